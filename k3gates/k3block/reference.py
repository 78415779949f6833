"""The K3 block's schedule as K3-SPEC.md states it, written out independently of kernels.py."""

from __future__ import annotations

K3_LAYERS = 93
K3_MLA_LAYERS = [*range(4, 93, 4), 93]  # 1-based: 4, 8, ..., 92 and the final 93


def mla_layers(n_layers: int, period: int) -> list[int]:
    """1-based MLA layers: every period-th layer, then the last one if it is not already MLA."""
    layers = list(range(period, n_layers + 1, period))
    if not layers or layers[-1] != n_layers:
        layers.append(n_layers)
    return layers


def attention_bytes(n_layers: int, mla: list[int], state: int, per_token: int, t: int) -> int:
    return (n_layers - len(mla)) * state + len(mla) * per_token * t
