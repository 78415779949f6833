"""Gates for the K3 block: the 3:1 KDA:MLA layer schedule and the attention memory it implies
(PARTIAL), and the composed block, three KDA layers then one Gated MLA layer with Block AttnRes
on the residual path and the LatentMoE FFN, in integers, held against float64 stage by stage
(HAVE)."""

from __future__ import annotations

import time
import warnings

import numpy as np

from k3gates.fx import kernels as FX
from k3gates.fx import quantize, value
from k3gates.fx.checks import lsb
from k3gates.infra.gate import GateContext, bit_equal, digest, gate

from ..attnres import kernels as AR
from ..attnres import reference as attnres_ref
from ..kda import kernels as KDA
from ..kda import reference as kda_ref
from ..mla import IntWeights, forward_int
from ..mla import kernels as MLA
from ..mla import reference as mla_ref
from ..moe import kernels as MOE
from ..moe import reference as moe_ref
from . import kernels as K
from . import reference as ref

# K3's attention state per layer, counted from arrays in the kernels' int32 storage: the KDA state
# H x d_k x d_v = 96 x 128 x 128; the MLA cache row c_KV (512) + shared k_R (64) per token
KDA_STATE = np.zeros((96, 128, 128), dtype=np.int32)
MLA_ROW = np.zeros(512 + 64, dtype=np.int32)
CONTEXTS = [1 << e for e in range(0, 21, 2)]  # 1 .. 2^20 tokens


# The schedule interleaves KDA and Gated MLA layers and counts their state and caches: it
# requires the gates proving those two modules' serve forms, the layers it schedules.
@gate(
    "k3block_schedule",
    innovation="k3block",
    level="PARTIAL",
    kernels=["k3gates.k3block.kernels"],
    bounds={"memory_exact": 0},
    requires=["kda_gate_decay", "kda_recurrent", "mla_latent", "mla_forward"],
)
def k3block_schedule(ctx: GateContext) -> None:
    """K3's 93 layers are 69 KDA and 24 Gated MLA, MLA at 4, 8, ..., 92 and 93: 3:1 with a final
    global layer; the attention memory of that stack, from arrays, at contexts up to 2^20."""
    k = ctx.compiled()
    kinds = k.layer_schedule(ref.K3_LAYERS, 4)
    mla = [i + 1 for i in range(kinds.size) if kinds[i] == 1]
    ctx.check(
        "k3_schedule",
        "the kernel's 93-layer schedule puts Gated MLA exactly at the 1-based layers K3-SPEC "
        "lists (4, 8, ..., 92, 93), and KDA everywhere else: 69 KDA and 24 MLA",
        mla == ref.K3_MLA_LAYERS and int(kinds.size - kinds.sum()) == 69 and len(mla) == 24,
        kda_layers=int(kinds.size - kinds.sum()),
        mla_layers=len(mla),
    )
    groups = kinds[:92].reshape(23, 4)
    ctx.check(
        "three_to_one",
        "every group of four layers (1-4, 5-8, ..., 89-92) is three KDA layers then one MLA "
        "layer, and the 93rd is a final MLA layer",
        bool((groups == np.array([0, 0, 0, 1], dtype=np.int8)).all()) and kinds[92] == 1,
    )
    # layers from each layer to the next MLA layer at or after it (the depth when there is none)
    gaps = [
        min((m - (i + 1) for m in mla if m >= i + 1), default=kinds.size) for i in range(kinds.size)
    ]
    ctx.check(
        "global_within_three",
        "every KDA layer's output reaches a global (MLA) layer within at most 3 layers, and the "
        "stack ends in global attention: not linear attention alone",
        max(gaps) <= 3 and kinds[-1] == 1,
        max_layers_to_global=max(gaps),
    )
    other = [(n, p) for n in range(1, 130) for p in (2, 3, 4, 5, 8) if p <= n]
    wrong = [
        (n, p)
        for n, p in other
        if [i + 1 for i, x in enumerate(k.layer_schedule(n, p)) if x == 1] != ref.mla_layers(n, p)
    ]
    ctx.check(
        "rule_general",
        "the kernel's rule agrees with the spec's rule written out independently for every depth "
        "1..129 and periods 2, 3, 4, 5, 8",
        not wrong,
        cases=len(other),
        first_wrong=str(wrong[:1]),
    )
    ratio = _memory(ctx, k, kinds, mla)
    ctx.check_compiled_matches_interpreted(
        "compiled",
        "layer_schedule",
        93,
        4,
        inputs="the gate's real inputs: K3's 93 layers, period 4, which reach both MLA rules "
        "(a multiple of the period, and the last layer) and the KDA layers",
    )
    state, row = int(KDA_STATE.nbytes), int(MLA_ROW.nbytes)
    ctx.check_compiled_matches_interpreted(
        "compiled_memory",
        "attention_bytes",
        kinds,
        state,
        row,
        CONTEXTS[-1],
        inputs="the gate's real inputs at its longest context: K3's 93-layer schedule, the KDA "
        "state and MLA row bytes, 2^20 tokens, whose total (about 2^36) is the largest the gate "
        "counts",
    )
    # the count depends on how many layers are of each kind, never on their order
    rng = np.random.default_rng(BLOCK_SEED)
    orders = {"schedule order": kinds, "reversed": kinds[::-1].copy()}
    orders["shuffled"] = kinds[rng.permutation(kinds.size)]
    ctx.check_deterministic(
        "deterministic",
        "the attention bytes of the 93 layers at every context from 1 to 2^20 tokens are the "
        "same bits with the layers in schedule order, reversed and shuffled: the count sums "
        "independent layers, in any order",
        {
            label: tuple(np.int64(k.attention_bytes(o, state, row, t)) for t in CONTEXTS)
            for label, o in orders.items()
        },
    )
    ctx.evidence(
        f"93 layers: {int(kinds.size - kinds.sum())} KDA + {len(mla)} MLA at 4, 8, ..., 92, 93; "
        f"the attention memory counted exactly up to 2^20 tokens, where 93 MLA layers would "
        f"hold {ratio:.2f} times as much"
    )


def _memory(ctx: GateContext, k, kinds: np.ndarray, mla: list[int]) -> float:
    """The stack's attention memory: 69 fixed KDA states plus 24 growing MLA caches, against the
    same 93 layers all MLA (the 'no KDA' alternative). Returns that ratio at 2^20 tokens."""
    state, row = int(KDA_STATE.nbytes), int(MLA_ROW.nbytes)
    all_mla = np.ones(ref.K3_LAYERS, dtype=np.int8)
    got = [k.attention_bytes(kinds, state, row, t) for t in CONTEXTS]
    want = [ref.attention_bytes(ref.K3_LAYERS, mla, state, row, t) for t in CONTEXTS]
    ctx.check_reference(
        "memory_exact",
        "the kernel's count of the stack's attention bytes equals the spec's formula, "
        "69 x KDA state + 24 x MLA row x T, exactly, at every context from 1 to 2^20 tokens",
        np.array(got, dtype=np.float64),
        np.array(want, dtype=np.float64),
        unit="bytes",
    )
    every = [k.attention_bytes(all_mla, state, row, t) for t in CONTEXTS]
    # a displayed fact, not a check: both columns follow from the constant sizes above
    ctx.artifact(
        "table:attention memory of 93 layers (int32 storage, K3 dimensions)",
        {
            "columns": ["tokens", "K3: 69 KDA + 24 MLA (MiB)", "93 MLA layers (MiB)", "ratio"],
            "rows": [
                [t, g / 2**20, e / 2**20, e / g if g else None]
                for t, g, e in zip(CONTEXTS, got, every, strict=True)
            ],
        },
    )
    return every[-1] / got[-1] if got[-1] else float("nan")


