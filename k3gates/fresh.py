"""Run one compiled kernel call in a fresh process with a chosen OpenMP thread count.

A determinism check that reruns a kernel in the same process proves little: the thread pool, the
allocator and every cache are already warm and the same. `run_digest` pickles the call's
arguments, starts `python -m k3gates.fresh JOB` with `OMP_NUM_THREADS=n`, and returns the digest
of what the compiled kernel returned there. The child loads the kernel through the same cache and
the same guard (and, in a fault run, the same fault) as the gate's own process.
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
    with tempfile.TemporaryDirectory(prefix="k3fresh-") as tmp:
        job = Path(tmp) / "job.pickle"
        out = Path(tmp) / "out.json"
        job.write_bytes(
            pickle.dumps({"modname": modname, "func": func, "args": args, "python": python})
        )
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            # idle OpenMP threads sleep instead of spinning: on a loaded 2-core machine a
            # spinning team made a 2 s kernel take 77 s; results do not depend on it
            "OMP_WAIT_POLICY": "passive",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "k3gates.fresh", str(job), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=FRESH_TIMEOUT_S,
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stdout + proc.stderr)[-1500:]
            raise FreshRunError(f"{modname}.{func} in a fresh process failed: {tail}")
        return json.loads(out.read_text())["digest"]


def main(argv: list[str]) -> int:
    from . import compile as kcompile
    from .gate import _as_tuple, digest

    job: dict[str, Any] = pickle.loads(Path(argv[0]).read_bytes())
    if job.get("python"):
        module = importlib.import_module(job["modname"])
    else:
        module = kcompile.load(job["modname"])
    result = getattr(module, job["func"])(*job["args"])
    Path(argv[1]).write_text(json.dumps({"digest": digest(*_as_tuple(result))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
