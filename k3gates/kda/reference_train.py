"""K3-μ Kimi Delta Attention layer in float64 numpy, written from the equations (K3-SPEC.md §1).

Kimi Linear (arXiv 2510.26692) with K3's lower-bounded gate. Per sequence, causal, x [B, T, d]
already RMS-normed by the caller; N = 3 H dk channels, dv = dk:

    u     = W_qkv x                                     [T, N]  rows: q heads, k heads, v heads
    c_t   = sum_j conv[:, j] * u_{t-3+j}                [T, N]  depthwise causal, kernel 4
    a     = SiLU(c)
    q     = a_q / sqrt(|a_q|^2 + eps) dk^-1/2,  k = a_k / sqrt(|a_k|^2 + eps),  v = a_v  (per head)
    beta  = sigmoid(W_b x)                              [T, H]
    z     = a_head[h] (W_f x + dt_bias),  sg = sigmoid(z),  alpha = exp(-5 sg)   [T, H dk]
    S_t   = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T,  o_t = S_t^T q_t   (S_0 = 0)
    o_n   = RMSNorm(o) * norm_w  (per head over dv),  gated = o_n * sigmoid(W_go x)
    y     = W_o gated                                   [T, d]

Backward by the chain rule (L = sum dy . y), through time for the state. With P = Diag(alpha)
S_{t-1}, e = v - P^T k and G = dL/dS_t (including q_t do_t^T):
    dP = G - beta k (k^T G),  dv = beta G^T k,  dbeta = k^T G e,
    dk = beta G e - beta P G^T k,  dalpha_i = sum_j dP_ij S_{t-1,ij},  dS_{t-1} = Diag(alpha) dP,
    dq = S_t do.
"""

from __future__ import annotations

import numpy as np

from ..fx.reference import sigmoid

EPS = 1e-6  # the L2 and RMS norms' epsilon (K3-SPEC §1: L2 eps 1e-6; head RMSNorm eps 1e-6)
GATE_LOWER = 5.0  # K3's gate g = -5 sigma(.): alpha in (e^-5, 1)
CONV = 4  # short-convolution kernel size


def dims(p: dict) -> tuple[int, int]:
    """(H, dk) from the shapes: a_head has one entry per head, norm_w one per value channel."""
    return p["a_head"].shape[0], p["norm_w"].shape[0]


def _l2(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a / sqrt(|a|^2 + eps), 1 / sqrt(|a|^2 + eps)) over the last axis."""
    s = 1.0 / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + EPS)
    return a * s, s


def forward(x: np.ndarray, p: dict) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] and the cache for backward."""
    n_h, dk = dims(p)
    B, T, _ = x.shape
    hk = n_h * dk
    u = x @ p["w_qkv"].T  # [B, T, N]
    upad = np.concatenate([np.zeros((B, CONV - 1, u.shape[2])), u], axis=1)
    c = sum(p["conv"][:, j] * upad[:, j : j + T] for j in range(CONV))  # [B, T, N]
    sc = sigmoid(c)
    a = c * sc
    qh, sq = _l2(a[..., :hk].reshape(B, T, n_h, dk))
    kh, sk = _l2(a[..., hk : 2 * hk].reshape(B, T, n_h, dk))
    q = qh * dk**-0.5
    v = a[..., 2 * hk :].reshape(B, T, n_h, dk)
    beta = sigmoid(x @ p["w_b"].T)  # [B, T, H]
    z = (x @ p["w_f"].T + p["dt_bias"]).reshape(B, T, n_h, dk) * p["a_head"][:, None]
    sg = sigmoid(z)
    alpha = np.exp(-GATE_LOWER * sg)  # [B, T, H, dk]
    S = np.zeros((B, T + 1, n_h, dk, dk))  # S[:, t + 1] = S_t, S[:, 0] = 0
    o = np.zeros((B, T, n_h, dk))
    for t in range(T):
        P = alpha[:, t, :, :, None] * S[:, t]
        e = v[:, t] - np.einsum("bhij,bhi->bhj", P, kh[:, t])
        S[:, t + 1] = P + beta[:, t, :, None, None] * kh[:, t, :, :, None] * e[:, :, None, :]
        o[:, t] = np.einsum("bhij,bhi->bhj", S[:, t + 1], q[:, t])
    r = 1.0 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + EPS)
    oh = o * r
    on = oh * p["norm_w"]
    gs = sigmoid(x @ p["w_go"].T)  # [B, T, H dk]
    gated = on.reshape(B, T, hk) * gs
    y = gated @ p["w_o"].T
    cache = (u, c, sc, a, qh, sq, kh, sk, v, beta, sg, alpha, S, o, oh, r, gs, gated)
    return y, cache


