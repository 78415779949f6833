"""KDA's own task: multi-query associative recall (MQAR; Zoology, Arora et al. 2023).

A sequence shows PAIRS key-value pairs, then QUERIES keys drawn from them, each followed by its
value. At every query key the model must predict that key's value: it has to have stored each
pair when it saw it, and look it up by key. Keys and values come from disjoint halves of the
vocabulary.

    k_1 v_1 k_2 v_2 ... k_N v_N | q_1 a_1 q_2 a_2 ... q_M a_M       (scored: a_j, predicted at q_j)

The model (k3gates.tasks.seq): an embedding, one KDA layer on K3-μ's kernels (2 heads of
d_k = d_v = 32, the short convolution, K3's lower-bounded decay), a head. The ablation fixes
beta at 0 (`BetaZero`). In KDA's update S_t = (I - beta k k^T) Diag(alpha) S_t-1 + beta k v^T,
beta scales the write as well as the erase, so with beta = 0 the state stays 0, the layer adds
exactly 0 and its weights get exactly no gradient: the ablated model is the model without the
layer, bit for bit (the gate checks this on three steps, then trains the layerless model).

W_f, the decay's input projection, is held at its initial value (FIXED); dt_bias, the decay's
per-channel bias, trains, and the decay stays data-dependent through the fixed projection. The
decay's pre-activation is a_head (W_f x + dt_bias) with a_head in [1, 16] (12.5 and 15.5 at
this seed), so one Muon step of W_f moves it by up to a_head lr |x|: in float64 trials (seed
1, 550 steps, W_f trained), a perturbation of 1e-6 of the initial weights grew to 2% of the
weights by step 50 and 11% by step 100, and two float64 runs ended 17% apart in held-out loss;
no comparison of an integer curve with a float64 curve can hold on a run that chaotic. With W_f
fixed, the same perturbation stays below 1e-4 of the weights at step 100.
"""

from __future__ import annotations

import numpy as np

from ...k3mu.ops import IntOps
from .. import seq as S

VOCAB = 64  # keys 0..31, values 32..63
KEYS = VOCAB // 2
PAIRS = 16
CONTEXT = 128
QUERIES = (CONTEXT - 2 * PAIRS) // 2  # 48 queries fill the rest of the sequence


def sequences(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n sequences: tokens [n, CONTEXT] and targets [n, CONTEXT] (the value at each query key's
    position, -1 elsewhere)."""
    tokens = np.zeros((n, CONTEXT), dtype=np.int64)
    targets = np.full((n, CONTEXT), -1, dtype=np.int64)
    for i in range(n):
        keys = rng.choice(KEYS, PAIRS, replace=False)
        values = KEYS + rng.integers(0, VOCAB - KEYS, PAIRS)
        tokens[i, 0 : 2 * PAIRS : 2] = keys
        tokens[i, 1 : 2 * PAIRS : 2] = values
        pick = rng.integers(0, PAIRS, QUERIES)
        q = 2 * PAIRS + 2 * np.arange(QUERIES)
        tokens[i, q] = keys[pick]
        tokens[i, q + 1] = values[pick]
        targets[i, q] = values[pick]
    return tokens, targets


# -- the model and its training --------------------------------------------------------------
CONFIG = S.SeqConfig(vocab=VOCAB, d=64, kinds=("kda",))
NO_LAYER = S.SeqConfig(vocab=VOCAB, d=64, kinds=())
# K3-μ's recipe with momentum 0.85: in float64 trials 0.95 needed 600 steps for 95%, 0.85 500
FIXED = ("0.attn.w_f",)  # not trained: see the module's docstring
HYPER = {"lr": 0.02, "lr_min": 0.001, "warmup": 20, "mu": 0.85, "wd": 0.0}
BATCH = 8
HELD_OUT = 64


class BetaZero:
    """kda.kernels_train with beta fixed at 0: every other kernel passes through unchanged."""

    def __init__(self, mod) -> None:
        self.mod = mod

    def __getattr__(self, name: str):
        return getattr(self.mod, name)

    def kda_fwd_act(self, c: np.ndarray, z: np.ndarray) -> tuple:
        act, gs, sg, ga, beta = self.mod.kda_fwd_act(c, z)
        return act, gs, sg, ga, np.zeros_like(beta)


def beta_zero_ops(load) -> IntOps:
    ops = IntOps(load)
    ops.mods["kda"] = BetaZero(ops.mods["kda"])
    return ops


def train_int(
    steps: int,
    seed: int,
    eval_every: int,
    h: dict,
    batch: int = BATCH,
    held_out: int = HELD_OUT,
    interpreted: bool = False,
) -> tuple:
    """The integer run as one call, for the rerun in a fresh process (k3gates.infra.fresh)."""
    from ...infra import compile as kcompile

    ops = IntOps(kcompile.interpreted if interpreted else kcompile.load)
    d = S.data(sequences, seed, steps, batch, held_out)
    out = S.run(ops, S.init(CONFIG, seed), CONFIG, d["train"], d["eval"], steps, h, eval_every,
                FIXED)  # fmt: skip
    return S.result_arrays(out)
