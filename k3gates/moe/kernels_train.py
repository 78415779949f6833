"""K3-μ's Stable LatentMoE FFN (K3-SPEC.md section 4) in integers only: forward, backward, QB.

Token-wise on N = B*T rows of the (already RMS-normed) input x:

    s = sigma(W_r x)                      [n] router scores on the full input
    S = top-k of s + bias                 the bias selects, never weights (ties: lower index)
    w_e = rsf s_e / sum_{e' in S} s_e'    renormalised unbiased scores
    z = W_down x                          [d_l] the latent
    E_e(z) = w2[e] SiTU-GLU(w1[e] z, w3[e] z)
    c = sum_{e in S} w_e E_e(z);  r = RMSNorm(c) w_n  (eps 1e-6)
    y = W_up r + ws2 SiTU-GLU(ws1 x, ws3 x)           (the shared expert, on the full x)

SiTU-GLU(g, u) = [beta tanh(g/beta) sigma(g)] [beta_lin tanh(u/beta_lin)], beta 4, beta_lin 25,
from k3gates/situ/kernels.py (situ_parts, situ_from_parts, situ_grad_from_parts).
The backward holds the selection fixed and reaches W_r through the weights w_e:
ds_f = rsf/S (dw_f - sum_e p_e dw_e), p_e = s_e/S, dlogit_f = ds_f s_f (1 - s_f).
Quantile Balancing (kexue.fm/archives/11619) is k3gates/moe/kernels.py's exact `qb_update`.

Exports, chained by layer_moe.py (each pass is its own export: Pythran's C++ types chain through
every array one function writes and reads, and one long kernel took minutes to compile):
forward moe_fwd_route -> moe_situ_fwd -> moe_fwd_out; backward moe_bwd_latent -> moe_situ_bwd
-> moe_bwd_dx -> moe_wgrad; moe_qb_update. Each non-linearity has one call site (SiTU in
moe_situ_fwd / moe_situ_bwd on all k h_e + h_s units of a token, the router's sigma in
moe_fwd_route, the latent rsqrt in moe_fwd_out): every inlined copy costs compile time.

Formats (int64 throughout; "Q.f": raw v stands for v 2^-f; magnitudes in real units):
    x                  [N, d]        Q.16  (ACT_FRAC)  |x| <= 2^5
    y                  [N, d]        Q.16              one rounding of an exact Q.44 sum
    weights            [out, in]     Q.20  (W_FRAC)    |W| <= 2^3; w1, w3 [n, h_e, d_l],
                                                       w2 [n, d_l, h_e]; w_n [d_l]
    bias               [n]           Q.40  (BIAS_FRAC) router-score format: an exception to
                                                       the Q.20 vector rule, so QB is exact
    rsf                scalar        Q.20              <= 4 (RSF_MAX)
    router logits, z, shared g/u     Q.36  exact (Q.16 x Q.20), |.| < 2^14
    scores s40 [N, n]                Q.40  selection and QB; ssel [N, k] the selected in Q0.62
    combine weights wts [N, k]       Q.60  (P_FRAC), rsf s_e / S <= 4 < 2^2
    internal activations             Q.24  (A_FRAC): z, g, u, a = SiTU, E, c, chat = c/rho,
                                     r, a_s; one rounding each from an exact Q.36 / Q.44 sum
    SiTU factors (tg, sg, tu)        Q0.62 (cached for the backward: no transcendental twice)
    rinv [N, 2]                      1/rho = rinv[0] 2^-rinv[1], 2^61 <= rinv[0] <= 2^62
    dy, dx, weight gradients         Q.24  (GRAD_FRAC)
    internal per-token gradients     Q.28  (G_FRAC): dr, da_s, dgs, dus, dc, dE, da, dg, du,
                                     dz, dlogit
Rounding: half away from zero everywhere (fx.rshift_round, mul_round, div_round,
div_round_shift); every stored value is rounded once from an exact integer sum. Division only
by positive divisors (div_round, div_round_shift with explicit signs).

Domain (int64 overflow; nothing saturates, so these are premises, stated here):
    every matrix-vector sum of |W| |v| stays below 2^62 raw: in real units sum |W||v| < 2^18
    for weights times Q.24 activations (g, u, E, y: e.g. |z| < 2^9 with |W| <= 8 and
    d_l = 32; SiTU outputs are <= 100, so E, y hold for widths <= 256), and < 2^14 for weights
    times Q.28 gradients (dr, da, dz, dx);
    every weight-gradient product |g_t a_t| < 2^63 raw (Q.52: |g a| < 2^11; Q.44/Q.48 more);
    token sums are exact (split accumulators, any N < 2^20);
    the RMSNorm sum of squares is pre-shifted per row so it never passes 2^61 (any c);
    the router needs a nonzero selected-score sum (sigma > 0 exactly unless a logit < -43).
K3-μ's values (unit-RMS x, weights ~ 1/sqrt(fan_in), |dy| < 1) sit some 2^8 inside.

Error bounds (declared; tests/test_k3mu_moe.py checks them against float64 on the same integer
inputs, with the integer run's selection given to the float reference):
- forward y: 1/2 LSB of Q.16 (the final rounding) plus the first-order propagation of the
  internal roundings, u = 2^-25 (half an LSB of Q.24) each, through the layer's actual
  Jacobians (`forward_bound` in the test computes it on the data):
      e_z = u, e_g = u + |w1| e_z, e_u = u + |w3| e_z,
      e_a = u + 2^-45 + |da/dg| e_g + |da/du| e_u          (2^-45: SiTU's Q0.62 factor floor),
      e_E = |w2| e_a,  e_c = sum_j (|w_j| e_E + u + |E_j| rsf (k+1) 2^-54 / S)  (score, p),
      e_chat = (e_c + |chat| (|chat| . e_c) / d_l) / rho + u + |chat| 2^-58,
      e_r = |w_n| e_chat + u,  e_as = u + 2^-45,  e_y = |W_up| e_r + |ws2| e_as,
  times FWD_SLACK = 5/4 for second-order terms. On K3-μ-like data this is ~2.8 LSB of Q.16;
  the measured error is 0.501 LSB (the final rounding dominates).
- backward (dx and each weight gradient): 1/2 LSB of Q.24 plus BWD_REL_Q30 / 2^30 (2^-17) of
  the array's largest float magnitude. This one is a budget, not a proof: the internal Q.28
  roundings (2^-29) and the forward's Q.24 values (2^-25) enter every gradient through gains
  of at most ~2^4 on K3-μ's data, about 2^-21 relative, taken with a 2^4 margin. Measured
  (B=2, T=12, d=64): at most 4.8e-7 of the array's RMS, 19 LSB on dw_up.
- qb_update: exact on its integer scores (k3gates/moe/kernels.py).
"""

