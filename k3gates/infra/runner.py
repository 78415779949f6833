"""Run gates in subprocesses, in parallel, with timeouts; return their results as plain dicts.

Each gate runs in a fresh `python -m k3gates.infra.runner JOB` process. Whatever happens in there
(an exception, a hang past the timeout, a segfault, a kernel that did not compile, a kernel with a
float in it) becomes a *failed* result with its message. The build itself never fails because of a
gate.

A result is reused from the previous build only when the code it ran on is still here, by content
(`contentkey`): every project file the gate process loaded, its kernels' sources among them, has
its key in today's tree, the gate's own file keeps its key, its folder's data files are the same,
and so is the toolchain. A moved file is the same file. Results that did not reach a verdict
(timeout, crash, exception) are never reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from . import compile as kcompile
from . import contentkey, faults
from .discover import GateSite
from .nofloat import audit_file
from .registry import Level

RESULT_SCHEMA = 2  # 2: deps keyed by content, `code` and `data` added
REUSABLE = {"passed", "failed"}  # statuses that are a verdict on the inputs, not an accident


# -- parent side ---------------------------------------------------------------------------------
def _results_dir() -> Path:
    return kcompile.cache_root() / "results"


def _result_path(gate_id: str, root: Path) -> Path:
    """One slot per gate per checkout (not per file: a moved gate finds its result)."""
    where = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:10]
    return _results_dir() / f"{gate_id}-{where}.json"


def _reusable(site: GateSite) -> dict[str, Any] | None:
    path = _result_path(site.id, site.root)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if old.get("schema") != RESULT_SCHEMA or old.get("status") not in REUSABLE:
        return None
    if old.get("toolchain") != kcompile.toolchain():
        return None
    try:
        index = contentkey.module_index(site.root)
        here = {contentkey.file_key(f, index) for f in index.values()}
        if old.get("gate_key") != contentkey.file_key(site.file, index):
            return None
    except (OSError, SyntaxError, ValueError):
        return None
    if not set(old["deps"].values()) <= here:
        return None
    if old.get("data") != contentkey.data_files(site.file.resolve().parent):
        return None
    return old


def run_gates(
    sites: list[GateSite],
    *,
    jobs: int = 2,
    reuse: bool = True,
    only: set[str] | None = None,
    needed: Collection[str] = (),
    on_event: Callable[[str, GateSite, dict | None], None] | None = None,
    pool: GatePool | None = None,
) -> list[dict[str, Any]]:
    """Run (or reuse) every gate; results come back in the order of `sites`.

    With `only`, just those gates run; every other gate is reused when it can be, else run if it
    is `needed` (what the `only` gates build on), else reported as "skipped" (not run, so not
    passing). The caller applies `apply_requirements` once it has every result it will publish.
    `pool` says where gates run: this machine, `jobs` at a time, unless another pool (a Dask
    cluster, `k3gates.infra.cluster`) is given.
    """
    lock = threading.Lock()
    pool = pool or LocalPool(jobs)

    def started(site: GateSite) -> None:
        if on_event:
            with lock:
                on_event("start", site, None)

    def one(site: GateSite) -> dict[str, Any]:
        forced = only is not None and site.id in only
        old = _reusable(site) if reuse and not forced else None
        if old is not None:
            result = {**old, **placed(site), "ran": False, "reused_from": old["run_hash"]}
        elif only is not None and not forced and site.id not in needed:
            result = _failure(
                site, "skipped", "not run in this build (--only), and no result of it can be reused"
            )
            result.update(ran=False, seconds=0.0)
        else:
            result = pool.run(site, lambda: started(site))
            result["ran"] = True
            if result["status"] in REUSABLE:
                _store(result)
        if on_event:
            with lock:
                on_event("done", site, result)
        return result

    with ThreadPoolExecutor(max_workers=pool.width) as threads:
        return list(threads.map(one, sites))


class GatePool(Protocol):
    """Where gates run. `run` runs one gate to a result (a failure is a result too) and calls
    `started` when the gate actually starts; `width` is how many gates may be in flight."""

    width: int

    def run(self, site: GateSite, started: Callable[[], None]) -> dict[str, Any]: ...


class LocalPool:
    """The default pool: each gate a subprocess on this machine, `jobs` at a time."""

    def __init__(self, jobs: int) -> None:
        self.width = max(1, jobs)
        self.slots = _Slots(self.width)

    def run(self, site: GateSite, started: Callable[[], None]) -> dict[str, Any]:
        with self.slots.held(site.exclusive):
            started()
            return _run_one(site, threads=gate_threads(site.exclusive, self.width))


def gate_threads(exclusive: bool, slots: int) -> int:
    """OpenMP threads for a gate: every core for an exclusive gate, else its share of them."""
    cores = os.cpu_count() or 1
    return cores if exclusive else max(1, cores // max(1, slots))


class _Slots:
    """The runner's `jobs` slots. An exclusive gate (a training gate, whose fresh rerun takes the
    other cores) waits until nothing else runs and takes them all, so its wall time is its own,
    not a share of the machine; gates that arrive while it waits queue behind it."""

    def __init__(self, n: int) -> None:
        self.n, self.busy, self.waiting = n, 0, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def held(self, exclusive: bool) -> Iterator[None]:
        need = self.n if exclusive else 1
        with self.cond:
            self.waiting += int(exclusive)
            self.cond.wait_for(
                lambda: self.busy + need <= self.n and (exclusive or not self.waiting)
            )
            self.waiting -= int(exclusive)
            self.busy += need
        try:
            yield
        finally:
            with self.cond:
                self.busy -= need
                self.cond.notify_all()


def apply_requirements(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A gate fails when a gate it builds on fails, transitively, with a `requires:` check.

    What a gate builds on is (1) every gate it names in `requires=` (e.g. `longctx_1m` on the kda
    and mla gates whose kernels it runs), and (2) every foundations gate (innovation None, e.g.
    the fx math) whose kernels its own kernels import. So a broken exp can never hide behind an
    innovation gate whose tolerance happened to absorb it.
    """
    by_id = {r["id"]: r for r in results}
    needs = _needs(
        [(r["id"], r.get("innovation"), r.get("kernels"), r.get("requires")) for r in results]
    )
    own = {gid: bool(r["passed"]) for gid, r in by_id.items()}
    out = []
    for r in results:
        extra = []
        for dep, why in needs[r["id"]]:
            below = _reachable(needs, [dep]) - {r["id"]}
            ok = own.get(dep, False) and all(own.get(x, False) for x in below)
            if dep not in by_id or by_id[dep].get("status") == "skipped":
                reason = f"required gate {dep} did not run in this build"
            elif not by_id[dep]["passed"]:
                reason = f"required gate {dep} failed"
            else:
                reason = f"required gate {dep} passes, but a gate it requires failed"
            extra.append(_requires_check(dep, why, ok, "" if ok else reason))
        if extra:
            r = {**r, "checks": [*r.get("checks", []), *extra]}
            if r["passed"] and not all(c["passed"] for c in extra):
                r = {**r, "passed": False, "status": "failed"}
        out.append(r)
    return out


