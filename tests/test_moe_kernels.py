"""LatentMoE kernels: compiled == interpreted on negative inputs, the exact split rounding, the
tie-break, Quantile Balancing's exactness, and the constants the bounds are built from."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal
from k3gates.moe import kernels as K

MOE = "k3gates.moe.kernels"


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(MOE), kc.interpreted(MOE)


@pytest.fixture(scope="module")
def tiny() -> dict:
    """A small problem with negative inputs everywhere (Pythran's // and % trap)."""
    rng = np.random.default_rng(7)
    t, d, d_l, f, n, k, f_s = 5, 6, 4, 3, 6, 2, 3

    def w(*shape):
        return np.round(rng.uniform(-0.4, 0.4, shape) * 2**24).astype(np.int64)

    return {
        "x": -np.abs(np.round(rng.normal(0, 1, (t, d)) * 2**24)).astype(np.int64),
        "w_r": w(n, d), "w_down": w(d_l, d), "w1": w(n, f, d_l), "w3": w(n, f, d_l),
        "w2": w(n, d_l, f), "w_n": -np.abs(w(d_l)), "w_up": w(d, d_l), "ws1": w(f_s, d),
        "ws3": w(f_s, d), "ws2": w(d, f_s),
        "b": np.round(rng.normal(0, 0.1, n) * 2**40).astype(np.int64), "k": k,
        "rsf": round(2.827 * 2**24), "eps": round(1e-6 * 2**56),
        "dc": np.round(rng.uniform(-1, 1, (t, d_l)) * 2**48).astype(np.int64),
    }  # fmt: skip


def test_every_kernel_compiled_equals_interpreted_on_negatives(kernels, tiny):
    p = tiny
    outs = []
    for kern in kernels:
        s, idx, wts = kern.router(p["x"], p["w_r"], p["b"], p["k"], p["rsf"])
        weights = [p[n] for n in ("w_down", "w1", "w3", "w2", "w_n")]
        rest = [p[n] for n in ("w_up", "ws1", "ws3", "ws2")]
        layer = kern.moe_layer(p["x"], idx, wts, *weights, p["eps"], *rest)
        qb = kern.qb_update(s, -np.abs(p["b"]), p["k"])
        back = kern.expert_backward(layer[1], idx, wts, p["dc"], p["w1"], p["w3"], p["w2"])
        norm = kern.latent_rmsnorm(-np.abs(layer[2]), p["w_n"], p["eps"], 48, 40)
        outs.append((s, idx, wts, *layer, qb, *back, norm))
    assert bit_equal(outs[0], outs[1])


def exact_round(num: Fraction) -> int:
    """Round half away from zero, exactly."""
    r = abs(num)
    q = int(r)
    if r - q >= Fraction(1, 2):
        q += 1
    return q if num >= 0 else -q


def test_round_split_is_exact_half_away_from_zero(kernels):
    _, interp = kernels
    rng = np.random.default_rng(1)
    cases = [
        (h, lo)
        for h in (-3, -1, 0, 1, 2)
        for lo in (-(1 << 24), -(1 << 23), -1, 0, 1, (1 << 23), (1 << 23) + 1, (1 << 25))
    ]
    cases += [(int(rng.integers(-(1 << 40), 1 << 40)), int(rng.integers(-(1 << 50), 1 << 50)))
              for _ in range(2000)]  # fmt: skip
    for hi, lo in cases:
        for shift in (24, 40, 48):
            want = exact_round(Fraction(hi * 2**24 + lo, 2**shift))
            assert interp.round_split(hi, lo, shift) == want, (hi, lo, shift)


def test_equal_scores_choose_the_lower_index_and_the_order_rule(kernels):
    compiled, _ = kernels
    w_r = np.zeros((10, 3), dtype=np.int64)  # every logit 0: every score 1/2
    b = np.array([0, 5, 5, 0, 7, 7, 0, 0, 7, 0], dtype=np.int64)
    _, idx, _ = compiled.router(np.zeros((2, 3), dtype=np.int64), w_r, b, 5, 1 << 24)
    assert idx.tolist() == [[4, 5, 8, 1, 2]] * 2  # by biased score, then by index


def count_around_q(s, b, b1, k):
    """Per expert: tokens strictly above their old threshold c_i under b', and at or above it."""
    n = s.shape[1]
    c = np.sort(s + b, axis=1)[:, n - 1 - k]
    new = s + b1 - c[:, None]
    return (new > 0).sum(axis=0), (new >= 0).sum(axis=0)


def test_one_qb_update_puts_q_tokens_above_the_old_thresholds(kernels):
    """b'_j is column j's (q+1)-th margin, so at most q tokens are strictly above their old
    threshold c_i and at least q + 1 at or above it. Margins tie exactly at 0 (each token's
    (k+1)-th expert defines c_i), so "strictly above" can be fewer than q: QB's own ties."""
    compiled, _ = kernels
    rng = np.random.default_rng(2)
    m, n, k = 96, 12, 3  # q = 24
    s = rng.integers(0, 1 << 40, (m, n))
    b = rng.integers(-(1 << 36), 1 << 36, n)
    b1 = compiled.qb_update(s, b, k)
    above, at_or_above = count_around_q(s, b, b1, k)
    assert np.all(above <= 24) and np.all(at_or_above >= 25) and np.any(above == 24)
    # q = floor(m k / n) when n does not divide m k: 97 * 3 / 12 = 24.25 -> 24
    s2 = rng.integers(0, 1 << 40, (97, n))
    zero = np.zeros(n, dtype=np.int64)
    above, at_or_above = count_around_q(s2, zero, compiled.qb_update(s2, zero, k), k)
    assert np.all(above <= 24) and np.all(at_or_above >= 25)
    # the update depends on the batch, not its order
    perm = rng.permutation(m)
    assert np.array_equal(compiled.qb_update(np.ascontiguousarray(s[perm]), b, k), b1)


def test_situ_slope_constants_cover_the_float_situ():
    """SITU_DG_MAX etc. (the bounds' slopes) against SiTU-GLU's derivatives on a fine grid."""
    g = np.linspace(-80, 80, 1_600_001)
    t, s = np.tanh(g / 4), 1 / (1 + np.exp(-g))
    f = 4 * t * s
    f1 = (1 - t * t) * s + 4 * t * s * (1 - s)
    f2 = np.gradient(f1, g)
    u = np.linspace(-300, 300, 600_001)
    tu = np.tanh(u / 25)
    h2 = -2 / 25 * tu * (1 - tu * tu)
    assert 25 * np.abs(f1).max() < K.SITU_DG_MAX  # 23.16 < 24
    assert np.abs(f).max() <= K.SITU_DU_MAX  # |f| <= 4, h' <= 1
    assert 25 * np.abs(f2).max() < K.SITU_DGG_MAX  # 12.58 < 13
    assert np.abs(f1).max() < K.SITU_DGU_MAX
    assert 4 * np.abs(h2).max() < 1 / K.SITU_DUU_INV  # 0.123 < 1/8
    assert K.SITU_FLOOR_E == 100 * 2 ** (58 - 52)  # beta beta_lin 2^-52 in units 2^-58


def test_declared_bounds_are_the_documented_numbers_and_grow_with_the_shape():
    assert K.layer_bound_q10(32, 8) == 592  # as the kernels' docstring states
    assert K.weights_bound_q10(8) == 38
    assert K.backward_bounds_q10(32, 8, 32) == [598, 685, 1174, 665, 645]
    assert K.layer_bound_q10(64, 8) > K.layer_bound_q10(32, 8) < K.layer_bound_q10(32, 16)
    assert all(a <= b for a, b in zip(K.backward_bounds_q10(32, 8, 32),
                                       K.backward_bounds_q10(32, 8, 64), strict=True))  # fmt: skip
    assert 512 < K.SCORE_MAX_ERR_LSB_Q10 < 1024 < K.QB_BIAS_MAX_ERR_LSB_Q10 < 1024 + 16


def test_rmsnorm_of_the_largest_rows_uses_the_prescaled_exact_sum(kernels):
    """|c| near 2^11 over K3's latent width 3584 passes 2^123 in the sum of squares: the kernel
    pre-rounds and still gives w c / rms within half an LSB of Q.32."""
    compiled, _ = kernels
    c = np.full((1, 3584), -3000 * 2**48, dtype=np.int64)
    c[0, ::2] *= -1
    w = np.full(3584, 1 << 24, dtype=np.int64)
    r = compiled.latent_rmsnorm(c, w, 0, 48, 32)
    assert np.all(np.abs(r - np.sign(c) * 2**32) <= 0.5)
