"""MX block formats (OCP Microscaling v1.0, K3-SPEC.md section 6) in integers only.

Inputs are float32 *bit patterns* (uint32); no float value is ever formed. A value is carried as
an exact pair (sig, exp) meaning sig * 2**exp, with sig a signed int64.

Element formats, by `fmt` number (the library face maps names to numbers):

    fmt  name  ebits mbits bias emax  max     min subnormal  specials
    0    e2m1  2     1     1    2     6       2**-1          none
    1    e2m3  2     3     1    2     7.5     2**-3          none
    2    e3m2  3     2     3    4     28      2**-4          none
    3    e4m3  4     3     7    8     448     2**-9          NaN = S.1111.111
    4    e5m2  5     2     15   15    57344   2**-16         Inf = S.11111.00,
                                                                NaN = S.11111.{01,10,11}

The scale is E8M0: byte b means 2**(b - 127) for b in 0..254, and 0xFF means NaN.

Quantisation of one 32-element block (`quantize_mx`):
- shared_exp = floor(log2(amax)) - emax, read from amax's exponent bits (a float log2 is off by
  one just below powers of two); X = shared_exp clamped to the E8M0 range [-127, 127].
- Underflow: when shared_exp < -127 the scale clamps to 2**-127 and elements are quantised against
  it, so they may round into the element subnormals or to zero. (floor(log2 amax) <= 127 for
  float32, so the upper clamp never binds.)
- All-zero block (+0 and -0 only): amax = 0 has floor(log2) = -inf, which the same clamp turns into
  scale byte 0x00 (2**-127); every element is a zero code that keeps its sign bit.
- A NaN or Inf anywhere in the block: scale 0xFF and every code 0.
- Elements: x / 2**X rounded to nearest, ties to even (RNE), on the element grid (normals and
  subnormals); magnitudes above the format's max saturate to max. Exact: no intermediate rounding.

Worst-case magnitudes: float32 significands are < 2**24; the element integer n before encoding is
< 2**(mbits+2); shifts are bounded to 0..25 (beyond 25 the result is exactly 0 or exact). The MX
dot product's per-block integer is at most 32 * maxint(a) * maxint(b) (see `mx_block_dot`).
"""

import numpy as np

# fmt number -> (ebits, mbits, bias, emax, largest finite magnitude code)
E2M1 = 0
E2M3 = 1
E3M2 = 2
E4M3 = 3
E5M2 = 4
FMT_EBITS = (2, 2, 3, 4, 5)
FMT_MBITS = (1, 3, 2, 3, 2)
FMT_BIAS = (1, 1, 3, 7, 15)
FMT_EMAX = (2, 2, 4, 8, 15)
FMT_MAXMAG = (0x7, 0x1F, 0x1F, 0x7E, 0x7B)  # 6, 7.5, 28, 448, 57344
BLOCK = 32
SCALE_NAN = 255
E8M0_BIAS = 127


def _bitlen(m):
    """Number of significant bits of 0 <= m < 2**32 (0 for m == 0), by binary search."""
    n = 0
    for step in (16, 8, 4, 2, 1):
        if m >= (1 << step):
            m >>= step
            n += step
    return n + (1 if m > 0 else 0)


def _floor_log2_bits(a):
    """floor(log2 |x|) of a non-zero finite float32 given as |bits| (exponent bits, not a log)."""
    e = a >> 23
    if e == 0:
        return _bitlen(a & 0x7FFFFF) - 150  # subnormal: m * 2**-149
    return e - 127


