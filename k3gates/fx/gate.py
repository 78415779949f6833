"""Foundations gates for the fx library: every function's bound, proven against reference.py.

Each bound is declared in the decorator from the constant kernels.py states (513/1024 LSB: one
final rounding plus 2^-10 LSB of margin that the error analyses leave unused), and each is proven
exhaustively over a whole input format where that format is small enough, and otherwise on a
dense seeded grid of at least 2^20 points; each check's `domain` says which. The gemmlowp anchors
(fixedpoint.h's tolerances on Q0.31 outputs) are shown beside exp, tanh and sigmoid, as a table
of the two constants (a displayed fact, not a check).

These gates count toward no innovation (innovation=None); every innovation gate whose kernels
import k3gates.fx.kernels fails when one of them fails (runner.apply_requirements).
"""

from __future__ import annotations

import numpy as np

from k3gates.infra.gate import GateContext, gate

from . import host
from . import reference as ref
from .checks import SEED, anchor_table, check_compiled, check_shuffled, edge_ints, in_lsb, lsb, raw
from .kernels import (
    ARG_FRAC,
    EXACT_LSB_Q10,
    EXP_MAX_ERR_LSB_Q10,
    L2NORM_MAX_ERR_LSB_Q10,
    LN2_Q56,
    LOG2E_Q26,
    RMSNORM_MAX_ERR_LSB_Q10,
    RSQRT_MAX_ERR_LSB_Q10,
    SIGMOID_MAX_ERR_LSB_Q10,
    SILU_MAX_ERR_LSB_Q10,
    SINCOS_MAX_ERR_LSB_Q10,
    SOFTMAX_MAX_ERR_LSB_Q10,
    TANH_MAX_ERR_LSB_Q10,
)

KERNELS = "k3gates.fx.kernels"
# gemmlowp fixedpoint.h test tolerances, Q0.31 output, units of 2^-31 (docs/K3-SPEC.md section 13)
ANCHOR_EXP = 500
ANCHOR_TANH = 310
ANCHOR_LOGISTIC = 155
Q31 = "LSB (2^-31)"


def _words(v: np.ndarray) -> np.ndarray:
    """int64 values as their high (signed) and low (unsigned) 32-bit words, side by side: each word
    is exact in float64, so two arrays compare equal here exactly when they are equal as int64."""
    v = np.asarray(v, dtype=np.int64)
    return np.concatenate([v >> 32, v & 0xFFFFFFFF]).astype(np.float64)


def _check_exact(ctx: GateContext, name: str, proves: str, got, want: list[int], **values) -> None:
    """The kernel's int64 output against Python's exact integers, bound 0, compared word by word
    (float64 alone would round values above 2^53 and could hide a 1 LSB error)."""
    ctx.check_reference(
        name,
        proves,
        _words(got),
        _words(np.array(want, dtype=np.int64)),  # every exact result here fits int64
        unit="exact (int64 as its two 32-bit words)",
        **{"points": len(want), **values},
    )


# == fx_core: the integer primitives ===========================================================
CORE_CHECKS = ("rshift_round", "mul_q62", "mul_round", "div_round", "div_round_shift")
CORE_CHECKS += ("narrow_int32", "isqrt_exhaustive", "isqrt_edges")


@gate(
    "fx_core",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={name: lsb(EXACT_LSB_Q10) for name in CORE_CHECKS},
    timeout=240,
)
def fx_core(ctx: GateContext) -> None:
    """The integer primitives (rounding shift, high multiplies, divisions, narrowing, isqrt) are
    exact: each equals Python's unbounded-integer arithmetic on edges, negatives and random values.
    """
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    x = np.concatenate([edge_ints(), rng.integers(-(2**63) + 1, 2**63 - 1, 1 << 13)])
    _check_rshift(ctx, k, x)
    _check_mul(ctx, k, rng)
    div_shift = _check_div(ctx, k, rng)
    m = _check_narrow_isqrt(ctx, k, x, rng)
    _check_core_compiled(ctx, x, div_shift, m)
    check_shuffled(ctx, "deterministic", lambda v: k.rshift_round_array(v, 17), x, "rshift_round")
    ctx.check_threads(
        "threads",
        f"isqrt over the {m.size:,} edge, square ± 1 and random inputs (an `omp parallel for` over "
        "the elements) gives the same bits with 1 and 2 OpenMP threads, each in a fresh process",
        "isqrt_array",
        m,
    )
    points = sum(c.values["points"] for c in ctx.checks if c.kind == "reference")
    ctx.evidence(
        "rounding shift, Q0.62 and 124-bit multiplies, divisions, narrowing and isqrt exact on "
        f"{points:,} cases, isqrt exhaustively below 2^22"
    )


def _check_rshift(ctx: GateContext, k, x: np.ndarray) -> None:
    got = np.concatenate([k.rshift_round_array(x, s) for s in range(64)])
    want = [ref.rshift_round(int(v), s) for s in range(64) for v in x.tolist()]
    _check_exact(
        ctx,
        "rshift_round",
        "x / 2^s rounds half away from zero, exactly, for every shift 0..63 of every probe",
        got,
        want,
        function="rshift_round",
        input_format="int64, shift 0..63",
        output_format="int64",
        domain=f"2^i±{{0,1,2}}, negatives, extremes and random, × 64 shifts ({got.size:,})",
    )
    neg = np.concatenate([k.rshift_round_array(-x, s) for s in range(64)])
    ties_in = np.array([1, 3, 5, -1, -3, -5], dtype=np.int64)
    ties = k.rshift_round_array(ties_in, 1).tolist()
    ctx.check(
        "rounding_symmetric",
        "the rounding is symmetric, rshift_round(-x) = -rshift_round(x) for every probe and "
        "shift, and ties go away from zero: ±1/2 -> ±1, ±3/2 -> ±2, ±5/2 -> ±3",
        bool(np.array_equal(neg, -got)) and ties == [1, 2, 3, -1, -2, -3],
        message=f"ties gave {ties}",
    )


def _operands(rng: np.random.Generator, n: int, max_bits: int) -> np.ndarray:
    """Signed values of every magnitude up to 2^max_bits (log-uniform bit lengths)."""
    bits = rng.integers(0, max_bits + 1, n)
    mag = rng.integers(0, 2**62, n) >> (62 - np.minimum(bits, 62))
    return np.where(rng.random(n) < 0.5, -mag, mag).astype(np.int64)


