"""Host math for kernel inputs: the same bits on every CPU.

Gates and library faces build the integers a kernel receives on the host. If one of those
integers passed through a float function whose last bit depends on the CPU (NumPy's `exp`, `sin`
or `power` take SIMD paths on AVX-512 that they do not take on AVX2; libm picks variants by CPU
feature too), the kernel's bit-exact outputs would differ between machines through no fault of
the kernel. So every value on the way to a kernel is built here, from operations whose result IEEE
754 fixes (+ - * / and sqrt, each correctly rounded; ldexp and rounding, exact), from exact
rational and decimal arithmetic (software, the same everywhere), or from integers.
`k3gates/infra/inputaudit.py` checks that no gate takes another way.

Formats and error bounds, each proved by tests/test_fx_host.py:
- `exp(x)`: float64 in, float64 out, relative error at most `EXP_MAX_ERR_ULP` ulp of the result
  for x in [-708, 709] (Cody and Waite's reduction by ln 2 in two parts, then the Taylor series
  of degree 13 on |r| <= ln2/2, whose remainder is below 2^-60 there; Horner in float64).
- `sigmoid(x) = 1 / (1 + exp(-x))`: absolute error at most `SIGMOID_MAX_ERR` for every x;
  `tanh(x) = 2 sigmoid(2x) - 1` within 2^-51 absolute; `exp2(x)` within EXP_MAX_ERR_ULP + 1 ulp;
  `softmax` from `exp`; `matmul`, a float64 product summed in one fixed order.
- `inv_sqrt(n)`: n^(-1/2) for a positive number, correctly rounded to float64 (exact integer
  comparison of the two neighbours), so it equals any correctly rounded `n ** -0.5`.
- `turns_q62(terms)`: round(f / (2 pi) 2^62) for frequencies f = c prod b^(-e), in 80-digit decimal
  arithmetic (libmpdec's exp and ln are correctly rounded): the value before the final rounding is
  within 10^-55 of the true one, so the result is the exact rounding unless the true value lies
  within 10^-55 of a half-integer (tests derive every table again at 120 digits and find it
  equal).
- `fixed(value, frac)`: round(value 2^frac) of a decimal value, exact.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_EVEN, Context, Decimal
from fractions import Fraction

import numpy as np

EXP_MAX_ERR_ULP = 2
SIGMOID_MAX_ERR = 2.0**-52

# ln 2 in two parts: LN2_HI has 32 significant bits, so k LN2_HI is exact for |k| < 2^20
LN2_HI = 6.93147180369123816490e-01  # 0x3FE62E42FEE00000
LN2_LO = 1.90821492927058770002e-10  # 0x3DEA39EF35793C76
INV_LN2 = 1.44269504088896338700e00
LN2 = 6.93147180559945286227e-01
TAYLOR = [1.0 / math.factorial(n) for n in range(14)]  # exact ratios of integers, rounded once

# pi to 100 digits, as an exact rational
PI = Fraction(
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706798"
)
DIGITS = 80


def exp(x: np.ndarray | float) -> np.ndarray:
    """e^x, float64 in and out, within EXP_MAX_ERR_ULP ulp; 0 below -745, inf above 709.8."""
    x = np.asarray(x, dtype=np.float64)
    xc = np.clip(x, -745.0, 709.0)
    # x = k ln2 + r, |r| <= ln2 / 2
    k = np.rint(xc * INV_LN2)
    r = (xc - k * LN2_HI) - k * LN2_LO
    # e^r = sum r^n / n!, n <= 13, by Horner
    p = np.full_like(r, TAYLOR[13])
    for c in reversed(TAYLOR[:13]):
        p = p * r + c
    out = np.ldexp(p, k.astype(np.int64))
    return np.where(x > 709.78, np.inf, np.where(x < -745.2, 0.0, out))


def sigmoid(x: np.ndarray | float) -> np.ndarray:
    """1 / (1 + e^-x), float64, within SIGMOID_MAX_ERR."""
    return 1.0 / (1.0 + exp(-np.asarray(x, dtype=np.float64)))


def exp2(x: np.ndarray | float) -> np.ndarray:
    """2^x, float64, within EXP_MAX_ERR_ULP + 1 ulp: 2^k e^((x - k) ln 2) with k = rint(x)."""
    x = np.asarray(x, dtype=np.float64)
    k = np.rint(x)
    return np.ldexp(exp((x - k) * LN2), k.astype(np.int64))


def tanh(x: np.ndarray | float) -> np.ndarray:
    """tanh x = 2 sigmoid(2x) - 1, float64, within 2^-51 absolute."""
    return 2.0 * sigmoid(2.0 * np.asarray(x, dtype=np.float64)) - 1.0


def softmax(s: np.ndarray, axis: int = -1) -> np.ndarray:
    """e^(s - max) / sum e^(s - max) along `axis`, float64."""
    z = exp(s - s.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for float64 a [..., m, k] and b [k, n], summed over k in index order, one IEEE
    multiply and add at a time: the same bits on every CPU (a BLAS's kernel and summation order
    depend on the CPU it finds). Exact products and sums are not claimed, only their order."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    out = np.zeros((*a.shape[:-1], b.shape[-1]))
    for j in range(a.shape[-1]):
        out += a[..., j : j + 1] * b[j]
    return out


def inv_sqrt(n: float) -> float:
    """n^(-1/2) correctly rounded to float64, for a positive int or float n."""
    exact = Fraction(n)
    if exact <= 0:
        raise ValueError(f"inv_sqrt: expected a positive number, got {n}")
    y = 1.0 / math.sqrt(float(n))  # within 2 ulp; the loop moves it to the nearest float
    while True:
        lo, hi = math.nextafter(y, 0.0), math.nextafter(y, math.inf)
        # the true value t = n^-1/2 lies above the midpoint m of y and its neighbour iff m^2 n < 1
        if (Fraction(y) + Fraction(hi)) ** 2 * exact < 4:
            y = hi
        elif (Fraction(y) + Fraction(lo)) ** 2 * exact > 4:
            y = lo
        else:
            return y


def _context(digits: int) -> Context:
    return Context(prec=digits)


def _dec(q: Fraction, ctx: Context) -> Decimal:
    return ctx.divide(Decimal(q.numerator), Decimal(q.denominator))


def ln(x: Fraction | int, digits: int | None = None) -> Decimal:
    """The natural logarithm of a positive rational, to `digits` (DIGITS) significant digits."""
    ctx = _context(digits or DIGITS)
    return ctx.ln(_dec(Fraction(x), ctx))


Factors = list[tuple[Fraction, Fraction]]  # [(b, e), ...]: the product of b^(-e)


def turns_q62(terms: list[tuple[Factors, Fraction]], digits: int | None = None) -> np.ndarray:
    """Q0.62 turns per position of frequencies given exactly, int64: each term (factors, c) is
    the frequency c prod b^(-e) radians per position, and becomes round(freq / (2 pi) 2^62)."""
    ctx = _context(digits or DIGITS)
    scale = _dec(Fraction(1 << 62) / (2 * PI), ctx)
    out = []
    for factors, c in terms:
        log = sum((ctx.multiply(_dec(Fraction(e), ctx), ctx.ln(_dec(Fraction(b), ctx)))
                   for b, e in factors), Decimal(0))  # fmt: skip
        freq = ctx.multiply(ctx.exp(ctx.minus(log)), _dec(Fraction(c), ctx))
        out.append(int(ctx.multiply(freq, scale).to_integral_value(rounding=ROUND_HALF_EVEN)))
    return np.array(out, dtype=np.int64)


def power_turns_q62(base: int, exponents: list[Fraction], digits: int | None = None) -> np.ndarray:
    """turns_q62 of base^(-e) for each exponent e: the plain RoPE table's shape."""
    return turns_q62([([(Fraction(base), e)], Fraction(1)) for e in exponents], digits)


def floor_log2(x: float | Fraction) -> int:
    """The largest integer n with 2^n <= x, for x > 0, exactly."""
    q = Fraction(x)
    if q <= 0:
        raise ValueError(f"floor_log2: expected a positive number, got {x}")
    n = q.numerator.bit_length() - q.denominator.bit_length()  # 2^(n-1) < q < 2^(n+1)
    return n if Fraction(2) ** n <= q else n - 1


def ceil_log2(x: float | Fraction) -> int:
    """The least integer n with 2^n >= x, for x > 0, exactly."""
    n = floor_log2(x)
    return n if Fraction(2) ** n == Fraction(x) else n + 1


def fixed(x: Decimal | Fraction | int, frac: int) -> int:
    """round(x 2^frac), half to even, of an exact value."""
    return round(Fraction(x) * (1 << frac))
