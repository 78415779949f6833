"""K3-μ Kimi Delta Attention layer: the Python face of kda.kernels_train (K3-SPEC.md §1).

Only batches, indexes and calls kernels: every value is computed in kda/kernels_train.py, whose work
is cut into nine exports (kda_fwd_lin, kda_fwd_act, kda_fwd_qkv, kda_fwd_rec, kda_fwd_rms,
kda_fwd_out; kda_bwd_out, kda_bwd_rec, kda_bwd_in) so g++ compiles it within its memory cap
(kda.kernels_train's docstring says why). The cache is the tuple of integer arrays they hand on.
H and dk come from the shapes (a_head has H entries, norm_w has dk).
"""

from __future__ import annotations

import numpy as np

from ..fx import host

H_DEFAULT = 2  # K3-μ: 2 KDA heads of dk = dv = d / 2 (docs/K3-SPEC.md section 10)
CONV = 4  # short-convolution kernel size


def params(heads: int = H_DEFAULT) -> list[tuple]:
    """(name, shape from d, optimizer) of a layer of `heads` heads of dk = dv = d / heads: the
    heads' total width is d whatever their number, so only the per-head weights and the Muon
    specs (one orthogonalisation per head) depend on it."""
    return [
        ("w_qkv", lambda d: (3 * d, d), ("muon", 3 * heads, 0)),  # q, k, v heads on rows
        ("conv", lambda d: (3 * d, CONV), ("adamw",)),
        ("w_b", lambda d: (heads, d), ("adamw",)),
        ("w_f", lambda d: (d, d), ("muon", heads, 0)),
        ("dt_bias", lambda d: (d,), ("adamw",)),
        # a_head = exp(A_log) is a fixed buffer: the spec's gate takes it as given per head, and
        # the issue fixes it (not trained) so the decay range set at init cannot collapse
        ("a_head", lambda d: (heads,), ("fixed",)),
        ("norm_w", lambda d: (d // heads,), ("adamw",)),
        ("w_go", lambda d: (d, d), ("muon", heads, 0)),
        ("w_o", lambda d: (d, d), ("muon", heads, 1)),  # heads on columns
    ]


PARAMS = params()  # K3-μ's layer
CACHE_NAMES = ("u", "c", "qkv", "nrm", "alpha", "sg", "beta", "S", "o", "oh", "rn", "gs", "gated")


class StateDomainError(ValueError):
    """The recurrence left the magnitudes kda.kernels_train's int64 arithmetic is analysed for."""


def init(rng: np.random.Generator, d: int, heads: int = H_DEFAULT) -> dict[str, np.ndarray]:
    """Float64 initial values (the model quantises them to Q.20)."""
    return {
        "w_qkv": rng.normal(0.0, host.inv_sqrt(d), (3 * d, d)),
        # PyTorch's Conv1d default for a depthwise kernel of 4: U(-1/sqrt(4), 1/sqrt(4))
        "conv": rng.uniform(-0.5, 0.5, (3 * d, CONV)),
        "w_b": rng.normal(0.0, host.inv_sqrt(d), (heads, d)),
        "w_f": rng.normal(0.0, host.inv_sqrt(d), (d, d)),
        # negative bias: sigma(z) starts small, so alpha starts nearer 1 (longer memory)
        "dt_bias": rng.uniform(-2.0, 0.0, d),
        # A_log = log(U[1, 16]) per head (Kimi Linear / Mamba2 init), stored as exp(A_log): the
        # draw itself (exp(log(u)) would only add the host's last-bit rounding)
        "a_head": rng.uniform(1.0, 16.0, heads),
        "norm_w": np.ones(d // heads),
        "w_go": rng.normal(0.0, host.inv_sqrt(d), (d, d)),
        "w_o": rng.normal(0.0, host.inv_sqrt(d), (d, d)) * 0.5,
    }


def _c(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _check(flags: np.ndarray, where: str) -> None:
    if np.any(flags):
        raise StateDomainError(
            f"kda.kernels_train.{where}: {int(np.sum(flags))} entries beyond the recurrence's "
            "int64 domain (state and state-gradient row/column 2-norms below 2^37 raw); lower the "
            "learning rate or check the inputs"
        )


def _check_gemm(outside: int, where: str) -> None:
    if outside:
        raise StateDomainError(
            f"kda.kernels_train.{where}: {int(outside)} projection outputs outside the shared "
            "GEMM's exact int64 domain (k3gates/gemm); check the inputs' magnitudes"
        )


def forward(mod, x: np.ndarray, p: dict) -> tuple[np.ndarray, tuple]:
    """y [B, T, d] Q.16 and the cache for backward, from x [B, T, d] Q.16 and Q.20 weights."""
    dk = p["norm_w"].shape[0]
    u, c, z, outside = mod.kda_fwd_lin(
        _c(x), p["w_qkv"], p["conv"], p["w_b"], p["w_f"], p["dt_bias"], p["a_head"], p["w_go"], dk
    )
    _check_gemm(outside, "kda_fwd_lin")
    act, gs, sg, ga, beta = mod.kda_fwd_act(c, z)
    qkv, nrm, alpha, flags = mod.kda_fwd_qkv(act, ga, dk)
    _check(flags, "kda_fwd_qkv")
    S, o, flags = mod.kda_fwd_rec(qkv, alpha, beta)
    _check(flags, "kda_fwd_rec")
    ms = mod.kda_fwd_rms(o, dk)
    y, oh, rn, gated, outside = mod.kda_fwd_out(o, gs, p["norm_w"], p["w_o"], ms)
    _check_gemm(outside, "kda_fwd_out")
    return y, (u, c, qkv, nrm, alpha, sg, beta, S, o, oh, rn, gs, gated)


def backward(mod, dy, x, p, cache) -> tuple[np.ndarray, dict]:
    """(dx [B, T, d] Q.24, gradients Q.24 of every trained weight) from dy [B, T, d] Q.24."""
    u, c, qkv, nrm, alpha, sg, beta, S, _o, oh, rn, gs, gated = cache
    do, dgz, g_o, g_nw, outside = mod.kda_bwd_out(_c(dy), gated, oh, rn, gs, p["norm_w"], p["w_o"])
    _check_gemm(outside, "kda_bwd_out")
    dqkv, dal, dbt, flags = mod.kda_bwd_rec(do, qkv, alpha, beta, S)
    _check(flags, "kda_bwd_rec")
    dx, g_qkv, g_conv, g_b, g_f, g_dt, g_go, outside = mod.kda_bwd_in(
        dqkv, dal, dbt, dgz, _c(x), u, c, qkv, nrm, alpha, sg, beta, p["a_head"],
        p["w_qkv"], p["conv"], p["w_b"], p["w_f"], p["w_go"],
    )  # fmt: skip
    _check_gemm(outside, "kda_bwd_in")
    grads = {"w_qkv": g_qkv, "conv": g_conv, "w_b": g_b, "w_f": g_f, "dt_bias": g_dt}
    return dx, grads | {"norm_w": g_nw, "w_go": g_go, "w_o": g_o}
