"""Static audit: a kernels module contains no float.

A kernel is integer-only when nothing in its source can produce a float value. The audit walks the
AST and reports every construct that could, with the file, the line and what was found.

The audit is built on allow-lists, not deny-lists. A deny-list of "numpy functions that return a
float" is never complete: `np.rint`, `np.fabs`, `np.pi` or `np.longdouble` each slip past one. So
a kernel may use only

- the numpy attributes in `NUMPY_ALLOWED` (integer dtypes and functions that keep integer input
  integer), and any other `np.X` is a finding, however numpy was imported or aliased;
- the `math` functions in `INT_MATH` and the `omp` (Pythran's OpenMP) queries in `INT_OMP`;
- the attributes and methods in `VALUE_ATTRIBUTES` on arrays, lists and ints (so `x.mean()` and
  `x.__truediv__(2)` are findings);
- imports of numpy, math, omp and the project's own kernels (relative imports);
- the types in `EXPORT_TYPES` in a `# pythran export` signature.

Around the allow-lists sit the rules for what needs no name: float and complex literals, true
division `/`, a power whose exponent may be negative, `float()` and `complex()`, float dtype
strings, numpy array constructors without an explicit integer `dtype=` (numpy's default is
float64), an empty list given to numpy, and the builtins that reach attributes by string.
Docstrings and comments are free text, except `# pythran export` lines, which Pythran reads even
inside a docstring.

The audit sees source, not values. A power `x ** n` by a name `n` that is negative at run time,
or numpy given a Python list that happens to be empty, is not caught here; the gates' reference
and compiled == interpreted checks are the backstop.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


def _words(text: str) -> frozenset[str]:
    """The whitespace-separated names in `text`: the allow-lists read as lists of words."""
    return frozenset(text.split())


NUMPY_INT_DTYPES = _words(
    "int8 int16 int32 int64 uint8 uint16 uint32 uint64 intc intp uintc uintp bool_"
)
# Array constructors whose default dtype is float64: a kernel must pass an integer `dtype=`.
NUMPY_NEEDS_DTYPE = _words(
    "zeros ones empty full identity eye array asarray ascontiguousarray arange"
)
# Every numpy attribute a kernel may use: integer dtypes, and functions whose result is integer
# for integer input. The kernels use int8..int64, uint8, uint64, zeros, sum, max and sort.
NUMPY_ALLOWED = (
    NUMPY_INT_DTYPES
    | NUMPY_NEEDS_DTYPE
    | _words(
        """
        zeros_like ones_like empty_like full_like copy
        abs absolute negative sign maximum minimum add subtract multiply floor_divide remainder
        left_shift right_shift bitwise_and bitwise_or bitwise_xor invert
        sum cumsum prod max min amax amin argmax argmin any all count_nonzero
        where clip sort argsort nonzero
        reshape transpose ravel concatenate stack
        equal not_equal less less_equal greater greater_equal array_equal
        iinfo
        """
    )
)
# math functions that return int for int input; every other math attribute is a finding.
INT_MATH = frozenset({"isqrt", "gcd", "lcm", "comb", "perm", "factorial"})
# Pythran's OpenMP module: the integer queries (omp.get_wtime and get_wtick are float).
INT_OMP = frozenset(
    {"get_thread_num", "get_num_threads", "get_max_threads", "get_num_procs", "in_parallel"}
)
# The modules a kernel may import (besides its own package, relatively), with what it may use.
MODULES = {"numpy": NUMPY_ALLOWED, "math": INT_MATH, "omp": INT_OMP}
# Attributes and methods a kernel may use on a value (an array, a list, an int).
VALUE_ATTRIBUTES = _words(
    """
    shape size ndim dtype T
    copy reshape ravel flatten transpose astype fill tolist item
    sum cumsum prod max min argmax argmin sort argsort clip any all nonzero dot
    append extend pop insert index count keys values items get bit_length
    """
)
# Identifiers a `# pythran export` signature may contain (Pythran's spec grammar, minus the
# float and complex types).
EXPORT_TYPES = (NUMPY_INT_DTYPES - {"bool_"}) | _words(
    "bool byte int order C F list tuple set dict slice str None or"
)
FLOAT_NAMES = frozenset({"float", "complex"})
# Builtins that reach an attribute or a module by string, out of the audit's sight.
DYNAMIC_NAMES = frozenset(
    {"getattr", "eval", "exec", "compile", "__import__", "globals", "locals", "vars"}
)
FLOAT_DTYPE_STRINGS = _words(
    """
    f f2 f4 f8 f12 f16 d e g c8 c16 c32
    float float_ float16 float32 float64 float96 float128 half single double longdouble longfloat
    complex complex_ complex64 complex128 complex192 complex256 csingle cdouble clongdouble
    clongfloat
    """
)
INT_DTYPE_STRING = re.compile(r"[<>=|]?(u?int(8|16|32|64)?|[iu][1248]|u?intc|u?intp|bool|b1)")
PYTHRAN_LINE = re.compile(r"\s*#\s*pythran")  # the test Pythran's own spec parser applies
EXPORT_TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|[()]")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass(frozen=True)
class _Module:
    """What the rules need to know about the module beyond one node."""

    parents: dict[ast.AST, ast.AST]
    aliases: dict[str, str]  # local name -> "numpy", "numpy.zeros", "math.sqrt", ".fx.kernels.f"
    constants: dict[str, int]  # module-level names bound once to an integer constant expression


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Every imported name, resolved to what it names; relative imports start with '.'."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:  # `import numpy.random` binds `numpy`
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _fold(node: ast.AST, constants: dict[str, int]) -> int | None:
    """The value of an integer constant expression, or None if it is not one."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, int) else None
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.UnaryOp):
        v = _fold(node.operand, constants)
        if v is None or isinstance(node.op, ast.Not):
            return None
        return {ast.USub: -v, ast.UAdd: +v, ast.Invert: ~v}[type(node.op)]
    if isinstance(node, ast.BinOp):
        a, b = _fold(node.left, constants), _fold(node.right, constants)
        if a is None or b is None:
            return None
        op = type(node.op)
        if op in (ast.FloorDiv, ast.Mod) and b == 0:
            return None
        if op in (ast.LShift, ast.RShift) and not 0 <= b <= 4096:
            return None
        if op is ast.Pow and not 0 <= b * max(1, abs(a).bit_length()) <= 1 << 16:
            return None
        ops: dict[type, Callable[[int, int], int]] = {
            ast.Add: int.__add__,
            ast.Sub: int.__sub__,
            ast.Mult: int.__mul__,
            ast.FloorDiv: int.__floordiv__,
            ast.Mod: int.__mod__,
            ast.Pow: int.__pow__,
            ast.LShift: int.__lshift__,
            ast.RShift: int.__rshift__,
            ast.BitAnd: int.__and__,
            ast.BitOr: int.__or__,
            ast.BitXor: int.__xor__,
        }
        return ops[op](a, b) if op in ops else None
    return None


