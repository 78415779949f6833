"""Per-Head Muon in the published census (issue 8, acceptance 1) and its training curve."""

from __future__ import annotations

from conftest import BuildRun

GATES = {"muon_ns5": "PARTIAL", "muon_step": "HAVE", "muon_perhead": "STRONG",
         "muon_training": "PROVEN"}  # fmt: skip


def test_perheadmuon_is_proven_with_every_check_passing(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "perheadmuon")
    assert row["level"] == "PROVEN" and not row["killed"]
    gates = {g["id"]: g for g in built_site.census["gates"] if g["innovation"] == "perheadmuon"}
    assert {gid: g["level"] for gid, g in gates.items()} == GATES
    for gid, g in gates.items():
        assert g["passed"] and all(c["passed"] for c in g["checks"]), gid
        if g["level"] != "PARTIAL":
            kinds = {c["kind"] for c in g["checks"]}
            assert {"nofloat", "compiled", "reference", "deterministic", "property"} <= kinds, gid
        for c in g["checks"]:
            if c["kind"] == "reference":
                assert c["measured"] <= c["bound"], (gid, c["name"])


def test_the_training_curve_is_drawn_beside_the_float_reference(built_site: BuildRun):
    g = next(g for g in built_site.census["gates"] if g["id"] == "muon_training")
    curve = g["artifacts"]["curve:training loss"]
    assert set(curve["series"]) == {"integer per-head Muon", "float64 reference"}
    assert curve["series"]["integer per-head Muon"][-1] < curve["threshold"]
    page = (built_site.out / "gates" / "muon_training" / "index.html").read_text()
    assert "<svg" in page and "training loss" in page
