"""Gated MLA gates: the latent projections (PARTIAL), the gated forward with naive == absorbed and
decode == forward bit for bit (HAVE), and the backward (STRONG). Bounds come from
k3gates/mla/kernels.py, declared before any run.

Test dimensions (SHAPE): T 64, H 4, D 64, q_lora 48, kv_lora 64, rope 16, nope 32, d_v 32.
K3's (K3_SHAPE): H 96, q_lora 1536, kv_lora 512, nope 128, rope 64, d_v 128, D 7168.
"""

from __future__ import annotations

import math

import numpy as np

from k3gates.fx import quantize, value
from k3gates.fx.checks import check_compiled, lsb
from k3gates.infra.gate import GateContext, gate

from ..fx import host
from . import (
    IntWeights,
    LatentCache,
    MLAWeights,
    backward_int,
    decode_int,
    forward_int,
    project_int,
)
from . import kernels as K
from . import reference as ref

SEED = 20240507
SHAPE = {"T": 64, "H": 4, "D": 64, "q_lora": 48, "kv_lora": 64, "rope": 16, "nope": 32, "d_v": 32}
TINY = {"T": 6, "H": 2, "D": 12, "q_lora": 10, "kv_lora": 16, "rope": 4, "nope": 8, "d_v": 8}
K3_SHAPE = {"H": 96, "q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "d_v": 128,
            "D": 7168}  # fmt: skip
EPS = 1e-6
LOUD = 60.0  # rows of x scaled by this reach |a| ~ 2^8, where the RMSNorms need acc_shift > 0
Q20 = "LSB (2^-20)"
Q16 = "LSB (2^-16)"


# == problems ===================================================================================
def random_weights(rng: np.random.Generator, d: dict[str, int], sharp: float = 2.0) -> dict:
    """Float weights at std 1/sqrt(fan_in) (W_UQ `sharp` times that, so the softmax is not flat),
    norm weights 1 + 0.1 N(0, 1)."""
    h, dqk = d["H"], d["nope"] + d["rope"]

    def lin(rows, cols, gain=1.0):
        return rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)

    return {
        "w_dq": lin(d["q_lora"], d["D"]),
        "w_q_norm": 1 + 0.1 * rng.standard_normal(d["q_lora"]),
        "w_uq": lin(h * dqk, d["q_lora"], sharp),
        "w_dkv": lin(d["kv_lora"] + d["rope"], d["D"]),
        "w_kv_norm": 1 + 0.1 * rng.standard_normal(d["kv_lora"]),
        "w_uk": rng.standard_normal((h, d["nope"], d["kv_lora"])) / np.sqrt(d["kv_lora"]),
        "w_uv": rng.standard_normal((h, d["d_v"], d["kv_lora"])) / np.sqrt(d["kv_lora"]),
        "w_g": lin(h * d["d_v"], d["D"]),
        "w_o": lin(d["D"], h * d["d_v"]),
    }


