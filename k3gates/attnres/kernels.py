"""Block Attention Residuals (K3-SPEC.md section 3; arXiv 2603.15031) in integers only.

    h = sum_i alpha_i v_i,   alpha = softmax_i(s_i),   s_i = k_i . w,
    k_i = v_i rsqrt(mean(v_i^2) + eps)        (RMS-normalised keys, no norm weight)

over the n sources v_i of one token (K3: the stored block sums, then the running prefix), with w the
pseudo-query (K3: norm_w * proj_w, one per sublayer). The output mixes the un-normalised v_i.

Formats (int64 throughout):
    v, h         Q.fv (caller's choice), |v_raw| <= 2^30 (V_MAX)   h is in v's own format
    w            Q.fw (caller's choice), |w_raw| <= 2^31
    eps          Q.(2 fv), 0 <= eps_raw < 2^62                       added to mean(v^2)
    s (scores)   Q.52 (SCORE_FRAC), |s| < 2^9: saturated beyond, and counted
    alpha        Q0.62 inside, Q0.31 out (2^31 = 1.0)
    keys         Q.fk (caller's choice), |k_raw| < 2^40; |k| <= sqrt(d)
    g = dL/dh    Q.fg (caller's choice), |g_raw| <= 2^30
    dL/dw        Q.fd, fd returned: the worst case |dL/dw_raw| < 2^32 (GRAD_OUT_BITS)
Shapes: n <= 16 sources (MAX_SOURCES; K3 has at most 8 stored blocks + the prefix), d < 2^20,
n T <= 2^14 for the gradient (MAX_GRAD_TERMS).

Rounding: fx's rshift_round / mul_round, half away from zero, so every map here is odd in w (and
the gradient odd in g) bit for bit. Division only by the positive d (the mean).

Wide sums. sum_j v_j^2 (up to d 2^60) and the dots sum_j v_j w_j, sum_j g_j v_j (up to d 2^61)
do not fit int64, so each product p is split exactly as (p >> 31) 2^31 + (p & (2^31 - 1)) and
the two halves are summed apart (`hi`, `lo`: exact for d < 2^31). `wide_top` reads such a sum as
m 2^z with |m| < 2^62 (truncated toward zero: relative error < 2^-61, none when it fits);
`wide_round` divides it by 2^s exactly rounded.

The steps and their errors, per token:
 1. r_i = rsqrt(mean(v_i^2) + eps) = h 2^-e (rms_rsqrt_src): the exact wide sum, its top 62
    bits (2^-61), one long division by d (2^-62), fx's rsqrt_norm (2^-59.5): relative error
    rho < 2^-59.1. A zero row with eps = 0 gives r = 0 (key 0, score 0).
 2. s_i = r_i (v_i . w) (score_q52): the exact wide dot, its top 62 bits (2^-61), one rounding
    into Q.52: |s - s_exact| <= 2^-53 + |s| 2^-58.8 < 2^-49.6 for |s| < 2^9.
 3. alpha = softmax over depth in Q0.62 (softmax_row_q62: fx's softmax_row_q31 algorithm,
    rounded into Q0.62 instead of Q0.31): against the softmax of the Q.52 scores,
    |alpha - exact| <= 2^-53 alpha + (n/2 + 4) 2^-62 + 2^-63; the score error moves each
    alpha by at most (e^(2 2^-49.6) - 1) alpha < 2^-48.5 alpha. So |Delta alpha| < 2^-48.4.
 4. h_j = sum_i alpha_i v_ij (token_mix): each product rounded into Q.(fv + 27) (MIX_GUARD;
    |term| < 2^57, the sum of n <= 16 < 2^62), one rounding into Q.fv.
The bounds, in output LSB, as integers over 2^BOUND_FRAC (a kernel holds no float):
    KEY_MAX_ERR      keys, Q.fk       1/2 + |k_raw| rho                       513/1024 (|k_raw| < 2^40)
    ALPHA_MAX_ERR    alpha, Q0.31     1/2 + 2^31 2^-48.4 = 1/2 + 2^-17.4      513/1024
    MIX_MAX_ERR      h, Q.fv          1/2 + n 2^-28 + 2^30 sum_i |Delta alpha_i|
                                      <= 1/2 + 2^-24 + 2^30 2^-48.4 = 1/2 + 2^-18.3   513/1024
    weights_sum_bound(n)  |sum_i alpha_i - 2^31| in Q0.31 LSB: n times ALPHA_MAX_ERR
    GRAD_MAX_ERR     dL/dw, Q.fd      see attnres_grad_w                        513/1024
Each is 1/2 LSB for the final rounding plus the 2^-10 margin fx uses; the analyses leave every
earlier error below 2^-12 LSB.

Exact cases (gated bit for bit): one source gives alpha = 2^31 and h = v. (In Q0.62 its weight
is 2^62 - 1: fx's recip_q62 of 1/2 lands one unit short of 1; the mix's term rounds
v (2^62 - 1) / 2^35 = v 2^27 - v 2^-35 back to v 2^27 exactly for |v_raw| < 2^34.) A zero
pseudo-query with n = 2^k >= 2 gives alpha = 2^(62-k) exactly (round(2^(62-k) - 2^-k)) and
h = rshift_round(sum_i v_i, k), the exactly rounded mean; scaling a source by 2^k with eps = 0
leaves its key bit-identical (the wide sum keeps the same top bits, r moves by 2^-k exactly).
"""

