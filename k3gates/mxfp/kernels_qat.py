"""MXFP4 quantisation-aware training of a routed expert, as K3 trains its experts (K3-SPEC.md
sections 4 and 6), in integers only.

Quantisation from fixed point. A row of K values x (int64 in Q.frac, K a multiple of 32) is cut
into blocks of 32 along the reduction axis; each block gets one E8M0 scale 2^X and element codes
(`quantize_fx`). Two scale rules, a parameter:

    OCP v1.0 (rule 0):   X = floor(log2 amax) - emax                  (amax / 2^X in [2^emax, 2^(emax+1)))
    round-up (rule 1):   X = ceil(log2(amax / max))                   the smallest X with amax <= max 2^X

floor(log2 amax) is bitlen(amax_raw) - 1 - frac, exact. Under OCP a block's largest values may
exceed the format's max after scaling (E2M1: amax / 2^X up to 8 > 6) and saturate; the round-up
rule (found necessary for MXFP8 pretraining, Mishra et al. 2025) never saturates, at the price of
one binade of resolution when it rounds up. Elements are rounded to nearest, ties to even, on the
element grid, and saturate at max; the sign bit is set for every negative input (a negative
value that rounds to zero keeps it, as mxfp's quantize_mx does for -0). An all-zero block gets
scale byte 0 (2^-127) and zero codes. `sat` marks the elements whose scaled magnitude exceeds
max: the straight-through estimator passes no gradient there (the clipped-STE mask).

Exact values. An element is an integer count of its format's smallest subnormal (E2M1: 2^-1,
|n| <= 12; E4M3: 2^-9, |n| <= 448 2^9), so a quantised value is n 2^e with e = X + unit (`values`).

Exact dyadic matrix product (`dyadic_matmul`): C[m, n] = round(sum_k a[m, k] b[n, k]
2^(ea[m, k] + eb[n, k] + frac)), one rounding (half away from zero) of the exact sum, through
two limbs: terms with a non-negative shift add to `hi` as integers; a term with shift -s < 0
adds its floor to `hi` and its remainder (< 2^s) scaled to units of 2^-40 to `lo`. The total is
hi + lo 2^-40 exactly, rounded once (gemm.round_limbs). Domain: every term |a b 2^max(s, 0)|
< 2^48 and s >= -40, K < 2^14, so neither limb passes 2^62; a term outside is counted in
`outside` (then C is not as stated and the caller stops). So an MX product of an MXFP8 activation row and an MXFP4 weight
row is exact before its one rounding: the "exact integer MX dot product", never a dequantised
float.

Error bounds against float64 on the same integers: 1/2 LSB for every dyadic_matmul output (the
float64 sum of at most 2^14 exact products is within 2^-38 of its magnitude).
"""

import numpy as np

from ..fx.kernels import bitlen
from ..gemm.kernels import round_limbs
from ..mxfp.kernels import FMT_BIAS, FMT_EBITS, FMT_EMAX, FMT_MAXMAG, FMT_MBITS, decode_element

BLOCK = 32
LO_BITS = 40  # the fractional limb: units of 2^-40
SHIFT_MIN = -40
TERM_MAX = 1 << 48  # |a b 2^max(s, 0)| below this: K < 2^14 terms keep each limb below 2^62
E8M0_BIAS = 127


def _rne_shift(m, sh):
    """m / 2^sh rounded to nearest, ties to even, for m >= 0 (sh <= 0: exact m 2^-sh)."""
    if sh <= 0:
        return m << (-sh)
    q = m >> sh
    r = m - (q << sh)
    half = 1 << (sh - 1)
    if r > half or (r == half and (q & 1) == 1):
        q += 1
    return q


def _max_int(fmt):
    """The format's largest magnitude as (integer M, exponent E): max = M 2^E."""
    mb = FMT_MBITS[fmt]
    code = FMT_MAXMAG[fmt]
    mant = code & ((1 << mb) - 1)
    return (1 << mb) + mant, FMT_EMAX[fmt] - mb


def _above(m, mi, e):
    """1 if m > mi 2^e exactly (m, mi >= 0, any integer e), else 0."""
    if e >= 0:
        return 1 if m > (mi << e) else 0
    hi = m >> (-e)
    if hi > mi:
        return 1
    if hi == mi and (m & ((1 << (-e)) - 1)) != 0:
        return 1
    return 0


