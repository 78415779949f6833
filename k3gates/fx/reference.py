"""The math the fx kernels implement, in float64 numpy and exact Python integers.

Written from the definitions, independent of kernels.py: nothing here knows about Q formats,
tables or Newton steps. The integer primitives' references use Python's unbounded integers, so
they are exact; the nonlinear functions use float64, whose relative error (about 2^-53) is far
below the 2^-10 LSB margin of every bound at the magnitudes the gates test.
"""

from __future__ import annotations

import math

import numpy as np


# -- exact integer references ---------------------------------------------------------------------
def round_half_away(num: int, den: int) -> int:
    """num / den rounded to the nearest integer, ties away from zero (den > 0). Exact."""
    q, r = divmod(abs(num), den)
    if 2 * r >= den:
        q += 1
    return -q if num < 0 else q


def rshift_round(x: int, s: int) -> int:
    return round_half_away(x, 1 << s)


def mul_round(a: int, b: int, s: int) -> int:
    return round_half_away(a * b, 1 << s)


def div_round(n: int, d: int) -> int:
    return round_half_away(n, d)


def div_round_shift(n: int, d: int, s: int) -> int:
    return round_half_away(n << s, d)


def isqrt(n: int) -> int:
    return math.isqrt(n)


def narrow_int32(x: np.ndarray) -> tuple[np.ndarray, int]:
    lo, hi = -(2**31), 2**31 - 1
    return np.clip(x, lo, hi).astype(np.int32), int(np.count_nonzero((x < lo) | (x > hi)))


# -- float64 references ---------------------------------------------------------------------------
def value(raw: np.ndarray, frac: int | np.ndarray) -> np.ndarray:
    """The real number a fixed-point integer stands for: raw * 2**-frac."""
    return np.ldexp(np.asarray(raw, dtype=np.float64), -np.asarray(frac, dtype=np.int32))


def exp(x: np.ndarray) -> np.ndarray:
    return np.exp(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), evaluated on the side where e^-|x| cannot overflow."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rsqrt(x: np.ndarray) -> np.ndarray:
    return 1.0 / np.sqrt(x)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = w x / sqrt(mean(x^2) + eps) over the last axis (K3-SPEC section 4)."""
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(sum(x^2) + eps) over the last axis (fla's l2norm, K3-SPEC section 1)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def turns(phase: np.ndarray, bits: int) -> np.ndarray:
    """A phase of `bits` bits as a fraction of a turn in [0, 1) (the phase is taken mod 2^bits)."""
    p = np.asarray(phase, dtype=np.int64) & np.int64((1 << bits) - 1)
    return np.ldexp(p.astype(np.float64), -bits)


def sin_turns(phase: np.ndarray, bits: int) -> np.ndarray:
    return np.sin(2.0 * np.pi * turns(phase, bits))


def cos_turns(phase: np.ndarray, bits: int) -> np.ndarray:
    return np.cos(2.0 * np.pi * turns(phase, bits))