def _recurrence_back(do, q, kh, v, beta, alpha, S):
    """Backprop through time: (dq, dk, dv, dbeta, dalpha) for do [B, T, H, dv]."""
    B, T, n_h, dk = kh.shape
    G = np.zeros((B, n_h, dk, dk))
    dq, dkk, dv, dal = (np.zeros_like(kh) for _ in range(4))
    dbeta = np.zeros((B, T, n_h))
    for t in range(T - 1, -1, -1):
        St, Sp = S[:, t + 1], S[:, t]
        dq[:, t] = np.einsum("bhij,bhj->bhi", St, do[:, t])
        G = G + q[:, t, :, :, None] * do[:, t, :, None, :]
        k, b = kh[:, t], beta[:, t, :, None]
        P = alpha[:, t, :, :, None] * Sp
        e = v[:, t] - np.einsum("bhij,bhi->bhj", P, k)
        gk = np.einsum("bhij,bhi->bhj", G, k)  # G^T k
        dbeta[:, t] = np.sum(gk * e, axis=-1)
        dv[:, t] = b * gk
        dkk[:, t] = b * (np.einsum("bhij,bhj->bhi", G, e) - np.einsum("bhij,bhj->bhi", P, gk))
        dP = G - k[..., :, None] * (b * gk)[..., None, :]
        dal[:, t] = np.sum(dP * Sp, axis=-1)
        G = alpha[:, t, :, :, None] * dP
    return dq, dkk, dv, dbeta, dal


def backward(dy: np.ndarray, x: np.ndarray, p: dict, cache: tuple) -> tuple[np.ndarray, dict]:
    """(dx, grads) for L = sum dy . y; grads of every trained parameter (a_head is fixed)."""
    u, c, sc, _a, qh, sq, kh, sk, v, beta, sg, alpha, S, _o, oh, r, gs, gated = cache
    n_h, dk = dims(p)
    B, T, _ = x.shape
    hk = n_h * dk
    g: dict[str, np.ndarray] = {}
    g["w_o"] = np.einsum("btj,btm->jm", dy, gated)
    dgated = dy @ p["w_o"]  # [B, T, H dk]
    on = (oh * p["norm_w"]).reshape(B, T, hk)
    dgz = dgated * on * gs * (1 - gs)  # gated = on sigmoid(gz)
    g["w_go"] = np.einsum("btm,bti->mi", dgz, x)
    don = (dgated * gs).reshape(B, T, n_h, dk)
    g["norm_w"] = np.einsum("bthj,bthj->j", don, oh)
    wd = don * p["norm_w"]
    do = r * (wd - oh * np.mean(oh * wd, axis=-1, keepdims=True))
    q = qh * dk**-0.5
    dq, dkk, dv, dbeta, dal = _recurrence_back(do, q, kh, v, beta, alpha, S)
    dz = dal * alpha * (-GATE_LOWER) * sg * (1 - sg)
    dfz = (dz * p["a_head"][:, None]).reshape(B, T, hk)
    g["dt_bias"] = dfz.sum(axis=(0, 1))
    g["w_f"] = np.einsum("btm,bti->mi", dfz, x)
    dbz = dbeta * beta * (1 - beta)
    g["w_b"] = np.einsum("bth,bti->hi", dbz, x)
    dqh = dq * dk**-0.5
    daq = sq * (dqh - qh * np.sum(qh * dqh, axis=-1, keepdims=True))
    dak = sk * (dkk - kh * np.sum(kh * dkk, axis=-1, keepdims=True))
    da = np.concatenate([daq.reshape(B, T, hk), dak.reshape(B, T, hk), dv.reshape(B, T, hk)], -1)
    dc = da * sc * (1 + c * (1 - sc))  # SiLU'(c)
    dcpad = np.concatenate([dc, np.zeros((B, CONV - 1, dc.shape[2]))], axis=1)
    upad = np.concatenate([np.zeros((B, CONV - 1, u.shape[2])), u], axis=1)
    g["conv"] = np.stack([np.sum(dc * upad[:, j : j + T], axis=(0, 1)) for j in range(CONV)], 1)
    # u_s feeds c_t for t = s + 3 - j: du_s = sum_j conv[:, j] dc_{s+3-j}
    du = sum(p["conv"][:, j] * dcpad[:, CONV - 1 - j : CONV - 1 - j + T] for j in range(CONV))
    g["w_qkv"] = np.einsum("btm,bti->mi", du, x)
    dx = du @ p["w_qkv"] + dbz @ p["w_b"] + dfz @ p["w_f"] + dgz @ p["w_go"]
    return dx, g
