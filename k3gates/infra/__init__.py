"""The infrastructure: the gate API and what finds, compiles, runs, audits and records gates.

It imports no kernel.
"""
