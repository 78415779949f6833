"""The vision backward in float64: the independent reference the vision gradient gate holds the
integer kernels to. Written from the math with numpy only, never from a kernel; the forward
pieces (rmsnorm, gelu, rope2d, merge, scores, softmax) are reference.py's own.

One MoonViT3d block (block.py's stage order and names; weights [out, in], y = x W^T):

    h1 = RMSNorm(x) g1;  q, k, v = h1 W_q^T, h1 W_k^T, h1 W_v^T
    q_rope, k_rope = RoPE2d(q), RoPE2d(k)           per head slice, the token's (column, row)
    o = softmax(q_rope k_rope^T / sqrt(dh)) v        per segment [cu[s], cu[s+1]) and head
    x1 = x + o W_o^T;  h2 = RMSNorm(x1) g2;  u = h2 W_1^T;  a = GELU(u);  x2 = x1 + a W_2^T

then the merger (chunk means, 2 x 2 concat) and the projector
p1 = merged P_1^T, p2 = GELU(p1) P_2^T, out = RMSNorm(p2) g_p. For a loss L, every backward
here takes dL/d(output) and returns dL/d(input) and dL/d(weight), dW shaped like W.
"""

from __future__ import annotations

import itertools

import numpy as np

from . import reference as ref
from .block import EPS

GELU_C = np.sqrt(2.0 / np.pi)
GELU_A = 0.044715


# == pointwise and row-wise pieces ==============================================================
def gelu_grad(u: np.ndarray) -> np.ndarray:
    """d GELU / du = (1 + t) / 2 + u (1 - t^2) c (1 + 3 a u^2) / 2, t = tanh(c (u + a u^3))."""
    t = np.tanh(GELU_C * (u + GELU_A * u**3))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * u * u)


