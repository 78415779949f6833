"""The integer sampler: K3-μ writes text from a checkpoint, the same text on every machine.

Each next character: the model runs in integers on the last `context` characters, the head's
logits of the last position (Q.16) go to `kernels.sample_next`, which keeps the top-k, divides by
the temperature and draws from the fixed-point softmax with a seeded integer PRNG. No float
touches a logit, so one seed gives one text.
"""

from __future__ import annotations

import numpy as np

from . import corpus
from .model import ACT_FRAC, Config, forward


def sample(ops, params: dict, cfg: Config, prompt: str, chars: int, seed: int,
           temperature: float = 0.8, top_k: int = 20) -> str:  # fmt: skip
    """`prompt` followed by `chars` sampled characters."""
    _text, vocab = corpus.load()
    unknown = sorted({c for c in prompt if c not in vocab})
    if unknown:
        raise ValueError(f"prompt: characters not in the vocabulary: {unknown!r}")
    if not (0.05 <= temperature <= 8.0) or not (1 <= top_k <= len(vocab)):
        raise ValueError("temperature must be in [0.05, 8] and top_k in [1, vocabulary]")
    ids = [int(i) for i in corpus.encode(prompt, vocab)]
    temp_q = round(temperature * (1 << ACT_FRAC))  # the boundary: a float option to Q.16
    state = int(seed)
    for _ in range(chars):
        window = ids[-cfg.context :]
        tokens = np.array([[*window, 0]], dtype=np.int64)  # the last target is never used
        rec = forward(ops, params, cfg, tokens, grad=False)
        logits = ops.logits(rec["values"][rec["hn"]][-1:], params["head"])[0]
        token, state = ops.k.sample_next(np.ascontiguousarray(logits), temp_q, top_k, state)
        ids.append(int(token))
    return "".join(vocab[i] for i in ids)
