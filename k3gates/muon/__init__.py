"""Per-Head Muon (K3-SPEC.md section 5): the library face. Float in, float out; integers between.

    O = newton_schulz5(G)                         # NS5 of a 2-D float64 matrix, same shape
    W, M = step(W, M, G, lr=0.02, momentum=0.95, weight_decay=0.1, heads=4, axis=0)
    Wq, Wk = qk_clip(Wq, Wk, s_max, heads=4)      # QK-Clip, tau = 100

newton_schulz5 quantises G with a power-of-two scale (|G| < 2^30 raw; NS5 does not depend on
the scale), runs the integer kernel (int16 Q1.14 iterates, int32 matmuls) and returns its exact
Q1.14 output: within 2^-7 of float64 NS5 of the same G for inputs the gates cover (rows or
columns <= 64, sigma_min / ||G||_F >= 0.05; measured about 10x tighter).

step is one Muon step with Nesterov momentum, Moonlight's lr 0.2 sqrt(max(A, B)) scaling and
decoupled weight decay; with heads > 1 the matrix is split into heads, by rows (axis 0: W_Q,
W_K, W_V) or by columns (axis 1: W_O), and NS5 runs on each head's slice independently (our
reading of "optimize attention heads independently"). W is held in Q.24; M and G share a
power-of-two format chosen from their magnitudes; lr, momentum and weight_decay are quantised to
Q.30. The returned W and M are the kernel's exact results for those quantised inputs.

Bad input (not a finite real 2-D array, shapes that disagree, heads not dividing the sliced
axis, hyper-parameters out of range) raises ValueError saying what was expected.
"""

from __future__ import annotations

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from .kernels import HYPER_FRAC, TRAIN_FRAC, X_FRAC

KERNELS = "k3gates.muon.kernels"
EPS = 1e-7  # KellerJordan/Muon's eps in G / (||G||_F + eps)
G_BITS = 30  # G is quantised so that its largest magnitude is in [2^29, 2^30)
MG_BITS = 40  # M and G of a step: their largest magnitude in [2^39, 2^40)
W_MAX = 2.0**37  # |W| 2^24 must stay well inside int64
MAX_ELEMENTS = 1 << 26  # the kernel's normalisation is analysed for m n <= 2^26
EPS_RAW_MAX = 2**31 - 1  # the kernel's eps domain


def _kernels():
    return _compile.load(KERNELS)


