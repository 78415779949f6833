"""Issue 16, PROVEN: the tiny vision-language model (k3gates/tasks/vlm/model.py) and its gate.

The model's float64 twin is what the integer model is held to, so its gradient is held to central
finite differences here; the layout that places the vision tokens in the text is checked by hand;
the integer model is held to the twin at the initial weights; and the gate's held-out
accuracies are read from the build's evidence."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import BuildRun, build_module, check, gate_row

from k3gates.tasks.vlm import gate as G
from k3gates.tasks.vlm import model as M
from k3gates.tasks.vlm import task as T


def _tiny_batch() -> M.Batch:
    """Two images and one clip, a right-moving 7."""
    return M.examples(np.array([0, 1]), np.array([7]), np.array([1]), np.array([0]))


def test_the_text_and_the_vision_slots_are_laid_out_as_documented():
    b = _tiny_batch()
    labels = T.digits()[1]
    assert b.tokens.tolist() == [[M.PAD, M.IMG, M.ANS, labels[0]], [M.PAD, M.IMG, M.ANS, labels[1]],
                                 [M.IMG, M.IMG, M.ANS, M.RIGHT]]  # fmt: skip
    assert b.targets.tolist() == [[-1, -1, labels[0], M.END], [-1, -1, labels[1], M.END],
                                  [-1, -1, M.RIGHT, labels[7]]]  # fmt: skip
    lay = M._layout(b)
    # an image is 2 x 2 patches (one merged token), a clip 4 frames of 2 x 4 (two tokens)
    assert lay["cu"].tolist() == [0, 4, 8, 40]
    assert lay["slots"].tolist() == [1, 5, 8, 9]
    assert lay["pos"][0][8:16].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # columns of a clip frame
    assert lay["pos"][1][8:16].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_answer_text_reads_the_greedy_tokens():
    assert M.text(7, M.END) == "seven"
    assert M.text(M.LEFT, 3) == "left three"
    assert M.text(M.PAD, M.IMG) == f"<{M.PAD}> <{M.IMG}>"


def test_float64_twin_gradient_equals_central_differences():
    """dL/dw of the float model (decoder, projector, block and patch embedding, through the
    vision slots and the merger) against (L(w + h) - L(w - h)) / 2h on sampled weights."""
    cfg = M.CONFIG
    p = M.twin_params(M.init(cfg, 3))
    b = _tiny_batch()
    ops = M.FloatOps()
    grads = M.backward(ops, p, cfg, b, M.forward(ops, p, cfg, b))
    rng = np.random.default_rng(0)
    for name in ("v.patch", "v.0.wq", "v.0.w1", "v.proj.p1", "v.proj.gp", "emb", "1.attn.w_dq"):
        for _ in range(3):
            i = tuple(rng.integers(0, n) for n in p[name].shape)
            h = 1e-5
            plus = {**p, name: p[name].copy()}
            plus[name][i] += h
            minus = {**p, name: p[name].copy()}
            minus[name][i] -= h
            fd = (M.forward(ops, plus, cfg, b, False)["loss"]
                  - M.forward(ops, minus, cfg, b, False)["loss"]) / (2 * h)  # fmt: skip
            assert abs(grads[name][i] - fd) <= 1e-6 + 1e-5 * abs(fd), (name, i, grads[name][i], fd)


def test_integer_model_matches_its_twin_at_the_initial_weights():
    """The gate's two first checks, on a small batch: vision tokens within 2^-10 and every
    gradient within 2^-8 of its largest float64 element; an all-zero answer would fail both."""
    cfg = M.CONFIG
    p = M.init(cfg, 1)
    pf = M.twin_params(p)
    b = _tiny_batch()
    io, fo = M.IntOps(), M.FloatOps()
    ri, rf = M.forward(io, p, cfg, b), M.forward(fo, pf, cfg, b)
    vi, vf = ri["tower"]["v"] * 2.0**-M.ACT_FRAC, rf["tower"]["v"]
    assert np.abs(vi - vf).max() <= G.TOWER_BOUND < np.abs(vf).max()
    gi, gf = M.backward(io, p, cfg, b, ri), M.backward(fo, pf, cfg, b, rf)
    assert set(gi) == set(gf) == {k for k, s in M.param_specs(cfg, M.FIXED).items()
                                  if s[0] != "fixed"} | {"0.attn.w_f"}  # fmt: skip
    for k in gf:
        scale = np.abs(gf[k]).max()
        assert np.abs(gi[k] * 2.0**-M.GRAD_FRAC - gf[k]).max() <= G.GRAD_BOUND * scale, k


def test_training_batches_are_reproducible_and_held_out_digits_never_train():
    a, b = M.batch(1, 5, 4, 4), M.batch(1, 5, 4, 4)
    assert np.array_equal(a.clips, b.clips) and np.array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.images, M.batch(1, 6, 4, 4).images)
    train, test = T.split()
    assert not set(train) & set(test)
    held = M.held_out(1)
    assert len(held.images) == len(held.clips) == len(test)


def test_pixel_runs_draw_each_block_of_equal_pixels_once():
    build = build_module()
    rows = ["ffffff" * 3 + "000000", "ffffff" * 3 + "000000", "123456" + "ffffff" * 3]
    assert build.pixel_runs(rows) == [(0, 0, 3, 2, "#ffffff"), (3, 0, 1, 2, "#000000"),
                                      (0, 2, 1, 1, "#123456"), (1, 2, 3, 1, "#ffffff")]  # fmt: skip


def test_gate_evidence_reports_the_held_out_accuracies(built_site: BuildRun):
    row = gate_row(built_site, "vlm_training")
    found = {}
    for name, minimum in (("digit_images", G.DIGIT_MIN), ("digit_clips", G.DIGIT_MIN),
                          ("direction_clips", G.DIRECTION_MIN)):  # fmt: skip
        c = check(row, name)
        acc = c["values"]["accuracy"]
        assert c["passed"] == (acc >= minimum) and c["values"]["minimum"] == minimum
        assert c["values"]["examples"] == len(T.split()[1])
        found[name] = acc
    sentence = row["summary"]
    numbers = [float(x) / 100 for x in re.findall(r"([\d.]+)% of", sentence)]
    assert numbers[:3] == pytest.approx(list(found.values()), abs=6e-4), sentence
    html = (built_site.out / "innovations" / "multimodal" / "index.html").read_text()
    assert html.count('<div class="picture">') == G.SHOWN + 2
    assert "answer:" in html
