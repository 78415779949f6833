"""Run one compiled kernel call in a fresh process with a chosen OpenMP thread count.

A determinism check that reruns a kernel in the same process proves little: the thread pool, the
allocator and every cache are already warm and the same. `run_digest` pickles the call's
arguments, starts `python -m k3gates.infra.fresh JOB` with `OMP_NUM_THREADS=n`, and returns the
digest of what the compiled kernel returned there. The child loads the kernel through the same
cache and the same guard (and, in a fault run, the same fault) as the gate's own process.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FRESH_TIMEOUT_S = 600.0


class FreshRunError(RuntimeError):
    """The child process failed; the message carries its last lines of output."""


def run_digest(modname: str, func: str, args: tuple, *, threads: int, python: bool = False) -> str:
    """The digest of compiled `modname.func(*args)` computed in a new process. With
    `python=True`, `modname` is a plain Python module (a training loop that only batches and
    calls kernels, which it loads compiled and guarded itself)."""
    job = {"modname": modname, "func": func, "args": args, "python": python}
    return _run(job, threads)["digest"]


def run_peak(modname: str, func: str, args: tuple, *, threads: int) -> dict[str, Any]:
    """Compiled `modname.func(*args)` in a new process, measured by the kernel of the OS: the
    growth of the process's peak resident memory during the call (VmHWM after the call, reset
    just before it, minus VmRSS before it), the bytes of each array the call returned, and the
    digest. Keys: digest, peak_growth_bytes, output_bytes (a list, in return order)."""
    job = {"modname": modname, "func": func, "args": args, "python": False, "peak": True}
    return _run(job, threads)


def _run(job: dict[str, Any], threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="k3fresh-") as tmp:
        path = Path(tmp) / "job.pickle"
        out = Path(tmp) / "out.json"
        path.write_bytes(pickle.dumps(job))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            # idle OpenMP threads sleep instead of spinning: on a loaded 2-core machine a
            # spinning team made a 2 s kernel take 77 s; results do not depend on it
            "OMP_WAIT_POLICY": "passive",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "k3gates.infra.fresh", str(path), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=FRESH_TIMEOUT_S,
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stdout + proc.stderr)[-1500:]
            raise FreshRunError(f"{job['modname']}.{job['func']} in a fresh process failed: {tail}")
        return json.loads(out.read_text())


def _status_kib(field: str) -> int:
    """A `VmRSS`/`VmHWM` line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise FreshRunError(f"/proc/self/status has no {field} line (Linux only)")


def main(argv: list[str]) -> int:
    from . import compile as kcompile
    from .bits import as_tuple, digest

    job: dict[str, Any] = pickle.loads(Path(argv[0]).read_bytes())
    if job.get("python"):
        module = importlib.import_module(job["modname"])
    else:
        module = kcompile.load(job["modname"])
    func = getattr(module, job["func"])
    report: dict[str, Any] = {}
    if job.get("peak"):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        before = _status_kib("VmRSS")
        result = func(*job["args"])
        report["peak_growth_bytes"] = (_status_kib("VmHWM") - before) * 1024
        report["output_bytes"] = [int(getattr(x, "nbytes", 0)) for x in as_tuple(result)]
    else:
        result = func(*job["args"])
    report["digest"] = digest(*as_tuple(result))
    Path(argv[1]).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
