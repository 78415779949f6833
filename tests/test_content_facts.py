"""Issue 20, "Wrong on the page": the content says what its sources say, labelled by class.

1. A body line that markdown would read as block syntax inside a running paragraph is a build
   error naming file and line; the latentmoe equation keeps `+ Shared(x)` in one element, in the
   built HTML and in Chromium at 1280 and 390 px wide.
2. Every fact in site_src/data carries an evidence class and its sources, and the class agrees
   with the sources' kinds: a summary, port, paper or article is never *official*, and a K3 fact
   is official only when every source is Moonshot AI's own release.
3. The multimodal page describes the encoder per public ports and claims only what its gates run.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import ROOT, BuildRun, build_module
from lesson_support import Recorder, serve_site

DATA = ROOT / "site_src" / "data"
INNOVATIONS = ROOT / "site_src" / "innovations"
# the equation with its last term, now display math on its own lines
EQUATION_NEW = (
    "\n$$\ny = W_{up}\\, \\operatorname{RMSNorm}\\Big(\\sum_e w_e\\, E_e(W_{down}\\, x)\\Big) "
    "+ \\operatorname{Shared}(x), \\qquad E(z) = w_2\\, \\text{SiTU-GLU}(w_1 z,\\, w_3 z)\n$$\n"
)


def _toml(name: str) -> dict[str, Any]:
    return tomllib.loads((DATA / f"{name}.toml").read_text(encoding="utf-8"))


def _data() -> dict[str, dict[str, Any]]:
    return {n: _toml(n) for n in ("lesson_facts", "lesson_matrix", "lesson_predict")}


# -- 1. the build-time check on block syntax inside a paragraph --------------------------------
def _old_latentmoe(tmp: Path) -> tuple[Path, int]:
    """latentmoe.md as it was: the equation's `+ Shared(x)` opening a line. Returns the file and
    that line's number."""
    text = (INNOVATIONS / "latentmoe.md").read_text(encoding="utf-8")
    assert EQUATION_NEW in text
    old = text.replace(
        "7168:\n" + EQUATION_NEW + "\nSelection",
        "7168: y = W_up(RMSNorm(Σ_e w_e E_e(W_down x)))\n"
        "+ Shared(x), with each expert E(z) = w2·SiTU-GLU(w1·z, w3·z). Selection",
    )
    assert old != text
    path = tmp / "latentmoe.md"
    path.write_text(old, encoding="utf-8")
    line = next(n for n, s in enumerate(old.splitlines(), 1) if s.startswith("+ Shared(x)"))
    return path, line


def test_the_old_latentmoe_line_is_a_build_error_with_file_and_line(tmp_path: Path):
    b = build_module()
    path, line = _old_latentmoe(tmp_path)
    with pytest.raises(b.BuildError) as e:
        b.read_page(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}: this line starts with '+'"), msg
    assert "list item" in msg and "move the symbol to the end of the previous line" in msg
    b.read_page(INNOVATIONS / "latentmoe.md")  # the fixed page reads


PAGE = "+++\nid = 'x'\n+++\n"


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("- b = c", "a list item"),
        ("* b = c", "a list item"),
        ("  + b = c", "a list item"),
        ("> b", "a block quote"),
        ("# b", "a heading"),
        ("===", "a heading underline"),
        ("---", "a heading underline"),
        ("1. b", "an ordered-list item"),
        ("2) b", "an ordered-list item"),
    ],
)
def test_each_paragraph_splitter_is_caught(tmp_path: Path, line: str, what: str):
    b = build_module()
    path = tmp_path / "p.md"
    path.write_text(PAGE + "a = b\n" + line + "\n", encoding="utf-8")
    with pytest.raises(b.BuildError, match=re.escape(f"{path}:5: ") + ".*" + what):
        b.read_page(path)


@pytest.mark.parametrize(
    "body",
    [
        "a = b\n\n- item\n",  # a list after a blank line
        "The list:\n- one\n- two\n  still two\n- three\n",  # a list a sentence introduces
        "**What is implemented.**\n- one\n",  # a list under a bold label line
        "```\na = b\n+ c\n```\n",  # fenced code
        "- one\n  more\n- two\n\n  para of two\n- three\n",  # list continuations
        "| a | b |\n|---|---|\n| 1 | 2 |\n",  # a table
        "# Heading\ntext\n",  # a heading, then a paragraph
        "a = b +\nc, and 2.5 more\n",  # an operator moved to the end of the line
    ],
)
def test_ordinary_markdown_is_not_flagged(tmp_path: Path, body: str):
    b = build_module()
    path = tmp_path / "p.md"
    path.write_text(PAGE + body, encoding="utf-8")
    b.read_page(path)


