"""The census.json of a published build, read for the terminal (`python -m k3gates census`) and
for MCP (`python -m k3gates mcp`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_SITE = Path(__file__).resolve().parents[2] / "public"  # the checkout's public/


class NoCensus(Exception):
    """No readable census.json in the folder; the message says what to run."""


def read_census(site: Path) -> dict[str, Any]:
    path = site / "census.json"
    if not path.is_file():
        raise NoCensus(f"no published build at {site}: run `python build.py`, or name another "
                       "build's folder")  # fmt: skip
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise NoCensus(f"{path}:{e.lineno}: not valid JSON ({e.msg}); rebuild it") from None
