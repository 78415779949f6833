"""`python -m k3gates census`: query the live census from the terminal.

python -m k3gates census               the table of the last published build
python -m k3gates census --json        the same census.json the site serves
python -m k3gates census --site DIR    another build's folder
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3gates", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census", help="print the census of the last published build")
    c.add_argument("--json", action="store_true", help="print census.json as it is served")
    c.add_argument("--site", type=Path, default=DEFAULT_SITE, help="a published site folder")
    args = p.parse_args(argv)
    census = load(args.site)
    if args.json:
        print(json.dumps(census, indent=1))
    else:
        print(table(census, shutil.get_terminal_size((120, 20)).columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
