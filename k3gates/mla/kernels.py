"""Gated MLA (K3-SPEC section 2) in integers only: the latent projections with their RMSNorms,
the naive and the absorbed attention paths with an integer causal softmax, a decode step over a
latent cache, and the output gate before o_proj.

    c_Q = RMSNorm(W_DQ x) w_q,  q = scale W_UQ c_Q = [q_C | q_R] per head
    [a_KV | k_R] = W_DKV x,  c_KV = RMSNorm(a_KV) w_kv          (NoPE: k_R is never rotated)
    naive:    score_ts = q_C,t . (W_UK c_s) + q_R,t . k_R,s,   o_t = sum_s p_ts (W_UV c_s)
    absorbed: score_ts = (W_UK^T q_C,t) . c_s + q_R,t . k_R,s,  o_t = W_UV (sum_s p_ts c_s)
    y = W_O (o ⊙ sigma(x W_g))

Formats (our choice; storage int32 unless said, arithmetic int64):
    x                       Q.16    |x| < 2^8            the layer's normed input
    W_DQ W_UQ W_DKV W_UK
    W_UV W_g W_O            Q.16    |W| < 2^4  (W_LIM)   every projection weight
    w_q, w_kv (norm)        Q.16    |w| < 2^3
    a_Q, a_KV (pre-norm)    Q.20    int64, |a| < 2^11    saturating at 2^31 - 1, counted
    c_Q, c_KV, k_R          Q.16    |c| < 2^8  (C_LIM)   saturating, counted
    q (times the scale)     Q.20    |q| < 2^6  (Q_LIM)   saturating, counted
    z (scores)              Q.32    int64, |z| < 2^60    saturating, counted
    p                       Q0.31   int64, fx.softmax_row_q31
    o, gated o, y           Q.20    |.| < 2^4 for o (O_LIM, the domain of V_MAX), 2^11 for y
Rounding: fx.rshift_round (half away from zero), once per stored quantity; `round_limbs` is the
same rounding of a two-limb integer. Division only by positive numbers.

Naive == absorbed, bit for bit. Nothing is rounded between the re-associated products: both paths
form the *exact* integer score total = sum_ij q_i W_ij c_j + 2^16 sum_r q_r k_r in Q.52 and the
exact value total = sum_s sum_j p_s W_ij c_sj in Q.63, then round each once, identically. Integer
addition is associative and commutative, so the two orders give the same integers. A total need
not fit one int64: each is held as two limbs, total = hi 2^L + lo, where one factor of every
product is split, a = (a >> L) 2^L + (a & (2^L - 1)) (exact for negative a too: >> floors).

Int64 headroom (dims nope <= 2^7, rope <= 2^6, kv_lora <= 2^9, cache length n <= 2^20, raw
limits |q| < 2^26, |W| < 2^20, |c|, |k_R| < 2^24, sum_s p_s < 2^31 + 2^19.1 by fx's bound):
    naive score, L = 28:     k_i = sum_j W_ij c_j < 2^9 2^44 = 2^53; lo = sum_i q_i (k_i & M)
                             < 2^7 2^26 2^28 = 2^61; hi = sum_i q_i (k_i >> 28) <= 2^7 2^26 2^25
                             = 2^58; the rope sum r < 2^6 2^26 2^24 = 2^56 adds (r >> 12) to hi
                             and (r & (2^12 - 1)) 2^16 < 2^28 to lo.
    absorbed score, L = 28:  a_j = sum_i W_ij q_i < 2^7 2^20 2^26 = 2^53; lo = sum_j c_j (a_j & M)
                             < 2^9 2^24 2^28 = 2^61; hi <= 2^9 2^24 2^25 = 2^58.
    naive value, L = 24:     v_i < 2^53 as k_i; lo = sum_s p_s (v_i & M) < 2^31.001 2^24
                             = 2^55.001; hi <= 2^31.001 2^29 = 2^60.001.
    absorbed value, L = 24:  lat_j = sum_s p_s c_sj < 2^31.001 2^24 = 2^55.001, any n <= 2^20;
                             lo = sum_j W_ij (lat_j & M) < 2^9 2^20 2^24 = 2^53;
                             hi <= 2^9 2^20 2^31.001 = 2^60.001.
Every partial sum is bounded by the sum of the absolute terms above, so none overflows, in either
path, at any cache length up to 2^20 (fx's softmax: its exp sum < n 2^31 = 2^51). Without the
limbs the value total alone, sum_s p_s v_s in Q.63, would need |v| < 1 to fit.

The score total is rounded to Q.32 once (z, error <= 1/2 LSB = 2^-33); z saturates at 2^60 when
|score| >= 2^28 (counted). The value total is rounded to Q.20 once and saturates at O_LIM.

Error bounds (LSB of each output; as integers over 2^BOUND_FRAC, a kernel holds no float):
    LINEAR_MAX_ERR       a_Q, a_KV, k_R: exact accumulation, one rounding           1/2
    RMSNORM_MAX_ERR      c_Q, c_KV against float64 RMSNorm of the integer a        513/1024
                         (fx.rmsnorm_row: 1/2 + |y| 2^-59; the per-row acc_shift adds
                         at most 2^(2 bitlen(n) - 36) <= 2^-14 for n <= 2^11, see mla_rmsnorm)
    QUERY_MAX_ERR        q against float64 scale W_UQ c_Q (the scale rsqrt_q of     513/1024
                         nope + rope in Q0.62, within 1 LSB: 2^26 2^-58 < 2^-31 LSB)
    UP_MAX_ERR           k_C = W_UK c, v = W_UV c: exact in Q.32                    0
    attend_bound_q10(n)  o against float64 attention on the same integer q, c, k_R, weights,
                         for max |v| <= V_MAX = 16:
                         |o - o*| <= 1/2 + 2^20 V_MAX sum_s |p_s - p*_s|, and
                         sum_s |p_s - p*_s| <= n (513/1024) 2^-31 (fx softmax, per term)
                                             + e^(2 2^-33) - 1 (z's rounding moves every score
                                               by <= 2^-33, so each p by a factor e^(+-2^-32))
                         = 1/2 + n 513 2^-17 + 2^-8 (1 + 2^-31) LSB; float64's own error
                         (< n 2^-28 LSB for n <= 2^16) takes one more 2^-10.
    GATED_MAX_ERR        o ⊙ sigma(u) against float64 with the integer o: 1/2 +     517/1024
                         |o| 2^20 (513/1024) 2^-31 <= 1/2 + 2^-7.99, plus 2^-10
    output_bound_q10(n)  y = W_O gated against float64 from the same integer inputs,
                         for row sums sum_k |W_O,ik| <= WO_L1_MAX = 16:
                         1/2 + WO_L1_MAX (GATED + attend(n)) + 2^-10 (float64)

Long context. `mla_decode_attend(q, t, c_kv, k_r, n, w_uk, w_uv)` streams one query over cache
rows 0..n-1 in O(n H (kv_lora + rope)) integer operations, holding two int64 rows of n per head
(never per-head keys or values); every bound above holds for n <= 2^20, where attend_bound_q10
gives 518 + 513 2^13 (2^-10 LSB) ~ 4104 LSB of Q.20 ~ 0.0039: the softmax's per-term 1/2 LSB of
Q0.31, summed over 2^20 keys, is what a 1M-token row costs in these formats.

Backward (STRONG), for L = sum dy ⊙ y. Formats: dy, do, du, dq, dc_KV, dk_R in Q.24 (G_FRAC, int32);
the backward's scores z in Q.48 and P = softmax(z) in Q0.62 (softmax_row_q62); dP, dS, g, e, f in
Q.48; mu in Q.54. Every sum is exact: a 124-bit accumulator (hi 2^62 + lo, `wide_add` from
31-bit limbs) absorbs any number of products of two |x| <= 2^62, so each stored quantity is
rounded once (`wide_round`) and saturates at its limit (counted). The chain, per element, in
real units (P the exact softmax of the exact scores, primes the integers):
    |P' - P|     <= P rho + a,  rho = 1.001 2^-48 (z's rounding), a = 2^-52 + n 2^-63 (fx's
                    softmax analysis before the last rounding, plus that rounding in Q0.62)
    |dP' - dP|   <= 2^-49 (exact, one rounding);  |mu' - mu| <= 2^-55 + DP (rho + n a) + 2^-48
    |dS' - dS|   <= 2^-49 + |P' - P| (2 DP + eps) + P eps,  eps = 2^-49 + |mu' - mu|
    rows:    E_S = sum_s |dS' - dS| <= n 2^-49 + (rho + n a)(2 DP + eps) + 2 eps
    columns: E_C = sum_t |dS' - dS| <= n 2^-49 + n (rho + a)(2 DP + eps) + n eps (column sums
             of P reach n)
    dq_R  <= 1/2 + E_S KR;  dq_C <= 1/2 + L1 (2^-49 + E_S C)   (g = sum_s dS c rounded to Q.48)
    dc_KV <= 1/2 + H L1 ((2^-49 + E_C Q) + (2^-49 + n (rho + a) DO))   (e, f rounded to Q.48)
    dk_R  <= 1/2 + H E_C Q
each times 2^24 for LSB, plus 2^-10 LSB for float64's own error: backward_bounds_q10(n, H, n). The
domain: |dP| <= DP = 2^BWD_DP_BITS, |do| <= DO, |c_KV| <= C, |k_R| <= KR, |q| <= Q, the row and
column L1 norms of W_UK, W_UV <= L1 (the BWD_*_BITS constants); the STRONG gate measures each.
do = dG sigma(u) and du = dG o sigma(1 - sigma) (dG = W_O^T dy exact): OUT_GRAD_MAX_ERR, see
mla_output_backward.
"""

