"""Native multimodal, the backward pass (STRONG): the gradients of one MoonViT3d block at K3's
width, of the temporal-pool patch merger and of the projector into 7168, in integers, per
public ports (K3-SPEC.md section 9). Every stage is held against float64 on the integers it
received (k3gates/vision/reference_grad.py, written from the math), and the whole chain against
central finite differences of the float64 forward. Bounds come from k3gates/vision/kernels_grad.py,
K3-μ's kernels_glue and longctx's kernels, declared before any run."""

from __future__ import annotations

from functools import partial
from itertools import pairwise

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.infra.gate import GateContext, gate

from ..k3mu import kernels_glue as KG
from ..longctx import kernels as LK
from . import backward as BW
from . import block as B
from . import kernels as VK
from . import kernels_grad as KV
from . import reference as ref
from . import reference_grad as rg

SEED = 20261206
HALF_LSB = 513 / 1024  # one rounding (1/2 LSB) with float64's own error as margin
Q24 = "LSB (2^-24)"
# Inputs: two packed images (the second an odd grid) and a 4-frame clip, at K3's width
PAIR = ((16, 16), (11, 7))  # patch grids: 224×224 and 154×98 pixels
CLIP = (8, 8, 4)  # a 4-frame 112×112 clip: one chunk
MERGED_PAIR = 8 * 8 + 6 * 4  # merged tokens of the pair (the odd grid padded)
MERGED_CLIP = 4 * 4
TOKENS = {"pair": 16 * 16 + 11 * 7, "clip": 8 * 8 * 4}
MERGED = {"pair": MERGED_PAIR, "clip": MERGED_CLIP}
# The integer forward carries 1/2 LSB per stage (relative 2^-16 at unit scale) through 14 stages
# and the softmax; the backward adds 2^-24 per stage: declared with room, 2^-10 relative.
FD_REL = 2.0**-10
FD_STEP = 1e-5  # the central difference's step, relative to the tensor's norm
TENSORS = ("x", "g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2", "p1", "p2", "gp")
ROPE_BACK_BOUND = LK.rope_bound_q10(B.ROPE_X_MAX, LK.ONE_MSCALE, VK.MAX_SIDE - 1) / 1024


def _bounds() -> dict[str, float]:
    """Per run: 1/2 LSB for one rounding; K3-μ's RMSNorm bounds (dx 1/2 + 2^-9, dg 1/2 + N
    2^-14 for N rows); GELU's 1/2 + 2^-9; dh1 sums three rounded products; RoPE turned back
    within rope_rotate's bound at its whole domain."""
    b: dict[str, float] = {"fd_directional": FD_REL}
    for run in ("pair", "clip"):
        n, m = TOKENS[run], MERGED[run]
        b |= {
            f"{run}_{s}": HALF_LSB
            for s in (
                "proj_down_dx",
                "proj_down_dw",
                "proj_up_dx",
                "proj_up_dw",
                "merge_back",
                "mlp_down_dx",
                "mlp_down_dw",
                "mlp_up_dx",
                "mlp_up_dw",
                "out_proj_dx",
                "out_proj_dw",
                "attn_dp",
                "attn_d",
                "attn_ds",
                "attn_dq",
                "attn_dk",
                "attn_dv",
                "qkv_dw",
            )
        }
        b |= {
            f"{run}_proj_gelu": KV.GELU_BACK_ERR_Q10 / 1024,
            f"{run}_gelu": KV.GELU_BACK_ERR_Q10 / 1024,
            f"{run}_proj_norm_dx": KG.RMSNORM_DX_ERR_Q10 / 1024,
            f"{run}_proj_norm_dg": KG.rmsnorm_dw_err_q10(m) / 1024,
            f"{run}_norm2_dx": KG.RMSNORM_DX_ERR_Q10 / 1024,
            f"{run}_norm2_dg": KG.rmsnorm_dw_err_q10(n) / 1024,
            f"{run}_norm1_dx": KG.RMSNORM_DX_ERR_Q10 / 1024,
            f"{run}_norm1_dg": KG.rmsnorm_dw_err_q10(n) / 1024,
            f"{run}_qkv_dx": 3 * HALF_LSB,
            f"{run}_rope_back": ROPE_BACK_BOUND,
        }
    return b