# == HAVE: the composed block ====================================================================
# Test dimensions (K3's in brackets). Where K3's details are not public the choice is ours:
#  - the block is the schedule's first four layers, layer_schedule(93, 4)[:4] = KDA, KDA, KDA,
#    Gated MLA, each followed by the LatentMoE FFN (K3's layer 0 is a dense FFN; the toy block
#    stands for any group of four, so every FFN here is the MoE);
#  - Block AttnRes with block size 2 (K3: 12, which in a 4-layer toy would store only the
#    embedding): layers 0 and 2 push, so AttnRes mixes 2 and then 3 sources;
#  - KDA's projections are full rank (fla uses low-rank gate projections), its short convolution
#    has 4 taps on q, k and v, and its output gate is sigma(x W_go) on the normed input, the same
#    form as Gated MLA's (K3's exact KDA output gate is not public);
#  - d_k = 16 = 4^2, so q's scale d_k^-1/2 = 2^-2 is exact: q is L2-normalised into Q.22 and read
#    as Q0.24 (K3's d_k = 128 would need one more rounding);
#  - weights are seeded draws at scale-preserving sizes, the router bias is 0 (Quantile Balancing
#    freezes it at inference), routed_scaling_factor 2.827.
T_BLOCK = 32  # tokens
D_BLOCK = 64  # hidden (K3: 7168)
N_LAYERS = 4
BLOCK_SIZE = 2  # (K3: 12)
KDA_H, KDA_D = 2, 16  # (K3: 96 heads, d_k = d_v = 128)
QS_FRAC = KDA.QK_FRAC - 2  # q L2-normalised into Q.22 = scale q in Q0.24 (d_k^-1/2 = 2^-2)
CONV_TAPS = 4
MLA_DIMS = {"H": 2, "q_lora": 24, "kv_lora": 32, "nope": 16, "rope": 8, "d_v": 16}
MOE_N, MOE_K, MOE_DL, MOE_F, MOE_FS = 8, 2, 16, 8, 16  # (K3: 896, 16, 3584, 3072, 2 x 3072)
RSF = 2.827
EPS = 1e-6  # every RMSNorm, AttnRes's keys, KDA's L2 norm
BLOCK_SEED = 20260710
I32_MAX = (1 << 31) - 1
X_LIM = (1 << 24) - 1  # the attention layers' input: |x| < 256 in Q.16 (mla's domain)
FFN_X_LIM = MOE.X_MAX << MOE.X_FRAC  # the FFN's input: |x| <= 8 in Q.24 (moe's domain)
EPS_RES = int(quantize(np.float64(EPS), 2 * K.RES_FRAC))  # Q.48: block RMSNorm, AttnRes
EPS_ACT = int(quantize(np.float64(EPS), 2 * K.ACT_FRAC))  # Q.40: KDA's L2 norm and head norm
EPS_MLA = int(quantize(np.float64(EPS), MLA.EPS_FRAC))
EPS_MOE = int(quantize(np.float64(EPS), MOE.EPS_FRAC))
RSF_Q = int(quantize(np.float64(RSF), MOE.W_FRAC))
# the bounds, every one from a module's declared constant (see each kernel's docstring)
POINTWISE_Q10 = max(
    MLA.LINEAR_MAX_ERR_LSB_Q10,  # the projections (mla_linear)
    K.CONV_SILU_MAX_ERR_LSB_Q10,
    FX.L2NORM_MAX_ERR_LSB_Q10,
    K.BETA_MAX_ERR_LSB_Q10,
    KDA.GATE_MAX_ERR_LSB_Q10,
    KDA.DECAY_MAX_ERR_LSB_Q10,
    K.NORM_MAX_ERR_LSB_Q10,  # the per-head RMSNorm of o
)
# y = W_O (o_n ⊙ sigma(x W_go)) from the integer o_n (mla_output): mla's output bound with no
# attention term, 1/2 + WO_L1 GATED + 2^-10 (k3gates.mla.kernels, output_bound_q10)
KDA_OUT_Q10 = 513 + MLA.GATED_MAX_ERR_LSB_Q10 * (1 << MLA.WO_L1_BITS)
MLA_LATENT_Q10 = max(
    MLA.LINEAR_MAX_ERR_LSB_Q10, MLA.RMSNORM_MAX_ERR_LSB_Q10, MLA.QUERY_MAX_ERR_LSB_Q10
)
KDA_LAYERS, MLA_LAYERS = (1, 2, 3), (4,)  # 1-based, from K3-SPEC's schedule
QK_NORM_SLACK = 1 + 2.0**-20  # see _domain: ||k||^2 <= 1 and ||scale q||^2 <= 1/d_k, relatively


def _block_bounds() -> dict[str, float]:
    b = {"final_attnres": lsb(AR.MIX_MAX_ERR_LSB_Q10)}
    for layer in range(1, N_LAYERS + 1):
        if layer > 1:
            b[f"L{layer}_attnres_a"] = lsb(AR.MIX_MAX_ERR_LSB_Q10)
        b[f"L{layer}_attnres_m"] = lsb(AR.MIX_MAX_ERR_LSB_Q10)
        b[f"L{layer}_norms"] = lsb(K.NORM_MAX_ERR_LSB_Q10)
        b[f"L{layer}_residual"] = lsb(K.RESIDUAL_MAX_ERR_LSB_Q10)
        b[f"L{layer}_moe"] = lsb(MOE.layer_bound_q10(MOE_DL, MOE_K))
    for layer in KDA_LAYERS:
        b[f"L{layer}_kda_pointwise"] = lsb(POINTWISE_Q10)
        b[f"L{layer}_kda_recurrent"] = float(KDA.recurrent_bound_lsb(T_BLOCK, KDA_D))
        b[f"L{layer}_kda_output"] = lsb(KDA_OUT_Q10)
    for layer in MLA_LAYERS:
        b[f"L{layer}_mla_latent"] = lsb(MLA_LATENT_Q10)
        b[f"L{layer}_mla_attention"] = lsb(MLA.attend_bound_q10(T_BLOCK))
        b[f"L{layer}_mla_output"] = lsb(MLA.output_bound_q10(T_BLOCK))
    return b


# -- weights --------------------------------------------------------------------------------------
def _lin(rng: np.random.Generator, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
    return rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)


def _fit_l1(w: np.ndarray, top: float = 6.0) -> np.ndarray:
    """Scale w so every row and column L1 norm is <= top (moe's domain is 8)."""
    a = np.abs(w)
    return w * min(1.0, top / max(a.sum(axis=-1).max(), a.sum(axis=-2).max()))


def _q(a: np.ndarray, frac: int, dtype: type = np.int64) -> np.ndarray:
    return np.ascontiguousarray(quantize(np.asarray(a, dtype=np.float64), frac).astype(dtype))


def _kda_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    hd, d = KDA_H * KDA_D, D_BLOCK
    taps = 0.3 * rng.standard_normal((3 * hd, CONV_TAPS)) + np.array([0.0, 0.0, 0.0, 1.0])
    return {
        "w_qkv": _q(_lin(rng, 3 * hd, d), K.GLUE_W_FRAC, np.int32),
        "conv": _q(taps, K.GLUE_W_FRAC),
        "w_f": _q(_lin(rng, hd, d), K.GLUE_W_FRAC, np.int32),
        "a_head": _q(rng.uniform(1.0, 4.0, KDA_H), KDA.G_FRAC),  # A = exp(A_log)
        "dt_bias": _q(rng.normal(-1.0, 0.5, (KDA_H, KDA_D)), KDA.G_FRAC),
        "w_b": _q(_lin(rng, KDA_H, d), K.GLUE_W_FRAC),
        "head_norm_w": _q(1 + 0.1 * rng.standard_normal(KDA_D), K.GLUE_W_FRAC),
        "w_go": _q(_lin(rng, hd, d), K.GLUE_W_FRAC, np.int32),
        "w_o": _q(_lin(rng, d, hd), K.GLUE_W_FRAC, np.int32),
    }


