"""The Python face of kernels.py: K3-μ's Gated MLA layer with its queries at rows t0.. only.
It orders arguments and calls the kernels; no arithmetic on values happens here. The weights,
their shapes and their initialisation are K3-μ's (k3gates/k3mu/layer_mla.py)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from ..k3mu.layer_mla import WEIGHTS, DomainError


def _args(p: dict) -> list[np.ndarray]:
    return [np.ascontiguousarray(p[name], dtype=np.int64) for name in WEIGHTS]


def forward(mod: ModuleType, x: np.ndarray, p: dict, t0: int) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] Q.16 (0 at rows < t0) from x [B, T, d] Q.16 and Q.20 weights."""
    out = mod.mla_rows_forward(np.ascontiguousarray(x, dtype=np.int64), int(t0), *_args(p))
    if int(out[-1]):
        raise DomainError(
            f"passkey kernels.mla_rows_forward: {int(out[-1])} values outside the domain "
            f"(T = {x.shape[1]})"
        )
    return out[0], (int(t0), *out[1:-1])


def backward(mod: ModuleType, dy: np.ndarray, x: np.ndarray, p: dict,
             cache: tuple) -> tuple[np.ndarray, dict]:  # fmt: skip
    """dx [B, T, d] Q.24 and every weight's gradient (Q.24, summed over all tokens)."""
    t0, *rest = cache
    out = mod.mla_rows_backward(
        np.ascontiguousarray(dy, dtype=np.int64),
        np.ascontiguousarray(x, dtype=np.int64),
        t0,
        *_args(p),
        *rest,
    )
    if int(out[-1]):
        raise DomainError(
            f"passkey kernels.mla_rows_backward: {int(out[-1])} values outside the domain "
            f"(T = {x.shape[1]})"
        )
    return out[0], dict(zip(WEIGHTS, out[1:-1], strict=True))
