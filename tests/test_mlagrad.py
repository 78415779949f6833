"""1M context STRONG (issue 15), MLA side: the attention backward for query rows over a long
latent cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BuildRun, check, gate_row

from k3gates.mla import kernels as M
from k3gates.mlagrad import gate as G
from k3gates.mlagrad import kernels as K
from k3gates.mlagrad import reference as R


@pytest.mark.parametrize("n", [1, 64, 1 << 14, 1 << 20])
def test_the_row_bounds_are_the_square_bounds_when_every_row_is_a_query(n):
    assert K.rows_bounds_q10(n, n, 2) == M.backward_bounds_q10(n, 2)
    # fewer query rows can only tighten the column terms
    fewer = zip(K.rows_bounds_q10(n, 1, 2), M.backward_bounds_q10(n, 2), strict=True)
    assert all(a <= b for a, b in fewer)


def test_the_rows_are_the_square_backward_bit_for_bit():
    x = G._inputs(12, 12, seed=1)
    rows = G.backward(K, x, 0)
    square = G._square(M, x)
    mine = (rows["p"], rows["ds"], rows["dq"], rows["dc"], rows["dk_r"])
    for a, b in zip(mine, square, strict=True):
        assert np.array_equal(a, b)


def test_the_last_rows_within_their_bounds_of_float64_and_the_bounds_discriminate():
    t_len, rows = 40, 5
    x = G._inputs(t_len, rows, seed=2)
    b = G.backward(K, x, t_len - rows)
    dq, dc, dkr = R.rows_backward(t0=t_len - rows, **G._reals(x))
    bounds = [v / 1024 for v in K.rows_bounds_q10(t_len, rows, G.N_H)]
    pairs = (
        (b["dq"][..., G.NOPE :], dq[..., G.NOPE :], bounds[0]),
        (b["dq"][..., : G.NOPE], dq[..., : G.NOPE], bounds[1]),
        (b["dc"], dc, bounds[2]),
        (b["dk_r"], dkr, bounds[3]),
    )
    for got, want, bound in pairs:
        w = want * 2.0**24
        assert np.abs(got - w).max() <= bound
        assert np.abs(w).max() > bound  # an all-zero gradient fails
        assert np.abs(got + 1 - w).max() > bound  # so does one LSB added everywhere
    assert b["sat"] == 0


def test_each_query_row_is_computed_alone():
    t_len, rows = 30, 4
    x = G._inputs(t_len, rows, seed=3)
    whole = G.backward(K, x, t_len - rows)
    last = {**x, "q": np.ascontiguousarray(x["q"][2:]), "do": np.ascontiguousarray(x["do"][2:])}
    part = G.backward(K, last, t_len - 2)
    assert np.array_equal(part["dq"], whole["dq"][2:])
    assert np.array_equal(part["p"], whole["p"][:, 2:])


def test_the_float64_rows_backward_is_the_derivative_of_its_loss():
    worst, n = G._finite_differences()
    assert n == 12 and worst <= G.FD_REL


def test_longctx_mla_backward_in_the_census(built_site: BuildRun):
    g = gate_row(built_site, "longctx_mla_backward")
    assert g["passed"] and all(c["passed"] for c in g["checks"]), g.get("error")
    for name in ("dq_C", "dq_R", "dc_kv", "dk_r"):
        c = check(g, name)
        assert c["measured"] <= c["bound"] and c["zero_output_fails"], name
        assert c["values"]["cache_rows"] >= 1 << 14
    assert check(g, "rows_equal_square")["passed"]
