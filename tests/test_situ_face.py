"""The k3gates.situ library face: SiTU-GLU and its backward, float in and out."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.situ as situ
from k3gates.situ import reference as ref

LSB = 2.0**-24
BOUND = 513 / 1024 * LSB  # the kernels' bound, on the exact function of the quantised inputs


def q24(a: np.ndarray) -> np.ndarray:
    """The face's own quantisation of its inputs (ties cannot occur for these draws)."""
    return np.round(np.asarray(a) * 2**24) / 2**24


@pytest.fixture(scope="module")
def points() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    n = 20000
    return rng.uniform(-70, 70, n), rng.uniform(-600, 600, n), rng.uniform(-512, 512, n)


def test_forward_within_the_bound_of_the_quantised_inputs(points):
    g, u, _ = points
    got = situ.situ_glu(g, u)
    assert got.dtype == np.float64
    assert np.abs(got - ref.situ_glu(q24(g), q24(u))).max() <= BOUND


def test_backward_within_the_bound_of_the_quantised_inputs(points):
    g, u, d = points
    dg, du = situ.situ_glu_grad(g, u, d)
    want_g, want_u = ref.situ_glu_grad(q24(g), q24(u), q24(d))
    assert np.abs(dg - want_g).max() <= BOUND
    assert np.abs(du - want_u).max() <= BOUND


def test_output_is_bounded_by_100_even_for_huge_inputs():
    big = np.array([-1e300, -1e9, -64.0, 0.0, 64.0, 1e9, 1e300])
    g, u = np.meshgrid(big, big)
    out = situ.situ_glu(g, u)
    assert np.abs(out).max() <= 100.0
    assert situ.situ_glu(1e300, 1e300) == 100.0  # 4 tanh(inf) sigma(inf) 25 tanh(inf)
    assert situ.situ_glu(-1e300, 1e300) == 0.0  # sigma(-inf) = 0


def test_shape_broadcasting_and_symmetry():
    g = np.linspace(-5, 5, 3)[:, None]
    u = np.linspace(-30, 30, 4)[None, :]
    out = situ.situ_glu(g, u)
    assert out.shape == (3, 4)
    np.testing.assert_array_equal(situ.situ_glu(g, -u), -out)  # odd in u, bit for bit
    assert situ.situ_glu(2.0, 0.0) == 0.0
    dg, du = situ.situ_glu_grad(g, u, 1.0)
    assert dg.shape == du.shape == (3, 4)


def test_near_zero_it_is_swiglu_like():
    # 4 tanh(g/4) ~ g and 25 tanh(u/25) ~ u for small arguments
    g, u = 0.01, 0.02
    assert situ.situ_glu(g, u) == pytest.approx(g / (1 + np.exp(-g)) * u, rel=1e-4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: situ.situ_glu([1.0, np.nan], [1.0, 2.0]), "g: expected finite values"),
        (lambda: situ.situ_glu([1.0], [np.inf]), "u: expected finite values"),
        (lambda: situ.situ_glu(np.ones(3), np.ones(4)), "shapes do not broadcast: g (3,), u (4,)"),
        (lambda: situ.situ_glu_grad(1.0, 1.0, 2.0**33), "dout: expected |dout| < 2^33"),
        (lambda: situ.situ_glu("x", 1.0), "g: expected an array of real numbers, got str"),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
