"""The Pythran cache: content-hash keys, no stale module, cached failures, loading by path."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3gates.infra import compile as kc

LIB = """
#pythran export scale(int64)
def scale(x):
    return x * FACTOR

FACTOR = 3
"""
USER = """
import numpy as np
from ..lib.kernels import scale

#pythran export apply(int64[:])
def apply(a):
    out = np.zeros(a.shape[0], dtype=np.int64)
    for i in range(a.shape[0]):
        out[i] = scale(a[i]) + (a[i] // 4)
    return out
"""


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A throwaway gate package `tpkg` with lib/ and user/ kernels, and a private cache."""
    root = tmp_path / "src"
    for sub, text in (("lib", LIB), ("user", USER)):
        (root / "tpkg" / sub).mkdir(parents=True)
        (root / "tpkg" / sub / "__init__.py").write_text("")
        (root / "tpkg" / sub / "kernels.py").write_text(text)
    (root / "tpkg" / "__init__.py").write_text("")
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(root))
    kc._key_memo.clear()
    yield root / "tpkg"
    for name in [m for m in sys.modules if m.startswith("tpkg")]:
        del sys.modules[name]


def test_compile_then_reuse_then_recompile_on_change(pkg: Path):
    first = kc.ensure("tpkg.user.kernels")
    assert first.error is None and not first.reused
    assert first.path is not None and kc.cache_root() in first.path.parents
    again = kc.ensure("tpkg.user.kernels")
    assert again.reused and again.key == first.key
    a = np.array([-9, -1, 0, 7], dtype=np.int64)
    assert kc.load("tpkg.user.kernels").apply(a).tolist() == [-30, -4, 0, 22]

    # an edit to the *imported* module changes the key, and load() serves the new code
    lib = pkg / "lib" / "kernels.py"
    lib.write_text(LIB.replace("FACTOR = 3", "FACTOR = 5"))
    changed = kc.ensure("tpkg.user.kernels")
    assert changed.key != first.key and not changed.reused
    assert kc.load("tpkg.user.kernels").apply(a).tolist() == [-48, -6, 0, 36]


def test_a_kernel_import_spelled_from_its_own_folder_is_refused(pkg: Path):
    """`from .kernels import` would bind another file once compiled into a module elsewhere."""
    (pkg / "lib" / "kernels_two.py").write_text("from .kernels import scale\n")
    with pytest.raises(kc.CompileError, match=r"kernels_two.py:1: `from .kernels import"):
        kc.dependencies("tpkg.lib.kernels_two")
    (pkg / "lib" / "kernels_two.py").write_text("from ..lib.kernels import scale\n")
    assert set(kc.dependencies("tpkg.lib.kernels_two")) == {
        "tpkg.lib.kernels",
        "tpkg.lib.kernels_two",
    }


def test_compiled_matches_interpreted_on_negative_floor_division(pkg: Path):
    a = np.arange(-50, 50, dtype=np.int64)
    compiled = kc.load("tpkg.user.kernels").apply(a)
    interpreted = kc.interpreted("tpkg.user.kernels").apply(a)
    assert np.array_equal(compiled, interpreted)


def test_a_stale_extension_beside_the_source_is_refused(pkg: Path):
    (pkg / "user" / "kernels.cpython-311-x86_64-linux-gnu.so").write_bytes(b"not really")
    result = kc.ensure("tpkg.user.kernels")
    assert result.path is None
    assert "would shadow the source" in result.error and "kernels.cpython-311" in result.error
    with pytest.raises(kc.StaleModuleError):
        kc.interpreted("tpkg.user.kernels")


def test_a_failed_compile_is_cached_with_its_message(pkg: Path):
    bad = pkg / "user" / "kernels.py"
    bad.write_text(USER + "\n\nclass Nope:\n    pass\n")
    failed = kc.ensure("tpkg.user.kernels")
    assert failed.path is None and not failed.reused
    assert str(bad) in failed.error and "level statements can only be" in failed.error
    again = kc.ensure("tpkg.user.kernels")
    assert again.reused and again.error == failed.error
    with pytest.raises(kc.CompileError, match="level statements can only be"):
        kc.load("tpkg.user.kernels")


