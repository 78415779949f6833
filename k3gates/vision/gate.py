"""Native multimodal, the input side (PARTIAL): MoonViT3d's patch embedding, its learned position
table resized to any patch grid, the frames' time embedding, 2D RoPE and the token-count rule, in
integers, at K3's width (1024) and head size (128), per public ports (K3-SPEC.md section 9).
Bounds come from k3gates/vision/kernels.py and k3gates/longctx/kernels.py, declared before any
run."""

from __future__ import annotations

import resource
import time

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.infra.gate import GateContext, gate

from ..longctx import kernels as LK
from . import block as B
from . import kernels as K
from . import reference as ref
from .tables import rope_turns, time_turns

SEED = 20261205
WIDTH = 1024  # the tower's width
HALF_LSB = 513 / 1024  # one rounding (1/2 LSB) with float64's own error as margin
Q16 = "LSB (2^-16)"
Q20 = "LSB (2^-20)"
GRIDS = ((16, 16), (23, 37), (97, 130), (512, 32))  # 448 px square, not square, past 64, extreme
IMAGES = ((448, 448), (224, 350))  # pixels: K3's usual square and one that is not
ROPE_GRID = (97, 130)  # every patch of a 1358 x 1820 image
ROPE_X_MAX = 4 << LK.X_FRAC  # rotated rows hold |x| < 4
ROPE_BOUND = LK.rope_bound_q10(ROPE_X_MAX, LK.ONE_MSCALE, K.MAX_SIDE - 1) / 1024
# pixels and frames where the rule changes: around one patch, one merged token, the side limit
SIDES = (0, 1, 13, 14, 15, 27, 28, 29, 55, 56, 57, 100, 224, 447, 448, 449, 895, 896, 1000, 1792,
         3584, 7167, 7168, 7169)  # fmt: skip
FRAMES = (0, 1, 2, 3, 4, 5, 7, 8, 9, 16)


