"""Python face of K3-μ's LatentMoE FFN: shapes, initial values and calls into kernels_moe.

Only batching and indexing happen here; every value is computed by the kernels. Formats (see
kernels_moe.py): x, y Q.16 [B, T, d]; dy, dx and the gradients Q.24; weights Q.20; the QB bias
in the router-score format Q.40 (BIAS_FRAC), an exception to the Q.20 vector rule so that
Quantile Balancing is exact on the integer scores.

Settings: TOP_K = 2 experts per token; RSF = 1 the routed scaling factor (public sources give
1.0 or 2.827, K3-SPEC section 4; passed to the kernels in Q.20); N_EXPERTS = 4; d_latent = 32,
h_expert = 32, h_shared = 64 at K3-μ's d = 64 (they follow d). The kernels take every size from
shapes.
"""

from __future__ import annotations

import numpy as np

TOP_K = 2  # experts per token
RSF = 1  # routed scaling factor (an integer here, so that RSF_Q20 is exact)
W_FRAC = 20
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
        return rng.normal(0.0, gain * fan_in**-0.5, shape)

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
            f"kernels_moe, {where}: {int(outside)} matmul outputs outside the shared GEMM's "
            "exact int64 domain (k3gates/gemm); check the inputs' magnitudes"
        )


def forward(mod, x: np.ndarray, p: dict) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] Q.16 and the cache (s40, idx, ssel, wts, z, parts, a, E, chat, rinv, r,
    sparts, a_s): kernels_moe's three forward passes, their arrays handed from one to the next."""
    b, t, d = x.shape
    x2 = _c(x.reshape(b * t, d))
    s40, idx, ssel, wts, z, pre_g, pre_u, out1 = mod.moe_fwd_route(
        x2, _c(p["w_r"]), _c(p["bias"]), _c(p["w_down"]), _c(p["w1"]), _c(p["w3"]),
        _c(p["ws1"]), _c(p["ws3"]), TOP_K, RSF_Q20,
    )  # fmt: skip
    parts, a, sparts, a_s = mod.moe_situ_fwd(pre_g, pre_u, TOP_K, p["w1"].shape[1])
    y, big_e, chat, rinv, r, out2 = mod.moe_fwd_out(
        idx, wts, a, _c(p["w2"]), _c(p["w_n"]), _c(p["w_up"]), _c(p["ws2"]), a_s
    )
    _check_gemm(out1 + out2, "the forward")
    cache = (s40, idx, ssel, wts, z, parts, a, big_e, chat, rinv, r, sparts, a_s)
    return y.reshape(b, t, d), cache


def backward(mod, dy, x, p, cache) -> tuple[np.ndarray, dict]:
    """dx [B, T, d] Q.24 and the gradient (Q.24) of every trained parameter (not the bias):
    kernels_moe's four backward passes."""
    b, t, d = x.shape
    _s40, idx, ssel, wts, z, parts, a, big_e, chat, rinv, r, sparts, a_s = cache
    dy2 = _c(dy.reshape(b * t, d))
    x2 = _c(x.reshape(b * t, d))
    dr, d_e, da_all, dlog, out1 = mod.moe_bwd_latent(
        dy2, _c(p["w_up"]), _c(p["ws2"]), _c(p["w_n"]), _c(p["w2"]), RSF_Q20,
        idx, ssel, wts, big_e, chat, rinv, p["ws1"].shape[0],
    )  # fmt: skip
    dg, du, dgs, dus = mod.moe_situ_bwd(parts, sparts, da_all, idx.shape[1])
    dx, dz, out2 = mod.moe_bwd_dx(
        _c(p["w_r"]), _c(p["w_down"]), _c(p["w1"]), _c(p["w3"]), _c(p["ws1"]), _c(p["ws3"]),
        idx, dg, du, dgs, dus, dlog,
    )  # fmt: skip
    *grads, out3 = mod.moe_wgrad(
        dy2, x2, idx, z, a, chat, r, a_s, dr, d_e, dg, du, dlog, dgs, dus, dz, p["w_r"].shape[0]
    )
    _check_gemm(out1 + out2 + out3, "the backward")
    names = ("w_r", "w_down", "w1", "w3", "w2", "w_n", "w_up", "ws1", "ws3", "ws2")
    return dx.reshape(b, t, d), dict(zip(names, grads, strict=True))


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
