"""Prose claims backed by checks (DESIGN.md, "Claims and liar-kill"; issue 13, acceptance 10).

Each innovation page lists its sentences about measured properties as `[[facts]]`, each naming the
`gate_id/check_name` that backs it. A fact whose check is missing from the build, or failed, is
struck through on the page with the reason, and census.json carries every fact's verdict.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
from conftest import ROOT, BuildRun
from markupsafe import escape


@pytest.fixture
def build_py(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    """build.py as a module, its Jinja bytecode cache kept private to the test."""
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("k3_build_for_claims", ROOT / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _esc(text: str) -> str:
    """As the templates escape it (Jinja's autoescape)."""
    return str(escape(text))


def _content_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "site_src"
    shutil.copytree(ROOT / "site_src", dst)
    return dst


def _replace(path: Path, old: str, new: str) -> None:
    """Replace the one occurrence of `old`; a no-op edit would hide the test."""
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path.name}: {old!r} occurs {text.count(old)} times"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _facts_section(page: str) -> str:
    m = re.search(r'<section aria-labelledby="facts-h">.*?</section>', page, re.S)
    assert m, "the page has no 'What the gates back' section"
    return m.group(0)


def _fact_item(page: str, text: str) -> str:
    """The <li> of the fact whose sentence is `text`."""
    for item in re.findall(r'<li id="fact-\d+">.*?</li>', _facts_section(page), re.S):
        if _esc(text) in item:
            return item
    raise AssertionError(f"no fact item shows {text!r}")


# -- (a) the real content: every fact names a check that exists and passes -----------------------
def test_every_fact_in_the_content_is_backed_by_a_passing_check(
    built_site: BuildRun, build_py: ModuleType
):
    content = build_py.load_content(ROOT / "site_src")
    census = built_site.census
    gates = {g["id"]: g for g in census["gates"]}
    unbacked = []
    for row in census["innovations"]:
        facts = content.facts[row["id"]]
        assert [f["check"] for f in row["facts"]] == [f.ref for f in facts], row["id"]
        if row["gates_total"]:
            assert len(facts) >= 2, f"{row['id']}: a page with gates lists at least two facts"
        else:
            assert facts == [], f"{row['id']}: no gate, so the page may assert nothing measured"
        for f, verdict in zip(facts, row["facts"], strict=True):
            checks = {c["name"]: c for c in (gates.get(f.gate) or {}).get("checks") or []}
            passed = f.check in checks and checks[f.check]["passed"]
            assert verdict["backed"] == passed and (verdict["reason"] == "") == passed, verdict
            if not passed:
                unbacked.append(f"{row['id']}.md:{f.line}: {f.ref}: {verdict['reason']}")
    assert not unbacked, "facts without a passing check:\n" + "\n".join(unbacked)


def test_each_fact_links_to_its_check_row_on_the_gate_page(built_site: BuildRun):
    for row in built_site.census["innovations"]:
        page = (built_site.out / "innovations" / row["id"] / "index.html").read_text()
        section = _facts_section(page)
        assert "<s>" not in section, f"{row['id']}: a fact of the real content is struck through"
        for f in row["facts"]:
            gate, _ = f["check"].split("/", 1)
            item = _fact_item(page, f["text"])
            href = re.search(rf'href="/gates/{gate}/#([^"]+)"', item)
            assert href, f"{row['id']}: {f['check']} does not link to its check's anchor"
            target = (built_site.out / "gates" / gate / "index.html").read_text()
            assert f'id="{href.group(1)}"' in target, f"no anchor #{href.group(1)} on {gate}"
            assert "passes" in item


# -- (b) acceptance 10: removing the check that backs a claim strikes the claim through ----------
OVERWRITE = "kda_recurrent/overwrite_exact"
# multimodal.md's front matter from [next] on, and the same without its [[facts]] tables: a
# top-level `facts = ...` key can only be written where no [[facts]] table follows
_MM = (ROOT / "site_src" / "innovations" / "multimodal.md").read_text(encoding="utf-8")
MM_TAIL = _MM[_MM.index("[next]") : _MM.index("+++", 3)]
MM_NEXT = MM_TAIL[: MM_TAIL.index("[[facts]]")]
ABSORBED = "mla_forward/naive_equals_absorbed"


