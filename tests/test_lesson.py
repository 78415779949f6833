"""Lesson 8.7 in headless Chromium (Debian's /usr/bin/chromium through Playwright).

Acceptance (issue 7):
1. enter a prediction and reveal it: the worked answer appears;
2. change a calculator input: the output equals the value computed here from the stated formula;
3. add a matrix row and reload: it persists; export it: valid JSON that contains the row;
4. the licensing helper gives the documented answer for every scenario of lesson_license.toml;
5. the live gate evidence on the lesson matches census.json of the same build;
6. no console error and no CSP violation; a screenshot of each lesson section is saved.

The site is the session build (conftest.built_site), served from 127.0.0.1 with the production
CSP header (lesson_support.serve_site). Every request to another host is aborted and fails the
test, so nothing here reaches the network. No test asserts a time.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, BuildRun
from lesson_support import CHROMIUM, Recorder, serve_site

playwright_sync = pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed"),
]

URL = "/lesson/8.7/"
DATA = ROOT / "site_src" / "data"


def _toml(name: str) -> dict[str, Any]:
    return tomllib.loads((DATA / f"{name}.toml").read_text(encoding="utf-8"))


FACTS = _toml("lesson_facts")["k3"]
LICENSE = _toml("lesson_license")
MATRIX = _toml("lesson_matrix")


def _front_matter_sections() -> list[str]:
    text = (ROOT / "site_src" / "pages" / "lesson-8.7.md").read_text(encoding="utf-8")
    return tomllib.loads(text.split("+++")[1])["sections"]


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(built_site: BuildRun) -> Iterator[str]:
    with serve_site(built_site.out) as base:
        yield base


@pytest.fixture(scope="module")
def census(built_site: BuildRun) -> dict[str, Any]:
    return built_site.census


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lesson-screenshots")
    print(f"\nlesson screenshots: {folder}")
    return folder


@dataclass
class Lesson:
    page: Any
    rec: Recorder
    base: str

    def value(self, selector: str) -> float:
        """The unrounded number an <output> holds (data-value), as a float."""
        raw = self.page.get_attribute(selector, "data-value")
        assert raw not in (None, ""), f"{selector} has no value"
        return float(raw)


def _open(browser: Any, base: str, **context_args: Any) -> tuple[Any, Recorder, Any]:
    context = browser.new_context(
        viewport={"width": 1280, "height": 900}, service_workers="block", **context_args
    )
    rec = Recorder(base)
    rec.attach(context)
    page = context.new_page()
    page.goto(base + URL)
    return context, rec, page


@pytest.fixture
def lesson(browser: Any, site: str) -> Iterator[Lesson]:
    """A fresh browser context (empty localStorage) on the lesson; fails on any console error,
    page error, CSP violation or outside request seen during the test."""
    context, rec, page = _open(browser, site)
    yield Lesson(page, rec, site)
    problems = rec.problems()
    context.close()
    assert not problems, "\n".join(problems)


def _b4(census: dict[str, Any]) -> float:
    gate = next(g for g in census["gates"] if g["id"] == "mxfp_quantize")
    assert gate["passed"]
    return float(gate["artifacts"]["mxfp4_bits_per_value"])


def _b8(census: dict[str, Any]) -> float:
    gate = next(g for g in census["gates"] if g["id"] == "mxfp_quantize")
    return float(gate["artifacts"]["mxfp8_bits_per_value"])


# -- 1. Predict -----------------------------------------------------------------------------------
def test_prediction_then_reveal_shows_the_worked_answer(lesson: Lesson, census: dict[str, Any]):
    page = lesson.page
    answer = page.locator("#answer-total")
    assert answer.is_hidden()  # with JS the answer waits for a prediction

    page.click("#predict-total button.reveal")  # no prediction yet: nothing revealed
    assert answer.is_hidden()
    assert "Write your prediction first" in page.inner_text("#predict-total .hint")

    mine = "BF16 needs 5.6 TB; it says nothing about per-token compute."
    page.fill("#pred-total", mine)
    page.click("#predict-total button.reveal")
    assert answer.is_visible()
    assert page.inner_text("#predict-total .echo") == mine
    assert page.get_attribute("#predict-total button.reveal", "aria-expanded") == "true"

    # the worked numbers, from the official figures and this build's measured bits per value
    n = FACTS["total_b"] * 1e9
    p_expert = 3 * FACTS["latent"] * FACTS["expert_width"]
    routed = (FACTS["layers"] - FACTS["dense_layers"]) * FACTS["routed"] * p_expert
    r = round(routed / 1e7) / 100 * 1e9  # the calculator's rounded default, in parameters
    b4 = _b4(census)
    expect = {
        "bf16_tb": (n * 2 / 1e12, 2),
        "b4": (b4, 2),
        "mixed_tb": ((r * b4 / 8 + (n - r) * 16 / 8) / 1e12, 2),
        "mxfp4_all_tb": (n * b4 / 8 / 1e12, 2),
    }
    for key, (value, digits) in expect.items():
        out = page.locator(f"#answer-total output[data-k='{key}']").first
        assert float(out.get_attribute("data-value")) == pytest.approx(value, rel=1e-12), key
        assert out.inner_text() == f"{value:.{digits}f}", key
    assert math.comb(FACTS["routed"], FACTS["selected"]) > 0
    digits = page.locator("#answer-experts output[data-k='combo_digits']").inner_text()
    assert int(digits) == len(str(math.comb(FACTS["routed"], FACTS["selected"])))

    page.reload()  # the prediction and its revealed state persist
    assert page.input_value("#pred-total") == mine
    assert page.locator("#answer-total").is_visible()
    assert page.locator("#answer-active").is_hidden()


# -- 2. calculators -------------------------------------------------------------------------------
def _formulas_shown(page: Any, form: str) -> str:
    return " ".join(page.locator(f"{form} dt code").all_inner_texts())


def test_weight_storage_uses_the_gate_measured_mxfp4_bits(lesson: Lesson, census: dict[str, Any]):
    page, b4 = lesson.page, _b4(census)
    assert float(page.input_value("#weights-b4")) == b4  # from mxfp_quantize, not typed in
    assert page.get_attribute("#weights-b4", "readonly") is not None
    shown = _formulas_shown(page, "#calc-weights")
    for formula in (
        "BF16 = N · 16 / 8",
        "FP8 = N · b_FP8 / 8",
        "all MXFP4 = N · b_MXFP4 / 8",
        "K3 mixed = R · b_MXFP4 / 8 + (N − R) · b_rest / 8",
    ):
        assert formula in shown

    page.fill("#weights-n_b", "1000")
    page.fill("#weights-routed_b", "900")
    page.fill("#weights-b_rest", "8")
    page.fill("#weights-b_fp8", "8.5")
    n, r = 1000e9, 900e9
    assert lesson.value("#weights-out-bf16") == pytest.approx(n * 16 / 8, rel=1e-12)
    assert lesson.value("#weights-out-fp8") == pytest.approx(n * 8.5 / 8, rel=1e-12)
    assert lesson.value("#weights-out-mxfp4") == pytest.approx(n * b4 / 8, rel=1e-12)
    mixed = r * b4 / 8 + (n - r) * 8 / 8
    assert lesson.value("#weights-out-mixed") == pytest.approx(mixed, rel=1e-12)
    assert page.inner_text("#weights-out-bf16") == "2.00 TB"


def test_active_and_all_to_all_follow_their_formulas(lesson: Lesson, census: dict[str, Any]):
    page = lesson.page
    assert "P_routed = L · E · P_expert" in _formulas_shown(page, "#calc-active")
    page.fill("#active-routed", "384")
    page.fill("#active-selected", "8")
    page.fill("#active-latent", "7168")
    page.fill("#active-expert_width", "2048")
    page.fill("#active-moe_layers", "60")
    p_expert = 3 * 7168 * 2048
    assert lesson.value("#active-out-p_expert") == p_expert
    assert lesson.value("#active-out-routed_total") == 60 * 384 * p_expert
    assert lesson.value("#active-out-routed_active") == 60 * 8 * p_expert
    assert lesson.value("#active-out-selected_frac") == pytest.approx(8 / 384)
    total = FACTS["total_b"] * 1e9
    assert lesson.value("#active-out-rest_total") == pytest.approx(total - 60 * 384 * p_expert)
    assert lesson.value("#active-out-flops") == pytest.approx(2 * FACTS["active_b"] * 1e9)

    shown = _formulas_shown(page, "#calc-a2a")
    assert "per layer = k · (1 − f_local) · d · (b_dispatch + b_combine) / 8" in shown
    b8 = _b8(census)
    assert float(page.input_value("#a2a-b_dispatch")) == b8  # MXFP8, measured by the gate
    page.fill("#a2a-width", "7168")
    page.fill("#a2a-local_frac", "0.25")
    page.fill("#a2a-tps", "2500")
    k, layers = FACTS["selected"], FACTS["layers"] - FACTS["dense_layers"]
    per_layer = k * (1 - 0.25) * 7168 * (b8 + 16) / 8
    assert lesson.value("#a2a-out-per_layer") == pytest.approx(per_layer, rel=1e-12)
    assert lesson.value("#a2a-out-per_token") == pytest.approx(layers * per_layer, rel=1e-12)
    assert lesson.value("#a2a-out-bandwidth") == pytest.approx(layers * per_layer * 2500)

    page.fill("#a2a-local_frac", "-1")  # out of range: flagged, no number invented
    assert page.get_attribute("#a2a-local_frac", "aria-invalid") == "true"
    assert page.inner_text("#a2a-out-per_token") == "—"


def test_kv_state_calculator_and_its_chart(lesson: Lesson):
    page = lesson.page
    shown = _formulas_shown(page, "#calc-kv")
    assert "MLA = T · L_MLA · (d_c + d_r) · b_cache" in shown
    assert "KDA = L_KDA · H · (d_k · d_v + c · (2·d_k + d_v)) · b_state" in shown
    assert "MHA = T · L_MHA · H · (d_qk + d_vh) · b_MHA" in shown
    f = FACTS
    page.fill("#kv-context", "131072")
    page.fill("#kv-cache_bytes", "1")
    mla = 131072 * f["mla_layers"] * (f["kv_lora"] + f["rope"]) * 1
    conv = f["conv_kernel"] - 1
    kda = (
        f["kda_layers"] * f["heads"] * (f["d_k"] * f["d_v"] + conv * (2 * f["d_k"] + f["d_v"])) * 4
    )
    mha = 131072 * f["layers"] * f["heads"] * (f["qk_head"] + f["v_head"]) * 2
    assert lesson.value("#kv-out-mla") == mla
    assert lesson.value("#kv-out-kda") == kda
    assert lesson.value("#kv-out-k3") == mla + kda
    assert lesson.value("#kv-out-mha") == mha
    assert lesson.value("#kv-out-ratio") == pytest.approx(mha / (mla + kda))
    # the chart is SVG built by the page: four series, a marker at T, a legend with the values
    assert page.locator("#kv-chart svg polyline.series").count() == 4
    assert page.locator("#kv-chart svg line.marker").count() == 1
    assert "T = 128K" in page.text_content("#kv-chart svg")
    assert page.locator("#kv-table tr.current th").inner_text().startswith("131,072")


# -- 3. the audit matrix --------------------------------------------------------------------------
def _add_row(page: Any, claim: str) -> None:
    page.select_option("#mx-model", "Kimi K3")
    page.select_option("#mx-layer", "training")
    page.select_option("#mx-evidence", "independent")
    page.select_option("#mx-innovation", "mxfp")
    page.fill("#mx-claim", claim)
    page.fill("#mx-source", "my own rerun, 2026-08")
    page.fill("#mx-boundary", "MXFP4 vs BF16 on one benchmark")
    page.fill("#mx-dependency", "the released MXFP4 checkpoint")
    page.fill("#mx-falsify", "a larger gap on a second benchmark")
    page.click("#mx-submit")


def test_matrix_row_persists_across_reload_and_exports(lesson: Lesson, census: dict[str, Any]):
    page = lesson.page
    seeds = len(MATRIX["rows"])
    assert page.locator("#matrix-table tbody tr").count() == seeds
    claim = "MXFP4 QAT costs under one point on my benchmark"
    _add_row(page, claim)
    assert page.locator("#matrix-table tbody tr").count() == seeds + 1

    page.reload()
    row = page.locator("#matrix-table tbody tr", has_text=claim)
    assert row.count() == 1
    assert row.get_attribute("data-origin") == "mine"
    mxfp = next(r for r in census["innovations"] if r["id"] == "mxfp")
    assert row.locator(".live").get_attribute("data-level") == mxfp["level"]  # live, not stored

    page.select_option("#mf-layer", "training")  # filter: only training rows remain
    layers = {tr.get_attribute("data-layer") for tr in page.locator("#matrix-table tbody tr").all()}
    assert layers == {"training"}
    page.select_option("#mf-layer", "")
    page.fill("#mf-text", "under one point")
    assert page.locator("#matrix-table tbody tr").count() == 1
    page.fill("#mf-text", "")

    page.click("button[data-export='json']")
    exported = json.loads(page.input_value("#mx-export-text"))
    assert exported["build_commit"] == census["provenance"]["git_commit"]
    mine = [r for r in exported["rows"] if r["claim"] == claim]
    assert len(mine) == 1 and len(exported["rows"]) == seeds + 1
    assert mine[0]["layer"] == "training" and mine[0]["evidence"] == "independent"
    assert mine[0]["live_status"]["level"] == mxfp["level"]
    with page.expect_download() as dl:
        page.click("#mx-download")
    assert dl.value.suggested_filename == "k3-audit-matrix.json"
    assert json.loads(Path(dl.value.path()).read_text(encoding="utf-8")) == exported

    page.click("button[data-export='csv']")
    rows = list(csv.DictReader(io.StringIO(page.input_value("#mx-export-text"))))
    assert [r["claim"] for r in rows].count(claim) == 1
    page.click("button[data-export='md']")
    assert f"| {claim} |" in page.input_value("#mx-export-text")


def test_matrix_edit_delete_and_reset(lesson: Lesson):
    page = lesson.page
    seeds = len(MATRIX["rows"])
    _add_row(page, "a claim to edit")
    page.locator("#matrix-table tr", has_text="a claim to edit").locator(
        "button[data-act='edit']"
    ).click()
    assert page.inner_text("#mx-submit") == "Save changes"
    page.fill("#mx-claim", "an edited claim")
    page.keyboard.press("Enter")  # the form submits from the keyboard
    first_seed = MATRIX["rows"][0]["id"]
    page.click(f"#mrow-{first_seed} button[data-act='delete']")
    page.reload()
    assert page.locator("#matrix-table tr", has_text="an edited claim").count() == 1
    assert page.locator("#matrix-table tr", has_text="a claim to edit").count() == 0
    assert page.locator(f"#mrow-{first_seed}").count() == 0
    page.click("#mx-reset")
    page.click("#mx-reset")  # the second click confirms
    assert page.locator("#matrix-table tbody tr").count() == seeds
    page.reload()
    assert page.locator(f"#mrow-{first_seed}").count() == 1


# -- 4. licensing ---------------------------------------------------------------------------------
def test_licensing_helper_gives_the_documented_answers(lesson: Lesson):
    page = lesson.page
    scenarios = LICENSE["scenarios"]
    assert len(scenarios) >= 4
    for s in scenarios:
        page.select_option("#lic-license", s["license"])
        page.select_option("#lic-use", s["use"])
        page.fill("#lic-revenue_12m", str(s["revenue_12m"]))
        page.fill("#lic-mau", str(s["mau"]))
        page.fill("#lic-revenue_month", str(s["revenue_month"]))
        verdict = page.inner_text("#license-verdict")
        answer = "yes" if s["review"] else "no"
        assert verdict.startswith(f"Needs separate commercial review: {answer}, because "), (
            s["name"],
            verdict,
        )
        assert s["because"] in verdict, (s["name"], verdict)
        display = page.inner_text("#license-display")
        if s["display"]:
            assert "prominently: required" in display, (s["name"], display)
        else:
            assert "prominently: required" not in display, (s["name"], display)

    # "Load" fills the helper from the documented row and lands on the same answer
    page.click("#license-scenarios button.try[data-scenario='1']")
    assert page.inner_text("#license-verdict").startswith(
        "Needs separate commercial review: yes, because"
    )


# -- 5. live evidence == census.json ---------------------------------------------------------------
def test_live_gate_evidence_matches_census_json(lesson: Lesson, census: dict[str, Any]):
    page = lesson.page
    gates = {g["id"]: g for g in census["gates"]}
    rows = page.locator("#verify-table tbody tr")
    assert rows.count() == len(census["innovations"])
    for i, inno in enumerate(census["innovations"]):
        tr = rows.nth(i)
        assert tr.get_attribute("data-innovation") == inno["id"]
        assert tr.locator(".v-level .badge").inner_text() == inno["level"]
        checks = f"{inno['checks_passed']}/{inno['checks_total']}"
        assert tr.locator(".v-checks-n").inner_text() == checks
        assert (
            tr.locator(".v-gates-n").inner_text() == f"{inno['gates_passed']}/{inno['gates_total']}"
        )
        claim = tr.locator(".v-claim").inner_text()
        assert inno["claim"] in claim and (("liar-killed" in claim) == inno["killed"])
        shown = tr.locator("li[data-gate]")
        assert [shown.nth(j).get_attribute("data-gate") for j in range(shown.count())] == inno[
            "gates"
        ]
        for gid in inno["gates"]:
            li = tr.locator(f"li[data-gate='{gid}']")
            g = gates[gid]
            assert li.locator(".status").inner_text() == g["status"]
            n_ok = sum(1 for c in g["checks"] if c["passed"])
            assert li.locator(".g-checks").inner_text() == f"{n_ok}/{len(g['checks'])} checks"
            assert li.locator("a").get_attribute("href") == f"/gates/{gid}/"
        assert tr.locator("th a").get_attribute("href") == f"/innovations/{inno['id']}/"

        # the same live status wherever the lesson shows it: concept cards and matrix rows
        for live in page.locator(f".live[data-innovation='{inno['id']}']").all():
            assert live.locator(".live-level .badge").inner_text() == inno["level"]
            assert live.locator(".live-checks").inner_text() == checks

    assert f"{census['permille']}‰" in page.inner_text("#this-build")
    artifact = page.locator("#mrow-arch-mxfp .artifact strong").inner_text()
    assert artifact == f"{_b4(census):.2f}"

    page.click("#recheck")  # the page re-reads census.json itself and compares
    page.locator("#recheck-result[data-ok]").wait_for(state="attached")
    assert page.get_attribute("#recheck-result", "data-ok") == "true"
    assert page.inner_text("#recheck-result").startswith("Matches census.json")


# -- 6. no console error, no CSP violation; screenshots ------------------------------------------
def test_every_section_clean_under_csp_with_screenshots(lesson: Lesson, shots: Path):
    page = lesson.page
    for box in page.locator(".predict").all():  # exercise every widget once
        box.locator("textarea").fill("my prediction")
        box.locator("button.reveal").click()
    page.fill("#kv-context", "262144")
    page.check("#ev-effort")
    page.check("#ev-harness")
    page.select_option("#tr-model", "k2")
    page.check("#tr-nc")
    page.click("#tr-add")
    assert "rows added" in page.inner_text("#tr-msg")
    page.click("#license-scenarios button.try[data-scenario='3']")
    page.click("button[data-export='md']")
    page.click("#recheck")
    page.locator("#recheck-result[data-ok]").wait_for(state="attached")

    sections = _front_matter_sections()
    saved = []
    for key in sections:
        section = page.locator(f"main section#{key}")
        assert section.count() == 1, key
        path = shots / f"{len(saved) + 1:02d}-{key}.png"
        section.screenshot(path=str(path))
        saved.append(path)
    print(f"\nlesson screenshots ({len(saved)} sections): {shots}")
    assert all(p.stat().st_size > 0 for p in saved)
    assert len(saved) == len(sections)
    assert not lesson.rec.problems(), "\n".join(lesson.rec.problems())


TOC_LAYOUT = """ol => [...ol.children].map(li => {
    const r = li.getBoundingClientRect(), s = getComputedStyle(li);
    return {display: s.display, numbering: getComputedStyle(ol).listStyleType,
            left: r.left - ol.getBoundingClientRect().left, top: r.top, bottom: r.bottom,
            text: li.textContent};
})"""


def test_the_toc_is_a_numbered_list_one_entry_per_line(lesson: Lesson):
    """Each section is a list item with its own number: on a line of its own, with room to the
    left of its text for the number (a flowing row once ran numbers into the entry before)."""
    rows = lesson.page.eval_on_selector(".toc ol", TOC_LAYOUT)
    assert [r["text"] for r in rows] and len(rows) == len(_front_matter_sections())
    for r in rows:
        assert (r["display"], r["numbering"]) == ("list-item", "decimal"), r
        assert r["left"] >= 16, f"no room for the number of {r['text']!r}"
    for before, after in itertools.pairwise(rows):
        assert after["top"] >= before["bottom"] - 1, f"{after['text']!r} shares a line"


def test_the_violation_recorder_does_catch_an_inline_script(browser: Any, site: str):
    """The CSP listener is live: an injected inline script is refused and reported."""
    context, rec, page = _open(browser, site)
    page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = '1';"
        " document.body.append(s); }"
    )
    page.locator("html[data-csp-violations]").wait_for(state="attached")
    context.close()
    assert rec.csp_violations and rec.csp_violations[0]["directive"].startswith("script-src")


# -- without JavaScript, and for the keyboard ------------------------------------------------------
def test_without_javascript_every_text_and_default_result_is_static(
    browser: Any, site: str, census: dict[str, Any]
):
    context, rec, page = _open(browser, site, java_script_enabled=False)
    try:
        assert page.locator("#matrix-table tbody tr").count() == len(MATRIX["rows"])
        assert page.locator("#answer-total").is_visible()  # worked answers stand open
        assert page.locator("#matrix-form").is_hidden()  # controls that need JS stay hidden
        assert page.locator("#license-scenarios tbody tr").count() == len(LICENSE["scenarios"])
        static = {
            o.get_attribute("id") or o.get_attribute("data-k"): o.get_attribute("data-value")
            for o in page.locator("output[data-value]").all()
        }
        assert page.locator("#verify-table tbody tr").count() == len(census["innovations"])
    finally:
        context.close()
    # the same numbers once the scripts recompute them from the same inputs
    context, rec, page = _open(browser, site)
    try:
        live = {
            o.get_attribute("id") or o.get_attribute("data-k"): o.get_attribute("data-value")
            for o in page.locator("output[data-value]").all()
        }
    finally:
        context.close()
    assert not rec.problems()
    assert static.keys() <= live.keys()
    for key, raw in static.items():
        assert raw, key
        assert float(live[key]) == pytest.approx(float(raw), rel=1e-12), key


def test_every_control_is_labelled_and_reachable_by_keyboard(lesson: Lesson):
    page = lesson.page
    unlabelled = page.evaluate(
        """() => [...document.querySelectorAll('input, select, textarea')]
             .filter((e) => e.type !== 'hidden')
             .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
             .map((e) => e.id || e.name)"""
    )
    assert unlabelled == []
    nameless = page.evaluate(
        """() => [...document.querySelectorAll('button')]
             .filter((b) => !(b.textContent.trim() || b.getAttribute('aria-label')))
             .length"""
    )
    assert nameless == 0
    # Tab from the first prediction reaches its reveal button; Enter activates it
    page.fill("#pred-active", "32B is K2's figure, not K3's")
    page.focus("#pred-active")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.closest('.predict').dataset.prompt") == "active"
    page.keyboard.press("Enter")
    assert page.locator("#answer-active").is_visible()
    # the licensing helper answers from the keyboard alone
    page.focus("#lic-use")
    page.keyboard.press("End")  # the last option: not sure whether it is MaaS
    page.focus("#lic-revenue_12m")
    page.keyboard.type("50")
    assert page.inner_text("#license-verdict").startswith("Needs separate commercial review: yes")


def test_transfer_marks_the_fields_that_do_not_compare(lesson: Lesson):
    page = lesson.page
    facts = _toml("lesson_facts")
    marked = page.locator("#transfer-table td[data-col='v3'] .cmp.nc").count()
    assert marked == sum(1 for t in facts["transfer"] if t.get("v3_note"))
    page.select_option("#tr-model", "v3")
    assert page.locator("#transfer-table td[data-col='k2']").first.is_hidden()
    page.click("#tr-add")
    added = page.locator("#matrix-table tbody tr[data-model='DeepSeek-V3']")
    assert added.count() == len(facts["transfer"])
    boundaries = " ".join(added.locator("[data-f='boundary']").all_inner_texts())
    assert "not directly comparable with Kimi K3" in boundaries


# -- the template follows whatever the census says -------------------------------------------------
def _render_lesson(census: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp: Path) -> str:
    """Render templates/lesson.html as build.py does, from an arbitrary census dict."""
    import importlib.util

    monkeypatch.setenv("K3GATES_CACHE", str(tmp))  # the Jinja bytecode cache, kept private
    spec = importlib.util.spec_from_file_location("k3_build_for_lesson", ROOT / "build.py")
    assert spec and spec.loader
    build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, build)  # dataclasses look their module up
    spec.loader.exec_module(build)
    content = build.load_content(ROOT / "site_src")
    page = next(p for p in content.pages if p.meta["url"] == URL)
    env = build._environment(ROOT / "templates")
    return env.get_template(page.meta["template"]).render(
        census=census,
        prov=census["provenance"],
        asset=lambda path: f"/assets/{path}",
        levels=["GAP", "PARTIAL", "HAVE", "STRONG", "PROVEN"],
        innovations={r["id"]: r for r in census["innovations"]},
        gates={g["id"]: g for g in census["gates"]},
        history=[],
        data=content.data,
        url=URL,
        page=page,
    )


def test_the_lesson_renders_any_census_generically(
    census: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """A new passing KDA gate shows up everywhere KDA's evidence is shown; a failing mxfp gate
    takes its measured bits per value off the page instead of leaving a stale number."""
    fake = json.loads(json.dumps(census))
    for g in fake["gates"]:
        if g["id"] == "mxfp_quantize":
            g.update(status="failed", passed=False, artifacts=None)
    check = {"name": "overwrite", "kind": "property", "proves": "v2, not v1 + v2", "passed": True}
    fake["gates"].append(
        {
            **fake["gates"][0],
            "id": "kda_gate_probe",
            "innovation": "kda",
            "level": "PARTIAL",
            "status": "passed",
            "passed": True,
            "checks": [check],
            "artifacts": {},
        }
    )
    for row in fake["innovations"]:
        if row["id"] == "kda":
            row.update(
                level="PARTIAL",
                score=1,
                gates=["kda_gate_probe"],
                gates_passed=1,
                gates_total=1,
                checks_passed=1,
                checks_total=1,
            )
    html = _render_lesson(fake, monkeypatch, tmp_path)
    assert html.count('href="/gates/kda_gate_probe/"') >= 2  # concept card and Verify table
    assert 'data-innovation="kda" data-title' in html
    assert (
        'id="verify-kda" data-innovation="kda" data-title="Kimi Delta Attention" '
        'data-level="PARTIAL"' in html
    )
    assert 'data-b4=""' in html  # no measurement from a failing gate
    assert 'id="weights-b4" name="b4"' in html and "not measured in this build" in html
    assert "4.25" not in html.split('id="calculators"')[1].split('id="matrix"')[0]
