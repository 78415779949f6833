"""The k3gates.attnres library face (float in and out) against a float64 AttnRes written here from
K3-SPEC section 3, and its input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

import k3gates.attnres as ar

BOUND = 513 / 1024  # the kernels' bound in LSB of each output format


def spec_attnres(v: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """h = sum_i softmax_i(w . v_i / rms(v_i)) v_i over axis 0, in float64."""
    k = v / np.sqrt((v**2).mean(axis=-1, keepdims=True) + eps)
    s = np.tensordot(k, w, axes=([-1], [0]))  # [n, ...]
    a = np.exp(s - s.max(axis=0))
    a /= a.sum(axis=0)
    return (a[..., None] * v).sum(axis=0), a


def spec_grad_w(v: np.ndarray, w: np.ndarray, dh: np.ndarray, eps: float) -> np.ndarray:
    """d(sum dh . h)/dw by the softmax Jacobian, in float64."""
    k = v / np.sqrt((v**2).mean(axis=-1, keepdims=True) + eps)
    _, a = spec_attnres(v, w, eps)
    u = (dh[None] * v).sum(axis=-1)  # dL/dalpha, [n, ...]
    ds = a * (u - (a * u).sum(axis=0))
    return (ds[..., None] * k).reshape(-1, v.shape[-1]).sum(axis=0)


def quantised(x: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """The face's quantisation: `bits` significant bits from the top exponent (no ties here)."""
    top = int(np.frexp(np.abs(x).max())[1])
    f = bits - top
    return np.round(x * 2.0**f) / 2.0**f, f


def eps_q(eps: float, fv: int) -> float:
    """eps as the kernels see it: quantised to Q.(2 fv)."""
    return round(eps * 2.0 ** (2 * fv)) / 2.0 ** (2 * fv)


@pytest.fixture(scope="module")
def problem() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(8)
    v = rng.standard_normal((5, 3, 7, 32)) * 2.0 ** rng.uniform(-4, 4, (5, 3, 7, 1))
    w = rng.standard_normal(32) * 0.5
    dh = rng.standard_normal((3, 7, 32))
    return {"v": v, "w": w, "dh": dh}


def test_forward_within_the_bound_of_the_quantised_inputs(problem):
    v, w = problem["v"], problem["w"]
    h, alpha = ar.attnres(v, w, eps=1e-6)
    assert h.shape == v.shape[1:] and alpha.shape == v.shape[:-1]
    assert h.dtype == alpha.dtype == np.float64
    vq, fv = quantised(v, 30)
    wq, _ = quantised(w, 31)
    want_h, want_a = spec_attnres(vq, wq, eps_q(1e-6, fv))
    assert np.abs(h - want_h).max() <= BOUND * 2.0**-fv
    assert np.abs(alpha - want_a).max() <= BOUND * 2.0**-31


def test_keys_within_the_bound(problem):
    v = problem["v"]
    keys = ar.rms_keys(v, eps=1e-6)
    vq, fv = quantised(v, 30)
    want = vq / np.sqrt((vq**2).mean(axis=-1, keepdims=True) + eps_q(1e-6, fv))
    fk = 40 - ((32).bit_length() + 1) // 2
    assert np.abs(keys - want).max() <= BOUND * 2.0**-fk
    rms = np.sqrt((ar.rms_keys(v, eps=0.0) ** 2).mean(axis=-1))
    assert np.abs(rms - 1.0).max() < 1e-9  # with eps = 0 every key has RMS one
    assert np.all(np.sqrt((keys**2).mean(axis=-1)) < 1.0)  # eps > 0 only shrinks them


