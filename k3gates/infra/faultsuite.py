"""The fault suite: rerun gates with corrupted kernels and record which checks catch each fault.

`python -m k3gates faults GATE|INNOVATION|all` runs, for every chosen gate, the gate once as it
is (it must pass, or its fault table means nothing) and then once per fault of `faults.FAULTS`,
each in its own process. The table it prints, and writes to `site_src/faults.json`, says for each
fault: `caught` with the checks that failed, `missed`, or `n/a` with the reason.

A record is tied to the code it ran on: `code` is the content key of every file the gate's process
loaded (`contentkey`), which a pure move of files leaves as it was. The build shows a gate's fault
table only while that key still matches the gate's current result, and says which commit it ran at.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import compile as kcompile
from . import runner
from .discover import GateSite
from .faults import FAULT_ENV, FAULTS
from .gate import STOP_AT_FIRST_FAILURE_ENV

SMALL_ENV = "K3GATES_SMALL"  # long gates may run a smaller shape of the same gate, same bounds
FAULTS_FILE = "faults.json"  # under site_src/, committed beside history.jsonl


def code_hash(result: dict[str, Any]) -> str:
    """The code key of a gate's result (`contentkey`): equal on any checkout of the same code,
    wherever its files live."""
    return result.get("code", "")


def classify(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """One faulted run -> {status: caught | missed | n/a, failed: [...], reason}.

    Only checks that pass without the fault count: a check already failing at baseline catches
    nothing."""
    stats = result.get("fault") or {}
    ok_before = {c["name"] for c in baseline.get("checks", []) if c["passed"]}
    failed = [
        c["name"] for c in result.get("checks", []) if not c["passed"] and c["name"] in ok_before
    ]
    if result.get("error") and not baseline.get("error"):
        failed.append(f"(gate {result['status']}: {str(result['error']).splitlines()[0][:160]})")
    if failed:
        return {"status": "caught", "failed": failed, "reason": "", **_counts(stats)}
    if stats and stats.get("changed", 0) == 0:
        why = (
            "no kernel output was changed by this fault"
            f" ({stats.get('outputs', 0)} integer outputs in {stats.get('calls', 0)} calls)"
        )
        return {"status": "n/a", "failed": [], "reason": why, **_counts(stats)}
    return {
        "status": "missed",
        "failed": [],
        "reason": "every check passed with corrupted kernel outputs",
        **_counts(stats),
    }


def _counts(stats: dict[str, Any]) -> dict[str, int]:
    return {k: int(stats.get(k, 0)) for k in ("calls", "outputs", "changed")}


def run_suite(
    sites: list[GateSite],
    *,
    jobs: int = 2,
    small: bool = False,
    first_failure: bool = False,
    baselines: dict[str, dict[str, Any]] | None = None,
    on_gate: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """{gate id: record} for every site; each record holds the baseline and every fault.

    With `first_failure`, a faulted run stops at its first failed check: enough to know the
    fault was caught, and much faster (the baseline always runs whole). `baselines` may hand in
    unfaulted results of the same code (a build's), which are then not run again."""
    env_small = {SMALL_ENV: "1"} if small else {}
    env_first = {STOP_AT_FIRST_FAILURE_ENV: "1"} if first_failure else {}
    given = baselines or {}
    work = [(s, None) for s in sites if s.id not in given]
    work += [(s, f) for s in sites for f in FAULTS]

    def one(item: tuple[GateSite, str | None]) -> tuple[str, str | None, dict[str, Any]]:
        site, fault = item
        env = {**env_small, **({FAULT_ENV: fault, **env_first} if fault else {})}
        return site.id, fault, runner._run_one(site, threads=1, env_extra=env)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(one, work))
    records: dict[str, dict[str, Any]] = {}
    for site in sites:
        mine = {f: r for gid, f, r in done if gid == site.id}
        base = mine.setdefault(None, given.get(site.id, {}))
        table = {f: classify(mine[f], base) for f in FAULTS}
        rec = {
            "gate": site.id,
            "code": code_hash(base),
            "baseline": base["status"],
            "small": bool(base.get("small")),
            "first_failure": first_failure,
            "faults": table,
            "caught": sum(t["status"] == "caught" for t in table.values()),
            "applicable": sum(t["status"] != "n/a" for t in table.values()),
            "seconds": round(sum(r.get("seconds", 0.0) for r in mine.values()), 1),
        }
        records[site.id] = rec
        if on_gate:
            on_gate(site.id, rec)
    return records


def provenance(root: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
            return out.stdout.strip() if out.returncode == 0 else ""
        except OSError:
            return ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "ran_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": kcompile.cpu_model(),
    }


def save(records: dict[str, dict[str, Any]], path: Path, prov: dict[str, Any]) -> None:
    """Merge these records into `path` (other gates' records stay), each with its provenance."""
    try:
        old = json.loads(path.read_text(encoding="utf-8")).get("gates", {})
    except (OSError, ValueError):
        old = {}
    old.update({gid: {**rec, **prov} for gid, rec in records.items()})
    body = {"schema": "k3-faults/1", "faults": FAULTS, "gates": dict(sorted(old.items()))}
    tmp = path.with_suffix(f".tmp{time.time_ns()}")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def load(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("gates", {})
    except (OSError, ValueError):
        return {}


def line(fault: str, entry: dict[str, Any]) -> str:
    what = ", ".join(entry["failed"][:6]) or entry["reason"]
    more = f" (+{len(entry['failed']) - 6})" if len(entry["failed"]) > 6 else ""
    return f"    {fault:<8} {entry['status']:<7} {what}{more}"
