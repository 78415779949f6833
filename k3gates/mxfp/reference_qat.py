"""MXFP4 quantisation-aware training of one expert in float64, written from the definitions
(K3-SPEC.md sections 4 and 6), not from kernels.py: the independent reference `mxfp_qat` holds
the integer kernels to.

Scale rules for a block of 32 with largest magnitude amax (emax and max from the element format):

    OCP v1.0:   X = floor(log2 amax) - emax          floor(log2) from np.frexp, exact
    round-up:   X = ceil(log2(amax / max))           from np.frexp of amax / max: a quotient
                                                     of two floats, exact at powers of two

Elements: x / 2^X rounded half-to-even onto the element grid (mxfp.reference), saturated at max;
`sat` where |x| / 2^X > max. The expert and its straight-through backward:

    g = Q8(z) Q4(W1)^T,  u = Q8(z) Q4(W3)^T,  a = SiTU-GLU(g, u),  y = Q8(a) Q4(W2)^T
    da = dy Q4(W2) (masked where a saturated);  dg, du = SiTU-GLU'(da)
    dz = dg Q4(W1) + du Q4(W3) (masked where z saturated)
    dW2 = dy^T Q8(a), dW1 = dg^T Q8(z), dW3 = du^T Q8(z), each masked where W saturated

(Q4: MXFP4 E2M1 along the reduction axis, Q8: MXFP8 E4M3 along it.)
"""

from __future__ import annotations

import numpy as np

from ..situ import reference as situ
from . import reference as mx


def scale_exponents(x: np.ndarray, fmt: str, rule: str) -> np.ndarray:
    """[R, K/32] scale exponents of the blocks of rows x [R, K] (real values)."""
    f = mx.FORMATS[fmt]
    amax = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=2)
    safe = np.where(amax > 0, amax, 1.0)
    if rule == "ocp":
        x_exp = np.frexp(safe)[1] - 1 - f.emax
    else:
        m, e = np.frexp(safe / f.max_value)
        x_exp = np.where(m == 0.5, e - 1, e)
    return np.where(amax > 0, np.clip(x_exp, -127, 127), -127)


def quantize(x: np.ndarray, fmt: str, rule: str) -> tuple[np.ndarray, ...]:
    """Rows x [R, K] (real) -> (scales uint8 [R, K/32], codes uint8 [R, K], sat bool [R, K],
    values float64 [R, K]): the quantised rows and their exact values."""
    f = mx.FORMATS[fmt]
    x_exp = scale_exponents(x, fmt, rule)
    scaled = x / np.exp2(np.repeat(x_exp, 32, axis=1).astype(np.float64))
    mag = mx._round_to_grid(np.abs(scaled).ravel(), f).reshape(x.shape)
    table = mx.element_values(f)[: 1 << (f.nbits - 1)]
    order = np.argsort(np.where(np.isfinite(table), table, np.inf), kind="stable")
    codes = order[np.searchsorted(table[order], mag)].astype(np.uint8)
    codes |= (x < 0).astype(np.uint8) << (f.nbits - 1)
    vals = np.sign(x) * mag * np.exp2(np.repeat(x_exp, 32, axis=1).astype(np.float64))
    return (x_exp + 127).astype(np.uint8), codes, np.abs(scaled) > f.max_value, vals


def expert_forward(z: np.ndarray, w: dict[str, np.ndarray], rule: str) -> dict[str, np.ndarray]:
    """The fake-quantised expert on real z [N, d_l] and master weights w1, w3 [h, d_l], w2 [d_l,
    h]: every stage, and each quantised tensor's (values, sat)."""
    s: dict[str, np.ndarray] = {}
    for name in ("w1", "w3", "w2"):
        *_, s[f"{name}_sat"], s[f"{name}_q"] = quantize(w[name], "e2m1", rule)
    *_, s["z_sat"], s["z_q"] = quantize(z, "e4m3", rule)
    s["g"] = s["z_q"] @ s["w1_q"].T
    s["u"] = s["z_q"] @ s["w3_q"].T
    return s


def expert_output(s: dict[str, np.ndarray], a: np.ndarray, rule: str) -> dict[str, np.ndarray]:
    """The second half, from the SiTU-GLU output a (given, so each stage can take the integers
    the kernel formed): Q8(a) and y."""
    *_, s["a_sat"], s["a_q"] = quantize(a, "e4m3", rule)
    s["y"] = s["a_q"] @ s["w2_q"].T
    return s


def situ_glu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return situ.situ_glu(g, u)


def expert_backward(s: dict[str, np.ndarray], dy: np.ndarray) -> dict[str, np.ndarray]:
    """The straight-through backward's stages from the forward's stages and dy [N, d_l]."""
    d = {"da": dy @ s["w2_q"] * ~s["a_sat"]}
    d["dg"], d["du"] = situ.situ_glu_grad(s["g"], s["u"], d["da"])
    d["dz"] = (d["dg"] @ s["w1_q"] + d["du"] @ s["w3_q"]) * ~s["z_sat"]
    d["dw2"] = dy.T @ s["a_q"] * ~s["w2_sat"]
    d["dw1"] = d["dg"].T @ s["z_q"] * ~s["w1_sat"]
    d["dw3"] = d["du"].T @ s["z_q"] * ~s["w3_sat"]
    return d
