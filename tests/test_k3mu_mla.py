"""K3-μ Gated MLA (NoPE): float backward vs finite differences, integer forward and backward vs
float64 on the same integers (declared bounds, each < 5% of the reference RMS), compiled ==
interpreted bit for bit, and the face's domain check."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.mla import layer_train as face
from k3gates.mla import reference_train as ref

MODNAME = "k3gates.mla.kernels_train"
W_FRAC, ACT_FRAC, GRAD_FRAC = 20, 16, 24
TINY = dict(d=16, heads=2, nope=8, rope=4, dv=6, ql=8, kl=10)  # unequal sizes catch mix-ups
K3MU = dict(d=64, heads=2, nope=32, rope=16, dv=32, ql=32, kl=32)


def make_params(rng, d, heads, nope, rope, dv, ql, kl, scale=1.0):
    def mat(rows, cols):
        return rng.normal(0.0, scale * cols**-0.5, (rows, cols))

    return {
        "w_dq": mat(ql, d),
        "q_norm": 1.0 + 0.2 * rng.normal(size=ql),
        "w_uq": mat(heads * (nope + rope), ql),
        "w_dkv": mat(kl, d),
        "kv_norm": 1.0 + 0.2 * rng.normal(size=kl),
        "w_kr": mat(rope, d),
        "w_uk": mat(heads * nope, kl),
        "w_uv": mat(heads * dv, kl),
        "w_g": mat(heads * dv, d),
        "w_o": mat(d, heads * dv),
    }


def quantise(a, frac):
    return np.round(a * 2.0**frac).astype(np.int64)


def case(seed, b, t, dims, scale=1.0):
    """(integer x, p, dy) and their exact dequantised float twins."""
    rng = np.random.default_rng(seed)
    p_int = {k: quantise(v, W_FRAC) for k, v in make_params(rng, **dims, scale=scale).items()}
    x_int = quantise(rng.normal(size=(b, t, dims["d"])), ACT_FRAC)
    dy_int = quantise(rng.normal(size=(b, t, dims["d"])), GRAD_FRAC)
    p_f = {k: v * 2.0**-W_FRAC for k, v in p_int.items()}
    return x_int, p_int, dy_int, x_int * 2.0**-ACT_FRAC, p_f, dy_int * 2.0**-GRAD_FRAC


@pytest.fixture(scope="module")
def compiled():
    return kc.load(MODNAME)


@pytest.fixture(scope="module")
def interpreted():
    return kc.interpreted(MODNAME)


# -- 1. float backward vs central finite differences ------------------------------------------
def test_float_backward_matches_finite_differences():
    _x_i, _p_i, _dy_i, x, p, dy = case(3, 2, 5, TINY)
    _y, cache = ref.forward(x, p)
    dx, grads = ref.backward(dy, x, p, cache)
    h = 1e-5

    def loss():
        return float(np.sum(ref.forward(x, p)[0] * dy))

    def fd(arr):
        out = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            keep = arr[idx]
            arr[idx] = keep + h
            up = loss()
            arr[idx] = keep - h
            down = loss()
            arr[idx] = keep
            out[idx] = (up - down) / (2 * h)
        return out

    assert set(grads) == {name for name, _s, _o in face.PARAMS}
    for name in grads:
        num = fd(p[name])
        err = np.abs(num - grads[name]).max() / np.abs(grads[name]).max()
        assert err < 1e-7, (name, err)
    err = np.abs(fd(x) - dx).max() / np.abs(dx).max()
    assert err < 1e-7, ("dx", err)


# -- 2, 3. integer vs float64 on the same integers --------------------------------------------
def integer_vs_float(mod, seed, b, t, dims):
    """Max errors (in the outputs' LSB) and the reference RMS of y, dx and every gradient."""
    x_i, p_i, dy_i, x, p, dy = case(seed, b, t, dims)
    y_i, cache_i = face.forward(mod, x_i, p_i)
    y, cache = ref.forward(x, p)
    dx_i, g_i = face.backward(mod, dy_i, x_i, p_i, cache_i)
    dx, g = ref.backward(dy, x, p, cache)
    rows = {"y": (np.abs(y_i * 2.0**-ACT_FRAC - y).max() * 2.0**ACT_FRAC, rms(y))}
    rows["dx"] = (np.abs(dx_i * 2.0**-GRAD_FRAC - dx).max() * 2.0**GRAD_FRAC, rms(dx))
    for name in g:
        err = np.abs(g_i[name] * 2.0**-GRAD_FRAC - g[name]).max() * 2.0**GRAD_FRAC
        rows[name] = (err, rms(g[name]))
    return rows


def rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


def check_rows(rows, n_tokens):
    """Every error within its declared bound, and each bound below 5% of the reference RMS."""
    kern = kc.interpreted(MODNAME)  # the declared bounds are Python constants of the source
    fwd = kern.FORWARD_MAX_ERR_LSB
    bwd = kern.backward_max_err_lsb(n_tokens)
    assert rows["y"][0] <= fwd, rows["y"]
    assert fwd * 2.0**-ACT_FRAC <= 0.05 * rows["y"][1]
    for name, (err, size) in rows.items():
        if name == "y":
            continue
        assert err <= bwd, (name, err, bwd)
        assert bwd * 2.0**-GRAD_FRAC <= 0.05 * size, (name, size)


def test_integer_matches_float_tiny_interpreted(interpreted):
    check_rows(integer_vs_float(interpreted, 5, 2, 7, TINY), 14)


def test_integer_matches_float_k3mu_compiled(compiled):
    for seed in (11, 12):
        check_rows(integer_vs_float(compiled, seed, 2, 12, K3MU), 24)


def test_integer_matches_float_training_shape(compiled):
    """B = 8, T = 64 (the training batch): the bounds still hold and the kernels are fast."""
    check_rows(integer_vs_float(compiled, 21, 8, 64, K3MU), 512)


def test_bounds_discriminate(interpreted):
    """The declared bounds are far tighter than the signal: a sign flip or a zero fails."""
    x_i, p_i, dy_i, x, p, dy = case(7, 1, 6, TINY)
    y_i, cache_i = face.forward(interpreted, x_i, p_i)
    dx_i, g_i = face.backward(interpreted, dy_i, x_i, p_i, cache_i)
    y, cache = ref.forward(x, p)
    dx, g = ref.backward(dy, x, p, cache)
    bwd = interpreted.backward_max_err_lsb(6) * 2.0**-GRAD_FRAC
    assert np.abs(-y_i * 2.0**-ACT_FRAC - y).max() > interpreted.FORWARD_MAX_ERR_LSB * 2.0**-16
    assert np.abs(0 * dx_i - dx).max() > bwd
    for name in g:
        assert np.abs(-g_i[name] * 2.0**-GRAD_FRAC - g[name]).max() > bwd, name


# -- 4. compiled == interpreted ---------------------------------------------------------------
def test_compiled_equals_interpreted(compiled, interpreted):
    x_i, p_i, dy_i, *_ = case(9, 2, 6, TINY)
    x_i[0, 0, :4] = [-(2**20), -(2**16) - 1, -3, 2**20 + 1]  # negatives and power-of-two edges
    y_c, cache_c = face.forward(compiled, x_i, p_i)
    y_p, cache_p = face.forward(interpreted, x_i, p_i)
    assert np.array_equal(y_c, y_p)
    for a, b in zip(cache_c, cache_p, strict=True):
        assert np.array_equal(a, b)
    dx_c, g_c = face.backward(compiled, dy_i, x_i, p_i, cache_c)
    dx_p, g_p = face.backward(interpreted, dy_i, x_i, p_i, cache_p)
    assert np.array_equal(dx_c, dx_p)
    for name in g_c:
        assert np.array_equal(g_c[name], g_p[name]), name


def test_batch_rows_independent(compiled):
    """Each sequence is computed on its own: a batch of two equals two batches of one, bit for
    bit (so thread scheduling over sequences cannot change a result)."""
    x_i, p_i, *_ = case(13, 2, 9, K3MU)
    y, _ = face.forward(compiled, x_i, p_i)
    for b in range(2):
        y_b, _ = face.forward(compiled, np.ascontiguousarray(x_i[b : b + 1]), p_i)
        assert np.array_equal(y_b[0], y[b])


def test_domain_error_is_raised(interpreted):
    """Weights far outside the documented domain make the face refuse, naming the kernel."""
    x_i, p_i, *_ = case(4, 1, 4, TINY)
    p_i = dict(p_i)
    p_i["w_uq"] = p_i["w_uq"] * 4096
    with pytest.raises(face.DomainError, match="mla_forward"):
        face.forward(interpreted, x_i, p_i)
