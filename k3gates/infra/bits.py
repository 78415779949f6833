"""Bits: whether two runs made the same outputs, and a short name for the outputs they made.

Kept apart from the gate API so that a fresh-process run (fresh.py) can digest what it computed
without importing the gate module that imports it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def digest(*arrays: Any) -> str:
    """A short SHA-256 over dtype, shape and bytes of each array: equal digests, equal bits."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def as_tuple(out: Any) -> tuple:
    """A kernel's outputs as a tuple, one array or several."""
    return out if isinstance(out, tuple) else (out,)


def bit_equal(a: Any, b: Any) -> bool:
    """Same dtype, same shape, same bytes, element by element of a tuple."""
    a, b = as_tuple(a), as_tuple(b)
    return len(a) == len(b) and all(digest(x) == digest(y) for x, y in zip(a, b, strict=True))
