"""Foundations gate for the shared integer GEMM: gemm_i16 and gemm_i64 are exact.

Every output is compared, bound 0, with an independent exact computation (reference.py): float64
BLAS where it is provably exact (int16 operands, K <= 2^23) and Python's unbounded integers
otherwise. The inputs reach both of gemm_i16's paths (the int32 vpmaddwd path under the
Cauchy-Schwarz guard, and the int64 path with clamping), every shape remainder of its tiling
(M not a multiple of TILE_M, N not a multiple of NR, K longer than TILE_K), and the extremes:
rows of -2^15 and 2^15 - 1, powers of two +- {0, 1, 2}, sums landing exactly on 2^31 - 1, 2^31
and -2^31; for gemm_i64, elements out to 2^62 - 1, row pairs on both sides of its Hoelder domain
and every rounding shift class; for sum_outer (a weight gradient's token sum), sums beyond
int64 held exactly in two limbs.

Like the fx gates it counts toward no innovation (innovation=None): every gate whose kernels
import k3gates.gemm.kernels fails when it fails (runner.apply_requirements). It also records the
speed of gemm_i16 against numpy float32 `@` in the same process (an artifact, not a check).
"""

from __future__ import annotations

import time

import numpy as np

from k3gates.infra.gate import GateContext, gate

from . import reference as ref
from .kernels import EXACT_LSB, I64_ELEM_LIMIT, NR, TILE_K, TILE_M

KERNELS = "k3gates.gemm.kernels"
SEED = 20261203
EXACT = "exact (integer)"
WORDS = "exact (int64 as its two 32-bit words)"
# (M, N, K): tile remainders in every dimension; K > TILE_K for the K-block accumulation
I16_SHAPES = ((67, 130, 45), (2 * TILE_M + 3, 4 * NR + 3, TILE_K + 37), (1, 1, 1), (5, 3, 7))
I64_SHAPES = ((67, 30, 45), (TILE_M + 5, NR + 2, TILE_K + 11))
I64_SHIFTS = (0, 1, 17, 31, 62)
SPEED_N = 512  # the speed artifact's square size (issue 14 aims at >= 0.5x sgemm there)


