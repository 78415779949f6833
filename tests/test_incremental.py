"""Incremental rebuilds, proven from the build's own report on a copy of the project.

The copy holds the framework and the mxfp package only, so the test does not pay for every
other gate; the rules it proves are the same for all of them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, run_build


@pytest.fixture(scope="module")
def project(tmp_path_factory, session_cache) -> Path:
    dst = tmp_path_factory.mktemp("copy") / "project"
    (dst / "k3gates").mkdir(parents=True)
    for f in (ROOT / "k3gates").glob("*.py"):
        shutil.copy(f, dst / "k3gates" / f.name)
    shutil.copytree(
        ROOT / "k3gates" / "infra",
        dst / "k3gates" / "infra",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    # mxfp's formats alone: its QAT form (gate_qat and what it needs) trains K3-mu
    shutil.copytree(
        ROOT / "k3gates" / "mxfp",
        dst / "k3gates" / "mxfp",
        ignore=shutil.ignore_patterns("__pycache__", "*_qat.py", "expert.py"),
    )
    for name in ("site_src", "templates"):
        shutil.copytree(ROOT / name, dst / name)
    shutil.copy(ROOT / "build.py", dst / "build.py")
    return dst


def build(project: Path, cache: Path) -> str:
    env = {**os.environ, "K3GATES_CACHE": str(cache), "PYTHONPATH": str(project)}
    proc = subprocess.run(
        [sys.executable, "build.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def counts(report: str) -> tuple[int, int]:
    m = re.search(r"done: compiled (\d+), reused \d+ modules; gates ran (\d+),", report)
    assert m, report
    return int(m.group(1)), int(m.group(2))


def test_rebuild_does_only_what_the_change_needs(project: Path, session_cache: Path):
    first = build(project, session_cache)
    assert counts(first)[1] == 2  # a new checkout: the gates run (their files moved)

    # nothing changed: nothing compiles, no gate runs
    again = build(project, session_cache)
    assert counts(again) == (0, 0) and "compile: nothing to compile" in again

    # a content-only change: re-render only, and the page shows the new text
    page = project / "site_src" / "innovations" / "kda.md"
    page.write_text(page.read_text() + "\nA sentence added by the incremental test.\n")
    content = build(project, session_cache)
    assert counts(content) == (0, 0)
    html = (project / "public" / "innovations" / "kda" / "index.html").read_text()
    assert "A sentence added by the incremental test." in html

    # a template change: re-render only
    tpl = project / "templates" / "404.html"
    tpl.write_text(tpl.read_text().replace("No page lives", "Nothing lives"))
    assert counts(build(project, session_cache)) == (0, 0)
    assert "Nothing lives" in (project / "public" / "404.html").read_text()

    # touching a kernel without changing it: the content hash is the same, nothing compiles
    kernel = project / "k3gates" / "mxfp" / "kernels.py"
    os.utime(kernel)
    assert counts(build(project, session_cache)) == (0, 0)

    # a comment in one kernel: it recompiles (the compiler reads bytes), but no gate runs again:
    # a result is keyed by the code's content, which a comment is not (k3gates/infra/contentkey.py)
    # (unique per run, so a cache kept across sessions with K3_TEST_CACHE has never seen it)
    kernel.write_text(kernel.read_text() + f"\n# an edit that changes the bytes {uuid.uuid4()}\n")
    assert counts(build(project, session_cache)) == (1, 0)

    # changing one kernel's code: exactly that module recompiles and only its gates re-run
    edit = f"\n\ndef _edited():\n    return {uuid.uuid4().int % 2**62}\n"
    kernel.write_text(kernel.read_text() + edit)
    changed = build(project, session_cache)
    assert counts(changed) == (1, 2)
    assert re.findall(r"compile: (\S+) compiled in", changed) == ["k3gates.mxfp.kernels"]
    ran = re.findall(r"gate: (\S+)\s+\S+\s+\(ran", changed)
    assert sorted(ran) == ["mxfp_decode", "mxfp_quantize"]


def test_another_checkout_does_not_evict_this_ones_results(
    project: Path, session_cache: Path, built_site
):
    """Two checkouts share one cache: the copy's gates running again (their gate file changed)
    must leave the original checkout's stored results reusable."""
    gate_file = project / "k3gates" / "mxfp" / "gate.py"
    gate_file.write_text(gate_file.read_text() + "\n_AN_EDIT_THAT_MAKES_ITS_GATES_RUN = 1\n")
    assert counts(build(project, session_cache))[1] == 2
    again = run_build(built_site.out, cache=session_cache)
    assert again.returncode == 0, again.stderr
    assert re.search(r"gates ran 0, reused \d+", again.stdout), again.stdout
