"""K3-μ glue in integers only: embedding, RMSNorm, Block AttnRes, the LM head with its
cross-entropy, AdamW, the learning-rate schedule and a seeded sampler (issue 14; K3-SPEC
sections 3, 4 and 10).

Formats (int64, C order; "Q.f": raw = round(value * 2^f)):
    x, y, h, xn   activations                Q.16 (ACT_FRAC)    |x| <= 2^5   raw <= 2^21
    E, W, w       weights, gains, queries    Q.20 (W_FRAC)      |W| <= 2^3   raw <= 2^23
    dy, dx, dW    gradients of L = SUM over tokens of the cross-entropy (nats)
                                             Q.24 (GRAD_FRAC)   |dy| <= 2^6  raw <= 2^30
    rstd          1/sqrt(mean(x^2) + eps)    Q.50 (RSTD_FRAC)   <= eps^-1/2 = 1000 < 2^10
    alpha         AttnRes depth weights      Q.62 (ALPHA_FRAC)  in [0, 1]
    score         AttnRes scores key . w     Q.48 (SCORE_FRAC)  |s| <= sqrt(d) |w|_2 < 2^13
    dlogits       softmax - onehot           Q.24               in [-1, 1]
    loss_q        SUM over tokens of CE      Q.32 (LOSS_FRAC)   a scalar
    m (AdamW)     first moment of G          Q.30 (M_FRAC)      |m| <= max |G| < 2^20
    v (AdamW)     kept as its square root    Q.40 (VS_FRAC)     sqrt(v) <= max |G| < 2^20
    lr, wd, betas, adam eps                  Q.30 (HYPER_FRAC)
    eps_raw       RMSNorm eps, Q.32 (mean(x^2) of Q.16 values is Q.32): EPS_Q32 = 1e-6

Rounding: fx's rshift_round / mul_round / div_round (half away from zero), once per stored
value; intermediate sums carry guard bits (stated per function). Nothing saturates: each
function states the domain where its int64 intermediates fit (the worst-case magnitudes above
keep every one of them inside with room to spare for d = 64, N <= 4096, V <= 2^10).

Error bounds against float64 on the same integer inputs, in output LSB over 2^10
(BOUND_FRAC), the constants below; each is the final rounding (1/2 LSB) plus a margin for the
earlier error, which each function's docstring bounds:
    embed                      exact rounding of E to Q.16    EMBED_ERR      512
    embed_backward             exact (integer sums)           EXACT          0
    rmsnorm_forward  y         1/2 + 2^-16                    RMSNORM_Y_ERR  513
    rmsnorm_backward dx        1/2 + 2^-9                     RMSNORM_DX_ERR 520
                     dw        1/2 + N 2^-14                  rmsnorm_dw_err_q10(N)
    attnres_forward  h         1/2 + 2^-8                     ATTNRES_H_ERR  520
    attnres_backward dV, dw    see attnres_backward           ATTNRES_DV_ERR, attnres_dw_err_q10
    head_loss        loss_q    1/2 + N (2^-5 + 2^-10)         head_loss_err_q10(N)
                     dlogits   1/2 + 2^-10                    DLOGITS_ERR    513
    head_backward    dxn, dW   exact sums, one rounding       HEAD_GRAD_ERR  513
    head_logits      z Q.16    exact dot, one rounding        LOGITS_ERR     513
    ln_q             Q.out     1/2 + 2^-10 (out <= 40)        LN_ERR         513
    add              exact                                    EXACT          0
    adamw_step       W         1/2 + lr |m_hat/sqrt(v_hat)| 2^-29 per step (m, sqrt v: 2^-30 rel.)
    lr_at            lr        1 LSB of Q.30 (cosine phase)
    sample_next      an exact integer draw from sample_weights / sum(sample_weights)
"""

import numpy as np

from ..fx.kernels import (
    LN2_Q56,
    MASK31,
    arg_q56,
    bitlen,
    div_round,
    div_round_shift,
    exp_neg_q62,
    isqrt,
    mul_mag_wide,
    mul_q62,
    mul_round,
    recip_q62,
    rshift_round,
    rsqrt_norm,
    sincos_q31,
)
from ..gemm.kernels import gemm_i64, transpose

# -- formats ------------------------------------------------------------------------------------
ACT_FRAC = 16
W_FRAC = 20
GRAD_FRAC = 24
RSTD_FRAC = 50
ALPHA_FRAC = 62
SCORE_FRAC = 48
LOGIT_FRAC = 36  # xn (Q.16) . W (Q.20): exact products
LOSS_FRAC = 32
M_FRAC = 30
VS_FRAC = 40
HYPER_FRAC = 30
ONE_Q62 = 1 << 62
ONE_Q30 = 1 << 30

# -- constants (raw integer, the real value it encodes) -----------------------------------------
EPS_Q32 = 4295  # round(1e-6 * 2**32): RMSNorm and AttnRes-key eps (mean(x^2) is Q.32)
BETA1_Q30 = 966367642  # round(0.9 * 2**30)
BETA2_Q30 = 1020054733  # round(0.95 * 2**30)
ADAM_EPS_Q30 = 11  # round(1e-8 * 2**30): the float twin uses 11 / 2**30 as well
ONE_MINUS_BETA1_Q30 = ONE_Q30 - BETA1_Q30  # exactly 1 - BETA1 in Q.30
ONE_MINUS_BETA2_Q30 = ONE_Q30 - BETA2_Q30
LN_TERMS = 16  # atanh series terms: u^2 <= 1/25, (1/25)^16 < 2^-74

