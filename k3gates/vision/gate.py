"""Native multimodal, the input side (PARTIAL): MoonViT3d's patch embedding, its learned position
table resized to any patch grid, the frames' time embedding, 2D RoPE and the token-count rule, in
integers, at K3's width (1024) and head size (128), per public ports (K3-SPEC.md section 9).
Bounds come from k3gates/vision/kernels.py and k3gates/longctx/kernels.py, declared before any
run."""

from __future__ import annotations

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.gate import GateContext, gate

from ..longctx import kernels as LK
from ..longctx.gate import turns_q62
from . import kernels as K
from . import reference as ref

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
    freq = turns_q62(ref.time_frequencies(WIDTH))
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
    freq = turns_q62(ref.rope_frequencies(K.HEAD))
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
                   turns_q62(ref.time_frequencies(16)), 4,
                   inputs="4 frames at width 16")  # fmt: skip
    x = rng.integers(-(2**30), 2**30, (8, K.HEAD)).astype(np.int32)
    pos = np.array([0, 1, 2, 63, 64, 255, 510, 511], dtype=np.int64)
    check_compiled(ctx, "compiled_rope2d", "rope2d", x, pos, pos[::-1].copy(),
                   turns_q62(ref.rope_frequencies(K.HEAD)),
                   inputs="8 rows at rope_rotate's largest inputs (|x| up to 2^30), columns and "
                   "rows from 0 to 511")  # fmt: skip
    sides = np.array(SIDES, dtype=np.int64)
    check_compiled(ctx, "compiled_tokens", "vision_tokens_array", sides, sides[::-1].copy(),
                   np.resize(np.array(FRAMES, dtype=np.int64), sides.size),
                   inputs=f"{sides.size} shapes, refusals included")  # fmt: skip