import numpy as np

from ..fx.kernels import (
    bitlen,
    div_round,
    div_round_shift,
    mul_q62,
    mul_round,
    rshift_round,
    rsqrt_norm,
    sigmoid_q62,
)
from ..gemm.kernels import gemm_i64, round_limbs, sum_outer, transpose
from ..moe.kernels import qb_update
from ..mxfp.kernels_qat import fake_quant
from ..situ.kernels import (
    SITU_BETA,
    SITU_BETA_LIN,
    situ_from_parts,
    situ_grad_from_parts,
    situ_parts,
)

# -- formats -------------------------------------------------------------------------------------
ACT_FRAC = 16  # x, y
W_FRAC = 20  # weights, w_n, rsf
GRAD_FRAC = 24  # dy, dx, weight gradients
BIAS_FRAC = 40  # QB bias = router-score format (k3gates/moe/kernels.py's S_FRAC)
XW_FRAC = ACT_FRAC + W_FRAC  # 36: W x exact
A_FRAC = 24  # internal activations (and SiTU's own output format, SITU_FRAC = 24)
E4M3 = 3  # mxfp's format code of MXFP8's element, for quantisation-aware training
G_FRAC = 28  # internal per-token gradients
SW_FRAC = 56  # selected scores summed for the renormalisation
P_FRAC = 60  # combine weights w_e and the ratios p_e = s_e / S
ONE_Q62 = 1 << 62
SPLIT = 20  # dw_n's token sum held as hi 2^SPLIT + lo (lo >= 0): exact
SPLIT_MASK = (1 << SPLIT) - 1
EPS_Q48 = 281474977  # round(1e-6 * 2**48): RMSNorm eps in Q.48 (= Q.(2 A_FRAC))
RSF_MAX = 4

# -- declared bounds (see the docstring) ---------------------------------------------------------
FWD_SLACK_Q2 = 5  # 5/4: second-order slack on the propagated forward error
BWD_REL_Q30 = 1 << 13  # 2^-17 of the array's largest float magnitude
HALF_LSB_Q10 = 512  # the final rounding of every output, in 1/1024 LSB


# == helpers =====================================================================================
def matmul(a, w, shift, bad):
    """rshift_round(A W^T, shift) by the shared GEMM (exact sum, one rounding): A [M, K],
    W [N, K]. Outputs outside its exact int64 domain are 0, counted in bad[0]."""
    c, outside = gemm_i64(a, w, shift)
    bad[0] += outside
    return c


