"""SiTU kernels: compiled == interpreted, the integer trainer's determinism, and the gate data."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal
from k3gates.situ import gate as situ_gate
from k3gates.situ.kernels import SITU_BETA, SITU_BETA_LIN, SITU_FRAC

SITU = "k3gates.situ.kernels"
F = 24


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(SITU), kc.interpreted(SITU)


@pytest.fixture(scope="module")
def tiny() -> dict[str, np.ndarray]:
    d = situ_gate.regression_data(situ_gate.SEED)
    return {"x": d["x"][:12].copy(), "y": d["y"][:12].copy(), "w1": d["w1"][:3].copy(),
            "w3": d["w3"][:3].copy(), "w2": d["w2"][:3].copy()}  # fmt: skip


def train(k, d: dict, order: np.ndarray, steps: int = 3, lr_shift: int = 6) -> tuple:
    return k.train_mlp(d["x"], d["y"], d["w1"], d["w3"], d["w2"], steps, 1, lr_shift, order)


def test_forward_and_backward_compiled_equal_interpreted_on_negatives(kernels):
    compiled, interpreted = kernels
    rng = np.random.default_rng(0)
    g = np.concatenate([-np.abs(rng.integers(0, 80 << F, 200)), [-(2**62), 2**62, 0]])
    u = np.concatenate([-np.abs(rng.integers(0, 900 << F, 200)), [2**62, -(2**62), 0]])
    d = -np.abs(rng.integers(0, 512 << F, g.size))
    args = (g, u, F, SITU_BETA, SITU_BETA_LIN)
    assert bit_equal(compiled.situ_glu_array(*args), interpreted.situ_glu_array(*args))
    gargs = (g, u, d, F, SITU_BETA, SITU_BETA_LIN)
    assert bit_equal(compiled.situ_glu_grad_array(*gargs), interpreted.situ_glu_grad_array(*gargs))


def test_the_trainer_compiled_equals_interpreted(kernels, tiny):
    compiled, interpreted = kernels
    order = np.arange(12, dtype=np.int64)
    assert bit_equal(train(compiled, tiny, order), train(interpreted, tiny, order))


def test_the_trainer_is_independent_of_sample_order(kernels, tiny):
    compiled, _ = kernels
    first = train(compiled, tiny, np.arange(12, dtype=np.int64), steps=20)
    again = train(compiled, tiny, np.arange(12, dtype=np.int64)[::-1].copy(), steps=20)
    assert bit_equal(first, again)
    losses = first[0]
    assert losses[-1] < losses[0]  # it learns
    assert first[4] == 0  # no saturation


def test_zero_steps_only_measure_the_loss(kernels, tiny):
    compiled, _ = kernels
    losses, w1, w3, w2, sat = train(compiled, tiny, np.arange(12, dtype=np.int64), steps=0)
    assert losses.shape == (1,) and sat == 0
    assert bit_equal((w1, w3, w2), (tiny["w1"], tiny["w3"], tiny["w2"]))
    # the loss is the MSE of the untrained net: recompute it from the exported forward
    a = compiled.situ_glu_array(
        ((tiny["x"] @ tiny["w1"].T + (1 << 23)) >> 24).ravel(),
        ((tiny["x"] @ tiny["w3"].T + (1 << 23)) >> 24).ravel(),
        F, SITU_BETA, SITU_BETA_LIN,
    ).reshape(12, 3)  # fmt: skip
    e = (a @ tiny["w2"]) / 2.0**48 - tiny["y"] / 2.0**24
    assert losses[0] / 2.0**24 == pytest.approx(np.mean(e * e), rel=1e-5)


def test_regression_data_is_seeded_and_in_the_trainer_domain():
    a = situ_gate.regression_data(situ_gate.SEED)
    b = situ_gate.regression_data(situ_gate.SEED)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert np.abs(a["x"]).max() <= 4 << F and np.abs(a["y"]).max() <= 8 << F
    y = a["y"] / 2.0**F
    assert abs(y.mean()) < 1e-6 and y.var() == pytest.approx(1.0, abs=1e-5)
    assert SITU_FRAC == F
