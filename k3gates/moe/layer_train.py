"""Python face of K3-μ's LatentMoE FFN: shapes, initial values and calls into moe.kernels_train.

Only batching and indexing happen here; every value is computed by the kernels. Formats (see
moe/kernels_train.py): x, y Q.16 [B, T, d]; dy, dx and the gradients Q.24; weights Q.20; the QB bias
in the router-score format Q.40 (BIAS_FRAC), an exception to the Q.20 vector rule so that
Quantile Balancing is exact on the integer scores.

Settings: TOP_K = 2 experts per token; RSF = 1 the routed scaling factor (public sources give
1.0 or 2.827, K3-SPEC section 4; passed to the kernels in Q.20); N_EXPERTS = 4; d_latent = 32,
h_expert = 32, h_shared = 64 at K3-μ's d = 64 (they follow d). The kernels take every size from
shapes.
"""

from __future__ import annotations

import numpy as np

from ..fx import host
from ..mxfp.expert import E2M1, E4M3, RULE_ROUND_UP

TOP_K = 2  # experts per token
RSF = 1  # routed scaling factor (an integer here, so that RSF_Q20 is exact)
W_FRAC = 20
A_FRAC = 24  # the experts' activations (moe.kernels_train)
BIAS_FRAC = 40
RSF_Q20 = RSF << W_FRAC
N_EXPERTS = 4


# Sizes follow the width (K3-μ's d = 64: 32, 32, 64), so a narrow model can be run interpreted
# in a test.
def d_latent(d: int) -> int:
    return d // 2


h_expert = d_latent


def h_shared(d: int) -> int:
    return d


MUON = ("muon", 1, 0)
PARAMS = [
    ("w_r", lambda d: (N_EXPERTS, d), MUON),
    # the QB bias is not trained by gradient: qb_update sets it after each step
    ("bias", lambda d: (N_EXPERTS,), ("fixed",)),
    ("w_down", lambda d: (d_latent(d), d), MUON),
    # 3-D [n, ., .]: the optimizer treats each expert's matrix as its own 2-D matrix
    ("w1", lambda d: (N_EXPERTS, h_expert(d), d_latent(d)), MUON),
    ("w3", lambda d: (N_EXPERTS, h_expert(d), d_latent(d)), MUON),
    ("w2", lambda d: (N_EXPERTS, d_latent(d), h_expert(d)), MUON),
    ("w_n", lambda d: (d_latent(d),), ("adamw",)),
    ("w_up", lambda d: (d, d_latent(d)), MUON),
    ("ws1", lambda d: (h_shared(d), d), MUON),
    ("ws3", lambda d: (h_shared(d), d), MUON),
    ("ws2", lambda d: (d, h_shared(d)), MUON),
]
TRAINED = [name for name, _shape, opt in PARAMS if opt[0] != "fixed"]


def init(rng: np.random.Generator, d: int) -> dict[str, np.ndarray]:
    """float64 initial values: hidden matrices N(0, 1/fan_in), output projections half that
    scale (the FFN adds onto the residual stream), w_n = 1, bias = 0."""

    def normal(shape, fan_in, gain=1.0):
        return rng.normal(0.0, gain * host.inv_sqrt(fan_in), shape)

    n, d_l, h, h_s = N_EXPERTS, d_latent(d), h_expert(d), h_shared(d)
    return {
        "w_r": normal((n, d), d),
        "bias": np.zeros(n),
        "w_down": normal((d_l, d), d),
        "w1": normal((n, h, d_l), d_l),
        "w3": normal((n, h, d_l), d_l),
        "w2": normal((n, d_l, h), h),
        "w_n": np.ones(d_l),
        "w_up": normal((d, d_l), d_l, 0.5),
        "ws1": normal((h_s, d), d),
        "ws3": normal((h_s, d), d),
        "ws2": normal((d, h_s), h_s, 0.5),
    }


def _c(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v)  # a wrong dtype is refused by the kernel, never cast


def _check_gemm(outside: int, where: str) -> None:
    if outside:
        raise ValueError(
            f"moe.kernels_train, {where}: {int(outside)} matmul outputs outside the shared GEMM's "
            "exact int64 domain (k3gates/gemm); check the inputs' magnitudes"
        )


