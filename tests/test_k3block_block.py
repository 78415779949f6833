"""The composed K3 block (HAVE): the glue kernels compiled and interpreted, their edges, and the
gate failing when a kernel it runs is broken by one LSB or is not deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.fx import quantize, value
from k3gates.infra import compile as kc
from k3gates.infra.gate import REGISTRY, GateContext, bit_equal
from k3gates.k3block import gate as block_gate
from k3gates.k3block import kernels as K
from k3gates.k3block import reference as ref

KERNELS = "k3gates.k3block.kernels"
RNG = np.random.default_rng(20260711)


@pytest.fixture(scope="module")
def kernels() -> tuple:
    return kc.load(KERNELS), kc.interpreted(KERNELS)


def _both(kernels, func: str, *args):
    compiled, interpreted = kernels
    got = getattr(compiled, func)(*args)
    assert bit_equal(got, getattr(interpreted, func)(*args)), func
    return got


def _edges(n: int, top_bits: int) -> np.ndarray:
    """Powers of two +- {0, 1, 2} below 2^top_bits, their negatives and 0 in a seeded order,
    then seeded values."""
    p = [(1 << i) + d for i in range(top_bits) for d in (-2, -1, 0, 1, 2)]
    v = RNG.permutation(np.array([0, *p, *(-q for q in p)], dtype=np.int64))
    rest = RNG.integers(-(1 << top_bits), 1 << top_bits, max(n - v.size, 0))
    return np.concatenate([v, rest])[:n]  # (a seeded sample of the edges when n is smaller)


def test_conv_silu_compiled_equals_interpreted_and_float(kernels):
    u = np.ascontiguousarray(_edges(40 * 6, 30).reshape(40, 6))  # Q.20, |u| < 1024
    wc = np.ascontiguousarray(_edges(6 * 4, 20).reshape(6, 4))  # Q.16, |w| < 16
    out, sat = _both(kernels, "conv_silu", u, wc, (1 << 31) - 1)
    want = ref.silu(ref.short_conv(value(u, 20), value(wc, 16)))
    acc = ref.short_conv(value(u, 20), value(wc, 16))
    inside = (np.abs(acc) < 256) & (np.abs(np.ldexp(want, 20)) < 2**31 - 1)
    err = np.abs(out - np.ldexp(want, 20))[inside]
    assert err.max() <= K.CONV_SILU_MAX_ERR_LSB_Q10 / 1024
    assert int(sat) == int((np.abs(np.ldexp(want, 20)) > 2**31 - 1).sum())


def test_conv_silu_is_causal(kernels):
    u = np.ascontiguousarray(RNG.integers(-(1 << 22), 1 << 22, (12, 3)))
    wc = np.ascontiguousarray(RNG.integers(-(1 << 17), 1 << 17, (3, 4)))
    later = u.copy()
    later[7:] = 0
    a, _ = kernels[0].conv_silu(u, wc, (1 << 31) - 1)
    b, _ = kernels[0].conv_silu(later, wc, (1 << 31) - 1)
    assert np.array_equal(a[:7], b[:7]) and not np.array_equal(a[7:], b[7:])


def test_head_sigmoid_compiled_equals_interpreted_and_float(kernels):
    x = np.ascontiguousarray(_edges(16 * 8, 23).reshape(16, 8).astype(np.int32))  # |x| < 128
    wb = np.ascontiguousarray(_edges(3 * 8, 19).reshape(3, 8))  # |w| < 8
    beta = _both(kernels, "head_sigmoid", x, wb)
    want = ref.sigmoid(value(x, 16) @ value(wb, 16).T)
    assert np.abs(beta - np.ldexp(want, 30)).max() <= K.BETA_MAX_ERR_LSB_Q10 / 1024
    assert beta.dtype == np.int32 and beta.min() >= 0 and beta.max() <= 1 << 30


def test_norm_rows_takes_an_acc_shift_on_loud_rows_and_stays_within_its_bound(kernels):
    rows = [RNG.integers(-(1 << 30), 1 << 30, 64), np.zeros(64, dtype=np.int64)]
    rows += [RNG.integers(-(1 << 24), 1 << 24, 64) for _ in range(6)]
    x = np.ascontiguousarray(np.stack(rows).astype(np.int64))  # Q.24, the residual's domain
    x[0, 0] = -(1 << 30)
    w = np.ascontiguousarray(quantize(1 + 0.1 * RNG.standard_normal(64), 24))
    eps = int(quantize(np.float64(1e-6), 48))
    out, sat, shift = _both(kernels, "norm_rows", x, w, eps, 24, 24, 16, (1 << 31) - 1)
    assert int(shift) > 0 and int(sat) == 0  # the loud row needed acc_shift > 0
    want = ref.rmsnorm(value(x, 24), value(w, 24), value(np.int64(eps), 48))
    assert np.abs(out - np.ldexp(want, 16)).max() <= K.NORM_MAX_ERR_LSB_Q10 / 1024
    tight, sat2, _ = kernels[0].norm_rows(x, w, eps, 24, 24, 16, 1 << 16)
    assert int(sat2) == int((np.abs(out) > 1 << 16).sum()) > 0
    assert np.abs(tight).max() == 1 << 16


def test_residual_add_is_exact_and_counts_saturations(kernels):
    p = _edges(8 * 5, 29)
    p[:4] = [1 << 30, -(1 << 30), (1 << 30) - 3, -(1 << 30) + 3]  # the stream's limits
    y = _edges(8 * 5, 25)
    y[:4] = [1, -1, 1, -1]  # 16 past the limit, and inside it
    p, y = np.ascontiguousarray(p.reshape(8, 5)), np.ascontiguousarray(y.reshape(8, 5))
    out, sat = _both(kernels, "residual_add", p, y, 4, 1 << 30)
    exact = p + y * 16
    assert np.array_equal(out, np.clip(exact, -(1 << 30), 1 << 30))
    assert int(sat) == int((np.abs(exact) > 1 << 30).sum()) > 0


def test_the_schedule_functions_are_unchanged(kernels):
    kinds = _both(kernels, "layer_schedule", 93, 4)
    assert (np.flatnonzero(kinds) + 1).tolist() == ref.K3_MLA_LAYERS


# == the gate ====================================================================================
def _run(monkeypatch=None, wrappers: dict | None = None) -> dict:
    ctx = GateContext(REGISTRY["k3block_forward"])
    if wrappers:
        real = ctx.compiled
        monkeypatch.setattr(
            ctx,
            "compiled",
            lambda modname=None: (
                wrappers[modname](real(modname)) if modname in wrappers else real(modname)
            ),
        )
    block_gate.k3block_forward(ctx)
    return {c.name: c for c in ctx.checks}


class _Wrap:
    """A compiled kernels module with one function replaced; everything else delegates."""

    def __init__(self, real, name: str, func) -> None:
        self._real, self._name, self._func = real, name, func

    def __getattr__(self, attr: str):
        if attr == self._name:
            return lambda *args: self._func(getattr(self._real, attr), *args)
        return getattr(self._real, attr)


def test_the_gate_passes():
    checks = _run()
    failed = [n for n, c in checks.items() if not c.passed]
    assert not failed, failed
    kinds = {c.kind for c in checks.values()}
    assert {"reference", "deterministic", "property", "compiled"} <= kinds
    assert sum(c.kind == "reference" for c in checks.values()) >= 30


def test_one_lsb_in_one_attnres_call_fails_that_stage_alone(monkeypatch):
    """Layer 3's AttnRes before Attn (its pseudo-query identifies it) returns h + 1 LSB: its
    check fails; every later stage, held against float64 on the integers it received, passes."""
    seed_w = block_gate.block_weights(
        block_gate.BLOCK_SEED, np.array([0, 0, 0, 1], dtype=np.int8), kc.load("k3gates.mla.kernels")
    )
    target = seed_w["layers"][2]["wq_a"]

    def off_by_one(real, src, w, *rest):
        h, alpha, sat = real(src, w, *rest)
        return (h + 1 if np.array_equal(w, target) else h), alpha, sat

    checks = _run(
        monkeypatch,
        {"k3gates.attnres.kernels": lambda r: _Wrap(r, "attnres_forward", off_by_one)},
    )
    failed = {n for n, c in checks.items() if not c.passed}
    assert failed == {"L3_attnres_a", "compiled_block"}, failed


def test_one_lsb_in_the_residual_add_fails_the_exact_check(monkeypatch):
    def off_by_one(real, *args):
        out, sat = real(*args)
        out = out.copy()
        out[0, 0] += 1
        return out, sat

    checks = _run(monkeypatch, {KERNELS: lambda r: _Wrap(r, "residual_add", off_by_one)})
    failed = {n for n, c in checks.items() if not c.passed}
    assert {f"L{layer}_residual" for layer in (1, 2, 3, 4)} <= failed
    assert checks["L1_residual"].measured == 1.0


def test_a_kernel_that_differs_on_one_run_fails_the_determinism_check(monkeypatch):
    """kda_recurrent returns o + 1 LSB at one element on its seventh call only: the block's third
    run (the determinism check's second), three KDA layers per run."""
    calls = {"n": 0}

    def flaky(real, *args):
        o, S, stats = real(*args)
        calls["n"] += 1
        if calls["n"] == 7:
            o = o.copy()
            o[-1, 0, 0] += 1
        return o, S, stats

    checks = _run(monkeypatch, {"k3gates.kda.kernels": lambda r: _Wrap(r, "kda_recurrent", flaky)})
    failed = {n for n, c in checks.items() if not c.passed}
    assert failed == {"deterministic"}, failed
