"""MoonViT3d (K3-SPEC.md section 9, per public ports): the library face. Float in,
float out; integers in between (k3gates.vision.kernels states every format and bound).

    y = patch_embed(pixels, w)           # uint8 [H, W, 3], w [D, 588] -> [H/14 W/14, D]
    p = position_embedding(table, h, w)  # the 64 x 64 x D table resized to an h x w grid
    e = time_embedding(frames, dim)      # [frames, dim] sin/cos, frames <= 4
    r = rope2d(x, pos_x, pos_y)          # [N, 128]: half by the column, half by the row
    n = token_count(height, width, frames)
    t = encode(pixels, weights)          # an image or a clip -> merged tokens in the text width

Weights are quantised to Q.20 and tables to Q.16 (ties away from zero); the results are the
kernels' exact fixed-point values. Bad input (wrong shape or dtype, NaN, out of range) raises
ValueError naming the argument.
"""

from __future__ import annotations

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from ..longctx.kernels import X_FRAC
from . import block as B
from . import kernels as K
from .tables import rope_turns, time_turns

KERNELS = "k3gates.vision.kernels"
WEIGHT_MAX = 2.0**11  # |w| < 2048 keeps Q.20 in int32
TABLE_MAX = 2.0**15  # |table| < 32768 keeps Q.16 in int32
ROPE_MAX = 2.0**10  # |x| < 1024 keeps Q.20 within rope_rotate's 2^30


def _kernels():
    return _compile.load(KERNELS)


def _real(a: object, name: str, limit: float, ndim: int) -> np.ndarray:
    try:
        v = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected an array of real numbers") from e
    if v.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {v.shape}")
    if not np.all(np.isfinite(v)) or (v.size and np.abs(v).max() >= limit):
        raise ValueError(f"{name}: expected finite values below {limit:g} in magnitude")
    return v


def patch_embed(pixels: object, w: object) -> np.ndarray:
    """The 14 x 14 patch embedding of an image: [H/14 W/14, D] (Q.16 values)."""
    px = np.asarray(pixels)
    if px.dtype != np.uint8 or px.ndim != 3 or px.shape[2] != 3:
        raise ValueError(f"pixels: expected uint8 [H, W, 3], got {px.dtype} {px.shape}")
    if px.shape[0] % K.PATCH or px.shape[1] % K.PATCH or 0 in px.shape:
        raise ValueError(f"pixels: H and W must be positive multiples of 14, got {px.shape[:2]}")
    wv = _real(w, "w", WEIGHT_MAX, 2)
    if wv.shape[1] != K.PATCH_VALUES:
        raise ValueError(f"w: expected [D, {K.PATCH_VALUES}], got {wv.shape}")
    wq = quantize(wv, K.W_FRAC).astype(np.int32)
    return value(_kernels().patch_embed(np.ascontiguousarray(px), wq), K.ACT_FRAC)


def position_embedding(table: object, h: int, w: int) -> np.ndarray:
    """The learned 64 x 64 x D table resized bilinearly to an h x w patch grid: [h w, D]."""
    t = _real(table, "table", TABLE_MAX, 3)
    if t.shape[:2] != (K.TABLE, K.TABLE):
        raise ValueError(f"table: expected [64, 64, D], got {t.shape}")
    if not (1 <= h <= K.MAX_SIDE and 1 <= w <= K.MAX_SIDE):
        raise ValueError(f"grid: expected 1 <= h, w <= {K.MAX_SIDE}, got {h} x {w}")
    tq = np.ascontiguousarray(quantize(t, K.ACT_FRAC).astype(np.int32))
    return value(_kernels().pos_resize(tq, int(h), int(w)), K.ACT_FRAC)


def time_embedding(frames: int, dim: int) -> np.ndarray:
    """The sin/cos time embedding of frames 0 .. frames-1 (at most 4, a chunk): [frames, dim]."""
    if not 1 <= frames <= K.CHUNK or dim < 2 or dim % 2:
        raise ValueError(f"expected 1 <= frames <= 4 and an even dim, got {frames}, {dim}")
    return value(_kernels().time_embed(time_turns(dim), int(frames)), K.ACT_FRAC)


def rope2d(x: object, pos_x: object, pos_y: object) -> np.ndarray:
    """Rows [N, 128] turned by 2D RoPE to their patches' columns pos_x and rows pos_y."""
    xv = _real(x, "x", ROPE_MAX, 2)
    if xv.shape[1] != K.HEAD:
        raise ValueError(f"x: expected [N, {K.HEAD}], got {xv.shape}")
    pos = [np.asarray(p) for p in (pos_x, pos_y)]
    for name, p in zip(("pos_x", "pos_y"), pos, strict=True):
        if p.shape != (xv.shape[0],) or not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"{name}: expected {xv.shape[0]} integer positions")
        if p.size and (p.min() < 0 or p.max() >= K.MAX_SIDE):
            raise ValueError(f"{name}: expected positions in 0 .. {K.MAX_SIDE - 1}")
    xq = np.ascontiguousarray(quantize(xv, X_FRAC).astype(np.int32))
    out, _sat = _kernels().rope2d(xq, *(p.astype(np.int64) for p in pos), rope_turns())
    return value(out, X_FRAC)


def token_count(height: int, width: int, frames: int = 1) -> int:
    """Language-model tokens for `frames` frames of height x width pixels: one per 28 x 28
    pixels per chunk of up to 4 frames, a side that is not a multiple of 14 padded up (as
    `encode` pads it). Raises ValueError where the processor would resize."""
    args = (np.array([v], dtype=np.int64) for v in (height, width, frames))
    n = int(_kernels().vision_tokens_array(*args)[0])
    if n < 0:
        raise ValueError(
            f"{height} x {width} pixels, {frames} frames: expected positive sizes and at most "
            f"{K.MAX_SIDE} patches per side and {K.MAX_PATCHES} per frame (resize first)"
        )
    return n


