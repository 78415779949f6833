"""Shared fixtures: the project root, a build runner, and one full build per test session.

The session build uses a cache of its own (never the developer's ~/.cache), so the suite proves
the cold path every time. Set K3_TEST_CACHE to a folder to keep that cache across sessions while
iterating locally; CI never sets it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_GATES = ROOT / "tests" / "fixtures" / "fixture_gates"

# Gates that fail honestly on this code, each with the one check that fails it. A test fails if
# any other gate or check fails, and also if one of these starts to pass (then remove it here).
# Each fails the shared training helper's relative tolerance of 3% to the float64 twin, declared
# before any run (issue 13, item 10):
# - muon_training: the integer per-head Muon run and the float64 run part late (the record of
#   faa0dec: integer / float64 loss 1.188 at logged point 198 of 201).
# - attnres_training: the run goes on far below its 1e-8 threshold, to losses of 1e-14 where the
#   integer loss's own resolution dominates, and the ratio there reaches 2.4.
HONEST_FAILURES = {
    "muon_training": {"loss_curve"},
    "attnres_training": {"loss_curve"},
}


@dataclass
class BuildRun:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @property
    def census(self) -> dict:
        return json.loads((self.out / "census.json").read_text())


def gate_row(run: BuildRun, gate_id: str) -> dict:
    """One gate's row of the published census."""
    return next(g for g in run.census["gates"] if g["id"] == gate_id)


def check(row: dict, name: str) -> dict:
    """One check of a gate's row, by name."""
    return next(c for c in row["checks"] if c["name"] == name)


def run_build(out: Path, *args: str, cache: Path, timeout: float = 3600) -> BuildRun:
    env = {**os.environ, "K3GATES_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return BuildRun(proc.returncode, proc.stdout, proc.stderr, out)


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (following the published symlink) -> sha256 of its bytes."""
    real = folder.resolve()
    return {
        str(p.relative_to(real)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(real.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("K3_TEST_CACHE"):
        return Path(os.environ["K3_TEST_CACHE"])
    return tmp_path_factory.mktemp("k3cache")


def two_worker_cluster():
    """A Dask LocalCluster of two worker processes of one slot each, with distributed's default
    config (the scheduler retries a task whose worker died; the Nanny sets
    OMP/MKL/OPENBLAS_NUM_THREADS=1 for its workers), used through its address as
    `--runner tcp://…` would use a remote one. The Nanny also sets them in this process; they are
    put back, as on a machine whose workers run elsewhere. Workers inherit this process's
    environment, K3GATES_CACHE included."""
    import logging

    import distributed

    from k3gates.infra import cluster

    before = dict(os.environ)
    lc = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        resources={cluster.SLOTS: 1},
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    os.environ.clear()
    os.environ.update(before)
    return lc


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory, session_cache: Path) -> BuildRun:
    """One full build of the real project, shared by every test that reads the site.

    Its gates run on the local runner, as `python build.py` runs them: a training gate alone with
    both cores. (Until issue 47 this build ran on a two-worker Dask cluster, which gives a
    training gate one core and took twice as long: test_cluster.py now holds a representative
    subset on Dask against the local runner in every run, and the whole default set through the
    runs `python build.py --runner dask --rerun --record` records.)"""
    out = tmp_path_factory.mktemp("site") / "public"
    run = run_build(out, cache=session_cache)
    if run.returncode != 0:
        pytest.fail(f"the project's own build failed:\n{run.stdout}\n{run.stderr}")
    return run


@pytest.fixture
def build(session_cache: Path) -> Callable[..., BuildRun]:
    def _build(out: Path, *args: str) -> BuildRun:
        return run_build(out, *args, cache=session_cache)

    return _build


def build_module():
    """build.py imported as a module (it is a script, not a package), once per session."""
    import importlib.util

    name = "k3_build_module"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "build.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through Playwright (DESIGN.md: no browser download), one per module."""
    from lesson_support import CHROMIUM, CHROMIUM_ARGS

    playwright_sync = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
