"""Independent references for the integer GEMM, written from the definition C = A B^T.

Two kinds, neither sharing code with kernels.py:
- Python's unbounded integers (`numpy` object arrays): exact for any input, slow, for small
  shapes and for gemm_i64, whose sums need up to 126 bits outside its domain.
- float64 BLAS: A B^T of integer matrices is exact in float64 whenever every partial sum is an
  integer below 2^53 in magnitude, which K max|A| max|B| <= 2^53 guarantees in any summation
  order. For int16 operands that is K <= 2^23 (products <= 2^30); `exact_in_f64` states it.
"""

from __future__ import annotations

import numpy as np

I32_MAX = 2**31 - 1
F64_EXACT = 2**53  # every integer of magnitude <= 2^53 is a float64


def exact_in_f64(a: np.ndarray, b: np.ndarray) -> bool:
    """True when float64 A B^T is exact: K max|A| max|B| <= 2^53 (Python integers)."""
    top_a = int(np.max(np.abs(a.astype(object)))) if a.size else 0
    top_b = int(np.max(np.abs(b.astype(object)))) if b.size else 0
    return a.shape[1] * top_a * top_b <= F64_EXACT


def gemm_f64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A B^T in float64 (BLAS dgemm); raises ValueError where it would not be exact."""
    if not exact_in_f64(a, b):
        raise ValueError("gemm_f64: K max|A| max|B| > 2^53, float64 would round")
    return a.astype(np.float64) @ b.astype(np.float64).T


def gemm_int(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A B^T in Python integers (object array [M, N]): exact for any integer input."""
    return a.astype(object) @ b.astype(object).T


def sat32(c: np.ndarray) -> tuple[np.ndarray, int]:
    """(c clamped to [-(2^31 - 1), 2^31 - 1] as int64, how many values were clamped)."""
    big = np.abs(c) > I32_MAX
    return np.clip(c, -I32_MAX, I32_MAX).astype(np.int64), int(np.count_nonzero(big))


def round_shift(x: int, s: int) -> int:
    """x / 2^s rounded to nearest, ties away from zero (Python integers, by divmod)."""
    if s == 0:
        return x
    q, r = divmod(abs(x), 1 << s)
    q += 1 if 2 * r >= (1 << s) else 0
    return q if x >= 0 else -q


def i64_domain(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [M, N]: the pairs of rows gemm_i64 promises to compute (its Hoelder domain): every
    element below 2^62 in magnitude and min(|a|_1 |b|_inf, |a|_inf |b|_1) < 2^62."""
    ao, bo = np.abs(a.astype(object)), np.abs(b.astype(object))
    l1a, l1b = ao.sum(axis=1), bo.sum(axis=1)
    infa = ao.max(axis=1) if a.shape[1] else np.zeros(a.shape[0], dtype=object)
    infb = bo.max(axis=1) if b.shape[1] else np.zeros(b.shape[0], dtype=object)
    ok = np.zeros((a.shape[0], b.shape[0]), dtype=bool)
    for i in range(a.shape[0]):
        for j in range(b.shape[0]):
            small = infa[i] < 2**62 and infb[j] < 2**62
            bound = min(l1a[i] * infb[j], infa[i] * l1b[j])
            ok[i, j] = small and bound < 2**62
    return ok


def gemm_i64(a: np.ndarray, b: np.ndarray, shift: int) -> tuple[list[int], int]:
    """(round_shift(A B^T, shift) flattened, 0 outside the domain; pairs outside), exactly."""
    c = gemm_int(a, b)
    ok = i64_domain(a, b)
    flat = [
        round_shift(int(v), shift) if inside else 0
        for v, inside in zip(c.ravel().tolist(), ok.ravel().tolist(), strict=True)
    ]
    return flat, int(ok.size - np.count_nonzero(ok))


def sum_outer(g: np.ndarray, a: np.ndarray, shift: int) -> list[int]:
    """round_shift(G^T A, shift) flattened, for G [R, P], A [R, Q], in Python integers."""
    c = g.astype(object).T @ a.astype(object)
    return [round_shift(int(v), shift) for v in c.ravel().tolist()]