def wsum(g, a, shift, bad):
    """round(G^T A / 2^shift): a weight gradient's exact token sum (gemm.sum_outer), G [R, P],
    A [R, Q]. Outputs outside the GEMM's exact domain counted in bad[0]."""
    c, outside = sum_outer(g, a, shift)
    bad[0] += outside
    return c


def gather(a, rows, lo_r, hi_r):
    """a[rows[lo_r:hi_r]] as a new array: one expert's slots or tokens, in order."""
    out = np.zeros((hi_r - lo_r, a.shape[1]), dtype=np.int64)
    for r in range(lo_r, hi_r):
        for j in range(a.shape[1]):
            out[r - lo_r, j] = a[int(rows[r]), j]
    return out


def expert(w, e):
    """Expert e's matrix w[e] as a new 2-D array."""
    out = np.zeros((w.shape[1], w.shape[2]), dtype=np.int64)
    for i in range(w.shape[1]):
        for j in range(w.shape[2]):
            out[i, j] = w[e, i, j]
    return out


def rms_inverse(c, t):
    """1/rho = 1/sqrt(mean(c[t]^2) + eps) as (h, e), value h 2^-e, c in Q.24 (any magnitude).

    Each c is pre-rounded by sh bits, the fewest that keep the exact sum of squares below
    2^61 (sh = 0, an exact sum, while max|c| < 2^(30 - bitlen(n)/2) raw); the mean is one long
    division and rsqrt_norm is within 2^-59.5 relative (fx): 1/rho within 2^-58.
    (Plain statements, no max/abs/conditional expressions: written with those, this helper
    alone took Pythran's C++ minutes and gigabytes of template instantiation.)
    """
    n = c.shape[1]
    top = 0
    for m in range(n):
        v0 = int(c[t, m])
        if v0 < 0:
            v0 = -v0
        if v0 > top:
            top = v0
    need = 2 * bitlen(top) + bitlen(n) - 61
    sh = 0
    if need > 0:
        sh = (need + 1) >> 1
    acc = n * rshift_round(EPS_Q48, 2 * sh)  # n eps in Q.(48 - 2 sh)
    # acc = n eps + sum_m round(c_m / 2^sh)^2
    for m in range(n):
        v = rshift_round(int(c[t, m]), sh)
        acc += v * v
    s = 61 - bitlen(acc) + bitlen(n)
    if s < 0:
        s = 0
    q = div_round_shift(acc, n, s)
    return rsqrt_norm(q, 2 * A_FRAC - 2 * sh + s)


