"""Stable LatentMoE + Quantile Balancing (K3-SPEC.md section 4): the library face.

Float64 in, float64 out; integers in between (k3gates.moe.kernels).

    idx, w = route(x, w_router, bias, k, routed_scaling_factor=1.0)
    y = layer(x, weights, bias, k, routed_scaling_factor=1.0, eps=1e-6)
    new_bias = qb_update(x, w_router, bias, k)

`weights` is a `MoEWeights` (or a mapping with its field names): the router [n, d], W_down
[d_l, d], the experts' w1, w3 [n, f, d_l] and w2 [n, d_l, f], the latent RMSNorm weight [d_l],
W_up [d, d_l], and the shared expert's w1, w3 [f_s, d] and w2 [d, f_s]; x is [T, d].

Formats at the boundary (ties away from zero): x, every weight and routed_scaling_factor in Q.24,
the bias in Q.40, eps in Q.56. The results are the kernels' exact outputs: y in Q.24 (within
layer_bound_q10(d_l, k) / 1024 LSB of the exact layer on the quantised inputs and the same
routing, in the domain the kernels' docstring states), the routing weights in Q.56, the new bias
in Q.40. The top-k tie-break: equal biased scores go to the lower expert index. The bias changes
which experts are chosen, never their weights.

Every function raises ValueError, naming the argument and saying what was expected, for NaN or
infinite values, wrong ranks or shapes, k out of range, and for inputs whose worst-case
magnitudes (from |x| and the weights' row L1 norms) could overflow the integer formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from . import kernels as _k

KERNELS = "k3gates.moe.kernels"
MAGNITUDE_LIMIT = 2.0**13  # every worst-case activation stays below this (int64 holds 2^14)
BIAS_LIMIT = 2.0**20
MAX_EPS = 2.0**-8  # n eps < 2^6 keeps n eps 2^56 below 2^62 for widths up to 2^14
SITU_MAX = 100.0  # |SiTU-GLU| <= beta beta_lin


@dataclass(frozen=True)
class MoEWeights:
    """The layer's weights (float64 arrays; quantised to Q.24 at the boundary)."""

    w_router: np.ndarray  # [n, d]   s = sigma(W_r x)
    w_down: np.ndarray  # [d_l, d]   z = W_down x
    w1: np.ndarray  # [n, f, d_l]    gate input of each expert's SiTU-GLU
    w3: np.ndarray  # [n, f, d_l]    linear input
    w2: np.ndarray  # [n, d_l, f]    expert output
    norm_w: np.ndarray  # [d_l]      the latent RMSNorm's weight (|w| < 4)
    w_up: np.ndarray  # [d, d_l]     back to the hidden width
    shared_w1: np.ndarray  # [f_s, d]
    shared_w3: np.ndarray  # [f_s, d]
    shared_w2: np.ndarray  # [d, f_s]


def _kernels():
    return _compile.load(KERNELS)


def _array(a: object, name: str, ndim: int) -> np.ndarray:
    try:
        v = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name}: expected an array of real numbers, got {type(a).__name__}"
        ) from e
    if v.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    return v


def _shape(v: np.ndarray, name: str, want: tuple[int, ...]) -> None:
    if v.shape != want:
        raise ValueError(f"{name}: expected shape {want}, got {v.shape}")


def _row_l1(w: np.ndarray) -> float:
    return float(np.abs(w).sum(axis=-1).max()) if w.size else 0.0


def _limit(what: str, bound: float) -> None:
    if bound >= MAGNITUDE_LIMIT:
        raise ValueError(
            f"{what}: the worst-case magnitude {bound:.4g} (from |x| and the weights' row L1 "
            f"norms) would reach 2^13; scale the inputs or weights down"
        )


def _k_checked(k: object, n: int, strict: bool) -> int:
    top = min(n - 1 if strict else n, _k.MAX_TOPK)
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= top:
        need = "k < n" if strict else "k <= n"
        raise ValueError(
            f"k: expected an integer 1 <= k <= {top} ({need}, and at most 31), got {k!r}"
        )
    return int(k)


def _rsf(rsf: object) -> int:
    if not isinstance(rsf, (int, float, np.floating, np.integer)) or not 0 < rsf < 64:
        raise ValueError(f"routed_scaling_factor: expected a number in (0, 64), got {rsf!r}")
    return int(quantize(np.float64(rsf), _k.W_FRAC))


def _router_inputs(x, w_router, bias):
    xv = _array(x, "x", 2)
    wr = _array(w_router, "w_router", 2)
    _shape(wr, "w_router", (wr.shape[0], xv.shape[1]))
    if wr.shape[0] < 2:
        raise ValueError(f"w_router: expected at least 2 experts, got {wr.shape[0]}")
    bv = _array(bias, "bias", 1)
    _shape(bv, "bias", (wr.shape[0],))
    if bv.size and np.abs(bv).max() >= BIAS_LIMIT:
        raise ValueError(f"bias: expected |bias| < 2^20, got {float(np.abs(bv).max())!r}")
    top = float(np.abs(xv).max()) if xv.size else 0.0
    _limit("router logits W_r x", top * _row_l1(wr))
    q = lambda a, frac: np.ascontiguousarray(quantize(a, frac))
    return q(xv, _k.X_FRAC), q(wr, _k.W_FRAC), q(bv, _k.S_FRAC), top