@gate(
    "gemm_exact",
    innovation=None,
    level="HAVE",
    kernels=["k3gates.gemm.kernels"],
    bounds={
        "i16_random": EXACT_LSB,
        "i16_edges": EXACT_LSB,
        "i64_exact": EXACT_LSB,
        "sum_outer_exact": EXACT_LSB,
    },
    timeout=240,
)
def gemm_exact(ctx: GateContext) -> None:
    """The shared integer GEMM, C = A B^T (int16 -> int32 clamped and counted, int64 with a
    rounding shift), equals exact integer arithmetic on random and extreme inputs."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    n16 = _check_i16_random(ctx, k, rng)
    n_edge = _check_i16_edges(ctx, k)
    n64 = _check_i64(ctx, k, rng)
    n_sum = _check_sum_outer(ctx, k, rng)
    _check_compiled(ctx, rng)
    _check_order(ctx, k, rng)
    x = _q14_rows(rng, 256, 256)
    ctx.check_threads(
        "threads",
        "gemm_i16 on 256 x 256 x 256 Q1.14 operands (the `omp parallel for` over row tiles) "
        "gives the same bits with 1 and 2 OpenMP threads, each in a fresh process",
        "gemm_i16",
        x,
        _q14_rows(rng, 256, 256),
    )
    speed = _speed(k, rng)
    ctx.artifact("speed", speed)
    ctx.evidence(
        f"{n16 + n_edge:,} int16, {n64:,} int64 and {n_sum:,} two-limb token-sum outputs "
        "exact, both int16 paths and every "
        f"tile remainder; gemm_i16 at {SPEED_N}^2 ran at {speed['i16_gmacs']:.1f} G multiply-"
        f"adds/s, {speed['ratio']:.2f}x numpy float32 @ in the same process"
    )


def _q14_rows(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """int16 rows of norm about 1 in Q1.14 (NS5's iterates): gemm_i16's int32 path."""
    x = rng.standard_normal((m, k)) * (2.0**14 / np.sqrt(k))
    return np.clip(np.round(x), -32767, 32767).astype(np.int16)


def _i16(rng: np.random.Generator, m: int, k: int, kind: str) -> np.ndarray:
    if kind == "q14":
        return _q14_rows(rng, m, k)
    top = {"small": 1 << 11, "full": 1 << 15}[kind]
    return rng.integers(-top, top, (m, k)).astype(np.int16)


def _fast_pairs(a: np.ndarray, b: np.ndarray) -> int:
    """How many outputs satisfy the Cauchy-Schwarz guard (Python integers, from the definition):
    reported so the page shows that both of gemm_i16's paths ran."""
    na = [sum(v * v for v in row) for row in a.astype(object).tolist()]
    nb = [sum(v * v for v in row) for row in b.astype(object).tolist()]
    return sum(1 for x in na for y in nb if x * y < 2**62)


def _check_i16_random(ctx: GateContext, k, rng: np.random.Generator) -> int:
    got, want, sat, want_sat, fast, cases = [], [], 0, 0, 0, []
    for m, n, kk in I16_SHAPES:
        for kind in ("q14", "small", "full"):
            a, b = _i16(rng, m, kk, kind), _i16(rng, n, kk, kind)
            c, s = k.gemm_i16(a, b)
            # audit: the reference's expected values
            w, ws = ref.sat32(ref.gemm_f64(a, b).astype(np.int64))
            got.append(c.ravel())
            want.append(w.ravel())
            sat, want_sat, fast = sat + s, want_sat + ws, fast + _fast_pairs(a, b)
            cases.append(f"{m}x{n}x{kk} {kind}")
    got_all, want_all = np.concatenate(got), np.concatenate(want)
    ctx.check_reference(
        "i16_random",
        "gemm_i16 equals A B^T clamped to +-(2^31 - 1), exactly, on seeded random int16 (Q1.14 "
        "rows of norm 1, |x| < 2^11, full range) at shapes off every tile multiple, K > TILE_K "
        "included; the reference is float64 BLAS, exact here (K max|A| max|B| <= 2^53)",
        got_all.astype(np.float64),
        want_all.astype(np.float64),
        unit=EXACT,
        function="gemm_i16",
        input_format="int16 A [M, K], B [N, K]",
        output_format="int32 [M, N], clamped to +-(2^31 - 1), + clamp count",
        domain=f"seeded random at {len(cases)} shape x range cases, {got_all.size:,} outputs",
        cases=cases,
        int32_path_outputs=fast,
        int64_path_outputs=int(want_all.size - fast),  # audit: a count for the page
    )
    ctx.check(
        "i16_random_saturations",
        "the count gemm_i16 returns equals the number of exact products outside +-(2^31 - 1)",
        sat == want_sat and want_sat > 0,
        message=f"counted {sat}, expected {want_sat} (and more than 0)",
        saturations=int(sat),
    )
    return int(got_all.size)


CRAFTED = (  # int16 rows of length 3 whose products land on the int32 limits and the guard's
    (-(2**15), 2**15 - 1, 2**15 - 1),  # . the next = 2^30 + (2^15 - 1)^2 + 2^16 - 2
    (-(2**15), 2**15 - 1, 2),  # = 2^31 - 1 exactly: the largest unclamped value
    (-(2**15), -(2**15), 0),  # . itself = 2^31, norms 2^31 x 2^31 = 2^62: the guard's edge
    (2**15 - 1, 2**15 - 1, 2),  # . the next = -2^31: clamped
    (-(2**15), -(2**15), -(2**15)),
    (-(2**15) + 1, -(2**15) + 1, 0),  # . (-2^15, -2^15, 0): guard just holds, 2^31 - 2^16
)


def _edge_rows(kk: int) -> np.ndarray:
    """int16 rows of length kk >= 3 at the extremes (STYLE rule 2), plus three crafted rows
    whose products with each other land exactly on 2^31 - 1, 2^31 and -2^31."""
    rows = [np.zeros(kk), np.full(kk, -(2**15)), np.full(kk, 2**15 - 1)]
    rows.append(np.resize([2**15 - 1, -(2**15)], kk))
    for p in (0, 1, 7, 13, 14, 15):
        for d in (-2, -1, 0, 1, 2):
            v = max(-(2**15), min((1 << p) + d, 2**15 - 1))
            rows += [np.full(kk, v), np.full(kk, -v)]
    for pos in (0, kk // 2, kk - 1):  # one-hot extremes
        e = np.zeros(kk)
        e[pos] = -(2**15)
        rows.append(e)
    rows += [np.pad(c, (0, kk - 3)) for c in CRAFTED]
    return np.array(rows).astype(np.int16)


def _check_i16_edges(ctx: GateContext, k) -> int:
    got, want, sat, want_sat = [], [], 0, 0
    for kk in (3, 5, 40):
        e = _edge_rows(kk)
        crafted = e[-len(CRAFTED) :]
        # every pair of rows, and each crafted row filling a whole micro-tile of B (NR copies),
        # so that its guard is decided by its own norm: 2^31 x 2^31 = 2^62 must not pass
        for a, b in ((e, e), (crafted, np.repeat(crafted, NR, axis=0))):
            c, s = k.gemm_i16(a, b)
            # audit: the reference's values
            w, ws = ref.sat32(np.array(ref.gemm_int(a, b), dtype=np.int64))
            got.append(c.ravel())
            want.append(w.ravel())
            sat, want_sat = sat + s, want_sat + ws
    e3 = ref.gemm_int(_edge_rows(3), _edge_rows(3)).ravel().tolist()
    landmarks = {v: v in e3 for v in (2**31 - 1, 2**31, -(2**31), 2**31 - 2**16)}
    ctx.check_reference(
        "i16_edges",
        "gemm_i16 equals A B^T clamped to +-(2^31 - 1), exactly (Python integers), on every pair "
        "of extreme rows: zeros, all -2^15, all 2^15 - 1, alternating, powers of two +- {0, 1, "
        "2} and their negatives, one-hot -2^15, and sums exactly 2^31 - 1, 2^31 and -2^31",
        np.concatenate(got).astype(np.float64),
        np.concatenate(want).astype(np.float64),
        unit=EXACT,
        function="gemm_i16",
        input_format="int16 A [M, K], B [N, K]",
        output_format="int32 [M, N], clamped to +-(2^31 - 1), + clamp count",
        domain="edge rows: every pair of extremes, powers of two ± {0, 1, 2}, crafted limits",
        k_values=[3, 5, 40],
        rows=int(_edge_rows(3).shape[0]),
        exact_sums_reached={str(v): hit for v, hit in landmarks.items()},
    )
    ctx.check(
        "i16_edges_saturations",
        "on the extreme rows the returned clamp count equals the number of exact products "
        "outside +-(2^31 - 1), the crafted 2^31 and -2^31 among them",
        sat == want_sat and all(landmarks.values()),
        message=f"counted {sat}, expected {want_sat}; sums reached: {landmarks}",
        saturations=int(sat),
    )
    return int(sum(g.size for g in got))


def _i64_operands(rng: np.random.Generator, m: int, kk: int, top_bits: int) -> np.ndarray:
    """Signed int64 values of log-uniform magnitude up to 2^top_bits."""
    bits = rng.integers(0, top_bits + 1, (m, kk))
    mag = rng.integers(0, 2**62, (m, kk)) >> (62 - np.minimum(bits, 62))
    return np.where(rng.random((m, kk)) < 0.5, -mag, mag).astype(np.int64)


def _i64_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, str]]:
    cases = []
    for m, n, kk in I64_SHAPES:
        a = _i64_operands(rng, m, kk, 26)
        b = _i64_operands(rng, n, kk, 26)
        cases.append((a, b, f"{m}x{n}x{kk}, |x| < 2^26"))
        a = _i64_operands(rng, m, kk, 40)  # large A against small B: inside by Hoelder
        b = _i64_operands(rng, n, kk, 12)
        b[1] = _i64_operands(rng, 1, kk, 30)  # one row of B whose pairs fall outside
        cases.append((a, b, f"{m}x{n}x{kk}, |A| < 2^40, |B| < 2^12, one B row < 2^30"))
    a, b = _k1_extremes()
    cases.append((a, b, "K = 1 extremes: +-(2^62 - 1), 2^62, -2^63"))
    top = I64_ELEM_LIMIT - 1
    a = np.array([[top, top, top], [top, 0, 0], [2**61, 2**61, -1], [2**20, -(2**20), 3]])
    b = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 1], [-(2**40), 2**40, 7]])
    cases.append((a.astype(np.int64), b.astype(np.int64), "K = 3: L1 norms at and past 2^62"))
    return cases


