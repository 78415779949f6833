"""The published site in headless Chromium over real HTTPS (issue 5, acceptance 7).

The session build (conftest.built_site) is served by `python -m serve` itself: TLS 1.3 with the
local CA, the production headers and CSP. Chromium (Debian's, through Playwright) loads the index
and a gate page, sees no console error, no page error, no CSP violation and no request to another
host, and saves a screenshot of each. The browser is told to trust the local CA's leaf by
`ignore_https_errors` (the chain itself is verified by openssl in test_serve_certs.py).
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


@pytest.fixture(scope="module")
def server(built_site: BuildRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("serve-state")
    with running_server(built_site.out, state) as s:
        yield s


def _visit(browser: Any, base: str, path: str, shot: Path) -> tuple[Any, list[str], int]:
    context = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 900})
    rec = Recorder(base)
    rec.attach(context)
    page = context.new_page()
    response = page.goto(base + path, wait_until="load")
    status = response.status if response else 0
    title = page.title()
    page.screenshot(path=str(shot), full_page=True)
    problems = rec.problems()
    context.close()
    return title, problems, status


@pytest.mark.parametrize("which", ["index", "gate"])
def test_index_and_a_gate_page_load_cleanly_over_https(
    which: str,
    server: Server,
    built_site: BuildRun,
    browser: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    census = built_site.census
    path = "/" if which == "index" else f"/gates/{census['gates'][0]['id']}/"
    base = f"https://localhost:{server.port}"
    shot = tmp_path_factory.mktemp("site-screenshots") / f"{which}.png"
    title, problems, status = _visit(browser, base, path, shot)
    print(f"\nscreenshot of {path}: {shot}")
    assert status == 200
    assert not problems, "\n".join(problems)
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    if which == "index":
        assert "coverage" in title.lower() or "k3" in title.lower(), title
    else:
        assert census["gates"][0]["id"] in title, title


def test_the_kda_page_lays_its_equations_out_as_mathml(
    server: Server, browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 18, acceptance 2: Chromium typesets the build-time MathML, with no script."""
    base = f"https://localhost:{server.port}"
    context = browser.new_context(ignore_https_errors=True, viewport={"width": 1280, "height": 900})
    rec = Recorder(base)
    rec.attach(context)
    page = context.new_page()
    page.goto(base + "/innovations/kda/", wait_until="load")
    equation = page.locator("math[display=block]").first
    shot = tmp_path_factory.mktemp("math-screenshots") / "kda-equation.png"
    equation.screenshot(path=str(shot))
    print(f"\nscreenshot of the KDA recurrence: {shot}")
    # S_{t-1}: laid out as MathML, the subscript sits lower and is set smaller than its base
    sub = equation.locator("msub").filter(has_text="S").last
    base_box = sub.locator(":scope > mi").first.bounding_box()
    script_box = sub.locator(":scope > :nth-child(2)").bounding_box()
    problems = rec.problems()
    context.close()
    assert base_box and script_box
    assert script_box["y"] + script_box["height"] > base_box["y"] + base_box["height"]
    assert script_box["height"] < base_box["height"]
    assert not problems, "\n".join(problems)
