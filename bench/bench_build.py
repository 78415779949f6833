"""Build speed, cold against incremental, from one run on a copy of the project.

    python bench/bench_build.py
    python bench/bench_build.py --issue-18    only the cold build of issue 18's gates

Each row is a full `python build.py` in a throwaway copy with its own empty cache, timed from
the outside, and shown as a ratio against the cold build. Then the render step alone per page and
the cold build's compile and gate phases (the build's own `time:` line), and each module's
compile time from its `compile:` lines (issue 18, item 6). First of all, on its own empty cache,
a cold build of the 34 gates issue 18 was filed against, whose target was <= 180 s. Prints;
asserts nothing.

For scale (issue 5): Hugo publishes about 1 ms per page and measures 0.8-1.3 ms per page on this
kind of machine. The aims (issue 18): a no-change rebuild of at most 1 s, a render of at most
5 ms/page.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from k3gates.infra.compile import cpu_model  # noqa: E402

COPY = ("build.py", "k3gates", "site_src", "templates")


def run(project: Path, cache: Path, *args: str) -> tuple[float, str]:
    env = {**os.environ, "K3GATES_CACHE": str(cache), "PYTHONPATH": str(project)}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "build.py", *args], cwd=project, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"build failed in the bench copy:\n{proc.stdout}\n{proc.stderr}")
    return seconds, proc.stdout


def issue_18_gates() -> list[str]:
    """The gates issue 18 was filed against ("cold build <= 180 s here with today's gates"): the
    34 of the first recorded digests (2026-12-03). The gates added since, mostly trainings from
    later issues, are in the full cold build."""
    with open(ROOT / "site_src" / "digests.jsonl", encoding="utf-8") as f:
        return sorted(json.loads(f.readline())["gates"])


def laps_of(report: str) -> dict[str, float]:
    """The build's own `time:` line: seconds per phase."""
    line = report.split("time: ", 1)[-1].split("\n")[0]
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", line)}


def print_phases(name: str, seconds: float, report: str) -> None:
    lap = laps_of(report)
    print(
        f"{name + ':':<12} {seconds:>7.1f} s from the shell; "
        f"compile {lap.get('compile', 0):.1f} s, gates {lap.get('gates', 0):.1f} s, "
        f"render {lap.get('render', 0):.2f} s"
    )


def print_issue_18(gates: list[str], seconds: float, report: str) -> None:
    print_phases("issue 18's", seconds, report)
    done = re.search(r"done: (.*)$", report, re.M)
    print(
        f"  issue 18's: a cold build of the {len(gates)} gates it was filed against, on its own "
        f"empty cache (--only, with what they build on): {done.group(1) if done else ''}"
    )


def main() -> None:
    alone = "--issue-18" in sys.argv[1:]  # just that cold build (3 minutes, not 25)
    with tempfile.TemporaryDirectory(prefix="k3bench-") as tmp:
        project, cache = Path(tmp) / "project", Path(tmp) / "cache"
        project.mkdir()
        for name in COPY:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, project / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, project / name)
        rows = []
        gates = issue_18_gates()
        only = [arg for g in gates for arg in ("--only", g)]
        issue_18 = run(project, Path(tmp) / "cache-issue-18", *only)
        if alone:
            print_issue_18(gates, *issue_18)
            print(f"\nCPU: {cpu_model()}")
            return
        cold, out = run(project, cache)
        rows.append(("cold build (empty cache)", cold, out))
        rows.append(("no-change rebuild", *run(project, cache)))
        page = project / "site_src" / "innovations" / "kda.md"
        page.write_text(page.read_text() + "\nOne more sentence.\n")
        rows.append(("content-only rebuild", *run(project, cache)))
        kernel = project / "k3gates" / "mxfp" / "kernels.py"
        kernel.write_text(kernel.read_text() + "\n# a changed kernel\n")
        rows.append(("one-kernel-change rebuild (mxfp)", *run(project, cache)))

    print(f"{'step':<36} {'seconds':>9} {'vs cold':>9}   what the build reported")
    for name, seconds, report in rows:
        done = re.search(r"done: (.*)$", report, re.M)
        print(
            f"{name:<36} {seconds:>9.2f} {seconds / cold:>8.3f}x   {done.group(1) if done else ''}"
        )
    per_page = [float(m) for m in re.findall(r"render ([\d.]+) ms/page", rows[1][2])]
    if per_page:
        print(
            f"{'render only, per page (no-change)':<36} {per_page[0] / 1000:>9.4f} "
            f"{per_page[0] / 1000 / cold:>8.5f}x   {per_page[0]:.2f} ms/page"
        )
    print(f"\nno-change rebuild is {cold / rows[1][1]:.0f}x faster than the cold build")
    cold_out = rows[0][2]
    print_phases("cold build", cold, cold_out)
    print_issue_18(gates, *issue_18)
    modules = re.findall(r"compile: (\S+) compiled in ([\d.]+) s", cold_out)
    print(f"\neach module's compile on the cold build ({len(modules)}, two at a time):")
    for name, seconds in sorted(modules, key=lambda m: -float(m[1])):
        print(f"  {name:<32} {float(seconds):>7.1f} s")
    print(f"\nCPU: {cpu_model()}")


if __name__ == "__main__":
    main()
