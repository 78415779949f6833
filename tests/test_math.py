"""Issue 18, item 2: `$…$` and `$$…$$` in site_src become MathML at build time.

The markdown-it-py plugin is mdit-py-plugins' dollarmath (same maintainers as markdown-it-py) and
the converter is latex2mathml (pure Python, no JavaScript on the page, so the CSP holds).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, BuildRun, build_module

build = build_module()

PAGE = """+++
title = "t"
+++
The state $S_t$ decays by $\\alpha = \\exp(g)$, then

$$
S_t = \\left(I - \\beta_t k_t k_t^\\top\\right) S_{t-1} + \\beta_t k_t v_t^\\top
$$

and costs $5 or $6 to print.
"""


def _page(tmp_path: Path, text: str) -> str:
    path = tmp_path / "p.md"
    path.write_text(text)
    return build.read_page(path).body_html


def test_inline_and_display_math_become_mathml_with_no_dollar_left(tmp_path: Path):
    html = _page(tmp_path, PAGE)
    assert html.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">') == 2
    assert html.count('display="block"') == 1
    assert "<msubsup>" in html and "&#x003B2;" in html  # k_t^T and beta, typeset
    outside = re.sub(r"<math.*?</math>", "", html, flags=re.S)
    assert "$5 or $6" in outside  # money is not math: math hugs its dollars
    assert outside.count("$") == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("Decay $\\bta_t$ here.", "unknown LaTeX command \\bta"),
        ("Decay $x^{2$ here.", "unclosed '{'"),
        ("Decay $x}$ here.", "unbalanced '}'"),
    ],
)
def test_bad_latex_names_the_file_and_line(tmp_path: Path, line: str, reason: str):
    text = '+++\ntitle = "t"\n+++\nFirst paragraph.\n\nSecond paragraph,\n' + line + "\n"
    with pytest.raises(build.BuildError) as e:
        _page(tmp_path, text)
    assert str(e.value).startswith(f"{tmp_path / 'p.md'}:7: ")
    assert reason in str(e.value)


def test_a_display_block_is_not_read_as_paragraph_syntax(tmp_path: Path):
    # a line of the equation opening with "+ " would otherwise be taken for a list item
    html = _page(tmp_path, '+++\ntitle = "t"\n+++\nText:\n\n$$\na\n+ b\n$$\n')
    assert "<li>" not in html and 'display="block"' in html


def test_display_math_glued_to_a_paragraph_is_refused(tmp_path: Path):
    with pytest.raises(build.BuildError, match=r"p.md:5: display math .* blank line before it"):
        _page(tmp_path, '+++\ntitle = "t"\n+++\nText:\n$$\na\n$$\n')


def test_the_innovation_pages_show_their_equations_as_mathml(built_site: BuildRun):
    for name, least in [("kda", 5), ("situ", 3), ("perheadmuon", 2), ("latentmoe", 2)]:
        html = (built_site.out / "innovations" / name / "index.html").read_text()
        main = re.sub(r"<math.*?</math>", "", html, flags=re.S)
        assert html.count("<math ") >= least, name
        assert "$" not in main, name
    # the recurrence itself, as written in K3-SPEC.md
    kda = (ROOT / "site_src" / "innovations" / "kda.md").read_text()
    assert "S_t = \\left(I - \\beta_t k_t k_t^\\top\\right)" in kda
