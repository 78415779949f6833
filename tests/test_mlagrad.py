"""1M context STRONG (issue 15), MLA side: the attention backward for query rows over a long
latent cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BuildRun, check, gate_row

from k3gates.mla import gate_grad as G
from k3gates.mla import kernels as M
from k3gates.mla import reference as R


@pytest.mark.parametrize("n", [1, 64, 1 << 14, 1 << 20])
def test_fewer_query_rows_only_tighten_the_column_bounds(n):
    one, every = M.backward_bounds_q10(n, 2, 1), M.backward_bounds_q10(n, 2, n)
    assert all(a <= b for a, b in zip(one, every, strict=True))
    assert one[:2] == every[:2]  # dq sums over a row's keys: the query rows do not enter


def test_rows_alone_are_the_last_rows_of_the_whole_sequence():
    x = G._inputs(12, 12, seed=1)
    whole = G.backward(M, x, 0)
    alone = G.backward(M, {**x, "q": x["q"][7:].copy(), "do": x["do"][7:].copy()}, 7)
    assert np.array_equal(alone["p"], whole["p"][:, 7:])
    assert np.array_equal(alone["ds"], whole["ds"][:, 7:])
    assert np.array_equal(alone["dq"], whole["dq"][7:])
    assert whole["p"].shape == (G.N_H, 12, 12) and alone["p"].shape == (G.N_H, 5, 12)


def test_the_last_rows_within_their_bounds_of_float64_and_the_bounds_discriminate():
    t_len, rows = 40, 5
    x = G._inputs(t_len, rows, seed=2)
    b = G.backward(M, x, t_len - rows)
    dq, dc, dkr = R.rows_backward(t0=t_len - rows, **G._reals(x))
    bounds = [v / 1024 for v in M.backward_bounds_q10(t_len, G.N_H, rows)]
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
    whole = G.backward(M, x, t_len - rows)
    last = {**x, "q": np.ascontiguousarray(x["q"][2:]), "do": np.ascontiguousarray(x["do"][2:])}
    part = G.backward(M, last, t_len - 2)
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
    assert check(g, "rows_alone")["passed"]
