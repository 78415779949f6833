"""The 1M-context training form (STRONG): KDA's backward over 2^16 tokens with one state kept per
chunk, its gradients against float64, and its memory against keeping every token's state."""

from __future__ import annotations

import numpy as np

from k3gates.infra import fresh, gradcheck
from k3gates.infra.gate import GateContext, digest, gate

from ..fx import host
from . import kernels_grad as K
from . import reference_grad as ref

T_LONG = 1 << 16  # tokens in one sequence
N_H, D = 2, 32  # heads, d_k = d_v (K3: 96 x 128 x 128)
CHUNK = 64  # the chunk the training form keeps one state per
BLOCK = 4096  # tokens per float64 block (memory of the reference)
CHUNK_BLOCK = 128  # chunks per float64 block
SPLIT_T = 1 << 12  # the split and thread checks run on this many tokens
INTERP_T = 70  # compiled == interpreted on this many tokens: a whole chunk and a partial one
FD_EPS = 1e-6  # central differences of the float64 loss
FD_REL = 1e-6  # and the agreement asked of the analytic float64 gradient
MIN_MEMORY_RATIO = 8  # the per-token alternative must need at least this many times more
GRADS = ("dq", "dk", "dv", "dalpha", "dbeta")
TOKEN = dict(zip((*GRADS, "ds"), K.token_bounds_q10(D, D), strict=True))
PER_CHUNK = dict(zip(("dq", "dv", "ds"), K.chunk_bounds_q10(D, D, CHUNK), strict=True))


def _inputs(t_len: int) -> dict[str, np.ndarray]:
    """One sequence in the kernels' formats: unit k, unit q times d^-1/2, v ~ N(0, 1/4), K3's
    decay alpha = exp(-5 sigma(N(0, 2^2))), beta = sigma(N(0, 1)), do of 2-norm 4, S_0 = 0 and
    no gradient arriving at the last state (a whole sequence)."""
    rng = np.random.default_rng(20261204)
    shape = (t_len, N_H, D)

    def unit(a: np.ndarray) -> np.ndarray:
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    def q(a: np.ndarray, frac: int) -> np.ndarray:
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    g = -5.0 * host.sigmoid(2.0 * rng.standard_normal(shape))
    zero = np.zeros((N_H, D, D), dtype=np.int32)
    return {
        "qs": q(unit(rng.standard_normal(shape)) * host.inv_sqrt(D), K.QK_FRAC),
        "k": q(unit(rng.standard_normal(shape)) * (1 - 2.0**-23), K.QK_FRAC),
        "v": q(0.5 * rng.standard_normal(shape), K.V_FRAC),
        "alpha": q(host.exp(g), K.A_FRAC),
        "beta": q(host.sigmoid(rng.standard_normal(shape[:2])), K.A_FRAC),
        "s0": zero,
        "do": q(K.DOMAIN_DO_L2 * (1 - 2.0**-16) * unit(rng.standard_normal(shape)), K.V_FRAC),
        "ds_t": zero,
    }


