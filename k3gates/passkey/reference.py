"""Gated MLA at the last query rows only, in float64 numpy: the twin of kernels.py.

The layer is K3-μ's Gated MLA (k3gates/k3mu/reference_mla.py, K3-SPEC.md section 2) with its
query side computed at rows t0 .. T-1 only; keys and values come from every row:

    c_kv = RMSNorm(W_dkv x) * kv_norm,  k_r = W_kr x,  k_C = W_uk c_kv,  v = W_uv c_kv   (all T)
    c_q  = RMSNorm(W_dq x_t) * q_norm,  q = W_uq c_q                                  (t >= t0)
    S_ts = (q_C,t . k_C,s + q_r,t . k_r,s) (nope + rope)^-1/2,  s <= t;   P = softmax_s(S)
    o_t  = sum_s P_ts v_s;   y_t = W_o (o_t * sigmoid(W_g x_t))  for t >= t0;   y_t = 0 below

When this layer is a model's last and only rows >= t0 are scored, the rows below t0 reach no
loss, so the model's loss and every gradient equal those of the full layer: the attention costs
(T - t0) T instead of T^2, which is what makes a 2^16-token context affordable here.
"""

from __future__ import annotations

import numpy as np

from ..k3mu.reference_mla import _norm, _norm_backward, dims, sigmoid


def forward(x: np.ndarray, p: dict, t0: int) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] (0 at rows < t0) and the cache for backward."""
    n_heads, nope, rope, dv = dims(p)
    b, t, d = x.shape
    r = t - t0
    scale = (nope + rope) ** -0.5
    xq = x[:, t0:]
    c_q, n_q, r_q = _norm(xq @ p["w_dq"].T, p["q_norm"])
    q = (c_q @ p["w_uq"].T).reshape(b, r, n_heads, nope + rope)
    c_kv, n_kv, r_kv = _norm(x @ p["w_dkv"].T, p["kv_norm"])
    k_r = x @ p["w_kr"].T
    k_c = (c_kv @ p["w_uk"].T).reshape(b, t, n_heads, nope)
    v = (c_kv @ p["w_uv"].T).reshape(b, t, n_heads, dv)
    # S_ts = (q_C,t . k_C,s + q_r,t . k_r,s) (nope + rope)^-1/2 for s <= t
    s = np.einsum("bthi,bshi->bhts", q[..., :nope], k_c)
    s = (s + np.einsum("bthi,bsi->bhts", q[..., nope:], k_r)) * scale
    causal = np.arange(t)[None, :] <= (t0 + np.arange(r))[:, None]  # [R, T]
    s = np.where(causal, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    prob = e / e.sum(axis=-1, keepdims=True)  # [B, H, R, T]
    o = np.einsum("bhts,bshj->bthj", prob, v).reshape(b, r, n_heads * dv)
    sg = sigmoid(xq @ p["w_g"].T)
    gated = o * sg
    y = np.zeros((b, t, d))
    y[:, t0:] = gated @ p["w_o"].T
    cache = (t0, c_q, n_q, r_q, q, c_kv, n_kv, r_kv, k_r, k_c, v, prob, o, sg, gated)
    return y, cache


def backward(dy: np.ndarray, x: np.ndarray, p: dict, cache: tuple) -> tuple[np.ndarray, dict]:
    """(dx, grads) for L = sum dy . y; dy at rows < t0 meets y = 0 there and adds nothing."""
    t0, c_q, n_q, r_q, q, c_kv, n_kv, r_kv, k_r, k_c, v, prob, o, sg, gated = cache
    n_heads, nope, rope, dv = dims(p)
    b, t, _ = x.shape
    r = t - t0
    scale = (nope + rope) ** -0.5
    xq, dyq = x[:, t0:], dy[:, t0:]
    g = {"w_o": np.einsum("bti,btj->ij", dyq, gated)}
    d_gated = dyq @ p["w_o"]
    d_o = (d_gated * sg).reshape(b, r, n_heads, dv)
    du = d_gated * o * sg * (1.0 - sg)
    g["w_g"] = np.einsum("bti,btj->ij", du, xq)
    dx = np.zeros_like(x)
    dx[:, t0:] = du @ p["w_g"]
    d_prob = np.einsum("bthj,bshj->bhts", d_o, v)
    dv_ = np.einsum("bhts,bthj->bshj", prob, d_o).reshape(b, t, -1)
    # dS = P (dP - sum_s P dP) scale
    ds = prob * (d_prob - np.sum(prob * d_prob, axis=-1, keepdims=True)) * scale
    dq = np.concatenate(
        [np.einsum("bhts,bshi->bthi", ds, k_c), np.einsum("bhts,bsi->bthi", ds, k_r)], axis=-1
    ).reshape(b, r, -1)
    dk_c = np.einsum("bhts,bthi->bshi", ds, q[..., :nope]).reshape(b, t, -1)
    dk_r = np.einsum("bhts,bthi->bsi", ds, q[..., nope:])
    g["w_uk"] = np.einsum("bti,btj->ij", dk_c, c_kv)
    g["w_uv"] = np.einsum("bti,btj->ij", dv_, c_kv)
    dc_kv = dk_c @ p["w_uk"] + dv_ @ p["w_uv"]
    g["w_kr"] = np.einsum("bti,btj->ij", dk_r, x)
    dx = dx + dk_r @ p["w_kr"]
    g["w_uq"] = np.einsum("bti,btj->ij", dq, c_q)
    dc_q = dq @ p["w_uq"]
    da_q, g["q_norm"] = _norm_backward(dc_q, n_q, r_q, p["q_norm"])
    da_kv, g["kv_norm"] = _norm_backward(dc_kv, n_kv, r_kv, p["kv_norm"])
    g["w_dq"] = np.einsum("bti,btj->ij", da_q, xq)
    g["w_dkv"] = np.einsum("bti,btj->ij", da_kv, x)
    dx[:, t0:] += da_q @ p["w_dq"]
    dx = dx + da_kv @ p["w_dkv"]
    return dx, g
