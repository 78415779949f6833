"""Content keys: the code a gate ran on, named by what it says rather than where it lives.

Three records hold only while a gate's code is unchanged: a stored result the next build reuses, a
digest record a build is compared with, and a fault-suite record. "Unchanged" is decided from
content, never from paths, so that moving a file leaves every record made on it current.

- A Python file's key hashes its syntax tree, so comments, docstrings and layout do not count.
  Each import of a project module, and each string that names one (a kernel's module name), is
  written in that tree as the *body key* of the module it names: the module's tree without its
  docstrings, each of its imports reduced to the names it binds and each module name in it
  blanked (they are spelled out in that module's own key). What a name is bound to stays in the
  key; the path it was spelled with does not. `from package import name` is taken, as Python
  takes it, for the package's own attribute when its __init__ binds that name, else for the
  submodule.
- A data file a gate reads (a corpus, a checkpoint) is keyed by its bytes and its path relative to
  the gate's folder.
- A gate's *code key* hashes the sorted keys of every project file its process loaded (the kernels'
  sources among them) and of its data files.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path

_SKIP_DIRS = {"__pycache__", ".git", "public", "node_modules"}


def module_index(root: Path) -> dict[str, Path]:
    """{dotted name: file} of every Python module under `root` (a sys.path entry)."""
    root = root.resolve()
    out: dict[str, Path] = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if _SKIP_DIRS & set(rel.parts) or any(p.startswith(".") for p in rel.parts):
            continue
        parts = rel.with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:
            out[name] = f
    return out


def file_key(path: Path, index: Mapping[str, Path]) -> str:
    """The key of one Python file under the project whose modules are `index`."""
    path = path.resolve()
    return _file_key(path, _stat(path), _index_key(index))


def body_key(path: Path, index: Mapping[str, Path]) -> str:
    """A module's tree without docstrings, each import reduced to the name it binds, each string
    naming a module of `index` blanked."""
    path = path.resolve()
    return _body_key(path, _stat(path), _index_key(index))


def code_key(sources: Iterable[str], data: Mapping[str, str]) -> str:
    """A gate's code key: its loaded files' keys (order and paths do not count) and its data."""
    h = hashlib.sha256()
    for k in sorted(sources):
        h.update(f"py\0{k}\0".encode())
    for rel, sha in sorted(data.items()):
        h.update(f"data\0{rel}\0{sha}\0".encode())
    return h.hexdigest()[:16]


def data_files(folder: Path) -> dict[str, str]:
    """{path relative to `folder`: sha256 of bytes} of every non-Python file under `folder`."""
    out = {}
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder)
        if not f.is_file() or f.suffix in (".py", ".pyc") or _SKIP_DIRS & set(rel.parts):
            continue
        out[rel.as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    return out


# -- the keys, memoised on each file's stat --------------------------------------------------------
_INDEXES: dict[str, Mapping[str, Path]] = {}


def _index_key(index: Mapping[str, Path]) -> str:
    """Names the index and the state of every file in it: a key depends on the files it names,
    so an edit anywhere makes every memoised key be computed again."""
    files = sorted((n, str(p), _stat(p)) for n, p in index.items())
    k = hashlib.sha256(repr(files).encode()).hexdigest()
    _INDEXES[k] = index
    return k


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4096)
def _file_key(path: Path, stat: tuple[int, int], index_key: str) -> str:
    index = _INDEXES[index_key]
    tree = _without_docstrings(ast.parse(path.read_bytes(), filename=str(path)))
    package = _package_of(path, index)

    def target_key(dotted: str) -> str:
        return f"<module {body_key(index[dotted], index)}>"

    class Canonical(ast.NodeTransformer):
        def visit_Import(self, node: ast.Import) -> list[ast.AST]:
            return _markers(
                (target_key(a.name) if a.name in index else a.name, a.asname or a.name)
                for a in node.names
            )

        def visit_ImportFrom(self, node: ast.ImportFrom) -> list[ast.AST]:
            base = _absolute(node, package)
            pairs = []
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if sub in index and not _binds(index.get(base), a.name):  # from package import mod
                    pairs.append((target_key(sub), a.asname or a.name))
                elif base in index:
                    pairs.append((f"{target_key(base)}.{a.name}", a.asname or a.name))
                else:
                    pairs.append((f"{'.' * node.level}{node.module or ''}.{a.name}", a.asname))
            return _markers(pairs)

        def visit_Constant(self, node: ast.Constant) -> ast.AST:
            if isinstance(node.value, str) and "." in node.value and node.value in index:
                return ast.Constant(target_key(node.value))
            return node

    return hashlib.sha256(ast.dump(Canonical().visit(tree)).encode()).hexdigest()[:16]


@lru_cache(maxsize=4096)
def _body_key(path: Path, stat: tuple[int, int], index_key: str) -> str:
    index = _INDEXES[index_key]
    tree = _without_docstrings(ast.parse(path.read_bytes(), filename=str(path)))

    class Names(ast.NodeTransformer):
        def visit_Import(self, node: ast.Import) -> list[ast.AST]:
            return _markers((a.asname or a.name,) for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> list[ast.AST]:
            return _markers((a.asname or a.name,) for a in node.names)

        def visit_Constant(self, node: ast.Constant) -> ast.AST:
            if isinstance(node.value, str) and "." in node.value and node.value in index:
                return ast.Constant("<module>")
            return node

    return hashlib.sha256(ast.dump(Names().visit(tree)).encode()).hexdigest()[:16]


def _binds(package: Path | None, name: str) -> bool:
    """Whether the package file binds `name` itself: then `from package import name` is that
    attribute, as Python gives it, not the submodule of the same name."""
    if package is None or package.name != "__init__.py":
        return False
    return name in _bound_names(package, _stat(package))


@lru_cache(maxsize=1024)
def _bound_names(path: Path, stat: tuple[int, int]) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_bytes(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _markers(items: Iterable[tuple]) -> list[ast.AST]:
    """One statement per name an import binds: `from m import a, b` is `from m import a` and
    `from m import b`, however the names are grouped into statements."""
    return [ast.Expr(ast.Constant(repr(item))) for item in items]


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _package_of(path: Path, index: Mapping[str, Path]) -> str:
    for name, f in index.items():
        if f == path:
            return name if path.name == "__init__.py" else name.rpartition(".")[0]
    return ""


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".") if package else []
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join([*base, *([node.module] if node.module else [])])
