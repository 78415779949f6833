"""K3-μ Gated MLA (NoPE) in float64 numpy, written from the equations (K3-SPEC.md section 2).

DeepSeek-V2 (arXiv 2405.04434) section 2.1 with K3's NoPE (the "rope" key part is shared and never
rotated) and the post-SDPA output gate of arXiv 2505.06708. Per sequence, causal, x [B, T, d]
already RMS-normed by the caller:

    c_q  = RMSNorm(W_dq x) * q_norm                        [T, q_lora]
    q    = W_uq c_q; head h: rows h (nope + rope) ..,       [T, H, nope + rope]
           first nope rows q_C, then rope rows q_r
    c_kv = RMSNorm(W_dkv x) * kv_norm                      [T, kv_lora]  (the latent cache)
    k_r  = W_kr x                                          [T, rope]     shared by all heads
    k_C  = W_uk c_kv,  v = W_uv c_kv                       [T, H, nope], [T, H, dv]
    S_ts = (q_C,t . k_C,s + q_r,t . k_r,s) (nope + rope)^-1/2,  s <= t
    o_t  = sum_s softmax_s(S_t) v_s                        [T, H, dv]
    y    = W_o (o * sigmoid(W_g x))                        [T, d]

Head count: H = (rows(W_uq) - rows(W_uk)) / rows(W_kr), then nope = rows(W_uk) / H and
dv = rows(W_uv) / H (every size from the shapes, as the integer kernel does).

With t0 > 0 the query side (c_q, q, the scores, o, the gate, y) runs at rows t0 .. T-1 only and
y is 0 above them; keys and values come from every row. When this layer is a model's last and
only rows >= t0 are scored, the rows above reach no loss, so the loss and every gradient are
those of the whole layer, at an attention cost (T - t0) T instead of T^2 (the passkey gate).

Backward by the chain rule (L = sum dy . y); RMSNorm y = g a r with r = (mean a^2 + eps)^-1/2,
n = a r: da = r (w - n mean(w n)) with w = g dy, dg = sum_tokens dy n.
"""

from __future__ import annotations

import numpy as np

from ..fx.reference import sigmoid

EPS = 1e-6  # the LoRA RMSNorms' epsilon (DeepSeek-V3 inference/model.py uses 1e-6)


def dims(p: dict) -> tuple[int, int, int, int]:
    """(H, nope, rope, dv) from the weight shapes."""
    rope = p["w_kr"].shape[0]
    n_heads = (p["w_uq"].shape[0] - p["w_uk"].shape[0]) // rope
    return n_heads, p["w_uk"].shape[0] // n_heads, rope, p["w_uv"].shape[0] // n_heads


def _norm(a: np.ndarray, g: np.ndarray):
    """(c, n, r) with r = (mean a^2 + eps)^-1/2 [..., 1], n = a r, c = g n."""
    r = 1.0 / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + EPS)
    n = a * r
    return g * n, n, r


def _norm_backward(dc: np.ndarray, n: np.ndarray, r: np.ndarray, g: np.ndarray):
    """(da, dg) for c = g a r."""
    w = dc * g
    da = r * (w - n * np.mean(w * n, axis=-1, keepdims=True))
    return da, np.einsum("btj,btj->j", dc, n)


def forward(x: np.ndarray, p: dict, t0: int = 0) -> tuple[np.ndarray, tuple]:
    """y [B, T, d], the queries at rows t0.. only (y is 0 above them), and the cache."""
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
