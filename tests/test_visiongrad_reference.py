"""k3gates.vision.reference_grad against central finite differences of its own float64 forward:
for a seeded upstream gradient g and L = sum(g * output), every analytic gradient (inputs and
each weight, every coordinate) must match (L(a + h e_i) - L(a - h e_i)) / 2h to 1e-6 relative."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from k3gates.vision import reference as ref
from k3gates.vision import reference_grad as rg

H = 1e-6
TOL = 1e-6
WIDTH, HEADS, MLP = 16, 2, 32
SEGMENTS = ((2, 3), (3, 3))  # two packed images: 6 and 9 tokens
FRAMES, CHUNK, GH, GW, D = 3, 2, 3, 5, 4


def fd_grad(f: Callable[[np.ndarray], float], a: np.ndarray) -> np.ndarray:
    """Central differences of the scalar f at a, one coordinate at a time."""
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        up, down = a.copy(), a.copy()
        up[idx] += H
        down[idx] -= H
        g[idx] = (f(up) - f(down)) / (2 * H)
    return g


def rel_err(analytic: np.ndarray, numeric: np.ndarray) -> float:
    """|analytic - numeric| / |numeric| over the whole array (Frobenius norms)."""
    assert analytic.shape == numeric.shape
    return float(np.linalg.norm(analytic - numeric) / max(np.linalg.norm(numeric), 1e-30))


def block_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    pos_x = np.concatenate([np.indices(s)[1].ravel() for s in SEGMENTS])
    pos_y = np.concatenate([np.indices(s)[0].ravel() for s in SEGMENTS])
    cu = np.cumsum([0] + [a * b for a, b in SEGMENTS])
    n = int(cu[-1])
    mat = lambda o, i: rng.normal(0, i**-0.5, (o, i))
    w = {
        "g1": 1 + 0.1 * rng.normal(size=WIDTH),
        "wq": mat(WIDTH, WIDTH), "wk": mat(WIDTH, WIDTH), "wv": mat(WIDTH, WIDTH),
        "wo": mat(WIDTH, WIDTH),
        "g2": 1 + 0.1 * rng.normal(size=WIDTH),
        "w1": mat(MLP, WIDTH), "w2": mat(WIDTH, MLP),
    }  # fmt: skip
    x = rng.normal(size=(n, WIDTH))
    g = rng.normal(size=(n, WIDTH))
    return x, pos_x, pos_y, cu, w, g


def projector_case(seed: int = 1):
    rng = np.random.default_rng(seed)
    w = {
        "p1": rng.normal(0, 8**-0.5, (8, 8)),
        "p2": rng.normal(0, 8**-0.5, (12, 8)),
        "gp": 1 + 0.1 * rng.normal(size=12),
    }
    return rng.normal(size=(5, 8)), w, rng.normal(size=(5, 12))


# == the pieces ================================================================================
def test_gelu_grad():
    u = np.random.default_rng(2).normal(scale=2.0, size=50)
    numeric = (ref.gelu(u + H) - ref.gelu(u - H)) / (2 * H)
    assert rel_err(rg.gelu_grad(u), numeric) < TOL


def test_rmsnorm_backward():
    rng = np.random.default_rng(3)
    x, g, dy = rng.normal(size=(4, 7)), 1 + 0.1 * rng.normal(size=7), rng.normal(size=(4, 7))
    eps = 1e-3  # large enough to matter in the derivative
    dx, dg = rg.rmsnorm_backward(dy, x, g, eps)
    assert rel_err(dx, fd_grad(lambda a: np.sum(dy * ref.rmsnorm(a, g, eps)), x)) < TOL
    assert rel_err(dg, fd_grad(lambda a: np.sum(dy * ref.rmsnorm(x, a, eps)), g)) < TOL


def test_rope2d_backward_is_adjoint_and_inverse():
    rng = np.random.default_rng(4)
    x, dy = rng.normal(size=(6, 8)), rng.normal(size=(6, 8))
    pos_x, pos_y = rng.integers(0, 40, 6), rng.integers(0, 40, 6)
    # orthogonal: the backward undoes the forward, and the turn moves x (not the identity)
    assert np.allclose(rg.rope2d_backward(ref.rope2d(x, pos_x, pos_y), pos_x, pos_y), x,
                       rtol=0, atol=1e-12)  # fmt: skip
    assert not np.allclose(ref.rope2d(x, pos_x, pos_y), x)
    numeric = fd_grad(lambda a: np.sum(dy * ref.rope2d(a, pos_x, pos_y)), x)
    assert rel_err(rg.rope2d_backward(dy, pos_x, pos_y), numeric) < TOL


def test_attention_backward_from_p():
    rng = np.random.default_rng(5)
    n, dh = 7, 8
    q, k, v, dO = (rng.normal(size=(n, dh)) for _ in range(4))
    scale = dh**-0.5

    def loss(q, k, v):
        return np.sum(dO * (rg.attention_probs(q, k) @ v))

    P = np.exp(scale * q @ k.T)
    P /= P.sum(axis=1, keepdims=True)
    assert np.allclose(rg.attention_probs(q, k), P, rtol=0, atol=1e-14)
    got = rg.attention_backward_from_p(P, q, k, v, dO, scale)
    assert got["D"].shape == (n,)
    assert rel_err(got["dP"], fd_grad(lambda a: np.sum(dO * (a @ v)), P)) < TOL
    assert rel_err(got["dq"], fd_grad(lambda a: loss(a, k, v), q)) < TOL
    assert rel_err(got["dk"], fd_grad(lambda a: loss(q, a, v), k)) < TOL
    assert rel_err(got["dv"], fd_grad(lambda a: loss(q, k, a), v)) < TOL
    # dS is the gradient wrt the unscaled dot products s = q k^T
    s = q @ k.T

    def loss_s(s):
        e = np.exp(scale * s - (scale * s).max(axis=1, keepdims=True))
        return np.sum(dO * ((e / e.sum(axis=1, keepdims=True)) @ v))

    assert rel_err(got["dS"], fd_grad(loss_s, s)) < TOL


def test_merge_backward():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(FRAMES * GH * GW, D))
    out = ref.merge(x, FRAMES, CHUNK, GH, GW)
    dm = rng.normal(size=out.shape)
    dx = rg.merge_backward(dm, FRAMES, CHUNK, GH, GW, D)
    assert dx.shape == x.shape
    numeric = fd_grad(lambda a: np.sum(dm * ref.merge(a, FRAMES, CHUNK, GH, GW)), x)
    assert rel_err(dx, numeric) < TOL
    # the last chunk holds one frame: its gradient is dm itself, not dm / 2
    assert np.allclose(dx[2 * GH * GW :], numeric[2 * GH * GW :], rtol=0, atol=1e-8)


# == the block and the projector ===============================================================
def test_block_forward_stages():
    x, pos_x, pos_y, cu, w, _ = block_case()
    s = rg.block_forward(x, pos_x, pos_y, cu, w, HEADS)
    for name in ("h1", "q", "k", "v", "q_rope", "k_rope", "o", "attn_out", "x1", "h2", "u",
                 "a", "mlp_out", "x2"):  # fmt: skip
        assert s[name].shape[0] == x.shape[0], name
    assert s["u"].shape == (x.shape[0], MLP)
    # segments are independent: moving a token of the second image leaves the first unchanged
    x2 = x.copy()
    x2[-1] += 1.0
    t = rg.block_forward(x2, pos_x, pos_y, cu, w, HEADS)
    assert np.array_equal(t["x2"][: cu[1]], s["x2"][: cu[1]])
    assert not np.allclose(t["x2"][cu[1] : -1], s["x2"][cu[1] : -1])


@pytest.fixture(scope="module")
def block_grads():
    x, pos_x, pos_y, cu, w, g = block_case()
    fwd = rg.block_forward(x, pos_x, pos_y, cu, w, HEADS)
    dx, grads = rg.block_backward(fwd, g, pos_x, pos_y, cu, w, HEADS)
    return (x, pos_x, pos_y, cu, w, g), dx, grads


def block_loss(x, pos_x, pos_y, cu, w, g) -> float:
    return float(np.sum(g * rg.block_forward(x, pos_x, pos_y, cu, w, HEADS)["x2"]))


def test_block_backward_input(block_grads):
    (x, pos_x, pos_y, cu, w, g), dx, _ = block_grads
    numeric = fd_grad(lambda a: block_loss(a, pos_x, pos_y, cu, w, g), x)
    assert rel_err(dx, numeric) < TOL


@pytest.mark.parametrize("name", ["g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2"])
def test_block_backward_weights(block_grads, name):
    (x, pos_x, pos_y, cu, w, g), _, grads = block_grads
    assert grads[name].shape == w[name].shape
    numeric = fd_grad(lambda a: block_loss(x, pos_x, pos_y, cu, {**w, name: a}, g), w[name])
    assert rel_err(grads[name], numeric) < TOL


def test_projector_backward():
    merged, w, g = projector_case()
    loss = lambda m, w: float(np.sum(g * rg.projector_forward(m, w)["out"]))
    dm, grads = rg.projector_backward(rg.projector_forward(merged, w), g, w)
    assert rel_err(dm, fd_grad(lambda a: loss(a, w), merged)) < TOL
    assert set(grads) == {"p1", "p2", "gp"}
    for name in grads:
        assert grads[name].shape == w[name].shape
        numeric = fd_grad(lambda a, name=name: loss(merged, {**w, name: a}), w[name])
        assert rel_err(grads[name], numeric) < TOL, name


def test_the_check_can_fail(block_grads):
    """A wrong sign or a dropped residual is far outside the tolerance."""
    (x, pos_x, pos_y, cu, w, g), dx, grads = block_grads
    numeric = fd_grad(lambda a: block_loss(x, pos_x, pos_y, cu, {**w, "g2": a}, g), w["g2"])
    assert rel_err(-grads["g2"], numeric) > 1.0
    assert rel_err(dx - g, fd_grad(lambda a: block_loss(a, pos_x, pos_y, cu, w, g), x)) > 0.1
