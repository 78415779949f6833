"""One routed expert of K3-μ's LatentMoE with MXFP4 quantisation-aware training, stage by stage
in integers (K3-SPEC.md sections 4 and 6). Python orders the kernels' calls and keeps every
stage, so the gate can hold each against float64 on the integers it received:

    z_q = Q8(z)                      MXFP8 (E4M3) along d_l, per token            quantize_fx
    g = z_q W1_q^T, u = z_q W3_q^T   W_q = Q4(W): MXFP4 (E2M1) along d_l          dyadic_matmul
    a = SiTU-GLU(g, u)               K3-μ's SiTU kernels                            situ_glu_array
    y = Q8(a) W2_q^T                 Q4(W2) along h                                 dyadic_matmul

and the straight-through backward: the quantisers pass the gradient unchanged except where an
element saturated (clipped STE); the activation gradients use the quantised weights, the master
weights take dW as if the quantiser were the identity.

Formats: z, g, u, a, y and every gradient Q.24; master weights Q.20 (K3-μ's). `rule` picks the
scale rule (kernels.quantize_fx: 0 OCP v1.0, 1 round-up).
"""

from __future__ import annotations

import numpy as np

from . import FORMATS

FRAC = 24  # activations and gradients: Q.24
W_FRAC = 20  # master weights: Q.20
E2M1, E4M3 = FORMATS["e2m1"], FORMATS["e4m3"]
RULE_OCP, RULE_ROUND_UP = 0, 1  # kernels.quantize_fx's scale rules
SITU_BETA, SITU_BETA_LIN = 4, 25


class Kernels:
    def __init__(self, load) -> None:
        self.mx = load("k3gates.mxfp.kernels_qat")
        self.mxfp = load("k3gates.mxfp.kernels")
        self.situ = load("k3gates.situ.kernels")

    def quantize(self, x: np.ndarray, frac: int, fmt: int, rule: int) -> dict[str, np.ndarray]:
        """Rows x [R, K] -> scales, codes, sat, and the exact values n 2^e."""
        scales, codes, sat = self.mx.quantize_fx(np.ascontiguousarray(x), frac, fmt, rule)
        n, e = self.mx.values(scales, codes, fmt)
        return {"scales": scales, "codes": codes, "sat": sat.astype(bool), "n": n, "e": e}

    def pack(self, q: dict) -> tuple[np.ndarray, np.ndarray]:
        """An MXFP4 weight [R, K] as stored for inference: (two E2M1 codes per byte, the even
        index in the low nibble: [R, K/2]; its E8M0 scale bytes [R, K/32]), by mxfp's pack_fp4."""
        codes = q["codes"]
        return self.mxfp.pack_fp4(codes.ravel()).reshape(codes.shape[0], -1), q["scales"]

    def matmul(self, a: dict, b: dict) -> np.ndarray:
        """round(A B^T) in Q.24, exact before its one rounding; outside the domain, an error."""
        c, outside = self.mx.dyadic_matmul(
            *(np.ascontiguousarray(m) for m in (a["n"], a["e"], b["n"], b["e"])), FRAC
        )
        if outside:
            raise OverflowError(f"{outside} products outside dyadic_matmul's exact domain")
        return c


def fixed(x: np.ndarray, frac: int = FRAC) -> dict[str, np.ndarray]:
    """A Q.frac array as dyadic_matmul's (n, e) operand."""
    x = np.ascontiguousarray(x)
    return {"n": x, "e": np.full(x.shape, -frac, dtype=np.int64)}


def transposed(q: dict) -> dict[str, np.ndarray]:
    return {"n": np.ascontiguousarray(q["n"].T), "e": np.ascontiguousarray(q["e"].T)}


def forward(k: Kernels, z: np.ndarray, w: dict[str, np.ndarray], rule: int) -> dict:
    """The fake-quantised expert on z [N, d_l] (Q.24): every stage."""
    s: dict = {"z": z}
    for name in ("w1", "w3", "w2"):
        s[f"{name}_q"] = k.quantize(w[name], W_FRAC, E2M1, rule)
    s["z_q"] = k.quantize(z, FRAC, E4M3, rule)
    s["g"] = k.matmul(s["z_q"], s["w1_q"])
    s["u"] = k.matmul(s["z_q"], s["w3_q"])
    a = k.situ.situ_glu_array(s["g"].ravel(), s["u"].ravel(), FRAC, SITU_BETA, SITU_BETA_LIN)
    s["a"] = a.reshape(s["g"].shape)
    s["a_q"] = k.quantize(s["a"], FRAC, E4M3, rule)
    s["y"] = k.matmul(s["a_q"], s["w2_q"])
    return s


def backward(k: Kernels, s: dict, dy: np.ndarray) -> dict[str, np.ndarray]:
    """The straight-through backward from the forward's stages and dy [N, d_l] (Q.24)."""
    d: dict[str, np.ndarray] = {"dy": dy}
    d["da"] = k.matmul(fixed(dy), transposed(s["w2_q"])) * ~s["a_q"]["sat"]
    dg, du = k.situ.situ_glu_grad_array(s["g"].ravel(), s["u"].ravel(), d["da"].ravel(), FRAC,
                                        SITU_BETA, SITU_BETA_LIN)  # fmt: skip
    d["dg"], d["du"] = dg.reshape(s["g"].shape), du.reshape(s["g"].shape)
    # dz = dg W1_q + du W3_q: one product over the two halves, one rounding
    both = {key: np.hstack([s["w1_q"][key].T, s["w3_q"][key].T]) for key in ("n", "e")}
    d["dz"] = k.matmul(fixed(np.hstack([d["dg"], d["du"]])), both) * ~s["z_q"]["sat"]
    d["dw2"] = k.matmul(fixed(dy.T), transposed(s["a_q"])) * ~s["w2_q"]["sat"]
    d["dw1"] = k.matmul(fixed(d["dg"].T), transposed(s["z_q"])) * ~s["w1_q"]["sat"]
    d["dw3"] = k.matmul(fixed(d["du"].T), transposed(s["z_q"])) * ~s["w3_q"]["sat"]
    return d