# -- error bounds (output LSB over 2^10) -------------------------------------------------------
BOUND_FRAC = 10
EXACT_Q10 = 0
EMBED_ERR_Q10 = 512
RMSNORM_Y_ERR_Q10 = 513
RMSNORM_DX_ERR_Q10 = 520
ATTNRES_H_ERR_Q10 = 520
ATTNRES_DV_ERR_Q10 = 576
DLOGITS_ERR_Q10 = 513
HEAD_GRAD_ERR_Q10 = 513  # exact sums, one rounding; + 2^-10 for float64's own error
LN_ERR_Q10 = 513
LOGITS_ERR_Q10 = 513  # one rounding of an exact dot; + 2^-10 for float64's own error


def rmsnorm_dw_err_q10(n):
    """rmsnorm_backward's dw bound over 2^10 LSB for n token rows: 1/2 + n 2^-14."""
    return 512 + ((n + 15) >> 4)


def attnres_dw_err_q10(n, s):
    """attnres_backward's dw bound over 2^10 LSB for n tokens and s sources: 1/2 + n s 2^-12."""
    return 512 + ((n * s + 3) >> 2)


def head_loss_err_q10(n):
    """head_loss's loss_q bound over 2^10 LSB (Q.32) for n tokens: 1/2 + n (2^-5 + 2^-10)."""
    return 512 + 33 * n


# == helpers ===================================================================================
def rstd_q50(acc, n):
    """1/sqrt(acc / n) in Q.50 for acc = sum x^2 + n eps in Q.32 (acc > 0, n >= 1); 0 if acc <= 0.

    The mean is one long division to 60..62 significant bits (2^-61), fx's rsqrt_norm (2^-59.5),
    one rounding into Q.50: |error| <= 2^-51 + r 2^-59. Domain r < 2^12 (acc/n > 2^-24).
    """
    if acc <= 0:
        return 0
    s = max(0, 61 - bitlen(acc) + bitlen(n))
    h, e = rsqrt_norm(div_round_shift(acc, n, s), 32 + s)
    return rshift_round(h, max(e - RSTD_FRAC, 0))


def sum_sq_q32(x, i, eps):
    """sum_j x[i, j]^2 + d eps, exact in Q.32 (x Q.16; d x^2 < 2^62)."""
    d = x.shape[1]
    acc = d * eps
    for j in range(d):
        v = int(x[i, j])
        acc += v * v
    return acc


def limb_round(hi, lo, s):
    """(hi 2^31 + lo) / 2^s rounded half away from zero, 1 <= s <= 62. Exact.

    A long sum kept as two limbs: hi = sum of (term >> 31), lo = sum of (term & (2^31 - 1))
    (>= 0), so no partial sum can overflow (|hi| < 2^62, lo < 2^62: fewer than 2^31 terms of
    |term| < 2^62). The rounded result must fit int64.
    """
    h = hi + (lo >> 31)
    low = lo & MASK31
    # value = h 2^31 + low with 0 <= low < 2^31; q = floor(value / 2^s), rem = value - q 2^s
    if s <= 31:
        q = h * (1 << max(31 - s, 0)) + (low >> s)
        rem = low & ((1 << s) - 1)
    else:
        t = s - 31
        q = h >> t
        rem = ((h - q * (1 << max(t, 0))) << 31) + low
    half = 1 << (s - 1)
    if q >= 0:  # value >= 0 exactly when q >= 0 (0 <= rem < 2^s)
        return q + (1 if rem >= half else 0)
    return q + (1 if rem > half else 0)


# == 1. embedding ===============================================================================
# pythran export embed(int64[:] order(C), int64[:,:] order(C))
def embed(tokens, E):
    """x[n] = E[tokens[n]]: tokens int64 [N] in [0, V), E [V, d] Q.20 -> x [N, d] Q.16.

    One rshift_round by 4 per value: error <= 1/2 LSB (EMBED_ERR). No bound check on tokens
    (an out-of-range id is the caller's bug; NumPy/Pythran index rules apply).
    """
    n = tokens.shape[0]
    d = E.shape[1]
    x = np.zeros((n, d), dtype=np.int64)
    # omp parallel for
    for i in range(n):
        t = int(tokens[i])
        for j in range(d):
            x[i, j] = rshift_round(int(E[t, j]), W_FRAC - ACT_FRAC)
    return x


# pythran export embed_backward(int64[:] order(C), int64[:,:] order(C), int64)
def embed_backward(tokens, dx, vocab):
    """dE[v] = sum over n with tokens[n] == v of dx[n]: dx [N, d] Q.24 -> dE [vocab, d] Q.24.

    Exact (a scatter-add of integers; |dE_raw| <= N max |dx_raw| < 2^62). Columns are
    independent, so the loop over j runs in parallel and each sum is in token order.
    """
    n = tokens.shape[0]
    d = dx.shape[1]
    dE = np.zeros((vocab, d), dtype=np.int64)
    # omp parallel for
    for j in range(d):
        for i in range(n):
            t = int(tokens[i])
            dE[t, j] += int(dx[i, j])
    return dE


