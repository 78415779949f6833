"""1M context STRONG (issue 15): KDA's backward at long context, one state kept per chunk."""

from __future__ import annotations

import numpy as np
from conftest import BuildRun, check, gate_row

from k3gates.kda import gate_grad as G
from k3gates.kda import kernels as KDA
from k3gates.kda import kernels_grad as K
from k3gates.kda import reference_grad as R

T, D = 13, 8  # interpreted: small, with a partial chunk for C = 4 and C = 5


def _inputs(t_len: int = T, d: int = D, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (t_len, 2, d)

    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    def q(a, frac):
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    return {
        "qs": q(unit(rng.standard_normal(shape)) * d**-0.5, 24),
        "k": q(unit(rng.standard_normal(shape)) * (1 - 2.0**-23), 24),
        "v": q(0.5 * rng.standard_normal(shape), 20),
        "alpha": q(np.exp(-5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal(shape)))), 30),
        "beta": q(1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:2]))), 30),
        "s0": q(0.5 * rng.standard_normal((2, d, d)), 20),
        "do": q(4 * (1 - 2.0**-16) * unit(rng.standard_normal(shape)), 20),
        "ds_t": q(0.01 * rng.standard_normal((2, d, d)), 20),
    }


def _reals(p):
    return (
        p["qs"] / 2.0**24,
        p["k"] / 2.0**24,
        p["v"] / 2.0**20,
        p["alpha"] / 2.0**30,
        p["beta"] / 2.0**30,
        p["s0"] / 2.0**20,
        p["do"] / 2.0**20,
        p["ds_t"] / 2.0**20,
    )


def _grads(res):
    return (*res[2:7], res[8][0])


def test_the_gradients_do_not_depend_on_the_chunk():
    p = _inputs()
    runs = [K.kda_backward(*p.values(), c) for c in (1, 4, 5, T)]
    for r in runs[1:]:
        for a, b in zip(_grads(runs[0]), _grads(r), strict=True):
            assert np.array_equal(a, b)
    # the kept states are the forward's at each chunk start
    assert np.array_equal(runs[1][7][1], runs[0][7][4]) and runs[1][7].shape[0] == 4


def test_the_forward_is_kda_recurrent_bit_for_bit():
    p = _inputs()
    res = K.kda_backward(*p.values(), 4)
    o, s_end, _ = KDA.kda_recurrent(*(p[key] for key in ("qs", "k", "v", "alpha", "beta", "s0")))
    assert np.array_equal(res[0], o) and np.array_equal(res[1], s_end)


def test_whole_sequence_gradients_within_the_per_chunk_bounds_and_they_discriminate():
    p = _inputs()
    res = K.kda_backward(*p.values(), T)
    want = R.backward(*_reals(p))
    bq, bv, bs = (b / 1024 for b in K.chunk_bounds_q10(D, D, T))
    got = {"dq": res[2], "dv": res[4], "ds": res[8][0]}
    ref = {"dq": want[0], "dv": want[2], "ds": want[5]}
    for name, bound in (("dq", bq), ("dv", bv), ("ds", bs)):
        err = np.abs(got[name] - ref[name] * 2.0**20).max()
        assert err <= bound, name
        # an all-zero gradient would fail the same bound
        assert np.abs(ref[name] * 2.0**20).max() > bound, name


def test_restarted_at_every_token_each_gradient_is_within_its_token_bound():
    p = _inputs(t_len=24, d=32, seed=3)
    res = K.kda_backward(*p.values(), 1)
    q, k, v, alpha, beta, _, do, _ = _reals(p)
    names = ("dq", "dk", "dv", "dalpha", "dbeta", "ds")
    bounds = dict(zip(names, K.token_bounds_q10(32, 32), strict=True))
    s_prev = res[7] / 2.0**20
    g_in = np.concatenate([res[8][1:], p["ds_t"][None]]) / 2.0**20
    n = 24 * 2  # each token of each head a sequence of one step, from the kernel's own state
    want = R.backward(
        q.reshape(1, n, 32),
        k.reshape(1, n, 32),
        v.reshape(1, n, 32),
        alpha.reshape(1, n, 32),
        beta.reshape(1, n),
        s_prev.reshape(n, 32, 32),
        do.reshape(1, n, 32),
        g_in.reshape(n, 32, 32),
    )
    got = (*res[2:7], res[8])
    for name, g, w in zip(bounds, got, want, strict=True):
        err = np.abs(g.reshape(-1) - (w * 2.0**20).reshape(-1)).max()
        assert err <= bounds[name] / 1024, (name, err)


def test_the_domain_is_counted():
    p = _inputs()
    p["v"] = np.ascontiguousarray(p["v"] * 40)  # |v| up to ~80 > 16: e leaves the domain
    assert K.kda_backward(*p.values(), 4)[9][1] > 0
    assert K.kda_backward(*_inputs().values(), 4)[9][1] == 0


def test_the_float64_backward_is_the_derivative_of_its_loss():
    worst, n = G._finite_differences()
    assert n == 24 and worst <= G.FD_REL


# -- the published evidence -----------------------------------------------------------------------
def test_longctx_kda_backward_in_the_census(built_site: BuildRun):
    g = gate_row(built_site, "longctx_kda_backward")
    assert g["passed"] and all(c["passed"] for c in g["checks"]), g.get("error")
    mem = check(g, "memory")["values"]
    # the acceptance: at least 8x below the per-token alternative, measured
    assert mem["ratio"] >= 8 and mem["peak_bytes_per_token"] >= 8 * mem["peak_bytes_chunked"]
    assert mem["peak_bytes_chunked"] > mem["kept_state_bytes"] > 0
    for name in ("dq", "dk", "dv", "dalpha", "dbeta", "ds"):
        c = check(g, f"{name}_per_token")
        assert c["measured"] <= c["bound"] and c["zero_output_fails"], name
    assert check(g, "chunk_independent")["passed"] and check(g, "split")["passed"]
    row = next(r for r in built_site.census["innovations"] if r["id"] == "longctx")
    assert row["level"] in ("STRONG", "PROVEN") and not row["killed"]


def test_the_gate_draws_do_inside_the_domain_the_bounds_are_stated_for():
    p = G._inputs(256)
    norms = np.sqrt(np.sum((p["do"] / 2.0**20) ** 2, axis=-1))
    assert 3.99 < norms.max() <= K.DOMAIN_DO_L2
