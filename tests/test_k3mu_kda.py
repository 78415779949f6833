"""K3-μ KDA layer: float reference vs finite differences, integer kernels vs the float reference
(within the bounds kda.kernels_train declares), compiled == interpreted, and the state-domain
guard."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.kda import layer_train as face
from k3gates.kda import reference_train as ref

MODNAME = "k3gates.kda.kernels_train"
X_FRAC, W_FRAC, D_FRAC = 16, 20, 24


def interpreted():
    return importlib.import_module(MODNAME)


@pytest.fixture(scope="module")
def compiled():
    return kc.load(MODNAME)


def real_params(rng: np.random.Generator, d: int, heads: int = 2) -> dict[str, np.ndarray]:
    """Random real parameters: face.init (dk = d / heads) with norm_w off its flat init."""
    p = face.init(rng, d, heads)
    p["norm_w"] = p["norm_w"] + rng.normal(0.0, 0.2, p["norm_w"].shape)
    return p


def quantize(p: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """(integer Q.20 weights, the real values they stand for)."""
    q = {k: np.round(v * 2.0**W_FRAC).astype(np.int64) for k, v in p.items()}
    return q, {k: v * 2.0**-W_FRAC for k, v in q.items()}


def inputs(rng, B, T, d, dy_scale=1.0):
    x = np.round(rng.normal(0.0, 1.0, (B, T, d)) * 2.0**X_FRAC).astype(np.int64)
    dy = np.round(rng.normal(0.0, dy_scale, (B, T, d)) * 2.0**D_FRAC).astype(np.int64)
    return x, dy


# -- 1. float backward vs central finite differences ---------------------------------------------
def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    B, T, d = 2, 6, 8
    p = real_params(rng, d)
    x = rng.normal(0.0, 1.0, (B, T, d))
    dy = rng.normal(0.0, 1.0, (B, T, d))
    _, cache = ref.forward(x, p)
    dx, grads = ref.backward(dy, x, p, cache)
    trained = [name for name, _, opt in face.PARAMS if opt[0] != "fixed"]
    assert sorted(grads) == sorted(trained)

    def loss(xv, pv):
        return float(np.sum(ref.forward(xv, pv)[0] * dy))

    def numeric(arr, f):
        out = np.zeros_like(arr)
        h = 1e-6
        for idx in np.ndindex(arr.shape):
            a = arr.copy()
            a[idx] += h
            up = f(a)
            a[idx] -= 2 * h
            out[idx] = (up - f(a)) / (2 * h)
        return out

    checks = {"x": (dx, numeric(x, lambda a: loss(a, p)))}
    for name in trained:
        checks[name] = (grads[name], numeric(p[name], lambda a, n=name: loss(x, {**p, n: a})))
    for name, (analytic, num) in checks.items():
        scale = np.max(np.abs(num))
        assert scale > 1e-3, name  # a gradient that is identically zero checks nothing
        assert np.max(np.abs(analytic - num)) <= 1e-6 * scale, name


# -- 2, 3. integer kernels vs the float reference on the same integer inputs ---------------------
def compare(mod, B, T, d, seed, dy_scale=1.0, silent_start=False, heads=2):
    rng = np.random.default_rng(seed)
    pq, pr = quantize(real_params(rng, d, heads))
    x, dy = inputs(rng, B, T, d, dy_scale)
    if silent_start:
        x[:, 0] = 0  # v_0 = 0, so o_0 = 0 and the head RMSNorm amplifies dy by 1/sqrt(eps)
    y, cache = face.forward(mod, x, pq)
    dx, grads = face.backward(mod, dy, x, pq, cache)
    yr, cr = ref.forward(x * 2.0**-X_FRAC, pr)
    dxr, gr = ref.backward(dy * 2.0**-D_FRAC, x * 2.0**-X_FRAC, pr, cr)
    return (y, yr * 2.0**X_FRAC), {"x": (dx, dxr * 2.0**D_FRAC)} | {
        k: (grads[k], gr[k] * 2.0**D_FRAC) for k in gr
    }


def check_forward(got, want):
    kda = interpreted()
    bound = kda.Y_MAX_ERR_LSB
    rms = np.sqrt(np.mean(want**2))
    assert bound <= 0.05 * rms, (bound, rms)
    err = np.max(np.abs(got - want))
    assert err <= bound, (err, bound)
    return err / rms


def check_backward(pairs):
    kda = interpreted()
    worst = {}
    for name, (got, want) in pairs.items():
        rms = np.sqrt(np.mean(want**2))
        bound = kda.GRAD_MAX_ERR_REL_Q20 * np.max(np.abs(want)) / 2**20 + kda.GRAD_MAX_ERR_LSB
        assert bound <= 0.05 * rms, (name, bound, rms)
        err = np.max(np.abs(got - want))
        assert err <= bound, (name, err, bound)
        worst[name] = err / rms
    return worst


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_integer_matches_reference_interpreted(seed):
    fwd, bwd = compare(interpreted(), B=2, T=8, d=8, seed=seed)
    check_forward(*fwd)
    check_backward(bwd)


@pytest.mark.parametrize("seed", [4, 5])
def test_integer_matches_reference_k3mu_width(compiled, seed):
    """The K3-μ head shape (d = 64: H = 2, dk = 32) on shorter sequences."""
    fwd, bwd = compare(compiled, B=2, T=24, d=64, seed=seed, dy_scale=0.3)
    assert check_forward(*fwd) < 1e-3
    assert max(check_backward(bwd).values()) < 1e-3


@pytest.mark.parametrize("seed", [6, 7])
def test_integer_matches_reference_one_head(compiled, seed):
    """The passkey model's shape (d = 16: one head of dk = 16), H and dk read from the shapes."""
    fwd, bwd = compare(compiled, B=2, T=24, d=16, seed=seed, heads=1)
    check_forward(*fwd)
    check_backward(bwd)


