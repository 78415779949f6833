"""Lesson 8.7's calculators refuse input outside its range (issue 20, acceptance point 3).

Every numeric input of the four calculators states its valid range (min, max, integer or not) on
the page. For EACH input, a value below its minimum, one above its maximum, a non-integer where
integers are required, and an empty field each show a message (role="alert") naming the range,
and no number in any output of that calculator. Also: the cases the issue found (zero experts,
more selected experts than exist, routed parameters above the total, a very large context), a
result that valid inputs make meaningless (explained in words, not printed), the number formats,
and the notes on calculators 2 and 3 and on the rounded 2.8T. No console error anywhere.

Chromium is Debian's /usr/bin/chromium through Playwright; the site is the session build served
with the production CSP (lesson_support.serve_site); requests to other hosts are aborted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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

# Every calculator input, read from the template: (calculator, input name). The page must hold
# exactly these, so a new input without a test fails test_every_input_states_its_range.
FIELD = re.compile(r'lp\.field\("(\w+)", "(\w+)"')
INPUTS = FIELD.findall((ROOT / "templates" / "lesson.html").read_text(encoding="utf-8"))


# -- fixtures (the pattern of tests/test_lesson.py) ---------------------------------------------
@pytest.fixture(scope="module")
def site(built_site: BuildRun) -> Iterator[str]:
    with serve_site(built_site.out) as base:
        yield base


@pytest.fixture
def page(browser: Any, site: str) -> Iterator[Any]:
    """The lesson in a fresh context; fails on any console error, page error, CSP violation or
    outside request seen during the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    rec = Recorder(site)
    rec.attach(context)
    pg = context.new_page()
    pg.goto(site + URL)
    yield pg
    problems = rec.problems()
    context.close()
    assert not problems, "\n".join(problems)


# -- helpers --------------------------------------------------------------------------------------
def _num(x: float) -> str:
    """A bound as the page prints it: integers with commas, other numbers as they are."""
    return f"{int(x):,}" if float(x).is_integer() else repr(float(x))


def _set(page: Any, selector: str, value: str) -> None:
    """Type into an input; a read-only one (a measured value) is set by script instead."""
    if page.get_attribute(selector, "readonly") is None:
        page.fill(selector, value)
    else:
        page.eval_on_selector(
            selector,
            "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
            value,
        )


def _outputs(page: Any, calc: str) -> list[tuple[str, str]]:
    """(text, data-value) of every output of a calculator."""
    return [
        (o.inner_text(), o.get_attribute("data-value") or "")
        for o in page.locator(f"#calc-{calc} output[name]").all()
    ]


def _assert_refused(page: Any, calc: str, lo: str, hi: str, integer: bool, why: str) -> None:
    msg = page.locator(f"#calc-{calc}-msg")
    assert msg.is_visible(), why
    assert msg.get_attribute("role") == "alert"
    text = msg.inner_text()
    assert f"from {lo}" in text and f"to {hi}" in text, (why, text)
    assert ("integer" in text) == integer, (why, text)
    for shown, raw in _outputs(page, calc):
        assert shown == "—" and raw == "", (why, shown, raw)
    if calc == "kv":  # the chart and the table are outputs too
        assert page.locator("#kv-chart svg").count() == 0, why
        assert not re.search(r"\d", page.inner_text("#kv-table tbody")), why


def _assert_accepted(page: Any, calc: str, why: str) -> None:
    assert page.locator(f"#calc-{calc}-msg").is_hidden(), why
    for shown, raw in _outputs(page, calc):
        assert re.search(r"\d", shown) and raw, (why, shown)


# -- 1. every input: its range stated, and every value outside it refused -------------------------
def test_every_input_states_its_range(page: Any):
    on_page = [
        (el.evaluate("e => e.form.dataset.calc"), el.get_attribute("name"))
        for el in page.locator("form.calc input[type=number]").all()
    ]
    assert sorted(on_page) == sorted(INPUTS) and len(INPUTS) == 34
    for calc, name in INPUTS:
        el = page.locator(f"#{calc}-{name}")
        rng = page.locator(f"#{calc}-{name}-range")
        assert rng.is_visible(), name
        assert f"{calc}-{name}-range" in el.get_attribute("aria-describedby").split()
        text = rng.inner_text()
        assert re.fullmatch(r"Valid: (integer )?from .+ to .+", text), (name, text)
        assert ("integer" in text) == (el.get_attribute("step") == "1"), name
        assert el.get_attribute("data-min") is not None and el.get_attribute("data-max") is not None


