"""Gated MLA's attention backward for a few query rows over a long latent cache, in integers only
(K3-SPEC section 2; the arithmetic of k3gates.mla.kernels' backward, row by row).

k3gates.mla.kernels' backward holds P and dS as [H, T, T] for a sequence of T tokens: at a cache
of 2^16 rows that is 2^33 entries per head. Here the R query rows t = t0 .. t0 + R - 1 attend
over the cache rows s <= t, and P, dS are [H, R, T]: memory O(R T), so R = 8 rows over a 2^16-row
cache hold 1 M entries per head. Per head, in the absorbed form (the scale folded into q):
    z_ts = (W_UK^T q_C,t) . c_s + q_R,t . k_R,s,   P_t = softmax(z_t),
    dP_ts = (W_UV^T do_t) . c_s,  mu_t = sum_s P_ts dP_ts,  dS_ts = P_ts (dP_ts - mu_t),
    dq_C,t = W_UK sum_s dS_ts c_s,   dq_R,t = sum_s dS_ts k_R,s,
    dc_s = sum_h (W_UK^T sum_t dS_ts q_C,t + W_UV^T sum_t P_ts do_t),
    dk_R,s = sum_h sum_t dS_ts q_R,t.
Every quantity is formed exactly as k3gates.mla.kernels forms it (formats, the 124-bit wide sums,
one rounding per stored value, the same saturation limits), only over rows t >= t0; with t0 = 0
and R = T the results are those kernels' bit for bit, which the gate checks. Their error bounds,
`k3gates.mla.kernels.backward_bounds_q10(n, H)` for rows of at most n keys, hold here:
a key column's sum over query rows runs over R <= n rows instead of n, which `rows_bounds_q10`
counts (the row bounds are theirs unchanged).
"""

import numpy as np

from ..fx.kernels import mul_round
from ..mla.kernels import (
    BWD_C_BITS,
    BWD_DO_BITS,
    BWD_DP_BITS,
    BWD_FRAC,
    BWD_KR_BITS,
    BWD_L1_BITS,
    BWD_MU_FRAC,
    BWD_Q_BITS,
    BWD_Z_FRAC,
    DO_LIM,
    DP_LIM,
    G48_LIM,
    G_FRAC,
    G_LIM,
    MU_LIM,
    SCORE_LIMB,
    SCORE_MASK,
    Z_LIM,
    clamp,
    score_round,
    softmax_row_q62,
    wide_add,
    wide_round,
)


# pythran export mla_rows_probs(int32[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C))
def mla_rows_probs(q, t0, c_kv, k_r, w_uk):
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


# pythran export mla_rows_scores(int64[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_rows_scores(p, t0, c_kv, w_uv, do):
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


# pythran export mla_rows_dq(int64[:,:,:] order(C), int, int32[:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C))
def mla_rows_dq(ds, t0, c_kv, k_r, w_uk):
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


# pythran export mla_rows_dkv(int64[:,:,:] order(C), int64[:,:,:] order(C), int, int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C))
def mla_rows_dkv(ds, p, t0, q, do, w_uk, w_uv):
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


def rows_bounds_q10(n, rows, n_h):
    """Declared bounds (dq_R, dq_C, dc_KV, dk_R) of the row kernels against the float64 backward
    on the same integer inputs, in 2^-10 LSB of Q.24, for rows of <= n keys, `rows` query rows
    and n_h heads, within the domain BWD_*_BITS of k3gates.mla.kernels. The derivation is that
    module's `backward_bounds_q10` (its docstring, "backward"), term for term, with one change:
    a key column sums over at most `rows` query rows, not n, so the column terms (col, e_c) count
    `rows`. rows_bounds_q10(n, n, n_h) is backward_bounds_q10(n, n_h)."""
    rho = 1 << 23  # 2^-47 >= 1.001 2^-48: z in Q.48 moves each p by a factor e^(+-2^-48)
    a = (1 << 18) + n * (1 << 7)  # 2^-52 + n 2^-63: the softmax's own error, per element
    row = rho + n * a  # sum_s |p_s - P_s| for one query row
    col = rows * (rho + a)  # sum_t |p_ts - P_ts| for one key column: `rows` terms of <= rho + a
    e_dp = 1 << 21  # dp rounded to Q.48: 2^-49
    e_mu = (1 << 15) + (row << BWD_DP_BITS) + (1 << 22)  # mu in Q.54; sum |dp| |dP - dp|
    e = e_dp + e_mu
    big = 1 << (BWD_DP_BITS + 1)  # |dP - mu| <= 2 DP
    e_s = n * (1 << 21) + row * big + ((row * e) >> 70) + 1 + 2 * e  # sum_s |dS_int - dS|
    e_c = rows * (1 << 21) + col * big + ((col * e) >> 70) + 1 + rows * e  # sum_t |dS_int - dS|
    unit = 36  # a real error in 2^-70 units -> 2^-10 LSB of Q.24: x 2^24 2^10 / 2^70
    dq_r = 513 + (((e_s << BWD_KR_BITS) + (1 << unit) - 1) >> unit)
    g = (1 << 21) + (e_s << BWD_C_BITS)  # |g_int - g|: its rounding to Q.48 and sum_s |dS err| |c|
    dq_c = 513 + (((g << BWD_L1_BITS) + (1 << unit) - 1) >> unit)
    e_e = (1 << 21) + (e_c << BWD_Q_BITS)  # e = sum_t dS q_C, rounded to Q.48
    e_f = (1 << 21) + (col << BWD_DO_BITS)  # f = sum_t p do, rounded to Q.48
    dc = 513 + (((n_h * (e_e + e_f) << BWD_L1_BITS) + (1 << unit) - 1) >> unit)
    dk_r = 513 + (((n_h * e_c << BWD_Q_BITS) + (1 << unit) - 1) >> unit)
    return dq_r, dq_c, dc, dk_r
