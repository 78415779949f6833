"""SiTU in the published census, and the foundations page (issue 3, acceptance 1 and 2)."""

from __future__ import annotations

import html
import re

import pytest
from conftest import BuildRun

FX_FUNCTIONS = {
    "rshift_round", "mul_q62", "mul_round", "div_round", "div_round_shift", "narrow_int32",
    "isqrt", "exp", "sigmoid", "tanh", "silu", "rsqrt", "rmsnorm", "l2norm", "softmax", "sin",
    "cos",
}  # fmt: skip
ANCHORS = {"exp": 500, "tanh": 310, "sigmoid": 155}  # gemmlowp, LSB of Q0.31


def gates(run: BuildRun, prefix: str) -> list[dict]:
    return [g for g in run.census["gates"] if g["id"].startswith(prefix)]


def test_situ_is_proven_with_every_check_passing(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "situ")
    assert row["level"] == "PROVEN" and not row["killed"]
    situ = [g for g in built_site.census["gates"] if g["innovation"] == "situ"]
    assert {g["level"] for g in situ} == {"PARTIAL", "HAVE", "STRONG", "PROVEN"}
    for g in situ:
        assert g["passed"] and all(c["passed"] for c in g["checks"]), g["id"]
        required = {c["name"] for c in g["checks"] if c["name"].startswith("requires:")}
        assert required == {f"requires:{f['id']}" for f in gates(built_site, "fx_")}


def test_the_foundations_gates_pass_and_count_toward_nothing(built_site: BuildRun):
    fx = gates(built_site, "fx_")
    assert len(fx) == 6
    for g in fx:
        assert g["innovation"] is None and g["passed"], g["id"]
        kinds = {c["kind"] for c in g["checks"]}
        assert {"nofloat", "compiled", "reference", "deterministic", "property"} <= kinds


def test_every_bound_is_declared_measured_and_at_least_as_tight_as_gemmlowp(built_site):
    seen = set()
    for g in gates(built_site, "fx_"):
        for c in g["checks"]:
            if c["kind"] != "reference":
                continue
            fn = c["values"]["function"]
            seen.add(fn)
            assert c["passed"] and c["measured"] <= c["bound"], (g["id"], c["name"])
            assert c["values"]["points"] >= 2**20 or "edge" in c["values"]["domain"] or fn in {
                "div_round", "div_round_shift", "narrow_int32", "mul_q62", "mul_round",
                "rshift_round", "isqrt",
            }  # fmt: skip
            if fn in ANCHORS:
                assert c["bound"] <= ANCHORS[fn] and str(ANCHORS[fn]) in c["values"]["anchor"]
    assert seen == FX_FUNCTIONS


def test_the_gemmlowp_anchors_are_a_displayed_table_not_a_check(built_site: BuildRun):
    """Two constants compared cannot fail: the anchors are a table on the gate pages."""
    key = "table:declared bounds beside gemmlowp's fixedpoint.h tolerances (LSB of Q0.31)"
    rows = {}
    for g in gates(built_site, "fx_"):
        assert not any(c["name"].startswith("anchor_") for c in g["checks"]), g["id"]
        rows |= {r[0]: (g["id"], r) for r in g["artifacts"].get(key, {}).get("rows", [])}
    assert set(rows) == set(ANCHORS)
    for fn, (gate_id, (_, bound, anchor, holds)) in rows.items():
        assert anchor == ANCHORS[fn] and bound <= anchor and holds == "yes", fn
        page = (built_site.out / "gates" / gate_id / "index.html").read_text()
        assert "gemmlowp" in page and f"<td>{anchor}</td>" in page.replace(" ", ""), fn


def page_rows(text: str) -> list[list[str]]:
    rows = re.findall(r'<tr class="(?:ok|bad)">(.*?)</tr>', text, re.S)
    cell = re.compile(r"<t[hd][^>]*>(.*?)</t[hd]>", re.S)
    return [
        [html.unescape(re.sub("<[^>]+>", "", c)).strip() for c in cell.findall(r)] for r in rows
    ]


def test_the_foundations_page_lists_every_function_with_bound_and_measurement(built_site):
    text = (built_site.out / "foundations" / "index.html").read_text()
    rows = page_rows(text)
    # the fx math, and the shared integer GEMM (exact: its bound and error are 0)
    gemm = {"gemm_i16", "gemm_i64", "sum_outer"}
    assert {r[0] for r in rows} == FX_FUNCTIONS | gemm
    for r in rows:
        function, _, _, domain, _, bound, measured, anchor, result = r
        if function in gemm:
            assert result == "pass" and bound.startswith("0 exact") and measured.startswith("0"), r
            continue
        assert result == "pass" and bound != "—" and measured != "—", r
        assert (
            domain.startswith(("exhaustive", "dense grid", "one seeded row")) or "random" in domain
        )
        if function in ANCHORS:
            assert f"≤ {ANCHORS[function]}" in anchor and bound.startswith("0.501"), r


@pytest.mark.parametrize("gate_id", ["situ_training"])
def test_the_training_curve_is_drawn(built_site: BuildRun, gate_id: str):
    g = next(g for g in built_site.census["gates"] if g["id"] == gate_id)
    curve = g["artifacts"]["curve:training loss"]
    assert set(curve["series"]) == {"integer (Q.24)", "float64 reference"}
    assert curve["series"]["integer (Q.24)"][-1] < curve["threshold"]
    page = (built_site.out / "gates" / gate_id / "index.html").read_text()
    assert "<svg" in page and "training loss" in page
