"""The audit matrix of Lesson 8.7 under hostile or careless use (issue 20, acceptance point 4).

- edit a row, delete it, then press the form's button: no false "Row saved."; the typed text is
  kept as a new row (the chosen behaviour), and the page says so;
- stored data that is malformed (a null field, a wrong type, garbage JSON) is reported on the
  page and skipped; the row count, Transfer and export keep working;
- exports are safe to open: CSV cells that begin with = + - @ tab or CR are neutralised (OWASP),
  Markdown escapes HTML and pipes;
- a 10k-character word and a 320-character URL wrap inside their cell, and Edit/Delete stay in view;
- after a delete, focus lands on the next row's Edit button (or the add-row form), not <body>.

Same harness as tests/test_lesson.py: the session build served with the production CSP, Debian's
chromium, and a recorder that fails the test on any console error, CSP violation or outside request.
"""

from __future__ import annotations

import csv
import io
import json
import tomllib
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
KEY = "k3.lesson-8.7.matrix.v1"
MATRIX = tomllib.loads((ROOT / "site_src" / "data" / "lesson_matrix.toml").read_text("utf-8"))
SEEDS = len(MATRIX["rows"])
ROWS = "#matrix-table tbody tr"


@pytest.fixture(scope="module")
def site(built_site: BuildRun) -> Iterator[str]:
    with serve_site(built_site.out) as base:
        yield base


@pytest.fixture
def open_lesson(browser: Any, site: str) -> Iterator[Any]:
    """open_lesson(stored=None, width=1280) -> page; `stored` is the raw localStorage text put
    there before the page's scripts run. Fails on any console error, page error, CSP violation
    or outside request."""
    opened: list[tuple[Any, Recorder]] = []

    def _open(stored: str | None = None, width: int = 1280) -> Any:
        context = browser.new_context(
            viewport={"width": width, "height": 900}, service_workers="block"
        )
        rec = Recorder(site)
        rec.attach(context)
        if stored is not None:
            context.add_init_script(
                f"try {{ if (location.pathname === {json.dumps(URL)}"
                f" && !sessionStorage.getItem('seeded')) {{"
                f" localStorage.setItem({json.dumps(KEY)}, {json.dumps(stored)});"
                f" sessionStorage.setItem('seeded', '1'); }} }} catch (e) {{}}"
            )
        page = context.new_page()
        page.goto(site + URL)
        opened.append((context, rec))
        return page

    yield _open
    problems = [p for _, rec in opened for p in rec.problems()]
    for context, _ in opened:
        context.close()
    assert not problems, "\n".join(problems)


def _stored_rows(page: Any) -> list[dict[str, Any]]:
    return json.loads(page.evaluate(f"() => localStorage.getItem({json.dumps(KEY)})"))["rows"]


def _fill(page: Any, claim: str, **fields: str) -> None:
    page.select_option("#mx-layer", "training")
    page.select_option("#mx-evidence", "independent")
    page.fill("#mx-claim", claim)
    for name, value in fields.items():
        page.fill(f"#mx-{name}", value)


def _row(claim: str, **over: Any) -> dict[str, Any]:
    base = {
        "id": f"mine-{abs(hash(claim)) % 10**8}",
        "origin": "mine",
        "model": "Kimi K3",
        "layer": "training",
        "claim": claim,
        "source": "my notes",
        "evidence": "independent",
        "boundary": "one benchmark",
        "dependency": "",
        "falsify": "a second benchmark",
        "innovation": "",
    }
    return {**base, **over}


# -- a false save ---------------------------------------------------------------------------------
def test_edit_then_delete_then_save_keeps_the_text_and_never_says_saved(open_lesson: Any):
    page = open_lesson()
    _fill(page, "a row I will edit")
    page.click("#mx-submit")
    row = page.locator(ROWS, has_text="a row I will edit")
    row.locator("button[data-act='edit']").click()
    typed = "my edited text, typed before the delete"
    page.fill("#mx-claim", typed)
    row.locator("button[data-act='delete']").click()
    # the page says at once that the row under edit is gone and the text is still in the form
    assert "You were editing it" in page.inner_text("#mx-msg")
    assert page.input_value("#mx-claim") == typed
    page.click("#mx-submit")
    said = page.inner_text("#mx-msg")
    assert "saved" not in said.lower(), said
    assert said.startswith("Row added"), said
    # the text is kept, as a new row, on the page and in storage, and survives a reload
    assert page.locator(ROWS, has_text=typed).count() == 1
    assert page.locator(ROWS, has_text="a row I will edit").count() == 0
    assert [r["claim"] for r in _stored_rows(page)].count(typed) == 1
    page.reload()
    assert page.locator(ROWS, has_text=typed).count() == 1
    assert page.locator(ROWS).count() == SEEDS + 1


