"""K3-μ: a tiny K3 language model, one definition run by two backends.

The model (issue 14; K3-SPEC sections 1-5 and the block flow of section 3):

    x_0 = Embed(tokens)
    for layer l = 0 .. 3 (KDA, KDA, KDA, Gated MLA: k3block's schedule, the last layer MLA):
        a = AttnRes([blocks..., prefix], w_a)      or prefix while no block is stored
        if l % BLOCK_SIZE == 0: push prefix onto blocks; prefix = 0   (layer 0 pushes x_0)
        prefix += Attn_l(RMSNorm(a) g_a)
        m = AttnRes([blocks..., prefix], w_m);  prefix += MoE_l(RMSNorm(m) g_m)
    logits = Head(RMSNorm(AttnRes([blocks..., prefix], w_f)) g_f)
    loss = sum over tokens of cross-entropy (nats)

`IntOps` runs it on the integer kernels (k3gates.k3mu.kernels*, Q.16 activations, Q.20 weights,
Q.24 gradients); `FloatOps` on the float64 references (reference*.py) with the same weights
dequantised. The model code below only batches, indexes and records a tape: every value is
computed by a backend call, so the integer model has no arithmetic outside its kernels.
The head is not tied to the embedding (K3 unties them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..kda import layer_train as layer_kda
from ..mla import layer_train as layer_mla
from ..moe import layer_train as layer_moe

W_FRAC = 20  # weights and norm gains
ACT_FRAC = 16  # activations
GRAD_FRAC = 24  # gradients of the summed loss
LOSS_FRAC = 32  # the kernels' summed loss
BLOCK_SIZE = 2  # AttnRes block size, as k3block_forward composes it (K3: 12 over 93 layers)
PERIOD = 4  # one Gated MLA layer after every three KDA layers
FACES = {"kda": layer_kda, "mla": layer_mla, "moe": layer_moe}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    d: int = 64
    layers: int = 4
    batch: int = 8
    context: int = 64

    def kinds(self) -> list[str]:
        """k3block's schedule: MLA at every PERIOD-th 1-based layer and at the last."""
        return [
            "mla" if (i + 1) % PERIOD == 0 or i + 1 == self.layers else "kda"
            for i in range(self.layers)
        ]


# -- parameters ------------------------------------------------------------------------------
def param_specs(cfg: Config) -> dict[str, tuple]:
    """name -> optimiser spec: ("muon", heads, axis), ("adamw",) or ("fixed",)."""
    specs: dict[str, tuple] = {
        "emb": ("adamw",),
        "head": ("adamw",),
        "final_norm": ("adamw",),
        "final_w": ("adamw",),
    }
    for i, kind in enumerate(cfg.kinds()):
        # layer 0 has no stored block yet, so no AttnRes before its attention (no w_a)
        for name in ("attn_norm", "ffn_norm", "w_a", "w_m"):
            if i or name != "w_a":
                specs[f"{i}.{name}"] = ("adamw",)
        for face, prefix in ((FACES[kind], f"{i}.attn."), (layer_moe, f"{i}.ffn.")):
            for name, _shape, opt in face.PARAMS:
                specs[prefix + name] = tuple(opt)
    return specs


def init_params(cfg: Config, seed: int) -> dict[str, np.ndarray]:
    """Real-valued initial weights (float64), drawn once from a seeded generator. The integer
    model quantises them to Q.20; the float twin takes the dequantised integers."""
    rng = np.random.default_rng(seed)
    d = cfg.d
    p: dict[str, np.ndarray] = {
        "emb": rng.normal(0.0, 1.0, (cfg.vocab, d)),
        # small (GPT-2 std 0.02) so that the untrained model starts at log2(vocab) bits/char
        "head": rng.normal(0.0, 0.02, (cfg.vocab, d)),
        "final_norm": np.ones(d),
        "final_w": np.zeros(d),  # a zero pseudo-query: AttnRes starts as the uniform mean
    }
    for i, kind in enumerate(cfg.kinds()):
        p[f"{i}.attn_norm"] = np.ones(d)
        p[f"{i}.ffn_norm"] = np.ones(d)
        if i:
            p[f"{i}.w_a"] = np.zeros(d)
        p[f"{i}.w_m"] = np.zeros(d)
        for face, prefix in ((FACES[kind], f"{i}.attn."), (layer_moe, f"{i}.ffn.")):
            for name, value in face.init(rng, d).items():
                p[prefix + name] = np.asarray(value, dtype=np.float64)
    return p


def frac_of(name: str) -> int:
    """The fixed-point fraction a parameter is stored in (the QB bias lives in router scores'
    Q.40, every other parameter in Q.20)."""
    return layer_moe.BIAS_FRAC if name.endswith(".bias") else W_FRAC


def quantize_params(real: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.round(v * 2.0 ** frac_of(k)).astype(np.int64) for k, v in real.items()}


def dequantize_params(q: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) * 2.0 ** -frac_of(k) for k, v in q.items()}


def initial(cfg: Config, seed: int) -> dict[str, np.ndarray]:
    """The integer model's initial weights: the seeded real init, quantised."""
    return quantize_params(init_params(cfg, seed))


