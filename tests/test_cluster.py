"""The Dask runner (issue 19, item 3): gates sent to a Dask cluster give the local runner's results,
digests included, and a hung, crashed or lost gate is a failed gate with its reason, never a pass.

Every cluster here is a LocalCluster on this machine (tests never reach the network). Those of two
worker processes (conftest.two_worker_cluster) are used through the scheduler's address, as
`--runner tcp://…` would use a remote one; the others are the one `--runner dask` starts. A
representative subset of real gates runs on both runners in every test run; the whole default set
on Dask is a recorded run (`python build.py --runner dask --rerun --record`), held against the local
runner's records of the same code. The session build (local) is held against every recorded run
of the same code, on whatever CPU it was made."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import FIXTURE_GATES, ROOT, build_module, run_build, two_worker_cluster

from k3gates.infra import cluster, runner
from k3gates.infra import compile as kcompile
from k3gates.infra.discover import GatePackage, discover_gates
from k3gates.infra.faultsuite import code_hash

TIMED = re.compile(r"(_s|seconds|speed_ratio)$")
CLUSTER_GATES = ROOT / "tests" / "fixtures" / "cluster_gates"
ARMED_ENV = "K3_TEST_KILL_DASK_WORKER"
# fast real gates with compiled kernels and digested checks, and every kind of broken gate
REAL = ["mxfp_quantize", "k3block_schedule", "attnres_grad"]
# the environment a gate process sees: the Nanny's OPENBLAS_NUM_THREADS=1 must not leak into it
ENV = ["fixture_env"]
BROKEN = [
    "fixture_raises",
    "fixture_hangs",
    "fixture_kills",
    "fixture_badcompile",
    "fixture_floaty",
]


@pytest.fixture(scope="module")
def env(session_cache: Path):
    """The session's cache for this process and for every Dask worker it starts (they inherit
    the environment), and the fixture packages importable here, as build.py arranges."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3GATES_CACHE", str(session_cache))
        mp.delenv(ARMED_ENV, raising=False)
        mp.syspath_prepend(str(FIXTURE_GATES.parent))
        mp.syspath_prepend(str(CLUSTER_GATES.parent))
        yield mp


def _sites(ids: list[str]) -> list:
    packages = [GatePackage(ROOT / "k3gates"), GatePackage(FIXTURE_GATES)]
    packages.append(GatePackage(CLUSTER_GATES))
    by_id = {s.id: s for s in discover_gates(packages)}
    return [by_id[i] for i in ids]


@pytest.fixture(scope="module")
def both(env) -> tuple[dict, dict]:
    """The same gates on the local runner and on a 2-worker cluster, nothing reused."""
    sites = _sites(REAL + BROKEN + ENV)
    for m in sorted({m for s in sites for m in s.kernels}):
        kcompile.ensure(m)  # what build.py's compile step does before the local runner
    local = runner.run_gates(sites, jobs=2, reuse=False)
    with (
        two_worker_cluster() as lc,
        cluster.DaskPool(
            lc.scheduler_address, jobs=2, packages=[FIXTURE_GATES, CLUSTER_GATES]
        ) as pool,
    ):
        assert (pool.width, pool.exclusive_slots) == (2, 1)
        assert pool.one_machine  # two workers on this machine share its cores
        on_dask = runner.run_gates(sites, jobs=2, reuse=False, pool=pool)
    return {r["id"]: r for r in local}, {r["id"]: r for r in on_dask}


def _verdict(r: dict) -> dict:
    """Everything a result says about the code, apart from when and how long it ran."""
    checks = [
        (c["name"], c["kind"], c["passed"], c["bound"], c["measured"], c["digests"], _untimed(c))
        for c in r["checks"]
    ]
    keep = ("status", "passed", "file", "line", "kernel_keys", "deps", "toolchain", "artifacts")
    error = (r.get("error") or "").splitlines()[:1]
    return {**{k: r.get(k) for k in keep}, "checks": checks, "error": error}


def _untimed(check: dict) -> dict:
    """A check's values without its wall-clock measurements (compiled_s, speed_ratio, ...)."""
    return {k: v for k, v in check["values"].items() if not TIMED.search(k)}


@pytest.mark.parametrize("gate_id", REAL + BROKEN + ENV)
def test_a_gate_on_dask_gives_the_local_runners_result(both, gate_id):
    local, on_dask = both
    mine, theirs = _verdict(on_dask[gate_id]), _verdict(local[gate_id])
    for a, b in zip(mine.pop("checks"), theirs.pop("checks"), strict=True):
        assert a == b
    assert mine == theirs
    assert code_hash(on_dask[gate_id]) == code_hash(local[gate_id])