def route(
    x: object, w_router: object, bias: object, k: int, routed_scaling_factor: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(idx [T, k] int64, weights [T, k] float64): the top k of sigma(W_r x) + bias, by
    decreasing biased score (ties: the lower expert index), and their weights
    rsf s_e / sum s over the chosen set (exact Q.56 values)."""
    qx, qw, qb, _ = _router_inputs(x, w_router, bias)
    kk = _k_checked(k, qw.shape[0], strict=False)
    _, idx, wts = _kernels().router(qx, qw, qb, kk, _rsf(routed_scaling_factor))
    return idx, value(wts, _k.C_FRAC)


def qb_update(x: object, w_router: object, bias: object, k: int) -> np.ndarray:
    """One Quantile Balancing update on the batch x [m, d]: the new bias [n] (exact Q.40 values).

    c_i = token i's (k+1)-th largest biased score, margins m_ij = s_ij + b_j - c_i,
    q = floor(m k / n), b_j <- b_j - (the (q+1)-th largest margin in column j).
    """
    qx, qw, qb, _ = _router_inputs(x, w_router, bias)
    if qx.shape[0] < 1:
        raise ValueError("x: expected at least one token for the Quantile Balancing batch")
    kk = _k_checked(k, qw.shape[0], strict=True)
    s, _, _ = _kernels().router(qx, qw, qb, kk, 1 << _k.W_FRAC)
    return value(_kernels().qb_update(s, qb, kk), _k.S_FRAC)


def _weights(weights: MoEWeights | Mapping[str, object], n: int, d: int) -> dict[str, np.ndarray]:
    get = (
        (lambda f: weights[f]) if isinstance(weights, Mapping) else (lambda f: getattr(weights, f))
    )
    ranks = {"w1": 3, "w3": 3, "w2": 3, "norm_w": 1}
    try:
        w = {f.name: _array(get(f.name), f.name, ranks.get(f.name, 2)) for f in fields(MoEWeights)}
    except KeyError as e:
        raise ValueError(f"weights: missing {e.args[0]!r}") from None
    d_l, (f_w, f_s) = w["w_down"].shape[0], (w["w1"].shape[1], w["shared_w1"].shape[0])
    for name, want in (
        ("w_down", (d_l, d)), ("w1", (n, f_w, d_l)), ("w3", (n, f_w, d_l)), ("w2", (n, d_l, f_w)),
        ("norm_w", (d_l,)), ("w_up", (d, d_l)), ("shared_w1", (f_s, d)), ("shared_w3", (f_s, d)),
        ("shared_w2", (d, f_s)),
    ):  # fmt: skip
        _shape(w[name], name, want)
    return w


def _check_magnitudes(w: dict[str, np.ndarray], top_x: float, rsf: float) -> None:
    """Worst-case magnitudes of every activation (module docstring): each must stay below 2^13."""
    if w["norm_w"].size and np.abs(w["norm_w"]).max() >= 4:
        raise ValueError(f"norm_w: expected |norm_w| < 4, got {float(np.abs(w['norm_w']).max())!r}")
    z = top_x * _row_l1(w["w_down"])
    _limit("z = W_down x", z)
    _limit("the experts' inputs w1 z, w3 z", z * max(_row_l1(w["w1"]), _row_l1(w["w3"])))
    e_out = SITU_MAX * _row_l1(w["w2"])
    _limit("the combine sum_e w_e E_e", rsf * e_out)
    r = float(np.abs(w["norm_w"]).max()) * np.sqrt(w["norm_w"].size)
    _limit(
        "the shared expert's inputs", top_x * max(_row_l1(w["shared_w1"]), _row_l1(w["shared_w3"]))
    )
    _limit("y", _row_l1(w["w_up"]) * r + _row_l1(w["shared_w2"]) * SITU_MAX)


def layer(
    x: object,
    weights: MoEWeights | Mapping[str, object],
    bias: object,
    k: int,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-6,
) -> np.ndarray:
    """y = W_up RMSNorm(sum_e w_e E_e(W_down x)) + Shared(x) for each row of x, [T, d] float64."""
    w_router = weights["w_router"] if isinstance(weights, Mapping) else weights.w_router
    qx, qr, qb, top = _router_inputs(x, w_router, bias)
    n, d = qr.shape
    kk = _k_checked(k, n, strict=False)
    rsf = _rsf(routed_scaling_factor)
    if not isinstance(eps, (int, float)) or not 0 <= eps <= MAX_EPS:
        raise ValueError(f"eps: expected a number in [0, 2^-8], got {eps!r}")
    w = _weights(weights, n, d)
    _check_magnitudes(w, top, float(routed_scaling_factor))
    q = {name: np.ascontiguousarray(quantize(a, _k.W_FRAC)) for name, a in w.items()}
    kern = _kernels()
    _, idx, wts = kern.router(qx, qr, qb, kk, rsf)
    y, _, _, _ = kern.moe_layer(
        qx, idx, wts, q["w_down"], q["w1"], q["w3"], q["w2"], q["norm_w"],
        int(quantize(np.float64(eps), _k.EPS_FRAC)), q["w_up"], q["shared_w1"], q["shared_w3"],
        q["shared_w2"],
    )  # fmt: skip
    return value(y, _k.Y_FRAC)


__all__ = ["MoEWeights", "layer", "qb_update", "route"]