def _matrix(x: object, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name}: expected a 2-D array of real numbers, got {type(x).__name__}"
        ) from e
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"{name}: expected a non-empty 2-D array, got shape {a.shape}")
    if a.size > MAX_ELEMENTS:
        raise ValueError(f"{name}: expected at most 2^26 elements, got {a.size}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    return a


def _frac(top: float, bits: int) -> int:
    """The fraction bits that put a largest magnitude `top` > 0 in [2^(bits-1), 2^bits)."""
    return bits - int(np.frexp(top)[1])


def _eps_raw(eps: float, frac: int, name: str) -> int:
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite eps >= 0, got {eps!r}")
    raw = int(quantize(np.float64(eps), frac))
    if raw > EPS_RAW_MAX:
        raise ValueError(
            f"eps: {eps!r} is too large next to {name} (expected eps below about twice the "
            f"largest |{name}|)"
        )
    return raw


def newton_schulz5(G: object, eps: float = EPS) -> np.ndarray:
    """NS5(G) as float64 (exact Q1.14 values), G any finite 2-D float array (zeros give zeros)."""
    g = _matrix(G, "G")
    top = float(np.abs(g).max())
    if top == 0.0:
        return np.zeros_like(g)
    frac = _frac(top, G_BITS)
    out, _guard = _kernels().ns5(np.ascontiguousarray(quantize(g, frac)), _eps_raw(eps, frac, "G"))
    return value(out, X_FRAC)


def _hyper(name: str, v: float, low: float, high: float, high_open: bool = False) -> int:
    if not np.isfinite(v) or v < low or v > high or (high_open and v == high):
        side = ")" if high_open else "]"
        raise ValueError(f"{name}: expected a value in [{low:g}, {high:g}{side}, got {v!r}")
    return int(quantize(np.float64(v), HYPER_FRAC))


def _layout(shape: tuple[int, int], heads: int, axis: int) -> None:
    if axis not in (0, 1):
        raise ValueError(
            f"axis: expected 0 (heads are rows) or 1 (heads are columns), got {axis!r}"
        )
    if not isinstance(heads, (int, np.integer)) or heads < 1 or shape[axis] % heads:
        raise ValueError(
            f"heads: expected a positive integer dividing W.shape[{axis}] = {shape[axis]}, "
            f"got {heads!r}"
        )


def step(
    W: object,
    M: object,
    G: object,
    *,
    lr: float = 0.02,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    nesterov: bool = True,
    heads: int = 1,
    axis: int = 0,
    eps: float = EPS,
) -> tuple[np.ndarray, np.ndarray]:
    """One (per-head) Muon step: returns (W_new, M_new) as float64.

    M <- momentum M + G; O = NS5(G + momentum M) (Nesterov; M itself when nesterov=False), per
    head slice; W <- W (1 - lr weight_decay) - lr 0.2 sqrt(max(A, B)) O with A x B the slice's
    shape. Requires 0 <= lr <= 1, 0 <= momentum < 1, lr weight_decay <= 1, |W| < 2^37.
    """
    w, m, g = _matrix(W, "W"), _matrix(M, "M"), _matrix(G, "G")
    if m.shape != w.shape or g.shape != w.shape:
        raise ValueError(f"M, G: expected the shape of W {w.shape}, got {m.shape} and {g.shape}")
    if np.abs(w).max() >= W_MAX:
        raise ValueError(f"W: expected |W| < 2^37, got {float(np.abs(w).max())!r}")
    _layout(w.shape, heads, axis)
    lr_q = _hyper("lr", lr, 0.0, 1.0)
    mu_q = _hyper("momentum", momentum, 0.0, 1.0, high_open=True)
    wd_q = _hyper("weight_decay", weight_decay, 0.0, 1.0 / max(lr, 2.0**-30))
    top = float(max(np.abs(m).max(), np.abs(g).max()))
    frac = _frac(top, MG_BITS) if top > 0 else 0
    w_new, m_new, _guard = _kernels().muon_step(
        np.ascontiguousarray(quantize(w, TRAIN_FRAC)),
        np.ascontiguousarray(quantize(m, frac)),
        np.ascontiguousarray(quantize(g, frac)),
        mu_q,
        lr_q,
        wd_q,
        int(bool(nesterov)),
        int(heads),
        axis,
        TRAIN_FRAC,
        _eps_raw(eps, frac, "G") if top > 0 else 0,
    )
    return value(w_new, TRAIN_FRAC), value(m_new, frac)


def qk_clip(
    Wq: object, Wk: object, s_max: object, *, heads: int, tau: float = 100.0
) -> tuple[np.ndarray, np.ndarray]:
    """QK-Clip (Kimi K2): head h's rows of W_Q and W_K times sqrt(min(1, tau / s_max[h])).

    Wq, Wk [heads d_h, d] with |W| < 64 (held in Q.24); s_max [heads] > 0 the heads' largest
    attention logits, tau > 0 (both held in Q.24, below 2^36). Heads with s_max <= tau come back
    unchanged.
    """
    wq, wk = _matrix(Wq, "Wq"), _matrix(Wk, "Wk")
    if wk.shape != wq.shape:
        raise ValueError(f"Wk: expected the shape of Wq {wq.shape}, got {wk.shape}")
    _layout(wq.shape, heads, 0)
    if max(np.abs(wq).max(), np.abs(wk).max()) >= 64.0:
        raise ValueError("Wq, Wk: expected |W| < 64")
    s = np.asarray(s_max, dtype=np.float64)
    if s.shape != (heads,) or not np.all(np.isfinite(s)) or s.min() <= 0 or s.max() >= 2.0**36:
        raise ValueError(f"s_max: expected {heads} finite values in (0, 2^36), got {s_max!r}")
    if not np.isfinite(tau) or tau <= 0 or tau >= 2.0**36:
        raise ValueError(f"tau: expected a finite value in (0, 2^36), got {tau!r}")
    cq, ck, _ = _kernels().qk_clip(
        np.ascontiguousarray(quantize(wq, TRAIN_FRAC)),
        np.ascontiguousarray(quantize(wk, TRAIN_FRAC)),
        quantize(s, TRAIN_FRAC),
        int(quantize(np.float64(tau), TRAIN_FRAC)),
        int(heads),
    )
    return value(cq, TRAIN_FRAC), value(ck, TRAIN_FRAC)
