"""What every task gate of issue 15 does the same way: train the integer model beside its float64
twin through the shared training helper, hold the held-out accuracy to its bar, and hold one
compiled training step to CPython's.

A task module (mqar/task.py, induction/task.py, passkey/task.py) gives CONFIG, HYPER, BATCH,
HELD_OUT, `sequences(rng, n)`, FIXED (the weights it does not train; optional) and `train_int`,
the integer run as one call for the fresh-process rerun. A task whose batches change over the
run (passkey's curriculum) gives `data(seed)`, and a task whose model computes a layer its own
way passes its two ops classes as `ops`. The float64 twin trains in a fresh process beside the
integer run.
"""

from __future__ import annotations

import importlib
import math
import pickle
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from ..infra.gate import GateContext, digest
from ..infra.training import Rerun, check_training, start_rerun
from ..k3mu.ops import FloatOps, IntOps
from . import seq as S


def train_beside_twin(
    ctx: GateContext,
    task: ModuleType,
    *,
    steps: int,
    seed: int,
    eval_every: int | tuple[int, ...],
    threshold: float,
    start_tol: float | None,
    unit: str,
    data: dict | None = None,
    ops: tuple[type, type] = (IntOps, FloatOps),
) -> tuple[dict, dict, dict, float]:
    """Train the task's integer model and its float64 twin on the same batches and record the
    shared training checks: the start within `start_tol` of log2(vocab) (knowing nothing; None:
    at least 10× the threshold, for a model whose fixed head starts it above log2(vocab)), the
    held-out loss below `threshold`, the twin curve within the gate's declared bound, and a
    bit-identical fresh-process rerun. `data`, if given, is what `task_data` gives (a gate that
    needs the batches first computes them once). Returns the data, the integer and twin runs,
    and the integer run's seconds."""
    cfg, h, fixed = task.CONFIG, dict(task.HYPER), getattr(task, "FIXED", ())
    rerun = start_rerun(ctx, "train_int", (steps, seed, eval_every, h), python_module=task.__name__)
    int_ops, float_ops = ops
    twin_run = _Twin(task.__name__, steps, seed, eval_every, h, float_ops)
    d = data or task_data(task, seed, steps)
    t0 = time.perf_counter()
    out = S.run(int_ops(ctx.compiled), _init(task)(seed), cfg, d["train"], d["eval"], steps, h,
                eval_every, fixed)  # fmt: skip
    int_s = time.perf_counter() - t0
    twin = twin_run.result()
    check_training(
        ctx,
        curve=np.array(out["val"]),
        twin=np.array(twin["val"]),
        threshold=threshold,
        unit=unit,
        rerun=rerun,
        first=S.result_arrays(out),
        start_near=None if start_tol is None else (math.log2(cfg.vocab), start_tol),
    )
    return d, out, twin, int_s


def task_data(task: ModuleType, seed: int, steps: int) -> dict:
    """The task's batches: its own `data(seed)` if its batches change over the run (passkey's
    curriculum), else `steps` batches of BATCH sequences and HELD_OUT held-out ones."""
    if hasattr(task, "data"):
        return task.data(seed)
    return S.data(task.sequences, seed, steps, task.BATCH, task.HELD_OUT)


def train_twin(task_name: str, steps: int, seed: int, eval_every: int | tuple[int, ...], h: dict,
               float_ops: type, path: str) -> None:  # fmt: skip
    """The float64 twin's run, pickled to `path`: what a fresh process runs for `_Twin`."""
    task = importlib.import_module(task_name)
    d = task_data(task, seed, steps)
    twin = S.run(float_ops(), S.twin_params(_init(task)(seed)), task.CONFIG, d["train"],
                 d["eval"], steps, h, eval_every, getattr(task, "FIXED", ()))  # fmt: skip
    Path(path).write_bytes(pickle.dumps(twin))


class _Twin:
    """The float64 twin training in a fresh process, started before the integer run: on two
    cores it runs beside the integer run and its rerun instead of after them. The process is
    started as the rerun's is (training.Rerun); it writes the run to a file it is given."""

    def __init__(self, task_name: str, *args: object) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="k3twin-")
        self._path = Path(self._dir.name) / "twin.pickle"
        self._proc = Rerun(__name__, "train_twin", (task_name, *args, str(self._path)), True)

    def result(self) -> dict:
        self._proc.digest()  # waits; re-raises the process's failure
        with self._dir:
            return pickle.loads(self._path.read_bytes())


def _init(task: ModuleType):
    """The task's initial weights from a seed: its own `init` if it fixes some (passkey's head),
    else seq's."""
    return getattr(task, "init", None) or (lambda seed: S.init(task.CONFIG, seed))


def check_accuracy(
    ctx: GateContext, name: str, what: str, out: dict, held_out: tuple, minimum: float
) -> float:
    """The trained integer model's held-out accuracy (its last evaluation) at least `minimum`.
    `what` names the scored positions ("queries")."""
    acc = out["accuracy"][-1]
    scored = int(np.sum(held_out[1] >= 0))
    ctx.check(
        name,
        f"the trained integer model predicts at least {minimum:.0%} of the {scored} {what} of "
        f"{held_out[0].shape[0]} held-out sequences",
        acc >= minimum,
        message=f"accuracy {acc:.4f} < {minimum}",
        accuracy=acc,
        minimum=minimum,
        start=out["accuracy"][0],
        scored=scored,
    )
    return acc


def compiled_step(
    ctx: GateContext,
    task: ModuleType,
    d: dict,
    *,
    seed: int,
    tiny: slice,
    variants: tuple,
    what: str = "",
) -> None:
    """One training step of each ops class in `variants` on the `tiny` positions of the first
    training sequence, compiled and run by CPython from the same sources: bit-identical."""
    tokens, targets = d["train"][0]
    batch = [(tokens[:1, tiny].copy(), targets[:1, tiny].copy())]
    cfg, h, fixed = task.CONFIG, dict(task.HYPER), getattr(task, "FIXED", ())
    runs, seconds = {}, {}
    for name, load in (("compiled", ctx.compiled), ("interpreted", ctx.interpreted)):
        t0 = time.perf_counter()
        outs = [
            S.run(ops(load), _init(task)(seed), cfg, batch, batch[0], 1, h, 1, fixed)
            for ops in variants
        ]
        runs[name] = digest(*[a for out in outs for a in S.result_arrays(out)])
        seconds[name] = time.perf_counter() - t0
    ctx.check(
        "compiled_step",
        f"one training step on {tiny.stop - tiny.start} tokens of one sequence (forward, "
        f"backward, Per-Head Muon and AdamW){what} gives bit-identical results compiled and run "
        "by CPython from the same sources",
        runs["compiled"] == runs["interpreted"],
        kind="compiled",
        digests=runs,
        speed_ratio=seconds["interpreted"] / max(seconds["compiled"], 1e-9),
    )
