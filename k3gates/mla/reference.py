"""Gated MLA in float64 numpy, written from K3-SPEC.md section 2 (independent of kernels.py).

DeepSeek-V2 (arXiv 2405.04434) section 2.1, with K3's NoPE and the output gate of arXiv 2505.06708:

    c_Q  = RMSNorm(W_DQ x) w_q                    [T, q_lora]
    q    = W_UQ c_Q, per head [q_C | q_R]          [T, H, nope + rope]  (times the score scale)
    c_KV = RMSNorm((W_DKV x)[:kv_lora]) w_kv       [T, kv_lora]
    k_R  = (W_DKV x)[kv_lora:]                     [T, rope]   the shared, unrotated key part
    k_C  = W_UK c_KV,  v = W_UV c_KV               per head    [T, H, nope], [T, H, d_v]
    score_ts = q_C,t . k_C,s + q_R,t . k_R,s       s <= t (causal); the scale is folded into q
    o_t  = sum_s softmax_s(score_t)_s v_s          [T, H, d_v]
    y    = W_O (o ⊙ sigma(x W_g))                  [T, D]   the gate is elementwise over H d_v

The absorbed form computes the same scores as (W_UK^T q_C) . c_KV and the same outputs as
W_UV (sum_s p_s c_s): `attention_absorbed` is that form, in float64, for comparison only.

Backward (`attention_backward`, `output_backward`), by the chain rule, with P the probabilities:
    dG = dy W_O,  do = dG ⊙ sigma(u),  du = dG ⊙ o ⊙ sigma(u)(1 - sigma(u)),  u = x W_g
    dP_ts = do_t . v_s,  dS_ts = P_ts (dP_ts - sum_s' P_ts' dP_ts')
    dq_C,t = sum_s dS_ts k_C,s,  dq_R,t = sum_s dS_ts k_R,s
    dc_s = W_UK^T (sum_t dS_ts q_C,t) + W_UV^T (sum_t P_ts do_t)  summed over heads
    dk_R,s = sum_t dS_ts q_R,t  summed over heads
"""

from __future__ import annotations

import numpy as np

from ..fx.reference import sigmoid

# Central differences check the analytic backward. They run in extended precision
# (np.longdouble: a 64-bit significand on x86-64, eps 2^-63), so cancellation cannot hide an error:
#   |FD - dL| <= h^2/6 max|d3L| + eps_ld N S / h,
# with h = 2^-20; |d3L| <= (2 max|k|)^3 max|f| < 2^13 on the gate's inputs (|k| < 8, f = the
# row's dy W_O (v ⊙ sigma), |f| < 2): 2^-40 2^13 / 6 < 1.3e-9; N S < 2^17 (N ~ 2^7 operations per
# output on |terms| summing to S < 2^10): 2^-63 2^17 2^20 < 1.6e-8. The declared tolerance 1e-7
# leaves a factor of 5 over their sum.
FD_STEP = 2.0**-20
FD_MAX_ERR = 1e-7


