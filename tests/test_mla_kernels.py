"""k3gates.mla kernels: compiled == interpreted on negative inputs, the exact two-limb and 124-bit
arithmetic against Python integers, the declared bounds recomputed, and a decode step over a
2^20-token latent cache (the long-context use)."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.infra.gate import bit_equal
from k3gates.mla import backward_int, forward_int
from k3gates.mla import gate as G
from k3gates.mla import kernels as K

MLA = "k3gates.mla.kernels"


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(MLA), kc.interpreted(MLA)


def exact_round(total: int, s: int) -> int:
    q = (abs(total) + (1 << (s - 1))) >> s
    return q if total >= 0 else -q


def test_round_limbs_is_rshift_round_of_the_exact_integer(kernels):
    compiled, interpreted = kernels
    rnd = random.Random(1)
    his, los, want = [], [], []
    for _ in range(20000):
        total = rnd.randint(-(2**80), 2**80) >> rnd.randint(0, 60)
        if rnd.random() < 0.3:  # exact ties and their neighbours
            total = (rnd.randint(-(2**40), 2**40) << 20) + (1 << 19) + rnd.choice((-1, 0, 1))
        hi = (total >> 28) + rnd.randint(-3, 3)
        his.append(hi)
        los.append(total - hi * (1 << 28))
        want.append(exact_round(total, 20))
    got = compiled.round_limbs_array(np.array(his), np.array(los), 28, 20)
    assert got.tolist() == want
    for hi, lo, w in list(zip(his, los, want, strict=True))[:500]:
        assert interpreted.round_limbs(hi, lo, 28, 20) == w
    for s in (28, 29, 43, 62):  # shifts at and beyond the limb
        assert interpreted.round_limbs(-5, 123, 28, s) == exact_round(-5 * 2**28 + 123, s)


def test_wide_add_accumulates_exactly(kernels):
    _, k = kernels
    rnd = random.Random(2)
    hi, lo, total = 0, 0, 0
    for _ in range(3000):
        a = rnd.randint(-(2**62), 2**62)
        b = rnd.randint(-(2**62), 2**62) >> rnd.randint(0, 62)
        hi, lo = k.wide_add(hi, lo, a, b)
        total += a * b
        assert 0 <= lo < 2**62 and hi * 2**62 + lo == total
    assert k.wide_round(hi, lo, 70, 2**61) == max(-(2**61), min(exact_round(total, 70), 2**61))


def test_the_declared_bounds_recompute_from_their_formulas():
    n = 64
    # attend: 1/2 + n 513 2^-17 + 2^-8 (1 + 2^-31) + 2^-10 (float64), in 2^-10 LSB, rounded up
    want = Fraction(1, 2) + Fraction(513 * n, 2**17) + Fraction(1, 2**8) * (1 + Fraction(1, 2**31))
    assert K.attend_bound_q10(n) >= (want + Fraction(1, 2**10)) * 1024
    assert K.attend_bound_q10(n) - (want + Fraction(1, 2**10)) * 1024 < 2
    assert K.output_bound_q10(n) == 513 + 16 * (K.GATED_MAX_ERR_LSB_Q10 + K.attend_bound_q10(n))
    # formats the docstring's limb analysis uses
    assert K.SCORE_TOTAL_FRAC == 52 and K.SCORE_SHIFT == 20 and K.VALUE_SHIFT == 43
    assert K.ROPE_HI_SHIFT == 12 and K.Z_LIM == 2**60 and K.O_LIM == 2**24 - 1


def test_backward_bounds_recompute_in_exact_rationals():
    n, h = 48, 4
    rho, a = Fraction(1, 2**47), Fraction(1, 2**52) + Fraction(n, 2**63)
    row, col = rho + n * a, n * (rho + a)
    dp, kr, c, q, l1, do = 8, 8, 8, 2, 32, 4
    e = Fraction(1, 2**49) + Fraction(1, 2**55) + dp * row + Fraction(1, 2**48)
    e_s = n * Fraction(1, 2**49) + row * (2 * dp + e) + 2 * e
    e_c = n * Fraction(1, 2**49) + col * (2 * dp + e) + n * e
    lsb = 2**24 * 1024  # real -> 2^-10 LSB of Q.24
    want = (
        e_s * kr,
        l1 * (Fraction(1, 2**49) + e_s * c),
        h * l1 * (2 * Fraction(1, 2**49) + e_c * q + col * do),
        h * e_c * q,
    )
    for got, w in zip(K.backward_bounds_q10(n, h, n), want, strict=True):
        assert 513 + w * lsb <= got <= 513 + w * lsb + 2


def test_attention_compiled_equals_interpreted_on_negatives(kernels):
    compiled, interpreted = kernels
    xq, iw = G.problem(5, G.TINY)
    r = forward_int(compiled, -xq, iw)  # every activation sign flipped
    args = (r["q"], r["c_kv"], r["k_r"], iw.w_uk, iw.w_uv)
    assert (r["q"] < 0).any() and (r["c_kv"] < 0).any()
    for name in ("mla_attend_naive", "mla_attend_absorbed"):
        assert bit_equal(getattr(compiled, name)(*args), getattr(interpreted, name)(*args))
    assert bit_equal(compiled.mla_attend_naive(*args), compiled.mla_attend_absorbed(*args))
    out = (r["o"], -xq, iw.w_g, iw.w_o)
    assert bit_equal(compiled.mla_output(*out), interpreted.mla_output(*out))


def test_backward_compiled_equals_interpreted_on_negatives(kernels):
    compiled, interpreted = kernels
    xq, iw = G.problem(6, G.TINY)
    rng = np.random.default_rng(6)
    dy = -np.abs(np.round(rng.standard_normal(xq.shape) * 2**23)).astype(np.int32)
    r = forward_int(compiled, -xq, iw)
    assert bit_equal(
        tuple(backward_int(compiled, r, -xq, iw, dy)[n] for n in ("dq", "dc_kv", "dk_r", "du")),
        tuple(backward_int(interpreted, r, -xq, iw, dy)[n] for n in ("dq", "dc_kv", "dk_r", "du")),
    )


def test_decode_step_appends_in_place(kernels):
    compiled, _ = kernels
    xq, iw = G.problem(7, G.TINY)
    r = forward_int(compiled, xq, iw)
    c = np.zeros((8, iw.w_uk.shape[2]), dtype=np.int32)
    k_r = np.zeros((8, r["k_r"].shape[1]), dtype=np.int32)
    for t in range(3):
        o_t, _ = compiled.mla_decode_step(
            r["q"][t : t + 1], r["c_kv"][t : t + 1], r["k_r"][t : t + 1], c, k_r, t, iw.w_uk,
            iw.w_uv,
        )  # fmt: skip
        np.testing.assert_array_equal(o_t, r["o"][t])
    np.testing.assert_array_equal(c[:3], r["c_kv"][:3])
    assert not c[3:].any()


def test_a_decode_step_over_a_2_to_the_20_token_cache(kernels):
    """The long-context use: one query over 2^20 cached latents, within attend_bound_q10(2^20)
    of float64 and with no saturation."""
    compiled, _ = kernels
    n, kv_lora, rope, nope, d_v = 1 << 20, 16, 4, 8, 8
    rng = np.random.default_rng(8)

    def q(a, frac):
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    c = q(rng.standard_normal((n, kv_lora)), 16)
    k_r = q(rng.standard_normal((n, rope)), 16)
    w_uk = q(rng.standard_normal((1, nope, kv_lora)) / 4, 16)
    w_uv = q(rng.standard_normal((1, d_v, kv_lora)) / 4, 16)
    qt = q(rng.standard_normal((1, 1, nope + rope)) * 0.3, 20)
    o, sat = compiled.mla_decode_attend(qt, 0, c, k_r, n, w_uk, w_uv)
    assert sat == 0
    cf, kf = c / 2.0**16, k_r / 2.0**16
    wk, wv = w_uk[0] / 2.0**16, w_uv[0] / 2.0**16
    qf = qt[0, 0] / 2.0**20
    s = cf @ (wk.T @ qf[:nope]) + kf @ qf[nope:]
    p = np.exp(s - s.max())
    p /= p.sum()
    want = wv @ (p @ cf)
    err = np.abs(o[0] - want * 2**20).max()
    assert err <= K.attend_bound_q10(n) / 1024