BLOCK_KEYS = ("g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2")


def encode(pixels: object, weights: dict) -> np.ndarray:
    """An image [H, W, 3] or a clip [F, H, W, 3] of uint8 pixels -> its merged tokens in the text
    model's width, [token_count(H, W, F), text width] (float64 of the integers' Q.16 values).

    The tower in integers: the 14 x 14 patch embedding (sides padded up to a multiple of 14 with
    the value 128, which normalises to 0), the position table resized to the grid, for a clip
    the time embedding of each frame's place in its chunk of 4, then every block (heads of 128;
    K3: width 1024, q/k/v width 1536, 27 blocks), attention inside each image or chunk, the
    temporal-pool merger and the projector. `weights` (float): "patch" [D, 588],
    "table" [64, 64, D], "blocks" (a list of dicts g1, wq, wk, wv, wo, g2, w1, w2, shaped as
    k3gates.vision.block.init_block makes them), "projector" (p1 [4D, 4D], p2 [T, 4D], gp [T])."""
    px = np.asarray(pixels)
    if px.ndim == 3:
        px = px[None]
    if px.dtype != np.uint8 or px.ndim != 4 or px.shape[3] != 3:
        raise ValueError(f"pixels: expected uint8 [H, W, 3] or [F, H, W, 3], got {px.dtype} "
                         f"{np.shape(pixels)}")  # fmt: skip
    frames, h, w = px.shape[:3]
    token_count(h, w, frames)  # refuses what the processor would resize
    gh, gw = -(-h // K.PATCH), -(-w // K.PATCH)
    padded = np.full((frames, gh * K.PATCH, gw * K.PATCH, 3), 128, dtype=np.uint8)
    padded[:, :h, :w] = px
    patch = _real(weights.get("patch"), "weights['patch']", WEIGHT_MAX, 2)
    d = patch.shape[0]
    if patch.shape[1] != K.PATCH_VALUES or d % K.HEAD:
        raise ValueError(f"weights['patch']: expected [D, 588] with D a multiple of 128, "
                         f"got {patch.shape}")  # fmt: skip
    table = _real(weights.get("table"), "weights['table']", TABLE_MAX, 3)
    if table.shape != (K.TABLE, K.TABLE, d):
        raise ValueError(f"weights['table']: expected [64, 64, {d}], got {table.shape}")
    blocks = [_block_weights(b, i, d) for i, b in enumerate(weights.get("blocks", ()))]
    proj = _projector_weights(weights.get("projector"), d)
    k = B.Kernels(_compile.load)
    wq = quantize(patch, K.W_FRAC).astype(np.int32)
    pos = k.vision.pos_resize(np.ascontiguousarray(quantize(table, K.ACT_FRAC).astype(np.int32)),
                              gh, gw)  # fmt: skip
    t = k.vision.time_embed(time_turns(d), min(frames, K.CHUNK)) if frames > 1 else None
    x = np.concatenate([k.vision.patch_embed(np.ascontiguousarray(padded[f]), wq) + pos
                        + (0 if t is None else t[f % K.CHUNK]) for f in range(frames)])  # fmt: skip
    cu = np.append(np.arange(0, frames, K.CHUNK), frames).astype(np.int64) * gh * gw
    where = B.grid_positions(gh, gw, frames)
    for blk in blocks:
        x = B.forward(k, x, where, cu, blk, blk["wq"].shape[0] // K.HEAD)["x2"]
    merged = k.block.merge(x, frames, K.CHUNK, gh, gw)
    return value(B.project(k, merged, proj)["out"], K.ACT_FRAC)


def _block_weights(b: object, i: int, d: int) -> dict[str, np.ndarray]:
    if not isinstance(b, dict) or set(b) != set(BLOCK_KEYS):
        raise ValueError(f"weights['blocks'][{i}]: expected a dict of {', '.join(BLOCK_KEYS)}")
    out = {n: quantize(_real(b[n], f"weights['blocks'][{i}]['{n}']", WEIGHT_MAX, 1 if n[0] == "g"
                             else 2), K.W_FRAC) for n in BLOCK_KEYS}  # fmt: skip
    qkv, mlp = out["wq"].shape[0], out["w1"].shape[0]
    want = {"g1": (d,), "wq": (qkv, d), "wk": (qkv, d), "wv": (qkv, d), "wo": (d, qkv),
            "g2": (d,), "w1": (mlp, d), "w2": (d, mlp)}  # fmt: skip
    for n, shape in want.items():
        if out[n].shape != shape or qkv % K.HEAD:
            raise ValueError(f"weights['blocks'][{i}]['{n}']: expected {shape} (q, k, v widths "
                             f"a multiple of 128), got {out[n].shape}")  # fmt: skip
    return out


def _projector_weights(p: object, d: int) -> dict[str, np.ndarray]:
    if not isinstance(p, dict) or set(p) != {"p1", "p2", "gp"}:
        raise ValueError("weights['projector']: expected a dict of p1, p2, gp")
    out = {n: quantize(_real(p[n], f"weights['projector']['{n}']", WEIGHT_MAX, 1 if n == "gp"
                             else 2), K.W_FRAC) for n in ("p1", "p2", "gp")}  # fmt: skip
    text = out["gp"].shape[0]
    for n, shape in (("p1", (4 * d, 4 * d)), ("p2", (text, 4 * d))):
        if out[n].shape != shape:
            raise ValueError(f"weights['projector']['{n}']: expected {shape}, got {out[n].shape}")
    return out
