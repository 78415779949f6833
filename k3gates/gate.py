"""The Gate/Check API that gates are written in (DESIGN.md, "The gate contract").

A gate is a function decorated with `@gate(...)`. It receives a `GateContext` and records checks
on it. Each check states, in one sentence, what it proves, and carries what was measured: the max
error against a bound *declared before the run*, digests, timings.

    @gate("mxfp_decode", innovation="mxfp", level="PARTIAL", kernels=["k3gates.mxfp.kernels"],
          bounds={"e4m3_exact": 0})
    def mxfp_decode(ctx: GateContext) -> None:
        k = ctx.compiled()
        got = ...
        ctx.check_reference("e4m3_exact", "every E4M3 code decodes to its exact value", got, want)

Bounds live in the decorator (usually as a constant imported from the kernels module, the same
constant its docstring states), so the code that measures an error can never choose its bound.
`check_reference` looks the bound up by check name and refuses a check that has none.

The id, innovation and level must be literals: the build reads them from the source without
importing it, and so can name the file and line of a bad id before anything runs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from . import compile as kcompile
from .discover import DEFAULT_TIMEOUT_S
from .registry import Level, canonical

# The five checks every gate at HAVE or above must contain (DESIGN.md, gate contract).
CONTRACT_KINDS = ("nofloat", "compiled", "reference", "deterministic", "property")


@dataclass
class Check:
    name: str
    kind: str  # one of CONTRACT_KINDS, or "contract" for the runner's own verdicts
    proves: str  # one sentence: what passing this check demonstrates
    passed: bool
    bound: float | None = None  # declared before the run, in `unit`
    measured: float | None = None  # the measured max error, in `unit`
    unit: str = ""
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    message: str = ""  # why it failed, when it did

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class GateSpec:
    id: str
    innovation: str | None  # canonical id; None for the foundations gates that count toward none
    level: Level
    kernels: tuple[str, ...]  # dotted module names of the kernels modules it exercises
    bounds: dict[str, float]
    timeout: float
    func: Callable[[GateContext], None]
    title: str
    doc: str
    file: str
    line: int


REGISTRY: dict[str, GateSpec] = {}


def gate(
    id: str,
    *,
    innovation: str | None,
    level: str,
    kernels: Sequence[str] = (),
    bounds: dict[str, float] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Callable[[Callable[[GateContext], None]], Callable[[GateContext], None]]:
    """Register a gate. See the module docstring."""

    def register(func: Callable[[GateContext], None]) -> Callable[[GateContext], None]:
        doc = (func.__doc__ or "").strip()
        code = func.__code__
        REGISTRY[id] = GateSpec(
            id=id,
            innovation=canonical(innovation) if innovation else None,
            level=Level.parse(level),
            kernels=tuple(kernels),
            bounds=dict(bounds or {}),
            timeout=float(timeout),
            func=func,
            title=doc.splitlines()[0] if doc else id,
            doc=doc,
            file=code.co_filename,
            line=code.co_firstlineno,
        )
        return func

    return register


def digest(*arrays: Any) -> str:
    """A short SHA-256 over dtype, shape and bytes of each array: equal digests, equal bits."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def bit_equal(a: Any, b: Any) -> bool:
    """Same dtype, same shape, same bytes, element by element of a tuple."""
    a, b = _as_tuple(a), _as_tuple(b)
    return len(a) == len(b) and all(digest(x) == digest(y) for x, y in zip(a, b, strict=True))