import numpy as np

from ..fx.kernels import (
    ARG_FRAC,
    MASK31,
    bitlen,
    div_round_shift,
    exp_neg_q62,
    mul_round,
    recip_q62,
    rshift_round,
    rsqrt_norm,
    tanh_q31,
)

BOUND_FRAC = 10
KEY_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10 LSB
ALPHA_MAX_ERR_LSB_Q10 = 513
MIX_MAX_ERR_LSB_Q10 = 513
GRAD_MAX_ERR_LSB_Q10 = 513

V_MAX = 1 << 30  # |v_raw|, |g_raw| <= 2^30
W_MAX = 1 << 31  # |w_raw| <= 2^31
SCORE_FRAC = 52  # scores in Q.52
SCORE_MAX_BITS = 9  # |s| < 2^9 = 512; |s_raw| < 2^61 (fx's softmax domain)
SCORE_CLAMP = (1 << (SCORE_FRAC + SCORE_MAX_BITS)) - 1
ARG_CLAMP = 64 << SCORE_FRAC  # score differences past 64: e^-64 < 2^-92 is 0 in Q0.62
MIX_GUARD = 27  # the mix's terms in Q.(fv + 27)
MAX_SOURCES = 16
ALPHA_OUT_SHIFT = 31  # Q0.62 -> Q0.31
U_BITS = 60  # the gradient holds u = g . v per token with max |u_raw| in [2^59, 2^60)
GRAD_OUT_BITS = 32  # worst-case |dL/dw_raw| < 2^32
GRAD_GUARD = 28  # the gradient's terms in Q.(fd + 28): |term| < 2^(32 + 28) = 2^60
MAX_GRAD_TERMS = 1 << 14  # n T

# the stand-in stack (attnres_stack): activations Q.24, pseudo-queries Q.24, matrices Q.fm
STACK_FRAC = 24
STACK_W_FRAC = 24
XN_FRAC = 24  # the sublayer's RMSNorm output
TANH_CLAMP = 32 << (STACK_FRAC + XN_FRAC)  # tanh_q31 is exactly +-1 for |z| >= 32


def weights_sum_bound_q10(n):
    """|sum_i alpha_i - 2^31| in Q0.31 LSB over 2^10: each alpha within ALPHA_MAX_ERR of its
    exact value, and the exact values sum to one."""
    return n * ALPHA_MAX_ERR_LSB_Q10


# == wide (two-limb) sums ======================================================================
def wide_mag(hi, lo):
    """(sign, H, L) of the value hi 2^31 + lo, |value| = H 2^31 + L with 0 <= L < 2^31. Exact.

    hi is any int64 with |hi| < 2^61 (a sum of products' high halves), lo >= 0 (a sum of low
    halves, each < 2^31).
    """
    h = hi + (lo >> 31)
    low = lo & MASK31
    if h >= 0:
        return 1, h, low
    if low == 0:
        return -1, -h, 0
    return -1, -h - 1, (1 << 31) - low


