"""Integer math foundations: the library face. Float in, float out; integers in between.

Each function quantises its float input at the boundary (ties away from zero, the kernels'
convention), calls the integer kernel in k3gates.fx.kernels, and returns float64 holding the
kernel's exact fixed-point output. Its error against the exact function of the *quantised* input
is the kernel's bound: 513/1024 LSB of the output format named below.

    sigmoid(x)           any finite x; quantised to Q.40 (|x| >= 64 saturates: Q0.31 1 or 0)
    tanh(x)              any finite x; quantised to Q.40 (|x| >= 32 saturates to +-1)
    exp(x)               finite x <= 0 (ValueError for x > 0); Q.40 in, Q0.31 out (x < -64 -> 0)
    silu(x)              finite |x| < 2^37; Q.24 in and out (bound proven for |x| < 2^12)
    rsqrt(x)             finite x > 0 (ValueError otherwise); exact float input, relative
                         error < 2^-38 (each result is held with 38-39 significant bits)
    softmax(x, axis=-1)  finite |x| < 2^28; Q.32 in, Q0.31 out; bound proven for rows <= 2^20
    rmsnorm(x, w, eps)   w * x / sqrt(mean(x^2) + eps) over the last axis; formats chosen per
                         call (x with 30 significant bits) so nothing overflows
    l2norm(x, eps)       x / sqrt(sum(x^2) + eps) over the last axis, output Q0.31

Every function raises ValueError, saying what was expected, for NaN or infinite input, for a
value outside its domain, and for shapes that do not fit.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ..infra import compile as _compile
from . import host

KERNELS = "k3gates.fx.kernels"
FRAC_IN = 40  # sigmoid, tanh, exp: input resolution 2^-40
SILU_FRAC = 24
SOFTMAX_FRAC = 32
OUT_FRAC = 31  # Q0.31 outputs
SILU_MAX_ABS = 2.0**37  # |x| 2^24 must stay below 2^62 (x * sigma)
SOFTMAX_MAX_ABS = 2.0**28  # |x| 2^32 < 2^61 keeps every difference x - max below 2^62
RSQRT_OUT_BITS = 38  # rsqrt results are formed with 38..39.5 significant bits (< 2^40 raw)


def _kernels():
    return _compile.load(KERNELS)


def _finite(x: object, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        what = type(x).__name__
        raise ValueError(f"{name}: expected an array of real numbers, got {what}") from e
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    return a


def quantize(x: np.ndarray, frac: int | np.ndarray) -> np.ndarray:
    """round(x * 2**frac) as int64, ties away from zero; the caller keeps it below 2**63."""
    y = np.ldexp(x, np.asarray(frac, dtype=np.int32))
    t = np.trunc(y)
    return (t + np.where(np.abs(y - t) >= 0.5, np.sign(y), 0.0)).astype(np.int64)


def value(raw: np.ndarray, frac: int | np.ndarray) -> np.ndarray:
    """The float64 a fixed-point integer stands for: raw * 2**-frac (exact below 2**53)."""
    return np.ldexp(raw.astype(np.float64), -np.asarray(frac, dtype=np.int32))


def _elementwise(kernel: str, x: np.ndarray, frac: int, out_frac: int) -> np.ndarray:
    q = quantize(x.ravel(), frac)
    return value(getattr(_kernels(), kernel)(q, frac), out_frac).reshape(x.shape)


def sigmoid(x: object) -> np.ndarray:
    """1 / (1 + e^-x), through sigmoid_q31: Q.40 in, Q0.31 out."""
    a = np.clip(_finite(x, "x"), -64.0, 64.0)
    return _elementwise("sigmoid_q31_array", a, FRAC_IN, OUT_FRAC)


def tanh(x: object) -> np.ndarray:
    """tanh(x), through tanh_q31: Q.40 in, Q0.31 out."""
    a = np.clip(_finite(x, "x"), -32.0, 32.0)
    return _elementwise("tanh_q31_array", a, FRAC_IN, OUT_FRAC)


def exp(x: object) -> np.ndarray:
    """e^x for x <= 0, through exp_q31: Q.40 in, Q0.31 out. x > 0 raises ValueError."""
    a = _finite(x, "x")
    if a.size and a.max() > 0:
        raise ValueError(f"x: exp is defined here for x <= 0 only, got {float(a.max())!r}")
    return _elementwise("exp_q31_array", np.maximum(a, -64.0), FRAC_IN, OUT_FRAC)


def silu(x: object) -> np.ndarray:
    """x * sigma(x), through silu_q in Q.24 (input and output)."""
    a = _finite(x, "x")
    if a.size and np.abs(a).max() >= SILU_MAX_ABS:
        raise ValueError(f"x: silu accepts |x| < 2^37, got {float(np.abs(a).max())!r}")
    return _elementwise("silu_array", a, SILU_FRAC, SILU_FRAC)


def rsqrt(x: object) -> np.ndarray:
    """1 / sqrt(x) for x > 0, through rsqrt_q; x <= 0 raises ValueError.

    Each float is split exactly as m * 2^E (m a 53-bit integer), so the kernel sees the exact
    input; the output format is chosen per element so the result has 2^38..2^39.5 raw.
    """
    a = _finite(x, "x")
    if a.size and a.min() <= 0:
        raise ValueError(f"x: rsqrt needs x > 0, got {float(a.min())!r}")
    m, e = np.frexp(a.ravel())  # a = m 2^e, m in [1/2, 1)
    raw = np.ldexp(m, 53).astype(np.int64)
    frac_in = (53 - e).astype(np.int64)
    frac_out = (RSQRT_OUT_BITS + (e + 1) // 2).astype(np.int64)  # 1/sqrt(a) in (2^-(e/2), ...]
    out = _kernels().rsqrt_array(raw, frac_in, frac_out)
    return value(out, frac_out).reshape(a.shape)


def softmax(x: object, axis: int = -1) -> np.ndarray:
    """softmax along `axis`, through softmax_q31: Q.32 in, Q0.31 out."""
    a = _finite(x, "x")
    if a.ndim == 0:
        raise ValueError("x: softmax needs at least one axis, got a scalar")
    if a.size and np.abs(a).max() >= SOFTMAX_MAX_ABS:
        raise ValueError(f"x: softmax accepts |x| < 2^28, got {float(np.abs(a).max())!r}")
    moved = np.moveaxis(a, axis, -1)
    if moved.shape[-1] == 0:
        raise ValueError("x: softmax over an empty axis")
    rows = np.ascontiguousarray(quantize(moved.reshape(-1, moved.shape[-1]), SOFTMAX_FRAC))
    p = value(_kernels().softmax_q31(rows, SOFTMAX_FRAC), OUT_FRAC)
    return np.moveaxis(p.reshape(moved.shape), -1, axis)


def _top_exponent(a: np.ndarray) -> int:
    """The least E with max|a| < 2^E (0 for an all-zero array)."""
    top = float(np.abs(a).max()) if a.size else 0.0
    return int(np.frexp(top)[1]) if top > 0 else 0


def _norm_formats(x: np.ndarray, eps: float, eps_count: int) -> tuple[int, int, int]:
    """(fx, acc_shift, eps_raw) for the norm kernels.

    x gets 30 significant bits (|x_raw| < 2^30); acc_shift is the least k for which the rounded
    sum of squares / 2^k and eps_count * eps_raw each stay below 2^60, so their sum fits int64.
    (These are format choices, so estimating the sum in float64 with a factor-2 margin is fine.)
    """
    fx = 30 - _top_exponent(x)
    rows = x.reshape(-1, x.shape[-1])
    biggest = 2.0 * float(np.max(np.sum(np.ldexp(rows, fx) ** 2, axis=-1))) + 1.0
    # the shift is a kernel input: ceil(log2 .) exactly (host.py), not by the CPU's log2
    k = max(0, host.ceil_log2(biggest) - 60)
    if eps > 0:
        k = max(k, 2 * fx + host.ceil_log2(eps_count * Fraction(eps)) - 60)
    return fx, k, int(quantize(np.float64(eps), 2 * fx - k))


def _rows(x: object, name: str) -> np.ndarray:
    a = _finite(x, name)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"{name}: expected an array with a non-empty last axis, got {a.shape}")
    return a


def rmsnorm(x: object, w: object, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x^2) + eps) over the last axis, through the integer rmsnorm kernel.

    x is quantised with 30 significant bits (a power-of-two scale from its largest magnitude),
    w to |w_raw| <= 2^31, the output to |y_raw| < 2^38 (the bound's domain); when the exact sum
    of squares would not fit int64, the squares are rounded before summing (acc_shift), which
    costs at most n / (4 acc) relative. eps must be finite and >= 0; w must have the length of
    x's last axis. The result is accurate to about 2^-29 relative to the row's largest output.
    """
    a = _rows(x, "x")
    wv = _finite(w, "w")
    n = a.shape[-1]
    if wv.shape != (n,):
        raise ValueError(f"w: expected shape ({n},) to match x's last axis, got {wv.shape}")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite eps >= 0, got {eps!r}")
    fx, k, eps_raw = _norm_formats(a, float(eps), n)
    ew = _top_exponent(wv)
    fw = 31 - ew
    fy = 38 - (ew + (n.bit_length() + 1) // 2)  # |y| <= |w| sqrt(n)
    rows = np.ascontiguousarray(quantize(a.reshape(-1, n), fx))
    y = _kernels().rmsnorm(rows, quantize(wv, fw), eps_raw, fx, fw, fy, k)
    return value(y, fy).reshape(a.shape)


def l2norm(x: object, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (K3's q, k normalisation), output Q0.31.

    Formats as in rmsnorm: x with 30 significant bits, squares rounded before the sum only when
    the exact sum would not fit.
    """
    a = _rows(x, "x")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite eps >= 0, got {eps!r}")
    fx, k, eps_raw = _norm_formats(a, float(eps), 1)  # eps is added once, not n times
    n = a.shape[-1]
    rows = np.ascontiguousarray(quantize(a.reshape(-1, n), fx))
    y = _kernels().l2norm(rows, eps_raw, fx, OUT_FRAC, k)
    return value(y, OUT_FRAC).reshape(a.shape)