# == forward: three exported passes (moe.kernels_train's compile time grows steeply with one kernel's
# length: Pythran's C++ types chain through every array a function writes and reads, so each
# pass is its own export, its arrays handed over by the Python face) =============================
# pythran export moe_fwd_route(int64[:,:] order(C), int64[:,:] order(C), int64[:],
#     int64[:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64, int64, int64)
def moe_fwd_route(x, w_r, bias, w_down, w1, w3, ws1, ws3, k, rsf, mx_rule):
    """Forward pass 1 on x [N, d] Q.16: the router, z and every SiTU input: (s40 [N, n],
    idx [N, k], ssel [N, k], wts [N, k], z [N, d_l], pre_g, pre_u [N, k h_e + h_s]); unit
    j h_e + i is slot j's expert unit i (Q.24), unit k h_e + i the shared expert's (Q.36);
    then the number of matmul outputs outside the shared GEMM's exact domain, 0 in the
    domain above).

    mx_rule >= 0 (quantisation-aware training, k3gates/mxfp/kernels_qat.py): z is quantised to MXFP8 (E4M3)
    along d_l by scale rule mx_rule before the experts read it, exactly (kernels_qat's fake_quant),
    and the returned z is the quantised one; -1 leaves z as it is."""
    n_tok = x.shape[0]
    n = w_r.shape[0]
    h = w1.shape[1]
    h_s = ws1.shape[0]
    m_all = k * h + h_s  # SiTU units per token
    s40 = np.zeros((n_tok, n), dtype=np.int64)
    idx = np.zeros((n_tok, k), dtype=np.int64)
    ssel = np.zeros((n_tok, k), dtype=np.int64)
    wts = np.zeros((n_tok, k), dtype=np.int64)
    s62 = np.zeros((n_tok, n), dtype=np.int64)
    pre_g = np.zeros((n_tok, m_all), dtype=np.int64)  # SiTU inputs: experts Q.24, shared Q.36
    pre_u = np.zeros((n_tok, m_all), dtype=np.int64)
    bad = np.zeros(1, dtype=np.int64)
    xc = x.copy()
    # the router's logits W_r x (exact Q.36); z = W_down x (Q.36 rounded to Q.24); the shared
    # expert's ws1 x, ws3 x (exact Q.36): the shared GEMM
    logits = matmul(xc, w_r, 0, bad)
    z = matmul(xc, w_down, XW_FRAC - A_FRAC, bad)
    if mx_rule >= 0:
        z, _sat, outside = fake_quant(z, A_FRAC, E4M3, mx_rule)
        bad[0] += outside
    sg_all = matmul(xc, ws1, 0, bad)
    su_all = matmul(xc, ws3, 0, bad)
    # pass 1: the router's scores and selection
    # omp parallel for
    for t in range(n_tok):
        for e in range(n):
            s62[t, e] = sigmoid_q62(int(logits[t, e]), int(XW_FRAC))
            s40[t, e] = rshift_round(int(s62[t, e]), int(62 - BIAS_FRAC))
        taken = np.zeros(n, dtype=np.int64)
        # k passes: the largest biased score not yet taken; strict > keeps the lower index on a tie
        for j in range(k):
            best = -1
            best_v = 0
            for e in range(n):
                v = int(s40[t, e]) + int(bias[e])
                if taken[e] == 0 and (best < 0 or v > best_v):
                    best = e
                    best_v = v
            taken[best] = 1
            idx[t, j] = best
            ssel[t, j] = s62[t, best]
        total = 0
        for j in range(k):
            total += rshift_round(int(ssel[t, j]), 62 - SW_FRAC)
        # w_j = rsf s_j / sum s: p_j in Q0.60 by one long division, then times rsf (Q.20)
        for j in range(k):
            sw = rshift_round(int(ssel[t, j]), 62 - SW_FRAC)
            p = 0
            if total > 0:
                p = div_round_shift(sw, total, int(P_FRAC))
            wts[t, j] = mul_round(p, int(rsf), int(W_FRAC))
        for i in range(h_s):
            pre_g[t, k * h + i] = sg_all[t, i]
            pre_u[t, k * h + i] = su_all[t, i]
    # g = w1 z, u = w3 z for each expert's slots: exact Q.44 sums, rounded to Q.24
    start, slots, tokens = expert_slots(idx, n)
    for e in range(n):
        lo_r = int(start[e])
        hi_r = int(start[e + 1])
        if hi_r > lo_r:
            z_e = gather(z, tokens, lo_r, hi_r)
            g_e = matmul(z_e, expert(w1, e), W_FRAC, bad)
            u_e = matmul(z_e, expert(w3, e), W_FRAC, bad)
            for r in range(lo_r, hi_r):
                sl = int(slots[r])
                t = sl // k
                j = sl - t * k
                for i in range(h):
                    pre_g[t, j * h + i] = g_e[r - lo_r, i]
                    pre_u[t, j * h + i] = u_e[r - lo_r, i]
    return s40, idx, ssel, wts, z, pre_g, pre_u, int(bad[0])


# pythran export moe_situ_fwd(int64[:,:] order(C), int64[:,:] order(C), int64, int64)
def moe_situ_fwd(pre_g, pre_u, k, h):
    """Forward pass 2: SiTU-GLU on every unit of moe_fwd_route (k h units of the experts, Q.24
    inputs, then the shared expert's, Q.36): (parts [N k, 3 h], a [N k, h], sparts [N, 3 h_s],
    a_s [N, h_s]); factors Q0.62, outputs Q.24."""
    n_tok = pre_g.shape[0]
    m_all = pre_g.shape[1]
    h_s = m_all - k * h
    beta = SITU_BETA  # (a global passed as an argument upsets Pythran's constness analysis)
    beta_lin = SITU_BETA_LIN
    parts = np.zeros((n_tok * k, 3 * h), dtype=np.int64)
    a = np.zeros((n_tok * k, h), dtype=np.int64)
    sparts = np.zeros((n_tok, 3 * h_s), dtype=np.int64)
    a_s = np.zeros((n_tok, h_s), dtype=np.int64)
    # pass 2: SiTU-GLU on every unit (one call site), factors Q0.62, outputs Q.24
    # omp parallel for
    for t in range(n_tok):
        for i in range(m_all):
            shared = i >= k * h
            frac = int(A_FRAC)
            if shared:
                frac = int(XW_FRAC)
            tg, sg, tu = situ_parts(int(pre_g[t, i]), int(pre_u[t, i]), frac, beta, beta_lin)
            av = situ_from_parts(tg, sg, tu, beta, beta_lin)
            if shared:
                q = i - k * h
                sparts[t, q] = tg
                sparts[t, h_s + q] = sg
                sparts[t, 2 * h_s + q] = tu
                a_s[t, q] = av
            else:
                j = i // h
                q = i - j * h
                sl = t * k + j
                parts[sl, q] = tg
                parts[sl, h + q] = sg
                parts[sl, 2 * h + q] = tu
                a[sl, q] = av
    return parts, a, sparts, a_s


