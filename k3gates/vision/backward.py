"""The backward pass of one MoonViT3d block and of the projector, stage by stage in integers:
Python orders the kernels' calls (k3gates.vision.kernels_grad, gemm, K3-μ's RMSNorm backward,
longctx's rope_rotate) and keeps every stage's gradient, so the gate can hold each against
float64 on the integers it received. Gradients are Q.24, K3-μ's format:

    x2 = x1 + a W_2^T, a = GELU(u), u = h2 W_1^T:   da = dx2 W_2, dW_2 = dx2^T a, du = da GELU'(u),
                                                    dh2 = du W_1, dW_1 = du^T h2
    h2 = RMSNorm(x1) g2:                           dx1 = dx2 + RMSNorm'(dh2), dg2
    x1 = x + o W_o^T:                              do = dx1 W_o, dW_o = dx1^T o
    o = attention(q~, k~, v):                      dq~, dk~, dv (kernels.attention_backward)
    q~ = RoPE(q), k~ = RoPE(k):                    dq, dk = the rotation turned back
    q, k, v = h1 W^T:                              dh1 = dq W_q + dk W_k + dv W_v, dW = d^T h1
    h1 = RMSNorm(x) g1:                            dx = dx1 + RMSNorm'(dh1), dg1
"""

from __future__ import annotations

import numpy as np

from .block import ACT_FRAC, EPS_Q32, HEADS, ROPE_X_MAX, W_FRAC, Kernels, attention_inputs
from .tables import rope_turns

G_FRAC = 24  # gradients: Q.24 (K3-μ's)


class GradKernels(Kernels):
    """The forward's kernels, plus the backward's: vision.kernels_grad, K3-μ's RMSNorm backward and
    the shared GEMM's weight-gradient sum."""

    def __init__(self, load) -> None:
        super().__init__(load)
        self.grad = load("k3gates.vision.kernels_grad")
        self.glue = load("k3gates.k3mu.kernels_glue")

    def linear_back(self, dy: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """y = x W^T: (dx = dy W, dW = dy^T x), both Q.24, each one rounding of an exact sum."""
        dx, out_a = self.gemm.gemm_i64(dy, np.ascontiguousarray(w.T), W_FRAC)
        dw, out_b = self.gemm.sum_outer(dy, x, ACT_FRAC)
        if out_a or out_b:
            raise OverflowError(f"{out_a + out_b} products outside gemm_i64's exact domain")
        return dx, dw

    def norm_back(self, dy: np.ndarray, x: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, ...]:
        """y = RMSNorm(x) g: (dx, dg), Q.24 (K3-μ's rmsnorm_backward; rstd depends on x only)."""
        _y, rstd = self.glue.rmsnorm_forward(x, g, EPS_Q32)
        return self.glue.rmsnorm_backward(dy, x, g, rstd)

    def rope_back(self, dy: np.ndarray, pos_x: np.ndarray, pos_y: np.ndarray,
                  heads: int) -> np.ndarray:  # fmt: skip
        """The adjoint of `rope` (a rotation): turned back by -theta. R(-theta)(a, b) is
        R(theta)(a, -b) with its second component negated, and rope_rotate's rounding is odd,
        so negating the second member of every pair before and after is exact."""
        n, width = dy.shape
        dh = width // heads
        flip = np.ones(dh, dtype=np.int64)
        flip[dh // 4 : dh // 2] = -1  # the x half's pairs are (i, i + dh/4)
        flip[3 * dh // 4 :] = -1  # the y half's
        rows = dy.reshape(n * heads, dh) * flip
        top = int(np.abs(rows).max(initial=0))
        if top > ROPE_X_MAX:
            raise OverflowError(f"RoPE gradient |raw| {top} > 2^30, outside rope_rotate's domain")
        if dh not in self._freq:  # the forward fills it, but a backward may run without one
            self._freq[dh] = rope_turns(dh)
        turned, sat = self.vision.rope2d(
            rows.astype(np.int32), np.repeat(pos_x, heads), np.repeat(pos_y, heads),
            self._freq[dh],
        )  # fmt: skip
        if sat:
            raise OverflowError(f"2D RoPE backward saturated {sat} values")
        return (turned.astype(np.int64) * flip).reshape(n, width)


Arrays = dict[str, np.ndarray]


def backward(k: GradKernels, s: Arrays, w: Arrays, dx2: np.ndarray,
             pos: tuple[np.ndarray, np.ndarray], cu: np.ndarray,
             heads: int = HEADS) -> tuple[Arrays, Arrays]:  # fmt: skip
    """The block's backward from its stages `s` (forward) and dx2 = dL/dx2 (Q.24): (the gradient
    of every stage's output, the gradient of every weight), all Q.24."""
    d: Arrays = {"x2": dx2}
    dw: Arrays = {}
    # x2 = x1 + GELU(h2 W_1^T) W_2^T
    d["a"], dw["w2"] = k.linear_back(dx2, s["a"], w["w2"])
    d["u"] = k.grad.gelu_backward(s["u"], d["a"])
    d["h2"], dw["w1"] = k.linear_back(d["u"], s["h2"], w["w1"])
    d["x1_norm"], dw["g2"] = k.norm_back(d["h2"], s["x1"], w["g2"])
    d["x1"] = dx2 + d["x1_norm"]
    # x1 = x + attention(q, k, v) W_o^T
    d["o"], dw["wo"] = k.linear_back(d["x1"], s["o"], w["wo"])
    d["q_rope"], d["k_rope"], d["v"], outside = k.grad.attention_backward(
        *attention_inputs(s), d["o"], cu, heads, k.scale
    )
    if outside:
        raise OverflowError(f"attention backward: {outside} values outside its domain")
    d["q"] = k.rope_back(d["q_rope"], *pos, heads)
    d["k"] = k.rope_back(d["k_rope"], *pos, heads)
    d["h1"] = np.zeros_like(s["h1"])
    for name in "qkv":
        dh1, dw[f"w{name}"] = k.linear_back(d[name], s["h1"], w[f"w{name}"])
        d["h1"] += dh1
    d["x_norm"], dw["g1"] = k.norm_back(d["h1"], s["x"], w["g1"])
    d["x"] = d["x1"] + d["x_norm"]
    return d, dw


def project_backward(k: GradKernels, s: Arrays, w: Arrays,
                     dout: np.ndarray) -> tuple[Arrays, Arrays]:  # fmt: skip
    """The projector's backward from its stages `s` and dout = dL/dout (Q.24)."""
    d: Arrays = {"out": dout}
    dw: Arrays = {}
    d["p2"], dw["gp"] = k.norm_back(dout, s["p2"], w["gp"])
    d["p1_gelu"], dw["p2"] = k.linear_back(d["p2"], s["p1_gelu"], w["p2"])
    d["p1"] = k.grad.gelu_backward(s["p1"], d["p1_gelu"])
    d["merged"], dw["p1"] = k.linear_back(d["p1"], s["merged"], w["p1"])
    return d, dw
