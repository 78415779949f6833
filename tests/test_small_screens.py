"""Issue 20, acceptance 1 and 5: the site at 390 px, and no console error on any page.

Served by `python -m serve` over HTTPS with the production headers and CSP, in Debian chromium.
- No element of the index or the lesson extends past a 390 px viewport (a scroll box, which
  scrolls inside the page, may hold wider content; the page itself never scrolls sideways).
- The census at 390 px shows every row's level and evidence inside the viewport.
- Every HTML page of the site, the first visit included, loads with no console error, no page
  error and no CSP violation (the favicon is served, so no 404 is logged).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BuildRun
from lesson_support import CHROMIUM, Recorder
from serve_support import Server, running_server

playwright_sync = pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed"),
]
NARROW = {"width": 390, "height": 844}

# Elements wider than the viewport that are not inside a horizontal scroll box.
OVERFLOW = """() => {
  const w = document.documentElement.clientWidth;
  const inScrollBox = (el) => {
    for (let p = el.parentElement; p; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX;
      if ((o === 'auto' || o === 'scroll') && p !== document.documentElement) return true;
    }
    return false;
  };
  const bad = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    if (r.right > w + 1 && r.left >= 0 && !inScrollBox(el)) {
      bad.push(`${el.tagName.toLowerCase()}.${el.className} right=${Math.round(r.right)}`);
    }
  }
  return {bad: bad.slice(0, 10), scrollWidth: document.documentElement.scrollWidth, width: w};
}"""


@pytest.fixture(scope="module")
def server(built_site: BuildRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(built_site.out, tmp_path_factory.mktemp("serve-state")) as s:
        yield s


def _page(browser: Any, server: Server, path: str, viewport: dict) -> tuple[Any, Any, Recorder]:
    base = f"https://localhost:{server.port}"
    context = browser.new_context(ignore_https_errors=True, viewport=viewport)
    rec = Recorder(base)
    rec.attach(context)
    page = context.new_page()
    page.goto(base + path, wait_until="load")
    return context, page, rec


@pytest.mark.parametrize("path", ["/", "/lesson/8.7/"])
def test_nothing_extends_past_a_390px_viewport(browser, server, path):
    context, page, _ = _page(browser, server, path, NARROW)
    try:
        found = page.evaluate(OVERFLOW)
    finally:
        context.close()
    assert found["scrollWidth"] <= found["width"], found
    assert not found["bad"], found


def test_the_census_shows_level_and_evidence_of_every_row_at_390px(browser, server, built_site):
    context, page, _ = _page(browser, server, "/", NARROW)
    try:
        for row in built_site.census["innovations"]:
            for cell in ("td[data-label='Level']", "td.evidence"):
                box = page.locator(f"#row-{row['id']} {cell}").bounding_box()
                assert box and box["x"] >= 0 and box["x"] + box["width"] <= NARROW["width"] + 1, (
                    row["id"],
                    cell,
                    box,
                )
    finally:
        context.close()


def test_no_page_logs_a_console_error_on_a_first_visit(browser, server, built_site):
    site = built_site.out.resolve()
    folders = sorted(f.relative_to(site).parent.as_posix() for f in site.rglob("index.html"))
    paths = ["/" if d == "." else f"/{d}/" for d in folders]
    assert len(paths) > 40
    problems = {}
    for path in paths:
        context, page, rec = _page(browser, server, path, {"width": 1280, "height": 900})
        page.wait_for_timeout(50)
        context.close()
        if rec.problems():
            problems[path] = rec.problems()
    assert not problems
