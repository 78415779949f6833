"""`python -m k3gates`: query the live census, or run gates, from the terminal.

python -m k3gates census               the table of the last published build
python -m k3gates census --json        the same census.json the site serves
python -m k3gates census --site DIR    another build's folder
python -m k3gates run GATE|INNOVATION  compile what those gates need, run them, print every check
                                       (a gate author's loop: no site is rendered or published)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

DEFAULT_SITE = Path(__file__).resolve().parent.parent / "public"


def load(site: Path) -> dict[str, Any]:
    path = site / "census.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no census here; run `python build.py` first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


def table(census: dict[str, Any], width: int) -> str:
    head = ("innovation", "level", "claim", "gates", "checks", "evidence / next step")
    rows = []
    for r in census["innovations"]:
        claim = f"~{r['claim']}~ killed" if r["killed"] else r["claim"]
        note = r["evidence"] or f"next: {r['next']}"
        rows.append(
            (
                r["id"],
                r["level"],
                claim,
                f"{r['gates_passed']}/{r['gates_total']}",
                f"{r['checks_passed']}/{r['checks_total']}",
                note,
            )
        )
    cols = [max(len(str(x[i])) for x in [head, *rows]) for i in range(5)]
    used = sum(cols) + 2 * 5
    lines = []
    for x in [head, *rows]:
        fixed = "  ".join(str(v).ljust(w) for v, w in zip(x[:5], cols, strict=True))
        lines.append(f"{fixed}  {str(x[5])[: max(20, width - used)]}")
    lines.insert(1, "-" * min(width, used + 40))
    prov = census["provenance"]
    dirty = " (dirty)" if prov["git_dirty"] else ""
    lines += [
        "",
        f"permille: {census['arithmetic']}",
        f"built {prov['built_at']} at {prov['git_commit'][:12]}{dirty}; "
        f"{sum(g['passed'] for g in census['gates'])}/{len(census['gates'])} gates pass",
    ]
    return "\n".join(lines)


def _check_line(c: dict[str, Any]) -> str:
    mark = "ok  " if c["passed"] else "FAIL"
    figure = ""
    if c.get("bound") is not None:
        figure = f"  {c['measured']:.6g} <= {c['bound']:.6g} {c.get('unit', '')}".rstrip()
    why = f"  -- {c['message'][:200]}" if c.get("message") else ""
    return f"    {mark} {c['name']}{figure}{why}"


def run(names: list[str], jobs: int) -> int:
    """Compile the kernels the named gates (or every gate of a named innovation) declare, run
    them afresh in their own processes, and print each check. Exit 1 if any gate fails."""
    from . import compile as kcompile
    from . import runner
    from .discover import GatePackage, discover_gates, kernel_modules
    from .registry import UnknownInnovation, canonical

    pkg = GatePackage(Path(__file__).resolve().parent)
    sites = discover_gates([pkg])
    chosen = []
    for name in names:
        try:
            inno = canonical(name)
        except UnknownInnovation:
            inno = None
        picked = [g for g in sites if g.id == name or (inno and g.innovation == inno)]
        if name in ("fx", "foundations"):
            picked = [g for g in sites if g.innovation is None]
        if not picked:
            raise SystemExit(f"no gate or innovation named {name!r}")
        chosen += [g for g in picked if g not in chosen]
    modules = sorted({m for g in chosen for m in (g.kernels or ())})
    if any(g.kernels is None for g in chosen):
        modules = kernel_modules([pkg])
    for m in modules:
        c = kcompile.ensure(m)
        how = "reused" if c.reused else f"compiled in {c.seconds:.1f} s"
        print(f"compile: {m} {'FAILED: ' + c.error.splitlines()[0] if c.error else how}")
    results = runner.run_gates(chosen, jobs=jobs, reuse=False)
    for r in results:
        print(f"gate {r['id']} ({r['innovation']}, {r['level']}): {r['status']}, {r['seconds']} s")
        if r.get("error"):
            print("    " + str(r["error"]).replace("\n", "\n    "))
        for c in r.get("checks", []):
            print(_check_line(c))
    return 0 if all(r["passed"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3gates", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census", help="print the census of the last published build")
    c.add_argument("--json", action="store_true", help="print census.json as it is served")
    c.add_argument("--site", type=Path, default=DEFAULT_SITE, help="a published site folder")
    r = sub.add_parser("run", help="compile and run gates, printing every check")
    r.add_argument("names", nargs="+", metavar="GATE|INNOVATION")
    r.add_argument("--jobs", "-j", type=int, default=2)
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args.names, max(1, args.jobs))
    census = load(args.site)
    if args.json:
        print(json.dumps(census, indent=1))
    else:
        print(table(census, shutil.get_terminal_size((120, 20)).columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