def problem(seed: int, d: dict[str, int]) -> tuple[np.ndarray, IntWeights]:
    """(x int32 [T, D] Q.16, the quantised weights) from a seed; x ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    w = MLAWeights(**random_weights(rng, d), eps=EPS).ints
    x = rng.standard_normal((d["T"], d["D"]))
    return np.ascontiguousarray(quantize(x, K.X_FRAC).astype(np.int32)), w


def reals(iw: IntWeights) -> dict[str, np.ndarray]:
    """The real values the integer weights stand for (the reference's inputs)."""
    names = ("w_dq", "w_q_norm", "w_uq", "w_dkv", "w_kv_norm", "w_uk", "w_uv", "w_g", "w_o")
    return {n: value(getattr(iw, n), K.W_FRAC) for n in names}


def rshift_round_np(a: np.ndarray, s: int) -> np.ndarray:
    """fx.rshift_round over an int64 array (half away from zero), for exact checks in numpy."""
    y = a - (a < 0)
    return (y >> s) + ((y >> (s - 1)) & 1)


def attention_reference(r: dict, iw: IntWeights) -> np.ndarray:
    """float64 attention on the kernel's own integer q, c_KV, k_R and weights."""
    w = reals(iw)
    return ref.attention_naive(
        value(r["q"], K.Q_FRAC),
        value(r["c_kv"], K.C_FRAC),
        value(r["k_r"], K.C_FRAC),
        w["w_uk"],
        w["w_uv"],
    )


# == PARTIAL: the latent projections and their RMSNorms ==========================================
@gate(
    "mla_latent",
    innovation="gatedmla",
    level="PARTIAL",
    kernels=["k3gates.mla.kernels"],
    bounds={
        "a_q": lsb(K.LINEAR_MAX_ERR_LSB_Q10),
        "a_kv": lsb(K.LINEAR_MAX_ERR_LSB_Q10),
        "k_r": lsb(K.LINEAR_MAX_ERR_LSB_Q10),
        "c_q": lsb(K.RMSNORM_MAX_ERR_LSB_Q10),
        "c_kv": lsb(K.RMSNORM_MAX_ERR_LSB_Q10),
        "q": lsb(K.QUERY_MAX_ERR_LSB_Q10),
        "up_k_c": lsb(K.UP_MAX_ERR_LSB_Q10),
        "up_v": lsb(K.UP_MAX_ERR_LSB_Q10),
    },
    timeout=300,
)
def mla_latent(ctx: GateContext) -> None:
    """The LoRA down/up projections and their RMSNorms, each stage within its declared bound of
    float64 applied to that stage's own integer input."""
    k = ctx.compiled()
    xq, iw = problem(SEED, SHAPE)
    loud = np.arange(0, SHAPE["T"], 8)
    xq[loud] = quantize(value(xq[loud], K.X_FRAC) * LOUD, K.X_FRAC)  # exercise acc_shift > 0
    r = project_int(k, xq, iw)
    a_q, c_q, q, a_kv, c_kv, k_r = (r[n] for n in ("a_q", "c_q", "q", "a_kv", "c_kv", "k_r"))
    sat = r["sat"]
    w = reals(iw)
    x = value(xq, K.X_FRAC)
    eps = iw.eps / 2.0**K.EPS_FRAC
    kv_lora, d_qk = SHAPE["kv_lora"], SHAPE["nope"] + SHAPE["rope"]
    stages = (
        ("a_q", a_q, x @ w["w_dq"].T, K.LAT_FRAC, "a_Q = W_DQ x in Q.20"),
        ("a_kv", a_kv, (x @ w["w_dkv"].T)[:, :kv_lora], K.LAT_FRAC, "a_KV = W_DKV x in Q.20"),
        ("k_r", k_r, (x @ w["w_dkv"].T)[:, kv_lora:], K.C_FRAC, "k_R (unrotated) in Q.16"),
        ("c_q", c_q, ref.rmsnorm(value(a_q, K.LAT_FRAC), w["w_q_norm"], eps), K.C_FRAC,
         "c_Q = RMSNorm(a_Q) w_q in Q.16"),
        ("c_kv", c_kv, ref.rmsnorm(value(a_kv, K.LAT_FRAC), w["w_kv_norm"], eps), K.C_FRAC,
         "c_KV = RMSNorm(a_KV) w_kv in Q.16"),
        ("q", q.reshape(len(x), -1),
         host.inv_sqrt(d_qk) * value(c_q, K.C_FRAC) @ w["w_uq"].T, K.Q_FRAC,
         "q = 192^-1/2-style scale × W_UQ c_Q in Q.20"),
    )  # fmt: skip
    for name, got, want, frac, what in stages:
        ctx.check_reference(
            name,
            f"{what} is within the declared bound of float64 on the kernel's own integer input",
            np.asarray(got, dtype=np.float64),
            np.ldexp(want, frac),
            unit=f"LSB (2^-{frac})",
        )
    k_c, v = k.mla_up(c_kv, iw.w_uk, iw.w_uv)
    cr = value(c_kv, K.C_FRAC)
    for name, got, wt in (("up_k_c", k_c, w["w_uk"]), ("up_v", v, w["w_uv"])):
        ctx.check_reference(
            name,
            f"the up-projection {'W_UK' if name == 'up_k_c' else 'W_UV'} c_KV is exact in Q.32 "
            "(float64 holds these sums exactly: < 2^53)",
            np.asarray(got, dtype=np.float64),
            np.ldexp(np.einsum("hij,sj->shi", wt, cr), K.W_FRAC + K.C_FRAC),
            unit="LSB (2^-32)",
        )
    shifts = [_norm_shift(a) for a in (a_q, a_kv)]
    ctx.check(
        "in_range",
        "no value saturated, and the loud rows really took the RMSNorm's acc_shift > 0 branch",
        sat == 0 and min(max(s) for s in shifts) > 0,
        saturations=int(sat),
        max_acc_shift_q=max(shifts[0]),
        max_acc_shift_kv=max(shifts[1]),
    )
    _latent_contract(ctx, k, xq, iw, r)
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    ctx.evidence(
        f"projections and LoRA RMSNorms within {worst:.3f} LSB of float64 per stage "
        f"(T={SHAPE['T']}, kv_lora={kv_lora}, q_lora={SHAPE['q_lora']}); up-projections exact"
    )


def _norm_shift(a: np.ndarray) -> list[int]:
    n = a.shape[1]
    return [max(0, 2 * int(np.abs(row).max()).bit_length() + n.bit_length() - 61) for row in a]


def _latent_contract(ctx: GateContext, k, xq: np.ndarray, iw: IntWeights, r: dict) -> None:
    real = (
        f"the gate's real inputs ({SHAPE['T']} rows of D = {SHAPE['D']}, every 8th row loud, so "
        "the RMSNorm takes acc_shift > 0 there)"
    )
    kv_lora = SHAPE["kv_lora"]
    shift = 2 * K.X_FRAC - K.LAT_FRAC
    check_compiled(ctx, "compiled_linear", "mla_linear", xq, iw.w_dq, shift, K.A_LIM, inputs=real)
    check_compiled(
        ctx, "compiled_linear_k_r", "mla_linear", xq, np.ascontiguousarray(iw.w_dkv[kv_lora:]),
        2 * K.X_FRAC - K.C_FRAC, K.C_LIM, inputs=real,
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_rmsnorm", "mla_rmsnorm", r["a_q"], iw.w_q_norm, iw.eps, inputs=real
    )
    check_compiled(ctx, "compiled_query", "mla_query", r["c_q"], iw.w_uq, iw.scale, inputs=real)
    check_compiled(ctx, "compiled_up", "mla_up", r["c_kv"], iw.w_uk, iw.w_uv, inputs=real)
    perm = np.random.default_rng(SEED + 1).permutation(xq.shape[0])
    inv = np.argsort(perm)
    names = ("a_q", "c_q", "q", "a_kv", "c_kv", "k_r")
    split = 23  # not a multiple of the loud rows' stride: both blocks hold loud and quiet rows

    def run(xs: np.ndarray) -> tuple:
        r = project_int(k, np.ascontiguousarray(xs), iw)
        return tuple(r[n] for n in names)

    ctx.check_deterministic(
        "deterministic",
        "the latents of all rows in one call, of the rows in a shuffled order (un-shuffled "
        f"afterwards), and of the rows in two calls split at row {split} are bit-identical: each "
        "row's projections and RMSNorms depend on that row alone, not on its neighbours or on "
        "how the rows are batched",
        {
            "all rows in one call": run(xq),
            "rows shuffled, un-shuffled after": tuple(a[inv] for a in run(xq[perm])),
            f"two calls, rows 0..{split - 1} and {split}..": tuple(
                np.concatenate([a, b])
                for a, b in zip(run(xq[:split]), run(xq[split:]), strict=True)
            ),
        },
    )


# == an exact big-integer model of the attention arithmetic (for headroom and edge checks) ======
def _cummax(terms: np.ndarray, axis: int) -> int:
    """max |partial sum| along `axis` of an object (Python int) array: exact, any size."""
    if terms.size == 0:
        return 0
    return int(np.abs(np.cumsum(terms, axis=axis)).max())


def _round_py(total: np.ndarray, s: int) -> np.ndarray:
    """Half away from zero, on Python ints (object arrays)."""
    a = np.abs(total)
    q = (a + (1 << (s - 1))) >> s
    return np.where(total >= 0, q, -q)


def exact_attention(k, q, c_kv, k_r, w_uk, w_uv) -> tuple[np.ndarray, dict[str, int]]:
    """o [T, H, d_v] computed with Python integers, following the module docstring's equations,
    with fx's softmax (through the kernels' mla_softmax) on the exact scores; and the largest
    |partial sum| each int64 limb accumulator of either path reaches (and the unsplit totals).

    This model never splits a product into limbs to get its answer: it forms the exact score and
    value totals as Python integers and rounds them once, so it checks the kernels' limb code.
    """

    def obj(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, dtype=np.int64).astype(object)

    t_len, n_h = q.shape[0], q.shape[1]
    nope = w_uk.shape[1]
    qo, co, ro = obj(q), obj(c_kv), obj(k_r)
    mx = {key: 0 for key in ("score_naive", "score_absorbed", "value_naive", "value_absorbed",
                             "lat", "score_total", "value_total")}  # fmt: skip
    o = np.zeros((t_len, n_h, w_uv.shape[1]), dtype=np.int64)
    ms, mv = (1 << K.SCORE_LIMB) - 1, (1 << K.VALUE_LIMB) - 1
    for h in range(n_h):
        wk, wv = obj(w_uk[h]), obj(w_uv[h])
        k_c = co @ wk.T  # [T, nope], exact
        v = co @ wv.T  # [T, d_v]
        qa = qo[:, h, :nope] @ wk  # [T, kv_lora]
        for t in range(t_len):
            qc, qr = qo[t, h, :nope], qo[t, h, nope:]
            rope = ro[: t + 1] @ qr  # [t + 1]
            total = k_c[: t + 1] @ qc + rope * (1 << K.W_FRAC)
            for terms in (qc * (k_c[: t + 1] >> K.SCORE_LIMB), qc * (k_c[: t + 1] & ms)):
                mx["score_naive"] = max(mx["score_naive"], _cummax(terms, 1))
            for terms in (co[: t + 1] * (qa[t] >> K.SCORE_LIMB), co[: t + 1] * (qa[t] & ms)):
                mx["score_absorbed"] = max(mx["score_absorbed"], _cummax(terms, 1))
            mx["score_total"] = max(mx["score_total"], int(np.abs(total).max()))
            top = total >> K.SCORE_LIMB
            z = np.where(top >= K.SCORE_HI_SAT, K.Z_LIM,
                         np.where(top <= -K.SCORE_HI_SAT, -K.Z_LIM,
                                  _round_py(total, K.SCORE_SHIFT)))  # fmt: skip
            # audit: Python ints
            p = k.mla_softmax(np.asarray(z, dtype=np.int64).reshape(1, -1))[0].astype(object)
            vt = p @ v[: t + 1]  # exact value totals [d_v]
            mx["value_total"] = max(mx["value_total"], int(np.abs(vt).max()))
            pv = p[:, None]
            for terms in (pv * (v[: t + 1] >> K.VALUE_LIMB), pv * (v[: t + 1] & mv)):
                mx["value_naive"] = max(mx["value_naive"], _cummax(terms, 0))
            lat_terms = p[:, None] * co[: t + 1]
            mx["lat"] = max(mx["lat"], _cummax(lat_terms, 0))
            lat = lat_terms.sum(axis=0)
            for terms in (wv * (lat >> K.VALUE_LIMB), wv * (lat & mv)):
                mx["value_absorbed"] = max(mx["value_absorbed"], _cummax(terms, 1))
            ot = _round_py(vt, K.VALUE_SHIFT)
            # audit: Python ints
            o[t, h] = np.array([max(-K.O_LIM, min(int(x), K.O_LIM)) for x in ot], dtype=np.int64)
    return o.astype(np.int32), mx  # audit: exact integers


# == HAVE: the gated forward ====================================================================
T_HAVE = SHAPE["T"]


@gate(
    "mla_forward",
    innovation="gatedmla",
    level="HAVE",
    kernels=["k3gates.mla.kernels"],
    bounds={
        "attention_reference": lsb(K.attend_bound_q10(T_HAVE)),
        "gated_reference": lsb(K.GATED_MAX_ERR_LSB_Q10),
        "output_reference": lsb(K.output_bound_q10(T_HAVE)),
    },
    timeout=300,
)
def mla_forward(ctx: GateContext) -> None:
    """The Gated MLA layer: naive == absorbed and token-by-token decode == the full forward, bit
    for bit; the attention, the gate and o_proj within their declared bounds of float64."""
    k = ctx.compiled()
    xq, iw = problem(SEED + 1, SHAPE)
    naive = forward_int(k, xq, iw, "naive")
    absorbed = forward_int(k, xq, iw, "absorbed")
    dec, cache = _decode_all(k, xq, iw)
    _references(ctx, naive, xq, iw)
    _in_domain(ctx, k, naive, iw, dec)
    same = {n: bool(np.array_equal(naive[n], absorbed[n])) for n in ("o", "gated", "y")}
    ctx.check(
        "naive_equals_absorbed",
        "the naive path (per-head keys W_UK c and values W_UV c materialised) and the absorbed "
        "path "
        "(scores (W_UK^T q_C)·c_KV, outputs W_UV Σ p c) give bit-identical o, gated o and y",
        all(same.values()),
        **same,
    )
    same = {n: bool(np.array_equal(naive[n], dec[n])) for n in ("o", "gated", "y", "c_kv", "k_r")}
    ctx.check(
        "decode_equals_forward",
        f"decoding the {T_HAVE} tokens one by one, each appended to a growing latent cache and "
        "attending over it (absorbed path), gives bit-identical o, gated o and y to the "
        "full-sequence forward (naive path), and the cache holds exactly the forward's c_KV, k_R",
        all(same.values()),
        **same,
        cache_rows=cache.length,
        cache_capacity=int(cache.c_kv.shape[0]),
    )
    _gate_before_o_proj(ctx, k, naive, xq, iw)
    ratio = _cache_ratio(ctx, k, cache, naive, iw)
    edges = _edge_cases()
    _headroom(ctx, k, naive, iw, edges)
    _forward_contract(ctx, k, xq, iw, naive, edges)
    _end_to_end(ctx, naive, xq, iw)
    err = next(c.measured for c in ctx.checks if c.name == "attention_reference")
    bound = next(c.bound for c in ctx.checks if c.name == "attention_reference")
    ctx.evidence(
        f"naive == absorbed and decode == forward bit for bit (T={T_HAVE}, H={SHAPE['H']}); "
        f"o within {err:.3f} LSB of float64 (bound {bound:.3f}); latent cache "
        f"{ratio['k3_latent_values']} vs {ratio['k3_mha_values']} values/token at K3's dims "
        f"({ratio['k3_ratio']:.1f}x smaller than MHA K/V), counted from the arrays held"
    )


def _decode_all(k, xq: np.ndarray, iw: IntWeights) -> tuple[dict, LatentCache]:
    """Token by token through decode_int, from an empty cache of capacity 4 (it grows)."""
    cache = LatentCache.empty(iw, capacity=4)
    rows = [decode_int(k, np.ascontiguousarray(xq[t : t + 1]), cache, iw) for t in range(len(xq))]
    out = {n: np.concatenate([r[n] for r in rows]) for n in ("o", "gated", "y", "c_kv", "k_r")}
    out["sat"] = sum(r["sat"] for r in rows)
    return out, cache


def _references(ctx: GateContext, naive: dict, xq: np.ndarray, iw: IntWeights) -> np.ndarray:
    w = reals(iw)
    x = value(xq, K.X_FRAC)
    shape = ", ".join(f"{n}={v}" for n, v in SHAPE.items())
    o_ref = attention_reference(naive, iw)
    ctx.check_reference(
        "attention_reference",
        f"the causal NoPE attention o in Q.20 matches float64 attention on the same integer "
        f"q, c_KV, k_R, W_UK, W_UV within the declared bound ({shape})",
        np.asarray(naive["o"], dtype=np.float64),
        np.ldexp(o_ref, K.O_FRAC),
        unit=Q20,
    )
    gated_ref = value(naive["o"], K.O_FRAC).reshape(len(x), -1) * ref.sigmoid(x @ w["w_g"].T)
    ctx.check_reference(
        "gated_reference",
        "the gated tensor o ⊙ σ(x W_g) in Q.20 matches float64 on the kernel's own o",
        np.asarray(naive["gated"], dtype=np.float64),
        np.ldexp(gated_ref, K.O_FRAC),
        unit=Q20,
    )
    y_ref = ref.output(o_ref, x, w["w_g"], w["w_o"])[1]
    ctx.check_reference(
        "output_reference",
        "the layer output y = W_O (o ⊙ σ(x W_g)) in Q.20 matches float64 computed end to end "
        "(float attention, gate and o_proj) from the same integer attention inputs and x",
        np.asarray(naive["y"], dtype=np.float64),
        np.ldexp(y_ref, K.O_FRAC),
        unit=Q20,
    )
    return o_ref


def _in_domain(ctx: GateContext, k, naive: dict, iw: IntWeights, dec: dict) -> None:
    v = k.mla_up(naive["c_kv"], iw.w_uk, iw.w_uv)[1]
    v_max = float(np.abs(v).max()) / 2.0 ** (K.W_FRAC + K.C_FRAC)
    wo_l1 = float(np.abs(value(iw.w_o, K.W_FRAC)).sum(axis=1).max())
    ctx.check(
        "in_domain",
        "no value saturated in the forward or the decode, and the inputs lie in the domain the "
        "bounds were derived for: max |v| = max |W_UV c| <= 16 and every row Σ_k |W_O,ik| <= 16",
        naive["sat"] == 0 and dec["sat"] == 0 and v_max <= 2**K.V_MAX_BITS
        and wo_l1 <= 2**K.WO_L1_BITS,
        saturations=int(naive["sat"]) + int(dec["sat"]),
        max_abs_v=v_max,
        max_row_l1_w_o=wo_l1,
    )  # fmt: skip


def _gate_before_o_proj(ctx: GateContext, k, naive: dict, xq: np.ndarray, iw: IntWeights) -> None:
    """With x[:, 0] = 8 and W_g = ±15 on column 0 only, every logit is ±120: σ is exactly 1 or 0
    (it saturates past 64). W_g = 0 gives σ(0) = 1/2 exactly."""
    o = naive["o"]
    t_len, d_v = o.shape[0], o.shape[2]
    x8 = xq.copy()
    x8[:, 0] = 8 << K.X_FRAC
    flat = o.reshape(t_len, -1).astype(np.int64)
    w_o = iw.w_o.astype(np.int64)

    def proj(g: np.ndarray) -> np.ndarray:  # y = round(W_O g / 2^16), exactly, in numpy int64
        return rshift_round_np(g.astype(np.int64) @ w_o.T, K.W_FRAC)

    def run(w_g: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g, y, _ = k.mla_output(o, xs, np.ascontiguousarray(w_g.astype(np.int32)), iw.w_o)
        return g, y

    open_g = np.zeros_like(iw.w_g)
    open_g[:, 0] = 15 << K.W_FRAC
    g1, y1 = run(open_g, x8)
    g2, y2 = run(np.zeros_like(iw.w_g), xq)
    closed = open_g.copy()
    closed[:d_v, 0] = -(15 << K.W_FRAC)  # head 0's gate shut, the others open
    g3, y3 = run(closed, x8)
    keep = flat.copy()
    keep[:, :d_v] = 0
    results = {
        "open_gate_passes_o": bool(np.array_equal(g1, flat)),
        "open_gate_y_is_ungated_W_O_o": bool(np.array_equal(y1, proj(flat))),
        "half_gate_halves_o": bool(np.array_equal(g2, rshift_round_np(flat, 1))),
        "half_gate_y_is_W_O_of_half_o": bool(np.array_equal(y2, proj(rshift_round_np(flat, 1)))),
        "shut_head_0_zeroes_its_channels": bool(np.array_equal(g3, keep)),
        "shut_head_0_y_omits_its_W_O_columns": bool(np.array_equal(y3, proj(keep))),
        "gate_changes_y": not bool(np.array_equal(naive["y"], y1)),
    }
    ctx.check(
        "gate_before_o_proj",
        "the gate multiplies the pre-o_proj tensor o, channel by channel: with σ = 1 the layer "
        "is W_O o exactly, with σ = 1/2 it is W_O round(o/2), and shutting head 0's gate "
        "removes exactly its W_O columns (no elementwise gate on y could); the real gate "
        "changes y",
        all(results.values()),
        **results,
    )


def _cache_ratio(ctx: GateContext, k, cache: LatentCache, naive: dict, iw: IntWeights) -> dict:
    """Values per token held, measured from arrays: the latent cache after decoding, and the
    per-head K and V a plain MHA layer would hold (the naive path's materialised keys/values).

    A displayed fact, not a check: these counts follow from the shapes alone (kv_lora + rope for
    MLA against H (nope + rope + d_v) for MHA, K3-SPEC section 2), so no kernel output could
    move them."""
    d = iw.dims
    k_c, v = k.mla_up(naive["c_kv"], iw.w_uk, iw.w_uv)
    mha_k = np.concatenate(
        [k_c, np.broadcast_to(naive["k_r"][:, None, :], (len(k_c), d["H"], d["rope"]))], axis=-1
    )
    test_lat = cache.values_per_token
    test_mha = mha_k[0].size + v[0].size
    # K3's dims: a 3-token latent cache written by mla_decode_step, and the MHA K/V it replaces
    kd = K3_SHAPE
    rng = np.random.default_rng(SEED + 5)
    w_uk = rng.integers(-(2**12), 2**12, (kd["H"], kd["nope"], kd["kv_lora"]), dtype=np.int32)
    w_uv = rng.integers(-(2**12), 2**12, (kd["H"], kd["d_v"], kd["kv_lora"]), dtype=np.int32)
    c3 = np.zeros((3, kd["kv_lora"]), dtype=np.int32)
    r3 = np.zeros((3, kd["rope"]), dtype=np.int32)
    for n in range(3):
        q_t = rng.integers(-(2**16), 2**16, (1, kd["H"], kd["nope"] + kd["rope"]), dtype=np.int32)
        c_t = rng.integers(-(2**16), 2**16, (1, kd["kv_lora"]), dtype=np.int32)
        r_t = rng.integers(-(2**16), 2**16, (1, kd["rope"]), dtype=np.int32)
        k.mla_decode_step(q_t, c_t, r_t, c3, r3, n, w_uk, w_uv)
    k3_kc, k3_v = k.mla_up(c3, w_uk, w_uv)
    k3_lat = c3[0].size + r3[0].size
    k3_mha = k3_kc[0].size + kd["H"] * r3[0].size + k3_v[0].size
    rows = [
        ["test dims", f"H={d['H']}, kv_lora={d['kv_lora']}, rope={d['rope']}, nope={d['nope']}, "
         f"d_v={d['d_v']}", test_lat, test_mha, test_mha / test_lat, cache.bytes_per_token],
        ["K3", "H=96, kv_lora=512, rope=64, nope=128, d_v=128", k3_lat, k3_mha, k3_mha / k3_lat,
         c3[:1].nbytes + r3[:1].nbytes],
    ]  # fmt: skip
    ctx.artifact(
        "table:cache values per token (measured from the arrays held)",
        {"columns": ["dims", "shape", "latent cache (c_KV + k_R)", "MHA K + V", "ratio",
                     "latent bytes per token"],
         "rows": rows},
    )  # fmt: skip
    return {"k3_latent_values": k3_lat, "k3_mha_values": k3_mha, "k3_ratio": k3_mha / k3_lat}


# the docstring's ceilings for each accumulator (log2 of the largest |partial sum|), K3's dims
CEILINGS = {"score_naive": 61.0, "score_absorbed": 61.0, "value_naive": 60.001,
            "value_absorbed": 60.001, "lat": 55.001}  # fmt: skip
W_EDGE = (1 << (K.W_FRAC + 4)) - 1  # |W| < 16


def _edge_cases() -> dict[str, tuple]:
    """Inputs at the formats' limits at K3's dims (H = 1, T = 4), each driving one path's limb
    accumulators toward the docstring's ceilings while the result stays computable."""
    kd = K3_SHAPE
    nope, kv, rope, d_v, t_len = kd["nope"], kd["kv_lora"], kd["rope"], kd["d_v"], 4
    rng = np.random.default_rng(SEED + 9)
    half = np.where(np.arange(kv) < kv // 2, 1, -1)

    def sign(shape):
        return rng.choice(np.array([-1, 1]), shape)

    cases = {}
    q = np.zeros((t_len, 1, nope + rope), dtype=np.int64)
    c = np.full((t_len, kv), K.C_LIM, dtype=np.int64)
    cases["random signs at full scale (scores saturate)"] = (
        sign((t_len, 1, nope + rope)) * K.Q_LIM,
        sign((t_len, kv)) * K.C_LIM,
        sign((t_len, rope)) * K.C_LIM,
        sign((1, nope, kv)) * W_EDGE,
        sign((1, d_v, kv)) * W_EDGE,
    )
    q1 = q.copy()
    q1[:, 0, :nope] = np.where(np.arange(nope) < nope // 2, K.Q_LIM, -K.Q_LIM)
    q1[:, 0, nope - 1] += 1000
    cases["naive score limbs: k_i ~ 2^53, q_C summing to ~0"] = (
        q1,
        c,
        np.zeros((t_len, rope)),
        np.full((1, nope, kv), W_EDGE),
        np.full((1, d_v, kv), W_EDGE) * half,
    )
    q2 = q.copy()
    q2[:, 0, :nope] = K.Q_LIM
    c2 = c * half
    c2[:, kv - 1] += 1000 * np.arange(1, t_len + 1)
    cases["absorbed score and value limbs: W_UK^T q ~ 2^53, c_KV summing to ~0"] = (
        q2,
        c2,
        np.zeros((t_len, rope)),
        np.full((1, nope, kv), W_EDGE),
        np.full((1, d_v, kv), W_EDGE) * half,
    )
    c3 = c * np.where(np.arange(t_len) % 2 == 0, 1, -1)[:, None]
    cases["naive value limbs: v = ±2^53 under uniform p"] = (
        q, c3, np.zeros((t_len, rope)), np.full((1, nope, kv), W_EDGE),
        np.full((1, d_v, kv), W_EDGE))  # fmt: skip
    return {
        name: tuple(np.ascontiguousarray(np.asarray(a, dtype=np.int32)) for a in arrays)
        for name, arrays in cases.items()
    }


def _headroom(ctx: GateContext, k, naive: dict, iw: IntWeights, edges: dict) -> None:
    """Every limb accumulator's largest |partial sum|, computed exactly from the arrays (Python
    integers), on the gate's problem and on edge inputs at K3's dims; and naive == absorbed ==
    an exact big-integer model that never splits a product."""
    o_exact, mx = exact_attention(k, naive["q"], naive["c_kv"], naive["k_r"], iw.w_uk, iw.w_uv)
    rows = [["test problem", *(_bits(mx[key]) for key in CEILINGS), _bits(mx["value_total"])]]
    agree = {"test problem": bool(np.array_equal(o_exact, naive["o"]))}
    worst = {key: mx[key] for key in CEILINGS}
    for name, args in edges.items():
        o_n, _ = k.mla_attend_naive(*args)
        o_a, _ = k.mla_attend_absorbed(*args)
        o_x, m = exact_attention(k, *args)
        agree[name] = bool(np.array_equal(o_n, o_a) and np.array_equal(o_n, o_x))
        rows.append([name, *(_bits(m[key]) for key in CEILINGS), _bits(m["value_total"])])
        worst = {key: max(worst[key], m[key]) for key in CEILINGS}
    rows.append(["docstring ceiling", *CEILINGS.values(), "(no int64 holds it)"])
    ctx.artifact(
        "table:int64 headroom: log2 of the largest |partial sum| per limb accumulator",
        {"columns": ["inputs", *CEILINGS, "unsplit value total Σ p v"], "rows": rows},
    )
    within = all(_bits(worst[key]) <= CEILINGS[key] for key in CEILINGS)
    ctx.check(
        "int64_headroom",
        "on the gate's inputs and on edge inputs at K3's dims (formats at their limits), every "
        "limb accumulator's largest partial sum, measured exactly, stays within the docstring's "
        "ceiling (< 2^61.01), and naive, absorbed and an exact big-integer model agree bit for bit",
        within and all(agree.values()),
        **{f"max_bits_{key}": _bits(val) for key, val in worst.items()},
        unsplit_value_total_bits_test=_bits(mx["value_total"]),
        exact_agreement=agree,
    )


def _bits(x: int) -> float:
    return round(math.log2(max(int(x), 1)), 3)  # exact for Python ints of any size


# the edge cases compiled == interpreted also runs on: each drives one path's accumulators to
# the docstring's ceilings, where an int64 wrap would show first
EDGE_COMPILED = {
    "compiled_naive_saturating": ("mla_attend_naive",
                                  "random signs at full scale (scores saturate)"),
    "compiled_naive_limbs": ("mla_attend_naive", "naive value limbs: v = ±2^53 under uniform p"),
    "compiled_absorbed_limbs": ("mla_attend_absorbed",
                                "absorbed score and value limbs: W_UK^T q ~ 2^53, c_KV summing "
                                "to ~0"),
}  # fmt: skip


def _round_limbs_inputs(limb: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) pairs for round_limbs: 4000 seeded ones (both signs of each limb, |hi| < 2^40,
    |lo| < 2^61) and constructed ones: lo a multiple of 2^limb under a negative hi (the borrow
    branch, low == 0), and exact halves of the last kept bit, of either sign."""
    rng = np.random.default_rng(SEED + 12)
    hi = list(rng.integers(-(2**40), 2**40, 4000))
    lo = list(rng.integers(-(2**61), 2**61, 4000))
    half = 1 << (s - 1)
    for h in (-3, -2, -1, 0, 1, 2):
        for low in (0, 1 << limb, -(1 << limb), 3 << limb, half, -half, half + 1, half - 1):
            hi.append(h)
            lo.append(low)
    return np.array(hi, dtype=np.int64), np.array(lo, dtype=np.int64)


def _forward_contract(
    ctx: GateContext, k, xq: np.ndarray, iw: IntWeights, naive: dict, edges: dict
) -> None:
    real = f"the gate's real inputs (T = {T_HAVE}, H = {SHAPE['H']})"
    args = (naive["q"], naive["c_kv"], naive["k_r"], iw.w_uk, iw.w_uv)
    check_compiled(ctx, "compiled_naive", "mla_attend_naive", *args, inputs=real)
    check_compiled(ctx, "compiled_absorbed", "mla_attend_absorbed", *args, inputs=real)
    check_compiled(
        ctx, "compiled_decode", "mla_decode_attend", naive["q"], T_HAVE - 1, naive["c_kv"],
        naive["k_r"], T_HAVE, iw.w_uk, iw.w_uv,
        inputs=f"{real}: the last token's query over the whole {T_HAVE}-row cache",
    )  # fmt: skip
    check_compiled(ctx, "compiled_output", "mla_output", naive["o"], xq, iw.w_g, iw.w_o,
                   inputs=real)  # fmt: skip
    for name, (func, case) in EDGE_COMPILED.items():
        check_compiled(
            ctx, name, func, *edges[case],
            inputs=f"the int64_headroom check's edge inputs at K3's dims (H = 1, T = 4): {case}",
        )  # fmt: skip
    for name, (limb, s, what) in {
        "compiled_round_limbs": (K.SCORE_LIMB, K.SCORE_SHIFT, "s < limb, the score's rounding"),
        "compiled_round_limbs_value": (K.VALUE_LIMB, K.VALUE_SHIFT,
                                       "s >= limb, the value's rounding"),
    }.items():  # fmt: skip
        hi, lo = _round_limbs_inputs(limb, s)
        check_compiled(
            ctx, name, "round_limbs_array", hi, lo, limb, s,
            inputs=f"a slice: {hi.size} (hi, lo) pairs at (limb, s) = ({limb}, {s}) ({what}), "
            "which reaches every branch of round_limbs for that (limb, s): hi and lo of both "
            "signs, lo a multiple of 2^limb under a negative hi (the borrow, low == 0), and "
            "exact halves of either sign",
        )  # fmt: skip
    perm = np.array([2, 0, 3, 1])
    ctx.check_deterministic(
        "deterministic",
        "a run with the heads in another order (W_UQ, W_UK, W_UV, W_g and W_O permuted alike, "
        "o permuted back) gives bit-identical o and y to the run in the original order: every "
        "sum is exact, so its order cannot matter",
        {
            "heads in order": (naive["o"], naive["y"]),
            "heads permuted, o permuted back": _heads_permuted(k, xq, iw, perm),
        },
    )
    ctx.check_threads(
        "threads",
        f"the naive attention over the gate's {T_HAVE} tokens (rows in parallel under OpenMP) "
        "gives bit-identical o and saturation counts here and in fresh processes with 1 and 2 "
        "threads",
        "mla_attend_naive",
        *args,
    )


def _heads_permuted(k, xq: np.ndarray, iw: IntWeights, perm: np.ndarray) -> tuple:
    from dataclasses import replace

    h, d_v = iw.n_heads, iw.w_uv.shape[1]
    d_qk = iw.w_uq.shape[0] // h
    pw = replace(
        iw,
        w_uq=np.ascontiguousarray(iw.w_uq.reshape(h, d_qk, -1)[perm].reshape(h * d_qk, -1)),
        w_uk=np.ascontiguousarray(iw.w_uk[perm]),
        w_uv=np.ascontiguousarray(iw.w_uv[perm]),
        w_g=np.ascontiguousarray(iw.w_g.reshape(h, d_v, -1)[perm].reshape(h * d_v, -1)),
        w_o=np.ascontiguousarray(iw.w_o.reshape(-1, h, d_v)[:, perm].reshape(-1, h * d_v)),
    )
    r = forward_int(k, xq, pw)
    return np.ascontiguousarray(r["o"][:, np.argsort(perm)]), r["y"]


def _end_to_end(ctx: GateContext, naive: dict, xq: np.ndarray, iw: IntWeights) -> None:
    """Informational (no bound is claimed): y against a float64 pass that starts from x and the
    weights, so the projections' roundings propagate through the softmax."""
    w = reals(iw)
    d_qk = SHAPE["nope"] + SHAPE["rope"]
    y = ref.forward(
        value(xq, K.X_FRAC), w, SHAPE["H"], iw.eps / 2.0**K.EPS_FRAC, host.inv_sqrt(d_qk)
    )
    err = np.abs(value(naive["y"], K.O_FRAC) - y)
    ctx.artifact(
        "table:end to end from x (measured, not a gated bound)",
        {
            "columns": ["quantity", "value"],
            "rows": [
                ["max |y_int - y_float64| (LSB of Q.20)", float(err.max() * 2**K.O_FRAC)],
                ["max |y_float64|", float(np.abs(y).max())],
                ["relative to max |y|", float(err.max() / np.abs(y).max())],
            ],
        },
    )


# == STRONG: the backward =======================================================================
T_BWD = 48  # the backward's sequence length (P and dS are [H, T, T])
BWD_SHAPE = {**SHAPE, "T": T_BWD}
BWD_NAMES = ("dq_R", "dq_C", "dc_kv", "dk_r")
BWD_BOUNDS = dict(zip(BWD_NAMES, K.backward_bounds_q10(T_BWD, SHAPE["H"], T_BWD), strict=True))
Q24 = "LSB (2^-24)"
FD_POINTS = 10  # finite-difference coordinates per input (q, c_KV, k_R, u)


def backward_problem(k) -> tuple:
    xq, iw = problem(SEED + 21, BWD_SHAPE)
    r = forward_int(k, xq, iw)
    rng = np.random.default_rng(SEED + 22)
    dy = 0.5 * rng.standard_normal((T_BWD, SHAPE["D"]))
    dyq = np.ascontiguousarray(quantize(dy, K.G_FRAC).astype(np.int32))
    return xq, iw, r, dyq


@gate(
    "mla_backward",
    innovation="gatedmla",
    level="STRONG",
    kernels=["k3gates.mla.kernels"],
    bounds={
        "do": lsb(K.OUT_GRAD_MAX_ERR_LSB_Q10),
        "du": lsb(K.OUT_GRAD_MAX_ERR_LSB_Q10),
        **{name: lsb(b) for name, b in BWD_BOUNDS.items()},
        "fd_q": ref.FD_MAX_ERR,
        "fd_c_kv": ref.FD_MAX_ERR,
        "fd_k_r": ref.FD_MAX_ERR,
        "fd_u": ref.FD_MAX_ERR,
    },
    timeout=300,
)
def mla_backward(ctx: GateContext) -> None:
    """The backward of the gated layer in integers: the gradients of q, c_KV, k_R and the gate's
    input u = x W_g within their declared bounds of the float64 backward, which itself agrees with
    central finite differences of the float64 forward."""
    k = ctx.compiled()
    xq, iw, r, dyq = backward_problem(k)
    b = backward_int(k, r, xq, iw, dyq)
    w = reals(iw)
    x = value(xq, K.X_FRAC)
    q, c, kr = value(r["q"], K.Q_FRAC), value(r["c_kv"], K.C_FRAC), value(r["k_r"], K.C_FRAC)
    o = value(r["o"], K.O_FRAC)
    dy = value(dyq, K.G_FRAC)
    do_ref, du_ref = ref.output_backward(o, x, w["w_g"], w["w_o"], dy)
    do = value(b["do"], K.G_FRAC)  # the attention backward starts from the kernel's own do
    dq_ref, dc_ref, dkr_ref = ref.attention_backward(q, c, kr, w["w_uk"], w["w_uv"], do)
    nope = SHAPE["nope"]
    shape = f"T={T_BWD}, H={SHAPE['H']}, kv_lora={SHAPE['kv_lora']}, nope={nope}"
    for name, got, want, what in (
        ("do", b["do"], do_ref, "do = (dy W_O) ⊙ σ(u)"),
        ("du", b["du"], du_ref, "du = (dy W_O) ⊙ o ⊙ σ(u)(1 - σ(u)), the gate input's gradient"),
        ("dq_C", b["dq"][..., :nope], dq_ref[..., :nope], "dq_C = Σ_s dS_ts W_UK c_s"),
        ("dq_R", b["dq"][..., nope:], dq_ref[..., nope:], "dq_R = Σ_s dS_ts k_R,s"),
        ("dc_kv", b["dc_kv"], dc_ref, "dc_KV (through both W_UK and W_UV, summed over heads)"),
        ("dk_r", b["dk_r"], dkr_ref, "dk_R (the shared key part, summed over heads)"),
    ):
        ctx.check_reference(
            name,
            f"{what} in Q.24 matches the float64 backward on the same integer inputs within the "
            f"declared bound ({shape})",
            np.asarray(got, dtype=np.float64),
            np.ldexp(want, K.G_FRAC),
            unit=Q24,
        )
    _finite_differences(ctx, q, c, kr, w, x, dy)
    _backward_domain(ctx, b, r, iw, dq_ref, do)
    _backward_properties(ctx, k, b, r, xq, iw, dyq)
    _backward_contract(ctx, k, xq, iw, r, dyq, b)
    worst = max(c.measured for c in ctx.checks if c.kind == "reference" and c.unit == Q24)
    fd = max(c.measured for c in ctx.checks if c.name.startswith("fd_"))
    ctx.evidence(
        f"backward dq, dc_KV, dk_R and the gate input's du within {worst:.3f} LSB of Q.24 of "
        f"float64 (T={T_BWD}, H={SHAPE['H']}); float64 backward within {fd:.1e} of finite "
        "differences"
    )


def _finite_differences(ctx: GateContext, q, c, kr, w, x, dy) -> None:
    """The float64 analytic backward (what the integers are held to) against central differences
    of the float64 forward's L = Σ dy ⊙ y, at seeded coordinates of q, c_KV, k_R and u."""
    u = ref.gate_logits(x, w["w_g"])
    args = {"q": q, "c_kv": c, "k_r": kr, "w_uk": w["w_uk"], "w_uv": w["w_uv"], "u": u,
            "w_o": w["w_o"]}  # fmt: skip
    o = ref.attention_naive(q, c, kr, w["w_uk"], w["w_uv"])
    s = ref.sigmoid(u)
    d_gated = dy @ w["w_o"]
    du = d_gated * o.reshape(len(o), -1) * s * (1 - s)
    dq, dc, dkr = ref.attention_backward(
        q, c, kr, w["w_uk"], w["w_uv"], (d_gated * s).reshape(o.shape)
    )
    analytic = {"q": dq, "c_kv": dc, "k_r": dkr, "u": du}
    rng = np.random.default_rng(SEED + 23)
    for name, grad in analytic.items():
        idx = [tuple(int(rng.integers(0, n)) for n in grad.shape) for _ in range(FD_POINTS)]
        fd = np.array([ref.finite_difference(args, dy, name, i) for i in idx])
        ctx.check_reference(
            f"fd_{name}",
            f"the float64 analytic dL/d{name} (the reference the integers are held to) agrees "
            "with central differences (h = 2^-20, in extended precision) of the forward at "
            f"{FD_POINTS} seeded "
            "coordinates",
            np.array([grad[i] for i in idx]),
            fd,
            unit="absolute",
        )


def _backward_domain(ctx: GateContext, b: dict, r: dict, iw: IntWeights, dq_ref, do) -> None:
    """The magnitudes backward_bounds_q10 assumes (K.BWD_*_BITS), measured on these inputs."""
    w = reals(iw)
    v = np.einsum("hij,sj->shi", w["w_uv"], value(r["c_kv"], K.C_FRAC))
    dp = np.einsum("thi,shi->hts", do, v)
    d_g = np.abs(value(b["do"], K.G_FRAC)).max()  # |dG| >= |do|; the dG bound is checked below
    l1 = max(float(np.abs(w[n]).sum(axis=a).max()) for n in ("w_uk", "w_uv") for a in (1, 2))
    got = {
        "max_abs_dP": float(np.abs(dp).max()),
        "max_abs_do": float(d_g),
        "max_abs_c_kv": float(np.abs(value(r["c_kv"], K.C_FRAC)).max()),
        "max_abs_k_r": float(np.abs(value(r["k_r"], K.C_FRAC)).max()),
        "max_abs_k_c": float(
            np.abs(np.einsum("hij,sj->shi", w["w_uk"], value(r["c_kv"], K.C_FRAC))).max()
        ),
        "max_abs_q": float(np.abs(value(r["q"], K.Q_FRAC)).max()),
        "max_l1_w_uk_w_uv": l1,
    }
    limits = {"max_abs_dP": K.BWD_DP_BITS, "max_abs_do": K.BWD_DO_BITS,
              "max_abs_c_kv": K.BWD_C_BITS, "max_abs_k_r": K.BWD_KR_BITS,
              "max_abs_k_c": K.BWD_KR_BITS,
              "max_abs_q": K.BWD_Q_BITS, "max_l1_w_uk_w_uv": K.BWD_L1_BITS}  # fmt: skip
    ctx.check(
        "in_domain",
        "no backward intermediate saturated, and the magnitudes the backward bounds assume hold: "
        "|dP| <= 8, |do| <= 4, |c_KV|, |k_R|, |k_C| <= 8, |q| <= 2, row and column L1 of W_UK, "
        "W_UV <= 32",
        b["sat"] == 0 and all(got[n] <= 2 ** limits[n] for n in got),
        saturations=int(b["sat"]),
        **got,
    )


def _backward_properties(ctx: GateContext, k, b: dict, r: dict, xq, iw: IntWeights, dyq) -> None:
    ds = b["ds"]
    n = np.arange(1, T_BWD + 1)
    row_sums = np.abs(ds.sum(axis=2)).max(axis=0)  # per query row t, worst head
    ctx.check(
        "softmax_jacobian_rows",
        "each row of dS = P ⊙ (dP - μ) sums to zero within n LSB of Q.48 (n keys in the row): the "
        "softmax Jacobian annihilates a constant shift of the scores, in the integers too",
        bool(np.all(row_sums <= n)),
        max_abs_row_sum_lsb=int(row_sums.max()),
    )
    # the gate's backward on the pre-o_proj tensor: sigma in {0, 1/2, 1} exactly
    x8 = xq.copy()
    x8[:, 0] = 8 << K.X_FRAC
    d_v = iw.w_uv.shape[1]
    dg = dyq.astype(np.int64) @ iw.w_o.astype(np.int64)  # dG in Q.40, exact
    open_g = np.zeros_like(iw.w_g)
    open_g[:, 0] = 15 << K.W_FRAC
    shut = open_g.copy()
    shut[:d_v, 0] = -(15 << K.W_FRAC)
    do1, du1, _ = k.mla_output_backward(r["o"], x8, open_g, iw.w_o, dyq)
    do2, du2, _ = k.mla_output_backward(r["o"], xq, np.zeros_like(iw.w_g), iw.w_o, dyq)
    do3, du3, _ = k.mla_output_backward(r["o"], x8, shut, iw.w_o, dyq)
    shape = do1.shape
    keep = rshift_round_np(dg, K.W_FRAC)
    keep[:, :d_v] = 0
    flat1, flat2, flat3 = (a.reshape(len(dg), -1) for a in (do1, do2, do3))
    results = {
        "open_gate_do_is_dG": bool(np.array_equal(flat1, rshift_round_np(dg, K.W_FRAC))),
        "half_gate_do_is_dG_over_2": bool(np.array_equal(flat2, rshift_round_np(dg, K.W_FRAC + 1))),
        "shut_head_0_do_is_zero_there": bool(np.array_equal(flat3, keep)),
        "saturated_gates_du_is_zero": not du1.any() and not du3.any(),
        "half_gate_du_nonzero": bool(du2.any()),
    }  # fmt: skip
    ctx.check(
        "gate_backward",
        "the gate's backward acts on the pre-o_proj tensor: with σ = 1 exactly, do = dy W_O; with "
        "σ = 1/2, do = (dy W_O)/2; a shut head gets do = 0; and du = 0 exactly wherever σ "
        "saturates (σ(1 - σ) = 0)",
        all(results.values()) and shape == r["o"].shape,
        **results,
    )


def _backward_contract(ctx: GateContext, k, xq, iw: IntWeights, r: dict, dyq, b: dict) -> None:
    real = f"the gate's real inputs (T = {T_BWD}, H = {SHAPE['H']})"
    check_compiled(
        ctx, "compiled_output_backward", "mla_output_backward", r["o"], xq, iw.w_g, iw.w_o, dyq,
        inputs=real,
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_probs", "mla_backward_probs", r["q"], 0, r["c_kv"], r["k_r"], iw.w_uk,
        inputs=real,
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_scores", "mla_backward_scores", b["p"], 0, r["c_kv"], iw.w_uv, b["do"],
        inputs=real,
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_dq", "mla_backward_dq", b["ds"], 0, r["c_kv"], r["k_r"], iw.w_uk,
        inputs=real,
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_dkv", "mla_backward_dkv", b["ds"], b["p"], 0, r["q"], b["do"], iw.w_uk,
        iw.w_uv, inputs=real,
    )  # fmt: skip
    from dataclasses import replace

    perm = np.array([1, 3, 0, 2])
    h, d_v = iw.n_heads, iw.w_uv.shape[1]
    d_qk = iw.w_uq.shape[0] // h
    pw = replace(
        iw,
        w_uq=np.ascontiguousarray(iw.w_uq.reshape(h, d_qk, -1)[perm].reshape(h * d_qk, -1)),
        w_uk=np.ascontiguousarray(iw.w_uk[perm]),
        w_uv=np.ascontiguousarray(iw.w_uv[perm]),
        w_g=np.ascontiguousarray(iw.w_g.reshape(h, d_v, -1)[perm].reshape(h * d_v, -1)),
        w_o=np.ascontiguousarray(iw.w_o.reshape(-1, h, d_v)[:, perm].reshape(-1, h * d_v)),
    )
    pr = forward_int(k, xq, pw)
    pb = backward_int(k, pr, xq, pw, dyq)
    inv = np.argsort(perm)
    names = ("dq", "dc_kv", "dk_r")
    ctx.check_deterministic(
        "deterministic",
        "a run with the heads in another order (weights permuted alike, dq permuted back) gives "
        "bit-identical dq, dc_KV and dk_R to the run in the original order: the sums over heads "
        "and positions are exact, so their order cannot matter",
        {
            "heads in order": tuple(b[n] for n in names),
            "heads permuted, dq permuted back": (
                np.ascontiguousarray(pb["dq"][:, inv]),
                pb["dc_kv"],
                pb["dk_r"],
            ),
        },
    )
    ctx.check_threads(
        "threads",
        f"the backward's dS = P ⊙ (dP − μ) over the gate's {T_BWD} tokens (heads in parallel "
        "under OpenMP) is bit-identical here and in fresh processes with 1 and 2 threads",
        "mla_backward_scores",
        b["p"], 0, r["c_kv"], iw.w_uv, b["do"],
    )  # fmt: skip
