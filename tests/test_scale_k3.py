"""Issue 19, item 4: the --scale k3 gate set, outside the default build, and its recorded runs
on the innovation pages. The gate itself runs here at a reduced expert count (its K3-size run is
the documented command); each of its comparisons is shown able to fail."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT, BuildRun, build_module

from k3gates.infra.discover import GatePackage, discover_gates
from k3gates.infra.gate import CONTRACT_KINDS, REGISTRY, GateContext
from k3gates.moe import layer_k3 as L

SMALL = L.Shape(n_experts=16, top_k=4, n_shared=2, hidden=128, latent=64, expert_width=64,
                shared_width=64)  # fmt: skip


@pytest.fixture
def build_py() -> ModuleType:
    return build_module()


def _ids(packages) -> set[str]:
    return {g.id for g in discover_gates([GatePackage(p) for p in packages])}


def test_the_k3_gate_set_is_added_only_by_scale_k3(build_py: ModuleType) -> None:
    default, k3 = build_py.parse_args([]), build_py.parse_args(["--scale", "k3"])
    assert "latentmoe_k3_layer" not in _ids(default.packages)
    assert "latentmoe_k3_layer" in _ids(k3.packages)
    assert k3.scale == "k3" and (ROOT / "scale_k3") in k3.packages


@pytest.fixture
def gate_module(monkeypatch) -> ModuleType:
    """The gate at 16 experts, top-4 (its bounds declared for that shape), on 2 workers."""
    monkeypatch.syspath_prepend(str(ROOT))
    g = importlib.import_module("scale_k3.moe_layer.gate")
    monkeypatch.setattr(g, "SHAPE", SMALL)
    monkeypatch.setattr(g, "TOKENS", 12)
    monkeypatch.setattr(g, "ROW_L1", g.row_l1_premise(SMALL))
    return g


def _context(g: ModuleType) -> GateContext:
    bounds = L.declared_bounds(SMALL, g.ROW_L1)  # the premise at SMALL's reduction length
    spec = dataclasses.replace(REGISTRY["latentmoe_k3_layer"], bounds=dict(bounds))
    ctx = GateContext(spec)
    g.latentmoe_k3_layer(ctx)
    return ctx


def _run(g: ModuleType) -> dict[str, bool]:
    return {c.name: c.passed for c in _context(g).checks}


def test_the_gate_passes_at_a_reduced_expert_count(gate_module) -> None:
    ctx = _context(gate_module)
    checks = {c.name: c.passed for c in ctx.checks}
    # the contract's kinds (the runner adds the no-float scans of the declared kernels)
    assert {c.kind for c in ctx.checks} | {"nofloat"} == set(CONTRACT_KINDS)
    assert checks == {"compiled_packed_matmul": True, "compiled_router": True,
                      "sharded_by_expert": True, "premises": True, "c": True, "y": True,
                      "one_process": True}  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "fails"),
    [("one_lsb", {"one_process"}), ("zero_y", {"y", "one_process"})],
)
def test_a_corrupted_parallel_result_fails_the_gate(gate_module, monkeypatch, fault, fails) -> None:
    forward = L.LatentMoE.forward_parallel

    def broken(self, client, x):
        out = forward(self, client, x)
        if fault == "one_lsb":
            out.c[:, 0] += 1  # one LSB of Q.40 in every token's combine
        else:
            out.y[:] = 0
        return out

    monkeypatch.setattr(L.LatentMoE, "forward_parallel", broken)
    checks = _run(gate_module)
    assert {name for name, ok in checks.items() if not ok} == fails


# -- recorded runs --------------------------------------------------------------------------------
def _record(gate: str = "latentmoe_k3_layer", passed: bool = True, measured: float = 3.25) -> dict:
    return {
        "gate": gate, "innovation": "latentmoe", "level": "HAVE", "commit": "0123456789abcdef",
        "built_at": "2026-12-06T01:00:00+00:00", "cpu": "Test CPU", "seconds": 400.0,
        "command": "python build.py --scale k3 --only latentmoe_k3_layer --record",
        "passed": passed, "summary": "a recorded summary",
        "checks": [{"name": "y", "kind": "reference", "passed": passed, "bound": 11210.0,
                    "measured": measured, "unit": "LSB (2^-24)"}],
        "artifacts": {"table:throughput": {"columns": ["", "value"],
                                           "rows": [["tokens/s", "0.123"]]}},
    }  # fmt: skip


def test_record_runs_keeps_only_the_scale_gates_run_in_this_build(build_py, tmp_path) -> None:
    def gate(gid: str, file: str, reused: str | None = None) -> dict:
        return {"id": gid, "innovation": "latentmoe", "level": "HAVE", "file": file,
                "reused_from": reused, "passed": True, "summary": "s", "seconds": 1.0,
                "artifacts": {}, "checks": [
                    {"name": "n", "kind": "nofloat", "passed": True, "bound": None,
                     "measured": None, "unit": ""},
                    {"name": "y", "kind": "reference", "passed": True, "bound": 2.0,
                     "measured": 1.0, "unit": "LSB"}]}  # fmt: skip

    census = {
        "provenance": {"git_commit": "f" * 40, "git_dirty": False, "built_at": "2026-12-06",
                       "cpu": "Test CPU"},
        "gates": [gate("moe_layer", "k3gates/moe/gate.py"),
                  gate("latentmoe_k3_layer", "scale_k3/moe_layer/gate.py"),
                  gate("old_k3_gate", "scale_k3/old/gate.py", reused="abc")],
    }  # fmt: skip
    s = build_py.Settings(content=tmp_path, scale="k3")
    assert build_py.record_runs(census, [], s) == 0
    lines = (tmp_path / build_py.RUNS_FILE).read_text().splitlines()
    assert [json.loads(x)["gate"] for x in lines] == ["latentmoe_k3_layer"]
    rec = json.loads(lines[0])
    assert set(rec) >= build_py.RUN_KEYS
    assert [c["name"] for c in rec["checks"]] == ["y"]  # the no-float scans stay in the census
    dirty = {**census, "provenance": {**census["provenance"], "git_dirty": True}}
    assert build_py.record_runs(dirty, [], s) == 1  # only a commit's build is recorded


def _content_with_runs(tmp_path: Path, *records: dict) -> Path:
    import shutil

    content = tmp_path / "site_src"
    shutil.copytree(ROOT / "site_src", content)
    (content / "recorded_runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return content


def test_a_recorded_run_shows_on_its_innovation_page_labelled(built_site: BuildRun, build,
                                                              tmp_path: Path) -> None:  # fmt: skip
    old, new = _record(measured=9.5), _record(measured=3.25)
    content = _content_with_runs(tmp_path, old, new)
    run = build(tmp_path / "public", "--content", str(content))
    assert run.returncode == 0, run.stdout + run.stderr
    page = (tmp_path / "public" / "innovations" / "latentmoe" / "index.html").read_text()
    assert "Recorded runs, not this build" in page
    assert "0123456789ab" in page and "Test CPU" in page and "a recorded summary" in page
    assert "3.25 LSB" in page and "9.5 LSB" not in page  # the latest run of the gate only
    assert "0.123" in page  # its tables
    other = (tmp_path / "public" / "innovations" / "kda" / "index.html").read_text()
    assert "Recorded runs" not in other
    census = json.loads((tmp_path / "public" / "census.json").read_text())
    assert "latentmoe_k3_layer" not in {g["id"] for g in census["gates"]}  # not this build's


def test_a_malformed_recorded_run_names_its_file_and_line(build, tmp_path: Path) -> None:
    bad = _record()
    del bad["commit"]
    content = _content_with_runs(tmp_path, _record(), bad)
    run = build(tmp_path / "public", "--content", str(content))
    assert run.returncode == 1
    assert f"{content / 'recorded_runs.jsonl'}:2: record lacks commit" in run.stderr


def test_a_row_l1_above_the_premise_fails_the_premises(gate_module, monkeypatch) -> None:
    monkeypatch.setattr(gate_module, "ROW_L1", 1.0)  # below the generator's mean row L1, 1.19
    checks = _run(gate_module)
    assert {name for name, ok in checks.items() if not ok} == {"premises"}