def _mla_weights(rng: np.random.Generator, mla) -> IntWeights:
    m, d = MLA_DIMS, D_BLOCK
    h, dqk = m["H"], m["nope"] + m["rope"]
    w = {
        "w_dq": _lin(rng, m["q_lora"], d),
        "w_q_norm": 1 + 0.1 * rng.standard_normal(m["q_lora"]),
        "w_uq": _lin(rng, h * dqk, m["q_lora"], 2.0),
        "w_dkv": _lin(rng, m["kv_lora"] + m["rope"], d),
        "w_kv_norm": 1 + 0.1 * rng.standard_normal(m["kv_lora"]),
        "w_uk": rng.standard_normal((h, m["nope"], m["kv_lora"])) / np.sqrt(m["kv_lora"]),
        "w_uv": rng.standard_normal((h, m["d_v"], m["kv_lora"])) / np.sqrt(m["kv_lora"]),
        "w_g": _lin(rng, h * m["d_v"], d),
        "w_o": _lin(rng, d, h * m["d_v"]),
    }
    ints = {name: _q(a, MLA.W_FRAC, np.int32) for name, a in w.items()}
    return IntWeights(**ints, eps=EPS_MLA, scale=int(mla.default_scale(dqk)))


def _moe_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def unit_rows(rows: int, cols: int) -> np.ndarray:
        w = rng.standard_normal((rows, cols))
        return _fit_l1(w / np.linalg.norm(w, axis=1, keepdims=True))

    stack = lambda rows, cols: np.stack([unit_rows(rows, cols) for _ in range(MOE_N)])
    d = D_BLOCK
    p = {
        "w_r": unit_rows(MOE_N, d),
        "w_down": unit_rows(MOE_DL, d),
        "w1": stack(MOE_F, MOE_DL),
        "w3": stack(MOE_F, MOE_DL),
        "w2": stack(MOE_DL, MOE_F),
        "w_n": 1.0 + 0.2 * rng.standard_normal(MOE_DL).clip(-3, 3),
        "w_up": unit_rows(d, MOE_DL),
        "ws1": unit_rows(MOE_FS, d),
        "ws3": unit_rows(MOE_FS, d),
        "ws2": unit_rows(d, MOE_FS),
    }
    return {name: _q(w, MOE.W_FRAC) for name, w in p.items()}


def block_weights(seed: int, kinds: np.ndarray, mla) -> dict:
    """Seeded integer weights for the block's layers (kinds: 0 KDA, 1 Gated MLA) and the
    embedding [T, D] in Q.24 (N(0, 1) clipped to +-6)."""
    rng = np.random.default_rng(seed)
    query = lambda: _q(rng.standard_normal(D_BLOCK) * 0.5 / np.sqrt(D_BLOCK), K.RES_FRAC)
    norm_w = lambda: _q(1 + 0.1 * rng.standard_normal(D_BLOCK), K.NORM_W_FRAC)
    layers = []
    for kind in kinds.tolist():
        layer = {"kind": int(kind), "wq_a": query(), "wq_m": query()}
        layer["attn_norm_w"], layer["ffn_norm_w"] = norm_w(), norm_w()
        if kind == 0:
            layer["kda"] = _kda_weights(rng)
        else:
            layer["mla"] = _mla_weights(rng, mla)
        layer["moe"] = _moe_weights(rng)
        layers.append(layer)
    emb = _q(np.clip(rng.standard_normal((T_BLOCK, D_BLOCK)), -6, 6), K.RES_FRAC)
    return {"layers": layers, "final_w": query(), "emb": emb}


# -- the integer block ----------------------------------------------------------------------------
KERNEL_MODULES = {
    "glue": "k3gates.k3block.kernels",
    "fx": "k3gates.fx.kernels",
    "kda": "k3gates.kda.kernels",
    "mla": "k3gates.mla.kernels",
    "moe": "k3gates.moe.kernels",
    "attnres": "k3gates.attnres.kernels",
}


