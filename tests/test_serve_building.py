"""Issue 18, item 5: a page within seconds of a cold start.

A copy of the project with no public/ is served by its own `python -m serve`. The build it starts
runs one fixture gate that takes a few seconds (tests/fixtures/slow_gates) and compiles no
kernel, so the whole build takes seconds. The server must answer 200 with the building page
within 5 s of being started, and then, by build.py's atomic swap, the real index.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from serve_support import READY, Server, get

SLOW_GATES = ROOT / "tests" / "fixtures" / "slow_gates"
FOLDERS = ("serve", "k3gates", "site_src", "templates")  # and build.py


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project checkout without public/, as a fresh clone has."""
    copy = tmp_path / "project"
    for name in FOLDERS:
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "build.py", copy)
    assert not (copy / "public").exists()
    return copy


def _serve(project: Path, tmp_path: Path, *build_args: str) -> Iterator[tuple[Server, float]]:
    state, log = tmp_path / "state", tmp_path / "serve.log"
    env = {
        **os.environ,
        "K3SERVE_STATE": str(state),
        "K3GATES_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(project),  # the copy's serve/ and k3gates/, not the checkout's
        "PYTHONUNBUFFERED": "1",
    }
    args = [f"--build-arg={a}" for a in build_args]
    command = [sys.executable, "-m", "serve", "--port", "0", "--workers", "1", *args]
    started = time.monotonic()
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=project, env=env, stdout=sink, stderr=sink)
    try:
        while not (match := READY.search(log.read_text(errors="replace"))):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() - started < 30, log.read_text()
            time.sleep(0.02)
        yield Server(process, int(match.group(2)), state, log), started
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(20)


def _first_answer(server: Server, started: float) -> tuple[float, bytes, int]:
    while True:
        try:
            reply = get(server, "/")
            return time.monotonic() - started, reply.body, reply.status
        except OSError:
            assert time.monotonic() - started < 30, server.stderr()
            time.sleep(0.02)


def test_a_cold_start_serves_the_building_page_within_5_s_then_the_site(
    project: Path, tmp_path: Path
):
    gen = _serve(project, tmp_path, f"--gates-from={SLOW_GATES}", "--only=fixture_slow")
    server, started = next(gen)
    try:
        seconds, body, status = _first_answer(server, started)
        page = body.decode()
        print(f"\nfirst answer after {seconds:.2f} s")
        assert status == 200 and seconds < 5, (status, seconds)
        assert "Building the site" in page
        assert re.search(r'<meta http-equiv="refresh" content="\d+">', page)
        assert "Kernel modules compiled" in page and "Gates run" in page
        assert "<script" not in page  # the CSP allows none inline; the page needs none
        seen_gates = set()
        deadline = time.monotonic() + 120
        while "Building the site" in page:
            seen_gates |= set(re.findall(r'id="gates">([^<]*)<', page))
            assert time.monotonic() < deadline, page
            time.sleep(0.25)
            page = get(server, "/").body.decode()
        # the page followed the build: gate counts were shown while the slow gate ran
        assert any(re.fullmatch(r"\d+ of \d+ gates", g) for g in seen_gates), seen_gates
        assert "<h1" in page and "census" in page.lower()
        assert "fixture_slow" in get(server, "/census.json").body.decode()
        assert not (project / "public" / ".building").exists()
    finally:
        gen.close()


def test_a_failed_build_shows_its_error_and_keeps_serving(project: Path, tmp_path: Path):
    gen = _serve(project, tmp_path, "--only=no_such_gate")
    server, started = next(gen)
    try:
        deadline = time.monotonic() + 30
        page = _first_answer(server, started)[1].decode()
        while "The build failed" not in page:
            assert time.monotonic() < deadline, page
            time.sleep(0.1)
            page = get(server, "/").body.decode()
        assert "--only: no gate named no_such_gate" in page
        assert 'http-equiv="refresh"' not in page  # nothing more is coming
        time.sleep(1)
        assert server.process.poll() is None  # still serving the failure
        assert "The build failed" in get(server, "/any/page/").body.decode()
    finally:
        gen.close()
