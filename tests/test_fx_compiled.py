"""Compiled == interpreted, bit for bit, for every exported fx kernel on negative inputs.

Negative operands are where Pythran's C++ and Python's integers part ways (`//` and `%` by a
negative divisor, `>>` and `&` of negatives, and any silent int64 overflow, which Python's
unbounded ints would not commit). The fx kernels divide only by positive numbers, so they must
agree everywhere; the fixture kernel below divides by negatives and must not, which shows the
comparison catches that class of bug (acceptance point 3 of issue 3).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal

FX = "k3gates.fx.kernels"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def fx() -> tuple:
    return kc.load(FX), kc.interpreted(FX)


def negatives(n: int, max_bits: int, seed: int) -> np.ndarray:
    """Negative int64 of every bit length up to max_bits, with -1, -2, -2^k and -2^k +- 1."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(1, max_bits + 1, n)
    mag = rng.integers(1, 2**62, n) >> (62 - np.minimum(bits, 62))
    edge = [1, 2, 3] + [2**k + d for k in range(1, max_bits) for d in (-1, 0, 1)]
    return -np.unique(np.concatenate([np.maximum(mag, 1), edge]).astype(np.int64))


def same(fx: tuple, func: str, *args: object) -> None:
    compiled, interpreted = fx
    out_c = getattr(compiled, func)(*args)
    out_i = getattr(interpreted, func)(*args)
    assert bit_equal(out_c, out_i), f"{func} differs compiled vs interpreted"


@pytest.mark.parametrize("s", [0, 1, 2, 7, 31, 32, 61, 62, 63])
def test_rshift_round_on_negatives(fx, s):
    x = np.concatenate([negatives(200, 62, s), [-(2**63) + 1, -(2**63) + 2, 2**63 - 1]])
    same(fx, "rshift_round_array", x, s)


@pytest.mark.parametrize("s", [0, 17, 31, 61, 62, 63, 93, 124])
def test_mul_round_on_mixed_signs(fx, s):
    a = negatives(150, 62, 1)
    b = np.resize(-negatives(150, 62, 2), a.size)  # positive
    ok = np.array([abs(int(p) * int(q)) >> s < 2**62 for p, q in zip(a, b, strict=True)])
    same(fx, "mul_round_array", a[ok], b[ok], s)
    same(fx, "mul_round_array", a[ok], -b[ok], s)


def test_mul_q62_at_its_extremes(fx):
    a = np.array([2**62, -(2**62), 2**62 - 1, -(2**62) + 1, -1, 1], dtype=np.int64)
    same(fx, "mul_q62_array", np.repeat(a, a.size), np.tile(a, a.size))


def test_div_round_with_negative_dividends(fx):
    n = negatives(300, 62, 3)
    d = np.resize(np.array([1, 2, 3, 7, 10, 2**31 - 1, 2**62, 2**63 - 1]), n.size)
    same(fx, "div_round_array", n, d)


def test_narrowing_of_negatives(fx):
    same(fx, "narrow_int32", negatives(300, 63, 4))


@pytest.mark.parametrize("frac", [0, 16, 40, 56, 57, 62])
def test_exp_on_its_domain_of_negatives(fx, frac):
    same(fx, "exp_q31_array", np.concatenate([negatives(200, 62, 5), [-(2**63) + 1, 0]]), frac)


@pytest.mark.parametrize("func", ["sigmoid_q31_array", "tanh_q31_array"])
@pytest.mark.parametrize("frac", [0, 24, 56, 62])
def test_logistic_on_negatives_and_extremes(fx, func, frac):
    x = negatives(150, 62, 6)
    same(fx, func, np.concatenate([x, -x, [-(2**63) + 1, 2**63 - 1, 0]]), frac)


@pytest.mark.parametrize("frac", [0, 26, 56])
def test_silu_on_negatives(fx, frac):
    x = negatives(150, 62, 7)
    same(fx, "silu_array", np.concatenate([x, -x, [-(2**62), 2**62]]), frac)


def test_rsqrt_with_negative_formats_and_bad_inputs(fx):
    x = np.concatenate([-negatives(100, 63, 8), [0, -1, -(2**62), 2**63 - 1]])
    fi = np.resize(np.array([-40, -7, -1, 0, 1, 33]), x.size).astype(np.int64)
    fo = np.resize(np.array([-3, 0, 20, 31]), x.size).astype(np.int64)
    same(fx, "rsqrt_array", x, fi, fo)


def test_softmax_norms_sincos_on_negatives(fx):
    rng = np.random.default_rng(9)
    scores = -np.abs(rng.integers(-(2**40), 2**40, (6, 33)))
    same(fx, "softmax_q31", scores, 24)
    same(fx, "softmax_q31", np.array([[-(2**61) + 1, 2**61 - 1, 0]]), 0)
    x = rng.integers(-(2**26), 2**26, (5, 40))
    w = -np.abs(rng.integers(1, 2**30, 40))
    same(fx, "rmsnorm", x, w, 1000, 20, 28, 30, 0)
    same(fx, "rmsnorm", x, w, 1000, 20, 28, 30, 9)
    same(fx, "l2norm", x, 1000, 20, 31, 0)
    same(fx, "l2norm", x, 1000, 20, 31, 9)
    same(fx, "sincos_q31_array", negatives(200, 63, 10), 40)
    same(fx, "sincos_q31_array", negatives(50, 62, 11), 62)


def test_the_comparison_catches_negative_divisors(tmp_path, monkeypatch):
    """The trap itself: Pythran's `//` and `%` by a negative divisor differ from Python's."""
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(FIXTURES))
    mod = "fx_traps.floordiv.kernels"
    compiled, interpreted = kc.load(mod), kc.interpreted(mod)
    a = np.array([7, -7, 7, -7, 5, -1], dtype=np.int64)
    pos = np.array([2, 2, 3, 3, 7, 4], dtype=np.int64)
    assert bit_equal(compiled.floor_div_mod(a, pos), interpreted.floor_div_mod(a, pos))
    assert interpreted.floor_div_mod(a, -pos)[0].tolist() == [-4, 3, -3, 2, -1, 0]
    assert not bit_equal(compiled.floor_div_mod(a, -pos), interpreted.floor_div_mod(a, -pos))


def test_div_round_shift_ends_outside_its_domain(fx):
    """Divisors of 2^61 and more are outside div_round_shift's domain; its long division once
    took chunks of 62 - bitlen(d) = 0 bits there and never ended (a faulted AdamW step hung
    until its gate's timeout). Outside the domain the value is unspecified, but both the
    compiled and the interpreted kernel must return, each within a generous 120 s."""
    args = "[2**61, 2**61 + 7, 2**62, 2**63 - 1], [1, 2**40, 5, 2**62], [70, 64, 3, 100]"
    calls = {
        "compiled": f"kc.load({FX!r}).div_round_shift_array(*(np.array(v) for v in ({args})))",
        # the scalar kernel: its quotients outgrow int64, which only Python's ints can hold
        "interpreted": f"[kc.interpreted({FX!r}).div_round_shift(n, d, s) for d, n, s in "
        f"zip({args})]",
    }
    for how, call in calls.items():
        code = f"import numpy as np; from k3gates.infra import compile as kc; {call}"
        done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
        assert done.returncode == 0, f"{how}: {done.stderr.decode()[-400:]}"
