"""Every magic constant in k3gates/fx/kernels.py, recomputed from the expression beside it.

High precision comes from the standard library: `decimal` (ln, exp, sqrt) at 80 digits, and an
integer Machin formula for pi. Python's round() of an exact Decimal or Fraction is the rounding
the comments name (none of these values is a tie).
"""

from __future__ import annotations

import ast
import decimal
from decimal import Decimal
from fractions import Fraction
from math import factorial
from pathlib import Path

import pytest

import k3gates.fx.kernels as k

decimal.getcontext().prec = 80
TWO62 = Decimal(2) ** 62


def arctan_inv(n: int, digits: int = 80) -> Decimal:
    """arctan(1/n) by its alternating series, to `digits` digits."""
    eps = Decimal(10) ** -(digits + 5)
    x = Decimal(1) / n
    total, term, k_ = Decimal(0), x, 0
    while abs(term) > eps:
        total += term / (2 * k_ + 1) * (-1 if k_ % 2 else 1)
        term *= x * x
        k_ += 1
    return total


PI = 16 * arctan_inv(5) - 4 * arctan_inv(239)  # Machin


def test_pi_is_pi():
    assert str(PI)[:32] == "3.141592653589793238462643383279"


def test_ln2_and_log2e():
    assert round(Decimal(2).ln() * Decimal(2) ** 56) == k.LN2_Q56
    assert round(Decimal(2) ** 26 / Decimal(2).ln()) == k.LOG2E_Q26  # log2(e) = 1 / ln 2


def test_exp_table():
    assert len(k.EXP_TABLE) == 45  # j = 0..44 covers r < ln 2: 64 ln 2 = 44.36
    assert int(64 * Decimal(2).ln()) == len(k.EXP_TABLE) - 1
    assert 2**k.EXP_TABLE_STEP == 64
    for j, raw in enumerate(k.EXP_TABLE):
        assert round((Decimal(-j) / 64).exp() * TWO62) == raw, j


@pytest.mark.parametrize(
    ("table", "denominators"),
    [
        ("EXP_TAYLOR", [factorial(n) for n in range(7)]),
        ("SIN_TAYLOR", [factorial(2 * n + 1) for n in range(9)]),
        ("COS_TAYLOR", [factorial(2 * n) for n in range(9)]),
    ],
)
def test_taylor_coefficients(table: str, denominators: list[int]):
    assert list(getattr(k, table)) == [round(Fraction(2**62, d)) for d in denominators]


def test_reciprocal_and_rsqrt_seeds():
    assert round(Fraction(24, 17) * 2**62) == k.RECIP_INIT_A
    assert round(Fraction(16, 17) * 2**62) == k.RECIP_INIT_B
    assert Fraction(17, 16) * 2**62 == k.RSQRT_INIT_A
    assert Fraction(5, 8) * 2**62 == k.RSQRT_INIT_B


def test_seed_errors_are_what_the_docstrings_claim():
    # recip: |1 - 2m h0| <= 1/17 on [1/2, 1] (Chebyshev: extremes at 1/2, 3/4, 1)
    for m in (Fraction(1, 2), Fraction(3, 4), Fraction(1)):
        assert abs(1 - 2 * m * (Fraction(24, 17) - Fraction(16, 17) * m)) == Fraction(1, 17)
    # rsqrt: the line 17/16 - 5/8 y is within 1/8 of 1/(2 sqrt y) on [1/4, 1]
    worst = max(
        abs(float((Fraction(17, 16) - Fraction(5, 8) * y) * 2) * float(y) ** 0.5 - 1)
        for y in (Fraction(i, 4096) for i in range(1024, 4097))
    )
    assert worst <= 0.125 + 1e-12


def test_two_pi():
    assert round(2 * PI * Decimal(2) ** 59) == k.TWO_PI_Q59


def test_format_constants():
    assert k.ONE_Q62 == 2**62 and k.HALF_Q62 == 2**61
    assert k.MASK31 == 2**31 - 1 and k.I64_MAX == 2**63 - 1
    assert (k.I32_MIN, k.I32_MAX) == (-(2**31), 2**31 - 1)
    assert k.SOFTMAX_MAX_ROW == 2**20


def test_bounds_are_one_rounding_plus_the_margin():
    assert k.ONE_ROUNDING_LSB_Q10 == 513 and k.BOUND_FRAC == 10  # 1/2 + 2^-10
    names = [n for n in dir(k) if n.endswith("_MAX_ERR_LSB_Q10")]
    assert len(names) == 9
    assert all(getattr(k, n) == 513 for n in names)


def test_every_integer_constant_is_covered():
    """Each module-level integer or tuple constant of kernels.py is checked by a test above."""
    tree = ast.parse(Path(k.__file__).read_text())
    names = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    covered = {
        "LN2_Q56", "LOG2E_Q26", "EXP_TABLE", "EXP_TABLE_STEP", "EXP_TAYLOR", "SIN_TAYLOR",
        "COS_TAYLOR", "RECIP_INIT_A", "RECIP_INIT_B", "RSQRT_INIT_A", "RSQRT_INIT_B",
        "TWO_PI_Q59", "ONE_Q62", "HALF_Q62", "MASK31", "I64_MAX", "I32_MIN", "I32_MAX",
        "SOFTMAX_MAX_ROW", "ONE_ROUNDING_LSB_Q10", "BOUND_FRAC", "EXACT_LSB_Q10",
        "ARG_FRAC", "OUT_SHIFT",
    }  # fmt: skip
    covered |= {n for n in names if n.endswith("_MAX_ERR_LSB_Q10")}
    assert names == covered, names ^ covered
    assert k.EXACT_LSB_Q10 == 0 and k.ARG_FRAC == 56 and k.OUT_SHIFT == 31
