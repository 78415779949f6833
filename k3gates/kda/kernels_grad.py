"""KDA's backward at long context in integers only: the chunkwise form that keeps one state per
chunk (K3-SPEC section 1; the forward is k3gates.kda.kernels' recurrent form, bit for bit).

Per head the forward runs, from S_0 = s0 (the formats of k3gates.kda.kernels),
    P_t = Diag(alpha_t) S_{t-1},  e_t = v_t - P_t^T k_t,  w_t = beta_t e_t,
    S_t = P_t + k_t w_t^T,  o_t = S_t^T (scale q_t),
and the backward of L = sum_t do_t . o_t + <G_T, S_T> (G_T = ds_T, the gradient arriving at the
last state) runs back through time with G = dL/dS_t:
    G += q_t do_t^T,  dq_t = S_t do_t,  gk = G^T k_t,  dv_t = beta_t gk,  dbeta_t = gk . e_t,
    dk_t = G w_t - P_t (beta_t gk),  dP = G - k_t (beta_t gk)^T,
    dalpha_t,i = sum_j dP_ij S_{t-1,ij},  G <- Diag(alpha_t) dP.
Backpropagation through time needs S_{t-1} and S_t at every token. Keeping them all costs
T d_k d_v per head; here the forward keeps only the state at each chunk's start (T / C of them),
and the backward recomputes one chunk's C states from it, with the very same integer operations,
so they are the forward's states bit for bit and the gradients do not depend on C. With C = T it
*is* the per-token alternative (every state kept), which the gate runs to measure it.

Formats (int32 storage, int64 arithmetic), those of k3gates.kda.kernels and:
    do, G, and every gradient            Q.20
    e = v - round(P^T k)                  Q.20
Domain (`DOMAIN_*`, checked by the kernel where overflow would follow, by the gate from float64):
|S|, |w|, |e| <= 16 and |do| <= 16 (entries; the kernel counts any beyond in stats[1]); G
saturates at 2048 (counted). Worst cases inside it: G (2^31) k (2^24) summed over d_k <= 128
< 2^62; S (2^24) do (2^24) over d_v <= 128 < 2^55; G w, P gk, dP S and gk e: 2^31 2^24 over 128
< 2^62.

Error bounds, output LSB (2^-20), for ||k|| <= 1, ||scale q|| <= d_k^-1/2, alpha, beta in [0, 1],
no saturation (derivation in `token_bounds_q10` and `chunk_bounds_q10`):
- restarted at every token (float64 given the kernel's own S_{t-1} and the G arriving at S_t):
  a few roundings per gradient, through the L1 norms of the domain (`token_bounds_q10`);
- restarted at every chunk of C tokens (float64 given the kernel's chunk-start state and the G
  arriving at the chunk's end): the maps S -> (I - beta k k^T) Diag(alpha) S and
  G -> Diag(alpha) (I - beta k k^T) G are non-expansive in the Frobenius norm, so each token's
  roundings add and never grow: rho = sqrt(d_k d_v) + sqrt(d_v) per token forward, gamma =
  3/2 sqrt(d_k d_v) + sqrt(d_v) backward (`chunk_bounds_q10`).
"""

import numpy as np

from ..fx.kernels import isqrt, rshift_round

QK_FRAC = 24  # q (times scale) and k: Q0.24
V_FRAC = 20  # v, S, w, o, do, G and the gradients: Q.20
A_FRAC = 30  # alpha, beta: Q0.30
DATA_MAX = (1 << 31) - 1  # int32: S, w, o, G and the gradients saturate at 2048 (counted)
DOMAIN = 1 << 24  # |S|, |w|, |e|, |do| <= 16: beyond it an int64 sum could overflow (counted)
BOUND_FRAC = 10  # bounds are integers over 2^10 (a kernel holds no float)
# the domain the bounds are stated for, real units (the gate measures each from float64)
DOMAIN_DO_L2 = 4  # ||do_t||_2
DOMAIN_S_ROW_L1 = 16  # sum_j |S_t,ij| for every row i (so also every row of P_t)
DOMAIN_E_L1 = 32  # ||e_t||_1 (so also ||w_t||_1)
DOMAIN_G_ROW_L1 = 8  # sum_j |G_ij| for every row i, G = dL/dS_t with q_t do_t^T included
DOMAIN_GK_L1 = 8  # ||G^T k_t||_1