# pythran export moe_fwd_out(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:,:] order(C), int64[:], int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C))
def moe_fwd_out(idx, wts, a, w2, w_n, w_up, ws2, a_s):
    """Forward pass 3: E, the combine, the latent RMSNorm and the output: (y [N, d] Q.16,
    E [N k, d_l], chat [N, d_l], rinv [N, 2], r [N, d_l], matmul outputs outside the shared
    GEMM's exact domain)."""
    n_tok = idx.shape[0]
    k = idx.shape[1]
    d = w_up.shape[0]
    d_l = w2.shape[1]
    h_s = ws2.shape[1]
    big_e = np.zeros((n_tok * k, d_l), dtype=np.int64)
    c = np.zeros((n_tok, d_l), dtype=np.int64)
    chat = np.zeros((n_tok, d_l), dtype=np.int64)
    rinv = np.zeros((n_tok, 2), dtype=np.int64)
    r = np.zeros((n_tok, d_l), dtype=np.int64)
    bad = np.zeros(1, dtype=np.int64)
    # E = w2 a for each expert's slots (exact Q.44, the shared GEMM); c += w_j E, one rounding
    # per slot into Q.24
    start, slots, _ = expert_slots(idx, w2.shape[0])
    for e in range(w2.shape[0]):
        lo_r = int(start[e])
        hi_r = int(start[e + 1])
        if hi_r > lo_r:
            acc_e = matmul(gather(a, slots, lo_r, hi_r), expert(w2, e), 0, bad)
            for r_ in range(lo_r, hi_r):
                sl = int(slots[r_])
                t = sl // k
                wj = int(wts[t, sl - t * k])
                for m in range(d_l):
                    acc = int(acc_e[r_ - lo_r, m])
                    big_e[sl, m] = rshift_round(acc, W_FRAC)
                    c[t, m] += mul_round(wj, acc, P_FRAC + W_FRAC)
    # the latent RMSNorm: r = w_n c / rho: chat = c / rho in Q.24, then r = w_n chat
    # omp parallel for
    for t in range(n_tok):
        rh, re = rms_inverse(c, t)
        rinv[t, 0] = rh
        rinv[t, 1] = re
        re_c = re
        if re_c > 124:
            re_c = 124
        for m in range(d_l):
            chat[t, m] = mul_round(int(c[t, m]), rh, re_c)
            r[t, m] = rshift_round(int(w_n[m]) * int(chat[t, m]), W_FRAC)
    # y = W_up r + ws2 a_s: one exact Q.44 sum (one GEMM over [r | a_s]), one rounding to Q.16
    ra = np.zeros((n_tok, d_l + h_s), dtype=np.int64)
    w_cat = np.zeros((d, d_l + h_s), dtype=np.int64)
    for t in range(n_tok):
        for m in range(d_l):
            ra[t, m] = r[t, m]
        for i in range(h_s):
            ra[t, d_l + i] = a_s[t, i]
    for o in range(d):
        for m in range(d_l):
            w_cat[o, m] = w_up[o, m]
        for i in range(h_s):
            w_cat[o, d_l + i] = ws2[o, i]
    y = matmul(ra, w_cat, A_FRAC + W_FRAC - ACT_FRAC, bad)
    return y, big_e, chat, rinv, r, int(bad[0])


# == backward ====================================================================================
def expert_slots(idx, n):
    """Each expert's slots (t k + j) in increasing order, by a counting sort: (start [n + 1],
    slots [N k], tokens [N k]); expert e owns slots[start[e]:start[e + 1]]."""
    n_tok = idx.shape[0]
    k = idx.shape[1]
    start = np.zeros(n + 1, dtype=np.int64)
    for t in range(n_tok):
        for j in range(k):
            start[int(idx[t, j]) + 1] += 1
    for e in range(n):
        start[e + 1] += start[e]
    fill = start.copy()
    slots = np.zeros(n_tok * k, dtype=np.int64)
    tokens = np.zeros(n_tok * k, dtype=np.int64)
    for t in range(n_tok):
        for j in range(k):
            e = int(idx[t, j])
            slots[fill[e]] = t * k + j
            tokens[fill[e]] = t
            fill[e] += 1
    return start, slots, tokens


