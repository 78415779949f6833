"""Build speed, cold against incremental, from one run on a copy of the project.

    python bench/bench_build.py

Each row is a full `python build.py` in a throwaway copy with its own empty cache, timed from
the outside, and shown as a ratio against the cold build. The last row is the render step alone
per page, read from the build's own `time:` line. Prints; asserts nothing.

For scale (issue 5): Hugo publishes about 1 ms per page and measures 0.8-1.3 ms per page on this
kind of machine. The aims here: a no-change rebuild of at most 1 s, a render of at most 2 ms/page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY = ("build.py", "k3gates", "site_src", "templates")


def run(project: Path, cache: Path) -> tuple[float, str]:
    env = {**os.environ, "K3GATES_CACHE": str(cache), "PYTHONPATH": str(project)}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "build.py"], cwd=project, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"build failed in the bench copy:\n{proc.stdout}\n{proc.stderr}")
    return seconds, proc.stdout


def main() -> None:
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


if __name__ == "__main__":
    main()