@gate(
    "vision_backward",
    innovation="multimodal",
    level="STRONG",
    kernels=[
        "k3gates.vision.kernels_grad",
        "k3gates.vision.kernels",
        "k3gates.vision.kernels_block",
        "k3gates.fx.kernels",
        "k3gates.gemm.kernels",
        "k3gates.k3mu.kernels_glue",
    ],
    bounds=_bounds(),
    timeout=300,
    requires=["vision_block"],
)
def vision_backward(ctx: GateContext) -> None:
    """The gradients of one MoonViT3d block at K3's width, the temporal-pool patch merger and the
    projector into 7168, in integers, on two packed images and on a 4-frame clip: every stage
    within its declared bound of float64 on the integers it received, and the whole chain along
    its own gradient within 2^-10 of central finite differences of the float64 forward.

    Every figure of the tower is per public ports (K3-SPEC.md section 9)."""
    k = BW.GradKernels(ctx.compiled)
    rng = np.random.default_rng([SEED, 1])
    w = B.init_block(rng)
    pw = B.init_projector(rng)
    directional = []
    for run, grids, frames in (("pair", PAIR, 1), ("clip", (CLIP[:2],), CLIP[2])):
        chain = _chain(k, rng, w, pw, grids, frames)
        what = (
            f"two packed images ({' and '.join(f'{a}×{b}' for a, b in grids)} patches)"
            if run == "pair"
            else f"a {frames}-frame clip of {CLIP[0]}×{CLIP[1]} patches"
        )
        _projector_stages(ctx, run, chain, pw, what)
        _block_stages(ctx, k, run, chain, w, what)
        _in_domain(ctx, run, chain, w, pw, what)
        directional += _finite_differences(chain, w, pw)
    _fd_check(ctx, directional)
    _compiled(ctx, rng)
    worst = max(c.measured for c in ctx.checks if c.kind == "reference" and c.unit == Q24)
    fd = max(abs(r - 1) for _, _, r in directional)
    ctx.evidence(
        f"gradients of one block at width 1024 ({TOKENS['pair']} packed tokens and a "
        f"{TOKENS['clip']}-token clip), the merger and the projector into 7168: every stage "
        f"within {worst:.4f} LSB (Q.24) of float64 on its own inputs; along each of "
        f"{len(directional)} gradients within {fd:.1e} of central finite differences"
    )
    ctx.artifact(
        "table:the whole chain against finite differences, along its own gradient",
        {
            "columns": ["run", "tensor", "integer / finite difference"],
            "rows": [[run, name, f"{r:.8f}"] for run, name, r in directional],
        },
    )


def _real(a: np.ndarray, frac: int) -> np.ndarray:
    return np.asarray(a, dtype=np.float64) * 2.0**-frac