class GateContext:
    """What a gate body sees: its kernels, and the methods that record checks."""

    def __init__(self, spec: GateSpec) -> None:
        self.spec = spec
        self.checks: list[Check] = []
        self.summary = ""  # one measured sentence for the census row; set with `evidence()`
        self.artifacts: dict[str, Any] = {}  # tables and curves for the gate page

    # -- kernels -------------------------------------------------------------------------------
    def _modname(self, modname: str | None) -> str:
        if modname is None:
            if len(self.spec.kernels) != 1:
                raise ValueError(f"gate {self.spec.id}: name one of {self.spec.kernels}")
            return self.spec.kernels[0]
        if modname not in self.spec.kernels:
            raise ValueError(f"gate {self.spec.id}: {modname} is not in its declared kernels")
        return modname

    def compiled(self, modname: str | None = None) -> ModuleType:
        return kcompile.load(self._modname(modname))

    def interpreted(self, modname: str | None = None) -> ModuleType:
        return kcompile.interpreted(self._modname(modname))

    # -- recording -----------------------------------------------------------------------------
    def check(
        self,
        name: str,
        proves: str,
        passed: bool,
        *,
        kind: str = "property",
        message: str = "",
        digests: dict[str, str] | None = None,
        seconds: float = 0.0,
        **values: Any,
    ) -> bool:
        """Record a check whose verdict the gate computed itself. Returns `passed`."""
        if kind not in CONTRACT_KINDS:
            raise ValueError(f"check {name}: kind {kind!r} is not one of {CONTRACT_KINDS}")
        passed = bool(passed)
        self.checks.append(
            Check(
                name,
                kind,
                proves,
                passed,
                digests=digests or {},
                values=values,
                seconds=seconds,
                message="" if passed else (message or "condition false"),
            )
        )
        return passed

    def check_reference(
        self, name: str, proves: str, got: Any, want: Any, *, unit: str = "LSB", **values: Any
    ) -> bool:
        """max |got − want| (in `unit`) against the bound declared for `name` in the decorator.

        `got` and `want` must already be in the same unit (e.g. both in output LSB). NaN in either
        counts as an infinite error unless both are NaN at the same place; equal infinities are
        no error.
        """
        if name not in self.spec.bounds:
            raise ValueError(f"gate {self.spec.id}: check {name!r} has no declared bound")
        bound = float(self.spec.bounds[name])
        g = np.asarray(got, dtype=np.float64)
        w = np.asarray(want, dtype=np.float64)
        if g.shape != w.shape:
            raise ValueError(f"check {name}: shapes differ, got {g.shape} want {w.shape}")
        same = (np.isnan(g) & np.isnan(w)) | (g == w)  # equal infinities are no error
        with np.errstate(invalid="ignore"):
            err = np.where(same, 0.0, np.abs(g - w))
        err = np.where(np.isnan(err), np.inf, err)
        measured = float(err.max()) if err.size else 0.0
        passed = measured <= bound
        worst = int(np.argmax(err)) if err.size else 0
        message = (
            ""
            if passed
            else (
                f"max error {measured:g} {unit} > declared bound {bound:g} at flat index {worst}"
                f" (got {g.flat[worst]!r}, want {w.flat[worst]!r})"
            )
        )
        self.checks.append(
            Check(
                name,
                "reference",
                proves,
                passed,
                bound=bound,
                measured=measured,
                unit=unit,
                message=message,
                values={"points": int(err.size), **values},
            )
        )
        return passed

    def check_compiled_matches_interpreted(
        self, name: str, func: str, *args: Any, modname: str | None = None
    ) -> bool:
        """Run `func(*args)` compiled and under CPython; the outputs must be bit-identical.

        Records both times and the speed ratio interpreted/compiled (the gate page shows it).
        """
        fc = getattr(self.compiled(modname), func)
        fi = getattr(self.interpreted(modname), func)
        t0 = time.perf_counter()
        out_c = fc(*args)
        t1 = time.perf_counter()
        out_i = fi(*args)
        t2 = time.perf_counter()
        passed = bit_equal(out_c, out_i)
        tc, ti = t1 - t0, t2 - t1
        self.checks.append(
            Check(
                name,
                "compiled",
                f"the Pythran-compiled `{func}` and the same source under CPython give "
                "bit-identical "
                "output on these inputs",
                passed,
                digests={
                    "compiled": digest(*_as_tuple(out_c)),
                    "interpreted": digest(*_as_tuple(out_i)),
                },
                values={"compiled_s": tc, "interpreted_s": ti, "speed_ratio": ti / max(tc, 1e-9)},
                seconds=t2 - t0,
                message="" if passed else "outputs differ",
            )
        )
        return passed

    def check_deterministic(self, name: str, proves: str, runs: dict[str, Any]) -> bool:
        """Every labelled run (e.g. "first", "second", "permuted back") has the same digest."""
        digests = {label: digest(*_as_tuple(out)) for label, out in runs.items()}
        passed = len(runs) >= 2 and len(set(digests.values())) == 1
        message = (
            ""
            if passed
            else ("needs two or more runs" if len(runs) < 2 else f"digests differ: {digests}")
        )
        self.checks.append(
            Check(name, "deterministic", proves, passed, digests=digests, message=message)
        )
        return passed

    def evidence(self, sentence: str) -> None:
        """The measured sentence shown on the census row, e.g. "1 048 576 values round-trip"."""
        self.summary = sentence

    def artifact(self, key: str, value: Any) -> None:
        """A table or curve for the gate page (lists and numbers, JSON-serialisable)."""
        self.artifacts[key] = _jsonable(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None if np.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Path):
        return str(value)
    return value