def windows(ids: np.ndarray, starts: np.ndarray, t: int) -> np.ndarray:
    """[len(starts), t + 1] token windows: inputs and, shifted by one, targets."""
    return np.stack([ids[s : s + t + 1] for s in starts]).astype(np.int64)


def sub(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


# -- forward with a tape, and backward along it ------------------------------------------------
def forward(ops: Any, params: dict, cfg: Config, tokens: np.ndarray, grad: bool = True) -> dict:
    """Run the model on tokens [B, T+1] (inputs then targets, shifted by one). Returns the
    summed loss in nats (a Python float: logging only), and the tape for `backward`."""
    b, t1 = tokens.shape
    t = t1 - 1
    inputs = np.ascontiguousarray(tokens[:, :t].reshape(-1))
    targets = np.ascontiguousarray(tokens[:, 1:].reshape(-1))
    tape: list[tuple] = []
    values: list[np.ndarray] = []

    def node(v: np.ndarray) -> int:
        values.append(v)
        return len(values) - 1

    def attnres(srcs: list[int], wname: str) -> int:
        h, cache = ops.attnres(np.stack([values[s] for s in srcs]), params[wname])
        out = node(h)
        tape.append(("attnres", out, srcs, wname, cache))
        return out

    def norm(x: int, wname: str) -> int:
        y, cache = ops.norm(values[x], params[wname])
        out = node(y)
        tape.append(("norm", out, x, wname, cache))
        return out

    def layer(kind: str, x: int, prefix: str) -> int:
        xs = values[x].reshape(b, t, -1)
        y, cache = ops.layer(kind, xs, sub(params, prefix))
        out = node(y.reshape(b * t, -1))
        tape.append(("layer", out, x, (kind, prefix, t), cache))
        return out

    def add(a: int, c: int) -> int:
        out = node(ops.add(values[a], values[c]))
        tape.append(("add", out, a, c, None))
        return out

    x0 = node(ops.embed(inputs, params["emb"]))
    blocks: list[int] = []
    prefix = x0
    moe_caches = []
    for i, kind in enumerate(cfg.kinds()):
        a = attnres([*blocks, prefix], f"{i}.w_a") if blocks else prefix
        if i % BLOCK_SIZE == 0:
            blocks.append(prefix)
            prefix = node(ops.zeros(values[x0].shape))
        y = layer(kind, norm(a, f"{i}.attn_norm"), f"{i}.attn.")
        prefix = add(prefix, y)
        m = attnres([*blocks, prefix], f"{i}.w_m")
        f = layer("moe", norm(m, f"{i}.ffn_norm"), f"{i}.ffn.")
        moe_caches.append((f"{i}.ffn.", tape[-1][4]))
        prefix = add(prefix, f)
    hn = norm(attnres([*blocks, prefix], "final_w"), "final_norm")
    loss, dlogits, loss_q = ops.head(values[hn], params["head"], targets, grad)
    return {
        "loss": loss,
        "loss_q": loss_q,
        "tokens": int(targets.size),
        "tape": tape,
        "values": values,
        "inputs": inputs,
        "hn": hn,
        "dlogits": dlogits,
        "moe": moe_caches,
    }


def backward(ops: Any, params: dict, cfg: Config, rec: dict) -> dict[str, np.ndarray]:
    """Every trained parameter's gradient of the summed loss, backward along the tape."""
    values = rec["values"]
    grads: dict[str, np.ndarray] = {}
    dv: dict[int, np.ndarray] = {}

    def acc(store: dict, key: Any, g: np.ndarray) -> None:
        store[key] = g if key not in store else ops.add(store[key], g)

    dh, grads["head"] = ops.head_back(rec["dlogits"], values[rec["hn"]], params["head"])
    acc(dv, rec["hn"], dh)
    for op, out, src, extra, cache in reversed(rec["tape"]):
        if out not in dv:
            continue
        g = dv.pop(out)
        if op == "add":
            acc(dv, src, g)
            acc(dv, extra, g)
        elif op == "norm":
            dx, dw = ops.norm_back(g, values[src], params[extra], cache)
            acc(dv, src, dx)
            acc(grads, extra, dw)
        elif op == "attnres":
            stacked = np.stack([values[s] for s in src])
            dsrc, dw = ops.attnres_back(g, stacked, params[extra], cache)
            for k, s in enumerate(src):
                acc(dv, s, np.ascontiguousarray(dsrc[k]))
            acc(grads, extra, dw)
        else:  # a layer
            kind, prefix, t = extra
            x = values[src]
            shape = (-1, t, x.shape[1])
            p = sub(params, prefix)
            gx, gp = ops.layer_back(kind, g.reshape(shape), x.reshape(shape), p, cache)
            acc(dv, src, np.ascontiguousarray(gx.reshape(x.shape)))
            for name, gw in gp.items():
                acc(grads, prefix + name, gw)
    grads["emb"] = ops.embed_back(rec["inputs"], dv.pop(0), cfg.vocab)
    return grads
