"""SiTU-GLU gates: the pieces (PARTIAL), the forward (HAVE), the backward (STRONG), and integer
SGD training (PROVEN). Bounds come from k3gates/situ/kernels.py, declared before any run.

The range K3 activations reach. K3's expert inputs g = w1 z and u = w3 z come out of MXFP4 x MXFP8
matmuls; no activation statistics are published. What bounds the range that matters is SiTU
itself: in Q7.24, the output is within one LSB of its saturated value once g >= 43.9
(8 e^(-g/2) * 25 < 2^-24), g <= -21.2 (100 e^g < 2^-24) or |u| >= 274 (200 e^(-2|u|/25) <
2^-24). The dense grid g in [-64, 64) x u in [-512, 512) therefore holds every point where the
output still varies, with margin (and u beyond E4M3's element maximum 448); tails out to 2^20 and
raw inputs of +-2^62 show the saturation itself, and |out| <= 100 there too.
"""

from __future__ import annotations

import numpy as np

from k3gates.fx.checks import check_compiled, check_shuffled, in_lsb, lsb, raw
from k3gates.infra.gate import GateContext, gate
from k3gates.infra.training import check_training, start_rerun

from ..fx import host
from . import reference as ref
from .kernels import (
    BETA_TANH_MAX_ERR_LSB_Q10,
    GATE_FACTOR_MAX_ERR_LSB_Q10,
    SITU_BETA,
    SITU_BETA_LIN,
    SITU_FRAC,
    SITU_GRAD_MAX_ERR_LSB_Q10,
    SITU_MAX_ERR_LSB_Q10,
    TRAIN_FRAC,
)

KERNELS = "k3gates.situ.kernels"
F = 24  # g, u, dout in Q.24 in every gate
Q24 = "LSB (2^-24)"
SEED = 20260704
B, BL = SITU_BETA, SITU_BETA_LIN
# declared: at beta = beta_lin = 512 (|g|, |u| <= 4) SiTU-GLU is within 1e-3 of SwiGLU, since
# beta tanh(x/beta) = x - x^3/(3 beta^2) + ...: 4^3/(3 512^2) = 8.1e-5 on each factor, times the
# other factor (<= 4), is at most 6.5e-4 there, plus Q7.24's half LSB
SWIGLU_LIMIT_TOL = 1e-3


def q24(a: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(a) * 2.0**F).astype(np.int64)


def real(a: np.ndarray) -> np.ndarray:
    return np.ldexp(np.asarray(a, dtype=np.float64), -F)


def grid() -> tuple[np.ndarray, np.ndarray]:
    """g in [-64, 64) step 1/16 (2048 values) x u in [-512, 512) step 1 (1024): 2^21 points."""
    g = np.repeat(np.arange(-64 * 16, 64 * 16, dtype=np.int64) << (F - 4), 1024)
    u = np.tile(np.arange(-512, 512, dtype=np.int64) << F, 2048)
    return g, u


def tails() -> tuple[np.ndarray, np.ndarray]:
    """Saturated inputs: magnitudes 64 .. 2^20 and raw +-2^62, every sign, crossed with a
    few unsaturated values."""
    big = np.array([64, 100, 448, 1000, 2**10, 2**15, 2**20], dtype=np.int64) << F
    big = np.concatenate([big, [2**62, 2**61 + 12345]])
    vals = np.concatenate([big, -big, q24([0.0, 0.5, -0.5, 3.0, -3.0, 30.0, -30.0])])
    g, u = np.meshgrid(vals, vals, indexing="ij")
    return g.ravel(), u.ravel()


