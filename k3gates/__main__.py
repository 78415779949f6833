"""`python -m k3gates`: query the live census, or run gates, from the terminal.

python -m k3gates census               the table of the last published build
python -m k3gates census --json        the same census.json the site serves
python -m k3gates census --site DIR    another build's folder
python -m k3gates run GATE|INNOVATION  compile what those gates need, run them, print every check
                                       (a gate author's loop: no site is rendered or published)
python -m k3gates faults GATE|INNOVATION|all
                                       rerun gates with corrupted kernel outputs; print which
                                       checks catch each fault; record it in site_src/faults.json
python -m k3gates faults --status all  run nothing: is each gate's fault record one of the code
                                       the last published build ran (its content key)?
python -m k3gates train k3mu --steps N --out DIR
                                       train K3-μ in integers with a live progress line; write the
                                       checkpoint, the curves and weight digests every K steps
python -m k3gates sample k3mu --prompt "ROMEO:" --chars 300 --seed 1
                                       text from the committed run, by the integer sampler
python -m k3gates mcp [--root DIR]     serve the last published census over MCP (stdio)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from .infra.published import DEFAULT_SITE, NoCensus, read_census


def load(site: Path) -> dict[str, Any]:
    try:
        return read_census(site)
    except NoCensus as e:
        raise SystemExit(str(e)) from None


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


def _choose(names: list[str]) -> list:
    """The gates named, or every gate of a named innovation, or `fx`, or `all`."""
    from .infra.discover import GatePackage, discover_gates
    from .infra.registry import UnknownInnovation, canonical

    sites = discover_gates([GatePackage(Path(__file__).resolve().parent)])
    chosen = []
    for name in names:
        if name == "all":
            picked = sites
        elif name in ("fx", "foundations"):
            picked = [g for g in sites if g.innovation is None]
        else:
            try:
                inno = canonical(name)
            except UnknownInnovation:
                inno = None
            picked = [g for g in sites if g.id == name or (inno and g.innovation == inno)]
        if not picked:
            raise SystemExit(f"no gate or innovation named {name!r}")
        chosen += [g for g in picked if g not in chosen]
    return chosen


def _compile_for(chosen: list) -> None:
    from .infra import compile as kcompile

    modules = sorted({m for g in chosen for m in g.kernels})
    for m in modules:
        c = kcompile.ensure(m)
        how = "reused" if c.reused else f"compiled in {c.seconds:.1f} s"
        print(f"compile: {m} {'FAILED: ' + c.error.splitlines()[0] if c.error else how}")


def run(names: list[str], jobs: int) -> int:
    """Compile the kernels the named gates (or every gate of a named innovation) declare, run
    them afresh in their own processes, and print each check. Exit 1 if any gate fails."""
    from .infra import runner

    chosen = _choose(names)
    _compile_for(chosen)
    results = runner.run_gates(chosen, jobs=jobs, reuse=False)
    for r in results:
        print(f"gate {r['id']} ({r['innovation']}, {r['level']}): {r['status']}, {r['seconds']} s")
        if r.get("error"):
            print("    " + str(r["error"]).replace("\n", "\n    "))
        for c in r.get("checks", []):
            print(_check_line(c))
    return 0 if all(r["passed"] for r in results) else 1


def faults(names: list[str], jobs: int, small: bool, record: bool, first: bool = False) -> int:
    """Run the fault suite; exit 1 if a gate fails as it is or misses an applicable fault."""
    from .infra import faultsuite

    chosen = _choose(names)
    _compile_for(chosen)

    def show(gate_id: str, rec: dict[str, Any]) -> None:
        shape = ", smaller shape" if rec["small"] else ""
        print(
            f"gate {gate_id}: baseline {rec['baseline']}{shape}; caught "
            f"{rec['caught']}/{rec['applicable']} applicable faults ({rec['seconds']} s)"
        )
        for f, entry in rec["faults"].items():
            print(faultsuite.line(f, entry))

    records = faultsuite.run_suite(
        chosen, jobs=jobs, small=small, first_failure=first, on_gate=show
    )
    root = Path(__file__).resolve().parent.parent
    if record:
        faultsuite.save(
            records, root / "site_src" / faultsuite.FAULTS_FILE, faultsuite.provenance(root)
        )
    missed = [
        (g, f)
        for g, r in records.items()
        for f, e in r["faults"].items()
        if e["status"] == "missed"
    ]
    broken = [g for g, r in records.items() if r["baseline"] != "passed"]
    caught = sum(r["caught"] for r in records.values())
    applicable = sum(r["applicable"] for r in records.values())
    print(
        f"faults: {len(records)} gates; {caught}/{applicable} applicable faults caught; "
        f"{len(missed)} missed; {len(broken)} gates failing without a fault"
    )
    for g, f in missed:
        print(f"faults: MISSED {f} in {g}")
    return 1 if missed or broken else 0


def fault_status(names: list[str], site: Path, records_file: Path | None = None) -> int:
    """For each chosen gate, whether site_src/faults.json holds a record made on the code the
    last published build ran (records are keyed by content, so a moved file keeps its record).
    Exit 1 if any is stale or missing."""
    from .infra import faultsuite

    chosen = _choose(names)
    built = {g["id"]: g for g in load(site)["gates"]}
    root = Path(__file__).resolve().parent.parent
    records = faultsuite.load(records_file or root / "site_src" / faultsuite.FAULTS_FILE)
    counts = {"current": 0, "stale": 0, "none": 0}
    for site_ in chosen:
        rec, code = records.get(site_.id), built.get(site_.id, {}).get("code", "")
        if rec is None:
            state, note = "none", "no fault record"
        elif code and rec.get("code") == code:
            state = "current"
            note = f"{rec['caught']}/{rec['applicable']} caught, recorded at {rec['commit'][:10]}"
        else:
            state = "stale"
            note = (f"recorded on code {rec.get('code')} at {rec.get('commit', '?')[:10]}; "
                    f"the build ran code {code or '(not in the build)'}")  # fmt: skip
        counts[state] += 1
        print(f"{site_.id:<28} {state:<8} {note}")
    print(f"faults: {counts['current']} current, {counts['stale']} stale, {counts['none']} "
          f"without a record, of {len(chosen)} gates")  # fmt: skip
    return 0 if counts["current"] == len(chosen) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3gates", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census", help="print the census of the last published build")
    c.add_argument("--json", action="store_true", help="print census.json as it is served")
    c.add_argument("--site", type=Path, default=DEFAULT_SITE, help="a published site folder")
    r = sub.add_parser("run", help="compile and run gates, printing every check")
    r.add_argument("names", nargs="+", metavar="GATE|INNOVATION")
    r.add_argument("--jobs", "-j", type=int, default=2)
    f = sub.add_parser("faults", help="rerun gates with corrupted kernel outputs")
    f.add_argument("names", nargs="+", metavar="GATE|INNOVATION|all")
    f.add_argument("--jobs", "-j", type=int, default=2)
    f.add_argument(
        "--small", action="store_true", help="let long gates run their smaller shape (same bounds)"
    )
    f.add_argument(
        "--first",
        action="store_true",
        help="stop each faulted run at its first failed check (faster; table lists one check)",
    )
    f.add_argument("--no-record", action="store_true", help="do not write site_src/faults.json")
    f.add_argument(
        "--status",
        action="store_true",
        help="run nothing: say whether each record is of the last build's code",
    )
    f.add_argument("--site", type=Path, default=DEFAULT_SITE, help="a published site folder")
    t = sub.add_parser("train", help="train K3-μ in integers (a long run, recorded)")
    t.add_argument("model", choices=["k3mu"])
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--every", type=int, default=50, help="record a weight digest every K steps")
    s = sub.add_parser("sample", help="sample text from a K3-μ checkpoint, in integers")
    s.add_argument("model", choices=["k3mu"])
    s.add_argument("--prompt", default="ROMEO:")
    s.add_argument("--chars", type=int, default=300)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=20)
    s.add_argument(
        "--run", type=Path, default=None, help="a run folder (default: the committed one)"
    )
    m = sub.add_parser("mcp", help="serve the published census over MCP (stdio)")
    m.add_argument("--root", type=Path, default=DEFAULT_SITE, help="a published site folder")
    args = p.parse_args(argv)
    if args.command == "mcp":
        from .infra import mcp_server

        mcp_server.server(args.root.resolve()).run()
        return 0
    if args.command == "train":
        from .k3mu import cli

        if args.steps < 1 or args.every < 1:
            raise SystemExit("--steps and --every must be positive")
        return cli.train_command(args.steps, args.out, args.seed, args.every)
    if args.command == "sample":
        from .k3mu import cli

        try:
            return cli.sample_command(args.prompt, args.chars, args.seed, args.temperature,
                                      args.top_k, args.run or cli.RUNS / "long")  # fmt: skip
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"sample: {e}") from None
    if args.command == "run":
        return run(args.names, max(1, args.jobs))
    if args.command == "faults" and args.status:
        return fault_status(args.names, args.site)
    if args.command == "faults":
        return faults(
            args.names, max(1, args.jobs), args.small, not args.no_record and not args.first,
            args.first,
        )  # fmt: skip
    census = load(args.site)
    if args.json:
        print(json.dumps(census, indent=1))
    else:
        print(table(census, shutil.get_terminal_size((120, 20)).columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
