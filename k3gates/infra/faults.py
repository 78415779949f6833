"""Output faults: prove that a gate catches a wrong kernel (issue 13, item 2).

`python -m k3gates faults GATE|INNOVATION|all` reruns gates with the environment variable
`K3GATES_FAULT` set. In that process every compiled kernel is wrapped so that each integer array
(or integer scalar) it returns is corrupted in one fixed way:

| fault | what it does to each output |
|---|---|
| zeros | every element 0 |
| lsb | +1 on the middle element |
| sign | the middle non-zero element negated |
| rms2 | + max(1, round(0.02 · RMS)) on every element |
| permute | rolled by one along the last axis |

A gate *catches* a fault when at least one of its checks fails (or the gate errors) under it. A
fault *applies* when it changed at least one kernel output during the run; one that changed
nothing (a permutation of scalars, a sign flip of all-zero outputs) is `n/a`, with that reason.

The same wrapper also guards every compiled kernel, faulted or not: an output whose dtype is not
an integer is refused with a TypeError naming the function. A kernel is integer-only at run time
too, not just in its source.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

FAULT_ENV = "K3GATES_FAULT"
FAULTS: dict[str, str] = {
    "zeros": "every output element set to 0",
    "lsb": "+1 LSB on the middle element of each output",
    "sign": "the sign of the middle non-zero element of each output flipped",
    "rms2": "+2% of the output's RMS (at least 1 LSB) added to every element",
    "permute": "each output rolled by one place along its last axis",
}

# What the active fault changed in this process: the worker publishes it with the gate's result.
STATS: dict[str, int] = {"calls": 0, "outputs": 0, "changed": 0}


class NonIntegerOutput(TypeError):
    """A compiled kernel returned a float (or other non-integer) value."""


def active() -> str | None:
    name = os.environ.get(FAULT_ENV) or None
    if name is not None and name not in FAULTS:
        raise ValueError(
            f"{FAULT_ENV}={name!r}: unknown fault; expected one of {', '.join(FAULTS)}"
        )
    return name


def _is_integer(x: Any) -> bool:
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    return isinstance(x, np.ndarray) and x.dtype.kind in "iu"


def _middle_nonzero(flat: np.ndarray) -> int | None:
    nz = np.flatnonzero(flat)
    if nz.size == 0:
        return None
    return int(nz[np.argmin(np.abs(nz - flat.size // 2))])


def corrupt_array(a: np.ndarray, fault: str) -> np.ndarray:
    """The faulted copy of one integer array (the input is never modified)."""
    out = np.array(a, copy=True)
    flat = out.reshape(-1)
    if flat.size == 0:
        return out
    if fault == "zeros":
        out[...] = 0
    elif fault == "lsb":
        flat[flat.size // 2] += 1
    elif fault == "sign":
        i = _middle_nonzero(flat)
        if i is not None and a.dtype.kind == "i":
            flat[i] = -flat[i]
    elif fault == "rms2":
        rms = float(np.sqrt(np.mean(np.square(flat.astype(np.float64)))))
        out += max(1, round(0.02 * rms))
    elif fault == "permute" and out.ndim >= 1 and out.shape[-1] > 1:
        out = np.ascontiguousarray(np.roll(out, 1, axis=-1))
    return out


def corrupt_scalar(x: int, fault: str) -> int | None:
    """The faulted scalar, or None when the fault cannot apply to a scalar (a permutation)."""
    x = int(x)
    if fault == "zeros":
        return 0
    if fault == "lsb":
        return x + 1
    if fault == "sign":
        return -x
    if fault == "rms2":
        return x + max(1, round(0.02 * abs(x)))
    return None


def _corrupt(value: Any, fault: str) -> Any:
    if isinstance(value, tuple):
        return tuple(_corrupt(v, fault) for v in value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        STATS["outputs"] += 1
        bad = corrupt_array(value, fault)
        if bad.shape != value.shape or not np.array_equal(bad, value):
            STATS["changed"] += 1
        return bad
    if _is_integer(value):
        STATS["outputs"] += 1
        bad = corrupt_scalar(value, fault)
        if bad is None:
            return value
        if bad != int(value):
            STATS["changed"] += 1
        return type(value)(bad) if isinstance(value, np.integer) else bad
    return value


def _check_integer(value: Any, where: str) -> None:
    if value is None:
        return
    if isinstance(value, tuple):
        for v in value:
            _check_integer(v, where)
        return
    if not _is_integer(value):
        what = getattr(value, "dtype", type(value).__name__)
        raise NonIntegerOutput(
            f"{where} returned a non-integer value ({what}); kernels are integer-only"
        )


class GuardedModule:
    """A compiled kernels module whose functions refuse non-integer outputs (and, when a fault
    is active, corrupt their integer outputs)."""

    def __init__(self, module: ModuleType, modname: str, fault: str | None) -> None:
        self._module, self._modname, self._fault = module, modname, fault
        self.__name__ = getattr(module, "__name__", modname)
        self.__file__ = getattr(module, "__file__", None)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not callable(attr) or name.startswith("__"):
            return attr
        wrapped = self._wrap(attr, f"{self._modname}.{name}")
        setattr(self, name, wrapped)  # one wrapper per function
        return wrapped

    def _wrap(self, func: Callable, where: str) -> Callable:
        fault = self._fault

        def call(*args: Any, **kwargs: Any) -> Any:
            out = func(*args, **kwargs)
            _check_integer(out, where)
            if fault is None:
                return out
            STATS["calls"] += 1
            return _corrupt(out, fault)

        call.__name__ = getattr(func, "__name__", where)
        call.__doc__ = getattr(func, "__doc__", None)
        return call


def guard(module: ModuleType, modname: str) -> GuardedModule:
    return GuardedModule(module, modname, active())
