"""Float64 reference for KDA, written from the equations in K3-SPEC.md section 1.

Independent of kernels.py: plain numpy, one token at a time, exactly as the paper writes it.
"""

from __future__ import annotations

import numpy as np


def gate(g_raw: np.ndarray, a_head: np.ndarray, dt_bias: np.ndarray) -> np.ndarray:
    """K3's gate g = -5 sigma(A_h (g_raw + dt_bias_h)); A_h = exp(A_log[h]) is passed as is."""
    z = a_head[None, :, None] * (g_raw + dt_bias[None, :, :])
    return -5.0 / (1.0 + np.exp(-z))


def recurrent(q, k, v, alpha, beta, s0):
    """S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T,  o_t = S_t^T q_t.

    q is used as given (the caller has applied the scale). Shapes as in kernels.kda_recurrent;
    returns (o [T, H, d_v], S [H, d_k, d_v]).
    """
    t_len, n_h, d_k = k.shape
    S = s0.astype(np.float64).copy()
    o = np.zeros((t_len, n_h, v.shape[2]))
    eye = np.eye(d_k)
    for t in range(t_len):
        for h in range(n_h):
            kt = k[t, h][:, None]
            decayed = alpha[t, h][:, None] * S[h]
            S[h] = (eye - beta[t, h] * kt @ kt.T) @ decayed + beta[t, h] * kt @ v[t, h][None, :]
            o[t, h] = S[h].T @ q[t, h]
    return o, S


def gated_deltanet(q, k, v, alpha_scalar, beta, s0):
    """Gated DeltaNet, one decay per head: S_t = alpha_t (I - beta k k^T) S_{t-1} + beta k v^T."""
    t_len, n_h, d_k = k.shape
    S = s0.astype(np.float64).copy()
    o = np.zeros((t_len, n_h, v.shape[2]))
    eye = np.eye(d_k)
    for t in range(t_len):
        for h in range(n_h):
            kt = k[t, h][:, None]
            S[h] = alpha_scalar[t, h] * (eye - beta[t, h] * kt @ kt.T) @ S[h]
            S[h] += beta[t, h] * kt @ v[t, h][None, :]
            o[t, h] = S[h].T @ q[t, h]
    return o, S


def recurrent_vectorised(q, k, v, alpha, beta, s0):
    """`recurrent` with its loop over heads done as array operations, for many independent
    sequences at once (heads, or windows of heads: any [T, B, ...] batch). The update is the
    same equation with (I - beta k k^T) D expanded to D - beta k (k^T D):
        D = Diag(alpha_t) S_{t-1},  S_t = D + beta_t k_t (v_t - D^T k_t)^T,  o_t = S_t^T q_t.
    Returns (o [T, B, d_v], S [B, d_k, d_v])."""
    t_len = k.shape[0]
    S = s0.astype(np.float64).copy()
    o = np.zeros((t_len, S.shape[0], v.shape[2]))
    for t in range(t_len):
        D = alpha[t][:, :, None] * S
        kd = (k[t][:, None, :] @ D)[:, 0, :]  # D^T k_t, per sequence
        S = D + (beta[t][:, None] * k[t])[:, :, None] * (v[t] - kd)[:, None, :]
        o[t] = (q[t][:, None, :] @ S)[:, 0, :]
    return o, S