def forward(mod, x: np.ndarray, p: dict, mx: MX | None = None) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] Q.16 and the cache (s40, idx, ssel, wts, z, parts, a, E, chat, rinv, r,
    sparts, a_s): moe.kernels_train's three forward passes, their arrays handed from one to the
    next.

    With `mx` (quantisation-aware training, K3-SPEC section 11), the routed experts run
    fake-quantised: their weights MXFP4 and their inputs z and a MXFP8, each along its reduction
    axis, exactly (kernels_qat's fake_quant); the cache keeps the quantised z and a, from which the
    backward forms the master weights' straight-through gradients."""
    b, t, d = x.shape
    x2 = _c(x.reshape(b * t, d))
    pe = mx.experts(p) if mx else p
    s40, idx, ssel, wts, z, pre_g, pre_u, out1 = mod.moe_fwd_route(
        x2, _c(p["w_r"]), _c(p["bias"]), _c(p["w_down"]), _c(pe["w1"]), _c(pe["w3"]),
        _c(p["ws1"]), _c(p["ws3"]), TOP_K, RSF_Q20, mx.rule if mx else -1,
    )  # fmt: skip
    parts, a, sparts, a_s = mod.moe_situ_fwd(pre_g, pre_u, TOP_K, p["w1"].shape[1])
    if mx:
        a = mx.activations(a)
    y, big_e, chat, rinv, r, out2 = mod.moe_fwd_out(
        idx, wts, a, _c(pe["w2"]), _c(p["w_n"]), _c(p["w_up"]), _c(p["ws2"]), a_s
    )
    _check_gemm(out1 + out2, "the forward")
    cache = (s40, idx, ssel, wts, z, parts, a, big_e, chat, rinv, r, sparts, a_s)
    return y.reshape(b, t, d), cache


def backward(mod, dy, x, p, cache, mx: MX | None = None) -> tuple[np.ndarray, dict]:
    """dx [B, T, d] Q.24 and the gradient (Q.24) of every trained parameter (not the bias):
    moe.kernels_train's four backward passes. With `mx`, the activation gradients go through the
    quantised expert weights and the master weights take the straight-through gradient (the
    cache's quantised z and a; the round-up rule saturates nothing, so there is no mask)."""
    b, t, d = x.shape
    pe = mx.experts(p) if mx else p
    _s40, idx, ssel, wts, z, parts, a, big_e, chat, rinv, r, sparts, a_s = cache
    dy2 = _c(dy.reshape(b * t, d))
    x2 = _c(x.reshape(b * t, d))
    dr, d_e, da_all, dlog, out1 = mod.moe_bwd_latent(
        dy2, _c(p["w_up"]), _c(p["ws2"]), _c(p["w_n"]), _c(pe["w2"]), RSF_Q20,
        idx, ssel, wts, big_e, chat, rinv, p["ws1"].shape[0],
    )  # fmt: skip
    dg, du, dgs, dus = mod.moe_situ_bwd(parts, sparts, da_all, idx.shape[1])
    dx, dz, out2 = mod.moe_bwd_dx(
        _c(p["w_r"]), _c(p["w_down"]), _c(pe["w1"]), _c(pe["w3"]), _c(p["ws1"]), _c(p["ws3"]),
        idx, dg, du, dgs, dus, dlog,
    )  # fmt: skip
    *grads, out3 = mod.moe_wgrad(
        dy2, x2, idx, z, a, chat, r, a_s, dr, d_e, dg, du, dlog, dgs, dus, dz, p["w_r"].shape[0]
    )
    _check_gemm(out1 + out2 + out3, "the backward")
    names = ("w_r", "w_down", "w1", "w3", "w2", "w_n", "w_up", "ws1", "ws3", "ws2")
    return dx.reshape(b, t, d), dict(zip(names, grads, strict=True))


class MX:
    """The routed experts' quantisation for QAT in integers: MXFP4 (E2M1) weights, MXFP8 (E4M3)
    activations, along each product's reduction axis, by kernels_qat's fake_quant kernel.

    Only the round-up scale rule: it never saturates, so the straight-through estimator is the
    identity everywhere (no clipping mask is needed, and none is applied). `packed=True`: the
    weights given are already MXFP4 values (decoded from a packed export), used as they are."""

    def __init__(self, kernels, packed: bool = False) -> None:
        self.k, self.rule, self.packed = kernels, RULE_ROUND_UP, packed

    def quantize(self, rows: np.ndarray, frac: int, fmt: int) -> np.ndarray:
        q, _sat, outside = self.k.fake_quant(_c(rows), frac, fmt, self.rule)
        if outside:
            raise ValueError(f"kernels_qat.fake_quant: {outside} elements not exact in Q.{frac}")
        return q

    def experts(self, p: dict) -> dict[str, np.ndarray]:
        """w1, w3 [n, h, d_l] along d_l and w2 [n, d_l, h] along h, MXFP4, in Q.20."""
        if self.packed:
            return p
        return {name: self.quantize(p[name].reshape(-1, p[name].shape[2]), W_FRAC, E2M1)
                .reshape(p[name].shape) for name in ("w1", "w3", "w2")}  # fmt: skip

    def activations(self, a: np.ndarray) -> np.ndarray:
        """a [N k, h] (Q.24), each slot's row along h, MXFP8."""
        return self.quantize(a, A_FRAC, E4M3)


def qb_update(mod, cache, p) -> np.ndarray:
    """The new QB bias [n] (Q.40) from this batch's router scores (call after the step)."""
    return mod.moe_qb_update(cache[0], _c(p["bias"]), TOP_K)


def qb_update_reference(cache: dict, p: dict, ref) -> np.ndarray:
    """The float twin's QB step: reference_moe.qb_update on the float cache's scores (real
    units; the caller's bias is real-valued too)."""
    return ref.qb_update(cache["s"], p["bias"], TOP_K)


def loads(cache) -> np.ndarray:
    """Tokens per expert under the batch's selection (counting is indexing); takes the integer
    cache (a tuple) or the float reference's (a dict)."""
    if isinstance(cache, dict):
        return np.bincount(cache["idx"].ravel(), minlength=cache["s"].shape[1])
    return np.bincount(cache[1].ravel(), minlength=cache[0].shape[1])