# == PARTIAL: the pieces ========================================================================
@gate(
    "situ_pieces",
    innovation="situ",
    level="PARTIAL",
    kernels=["k3gates.situ.kernels"],
    bounds={
        "beta_tanh_4": lsb(BETA_TANH_MAX_ERR_LSB_Q10),
        "beta_tanh_25": lsb(BETA_TANH_MAX_ERR_LSB_Q10),
        "gate_factor": lsb(GATE_FACTOR_MAX_ERR_LSB_Q10),
    },
    timeout=180,
)
def situ_pieces(ctx: GateContext) -> None:
    """The scaled tanh at beta = 4 and beta_lin = 25, and the gate factor 4 tanh(g/4) sigma(g),
    each within 513/1024 LSB of Q.24, exhaustively over their input formats."""
    k = ctx.compiled()
    g16 = np.arange(-(64 << 16), 64 << 16, dtype=np.int64)  # every Q6.16 g
    u12 = np.arange(-(512 << 12), 512 << 12, dtype=np.int64)  # every Q10.12 u
    bt4 = k.beta_tanh_array(g16, 16, B)
    cases = (
        (
            "beta_tanh_4",
            bt4,
            ref.beta_tanh(np.ldexp(g16, -16), B),
            "4·tanh(g/4)",
            "Q6.16",
            "exhaustive: every Q6.16 input in [-64, 64), 2^23 points",
        ),
        (
            "beta_tanh_25",
            k.beta_tanh_array(u12, 12, BL),
            ref.beta_tanh(np.ldexp(u12, -12), BL),
            "25·tanh(u/25)",
            "Q10.12",
            "exhaustive: every Q10.12 input in [-512, 512), 2^22 points",
        ),
        (
            "gate_factor",
            k.gate_factor_array(g16, 16, B),
            ref.gate_factor(np.ldexp(g16, -16)),
            "4·tanh(g/4)·σ(g)",
            "Q6.16",
            "exhaustive: every Q6.16 input in [-64, 64), 2^23 points",
        ),
    )
    for name, got, want, function, fmt, domain in cases:
        ctx.check_reference(
            name,
            f"{function} in Q.24 over {domain.split(': ')[1]} is within the declared bound",
            raw(got),
            in_lsb(want, SITU_FRAC),
            unit=Q24,
            function=function,
            input_format=fmt,
            output_format="Q.24",
            domain=domain,
        )
    half = g16.size // 2
    ctx.check(
        "pieces_bounded_and_odd",
        "|4 tanh(g/4)| <= 4 and |25 tanh(u/25)| <= 25 in the integers, and 4 tanh(g/4) is odd "
        "bit for bit over every Q6.16 input",
        bool(np.abs(bt4).max() <= 4 << SITU_FRAC)
        and bool(np.abs(k.beta_tanh_array(u12, 12, BL)).max() <= 25 << SITU_FRAC)
        and bool(np.array_equal(bt4[1 : half + 1][::-1], -bt4[half:])),
    )
    far = np.array([200 << 16, -(200 << 16), 2**62, -(2**62), 2**61 + 12345], dtype=np.int64)
    check_compiled(
        ctx, "compiled_pieces", "gate_factor_array", np.concatenate([g16[::65537], far]), 16, B,
        inputs="a slice: 128 evenly spaced Q6.16 inputs over [-64, 64) (both signs, zero) plus "
        "±200 and raw ±2^62, which reaches every branch of gate_factor_array because tanh(g/4) "
        "is saturated (|g| >= 128) and not, and sigma's argument has both signs",
    )  # fmt: skip
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    ctx.evidence(f"4·tanh(g/4), 25·tanh(u/25) and 4·tanh(g/4)·σ(g) within {worst:.4f} LSB of Q.24")


