"""Float64 reference for the MX formats, written from the definitions (K3-SPEC.md section 6).

Independent of kernels.py: values come from the IEEE-style formula (-1)^s * 2^(e-bias) * (1 + f/2^m)
evaluated in float64 (every MX value is exactly representable there), floor(log2) comes from
np.frexp, and rounding is np.rint (round half to even) on x / 2^X. Codes are found by looking the
rounded value up in the decoded table, not by assembling bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass(frozen=True)
class ElementFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    has_inf: bool  # E5M2 only
    nan_codes: str  # "none", "e4m3" (S.1111.111) or "ieee" (all-ones exponent, f != 0)

    @property
    def nbits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def max_value(self) -> float:
        return float(np.nanmax(element_values(self)[np.isfinite(element_values(self))]))

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value: floor(log2(max))."""
        return int(np.frexp(self.max_value)[1]) - 1


FORMATS = {
    "e2m1": ElementFormat("e2m1", 2, 1, 1, False, "none"),
    "e2m3": ElementFormat("e2m3", 2, 3, 1, False, "none"),
    "e3m2": ElementFormat("e3m2", 3, 2, 3, False, "none"),
    "e4m3": ElementFormat("e4m3", 4, 3, 7, False, "e4m3"),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, True, "ieee"),
}


def decode_element(code: int, f: ElementFormat) -> float:
    """The value of one element code, by the format's definition."""
    s = (code >> (f.ebits + f.mbits)) & 1
    e = (code >> f.mbits) & ((1 << f.ebits) - 1)
    m = code & ((1 << f.mbits) - 1)
    sign = -1.0 if s else 1.0
    top = (1 << f.ebits) - 1
    if f.nan_codes == "e4m3" and e == top and m == (1 << f.mbits) - 1:
        return float("nan")
    if f.nan_codes == "ieee" and e == top:
        return sign * float("inf") if m == 0 else float("nan")
    if e == 0:
        return sign * 2.0**f.emin * (m / 2.0**f.mbits)
    return sign * 2.0 ** (e - f.bias) * (1.0 + m / 2.0**f.mbits)


def element_values(f: ElementFormat) -> np.ndarray:
    """Values of all 2^nbits codes, indexed by code."""
    return np.array([decode_element(c, f) for c in range(1 << f.nbits)])


def decode_e8m0(b: int) -> float:
    return float("nan") if b == 255 else 2.0 ** (b - 127)


def _round_to_grid(a: np.ndarray, f: ElementFormat) -> np.ndarray:
    """|v| rounded half-to-even onto the element grid, saturated at the format's max."""
    out = np.zeros_like(a)
    nz = a > 0
    t = np.frexp(a[nz])[1] - 1  # floor(log2 a)
    spacing = np.exp2((np.maximum(t, f.emin) - f.mbits).astype(np.float64))
    out[nz] = np.rint(a[nz] / spacing) * spacing
    return np.minimum(out, f.max_value)


def quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference MX quantisation of float32 `x` (length a multiple of 32): (scales, codes).

    Same documented rules as the kernel: X = floor(log2 amax) - emax clamped to [-127, 127];
    all-zero blocks get scale 0 with signed zero codes; NaN/Inf blocks get scale 255, codes 0.
    """
    f = FORMATS[fmt]
    v64 = x.astype(np.float64).reshape(-1, 32)
    nb = v64.shape[0]
    scales = np.zeros(nb, dtype=np.uint8)
    codes = np.zeros(v64.shape, dtype=np.uint8)
    special = ~np.isfinite(v64).all(axis=1)
    amax = np.where(special, 0.0, np.abs(np.where(np.isfinite(v64), v64, 0.0)).max(axis=1))
    floor_log2 = np.where(amax > 0, np.frexp(amax)[1] - 1, -1000)
    x_exp = np.clip(floor_log2 - f.emax, -127, 127)
    scales[:] = np.where(special, 255, x_exp + 127)
    scaled = v64 / np.exp2(x_exp.astype(np.float64))[:, None]
    mag = _round_to_grid(np.abs(np.where(special[:, None], 0.0, scaled)), f)
    # the code of each rounded magnitude, found by value among the positive codes
    table = element_values(f)[: 1 << (f.nbits - 1)]
    order = np.argsort(np.where(np.isfinite(table), table, np.inf), kind="stable")
    idx = np.searchsorted(table[order], mag)
    if not np.array_equal(table[order][idx], mag):
        raise AssertionError(f"{fmt}: a rounded value is not on the element grid")
    codes[:] = order[idx]
    negative = np.signbit(v64) & ~special[:, None]
    codes |= (negative.astype(np.uint8) << (f.nbits - 1)).astype(np.uint8)
    return scales, codes.reshape(-1)


def dequantize(scales: np.ndarray, codes: np.ndarray, fmt: str) -> np.ndarray:
    f = FORMATS[fmt]
    table = element_values(f)
    vals = table[codes.astype(np.int64)].reshape(-1, 32)
    scale = np.array([decode_e8m0(int(b)) for b in scales])
    return (vals * scale[:, None]).reshape(-1)


def exact_dot(a_vals: np.ndarray, b_vals: np.ndarray) -> Fraction:
    """sum a_i * b_i as an exact rational (float64 MX values are exact binary fractions)."""
    return sum(
        (Fraction(float(a)) * Fraction(float(b)) for a, b in zip(a_vals, b_vals, strict=True)),
        Fraction(0),
    )
