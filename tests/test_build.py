"""The site build end to end: census.json, liar-kill on the page, incremental, bad input."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import HONEST_FAILURES, ROOT, BuildRun, build_module, tree_digest

from k3gates.infra.registry import INNOVATIONS


def test_census_lists_exactly_the_ten_canonical_ids(built_site: BuildRun):
    c = built_site.census
    assert c["schema"] == "k3-census/1"
    assert [r["id"] for r in c["innovations"]] == list(INNOVATIONS)
    for row in c["innovations"]:
        assert {"level", "score", "gates", "checks_passed", "checks_total"} <= set(row)
        assert row["score"] == ["GAP", "PARTIAL", "HAVE", "STRONG", "PROVEN"].index(row["level"])


def test_permille_is_floor_thousand_sum_over_forty(built_site: BuildRun):
    c = built_site.census
    total = sum(r["score"] for r in c["innovations"])
    assert c["permille"] == (1000 * total) // 40
    assert c["arithmetic"] == f"floor(1000 × {total} / 40) = {c['permille']}"


def test_mxfp_is_proven_with_every_check_passing(built_site: BuildRun):
    c = built_site.census
    row = next(r for r in c["innovations"] if r["id"] == "mxfp")
    assert row["level"] == "PROVEN" and not row["killed"]
    gates = [g for g in c["gates"] if g["innovation"] == "mxfp"]
    assert {g["level"] for g in gates} == {"PARTIAL", "HAVE", "STRONG", "PROVEN"}
    for g in gates:
        assert g["passed"], g["id"]
        assert g["checks"] and all(ch["passed"] for ch in g["checks"]), g["id"]
    have = next(g for g in gates if g["level"] == "HAVE")
    assert {ch["kind"] for ch in have["checks"]} >= {
        "nofloat",
        "compiled",
        "reference",
        "deterministic",
        "property",
    }


def test_every_gate_of_the_project_passes_but_the_honest_failures(built_site: BuildRun):
    failed = {
        g["id"]: g["error"] or {c["name"] for c in g["checks"] if not c["passed"]}
        for g in built_site.census["gates"]
        if not g["passed"]
    }
    assert failed == HONEST_FAILURES


def test_liar_killed_claims_are_struck_through_with_the_reason(
    built_site: BuildRun, build, tmp_path: Path
):
    """Every innovation claims PROVEN in a copy of the content: each claim above the level its
    gates reached is killed, struck through with the reason, and only those."""
    content = _content_copy(tmp_path)
    for md in (content / "innovations").glob("*.md"):
        _edit(md, r'claim = "\w+"', 'claim = "PROVEN"')
    run = build(tmp_path / "public", "--content", str(content))
    assert run.returncode == 0, run.stderr
    c = run.census
    index = (run.out / "index.html").read_text()
    killed = [r for r in c["innovations"] if r["killed"]]
    for r in c["innovations"]:
        assert r["claim"] == "PROVEN"
        assert r["killed"] == (r["score"] < 4), r["id"]
    assert killed, "an innovation below PROVEN (an honest failure's) must have its claim killed"
    for r in killed:
        row = re.search(rf'<tr id="row-{r["id"]}".*?</tr>', index, re.S).group(0)
        assert "<s>PROVEN</s>" in row
        assert r["kill_reason"].split(":")[0] in row
        page = (run.out / "innovations" / r["id"] / "index.html").read_text()
        assert "Liar-killed" in page and "<s>PROVEN</s>" in page
    # the real content's claims obey the same rule
    levels = ["GAP", "PARTIAL", "HAVE", "STRONG", "PROVEN"]
    for r in built_site.census["innovations"]:
        assert r["killed"] == (levels.index(r["claim"]) > r["score"]), r["id"]


def test_second_build_with_nothing_changed_compiles_nothing(built_site: BuildRun, build):
    again = build(built_site.out)
    assert again.returncode == 0, again.stderr
    assert "compile: nothing to compile" in again.stdout
    assert re.search(r"done: compiled 0, reused \d+ modules; gates ran 0,", again.stdout)
    assert again.census["permille"] == built_site.census["permille"]
    assert all(not g["ran"] for g in again.census["gates"])


def _content_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "site_src"
    shutil.copytree(ROOT / "site_src", dst)
    return dst


def _edit(path: Path, pattern: str, replacement: str) -> None:
    """Rewrite the one front-matter line matching `pattern`; a no-op edit would hide the test."""
    text, n = re.subn(pattern, replacement, path.read_text(), count=1)
    assert n == 1, f"{path.name}: no line matches {pattern!r}"
    path.write_text(text)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: _edit(d / "innovations" / "kda.md", r'id = "kda"', 'id = "kdaa"'),
            r"innovations/kda\.md:2: unknown innovation 'kdaa'",
        ),
        (
            lambda d: (d / "innovations" / "mxfp8.md").write_text(
                (d / "innovations" / "mxfp.md").read_text().replace('id = "mxfp"', 'id = "mxfp8"')
            ),
            r"innovations/mxfp8\.md:2: id 'mxfp8' claims the slot 'mxfp', "
            r"which .*/mxfp\.md already",
        ),
        (
            lambda d: _edit(d / "innovations" / "situ.md", r'claim = "(\w+)"', r"claim = \1"),
            r"innovations/situ\.md:\d+: front matter is not valid TOML",
        ),
        (
            lambda d: (d / "innovations" / "attnres.md").write_text("no front matter here\n"),
            r"innovations/attnres\.md:1: no front matter; the file must start with a `\+\+\+` line",
        ),
        (
            lambda d: _edit(d / "innovations" / "longctx.md", r'claim = "\w+"', 'claim = "HAV"'),
            r"innovations/longctx\.md:4: `claim`: unknown level 'HAV'",
        ),
    ],
)
def test_bad_content_fails_naming_the_file_and_leaves_public_intact(
    built_site: BuildRun, build, tmp_path: Path, edit, message
):
    before = tree_digest(built_site.out)
    content = _content_copy(tmp_path)
    edit(content)
    run = build(built_site.out, "--content", str(content))
    assert run.returncode == 1
    assert re.search(message, run.stderr), run.stderr
    assert "was left unchanged" in run.stderr
    assert tree_digest(built_site.out) == before


def test_template_error_names_the_template_and_line(built_site: BuildRun, build, tmp_path: Path):
    before = tree_digest(built_site.out)
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    gate = templates / "gate.html"
    lines = gate.read_text().splitlines()
    lines[5] += " {{ gate.no_such_field.deeper }}"
    gate.write_text("\n".join(lines) + "\n")
    run = build(built_site.out, "--templates", str(templates))
    assert run.returncode == 1
    assert re.search(r"templates/gate\.html:6: UndefinedError", run.stderr), run.stderr
    assert tree_digest(built_site.out) == before


def test_the_published_site_is_a_symlink_swapped_whole(built_site: BuildRun):
    assert built_site.out.is_symlink()
    target = built_site.out.resolve()
    assert target.parent.name == f".{built_site.out.name}"
    assert (target / "index.html").is_file() and (target / "census.json").is_file()
    assert (target / "404.html").is_file() and (target / "sitemap.xml").is_file()
    assert (target / "index.html.gz").is_file()


def test_the_summary_counts_skipped_gates_apart_from_reused_and_failed(capsys):
    """--only: a gate neither run nor reusable is skipped; the summary neither calls it reused
    nor failed."""
    b = build_module()
    gates = [
        {"id": "ran_ok", "passed": True, "status": "passed", "ran": True, "reused_from": None},
        {"id": "old_ok", "passed": True, "status": "passed", "ran": False, "reused_from": "h"},
        {"id": "ran_bad", "passed": False, "status": "failed", "ran": True, "reused_from": None},
        {"id": "not_run", "passed": False, "status": "skipped", "ran": False, "reused_from": None},
    ]
    prov = b.provenance(gates, [])
    assert (prov["gates_ran"], prov["gates_reused"], prov["gates_skipped"]) == (2, 1, 1)
    census = {
        "provenance": prov,
        "gates": [{**g, "seconds": 1.0} for g in gates],
        "innovations": [],
        "arithmetic": "floor(1000 × 0 / 40) = 0",
    }
    b.summary(census, 3, b.Laps())
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    assert "gates ran 2, reused 1, skipped 1, passed 2, failed 1;" in done
