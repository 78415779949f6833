"""`python -m k3gates mcp` (issue 18, item 1): the two tools against census.json, in-process and
over stdio, and the tool errors for a missing build and an unknown gate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
from conftest import ROOT, BuildRun
from mcp import Client, StdioServerParameters

from k3gates.infra import mcp_server


def _call(server: Any, tool: str, args: dict[str, Any]) -> Any:
    async def go() -> Any:
        async with Client(server) as client:
            return await client.call_tool(tool, args)

    return anyio.run(go)


def test_both_tools_return_what_census_json_says(built_site: BuildRun):
    census = built_site.census
    server = mcp_server.server(built_site.out)
    result = _call(server, "nx_k3_arch_census", {})
    assert not result.is_error
    got = result.structured_content
    assert got["permille"] == census["permille"] and got["arithmetic"] == census["arithmetic"]
    assert got["provenance"]["git_commit"] == census["provenance"]["git_commit"]
    assert got["provenance"]["cpu"] == census["provenance"]["cpu"]
    assert list(got["innovations"]) == [r["id"] for r in census["innovations"]]
    for row in census["innovations"]:
        mine = got["innovations"][row["id"]]
        for key in ("level", "claim", "killed", "kill_reason", "evidence", "next", "gates"):
            assert mine[key] == row[key], (row["id"], key)
        assert (mine["gates_passed"], mine["checks_total"]) == (
            row["gates_passed"],
            row["checks_total"],
        )
    gate = census["gates"][0]
    detail = _call(server, "nx_k3_gate", {"gate_id": gate["id"]}).structured_content
    assert detail["id"] == gate["id"] and detail["passed"] == gate["passed"]
    assert [c["name"] for c in detail["checks"]] == [c["name"] for c in gate["checks"]]
    for mine, theirs in zip(detail["checks"], gate["checks"], strict=True):
        for key in ("kind", "bound", "measured", "digests", "passed"):
            assert mine[key] == theirs.get(key), (gate["id"], mine["name"], key)
    assert detail["faults"]["caught"] == gate["faults_caught"]


def test_the_census_tool_over_stdio(built_site: BuildRun):
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "k3gates", "mcp", "--root", str(built_site.out)],
        cwd=str(ROOT),
    )
    result = _call(params, "nx_k3_arch_census", {})
    assert not result.is_error
    assert result.structured_content["permille"] == built_site.census["permille"]
    text = json.loads(result.content[0].text)  # the same content as text, for plain clients
    assert text["permille"] == built_site.census["permille"]


def test_a_missing_build_and_an_unknown_gate_are_tool_errors_that_name_the_fix(tmp_path: Path):
    missing = _call(mcp_server.server(tmp_path / "nowhere"), "nx_k3_arch_census", {})
    assert missing.is_error
    assert "python build.py" in missing.content[0].text
    (tmp_path / "census.json").write_text(json.dumps({"gates": [{"id": "kda_mqar"}]}))
    unknown = _call(mcp_server.server(tmp_path), "nx_k3_gate", {"gate_id": "kda_nope"})
    assert unknown.is_error
    assert "kda_nope" in unknown.content[0].text
    assert "nx_k3_arch_census" in unknown.content[0].text and "kda_mqar" in unknown.content[0].text
