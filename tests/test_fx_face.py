"""The k3gates.fx library face: float in, float out, against numpy, plus its input contract."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.fx as fx

Q31 = 2.0**-31
BOUND = 513 / 1024  # kernels' bound in output LSB


def test_sigmoid_tanh_exp_match_numpy_within_the_bound_plus_input_rounding():
    x = np.linspace(-30, 30, 20001)
    # the face rounds x to 2^-40 first; |f'| <= 1 turns that into < 2^-41 of output
    slack = BOUND * Q31 + 2.0**-41
    assert np.abs(fx.sigmoid(x) - 1 / (1 + np.exp(-x))).max() <= slack
    assert np.abs(fx.tanh(x) - np.tanh(x)).max() <= slack
    xn = -np.abs(x)
    assert np.abs(fx.exp(xn) - np.exp(xn)).max() <= slack


def test_exact_values():
    assert fx.sigmoid(0.0) == 0.5 and fx.tanh(0.0) == 0.0 and fx.exp(0.0) == 1.0
    assert fx.sigmoid(100.0) == 1.0 and fx.sigmoid(-100.0) == 0.0  # saturates
    assert fx.tanh(1e9) == 1.0 and fx.tanh(-1e9) == -1.0
    assert fx.exp(-1e300) == 0.0
    assert fx.rsqrt(4.0) == 0.5 and fx.rsqrt(2.0**-200) == 2.0**100
    np.testing.assert_array_equal(fx.softmax(np.zeros((2, 8))), np.full((2, 8), 0.125))


def test_shapes_are_kept():
    x = np.linspace(-3, 3, 24).reshape(2, 3, 4)
    for f in (fx.sigmoid, fx.tanh, fx.silu):
        assert f(x).shape == (2, 3, 4)
    assert fx.exp(-np.abs(x)).shape == (2, 3, 4)
    assert np.asarray(fx.sigmoid(1.5)).shape == ()


def test_silu():
    x = np.linspace(-50, 50, 10001)
    want = x / (1 + np.exp(-x))
    assert np.abs(fx.silu(x) - want).max() <= BOUND * 2.0**-24 + 2.0**-25 * 1.1


def test_rsqrt_relative_error_over_the_float_range():
    x = np.exp2(np.random.default_rng(0).uniform(-1000, 1000, 5000))
    rel = np.abs(fx.rsqrt(x) * np.sqrt(x) - 1)
    assert rel.max() < 2.0**-38


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_matches_numpy_on_any_axis(axis):
    x = np.random.default_rng(1).normal(0, 5, (7, 9))
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    want = z / z.sum(axis=axis, keepdims=True)
    # Q.32 input rounding moves a weight by at most p (1 - p) 2^-32 * 2 <= 2^-32
    assert np.abs(fx.softmax(x, axis=axis) - want).max() <= BOUND * Q31 + 2.0**-32


def test_rmsnorm_matches_numpy_across_scales():
    rng = np.random.default_rng(2)
    w = rng.normal(1, 0.3, 64)
    for scale in (1e-6, 1e-2, 1.0, 1e3, 1e6):
        x = rng.normal(0, scale, (5, 64))
        want = w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        got = fx.rmsnorm(x, w, 1e-6)
        assert np.abs(got - want).max() <= 1e-7 * np.abs(want).max() + 1e-9, scale


def test_l2norm_rows_have_unit_norm():
    x = np.random.default_rng(3).normal(0, 10, (4, 128))
    y = fx.l2norm(x, 0.0)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), 1.0, atol=128 * Q31)
    np.testing.assert_allclose(y, x / np.linalg.norm(x, axis=-1, keepdims=True), atol=2 * Q31)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fx.exp(np.array([-1.0, 0.5])), "x: exp is defined here for x <= 0 only, got 0.5"),
        (lambda: fx.sigmoid([1.0, np.nan]), "x: expected finite values, got NaN or infinity"),
        (lambda: fx.tanh(np.inf), "x: expected finite values"),
        (lambda: fx.rsqrt([1.0, 0.0]), "x: rsqrt needs x > 0, got 0.0"),
        (lambda: fx.rsqrt(-2.0), "x: rsqrt needs x > 0, got -2.0"),
        (lambda: fx.softmax(3.0), "x: softmax needs at least one axis, got a scalar"),
        (lambda: fx.softmax(np.zeros((2, 0))), "x: softmax over an empty axis"),
        (lambda: fx.softmax([1e9]), "x: softmax accepts |x| < 2^28, got 1000000000.0"),
        (lambda: fx.silu([2.0**38]), "x: silu accepts |x| < 2^37"),
        (lambda: fx.rmsnorm(np.ones((2, 4)), np.ones(3), 1e-6), "w: expected shape (4,) to match"),
        (lambda: fx.rmsnorm(np.ones(4), np.ones(4), -1.0), "eps: expected a finite eps >= 0"),
        (lambda: fx.rmsnorm(np.ones((2, 0)), np.ones(0), 1e-6), "x: expected an array with a"),
        (lambda: fx.sigmoid("abc"), "x: expected an array of real numbers, got str"),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