# == 2. RMSNorm =================================================================================
# pythran export rmsnorm_forward(int64[:,:] order(C), int64[:] order(C), int64)
def rmsnorm_forward(x, w, eps_raw):
    """y = w x rsqrt(mean(x^2) + eps) (K3-SPEC section 4) per row.

    x [N, d] Q.16, w [d] Q.20, eps_raw Q.32 (EPS_Q32 for 1e-6) -> (y [N, d] Q.16, rstd [N] Q.50).
    y_j = x_j w_j rstd / 2^70, one rounding from the exact product (mul_round). rstd's error
    (2^-51 + r 2^-59) moves y by |x w| 2^-51 real < 2^-27 LSB: error <= 1/2 + 2^-16 LSB
    (RMSNORM_Y_ERR). Domain: d x_raw^2 < 2^62, |x_raw w_raw| < 2^62, rstd < 2^12.
    """
    n = x.shape[0]
    d = x.shape[1]
    y = np.zeros((n, d), dtype=np.int64)
    rstd = np.zeros(n, dtype=np.int64)
    # omp parallel for
    for i in range(n):
        r = rstd_q50(sum_sq_q32(x, i, eps_raw), d)
        rstd[i] = r
        for j in range(d):
            y[i, j] = mul_round(
                int(x[i, j]) * int(w[j]), r, ACT_FRAC + W_FRAC + RSTD_FRAC - ACT_FRAC
            )
    return y, rstd


# pythran export rmsnorm_backward(int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:] order(C))
def rmsnorm_backward(dy, x, w, rstd):
    """Gradients of y = w x r, r = rsqrt(mean(x^2) + eps), with k = x r and g = dy w:

        dx = r (g - k mean_j(g_j k_j))        dw = sum over rows of dy k

    dy [N, d] Q.24, x Q.16, w [d] Q.20, rstd [N] Q.50 (from rmsnorm_forward)
    -> (dx [N, d] Q.24, dw [d] Q.24).
    Steps per row: g = dy w exact in Q.44 (|g| <= 2^9: raw 2^53); k = x r in Q.44 (|k| <= sqrt d);
    mean(g k) in Q.44 (terms rounded in Q.44, sum exact, one div_round by d), u = r mean(g k)
    in Q.40; dx = r g - k u formed in Q.40 and rounded once into Q.24. Error: u within
    2^-41 + r 2^-44 real, times |k| <= sqrt(d) = 8; k within 2^-45, times |u| <= r 2^9; r
    within 2^-51 + r 2^-59, times |g| <= 2^9: below 2^-10 LSB for r <= 2^8 (rms(x) >= 2^-8),
    so |dx error| <= 1/2 + 2^-9 LSB (RMSNORM_DX_ERR). Domain: d max|g| < 2^18.
    dw_j: terms dy k rounded in Q.40, summed exactly in two limbs (limb_round), rounded once:
    1/2 + N (2^-17 + 2^-15) LSB, declared as 1/2 + N 2^-14 (rmsnorm_dw_err_q10). Domain: |dy k| < 2^21, |dw| < 2^38.
    """
    n = x.shape[0]
    d = x.shape[1]
    dx = np.zeros((n, d), dtype=np.int64)
    k = np.zeros((n, d), dtype=np.int64)
    dw = np.zeros(d, dtype=np.int64)
    # omp parallel for
    for i in range(n):
        r = int(rstd[i])
        acc = 0
        for j in range(d):
            kj = mul_round(int(x[i, j]), r, ACT_FRAC + RSTD_FRAC - 44)
            k[i, j] = kj
            acc += mul_round(int(dy[i, j]) * int(w[j]), kj, 44)
        u = mul_round(div_round(acc, d), r, 44 + RSTD_FRAC - 40)  # r mean(g k), Q.40
        for j in range(d):
            a = mul_round(int(dy[i, j]) * int(w[j]), r, 44 + RSTD_FRAC - 40)
            b = mul_round(int(k[i, j]), u, 44)
            dx[i, j] = rshift_round(a - b, 40 - GRAD_FRAC)
    # omp parallel for
    for j in range(d):
        hi = 0
        lo = 0
        for i in range(n):
            t = mul_round(int(dy[i, j]), int(k[i, j]), GRAD_FRAC + 44 - 40)  # Q.40
            hi += t >> 31
            lo += t & MASK31
        dw[j] = limb_round(hi, lo, 40 - GRAD_FRAC)
    return dx, dw


# == 3. Block AttnRes ===========================================================================
def attnres_token(V, w, i, alpha, rstd, score):
    """Fill alpha[i] (Q.62), rstd[:, i] (Q.50) and score[i] (Q.48) for token i.

    score_s = r_s (V_s . w): the dot exact in Q.36 (d |V_raw w_raw| < 2^62), one mul_round into
    Q.48 (error 2^-49 + |s| 2^-58). alpha = softmax over s: e_s = exp(s - max) in Q.62
    (fx exp_neg_q62, relative 2^-54), summed in Q.56 (S <= 32 sources: sum < 2^61), then
    alpha_s = e_s / sum by one long division into Q.62: |alpha error| < 2^-50.
    """
    ns = V.shape[0]
    d = V.shape[2]
    for s in range(ns):
        acc = d * EPS_Q32
        dot = 0
        for j in range(d):
            v = int(V[s, i, j])
            acc += v * v
            dot += v * int(w[j])
        r = rstd_q50(acc, d)
        rstd[s, i] = r
        score[i, s] = mul_round(dot, r, ACT_FRAC + W_FRAC + RSTD_FRAC - SCORE_FRAC)
    m = int(score[i, 0])
    for s in range(1, ns):
        m = max(m, int(score[i, s]))
    total = 0
    for s in range(ns):
        e = exp_neg_q62(-arg_q56(int(score[i, s]) - m, SCORE_FRAC, 64))
        e56 = rshift_round(e, 6)
        alpha[i, s] = e56
        total += e56
    for s in range(ns):
        alpha[i, s] = div_round_shift(int(alpha[i, s]), total, 62)  # Q.62


