"""Integer math foundations: fixed-point primitives and nonlinear functions, integers only.

Every other kernel imports these (`from ..fx.kernels import sigmoid_q62, mul_q62, ...`), so the
formats are chosen for them, and every error bound below is stated in output LSB and proven by a
foundations gate (k3gates/fx/gate.py) against the float64 math in reference.py.

Formats. "Q.f" means the integer v stands for v * 2**-f, held in int64 (a Pythran C long; an
overflow would wrap silently, so every function states the magnitudes it reaches). Q0.62 values lie
in [-1, 1] as int64 in [-2**62, 2**62]; Q0.31 outputs in [-2**31, 2**31], so that 1.0 itself is
representable (exp(0), sigma(64), a one-hot softmax). An argument's format is passed as `frac`,
so a caller hands over its accumulator as it is.

Rounding, everywhere: round half away from zero (gemmlowp's RoundingDivideByPOT convention), done
by `rshift_round`, `mul_round`, `div_round` and `div_round_shift`. It is symmetric, so
f(-x) = -f(x) holds bit for bit for every odd function here. Division is only ever by a positive
divisor with a non-negative dividend (Pythran's `//` and `%` differ from Python's for negative
divisors), and `>>` of a negative number is an arithmetic (floor) shift in both.

Internally every nonlinear function works in Q0.62 through `mul_q62`, an exact 31-bit-limb high
multiply, so the one rounding that matters is the last one into the output format. Each bound is
therefore 1/2 LSB (that final rounding) plus 2^-10 LSB for everything before it; the analysis in
each docstring puts everything before it below 2^-11 LSB.

    function         input                       output          bound holds for          max error
    rshift_round     int64 x, shift 0..63        int64           x != -2^63               exact
    mul_round        |a|,|b| <= 2^62, s 0..124   int64           |result| < 2^62          exact
    div_round        n, d >= 1                   int64           |n| < 2^63               exact
    div_round_shift  n >= 0, 1 <= d < 2^61       int64           result < 2^62            exact
    narrow_int32     int64                       int32 + count   any                      exact
    isqrt            0 <= n < 2^63               floor(sqrt n)   any                      exact
    exp_q31          x <= 0, Q.frac (<= 62)      Q0.31 [0, 1]    any x <= 0               B
    sigmoid_q31      x, Q.frac                   Q0.31 [0, 1]    any x                    B
    tanh_q31         x, Q.frac                   Q0.31 [-1, 1]   any x                    B
    silu_q           x, Q.frac                   Q.frac          |x_raw| <= 2^36          B
    rsqrt_q          x > 0, Q.frac_in            Q.frac_out      result < 2^40 raw        B
    softmax_row_q31  row, Q.frac, |x| < 2^61     Q0.31           n <= 2^20                B
    rmsnorm_row      x Q.fx, w Q.fw (<= 2^31)    Q.fy            |y_raw| < 2^40, exact    B
    l2norm_row       x Q.fx (<= 2^31)            Q.fy            sum (acc_shift 0)        B
    sincos_q31       phase: 2^-bits turns        Q0.31 sin, cos  bits 1..62, any phase    B

    B = 513/1024 LSB of the output = 1/2 + 2^-10 (the constants *_MAX_ERR_LSB_Q10 below).
    rmsnorm and l2norm also need sum x^2 / 2^acc_shift + n eps < 2^62 (acc_shift > 0 trades an
    exact sum for range, adding |y_raw| n / (4 acc) LSB); softmax needs n < 2^31 not to overflow.

gemmlowp's fixedpoint.h tolerances on Q0.31 outputs (the anchors): exp_on_negative_values 500,
tanh 310, logistic 155, in units of 2^-31, i.e. in the LSB of exp_q31, tanh_q31, sigmoid_q31.

Constants are written as raw integers beside the real expression they encode; tests/
test_fx_constants.py recomputes each one to 80 digits.
"""

import numpy as np

# -- error bounds, in output LSB, as integers over 2**BOUND_FRAC (a kernel holds no float) -------
BOUND_FRAC = 10
EXACT_LSB_Q10 = 0  # the integer primitives have one right answer
# 1/2 LSB for the final rounding + 2^-10 LSB for all earlier error (< 2^-11 by each analysis)
ONE_ROUNDING_LSB_Q10 = (1 << (BOUND_FRAC - 1)) + 1
EXP_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
SIGMOID_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
TANH_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
SILU_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
RSQRT_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
SOFTMAX_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
RMSNORM_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
L2NORM_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10
SINCOS_MAX_ERR_LSB_Q10 = ONE_ROUNDING_LSB_Q10

