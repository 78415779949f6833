"""K3-μ Gated MLA (NoPE): the Python face. It only orders arguments and calls the kernels
(k3gates/mla/kernels_train.py); no arithmetic on values happens here.

Sizes (K3-SPEC.md section 2 at K3-μ scale): H = 2 heads, q_lora = kv_lora = 32, nope 32, the shared
unrotated "rope" key part 16, dv 32. The kernels read every size from the weight shapes
(rope = rows(w_kr), H = (rows(w_uq) - rows(w_uk)) / rope, nope = rows(w_uk) / H,
dv = rows(w_uv) / H), so the constants below are only used to build the shapes.
"""

from __future__ import annotations

import numpy as np

from ..fx import host

N_HEADS = 2


# Sizes follow the width (K3-μ's d = 64: 32, 32, 32, 16, 32), so a narrow model can be run
# interpreted in a test. rope: NoPE, the "rope" part of the key is shared by the heads and
# never rotated.
def q_lora(d: int) -> int:
    return d // 2


kv_lora = nope = dv = q_lora


def rope(d: int) -> int:
    return d // 4


# name, shape as a function of the model width d, optimiser. Per-Head Muon slices multi-head
# matrices by heads on rows (axis 0: w_uq, w_uk, w_uv, w_g) or on columns (axis 1: w_o).
PARAMS = [
    ("w_dq", lambda d: (q_lora(d), d), ("muon", 1, 0)),
    ("q_norm", lambda d: (q_lora(d),), ("adamw",)),
    ("w_uq", lambda d: (N_HEADS * (nope(d) + rope(d)), q_lora(d)), ("muon", N_HEADS, 0)),
    ("w_dkv", lambda d: (kv_lora(d), d), ("muon", 1, 0)),
    ("kv_norm", lambda d: (kv_lora(d),), ("adamw",)),
    ("w_kr", lambda d: (rope(d), d), ("muon", 1, 0)),
    ("w_uk", lambda d: (N_HEADS * nope(d), kv_lora(d)), ("muon", N_HEADS, 0)),
    ("w_uv", lambda d: (N_HEADS * dv(d), kv_lora(d)), ("muon", N_HEADS, 0)),
    ("w_g", lambda d: (N_HEADS * dv(d), d), ("muon", N_HEADS, 0)),
    ("w_o", lambda d: (d, N_HEADS * dv(d)), ("muon", N_HEADS, 1)),
]
WEIGHTS = [name for name, _shape, _opt in PARAMS]  # the kernels' argument order


class DomainError(ValueError):
    """An internal value left the domain the kernels' int64 headroom is proven for."""


def init(rng: np.random.Generator, d: int) -> dict[str, np.ndarray]:
    """Float64 initial values: matrices N(0, 1/fan_in), norm gains 1; w_o at half scale so the
    fresh layer adds a modest update to the residual stream."""
    p: dict[str, np.ndarray] = {}
    for name, shape_fn, _opt in PARAMS:
        shape = shape_fn(d)
        if len(shape) == 1:
            p[name] = np.ones(shape)
        else:
            p[name] = rng.normal(0.0, host.inv_sqrt(shape[1]), shape)
    p["w_o"] = p["w_o"] * 0.5
    return p


def _args(p: dict) -> list[np.ndarray]:
    return [np.ascontiguousarray(p[name], dtype=np.int64) for name in WEIGHTS]


def forward(mod, x: np.ndarray, p: dict, t0: int = 0) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] Q.16 from x [B, T, d] Q.16 and Q.20 weights, with the queries at rows t0..
    only (y is 0 above them); the cache holds the kernel's intermediates (formats:
    mla.kernels_train docstring)."""
    out = mod.mla_forward(np.ascontiguousarray(x, dtype=np.int64), int(t0), *_args(p))
    if int(out[-1]):
        raise DomainError(
            f"mla.kernels_train.mla_forward: {int(out[-1])} internal values beyond |2^7| (Q.24 "
            f"domain), or T = {x.shape[1]} beyond mla.kernels_train.FORWARD_MAX_T"
        )
    return out[0], tuple(out[1:-1])


def backward(mod, dy, x, p, cache) -> tuple[np.ndarray, dict]:
    """dx [B, T, d] Q.24 and every parameter's gradient (Q.24, summed over all tokens)."""
    t0 = x.shape[1] - cache[3].shape[1]  # the forward's query rows: cache[3] is q [B, R, .]
    out = mod.mla_backward(
        np.ascontiguousarray(dy, dtype=np.int64),
        np.ascontiguousarray(x, dtype=np.int64),
        t0,
        *_args(p),
        *cache,
    )
    if int(out[-1]):
        raise DomainError(
            f"mla.kernels_train.mla_backward: {int(out[-1])} internal gradients beyond |2^7| "
            f"(Q.24) or T = {x.shape[1]} beyond mla.kernels_train.BACKWARD_MAX_T"
        )
    return out[0], dict(zip(WEIGHTS, out[1:-1], strict=True))
