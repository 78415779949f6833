"""Gated MLA (K3-SPEC section 2): the library face. Float64 in, float64 out; integers in between.

    w = MLAWeights(w_dq=..., w_q_norm=..., w_uq=..., w_dkv=..., w_kv_norm=...,
                   w_uk=..., w_uv=..., w_g=..., w_o=...)
    y = forward(x, w)                        # x [T, D] -> y [T, D], causal over the T rows
    y_t, cache = decode_step(x_t, cache, w)  # x_t [D] -> y_t [D]; cache=None starts a cache

Shapes (H heads; K3: D 7168, H 96, q_lora 1536, kv_lora 512, nope 128, rope 64, d_v 128):
    w_dq [q_lora, D]   w_q_norm [q_lora]   w_uq [H (nope + rope), q_lora]   (per head [q_C | q_R])
    w_dkv [kv_lora + rope, D]   w_kv_norm [kv_lora]   (rows kv_lora.. give the shared key part k_R)
    w_uk [H, nope, kv_lora]   w_uv [H, d_v, kv_lora]   w_g [H d_v, D]   w_o [D, H d_v]
x is the layer's normed input; y = W_O (o ⊙ sigma(x W_g)) with o the causal NoPE attention of
q = scale W_UQ RMSNorm(W_DQ x) against the latent c_KV = RMSNorm(W_DKV x) (K3-SPEC section 2).
`scale` defaults to (nope + rope)^-1/2 (K3: 192^-1/2); `eps` is the LoRA RMSNorms' epsilon.

Each decode step appends the token's latent (kv_lora + rope int32 values) to `cache`, a
`LatentCache`, and attends over the whole cache through the absorbed path; its output equals the
row of `forward` bit for bit. `cache.values_per_token` and `cache.bytes_per_token` measure it.

Range (the fixed-point formats of k3gates.mla.kernels): |x| < 256; projection weights |.| < 16;
norm weights |.| < 8; nope <= 128, rope <= 64, kv_lora <= 512, D <= 8192, q_lora <= 2048,
H d_v <= 16384, T <= 2^20; intermediate values must stay in their formats (|q| < 64, |c| < 256,
|o| < 16), or ValueError says how many saturated. Float inputs are quantised to Q.16, ties away
from zero; outputs are exact Q.20 values. Anything else (type, shape, NaN, range) is a ValueError
naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from .kernels import (
    A_LIM,
    C_FRAC,
    C_LIM,
    EPS_FRAC,
    G_FRAC,
    LAT_FRAC,
    O_FRAC,
    SCALE_FRAC,
    W_FRAC,
    X_FRAC,
)

KERNELS = "k3gates.mla.kernels"
X_MAX, W_MAX, NORM_W_MAX = 256.0, 16.0, 8.0
MAX_DIMS = {"nope": 128, "rope": 64, "kv_lora": 512, "D": 8192, "q_lora": 2048, "H d_v": 16384}
MAX_T = 1 << 20
MAX_T_BACKWARD = 4096  # the backward holds P and dS, [H, T, T] int64 each
DY_MAX = 16.0
# (name, rank) of each weight, in the order the kernels take them
WEIGHTS = (
    ("w_dq", 2),
    ("w_q_norm", 1),
    ("w_uq", 2),
    ("w_dkv", 2),
    ("w_kv_norm", 1),
    ("w_uk", 3),
    ("w_uv", 3),
    ("w_g", 2),
    ("w_o", 2),
)


def _kernels() -> ModuleType:
    return _compile.load(KERNELS)


def _floats(a: object, name: str, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.number):
        raise ValueError(f"{name}: expected a numpy array of real numbers, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    v = a.astype(np.float64)
    if not np.isfinite(v).all():
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    return v


def _q16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(quantize(a, W_FRAC).astype(np.int32))


@dataclass(frozen=True)
class IntWeights:
    """The quantised weights and settings the kernels take (all Q.16 int32, C order)."""

    w_dq: np.ndarray
    w_q_norm: np.ndarray
    w_uq: np.ndarray
    w_dkv: np.ndarray
    w_kv_norm: np.ndarray
    w_uk: np.ndarray
    w_uv: np.ndarray
    w_g: np.ndarray
    w_o: np.ndarray
    eps: int  # Q.40
    scale: int  # Q0.62

    @property
    def n_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def dims(self) -> dict[str, int]:
        h, nope, kv_lora = self.w_uk.shape
        return {"D": self.w_dq.shape[1], "q_lora": self.w_dq.shape[0], "kv_lora": kv_lora,
                "rope": self.w_dkv.shape[0] - kv_lora, "nope": nope, "d_v": self.w_uv.shape[1],
                "H": h}  # fmt: skip


@dataclass(frozen=True)
class MLAWeights:
    """One Gated MLA layer's float weights (shapes in the module docstring), validated once."""

    w_dq: np.ndarray
    w_q_norm: np.ndarray
    w_uq: np.ndarray
    w_dkv: np.ndarray
    w_kv_norm: np.ndarray
    w_uk: np.ndarray
    w_uv: np.ndarray
    w_g: np.ndarray
    w_o: np.ndarray
    eps: float = 1e-6
    scale: float | None = None  # None: (nope + rope)^-1/2, formed in the integer kernel
    _int: IntWeights | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        w = {name: _floats(getattr(self, name), name, rank) for name, rank in WEIGHTS}
        _check_shapes(w)
        for name, _ in WEIGHTS:
            top = NORM_W_MAX if name.endswith("_norm") else W_MAX
            if np.abs(w[name]).max(initial=0) >= top:
                raise ValueError(f"{name}: expected |values| < {top:g}")
        if not (isinstance(self.eps, (int, float)) and 0 <= self.eps < 2**10):
            raise ValueError(f"eps: expected a number in [0, 1024), got {self.eps!r}")
        if self.scale is not None and not (
            isinstance(self.scale, (int, float)) and 0 < self.scale <= 1
        ):
            raise ValueError(f"scale: expected None or a number in (0, 1], got {self.scale!r}")
        d_qk = w["w_uk"].shape[1] + w["w_dkv"].shape[0] - w["w_kv_norm"].shape[0]
        scale = (  # (nope + rope)^-1/2 by fx's integer rsqrt: cheap enough under CPython
            int(_compile.interpreted(KERNELS).default_scale(d_qk))
            if self.scale is None
            else int(quantize(np.float64(self.scale), SCALE_FRAC))
        )
        eps = int(quantize(np.float64(self.eps), EPS_FRAC))
        ints = {name: _q16(a) for name, a in w.items()}
        object.__setattr__(self, "_int", IntWeights(**ints, eps=eps, scale=scale))

    @property
    def ints(self) -> IntWeights:
        if self._int is None:  # unreachable: __post_init__ sets it or raises
            raise RuntimeError("MLAWeights was not initialised")
        return self._int


