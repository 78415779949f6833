"""Per-Head Muon gates: NS5 in fixed point (PARTIAL), the Muon step (HAVE), per-head isolation and
order-independence (STRONG), and an attention layer trained with integer Per-Head Muon (PROVEN).
Bounds and tolerances come from k3gates/muon/kernels.py, declared before any run.

Inputs. NS5's singular-value property (K3-SPEC: "about (0.5, 1.5)") holds for inputs whose
smallest singular value is not tiny: five steps lift sigma_min / ||G||_F from 0.05 to 0.68, but a
square Gaussian matrix has sigma_min ~ 1/n and Muon leaves it small. The NS5 gate therefore draws
Gaussian matrices with aspect ratio 3 or 4 (sigma_min / ||G||_F ~ 0.05 to 0.13, measured and
reported), and uses square ones only for the transposition and permutation properties.
"""

from __future__ import annotations

import itertools

import numpy as np

from k3gates.fx.checks import lsb
from k3gates.infra.gate import GateContext, bit_equal, gate
from k3gates.infra.training import check_training, start_rerun

from ..fx import host
from . import reference as ref
from .kernels import (
    GRAD_FRAC,
    HYPER_FRAC,
    MOMENTUM_MAX_ERR_LSB_Q10,
    NS5_TOL_LSB,
    NS5_TOL_MAX_ROWS,
    QKCLIP_MAX_ERR_LSB_Q10,
    STEP_MAX_ERR_LSB_Q10,
    TRAIN_FRAC,
    X_FRAC,
    ns_step_bound_q10,
    step_tolerance_lsb,
)

KERNELS = "k3gates.muon.kernels"
SEED = 20260705
LSB14 = "LSB (2^-14)"
LSB24 = "LSB (2^-24)"
G_FRAC = 24  # the NS5 gate's inputs: Gaussian matrices in Q.24
EPS_RAW = 2  # round(1e-7 * 2^24): K3-SPEC's eps in the NS5 inputs' format (Q.24)
STEP_EPS = 430  # round(1e-7 * 2^32): the same eps for gradients in Q.32
NS_SHAPES = ((32, 96), (96, 32), (16, 64), (48, 160), (64, 192))  # rows <= NS5_TOL_MAX_ROWS
SQUARES = (24, 40, 64)
KAPPA_MIN = 0.05  # sigma_min / ||G||_F the NS5 tolerance's model assumed
S_MAX = 1.25  # ||X||_2 the local bound assumed
# NS5 from the kernel's own X_0, a priori (the first-order model of kernels.py's docstring,
# recomputed in tests/test_muon_kernels.py): each of the five steps adds at most the local bound
# (0.78 LSB at m <= 64) and the later steps amplify those errors by at most 54 in sum, so
# |NS5 - float64 NS5 from X_0| <= 0.78 x 54 = 42 LSB (the normalisation's term, 119 x 1/2 LSB,
# is what the looser declared NS5_TOL_LSB adds on top).
NS5_STEP_GAIN = 54

# the Muon step's hyper-parameters (Q.30) and shapes, fixed so that the bounds are declared
MU_Q = round(0.95 * 2**HYPER_FRAC)
LR_Q = round(0.02 * 2**HYPER_FRAC)
WD_Q = round(0.1 * 2**HYPER_FRAC)
STEP_SHAPE = (48, 144)
HEADS, D_HEAD, D_MODEL = 4, 16, 48  # per-head: W_Q-like [64, 48] by rows, W_O-like [48, 64]
TAU = 100.0  # QK-Clip threshold (Kimi K2)
# declared: a clipped head's max logit lands on tau to 1e-5 relative (the weights' 1/2 LSB of
# Q.24 and sqrt(gamma)'s 2^-31 move a logit of 100 by far less)
QK_CLIP_TAU_TOL = 1e-5


def q(a: np.ndarray, frac: int) -> np.ndarray:
    return np.ascontiguousarray(np.round(np.asarray(a) * 2.0**frac).astype(np.int64))


def real(a: np.ndarray, frac: int) -> np.ndarray:
    return np.ldexp(np.asarray(a, dtype=np.float64), -frac)


def check_compiled(ctx: GateContext, name: str, func: str, *args, inputs: str) -> None:
    """compiled == interpreted on `inputs`, timed after one warm-up call (the first call of an
    OpenMP kernel starts the thread pool, which would otherwise dominate the speed ratio)."""
    getattr(ctx.compiled(), func)(*args)
    ctx.check_compiled_matches_interpreted(name, func, *args, inputs=inputs)


def _kappa(g: np.ndarray) -> float:
    s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
    return float(s[-1] / np.linalg.norm(s))


def _ns_inputs(rng: np.random.Generator) -> list[np.ndarray]:
    """Two seeded Gaussian matrices of each NS_SHAPES shape, in Q.24."""
    return [q(rng.standard_normal(shape), G_FRAC) for shape in NS_SHAPES for _ in range(2)]


def _trajectory(k, g: np.ndarray) -> tuple[list[np.ndarray], int]:
    """The integer iterates X_0 .. X_5 (wide orientation) of NS5(g), through ns_step."""
    x = k.normalise(g, EPS_RAW)
    if g.shape[0] > g.shape[1]:
        x = np.ascontiguousarray(x.T)
    xs, guard = [x], 0
    for _ in range(5):
        x, gd = k.ns_step(x)
        xs.append(x)
        guard += gd
    return xs, guard