def _k1_extremes() -> tuple[np.ndarray, np.ndarray]:
    """K = 1 rows at gemm_i64's extremes: inside (+-(2^62 - 1) against +-1) and outside."""
    top = I64_ELEM_LIMIT - 1
    a = np.array([[top], [-top], [1], [-1], [2**31], [I64_ELEM_LIMIT], [-(2**63)], [0]])
    b = np.array([[1], [-1], [2], [top], [2**31 - 1], [2**32]])
    return a.astype(np.int64), b.astype(np.int64)


def _check_i64(ctx: GateContext, k, rng: np.random.Generator) -> int:
    got, want, outside, want_outside = [], [], 0, 0
    for a, b, _ in _i64_cases(rng):
        for s in I64_SHIFTS:
            c, o = k.gemm_i64(a, b, s)
            w, wo = ref.gemm_i64(a, b, s)
            got.append(c.ravel())
            want.extend(w)
            outside, want_outside = outside + o, want_outside + wo
    g = np.concatenate(got)
    w = np.array(want, dtype=np.int64)
    ctx.check_reference(
        "i64_exact",
        "gemm_i64 equals A B^T rounded by 2^shift half away from zero, exactly (Python "
        "integers), and 0 outside its domain, for shifts 0, 1, 17, 31, 62, on random operands "
        "out to 2^40, tile remainders, K > TILE_K, and K = 1 extremes out to 2^62 - 1",
        _words(g),
        # audit: the reference's words (Python ints)
        _words(w),
        unit=WORDS,
        function="gemm_i64",
        input_format="int64 A [M, K], B [N, K], shift 0..62",
        output_format="int64 [M, N] + count outside the domain",
        domain="seeded random out to 2^40, and edge rows out to 2^62 - 1, inside and outside",
        cases=[label for _, _, label in _i64_cases(np.random.default_rng(0))],
        shifts=list(I64_SHIFTS),
    )
    ctx.check(
        "i64_domain",
        "the count of outputs gemm_i64 returns as outside its domain equals the count of row "
        "pairs the reference's own Hoelder test rejects (elements >= 2^62, or the bound >= 2^62)",
        outside == want_outside and want_outside > 0,
        message=f"counted {outside}, expected {want_outside} (and more than 0)",
        outside=int(outside),
    )
    return int(g.size)