def scale_exp(amax, frac, fmt, rule):
    """The block's scale exponent X for its largest magnitude amax (raw, Q.frac, > 0)."""
    x = bitlen(amax) - 1 - frac - FMT_EMAX[fmt]
    mi, me = _max_int(fmt)
    # round-up: amax 2^-frac > max 2^x, i.e. amax > mi 2^(me + x + frac), takes one binade more
    if rule == 1 and _above(amax, mi, me + x + frac) == 1:
        x += 1
    return min(max(x, -E8M0_BIAS), E8M0_BIAS)


def _element(m, shift, fmt):
    """(code magnitude, saturated) of magnitude m 2^-shift (m >= 0) on fmt's element grid."""
    mb = FMT_MBITS[fmt]
    bias = FMT_BIAS[fmt]
    mi, me = _max_int(fmt)
    if m == 0:
        return 0, 0
    if _above(m, mi, me + shift) == 1:  # m 2^-shift > max: saturated
        return FMT_MAXMAG[fmt], 1
    t = bitlen(m) - 1 - shift  # floor(log2 |v|)
    n = _rne_shift(m, shift + max(t, 1 - bias) - mb)
    code = ((max(t + bias, 1) - 1) << mb) + n
    return min(code, FMT_MAXMAG[fmt]), 0


# pythran export quantize_fx(int64[:,:] order(C), int64, int64, int64)
def quantize_fx(x, frac, fmt, rule):
    """Rows x [R, K] (Q.frac, K a multiple of 32) -> (scales uint8 [R, K/32], codes uint8 [R, K],
    sat uint8 [R, K]) by scale rule `rule` (0: OCP floor, 1: round-up)."""
    r_n, k_n = x.shape[0], x.shape[1]
    nb = k_n // BLOCK
    scales = np.zeros((r_n, nb), dtype=np.uint8)
    codes = np.zeros((r_n, k_n), dtype=np.uint8)
    sat = np.zeros((r_n, k_n), dtype=np.uint8)
    sign = 1 << (FMT_EBITS[fmt] + FMT_MBITS[fmt])
    # omp parallel for
    for r in range(r_n):
        for b in range(nb):
            amax = 0
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                amax = max(amax, abs(int(x[r, i])))
            if amax == 0:
                continue  # scale byte 0, zero codes
            xe = scale_exp(amax, frac, fmt, rule)
            scales[r, b] = xe + E8M0_BIAS
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                v = int(x[r, i])
                c, s = _element(abs(v), frac + xe, fmt)
                codes[r, i] = c | (sign if v < 0 else 0)
                sat[r, i] = s
    return scales, codes, sat


