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

A training gate declares `exclusive=True`: its fresh-process rerun (k3gates.infra.training) takes
the other core, so the runner runs nothing beside it and its wall time is its own.

The id, innovation and level must be literals: the build reads them from the source without
importing it, and so can name the file and line of a bad id before anything runs.
"""

from __future__ import annotations

import ast
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from . import compile as kcompile
from . import fresh
from .bits import as_tuple, bit_equal, digest
from .discover import DEFAULT_TIMEOUT_S
from .registry import Level, canonical

# The five checks every gate at HAVE or above must contain (DESIGN.md, gate contract).
CONTRACT_KINDS = ("nofloat", "compiled", "reference", "deterministic", "property")
# A reference check must be able to fail: its bound at most 5% of the reference's RMS, and an
# all-zero output outside it (issue 13). A looser rigorous bound may stand only as `worst_case`.
MAX_BOUND_OVER_RMS = 0.05
# A fault-suite run only needs to know whether some check fails: it may stop at the first.
STOP_AT_FIRST_FAILURE_ENV = "K3GATES_STOP_AT_FIRST_FAILURE"
# The thread counts a determinism check compares, each in a fresh process.
THREAD_COUNTS = (1, 2)


class FirstFailure(Exception):
    """Raised after the first failed check when STOP_AT_FIRST_FAILURE_ENV is set."""


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
    # discrimination, for comparisons against a reference (issue 13, item 1): can this fail?
    reference_rms: float | None = None  # RMS of the reference values, in `unit`
    bound_over_rms: float | None = None  # bound / reference_rms: at most MAX_BOUND_OVER_RMS
    zero_output_fails: bool | None = None  # an all-zero output would fail this comparison
    worst_case: bool = False  # a rigorous but loose bound, standing beside a tight check
    tight: str | None = None  # for a worst_case check: the tight check on the same output

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
    requires: tuple[str, ...]  # gate ids this gate builds on; it fails when one of them fails
    func: Callable[[GateContext], None]
    title: str
    doc: str
    file: str
    line: int
    exclusive: bool = False  # runs with the machine to itself (a training gate and its rerun)


REGISTRY: dict[str, GateSpec] = {}


def gate(
    id: str,
    *,
    innovation: str | None,
    level: str,
    kernels: Sequence[str] = (),
    bounds: dict[str, float] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    requires: Sequence[str] = (),
    exclusive: bool = False,
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
            requires=tuple(requires),
            exclusive=bool(exclusive),
            func=func,
            title=first_sentence(doc) or id,
            doc=doc,
            file=code.co_filename,
            line=code.co_firstlineno,
        )
        return func

    return register


# A sentence ends at . ! or ? before a space and a capital or "(", or at the paragraph end.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, whole, its line breaks made spaces."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return _SENTENCE_END.split(paragraph, maxsplit=1)[0]


class GateContext:
    """What a gate body sees: its kernels, and the methods that record checks."""

    def __init__(self, spec: GateSpec) -> None:
        self.spec = spec
        self.checks: list[Check] = []
        self.summary = ""  # one measured sentence for the census row; set with `evidence()`
        self.artifacts: dict[str, Any] = {}  # tables and curves for the gate page
        self.used_small = False  # the gate ran its smaller shape (a fault-suite run asked)

    @property
    def small(self) -> bool:
        """True in a fault-suite run that asks long gates for a smaller shape of the same gate
        (same function, same declared bounds). A gate that honours it says so on its page."""
        if os.environ.get("K3GATES_SMALL") == "1":
            self.used_small = True
        return self.used_small

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
    def _record(self, check: Check) -> None:
        self.checks.append(check)
        if not check.passed and os.environ.get(STOP_AT_FIRST_FAILURE_ENV) == "1":
            raise FirstFailure(check.name)

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
        self._record(
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
        self,
        name: str,
        proves: str,
        got: Any,
        want: Any,
        *,
        unit: str = "LSB",
        worst_case: bool = False,
        tight: str | None = None,
        **values: Any,
    ) -> bool:
        """max |got − want| (in `unit`) against the bound declared for `name` in the decorator.

        `got` and `want` must already be in the same unit (e.g. both in output LSB). NaN in either
        counts as an infinite error unless both are NaN at the same place; equal infinities are
        no error.

        The check also measures whether it can fail: the reference's RMS, bound / RMS, and whether
        an all-zero output would fail. Unless it is a `worst_case` check it fails when bound / RMS
        exceeds MAX_BOUND_OVER_RMS or a zero output would pass. A `worst_case` check names the
        `tight` check on the same output that stands beside it (verified in `finish`).
        """
        if name not in self.spec.bounds:
            raise ValueError(f"gate {self.spec.id}: check {name!r} has no declared bound")
        if worst_case and not tight:
            raise ValueError(f"check {name}: a worst_case check names its tight check")
        bound = float(self.spec.bounds[name])
        g = np.asarray(got, dtype=np.float64)
        w = np.asarray(want, dtype=np.float64)
        if g.shape != w.shape:
            raise ValueError(f"check {name}: shapes differ, got {g.shape} want {w.shape}")
        err = _abs_error(g, w)
        measured = float(err.max()) if err.size else 0.0
        rms, over, zero_fails = discrimination(w, bound)
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
        if passed and not worst_case:
            blind = _blindness(over, zero_fails)
            passed, message = not blind, blind
        self._record(
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
                reference_rms=rms,
                bound_over_rms=over,
                zero_output_fails=zero_fails,
                worst_case=worst_case,
                tight=tight,
            )
        )
        return passed

    def check_compiled_matches_interpreted(
        self, name: str, func: str, *args: Any, inputs: str = "", modname: str | None = None
    ) -> bool:
        """Run `func(*args)` compiled and under CPython; the outputs must be bit-identical.

        `inputs` says what the interpreted side ran on: the gate's real inputs, or a slice large
        enough to reach every branch (and which). NumPy integer scalars wrap like C++ with only
        a RuntimeWarning; here that warning is an error, so an int64 overflow that the compiled
        kernel silently wraps fails the check. Records both times and the speed ratio.
        """
        fc = getattr(self.compiled(modname), func)
        fi = getattr(self.interpreted(modname), func)
        t0 = time.perf_counter()
        out_c = fc(*args)
        t1 = time.perf_counter()
        raised = ""
        try:
            with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise"):
                warnings.simplefilter("error", RuntimeWarning)
                out_i = fi(*args)
        except (ArithmeticError, RuntimeWarning, OverflowError, ValueError) as e:
            raised, out_i = f"the interpreted run raised {type(e).__name__}: {e}", None
        t2 = time.perf_counter()
        passed = not raised and bit_equal(out_c, out_i)
        if not inputs:  # the check must say what it ran on
            passed, raised = (
                False,
                "the check does not say which inputs the interpreted side ran on",
            )
        tc, ti = t1 - t0, t2 - t1
        digests = {"compiled": digest(*as_tuple(out_c))}
        if not raised:
            digests["interpreted"] = digest(*as_tuple(out_i))
        self._record(
            Check(
                name,
                "compiled",
                f"the Pythran-compiled `{func}` and the same source under CPython give "
                f"bit-identical output on {inputs}, with NumPy overflow an error",
                passed,
                digests=digests,
                values={
                    "inputs": inputs,
                    "compiled_s": tc,
                    "interpreted_s": ti,
                    "speed_ratio": ti / max(tc, 1e-9),
                },
                seconds=t2 - t0,
                message="" if passed else (raised or "outputs differ"),
            )
        )
        return passed

    def check_threads(
        self, name: str, proves: str, func: str, *args: Any, modname: str | None = None
    ) -> bool:
        """Run compiled `func(*args)` in fresh processes with OMP_NUM_THREADS=1 and =2 and here;
        every digest must be equal. `func` must reach an `omp parallel` loop (in its body or a
        kernel it calls), or the thread count could not matter and the check would prove
        nothing."""
        mod = self._modname(modname)
        loops = omp_loops(mod, func)
        t0 = time.perf_counter()
        runs = {"this process": digest(*as_tuple(getattr(self.compiled(mod), func)(*args)))}
        for n in THREAD_COUNTS:
            runs[f"fresh process, OMP_NUM_THREADS={n}"] = fresh.run_digest(
                mod, func, args, threads=n
            )
        passed = loops > 0 and len(set(runs.values())) == 1
        if loops == 0:
            message = f"{mod}.{func} reaches no `omp parallel` loop: the thread count cannot matter"
        else:
            message = "" if passed else f"digests differ: {runs}"
        self._record(
            Check(
                name,
                "deterministic",
                proves,
                passed,
                digests=runs,
                values={"function": func, "omp_loops_reached": loops},
                seconds=time.perf_counter() - t0,
                message=message,
            )
        )
        return passed

    def check_digests(self, name: str, proves: str, digests: dict[str, str], **values: Any) -> bool:
        """Digests computed elsewhere (fresh processes): all labelled digests must be equal."""
        passed = len(digests) >= 2 and len(set(digests.values())) == 1
        message = "" if passed else f"digests differ: {digests}"
        self._record(
            Check(name, "deterministic", proves, passed, digests=digests, values=values,
                  message=message)
        )  # fmt: skip
        return passed

    def check_deterministic(self, name: str, proves: str, runs: dict[str, Any]) -> bool:
        """Every labelled run (e.g. "C = 16", "rows permuted back") has the same digest.

        The runs must differ in something a float implementation would be sensitive to
        (thread count, split points, order of independent rows): two reruns of identical
        inputs prove nothing."""
        digests = {label: digest(*as_tuple(out)) for label, out in runs.items()}
        passed = len(runs) >= 2 and len(set(digests.values())) == 1
        message = (
            ""
            if passed
            else ("needs two or more runs" if len(runs) < 2 else f"digests differ: {digests}")
        )
        self._record(Check(name, "deterministic", proves, passed, digests=digests, message=message))
        return passed

    def finish(self) -> None:
        """After the gate body: a worst_case check stands only beside a discriminating tight
        check on the same output."""
        by_name = {c.name: c for c in self.checks}
        for c in self.checks:
            if not c.worst_case:
                continue
            t = by_name.get(c.tight or "")
            ok = t is not None and t.kind == "reference" and not t.worst_case
            if ok and _blindness(t.bound_over_rms, t.zero_output_fails):
                ok = False
            if not ok and c.passed:
                c.passed = False
                c.message = (
                    f"worst_case check without a discriminating tight check {c.tight!r} "
                    "on the same output"
                )

    def evidence(self, sentence: str) -> None:
        """The measured sentence shown on the census row, e.g. "1 048 576 values round-trip"."""
        self.summary = sentence

    def artifact(self, key: str, value: Any) -> None:
        """A table or curve for the gate page (lists and numbers, JSON-serialisable)."""
        self.artifacts[key] = _jsonable(value)


def _abs_error(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    same = (np.isnan(g) & np.isnan(w)) | (g == w)  # equal infinities are no error
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(g - w))
    return np.where(np.isnan(err), np.inf, err)


def discrimination(want: np.ndarray, bound: float) -> tuple[float, float, bool]:
    """(RMS of the reference, bound / RMS, whether an all-zero output fails against `want`)."""
    w = np.asarray(want, dtype=np.float64)
    finite = w[np.isfinite(w)]
    rms = float(np.sqrt(np.mean(np.square(finite)))) if finite.size else 0.0
    over = bound / rms if rms > 0 else float("inf")
    zero_err = _abs_error(np.zeros_like(w), w)
    zero_fails = bool(zero_err.size) and float(zero_err.max()) > bound
    return rms, over, zero_fails


def _blindness(over: float | None, zero_fails: bool | None) -> str:
    """Why a reference check could not fail, or "" when it can."""
    if not zero_fails:
        return "an all-zero output would pass this comparison: the check cannot discriminate"
    if over is None or not over <= MAX_BOUND_OVER_RMS:
        return (
            f"bound / reference RMS = {over:.3g} > {MAX_BOUND_OVER_RMS}: the bound is too loose "
            "to discriminate (keep it only as a worst_case check beside a tight one)"
        )
    return ""


_OMP = re.compile(r"#\s*omp\s+parallel")


def omp_loops(modname: str, func: str) -> int:
    """`omp parallel` pragmas that a call of `func` can reach: in its own body and, transitively,
    in every kernel function it calls (by name, across the kernel modules it imports)."""
    bodies: dict[str, tuple[int, set[str]]] = {}  # function -> (pragmas in body, names called)
    for path in kcompile.dependencies(modname).values():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                calls = {
                    c.func.id
                    for c in ast.walk(node)
                    if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                }
                bodies.setdefault(node.name, (len(_OMP.findall(body)), calls))
    seen: set[str] = set()
    todo = [func]
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        todo.extend(bodies[name][1])
    return sum(bodies[name][0] for name in seen)


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
