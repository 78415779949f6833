"""The tiny vision-language model of issue 16's PROVEN rung, one definition run by two backends.

    x = PatchEmbed(frame) + Pos(gh, gw) [+ 4 Time(t) for frame t of a clip]   every frame
    x = Block_l(x), l = 1 .. DEPTH           attention inside each image or clip (MoonViT3d)
    m = Merge(x)                             a clip's 4 frames averaged; 2 x 2 patches joined
    v = RMSNorm(GELU(m P_1^T) P_2^T) g_p     the projector, into the text width
    y = Decoder(Embed(tokens) + v at the image slots)   tasks/seq: a KDA then a Gated MLA layer

The tower has K3's structure at a toy size (one head of 128, as K3's heads; an MLP of 4 x the
width; DEPTH blocks). The position table is resized to the grid as K3 does but is not trained
(fixed at its seeded init); 2D RoPE also gives every patch its place. The text is four tokens:

    image:  <pad> <img> <ans> seven     targets:  . . seven <end>
    clip:   <img> <img> <ans> left      targets:  . . left  seven

<img> slots receive the vision tokens (an image merges into one, a 28 x 56 clip into two: the
canvas's left and right halves). At <ans> the model says an image's digit, or a clip's
direction; then <end>, or the clip's digit. Greedy decoding feeds the first word back. (With
the digit first, the direction is read after a position whose input is one of ten words: in
float64 trials at 4x it was learnt in 3 of 11; asked first, at <ans>, in each of 4.)

`IntOps` runs every value through the integer kernels (vision and its gradients, gemm and K3-μ's);
`FloatOps` runs the float64 references on the same weights dequantised. Python only batches,
indexes and records. Weights are Q.20 (the table Q.16), activations Q.16, gradients Q.24.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ...fx import host
from ...infra import compile as kcompile
from ...k3mu import ops as k3ops
from ...k3mu.model import sub
from ...vision import backward as VG
from ...vision import block as B
from ...vision import kernels as VK
from ...vision import reference as vref
from ...vision import reference_grad as gref
from ...vision.tables import time_turns
from .. import seq as S
from . import task as T

# tokens 0 .. 9 are the digit words (task.WORDS)
LEFT, RIGHT, END, ANS, IMG, PAD = range(10, 16)
VOCAB = 16
LENGTH = 4  # tokens per example
TABLE_FRAC = VK.ACT_FRAC  # the position table: Q.16, as the pos_resize kernel reads it
ACT_FRAC, GRAD_FRAC = B.ACT_FRAC, VG.G_FRAC  # activations Q.16, gradients Q.24


# The sin/cos time embedding enters at 4x (exact in integers). At 1x the direction stayed at
# chance, 47-55% of held-out clips, in ten float64 trials (400-500 steps, one or two blocks,
# decoder width 64 or 128, either word order); at 4x, with the direction asked first, it was
# learnt in each of four (seeds 1 and 2, widths 64 and 128).
TIME_GAIN = 4
BLOCK = ("g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2")  # one tower block's weights
TEXT = S.SeqConfig(vocab=VOCAB, d=64, kinds=("kda", "mla"))


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 128  # one head of 128
    mlp: int = 512
    depth: int = 1
    time_gain: int = TIME_GAIN
    text: S.SeqConfig = TEXT

    @property
    def heads(self) -> int:
        return self.width // VK.HEAD


# -- weights ---------------------------------------------------------------------------------
def init(cfg: Config, seed: int) -> dict[str, np.ndarray]:
    """The integer model's initial weights: the decoder's (tasks/seq) and the tower's ("v."),
    each a seeded real init quantised (Q.20; the table Q.16)."""
    p = S.init(cfg.text, seed)
    rng = np.random.default_rng(seed + 1000)
    p["v.patch"] = B.q20(
        rng.normal(0.0, host.inv_sqrt(VK.PATCH_VALUES), (cfg.width, VK.PATCH_VALUES))
    )
    p["v.table"] = np.round(rng.normal(0.0, 0.1, (VK.TABLE, VK.TABLE, cfg.width))
                            * 2**TABLE_FRAC).astype(np.int64)  # fmt: skip
    for i in range(cfg.depth):
        blk = B.init_block(rng, cfg.width, cfg.heads, VK.HEAD, cfg.mlp)
        p.update({f"v.{i}.{k}": v for k, v in blk.items()})
    proj = B.init_projector(rng, 4 * cfg.width, cfg.text.d)
    p.update({f"v.proj.{k}": v for k, v in proj.items()})
    return p


def twin_params(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 twin's weights: the same integers dequantised."""
    return {k: v * 2.0 ** -(TABLE_FRAC if k == "v.table" else B.W_FRAC) for k, v in p.items()}