# == PARTIAL: NS5 =================================================================================
@gate(
    "muon_ns5",
    innovation="perheadmuon",
    level="PARTIAL",
    kernels=["k3gates.muon.kernels"],
    bounds={
        "ns_step": lsb(ns_step_bound_q10(NS5_TOL_MAX_ROWS)),
        "ns5_given_x0": lsb(ns_step_bound_q10(NS5_TOL_MAX_ROWS)) * NS5_STEP_GAIN,
        "ns5_vs_float64": NS5_TOL_LSB,
    },
    timeout=180,
)
def muon_ns5(ctx: GateContext) -> None:
    """Newton-Schulz-5 in fixed point: each iteration within its derived bound of float64, NS5
    within its declared tolerance, singular values in (0.5, 1.5), NS5(G^T) = NS5(G)^T."""
    k = ctx.compiled()
    gs = _ns_inputs(np.random.default_rng(SEED))
    outs = [k.ns5(g, EPS_RAW) for g in gs]
    got, want, smax, guards, same = [], [], [], [int(o[1]) for o in outs], True
    x0s = []
    for g, o in zip(gs, outs, strict=True):
        xs, guard = _trajectory(k, g)
        x0s.append(xs[0])
        guards.append(guard)
        same &= np.array_equal(xs[-1], o[0].T if g.shape[0] > g.shape[1] else o[0])
        for x, x_next in itertools.pairwise(xs):
            got.append(x_next.astype(np.float64).ravel())
            want.append(ref.ns_iteration(real(x, X_FRAC)).ravel() * 2.0**X_FRAC)
            smax.append(float(np.linalg.norm(real(x, X_FRAC), 2)))
    ctx.check_reference(
        "ns_step",
        "every Newton-Schulz iteration of the integer kernel, from each integer iterate, is "
        "within the bound derived in kernels.py (m <= 64) of the exact float64 iteration from "
        "that iterate",
        np.concatenate(got),
        np.concatenate(want),
        unit=LSB14,
        function="one NS iteration X <- aX + (bA + cA²)X",
        domain=f"5 iterations of each of {len(gs)} seeded Gaussian matrices, shapes {NS_SHAPES}",
    )
    local = ctx.checks[-1].measured
    ns5_out = np.concatenate([o[0].astype(np.float64).ravel() for o in outs])
    ctx.check_reference(
        "ns5_given_x0",
        "NS5 of each G (the kernel's output) is within 54 times the local bound (the first-order "
        "model's summed amplification of the five steps' errors) of five float64 iterations "
        "from the kernel's own normalised X_0",
        ns5_out,
        np.concatenate([_from_x0(g, xs0) for g, xs0 in zip(gs, x0s, strict=True)]),
        unit=LSB14,
        function="five float64 NS iterations from the integer X_0",
        domain=f"{len(gs)} seeded Gaussian matrices, shapes {NS_SHAPES}",
    )
    given = ctx.checks[-1].measured
    ctx.check_reference(
        "ns5_vs_float64",
        "NS5 of each quantised G is within the declared tolerance (2^-7) of float64 NS5 of the "
        "same G; a tolerance from a first-order model, not a proof (kernels.py docstring), "
        "looser than 5% of the output's RMS, so it stands as a worst case beside ns5_given_x0",
        ns5_out,
        np.concatenate(
            [ref.ns5(real(g, G_FRAC), EPS_RAW / 2**G_FRAC).ravel() * 2**X_FRAC for g in gs]
        ),
        unit=LSB14,
        worst_case=True,
        tight="ns5_given_x0",
        function="NS5(G) = five NS iterations of G/(||G||_F + eps)",
        domain=f"{len(gs)} seeded Gaussian matrices, shapes {NS_SHAPES}",
    )
    err = ctx.checks[-1].measured
    kappas = [_kappa(g) for g in gs]
    ctx.check(
        "premise",
        f"the premises of both analyses held: every input has sigma_min/||G||_F >= {KAPPA_MIN}, "
        f"every integer iterate has ||X||_2 <= {S_MAX}, no int32 guard tripped (no int64 "
        "fallback, no saturation); and NS5's output is bit for bit the fifth checked iterate",
        min(kappas) >= KAPPA_MIN and max(smax) <= S_MAX and max(guards) == 0 and same,
        min_kappa=min(kappas),
        max_iterate_norm=max(smax),
        guard=max(guards),
        ns5_is_fifth_iterate=same,
    )
    s_lo, s_hi = _singular_values(ctx, outs)
    _transpose(ctx, k, gs)
    _equivariance(ctx, k, gs)
    check_compiled(
        ctx, "compiled_ns5", "ns5", _square_edge(), 3,
        inputs="a slice: one 7×7 matrix, which reaches every branch of ns5 on the int32 path "
        "because its entries up to 2^40 force the pre-shift to 31 bits and eps's rescaling by a "
        "right shift, it is square with its columns winning (the orientation rule, transposed "
        "in and out), 7 leaves remainders in every unrolled matmul loop, and it holds zeros and "
        "both signs (the all-zero G's early return aside)",
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_step", "ns_step", _trajectory(k, gs[4][:5, :13].copy())[0][1],
        inputs="a slice: the first iterate X_1 (5×13, int16 Q1.14) of a 5×13 corner of one of "
        "the gate's inputs, which reaches every branch of ns_step's int32 path because 5 and 13 "
        "leave remainders in every unrolled matmul loop and its entries have both signs, so A, "
        "B and X_new round both ways",
    )  # fmt: skip
    check_compiled(
        ctx, "compiled_fallback", "ns_step", _fallback_iterate(),
        inputs="a slice: one 3×9 int16 iterate with rows of norm 2^16.5, which breaks the "
        "Cauchy-Schwarz guard, so ns_step takes its int64 and saturating branches (the gate's "
        "own inputs never do: premise guard = 0)",
    )  # fmt: skip
    perm = np.random.default_rng(SEED + 1).permutation(gs[0].shape[0])
    ctx.check_deterministic(
        "deterministic",
        "NS5 of G and NS5 of G with its rows permuted (un-permuted after; the sums over rows "
        "in A^2 and B X then run in another order) give bit-identical outputs",
        {
            "as given": outs[0],
            "rows permuted": (
                k.ns5(np.ascontiguousarray(gs[0][perm]), EPS_RAW)[0][np.argsort(perm)],
                outs[0][1],
            ),
        },
    )
    ctx.evidence(
        f"NS5 in int16 Q1.14: each iteration within {local:.3f} LSB of float64 "
        "(bound "
        f"{lsb(ns_step_bound_q10(NS5_TOL_MAX_ROWS)):.3f}), NS5 within {given:.1f} LSB of float64 "
        f"from the integer X_0 (bound {ctx.spec.bounds['ns5_given_x0']:.1f}) and {err:.1f} LSB "
        f"from G (tolerance {NS5_TOL_LSB}); singular values in "
        f"[{s_lo:.3f}, {s_hi:.3f}]"
    )


