"""Quantile Balancing's own promise can fail (issue 13, item 9; acceptance 8): the moe_layer gate's
`qb_balance` check passes with the real qb_update kernel and fails with a no-op update that hands
back the bias unchanged. No recompile: both runs use the cached compiled router, and the check
takes the update as a Python function."""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.moe.gate as moe_gate
from k3gates.infra import compile as kc
from k3gates.infra.gate import REGISTRY, GateContext

MOE = "k3gates.moe.kernels"


@pytest.fixture(scope="module")
def kernels():
    return kc.load(MOE)


def run_check(kernels, qb_update) -> tuple[bool, dict]:
    ctx = GateContext(REGISTRY["moe_layer"])
    passed = moe_gate.check_qb_balance(ctx, kernels.router, qb_update)
    (check,) = ctx.checks
    assert check.name == "qb_balance" and check.passed == passed
    return passed, check.values


def test_the_batch_starts_with_one_expert_holding_every_token(kernels):
    x, w_r, q = moe_gate.qb_balance_batch()
    s = moe_gate.TEST
    _, idx, _ = kernels.router(x, w_r, np.zeros(s.n, dtype=np.int64), s.k, moe_gate.scalars()[0])
    assert (idx == 0).any(axis=1).all()
    assert q == x.shape[0] * s.k // s.n


def test_the_real_qb_update_balances_within_the_declared_band(kernels):
    passed, values = run_check(kernels, kernels.qb_update)
    assert passed, values
    assert values["expert_0_before"] == values["tokens"]
    assert values["max_dev_after"] <= moe_gate.QB_BALANCE_BAND


def test_a_no_op_qb_update_fails_the_check(kernels):
    def no_op(s, b, k):
        return np.array(b, dtype=np.int64, copy=True)

    passed, values = run_check(kernels, no_op)
    assert not passed
    assert values["expert_0_after"] == values["tokens"]  # nothing moved: expert 0 keeps them all
    assert values["max_dev_after"] > moe_gate.QB_BALANCE_BAND


def test_an_update_aimed_at_the_wrong_quantile_fails_the_check(kernels):
    """Half the shift the (q+1)-th margin rule asks for: expert 0 keeps far more than q."""

    def half_step(s, b, k):
        return b + (kernels.qb_update(s, b, k) - b) // 2

    passed, values = run_check(kernels, half_step)
    assert not passed and values["expert_0_after"] > values["q"] + moe_gate.QB_BALANCE_BAND
