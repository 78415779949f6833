"""The vision-language task of issue 16's PROVEN rung: real handwritten digits, shown as RGB
images and as 4-frame clips of a digit moving left or right, answered with text.

    image: 28 x 28 RGB of one digit                  ->  "seven"
    clip:  4 frames of 28 x 56, the digit moving      ->  "seven left"

The digits are the 1797 8 x 8 images scikit-learn ships (data/PROVENANCE.md), each pixel a count
0..16 of ink in a 4 x 4 block. An image is drawn by nearest-neighbour upsampling to 28 x 28 (row
i reads source row floor(8 i / 28)) and mixing a background and an ink colour in proportion
v / 16, rounded half up, in integers. A clip draws the same digit on a 28 x 56 canvas at a
column that moves by STEP pixels per frame, left or right; the pooled merge averages a chunk's
frames, so the direction is only there if the tower reads it before the merge.

The split is by a seeded permutation: HELD_OUT images never trained on. The dataset has no
writer ids, so held-out images may share writers with training ones (scikit-learn's copy is the
UCI test set: 13 writers).
"""

from __future__ import annotations

import gzip
import hashlib
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "digits.csv.gz"
SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIRECTIONS = ("left", "right")
SIDE = 28  # image side in pixels: two 14 x 14 patches, one merged token
CANVAS = 56  # a clip's width: the digit has room to move
FRAMES = 4  # one chunk: the merge pools exactly these
STEP = 9  # pixels per frame a clip's digit moves: from one edge of the canvas to the other
HELD_OUT = 297  # of 1797: 1500 to train on
SPLIT_SEED = 16


@cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [1797, 8, 8] with values 0..16, labels int64 [1797]), from the committed
    file, refused unless its sha256 is the recorded one."""
    raw = DATA.read_bytes()
    got = hashlib.sha256(raw).hexdigest()
    if got != SHA256:
        raise ValueError(f"{DATA}: sha256 {got}, expected {SHA256} (see data/PROVENANCE.md)")
    rows = np.loadtxt(gzip.decompress(raw).decode("ascii").splitlines(), delimiter=",",
                      dtype=np.int64)  # fmt: skip
    if rows.shape != (1797, 65) or rows[:, :64].min() < 0 or rows[:, :64].max() > 16:
        raise ValueError(f"{DATA}: expected 1797 rows of 64 pixels 0..16 and a label")
    return rows[:, :64].reshape(-1, 8, 8).astype(np.uint8), rows[:, 64]


def split() -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): a seeded permutation, HELD_OUT held out."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(digits()[1]))
    return np.sort(order[HELD_OUT:]), np.sort(order[:HELD_OUT])


def _upsample(img8: np.ndarray) -> np.ndarray:
    """8 x 8 -> 28 x 28, nearest neighbour: pixel (i, j) reads (8 i // 28, 8 j // 28)."""
    idx = np.arange(SIDE) * 8 // SIDE
    return img8[np.ix_(idx, idx)]


def _paint(v: np.ndarray, ink: tuple[int, int, int], paper: tuple[int, int, int]) -> np.ndarray:
    """Ink amounts v (0..16) -> uint8 RGB: paper + (ink - paper) v / 16, rounded half up."""
    ink_a, paper_a = np.array(ink, np.int64), np.array(paper, np.int64)
    num = paper_a * 16 + (ink_a - paper_a) * v[..., None].astype(np.int64)
    return ((2 * num + 16) // 32).astype(np.uint8)


def render(img8: np.ndarray, ink: tuple[int, int, int] = (20, 20, 20),
           paper: tuple[int, int, int] = (250, 250, 250)) -> np.ndarray:  # fmt: skip
    """One digit as a 28 x 28 x 3 uint8 image."""
    return _paint(_upsample(img8), ink, paper)


def clip(img8: np.ndarray, direction: str, start: int, ink: tuple[int, int, int] = (20, 20, 20),
         paper: tuple[int, int, int] = (250, 250, 250)) -> np.ndarray:  # fmt: skip
    """FRAMES frames of 28 x 56 (uint8 [4, 28, 56, 3]): the digit's left edge at `start`, then
    STEP pixels further right or left each frame; it must stay on the canvas."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    sign = 1 if direction == "right" else -1
    cols = [start + sign * STEP * f for f in range(FRAMES)]
    if min(cols) < 0 or max(cols) + SIDE > CANVAS:
        raise ValueError(f"start {start}: the digit leaves the {CANVAS}-pixel canvas")
    v = np.zeros((FRAMES, SIDE, CANVAS), dtype=np.int64)
    for f, c in enumerate(cols):
        v[f, :, c : c + SIDE] = _upsample(img8)
    return _paint(v, ink, paper)


def answer(label: int, direction: str | None = None) -> str:
    """The target text: the digit's name, and for a clip the direction."""
    return WORDS[label] if direction is None else f"{WORDS[label]} {direction}"