@pytest.mark.parametrize(("calc", "name"), INPUTS, ids=[f"{c}-{n}" for c, n in INPUTS])
def test_values_outside_the_range_show_a_message_and_no_number(page: Any, calc: str, name: str):
    sel = f"#{calc}-{name}"
    default = page.get_attribute(sel, "value")
    _assert_accepted(page, calc, "at the defaults")
    # the bounds in force now (a bound that is another input is resolved by the page's script)
    lo, hi = float(page.get_attribute(sel, "min")), float(page.get_attribute(sel, "max"))
    integer = page.get_attribute(sel, "data-integer") == "true"
    below = lo - 1 if integer or lo <= 0 else lo / 2
    above = hi + 1 if integer else hi * 2
    cases = {"below the minimum": below, "above the maximum": above, "empty": ""}
    if integer:
        cases["not an integer"] = lo + 0.5
    for why, value in cases.items():
        _set(page, sel, str(value))
        assert page.get_attribute(sel, "aria-invalid") == "true", why
        _assert_refused(page, calc, _num(lo), _num(hi), integer, f"{name} {why} ({value})")
        _set(page, sel, default)
        _assert_accepted(page, calc, f"{name} back to {default}")


# -- 2. the cases the issue found -----------------------------------------------------------------
def test_zero_experts_and_more_selected_than_exist_are_refused(page: Any):
    page.fill("#active-routed", "0")
    _assert_refused(page, "active", "1", "100,000", True, "zero routed experts")
    # an out-of-range E does not become k's bound (no "from 1 to 0")
    assert page.get_attribute("#active-selected", "aria-invalid") == "false"
    assert "to 0 " not in page.inner_text("#calc-active-msg")
    page.fill("#active-routed", "8")  # 16 selected of 8 routed
    assert page.get_attribute("#active-selected", "aria-invalid") == "true"
    text = page.inner_text("#calc-active-msg")
    assert "Selected per token k" in text and "to 8 (Routed experts per layer E)" in text
    _assert_refused(page, "active", "1", "8", True, "k > E")
    page.fill("#active-selected", "8")
    _assert_accepted(page, "active", "k = E")
    # calculator 3 has no E of its own: k is bounded by K3's 896
    page.fill("#a2a-selected", "897")
    _assert_refused(page, "a2a", "1", "896", True, "k > K3's E")


def test_routed_parameters_above_the_total_and_active_above_total_are_refused(page: Any):
    page.fill("#weights-routed_b", "3000")  # R > N = 2800: the "mixed" figure would be nonsense
    _assert_refused(page, "weights", "0", "2,800", False, "R > N")
    page.fill("#weights-routed_b", "2000")
    _assert_accepted(page, "weights", "R < N")
    mixed = float(page.get_attribute("#weights-out-mixed", "data-value"))
    assert mixed >= float(page.get_attribute("#weights-out-mxfp4", "data-value"))
    page.fill("#weights-b_rest", "4")  # narrower than the measured MXFP4
    assert page.get_attribute("#weights-b_rest", "aria-invalid") == "true"
    assert page.locator("#weights-out-mixed").inner_text() == "—"
    page.fill("#active-active_b", "3000")  # more active than total parameters
    _assert_refused(page, "active", "0.001", "2,800", False, "N_active > N")


def test_a_meaningless_result_is_explained_not_printed(page: Any):
    page.fill("#active-total_b", "1000")  # valid, but the routed experts alone hold 3.0T
    why = page.locator("#calc-active-why")
    assert why.is_visible()
    assert "below zero" in why.inner_text() and "contradict" in why.inner_text()
    assert page.inner_text("#active-out-rest_total") == "—"
    assert page.get_attribute("#active-out-rest_total", "data-value") == ""
    assert page.locator("#calc-active-msg").is_hidden()  # every input is in range
    assert re.search(r"\d", page.inner_text("#active-out-flops"))  # the rest still prints
    page.fill("#active-total_b", "2800")
    assert why.is_hidden()
    assert float(page.get_attribute("#active-out-rest_total", "data-value")) > 0


