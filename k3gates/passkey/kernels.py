"""Gated MLA with its queries at the last rows only, forward and backward, integers only: the
passkey model's last layer (issue 15, 1M context PROVEN).

The layer is K3-μ's Gated MLA (k3gates/k3mu/kernels_mla.py, K3-SPEC.md section 2), with the
same formats, helpers and roundings; only its query side runs at rows t0 .. T-1:

    c_kv = RMSNorm(W_dkv x) kv_norm,  k_r = W_kr x,  k_C = W_uk c_kv,  v = W_uv c_kv  (all T rows)
    c_q = RMSNorm(W_dq x_t) q_norm,  q = W_uq c_q,  u = W_g x_t                     (t >= t0)
    z_ts = (q_C,t . k_C,s + q_r,t . k_r,s) (nope + rope)^-1/2, s <= t;  P = softmax_s(z)
    o_t = sum_s P_ts v_s;   y_t = W_o (o_t sigmoid(u_t)) for t >= t0,  y_t = 0 for t < t0

Formats (kernels_mla's docstring): x Q.16, weights Q.20, c_q, q, c_kv, k_r, k_C, v, o, G and
the activation gradients Q.24 (|.| < 2^7, counted), z, dP, mu, dS Q.32, P Q0.31, y Q.16, dy, dx
and weight gradients Q.24.

Same integers as the full layer. Every value here is the one kernels_mla.mla_forward computes
at the same row (the same exact sums, rounded once the same way), and the backward is
mla_backward's with dy = 0 below t0 (there du, dq, dc_q, da_q and dS are exactly 0, so they add
nothing to any sum): tests/test_passkey.py holds both bit for bit at T <= 128, where
kernels_mla is proven.

Long context. kernels_mla bounds its sums for T <= 128; these sums run over up to T keys:
    o_t = sum_s P_ts v_s         exact in one int64: sum_s P_ts <= 2^31 + 2^19.1 (fx's softmax,
                                 T <= 2^20) and |v| < 2^31, so |sum| < 2^62.001
    mu_t = sum_s P_ts dP_ts      dP split at bit 24: sum_s P (dP >> 24) <= 2^31.001 2^(b - 24)
                                 for |dP| < 2^b raw (b <= 54: |dP| < 2^22), the low limb
                                 < 2^31.001 2^24 = 2^55.001
    dq_t = sum_s dS_ts k_s       dS split at bit 16 (kernels_mla.query_back): the high limb sums
                                 to <= (sum_s |dS_ts| 2^-16 + T) 2^31 < 2^57 (sum_s |dS_ts| <=
                                 2 max|dP| scale, below 2^41 raw), the low limb < T 2^16 2^31,
                                 below 2^63 only for T <= 2^15: BACKWARD_MAX_T, refused beyond
    dk_s, dv_s                   sums over the rows t >= t0 only (R <= 2^7 terms, as kernels_mla)
The weight gradients' token sums run over B T tokens (gemm.sum_outer, exact up to 2^15 tokens,
counted beyond). So the forward serves any T <= 2^20 and the backward T <= 2^15.

Error against float64 on the same integers: the forward's y within kernels_mla's
FORWARD_MAX_ERR_LSB plus what the softmax's per-term 1/2 LSB of Q0.31 costs over T keys
(T 2^-32 |v| in o, then times W_o: `forward_max_err_lsb(T)`); the backward within
kernels_mla.backward_max_err_lsb of the tokens summed, plus the same per-key term through dS.
"""

import numpy as np

from ..fx.kernels import mul_round, rshift_round, rsqrt_q, softmax_row_q31
from ..gemm.kernels import round_limbs
from ..k3mu.kernels_mla import (
    A_FRAC,
    ACT_FRAC,
    DOT_LIMB,
    DOT_MASK,
    INT_FRAC,
    P_FRAC,
    S_FRAC,
    SUM_LIMB,
    SUM_MASK,
    W_FRAC,
    gain_grad,
    gate,
    gate_back,
    norm_back,
    norm_rows,
    out_of_domain,
    project,
    project_t,
    put,
    round_sum2,
    sizes,
    take,
    weight_grad,
)

BACKWARD_MAX_T = 1 << 15  # dq's low limb: T 2^16 2^31 < 2^63 (module docstring)
FORWARD_MAX_T = 1 << 20  # fx's softmax bound on sum_s P


def forward_max_err_lsb(t_len):
    """Declared bound of y (Q.16 LSB) against float64 at T keys: kernels_mla's 1 LSB for its
    T <= 128, plus the softmax's 1/2 LSB of Q0.31 per key through o (|v| < 2^3 in the trained
    domain, |W_o| row L1 <= 2^3): T 2^-32 2^3 2^3 in real units, 2^16 of that in LSB."""
    return 1 + (t_len >> 10)