def _sqrt_up(n):
    """The least integer >= sqrt(n), n >= 1."""
    r = isqrt(n)
    return r if r * r == n else r + 1


def token_bounds_q10(d_k, d_v):
    """Declared bounds, output LSB over 2^10 (rounded up), against float64 restarted at every
    token: (dq, dk, dv, dalpha, dbeta, dS). Entry errors in LSB, with r >= sqrt(d_k):
        P_ij = round(alpha_i S_ij)               1/2
        e_j = v_j - round(sum_i k_i P_ij)        Ee = ||k||_1 / 2 + 1/2 <= (r + 1) / 2
        w_j = round(beta e_j)                    Ew = Ee + 1/2
        S_t,ij = P_ij + round(k_i w_j)           1/2 + |k_i| Ew + 1/2 <= 1 + Ew
        G_ij = G_in,ij + round(q_i do_j)         1/2
        gkr_j = round(sum_i G_ij k_i)            Ee;   de_j = round(beta gkr_j): Ew
        dP_ij = G_ij - round(k_i de_j)           1 + Ew
    dq_i = S_t,i . do: (1 + Ew) ||do||_1 + 1/2, ||do||_1 <= sqrt(d_v) ||do||_2;  dv = de: Ew;
    dbeta = gkr . e: Ee (||e||_1 + ||gk||_1) + 1/2 + 1 (the product of two errors, d_v Ee^2
    2^-20 < 1);  dk_i = G_i . w - P_i . de: ||w||_1 / 2 + Ew ||G_i||_1 + ||de||_1 / 2 +
    Ew ||P_i||_1 + 1/2 + 1;  dalpha_i = dP_i . S_{t-1,i} (S_{t-1} exact): (1 + Ew) ||S_i||_1 +
    1/2;  dS = round(alpha dP): 1 + Ew + 1/2. The norms are the DOMAIN_* constants."""
    r = _sqrt_up(d_k)
    rv = _sqrt_up(d_v)
    one = 1 << BOUND_FRAC
    half = one >> 1
    ee = (r + 1) * half  # Ee over 2^10
    ew = ee + half
    dq = (one + ew) * rv * DOMAIN_DO_L2 + half
    dv = ew
    dbeta = ee * (DOMAIN_E_L1 + DOMAIN_GK_L1) + half + one
    dk = (
        DOMAIN_E_L1 * half
        + ew * DOMAIN_G_ROW_L1
        + DOMAIN_GK_L1 * half
        + ew * DOMAIN_S_ROW_L1
        + half
        + one
    )
    dalpha = (one + ew) * DOMAIN_S_ROW_L1 + half
    ds = one + ew + half
    return dq, dk, dv, dalpha, dbeta, ds


def chunk_bounds_q10(d_k, d_v, chunk):
    """Declared bounds, output LSB over 2^10, against float64 restarted at every chunk of
    `chunk` tokens: (dq, dv, dS). With r2 >= sqrt(d_k d_v) and rv >= sqrt(d_v), the Frobenius
    error of a state grows by at most rho = r2 + rv per token forward (decay 1/2 per entry, w
    1 per entry through ||k|| <= 1, the update 1/2 per entry) and of G by gamma = 3/2 r2 + rv per
    token backward (q do^T, k de^T and alpha dP rounded, de 1 per entry):
        dq = S_t do: C rho ||do||_2 + 1/2;  dv = beta G^T k: (C - 1) gamma + r2 / 2 + 1;
        dS at the chunk's start: C gamma."""
    r2 = _sqrt_up(d_k * d_v)
    rv = _sqrt_up(d_v)
    one = 1 << BOUND_FRAC
    rho = (r2 + rv) * one
    gamma = (3 * r2 * one) // 2 + rv * one + 1
    dq = chunk * rho * DOMAIN_DO_L2 + (one >> 1)
    dv = (chunk - 1) * gamma + r2 * (one >> 1) + one
    ds = chunk * gamma
    return dq, dv, ds


