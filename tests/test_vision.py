"""The vision library face (k3gates.vision): float in, float out, the kernels' exact values, and
a clear error for bad input. The gate (vision_input) holds the kernels to float64 at K3's width;
these tests hold the face's conversions at small sizes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from k3gates import vision as V
from k3gates.vision import reference as ref

RNG = np.random.default_rng(7)
U8 = np.zeros((28, 28, 3), np.uint8)
W = np.zeros((4, 588))


def test_patch_embed_is_the_convolution_within_half_an_lsb():
    pixels = RNG.integers(0, 256, (28, 42, 3), dtype=np.uint8)
    w = RNG.normal(0, 0.05, (8, 588))
    got = V.patch_embed(pixels, w)
    wq = np.round(w * 2**20) / 2**20
    assert got.shape == (6, 8)
    assert np.abs(got - ref.patch_embed(pixels, wq)).max() <= 0.5 * 2**-16
    # an all-zero embedding would be far outside that bound
    assert np.abs(ref.patch_embed(pixels, wq)).max() > 100 * 2**-16


def test_position_embedding_resizes_to_any_grid_and_keeps_its_own():
    table = RNG.normal(0, 1, (64, 64, 3))
    tq = np.round(table * 2**16) / 2**16
    assert np.array_equal(V.position_embedding(table, 64, 64).reshape(64, 64, 3), tq)
    for h, w in ((5, 7), (97, 130), (1, 1)):
        got = V.position_embedding(table, h, w)
        assert np.abs(got - ref.resize_bilinear(tq, h, w)).max() <= 513 / 1024 * 2**-16


def test_time_embedding_and_rope2d_against_float64():
    e = V.time_embedding(4, 16)
    assert np.abs(e - ref.time_embed(4, 16)).max() <= 513 / 1024 * 2**-16
    assert np.array_equal(e[0], np.r_[np.zeros(8), np.ones(8)])
    x = RNG.normal(0, 1, (5, 128))
    px, py = np.array([0, 3, 70, 511, 9]), np.array([0, 200, 1, 511, 9])
    got = V.rope2d(x, px, py)
    xq = np.round(x * 2**20) / 2**20
    assert np.abs(got - ref.rope2d(xq, px, py)).max() <= 2 * 2**-20
    assert np.array_equal(got[0], xq[0])  # column 0, row 0: no turn at all


@pytest.mark.parametrize(
    ("h", "w", "frames", "tokens"),
    [(448, 448, 1, 256), (896, 896, 1, 1024), (1080, 1920, 1, 39 * 69), (448, 448, 5, 512),
     (28, 28, 4, 1), (29, 28, 1, 2), (1, 1, 1, 1), (100, 57, 1, 12), (30, 44, 3, 4),
     (14, 14, 9, 3), (322, 210, 1, 96)],
)  # fmt: skip
def test_token_count_is_one_token_per_28_pixels_per_chunk_padded_up(h, w, frames, tokens):
    """Sides that are not multiples of 28 are padded up (to 14 for the patches, to 2 patches for
    the merge), never cropped: the formula ceil(F/4) ceil(ceil(H/14)/2) ceil(ceil(W/14)/2)."""
    up = lambda a, b: -(-a // b)
    assert (
        V.token_count(h, w, frames) == tokens == up(frames, 4) * up(up(h, 14), 2) * up(up(w, 14), 2)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: V.token_count(7169, 14), "at most 512 patches per side"),
        (lambda: V.token_count(0, 14), "expected positive sizes"),
        (lambda: V.patch_embed(np.zeros((28, 28, 3)), W), "pixels: expected uint8"),
        (lambda: V.patch_embed(U8[:20], W), "multiples of 14"),
        (lambda: V.patch_embed(U8, W[:, :5]), "w: expected [D, 588]"),
        (lambda: V.patch_embed(U8, W + np.nan), "w: expected finite"),
        (lambda: V.position_embedding(np.zeros((32, 32, 2)), 4, 4), "table: expected [64, 64, D]"),
        (lambda: V.position_embedding(np.zeros((64, 64, 2)), 513, 4), "1 <= h, w <= 512"),
        (lambda: V.time_embedding(5, 8), "frames <= 4"),
        (lambda: V.rope2d(np.zeros((2, 64)), [0, 1], [0, 1]), "x: expected [N, 128]"),
        (lambda: V.rope2d(np.zeros((2, 128)), [0, 512], [0, 1]), "pos_x: expected positions"),
        (lambda: V.rope2d(np.zeros((2, 128)), [0.5, 1], [0, 1]), "pos_x: expected 2 integer"),
    ],
)  # fmt: skip
def test_bad_input_gets_an_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# -- the block's kernels (k3gates.vision.kernels_block) and its stages (k3gates.vision.block) ----
def _block_kernels():
    from k3gates.infra import compile as kcompile
    from k3gates.vision import block as B

    return B, B.Kernels(kcompile.load)


def test_gelu_kernel_against_float64_and_its_limits():
    _, k = _block_kernels()
    x = np.concatenate([np.arange(-12 << 16, 12 << 16, 977), [0, 1, -1, 1 << 40, -(1 << 40)]])
    got = k.block.gelu(x.reshape(1, -1))[0]
    want = ref.gelu(x / 2**16) * 2**16
    assert np.abs(got - want).max() <= 513 / 1024
    assert got[-5] == 0 and got[-2] == 1 << 40 and got[-1] == 0  # GELU(0) = 0, x and 0 far out


def test_merge_means_the_frames_of_each_chunk_and_pads_an_odd_grid():
    _, k = _block_kernels()
    x = RNG.integers(-(1 << 30), 1 << 30, (5 * 3 * 5, 6))  # 5 frames of a 3 x 5 grid
    got = k.block.merge(x, 5, 4, 3, 5)  # chunks of 4 and 1 frames
    assert got.shape == (2 * 2 * 3, 24)
    assert np.abs(got - ref.merge(x.astype(np.float64), 5, 4, 3, 5)).max() <= 0.5
    assert not got[3:6, 12:].any()  # the padded bottom row of the first chunk's grid is zero


def test_packed_images_attend_only_to_themselves():
    """Two packed images give each image's lone output bit for bit, and changing the second
    image's tokens changes none of the first image's bits."""
    B, k = _block_kernels()
    rng = np.random.default_rng(3)
    w = B.init_block(rng, width=256, heads=2, head_dim=128, mlp=512)
    xa, xb = (np.round(rng.normal(0, 1, (n, 256)) * 2**16).astype(np.int64) for n in (12, 6))
    pa, pb = B.grid_positions(3, 4), B.grid_positions(2, 3)
    pos = [np.concatenate(p) for p in zip(pa, pb, strict=True)]
    cu = np.array([0, 12, 18])
    packed = B.forward(k, np.vstack([xa, xb]), pos, cu, w, heads=2)["x2"]
    alone_a = B.forward(k, xa, pa, np.array([0, 12]), w, heads=2)["x2"]
    alone_b = B.forward(k, xb, pb, np.array([0, 6]), w, heads=2)["x2"]
    assert np.array_equal(packed, np.vstack([alone_a, alone_b]))
    other = B.forward(k, np.vstack([xa, -xb]), pos, cu, w, heads=2)["x2"]
    assert np.array_equal(other[:12], packed[:12]) and not np.array_equal(other[12:], packed[12:])
    # one segment for all 18 tokens: the first image now sees the second, and its output moves
    joined = B.forward(k, np.vstack([xa, xb]), pos, np.array([0, 18]), w, heads=2)["x2"]
    assert not np.array_equal(joined[:12], packed[:12])


def test_a_rope_input_outside_its_domain_stops_the_block_instead_of_wrapping():
    """q beyond 2^26 raw (Q.16) is beyond rope_rotate's 2^30 in Q.20; the int32 cast would wrap
    it silently, so the block raises before the cast."""
    _, k = _block_kernels()
    zero = np.zeros(2, dtype=np.int64)
    with pytest.raises(OverflowError, match="outside rope_rotate's domain"):
        k.rope(np.full((2, 256), 1 << 27, dtype=np.int64), zero, zero, 2)


# -- the encoder face: pixels in, merged tokens in the text model's width out ---------------------
def _encoder_weights(rng: np.random.Generator, d: int = 128, text: int = 64) -> dict:
    from k3gates.vision import block as B

    blocks = [{n: v / 2**20 for n, v in B.init_block(rng, d, 1, 128, 2 * d).items()}
              for _ in range(2)]  # fmt: skip
    proj = {n: v / 2**20 for n, v in B.init_projector(rng, 4 * d, text).items()}
    return {"patch": np.round(rng.normal(0, 0.05, (d, 588)) * 2**20) / 2**20,
            "table": np.round(rng.normal(0, 0.5, (64, 64, d)) * 2**16) / 2**16,
            "blocks": blocks, "projector": proj}  # fmt: skip


def _encode_float(pixels: np.ndarray, wts: dict) -> np.ndarray:
    """The same encoder in float64, written here: pad with 128 to multiples of 14, embed, add
    the resized table (and each frame's time embedding for a clip), the blocks with attention
    inside each chunk of 4 frames, the merger and the projector."""
    from k3gates.vision import reference_grad as rg

    clip = pixels if pixels.ndim == 4 else pixels[None]
    f, h, w = clip.shape[:3]
    gh, gw = -(-h // 14), -(-w // 14)
    padded = np.full((f, gh * 14, gw * 14, 3), 128.0)
    padded[:, :h, :w] = clip
    d = wts["patch"].shape[0]
    pos = ref.resize_bilinear(wts["table"], gh, gw)
    t = ref.time_embed(min(f, 4), d) if f > 1 else np.zeros((4, d))
    x = np.vstack([ref.patch_embed(padded[i].astype(np.uint8), wts["patch"]) + pos + t[i % 4]
                   for i in range(f)])  # fmt: skip
    cols, rows = np.indices((gh, gw))[::-1]
    px, py = np.tile(cols.ravel(), f), np.tile(rows.ravel(), f)
    cu = np.append(np.arange(0, f, 4), f) * gh * gw
    for blk in wts["blocks"]:
        x = rg.block_forward(x, px, py, cu, blk, blk["wq"].shape[0] // 128)["x2"]
    return rg.projector_forward(ref.merge(x, f, 4, gh, gw), wts["projector"])["out"]


@pytest.mark.parametrize("shape", [(30, 44, 3), (4, 28, 42, 3)])
def test_encode_is_the_float64_encoder_within_a_thousandth(shape):
    """An odd-sized image (padded up) and a 4-frame clip at width 128 with two blocks: the
    integer encoder within 1e-3 of float64 (relative to its largest output)."""
    rng = np.random.default_rng(11)
    wts = _encoder_weights(rng)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    got = V.encode(pixels, wts)
    want = _encode_float(pixels, wts)
    assert got.shape == want.shape == (V.token_count(*shape[-3:-1], 1 if len(shape) == 3
                                                      else shape[0]), 64)  # fmt: skip
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert np.abs(want).max() > 0.5  # the outputs are RMS-normed: zero would fail


def test_encode_refuses_bad_input_naming_it():
    wts = _encoder_weights(np.random.default_rng(1))
    with pytest.raises(ValueError, match=re.escape("pixels: expected uint8")):
        V.encode(np.zeros((28, 28, 3)), wts)
    with pytest.raises(ValueError, match=re.escape("weights['patch']: expected [D, 588]")):
        V.encode(U8, wts | {"patch": np.zeros((100, 588))})
    bad = [dict(wts["blocks"][0], w1=np.zeros((3, 3)))]
    with pytest.raises(ValueError, match=re.escape("weights['blocks'][0]['w1']: expected")):
        V.encode(U8, wts | {"blocks": bad})
    with pytest.raises(ValueError, match=re.escape("weights['projector']: expected a dict")):
        V.encode(U8, wts | {"projector": None})
