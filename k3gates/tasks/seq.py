"""A tiny sequence model for the attention tasks (issue 15), on K3-μ's kernels (k3gates.k3mu).

    x_0 = Embed(tokens)
    for each layer l (its kind: "kda" or "mla"):  x_{l+1} = x_l + Attn_l(RMSNorm(x_l) g_l)
    logits = W_head RMSNorm(x_L) g_f
    loss = sum over the scored positions of the cross-entropy (nats)

A task scores only some positions (MQAR: the queries; induction: the repeated half), marked by a
target >= 0; the head runs on those rows only. The same code runs the integer kernels (IntOps)
and the float64 twin (FloatOps). Python only batches, indexes and logs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..k3mu import reference as glue_ref
from ..k3mu.model import FACES, dequantize_params, quantize_params, sub
from ..kda import layer_train as layer_kda


@dataclasses.dataclass(frozen=True)
class SeqConfig:
    vocab: int
    d: int
    kinds: tuple[str, ...]  # one attention kind per layer
    # add an embedding of the previous token (token 0 before the first): the position signal a
    # NoPE attention layer lacks, as K3's short convolution gives its KDA layers
    shift: bool = False
    kda_heads: int = layer_kda.H_DEFAULT  # heads of every KDA layer, dk = dv = d / kda_heads


def data(sequences: Callable, seed: int, steps: int, batch: int, held_out: int) -> dict:
    """A task's batches: `steps` training batches of `batch` sequences, and `held_out` sequences
    from another seed. `sequences(rng, n)` returns (tokens, targets), each [n, T]."""
    rng = np.random.default_rng(seed)
    return {
        "train": [sequences(rng, batch) for _ in range(steps)],
        "eval": sequences(np.random.default_rng(seed + 1), held_out),
    }


def param_specs(cfg: SeqConfig, fixed: tuple[str, ...] = ()) -> dict[str, tuple]:
    """name -> optimiser spec; the names in `fixed` are not trained."""
    specs: dict[str, tuple] = {"emb": ("adamw",), "head": ("adamw",), "final_norm": ("adamw",)}
    if cfg.shift:
        specs["emb_prev"] = ("adamw",)
    for i, kind in enumerate(cfg.kinds):
        specs[f"{i}.norm"] = ("adamw",)
        face_params = layer_kda.params(cfg.kda_heads) if kind == "kda" else FACES[kind].PARAMS
        for name, _shape, opt in face_params:
            specs[f"{i}.attn.{name}"] = tuple(opt)
    return {k: ("fixed",) if k in fixed else v for k, v in specs.items()}


def init(cfg: SeqConfig, seed: int) -> dict[str, np.ndarray]:
    """The integer model's initial weights (Q.20): a seeded real init, quantised."""
    rng = np.random.default_rng(seed)
    p = {
        "emb": rng.normal(0.0, 1.0, (cfg.vocab, cfg.d)),
        "head": rng.normal(0.0, 0.02, (cfg.vocab, cfg.d)),  # starts at log(vocab) nats
        "final_norm": np.ones(cfg.d),
    }
    if cfg.shift:
        p["emb_prev"] = rng.normal(0.0, 1.0, (cfg.vocab, cfg.d))
    for i, kind in enumerate(cfg.kinds):
        p[f"{i}.norm"] = np.ones(cfg.d)
        heads = {"heads": cfg.kda_heads} if kind == "kda" else {}
        for name, value in FACES[kind].init(rng, cfg.d, **heads).items():
            p[f"{i}.attn.{name}"] = np.asarray(value, dtype=np.float64)
    return quantize_params(p)


def twin_params(p: dict) -> dict:
    return dequantize_params(p)


def forward(ops: Any, p: dict, cfg: SeqConfig, tokens: np.ndarray, targets: np.ndarray,
            grad: bool = True, prefix: np.ndarray | None = None) -> dict:  # fmt: skip
    """tokens, targets [B, T] (target -1: not scored). The summed loss in nats and the tape.
    `prefix` [B T, d], when given, is added to the embedded tokens (a VLM's image tokens);
    `backward` then returns its gradient as grads["x0"]."""
    b, t = tokens.shape
    x = ops.embed(np.ascontiguousarray(tokens.reshape(-1)), p["emb"])
    if prefix is not None:
        x = ops.add(x, prefix)
    if cfg.shift:
        x = ops.add(x, ops.embed(previous(tokens), p["emb_prev"]))
    tape = []
    for i, kind in enumerate(cfg.kinds):
        xn, c_norm = ops.norm(x, p[f"{i}.norm"])
        y, c_attn = ops.layer(kind, xn.reshape(b, t, -1), sub(p, f"{i}.attn."))
        tape.append((x, xn, c_norm, c_attn))
        x = ops.add(x, y.reshape(b * t, -1))
    hn, c_final = ops.norm(x, p["final_norm"])
    rows = np.flatnonzero(targets.reshape(-1) >= 0)
    want = np.ascontiguousarray(targets.reshape(-1)[rows])
    hs = np.ascontiguousarray(hn[rows])
    loss, dlogits, loss_q = ops.head(hs, p["head"], want, grad)
    return {"loss": loss, "loss_q": loss_q, "dlogits": dlogits, "rows": rows, "want": want,
            "hs": hs, "x": x, "c_final": c_final, "tape": tape, "shape": (b, t),
            "tokens": tokens, "prefix": prefix is not None}  # fmt: skip