# The per-head work is in helpers that receive every array they write: the arrays' types are
# then fixed by the caller, where arrays both written and read in one function made Pythran
# combine their element types with every value stored (g++ spent minutes on those types).
# (The keys are `keys` there: a helper parameter named `k` was typed as a scalar by Pythran 0.19.)
def _chunk_states(h, t0, c_len, keys, v, alpha, beta, cs, ew, u, st):
    """The forward over tokens t0 .. t0 + c_len - 1 of head h, from the state in cs[0:sz]: the
    state after each token c into cs[(c + 1) sz:], e_t and w_t into ew[c]. The forward and the
    backward's recompute both run it, so they make the same states bit for bit. Adds to st[h]
    the saturations, the values outside DOMAIN (e, w, S) and the largest |S| (the forward's
    states are counted there and again when the backward recomputes them)."""
    d_v, d_k = v.shape[2], keys.shape[2]
    sz = d_k * d_v
    sat = 0
    out = 0
    s_max = 0
    for c in range(c_len):
        t = t0 + c
        prev = c * sz
        nxt = prev + sz
        for j in range(d_v):
            u[j] = 0
        # P = Diag(alpha_t) S_{t-1};  u = P^T k_t
        for i in range(d_k):
            a = int(alpha[t, h, i])
            ki = int(keys[t, h, i])
            for j in range(d_v):
                pd = rshift_round(a * int(cs[prev + i * d_v + j]), A_FRAC)
                cs[nxt + i * d_v + j] = pd
                u[j] += ki * pd
        # e = v_t - round(u);  w = beta_t e
        b = int(beta[t, h])
        for j in range(d_v):
            e = int(v[t, h, j]) - rshift_round(int(u[j]), QK_FRAC)
            wx = rshift_round(b * e, A_FRAC)
            wy = min(max(wx, -DATA_MAX), DATA_MAX)
            if wx != wy:
                sat += 1
            if abs(e) > DOMAIN or abs(wy) > DOMAIN:
                out += 1
            ew[c, j] = e
            ew[c, d_v + j] = wy
        # S_t = P + k_t w^T
        for i in range(d_k):
            ki = int(keys[t, h, i])
            for j in range(d_v):
                sx = int(cs[nxt + i * d_v + j]) + rshift_round(ki * int(ew[c, d_v + j]), QK_FRAC)
                sy = min(max(sx, -DATA_MAX), DATA_MAX)
                if sx != sy:
                    sat += 1
                if abs(sy) > DOMAIN:
                    out += 1
                s_max = max(s_max, abs(sy))
                cs[nxt + i * d_v + j] = sy
    st[h, 0] += sat
    st[h, 1] += out
    st[h, 2] = max(int(st[h, 2]), s_max)