def _from_x0(g: np.ndarray, x0: np.ndarray) -> np.ndarray:
    """Five float64 NS iterations from the integer X_0 (wide), in G's orientation, in LSB."""
    x = real(x0, X_FRAC)
    for _ in range(5):
        x = ref.ns_iteration(x)
    return (x.T if g.shape[0] > g.shape[1] else x).ravel() * 2.0**X_FRAC


def _square_edge() -> np.ndarray:
    """A square G whose first column holds entries near 2^40: pre-shift, columns win."""
    g = np.random.default_rng(SEED + 5).integers(-(2**34), 2**34, (7, 7))
    g[:, 0] = [-(2**40), 2**39 + 3, -(2**38) - 1, 2**39, -(2**37), 2**40 - 5, 2**38]
    g[2, 3], g[4, 4] = 0, 2**33 + 1
    return np.ascontiguousarray(g)


def _fallback_iterate() -> np.ndarray:
    """Rows of norm 3 x 30000 = 2^16.5 (> 2^15.5 the int32 path allows): the int64 branch."""
    x = np.full((3, 9), 30000, dtype=np.int16)
    x[1] = -x[1]
    x[2, ::2] = -x[2, ::2]
    return x


def _singular_values(ctx: GateContext, outs: list) -> tuple[float, float]:
    s = np.concatenate([np.linalg.svd(real(o[0], X_FRAC), compute_uv=False) for o in outs])
    ctx.check(
        "singular_values",
        "the singular values of every integer NS5 output, measured by a float64 SVD, lie in "
        "(0.5, 1.5)",
        bool(s.min() > 0.5 and s.max() < 1.5),
        min=float(s.min()),
        max=float(s.max()),
        count=int(s.size),
    )
    return float(s.min()), float(s.max())


def _transpose(ctx: GateContext, k, gs: list) -> None:
    """NS5(G^T) = NS5(G)^T, and what the square orientation rule is needed for."""
    rng = np.random.default_rng(SEED + 2)
    squares = [q(rng.standard_normal((n, n)), G_FRAC) for n in SQUARES]
    same = all(
        np.array_equal(k.ns5(np.ascontiguousarray(g.T), EPS_RAW)[0], k.ns5(g, EPS_RAW)[0].T)
        for g in gs + squares
    )
    # without the rule, the two orientations of a square G are different integer computations
    differ = 0
    for g in squares:
        a = _trajectory(k, g)[0][-1]
        b = _trajectory(k, np.ascontiguousarray(g.T))[0][-1]
        differ += int(np.count_nonzero(a != b.T))
    ctx.check(
        "transpose",
        "NS5(G^T) = NS5(G)^T bit for bit, for wide, tall and square G. For non-square G this is "
        "structural (both are reduced to the same wide integer matrix before any arithmetic); for "
        "square G it rests on the kernel's orientation rule, since iterating G and G^T as they are "
        "gives different integers (counted here)",
        same,
        matrices=len(gs) + len(squares),
        square_entries_differing_without_rule=differ,
    )


def _equivariance(ctx: GateContext, k, gs: list) -> None:
    """Permutations, signs and powers of two commute with the integer NS5 bit for bit."""
    rng = np.random.default_rng(SEED + 3)
    ok_perm, ok_sign, ok_pow2, scale_err = True, True, True, 0.0
    for g in [*gs, q(rng.standard_normal((32, 32)), G_FRAC)]:
        o = k.ns5(g, 0)[0]
        pr, pc = rng.permutation(g.shape[0]), rng.permutation(g.shape[1])
        op = k.ns5(np.ascontiguousarray(g[pr][:, pc]), 0)[0]
        ok_perm &= np.array_equal(op, o[pr][:, pc])
        ok_sign &= np.array_equal(k.ns5(-g, 0)[0], -o)
        ok_pow2 &= np.array_equal(k.ns5(g << 5, 0)[0], o) and np.array_equal(k.ns5(g << 9, 0)[0], o)
        scale_err = max(scale_err, float(np.abs(k.ns5(3 * g, 0)[0] - o.astype(np.int64)).max()))
    ctx.check(
        "equivariance",
        "NS5(P G Q) = P NS5(G) Q bit for bit for random row and column permutations (the integer "
        "sums then run in another order), NS5(-G) = -NS5(G), NS5(2^k G) = NS5(G), and NS5(3G) "
        "is within twice the NS5 tolerance of NS5(G) (K3-SPEC: NS5(cG) ~ NS5(G))",
        ok_perm and ok_sign and ok_pow2 and scale_err <= 2 * NS5_TOL_LSB,
        permutation=ok_perm,
        sign=ok_sign,
        power_of_two=ok_pow2,
        max_diff_3g_lsb=scale_err,
    )


