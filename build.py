"""The site generator: content + gate results + census -> templates -> public/.

    python build.py                 compile what changed, run (or reuse) the gates, render, publish
    python build.py --check         the same, then exit 1 if a gate fails or a claim is liar-killed
    python build.py --rerun         ignore reusable gate results and run every gate
    python build.py --only GATE     run only this gate (others keep their reusable results; what
                                    it builds on runs if it has none)

The pipeline is `main()`, top to bottom. Every step that can be wrong about its input raises
BuildError naming the file and the reason; the previous `public/` is then left as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tomllib
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import markupsafe
from latex2mathml.converter import convert as latex_to_mathml
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from k3gates.infra import compile as kcompile  # noqa: E402
from k3gates.infra import faultsuite, runner  # noqa: E402
from k3gates.infra.census import census as compute_census  # noqa: E402
from k3gates.infra.discover import (  # noqa: E402
    DiscoveryError,
    GatePackage,
    GateSite,
    discover_gates,
    kernel_modules,
)
from k3gates.infra.registry import INNOVATIONS, Level, UnknownInnovation, canonical  # noqa: E402

CENSUS_SCHEMA = "k3-census/1"
COMPRESSIBLE = {".html", ".css", ".js", ".json", ".svg", ".xml", ".txt", ".map"}
KEEP_OLD_BUILDS = 2  # the current site plus one older, so in-flight requests can finish
HISTORY_FILE = "history.jsonl"  # under site_src/: one recorded census per line, committed
DIGESTS_FILE = "digests.jsonl"  # under site_src/: every check's digests per recorded build and CPU
RUNS_FILE = "recorded_runs.jsonl"  # under site_src/: the --scale gates' recorded runs, committed
RUN_KEYS = {"gate", "innovation", "commit", "built_at", "cpu", "command", "passed", "summary",
            "checks", "artifacts"}  # fmt: skip
SCHEMA_FILE = "census.schema.json"  # under site_src/, published beside census.json


class BuildError(Exception):
    """A problem with the project's own input; the message names the file and what to fix."""


# -- settings ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    content: Path = ROOT / "site_src"  # markdown pages with TOML front matter, data, static assets
    templates: Path = ROOT / "templates"  # Jinja2 templates
    out: Path = ROOT / "public"  # the published site: a symlink swapped atomically per build
    packages: tuple[Path, ...] = (ROOT / "k3gates",)  # gate packages; tests add fixture packages
    jobs: int = max(1, os.cpu_count() or 1)  # parallel compiles and gates; more needs more RAM
    rerun: bool = False  # True ignores reusable gate results (slower, re-measures everything)
    only: tuple[str, ...] = ()  # run just these gates; the rest may still be reused
    needed: tuple[str, ...] = ()  # what the `only` gates build on: run unless reusable
    check: bool = False  # exit non-zero on a failed gate or a liar-killed claim
    record: bool = False  # append this build's census to site_src/history.jsonl (clean tree only)
    watch: bool = False  # rebuild whenever k3gates/, site_src/ or templates/ change
    building_page: bool = False  # publish a live progress page until the site exists (serve's)
    runner: str = "local"  # where gates run: this machine, "dask" (a LocalCluster) or tcp://…
    scale: str = "default"  # "k3" adds the gate set at K3's true dimensions (SCALES)


# Gate sets beyond the default build, by --scale: each a gate package of its own, so the default
# packages' gates (and their fault records) are untouched by them.
SCALES: dict[str, tuple[Path, ...]] = {"default": (), "k3": (ROOT / "scale_k3",)}


