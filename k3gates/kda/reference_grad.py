"""Float64 reference for KDA's backward over the recurrence (K3-SPEC.md section 1).

Written from the equations, independent of kernels.py. The forward, for each of B independent
sequences (heads, or chunks of heads: any [T, B, ...] batch), from a given start state S_0:
    P_t = Diag(alpha_t) S_{t-1},  e_t = v_t - P_t^T k_t,  w_t = beta_t e_t,
    S_t = P_t + k_t w_t^T,  o_t = S_t^T q_t
(the delta rule S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, expanded).
The backward of L = sum_t do_t . o_t + <G_T, S_T>, where G_T is the gradient arriving at the end
state (zero for a whole sequence, the next chunk's for a chunk). With G = dL/dS_t, q_t do_t^T
included:
    dq_t = S_t do_t,  gk = G^T k_t,  dv_t = beta_t gk,  dbeta_t = gk . e_t,
    dk_t = G w_t - beta_t P_t gk,  dP = G - beta_t k_t gk^T,
    dalpha_t,i = sum_j dP_ij S_{t-1,ij},  dL/dS_{t-1} = Diag(alpha_t) dP.
"""

from __future__ import annotations

import numpy as np


def forward_states(q, k, v, alpha, beta, s0):
    """(o [T, B, d_v], S [T + 1, B, d_k, d_v] with S[0] = s0): every state of the chunk."""
    t_len = k.shape[0]
    S = np.zeros((t_len + 1, *s0.shape))
    S[0] = s0
    o = np.zeros((t_len, s0.shape[0], v.shape[2]))
    for t in range(t_len):
        P = alpha[t][:, :, None] * S[t]
        e = v[t] - np.einsum("bij,bi->bj", P, k[t])
        S[t + 1] = P + k[t][:, :, None] * (beta[t][:, None] * e)[:, None, :]
        o[t] = np.einsum("bij,bi->bj", S[t + 1], q[t])
    return o, S


def backward(q, k, v, alpha, beta, s0, do, g_end):
    """The gradients of L (module docstring): (dq, dk, dv, dalpha [T, B, d], dbeta [T, B],
    dL/dS_0 [B, d_k, d_v]), recomputing the states from s0."""
    _, S = forward_states(q, k, v, alpha, beta, s0)
    G = np.array(g_end, dtype=np.float64)
    dq, dk, dalpha = (np.zeros(k.shape) for _ in range(3))
    dv = np.zeros(v.shape)
    dbeta = np.zeros(beta.shape)
    for t in range(k.shape[0] - 1, -1, -1):
        b = beta[t][:, None]
        # o_t = S_t^T q_t:  G += q_t do_t^T,  dq_t = S_t do_t
        G = G + q[t][:, :, None] * do[t][:, None, :]
        dq[t] = np.einsum("bij,bj->bi", S[t + 1], do[t])
        P = alpha[t][:, :, None] * S[t]
        e = v[t] - np.einsum("bij,bi->bj", P, k[t])
        gk = np.einsum("bij,bi->bj", G, k[t])
        dv[t] = b * gk
        dbeta[t] = np.sum(gk * e, axis=1)
        dk[t] = np.einsum("bij,bj->bi", G, b * e) - np.einsum("bij,bj->bi", P, b * gk)
        dP = G - k[t][:, :, None] * (b * gk)[:, None, :]
        dalpha[t] = np.sum(dP * S[t], axis=2)
        G = alpha[t][:, :, None] * dP
    return dq, dk, dv, dalpha, dbeta, G


def loss(q, k, v, alpha, beta, s0, do, g_end) -> float:
    """L = sum_t do_t . o_t + <G_T, S_T>: what `backward` differentiates (finite differences)."""
    o, S = forward_states(q, k, v, alpha, beta, s0)
    return float(np.sum(do * o) + np.sum(g_end * S[-1]))
