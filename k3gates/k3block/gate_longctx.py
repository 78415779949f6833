"""K3's own long-context path at 2^20 tokens (1M context, HAVE): an integer KDA layer and an MLA
NoPE decode step at that length, with the memory accounting of each. It composes two primitives,
so it lives with the block that interleaves them."""

from __future__ import annotations

import hashlib

import numpy as np

from k3gates.infra.gate import GateContext, gate

from ..fx import host
from ..kda import kernels as kda_k
from ..kda import reference as kda_ref
from ..mla import kernels as mla_k

LONG = 1 << 20  # K3's 1M window, 2^20 tokens


# -- HAVE: K3's own path at 2^20 tokens ---------------------------------------------------------
KDA_H, KDA_D = 2, 32  # the 2^20-token KDA layer: 2 heads, d_k = d_v = 32 (K3: 96 x 128 x 128)
PIECE = 1 << 16  # inputs are drawn 2^16 tokens at a time, each piece from its own seed
WINDOW = 1 << 8  # the float64 restarts every 2^8 tokens from the state the kernel carried there
SMALL_LONG = 1 << 18  # the fault suite's shape (ctx.small): the same gate and bounds, 2^18 tokens
WHOLE = (0, -1)  # the pieces also held against float64 carried over the whole piece: first, last
COMPILED_TOKENS = 32  # compiled == interpreted on this many tokens of the gate's last piece
THREAD_TOKENS = 1 << 12  # the thread-count check's KDA call: this many tokens of the last piece
STATE_BYTES = KDA_H * KDA_D * KDA_D * 4  # the int32 state every call carries, whatever the length


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

    g = -5.0 * host.sigmoid(2.0 * rng.standard_normal(shape))
    return {
        "qs": q(unit(rng.standard_normal(shape)) * host.inv_sqrt(KDA_D), 24),
        "k": q(unit(rng.standard_normal(shape)) * (1 - 2.0**-23), 24),
        "v": q(rng.standard_normal(shape), 20),
        "g": np.ascontiguousarray(np.round(g * 2.0**24).astype(np.int64)),
        "beta": q(host.sigmoid(rng.standard_normal(shape[:2])), 30),
    }


def _to_reals(p: dict[str, np.ndarray], alpha: np.ndarray) -> tuple[np.ndarray, ...]:
    """The kernel's quantised inputs as reals, in kda_recurrent's argument order."""
    return (
        p["qs"] / 2.0**kda_k.QK_FRAC,
        p["k"] / 2.0**kda_k.QK_FRAC,
        p["v"] / 2.0**kda_k.V_FRAC,
        alpha / 2.0**kda_k.A_FRAC,
        p["beta"] / 2.0**kda_k.A_FRAC,
    )


