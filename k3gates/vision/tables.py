"""The vision kernels' frequency tables, derived exactly on the host (k3gates/fx/host.py).

Apart from the library face so that the block and its backward, which the face imports, can use
them without importing the face.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ..fx import host
from . import kernels as K


def time_turns(dim: int) -> np.ndarray:
    """The time embedding's frequencies 10000^(-i/(dim/2)) in Q0.62 turns per frame, derived
    exactly (k3gates/fx/host.py): the same integers on every CPU."""
    return host.power_turns_q62(10000, [Fraction(i, dim // 2) for i in range(dim // 2)])


def rope_turns(head: int = K.HEAD) -> np.ndarray:
    """2D RoPE's frequencies per half head, 10000^(-2i/(head/2)), in Q0.62 turns per position,
    derived exactly (k3gates/fx/host.py)."""
    half = head // 2
    return host.power_turns_q62(10000, [Fraction(j, half) for j in range(0, half, 2)])
