"""A broken fx constant fails its foundations gate and every innovation gate built on it.

Issue 3, acceptance point 4. The project is copied to a scratch folder, one constant of
k3gates/fx/kernels.py is broken there (LN2_Q56 off by 2^30, a relative error of 2^-26 in ln 2),
and the copy is built with a cache of its own. The build runs the exp gate and the gates this
project's SiTU kernels carry; every gate whose kernels import k3gates.fx.kernels must then be
reported failed (or, if it was not run, at least not passing), and the situ gates must carry a
failed `requires:fx_exp` check: a broken exp can never hide behind a tolerance downstream.

It compiles two kernel modules from scratch (fx, and situ which includes fx), so it is slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3gates.fx.kernels import LN2_Q56
from k3gates.infra import compile as kcompile
from k3gates.infra.discover import GatePackage, discover_gates

ROOT = Path(__file__).resolve().parent.parent
FX = "k3gates.fx.kernels"
COPIED = ("k3gates", "templates", "site_src")


def fx_dependents() -> list:
    """Every innovation gate whose kernels import fx, found as runner.apply_requirements does."""
    sites = discover_gates([GatePackage(ROOT / "k3gates")])

    def on_fx(site) -> bool:
        try:
            return any(FX in kcompile.dependencies(m) for m in site.kernels)
        except kcompile.CompileError:
            return False

    return [s for s in sites if s.innovation is not None and on_fx(s)]


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, list]:
    tree = tmp_path_factory.mktemp("broken") / "tree"
    tree.mkdir()
    shutil.copy2(ROOT / "build.py", tree / "build.py")
    for folder in COPIED:
        shutil.copytree(
            ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    kernels = tree / "k3gates" / "fx" / "kernels.py"
    text = kernels.read_text(encoding="utf-8")
    good = f"LN2_Q56 = {LN2_Q56}  #"
    assert text.count(good) == 1, "the constant this test breaks has moved; update the test"
    kernels.write_text(text.replace(good, f"LN2_Q56 = {LN2_Q56 + 2**30}  #"), encoding="utf-8")
    dependents = fx_dependents()
    ours = [s.id for s in dependents if s.module.startswith("k3gates.situ.")]
    only = [arg for gid in ["fx_exp", *ours] for arg in ("--only", gid)]
    env = {**os.environ, "K3GATES_CACHE": str(tree.parent / "cache")}
    out = tree.parent / "public"
    proc = subprocess.run(
        [sys.executable, str(tree / "build.py"), "--out", str(out), "--jobs", "2", *only],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    census = json.loads((out / "census.json").read_text())
    return census, proc.stdout, [s.id for s in dependents]


def gate(census: dict, gate_id: str) -> dict:
    return next(g for g in census["gates"] if g["id"] == gate_id)


def test_the_broken_constant_fails_its_own_gate(broken_build):
    census, _, _ = broken_build
    g = gate(census, "fx_exp")
    assert not g["passed"] and g["status"] == "failed"
    refs = [c for c in g["checks"] if c["kind"] == "reference"]
    assert refs and all(not c["passed"] for c in refs)
    assert all(c["measured"] > c["bound"] for c in refs)


def test_every_situ_gate_is_failed_with_a_failed_requires_check(broken_build):
    census, stdout, _ = broken_build
    situ = [g for g in census["gates"] if g["innovation"] == "situ"]
    assert {g["level"] for g in situ} == {"PARTIAL", "HAVE", "STRONG", "PROVEN"}
    for g in situ:
        assert not g["passed"] and g["status"] == "failed", g["id"]
        req = next(c for c in g["checks"] if c["name"] == "requires:fx_exp")
        assert not req["passed"] and req["message"] == "required gate fx_exp failed"
    row = next(r for r in census["innovations"] if r["id"] == "situ")
    assert row["level"] == "GAP"
    assert "gate: situ_training" in stdout


def test_no_gate_that_builds_on_fx_passes(broken_build):
    census, _, dependents = broken_build
    assert dependents  # at least the situ gates
    for gid in dependents:
        assert not gate(census, gid)["passed"], gid