def _float_windows(p: dict[str, np.ndarray], alpha: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The float64 recurrence (k3gates.kda.reference) over one piece, restarted at every window
    from the integer state the kernel carried into it (starts [windows, H, d_k, d_v]); all windows
    run as independent sequences at once. o in LSB of Q.20, [PIECE, H, d_v]."""
    n_w = PIECE // WINDOW

    def fold(x: np.ndarray) -> np.ndarray:  # [PIECE, H, ...] -> [WINDOW, windows x H, ...]
        x = np.moveaxis(x.reshape(n_w, WINDOW, *x.shape[1:]), 1, 0)
        return x.reshape(WINDOW, n_w * KDA_H, *x.shape[3:])

    s0 = starts.reshape(n_w * KDA_H, KDA_D, KDA_D) / 2.0**kda_k.V_FRAC
    o, _ = kda_ref.recurrent_vectorised(*(fold(x) for x in _to_reals(p, alpha)), s0)
    o = np.moveaxis(o.reshape(WINDOW, n_w, KDA_H, KDA_D), 0, 1).reshape(PIECE, KDA_H, KDA_D)
    return o * 2.0**kda_k.V_FRAC


def _float_whole(p: dict[str, np.ndarray], alpha: np.ndarray, start: np.ndarray) -> np.ndarray:
    """The float64 recurrence over one whole piece, started from the integer state the kernel
    carried to its first token and carried in float for its 2^16 tokens. o in LSB of Q.20."""
    o, _ = kda_ref.recurrent_vectorised(*_to_reals(p, alpha), start / 2.0**kda_k.V_FRAC)
    return o * 2.0**kda_k.V_FRAC


def _kda_long(ctx: GateContext, kern, n_tokens: int) -> dict:
    """All n_tokens through kda_decay + kda_recurrent three times, the integer state carried
    between calls: in calls of 2^16 tokens (one per piece), of 2^17 and of 2^8 tokens. Each
    piece's 2^8-token outputs are held against float64 restarted at every call from the state
    the kernel carried into it (and, for the pieces in WHOLE, carried in float over the whole
    piece). Hashes o in token order and the final state, so the splits hash the same bytes if
    they agree."""
    n_pieces = n_tokens // PIECE
    whole = {i % n_pieces for i in WHOLE}
    zero = np.zeros((KDA_H, KDA_D, KDA_D), dtype=np.int32)
    states = {label: zero.copy() for label in ("2^16", "2^8", "2^17")}
    hashes = {label: hashlib.sha256() for label in states}
    out: dict = {"sat": 0, "w_max": 0, "s_max": [], "err": [], "tokens": []}
    held: tuple = ()
    for i in range(n_pieces):
        p = _kda_piece(i)
        alpha = kern.kda_decay(p["g"])
        inputs = (p["qs"], p["k"], p["v"], alpha, p["beta"])

        def call(lo: int, hi: int, s0: np.ndarray, inputs=inputs) -> tuple:
            return kern.kda_recurrent(*(np.ascontiguousarray(x[lo:hi]) for x in inputs), s0)

        o, states["2^16"], stats = call(0, PIECE, states["2^16"])
        hashes["2^16"].update(o.tobytes())
        if i % 2 == 0:  # calls of 2^17 tokens: this piece and the next in one call
            held = inputs
        else:
            pair = tuple(np.concatenate([a, b]) for a, b in zip(held, inputs, strict=True))
            o_pair, states["2^17"], _ = kern.kda_recurrent(*pair, states["2^17"])
            hashes["2^17"].update(o_pair.tobytes())
            held = ()
        starts = np.zeros((PIECE // WINDOW, KDA_H, KDA_D, KDA_D), dtype=np.int32)
        parts = []
        for w in range(PIECE // WINDOW):
            starts[w] = states["2^8"]
            o_w, states["2^8"], st = call(w * WINDOW, (w + 1) * WINDOW, states["2^8"])
            parts.append(o_w)
            out["sat"] += int(st[0])
            out["w_max"] = max(out["w_max"], int(st[2]))
        o = np.concatenate(parts)
        hashes["2^8"].update(o.tobytes())
        out["sat"] += int(stats[0])
        out["w_max"] = max(out["w_max"], int(stats[2]))
        out["s_max"].append(int(np.abs(states["2^16"]).max()))
        out["tokens"].append((i + 1) * PIECE)
        if i == n_pieces - 1:  # the calls the contract checks rerun
            out["compiled_args"] = (
                *(np.ascontiguousarray(x[:COMPILED_TOKENS]) for x in inputs),
                starts[0],
            )
            out["thread_args"] = (
                *(np.ascontiguousarray(x[:THREAD_TOKENS]) for x in inputs),
                starts[0],
            )
            out["last_start"] = i * PIECE
        span = f"tokens {i * PIECE:,} to {(i + 1) * PIECE - 1:,}"
        want = _float_windows(p, alpha, starts)
        ctx.check_reference(
            f"kda_reference_piece{i:02d}",
            f"every o_t of piece {i} ({span}), run in 2^8-token calls with the integer state "
            "carried, is within W (1 + 1/sqrt(d_k)) + 1/2 LSB (W = 2^8) of the float64 "
            "recurrence restarted at every call from the state the kernel carried into it",
            o,
            want,
            unit="LSB (2^-20)",
            tokens=PIECE,
            restart_every=WINDOW,
        )
        out["err"].append(float(np.abs(o - want).max()))
        if i in whole:
            ctx.check_reference(
                f"kda_reference_piece{i:02d}_whole",
                f"the same outputs of piece {i} are within the 2^16-token bound of the float64 "
                "recurrence started from the state the kernel carried to the piece's first token "
                "and carried in float over all 2^16 tokens: a rigorous worst case, loose at this "
                "length, that measures how far the integer run drifts over a whole piece",
                o,
                _float_whole(p, alpha, starts[0]),
                unit="LSB (2^-20)",
                worst_case=True,
                tight=f"kda_reference_piece{i:02d}",
                tokens=PIECE,
            )
    for label, h in hashes.items():
        h.update(states[label].tobytes())
    out["digests"] = {f"calls of {label} tokens": h.hexdigest()[:16] for label, h in hashes.items()}
    return out


# the MLA decode over a 2^20-token latent cache: 2 heads at test widths (K3: 96 heads, 512 + 64)
MLA_H, MLA_NOPE, MLA_ROPE, MLA_KV, MLA_DV = 2, 32, 16, 64, 32


def _listed(ns: tuple[int, ...]) -> str:
    return ", ".join(f"{n:,}" for n in ns)


def _decode_at(n_long: int) -> tuple[int, ...]:
    """The cache lengths n one query each attends over, the last one the whole window."""
    return (1, 2, 1 << 10, 1 << 16, n_long // 2, n_long)


COMPILED_N = 1 << 10  # compiled == interpreted on the gate's own decode call at n = 2^10
THREAD_N = 1 << 16  # the thread-count check's decode call: the first 2^16 cache rows


def _mla_cache(rng: np.random.Generator, n: int, rows: int) -> dict[str, np.ndarray]:
    """A latent cache as MLA writes it: c_KV rows of rms 1 (the output of its RMSNorm), k_R of
    unit scale; W_UK, W_UV ~ N(0, 1/kv_lora); `rows` queries per head of scale
    (nope + rope)^-1/2 (the scale folded in, as the kernels take it). Quantised to the MLA
    kernels' formats."""

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
            rng.standard_normal((rows, MLA_H, MLA_NOPE + MLA_ROPE))
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
        # per 2^8-token call, restarted from the kernel's own state: W (1 + 1/sqrt(d)) + 1/2, the
        # recurrent form's a priori bound (k3gates.kda.kernels), the same as kda_recurrent's
        **{
            f"kda_reference_piece{i:02d}": kda_k.recurrent_bound_lsb(WINDOW, KDA_D)
            for i in range(16)
        },
        # worst case: the same bound over a whole 2^16-token piece carried in float
        **{
            f"kda_reference_piece{i:02d}_whole": kda_k.recurrent_bound_lsb(PIECE, KDA_D)
            for i in range(16)
        },
        # 1/2 + n 513 2^-17 + 2^-8 + 2^-10: the softmax's per-term error over n keys (mla kernels)
        **{
            f"mla_decode_n{n}": mla_k.attend_bound_q10(n) / 1024
            for n in sorted(set(_decode_at(LONG) + _decode_at(SMALL_LONG)))
        },
    },
    timeout=1200,
    requires=["kda_gate_decay", "kda_recurrent", "mla_forward"],
)
def longctx_1m(ctx: GateContext) -> None:
    """K3's own long-context path at 2^20 tokens: an integer KDA layer runs the whole window with
    its state bounded and constant in size, an MLA NoPE decode step attends over a 2^20-token
    latent cache, and the memory of each at 1M tokens is measured from arrays. (In the fault
    suite's --small run, the same gate at 2^18 tokens; the shape table says which ran.)"""
    n_tokens = SMALL_LONG if ctx.small else LONG
    kda = ctx.compiled("k3gates.kda.kernels")
    mla = ctx.compiled("k3gates.mla.kernels")
    decode_at = _decode_at(n_tokens)
    ctx.artifact(
        "table:the shape this run used",
        {
            "columns": ["", "this run", "the normal build"],
            "rows": [
                ["KDA tokens", n_tokens, LONG],
                ["2^16-token pieces", n_tokens // PIECE, LONG // PIECE],
                ["float64 restarted every (tokens)", WINDOW, WINDOW],
                ["MLA cache rows", n_tokens, LONG],
                ["MLA decode lengths", _listed(decode_at), _listed(_decode_at(LONG))],
                ["KDA state carried between calls (bytes)", STATE_BYTES, STATE_BYTES],
                ["why", "fault suite (--small)" if ctx.small else "build", ""],
            ],
        },
    )
    run = _kda_long(ctx, kda, n_tokens)
    ctx.check(
        "kda_state_bounded",
        f"over {n_tokens:,} tokens no KDA value saturated (the Q.20 state's limit is 2048) and "
        "|w| stayed in the domain the kernel's bounds are stated for (<= 16); the state's "
        "largest entry at every 2^16-token mark is reported and charted",
        run["sat"] == 0 and run["w_max"] <= kda_k.W_DOMAIN,
        saturations=run["sat"],
        max_abs_w=run["w_max"] / 2**20,
        max_abs_state=max(run["s_max"]) / 2**20,
    )
    ctx.check_digests(
        "kda_deterministic",
        f"the {n_tokens:,}-token run in calls of 2^16 tokens, of 2^17 and of 2^8 tokens (the "
        "state carried between calls) hashes the same outputs and final state",
        run["digests"],
    )
    ctx.check_threads(
        "kda_threads",
        f"kda_recurrent over {THREAD_TOKENS:,} tokens of the last piece, from the state the "
        "kernel carried there, gives the same bits with 1 and with 2 OpenMP threads (heads in "
        "parallel), each in a fresh process",
        "kda_recurrent",
        *run["thread_args"],
        modname="k3gates.kda.kernels",
    )
    ctx.artifact(
        f"curve:KDA over {n_tokens:,} tokens",
        {
            "x": run["tokens"],
            "series": {
                "max |S| (real units)": [s / 2**20 for s in run["s_max"]],
                "max |o - float64| per piece (LSB)": run["err"],
            },
            "xlabel": "tokens",
            "ylabel": "value",
        },
    )
    decode, mla_args = _mla_long(ctx, mla, n_tokens, decode_at)
    _memory(ctx)
    _contract(ctx, run, mla_args)
    small = " (the fault suite's 2^18-token shape)" if ctx.small else ""
    mla_bound = mla_k.attend_bound_q10(n_tokens) / 1024
    ctx.evidence(
        f"a KDA layer runs {n_tokens:,} tokens{small} with 0 saturations, max |S| "
        f"{max(run['s_max']) / 2**20:.2f}, every 2^8-token call within {max(run['err']):.2f} "
        f"LSB of float64 restarted from the kernel's state (bound "
        f"{kda_k.recurrent_bound_lsb(WINDOW, KDA_D)}); an MLA decode over a {n_tokens:,}-token "
        f"latent cache within {decode:.3f} LSB (bound {mla_bound:.0f})"
    )


def _mla_long(ctx: GateContext, mla, n_tokens: int, decode_at: tuple[int, ...]) -> tuple:
    """One decode query at each cache length in decode_at, the last one the whole window.
    Returns (the max error at the whole window, the arguments of the n = 2^10 call)."""
    m = _mla_cache(np.random.default_rng(20260709), n_tokens, len(decode_at))
    v_max = max(
        float(np.abs((m["c_kv"] / 2.0**16) @ (m["w_uv"][h].T / 2.0**16)).max())
        for h in range(MLA_H)
    )
    sats, errs = [], []
    for row, n in enumerate(decode_at):
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
        f"no score or output saturated at any cache length up to {n_tokens:,}, and every value "
        "|W_UV c| lies in the domain the decode bound is stated for (<= 16)",
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
                for n, err in zip(decode_at, errs, strict=True)
            ],
        },
    )
    head = {key: np.ascontiguousarray(m[key][:THREAD_N]) for key in ("c_kv", "k_r")}
    row = decode_at.index(THREAD_N)
    ctx.check_threads(
        "mla_threads",
        f"mla_decode_attend over a {THREAD_N:,}-token latent cache gives the same bits with 1 "
        "and with 2 OpenMP threads (heads in parallel), each in a fresh process",
        "mla_decode_attend",
        m["q"],
        row,
        head["c_kv"],
        head["k_r"],
        THREAD_N,
        m["w_uk"],
        m["w_uv"],
        modname="k3gates.mla.kernels",
    )
    row = decode_at.index(COMPILED_N)
    return errs[-1], (m["q"], row, m["c_kv"], m["k_r"], COMPILED_N, m["w_uk"], m["w_uv"])


