"""Discovery reads the @gate decorators from the AST; a good file's gates are memoised on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3gates import compile as kc
from k3gates.discover import DiscoveryError, GatePackage, discover_gates

GOOD = """
from k3gates.gate import gate

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
    assert len(_memos()) == len({s.file for s in parsed}) > 20
    assert discover_gates(project) == parsed


def test_an_edit_after_a_memoised_run_is_seen_and_a_bad_file_is_not_memoised(pkg: GatePackage):
    discover_gates([pkg])
    gate_py = pkg.path / "kda" / "gate.py"
    gate_py.write_text(GOOD.replace('"kda_two", innovation', '"kda two", innovation'))
    for _ in range(2):
        with pytest.raises(DiscoveryError, match=rf"{gate_py}:8: gate id 'kda two' is not an"):
            discover_gates([pkg])
    assert len(_memos()) == 1  # the good version's only