def rmsnorm_backward(
    dy: np.ndarray, x: np.ndarray, g: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """y = g n, n = x r, r = (mean(x^2) + eps)^(-1/2) per row:
    dx = r (dn - n mean(dn n)) with dn = dy g;  dg = sum over rows of dy n."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    n = x * r
    dn = dy * g
    dx = r * (dn - n * np.mean(dn * n, axis=-1, keepdims=True))
    dg = (dy * n).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dg


def rope2d_backward(dy: np.ndarray, pos_x: np.ndarray, pos_y: np.ndarray) -> np.ndarray:
    """[N, head]: RoPE turns each pair by an angle, an orthogonal map R, so its adjoint is
    R^T = R^-1: the same pairs turned back, dx = rope2d(dy, -pos_x, -pos_y)."""
    return ref.rope2d(dy, -np.asarray(pos_x, np.float64), -np.asarray(pos_y, np.float64))


def _rope_heads(
    x: np.ndarray, pos_x: np.ndarray, pos_y: np.ndarray, heads: int, turn
) -> np.ndarray:
    """Apply `turn` (rope2d or its adjoint) to every head slice [N, dh] of x [N, heads dh]."""
    dh = x.shape[1] // heads
    return np.concatenate(
        [turn(x[:, h * dh : (h + 1) * dh], pos_x, pos_y) for h in range(heads)], axis=1
    )


# == attention ==================================================================================
def attention_probs(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """P [n, n], row i = softmax_j(q_i . k_j / sqrt(dh)) (bidirectional, one segment and head)."""
    dh = q.shape[1]
    return np.stack([ref.softmax(ref.scores(qi, k, dh)) for qi in q])


def attention_backward_from_p(
    P: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, dO: np.ndarray, scale: float
) -> dict[str, np.ndarray]:
    """O = P v with P = softmax(scale q k^T) row-wise (P taken as given):
    dP = dO v^T, D = rowsum(P * dP), dS = scale P (dP - D) (wrt the unscaled q . k),
    dq = dS k, dk = dS^T q, dv = P^T dO."""
    dP = dO @ v.T
    D = np.sum(P * dP, axis=1)
    dS = scale * P * (dP - D[:, None])
    return {"dP": dP, "D": D, "dS": dS, "dq": dS @ k, "dk": dS.T @ q, "dv": P.T @ dO}


# == the merger ================================================================================
def merge_backward(dm: np.ndarray, frames: int, chunk: int, gh: int, gw: int, d: int) -> np.ndarray:
    """Adjoint of reference.merge: each chunk's rows [ph pw, 4d] back to its padded grid
    [2ph, 2pw, d], the padding dropped, and dm / nf to each of the chunk's nf frames."""
    ph, pw = (gh + gh % 2) // 2, (gw + gw % 2) // 2
    dx = np.zeros((frames, gh, gw, d))
    for c, f0 in enumerate(range(0, frames, chunk)):
        rows = dm[c * ph * pw : (c + 1) * ph * pw]
        grid = rows.reshape(ph, pw, 2, 2, d).transpose(0, 2, 1, 3, 4).reshape(2 * ph, 2 * pw, d)
        nf = min(chunk, frames - f0)
        dx[f0 : f0 + nf] = grid[:gh, :gw] / nf
    return dx.reshape(frames * gh * gw, d)


# == one block =================================================================================
def block_forward(
    x: np.ndarray,
    pos_x: np.ndarray,
    pos_y: np.ndarray,
    cu: np.ndarray,
    w: dict[str, np.ndarray],
    heads: int,
) -> dict[str, np.ndarray]:
    """Every stage of the block in float64 on packed tokens x [N, D], segments cu (block.forward's
    names): x1 = x + Attn(RMSNorm(x) g1) W_o^T, x2 = x1 + GELU(RMSNorm(x1) g2 W_1^T) W_2^T."""
    s: dict[str, np.ndarray] = {"x": x}
    s["h1"] = ref.rmsnorm(x, w["g1"], EPS)
    for name in "qkv":
        s[name] = s["h1"] @ w[f"w{name}"].T
    s["q_rope"] = _rope_heads(s["q"], pos_x, pos_y, heads, ref.rope2d)
    s["k_rope"] = _rope_heads(s["k"], pos_x, pos_y, heads, ref.rope2d)
    dh = s["q"].shape[1] // heads
    o = np.zeros_like(s["v"])
    for a, b in itertools.pairwise(cu):
        for h in range(heads):
            c = slice(h * dh, (h + 1) * dh)
            P = attention_probs(s["q_rope"][a:b, c], s["k_rope"][a:b, c])
            o[a:b, c] = P @ s["v"][a:b, c]
    s["o"] = o
    s["attn_out"] = o @ w["wo"].T
    s["x1"] = x + s["attn_out"]
    s["h2"] = ref.rmsnorm(s["x1"], w["g2"], EPS)
    s["u"] = s["h2"] @ w["w1"].T
    s["a"] = ref.gelu(s["u"])
    s["mlp_out"] = s["a"] @ w["w2"].T
    s["x2"] = s["x1"] + s["mlp_out"]
    return s


def block_backward(
    fwd: dict[str, np.ndarray],
    dx2: np.ndarray,
    pos_x: np.ndarray,
    pos_y: np.ndarray,
    cu: np.ndarray,
    w: dict[str, np.ndarray],
    heads: int,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dL/dx, dL/dW for g1 wq wk wv wo g2 w1 w2) given dL/dx2, the stages in reverse order;
    for y = x W^T: dx = dy W and dW = dy^T x."""
    grads: dict[str, np.ndarray] = {}
    # MLP: x2 = x1 + GELU(RMSNorm(x1) g2 W_1^T) W_2^T
    grads["w2"] = dx2.T @ fwd["a"]
    du = (dx2 @ w["w2"]) * gelu_grad(fwd["u"])
    grads["w1"] = du.T @ fwd["h2"]
    dx1, grads["g2"] = rmsnorm_backward(du @ w["w1"], fwd["x1"], w["g2"], EPS)
    dx1 = dx1 + dx2  # the residual
    # attention: x1 = x + o W_o^T
    grads["wo"] = dx1.T @ fwd["o"]
    do = dx1 @ w["wo"]
    dh = do.shape[1] // heads
    dq_rope, dk_rope, dv = np.zeros_like(do), np.zeros_like(do), np.zeros_like(do)
    for a, b in itertools.pairwise(cu):
        for h in range(heads):
            c = slice(h * dh, (h + 1) * dh)
            q, k = fwd["q_rope"][a:b, c], fwd["k_rope"][a:b, c]
            P = attention_probs(q, k)
            g = attention_backward_from_p(P, q, k, fwd["v"][a:b, c], do[a:b, c], dh**-0.5)
            dq_rope[a:b, c], dk_rope[a:b, c], dv[a:b, c] = g["dq"], g["dk"], g["dv"]
    dq = _rope_heads(dq_rope, pos_x, pos_y, heads, rope2d_backward)
    dk = _rope_heads(dk_rope, pos_x, pos_y, heads, rope2d_backward)
    dh1 = np.zeros_like(fwd["h1"])
    for name, d in (("q", dq), ("k", dk), ("v", dv)):
        grads[f"w{name}"] = d.T @ fwd["h1"]
        dh1 += d @ w[f"w{name}"]
    dx, grads["g1"] = rmsnorm_backward(dh1, fwd["x"], w["g1"], EPS)
    return dx + dx1, grads


# == the projector =============================================================================
def projector_forward(merged: np.ndarray, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """p1 = merged P_1^T, p1_gelu = GELU(p1), p2 = p1_gelu P_2^T, out = RMSNorm(p2) g_p."""
    s = {"merged": merged, "p1": merged @ w["p1"].T}
    s["p1_gelu"] = ref.gelu(s["p1"])
    s["p2"] = s["p1_gelu"] @ w["p2"].T
    s["out"] = ref.rmsnorm(s["p2"], w["gp"], EPS)
    return s


def projector_backward(
    fwd: dict[str, np.ndarray], dout: np.ndarray, w: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dL/dmerged, dL/dW for p1 p2 gp) given dL/dout, the projector's stages in reverse."""
    grads: dict[str, np.ndarray] = {}
    dp2, grads["gp"] = rmsnorm_backward(dout, fwd["p2"], w["gp"], EPS)
    grads["p2"] = dp2.T @ fwd["p1_gelu"]
    dp1 = (dp2 @ w["p2"]) * gelu_grad(fwd["p1"])
    grads["p1"] = dp1.T @ fwd["merged"]
    return dp1 @ w["p1"], grads