def rmsnorm(a: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w a / sqrt(mean(a^2) + eps) over the last axis."""
    return w * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps)


def project(x, w_dq, w_q_norm, w_uq, w_dkv, w_kv_norm, n_heads, eps, scale):
    """(q [T, H, nope + rope] times scale, c_KV [T, kv_lora], k_R [T, rope])."""
    kv_lora = w_kv_norm.shape[0]
    c_q = rmsnorm(x @ w_dq.T, w_q_norm, eps)
    q = scale * (c_q @ w_uq.T).reshape(x.shape[0], n_heads, -1)
    kv = x @ w_dkv.T
    return q, rmsnorm(kv[:, :kv_lora], w_kv_norm, eps), kv[:, kv_lora:]


def _softmax(s: np.ndarray) -> np.ndarray:
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def probabilities(q, c_kv, k_r, w_uk):
    """P [H, T, T]: causal softmax of q_C . (W_UK c_KV) + q_R . k_R (the scale is inside q)."""
    t_len, nope = q.shape[0], w_uk.shape[1]
    k_c = np.einsum("hij,sj->shi", w_uk, c_kv)  # [T, H, nope]
    s = np.einsum("thi,shi->hts", q[:, :, :nope], k_c) + np.einsum(
        "thr,sr->hts", q[:, :, nope:], k_r
    )
    s = np.where(np.tril(np.ones((t_len, t_len), dtype=bool)), s, -np.inf)
    return _softmax(s)


def attention_naive(q, c_kv, k_r, w_uk, w_uv):
    """o [T, H, d_v] with the per-head keys and values materialised (the naive path)."""
    p = probabilities(q, c_kv, k_r, w_uk)
    v = np.einsum("hij,sj->shi", w_uv, c_kv)  # [T, H, d_v]
    return np.einsum("hts,shi->thi", p, v)


def attention_absorbed(q, c_kv, k_r, w_uk, w_uv):
    """The same o through the latent: scores (W_UK^T q_C) . c_KV, outputs W_UV (sum_s p_s c_s)."""
    t_len, nope = q.shape[0], w_uk.shape[1]
    q_abs = np.einsum("hij,thi->thj", w_uk, q[:, :, :nope])  # [T, H, kv_lora]
    s = np.einsum("thj,sj->hts", q_abs, c_kv) + np.einsum("thr,sr->hts", q[:, :, nope:], k_r)
    s = np.where(np.tril(np.ones((t_len, t_len), dtype=bool)), s, -np.inf)
    lat = np.einsum("hts,sj->thj", _softmax(s), c_kv)
    return np.einsum("hij,thj->thi", w_uv, lat)


def gate_logits(x, w_g):
    return x @ w_g.T  # u = x W_g, [T, H d_v]


def output(o, x, w_g, w_o):
    """(gated = o ⊙ sigma(x W_g) [T, H d_v], y = W_O gated [T, D])."""
    gated = o.reshape(o.shape[0], -1) * sigmoid(gate_logits(x, w_g))
    return gated, gated @ w_o.T


def forward(x, w, n_heads, eps, scale):
    """The whole layer from x and the float weights dict `w` (keys as in the kernels)."""
    q, c_kv, k_r = project(
        x, w["w_dq"], w["w_q_norm"], w["w_uq"], w["w_dkv"], w["w_kv_norm"], n_heads, eps, scale
    )
    o = attention_naive(q, c_kv, k_r, w["w_uk"], w["w_uv"])
    return output(o, x, w["w_g"], w["w_o"])[1]


# == backward ====================================================================================
def output_backward(o, x, w_g, w_o, dy):
    """(do [T, H, d_v], du [T, H d_v]) for y = W_O (o ⊙ sigma(u)), u = x W_g."""
    s = sigmoid(gate_logits(x, w_g))
    d_gated = dy @ w_o
    flat = o.reshape(o.shape[0], -1)
    return (d_gated * s).reshape(o.shape), d_gated * flat * s * (1.0 - s)


def attention_backward(q, c_kv, k_r, w_uk, w_uv, do):
    """(dq [T, H, nope + rope], dc_KV [T, kv_lora], dk_R [T, rope]) for o = attention_naive:
    every row is a query row, from t0 = 0."""
    return rows_backward(q, 0, c_kv, k_r, w_uk, w_uv, do)


# -- the backward over a few query rows (the chunked backward's reference) -----------------------
# Query rows t = t0 .. t0 + R - 1 attend over cache rows s <= t; per head, with k_C,s = W_UK c_s and
# v_s = W_UV c_s (the scale folded into q), for L = sum_t do_t . o_t (the module docstring's
# equations, restricted to those rows).
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


def rows_loss(q, t0, c_kv, k_r, w_uk, w_uv, do) -> float:
    """L = sum_t do_t . o_t: what `rows_backward` differentiates (finite differences)."""
    return float(np.sum(do * rows_forward(q, t0, c_kv, k_r, w_uk, w_uv)[1]))


def loss(q, c_kv, k_r, w_uk, w_uv, u, w_o, dy):
    """L = sum(dy * y) with y = W_O (o ⊙ sigma(u)): its gradients are the backward's outputs for
    the upstream gradient dy (u = x W_g, the gate's input). Computed in the inputs' dtype."""
    o = attention_naive(q, c_kv, k_r, w_uk, w_uv)
    gated = o.reshape(o.shape[0], -1) * sigmoid(u)
    return np.sum(dy * (gated @ w_o.T))


def finite_difference(args: dict, dy, name: str, index: tuple, h: float = FD_STEP) -> float:
    """dL/d(args[name][index]) by a central difference of `loss`, in np.longdouble."""
    plus = {k: np.array(v, dtype=np.longdouble, copy=True) for k, v in args.items()}
    minus = {k: np.array(v, dtype=np.longdouble, copy=True) for k, v in args.items()}
    plus[name][index] += h
    minus[name][index] -= h
    dyl = np.asarray(dy, dtype=np.longdouble)
    return float((loss(**plus, dy=dyl) - loss(**minus, dy=dyl)) / (2 * np.longdouble(h)))
