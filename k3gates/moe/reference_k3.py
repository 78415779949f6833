"""The K3-size LatentMoE layer in float64 on a sample of tokens, and the check against it.

Written from K3-SPEC.md section 4, not from layer.py's arithmetic. It takes from the integer run
only its inputs (x, the seed's weights) and its routing idx (as the moe gate does: a near-tie may
legitimately choose differently, so the selection is checked on its own, outside a band):

    s = sigma(W_r x);  w_e = rsf s_e / sum_{e' in idx} s_e'
    z = W_down x;  E_e = W2_e SiTU-GLU(W1_e z, W3_e z)     (W_e: the MXFP4 values, exactly)
    c = sum_e w_e E_e;  r = w_n c / sqrt(mean(c^2) + eps)
    y = W_up r + W2_s SiTU-GLU(W1_s x, W3_s x)

MXFP4 decoding from the definition (OCP MX v1.0, K3-SPEC.md section 6): a 4-bit E2M1 code is
sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exponent 0 is subnormal m/2, else
(1 + m/2) 2^(e - 1); times the block's E8M0 scale 2^(byte - 127). Products of Q.24 integers
(W_r x, W_down x, W1_s x, W3_s x) are formed exactly in int64 and rounded once to float64; every
other operation is plain float64.
"""

from __future__ import annotations

import time

import numpy as np

from ..situ.reference import situ_glu
from . import layer_k3 as L

SELECT_BAND = 2.0**-39  # 2 LSB of the router's Q.40 scores (moe.kernels.SELECT_BAND_LSB)
EPS = 1e-6
SAMPLE_TOKENS = 8


def e2m1_values() -> np.ndarray:
    """The 16 E2M1 code values, from the bit fields."""
    out = np.zeros(16)
    for code in range(16):
        sign, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        out[code] = -mag if sign else mag
    return out


