"""Checks that must be able to fail, proven on fixture kernels built to break them (issue 13).

- A kernel that sums in thread order fails the thread-count check (acceptance 5).
- A kernel whose int64 product overflows fails compiled == interpreted (acceptance 6).
- A training gate that starts below 10x its threshold fails the shared helper (acceptance 9).
- The runtime guard refuses a float output from a compiled kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from k3gates.infra import compile as kcompile
from k3gates.infra import faults, runner
from k3gates.infra.discover import GatePackage, discover_gates

INTEGRITY = ROOT / "tests" / "fixtures" / "integrity_gates"


@pytest.fixture(scope="module")
def results(session_cache: Path) -> dict[str, dict]:
    mp = pytest.MonkeyPatch()
    mp.setenv("K3GATES_CACHE", str(session_cache))
    mp.syspath_prepend(str(INTEGRITY.parent))
    try:
        sites = discover_gates([GatePackage(INTEGRITY)])
        for site in sites:
            for m in site.kernels:
                c = kcompile.ensure(m)
                assert c.error is None, c.error
        return {r["id"]: r for r in runner.run_gates(sites, jobs=2, reuse=False)}
    finally:
        mp.undo()


def check(result: dict, name: str) -> dict:
    return next(c for c in result["checks"] if c["name"] == name)


def test_a_kernel_that_sums_in_thread_order_fails_the_thread_check(results):
    r = results["integrity_threadorder"]
    c = check(r, "threads")
    assert not r["passed"] and not c["passed"]
    assert c["kind"] == "deterministic" and c["values"]["omp_loops_reached"] == 1
    one = c["digests"]["fresh process, OMP_NUM_THREADS=1"]
    two = c["digests"]["fresh process, OMP_NUM_THREADS=2"]
    assert one != two and "digests differ" in c["message"]


def test_an_overflowing_int64_product_fails_compiled_equals_interpreted(results):
    r = results["integrity_overflow"]
    c = check(r, "compiled")
    assert not r["passed"] and not c["passed"]
    assert "the interpreted run raised FloatingPointError" in c["message"]
    assert "overflow" in c["message"]
    assert c["values"]["inputs"] == "the gate's real inputs"


def test_a_training_gate_starting_below_ten_times_its_threshold_fails(results):
    r = results["integrity_lowstart"]
    assert not r["passed"]
    start = check(r, "start_loss")
    assert not start["passed"] and "< 10 × threshold 0.01" in start["message"]
    # everything else the helper checks holds, so the start rule alone failed it
    for name in ("loss_curve", "loss_below_threshold", "rerun_fresh"):
        assert check(r, name)["passed"], check(r, name)


def test_the_guard_refuses_a_float_output():
    fake = type(sys)("fake_kernels")
    fake.halve = lambda x: x / 2
    fake.double = lambda x: x * 2
    guarded = faults.GuardedModule(fake, "fake.kernels", None)
    assert guarded.double(np.arange(3, dtype=np.int32)).tolist() == [0, 2, 4]
    with pytest.raises(faults.NonIntegerOutput, match=r"fake\.kernels\.halve returned a non-int"):
        guarded.halve(np.arange(3, dtype=np.int32))


@pytest.mark.parametrize("fault", list(faults.FAULTS))
def test_every_fault_changes_a_typical_output(fault):
    a = np.arange(-6, 10, dtype=np.int32).reshape(4, 4) * 1000
    bad = faults.corrupt_array(a, fault)
    assert bad.dtype == a.dtype and bad.shape == a.shape
    assert not np.array_equal(bad, a)
    assert np.array_equal(a, np.arange(-6, 10, dtype=np.int32).reshape(4, 4) * 1000)  # untouched