# pythran export attnres_forward(int64[:,:,:] order(C), int64[:] order(C))
def attnres_forward(V, w):
    """Block AttnRes (K3-SPEC section 3): h = sum_s alpha_s V_s, alpha = softmax_s(key_s . w),
    key_s = V_s rsqrt(mean(V_s^2) + eps) per token (no norm weight, eps = EPS_Q32 = 1e-6).

    V [S, N, d] Q.16 (the sources: stored blocks, then the running prefix), w [d] Q.20
    -> (h [N, d] Q.16, alpha [N, S] Q.62, rstd [S, N] Q.50, score [N, S] Q.48); pass alpha,
    rstd and score back to attnres_backward.
    h_j = sum_s alpha_s V_sj: terms in Q.46 (mul_round, |term| < 2^51), one rounding into Q.16.
    Error: 1/2 + S 2^-31 + 2^16 |V| sum_s |alpha error| (< 2^-50 each, plus the score rounding's
    2^-48 relative) < 1/2 + 2^-8 LSB for S <= 16 (ATTNRES_H_ERR). One source gives h = V
    (alpha = 1 exactly). Domain: S <= 32, d V_raw^2 < 2^62, |score| < 2^13.
    """
    ns = V.shape[0]
    n = V.shape[1]
    d = V.shape[2]
    h = np.zeros((n, d), dtype=np.int64)
    alpha = np.zeros((n, ns), dtype=np.int64)
    rstd = np.zeros((ns, n), dtype=np.int64)
    score = np.zeros((n, ns), dtype=np.int64)
    # omp parallel for
    for i in range(n):
        attnres_token(V, w, i, alpha, rstd, score)
        for j in range(d):
            acc = 0
            for s in range(ns):
                acc += mul_round(int(alpha[i, s]), int(V[s, i, j]), ALPHA_FRAC - 30)
            h[i, j] = rshift_round(acc, 30)
    return h, alpha, rstd, score


# pythran export attnres_backward(int64[:,:] order(C), int64[:,:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C))
def attnres_backward(dh, V, w, alpha, rstd, score):
    """Gradients of attnres_forward. Per token, with a_s = dh . V_s, abar = sum_t alpha_t a_t,
    ds_s = alpha_s (a_s - abar) (the score gradient), k_s = r_s V_s:

        dV_s = alpha_s dh + r_s ds_s (w - k_s score_s / d)     dw = sum over tokens, s of ds_s k_s

    (the key's RMSNorm backward with g = ds_s w, using mean(g k) = ds_s score_s / d).
    dh [N, d] Q.24, V [S, N, d] Q.16, w [d] Q.20, alpha [N, S] Q.62, rstd [S, N] Q.50,
    score [N, S] Q.48 (from attnres_forward) -> (dV [S, N, d] Q.24, dw [d] Q.24).
    Internals: a_s exact in Q.40 (d |dh_raw V_raw| < 2^62); abar, ds in Q.40; c_s = r_s ds_s
    in Q.36 (range for a near-zero source, whose r reaches 1000); f_sj = w_j - k_sj score_s / d
    in Q.48 (k in Q.44, score / d in Q.56); both dV terms in Q.32, one rounding into Q.24. Error of dV, in LSB:
    1/2 + 2^-8 (two Q.32 roundings) + 2^-6.8 (c's rounding times |f| <= 2^3 (1 + sqrt d))
    + |c f| 2^-23 (alpha's and the score's relative error 2^-47): below ATTNRES_DV_ERR
    = 1/2 + 2^-4 for |c f| < 2^17 real.
    dw_j: terms ds k rounded in Q.40, summed exactly in two limbs, one rounding:
    1/2 + N S 2^-12 LSB (attnres_dw_err_q10; each term's rounding 2^-17 plus ds's error
    2^-39 times |k| <= 8). Domain (real values): |ds| < 2^21, |c| < 2^26, |ds k| < 2^21,
    |dV| < 2^29, |dw| < 2^38.
    """
    ns = V.shape[0]
    n = V.shape[1]
    d = V.shape[2]
    dV = np.zeros((ns, n, d), dtype=np.int64)
    ds = np.zeros((n, ns), dtype=np.int64)
    kk = np.zeros((ns, n, d), dtype=np.int64)
    dw = np.zeros(d, dtype=np.int64)
    # omp parallel for
    for i in range(n):
        abar = 0
        for s in range(ns):
            a = 0
            for j in range(d):
                a += int(dh[i, j]) * int(V[s, i, j])
            ds[i, s] = a
            abar += mul_round(int(alpha[i, s]), a, ALPHA_FRAC)
        for s in range(ns):
            al = int(alpha[i, s])
            dss = mul_round(al, int(ds[i, s]) - abar, ALPHA_FRAC)
            ds[i, s] = dss
            r = int(rstd[s, i])
            c = mul_round(r, dss, RSTD_FRAC + 40 - 36)  # r ds in Q.36
            sc = int(score[i, s])
            sd = div_round_shift(abs(sc), d, 8)  # |score| / d in Q.56 (<= max |w| <= 2^3)
            sd = -sd if sc < 0 else sd
            for j in range(d):
                kj = mul_round(int(V[s, i, j]), r, ACT_FRAC + RSTD_FRAC - 44)
                kk[s, i, j] = kj
                f = (int(w[j]) << (48 - W_FRAC)) - mul_round(kj, sd, 52)
                t1 = mul_round(al, int(dh[i, j]), ALPHA_FRAC + GRAD_FRAC - 32)
                t2 = mul_round(c, f, 36 + 48 - 32)
                dV[s, i, j] = rshift_round(t1 + t2, 32 - GRAD_FRAC)
    # omp parallel for
    for j in range(d):
        hi = 0
        lo = 0
        for i in range(n):
            for s in range(ns):
                t = mul_round(int(ds[i, s]), int(kk[s, i, j]), 44)  # Q.40
                hi += t >> 31
                lo += t & MASK31
        dw[j] = limb_round(hi, lo, 40 - GRAD_FRAC)
    return dV, dw