def _fact_text(content: Any, inno: str, ref: str) -> str:
    return next(f.text for f in content.facts[inno] if f.ref == ref)


def test_a_fact_naming_a_check_absent_from_the_build_is_struck_through(
    built_site: BuildRun, build, build_py: ModuleType, tmp_path: Path
):
    """A copy of the content points one fact at a check its gate lacks and one at a gate that
    does not exist: the build succeeds, and both are struck through with the reason."""
    content = _content_copy(tmp_path)
    _replace(content / "innovations" / "kda.md", OVERWRITE, "kda_recurrent/no_such_check")
    _replace(content / "innovations" / "gatedmla.md", ABSORBED, "mla_gone/naive_equals_absorbed")
    run = build(tmp_path / "public", "--content", str(content))
    assert run.returncode == 0, run.stderr
    schema = json.loads((ROOT / "site_src" / "census.schema.json").read_text())
    jsonschema.validate(run.census, schema)

    real = build_py.load_content(ROOT / "site_src")
    rows = {r["id"]: r for r in run.census["innovations"]}
    cases = [
        (
            "kda",
            _fact_text(real, "kda", OVERWRITE),
            "kda_recurrent/no_such_check",
            "check kda_recurrent/no_such_check does not exist in this build",
            'href="/gates/kda_recurrent/"',  # the gate page exists, the check's anchor does not
        ),
        (
            "gatedmla",
            _fact_text(real, "gatedmla", ABSORBED),
            "mla_gone/naive_equals_absorbed",
            "gate mla_gone did not run in this build",
            None,  # no gate page to link to
        ),
    ]
    for inno, text, ref, reason, link in cases:
        struck = [f for f in rows[inno]["facts"] if not f["backed"]]
        assert struck == [{"text": text, "check": ref, "backed": False, "reason": reason}]
        page = (run.out / "innovations" / inno / "index.html").read_text()
        item = _fact_item(page, text)
        assert f"<s>{_esc(text)}</s>" in item
        assert _esc(reason) in item
        if link:
            assert link in item
        else:
            assert "<a " not in item
        assert sum(1 for f in rows[inno]["facts"] if f["backed"]) == len(rows[inno]["facts"]) - 1


@pytest.mark.parametrize("how", ["failed", "removed"])
def test_a_fact_whose_check_failed_or_vanished_is_struck_through(
    built_site: BuildRun, build_py: ModuleType, tmp_path: Path, how: str
):
    """Render the real content from this build's gate results with the check that backs the
    exact-overwrite sentence failed, or taken out of its gate: the sentence is struck through
    on the page with the reason, and census.json records why."""
    results = copy.deepcopy(built_site.census["gates"])
    gate = next(g for g in results if g["id"] == "kda_recurrent")
    check = next(c for c in gate["checks"] if c["name"] == "overwrite_exact")
    if how == "failed":
        check.update(passed=False, message="S^T k differs from v at step 3 (planted)")
        reason = "check kda_recurrent/overwrite_exact failed: S^T k differs from v at step 3"
    else:
        gate["checks"].remove(check)
        reason = "check kda_recurrent/overwrite_exact does not exist in this build"
    gate.update(passed=False, status="failed")

    content = build_py.load_content(ROOT / "site_src")
    census = build_py.build_census(results, content, [])
    stage = tmp_path / "stage"
    stage.mkdir()
    build_py._render_into(stage, build_py.Settings(out=tmp_path / "public"), content, census)

    text = _fact_text(content, "kda", OVERWRITE)
    kda = next(r for r in census["innovations"] if r["id"] == "kda")
    verdicts = {f["check"]: f for f in kda["facts"]}
    assert not verdicts[OVERWRITE]["backed"]
    assert verdicts[OVERWRITE]["reason"].startswith(reason)
    assert all(f["backed"] for ref, f in verdicts.items() if ref != OVERWRITE)
    item = _fact_item((stage / "innovations" / "kda" / "index.html").read_text(), text)
    assert f"<s>{_esc(text)}</s>" in item
    assert _esc(reason) in item
    written = json.loads((stage / "census.json").read_text())
    assert next(r for r in written["innovations"] if r["id"] == "kda")["facts"] == kda["facts"]


