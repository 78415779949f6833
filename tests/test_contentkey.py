"""Content keys (k3gates/infra/contentkey.py): a pure move keeps every key; a change of code
does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3gates.infra import contentkey

KERNELS = '''"""Kernels."""
def double(x):
    return 2 * x
'''
OTHER = """def double(x):
    return 3 * x
"""
GATE = '''"""A gate."""
from ..prim import kernels  # the kernels it proves
from ..prim.kernels import double

MODULE = "pkg.prim.kernels"


def run():
    return double(kernels.double(1))
'''
MOVED_GATE = '''"""A gate, after its folder moved."""
from ..home import kernels_prim as kernels
from ..home.kernels_prim import double

MODULE = "pkg.home.kernels_prim"


def run():
    return double(kernels.double(1))  # a comment the old file did not have
'''


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {rel: root / rel for rel in files}


def _keys(root: Path, files: list[Path]) -> list[str]:
    index = contentkey.module_index(root)
    return sorted(contentkey.file_key(f, index) for f in files)


def _before(root: Path) -> dict[str, Path]:
    return _tree(
        root,
        {
            "pkg/__init__.py": "",
            "pkg/prim/__init__.py": "",
            "pkg/prim/kernels.py": KERNELS,
            "pkg/tasks/__init__.py": "",
            "pkg/tasks/gate.py": GATE,
            "pkg/other/__init__.py": "",
            "pkg/other/kernels.py": OTHER,
        },
    )


def test_a_pure_move_keeps_every_key(tmp_path):
    a = _before(tmp_path / "a")
    b = _tree(
        tmp_path / "b",
        {
            "pkg/__init__.py": "",
            "pkg/home/__init__.py": "",
            "pkg/home/kernels_prim.py": KERNELS.replace("Kernels.", "Kernels, moved."),
            "pkg/tasks/__init__.py": "",
            "pkg/tasks/gate.py": MOVED_GATE,
            "pkg/other/__init__.py": "",
            "pkg/other/kernels.py": OTHER,
        },
    )
    before = _keys(tmp_path / "a", [a["pkg/prim/kernels.py"], a["pkg/tasks/gate.py"]])
    after = _keys(tmp_path / "b", [b["pkg/home/kernels_prim.py"], b["pkg/tasks/gate.py"]])
    assert before == after
    assert contentkey.code_key(before, {}) == contentkey.code_key(after, {})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # rebinding `kernels` to another module with a function of the same name
        ("from ..prim import kernels", "from ..other import kernels"),
        # naming another kernel module in a string
        ('"pkg.prim.kernels"', '"pkg.other.kernels"'),
    ],
)
def test_what_a_name_is_bound_to_is_in_the_key(tmp_path, old, new):
    a = _before(tmp_path / "a")
    gate = a["pkg/tasks/gate.py"]
    before = _keys(tmp_path / "a", [gate])
    gate.write_text(GATE.replace(old, new))
    assert _keys(tmp_path / "a", [gate]) != before


def test_a_change_of_code_changes_the_key_and_a_comment_does_not(tmp_path):
    a = _before(tmp_path / "a")
    kernels = a["pkg/prim/kernels.py"]
    before = _keys(tmp_path / "a", [kernels])
    kernels.write_text(KERNELS.replace('"""Kernels."""', '"""Other words."""  # and a comment'))
    assert _keys(tmp_path / "a", [kernels]) == before
    kernels.write_text(KERNELS.replace("2 * x", "2 * x + 0"))
    assert _keys(tmp_path / "a", [kernels]) != before


def test_a_data_file_is_in_the_code_key(tmp_path):
    folder = tmp_path / "gate"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "corpus.txt").write_text("abc")
    (folder / "gate.py").write_text("")
    first = contentkey.data_files(folder)
    assert list(first) == ["data/corpus.txt"]
    (folder / "data" / "corpus.txt").write_text("abd")
    assert contentkey.code_key(["k"], first) != contentkey.code_key(
        ["k"], contentkey.data_files(folder)
    )


def test_a_package_attribute_is_not_taken_for_the_submodule_it_shadows(tmp_path):
    """`from pkg.prim import kernels` is the package's own `kernels` when its __init__ binds one
    (Python gives the attribute), so moving the module beside it must change the key."""
    a = _before(tmp_path / "a")
    gate = a["pkg/tasks/gate.py"]
    before = _keys(tmp_path / "a", [gate])
    (tmp_path / "a" / "pkg/prim/__init__.py").write_text("def kernels():\n    return 0\n")
    assert _keys(tmp_path / "a", [gate]) != before