def _rows(a: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(a.astype(np.int64).reshape(-1, width))


def _attnres(ar, blocks: list[np.ndarray], prefix: np.ndarray, w: np.ndarray) -> dict:
    """AttnRes over [blocks..., prefix] (K3-SPEC section 3), every source [T, D] Q.24."""
    src = np.ascontiguousarray(np.stack([*blocks, prefix]))
    h, alpha, sat = ar.attnres_forward(src, w, EPS_RES, K.RES_FRAC, K.RES_FRAC)
    return {"src": src, "h": h, "alpha": alpha, "sat": int(sat)}


def _kda_layer(m: dict, xn: np.ndarray, p: dict) -> dict:
    """One KDA layer on its normed input xn (int32 [T, D], Q.16): y int32 [T, D] in Q.20 and
    every intermediate (K3-SPEC section 1)."""
    glue, fx, kda, mla = m["glue"], m["fx"], m["kda"], m["mla"]
    t_len, hd = xn.shape[0], KDA_H * KDA_D
    shape = (t_len, KDA_H, KDA_D)
    r = {}
    # q, k, v = SiLU(conv(W x)): the projections exact in Q.32, rounded to Q.20
    r["pre"], s_pre = mla.mla_linear(xn, p["w_qkv"], 2 * K.X_FRAC - K.ACT_FRAC, I32_MAX)
    r["act"], s_conv = glue.conv_silu(r["pre"], p["conv"], I32_MAX)
    # q, k L2-normalised: k into Q0.24, q into Q.22 (= scale q in Q0.24, scale = 2^-2)
    q_rows, k_rows = _rows(r["act"][:, :hd], KDA_D), _rows(r["act"][:, hd : 2 * hd], KDA_D)
    r["qs"] = fx.l2norm(q_rows, EPS_ACT, K.ACT_FRAC, QS_FRAC, 0).reshape(shape).astype(np.int32)
    r["k"] = fx.l2norm(k_rows, EPS_ACT, K.ACT_FRAC, KDA.QK_FRAC, 0).reshape(shape)
    r["k"] = r["k"].astype(np.int32)
    r["v"] = np.ascontiguousarray(r["act"][:, 2 * hd :].reshape(shape).astype(np.int32))
    # g = -5 sigma(A (W_f x + dt_bias)) in Q.24, alpha = exp(g), beta = sigma(W_b x)
    r["g_raw"], s_g = mla.mla_linear(xn, p["w_f"], 2 * K.X_FRAC - KDA.G_FRAC, I32_MAX)
    r["g"] = kda.kda_gate(
        np.ascontiguousarray(r["g_raw"].reshape(shape)), p["a_head"], p["dt_bias"]
    )
    r["alpha"] = kda.kda_decay(r["g"])
    r["beta"] = glue.head_sigmoid(xn, p["w_b"])
    s0 = np.zeros((KDA_H, KDA_D, KDA_D), dtype=np.int32)
    r["o"], r["S"], stats = kda.kda_recurrent(r["qs"], r["k"], r["v"], r["alpha"], r["beta"], s0)
    # the head output: RMSNorm(o_h) w ⊙ sigma(x W_go), then o_proj (mla_output's same form)
    o_n, s_n, _ = glue.norm_rows(
        _rows(r["o"], KDA_D), p["head_norm_w"], EPS_ACT, K.ACT_FRAC, K.GLUE_W_FRAC, K.ACT_FRAC,
        MLA.O_LIM,
    )  # fmt: skip
    r["o_n"] = np.ascontiguousarray(o_n.reshape(shape).astype(np.int32))
    r["gated"], r["y"], s_y = mla.mla_output(r["o_n"], xn, p["w_go"], p["w_o"])
    r["kda_stats"] = stats
    r["sat"] = sum(int(s) for s in (s_pre, s_conv, s_g, stats[0], s_n, s_y))
    return r


def _moe(m: dict, xf: np.ndarray, p: dict) -> dict:
    moe = m["moe"]
    s, idx, wts = moe.router(xf, p["w_r"], np.zeros(MOE_N, dtype=np.int64), MOE_K, RSF_Q)
    y, z, c, r = moe.moe_layer(
        xf, idx, wts, p["w_down"], p["w1"], p["w3"], p["w2"], p["w_n"], EPS_MOE, p["w_up"],
        p["ws1"], p["ws3"], p["ws2"],
    )  # fmt: skip
    return {"s": s, "idx": idx, "wts": wts, "y": y, "z": z, "c": c, "r": r}


def run_block(m: dict, w: dict, emb: np.ndarray, mla_path: str = "naive") -> dict:
    """The block in integers (K3-SPEC section 3's flow), every intermediate recorded.

    m maps "glue", "fx", "kda", "mla", "moe", "attnres" to kernels modules (compiled or
    interpreted); emb int64 [T, D] Q.24. Per layer: a = AttnRes(prefix, blocks) or prefix; push
    the prefix every BLOCK_SIZE layers (layer 0 pushes the embedding); prefix += Attn(RMSNorm(a));
    m = AttnRes(prefix, blocks); prefix += FFN(RMSNorm(m)). Then the final AttnRes."""
    glue, ar = m["glue"], m["attnres"]
    blocks: list[np.ndarray] = []
    prefix = emb.copy()
    layers = []
    for index, p in enumerate(w["layers"]):
        r: dict = {"kind": p["kind"], "n_blocks_a": len(blocks)}
        r["att_a"] = _attnres(ar, blocks, prefix, p["wq_a"]) if blocks else None
        r["a"] = r["att_a"]["h"] if blocks else prefix.copy()
        if index % BLOCK_SIZE == 0:
            blocks.append(prefix)
            prefix = np.zeros_like(prefix)
        r["prefix_pushed"] = prefix
        xn, s_na, sh_a = glue.norm_rows(
            r["a"], p["attn_norm_w"], EPS_RES, K.RES_FRAC, K.NORM_W_FRAC, K.X_FRAC, X_LIM
        )
        r["xn"] = np.ascontiguousarray(xn.astype(np.int32))
        if p["kind"] == 0:
            r["attn"] = _kda_layer(m, r["xn"], p["kda"])
        else:
            r["attn"] = forward_int(m["mla"], r["xn"], p["mla"], mla_path)
        y_attn = r["attn"]["y"].astype(np.int64)
        prefix, s_ra = glue.residual_add(prefix, y_attn, K.RES_FRAC - K.ACT_FRAC, K.RES_LIM)
        r["prefix_mid"] = prefix
        r["n_blocks_m"] = len(blocks)
        r["att_m"] = _attnres(ar, blocks, prefix, p["wq_m"])
        xf, s_nf, sh_f = glue.norm_rows(
            r["att_m"]["h"], p["ffn_norm_w"], EPS_RES, K.RES_FRAC, K.NORM_W_FRAC, MOE.X_FRAC,
            FFN_X_LIM,
        )  # fmt: skip
        r["xf"] = xf
        r["ffn"] = _moe(m, xf, p["moe"])
        prefix, s_rf = glue.residual_add(prefix, r["ffn"]["y"], 0, K.RES_LIM)
        r["prefix_out"] = prefix
        r["acc_shift"] = max(int(sh_a), int(sh_f))
        r["sat"] = {
            "attnres": (r["att_a"]["sat"] if r["att_a"] else 0) + r["att_m"]["sat"],
            "norms": int(s_na) + int(s_nf),
            "attn": int(r["attn"]["sat"]),
            "residual": int(s_ra) + int(s_rf),
        }
        layers.append(r)
    final = _attnres(ar, blocks, prefix, w["final_w"])
    return {"layers": layers, "final": final, "n_blocks_final": len(blocks)}


def block_outputs(rec: dict) -> tuple[np.ndarray, ...]:
    """Every layer's stored results (a, attention y, m, FFN y, prefix) and the final output."""
    out = []
    for r in rec["layers"]:
        out += [r["a"], r["attn"]["y"], r["att_m"]["h"], r["ffn"]["y"], r["prefix_out"]]
    return (*out, rec["final"]["h"])


# -- the gate --------------------------------------------------------------------------------------
Q24, Q20, Q16 = "LSB (2^-24)", "LSB (2^-20)", "LSB (2^-16)"


# The block runs the serve-form kernels of kda, mla, moe (and the situ kernels its experts
# import) and attnres: it requires every gate that proves one of those kernels (fx's gates apply
# by themselves). The training forms it never runs (kda_chunked, the backward passes, the
# training runs) prove other kernels, so they are not its requirements.
@gate(
    "k3block_forward",
    innovation="k3block",
    level="HAVE",
    kernels=list(KERNEL_MODULES.values()),
    bounds=_block_bounds(),
    timeout=900,
    requires=[
        "kda_gate_decay",
        "kda_recurrent",
        "mla_latent",
        "mla_forward",
        "moe_router",
        "moe_layer",
        "attnres_pieces",
        "attnres_forward",
        "attnres_stack",
        "situ_pieces",
        "situ_forward",
    ],
)
def k3block_forward(ctx: GateContext) -> None:
    """The composed K3 block: three KDA layers then one Gated MLA layer (the schedule's first
    four), Block AttnRes on the residual path and the LatentMoE FFN after each, all in integers
    on the kda, mla, moe, attnres and fx kernels; every stage within its module's declared bound
    of float64 applied to the integers that stage received; causal and deterministic bit for
    bit, with no saturation anywhere."""
    m = {key: ctx.compiled(name) for key, name in KERNEL_MODULES.items()}
    kinds = m["glue"].layer_schedule(ref.K3_LAYERS, 4)[:N_LAYERS]
    w = block_weights(BLOCK_SEED, kinds, m["mla"])
    rec = run_block(m, w, w["emb"])
    ctx.check(
        "schedule_used",
        "the block's four layers are the kernel's 93-layer schedule's first four, KDA, KDA, KDA, "
        "Gated MLA, as K3-SPEC lists them (MLA at the 1-based layer 4)",
        [int(k) for k in kinds] == [int(i + 1 in ref.K3_MLA_LAYERS) for i in range(N_LAYERS)]
        and [r["kind"] for r in rec["layers"]] == [0, 0, 0, 1],
        kinds=[int(k) for k in kinds],
    )
    seen = [n for r in rec["layers"] for n in (r["n_blocks_a"], r["n_blocks_m"])]
    seen.append(rec["n_blocks_final"])
    ctx.check(
        "attnres_flow",
        f"the stored blocks each AttnRes call sees follow K3-SPEC section 3's flow with block "
        f"size {BLOCK_SIZE}, written out independently, and the first stored block is the "
        "embedding bit for bit",
        seen == ref.attnres_flow(N_LAYERS, BLOCK_SIZE)
        and bool(np.array_equal(rec["final"]["src"][0], w["emb"])),
        blocks_seen=seen,
    )
    for index, r in enumerate(rec["layers"]):
        _layer_references(ctx, index + 1, r, w["layers"][index])
    fin = rec["final"]
    _check_attnres(ctx, "final_attnres", "the final AttnRes", fin, w["final_w"])
    _saturations(ctx, rec)
    _domain(ctx, rec, w)
    _routing(ctx, rec, w)
    _causal(ctx, m, w, rec)
    _deterministic(ctx, m, w, rec)
    _threads(ctx, w, rec)
    _block_contract(ctx, m, w, rec)
    _drift(ctx, w, rec)
    refs = [c for c in ctx.checks if c.kind == "reference"]
    held = {c.name: c.passed for c in ctx.checks}
    props = [name for name in ("no_saturation", "causal", "deterministic") if held.get(name)]
    ctx.evidence(
        f"3 KDA + 1 Gated MLA layers with Block AttnRes and the LatentMoE FFN (T={T_BLOCK}, "
        f"D={D_BLOCK}) in integers: {sum(c.passed for c in refs)}/{len(refs)} stage checks "
        f"within their declared bounds of float64; properties holding {len(props)}/3: "
        + (", ".join(props) or "none")
    )


def _kda_reals(pi: dict) -> dict[str, np.ndarray]:
    """A KDA layer's integer weights as real numbers: A and dt_bias in kda's Q.24 (G_FRAC),
    the rest in the glue's Q.16."""
    gate_params = ("a_head", "dt_bias")
    return {
        name: value(np.asarray(v), KDA.G_FRAC if name in gate_params else K.GLUE_W_FRAC)
        for name, v in pi.items()
    }


def _mla_reals(iw) -> dict[str, np.ndarray]:
    """An MLA layer's integer weights (all Q.16, mla's W_FRAC) as real numbers."""
    names = ("w_dq", "w_q_norm", "w_uq", "w_dkv", "w_kv_norm", "w_uk", "w_uv", "w_g", "w_o")
    return {n: value(getattr(iw, n), MLA.W_FRAC) for n in names}


def _reals(p: dict, frac: int) -> dict[str, np.ndarray]:
    return {name: value(np.asarray(a), frac) for name, a in p.items()}


def _check_attnres(ctx: GateContext, name: str, what: str, att: dict, wq: np.ndarray) -> None:
    want = attnres_ref.attnres(
        value(att["src"], K.RES_FRAC), value(wq, K.RES_FRAC), value(np.int64(EPS_RES), 48)
    )[0]
    ctx.check_reference(
        name,
        f"{what} (AttnRes over {att['src'].shape[0]} sources, Q.24) is within the attnres "
        "module's declared bound of float64 AttnRes on the same integer sources",
        att["h"],
        np.ldexp(want, K.RES_FRAC),
        unit=Q24,
        sources=int(att["src"].shape[0]),
    )


def _layer_references(ctx: GateContext, layer: int, r: dict, p: dict) -> None:
    """Every stage of one layer against float64 on the integers that stage received."""
    kind = "KDA" if r["kind"] == 0 else "Gated MLA"
    if r["att_a"] is not None:
        _check_attnres(ctx, f"L{layer}_attnres_a", f"layer {layer}'s a", r["att_a"], p["wq_a"])
    _check_attnres(ctx, f"L{layer}_attnres_m", f"layer {layer}'s m", r["att_m"], p["wq_m"])
    eps = value(np.int64(EPS_RES), 2 * K.RES_FRAC)
    want_x = ref.rmsnorm(value(r["a"], 24), value(p["attn_norm_w"], K.NORM_W_FRAC), eps)
    want_f = ref.rmsnorm(value(r["att_m"]["h"], 24), value(p["ffn_norm_w"], K.NORM_W_FRAC), eps)
    ctx.check_reference(
        f"L{layer}_norms",
        f"layer {layer}'s two RMSNorms (before {kind} into Q.16, before the FFN into Q.24) are "
        "each within 1/2 + 2^-10 of its own LSB of float64 RMSNorm of the integer a and m",
        np.concatenate([r["xn"].ravel(), r["xf"].ravel()]).astype(np.float64),
        np.concatenate([np.ldexp(want_x, K.X_FRAC).ravel(), np.ldexp(want_f, 24).ravel()]),
        unit="LSB of each output",
    )
    if r["kind"] == 0:
        _kda_references(ctx, layer, r["attn"], r["xn"], p["kda"])
    else:
        _mla_references(ctx, layer, r["attn"], r["xn"], p["mla"])
    f = r["ffn"]
    want = moe_ref.layer(
        value(r["xf"], MOE.X_FRAC), f["idx"], _reals(p["moe"], MOE.W_FRAC),
        RSF_Q / 2.0**MOE.W_FRAC, value(np.int64(EPS_MOE), MOE.EPS_FRAC),
    )  # fmt: skip
    ctx.check_reference(
        f"L{layer}_moe",
        f"layer {layer}'s LatentMoE FFN output ({MOE_N} experts, top-{MOE_K}, latent {MOE_DL}, "
        "plus the shared expert) is within the moe module's declared layer bound of float64 on "
        "the same integer input and routing",
        f["y"],
        np.ldexp(want["y"], MOE.Y_FRAC),
        unit=Q24,
    )
    shift = 1 << (K.RES_FRAC - K.ACT_FRAC)
    want_mid = r["prefix_pushed"] + r["attn"]["y"].astype(np.int64) * shift
    want_out = r["prefix_mid"] + f["y"]
    ctx.check_reference(
        f"L{layer}_residual",
        f"layer {layer}'s two residual adds (prefix += {kind} y moved exactly from Q.20 into "
        "Q.24, prefix += FFN y) are exact",
        np.concatenate([r["prefix_mid"].ravel(), r["prefix_out"].ravel()]).astype(np.float64),
        np.concatenate([want_mid.ravel(), want_out.ravel()]).astype(np.float64),
        unit=Q24,
    )


def _kda_references(ctx: GateContext, layer: int, a: dict, xn: np.ndarray, pi: dict) -> None:
    p = _kda_reals(pi)
    x = value(xn, K.X_FRAC)
    t_len, hd = xn.shape[0], KDA_H * KDA_D
    shape = (t_len, KDA_H, KDA_D)
    act = value(a["act"], K.ACT_FRAC)
    eps_act = value(np.int64(EPS_ACT), 2 * K.ACT_FRAC)
    pairs = [
        (a["pre"], np.ldexp(x @ p["w_qkv"].T, K.ACT_FRAC)),
        (a["g_raw"], np.ldexp(x @ p["w_f"].T, KDA.G_FRAC)),
        (a["act"], np.ldexp(ref.silu(ref.short_conv(value(a["pre"], 20), p["conv"])), 20)),
        (a["qs"], np.ldexp(ref.l2norm(act[:, :hd].reshape(shape), eps_act), QS_FRAC)),
        (a["k"], np.ldexp(ref.l2norm(act[:, hd : 2 * hd].reshape(shape), eps_act), 24)),
        (a["beta"], np.ldexp(ref.sigmoid(x @ p["w_b"].T), KDA.A_FRAC)),
        (
            a["g"],
            np.ldexp(
                kda_ref.gate(value(a["g_raw"], 24).reshape(shape), p["a_head"], p["dt_bias"]),
                KDA.G_FRAC,
            ),
        ),
        (a["alpha"], np.ldexp(np.exp(value(a["g"], KDA.G_FRAC)), KDA.A_FRAC)),
        (a["o_n"], np.ldexp(ref.rmsnorm(value(a["o"], 20), p["head_norm_w"], eps_act), 20)),
    ]
    ctx.check_reference(
        f"L{layer}_kda_pointwise",
        f"layer {layer}'s KDA input and output stages, each from the integers it received: the "
        "q/k/v and gate projections, the 4-tap causal conv with SiLU, the L2 norms of q and k, "
        "beta, K3's gate g and the decay alpha, and the per-head RMSNorm of o, each within "
        "1/2 + 2^-10 of its own LSB of float64",
        np.concatenate([np.asarray(g).ravel() for g, _ in pairs]).astype(np.float64),
        np.concatenate([want.ravel() for _, want in pairs]),
        unit="LSB of each output",
    )
    s0 = np.zeros((KDA_H, KDA_D, KDA_D))
    o_ref, _ = kda_ref.recurrent(
        value(a["qs"], KDA.QK_FRAC), value(a["k"], KDA.QK_FRAC), value(a["v"], KDA.V_FRAC),
        value(a["alpha"], KDA.A_FRAC), value(a["beta"], KDA.A_FRAC), s0,
    )  # fmt: skip
    ctx.check_reference(
        f"L{layer}_kda_recurrent",
        f"layer {layer}'s KDA recurrence ({KDA_H} heads, d_k = d_v = {KDA_D}, {t_len} tokens) is "
        "within the kda module's declared recurrent bound of float64 on the same integer q, k, "
        "v, alpha, beta",
        a["o"],
        np.ldexp(o_ref, KDA.V_FRAC),
        unit=Q20,
    )
    y_ref = mla_ref.output(value(a["o_n"], 20), x, p["w_go"], p["w_o"])[1]
    ctx.check_reference(
        f"L{layer}_kda_output",
        f"layer {layer}'s KDA output y = W_O (o_n ⊙ σ(x W_go)) in Q.20 is within mla's output "
        "bound (without its attention term) of float64 on the same integer o_n and x",
        a["y"],
        np.ldexp(y_ref, K.ACT_FRAC),
        unit=Q20,
    )


def _mla_references(ctx: GateContext, layer: int, a: dict, xn: np.ndarray, iw) -> None:
    p = _mla_reals(iw)
    x = value(xn, MLA.X_FRAC)
    kv = MLA_DIMS["kv_lora"]
    eps = value(np.int64(iw.eps), MLA.EPS_FRAC)
    scale = iw.scale / 2.0**MLA.SCALE_FRAC
    pairs = [
        (a["a_q"], np.ldexp(x @ p["w_dq"].T, MLA.LAT_FRAC)),
        (a["c_q"], np.ldexp(mla_ref.rmsnorm(value(a["a_q"], 20), p["w_q_norm"], eps), 16)),
        (a["q"], np.ldexp(scale * value(a["c_q"], 16) @ p["w_uq"].T, 20).reshape(a["q"].shape)),
        (a["a_kv"], np.ldexp(x @ p["w_dkv"][:kv].T, MLA.LAT_FRAC)),
        (a["c_kv"], np.ldexp(mla_ref.rmsnorm(value(a["a_kv"], 20), p["w_kv_norm"], eps), 16)),
        (a["k_r"], np.ldexp(x @ p["w_dkv"][kv:].T, MLA.C_FRAC)),
    ]
    ctx.check_reference(
        f"L{layer}_mla_latent",
        f"layer {layer}'s Gated MLA latent projections and LoRA RMSNorms (a_Q, c_Q, q, a_KV, "
        "c_KV, k_R), each from the integers it received, within 1/2 + 2^-10 of its own LSB of "
        "float64",
        np.concatenate([np.asarray(g).ravel() for g, _ in pairs]).astype(np.float64),
        np.concatenate([want.ravel() for _, want in pairs]),
        unit="LSB of each output",
    )
    o_ref = mla_ref.attention_naive(
        value(a["q"], MLA.Q_FRAC), value(a["c_kv"], MLA.C_FRAC), value(a["k_r"], MLA.C_FRAC),
        p["w_uk"], p["w_uv"],
    )  # fmt: skip
    ctx.check_reference(
        f"L{layer}_mla_attention",
        f"layer {layer}'s causal NoPE attention o ({MLA_DIMS['H']} heads, kv_lora "
        f"{MLA_DIMS['kv_lora']}, rope {MLA_DIMS['rope']}) is within mla's declared attention "
        "bound of float64 on the same integer q, c_KV, k_R",
        a["o"],
        np.ldexp(o_ref, MLA.O_FRAC),
        unit=Q20,
    )
    y_ref = mla_ref.output(o_ref, x, p["w_g"], p["w_o"])[1]
    ctx.check_reference(
        f"L{layer}_mla_output",
        f"layer {layer}'s Gated MLA output y = W_O (o ⊙ σ(x W_g)) is within mla's declared "
        "output bound of float64 attention, gate and o_proj on the same integer q, c_KV, k_R, x",
        a["y"],
        np.ldexp(y_ref, MLA.O_FRAC),
        unit=Q20,
    )


def _amax(a: np.ndarray, frac: int) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64)).max()) / 2.0**frac


