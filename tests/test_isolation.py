"""Fault isolation: every broken fixture gate becomes a failed gate; the build still succeeds."""

from __future__ import annotations

import pytest
from conftest import FIXTURE_GATES, BuildRun


@pytest.fixture(scope="module")
def with_fixtures(tmp_path_factory, session_cache) -> BuildRun:
    from conftest import run_build

    out = tmp_path_factory.mktemp("fixtures") / "public"
    return run_build(out, "--gates-from", str(FIXTURE_GATES), cache=session_cache)


def gate(run: BuildRun, gate_id: str) -> dict:
    return next(g for g in run.census["gates"] if g["id"] == gate_id)


def test_the_build_succeeds_despite_every_broken_gate(with_fixtures: BuildRun):
    assert with_fixtures.returncode == 0, with_fixtures.stderr


@pytest.mark.parametrize(
    ("gate_id", "status", "message"),
    [
        ("fixture_raises", "error", "RuntimeError: deliberate failure from the raises fixture"),
        ("fixture_hangs", "timeout", "did not finish within its 3 s timeout; killed"),
        ("fixture_kills", "crashed", "killed by signal SIGKILL"),
        ("fixture_badcompile", "compile-error", "badcompile/kernels.py: pythran failed"),
    ],
)
def test_each_fault_is_a_failed_gate_with_its_message(with_fixtures, gate_id, status, message):
    g = gate(with_fixtures, gate_id)
    assert not g["passed"] and g["status"] == status
    assert message in g["error"]
    assert f"gate: {gate_id}" in with_fixtures.stdout


def test_a_smuggled_float_fails_both_the_static_audit_and_the_runtime_guard(with_fixtures):
    """The gate's own check would pass (halve(4) > 0); the no-float audit flags the source, and
    the guard on every compiled kernel refuses the float it returns, so the gate errors."""
    g = gate(with_fixtures, "fixture_floaty")
    assert not g["passed"] and g["status"] == "error"
    nofloat = next(c for c in g["checks"] if c["kind"] == "nofloat")
    assert not nofloat["passed"]
    assert "floaty/kernels.py:6: true division" in nofloat["message"]
    assert "float literal 0.5" in nofloat["message"]
    assert "fixture_gates.floaty.kernels.halve returned a non-integer value" in g["error"]


def test_the_innovation_they_claim_is_capped(with_fixtures, built_site):
    # the fixtures are PARTIAL mxfp gates; failing PARTIAL gates cap mxfp to GAP
    row = next(r for r in with_fixtures.census["innovations"] if r["id"] == "mxfp")
    assert row["level"] == "GAP" and row["killed"]
    clean = next(r for r in built_site.census["innovations"] if r["id"] == "mxfp")
    assert clean["level"] != "GAP"
    assert "fixture_" in row["kill_reason"]


def test_check_verb_exits_nonzero_naming_failures(build, with_fixtures):
    from conftest import FIXTURE_GATES

    run = build(with_fixtures.out, "--gates-from", str(FIXTURE_GATES), "--check")
    assert run.returncode == 1
    assert "check: gate fixture_raises failed" in run.stdout
    assert "check: claim liar-killed: mxfp" in run.stdout
