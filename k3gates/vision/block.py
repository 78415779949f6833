"""One MoonViT3d block, the patch merger and the projector, stage by stage in integers (K3-SPEC.md
section 9, per public ports). Python only orders the kernels' calls and keeps every stage's
output, so a gate can hold each stage against float64 on the integers it received:

    h1 = RMSNorm(x) g1                                  fx.rmsnorm        x, h Q.16, g Q.20
    q, k, v = h1 W_q^T, h1 W_k^T, h1 W_v^T              gemm.gemm_i64     W Q.20 -> Q.16
    q, k <- 2D RoPE (x half by column, y half by row)   vision.rope2d     Q.20
    o = softmax(q k^T / sqrt(128)) v, per image/chunk   attention         Q.16
    x1 = x + o W_o^T                                    gemm_i64, exact add
    h2 = RMSNorm(x1) g2;  u = h2 W_1^T;  a = GELU(u);  x2 = x1 + a W_2^T

    merged = merge(x2)                                  frames averaged per chunk, 2 x 2 concat
    p1 = merged P_1^T;  p2 = GELU(p1) P_2^T;  out = RMSNorm(p2) g_p

No biases. Widths: K3's tower is 1024 wide with 12 heads of 128 (qkv 1536) and an MLP of 4096;
the projector maps 4096 -> 4096 -> 7168.
"""

from __future__ import annotations

import numpy as np

from ..fx import host
from .tables import rope_turns

W_FRAC = 20  # weights and norm gains: Q.20
ACT_FRAC = 16  # activations: Q.16
ROPE_FRAC = 20  # q, k after RoPE: Q.20
ROPE_X_MAX = 1 << 30  # rope_rotate's input domain (longctx.kernels)
EPS_Q32 = 4295  # RMSNorm's eps 1e-6 in Q.32 (mean of squares of Q.16 values)
EPS = EPS_Q32 / 2**32
WIDTH, HEADS, HEAD_DIM, MLP = 1024, 12, 128, 4096
TEXT_WIDTH = 7168


def init_block(rng: np.random.Generator, width: int = WIDTH, heads: int = HEADS,
               head_dim: int = HEAD_DIM, mlp: int = MLP) -> dict[str, np.ndarray]:  # fmt: skip
    """Seeded weights (std fan_in^-1/2, gains near 1), quantised to Q.20 int64."""

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return q20(rng.normal(0, host.inv_sqrt(n_in), (n_out, n_in)))

    qkv = heads * head_dim
    return {
        "g1": q20(1 + 0.1 * rng.normal(size=width)),
        "wq": mat(qkv, width), "wk": mat(qkv, width), "wv": mat(qkv, width),
        "wo": mat(width, qkv),
        "g2": q20(1 + 0.1 * rng.normal(size=width)),
        "w1": mat(mlp, width), "w2": mat(width, mlp),
    }  # fmt: skip


def init_projector(rng: np.random.Generator, d_in: int = 4 * WIDTH,
                   d_out: int = TEXT_WIDTH) -> dict[str, np.ndarray]:  # fmt: skip
    return {
        "p1": q20(rng.normal(0, host.inv_sqrt(d_in), (d_in, d_in))),
        "p2": q20(rng.normal(0, host.inv_sqrt(d_in), (d_out, d_in))),
        "gp": q20(1 + 0.1 * rng.normal(size=d_out)),
    }


def q20(a: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(a) * 2**W_FRAC).astype(np.int64)


