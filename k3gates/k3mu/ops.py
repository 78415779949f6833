"""The two backends K3-μ's one model definition runs on (see model.py).

`IntOps` calls the integer kernels only; `FloatOps` calls the float64 references (the twin).
Both expose the same methods, and both optimisers are the same recipe:
- Per-Head Muon (Moonlight scaling, Nesterov) for the attention matrices, per head, and plain
  Muon for every other 2-D hidden matrix, each routed expert's matrix on its own;
- AdamW for the embedding, the head, norm gains and AttnRes pseudo-queries (K3 trains those with
  AdamW; Muon is defined for hidden matrices only).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ..infra import compile as kcompile
from ..kda import reference_train as reference_kda
from ..mla import reference_train as reference_mla
from ..moe import reference_train as reference_moe
from ..muon import reference as muon_ref
from ..mxfp import reference_qat as mxqat_ref
from . import reference as glue_ref
from .model import FACES, LOSS_FRAC, W_FRAC

EPS = 1e-6  # every RMSNorm (K3-SPEC section 4)
HYPER_FRAC = 30  # lr, mu, wd in Q.30 (the muon and AdamW kernels' format)
MUON_EPS_RAW = 1  # NS5's eps in the gradient's units: 2^-24, as good as zero
KERNELS = {
    "glue": "k3gates.k3mu.kernels_glue",
    "kda": "k3gates.kda.kernels_train",
    "mla": "k3gates.mla.kernels_train",
    "moe": "k3gates.moe.kernels_train",
    "muon": "k3gates.muon.kernels",
}
MXQAT = "k3gates.mxfp.kernels_qat"  # the routed experts' quantiser, for quantisation-aware training
REFERENCES = {"kda": reference_kda, "mla": reference_mla, "moe": reference_moe}


def q30(x: float) -> int:
    return round(x * (1 << HYPER_FRAC))


class IntOps:
    """The integer model: every value comes out of a kernel."""

    def __init__(self, load: Callable[[str], ModuleType] = kcompile.load, qat: str = "") -> None:
        """`qat`: "" the plain model; "train" the routed experts fake-quantised (MXFP4 weights,
        MXFP8 activations, layer_moe.MX); "packed" the same with expert weights that are already
        MXFP4 values (a packed export, decoded)."""
        self.load = load
        self.mods = {key: load(KERNELS[key]) for key in ("glue", "kda", "mla", "moe")}
        self.mx = FACES["moe"].MX(load(MXQAT), packed=qat == "packed") if qat else None
        self.k = self.mods["glue"]
        self.eps = round(EPS * 2.0 ** (2 * 16))  # mean(x^2) of Q.16 rows is Q.32

    # forward / backward pieces
    def embed(self, inputs: np.ndarray, E: np.ndarray) -> np.ndarray:
        return self.k.embed(inputs, E)

    def embed_back(self, inputs: np.ndarray, dx: np.ndarray, vocab: int) -> np.ndarray:
        return self.k.embed_backward(inputs, dx, vocab)

    def zeros(self, shape: tuple) -> np.ndarray:
        return np.zeros(shape, dtype=np.int64)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.k.add(a, b)

    def norm(self, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, Any]:
        y, rstd = self.k.rmsnorm_forward(x, w, self.eps)
        return y, rstd

    def norm_back(self, dy, x, w, rstd) -> tuple[np.ndarray, np.ndarray]:
        return self.k.rmsnorm_backward(dy, x, w, rstd)

    def attnres(self, V: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, Any]:
        out = self.k.attnres_forward(np.ascontiguousarray(V), w)
        return out[0], tuple(out[1:])

    def attnres_back(self, dh, V, w, cache) -> tuple[np.ndarray, np.ndarray]:
        return self.k.attnres_backward(dh, np.ascontiguousarray(V), w, *cache)

    def layer(self, kind: str, x: np.ndarray, p: dict) -> tuple[np.ndarray, Any]:
        return FACES[kind].forward(self.mods[kind], np.ascontiguousarray(x), p, **self._mx(kind))

    def layer_back(self, kind, dy, x, p, cache) -> tuple[np.ndarray, dict]:
        face = FACES[kind]
        dy = np.ascontiguousarray(dy)
        return face.backward(self.mods[kind], dy, x, p, cache, **self._mx(kind))

    def _mx(self, kind: str) -> dict:
        return {"mx": self.mx} if kind == "moe" and self.mx else {}

    def head(self, xn, W, targets, grad: bool = True) -> tuple[float, Any, int]:
        """(summed loss in nats for logging, dlogits Q.24 or None, the kernel's Q.32 sum)."""
        if not grad:
            loss_q = int(self.k.eval_loss(xn, W, targets))
            return loss_q * 2.0**-LOSS_FRAC, None, loss_q
        loss_q, dlogits = self.k.head_loss(xn, W, targets)[:2]
        return int(loss_q) * 2.0**-LOSS_FRAC, dlogits, int(loss_q)

    def logits(self, xn: np.ndarray, W: np.ndarray) -> np.ndarray:
        return self.k.head_logits(np.ascontiguousarray(xn), W)

    def head_back(self, dlogits, xn, W) -> tuple[np.ndarray, np.ndarray]:
        return self.k.head_backward(dlogits, xn, W)

    # optimiser
    def lr(self, step: int, h: dict) -> int:
        return int(self.k.lr_at(step, h["warmup"], h["steps"], q30(h["lr"]), q30(h["lr_min"])))

    def init_state(self, spec: tuple, W: np.ndarray) -> Any:
        if spec[0] == "muon":
            return np.zeros_like(W)
        if spec[0] == "adamw":
            return (np.zeros_like(W), np.zeros_like(W))
        return None

    def step(self, spec, W, state, G, lr, t: int, h: dict) -> tuple[np.ndarray, Any]:
        if spec[0] == "muon":
            _, heads, axis = spec
            mu, wd = q30(h["mu"]), q30(h["wd"])
            if W.ndim == 3:  # routed experts: each expert's matrix is its own 2-D matrix
                out = [
                    self._muon(W[e], state[e], G[e], mu, lr, wd, heads, axis)
                    for e in range(W.shape[0])
                ]
                return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])
            return self._muon(W, state, G, mu, lr, wd, heads, axis)
        m, v = state
        shape = W.shape
        W1, m1, v1 = self.k.adamw_step(
            W.reshape(-1), m.reshape(-1), v.reshape(-1), G.reshape(-1), lr, t, q30(h["wd"])
        )
        return W1.reshape(shape), (m1.reshape(shape), v1.reshape(shape))

    def _muon(self, W, M, G, mu, lr, wd, heads, axis) -> tuple[np.ndarray, np.ndarray]:
        if "muon" not in self.mods:  # the optimiser's kernels: only a training run loads them
            self.mods["muon"] = self.load(KERNELS["muon"])
        W1, M1, _guard = self.mods["muon"].muon_step(
            np.ascontiguousarray(W), np.ascontiguousarray(M), np.ascontiguousarray(G),
            mu, lr, wd, 1, heads, axis, W_FRAC, MUON_EPS_RAW,
        )  # fmt: skip
        return W1, M1

    def qb(self, p: dict, cache: Any) -> np.ndarray:
        return FACES["moe"].qb_update(self.mods["moe"], cache, p)