# -- formats -------------------------------------------------------------------------------------
ONE_Q62 = 1 << 62  # 1.0 in Q0.62
HALF_Q62 = 1 << 61  # 1/2 in Q0.62
ARG_FRAC = 56  # nonlinear arguments are converted to Q.56 (|x| <= 64 fits: 2^62)
OUT_SHIFT = 31  # Q0.62 -> Q0.31
MASK31 = (1 << 31) - 1
I64_MAX = (1 << 63) - 1
I32_MIN = -(1 << 31)
I32_MAX = (1 << 31) - 1
SOFTMAX_MAX_ROW = 1 << 20  # longest row the softmax bound covers (sums fit up to 2^31)

# -- constants (each: raw integer, the real expression) -----------------------------------------
LN2_Q56 = 49946518145322874  # round(ln 2 * 2**56)
LOG2E_Q26 = 96817625  # round(log2(e) * 2**26); only estimates k, which is then corrected
EXP_TABLE_STEP = 6  # the table holds e^(-j/64): 64 = 2**EXP_TABLE_STEP entries per unit
# EXP_TABLE[j] = round(exp(-j/64) * 2**62), j = 0..44 (ln 2 * 64 = 44.36)
EXP_TABLE = (
    4611686018427387904,
    4540188453729421605,
    4469799356029710115,
    4400501540140318564,
    4332278087304955805,
    4265112341068334641,
    4198987903209571687,
    4133888629738634021,
    4069798626954855183,
    4006702247566558211,
    3944584086870838351,
    3883428978992572748,
    3823221993181738881,
    3763948430168137758,
    3705593818572631895,
    3648143911374021882,
    3591584682430698961,
    3535902323056224374,
    3481083238647999443,
    3427114045368203260,
    3373981566876187687,
    3321672831111531860,
    3270175067126970821,
    3219475701970425034,
    3169562357615369557,
    3120422847938793425,
    3072045175746011435,
    3024417529841601942,
    2977528282145755564,
    2931365984855330749,
    2885919367648923101,
    2841177334935266083,
    2797128963144291325,
    2753763498060187135,
    2711070352195804117,
    2669039102207766849,
    2627659486351660544,
    2586921401976671383,
    2546814903059068855,
    2507330197773927898,
    2468457646104498006,
    2430187757488635638,
    2392511188501725296,
    2355418740575523594,
    2318901357752369368,
)
# EXP_TAYLOR[n] = round(2**62 / n!), n = 0..6: e^-rho = sum (-rho)^n / n!
EXP_TAYLOR = (
    4611686018427387904,
    4611686018427387904,
    2305843009213693952,
    768614336404564651,
    192153584101141163,
    38430716820228233,
    6405119470038039,
)
RECIP_INIT_A = 6510615555426900570  # round(24/17 * 2**62): Chebyshev line for 1/(2m) on [1/2, 1]
RECIP_INIT_B = 4340410370284600380  # round(16/17 * 2**62)
RSQRT_INIT_A = 17 << 58  # 17/16 * 2**62 exactly: the line 17/16 - 5/8 y for 1/(2 sqrt y)
RSQRT_INIT_B = 5 << 59  # 5/8 * 2**62 exactly
TWO_PI_Q59 = 3622009729038561421  # round(2 * pi * 2**59)
# SIN_TAYLOR[k] = round(2**62 / (2k+1)!), k = 0..8: sin p = p * sum (-p^2)^k / (2k+1)!
SIN_TAYLOR = (
    4611686018427387904,
    768614336404564651,
    38430716820228233,
    915017067148291,
    12708570377060,
    115532457973,
    740592679,
    3526632,
    12966,
)
# COS_TAYLOR[k] = round(2**62 / (2k)!), k = 0..8: cos p = sum (-p^2)^k / (2k)!
COS_TAYLOR = (
    4611686018427387904,
    2305843009213693952,
    192153584101141163,
    6405119470038039,
    114377133393536,
    1270857037706,
    9627704831,
    52899477,
    220414,
)


# == core primitives ============================================================================
def bitlen(x):
    """Number of significant bits of 0 <= x < 2**63 (0 for 0), by binary search. Exact."""
    n = 0
    v = x  # (a kernel never reassigns a parameter: Pythran's types then grow without bound)
    for step in (32, 16, 8, 4, 2, 1):
        if v >= (1 << step):
            v >>= step
            n += step
    return n + (1 if v > 0 else 0)