def _constants(tree: ast.Module) -> dict[str, int]:
    stores: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stores[node.id] = stores.get(node.id, 0) + 1
    constants: dict[str, int] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        else:
            continue
        if isinstance(target, ast.Name) and stores[target.id] == 1:
            v = _fold(value, constants)
            if v is not None:
                constants[target.id] = v
    return constants


def _resolve(node: ast.AST, m: _Module) -> str | None:
    """What an imported name or attribute chain stands for: `npx.zeros` -> "numpy.zeros"."""
    if isinstance(node, ast.Name):
        return m.aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, m)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_outermost(node: ast.AST, m: _Module) -> bool:
    """True unless `node` is the object of an attribute access (`np` in `np.zeros`)."""
    parent = m.parents.get(node)
    return not (isinstance(parent, ast.Attribute) and parent.value is node)


def _is_call_target(node: ast.AST, m: _Module) -> bool:
    parent = m.parents.get(node)
    return isinstance(parent, ast.Call) and parent.func is node


def _is_docstring(node: ast.AST, m: _Module) -> bool:
    parent = m.parents.get(node)
    if not isinstance(parent, ast.Expr):
        return False
    body = getattr(m.parents.get(parent), "body", None)
    return bool(body) and body[0] is parent


def _is_int_dtype(node: ast.AST, m: _Module) -> bool:
    """`np.int64`, `int`, `bool` or an integer dtype string: a dtype named in the source."""
    if isinstance(node, ast.Name) and node.id in {"int", "bool"} and node.id not in m.aliases:
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return INT_DTYPE_STRING.fullmatch(node.value.strip().lower()) is not None
    q = _resolve(node, m) or ""
    return q.startswith("numpy.") and q.removeprefix("numpy.") in NUMPY_INT_DTYPES