# == 4. add =====================================================================================
# pythran export add(int64[:] order(C), int64[:] order(C))
# pythran export add(int64[:,:] order(C), int64[:,:] order(C))
# pythran export add(int64[:,:,:] order(C), int64[:,:,:] order(C))
def add(a, b):
    """a + b elementwise, same shape and format (residual updates, gradient accumulation).
    Exact for |a + b| < 2^63."""
    return a + b


# == 5. natural log, head and cross-entropy =====================================================
def ln_q(x, frac, out_frac):
    """ln(x 2^-frac) in Q.out_frac for x > 0 (any int64 frac; x <= 0 returns 0: outside).

    Range reduction: x = y 2^k with y in Q.58 in [1, 2) (x's top 59 bits, relative error 2^-59),
    halved when y >= 3/2 so that Y in [3/4, 3/2); then ln Y = 2 atanh(u), u = (Y-1)/(Y+1)
    (|u| <= 1/5, one long division into Q.62), and 2 atanh u = 2u sum_n u^(2n)/(2n+1), LN_TERMS
    terms (truncation (1/25)^16 < 2^-74), Horner in Q0.62. ln x = k ln 2 + ln Y in Q.56 with
    fx's LN2_Q56 (error |k| 2^-57 <= 2^-51 for |k| <= 63). Total error < 2^-50 + the final
    rounding: 1/2 + 2^-10 LSB for out_frac <= 40 (LN_ERR). Domain |k| <= 60 (|ln x| < 41:
    k ln 2 in Q.56 must fit; k = bitlen(x) - 1 - frac), 0 <= out_frac <= 56.
    """
    if x <= 0:
        return 0
    b = bitlen(x)
    y = x << max(59 - b, 0) if b <= 59 else rshift_round(x, b - 59)  # Q.58, in [2^58, 2^59]
    k = b - 1 - frac
    if y >= 3 << 57:  # Y = y / 2, in Q.59 the same integer
        yy = y
        k += 1
    else:
        yy = y << 1  # Q.59, Y in [1, 3/2)
    num = yy - (1 << 59)
    den = yy + (1 << 59)
    u = div_round_shift(abs(num), den, 62 - 59 + 59)  # |num| / den in Q.62
    u = -u if num < 0 else u
    u2 = mul_q62(u, u)
    p = div_round(ONE_Q62, 2 * LN_TERMS - 1)
    for t in range(LN_TERMS - 2, -1, -1):
        p = div_round(ONE_Q62, 2 * t + 1) + mul_q62(u2, p)
    lny = rshift_round(mul_q62(u, p), 5)  # 2 u p in Q.56
    return rshift_round(k * LN2_Q56 + lny, 56 - out_frac)