# == HAVE: the forward ==========================================================================
@gate(
    "situ_forward",
    innovation="situ",
    level="HAVE",
    kernels=["k3gates.situ.kernels"],
    bounds={name: lsb(SITU_MAX_ERR_LSB_Q10) for name in ("situ_grid", "situ_random", "situ_tails")}
    | {"swiglu_limit": SWIGLU_LIMIT_TOL},
    timeout=240,
)
def situ_forward(ctx: GateContext) -> None:
    """SiTU-GLU forward in Q7.24 within 513/1024 LSB of float64 over g in [-64, 64) x u in
    [-512, 512) (every point where the output still varies), with |out| <= 100 everywhere."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    g, u = grid()
    gr = rng.integers(-64 << F, 64 << F, 1 << 20)
    ur = rng.integers(-512 << F, 512 << F, 1 << 20)
    gt, ut = tails()
    outs = {}
    for name, gg, uu, domain in (
        ("situ_grid", g, u, "dense grid: 2048 × 1024 = 2^21 points, g step 1/16, u step 1"),
        ("situ_random", gr, ur, "dense grid: 2^20 seeded random Q.24 points in the same box"),
        (
            "situ_tails",
            gt,
            ut,
            f"{gt.size} saturated pairs: |g|, |u| from 64 to 2^20 and raw ±2^62",
        ),
    ):
        outs[name] = out = k.situ_glu_array(gg, uu, F, B, BL)
        ctx.check_reference(
            name,
            f"SiTU-GLU(g, u) in Q7.24 over {domain.split(': ')[0]} is within the declared bound",
            raw(out),
            in_lsb(ref.situ_glu(real(gg), real(uu)), SITU_FRAC),
            unit=Q24,
            function="SiTU-GLU",
            input_format="g, u in Q.24",
            output_format="Q7.24",
            domain=domain + " over g ∈ [-64, 64), u ∈ [-512, 512)" * (name != "situ_tails"),
        )
    _forward_properties(ctx, k, g, u, outs)
    _swiglu_limit(ctx, k)
    check_compiled(
        ctx, "compiled_situ", "situ_glu_array",
        np.concatenate([g[::8191], gt[::16]]), np.concatenate([u[::8191], ut[::16]]), F, B, BL,
        inputs="a slice: 256 points of the dense grid and 40 spread over the saturated tails "
        "(|g|, |u| from 64 to raw 2^62), which reaches every branch of situ_glu_array because "
        "tanh(g/4) and tanh(u/25) are each saturated and not, with g and u of both signs",
    )  # fmt: skip
    pairs = np.stack([gr, ur], axis=1)
    check_shuffled(
        ctx,
        "deterministic",
        lambda p: k.situ_glu_array(
            np.ascontiguousarray(p[:, 0]), np.ascontiguousarray(p[:, 1]), F, B, BL
        ),
        pairs,
        "SiTU-GLU on 2^20 random points",
    )
    ctx.check_threads(
        "threads",
        "SiTU-GLU on 2^20 random points (an OpenMP loop over elements) gives bit-identical "
        "outputs in fresh processes with 1 and 2 OpenMP threads and here",
        "situ_glu_array", gr, ur, F, B, BL,
    )  # fmt: skip
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    top = max(int(np.abs(o).max()) for o in outs.values()) / 2**SITU_FRAC
    ctx.evidence(
        f"forward within {worst:.4f} LSB of Q7.24 over 2^21 grid + 2^20 random points, "
        f"max |out| = {top:g} ≤ 100"
    )


def _forward_properties(ctx: GateContext, k, g, u, outs) -> None:
    top = max(int(np.abs(o).max()) for o in outs.values())
    ctx.check(
        "out_bounded_by_100",
        "|out| <= 100 for every output (grid, random and saturated tails), so Q7.24 holds it in "
        "int32 with no saturation",
        top <= 100 << SITU_FRAC and top < 2**31,
        max_abs_out=top / 2**SITU_FRAC,
        max_abs_raw=top,
    )
    neg = k.situ_glu_array(g, -u, F, B, BL)
    ctx.check(
        "odd_in_u",
        "SiTU-GLU(g, -u) = -SiTU-GLU(g, u) bit for bit over the grid, and SiTU-GLU(g, 0) = 0",
        bool(np.array_equal(neg, -outs["situ_grid"]))
        and bool(np.all(outs["situ_grid"][u == 0] == 0)),
    )


def _swiglu_limit(ctx: GateContext, k) -> None:
    """As beta = beta_lin grows, the integer SiTU-GLU tends to SwiGLU g sigma(g) u, as 1/beta^2."""
    vals = np.arange(-4 * 16, 4 * 16 + 1, dtype=np.int64) << (F - 4)  # [-4, 4] step 1/16
    g, u = (a.ravel() for a in np.meshgrid(vals, vals, indexing="ij"))
    swiglu = ref.swiglu(real(g), real(u))
    betas = [16, 32, 64, 128, 256, 512]  # beta beta_lin <= 2^18, the forward bound's domain
    dev = [float(np.abs(real(k.situ_glu_array(g, u, F, b, b)) - swiglu).max()) for b in betas]
    ratios = [dev[i] / dev[i + 1] for i in range(len(dev) - 1)]
    ctx.artifact(
        "table:distance to SwiGLU as beta = beta_lin grows (|g|, |u| <= 4)",
        {
            "columns": ["beta = beta_lin", "max |SiTU-GLU - g σ(g) u|", "ratio to the next"],
            "rows": [[b, d, r] for b, d, r in zip(betas, dev, [*ratios, None], strict=True)],
        },
    )
    ctx.check(
        "approaches_swiglu",
        "with beta = beta_lin doubled from 16 to 512 the integer forward's distance to SwiGLU "
        "shrinks at least 3x per doubling (1/beta^2: 4x)",
        all(r >= 3 for r in ratios),
        deviations=dev,
        ratios=ratios,
    )
    ctx.check_reference(
        "swiglu_limit",
        "at beta = beta_lin = 512 the integer SiTU-GLU is within 10^-3 (declared) of float64 "
        "SwiGLU g sigma(g) u over |g|, |u| <= 4",
        real(k.situ_glu_array(g, u, F, betas[-1], betas[-1])),
        swiglu,
        unit="absolute",
        function="SiTU-GLU at beta = beta_lin = 512 vs SwiGLU",
        domain="g, u in [-4, 4] step 1/16",
    )


# == STRONG: the backward =======================================================================
GRAD_CHECKS = ("dg_unit", "du_unit", "dg_random", "du_random")


@gate(
    "situ_backward",
    innovation="situ",
    level="STRONG",
    kernels=["k3gates.situ.kernels"],
    bounds={name: lsb(SITU_GRAD_MAX_ERR_LSB_Q10) for name in GRAD_CHECKS}
    | {"fd_dg": ref.FD_MAX_ERR, "fd_du": ref.FD_MAX_ERR},
    timeout=240,
)
def situ_backward(ctx: GateContext) -> None:
    """The analytic SiTU-GLU backward in Q.24 within 513/1024 LSB of float64; the float64
    backward itself agrees with central finite differences of the float forward."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED + 1)
    g, u = grid()
    g, u = g[::2].copy(), u[::2].copy()  # 2048 x 512, u step 2: 2^20 points
    ones = np.full(g.size, 1 << F, dtype=np.int64)
    gr = rng.integers(-64 << F, 64 << F, 1 << 20)
    ur = rng.integers(-512 << F, 512 << F, 1 << 20)
    dr = rng.integers(-512 << F, 512 << F, 1 << 20)  # |dout| <= 512: dout 25 < 2^38 raw
    unit = k.situ_glu_grad_array(g, u, ones, F, B, BL)
    rand = k.situ_glu_grad_array(gr, ur, dr, F, B, BL)
    want_unit = ref.situ_glu_grad(real(g), real(u), 1.0)
    want_rand = ref.situ_glu_grad(real(gr), real(ur), real(dr))
    for i, part in enumerate(("dg", "du")):
        for name, got, want, domain in (
            (
                f"{part}_unit",
                unit[i],
                want_unit[i],
                "dense grid: 2048 × 512 = 2^20 points over "
                "g ∈ [-64, 64), u ∈ [-512, 512), dout = 1",
            ),
            (
                f"{part}_random",
                rand[i],
                want_rand[i],
                "dense grid: 2^20 seeded random (g, u) in the same box, dout ∈ [-512, 512)",
            ),
        ):
            ctx.check_reference(
                name,
                f"{part} = dout·∂out/∂{part[1]} in Q.24 is within the declared bound of float64",
                raw(got),
                in_lsb(want, F),
                unit=Q24,
                function=f"SiTU-GLU backward {part}",
                input_format="g, u, dout in Q.24",
                output_format="Q.24",
                domain=domain,
            )
    _finite_differences(ctx, rng)
    _backward_properties(ctx, k, g, u, ones, unit)
    gt, ut = tails()
    check_compiled(
        ctx, "compiled_grad", "situ_glu_grad_array",
        np.concatenate([gr[:300], gt[::16]]), np.concatenate([ur[:300], ut[::16]]),
        dr[:340].copy(), F, B, BL,
        inputs="a slice: 300 of the gate's random (g, u, dout) and 40 pairs spread over the "
        "saturated tails, which reaches every branch of situ_glu_grad_array because tanh(g/4) "
        "and tanh(u/25) are each saturated and not, with g, u and dout of both signs",
    )  # fmt: skip
    trip = np.stack([gr, ur, dr], axis=1)
    check_shuffled(
        ctx,
        "deterministic",
        lambda p: k.situ_glu_grad_array(
            *(np.ascontiguousarray(p[:, c]) for c in range(3)), F, B, BL
        ),
        trip,
        "the backward on 2^20 random points",
    )
    worst = max(c.measured for c in ctx.checks if c.name in GRAD_CHECKS)
    fd = max(c.measured for c in ctx.checks if c.name.startswith("fd_"))
    ctx.evidence(
        f"backward dg, du within {worst:.4f} LSB of Q.24 on 2^21 points; float64 backward within "
        f"{fd:.1e} of finite differences"
    )