def test_the_comparison_can_fail(both):
    """The real gates pass and digest their checks, so a changed digest would show above."""
    local, on_dask = both
    for gate_id in REAL:
        assert on_dask[gate_id]["passed"]
        assert any(c["digests"] for c in on_dask[gate_id]["checks"])
        changed = {**on_dask[gate_id], "checks": [dict(c) for c in on_dask[gate_id]["checks"]]}
        digested = next(c for c in changed["checks"] if c["digests"])
        digested["digests"] = {k: "0" * len(v) for k, v in digested["digests"].items()}
        assert _verdict(changed) != _verdict(local[gate_id])


def test_broken_gates_fail_on_dask_with_the_local_reasons(both):
    _, on_dask = both
    assert on_dask["fixture_hangs"]["status"] == "timeout"
    assert "did not finish within its 3 s timeout" in on_dask["fixture_hangs"]["error"]
    assert on_dask["fixture_kills"]["status"] == "crashed"
    assert "SIGKILL" in on_dask["fixture_kills"]["error"]
    assert on_dask["fixture_badcompile"]["status"] == "compile-error"
    assert not any(on_dask[g]["passed"] for g in BROKEN)


def test_no_worker_path_leaks_into_a_result(both):
    """The worker ran a copy of this checkout under the cache; results name this checkout."""
    _, on_dask = both
    trees = str(kcompile.cache_root() / cluster.TREE_DIR)
    for r in on_dask.values():
        assert trees not in repr({k: v for k, v in r.items() if k != "log"})
    assert all(Path(f).is_file() for r in on_dask.values() for f in r["deps"])


def _armed(env) -> None:
    env.setenv(ARMED_ENV, "1")  # before the cluster starts, so its workers inherit it


@pytest.fixture(autouse=True)
def _no_litter():
    """A killed worker cannot remove its gate's scratch folder; the test does it."""
    yield
    for job in Path(tempfile.gettempdir()).glob("k3gate-*/job.json"):
        if '"fixture_worker_dies"' in job.read_text():
            shutil.rmtree(job.parent, ignore_errors=True)


def test_a_worker_that_dies_mid_gate_fails_the_gate(env):
    """--runner dask: its scheduler allows no retry, so the lost worker is a crashed gate."""
    _armed(env)
    try:
        with cluster.DaskPool("dask", jobs=2, packages=[CLUSTER_GATES]) as pool:
            assert (pool.width, pool.exclusive_slots) == (2, 2)  # one worker, every core
            (r,) = runner.run_gates(_sites(["fixture_worker_dies"]), reuse=False, pool=pool)
    finally:
        env.delenv(ARMED_ENV)
    assert r["status"] == "crashed" and not r["passed"]
    assert "its Dask worker died while running it (KilledWorker" in r["error"]


def test_a_scheduler_that_retries_does_not_turn_a_lost_gate_into_a_pass(env):
    """--runner tcp://…: an existing scheduler (default config) retries the task on a fresh
    worker; the task sees it already started, and the gate fails. The cluster still runs the
    next gate."""
    _armed(env)
    try:
        with two_worker_cluster() as lc:
            assert lc.scheduler.allowed_failures > 0  # it would retry
            with cluster.DaskPool(lc.scheduler_address, jobs=2, packages=[CLUSTER_GATES]) as pool:
                (dies,) = runner.run_gates(_sites(["fixture_worker_dies"]), reuse=False, pool=pool)
                (after,) = runner.run_gates(_sites(["mxfp_decode"]), reuse=False, pool=pool)
    finally:
        env.delenv(ARMED_ENV)
    assert dies["status"] == "crashed" and not dies["passed"]
    assert "started it again on another worker" in dies["error"]
    assert after["passed"], after.get("error")


def test_the_build_takes_the_runner_and_names_an_unreachable_scheduler(tmp_path, session_cache):
    out = tmp_path / "public"
    ok = run_build(out, "--runner", "dask", "--only", "mxfp_decode", "--rerun", cache=session_cache)
    assert ok.returncode == 0, ok.stderr
    row = next(g for g in ok.census["gates"] if g["id"] == "mxfp_decode")
    assert row["passed"] and row["ran"]
    before = os.readlink(out)
    bad = run_build(
        out, "--runner", "tcp://127.0.0.1:9", "--only", "mxfp_decode", cache=session_cache
    )
    assert bad.returncode == 1
    assert "--runner tcp://127.0.0.1:9: cannot reach the Dask scheduler" in bad.stderr
    assert os.readlink(out) == before  # the published site is left as it was


# --- the whole default gate set, as recorded ---------------------------------------------------
# The session build runs on the local runner (conftest.built_site); the whole default set on Dask
# takes twice as long on two cores, so it is a recorded run, tied to the code like the fault
# records: `python build.py --runner dask --rerun --record` appends each gate's result with
# runner = "dask" to site_src/digests.jsonl, beside the local runner's records.