def test_do_beyond_its_domain_is_scaled_into_it(compiled):
    """A head whose o is 0 at t = 0 (training meets this) gets do = dy w_o / sqrt(eps): past the
    recurrence's 2^37-raw domain. kda_bwd_rec scales that sequence's do into the domain and its
    outputs back, and the gradients still meet the declared bounds."""
    kda = interpreted()
    rng = np.random.default_rng(11)
    d = 64
    pq, _ = quantize(real_params(rng, d))
    x, dy = inputs(rng, 2, 16, d, dy_scale=6.0)
    x[:, 0] = 0
    _y, cache = face.forward(compiled, x, pq)
    oh, rn, gs, gated = cache[-4:]
    do = compiled.kda_bwd_out(dy, gated, oh, rn, gs, pq["norm_w"], pq["w_o"])[0]
    assert np.abs(do).max() > 1 << kda.STATE_NORM_BITS  # the case the scaling exists for
    fwd, bwd = compare(compiled, B=2, T=16, d=d, seed=11, dy_scale=6.0, silent_start=True)
    check_forward(*fwd)
    check_backward(bwd)


# -- 4. compiled == interpreted, bit for bit -------------------------------------------------------
def test_compiled_equals_interpreted(compiled):
    rng = np.random.default_rng(7)
    B, T, d = 2, 7, 8
    pq, _ = quantize(real_params(rng, d))
    pq["dt_bias"][0] = -(1 << 21)  # negative values everywhere, including the gate's
    x, dy = inputs(rng, B, T, d)
    outs = []
    for mod in (interpreted(), compiled):
        y, cache = face.forward(mod, x, pq)
        dx, grads = face.backward(mod, dy, x, pq, cache)
        outs.append([y, *cache, dx, *(grads[k] for k in sorted(grads))])
    assert np.any(outs[0][0] < 0) and np.any(outs[0][14] < 0)  # y and dx take both signs
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.dtype == np.int64 and b.dtype == np.int64
        np.testing.assert_array_equal(a, b)


def test_sequences_are_independent(compiled):
    """Each sequence's output and its share of the gradients depend on that sequence alone, and
    threads cannot change the result (the batch is split across OpenMP threads)."""
    rng = np.random.default_rng(8)
    pq, _ = quantize(real_params(rng, 16))
    x, dy = inputs(rng, 3, 9, 16)
    y, cache = face.forward(compiled, x, pq)
    y1, _ = face.forward(compiled, x[1:2].copy(), pq)
    np.testing.assert_array_equal(y[1:2], y1)
    dx, g = face.backward(compiled, dy, x, pq, cache)
    dx2, g2 = face.backward(compiled, dy, x, pq, cache)
    np.testing.assert_array_equal(dx, dx2)
    for k in g:
        np.testing.assert_array_equal(g[k], g2[k])


# -- the recurrence's int64 domain is guarded, not silently wrapped ----------------------------
def test_state_outside_domain_raises():
    rng = np.random.default_rng(9)
    d = 8
    pq, _ = quantize(real_params(rng, d))
    pq["w_qkv"][2 * d :] = 8 << W_FRAC  # v rows at the contract's |W| <= 2^3
    pq["conv"][:] = 8 << W_FRAC
    x = np.full((1, 6, d), 32 << X_FRAC, dtype=np.int64)  # |x| = 2^5
    with pytest.raises(face.StateDomainError, match="kda_fwd_qkv"):
        face.forward(interpreted(), x, pq)


def test_params_table():
    d = 64
    shapes = {name: fn(d) for name, fn, _ in face.PARAMS}
    init = face.init(np.random.default_rng(0), d)
    assert {k: v.shape for k, v in init.items()} == shapes
    opts = {name: opt for name, _, opt in face.PARAMS}
    assert opts["w_qkv"] == ("muon", 6, 0) and opts["w_o"] == ("muon", 2, 1)
    assert opts["a_head"] == ("fixed",)
    assert np.all((init["a_head"] >= 1) & (init["a_head"] <= 16))


def test_params_table_of_one_head():
    d = 16
    table = face.params(1)
    init = face.init(np.random.default_rng(0), d, heads=1)
    assert {k: v.shape for k, v in init.items()} == {name: fn(d) for name, fn, _ in table}
    opts = {name: opt for name, _, opt in table}
    assert opts["w_qkv"] == ("muon", 3, 0) and opts["w_f"] == ("muon", 1, 0)
    assert init["a_head"].shape == (1,) and init["norm_w"].shape == (16,)
