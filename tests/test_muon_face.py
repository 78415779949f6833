"""The k3gates.muon library face against float64 written here from K3-SPEC section 5."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.muon as muon

A, B, C = 3.4445, -4.7750, 2.0315


def ns5_float(G: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """KellerJordan/Muon's NS5 in float64: normalise, transpose if tall, five iterations."""
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / (np.linalg.norm(X) + eps)
    for _ in range(5):
        S = X @ X.T
        X = A * X + (B * S + C * S @ S) @ X
    return X.T if tall else X


def muon_float(W, M, G, lr, mu, wd, heads=1, axis=0):
    """Moonlight's Muon step with Nesterov momentum, NS5 per head slice."""
    M = mu * M + G
    N = G + mu * M
    W = W * (1 - lr * wd)
    dh = W.shape[axis] // heads
    for h in range(heads):
        idx = slice(h * dh, (h + 1) * dh)
        sl = (idx, slice(None)) if axis == 0 else (slice(None), idx)
        W[sl] -= lr * 0.2 * np.sqrt(max(N[sl].shape)) * ns5_float(N[sl])
    return W, M


@pytest.mark.parametrize("seed", range(5))
def test_newton_schulz5_agrees_with_float64_on_64_by_32(seed):
    G = np.random.default_rng(seed).standard_normal((64, 32))
    out = muon.newton_schulz5(G)
    assert out.dtype == np.float64 and out.shape == (64, 32)
    assert np.abs(out - ns5_float(G)).max() < 1e-2  # the acceptance bar
    assert np.abs(out - ns5_float(G)).max() < 2.0**-7  # the declared NS5 tolerance


def test_singular_values_transpose_and_scale():
    G = np.random.default_rng(7).standard_normal((24, 80)) * 1e-3
    out = muon.newton_schulz5(G)
    s = np.linalg.svd(out, compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.5
    np.testing.assert_array_equal(muon.newton_schulz5(G.T), out.T)  # bit for bit
    big = muon.newton_schulz5(G * 2.0**20, eps=0)
    np.testing.assert_array_equal(big, muon.newton_schulz5(G, eps=0))
    np.testing.assert_array_equal(muon.newton_schulz5(-G), -out)


def test_zero_gradient_gives_zeros():
    assert not muon.newton_schulz5(np.zeros((3, 5))).any()
    W = np.full((4, 6), 0.5)
    W1, M1 = muon.step(W, np.zeros((4, 6)), np.zeros((4, 6)), lr=0.1, weight_decay=0.5)
    np.testing.assert_allclose(W1, 0.5 * (1 - 0.05), atol=2.0**-24)
    assert not M1.any()


@pytest.mark.parametrize(("heads", "axis"), [(1, 0), (4, 0), (4, 1)])
def test_step_agrees_with_float64(heads, axis):
    rng = np.random.default_rng(11 + heads + axis)
    shape = (64, 24) if axis == 0 else (24, 64)
    W = rng.standard_normal(shape) * 0.1
    M = rng.standard_normal(shape) * 1e-3
    G = rng.standard_normal(shape) * 1e-3
    lr, mu, wd = 0.02, 0.95, 0.1
    W1, M1 = muon.step(W, M, G, lr=lr, momentum=mu, weight_decay=wd, heads=heads, axis=axis)
    W2, M2 = muon_float(W.copy(), M, G, lr, mu, wd, heads, axis)
    # M: the quantisation of M and G and one rounding, in a format whose LSB is at most
    # 2^-39 max(|M|, |G|): 1.5 LSB; and momentum's quantisation to Q.30 (2^-31 |M|)
    lsb = 2.0**-39 * max(np.abs(M).max(), np.abs(G).max())
    assert np.abs(M1 - M2).max() <= 1.5 * lsb + 2.0**-31 * np.abs(M).max()
    # W: its quantisation to Q.24 and two roundings (1.5 2^-24), plus lr 0.2 sqrt(max(A, B))
    # times NS5's tolerance 2^-7, A x B the head slice
    a, b = (shape[0] // heads, shape[1]) if axis == 0 else (shape[0], shape[1] // heads)
    tol = 1.5 * 2.0**-24 + lr * 0.2 * np.sqrt(max(a, b)) * 2.0**-7
    assert np.abs(W1 - W2).max() <= tol


def test_per_head_slices_are_independent():
    rng = np.random.default_rng(3)
    W, M, G = (rng.standard_normal((32, 16)) for _ in range(3))
    G2 = G.copy()
    G2[8:16] += 1.0  # head 1 of 4 (rows 8..15)
    a, _ = muon.step(W, M, G, heads=4)
    b, _ = muon.step(W, M, G2, heads=4)
    others = np.r_[0:8, 16:32]
    np.testing.assert_array_equal(a[others], b[others])
    assert not np.array_equal(a[8:16], b[8:16])


def test_qk_clip_scales_only_heads_over_tau():
    rng = np.random.default_rng(5)
    Wq, Wk = rng.standard_normal((8, 6)), rng.standard_normal((8, 6))
    s = np.array([50.0, 400.0])
    cq, ck = muon.qk_clip(Wq, Wk, s, heads=2, tau=100.0)
    np.testing.assert_allclose(cq[4:], Wq[4:] * 0.5, atol=2.0**-23)  # sqrt(100/400)
    np.testing.assert_allclose(ck[4:], Wk[4:] * 0.5, atol=2.0**-23)
    np.testing.assert_allclose(cq[:4], Wq[:4], atol=2.0**-25)  # head 0 untouched (Q.24)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: muon.newton_schulz5(np.ones(4)),
            "G: expected a non-empty 2-D array, got shape (4,)",
        ),
        (lambda: muon.newton_schulz5([[1.0, np.nan]]), "G: expected finite values"),
        (lambda: muon.newton_schulz5("x"), "G: expected a 2-D array of real numbers, got str"),
        (lambda: muon.newton_schulz5([[1e-9]], eps=1.0), "eps: 1.0 is too large next to G"),
        (lambda: muon.newton_schulz5([[1.0]], eps=-1.0), "eps: expected a finite eps >= 0"),
        (
            lambda: muon.step(np.ones((2, 3)), np.ones((2, 3)), np.ones((3, 2))),
            "M, G: expected the shape of W (2, 3)",
        ),
        (
            lambda: muon.step(np.ones((6, 3)), np.ones((6, 3)), np.ones((6, 3)), heads=4),
            "heads: expected a positive integer dividing W.shape[0] = 6, got 4",
        ),
        (
            lambda: muon.step(np.ones((6, 3)), np.ones((6, 3)), np.ones((6, 3)), axis=2),
            "axis: expected 0 (heads are rows) or 1 (heads are columns), got 2",
        ),
        (
            lambda: muon.step(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), momentum=1.0),
            "momentum: expected a value in [0, 1), got 1.0",
        ),
        (
            lambda: muon.step(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), lr=2.0),
            "lr: expected a value in [0, 1], got 2.0",
        ),
        (
            lambda: muon.qk_clip(np.ones((4, 2)), np.ones((4, 2)), [1.0], heads=2),
            "s_max: expected 2 finite values in (0, 2^36)",
        ),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)