def _chain(k, rng, w: dict, pw: dict, grids, frames: int) -> dict:
    """Forward (block, merger, projector) and backward in integers, for seeded random block
    inputs (Q.16, std 1) and a seeded random gradient of the projector's output (Q.24, std 1)."""
    sizes = [gh * gw * frames for gh, gw in grids]
    x = np.round(rng.normal(0, 1, (sum(sizes), B.WIDTH)) * 2**16).astype(np.int64)
    pos = [
        np.concatenate(p)
        for p in zip(*(B.grid_positions(gh, gw, frames) for gh, gw in grids), strict=True)
    ]
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    s = B.forward(k, x, pos, cu, w)
    parts = [s["x2"][a:b] for a, b in pairwise(cu)]
    merged = np.vstack(
        [
            k.block.merge(p, frames, VK.CHUNK, gh, gw)
            for p, (gh, gw) in zip(parts, grids, strict=True)
        ]
    )
    sp = B.project(k, merged, pw)
    dout = np.round(rng.normal(0, 1, sp["out"].shape) * 2**24).astype(np.int64)
    dp, dwp = BW.project_backward(k, sp, pw, dout)
    dx2, m0 = [], 0
    for gh, gw in grids:
        m = ((gh + 1) // 2) * ((gw + 1) // 2) * ((frames + VK.CHUNK - 1) // VK.CHUNK)
        dx2.append(k.grad.merge_backward(dp["merged"][m0 : m0 + m], frames, VK.CHUNK, gh, gw))
        m0 += m
    d, dw = BW.backward(k, s, w, np.vstack(dx2), pos, cu)
    return {
        "x": x,
        "pos": pos,
        "cu": cu,
        "grids": grids,
        "frames": frames,
        "s": s,
        "sp": sp,
        "dout": dout,
        "dp": dp,
        "d": d,
        "dw": dw | dwp,
    }


def _hold(
    ctx: GateContext, run: str, what: str, name: str, got, want, about: str, frac: int = 24
) -> None:
    ctx.check_reference(
        f"{run}_{name}",
        f"{about}, on {what}, is within the declared bound of float64 on the integers it received",
        got,
        want * 2.0**frac,
        unit=f"LSB (2^-{frac})",
    )


def _projector_stages(ctx: GateContext, run: str, c: dict, pw: dict, what: str) -> None:
    """RMSNorm, the two matrices, GELU and the merger, backward, each on its own integers."""
    sp, dp, dw = c["sp"], c["dp"], c["dw"]
    a, g, wf = B.ACT_FRAC, BW.G_FRAC, B.W_FRAC
    dx, dg = rg.rmsnorm_backward(
        _real(c["dout"], g), _real(sp["p2"], a), _real(pw["gp"], wf), B.EPS
    )
    hold = partial(_hold, ctx, run, what)
    hold("proj_norm_dx", dp["p2"], dx, "the projector's RMSNorm (7168) backward, dx")
    hold("proj_norm_dg", dw["gp"], dg, "the projector's RMSNorm backward, its gain's gradient")
    hold(
        "proj_down_dx",
        dp["p1_gelu"],
        _real(dp["p2"], g) @ _real(pw["p2"], wf),
        "the projector's second matrix (4096 → 7168) backward, dx",
    )
    hold(
        "proj_down_dw",
        dw["p2"],
        _real(dp["p2"], g).T @ _real(sp["p1_gelu"], a),
        "the projector's second matrix backward, dW",
    )
    hold(
        "proj_gelu",
        dp["p1"],
        _real(dp["p1_gelu"], g) * rg.gelu_grad(_real(sp["p1"], a)),
        "the projector's GELU backward",
    )
    hold(
        "proj_up_dx",
        dp["merged"],
        _real(dp["p1"], g) @ _real(pw["p1"], wf),
        "the projector's first matrix (4096 → 4096) backward, dx",
    )
    hold(
        "proj_up_dw",
        dw["p1"],
        _real(dp["p1"], g).T @ _real(sp["merged"], a),
        "the projector's first matrix backward, dW",
    )
    want, m0 = [], 0
    for gh, gw in c["grids"]:
        m = ((gh + 1) // 2) * ((gw + 1) // 2) * ((c["frames"] + VK.CHUNK - 1) // VK.CHUNK)
        want.append(
            rg.merge_backward(
                _real(dp["merged"][m0 : m0 + m], g), c["frames"], VK.CHUNK, gh, gw, B.WIDTH
            )
        )
        m0 += m
    hold(
        "merge_back",
        c["d"]["x2"],
        np.vstack(want),
        "the patch merger backward (each frame of a chunk gets the mean's gradient / frames; "
        "padding dropped)",
    )


def _block_stages(ctx: GateContext, k, run: str, c: dict, w: dict, what: str) -> None:
    """Every stage of the block's backward, each on its own integers."""
    s, d, dw = c["s"], c["d"], c["dw"]
    a, g, wf = B.ACT_FRAC, BW.G_FRAC, B.W_FRAC
    hold = partial(_hold, ctx, run, what)

    def linear(stage: str, dy: np.ndarray, x: np.ndarray, name: str, about: str) -> None:
        hold(
            f"{stage}_dx",
            d[stage_input[stage]],
            _real(dy, g) @ _real(w[name], wf),
            f"{about} backward, dx",
        )
        hold(f"{stage}_dw", dw[name], _real(dy, g).T @ _real(x, a), f"{about} backward, dW")

    stage_input = {"mlp_down": "a", "mlp_up": "h2", "out_proj": "o"}
    linear("mlp_down", d["x2"], s["a"], "w2", "the MLP's second matrix (4096 → 1024)")
    hold("gelu", d["u"], _real(d["a"], g) * rg.gelu_grad(_real(s["u"], a)), "tanh-GELU backward")
    linear("mlp_up", d["u"], s["h2"], "w1", "the MLP's first matrix (1024 → 4096)")
    for norm, x_name, dy_name, dx_name, gain in (
        ("norm2", "x1", "h2", "x1_norm", "g2"),
        ("norm1", "x", "h1", "x_norm", "g1"),
    ):
        dx, dg = rg.rmsnorm_backward(
            _real(d[dy_name], g), _real(s[x_name], a), _real(w[gain], wf), B.EPS
        )
        hold(f"{norm}_dx", d[dx_name], dx, f"RMSNorm ({gain}) backward, dx")
        hold(f"{norm}_dg", dw[gain], dg, f"RMSNorm ({gain}) backward, its gain's gradient")
    linear("out_proj", d["x1"], s["o"], "wo", "the output projection (1536 → 1024)")
    _attention(ctx, k, run, c, what)
    rows = np.vstack([d["q_rope"], d["k_rope"]]).reshape(-1, B.HEAD_DIM)
    px, py = (np.tile(np.repeat(p, B.HEADS), 2) for p in c["pos"])
    hold(
        "rope_back",
        np.vstack([d["q"], d["k"]]).reshape(-1, B.HEAD_DIM),
        rg.rope2d_backward(_real(rows, g), px, py),
        "2D RoPE backward (each head's gradient turned back) on q and k",
    )
    hold(
        "qkv_dx",
        d["h1"],
        sum(_real(d[n], g) @ _real(w[f"w{n}"], wf) for n in "qkv"),
        "the q, k and v projections backward, dh1 (three products, each rounded once)",
    )
    hold(
        "qkv_dw",
        np.vstack([dw[f"w{n}"] for n in "qkv"]),
        np.vstack([_real(d[n], g).T @ _real(s["h1"], a) for n in "qkv"]),
        "the q, k and v projections backward, dW",
    )


def _attention(ctx: GateContext, k, run: str, c: dict, what: str) -> None:
    """Every (segment, head) of the attention backward, stage by stage, from the probe that runs
    the same helper; and the whole call equal to the probes, bit for bit."""
    s, d, cu = c["s"], c["d"], c["cu"]
    inputs = B.attention_inputs(s)
    dh, scale = B.HEAD_DIM, k.scale * 2.0**-62
    names = ("dp", "d", "ds", "dq", "dk", "dv")
    got: dict[str, list] = {n: [] for n in names}
    want: dict[str, list] = {n: [] for n in names}
    same = True
    for seg in range(len(cu) - 1):
        lo, hi = int(cu[seg]), int(cu[seg + 1])
        for head in range(B.HEADS):
            p, dp, dd, ds, dq, dk, dv = k.grad.attention_backward_head(
                *inputs, d["o"], cu, B.HEADS, k.scale, seg, head
            )
            cols = slice(head * dh, (head + 1) * dh)
            q_h, k_h = _real(s["q_rope"][lo:hi, cols], 20), _real(s["k_rope"][lo:hi, cols], 20)
            v_h, do_h = _real(s["v"][lo:hi, cols], 16), _real(d["o"][lo:hi, cols], 24)
            pf = _real(p, 31)
            full = rg.attention_backward_from_p(pf, q_h, k_h, v_h, do_h, scale)
            # each stage from the integers the kernel formed before it
            step = {
                "dp": full["dP"],
                "d": np.sum(pf * _real(dp, KV.DP_FRAC), axis=1),
                "ds": scale * pf * (_real(dp, KV.DP_FRAC) - _real(dd, KV.DP_FRAC)[:, None]),
                "dq": _real(ds, 24) @ k_h,
                "dk": _real(ds, 24).T @ q_h,
                "dv": full["dv"],
            }
            for name, v in zip(names, (dp, dd, ds, dq, dk, dv), strict=True):
                got[name].append(v.ravel())
                want[name].append(step[name].ravel())
            same = same and all(
                np.array_equal(a, b[lo:hi, cols])
                for a, b in ((dq, d["q_rope"]), (dk, d["k_rope"]), (dv, d["v"]))
            )
    for name, about in (
        ("dp", "dP = dO vᵀ"),
        ("d", "D = Σ_j P dP (per query)"),
        ("ds", "dS = P (dP − D) / √128, the gradient of q·k"),
        ("dq", "dq = dS k"),
        ("dk", "dk = dSᵀ q"),
        ("dv", "dv = Pᵀ dO"),
    ):
        _hold(
            ctx,
            run,
            what,
            f"attn_{name}",
            np.concatenate(got[name]),
            np.concatenate(want[name]),
            f"the attention backward's {about}, in all {B.HEADS} heads of every packed segment",
            KV.DP_FRAC if name in ("dp", "d") else 24,
        )
    ctx.check(
        f"{run}_attention_probes",
        f"on {what}, the whole attention backward gives every (segment, head) the same bits as "
        "the stage probe (one code path)",
        same,
    )


def _in_domain(ctx: GateContext, run: str, c: dict, w: dict, pw: dict, what: str) -> None:
    """The domains the bounds above are stated on, where a kernel does not stop outside them:
    GELU's |da| < 2^37 raw; RMSNorm's d max|dy w| < 2^18 (real) and rms(x) >= 2^-8."""
    d, dp, s, sp = c["d"], c["dp"], c["s"], c["sp"]
    worst_da = max(int(np.abs(d["a"]).max()), int(np.abs(dp["p1_gelu"]).max()))
    norms = (
        ("g1", d["h1"], s["x"], w["g1"]),
        ("g2", d["h2"], s["x1"], w["g2"]),
        ("gp", c["dout"], sp["p2"], pw["gp"]),
    )
    over = {}
    for gain, dy, x, g in norms:
        dyw = float(np.abs(_real(dy, BW.G_FRAC) * _real(g, B.W_FRAC)).max()) * x.shape[1]
        rms = float(np.sqrt(np.mean(_real(x, B.ACT_FRAC) ** 2, axis=1)).min())
        if dyw >= 2**18 or rms < 2**-8:
            over[gain] = (dyw, rms)
    ctx.check(
        f"{run}_in_domain",
        f"on {what}, GELU's backward sees |da| < 2^37 raw and every RMSNorm backward d max|dy g| "
        "< 2^18 with rms(x) >= 2^-8, the domains its bound is stated on",
        worst_da < KV.GELU_BACK_DA_MAX and not over,
        message=f"GELU |da| {worst_da}; RMSNorm outside: {over}",
        gelu_da_max=worst_da,
    )


def _loss(c: dict, wf: dict, pwf: dict, x: np.ndarray) -> float:
    """L = <dout, projector(merge(block(x)))> in float64."""
    fwd = rg.block_forward(x, *c["pos"], c["cu"], wf, B.HEADS)
    cu, frames = c["cu"], c["frames"]
    merged = np.vstack(
        [
            ref.merge(fwd["x2"][a:b], frames, VK.CHUNK, gh, gw)
            for (a, b), (gh, gw) in zip(pairwise(cu), c["grids"], strict=True)
        ]
    )
    out = rg.projector_forward(merged, pwf)["out"]
    return float(np.sum(_real(c["dout"], 24) * out))


def _finite_differences(c: dict, w: dict, pw: dict) -> list[tuple[str, str, float]]:
    """Per tensor T: the integer gradient's norm |g| against (L(T + h u) - L(T - h u)) / 2h,
    u = g / |g|, in float64 from the dequantised integer weights and inputs. Equal when the
    integer gradient is the float64 gradient; a zero, rolled or scaled gradient is not."""
    wf = {n: _real(v, B.W_FRAC) for n, v in w.items()}
    pwf = {n: _real(v, B.W_FRAC) for n, v in pw.items()}
    x = _real(c["x"], B.ACT_FRAC)
    run = "pair" if len(c["grids"]) == 2 else "clip"
    out = []
    for name in TENSORS:
        g = _real(c["d"]["x"] if name == "x" else c["dw"][name], BW.G_FRAC)
        norm = float(np.linalg.norm(g))
        if norm == 0.0:
            out.append((run, name, 0.0))
            continue
        base = x if name == "x" else (pwf if name in pw else wf)[name]
        h = FD_STEP * float(np.linalg.norm(base))
        vals = []
        for sign in (1.0, -1.0):
            moved = base + sign * h * g / norm
            if name == "x":
                vals.append(_loss(c, wf, pwf, moved))
            elif name in pw:
                vals.append(_loss(c, wf, pwf | {name: moved}, x))
            else:
                vals.append(_loss(c, wf | {name: moved}, pwf, x))
        out.append((run, name, norm / ((vals[0] - vals[1]) / (2 * h))))
    return out


def _fd_check(ctx: GateContext, directional: list) -> None:
    ctx.check_reference(
        "fd_directional",
        f"for each of {len(TENSORS)} tensors (the input, every block weight and gain, both "
        "projector matrices and its gain) on both runs, the integer gradient's norm |g| equals "
        "the float64 forward's central finite difference along g/|g| within 2^-10 (relative, "
        "declared)",
        np.array([r for _, _, r in directional]),
        np.ones(len(directional)),
        unit="integer / finite difference",
    )


def _compiled(ctx: GateContext, rng: np.random.Generator) -> None:
    mod = "k3gates.vision.kernels_grad"
    q, keys, v = (rng.integers(-(1 << 24), 1 << 24, (10, 16)).astype(np.int32) for _ in range(3))
    d_o = rng.integers(-(1 << 26), 1 << 26, (10, 16))
    cu = np.array([0, 6, 10], dtype=np.int64)
    scale = 1 << 60  # 1/4 in Q0.62
    check_compiled(
        ctx,
        "compiled_attention_backward",
        "attention_backward",
        q,
        keys,
        v,
        d_o,
        cu,
        2,
        scale,
        inputs="10 tokens in two packed segments (6 and 4), 2 heads of 8",
        modname=mod,
    )
    check_compiled(
        ctx,
        "compiled_attention_backward_head",
        "attention_backward_head",
        q,
        keys,
        v,
        d_o,
        cu,
        2,
        scale,
        1,
        1,
        inputs="the second segment, head 1",
        modname=mod,
    )
    edges = np.array(
        [
            0,
            1,
            -1,
            8 << 16,
            -(8 << 16),
            (8 << 16) + 1,
            -(8 << 16) - 1,
            3 << 15,
            -(3 << 15),
            1 << 40,
            -(1 << 40),
            12345,
            -98765,
        ],
        dtype=np.int64,
    )
    da = rng.integers(-(1 << 37) + 1, 1 << 37, edges.size)
    check_compiled(
        ctx,
        "compiled_gelu_backward",
        "gelu_backward",
        edges.reshape(1, -1),
        da.reshape(1, -1),
        inputs="0, ±1 LSB, ±1.5, both sides of the clamp at ±8, "
        "±2^24 and two arbitrary values, |da| up to 2^37",
        modname=mod,
    )
    dm = rng.integers(-(1 << 40), 1 << 40, (2 * 2 * 3, 8))
    check_compiled(
        ctx,
        "compiled_merge_backward",
        "merge_backward",
        dm,
        3,
        2,
        3,
        5,
        inputs="3 frames in chunks of 2 (the last chunk of 1) of an odd 3×5 grid, width 2",
        modname=mod,
    )
    big = [rng.integers(-(1 << 22), 1 << 22, (300, 64)).astype(np.int32) for _ in range(3)]
    ctx.check_threads(
        "threads_attention_backward",
        "the attention backward over 300 tokens in two segments gives the same bits with 1 and "
        "with 2 OpenMP threads",
        "attention_backward",
        *big,
        rng.integers(-(1 << 24), 1 << 24, (300, 64)),
        np.array([0, 170, 300], dtype=np.int64),
        4,
        1 << 60,
        modname=mod,
    )
