"""Gated MLA decode over the latent cache, and the output gate held open: the induction task's
kernels (issue 15), integers only.

Both are built from mla/kernels_train's helpers (K3-SPEC.md section 2), so each value is the one
`mla_forward` computes, with the same formats (mla.kernels_train's docstring): x Q.16, weights Q.20,
c_kv, k_r, q, k_C, v, o, G Q.24, scores Q.32, P Q0.31, y Q.16.

Decode. Token n arrives alone. Its query, its latent row c_kv,n = RMSNorm(W_dkv x_n) kv_norm and
its shared key part k_r,n = W_kr x_n are formed; the keys and values of every position come from
the latent cache (k_C,s = W_uk c_kv,s, v_s = W_uv c_kv,s: the cache holds only c_kv and k_r,
kv_lora + rope numbers a token); then one causal row of attention (mla.kernels_train.attend with its
one query row at n):

    z_s = (q_C . k_C,s + q_r . k_r,s) (nope + rope)^-1/2,  s = 0 .. n;   P = softmax(z)
    o = sum_s P_s v_s;   G = o sigmoid(W_g x_n)  (or G = o with the gate held open);   y = W_o G

Every row of `mla_forward` is computed row by row with one rounding per stored value, and an
exact integer sum does not depend on how many rows share a call, so row n of the forward and
the decode step are the same integers: error 0 between them (the gate checks it bit for bit).
Against float64 the step inherits mla.kernels_train.FORWARD_MAX_ERR_LSB.

Open gate. `mla_open_gate` replaces the output gate by 1: sigma = 1 (2^62 in Q0.62), G = o,
y = W_o o, in the forward's cache layout, so `mla_backward` takes it unchanged (du = 0 exactly:
the gate's weights get no gradient).

Magnitudes: as mla.kernels_train (internal Q.24 values below 2^31 raw, counted when not).
"""

import numpy as np

from ..fx.kernels import rsqrt_q
from ..mla.kernels_train import (
    A_FRAC,
    ACT_FRAC,
    INT_FRAC,
    ONE_Q62,
    W_FRAC,
    attend,
    gate,
    norm_rows,
    out_of_domain,
    project,
    sizes,
)


# pythran export mla_decode_step(int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int, int)
def mla_decode_step(
    x_t, w_dq, q_norm, w_uq, w_dkv, kv_norm, w_kr, w_uk, w_uv, w_g, w_o, c_kv, k_r, n, open_gate
):
    """Token n of a sequence, x_t [1, d] Q.16, against the latent cache rows 0 .. n-1 of c_kv
    [>= n, kv_lora] and k_r [>= n, rope] (Q.24): (y [1, d] Q.16, its cache rows c_kv [1,
    kv_lora] and k_r [1, rope], the out-of-domain count). open_gate = 1 holds the gate at 1."""
    n_heads, nope, rope, _dv = sizes(w_uq, w_uk, w_uv, w_kr)
    kl = w_dkv.shape[0]
    scale = rsqrt_q(nope + rope, 0, 62)  # (nope + rope)^-1/2 in Q0.62
    bad = np.zeros(1, dtype=np.int64)
    # q = W_uq RMSNorm(W_dq x) q_norm;  c_kv,n = RMSNorm(W_dkv x) kv_norm;  k_r,n = W_kr x
    c_q = norm_rows(project(x_t, w_dq, 0, bad, 0), q_norm)[1]
    q = project(c_q, w_uq, W_FRAC, bad, 0)
    c_new = norm_rows(project(x_t, w_dkv, 0, bad, 0), kv_norm)[1]
    kr_new = project(x_t, w_kr, A_FRAC - INT_FRAC, bad, 0)
    # the latent cache with token n appended; every key and value up-projected from it
    lat = np.zeros((n + 1, kl), dtype=np.int64)
    kr = np.zeros((n + 1, rope), dtype=np.int64)
    for s in range(n):
        for j in range(kl):
            lat[s, j] = c_kv[s, j]
        for j in range(rope):
            kr[s, j] = k_r[s, j]
    for j in range(kl):
        lat[n, j] = c_new[0, j]
    for j in range(rope):
        kr[n, j] = kr_new[0, j]
    k_c = project(lat, w_uk, W_FRAC, bad, 0)
    v = project(lat, w_uv, W_FRAC, bad, 0)
    o = attend(q, k_c, kr, v, n_heads, scale, n)[1]  # one query row, sequence row n
    gated = o.copy()
    if open_gate == 0:
        gated = gate(project(x_t, w_g, 0, bad, 0), o)[1]
    y = project(gated, w_o, INT_FRAC + W_FRAC - ACT_FRAC, bad, 0)
    n_bad = int(bad[0]) + out_of_domain(c_q) + out_of_domain(q) + out_of_domain(c_new)
    n_bad += out_of_domain(kr_new) + out_of_domain(k_c) + out_of_domain(v)
    return y, c_new, kr_new, n_bad


# pythran export mla_open_gate(int64[:,:,:] order(C), int64[:,:] order(C))
def mla_open_gate(o, w_o):
    """The output gate held open on the forward's o [B, T, H dv] (Q.24): (y = W_o o [B, T, d]
    Q.16, sigma = 1 [B, T, H dv] Q0.62, G = o), the cache entries mla_backward reads."""
    n_b, t_len, hv = o.shape[0], o.shape[1], o.shape[2]
    d = w_o.shape[0]
    y = np.zeros((n_b, t_len, d), dtype=np.int64)
    sg = np.full((n_b, t_len, hv), ONE_Q62, dtype=np.int64)
    bad = np.zeros(n_b, dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        ob = np.zeros((t_len, hv), dtype=np.int64)
        for t in range(t_len):
            for j in range(hv):
                ob[t, j] = o[b, t, j]
        yb = project(ob, w_o, INT_FRAC + W_FRAC - ACT_FRAC, bad, b)
        for t in range(t_len):
            for j in range(d):
                y[b, t, j] = yb[t, j]
    return y, sg, o.copy(), int(np.sum(bad))