def _memory(ctx: GateContext) -> None:
    """Facts, not checks: these sizes follow from the shapes, so the table shows them."""
    rows = _memory_rows()
    ctx.artifact(
        "table:memory at 2^20 tokens (int32 storage, K3 dimensions)",
        {
            "columns": ["what", "bytes per token", "MiB per layer", "K3 layers", "GiB in all"],
            "rows": rows,
        },
    )


def _contract(ctx: GateContext, run: dict, mla_args: tuple) -> None:
    """compiled == interpreted for both kernels this gate runs, on its own calls' inputs."""
    kda = ctx.compiled("k3gates.kda.kernels")
    kda.kda_recurrent(*run["compiled_args"])  # warm-up (the OpenMP pool)
    ctx.check_compiled_matches_interpreted(
        "compiled_kda",
        "kda_recurrent",
        *run["compiled_args"],
        inputs=f"a slice of the gate's real inputs: the first {COMPILED_TOKENS} tokens of its "
        f"last piece (token {run['last_start']:,} on), from the state the kernel carried there; "
        "in range like every call of the run, so the saturation branches are not reached here "
        "(kda_recurrent's own gate drives them)",
        modname="k3gates.kda.kernels",
    )
    ctx.compiled("k3gates.mla.kernels").mla_decode_attend(*mla_args)
    ctx.check_compiled_matches_interpreted(
        "compiled_mla",
        "mla_decode_attend",
        *mla_args,
        inputs=f"the gate's real inputs of its n = {COMPILED_N} decode call (the same query, "
        "cache and weights); no score or output saturates there, as at every length the gate ran",
        modname="k3gates.mla.kernels",
    )