def parse_args(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(description="Build the K3 sovereign coverage site.")
    p.add_argument("--out", type=Path, default=Settings.out, help="publish here (default public/)")
    p.add_argument("--content", type=Path, default=Settings.content)
    p.add_argument("--templates", type=Path, default=Settings.templates)
    p.add_argument(
        "--gates-from",
        type=Path,
        action="append",
        default=[],
        metavar="PKG",
        help="an extra gate package folder (repeatable)",
    )
    p.add_argument(
        "--scale",
        choices=sorted(SCALES),
        default="default",
        help="k3 adds the gates at K3's true dimensions (scale_k3/: about 20 GB of memory)",
    )
    p.add_argument("--jobs", "-j", type=int, default=Settings.jobs)
    p.add_argument("--rerun", action="store_true", help="run every gate, reuse nothing")
    p.add_argument("--only", action="append", default=[], metavar="GATE")
    p.add_argument(
        "--check", action="store_true", help="exit 1 if any gate fails or any claim is liar-killed"
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="append this build's census to the history (needs a clean tree at a commit)",
    )
    p.add_argument("--watch", action="store_true", help="rebuild whenever a source changes")
    p.add_argument(
        "--building-page",
        action="store_true",
        help="while no site is published, publish a live progress page (python -m serve does)",
    )
    p.add_argument(
        "--runner",
        default=Settings.runner,
        metavar="local|dask|tcp://HOST:PORT",
        help="run the gates here (default), on a Dask LocalCluster, or on a Dask scheduler "
        "(needs pip install -e '.[cluster]')",
    )
    a = p.parse_args(argv)
    if a.runner not in {"local", "dask"} and "://" not in a.runner:
        p.error(
            f"--runner {a.runner!r}: expected local, dask or a scheduler address tcp://HOST:PORT"
        )
    return Settings(
        content=a.content.resolve(),
        templates=a.templates.resolve(),
        out=a.out.absolute(),
        jobs=max(1, a.jobs),
        rerun=a.rerun,
        packages=(*Settings.packages, *SCALES[a.scale], *(g.resolve() for g in a.gates_from)),
        only=tuple(a.only),
        check=a.check,
        record=a.record,
        watch=a.watch,
        building_page=a.building_page,
        runner=a.runner,
        scale=a.scale,
    )


class Progress:
    """Live progress on a terminal (one redrawn status line), plain lines otherwise.

    Finished items always print as their own line, so a log captured without a terminal reads
    the same as the scrollback of one that had it.
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.lock = threading.Lock()
        self.phase, self.total, self.done = "", 0, 0
        self.current: dict[str, float] = {}  # item -> start time
        self.started = time.perf_counter()
        self.phases: dict[str, list[float]] = {}  # phase -> [done, total, start time]
        self._stop = threading.Event()
        if self.tty:
            threading.Thread(target=self._tick, daemon=True).start()

    def begin(self, phase: str, total: int) -> None:
        with self.lock:
            self.phase, self.total, self.done = phase, total, 0
            self.current.clear()
            self.phases[phase] = [0, total, time.perf_counter()]

    def start(self, item: str) -> None:
        with self.lock:
            self.current[item] = time.perf_counter()
            self._draw()

    def finish(self, item: str, line: str | None) -> None:
        with self.lock:
            self.current.pop(item, None)
            self.done += 1
            self.phases[self.phase][0] = self.done
            if line:
                self._print(line)
            self._draw()

    def log(self, line: str) -> None:
        with self.lock:
            self._print(line)

    def snapshot(self) -> dict[str, Any]:
        """Where the build is, for the building page: counts per phase, running items, times."""
        with self.lock:
            now = time.perf_counter()
            phases = {}
            for name, (done, total, start) in self.phases.items():
                left = None  # the phase's own pace so far; unknown before its first item ends
                if done and done < total:
                    left = (now - start) / done * (total - done)
                phases[name] = {"done": int(done), "total": int(total), "left": left}
            return {
                "phase": self.phase,
                "phases": phases,
                "running": {k: now - t for k, t in self.current.items()},
                "elapsed": now - self.started,
            }

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            if self.tty:
                self.stream.write("\r\033[K")
                self.stream.flush()

    def _print(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(line + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        if not self.tty or not self.phase:
            return
        now = time.perf_counter()
        running = ", ".join(f"{k} {now - t:.0f}s" for k, t in list(self.current.items())[:3])
        status = f"[{self.phase} {self.done}/{self.total}] {running}  ({now - self.started:.1f} s)"
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r\033[K" + status[:width])
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self.lock:
                self._draw()


# -- the pipeline --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    if s.watch:
        return watch(s)
    return build(s)


def build(s: Settings) -> int:
    laps = Laps()
    progress = Progress()
    building = BuildingPage(s, progress) if s.building_page else None
    try:
        if building:
            building.start()
        packages = [GatePackage(p) for p in s.packages]
        gates = discover(packages, s.only)  # 1. discover gates and content
        s = with_requirements(s, gates, progress)
        content = load_content(s.content)
        laps.mark("discover")
        compiled = compile_kernels(packages, gates, s, progress)  # 2-3. compile what changed
        laps.mark("compile")
        results = run_gates(gates, s, progress)  # 4. run the gates, in parallel, with timeouts
        laps.mark("gates")
        census = build_census(results, content, compiled)  # 5. the census
        staged, pages = render_site(s, content, census)  # 6. render into a staging folder
        laps.mark("render")
        write_gzip_sidecars(staged, s.out)
        laps.mark("compress")
        if building:
            building.stop()
        publish(staged, s.out)  # 7. swap it in atomically
        laps.mark("publish")
    except BuildError as e:
        progress.close()
        print(f"build failed: {e}", file=sys.stderr)
        if building and building.enabled:
            building.fail(str(e))
            print(f"{s.out} shows the failure.", file=sys.stderr)
        else:
            print(f"{s.out} was left unchanged.", file=sys.stderr)
        return 1
    except BaseException:
        if building:  # a bug in the build itself: the page says so rather than spinning forever
            building.fail(traceback.format_exc())
        raise
    progress.close()
    summary(census, pages, laps)
    status = 0
    if s.record:  # a --scale build records its own gates' runs, not the default build's history
        record = record_runs if s.scale != "default" else record_history
        status = record(census, results, s)
    return max(status, verdict(census, results) if s.check else 0)


class Laps:
    """Wall time per pipeline step, for the summary and the build bench."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.steps: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


# -- 1. discovery and content --------------------------------------------------------------------
def discover(packages: list[GatePackage], only: tuple[str, ...]) -> list[GateSite]:
    for pkg in packages:
        if not (pkg.path / "__init__.py").is_file():
            raise BuildError(f"{pkg.path}: not a gate package (no __init__.py)")
    try:
        gates = discover_gates(packages)
    except DiscoveryError as e:
        raise BuildError(str(e)) from e
    unknown = set(only) - {g.id for g in gates}
    if unknown:
        raise BuildError(f"--only: no gate named {', '.join(sorted(unknown))}")
    return gates


def with_requirements(s: Settings, gates: list[GateSite], progress: Progress) -> Settings:
    """--only X also runs the gates X builds on that have no result to reuse: without them X
    would fail as built on a gate that did not run."""
    if not s.only:  # a whole build needs no closure: spare every build the kernels' imports
        return s
    needed = runner.requirements(gates, s.only)
    if needed:
        progress.log(
            f"--only: the chosen gates build on {', '.join(needed)}; each of those runs unless "
            "its result can be reused"
        )
    return dataclasses.replace(s, needed=needed)


@dataclass
class Page:
    path: Path
    meta: dict[str, Any]
    body_html: str
    body_line: int  # the file line where the markdown body starts


@dataclass
class Content:
    index: Page
    innovations: dict[str, Page] = field(default_factory=dict)  # canonical id -> page
    claims: dict[str, Level] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    digests: list[dict[str, Any]] = field(default_factory=list)  # recorded runs, any CPU
    runs: list[dict[str, Any]] = field(default_factory=list)  # the --scale gates' recorded runs
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)  # gate id -> fault record
    pages: list[Page] = field(default_factory=list)  # site_src/pages/**.md, e.g. the lesson
    data: dict[str, Any] = field(default_factory=dict)  # site_src/data/*.toml|json
    facts: dict[str, list[Fact]] = field(default_factory=dict)  # canonical id -> [[facts]]


@dataclass(frozen=True)
class Fact:
    """A sentence about a measured property, and the one gate check that must pass to back it."""

    text: str
    gate: str
    check: str
    line: int  # the front-matter line of its `check`

    @property
    def ref(self) -> str:
        return f"{self.gate}/{self.check}"


FRONT_MATTER = "+++"


class MathError(ValueError):
    """LaTeX that would not come out as the equation written; the message says what is wrong."""


@functools.cache  # render_markdown checks each equation, then renders it
def mathml(latex: str, display: bool) -> str:
    """`$…$` or `$$…$$` as MathML, made at build time: no script on the page, the CSP holds."""
    depth = 0
    for ch in re.sub(r"\\[{}]", "", latex):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            raise MathError(f"unbalanced '}}' in ${latex}$")
    if depth:
        raise MathError(f"unclosed '{{' in ${latex}$")
    try:
        out = latex_to_mathml(latex, display="block" if display else "inline")
    except Exception as e:  # latex2mathml raises its own error per syntax problem
        raise MathError(f"${latex}$ is not LaTeX it can read: {type(e).__name__} {e}") from e
    # an unknown command is kept as text, so a typo would be printed as "\\bta"
    if m := re.search(r">(\\[A-Za-z]+)<", out):
        raise MathError(f"unknown LaTeX command {m.group(1)} in ${latex}$")
    return out


MARKDOWN = (
    MarkdownIt("commonmark", {"html": False, "typographer": True})
    .enable("table")
    .use(
        dollarmath_plugin,
        allow_space=False,  # "$5 and $6" stays money: math hugs its dollars, as in TeX
        allow_digits=False,
        allow_labels=False,
        renderer=lambda latex, config: mathml(latex, config["display_mode"]),
    )
)


def render_markdown(path: Path, body: str, first: int) -> str:
    """The body as HTML; a math error names the file line its equation is on."""
    tokens = MARKDOWN.parse(body)
    for tok in tokens:
        maths = [(tok.content, tok.content, True)] if tok.type == "math_block" else []
        if tok.type == "inline":
            maths = [(c.content, tok.content, False) for c in tok.children or []
                     if c.type == "math_inline"]  # fmt: skip
        for latex, text, display in maths:
            try:
                mathml(latex, display)
            except MathError as e:
                line = first + (tok.map or [0])[0] + text[: text.find(latex)].count("\n")
                raise BuildError(f"{path}:{line}: {e}") from None
    return MARKDOWN.renderer.render(tokens, MARKDOWN.options, {})


