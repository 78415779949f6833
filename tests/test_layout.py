"""The layout holds: one home per primitive, imports one way, no cycle (docs/DESIGN.md section 2).

Every rule is computed from the source tree (the ASTs and the folders), not from a list kept
beside it, so a new file is held to it the day it is added. Each rule is also shown failing on a
small tree that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from k3gates.infra.discover import GatePackage, discover_gates

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "k3gates"

# infrastructure <- foundations <- primitives <- K3 block and K3-mu <- tasks
RANKS = {"infra": 0, "fx": 1, "gemm": 1, "k3block": 3, "k3mu": 3, "tasks": 4}
PRIMITIVE_RANK = 2
FOUNDATIONS = {"fx", "gemm"}
COMPOSITES = {"k3block", "k3mu", "tasks"}  # their gates compose several primitives


def modules(package: Path) -> dict[str, Path]:
    """{dotted name: file} of every module under `package` (its parent is the sys.path entry)."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = f.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `file` imports, at any depth of its code (a lazy import inside a
    function is an edge too): `from p import m` names the module p.m when there is one."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(file.read_bytes(), filename=str(file))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports(name, f, known) for name, f in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


FOLDERS = {f"k3gates.{d.name}" for d in PACKAGE.iterdir() if d.is_dir()}


def rank(name: str) -> int | None:
    top = name.split(".")[1] if name.count(".") else ""
    if not top or f"k3gates.{top}" not in FOLDERS:
        return None  # k3gates/__main__.py, the command line, sits above everything
    return RANKS.get(top, PRIMITIVE_RANK)


def is_gate_module(name: str) -> bool:
    stem = name.rpartition(".")[2]
    return (stem == "gate" or stem.startswith("gate_")) and not name.startswith("k3gates.infra.")


def is_kernel_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("kernels")


def problems(package: Path) -> dict[str, list]:
    edges = graph(package)
    out: dict[str, list] = {"cycles": cycles(edges), "infra": [], "face": [], "direction": []}
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            if a.split(".")[1:2] == ["infra"] and b.split(".")[1:2] != ["infra"]:
                out["infra"].append((a, b))
            if is_gate_module(b) and not is_gate_module(a):
                out["face"].append((a, b))
            ra, rb = rank(a), rank(b)
            if not is_gate_module(a) and ra is not None and rb is not None and rb > ra:
                out["direction"].append((a, b))
    return out


def test_the_project_has_no_import_cycle():
    assert problems(PACKAGE)["cycles"] == []


def test_the_infrastructure_imports_nothing_but_itself():
    """No kernel, no primitive, no model: the gate API and the runners know no operator."""
    assert problems(PACKAGE)["infra"] == []


def test_no_module_but_a_gate_imports_a_gate_module():
    """A gate module is a leaf: a library face, a layer or a task never imports one."""
    assert problems(PACKAGE)["face"] == []


def test_imports_run_from_tasks_down_to_the_infrastructure():
    assert problems(PACKAGE)["direction"] == []


