"""MX formats (MXFP4 / MXFP6 / MXFP8): the library face.

Float arrays in, float arrays out; the integer kernels do all the arithmetic in between.

    scales, codes = quantize(x, "e2m1")        # x: 1-D float32, len % 32 == 0
    y = dequantize(scales, codes, "e2m1")      # float64, exact; NaN where scale or code is NaN
    packed = pack_fp4(codes)                    # two codes per byte, even index in the low nibble
    total = dot(sa, ca, "e4m3", sb, cb, "e2m1") # exact MXFP8 . MXFP4, rounded once to float64
    exact = dot(..., exact=True)                # the same sum as a fractions.Fraction

The rules for rounding, saturation, all-zero blocks, underflow and NaN/Inf blocks are in the
docstring of `k3gates.mxfp.kernels`.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ..infra import compile as _compile

KERNELS = "k3gates.mxfp.kernels"
FORMATS = {"e2m1": 0, "e2m3": 1, "e3m2": 2, "e4m3": 3, "e5m2": 4}
BLOCK = 32
# Pairs whose per-block integer dot could exceed int64 (kernels.mx_block_dot docstring).
_TOO_WIDE = {("e5m2", "e5m2"), ("e5m2", "e4m3"), ("e4m3", "e5m2")}


def _kernels():
    return _compile.load(KERNELS)


def _fmt(fmt: str) -> int:
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt.lower()]


def _array(a: object, name: str, dtype: type, *, multiple: int = 1) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(
            f"{name}: expected a numpy array of {np.dtype(dtype).name}, got {type(a).__name__}"
        )
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got {a.ndim}-D with shape {a.shape}")
    if a.shape[0] % multiple:
        raise ValueError(
            f"{name}: expected a length that is a multiple of {multiple}, got {a.shape[0]}"
        )
    return np.ascontiguousarray(a)


def quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """MX-quantise float32 `x` in blocks of 32: (scales uint8[n/32], codes uint8[n])."""
    f = _fmt(fmt)
    x = _array(x, "x", np.float32, multiple=BLOCK)
    return _kernels().quantize_mx(x.view(np.uint32), f)


def _check_codes(scales: np.ndarray, codes: np.ndarray, fmt: str) -> int:
    f = _fmt(fmt)
    scales = _array(scales, "scales", np.uint8)
    codes = _array(codes, "codes", np.uint8, multiple=BLOCK)
    if codes.shape[0] != BLOCK * scales.shape[0]:
        raise ValueError(
            f"codes: expected {BLOCK} codes per scale, i.e. length "
            f"{BLOCK * scales.shape[0]}, got {codes.shape[0]}"
        )
    width = WIDTH[f]
    if codes.size and int(codes.max()) >= 1 << width:
        raise ValueError(f"codes: {fmt} codes are {width}-bit, got {int(codes.max())}")
    return f


WIDTH = {0: 4, 1: 6, 2: 6, 3: 8, 4: 8}  # bits per element code


def _values(sig: np.ndarray, exp: np.ndarray, cls: np.ndarray, negative: np.ndarray) -> np.ndarray:
    # Boundary conversion: sig * 2**exp is exact in float64 for every MX value (|exp| < 200).
    out = np.ldexp(sig.astype(np.float64), exp.astype(np.int32))
    out[(sig == 0) & negative] = -0.0  # an integer has no negative zero; the sign bit does
    out[cls == 1] = np.copysign(np.inf, sig[cls == 1].astype(np.float64))
    out[cls == 2] = np.nan
    return out


def dequantize(scales: np.ndarray, codes: np.ndarray, fmt: str) -> np.ndarray:
    """Exact float64 values of MX blocks; NaN where the scale is 0xFF or the code is NaN."""
    f = _check_codes(scales, codes, fmt)
    negative = (codes >> (WIDTH[f] - 1)) == 1
    return _values(*_kernels().dequantize_mx(scales, codes, f), negative)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Two E2M1 codes per byte; the even index goes in the low nibble."""
    codes = _array(codes, "codes", np.uint8, multiple=2)
    if codes.size and int(codes.max()) > 0xF:
        raise ValueError(f"codes: FP4 codes are 4-bit, got {int(codes.max())}")
    return _kernels().pack_fp4(codes)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    return _kernels().unpack_fp4(_array(packed, "packed", np.uint8))


def dot(
    a_scales: np.ndarray,
    a_codes: np.ndarray,
    a_fmt: str,
    b_scales: np.ndarray,
    b_codes: np.ndarray,
    b_fmt: str = "e2m1",
    *,
    exact: bool = False,
) -> float | Fraction:
    """The dot product of two MX vectors of equal length, computed exactly in integers.

    Typical use is an MXFP8 activation (e4m3 or e5m2) against an MXFP4 weight (e2m1). The exact sum
    is returned as a Fraction with exact=True, else rounded once to the nearest float64. A block
    with a NaN scale, or a NaN or infinite element, makes the result follow IEEE rules (NaN/Inf).
    """
    fa, fb = _check_codes(a_scales, a_codes, a_fmt), _check_codes(b_scales, b_codes, b_fmt)
    if a_codes.shape != b_codes.shape:
        raise ValueError(
            f"b_codes: expected the length of a_codes ({a_codes.shape[0]}), got {b_codes.shape[0]}"
        )
    if (a_fmt.lower(), b_fmt.lower()) in _TOO_WIDE:
        raise ValueError(
            f"dot: {a_fmt} x {b_fmt} could overflow the exact int64 block sum; "
            "use an FP4 or FP6 operand"
        )
    d, e, cls = _kernels().mx_block_dot(a_scales, a_codes, fa, b_scales, b_codes, fb)
    if cls.any():  # IEEE semantics for the special blocks
        a = dequantize(a_scales, a_codes, a_fmt)
        b = dequantize(b_scales, b_codes, b_fmt)
        with np.errstate(invalid="ignore"):
            special = float(np.sum(a * b))
        return special  # NaN or Inf: there is no exact rational to return
    total = sum(
        (Fraction(int(dk)) * Fraction(2) ** int(ek) for dk, ek in zip(d, e, strict=True)),
        Fraction(0),
    )
    return total if exact else float(total)


def bits_per_value(scales: np.ndarray, elements: np.ndarray, n_values: int) -> float:
    """Storage measured from the arrays actually held: 8 * (bytes of scales + elements) / n."""
    return 8.0 * (scales.nbytes + elements.nbytes) / n_values
