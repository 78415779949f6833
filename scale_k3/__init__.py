"""The `--scale k3` gate set: gates at K3's true dimensions, outside the default build.

`python build.py --scale k3` adds this package to the build's gate packages. Each gate here needs
more than the default build's budgets (memory and minutes); the README says what.
"""
