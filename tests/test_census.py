"""The census rules as a table: ladder, caps, liar-kill, permille."""

import pytest

from k3gates.infra.census import GateOutcome, blocker, census, innovation_level, liar_kill, permille
from k3gates.infra.registry import INNOVATIONS, Level

P, H, S, V = Level.PARTIAL, Level.HAVE, Level.STRONG, Level.PROVEN


def g(level: Level, passed: bool, name: str = "") -> GateOutcome:
    return GateOutcome(name or f"{level.name.lower()}_{passed}", level, passed, failure="boom")


@pytest.mark.parametrize(
    ("gates", "expected"),
    [
        ([], Level.GAP),
        ([g(P, True)], P),
        ([g(P, False)], Level.GAP),
        ([g(P, True), g(H, True)], H),
        ([g(P, True), g(H, True), g(S, True), g(V, True)], V),
        ([g(P, True), g(H, False), g(S, True)], P),  # a failing HAVE caps STRONG
        ([g(P, False), g(H, True), g(S, True)], Level.GAP),  # a failing lower gate caps all above
        ([g(P, True), g(P, True, "p2"), g(H, True)], H),
        ([g(P, True), g(P, False, "p2"), g(H, True)], Level.GAP),  # every gate at a level must pass
        ([g(P, True), g(H, True), g(S, False)], H),  # a failing higher gate does not lower
        ([g(H, True)], Level.GAP),  # no PARTIAL rung: nothing above it counts
        ([g(V, True)], Level.GAP),  # a lone passing PROVEN gate earns nothing
        ([g(P, True), g(V, True)], P),  # empty HAVE and STRONG rungs cap PROVEN
        ([g(P, True), g(S, True), g(V, True)], P),  # a missing HAVE rung caps at PARTIAL
        ([g(P, True), g(H, True), g(V, True)], H),  # a missing STRONG rung caps at HAVE
    ],
)
def test_innovation_level(gates, expected):
    assert innovation_level(gates) == expected


def test_blocker_names_the_failing_gate_or_the_missing_level():
    assert blocker([g(P, True)], P) == "no HAVE gate exists"
    assert blocker([g(P, True), g(H, False, "kda_serve")], P) == (
        "gate kda_serve (HAVE) fails: boom"
    )
    assert blocker([g(P, True), g(V, True)], P) == (
        "no HAVE gate exists, so the PROVEN gates above it cannot count"
    )
    assert blocker([g(V, True)], V) == ""


def test_liar_kill_only_above_the_proven_level():
    v = liar_kill(Level.STRONG, Level.PARTIAL, "no HAVE gate exists")
    assert v.killed
    assert v.reason == "claimed STRONG, but the gates prove PARTIAL: no HAVE gate exists"
    assert not liar_kill(Level.HAVE, Level.HAVE, "").killed
    assert not liar_kill(Level.PARTIAL, Level.PROVEN, "").killed  # modest text is no lie


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([0] * 10, 0),
        ([4] * 10, 1000),
        ([2] + [0] * 9, 50),
        ([1] * 3 + [0] * 7, 75),
        ([3, 3, 3] + [0] * 7, 225),
        ([1] + [0] * 9, 25),
        ([4, 4, 4, 4, 3, 3, 2, 2, 1, 0], 675),
    ],
)
def test_permille_is_floor_of_thousand_times_sum_over_forty(scores, expected):
    assert permille(scores) == expected == (1000 * sum(scores)) // 40


def _result(id_, innovation, level, passed, checks=2):
    return {
        "id": id_,
        "innovation": innovation,
        "level": level,
        "passed": passed,
        "status": "passed" if passed else "failed",
        "summary": f"{id_} evidence",
        "checks": [
            {"name": f"c{i}", "passed": passed or i, "message": "bad"} for i in range(checks)
        ],
    }


def test_census_rows_use_the_proven_level_and_kill_overclaims():
    results = [
        _result("mx_p", "mxfp", "PARTIAL", True),
        _result("mx_h", "mxfp", "HAVE", False),
        _result("fx", None, "PARTIAL", True),
    ]
    claims = {"mxfp": Level.HAVE, "kda": Level.HAVE, "longctx": Level.GAP}
    c = census(results, claims)
    rows = {r["id"]: r for r in c["innovations"]}
    assert list(rows) == list(INNOVATIONS)
    assert rows["mxfp"]["level"] == "PARTIAL" and rows["mxfp"]["killed"]
    assert "gate mx_h (HAVE) fails: check c0: bad" in rows["mxfp"]["kill_reason"]
    assert rows["mxfp"]["checks_passed"] == 3 and rows["mxfp"]["checks_total"] == 4
    assert rows["kda"]["killed"] and rows["kda"]["level"] == "GAP"
    assert not rows["longctx"]["killed"]
    assert c["permille"] == 25  # only mxfp's PARTIAL scores; the foundations gate counts for none
    assert c["score_sum"] == 1 and c["score_max"] == 40


