"""Discovery reads the @gate decorators from the AST; a good file's gates are memoised on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3gates.infra import compile as kc
from k3gates.infra.discover import DiscoveryError, GatePackage, discover_gates, gate_files

GOOD = """
from k3gates.infra.gate import gate

@gate("kda_one", innovation="kda", level="HAVE", timeout=12, requires=["kda_two"])
def one(ctx):
    pass

@gate("kda_two", innovation="kda", level="PARTIAL", kernels=["k3gates.kda.kernels"])
def two(ctx):
    pass
"""


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GatePackage:
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    (tmp_path / "gp" / "kda").mkdir(parents=True)
    (tmp_path / "gp" / "__init__.py").write_text("")
    (tmp_path / "gp" / "kda" / "gate.py").write_text(GOOD)
    return GatePackage(tmp_path / "gp")


def _memos() -> list[Path]:
    return sorted((kc.cache_root() / "memo").glob("gates-*.json"))


def test_the_memo_gives_the_sites_a_parse_gives(pkg: GatePackage):
    parsed = discover_gates([pkg])
    assert [s.id for s in parsed] == ["kda_one", "kda_two"] and len(_memos()) == 1
    assert parsed[0].timeout == 12 and parsed[0].requires == ("kda_two",)
    assert parsed[1].kernels == ("k3gates.kda.kernels",) and parsed[1].level.name == "PARTIAL"
    assert discover_gates([pkg]) == parsed  # from the memo, field for field


def test_the_project_gates_are_the_same_from_the_memo(tmp_path, monkeypatch):
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    project = [GatePackage(Path(__file__).parents[1] / "k3gates")]
    parsed = discover_gates(project)
    # one memo per gate file read (infra/gate.py, the API, is read and holds none)
    assert len(_memos()) == len(gate_files(project[0])) > len({s.file for s in parsed}) > 20
    assert discover_gates(project) == parsed


def test_an_edit_after_a_memoised_run_is_seen_and_a_bad_file_is_not_memoised(pkg: GatePackage):
    discover_gates([pkg])
    gate_py = pkg.path / "kda" / "gate.py"
    gate_py.write_text(GOOD.replace('"kda_two", innovation', '"kda two", innovation'))
    for _ in range(2):
        with pytest.raises(DiscoveryError, match=rf"{gate_py}:8: gate id 'kda two' is not an"):
            discover_gates([pkg])
    assert len(_memos()) == 1  # the good version's only


# -- kernels= named through module-level literals --------------------------------------------------
NAMED = """
from k3gates.infra.gate import gate

from ..shared.names import KERNELS
from ..shared import names as N

LOCAL = [KERNELS["a"], "k3gates.fx.kernels"]


@gate("kda_named", innovation="kda", level="HAVE", kernels=[*KERNELS.values(), N.EXTRA])
def named(ctx):
    pass


@gate("kda_local", innovation="kda", level="HAVE", kernels=tuple(LOCAL))
def local(ctx):
    pass
"""
NAMES = """
KERNELS = {"a": "k3gates.kda.kernels", "b": "k3gates.mla.kernels"}
EXTRA = "k3gates.moe.kernels"
"""


@pytest.fixture
def named(pkg: GatePackage) -> GatePackage:
    (pkg.path / "shared").mkdir()
    (pkg.path / "shared" / "__init__.py").write_text("")
    (pkg.path / "shared" / "names.py").write_text(NAMES)
    (pkg.path / "kda" / "gate.py").write_text(NAMED)
    return pkg


def test_kernels_named_by_module_level_literals_resolve_without_importing(named: GatePackage):
    site = {s.id: s for s in discover_gates([named])}
    assert site["kda_named"].kernels == (
        "k3gates.kda.kernels", "k3gates.mla.kernels", "k3gates.moe.kernels"
    )  # fmt: skip
    assert site["kda_local"].kernels == ("k3gates.kda.kernels", "k3gates.fx.kernels")


def test_an_edit_to_the_module_that_names_the_kernels_is_seen_through_the_memo(named):
    discover_gates([named])
    names = named.path / "shared" / "names.py"
    names.write_text(NAMES.replace("k3gates.mla.kernels", "k3gates.muon.kernels"))
    site = {s.id: s for s in discover_gates([named])}
    assert site["kda_named"].kernels[1] == "k3gates.muon.kernels"


@pytest.mark.parametrize(
    "expr, why",
    [
        ("_computed()", r"`_computed\(\)` is not a literal"),
        ("MISSING", "`MISSING` is not bound to a literal"),
        ("[KERNELS['zz']]", "'zz'"),
        ("EXTRA", "must list modules"),
    ],
)
def test_kernels_that_cannot_be_read_without_importing_name_the_file_and_line(named, expr, why):
    gate_py = named.path / "kda" / "gate.py"
    text = NAMED.replace("from ..shared import names as N", "from ..shared.names import EXTRA")
    gate_py.write_text(text.replace("[*KERNELS.values(), N.EXTRA]", expr))
    with pytest.raises(DiscoveryError, match=rf"{gate_py}:10: gate kda_named: kernels.*{why}"):
        discover_gates([named])


def test_every_project_gate_declares_at_run_time_the_kernels_discovery_read(tmp_path, monkeypatch):
    """build.py --only compiles, and brings the gates proving, what discovery reads; the gate
    runs with what its decorator computes on import. They must be the same list. The gate
    modules are imported in a child process, as the runner does, so that this process's registry
    stays as the other tests find it."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    sites = discover_gates([GatePackage(Path(__file__).parents[1] / "k3gates")])
    code = (
        "import importlib, json, sys\n"
        "from k3gates.infra.gate import REGISTRY\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "print(json.dumps({i: list(s.kernels) for i, s in REGISTRY.items()}))\n"
    )
    modules = sorted({s.module for s in sites})
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1])  # fmt: skip
    declared = json.loads(out.stdout)
    for s in sites:
        assert tuple(declared[s.id]) == s.kernels, s.id
    assert sum(len(s.kernels) > 3 for s in sites) >= 8  # the K3-μ gates name theirs by name


def test_no_library_face_binds_the_name_of_a_module_of_its_package():
    """Importing k3gates.kda.gate sets the attribute `gate` of k3gates.kda to that module; a face
    function of the same name would be replaced by it in any process that imports the gate."""
    import ast

    root = Path(__file__).parents[1] / "k3gates"
    clashes = []
    for init in sorted(root.glob("*/__init__.py")):
        modules = {p.stem for p in init.parent.glob("*.py")} | {
            p.parent.name for p in init.parent.glob("*/__init__.py")
        }
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            else:
                continue
            clashes += [f"{init}:{node.lineno}: {b}" for b in bound if b in modules]
    assert clashes == []