def _check_mul(ctx: GateContext, k, rng: np.random.Generator) -> None:
    e = edge_ints(62)
    e = e[np.abs(e) <= 2**62]
    a = np.concatenate([np.repeat(e, e.size), _operands(rng, 1 << 16, 62), [2**62, -(2**62)]])
    b = np.concatenate([np.tile(e, e.size), _operands(rng, 1 << 16, 62), [2**62, 2**62]])
    _check_exact(
        ctx,
        "mul_q62",
        "the Q0.62 high multiply equals a·b/2^62 rounded half away from zero, exactly",
        k.mul_q62_array(a, b),
        [ref.mul_round(int(p), int(q), 62) for p, q in zip(a.tolist(), b.tolist(), strict=True)],
        function="mul_q62",
        input_format="|a|, |b| ≤ 2^62 (int64)",
        output_format="Q0.62 (int64)",
        domain=f"all pairs of {e.size} edge values, plus 2^16 random pairs",
    )
    s = rng.integers(0, 125, a.size)
    ok = [abs(int(p) * int(q)) >> int(t) < 2**62 for p, q, t in zip(a, b, s, strict=True)]
    a, b, s = a[ok], b[ok], s[ok]
    got = np.concatenate([k.mul_round_array(a[s == t], b[s == t], t) for t in range(125)])
    order = np.concatenate([np.flatnonzero(s == t) for t in range(125)])
    want = [ref.mul_round(int(a[i]), int(b[i]), int(s[i])) for i in order]
    _check_exact(
        ctx,
        "mul_round",
        "a·b/2^s from the exact 124-bit product, rounded half away from zero, for shifts 0..124",
        got,
        want,
        function="mul_round",
        input_format="|a|, |b| ≤ 2^62, shift 0..124",
        output_format="int64 (|result| < 2^62)",
        domain=f"{got.size:,} edge and random pairs whose result fits, random shifts",
    )


