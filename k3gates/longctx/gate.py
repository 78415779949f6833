"""The 1M context's RoPE gate: integer RoPE with NTK and YaRN scaling for the models that use it
(PARTIAL). K3's own path at 2^20 tokens, which composes KDA and MLA, is proven in
k3block/gate_longctx.py."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from k3gates.infra.gate import GateContext, gate

from ..fx import host
from . import kernels as K
from . import reference as ref

LONG = 1 << 20  # K3's 1M window, 2^20 tokens
HEAD_DIM = 128  # a RoPE head dimension
X_REAL_MAX = 4.0  # rotated rows hold |x| < 4 (Q.20: |x_raw| < 2^22)
X_RAW_MAX = int(X_REAL_MAX) << K.X_FRAC
# (name, base, scale, original window): the plain table, NTK at 8x, YaRN at 32x of a 32k window
SCALINGS = (
    ("plain", 10000.0, 1.0, 0),
    ("ntk", 10000.0, 8.0, 0),
    ("yarn", 10000.0, 32.0, 32768),
)
YARN_MSCALE = 0.1 * math.log(32.0) + 1.0  # YaRN's attention factor at s = 32 (the reference's)


def mscale_q30(s: int) -> int:
    """YaRN's attention factor 0.1 ln s + 1 in Q.30, from 80-digit decimal ln: exact rounding."""
    return host.fixed(Fraction(1, 10) * Fraction(host.ln(s)) + 1, K.MSCALE_FRAC)


YARN_MSCALE_Q30 = mscale_q30(32)


def _table(name: str, base: float, s: float, l_orig: int) -> tuple[np.ndarray, float]:
    """The float64 frequencies and attention factor the reference rotates by."""
    if name == "plain":
        return ref.inv_freq(HEAD_DIM, base), 1.0
    if name == "ntk":
        return ref.ntk_inv_freq(HEAD_DIM, base, s), 1.0
    return ref.yarn_inv_freq(HEAD_DIM, base, s, l_orig)


