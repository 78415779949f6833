"""Central differences: is a float64 reference backward the derivative of its own loss?"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def worst_relative_error(
    loss: Callable[..., float],
    x: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    rng: np.random.Generator,
    *,
    per_input: int = 4,
    eps: float = 1e-6,
    floor: float = 1e-3,
) -> tuple[float, int]:
    """At `per_input` seeded coordinates of each grads[name] (shaped like x[name]), the central
    difference (loss(x + eps e_i) - loss(x - eps e_i)) / 2 eps against the analytic value:
    (the largest |difference| / max(|analytic|, floor), the number of coordinates)."""
    worst, n = 0.0, 0
    for name, g in grads.items():
        for flat in rng.choice(g.size, per_input, replace=False):
            idx = np.unravel_index(flat, g.shape)
            up, down = x[name].copy(), x[name].copy()
            up[idx] += eps
            down[idx] -= eps
            fd = (loss(**{**x, name: up}) - loss(**{**x, name: down})) / (2 * eps)
            worst = max(worst, abs(fd - g[idx]) / max(abs(g[idx]), floor))
            n += 1
    return worst, n
