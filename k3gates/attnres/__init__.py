"""Block Attention Residuals (K3-SPEC.md section 3): the library face. Float in, float out;
integers in between.

    h, alpha = attnres(sources, w, eps=1e-6)      # h = sum_i alpha_i v_i, alpha = softmax_i(s_i)
    k = rms_keys(sources, eps=1e-6)               # k_i = v_i / sqrt(mean(v_i^2) + eps)
    dw = attnres_grad_w(sources, w, dh, eps=1e-6) # d(sum dh . h)/dw, summed over every token

sources [n, ..., d]: the n sources of each token (K3: the stored blocks, then the running prefix;
1 <= n <= 16), any number of token axes in between; w [d]: the pseudo-query (K3: norm_w * proj_w);
dh: the shape of h. Scores are s_i = k_i . w; alpha [n, ...] holds the weight of each source.

Quantisation (ties away from zero): sources with 30 significant bits, Q.fv with fv = 30 - E where
E is the least integer with max|v| < 2^E (lowered so that eps 2^(2 fv) < 2^61); w with 31 bits
(fw = 31 - E_w); dh with 30 bits. The results are exact fixed-point values: h in Q.fv, alpha in
Q0.31, keys in Q.(40 - ceil(log2 sqrt d)), dw in a Q.fd the kernel picks so that its worst case,
sum over tokens of 2 max_i |dh . v_i| sqrt(d), fits 2^32. Against the exact function of the
quantised inputs each is within 513/1024 LSB of its format (for dw with n T <= 2^14; beyond, add
n T 2^-29 LSB). dw is therefore accurate to about 2^-33 of that worst case: when the weights are
nearly one-hot, dw itself can be far smaller than the worst case, and its relative accuracy lower.

Domain, else ValueError naming the argument: finite values; |sources| < 2^30; 1 <= n <= 16;
w of shape (d,) with sqrt(d) ||w||_2 < 511 (every score |s_i| < 511, inside the kernels' 2^9);
eps finite and >= 0; dh of h's shape with |dh| < 2^30.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..fx import host, quantize, value
from ..infra import compile as _compile
from .kernels import MAX_SOURCES

KERNELS = "k3gates.attnres.kernels"
V_BITS = 30  # sources and dh: |raw| < 2^30
W_BITS = 31  # w: |raw| < 2^31
KEY_BITS = 40  # keys: |raw| < 2^40, the key bound's domain
EPS_RAW_BITS = 61  # eps 2^(2 fv) < 2^61
MAX_SCORE = 511.0  # sqrt(d) ||w|| < 511 keeps every |score| below the kernels' 2^9
MAX_ABS = 2.0**30


def _kernels():
    return _compile.load(KERNELS)


def _array(x: object, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name}: expected an array of real numbers, got {type(x).__name__}"
        ) from e
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    if a.size and np.abs(a).max() >= MAX_ABS:
        raise ValueError(f"{name}: expected |{name}| < 2^30, got {float(np.abs(a).max())!r}")
    return a


def _top_exponent(a: np.ndarray) -> int:
    """The least E with max|a| < 2^E (0 for an all-zero array)."""
    top = float(np.abs(a).max()) if a.size else 0.0
    return int(np.frexp(top)[1]) if top > 0 else 0


def _sources(sources: object, eps: float) -> tuple[np.ndarray, int, int]:
    """(v [n, T, d] int64 in Q.fv, fv, eps_raw) from sources [n, ..., d]."""
    a = _array(sources, "sources")
    if a.ndim < 2 or a.shape[0] == 0 or a.shape[-1] == 0:
        raise ValueError(f"sources: expected shape [n, ..., d] with n, d >= 1, got {a.shape}")
    if a.shape[0] > MAX_SOURCES:
        raise ValueError(f"sources: expected at most {MAX_SOURCES} sources, got {a.shape[0]}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite eps >= 0, got {eps!r}")
    fv = V_BITS - _top_exponent(a)
    if eps > 0:
        # floor((EPS_RAW_BITS - log2 eps) / 2), exactly: the format is a kernel input
        fv = min(fv, host.floor_log2(Fraction(2**EPS_RAW_BITS) / Fraction(eps)) // 2)
    v = quantize(a.reshape(a.shape[0], -1, a.shape[-1]), fv)
    return np.ascontiguousarray(v), fv, int(quantize(np.float64(eps), 2 * fv))


def _query(w: object, d: int) -> tuple[np.ndarray, int]:
    wv = _array(w, "w")
    if wv.shape != (d,):
        raise ValueError(
            f"w: expected shape ({d},) to match the sources' last axis, got {wv.shape}"
        )
    size = math.sqrt(d) * float(np.linalg.norm(wv))
    if size >= MAX_SCORE:
        raise ValueError(f"w: expected sqrt(d) ||w|| < 511 (scores below 2^9), got {size!r}")
    fw = W_BITS - _top_exponent(wv)
    return quantize(wv, fw), fw


def attnres(sources: object, w: object, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """(h [..., d], alpha [n, ...]): Block AttnRes of each token's n sources, as float64."""
    v, fv, eps_raw = _sources(sources, eps)
    shape = np.shape(sources)
    wq, fw = _query(w, shape[-1])
    h, alpha, _ = _kernels().attnres_forward(v, wq, eps_raw, fv, fw)
    return value(h, fv).reshape(shape[1:]), value(alpha.T, 31).reshape(shape[:-1])


def rms_keys(sources: object, eps: float = 1e-6) -> np.ndarray:
    """k_i = v_i / sqrt(mean(v_i^2) + eps) for every source of every token (no norm weight)."""
    v, fv, eps_raw = _sources(sources, eps)
    fk = KEY_BITS - (np.shape(sources)[-1].bit_length() + 1) // 2  # |k| <= sqrt(d)
    return value(_kernels().attnres_keys(v, eps_raw, fv, fk), fk).reshape(np.shape(sources))


def attnres_grad_w(sources: object, w: object, dh: object, eps: float = 1e-6) -> np.ndarray:
    """dL/dw [d] for L = sum over tokens of dh . h, h = attnres(sources, w, eps)[0]."""
    v, fv, eps_raw = _sources(sources, eps)
    shape = np.shape(sources)
    wq, fw = _query(w, shape[-1])
    g = _array(dh, "dh")
    if g.shape != tuple(shape[1:]):
        raise ValueError(f"dh: expected the shape of h, {tuple(shape[1:])}, got {g.shape}")
    fg = V_BITS - _top_exponent(g)
    gq = np.ascontiguousarray(quantize(g.reshape(-1, shape[-1]), fg))
    dw, fd = _kernels().attnres_grad_w(v, wq, gq, eps_raw, fv, fw, fg)
    return value(dw, fd)
