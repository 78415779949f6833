"""Gates on a Dask cluster: `python build.py --runner dask` or `--runner tcp://HOST:PORT`.

Each gate is one Dask task. Its worker does what the local runner does on this machine: it runs
the gate in its own `python -m k3gates.infra.runner` subprocess, with the gate's timeout and OpenMP
threads (`runner._run_one`), so a hang or a crash becomes a failed gate with its reason.

What a worker runs is this checkout, not whatever the worker has on disk. The gate packages (and
k3gates itself) ship as one content-addressed tree, written once per worker under the cache, and
kernels compile there through the same content-hash cache (`compile.ensure`). Paths in a result
are mapped back to this checkout, so the result is the one the local runner would have written,
digests included, and the runner stores and reuses it the same way.

A worker that dies mid-gate fails the gate; it is never retried into a pass. A local cluster's
scheduler allows no failures (it raises KilledWorker). An existing scheduler may retry the task
on another worker, so the task marks its first start with a Dask Event and refuses a second one.

This module runs in the build process (`DaskPool`) and in Dask workers (`_gate_task`); gate
processes never import it, so it is not part of any gate's code hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import compile as kcompile
from . import contentkey, runner
from .discover import GatePackage, GateSite, kernel_modules

LOCAL = "dask"  # --runner dask: a LocalCluster on this machine, one worker with `jobs` slots
SLOTS = "slots"  # the worker resource a gate takes: 1, or a whole worker's for an exclusive gate
CONNECT_TIMEOUT_S = 20
WORKERS_TIMEOUT_S = 60  # how long to wait for a worker with slots to join the scheduler
TREE_DIR = "trees"  # under the cache: one folder per shipped source tree, named by its hash
TREE_MAX_AGE_S = 7 * 24 * 3600  # unused trees are removed after a week
SKIP_PARTS = {"__pycache__", ".pytest_cache"}
PACKAGE = Path(__file__).resolve().parents[1]  # k3gates itself: every gate process imports it
# distributed's Nanny sets these for its worker processes (its pre-spawn environ), in the
# process that starts it too: the thread counts to 1, and glibc's malloc trim threshold to 64 KiB.
# A gate process must see the build's values, as the local runner's do: a float64 twin's BLAS on
# another thread count sums in another order, and its losses differ in the last digits; and with
# the low trim threshold every large temporary array goes back to the kernel and faults in again
# (measured: kda_mqar 117.5 s against 83.0 s on the local runner).
NANNY_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")


class ClusterError(RuntimeError):
    """The cluster cannot run gates: `distributed` missing, the scheduler unreachable, or no
    worker offering slots. The message says what to do."""


def _distributed() -> Any:
    try:
        import distributed
    except ImportError as e:
        raise ClusterError(
            "the Dask runner needs the optional extra: pip install -e '.[cluster]'"
        ) from e
    return distributed


# -- build side ----------------------------------------------------------------------------------
class DaskPool:
    """A `runner.GatePool` whose gates run as tasks on a Dask cluster.

    `address` is "dask" for a LocalCluster (one worker with `jobs` slots) or a scheduler's
    address. `packages` are the gate package folders the build discovered. A worker is taken
    for a machine of its own, unless every worker runs on one host (`one_machine`)."""

    def __init__(self, address: str, *, jobs: int, packages: Iterable[Path]) -> None:
        d = _distributed()
        import dask

        self.build_env = {name: os.environ.get(name) for name in NANNY_ENV}
        self.cluster = None
        if address == LOCAL:
            # no retries: a worker that dies mid-gate fails the gate (KilledWorker); and no
            # pre-spawn environ, which would also land in this process's own
            settings = {
                "distributed.scheduler.allowed-failures": 0,
                "distributed.nanny.pre-spawn-environ": {},
            }
            with dask.config.set(settings):
                self.cluster = d.LocalCluster(
                    n_workers=1,
                    threads_per_worker=max(1, jobs),
                    processes=True,
                    resources={SLOTS: max(1, jobs)},
                    dashboard_address=None,
                    silence_logs=logging.ERROR,
                )
            address = self.cluster.scheduler_address
        try:
            self.client = d.Client(address, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            self.close()
            raise ClusterError(f"cannot reach the Dask scheduler at {address}: {e}") from e
        try:
            workers = _worker_slots(self.client)
        except ClusterError:
            self.close()
            raise
        slots = [n for _, n in workers]
        self.width = sum(slots)  # gates in flight: as many as the cluster has slots
        self.exclusive_slots = min(slots)  # a whole worker, on every worker
        # Several workers on one machine (a LocalCluster of worker processes, or `dask worker`
        # started twice on a host) share its cores. There an exclusive gate waits for every
        # slot and runs alone, as on the local runner; else its fresh rerun would compete with
        # the other workers' gates (measured: kda_mqar 338 s against 79 s alone).
        self.one_machine = len(workers) > 1 and len({host for host, _ in workers}) == 1
        self.machine = runner._Slots(self.width) if self.one_machine else None
        self.homes = {p.name: p.resolve() for p in [PACKAGE, *packages]}
        tree = source_tree(self.homes.values())
        self.tree_key = tree_key(tree)
        # held by the scheduler, not scattered to a worker: a worker's death must not lose it
        self.tree = d.Variable(f"k3gates-tree-{self.tree_key}", client=self.client)
        self.tree.set(tree)
        self._events, self._killed = d.Event, d.KilledWorker

    def run(self, site: GateSite, started: Callable[[], None]) -> dict[str, Any]:
        if self.machine is None:
            return self._run(site, started, threads=None)
        with self.machine.held(site.exclusive):
            return self._run(site, started, runner.gate_threads(site.exclusive, self.width))

    def _run(
        self, site: GateSite, started: Callable[[], None], threads: int | None
    ) -> dict[str, Any]:
        """One gate as one task; `threads` for its process, or None for its worker's share."""
        key = f"gate-{site.id}-{uuid.uuid4().hex[:12]}"
        rel = site.file.resolve().relative_to(site.root.resolve())
        start = time.perf_counter()
        future = self.client.submit(
            _gate_task,
            replace(site, root=Path("."), file=rel),
            self.tree_key,
            self.tree.name,
            key,
            self.build_env,
            threads,
            key=key,
            resources={SLOTS: self.exclusive_slots if site.exclusive else 1},
            priority=int(site.exclusive),  # like the local runner: exclusive gates go first
            pure=False,
        )
        began = self._events(key, client=self.client)
        while not future.done() and not began.wait(timeout=0.5):
            pass
        started()
        try:
            out = future.result()
        except self._killed as e:
            out = {"died": f"{type(e).__name__}: {e}"}
        except Exception as e:  # a lost scheduler, a cancelled task, a task that raised
            out = {"lost": f"{type(e).__name__}: {e}"}
        finally:
            began.clear()
        if "result" not in out:
            if out.get("retried"):
                why = (
                    "its Dask worker died while running it, and the scheduler started it again "
                    "on another worker; a gate is never retried into a pass"
                )
            elif "died" in out:
                why = f"its Dask worker died while running it ({out['died'][:300]}); not retried"
            else:
                why = f"the Dask task did not return a result: {out['lost'][:300]}"
            return {
                **runner._failure(site, "crashed", why),
                "seconds": round(time.perf_counter() - start, 3),
            }
        return self._mapped(site, Path(out["root"]), out["result"])

    def _mapped(self, site: GateSite, there: Path, result: dict[str, Any]) -> dict[str, Any]:
        """The worker's result with its tree's paths mapped to this checkout, and only the
        sources the local runner would have hashed (those under the gate's root), keyed as the
        local runner keys them: a key names what each import binds among the modules under the
        root, and the worker's tree holds other modules beside the gate's (k3gates itself, when
        the gate package lives elsewhere). The files are byte for byte this checkout's."""
        pairs = [(f"{there / name}", str(home)) for name, home in self.homes.items()]
        result = _relocated(result, pairs)
        root = site.root.resolve()
        index = contentkey.module_index(root)
        result["deps"] = {
            f: contentkey.file_key(Path(f), index)
            for f in result.get("deps", {})
            if Path(f).is_relative_to(root)
        }
        if result.get("code"):  # a gate that never reached a verdict has none, as on this machine
            result["gate_key"] = contentkey.file_key(site.file, index)
            result["code"] = contentkey.code_key(result["deps"].values(), result.get("data", {}))
        result.update(runner.placed(site))
        result["runner"] = "dask"  # kept with the stored result: digest records name it
        return result

    def close(self) -> None:
        if getattr(self, "tree", None) is not None:
            self.tree.delete()
        for thing in (getattr(self, "client", None), self.cluster):
            if thing is not None:
                thing.close()

    def __enter__(self) -> DaskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker_slots(client: Any) -> list[tuple[str, int]]:
    """Each worker with slots, as (its host, its slots); waits a while for the first to join."""
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while True:
        workers = client.scheduler_info()["workers"].values()
        slots = [(w.get("host", ""), int(w.get("resources", {}).get(SLOTS, 0))) for w in workers]
        if any(n for _, n in slots):
            return [(host, n) for host, n in slots if n]
        if time.monotonic() > deadline:
            raise ClusterError(
                f"no Dask worker with the '{SLOTS}' resource joined within {WORKERS_TIMEOUT_S} s; "
                f"start one per machine: dask worker tcp://SCHEDULER:8786 --nthreads N "
                f"--resources {SLOTS}=N (N = its cores)"
            )
        time.sleep(0.5)