class _Elements(HTMLParser):
    """(tag, text) of every element, in the order they close: innermost first."""

    VOID: ClassVar[set[str]] = {
        "br",
        "img",
        "hr",
        "meta",
        "link",
        "input",
        "wbr",
        "source",
        "col",
        "area",
    }

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, list[str]]] = []
        self.closed: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag not in self.VOID:
            self.stack.append((tag, []))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            t, parts = self.stack.pop()
            text = "".join(parts)
            self.closed.append((t, text))
            if self.stack:
                self.stack[-1][1].append(text)
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.stack:
            self.stack[-1][1].append(data)


def _innermost_with(html: str, needle: str) -> tuple[str, str]:
    p = _Elements()
    p.feed(html)
    hits = [(t, s) for t, s in p.closed if needle in s]
    assert hits, f"{needle!r} is not on the page"
    return hits[0]  # elements close innermost first


def test_built_latentmoe_keeps_shared_x_with_w_up(built_site: BuildRun):
    html = (built_site.out / "innovations" / "latentmoe" / "index.html").read_text()
    tag, text = _innermost_with(html, "RMSNorm")
    assert tag in {"mo", "mi", "mrow", "math"}, (tag, text)  # typeset as MathML
    equation = [m for m in re.findall(r"<math\b.*?</math>", html, flags=re.S) if "RMSNorm" in m]
    assert len(equation) == 1
    text = unescape(re.sub(r"<[^>]+>", "", equation[0]))
    assert re.search(r"^y=WupRMSNorm\(.*\)\+Shared\(x\),", text), text
    assert not re.search(r"<li>\s*Shared\(x\)", html)


playwright_sync = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def site(built_site: BuildRun) -> Iterator[str]:
    with serve_site(built_site.out) as base:
        yield base


@pytest.mark.browser
@pytest.mark.parametrize("width", [1280, 390])
def test_latentmoe_equation_is_one_element_in_chromium(browser: Any, site: str, width: int):
    context = browser.new_context(viewport={"width": width, "height": 900})
    rec = Recorder(site)
    rec.attach(context)
    page = context.new_page()
    page.goto(site + "/innovations/latentmoe/")
    eq = page.locator("main math", has_text="RMSNorm")
    assert eq.count() == 1
    text = re.sub(r"\s+", "", eq.first.text_content() or "")
    assert text.startswith("y=WupRMSNorm(") and "+Shared(x)" in text, text
    box = eq.first.bounding_box()
    assert box and box["width"] > 100  # laid out as one equation, not lost in a list
    assert page.locator("main li", has_text=re.compile(r"^\s*Shared\(x\)")).count() == 0
    problems = rec.problems()
    context.close()
    assert not problems, "\n".join(problems)


# -- 2. evidence classes --------------------------------------------------------------------------
# which classes a source of each kind allows a fact to carry
ALLOWED = {
    "official": {"official"},
    "summary": {"third-party"},
    "port": {"third-party"},
    "article": {"third-party"},
    "paper": {"third-party"},
    "independent": {"independent"},
    "measured": {"gate"},
    "derived": {"assumption"},
    "none": {"unknown"},
}
NOT_FACTS = {"name", "source", "vendor"}  # the [k3] table's labels, not figures


def _facts(data: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, str, Any, Any]]:
    """(where, vendor the fact is about, shown text, class, cites) of every fact in the data."""
    facts, matrix, predict = data["lesson_facts"], data["lesson_matrix"], data["lesson_predict"]
    k3, ev = facts["k3"], facts.get("k3_evidence", {})
    moonshot = k3.get("vendor", "Moonshot AI")
    for key in k3:
        if key not in NOT_FACTS:
            e = ev.get(key, {})
            yield f"lesson_facts k3.{key}", moonshot, str(k3[key]), e.get("class"), e.get("cites")
    for iid, c in facts.get("claims", {}).items():
        yield (
            f"lesson_facts claims.{iid}",
            moonshot,
            c.get("text", ""),
            c.get("class"),
            c.get("cites"),
        )
    vendors = {"k2": "Moonshot AI", "v3": "DeepSeek"}
    models = facts["models"]
    for t in facts["transfer"]:
        where = f"lesson_facts transfer {t['field']!r}"
        yield f"{where} k3", moonshot, t["k3"], t.get("k3_class"), t.get("k3_cites")
        for col in ("k2", "v3"):
            cls = t.get(f"{col}_class", models.get(f"{col}_class"))
            cites = t.get(f"{col}_cites", models.get(f"{col}_cites"))
            yield f"{where} {col}", vendors[col], t[col], cls, cites
    for r in matrix["rows"]:
        yield (
            f"lesson_matrix row {r['id']}",
            moonshot,
            r.get("source", ""),
            r.get("evidence"),
            r.get("cites"),
        )
    for p in predict["prompts"]:
        yield f"lesson_predict {p['id']}", moonshot, p["figure"], p.get("class"), p.get("cites")


