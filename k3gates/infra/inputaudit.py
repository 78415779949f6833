"""Static audit: every integer a kernel receives is derived the same way on every CPU.

Kernels are integer code, so their outputs are the same bits on every machine, but only if their
inputs are. A kernel input that passed through a float function whose last bit depends on the CPU
(NumPy's SIMD `exp`, `sin`, `power`, ..., which take other code paths with AVX-512 than with AVX2,
or libm's `pow` and `log`) can differ by one LSB between machines, and so can everything the
kernel computes from it. Issue 47 found exactly that: `longctx_rope`'s frequency table was
`base ** (-2i/D)` in NumPy float64, and its digests differed between an AVX2 and an AVX-512 host.

The audit finds every *conversion site*: a place in a gate, a library face or a model module where
a value becomes an integer (`.astype(<int dtype>)`, `np.round`, `np.rint`, `np.floor`,
`np.ceil`, `round(...)`, `int(<arithmetic>)`, `Fraction(...)`, and every call of a project function
whose own conversion site depends on one of its parameters). It then follows the value back:
through every assignment of each name it reads in the same function (then at module level), and
into what every project function it calls returns, transitively. A *finding* is any of

- a transcendental NumPy function (`TRANSCENDENTAL`) or `math` function (`MATH_TRANSCENDENTAL`);
- a power `a ** b` whose exponent the source does not show to be an integer (`D ** -0.5`,
  `base ** (-2 i / D)`, `2.0 ** rng.uniform(...)`);
- a float product NumPy hands to BLAS (`@`, `np.dot`, `np.einsum`, `np.linalg.*` but a norm
  along an axis, ...), whose kernel and summation order depend on the CPU OpenBLAS finds;

on the way. What remains are the operations that give the same bits everywhere: + - * / and sqrt
on float64 (IEEE 754 rounds each correctly), sums in NumPy's fixed pairwise order, integer
powers, rounding, integer conversion, comparisons, and NumPy's random generators (their streams
are fixed by NumPy, per version, on every platform). The portable replacements (exp, sigmoid,
tanh, softmax, a fixed-order matmul, exact logarithms and the RoPE tables) are in
`k3gates/fx/host.py`.

A conversion that makes no kernel input (a reference value the kernel's output is compared with,
a run's outputs, a figure to print) may say why, on its line or in a comment line right above
it: `# audit: <reason>`. The audit does not follow it, and the test prints every such site with
its reason, so a reader can check each claim.

The audit sees source, not values: a value that reaches a kernel through a container filled
elsewhere, or through a function it cannot resolve by name, is not followed. The runtime backstop
is `tests/test_kernel_inputs.py`, which derives gates' inputs again in a process whose NumPy and
OpenBLAS take their AVX2 paths and finds the same bits.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


TRANSCENDENTAL = _words(
    """exp exp2 expm1 log log2 log10 log1p sin cos tan arcsin arccos arctan arctan2 sinh cosh
    tanh arcsinh arccosh arctanh power float_power cbrt hypot logaddexp logaddexp2 sinc"""
)
MATH_TRANSCENDENTAL = _words(
    """exp exp2 expm1 log log2 log10 log1p pow sin cos tan asin acos atan atan2 sinh cosh tanh
    asinh acosh atanh erf erfc gamma lgamma cbrt"""
)
# float products that NumPy hands to BLAS, whose kernels (and so summation orders) differ by CPU
PRODUCTS = _words("dot matmul vdot inner tensordot einsum")
ROUNDERS = _words("round rint floor ceil trunc around fix")
INT_DTYPES = _words("int8 int16 int32 int64 uint8 uint16 uint32 uint64 intc intp int uint")
INTEGER_OPS = ast.Add | ast.Sub | ast.Mult | ast.FloorDiv | ast.Mod | ast.LShift | ast.RShift
PRAGMA = "# audit: "  # then the reason this conversion is not a kernel input


@dataclass(frozen=True)
class Site:
    """One place where a value becomes an integer."""

    path: Path
    line: int
    function: str
    text: str
    reason: str  # why this conversion is no kernel input (the line's "# audit: ..."), or ""


@dataclass(frozen=True)
class Finding:
    site: Site
    path: Path  # where the CPU-dependent operation is
    line: int
    what: str

    def __str__(self) -> str:
        return (
            f"{self.site.path}:{self.site.line} ({self.site.function}: {self.site.text}) is "
            f"derived through {self.what} at {self.path}:{self.line}"
        )


@dataclass
class _Module:
    path: Path
    name: str  # dotted
    tree: ast.Module
    lines: list[str]
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted module or obj
    numpy: set[str] = field(default_factory=set)
    math: set[str] = field(default_factory=set)


def _dotted(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _load(root: Path, path: Path) -> _Module:
    text = path.read_text()
    mod = _Module(path, _dotted(root, path), ast.parse(text, str(path)), text.splitlines())
    package = mod.name if path.name == "__init__.py" else mod.name.rpartition(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.FunctionDef):
            mod.functions.setdefault(node.name, node)
        elif isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                if a.name == "numpy":
                    mod.numpy.add(local)
                elif a.name == "math":
                    mod.math.add(local)
                else:
                    mod.imports[local] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                mod.imports[a.asname or a.name] = f"{base}.{a.name}"
    return mod


class _Project:
    """Every module under the roots, with name resolution across them."""

    def __init__(self, root: Path, packages: list[str]) -> None:
        self.root = root
        self.modules: dict[str, _Module] = {}
        for pkg in packages:
            for path in sorted((root / pkg).rglob("*.py")):
                m = _load(root, path)
                self.modules[m.name] = m

    def resolve(self, mod: _Module, node: ast.expr) -> tuple[_Module, ast.FunctionDef] | None:
        """The project function a call's `func` names, if it names one."""
        if isinstance(node, ast.Name):
            if node.id in mod.functions:
                return mod, mod.functions[node.id]
            target = mod.imports.get(node.id)
            if target:
                owner, _, name = target.rpartition(".")
                m = self.modules.get(owner)
                if m and name in m.functions:
                    return m, m.functions[name]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = mod.imports.get(node.value.id)
            m = self.modules.get(target or "")
            if m and node.attr in m.functions:
                return m, m.functions[node.attr]
        return None

    def module_constant(self, mod: _Module, node: ast.expr) -> tuple[_Module, list[ast.expr]]:
        """Module-level assignments of a name (`X`) or of an imported module's name (`K.X`)."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            m = self.modules.get(mod.imports.get(node.value.id, ""))
            return (m, _assigned(m.tree.body, node.attr)) if m else (mod, [])
        if isinstance(node, ast.Name):
            found = _assigned(mod.tree.body, node.id)
            if not found and node.id in mod.imports:
                owner, _, name = mod.imports[node.id].rpartition(".")
                m = self.modules.get(owner)
                if m:
                    return m, _assigned(m.tree.body, name)
            return mod, found
        return mod, []


_ASSIGNMENTS: dict[int, tuple[list[ast.stmt], dict[str, list[ast.expr]]]] = {}


def _assigned(body: list[ast.stmt], name: str) -> list[ast.expr]:
    """The values assigned to `name` by the statements of `body` (nested blocks included, nested
    functions excluded), from a table made once per body."""
    key = id(body)
    if key not in _ASSIGNMENTS:  # the body is kept with its table, so its id stays its own
        _ASSIGNMENTS[key] = (body, _assignments(body))
    return _ASSIGNMENTS[key][1].get(name, [])


def _targets(t: ast.expr) -> Iterator[str]:
    if isinstance(t, ast.Name):
        yield t.id
    elif isinstance(t, ast.Tuple | ast.List):
        for e in t.elts:
            yield from _targets(e)
    elif isinstance(t, ast.Starred | ast.Subscript):  # x[...] = v: v flows into x
        yield from _targets(t.value)


def _assignments(body: list[ast.stmt]) -> dict[str, list[ast.expr]]:
    out: dict[str, list[ast.expr]] = {}

    def add(target: ast.expr, value: ast.expr) -> None:
        for name in _targets(target):
            out.setdefault(name, []).append(value)

    for node in _walk_scope(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                add(t, node.value)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
            add(node.target, node.value)
        elif isinstance(node, ast.For | ast.comprehension):
            add(node.target, node.iter)
        elif isinstance(node, ast.NamedExpr):
            add(node.target, node.value)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            add(node.optional_vars, node.context_expr)
    return out


def _is_int_dtype(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in INT_DTYPES
    if isinstance(node, ast.Name):
        return node.id == "int"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lstrip("<>=").rstrip("0123456789") in {"int", "uint", "i", "u"}
    return False


def _conversion_args(mod: _Module, call: ast.Call) -> list[ast.expr] | None:
    """The converted expressions, if `call` turns a value into integers."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "astype" and call.args:
        return [f.value] if _is_int_dtype(call.args[0]) else None
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.value.id in mod.numpy and f.attr in ROUNDERS:
            return list(call.args[:1])
        if f.value.id in mod.numpy and f.attr in {"array", "asarray", "full"}:
            dt = next((k.value for k in call.keywords if k.arg == "dtype"), None)
            return list(call.args) if dt is not None and _is_int_dtype(dt) else None
        if f.value.id in mod.math and f.attr in {"floor", "ceil", "trunc"}:
            return list(call.args[:1])
    if isinstance(f, ast.Name):
        if f.id == "round" and len(call.args) == 1:  # round(x, n) stays a float
            return [call.args[0]]
        if f.id == "Fraction" and call.args:
            return [call.args[0]]
        if f.id == "int" and call.args and isinstance(call.args[0], ast.BinOp):
            return [call.args[0]]
    return None