def source_tree(folders: Iterable[Path]) -> dict[str, bytes]:
    """Every file of each package folder, keyed `package/relative/path`."""
    tree = {}
    for folder in folders:
        for f in sorted(folder.rglob("*")):
            if f.is_file() and not SKIP_PARTS & set(f.parts) and f.suffix not in {".pyc", ".so"}:
                tree[f"{folder.name}/{f.relative_to(folder).as_posix()}"] = f.read_bytes()
    return tree


def tree_key(tree: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(tree):
        h.update(f"{rel}\0{hashlib.sha256(tree[rel]).hexdigest()}\0".encode())
    return h.hexdigest()[:24]


def _relocated(value: Any, pairs: list[tuple[str, str]]) -> Any:
    """`value` with every path prefix `there` replaced by `home`, in keys and values."""
    if isinstance(value, str):
        for there, home in pairs:
            value = value.replace(there, home)
        return value
    if isinstance(value, dict):
        return {_relocated(k, pairs): _relocated(v, pairs) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, pairs) for v in value]
    return value


# -- worker side (inside a Dask worker) ----------------------------------------------------------
_tree_lock = threading.Lock()


def _gate_task(
    site: GateSite,
    key: str,
    tree: str,
    event: str,
    build_env: dict[str, str | None],
    threads: int | None,
) -> dict[str, Any]:
    from distributed import Event, Variable, get_worker

    began = Event(event)
    if began.is_set():  # a second start: the worker that ran it first died
        return {"retried": True}
    began.set()
    for name, value in build_env.items():  # the gate process inherits this process's environ
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    root = materialise(key, lambda: Variable(tree).get())
    site = replace(site, root=root, file=root / site.file)
    _compile(site, root)
    if threads is None:  # this worker is a machine of its own: its slots share its cores
        slots = int(get_worker().state.total_resources.get(SLOTS, 1))
        threads = runner.gate_threads(site.exclusive, slots)
    return {"root": str(root), "result": runner._run_one(site, threads=threads)}