def runner_records(runner_name: str) -> dict[tuple[str, str], dict]:
    """(gate id, code hash) -> the newest record of that gate's result made by `runner_name`,
    from site_src/digests.jsonl (`python build.py --record` appends one per commit and CPU)."""
    out = {}
    path = ROOT / "site_src" / "digests.jsonl"
    for rec in build_module().load_jsonl(path, {"commit", "cpu", "gates"}):
        for gate_id, entry in rec["gates"].items():
            if entry.get("runner") == runner_name:
                out[(gate_id, entry["code"])] = entry
    return out


def differences(
    theirs: dict[tuple[str, str], dict], records: dict[tuple[str, str], dict]
) -> tuple[int, list[str]]:
    """(how many (gate, code) pairs both sides hold, every way they differ there): another
    status, or a check whose digests differ."""
    out, compared = [], 0
    for key, entry in sorted(theirs.items()):
        rec = records.get(key)
        if rec is None:
            continue
        compared += 1
        gate_id = key[0]
        if entry["status"] != rec["status"]:
            out.append(f"{gate_id}: {entry['status']} on dask, {rec['status']} on the local runner")
        if entry["checks"] != rec["checks"]:
            mine = entry["checks"]
            differ = sorted(
                n for n in set(mine) | set(rec["checks"]) if mine.get(n) != rec["checks"].get(n)
            )
            out.append(f"{gate_id}: digests differ in {', '.join(differ)}")
    return compared, out


def test_every_recorded_dask_run_equals_the_local_runner():
    """Each gate recorded on Dask equals the local runner's record of the same code, status and
    every check's digests. A gate whose code has no Dask record is not comparable (listed)."""
    on_dask, local = runner_records("dask"), runner_records("local")
    compared, found = differences(on_dask, local)
    if not on_dask:
        pytest.skip("no Dask run is recorded: `python build.py --runner dask --rerun --record`")
    assert compared >= 1
    assert found == []


def test_the_recorded_comparison_can_fail():
    """One changed digest and one changed status are each reported; an unrecorded code is not
    compared at all."""
    local = runner_records("local")
    (a, ea), (b, eb), (c, ec) = [(k, v) for k, v in sorted(local.items()) if v["checks"]][:3]
    name = next(iter(ea["checks"]))
    fake = {
        a: {**ea, "checks": {**ea["checks"], name: {"x": "0" * 16}}},
        b: {**eb, "status": "failed" if eb["status"] == "passed" else "passed"},
        (c[0], "0" * 16): ec,
    }
    compared, found = differences(fake, local)
    assert compared == 2
    assert [d.split(":")[0] for d in found] == [a[0], b[0]]
    assert "digests differ in " + name in found[0]


def test_the_session_build_ran_on_the_local_runner(built_site):
    """What the suite's build compares elsewhere is the local runner's result (a K3_TEST_CACHE
    kept from a Dask run would make it another's)."""
    gates = built_site.census["gates"]
    assert len(gates) >= 50
    assert {g["runner"] for g in gates} == {"local"}


def test_the_session_build_equals_every_record_of_its_code(built_site):
    """Every gate's status and check digests equal each local-runner record of the same code,
    whichever CPU made it: the kernels' promise of the same bits everywhere (issue 47 found
    longctx_rope breaking it on an AVX2 machine, through a float table made on the host)."""
    path = ROOT / "site_src" / "digests.jsonl"
    records = [r for r in build_module().load_jsonl(path, {"commit", "cpu", "gates"})]
    missing, found, compared = [], [], 0
    for g in built_site.census["gates"]:
        mine = {c["name"]: c["digests"] for c in g["checks"] if c["digests"]}
        same_code = [
            (r, r["gates"][g["id"]]) for r in records
            if r["gates"].get(g["id"], {}).get("code") == g["code"]
            and r["gates"][g["id"]].get("runner") == "local"
        ]  # fmt: skip
        if not same_code:
            missing.append(f"{g['id']}: no local-runner record of code {g['code']}")
        for rec, entry in same_code:
            compared += 1
            if entry["status"] != g["status"] or entry["checks"] != mine:
                differ = sorted(n for n in set(mine) | set(entry["checks"])
                                if mine.get(n) != entry["checks"].get(n))  # fmt: skip
                found.append(f"{g['id']} vs {rec['commit'][:12]} on {rec['cpu']}: {differ}")
    assert not missing, (
        "the local runner's results for this code are not recorded: on a clean commit run "
        "`python build.py --record`, then commit site_src/digests.jsonl\n" + "\n".join(missing)
    )
    assert found == []
    assert compared >= 50