def _sum_outer_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, tuple]]:
    """(G [R, P], A [R, Q], shifts): token sums inside int64 (every shift), and beyond it, to
    2^76.2, at shifts that bring the result back into int64."""
    return [
        (_i64_operands(rng, 37, 9, 30), _i64_operands(rng, 37, 70, 24), (0, 1, 24, 62)),
        (_i64_operands(rng, 300, 5, 40), _i64_operands(rng, 300, 6, 28), (14, 24, 62)),
        (np.full((300, 2), 2**40 - 1), np.full((300, 3), -(2**28)), (14, 24, 62)),
    ]


def _check_sum_outer(ctx: GateContext, k, rng: np.random.Generator) -> int:
    got, want, outside, top = [], [], 0, 0
    for g, a, shifts in _sum_outer_cases(rng):
        g, a = g.astype(np.int64), a.astype(np.int64)
        exact = (g.astype(object).T @ a.astype(object)).ravel()
        top = max(top, max(abs(int(v)) for v in exact))
        for s in shifts:
            c, o = k.sum_outer(g, a, s)
            got.append(c.ravel())
            want.extend(ref.sum_outer(g, a, s))
            outside += o
    g_all = np.concatenate(got)
    ctx.check_reference(
        "sum_outer_exact",
        "sum_outer equals G^T A rounded by 2^shift half away from zero, exactly (Python "
        "integers), for shifts 0 to 62, including token sums beyond int64 (to 2^76.2)",
        _words(g_all),
        _words(np.array(want, dtype=np.int64)),
        unit=WORDS,
        function="sum_outer",
        input_format="int64 G [R, P], A [R, Q], shift 0..62",
        output_format="int64 [P, Q]",
        domain="R max|G| max|A| < 2^78, R 2^16 max|A| < 2^62, the result within int64",
        largest_exact_sum_bits=top.bit_length(),
    )
    ctx.check(
        "sum_outer_inside",
        "every sum_outer case lies inside the domain its docstring states, and the kernel "
        "counts no limb output outside gemm_i64's domain, with a sum beyond int64 among them",
        outside == 0 and top >= 2**63,
        message=f"{outside} limb outputs outside; largest |sum| 2^{top.bit_length()}",
        outside=int(outside),
    )
    return int(g_all.size)


def _words(v: np.ndarray) -> np.ndarray:
    """int64 values as their high (signed) and low (unsigned) 32-bit words: exact in float64."""
    v = np.asarray(v, dtype=np.int64)
    return np.concatenate([v >> 32, v & 0xFFFFFFFF]).astype(np.float64)