def _quantize_element(u, x_exp, mbits, bias, maxmag, sign_pos):
    """The element code of float32 bits `u` against scale 2**x_exp (RNE, saturating).

    Write |u| = M * 2**(e - 150) with the leading bit of M at bit 23 (float32 subnormals are
    normalised first, zero gets e = -200 so it lands on code 0). With t = e - 127 - X the binade
    of |u| / 2**X, the element grid has spacing 2**(max(t, 1 - bias) - mbits), so
        n = RNE(M / 2**sh),  sh = 23 - mbits + max(0, 1 - bias - t)
        code = ((max(t + bias, 1) - 1) << mbits) + n,  saturated at maxmag.
    Adding n (rather than or-ing a mantissa) carries a rounded-up mantissa into the exponent
    field, and a subnormal rounded up to 2**mbits lands exactly on the smallest normal code.
    Magnitudes: M < 2**24, sh <= 62, so M + 2**(sh-1) < 2**62.
    """
    e = (u >> 23) & 0xFF
    m = u & 0x7FFFFF
    if e != 0:
        big_m = m | 0x800000
    elif m == 0:
        big_m = 0
        e = -200
    else:  # float32 subnormal: move the leading bit to bit 23
        length = _bitlen(m)
        big_m = m << (24 - length)
        e = length - 23
    t = e - 127 - x_exp
    # (the outer max(1, ...) is always a no-op; it gives Pythran's range analysis a lower bound)
    sh = max(1, min(23 - mbits + max(0, 1 - bias - t), 62))
    # n = round(M / 2**sh), ties to even: add half - 1, plus one more when the kept LSB is odd
    n = (big_m + (1 << (sh - 1)) - 1 + ((big_m >> sh) & 1)) >> sh
    mag = min(((max(t + bias, 1) - 1) << mbits) + n, maxmag)
    return (((u >> 31) & 1) << sign_pos) | mag


# pythran export quantize_mx(uint32[:], int)
def quantize_mx(bits, fmt):
    """MX-quantise float32 bits in blocks of 32. Returns (scales uint8[nb], codes uint8[n]).

    `bits` is float32 viewed as uint32, length a multiple of 32 (the face checks). See the module
    docstring for the rounding, saturation, all-zero and underflow rules.
    """
    n = bits.shape[0]
    nb = n // BLOCK
    mbits = FMT_MBITS[fmt]
    bias = FMT_BIAS[fmt]
    emax = FMT_EMAX[fmt]
    maxmag = FMT_MAXMAG[fmt]
    sign_pos = FMT_EBITS[fmt] + mbits
    scales = np.zeros(nb, dtype=np.uint8)
    codes = np.zeros(n, dtype=np.uint8)
    # omp parallel for
    for b in range(nb):
        # amax as |bits|: for non-negative floats, integer order is value order, and every
        # NaN or Inf pattern is >= 0x7F800000
        amax = 0
        for i in range(b * BLOCK, (b + 1) * BLOCK):
            amax = max(amax, int(bits[i]) & 0x7FFFFFFF)
        if amax >= 0x7F800000:
            scales[b] = SCALE_NAN
            continue
        # shared_exp = floor(log2 amax) - emax, clamped to E8M0's [-127, 127]
        x_exp = -E8M0_BIAS
        if amax != 0:
            x_exp = max(_floor_log2_bits(amax) - emax, -E8M0_BIAS)
        scales[b] = x_exp + E8M0_BIAS
        for i in range(b * BLOCK, (b + 1) * BLOCK):
            codes[i] = _quantize_element(int(bits[i]), x_exp, mbits, bias, maxmag, sign_pos)
    return scales, codes


def decode_element(code, fmt):
    """(sig, exp, cls) with value = sig * 2**exp; cls 0 finite, 1 infinite, 2 NaN."""
    ebits = FMT_EBITS[fmt]
    mbits = FMT_MBITS[fmt]
    bias = FMT_BIAS[fmt]
    s = (code >> (ebits + mbits)) & 1
    e = (code >> mbits) & ((1 << ebits) - 1)
    f = code & ((1 << mbits) - 1)
    cls = 0
    if fmt == E4M3 and e == 15 and f == 7:
        cls = 2
    if fmt == E5M2 and e == 31:
        cls = 1 if f == 0 else 2
    if e == 0:
        sig = f
        exp = 1 - bias - mbits
    else:
        sig = (1 << mbits) | f
        exp = e - bias - mbits
    if s == 1:
        sig = -sig
    return sig, exp, cls


