"""The 1M-context training form, MLA side (STRONG): Gated MLA's attention backward for query rows
at the end of a 2^14-row latent cache, against float64 and against the same rows of a whole
sequence's backward."""

from __future__ import annotations

import numpy as np

from k3gates.infra import gradcheck
from k3gates.infra.gate import GateContext, gate

from . import kernels as mla_k
from . import reference as ref

T_CACHE = 1 << 14  # latent cache rows the query rows attend over (the issue: at least 2^14)
ROWS = 8  # query rows: the last ROWS positions, each over every cache row up to itself
N_H, NOPE, ROPE, KV, DV = 2, 32, 16, 64, 32  # test widths (K3: 96 heads, nope 128, kv 512)
SQUARE_T = 64  # the whole sequence whose last rows rows_alone runs again on their own
INTERP_T, INTERP_R = 48, 4  # compiled == interpreted on this slice
FD_EPS = 1e-6
FD_REL = 1e-6
NAMES = ("dq_R", "dq_C", "dc_kv", "dk_r")
BOUNDS = dict(zip(NAMES, mla_k.backward_bounds_q10(T_CACHE, N_H, ROWS), strict=True))
KERNELS = "k3gates.mla.kernels"


def _inputs(t_len: int, rows: int, seed: int = 20261205) -> dict[str, np.ndarray]:
    """A latent cache as MLA writes it (c_KV rows of rms 1, k_R of unit scale; W_UK, W_UV ~
    N(0, 1/kv_lora)), `rows` queries of scale 2 (nope + rope)^-1/2 (the scale folded in) and
    do ~ N(0, 0.2^2), in the formats of k3gates.mla.kernels (Q.16, Q.20 for q, Q.24 for do)."""
    rng = np.random.default_rng(seed)

    def q(a: np.ndarray, frac: int) -> np.ndarray:
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    c = rng.standard_normal((t_len, KV))
    c /= np.sqrt(np.mean(c * c, axis=1, keepdims=True))
    return {
        "q": q(rng.standard_normal((rows, N_H, NOPE + ROPE)) * 2 / np.sqrt(NOPE + ROPE), 20),
        "c_kv": q(c, mla_k.C_FRAC),
        "k_r": q(rng.standard_normal((t_len, ROPE)), mla_k.C_FRAC),
        "w_uk": q(rng.standard_normal((N_H, NOPE, KV)) / np.sqrt(KV), mla_k.W_FRAC),
        "w_uv": q(rng.standard_normal((N_H, DV, KV)) / np.sqrt(KV), mla_k.W_FRAC),
        "do": q(0.2 * rng.standard_normal((rows, N_H, DV)), mla_k.G_FRAC),
    }


def backward(kern, x: dict[str, np.ndarray], t0: int) -> dict:
    """k3gates.mla.kernels' four backward kernels for the query rows t0 .. t0 + R - 1: P, dS,
    dq, dc_KV, dk_R and the saturations."""
    p, s1 = kern.mla_backward_probs(x["q"], t0, x["c_kv"], x["k_r"], x["w_uk"])
    ds, s2 = kern.mla_backward_scores(p, t0, x["c_kv"], x["w_uv"], x["do"])
    dq, s3 = kern.mla_backward_dq(ds, t0, x["c_kv"], x["k_r"], x["w_uk"])
    dc, dkr, s4 = kern.mla_backward_dkv(ds, p, t0, x["q"], x["do"], x["w_uk"], x["w_uv"])
    return {"p": p, "ds": ds, "dq": dq, "dc": dc, "dk_r": dkr, "sat": s1 + s2 + s3 + s4}