def wide_top(hi, lo):
    """(m, z) with hi 2^31 + lo = m 2^z + rest, |m| < 2^62, m truncated toward zero.

    (Shift counts are written max(., 0) here and below: Pythran's range analysis rejects a left
    shift whose count it cannot prove non-negative.)

    Exact (z = 0) when |value| < 2^62; otherwise the low z bits are dropped: relative error
    below 2^-61. Odd: the magnitude is truncated and the sign put back.
    """
    sign, h, low = wide_mag(hi, lo)
    if h < (1 << 31):
        return sign * ((h << 31) | low), 0
    b = bitlen(h)
    z = b - 31
    return sign * ((h << max(62 - b, 0)) | (low >> max(z, 0))), z


def wide_round(hi, lo, s):
    """(hi 2^31 + lo) / 2^s rounded half away from zero. Exact; the result must fit int64.

    On the magnitude H 2^31 + L: s >= 32 adds 2^(s-1) into H (L / 2^31 < 1 never moves the
    floor), 1 <= s <= 31 into L; s < 0 is an exact left shift (value < 2^62 there).
    """
    sign, h, low = wide_mag(hi, lo)
    # (every shift is written max(., 0): Pythran folds constant shifts in unreachable branches)
    if s > 92:
        q = 0  # |value| < 2^92
    elif s >= 32:
        q = (h + (1 << max(s - 32, 0))) >> max(s - 31, 0)
    elif s >= 1:
        q = (h << max(31 - s, 0)) + ((low + (1 << max(s - 1, 0))) >> max(s, 0))
    else:
        q = ((h << 31) + low) << max(-s, 0)
    return sign * q


def mul_shift(a, b, s):
    """a b / 2^s rounded half away from zero, for any s (s < 0: the exact product shifted
    left). Domain as mul_round: |a|, |b| <= 2^62 and |result| < 2^62."""
    if s > 124:
        return 0
    if s >= 0:
        return mul_round(a, b, s)
    return mul_round(a, b, 0) << max(-s, 0)


# == one source: its RMS and its score =========================================================
def rms_rsqrt_src(v, i, t, eps, fv):
    """r = rsqrt(mean(v[i, t, :]^2) + eps) as (h, e), value h 2^-e, 2^61 <= h <= 2^62.

    v in Q.fv (|v_raw| <= 2^30), eps in Q.(2 fv). The sum d eps + sum_j v_j^2 is exact (wide),
    read as m 2^z (2^-61), divided by d into 60..62 significant bits (2^-62) and handed to
    fx's rsqrt_norm (2^-59.5): relative error < 2^-59.1. Zero sum: (0, 0).
    """
    d = v.shape[2]
    hi = (eps >> 31) * d
    lo = (eps & MASK31) * d
    # d eps + sum_j v_j^2, in two exact 31-bit halves
    for j in range(d):
        x = int(v[i, t, j])
        q = x * x
        hi += q >> 31
        lo += q & MASK31
    m, z = wide_top(hi, lo)
    if m <= 0:
        return 0, 0
    s = max(0, 61 - bitlen(m) + bitlen(d))
    # mean + eps = (m 2^z / d) 2^-2fv = (m 2^s / d) 2^-(2 fv - z + s)
    return rsqrt_norm(div_round_shift(m, d, s), 2 * fv - z + s)