def backward(ops: Any, p: dict, cfg: SeqConfig, rec: dict) -> dict[str, np.ndarray]:
    b, t = rec["shape"]
    grads: dict[str, np.ndarray] = {}
    dhs, grads["head"] = ops.head_back(rec["dlogits"], rec["hs"], p["head"])
    dhn = ops.zeros(rec["x"].shape)
    dhn[rec["rows"]] = dhs  # the unscored rows get no gradient
    dx, grads["final_norm"] = ops.norm_back(dhn, rec["x"], p["final_norm"], rec["c_final"])
    for i in reversed(range(len(cfg.kinds))):
        x, xn, c_norm, c_attn = rec["tape"][i]
        kind = cfg.kinds[i]
        dxn, g_attn = ops.layer_back(
            kind, dx.reshape(b, t, -1), xn.reshape(b, t, -1), sub(p, f"{i}.attn."), c_attn
        )
        dxn = np.ascontiguousarray(dxn.reshape(b * t, -1))
        d_in, grads[f"{i}.norm"] = ops.norm_back(dxn, x, p[f"{i}.norm"], c_norm)
        dx = ops.add(dx, d_in)  # the residual: x_{l+1} = x_l + Attn(...)
        grads.update({f"{i}.attn.{k}": v for k, v in g_attn.items()})
    grads["emb"] = ops.embed_back(np.ascontiguousarray(rec["tokens"].reshape(-1)), dx, cfg.vocab)
    if rec["prefix"]:
        grads["x0"] = dx
    if cfg.shift:
        grads["emb_prev"] = ops.embed_back(previous(rec["tokens"]), dx, cfg.vocab)
    return grads


def previous(tokens: np.ndarray) -> np.ndarray:
    """[B * T] ids of each position's previous token, 0 at the start of a sequence."""
    prev = np.zeros_like(tokens)
    prev[:, 1:] = tokens[:, :-1]
    return np.ascontiguousarray(prev.reshape(-1))


def predictions(ops: Any, p: dict, rec: dict) -> np.ndarray:
    """The argmax class at each scored row."""
    if hasattr(ops, "logits"):
        return np.argmax(ops.logits(rec["hs"], p["head"]), axis=1)
    return np.argmax(glue_ref.head_logits(rec["hs"], p["head"]), axis=1)


def evaluate(ops: Any, p: dict, cfg: SeqConfig, batch: tuple[np.ndarray, np.ndarray]) -> dict:
    """Loss (bits per scored token) and accuracy on a held-out batch."""
    rec = forward(ops, p, cfg, *batch, grad=False)
    pred = predictions(ops, p, rec)
    return {"bits": rec["loss"] / rec["want"].size / math.log(2),
            "accuracy": float(np.mean(pred == rec["want"])), "pred": pred}  # fmt: skip


def run(ops: Any, p: dict, cfg: SeqConfig, batches: list, held_out: tuple | Callable,
        steps: int, h: dict, eval_every: int | tuple[int, ...],
        fixed: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Train `steps` steps on `batches` (a list of (tokens, targets)); evaluate on `held_out` at
    step 0, every `eval_every` steps (or at the steps it lists) and at the end. `held_out` is one
    batch, or a function of the step giving the batch to evaluate on there (a curriculum's
    current length)."""
    h = {**h, "steps": steps}
    specs = param_specs(cfg, fixed)
    state = {n: ops.init_state(spec, p[n]) for n, spec in specs.items()}
    held_out_at = held_out if callable(held_out) else lambda _t: held_out
    ev = evaluate(ops, p, cfg, held_out_at(0))
    out: dict = {"eval_steps": [0], "val": [ev["bits"]], "accuracy": [ev["accuracy"]],
                 "train": []}  # fmt: skip
    for t in range(1, steps + 1):
        tokens, targets = batches[t - 1]
        rec = forward(ops, p, cfg, tokens, targets)
        grads = backward(ops, p, cfg, rec)
        lr = learning_rate(ops, t, h)
        for name, spec in specs.items():
            if spec[0] != "fixed":
                p[name], state[name] = ops.step(spec, p[name], state[name], grads[name], lr, t, h)
        out["train"].append(rec["loss"] / rec["want"].size / math.log(2))
        due = t in eval_every if isinstance(eval_every, tuple) else t % eval_every == 0
        if due or t == steps:
            ev = evaluate(ops, p, cfg, held_out_at(t))
            out["eval_steps"].append(t)
            out["val"].append(ev["bits"])
            out["accuracy"].append(ev["accuracy"])
    out["pred"] = ev["pred"]
    out["params"] = p
    return out


def learning_rate(ops: Any, t: int, h: dict) -> Any:
    """The rate at step t (from 1): ops' warm-up and cosine over the run, or, when h["cycles"]
    lists (steps, lr, lr_min) per cycle, the same warm-up and cosine restarted in each cycle (a
    curriculum's phases: the rate is high where a phase starts on a new length and low where it
    ends, on the floor of the loss)."""
    if "cycles" not in h:
        return ops.lr(t, h)
    start = 0
    for cycle in h["cycles"]:
        if t <= start + cycle[0]:
            break
        start += cycle[0]
    n, lr, lr_min = cycle
    return ops.lr(t - start, {**h, "steps": n, "lr": lr, "lr_min": lr_min})


def result_arrays(out: dict) -> tuple:
    """What a rerun must reproduce bit for bit: the held-out curve and every final weight."""
    return (
        np.array(out["val"], dtype=np.float64),
        *[out["params"][n] for n in sorted(out["params"])],
    )