def param_specs(cfg: Config, fixed: tuple[str, ...]) -> dict[str, tuple]:
    """The decoder's optimisers (Per-Head Muon and AdamW, as tasks/seq), AdamW for the tower;
    the position table and the names in `fixed` are not trained."""
    specs = S.param_specs(cfg.text, fixed)
    specs["v.patch"] = ("adamw",)
    specs["v.table"] = ("fixed",)
    for i in range(cfg.depth):
        specs.update({f"v.{i}.{k}": ("adamw",) for k in BLOCK})
    specs.update({f"v.proj.{k}": ("adamw",) for k in ("p1", "p2", "gp")})
    return specs


# -- the two backends --------------------------------------------------------------------------
class IntOps(k3ops.IntOps):
    """K3-μ's integer ops (the decoder and the optimisers) and the vision tower's kernels."""

    def __init__(self, load: Callable[[str], ModuleType] = kcompile.load) -> None:
        super().__init__(load)
        self.v = VG.GradKernels(self.load)
        self._grid: dict[tuple[int, int], np.ndarray] = {}

    def patch(self, frames: list[np.ndarray], w: np.ndarray) -> np.ndarray:
        """Each uint8 frame's 14 x 14 patches x its Q.20 weights: rows Q.16, frame after frame."""
        top = int(np.abs(w).max(initial=0))
        if top >= 1 << 31:
            raise OverflowError(f"patch weights |raw| {top} >= 2^31, outside patch_embed's int32")
        w32 = w.astype(np.int32)
        return np.concatenate([self.v.vision.patch_embed(f, w32) for f in frames])

    def patch_back(self, frames: list[np.ndarray], dy: np.ndarray) -> np.ndarray:
        """dW = dy^T X with X the frames' patches (p - 128) in Q.7 (exact): Q.24. (unfold is the
        reference's index-only reshape.)"""
        x = np.concatenate([vref.unfold(f).astype(np.int64) for f in frames]) - VK.PIXEL_ZERO
        dw, outside = self.v.gemm.sum_outer(dy, x, VK.PIXEL_FRAC)
        if outside:
            raise OverflowError(f"patch gradient: {outside} outputs outside gemm_i64's domain")
        return dw

    def grid(self, table: np.ndarray, gh: int, gw: int) -> np.ndarray:
        """The fixed table resized to a gh x gw grid (computed once per grid)."""
        if (gh, gw) not in self._grid:
            t32 = np.ascontiguousarray(table.astype(np.int32))
            self._grid[gh, gw] = self.v.vision.pos_resize(t32, gh, gw)
        return self._grid[gh, gw]

    def time(self, frames: int, width: int) -> np.ndarray:
        return self.v.vision.time_embed(time_turns(width), frames)

    def block(self, x, pos, cu, w, heads) -> tuple[np.ndarray, dict]:
        s = B.forward(self.v, x, pos, cu, w, heads)
        return s["x2"], s

    def block_back(self, dx2, s, pos, cu, w, heads) -> tuple[np.ndarray, dict]:
        d, dw = VG.backward(self.v, s, w, dx2, pos, cu, heads)
        return d["x"], dw

    def merge(self, x, frames, chunk, gh, gw) -> np.ndarray:
        return self.v.block.merge(np.ascontiguousarray(x), frames, chunk, gh, gw)

    def merge_back(self, dm, frames, chunk, gh, gw, width) -> np.ndarray:
        return self.v.grad.merge_backward(np.ascontiguousarray(dm), frames, chunk, gh, gw)

    def project(self, m, w) -> tuple[np.ndarray, dict]:
        s = B.project(self.v, m, w)
        return s["out"], s

    def project_back(self, dout, s, w) -> tuple[np.ndarray, dict]:
        d, dw = VG.project_backward(self.v, s, w, dout)
        return d["merged"], dw