def fact_problems(data: dict[str, dict[str, Any]]) -> list[str]:
    """Every way a fact's class and sources disagree; empty when the data is consistent."""
    sources = data["lesson_facts"].get("sources", {})
    classes = {c["key"] for c in data["lesson_matrix"]["classes"]}
    out: list[str] = []
    for sid, s in sources.items():
        if s.get("kind") not in ALLOWED or not s.get("title"):
            out.append(f"source {sid}: needs a title and a kind of {sorted(ALLOWED)}")
        if s.get("kind") == "official" and not s.get("vendor"):
            out.append(f"source {sid}: an official source names its vendor")
    for where, vendor, text, cls, cites in _facts(data):
        if cls not in classes:
            out.append(f"{where}: class {cls!r} is not one of {sorted(classes)}")
            continue
        if not cites:
            out.append(f"{where}: no source")
            continue
        missing = [c for c in cites if c not in sources]
        if missing:
            out.append(f"{where}: cites unknown sources {missing}")
            continue
        kinds = [sources[c]["kind"] for c in cites]
        if not any(cls in ALLOWED.get(k, set()) for k in kinds):
            out.append(f"{where}: class {cls!r} contradicts its sources' kinds {kinds}")
        if cls == "official":
            not_own = [c for c in cites if sources[c].get("vendor") != vendor]
            if not_own or set(kinds) != {"official"}:
                out.append(
                    f"{where}: official, but {not_own or cites} is not {vendor}'s own release"
                )
        said_official = re.search(r"\bofficial\b", text, re.IGNORECASE)
        if where.startswith("lesson_matrix") and bool(said_official) != (cls == "official"):
            out.append(f"{where}: its shown source {text!r} and its class {cls!r} disagree")
    return out


def test_every_fact_has_a_source_and_a_consistent_class():
    assert fact_problems(_data()) == []


def test_every_canonical_innovation_has_a_classed_public_claim():
    ids = {
        tomllib.loads(p.read_text(encoding="utf-8").split("+++")[1])["id"]
        for p in INNOVATIONS.glob("*.md")
    }
    assert set(_toml("lesson_facts")["claims"]) == ids


def _row(data: dict[str, Any], rid: str) -> dict[str, Any]:
    return next(r for r in data["lesson_matrix"]["rows"] if r["id"] == rid)


@pytest.mark.parametrize(
    ("mislabel", "expect"),
    [
        # the SiTU-GLU row as it was: a public summary tagged official
        (
            lambda d: _row(d, "arch-situ").update(
                evidence="official",
                source="public summaries of the K3 report (official claim, second hand)",
            ),
            "lesson_matrix row arch-situ: class 'official' contradicts",
        ),
        # a port's figure sold as an official claim
        (
            lambda d: d["lesson_facts"]["k3_evidence"]["latent"].update({"class": "official"}),
            "lesson_facts k3.latent: class 'official' contradicts",
        ),
        # official only if every source is official
        (
            lambda d: d["lesson_facts"]["claims"]["situ"].update(
                {"class": "official", "cites": ["k3_card", "k3_summary"]}
            ),
            "lesson_facts claims.situ: official, but",
        ),
        # another vendor's release is not Moonshot's
        (
            lambda d: d["lesson_facts"]["claims"]["kda"].update(
                {"class": "official", "cites": ["v3_release"]}
            ),
            "lesson_facts claims.kda: official, but ['v3_release'] is not Moonshot AI's",
        ),
        (lambda d: _row(d, "eval-vendor").pop("cites"), "lesson_matrix row eval-vendor: no source"),
        (
            lambda d: d["lesson_facts"]["k3_evidence"].pop("hidden"),
            "lesson_facts k3.hidden: class None",
        ),
        (
            lambda d: d["lesson_predict"]["prompts"][0].update(cites=["nowhere"]),
            "lesson_predict total: cites unknown sources",
        ),
        (
            lambda d: _row(d, "train-qb").update(source="Moonshot release notes (official)"),
            "lesson_matrix row train-qb: its shown source",
        ),
    ],
)
def test_the_checker_fails_on_a_mislabelled_fact(mislabel: Any, expect: str):
    data = copy.deepcopy(_data())
    mislabel(data)
    problems = fact_problems(data)
    assert any(p.startswith(expect) for p in problems), problems