def read_page(path: Path) -> Page:
    """A markdown file opening with TOML front matter between `+++` lines (as Zola does)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if not lines or lines[0].strip() != FRONT_MATTER:
        raise BuildError(f"{path}:1: no front matter; the file must start with a `+++` line")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == FRONT_MATTER)
    except StopIteration:
        raise BuildError(
            f"{path}:1: front matter is not closed; add a `+++` line after it"
        ) from None
    try:
        meta = tomllib.loads("\n".join(lines[1:end]))
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        line = int(m.group(1)) + 1 if m else 1
        raise BuildError(f"{path}:{line}: front matter is not valid TOML: {e}") from e
    check_block_starts(path, lines[end + 1 :], end + 2)
    body = "\n".join(lines[end + 1 :])
    return Page(path, meta, render_markdown(path, body, end + 2), end + 2)


# A line that opens with one of these inside a running paragraph is read by markdown as new block
# syntax, so the paragraph splits there (`+ Shared(x)` once turned an equation's term into a
# bullet).
_SPLITTERS = [
    (re.compile(r"[+*-][ \t]"), "a list item"),
    (re.compile(r"[0-9]{1,9}[.)]([ \t]|$)"), "an ordered-list item"),
    (re.compile(r"#{1,6}([ \t]|$)"), "a heading"),
    (re.compile(r">"), "a block quote"),
    (re.compile(r"(=+|-+)[ \t]*$"), "a heading underline"),
]
_LEAD_IN = re.compile(r"(:|:\*\*|^\*\*[^*]+\*\*)$")  # "…as follows:" or a bold label line
_FENCE = re.compile(r"(`{3,}|~{3,}|\$\$$)")  # code fences, and display math on its own lines
_ITEM = re.compile(r"([+*-]|[0-9]{1,9}[.)])([ \t]|$)")


def check_block_starts(path: Path, body: list[str], first: int) -> None:
    """Fail on a body line that markdown would read as block syntax splitting the paragraph above.

    `body` is the markdown after the front matter and `first` the file line of its first line.
    Fenced code is skipped; so are lines continuing a list, a table or a quote. A list item right
    after a line ending in ':', or after a bold label line (`**What is implemented.**`), is a list
    that line introduces, and is allowed.
    """
    fence = ""
    block = ""  # what the current run of non-blank lines is: "", para, list, table, other
    prev = ""  # the previous non-blank line
    for n, raw in enumerate(body, first):
        line = raw.strip()
        if fence:
            if line.startswith(fence):
                fence = ""
            continue
        if m := _FENCE.match(line):
            if m.group(1) == "$$" and block == "para":
                raise BuildError(
                    f"{path}:{n}: display math ($$) inside a paragraph is read as text: "
                    "leave a blank line before it"
                )
            fence, block = m.group(1), ""
            continue
        if not line:
            block = "" if block != "list" else "list-gap"
            continue
        lead_in, prev = bool(_LEAD_IN.search(prev)), line
        indented = len(raw) - len(raw.lstrip(" \t")) >= 2
        if block == "para":
            for rx, what in _SPLITTERS:
                if rx.match(line) and not (lead_in and _ITEM.match(line)):
                    raise BuildError(
                        f"{path}:{n}: this line starts with {line[0]!r}, which markdown reads as "
                        f"{what} and splits the paragraph (an equation loses its term): move the "
                        "symbol to the end of the previous line or rephrase"
                    )
            if not _ITEM.match(line):
                continue
        if block == "list-gap" and not indented and not _ITEM.match(line):
            block = ""
        if block in ("list", "list-gap", "table", "other"):
            block = "list" if block == "list-gap" else block
            continue
        if _ITEM.match(line):
            block = "list"
        elif line.startswith("|"):
            block = "table"
        elif re.match(r"#{1,6}([ \t]|$)", line):
            block = ""  # an ATX heading is one line; the next line opens a new block
        elif line.startswith((">", "<")) or len(raw) - len(raw.lstrip(" ")) >= 4:
            block = "other"
        else:
            block = "para"


def _field_line(page: Page, key: str) -> int:
    for i, line in enumerate(page.path.read_text(encoding="utf-8").splitlines(), 1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line):
            return i
    return 1


def _require(page: Page, key: str, kind: type) -> Any:
    if key not in page.meta:
        raise BuildError(f"{page.path}:1: front matter has no `{key}` field")
    value = page.meta[key]
    if not isinstance(value, kind):
        raise BuildError(
            f"{page.path}:{_field_line(page, key)}: `{key}` must be a "
            f"{kind.__name__}, got {type(value).__name__}"
        )
    return value


def load_content(content: Path) -> Content:
    index_file = content / "index.md"
    if not index_file.is_file():
        raise BuildError(f"{index_file}: missing (the home page's text)")
    result = Content(
        index=read_page(index_file),
        history=load_history(content / HISTORY_FILE),
        digests=load_jsonl(content / DIGESTS_FILE, {"commit", "cpu", "vector", "gates"}),
        runs=load_jsonl(content / RUNS_FILE, RUN_KEYS),
        faults=faultsuite.load(content / faultsuite.FAULTS_FILE),
        pages=[_extra_page(p) for p in sorted((content / "pages").rglob("*.md"))],
        data=load_data(content / "data"),
    )
    for path in sorted((content / "innovations").glob("*.md")):
        inno, page, claim = _innovation_page(path)
        if inno in result.innovations:
            other = result.innovations[inno].path
            raise BuildError(
                f"{path}:{_field_line(page, 'id')}: id {page.meta['id']!r} claims the slot "
                f"{inno!r}, which {other} already claims"
            )
        result.innovations[inno], result.claims[inno] = page, claim
        result.facts[inno] = _facts(page)
    missing = [i for i in INNOVATIONS if i not in result.innovations]
    if missing:
        raise BuildError(f"{content / 'innovations'}: no page for {', '.join(missing)}")
    urls: dict[str, Path] = {}
    for page in result.pages:
        url = page.meta["url"]
        if url in urls:
            raise BuildError(
                f"{page.path}:{_field_line(page, 'url')}: url {url} is already the page {urls[url]}"
            )
        urls[url] = page.path
    return result


def _innovation_page(path: Path) -> tuple[str, Page, Level]:
    page = read_page(path)
    raw_id = _require(page, "id", str)
    try:
        inno = canonical(raw_id)
    except UnknownInnovation as e:
        raise BuildError(f"{path}:{_field_line(page, 'id')}: {e}") from e
    _require(page, "title", str)
    try:
        claim = Level.parse(_require(page, "claim", str))
    except ValueError as e:
        raise BuildError(f"{path}:{_field_line(page, 'claim')}: `claim`: {e}") from e
    for ref in page.meta.get("references", []):
        if not isinstance(ref, dict) or "title" not in ref:
            raise BuildError(
                f"{path}:{_field_line(page, 'references')}: each reference "
                "needs a title (and an arxiv id or a url)"
            )
    return inno, page, claim


FACT_FIELDS = ("text", "check")
CHECK_REF = re.compile(r"([A-Za-z0-9_.-]+)/(\S(?:.*\S)?)")  # gate_id/check_name


def _facts(page: Page) -> list[Fact]:
    """The page's `[[facts]]`: each sentence about a measured property names, as `check`, the
    `gate_id/check_name` whose pass backs it (DESIGN.md, "Claims and liar-kill")."""
    raw = page.meta.get("facts", [])
    if not isinstance(raw, list):
        raise BuildError(
            f"{page.path}:{_field_line(page, 'facts')}: `facts` must be an array of tables "
            f"([[facts]] with text and check), got {type(raw).__name__}"
        )
    facts = []
    for n, entry in enumerate(raw, 1):
        if not isinstance(entry, dict):
            raise BuildError(
                f"{page.path}:{_fact_line(page, n)}: fact {n}: must be a table with `text` and "
                f"`check`, got {type(entry).__name__}"
            )
        unknown = sorted(set(entry) - set(FACT_FIELDS))
        if unknown:
            raise BuildError(
                f"{page.path}:{_fact_line(page, n, unknown[0])}: fact {n}: unknown field "
                f"`{unknown[0]}`; a fact has only `text` and `check`"
            )
        for key in FACT_FIELDS:
            if key not in entry:
                raise BuildError(f"{page.path}:{_fact_line(page, n)}: fact {n}: no `{key}` field")
            if not isinstance(entry[key], str) or not entry[key].strip():
                got = repr(entry[key]) if isinstance(entry[key], str) else type(entry[key]).__name__
                raise BuildError(
                    f"{page.path}:{_fact_line(page, n, key)}: fact {n}: `{key}` must be a "
                    f"non-empty string, got {got}"
                )
        line = _fact_line(page, n, "check")
        ref = CHECK_REF.fullmatch(entry["check"])
        if not ref:
            raise BuildError(
                f"{page.path}:{line}: fact {n}: `check` must name gate_id/check_name, "
                f"got {entry['check']!r}"
            )
        facts.append(Fact(" ".join(entry["text"].split()), ref[1], ref[2], line))
    return facts


def _fact_line(page: Page, n: int, key: str | None = None) -> int:
    """The line of the n-th (1-based) `[[facts]]` table, or of its `key` when it has one."""
    lines = page.path.read_text(encoding="utf-8").splitlines()
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == FRONT_MATTER), len(lines))
    heads = [i for i in range(1, end) if re.match(r"\s*\[\[\s*facts\s*\]\]", lines[i])]
    if len(heads) < n:  # an inline array, `facts = [...]`
        return _field_line(page, "facts")
    head = heads[n - 1]
    for i in range(head + 1, end):
        if lines[i].lstrip().startswith("["):  # the next table: the key is not in this one
            break
        if key and re.match(rf"\s*{re.escape(key)}\s*=", lines[i]):
            return i + 1
    return head + 1


def _extra_page(path: Path) -> Page:
    """A page under site_src/pages/: front matter names its `url` and its `template`."""
    page = read_page(path)
    _require(page, "title", str)
    url = _require(page, "url", str)
    if not (url.startswith("/") and url.endswith("/")) or ".." in url:
        raise BuildError(
            f"{path}:{_field_line(page, 'url')}: `url` must look like /a/b/, got {url!r}"
        )
    page.meta.setdefault("template", "page.html")
    return page


def load_data(folder: Path) -> dict[str, Any]:
    """site_src/data/NAME.toml or NAME.json -> data[NAME], for templates and the lesson."""
    data: dict[str, Any] = {}
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        try:
            if f.suffix == ".toml":
                data[f.stem] = tomllib.loads(f.read_text(encoding="utf-8"))
            elif f.suffix == ".json":
                data[f.stem] = json.loads(f.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise BuildError(f"{f}: not valid TOML: {e}") from e
        except json.JSONDecodeError as e:
            raise BuildError(f"{f}:{e.lineno}: not valid JSON: {e.msg}") from e
    return data


# -- 3. compile ----------------------------------------------------------------------------------
def compile_kernels(
    packages: list[GatePackage], gates: list[GateSite], s: Settings, progress: Progress
) -> list[kcompile.Compiled]:
    """Compile every kernels module whose key the cache lacks; bad kernels fail their gates.

    With --only, just the kernels those gates declare (discovery reads them without importing).
    """
    for pkg in packages:  # the runner and this process must resolve the same modules
        if str(pkg.root) not in sys.path:
            sys.path.insert(0, str(pkg.root))
    modules = kernel_modules(packages)
    chosen = [g for g in gates if g.id in s.only or g.id in s.needed]
    if chosen:
        wanted = {m for g in chosen for m in g.kernels}
        modules = [m for m in modules if m in wanted]
    todo = [m for m in modules if not _cached(m)]
    if not todo:
        progress.log(f"compile: nothing to compile; all {len(modules)} kernel modules reused")
    progress.begin("compile", len(modules))
    done: dict[str, kcompile.Compiled] = {}

    def one(modname: str) -> None:
        if modname in todo:
            progress.start(modname)
        c = kcompile.ensure(modname)
        done[modname] = c
        if c.error:
            line = f"compile: {modname} FAILED (its gates will fail): {c.error.splitlines()[0]}"
        else:
            line = None if c.reused else f"compile: {modname} compiled in {c.seconds:.1f} s"
        progress.finish(modname, line)

    with ThreadPoolExecutor(max_workers=s.jobs) as pool:
        list(pool.map(one, modules))
    return [done[m] for m in modules]


def _cached(modname: str) -> bool:
    try:
        return kcompile._read_entry(modname, kcompile.module_key(modname)) is not None
    except (kcompile.CompileError, OSError):
        return False


# -- 4. gates ------------------------------------------------------------------------------------
def run_gates(gates: list[GateSite], s: Settings, progress: Progress) -> list[dict[str, Any]]:
    shown: dict[str, str] = {}
    progress.begin("gates", len(gates))

    def on_event(kind: str, site: GateSite, result: dict | None) -> None:
        if kind == "start":
            progress.start(site.id)
            return
        if result is None:
            return
        how = "ran" if result["ran"] else "not run"
        if result.get("reused_from"):
            how = f"reused {result['reused_from']}"
        why = "" if result["passed"] else f": {_first_failure(result)}"
        line = f"gate: {site.id:<22} {result['status']:<13} ({how}, {result['seconds']:.1f} s){why}"
        shown[site.id] = result["status"]
        progress.finish(site.id, line)

    with gate_pool(s) as pool:
        raw = runner.run_gates(
            gates,
            jobs=s.jobs,
            reuse=not s.rerun,
            only=set(s.only) or None,
            needed=set(s.needed),
            on_event=on_event,
            pool=pool,
        )
    results = runner.apply_requirements(raw)
    for r in results:  # verdicts that changed once the foundations gates were known
        if shown.get(r["id"]) != r["status"]:
            progress.log(
                f"gate: {r['id']:<22} {r['status']:<13} (after foundations): {_first_failure(r)}"
            )
    return results


@contextlib.contextmanager
def gate_pool(s: Settings) -> Iterator[runner.GatePool | None]:
    """None for the local runner (the default); a Dask cluster's pool for --runner."""
    if s.runner == "local":
        yield None
        return
    from k3gates.infra import cluster  # distributed is an optional extra: imported only when asked

    try:
        pool = cluster.DaskPool(s.runner, jobs=s.jobs, packages=s.packages)
    except cluster.ClusterError as e:
        raise BuildError(f"--runner {s.runner}: {e}") from e
    with pool:
        yield pool