def _check_div(ctx: GateContext, k, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    n = np.concatenate([edge_ints(), _operands(rng, 1 << 16, 62)])
    d = np.abs(_operands(rng, n.size, 62)) + 1
    d[: edge_ints().size] = np.resize(
        np.array([1, 2, 3, 7, 2**31, 2**62, 2**63 - 1]), edge_ints().size
    )
    _check_exact(
        ctx,
        "div_round",
        "n/d rounds half away from zero exactly, negative dividends included (d ≥ 1)",
        k.div_round_array(n, d),
        [ref.div_round(int(p), int(q)) for p, q in zip(n.tolist(), d.tolist(), strict=True)],
        function="div_round",
        input_format="int64 n, d ≥ 1",
        output_format="int64",
        domain=f"edges and random, {n.size:,} pairs",
    )
    nn = np.abs(_operands(rng, 1 << 16, 62))
    dd = np.abs(_operands(rng, nn.size, 60)) + 1
    ss = rng.integers(0, 90, nn.size)
    ok = [(int(p) << int(t)) // int(q) < 2**62 - 1 for p, q, t in zip(nn, dd, ss, strict=True)]
    nn, dd, ss = nn[ok], dd[ok], ss[ok]
    _check_exact(
        ctx,
        "div_round_shift",
        "n·2^s/d by long division equals the exactly rounded quotient",
        k.div_round_shift_array(nn, dd, ss),
        [ref.div_round_shift(int(p), int(q), int(t)) for p, q, t in zip(nn, dd, ss, strict=True)],
        function="div_round_shift",
        input_format="n ≥ 0, 1 ≤ d < 2^61, s ≥ 0",
        output_format="int64 (< 2^62)",
        domain=f"{nn.size:,} random cases whose quotient fits",
    )
    return nn, dd, ss


def _check_narrow_isqrt(ctx: GateContext, k, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    got, count = k.narrow_int32(x)
    want, want_count = ref.narrow_int32(x)
    _check_exact(
        ctx,
        "narrow_int32",
        "saturating narrowing clamps to [-2^31, 2^31 - 1] exactly",
        got,
        want.tolist(),
        function="narrow_int32",
        input_format="int64",
        output_format="int32 + saturation count",
        domain=f"edges and random, {x.size:,} values",
    )
    ctx.check(
        "narrow_count",
        "the saturation count equals the number of values outside the int32 range",
        count == want_count,
        message=f"counted {count}, expected {want_count}",
        saturations=int(count),
    )
    n = np.arange(1 << 22, dtype=np.int64)
    _check_exact(
        ctx,
        "isqrt_exhaustive",
        "isqrt(n) = floor(sqrt(n)) for every n below 2^22",
        k.isqrt_array(n),
        [ref.isqrt(v) for v in n.tolist()],
        function="isqrt",
        input_format="int64, 0 ≤ n",
        output_format="int64",
        domain="exhaustive: every n in [0, 2^22), 2^22 points",
    )
    roots = np.abs(_operands(rng, 1 << 14, 31)) + 1
    e = edge_ints()
    m = np.concatenate([e[e >= 0], roots * roots - 1, roots * roots, roots * roots + 1])
    m = np.concatenate([m, np.abs(_operands(rng, 1 << 16, 62))])
    r = k.isqrt_array(m)
    _check_exact(
        ctx,
        "isqrt_edges",
        "isqrt is exact at perfect squares ± 1, powers of two ± 2, 2^63 - 1 and random values",
        r,
        [ref.isqrt(v) for v in m.tolist()],
        function="isqrt",
        input_format="int64, 0 ≤ n < 2^63",
        output_format="int64",
        domain=f"squares ± 1, edges, random: {m.size:,} points",
    )
    return m


def _check_core_compiled(
    ctx: GateContext, x: np.ndarray, div_shift: tuple[np.ndarray, ...], m: np.ndarray
) -> None:
    """compiled == interpreted on slices that reach every branch, with negative operands (where
    Pythran's C++ and Python's integers part ways) and results up to the int64 extremes."""
    e = edge_ints()
    small = np.concatenate([e[:150], e[-150:], x[-100:]])  # both extremes, then random
    edges = (
        "400 int64: the 150 most negative and 150 most positive edge values (powers of two ± "
        "0..2, out to ±(2^63 - 1)) and 100 random"
    )
    for shift in (0, 1, 7, 63):
        check_compiled(
            ctx,
            f"compiled_rshift_{shift}",
            "rshift_round_array",
            small,
            shift,
            inputs=f"a slice: {edges}, at shift {shift}, which reaches "
            + (
                "the s = 0 branch"
                if shift == 0
                else "both signs of x and both values of the rounding bit"
            ),
        )
    sv = small[np.abs(small) <= 2**62]  # mul_q62's domain, both signs, ±2^62 included
    a, b = np.concatenate([sv, sv]), np.concatenate([sv[::-1], -sv[::-1]])  # every sign pair
    pairs = f"{a.size} pairs (a, ±b) of the slice's values with |.| <= 2^62"
    check_compiled(
        ctx,
        "compiled_mul_q62",
        "mul_q62_array",
        a,
        b,
        inputs=f"a slice: {pairs}, which reaches every sign of the product and ±2^62 itself",
    )
    for s in (0, 31, 62, 90):
        t = max(0, (62 - s) // 2 + 1)  # |a b| / 2^s < 2^62: the result fits, as in the domain
        check_compiled(
            ctx,
            f"compiled_mul_round_{s}",
            "mul_round_array",
            a >> t,
            b >> t,
            s,
            inputs=f"a slice: {pairs}, shifted right by {t} so a·b/2^{s} fits, at s = {s}, "
            f"which reaches mul_round's {_MUL_ROUND_BRANCH[s]} branch with both signs",
        )
    n = np.concatenate([sv, -sv])
    big = np.resize(np.array([1, 2, 3, 7, 2**31, 2**62, 2**63 - 1]), sv.size)
    d = np.concatenate([np.abs(sv) % 1000 + 1, big])
    check_compiled(
        ctx,
        "compiled_div_round",
        "div_round_array",
        n,
        d,
        inputs=f"a slice: {n.size} dividends ± the slice's values, by divisors 1..1000 and "
        "1, 2, 3, 7, 2^31, 2^62, 2^63 - 1, which reaches both signs of n and both sides of "
        "the rounding test 2r >= d",
    )
    nn, dd, ss = (v[:400] for v in div_shift)
    nn, dd, ss = np.append(nn, 7), np.append(dd, 3), np.append(ss, 0)  # s = 0: no long division
    check_compiled(
        ctx,
        "compiled_div_round_shift",
        "div_round_shift_array",
        nn,
        dd,
        ss,
        inputs="a slice: the gate's first 400 div_round_shift cases (divisors up to 2^60, "
        "shifts 0..89) and 7·2^0/3, which reaches zero, one and several long-division steps "
        "and both sides of the rounding test",
    )
    check_compiled(
        ctx,
        "compiled_narrow",
        "narrow_int32",
        small,
        inputs=f"a slice: {edges}, which reaches the clamp below -2^31, the clamp above "
        "2^31 - 1 and the values in range",
    )
    ne, sq = int(np.count_nonzero(e >= 0)), 1 << 14  # m: edges, then roots^2 - 1, +0, +1
    r = np.concatenate([[0, 1, 2, 3], m[:ne], m[ne : ne + 100], m[ne + sq : ne + sq + 100]])
    r = np.concatenate([r, m[ne + 2 * sq : ne + 2 * sq + 100], m[-100:]])
    check_compiled(
        ctx,
        "compiled_isqrt",
        "isqrt_array",
        r,
        inputs=f"a slice: {r.size} values: 0..3 (the n < 2 branch), every non-negative edge value "
        "out to 2^63 - 1, 100 each of perfect squares - 1, + 0 and + 1, and 100 random values up "
        "to 2^62, which reaches the Newton loop's stop on both sides of a square",
    )


_MUL_ROUND_BRANCH = {0: "s = 0", 31: "0 < s < 62", 62: "s = 62", 90: "s > 62"}


# == fx_exp ======================================================================================
@gate(
    "fx_exp",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={"exp_q16": lsb(EXP_MAX_ERR_LSB_Q10), "exp_q50": lsb(EXP_MAX_ERR_LSB_Q10)},
    timeout=180,
)
def fx_exp(ctx: GateContext) -> None:
    """exp on non-positive inputs, Q0.31 output, within 513/1024 LSB: exhaustive over Q6.16."""
    k = ctx.compiled()
    bound = lsb(EXP_MAX_ERR_LSB_Q10)
    x16 = np.arange(-(64 << 16), 1, dtype=np.int64)
    got16 = k.exp_q31_array(x16, 16)
    anchor = f"gemmlowp exp_on_negative_values ≤ {ANCHOR_EXP} × 2^-31 = {ANCHOR_EXP} LSB here"
    ctx.check_reference(
        "exp_q16",
        "e^x in Q0.31 for every Q6.16 input in [-64, 0] is within the declared bound",
        raw(got16),
        in_lsb(ref.exp(ref.value(x16, 16)), 31),
        unit=Q31,
        function="exp",
        input_format="Q6.16 (x ≤ 0)",
        output_format="Q0.31 in int64, [0, 1]",
        domain="exhaustive: every Q6.16 input in [-64, 0], 2^22 + 1 points",
        anchor=anchor,
    )
    rng = np.random.default_rng(SEED)
    x50 = np.concatenate([-rng.integers(0, 64 << 50, 1 << 22), [-(1 << 62), -(70 << 50)]])
    ctx.check_reference(
        "exp_q50",
        "e^x in Q0.31 for 2^22 seeded random Q.50 inputs in [-64, 0] (and two below -64)",
        raw(k.exp_q31_array(x50, 50)),
        in_lsb(ref.exp(ref.value(x50, 50)), 31),
        unit=Q31,
        function="exp",
        input_format="Q.50 (x ≤ 0)",
        output_format="Q0.31 in int64, [0, 1]",
        domain="dense grid: 2^22 seeded random points over [-64, 0]",
        anchor=anchor,
    )
    anchor_table(ctx, [("exp", bound, ANCHOR_EXP)])
    ctx.check(
        "exp_monotone_exact_one",
        "e^0 is exactly 2^31 (one), and e^x never decreases as x rises over the exhaustive grid",
        int(got16[-1]) == 2**31 and bool(np.all(np.diff(got16) >= 0)),
    )
    probe = np.concatenate([x16[::4099], x16[_k_corrected(x16, 16)]])
    check_compiled(
        ctx,
        "compiled_exp",
        "exp_q31_array",
        probe,
        16,
        inputs=f"a slice: {probe.size} Q6.16 inputs, every 4099th of the exhaustive grid from -64 "
        "to 0 and every grid input where the estimate of k = floor(t / ln 2) is corrected, which "
        "reaches the clamp at -64, the underflow to 0 (k > 62), the k correction and e^0 = 1 "
        "(the gate uses no format above Q.56, so arg_q56's rounding conversion is not reached)",
    )
    check_shuffled(ctx, "deterministic", lambda v: k.exp_q31_array(v, 16), x16, "exp_q31")
    ctx.check_threads(
        "threads",
        "exp over every Q6.16 input in [-64, 0] (an `omp parallel for` over the elements) gives "
        "the same bits with 1 and 2 OpenMP threads, each in a fresh process",
        "exp_q31_array",
        x16,
        16,
    )
    ctx.evidence(
        f"exp within {bound:g} LSB of Q0.31 (gemmlowp: {ANCHOR_EXP}), measured "
        f"{max(c.measured for c in ctx.checks if c.kind == 'reference'):.4f} over 2^23 inputs"
    )


def _k_corrected(x: np.ndarray, frac: int) -> np.ndarray:
    """Indices where exp_neg_q62's estimate of k = floor(t / ln 2), t = -x, is off by one and
    corrected (x <= 0 in Q.frac, frac <= 56): the same integer estimate, from the kernel's
    constants, so a compiled == interpreted slice can include those inputs."""
    t = np.minimum(-x, 64 << frac) << (ARG_FRAC - frac)  # t in Q.56, <= 2^62
    est = ((t >> 26) * LOG2E_Q26) >> 56  # < 2^36 * 2^27: no int64 overflow
    r = t - est * LN2_Q56
    return np.flatnonzero((r < 0) | (r >= LN2_Q56))


# == fx_logistic: sigmoid, tanh, SiLU ===========================================================
LOGISTIC_CHECKS = {
    "sigmoid_q16": SIGMOID_MAX_ERR_LSB_Q10,
    "sigmoid_q40": SIGMOID_MAX_ERR_LSB_Q10,
    "tanh_q16": TANH_MAX_ERR_LSB_Q10,
    "tanh_q40": TANH_MAX_ERR_LSB_Q10,
    "silu_q16": SILU_MAX_ERR_LSB_Q10,
    "silu_q26": SILU_MAX_ERR_LSB_Q10,
}


@gate(
    "fx_logistic",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={name: lsb(q10) for name, q10 in LOGISTIC_CHECKS.items()},
    timeout=240,
)
def fx_logistic(ctx: GateContext) -> None:
    """sigmoid and tanh (Q0.31 output) and SiLU within 513/1024 LSB: exhaustive over Q6.16/Q5.16."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    x64 = np.arange(-(64 << 16), 64 << 16, dtype=np.int64)  # every Q6.16 input
    x32 = np.arange(-(32 << 16), 32 << 16, dtype=np.int64)  # every Q5.16 input
    wide = rng.integers(-(80 << 40), 80 << 40, 1 << 22)  # Q.40 over [-80, 80]
    sig16 = k.sigmoid_q31_array(x64, 16)
    tanh16 = k.tanh_q31_array(x32, 16)
    _logistic_reference(ctx, k, x64, x32, wide, sig16, tanh16)
    silu_grid = rng.integers(-(1 << 36), 1 << 36, 1 << 21)  # Q.26: |x| < 1024
    _silu_reference(ctx, k, x64, silu_grid)
    anchor_table(
        ctx,
        [
            ("sigmoid", lsb(SIGMOID_MAX_ERR_LSB_Q10), ANCHOR_LOGISTIC),
            ("tanh", lsb(TANH_MAX_ERR_LSB_Q10), ANCHOR_TANH),
        ],
    )
    half = x64.size // 2  # x64[half] is 0; x64[half - i] = -x64[half + i]
    ctx.check(
        "logistic_symmetries",
        "sigma(x) + sigma(-x) = 1 and tanh(-x) = -tanh(x) bit for bit on the exhaustive grids, "
        "sigma(0) = 1/2 and tanh(0) = 0 exactly, and both never decrease",
        bool(np.all(sig16[1 : half + 1][::-1] + sig16[half:] == 2**31))
        and bool(np.array_equal(tanh16[1 : x32.size // 2 + 1][::-1], -tanh16[x32.size // 2 :]))
        and int(sig16[half]) == 2**30
        and int(tanh16[x32.size // 2]) == 0
        and bool(np.all(np.diff(sig16) >= 0) and np.all(np.diff(tanh16) >= 0)),
    )
    _logistic_compiled_threads(ctx, wide, silu_grid)
    check_shuffled(
        ctx,
        "deterministic",
        lambda v: (k.sigmoid_q31_array(v, 40), k.tanh_q31_array(v, 40), k.silu_array(v, 40)),
        wide,
        "sigmoid, tanh and SiLU",
    )
    worst = {c.name: c.measured for c in ctx.checks if c.kind == "reference"}
    ctx.evidence(
        f"sigmoid {max(worst['sigmoid_q16'], worst['sigmoid_q40']):.4f} LSB (gemmlowp "
        f"{ANCHOR_LOGISTIC}), tanh {max(worst['tanh_q16'], worst['tanh_q40']):.4f} "
        f"(gemmlowp {ANCHOR_TANH}), SiLU {max(worst['silu_q16'], worst['silu_q26']):.4f} LSB"
    )


def _logistic_compiled_threads(ctx: GateContext, wide: np.ndarray, grid: np.ndarray) -> None:
    """compiled == interpreted on slices of the Q.40 and Q.26 grids, with the inputs where
    exp_neg_q62 corrects its estimate of k added (the grids hold almost none), and 1 vs 2 threads.
    """
    t16 = np.arange((64 << 16) + 1, dtype=np.int64)
    t_fix = t16[_k_corrected(-t16, 16)]  # e^-t's argument, Q.16, where k is corrected
    for func, x, frac, fix, clamp in (
        ("sigmoid", wide, 40, t_fix << 24, "±64 (saturation)"),
        ("tanh", wide, 40, (t_fix[t_fix % 2 == 0] >> 1) << 24, "±32 (saturation)"),  # e^-2|x|
        ("silu", grid, 26, t_fix << 10, "±64"),
    ):
        name = f"{func}_q31_array" if func != "silu" else "silu_array"
        probe = np.concatenate([x[:2048], fix, -fix])
        check_compiled(
            ctx,
            f"compiled_{func}",
            name,
            probe,
            frac,
            inputs=f"a slice: the first 2048 of the gate's Q.{frac} grid (seeded, uniform over "
            f"{'[-80, 80)' if frac == 40 else '[-1024, 1024)'}) and the {2 * fix.size} inputs "
            "±x where exp_neg_q62 corrects its estimate of k, which reaches both signs, the "
            f"clamp at {clamp} and the k correction",
        )
        ctx.check_threads(
            f"threads_{func}",
            f"{func} over the 2^{int(np.log2(x.size))} seeded Q.{frac} inputs (an `omp parallel "
            "for` over the elements) gives the same bits with 1 and 2 OpenMP threads, each in a "
            "fresh process",
            name,
            x,
            frac,
        )


def _logistic_reference(ctx, k, x64, x32, wide, sig16, tanh16) -> None:
    sig_anchor = f"gemmlowp logistic ≤ {ANCHOR_LOGISTIC} × 2^-31 = {ANCHOR_LOGISTIC} LSB here"
    tanh_anchor = f"gemmlowp tanh ≤ {ANCHOR_TANH} × 2^-31 = {ANCHOR_TANH} LSB here"
    for name, fn, got, x, frac, fmt, domain, anchor in (
        (
            "sigmoid_q16",
            ref.sigmoid,
            sig16,
            x64,
            16,
            "Q6.16",
            "exhaustive: every Q6.16 input in [-64, 64), 2^23 points",
            sig_anchor,
        ),
        (
            "sigmoid_q40",
            ref.sigmoid,
            k.sigmoid_q31_array(wide, 40),
            wide,
            40,
            "Q.40",
            "dense grid: 2^22 seeded random points over [-80, 80)",
            sig_anchor,
        ),
        (
            "tanh_q16",
            ref.tanh,
            tanh16,
            x32,
            16,
            "Q5.16",
            "exhaustive: every Q5.16 input in [-32, 32), 2^22 points",
            tanh_anchor,
        ),
        (
            "tanh_q40",
            ref.tanh,
            k.tanh_q31_array(wide, 40),
            wide,
            40,
            "Q.40",
            "dense grid: 2^22 seeded random points over [-80, 80)",
            tanh_anchor,
        ),
    ):
        function = name.split("_")[0]
        ctx.check_reference(
            name,
            f"{function}(x) in Q0.31 over {domain.split(': ')[1]} is within the declared bound",
            raw(got),
            in_lsb(fn(ref.value(x, frac)), 31),
            unit=Q31,
            function=function,
            input_format=fmt,
            output_format="Q0.31 in int64, " + ("[0, 1]" if function == "sigmoid" else "[-1, 1]"),
            domain=domain,
            anchor=anchor,
        )


def _silu_reference(ctx, k, x64, grid) -> None:
    for name, x, frac, fmt, domain in (
        ("silu_q16", x64, 16, "Q6.16", "exhaustive: every Q6.16 input in [-64, 64), 2^23 points"),
        (
            "silu_q26",
            grid,
            26,
            "Q.26, |x| < 2^10",
            "dense grid: 2^21 seeded random points over [-1024, 1024), |x_raw| < 2^36",
        ),
    ):
        ctx.check_reference(
            name,
            f"x·sigma(x) in the input's own format ({fmt}) is within the declared bound",
            raw(k.silu_array(x, frac)),
            in_lsb(ref.silu(ref.value(x, frac)), frac),
            unit=f"LSB (2^-{frac})",
            function="silu",
            input_format=fmt,
            output_format=fmt.split(",")[0],
            domain=domain,
        )


# == fx_norm: rsqrt, RMSNorm, L2 normalisation ==================================================
NORM_CHECKS = {
    "rsqrt_exhaustive": RSQRT_MAX_ERR_LSB_Q10,
    "rsqrt_random": RSQRT_MAX_ERR_LSB_Q10,
    "rmsnorm": RMSNORM_MAX_ERR_LSB_Q10,
    "l2norm": L2NORM_MAX_ERR_LSB_Q10,
    "rmsnorm_acc_shift": RMSNORM_MAX_ERR_LSB_Q10,  # beyond the stated widening |y| n / (4 acc)
}
NORM_FX, NORM_FW, NORM_FY = 20, 28, 30  # x in Q.20 (|x| <= 100), w in Q.28, RMSNorm out Q.30


@gate(
    "fx_norm",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={name: lsb(q10) for name, q10 in NORM_CHECKS.items()},
    timeout=180,
)
def fx_norm(ctx: GateContext) -> None:
    """rsqrt (Newton), RMSNorm and L2 normalisation within 513/1024 output LSB."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    _rsqrt_reference(ctx, k, rng)
    x, w, eps_raw = _norm_rows(rng)
    eps = ref.value(np.int64(eps_raw), 2 * NORM_FX)
    y = k.rmsnorm(x, w, eps_raw, NORM_FX, NORM_FW, NORM_FY, 0)
    ctx.check_reference(
        "rmsnorm",
        "w·x·rsqrt(mean(x^2) + eps) per row is within the declared bound of the float64 value",
        raw(y),
        in_lsb(ref.rmsnorm(ref.value(x, NORM_FX), ref.value(w, NORM_FW), eps), NORM_FY),
        unit=f"LSB (2^-{NORM_FY})",
        function="rmsnorm",
        input_format=f"x Q.{NORM_FX}, w Q.{NORM_FW}, eps Q.{2 * NORM_FX}",
        output_format=f"Q.{NORM_FY}",
        domain=f"dense grid: {x.shape[0]} rows × {x.shape[1]} (2^20 values), row scales "
        "2^-10..2^3, plus zero and one-hot rows",
    )
    z = k.l2norm(x, eps_raw, NORM_FX, 31, 0)
    ctx.check_reference(
        "l2norm",
        "x·rsqrt(sum(x^2) + eps) per row is within the declared bound of the float64 value",
        raw(z),
        in_lsb(ref.l2norm(ref.value(x, NORM_FX), eps), 31),
        unit=Q31,
        function="l2norm",
        input_format=f"Q.{NORM_FX}, eps Q.{2 * NORM_FX}",
        output_format="Q0.31",
        domain=f"dense grid: {x.shape[0]} rows × {x.shape[1]} (2^20 values), as rmsnorm",
    )
    _check_acc_shift(ctx, k, x, w)
    half = np.ascontiguousarray(x[1:][np.abs(x[1:]).max(axis=1) <= 50 << NORM_FX])  # 2x fits
    y2 = k.rmsnorm(2 * half, w, 0, NORM_FX, NORM_FW, NORM_FY, 0)
    ctx.check(
        "rmsnorm_scale_invariant",
        "at eps = 0, RMSNorm(2x) = RMSNorm(x) bit for bit (the mean square is normalised exactly)",
        bool(np.array_equal(y2, k.rmsnorm(half, w, 0, NORM_FX, NORM_FW, NORM_FY, 0))),
        rows=int(half.shape[0]),
    )
    _norm_compiled_threads(ctx, x, w, eps_raw)
    check_shuffled(
        ctx,
        "deterministic",
        lambda v: k.rmsnorm(v, w, eps_raw, NORM_FX, NORM_FW, NORM_FY, 0),
        x,
        "RMSNorm",
    )
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    ctx.evidence(f"rsqrt, RMSNorm and L2 norm within {worst:.4f} output LSB over 2^24 points")


def _norm_compiled_threads(ctx: GateContext, x: np.ndarray, w: np.ndarray, eps_raw: int) -> None:
    """compiled == interpreted on the first rows (zero, one-hot, random), as the gate runs them
    and at eps = 0 with rounded squares; then 1 vs 2 threads on every row."""
    rows = "a slice: the gate's first 6 rows of 256 (a zero row, a one-hot row, 4 random rows)"
    for name, eps, shift, reach in (
        ("", eps_raw, 0, "the exact sum of squares with eps, as the reference checks run"),
        (
            "_eps0_shift8",
            0,
            8,
            "the zero row's zero sum (outputs 0) and squares rounded before the sum (acc_shift 8)",
        ),
    ):
        check_compiled(
            ctx,
            f"compiled_rmsnorm{name}",
            "rmsnorm",
            x[:6],
            w,
            eps,
            NORM_FX,
            NORM_FW,
            NORM_FY,
            shift,
            inputs=f"{rows} at eps = {eps} raw, acc_shift {shift}, which reaches {reach}",
        )
        check_compiled(
            ctx,
            f"compiled_l2norm{name}",
            "l2norm",
            x[:6],
            eps,
            NORM_FX,
            31,
            shift,
            inputs=f"{rows} at eps = {eps} raw, acc_shift {shift}, which reaches {reach}",
        )
    for func, args in (
        ("rmsnorm", (x, w, eps_raw, NORM_FX, NORM_FW, NORM_FY, 0)),
        ("l2norm", (x, eps_raw, NORM_FX, 31, 0)),
    ):
        ctx.check_threads(
            f"threads_{func}",
            f"{func} over the gate's {x.shape[0]} rows of {x.shape[1]} (an `omp parallel for` "
            "over the rows) gives the same bits with 1 and 2 OpenMP threads, each in a fresh "
            "process",
            func,
            *args,
        )


def _check_acc_shift(ctx: GateContext, k, x: np.ndarray, w: np.ndarray, shift: int = 8) -> None:
    """With squares rounded to Q.(2fx - 8) before the sum, every output stays within the
    docstring's widened bound B + |y_raw| n / (4 acc), acc being the rounded sum.

    The widening is a function of the inputs (acc), stated in kernels.py before the run; the
    check measures each output's error beyond its own widening, max(0, |got - y| - |y| n/(4 acc)),
    against the declared B, with the float64 y itself as the reference (so its RMS and the
    all-zero output are the reference's)."""
    eps_raw = round(1e-6 * 2 ** (2 * NORM_FX - shift))
    eps = ref.value(np.int64(eps_raw), 2 * NORM_FX - shift)
    n = x.shape[1]
    acc = ((x * x + (1 << (shift - 1))) >> shift).sum(axis=1, keepdims=True) + n * eps_raw
    want = in_lsb(ref.rmsnorm(ref.value(x, NORM_FX), ref.value(w, NORM_FW), eps), NORM_FY)
    got = raw(k.rmsnorm(x, w, eps_raw, NORM_FX, NORM_FW, NORM_FY, shift))
    widen = np.abs(want) * n / (4 * acc)  # |y_raw| n / (4 acc), per output
    # the output with its error shrunk by the widening: |beyond - want| = max(0, err - widen)
    beyond = want + np.sign(got - want) * np.maximum(np.abs(got - want) - widen, 0)
    ctx.check_reference(
        "rmsnorm_acc_shift",
        f"with acc_shift = {shift} (squares rounded before the sum, for rows whose exact sum "
        "would not fit) every output is within 513/1024 + |y| n / (4 acc) LSB of float64",
        beyond,
        want,
        unit=f"LSB (2^-{NORM_FY}) beyond |y| n / (4 acc)",
        function="rmsnorm",
        input_format=f"x Q.{NORM_FX}, w Q.{NORM_FW}, eps Q.{2 * NORM_FX - shift}, squares "
        f"rounded to Q.{2 * NORM_FX - shift}",
        output_format=f"Q.{NORM_FY}",
        domain=f"dense grid: the same {x.shape[0]} rows × {n} (2^20 values), acc_shift {shift}",
        worst_extra_allowance_lsb=float(widen.max()),
    )


def _rsqrt_reference(ctx: GateContext, k, rng: np.random.Generator) -> None:
    x = np.arange(1, 1 << 22, dtype=np.int64)
    fi = np.concatenate([np.zeros_like(x), np.ones_like(x)])
    xx = np.concatenate([x, x])
    fo = np.full_like(xx, 31)
    got = k.rsqrt_array(xx, fi, fo)
    ctx.check_reference(
        "rsqrt_exhaustive",
        "1/sqrt(x) in Q0.31 for every integer x in [1, 2^22), and for every x/2 (odd format)",
        raw(got),
        in_lsb(ref.rsqrt(ref.value(xx, fi)), 31),
        unit=Q31,
        function="rsqrt",
        input_format="Q.0 and Q.1 (x > 0)",
        output_format="Q0.31",
        domain="exhaustive: every x in [1, 2^22) at frac 0 and at frac 1, 2^23 points",
    )
    bits = rng.integers(1, 63, 1 << 22)
    xr = np.maximum(rng.integers(0, 2**62, bits.size) >> (62 - bits), 1)
    fir = rng.integers(-20, 101, xr.size)
    # floor(log2 of the result) = floor((fir - log2 x) / 2), exactly from x's bit length b:
    # (fir - b + 1) // 2 when x = 2^(b-1), else (fir - b) // 2
    b = np.zeros_like(xr)
    rest = xr.copy()
    for s in (32, 16, 8, 4, 2, 1):
        top = rest >= (1 << s)
        b += s * top
        rest = np.where(top, rest >> s, rest)
    b += 1
    lv = (fir - b + ((xr & (xr - 1)) == 0)) // 2
    for_ = (35 - lv).astype(np.int64)  # results in [2^35, 2^36) raw
    ctx.check_reference(
        "rsqrt_random",
        "1/sqrt(x) for random x of every bit length 1..62 in random formats Q.-20..Q.100",
        raw(k.rsqrt_array(xr, fir, for_)),
        in_lsb(ref.rsqrt(ref.value(xr, fir)), for_),
        unit="LSB of the chosen output format",
        function="rsqrt",
        input_format="Q.f, f in [-20, 100], x in [1, 2^62)",
        output_format="Q.g, results 2^35..2^36 raw",
        domain="dense grid: 2^22 seeded random (x, format) pairs",
    )
    y = xr[xr < 2**60]
    f0 = fir[: y.size]
    g = for_[: y.size]
    ctx.check(
        "rsqrt_exact_scaling",
        "rsqrt(4x) = rsqrt(x)/2 bit for bit (same mantissa path), and x <= 0 returns -1",
        bool(np.array_equal(k.rsqrt_array(4 * y, f0, g), k.rsqrt_array(y, f0, g - 1)))
        and k.rsqrt_array(np.array([0, -5]), np.zeros(2, np.int64), np.zeros(2, np.int64)).tolist()
        == [-1, -1],
    )
    # x <= 0 (-1), x >= 2^62 (rounded into range), results too large (2^63 - 1) and too small (0)
    odd = np.array([0, -5, 2**63 - 1, 2**62, 1, 1], dtype=np.int64)
    odd_fo = np.array([31, 31, 31, 31, 100, -10], dtype=np.int64)
    small = np.concatenate([x[:20], xr[:20], odd])
    check_compiled(
        ctx,
        "compiled_rsqrt",
        "rsqrt_array",
        small,
        np.concatenate([fi[:20], fir[:20], np.zeros(odd.size, np.int64)]),
        np.concatenate([fo[:20], for_[:20], odd_fo]),
        inputs="a slice: x = 1..20 in Q.0, the first 20 random (x, format) pairs, and x = 0, -5, "
        "2^62, 2^63 - 1 and two results out of range, which reaches both parities of the "
        "normalising shift, x >= 2^62, x <= 0 (-1), a result too large (2^63 - 1) and too small "
        "(0)",
    )
    ctx.check_threads(
        "threads_rsqrt",
        "rsqrt over the 2^22 random (x, format) pairs (an `omp parallel for` over the elements) "
        "gives the same bits with 1 and 2 OpenMP threads, each in a fresh process",
        "rsqrt_array",
        xr,
        fir,
        for_,
    )


def _norm_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """4096 rows of 256 Q.20 values with per-row scales 2^-10..2^3 (|x| <= 100)."""
    scale = host.exp2(rng.uniform(-10, 3, (4096, 1)))
    x = np.clip(rng.standard_normal((4096, 256)) * scale, -100, 100)
    x[0] = 0.0  # a zero row: eps alone
    x[1] = 0.0
    x[1, 7] = 3.0  # one-hot: y = w sqrt(n) there
    w = rng.normal(1.0, 0.5, 256)
    eps_raw = round(1e-6 * 2 ** (2 * NORM_FX))
    xq = np.round(x * 2**NORM_FX).astype(np.int64)
    return np.ascontiguousarray(xq), np.round(w * 2**NORM_FW).astype(np.int64), eps_raw


# == fx_softmax ==================================================================================
SOFTMAX_FRAC = 24


@gate(
    "fx_softmax",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={
        "softmax_rows": lsb(SOFTMAX_MAX_ERR_LSB_Q10),
        "softmax_long": lsb(SOFTMAX_MAX_ERR_LSB_Q10),
    },
    timeout=180,
)
def fx_softmax(ctx: GateContext) -> None:
    """Row softmax (max-subtract, exp, exact int64 sum, one reciprocal) within 513/1024 LSB."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    x = _softmax_rows(rng)
    p = k.softmax_q31(x, SOFTMAX_FRAC)
    ctx.check_reference(
        "softmax_rows",
        "each of 4096 rows of 256 scores (scales 2^-4..2^5, plus uniform, one-hot and tied rows) "
        "is within the declared bound of the float64 softmax",
        raw(p),
        in_lsb(ref.softmax(ref.value(x, SOFTMAX_FRAC)), 31),
        unit=Q31,
        function="softmax",
        input_format=f"Q.{SOFTMAX_FRAC} rows of 256",
        output_format="Q0.31",
        domain="dense grid: 4096 rows × 256, 2^20 values",
    )
    long_row = np.round(rng.normal(0, 4, (1, 1 << 20)) * 2**SOFTMAX_FRAC).astype(np.int64)
    pl = k.softmax_q31(long_row, SOFTMAX_FRAC)
    ctx.check_reference(
        "softmax_long",
        "one row of 2^20 keys (the 1M-context decode case) is within the same bound: the exact "
        "two-word sum does not overflow and keeps every term",
        raw(pl),
        in_lsb(ref.softmax(ref.value(long_row, SOFTMAX_FRAC)), 31),
        unit=Q31,
        function="softmax",
        input_format=f"Q.{SOFTMAX_FRAC}, one row of 2^20",
        output_format="Q0.31",
        domain="one seeded row of 2^20 scores (the largest row the bound covers)",
    )
    _softmax_properties(ctx, k, x, p, pl)
    check_compiled(
        ctx,
        "compiled_softmax",
        "softmax_q31",
        x[:8, :32].copy(),
        SOFTMAX_FRAC,
        inputs="a slice: the first 32 scores of the gate's first 8 rows (uniform, one-hot with "
        "scores 1000 below the max, a tie, 5 random rows), which reaches exact terms, terms "
        "clamped at -64 that underflow to 0, and random rows",
    )
    check_shuffled(ctx, "deterministic", lambda v: k.softmax_q31(v, SOFTMAX_FRAC), x, "softmax")
    ctx.check_threads(
        "threads",
        f"softmax over the gate's {x.shape[0]} rows of {x.shape[1]} scores (an `omp parallel "
        "for` over the rows) gives the same bits with 1 and 2 OpenMP threads, each in a fresh "
        "process",
        "softmax_q31",
        x,
        SOFTMAX_FRAC,
    )
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    ctx.evidence(f"softmax within {worst:.4f} LSB of Q0.31 on 2^20 scores and a 2^20-key row")


def _softmax_rows(rng: np.random.Generator) -> np.ndarray:
    scale = host.exp2(rng.uniform(-4, 5, (4096, 1)))
    x = rng.standard_normal((4096, 256)) * scale
    x[0] = 3.25  # uniform: every p is 2^31 / 256 exactly
    x[1] = -1000.0
    x[1, 17] = 0.0  # one-hot: 1 and 0 exactly
    x[2] = -1000.0
    x[2, 3] = x[2, 200] = 5.0  # a two-way tie: 1/2 each
    return np.ascontiguousarray(np.round(x * 2**SOFTMAX_FRAC).astype(np.int64))


def _softmax_properties(ctx: GateContext, k, x: np.ndarray, p: np.ndarray, pl: np.ndarray) -> None:
    shift = k.softmax_q31(x + (12345 << SOFTMAX_FRAC) + 7, SOFTMAX_FRAC)
    perm = np.random.default_rng(SEED + 2).permutation(x.shape[1])
    permuted = k.softmax_q31(np.ascontiguousarray(x[:, perm]), SOFTMAX_FRAC)
    bound = lsb(SOFTMAX_MAX_ERR_LSB_Q10)
    slack = np.abs(p.sum(axis=1) - 2**31) / x.shape[1]
    ctx.check(
        "softmax_invariances",
        "adding a constant to every score changes nothing, bit for bit; permuting the keys "
        "permutes the weights, bit for bit; uniform, one-hot and tied rows are exact",
        bool(np.array_equal(shift, p))
        and bool(np.array_equal(permuted, p[:, perm]))
        and bool(np.all(p[0] == 2**31 // 256))
        and p[1].tolist() == [2**31 if j == 17 else 0 for j in range(256)]
        and int(p[2, 3]) == int(p[2, 200]) == 2**30,
    )
    ctx.check(
        "softmax_sums",
        "every row's weights sum to 1 within n times the per-weight bound (the 2^20 row too)",
        bool(np.all(slack <= bound)) and abs(int(pl.sum()) - 2**31) <= bound * pl.shape[1],
        worst_row_slack_per_key=float(slack.max()),
        long_row_sum_minus_one_lsb=int(pl.sum()) - 2**31,
    )


# == fx_sincos ===================================================================================
@gate(
    "fx_sincos",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.fx.kernels"],
    bounds={
        name: lsb(SINCOS_MAX_ERR_LSB_Q10) for name in ("sin_q22", "cos_q22", "sin_q40", "cos_q40")
    },
    timeout=180,
)
def fx_sincos(ctx: GateContext) -> None:
    """sin and cos of a phase in turns (exact range reduction), Q0.31, exhaustive over 22 bits."""
    k = ctx.compiled()
    p22 = np.arange(1 << 22, dtype=np.int64)
    s22, c22 = k.sincos_q31_array(p22, 22)
    rng = np.random.default_rng(SEED)
    p40 = rng.integers(-(2**62), 2**62, 1 << 22)  # any int64: only the low 40 bits count
    s40, c40 = k.sincos_q31_array(p40, 40)
    for name, got, fn, phase, bits, domain in (
        ("sin_q22", s22, ref.sin_turns, p22, 22, "exhaustive: every 22-bit phase, 2^22 points"),
        ("cos_q22", c22, ref.cos_turns, p22, 22, "exhaustive: every 22-bit phase, 2^22 points"),
        (
            "sin_q40",
            s40,
            ref.sin_turns,
            p40,
            40,
            "dense grid: 2^22 seeded random int64 phases (negative ones wrap), 40 bits",
        ),
        (
            "cos_q40",
            c40,
            ref.cos_turns,
            p40,
            40,
            "dense grid: 2^22 seeded random int64 phases (negative ones wrap), 40 bits",
        ),
    ):
        ctx.check_reference(
            name,
            f"{name[:3]}(2π p / 2^{bits}) in Q0.31 is within the declared bound",
            raw(got),
            in_lsb(fn(phase, bits), 31),
            unit=Q31,
            function=name[:3],
            input_format=f"phase in turns × 2^{bits} (mod 2^{bits})",
            output_format="Q0.31, [-1, 1]",
            domain=domain,
        )
    n = p22.size
    idx = np.arange(n)
    ctx.check(
        "sincos_symmetries",
        "over every 22-bit phase: sin(p + 1/2 turn) = -sin(p), cos(p + 1/2) = -cos(p), "
        "sin(-p) = -sin(p) and cos(p) = sin(p + 1/4 turn), all bit for bit",
        bool(np.array_equal(s22[(idx + n // 2) % n], -s22))
        and bool(np.array_equal(c22[(idx + n // 2) % n], -c22))
        and bool(np.array_equal(s22[(n - idx) % n], -s22))
        and bool(np.array_equal(s22[(idx + n // 4) % n], c22)),
    )
    check_compiled(
        ctx,
        "compiled_sincos",
        "sincos_q31_array",
        p40[:256].copy(),
        40,
        inputs="a slice: the first 256 of the gate's seeded random int64 phases (negative ones "
        "wrap), 40 bits, which reaches all eight octants (both mirrorings, every swap and sign)",
    )
    check_shuffled(ctx, "deterministic", lambda v: k.sincos_q31_array(v, 40), p40, "sin/cos")
    ctx.check_threads(
        "threads",
        "sin and cos of the 2^22 seeded random 40-bit phases (an `omp parallel for` over the "
        "elements) give the same bits with 1 and 2 OpenMP threads, each in a fresh process",
        "sincos_q31_array",
        p40,
        40,
    )
    worst = max(c.measured for c in ctx.checks if c.kind == "reference")
    ctx.evidence(f"sin and cos of phases in turns within {worst:.4f} LSB of Q0.31, 2^23 phases")