def _check_shapes(w: dict[str, np.ndarray]) -> None:
    h, nope, kv_lora = w["w_uk"].shape
    q_lora, d_model = w["w_dq"].shape
    rope = w["w_dkv"].shape[0] - kv_lora
    d_v = w["w_uv"].shape[1]
    want = {
        "w_q_norm": (q_lora,),
        "w_uq": (h * (nope + rope), q_lora),
        "w_dkv": (kv_lora + rope, d_model),
        "w_kv_norm": (kv_lora,),
        "w_uv": (h, d_v, kv_lora),
        "w_g": (h * d_v, d_model),
        "w_o": (d_model, h * d_v),
    }
    if rope < 0:
        raise ValueError(f"w_dkv: expected at least kv_lora = {kv_lora} rows, got {rope + kv_lora}")
    for name, shape in want.items():
        if w[name].shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {w[name].shape}")
    got = {"nope": nope, "rope": rope, "kv_lora": kv_lora, "D": d_model, "q_lora": q_lora,
           "H d_v": h * d_v}  # fmt: skip
    for name, top in MAX_DIMS.items():
        if not 1 <= got[name] <= top and not (name == "rope" and got[name] == 0):
            raise ValueError(f"w_*: expected 1 <= {name} <= {top}, got {got[name]}")


# == the integer pipeline (the gates call these with a compiled or an interpreted module) =========
def project_int(k: ModuleType, xq: np.ndarray, iw: IntWeights) -> dict[str, np.ndarray | int]:
    """The latent projections of every row of xq (int32 [T, D], Q.16): a_Q, a_KV (Q.20 int64),
    c_Q, c_KV, k_R (Q.16 int32), q (Q.20 int32 [T, H, nope + rope], times the scale)."""
    kv_lora = iw.w_kv_norm.shape[0]
    shift_lat = 2 * X_FRAC - LAT_FRAC
    a_q, s1 = k.mla_linear(xq, iw.w_dq, shift_lat, A_LIM)
    c_q, s2 = k.mla_rmsnorm(a_q, iw.w_q_norm, iw.eps)
    q, s3 = k.mla_query(c_q, iw.w_uq, iw.scale)
    a_kv, s4 = k.mla_linear(xq, np.ascontiguousarray(iw.w_dkv[:kv_lora]), shift_lat, A_LIM)
    c_kv, s5 = k.mla_rmsnorm(a_kv, iw.w_kv_norm, iw.eps)
    k_r, s6 = k.mla_linear(xq, np.ascontiguousarray(iw.w_dkv[kv_lora:]), 2 * X_FRAC - C_FRAC, C_LIM)
    return {
        "a_q": a_q,
        "c_q": c_q,
        "q": q.reshape(xq.shape[0], iw.n_heads, -1),
        "a_kv": a_kv,
        "c_kv": c_kv,
        "k_r": np.ascontiguousarray(k_r.astype(np.int32)),
        "sat": int(s1) + int(s2) + int(s3) + int(s4) + int(s5) + int(s6),
    }