def _saturations(ctx: GateContext, rec: dict) -> None:
    """Zero saturations in every kernel of every layer; the activation range per layer."""
    rows, total = [], 0
    for index, r in enumerate(rec["layers"]):
        sat = sum(r["sat"].values())
        total += sat
        a = r["attn"]
        state = _amax(a["S"], KDA.V_FRAC) if r["kind"] == 0 else float("nan")
        rows.append([
            index + 1, "KDA" if r["kind"] == 0 else "Gated MLA",
            _amax(r["a"], 24), _amax(r["xn"], 16), _amax(a["y"], 20), _amax(r["att_m"]["h"], 24),
            _amax(r["xf"], 24), _amax(r["ffn"]["y"], 24), _amax(r["prefix_out"], 24), state, sat,
        ])  # fmt: skip
    total += rec["final"]["sat"]
    ctx.artifact(
        "table:activation range per layer (max |value|, real units)",
        {
            "columns": [
                "layer",
                "kind",
                "a",
                "attn input",
                "attn y",
                "m",
                "FFN input",
                "FFN y",
                "prefix",
                "KDA max |S|",
                "saturations",
            ],
            "rows": rows,
        },
    )
    ctx.check(
        "no_saturation",
        "no value saturated anywhere in the block: the projections, conv, KDA state and w, MLA "
        "scores and outputs, the RMSNorms, AttnRes scores and the residual stream (|prefix| "
        "<= 64), on every layer; the range of every stored activation per layer is charted",
        total == 0,
        saturations=total,
        max_abs_prefix=max(row[8] for row in rows),
        max_abs_attn_y=max(row[4] for row in rows),
    )