import numpy as np

from ..fx.kernels import (
    arg_q56,
    bitlen,
    exp_neg_q62,
    mul_q62,
    mul_round,
    recip_q62,
    rmsnorm_row,
    rshift_round,
    rsqrt_q,
    sigmoid_q31,
    sigmoid_q62,
    softmax_row_q31,
)

BOUND_FRAC = 10
LINEAR_MAX_ERR_LSB_Q10 = 512  # exact int64 sum, one half-away rounding
RMSNORM_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10
QUERY_MAX_ERR_LSB_Q10 = 513
UP_MAX_ERR_LSB_Q10 = 0
GATED_MAX_ERR_LSB_Q10 = 517  # 1/2 + 2^-8 + 2^-10, rounded up
V_MAX_BITS = 4  # the attention bound's domain: every |v| = |W_UV c| <= V_MAX = 2^4
WO_L1_BITS = 4  # the output bound's domain: every row sum_k |W_O,ik| <= 2^4

X_FRAC = 16
W_FRAC = 16
LAT_FRAC = 20  # pre-norm latents
C_FRAC = 16  # c_Q, c_KV, k_R
Q_FRAC = 20  # q, scale folded in
Z_FRAC = 32  # scores into the softmax
P_FRAC = 31  # fx softmax output
O_FRAC = 20
EPS_FRAC = 2 * LAT_FRAC  # the RMSNorm eps is given in Q.40, the format of a^2
SCALE_FRAC = 62  # the score scale (nope + rope)^-1/2 in Q0.62

A_LIM = (1 << 31) - 1  # |a| saturates here: a^2 must fit int64
C_LIM = (1 << 24) - 1  # |c|, |k_R| < 2^8 in Q.16
Q_LIM = (1 << 26) - 1  # |q| < 2^6 in Q.20
O_LIM = (1 << (V_MAX_BITS + O_FRAC)) - 1  # |o| < V_MAX in Q.20
Y_LIM = (1 << 31) - 1  # y in int32
Z_LIM = 1 << 60  # a saturated score: larger than any unsaturated |z| < 2^60, below fx's 2^61

# the backward (mla_*backward*): gradients in Q.24, intermediates in Q.48, accumulators 124-bit
G_FRAC = 24  # dy, do, du, dq, dc_KV, dk_R
BWD_Z_FRAC = 48  # the backward's scores (|score| < 2^12) and its Q0.62 probabilities
BWD_FRAC = 48  # dP, dS, g, e, f
BWD_MU_FRAC = 54  # mu
DO_LIM = (1 << (4 + G_FRAC)) - 1  # |do|, |dy| < 2^4
G_LIM = (1 << 31) - 1  # gradients in int32: |.| < 2^7
DP_LIM = (1 << (6 + BWD_FRAC)) - 1  # |dP| < 2^6
MU_LIM = (1 << (7 + BWD_MU_FRAC)) - 1
G48_LIM = (1 << (8 + BWD_FRAC)) - 1  # |g|, |e|, |f| < 2^8
WIDE_LIMB = 62
WIDE_ONE = 1 << WIDE_LIMB
WIDE_MASK = WIDE_ONE - 1
MASK31 = (1 << 31) - 1
ONE_Q62 = 1 << 62
# the domain the backward bounds are stated for (log2 of magnitudes; the STRONG gate checks them)
BWD_DP_BITS = 3  # |dP| <= 8
BWD_DO_BITS = 2  # |do| <= 4
BWD_C_BITS = 3  # |c_KV| <= 8
BWD_KR_BITS = 3  # |k_R| <= 8
BWD_Q_BITS = 1  # |q| <= 2 (scaled)
BWD_L1_BITS = 5  # row and column L1 norms of W_UK and W_UV <= 32
BWD_DG_BITS = 4  # |W_O^T dy| <= 16
OUT_GRAD_MAX_ERR_LSB_Q10 = 513  # do, du: 1/2 + 2^-12