def grid_positions(gh: int, gw: int, frames: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(column, row) of every token of `frames` frames of a gh x gw grid, frame-major."""
    rows, cols = np.indices((gh, gw))
    return np.tile(cols.ravel(), frames), np.tile(rows.ravel(), frames)


class Kernels:
    """The compiled (or interpreted) kernel modules a block needs, from one loader."""

    def __init__(self, load) -> None:
        self.fx = load("k3gates.fx.kernels")
        self.gemm = load("k3gates.gemm.kernels")
        self.vision = load("k3gates.vision.kernels")
        self.block = load("k3gates.vision.kernels_block")
        self.scale = int(self.fx.rsqrt_array(np.array([HEAD_DIM], np.int64), np.array([0]),
                                             np.array([62]))[0])  # fmt: skip
        self._freq: dict[int, np.ndarray] = {}  # 2D RoPE's frequencies per head width

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x W^T with one rounding to Q.16 (exact inside gemm_i64's domain; outside is an error)."""
        y, outside = self.gemm.gemm_i64(np.ascontiguousarray(x), w, W_FRAC)
        if outside:
            raise OverflowError(f"{outside} products outside gemm_i64's exact domain")
        return y

    def norm(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return self.fx.rmsnorm(np.ascontiguousarray(x), g, EPS_Q32, ACT_FRAC, W_FRAC, ACT_FRAC, 0)

    def rope(self, x: np.ndarray, pos_x: np.ndarray, pos_y: np.ndarray, heads: int) -> np.ndarray:
        """Q.16 [N, heads dh] -> 2D RoPE in Q.20, each head turned by its token's position."""
        n, width = x.shape
        rows = (x << (ROPE_FRAC - ACT_FRAC)).reshape(n * heads, width // heads)
        top = int(np.abs(rows).max(initial=0))
        if top > ROPE_X_MAX:  # checked before the int32 cast, which would wrap silently
            raise OverflowError(f"2D RoPE input |raw| {top} > 2^30, outside rope_rotate's domain")
        if width // heads not in self._freq:
            self._freq[width // heads] = rope_turns(width // heads)
        turned, sat = self.vision.rope2d(
            rows.astype(np.int32), np.repeat(pos_x, heads), np.repeat(pos_y, heads),
            self._freq[width // heads],
        )  # fmt: skip
        if sat:
            raise OverflowError(f"2D RoPE saturated {sat} values")
        return turned.astype(np.int64).reshape(n, width)


def forward(k: Kernels, x: np.ndarray, pos: tuple[np.ndarray, np.ndarray], cu: np.ndarray,
            w: dict[str, np.ndarray], heads: int = HEADS) -> dict[str, np.ndarray]:  # fmt: skip
    """One block on packed tokens x [N, D] (Q.16) with segment starts cu: every stage's output."""
    s: dict[str, np.ndarray] = {"x": x}
    s["h1"] = k.norm(x, w["g1"])
    for name in "qkv":
        s[name] = k.linear(s["h1"], w[f"w{name}"])
    s["q_rope"] = k.rope(s["q"], *pos, heads)
    s["k_rope"] = k.rope(s["k"], *pos, heads)
    s["o"], outside = k.block.attention(*attention_inputs(s), cu, heads, k.scale)
    if outside:
        raise OverflowError(f"attention: {outside} products outside gemm_i64's exact domain")
    s["attn_out"] = k.linear(s["o"], w["wo"])
    s["x1"] = x + s["attn_out"]
    s["h2"] = k.norm(s["x1"], w["g2"])
    s["u"] = k.linear(s["h2"], w["w1"])
    s["a"] = k.block.gelu(s["u"])
    s["mlp_out"] = k.linear(s["a"], w["w2"])
    s["x2"] = s["x1"] + s["mlp_out"]
    return s


def attention_inputs(s: dict[str, np.ndarray]) -> list[np.ndarray]:
    """q, k (Q.20) and v (Q.16) as the int32 the attention kernel reads, inside its domain
    (|q|, |k| < 2^26, |v| < 2^30) or an OverflowError naming the array."""
    out = []
    for name, limit in (("q_rope", 1 << 26), ("k_rope", 1 << 26), ("v", 1 << 30)):
        top = int(np.abs(s[name]).max(initial=0))
        if top >= limit:
            raise OverflowError(f"{name}: |raw| {top} >= {limit}, outside attention's domain")
        out.append(s[name].astype(np.int32))
    return out


def project(k: Kernels, merged: np.ndarray, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The projector on merged tokens [M, 4096] (Q.16): every stage's output."""
    s = {"merged": merged, "p1": k.linear(merged, w["p1"])}
    s["p1_gelu"] = k.block.gelu(s["p1"])
    s["p2"] = k.linear(s["p1_gelu"], w["p2"])
    s["out"] = k.norm(s["p2"], w["gp"])
    return s