def _first_failure(r: dict[str, Any]) -> str:
    if r.get("error"):
        return str(r["error"]).splitlines()[0]
    bad = [c for c in r.get("checks", []) if not c["passed"]]
    return f"check {bad[0]['name']}: {bad[0]['message'][:160]}" if bad else r["status"]


# -- 5. census -----------------------------------------------------------------------------------
def provenance(results: list[dict[str, Any]], compiled: list[kcompile.Compiled]) -> dict:
    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20
            )
            return out.stdout.strip() if out.returncode == 0 else ""
        except OSError:
            return ""

    tc = kcompile.toolchain()
    return {
        "built_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(git("status", "--porcelain")),
        "python": tc["python"],
        "numpy": tc["numpy"],
        "pythran": tc["pythran"],
        "compiler": tc["compiler"],
        "cpu": tc["cpu"],
        "cpu_vector": kcompile.cpu_vector_extensions(),
        "flags": tc["flags"],
        "gate_seconds": round(sum(r.get("seconds", 0.0) for r in results if r.get("ran")), 3),
        "gates_ran": sum(1 for r in results if r.get("ran")),
        "gates_reused": sum(1 for r in results if r.get("reused_from")),
        "gates_skipped": sum(1 for r in results if r["status"] == "skipped"),
        "modules_compiled": sum(1 for c in compiled if not c.reused),
        "modules_reused": sum(1 for c in compiled if c.reused),
    }