class FloatOps(k3ops.FloatOps):
    """The float64 twin: K3-μ's references and the vision references."""

    def patch(self, frames, w):
        return np.concatenate([vref.patch_embed(f, w) for f in frames])

    def patch_back(self, frames, dy):
        pixels = np.concatenate([vref.unfold(f) for f in frames]).astype(np.float64)
        x = (pixels - VK.PIXEL_ZERO) / 2**VK.PIXEL_FRAC
        return dy.T @ x

    def grid(self, table, gh, gw):
        return vref.resize_bilinear(table, gh, gw)

    def time(self, frames, width):
        return vref.time_embed(frames, width)

    def block(self, x, pos, cu, w, heads):
        s = gref.block_forward(x, *pos, cu, w, heads)
        return s["x2"], s

    def block_back(self, dx2, s, pos, cu, w, heads):
        return gref.block_backward(s, dx2, *pos, cu, w, heads)

    def merge(self, x, frames, chunk, gh, gw):
        return vref.merge(x, frames, chunk, gh, gw)

    def merge_back(self, dm, frames, chunk, gh, gw, width):
        return gref.merge_backward(dm, frames, chunk, gh, gw, width)

    def project(self, m, w):
        s = gref.projector_forward(m, w)
        return s["out"], s

    def project_back(self, dout, s, w):
        return gref.projector_backward(s, dout, w)


