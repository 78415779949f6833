"""The k3gates.moe library face (route, layer, qb_update) against a float64 implementation
written here from K3-SPEC.md section 4, and its input validation."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.moe as moe
from k3gates.moe.kernels import QB_BIAS_MAX_ERR_LSB_Q10, layer_bound_q10

T, D, D_L, F, N, K, F_S = 48, 32, 16, 8, 24, 4, 16
RSF = 2.827


def q(a: np.ndarray, frac: int) -> np.ndarray:
    """Round to the face's grid (ties cannot occur for these draws)."""
    return np.round(np.asarray(a) * 2.0**frac) / 2.0**frac


# -- float64, from the equations -------------------------------------------------------------------
def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def situ(g, u):
    return 4 * np.tanh(g / 4) * sig(g) * 25 * np.tanh(u / 25)


def float_route(x, w_r, b, k, rsf):
    s = sig(x @ w_r.T)
    biased = s + b
    idx = np.argsort(-biased, axis=1, kind="stable")[:, :k]
    sel = np.take_along_axis(s, idx, 1)
    top = -np.sort(-biased, axis=1)
    return idx, rsf * sel / sel.sum(1, keepdims=True), top[:, k - 1] - top[:, k]


def float_layer(x, p, b, k, rsf, eps):
    idx, wts, gap = float_route(x, p["w_router"], b, k, rsf)
    z = x @ p["w_down"].T
    c = np.zeros((x.shape[0], D_L))
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            c[t] += wts[t, j] * (p["w2"][e] @ situ(p["w1"][e] @ z[t], p["w3"][e] @ z[t]))
    r = p["norm_w"] * c / np.sqrt(np.mean(c * c, axis=1, keepdims=True) + eps)
    shared = situ(x @ p["shared_w1"].T, x @ p["shared_w3"].T) @ p["shared_w2"].T
    return r @ p["w_up"].T + shared, idx, gap


@pytest.fixture(scope="module")
def problem() -> dict:
    rng = np.random.default_rng(11)

    def mat(*shape):
        w = rng.standard_normal(shape)
        w /= np.linalg.norm(w, axis=-1, keepdims=True)
        return q(w / 2, 24)  # row and column L1 norms well below 8

    p = {
        "w_router": mat(N, D), "w_down": mat(D_L, D), "w1": mat(N, F, D_L), "w3": mat(N, F, D_L),
        "w2": mat(N, D_L, F), "norm_w": q(1 + 0.1 * rng.standard_normal(D_L), 24),
        "w_up": mat(D, D_L), "shared_w1": mat(F_S, D), "shared_w3": mat(F_S, D),
        "shared_w2": mat(D, F_S),
    }  # fmt: skip
    p["w_down"] *= 4  # z of order 1
    p["w1"] *= 2
    p["w3"] *= 2
    p["w2"] *= 2
    x = q(np.clip(rng.standard_normal((T, D)), -4, 4), 24)
    b = q(rng.normal(0, 0.02, N), 40)
    return {"p": p, "x": x, "b": b}


def test_route_matches_float64(problem):
    x, p, b = problem["x"], problem["p"], problem["b"]
    idx, w = moe.route(x, p["w_router"], b, K, RSF)
    fidx, fw, gap = float_route(x, p["w_router"], b, K, q(RSF, 24))
    assert idx.shape == w.shape == (T, K) and w.dtype == np.float64
    assert gap.min() > 2.0**-38  # no near-ties in this draw, so the sets must agree exactly
    assert np.array_equal(idx, fidx)  # same order too: lower index first on ties, none here
    assert np.abs(w - fw).max() <= 2.0**-44  # weights_bound: well below 2^-40
    assert np.abs(w.sum(1) - q(RSF, 24)).max() <= K * 2.0**-56 + 2.0**-50  # + float64 sum


def test_layer_matches_float64_on_the_quantised_inputs(problem):
    x, p, b = problem["x"], problem["p"], problem["b"]
    eps = 2.0**-20  # exact in Q.56
    y = moe.layer(x, p, b, K, RSF, eps)
    want, _, gap = float_layer(x, p, b, K, q(RSF, 24), eps)
    assert y.shape == (T, D) and y.dtype == np.float64
    assert gap.min() > 2.0**-38
    bound = layer_bound_q10(D_L, K) / 1024 * 2.0**-24  # declared in the kernels
    assert np.abs(y - want).max() <= bound