def forward_int(
    k: ModuleType, xq: np.ndarray, iw: IntWeights, path: str = "naive"
) -> dict[str, np.ndarray | int]:
    """The whole layer in integers: projections, causal attention (`path` naive or absorbed),
    the output gate and o_proj. Returns every intermediate and the total saturation count."""
    r = project_int(k, xq, iw)
    attend = k.mla_attend_naive if path == "naive" else k.mla_attend_absorbed
    r["o"], sat_o = attend(r["q"], r["c_kv"], r["k_r"], iw.w_uk, iw.w_uv)
    r["gated"], r["y"], sat_y = k.mla_output(r["o"], xq, iw.w_g, iw.w_o)
    r["sat"] = int(r["sat"]) + int(sat_o) + int(sat_y)
    return r


@dataclass
class LatentCache:
    """The per-token latent cache of one Gated MLA layer: c_KV and k_R, Q.16 int32, rows
    0..length-1 in use (the arrays grow by doubling)."""

    c_kv: np.ndarray  # int32 [capacity, kv_lora]
    k_r: np.ndarray  # int32 [capacity, rope]
    length: int = 0

    @classmethod
    def empty(cls, iw: IntWeights, capacity: int = 16) -> LatentCache:
        d = iw.dims
        return cls(
            np.zeros((capacity, d["kv_lora"]), dtype=np.int32),
            np.zeros((capacity, d["rope"]), dtype=np.int32),
        )

    @property
    def values_per_token(self) -> int:
        return self.c_kv.shape[1] + self.k_r.shape[1]

    @property
    def bytes_per_token(self) -> int:
        return self.c_kv[:1].nbytes + self.k_r[:1].nbytes

    def reserve(self, rows: int) -> None:
        if rows <= self.c_kv.shape[0]:
            return
        cap = max(rows, 2 * self.c_kv.shape[0])
        for name in ("c_kv", "k_r"):
            old = getattr(self, name)
            new = np.zeros((cap, old.shape[1]), dtype=np.int32)
            new[: self.length] = old[: self.length]
            setattr(self, name, new)


def decode_int(
    k: ModuleType, xq_t: np.ndarray, cache: LatentCache, iw: IntWeights
) -> dict[str, np.ndarray | int]:
    """One token (xq_t int32 [1, D]): project, append its latent to `cache`, attend over the
    cache (absorbed path), gate and o_proj. Mutates `cache`."""
    r = project_int(k, xq_t, iw)
    cache.reserve(cache.length + 1)
    o_t, sat_o = k.mla_decode_step(
        r["q"], r["c_kv"], r["k_r"], cache.c_kv, cache.k_r, cache.length, iw.w_uk, iw.w_uv
    )
    cache.length += 1
    r["o"] = o_t.reshape(1, *o_t.shape)
    r["gated"], r["y"], sat_y = k.mla_output(r["o"], xq_t, iw.w_g, iw.w_o)
    r["sat"] = int(r["sat"]) + int(sat_o) + int(sat_y)
    return r


def backward_int(
    k: ModuleType, r: dict, xq: np.ndarray, iw: IntWeights, dyq: np.ndarray
) -> dict[str, np.ndarray | int]:
    """Gradients of L = sum(dy * y), Q.24 int32, from the forward's integers `r` (forward_int)
    and dyq (int32 [T, D], Q.24): do, du (u = x W_g, the gate's input), dq (of the kernels' q,
    the scale included), dc_kv, dk_r; with P (Q0.62) and dS (Q.48) and the saturation count."""
    q, c_kv, k_r = r["q"], r["c_kv"], r["k_r"]
    do, du, s0 = k.mla_output_backward(r["o"], xq, iw.w_g, iw.w_o, dyq)
    p, s1 = k.mla_backward_probs(q, 0, c_kv, k_r, iw.w_uk)
    ds, s2 = k.mla_backward_scores(p, 0, c_kv, iw.w_uv, do)
    dq, s3 = k.mla_backward_dq(ds, 0, c_kv, k_r, iw.w_uk)
    dc, dk_r, s4 = k.mla_backward_dkv(ds, p, 0, q, do, iw.w_uk, iw.w_uv)
    return {
        "do": do,
        "du": du,
        "dq": dq,
        "dc_kv": dc,
        "dk_r": dk_r,
        "p": p,
        "ds": ds,
        "sat": sum(int(v) for v in (s0, s1, s2, s3, s4)),
    }


