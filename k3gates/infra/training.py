"""The one helper every training gate uses (DESIGN.md, "The level ladder"; issue 13, item 10).

A training gate trains something in integers, beside the same training in float64, and earns
its level only if all four of these hold:

1. `start_loss`: the run starts at least START_FACTOR times above its success threshold, so
   "below the threshold" is something the training did, not where it began. A cross-entropy
   run cannot start 10x above a threshold near its floor; it passes `start_near=(value, tol)`
   instead (e.g. log2 of the vocabulary, the loss of knowing nothing) and must start within
   `tol` of it and above the threshold.
2. `loss_curve`: at every logged step the integer loss is within a *relative* tolerance of the
   float64 twin's loss. The tolerance is the gate's declared bound for `loss_curve` (in the
   decorator, before any run); it is never equal to the threshold, which is a different thing.
3. `loss_below_threshold`: the final integer loss is below the threshold.
4. `rerun_fresh`: the whole training, rerun in a fresh process with another OpenMP thread count,
   is bit-identical to this process's run.

The gate starts that rerun (`start_rerun`) before its own run, so the fresh process trains while
this one trains and runs the float64 twin: the check costs cores, not wall time.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import numpy as np

from . import fresh
from .bits import as_tuple, digest
from .gate import GateContext

START_FACTOR = 10.0
CURVE = "loss_curve"  # the bound name a training gate declares: the relative tolerance


class Rerun:
    """The whole training running in a fresh process, started by `start_rerun`; `digest()` waits
    for it. A daemon thread, so a gate that fails before asking does not wait for it."""

    def __init__(self, mod: str, func: str, args: tuple, python: bool) -> None:
        # the gate's own run keeps this process's thread count; the rerun takes the other one
        self.here = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        self.func, self.threads = func, 2 if self.here == 1 else 1
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(mod, args, python), daemon=True)
        self._thread.start()

    def _run(self, mod: str, args: tuple, python: bool) -> None:
        try:
            self._digest = fresh.run_digest(
                mod, self.func, args, threads=self.threads, python=python
            )
        except BaseException as e:  # re-raised in the gate's thread by digest()
            self._error = e

    def digest(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return str(self._digest)


def start_rerun(
    ctx: GateContext,
    func: str,
    args: tuple,
    *,
    modname: str | None = None,
    python_module: str | None = None,
) -> Rerun:
    """Start the fresh-process rerun of kernel `func(*args)` (or, with `python_module`, of that
    Python module's training loop) at the other OpenMP thread count. Call it before the gate's
    own run of the same arguments, and pass the handle to `check_training`."""
    mod = python_module or ctx._modname(modname)
    # a copy: the gate's own run may not change what the fresh process is given
    return Rerun(mod, func, copy.deepcopy(args), python_module is not None)


def check_training(
    ctx: GateContext,
    *,
    curve: np.ndarray,
    twin: np.ndarray,
    threshold: float,
    unit: str,
    rerun: Rerun,
    first: Any,
    start_near: tuple[float, float] | None = None,
) -> bool:
    """Record the four training checks. `curve` and `twin` are the integer and float64 losses
    at the same logged steps; `rerun` (from `start_rerun`) is the fresh process's run of the
    arguments whose output `first` is this process's run of the whole training."""
    if CURVE not in ctx.spec.bounds:
        raise ValueError(f"gate {ctx.spec.id}: declare the relative tolerance bounds[{CURVE!r}]")
    rel_tol = float(ctx.spec.bounds[CURVE])
    if rel_tol == threshold:
        raise ValueError(
            f"gate {ctx.spec.id}: the curve tolerance equals the success threshold ({threshold})"
        )
    curve = np.asarray(curve, dtype=np.float64)
    twin = np.asarray(twin, dtype=np.float64)
    if start_near is None:
        ok = ctx.check(
            "start_loss",
            f"the run starts at least {START_FACTOR:g}× above its threshold {threshold:g}, so "
            "reaching the threshold is the training's doing",
            curve[0] >= START_FACTOR * threshold,
            message=f"start loss {curve[0]:.6g} < {START_FACTOR:g} × threshold {threshold:g}",
            start=float(curve[0]),
            threshold=threshold,
            helper="k3gates.infra.training",
        )
    else:
        center, tol = start_near
        ok = ctx.check(
            "start_loss",
            f"the run starts within {tol:g} of {center:.6g} (knowing nothing) and above its "
            f"threshold {threshold:g}, so reaching the threshold is the training's doing",
            abs(curve[0] - center) <= tol and curve[0] > threshold,
            message=f"start loss {curve[0]:.6g}: not within {tol:g} of {center:.6g} "
            f"or not above {threshold:g}",
            start=float(curve[0]),
            expected_start=center,
            tolerance=tol,
            threshold=threshold,
            helper="k3gates.infra.training",
        )
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = curve / twin
    ok &= ctx.check_reference(
        CURVE,
        f"at every one of {curve.size} logged steps the integer loss is within {rel_tol:g} "
        "(relative, declared) of the float64 run of the same model, data and initialisation",
        ratio,
        np.ones_like(twin),
        unit=f"integer / float64 loss ({unit})",
        steps=int(curve.size),
        max_abs_difference=float(np.abs(curve - twin).max()),
        helper="k3gates.infra.training",
    )
    ok &= ctx.check(
        "loss_below_threshold",
        f"the integer run's final loss is below the declared threshold {threshold:g}",
        curve[-1] < threshold,
        message=f"final loss {curve[-1]:.6g} >= {threshold:g}",
        initial=float(curve[0]),
        final=float(curve[-1]),
        threshold=threshold,
        helper="k3gates.infra.training",
    )
    runs = {
        f"this process (OMP_NUM_THREADS={rerun.here})": digest(*as_tuple(first)),
        f"fresh process (OMP_NUM_THREADS={rerun.threads})": rerun.digest(),
    }
    ok &= ctx.check_digests(
        "rerun_fresh",
        "the whole training rerun in a fresh process with another OpenMP thread count gives "
        "bit-identical losses and weights",
        runs,
        function=rerun.func,
        helper="k3gates.infra.training",
    )
    return bool(ok)