class FloatOps:
    """The float64 twin: the same model on each module's reference.py. `qat="train"`: the
    routed experts fake-quantised as IntOps's, by reference_qat's float64 quantiser."""

    def __init__(self, qat: str = "") -> None:
        self.qat = qat

    def _q(self, rows: np.ndarray, fmt: str) -> np.ndarray:
        return mxqat_ref.quantize(rows, fmt, "round-up")[3]

    def _experts(self, p: dict) -> dict:
        q = {n: self._q(p[n].reshape(-1, p[n].shape[2]), "e2m1").reshape(p[n].shape)
             for n in ("w1", "w3", "w2")}  # fmt: skip
        return {**p, **q}

    def embed(self, inputs, E):
        return glue_ref.embed(inputs, E)

    def embed_back(self, inputs, dx, vocab):
        return glue_ref.embed_backward(inputs, dx, vocab)

    def zeros(self, shape):
        return np.zeros(shape)

    def add(self, a, b):
        return a + b

    def norm(self, x, w):
        return glue_ref.rmsnorm_forward(x, w, EPS)

    def norm_back(self, dy, x, w, cache):
        return glue_ref.rmsnorm_backward(dy, x, w, cache)

    def attnres(self, V, w):
        out = glue_ref.attnres_forward(V, w)
        return out[0], tuple(out[1:])

    def attnres_back(self, dh, V, w, cache):
        return glue_ref.attnres_backward(dh, V, w, *cache)

    def layer(self, kind, x, p):
        if kind == "moe" and self.qat:
            return reference_moe.forward(x, self._experts(p), q8=lambda r: self._q(r, "e4m3"))
        return REFERENCES[kind].forward(x, p)

    def layer_back(self, kind, dy, x, p, cache):
        if kind == "moe" and self.qat:  # straight-through: the quantised weights' gradient
            return reference_moe.backward(dy, x, self._experts(p), cache)
        return REFERENCES[kind].backward(dy, x, p, cache)

    def head(self, xn, W, targets, grad=True):
        out = glue_ref.head_loss(xn, W, targets)
        return float(out[0]), (out[1] if grad else None), None

    def head_back(self, dlogits, xn, W):
        return glue_ref.head_backward(dlogits, xn, W)

    def lr(self, step, h):
        return glue_ref.lr_at(step, h["warmup"], h["steps"], h["lr"], h["lr_min"])

    def init_state(self, spec, W):
        if spec[0] == "muon":
            return np.zeros_like(W)
        if spec[0] == "adamw":
            return (np.zeros_like(W), np.zeros_like(W))
        return None

    def step(self, spec, W, state, G, lr, t, h):
        if spec[0] == "muon":
            _, heads, axis = spec
            kw = dict(mu=h["mu"], lr=lr, wd=h["wd"], nesterov=True, heads=heads, axis=axis)
            if W.ndim == 3:
                out = [muon_ref.muon_step(W[e], state[e], G[e], **kw) for e in range(W.shape[0])]
                return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])
            return muon_ref.muon_step(W, state, G, **kw)
        m, v = state
        W1, m1, v1 = glue_ref.adamw_step(W, m, v, G, lr, t, h["wd"])
        return W1, (m1, v1)

    def qb(self, p, cache):
        return FACES["moe"].qb_update_reference(cache, p, reference_moe)