def test_gradient_matches_float64_and_finite_differences(problem):
    v, w, dh = problem["v"], problem["w"], problem["dh"]
    dw = ar.attnres_grad_w(v, w, dh, eps=1e-6)
    vq, fv = quantised(v, 30)
    wq, _ = quantised(w, 31)
    dq, _ = quantised(dh, 30)
    eps = eps_q(1e-6, fv)
    want = spec_grad_w(vq, wq, dq, eps)
    # dw is exact to 513/1024 LSB of a format whose worst case is 2^32: 2^-29 relative to the
    # sum of |dL/ds| |k| over tokens, here below 2^-20 of max |dw|
    assert np.abs(dw - want).max() <= 2.0**-20 * np.abs(want).max()
    step = 2.0**-16
    e = np.eye(32)[5] * step
    up, down = spec_attnres(vq, wq + e, eps)[0], spec_attnres(vq, wq - e, eps)[0]
    fd = (np.sum(dq * up) - np.sum(dq * down)) / (2 * step)
    assert dw[5] == pytest.approx(fd, rel=1e-6, abs=1e-6)


def test_single_source_comes_back_unchanged():
    rng = np.random.default_rng(1)
    v = np.round(rng.standard_normal((1, 4, 16)) * 2**20) / 2**20  # exactly representable
    h, alpha = ar.attnres(v, rng.standard_normal(16))
    np.testing.assert_array_equal(h, v[0])
    np.testing.assert_array_equal(alpha, np.ones((1, 4)))
    np.testing.assert_array_equal(ar.attnres_grad_w(v, np.ones(16), np.ones((4, 16))), 0.0)


def test_zero_query_gives_the_mean():
    rng = np.random.default_rng(2)
    v = np.round(rng.standard_normal((4, 5, 8)) * 2**20) / 2**20
    h, alpha = ar.attnres(v, np.zeros(8))
    np.testing.assert_array_equal(alpha, np.full((4, 5), 0.25))
    np.testing.assert_array_equal(h, v.mean(axis=0))  # n = 4: exact, the mean fits 2^-22
    h3, _ = ar.attnres(v[:3], np.zeros(8))
    assert np.abs(h3 - v[:3].mean(axis=0)).max() <= BOUND * 2.0**-28  # fv = 30 - 2 at most


def test_scaling_a_source_keeps_its_key():
    rng = np.random.default_rng(3)
    v = rng.standard_normal((3, 6, 16))
    scaled = v.copy()
    scaled[1] *= 4.0
    _, a1 = ar.attnres(v, rng.standard_normal(16) * 0.2, eps=0.0)
    np.testing.assert_array_equal(ar.rms_keys(scaled, 0.0)[1], ar.rms_keys(v, 0.0)[1])
    assert a1.shape == (3, 6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ar.attnres(np.ones(4), np.ones(4)), "sources: expected shape [n, ..., d]"),
        (lambda: ar.attnres(np.ones((17, 2, 4)), np.ones(4)), "sources: expected at most 16"),
        (lambda: ar.attnres(np.ones((2, 0)), np.ones(0)), "sources: expected shape [n, ..., d]"),
        (lambda: ar.attnres([[1.0, np.nan]], [1.0, 1.0]), "sources: expected finite values"),
        (lambda: ar.attnres([[2.0**30, 1.0]], [1.0, 1.0]), "sources: expected |sources| < 2^30"),
        (lambda: ar.attnres(np.ones((2, 3)), np.ones(4)), "w: expected shape (3,) to match"),
        (lambda: ar.attnres(np.ones((2, 4)), np.full(4, 200.0)), "w: expected sqrt(d) ||w|| < 511"),
        (lambda: ar.attnres(np.ones((2, 4)), np.ones(4), eps=-1.0), "eps: expected a finite eps"),
        (lambda: ar.attnres(np.ones((2, 4)), np.ones(4), eps=math.inf), "eps: expected a finite"),
        (lambda: ar.attnres("abc", np.ones(4)), "sources: expected an array of real numbers"),
        (
            lambda: ar.attnres_grad_w(np.ones((2, 3, 4)), np.ones(4), np.ones((2, 4))),
            "dh: expected the shape of h, (3, 4), got (2, 4)",
        ),
        (
            lambda: ar.attnres_grad_w(np.ones((2, 4)), np.ones(4), [np.inf] * 4),
            "dh: expected finite values",
        ),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