# pythran export values(uint8[:,:] order(C), uint8[:,:] order(C), int64)
def values(scales, codes, fmt):
    """Exact values of quantised rows: (n int64 [R, K], e int64 [R, K]), value = n 2^e (n an
    integer count of the smallest subnormal, e = X + that subnormal's exponent)."""
    unit = 1 - FMT_BIAS[fmt] - FMT_MBITS[fmt]
    n = np.zeros((codes.shape[0], codes.shape[1]), dtype=np.int64)
    e = np.zeros((codes.shape[0], codes.shape[1]), dtype=np.int64)
    for r in range(codes.shape[0]):
        for i in range(codes.shape[1]):
            sig, ex, _cls = decode_element(int(codes[r, i]), fmt)
            n[r, i] = sig << (ex - unit)
            e[r, i] = int(scales[r, i // BLOCK]) - E8M0_BIAS + unit
    return n, e


def _add_term(hi, lo, v, s):
    """(hi, lo, 1) with v 2^s added to the two limbs (hi + lo 2^-40), or (hi, lo, 0) for a
    term outside the exact domain (s < -40, or |v 2^max(s, 0)| >= 2^48), which is not added."""
    if v == 0:
        return hi, lo, 1
    if s < SHIFT_MIN or s > 47 or abs(v) >= (TERM_MAX >> max(s, 0)):
        return hi, lo, 0
    if s >= 0:
        return hi + (v << s), lo, 1
    q = v >> (-s)  # floor; the remainder v - q 2^-s is in [0, 2^-s)
    return hi + q, lo + ((v - (q << (-s))) << (LO_BITS + s)), 1


# pythran export dyadic_matmul(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64)
def dyadic_matmul(a, ea, b, eb, frac):
    """(C int64 [M, N] in Q.frac, outside): C = round(sum_k a[m,k] b[n,k] 2^(ea + eb + frac))."""
    m_n, n_n, k_n = a.shape[0], b.shape[0], a.shape[1]
    c = np.zeros((m_n, n_n), dtype=np.int64)
    bad = np.zeros(m_n, dtype=np.int64)
    # omp parallel for
    for m in range(m_n):
        for n in range(n_n):
            hi = 0
            lo = 0
            for k in range(k_n):
                hi, lo, ok = _add_term(hi, lo, int(a[m, k]) * int(b[n, k]),
                                       int(ea[m, k]) + int(eb[n, k]) + frac)  # fmt: skip
                bad[m] += 1 - ok
            c[m, n] = round_limbs(hi, lo, LO_BITS, LO_BITS)
    return c, int(np.sum(bad))


# pythran export packed_matmul(int64[:,:] order(C), int64[:,:] order(C), uint8[:,:] order(C), uint8[:,:] order(C), int64)
def packed_matmul(a, ea, w_packed, w_scales, frac):
    """The inference path: activations (a, ea as `values` gives them) against packed MXFP4
    weights (two E2M1 codes per byte, one E8M0 byte per 32), each nibble decoded in the loop:
    (C [M, N] Q.frac, outside), the same sum and rounding as dyadic_matmul."""
    m_n, n_n, k_n = a.shape[0], w_packed.shape[0], a.shape[1]
    unit = 1 - FMT_BIAS[0] - FMT_MBITS[0]
    c = np.zeros((m_n, n_n), dtype=np.int64)
    bad = np.zeros(m_n, dtype=np.int64)
    # E2M1 magnitudes as counts of 2^-1: codes 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12
    table = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.int64)
    # omp parallel for
    for m in range(m_n):
        for n in range(n_n):
            hi = 0
            lo = 0
            for k in range(k_n):
                byte = int(w_packed[n, k >> 1])
                code = (byte >> (4 * (k & 1))) & 15
                w = table[code & 7]
                s = int(ea[m, k]) + int(w_scales[n, k // BLOCK]) - E8M0_BIAS + unit + frac
                hi, lo, ok = _add_term(hi, lo, int(a[m, k]) * (-w if code >= 8 else w), s)
                bad[m] += 1 - ok
            c[m, n] = round_limbs(hi, lo, LO_BITS, LO_BITS)
    return c, int(np.sum(bad))


# pythran export fake_quant(int64[:,:] order(C), int64, int64, int64)
def fake_quant(x, frac, fmt, rule):
    """(xq int64 [R, K] Q.frac, sat uint8 [R, K], outside): rows x quantised by `quantize_fx`,
    each element's exact value n 2^e written back in x's own format Q.frac.

    Exact, no second rounding. An element of binade 2^t is rounded onto a grid of spacing
    2^(t - mbits) (the subnormal spacing 2^(X + unit) below the normal range): a spacing of at
    least 2^-frac gives a multiple of 2^-frac, and a finer one leaves the Q.frac input as it is.
    A saturated element becomes max 2^X = M 2^(bitlen(amax) - 1 - mbits) in units of 2^-frac (max
    = M 2^(emax - mbits)), and saturation needs bitlen(amax) > mbits for E2M1 and E4M3, so that
    is an integer too. `outside` counts the elements for which this fails (none, by the argument;
    the caller stops on any), left 0."""
    scales, codes, sat = quantize_fx(x, frac, fmt, rule)
    n, e = values(scales, codes, fmt)
    xq = np.zeros((x.shape[0], x.shape[1]), dtype=np.int64)
    bad = 0
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            s = int(e[r, i]) + frac
            v = int(n[r, i])
            if s >= 0:
                xq[r, i] = v << s
            elif v == ((v >> (-s)) << (-s)):
                xq[r, i] = v >> (-s)
            else:
                bad += 1
    return xq, sat, bad