def test_a_very_large_and_a_very_small_context_draw_a_clean_chart(page: Any):
    for context in ("1073741824", "1", "1000"):
        page.fill("#kv-context", context)
        svg = page.locator("#kv-chart svg")
        assert svg.count() == 1, context
        x_ticks = page.locator("#kv-chart svg text.tick[text-anchor=middle]").count()
        assert 2 <= x_ticks <= 8, (context, x_ticks)
        assert page.locator("#kv-chart svg text.tick[text-anchor=end]").count() <= 10
        markup = svg.evaluate("e => e.outerHTML")
        assert "Infinity" not in markup and "NaN" not in markup, context
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        # the marker at T lies inside the plot
        plot = page.locator("#kv-chart svg rect.plot")
        x0 = float(plot.get_attribute("x"))
        x1 = x0 + float(plot.get_attribute("width"))
        xm = float(page.get_attribute("#kv-chart svg line.marker", "x1"))
        assert x0 - 0.01 <= xm <= x1 + 0.01, (context, xm)
    page.fill("#kv-context", "1073741825")  # one past the maximum
    _assert_refused(page, "kv", "1", "1,073,741,824", True, "context above 2^30")


# -- 3. formats -----------------------------------------------------------------------------------
def test_formats_round_into_the_next_unit_and_keep_small_ratios(page: Any):
    page.fill("#weights-routed_b", "100")  # R must stay at most N
    page.fill("#weights-n_b", "499.8")  # BF16 = 999.6e9 bytes
    assert page.inner_text("#weights-out-bf16") == "1.00 TB"
    fmt = "([x, k]) => K3Lesson.calcFmt(x, k)"
    assert page.evaluate(fmt, [999.6e9, "bytes"]) == "1.00 TB"
    assert page.evaluate(fmt, [999.4e9, "bytes"]) == "999 GB"
    assert page.evaluate(fmt, [0.5, "ratio"]) == "0.5×"
    assert page.evaluate(fmt, [0.0123456, "ratio"]) == "0.0123×"
    assert page.evaluate(fmt, [203.4, "ratio"]) == "203×"
    assert page.evaluate(fmt, [1e-5, "pct"]) == "0.001 %"
    # beyond the largest unit: 3 significant digits as a power of ten, no invented digits
    assert page.evaluate(fmt, [1.234567891e25, "count"]) == "1.23 × 10^13T"
    assert page.evaluate(fmt, [2**80, "bytes"]) == "1.21 × 10^12 TB"
    # a ratio below 1 through the page: plain MHA made tiny against the K3 cache
    for sel, v in (("#kv-mha_layers", "1"), ("#kv-qk_head", "1"), ("#kv-v_head", "1")):
        page.fill(sel, v)
    page.fill("#kv-context", "1024")
    ratio = float(page.get_attribute("#kv-out-ratio", "data-value"))
    assert 0 < ratio < 1
    shown = page.inner_text("#kv-out-ratio")
    assert shown == f"{float(f'{ratio:.3g}')}×" and shown != "0×", shown


# -- 4. what calculators 2 and 3 follow, and the rounded 2.8T -------------------------------------
def test_calculators_2_and_3_say_they_use_k3_defaults_and_do(page: Any):
    for calc in ("weights", "a2a"):
        note = page.locator(f"#calc-{calc}-defaults")
        assert note.is_visible()
        assert "K3's published defaults" in note.inner_text()
        assert "does not follow edits in calculator 1" in note.inner_text()
    before = {s: page.input_value(s) for s in ("#weights-n_b", "#a2a-moe_layers", "#a2a-selected")}
    page.fill("#active-total_b", "2000")
    page.fill("#active-moe_layers", "60")
    page.fill("#active-selected", "8")
    assert {s: page.input_value(s) for s in before} == before  # true: they did not follow


def test_everything_else_says_the_total_is_rounded(page: Any):
    dt = page.locator("#calc-active dt", has=page.locator("#active-rest-rounding"))
    assert dt.count() == 1
    assert "N − P_routed" in dt.inner_text()
    note = page.inner_text("#active-rest-rounding")
    assert "2.8T" in note and "rounded" in note and "±50B" in note
