"""Stable LatentMoE + Quantile Balancing gates: the router and the latent RMSNorm (PARTIAL), the
layer with batch invariance and one Quantile Balancing update (HAVE), and the backward through
the experts and the combine with the routing held fixed (STRONG). Every bound comes from
k3gates/moe/kernels.py, declared before any run.

Test scale. The layer runs at 64 experts, top-8, hidden 64, latent 32, expert width 16, shared
width 32, on 256 tokens (K3: 896 experts, top-16, hidden 7168, latent 3584, expert width 3072,
which no gate can run at full width on this machine). At K3's 896/16 the router, the top-k, the
renormalisation and Quantile Balancing run on a hidden width of 64, and the latent RMSNorm runs
at K3's latent width 3584. Weights are drawn with rows of unit L2 norm (the scale-preserving
initialisation) and scaled so that no row or column has an L1 norm above 6, inside the analysed
domain (8); the router's inputs share a mean direction, so the experts start unbalanced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3gates.fx import quantize, value
from k3gates.fx.checks import check_compiled, lsb
from k3gates.infra.gate import GateContext, bit_equal, gate

from . import kernels as K
from . import reference as ref

SEED = 20260708
RSF = 2.827  # routed_scaling_factor: a parameter (public sources say 1.0 or 2.827)
EPS = 1e-6
L1_TARGET = 6.0  # the gates' weights: every row and column L1 norm <= 6 (domain: 8)
Q40 = "LSB (2^-40)"
Q32 = "LSB (2^-32)"
Q24 = "LSB (2^-24)"


@dataclass(frozen=True)
class Shape:
    t: int  # tokens
    d: int  # hidden width
    d_l: int  # latent width
    f: int  # expert width
    n: int  # routed experts
    k: int  # experts per token
    f_s: int  # shared expert width


TEST = Shape(t=256, d=64, d_l=32, f=16, n=64, k=8, f_s=32)
ROUTER_TOKENS = 1 << 14  # the router check: 2^14 tokens x 64 experts = 2^20 scores
QB_TOKENS = 1024  # the QB batch at 64/8: q = 1024 * 8 / 64 = 128
# The qb_balance check's band, in tokens, declared before the run. Its batch (qb_balance_batch)
# is balanced but for expert 0, which every token takes. One update sets b'_0 = -(the (q+1)-th
# largest column-0 margin) and leaves every other b'_j at 0 (each other column's (q+1)-th margin
# is exactly 0 by construction); then exactly q tokens keep expert 0 strictly above their old
# threshold, and the (q+1)-th lands exactly on it, tied with its own lowest home expert. The
# documented tie-break (lower index) gives it expert 0: loads q + 1 for expert 0, q - 1 for that
# home expert, q for the rest. So the a-priori slack is one token, from the (q+1)-th margin
# rule's tie alone.
QB_BALANCE_BAND = 1
K3_N, K3_K, K3_TOKENS = 896, 16, 448  # q = 448 * 16 / 896 = 8
K3_LATENT = 3584
RMS_CHECK_FRAC = 32  # the RMSNorm check reads its output in Q.32, where float64 is exact enough


# == data ========================================================================================
def _matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    w = rng.standard_normal((rows, cols))
    return w / np.linalg.norm(w, axis=1, keepdims=True)


def _fit_l1(w: np.ndarray) -> np.ndarray:
    """Scale w (2-D, or a stack of 2-D) so that every row and column L1 norm is <= L1_TARGET."""
    a = np.abs(w)
    top = max(a.sum(axis=-1).max(), a.sum(axis=-2).max())
    return w * min(1.0, L1_TARGET / top)


def params(seed: int, s: Shape) -> dict[str, np.ndarray]:
    """Seeded float weights, already exact Q.24 values (quantised, then read back)."""
    rng = np.random.default_rng(seed)
    stack = lambda rows, cols: np.stack([_fit_l1(_matrix(rng, rows, cols)) for _ in range(s.n)])
    p = {
        "w_r": _fit_l1(_matrix(rng, s.n, s.d)),
        "w_down": _fit_l1(_matrix(rng, s.d_l, s.d)),
        "w1": stack(s.f, s.d_l),
        "w3": stack(s.f, s.d_l),
        "w2": stack(s.d_l, s.f),
        "w_n": 1.0 + 0.2 * rng.standard_normal(s.d_l).clip(-3, 3),
        "w_up": _fit_l1(_matrix(rng, s.d, s.d_l)),
        "ws1": _fit_l1(_matrix(rng, s.f_s, s.d)),
        "ws3": _fit_l1(_matrix(rng, s.f_s, s.d)),
        "ws2": _fit_l1(_matrix(rng, s.d, s.f_s)),
    }
    return {name: value(quantize(w, K.W_FRAC), K.W_FRAC) for name, w in p.items()}


def tokens(seed: int, t_len: int, d: int) -> np.ndarray:
    """x = N(0, I) + mu (a shared mean direction: some experts start far more popular), clipped
    to +-6, as exact Q.24 values."""
    rng = np.random.default_rng(seed)
    mu = np.random.default_rng(SEED).standard_normal(d)
    x = np.clip(rng.standard_normal((t_len, d)) + mu[:d], -6, 6)
    return value(quantize(x, K.X_FRAC), K.X_FRAC)


def order_and_split_runs(fn, x: np.ndarray, seed: int, split: int) -> dict[str, tuple]:
    """fn over the rows of x in one call, in a shuffled order (un-shuffled after), and in two
    calls split at row `split` (outputs concatenated): for a kernel whose rows are independent
    all three must be bit-identical, whatever a float implementation's batching would do."""
    perm = np.random.default_rng(seed).permutation(x.shape[0])
    inv = np.argsort(perm)
    c_ = np.ascontiguousarray

    def rows(out) -> tuple:
        return out if isinstance(out, tuple) else (out,)

    head, tail = rows(fn(c_(x[:split]))), rows(fn(c_(x[split:])))
    return {
        "all rows in one call": rows(fn(x)),
        "rows shuffled, un-shuffled after": tuple(o[inv] for o in rows(fn(c_(x[perm])))),
        f"two calls, rows 0..{split - 1} and {split}..": tuple(
            np.concatenate([a, b]) for a, b in zip(head, tail, strict=True)
        ),
    }


def ints(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(quantize(w, K.W_FRAC)) for name, w in p.items()}


def scalars() -> tuple[int, float, int, float]:
    """(rsf raw Q.24, rsf value, eps raw Q.56, eps value)."""
    rsf = int(quantize(np.float64(RSF), K.W_FRAC))
    eps = int(quantize(np.float64(EPS), K.EPS_FRAC))
    return rsf, rsf / 2.0**K.W_FRAC, eps, eps / 2.0**K.EPS_FRAC


