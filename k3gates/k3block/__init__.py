"""The K3 block: how 69 KDA layers and 24 Gated MLA layers interleave (K3-SPEC.md, the header).

    kinds = layer_schedule(93)     # [93] int8: 1 for Gated MLA, 0 for KDA, 1-based layer l = i + 1

The schedule itself is an integer kernel (k3gates.k3block.kernels) so the gate can hold it, and
the KV memory that follows from it, to the spec's statement.
"""

from __future__ import annotations

import numpy as np

from ..infra import compile as _compile

KERNELS = "k3gates.k3block.kernels"


def layer_schedule(n_layers: int = 93, period: int = 4) -> np.ndarray:
    """int8 [n_layers]: 1 where the 1-based layer is Gated MLA (every `period`-th layer, and the
    last), 0 where it is KDA."""
    if not (isinstance(n_layers, int) and 1 <= n_layers <= 1 << 16):
        raise ValueError(f"n_layers: expected an int in [1, 65536], got {n_layers!r}")
    if not (isinstance(period, int) and 1 <= period <= n_layers):
        raise ValueError(f"period: expected an int in [1, n_layers], got {period!r}")
    return _compile.load(KERNELS).layer_schedule(n_layers, period)