def norm_backward(dr, chat, w_n, rh, re, t):
    """dc = (w_n dr - chat mean(chat . w_n dr)) / rho for token t, Q.28 (RMSNorm's backward)."""
    d_l = chat.shape[1]
    gr = np.zeros(d_l, dtype=np.int64)
    dc = np.zeros(d_l, dtype=np.int64)
    acc = 0
    for m in range(d_l):
        gr[m] = rshift_round(int(w_n[m]) * int(dr[t, m]), W_FRAC)
        acc += mul_round(int(chat[t, m]), int(gr[m]), A_FRAC)  # Q.28
    mq = div_round(acc, d_l)
    # dc_m = (gr_m - chat_m mq) / rho
    re_c = re
    if re_c > 124:
        re_c = 124
    for m in range(d_l):
        tm = int(gr[m]) - mul_round(int(chat[t, m]), mq, A_FRAC)
        dc[m] = mul_round(tm, rh, re_c)
    return dc


def router_backward(t, ssel, dwj, rsf):
    """dl [k] (Q.28): the logit gradients of token t's selected experts from dwj = dL/dw_j.
    ds_f = rsf / S (dw_f - sum_e p_e dw_e), dl_f = ds_f s_f (1 - s_f); S, p as the forward."""
    k = ssel.shape[1]
    dl = np.zeros(k, dtype=np.int64)
    total = 0
    for j in range(k):
        total += rshift_round(int(ssel[t, j]), 62 - SW_FRAC)
    sbar = 0
    for j in range(k):
        sw = rshift_round(int(ssel[t, j]), 62 - SW_FRAC)
        p = 0
        if total > 0:
            p = div_round_shift(sw, total, int(P_FRAC))
        sbar += mul_round(int(dwj[j]), p, P_FRAC)
    for j in range(k):
        tq = mul_round(int(dwj[j]) - sbar, rsf, W_FRAC)
        atq = tq
        if atq < 0:
            atq = -atq
        ds = 0
        if total > 0:
            ds = div_round_shift(atq, total, int(SW_FRAC))
        if tq < 0:
            ds = -ds
        sg = int(ssel[t, j])
        dl[j] = mul_round(ds, mul_q62(sg, ONE_Q62 - sg), 62)
    return dl


# pythran export moe_bwd_latent(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:], int64[:,:,:] order(C), int64, int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64)
def moe_bwd_latent(dy, w_up, ws2, w_n, w2, rsf, idx, ssel, wts, big_e, chat, rinv, h_s):
    """Backward pass 1 for dy [N, d] Q.24: dr, da_s, the RMSNorm's backward, dE, da and the
    router's logit gradients: (dr [N, d_l], d_e [N k, d_l], da_all [N, k h + h_s] (every SiTU
    unit's dL/da, Q.28, units as moe_fwd_route's), dlog [N k, 1]), Q.28, and the matmul
    outputs outside the shared GEMM's exact domain."""
    n_tok = dy.shape[0]
    d_l = w2.shape[1]
    h = w2.shape[2]
    k = idx.shape[1]
    m_all = k * h + h_s
    d_e = np.zeros((n_tok * k, d_l), dtype=np.int64)
    dlog = np.zeros((n_tok * k, 1), dtype=np.int64)
    da_all = np.zeros((n_tok, m_all), dtype=np.int64)  # dL/da of every SiTU unit, Q.28
    bad = np.zeros(1, dtype=np.int64)
    dyc = dy.copy()
    # dr = W_up^T dy, da_s = ws2^T dy: exact Q.44 (the shared GEMM), rounded to Q.28
    dr = matmul(dyc, transpose(w_up), A_FRAC + W_FRAC - G_FRAC, bad)
    dsa = matmul(dyc, transpose(ws2), A_FRAC + W_FRAC - G_FRAC, bad)
    # pass 1: the RMSNorm's backward, dE and the router's logit gradients
    # omp parallel for
    for t in range(n_tok):
        for i in range(h_s):
            da_all[t, k * h + i] = dsa[t, i]
        dc = norm_backward(dr, chat, w_n, int(rinv[t, 0]), int(rinv[t, 1]), t)
        dwj = np.zeros(k, dtype=np.int64)
        for j in range(k):
            sl = t * k + j
            wj = int(wts[t, j])
            acc = 0
            # dL/dw_j = dc . E_j;  dE = w_j dc
            for m in range(d_l):
                acc += mul_round(int(dc[m]), int(big_e[sl, m]), A_FRAC)
                d_e[sl, m] = mul_round(wj, int(dc[m]), P_FRAC)
            dwj[j] = acc
        # the router, through the weights
        dl = router_backward(t, ssel, dwj, rsf)
        for j in range(k):
            dlog[t * k + j, 0] = dl[j]
    # da = w2^T dE for each expert's slots (Q.48, the shared GEMM), rounded to Q.28
    start, slots, _ = expert_slots(idx, w2.shape[0])
    for e in range(w2.shape[0]):
        lo_r = int(start[e])
        hi_r = int(start[e + 1])
        if hi_r > lo_r:
            da_e = matmul(gather(d_e, slots, lo_r, hi_r), transpose(expert(w2, e)), W_FRAC, bad)
            for r_ in range(lo_r, hi_r):
                sl = int(slots[r_])
                t = sl // k
                j = sl - t * k
                for i in range(h):
                    da_all[t, j * h + i] = da_e[r_ - lo_r, i]
    return dr, d_e, da_all, dlog, int(bad[0])