def test_each_module_is_compiled_by_its_compiler(pkg: Path, monkeypatch: pytest.MonkeyPatch):
    """clang++ unless the module is in GXX_MODULES (the compiler leaves its name in .comment)."""
    monkeypatch.delenv("CXX", raising=False)
    assert kc._builds_openmp("clang++"), "no clang++ with OpenMP: run `bash tests/bootstrap.sh`"
    clang = kc.ensure("tpkg.lib.kernels").path.read_bytes()
    monkeypatch.setitem(kc.GXX_MODULES, "tpkg.user.kernels", "a test")
    gcc = kc.ensure("tpkg.user.kernels").path.read_bytes()
    assert b"clang version" in clang and b"clang version" not in gcc
    compiler = kc.toolchain()["compiler"]  # the build's provenance names both
    assert "clang version" in compiler and "g++" in compiler, compiler


def test_cxx_in_the_environment_chooses_the_compiler(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setenv("CC", "gcc")
    assert kc.compilers("k3gates.kda.kernels") == ("g++", "gcc")


def test_without_clang_every_module_uses_gxx(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(kc, "CLANG", ("no-such-clang++", "no-such-clang"))
    assert kc.compilers("k3gates.kda.kernels") == kc.GCC
    assert kc.compilers("k3gates.gemm.kernels") == kc.GCC


def test_no_compile_mode_refuses_a_cache_miss(pkg: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(kc.NO_COMPILE_ENV, "1")
    with pytest.raises(kc.CompileError, match="not compiled for key"):
        kc.ensure("tpkg.lib.kernels")


def test_source_is_found_through_an_import_hook_off_sys_path(pkg: Path, monkeypatch):
    """An editable install can place a package behind a path hook with no sys.path entry; the
    kernel source must still be found (it once raised "no source file ... on sys.path")."""
    root = pkg.parent
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != root])

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "tpkg":
                return None
            return importlib.util.spec_from_file_location(
                name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
            )

    monkeypatch.setattr(sys, "meta_path", [Hook(), *sys.meta_path])
    assert kc.source_path("tpkg.user.kernels") == (pkg / "user" / "kernels.py").resolve()
    with pytest.raises(kc.CompileError, match=r"tpkg\.nope\.kernels: no source file"):
        kc.source_path("tpkg.nope.kernels")


def test_a_library_face_works_from_any_working_directory(tmp_path: Path):
    code = "import k3gates.fx as fx; print(fx.sigmoid([0.0])[0])"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr
    assert abs(float(run.stdout) - 0.5) < 1e-6


def test_a_compiler_probe_is_memoised_only_once_it_passes(tmp_path: Path, monkeypatch):
    """A compiler that builds OpenMP code is probed once per binary, not by every process; one
    that cannot is probed again next time, so installing libomp-dev is seen at once."""
    monkeypatch.setenv("K3GATES_CACHE", str(tmp_path / "cache"))
    calls, rc = tmp_path / "calls", tmp_path / "rc"
    fake = tmp_path / "bin" / "fake-cxx"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "fake c++ 1.0"\nexit $(cat {rc})\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")

    def facts() -> tuple[dict, int]:
        kc._compiler_facts.cache_clear()  # as a new process would
        got = kc._compiler_facts("fake-cxx")
        return got, len(calls.read_text().splitlines()) if calls.exists() else 0

    rc.write_text("1")  # the probe fails: no libomp
    assert facts() == ({"version": "fake c++ 1.0", "openmp": False}, 2)
    assert facts()[1] == 4  # probed again
    rc.write_text("0")  # libomp-dev installed
    assert facts() == ({"version": "fake c++ 1.0", "openmp": True}, 6)
    assert facts() == ({"version": "fake c++ 1.0", "openmp": True}, 6)  # from the memo
    fake.write_text(fake.read_text() + "# upgraded\n")  # a new binary is probed again
    assert facts()[1] == 8
    kc._compiler_facts.cache_clear()