def test_a_save_for_a_row_that_is_gone_adds_it_and_says_so(open_lesson: Any):
    """The same edit whose row vanished behind the form's back (the matrix was reset in the
    meantime): Save must not claim "Row saved." for a row that no longer exists."""
    page = open_lesson()
    first = MATRIX["rows"][0]["id"]
    page.click(f"#mrow-{first} button[data-act='edit']")
    page.fill("#mx-claim", "an edit of a row that is about to vanish")
    page.evaluate(  # the row leaves the matrix without the form being told
        "(id) => { const f = document.getElementById('matrix-form');"
        " f.elements.id.value = id + '-gone'; }",
        first,
    )
    page.click("#mx-submit")
    said = page.inner_text("#mx-msg")
    assert "Row saved" not in said and "added as a new row" in said, said
    assert page.locator(ROWS, has_text="an edit of a row that is about to vanish").count() == 1


# -- malformed stored data ------------------------------------------------------------------------
BAD_ROWS = [
    _row("a row with a null source", source=None),
    _row("a row whose layer is a number", layer=7),
    "not an object",
    _row("a row with no id", id=None),
]


@pytest.mark.parametrize(
    ("stored", "expect"),
    [
        pytest.param(
            json.dumps(
                {"version": 1, "rows": [_row("a good stored row"), *BAD_ROWS], "deleted": []}
            ),
            ["4 of 5 stored rows were skipped", 'field "source" is null', '"layer" is a number'],
            id="bad-rows",
        ),
        pytest.param(
            '{"version": 1, "rows": [{"id": "x", "claim": nul',
            ["not valid JSON"],
            id="garbage-json",
        ),
        pytest.param(json.dumps({"version": 1, "rows": "many"}), ["unknown format"], id="shape"),
    ],
)
def test_malformed_storage_is_reported_and_skipped_and_the_matrix_still_works(
    open_lesson: Any, stored: str, expect: list[str]
):
    page = open_lesson(stored)
    report = page.locator("#mx-load-msg")
    assert report.is_visible()
    for words in expect:
        assert words in report.inner_text(), (words, report.inner_text())

    good = 1 if "good stored row" in stored else 0
    total = SEEDS + good
    assert page.locator(ROWS).count() == total
    assert page.inner_text("#matrix-count").startswith(f"Showing {total} of {total} rows.")
    if good:
        assert page.locator(ROWS, has_text="a good stored row").count() == 1

    # Transfer still adds its rows, the count follows, and every export still works
    page.select_option("#tr-model", "k2")
    page.click("#tr-add")
    added = page.locator(f"{ROWS}[data-model='Kimi K2']").count()
    assert added > 0 and "rows added" in page.inner_text("#tr-msg")
    assert page.inner_text("#matrix-count").startswith(f"Showing {total + added} of")
    page.click("button[data-export='json']")
    assert len(json.loads(page.input_value("#mx-export-text"))["rows"]) == total + added
    page.click("button[data-export='csv']")
    assert len(list(csv.DictReader(io.StringIO(page.input_value("#mx-export-text"))))) == (
        total + added
    )
    with page.expect_download() as dl:
        page.click("#mx-download")
    assert dl.value.suggested_filename == "k3-audit-matrix.csv"

    # the change dropped the bad data from storage, and the report says so; a reload is clean
    assert "dropped" in report.inner_text() or "replaced" in report.inner_text()
    assert len(_stored_rows(page)) == total + added
    page.reload()
    assert page.locator("#mx-load-msg").is_hidden()
    assert page.locator(ROWS).count() == total + added


# -- exports are safe to open ---------------------------------------------------------------------
HOSTILE = ["=SUM(1,1)", "+1+1", "-2+3", "@SUM(1,1)", "\tTAB", "\rCR"]