def rshift_round(x, s):
    """x / 2**s rounded half away from zero. Exact; 0 <= s <= 63; any x except -2**63.

    For x >= 0 this is floor(x/2^s + 1/2), for x < 0 ceil(x/2^s - 1/2) = floor((x-1)/2^s + 1/2).
    With y = x - [x < 0] both are floor((y + 2^(s-1)) / 2^s) = (y >> s) + bit s-1 of y, which
    never forms y + 2^(s-1) and so cannot overflow, even at x = 2^63 - 1.
    """
    if s <= 0:
        return x
    y = x + (x >> 63)
    return (y >> s) + ((y >> max(s - 1, 0)) & 1)


def saturate(x, bits):
    """Clamp x to the signed `bits`-bit range [-2**(bits-1), 2**(bits-1) - 1]; 1 <= bits <= 63."""
    hi = (1 << (bits - 1)) - 1
    return max(-hi - 1, min(x, hi))


def mul_mag_wide(a, b):
    """(hi, lo) with a*b = hi * 2**62 + lo, 0 <= lo < 2**62, for 0 <= a, b <= 2**62. Exact.

    31-bit limbs: a = ah 2^31 + al, b = bh 2^31 + bl. mid = ah bl + al bh + (al bl >> 31) stays
    below 2^63 - 2^32 because ah = 2^31 forces al = 0.
    """
    ah = a >> 31
    al = a & MASK31
    bh = b >> 31
    bl = b & MASK31
    lo = al * bl
    mid = ah * bl + al * bh + (lo >> 31)
    return ah * bh + (mid >> 31), ((mid & MASK31) << 31) | (lo & MASK31)


def mul_q62(a, b):
    """The Q0.62 high multiply: a*b / 2**62 rounded half away from zero. Exact.

    Domain |a|, |b| <= 2**62; the result has |.| <= 2**62. Four 31x31-bit products, no overflow
    (see mul_mag_wide); the rounding bit is bit 30 of mid.
    """
    neg = (a < 0) != (b < 0)
    ua = abs(a)
    ub = abs(b)
    ah = ua >> 31
    al = ua & MASK31
    bh = ub >> 31
    bl = ub & MASK31
    mid = ah * bl + al * bh + ((al * bl) >> 31)
    q = ah * bh + (mid >> 31) + ((mid >> 30) & 1)
    return -q if neg else q


def mul_round(a, b, s):
    """a*b / 2**s rounded half away from zero, from the exact 124-bit product. Exact.

    Domain |a|, |b| <= 2**62, 0 <= s <= 124, |result| < 2**62 (the caller's magnitudes).
    """
    neg = (a < 0) != (b < 0)
    hi, lo = mul_mag_wide(abs(a), abs(b))
    if s >= 62:
        t = s - 62
        if t == 0:
            q = hi + (lo >> 61)
        else:  # lo / 2^62 < 1 never moves floor((hi + 2^(t-1) + lo/2^62) / 2^t)
            q = (hi + (1 << max(t - 1, 0))) >> t
    elif s == 0:
        q = hi * (1 << 62) + lo
    else:
        q = hi * (1 << max(62 - s, 0)) + ((lo + (1 << max(s - 1, 0))) >> s)
    return -q if neg else q


def div_round(n, d):
    """n / d rounded half away from zero, for d >= 1. Exact; |n| < 2**63.

    Only non-negative operands ever reach `//` and `%`: q, r = |n| // d, |n| % d, and the
    quotient is rounded up when 2r >= d (r < d, so 2r cannot overflow for d < 2**62).
    """
    m = abs(n)
    q = m // d
    r = m - q * d
    if r >= d - r:
        q += 1
    return -q if n < 0 else q


def div_round_shift(n, d, s):
    """n * 2**s / d rounded half away from zero, by long division. Exact.

    Domain n >= 0, 1 <= d < 2**61, s >= 0, result < 2**62. The quotient is extended by chunks of
    62 - bitlen(d) bits, so the shifted remainder (< d) never exceeds 2**62. Outside the domain
    the result is unspecified, but the loop still ends: a chunk is at least 1 bit (a divisor of
    2**61 or more once made it 0 bits, and a faulted training step spun forever).
    """
    q = n // d
    r = n - q * d
    room = max(62 - bitlen(d), 1)
    left = s
    # long division, c bits at a time: q <- q 2^c + (r 2^c) // d, r <- (r 2^c) % d
    while left > 0:
        c = min(left, room)
        r <<= c
        step = r // d
        q = (q << c) + step
        r -= step * d
        left -= c
    if r >= d - r:
        q += 1
    return q