def test_no_claim_cites_what_no_source_contains():
    rows = {r["id"]: r for r in _toml("lesson_matrix")["rows"]}
    assert rows["eval-vendor"]["evidence"] == "unknown"
    assert "BF16-level" not in rows["train-qat"]["claim"]
    assert rows["train-qat"]["evidence"] != "official"
    for r in rows.values():
        assert "release notes" not in r["source"] and "release post" not in r["source"]
        assert "release config" not in r["source"]


def test_lesson_pages_show_each_class_and_source(built_site: BuildRun):
    html = (built_site.out / "lesson" / "8.7" / "index.html").read_text()
    assert "three trillion" not in html
    first = re.search(r'<section id="intro".*?<p>(.*?)</p>', html, re.S)
    assert first and "2.8T" in first.group(1) and "official claim" in first.group(1)
    for iid in ("situ", "latentmoe"):
        tr = re.search(rf'<tr id="verify-{iid}".*?</tr>', html, re.S)
        assert tr, iid
        cell = re.search(r'<td class="v-public">(.*?)</td>', tr.group(0), re.S)
        assert cell and "tag-third-party" in cell.group(1), iid
        assert "tag-official" not in cell.group(1) and "public summaries" in cell.group(1)
    for rid in ("arch-situ", "train-qb"):
        tr = re.search(rf'<tr id="mrow-{rid}".*?</tr>', html, re.S)
        assert tr and 'data-evidence="third-party"' in tr.group(0), rid
        assert "tag-official" not in tr.group(0)


# -- 3. the multimodal page -----------------------------------------------------------------------
def test_multimodal_page_is_per_public_ports_and_claims_what_its_gates_run(built_site: BuildRun):
    """The tower's figures are per public ports; what the page claims as measured is the input
    side, one block with the merger and the projector, their gradients, all at K3's width with
    random weights, and a toy vision-language model trained in integers (the PROVEN gate), which
    the vision_input, vision_block, vision_backward and vlm_training gates run in this build."""
    text = (INNOVATIONS / "multimodal.md").read_text(encoding="utf-8")
    meta = tomllib.loads(text.split("+++")[1])
    assert meta["claim"] == "PROVEN"
    body = text.split("+++")[2]
    assert "not public" not in body
    assert "per public ports" in body
    for figure in ("14", "27 ", "1024", "1536", "4096", "7168", "64×64", "2×2", "0.4B"):
        assert figure in body, figure
    for word in ("NeMo Automodel", "ferrox-models", "GELU", "RMSNorm", "RoPE", "bidirectional",
                 "scikit-learn", "BSD-3", "four times larger", "not trained"):  # fmt: skip
        assert word in body, word
    assert "Only one block runs at K3's width, not the stack of 27" in body
    assert "Nothing here is trained at K3's size." in body
    assert "seeded random values, not K3's" in body
    row = next(r for r in built_site.census["innovations"] if r["id"] == "multimodal")
    gates = {g["id"]: g for g in built_site.census["gates"]}
    assert gates["vision_input"]["level"] == "PARTIAL" and gates["vision_block"]["level"] == "HAVE"
    assert gates["vision_backward"]["level"] == "STRONG" and gates["vision_backward"]["passed"]
    assert gates["vlm_training"]["level"] == "PROVEN"
    assert gates["vlm_training"]["passed"] and row["level"] == "PROVEN", row
    assert row["claim"] == "PROVEN" and not row["killed"], row
    html = (built_site.out / "innovations" / "multimodal" / "index.html").read_text()
    assert "per public ports" in html and "not public" not in html
    assert all(g in html for g in ("vision_input", "vision_block", "vision_backward",
                                   "vlm_training"))  # fmt: skip


def test_calculator_inputs_carry_the_class_of_the_k3_figure_they_default_to(built_site):
    """A calculator input seeded with a K3 figure shows that figure's class, never a stronger
    one (the dimensions are per public ports, so their inputs are not tagged official)."""
    facts = tomllib.loads((ROOT / "site_src" / "data" / "lesson_facts.toml").read_text())
    evidence = facts["k3_evidence"]
    html = (built_site.out / "lesson" / "8.7" / "index.html").read_text()
    seeded = {"active-routed": "routed", "active-latent": "latent", "kv-heads": "heads",
              "kv-kv_lora": "kv_lora", "a2a-width": "latent", "weights-n_b": "total_b"}  # fmt: skip
    for input_id, key in seeded.items():
        label = re.search(rf'<label for="{input_id}">(.*?)</label>', html, re.S)
        assert label, input_id
        tag = re.search(r'class="tag tag-([\w-]+)"', label.group(1))
        assert tag and tag.group(1) == evidence[key]["class"], (input_id, tag and tag.group(1))