def _check_compiled(ctx: GateContext, rng: np.random.Generator) -> None:
    e = _edge_rows(5)
    crafted = e[-len(CRAFTED) :]
    a = np.concatenate([e[:9], crafted, _i16(rng, 4, 5, "small")])  # 19 rows
    b = np.concatenate([np.repeat(crafted[2:3], NR, axis=0), e[-9:]])  # 13 rows: N % 4 = 1
    ctx.compiled().gemm_i16(a, b)  # warm-up: the OpenMP pool
    ctx.check_compiled_matches_interpreted(
        "compiled_i16",
        "gemm_i16",
        a,
        b,
        inputs="a slice: 19 x 5 rows (zeros, -2^15, 2^15 - 1, alternating, small powers of two, "
        "the crafted rows, random |x| < 2^11) against 13 rows (a micro-tile of the row whose "
        "norm meets the guard's edge, one-hot -2^15, and the crafted rows summing to 2^31 - 1, "
        "2^31, -2^31), which reaches the int32 path, the int64 path with clamping, and the "
        "N % 4 remainder (an int32 overflow in the interpreted run is an error)",
    )
    a64, b64 = _k1_extremes()
    mixed = np.concatenate([_i64_operands(rng, 6, 9, 30), np.pad(a64, ((0, 0), (0, 8)))])
    other = np.concatenate([_i64_operands(rng, 5, 9, 20), np.pad(b64, ((0, 0), (0, 8)))])
    for s in (0, 17):
        ctx.compiled().gemm_i64(mixed, other, s)
        ctx.check_compiled_matches_interpreted(
            f"compiled_i64_{s}",
            "gemm_i64",
            mixed,
            other,
            s,
            inputs=f"a slice: 14 x 9 against 11 x 9 int64 rows (random out to 2^30, and the K = 1 "
            f"extremes +-(2^62 - 1), 2^62, -2^63 padded), at shift {s}, which reaches the "
            "four-row micro-kernel, the one-pair path, and pairs outside the domain",
        )
    g, a = _i64_operands(rng, 40, 6, 40), _i64_operands(rng, 40, 7, 28)
    ctx.check_compiled_matches_interpreted(
        "compiled_sum_outer",
        "sum_outer",
        g,
        a,
        24,
        inputs="a slice: G 40 x 6 out to 2^40 against A 40 x 7 out to 2^28 at shift 24 (both "
        "limbs, negative limb sums, the two-limb rounding)",
    )


def _check_order(ctx: GateContext, k, rng: np.random.Generator) -> None:
    """A permutation of A's rows (other rows per tile, another thread's tile) and a split of K
    (other partial sums) give the same bits: the integer sums do not depend on order."""
    a, b = _q14_rows(rng, 3 * TILE_M + 5, 300), _q14_rows(rng, 41, 300)
    c, _ = k.gemm_i16(a, b)
    perm = rng.permutation(a.shape[0])
    cp, _ = k.gemm_i16(np.ascontiguousarray(a[perm]), b)
    lo, _ = k.gemm_i16(np.ascontiguousarray(a[:, :123]), np.ascontiguousarray(b[:, :123]))
    hi, _ = k.gemm_i16(np.ascontiguousarray(a[:, 123:]), np.ascontiguousarray(b[:, 123:]))
    ctx.check_deterministic(
        "order",
        "gemm_i16 on 197 x 41 x 300 Q1.14 rows: in order, with A's rows permuted (then restored, "
        "so each row meets other tile-mates and another thread), and as the sum of its K = 123 "
        "and K = 177 halves, gives bit-identical outputs",
        {
            "rows in order": c,
            "rows permuted, then restored": cp[np.argsort(perm)],
            "K split at 123, halves summed": (lo.astype(np.int64) + hi).astype(np.int32),
        },
    )


def _speed(k, rng: np.random.Generator) -> dict[str, float]:
    """gemm_i16 and numpy float32 @ at SPEED_N^2 on the same values, best of 5, interleaved."""
    a, b = _q14_rows(rng, SPEED_N, SPEED_N), _q14_rows(rng, SPEED_N, SPEED_N)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    best = {"i16": float("inf"), "sgemm": float("inf")}
    k.gemm_i16(a, b)
    _ = af @ bf.T
    for _ in range(5):
        for name, fn in (("i16", lambda: k.gemm_i16(a, b)), ("sgemm", lambda: af @ bf.T)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    macs = SPEED_N**3
    return {
        "size": SPEED_N,
        "i16_gmacs": macs / best["i16"] / 1e9,
        "sgemm_gmacs": macs / best["sgemm"] / 1e9,
        "ratio": best["sgemm"] / best["i16"],
    }