def isqrt(n):
    """floor(sqrt(n)) for 0 <= n < 2**63, by Newton's method on integers. Exact.

    x starts at 2**ceil(bitlen/2) >= sqrt(n); x <- (x + n // x) // 2 decreases strictly while
    x > floor(sqrt n) and stops there (the integer Newton step never undershoots it).
    """
    if n < 2:
        return max(n, 0)
    x = 1 << ((bitlen(n) + 1) >> 1)
    # x <- (x + n // x) // 2 until it stops decreasing
    while True:
        y = (x + n // x) >> 1
        if y >= x:
            return x
        x = y


def recip_q62(m):
    """1 / (2m) in Q0.62 for m in Q0.62 with 2**61 <= m <= 2**62 (so the result is in [1/2, 1]).

    Newton h <- h (2 - 2 m h) from the Chebyshev line h0 = 24/17 - 16/17 m, whose relative error
    is at most 1/17; each step squares it: (1/17)^16 < 2^-65. Each step adds at most 1.5 * 2^-62
    of rounding, so |h - 1/(2m)| <= 2^-60.5. h is clamped to 2^62 (rounding overshoot at m = 1/2).
    """
    h = RECIP_INIT_A - mul_q62(RECIP_INIT_B, m)
    # h <- h + h (1 - 2 m h)
    for _ in range(4):
        w = mul_q62(m, h)  # m h ~ 1/2; the relative error eps = 1 - 2 m h
        h = min(h + mul_q62(h, ONE_Q62 - 2 * w), ONE_Q62)
    return h


# == exp, sigmoid, tanh, SiLU ===================================================================
def arg_q56(x, frac, limit):
    """x * 2**-frac converted to Q.56 and clamped to [-limit, limit] (limit 32 or 64). Exact.

    For frac <= 56 the conversion is an exact left shift, done only after the clamp test, so
    |result| <= limit * 2^56 <= 2^62. For 56 < frac <= 62 it is rshift_round (error 2^-57).
    """
    top = limit << ARG_FRAC
    if frac > ARG_FRAC:
        v = rshift_round(x, frac - ARG_FRAC)
        return max(-top, min(v, top))
    lim = limit << frac
    if x >= lim:
        return top
    if x <= -lim:
        return -top
    return x * (1 << max(ARG_FRAC - frac, 0))


def exp_neg_q62(t):
    """e^(-t) in Q0.62 for t in Q.56 with 0 <= t <= 64 * 2**56 (2**62).

    Cody-Waite reduction: t = k ln 2 + r with 0 <= r < ln 2, the remainder exact against
    LN2_Q56; then r = j/64 + rho, e^-r = EXP_TABLE[j] * e^-rho with e^-rho from its Taylor
    series to rho^6 (rho < 2^-6), and a final rounding shift by k.
    Error: truncation rho^7/7! < 2^-54.2; LN2_Q56's rounding, k * 2^-57 relative, is at most
    2^-58 after the shift by k; coefficients, table and 8 roundings < 2^-60.
    So |result * 2^-62 - e^-t| <= 2^-54 e^-t + 2^-62.
    """
    k = ((t >> 26) * LOG2E_Q26) >> 56  # estimate of floor(t / ln 2), off by at most one
    r = t - k * LN2_Q56
    if r < 0:
        k -= 1
        r += LN2_Q56
    elif r >= LN2_Q56:
        k += 1
        r -= LN2_Q56
    if k > 62:
        return 0  # e^-t < 2^-63: below half an LSB of Q0.62
    j = r >> (ARG_FRAC - EXP_TABLE_STEP)
    rho = (r - (j << (ARG_FRAC - EXP_TABLE_STEP))) << (62 - ARG_FRAC)  # Q0.62, < 2^56
    # e^-rho = 1 - rho (1 - rho (1/2! - rho (1/3! - ...)))  (Horner, all partial sums > 0)
    p = EXP_TAYLOR[6]
    for n in range(5, -1, -1):
        p = EXP_TAYLOR[n] - mul_q62(rho, p)
    return rshift_round(mul_q62(EXP_TABLE[j], p), k)


def exp_q31(x, frac):
    """e^x in Q0.31 ([0, 2**31], 2**31 = 1.0) for x <= 0 in Q.frac, 0 <= frac <= 62.

    x > 0 is outside the domain and is treated as 0 (result 2**31); x < -64 gives 0.
    Error <= 1/2 LSB (final rounding) + 2^31 (2^-54 + 2^-62) < 1/2 + 2^-22 LSB: EXP_MAX_ERR.
    """
    t = -arg_q56(min(x, 0), frac, 64)
    return rshift_round(exp_neg_q62(t), OUT_SHIFT)


def sigmoid_q62(x, frac):
    """sigma(x) = 1/(1 + e^-x) in Q0.62 for x in Q.frac, 0 <= frac <= 62; |x| >= 64 saturates.

    For x >= 0: m = (1 + e^-x)/2 in [1/2, 1] (formed as 2^61 + (e + 1) >> 1: 2^62 + e would
    overflow at x = 0) and sigma = 1/(2m) by recip_q62; for x < 0,
    sigma(x) = 1 - sigma(-x) exactly. Error: e^-|x|'s 2^-54 e + 2^-62 times sigma^2 (<= 1/4
    relative), m's rounding 2^-63, recip's 2^-60.5, the clamp's e^-64: below 2^-55 absolute.
    """
    t = arg_q56(x, frac, 64)
    e = exp_neg_q62(abs(t))
    s = recip_q62(HALF_Q62 + ((e + 1) >> 1))
    return s if t >= 0 else ONE_Q62 - s


def sigmoid_q31(x, frac):
    """sigma(x) in Q0.31 ([0, 2**31]) for x in Q.frac, 0 <= frac <= 62. Any x (saturates).

    sigma(-x) = 2**31 - sigma(x) exactly: the side x >= 0 is rounded once, the other side is its
    exact complement, so both carry the same error (computed as in sigmoid_q62).
    Error <= 1/2 + 2^31 * 2^-55 = 1/2 + 2^-24 LSB: SIGMOID_MAX_ERR.
    """
    t = arg_q56(x, frac, 64)
    e = exp_neg_q62(abs(t))
    s = rshift_round(recip_q62(HALF_Q62 + ((e + 1) >> 1)), OUT_SHIFT)
    return s if t >= 0 else (1 << OUT_SHIFT) - s


def tanh_q62(x, frac):
    """tanh(x) in Q0.62 for x in Q.frac, 0 <= frac <= 62; |x| >= 32 saturates to +-1.

    tanh|x| = 2/(1 + e^-2|x|) - 1 = 2 recip_q62((1 + e^-2|x|)/2) - 1, with the sign applied
    after (odd exactly). Error: twice sigmoid's, plus the clamp's 2e^-64: < 2^-54 absolute.
    """
    a = arg_q56(x, frac, 32)
    e = exp_neg_q62(2 * abs(a))
    s = recip_q62(HALF_Q62 + ((e + 1) >> 1))
    t = 2 * (s - HALF_Q62)
    return t if a >= 0 else -t


def tanh_q31(x, frac):
    """tanh(x) in Q0.31 ([-2**31, 2**31]) for x in Q.frac, 0 <= frac <= 62. Any x (saturates).

    Error <= 1/2 + 2^31 * 2^-54 = 1/2 + 2^-23 LSB: TANH_MAX_ERR. Odd bit for bit.
    """
    return rshift_round(tanh_q62(x, frac), OUT_SHIFT)


def silu_q(x, frac):
    """SiLU(x) = x sigma(x) in Q.frac (the input's own format), 0 <= frac <= 62; |x| <= 2**62.

    One rounding of x * sigma62 / 2^62. Error <= 1/2 + |x_raw| 2^-55 LSB, below SILU_MAX_ERR
    for |x_raw| <= 2^44 (the gate proves |x_raw| <= 2^36, where float64 can still tell).
    """
    return mul_round(x, sigmoid_q62(x, frac), 62)


# == square roots ===============================================================================
def rsqrt_norm(x, frac):
    """1/sqrt(x * 2**-frac) as (h, e): value = h * 2**-e with 2**61 <= h <= 2**62. x >= 1.

    x is normalised to y = x 2^sh / 2^62 in [1/4, 1] with frac + sh even, so
    1/sqrt(x 2^-frac) = 2 h_y 2^((frac + sh)/2 - 31), h_y = 1/(2 sqrt y) in [1/2, 1].
    Newton h <- h (3/2 - 2 y h^2), five steps from the line 17/16 - 5/8 y (relative error
    <= 1/8): 1/8 -> 2^-5.4 -> 2^-10.1 -> 2^-19.7 -> 2^-38.8 -> 2^-77, plus 1.5 * 2^-62 rounding
    per step: relative error of h below 2^-59.5. x >= 2^62 loses its low bits (2^-61).
    """
    b = bitlen(x)
    sh = 62 - b
    if (sh + frac) & 1:
        sh -= 1
    y = x << sh if sh >= 0 else rshift_round(x, -sh)
    h = RSQRT_INIT_A - mul_q62(RSQRT_INIT_B, y)
    # h <- h + h (1/2 - 2 y h^2)
    for _ in range(5):
        q = mul_q62(y, mul_q62(h, h))  # y h^2 ~ 1/4
        h = min(h + mul_q62(h, HALF_Q62 - 2 * q), ONE_Q62)
    return h, 92 - ((frac + sh) >> 1)


def rsqrt_q(x, frac_in, frac_out):
    """1/sqrt(x) for x > 0 in Q.frac_in, as Q.frac_out. x <= 0 is outside the domain: -1.

    Error <= 1/2 + |result_raw| 2^-59.5 LSB: below RSQRT_MAX_ERR for results < 2^40 raw.
    A result that would not fit (>= 2^62) saturates to 2^63 - 1.
    """
    if x <= 0:
        return -1
    h, e = rsqrt_norm(x, frac_in)
    s = e - frac_out
    if s < 0:
        return I64_MAX
    if s > 63:
        return 0
    return rshift_round(h, s)


# == rows: softmax, RMSNorm, L2 normalisation ===================================================
def softmax_row_q31(x, i, n, frac, out):
    """out[i, :n] = softmax(x[i, :n]) in Q0.31, for x in Q.frac with |x| < 2**61, 1 <= n < 2**31.

    Max-subtract (so every term is e^d with d <= 0, the largest exactly 1), e^d in Q0.62, the sum
    held exactly as two int64 halves (hi: bits 31.., lo: bits 0..30; each < n 2^31), then one
    reciprocal of the sum's top 62 bits and one rounding per term. Error <= 1/2 + 2^31
    (2 * 2^-54 + n 2^-63 + 2^-60) LSB: below SOFTMAX_MAX_ERR for n <= 2^20.
    """
    m = int(x[i, 0])
    # m = max_j x_j
    for j in range(1, n):
        m = max(m, int(x[i, j]))
    hi = 0
    lo = 0
    for j in range(n):
        # e_j = exp(x_j - max), held in out until the sum is known
        e = exp_neg_q62(-arg_q56(int(x[i, j]) - m, frac, 64))
        out[i, j] = e
        hi += e >> 31
        lo += e & MASK31
    # S = sum e_j = hi 2^31 + lo exactly, S >= 2^62; sm = top 62 bits of S, S ~ sm 2^(z-31)
    hi += lo >> 31
    lo &= MASK31
    z = bitlen(hi)
    sm = (hi << (62 - z)) + (lo >> (z - 31))
    h = recip_q62(sm)  # 2^123 / sm
    # p_j = e_j / S = e_j h / 2^(61 + z) in Q0.31
    for j in range(n):
        out[i, j] = mul_round(int(out[i, j]), h, 61 + z)
    return z


def sum_squares_row(x, i, n, eps, acc_shift):
    """n eps + sum_j x[i, j]^2 / 2^acc_shift, each square rounded (exact when acc_shift = 0).

    With acc_shift = k the squares are in Q.(2f - k), so a row whose exact sum would pass 2^62
    still fits; each rounding moves the sum by at most 1/2, n/2 in all. The caller keeps the
    result below 2^62 (|x| <= 2^31, so one square never overflows).
    """
    acc = n * eps
    # acc = n eps + sum_j round(x_j^2 / 2^acc_shift)
    for j in range(n):
        v = int(x[i, j])
        acc += rshift_round(v * v, acc_shift)
    return acc


def rms_rsqrt_row(x, i, n, eps, frac, acc_shift):
    """1/sqrt(mean(x[i, :n]^2) + eps) as (h, e), value h 2^-e; x in Q.frac, eps in
    Q.(2 frac - acc_shift).

    The mean is one long division carried to 60..62 significant bits (relative error 2^-61),
    then rsqrt_norm. A zero sum (zero row, eps = 0) returns (0, 0), so its outputs are 0.
    """
    acc = sum_squares_row(x, i, n, eps, acc_shift)
    if acc <= 0:
        return 0, 0
    s = max(0, 61 - bitlen(acc) + bitlen(n))
    return rsqrt_norm(div_round_shift(acc, n, s), 2 * frac - acc_shift + s)


def rmsnorm_row(x, i, w, eps, fx, fw, fy, acc_shift, out):
    """out[i] = w * x[i] * rsqrt(mean(x[i]^2) + eps) in Q.fy (K3-SPEC section 4, RMSNorm).

    x in Q.fx, w in Q.fw, |x|, |w| <= 2^31; eps in Q.(2 fx - acc_shift); the sum of squares
    (sum_squares_row) below 2^62. One rounding per output of x w h / 2^(e + fx + fw - fy).
    Error <= 1/2 + |y_raw| 2^-59 LSB, below RMSNORM_MAX_ERR for |y_raw| < 2^40, with an exact
    sum (acc_shift = 0); acc_shift > 0 adds |y_raw| n / (4 acc) LSB (acc the rounded sum).
    """
    n = x.shape[1]
    h, e = rms_rsqrt_row(x, i, n, eps, fx, acc_shift)
    s = e + fx + fw - fy
    # y_j = x_j w_j h / 2^s
    for j in range(n):
        p = int(x[i, j]) * int(w[j])
        out[i, j] = 0 if s > 124 or h == 0 else mul_round(p, h, max(s, 0))
    return s


def l2norm_row(x, i, eps, fx, fy, acc_shift, out):
    """out[i] = x[i] * rsqrt(sum(x[i]^2) + eps) in Q.fy (K3-SPEC section 1: q, k L2-normalised).

    x in Q.fx, |x| <= 2^31; eps in Q.(2 fx - acc_shift); the sum below 2^62. Error <= 1/2 +
    |y_raw| 2^-59 LSB: below L2NORM_MAX_ERR for |y_raw| < 2^40 (fy <= 39) with acc_shift = 0;
    acc_shift > 0 adds |y_raw| n / (4 acc) LSB, as in rmsnorm_row.
    """
    n = x.shape[1]
    acc = sum_squares_row(x, i, n, 0, acc_shift) + eps
    h = 0
    e = 0
    if acc > 0:
        h, e = rsqrt_norm(acc, 2 * fx - acc_shift)
    s = e + fx - fy
    # y_j = x_j h / 2^s
    for j in range(n):
        out[i, j] = 0 if s > 124 or h == 0 else mul_round(int(x[i, j]), h, max(s, 0))
    return s


# == sin / cos of a phase in turns ==============================================================
def sincos_q62(p):
    """(sin, cos) of the angle 2 pi p / 2**62 for a phase 0 <= p < 2**62 (turns in Q0.62).

    The octant o = p >> 59 is exact range reduction; phi = 2 pi f in [0, pi/4] with f the
    offset into the octant (mirrored in odd octants), then Taylor to phi^17 (sin) and phi^16
    (cos), Horner in u = phi^2. Error: truncation < 2^-54.3, 2 pi's rounding 2^-61.6, roundings
    < 2^-59: below 2^-54 absolute.
    """
    o = p >> 59
    f = p & ((1 << 59) - 1)
    if o & 1:
        f = (1 << 59) - f
    phi = mul_round(f, TWO_PI_Q59, 59)  # Q0.62 radians, <= pi/4
    u = mul_q62(phi, phi)
    # sin phi = phi (1 - u/3! + u^2/5! - ...), cos phi = 1 - u/2! + u^2/4! - ...
    s = SIN_TAYLOR[8]
    c = COS_TAYLOR[8]
    for k in range(7, -1, -1):
        s = SIN_TAYLOR[k] - mul_q62(u, s)
        c = COS_TAYLOR[k] - mul_q62(u, c)
    s = mul_q62(phi, s)
    # octant o covers [o pi/4, (o+1) pi/4): swap in octants 1, 2, 5, 6; signs by quadrant
    if o == 1 or o == 2 or o == 5 or o == 6:
        s, c = c, s
    if o >= 4:
        s = -s
    if o >= 2 and o <= 5:
        c = -c
    return s, c


def sincos_q31(phase, bits):
    """(sin, cos) in Q0.31 of 2 pi phase / 2**bits, the phase taken mod 2**bits, 1 <= bits <= 62.

    Any int64 phase: only its low `bits` bits count, as an unsigned number of 2^-bits turns, so a
    phase accumulator may wrap (RoPE: (m omega) mod 2^bits). Error <= 1/2 + 2^-23 LSB:
    SINCOS_MAX_ERR. sin(p + half turn) = -sin(p) and cos(p) = sin(p + quarter turn) exactly.
    """
    p = (phase & ((1 << bits) - 1)) << (62 - bits)
    s, c = sincos_q62(p)
    return rshift_round(s, OUT_SHIFT), rshift_round(c, OUT_SHIFT)


# == exported array versions (the library face and the gates call these) ========================
# pythran export rshift_round_array(int64[:], int64)
def rshift_round_array(x, s):
    """rshift_round over an array."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    for i in range(x.shape[0]):
        out[i] = rshift_round(int(x[i]), s)
    return out


# pythran export mul_round_array(int64[:], int64[:], int64)
def mul_round_array(a, b, s):
    """mul_round elementwise (s = 62 is mul_q62)."""
    out = np.zeros(a.shape[0], dtype=np.int64)
    for i in range(a.shape[0]):
        out[i] = mul_round(int(a[i]), int(b[i]), s)
    return out


# pythran export mul_q62_array(int64[:], int64[:])
def mul_q62_array(a, b):
    """mul_q62 elementwise."""
    out = np.zeros(a.shape[0], dtype=np.int64)
    for i in range(a.shape[0]):
        out[i] = mul_q62(int(a[i]), int(b[i]))
    return out


# pythran export div_round_array(int64[:], int64[:])
def div_round_array(n, d):
    """div_round elementwise (every d >= 1)."""
    out = np.zeros(n.shape[0], dtype=np.int64)
    for i in range(n.shape[0]):
        out[i] = div_round(int(n[i]), int(d[i]))
    return out


# pythran export div_round_shift_array(int64[:], int64[:], int64[:])
def div_round_shift_array(n, d, s):
    """div_round_shift elementwise."""
    out = np.zeros(n.shape[0], dtype=np.int64)
    for i in range(n.shape[0]):
        out[i] = div_round_shift(int(n[i]), int(d[i]), int(s[i]))
    return out


# pythran export narrow_int32(int64[:])
def narrow_int32(x):
    """Saturating narrowing to int32: (clamped values, number of values that were clamped)."""
    out = np.zeros(x.shape[0], dtype=np.int32)
    count = 0
    for i in range(x.shape[0]):
        v = int(x[i])
        if v < I32_MIN or v > I32_MAX:
            count += 1
        out[i] = max(I32_MIN, min(v, I32_MAX))
    return out, count


# pythran export isqrt_array(int64[:])
def isqrt_array(n):
    """isqrt elementwise (every n >= 0)."""
    out = np.zeros(n.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(n.shape[0]):
        out[i] = isqrt(int(n[i]))
    return out


# pythran export exp_q31_array(int64[:], int64)
def exp_q31_array(x, frac):
    """exp_q31 elementwise."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = exp_q31(int(x[i]), frac)
    return out


# pythran export sigmoid_q31_array(int64[:], int64)
def sigmoid_q31_array(x, frac):
    """sigmoid_q31 elementwise."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = sigmoid_q31(int(x[i]), frac)
    return out


# pythran export tanh_q31_array(int64[:], int64)
def tanh_q31_array(x, frac):
    """tanh_q31 elementwise."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = tanh_q31(int(x[i]), frac)
    return out


# pythran export silu_array(int64[:], int64)
def silu_array(x, frac):
    """silu_q elementwise."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = silu_q(int(x[i]), frac)
    return out


# pythran export rsqrt_array(int64[:], int64[:], int64[:])
def rsqrt_array(x, frac_in, frac_out):
    """rsqrt_q elementwise, each element with its own formats."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = rsqrt_q(int(x[i]), int(frac_in[i]), int(frac_out[i]))
    return out


# pythran export softmax_q31(int64[:,:] order(C), int64)
def softmax_q31(x, frac):
    """Row softmax of x in Q.frac, as Q0.31 (see softmax_row_q31)."""
    out = np.zeros((x.shape[0], x.shape[1]), dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        softmax_row_q31(x, i, x.shape[1], frac, out)
    return out


# pythran export rmsnorm(int64[:,:] order(C), int64[:], int64, int64, int64, int64, int64)
def rmsnorm(x, w, eps, fx, fw, fy, acc_shift):
    """RMSNorm of each row (see rmsnorm_row)."""
    out = np.zeros((x.shape[0], x.shape[1]), dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        rmsnorm_row(x, i, w, eps, fx, fw, fy, acc_shift, out)
    return out


# pythran export l2norm(int64[:,:] order(C), int64, int64, int64, int64)
def l2norm(x, eps, fx, fy, acc_shift):
    """L2 normalisation of each row (see l2norm_row)."""
    out = np.zeros((x.shape[0], x.shape[1]), dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        l2norm_row(x, i, eps, fx, fy, acc_shift, out)
    return out


# pythran export sincos_q31_array(int64[:], int64)
def sincos_q31_array(phase, bits):
    """sincos_q31 elementwise: (sin, cos)."""
    s = np.zeros(phase.shape[0], dtype=np.int64)
    c = np.zeros(phase.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(phase.shape[0]):
        s[i], c[i] = sincos_q31(int(phase[i]), bits)
    return s, c