SCORE_LIMB = 28
SCORE_MASK = (1 << SCORE_LIMB) - 1
# the rope sum is in Q.(Q_FRAC + C_FRAC) = Q.36, 2^W_FRAC below the nope total's Q.52
ROPE_HI_SHIFT = SCORE_LIMB - W_FRAC
ROPE_LO_MASK = (1 << ROPE_HI_SHIFT) - 1
SCORE_TOTAL_FRAC = Q_FRAC + W_FRAC + C_FRAC  # the exact score total is Q.52
SCORE_SHIFT = SCORE_TOTAL_FRAC - Z_FRAC  # Q.52 -> Q.32
SCORE_HI_SAT = 1 << 52  # floor(total / 2^28) >= 2^52 means |score| >= 2^28: z saturates
VALUE_LIMB = 24
VALUE_MASK = (1 << VALUE_LIMB) - 1
VALUE_SHIFT = P_FRAC + W_FRAC + C_FRAC - O_FRAC  # Q.63 -> Q.20


def attend_bound_q10(n):
    """Declared bound of the attention output o against float64, in 2^-10 LSB of Q.20, for rows
    of at most n keys and |v| <= V_MAX: 512 + 513 n / 128 + 4.01 + 1 (module docstring)."""
    return 518 + (513 * n + 127) // 128


def output_bound_q10(n):
    """Declared bound of y against float64 from the same integer attention inputs, 2^-10 LSB."""
    return 513 + (GATED_MAX_ERR_LSB_Q10 + attend_bound_q10(n)) * (1 << WO_L1_BITS)


# == scalar helpers ==============================================================================
def round_limbs(hi, lo, limb, s):
    """(hi 2^limb + lo) / 2^s rounded half away from zero, exactly as fx.rshift_round would round
    the (possibly > 64-bit) integer; 1 <= s, 1 <= limb <= 62, the result must fit int64.

    Normalise lo into [0, 2^limb) (the carry goes to hi), then the value is negative iff hi is.
    rshift_round's y = value - [value < 0] is formed with a borrow; floor(y / 2^s) and bit s-1 of
    y are read from whichever limb holds them.
    """
    mask = (1 << limb) - 1
    h = hi + (lo >> limb)
    low = lo & mask
    if h < 0:
        if low == 0:
            h -= 1
            low = mask
        else:
            low -= 1
    # (the shift counts are wrapped in max(., 0): Pythran's range analysis needs them >= 0)
    if s >= limb:
        q = h >> max(s - limb, 0)
    else:
        q = h * (1 << max(limb - s, 0)) + (low >> max(s, 0))
    if s - 1 >= limb:
        bit = (h >> max(s - 1 - limb, 0)) & 1
    else:
        bit = (low >> max(s - 1, 0)) & 1
    return q + bit


def score_round(hi, lo, r, frac):
    """The score total (hi 2^28 + lo in Q.52, plus the rope sum r in Q.36) rounded once to Q.frac
    (32 for the forward's z, 48 for the backward's), saturated at +-Z_LIM when
    |score| >= 2^(60 - frac) (then floor(total / 2^28) >= 2^(84 - frac)). Error <= 2^-(frac+1).
    """
    h = hi + (r >> ROPE_HI_SHIFT)
    low = lo + ((r & ROPE_LO_MASK) << W_FRAC)
    top = h + (low >> SCORE_LIMB)
    sat = 1 << max(84 - frac, 0)
    if top >= sat:
        return Z_LIM
    if top <= -sat:
        return -Z_LIM
    return round_limbs(h, low, SCORE_LIMB, SCORE_TOTAL_FRAC - frac)


def clamp(x, lim):
    return max(-lim, min(x, lim))


def norm_shift(amax, n):
    """The acc_shift k for fx.rmsnorm_row on a row of n values with max |a| = amax: the least
    k >= 0 with 2 bitlen(amax) + bitlen(n) - k <= 61, so the rounded sum of squares stays below
    2^61 + n/2."""
    return max(0, 2 * bitlen(amax) + bitlen(n) - 61)


# == the latent projections (PARTIAL) ============================================================
# (three small kernels the face composes: one exported function holding both RMSNorms and all the
# projections made g++ need more than the 6 GiB compile cap)
# pythran export mla_linear(int32[:,:] order(C), int32[:,:] order(C), int, int)
def mla_linear(x, w, shift, lim):
    """y = x W^T, exact in int64, one rounding by 2^shift, saturated at +-lim (counted).

    x [T, D] Q.16, w [N, D] Q.16: the sum is Q.32, |x W| < 2^24 2^20 per product and D <= 2^13
    terms, < 2^57. shift 12 gives the pre-norm latents a_Q, a_KV in Q.20 (lim A_LIM), shift 16
    the shared key part k_R in Q.16 (lim C_LIM). Error: LINEAR bound (1/2 LSB). Returns
    (y int64 [T, N], saturations). Rows are independent (OpenMP over rows).
    """
    t_len, d_in, n_out = x.shape[0], x.shape[1], w.shape[0]
    y = np.zeros((t_len, n_out), dtype=np.int64)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        # y_t = W x_t
        for i in range(n_out):
            acc = 0
            for d in range(d_in):
                acc += int(w[i, d]) * int(x[t, d])
            v = rshift_round(acc, shift)
            sat[t] += abs(v) > lim
            y[t, i] = clamp(v, lim)
    return y, int(np.sum(sat))


