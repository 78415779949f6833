"""The vision backward's integer kernels (k3gates.vision.kernels_grad) at small sizes: against the
float64 reference, exact where the arithmetic is exact, and stopping outside their domains. The gate
(vision_backward) holds them at K3's width."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.infra import compile as kcompile
from k3gates.vision import backward as BW
from k3gates.vision import block as B
from k3gates.vision import reference_grad as rg


@pytest.fixture(scope="module")
def k() -> BW.GradKernels:
    return BW.GradKernels(kcompile.load)


def _chain(k, rng, n=(12, 9), width=128, heads=1, mlp=256):
    w = B.init_block(rng, width=width, heads=heads, head_dim=128, mlp=mlp)
    x = np.round(rng.normal(0, 1, (sum(n), width)) * 2**16).astype(np.int64)
    grids = [B.grid_positions(3, 4), B.grid_positions(3, 3)]
    pos = [np.concatenate(p) for p in zip(*grids, strict=True)]
    cu = np.array([0, n[0], sum(n)])
    s = B.forward(k, x, pos, cu, w, heads)
    dx2 = np.round(rng.normal(0, 1, (sum(n), width)) * 2**24).astype(np.int64)
    return w, x, pos, cu, s, dx2


def test_the_block_backward_matches_float64_end_to_end(k):
    """Every gradient within 1e-4 of float64's largest (the integer forward's rounding carried
    through); a dropped residual or a sign error would be off by far more."""
    w, x, pos, cu, s, dx2 = _chain(k, np.random.default_rng(1))
    d, dw = BW.backward(k, s, w, dx2, pos, cu, 1)
    wf = {n: v * 2.0**-20 for n, v in w.items()}
    fwd = rg.block_forward(x * 2.0**-16, *pos, cu, wf, 1)
    dx, grads = rg.block_backward(fwd, dx2 * 2.0**-24, *pos, cu, wf, 1)
    assert np.abs(d["x"] * 2.0**-24 - dx).max() <= 1e-4 * np.abs(dx).max()
    for name, g in grads.items():
        assert np.abs(dw[name] * 2.0**-24 - g).max() <= 1e-4 * np.abs(g).max(), name


def test_the_rope_turned_back_undoes_the_rope(k):
    """R(-theta) R(theta) = I up to the two roundings, and turning back is the same kernel's
    rotation with each pair's second member negated before and after: exact, not approximate."""
    rng = np.random.default_rng(2)
    q = np.round(rng.normal(0, 1, (20, 256)) * 2**16).astype(np.int64)
    px, py = rng.integers(0, 512, 20), rng.integers(0, 512, 20)
    turned = k.rope(q, px, py, 2)  # Q.20
    back = BW.GradKernels(kcompile.load).rope_back(turned, px, py, 2)  # no forward ran on it
    assert np.abs(back - (q << 4)).max() <= 2
    want = rg.rope2d_backward(turned.reshape(-1, 128) * 2.0**-20, np.repeat(px, 2),
                              np.repeat(py, 2)).reshape(20, 256) * 2**20  # fmt: skip
    assert np.abs(back - want).max() <= 1.002


def test_gelu_backward_within_its_bound_and_zero_far_left(k):
    u = np.concatenate([np.arange(-12 << 16, 12 << 16, 977), [0, 1 << 40, -(1 << 40)]])
    da = np.full(u.size, (1 << 37) - 1, dtype=np.int64)
    got = k.grad.gelu_backward(u.reshape(1, -1), da.reshape(1, -1))[0]
    x = u * 2.0**-16
    want = np.where(x > 30, 1.0, np.where(x < -30, 0.0, rg.gelu_grad(np.clip(x, -30, 30))))
    assert np.abs(got - want * da).max() <= 514 / 1024
    assert got[-3] == da[-3] // 2 + 1 or abs(got[-3] - da[-3] / 2) <= 0.5  # GELU'(0) = 1/2
    assert got[-2] == da[-2] and got[-1] == 0


def test_merge_backward_is_the_adjoint_of_merge(k):
    """<merge(x), dm> = <x, merge_backward(dm)> for one frame (exact: no division), and with a
    chunk of frames each frame gets the mean's gradient / frames."""
    rng = np.random.default_rng(4)
    x = rng.integers(-(1 << 20), 1 << 20, (3 * 5, 4))
    dm = rng.integers(-(1 << 20), 1 << 20, (2 * 3, 16))
    merged = k.block.merge(x, 1, 4, 3, 5)
    back = k.grad.merge_backward(dm, 1, 4, 3, 5)
    assert int(np.sum(merged * dm)) == int(np.sum(x * back))
    dm4 = rng.integers(-(1 << 30), 1 << 30, (2 * 3, 16))
    back4 = k.grad.merge_backward(dm4, 4, 4, 3, 5)
    want = rg.merge_backward(dm4.astype(np.float64), 4, 4, 3, 5, 4)
    assert np.abs(back4 - want).max() <= 0.5 and np.abs(want).max() > 1


def test_attention_backward_equals_its_probe_and_stops_outside_its_domain(k):
    rng = np.random.default_rng(5)
    w, x, pos, cu, s, dx2 = _chain(k, rng)
    q, keys, v = B.attention_inputs(s)
    d_o = rng.integers(-(1 << 26), 1 << 26, (len(x), 128))
    dq, dk, dv, outside = k.grad.attention_backward(q, keys, v, d_o, cu, 1, k.scale)
    assert outside == 0
    for seg in range(2):
        lo, hi = cu[seg], cu[seg + 1]
        probe = k.grad.attention_backward_head(q, keys, v, d_o, cu, 1, k.scale, seg, 0)
        for got, whole in zip(probe[4:], (dq, dk, dv), strict=True):
            assert np.array_equal(got, whole[lo:hi])
    # dO large enough that |dP| passes 2^10: counted, never silently wrong
    *_, outside = k.grad.attention_backward(q, keys, v, d_o << 12, cu, 1, k.scale)
    assert outside > 0
    # and a block backward driven outside any kernel's domain stops instead of returning
    with pytest.raises(OverflowError, match="outside"):
        BW.backward(k, s, w, dx2 << 30, pos, cu, 1)
