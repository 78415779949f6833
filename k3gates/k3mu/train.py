"""K3-μ's training loop, shared by the integer model and its float64 twin (model.py, ops.py).

Python here only draws batch offsets (a seeded integer generator), indexes, calls the backend
and logs; every number of the integer run comes out of a kernel.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import corpus
from .model import Config, backward, forward, initial, param_specs, windows

# The recipe. Declared here, before any run; the gate and the CLI use the same one.
HYPER = {
    "lr": 0.01,  # peak learning rate for both Muon (Moonlight-scaled) and AdamW
    "lr_min": 0.001,
    "warmup": 20,
    "mu": 0.95,  # Muon momentum (Nesterov)
    "wd": 0.0,
}
VAL_WINDOWS = 32  # validation: the first 32 windows of the held-out 10%
# Success, declared with the recipe: the gates that train K3-μ (k3mu_training, mxfp_training)
START_TOL_BITS = 0.1  # the untrained model starts within 0.1 bits of log2(vocabulary)
BELOW_BIGRAM_BITS = 0.3  # success: validation at least 0.3 bits/char below the bigram model
NANOGPT_NATS = 1.88  # nanoGPT's CPU Shakespeare configuration, float (K3-SPEC section 10)


def baselines() -> dict:
    return json.loads((Path(corpus.__file__).parent / "data" / "baselines.json").read_text())


def threshold() -> float:
    return baselines()["bigram"] - BELOW_BIGRAM_BITS


def baseline_lines(base: dict) -> list[dict]:
    """The reference lines of a bits/char chart: the n-gram baselines and nanoGPT's anchor."""
    lines = [{"y": base[k], "label": f"{k} baseline"} for k in ("unigram", "bigram", "trigram")]
    lines.append(
        {"y": NANOGPT_NATS / math.log(2), "label": "nanoGPT CPU config, float (its README)"}
    )
    return lines


def data(cfg: Config) -> dict[str, Any]:
    text, vocab = corpus.load()
    ids = corpus.encode(text, vocab)
    train_ids, val_ids = corpus.split(ids)
    return {"train": train_ids, "val": val_ids, "vocab": vocab}


def batch_offsets(n_train: int, cfg: Config, steps: int, seed: int) -> np.ndarray:
    """[steps, B] window starts into the training part (PCG64: the same on every machine)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_train - cfg.context - 1, size=(steps, cfg.batch), dtype=np.int64)


def val_batch(val_ids: np.ndarray, cfg: Config, n: int = VAL_WINDOWS) -> np.ndarray:
    starts = np.arange(n, dtype=np.int64) * cfg.context
    return windows(val_ids, starts, cfg.context)


def evaluate(ops: Any, params: dict, cfg: Config, tokens: np.ndarray) -> float:
    """Mean cross-entropy in bits per character on `tokens` [n, T+1]."""
    rec = forward(ops, params, cfg, tokens, grad=False)
    return rec["loss"] / rec["tokens"] / math.log(2)


def step(ops: Any, params: dict, state: dict, cfg: Config, tokens: np.ndarray, t: int,
         h: dict) -> float:  # fmt: skip
    """One training step (1-based t): forward, backward, the optimisers, then Quantile
    Balancing's bias update from this batch's router scores. Returns the batch loss (bits/char)."""
    rec = forward(ops, params, cfg, tokens)
    grads = backward(ops, params, cfg, rec)
    lr = ops.lr(t, h)
    for name, spec in param_specs(cfg).items():
        if spec[0] == "fixed":
            continue
        params[name], state[name] = ops.step(spec, params[name], state[name], grads[name], lr, t, h)
    for prefix, cache in rec["moe"]:
        bias = ops.qb(
            {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}, cache
        )
        params[prefix + "bias"] = bias
    return rec["loss"] / rec["tokens"] / math.log(2)


def run(
    ops: Any,
    params: dict,
    cfg: Config,
    d: dict,
    steps: int,
    seed: int,
    *,
    h: dict = HYPER,
    eval_every: int = 25,
    progress: Callable[[dict], None] | None = None,
    checkpoint_every: int = 0,
    total: int | None = None,
) -> dict:
    """Train `steps` steps of a run of `total` steps (default: `steps`; the schedule and the
    batches are the whole run's, so a replay of a prefix is that run's prefix); evaluate on the
    validation windows at step 0, every `eval_every` steps and at the end. Returns the curves,
    the weight digests every `checkpoint_every` steps and the final params."""
    total = total or steps
    h = {**h, "steps": total}
    state = {n: ops.init_state(spec, params[n]) for n, spec in param_specs(cfg).items()}
    offsets = batch_offsets(d["train"].size, cfg, total, seed)
    val = val_batch(d["val"], cfg)
    out: dict = {"eval_steps": [0], "val": [evaluate(ops, params, cfg, val)], "train": [],
                 "digests": {}}  # fmt: skip
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        out["train"].append(
            step(ops, params, state, cfg, windows(d["train"], offsets[t - 1], cfg.context), t, h)
        )
        if t % eval_every == 0 or t == steps:
            out["eval_steps"].append(t)
            out["val"].append(evaluate(ops, params, cfg, val))
        if checkpoint_every and t % checkpoint_every == 0:
            out["digests"][t] = params_digest(params)
        if progress:
            elapsed = time.perf_counter() - t0
            progress({"step": t, "steps": steps, "loss": out["train"][-1], "elapsed": elapsed,
                      "tokens_per_s": t * cfg.batch * cfg.context / elapsed})  # fmt: skip
    out["seconds"] = time.perf_counter() - t0
    out["tokens"] = steps * cfg.batch * cfg.context
    out["params"] = params
    return out


def params_digest(params: dict[str, np.ndarray]) -> str:
    """SHA-256 over every parameter, in name order (names, shapes and int64 bytes)."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(name.encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


def result_arrays(out: dict) -> tuple:
    """What a rerun must reproduce bit for bit: the validation curve and every final weight."""
    return (
        np.array(out["val"], dtype=np.float64),
        *[out["params"][n] for n in sorted(out["params"])],
    )


def train_int(
    cfg_fields: dict,
    steps: int,
    seed: int,
    eval_every: int,
    interpreted: bool = False,
    qat: str = "",
) -> tuple:
    """The integer run as one call, for a rerun in a fresh process (k3gates.infra.fresh): its
    kernels are loaded compiled and guarded there like any gate's (or, with `interpreted`, run
    from their sources by CPython). `qat="train"`: with MXFP4 QAT on the routed experts
    (ops.IntOps)."""
    from ..infra import compile as kcompile
    from .ops import IntOps

    cfg = Config(**cfg_fields)
    ops = IntOps(kcompile.interpreted if interpreted else kcompile.load, qat=qat)
    out = run(ops, initial(cfg, seed), cfg, data(cfg), steps, seed, eval_every=eval_every)
    return result_arrays(out)


def print_progress(p: dict) -> None:
    eta = p["elapsed"] / p["step"] * (p["steps"] - p["step"])
    sys.stderr.write(
        f"\rstep {p['step']}/{p['steps']}  loss {p['loss']:.4f} bits/char  "
        f"{p['tokens_per_s']:.0f} tokens/s  ETA {eta:.0f} s   "
    )
    sys.stderr.flush()