def _dtype_keyword(call: ast.Call) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == "dtype"), None)


def _short(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


# -- the rules: one per kind of finding; each yields what it found at `node` ----------------------
def _float_literal(node: ast.AST, m: _Module) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, (float, complex)):
        yield f"float literal {node.value!r}"


def _float_dtype_string(node: ast.AST, m: _Module) -> Iterator[str]:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.strip().lower().lstrip("<>=|") in FLOAT_DTYPE_STRINGS
        and not _is_docstring(node, m)
    ):
        yield f"float dtype string {node.value!r}"


def _true_division(node: ast.AST, m: _Module) -> Iterator[str]:
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div):
        yield "true division `/` (use `//` by a positive divisor, or a shift)"


def _exponent(exponent: ast.AST, construct: str, m: _Module) -> Iterator[str]:
    """A power is integer only for a non-negative exponent: a literal, or a name (runtime)."""
    value = _fold(exponent, m.constants)
    if value is not None:
        if value < 0:
            yield f"negative power `{construct}` is a float"
    elif not isinstance(exponent, ast.Name):
        yield (
            f"power `{construct}`: the exponent is neither a non-negative integer literal "
            "nor a name, and a negative exponent makes a float"
        )


def _power(node: ast.AST, m: _Module) -> Iterator[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        yield from _exponent(node.right, _short(node), m)
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Pow):
        yield from _exponent(node.value, _short(node), m)
    elif isinstance(node, ast.Name) and node.id == "pow" and node.id not in m.aliases:
        call = m.parents.get(node)
        if not _is_call_target(node, m):
            yield "`pow` used as a value hides its exponent from the audit"
        elif isinstance(call, ast.Call):
            modular = len(call.args) == 3 or any(k.arg == "mod" for k in call.keywords)
            exps = call.args[1:2] or [k.value for k in call.keywords if k.arg == "exp"]
            if not modular:  # pow(a, b, m) of ints is an int, even for b < 0
                for exp in exps:
                    yield from _exponent(exp, _short(call), m)


def _float_builtin(node: ast.AST, m: _Module) -> Iterator[str]:
    if isinstance(node, ast.Name) and node.id in FLOAT_NAMES and node.id not in m.aliases:
        yield f"`{node.id}` makes a float"


def _dynamic_access(node: ast.AST, m: _Module) -> Iterator[str]:
    if isinstance(node, ast.Name) and node.id in DYNAMIC_NAMES and node.id not in m.aliases:
        yield f"`{node.id}` reaches names by string, out of the audit's sight"


def _import(node: ast.AST, m: _Module) -> Iterator[str]:
    """Kernels import the modules in MODULES and (relatively) other kernels; nothing else."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name not in MODULES:
                yield f"`import {alias.name}` is not on the kernel import allow-list"
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
        allowed = MODULES.get(node.module or "", frozenset())
        for alias in node.names:
            if alias.name not in allowed:
                yield (
                    f"`from {node.module} import {alias.name}` is not on the kernel "
                    "import allow-list"
                )


def _module_member(node: ast.AST, m: _Module) -> Iterator[str]:
    """`np.X`, `math.X`, `from numpy import X as Y`: X must be on its module's allow-list."""
    if not isinstance(node, (ast.Name, ast.Attribute)) or not _is_outermost(node, m):
        return
    q = _resolve(node, m)
    if not q or q.startswith("."):  # not imported, or the project's own kernels
        return
    root, *rest = q.split(".")
    if not rest or root == "__future__":
        return
    if root == "numpy":
        if rest[0] not in NUMPY_ALLOWED:
            yield f"`np.{rest[0]}` is not on the integer allow-list"
            return
        for attr in rest[1:]:
            if attr not in VALUE_ATTRIBUTES:
                yield f"attribute `.{attr}` of `np.{rest[0]}` is not on the integer allow-list"
                return
    elif root in MODULES:
        if rest[0] not in MODULES[root]:
            yield f"`{root}.{rest[0]}` is not on the integer allow-list"
    else:
        yield f"`{q}`: module `{root}` is not on the kernel import allow-list"