def dequantise(pair: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """A packed MXFP4 matrix (packed [R, K/2], scales [R, K/32]) as float64 [R, K], exactly."""
    packed, scales = pair
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4  # even index: the low nibble
    block = np.exp2(scales.astype(np.float64) - 127)
    return e2m1_values()[codes] * np.repeat(block, 32, axis=1)


def sigmoid(v: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1 / (1 + e), e / (1 + e))


def exact_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x W^T for Q.24 integers x, W, formed exactly in int64, then rounded once to float64."""
    return (x @ w.T).astype(np.float64) * 2.0**-48


def sample_tokens(n_tokens: int, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_tokens, size=min(count, n_tokens), replace=False))


def forward(
    shape: L.Shape, seed: int, x: np.ndarray, idx: np.ndarray, dense: L.DenseWeights | None = None
) -> dict[str, np.ndarray]:
    """The layer in float64 for the tokens x [S, d] (Q.24) on the routing idx [S, k]. `dense`:
    the seed's dense weights if already generated (at K3's size they take 1.4 GiB)."""
    dense = dense if dense is not None else L.dense_weights(shape, seed)
    q24 = 2.0**-24
    s = sigmoid(exact_linear(x, dense.w_r))
    biased = s + dense.b * 2.0**-40
    sel = np.take_along_axis(s, idx, axis=1)
    wts = shape.rsf_q24 * q24 * sel / sel.sum(axis=1, keepdims=True)
    z = exact_linear(x, dense.w_down)
    c = np.zeros_like(z)
    e_max = 0.0
    l1_ratio = 0.0
    for e in np.unique(idx):
        w = L.expert_weights(shape, seed, int(e))
        w1, w3, w2 = dequantise(w.w1), dequantise(w.w3), dequantise(w.w2)
        for m, k in ((w1, shape.latent), (w3, shape.latent), (w2, shape.expert_width)):
            l1_ratio = max(l1_ratio, np.abs(m).sum(axis=1).max() / (k * 2.0 ** L.x_top(k)))
        t, j = np.nonzero(idx == e)
        # E_e = W2 SiTU-GLU(W1 z, W3 z), then c_t += w_tj E_e
        E = situ_glu(z[t] @ w1.T, z[t] @ w3.T) @ w2.T
        e_max = max(e_max, float(np.abs(E).max()))
        np.add.at(c, t, wts[t, j, None] * E)
    rho = np.sqrt(np.mean(c * c, axis=1, keepdims=True) + EPS)
    r = dense.w_n * q24 * c / rho
    shared = situ_glu(exact_linear(x, dense.w1_s), exact_linear(x, dense.w3_s))
    y = r @ (dense.w_up * q24).T + shared @ (dense.w2_s * q24).T
    return {"y": y, "c": c, "z": z, "biased": biased, "score_sum": sel.sum(axis=1),
            "rho": rho[:, 0], "e_max": e_max, "l1_ratio": l1_ratio}  # fmt: skip


def bound_premises(ref: dict) -> dict[str, bool]:
    """The declared bounds' premises (layer.py), on the reference's own figures for the sampled
    tokens. The row L1 is not one: the bounds take it as a parameter (check reads it off)."""
    return {
        "z_max": bool(np.abs(ref["z"]).max() < L.Z_MAX),
        "e_max": bool(ref["e_max"] <= L.E_MAX),
        "rms_c": bool(ref["rho"].min() >= 1 / L.RHO_MIN_INV),
        "score_sum": bool(ref["score_sum"].min() >= 1 / L.S_MIN_INV),
    }


def selection_agrees(biased: np.ndarray, idx: np.ndarray) -> tuple[bool, int]:
    """(agrees, near_ties): float64's top k equals the integer's set wherever float64's gap
    between the k-th and (k+1)-th biased score exceeds SELECT_BAND; near-ties are counted."""
    k = idx.shape[1]
    order = np.argsort(-biased, axis=1, kind="stable")
    top = np.take_along_axis(biased, order, axis=1)
    gap = top[:, k - 1] - top[:, k] if k < biased.shape[1] else np.full(len(top), np.inf)
    clear = gap > SELECT_BAND
    same = np.array([set(a) == set(b) for a, b in zip(order[:, :k], idx, strict=True)])
    return bool(np.all(same[clear])), int(np.sum(~clear))


def check(
    shape: L.Shape,
    seed: int,
    x: np.ndarray,
    result: L.Result,
    tokens: np.ndarray,
    dense: L.DenseWeights | None = None,
) -> dict:
    """The float64 check of c and y on the sampled tokens, within the declared bounds."""
    start = time.perf_counter()
    ref = forward(shape, seed, x[tokens], result.routing.idx[tokens], dense)
    # the bounds for the largest row L1 of the experts used, read off the weights
    bounds = L.declared_bounds(shape, ref["l1_ratio"])
    c_int = result.c[tokens] * 2.0 ** -(L.Z_FRAC - 24)  # in LSB of Q.24
    y_int = result.y[tokens].astype(np.float64)
    c_ref, y_ref = ref["c"] * 2.0**24, ref["y"] * 2.0**24
    agrees, near = selection_agrees(ref["biased"], result.routing.idx[tokens])
    premises = bound_premises(ref)
    out = {
        "tokens": [int(t) for t in tokens],
        "experts": int(np.unique(result.routing.idx[tokens]).size),
        "selection_agrees": agrees,
        "near_ties": near,
        "premises": premises,
        "min_rms_c": float(ref["rho"].min()),
        "max_row_l1_ratio": float(ref["l1_ratio"]),
        "seconds": time.perf_counter() - start,
    }
    for name, got, want in (("c", c_int, c_ref), ("y", y_int, y_ref)):
        err = float(np.abs(got - want).max())
        rms = float(np.sqrt(np.mean(want * want)))
        out[name] = {"max_err_lsb": err, "bound_lsb": bounds[name], "rms_lsb": rms,
                     "bound_over_rms": bounds[name] / rms,
                     "zero_fails": bool(np.abs(want).max() > bounds[name]),
                     "ok": bool(err <= bounds[name])}  # fmt: skip
    out["ok"] = bool(agrees and all(premises.values()) and out["c"]["ok"] and out["y"]["ok"]
                 and out["y"]["bound_over_rms"] <= 0.05 and out["y"]["zero_fails"])  # fmt: skip
    return out