# pythran export ln_q_array(int64[:] order(C), int64, int64)
def ln_q_array(x, frac, out_frac):
    """ln_q elementwise (for the tests' exhaustive grid)."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = ln_q(int(x[i]), frac, out_frac)
    return out


def matmul(a, b, shift):
    """rshift_round(A B^T, shift), exact, by the shared GEMM (k3gates/gemm): A [M, K], B [N, K]
    int64. Raises ValueError for rows outside its exact int64 domain (Hoelder: every partial
    sum below 2^62), which the formats above keep far away (d |x W| < 2^50)."""
    c, outside = gemm_i64(a, b, shift)
    if outside != 0:
        raise ValueError("kernels_glue: a matmul's rows are outside the exact int64 domain")
    return c


def ce_row(z, i, target, dl, want_grad):
    """Cross-entropy of row i of z (Q.36 logits) in Q.36; if want_grad, dl[i] = softmax - onehot
    in Q.24.

    logsumexp = max + ln S, S = sum_v e^(z_v - max) in [1, V]: each e_v in Q.62 (fx
    exp_neg_q62, relative 2^-54), S held exactly as two limbs (as fx.softmax_row_q31), its top
    62 bits (2^-61) given to ln_q: ln S within 2^-53 + the rounding into Q.36 (1/2 LSB). CE =
    (max - z_t) + ln S exact in Q.36. p_v = e_v / S by fx's recip_q62 (2^-60.5), one rounding
    into Q.24: 1/2 + 2^-20 LSB.
    """
    nv = z.shape[1]
    m = int(z[i, 0])
    for v in range(1, nv):
        m = max(m, int(z[i, v]))
    hi = 0
    lo = 0
    for v in range(nv):
        e = exp_neg_q62(-arg_q56(int(z[i, v]) - m, LOGIT_FRAC, 64))
        if want_grad:
            dl[i, v] = e
        hi += e >> 31
        lo += e & MASK31
    hi += lo >> 31
    lo &= MASK31
    zb = bitlen(hi)
    sm = (hi << (62 - zb)) + (lo >> (zb - 31))  # S ~ sm 2^(zb - 93)
    ce = m - int(z[i, target]) + ln_q(sm, 93 - zb, LOGIT_FRAC)
    if want_grad:
        h = recip_q62(sm)  # 2^123 / sm
        for v in range(nv):
            p = mul_round(int(dl[i, v]), h, 61 + zb + 31 - GRAD_FRAC)
            dl[i, v] = p - (1 << GRAD_FRAC) if v == target else p
    return ce


def head_rows(xn, W, targets, want_grad):
    n = xn.shape[0]
    nv = W.shape[0]
    # z = xn W^T, exact in Q.36
    z = matmul(xn, W, 0)
    rows = n if want_grad else 1
    cols = nv if want_grad else 1
    dl = np.zeros((rows, cols), dtype=np.int64)
    ce = np.zeros(n, dtype=np.int64)
    # omp parallel for
    for i in range(n):
        ce[i] = ce_row(z, i, int(targets[i]), dl, want_grad)
    total = 0
    for i in range(n):
        total += int(ce[i])
    return rshift_round(total, LOGIT_FRAC - LOSS_FRAC), dl


# pythran export head_loss(int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C))
def head_loss(xn, W, targets):
    """Logits z = xn W^T, L = SUM over tokens of CE = logsumexp(z) - z_target (nats).

    xn [N, d] Q.16, W [V, d] Q.20, targets int64 [N] in [0, V)
    -> (loss_q: int, Q.32; dlogits [N, V] Q.24 = softmax(z) - onehot(target)).
    Logits exact in Q.36; per-token CE in Q.36 within 1/2 + 2^-16 of its Q.36 LSB (ce_row);
    summed exactly in Q.36 and rounded once into Q.32: |loss error| <= 1/2 + N (2^-5 + 2^-10)
    LSB (head_loss_err_q10). dlogits: 1/2 + 2^-10 LSB (DLOGITS_ERR).
    Domain: d |xn_raw W_raw| < 2^62 (|z| < 2^25), sum of CE < 2^26 nats.
    """
    return head_rows(xn, W, targets, True)


# pythran export eval_loss(int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C))
def eval_loss(xn, W, targets):
    """head_loss's loss_q alone (validation: no dlogits array), bit-identical to it."""
    loss, _ = head_rows(xn, W, targets, False)
    return loss


# pythran export head_logits(int64[:,:] order(C), int64[:,:] order(C))
def head_logits(xn, W):
    """Logits z = xn W^T for sampling: xn [N, d] Q.16, W [V, d] Q.20 -> z [N, V] Q.16.

    The dot is exact in Q.36 (as in head_loss), one rounding: error <= 1/2 LSB (LOGITS_ERR).
    """
    # z = xn W^T: Q.36 -> Q.16
    return matmul(xn, W, LOGIT_FRAC - ACT_FRAC)


# pythran export head_backward(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C))
def head_backward(dlogits, xn, W):
    """dxn = dlogits W, dW = dlogits^T xn.

    dlogits [N, V] Q.24, xn [N, d] Q.16, W [V, d] Q.20 -> (dxn [N, d] Q.24, dW [V, d] Q.24).
    Both sums exact (Q.44: V |dl_raw W_raw| < 2^62; Q.40: N |dl_raw xn_raw| < 2^62, i.e.
    N < 2^17 at |dl| <= 1, |xn| <= 2^5), one rounding each: 1/2 LSB (HEAD_GRAD_ERR).
    """
    # dxn = dlogits W: Q.44 -> Q.24
    dxn = matmul(dlogits, transpose(W), W_FRAC)
    # dW = dlogits^T xn: Q.40 -> Q.24
    dW = matmul(transpose(dlogits), transpose(xn), ACT_FRAC)
    return dxn, dW


# == 6. AdamW ===================================================================================
def one_minus_pow(beta, t):
    """1 - beta^t in Q.62 for beta in Q.30 (0 < beta < 1) and t >= 1: beta^t by t mul_rounds
    in Q.62 (error < t 2^-63, below the Q.30 constant's own rounding for t < 2^30)."""
    p = ONE_Q62
    for _ in range(t):
        p = mul_round(p, beta, HYPER_FRAC)
    return ONE_Q62 - p


def sqrt_ema(vs, g40):
    """sqrt(beta2 vs^2 + (1 - beta2) g^2) in Q.40 for vs >= 0 and g in Q.40 (both < 2^62).

    Both are shifted right by sh so the larger has <= 31 bits, the squares (< 2^62) mixed in
    Q.30 weights, the square root rounded to nearest and shifted back: relative error
    <= 2^-30 when sh > 0, <= 1 raw LSB otherwise.
    """
    a = max(vs, abs(g40))
    sh = max(bitlen(a) - 31, 0)
    x = rshift_round(vs, sh)
    y = rshift_round(abs(g40), sh)
    s = mul_round(BETA2_Q30, x * x, HYPER_FRAC) + mul_round(ONE_MINUS_BETA2_Q30, y * y, HYPER_FRAC)
    r = isqrt(s)
    if s - r * r > r:  # (r + 1/2)^2 = r^2 + r + 1/4: round to nearest
        r += 1
    return r << sh


