"""Helpers shared by the gates that measure fixed-point kernels (fx, situ, and later ones).

Bounds are integers over 2^BOUND_FRAC in kernels.py (a kernel holds no float); `lsb` turns one
into output LSB for a gate's `bounds=`. The check helpers add the warm-up and shuffled-order runs
the contract's compiled and deterministic kinds need, and the gemmlowp anchor table.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3gates.infra.gate import GateContext

from .kernels import BOUND_FRAC

SEED = 20260703


def lsb(q10: int) -> float:
    """A bound constant of kernels.py (an integer over 2^BOUND_FRAC) in output LSB."""
    return q10 / 2**BOUND_FRAC


def in_lsb(real: np.ndarray, frac: int) -> np.ndarray:
    """A real-valued reference expressed in units of 2^-frac (the output LSB)."""
    return np.ldexp(np.asarray(real, dtype=np.float64), frac)


def raw(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def edge_ints(max_bits: int = 62) -> np.ndarray:
    """Powers of two +- {0, 1, 2}, their negatives, and the int64 extremes (STYLE rule 2)."""
    p = [(1 << i) + d for i in range(max_bits + 1) for d in (-2, -1, 0, 1, 2)]
    p += [0, 3, 5, 7, 2**63 - 1, 2**63 - 2, -(2**63) + 1, -(2**63) + 2]
    v = np.array(sorted({q for q in p if q < 2**63}), dtype=np.int64)
    return np.unique(np.concatenate([v, -v[v > -(2**63) + 1]]))


def _tuple(out: object) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def check_shuffled(ctx: GateContext, name: str, fn: Callable, x: np.ndarray, what: str) -> None:
    """A run over the rows of x in order and a run over the same rows in a shuffled order
    (un-shuffled after) agree bit for bit: each row's result depends on that row alone, not on
    which rows share the call or where it sits (the thread-count check is `ctx.check_threads`)."""
    perm = np.random.default_rng(SEED + 1).permutation(x.shape[0])
    inv = np.argsort(perm)
    back = tuple(np.asarray(o)[inv] for o in _tuple(fn(np.ascontiguousarray(x[perm]))))
    ctx.check_deterministic(
        name,
        f"{what} over {x.shape[0]:,} rows in order, and over the same rows in a shuffled order "
        "(un-shuffled afterwards), give bit-identical outputs",
        {"in order": _tuple(fn(x)), "rows shuffled, then restored": back},
    )


def check_compiled(
    ctx: GateContext,
    name: str,
    func: str,
    *args: object,
    inputs: str = "",
    modname: str | None = None,
) -> None:
    """compiled == interpreted, timed after one warm-up call (the first call of an OpenMP
    kernel starts the thread pool, which would otherwise dominate the speed ratio). `inputs`
    says what the interpreted side ran on (see `GateContext.check_compiled_matches_interpreted`)."""
    getattr(ctx.compiled(modname), func)(*args)
    ctx.check_compiled_matches_interpreted(name, func, *args, inputs=inputs, modname=modname)


def anchor_table(ctx: GateContext, rows: list[tuple[str, float, int]]) -> None:
    """The declared bounds beside gemmlowp fixedpoint.h's tolerances (both constants: a displayed
    fact, not a check; the reference checks above measure the kernels against the bounds)."""
    ctx.artifact(
        "table:declared bounds beside gemmlowp's fixedpoint.h tolerances (LSB of Q0.31)",
        {
            "columns": ["function", "declared bound", "gemmlowp anchor", "declared <= anchor"],
            "rows": [
                [function, bound, anchor, "yes" if bound <= anchor else "no"]
                for function, bound, anchor in rows
            ],
        },
    )