def requirements(gates: list[GateSite], only: tuple[str, ...]) -> tuple[str, ...]:
    """Every gate the `only` gates build on, transitively, by `apply_requirements`' rule, less
    the `only` gates: so `--only muon_ns5` can run the gemm_exact gate it stands on, rather than
    fail for lack of it."""
    needs = _needs([(g.id, g.innovation, g.kernels, g.requires) for g in gates])
    return tuple(sorted(_reachable(needs, only) - set(only)))


def _needs(
    gates: list[tuple[str, str | None, list[str] | tuple[str, ...] | None, Any]],
) -> dict[str, list[tuple[str, str]]]:
    """Per gate id (from (id, innovation, kernels, requires)): the gates it builds on, and why."""
    foundations = [(gid, set(k)) for gid, inn, k, _ in gates if inn is None and k]
    needs: dict[str, list[tuple[str, str]]] = {}
    for gid, _, kernels, requires in gates:
        try:
            deps = {d for m in kernels or [] for d in kcompile.dependencies(m)}
        except kcompile.CompileError:
            deps = set(kernels or [])
        mine = []
        for fid, fkernels in foundations:
            shared = sorted(deps & fkernels)
            if fid != gid and shared:
                mine.append((fid, f"proves the shared kernels {', '.join(shared)}"))
        for req in requires or []:
            mine.append((req, "proves the kernels this gate composes"))
        needs[gid] = mine
    return needs


def _reachable(needs: dict[str, list[tuple[str, str]]], start: Iterable[str]) -> set[str]:
    """Every gate the `start` gates build on, transitively (cycles among foundations are fine)."""
    seen: set[str] = set()
    todo = [d for s in start for d, _ in needs.get(s, [])]
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(x for x, _ in needs.get(d, []))
    return seen