def private_imports(package: Path) -> list[tuple[str, str]]:
    """(module, name) for each `from m import _name` of a project module: a name another module
    needs is public."""
    known = modules(package)
    out = []
    for name, file in known.items():
        for node in ast.walk(ast.parse(file.read_bytes(), filename=str(file))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                out += [
                    (name, a.name)
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return out


def test_no_module_imports_a_private_name_of_another():
    assert private_imports(PACKAGE) == []


def test_every_folder_of_python_files_is_a_package():
    bare = [
        d.relative_to(ROOT).as_posix()
        for d in sorted({f.parent for f in PACKAGE.rglob("*.py")})
        if not (d / "__init__.py").is_file()
    ]
    assert bare == []


def misplaced_gates(package: Path) -> list[tuple[str, str, str]]:
    """(gate id, module, why) for each gate not in its primitive's home. A gate in a primitive's
    folder proves that primitive: it declares a kernel of that folder. A gate whose kernels all
    belong to one primitive (foundations aside) lives in that primitive's folder, unless it is a
    composite's (k3block/, k3mu/, tasks/ compose several primitives)."""
    wrong = []
    for site in discover_gates([GatePackage(package)]):
        home = site.module.split(".")[1]
        owners = {k.split(".")[1] for k in site.kernels} - FOUNDATIONS
        if home in COMPOSITES or home in FOUNDATIONS:
            continue
        if site.kernels and home not in owners:
            wrong.append((site.id, site.module, f"declares no kernel of {home}/"))
        if len(owners) == 1 and owners != {home}:
            wrong.append((site.id, site.module, f"proves only {owners.pop()}/'s kernels"))
    return wrong


def test_every_gate_lives_in_its_primitives_folder_or_a_composite_one():
    assert misplaced_gates(PACKAGE) == []


CITED = re.compile(r"\b([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*\.md)\b")
OUTSIDE = re.compile(r"\.\./shared/|(?<![\w.])shared/(?:DESIGN|K3-SPEC|INTEGER-NOTES|STYLE)")


def _project_texts() -> list[Path]:
    skip = {".git", "public", "__pycache__"}
    return [
        f
        for f in sorted(ROOT.rglob("*"))
        if f.suffix in (".py", ".md") and f.is_file() and not skip & set(f.relative_to(ROOT).parts)
    ]


def test_every_document_the_code_cites_is_in_the_repository():
    """DESIGN.md, K3-SPEC.md, PROVENANCE.md...: each named document is a file of this tree, and
    nothing points at a folder outside it."""
    names = {f.name for f in ROOT.rglob("*.md") if ".git" not in f.parts}
    assert {"DESIGN.md", "K3-SPEC.md"} <= {f.name for f in (ROOT / "docs").iterdir()}
    missing, outside = [], []
    for f in _project_texts():
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".py":
            missing += [(f.name, m) for m in CITED.findall(text) if m not in names]
        outside += [f.name for _ in OUTSIDE.finditer(text)]
    assert missing == [] and outside == []


# -- each rule, broken on purpose -----------------------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "k3gates"


GATE = """from ..infra.gate import gate
from . import kernels


@gate("a_gate", innovation="kda", level="HAVE", kernels=["{kernels}"])
def a_gate(ctx):
    pass
"""
BASE = {
    "k3gates/__init__.py": "",
    "k3gates/infra/__init__.py": "",
    "k3gates/infra/gate.py": "def gate(*a, **k):\n    return lambda f: f\n",
    "k3gates/fx/__init__.py": "",
    "k3gates/fx/kernels.py": "def one():\n    return 1\n",
    "k3gates/kda/__init__.py": "from .kernels import two\n",
    "k3gates/kda/kernels.py": "from ..fx.kernels import one\n\ndef two():\n    return 2 * one()\n",
    "k3gates/kda/gate.py": GATE.format(kernels="k3gates.kda.kernels"),
    "k3gates/tasks/__init__.py": "",
    "k3gates/tasks/mqar/__init__.py": "from ...kda import two\n",
}


def test_a_clean_tree_passes(tmp_path):
    assert misplaced_gates(_tree(tmp_path, BASE)) == []
    assert problems(_tree(tmp_path, BASE)) == {
        "cycles": [],
        "infra": [],
        "face": [],
        "direction": [],
    }


@pytest.mark.parametrize(
    ("rule", "edit"),
    [
        ("cycles", {"k3gates/fx/kernels.py": "def one():\n    from ..kda import kernels\n"}),
        ("infra", {"k3gates/infra/gate.py": "from ..kda import kernels\n"}),
        ("face", {"k3gates/kda/__init__.py": "from .gate import kernels\n"}),
        ("direction", {"k3gates/kda/kernels.py": "from ..tasks import mqar\n"}),
    ],
)
def test_each_rule_fails_on_a_tree_that_breaks_it(tmp_path, rule, edit):
    found = problems(_tree(tmp_path, {**BASE, **edit}))
    assert found[rule], found


def test_a_private_import_is_found(tmp_path):
    broken = {**BASE, "k3gates/kda/__init__.py": "from .kernels import _helper\n"}
    assert private_imports(_tree(tmp_path, broken)) == [("k3gates.kda", "_helper")]


def test_a_gate_away_from_its_primitives_home_is_found(tmp_path):
    moved = {**BASE, "k3gates/kda/gate.py": GATE.format(kernels="k3gates.fx.kernels")}
    moved["k3gates/fx/gate.py"] = moved.pop("k3gates/kda/gate.py")
    assert misplaced_gates(_tree(tmp_path / "a", moved)) == []  # a foundation's own gate
    away = {**BASE, "k3gates/mla/__init__.py": ""}
    away["k3gates/mla/gate.py"] = away.pop("k3gates/kda/gate.py")
    found = misplaced_gates(_tree(tmp_path / "b", away))
    assert [why for _, _, why in found] == [
        "declares no kernel of mla/",
        "proves only kda/'s kernels",
    ]
