"""The site generator: content + gate results + census -> templates -> public/.

    python build.py                 compile what changed, run (or reuse) the gates, render, publish
    python build.py --check         the same, then exit 1 if a gate fails or a claim is liar-killed
    python build.py --rerun         ignore reusable gate results and run every gate
    python build.py --only GATE     run only this gate (others keep their reusable results)

The pipeline is `main()`, top to bottom. Every step that can be wrong about its input raises
BuildError naming the file and the reason; the previous `public/` is then left as it was.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from k3gates import compile as kcompile  # noqa: E402
from k3gates import runner  # noqa: E402
from k3gates.census import census as compute_census  # noqa: E402
from k3gates.discover import (  # noqa: E402
    DiscoveryError,
    GatePackage,
    GateSite,
    discover_gates,
    kernel_modules,
)
from k3gates.registry import INNOVATIONS, Level, UnknownInnovation, canonical  # noqa: E402

CENSUS_SCHEMA = "k3-census/1"
COMPRESSIBLE = {".html", ".css", ".js", ".json", ".svg", ".xml", ".txt", ".map"}
KEEP_OLD_BUILDS = 2  # the current site plus one older, so in-flight requests can finish


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
    check: bool = False  # exit non-zero on a failed gate or a liar-killed claim


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
    p.add_argument("--jobs", "-j", type=int, default=Settings.jobs)
    p.add_argument("--rerun", action="store_true", help="run every gate, reuse nothing")
    p.add_argument("--only", action="append", default=[], metavar="GATE")
    p.add_argument(
        "--check", action="store_true", help="exit 1 if any gate fails or any claim is liar-killed"
    )
    a = p.parse_args(argv)
    return Settings(
        content=a.content.resolve(),
        templates=a.templates.resolve(),
        out=a.out.absolute(),
        jobs=max(1, a.jobs),
        rerun=a.rerun,
        packages=(*Settings.packages, *(g.resolve() for g in a.gates_from)),
        only=tuple(a.only),
        check=a.check,
    )


def log(msg: str) -> None:
    print(msg, flush=True)


# -- the pipeline --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    started = time.perf_counter()
    try:
        packages = [GatePackage(p) for p in s.packages]
        gates = discover(packages, s.only)  # 1. discover gates and content
        content = load_content(s.content)
        compiled = compile_kernels(packages, s.jobs)  # 2-3. validate ids, compile what changed
        results = run_gates(gates, s)  # 4. run the gates, in parallel, with timeouts
        census = build_census(results, content, compiled)  # 5. the census
        staged = render_site(s, content, census, results)  # 6. render into a staging folder
        publish(staged, s.out)  # 7. swap it in atomically
    except BuildError as e:
        print(f"build failed: {e}", file=sys.stderr)
        print(f"{s.out} was left unchanged.", file=sys.stderr)
        return 1
    summary(census, compiled, results, time.perf_counter() - started)
    return verdict(census, results) if s.check else 0


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


MARKDOWN = MarkdownIt("commonmark", {"html": False, "typographer": True}).enable("table")
FRONT_MATTER = "+++"


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
    body = "\n".join(lines[end + 1 :])
    return Page(path, meta, MARKDOWN.render(body), end + 2)


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
    result = Content(index=read_page(index_file))
    for path in sorted((content / "innovations").glob("*.md")):
        page = read_page(path)
        raw_id = _require(page, "id", str)
        try:
            inno = canonical(raw_id)
        except UnknownInnovation as e:
            raise BuildError(f"{path}:{_field_line(page, 'id')}: {e}") from e
        if inno in result.innovations:
            other = result.innovations[inno].path
            raise BuildError(
                f"{path}:{_field_line(page, 'id')}: id {raw_id!r} claims the slot "
                f"{inno!r}, which {other} already claims"
            )
        _require(page, "title", str)
        try:
            result.claims[inno] = Level.parse(_require(page, "claim", str))
        except ValueError as e:
            raise BuildError(f"{path}:{_field_line(page, 'claim')}: `claim`: {e}") from e
        for ref in page.meta.get("references", []):
            if not isinstance(ref, dict) or "title" not in ref:
                raise BuildError(
                    f"{path}:{_field_line(page, 'references')}: each reference "
                    "needs a title (and an arxiv id or a url)"
                )
        result.innovations[inno] = page
    missing = [i for i in INNOVATIONS if i not in result.innovations]
    if missing:
        raise BuildError(f"{content / 'innovations'}: no page for {', '.join(missing)}")
    return result


# -- 3. compile ----------------------------------------------------------------------------------
def compile_kernels(packages: list[GatePackage], jobs: int) -> list[kcompile.Compiled]:
    """Compile every kernels module whose key the cache lacks; bad kernels fail their gates."""
    from concurrent.futures import ThreadPoolExecutor

    for pkg in packages:  # the runner and this process must resolve the same modules
        if str(pkg.root) not in sys.path:
            sys.path.insert(0, str(pkg.root))
    modules = kernel_modules(packages)
    todo = [m for m in modules if not _cached(m)]
    if todo:
        log(
            f"compile: {len(todo)} of {len(modules)} kernel modules changed; compiling "
            f"{', '.join(todo)}"
        )
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(kcompile.ensure, modules))
    for c in done:
        if c.error:
            log(f"compile: {c.modname} FAILED (its gates will fail): {c.error.splitlines()[0]}")
        elif not c.reused:
            log(f"compile: {c.modname} compiled in {c.seconds:.1f} s")
    if not todo:
        log(f"compile: nothing to compile; all {len(modules)} kernel modules reused from the cache")
    return done


def _cached(modname: str) -> bool:
    try:
        return kcompile._read_entry(modname, kcompile.module_key(modname)) is not None
    except (kcompile.CompileError, OSError):
        return False


# -- 4. gates ------------------------------------------------------------------------------------
def run_gates(gates: list[GateSite], s: Settings) -> list[dict[str, Any]]:
    shown: dict[str, str] = {}

    def on_event(kind: str, site: GateSite, result: dict | None) -> None:
        if kind == "done" and result is not None:
            how = "ran" if result["ran"] else f"reused {result.get('reused_from', '')}"
            why = "" if result["passed"] else f": {_first_failure(result)}"
            log(
                f"gate: {site.id:<22} {result['status']:<13} "
                f"({how}, {result['seconds']:.1f} s){why}"
            )
            shown[site.id] = result["status"]

    forced = set(s.only)
    if forced:
        first = runner.run_gates(
            [g for g in gates if g.id in forced], jobs=s.jobs, reuse=False, on_event=on_event
        )
        rest = runner.run_gates(
            [g for g in gates if g.id not in forced],
            jobs=s.jobs,
            reuse=not s.rerun,
            on_event=on_event,
        )
        by_id = {r["id"]: r for r in runner.apply_foundations(first + rest)}
        results = [by_id[g.id] for g in gates]
    else:
        results = runner.apply_foundations(
            runner.run_gates(gates, jobs=s.jobs, reuse=not s.rerun, on_event=on_event)
        )
    for r in results:  # verdicts that changed once the foundations gates were known
        if shown.get(r["id"]) != r["status"]:
            log(f"gate: {r['id']:<22} {r['status']:<13} (after foundations): {_first_failure(r)}")
    return results


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
        "flags": tc["flags"],
        "gate_seconds": round(sum(r.get("seconds", 0.0) for r in results if r.get("ran")), 3),
        "gates_ran": sum(1 for r in results if r.get("ran")),
        "gates_reused": sum(1 for r in results if not r.get("ran")),
        "modules_compiled": sum(1 for c in compiled if not c.reused),
        "modules_reused": sum(1 for c in compiled if c.reused),
    }


def build_census(
    results: list[dict[str, Any]], content: Content, compiled: list[kcompile.Compiled]
) -> dict[str, Any]:
    table = compute_census(results, content.claims)
    for row in table["innovations"]:
        page = content.innovations[row["id"]]
        hints = page.meta.get("next", {})
        next_level = Level(min(row["score"] + 1, Level.PROVEN)).name
        row["next"] = (
            row["blocker"] if "fails" in row["blocker"] else hints.get(next_level, row["blocker"])
        )
        row["title"] = page.meta["title"]
    return {
        "schema": CENSUS_SCHEMA,
        "provenance": provenance(results, compiled),
        **table,
        "arithmetic": f"floor(1000 × {table['score_sum']} / {table['score_max']}) = "
        f"{table['permille']}",
        "gates": [_public_result(r) for r in results],
    }


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
    )
    env.filters["commas"] = lambda n: f"{n:,}"
    env.filters["num"] = _format_number
    env.filters["ylog"] = lambda v, on: math.log10(v) if on else float(v)
    env.filters["yunlog"] = lambda v, on: 10.0**v if on else v
    return env


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


def render_site(
    s: Settings, content: Content, census: dict[str, Any], results: list[dict[str, Any]]
) -> Path:
    builds = s.out.parent / f".{s.out.name}"
    builds.mkdir(parents=True, exist_ok=True)
    stage = builds / f"build-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        _render_into(stage, s, content, census, results)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage


def _render_into(
    stage: Path,
    s: Settings,
    content: Content,
    census: dict[str, Any],
    results: list[dict[str, Any]],
) -> None:
    env = _environment(s.templates)
    assets = copy_assets(s.content / "static", stage / "assets")
    rows = {r["id"]: r for r in census["innovations"]}
    gates = {g["id"]: g for g in census["gates"]}
    common = {
        "census": census,
        "prov": census["provenance"],
        "asset": lambda p: assets[p],
        "levels": [lvl.name for lvl in Level],
        "innovations": rows,
        "gates": gates,
    }
    pages: list[str] = []

    def page(url: str, template: str, **ctx: Any) -> None:
        try:
            html = env.get_template(template).render(**common, url=url, **ctx)
        except jinja2.TemplateError as e:
            raise _template_error(e) from e
        except Exception as e:
            raise _template_error(e) from e
        rel = url.lstrip("/")
        target = stage / rel / "index.html" if url.endswith("/") else stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
        if url.endswith("/"):
            pages.append(url)

    page("/", "index.html", intro=content.index)
    for inno, pg in content.innovations.items():
        mine = [gates[g] for g in rows[inno]["gates"]]
        page(f"/innovations/{inno}/", "innovation.html", row=rows[inno], page=pg, my_gates=mine)
    for g in census["gates"]:
        page(f"/gates/{g['id']}/", "gate.html", gate=g, sources=_kernel_sources(g))
    page(
        "/foundations/",
        "foundations.html",
        found=[g for g in census["gates"] if g["innovation"] is None],
    )
    page("/404.html", "404.html")
    (stage / "census.json").write_text(json.dumps(census, indent=1, sort_keys=False) + "\n")
    page(
        "/sitemap.xml", "sitemap.xml", pages=pages, base_url=content.index.meta.get("base_url", "")
    )
    write_gzip_sidecars(stage)


def _kernel_sources(g: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for modname in g.get("kernels") or []:
        try:
            for name, path in kcompile.dependencies(modname).items():
                out.append(
                    {
                        "module": name,
                        "path": _rel(str(path)),
                        "lines": path.read_text(encoding="utf-8").splitlines(),
                    }
                )
        except (kcompile.CompileError, OSError):
            continue
    return out


def copy_assets(src: Path, dst: Path) -> dict[str, str]:
    """Copy static files with a content hash in the name; returns {relative path: URL}."""
    urls: dict[str, str] = {}
    if not src.is_dir():
        return urls
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src).as_posix()
        digest = hashlib.sha256(f.read_bytes()).hexdigest()[:10]
        name = f"{f.stem}.{digest}{f.suffix}"
        target = dst / f.relative_to(src).parent / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        urls[rel] = "/assets/" + target.relative_to(dst).as_posix()
    return urls


def write_gzip_sidecars(stage: Path) -> None:
    """`x.gz` beside each compressible `x`, so the server never compresses on the request path."""
    for f in list(stage.rglob("*")):
        if f.is_file() and f.suffix in COMPRESSIBLE:
            data = f.read_bytes()
            Path(f"{f}.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))


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
    old = sorted(
        (p for p in builds.iterdir() if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime
    )
    for p in old[: max(0, len(old) - (KEEP_OLD_BUILDS - 1))]:
        shutil.rmtree(p, ignore_errors=True)


# -- the end -------------------------------------------------------------------------------------
def summary(
    census: dict, compiled: list[kcompile.Compiled], results: list[dict], seconds: float
) -> None:
    prov = census["provenance"]
    failed = [r["id"] for r in results if not r["passed"]]
    log(
        f"census: {census['arithmetic']} permille; "
        + ", ".join(f"{r['id']}={r['level']}" for r in census["innovations"])
    )
    log(
        f"done: compiled {prov['modules_compiled']}, reused {prov['modules_reused']} modules; "
        f"gates ran {prov['gates_ran']}, reused {prov['gates_reused']}, "
        f"passed {len(results) - len(failed)}, failed {len(failed)}; {seconds:.1f} s"
    )


def verdict(census: dict, results: list[dict]) -> int:
    failed = [r for r in results if not r["passed"]]
    killed = [r for r in census["innovations"] if r["killed"]]
    for r in failed:
        log(f"check: gate {r['id']} failed: {_first_failure(r)}")
    for r in killed:
        log(f"check: claim liar-killed: {r['id']}: {r['kill_reason']}")
    return 1 if failed or killed else 0


if __name__ == "__main__":
    sys.exit(main())