def _domain(ctx: GateContext, rec: dict, w: dict) -> None:
    """The premises of each module's bound, measured on the data this gate ran."""
    v: dict[str, float] = {"max_acc_shift": max(r["acc_shift"] for r in rec["layers"])}
    kda_k, kda_q, kda_w, l2_sum, o_n, wo_l1 = 0.0, 0.0, 0.0, 0, 0.0, 0.0
    mla_v, moe = 0.0, {"x": 0.0, "z": 0.0, "E": 0.0, "chosen": 1e9, "rms_c": 1e9}
    for r, p in zip(rec["layers"], w["layers"], strict=True):
        a = r["attn"]
        if r["kind"] == 0:
            k = a["k"].astype(np.float64) / 2.0**KDA.QK_FRAC
            q = a["qs"].astype(np.float64) / 2.0**KDA.QK_FRAC
            kda_k = max(kda_k, float((k * k).sum(axis=-1).max()))
            kda_q = max(kda_q, float((q * q).sum(axis=-1).max()) * KDA_D)
            kda_w = max(kda_w, int(a["kda_stats"][2]) / 2.0**KDA.V_FRAC)
            pre = a["act"].astype(np.float64)
            l2_sum = max(l2_sum, float((pre * pre).reshape(-1, KDA_D).sum(axis=1).max()))
            o_n = max(o_n, _amax(a["o_n"], K.ACT_FRAC))
            wo_l1 = max(wo_l1, float(np.abs(value(p["kda"]["w_o"], 16)).sum(axis=1).max()))
        else:
            iw = p["mla"]
            vv = np.einsum("hij,sj->shi", value(iw.w_uv, 16), value(a["c_kv"], 16))
            mla_v = max(mla_v, float(np.abs(vv).max()))
            wo_l1 = max(wo_l1, float(np.abs(value(iw.w_o, 16)).sum(axis=1).max()))
        f, pm = r["ffn"], _reals(p["moe"], MOE.W_FRAC)
        x = value(r["xf"], MOE.X_FRAC)
        z = x @ pm["w_down"].T
        e_out = moe_ref.expert_outputs(z, f["idx"], pm["w1"], pm["w3"], pm["w2"])
        s = moe_ref.scores(x, pm["w_r"])
        c = value(f["c"], MOE.A_FRAC)
        moe["x"] = max(moe["x"], float(np.abs(x).max()))
        moe["z"] = max(moe["z"], float(np.abs(z).max()))
        moe["E"] = max(moe["E"], float(np.abs(e_out).max()))
        moe["chosen"] = min(moe["chosen"], float(np.take_along_axis(s, f["idx"], 1).sum(1).min()))
        moe["rms_c"] = min(moe["rms_c"], float(np.sqrt(np.mean(c * c, axis=1)).min()))
    moe_l1 = max(
        max(np.abs(a).sum(axis=-1).max(), np.abs(a).sum(axis=-2).max())
        for p in w["layers"]
        for name, a in _reals(p["moe"], MOE.W_FRAC).items()
        if name != "w_n"
    )
    moe_wn = max(float(np.abs(value(p["moe"]["w_n"], MOE.W_FRAC)).max()) for p in w["layers"])
    v.update(
        kda_max_k_norm_sq=kda_k, kda_max_dk_q_norm_sq=kda_q, kda_max_abs_w=kda_w,
        kda_l2_max_sum_sq_raw_log2=float(np.log2(max(l2_sum, 1.0))), kda_max_abs_o_n=o_n,
        max_row_l1_w_o=wo_l1, mla_max_abs_v=mla_v, moe_max_abs_x=moe["x"],
        moe_max_abs_z=moe["z"], moe_max_abs_E=moe["E"], moe_min_chosen_sum=moe["chosen"],
        moe_min_rms_c=moe["rms_c"], moe_max_weight_l1=float(moe_l1), moe_max_abs_w_n=moe_wn,
    )  # fmt: skip
    ok = (
        kda_k <= QK_NORM_SLACK and kda_q <= QK_NORM_SLACK
        and kda_w <= KDA.W_DOMAIN / 2.0**KDA.V_FRAC and l2_sum < 2.0**62
        and o_n < 2**MLA.V_MAX_BITS and wo_l1 <= 2**MLA.WO_L1_BITS
        and mla_v <= 2**MLA.V_MAX_BITS
        and moe["x"] <= MOE.X_MAX and moe["z"] <= MOE.Z_MAX and moe["E"] <= MOE.E_MAX
        and moe["chosen"] >= 1 / MOE.S_MIN_INV and moe["rms_c"] >= 1 / MOE.RMS_MIN_INV
        and moe_l1 <= MOE.W_L1_MAX and moe_wn <= MOE.NORM_W_MAX and RSF <= MOE.RSF_MAX
    )  # fmt: skip
    ctx.check(
        "in_domain",
        "every stage's inputs lie in the domain its module's bound is stated for: KDA keys "
        "||k||^2 <= 1 and ||scale q||^2 <= 1/d_k (to 2^-20 relative, which the recurrent "
        "bound's rounding-up covers), |w| <= 16, the L2 norms' exact sums below 2^62; the "
        "output gates' |o| < 16 and W_O row L1 <= 16; MLA |W_UV c| <= 16; the MoE's |x| <= 8, "
        "|z| <= 8, |E| <= 16, weight L1 <= 8, |w_n| <= 2, rsf <= 4, chosen scores >= 1/16, "
        "rms(c) >= 1/16",
        ok,
        **v,
    )


