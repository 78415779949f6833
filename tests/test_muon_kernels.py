"""Muon kernels: constants, the declared bound functions, compiled == interpreted on negative
inputs (and on the int64 fallback path), and the integer trainer's order-independence."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal
from k3gates.muon import gate as muon_gate
from k3gates.muon import kernels as K

MUON = "k3gates.muon.kernels"


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(MUON), kc.interpreted(MUON)


def test_coefficients_are_the_rounded_spec_values():
    for raw, value, frac in (
        (K.NS_A_Q28, Fraction("3.4445"), 28),
        (K.NS_B_Q30, Fraction("-4.7750"), 30),
        (K.NS_C_Q26, Fraction("2.0315"), 26),
    ):
        assert raw == round(value * 2**frac)
    # the error magnitudes the step bound uses: |da| < 0.77 2^-30, |db| < 0.82 2^-31,
    # |dc| < 0.88 2^-28, c_q < 2.0316
    assert abs(Fraction(K.NS_A_Q28, 2**28) - Fraction("3.4445")) < Fraction(77, 100) / 2**30
    assert abs(Fraction(K.NS_B_Q30, 2**30) - Fraction("-4.775")) < Fraction(82, 100) / 2**31
    assert abs(Fraction(K.NS_C_Q26, 2**26) - Fraction("2.0315")) < Fraction(88, 100) / 2**28
    assert Fraction(K.NS_C_Q26, 2**26) < Fraction("2.0316")


@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 128, 512, 4096])
def test_ns_step_bound_covers_the_exact_expression(m):
    s = Fraction(5, 4)
    sqrt_m = Fraction(math.isqrt(m << 40) + 1, 2**20)  # >= sqrt(m)
    e_a2 = 2 * s**2 * sqrt_m / 2**25 + Fraction(m, 2**50) + Fraction(m, 2**30) + Fraction(1, 2**33)
    e_b = (
        Fraction(1, 2**24)
        + Fraction(82, 100) * s**2 / 2**31
        + Fraction(88, 100) * s**4 / 2**28
        + Fraction(20316, 10000) * e_a2
    )
    exact = Fraction(1, 2) + 2**14 * (Fraction(77, 100) * s / 2**30 + sqrt_m * s * e_b)
    bound = Fraction(K.ns_step_bound_q10(m), 2**10)
    assert exact <= bound <= exact + Fraction(1, 2**9)


def test_step_tolerance_is_ns5_tolerance_scaled_by_the_update():
    lr_q = round(0.02 * 2**30)
    got = K.step_tolerance_lsb(lr_q, 144, 24)
    want = 1 + 0.02 * 0.2 * math.sqrt(144) * K.NS5_TOL_LSB * 2.0**-14 * 2**24
    assert want <= got <= want + 2


def test_ns5_compiled_equals_interpreted_on_negatives_and_large_values(kernels):
    compiled, interpreted = kernels
    rng = np.random.default_rng(0)
    for shape in ((5, 7), (7, 5), (6, 6)):
        g = -np.abs(rng.integers(0, 2**45, shape))
        g[0, 0] = 2**61  # forces the pre-shift
        g = np.ascontiguousarray(g)
        assert bit_equal(compiled.ns5(g, 3), interpreted.ns5(g, 3))
    assert not compiled.ns5(np.zeros((3, 4), dtype=np.int64), 0)[0].any()


def test_the_int64_fallback_path_is_exact_and_counted(kernels):
    compiled, interpreted = kernels
    # rows of norm ~ 2^16.5 break the int32 guard: the kernel must take its int64 path
    x = np.full((3, 9), 30000, dtype=np.int16)
    x[1] = -x[1]
    out_c = compiled.ns_step(x)
    assert out_c[1] > 0  # guard count: the premise failed, and the kernel said so
    assert bit_equal(out_c, interpreted.ns_step(x))


def test_muon_step_and_qk_clip_compiled_equal_interpreted(kernels):
    compiled, interpreted = kernels
    rng = np.random.default_rng(1)
    W, M, G = (np.ascontiguousarray(-np.abs(rng.integers(0, 2**30, (4, 6)))) for _ in range(3))
    for heads, axis in ((1, 0), (2, 0), (3, 1)):
        args = (W, M, G, 2**29, 2**25, 2**27, 1, heads, axis, 24, 7)
        assert bit_equal(compiled.muon_step(*args), interpreted.muon_step(*args))
    s_max = np.array([2**30, 5 << 30], dtype=np.int64)
    args = (W, -M, s_max, 3 << 29, 2)
    assert bit_equal(compiled.qk_clip(*args), interpreted.qk_clip(*args))


def test_momentum_rounds_half_away_from_zero(kernels):
    compiled, _ = kernels
    m = np.array([[3, -3, 1, -1]], dtype=np.int64)
    g = np.zeros_like(m)
    m_new, n = compiled.momentum(m, g, 1 << 29, 0)  # mu = 1/2
    assert m_new.tolist() == [[2, -2, 1, -1]] and np.array_equal(n, m_new)


@pytest.fixture(scope="module")
def tiny() -> dict[str, np.ndarray]:
    d = muon_gate.attention_data(muon_gate.SEED)
    t = muon_gate.T_LEN
    return {n: np.ascontiguousarray(a[: 3 * t] if a.shape[0] > 8 else a) for n, a in d.items()}


def _train(k, d, order, steps=3):
    return k.train_attention(
        d["x"], d["y"], d["wq"], d["wk"], d["wv"], d["wo"], steps, muon_gate.T_LEN, 2, 1,
        muon_gate.TRAIN_LR_Q, muon_gate.MU_Q, 0, muon_gate.TRAIN_EPS, order,
    )  # fmt: skip


def test_the_trainer_compiled_equals_interpreted(kernels, tiny):
    compiled, interpreted = kernels
    order = np.arange(3, dtype=np.int64)
    neg = dict(tiny, wv=-tiny["wv"])
    assert bit_equal(_train(compiled, neg, order), _train(interpreted, neg, order))


def test_the_trainer_is_independent_of_sequence_order_and_learns(kernels, tiny):
    compiled, _ = kernels
    first = _train(compiled, tiny, np.arange(3, dtype=np.int64), steps=30)
    again = _train(compiled, tiny, np.array([2, 0, 1], dtype=np.int64), steps=30)
    assert bit_equal(first, again)
    assert first[0][-1] < first[0][0] / 2
    assert first[5] == 0 and first[6] == 0


def test_the_ns5_tolerance_model_recomputed():
    """The first-order model behind NS5_TOL_LSB (kernels.py docstring): the largest product of
    divided differences of p(s) = a s + b s^3 + c s^5 along pairs of singular-value trajectories
    from [0.05, 1], injected at the normalisation (<= 119) and summed over the steps (<= 53)."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def p(s):
        return a * s + b * s**3 + c * s**5

    def dp(s):
        return a + 3 * b * s**2 + 5 * c * s**4

    s0 = np.linspace(0.05, 1.0, 401)
    S, T = np.meshgrid(s0, s0)
    traj = [(S, T)]
    for _ in range(5):
        traj.append((p(traj[-1][0]), p(traj[-1][1])))

    def factor(s, t):
        near = np.abs(s - t) < 1e-9
        d1 = np.where(near, dp(s), (p(s) - p(t)) / np.where(near, 1.0, s - t))
        return np.maximum(np.abs(d1), np.abs((p(s) + p(t)) / (s + t)))

    amp = [np.prod([factor(*traj[j]) for j in range(k, 5)], axis=0).max() for k in range(6)]
    assert amp[0] <= 120 and sum(amp[1:]) <= 54
    local = K.ns_step_bound_q10(K.NS5_TOL_MAX_ROWS) / 1024
    assert 0.5 * amp[0] + local * sum(amp[1:]) <= K.NS5_TOL_LSB