def rows_of(a, t0):
    """A copy of rows t0.. of a [B, T, n]."""
    out = np.zeros((a.shape[0], a.shape[1] - t0, a.shape[2]), dtype=np.int64)
    for b in range(a.shape[0]):
        for t in range(a.shape[1] - t0):
            for j in range(a.shape[2]):
                out[b, t, j] = a[b, t0 + t, j]
    return out


def pad_rows(a, t_len):
    """[T, n] with a [R, n] in its last R rows and 0 above."""
    out = np.zeros((t_len, a.shape[1]), dtype=np.int64)
    t0 = t_len - a.shape[0]
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[t0 + t, j] = a[t, j]
    return out


# == attention at the query rows =================================================================
def attend_rows(q, kc, kr, v, n_heads, scale, t0):
    """(P [H, R, T] Q0.31, o [R, H dv] Q.24): query row r is sequence row t0 + r and sees keys
    0 .. t0 + r. Scores as kernels_mla.attend; o = sum_s P v exact in one int64, rounded once."""
    n_rows = q.shape[0]
    t_len = kc.shape[0]
    rope = kr.shape[1]
    qw = q.shape[1] // n_heads
    nope = qw - rope
    dv = v.shape[1] // n_heads
    p = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
    o = np.zeros((n_rows, n_heads * dv), dtype=np.int64)
    z = np.zeros((1, t_len), dtype=np.int64)
    pr = np.zeros((1, t_len), dtype=np.int64)
    acc = np.zeros(dv, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            n = t0 + r + 1
            # z_s = (q_C . k_C,s + q_r . k_r,s) scale: exact in Q.48, to Q.40, then Q.32
            for s in range(n):
                hi = 0
                lo = 0
                for i in range(nope):
                    a = int(q[r, hh * qw + i])
                    c = int(kc[s, hh * nope + i])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                for i in range(rope):
                    a = int(q[r, hh * qw + nope + i])
                    c = int(kr[s, i])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                z[0, s] = mul_round(round_limbs(hi, lo, DOT_LIMB, 8), scale, 70)
            softmax_row_q31(z, 0, n, S_FRAC, pr)
            # o = sum_s P_s v_s, exact in Q.55
            for j in range(dv):
                acc[j] = 0
            for s in range(n):
                a = int(pr[0, s])
                p[hh, r, s] = a
                for j in range(dv):
                    acc[j] += a * int(v[s, hh * dv + j])
            for j in range(dv):
                o[r, hh * dv + j] = rshift_round(int(acc[j]), P_FRAC)
    return p, o


def scores_rows_back(p, v, d_o, scale, t0):
    """dS [H, R, T] in Q.32: dP = do . v (Q.32), mu = sum_s P dP (Q.32), dS = P (dP - mu) scale,
    as kernels_mla.scores_back with mu's limbs split on dP (long rows)."""
    n_heads = p.shape[0]
    n_rows = p.shape[1]
    t_len = p.shape[2]
    dv = v.shape[1] // n_heads
    ds = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
    dp = np.zeros(t_len, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            n = t0 + r + 1
            for s in range(n):
                hi = 0
                lo = 0
                for j in range(dv):
                    a = int(d_o[r, hh * dv + j])
                    c = int(v[s, hh * dv + j])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                dp[s] = round_limbs(hi, lo, DOT_LIMB, 16)  # Q.48 -> Q.32
            hi = 0
            lo = 0
            for s in range(n):
                a = int(p[hh, r, s])
                hi += a * (int(dp[s]) >> DOT_LIMB)
                lo += a * (int(dp[s]) & DOT_MASK)
            mu = round_limbs(hi, lo, DOT_LIMB, P_FRAC)  # Q.63 -> Q.32
            for s in range(n):
                d = mul_round(int(dp[s]) - mu, scale, 62)
                ds[hh, r, s] = mul_round(int(p[hh, r, s]), d, P_FRAC)
    return ds


def query_rows_back(ds, kc, kr, t0):
    """dq [R, H (nope + rope)] in Q.24: dq_t = sum_s dS_ts [k_C,s | k_r,s] (exact, Q.56)."""
    n_heads = ds.shape[0]
    n_rows = ds.shape[1]
    rope = kr.shape[1]
    nope = kc.shape[1] // n_heads
    qw = nope + rope
    dq = np.zeros((n_rows, n_heads * qw), dtype=np.int64)
    his = np.zeros(qw, dtype=np.int64)
    los = np.zeros(qw, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            for i in range(qw):
                his[i] = 0
                los[i] = 0
            for s in range(t0 + r + 1):
                a = int(ds[hh, r, s])
                ah = a >> SUM_LIMB
                al = a & SUM_MASK
                for i in range(nope):
                    c = int(kc[s, hh * nope + i])
                    his[i] += ah * c
                    los[i] += al * c
                for i in range(rope):
                    c = int(kr[s, i])
                    his[nope + i] += ah * c
                    los[nope + i] += al * c
            for i in range(qw):
                dq[r, hh * qw + i] = round_limbs(int(his[i]), int(los[i]), SUM_LIMB, S_FRAC)
    return dq


def key_rows_back(ds, q, rope, t0):
    """(dk_C [T, H nope], dk_r [T, rope]) in Q.24: dk_C,s = sum_{t >= t0, s} dS_ts q_C,t per
    head, dk_r,s the same over every head's q_r (exact, Q.56)."""
    n_heads = ds.shape[0]
    n_rows = ds.shape[1]
    t_len = ds.shape[2]
    qw = q.shape[1] // n_heads
    nope = qw - rope
    dkc = np.zeros((t_len, n_heads * nope), dtype=np.int64)
    dkr = np.zeros((t_len, rope), dtype=np.int64)
    his = np.zeros(qw, dtype=np.int64)  # [nope: this head's k_C | rope: k_r over all heads]
    los = np.zeros(qw, dtype=np.int64)
    for s in range(t_len):
        for i in range(qw):
            his[i] = 0
            los[i] = 0
        for hh in range(n_heads):
            for i in range(nope):
                his[i] = 0
                los[i] = 0
            for r in range(max(s - t0, 0), n_rows):
                a = int(ds[hh, r, s])
                ah = a >> SUM_LIMB
                al = a & SUM_MASK
                for i in range(qw):
                    c = int(q[r, hh * qw + i])
                    his[i] += ah * c
                    los[i] += al * c
            for i in range(nope):
                dkc[s, hh * nope + i] = round_limbs(int(his[i]), int(los[i]), SUM_LIMB, S_FRAC)
        for i in range(rope):
            dkr[s, i] = round_limbs(int(his[nope + i]), int(los[nope + i]), SUM_LIMB, S_FRAC)
    return dkc, dkr


def value_rows_back(p, d_o, t0):
    """dv [T, H dv] in Q.24: dv_s = sum_{t >= t0, s} P_ts do_t per head (exact, Q.55)."""
    n_heads = p.shape[0]
    n_rows = p.shape[1]
    t_len = p.shape[2]
    dv = d_o.shape[1] // n_heads
    dvv = np.zeros((t_len, n_heads * dv), dtype=np.int64)
    his = np.zeros(dv, dtype=np.int64)
    los = np.zeros(dv, dtype=np.int64)
    for hh in range(n_heads):
        for s in range(t_len):
            for j in range(dv):
                his[j] = 0
                los[j] = 0
            for r in range(max(s - t0, 0), n_rows):
                a = int(p[hh, r, s])
                ah = a >> DOT_LIMB
                al = a & DOT_MASK
                for j in range(dv):
                    c = int(d_o[r, hh * dv + j])
                    his[j] += ah * c
                    los[j] += al * c
            for j in range(dv):
                dvv[s, hh * dv + j] = round_limbs(int(his[j]), int(los[j]), DOT_LIMB, P_FRAC)
    return dvv


# == exports =====================================================================================
# pythran export mla_rows_forward(int64[:,:,:] order(C), int, int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C))
def mla_rows_forward(x, t0, w_dq, q_norm, w_uq, w_dkv, kv_norm, w_kr, w_uk, w_uv, w_g, w_o):
    """y [B, T, d] Q.16 (0 at rows < t0) and the cache (n_q, r_q, c_q, q [B, R, .], n_kv, r_kv,
    c_kv, k_r, k_c, v [B, T, .], p [B, H, R, T], o, sg, gated [B, R, .]), then the count of
    values outside the domain (a T beyond FORWARD_MAX_T counts as one)."""
    n_b, t_len, d = x.shape[0], x.shape[1], x.shape[2]
    n_rows = t_len - t0
    n_heads, nope, rope, dv = sizes(w_uq, w_uk, w_uv, w_kr)
    ql = w_dq.shape[0]
    kl = w_dkv.shape[0]
    hv = n_heads * dv
    scale = rsqrt_q(nope + rope, 0, 62)  # (nope + rope)^-1/2 in Q0.62
    xq_all = rows_of(x, t0)
    n_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    c_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    r_q_all = np.zeros((n_b, n_rows, 2), dtype=np.int64)
    q_all = np.zeros((n_b, n_rows, w_uq.shape[0]), dtype=np.int64)
    n_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    c_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    r_kv_all = np.zeros((n_b, t_len, 2), dtype=np.int64)
    k_r_all = np.zeros((n_b, t_len, rope), dtype=np.int64)
    k_c_all = np.zeros((n_b, t_len, n_heads * nope), dtype=np.int64)
    v_all = np.zeros((n_b, t_len, hv), dtype=np.int64)
    p_all = np.zeros((n_b, n_heads, n_rows, t_len), dtype=np.int64)
    o_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    sg_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    gated_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    y_all = np.zeros((n_b, t_len, d), dtype=np.int64)
    bad = np.zeros(n_b, dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        xb = take(x, b)
        xq = take(xq_all, b)
        n_q, c_q, r_q = norm_rows(project(xq, w_dq, 0, bad, b), q_norm)  # W_dq x exact in Q.36
        q = project(c_q, w_uq, W_FRAC, bad, b)  # Q.44 -> Q.24
        n_kv, c_kv, r_kv = norm_rows(project(xb, w_dkv, 0, bad, b), kv_norm)
        k_r = project(xb, w_kr, A_FRAC - INT_FRAC, bad, b)  # Q.36 -> Q.24
        k_c = project(c_kv, w_uk, W_FRAC, bad, b)
        v = project(c_kv, w_uv, W_FRAC, bad, b)
        p, o = attend_rows(q, k_c, k_r, v, n_heads, scale, t0)
        sg, gated = gate(project(xq, w_g, 0, bad, b), o)  # u = W_g x exact in Q.36
        # y = W_o G at the query rows, Q.44 -> Q.16; 0 above them
        put(y_all, b, pad_rows(project(gated, w_o, INT_FRAC + W_FRAC - ACT_FRAC, bad, b), t_len))
        put(n_q_all, b, n_q)
        put(c_q_all, b, c_q)
        put(r_q_all, b, r_q)
        put(q_all, b, q)
        put(n_kv_all, b, n_kv)
        put(c_kv_all, b, c_kv)
        put(r_kv_all, b, r_kv)
        put(k_r_all, b, k_r)
        put(k_c_all, b, k_c)
        put(v_all, b, v)
        for hh in range(n_heads):
            for r in range(n_rows):
                for s in range(t_len):
                    p_all[b, hh, r, s] = p[hh, r, s]
        put(o_all, b, o)
        put(sg_all, b, sg)
        put(gated_all, b, gated)
        bad[b] += (
            out_of_domain(c_q)
            + out_of_domain(q)
            + out_of_domain(c_kv)
            + out_of_domain(k_r)
            + out_of_domain(k_c)
            + out_of_domain(v)
        )
    n_bad = int(np.sum(bad)) + (1 if t_len > FORWARD_MAX_T else 0)
    return (
        y_all,
        n_q_all,
        r_q_all,
        c_q_all,
        q_all,
        n_kv_all,
        r_kv_all,
        c_kv_all,
        k_r_all,
        k_c_all,
        v_all,
        p_all,
        o_all,
        sg_all,
        gated_all,
        n_bad,
    )


# pythran export mla_rows_backward(int64[:,:,:] order(C), int64[:,:,:] order(C), int, int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C))
def mla_rows_backward(
    dy,
    x,
    t0,
    w_dq,
    q_norm,
    w_uq,
    w_dkv,
    kv_norm,
    w_kr,
    w_uk,
    w_uv,
    w_g,
    w_o,
    n_q_all,
    r_q_all,
    c_q_all,
    q_all,
    n_kv_all,
    r_kv_all,
    c_kv_all,
    k_r_all,
    k_c_all,
    v_all,
    p_all,
    o_all,
    sg_all,
    gated_all,
):
    """dx [B, T, d] Q.24, the gradients of w_dq, q_norm, w_uq, w_dkv, kv_norm, w_kr, w_uk, w_uv,
    w_g, w_o (Q.24, summed over all tokens), then the out-of-domain count (a T beyond
    BACKWARD_MAX_T counts as one), for L = sum dy . y; dy at rows < t0 meets y = 0 there and
    adds nothing."""
    n_b, t_len, d = x.shape[0], x.shape[1], x.shape[2]
    n_rows = t_len - t0
    n_heads, nope, rope, dv = sizes(w_uq, w_uk, w_uv, w_kr)
    ql = w_dq.shape[0]
    kl = w_dkv.shape[0]
    hv = n_heads * dv
    scale = rsqrt_q(nope + rope, 0, 62)
    dyq_all = rows_of(dy, t0)
    xq_all = rows_of(x, t0)
    du_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    dq_all = np.zeros((n_b, n_rows, w_uq.shape[0]), dtype=np.int64)
    dkc_all = np.zeros((n_b, t_len, n_heads * nope), dtype=np.int64)
    dv_all = np.zeros((n_b, t_len, hv), dtype=np.int64)
    dkr_all = np.zeros((n_b, t_len, rope), dtype=np.int64)
    dc_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    da_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    dc_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    da_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    dx_all = np.zeros((n_b, t_len, d), dtype=np.int64)
    bad = np.zeros(n_b, dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        p = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
        for hh in range(n_heads):
            for r in range(n_rows):
                for s in range(t_len):
                    p[hh, r, s] = p_all[b, hh, r, s]
        zero = np.zeros((n_rows, hv), dtype=np.int64)
        dg = round_sum2(project_t(take(dyq_all, b), w_o, bad, b), zero, W_FRAC)  # dG = W_o^T dy
        d_o, du = gate_back(dg, take(sg_all, b), take(o_all, b))
        ds = scores_rows_back(p, take(v_all, b), d_o, scale, t0)
        dq = query_rows_back(ds, take(k_c_all, b), take(k_r_all, b), t0)
        dkc, dkr = key_rows_back(ds, take(q_all, b), rope, t0)
        dvv = value_rows_back(p, d_o, t0)
        dc_kv = round_sum2(project_t(dkc, w_uk, bad, b), project_t(dvv, w_uv, bad, b), W_FRAC)
        zq = np.zeros((n_rows, ql), dtype=np.int64)
        dc_q = round_sum2(project_t(dq, w_uq, bad, b), zq, W_FRAC)
        da_q = norm_back(dc_q, q_norm, take(n_q_all, b), take(r_q_all, b))
        da_kv = norm_back(dc_kv, kv_norm, take(n_kv_all, b), take(r_kv_all, b))
        # dx = W_g^T du + W_kr^T dk_r + W_dq^T da_q + W_dkv^T da_kv, exact in Q.44, one rounding
        # (du and da_q are 0 above the query rows)
        acc = round_sum2(project_t(pad_rows(du, t_len), w_g, bad, b),
                         project_t(dkr, w_kr, bad, b), 0)  # fmt: skip
        acc = round_sum2(acc, project_t(pad_rows(da_q, t_len), w_dq, bad, b), 0)
        put(dx_all, b, round_sum2(acc, project_t(da_kv, w_dkv, bad, b), W_FRAC))
        put(du_all, b, du)
        put(dq_all, b, dq)
        put(dkc_all, b, dkc)
        put(dv_all, b, dvv)
        put(dkr_all, b, dkr)
        put(dc_q_all, b, dc_q)
        put(da_q_all, b, da_q)
        put(dc_kv_all, b, dc_kv)
        put(da_kv_all, b, da_kv)
        bad[b] += (
            out_of_domain(dg)
            + out_of_domain(du)
            + out_of_domain(dq)
            + out_of_domain(dkc)
            + out_of_domain(dvv)
            + out_of_domain(dkr)
            + out_of_domain(dc_q)
            + out_of_domain(dc_kv)
            + out_of_domain(da_q)
            + out_of_domain(da_kv)
        )
    xs = A_FRAC - W_FRAC  # a Q.24 gradient times Q.16 x = Q.40 -> Q.24: 16
    wbad = np.zeros(1, dtype=np.int64)
    g_dq = weight_grad(da_q_all, xq_all, xs, wbad)
    g_qn = gain_grad(dc_q_all, n_q_all)
    g_uq = weight_grad(dq_all, c_q_all, INT_FRAC, wbad)
    g_dkv = weight_grad(da_kv_all, x, xs, wbad)
    g_kvn = gain_grad(dc_kv_all, n_kv_all)
    g_kr = weight_grad(dkr_all, x, xs, wbad)
    g_uk = weight_grad(dkc_all, c_kv_all, INT_FRAC, wbad)
    g_uv = weight_grad(dv_all, c_kv_all, INT_FRAC, wbad)
    g_g = weight_grad(du_all, xq_all, xs, wbad)
    g_o = weight_grad(dyq_all, gated_all, INT_FRAC, wbad)
    n_bad = int(np.sum(bad)) + int(wbad[0]) + (1 if t_len > BACKWARD_MAX_T else 0)
    return dx_all, g_dq, g_qn, g_uq, g_dkv, g_kvn, g_kr, g_uk, g_uv, g_g, g_o, n_bad
