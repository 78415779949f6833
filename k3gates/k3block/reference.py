"""The K3 block's schedule as K3-SPEC.md states it, written out independently of kernels.py."""

from __future__ import annotations

import numpy as np

from ..attnres import reference as attnres_ref
from ..fx.reference import l2norm, rmsnorm, sigmoid, silu
from ..kda import reference as kda_ref
from ..mla import reference as mla_ref
from ..moe import reference as moe_ref

K3_LAYERS = 93
K3_MLA_LAYERS = [*range(4, 93, 4), 93]  # 1-based: 4, 8, ..., 92 and the final 93


def mla_layers(n_layers: int, period: int) -> list[int]:
    """1-based MLA layers: every period-th layer, then the last one if it is not already MLA."""
    layers = list(range(period, n_layers + 1, period))
    if not layers or layers[-1] != n_layers:
        layers.append(n_layers)
    return layers


def attention_bytes(n_layers: int, mla: list[int], state: int, per_token: int, t: int) -> int:
    return (n_layers - len(mla)) * state + len(mla) * per_token * t


# == the composed block (K3-SPEC sections 1-4), float64 =========================================
# The block's own pieces are written here from the equations; the modules' float references
# (each written from the same spec, independent of every kernel) supply the pointwise functions
# and norms (fx), KDA's recurrence and gate, Gated MLA, the LatentMoE layer and AttnRes.


def attnres_flow(n_layers: int, block_size: int) -> list[int]:
    """How many stored blocks each AttnRes call of K3's layer flow sees (K3-SPEC section 3):
    per layer the call before Attn, the call before the FFN, then the final call. Layer 0's
    first call has no blocks (a = prefix); a layer l with l % block_size == 0 pushes the prefix
    after its first call (layer 0 pushes the embedding)."""
    seen, blocks = [], 0
    for layer in range(n_layers):
        seen.append(blocks)
        if layer % block_size == 0:
            blocks += 1
        seen.append(blocks)
    return [*seen, blocks]


def short_conv(u: np.ndarray, wc: np.ndarray) -> np.ndarray:
    """Causal depthwise convolution of u [T, C] with taps wc [C, K]: tap K - 1 is the current
    token, tap 0 the token K - 1 back; tokens before the first count as zero."""
    t_len, kw = u.shape[0], wc.shape[1]
    padded = np.concatenate([np.zeros((kw - 1, u.shape[1])), u])
    return sum(wc[:, j] * padded[j : j + t_len] for j in range(kw))


def kda_inputs(x: np.ndarray, p: dict, n_heads: int, l2_eps: float) -> dict[str, np.ndarray]:
    """q (times d_k^-1/2), k, v, beta, g, alpha of a KDA layer from its normed input x [T, D]
    (K3-SPEC section 1): q, k, v = SiLU(conv(W x)), q, k L2-normalised, beta = sigma(W_b x),
    g = -5 sigma(A (W_f x + dt_bias)), alpha = exp(g)."""
    t_len = x.shape[0]
    act = silu(short_conv(x @ p["w_qkv"].T, p["conv"]))
    q, k, v = (a.reshape(t_len, n_heads, -1) for a in np.split(act, 3, axis=1))
    d_k = q.shape[2]
    g = kda_ref.gate((x @ p["w_f"].T).reshape(q.shape), p["a_head"], p["dt_bias"])
    return {
        "qs": l2norm(q, l2_eps) * d_k**-0.5,
        "k": l2norm(k, l2_eps),
        "v": v,
        "beta": sigmoid(x @ p["w_b"].T),
        "g": g,
        "alpha": np.exp(g),
    }


def kda_output(o: np.ndarray, x: np.ndarray, p: dict, eps: float) -> np.ndarray:
    """y = W_O (RMSNorm(o_h) w ⊙ sigma(x W_go)): the head output of K3-SPEC section 1, with
    the output gate sigma(x W_go) of the same form as Gated MLA's."""
    o_n = rmsnorm(o, p["head_norm_w"], eps)
    return mla_ref.output(o_n, x, p["w_go"], p["w_o"])[1]


def kda_layer(x: np.ndarray, p: dict, n_heads: int, l2_eps: float, eps: float) -> np.ndarray:
    i = kda_inputs(x, p, n_heads, l2_eps)
    s0 = np.zeros((n_heads, i["k"].shape[2], i["v"].shape[2]))
    o, _ = kda_ref.recurrent(i["qs"], i["k"], i["v"], i["alpha"], i["beta"], s0)
    return kda_output(o, x, p, eps)


def moe_ffn(x: np.ndarray, p: dict, k: int, rsf: float, eps: float) -> np.ndarray:
    """The LatentMoE layer with float64's own routing: top-k of sigma(W_r x) (bias 0)."""
    idx = moe_ref.select(moe_ref.scores(x, p["w_r"]), k)
    return moe_ref.layer(x, idx, p, rsf, eps)["y"]


def block(emb: np.ndarray, layers: list[dict], final_w: np.ndarray, cfg: dict) -> np.ndarray:
    """The whole block in float64 from the float embedding [T, D]: K3-SPEC section 3's flow
    over the given layers (each dict: kind 0 = KDA, 1 = Gated MLA, its weights), ending with
    the final AttnRes. cfg: block_size, eps (RMSNorm, AttnRes), l2_eps, n_heads (KDA),
    mla_heads, mla_eps, mla_scale, k, rsf, moe_eps."""
    blocks: list[np.ndarray] = []
    prefix = emb.copy()

    def mix(w: np.ndarray) -> np.ndarray:
        return attnres_ref.attnres(np.stack([*blocks, prefix]), w, cfg["eps"])[0]

    for layer, p in enumerate(layers):
        a = mix(p["wq_a"]) if blocks else prefix.copy()
        if layer % cfg["block_size"] == 0:
            blocks.append(prefix)
            prefix = np.zeros_like(prefix)
        x = rmsnorm(a, p["attn_norm_w"], cfg["eps"])
        if p["kind"] == 0:
            y = kda_layer(x, p["kda"], cfg["n_heads"], cfg["l2_eps"], cfg["eps"])
        else:
            y = mla_ref.forward(x, p["mla"], cfg["mla_heads"], cfg["mla_eps"], cfg["mla_scale"])
        prefix = prefix + y
        m = mix(p["wq_m"])
        prefix = prefix + moe_ffn(
            rmsnorm(m, p["ffn_norm_w"], cfg["eps"]), p["moe"], cfg["k"], cfg["rsf"], cfg["moe_eps"]
        )
    return mix(final_w)