def test_csv_export_neutralises_formulas_and_markdown_escapes_html(open_lesson: Any):
    rows = [_row(c, id=f"mine-h{i}") for i, c in enumerate(HOSTILE)]
    rows.append(_row("<img src=x onerror=alert(1)> | a pipe & more", id="mine-html"))
    page = open_lesson(json.dumps({"version": 1, "rows": rows, "deleted": []}))
    assert page.locator("#mx-load-msg").is_hidden()

    page.click("button[data-export='csv']")
    with page.expect_download() as dl:  # the file as saved: the textarea turns CR into LF
        page.click("#mx-download")
    text = Path(dl.value.path()).read_bytes().decode("utf-8")
    assert '"\'=SUM(1,1)"' in text  # prefixed with a single quote, and quoted
    claims = [r["claim"] for r in csv.DictReader(io.StringIO(text, newline=""))]
    for c in HOSTILE:
        assert f"'{c}" in claims, (c, claims)
    # no cell of any row begins with a character a spreadsheet reads as a formula
    for record in csv.reader(io.StringIO(text, newline="")):
        for cell in record:
            assert not cell or cell[0] not in "=+-@\t\r", record

    page.click("button[data-export='md']")
    md = page.input_value("#mx-export-text")
    line = next(ln for ln in md.splitlines() if "a pipe" in ln)
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt; \\| a pipe &amp; more" in line


# -- long text wraps; the controls stay in view ---------------------------------------------------
@pytest.mark.parametrize("width", [1280, 390])
def test_long_words_wrap_and_edit_delete_stay_visible(open_lesson: Any, width: int):
    word = "x" * 10_000
    url = "https://example.com/" + "a" * 300
    assert len(url) == 320
    rows = [_row(word, id="mine-word", source=url), _row(url, id="mine-url", boundary=word)]
    page = open_lesson(json.dumps({"version": 1, "rows": rows, "deleted": []}), width=width)
    wrap = page.locator("#matrix .table-wrap")
    view = page.viewport_size
    for rid in ("mine-word", "mine-url"):
        tr = page.locator(f"#mrow-{rid}")
        # scroll the page only: the controls must be in view without panning the table's box
        page.evaluate(
            "(id) => window.scrollTo(0, window.scrollY"
            " + document.getElementById(id).getBoundingClientRect().top - 100)",
            f"mrow-{rid}",
        )
        box = wrap.bounding_box()
        cell = tr.locator("td.actions").bounding_box()
        for act in ("edit", "delete"):
            button = tr.locator(f"button[data-act='{act}']")
            assert button.is_visible()
            b = button.bounding_box()
            # inside its cell, inside the scroll box's visible part, inside the viewport
            assert cell["x"] <= b["x"] and b["x"] + b["width"] <= cell["x"] + cell["width"]
            assert box["x"] <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"], (b, box)
            assert b["x"] >= 0 and b["x"] + b["width"] <= view["width"], (b, view)
            assert b["y"] >= 0 and b["y"] + b["height"] <= view["height"], (b, view)
        # the long text wraps inside its own cell instead of widening the table
        claim = tr.locator("td.c-claim").bounding_box()
        text = tr.locator("td.c-claim [data-f='claim']").bounding_box()
        assert text["x"] + text["width"] <= claim["x"] + claim["width"] + 0.5
        assert claim["width"] <= 28 * 16 + 0.5, claim  # its max-width: 28rem
    # the table fits its box: nothing to pan to (at 390 px each row is a card)
    table = page.locator("#matrix-table").bounding_box()
    assert table["width"] <= box["width"] + 0.5, (table, box)
    # and the buttons work: Delete removes the 10k-word row
    page.click("#mrow-mine-word button[data-act='delete']")
    assert page.locator("#mrow-mine-word").count() == 0


# -- focus after a delete -------------------------------------------------------------------------
def _focused(page: Any) -> dict[str, Any]:
    return page.evaluate(
        "() => { const a = document.activeElement; return {tag: a.tagName, id: a.id,"
        " act: a.dataset ? a.dataset.act || '' : '', row: a.dataset ? a.dataset.id || '' : ''}; }"
    )


def test_focus_moves_to_a_sensible_control_after_a_delete(open_lesson: Any):
    page = open_lesson()
    ids = [r["id"] for r in MATRIX["rows"]]
    page.focus(f"#mrow-{ids[0]} button[data-act='delete']")
    page.keyboard.press("Enter")  # from the keyboard, as a keyboard user deletes
    assert page.locator(f"#mrow-{ids[0]}").count() == 0
    assert _focused(page) == {"tag": "BUTTON", "id": "", "act": "edit", "row": ids[1]}

    # the last row: focus goes back to the row before it
    page.click(f"#mrow-{ids[-1]} button[data-act='delete']")
    assert _focused(page) == {"tag": "BUTTON", "id": "", "act": "edit", "row": ids[-2]}

    # the only row left in view: focus goes to the add-row form
    page.fill("#mf-text", MATRIX["rows"][2]["claim"])
    assert page.locator(ROWS).count() == 1
    page.click(f"{ROWS} button[data-act='delete']")
    assert page.locator(ROWS).count() == 0
    assert _focused(page)["id"] == "mx-claim"
