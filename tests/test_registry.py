import importlib
from pathlib import Path

import pytest

import k3gates
from k3gates.infra.discover import GatePackage, gate_files
from k3gates.infra.gate import REGISTRY, first_sentence
from k3gates.infra.registry import ALIASES, INNOVATIONS, Level, UnknownInnovation, canonical

REQUIRED_ALIASES = {
    "muon": "perheadmuon",
    "mxfp4": "mxfp",
    "mxfp8": "mxfp",
    "mla": "gatedmla",
    "moe": "latentmoe",
    "interleave": "k3block",
}


def test_exactly_ten_canonical_innovations():
    assert list(INNOVATIONS) == [
        "kda",
        "gatedmla",
        "latentmoe",
        "situ",
        "mxfp",
        "perheadmuon",
        "attnres",
        "k3block",
        "longctx",
        "multimodal",
    ]


@pytest.mark.parametrize(("alias", "target"), sorted(REQUIRED_ALIASES.items()))
def test_required_aliases_resolve(alias, target):
    assert canonical(alias) == target
    assert canonical(alias.upper()) == target


def test_every_alias_points_at_a_canonical_id():
    assert set(ALIASES.values()) <= set(INNOVATIONS)
    assert not set(ALIASES) & set(INNOVATIONS)


def test_unknown_id_names_itself_and_the_valid_ids():
    with pytest.raises(UnknownInnovation, match=r"unknown innovation 'mxfp16'.*kda, gatedmla"):
        canonical("mxfp16")


def test_ladder_scores():
    assert [(lvl.name, int(lvl)) for lvl in Level] == [
        ("GAP", 0),
        ("PARTIAL", 1),
        ("HAVE", 2),
        ("STRONG", 3),
        ("PROVEN", 4),
    ]
    assert Level.parse("strong") is Level.STRONG
    with pytest.raises(ValueError, match="unknown level 'HAV'; expected one of GAP, PARTIAL"):
        Level.parse("HAV")


def test_a_gate_title_is_its_docstrings_first_sentence_whole():
    doc = """The integer primitives (rounding shift, isqrt) are
    exact: each equals Python's arithmetic. Second sentence.

    Another paragraph."""
    assert first_sentence(doc) == (
        "The integer primitives (rounding shift, isqrt) are exact: each equals Python's arithmetic."
    )
    assert first_sentence("Q0.31 output, e.g. 2.5 LSB.\n\nMore.") == "Q0.31 output, e.g. 2.5 LSB."
    assert first_sentence("At 2^20 tokens. (At 2^18 in a small run.)") == "At 2^20 tokens."


def test_no_gate_title_ends_without_a_full_stop():
    for file in gate_files(GatePackage(Path(k3gates.__file__).parent)):
        package = GatePackage(Path(k3gates.__file__).parent)
        importlib.import_module(package.modname(file))
    assert len(REGISTRY) >= 40
    cut = {g.id: g.title for g in REGISTRY.values() if not g.title.endswith(".")}
    assert not cut, f"titles cut mid-sentence (end the docstring's first sentence with '.'): {cut}"
    for g in REGISTRY.values():
        assert " ".join(g.doc.split()).startswith(g.title), g.id