# pythran export adamw_step(int64[:] order(C), int64[:] order(C), int64[:] order(C), int64[:] order(C), int64, int64, int64)
def adamw_step(W, m, v, G, lr_q, step, wd_q):
    """One AdamW step (decoupled weight decay), on flat 1-D arrays: the caller passes
    W.reshape(-1) (and m, v, G alike) and reshapes the results back.

        m <- b1 m + (1 - b1) G;  v <- b2 v + (1 - b2) G^2
        W <- W - lr wd W - lr m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^t),
        sqrt(v_hat) = sqrt(v) / sqrt(1 - b2^t)

    W [P] Q.20, m [P] Q.30, v [P]: v is STORED AS ITS SQUARE ROOT vs = sqrt(v) in Q.40 (an RMS
    of the gradients: squares of gradients from 2^-24 to 2^20 span 88 bits, their roots 44), G
    [P] Q.24, lr_q and wd_q Q.30 (<= 1), step t >= 1 (the t-th update). Zeros are the initial
    m and vs. Returns new arrays (W, m, vs). Constants BETA1_Q30, BETA2_Q30, ADAM_EPS_Q30.
    Per element: m by two mul_rounds (error <= 1 LSB of Q.30 per step); vs by sqrt_ema
    (relative 2^-30); the ratio q = m_hat / (sqrt(v_hat) + eps) in Q.40 by one long division
    of normalised operands (relative 2^-39); W's update lr q + lr wd W formed in Q.40, rounded
    once into Q.20: 1/2 LSB + lr |q| 2^-29 per step. Domain: |G| < 2^20, |m| < 2^20, |W| < 2^40.
    """
    n = W.shape[0]
    Wn = np.zeros(n, dtype=np.int64)
    mn = np.zeros(n, dtype=np.int64)
    vn = np.zeros(n, dtype=np.int64)
    c1 = one_minus_pow(BETA1_Q30, step)  # Q.62
    c2 = one_minus_pow(BETA2_Q30, step)
    hc, ec = rsqrt_norm(c2, 62)  # 1/sqrt(c2) = hc 2^-ec
    lrwd = lr_q * wd_q  # Q.60
    eps40 = ADAM_EPS_Q30 << (VS_FRAC - HYPER_FRAC)
    # omp parallel for
    for i in range(n):
        g = int(G[i])
        mi = mul_round(BETA1_Q30, int(m[i]), HYPER_FRAC) + mul_round(
            ONE_MINUS_BETA1_Q30, g, HYPER_FRAC + GRAD_FRAC - M_FRAC
        )
        vi = sqrt_ema(int(v[i]), g << (VS_FRAC - GRAD_FRAC))
        mn[i] = mi
        vn[i] = vi
        den = mul_round(vi, hc, ec) + eps40  # sqrt(v_hat) + eps, Q.40, >= 2^13
        # q = |m| 2^-30 / (c1 2^-62 den 2^-40) = |m| 2^72 / (c1 den), in Q.40
        sh = max(bitlen(c1) + bitlen(den) - 40, 0)
        pq = mul_round(c1, den, sh)  # c1 den / 2^sh < 2^41
        q = div_round_shift(abs(mi), pq, 72 + VS_FRAC - sh)
        q = -q if mi < 0 else q
        wi = int(W[i])
        upd = mul_round(lr_q, q, HYPER_FRAC) + mul_round(lrwd, wi, 60 - (40 - W_FRAC))  # Q.40
        Wn[i] = wi - rshift_round(upd, 40 - W_FRAC)
    return Wn, mn, vn


# == 7. learning-rate schedule ==================================================================
# pythran export lr_at(int64, int64, int64, int64, int64)
def lr_at(step, warmup, total, lr_max_q, lr_min_q):
    """The learning rate for update number `step` (1-based: the step AdamW is given), Q.30.

        step <= 0                     0
        1 <= step <= warmup           lr_max step / warmup              (linear warm-up from 0)
        warmup < step < total         lr_min + (lr_max - lr_min) (1 + cos(pi p)) / 2,
                                      p = (step - warmup) / (total - warmup)   (cosine decay)
        step >= total                 lr_min
    lr_max_q, lr_min_q Q.30 (0 <= lr_min <= lr_max < 2^31). warmup = 0 skips the warm-up.
    Warm-up: one div_round (exact rounding). Decay: the phase p/2 turns in Q.31 (one
    div_round), fx's sincos_q31 (1/2 + 2^-23 of 2^-31), one mul_round: error <= 1 LSB (Q.30).
    """
    if step <= 0:
        return 0
    if step <= warmup:
        return div_round(lr_max_q * step, warmup)
    if step >= total:
        return lr_min_q
    phase = div_round((step - warmup) << 30, total - warmup)  # p / 2 turns, Q.31
    _, c = sincos_q31(phase, 31)
    return lr_min_q + mul_round(lr_max_q - lr_min_q, (1 << 31) + c, 32)


# == 8. sampler =================================================================================
M32 = (1 << 32) - 1
M16 = (1 << 16) - 1
SM_GAMMA_HI = 0x9E3779B9  # splitmix64's increment 0x9E3779B97F4A7C15, as two 32-bit halves
SM_GAMMA_LO = 0x7F4A7C15
SM_MUL1_HI = 0xBF58476D  # 0xBF58476D1CE4E5B9
SM_MUL1_LO = 0x1CE4E5B9
SM_MUL2_HI = 0x94D049BB  # 0x94D049BB133111EB
SM_MUL2_LO = 0x133111EB
SAMPLE_WEIGHT_FRAC = 52  # top-k weights e^((z - max)/T) in Q.52 (<= 2^10 of them sum < 2^62)


