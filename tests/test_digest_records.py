"""Issue 13 item 6: --record keeps every check's digests with the CPU; gate pages compare."""

from __future__ import annotations

import json

import pytest
from conftest import build_module


@pytest.fixture(scope="module")
def build():
    return build_module()


def result(digest_a: str) -> dict:
    return {
        "checks": [
            {"name": "threads", "digests": {"1": digest_a, "2": digest_a}},
            {"name": "reference", "digests": {}},
        ]
    }


def record(cpu: str, vector: str, digest_a: str, code: str = "c1") -> dict:
    return {
        "commit": "abc123",
        "cpu": cpu,
        "vector": vector,
        "gates": {"g": {"code": code, "checks": {"threads": {"1": digest_a, "2": digest_a}}}},
    }


PROV = {"cpu": "AMD EPYC", "cpu_vector": "avx2 fma"}


def test_a_run_on_another_cpu_is_compared_check_by_check(build):
    g = {"id": "g", "code": "c1"}
    same_bits = record("Intel Xeon", "avx2 fma avx512f avx512_vnni", "d1")
    other_bits = record("Intel Xeon", "avx2 fma avx512f", "d2")
    other_code = record("Intel Xeon", "avx512f", "d9", code="c0")
    out = build.compare_digests(g, result("d1"), [same_bits, other_bits, other_code], PROV)
    assert len(out) == 2  # a record of other code is not comparable
    assert out[0]["identical"] and out[0]["compared"] == 1 and not out[0]["same_cpu"]
    assert not out[1]["identical"] and out[1]["differ"] == ["threads"]


def test_a_record_with_nothing_in_common_is_not_comparable(build):
    """A record whose gate has no digested check that this build also has (compared 0) is not
    comparable: neither identical nor different (issue 47, item 3)."""
    g = {"id": "g", "code": "c1"}
    rec = record("Intel Xeon", "avx2 fma avx512f", "d1")
    rec["gates"]["g"]["checks"] = {"compiled": {"compiled": "d1", "interpreted": "d1"}}
    (o,) = build.compare_digests(g, result("d1"), [rec], PROV)
    assert (o["compared"], o["comparable"], o["identical"], o["differ"]) == (0, False, False, [])
    (o,) = build.compare_digests(g, result("d1"), [record("Intel Xeon", "avx2", "d1")], PROV)
    assert (o["comparable"], o["identical"]) == (True, True)
    (o,) = build.compare_digests(g, result("d2"), [record("Intel Xeon", "avx2", "d1")], PROV)
    assert (o["comparable"], o["identical"], o["differ"]) == (True, False, ["threads"])


def test_record_digests_appends_one_line_per_commit_and_cpu(build, tmp_path):
    census = {
        "provenance": {
            "git_commit": "abc123",
            "built_at": "2026-12-03T00:00:00Z",
            "cpu": "AMD EPYC",
            "cpu_vector": "avx2 fma",
        },
        "gates": [{"id": "g", "code": "c1", "status": "passed", "runner": "local"}],
    }
    path = tmp_path / "digests.jsonl"
    build.record_digests(census, [result("d1")], path)
    build.record_digests(census, [result("d1")], path)  # the same commit and CPU: once
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["cpu"] == "AMD EPYC" and rec["vector"] == "avx2 fma"
    assert rec["gates"]["g"] == {
        "code": "c1",
        "checks": {"threads": {"1": "d1", "2": "d1"}},
        "status": "passed",
        "runner": "local",
    }
    # the same commit and CPU built on Dask is a record of its own (test_cluster compares them)
    census["gates"][0]["runner"] = "dask"
    build.record_digests(census, [result("d1")], path)
    build.record_digests(census, [result("d1")], path)
    runners = [json.loads(line)["gates"]["g"]["runner"] for line in path.read_text().splitlines()]
    assert runners == ["local", "dask"]