def q24(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(quantize(x, K.X_FRAC))


def run_layer(k, qx: np.ndarray, qp: dict[str, np.ndarray], idx, wts, eps: int) -> tuple:
    return k.moe_layer(
        qx, idx, wts, qp["w_down"], qp["w1"], qp["w3"], qp["w2"], qp["w_n"], eps, qp["w_up"],
        qp["ws1"], qp["ws3"], qp["ws2"],
    )  # fmt: skip


def selection_agreement(idx: np.ndarray, sf: np.ndarray, bf: np.ndarray, k: int) -> dict:
    """Compare the integer selection with float64's: outside the band they must be equal sets."""
    biased = sf + bf
    gap = ref.kth_gap(biased, k) * 2.0**K.S_FRAC
    band = gap <= K.SELECT_BAND_LSB
    same = np.array(
        [
            set(a) == set(b)
            for a, b in zip(idx.tolist(), ref.select(biased, k).tolist(), strict=True)
        ]
    )
    return {
        "agree_outside_band": bool(np.all(same | band)),
        "band_tokens": int(band.sum()),
        "differ_in_band": int((~same & band).sum()),
        "min_gap_lsb": float(gap.min()),
        "tokens": int(idx.shape[0]),
    }


def tie_order_ok(s: np.ndarray, b: np.ndarray, idx: np.ndarray) -> bool:
    """idx lists each token's experts by decreasing biased score, equal scores by index, and no
    unchosen expert beats (or ties with a lower index than) the last chosen one."""
    biased = s + b[None, :]
    for t in range(idx.shape[0]):
        v = biased[t, idx[t]]
        for j in range(idx.shape[1] - 1):
            if not (v[j] > v[j + 1] or (v[j] == v[j + 1] and idx[t, j] < idx[t, j + 1])):
                return False
        rest = np.setdiff1d(np.arange(biased.shape[1]), idx[t])
        last_v, last_e = v[-1], idx[t, -1]
        if np.any((biased[t, rest] > last_v) | ((biased[t, rest] == last_v) & (rest < last_e))):
            return False
    return True


# == PARTIAL: the router and the latent RMSNorm ===================================================
@gate(
    "moe_router",
    innovation="latentmoe",
    level="PARTIAL",
    kernels=["k3gates.moe.kernels"],
    bounds={
        "scores": lsb(K.SCORE_MAX_ERR_LSB_Q10),
        "combine_weights": lsb(K.weights_bound_q10(TEST.k)),
        "rmsnorm_latent": lsb(K.RMS_MAX_ERR_LSB_Q10),
        "rmsnorm_k3_width": lsb(K.RMS_MAX_ERR_LSB_Q10),
    },
    timeout=240,
)
def moe_router(ctx: GateContext) -> None:
    """The sigmoid router with its bias: scores within 513/1024 LSB of Q.40, top-k equal to
    float64's outside the rounding band with a documented tie-break, renormalised weights; and
    the latent RMSNorm within 514/1024 LSB, at the test latent width and at K3's 3584."""
    k = ctx.compiled()
    s = TEST
    p = params(SEED, s)
    qp = ints(p)
    rsf, rsf_f, _, _ = scalars()
    x = tokens(SEED + 1, ROUTER_TOKENS, s.d)
    x[:8] *= 16  # |x| up to 96 (outside the layer's domain, fine for the router): logits up to
    # +-64 and beyond, where sigma saturates
    qx = q24(x)
    bf = np.random.default_rng(SEED + 2).normal(0, 0.05, s.n)
    b = quantize(bf, K.S_FRAC)
    bf = value(b, K.S_FRAC)
    sc, idx, wts = k.router(qx, qp["w_r"], b, s.k, rsf)
    sf = ref.scores(x, p["w_r"])
    ctx.check_reference(
        "scores",
        "router scores s = σ(W_r x) in Q.40 are within 513/1024 LSB of float64",
        sc.astype(np.float64),
        np.ldexp(sf, K.S_FRAC),
        unit=Q40,
        function="σ(W_r x)",
        domain=f"{sc.size} scores: {x.shape[0]} seeded tokens × {s.n} experts, 8 tokens with "
        "saturated logits",
    )
    agree = selection_agreement(idx, sf, bf, s.k)
    ctx.check(
        "topk_matches_float64",
        f"outside the rounding band (float64 gap between the k-th and (k+1)-th biased score "
        f"> {K.SELECT_BAND_LSB} LSB of Q.40) the integer top-{s.k} set equals float64's",
        agree["agree_outside_band"],
        **agree,
    )
    ctx.check_reference(
        "combine_weights",
        "the weights rsf·s_e / Σ s over the chosen set (Q.56) are within the declared bound of "
        "float64's renormalisation of its own scores over the same set",
        np.ldexp(value(wts, K.C_FRAC), K.S_FRAC),
        np.ldexp(ref.combine_weights(sf, idx, rsf_f), K.S_FRAC),
        unit="2^-40",
        function="w_e = rsf s_e / Σ s",
        domain=f"{wts.size} weights, rsf = {RSF}, k = {s.k}",
    )
    total = wts.sum(axis=1) - (rsf << (K.C_FRAC - K.W_FRAC))
    ctx.check(
        "weights_sum_to_rsf",
        f"each token's {s.k} weights sum to rsf within k LSB of Q.56 (one rounding each)",
        bool(np.abs(total).max() <= s.k),
        max_deviation_lsb_q56=int(np.abs(total).max()),
    )
    _tie_break(ctx, k, s, qp, rsf, sc, b, idx)
    _rmsnorm_checks(ctx, k)
    # the 8 loud tokens (logits up to +98: sigma clamped at +64), one of them negated (logits
    # down to -98: clamped at -64), 8 ordinary tokens, and x = 0 (every score 1/2: ties)
    sl = np.ascontiguousarray(
        np.concatenate([qx[:16], -qx[:1], np.zeros((1, s.d), dtype=np.int64)])
    )
    check_compiled(
        ctx, "compiled_router", "router", sl, qp["w_r"], b, s.k, rsf,
        inputs=f"a slice: 18 tokens with the gate's W_r, b, k = {s.k} and rsf: its 8 loud "
        "tokens (σ clamped at +64), one of them negated (clamped at −64), 8 ordinary tokens and "
        "x = 0 (all scores ½: the top-k scan's ties), which reaches every branch of router and "
        "router_weights but the zero-score-sum fallback (every chosen logit below −39.5), which "
        "no token of the gate's batch reaches either",
    )  # fmt: skip
    split = 5000
    ctx.check_deterministic(
        "deterministic",
        f"the router over the {qx.shape[0]} tokens in one call, in a shuffled order (un-shuffled "
        f"afterwards), and in two calls split at token {split} gives bit-identical scores, "
        "choices and weights: each token's routing depends on that token alone",
        order_and_split_runs(lambda v: k.router(v, qp["w_r"], b, s.k, rsf), qx, SEED + 19, split),
    )
    ctx.check_threads(
        "threads",
        f"the router over the {qx.shape[0]} tokens (tokens in parallel under OpenMP) gives "
        "bit-identical scores, choices and weights here and in fresh processes with 1 and 2 "
        "threads",
        "router",
        qx, qp["w_r"], b, s.k, rsf,
    )  # fmt: skip
    worst = max(c.measured for c in ctx.checks if c.name == "scores")
    ctx.evidence(
        f"scores within {worst:.4f} LSB of Q.40 on {sc.size} points; top-{s.k} equal to "
        f"float64 on {agree['tokens'] - agree['band_tokens']}/{agree['tokens']} tokens (the rest "
        f"in the rounding band); RMSNorm at widths {s.d_l} and {K3_LATENT}"
    )


def _tie_break(ctx: GateContext, k, s: Shape, qp, rsf: int, sc, b, idx) -> None:
    """Constructed ties: equal scores (x = 0), duplicated router rows, and the order rule."""
    zero = np.zeros((3, s.d), dtype=np.int64)
    _, idx0, _ = k.router(zero, qp["w_r"], np.zeros(s.n, dtype=np.int64), s.k, rsf)
    w_dup = qp["w_r"].copy()
    w_dup[1::2] = w_dup[0::2]  # experts 2i and 2i+1 always score the same
    b_dup = np.repeat(b[0::2], 2)  # ... and carry the same bias
    x_dup = q24(tokens(SEED + 3, 64, s.d))
    sd, idx_dup, _ = k.router(x_dup, w_dup, b_dup, s.k, rsf)
    pos = {(t, e): j for t in range(idx_dup.shape[0]) for j, e in enumerate(idx_dup[t])}
    pairs_ok = all(
        (t, e - 1) in pos and pos[(t, e - 1)] == pos[(t, e)] - 1 for (t, e) in pos if e % 2 == 1
    )
    ctx.check(
        "tie_break_lower_index",
        "equal biased scores go to the lower expert index: with x = 0 every score is ½ and "
        "every token picks experts 0..k-1 in order; with duplicated router rows expert 2i+1 is "
        "only ever chosen right after its twin 2i; and on every token the chosen list is "
        "ordered by (biased score desc, index asc) with no unchosen expert ahead of its last",
        bool(np.all(idx0 == np.arange(s.k)))
        and pairs_ok
        and tie_order_ok(sd, b_dup, idx_dup)
        and tie_order_ok(sc, b, idx),
        equal_score_tokens=int(idx0.shape[0]),
        duplicate_pair_tokens=int(idx_dup.shape[0]),
    )


def _rmsnorm_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows over the kernel's domain: Gaussian rows from 2^-16 to 2^10 in scale, one-hot, constant,
    alternating, the largest magnitudes the layer can reach (|c| < 3200), and a zero row."""
    rows = [rng.standard_normal(n) * 2.0**e for e in range(-16, 11)]
    one_hot = np.zeros(n)
    one_hot[n // 3] = 5.0
    rows += [one_hot, np.full(n, 0.75), np.resize([1.0, -1.0], n) * 3.0, np.full(n, -3199.0)]
    rows += [np.zeros(n)]
    return np.array(rows)


def _rmsnorm_checks(ctx: GateContext, k) -> None:
    rng = np.random.default_rng(SEED + 4)
    _, _, eps, eps_f = scalars()
    for name, n in (("rmsnorm_latent", TEST.d_l), ("rmsnorm_k3_width", K3_LATENT)):
        c = _rmsnorm_rows(rng, n)
        constructed = c.shape[0]
        if n == TEST.d_l:  # plus realistic rows: 2^15 Gaussian rows of rms 1
            c = np.concatenate([c, rng.standard_normal((1 << 15, n))])  # 2^20 values
        qc = np.ascontiguousarray(quantize(c, K.A_FRAC))
        w = rng.uniform(-1, 1, n)  # |w| <= 1: |r| <= sqrt(n) < 2^6, within float64's reach
        qw = quantize(w, K.W_FRAC)
        got = k.latent_rmsnorm(qc, qw, eps, K.A_FRAC, RMS_CHECK_FRAC)
        want = ref.rmsnorm(value(qc, K.A_FRAC), value(qw, K.W_FRAC), eps_f)
        ctx.check_reference(
            name,
            f"RMSNorm of Q.48 rows of width {n} (the latent's format) in Q.32 is within the "
            "declared bound of float64",
            got.astype(np.float64),
            np.ldexp(want, RMS_CHECK_FRAC),
            unit=Q32,
            function="w c / sqrt(mean(c²) + eps)",
            domain=f"{c.shape[0]} rows of width {n}: scales 2^-16..2^10, one-hot, constant, "
            "alternating, |c| = 3199, zero",
        )
        if n == TEST.d_l:
            check_compiled(
                ctx, "compiled_rmsnorm", "latent_rmsnorm", np.ascontiguousarray(qc[:constructed]),
                qw, eps, K.A_FRAC, RMS_CHECK_FRAC,
                inputs=f"a slice: the rmsnorm_latent check's {constructed} constructed rows of "
                f"width {n} (its Gaussian rows left out) with its w, eps and formats (Q.48 in, "
                "Q.32 out), which reach every branch of latent_rmsnorm at these formats (|c| = "
                "3199: the sum of squares pre-rounded; rows of both signs; scales 2^-16..2^10) "
                "but the zero-sum return (a zero row with eps = 0) and eps_wide's d < 0 side "
                "(only for inputs coarser than Q.28)",
            )  # fmt: skip
    c = np.ascontiguousarray(quantize(rng.standard_normal((64, TEST.d_l)), K.A_FRAC))
    w = quantize(rng.uniform(-2, 2, TEST.d_l), K.W_FRAC)
    r = k.latent_rmsnorm(c, w, eps, K.A_FRAC, K.A_FRAC)
    neg = k.latent_rmsnorm(np.ascontiguousarray(-c), w, eps, K.A_FRAC, K.A_FRAC)
    zero = k.latent_rmsnorm(np.zeros((2, TEST.d_l), dtype=np.int64), w, eps, K.A_FRAC, K.A_FRAC)
    scaled = [
        k.latent_rmsnorm(np.ascontiguousarray(c << j), w, 0, K.A_FRAC, K.A_FRAC)
        for j in (0, 1, 2, 5)
    ]
    ctx.check(
        "rmsnorm_symmetries",
        "RMSNorm is odd bit for bit (-c gives -r), a zero row gives exactly 0, and with eps = 0 "
        "scaling a row by 2, 4 or 32 leaves its output bit-identical (the sum of squares is "
        "exact)",
        bool(np.array_equal(neg, -r))
        and not zero.any()
        and all(np.array_equal(scaled[0], v) for v in scaled[1:]),
    )


# == HAVE: the layer, batch invariance, the bias, one Quantile Balancing update ==================
@gate(
    "moe_layer",
    innovation="latentmoe",
    level="HAVE",
    kernels=["k3gates.moe.kernels"],
    bounds={
        "layer": lsb(K.layer_bound_q10(TEST.d_l, TEST.k)),
        "z_exact": 0,  # W x with x, W in Q.24 is exact in Q.48 (module docstring)
        "qb_bias": lsb(K.QB_BIAS_MAX_ERR_LSB_Q10),
        # loads outside the rounding band: integer and float64 choose the same sets there
        "qb_loads": 0,
        "k3_combine_weights": lsb(K.weights_bound_q10(K3_K)),
        "k3_qb_bias": lsb(K.QB_BIAS_MAX_ERR_LSB_Q10),
        "k3_qb_loads": 0,
    },
    timeout=300,
)
def moe_layer(ctx: GateContext) -> None:
    """The latent MoE layer (64 experts, top-8) within the declared bound of float64 on the same
    routing; shuffled tokens give permuted outputs bit for bit; the bias moves the choice, never
    a weight; one Quantile Balancing update lands every expert's load where float64's does."""
    k = ctx.compiled()
    s = TEST
    p = params(SEED, s)
    qp = ints(p)
    rsf, rsf_f, eps, eps_f = scalars()
    # the bias: one integer QB update on a batch of QB_TOKENS from the same distribution
    xb = q24(tokens(SEED + 5, QB_TOKENS, s.d))
    sb, _, _ = k.router(xb, qp["w_r"], np.zeros(s.n, dtype=np.int64), s.k, rsf)
    b = k.qb_update(sb, np.zeros(s.n, dtype=np.int64), s.k)
    bf = value(b, K.S_FRAC)
    x = tokens(SEED + 6, s.t, s.d)
    qx = q24(x)
    _, idx, wts = k.router(qx, qp["w_r"], b, s.k, rsf)
    y, z, _, _ = run_layer(k, qx, qp, idx, wts, eps)
    want = ref.layer(x, idx, p, rsf_f, eps_f)
    agree = selection_agreement(idx, want["s"], bf, s.k)
    ctx.check(
        "topk_matches_float64",
        "outside the rounding band the integer routing (with the QB bias) chooses float64's set",
        agree["agree_outside_band"],
        **agree,
    )
    ctx.check_reference(
        "layer",
        "y = W_up RMSNorm(Σ w_e E_e(W_down x)) + Shared(x) in Q.24 is within the declared bound "
        "of the float64 layer on the same routing (weights renormalised from float64's scores)",
        y.astype(np.float64),
        np.ldexp(want["y"], K.Y_FRAC),
        unit=Q24,
        function="the LatentMoE layer",
        domain=f"{s.t} seeded tokens; {s.n} experts, top-{s.k}, hidden {s.d}, latent {s.d_l}, "
        f"expert width {s.f}, shared width {s.f_s}, rsf = {RSF}",
    )
    _domain(ctx, p, x, want, idx, rsf_f)
    ctx.check_reference(
        "z_exact",
        "z = W_down x is exact: Q.24 × Q.24 is held in Q.48 with no rounding, equal bit for bit "
        "to float64's product (itself exact while every partial sum stays below 2^5 = 2^53 LSB)",
        z.astype(np.float64),
        np.ldexp(want["z"], K.A_FRAC),
        unit="LSB (2^-48)",
        function="z = W_down x",
        domain=f"{s.t} seeded tokens, hidden {s.d}, latent {s.d_l}",
    )
    split = 100
    ctx.check_deterministic(
        "batch_invariance",
        f"routing plus the layer over the {s.t} tokens in one call, in a shuffled order "
        f"(un-shuffled afterwards), and in two calls split at token {split} give bit-identical "
        "y, z, c, r, s, idx and w: a token's result depends on that token alone",
        order_and_split_runs(lambda v: _route_and_run(k, v, qp, b, rsf, eps), qx, SEED + 20,
                             split),
    )  # fmt: skip
    layer_args = (qx, idx, wts, qp["w_down"], qp["w1"], qp["w3"], qp["w2"], qp["w_n"], eps,
                  qp["w_up"], qp["ws1"], qp["ws3"], qp["ws2"])  # fmt: skip
    ctx.check_threads(
        "threads",
        f"the layer over the {s.t} tokens (tokens in parallel under OpenMP) gives bit-identical "
        "y, z, c and r here and in fresh processes with 1 and 2 threads",
        "moe_layer",
        *layer_args,
    )
    _bias_never_weights(ctx, k, s, qp, qx, b, rsf, idx, wts)
    _quantile_balancing(ctx, k, s, qp, rsf, sb, xb)
    check_qb_balance(ctx, k.router, k.qb_update)
    _k3_shape(ctx, k)
    real = f"the gate's real inputs ({s.t} tokens, {s.n} experts, top-{s.k})"
    check_compiled(ctx, "compiled_router", "router", qx, qp["w_r"], b, s.k, rsf, inputs=real)
    check_compiled(ctx, "compiled_layer", "moe_layer", *layer_args, inputs=real)
    check_compiled(
        ctx, "compiled_qb", "qb_update", sb, np.zeros(s.n, dtype=np.int64), s.k,
        inputs=f"the gate's real inputs (the QB batch: {QB_TOKENS} tokens' scores, zero bias)",
    )  # fmt: skip
    worst = next(c.measured for c in ctx.checks if c.name == "layer")
    bound = next(c.bound for c in ctx.checks if c.name == "layer")
    bal = next(c.values for c in ctx.checks if c.name == "qb_balance")
    ctx.evidence(
        f"layer ({s.n} experts, top-{s.k}) within {worst:.4f} LSB of Q.24 (bound {bound:.4f}) "
        "of float64 on the same routing; shuffled tokens permute outputs bit for bit; one QB "
        f"update takes an expert holding all {bal['tokens']} tokens to max |load − q| = "
        f"{bal['max_dev_after']} (q = {bal['q']})"
    )


def _route_and_run(k, qx, qp, b, rsf, eps) -> tuple:
    sc, idx, wts = k.router(qx, qp["w_r"], b, TEST.k, rsf)
    return (*run_layer(k, qx, qp, idx, wts, eps), sc, idx, wts)


def _domain(ctx: GateContext, p, x, want, idx, rsf_f) -> None:
    """The premises of the layer bound, measured on this data (float64 values)."""
    l1 = max(
        max(np.abs(w).sum(axis=-1).max(), np.abs(w).sum(axis=-2).max())
        for name, w in p.items()
        if name != "w_n"
    )
    e_out = ref.expert_outputs(want["z"], idx, p["w1"], p["w3"], p["w2"])
    chosen = np.take_along_axis(want["s"], idx, axis=1).sum(axis=1)
    rms = np.sqrt(np.mean(want["c"] ** 2, axis=1))
    values = {
        "max_abs_x": float(np.abs(x).max()),
        "max_weight_l1": float(l1),
        "max_abs_w_n": float(np.abs(p["w_n"]).max()),
        "rsf": rsf_f,
        "max_abs_z": float(np.abs(want["z"]).max()),
        "max_abs_E": float(np.abs(e_out).max()),
        "min_chosen_score_sum": float(chosen.min()),
        "min_rms_c": float(rms.min()),
    }
    ctx.check(
        "inputs_in_domain",
        "the data lie in the domain the layer bound is derived for: |x| <= 8, weight row and "
        "column L1 <= 8, |w_n| <= 2, rsf <= 4, |z| <= 8, |E| <= 16, chosen scores sum >= 1/16, "
        "rms(c) >= 1/16",
        values["max_abs_x"] <= K.X_MAX
        and values["max_weight_l1"] <= K.W_L1_MAX
        and values["max_abs_w_n"] <= K.NORM_W_MAX
        and rsf_f <= K.RSF_MAX
        and values["max_abs_z"] <= K.Z_MAX
        and values["max_abs_E"] <= K.E_MAX
        and values["min_chosen_score_sum"] >= 1 / K.S_MIN_INV
        and values["min_rms_c"] >= 1 / K.RMS_MIN_INV,
        **values,
    )


def _bias_never_weights(ctx: GateContext, k, s: Shape, qp, qx, b, rsf, idx, wts) -> None:
    """The bias changes the set, never a weight: forcing each token's set with an unrelated bias
    reproduces its weights bit for bit, and unbiased routing keeps the weights of unmoved sets."""
    same = lambda ia, ib: np.array(
        [set(a) == set(c) for a, c in zip(ia.tolist(), ib.tolist(), strict=True)]
    )
    as_map = lambda ii, ww: dict(zip(ii.tolist(), ww.tolist(), strict=True))
    _, idx0, _ = k.router(qx, qp["w_r"], np.zeros(s.n, dtype=np.int64), s.k, rsf)
    moved = ~same(idx, idx0)
    # another bias, b plus noise of up to 2^-8: most tokens keep the set b gave them
    noise = np.random.default_rng(SEED + 17).integers(-(1 << 32), 1 << 32, s.n)
    _, idx4, wts4 = k.router(qx, qp["w_r"], b + noise, s.k, rsf)
    kept = same(idx, idx4)
    same_set_same_w = all(
        as_map(idx[t], wts[t]) == as_map(idx4[t], wts4[t]) for t in np.flatnonzero(kept)
    )
    forced_ok = True
    big = 1 << (K.S_FRAC + 4)  # +16: no score can catch a forced expert
    for t in range(0, s.t, 4):
        bt = np.where(np.isin(np.arange(s.n), idx[t]), big, -big).astype(np.int64)
        bt += np.arange(s.n, dtype=np.int64)[::-1] << 20  # and a different order among them
        _, it, wt = k.router(qx[t : t + 1].copy(), qp["w_r"], bt, s.k, rsf)
        forced_ok &= as_map(it[0], wt[0]) == as_map(idx[t], wts[t])
    ctx.check(
        "bias_moves_choice_not_weights",
        "the QB bias changes the chosen set of some tokens, yet every weight is the "
        "renormalised unbiased score: tokens whose set is the same under b and under b + noise "
        "(|noise| < 2^-8) keep bit-identical weights, and forcing each token's set with an "
        "unrelated bias (set +16, others -16, any order) gives bit-identical weights",
        bool(moved.any()) and bool(kept.any()) and same_set_same_w and forced_ok,
        tokens_moved_by_bias=int(moved.sum()),
        tokens_same_set_under_b_and_b_noise=int(kept.sum()),
        tokens=int(s.t),
        forced_tokens=len(range(0, s.t, 4)),
    )


def _qb_loads(ctx: GateContext, name: str, idx_before, idx_after, sf, bf, k: int) -> dict:
    """The loads after one update: integer (its own s, b') against float64 (its own s, b'),
    counted exactly over the tokens outside the QB rounding band, where both must choose the
    same set (module docstring of kernels.py, "Quantile Balancing")."""
    m, n = sf.shape
    q = m * k // n
    before = ref.loads(idx_before, n)
    load_int = ref.loads(idx_after, n)
    chosen_f = ref.select(sf + bf, k)
    load_f = ref.loads(chosen_f, n)
    out = ref.kth_gap(sf + bf, k) * 2.0**K.S_FRAC > K.QB_BAND_LSB  # outside the rounding band
    band_tokens = int(m - out.sum())
    diff = np.abs(load_int - load_f)
    ctx.check_reference(
        name,
        f"after one update on {m} tokens ({n} experts, top-{k}, q = m·k/n = {q}) each expert's "
        f"integer load over the {int(out.sum())} tokens outside the rounding band (float64's gap "
        f"at the k-th place > {K.QB_BAND_LSB} LSB of Q.40, where the two biased scores cannot "
        "order differently) equals float64's load over the same tokens, exactly",
        ref.loads(idx_after[out], n).astype(np.float64),
        ref.loads(chosen_f[out], n).astype(np.float64),
        unit="tokens",
        function="per-expert load after one QB update",
        domain=f"{m} tokens, {n} experts, top-{k}; {band_tokens} tokens in the band left out",
        q=q,
        max_dev_before=int(np.abs(before - q).max()),
        max_dev_integer=int(np.abs(load_int - q).max()),
        max_dev_float64=int(np.abs(load_f - q).max()),
        max_load_difference_all_tokens=int(diff.max()),
        experts_with_other_load_all_tokens=int((diff > 0).sum()),
        band_tokens=band_tokens,
    )
    return {"before": before, "int": load_int, "float": load_f, "band_tokens": band_tokens}


def _quantile_balancing(ctx: GateContext, k, s: Shape, qp, rsf, sb, xb) -> None:
    zero = np.zeros(s.n, dtype=np.int64)
    q = QB_TOKENS * s.k // s.n
    b1 = k.qb_update(sb, zero, s.k)
    sf = ref.scores(value(xb, K.X_FRAC), value(qp["w_r"], K.W_FRAC))
    bf = ref.qb_update(sf, np.zeros(s.n), s.k)
    ctx.check_reference(
        "qb_bias",
        "one Quantile Balancing update in integers gives b' within the declared bound of "
        "float64's update on float64's scores (order statistics are 1-Lipschitz)",
        b1.astype(np.float64),
        np.ldexp(bf, K.S_FRAC),
        unit=Q40,
        function="b_j - (q+1)-th largest margin",
        domain=f"{QB_TOKENS} tokens, {s.n} experts, top-{s.k}, q = {q}",
    )
    _, idx_before, _ = k.router(xb, qp["w_r"], zero, s.k, rsf)
    _, idx_after, _ = k.router(xb, qp["w_r"], b1, s.k, rsf)
    loads = _qb_loads(ctx, "qb_loads", idx_before, idx_after, sf, bf, s.k)  # audit: reference loads
    load_before, load_int, load_f = loads["before"], loads["int"], loads["float"]
    diff = np.abs(load_int - load_f)
    band_tokens = loads["band_tokens"]
    perm = np.random.default_rng(SEED + 21).permutation(sb.shape[0])
    ctx.check_deterministic(
        "qb_deterministic",
        "the QB update on the batch in its order, in reverse token order and in a shuffled token "
        "order gives bit-identical biases: its order statistics (the (k+1)-th score of each "
        "token, the (q+1)-th margin of each column) do not depend on the tokens' order",
        {
            "tokens in order": b1,
            "tokens reversed": k.qb_update(np.ascontiguousarray(sb[::-1]), zero, s.k),
            "tokens shuffled": k.qb_update(np.ascontiguousarray(sb[perm]), zero, s.k),
        },
    )
    steps = [np.abs(load_before - q).max()]
    bi = zero
    for _ in range(4):
        bi = k.qb_update(sb, bi, s.k)
        _, ii, _ = k.router(xb, qp["w_r"], bi, s.k, rsf)
        steps.append(np.abs(ref.loads(ii, s.n) - q).max())
    ctx.artifact(
        "table:Quantile Balancing on a fixed batch (1024 tokens, 64 experts, top-8, q = 128)",
        {
            "columns": ["updates", "min load", "max load", "max |load − q|"],
            "rows": [
                [0, int(load_before.min()), int(load_before.max()), int(steps[0])],
                [1, int(load_int.min()), int(load_int.max()), int(steps[1])],
                *[[i, "", "", int(v)] for i, v in enumerate(steps[2:], start=2)],
            ],
        },
    )
    ctx.artifact(
        "table:one update, integer against float64",
        {
            "columns": ["", "integer", "float64"],
            "rows": [
                ["max |load − q|", int(np.abs(load_int - q).max()), int(np.abs(load_f - q).max())],
                ["experts with a different load", int((diff > 0).sum()), ""],
                ["tokens in the rounding band", band_tokens, ""],
            ],
        },
    )


def qb_balance_batch(s: Shape = TEST, m: int = QB_TOKENS, seed: int = SEED + 18) -> tuple:
    """A batch of m tokens over s.n experts, top-s.k, in which expert 0 starts with every token,
    built so that one exact Quantile Balancing update must balance it (see QB_BALANCE_BAND).

    The router is the identity (hidden width = n, W_r = I), so x holds the logits. Home sets:
    m / (n / k) groups of n / k tokens, each group a seeded partition of the n experts into sets
    of k, so every expert is home to exactly q = m k / n tokens and expert 0 to one token per
    group (the "A" tokens). Logits: expert 0 gets 3 + i 2^-12 for token i (σ in [0.953, 0.963],
    distinct, above everything else); a token's other home experts get 0.5 + 0.06 r by rank r
    (σ in [0.62, 0.72]; the A tokens' ranks start at 1); each A token has one "top low" expert
    at -1 (σ = 0.27), every other logit is -2 (σ = 0.12). Every expert but 0 is the top low
    expert of some A token. Returns (x Q.24 [m, n], W_r Q.24 [n, n], q).

    Why one update balances it (zero bias, c_i the (k+1)-th biased score, margins s_ij - c_i):
    an A token takes 0 and its k - 1 other homes, c_i = its top low score; a "B" token (0 not
    home) takes 0 and its homes of rank >= 1, c_i = its rank-0 home score σ(0.5). Column 0's
    margins are >= 0.953 - 0.269 for the q A tokens and <= 0.963 - 0.622 for the B tokens, so
    its (q+1)-th is the largest B margin, at the B token with the largest i. In any other column
    j the home tokens' margins are >= 0 (0 for the B tokens whose rank-0 home is j), at most q of
    them, and the A token whose top low expert is j adds one more 0: the (q+1)-th margin is 0,
    so b'_j = 0.
    """
    n, k = s.n, s.k
    q = m * k // n
    rng = np.random.default_rng(seed)
    homes = np.concatenate(
        [rng.permutation(n).reshape(n // k, k) for _ in range(m * k // n)]
    )  # [m, k]: group g's n / k tokens partition the experts
    logits = np.full((m, n), -2.0)
    a_tokens = [i for i in range(m) if 0 in homes[i]]
    low = {}
    free = list(a_tokens)
    for j in range(1, n):  # every expert j >= 1 is the top low expert of some A token
        i = next(i for i in free if j not in homes[i])
        free.remove(i)
        low[i] = j
    for i in free:
        low[i] = next(j for j in range(1, n) if j not in homes[i])
    for i in range(m):
        others = [int(e) for e in homes[i] if e != 0]
        first = 1 if i in low else 0
        for r, e in enumerate(others):
            logits[i, e] = 0.5 + 0.06 * (r + first)
        if i in low:
            logits[i, low[i]] = -1.0
        logits[i, 0] = 3.0 + i * 2.0**-12
    w_r = np.ascontiguousarray(np.eye(n, dtype=np.int64) << K.W_FRAC)
    return q24(logits), w_r, q


def check_qb_balance(ctx: GateContext, router, qb_update, name: str = "qb_balance") -> bool:
    """Quantile Balancing's own promise on a batch where one expert starts with every token: after
    ONE update, max_j |load_j - q| <= QB_BALANCE_BAND tokens (q = m k / n), the loads counted
    from the router run again with the new bias. `router` is the kernels' router; `qb_update`
    any function (s, b, k) -> b', so a test can hand in a no-op and watch this check fail."""
    s = TEST
    rsf = scalars()[0]
    x, w_r, q = qb_balance_batch(s)
    zero = np.zeros(s.n, dtype=np.int64)
    sc, idx0, _ = router(x, w_r, zero, s.k, rsf)
    before = ref.loads(idx0, s.n)
    b1 = np.asarray(qb_update(sc, zero, s.k), dtype=np.int64)
    _, idx1, _ = router(x, w_r, np.ascontiguousarray(b1), s.k, rsf)
    after = ref.loads(idx1, s.n)
    dev = int(np.abs(after - q).max())
    m = x.shape[0]
    return ctx.check(
        name,
        f"on a batch of {m} tokens where expert 0 starts with every token ({s.n} experts, "
        f"top-{s.k}, the rest balanced), one Quantile Balancing update brings every expert's "
        f"load within {QB_BALANCE_BAND} token of q = m·k/n = {q} when the router runs again with "
        "the new bias (the band declared before the run from the method: the (q+1)-th margin "
        "rule's one tie)",
        int(before[0]) == m and dev <= QB_BALANCE_BAND,
        message=f"max |load − q| = {dev} > {QB_BALANCE_BAND} (expert 0: {int(before[0])} tokens "
        f"before, {int(after[0])} after)",
        tokens=m,
        q=q,
        band=QB_BALANCE_BAND,
        expert_0_before=int(before[0]),
        expert_0_after=int(after[0]),
        max_dev_before=int(np.abs(before - q).max()),
        max_dev_after=dev,
        min_load_after=int(after.min()),
        max_load_after=int(after.max()),
    )


def _k3_shape(ctx: GateContext, k) -> None:
    """K3's router shape: 896 experts, top-16, on a hidden width of 64 (a stated stand-in for
    7168), 448 tokens, and one QB update at q = 8."""
    s = Shape(t=K3_TOKENS, d=64, d_l=8, f=4, n=K3_N, k=K3_K, f_s=4)
    rng = np.random.default_rng(SEED + 7)
    w_r = value(quantize(_fit_l1(_matrix(rng, s.n, s.d)), K.W_FRAC), K.W_FRAC)
    x = tokens(SEED + 8, s.t, s.d)
    rsf, rsf_f, _, _ = scalars()
    qw = np.ascontiguousarray(quantize(w_r, K.W_FRAC))
    zero = np.zeros(s.n, dtype=np.int64)
    sc, idx0, _ = k.router(q24(x), qw, zero, s.k, rsf)
    b = k.qb_update(sc, zero, s.k)
    sc, idx, wts = k.router(q24(x), qw, b, s.k, rsf)
    sf = ref.scores(x, w_r)
    bf = ref.qb_update(sf, np.zeros(s.n), s.k)
    _qb_loads(ctx, "k3_qb_loads", idx0, idx, sf, bf, s.k)  # audit: reference loads
    ctx.check_reference(
        "k3_qb_bias",
        f"at K3's {s.n}/{s.k} one QB update is within the declared bound of float64's",
        b.astype(np.float64),
        np.ldexp(bf, K.S_FRAC),
        unit=Q40,
        function="b_j - (q+1)-th largest margin",
        domain=f"{s.t} tokens, {s.n} experts, top-{s.k}, q = {s.t * s.k // s.n}",
    )
    ctx.check_reference(
        "k3_combine_weights",
        f"at K3's {s.n}/{s.k} the renormalised weights are within the declared bound of float64",
        np.ldexp(value(wts, K.C_FRAC), K.S_FRAC),
        np.ldexp(ref.combine_weights(sf, idx, rsf_f), K.S_FRAC),
        unit="2^-40",
        function="w_e = rsf s_e / Σ s",
        domain=f"{wts.size} weights, k = {s.k}",
    )
    agree = selection_agreement(idx, sf, value(b, K.S_FRAC), s.k)
    distinct = all(len(set(r)) == s.k for r in idx.tolist())
    total = np.abs(wts.sum(axis=1) - (rsf << (K.C_FRAC - K.W_FRAC))).max()
    ctx.check(
        "k3_shape_contract",
        f"at {s.n} experts, top-{s.k}: s is [T, {s.n}], idx and w are [T, {s.k}] with {s.k} "
        f"distinct experts in 0..{s.n - 1} per token, the weights sum to rsf within k LSB of "
        "Q.56, and the set equals float64's outside the rounding band (hidden width 64 stands in "
        "for 7168; the latent path is not run at K3 width)",
        sc.shape == (s.t, s.n)
        and idx.shape == wts.shape == (s.t, s.k)
        and distinct
        and bool((idx >= 0).all() and (idx < s.n).all())
        and total <= s.k
        and agree["agree_outside_band"],
        max_dev_before=int(np.abs(ref.loads(idx0, s.n) - s.t * s.k // s.n).max()),
        max_dev_after=int(np.abs(ref.loads(idx, s.n) - s.t * s.k // s.n).max()),
        **{f"selection_{key}": v for key, v in agree.items()},
    )


# == STRONG: the backward, routing held fixed =====================================================
def balanced_routing(s: Shape, seed: int) -> np.ndarray:
    """A fixed routing in which every expert serves exactly q = t k / n tokens: token t takes
    experts perm[(t + j n/k) mod n], j < k, under a seeded permutation of experts and tokens."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(s.n)
    t = rng.permutation(s.t)[:, None]
    j = np.arange(s.k)[None, :]
    return np.ascontiguousarray(perm[(t + j * (s.n // s.k)) % s.n]).astype(np.int64)


BACKWARD_Q = TEST.t * TEST.k // TEST.n  # 32 tokens per expert
GRADS = ("dwts", "dz", "dw1", "dw3", "dw2")
FD_NAMES = ("z", "wts", "w1", "w3", "w2")


@gate(
    "moe_backward",
    innovation="latentmoe",
    level="STRONG",
    kernels=["k3gates.moe.kernels"],
    bounds={
        name: lsb(bound)
        for name, bound in zip(
            GRADS, K.backward_bounds_q10(TEST.d_l, TEST.k, BACKWARD_Q), strict=True
        )
    }
    | {f"fd_{name}": ref.FD_MAX_ERR for name in FD_NAMES},
    timeout=300,
)
def moe_backward(ctx: GateContext) -> None:
    """The backward through the experts and the combine with the routing held fixed: the
    gradients of the combine weights, z, w1, w3 and w2 within the declared bounds of float64,
    whose own backward agrees with finite differences."""
    k = ctx.compiled()
    s = TEST
    p = params(SEED, s)
    qp = ints(p)
    rsf, _, eps, _ = scalars()
    qx = q24(tokens(SEED + 6, s.t, s.d))
    idx = balanced_routing(s, SEED + 11)
    wts = k.router_weights(qx, qp["w_r"], idx, rsf)
    _, z, _, _ = run_layer(k, qx, qp, idx, wts, eps)
    dc = np.ascontiguousarray(
        quantize(np.random.default_rng(SEED + 12).uniform(-1, 1, (s.t, s.d_l)), K.A_FRAC)
    )
    got = k.expert_backward(z, idx, wts, dc, qp["w1"], qp["w3"], qp["w2"])
    zf, wf, dcf = value(z, K.A_FRAC), value(wts, K.C_FRAC), value(dc, K.A_FRAC)
    want = ref.expert_backward(zf, idx, wf, dcf, p["w1"], p["w3"], p["w2"])
    for name, g in zip(GRADS, got, strict=True):
        ctx.check_reference(
            name,
            f"∂L/∂{name[1:]} in Q.32 is within the declared bound of float64's backward on the "
            "same z, routing and weights",
            g.astype(np.float64),
            np.ldexp(want[name], K.GRAD_FRAC),
            unit=Q32,
            function=f"∂L/∂{name[1:]}, L = Σ dc · c",
            domain=f"{s.t} tokens, {s.n} experts × {BACKWARD_Q} tokens each, top-{s.k}, "
            f"latent {s.d_l}, width {s.f}, dc uniform in [-1, 1]",
        )
    _backward_domain(ctx, p, zf, idx, wf, dcf)
    _finite_differences(ctx, p, zf, idx, wf, dcf)
    _backward_properties(ctx, k, qp, z, idx, wts, dc, got)
    bwd_args = (z, idx, wts, dc, qp["w1"], qp["w3"], qp["w2"])
    check_compiled(
        ctx, "compiled_backward", "expert_backward", *bwd_args,
        inputs=f"the gate's real inputs ({s.t} tokens, {BACKWARD_Q} per expert, top-{s.k})",
    )  # fmt: skip
    c_ = np.ascontiguousarray
    runs = {"tokens in order": got}
    for label, order in (
        ("tokens shuffled", np.random.default_rng(SEED + 16).permutation(s.t)),
        ("tokens reversed", np.arange(s.t)[::-1]),
    ):
        inv = np.argsort(order)
        out = k.expert_backward(
            c_(z[order]), c_(idx[order]), c_(wts[order]), c_(dc[order]), qp["w1"], qp["w3"],
            qp["w2"],
        )  # fmt: skip
        runs[f"{label} (dwts, dz un-permuted after)"] = (out[0][inv], out[1][inv], *out[2:])
    ctx.check_deterministic(
        "deterministic",
        "the backward over the tokens in their order, shuffled, and reversed (dwts, dz "
        "un-permuted after; dw1, dw3, dw2 then sum each expert's tokens in another order) gives "
        "bit-identical gradients: every weight-gradient sum is exact",
        runs,
    )
    ctx.check_threads(
        "threads",
        f"the backward over the {s.t} tokens (tokens, then experts, in parallel under OpenMP) "
        "gives bit-identical gradients here and in fresh processes with 1 and 2 threads",
        "expert_backward",
        *bwd_args,
    )
    worst = {c.name: c.measured for c in ctx.checks if c.name in GRADS}
    ctx.evidence(
        "backward through experts and combine, routing fixed: "
        + ", ".join(f"{n} {v:.3f}" for n, v in worst.items())
        + " LSB of Q.32; float64's backward agrees with finite differences"
    )


def _backward_domain(ctx: GateContext, p, zf, idx, wf, dcf) -> None:
    da = max(
        float(np.abs(p["w2"][idx[t, j]].T @ (wf[t, j] * dcf[t])).max())
        for t in range(idx.shape[0])
        for j in range(idx.shape[1])
    )
    values = {
        "max_abs_z": float(np.abs(zf).max()),
        "max_abs_dc": float(np.abs(dcf).max()),
        "max_abs_da": da,
        "tokens_per_expert": sorted(set(ref.loads(idx, TEST.n).tolist())),
    }
    ctx.check(
        "inputs_in_domain",
        f"the data lie in the domain the backward bounds are derived for: |z| <= {K.Z_MAX}, "
        f"|dc| <= {K.DC_MAX}, |da| = |w2^T (w dc)| <= {K.DA_MAX}, and exactly {BACKWARD_Q} "
        "tokens per expert",
        values["max_abs_z"] <= K.Z_MAX
        and values["max_abs_dc"] <= K.DC_MAX
        and da <= K.DA_MAX
        and values["tokens_per_expert"] == [BACKWARD_Q],
        **values,
    )


def _finite_differences(ctx: GateContext, p, zf, idx, wf, dcf) -> None:
    """float64's analytic backward against central differences of float64's forward, on 8
    tokens (a small loss keeps the differences' rounding small)."""
    rng = np.random.default_rng(SEED + 14)
    sl = slice(0, 8)
    z, ii, w, dc = zf[sl].copy(), idx[sl], wf[sl].copy(), dcf[sl]
    w1, w3, w2 = p["w1"].copy(), p["w3"].copy(), p["w2"].copy()
    grads = ref.expert_backward(z, ii, w, dc, w1, w3, w2)
    used = np.unique(ii)
    picks = {
        "z": [tuple(rng.integers(0, n) for n in z.shape) for _ in range(12)],
        "wts": [tuple(rng.integers(0, n) for n in w.shape) for _ in range(12)],
    }
    for name, arr in (("w1", w1), ("w3", w3), ("w2", w2)):
        picks[name] = [
            (int(rng.choice(used)), *(int(rng.integers(0, n)) for n in arr.shape[1:]))
            for _ in range(12)
        ]
    fd = ref.finite_differences(z, ii, w, dc, w1, w3, w2, picks)
    for name in FD_NAMES:
        key = "dwts" if name == "wts" else f"d{name}"
        analytic = np.array([grads[key][c] for c in picks[name]])
        ctx.check_reference(
            f"fd_{name}",
            f"float64's analytic ∂L/∂{name} (the reference the integers are held to) agrees with "
            f"central differences (h = 2^-14) of float64's forward",
            analytic,
            fd[name],
            unit="absolute",
            function=f"float64 ∂L/∂{name} vs finite differences",
            domain=f"12 seeded coordinates of {name}, 8 tokens",
        )


def _backward_properties(ctx: GateContext, k, qp, z, idx, wts, dc, got) -> None:
    zero = k.expert_backward(z, idx, wts, np.zeros_like(dc), qp["w1"], qp["w3"], qp["w2"])
    perm = np.random.default_rng(SEED + 15).permutation(idx.shape[1])
    slots = k.expert_backward(
        z, np.ascontiguousarray(idx[:, perm]), np.ascontiguousarray(wts[:, perm]), dc, qp["w1"],
        qp["w3"], qp["w2"],
    )  # fmt: skip
    unused = np.ascontiguousarray(np.where(idx == 0, 1, idx))  # expert 0 serves nobody
    none = k.expert_backward(z, unused, wts, dc, qp["w1"], qp["w3"], qp["w2"])
    ctx.check(
        "backward_properties",
        "dc = 0 gives exactly zero gradients; permuting the k slots of every token permutes dwts "
        "and leaves dz, dw1, dw3, dw2 bit-identical; an expert no token is routed to gets "
        "exactly zero weight gradients",
        all(not g.any() for g in zero)
        and bool(np.array_equal(slots[0], got[0][:, perm]))
        and bit_equal(slots[1:], got[1:])
        and not none[2][0].any()
        and not none[3][0].any()
        and not none[4][0].any(),
    )
