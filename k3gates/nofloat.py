"""Static audit: a kernels module contains no float.

A kernel is integer-only when nothing in its source can produce a float value. The audit walks the
AST and reports every construct that could: a float or complex literal, true division `/`, a
negative power, `float()`/`complex()`, a float dtype by attribute or by name string, and the
`math` and numpy functions that return floats. Docstrings and comments are free text and are not
inspected. A finding names the file, the line and what was found.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# numpy callables whose result is float for integer input (or which draw random floats).
FLOAT_NUMPY = frozenset(
    [
        "sqrt",
        "cbrt",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log2",
        "log10",
        "log1p",
        "sin",
        "cos",
        "tan",
        "arcsin",
        "arccos",
        "arctan",
        "arctan2",
        "sinh",
        "cosh",
        "tanh",
        "arcsinh",
        "arccosh",
        "arctanh",
        "hypot",
        "degrees",
        "radians",
        "deg2rad",
        "rad2deg",
        "mean",
        "average",
        "std",
        "var",
        "median",
        "percentile",
        "quantile",
        "nanmean",
        "nanstd",
        "nanvar",
        "divide",
        "true_divide",
        "float_power",
        "linspace",
        "logspace",
        "geomspace",
        "interp",
        "random",
        "reciprocal",
        "ldexp",
        "frexp",
        "nextafter",
        "spacing",
        "trapz",
        "trapezoid",
        "corrcoef",
        "cov",
        "fft",
        "linalg",
    ]
)
# math functions that return int for int input; every other math call is rejected.
INT_MATH = frozenset({"isqrt", "gcd", "lcm", "comb", "perm", "factorial"})
FLOAT_NAMES = frozenset({"float", "complex"})
FLOAT_DTYPE_STRINGS = frozenset(
    [
        "f",
        "f2",
        "f4",
        "f8",
        "f16",
        "d",
        "e",
        "g",
        "float",
        "float16",
        "float32",
        "float64",
        "float128",
        "half",
        "single",
        "double",
        "longdouble",
        "complex",
        "complex64",
        "complex128",
        "c8",
        "c16",
        "<f4",
        "<f8",
        ">f4",
        ">f8",
        "=f4",
        "=f8",
    ]
)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    if not isinstance(parent, ast.Expr):
        return False
    owner = parents.get(parent)
    body = getattr(owner, "body", None)
    return bool(body) and body[0] is parent


def _attr_root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _float_attribute(node: ast.Attribute) -> str | None:
    attr = node.attr
    root = _attr_root(node)
    if "float" in attr.lower() or "complex" in attr.lower() or attr in {"half", "double", "single"}:
        return f"float dtype `{attr}`"
    if root == "math" and attr not in INT_MATH:
        return f"`math.{attr}` returns a float"
    if root in {"np", "numpy"} and attr in FLOAT_NUMPY:
        return f"`np.{attr}` returns a float"
    return None


def audit_source(source: str, path: str = "<string>") -> list[Finding]:
    """Every float construct in `source`, in line order. Raises SyntaxError if it does not parse."""
    tree = ast.parse(source, filename=path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[Finding] = []

    def add(node: ast.AST, what: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (float, complex)):
                add(node, f"float literal {node.value!r}")
            elif (
                isinstance(node.value, str)
                and not _is_docstring(node, parents)
                and node.value.strip().lower() in FLOAT_DTYPE_STRINGS
            ):
                add(node, f"float dtype string {node.value!r}")
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div):
            add(node, "true division `/` (use `//` by a positive divisor, or a shift)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = node.right
            if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, ast.USub):
                add(node, "negative power `** -n` is a float")
        elif isinstance(node, ast.Name) and node.id in FLOAT_NAMES:
            add(node, f"`{node.id}` makes a float")
        elif isinstance(node, ast.Attribute):
            what = _float_attribute(node)
            if what:
                add(node, what)
        elif isinstance(node, ast.ImportFrom) and node.module in {"math", "numpy", "numpy.random"}:
            for alias in node.names:
                if node.module == "math" and alias.name not in INT_MATH:
                    add(node, f"`from math import {alias.name}` returns a float")
                if node.module.startswith("numpy") and (
                    alias.name in FLOAT_NUMPY or "float" in alias.name
                ):
                    add(node, f"`from numpy import {alias.name}` returns a float")
    return sorted(found, key=lambda f: f.line)


def audit_file(path: Path) -> list[Finding]:
    return audit_source(path.read_text(encoding="utf-8"), str(path))