def score_q52(v, i, t, w, fv, fw, h, e):
    """s = r (v[i, t, :] . w) in Q.52, and 1 if it saturated at |s| = 2^9 (else 0).

    The dot is exact (wide), read as m 2^z (2^-61), and multiplied by r = h 2^-e with one
    rounding: |s - r (v . w)| <= 2^-53 + |s| 2^-61 (plus r's own relative error rho).
    """
    d = v.shape[2]
    hi = 0
    lo = 0
    # v . w, in two exact 31-bit halves
    for j in range(d):
        p = int(v[i, t, j]) * int(w[j])
        hi += p >> 31
        lo += p & MASK31
    m, z = wide_top(hi, lo)
    if m == 0 or h == 0:
        return 0, 0
    shift = e + fv + fw - z - SCORE_FRAC
    if bitlen(abs(m)) + bitlen(h) - shift > SCORE_FRAC + SCORE_MAX_BITS:
        return (SCORE_CLAMP if m > 0 else -SCORE_CLAMP), 1
    s = mul_shift(m, h, shift)
    c = max(-SCORE_CLAMP, min(s, SCORE_CLAMP))
    return c, (1 if c != s else 0)


# == the depth softmax, and the mix ============================================================
def softmax_row_q62(x, i, n):
    """x[i, :n] <- softmax(x[i, :n]) in Q0.62, in place; x in Q.52 with |x| < 2^61.

    fx's softmax_row_q31, rounded into Q0.62: max-subtract, e^d in Q0.62, the sum held exactly
    in two halves, one reciprocal of its top 62 bits, one rounding per term. Error
    <= 1/2 + 2^62 (2 2^-54 + n 2^-63 + 2^-60) LSB of Q0.62, below 2^-52.9 absolute for n <= 16.
    The differences are moved to fx's Q.56 argument format by an exact shift after clamping at
    64, where e^-64 is already 0 in Q0.62 (fx's arg_q56 with a constant frac < 56 does not
    compile: Pythran folds the negative shift of its dead branch).
    """
    m = int(x[i, 0])
    # m = max_j x_j
    for j in range(1, n):
        m = max(m, int(x[i, j]))
    hi = 0
    lo = 0
    for j in range(n):
        # e_j = exp(x_j - max) in Q0.62, held in x until the sum is known
        e = exp_neg_q62(min(m - int(x[i, j]), ARG_CLAMP) << (ARG_FRAC - SCORE_FRAC))
        x[i, j] = e
        hi += e >> 31
        lo += e & MASK31
    hi += lo >> 31
    lo &= MASK31
    z = bitlen(hi)  # >= 32: the largest term is exactly 2^62
    sm = (hi << max(62 - z, 0)) + (lo >> max(z - 31, 0))
    h = recip_q62(sm)  # 2^123 / sm
    # alpha_j = e_j / S = e_j h / 2^(30 + z) in Q0.62
    for j in range(n):
        x[i, j] = mul_round(int(x[i, j]), h, 30 + z)
    return z


def token_alpha(v, n, t, w, eps, fv, fw, a62):
    """a62[t, :n] = softmax_i(r_i (v_i . w)) in Q0.62 for token t; returns the saturated count."""
    sat = 0
    for i in range(n):
        h, e = rms_rsqrt_src(v, i, t, eps, fv)
        s, c = score_q52(v, i, t, w, fv, fw, h, e)
        a62[t, i] = s
        sat += c
    softmax_row_q62(a62, t, n)
    return sat


def token_mix(v, n, t, a62, out):
    """out[t, :] = sum_i alpha_i v[i, t, :] in v's format: terms in Q.(fv + 27), one rounding."""
    d = v.shape[2]
    for j in range(d):
        acc = 0
        # h_j = sum_i alpha_i v_ij
        for i in range(n):
            acc += mul_round(int(a62[t, i]), int(v[i, t, j]), 62 - MIX_GUARD)
        out[t, j] = rshift_round(acc, MIX_GUARD)
    return 0


