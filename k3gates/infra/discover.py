"""Find gates and kernels modules without importing them.

The build must name the file and line of a bad gate id before any gate code runs, and a gate file
that crashes on import must become a failed gate, not a failed build. So discovery reads the
`@gate(...)` decorators from the AST: their id, innovation and level must be literals. Their
`kernels=` may also name literals bound elsewhere (`kernels=list(KERNELS.values())`, with KERNELS
a dict literal here or in a module this file imports from), resolved from those files' ASTs too:
`build.py --only` compiles just those modules, and brings the gates that prove them.

A *gate package* is a folder of primitive folders (`k3gates/`, or a test's fixture folder): at any
depth below it, `gate.py` and `gate_<form>.py` hold gates and `kernels*.py` hold kernels.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .compile import memo_path, write_memo
from .registry import Level, UnknownInnovation, canonical

DEFAULT_TIMEOUT_S = 300.0  # a gate that runs longer must say so in its decorator


class DiscoveryError(ValueError):
    """One or more gates are malformed; the message lists each as `file:line: reason`."""


@dataclass(frozen=True)
class GateSite:
    id: str
    innovation: str | None
    level: Level
    module: str  # dotted name, importable once `root` is on sys.path
    root: Path  # the sys.path entry the module lives under
    file: Path
    line: int
    kernels: tuple[str, ...] = ()  # from the decorator, resolved without importing
    timeout: float = DEFAULT_TIMEOUT_S  # seconds; the runner kills the gate's process after it
    requires: tuple[str, ...] = ()  # gate ids this gate builds on (checked to exist)
    exclusive: bool = False  # the runner gives it every core and runs nothing beside it
    doc: str = ""  # the gate function's docstring, stripped


@dataclass(frozen=True)
class GatePackage:
    """`path` is a package folder; its parent goes on sys.path."""

    path: Path

    @property
    def root(self) -> Path:
        return self.path.parent

    def modname(self, file: Path) -> str:
        rel = file.resolve().relative_to(self.root.resolve()).with_suffix("")
        return ".".join(rel.parts)


def kernel_modules(packages: list[GatePackage]) -> list[str]:
    # kernels.py, or kernels_<part>.py when one innovation's kernels compile as several modules
    return [p.modname(f) for p in packages for f in sorted(p.path.rglob("kernels*.py"))]


def _file_sites(pkg: GatePackage, file: Path, rules: bytes) -> tuple[list[GateSite], list[str]]:
    """The gates of one gate.py and its problems. A file with none is memoised on disk by its
    bytes and `rules` (this module's and the registry's bytes): parsing every gate file was a
    fifth of a no-change rebuild."""
    text = file.read_bytes()
    where = f"{file.resolve()}\0{pkg.root}\0".encode()
    memo = memo_path("gates", where + text + rules)
    try:
        kept = json.loads(memo.read_text())
        # a site whose kernels are names bound in other files holds while those files do
        if all(_digest(Path(f)) == h for f, h in kept["sources"].items()):
            return [_site_from_json(d, pkg, file) for d in kept["sites"]], []
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        tree = ast.parse(text, filename=str(file))
    except SyntaxError as e:
        return [], [f"{file}:{e.lineno}: syntax error: {e.msg}"]
    sites, problems = [], []
    names = _Names(pkg, file, tree)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            call = _gate_call(dec)
            if call is None:
                continue
            try:
                doc = (ast.get_docstring(node, clean=False) or "").strip()
                sites.append(replace(_site_from_call(call, pkg, file, names), doc=doc))
            except DiscoveryError as e:
                problems.append(str(e))
    if not problems:
        sources = {str(f): _digest(f) for f in names.read if f != file}
        write_memo(memo, {"sites": [_site_to_json(s) for s in sites], "sources": sources})
    return sites, problems


def _digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


class _Unresolved(ValueError):
    """An expression that is not a literal, nor built from names bound to literals."""


class _Names:
    """Resolves an expression of the decorator from module-level literals, without importing:
    a literal; a name assigned a literal in this module or imported (`from m import NAME`) from
    another module of the package; and list(...), tuple(...), d.values(), d[key], [*a, b] of
    those. `read` is every file consulted."""

    def __init__(self, pkg: GatePackage, file: Path, tree: ast.Module) -> None:
        self.pkg, self.read = pkg, {file}
        self._modules: dict[Path, dict[str, ast.stmt]] = {file: _bindings(tree)}
        self._file = file

    def value(self, node: ast.expr, file: Path | None = None) -> Any:
        file = file or self._file
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            out: list = []
            for e in node.elts:
                if isinstance(e, ast.Starred):
                    out += list(self.value(e.value, file))
                else:
                    out.append(self.value(e, file))
            return out
        if isinstance(node, ast.Dict) and None not in node.keys:
            pairs = zip(node.keys, node.values, strict=True)
            return {self.value(k, file): self.value(v, file) for k, v in pairs}
        if isinstance(node, ast.Name):
            return self._name(node.id, file)
        if isinstance(node, ast.Attribute):  # m.NAME, with m a module imported from the package
            module = self.value(node.value, file)
            if isinstance(module, _Module):
                return self._name(node.attr, module.file)
        if isinstance(node, ast.Subscript):
            return self.value(node.value, file)[self.value(node.slice, file)]
        if isinstance(node, ast.Call) and not node.keywords:
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("list", "tuple") and len(node.args) == 1:
                return list(self.value(node.args[0], file))
            if isinstance(f, ast.Attribute) and f.attr == "values" and not node.args:
                return list(self.value(f.value, file).values())
        raise _Unresolved(
            f"`{ast.unparse(node)}` is not a literal nor built from names of literals"
        )

    def _name(self, name: str, file: Path) -> Any:
        stmt = self._modules[file].get(name)
        if isinstance(stmt, ast.Assign):
            return self.value(stmt.value, file)
        if isinstance(stmt, ast.ImportFrom):
            imported = next(a.name for a in stmt.names if (a.asname or a.name) == name)
            module = [*(stmt.module or "").split("."), imported] if stmt.module else [imported]
            submodule = self._module_file(stmt.level, module, file)
            if submodule is not None:  # from package import module
                return _Module(self._load(submodule))
            source = self._module_file(stmt.level, module[:-1], file)
            if source is None:
                raise _Unresolved(
                    f"module {stmt.module!r} (imported in {file}) is not in the package"
                )
            return self._name(imported, self._load(source))
        raise _Unresolved(f"`{name}` is not bound to a literal at module level in {file}")

    def _load(self, source: Path) -> Path:
        if source not in self._modules:
            self._modules[source] = _bindings(ast.parse(source.read_bytes(), filename=str(source)))
            self.read.add(source)
        return source

    def _module_file(self, level: int, parts: list[str], file: Path) -> Path | None:
        base = file.parent if level else self.pkg.root
        for _ in range(level - 1):
            base = base.parent
        target = base.joinpath(*parts)
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None


@dataclass(frozen=True)
class _Module:
    file: Path


def _bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """Module-level names and the statement that binds them last: an assignment to one name,
    or a `from m import name`."""
    out: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            if isinstance(stmt.targets[0], ast.Name):
                out[stmt.targets[0].id] = stmt
        elif isinstance(stmt, ast.ImportFrom):
            for a in stmt.names:
                out[a.asname or a.name] = stmt
    return out


_RULES = Path(__file__)
_REGISTRY = Path(__file__).with_name("registry.py")
_MEMO_FIELDS = ("id", "innovation", "line", "kernels", "timeout", "requires", "exclusive", "doc")


def _site_to_json(site: GateSite) -> dict:
    return {"level": site.level.name} | {f: getattr(site, f) for f in _MEMO_FIELDS}


def _site_from_json(d: dict, pkg: GatePackage, file: Path) -> GateSite:
    return GateSite(d["id"], d["innovation"], Level[d["level"]], pkg.modname(file), pkg.root,
                    file, d["line"], tuple(d["kernels"]), d["timeout"], tuple(d["requires"]),
                    d["exclusive"], d["doc"])  # fmt: skip


def _literal(node: ast.expr, what: str, file: Path) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise DiscoveryError(f"{file}:{node.lineno}: `{what}` must be a literal") from None


def _gate_call(decorator: ast.expr) -> ast.Call | None:
    if not isinstance(decorator, ast.Call):
        return None
    f = decorator.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return decorator if name == "gate" else None


def _site_from_call(call: ast.Call, pkg: GatePackage, file: Path, names: _Names) -> GateSite:
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    id_node = call.args[0] if call.args else kw.get("id")
    if id_node is None or "level" not in kw or "innovation" not in kw:
        raise DiscoveryError(f"{file}:{call.lineno}: @gate needs an id, innovation= and level=")
    gate_id = _literal(id_node, "id", file)
    innovation = _literal(kw["innovation"], "innovation", file)
    level = _literal(kw["level"], "level", file)
    if not isinstance(gate_id, str) or not gate_id.isidentifier():
        raise DiscoveryError(f"{file}:{call.lineno}: gate id {gate_id!r} is not an identifier")
    try:
        inno = canonical(innovation) if innovation is not None else None
        lvl = Level.parse(level)
    except (UnknownInnovation, ValueError) as e:
        raise DiscoveryError(f"{file}:{call.lineno}: gate {gate_id}: {e}") from None
    try:
        kernels = names.value(kw["kernels"]) if "kernels" in kw else ()
    except (_Unresolved, SyntaxError, OSError, KeyError, IndexError, TypeError) as e:
        raise DiscoveryError(f"{file}:{call.lineno}: gate {gate_id}: kernels=: {e}") from None
    if not isinstance(kernels, (list, tuple)) or not all(isinstance(k, str) for k in kernels):
        raise DiscoveryError(f"{file}:{call.lineno}: gate {gate_id}: kernels= must list modules")
    timeout = _literal(kw["timeout"], "timeout", file) if "timeout" in kw else DEFAULT_TIMEOUT_S
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise DiscoveryError(f"{file}:{call.lineno}: gate {gate_id}: timeout must be > 0 s")
    requires = _literal(kw["requires"], "requires", file) if "requires" in kw else ()
    if not isinstance(requires, (list, tuple)) or not all(isinstance(r, str) for r in requires):
        raise DiscoveryError(f"{file}:{call.lineno}: gate {gate_id}: requires must list gate ids")
    exclusive = _literal(kw["exclusive"], "exclusive", file) if "exclusive" in kw else False
    if not isinstance(exclusive, bool):
        raise DiscoveryError(
            f"{file}:{call.lineno}: gate {gate_id}: exclusive must be True or False"
        )
    return GateSite(
        gate_id,
        inno,
        lvl,
        pkg.modname(file),
        pkg.root,
        file,
        call.lineno,
        tuple(kernels),
        float(timeout),
        tuple(requires),
        exclusive,
    )


def gate_files(pkg: GatePackage) -> list[Path]:
    """`gate.py` and `gate_<form>.py` (one primitive's gates of several forms) in any folder."""
    return sorted(
        f
        for f in pkg.path.rglob("gate*.py")
        if (f.stem == "gate" or f.stem.startswith("gate_")) and f.parent != pkg.path
    )


def discover_gates(packages: list[GatePackage]) -> list[GateSite]:
    """Every gate in `packages`, in file order. Raises DiscoveryError listing every problem."""
    sites: list[GateSite] = []
    problems: list[str] = []
    rules = _RULES.read_bytes() + _REGISTRY.read_bytes()  # read once, not once per gate file
    for pkg in packages:
        for file in gate_files(pkg):
            found, bad = _file_sites(pkg, file, rules)
            sites += found
            problems += bad
    seen: dict[str, GateSite] = {}
    for s in sites:
        if s.id in seen:
            first = seen[s.id]
            problems.append(
                f"{s.file}:{s.line}: gate id {s.id!r} is already defined at "
                f"{first.file}:{first.line}"
            )
        seen.setdefault(s.id, s)
    for s in sites:
        for req in s.requires:
            if req not in seen:
                problems.append(f"{s.file}:{s.line}: gate {s.id} requires {req!r}, no such gate")
            elif req == s.id:
                problems.append(f"{s.file}:{s.line}: gate {s.id} requires itself")
    if problems:
        raise DiscoveryError("\n".join(problems))
    return sorted(sites, key=lambda s: (str(s.file), s.line))