def _finite_differences(ctx: GateContext, rng: np.random.Generator) -> None:
    g = rng.uniform(-64, 64, 1 << 16)
    u = rng.uniform(-512, 512, 1 << 16)
    fd_g, fd_u = ref.finite_difference_grad(g, u)
    an_g, an_u = ref.situ_glu_grad(g, u, 1.0)
    for name, got, want in (("fd_dg", an_g, fd_g), ("fd_du", an_u, fd_u)):
        ctx.check_reference(
            name,
            f"the float64 analytic ∂out/∂{name[-1]} (the reference the integers are held to) "
            f"agrees with central differences (h = 2^-17) of the float64 forward",
            got,
            want,
            unit="absolute",
            function=f"float64 ∂out/∂{name[-1]} vs finite differences",
            domain="2^16 seeded random points over g ∈ [-64, 64), u ∈ [-512, 512)",
        )


def _backward_properties(ctx: GateContext, k, g, u, ones, unit) -> None:
    dg_neg, du_neg = k.situ_glu_grad_array(g, -u, ones, F, B, BL)
    far_g = np.array([-(2**62), -(200 << F), 200 << F, 2**62], dtype=np.int64)
    far_u = np.array([-(2**62), -(1000 << F), 1000 << F, 2**62], dtype=np.int64)
    three, one = np.full(4, 3 << F), np.full(4, 1 << F)
    sat_g, _ = k.situ_glu_grad_array(far_g, three, one, F, B, BL)
    _, sat_u = k.situ_glu_grad_array(three, far_u, one, F, B, BL)
    ctx.check(
        "grad_symmetries",
        "dg is odd and du even in u, bit for bit; dg = 0 at u = 0; dg = 0 exactly where "
        "|g| >= 200 (tanh(g/4) = ±1, σ(1-σ) < 2^-62) and du = 0 exactly where |u| >= 1000 "
        "(tanh(u/25) = ±1)",
        bool(np.array_equal(dg_neg, -unit[0]))
        and bool(np.array_equal(du_neg, unit[1]))
        and bool(np.all(unit[0][u == 0] == 0))
        and not sat_g.any()
        and not sat_u.any(),
    )


