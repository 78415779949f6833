"""The K3 block's schedule: the face, the kernels compiled and interpreted, and the gate's checks
catching a wrong schedule."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.k3block as k3block
from k3gates.infra import compile as kc
from k3gates.infra.gate import REGISTRY, GateContext, bit_equal
from k3gates.k3block import gate as block_gate

KERNELS = "k3gates.k3block.kernels"


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(KERNELS), kc.interpreted(KERNELS)


def test_k3s_93_layers_put_mla_at_4_8_to_92_and_93():
    kinds = k3block.layer_schedule(93)
    mla = (np.flatnonzero(kinds) + 1).tolist()
    assert mla == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80,
                   84, 88, 92, 93]  # fmt: skip
    assert kinds.dtype == np.int8 and int((kinds == 0).sum()) == 69


@pytest.mark.parametrize("bad", [0, -1, 1.5, "93", 1 << 17])
def test_the_face_refuses_a_bad_depth(bad):
    with pytest.raises(ValueError, match="n_layers"):
        k3block.layer_schedule(bad)


def test_the_face_refuses_a_period_longer_than_the_stack():
    with pytest.raises(ValueError, match="period"):
        k3block.layer_schedule(8, 9)


def test_compiled_equals_interpreted(kernels):
    compiled, interpreted = kernels
    for n, p in [(1, 1), (7, 3), (93, 4), (200, 8)]:
        assert bit_equal(compiled.layer_schedule(n, p), interpreted.layer_schedule(n, p))
    kinds = compiled.layer_schedule(93, 4)
    for args in [(6 << 20, 2304, 1 << 20), (0, 0, 0), (1 << 31, 1, 1), (1, 1 << 20, 1)]:
        assert compiled.attention_bytes(kinds, *args) == interpreted.attention_bytes(kinds, *args)


def test_attention_bytes_is_exact_and_refuses_its_outside(kernels):
    compiled, _ = kernels
    kinds = compiled.layer_schedule(93, 4)
    assert compiled.attention_bytes(kinds, 6 << 20, 2304, 1 << 20) == 69 * (6 << 20) + 24 * 2304 * (
        1 << 20
    )
    assert compiled.attention_bytes(kinds, 1 << 31, 1, 1) == -1
    assert compiled.attention_bytes(kinds, 1, 1 << 20, 1) == -1
    assert compiled.attention_bytes(kinds, 1, 1, (1 << 24) + 1) == -1


class _WrongSchedule:
    """The compiled kernels with the MLA layer moved to the first of each group of four."""

    def __init__(self, real):
        self._real = real

    def layer_schedule(self, n, p):
        kinds = self._real.layer_schedule(n, p)
        return np.roll(kinds, 1) if n == 93 else kinds

    def attention_bytes(self, *args):
        return self._real.attention_bytes(*args)


def test_the_gate_fails_on_a_wrong_schedule(kernels, monkeypatch):
    spec = REGISTRY["k3block_schedule"]
    ok = GateContext(spec)
    block_gate.k3block_schedule(ok)
    assert all(c.passed for c in ok.checks)
    bad = GateContext(spec)
    monkeypatch.setattr(bad, "compiled", lambda modname=None: _WrongSchedule(kernels[0]))
    block_gate.k3block_schedule(bad)
    failed = {c.name for c in bad.checks if not c.passed}
    assert {"k3_schedule", "three_to_one"} <= failed