def _image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A smooth colour gradient with noise, every value 0 .. 255 present: uint8 [h, w, 3]."""
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    base = np.stack([yy, xx, (yy + xx) / 2], axis=-1) * 200 + rng.normal(0, 30, (h, w, 3))
    return np.clip(np.round(base), 0, 255).astype(np.uint8)


def _tokens_by_simulation(h: int, w: int, frames: int) -> int:
    """The rule written out as the processor's steps on shapes: whole patches, the limits, a
    merge-group id for every patch of the grid, chunks of up to 4 frames; -1 when refused."""
    if min(h, w, frames) < 1:
        return -1
    gh, gw = len(range(0, h, K.PATCH)), len(range(0, w, K.PATCH))
    if gh > 512 or gw > 512 or gh * gw > 16384:
        return -1
    group = (np.arange(gh)[:, None] // 2) * 1024 + np.arange(gw)[None, :] // 2
    chunks = len(np.array_split(np.arange(frames), range(4, frames, 4)))
    return chunks * int(np.unique(group).size)


@gate(
    "vision_input",
    innovation="multimodal",
    level="PARTIAL",
    kernels=["k3gates.vision.kernels"],
    bounds={f"patch_embed_{h}x{w}": HALF_LSB for h, w in IMAGES}
    | {f"pos_resize_{h}x{w}": HALF_LSB for h, w in GRIDS}
    | {"time_embed": HALF_LSB, "rope2d": ROPE_BOUND},
    timeout=180,
)
def vision_input(ctx: GateContext) -> None:
    """MoonViT3d's input side in integers at width 1024: the patch embedding, the 64 × 64
    position table resized to square, oblong and larger grids, and the time embedding, each within
    513/1024 LSB of float64; 2D RoPE within its bound; the token count equal to the rule
    simulated on shapes.

    Every figure of the tower is per public ports (K3-SPEC.md section 9)."""
    k = ctx.compiled()
    rng = np.random.default_rng(SEED)
    _patch_embed(ctx, k, rng)
    _positions(ctx, k, rng)
    _time(ctx, k)
    _rope(ctx, k, rng)
    _token_count(ctx, k)
    _compiled(ctx, rng)
    worst = {c.name: c.measured for c in ctx.checks if c.kind == "reference"}
    ctx.evidence(
        f"patch embedding of a 448×448 image at width {WIDTH} within "
        f"{worst['patch_embed_448x448']:.3f} LSB, the position table at 97×130 within "
        f"{worst['pos_resize_97x130']:.3f}, time embedding {worst['time_embed']:.3f}, 2D RoPE "
        f"{worst['rope2d']:.3f} LSB; token counts equal the rule on "
        f"{len(SIDES) ** 2 * len(FRAMES):,} shapes"
    )


def _patch_embed(ctx: GateContext, k, rng: np.random.Generator) -> None:
    w = np.round(rng.normal(0, 0.05, (WIDTH, K.PATCH_VALUES)) * 2**K.W_FRAC).astype(np.int32)
    for h, wd in IMAGES:
        pixels = _image(rng, h, wd)
        got = k.patch_embed(pixels, w)
        want = ref.patch_embed(pixels, w * 2.0**-K.W_FRAC) * 2.0**K.ACT_FRAC
        ctx.check_reference(
            f"patch_embed_{h}x{wd}",
            f"the 14×14 patch embedding of a {h}×{wd}-pixel image ({h // 14}×{wd // 14} patches) "
            f"at width {WIDTH}, from uint8 pixels, in Q.16 within the declared bound of float64",
            got,
            want,
            unit=Q16,
        )
    ctx.check_threads(
        "threads_patch_embed",
        "the patch embedding of a 224×350 image gives the same bits with 1 and with 2 OpenMP "
        "threads (patches in parallel)",
        "patch_embed",
        pixels,
        np.ascontiguousarray(w[:64]),
    )


def _positions(ctx: GateContext, k, rng: np.random.Generator) -> None:
    table = np.round(rng.normal(0, 1.0, (K.TABLE, K.TABLE, WIDTH)) * 2**K.ACT_FRAC)
    table = table.astype(np.int32)
    for h, w in GRIDS:
        ctx.check_reference(
            f"pos_resize_{h}x{w}",
            f"the learned 64×64 position table at width {WIDTH}, resized bilinearly (half-pixel "
            f"centres) to a {h}×{w} patch grid, in Q.16 within the declared bound of float64",
            k.pos_resize(table, h, w),
            ref.resize_bilinear(table * 2.0**-K.ACT_FRAC, h, w) * 2.0**K.ACT_FRAC,
            unit=Q16,
        )
    same = np.array_equal(k.pos_resize(table, K.TABLE, K.TABLE).reshape(table.shape), table)
    flat = np.full((K.TABLE, K.TABLE, 4), 12345, dtype=np.int32)
    flat[..., 1] = -(2**31) + 1
    flat_ok = all(
        np.array_equal(k.pos_resize(flat, h, w), np.tile(flat[0, 0], (h * w, 1)))
        for h, w in (*GRIDS, (1, 1), (64, 1), (511, 509))
    )
    ctx.check(
        "resize_exact_cases",
        "resized to its own 64×64 grid the table comes back bit for bit, and a constant table "
        "(raw 12345, and -2^31 + 1) stays that constant bit for bit on every grid, 1×1 to "
        "511×509 (the bilinear weights sum to one exactly)",
        same and flat_ok,
        message=f"identity {same}, constant {flat_ok}",
    )


def _time(ctx: GateContext, k) -> None:
    freq = time_turns(WIDTH)
    got = k.time_embed(freq, K.CHUNK)
    ctx.check_reference(
        "time_embed",
        f"the sin/cos time embedding of the {K.CHUNK} frames of a chunk at width {WIDTH}, in Q.16 "
        "within the declared bound of float64",
        got,
        ref.time_embed(K.CHUNK, WIDTH) * 2.0**K.ACT_FRAC,
        unit=Q16,
    )
    half = WIDTH // 2
    ctx.check(
        "time_frame_zero",
        "frame 0 embeds as sin 0 = 0 and cos 0 = 1 exactly in every one of its 1024 values",
        bool((got[0, :half] == 0).all() and (got[0, half:] == 1 << K.ACT_FRAC).all()),
    )


def _rope(ctx: GateContext, k, rng: np.random.Generator) -> None:
    gh, gw = ROPE_GRID
    pos_y, pos_x = (a.ravel().astype(np.int64) for a in np.indices(ROPE_GRID))
    corner = np.arange(K.MAX_SIDE - 64, K.MAX_SIDE, dtype=np.int64)  # up to 511, both axes
    pos_x = np.concatenate([pos_x, corner, corner[::-1]])
    pos_y = np.concatenate([pos_y, corner[::-1], corner])
    n = pos_x.size
    x = rng.integers(-ROPE_X_MAX + 1, ROPE_X_MAX, (n, K.HEAD)).astype(np.int32)
    freq = rope_turns(K.HEAD)
    got, sat = k.rope2d(x, pos_x, pos_y, freq)
    ctx.check_reference(
        "rope2d",
        f"2D RoPE on {n:,} rows of a 128-wide head, at every patch of a {gh}×{gw} grid and at "
        f"columns and rows up to {K.MAX_SIDE - 1}, in Q.20 within the declared bound of float64 "
        "(longctx.kernels.rope_bound_q10 at position 511)",
        got,
        ref.rope2d(x * 2.0**-LK.X_FRAC, pos_x, pos_y) * 2.0**LK.X_FRAC,
        unit=Q20,
    )
    zero = np.zeros(n, dtype=np.int64)
    origin, _ = k.rope2d(x, zero, zero, freq)
    moved, _ = k.rope2d(x, pos_x, pos_y[::-1].copy(), freq)
    half = K.HEAD // 2
    ctx.check(
        "rope_exact_cases",
        "at column 0 and row 0 2D RoPE returns every row bit for bit; changing only the rows "
        "leaves the column half bit for bit and changing only the columns leaves the row half; "
        "no value saturates",
        bool(
            np.array_equal(origin, x)
            and np.array_equal(moved[:, :half], got[:, :half])
            and np.array_equal(k.rope2d(x, zero, pos_y, freq)[0][:, half:], got[:, half:])
            and sat == 0
        ),
        saturations=int(sat),
    )


def _token_count(ctx: GateContext, k) -> None:
    h, w, f = (a.ravel().astype(np.int64) for a in np.meshgrid(SIDES, SIDES, FRAMES))
    got = k.vision_tokens_array(h, w, f)
    want = np.array([_tokens_by_simulation(*map(int, c)) for c in zip(h, w, f, strict=True)])
    bad = np.flatnonzero(got != want)
    ctx.check(
        "token_count",
        f"the integer token count equals the rule simulated on shapes (patches, limits, 2×2 "
        f"merge groups, chunks of 4 frames) on all {h.size:,} combinations of {len(SIDES)} "
        f"heights and widths from 0 to 7169 pixels and {len(FRAMES)} frame counts from 0 to 16, "
        "refusals included",
        bad.size == 0,
        message=f"{bad.size} differ, first {h[bad[:1]]}x{w[bad[:1]]}x{f[bad[:1]]}" * bool(bad.size),
        refused=int(np.sum(want < 0)),
    )
    sizes = [(448, 448, 1), (896, 896, 1), (1080, 1920, 1), (448, 448, 4), (448, 448, 9)]
    ctx.artifact(
        "table:tokens per image or clip",
        {
            "columns": ["pixels", "frames", "patches per frame", "tokens"],
            "rows": [
                [f"{a}×{b}", c, -(-a // 14) * -(-b // 14), int(k.vision_tokens_array(
                    *(np.array([v], dtype=np.int64) for v in (a, b, c)))[0])]
                for a, b, c in sizes
            ],
        },
    )  # fmt: skip


def _compiled(ctx: GateContext, rng: np.random.Generator) -> None:
    pixels = _image(rng, 28, 42)
    w = rng.integers(-(2**31) + 1, 2**31, (3, K.PATCH_VALUES)).astype(np.int32)
    check_compiled(ctx, "compiled_patch_embed", "patch_embed", pixels, w,
                   inputs="a 28×42 image (6 patches) at width 3, weights over the whole int32 "
                   "range")  # fmt: skip
    table = rng.integers(-(2**31) + 1, 2**31, (K.TABLE, K.TABLE, 2)).astype(np.int32)
    check_compiled(ctx, "compiled_pos_resize", "pos_resize", table, 5, 97,
                   inputs="the table at width 2 with values over the whole int32 range, resized "
                   "to 5×97 (shrinking one axis, growing the other)")  # fmt: skip
    check_compiled(ctx, "compiled_time_embed", "time_embed",
                   time_turns(16), 4,
                   inputs="4 frames at width 16")  # fmt: skip
    x = rng.integers(-(2**30), 2**30, (8, K.HEAD)).astype(np.int32)
    pos = np.array([0, 1, 2, 63, 64, 255, 510, 511], dtype=np.int64)
    check_compiled(ctx, "compiled_rope2d", "rope2d", x, pos, pos[::-1].copy(),
                   rope_turns(K.HEAD),
                   inputs="8 rows at rope_rotate's largest inputs (|x| up to 2^30), columns and "
                   "rows from 0 to 511")  # fmt: skip
    sides = np.array(SIDES, dtype=np.int64)
    check_compiled(ctx, "compiled_tokens", "vision_tokens_array", sides, sides[::-1].copy(),
                   np.resize(np.array(FRAMES, dtype=np.int64), sides.size),
                   inputs=f"{sides.size} shapes, refusals included")  # fmt: skip


# == HAVE: one block at K3's width, packed per image, the merger and the projector ===============
PAIR = ((448, 448), (322, 210))  # two images packed in one batch: 32×32 and 23×15 patches
CLIP = (224, 224, 4)  # a 4-frame clip: one chunk of 4 × 16×16 patches
TIMED = ((448, 448), (896, 896))  # time and memory per image
PROBE_ROWS = 24  # query rows per input whose attention stages are held to float64 (every head)
ROPE_BLOCK_BOUND = LK.rope_bound_q10(1 << 26, LK.ONE_MSCALE, K.MAX_SIDE - 1) / 1024
STAGES = ("norm1", "qkv", "rope", "scores", "softmax", "attend", "out_proj", "norm2", "mlp_up",
          "gelu", "mlp_down")  # fmt: skip
PROJECTOR = ("proj_up", "proj_gelu", "proj_down", "proj_norm")


def _stage_bounds() -> dict[str, float]:
    bounds = {f"{run}_{s}": HALF_LSB for run in ("pair", "clip") for s in STAGES}
    bounds |= {"pair_rope": ROPE_BLOCK_BOUND, "clip_rope": ROPE_BLOCK_BOUND}
    return bounds | {s: HALF_LSB for s in PROJECTOR} | {"merge_pair": HALF_LSB,
                                                        "merge_clip": HALF_LSB}  # fmt: skip


@gate(
    "vision_block",
    innovation="multimodal",
    level="HAVE",
    kernels=["k3gates.vision.kernels", "k3gates.vision.kernels_block", "k3gates.fx.kernels",
             "k3gates.gemm.kernels"],
    bounds=_stage_bounds(),
    timeout=300,
    requires=["vision_input"],
)  # fmt: skip
def vision_block(ctx: GateContext) -> None:
    """One MoonViT3d block at K3's width (1024, 12 heads of 128, MLP 4096, tanh-GELU, RMSNorm) on
    two packed images of different shapes and on a 4-frame clip, the temporal-pool patch merger
    and the projector into 7168, every stage within its declared bound of float64 on the
    integers it received; packing two images equals running them apart, bit for bit.

    Every figure of the tower is per public ports (K3-SPEC.md section 9)."""
    k = B.Kernels(ctx.compiled)
    rng = np.random.default_rng([SEED, 2])
    w = B.init_block(rng)
    table = np.round(rng.normal(0, 0.5, (K.TABLE, K.TABLE, B.WIDTH)) * 2**16).astype(np.int32)
    w_patch = np.round(rng.normal(0, 0.05, (B.WIDTH, K.PATCH_VALUES)) * 2**20).astype(np.int32)

    def embed(h: int, wd: int, frames: int = 1) -> tuple[np.ndarray, int, int]:
        gh, gw = h // K.PATCH, wd // K.PATCH
        pos = k.vision.pos_resize(table, gh, gw)
        if frames == 1:
            return k.vision.patch_embed(_image(rng, h, wd), w_patch) + pos, gh, gw
        t = k.vision.time_embed(time_turns(B.WIDTH), frames)
        per = [
            k.vision.patch_embed(_image(rng, h, wd), w_patch) + pos + t[f] for f in range(frames)
        ]
        return np.concatenate(per), gh, gw

    (xa, gha, gwa), (xb, ghb, gwb) = embed(*PAIR[0]), embed(*PAIR[1])
    both = zip(B.grid_positions(gha, gwa), B.grid_positions(ghb, gwb), strict=True)
    pos_pair = [np.concatenate(a) for a in both]
    cu_pair = np.array([0, len(xa), len(xa) + len(xb)], dtype=np.int64)
    pair = B.forward(k, np.concatenate([xa, xb]), pos_pair, cu_pair, w)
    what = f"two packed images, {PAIR[0][0]}×{PAIR[0][1]} and {PAIR[1][0]}×{PAIR[1][1]}"
    _stages(ctx, k, "pair", pair, pos_pair, cu_pair, w, f"{what} ({len(xa)} + {len(xb)} tokens)")

    ch, cw, frames = CLIP
    xc, ghc, gwc = embed(ch, cw, frames)
    pos_clip = B.grid_positions(ghc, gwc, frames)
    cu_clip = np.array([0, len(xc)], dtype=np.int64)
    clip = B.forward(k, xc, pos_clip, cu_clip, w)
    _stages(ctx, k, "clip", clip, pos_clip, cu_clip, w,
            f"a {frames}-frame {ch}×{cw} clip, one chunk of {len(xc)} tokens")  # fmt: skip

    timing = _apart_and_timed(ctx, k, w, pair, (xa, gha, gwa), (xb, ghb, gwb), embed)
    merged = _merger(ctx, k, pair, clip, (gha, gwa, len(xa)), (ghb, gwb), (ghc, gwc, frames))
    _projector(ctx, k, merged, rng)
    _block_compiled(ctx, rng)
    ctx.artifact(
        "table:time and memory of one block per image (width 1024, this machine)",
        {"columns": ["image", "tokens", "block seconds", "stage outputs held (MiB)",
                     "gate process peak RSS after it (MiB)"], "rows": timing},
    )  # fmt: skip
    worst = max(c.measured for c in ctx.checks if c.kind == "reference" and c.unit == Q16)
    ctx.evidence(
        f"one block at width 1024 on two packed images ({len(xa)} + {len(xb)} tokens) and a "
        f"4-frame clip ({len(xc)} tokens), the merger and the projector into 7168: every Q.16 "
        f"stage within {worst:.4f} LSB of float64 on its own inputs; {timing[-1][2]} s per block "
        "at 896×896"
    )


def _real(a: np.ndarray, frac: int) -> np.ndarray:
    return np.asarray(a, dtype=np.float64) * 2.0**-frac


def _stages(ctx: GateContext, k, run: str, s: dict, pos, cu: np.ndarray, w: dict,
            what: str) -> None:  # fmt: skip
    """Every stage of one block run against float64 on the integers that stage received."""
    a, wf = B.ACT_FRAC, B.W_FRAC

    def hold(stage: str, got: np.ndarray, want: np.ndarray, unit: str, about: str) -> None:
        ctx.check_reference(f"{run}_{stage}", f"{about}, on {what}, is within the declared "
                            "bound of float64 on the integers it received", got, want,
                            unit=unit)  # fmt: skip

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return _real(x, a) @ _real(w[name], wf).T * 2.0**a

    hold("norm1", s["h1"], ref.rmsnorm(_real(s["x"], a), _real(w["g1"], wf), B.EPS) * 2.0**a,
         Q16, "RMSNorm before attention")  # fmt: skip
    hold("qkv", np.hstack([s[n] for n in "qkv"]), np.hstack([linear(s["h1"], f"w{n}")
         for n in "qkv"]), Q16, "the q, k and v projections, 1024 → 3 × 1536")  # fmt: skip
    dh = B.HEAD_DIM
    px, py = (np.tile(np.repeat(p, B.HEADS), 2) for p in pos)
    rows = np.vstack([s["q"], s["k"]]).reshape(-1, dh)
    hold("rope", np.vstack([s["q_rope"], s["k_rope"]]).reshape(-1, dh),
         ref.rope2d(_real(rows, a), px, py) * 2.0**B.ROPE_FRAC, Q20,
         "2D RoPE on every head of q and k")  # fmt: skip
    _attention_probes(ctx, k, run, s, cu, what)
    hold("out_proj", s["attn_out"], linear(s["o"], "wo"), Q16, "the output projection 1536 → 1024")
    hold("norm2", s["h2"], ref.rmsnorm(_real(s["x1"], a), _real(w["g2"], wf), B.EPS) * 2.0**a,
         Q16, "RMSNorm before the MLP")  # fmt: skip
    hold("mlp_up", s["u"], linear(s["h2"], "w1"), Q16, "the MLP's first matrix, 1024 → 4096")
    hold("gelu", s["a"], ref.gelu(_real(s["u"], a)) * 2.0**a, Q16, "tanh-GELU")
    hold("mlp_down", s["mlp_out"], linear(s["a"], "w2"), Q16, "the MLP's second matrix 4096 → 1024")
    limits = {"u": 1 << 42, "x2": 1 << 40}  # q, k, v and RoPE: forward raises outside them
    over = {n: int(np.abs(s[n]).max()) for n in limits if np.abs(s[n]).max() >= limits[n]}
    ctx.check(
        f"{run}_in_domain",
        f"on {what}, GELU's input stays below 2^42 raw (where its bound is stated) and the "
        "residual stream below 2^40; q, k, v, the RoPE input and every product stay inside "
        "their kernels' domains too, since the block stops with an error outside them",
        not over,
        message=f"outside: {over}",
    )


def _attention_probes(ctx: GateContext, k, run: str, s: dict, cu: np.ndarray,
                      what: str) -> None:  # fmt: skip
    """Scores, softmax and P v of PROBE_ROWS query rows (both ends of every segment among them)
    in every head, each against float64 on the integers it received; and the same rows of the
    whole attention call, bit for bit."""
    n, dh = len(s["x"]), B.HEAD_DIM
    rows = np.unique(np.concatenate([np.linspace(0, n - 1, PROBE_ROWS).astype(np.int64),
                                     cu[1:-1], cu[1:-1] - 1]))  # fmt: skip
    got: dict[str, list] = {"z": [], "p": [], "o": []}
    want: dict[str, list] = {"z": [], "p": [], "o": []}
    same = True
    inputs = B.attention_inputs(s)
    for row in rows:
        lo, hi = (int(c) for c in cu[np.searchsorted(cu, row, side="right") - 1 :][:2])
        for head in range(B.HEADS):
            cols = slice(head * dh, (head + 1) * dh)
            z, p, o = k.block.attention_row(*inputs, cu, B.HEADS, k.scale, int(row), head)
            keys = _real(s["k_rope"][lo:hi, cols], B.ROPE_FRAC)
            want["z"].append(ref.scores(_real(s["q_rope"][row, cols], B.ROPE_FRAC), keys, dh)
                             * 2.0**24)  # fmt: skip
            want["p"].append(ref.softmax(_real(z, 24)) * 2.0**31)
            want["o"].append(_real(p, 31) @ _real(s["v"][lo:hi, cols], B.ACT_FRAC) * 2.0**16)
            for name, v in (("z", z), ("p", p), ("o", o)):
                got[name].append(v)
            same = same and np.array_equal(o, s["o"][row, cols])
    for name, stage, unit, about in (
        ("z", "scores", "LSB (2^-24)", "the attention scores q·k/√128 in Q.24"),
        ("p", "softmax", "LSB (2^-31)", "the softmax over the row's own image or chunk, Q0.31"),
        ("o", "attend", Q16, "P v, the attention output of each head"),
    ):
        ctx.check_reference(
            f"{run}_{stage}",
            f"{about}, for {len(rows)} query rows (the ends of every packed segment among them) "
            f"in all {B.HEADS} heads on {what}, is within the declared bound of float64 on the "
            "integers it received",
            np.concatenate(got[name]),
            np.concatenate(want[name]),
            unit=unit,
        )
    ctx.check(
        f"{run}_attention_rows",
        f"the whole attention call gives those {len(rows)} rows the same bits as the stage "
        "probe (one code path)",
        same,
    )


def _apart_and_timed(ctx: GateContext, k, w: dict, pair: dict, a: tuple, b: tuple,
                     embed) -> list[list]:  # fmt: skip
    """Each image of the pair run alone: packing changes no bit. Then the time and memory of one
    block per image at 448×448 and 896×896."""
    runs, rows = [], []
    for given, size in ((a, PAIR[0]), (b, PAIR[1]), (None, TIMED[1])):
        x, gh, gw = given or embed(*size)
        t0 = time.perf_counter()
        s = B.forward(k, x, B.grid_positions(gh, gw), np.array([0, len(x)], np.int64), w)
        seconds = time.perf_counter() - t0
        runs.append(s["x2"])
        if size in TIMED:
            held = sum(v.nbytes for v in s.values()) / 2**20
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append([f"{size[0]}×{size[1]}", len(x), f"{seconds:.1f}", f"{held:.0f}",
                         f"{peak:.0f}"])  # fmt: skip
    ctx.check_deterministic(
        "packing",
        f"the two images packed in one batch ({PAIR[0][0]}×{PAIR[0][1]} and {PAIR[1][0]}×"
        f"{PAIR[1][1]}) and each run alone give the same block output, bit for bit",
        {"packed": pair["x2"], "apart": np.vstack(runs[:2])},
    )
    return rows


def _merger(ctx: GateContext, k, pair: dict, clip: dict, a: tuple, b: tuple,
            c: tuple) -> np.ndarray:  # fmt: skip
    """The temporal-pool patch merger on the pair (odd grid padded) and on the clip."""
    gha, gwa, na = a
    (ghb, gwb), (ghc, gwc, frames) = b, c
    xa, xb = pair["x2"][:na], pair["x2"][na:]
    merged = np.vstack([k.block.merge(xa, 1, K.CHUNK, gha, gwa),
                        k.block.merge(xb, 1, K.CHUNK, ghb, gwb)])  # fmt: skip
    want = np.vstack([ref.merge(_real(xa, 16), 1, K.CHUNK, gha, gwa),
                      ref.merge(_real(xb, 16), 1, K.CHUNK, ghb, gwb)]) * 2.0**16  # fmt: skip
    ctx.check_reference(
        "merge_pair",
        f"the patch merger on the pair's block output: 2×2 groups concatenated into 4096-wide "
        f"tokens ({gha}×{gwa} and {ghb}×{gwb} patches, the odd grid padded), within the declared "
        "bound of float64",
        merged,
        want,
        unit=Q16,
    )
    ctx.check_reference(
        "merge_clip",
        f"the temporal-pool patch merger on the clip: the mean of its {frames} frames, then 2×2 "
        "groups concatenated, within the declared bound of float64",
        k.block.merge(clip["x2"], frames, K.CHUNK, ghc, gwc),
        ref.merge(_real(clip["x2"], 16), frames, K.CHUNK, ghc, gwc) * 2.0**16,
        unit=Q16,
    )
    return merged


def _projector(ctx: GateContext, k, merged: np.ndarray, rng: np.random.Generator) -> None:
    pw = B.init_projector(rng)
    s = B.project(k, merged, pw)
    a, wf = B.ACT_FRAC, B.W_FRAC
    cases = (
        ("proj_up", s["p1"], _real(merged, a) @ _real(pw["p1"], wf).T,
         "its first matrix 4096 → 4096"),
        ("proj_gelu", s["p1_gelu"], ref.gelu(_real(s["p1"], a)), "its GELU"),
        ("proj_down", s["p2"], _real(s["p1_gelu"], a) @ _real(pw["p2"], wf).T,
         "its second matrix 4096 → 7168"),
        ("proj_norm", s["out"], ref.rmsnorm(_real(s["p2"], a), _real(pw["gp"], wf), B.EPS),
         "its RMSNorm over 7168"),
    )  # fmt: skip
    for name, got, want, about in cases:
        ctx.check_reference(
            name,
            f"the projector into K3's 7168-wide stream, {about}, on the pair's {len(merged)} "
            "merged tokens, is within the declared bound of float64 on the integers it received",
            got,
            want * 2.0**a,
            unit=Q16,
        )


def _block_compiled(ctx: GateContext, rng: np.random.Generator) -> None:
    mod = "k3gates.vision.kernels_block"
    q, keys, v = (rng.integers(-(1 << 25), 1 << 25, (10, 16)).astype(np.int32) for _ in range(3))
    cu = np.array([0, 6, 10], dtype=np.int64)
    scale = 1 << 60  # 1/4 in Q0.62
    check_compiled(ctx, "compiled_attention", "attention", q, keys, v, cu, 2, scale,
                   inputs="10 tokens in two packed segments (6 and 4), 2 heads of 8, "
                   "|q|, |k|, |v| up to 2^25", modname=mod)  # fmt: skip
    check_compiled(ctx, "compiled_attention_row", "attention_row", q, keys, v, cu, 2, scale, 7,
                   1, inputs="row 7 (the second segment), head 1", modname=mod)  # fmt: skip
    edges = np.array([0, 1, -1, 8 << 16, -(8 << 16), (8 << 16) + 1, -(8 << 16) - 1, 3 << 15,
                      -(3 << 15), 1 << 40, -(1 << 40), 12345, -98765], dtype=np.int64)  # fmt: skip
    check_compiled(ctx, "compiled_gelu", "gelu", edges.reshape(1, -1),
                   inputs="0, ±1 LSB, ±1.5, both sides of the clamp at ±8, ±2^24 and two "
                   "arbitrary values", modname=mod)  # fmt: skip
    x = rng.integers(-(1 << 30), 1 << 30, (3 * 3 * 5, 2))
    check_compiled(ctx, "compiled_merge", "merge", x, 3, 2, 3, 5,
                   inputs="3 frames in chunks of 2 (the last chunk of 1) of an odd 3×5 grid, "
                   "width 2", modname=mod)  # fmt: skip
    big_q, big_k, big_v = (
        rng.integers(-(1 << 24), 1 << 24, (300, 64)).astype(np.int32) for _ in range(3)
    )
    ctx.check_threads(
        "threads_attention",
        "attention over 300 tokens in two segments gives the same bits with 1 and with 2 OpenMP "
        "threads (gemm tiles and softmax rows in parallel)",
        "attention", big_q, big_k, big_v, np.array([0, 170, 300], dtype=np.int64), 4, 1 << 60,
        modname=mod,
    )  # fmt: skip