def _routing(ctx: GateContext, rec: dict, w: dict) -> None:
    """Outside the rounding band the integer top-k chooses float64's experts."""
    agree, band, tokens, min_gap = True, 0, 0, float("inf")
    for r, p in zip(rec["layers"], w["layers"], strict=True):
        s = moe_ref.scores(value(r["xf"], MOE.X_FRAC), value(p["moe"]["w_r"], MOE.W_FRAC))
        gap = moe_ref.kth_gap(s, MOE_K) * 2.0**MOE.S_FRAC
        inside = gap <= MOE.SELECT_BAND_LSB
        same = [
            set(a) == set(b)
            for a, b in zip(
                r["ffn"]["idx"].tolist(), moe_ref.select(s, MOE_K).tolist(), strict=True
            )
        ]
        agree &= bool(np.all(np.array(same) | inside))
        band += int(inside.sum())
        tokens += len(same)
        min_gap = min(min_gap, float(gap.min()))
    ctx.check(
        "routing_matches_float64",
        "on every layer, outside the rounding band (2 LSB of Q.40) the integer router chooses "
        "the same top-k experts as float64 on the same integer input",
        agree,
        tokens=tokens,
        band_tokens=band,
        min_gap_lsb=min_gap,
    )


def _causal(ctx: GateContext, m: dict, w: dict, rec: dict) -> None:
    """Changing tokens t0+1.. leaves every output of tokens 0..t0 bit-identical."""
    t0 = T_BLOCK // 2 - 1
    emb = w["emb"].copy()
    rng = np.random.default_rng(BLOCK_SEED + 1)
    emb[t0 + 1 :] = _q(np.clip(rng.standard_normal((T_BLOCK - t0 - 1, D_BLOCK)), -6, 6), 24)
    other = run_block(m, w, np.ascontiguousarray(emb))
    before = all(
        np.array_equal(a[: t0 + 1], b[: t0 + 1])
        for a, b in zip(block_outputs(rec), block_outputs(other), strict=True)
    )
    after = not np.array_equal(rec["final"]["h"][t0 + 1 :], other["final"]["h"][t0 + 1 :])
    ctx.check(
        "causal",
        f"replacing the embeddings of tokens {t0 + 1}..{T_BLOCK - 1} leaves every layer's a, "
        f"attention y, m, FFN y, prefix and the final output of tokens 0..{t0} bit-identical "
        "(and the later tokens' outputs do change)",
        before and after,
        unchanged_prefix=before,
        later_changed=after,
        t0=t0,
    )


def _deterministic(ctx: GateContext, m: dict, w: dict, rec: dict) -> None:
    absorbed = run_block(m, w, w["emb"], mla_path="absorbed")
    ctx.check_deterministic(
        "deterministic",
        "the whole block with the MLA layer on its naive path, and again on its absorbed path (a "
        "different association of its sums: scores (W_UK^T q)·c, outputs W_UV Σ p c, where "
        "float sums would differ), gives bit-identical outputs on every layer",
        {
            "MLA naive path (the gate's run)": block_outputs(rec),
            "MLA absorbed path": block_outputs(absorbed),
        },
    )