def _reals(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    fracs = {"q": mla_k.Q_FRAC, "c_kv": mla_k.C_FRAC, "k_r": mla_k.C_FRAC,
             "w_uk": mla_k.W_FRAC, "w_uv": mla_k.W_FRAC, "do": mla_k.G_FRAC}  # fmt: skip
    return {key: x[key] / 2.0 ** fracs[key] for key in fracs}


def _finite_differences() -> tuple[float, int]:
    """The float64 rows backward against central differences of its loss at 4 coordinates of
    each of q, c_KV, k_R, on a seeded 12-row cache with 3 query rows: (max relative error, n)."""
    x = _reals(_inputs(12, 3, seed=5))
    t0 = 9
    grads = dict(zip(("q", "c_kv", "k_r"), ref.rows_backward(t0=t0, **x), strict=True))

    def loss(**arrays: np.ndarray) -> float:
        return ref.rows_loss(t0=t0, **arrays)

    return gradcheck.worst_relative_error(loss, x, grads, np.random.default_rng(6), eps=FD_EPS)


@gate(
    "longctx_mla_backward",
    innovation="longctx",
    level="STRONG",
    kernels=[KERNELS],
    bounds={name: b / 1024 for name, b in BOUNDS.items()},
    timeout=900,
    requires=["mla_backward"],
)
def longctx_mla_backward(ctx: GateContext) -> None:
    """Gated MLA's attention backward for 8 query rows over a 16,384-row latent cache in
    integers, holding P and dS for those rows only: dq, dc_KV and dk_R within their derived
    bounds of float64, and each row's results those of the gatedmla STRONG gate's backward."""
    kern = ctx.compiled(KERNELS)
    x = _inputs(T_CACHE, ROWS)
    t0 = T_CACHE - ROWS
    b = backward(kern, x, t0)
    dq, dc, dkr = ref.rows_backward(t0=t0, **_reals(x))
    errs = {}
    for name, got, want, what in (
        ("dq_C", b["dq"][..., :NOPE], dq[..., :NOPE], "dq_C = W_UK sum_s dS_ts c_s"),
        ("dq_R", b["dq"][..., NOPE:], dq[..., NOPE:], "dq_R = sum_s dS_ts k_R,s"),
        ("dc_kv", b["dc"], dc, "dc_KV of every cache row (through W_UK and W_UV, over heads)"),
        ("dk_r", b["dk_r"], dkr, "dk_R of every cache row (summed over heads)"),
    ):
        ctx.check_reference(
            name,
            f"{what}, in Q.24, for {ROWS} query rows over a {T_CACHE:,}-row latent cache, within "
            "the bound derived for rows of 2^14 keys (k3gates.mla.kernels' derivation, the key "
            f"columns summed over {ROWS} rows) of the float64 backward on the same integer inputs",
            np.asarray(got, dtype=np.float64),
            want * 2.0**mla_k.G_FRAC,
            unit="LSB (2^-24)",
            cache_rows=T_CACHE,
            query_rows=ROWS,
        )
        errs[name] = float(np.abs(got - want * 2.0**mla_k.G_FRAC).max())
    _check_domain(ctx, x, b)
    _check_rows_alone(ctx, kern)
    _check_split(ctx, kern, x, t0, b)
    for func, args in (
        ("mla_backward_scores", (b["p"], t0, x["c_kv"], x["w_uv"], x["do"])),
        ("mla_backward_dkv", (b["ds"], b["p"], t0, x["q"], x["do"], x["w_uk"], x["w_uv"])),
    ):
        ctx.check_threads(
            f"threads_{func}",
            f"{func} over the {T_CACHE:,}-row cache gives the same bits with 1 and with 2 "
            "OpenMP threads, each in a fresh process",
            func,
            *args,
            modname=KERNELS,
        )
    _check_compiled(ctx, kern)
    worst, n = _finite_differences()
    ctx.check(
        "reference_finite_differences",
        "the float64 rows backward is the derivative of its loss: at 12 coordinates of q, c_KV "
        "and k_R it agrees with central differences (eps 1e-6) within 1e-6 relative",
        worst <= FD_REL,
        max_relative_error=worst,
        coordinates=n,
    )
    rows_bytes = 2 * N_H * ROWS * T_CACHE * 8
    square_bytes = 2 * N_H * T_CACHE * T_CACHE * 8
    ctx.artifact(
        f"table:P and dS for {ROWS} query rows over {T_CACHE:,} cache rows (int64, from shapes)",
        {
            "columns": ["", "these rows", "the square backward at this length"],
            "rows": [
                ["entries of P and dS", 2 * N_H * ROWS * T_CACHE, 2 * N_H * T_CACHE**2],
                ["MiB", rows_bytes / 2**20, square_bytes / 2**20],
            ],
        },
    )
    ctx.evidence(
        f"the MLA attention backward for {ROWS} query rows over a {T_CACHE:,}-row latent cache: "
        f"dq, dc_KV and dk_R within {max(errs.values()):.3f} LSB of Q.24 of float64 (bounds "
        f"{min(BOUNDS.values()) / 1024:.3f} to {max(BOUNDS.values()) / 1024:.3f}); P and dS "
        f"{rows_bytes / 2**20:.0f} MiB where the square backward would need "
        f"{square_bytes / 2**30:.0f} GiB"
    )


def _check_domain(ctx: GateContext, x: dict, b: dict) -> None:
    """The magnitudes backward_bounds_q10 assumes (mla_k.BWD_*_BITS), measured here."""
    r = _reals(x)
    v = np.einsum("hij,sj->hsi", r["w_uv"], r["c_kv"])
    got = {
        "max_abs_dP": float(np.abs(np.einsum("rhi,hsi->hrs", r["do"], v)).max()),
        "max_abs_do": float(np.abs(r["do"]).max()),
        "max_abs_c_kv": float(np.abs(r["c_kv"]).max()),
        "max_abs_k_r": float(np.abs(r["k_r"]).max()),
        "max_abs_k_c": float(np.abs(np.einsum("hij,sj->hsi", r["w_uk"], r["c_kv"])).max()),
        "max_abs_q": float(np.abs(r["q"]).max()),
        "max_l1_w_uk_w_uv": max(
            float(np.abs(r[n]).sum(axis=a).max()) for n in ("w_uk", "w_uv") for a in (1, 2)
        ),
    }
    limits = {"max_abs_dP": mla_k.BWD_DP_BITS, "max_abs_do": mla_k.BWD_DO_BITS,
              "max_abs_c_kv": mla_k.BWD_C_BITS, "max_abs_k_r": mla_k.BWD_KR_BITS,
              "max_abs_k_c": mla_k.BWD_KR_BITS, "max_abs_q": mla_k.BWD_Q_BITS,
              "max_l1_w_uk_w_uv": mla_k.BWD_L1_BITS}  # fmt: skip
    ctx.check(
        "in_domain",
        "no backward intermediate saturated, and the magnitudes the backward bounds assume hold "
        "over the whole cache: |dP| <= 8, |do| <= 4, |c_KV|, |k_R|, |k_C| <= 8, |q| <= 2, row "
        "and column L1 of W_UK, W_UV <= 32",
        b["sat"] == 0 and all(got[n] <= 2 ** limits[n] for n in got),
        saturations=int(b["sat"]),
        **got,
    )


def _check_rows_alone(ctx: GateContext, kern) -> None:
    """The last rows of a whole sequence's backward (t0 = 0, every row a query) and the same rows
    run alone (t0 = 40): each row's P, dS and dq come from that row alone."""
    x = _inputs(SQUARE_T, SQUARE_T, seed=20261206)
    whole = backward(kern, x, 0)
    lo = SQUARE_T - 24
    alone = backward(kern, {**x, "q": np.ascontiguousarray(x["q"][lo:]),
                            "do": np.ascontiguousarray(x["do"][lo:])}, lo)  # fmt: skip
    ctx.check_deterministic(
        "rows_alone",
        f"the last 24 query rows of a whole {SQUARE_T}-token sequence's backward (the gatedmla "
        "STRONG gate's square form, t0 = 0) and the same rows run alone (t0 = 40) give the same "
        "P, dS and dq: what a query row gets does not depend on which other rows ran",
        {
            "rows of the whole sequence": (
                whole["p"][:, lo:],
                whole["ds"][:, lo:],
                whole["dq"][lo:],
            ),
            "rows alone": (alone["p"], alone["ds"], alone["dq"]),
        },
    )


def _check_split(ctx: GateContext, kern, x: dict, t0: int, whole: dict) -> None:
    """The 8 query rows in one call and in two calls of 4: each row's P, dS and dq alone."""
    half = ROWS // 2
    parts = []
    for lo in (0, half):
        sub = {**x, "q": np.ascontiguousarray(x["q"][lo : lo + half]),
               "do": np.ascontiguousarray(x["do"][lo : lo + half])}  # fmt: skip
        parts.append(backward(kern, sub, t0 + lo))
    joined = (
        np.concatenate([parts[0]["p"], parts[1]["p"]], axis=1),
        np.concatenate([parts[0]["ds"], parts[1]["ds"]], axis=1),
        np.concatenate([parts[0]["dq"], parts[1]["dq"]], axis=0),
    )
    ctx.check_deterministic(
        "split",
        f"the {ROWS} query rows in one call and in two calls of {half} give each row the same "
        "P, dS and dq",
        {"one call": (whole["p"], whole["ds"], whole["dq"]), "two calls": joined},
    )


def _check_compiled(ctx: GateContext, kern) -> None:
    x = _inputs(INTERP_T, INTERP_R, seed=20261207)
    x["q"][0, 0, 0] = -x["q"][0, 0, 0] - 1  # both signs on the first query's first weight
    t0 = INTERP_T - INTERP_R
    b = backward(kern, x, t0)
    for func, args in (
        ("mla_backward_probs", (x["q"], t0, x["c_kv"], x["k_r"], x["w_uk"])),
        ("mla_backward_scores", (b["p"], t0, x["c_kv"], x["w_uv"], x["do"])),
        ("mla_backward_dq", (b["ds"], t0, x["c_kv"], x["k_r"], x["w_uk"])),
        ("mla_backward_dkv", (b["ds"], b["p"], t0, x["q"], x["do"], x["w_uk"], x["w_uv"])),
    ):
        ctx.check_compiled_matches_interpreted(
            f"compiled_{func}",
            func,
            *args,
            inputs=f"{INTERP_R} query rows over a {INTERP_T}-row cache drawn like the gate's "
            "own, both signs everywhere; in the domain, so the saturation branches are not "
            "reached",
            modname=KERNELS,
        )