# pythran export moe_situ_bwd(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64)
def moe_situ_bwd(parts, sparts, da_all, k):
    """Backward pass 2: (dg, du [N k, h], dgs, dus [N, h_s]) = da SiTU' on every unit, Q.28,
    from the forward's cached Q0.62 factors."""
    n_tok = da_all.shape[0]
    m_all = da_all.shape[1]
    h = parts.shape[1] // 3
    h_s = sparts.shape[1] // 3
    beta = SITU_BETA
    beta_lin = SITU_BETA_LIN
    dgs = np.zeros((n_tok, h_s), dtype=np.int64)
    dus = np.zeros((n_tok, h_s), dtype=np.int64)
    dg = np.zeros((n_tok * k, h), dtype=np.int64)
    du = np.zeros((n_tok * k, h), dtype=np.int64)
    # pass 2: (dg, du) = da SiTU' on every unit, from the cached Q0.62 factors
    # omp parallel for
    for t in range(n_tok):
        for i in range(m_all):
            shared = i >= k * h
            if shared:
                q = i - k * h
                tg = int(sparts[t, q])
                sg = int(sparts[t, h_s + q])
                tu = int(sparts[t, 2 * h_s + q])
            else:
                j = i // h
                q = i - j * h
                sl = t * k + j
                tg = int(parts[sl, q])
                sg = int(parts[sl, h + q])
                tu = int(parts[sl, 2 * h + q])
            vg, vu = situ_grad_from_parts(tg, sg, tu, int(da_all[t, i]), beta, beta_lin)
            if shared:
                dgs[t, i - k * h] = vg
                dus[t, i - k * h] = vu
            else:
                j = i // h
                dg[t * k + j, i - j * h] = vg
                du[t * k + j, i - j * h] = vu
    return dg, du, dgs, dus


# pythran export moe_bwd_dx(int64[:,:] order(C), int64[:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C))
def moe_bwd_dx(w_r, w_down, w1, w3, ws1, ws3, idx, dg, du, dgs, dus, dlog):
    """Backward pass 3: (dx [N, d] Q.24, dz [N, d_l] Q.28, matmul outputs outside the shared
    GEMM's exact domain): dz = w1^T dg + w3^T du and
    dx = ws1^T dgs + ws3^T dus + W_down^T dz + W_r^T dlogit."""
    n_tok = idx.shape[0]
    k = idx.shape[1]
    d = w_r.shape[1]
    d_l = w_down.shape[0]
    h = w1.shape[1]
    h_s = ws1.shape[0]
    n = w_r.shape[0]
    bad = np.zeros(1, dtype=np.int64)
    # dz = w1^T dg + w3^T du: per expert, one exact GEMM over [dg | du] against [w1^T | w3^T]
    # (Q.48); the slots' sums per token, exact, then one rounding to Q.28
    dza = np.zeros((n_tok, d_l), dtype=np.int64)
    start, slots, _ = expert_slots(idx, n)
    for e in range(n):
        lo_r = int(start[e])
        hi_r = int(start[e + 1])
        if hi_r > lo_r:
            gu = np.zeros((hi_r - lo_r, 2 * h), dtype=np.int64)
            for r_ in range(lo_r, hi_r):
                sl = int(slots[r_])
                for i in range(h):
                    gu[r_ - lo_r, i] = dg[sl, i]
                    gu[r_ - lo_r, h + i] = du[sl, i]
            w13 = np.zeros((d_l, 2 * h), dtype=np.int64)
            for m in range(d_l):
                for i in range(h):
                    w13[m, i] = w1[e, i, m]
                    w13[m, h + i] = w3[e, i, m]
            dz_e = matmul(gu, w13, 0, bad)
            for r_ in range(lo_r, hi_r):
                t = int(slots[r_]) // k
                for m in range(d_l):
                    dza[t, m] += dz_e[r_ - lo_r, m]
    # dx = ws1^T dgs + ws3^T dus + W_down^T dz + W_r^T dlogit: one exact GEMM (Q.48) over
    # [dgs | dus | dz | dlogit scattered to its experts], one rounding to Q.24
    n_c = 2 * h_s + d_l + n
    gcat = np.zeros((n_tok, n_c), dtype=np.int64)
    dz = np.zeros((n_tok, d_l), dtype=np.int64)
    for t in range(n_tok):
        for i in range(h_s):
            gcat[t, i] = dgs[t, i]
            gcat[t, h_s + i] = dus[t, i]
        for m in range(d_l):
            dz[t, m] = rshift_round(int(dza[t, m]), W_FRAC)
            gcat[t, 2 * h_s + m] = dz[t, m]
        for j in range(k):
            gcat[t, 2 * h_s + d_l + int(idx[t, j])] = dlog[t * k + j, 0]
    wcat = np.zeros((d, n_c), dtype=np.int64)
    for i in range(d):
        for q in range(h_s):
            wcat[i, q] = ws1[q, i]
            wcat[i, h_s + q] = ws3[q, i]
        for m in range(d_l):
            wcat[i, 2 * h_s + m] = w_down[m, i]
        for e in range(n):
            wcat[i, 2 * h_s + d_l + e] = w_r[e, i]
    dx = matmul(gcat, wcat, G_FRAC + W_FRAC - GRAD_FRAC, bad)
    return dx, dz, int(bad[0])