def test_a_failed_required_gate_fails_its_dependants_transitively():
    """runner.apply_requirements: `requires=` is followed transitively, with a named check."""
    from k3gates.infra.runner import apply_requirements

    results = [
        {**_result("kda_recurrent", "kda", "HAVE", False), "kernels": []},
        {**_result("k3block_forward", "k3block", "HAVE", True), "requires": ["kda_recurrent"]},
        {**_result("longctx_1m", "longctx", "HAVE", True), "requires": ["k3block_forward"]},
        {**_result("mx_p", "mxfp", "PARTIAL", True), "requires": []},
    ]
    out = {r["id"]: r for r in apply_requirements(results)}
    assert not out["k3block_forward"]["passed"]
    req = next(c for c in out["k3block_forward"]["checks"] if c["name"] == "requires:kda_recurrent")
    assert not req["passed"] and req["message"] == "required gate kda_recurrent failed"
    assert not out["longctx_1m"]["passed"]  # its requirement passed on its own, but not its own
    req = next(c for c in out["longctx_1m"]["checks"] if c["name"] == "requires:k3block_forward")
    assert req["message"] == "required gate k3block_forward passes, but a gate it requires failed"
    assert out["mx_p"]["passed"]


def test_a_required_gate_that_was_not_run_is_named_as_not_run():
    """A --only build that skips a requirement says so, rather than calling it failed."""
    from k3gates.infra.runner import apply_requirements

    skipped = {**_result("kda_recurrent", "kda", "HAVE", False), "status": "skipped"}
    results = [
        {**skipped, "kernels": []},
        {**_result("k3block_forward", "k3block", "HAVE", True), "requires": ["kda_recurrent"]},
    ]
    out = {r["id"]: r for r in apply_requirements(results)}
    req = next(c for c in out["k3block_forward"]["checks"] if c["name"] == "requires:kda_recurrent")
    assert not req["passed"]
    assert req["message"] == "required gate kda_recurrent did not run in this build"


def test_only_brings_every_gate_the_chosen_gates_build_on():
    """build.py --only muon_ns5 needs gemm_exact (a foundations gate of its kernels), and
    --only longctx_1m the kda and mla gates it requires, and --only vlm_training what its
    requirements require."""
    from pathlib import Path

    from k3gates.infra.discover import GatePackage, discover_gates
    from k3gates.infra.runner import requirements

    sites = discover_gates([GatePackage(Path(__file__).parents[1] / "k3gates")])
    site = {s.id: s for s in sites}
    muon = requirements(sites, ("muon_ns5",))
    assert "gemm_exact" in muon and "muon_ns5" not in muon
    assert all(site[g].innovation in (None, "perheadmuon") for g in muon), muon
    longctx = set(requirements(sites, ("longctx_1m",)))
    assert site["longctx_1m"].requires and set(site["longctx_1m"].requires) <= longctx
    vlm = set(requirements(sites, ("vlm_training",)))
    direct = set(site["vlm_training"].requires)
    below = {r for d in direct for r in site[d].requires} - direct
    assert below and direct | below <= vlm  # vision_block, through vision_backward
    assert requirements(sites, ()) == ()


def test_longctx_1m_fails_when_a_kda_gate_it_requires_fails():
    """The real declarations: longctx_1m names the kda gates whose kernels it runs."""
    from pathlib import Path

    from k3gates.infra.discover import GatePackage, discover_gates
    from k3gates.infra.runner import apply_requirements

    sites = discover_gates([GatePackage(Path(__file__).parents[1] / "k3gates")])
    site = {s.id: s for s in sites}
    kda_required = [r for r in site["longctx_1m"].requires if site[r].innovation == "kda"]
    assert kda_required, "longctx_1m must require the kda gates whose kernels it runs"
    for broken in kda_required:
        results = [
            {
                **_result(s.id, s.innovation, s.level.name, s.id != broken),
                "requires": list(s.requires),
            }
            for s in sites
        ]
        out = {r["id"]: r for r in apply_requirements(results)}
        assert not out["longctx_1m"]["passed"], broken
        rows = {r["id"]: r for r in census(list(out.values()), {})["innovations"]}
        assert Level[rows["longctx"]["level"]] < Level.HAVE
        assert f"requires:{broken}" in rows["longctx"]["blocker"]