class Audit:
    """The conversion sites of the audited modules and the findings on their way back."""

    def __init__(self, root: Path, packages: list[str], audited: list[Path]) -> None:
        self.project = _Project(root, packages)
        self.sites: list[Site] = []
        self.findings: list[Finding] = []
        # (module name, function name) -> parameter positions a conversion depends on
        self.quantisers: dict[tuple[str, str], set[int]] = {}
        audited_names = {_dotted(root, p) for p in audited}
        mods = [m for n, m in self.project.modules.items() if n in audited_names]
        self._find_quantisers()
        for m in mods:
            self._audit_module(m)

    # -- quantisers: functions whose conversion depends on a parameter --------------------------
    def _find_quantisers(self) -> None:
        changed = True
        while changed:
            changed = False
            for mod in self.project.modules.values():
                for fn in mod.functions.values():
                    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                    for args in self._conversions(mod, fn):
                        names = set()
                        for a in args:
                            names |= self._closure_names(mod, fn, a)
                        pos = {i for i, p in enumerate(params) if p in names}
                        key = (mod.name, fn.name)
                        if pos - self.quantisers.get(key, set()):
                            self.quantisers[key] = self.quantisers.get(key, set()) | pos
                            changed = True

    def _conversions(self, mod: _Module, scope: ast.AST) -> Iterator[list[ast.expr]]:
        for node in _walk_scope(scope):
            if isinstance(node, ast.Call):
                args = self._converted(mod, node)
                if args:
                    yield args

    def _converted(self, mod: _Module, call: ast.Call) -> list[ast.expr] | None:
        args = _conversion_args(mod, call)
        if args is not None:
            return args
        target = self.project.resolve(mod, call.func)
        if target is None:
            return None
        pos = self.quantisers.get((target[0].name, target[1].name), set())
        return [call.args[i] for i in sorted(pos) if i < len(call.args)] or None

    def _closure_names(self, mod: _Module, fn: ast.AST, expr: ast.expr) -> set[str]:
        """Every name `expr` reads, through the assignments of the function it is in."""
        seen: set[str] = set()
        todo = [expr]
        body = fn.body if isinstance(fn, ast.FunctionDef | ast.Module) else []
        while todo:
            e = todo.pop()
            for n in ast.walk(e):
                if isinstance(n, ast.Name) and n.id not in seen:
                    seen.add(n.id)
                    todo.extend(_assigned(body, n.id))
        return seen

    # -- the audit proper --------------------------------------------------------------------
    def _audit_module(self, mod: _Module) -> None:
        scopes: list[ast.AST] = [mod.tree, *(n for n in ast.walk(mod.tree)
                                             if isinstance(n, ast.FunctionDef))]  # fmt: skip
        for scope in scopes:
            for node in _walk_scope(scope):
                if not isinstance(node, ast.Call):
                    continue
                args = self._converted(mod, node)
                if not args:
                    continue
                line = mod.lines[node.lineno - 1]
                above = mod.lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                reason = line.partition(PRAGMA)[2].strip() or (
                    above.partition(PRAGMA)[2].strip() if above.startswith(PRAGMA) else ""
                )
                site = Site(mod.path, node.lineno, getattr(scope, "name", "<module>"),
                            line.partition(PRAGMA)[0].strip()[:100], reason)  # fmt: skip
                self.sites.append(site)
                if reason:
                    continue
                for a in args:
                    self._trace(site, mod, scope, a, set())

    def _trace(self, site: Site, mod: _Module, scope: ast.AST, expr: ast.expr, seen: set) -> None:
        body = scope.body if isinstance(scope, ast.FunctionDef | ast.Module) else []
        todo: list[tuple[_Module, ast.expr, list[ast.stmt]]] = [(mod, expr, body)]
        while todo:
            m, e, b = todo.pop()
            for n in ast.walk(e):
                key = (m.name, id(n))
                if key in seen:
                    continue
                seen.add(key)
                self._check_node(site, m, n)
                if isinstance(n, ast.Name):
                    values = _assigned(b, n.id)
                    if values:
                        todo.extend((m, v, b) for v in values)
                    else:
                        owner, consts = self.project.module_constant(m, n)
                        todo.extend((owner, v, owner.tree.body) for v in consts)
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                    if n.value.id in m.imports:
                        owner, consts = self.project.module_constant(m, n)
                        todo.extend((owner, v, owner.tree.body) for v in consts)
                elif isinstance(n, ast.Call):
                    target = self.project.resolve(m, n.func)
                    if target and (target[0].name, target[1].name) not in seen:
                        seen.add((target[0].name, target[1].name))
                        fm, fn = target
                        todo.extend((fm, r, fn.body) for r in _returned(fn))

    def _integer_exponent(self, m: _Module, node: ast.expr) -> bool:
        """An exponent the source shows to be an integer: int literals, names (the project's
        format constants), +, -, *, //, % and shifts of those, int(), len(), min() and max() of
        those, and calls of project functions annotated `-> int`."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, int)
        if isinstance(node, ast.Name | ast.Attribute):
            return True
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return self._integer_exponent(m, node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, INTEGER_OPS):
            return self._integer_exponent(m, node.left) and self._integer_exponent(m, node.right)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in {"int", "len", "min", "max"}:
                return all(self._integer_exponent(m, a) for a in node.args)
            target = self.project.resolve(m, node.func)
            returns = target[1].returns if target else None
            return isinstance(returns, ast.Name) and returns.id == "int"
        return False

    def _check_node(self, site: Site, m: _Module, n: ast.AST) -> None:
        what = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            owner = n.func.value
            if (
                isinstance(owner, ast.Attribute)
                and owner.attr == "linalg"
                and isinstance(owner.value, ast.Name)
                and owner.value.id in m.numpy
                # NumPy takes a norm along an axis as sqrt(sum(x * x)), without BLAS
                and not (n.func.attr == "norm" and any(k.arg == "axis" for k in n.keywords))
            ):
                what = f"np.linalg.{n.func.attr} (BLAS or LAPACK)"
            name = owner.id if isinstance(owner, ast.Name) else ""
            if name in m.numpy and n.func.attr in TRANSCENDENTAL | PRODUCTS:
                what = f"np.{n.func.attr}"
            elif name in m.math and n.func.attr in MATH_TRANSCENDENTAL:
                what = f"math.{n.func.attr}"
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
            what = f"a matrix product ({ast.unparse(n)[:60]})"
        elif (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Pow)
            and not self._integer_exponent(m, n.right)
        ):
            what = f"a power with a non-integer exponent ({ast.unparse(n)[:60]})"
        if what:
            self.findings.append(Finding(site, m.path, getattr(n, "lineno", 0), what))


def _returned(fn: ast.FunctionDef) -> list[ast.expr]:
    """What a function returns or yields (not what nested functions do)."""
    return [
        n.value
        for n in _walk_scope(fn)
        if isinstance(n, ast.Return | ast.Yield | ast.YieldFrom) and n.value is not None
    ]


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function or module, without descending into nested functions."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        n = todo.pop()
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield n
        todo.extend(ast.iter_child_nodes(n))


def audited_files(root: Path) -> list[Path]:
    """The modules that turn values into kernel inputs: every module of the gate packages except
    the kernels themselves (audited by nofloat.py) and the float64 references."""
    out = []
    for pkg in ("k3gates", "scale_k3"):
        for p in sorted((root / pkg).rglob("*.py")):
            name = p.name
            if name.startswith(("kernels", "reference")) or p.parent == root / "k3gates":
                continue
            out.append(p)
    return out


def audit(root: Path) -> Audit:
    return Audit(root, ["k3gates", "scale_k3"], audited_files(root))