def materialise(key: str, fetch: Callable[[], dict[str, bytes]]) -> Path:
    """The tree as files under the cache, fetched and written once (atomically) per machine."""
    trees = kcompile.cache_root() / TREE_DIR
    final = trees / key
    with _tree_lock:
        if not final.is_dir():
            trees.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=trees))
            for rel, data in fetch().items():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                (scratch / rel).write_bytes(data)
            try:
                os.rename(scratch, final)
            except OSError:  # another worker process on this machine wrote it first
                shutil.rmtree(scratch, ignore_errors=True)
            _prune(trees, keep=final)
        os.utime(final)
    return final


def _prune(trees: Path, keep: Path) -> None:
    cutoff = time.time() - TREE_MAX_AGE_S
    for old in trees.iterdir():
        if old != keep and not old.name.startswith(".") and old.stat().st_mtime < cutoff:
            shutil.rmtree(old, ignore_errors=True)


def _compile(site: GateSite, root: Path) -> None:
    """Compile the gate's kernels into this machine's cache, in a subprocess that imports the
    shipped tree. A failure is left for the gate's own process to report (compile-error)."""
    modules = list(site.kernels) if site.kernels is not None else _all_kernels(root)
    if not modules:
        return
    code = "import sys\nfrom k3gates.infra import compile as c\n"
    code += "for m in sys.argv[1:]:\n    c.ensure(m)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path[1:]])}
    env.pop(kcompile.NO_COMPILE_ENV, None)
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", code, *modules],
            cwd=root,
            env=env,
            capture_output=True,
            timeout=kcompile.COMPILE_TIMEOUT_S * len(modules),
        )


def _all_kernels(root: Path) -> list[str]:
    """Every kernels module in the tree (a gate that names its kernels only at run time)."""
    return kernel_modules([GatePackage(p) for p in sorted(root.iterdir()) if p.is_dir()])
