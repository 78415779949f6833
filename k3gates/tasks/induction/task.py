"""Gated MLA's own task: induction (copy after a marker).

A sequence is HALF distinct random tokens, a marker, then the same tokens again. From the marker
on, the model predicts each next token of the repeat: it must find the current token's earlier
occurrence and read off what followed it.

    x_1 x_2 ... x_L  M  x_1 x_2 ... x_L          (scored: at M predict x_1, at x_j predict x_j+1)

The model (k3gates.tasks.seq): an embedding plus an embedding of the previous token, one Gated
MLA layer on K3-μ's kernels, a head. K3's MLA layers are NoPE: their position signal comes from
the KDA layers' short convolution, which this one-layer model does not have, so the
previous-token embedding stands in for it (without it, two NoPE MLA layers stayed at 4% in a
float64 trial). The ungated variant holds the output gate at 1 (kernels.mla_open_gate).

`decode` runs the trained model token by token over the latent cache (kernels.mla_decode_step)
and continues the sequence greedily: its logits must equal the full forward's bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...k3mu.ops import IntOps
from ...mla.layer_train import WEIGHTS, DomainError
from .. import seq as S

VOCAB = 64  # 1 .. 62 content, 63 the marker, 0 the "no previous token" id
MARKER = VOCAB - 1
HALF = 16
CONTEXT = 2 * HALF + 1


def sequences(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n sequences: tokens [n, CONTEXT] and targets [n, CONTEXT] (the next token from the marker
    to the second-last position, -1 elsewhere)."""
    # distinct tokens: a repeated one would make its successor ambiguous
    body = np.stack([1 + rng.choice(MARKER - 1, HALF, replace=False) for _ in range(n)])
    tokens = np.concatenate([body, np.full((n, 1), MARKER), body], axis=1).astype(np.int64)
    targets = np.full((n, CONTEXT), -1, dtype=np.int64)
    targets[:, HALF : CONTEXT - 1] = tokens[:, HALF + 1 :]
    return tokens, targets


# -- the model and its training --------------------------------------------------------------
CONFIG = S.SeqConfig(vocab=VOCAB, d=64, kinds=("mla",), shift=True)
HYPER = {"lr": 0.01, "lr_min": 0.001, "warmup": 20, "mu": 0.95, "wd": 0.0}  # K3-μ's recipe
BATCH = 8
HELD_OUT = 64
DECODE_KERNELS = "k3gates.mla.kernels_decode"


class OpenGateOps(IntOps):
    """The integer model with each MLA layer's output gate held open (sigma = 1)."""

    def layer(self, kind: str, x: np.ndarray, p: dict) -> tuple[np.ndarray, Any]:
        y, cache = super().layer(kind, x, p)
        if kind != "mla":
            return y, cache
        dec = self.load(DECODE_KERNELS)
        y, sg, gated, bad = dec.mla_open_gate(cache[11], np.ascontiguousarray(p["w_o"]))
        if bad:
            raise DomainError(f"mla_open_gate: {bad} outputs outside the shared GEMM's domain")
        return y, (*cache[:12], sg, gated)


def train_int(
    steps: int,
    seed: int,
    eval_every: int,
    h: dict,
    open_gate: bool = False,
    batch: int = BATCH,
    held_out: int = HELD_OUT,
    interpreted: bool = False,
) -> tuple:
    """The integer run as one call, for the rerun in a fresh process (k3gates.infra.fresh)."""
    from ...infra import compile as kcompile

    load = kcompile.interpreted if interpreted else kcompile.load
    ops = OpenGateOps(load) if open_gate else IntOps(load)
    d = S.data(sequences, seed, steps, batch, held_out)
    out = S.run(ops, S.init(CONFIG, seed), CONFIG, d["train"], d["eval"], steps, h, eval_every)
    return S.result_arrays(out)


# -- decode over the latent cache ---------------------------------------------------------------
def decode(ops: Any, dec: Any, p: dict, prompt: np.ndarray, new: int,
           open_gate: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Feed `prompt` one token at a time through the integer model, then continue it greedily
    for `new` tokens; each MLA layer keeps only its latent cache (c_kv, k_r rows). Returns the
    tokens [len(prompt) + new] and the logits [len(prompt) + new - 1, V] at every position but
    the last (Q.16)."""
    cfg = CONFIG
    total = prompt.size + new
    tokens = [int(t) for t in prompt]
    caches = []
    for i in range(len(cfg.kinds)):
        w = p[f"{i}.attn.w_dkv"].shape[0], p[f"{i}.attn.w_kr"].shape[0]
        caches.append((np.zeros((total, w[0]), np.int64), np.zeros((total, w[1]), np.int64)))
    rows = []
    for n in range(total - 1):
        prev = tokens[n - 1] if n else 0
        x = ops.add(ops.embed(np.array([tokens[n]]), p["emb"]),
                    ops.embed(np.array([prev]), p["emb_prev"]))  # fmt: skip
        for i in range(len(cfg.kinds)):
            xn, _ = ops.norm(x, p[f"{i}.norm"])
            weights = [np.ascontiguousarray(p[f"{i}.attn.{k}"]) for k in WEIGHTS]
            c_kv, k_r = caches[i]
            y, c_new, kr_new, bad = dec.mla_decode_step(xn, *weights, c_kv, k_r, n, int(open_gate))
            if bad:
                raise DomainError(f"mla_decode_step: {bad} values outside the Q.24 domain")
            c_kv[n], k_r[n] = c_new[0], kr_new[0]  # the cache grows by one latent row
            x = ops.add(x, y)
        hn, _ = ops.norm(x, p["final_norm"])
        rows.append(ops.logits(hn, p["head"])[0])
        if n + 1 == len(tokens):
            tokens.append(int(np.argmax(rows[-1])))  # greedy: the largest integer logit
    return np.array(tokens, dtype=np.int64), np.stack(rows)


def forward_logits(ops: Any, p: dict, tokens: np.ndarray) -> np.ndarray:
    """The full forward's logits [T - 1, V] at every position but the last, for one sequence."""
    t = tokens.size - 1
    scored = np.zeros((1, t), dtype=np.int64)  # every position scored: the head sees every row
    rec = S.forward(ops, p, CONFIG, tokens[None, :t], scored, grad=False)
    return ops.logits(rec["hs"], p["head"])