def _value_attribute(node: ast.AST, m: _Module) -> Iterator[str]:
    """`x.mean()`, `x.__truediv__(2)`: on a value, only the attributes in VALUE_ATTRIBUTES."""
    if (
        isinstance(node, ast.Attribute)
        and _resolve(node, m) is None
        and node.attr not in VALUE_ATTRIBUTES
    ):
        yield f"attribute `.{node.attr}` is not on the integer allow-list"


def _array_constructor(node: ast.AST, m: _Module) -> Iterator[str]:
    """`np.zeros(n)` is float64: numpy constructors must name an integer `dtype=`."""
    if isinstance(node, ast.Call):
        name = (_resolve(node.func, m) or "").removeprefix("numpy.")
        if name not in NUMPY_NEEDS_DTYPE:
            return
        dtype = _dtype_keyword(node)
        if dtype is None:
            yield f"`np.{name}` without an integer `dtype=` keyword (numpy's default is float64)"
        elif not _is_int_dtype(dtype, m):
            yield f"`np.{name}` with `dtype={_short(dtype)}`, which is not an integer dtype"
    elif (
        isinstance(node, (ast.Name, ast.Attribute))
        and _is_outermost(node, m)
        and not _is_call_target(node, m)
    ):
        name = (_resolve(node, m) or "").removeprefix("numpy.")
        if name in NUMPY_NEEDS_DTYPE:
            yield f"`np.{name}` used as a value hides its dtype from the audit"


def _empty_list_to_numpy(node: ast.AST, m: _Module) -> Iterator[str]:
    """`np.sum([])` is 0.0: numpy makes an empty list float64 unless a dtype is named."""
    if not isinstance(node, ast.Call):
        return
    q = _resolve(node.func, m) or ""
    dtype = _dtype_keyword(node)
    if not q.startswith("numpy.") or (dtype is not None and _is_int_dtype(dtype, m)):
        return
    args = [*node.args, *(k.value for k in node.keywords)]
    if any(isinstance(n, ast.List) and not n.elts for arg in args for n in ast.walk(arg)):
        yield f"empty list `[]` given to `np.{q.removeprefix('numpy.')}` is float64"


RULES: tuple[Callable[[ast.AST, _Module], Iterator[str]], ...] = (
    _float_literal,
    _float_dtype_string,
    _true_division,
    _power,
    _float_builtin,
    _dynamic_access,
    _import,
    _module_member,
    _value_attribute,
    _array_constructor,
    _empty_list_to_numpy,
)


def _export_types(source: str) -> Iterator[tuple[int, str]]:
    """Float or complex types in `# pythran export` signatures, read as Pythran reads them: every
    line starting with `#pythran` (docstrings too) and the comment lines continuing it."""
    in_spec, depth = False, 0
    for line_no, line in enumerate(source.split("\n"), start=1):
        start = PYTHRAN_LINE.match(line)
        if start:
            in_spec, depth, text = True, 0, line[start.end() :]
        elif in_spec and line.strip().startswith("#"):
            text = line.strip()[1:]
        else:
            in_spec = in_spec and not line.strip()
            continue
        for token in EXPORT_TOKEN.findall(text):
            if token in "()":
                depth = max(0, depth + (1 if token == "(" else -1))
            elif depth and token not in EXPORT_TYPES:  # depth 0 holds the exported names
                yield line_no, f"`# pythran export` type `{token}` is not on the integer allow-list"


def audit_source(source: str, path: str = "<string>") -> list[Finding]:
    """Every float construct in `source`, in line order. Raises SyntaxError if it does not parse."""
    tree = ast.parse(source, filename=path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    m = _Module(parents, _aliases(tree), _constants(tree))
    found: dict[tuple[int, str], None] = {}  # ordered and without repeats
    for node in ast.walk(tree):
        for rule in RULES:
            for what in rule(node, m):
                found[(getattr(node, "lineno", 0), what)] = None
    for line, what in _export_types(source):
        found[(line, what)] = None
    return sorted((Finding(path, line, what) for line, what in found), key=lambda f: f.line)


def audit_file(path: Path) -> list[Finding]:
    return audit_source(path.read_text(encoding="utf-8"), str(path))