def mul32_full(a, b):
    """(hi, lo) 32-bit halves of a b for 0 <= a, b < 2^32, by 16-bit limbs (all < 2^50)."""
    a0 = a & M16
    a1 = a >> 16
    b0 = b & M16
    b1 = b >> 16
    mid = a0 * b1 + a1 * b0  # < 2^33
    low = a0 * b0 + ((mid & M16) << 16)  # < 2^33
    hi = a1 * b1 + (mid >> 16) + (low >> 32)
    return hi & M32, low & M32


def mul64(ah, al, bh, bl):
    """(a b) mod 2^64 on 32-bit halves: al bl + ((ah bl + al bh) mod 2^32) 2^32."""
    h, lo = mul32_full(al, bl)
    _, c1 = mul32_full(ah, bl)
    _, c2 = mul32_full(al, bh)
    return (h + c1 + c2) & M32, lo


def xorshr(h, lo, k):
    """(z ^ (z >> k)) on 32-bit halves, 0 < k < 32."""
    sl = ((lo >> k) | (h << (32 - k))) & M32
    return h ^ (h >> k), lo ^ sl


def splitmix64(state):
    """splitmix64 (Steele, Lea, Flood 2014) on an int64 holding the unsigned 64-bit state
    (two's complement), in 32-bit halves so that nothing overflows in C or grows in Python.
    Returns (z, new_state), z as (hi, lo) 32-bit halves of the 64-bit output."""
    sh = (state >> 32) & M32
    sl = state & M32
    lo = sl + SM_GAMMA_LO
    h = (sh + SM_GAMMA_HI + (lo >> 32)) & M32
    lo &= M32
    new_state = (h - (1 << 32)) * (1 << 32) + lo if h >= (1 << 31) else (h << 32) + lo
    zh, zl = xorshr(h, lo, 30)
    zh, zl = mul64(zh, zl, SM_MUL1_HI, SM_MUL1_LO)
    zh, zl = xorshr(zh, zl, 27)
    zh, zl = mul64(zh, zl, SM_MUL2_HI, SM_MUL2_LO)
    zh, zl = xorshr(zh, zl, 31)
    return zh, zl, new_state


def top_weights(logits, temperature_q, top_k, order, wt):
    """Fill order[:k] with the k largest logits' indices (ties: lower index first) and wt[v] =
    e^((z_v - max) / T) in Q.52 for those, 0 elsewhere; returns (k, total weight).

    (z_max - z_v) / T by one long division into Q.32 (exact rounding), fx's exp_neg_q62, one
    rounding into Q.52.
    """
    nv = logits.shape[0]
    k = nv if top_k <= 0 or top_k > nv else top_k
    used = np.zeros(nv, dtype=np.int64)
    for r in range(k):
        best = -1
        for v in range(nv):
            if used[v] == 0 and (best < 0 or int(logits[v]) > int(logits[best])):
                best = v
        used[best] = 1
        order[r] = best
    zmax = int(logits[order[0]])
    total = 0
    for r in range(k):
        v = int(order[r])
        x = div_round_shift(zmax - int(logits[v]), temperature_q, 32)  # Q.32, >= 0
        e = exp_neg_q62(arg_q56(x, 32, 64))
        wv = rshift_round(e, 62 - SAMPLE_WEIGHT_FRAC)
        wt[v] = wv
        total += wv
    return k, total


# pythran export sample_weights(int64[:] order(C), int64, int64)
def sample_weights(logits, temperature_q, top_k):
    """The sampler's distribution: weights [V] in Q.52 (0 outside the top k); token v is drawn
    with probability weights[v] / sum(weights) exactly (up to the 2^-62 grain of the draw)."""
    nv = logits.shape[0]
    order = np.zeros(nv, dtype=np.int64)
    wt = np.zeros(nv, dtype=np.int64)
    top_weights(logits, temperature_q, top_k, order, wt)
    return wt


# pythran export sample_next(int64[:] order(C), int64, int64, int64)
def sample_next(logits, temperature_q, top_k, state):
    """Draw the next token from softmax(top-k logits / T) by inverse CDF: (token, new_state).

    logits [V] Q.16, temperature_q Q.16 (> 0), top_k (<= 0 or >= V: all V), state: the
    splitmix64 state as int64 (any value seeds it; the unsigned 64-bit state in two's
    complement). One splitmix64 output gives u in [0, 1) as 62 bits; r = floor(u total) (exact,
    128-bit product); the token is the first of the top k (largest logit first) whose running
    weight sum exceeds r. Integer only, so the same (logits, T, k, state) give the same token on
    any machine. Domain: |logits_raw| < 2^40, (z_max - z_v) / T < 2^29.
    """
    nv = logits.shape[0]
    order = np.zeros(nv, dtype=np.int64)
    wt = np.zeros(nv, dtype=np.int64)
    k, total = top_weights(logits, temperature_q, top_k, order, wt)
    zh, zl, new_state = splitmix64(state)
    u = (zh << 30) | (zl >> 2)  # top 62 bits: Q0.62 in [0, 1)
    r, _ = mul_mag_wide(u, total)  # floor(u total / 2^62) < total
    acc = 0
    token = int(order[k - 1])
    for i in range(k):
        v = int(order[i])
        acc += int(wt[v])
        if acc > r:
            token = v
            break
    return token, new_state
