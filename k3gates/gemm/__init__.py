"""The shared integer GEMM: the library face. C = A B^T, both operands [rows, K] with K contiguous.

    C, sat = gemm_i16(A, B)            # int16 [M, K], int16 [N, K] -> int32 [M, N], clamp count
    C = gemm_i64(A, B, shift)          # int64 -> int64, rshift_round(A B^T, shift), exact
    Y = matmul_nt(X, W)                # float X [M, K], W [N, K] -> float64 X W^T, through int16

gemm_i16 and gemm_i64 are the raw kernels, with their arguments checked: exact, see
k3gates/gemm/kernels.py for formats, the int32 path's Cauchy-Schwarz guard and gemm_i64's
domain. gemm_i64 raises ValueError when an output falls outside that domain (the kernel returns
0 there and counts it). matmul_nt quantises X and W each to int16 with a power-of-two scale
(largest magnitude in [2^14, 2^15)), multiplies exactly, and returns the exact product of the
quantised operands: within the operands' quantisation error of float64 X W^T, nothing more.

Bad input (not 2-D, K differing, a wrong dtype for the raw kernels, non-finite floats, a shift
outside 0..62) raises ValueError saying what was expected.
"""

from __future__ import annotations

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from .kernels import MAX_SHIFT

KERNELS = "k3gates.gemm.kernels"
Q_BITS = 15  # matmul_nt's operands: largest magnitude in [2^14, 2^15), so they fit int16


def _kernels():
    return _compile.load(KERNELS)


def _pair(a: object, b: object, dtype: type, what: str) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for name, x in (("A", a), ("B", b)):
        arr = np.asarray(x)
        if arr.dtype != dtype:
            raise ValueError(f"{what}: {name} must be {np.dtype(dtype).name}, got {arr.dtype}")
        if arr.ndim != 2:
            raise ValueError(f"{what}: {name} must be 2-D [rows, K], got shape {arr.shape}")
        out.append(np.ascontiguousarray(arr))
    if out[0].shape[1] != out[1].shape[1]:
        raise ValueError(
            f"{what}: A is [M, K] and B is [N, K] with the same K, got {out[0].shape} "
            f"and {out[1].shape}"
        )
    return out[0], out[1]


def gemm_i16(a: object, b: object) -> tuple[np.ndarray, int]:
    """(C int32 [M, N], sat): C = A B^T clamped to +-(2^31 - 1), sat = outputs clamped."""
    a16, b16 = _pair(a, b, np.int16, "gemm_i16")
    c, sat = _kernels().gemm_i16(a16, b16)
    return c, int(sat)


def gemm_i64(a: object, b: object, shift: int = 0) -> np.ndarray:
    """C int64 [M, N] = A B^T / 2^shift rounded half away from zero, exactly; ValueError when a
    pair of rows is outside the kernel's domain (see kernels.py)."""
    a64, b64 = _pair(a, b, np.int64, "gemm_i64")
    if not 0 <= int(shift) <= MAX_SHIFT:
        raise ValueError(f"gemm_i64: shift must be in 0..{MAX_SHIFT}, got {shift}")
    c, outside = _kernels().gemm_i64(a64, b64, int(shift))
    if outside:
        raise ValueError(
            f"gemm_i64: {outside} outputs outside the domain (min(|a|_1 |b|_inf, "
            "|a|_inf |b|_1) < 2^62 per pair of rows): reduce the operands' magnitudes"
        )
    return c


def _frac(x: np.ndarray) -> int:
    """The power-of-two format putting max|x| in [2^14, 2^15) (0 for an all-zero array)."""
    top = float(np.max(np.abs(x))) if x.size else 0.0
    if top == 0.0:
        return 0
    return Q_BITS - 1 - int(np.frexp(top)[1] - 1)


def _float_matrix(x: object, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"matmul_nt: {name} must be a 2-D array of real numbers") from e
    if arr.ndim != 2:
        raise ValueError(f"matmul_nt: {name} must be 2-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"matmul_nt: {name} must be finite, got NaN or infinity")
    return arr


def matmul_nt(x: object, w: object) -> np.ndarray:
    """X W^T in float64 through gemm_i16: X [M, K], W [N, K] quantised to int16 (power-of-two
    scales), multiplied exactly (int64 when an int32 sum would clamp), dequantised."""
    xf, wf = _float_matrix(x, "X"), _float_matrix(w, "W")
    if xf.shape[1] != wf.shape[1]:
        raise ValueError(f"matmul_nt: X [M, K] and W [N, K] need one K, got {xf.shape}, {wf.shape}")
    fx, fw = _frac(xf), _frac(wf)
    xq = np.clip(quantize(xf, fx), -32767, 32767).astype(np.int16)
    wq = np.clip(quantize(wf, fw), -32767, 32767).astype(np.int16)
    c, sat = gemm_i16(xq, wq)
    if sat:  # an exact sum beyond int32: the int64 kernel holds it (K 2^30 < 2^62 for K < 2^32)
        return value(gemm_i64(xq.astype(np.int64), wq.astype(np.int64), 0), fx + fw)
    return value(c.astype(np.int64), fx + fw)


__all__ = ["gemm_i16", "gemm_i64", "matmul_nt"]