def _forward_head(h, chunk, qs, keys, v, alpha, beta, s0, cs, ew, u, o, s_end, s_kept, st):
    """Head h's forward, chunk by chunk, keeping the state at each chunk's start;
    o_t = S_t^T (scale q_t)."""
    t_len, d_v, d_k = v.shape[0], v.shape[2], keys.shape[2]
    sz = d_k * d_v
    sat = 0
    for m in range(sz):
        cs[m] = s0[h, m // d_v, m % d_v]
    for ci in range(s_kept.shape[0]):
        t0 = ci * chunk
        c_len = min(chunk, t_len - t0)
        for m in range(sz):
            s_kept[ci, h, m // d_v, m % d_v] = cs[m]
        _chunk_states(h, t0, c_len, keys, v, alpha, beta, cs, ew, u, st)
        for c in range(c_len):
            t = t0 + c
            nxt = (c + 1) * sz
            for j in range(d_v):
                u[j] = 0
            for i in range(d_k):
                qi = int(qs[t, h, i])
                for j in range(d_v):
                    u[j] += qi * int(cs[nxt + i * d_v + j])
            for j in range(d_v):
                ox = rshift_round(int(u[j]), QK_FRAC)
                oy = min(max(ox, -DATA_MAX), DATA_MAX)
                if ox != oy:
                    sat += 1
                o[t, h, j] = oy
        # the chunk's last state starts the next chunk
        for m in range(sz):
            cs[m] = cs[c_len * sz + m]
    for m in range(sz):
        s_end[h, m // d_v, m % d_v] = cs[m]
    st[h, 0] += sat


def _backward_head(
    h, chunk, qs, keys, v, alpha, beta, do, ds_t, cs, ew, g, gk, de, u, grads, s_kept, g_kept, st
):
    """Head h's backward, chunk by chunk from the last, each chunk's states recomputed from the
    one kept at its start. grads = (dq, dk, dalpha, dv, dbeta)."""
    dq, dkk, dal, dv, dbeta = grads
    t_len, d_v, d_k = v.shape[0], v.shape[2], keys.shape[2]
    n_c = s_kept.shape[0]
    sz = d_k * d_v
    sat = 0
    out = 0
    g_max = 0
    for m in range(sz):
        g[m] = int(ds_t[h, m // d_v, m % d_v])
    for ci in range(n_c - 1, -1, -1):
        t0 = ci * chunk
        c_len = min(chunk, t_len - t0)
        for m in range(sz):
            cs[m] = s_kept[ci, h, m // d_v, m % d_v]
        # the chunk's states again, by the forward's own code
        _chunk_states(h, t0, c_len, keys, v, alpha, beta, cs, ew, u, st)
        for c in range(c_len - 1, -1, -1):
            t = t0 + c
            prev = c * sz
            nxt = prev + sz
            b = int(beta[t, h])
            # G += q_t do_t^T;  dq_t = S_t do_t
            for j in range(d_v):
                if abs(int(do[t, h, j])) > DOMAIN:
                    out += 1
            for i in range(d_k):
                qi = int(qs[t, h, i])
                acc_q = 0
                for j in range(d_v):
                    dj = int(do[t, h, j])
                    g[i * d_v + j] += rshift_round(qi * dj, QK_FRAC)
                    acc_q += int(cs[nxt + i * d_v + j]) * dj
                qx = rshift_round(acc_q, V_FRAC)
                qy = min(max(qx, -DATA_MAX), DATA_MAX)
                if qx != qy:
                    sat += 1
                dq[t, h, i] = qy
            # gk = G^T k_t;  dv_t = de = beta_t gk;  dbeta_t = gk . e_t
            for j in range(d_v):
                gk[j] = 0
            for i in range(d_k):
                ki = int(keys[t, h, i])
                for j in range(d_v):
                    gk[j] += int(g[i * d_v + j]) * ki
            acc_b = 0
            for j in range(d_v):
                gr = rshift_round(int(gk[j]), QK_FRAC)
                gk[j] = gr
                dej = rshift_round(b * gr, A_FRAC)
                de[j] = dej
                dv[t, h, j] = min(max(dej, -DATA_MAX), DATA_MAX)
                acc_b += gr * int(ew[c, j])
            bx = rshift_round(acc_b, V_FRAC)
            by = min(max(bx, -DATA_MAX), DATA_MAX)
            if bx != by:
                sat += 1
            dbeta[t, h] = by
            # dk_t = G w_t - P_t de;  dP = G - k_t de^T;  dalpha_t,i = dP_i . S_{t-1,i};
            # G <- Diag(alpha_t) dP
            for i in range(d_k):
                a = int(alpha[t, h, i])
                ki = int(keys[t, h, i])
                acc_k = 0
                acc_a = 0
                for j in range(d_v):
                    s_prev = int(cs[prev + i * d_v + j])
                    pd = rshift_round(a * s_prev, A_FRAC)
                    gij = int(g[i * d_v + j])
                    acc_k += gij * int(ew[c, d_v + j]) - pd * int(de[j])
                    dp = gij - rshift_round(ki * int(de[j]), QK_FRAC)
                    acc_a += dp * s_prev
                    gx = rshift_round(a * dp, A_FRAC)
                    gy = min(max(gx, -DATA_MAX), DATA_MAX)
                    if gx != gy:
                        sat += 1
                    g_max = max(g_max, abs(gy))
                    g[i * d_v + j] = gy
                kx = rshift_round(acc_k, V_FRAC)
                ky = min(max(kx, -DATA_MAX), DATA_MAX)
                ax = rshift_round(acc_a, V_FRAC)
                ay = min(max(ax, -DATA_MAX), DATA_MAX)
                if kx != ky or ax != ay:
                    sat += 1
                dkk[t, h, i] = ky
                dal[t, h, i] = ay
        for m in range(sz):
            g_kept[ci, h, m // d_v, m % d_v] = g[m]
    st[h, 0] += sat
    st[h, 1] += out
    st[h, 3] = g_max


# pythran export kda_backward(int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int)
def kda_backward(qs, k, v, alpha, beta, s0, do, ds_t, chunk):
    """Forward and backward over T tokens, H heads (in parallel), one state kept per chunk.

    qs = scale q, k [T, H, d_k] Q0.24; v [T, H, d_v] Q.20; alpha [T, H, d_k] and beta [T, H]
    Q0.30; s0 [H, d_k, d_v] Q.20; do [T, H, d_v] Q.20; ds_t [H, d_k, d_v] Q.20; chunk >= 1.
    Returns, all int32 except stats:
        o [T, H, d_v], s_end [H, d_k, d_v]    the forward (== kda_recurrent's, bit for bit)
        dq, dk, dalpha [T, H, d_k], dv [T, H, d_v], dbeta [T, H]
        s_kept [n, H, d_k, d_v]               the state at each chunk's start (n = ceil(T / C))
        g_kept [n, H, d_k, d_v]               dL/dS at each chunk's start; g_kept[0] = dL/ds0
        stats int64 [4]                       saturations, values outside DOMAIN, max |S|, max |G|
    Working memory beyond inputs and outputs: C + 1 int32 states and 2 C d_v int64 per head.
    """
    t_len, n_h, d_v = v.shape[0], v.shape[1], v.shape[2]
    d_k = k.shape[2]
    n_c = (t_len + chunk - 1) // chunk
    sz = d_k * d_v
    o = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    s_end = np.zeros((n_h, d_k, d_v), dtype=np.int32)
    dq = np.zeros((t_len, n_h, d_k), dtype=np.int32)
    dkk = np.zeros((t_len, n_h, d_k), dtype=np.int32)
    dal = np.zeros((t_len, n_h, d_k), dtype=np.int32)
    dv = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    dbeta = np.zeros((t_len, n_h), dtype=np.int32)
    s_kept = np.zeros((n_c, n_h, d_k, d_v), dtype=np.int32)
    g_kept = np.zeros((n_c, n_h, d_k, d_v), dtype=np.int32)
    st = np.zeros((n_h, 4), dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        cs = np.zeros((chunk + 1) * sz, dtype=np.int32)  # S_{t0 - 1 + c} at c sz, Q.20
        ew = np.zeros((chunk, 2 * d_v), dtype=np.int64)  # e_t and w_t of the chunk, Q.20
        u = np.zeros(d_v, dtype=np.int64)
        _forward_head(h, chunk, qs, k, v, alpha, beta, s0, cs, ew, u, o, s_end, s_kept, st)
        g = np.zeros(sz, dtype=np.int64)  # G = dL/dS, Q.20
        gk = np.zeros(d_v, dtype=np.int64)
        de = np.zeros(d_v, dtype=np.int64)
        grads = (dq, dkk, dal, dv, dbeta)
        _backward_head(
            h,
            chunk,
            qs,
            k,
            v,
            alpha,
            beta,
            do,
            ds_t,
            cs,
            ew,
            g,
            gk,
            de,
            u,
            grads,
            s_kept,
            g_kept,
            st,
        )
    stats = np.zeros(4, dtype=np.int64)
    for h in range(n_h):
        stats[0] += st[h, 0]
        stats[1] += st[h, 1]
        stats[2] = max(stats[2], st[h, 2])
        stats[3] = max(stats[3], st[h, 3])
    return o, s_end, dq, dkk, dv, dal, dbeta, s_kept, g_kept, stats
