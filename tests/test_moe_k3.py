"""The expert-parallel LatentMoE layer (issue 19, item 4) at a reduced expert count, on a
LocalCluster of two worker processes: bit-identical to one process, within the declared bound of
float64, and each comparison shown able to fail. Tests never reach the network."""

from __future__ import annotations

import logging
from math import erf, sqrt

import distributed
import numpy as np
import pytest

from k3gates.moe import layer_k3 as L
from k3gates.moe import reference_k3 as R

# K3's structure (routed top-k of many, 2 shared, latent < hidden, MXFP4 blocks of 32) at 16
# experts, top-4, hidden 128, latent 64, expert width 64
SHAPE = L.Shape(n_experts=16, top_k=4, n_shared=2, hidden=128, latent=64, expert_width=64,
                shared_width=64)  # fmt: skip
SEED = 19
TOKENS = 24


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                 dashboard_address=None, silence_logs=logging.ERROR) as cluster,
        distributed.Client(cluster) as c,
    ):  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def runs(client):
    layer = L.LatentMoE(SHAPE, SEED)
    x = L.make_input(SHAPE, SEED, TOKENS)
    layer.load(client)
    return layer, x, layer.forward_parallel(client, x), layer.forward(x)


def test_expert_parallel_is_bit_identical_to_one_process(runs) -> None:
    _, _, par, single = runs
    assert len(par.parts) == 2  # two shards, one per worker
    assert np.array_equal(par.routing.idx, single.routing.idx)
    assert np.array_equal(par.c, single.c)
    assert np.array_equal(par.y, single.y)
    # the combine is order-independent: the workers' sums added the other way round
    assert np.array_equal(L.combine(TOKENS, SHAPE.latent, par.parts[::-1]), par.c)


def test_each_worker_receives_only_its_experts_slots(runs, client) -> None:
    layer, _, par, _ = runs
    owners = layer.workers(client)
    assert [(lo, hi) for _, lo, hi in owners] == [(0, 8), (8, 16)]
    slots = 0
    for _, lo, hi in owners:
        msg = L.shard_message(par.routing, lo, hi)
        assert np.all((msg.pair_expert >= lo) & (msg.pair_expert < hi))
        # a token is sent to a worker only if one of its slots is there
        assert np.array_equal(np.unique(msg.pair_row), np.arange(msg.tokens.size))
        slots += msg.pair_expert.size
    assert slots == TOKENS * SHAPE.top_k
    sent = sum(w["sent_bytes"] for w in par.stats["workers"].values())
    assert sent > 0 and all(w["returned_bytes"] > 0 for w in par.stats["workers"].values())


def test_workers_generate_the_same_expert_bits(client) -> None:
    for e in (0, 9, 15):
        there = client.submit(L.expert_weights, SHAPE, SEED, e, pure=False).result()
        here = L.expert_weights(SHAPE, SEED, e)
        for a, b in zip((there.w1, there.w3, there.w2), (here.w1, here.w3, here.w2), strict=True):
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(L.expert_weights(SHAPE, SEED, 1).w1[0], here.w1[0])


def test_within_the_declared_bound_of_float64(runs) -> None:
    _, x, par, _ = runs
    out = R.check(SHAPE, SEED, x, par, R.sample_tokens(TOKENS, 8, SEED))
    assert out["selection_agrees"] and all(out["premises"].values()), out
    for name in ("c", "y"):
        assert out[name]["max_err_lsb"] <= out[name]["bound_lsb"], out
        assert out[name]["zero_fails"]
    assert out["y"]["bound_over_rms"] <= 0.05
    assert out["ok"]


def test_a_corrupted_partial_breaks_bit_identity(runs) -> None:
    layer, x, par, single = runs
    tokens, partial = par.parts[1]
    one_lsb = partial.copy()
    one_lsb[0, 0] += 1  # one LSB of Q.40 in one worker's sum
    c = L.combine(TOKENS, SHAPE.latent, [par.parts[0], (tokens, one_lsb)])
    assert not np.array_equal(c, single.c)
    lost = partial.copy()
    lost[0] = 0  # that worker's contribution to one token lost
    c = L.combine(TOKENS, SHAPE.latent, [par.parts[0], (tokens, lost)])
    assert not np.array_equal(layer.finish(c, layer.shared_sum(x)), single.y)


def test_a_dropped_expert_fails_the_float64_check(runs) -> None:
    layer, x, par, _ = runs
    sample = R.sample_tokens(TOKENS, 8, SEED)
    wts = par.routing.wts.copy()
    wts[sample[0], 0] = 0  # the token's first expert left out of its combine
    dropped = L.Routing(idx=par.routing.idx, wts=wts, z=par.routing.z)
    out = R.check(SHAPE, SEED, x, layer.forward_from_routing(x, dropped), sample)
    assert not out["c"]["ok"] and not out["ok"]


def test_constants_recomputed() -> None:
    # CODE_COUNTS: 128 x the mass of |N(0, 2^2)| between E2M1's rounding midpoints
    mass = lambda t: erf(t / 2 / sqrt(2))  # P(|N(0, 4)| < t)
    edges = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    cum = [round(128 * mass(t)) for t in edges] + [128]
    assert tuple(np.diff([0, *cum])) == L.CODE_COUNTS
    assert round(1e-6 * 2**56) == L.EPS_Q56
    assert list(R.e2m1_values()[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert L.K3.expert_bytes * L.K3.n_experts == pytest.approx(15.7e9, rel=0.01)
