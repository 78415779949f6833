"""Gates for the 1M context: integer RoPE with NTK and YaRN scaling for the models that use it
(PARTIAL), and K3's own path, an integer KDA layer and an MLA NoPE decode step at 2^20 tokens with
the memory accounting at that length (HAVE)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.gate import GateContext, gate

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
YARN_MSCALE = 0.1 * math.log(32.0) + 1.0  # YaRN's attention factor at s = 32


def _mscale_q30(m: float) -> int:
    return round(m * K.ONE_MSCALE)


def _table(name: str, base: float, s: float, l_orig: int) -> tuple[np.ndarray, float]:
    if name == "plain":
        return ref.inv_freq(HEAD_DIM, base), 1.0
    if name == "ntk":
        return ref.ntk_inv_freq(HEAD_DIM, base, s), 1.0
    return ref.yarn_inv_freq(HEAD_DIM, base, s, l_orig)


# pi to 100 digits: the turns conversion below is exact to far below 2^-62
PI = Fraction(
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706798"
)


def turns_q62(freq: np.ndarray) -> np.ndarray:
    """Radians per position -> Q0.62 turns per position: round(freq / (2 pi) 2^62), computed on
    the exact value of each float64 freq, so the error is 1/2 of 2^-62 turns (the kernel's
    stated frequency error)."""
    scale = Fraction(1 << K.PHASE_BITS) / (2 * PI)
    return np.array([round(Fraction(float(f)) * scale) for f in freq], dtype=np.int64)


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
        "rotate_yarn": K.rope_bound_q10(X_RAW_MAX, _mscale_q30(YARN_MSCALE), LONG - 1) / 1024,
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
        f = turns_q62(freq)
        m = _mscale_q30(mscale)
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
    f = turns_q62(ref.inv_freq(HEAD_DIM, 10000.0))
    check_compiled(ctx, "compiled", "rope_rotate", small_x, pos[:64], f, _mscale_q30(YARN_MSCALE))
    ctx.check_deterministic(
        "deterministic",
        "two runs, and a run over the rows in reversed order (reversed back), are identical",
        {
            "first": kern.rope_rotate(x, pos, f, K.ONE_MSCALE)[0],
            "second": kern.rope_rotate(x, pos, f, K.ONE_MSCALE)[0],
            "reversed": kern.rope_rotate(
                np.ascontiguousarray(x[::-1]), np.ascontiguousarray(pos[::-1]), f, K.ONE_MSCALE
            )[0][::-1],
        },
    )
    ctx.evidence(
        "integer RoPE with exact phase accumulation in turns; plain, NTK 8x and YaRN 32x within "
        f"{max(r[-1] for r in rows):.2f} LSB (2^-20) of float64 up to position 2^20 - 1"
    )


def _check_phases(ctx: GateContext, kern, pos: np.ndarray) -> None:
    """Exact range reduction and the relative-position property, on the integer phases."""
    f = turns_q62(ref.yarn_inv_freq(HEAD_DIM, 10000.0, 32.0, 32768)[0])
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


# -- HAVE: K3's own path at 2^20 tokens ---------------------------------------------------------
KDA_H, KDA_D = 2, 32  # the 2^20-token KDA layer: 2 heads, d_k = d_v = 32 (K3: 96 x 128 x 128)
PIECE = 1 << 16  # inputs are drawn and run 2^16 tokens at a time, the state carried between


def _kda_piece(index: int) -> dict[str, np.ndarray]:
    """Piece `index` of the 2^20-token input, drawn from its own seed (so any split re-draws the
    same tokens): unit k, unit q times d^-1/2, v ~ N(0, 1), K3's gate g = -5 sigma(N(0, 2^2)),
    beta = sigma(N(0, 1)); quantised to the formats of k3gates.kda.kernels."""
    rng = np.random.default_rng([20260707, index])
    shape = (PIECE, KDA_H, KDA_D)

    def unit(a: np.ndarray) -> np.ndarray:
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    def q(a: np.ndarray, frac: int) -> np.ndarray:
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal(shape)))
    return {
        "qs": q(unit(rng.standard_normal(shape)) * KDA_D**-0.5, 24),
        "k": q(unit(rng.standard_normal(shape)) * (1 - 2.0**-23), 24),
        "v": q(rng.standard_normal(shape), 20),
        "g": np.ascontiguousarray(np.round(g * 2.0**24).astype(np.int64)),
        "beta": q(1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:2]))), 30),
    }
