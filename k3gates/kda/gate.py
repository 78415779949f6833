"""Gates for Kimi Delta Attention: the gate and decay (PARTIAL), the recurrent serve form (HAVE),
the chunkwise-parallel training form (STRONG)."""

from __future__ import annotations

from math import isqrt

import numpy as np

from k3gates.infra.gate import GateContext, digest, gate

from ..fx import host
from . import kernels as K
from . import reference as ref

Q10 = 1024.0
T_GATE, H_GATE, DK_GATE, DV_GATE = 256, 2, 32, 32  # the shape the HAVE and STRONG gates run
CHUNKS = (16, 32, 64)
GRID = 1 << 22  # points of the decay grid over [-5, 0]


def _q(x: np.ndarray, frac: int, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(np.round(x * 2.0**frac).astype(dtype))


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _problem(rng, t_len=T_GATE, n_h=H_GATE, d_k=DK_GATE, d_v=DV_GATE, state=True):
    """Random K3-like inputs, quantised: unit q (times d_k^-1/2) and k, v ~ N(0, 1), the gate's
    g = -5 sigma(N(0, 2^2)) so alpha spans (e^-5, 1), beta = sigma(N(0, 1))."""
    k = rng.standard_normal((t_len, n_h, d_k))
    q = _unit(rng.standard_normal((t_len, n_h, d_k))) * host.inv_sqrt(d_k)
    g = -5.0 * host.sigmoid(2.0 * rng.standard_normal((t_len, n_h, d_k)))
    beta = host.sigmoid(rng.standard_normal((t_len, n_h)))
    s0 = rng.standard_normal((n_h, d_k, d_v)) * 0.25 if state else np.zeros((n_h, d_k, d_v))
    return {
        "qs": _q(q, K.QK_FRAC, np.int32),
        "k": _q(_unit(k) * (1 - 2.0**-23), K.QK_FRAC, np.int32),  # ||k|| <= 1 after rounding
        "v": _q(rng.standard_normal((t_len, n_h, d_v)), K.V_FRAC, np.int32),
        "g": _q(g, K.G_FRAC, np.int64),
        "beta": _q(beta, K.A_FRAC, np.int32),
        "s0": _q(s0, K.V_FRAC, np.int32),
    }


def recurrent_state_bound_lsb(t_len: int, d_k: int) -> int:
    """The recurrent form's own bound on each entry of the final state, LSB (a priori, from the
    analysis in kernels.py's docstring): a token's roundings (decay, u, w, the k w^T update) add
    at most sqrt(d_k) + 1 to a state column's 2-norm error, which the non-expansive KDA map never
    grows, so every entry is within T (sqrt(d_k) + 1) <= T (isqrt(d_k) + 2).
    K.state_bound_lsb covers the chunked form too, at any chunk size, and is looser."""
    return t_len * (isqrt(d_k) + 2)


def chunked_state_bound_lsb(t_len: int, d_k: int, chunk: int) -> int:
    """The chunked form's bound on each entry of the final state at chunk size C, LSB (a priori,
    kernels.py's docstring): sqrt(d_k) + 4 per token and 2 sqrt(d_k) more per chunk (the state
    rebuild), so T (sqrt(d_k) + 4) + 2 ceil(T / C) sqrt(d_k), with r = isqrt(d_k) + 1 >= sqrt(d_k).
    K.state_bound_lsb is this at C = 1."""
    r = isqrt(d_k) + 1
    return t_len * (r + 4) + 2 * ((t_len + chunk - 1) // chunk) * r


def _run(kern, p, alpha, form="recurrent", chunk=64):
    args = (p["qs"], p["k"], p["v"], alpha, p["beta"], p["s0"])
    if form == "recurrent":
        return kern.kda_recurrent(*args)
    return kern.kda_chunked(*args, chunk)


def _reference(p, alpha):
    """The float64 recurrence on exactly the kernel's quantised inputs, in output LSB."""
    o, S = ref.recurrent(
        p["qs"] / 2.0**K.QK_FRAC,
        p["k"] / 2.0**K.QK_FRAC,
        p["v"] / 2.0**K.V_FRAC,
        alpha / 2.0**K.A_FRAC,
        p["beta"] / 2.0**K.A_FRAC,
        p["s0"] / 2.0**K.V_FRAC,
    )
    return o * 2.0**K.V_FRAC, S * 2.0**K.V_FRAC


# -- PARTIAL --------------------------------------------------------------------------------------
@gate(
    "kda_gate_decay",
    innovation="kda",
    level="PARTIAL",
    kernels=["k3gates.kda.kernels"],
    bounds={
        "gate_vs_float64": K.GATE_MAX_ERR_LSB_Q10 / Q10,
        "decay_vs_float64": K.DECAY_MAX_ERR_LSB_Q10 / Q10,
    },
    timeout=300,
)
def kda_gate_decay(ctx: GateContext) -> None:
    """K3's lower-bounded gate g = -5 sigma(A (g_raw + dt_bias)) and the decay alpha = exp(g)."""
    kern = ctx.compiled()
    # the gate over a dense grid of pre-activations, for three head scales A
    x = np.linspace(-16.0, 16.0, 1 << 18)
    a_head = np.array([0.25, 1.0, 3.0])
    g_raw = np.broadcast_to(x[:, None, None], (x.size, 3, 1)).copy()
    dt_bias = np.array([[0.5], [-0.25], [0.0]])
    qa, qg, qb = _q(a_head, 24, np.int64), _q(g_raw, 24, np.int64), _q(dt_bias, 24, np.int64)
    got = kern.kda_gate(qg, qa, qb)
    want = ref.gate(qg / 2**24, qa / 2**24, qb / 2**24) * 2**24
    gate_err = float(np.abs(got - want).max())
    ctx.check_reference(
        "gate_vs_float64",
        "g = -5 sigma(A (g_raw + dt_bias)) in Q.24 is within 1/2 + 2^-10 LSB of "
        "float64 on a dense grid of 2^18 pre-activations x 3 head scales",
        got,
        want,
        unit="LSB (2^-24)",
        function="kda_gate",
        domain="grid, 2^18 points over [-16, 16] x 3 scales",
    )
    gf = got / 2**24
    ctx.check(
        "gate_bounded",
        "the gate is lower-bounded as K3's is: every g lies in [-5, 0]",
        bool(((gf >= -5) & (gf <= 0)).all()),
        g_min=float(gf.min()),
        g_max=float(gf.max()),
    )
    # the decay, on a dense grid of Q.24 log-decays covering K3's range [-5, 0]
    g = -np.round(np.linspace(0.0, 5.0, GRID) * 2**24).astype(np.int64).reshape(-1, 1, 1)
    alpha = kern.kda_decay(g)
    want = np.exp(g / 2**24) * 2**30
    decay_err = float(np.abs(alpha - want).max())
    ctx.check_reference(
        "decay_vs_float64",
        "alpha = exp(g) in Q0.30 is within 1/2 + 2^-10 LSB of float64 over 2^22 "
        "log-decays in [-5, 0]",
        alpha,
        want,
        unit="LSB (2^-30)",
        function="kda_decay",
        domain="grid, 2^22 points over [-5, 0]",
    )
    ctx.check(
        "decay_monotone",
        "alpha never increases as g decreases (no rounding inversion)",
        bool((np.diff(alpha.reshape(-1).astype(np.int64)) <= 0).all()),
    )
    # every 4096th point of the decay grid, and the edges: g > 0 (taken as 0), 0, -ln 2 in Q.24
    # (exp's upward correction of its k estimate), g <= -44 (exp below 2^-63) and g <= -64 (0)
    edges = [1 << 20, 0, -3, -(1 << 24) - 7, -11629080, -(43 << 24), -(44 << 24)]
    edges += [-(64 << 24) + 1, -(64 << 24), -(70 << 24)]
    small = np.concatenate([g[::4096, 0, 0], np.array(edges, dtype=np.int64)]).reshape(-1, 1, 1)
    ctx.check_compiled_matches_interpreted(
        "compiled_decay",
        "kda_decay",
        small,
        inputs=f"a slice: {small.shape[0]} log-decays, every 4096th of the grid plus its edges "
        "(g > 0, 0, -ln 2, -44, -64, -70), which reach every branch of kda_decay and of fx's "
        "exp_neg_q62 but the downward correction of its k estimate (no Q.24 input tried needs it)",
    )
    # every 4096th pre-activation of the grid, and g_raw = +-(2^31 - 1) LSB, where |A z| >= 64
    # takes the sigmoid's saturation branches
    extremes = np.full((2, 3, 1), (1 << 31) - 1, dtype=np.int64) * np.array([1, -1])[:, None, None]
    small_g = np.ascontiguousarray(np.concatenate([qg[::4096], extremes]))
    ctx.check_compiled_matches_interpreted(
        "compiled_gate",
        "kda_gate",
        small_g,
        qa,
        qb,
        inputs=f"a slice: {small_g.shape[0]} x 3 pre-activations, every 4096th of the grid plus "
        "+-(2^31 - 1) LSB, which reach every branch of kda_gate and of the fx sigmoid path it "
        "calls (both signs, and the |z| >= 64 clamp)",
    )
    ctx.evidence(
        f"the -5·σ gate and the exp decay are within {gate_err:.3f} and {decay_err:.3f} LSB of "
        f"float64 on {got.size + alpha.size:,} points"
    )


# -- HAVE -----------------------------------------------------------------------------------------
@gate(
    "kda_recurrent",
    innovation="kda",
    level="HAVE",
    kernels=["k3gates.kda.kernels"],
    bounds={
        # T (1 + 1/sqrt(d_k)) + 1/2: every token's roundings, never amplified (kernels.py)
        "reference": K.recurrent_bound_lsb(T_GATE, DK_GATE),
        # T (sqrt(d_k) + 1) per state entry: the same analysis, on a state column's 2-norm
        "state_reference": recurrent_state_bound_lsb(T_GATE, DK_GATE),
        "uniform_alpha_is_gated_deltanet": K.recurrent_bound_lsb(T_GATE, DK_GATE),
    },
    timeout=600,
)
def kda_recurrent(ctx: GateContext) -> None:
    """The recurrent (serve) form against float64, with KDA's own properties."""
    kern = ctx.compiled()
    rng = np.random.default_rng(20251030)
    p = _problem(rng)
    alpha = kern.kda_decay(p["g"])
    o, S, stats = _run(kern, p, alpha)
    want_o, want_S = _reference(p, alpha)
    shape = f"T={T_GATE}, H={H_GATE}, d_k=d_v={DK_GATE}"
    ctx.check_reference(
        "reference",
        f"o_t matches the float64 recurrence on the same inputs ({shape})",
        o,
        want_o,
        unit="LSB (2^-20)",
    )
    ctx.check_reference(
        "state_reference",
        "every entry of the final state is within T (sqrt(d_k) + 1) LSB of the float64 "
        "recurrence's, the recurrent form's own a priori bound",
        S,
        want_S,
        unit="LSB (2^-20)",
    )
    ctx.check(
        "in_domain",
        "no value saturated and |w| stayed in the analysed domain (<= 16)",
        stats[0] == 0 and stats[2] <= K.W_DOMAIN,
        saturations=int(stats[0]),
        max_abs_state=float(stats[1]) / 2**20,
        max_abs_w=float(stats[2]) / 2**20,
    )
    _check_overwrite(ctx, kern, rng)
    _check_pure_decay(ctx, kern, rng)
    _check_gated_deltanet(ctx, kern, rng)
    _check_split_and_state(ctx, kern, rng)
    args, sat = _branch_slice(kern)
    ctx.check_compiled_matches_interpreted(
        "compiled",
        "kda_recurrent",
        *args,
        inputs=f"a slice: T=12, H=2, d_k=d_v=8; head 0 random, head 1 driven past the Q.20 limit "
        f"({sat} saturations in this run), which reaches every branch of kda_recurrent: rows in "
        "range, the w clamp, and the redo of a row whose update overflowed int32",
    )
    # heads are independent: a permuted head order gives the permuted result, bit for bit
    ctx.check_deterministic(
        "deterministic",
        "a run with the heads in another order (restored afterwards) gives the same outputs and "
        "final state, bit for bit",
        {"heads in order": (o, S), "heads reversed, restored": _heads_reversed(kern, p, alpha)},
    )
    ctx.check_threads(
        "threads",
        f"the recurrent form ({shape}; heads in parallel) gives the same bits with 1 and with 2 "
        "OpenMP threads, each in a fresh process",
        "kda_recurrent",
        p["qs"],
        p["k"],
        p["v"],
        alpha,
        p["beta"],
        p["s0"],
    )
    # a fact, not a check: the carried state's size is fixed by its shape
    ctx.artifact(
        "table:the carried state",
        {
            "columns": ["tokens", "state shape", "bytes (int32)"],
            "rows": [[T_GATE, " x ".join(map(str, S.shape)), int(S.nbytes)]],
        },
    )
    err = float(np.abs(o - want_o).max())
    ctx.evidence(
        f"recurrent form within {err:.2f} LSB (2^-20) of float64 over {T_GATE} tokens; "
        f"exact overwrite, pure decay and state carry bit-exact; the state is "
        f"H·d_k·d_v int32 = {S.nbytes:,} bytes at any length"
    )


def _heads_reversed(kern, p, alpha, form="recurrent", chunk=64):
    """The same problem with its heads in reversed order, outputs and state restored."""
    perm = np.arange(p["k"].shape[1])[::-1]
    pp = {key: np.ascontiguousarray(val[:, perm]) for key, val in p.items() if key != "s0"}
    pp["s0"] = np.ascontiguousarray(p["s0"][perm])
    o, S, _ = _run(kern, pp, np.ascontiguousarray(alpha[:, perm]), form, chunk)
    return np.ascontiguousarray(o[:, perm]), np.ascontiguousarray(S[perm])


def _branch_slice(kern):
    """Arguments of kda_recurrent (and, with a chunk size, of kda_chunked) that reach every
    branch: T=12, H=2, d_k=d_v=8, head 0 as the gate draws it, head 1 driven past the Q.20 limit
    (|S0|, |v| near 2048, alpha = beta = 1, so w clamps and state rows overflow int32 and are
    redone saturating). Returns (args, saturations of kda_recurrent on them)."""
    rng = np.random.default_rng(5)
    p = _problem(rng, 12, 2, 8, 8)
    edge = (1 << 31) - (1 << 21)  # 2048 - 2 in Q.20
    p["s0"][1] = edge * rng.choice([-1, 1], (8, 8))
    p["v"][:, 1] = edge * rng.choice([-1, 1], (12, 8))
    p["beta"][:, 1] = 1 << K.A_FRAC
    p["g"][:, 1] = 0  # alpha = 1: nothing decays
    args = (p["qs"], p["k"], p["v"], kern.kda_decay(p["g"]), p["beta"], p["s0"])
    return args, int(kern.kda_recurrent(*args)[2][0])


def _check_overwrite(ctx: GateContext, kern, rng) -> None:
    """beta = 1 with a basis-vector key: S_t^T k_t = v_t exactly, whatever the decay."""
    p = _problem(rng, 64, 1, 16, 16)
    idx = rng.integers(0, 16, 64)
    p["k"] = np.zeros_like(p["k"])
    p["k"][np.arange(64), 0, idx] = 1 << K.QK_FRAC
    p["beta"] = np.full_like(p["beta"], 1 << K.A_FRAC)
    alpha = kern.kda_decay(p["g"])
    S = p["s0"]
    exact = 0
    for t in range(64):
        one = {key: (val[t : t + 1] if key != "s0" else S) for key, val in p.items()}
        _, S, _ = _run(kern, one, np.ascontiguousarray(alpha[t : t + 1]))
        exact += int(np.array_equal(S[0, idx[t]], p["v"][t, 0]))
    ctx.check(
        "overwrite_exact",
        "with beta = 1 and a basis-vector key, S_t^T k_t = v_t bit for bit at every one of "
        "64 steps, for random decays: the same key rewritten gives v2, not v1 + v2",
        exact == 64,
        steps_exact=exact,
    )


def _round_shift(x: np.ndarray, s: int) -> np.ndarray:
    """Round half away from zero of x / 2^s, written independently of fx (numpy int64)."""
    mag = (np.abs(x) + (1 << (s - 1))) >> s
    return np.where(x < 0, -mag, mag)


def _check_pure_decay(ctx: GateContext, kern, rng) -> None:
    p = _problem(rng, 32, 2, 16, 16)
    p["beta"] = np.zeros_like(p["beta"])
    alpha = kern.kda_decay(p["g"])
    _, S, _ = _run(kern, p, alpha)
    want = p["s0"].astype(np.int64)
    for t in range(32):
        want = _round_shift(alpha[t][:, :, None].astype(np.int64) * want, K.A_FRAC)
    ctx.check(
        "pure_decay_exact",
        "beta = 0 is pure decay: S_t = Diag(alpha_t) S_{t-1}, bit for bit against an "
        "independent integer computation, over 32 steps",
        bool(np.array_equal(S.astype(np.int64), want)),
    )


def _check_gated_deltanet(ctx: GateContext, kern, rng) -> None:
    p = _problem(rng)
    # one decay per head and token
    a_scalar = kern.kda_decay(np.ascontiguousarray(p["g"][:, :, :1]))
    alpha = np.ascontiguousarray(np.repeat(a_scalar, DK_GATE, axis=2))
    o, _, _ = _run(kern, p, alpha)
    want, _ = ref.gated_deltanet(
        p["qs"] / 2.0**24,
        p["k"] / 2.0**24,
        p["v"] / 2.0**20,
        a_scalar[:, :, 0] / 2.0**30,
        p["beta"] / 2.0**30,
        p["s0"] / 2.0**20,
    )
    ctx.check_reference(
        "uniform_alpha_is_gated_deltanet",
        "with alpha equal in every channel, KDA reproduces Gated DeltaNet's "
        "recurrence S_t = alpha_t (I - beta k k^T) S_{t-1} + beta k v^T",
        o,
        want * 2**20,
        unit="LSB (2^-20)",
    )


def _check_split_and_state(ctx: GateContext, kern, rng) -> None:
    p = _problem(rng, 200, 2, 16, 16)
    alpha = kern.kda_decay(p["g"])
    o, S, _ = _run(kern, p, alpha)
    cut = 77
    first = {key: (val[:cut] if key != "s0" else val) for key, val in p.items()}
    o1, S1, _ = _run(kern, first, np.ascontiguousarray(alpha[:cut]))
    rest = {key: (val[cut:] if key != "s0" else S1) for key, val in p.items()}
    o2, S2, _ = _run(kern, rest, np.ascontiguousarray(alpha[cut:]))
    ctx.check(
        "split_carry_exact",
        "running x1 and then x2 from x1's final state equals running [x1; x2], bit for bit",
        digest(np.concatenate([o1, o2]), S2) == digest(o, S),
    )


# -- STRONG ---------------------------------------------------------------------------------------
@gate(
    "kda_chunked",
    innovation="kda",
    level="STRONG",
    kernels=["k3gates.kda.kernels"],
    # T (2 + 4/sqrt(d_k)) + 2 T/C + 1: the chunked form's roundings, never amplified (kernels.py)
    bounds={f"chunk{c}_reference": K.chunked_bound_lsb(T_GATE, DK_GATE, c) for c in CHUNKS}
    # worst case: the two forms' bounds added (triangle inequality through float64)
    | {
        f"chunk{c}_vs_recurrent": K.chunked_bound_lsb(T_GATE, DK_GATE, c)
        + K.recurrent_bound_lsb(T_GATE, DK_GATE)
        for c in CHUNKS
    }
    # T (sqrt(d_k) + 4) + 2 (T/C) sqrt(d_k) per state entry at C = 64: the same analysis
    | {"state_reference": chunked_state_bound_lsb(T_GATE, DK_GATE, 64)},
    timeout=900,
)
def kda_chunked(ctx: GateContext) -> None:
    """The chunkwise-parallel (training) form against float64 and against the recurrent form."""
    kern = ctx.compiled()
    p = _problem(np.random.default_rng(20251031))
    alpha = kern.kda_decay(p["g"])
    o_rec, _, _ = _run(kern, p, alpha)
    want_o, want_S = _reference(p, alpha)
    outs = {}
    for c in CHUNKS:
        o, S, stats = _run(kern, p, alpha, "chunked", c)
        outs[c] = (o, S)
        ctx.check_reference(
            f"chunk{c}_reference",
            f"the chunked form with C = {c} matches float64 on the same inputs",
            o,
            want_o,
            unit="LSB (2^-20)",
        )
        ctx.check_reference(
            f"chunk{c}_vs_recurrent",
            f"chunked (C = {c}) and recurrent differ only by rounding, within the "
            "sum of their declared bounds: they round different partial products "
            f"(a rigorous worst case; chunk{c}_reference holds the same output tightly)",
            o,
            o_rec,
            unit="LSB (2^-20)",
            worst_case=True,
            tight=f"chunk{c}_reference",
        )
        ctx.check(
            f"chunk{c}_in_domain",
            "no saturation; |w| within the analysed domain",
            stats[0] == 0 and stats[2] <= K.W_DOMAIN,
            saturations=int(stats[0]),
        )
    ctx.check_reference(
        "state_reference",
        "every entry of the chunked final state (C = 64) is within the chunked form's a priori "
        "bound, T (sqrt(d_k) + 4) + 2 (T/C) sqrt(d_k) LSB, of the float64 recurrence's",
        outs[64][1],
        want_S,
        unit="LSB (2^-20)",
    )
    # restartable at chunk boundaries: [x1; x2] equals x1 then x2 when len(x1) is a multiple of C
    cut = 128
    first = {key: (val[:cut] if key != "s0" else val) for key, val in p.items()}
    o1, S1, _ = _run(kern, first, np.ascontiguousarray(alpha[:cut]), "chunked", 64)
    rest = {key: (val[cut:] if key != "s0" else S1) for key, val in p.items()}
    o2, S2, _ = _run(kern, rest, np.ascontiguousarray(alpha[cut:]), "chunked", 64)
    ctx.check(
        "chunk_boundary_carry_exact",
        "the chunked form carries its state across a chunk boundary bit for bit: running "
        "128 tokens and then 128 more equals running all 256 (C = 64)",
        digest(np.concatenate([o1, o2]), S2) == digest(*outs[64]),
    )
    args, _ = _branch_slice(kern)
    sat = int(kern.kda_chunked(*args, 5)[2][0])
    ctx.check_compiled_matches_interpreted(
        "compiled",
        "kda_chunked",
        *args,
        5,
        inputs=f"a slice: T=12, H=2, d_k=d_v=8, C=5 (chunks of 5, 5 and a partial 2); head 0 "
        f"random, head 1 driven past the Q.20 limit ({sat} saturations in this run), which "
        "reaches every branch of kda_chunked and its clamps",
    )
    # bit-equal across what a float implementation would be sensitive to: the order of the
    # (independent) heads, and the split points of the carried sequence at chunk boundaries
    pieces, S_c = [], p["s0"]
    for lo, hi in ((0, 96), (96, 160), (160, T_GATE)):
        part = {key: (val[lo:hi] if key != "s0" else S_c) for key, val in p.items()}
        o_c, S_c, _ = _run(kern, part, np.ascontiguousarray(alpha[lo:hi]), "chunked", 32)
        pieces.append(o_c)
    ctx.check_deterministic(
        "deterministic",
        "the chunked form (C = 32) gives the same outputs and final state, bit for bit, with "
        "the heads in reversed order (restored afterwards) and in three calls split at tokens "
        "96 and 160 with the state carried",
        {
            "whole, heads in order": outs[32],
            "heads reversed, restored": _heads_reversed(kern, p, alpha, "chunked", 32),
            "split at 96 and 160": (np.concatenate(pieces), S_c),
        },
    )
    ctx.check_threads(
        "threads",
        f"the chunked form (T={T_GATE}, H={H_GATE}, d_k=d_v={DK_GATE}, C = 32; heads in "
        "parallel) gives the same bits with 1 and with 2 OpenMP threads, each in a fresh process",
        "kda_chunked",
        p["qs"],
        p["k"],
        p["v"],
        alpha,
        p["beta"],
        p["s0"],
        32,
    )
    worst = max(float(np.abs(outs[c][0].astype(np.int64) - o_rec).max()) for c in CHUNKS)
    ctx.artifact(
        "table:chunked against recurrent",
        {
            "columns": [
                "chunk size",
                "max |chunked - float64| (LSB)",
                "max |chunked - recurrent| (LSB)",
                "declared bound vs float64 (LSB)",
            ],
            "rows": [
                [
                    c,
                    float(np.abs(outs[c][0] - want_o).max()),
                    float(np.abs(outs[c][0].astype(np.int64) - o_rec).max()),
                    K.chunked_bound_lsb(T_GATE, DK_GATE, c),
                ]
                for c in CHUNKS
            ],
        },
    )
    ctx.evidence(
        f"chunked form (C = 16, 32, 64) within {worst:.0f} LSB of the recurrent form; "
        "carry across chunk boundaries bit-exact"
    )