# pythran export dequantize_mx(uint8[:], uint8[:], int)
def dequantize_mx(scales, codes, fmt):
    """Exact values of MX blocks: (sig int64[n], exp int64[n], cls int8[n]).

    value = sig * 2**exp, exp = element exponent + (scale - 127). cls is 2 (NaN) where the block
    scale is 0xFF or the code is NaN, 1 where the code is infinite, else 0. No rounding happens.
    """
    n = codes.shape[0]
    sig = np.zeros(n, dtype=np.int64)
    exp = np.zeros(n, dtype=np.int64)
    cls = np.zeros(n, dtype=np.int8)
    for i in range(n):
        sc = int(scales[i // BLOCK])
        s, e, c = decode_element(int(codes[i]), fmt)
        sig[i] = s
        exp[i] = e + sc - E8M0_BIAS
        cls[i] = 2 if sc == SCALE_NAN else c
    return sig, exp, cls


# pythran export decode_e8m0(uint8[:])
def decode_e8m0(scales):
    """E8M0 bytes -> (exp int64, is_nan int8): value 2**exp, or NaN for 0xFF."""
    n = scales.shape[0]
    exp = np.zeros(n, dtype=np.int64)
    nan = np.zeros(n, dtype=np.int8)
    for i in range(n):
        exp[i] = int(scales[i]) - E8M0_BIAS
        nan[i] = 1 if scales[i] == SCALE_NAN else 0
    return exp, nan


# pythran export pack_fp4(uint8[:])
def pack_fp4(codes):
    """Two 4-bit codes per byte, the even index in the low nibble. len(codes) must be even."""
    n = codes.shape[0] // 2
    packed = np.zeros(n, dtype=np.uint8)
    for i in range(n):
        packed[i] = (codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4)
    return packed


# pythran export unpack_fp4(uint8[:])
def unpack_fp4(packed):
    """Inverse of pack_fp4."""
    n = packed.shape[0]
    codes = np.zeros(2 * n, dtype=np.uint8)
    for i in range(n):
        codes[2 * i] = packed[i] & 0xF
        codes[2 * i + 1] = packed[i] >> 4
    return codes


# pythran export quantize_pack_fp4(uint32[:])
def quantize_pack_fp4(bits):
    """MXFP4 (E2M1) quantisation straight to packed bytes: (scales uint8[nb], packed uint8[n/2])."""
    scales, codes = quantize_mx(bits, E2M1)
    return scales, pack_fp4(codes)


def _fixed_point(code, fmt):
    """An element as an integer count of its format's smallest subnormal, and its class."""
    sig, exp, cls = decode_element(code, fmt)
    return sig << (exp - (1 - FMT_BIAS[fmt] - FMT_MBITS[fmt])), cls


# pythran export mx_block_dot(uint8[:], uint8[:], int, uint8[:], uint8[:], int)
def mx_block_dot(a_scales, a_codes, a_fmt, b_scales, b_codes, b_fmt):
    """Exact per-block dot products of two MX vectors: (d int64[nb], e int64[nb], cls int8[nb]).

    sum_i a_i * b_i over block k equals d[k] * 2**e[k] exactly. Each element is taken as an integer
    multiple of its format's smallest subnormal (E4M3: |a| <= 448 * 2**9 < 2**18; E5M2: < 2**32;
    E2M1: |b| <= 12), so with 32 products d fits int64 for every pair except E5M2 x E5M2 and
    E5M2 x E4M3 (the face refuses those). cls is 2 where a scale is NaN or an element is NaN or
    infinite (the face evaluates those blocks by IEEE rules), else 0.
    """
    nb = a_scales.shape[0]
    d = np.zeros(nb, dtype=np.int64)
    e = np.zeros(nb, dtype=np.int64)
    cls = np.zeros(nb, dtype=np.int8)
    a_unit = 1 - FMT_BIAS[a_fmt] - FMT_MBITS[a_fmt]
    b_unit = 1 - FMT_BIAS[b_fmt] - FMT_MBITS[b_fmt]
    for k in range(nb):
        if a_scales[k] == SCALE_NAN or b_scales[k] == SCALE_NAN:
            cls[k] = 2
        acc = 0
        for i in range(k * BLOCK, (k + 1) * BLOCK):
            ai, ac = _fixed_point(int(a_codes[i]), a_fmt)
            bi, bc = _fixed_point(int(b_codes[i]), b_fmt)
            if ac != 0 or bc != 0:
                cls[k] = 2
            # d_k = sum_i a_i * b_i in units of 2**(a_unit + b_unit)
            acc += ai * bi
        d[k] = acc
        e[k] = int(a_scales[k]) + int(b_scales[k]) - 2 * E8M0_BIAS + a_unit + b_unit
    return d, e, cls