# == exported: keys, forward ===================================================================
# pythran export attnres_keys(int64[:,:,:] order(C), int64, int64, int64)
def attnres_keys(v, eps, fv, fk):
    """keys[i, t, :] = v[i, t, :] rsqrt(mean(v[i, t, :]^2) + eps) in Q.fk, v [n, T, d] in Q.fv.

    One rounding of v h / 2^(e + fv - fk): error <= 1/2 + |k_raw| 2^-59.1 LSB, within
    KEY_MAX_ERR for |k_raw| < 2^40 (|k| <= sqrt(d), so fk <= 40 - log2(sqrt d)).
    """
    n, t_len, d = v.shape[0], v.shape[1], v.shape[2]
    keys = np.zeros((n, t_len, d), dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        for i in range(n):
            h, e = rms_rsqrt_src(v, i, t, eps, fv)
            # k_j = v_j r
            for j in range(d):
                keys[i, t, j] = 0 if h == 0 else mul_shift(int(v[i, t, j]), h, e + fv - fk)
    return keys


# pythran export attnres_forward(int64[:,:,:] order(C), int64[:], int64, int64, int64)
def attnres_forward(v, w, eps, fv, fw):
    """Block AttnRes for every token: (h [T, d] in Q.fv, alpha [T, n] in Q0.31, saturations).

    v [n, T, d] in Q.fv holds the n sources of each of T tokens (|v_raw| <= 2^30, n <= 16);
    w [d] in Q.fw (|w_raw| <= 2^31) is the pseudo-query; eps in Q.(2 fv). The scores must stay
    below 2^9 (sqrt(d) ||w|| < 2^9 guarantees it); a saturated score is counted. Errors:
    MIX_MAX_ERR on h, ALPHA_MAX_ERR on alpha (module docstring).
    """
    n, t_len, d = v.shape[0], v.shape[1], v.shape[2]
    a62 = np.zeros((t_len, n), dtype=np.int64)
    h = np.zeros((t_len, d), dtype=np.int64)
    alpha = np.zeros((t_len, n), dtype=np.int64)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        sat[t] = token_alpha(v, n, t, w, eps, fv, fw, a62)
        token_mix(v, n, t, a62, h)
        for i in range(n):
            alpha[t, i] = rshift_round(int(a62[t, i]), ALPHA_OUT_SHIFT)
    return h, alpha, int(np.sum(sat))


# == exported: the gradient with respect to the pseudo-query ===================================
def token_delta(v, n, t, g, a62, delta):
    """delta[t, i] = alpha_i (u_i - sum_k alpha_k u_k), u_i = g[t] . v[i, t] (= dL/ds_i).

    The dots are exact (wide); u is then held with its largest |u_raw| in [2^59, 2^60): units
    2^(E - 60) of Q.(fg + fv), E returned (0 when every u_i is 0, and then delta = 0).
    Roundings: u 1/2, the mean n/2, delta 1/2 unit; |u - mean| < 2^61, |delta| < 2^61.
    """
    d = v.shape[2]
    uh = np.zeros(n, dtype=np.int64)
    ul = np.zeros(n, dtype=np.int64)
    u = np.zeros(n, dtype=np.int64)
    top = 0
    for i in range(n):
        hi = 0
        lo = 0
        # u_i = g . v_i, in two exact 31-bit halves
        for j in range(d):
            p = int(g[t, j]) * int(v[i, t, j])
            hi += p >> 31
            lo += p & MASK31
        m, z = wide_top(hi, lo)
        top = max(top, bitlen(abs(m)) + z)
        uh[i] = hi
        ul[i] = lo
    ubar = 0
    for i in range(n):
        u[i] = wide_round(int(uh[i]), int(ul[i]), top - U_BITS)
        # ubar = sum_k alpha_k u_k
        ubar += mul_round(int(a62[t, i]), int(u[i]), 62)
    for i in range(n):
        # delta_i = alpha_i (u_i - ubar)
        delta[t, i] = mul_round(int(a62[t, i]), int(u[i]) - ubar, 62) if top > 0 else 0
    return top


def grad_into(v, w, g, eps, fv, fw, fg, dw):
    """dw[:] = dL/dw in Q.fd for L = sum_t g_t . h_t; returns fd (see attnres_grad_w)."""
    n, t_len, d = v.shape[0], v.shape[1], v.shape[2]
    a62 = np.zeros((t_len, n), dtype=np.int64)
    delta = np.zeros((t_len, n), dtype=np.int64)
    ebits = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        token_alpha(v, n, t, w, eps, fv, fw, a62)
        ebits[t] = token_delta(v, n, t, g, a62, delta)
    top = int(np.max(ebits))
    if top == 0:
        dw[:] = 0
        return 0
    fd = GRAD_OUT_BITS - 1 - bitlen(t_len) - top - ((bitlen(d) + 1) >> 1) + fg + fv
    coef = np.zeros((t_len, n), dtype=np.int64)
    shift = np.zeros((t_len, n), dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        for i in range(n):
            h, e = rms_rsqrt_src(v, i, t, eps, fv)
            # c = delta r, and the shift that puts c v in Q.(fd + GRAD_GUARD)
            coef[t, i] = mul_round(int(delta[t, i]), h, 62)
            shift[t, i] = fg + 2 * fv + e - 62 - (int(ebits[t]) - U_BITS) - fd - GRAD_GUARD
    # omp parallel for
    for j in range(d):
        hi = 0
        lo = 0
        # dL/dw_j = sum_t sum_i c_ti v_tij, in two exact 31-bit halves
        for t in range(t_len):
            for i in range(n):
                c = int(coef[t, i])
                if c != 0:
                    p = mul_shift(c, int(v[i, t, j]), int(shift[t, i]))
                    hi += p >> 31
                    lo += p & MASK31
        dw[j] = wide_round(hi, lo, GRAD_GUARD)
    return fd


# pythran export attnres_grad_w(int64[:,:,:] order(C), int64[:], int64[:,:] order(C), int64, int64, int64, int64)
def attnres_grad_w(v, w, g, eps, fv, fw, fg):
    """dL/dw for L = sum_t g_t . h_t, h_t = AttnRes(v[:, t], w): (dw [d] in Q.fd, fd).

        dL/dw = sum_t sum_i delta_ti k_ti,  delta_ti = alpha_ti (u_ti - sum_k alpha_tk u_tk),
        u_ti = g_t . v_ti,  k_ti = v_ti r_ti   (the softmax Jacobian; arXiv 2603.15031 trains w)

    g [T, d] in Q.fg (|g_raw| <= 2^30), the rest as attnres_forward; n T <= 2^14.
    Format: with M_t = max_i |u_ti|, |dL/dw_j| <= W = sum_t 2 M_t sqrt(d) (sum_i |delta_ti|
    <= 2 M_t, |k| <= sqrt(d)); fd is the largest format with W 2^fd < 2^32, from
    M_t < 2^(E_t - fg - fv), T < 2^bitlen(T), sqrt(d) <= 2^ceil(bitlen(d)/2).
    Each term delta k v-wise: c = delta h / 2^62 (one rounding), c v rounded into Q.(fd + 28),
    |term| < 2^60, summed exactly (wide), one rounding into Q.fd.
    Error, in LSB of Q.fd (W 2^fd < 2^32): final rounding 1/2; n T terms 2^-29 each (< 2^-15);
    delta's roundings (n + 1) 2^-59 M_t and c's n 2^-59 M_t sqrt(d): < 2^-23 for n <= 16;
    alpha's 2^-52.9 (3 n 2^-52.9 M_t on sum_i |delta|, half of W's 2 M_t): 24 2^-52.9 2^32 =
    2^-16.3; the scores' relative 2^-48.5 on alpha (3 2^-48.5 M_t): 2^-15.9; r's rho on the
    keys: 2^-27. Together 2^-14.05 (6.0e-5) < 2^-10, so GRAD_MAX_ERR = 513/1024 LSB holds.
    """
    dw = np.zeros(v.shape[2], dtype=np.int64)
    fd = grad_into(v, w, g, eps, fv, fw, fg, dw)
    return dw, fd


# == exported: learning the pseudo-query (integer gradient descent) ============================
# pythran export train_w(int64[:,:,:] order(C), int64[:,:] order(C), int64[:], int64, int64, int64, int64, int64)
def train_w(v, target, w_init, steps, lr_shift, eps, fv, fw):
    """Full-batch gradient descent on w for L = 1/2 sum_t ||AttnRes(v[:, t], w) - target_t||^2.

    v [n, T, d] and target [T, d] in Q.fv, w in Q.fw (|w_raw| <= 2^31, saturating, counted);
    each step w <- w - 2^-lr_shift dL/dw, with dL/dw from grad_into (g = h - target in Q.fv,
    saturating at 2^30, counted) rounded once into Q.fw. Every sum is exact, so the result does
    not depend on the order of the tokens or on the thread count. Returns (loss_m, loss_z, w,
    saturations): before each step and after the last, sum_t ||h_t - target_t||^2 in
    Q.(2 fv) is m 2^z (wide_top: truncated, relative error < 2^-61).
    """
    n, t_len, d = v.shape[0], v.shape[1], v.shape[2]
    w = w_init.copy()
    a62 = np.zeros((t_len, n), dtype=np.int64)
    h = np.zeros((t_len, d), dtype=np.int64)
    g = np.zeros((t_len, d), dtype=np.int64)
    dw = np.zeros(d, dtype=np.int64)
    loss_m = np.zeros(steps + 1, dtype=np.int64)
    loss_z = np.zeros(steps + 1, dtype=np.int64)
    sat = 0
    for step in range(steps + 1):
        for t in range(t_len):
            sat += token_alpha(v, n, t, w, eps, fv, fw, a62)
            token_mix(v, n, t, a62, h)
        hi = 0
        lo = 0
        # g = h - target; sum_t ||g_t||^2 in two exact 31-bit halves
        for t in range(t_len):
            for j in range(d):
                e = int(h[t, j]) - int(target[t, j])
                c = max(-V_MAX, min(e, V_MAX))
                sat += 1 if c != e else 0
                g[t, j] = c
                hi += (c * c) >> 31
                lo += (c * c) & MASK31
        loss_m[step], loss_z[step] = wide_top(hi, lo)
        if step == steps:
            break
        fd = grad_into(v, w, g, eps, fv, fw, fv, dw)
        sh = fd + lr_shift - fw
        # w <- w - 2^-lr_shift dL/dw: Q.fd -> Q.fw (|dw| < 2^32: a left shift past 29 could wrap,
        # and would move w past 2^31 anyway: it saturates instead)
        for j in range(d):
            x = int(dw[j])
            step_w = mul_shift(x, 1, sh) if sh >= -29 else (2 * W_MAX if x > 0 else -2 * W_MAX)
            u = int(w[j]) - (step_w if x != 0 else 0)
            c = max(-W_MAX, min(u, W_MAX))
            sat += 1 if c != u else 0
            w[j] = c
    return loss_m, loss_z, w, sat


# == exported: a deep stack with K3's layer flow ===============================================
def sublayer(x, mats, c, eps, out):
    """out[0, t] = tanh(M_c RMSNorm(x[0, t])) in Q.24: the stand-in Attn / FFN sublayer.

    x [1, T, d] in Q.24; RMSNorm without weight into Q.24 (|xn| <= sqrt(d)); M_c [d, d] in
    Q.fm with sum_j |M_kj| |xn_j| < 2^62 / 2^(24 + fm); tanh in Q0.31 (fx), rounded to Q.24.
    Per-token (no mixing across tokens): a deterministic integer map, not an attention.
    """
    t_len, d = x.shape[1], x.shape[2]
    fm = STACK_FRAC  # the matrices' format
    xn = np.zeros(d, dtype=np.int64)
    for t in range(t_len):
        h, e = rms_rsqrt_src(x, 0, t, eps, STACK_FRAC)
        for j in range(d):
            xn[j] = 0 if h == 0 else mul_shift(int(x[0, t, j]), h, e + STACK_FRAC - XN_FRAC)
        for k in range(d):
            acc = 0
            # z_k = sum_j M_kj xn_j in Q.(fm + 24); y_k = tanh(z_k)
            for j in range(d):
                acc += int(mats[c, k, j]) * int(xn[j])
            # (tanh is exactly +-1 past 32; the clamp lets fx see its own Q.56 format)
            z = max(-TANH_CLAMP, min(acc, TANH_CLAMP)) << (ARG_FRAC - fm - XN_FRAC)
            out[0, t, k] = rshift_round(tanh_q31(z, ARG_FRAC), 31 - STACK_FRAC)
    return 0


# pythran export attnres_stack(int64[:,:] order(C), int64[:,:] order(C), int64[:,:,:] order(C), int64, int64)
def attnres_stack(emb, wq, mats, block_size, eps):
    """K3's layer flow (K3-SPEC section 3) over L = mats.shape[0] / 2 layers, integers only.

        1. a = AttnRes(blocks + [prefix]) with w_{2l}, or prefix while there are no blocks
        2. if l % block_size == 0: push prefix onto blocks, prefix = 0 (layer 0 pushes emb)
        3. prefix += Attn(RMSNorm(a))
        4. m = AttnRes(blocks + [prefix]) with w_{2l+1}; prefix += FFN(RMSNorm(m))
        5. the final AttnRes(blocks + [prefix]) with w_{2L}
    Attn and FFN are the stand-in `sublayer` (tanh of a fixed matrix). emb [T, d] Q.24, wq
    [2L+1, d] Q.24, mats [2L, d, d] Q.24, eps Q.48. Returns, for each of the 2L+1 AttnRes
    calls c: outs[c] (its output; the prefix itself where there is no call), prefixes[c] (the
    prefix it saw), nblocks[c] (the blocks it saw), alphas[c] (Q0.31, [T, n_max]); then blocks
    [n_blocks, T, d] and the saturations (scores, and |prefix| at 2^30 raw = 64).
    """
    n_layers = mats.shape[0] // 2
    t_len, d = emb.shape[0], emb.shape[1]
    n_calls = 2 * n_layers + 1
    max_blocks = (n_layers - 1) // block_size + 1
    outs = np.zeros((n_calls, t_len, d), dtype=np.int64)
    prefixes = np.zeros((n_calls, t_len, d), dtype=np.int64)
    alphas = np.zeros((n_calls, t_len, max_blocks + 1), dtype=np.int64)
    nblocks = np.zeros(n_calls, dtype=np.int64)
    blocks = np.zeros((max_blocks, t_len, d), dtype=np.int64)
    prefix = np.zeros((1, t_len, d), dtype=np.int64)
    y = np.zeros((1, t_len, d), dtype=np.int64)
    a = np.zeros((1, t_len, d), dtype=np.int64)
    mixed = np.zeros((t_len, d), dtype=np.int64)
    wc = np.zeros(d, dtype=np.int64)
    prefix[0] = emb
    nb = 0
    sat = 0
    for c in range(n_calls):
        if nb == 0:
            a[0] = prefix[0]  # step 1 of layer 0, with no blocks yet: a = prefix
        else:
            # steps 1, 4, 5: a = AttnRes over [blocks..., prefix] with w_c
            src = np.zeros((nb + 1, t_len, d), dtype=np.int64)
            src[:nb] = blocks[:nb]
            src[nb] = prefix[0]
            a62 = np.zeros((t_len, nb + 1), dtype=np.int64)
            wc[:] = wq[c]
            for t in range(t_len):
                sat += token_alpha(src, nb + 1, t, wc, eps, STACK_FRAC, STACK_W_FRAC, a62)
                token_mix(src, nb + 1, t, a62, mixed)
                for i in range(nb + 1):
                    alphas[c, t, i] = rshift_round(int(a62[t, i]), ALPHA_OUT_SHIFT)
            a[0] = mixed
        outs[c] = a[0]
        prefixes[c] = prefix[0]
        nblocks[c] = nb
        if c == n_calls - 1:
            break
        if c % (2 * block_size) == 0:
            # step 2 (layer c/2 a multiple of block_size): push the prefix, reset it
            blocks[nb] = prefix[0]
            nb += 1
            prefix[0] = 0
        # steps 3, 4: prefix += sublayer(RMSNorm(a)), saturating at |prefix_raw| = 2^30
        sublayer(a, mats, c, eps, y)
        for t in range(t_len):
            for j in range(d):
                p = int(prefix[0, t, j]) + int(y[0, t, j])
                q = max(-V_MAX, min(p, V_MAX))
                sat += 1 if q != p else 0
                prefix[0, t, j] = q
    return outs, prefixes, nblocks, alphas, blocks, sat