def build_census(
    results: list[dict[str, Any]], content: Content, compiled: list[kcompile.Compiled]
) -> dict[str, Any]:
    table = compute_census(results, content.claims)
    by_id = {r["id"]: r for r in results}
    for row in table["innovations"]:
        page = content.innovations[row["id"]]
        row["facts"] = back_facts(content.facts.get(row["id"], []), by_id)
        hints = page.meta.get("next", {})
        if row["score"] == Level.PROVEN:
            # nothing on the ladder is left; `beyond` names the work past it
            beyond = hints.get("beyond")
            row["next"] = "top of the ladder" + (f"; beyond it: {beyond}" if beyond else "")
        else:
            next_level = Level(row["score"] + 1).name
            row["next"] = (
                row["blocker"]
                if "fails" in row["blocker"]
                else hints.get(next_level, row["blocker"])
            )
        row["title"] = page.meta["title"]
    prov = provenance(results, compiled)
    gates = [_public_result(r) for r in results]
    for g, r in zip(gates, results, strict=True):
        attach_faults(g, content.faults.get(g["id"]))
        g["other_cpus"] = compare_digests(g, r, content.digests, prov)
    return machine_paths_removed(
        {
            "$schema": f"/{SCHEMA_FILE}",
            "schema": CENSUS_SCHEMA,
            "provenance": prov,
            **table,
            "arithmetic": f"floor(1000 × {table['score_sum']} / {table['score_max']}) = "
            f"{table['permille']}",
            "gates": gates,
        }
    )


# What a published path may not carry: where this checkout, and this Python, happen to live.
MACHINE_PREFIXES = tuple(
    dict.fromkeys(
        f"{p}/"
        for p in (
            ROOT,
            sysconfig.get_path("purelib"),
            sysconfig.get_path("platlib"),
            sysconfig.get_path("stdlib"),
        )
    )
)


