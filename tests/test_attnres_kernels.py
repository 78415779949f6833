"""AttnRes kernels: compiled == interpreted on negative inputs, the wide-sum helpers against exact
Python integers, the exact cases of the depth softmax, and the constants."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from k3gates.attnres import gate as G
from k3gates.attnres import kernels as K
from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal

ATTNRES = "k3gates.attnres.kernels"
F = 24


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(ATTNRES), kc.interpreted(ATTNRES)


@pytest.fixture(scope="module")
def negative() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    v, w = G.small_negative_problem(rng, n=4, t_len=5, d=8)
    g = -np.abs(G.upstream(rng, 5, 8))
    return {"v": v, "w": w, "g": np.ascontiguousarray(g)}


def test_forward_keys_and_grad_compiled_equal_interpreted_on_negatives(kernels, negative):
    compiled, interpreted = kernels
    v, w, g = negative["v"], negative["w"], negative["g"]
    for func, args in (
        ("attnres_forward", (v, w, G.EPS_RAW, F, F)),
        ("attnres_forward", (v, -w, 0, F, F)),  # eps = 0, a zero row in v: key 0
        ("attnres_keys", (v, G.EPS_RAW, F, 30)),
        ("attnres_grad_w", (v, w, g, G.EPS_RAW, F, F, F)),
    ):
        assert bit_equal(getattr(compiled, func)(*args), getattr(interpreted, func)(*args)), func


def test_the_stack_compiled_equals_interpreted(kernels):
    compiled, interpreted = kernels
    p = G.stack_problem(5, 3, t_len=2, d=8)
    emb = np.ascontiguousarray(-np.abs(p["emb"]))
    args = (emb, p["wq"], p["mats"], 2, G.EPS_RAW)
    assert bit_equal(compiled.attnres_stack(*args), interpreted.attnres_stack(*args))


def _edges() -> list[int]:
    p = [(1 << i) + d for i in range(0, 62) for d in (-2, -1, 0, 1, 2)]
    return sorted({x for x in p if x >= 0})


def _round_half_away(x: Fraction) -> int:
    q = int(abs(x) + Fraction(1, 2))  # floor for the non-negative
    return q if x >= 0 else -q


def test_wide_round_and_wide_top_are_exact():
    k = kc.interpreted(ATTNRES)
    rng = np.random.default_rng(12)
    his = [0, 1, -1, 2**31, -(2**31), 2**40 + 3, -(2**40) - 3] + [
        int(x) for x in rng.integers(-(2**45), 2**45, 200)
    ]
    los = [0, 1, 2**31 - 1, 2**31, 3 * 2**31 + 5] + [int(x) for x in rng.integers(0, 2**36, 200)]
    for hi, lo in zip(his * 2, los * 2, strict=False):
        value = hi * 2**31 + lo
        m, z = k.wide_top(hi, lo)
        assert abs(m) < 2**62
        assert abs(value - m * 2**z) < 2**z and (z == 0) == (abs(value) < 2**62)
        assert abs(m * 2**z) <= abs(value)  # truncated toward zero
        for s in (0, 1, 5, 30, 31, 32, 33, 45, 60, 92, 93):
            want = _round_half_away(Fraction(value, 2**s))
            if abs(want) < 2**62:
                assert k.wide_round(hi, lo, s) == want, (hi, lo, s)
        if abs(value) < 2**55:
            assert k.wide_round(hi, lo, -3) == value * 8


def test_wide_round_at_powers_of_two():
    k = kc.interpreted(ATTNRES)
    for x in _edges():
        for sign in (1, -1):
            value = sign * x
            hi, lo = value >> 31, value & (2**31 - 1)
            for s in (0, 1, 31, 32, 40):
                want = _round_half_away(Fraction(value, 2**s))
                assert k.wide_round(hi, lo, s) == want


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_equal_scores_give_exact_powers_of_two(n):
    k = kc.interpreted(ATTNRES)
    x = np.full((1, n), 12345 << 20, dtype=np.int64)
    k.softmax_row_q62(x, 0, n)
    assert np.all(x == 1 << (62 - (n.bit_length() - 1)))


def test_one_source_weighs_one_unit_short_in_q62_and_exactly_one_in_q31():
    """fx's recip_q62(1/2) is 2^62 - 1: the single weight is 1 - 2^-62, which the mix absorbs."""
    k = kc.interpreted(ATTNRES)
    x = np.array([[7 << 40]], dtype=np.int64)
    k.softmax_row_q62(x, 0, 1)
    assert int(x[0, 0]) == 2**62 - 1
    v = np.array([[[-(2**30), 2**30 - 1, -1, 0, 1, 12345]]], dtype=np.int64)
    h, alpha, _ = k.attnres_forward(v, np.arange(6, dtype=np.int64) << 20, 0, F, F)
    assert np.array_equal(h, v[0]) and int(alpha[0, 0]) == 2**31


def test_softmax_q62_sums_to_one_and_orders():
    k = kc.interpreted(ATTNRES)
    rng = np.random.default_rng(13)
    s = rng.integers(-(20 << K.SCORE_FRAC), 20 << K.SCORE_FRAC, (1, 9))
    x = s.copy()
    k.softmax_row_q62(x, 0, 9)
    assert abs(sum(int(a) for a in x[0]) - 2**62) <= 9 * 520  # n (2^9 + n/2 + 5) LSB of Q0.62
    assert list(np.argsort(x[0])) == list(np.argsort(s[0]))


def test_constants_are_the_expressions_they_encode():
    assert K.SCORE_CLAMP == 2**61 - 1  # |s| < 2^9 in Q.52
    assert K.ARG_CLAMP == 64 * 2**52  # score differences clamp at 64 in Q.52
    assert K.TANH_CLAMP == 32 * 2 ** (K.STACK_FRAC + K.XN_FRAC)  # tanh saturates at 32
    for bound in (
        K.KEY_MAX_ERR_LSB_Q10,
        K.ALPHA_MAX_ERR_LSB_Q10,
        K.MIX_MAX_ERR_LSB_Q10,
        K.GRAD_MAX_ERR_LSB_Q10,
    ):
        assert bound == 2**K.BOUND_FRAC // 2 + 1  # 1/2 + 2^-10 LSB
    assert [K.weights_sum_bound_q10(n) for n in (1, 9, 16)] == [513, 9 * 513, 16 * 513]
    assert K.GRAD_OUT_BITS + K.GRAD_GUARD == 60  # every term of the gradient below 2^60
    assert K.V_MAX**2 * 2 <= 2**62 - 1  # v^2 and v w (|w| <= 2^31) fit int64
