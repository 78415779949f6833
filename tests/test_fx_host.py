"""k3gates/fx/host.py: each function's stated bound, proved against exact decimal arithmetic."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest

from k3gates.fx import host
from k3gates.longctx import gate as longctx


def _ulp_errors(got: np.ndarray, x: np.ndarray, f) -> float:
    worst = 0.0
    with localcontext() as ctx:
        ctx.prec = 40
        for xi, gi in zip(x, got, strict=True):
            true = f(Decimal(float(xi)))
            err = abs(Decimal(float(gi)) - true) / Decimal(math.ulp(float(true)))
            worst = max(worst, float(err))
    return worst


def test_exp_is_within_its_stated_ulps():
    rng = np.random.default_rng(1)
    edges = [0.0, -0.0, 1.0, -1.0, 709.0, -708.0]
    x = np.concatenate([rng.uniform(-708, 709, 4000), rng.standard_normal(4000) * 4,
                        rng.uniform(-1e-6, 1e-6, 500), edges])  # fmt: skip
    worst = _ulp_errors(host.exp(x), x, lambda d: d.exp())
    assert worst <= host.EXP_MAX_ERR_ULP
    assert worst > 0.5  # not correctly rounded: the bound is what is claimed, and it is used


def test_exp2_is_within_its_stated_ulps():
    x = np.random.default_rng(2).uniform(-20, 20, 4000)
    worst = _ulp_errors(host.exp2(x), x, lambda d: (d * Decimal(2).ln()).exp())
    assert worst <= host.EXP_MAX_ERR_ULP + 1


def test_exp_edges():
    assert host.exp(np.array([-800.0, 800.0, 0.0])).tolist() == [0.0, math.inf, 1.0]


def test_sigmoid_and_tanh_are_within_their_absolute_bounds():
    x = np.random.default_rng(3).standard_normal(4000) * 8
    with localcontext() as ctx:
        ctx.prec = 40
        want_s = [1 / (1 + (-Decimal(float(v))).exp()) for v in x]
        want_t = [(2 / (1 + (-2 * Decimal(float(v))).exp())) - 1 for v in x]
    err_s = max(
        abs(float(Decimal(float(g)) - w)) for g, w in zip(host.sigmoid(x), want_s, strict=True)
    )
    err_t = max(
        abs(float(Decimal(float(g)) - w)) for g, w in zip(host.tanh(x), want_t, strict=True)
    )
    assert err_s <= host.SIGMOID_MAX_ERR
    assert err_t <= 2.0**-51


def test_inv_sqrt_is_correctly_rounded():
    """n^-1/2 lies between the midpoints of y with its two neighbours, exactly."""
    for n in [*range(1, 3000), 3584, 7168, 2.5, 1e-3]:
        y = host.inv_sqrt(n)
        lo, hi = math.nextafter(y, 0.0), math.nextafter(y, math.inf)
        mid_lo, mid_hi = (Fraction(y) + Fraction(lo)) / 2, (Fraction(y) + Fraction(hi)) / 2
        assert mid_lo**2 * Fraction(n) <= 1 <= mid_hi**2 * Fraction(n), n
    with pytest.raises(ValueError):
        host.inv_sqrt(0)


def test_floor_and_ceil_log2_are_exact():
    for x in [1, 2, 3, 0.75, 2.0**-1074, 1e300, Fraction(1, 3), 2**60 - 1, 2**60]:
        f, c = host.floor_log2(x), host.ceil_log2(x)
        assert Fraction(2) ** f <= Fraction(x) < Fraction(2) ** (f + 1)
        assert Fraction(2) ** (c - 1) < Fraction(x) <= Fraction(2) ** c


@pytest.mark.parametrize("name", ["plain", "ntk", "yarn"])
def test_rope_tables_are_the_exact_rounding(name, monkeypatch):
    """Each table derived again at 120 digits is the same integers, and it is the float64
    reference's table to within float64's own precision (2^-52 relative, in turns)."""
    s = {"plain": 1, "ntk": 8, "yarn": 32}[name]
    table, m = longctx.table_q62(name, 10000, s, 32768)
    monkeypatch.setattr(host, "DIGITS", 120)
    again, m_again = longctx.table_q62(name, 10000, s, 32768)
    assert np.array_equal(table, again) and m == m_again
    freq, mscale = longctx._table(name, 10000.0, float(s), 32768)
    float_turns = freq / (2 * math.pi) * 2.0**62
    assert np.all(np.abs(table - float_turns) <= np.abs(float_turns) * 2.0**-50 + 1)
    assert abs(m - mscale * 2**30) <= 1


def test_matmul_sums_in_one_order():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((5, 7, 9)), rng.standard_normal((9, 3))
    got = host.matmul(a, b)
    want = np.zeros((5, 7, 3))
    for j in range(9):
        want = want + a[..., j : j + 1] * b[j]
    assert np.array_equal(got, want)
    assert np.allclose(got, a @ b, rtol=1e-13, atol=1e-13)
