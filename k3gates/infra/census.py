"""The census: levels from gate results, liar-kill, and the permille. Pure functions, no I/O.

Rules (DESIGN.md, "The level ladder and the census"):
- An innovation's level is the highest L such that every level from PARTIAL to L has at least
  one gate of its own, and every gate at levels <= L passes. A missing or failing rung caps
  everything above it: a lone PROVEN gate earns nothing.
- A claim above the proven level is liar-killed: shown struck through, with the reason, and the
  census uses the proven level.
- permille = floor(1000 * sum(scores) / (4 * number of canonical innovations)).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .registry import INNOVATIONS, Level


@dataclass(frozen=True)
class GateOutcome:
    """What the census needs to know of one gate result."""

    id: str
    level: Level
    passed: bool
    checks_passed: int = 0
    checks_total: int = 0
    summary: str = ""
    failure: str = ""  # the first reason it failed, when it did

    @classmethod
    def from_result(cls, r: Mapping[str, Any]) -> GateOutcome:
        checks = r.get("checks", [])
        failed = [c for c in checks if not c["passed"]]
        if r.get("error"):
            failure = str(r["error"]).splitlines()[0]
        elif failed:
            c = failed[0]
            failure = f"check {c['name']}: {c.get('message') or 'failed'}"
        else:
            failure = "" if r["passed"] else f"status {r.get('status')}"
        return cls(
            r["id"],
            Level[r["level"]],
            bool(r["passed"]),
            sum(1 for c in checks if c["passed"]),
            len(checks),
            r.get("summary", ""),
            failure,
        )


def innovation_level(gates: Iterable[GateOutcome]) -> Level:
    """Climb the ladder rung by rung; stop at the first rung with no gate or a failing one."""
    gates = list(gates)
    best = Level.GAP
    for level in list(Level)[1:]:
        rung = [g for g in gates if g.level == level]
        if not rung or not all(g.passed for g in rung):
            break
        best = level
    return best


def blocker(gates: Iterable[GateOutcome], proven: Level) -> str:
    """Why the level is not one higher: a failing gate, or a missing one."""
    if proven == Level.PROVEN:
        return ""
    target = Level(proven + 1)
    gates = list(gates)
    failing = [g for g in gates if g.level <= target and not g.passed]
    if failing:
        g = min(failing, key=lambda g: g.level)
        return f"gate {g.id} ({g.level.name}) fails: {g.failure}"
    higher = [g for g in gates if g.level > target]
    if higher:
        above = ", ".join(sorted({g.level.name for g in higher}, key=lambda n: Level[n]))
        return f"no {target.name} gate exists, so the {above} gates above it cannot count"
    return f"no {target.name} gate exists"


@dataclass(frozen=True)
class Verdict:
    claim: Level
    proven: Level
    killed: bool  # the claim asserts more than the gates prove
    reason: str


def liar_kill(claim: Level, proven: Level, why_not_higher: str) -> Verdict:
    if claim <= proven:
        return Verdict(claim, proven, False, "")
    reason = f"claimed {claim.name}, but the gates prove {proven.name}: {why_not_higher}"
    return Verdict(claim, proven, True, reason)


def permille(scores: Iterable[int], n_innovations: int = len(INNOVATIONS)) -> int:
    return (1000 * sum(scores)) // (4 * n_innovations)


def census(results: list[Mapping[str, Any]], claims: Mapping[str, Level]) -> dict[str, Any]:
    """The census rows for every canonical innovation, in registry order.

    `results` are gate result dicts (runner.py); `claims` maps canonical id -> claimed level.
    Gates whose innovation is None (the foundations) count toward no row.
    """
    rows = []
    for inno in INNOVATIONS.values():
        mine = [GateOutcome.from_result(r) for r in results if r.get("innovation") == inno.id]
        proven = innovation_level(mine)
        why = blocker(mine, proven)
        verdict = liar_kill(claims.get(inno.id, Level.GAP), proven, why)
        at_level = [g for g in mine if g.level == proven and g.passed]
        rows.append(
            {
                "id": inno.id,
                "title": inno.title,
                "level": proven.name,
                "score": int(proven),
                "claim": verdict.claim.name,
                "killed": verdict.killed,
                "kill_reason": verdict.reason,
                "gates": [g.id for g in mine],
                "gates_passed": sum(g.passed for g in mine),
                "gates_total": len(mine),
                "checks_passed": sum(g.checks_passed for g in mine),
                "checks_total": sum(g.checks_total for g in mine),
                "evidence": "; ".join(g.summary for g in at_level if g.summary),
                "blocker": why,
            }
        )
    total = sum(r["score"] for r in rows)
    return {
        "innovations": rows,
        "score_sum": total,
        "score_max": 4 * len(rows),
        "permille": permille((r["score"] for r in rows), len(rows)),
    }
