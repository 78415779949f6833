"""SiTU-GLU (K3-SPEC.md section 4): the library face. Float in, float out; integers in between.

    out = situ_glu(g, u)                # [4 tanh(g/4) sigma(g)] [25 tanh(u/25)], |out| <= 100
    dg, du = situ_glu_grad(g, u, dout)  # dout * d out/dg, dout * d out/du

g, u and dout are quantised to Q.24 (ties away from zero) and broadcast together; the integer
kernels in k3gates.situ.kernels do the rest, and the float64 results hold their exact Q7.24
(forward) or Q.24 (backward) outputs: within 513/1024 LSB = 2^-24 * 0.501 of the exact function
of the quantised inputs, for |dout| <= 512 in the backward.

Inputs may be any finite values: g and u saturate (|g|, |u| >= 2^37 behave as 2^37, where the
function is constant to far below one output LSB); |dout| must be below 2^33. NaN or infinity,
or shapes that do not broadcast, raise ValueError.
"""

from __future__ import annotations

import numpy as np

from ..fx import quantize, value
from ..infra import compile as _compile
from .kernels import SITU_BETA, SITU_BETA_LIN, SITU_FRAC

KERNELS = "k3gates.situ.kernels"
IN_FRAC = 24  # g, u and dout in Q.24
INPUT_CLIP = 2.0**37  # |g|, |u| beyond this change nothing (saturated), and stay in int64
DOUT_MAX = 2.0**33  # dout * beta_lin must stay within the kernels' 2^62 operand range


def _kernels():
    return _compile.load(KERNELS)


def _inputs(**arrays: object) -> list[np.ndarray]:
    out = []
    for name, a in arrays.items():
        try:
            v = np.asarray(a, dtype=np.float64)
        except (TypeError, ValueError) as e:
            what = type(a).__name__
            raise ValueError(f"{name}: expected an array of real numbers, got {what}") from e
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{name}: expected finite values, got NaN or infinity")
        out.append(v)
    try:
        return list(np.broadcast_arrays(*out))
    except ValueError as e:
        shapes = ", ".join(f"{n} {v.shape}" for n, v in zip(arrays, out, strict=True))
        raise ValueError(f"shapes do not broadcast: {shapes}") from e


def _q(a: np.ndarray) -> np.ndarray:
    return quantize(np.clip(a, -INPUT_CLIP, INPUT_CLIP).ravel(), IN_FRAC)


def situ_glu(g: object, u: object) -> np.ndarray:
    """SiTU-GLU(g, u) = [4 tanh(g/4) sigma(g)] [25 tanh(u/25)] as float64 (exact Q7.24 values)."""
    gv, uv = _inputs(g=g, u=u)
    out = _kernels().situ_glu_array(_q(gv), _q(uv), IN_FRAC, SITU_BETA, SITU_BETA_LIN)
    return value(out, SITU_FRAC).reshape(gv.shape)


def situ_glu_grad(g: object, u: object, dout: object) -> tuple[np.ndarray, np.ndarray]:
    """(dout * d out/dg, dout * d out/du) as float64, each an exact Q.24 value."""
    gv, uv, dv = _inputs(g=g, u=u, dout=dout)
    if dv.size and np.abs(dv).max() >= DOUT_MAX:
        raise ValueError(f"dout: expected |dout| < 2^33, got {np.abs(dv).max()!r}")
    dq = quantize(dv.ravel(), IN_FRAC)
    dg, du = _kernels().situ_glu_grad_array(_q(gv), _q(uv), dq, IN_FRAC, SITU_BETA, SITU_BETA_LIN)
    return value(dg, IN_FRAC).reshape(gv.shape), value(du, IN_FRAC).reshape(gv.shape)
