"""Count-based baselines for the K3-μ corpus, in bits/char on its validation tenth (issue 14).

`python -m k3gates.k3mu.baselines` prints the table and writes data/baselines.json, the figures
the k3mu_training gate is held to ("at least 0.3 bits/char below the bigram baseline").

Every model is counted on the training part only and scored on every validation character:

- uniform: log2(V), V the corpus vocabulary;
- unigram: p(c) = (n(c) + 1) / (N + V), add-one (Laplace);
- bigram:  p(c | a) = (n(a, c) + 1) / (n(a, ·) + V), n(a, ·) the bigrams of the training part
  that start with a;
- trigram: p(c | a, b) = (n(a, b, c) + 1) / (n(a, b, ·) + V), likewise.

An n-gram's counts use only n-grams lying wholly inside the training part. Scoring val[i] needs
the one or two characters before it; for the first validation characters those are the last
training characters, read as context only (they are never scored and never counted).

Float64 numpy, not a kernel: these are reference figures, not part of the integer model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from . import corpus

OUT = corpus.DATA_DIR / "baselines.json"
ORDERS = ("uniform", "unigram", "bigram", "trigram")


def ngram_bits(ids: np.ndarray, n_train: int, vocab_size: int, order: int) -> float:
    """Mean -log2 p(val[i] | previous order-1 chars) under the add-one order-gram model counted on
    ids[:n_train]. `order` is 1 (unigram), 2 (bigram) or 3 (trigram)."""
    if order not in (1, 2, 3) or not 0 < n_train < len(ids) or n_train < order:
        raise ValueError(f"order {order} and n_train {n_train} of {len(ids)} ids: out of range")
    V = vocab_size
    ids = ids.astype(np.int64)

    def codes(lo: int, hi: int) -> np.ndarray:
        # the order-gram ending at each position t in [lo, hi), as a base-V number: shape (hi-lo,)
        c = np.zeros(hi - lo, dtype=np.int64)
        for k in range(order):
            c = c * V + ids[lo - order + 1 + k : hi - order + 1 + k]
        return c

    train = codes(order - 1, n_train)  # n-grams wholly inside the training part
    full = np.bincount(train, minlength=V**order).reshape(-1, V)  # (V^(order-1), V)
    ctx = full.sum(axis=1)  # n(context, ·): (V^(order-1),)
    val = codes(n_train, len(ids))  # the n-gram ending at each validation character
    hist, nxt = val // V, val % V
    p = (full[hist, nxt] + 1) / (ctx[hist] + V)
    return float(-np.mean(np.log2(p)))


def compute(ids: np.ndarray, n_train: int, vocab_size: int) -> dict[str, float]:
    """The four baselines in bits/char on ids[n_train:]."""
    return {
        "uniform": math.log2(vocab_size),
        "unigram": ngram_bits(ids, n_train, vocab_size, 1),
        "bigram": ngram_bits(ids, n_train, vocab_size, 2),
        "trigram": ngram_bits(ids, n_train, vocab_size, 3),
    }


def report(data_dir: Path = corpus.DATA_DIR) -> dict:
    """Load the checked corpus, compute the baselines, and return baselines.json's content."""
    text, vocab = corpus.load(data_dir)
    ids = corpus.encode(text, vocab)
    train, val = corpus.split(ids)
    figures = compute(ids, len(train), len(vocab))
    return {
        **figures,  # bits/char on validation; top-level so gates read base["bigram"]
        "unit": "bits/char on the validation part",
        "nats": {k: v * math.log(2) for k, v in figures.items()},
        "smoothing": "add-one (Laplace); counted on the training part only",
        "corpus_sha256": corpus.read_provenance(data_dir)["corpus"]["sha256"],
        "vocab_size": len(vocab),
        "n_train": len(train),
        "n_val": len(val),
    }


def table(rep: dict) -> str:
    lines = [f"{'model':<10}{'bits/char':>11}{'nats/char':>11}"]
    lines += [f"{k:<10}{rep[k]:>11.4f}{rep['nats'][k]:>11.4f}" for k in ORDERS]
    lines.append(
        f"V = {rep['vocab_size']}, train {rep['n_train']} chars, validation {rep['n_val']} chars"
    )
    return "\n".join(lines)


def main() -> int:
    rep = report()
    OUT.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    print(table(rep))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