def machine_paths_removed(value: Any) -> Any:
    """`value` with every path under the repository made relative to it, and every path into
    Python's own library made relative to that library (a gate error names numpy's file)."""
    if isinstance(value, str):
        for prefix in MACHINE_PREFIXES:
            value = value.replace(prefix, "")
        return value
    if isinstance(value, dict):
        return {k: machine_paths_removed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [machine_paths_removed(v) for v in value]
    return value


def attach_faults(g: dict[str, Any], rec: dict[str, Any] | None) -> None:
    """The fault-suite record for exactly this gate's code, or none: a record made on other
    code is kept aside as stale (shown with its commit), never claimed for this code."""
    fresh_rec = rec is not None and bool(g["code"]) and rec.get("code") == g["code"]
    g["faults"] = rec if fresh_rec else None
    g["faults_stale"] = rec if rec is not None and not fresh_rec else None
    g["faults_caught"] = rec["caught"] if fresh_rec else None
    g["faults_applicable"] = rec["applicable"] if fresh_rec else None


def compare_digests(
    g: dict[str, Any], r: dict[str, Any], records: list[dict[str, Any]], prov: dict[str, Any]
) -> list[dict[str, Any]]:
    """For each recorded run of this gate's same code: are this build's digests bit-identical?"""
    mine = _check_digests(r)
    out = []
    for rec in records:
        theirs = rec["gates"].get(g["id"])
        if not theirs or theirs.get("code") != g["code"] or not g["code"]:
            continue
        shared = sorted(set(mine) & set(theirs["checks"]))
        differ = [name for name in shared if mine[name] != theirs["checks"][name]]
        same_cpu = rec["cpu"] == prov["cpu"] and rec["vector"] == prov["cpu_vector"]
        out.append(
            {
                "commit": rec["commit"],
                "built_at": rec.get("built_at", ""),
                "cpu": rec["cpu"],
                "vector": rec["vector"],
                "same_cpu": same_cpu,
                "compared": len(shared),
                # with no check digested on both sides there is nothing to compare: not
                # comparable, which is neither identical nor different
                "comparable": bool(shared),
                "differ": differ,
                "identical": bool(shared) and not differ,
            }
        )
    return out


def _check_digests(r: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c["digests"] for c in r.get("checks", []) if c.get("digests")}


def back_facts(facts: list[Fact], gates: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fact against this build's gate results: backed only when its own check passed."""
    out = []
    for f in facts:
        gate = gates.get(f.gate)
        checks = (gate or {}).get("checks") or []
        check = next((c for c in checks if c["name"] == f.check), None)
        if gate is None:
            reason = f"gate {f.gate} did not run in this build"
        elif check is None:
            status = gate.get("status", "")
            why = "" if status in ("passed", "failed") else f" (gate {f.gate}: {status})"
            reason = f"check {f.ref} does not exist in this build{why}"
        elif not check["passed"]:
            reason = f"check {f.ref} failed: {check.get('message') or 'no message'}"
        else:
            reason = ""
        out.append({"text": f.text, "check": f.ref, "backed": not reason, "reason": reason})
    return out


def _public_result(r: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "id",
        "innovation",
        "level",
        "status",
        "passed",
        "error",
        "title",
        "summary",
        "checks",
        "bounds",
        "kernels",
        "kernel_keys",
        "seconds",
        "ran",
        "run_hash",
        "reused_from",
        "artifacts",
    )
    out = {k: r.get(k) for k in keep}
    out["file"] = _rel(r.get("file", ""))
    out["line"] = r.get("line")
    out["requires"] = list(r.get("requires") or [])
    out["code"] = faultsuite.code_hash(r)
    out["runner"] = r.get("runner", "local")  # where this result was made (a reused one too)
    return out


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


# -- 6. render -----------------------------------------------------------------------------------
def _environment(templates: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        autoescape=jinja2.select_autoescape(["html", "xml", "svg"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        bytecode_cache=_bytecode_cache(),  # compiled templates, keyed by source checksum
    )
    env.filters["commas"] = lambda n: f"{n:,}"
    env.filters["num"] = _format_number
    env.filters["ylog"] = lambda v, on: math.log10(v) if on else float(v)
    env.globals["chart_axes"] = chart_axes
    env.filters["pixel_runs"] = pixel_runs
    return env


def pixel_runs(rows: list[str]) -> list[tuple[int, int, int, int, str]]:
    """Rows of RRGGBB hex pixels -> (x, y, width, height, #colour) rectangles: each run of equal
    neighbours in a row, over as many equal rows as follow it. An image drawn as few SVG
    rectangles (the CSP allows no data: URI)."""
    rects = []
    y = 0
    while y < len(rows):
        height = 1
        while y + height < len(rows) and rows[y + height] == rows[y]:
            height += 1
        colours = [rows[y][i : i + 6] for i in range(0, len(rows[y]), 6)]
        x = 0
        while x < len(colours):
            end = x
            while end < len(colours) and colours[end] == colours[x]:
                end += 1
            rects.append((x, y, end - x, height, "#" + colours[x]))
            x = end
        y += height
    return rects


def _bytecode_cache() -> jinja2.BytecodeCache:
    folder = kcompile.cache_root() / "jinja"
    folder.mkdir(parents=True, exist_ok=True)
    return jinja2.FileSystemBytecodeCache(str(folder))


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """At most `count` + 1 round values, 1, 2 or 5 times a power of ten apart, from the last one
    at or below `lo` to the first one at or above `hi`. Integers when the step is one or more."""
    if hi <= lo:
        hi = lo + 1
    power = 10.0 ** math.floor(math.log10((hi - lo) / count))
    for step in (m * power for m in (1, 2, 5, 10, 20)):  # the finest step giving <= count gaps
        first = math.floor(lo / step + 1e-9)
        last = math.ceil(hi / step - 1e-9)
        if last - first <= count:
            break
    ticks = [round(k * step, 12) for k in range(first, last + 1)]
    return [int(t) for t in ticks] if step >= 1 else ticks


def chart_axes(data: dict[str, Any]) -> dict[str, Any]:
    """The plot ranges and labelled ticks of a line chart (templates/charts.html).

    y: `y_ticks` [[value, label], ...] as given (level names), else round ticks over `y_range`
    or over the data, threshold and lines; on a log axis, powers of ten (six at most).
    x: `x_labels` (one per point: recorded builds) at four points at most, else round ticks
    inside the data.
    Returned y0, y1 are in plot space (log10 on a log axis)."""
    log_y = data.get("log_y", False)
    ys = [v for vals in data["series"].values() for v in vals
          if v is not None and (not log_y or v > 0)]  # fmt: skip
    ys += [data["threshold"]] if data.get("threshold") is not None else []
    ys += [ln["y"] for ln in data.get("lines", [])]
    xs = data["x"]
    if not xs or not ys:
        return {}
    if data.get("y_ticks"):
        yticks = [(float(v), str(label)) for v, label in data["y_ticks"]]
    elif log_y:
        low, high = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        every = max(1, math.ceil((high - low) / 5))  # decades per tick: six ticks at most
        high = low + every * max(1, math.ceil((high - low) / every))
        yticks = [(float(k), _format_number(10.0**k)) for k in range(low, high + 1, every)]
    else:
        lo, hi = data.get("y_range") or (min(ys), max(ys))
        yticks = [(float(v), _format_number(v)) for v in nice_ticks(lo, hi)]
    x0, x1 = min(xs), max(xs)
    if data.get("x_labels"):  # long labels: four at most, the outer ones kept inside the plot
        every = max(1, math.ceil(len(xs) / 4))
        picked = range(0, len(xs), every)
        xticks = [(xs[i], data["x_labels"][i],
                   "start" if i == 0 and len(picked) > 1 else "end" if i == len(xs) - 1 else
                   "middle") for i in picked]  # fmt: skip
    else:  # steps and counts are never labelled with a fraction
        whole = all(isinstance(v, int) for v in xs)
        xticks = [(v, _format_number(v), "middle") for v in nice_ticks(x0, x1)
                  if x0 <= v <= x1 and (not whole or float(v).is_integer())]  # fmt: skip
    return {
        "x0": x0,
        "x1": x1 if x1 > x0 else x0 + 1,
        "y0": yticks[0][0],
        "y1": yticks[-1][0],
        "yticks": yticks,
        "xticks": xticks,
    }


def _format_number(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def _template_error(e: Exception) -> BuildError:
    """Point at the template file and line, as Jinja rewrote the traceback to template lines."""
    if isinstance(e, jinja2.TemplateSyntaxError):
        return BuildError(f"{e.filename or e.name}:{e.lineno}: template syntax error: {e.message}")
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if f.filename.endswith((".html", ".xml", ".svg", ".j2", ".txt"))
    ]
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "template"
    return BuildError(f"{where}: {type(e).__name__}: {e}")


def render_site(s: Settings, content: Content, census: dict[str, Any]) -> tuple[Path, int]:
    """Render every page into a fresh staging folder; returns it and the number of pages."""
    builds = s.out.parent / f".{s.out.name}"
    builds.mkdir(parents=True, exist_ok=True)
    stage = builds / f"build-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        pages = _render_into(stage, s, content, census)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage, pages


def _render_into(stage: Path, s: Settings, content: Content, census: dict[str, Any]) -> int:
    env = _environment(s.templates)
    assets = copy_assets(s.content / "static", stage / "assets")
    rows = {r["id"]: r for r in census["innovations"]}
    gates = {g["id"]: g for g in census["gates"]}

    def asset(path: str) -> str:
        if path not in assets:
            raise KeyError(f"no static asset {path!r} under {s.content / 'static'}")
        return assets[path]

    common = {
        "census": census,
        "prov": census["provenance"],
        "asset": asset,
        "levels": [lvl.name for lvl in Level],
        "innovations": rows,
        "gates": gates,
        "history": content.history,
        "data": content.data,
    }
    pages: list[str] = []

    def page(url: str, template: str, origin: Path | None = None, **ctx: Any) -> None:
        try:
            html = env.get_template(template).render(**common, url=url, **ctx)
        except jinja2.TemplateNotFound as e:
            where = f"{origin}:{_field_line(ctx['page'], 'template')}" if origin else "build.py"
            raise BuildError(f"{where}: template {e.name!r} not found in {s.templates}") from e
        except Exception as e:  # a template bug: name the template file and line
            raise _template_error(e) from e
        rel = url.lstrip("/")
        target = stage / rel / "index.html" if url.endswith("/") else stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
        pages.append(url)

    hist = content.history
    x = list(range(len(hist)))
    builds = [f"{r['built_at'][:10]} {r['commit'][:7]}" for r in hist]
    coverage = {
        "x": x,
        "x_labels": builds,
        "series": {"coverage of the ten innovations (permille)": [r["permille"] for r in hist]},
        "y_range": [0, 1000],
        "xlabel": "recorded build (date, commit)",
        "ylabel": "permille",
    }
    page("/", "index.html", intro=content.index, coverage=coverage)
    for inno, pg in content.innovations.items():
        mine = [gates[g] for g in rows[inno]["gates"]]
        levels = {
            "x": x,
            "x_labels": builds,
            "series": {f"level of {pg.meta['title']}": [r["scores"].get(inno) for r in hist]},
            "y_ticks": [[int(level), level.name] for level in Level],
            "xlabel": "recorded build (date, commit)",
            "ylabel": "level",
        }
        page(
            f"/innovations/{inno}/",
            "innovation.html",
            row=rows[inno],
            page=pg,
            my_gates=mine,
            level_history=levels,
            recorded=_latest_runs(content.runs, inno),
        )
    sources: dict[Any, Any] = {}
    for g in census["gates"]:
        page(f"/gates/{g['id']}/", "gate.html", gate=g, sources=_kernel_sources(g, sources))
    for pg in content.pages:
        page(pg.meta["url"], pg.meta["template"], origin=pg.path, page=pg)
    found = [g for g in census["gates"] if g["innovation"] is None]
    page("/foundations/", "foundations.html", found=found)
    page("/404.html", "404.html")
    (stage / "census.json").write_text(json.dumps(census, indent=1) + "\n", encoding="utf-8")
    shutil.copyfile(s.content / SCHEMA_FILE, stage / SCHEMA_FILE)
    listed = [p for p in pages if p.endswith("/")]
    base = content.index.meta.get("base_url", "")
    page("/sitemap.xml", "sitemap.xml", pages=listed, base_url=base)
    return len(pages)


def _kernel_sources(g: dict[str, Any], cache: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernel modules a gate page shows, with their imports; `cache` spans one render, since
    44 gates share a handful of modules and each lookup parses the source."""
    out = []
    seen: set[str] = set()  # kernels sharing a dependency (fx) list it once; line ids stay unique
    for modname in g.get("kernels") or []:
        if modname not in cache:
            try:
                cache[modname] = kcompile.dependencies(modname)
            except kcompile.CompileError:
                cache[modname] = {}
        for name, path in cache[modname].items():
            if name in seen:
                continue
            seen.add(name)
            if path not in cache:
                cache[path] = _numbered_source(name, path)
            out.append({"module": name, "path": _rel(str(path)), "html": cache[path]})
    return out


def _numbered_source(modname: str, path: Path) -> markupsafe.Markup:
    """A module's lines, each with an anchor `<module>-L<n>`: built once per module, not per
    gate page that shows it (a template loop over every line was most of the render time)."""
    anchor = modname.replace(".", "-")  # a module name: letters, digits, _ and -, no escaping
    lines = markupsafe.escape(path.read_text(encoding="utf-8")).splitlines()
    return markupsafe.Markup(
        "".join(
            f'<span class="ln" id="{anchor}-L{n}">{n:4d}</span> {line}\n'
            for n, line in enumerate(lines, 1)
        )
    )


def copy_assets(src: Path, dst: Path) -> dict[str, str]:
    """Copy static files with a content hash in the name; returns {relative path: URL}."""
    urls: dict[str, str] = {}
    if not src.is_dir():
        return urls
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src).as_posix()
        digest = hashlib.sha256(f.read_bytes()).hexdigest()[:10]
        target = dst / f.relative_to(src).parent / f"{f.stem}.{digest}{f.suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        urls[rel] = "/assets/" + target.relative_to(dst).as_posix()
    return urls


def write_gzip_sidecars(stage: Path, previous: Path) -> None:
    """`x.gz` beside each compressible `x`, so the server never compresses on the request path.

    A file whose bytes equal the published build's copy takes that build's sidecar. Every page
    carries the build time, so a rebuild compresses every page again: zlib's level 6, because
    level 9 took 0.45 s of one core for the site's 14.9 MB (a third of a no-change rebuild) and
    saved 1.5% of the bytes (2.84 MB against 2.88 MB).
    """
    old = previous.resolve() if previous.is_symlink() else None

    def one(f: Path) -> None:
        data = f.read_bytes()
        if old is not None:
            before = old / f.relative_to(stage)
            sidecar = Path(f"{before}.gz")
            if sidecar.is_file() and before.is_file() and before.read_bytes() == data:
                shutil.copyfile(sidecar, f"{f}.gz")
                return
        Path(f"{f}.gz").write_bytes(gzip.compress(data, compresslevel=6, mtime=0))

    files = [f for f in stage.rglob("*") if f.is_file() and f.suffix in COMPRESSIBLE]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # zlib frees the GIL
        list(pool.map(one, files))


# -- 7. publish ----------------------------------------------------------------------------------
def publish(stage: Path, out: Path) -> None:
    """Point `out` at `stage` with one atomic rename of a symlink; readers see old or new, whole."""
    link_tmp = out.parent / f".{out.name}.link-{os.getpid()}"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(os.path.relpath(stage, out.parent), link_tmp)
    if out.exists() and not out.is_symlink():  # a plain folder from elsewhere: keep it aside
        os.rename(out, stage.parent / f"previous-{stage.name}")
    os.replace(link_tmp, out)
    _prune_builds(stage.parent, keep=stage)


def _prune_builds(builds: Path, keep: Path) -> None:
    old = sorted((p for p in builds.iterdir() if p.is_dir() and p != keep), key=os.path.getmtime)
    for p in old[: max(0, len(old) - (KEEP_OLD_BUILDS - 1))]:
        shutil.rmtree(p, ignore_errors=True)


# -- the building page ---------------------------------------------------------------------------
BUILDING_MARK = ".building"  # in a published building page: not the site yet, so serve rebuilds


class BuildingPage:
    """`--building-page`: a live page at `out` until the site is published (issue 18, item 5).

    A fresh checkout has nothing to serve for minutes, so `python -m serve` starts the build with
    this flag and serves at once. Every second the page is rendered again (kernel modules
    compiled, gates run, what is running, elapsed and estimated time) and published by the same
    atomic swap as the site; a meta refresh reloads it, since the CSP allows no inline script.
    A failed build leaves its error on the page. It never replaces a published site.
    """

    REFRESH_S = 2

    def __init__(self, s: Settings, progress: Progress) -> None:
        self.s, self.progress = s, progress
        self.enabled = not s.out.exists() or (s.out / BUILDING_MARK).exists()
        self.env = _environment(s.templates)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        if self.enabled:
            self.show()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def fail(self, error: str) -> None:
        self.stop()
        if self.enabled:
            self.show(error)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.show()

    def show(self, failure: str | None = None) -> None:
        with self.lock:
            builds = self.s.out.parent / f".{self.s.out.name}"
            builds.mkdir(parents=True, exist_ok=True)
            stage = Path(tempfile.mkdtemp(prefix="building-", dir=builds))
            assets = copy_assets(self.s.content / "static", stage / "assets")
            html = self.env.get_template("building.html").render(
                **self.progress.snapshot(),
                failure=failure,
                refresh=self.REFRESH_S,
                asset=assets.__getitem__,
            )
            for name in ("index.html", "404.html"):  # every address shows it meanwhile
                (stage / name).write_text(html, encoding="utf-8")
            (stage / BUILDING_MARK).write_text("published by build.py --building-page\n")
            stage.chmod(0o755)  # mkdtemp makes it private; the server may run as another user
            publish(stage, self.s.out)


# -- history -------------------------------------------------------------------------------------
def load_jsonl(path: Path, required: set[str]) -> list[dict[str, Any]]:
    """One JSON object per line of `path`, each with the `required` keys; [] when absent."""
    if not path.is_file():
        return []
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BuildError(f"{path}:{n}: not a JSON object: {e.msg}") from e
        missing = required - set(rec)
        if missing:
            raise BuildError(f"{path}:{n}: record lacks {', '.join(sorted(missing))}")
        records.append(rec)
    return records


def _latest_runs(runs: list[dict[str, Any]], inno: str) -> list[dict[str, Any]]:
    """The latest recorded run of each --scale gate of this innovation (the file is in order)."""
    latest = {r["gate"]: r for r in runs if r["innovation"] == inno}
    return [latest[g] for g in sorted(latest)]


def load_history(path: Path) -> list[dict[str, Any]]:
    """The recorded censuses, oldest first, one JSON object per line of `path`."""
    return load_jsonl(path, {"commit", "built_at", "permille", "scores"})


def _unrecordable(census: dict[str, Any]) -> bool:
    """True (and says why) unless this is a build of a commit with a clean tree."""
    prov = census["provenance"]
    if prov["git_commit"] == "unknown" or prov["git_dirty"]:
        why = "the tree has uncommitted changes" if prov["git_dirty"] else "no git commit"
        print(
            f"record: not recorded: {why}; records come only from builds of a commit",
            file=sys.stderr,
        )
        return True
    return False


def record_history(census: dict[str, Any], results: list[dict[str, Any]], s: Settings) -> int:
    """Append this build's census, if it is a real build of a commit (clean tree)."""
    if _unrecordable(census):
        return 1
    content, prov = s.content, census["provenance"]
    path = content / HISTORY_FILE
    history = load_history(path)
    if any(r["commit"] == prov["git_commit"] for r in history):
        log(f"record: commit {prov['git_commit'][:12]} is already recorded in {path}")
        record_digests(census, results, content / DIGESTS_FILE)  # another CPU may add its own
        return 0
    rec = {
        "commit": prov["git_commit"],
        "built_at": prov["built_at"],
        "permille": census["permille"],
        "scores": {r["id"]: r["score"] for r in census["innovations"]},
        "gates_passed": sum(1 for g in census["gates"] if g["passed"]),
        "gates_total": len(census["gates"]),
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    log(f"record: appended {census['permille']} permille at {prov['git_commit'][:12]} to {path}")
    record_digests(census, results, content / DIGESTS_FILE)
    return 0


def record_digests(census: dict[str, Any], results: list[dict[str, Any]], path: Path) -> None:
    """Every check's digests with the CPU and its vector extensions, one JSON line per record:
    the gate pages of later builds, on any machine, compare their digests with these."""
    prov = census["provenance"]
    rec = {
        "commit": prov["git_commit"],
        "built_at": prov["built_at"],
        "cpu": prov["cpu"],
        "vector": prov["cpu_vector"],
        "gates": {
            g["id"]: {
                "code": g["code"],
                "checks": _check_digests(r),
                "status": g["status"],
                "runner": g["runner"],
            }
            for g, r in zip(census["gates"], results, strict=True)
            if g["code"]
        },
    }
    if any(
        old["commit"] == rec["commit"]
        and old["cpu"] == rec["cpu"]
        and old["vector"] == rec["vector"]
        and _runners(old) == _runners(rec)  # a Dask run of the same commit is a record of its own
        for old in load_jsonl(path, {"commit", "cpu", "vector", "gates"})
    ):
        log(f"record: digests of {prov['git_commit'][:12]} on this CPU are already in {path}")
        return
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    log(f"record: appended the digests of {len(rec['gates'])} gates ({prov['cpu']}) to {path}")


def _runners(rec: dict[str, Any]) -> set[str]:
    return {g.get("runner", "local") for g in rec["gates"].values()}


def record_runs(census: dict[str, Any], results: list[dict[str, Any]], s: Settings) -> int:
    """Append each gate of the --scale set that ran in this build to site_src/recorded_runs.jsonl.
    The default build shows the latest run of each on its innovation's page, labelled as a
    recorded run: these gates are too large for the default build to run."""
    if _unrecordable(census):
        return 1
    prov = census["provenance"]
    scale_dirs = {p.name for p in SCALES[s.scale]}
    path = s.content / RUNS_FILE
    for g in census["gates"]:
        if Path(g["file"]).parts[0] not in scale_dirs or g["reused_from"]:
            continue  # not a --scale gate, or its result was reused rather than run here
        rec = {
            "gate": g["id"], "innovation": g["innovation"], "level": g["level"],
            "commit": prov["git_commit"], "built_at": prov["built_at"], "cpu": prov["cpu"],
            "command": f"python build.py --scale {s.scale} --only {g['id']} --record",
            "passed": g["passed"], "summary": g["summary"], "seconds": g["seconds"],
            "checks": [{k: c[k] for k in ("name", "kind", "passed", "bound", "measured", "unit")}
                       for c in g["checks"] if c["kind"] != "nofloat"],
            "artifacts": g["artifacts"],
        }  # fmt: skip
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        log(f"record: appended the run of {g['id']} at {prov['git_commit'][:12]} to {path}")
    return 0


# -- watch ---------------------------------------------------------------------------------------
def _snapshot(folders: list[Path]) -> dict[str, tuple[int, int]]:
    state = {}
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                st = p.stat()
                state[str(p)] = (st.st_mtime_ns, st.st_size)
    return state


def watch(s: Settings, poll: float = 0.5) -> int:
    """Build, then rebuild whenever a file under k3gates/, site_src/ or templates/ changes.

    Polling keeps this free of dependencies; each rebuild publishes atomically like any build.
    """
    folders = [*s.packages, s.content, s.templates]
    once = dataclasses.replace(s, watch=False)
    build(once)
    seen = _snapshot(folders)
    log(f"watch: watching {', '.join(_rel(str(f)) for f in folders)}; Ctrl-C stops")
    try:
        while True:
            time.sleep(poll)
            now = _snapshot(folders)
            if now == seen:
                continue
            changed = sorted(set(now.items()) ^ set(seen.items()))
            time.sleep(poll)  # let an editor finish writing
            seen = _snapshot(folders)
            log(f"watch: {_rel(changed[0][0])} changed; rebuilding")
            build(once)
    except KeyboardInterrupt:
        log("watch: stopped")
        return 0


# -- the end -------------------------------------------------------------------------------------
def summary(census: dict, pages: int, laps: Laps) -> None:
    prov = census["provenance"]
    passed = sum(1 for g in census["gates"] if g["passed"])
    skipped = prov["gates_skipped"]  # --only: not run, no result to reuse
    failed = len(census["gates"]) - passed - skipped
    levels = ", ".join(f"{r['id']}={r['level']}" for r in census["innovations"])
    log(f"census: {census['arithmetic']} permille; {levels}")
    steps = ", ".join(f"{k} {v:.3f} s" for k, v in laps.steps.items())
    per_page = 1000 * laps.steps.get("render", 0.0) / max(1, pages)
    log(f"time: {steps}; render {per_page:.2f} ms/page")
    slow = sorted(census["gates"], key=lambda g: -g["seconds"])[:5]
    log("slowest gates: " + ", ".join(
        f"{g['id']} {g['seconds']:.1f} s" + (" (reused)" if g["reused_from"] else "") for g in slow
    ))  # fmt: skip
    log(
        f"done: compiled {prov['modules_compiled']}, reused {prov['modules_reused']} modules; "
        f"gates ran {prov['gates_ran']}, reused {prov['gates_reused']}, "
        + (f"skipped {skipped}, " if skipped else "")
        + f"passed {passed}, failed {failed}; {pages} pages written; {laps.total:.1f} s"
    )


def verdict(census: dict, results: list[dict]) -> int:
    failed = [r for r in results if not r["passed"]]
    killed = [r for r in census["innovations"] if r["killed"]]
    struck = [(r["id"], f) for r in census["innovations"] for f in r.get("facts", [])
              if not f["backed"]]  # fmt: skip
    for r in failed:
        log(f"check: gate {r['id']} failed: {_first_failure(r)}")
    for r in killed:
        log(f"check: claim liar-killed: {r['id']}: {r['kill_reason']}")
    for inno, f in struck:
        log(f"check: fact struck through on {inno}: {f['text'][:80]!r}: {f['reason']}")
    return 1 if failed or killed or struck else 0


def log(msg: str) -> None:
    print(msg, flush=True)


if __name__ == "__main__":
    sys.exit(main())