def test_layer_accepts_the_dataclass_and_shuffled_tokens_permute_outputs(problem):
    x, p, b = problem["x"], problem["p"], problem["b"]
    weights = moe.MoEWeights(**p)
    y = moe.layer(x, weights, b, K, RSF)
    perm = np.random.default_rng(3).permutation(T)
    np.testing.assert_array_equal(moe.layer(x[perm], weights, b, K, RSF), y[perm])


def test_qb_update_matches_float64_and_balances(problem):
    x, p = problem["x"], problem["p"]
    m = T  # 48 tokens, 24 experts, top-4: q = 8
    b0 = np.zeros(N)
    b1 = moe.qb_update(x, p["w_router"], b0, K)
    s = sig(x @ p["w_router"].T)
    c = -np.sort(-(s + b0), axis=1)[:, K]
    margins = s + b0 - c[:, None]
    want = b0 - (-np.sort(-margins, axis=0))[m * K // N]
    assert np.abs(b1 - want).max() <= QB_BIAS_MAX_ERR_LSB_Q10 / 1024 * 2.0**-40
    before = np.bincount(moe.route(x, p["w_router"], b0, K)[0].ravel(), minlength=N)
    after = np.bincount(moe.route(x, p["w_router"], b1, K)[0].ravel(), minlength=N)
    assert np.abs(after - m * K // N).max() < np.abs(before - m * K // N).max()


def test_the_bias_moves_the_choice_never_the_weights(problem):
    x, p = problem["x"], problem["p"]
    rng = np.random.default_rng(5)
    b1 = q(rng.normal(0, 0.3, N), 40)
    i0, w0 = moe.route(x, p["w_router"], np.zeros(N), K, RSF)
    i1, w1 = moe.route(x, p["w_router"], b1, K, RSF)
    moved = 0
    for t in range(T):
        if set(i0[t]) == set(i1[t]):
            assert dict(zip(i0[t], w0[t], strict=True)) == dict(zip(i1[t], w1[t], strict=True))
        else:
            moved += 1
    assert moved > 0


def test_equal_scores_go_to_the_lower_index(problem):
    p = problem["p"]
    idx, w = moe.route(np.zeros((3, D)), p["w_router"], np.zeros(N), K)
    assert np.array_equal(idx, np.tile(np.arange(K), (3, 1)))
    assert np.all(w == 1.0 / K)  # sigma(0) = 1/2 for all: equal weights, rsf = 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, p, b: moe.layer(np.where(x > 1, np.nan, x), p, b, K), "x: expected finite"),
        (lambda x, p, b: moe.layer(x[0], p, b, K), "x: expected a 2-D array, got shape (32,)"),
        (lambda x, p, b: moe.layer(x, {**p, "w1": p["w1"][:, :, :3]}, b, K),
         "w1: expected shape (24, 8, 16), got (24, 8, 3)"),
        (lambda x, p, b: moe.layer(x, {k: v for k, v in p.items() if k != "w_up"}, b, K),
         "weights: missing 'w_up'"),
        (lambda x, p, b: moe.layer(x, p, b, 0), "k: expected an integer 1 <= k <= 24"),
        (lambda x, p, b: moe.layer(x, p, b[:5], K), "bias: expected shape (24,), got (5,)"),
        (lambda x, p, b: moe.layer(x * 1e5, p, b, K), "router logits W_r x: the worst-case"),
        (lambda x, p, b: moe.layer(x, {**p, "norm_w": p["norm_w"] * 8}, b, K),
         "norm_w: expected |norm_w| < 4"),
        (lambda x, p, b: moe.layer(x, p, b, K, 0.0), "routed_scaling_factor: expected a number"),
        (lambda x, p, b: moe.layer(x, p, b, K, eps=-1.0), "eps: expected a number in [0, 2^-8]"),
        (lambda x, p, b: moe.qb_update(x, p["w_router"], b, N),
         "k: expected an integer 1 <= k <= 23"),
        (lambda x, p, b: moe.route(x, "w", b, K), "w_router: expected an array of real numbers"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error_saying_what_was_expected(problem, call, message):
    with pytest.raises(ValueError) as e:
        call(problem["x"], problem["p"], problem["b"])
    assert message in str(e.value)
