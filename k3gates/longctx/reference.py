"""Float64 reference for RoPE and its long-context scalings (K3-SPEC section 7).

Written from the formulas K3-SPEC.md collects from huggingface transformers'
`modeling_rope_utils.py` (the equations, not the code):
- plain:  inv_freq[i] = base^(-2i/D), i = 0 .. D/2 - 1
- NTK:    the same with base' = base s^(D/(D-2))
- YaRN:   find_correction_dim(r) = D ln(L_orig / (r 2 pi)) / (2 ln base);
          low = floor(dim(beta_fast)), high = ceil(dim(beta_slow)), clipped to [0, D-1];
          ramp = clamp((i - low)/(high - low), 0, 1);
          inv = inv_interp ramp + inv_extrap (1 - ramp), inv_interp = inv_extrap / s;
          attention factor mscale = 0.1 ln s + 1.
Rotation in the half-split layout: pairs (i, i + D/2) turned by the angle m inv_freq[i].
"""

from __future__ import annotations

import math

import numpy as np

BETA_FAST, BETA_SLOW = 32.0, 1.0


def inv_freq(dim: int, base: float) -> np.ndarray:
    """base^(-2i/D) for i = 0 .. D/2 - 1."""
    return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def ntk_inv_freq(dim: int, base: float, s: float) -> np.ndarray:
    """NTK-aware scaling: the plain table with base s^(D/(D-2))."""
    return inv_freq(dim, base * s ** (dim / (dim - 2)))


def _correction_dim(rotations: float, dim: int, base: float, l_orig: int) -> float:
    return dim * math.log(l_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, s: float, l_orig: int) -> tuple[np.ndarray, float]:
    """YaRN's blended table and its attention factor 0.1 ln s + 1."""
    low = max(math.floor(_correction_dim(BETA_FAST, dim, base, l_orig)), 0)
    high = min(math.ceil(_correction_dim(BETA_SLOW, dim, base, l_orig)), dim - 1)
    if high == low:
        high += 0.001  # a zero-width ramp would divide by zero
    i = np.arange(dim // 2, dtype=np.float64)
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    extrap = inv_freq(dim, base)
    return extrap / s * ramp + extrap * (1.0 - ramp), 0.1 * math.log(s) + 1.0


def rotate(x: np.ndarray, pos: np.ndarray, freq: np.ndarray, mscale: float = 1.0) -> np.ndarray:
    """x [P, D] turned row by row to positions pos [P] (float64 angles pos * freq)."""
    half = freq.shape[0]
    theta = pos.astype(np.float64)[:, None] * freq[None, :]
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[:, :half], x[:, half:]
    return mscale * np.concatenate([a * c - b * s, b * c + a * s], axis=1)