def table_q62(name: str, base: int, s: int, l_orig: int) -> tuple[np.ndarray, int]:
    """The same table as the kernel receives it, derived exactly (k3gates/fx/host.py), so it is
    the same integers on every CPU: Q0.62 turns per position and the attention factor in Q.30.
    plain base^(-2i/D); NTK the same with base s^(D/(D-2)); YaRN extrap (ramp / s + 1 - ramp)
    with the ramp between floor(dim(32)) and ceil(dim(1)), dim(r) = D ln(L / (2 pi r)) / (2 ln
    base), from 80-digit logarithms."""
    e = [Fraction(2 * i, HEAD_DIM) for i in range(HEAD_DIM // 2)]
    if name == "plain":
        return host.power_turns_q62(base, e), K.ONE_MSCALE
    if name == "ntk":
        ntk = Fraction(HEAD_DIM, HEAD_DIM - 2)
        return host.turns_q62([([(base, ei), (s, ntk * ei)], Fraction(1)) for ei in e]), (
            K.ONE_MSCALE
        )

    def dim(r: int) -> Fraction:
        log_ratio = Fraction(host.ln(Fraction(l_orig) / (2 * host.PI * r)))
        return HEAD_DIM * log_ratio / (2 * Fraction(host.ln(base)))

    low = max(math.floor(dim(int(ref.BETA_FAST))), 0)
    high = Fraction(min(math.ceil(dim(int(ref.BETA_SLOW))), HEAD_DIM - 1))
    if high == low:
        high += Fraction(1, 1000)  # as the reference: a zero-width ramp would divide by zero
    ramp = [min(max((i - low) / (high - low), Fraction(0)), Fraction(1)) for i in range(len(e))]
    terms = [([(base, ei)], r / s + 1 - r) for ei, r in zip(e, ramp, strict=True)]
    return host.turns_q62(terms), mscale_q30(s)


def _positions(rng: np.random.Generator, n: int) -> np.ndarray:
    """Edges (0, 1, 2^k +- 1 up to the window, its last token) and random positions below 2^20."""
    edges = {0, 1, 2, LONG - 1, LONG - 2}
    for b in range(1, 21):
        edges |= {(1 << b) - 1, 1 << b, (1 << b) + 1}
    edges = sorted(e for e in edges if e < LONG)
    return np.concatenate([edges, rng.integers(0, LONG, n - len(edges))]).astype(np.int64)


# -- PARTIAL: integer RoPE, NTK and YaRN ------------------------------------------------------
@gate(
    "longctx_rope",
    innovation="longctx",
    level="PARTIAL",
    kernels=["k3gates.longctx.kernels"],
    bounds={
        "rotate_plain": K.rope_bound_q10(X_RAW_MAX, K.ONE_MSCALE, LONG - 1) / 1024,
        "rotate_ntk": K.rope_bound_q10(X_RAW_MAX, K.ONE_MSCALE, LONG - 1) / 1024,
        "rotate_yarn": K.rope_bound_q10(X_RAW_MAX, YARN_MSCALE_Q30, LONG - 1) / 1024,
    },
    timeout=300,
)
def longctx_rope(ctx: GateContext) -> None:
    """RoPE in integers: exact phase accumulation in turns, fx sin/cos, and the NTK and YaRN
    frequency scalings, against float64 at positions up to 2^20."""
    kern = ctx.compiled()
    rng = np.random.default_rng(20250707)
    pos = _positions(rng, 4096)
    x = np.round(rng.uniform(-X_REAL_MAX, X_REAL_MAX, (pos.size, HEAD_DIM)) * 2**K.X_FRAC)
    x = np.ascontiguousarray(np.clip(x, -X_RAW_MAX + 1, X_RAW_MAX - 1).astype(np.int32))
    rows = []
    for name, base, s, l_orig in SCALINGS:
        freq, mscale = _table(name, base, s, l_orig)
        f, m = table_q62(name, int(base), int(s), l_orig)
        got, sat = kern.rope_rotate(x, pos, f, m)
        want = ref.rotate(x / 2.0**K.X_FRAC, pos, freq, mscale) * 2.0**K.X_FRAC
        ctx.check_reference(
            f"rotate_{name}",
            f"{name} RoPE (base {base:g}, scale {s:g}) rotates 4096 rows of 128 to positions up to "
            "2^20 - 1 within the declared bound of float64's rotation by the float frequencies",
            got,
            want,
            unit="LSB (2^-20)",
            saturations=int(sat),
        )
        rows.append(
            [name, float(freq[0]), float(freq[-1]), mscale, float(np.abs(got - want).max())]
        )
    ctx.artifact(
        "table:frequency scalings",
        {
            "columns": ["scaling", "highest freq (rad/token)", "lowest", "mscale", "max err (LSB)"],
            "rows": rows,
        },
    )
    _check_phases(ctx, kern, pos)
    small_x = np.ascontiguousarray(x[:64] - (1 << 21))  # negatives on every path
    f = table_q62("plain", 10000, 1, 0)[0]
    args = (small_x, pos[:64], f, YARN_MSCALE_Q30)
    kern.rope_rotate(*args)  # warm-up (the OpenMP pool), so the speed ratio is the kernel's
    ctx.check_compiled_matches_interpreted(
        "compiled",
        "rope_rotate",
        *args,
        inputs="a slice: the first 64 rows (positions 0 to 2^20 - 1, the powers of two +-1), "
        "shifted by -2 so that both signs occur, at YaRN's mscale; they reach every branch of "
        "rope_rotate, phase_q62 and the fx sin/cos it calls (every quadrant of the phase)",
    )
    perm = np.random.default_rng(20250708).permutation(pos.size)
    shuffled = kern.rope_rotate(
        np.ascontiguousarray(x[perm]), np.ascontiguousarray(pos[perm]), f, K.ONE_MSCALE
    )[0]
    back = np.empty_like(shuffled)
    back[perm] = shuffled
    ctx.check_deterministic(
        "deterministic",
        "the 4096 rows rotated in a shuffled order (each row with its own position, restored "
        "afterwards) give the same bits as in their own order",
        {"rows in order": kern.rope_rotate(x, pos, f, K.ONE_MSCALE)[0], "rows shuffled": back},
    )
    ctx.check_threads(
        "threads",
        "rope_rotate over the 4096 rows (rows in parallel) gives the same bits with 1 and with "
        "2 OpenMP threads, each in a fresh process",
        "rope_rotate",
        x,
        pos,
        f,
        K.ONE_MSCALE,
    )
    ctx.evidence(
        "integer RoPE with exact phase accumulation in turns; plain, NTK 8x and YaRN 32x within "
        f"{max(r[-1] for r in rows):.2f} LSB (2^-20) of float64 up to position 2^20 - 1"
    )


def _check_phases(ctx: GateContext, kern, pos: np.ndarray) -> None:
    """Exact range reduction and the relative-position property, on the integer phases."""
    f = table_q62("yarn", 10000, 32, 32768)[0]
    big = np.array([LONG, (1 << 31) - 1, (1 << 30) + 12345], dtype=np.int64)
    p = np.concatenate([pos, big])
    got = kern.rope_phases(p, f)
    mod = 1 << K.PHASE_BITS
    want = [[(int(m) * int(fi)) % mod for fi in f] for m in p]
    exact = all(int(got[r, i]) == want[r][i] for r in range(len(p)) for i in range(len(f)))
    ctx.check(
        "phase_exact",
        "the phase (m f) mod 2^62 turns equals Python's exact big-integer value at every sampled "
        "position up to 2^31 - 1, so range reduction loses nothing however far m goes",
        exact,
        positions=int(p.size),
        frequencies=int(f.size),
    )
    rng = np.random.default_rng(7)
    m, n = rng.integers(0, LONG, 2048), rng.integers(0, LONG, 2048)
    lo, hi = np.minimum(m, n), np.maximum(m, n)
    diff = (kern.rope_phases(hi, f) - kern.rope_phases(lo, f)) % mod
    rel = kern.rope_phases((hi - lo).astype(np.int64), f)
    ctx.check(
        "relative_position_exact",
        "phase(m) - phase(n) = phase(m - n) mod 2^62 bit for bit on 2048 random pairs: the "
        "rotation between a query at m and a key at n depends on m - n alone",
        bool(np.array_equal(diff, rel)),
        pairs=2048,
    )