def _reals(p: dict[str, np.ndarray], lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """Tokens lo..hi-1 as reals: (q, k, v, alpha, beta, do), each [n, H, ...]."""
    return (
        p["qs"][lo:hi] / 2.0**K.QK_FRAC,
        p["k"][lo:hi] / 2.0**K.QK_FRAC,
        p["v"][lo:hi] / 2.0**K.V_FRAC,
        p["alpha"][lo:hi] / 2.0**K.A_FRAC,
        p["beta"][lo:hi] / 2.0**K.A_FRAC,
        p["do"][lo:hi] / 2.0**K.V_FRAC,
    )


def _args(p: dict[str, np.ndarray], lo: int, hi: int, s0=None, ds_t=None) -> tuple:
    """The kernel's array arguments for tokens lo..hi-1 (without the chunk)."""
    cut = [np.ascontiguousarray(p[key][lo:hi]) for key in ("qs", "k", "v", "alpha", "beta")]
    s0 = p["s0"] if s0 is None else s0
    ds_t = p["ds_t"] if ds_t is None else ds_t
    return (*cut, s0, np.ascontiguousarray(p["do"][lo:hi]), ds_t)


def _grads(res: tuple) -> tuple:
    """dq, dk, dv, dalpha, dbeta and dL/dS_0 of a kda_backward result."""
    return res[2], res[3], res[4], res[5], res[6], res[8][0]


def _per_token(
    p: dict[str, np.ndarray], s_kept: np.ndarray, g_kept: np.ndarray, s_end: np.ndarray
) -> tuple[dict, dict]:
    """float64 restarted at every token from the C = 1 run's own S_{t-1} and the G arriving at
    S_t: each gradient in LSB [T, H, ...] (dS as dL/dS_{t-1}, [T, H, d, d]), and the largest
    norms of the domain the token bounds are stated for (the states: every kept S_{t-1} and the
    last state s_end)."""
    t_len = s_kept.shape[0]
    s_last = np.abs(s_end / 2.0**K.V_FRAC).sum(-1).max()
    out = {name: [] for name in (*GRADS, "ds")}
    norms = {"S row L1": float(s_last), "e L1": 0.0, "G row L1": 0.0, "G^T k L1": 0.0}
    norms["do L2"] = 0.0
    for lo in range(0, t_len, BLOCK):
        hi = min(lo + BLOCK, t_len)
        n = (hi - lo) * N_H
        q, k, v, alpha, beta, do = (x.reshape(1, n, *x.shape[2:]) for x in _reals(p, lo, hi))
        s_prev = s_kept[lo:hi].reshape(n, D, D) / 2.0**K.V_FRAC
        nxt = np.concatenate([g_kept[lo + 1 : hi + 1], p["ds_t"][None]])[: hi - lo]
        g_in = nxt.reshape(n, D, D) / 2.0**K.V_FRAC
        dq, dk, dv, dalpha, dbeta, ds = ref.backward(q, k, v, alpha, beta, s_prev, do, g_in)
        for name, x in zip(GRADS, (dq, dk, dv, dalpha, dbeta), strict=True):
            out[name].append(x.reshape(hi - lo, N_H, *x.shape[2:]) * 2.0**K.V_FRAC)
        out["ds"].append(ds.reshape(hi - lo, N_H, D, D) * 2.0**K.V_FRAC)
        P = alpha[0][:, :, None] * s_prev
        e = v[0] - np.einsum("bij,bi->bj", P, k[0])
        G = g_in + q[0][:, :, None] * do[0][:, None, :]
        for key, val in (
            ("S row L1", np.abs(s_prev).sum(-1).max()),
            ("e L1", np.abs(e).sum(-1).max()),
            ("G row L1", np.abs(G).sum(-1).max()),
            ("G^T k L1", np.abs(np.einsum("bij,bi->bj", G, k[0])).sum(-1).max()),
            ("do L2", np.sqrt(np.sum(do * do, axis=-1)).max()),
        ):
            norms[key] = max(norms[key], float(val))
    return {name: np.concatenate(parts) for name, parts in out.items()}, norms


def _per_chunk(p: dict[str, np.ndarray], s_kept: np.ndarray, g_kept: np.ndarray) -> dict:
    """float64 restarted at every chunk from the C = 64 run's state at the chunk's start and the
    G arriving at its end: dq, dv [T, H, d] and dS at each chunk's start [n, H, d, d], in LSB."""
    t_len = p["v"].shape[0]
    n_c = t_len // CHUNK
    out = {"dq": [], "dv": [], "ds": []}
    g_end = np.concatenate([g_kept[1:], p["ds_t"][None]])
    for c0 in range(0, n_c, CHUNK_BLOCK):
        c1 = min(c0 + CHUNK_BLOCK, n_c)
        n = (c1 - c0) * N_H

        def fold(x: np.ndarray, c0=c0, c1=c1, n=n) -> np.ndarray:  # -> [C, chunks x H, ...]
            x = x.reshape(c1 - c0, CHUNK, *x.shape[1:])
            return np.moveaxis(x, 1, 0).reshape(CHUNK, n, *x.shape[3:])

        q, k, v, alpha, beta, do = (fold(x) for x in _reals(p, c0 * CHUNK, c1 * CHUNK))
        s0 = s_kept[c0:c1].reshape(n, D, D) / 2.0**K.V_FRAC
        ge = g_end[c0:c1].reshape(n, D, D) / 2.0**K.V_FRAC
        dq, _, dv, _, _, ds = ref.backward(q, k, v, alpha, beta, s0, do, ge)
        for name, x in (("dq", dq), ("dv", dv)):
            x = np.moveaxis(x.reshape(CHUNK, c1 - c0, N_H, D), 0, 1)
            out[name].append(x.reshape((c1 - c0) * CHUNK, N_H, D) * 2.0**K.V_FRAC)
        out["ds"].append(ds.reshape(c1 - c0, N_H, D, D) * 2.0**K.V_FRAC)
    return {name: np.concatenate(parts) for name, parts in out.items()}


def _finite_differences() -> tuple[float, int]:
    """The float64 backward against central differences of its loss, at 4 coordinates of each
    input (q, k, v, alpha, beta, S_0) of a seeded 8-token, 2-sequence, d = 8 problem with a
    gradient arriving at the end: (max relative error, coordinates)."""
    rng = np.random.default_rng(11)
    t, b, d = 8, 2, 8

    def unit(a: np.ndarray) -> np.ndarray:
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    x = {
        "q": unit(rng.standard_normal((t, b, d))) * host.inv_sqrt(d),
        "k": unit(rng.standard_normal((t, b, d))),
        "v": rng.standard_normal((t, b, d)),
        "alpha": host.exp(-5.0 * host.sigmoid(2.0 * rng.standard_normal((t, b, d)))),
        "beta": host.sigmoid(rng.standard_normal((t, b))),
        "s0": rng.standard_normal((b, d, d)),
        "do": rng.standard_normal((t, b, d)),
        "g_end": rng.standard_normal((b, d, d)),
    }
    grads = dict(zip(("q", "k", "v", "alpha", "beta", "s0"), ref.backward(**x), strict=True))
    return gradcheck.worst_relative_error(ref.loss, x, grads, rng, eps=FD_EPS)


@gate(
    "longctx_kda_backward",
    innovation="longctx",
    level="STRONG",
    kernels=["k3gates.kda.kernels_grad", "k3gates.kda.kernels"],
    bounds={
        # restarted at every token: a few roundings through the domain's norms (kernels.py)
        **{f"{name}_per_token": b / 1024 for name, b in TOKEN.items()},
        # restarted at every 64-token chunk: per-token Frobenius growth, C of them (kernels.py)
        **{f"{name}_per_chunk": b / 1024 for name, b in PER_CHUNK.items()},
    },
    timeout=900,
    requires=["kda_recurrent"],
)
def longctx_kda_backward(ctx: GateContext) -> None:
    """KDA's backward over 65,536 tokens in integers, keeping one state per 64-token chunk and
    recomputing each chunk's states: the gradients are the same bits as keeping every state,
    within their declared bounds of float64 restarted at every token and at every chunk, and the
    peak memory is measured against the per-token alternative."""
    kern = ctx.compiled("k3gates.kda.kernels_grad")
    p = _inputs(T_LONG)
    args = _args(p, 0, T_LONG)
    main = kern.kda_backward(*args, CHUNK)
    token = kern.kda_backward(*args, 1)
    whole = kern.kda_backward(*args, T_LONG)
    _check_forward(ctx, p, main)
    ctx.check_digests(
        "chunk_independent",
        "recomputing a chunk's states from the one kept at its start is exact: the gradients "
        "(dq, dk, dv, dalpha, dbeta, dL/dS_0) hash the same with C = 64, with C = 1 (every "
        "state kept twice) and with C = 65,536 (one chunk: every state recomputed and held)",
        {f"C = {c:,}": digest(*_grads(r)) for c, r in ((CHUNK, main), (1, token), (T_LONG, whole))},
    )
    peaks = {
        c: fresh.run_peak("k3gates.kda.kernels_grad", "kda_backward", (*args, c), threads=2)
        for c in (CHUNK, T_LONG)
    }
    for c, here in ((CHUNK, main), (T_LONG, whole)):
        ctx.check_digests(
            f"fresh_process_c{c}",
            f"the C = {c:,} run whose memory the OS measured, in a fresh process with 2 OpenMP "
            "threads, returns the same bits (kept states included) as in the gate's process",
            {"here": digest(*here), "fresh process": peaks[c]["digest"]},
        )
    del whole
    _check_memory(ctx, main, peaks)
    tight, norms = _per_token(p, token[7], token[8], main[1])
    _check_domain(ctx, main, token, norms)
    errs = {}
    for name, got in zip((*GRADS, "ds"), (*_grads(main)[:5], token[8]), strict=True):
        ctx.check_reference(
            f"{name}_per_token",
            f"every {name} of the 65,536 tokens x 2 heads is within the declared bound of the "
            "float64 backward restarted at every token from the kernel's own S_{t-1} and the "
            "gradient arriving at S_t (the C = 1 run's kept states, whose gradients are the "
            "C = 64 run's bit for bit)",
            got,
            tight[name],
            unit="LSB (2^-20)",
            tokens=T_LONG,
        )
        errs[name] = float(np.abs(got - tight[name]).max())
    wide = _per_chunk(p, main[7], main[8])
    wide_errs = {}
    for name, got in (("dq", main[2]), ("dv", main[4]), ("ds", main[8])):
        ctx.check_reference(
            f"{name}_per_chunk",
            f"every {name} is within the rigorous worst case of float64 restarted at every "
            "64-token chunk from the kernel's kept state and the gradient arriving at the "
            "chunk's end: C tokens of roundings, none amplified",
            got,
            wide[name],
            unit="LSB (2^-20)",
            worst_case=True,
            tight=f"{name}_per_token",
        )
        wide_errs[name] = float(np.abs(got - wide[name]).max())
    _check_split(ctx, kern, p)
    ctx.check_threads(
        "threads",
        f"kda_backward over the first {SPLIT_T:,} tokens (heads in parallel) gives the same "
        "bits with 1 and with 2 OpenMP threads, each in a fresh process",
        "kda_backward",
        *_args(p, 0, SPLIT_T),
        CHUNK,
        modname="k3gates.kda.kernels_grad",
    )
    interp = (*_args(p, 0, INTERP_T, ds_t=np.ascontiguousarray(token[8][INTERP_T])), CHUNK)
    kern.kda_backward(*interp)  # warm-up (the OpenMP pool)
    ctx.check_compiled_matches_interpreted(
        "compiled",
        "kda_backward",
        *interp,
        inputs=f"the gate's first {INTERP_T} tokens (a whole chunk of 64 and a partial one of "
        "6), both heads at d = 32, with the gradient the whole sequence sends into S_69 arriving "
        "at the end; in the domain like every call, so no saturation branch is reached",
        modname="k3gates.kda.kernels_grad",
    )
    worst, n = _finite_differences()
    ctx.check(
        "reference_finite_differences",
        "the float64 backward is the derivative of its loss: at 24 coordinates of q, k, v, "
        "alpha, beta and S_0 it agrees with central differences (eps 1e-6) within 1e-6 "
        "relative",
        worst <= FD_REL,
        max_relative_error=worst,
        coordinates=n,
    )
    ctx.artifact(
        "table:gradient errors against float64 (LSB = 2^-20)",
        {
            "columns": ["gradient", "restarted every token", "bound", "every 64 tokens", "bound"],
            "rows": [
                [
                    name,
                    errs[name],
                    TOKEN[name] / 1024,
                    wide_errs.get(name),
                    PER_CHUNK[name] / 1024 if name in PER_CHUNK else None,
                ]
                for name in (*GRADS, "ds")
            ],
        },
    )
    chunked, per_token = _working(peaks[CHUNK]), _working(peaks[T_LONG])
    ctx.evidence(
        f"KDA's backward over {T_LONG:,} tokens keeps {T_LONG // CHUNK:,} chunk states: peak "
        f"working memory {chunked / 2**20:.1f} MiB against {per_token / 2**20:.1f} MiB with "
        f"every state kept ({per_token / chunked:.0f}x less), the same gradients bit for bit, "
        f"each within {max(errs[n] / (TOKEN[n] / 1024) for n in errs):.0%} of its bound of "
        "float64 restarted every token"
    )


def _working(rep: dict) -> int:
    """Peak memory growth of a fresh-process call minus the arrays that are its per-token
    results (o, s_end, dq, dk, dv, dalpha, dbeta): what the backward held to compute them,
    the kept states and its working buffers included."""
    return rep["peak_growth_bytes"] - sum(rep["output_bytes"][:7])


def _check_forward(ctx: GateContext, p: dict, main: tuple) -> None:
    kda = ctx.compiled("k3gates.kda.kernels")
    o, s_end, _ = kda.kda_recurrent(*(p[key] for key in ("qs", "k", "v", "alpha", "beta", "s0")))
    same = bool(np.array_equal(o, main[0]) and np.array_equal(s_end, main[1]))
    ctx.check(
        "forward_is_kda_recurrent",
        "the forward inside kda_backward is KDA's recurrent form of k3gates.kda.kernels bit for "
        f"bit: the same o_t at all {T_LONG:,} tokens and the same final state",
        same,
        digests={"kda_recurrent": digest(o, s_end), "kda_backward": digest(main[0], main[1])},
    )


def _check_memory(ctx: GateContext, main: tuple, peaks: dict) -> None:
    chunked, per_token = _working(peaks[CHUNK]), _working(peaks[T_LONG])
    kept = main[7].nbytes + main[8].nbytes
    ratio = per_token / max(chunked, 1)
    ctx.check(
        "memory",
        f"the peak working memory of the backward over {T_LONG:,} tokens, measured by the OS in "
        "fresh processes, is at least 8x smaller keeping one state per 64-token chunk than "
        "keeping every token's state (C = 65,536)",
        ratio >= MIN_MEMORY_RATIO and chunked > kept,
        peak_bytes_chunked=chunked,
        peak_bytes_per_token=per_token,
        ratio=ratio,
        kept_state_bytes=kept,
        minimum_ratio=MIN_MEMORY_RATIO,
    )
    state = N_H * D * D * 4  # one int32 state of all heads
    ctx.artifact(
        f"table:memory of the backward over {T_LONG:,} tokens",
        {
            "columns": ["", "one state per 64-token chunk", "every token's state"],
            "rows": [
                ["states held (from the arrays)", T_LONG // CHUNK * 2 + CHUNK + 1, T_LONG + 3],
                [
                    "their bytes",
                    (T_LONG // CHUNK * 2 + CHUNK + 1) * state,
                    (T_LONG + 3) * state,
                ],
                ["peak memory growth, measured (MiB)", chunked / 2**20, per_token / 2**20],
            ],
        },
    )


def _check_domain(ctx: GateContext, main: tuple, token: tuple, norms: dict) -> None:
    limits = {
        "S row L1": K.DOMAIN_S_ROW_L1,
        "e L1": K.DOMAIN_E_L1,
        "G row L1": K.DOMAIN_G_ROW_L1,
        "G^T k L1": K.DOMAIN_GK_L1,
        "do L2": K.DOMAIN_DO_L2,
    }
    inside = all(norms[key] <= limits[key] for key in limits)
    sat, out = int(main[9][0]) + int(token[9][0]), int(main[9][1]) + int(token[9][1])
    ctx.check(
        "domain",
        "no value saturated or left the kernel's overflow domain, and every norm the bounds are "
        "stated for (rows of S and G, e, G^T k, do), measured in float64 at every token, stays "
        "within its declared limit",
        inside and sat == 0 and out == 0,
        saturations=sat,
        outside_domain=out,
        **{f"max {key}": norms[key] for key in norms},
        **{f"limit {key}": limits[key] for key in limits},
    )


def _check_split(ctx: GateContext, kern, p: dict) -> None:
    """The first SPLIT_T tokens in one call, and in two: the second half first from the state
    the first half's forward reached, then the first half with the gradient the second sent
    back into that state. Both hash the same gradients."""
    half = SPLIT_T // 2
    whole = kern.kda_backward(*_args(p, 0, SPLIT_T), CHUNK)
    first_fwd = kern.kda_backward(*_args(p, 0, half), CHUNK)
    second = kern.kda_backward(*_args(p, half, SPLIT_T, s0=first_fwd[1]), CHUNK)
    first = kern.kda_backward(*_args(p, 0, half, ds_t=np.ascontiguousarray(second[8][0])), CHUNK)
    joined = tuple(np.concatenate([a, b]) for a, b in zip(first[2:7], second[2:7], strict=True))
    ctx.check_deterministic(
        "split",
        f"the backward over {SPLIT_T:,} tokens in one call equals two calls of {half:,} (the "
        "later half first, its gradient into the split state handed to the earlier half), "
        "gradient for gradient, dL/dS_0 included",
        {
            "one call": (*whole[2:7], whole[8][0]),
            "two calls": (*joined, first[8][0]),
        },
    )