def _threads(ctx: GateContext, w: dict, rec: dict) -> None:
    """The block's parallel kernels, on the block's own data, with 1 and 2 OpenMP threads in
    fresh processes. (k3gates.k3block.kernels, the glue, holds no parallel loop of its own.)"""
    kda_l, mla_l, moe_l = rec["layers"][0], rec["layers"][3], rec["layers"][0]
    a, iw, f = kda_l["attn"], w["layers"][3]["mla"], moe_l["ffn"]
    pm = w["layers"][0]["moe"]
    s0 = np.zeros((KDA_H, KDA_D, KDA_D), dtype=np.int32)
    fin = rec["final"]
    for name, module, func, what, args in (
        (
            "threads_kda",
            "kda",
            "kda_recurrent",
            f"layer 1's KDA recurrence ({KDA_H} heads in parallel)",
            (a["qs"], a["k"], a["v"], a["alpha"], a["beta"], s0),
        ),
        (
            "threads_mla",
            "mla",
            "mla_attend_naive",
            f"layer 4's Gated MLA attention ({MLA_DIMS['H']} heads in parallel)",
            (mla_l["attn"]["q"], mla_l["attn"]["c_kv"], mla_l["attn"]["k_r"], iw.w_uk, iw.w_uv),
        ),
        (
            "threads_moe",
            "moe",
            "moe_layer",
            f"layer 1's LatentMoE FFN ({T_BLOCK} tokens in parallel)",
            (
                kda_l["xf"], f["idx"], f["wts"], pm["w_down"], pm["w1"], pm["w3"], pm["w2"],
                pm["w_n"], EPS_MOE, pm["w_up"], pm["ws1"], pm["ws3"], pm["ws2"],
            ),
        ),
        (
            "threads_attnres",
            "attnres",
            "attnres_forward",
            f"the final AttnRes over {fin['src'].shape[0]} sources",
            (fin["src"], w["final_w"], EPS_RES, K.RES_FRAC, K.RES_FRAC),
        ),
    ):  # fmt: skip
        ctx.check_threads(
            name,
            f"{what}, on the block's own data, gives the same bits with 1 and 2 OpenMP threads, "
            f"each in a fresh process (`{func}` has an `omp parallel for`)",
            func,
            *args,
            modname=KERNEL_MODULES[module],
        )


def _block_contract(ctx: GateContext, m: dict, w: dict, rec: dict) -> None:
    """compiled == interpreted: each glue kernel on the gate's own inputs and with a limit low
    enough to saturate, then the whole block with every module interpreted."""
    r, p = rec["layers"][0], w["layers"][0]
    a = r["attn"]
    glue = "k3gates.k3block.kernels"
    run = lambda name, *args, inputs: ctx.check_compiled_matches_interpreted(
        name, *args, inputs=inputs, modname=glue
    )
    real = "the gate's real inputs: layer 1's"
    sat = "a limit low enough that some outputs saturate, which reaches the clamp's both sides"
    for suffix, lim, how in (
        ("", I32_MAX, "at the gate's limit (no saturation)"),
        ("_saturating", 1 << 16, sat),
    ):
        run(
            f"compiled_conv_silu{suffix}",
            "conv_silu",
            a["pre"],
            p["kda"]["conv"],
            lim,
            inputs=f"{real} q/k/v pre-activations ({a['pre'].shape[0]} tokens, the first 3 with "
            f"the causal zero rows), {how}",
        )
    run(
        "compiled_head_sigmoid",
        "head_sigmoid",
        r["xn"],
        p["kda"]["w_b"],
        inputs=f"{real} normed input and beta weights (logits of both signs)",
    )
    x16 = r["a"] * 16  # |x_raw| < 2^31, the kernel's domain: rows need acc_shift > 0
    for suffix, x, lim, how in (
        ("", r["a"], X_LIM, "layer 1's a (the embedding), at the gate's limit"),
        (
            "_saturating",
            x16,
            1 << 18,
            "layer 1's a times 16 (raw below 2^31, the kernel's domain), so that rows need "
            f"acc_shift > 0, and {sat}",
        ),
    ):
        run(
            f"compiled_norm_rows{suffix}",
            "norm_rows",
            x,
            p["attn_norm_w"],
            EPS_RES,
            K.RES_FRAC,
            K.NORM_W_FRAC,
            K.X_FRAC,
            lim,
            inputs=f"the gate's real inputs: {how} with the attention-norm weights"
            if not suffix
            else f"the gate's inputs scaled: {how}",
        )
    r2 = rec["layers"][1]  # layer 2 adds onto a non-zero prefix (layer 1's starts at zero)
    y = r2["attn"]["y"].astype(np.int64)
    for suffix, lim, how in (
        ("", K.RES_LIM, "at the stream's limit"),
        ("_saturating", 1 << 24, sat),
    ):
        run(
            f"compiled_residual_add{suffix}",
            "residual_add",
            r2["prefix_pushed"],
            y,
            4,
            lim,
            inputs=f"the gate's real inputs: layer 2's prefix and KDA output y (shift 4, Q.20 "
            f"into Q.24), {how}",
        )
    interp = {key: ctx.interpreted(name) for key, name in KERNEL_MODULES.items()}
    t0 = time.perf_counter()
    raised = ""
    try:  # NumPy overflow is an error here, as in check_compiled_matches_interpreted
        with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise"):
            warnings.simplefilter("error", RuntimeWarning)
            slow = run_block(interp, w, w["emb"])
    except (ArithmeticError, RuntimeWarning, OverflowError, ValueError) as e:
        raised, slow = f"the interpreted run raised {type(e).__name__}: {e}", None
    t1 = time.perf_counter()
    run_block(m, w, w["emb"])
    t2 = time.perf_counter()
    same = slow is not None and bit_equal(block_outputs(rec), block_outputs(slow))
    digests = {"compiled": digest(*block_outputs(rec))}
    if slow is not None:
        digests["interpreted"] = digest(*block_outputs(slow))
    ctx.check(
        "compiled_block",
        "the whole block with every kernels module Pythran-compiled and with the same sources "
        "under CPython gives bit-identical outputs on every layer, on the gate's real inputs, "
        "with NumPy overflow an error",
        same,
        kind="compiled",
        message=raised or "outputs differ",
        digests=digests,
        seconds=t2 - t0,
        inputs="the gate's real inputs: the whole block",
        compiled_s=t2 - t1,
        interpreted_s=t1 - t0,
        speed_ratio=(t1 - t0) / max(t2 - t1, 1e-9),
    )


def _drift(ctx: GateContext, w: dict, rec: dict) -> None:
    """The whole block in float64 from the float embedding, for the page: how far the integer
    block ends from it. No bound is claimed: rounding errors pass through nonlinear stages, and
    near-tie routing may differ; the bounded checks are the per-stage ones above."""
    layers = []
    for p in w["layers"]:
        q = {"kind": p["kind"], "wq_a": value(p["wq_a"], 24), "wq_m": value(p["wq_m"], 24),
             "attn_norm_w": value(p["attn_norm_w"], 24), "ffn_norm_w": value(p["ffn_norm_w"], 24),
             "moe": _reals(p["moe"], MOE.W_FRAC)}  # fmt: skip
        if p["kind"] == 0:
            q["kda"] = _kda_reals(p["kda"])
        else:
            q["mla"] = _mla_reals(p["mla"])
        layers.append(q)
    cfg = {
        "block_size": BLOCK_SIZE, "eps": value(np.int64(EPS_RES), 48),
        "l2_eps": value(np.int64(EPS_ACT), 40), "n_heads": KDA_H, "mla_heads": MLA_DIMS["H"],
        "mla_eps": value(np.int64(EPS_MLA), MLA.EPS_FRAC),
        "mla_scale": w["layers"][-1]["mla"].scale / 2.0**MLA.SCALE_FRAC, "k": MOE_K,
        "rsf": RSF_Q / 2.0**MOE.W_FRAC, "moe_eps": value(np.int64(EPS_MOE), MOE.EPS_FRAC),
    }  # fmt: skip
    want = ref.block(value(w["emb"], 24), layers, value(w["final_w"], 24), cfg)
    err = np.abs(rec["final"]["h"] - np.ldexp(want, K.RES_FRAC))
    ctx.artifact(
        "table:end-to-end drift from the float64 block (no bound claimed)",
        {
            "columns": ["output", "max |integer - float64| (LSB of Q.24)", "max |float64|"],
            "rows": [["final AttnRes", float(err.max()), float(np.abs(want).max())]],
        },
    )
