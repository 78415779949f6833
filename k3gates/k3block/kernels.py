"""The K3 block's layer schedule and the attention memory it implies, in integers.

K3 stacks 93 layers: three KDA layers, then one Gated MLA layer, repeated, with a final MLA layer
(1-based MLA layers 4, 8, ..., 92 and 93; K3-SPEC.md). `layer_schedule` writes that rule for any
depth and period; `attention_bytes` adds up what the attention layers hold at a context length:
a KDA layer keeps a state of fixed size, an MLA layer a latent cache that grows by one row per
token.

Formats: plain integers (int64 arithmetic). Domain and worst-case magnitudes: n_layers <= 2^16,
a KDA state < 2^31 bytes, an MLA row < 2^20 bytes per token, tokens <= 2^24, so
n_kda * state < 2^47 and n_mla * row * tokens < 2^60: the total is below 2^61 and exact.
`attention_bytes` returns -1 outside that domain. Error bound: 0, nothing is rounded.
"""

import numpy as np


# pythran export layer_schedule(int, int)
def layer_schedule(n_layers, period):
    """int8 [n_layers]: 1 (Gated MLA) where the 1-based layer l has l % period == 0 or
    l == n_layers, else 0 (KDA)."""
    kinds = np.zeros(n_layers, dtype=np.int8)
    for i in range(n_layers):
        layer = i + 1
        # MLA at l = period, 2 period, ..., and the last layer l = n_layers
        if layer % period == 0 or layer == n_layers:
            kinds[i] = 1
    return kinds


# pythran export attention_bytes(int8[:], int, int, int)
def attention_bytes(kinds, kda_state_bytes, mla_bytes_per_token, tokens):
    """Bytes the attention layers of a stack hold at `tokens` tokens: each KDA layer its fixed
    state, each MLA layer mla_bytes_per_token per token. -1 when an input is outside the exact
    domain (see the module docstring)."""
    if kda_state_bytes < 0 or kda_state_bytes >= 1 << 31:
        return -1
    if mla_bytes_per_token < 0 or mla_bytes_per_token >= 1 << 20:
        return -1
    if tokens < 0 or tokens > 1 << 24 or kinds.shape[0] > 1 << 16:
        return -1
    n_mla = 0
    for i in range(kinds.shape[0]):
        n_mla += int(kinds[i])
    n_kda = kinds.shape[0] - n_mla
    # total = n_kda S + n_mla c T
    return n_kda * kda_state_bytes + n_mla * mla_bytes_per_token * tokens