def _requires_check(dep: str, why: str, ok: bool, message: str) -> dict[str, Any]:
    return {
        "name": f"requires:{dep}",
        "kind": "contract",
        "passed": ok,
        "proves": f"the gate {dep}, which {why}, passes (and so do the gates it requires)",
        "bound": None,
        "measured": None,
        "unit": "",
        "digests": {},
        "values": {},
        "seconds": 0.0,
        "message": message,
    }


def _store(result: dict[str, Any]) -> None:
    d = _results_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{result['id']}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, _result_path(result["id"], Path(result["root"])))


def _run_one(
    site: GateSite, *, threads: int, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    timeout = site.timeout
    with tempfile.TemporaryDirectory(prefix="k3gate-") as tmp:
        out = Path(tmp) / "result.json"
        job = Path(tmp) / "job.json"
        job.write_text(
            json.dumps(
                {"id": site.id, "module": site.module, "root": str(site.root), "out": str(out)}
            )
        )
        env = {
            **os.environ,
            kcompile.NO_COMPILE_ENV: "1",
            "OMP_NUM_THREADS": str(threads),
            # idle OpenMP threads sleep (as in fresh.py): a training gate shares the cores with
            # its own fresh rerun, and spinning threads starved it (vlm_training's integer step
            # took 0.68 s instead of 0.31 s beside its rerun); results do not depend on it
            "OMP_WAIT_POLICY": "passive",
            "PYTHONHASHSEED": "0",
            "PYTHONPATH": os.pathsep.join([str(site.root), *sys.path[1:]]),
            **(env_extra or {}),
        }
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3gates.infra.runner", str(job)],
            cwd=site.root,  # `-m` puts the cwd first on sys.path: the gate's own checkout
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
            status_note = None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status_note = ("timeout", f"did not finish within its {timeout:g} s timeout; killed")
        seconds = time.perf_counter() - start
        log = output.decode("utf-8", "replace")[-4000:]
        if status_note is None and out.is_file():
            result = {**_failure(site, "error", ""), **json.loads(out.read_text()), **placed(site)}
        elif status_note is None:
            code = proc.returncode
            why = (
                f"killed by signal {signal.Signals(-code).name}"
                if code < 0
                else f"exited with status {code} before writing a result"
            )
            result = _failure(site, "crashed", why, log)
        else:
            result = _failure(site, *status_note, log)
    result["seconds"] = round(seconds, 3)
    result["log"] = log
    return result


def placed(site: GateSite) -> dict[str, Any]:
    """What the static site is the authority on: a gate's id, innovation, level, place and
    docstring (a reused result may have run from another file, or before a docstring changed)."""
    from .gate import first_sentence

    return {
        "id": site.id,
        "innovation": site.innovation,
        "level": site.level.name,
        "root": str(site.root),
        "file": str(site.file),
        "line": site.line,
        "title": first_sentence(site.doc) or site.id,
        "doc": site.doc,
    }


def _failure(site: GateSite, status: str, message: str, log: str = "") -> dict[str, Any]:
    return {
        "schema": RESULT_SCHEMA,
        **placed(site),
        "status": status,
        "passed": False,
        "error": message,
        "checks": [],
        "summary": "",
        "artifacts": {},
        "deps": {},
        "data": {},
        "code": "",
        "gate_key": "",
        "kernel_keys": {},
        "bounds": {},
        "kernels": list(site.kernels),
        "requires": list(site.requires),
        "toolchain": kcompile.toolchain(),
        "run_hash": "",
        "log": log,
    }


# -- worker side (runs inside the gate's own process) --------------------------------------------
def _worker(job: dict[str, Any]) -> dict[str, Any]:
    from .gate import REGISTRY, Check, FirstFailure, GateContext

    root = Path(job["root"])
    try:
        importlib.import_module(job["module"])
        spec = REGISTRY[job["id"]]
    except Exception as e:
        return _worker_error(job, root, e, "error")
    ctx = GateContext(spec)
    status, error = "passed", None
    kernel_keys: dict[str, str] = {}
    for modname in spec.kernels:
        try:
            kernel_keys[modname] = kcompile.module_key(modname)
            deps = kcompile.dependencies(modname)
        except kcompile.CompileError as e:
            status, error = "compile-error", str(e)
            break
        findings = [str(f) for p in deps.values() for f in audit_file(p)]
        ctx.checks.append(
            Check(
                f"nofloat:{modname}",
                "nofloat",
                f"`{modname}` and the kernels it imports contain no float literal, `/`, "
                "float dtype "
                "or float-returning call",
                not findings,
                values={"files": [str(p) for p in deps.values()], "findings": findings},
                message="; ".join(findings[:5]),
            )
        )
        try:
            kcompile.load(modname)
        except Exception as e:
            status, error = "compile-error", f"kernel {modname} is unusable: {e}"
            break
    if status == "passed":
        try:
            spec.func(ctx)
            ctx.finish()
        except FirstFailure:
            pass  # a fault-suite run asked to stop at the first failed check
        except Exception as e:
            status, error = "error", _short_traceback(e)
    ctx.checks.extend(_contract_checks(spec, ctx.checks, status))
    passed = status == "passed" and all(c.passed for c in ctx.checks)
    if status == "passed" and not passed:
        status = "failed"
    return {
        "schema": RESULT_SCHEMA,
        "id": spec.id,
        "innovation": spec.innovation,
        "level": spec.level.name,
        "title": spec.title,
        "doc": spec.doc,
        "status": status,
        "passed": passed,
        "error": error,
        "checks": [c.to_json() for c in ctx.checks],
        "summary": ctx.summary,
        "artifacts": ctx.artifacts,
        "bounds": spec.bounds,
        "kernels": list(spec.kernels),
        "requires": list(spec.requires),
        "fault": {"name": faults.active(), **faults.STATS} if faults.active() else None,
        "small": ctx.used_small,
        "kernel_keys": kernel_keys,
        **_code(root, Path(spec.file)),
        "toolchain": kcompile.toolchain(),
        "run_hash": _run_hash(spec.id, kernel_keys),
    }


def _contract_checks(spec: Any, checks: list, status: str) -> list:
    from .gate import CONTRACT_KINDS, Check

    if status != "passed":
        return []
    if not checks:
        return [
            Check(
                "contract",
                "contract",
                "the gate recorded at least one check",
                False,
                message="the gate recorded no checks",
            )
        ]
    if spec.level < Level.HAVE:
        return []
    missing = [k for k in CONTRACT_KINDS if not any(c.kind == k for c in checks)]
    return [
        Check(
            "contract",
            "contract",
            "a gate at HAVE or above contains the contract's five kinds of check: "
            + ", ".join(CONTRACT_KINDS),
            not missing,
            message=f"missing: {', '.join(missing)}" if missing else "",
        )
    ]


def _code(root: Path, gate_file: Path) -> dict[str, Any]:
    """The content keys of what this process loaded: every project file it imported and the
    sources of every kernel it loaded ("deps", path -> key), the data files of the gate's folder
    ("data": a corpus or a checkpoint invalidates a result like code does), the gate file's own
    key, and the code key of them all."""
    root = root.resolve()
    index = contentkey.module_index(root)
    files = {gate_file.resolve()}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and f.endswith(".py") and Path(f).resolve().is_relative_to(root):
            files.add(Path(f).resolve())
    for modname in kcompile.loaded_modules():
        with contextlib.suppress(kcompile.CompileError):
            files |= {p.resolve() for p in kcompile.dependencies(modname).values()}
    deps = {str(f): contentkey.file_key(f, index) for f in sorted(files) if f.is_relative_to(root)}
    data = contentkey.data_files(gate_file.resolve().parent)
    return {
        "deps": deps,
        "data": data,
        "gate_key": contentkey.file_key(gate_file, index),
        "code": contentkey.code_key(deps.values(), data),
    }


def _run_hash(gate_id: str, kernel_keys: dict[str, str]) -> str:
    h = hashlib.sha256(gate_id.encode())
    h.update(json.dumps(kernel_keys, sort_keys=True).encode())
    h.update(str(time.time_ns()).encode())
    return h.hexdigest()[:12]


def _short_traceback(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e))[-3000:]


def _worker_error(job: dict[str, Any], root: Path, e: BaseException, status: str) -> dict:
    return {
        "schema": RESULT_SCHEMA,
        "id": job["id"],
        "status": status,
        "passed": False,
        "error": _short_traceback(e),
        "checks": [],
        "summary": "",
        "artifacts": {},
        "deps": {},
        "kernel_keys": {},
        "bounds": {},
        "kernels": [],
        "run_hash": "",
        "toolchain": kcompile.toolchain(),
    }


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    result = _worker(job)
    Path(job["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