# pythran export mla_rmsnorm(int64[:,:] order(C), int32[:], int)
def mla_rmsnorm(a, w, eps):
    """c = RMSNorm(a) w (the LoRA norms): a [T, n] Q.20 (|a| <= 2^31 raw), w [n] Q.16, eps in
    Q.40 (<= 2^40). Each row takes the acc_shift k of `norm_shift` (eps enters as
    rshift_round(eps, k) in Q.(40 - k)), then fx.rmsnorm_row to Q.16: the rounded sum of squares
    stays below 2^61 + n/2 + n eps < 2^62. Error: RMSNORM bound, where k > 0 only when
    max a^2 >= 2^(59 - bitlen n) 2^k, so the n/2 + n/2 of rounding (squares, eps) moves the
    output by |c| n / (2 acc) <= 2^24 n 2^(bitlen(n) - 60) <= 2^(2 bitlen(n) - 36) LSB.
    Returns (c int32 [T, n] Q.16 saturated at C_LIM, saturations).
    """
    t_len, n = a.shape[0], a.shape[1]
    out = np.zeros((t_len, n), dtype=np.int64)
    c = np.zeros((t_len, n), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        amax = 0
        for j in range(n):
            amax = max(amax, abs(int(a[t, j])))
        k = norm_shift(amax, n)
        # c_t = w a_t / sqrt(mean(a_t^2) + eps)
        rmsnorm_row(a, t, w, rshift_round(eps, k), LAT_FRAC, W_FRAC, C_FRAC, k, out)
        for j in range(n):
            v = int(out[t, j])
            sat[t] += abs(v) > C_LIM
            c[t, j] = clamp(v, C_LIM)
    return c, int(np.sum(sat))


# pythran export mla_query(int32[:,:] order(C), int32[:,:] order(C), int)
def mla_query(c_q, w_uq, scale):
    """q = scale W_UQ c_Q in Q.20, heads flattened: [T, H (nope + rope)] int32 (the face views it
    as [T, H, nope + rope]). c_q Q.16, w_uq Q.16, scale Q0.62 (`default_scale`). The sum is exact
    in Q.32 (< 2^20 2^24 2^11 = 2^55 for q_lora <= 2^11), then mul_round(acc, scale, 74): one
    rounding (QUERY bound). Saturates at Q_LIM (counted). Returns (q, saturations).
    """
    t_len, q_lora, n_out = c_q.shape[0], c_q.shape[1], w_uq.shape[0]
    q = np.zeros((t_len, n_out), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        # q_t = scale W_UQ c_Q,t
        for i in range(n_out):
            acc = 0
            for j in range(q_lora):
                acc += int(w_uq[i, j]) * int(c_q[t, j])
            v = mul_round(acc, scale, SCALE_FRAC + W_FRAC + C_FRAC - Q_FRAC)
            sat[t] += abs(v) > Q_LIM
            q[t, i] = clamp(v, Q_LIM)
    return q, int(np.sum(sat))


# pythran export default_scale(int)
def default_scale(d_qk):
    """The score scale d_qk^-1/2 in Q0.62 (K3: 192^-1/2), from fx.rsqrt_q: within 1 LSB."""
    return rsqrt_q(d_qk, 0, SCALE_FRAC)


# pythran export mla_up(int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_up(c_kv, w_uk, w_uv):
    """The per-head up-projections the naive path materialises, exact in Q.32 (int64):
    k_C [T, H, nope] = W_UK c_KV and v [T, H, d_v] = W_UV c_KV (|.| < 2^53, UP bound 0)."""
    t_len, kv_lora = c_kv.shape[0], c_kv.shape[1]
    n_h, nope, d_v = w_uk.shape[0], w_uk.shape[1], w_uv.shape[1]
    k_c = np.zeros((t_len, n_h, nope), dtype=np.int64)
    v = np.zeros((t_len, n_h, d_v), dtype=np.int64)
    # omp parallel for
    for s in range(t_len):
        for h in range(n_h):
            # k_C = W_UK c_s, v = W_UV c_s
            for i in range(nope):
                acc = 0
                for j in range(kv_lora):
                    acc += int(w_uk[h, i, j]) * int(c_kv[s, j])
                k_c[s, h, i] = acc
            for i in range(d_v):
                acc = 0
                for j in range(kv_lora):
                    acc += int(w_uv[h, i, j]) * int(c_kv[s, j])
                v[s, h, i] = acc
    return k_c, v


# == attention: the naive path ===================================================================
# pythran export mla_attend_naive(int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_attend_naive(q, c_kv, k_r, w_uk, w_uv):
    """Causal attention with per-head keys k_C = W_UK c and values v = W_UV c materialised.

    q [T, H, nope + rope] Q.20 (times the scale); c_kv [T, kv_lora], k_r [T, rope] Q.16;
    w_uk [H, nope, kv_lora], w_uv [H, d_v, kv_lora] Q.16. Returns (o int32 [T, H, d_v] Q.20,
    saturations of z and o). Error: attend_bound_q10(T) / 2^10 LSB against float64.
    Memory O(T H (nope + d_v)): this is the path the latent cache avoids.
    """
    t_len, n_h, d_qk = q.shape[0], q.shape[1], q.shape[2]
    nope, d_v = w_uk.shape[1], w_uv.shape[1]
    rope = d_qk - nope
    k_c, v = mla_up(c_kv, w_uk, w_uv)
    o = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        z = np.zeros((1, t + 1), dtype=np.int64)
        p = np.zeros((1, t + 1), dtype=np.int64)
        for h in range(n_h):
            # score_ts = q_C . k_C,s + q_R . k_R,s, exact in two limbs, one rounding to Q.32
            for s in range(t + 1):
                hi = 0
                lo = 0
                for i in range(nope):
                    qi = int(q[t, h, i])
                    hi += qi * (k_c[s, h, i] >> SCORE_LIMB)
                    lo += qi * (k_c[s, h, i] & SCORE_MASK)
                r = 0
                for i in range(rope):
                    r += int(q[t, h, nope + i]) * int(k_r[s, i])
                z[0, s] = score_round(hi, lo, r, Z_FRAC)
                sat[t] += abs(z[0, s]) == Z_LIM
            softmax_row_q31(z, 0, t + 1, Z_FRAC, p)
            # o_t = sum_s p_ts v_s, exact in two limbs, one rounding to Q.20
            for i in range(d_v):
                hi = 0
                lo = 0
                for s in range(t + 1):
                    ps = p[0, s]
                    hi += ps * (v[s, h, i] >> VALUE_LIMB)
                    lo += ps * (v[s, h, i] & VALUE_MASK)
                x = round_limbs(hi, lo, VALUE_LIMB, VALUE_SHIFT)
                sat[t] += abs(x) > O_LIM
                o[t, h, i] = clamp(x, O_LIM)
    return o, int(np.sum(sat))


# == attention: the absorbed path, one query over a latent cache =================================
# pythran export mla_decode_attend(int32[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:] order(C), int, int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_decode_attend(q, t, c_kv, k_r, n, w_uk, w_uv):
    """Query row q[t] attends over the first n rows of a latent cache: the absorbed path.

    q [*, H, nope + rope] Q.20 (times the scale); c_kv [>= n, kv_lora] and k_r [>= n, rope] Q.16
    (rows n.. are ignored, so a cache may be preallocated); w_uk [H, nope, kv_lora], w_uv
    [H, d_v, kv_lora] Q.16. Returns (o_t int32 [H, d_v] Q.20, saturations of z and o).
    Exactly the integers of mla_attend_naive's row t when n = t + 1 (module docstring).

    Streaming: per head, W_UK^T q_C (kv_lora values), one pass over the cache for the scores
    (2 kv_lora + rope multiply-adds per row), fx's softmax over them, one pass for
    lat = sum_s p_s c_s (kv_lora per row), then W_UV lat. Work O(n H (kv_lora + rope)); memory
    two int64 rows of n per head in flight (16 MiB at n = 2^20), never per-head keys or values.
    The int64 bounds in the module docstring hold for every n <= 2^20 (fx's softmax bound too).
    Heads run in parallel (OpenMP); each is one exact integer sequence.
    """
    n_h, d_qk = q.shape[1], q.shape[2]
    nope, kv_lora, d_v = w_uk.shape[1], w_uk.shape[2], w_uv.shape[1]
    rope = d_qk - nope
    o = np.zeros((n_h, d_v), dtype=np.int32)
    sat = np.zeros(n_h, dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        qa = np.zeros(kv_lora, dtype=np.int64)
        # W_UK^T q_C: qa_j = sum_i W_UK[h, i, j] q_i, exact in Q.36 (< 2^53)
        for i in range(nope):
            qi = int(q[t, h, i])
            for j in range(kv_lora):
                qa[j] += int(w_uk[h, i, j]) * qi
        a_hi = np.zeros(kv_lora, dtype=np.int64)
        a_lo = np.zeros(kv_lora, dtype=np.int64)
        for j in range(kv_lora):
            a_hi[j] = qa[j] >> SCORE_LIMB
            a_lo[j] = qa[j] & SCORE_MASK
        z = np.zeros((1, n), dtype=np.int64)
        p = np.zeros((1, n), dtype=np.int64)
        # score_s = (W_UK^T q_C) . c_s + q_R . k_R,s, exact in two limbs, one rounding to Q.32
        for s in range(n):
            hi = 0
            lo = 0
            for j in range(kv_lora):
                cj = int(c_kv[s, j])
                hi += a_hi[j] * cj
                lo += a_lo[j] * cj
            r = 0
            for i in range(rope):
                r += int(q[t, h, nope + i]) * int(k_r[s, i])
            z[0, s] = score_round(hi, lo, r, Z_FRAC)
            sat[h] += abs(z[0, s]) == Z_LIM
        softmax_row_q31(z, 0, n, Z_FRAC, p)
        # lat = sum_s p_s c_s, exact in Q.47 (< 2^55.001)
        lat = np.zeros(kv_lora, dtype=np.int64)
        for s in range(n):
            ps = p[0, s]
            for j in range(kv_lora):
                lat[j] += ps * int(c_kv[s, j])
        # o = W_UV lat, exact in two limbs, one rounding to Q.20
        for i in range(d_v):
            hi = 0
            lo = 0
            for j in range(kv_lora):
                w = int(w_uv[h, i, j])
                hi += w * (lat[j] >> VALUE_LIMB)
                lo += w * (lat[j] & VALUE_MASK)
            x = round_limbs(hi, lo, VALUE_LIMB, VALUE_SHIFT)
            sat[h] += abs(x) > O_LIM
            o[h, i] = clamp(x, O_LIM)
    return o, int(np.sum(sat))


# pythran export mla_attend_absorbed(int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_attend_absorbed(q, c_kv, k_r, w_uk, w_uv):
    """The whole causal sequence through the absorbed path: row t is mla_decode_attend over the
    cache rows 0..t. Same arguments and results as mla_attend_naive."""
    t_len, n_h, d_v = q.shape[0], q.shape[1], w_uv.shape[1]
    o = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    sat = 0
    for t in range(t_len):
        row, s = mla_decode_attend(q, t, c_kv, k_r, t + 1, w_uk, w_uv)
        sat += s
        for h in range(n_h):
            for i in range(d_v):
                o[t, h, i] = row[h, i]
    return o, sat


# pythran export mla_decode_step(int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int, int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_decode_step(q_t, c_t, k_r_t, c_kv, k_r, n, w_uk, w_uv):
    """Append one token's latent (c_t [1, kv_lora], k_r_t [1, rope]) at row n of the cache
    arrays (in place; they need n + 1 rows), then attend q_t [1, H, nope + rope] over rows
    0..n. Returns (o_t int32 [H, d_v], saturations), as mla_decode_attend."""
    for j in range(c_kv.shape[1]):
        c_kv[n, j] = c_t[0, j]
    for j in range(k_r.shape[1]):
        k_r[n, j] = k_r_t[0, j]
    return mla_decode_attend(q_t, 0, c_kv, k_r, n + 1, w_uk, w_uv)


# == the output gate and o_proj ==================================================================
# pythran export mla_output(int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C))
def mla_output(o, x, w_g, w_o):
    """gated = o ⊙ sigma(x W_g) (elementwise over H d_v, before o_proj), y = W_O gated.

    o [T, H, d_v] Q.20 (|o| < 2^4); x [T, D] Q.16; w_g [H d_v, D], w_o [D, H d_v] Q.16.
    u = x W_g is exact in Q.32 (< 2^57) and goes to fx.sigmoid_q31 unrounded; gated =
    o sigma / 2^31, one rounding (GATED bound); y: W_O gated exact in Q.36 (< 2^24 2^20 2^14 for
    H d_v <= 2^14), one rounding to Q.20, saturated to int32 (counted).
    Returns (gated int32 [T, H d_v] Q.20, y int32 [T, D] Q.20, saturations). Rows independent.
    """
    t_len, n_h, d_v = o.shape[0], o.shape[1], o.shape[2]
    d_model = x.shape[1]
    width = n_h * d_v
    gated = np.zeros((t_len, width), dtype=np.int32)
    y = np.zeros((t_len, d_model), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        # gated_k = o_k sigma(u_k), u = x W_g in Q.32
        for k in range(width):
            acc = 0
            for d in range(d_model):
                acc += int(w_g[k, d]) * int(x[t, d])
            sig = sigmoid_q31(acc, 2 * W_FRAC)
            gated[t, k] = rshift_round(int(o[t, k // d_v, k % d_v]) * sig, P_FRAC)
        # y = W_O gated: Q.36 -> Q.20
        for i in range(d_model):
            acc = 0
            for k in range(width):
                acc += int(w_o[i, k]) * int(gated[t, k])
            v = rshift_round(acc, W_FRAC)
            sat[t] += abs(v) > Y_LIM
            y[t, i] = clamp(v, Y_LIM)
    return gated, y, int(np.sum(sat))


# == the backward (STRONG) =======================================================================
# Every gradient sum is accumulated exactly in a 124-bit (hi, lo) pair, value = hi 2^62 + lo with
# 0 <= lo < 2^62 (`wide_add`: the exact product of two |x| <= 2^62 from 31-bit limbs), and
# rounded once (`wide_round`). So the backward's error comes only from the roundings listed in
# backward_bounds_q10, never from the length of a sum.
def mul_wide(a, b):
    """(hi, lo) with |a| |b| = hi 2^62 + lo, 0 <= lo < 2^62, for 0 <= a, b <= 2^62. Exact.

    31-bit limbs: mid = ah bl + al bh + (al bl >> 31) < 2^63 - 2^32 (ah = 2^31 forces al = 0).
    """
    ah = a >> 31
    al = a & MASK31
    bh = b >> 31
    bl = b & MASK31
    low = al * bl
    mid = ah * bl + al * bh + (low >> 31)
    return ah * bh + (mid >> 31), ((mid & MASK31) << 31) | (low & MASK31)


def wide_add(hi, lo, a, b):
    """The 124-bit accumulator (hi, lo) plus a b exactly; |a|, |b| <= 2^62, 0 <= lo < 2^62."""
    ph, pl = mul_wide(abs(a), abs(b))
    if (a < 0) != (b < 0):
        low = lo - pl
        return hi - ph - (1 if low < 0 else 0), low + (WIDE_ONE if low < 0 else 0)
    low = lo + pl
    return hi + ph + (low >> WIDE_LIMB), low & WIDE_MASK


def wide_round(hi, lo, s, lim):
    """(hi 2^62 + lo) / 2^s rounded half away from zero (round_limbs), saturated at +-lim.

    For s < 62 the result is about hi 2^(62 - s); a hi beyond lim's range saturates before
    round_limbs could overflow. 1 <= s <= 124, 1 <= lim < 2^62.
    """
    if s < WIDE_LIMB:
        top = (lim >> max(WIDE_LIMB - s, 0)) + 2
        if hi >= top:
            return lim
        if hi < -top:
            return -lim
    return clamp(round_limbs(hi, lo, WIDE_LIMB, s), lim)


def softmax_row_q62(z, t, n, frac, out):
    """out[t, :n] = softmax(z[t, :n]) in Q0.62, z in Q.frac: fx.softmax_row_q31's steps
    (max-subtract, exp_neg_q62, the exact two-half sum, recip_q62) with the last rounding to
    Q0.62 instead of Q0.31. fx's analysis bounds the error before that rounding by
    2 2^-54 + n 2^-63 + 2^-60 absolute, so |p - softmax| <= 2^-52 + n 2^-63 (the `a` of
    backward_bounds_q10). Returns bitlen of the sum's high half."""
    m = int(z[t, 0])
    for j in range(1, n):
        m = max(m, int(z[t, j]))
    hi = 0
    lo = 0
    # e_j = exp(z_j - max), held in out until the sum is known
    for j in range(n):
        e = exp_neg_q62(-arg_q56(int(z[t, j]) - m, frac, 64))
        out[t, j] = e
        hi += e >> 31
        lo += e & MASK31
    hi += lo >> 31
    lo &= MASK31
    zb = bitlen(hi)
    sm = (hi << (62 - zb)) + (lo >> (zb - 31))
    h = recip_q62(sm)  # 2^123 / sm, the sum ~ sm 2^(zb - 31)
    # p_j = e_j h / 2^(30 + zb) in Q0.62
    for j in range(n):
        out[t, j] = mul_round(int(out[t, j]), h, 30 + zb)
    return zb


def backward_bounds_q10(n, n_h, rows):
    """Declared bounds (dq_R, dq_C, dc_KV, dk_R) of mla_backward_* against the float64 backward
    on the same integer inputs, in 2^-10 LSB of Q.24, for rows of <= n keys, key columns summed
    over <= `rows` query rows (n for a whole sequence; fewer for mla/gate_grad.py's query rows)
    and n_h heads, within the domain BWD_*_BITS (module docstring, "backward"). All terms are
    upper bounds in units of 2^-70 (an integer per real), rounded up; the last + 1 is float64's
    own error (2^-10 LSB)."""
    rho = 1 << 23  # 2^-47 >= 1.001 2^-48: z in Q.48 moves each p by a factor e^(+-2^-48)
    a = (1 << 18) + n * (1 << 7)  # 2^-52 + n 2^-63: the softmax's own error, per element
    row = rho + n * a  # sum_s |p_s - P_s| for one query row
    col = rows * (rho + a)  # sum_t |p_ts - P_ts| for one key column (its sum of P <= rows)
    e_dp = 1 << 21  # dp rounded to Q.48: 2^-49
    e_mu = (1 << 15) + (row << BWD_DP_BITS) + (1 << 22)  # mu in Q.54; sum |dp| |dP - dp|
    e = e_dp + e_mu
    big = 1 << (BWD_DP_BITS + 1)  # |dP - mu| <= 2 DP
    e_s = n * (1 << 21) + row * big + ((row * e) >> 70) + 1 + 2 * e  # sum_s |dS_int - dS|
    e_c = rows * (1 << 21) + col * big + ((col * e) >> 70) + 1 + rows * e  # sum_t |dS err|
    unit = 36  # a real error in 2^-70 units -> 2^-10 LSB of Q.24: x 2^24 2^10 / 2^70
    dq_r = 513 + (((e_s << BWD_KR_BITS) + (1 << unit) - 1) >> unit)
    g = (1 << 21) + (e_s << BWD_C_BITS)  # |g_int - g|: its rounding to Q.48 and sum_s |dS err| |c|
    dq_c = 513 + (((g << BWD_L1_BITS) + (1 << unit) - 1) >> unit)
    e_e = (1 << 21) + (e_c << BWD_Q_BITS)  # e = sum_t dS q_C, rounded to Q.48
    e_f = (1 << 21) + (col << BWD_DO_BITS)  # f = sum_t p do, rounded to Q.48
    dc = 513 + (((n_h * (e_e + e_f) << BWD_L1_BITS) + (1 << unit) - 1) >> unit)
    dk_r = 513 + (((n_h * e_c << BWD_Q_BITS) + (1 << unit) - 1) >> unit)
    return dq_r, dq_c, dc, dk_r


# pythran export mla_output_backward(int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C))
def mla_output_backward(o, x, w_g, w_o, dy):
    """(do int32 [T, H, d_v], du int32 [T, H d_v], saturations) for y = W_O (o ⊙ sigma(u)),
    u = x W_g, given dy [T, D] in Q.24 (G_FRAC). do = dG sigma(u), du = dG o sigma(1 - sigma),
    dG = W_O^T dy exact in Q.40 (|dy| < 2^4: < 2^28 2^20 2^13 = 2^61).

    sigma in Q0.62 (fx.sigmoid_q62, within 2^-55); do = mul_round(dG, sigma, 78), one rounding;
    du: t = mul_round(dG, sigma(1 - sigma), 62) in Q.40, then mul_round(t, o, 36) in Q.24.
    Errors for |dG| <= 2^BWD_DG_BITS, |o| < 2^4: do 1/2 + |dG| 2^-55 2^24 <= 1/2 + 2^-27 LSB;
    du 1/2 + |o| (2^-41 + |dG| 2^-53) 2^24 <= 1/2 + 2^-12 LSB: OUT_GRAD bound. do saturates at
    |do| >= 2^4 (DO_LIM, the domain mla_attend_backward assumes), counted with |dy| >= 2^4.
    """
    t_len, n_h, d_v = o.shape[0], o.shape[1], o.shape[2]
    d_model = x.shape[1]
    width = n_h * d_v
    do = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    du = np.zeros((t_len, width), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for t in range(t_len):
        for i in range(d_model):
            sat[t] += abs(int(dy[t, i])) > DO_LIM
        for k in range(width):
            # dG_k = sum_i dy_i W_O[i, k];  u_k = x W_g[k]
            dg = 0
            for i in range(d_model):
                dg += int(dy[t, i]) * int(w_o[i, k])
            acc = 0
            for d in range(d_model):
                acc += int(w_g[k, d]) * int(x[t, d])
            sig = sigmoid_q62(acc, 2 * W_FRAC)
            v = mul_round(dg, sig, 62 + W_FRAC + G_FRAC - G_FRAC)
            sat[t] += abs(v) > DO_LIM
            do[t, k // d_v, k % d_v] = clamp(v, DO_LIM)
            # du = dG o sigma (1 - sigma)
            t40 = mul_round(dg, mul_q62(sig, ONE_Q62 - sig), 62)
            du[t, k] = clamp(mul_round(t40, int(o[t, k // d_v, k % d_v]), 36), G_LIM)
    return do, du, int(np.sum(sat))


# The attention backward runs over query rows t = t0 .. t0 + R - 1, each over keys s <= t (q and
# do hold those R rows; P and dS are [H, R, T]). t0 = 0 and R = T is the whole sequence's square
# backward; a few rows at the end of a long cache (mla/gate_grad.py) hold O(R T), not O(T^2).
# (The sums are split over four kernels: one function holding all of them made g++ pass the 6 GiB
# compile cap, as mla_project once did.)
# pythran export mla_backward_probs(int32[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C))
def mla_backward_probs(q, t0, c_kv, k_r, w_uk):
    """P [H, R, T] in Q0.62 (int64; zero for s > t): row r is query t = t0 + r (q [R, H, d_qk]
    Q.20) over cache rows 0..t; the exact score totals rounded to Q.48 (saturating at
    |score| >= 2^12, counted) and softmax_row_q62. Returns (P, saturations)."""
    n_r, n_h, d_qk = q.shape[0], q.shape[1], q.shape[2]
    t_len, kv_lora = c_kv.shape[0], c_kv.shape[1]
    nope = w_uk.shape[1]
    rope = d_qk - nope
    p = np.zeros((n_h, n_r, t_len), dtype=np.int64)
    sat = np.zeros(n_h, dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        z = np.zeros((n_r, t_len), dtype=np.int64)
        row = np.zeros((n_r, t_len), dtype=np.int64)
        qa = np.zeros(kv_lora, dtype=np.int64)
        for r in range(n_r):
            t = t0 + r
            # W_UK^T q_C, exact
            for j in range(kv_lora):
                qa[j] = 0
            for i in range(nope):
                qi = int(q[r, h, i])
                for j in range(kv_lora):
                    qa[j] += int(w_uk[h, i, j]) * qi
            # z_ts, exact in two limbs, rounded to Q.48
            for s in range(t + 1):
                hi = 0
                lo = 0
                for j in range(kv_lora):
                    cj = int(c_kv[s, j])
                    hi += (int(qa[j]) >> SCORE_LIMB) * cj
                    lo += (int(qa[j]) & SCORE_MASK) * cj
                rs = 0
                for i in range(rope):
                    rs += int(q[r, h, nope + i]) * int(k_r[s, i])
                zs = score_round(hi, lo, rs, BWD_Z_FRAC)
                z[r, s] = zs
                if abs(zs) == Z_LIM:
                    sat[h] += 1
            softmax_row_q62(z, r, t + 1, BWD_Z_FRAC, row)
            for s in range(t + 1):
                p[h, r, s] = row[r, s]
    return p, int(np.sum(sat))


# pythran export mla_backward_scores(int64[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_backward_scores(p, t0, c_kv, w_uv, do):
    """dS [H, R, T] in Q.48 (int64): dl_t = W_UV^T do_t exact in Q.40, dP_ts = dl_t . c_s
    (wide, Q.56 -> Q.48, saturating at 2^6, counted), mu_t = sum_s P_ts dP_ts (wide, Q.110 ->
    Q.54), dS_ts = mul_round(P_ts, dP_ts 2^6 - mu_t, 68). do [R, H, d_v] in Q.24.
    Returns (dS, saturations)."""
    n_h, n_r, t_len = p.shape[0], p.shape[1], p.shape[2]
    kv_lora, d_v = w_uv.shape[2], w_uv.shape[1]
    ds = np.zeros((n_h, n_r, t_len), dtype=np.int64)
    sat = np.zeros(n_h, dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        dl = np.zeros(kv_lora, dtype=np.int64)
        dp = np.zeros(t_len, dtype=np.int64)
        for r in range(n_r):
            t = t0 + r
            # dl = W_UV^T do_t (do clamped to the domain the bounds assume)
            for j in range(kv_lora):
                dl[j] = 0
            for i in range(d_v):
                di = clamp(int(do[r, h, i]), DO_LIM)
                for j in range(kv_lora):
                    dl[j] += int(w_uv[h, i, j]) * di
            # dP_ts = dl . c_s;  mu_t = sum_s P_ts dP_ts
            mh = 0
            ml = 0
            for s in range(t + 1):
                wh = 0
                wl = 0
                for j in range(kv_lora):
                    wh, wl = wide_add(wh, wl, int(dl[j]), int(c_kv[s, j]))
                dps = wide_round(wh, wl, 56 - BWD_FRAC, DP_LIM)
                dp[s] = dps
                if abs(dps) >= DP_LIM:
                    sat[h] += 1
                mh, ml = wide_add(mh, ml, int(p[h, r, s]), dps)
            mu = wide_round(mh, ml, 62 + BWD_FRAC - BWD_MU_FRAC, MU_LIM)
            # dS_ts = P_ts (dP_ts - mu_t) in Q.48
            for s in range(t + 1):
                x = int(dp[s]) * (1 << (BWD_MU_FRAC - BWD_FRAC)) - mu
                ds[h, r, s] = mul_round(int(p[h, r, s]), x, 62 + BWD_MU_FRAC - BWD_FRAC)
    return ds, int(np.sum(sat))


# pythran export mla_backward_dq(int64[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C))
def mla_backward_dq(ds, t0, c_kv, k_r, w_uk):
    """(dq int32 [R, H, nope + rope] Q.24, saturations): g_t = sum_s dS_ts c_s (wide, Q.64 ->
    Q.48, saturating at 2^8), dq_C,t = W_UK g_t (wide, Q.64 -> Q.24) and dq_R,t = sum_s dS_ts
    k_R,s (wide, Q.64 -> Q.24)."""
    n_h, n_r = ds.shape[0], ds.shape[1]
    kv_lora, rope = c_kv.shape[1], k_r.shape[1]
    nope = w_uk.shape[1]
    dq = np.zeros((n_r, n_h, nope + rope), dtype=np.int32)
    sat = np.zeros(n_h, dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        g = np.zeros(kv_lora, dtype=np.int64)
        for r in range(n_r):
            t = t0 + r
            # g_t = sum_s dS_ts c_s
            for j in range(kv_lora):
                wh = 0
                wl = 0
                for s in range(t + 1):
                    wh, wl = wide_add(wh, wl, int(ds[h, r, s]), int(c_kv[s, j]))
                gj = wide_round(wh, wl, 64 - BWD_FRAC, G48_LIM)
                g[j] = gj
                if abs(gj) >= G48_LIM:
                    sat[h] += 1
            # dq_C,t = W_UK g_t
            for i in range(nope):
                wh = 0
                wl = 0
                for j in range(kv_lora):
                    wh, wl = wide_add(wh, wl, int(w_uk[h, i, j]), int(g[j]))
                vc = wide_round(wh, wl, 64 - G_FRAC, G_LIM)
                if abs(vc) >= G_LIM:
                    sat[h] += 1
                dq[r, h, i] = vc
            # dq_R,t = sum_s dS_ts k_R,s
            for i in range(rope):
                wh = 0
                wl = 0
                for s in range(t + 1):
                    wh, wl = wide_add(wh, wl, int(ds[h, r, s]), int(k_r[s, i]))
                vr = wide_round(wh, wl, 64 - G_FRAC, G_LIM)
                if abs(vr) >= G_LIM:
                    sat[h] += 1
                dq[r, h, nope + i] = vr
    return dq, int(np.sum(sat))


# pythran export mla_backward_dkv(int64[:,:,:] order(C), int64[:,:,:] order(C), int, int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_backward_dkv(ds, p, t0, q, do, w_uk, w_uv):
    """(dc_KV int32 [T, kv_lora], dk_R int32 [T, rope], both Q.24, saturations): per cache row s
    and head, e_s = sum_t dS_ts q_C,t (wide, Q.68 -> Q.48) and f_s = sum_t P_ts do_t (wide,
    Q.86 -> Q.48), saturating at 2^8; then dc_s = sum_h W_UK^T e_s + W_UV^T f_s and dk_R,s =
    sum_h sum_t dS_ts q_R,t, each one wide sum (Q.64, Q.68) rounded once. Rows in parallel."""
    n_h, n_r, t_len = ds.shape[0], ds.shape[1], ds.shape[2]
    nope, kv_lora = w_uk.shape[1], w_uk.shape[2]
    d_v = w_uv.shape[1]
    rope = q.shape[2] - nope
    dc = np.zeros((t_len, kv_lora), dtype=np.int32)
    dk_r = np.zeros((t_len, rope), dtype=np.int32)
    sat = np.zeros(t_len, dtype=np.int64)
    # omp parallel for
    for s in range(t_len):
        e = np.zeros((n_h, nope), dtype=np.int64)
        f = np.zeros((n_h, d_v), dtype=np.int64)
        first = max(s - t0, 0)  # the query rows t = t0 + r that see key s: t >= s
        for h in range(n_h):
            for i in range(nope):
                wh = 0
                wl = 0
                for r in range(first, n_r):
                    wh, wl = wide_add(wh, wl, int(ds[h, r, s]), int(q[r, h, i]))
                ei = wide_round(wh, wl, 68 - BWD_FRAC, G48_LIM)
                e[h, i] = ei
                if abs(ei) >= G48_LIM:
                    sat[s] += 1
            for i in range(d_v):
                wh = 0
                wl = 0
                for r in range(first, n_r):
                    wh, wl = wide_add(wh, wl, int(p[h, r, s]), clamp(int(do[r, h, i]), DO_LIM))
                fi = wide_round(wh, wl, 86 - BWD_FRAC, G48_LIM)
                f[h, i] = fi
                if abs(fi) >= G48_LIM:
                    sat[s] += 1
        # dc_s,j = sum_h (sum_i W_UK[h, i, j] e_s,i + sum_i W_UV[h, i, j] f_s,i)
        for j in range(kv_lora):
            wh = 0
            wl = 0
            for h in range(n_h):
                for i in range(nope):
                    wh, wl = wide_add(wh, wl, int(w_uk[h, i, j]), int(e[h, i]))
                for i in range(d_v):
                    wh, wl = wide_add(wh, wl, int(w_uv[h, i, j]), int(f[h, i]))
            vc = wide_round(wh, wl, 64 - G_FRAC, G_LIM)
            if abs(vc) >= G_LIM:
                sat[s] += 1
            dc[s, j] = vc
        # dk_R,s = sum_h sum_t dS_ts q_R,t
        for i in range(rope):
            wh = 0
            wl = 0
            for h in range(n_h):
                for r in range(first, n_r):
                    wh, wl = wide_add(wh, wl, int(ds[h, r, s]), int(q[r, h, nope + i]))
            vr = wide_round(wh, wl, 68 - G_FRAC, G_LIM)
            if abs(vr) >= G_LIM:
                sat[s] += 1
            dk_r[s, i] = vr
    return dc, dk_r, int(np.sum(sat))


# pythran export mla_softmax(int64[:,:] order(C))
def mla_softmax(z):
    """fx.softmax_row_q31 over every row of z (Q.32 scores): the probabilities the attention
    kernels form, exposed for the gates' exact big-integer model."""
    out = np.zeros((z.shape[0], z.shape[1]), dtype=np.int64)
    for i in range(z.shape[0]):
        softmax_row_q31(z, i, z.shape[1], Z_FRAC, out)
    return out


# == for tests: the two-limb rounding over arrays ================================================
# pythran export round_limbs_array(int64[:], int64[:], int, int)
def round_limbs_array(hi, lo, limb, s):
    """round_limbs elementwise."""
    out = np.zeros(hi.shape[0], dtype=np.int64)
    for i in range(hi.shape[0]):
        out[i] = round_limbs(int(hi[i]), int(lo[i]), limb, s)
    return out