# == PROVEN: integer SGD on a SiTU-GLU MLP ======================================================
# Declared before any run: the targets are normalised to variance 1, so predicting their mean
# scores 1.0 and this threshold asks the net to explain 95% of the variance.
LOSS_THRESHOLD = 0.05
# A declared tolerance, not a derived bound (gradient descent on a non-convex loss has none):
# integer / float64 loss within 3% (relative) at every logged step, declared before any run for
# all three training gates: below the 5% discrimination cap, and above what the narrowest format
# in the loop (Q.24 values and weights) can move the loss over the run. It differs from
# LOSS_THRESHOLD, which is a different thing.
CURVE_REL_TOL = 0.03
N_SAMPLES, D_IN, HIDDEN, TEACHER_HIDDEN = 256, 8, 16, 8
STEPS = 600
LR_NUM, LR_SHIFT = 1, 10  # lr = 2^-10 on sum_n e dy/dw, i.e. 2^-10 N / 2 = 1/8 on the MSE gradient
CURVE_EVERY = 5


def regression_data(seed: int) -> dict[str, np.ndarray]:
    """A synthetic regression from a fixed seed, already quantised to Q.24.

    x ~ N(0, 1)^8 (clipped to +-4); y = a random SiTU-GLU teacher net (8 hidden) of x,
    normalised to mean 0 and variance 1; the student's weights start at N(0, 1/fan_in).
    """
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((N_SAMPLES, D_IN)), -4, 4)
    t1 = rng.standard_normal((TEACHER_HIDDEN, D_IN)) * 1.5 / np.sqrt(D_IN)
    t3 = rng.standard_normal((TEACHER_HIDDEN, D_IN)) * 1.5 / np.sqrt(D_IN)
    t2 = rng.standard_normal(TEACHER_HIDDEN) / np.sqrt(TEACHER_HIDDEN)
    # host math (k3gates/fx/host.py): y is a kernel input, so no CPU-dependent tanh, exp or BLAS
    g, u = host.matmul(x, t1.T), host.matmul(x, t3.T)
    gate_factor = ref.BETA * host.tanh(g / ref.BETA) * host.sigmoid(g)
    y = host.matmul(gate_factor * ref.BETA_LIN * host.tanh(u / ref.BETA_LIN), t2[:, None])[:, 0]
    y = np.clip((y - y.mean()) / y.std(), -8, 8)
    init = {
        "w1": rng.standard_normal((HIDDEN, D_IN)) / np.sqrt(D_IN),
        "w3": rng.standard_normal((HIDDEN, D_IN)) / np.sqrt(D_IN),
        "w2": rng.standard_normal(HIDDEN) * 0.5 / np.sqrt(HIDDEN),
    }
    return {"x": q24(x), "y": q24(y), **{name: q24(w) for name, w in init.items()}}


