"""Float64 reference for Gated MLA's attention backward over a few query rows (K3-SPEC section 2).

Written from the equations, independent of kernels.py. Query rows t = t0 .. t0 + R - 1 attend
over cache rows s <= t; per head, with k_C,s = W_UK c_s and v_s = W_UV c_s (the scale folded
into q):
    P_t = softmax_s(q_C,t . k_C,s + q_R,t . k_R,s),  o_t = sum_s P_ts v_s;
for L = sum_t do_t . o_t:
    dP_ts = do_t . v_s,  dS_ts = P_ts (dP_ts - sum_u P_tu dP_tu),
    dq_C,t = sum_s dS_ts k_C,s,  dq_R,t = sum_s dS_ts k_R,s,
    dc_s = sum_h (W_UK^T sum_t dS_ts q_C,t + W_UV^T sum_t P_ts do_t),
    dk_R,s = sum_h sum_t dS_ts q_R,t.
"""

from __future__ import annotations

import numpy as np


def rows_forward(q, t0, c_kv, k_r, w_uk, w_uv):
    """(P [H, R, T] with zeros where s > t, o [R, H, d_v])."""
    n_r, t_len = q.shape[0], c_kv.shape[0]
    nope = w_uk.shape[1]
    k_c = np.einsum("hij,sj->hsi", w_uk, c_kv)
    z = np.einsum("rhi,hsi->hrs", q[:, :, :nope], k_c) + np.einsum(
        "rhi,si->hrs", q[:, :, nope:], k_r
    )
    causal = np.arange(t_len)[None, :] <= (t0 + np.arange(n_r))[:, None]
    z = np.where(causal[None], z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    v = np.einsum("hij,sj->hsi", w_uv, c_kv)
    return p, np.einsum("hrs,hsi->rhi", p, v)


def rows_backward(q, t0, c_kv, k_r, w_uk, w_uv, do):
    """(dq [R, H, nope + rope], dc_KV [T, kv_lora], dk_R [T, rope]) of L = sum do . o."""
    nope = w_uk.shape[1]
    p, _ = rows_forward(q, t0, c_kv, k_r, w_uk, w_uv)
    k_c = np.einsum("hij,sj->hsi", w_uk, c_kv)
    v = np.einsum("hij,sj->hsi", w_uv, c_kv)
    dp = np.einsum("rhi,hsi->hrs", do, v)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = np.concatenate(
        [np.einsum("hrs,hsi->rhi", ds, k_c), np.einsum("hrs,si->rhi", ds, k_r)], axis=-1
    )
    e = np.einsum("hrs,rhi->hsi", ds, q[:, :, :nope])  # sum_t dS_ts q_C,t
    f = np.einsum("hrs,rhi->hsi", p, do)  # sum_t P_ts do_t
    dc = np.einsum("hsi,hij->sj", e, w_uk) + np.einsum("hsi,hij->sj", f, w_uv)
    dk_r = np.einsum("hrs,rhi->si", ds, q[:, :, nope:])
    return dq, dc, dk_r


def loss(q, t0, c_kv, k_r, w_uk, w_uv, do) -> float:
    """L = sum_t do_t . o_t: what `rows_backward` differentiates (finite differences)."""
    return float(np.sum(do * rows_forward(q, t0, c_kv, k_r, w_uk, w_uv)[1]))
