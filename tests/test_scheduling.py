"""The runner's slots: an exclusive gate (a training gate and its fresh rerun) runs with nothing
beside it and with every core, so the wall time the build prints is its own."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from k3gates.infra import runner
from k3gates.infra.discover import GateSite
from k3gates.infra.registry import Level


def _site(gate_id: str, exclusive: bool = False) -> GateSite:
    return GateSite(gate_id, None, Level.PARTIAL, f"x.{gate_id}", Path("."), Path("x.py"), 1,
                    exclusive=exclusive)  # fmt: skip


def _run(monkeypatch, sites: list[GateSite], jobs: int = 2) -> dict[str, tuple]:
    spans: dict[str, tuple] = {}
    lock = threading.Lock()

    def fake_run_one(site, *, threads, env_extra=None):
        start = time.perf_counter()
        time.sleep(0.05)
        with lock:
            spans[site.id] = (start, time.perf_counter(), threads)
        return {"id": site.id, "status": "error"}

    monkeypatch.setattr(runner, "_run_one", fake_run_one)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    runner.run_gates(sites, jobs=jobs, reuse=False)
    return spans


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_an_exclusive_gate_runs_alone_with_every_core(monkeypatch):
    sites = [_site("a"), _site("b"), _site("train", exclusive=True), _site("c"), _site("d")]
    spans = _run(monkeypatch, sites)
    assert spans["train"][2] == 2  # every core; a shared gate gets cpu_count // jobs
    assert all(spans[g][2] == 1 for g in "abcd")
    assert not any(_overlap(spans["train"], spans[g]) for g in "abcd")
    # and the shared gates do share the machine: two of them ran at once
    assert any(_overlap(spans[x], spans[y]) for x in "abcd" for y in "abcd" if x < y)


def test_without_the_flag_gates_overlap(monkeypatch):
    """The check above can fail: the same gate, not exclusive, runs beside another."""
    sites = [_site("a"), _site("b"), _site("train"), _site("c"), _site("d")]
    spans = _run(monkeypatch, sites)
    assert any(_overlap(spans["train"], spans[g]) for g in "abcd")


def test_discovery_reads_the_flag(tmp_path: Path):
    from k3gates.infra.discover import GatePackage, discover_gates

    (tmp_path / "pkg" / "inno").mkdir(parents=True)
    (tmp_path / "pkg" / "inno" / "gate.py").write_text(
        "from k3gates.infra.gate import gate\n\n"
        '@gate("t1", innovation="kda", level="PARTIAL", exclusive=True)\n'
        "def t1(ctx):\n    pass\n\n"
        '@gate("t2", innovation="kda", level="PARTIAL")\n'
        "def t2(ctx):\n    pass\n"
    )
    sites = {s.id: s for s in discover_gates([GatePackage(tmp_path / "pkg")])}
    assert sites["t1"].exclusive and not sites["t2"].exclusive


def test_only_runs_what_its_gates_build_on_unless_it_can_be_reused(monkeypatch):
    """build.py --only X: X runs; a gate X builds on runs when it has no result to reuse, and is
    reused when it has one; any other gate without a result is skipped."""
    ran: list[str] = []

    def fake_run_one(site, *, threads, env_extra=None):
        ran.append(site.id)
        return {"id": site.id, "status": "error"}

    stored = {"base_reused": {"id": "base_reused", "status": "passed", "run_hash": "h1"}}
    monkeypatch.setattr(runner, "_run_one", fake_run_one)
    monkeypatch.setattr(runner, "_reusable", lambda site: stored.get(site.id))
    sites = [_site(g) for g in ("chosen", "base_missing", "base_reused", "other")]
    out = runner.run_gates(sites, only={"chosen"}, needed={"base_missing", "base_reused"})
    by_id = {r["id"]: r for r in out}
    assert sorted(ran) == ["base_missing", "chosen"]
    assert by_id["base_reused"]["reused_from"] == "h1" and not by_id["base_reused"]["ran"]
    assert by_id["other"]["status"] == "skipped"
