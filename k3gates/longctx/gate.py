"""Gates for the 1M context: integer RoPE with NTK and YaRN scaling for the models that use it
(PARTIAL), and K3's own path, an integer KDA layer and an MLA NoPE decode step at 2^20 tokens with
the memory accounting at that length (HAVE)."""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.gate import GateContext, gate

from ..kda import kernels as kda_k
from ..kda import reference as kda_ref
from ..mla import kernels as mla_k
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


def _kda_run(kern, pieces_per_run: int, want: dict | None) -> dict:
    """All 2^20 tokens through kda_decay + kda_recurrent, `pieces_per_run` pieces of 2^16 tokens
    per kernel call, the integer state carried between calls. Hashes o in token order (so any
    split hashes the same bytes); records |S| and the state's bytes after every call and, when
    `want` holds the float64 run, the max error of each call's outputs."""
    S = np.zeros((KDA_H, KDA_D, KDA_D), dtype=np.int32)
    h = hashlib.sha256()
    out: dict = {"sat": 0, "w_max": 0, "s_max": [], "state_bytes": [], "err": [], "tokens": []}
    for first in range(0, LONG // PIECE, pieces_per_run):
        parts = [_kda_piece(first + i) for i in range(pieces_per_run)]
        p = {key: np.ascontiguousarray(np.concatenate([q[key] for q in parts])) for key in parts[0]}
        alpha = kern.kda_decay(p["g"])
        o, S, stats = kern.kda_recurrent(p["qs"], p["k"], p["v"], alpha, p["beta"], S)
        h.update(o.tobytes())
        out["sat"] += int(stats[0])
        out["w_max"] = max(out["w_max"], int(stats[2]))
        out["s_max"].append(int(np.abs(S).max()))
        out["state_bytes"].append(int(S.nbytes))
        out["tokens"].append((first + pieces_per_run) * PIECE)
        if want is not None:
            want["S"] = _float_piece(p, alpha, want)
            out["err"].append(float(np.abs(o - want["o"]).max()))
    h.update(S.tobytes())
    out["digest"] = h.hexdigest()[:16]
    out["S"] = S
    return out


def _float_piece(p: dict, alpha: np.ndarray, want: dict) -> np.ndarray:
    """The float64 recurrence (k3gates.kda.reference) over one piece, on the kernel's quantised
    inputs and carrying its own float state; leaves the piece's o in LSB in want["o"]."""
    o, S = kda_ref.recurrent(
        p["qs"] / 2.0**kda_k.QK_FRAC,
        p["k"] / 2.0**kda_k.QK_FRAC,
        p["v"] / 2.0**kda_k.V_FRAC,
        alpha / 2.0**kda_k.A_FRAC,
        p["beta"] / 2.0**kda_k.A_FRAC,
        want["S"],
    )
    want["o"] = o * 2.0**kda_k.V_FRAC
    return S


# the MLA decode over a 2^20-token latent cache: 2 heads at test widths (K3: 96 heads, 512 + 64)
MLA_H, MLA_NOPE, MLA_ROPE, MLA_KV, MLA_DV = 2, 32, 16, 64, 32
DECODE_AT = (1, 2, 1 << 10, 1 << 16, 1 << 19, LONG)  # cache lengths n the query attends over


def _mla_cache(rng: np.random.Generator, n: int = LONG) -> dict[str, np.ndarray]:
    """A latent cache as MLA writes it: c_KV rows of rms 1 (the output of its RMSNorm), k_R of
    unit scale; W_UK, W_UV ~ N(0, 1/kv_lora); one query per head of scale (nope + rope)^-1/2
    (the scale folded in, as the kernels take it). Quantised to the MLA kernels' formats."""

    def q(a: np.ndarray, frac: int) -> np.ndarray:
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    c = rng.standard_normal((n, MLA_KV))
    c /= np.sqrt(np.mean(c * c, axis=1, keepdims=True))
    return {
        "c_kv": q(c, mla_k.C_FRAC),
        "k_r": q(rng.standard_normal((n, MLA_ROPE)), mla_k.C_FRAC),
        "w_uk": q(rng.standard_normal((MLA_H, MLA_NOPE, MLA_KV)) / np.sqrt(MLA_KV), mla_k.W_FRAC),
        "w_uv": q(rng.standard_normal((MLA_H, MLA_DV, MLA_KV)) / np.sqrt(MLA_KV), mla_k.W_FRAC),
        "q": q(
            rng.standard_normal((len(DECODE_AT), MLA_H, MLA_NOPE + MLA_ROPE))
            * 2.0
            / np.sqrt(MLA_NOPE + MLA_ROPE),
            mla_k.Q_FRAC,
        ),
    }


def _mla_float(m: dict[str, np.ndarray], row: int, n: int) -> np.ndarray:
    """float64 attention of query `row` over cache rows 0..n-1 (the equations of K3-SPEC section
    2, absorbed form, on the kernel's integer inputs), [H, d_v] in LSB of Q.20."""
    c = m["c_kv"][:n] / 2.0**mla_k.C_FRAC
    k_r = m["k_r"][:n] / 2.0**mla_k.C_FRAC
    out = np.zeros((MLA_H, MLA_DV))
    for h in range(MLA_H):
        qh = m["q"][row, h] / 2.0**mla_k.Q_FRAC
        w_uk = m["w_uk"][h] / 2.0**mla_k.W_FRAC
        w_uv = m["w_uv"][h] / 2.0**mla_k.W_FRAC
        s = c @ (w_uk.T @ qh[:MLA_NOPE]) + k_r @ qh[MLA_NOPE:]
        p = np.exp(s - s.max())
        out[h] = w_uv @ (p @ c) / p.sum()
    return out * 2.0**mla_k.O_FRAC


def _memory_rows() -> list[list]:
    """Bytes per layer at 2^20 tokens, from arrays allocated in the kernels' int32 storage at
    K3's dimensions: one token's MLA cache row and plain-MHA K/V row (times 2^20), and the whole
    KDA state (constant in T)."""
    kda_state = np.zeros((96, 128, 128), dtype=np.int32)  # H x d_k x d_v, per layer
    mla_row = np.zeros(512 + 64, dtype=np.int32)  # c_KV + shared k_R, per token
    mha_row = np.zeros(96 * 192 + 96 * 128, dtype=np.int32)  # K: 96 heads x 192, V: 96 x 128
    rows = []
    for name, per_token, fixed, layers in (
        ("KDA state (per layer, constant in T)", 0, kda_state.nbytes, 69),
        ("MLA latent cache c_KV + k_R", mla_row.nbytes, 0, 24),
        ("plain MHA K/V at K3's head dims", mha_row.nbytes, 0, 24),
    ):
        total = fixed + per_token * LONG
        rows.append([name, per_token, total / 2**20, layers, layers * total / 2**30])
    return rows


@gate(
    "longctx_1m",
    innovation="longctx",
    level="HAVE",
    kernels=["k3gates.kda.kernels", "k3gates.mla.kernels"],
    bounds={
        "kda_reference": kda_k.recurrent_bound_lsb(LONG, KDA_D),
        **{f"mla_decode_n{n}": mla_k.attend_bound_q10(n) / 1024 for n in DECODE_AT},
    },
    timeout=1200,
)
def longctx_1m(ctx: GateContext) -> None:
    """K3's own long-context path at 2^20 tokens: an integer KDA layer runs the whole window with
    its state bounded and constant in size, an MLA NoPE decode step attends over a 2^20-token
    latent cache, and the memory of each at 1M tokens is measured from arrays."""
    kda = ctx.compiled("k3gates.kda.kernels")
    mla = ctx.compiled("k3gates.mla.kernels")
    want = {"S": np.zeros((KDA_H, KDA_D, KDA_D))}
    run = _kda_run(kda, 1, want)
    resplit = _kda_run(kda, 2, None)
    ctx.check_reference(
        "kda_reference",
        f"every o_t of the 2^20-token KDA layer ({KDA_H} heads, d_k = d_v = {KDA_D}) is within "
        "the declared bound of the float64 recurrence carried over the same 2^20 tokens",
        np.array(run["err"]),
        np.zeros(len(run["err"])),
        unit="LSB (2^-20)",
        note="each point is the max error of one 2^16-token piece",
        outputs=LONG * KDA_H * KDA_D,
    )
    ctx.check(
        "kda_state_bounded",
        "over 2^20 tokens no KDA value saturated (the Q.20 state's limit is 2048) and |w| stayed "
        "in the domain the kernel's bounds are stated for (<= 16); the state's largest entry at "
        "every 2^16-token mark is reported and charted",
        run["sat"] == 0 and run["w_max"] <= kda_k.W_DOMAIN,
        saturations=run["sat"],
        max_abs_w=run["w_max"] / 2**20,
        max_abs_state=max(run["s_max"]) / 2**20,
    )
    ctx.check(
        "kda_state_constant",
        "the carried state's bytes, measured after every piece, are the same at 2^16 and at "
        "2^20 tokens: memory O(1) in T",
        len(set(run["state_bytes"])) == 1,
        state_bytes=run["state_bytes"][0],
        marks=len(run["state_bytes"]),
    )
    ctx.check_deterministic(
        "kda_deterministic",
        "the 2^20-token run in pieces of 2^16 and again in pieces of 2^17 (the state carried "
        "between calls) hashes the same outputs and final state",
        {
            "2^16 pieces": np.frombuffer(run["digest"].encode(), dtype=np.uint8),
            "2^17 pieces": np.frombuffer(resplit["digest"].encode(), dtype=np.uint8),
        },
    )
    ctx.artifact(
        "curve:KDA over 2^20 tokens",
        {
            "x": run["tokens"],
            "series": {
                "max |S| (real units)": [s / 2**20 for s in run["s_max"]],
                "max |o - float64| (LSB)": run["err"],
            },
            "xlabel": "tokens",
            "ylabel": "value",
        },
    )
    decode = _mla_long(ctx, mla)
    _memory(ctx)
    _contract_compiled(ctx)
    ctx.evidence(
        f"a KDA layer runs 2^20 tokens with 0 saturations, max |S| "
        f"{max(run['s_max']) / 2**20:.2f}, within {max(run['err']):.2f} LSB of float64; an MLA "
        f"decode over a 2^20-token latent cache within {decode:.3f} LSB (bound "
        f"{mla_k.attend_bound_q10(LONG) / 1024:.0f})"
    )


def _mla_long(ctx: GateContext, mla) -> float:
    """One decode query at each cache length in DECODE_AT, the last one the full 2^20."""
    m = _mla_cache(np.random.default_rng(20260709))
    v_max = max(
        float(np.abs((m["c_kv"] / 2.0**16) @ (m["w_uv"][h].T / 2.0**16)).max())
        for h in range(MLA_H)
    )
    sats, errs = [], []
    for row, n in enumerate(DECODE_AT):
        o, sat = mla.mla_decode_attend(m["q"], row, m["c_kv"], m["k_r"], n, m["w_uk"], m["w_uv"])
        sats.append(int(np.sum(sat)))
        want = _mla_float(m, row, n)
        ctx.check_reference(
            f"mla_decode_n{n}",
            f"an MLA NoPE decode query over a {n}-token latent cache (kv_lora {MLA_KV}, rope "
            f"{MLA_ROPE}, {MLA_H} heads) is within the declared bound of float64 attention",
            o,
            want,
            unit="LSB (2^-20)",
            saturations=sats[-1],
        )
        errs.append(float(np.abs(o - want).max()))
    ctx.check(
        "mla_no_overflow",
        "no score or output saturated at any cache length up to 2^20, and every value |W_UV c| "
        "lies in the domain the decode bound is stated for (<= 16)",
        sum(sats) == 0 and v_max <= 2**mla_k.V_MAX_BITS,
        saturations=sum(sats),
        max_abs_v=v_max,
    )
    ctx.artifact(
        "table:MLA decode at growing cache length",
        {
            "columns": ["cache tokens", "max |o - float64| (LSB)", "declared bound (LSB)"],
            "rows": [
                [n, err, mla_k.attend_bound_q10(n) / 1024]
                for n, err in zip(DECODE_AT, errs, strict=True)
            ],
        },
    )
    return errs[-1]


def _memory(ctx: GateContext) -> None:
    rows = _memory_rows()
    ctx.artifact(
        "table:memory at 2^20 tokens (int32 storage, K3 dimensions)",
        {
            "columns": ["what", "bytes per token", "MiB per layer", "K3 layers", "GiB in all"],
            "rows": rows,
        },
    )
    kda, mla, mha = (r[2] for r in rows)
    ctx.check(
        "memory_accounting",
        "measured from arrays at K3's dimensions: at 2^20 tokens a KDA layer's state is smaller "
        "than an MLA layer's latent cache, which is smaller than plain MHA's K/V",
        kda < mla < mha,
        kda_mib=kda,
        mla_mib=mla,
        mha_mib=mha,
        mha_over_mla=mha / mla,
    )


def _contract_compiled(ctx: GateContext) -> None:
    """compiled == interpreted for both kernels this gate runs, on small inputs."""
    p = {key: np.ascontiguousarray(val[:8]) for key, val in _kda_piece(0).items()}
    kda = ctx.compiled("k3gates.kda.kernels")
    alpha = kda.kda_decay(p["g"])
    s0 = np.zeros((KDA_H, KDA_D, KDA_D), dtype=np.int32)
    kda.kda_recurrent(p["qs"], p["k"], p["v"], alpha, p["beta"], s0)  # warm-up (OpenMP pool)
    ctx.check_compiled_matches_interpreted(
        "compiled_kda",
        "kda_recurrent",
        p["qs"],
        p["k"],
        p["v"],
        alpha,
        p["beta"],
        s0,
        modname="k3gates.kda.kernels",
    )
    m = _mla_cache(np.random.default_rng(3), 16)
    args = (m["q"], 0, m["c_kv"], m["k_r"], 16, m["w_uk"], m["w_uv"])
    ctx.compiled("k3gates.mla.kernels").mla_decode_attend(*args)
    ctx.check_compiled_matches_interpreted(
        "compiled_mla", "mla_decode_attend", *args, modname="k3gates.mla.kernels"
    )
