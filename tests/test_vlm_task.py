"""The vision-language task's data (k3gates.tasks.vlm.task): the committed digits, checked by hash;
the split; the rendering of images and clips; the target text."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.tasks.vlm import task as T


def test_the_digits_are_the_recorded_file_with_its_classes():
    images, labels = T.digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_a_changed_data_file_is_refused_naming_it(tmp_path, monkeypatch):
    bad = tmp_path / "digits.csv.gz"
    raw = bytearray(T.DATA.read_bytes())
    raw[100] ^= 1
    bad.write_bytes(bytes(raw))
    monkeypatch.setattr(T, "DATA", bad)
    T.digits.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"digits\.csv\.gz: sha256 .* expected 09f66e6d"):
            T.digits()
    finally:
        monkeypatch.undo()
        T.digits.cache_clear()


def test_the_split_is_disjoint_and_covers_every_image():
    train, held = T.split()
    assert len(train) == 1500 and len(held) == T.HELD_OUT
    assert not set(train) & set(held) and len(set(train) | set(held)) == 1797
    assert np.array_equal(T.split()[1], held)  # seeded: the same every time


def test_an_image_is_the_digit_upsampled_and_painted():
    images, _ = T.digits()
    img = T.render(images[0], ink=(200, 0, 40), paper=(250, 250, 250))
    assert img.shape == (28, 28, 3) and img.dtype == np.uint8
    for i, j in ((0, 0), (10, 13), (27, 27), (14, 3)):
        v = int(images[0][8 * i // 28, 8 * j // 28])
        ink, paper = (200, 0, 40), (250, 250, 250)
        want = [(2 * (p * 16 + (q - p) * v) + 16) // 32 for q, p in zip(ink, paper, strict=True)]
        assert img[i, j].tolist() == want
    zero, full = np.zeros((8, 8), np.uint8), np.full((8, 8), 16, np.uint8)
    assert (T.render(zero) == 250).all() and (T.render(full) == 20).all()


@pytest.mark.parametrize(
    ("direction", "sign", "start"), [("left", -1, 28), ("right", 1, 0), ("right", 1, 1)]
)
def test_a_clip_moves_the_digit_step_pixels_a_frame(direction, sign, start):
    images, _ = T.digits()
    frames = T.clip(images[7], direction, start)
    assert frames.shape == (4, 28, 56, 3) and frames.dtype == np.uint8
    ink = 250 - frames[..., 0].astype(np.int64)  # ink amount per pixel
    centre = [(ink[f].sum(axis=0) * np.arange(56)).sum() / ink[f].sum() for f in range(4)]
    assert np.allclose(np.diff(centre), sign * T.STEP)
    for f in range(4):  # each frame is the still image at its column
        c = start + sign * T.STEP * f
        assert np.array_equal(frames[f][:, c : c + 28], T.render(images[7]))


def test_a_clip_that_leaves_the_canvas_or_a_bad_direction_is_refused():
    images, _ = T.digits()
    with pytest.raises(ValueError, match="leaves the 56-pixel canvas"):
        T.clip(images[0], "left", 10)
    with pytest.raises(ValueError, match="direction: expected one of"):
        T.clip(images[0], "up", 20)


def test_the_answers_are_words():
    assert T.answer(7) == "seven" and T.answer(0, "left") == "zero left"
