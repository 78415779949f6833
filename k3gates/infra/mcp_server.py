"""`python -m k3gates mcp`: the census of the last published build, over MCP (stdio).

Two tools, both read from `census.json` in the published folder (`public/`, or `--root DIR`);
nothing here compiles or runs a gate:

- `nx_k3_arch_census()`: per innovation its level, claim, liar-kill and reason, gates and checks
  passed, evidence and next step; the permille with its arithmetic; the build's provenance.
- `nx_k3_gate(gate_id)`: one gate with every check (kind, bound, measured, digests and the
  discrimination fields) and its fault-suite record.

A missing build or an unknown gate id is a tool error that says what to run or to ask, never a
traceback. Register it with an MCP client (README, "Query it over MCP").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from . import published

ROW_FIELDS = ("level", "claim", "killed", "kill_reason", "gates_passed", "gates_total",
              "checks_passed", "checks_total", "evidence", "next")  # fmt: skip
CHECK_FIELDS = ("name", "kind", "proves", "passed", "bound", "measured", "unit", "digests",
                "message", "reference_rms", "bound_over_rms", "zero_output_fails", "worst_case",
                "tight")  # fmt: skip
PROVENANCE_FIELDS = ("git_commit", "git_dirty", "built_at", "cpu", "cpu_vector", "flags")


def read_census(root: Path) -> dict[str, Any]:
    """The census.json under `root`, or a ToolError that says how to make one."""
    try:
        return published.read_census(root)
    except published.NoCensus as e:
        raise ToolError(str(e)) from None


def census_summary(census: dict[str, Any]) -> dict[str, Any]:
    """What `nx_k3_arch_census` returns: the census table without the gates' detail."""
    return {
        "innovations": {
            r["id"]: {
                "title": r["title"],
                "gates": list(r["gates"]),
                **{k: r[k] for k in ROW_FIELDS},
            }
            for r in census["innovations"]
        },
        "permille": census["permille"],
        "arithmetic": census["arithmetic"],
        "provenance": {k: census["provenance"].get(k) for k in PROVENANCE_FIELDS},
    }


def gate_detail(census: dict[str, Any], gate_id: str) -> dict[str, Any]:
    """What `nx_k3_gate` returns: one gate with every check and its fault record."""
    gates = {g["id"]: g for g in census["gates"]}
    if gate_id not in gates:
        raise ToolError(
            f"no gate {gate_id!r} in this build; nx_k3_arch_census lists each innovation's "
            f"gates, and these exist: {', '.join(sorted(gates))}"
        )
    g = gates[gate_id]
    return {
        "id": g["id"],
        "innovation": g["innovation"],
        "level": g["level"],
        "status": g["status"],
        "passed": g["passed"],
        "error": g["error"],
        "title": g["title"],
        "file": g["file"],
        "seconds": g["seconds"],
        "bounds": g["bounds"],
        "checks": [{k: c.get(k) for k in CHECK_FIELDS} for c in g["checks"]],
        "faults": {
            "caught": g["faults_caught"],
            "applicable": g["faults_applicable"],
            "record": g["faults"],
            "stale": g["faults_stale"] is not None,
        },
    }


def server(root: Path = published.DEFAULT_SITE) -> MCPServer:
    """The MCP server over the published build in `root`."""
    app = MCPServer(
        name="k3-sovereign-coverage",
        instructions="The K3 sovereign coverage census: integer gates behind each of ten K3 "
        "innovations. Call nx_k3_arch_census first, then nx_k3_gate for one gate's checks.",
    )

    @app.tool(name="nx_k3_arch_census")
    def nx_k3_arch_census() -> dict[str, Any]:
        """The census of the last published build: per innovation its level (GAP..PROVEN),
        claim, liar-kill and reason, gates and checks passed, evidence and next step; the
        permille with its arithmetic; provenance (commit, build time, CPU)."""
        return census_summary(read_census(root))

    @app.tool(name="nx_k3_gate")
    def nx_k3_gate(gate_id: str) -> dict[str, Any]:
        """One gate of the last published build, with every check: kind, bound, measured,
        digests, discrimination fields, and its fault-suite record."""
        return gate_detail(read_census(root), gate_id)

    return app
