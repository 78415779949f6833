"""1M context's own task: passkey retrieval (Mohtashami and Jaggi, 2023), trained in integers.

A passkey of DIGITS distinct digits is hidden at a random depth of filler text; at the end the
model is asked for it and answers digit by digit:

    filler ... K d1 d2 d3 d4 d5 filler ...  Q d1 d2 d3 d4      (scored: d1 at Q, d_j+1 at d_j)

The filler is the K3-μ corpus (Shakespeare, k3gates/k3mu/data) with its digits removed, read
from a random offset. A passkey counts as retrieved only if every digit is predicted: with
teacher forcing that is exactly what greedy decoding would produce, so the exact-match rate
is the field's passkey accuracy.

The model (k3gates.tasks.seq): an embedding plus an embedding of the previous token, one KDA
layer, then one Gated MLA layer, a head. K3 interleaves three KDA layers per MLA layer; the
three-KDA stack took 318 s for this gate on this 2-core machine (its budget is 180 s), so the
model keeps the smallest stack with both kinds in K3's order. The MLA layer is the last, and
only the answer rows are scored, so it runs its queries at those rows alone (kernels_mla with
t0 = T - 5): the model's loss and gradients are those of the full layer, at a
cost linear in the context instead of quadratic.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from ..k3mu import corpus, layer_mla, reference_mla
from ..k3mu.ops import FloatOps, IntOps
from ..tasks import seq as S

DIGITS = 5  # passkey length
FIRST_DIGIT = 1  # ids 1..10 are the digits 0..9; 0 is "no previous token"
KEY = 11  # "the pass key is"
ASK = 12  # "what is the pass key?"
FILLER0 = 13  # the filler characters start here


@cache
def filler_text() -> np.ndarray:
    """The corpus as ids FILLER0.. (digits dropped): the haystack every sequence is cut from."""
    text, vocab = corpus.load()
    keep = [c for c in vocab if not c.isdigit()]
    index = {c: FILLER0 + i for i, c in enumerate(keep)}
    return np.array([index[c] for c in text if c in index], dtype=np.int64)


VOCAB = int(filler_text().max()) + 1  # FILLER0 + the corpus's 76 characters less its 5 digits
ANSWER = DIGITS  # scored rows, the last of every sequence


def context(filler: int) -> int:
    """Tokens in a sequence with `filler` filler tokens."""
    return filler + 1 + DIGITS + 1 + DIGITS - 1


def sequences(rng: np.random.Generator, n: int, filler: int,
              depth: float | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """n sequences of `filler` filler tokens with a passkey at `depth` (a fraction of the
    filler before it; uniform at random if None): tokens, targets [n, context(filler)]."""
    text = filler_text()
    t = context(filler)
    tokens = np.zeros((n, t), dtype=np.int64)
    targets = np.full((n, t), -1, dtype=np.int64)
    for i in range(n):
        start = int(rng.integers(0, text.size - filler))
        hay = text[start : start + filler]
        at = int(rng.integers(0, filler + 1)) if depth is None else round(depth * filler)
        key = FIRST_DIGIT + rng.choice(10, DIGITS, replace=False)
        tokens[i] = np.concatenate([hay[:at], [KEY], key, hay[at:], [ASK], key[:-1]])
        targets[i, t - ANSWER :] = key
    return tokens, targets


def exact_match(pred: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per sequence: every digit of its passkey predicted (pred, want: [n * ANSWER])."""
    return np.all((pred == want).reshape(-1, ANSWER), axis=1)


# -- the model: K3-μ's layers, the last MLA at the answer rows only -------------------------------
CONFIG = S.SeqConfig(vocab=VOCAB, d=16, kinds=("kda", "mla"), shift=True)
MLA = len(CONFIG.kinds) - 1  # the MLA layer's index: the last


class RowsInt(IntOps):
    """The integer model with its MLA layer's queries at the answer rows only."""

    def layer(self, kind: str, x: np.ndarray, p: dict) -> tuple[np.ndarray, Any]:
        if kind != "mla":
            return super().layer(kind, x, p)
        return layer_mla.forward(self.mods["mla"], x, p, x.shape[1] - ANSWER)


class RowsFloat(FloatOps):
    """The float64 twin, its MLA layer likewise at the answer rows only."""

    def layer(self, kind, x, p):
        if kind != "mla":
            return super().layer(kind, x, p)
        return reference_mla.forward(x, p, x.shape[1] - ANSWER)


# -- the training run: a curriculum up to the trained length -------------------------------------
# (steps, filler tokens, sequences per step). A retrieval learned at short length does not reach
# 2^12 (a float64 trial of 800 steps at 32 filler tokens: 100% at 2^8, 0 passkeys at 2^12), so
# the filler grows by factors of 4-8 to the trained length, 2^12, as long-context training does.
PHASES = ((500, 32, 8), (100, 256, 8), (60, 1024, 4), (40, 4096, 4))
STEPS = sum(n for n, _, _ in PHASES)
TRAINED = PHASES[-1][1]  # filler tokens at the trained length
HELD_OUT = 8  # held-out sequences at the trained length, for the loss curve
# K3-μ's recipe, with the cosine's floor at half the peak: at a tenth, the last phase (at the
# trained length) barely moved the weights and a trial reached 0 of 6 passkeys at 2^16 filler
# tokens; at half, 6 of 6 (integer trials of the three-KDA stack at seed 7; at a constant 0.02 a
# state left the KDA recurrence's domain)
HYPER = {"lr": 0.02, "lr_min": 0.01, "warmup": 20, "mu": 0.95, "wd": 0.0}


def data(seed: int) -> dict:
    """The curriculum's batches, and HELD_OUT sequences at the trained length from another
    seed (passkeys at uniformly random depths)."""
    rng = np.random.default_rng(seed)
    train = [sequences(rng, b, filler) for n, filler, b in PHASES for _ in range(n)]
    return {"train": train, "eval": sequences(np.random.default_rng(seed + 1), HELD_OUT, TRAINED)}


def train_int(steps: int, seed: int, eval_every: int, h: dict, interpreted: bool = False) -> tuple:
    """The integer run as one call, for the rerun in a fresh process (k3gates.fresh)."""
    from .. import compile as kcompile

    ops = RowsInt(kcompile.interpreted if interpreted else kcompile.load)
    d = data(seed)
    out = S.run(ops, S.init(CONFIG, seed), CONFIG, d["train"], d["eval"], steps, h, eval_every)
    return S.result_arrays(out)