# -- (c) malformed facts fail the build at load, naming the file, the line and the field ----------
FIRST_FACT = "[[facts]]"
MALFORMED = [
    # (page, old, new, what the named line holds, its occurrence, the message after `file:line: `)
    ("kda.md", 'check = "kda_gate_decay/gate_bounded"\n', "", FIRST_FACT, 1,
     "fact 1: no `check` field"),
    ("kda.md", 'text = "The integer decay α = exp(g) never increases as g decreases: no rounding '
     'inversion."\n', "", FIRST_FACT, 2, "fact 2: no `text` field"),
    ("kda.md", f'check = "{OVERWRITE}"', "check = 7", "check = 7", 1,
     "fact 4: `check` must be a non-empty string, got int"),
    ("situ.md", "text = \"Integer gradient descent brings the network's MSE below the declared "
     'threshold."', 'text = "  "', 'text = "  "', 1,
     "fact 9: `text` must be a non-empty string, got '  '"),
    ("kda.md", f'check = "{OVERWRITE}"', 'check = "overwrite_exact"', 'check = "overwrite_exact"',
     1, "fact 4: `check` must name gate_id/check_name, got 'overwrite_exact'"),
    ("mxfp.md", 'check = "mxfp_decode/e8m0_scales"',
     'check = "mxfp_decode/e8m0_scales"\nchek = "mxfp_decode/e2m1_codes"', "chek =", 1,
     "fact 11: unknown field `chek`; a fact has only `text` and `check`"),
    ("multimodal.md", MM_TAIL, 'facts = "kda_recurrent/overwrite_exact"\n' + MM_NEXT, "facts =", 1,
     "`facts` must be an array of tables ([[facts]] with text and check), got str"),
    ("multimodal.md", MM_TAIL, 'facts = ["kda_recurrent/overwrite_exact"]\n' + MM_NEXT, "facts =",
     1,
     "fact 1: must be a table with `text` and `check`, got str"),
]  # fmt: skip


def _line_of(path: Path, marker: str, nth: int) -> int:
    lines = [n for n, s in enumerate(path.read_text().splitlines(), 1) if s.startswith(marker)]
    assert len(lines) >= nth, f"{path.name}: no line {nth} starting {marker!r}"
    return lines[nth - 1]


@pytest.mark.parametrize(("page", "old", "new", "marker", "nth", "message"), MALFORMED)
def test_a_malformed_fact_is_an_error_naming_file_line_and_field(
    build_py: ModuleType, tmp_path: Path, page, old, new, marker, nth, message
):
    content = _content_copy(tmp_path)
    path = content / "innovations" / page
    _replace(path, old, new)
    with pytest.raises(build_py.BuildError) as e:
        build_py.load_content(content)
    where = f"{path}:{_line_of(path, marker, nth)}: "
    assert str(e.value) == where + message


def test_the_build_stops_on_a_malformed_fact_before_any_gate_runs(build, tmp_path: Path):
    content = _content_copy(tmp_path)
    path = content / "innovations" / "kda.md"
    _replace(path, f'check = "{OVERWRITE}"', 'check = "overwrite_exact"')
    run = build(tmp_path / "public", "--content", str(content))
    assert run.returncode == 1
    line = _line_of(path, 'check = "overwrite_exact"', 1)
    assert f"{path}:{line}: fact 4: `check` must name gate_id/check_name" in run.stderr
    assert "gate:" not in run.stdout and not (tmp_path / "public").exists()
