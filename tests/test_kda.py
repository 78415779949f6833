"""The KDA library face: its contract, acceptance point 2 of issue 4, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.kda as kda


def independent_kda(q, k, v, g, beta, scale, s0):
    """Written here from the issue's equations, not from the package's reference."""
    t_len, n_h, _ = q.shape
    S = s0.copy()
    o = np.zeros((t_len, n_h, v.shape[2]))
    for t in range(t_len):
        for h in range(n_h):
            kk = k[t, h]
            decayed = np.exp(g[t, h])[:, None] * S[h]
            S[h] = (
                decayed
                - beta[t, h] * np.outer(kk, kk @ decayed)
                + beta[t, h] * np.outer(kk, v[t, h])
            )
            o[t, h] = S[h].T @ (scale * q[t, h])
    return o, S


def inputs(seed=0, t_len=256, n_h=2, d=32):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((t_len, n_h, d)))
    k = unit(rng.standard_normal((t_len, n_h, d)))
    v = rng.standard_normal((t_len, n_h, d))
    g = rng.uniform(-5.0, 0.0, (t_len, n_h, d))  # K3's range (-5, 0)
    beta = rng.uniform(0.0, 1.0, (t_len, n_h))
    return q, k, v, g, beta


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_matches_an_independent_float64_kda_within_a_thousandth(form):
    q, k, v, g, beta = inputs()
    s0 = np.zeros((2, 32, 32))
    want_o, want_S = independent_kda(q, k, v, g, beta, 32**-0.5, s0)
    fn = kda.recurrent if form == "recurrent" else kda.chunked
    o, S = fn(q, k, v, g, beta)
    assert o.shape == (256, 2, 32) and S.shape == (2, 32, 32)
    assert o.dtype == np.float64
    rel_o = np.abs(o - want_o).max() / np.abs(want_o).max()
    rel_S = np.abs(S - want_S).max() / np.abs(want_S).max()
    assert rel_o < 1e-3 and rel_S < 1e-3, (rel_o, rel_S)


def test_scale_and_initial_state_are_honoured():
    q, k, v, g, beta = inputs(1, 32, 1, 8)
    s0 = np.random.default_rng(2).standard_normal((1, 8, 8)) * 0.5
    want_o, _ = independent_kda(q, k, v, g, beta, 0.25, s0)
    o, _ = kda.recurrent(q, k, v, g, beta, scale=0.25, initial_state=s0)
    assert np.abs(o - want_o).max() < 1e-4


def test_chunked_carries_state_like_recurrent():
    q, k, v, g, beta = inputs(3, 96, 2, 16)
    o_r, S_r = kda.recurrent(q, k, v, g, beta)
    o_c, S_c = kda.chunked(q, k, v, g, beta, chunk_size=32)
    assert np.abs(o_r - o_c).max() < 1e-5 and np.abs(S_r - S_c).max() < 1e-5


def test_compiled_equals_interpreted_on_negative_inputs():
    from k3gates.infra import compile as kc

    rng = np.random.default_rng(9)
    q, k, v, g, beta = inputs(9, 6, 2, 8)
    args = kda._inputs(q, k, -np.abs(v), g, beta, None, -np.abs(rng.standard_normal((2, 8, 8))))
    compiled = kc.load("k3gates.kda.kernels")
    interpreted = kc.interpreted("k3gates.kda.kernels")
    for a, b in zip(compiled.kda_recurrent(*args), interpreted.kda_recurrent(*args), strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(compiled.kda_chunked(*args, 4), interpreted.kda_chunked(*args, 4), strict=True):
        assert np.array_equal(a, b)
    g_raw = -np.abs(rng.standard_normal((4, 2, 8)))
    a = np.array([1 << 24, 3 << 23], dtype=np.int64)
    b = np.round(rng.standard_normal((2, 8)) * 2**24).astype(np.int64)
    gq = np.round(g_raw * 2**24).astype(np.int64)
    assert np.array_equal(compiled.kda_gate(gq, a, b), interpreted.kda_gate(gq, a, b))


def test_decay_gate_is_k3s_lower_bounded_form():
    g_raw = np.linspace(-20, 20, 64).reshape(8, 1, 8)
    g = kda.decay_gate(g_raw, np.array([0.0]), np.zeros((1, 8)))
    assert np.all((g >= -5) & (g <= 0))
    assert np.abs(g - (-5 / (1 + np.exp(-g_raw)))).max() < 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(q=a["q"].astype(np.int64)), "q: expected a float numpy array"),
        (lambda a: a.update(k=a["k"] * 2), "L2-normalised keys"),
        (lambda a: a.update(g=np.abs(a["g"])), "g: expected log-decays <= 0"),
        (lambda a: a.update(beta=a["beta"] + 1.5), r"beta: expected values in \[0, 1\]"),
        (lambda a: a.update(v=a["v"][:, :1]), r"v \[T, H, d_v\] and beta \[T, H\]"),
        (lambda a: a.update(v=a["v"] * 1e4), "expected |values| < 2048"),
        (lambda a: a.update(q=a["q"][None]), "q: expected 3 dimensions"),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(change, message):
    q, k, v, g, beta = inputs(4, 8, 2, 8)
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    change(args)
    with pytest.raises(ValueError, match=message):
        kda.recurrent(**args)


def test_chunk_size_is_checked():
    q, k, v, g, beta = inputs(4, 8, 1, 4)
    with pytest.raises(ValueError, match=r"chunk_size: expected an int in 1\.\.64"):
        kda.chunked(q, k, v, g, beta, chunk_size=65)