# == HAVE: the Muon step ==========================================================================
def _step_problem(rng: np.random.Generator, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """W ~ N(0, 1/cols) in Q.24; G ~ N(0, 1) 2^-6 and a previous momentum M ~ N(0, 1) 2^-4, both
    in Q.32 (GRAD_FRAC)."""
    return {
        "W": q(rng.standard_normal(shape) / np.sqrt(shape[1]), TRAIN_FRAC),
        "M": q(rng.standard_normal(shape) * 2.0**-4, GRAD_FRAC),
        "G": q(rng.standard_normal(shape) * 2.0**-6, GRAD_FRAC),
    }


def _hyper() -> dict[str, float]:
    return {"mu": MU_Q / 2**HYPER_FRAC, "lr": LR_Q / 2**HYPER_FRAC, "wd": WD_Q / 2**HYPER_FRAC}


def _run_step(k, p: dict, heads: int = 1, axis: int = 0, nesterov: int = 1) -> tuple:
    return k.muon_step(
        p["W"], p["M"], p["G"], MU_Q, LR_Q, WD_Q, nesterov, heads, axis, TRAIN_FRAC, STEP_EPS
    )


def _references(k, p: dict, heads: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(W_new given the kernel's own O, W_new with float64 NS5), both float64 in LSB of Q.24."""
    _, n_int = k.momentum(p["M"], p["G"], MU_Q, 1)
    slices = ref.head_slices(n_int.shape, heads, axis)
    o_int = [real(k.ns5(np.ascontiguousarray(n_int[sl]), STEP_EPS)[0], X_FRAC) for sl in slices]
    args = (real(p["W"], TRAIN_FRAC), real(p["M"], GRAD_FRAC), real(p["G"], GRAD_FRAC))
    eps = STEP_EPS / 2**GRAD_FRAC
    given, _ = ref.muon_step(
        *args, **_hyper(), heads=heads, axis=axis, eps=eps, orthogonalise=lambda h, _n: o_int[h]
    )
    full, _ = ref.muon_step(*args, **_hyper(), heads=heads, axis=axis, eps=eps)
    return given * 2.0**TRAIN_FRAC, full * 2.0**TRAIN_FRAC


@gate(
    "muon_step",
    innovation="perheadmuon",
    level="HAVE",
    kernels=["k3gates.muon.kernels"],
    bounds={
        "momentum": lsb(MOMENTUM_MAX_ERR_LSB_Q10),
        "step_given_ns5": lsb(STEP_MAX_ERR_LSB_Q10),
        "step_vs_float64": step_tolerance_lsb(LR_Q, max(STEP_SHAPE), TRAIN_FRAC),
        "qk_clip": lsb(QKCLIP_MAX_ERR_LSB_Q10),
        "qk_clip_tau": QK_CLIP_TAU_TOL,
    },
    timeout=180,
)
def muon_step(ctx: GateContext) -> None:
    """The full Muon step (momentum, Nesterov, 0.2 sqrt(max(A, B)) scaling, decoupled weight
    decay) against float64, and QK-Clip."""
    k = ctx.compiled()
    p = _step_problem(np.random.default_rng(SEED + 10), STEP_SHAPE)
    w_new, m_new, guard = _run_step(k, p)
    mu = MU_Q / 2**HYPER_FRAC
    m_int, n_int = k.momentum(p["M"], p["G"], MU_Q, 1)
    want_m = mu * p["M"].astype(np.float64) + p["G"]
    ctx.check_reference(
        "momentum",
        "M <- mu M + G and Nesterov's N = G + mu M are each within one rounding of float64",
        np.concatenate([m_new.ravel(), n_int.ravel()]).astype(np.float64),
        np.concatenate([want_m.ravel(), (p["G"] + mu * m_int.astype(np.float64)).ravel()]),
        unit="LSB (2^-32)",
        function="momentum and Nesterov input",
        domain=f"{STEP_SHAPE[0]}×{STEP_SHAPE[1]}, mu = {mu:.6f}",
    )
    given, full = _references(k, p, 1, 0)
    ctx.check_reference(
        "step_given_ns5",
        "given the kernel's own NS5 output O, W <- W(1 - lr wd) - lr 0.2 sqrt(max(A,B)) O is "
        "within its derived bound (two roundings) of float64",
        w_new.astype(np.float64),
        given,
        unit=LSB24,
        function="decoupled weight decay and the scaled update",
        domain=f"{STEP_SHAPE[0]}×{STEP_SHAPE[1]} weights in Q.24, lr = 0.02, wd = 0.1",
    )
    ctx.check_reference(
        "step_vs_float64",
        "the whole integer Muon step is within its declared tolerance (1 + lr 0.2 sqrt(max(A,B)) "
        "times NS5's tolerance) of a float64 Muon step on the same quantised W, M and G",
        w_new.astype(np.float64),
        full,
        unit=LSB24,
        function="Muon step (Nesterov, Moonlight scaling, decoupled weight decay)",
        domain=f"{STEP_SHAPE[0]}×{STEP_SHAPE[1]}, mu 0.95, lr 0.02, wd 0.1",
    )
    _step_properties(ctx, k, p, w_new, guard)
    _qk_clip(ctx, k)
    tiny = {name: np.ascontiguousarray(-np.abs(a[:10, :6])) for name, a in p.items()}
    tiny["G"][0] = -tiny["G"][0]
    check_compiled(
        ctx, "compiled_step", "muon_step", tiny["W"], tiny["M"], tiny["G"],
        MU_Q, LR_Q, WD_Q, 0, 2, 0, TRAIN_FRAC, 5,
        inputs="a slice: W, M, G the 10×6 corner of the gate's problem made negative (G's first "
        "row positive), 2 heads of 5 rows, plain momentum, which reaches the row-slicing and "
        "non-Nesterov branches of muon_step and every branch of its NS5's int32 path, with "
        "roundings of both signs (the column-slicing and Nesterov branches run in muon_perhead's "
        "compiled_perhead)",
    )  # fmt: skip
    perm = np.random.default_rng(SEED + 11).permutation(STEP_SHAPE[1])
    pp = {name: np.ascontiguousarray(a[:, perm]) for name, a in p.items()}
    wp, mp, gp = _run_step(k, pp)
    inv = np.argsort(perm)
    ctx.check_deterministic(
        "deterministic",
        "the step on W, M, G and the step with their columns permuted (un-permuted after; every "
        "NS5 sum over columns then runs in another order) give bit-identical W and M",
        {"as given": (w_new, m_new, guard), "columns permuted": (wp[:, inv], mp[:, inv], gp)},
    )
    worst = max(c.measured for c in ctx.checks if c.name == "step_vs_float64")
    ctx.evidence(
        f"Muon step on {STEP_SHAPE[0]}×{STEP_SHAPE[1]}: within "
        f"{max(c.measured for c in ctx.checks if c.name == 'step_given_ns5'):.3f} LSB of float64 "
        f"given O, {worst:.1f} LSB of Q.24 with float64 NS5; QK-Clip within "
        f"{max(c.measured for c in ctx.checks if c.name == 'qk_clip'):.3f} LSB"
    )


def _step_properties(ctx: GateContext, k, p: dict, w_new: np.ndarray, guard: int) -> None:
    lr, wd = LR_Q / 2**HYPER_FRAC, WD_Q / 2**HYPER_FRAC
    update = real(w_new, TRAIN_FRAC) - real(p["W"], TRAIN_FRAC) * (1 - lr * wd)
    rms = float(np.sqrt(np.mean(update**2))) / lr
    ctx.check(
        "update_rms",
        "the update's RMS divided by lr is 0.2 times the RMS singular value of O, within (0.1, "
        "0.3): the 0.2 sqrt(max(A,B)) scaling matches AdamW's update RMS (Moonlight)",
        0.1 < rms < 0.3 and guard == 0,
        rms_over_lr=rms,
        guard=int(guard),
    )
    zero = {"W": p["W"], "M": np.zeros_like(p["M"]), "G": np.zeros_like(p["G"])}
    w0, m0, g0 = _run_step(k, zero)
    decay = LR_Q * WD_Q
    exact = [w - _round_div(w * decay, 1 << (2 * HYPER_FRAC)) for w in p["W"].ravel().tolist()]
    ctx.check(
        "decay_only",
        "with G = M = 0, NS5 returns zeros (no division by zero) and the step is exactly the "
        "correctly rounded W(1 - lr wd), checked with Python's exact integers",
        np.array_equal(w0.ravel(), np.array(exact, dtype=np.int64)) and not m0.any() and g0 == 0,
    )


def _round_div(n: int, d: int) -> int:
    """n / d rounded half away from zero, with Python's unbounded integers (d > 0)."""
    qt, r = divmod(abs(n), d)
    qt += 2 * r >= d
    return qt if n >= 0 else -qt


def _qk_clip(ctx: GateContext, k) -> None:
    """QK-Clip on heads whose max logit exceeds tau = 100, and on heads below it."""
    rng = np.random.default_rng(SEED + 12)
    x = rng.standard_normal((32, D_MODEL))
    scales = np.array([0.2, 1.0, 1.6, 3.0])  # per-head weight scale: logits from ~5 to ~1000
    wq = q(rng.standard_normal((HEADS * D_HEAD, D_MODEL)) * np.repeat(scales, D_HEAD)[:, None], 24)
    wk = q(rng.standard_normal((HEADS * D_HEAD, D_MODEL)) * np.repeat(scales, D_HEAD)[:, None], 24)

    def max_logits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # host math (k3gates/fx/host.py): s_max is a kernel input
        qq = host.matmul(x, real(a, 24).T).reshape(-1, HEADS, D_HEAD).transpose(1, 0, 2)
        kk = host.matmul(x, real(b, 24).T).reshape(-1, HEADS, D_HEAD).transpose(1, 0, 2)
        s = (qq[:, :, None, :] * kk[:, None, :, :]).sum(axis=-1)  # [h, t, u]
        return s.reshape(HEADS, -1).max(axis=1) / np.sqrt(D_HEAD)

    s_max = max_logits(wq, wk)
    s_raw = q(s_max, 24)
    cq, ck, clipped = k.qk_clip(wq, wk, s_raw, round(TAU * 2**24), HEADS)
    want_q, want_k = ref.qk_clip(real(wq, 24), real(wk, 24), real(s_raw, 24), TAU, HEADS)
    ctx.check_reference(
        "qk_clip",
        "QK-Clip's scaled W_Q and W_K (each head's rows times sqrt(min(1, tau/S_max))) are within "
        "the derived bound of float64",
        np.concatenate([cq.ravel(), ck.ravel()]).astype(np.float64),
        np.concatenate([want_q.ravel(), want_k.ravel()]) * 2.0**24,
        unit=LSB24,
        function="QK-Clip, tau = 100",
        domain=f"{HEADS} heads of {D_HEAD} rows, max logits {np.round(s_max, 1).tolist()}",
    )
    after = max_logits(cq, ck)
    over = s_max > TAU
    untouched = all(
        np.array_equal(cq[h * D_HEAD : (h + 1) * D_HEAD], wq[h * D_HEAD : (h + 1) * D_HEAD])
        for h in range(HEADS)
        if not over[h]
    )
    on_tau = ctx.check_reference(
        "qk_clip_tau",
        "the clipped heads' max logit, recomputed in float64 from the clipped integer weights, "
        "is tau to within 10^-5 (relative, declared)",
        after[over] / TAU,
        np.ones(int(over.sum())),
        unit="fraction of tau",
        function="max logit after QK-Clip / tau",
        heads_clipped=int(over.sum()),
    )
    ctx.check(
        "qk_clip_property",
        "heads whose max logit is at most tau are returned bit-identical, exactly the heads "
        "above tau are clipped (some, not all), and their max logit lands on tau (qk_clip_tau)",
        untouched and clipped == int(over.sum()) and 0 < clipped < HEADS and on_tau,
        heads_clipped=int(clipped),
        max_logits_before=s_max.tolist(),
        max_logits_after=after.tolist(),
    )


# == STRONG: per-head isolation and order-independence ============================================
@gate(
    "muon_perhead",
    innovation="perheadmuon",
    level="STRONG",
    kernels=["k3gates.muon.kernels"],
    bounds={
        "perhead_given_ns5": lsb(STEP_MAX_ERR_LSB_Q10),
        "perhead_vs_float64": step_tolerance_lsb(LR_Q, D_MODEL, TRAIN_FRAC),
    },
    timeout=240,
)
def muon_perhead(ctx: GateContext) -> None:
    """Per-Head Muon: NS5 on each head's slice (rows of W_Q/W_K/W_V, columns of W_O); changing one
    head's gradient leaves every other head's update bit-identical; float64 drifts with summation
    order, the integer step does not."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED + 20)
    layouts = {
        "W_Q (rows)": (_step_problem(rng, (HEADS * D_HEAD, D_MODEL)), 0),
        "W_O (columns)": (_step_problem(rng, (D_MODEL, HEADS * D_HEAD)), 1),
    }
    got, given, full = [], [], []
    for p, axis in layouts.values():
        got.append(_run_step(k, p, HEADS, axis)[0].astype(np.float64).ravel())
        g_ref, f_ref = _references(k, p, HEADS, axis)
        given.append(g_ref.ravel())
        full.append(f_ref.ravel())
    domain = f"{HEADS} heads × {D_HEAD}, d = {D_MODEL}: W_Q-like by rows, W_O-like by columns"
    ctx.check_reference(
        "perhead_given_ns5",
        "given each head's integer NS5 output, the per-head step is within its derived bound "
        "(two roundings) of float64",
        np.concatenate(got),
        np.concatenate(given),
        unit=LSB24,
        function="per-head Muon step given O_h",
        domain=domain,
    )
    ctx.check_reference(
        "perhead_vs_float64",
        "the per-head integer Muon step is within its declared tolerance of a float64 per-head "
        "Muon step (NS5 on each head's slice) on the same quantised inputs",
        np.concatenate(got),
        np.concatenate(full),
        unit=LSB24,
        function="per-head Muon step",
        domain=domain,
    )
    moved = _isolation(ctx, k, layouts)
    w_q = layouts["W_Q (rows)"][0]
    threads = ctx.check_threads(
        "threads",
        "the per-head Muon step (4 heads of W_Q by rows; its NS5 matmuls are OpenMP loops over "
        "rows) gives bit-identical W, M in fresh processes with 1 and 2 OpenMP threads and here",
        "muon_step", w_q["W"], w_q["M"], w_q["G"], MU_Q, LR_Q, WD_Q, 1, HEADS, 0, TRAIN_FRAC,
        STEP_EPS,
    )  # fmt: skip
    differing = _order_drift(ctx, k, w_q, threads)
    small = _step_problem(rng, (6, 10))
    tiny = {name: np.ascontiguousarray(-np.abs(a)) for name, a in small.items()}
    tiny["M"][:, ::3] = -tiny["M"][:, ::3]
    check_compiled(
        ctx, "compiled_perhead", "muon_step", tiny["W"], tiny["M"], tiny["G"],
        MU_Q, LR_Q, WD_Q, 1, 2, 1, TRAIN_FRAC, 5,
        inputs="a slice: W, M, G 6×10 drawn like the gate's (W and G negative, M of both "
        "signs), 2 heads of 5 columns (as W_O) with Nesterov, which reaches the column-slicing, "
        "tall-slice and Nesterov branches of muon_step with roundings of both signs",
    )  # fmt: skip
    ctx.evidence(
        f"{HEADS} heads: changing one head's gradient changed {moved} entries of the other heads' "
        "W and M; "
        f"float64 per-head Muon changed {differing} weights' bits when its sums ran in another "
        "order, the integer step none"
    )


def _isolation(ctx: GateContext, k, layouts: dict) -> int:
    rng = np.random.default_rng(SEED + 21)
    isolated, touched, plain_spill, moved = True, True, [], 0
    for p, axis in layouts.values():
        base = _run_step(k, p, HEADS, axis)
        plain = _run_step(k, p, 1, axis)
        for sl in ref.head_slices(p["G"].shape, HEADS, axis):
            g = p["G"].copy()
            g[sl] += q(rng.standard_normal(g[sl].shape) * 2.0**-6, GRAD_FRAC)
            pert = dict(p, G=g)
            w, m, _ = _run_step(k, pert, HEADS, axis)
            others = np.ones(g.shape, dtype=bool)
            others[sl] = False
            moved += int(np.count_nonzero(w[others] != base[0][others]))
            moved += int(np.count_nonzero(m[others] != base[1][others]))
            isolated &= moved == 0
            touched &= not np.array_equal(w[sl], base[0][sl])
            wp, _, _ = _run_step(k, pert, 1, axis)
            plain_spill.append(float(np.mean(wp[others] != plain[0][others])))
    ctx.check(
        "head_isolation",
        "for every head h of a row-sliced (W_Q) and a column-sliced (W_O) matrix, changing head "
        "h's gradient leaves every other head's W and M bit-identical and changes head h's; with "
        "plain (whole-matrix) Muon the same change moves the other heads' weights too",
        isolated and touched and min(plain_spill) > 0.5,
        other_heads_bit_identical=isolated,
        changed_head_moves=touched,
        plain_muon_fraction_of_other_weights_moved=min(plain_spill),
        other_head_entries_changed=moved,
    )
    return moved


def _order_drift(ctx: GateContext, k, p: dict, threads: bool) -> int:
    """Float64 per-head Muon with its matmuls summed forwards and backwards, against the integer
    step with permuted columns and (`threads`: the verdict of the check `threads`) another
    OpenMP thread count."""

    def reverse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a[:, ::-1] @ b[::-1, :]  # the same products, summed in the reverse order

    args = (real(p["W"], TRAIN_FRAC), real(p["M"], GRAD_FRAC), real(p["G"], GRAD_FRAC))
    eps = STEP_EPS / 2**GRAD_FRAC
    fwd, _ = ref.muon_step(*args, **_hyper(), heads=HEADS, axis=0, eps=eps)
    bwd, _ = ref.muon_step(
        *args, **_hyper(), heads=HEADS, axis=0, eps=eps,
        orthogonalise=lambda h, n: ref.ns5(n, eps, matmul=reverse),
    )  # fmt: skip
    differing = int(np.count_nonzero(fwd != bwd))
    base = _run_step(k, p, HEADS, 0)
    perm = np.random.default_rng(SEED + 22).permutation(p["W"].shape[1])
    pp = {name: np.ascontiguousarray(a[:, perm]) for name, a in p.items()}
    wp, mp, gp = _run_step(k, pp, HEADS, 0)
    inv = np.argsort(perm)
    same = bit_equal(base, (wp[:, inv], mp[:, inv], gp))
    ctx.check(
        "float64_drifts_integer_does_not",
        "measured here: a float64 per-head Muon step with its matmuls summed in reverse order "
        "gives different bits from the same step summed forwards, while the integer step gives "
        "bit-identical W, M with its columns permuted (its sums in another order) and with "
        "another OpenMP thread count (the check threads)",
        differing > 0 and same and threads,
        float64_entries_differing=differing,
        float64_max_abs_diff=float(np.abs(fwd - bwd).max()),
        integer_bit_identical_permuted=same,
        integer_bit_identical_threads=threads,
    )
    ctx.check_deterministic(
        "deterministic",
        "the per-head step on W_Q and the step with the columns of W, M and G permuted "
        "(un-permuted after) give bit-identical W and M",
        {"as given": base, "columns permuted": (wp[:, inv], mp[:, inv], gp)},
    )
    return differing


# == PROVEN: an attention layer trained with integer Per-Head Muon ================================
# Declared before any run: the targets have variance 1, so predicting 0 scores about 1 and this
# threshold asks the student to explain 99% of the teacher's output variance.
LOSS_THRESHOLD = 0.01
# Declared tolerances, not derived bounds (training is a long non-linear iteration):
# integer / float64 loss within 3% (relative) at every logged step, declared before any run for
# all three training gates: below the 5% discrimination cap, and above what the narrowest format
# in the loop (NS5's Q1.14: 2^-14 per entry, amplified through NS5 and accumulated over the 200
# steps) can move the loss. It differs from LOSS_THRESHOLD, which is a different thing.
CURVE_REL_TOL = 0.03
GRAD_REL_TOL = 2.0**-16  # |dW_int - dW_float| / max |dW_float| at the initial weights
N_SEQ, T_LEN, D_TRAIN, TRAIN_HEADS = 64, 8, 8, 2  # d_h = 4, sqrt(d_h) = 2^1
SCALE_SHIFT = 1
TRAIN_STEPS = 200
TRAIN_LR_Q = round(0.04 * 2**HYPER_FRAC)
TRAIN_EPS = round(1e-7 * 2**GRAD_FRAC)


def attention_data(seed: int) -> dict[str, np.ndarray]:
    """A seeded teacher-student task: x ~ N(0, 1) clipped to +-4, [64 sequences x 8 tokens x 8];
    y = a random teacher attention layer (2 heads) of x, scaled to variance 1; the student's
    weights start at N(0, 1/d). Quantised to Q.24."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((N_SEQ, T_LEN, D_TRAIN)), -4, 4)
    teacher = {n: rng.standard_normal((D_TRAIN, D_TRAIN)) / np.sqrt(D_TRAIN) for n in "qkvo"}
    y = _teacher_attention(x, teacher, TRAIN_HEADS)
    y = y / y.std()
    w0 = {n: rng.standard_normal((D_TRAIN, D_TRAIN)) / np.sqrt(D_TRAIN) for n in "qkvo"}
    out = {"x": q(x.reshape(-1, D_TRAIN), 24), "y": q(y.reshape(-1, D_TRAIN), 24)}
    return out | {f"w{n}": q(w, 24) for n, w in w0.items()}


def _teacher_attention(x: np.ndarray, W: dict[str, np.ndarray], heads: int) -> np.ndarray:
    """ref.attention's y in host math (k3gates/fx/host.py): the teacher's output is a kernel
    input (the targets), so it takes no CPU-dependent exp or BLAS product."""
    n, t_len, _ = x.shape
    dh = W["q"].shape[0] // heads
    q, k, v = (host.matmul(x, W[c].T).reshape(n, t_len, heads, dh) for c in "qkv")
    s = (q[:, :, None, :, :] * k[:, None, :, :, :]).sum(axis=-1)  # [n, t, u, h]
    p = host.softmax(s.transpose(0, 3, 1, 2) / np.sqrt(dh))  # [n, h, t, u]
    o = (p[:, :, :, :, None] * v.transpose(0, 2, 1, 3)[:, :, None, :, :]).sum(axis=3)
    return host.matmul(o.transpose(0, 2, 1, 3).reshape(n, t_len, heads * dh), W["o"].T)


def _train_args(d: dict, order: np.ndarray, steps: int = TRAIN_STEPS) -> tuple:
    """The arguments of the whole training run, `train_attention(*args)`."""
    return (
        d["x"], d["y"], d["wq"], d["wk"], d["wv"], d["wo"], steps, T_LEN, TRAIN_HEADS,
        SCALE_SHIFT, TRAIN_LR_Q, MU_Q, 0, TRAIN_EPS, order,
    )  # fmt: skip


def _train(k, d: dict, order: np.ndarray, steps: int = TRAIN_STEPS) -> tuple:
    return k.train_attention(*_train_args(d, order, steps))


def _float_inputs(d: dict) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    shape = (-1, T_LEN, D_TRAIN)
    w = {n: real(d[f"w{n}"], 24) for n in "qkvo"}
    return real(d["x"], 24).reshape(shape), real(d["y"], 24).reshape(shape), w


@gate(
    "muon_training",
    innovation="perheadmuon",
    level="PROVEN",
    kernels=["k3gates.muon.kernels"],
    bounds={"loss_curve": CURVE_REL_TOL, "initial_gradients": GRAD_REL_TOL},
    timeout=300,
    exclusive=True,  # its fresh rerun takes the other core
)
def muon_training(ctx: GateContext) -> None:
    """An attention layer (2 heads) trained with integer Per-Head Muon on a seeded teacher-student
    task brings its MSE below 0.01, within 3% of a float64 run at every step, bit-identically in
    a fresh process with another thread count and in another sequence order."""
    k = ctx.compiled()
    d = attention_data(SEED)
    order = np.arange(N_SEQ, dtype=np.int64)
    args = _train_args(d, order)
    rerun = start_rerun(ctx, "train_attention", args)
    first = k.train_attention(*args)
    shuffled = _train(k, d, np.random.default_rng(SEED + 30).permutation(N_SEQ))
    curve = real(first[0], 24)
    x, y, w = _float_inputs(d)
    floats, _ = ref.train_attention(
        x, y, w, heads=TRAIN_HEADS, steps=TRAIN_STEPS, lr=TRAIN_LR_Q / 2**HYPER_FRAC,
        mu=MU_Q / 2**HYPER_FRAC, wd=0.0,
    )  # fmt: skip
    check_training(
        ctx,
        curve=curve,
        twin=floats,
        threshold=LOSS_THRESHOLD,
        unit="MSE (target variance 1)",
        rerun=rerun,
        first=first,
    )
    _initial_gradients(ctx, k, d, x, y, w)
    ctx.check(
        "no_saturation",
        "no activation, error or weight saturated and no NS5 int32 guard tripped in any step",
        int(first[5]) == 0 and int(first[6]) == 0,
        saturations=int(first[5]),
        guard=int(first[6]),
    )
    ctx.check_deterministic(
        "shuffled_order",
        "the training visiting the sequences in a shuffled order gives loss curves and final "
        "weights bit-identical to the run in order (every sum is exact)",
        {"sequences in order": first, "sequences in a shuffled order": shuffled},
    )
    check_compiled(
        ctx, "compiled_train", "train_attention", *_saturating_problem(d),
        inputs="a slice: 2 sequences × 8 tokens of the gate's data with W_V negated, the first "
        "sequence's x scaled by 24 and two rows of W_O at ±(2^29 - 1), 2 steps, which reaches "
        "every branch of train_attention's own code: activations and errors saturate at 2^31, "
        "weights clamp at 2^29, values and roundings have both signs (its NS5 branches are "
        "held by the ns5 and step checks)",
    )  # fmt: skip
    _training_artifacts(ctx, curve, floats)


def _saturating_problem(d: dict) -> tuple:
    """A 2-sequence slice of the training data pushed into every saturation branch."""
    t = {n: (a[: 2 * T_LEN] if a.shape[0] > D_TRAIN else a).copy() for n, a in d.items()}
    t["wv"] = -t["wv"]
    t["x"][:T_LEN] *= 24  # |x| up to ~67: q, k, v and y_hat saturate at 2^31 raw
    t["wo"][0], t["wo"][1] = (1 << 29) - 1, -((1 << 29) - 1)  # at the clamp: any step outward
    return _train_args(t, np.arange(2, dtype=np.int64), 2)


def _initial_gradients(ctx: GateContext, k, d: dict, x, y, w) -> None:
    out = k.attention_grads(
        d["x"], d["y"], d["wq"], d["wk"], d["wv"], d["wo"], T_LEN, TRAIN_HEADS, SCALE_SHIFT,
        np.arange(N_SEQ, dtype=np.int64),
    )  # fmt: skip
    _, want = ref.attention_grads(x, y, w, TRAIN_HEADS)
    got = np.concatenate([real(g, GRAD_FRAC).ravel() for g in out[1:5]])
    exp = np.concatenate([want[n].ravel() for n in "qkvo"])
    scale = float(np.abs(exp).max())
    ctx.check_reference(
        "initial_gradients",
        "the integer backward's dW_Q, dW_K, dW_V, dW_O at the initial weights are within the "
        "declared tolerance (2^-16 of the largest gradient) of the float64 chain rule",
        got / scale,
        exp / scale,
        unit="fraction of max |dW|",
        function="attention backward (softmax, per-head)",
        domain=f"{N_SEQ} sequences × {T_LEN} tokens, d = {D_TRAIN}, {TRAIN_HEADS} heads",
    )


def _training_artifacts(ctx: GateContext, curve: np.ndarray, floats: np.ndarray) -> None:
    steps = list(range(0, TRAIN_STEPS + 1, 2))
    ctx.artifact(
        "curve:training loss",
        {
            "x": steps,
            "series": {"integer per-head Muon": curve[steps], "float64 reference": floats[steps]},
            "threshold": LOSS_THRESHOLD,
            "xlabel": "step",
            "ylabel": "MSE (target variance 1)",
            "log_y": True,
        },
    )
    ctx.artifact(
        "table:training setup",
        {
            "columns": ["setting", "value"],
            "rows": [
                [
                    "layer",
                    f"softmax attention, d = {D_TRAIN}, {TRAIN_HEADS} heads of "
                    f"{D_TRAIN // TRAIN_HEADS}, W_Q, W_K, W_V, W_O, no biases",
                ],
                [
                    "data",
                    f"{N_SEQ} sequences × {T_LEN} tokens, x ~ N(0,1); y from a random teacher "
                    f"layer, variance 1; seed {SEED}",
                ],
                [
                    "optimiser",
                    f"per-head Muon (Nesterov, mu 0.95, lr 0.04, wd 0), {TRAIN_STEPS} full-batch "
                    "steps; NS5 on each head's rows of W_Q, W_K, W_V and columns of W_O",
                ],
                ["formats", "Q.24 values and weights, Q0.31 attention, Q.32 gradients, NS5 Q1.14"],
                ["loss threshold (declared)", LOSS_THRESHOLD],
            ],
        },
    )
    ctx.evidence(
        f"integer per-head Muon: attention MSE {curve[0]:.3f} -> {curve[-1]:.4f} in "
        f"{TRAIN_STEPS} steps (threshold {LOSS_THRESHOLD}), within "
        f"{float(np.abs(curve / floats - 1).max()):.1%} of a float64 run at every step, "
        "bit-identical with another thread count and sequence order"
    )