# pythran export moe_wgrad(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64)
def moe_wgrad(dy, x, idx, z, a, chat, r, a_s, dr, d_e, dg, du, dlog, dgs, dus, dz, n):
    """Backward pass 4: the weight gradients (dw_r, dw_down, dw1, dw3, dw2, dw_n, dw_up, dws1,
    dws3, dws2, and the count of GEMM outputs outside their exact domain), Q.24: each an exact
    token sum by the shared GEMM (gemm.sum_outer: two limbs, one rounding), an expert's over its
    own slots (gathered in order)."""
    n_tok = x.shape[0]
    d = x.shape[1]
    d_l = z.shape[1]
    h = a.shape[1]
    sh_x = G_FRAC + ACT_FRAC - GRAD_FRAC  # Q.28 x Q.16 -> Q.24
    sh_a = G_FRAC + A_FRAC - GRAD_FRAC  # Q.28 x Q.24 -> Q.24
    sh_y = GRAD_FRAC + A_FRAC - GRAD_FRAC  # Q.24 x Q.24 -> Q.24
    dw_n = np.zeros(d_l, dtype=np.int64)
    for m in range(d_l):
        hi = 0
        lo = 0
        # dw_n = sum_t dr chat (Q.52), split exactly: hi 2^SPLIT + lo
        for t in range(n_tok):
            prod = int(dr[t, m]) * int(chat[t, m])
            hi += prod >> SPLIT
            lo += prod & SPLIT_MASK
        dw_n[m] = round_limbs(hi, lo, SPLIT, sh_a)
    bad = np.zeros(1, dtype=np.int64)
    dw_up = wsum(dy, r, sh_y, bad)
    dws2 = wsum(dy, a_s, sh_y, bad)
    dws1 = wsum(dgs, x, sh_x, bad)
    dws3 = wsum(dus, x, sh_x, bad)
    dw_down = wsum(dz, x, sh_x, bad)
    start, slots, tokens = expert_slots(idx, n)
    dw_r = np.zeros((n, d), dtype=np.int64)
    dw1 = np.zeros((n, h, d_l), dtype=np.int64)
    dw3 = np.zeros((n, h, d_l), dtype=np.int64)
    dw2 = np.zeros((n, d_l, h), dtype=np.int64)
    for e in range(n):
        lo_r = int(start[e])
        hi_r = int(start[e + 1])
        z_e = gather(z, tokens, lo_r, hi_r)
        dw1[e] = wsum(gather(dg, slots, lo_r, hi_r), z_e, sh_a, bad)
        dw3[e] = wsum(gather(du, slots, lo_r, hi_r), z_e, sh_a, bad)
        dw2[e] = wsum(gather(d_e, slots, lo_r, hi_r), gather(a, slots, lo_r, hi_r), sh_a, bad)
        dw_r[e] = wsum(gather(dlog, slots, lo_r, hi_r), gather(x, tokens, lo_r, hi_r), sh_x, bad)[0]
    return dw_r, dw_down, dw1, dw3, dw2, dw_n, dw_up, dws1, dws3, dws2, int(bad[0])


# == Quantile Balancing ==========================================================================
# pythran export moe_qb_update(int64[:,:] order(C), int64[:], int64)
def moe_qb_update(s40, bias, k):
    """The new bias [n] Q.40 after one Quantile Balancing step on the batch's scores s40 [N, n]
    (Q.40, from moe_fwd_route): k3gates/moe/kernels.py's qb_update, exact. The bias stays in the
    router-score format Q.40 (an exception to the Q.20 vector rule)."""
    return qb_update(s40, bias, k)
