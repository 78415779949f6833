"""Gates for the MX formats: exact decode (PARTIAL), exact quantise/dequantise/dot (HAVE)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from k3gates.infra.gate import GateContext, gate

from . import BLOCK, FORMATS, bits_per_value, dequantize, dot, pack_fp4, quantize, unpack_fp4
from . import reference as ref

EXACT = 0  # MX conversion has one correct answer: every bound here is zero
N_RANDOM = 1 << 20  # values per format in the HAVE gate (the issue asks for at least 10^6)


@gate(
    "mxfp_decode",
    innovation="mxfp",
    level="PARTIAL",
    kernels=["k3gates.mxfp.kernels"],
    bounds={f"{name}_codes": EXACT for name in FORMATS} | {"e8m0_scales": EXACT},
)
def mxfp_decode(ctx: GateContext) -> None:
    """Every element code of E2M1, E2M3, E3M2, E4M3, E5M2 and all 256 E8M0 scales decode exactly.

    Expected values come from the formats' definitions in reference.py, evaluated in float64,
    never from the kernel. The scale is held at 2^0 so each code's own value is compared.
    """
    for name in FORMATS:
        fmt = ref.FORMATS[name]
        codes = np.arange(1 << fmt.nbits, dtype=np.uint8)
        codes = np.resize(codes, -(-codes.size // BLOCK) * BLOCK)  # whole blocks
        scales = np.full(codes.size // BLOCK, 127, dtype=np.uint8)
        got = dequantize(scales, codes, name)
        want = ref.element_values(fmt)[codes]
        ctx.check_reference(
            f"{name}_codes",
            f"all {1 << fmt.nbits} {name.upper()} codes decode to the exact value "
            "their definition gives (NaN and Inf included)",
            got,
            want,
            unit="absolute (exact)",
            codes=1 << fmt.nbits,
        )
    k = ctx.compiled()
    b = np.arange(256, dtype=np.uint8)
    exp, nan = k.decode_e8m0(b)
    got = np.where(nan == 1, np.nan, np.ldexp(1.0, exp.astype(np.int32)))
    want = np.array([ref.decode_e8m0(int(v)) for v in b])
    ctx.check_reference(
        "e8m0_scales",
        "all 256 E8M0 bytes decode to 2^(b-127), and 0xFF to NaN",
        got,
        want,
        unit="absolute (exact)",
    )
    ctx.evidence("all 1,984 element codes of five formats and 256 E8M0 scales decode exactly")


def _edge_block_values(name: str) -> np.ndarray:
    """Blocks of 32 that probe every rule: zeros, subnormals, max, min normal, ties, specials."""
    f = ref.FORMATS[name]
    vals = ref.element_values(f)
    finite = np.unique(np.abs(vals[np.isfinite(vals)]))
    mids = (finite[:-1] + finite[1:]) / 2  # exact ties between neighbouring element values
    f32 = np.float32
    tiny = np.finfo(f32).smallest_subnormal
    blocks = [
        np.zeros(32),  # all-zero block
        -np.zeros(32),  # all negative zero
        np.full(32, tiny),  # float32 subnormals only: underflowing scale
        np.array([np.finfo(f32).max] + [1.0] * 31),  # float32 max: largest scale
        np.array([np.finfo(f32).tiny] * 16 + [tiny * 3] * 16),  # min normal with subnormals
        np.array([np.nextafter(f32(2.0**k), f32(0)) for k in range(-8, 24)]),  # just below 2^k
        np.array([2.0**k for k in range(-8, 24)]),  # exact powers of two
        np.resize(np.concatenate([mids, -mids]) * f.max_value / finite.max(), 32),  # ties at 2^0
        np.resize(finite, 32),  # every representable magnitude
        # saturation: above max but below 2^(emax+1), so the scale stays 2^0 and they clamp
        np.array(
            [np.nextafter(2.0 ** (f.emax + 1), 0), 1.99 * 2.0**f.emax, f.max_value * 1.01]
            + [1.0] * 29
        ),
        np.array([np.nan] + [1.0] * 31),  # NaN poisons the block
        np.array([np.inf] + [1.0] * 31),
        np.array([-np.inf] + [-1.0] * 31),
        np.array([2.0**-130, 2.0**-140, 2.0**-149] + [2.0**-126] * 29),  # shared_exp < -127
    ]
    return np.concatenate(blocks).astype(np.float32)


def _random_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 over many binades: normal draws, each block at its own power of two."""
    per_block = rng.integers(-135, 100, n // BLOCK).repeat(BLOCK)
    x = rng.standard_normal(n) * np.ldexp(1.0, per_block)  # exact powers of two
    # one block in eight spans many binades inside the block itself
    wide = rng.random(n // BLOCK).repeat(BLOCK) < 0.125
    x[wide] *= np.ldexp(1.0, rng.integers(-20, 20, int(wide.sum())))
    return x.astype(np.float32)


@gate(
    "mxfp_quantize",
    innovation="mxfp",
    level="HAVE",
    kernels=["k3gates.mxfp.kernels"],
    bounds={f"{name}_roundtrip": EXACT for name in FORMATS} | {"dot_exact": EXACT},
)
def mxfp_quantize(ctx: GateContext) -> None:
    """MX quantise, dequantise, FP4 packing and the MXFP8 x MXFP4 dot agree exactly with float64."""
    rng = np.random.default_rng(20260701)
    x = np.concatenate([_random_values(rng, N_RANDOM), *(_edge_block_values(n) for n in FORMATS)])
    for name in FORMATS:
        scales, codes = quantize(x, name)
        r_scales, r_codes = ref.quantize(x, name)
        got = dequantize(scales, codes, name)
        want = ref.dequantize(r_scales, r_codes, name)  # audit: the reference's values
        ctx.check_reference(
            f"{name}_roundtrip",
            f"{x.size:,} float32 values (random over 235 binades plus every edge "
            f"case) quantise to {name.upper()} and dequantise to exactly the float64 "
            "reference's values",
            got,
            want,
            unit="absolute (exact)",
        )
        bad_codes = int(np.count_nonzero(codes != r_codes))
        bad_scales = int(np.count_nonzero(scales != r_scales))
        # == calls -0.0 and +0.0 equal; the bit patterns do not (NaN payloads aside)
        finite = ~np.isnan(want)
        bad_bits = int(
            np.count_nonzero(got[finite].view(np.uint64) != want[finite].view(np.uint64))
        )
        ctx.check(
            f"{name}_codes_equal",
            f"the {name.upper()} codes and E8M0 scales are the reference's, and the "
            "dequantised float64 bit patterns too (signed zeros included)",
            bad_codes == 0 and bad_scales == 0 and bad_bits == 0,
            message=f"{bad_codes} codes, {bad_scales} scales, {bad_bits} values differ",
            codes_differing=bad_codes,
            scales_differing=bad_scales,
            values_differing_in_bits=bad_bits,
        )

    dot_args = _check_dot(ctx, rng)
    _check_packing(ctx, x)
    _check_compiled_and_determinism(ctx, x, dot_args)
    ctx.evidence(
        f"{x.size:,} values x 5 formats quantise bit-exactly; MXFP8·MXFP4 dot exact; "
        f"{ctx.artifacts['mxfp4_bits_per_value']} bits/value measured"
    )


def _block_units(sa: np.ndarray, sb: np.ndarray, a_fmt: str, b_fmt: str) -> np.ndarray:
    """Each block's unit, as a power of two: the product of the two scales and the two formats'
    smallest subnormals, 2^((sa - 127) + (sb - 127) + (emin_a - m_a) + (emin_b - m_b)). Every
    product in the block, and so the block's exact dot, is an integer multiple of it."""
    fa, fb = ref.FORMATS[a_fmt], ref.FORMATS[b_fmt]
    sub = (fa.emin - fa.mbits) + (fb.emin - fb.mbits)
    return sa.astype(np.int64) + sb.astype(np.int64) - 254 + sub


def _reference_block_dots(av: np.ndarray, bv: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """The reference's exact dot of each block of 32, in that block's unit (an integer below
    2^41, exact in float64); NaN for a block holding a NaN or an infinity (IEEE)."""
    out = np.empty(unit.size)
    for k in range(unit.size):
        a, b = av[k * BLOCK : (k + 1) * BLOCK], bv[k * BLOCK : (k + 1) * BLOCK]
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            out[k] = np.nan
            continue
        out[k] = float(ref.exact_dot(a, b) / Fraction(2) ** int(unit[k]))
    return out


def _dot_operands(rng: np.random.Generator) -> list[tuple]:
    """80 MXFP8 (E4M3, E5M2) x MXFP4 operand pairs of 1..8 blocks over many binades, and one of
    4 blocks with two special ones: a NaN in a (scale 0xFF) and an E4M3 NaN code (0x7F)."""
    pairs = []
    for a_fmt in ("e4m3", "e5m2"):
        for _ in range(40):
            n = BLOCK * int(rng.integers(1, 9))
            a = _random_values(rng, n)
            b = (rng.standard_normal(n) * np.ldexp(1.0, rng.integers(-6, 6))).astype(np.float32)
            pairs.append((a_fmt, *quantize(a, a_fmt), *quantize(b, "e2m1")))
    a = _random_values(rng, 4 * BLOCK)
    a[BLOCK + 5] = np.nan  # block 1: NaN scale
    b = rng.standard_normal(4 * BLOCK).astype(np.float32)
    sa, ca = quantize(a, "e4m3")
    ca[2 * BLOCK + 7] = 0x7F  # block 2: an E4M3 NaN element
    pairs.append(("e4m3", sa, ca, *quantize(b, "e2m1")))
    return pairs


def _check_dot(ctx: GateContext, rng: np.random.Generator) -> tuple:
    k = ctx.compiled()
    got, want, total_ok, blocks = [], [], True, 0
    pairs = _dot_operands(rng)
    for a_fmt, sa, ca, sb, cb in pairs:
        d, e, cls = k.mx_block_dot(sa, ca, FORMATS[a_fmt], sb, cb, FORMATS["e2m1"])
        unit = _block_units(sa, sb, a_fmt, "e2m1")
        # the kernel's block value d 2^e in the block's unit; IEEE (NaN) where it flags a special
        got.append(
            np.where(cls == 0, np.ldexp(d.astype(np.float64), (e - unit).astype(int)), np.nan)
        )
        av, bv = ref.dequantize(sa, ca, a_fmt), ref.dequantize(sb, cb, "e2m1")
        want.append(_reference_block_dots(av, bv, unit))
        blocks += unit.size
        if np.isfinite(want[-1]).all():  # the face's exact Fraction sum of the kernel's blocks
            total_ok &= dot(sa, ca, a_fmt, sb, cb, "e2m1", exact=True) == ref.exact_dot(av, bv)
    ctx.check_reference(
        "dot_exact",
        f"every one of {blocks} blocks of {len(pairs)} MXFP8 (E4M3 and E5M2) x MXFP4 dot "
        "products, d 2^e from the kernel, equals the exact rational dot of the reference's "
        "dequantised values (counted in the block's unit, two scales times the two smallest "
        "subnormals), and blocks with a NaN scale or NaN element are flagged special",
        np.concatenate(got),
        np.concatenate(want),
        unit="units of each block's smallest product (exact)",
        trials=len(pairs),
        blocks=blocks,
    )
    ctx.check(
        "dot_sum_exact",
        "the face's exact sum of the kernel's blocks, a Fraction, equals the reference's exact "
        "rational dot for every operand pair without special blocks",
        total_ok,
    )
    first, special = pairs[0], pairs[-1]  # both E4M3 x E2M1: one call holds both
    return tuple(np.concatenate([p, q]) for p, q in zip(first[1:], special[1:], strict=True))


def _check_packing(ctx: GateContext, x: np.ndarray) -> None:
    scales, codes = quantize(x, "e2m1")
    packed = pack_fp4(codes)
    low_even = bool(np.array_equal(packed & 0xF, codes[0::2]))
    high_odd = bool(np.array_equal(packed >> 4, codes[1::2]))
    ctx.check(
        "fp4_packing",
        "FP4 packs two codes per byte with the even index in the low nibble, and unpacking "
        "restores every code",
        low_even and high_odd and bool(np.array_equal(unpack_fp4(packed), codes)),
    )
    # storage, from the arrays the kernels returned: a displayed fact (sizes, not a check)
    mxfp4 = bits_per_value(scales, packed, x.size)
    s8, c8 = quantize(x, "e4m3")
    mxfp8 = bits_per_value(s8, c8, x.size)
    ctx.artifact("mxfp4_bits_per_value", mxfp4)
    ctx.artifact("mxfp8_bits_per_value", mxfp8)
    ctx.artifact(
        "table:storage measured from the arrays the kernels returned",
        {
            "columns": ["format", "values", "scale bytes", "element bytes", "bits per value"],
            "rows": [
                ["MXFP4 (E2M1, packed)", x.size, scales.nbytes, packed.nbytes, mxfp4],
                ["MXFP8 (E4M3)", x.size, s8.nbytes, c8.nbytes, mxfp8],
            ],
        },
    )


def _check_compiled_and_determinism(ctx: GateContext, x: np.ndarray, dot_args: tuple) -> None:
    k = ctx.compiled()
    n_edge = len(FORMATS) * _edge_block_values("e2m1").size // BLOCK
    probe = np.concatenate([x[: 64 * BLOCK], x[-n_edge * BLOCK :]]).view(np.uint32)
    for name, f in FORMATS.items():
        ctx.check_compiled_matches_interpreted(
            f"compiled_{name}",
            "quantize_mx",
            probe,
            f,
            inputs=f"a slice: the gate's first 64 random blocks and all {n_edge} edge-case blocks "
            "(zeros of both signs, float32 subnormals, float32 max, ties, saturation, NaN, Inf, "
            f"scales below 2^-127) of every format, {probe.size:,} values, which reaches every "
            "rule: all-zero, NaN/Inf and underflowing blocks, subnormal inputs and elements, "
            "rounding ties and saturation",
        )
    for name, f in FORMATS.items():
        s, c = quantize(probe.view(np.float32), name)
        every = np.resize(np.arange(1 << ref.FORMATS[name].nbits, dtype=np.uint8), 256)
        scales = np.concatenate([s, [127] * 8, [255] * 8]).astype(np.uint8)  # 256 codes each
        codes = np.concatenate([c, every, every])
        ctx.check_compiled_matches_interpreted(
            f"compiled_dequantize_{name}",
            "dequantize_mx",
            scales,
            codes,
            f,
            inputs="a slice: the quantised slice above and every code of the format under the "
            "scale 2^0 and under the NaN scale 0xFF, which reaches subnormal and normal codes "
            "of both signs, the format's NaN and Inf codes where it has them, and NaN scales",
        )
    sa, ca, sb, cb = dot_args
    ctx.check_compiled_matches_interpreted(
        "compiled_dot",
        "mx_block_dot",
        sa,
        ca,
        FORMATS["e4m3"],
        sb,
        cb,
        FORMATS["e2m1"],
        inputs=f"a slice of the gate's real inputs: its first E4M3 x E2M1 dot operands and the "
        f"pair with special blocks ({sa.size} blocks), which reaches finite blocks of both "
        "signs, a NaN scale and a NaN element code",
    )
    ctx.check_compiled_matches_interpreted(
        "compiled_pack",
        "pack_fp4",
        quantize(probe.view(np.float32), "e2m1")[1],
        inputs="a slice: the E2M1 codes of the slice above (every code, both nibbles)",
    )
    # the same values in another block order quantise to the same codes, permuted
    nb = x.size // BLOCK
    perm = np.random.default_rng(7).permutation(nb)
    in_order = k.quantize_mx(x.view(np.uint32), 0)
    ps, pc = k.quantize_mx(x.reshape(nb, BLOCK)[perm].reshape(-1).view(np.uint32), 0)
    inv = np.argsort(perm)
    unpermuted = (ps[inv], pc.reshape(nb, BLOCK)[inv].reshape(-1))
    ctx.check_deterministic(
        "deterministic",
        f"MXFP4 quantisation of the {nb:,} blocks in order, and of the same blocks in a shuffled "
        "order (un-shuffled afterwards), give identical scales and codes",
        {"in order": in_order, "blocks shuffled, then restored": unpermuted},
    )
    ctx.check_threads(
        "threads",
        f"MXFP4 quantisation of the gate's {x.size:,} values (an `omp parallel for` over the "
        "blocks) gives the same scales and codes with 1 and 2 OpenMP threads, each in a fresh "
        "process",
        "quantize_mx",
        x.view(np.uint32),
        0,
    )
