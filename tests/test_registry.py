import pytest

from k3gates.registry import ALIASES, INNOVATIONS, Level, UnknownInnovation, canonical

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