# == the float face ===============================================================================
def _input(x: object, name: str, ndim: int, d_model: int) -> np.ndarray:
    a = _floats(x, name, ndim)
    if a.shape[-1] != d_model:
        raise ValueError(f"{name}: expected a last axis of D = {d_model}, got shape {a.shape}")
    if np.abs(a).max(initial=0) >= X_MAX:
        raise ValueError(f"{name}: expected |values| < {X_MAX:g}")
    return np.ascontiguousarray(quantize(a, X_FRAC).reshape(-1, d_model).astype(np.int32))


def _checked(r: dict) -> np.ndarray:
    if r["sat"]:
        raise ValueError(
            f"x, weights: {r['sat']} intermediate values left the kernels' formats and saturated "
            "(|q| < 64, |c| < 256, |o| < 16, |y| < 2048 are the analysed range)"
        )
    return value(np.asarray(r["y"]), O_FRAC)


def _weights(w: object) -> MLAWeights:
    if not isinstance(w, MLAWeights):
        raise ValueError(f"weights: expected an MLAWeights, got {type(w).__name__}")
    return w


def forward(x: object, weights: MLAWeights) -> np.ndarray:
    """y [T, D] for x [T, D]: the causal Gated MLA layer (naive path), float64 in and out."""
    iw = _weights(weights).ints
    xq = _input(x, "x", 2, iw.dims["D"])
    if not 1 <= xq.shape[0] <= MAX_T:
        raise ValueError(f"x: expected 1 <= T <= 2^20 rows, got {xq.shape[0]}")
    return _checked(forward_int(_kernels(), xq, iw))


def decode_step(
    x_t: object, cache: LatentCache | None, weights: MLAWeights
) -> tuple[np.ndarray, LatentCache]:
    """(y_t [D], cache) for one token x_t [D]: appends to `cache` (None starts a new one) and
    attends over everything in it. The cache is updated in place and returned."""
    iw = _weights(weights).ints
    xq = _input(x_t, "x_t", 1, iw.dims["D"])
    if cache is None:
        cache = LatentCache.empty(iw)
    if not isinstance(cache, LatentCache):
        raise ValueError(f"cache: expected a LatentCache or None, got {type(cache).__name__}")
    d = iw.dims
    if cache.c_kv.shape[1] != d["kv_lora"] or cache.k_r.shape[1] != d["rope"]:
        raise ValueError(
            f"cache: expected rows of kv_lora = {d['kv_lora']} and rope = {d['rope']}, got "
            f"{cache.c_kv.shape[1]} and {cache.k_r.shape[1]}"
        )
    if cache.length >= MAX_T:
        raise ValueError(f"cache: full at 2^20 tokens (length {cache.length})")
    return _checked(decode_int(_kernels(), xq, cache, iw))[0], cache


def backward(x: object, weights: MLAWeights, dy: object) -> dict[str, np.ndarray]:
    """The gradients of L = sum(dy * forward(x, weights)) as float64: "dq" [T, H, nope + rope]
    (of q = scale W_UQ c_Q, the query the attention sees), "dc_kv" [T, kv_lora], "dk_r"
    [T, rope] and "du" [T, H d_v] (u = x W_g, the gate's input). dy [T, D] with |dy| < 16,
    T <= 4096; Q.24 integers inside (k3gates.mla.kernels, "backward")."""
    iw = _weights(weights).ints
    xq = _input(x, "x", 2, iw.dims["D"])
    if not 1 <= xq.shape[0] <= MAX_T_BACKWARD:
        raise ValueError(f"x: expected 1 <= T <= {MAX_T_BACKWARD} rows, got {xq.shape[0]}")
    g = _floats(dy, "dy", 2)
    if g.shape != (xq.shape[0], iw.dims["D"]):
        raise ValueError(f"dy: expected shape {(xq.shape[0], iw.dims['D'])}, got {g.shape}")
    if np.abs(g).max(initial=0) >= DY_MAX:
        raise ValueError(f"dy: expected |values| < {DY_MAX:g}")
    k = _kernels()
    r = forward_int(k, xq, iw)
    _checked(r)
    b = backward_int(k, r, xq, iw, np.ascontiguousarray(quantize(g, G_FRAC).astype(np.int32)))
    if b["sat"]:
        raise ValueError(
            f"x, weights, dy: {b['sat']} backward intermediates left their formats and saturated"
        )
    return {name: value(b[name], G_FRAC) for name in ("dq", "dc_kv", "dk_r", "du")}


def mha_values_per_token(n_heads: int, nope: int, rope: int, d_v: int) -> int:
    """What plain multi-head attention caches per token: H (nope + rope) keys + H d_v values."""
    return n_heads * (nope + rope) + n_heads * d_v


__all__ = [
    "IntWeights",
    "LatentCache",
    "MLAWeights",
    "backward",
    "backward_int",
    "decode_int",
    "decode_step",
    "forward",
    "forward_int",
    "mha_values_per_token",
    "project_int",
]