def _train_args(d: dict[str, np.ndarray], order: np.ndarray, steps: int = STEPS) -> tuple:
    """The arguments of the whole training run, `train_mlp(*args)`."""
    return (d["x"], d["y"], d["w1"], d["w3"], d["w2"], steps, LR_NUM, LR_SHIFT, order)


def _train(k, d: dict[str, np.ndarray], order: np.ndarray, steps: int = STEPS) -> tuple:
    return k.train_mlp(*_train_args(d, order, steps))


def _saturating_problem(d: dict[str, np.ndarray]) -> tuple:
    """8 samples and 4 hidden units of the gate's data and net, with weights at the clamp
    (2^29 - 1): g = w1 x saturates tanh, y_hat's error saturates at 16, weights at 32."""
    t = {"x": d["x"][:8], "y": d["y"][:8], "w1": d["w1"][:4], "w3": d["w3"][:4], "w2": d["w2"][:4]}
    t = {name: a.copy() for name, a in t.items()}
    top = (1 << 29) - 1
    t["w1"][0], t["w1"][2], t["w3"][2], t["w2"][1] = top, top, top, top
    return _train_args(t, np.arange(8, dtype=np.int64), 2)


@gate(
    "situ_training",
    innovation="situ",
    level="PROVEN",
    kernels=["k3gates.situ.kernels"],
    bounds={"loss_curve": CURVE_REL_TOL},
    timeout=300,
    exclusive=True,  # its fresh rerun takes the other core
)
def situ_training(ctx: GateContext) -> None:
    """A SiTU-GLU MLP (8 -> 16 -> 1) trained with integer gradient descent on a seeded regression
    brings its MSE below 0.05, within 3% of a float64 run of the same at every step,
    bit-identically in a fresh process with another thread count and in another sample order."""
    k = ctx.compiled()
    d = regression_data(SEED)
    args = _train_args(d, np.arange(N_SAMPLES, dtype=np.int64))
    rerun = start_rerun(ctx, "train_mlp", args)
    first = k.train_mlp(*args)
    shuffled = _train(k, d, np.random.default_rng(SEED + 2).permutation(N_SAMPLES))
    curve = real(first[0])
    lr = LR_NUM / 2**LR_SHIFT
    floats = ref.train_mlp(
        real(d["x"]), real(d["y"]), real(d["w1"]), real(d["w3"]), real(d["w2"]), STEPS, lr
    )[0]
    check_training(
        ctx,
        curve=curve,
        twin=floats,
        threshold=LOSS_THRESHOLD,
        unit="MSE (target variance 1)",
        rerun=rerun,
        first=first,
    )
    ctx.check(
        "no_saturation",
        "no error |y_hat - y| reached 16 and no weight reached 32 (zero saturations)",
        int(first[4]) == 0,
        saturations=int(first[4]),
    )
    ctx.check_deterministic(
        "shuffled_order",
        "the training visiting the samples in a shuffled order gives loss curves and final "
        "weights bit-identical to the run in order (every gradient sum is exact)",
        {"samples in order": first, "samples in a shuffled order": shuffled},
    )
    check_compiled(
        ctx, "compiled_train", "train_mlp", *_saturating_problem(d),
        inputs="a slice: 8 samples, 4 hidden units, 2 steps of the gate's data and net with "
        "four weights at the clamp (2^29 - 1), which reaches every branch of train_mlp because "
        "g = w1 x saturates tanh(g/4), the error saturates at 16, weights saturate at 32, and "
        "values and roundings have both signs",
    )  # fmt: skip
    _training_artifacts(ctx, curve, floats)