# -- one batch: images and clips, their text -------------------------------------------------
IMAGE_GRID = (T.SIDE // VK.PATCH, T.SIDE // VK.PATCH)  # 2 x 2 patches, one merged token
CLIP_GRID = (T.SIDE // VK.PATCH, T.CANVAS // VK.PATCH)  # 2 x 4 patches a frame, two tokens


@dataclasses.dataclass
class Batch:
    images: np.ndarray  # uint8 [Bi, 28, 28, 3]
    clips: np.ndarray  # uint8 [Bc, 4, 28, 56, 3]
    tokens: np.ndarray  # [Bi + Bc, LENGTH]
    targets: np.ndarray  # [Bi + Bc, LENGTH], -1 where not scored


def examples(idx_img: np.ndarray, idx_clip: np.ndarray, directions: np.ndarray,
             starts: np.ndarray) -> Batch:  # fmt: skip
    """Images of the digits idx_img, clips of the digits idx_clip moving in `directions`
    (0 left, 1 right) from `starts`, with their text."""
    imgs8, labels = T.digits()
    images = np.stack([T.render(imgs8[i]) for i in idx_img])
    clips = np.zeros((len(idx_clip), T.FRAMES, T.SIDE, T.CANVAS, 3), dtype=np.uint8)
    for n, (i, d, s) in enumerate(zip(idx_clip, directions, starts, strict=True)):
        clips[n] = T.clip(imgs8[i], T.DIRECTIONS[d], s)
    bi, bc = len(idx_img), len(idx_clip)
    tokens = np.zeros((bi + bc, LENGTH), dtype=np.int64)
    targets = np.full((bi + bc, LENGTH), -1, dtype=np.int64)
    # the answer's two words: an image's digit then <end>; a clip's direction then its digit
    first = np.concatenate([labels[idx_img], LEFT + directions]).astype(np.int64)
    second = np.concatenate([np.full(bi, END), labels[idx_clip]]).astype(np.int64)
    tokens[:, :3] = [PAD, IMG, ANS]
    tokens[bi:, 0] = IMG
    tokens[:, 3] = first  # teacher forcing
    targets[:, 2], targets[:, 3] = first, second
    return Batch(images, clips, tokens, targets)


def random_clips(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n directions (0 left, 1 right) and start columns that keep the digit on the canvas."""
    travel = T.STEP * (T.FRAMES - 1)
    directions = rng.integers(0, 2, n)
    free = T.CANVAS - T.SIDE - travel  # the start's range for either direction
    starts = rng.integers(0, free + 1, n) + np.where(directions == 0, travel, 0)
    return directions, starts


def batch(seed: int, step: int, n_img: int, n_clip: int) -> Batch:
    """Training batch `step`: digits drawn from the training split by a generator seeded with
    (seed, step), so a fresh process draws the same batches without storing them."""
    rng = np.random.default_rng((seed, step))
    train, _ = T.split()
    idx = rng.choice(train, n_img + n_clip)
    return examples(idx[:n_img], idx[n_img:], *random_clips(rng, n_clip))


def held_out(seed: int) -> Batch:
    """Every held-out digit as an image and as a clip (a seeded direction and start)."""
    _, test = T.split()
    return examples(test, test, *random_clips(np.random.default_rng((seed, 0)), len(test)))


# -- forward with a tape, and backward along it ------------------------------------------------
def _embed_frames(ops: Any, p: dict, b: Batch, cfg: Config) -> tuple[list, np.ndarray]:
    """(the frames in packing order, x [N, width]): patches + the resized table, and for a
    clip's frame t the time embedding of t (times cfg.time_gain)."""
    frames = [*b.images, *b.clips.reshape(-1, T.SIDE, T.CANVAS, 3)]
    gc = math.prod(CLIP_GRID)
    pos_i = np.tile(ops.grid(p["v.table"], *IMAGE_GRID), (len(b.images), 1))
    per_clip = np.tile(ops.grid(p["v.table"], *CLIP_GRID), (T.FRAMES, 1))
    if len(b.clips):
        time = ops.time(T.FRAMES, cfg.width) * cfg.time_gain
        per_clip = ops.add(per_clip, np.repeat(time, gc, axis=0))
    pos_c = np.tile(per_clip, (len(b.clips), 1))
    return frames, ops.add(ops.patch(frames, p["v.patch"]), np.concatenate([pos_i, pos_c]))


def _layout(b: Batch) -> dict:
    """Segment starts, patch positions and the text slots of the vision tokens."""
    bi, bc = len(b.images), len(b.clips)
    gi, gc = math.prod(IMAGE_GRID), math.prod(CLIP_GRID) * T.FRAMES
    cu = np.concatenate([np.arange(bi) * gi, bi * gi + np.arange(bc + 1) * gc]).astype(np.int64)
    xi, yi = B.grid_positions(*IMAGE_GRID)
    xc, yc = B.grid_positions(*CLIP_GRID, T.FRAMES)
    pos = (np.concatenate([np.tile(xi, bi), np.tile(xc, bc)]).astype(np.int64),
           np.concatenate([np.tile(yi, bi), np.tile(yc, bc)]).astype(np.int64))  # fmt: skip
    clip_slots = ((bi + np.arange(bc)) * LENGTH)[:, None] + np.arange(2)  # both its tokens
    slots = np.concatenate([np.arange(bi) * LENGTH + 1, clip_slots.ravel()])
    return {"cu": cu, "pos": pos, "slots": slots.astype(np.int64)}


def _merges(b: Batch) -> list[tuple[slice, slice, int, int, tuple[int, int]]]:
    """The merger's calls: (patch rows, merged rows, frames, frames per chunk, grid) for the
    images (each its own chunk of one frame) and for the clips (one chunk of 4 frames each)."""
    bi, bc, r = len(b.images), len(b.clips), len(b.images) * math.prod(IMAGE_GRID)
    parts = [(slice(0, r), slice(0, bi), bi, 1, IMAGE_GRID),
             (slice(r, None), slice(bi, None), T.FRAMES * bc, T.FRAMES, CLIP_GRID)]  # fmt: skip
    return [part for part in parts if part[2]]


def tower(ops: Any, p: dict, cfg: Config, b: Batch) -> tuple[np.ndarray, dict]:
    """The vision tokens [Bi + 2 Bc, d] of a batch (images first, then each clip's two), and
    the tower's tape."""
    lay = _layout(b)
    frames, x = _embed_frames(ops, p, b, cfg)
    stages = []
    for i in range(cfg.depth):
        x, s = ops.block(x, lay["pos"], lay["cu"], sub(p, f"v.{i}."), cfg.heads)
        stages.append(s)
    merged = np.concatenate([ops.merge(x[rows], f, c, *g) for rows, _, f, c, g in _merges(b)])
    v, s_proj = ops.project(merged, sub(p, "v.proj."))
    return v, {"frames": frames, "layout": lay, "blocks": stages, "proj": s_proj, "v": v}


def tower_back(ops: Any, p: dict, cfg: Config, b: Batch, tape: dict,
               dv: np.ndarray) -> dict[str, np.ndarray]:  # fmt: skip
    """The tower's weight gradients from dv = dL/d(vision tokens)."""
    grads: dict[str, np.ndarray] = {}
    lay = tape["layout"]
    dm, g = ops.project_back(dv, tape["proj"], sub(p, "v.proj."))
    grads.update({f"v.proj.{k}": w for k, w in g.items()})
    dx = np.concatenate([ops.merge_back(dm[m], f, c, *g, cfg.width)
                         for _, m, f, c, g in _merges(b)])  # fmt: skip
    for i in reversed(range(cfg.depth)):
        dx, g = ops.block_back(dx, tape["blocks"][i], lay["pos"], lay["cu"],
                               sub(p, f"v.{i}."), cfg.heads)  # fmt: skip
        grads.update({f"v.{i}.{k}": w for k, w in g.items()})
    grads["v.patch"] = ops.patch_back(tape["frames"], dx)
    return grads


def forward(ops: Any, p: dict, cfg: Config, b: Batch, grad: bool = True,
            tokens: np.ndarray | None = None) -> dict:  # fmt: skip
    """The whole model on a batch: the decoder's record (tasks/seq) with the tower's tape.
    `tokens` replaces the batch's text (greedy decoding feeds predictions back)."""
    prefix, tape = image_rows(ops, p, cfg, b)
    text = b.tokens if tokens is None else tokens
    rec = S.forward(ops, p, cfg.text, text, b.targets, grad, prefix=prefix)
    rec["tower"] = tape
    return rec


def image_rows(ops: Any, p: dict, cfg: Config, b: Batch) -> tuple[np.ndarray, dict]:
    """The decoder's additive input [B LENGTH, d]: the vision tokens at their slots, 0 elsewhere
    (and the tower's tape)."""
    v, tape = tower(ops, p, cfg, b)
    prefix = ops.zeros((len(b.tokens) * LENGTH, cfg.text.d))
    prefix[tape["layout"]["slots"]] = v
    return prefix, tape


def backward(ops: Any, p: dict, cfg: Config, b: Batch, rec: dict) -> dict[str, np.ndarray]:
    grads = S.backward(ops, p, cfg.text, rec)
    dv = np.ascontiguousarray(grads.pop("x0")[rec["tower"]["layout"]["slots"]])
    grads.update(tower_back(ops, p, cfg, b, rec["tower"], dv))
    return grads


# -- evaluation and training -------------------------------------------------------------------
def evaluate(ops: Any, p: dict, cfg: Config, b: Batch) -> dict:
    """Held-out loss (bits per scored token, teacher-forced) and the greedy answers: the first
    word at <ans>, then, with that word fed back, the second."""
    prefix, _tape = image_rows(ops, p, cfg, b)
    rec = S.forward(ops, p, cfg.text, b.tokens, b.targets, False, prefix=prefix)
    first = S.predictions(ops, p, rec).reshape(-1, 2)[:, 0]
    fed = b.tokens.copy()
    fed[:, 3] = first  # what the model said
    again = S.forward(ops, p, cfg.text, fed, b.targets, False, prefix=prefix)
    second = S.predictions(ops, p, again).reshape(-1, 2)[:, 1]
    bi = len(b.images)
    want = b.targets[:, 2:]
    return {
        "bits": rec["loss"] / rec["want"].size / math.log(2),
        "digit_images": float(np.mean(first[:bi] == want[:bi, 0])),
        "digit_clips": float(np.mean(second[bi:] == want[bi:, 1])),
        "direction": float(np.mean(first[bi:] == want[bi:, 0])),
        "end": float(np.mean(second[:bi] == END)),
        "first": first,
        "second": second,
    }


def run(ops: Any, p: dict, cfg: Config, steps: int, h: dict, eval_every: int, *, seed: int,
        per_step: tuple[int, int], fixed: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Train `steps` steps on `batch(seed, t, *per_step)`; evaluate on `held_out(seed)` at step
    0, every `eval_every` steps and at the end."""
    h = {**h, "steps": steps}
    state = init_state(ops, p, cfg, fixed)
    test = held_out(seed)
    keys = ("bits", "digit_images", "digit_clips", "direction", "end")
    out: dict = {"eval_steps": [], "train": [], **{k: [] for k in keys}}

    def log(t: int) -> dict:
        ev = evaluate(ops, p, cfg, test)
        out["eval_steps"].append(t)
        for k in keys:
            out[k].append(ev[k])
        return ev

    ev = log(0)
    for t in range(1, steps + 1):
        out["train"].append(train_step(ops, p, cfg, batch(seed, t, *per_step), t, h, state))
        if t % eval_every == 0 or t == steps:
            ev = log(t)
    out["answers"] = (ev["first"], ev["second"])
    out["params"] = p
    return out


def init_state(ops: Any, p: dict, cfg: Config, fixed: tuple[str, ...]) -> dict:
    """Each weight's optimiser spec and state: {name: (spec, state)}."""
    specs = param_specs(cfg, fixed)
    return {n: (spec, ops.init_state(spec, p[n])) for n, spec in specs.items()}


def train_step(ops: Any, p: dict, cfg: Config, b: Batch, t: int, h: dict, state: dict) -> float:
    """Step t on batch b: forward, backward, and every trained weight's optimiser step (p and
    state are updated in place). Returns the batch's loss in bits per answer token."""
    rec = forward(ops, p, cfg, b)
    grads = backward(ops, p, cfg, b, rec)
    lr = ops.lr(t, h)
    for name, (spec, st) in state.items():
        if spec[0] != "fixed":
            p[name], new = ops.step(spec, p[name], st, grads[name], lr, t, h)
            state[name] = (spec, new)
    return rec["loss"] / rec["want"].size / math.log(2)


def result_arrays(out: dict) -> tuple:
    """What a rerun must reproduce bit for bit: the held-out curve and every final weight."""
    return (np.array(out["bits"], dtype=np.float64),
            *[out["params"][n] for n in sorted(out["params"])])  # fmt: skip


def word(token: int) -> str:
    """A token as text: a digit's name, a direction, else its id in angle brackets."""
    if 0 <= token < len(T.WORDS):
        return T.WORDS[token]
    return T.DIRECTIONS[token - LEFT] if token in (LEFT, RIGHT) else f"<{token}>"


def text(first: int, second: int) -> str:
    """A two-word answer as text; <end> ends it after the first word."""
    return word(first) if second == END else f"{word(first)} {word(second)}"


# -- the recipe the gate trains ------------------------------------------------------------------
CONFIG = Config()
FIXED = ("0.attn.w_f",)  # KDA's decay projection stays at its init (tasks/mqar/task.py: why)
# lr 2e-3, not 3e-3: measured float64 against float64 (initial weights x (1 + 1e-6)), the run at
# 3e-3 parts by 29% at step 150 (the direction is learnt late, in a jump); at 2e-3 the gap grows
# half as fast (training losses 1e-2 apart at step 145 instead of 67) and stays within 1.1% at
# the gate's evaluations, though still 3.8% at step 250 between them. Lower rates contract fully
# but end near 0.33 bits with clip digits at 91-95%.
HYPER = {"lr": 2e-3, "lr_min": 0.0, "warmup": 10, "mu": 0.95, "wd": 0.0}
PER_STEP = (16, 16)  # images and clips per training step
STEPS = 300
EVAL_EVERY = 100


def train_int(steps: int, seed: int, eval_every: int, h: dict) -> tuple:
    """The integer run as one call, for the rerun in a fresh process (k3gates.infra.fresh)."""
    out = run(IntOps(kcompile.load), init(CONFIG, seed), CONFIG, steps, h, eval_every, seed=seed,
              per_step=PER_STEP, fixed=FIXED)  # fmt: skip
    return result_arrays(out)