def _training_artifacts(ctx: GateContext, curve: np.ndarray, floats: np.ndarray) -> None:
    steps = [*range(0, STEPS, CURVE_EVERY), STEPS]
    ctx.artifact(
        "curve:training loss",
        {
            "x": steps,
            "series": {"integer (Q.24)": curve[steps], "float64 reference": floats[steps]},
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
                ["net", f"{D_IN} -> SiTU-GLU({HIDDEN}) -> 1, no biases"],
                [
                    "data",
                    f"{N_SAMPLES} samples, x ~ N(0,1)^{D_IN}, y = SiTU-GLU teacher "
                    f"({TEACHER_HIDDEN} hidden), variance 1, seed {SEED}",
                ],
                [
                    "optimiser",
                    f"full-batch gradient descent, {STEPS} steps, lr = 2^-{LR_SHIFT} on Σ e ∂ŷ/∂w",
                ],
                ["formats", f"Q.{TRAIN_FRAC} values and weights, gradients summed in Q.32"],
                ["loss threshold (declared)", LOSS_THRESHOLD],
            ],
        },
    )
    rel = float(np.abs(curve / floats - 1).max())
    ctx.evidence(
        f"integer SGD: MSE {curve[0]:.3f} -> {curve[-1]:.4f} in {STEPS} steps (threshold "
        f"{LOSS_THRESHOLD}), within {rel:.1e} (relative) of float64 at every step, bit-identical "
        "with another thread count and sample order"
    )
