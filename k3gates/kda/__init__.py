"""Kimi Delta Attention: the library face. Float64 in, float64 out; integers in between.

    o, S = recurrent(q, k, v, g, beta)                  # the serve form, token by token
    o, S = chunked(q, k, v, g, beta, chunk_size=64)      # the chunkwise-parallel training form
    g = decay_gate(g_raw, A_log, dt_bias)               # K3's g = -5 sigma(exp(A_log)(g_raw + b))

Shapes: q, k [T, H, d_k]; v [T, H, d_v]; g [T, H, d_k] (log-decay, <= 0); beta [T, H] in [0, 1];
initial_state [H, d_k, d_v]; o [T, H, d_v]; S [H, d_k, d_v]. `scale` (default d_k^-1/2)
multiplies q; q and k arrive already L2-normalised (this face does not normalise them).

Range: d_k <= 128; |scale q_i| <= 1 and ||k||_2 <= 1; |v| and |initial_state| < 2048; the
state saturates at 2048 (the formats are in `k3gates.kda.kernels`). Outside that, ValueError.
"""

from __future__ import annotations

import numpy as np

from ..fx import host
from ..infra import compile as _compile

KERNELS = "k3gates.kda.kernels"
QK_FRAC, V_FRAC, A_FRAC, G_FRAC = 24, 20, 30, 24  # as in kernels.py
MAX_DK, MAX_CHUNK, DATA_LIMIT = 128, 64, 2048.0


def _kernels():
    return _compile.load(KERNELS)


def _floats(x: object, name: str, ndim: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name}: expected a float numpy array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: expected finite values")
    return x.astype(np.float64)


def _quantize(x: np.ndarray, frac: int, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(np.round(x * 2.0**frac).astype(dtype))


def _inputs(q, k, v, g, beta, scale, initial_state):
    q, k, v, g = (_floats(a, n, 3) for a, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g")))
    beta = _floats(beta, "beta", 2)
    t_len, n_h, d_k = k.shape
    if q.shape != k.shape or g.shape != k.shape:
        raise ValueError(f"q and g: expected the shape of k {k.shape}, got {q.shape}, {g.shape}")
    if v.shape[:2] != (t_len, n_h) or beta.shape != (t_len, n_h):
        raise ValueError(
            f"v [T, H, d_v] and beta [T, H]: expected T={t_len}, H={n_h}, "
            f"got {v.shape} and {beta.shape}"
        )
    if not 1 <= d_k <= MAX_DK:
        raise ValueError(f"k: expected 1 <= d_k <= {MAX_DK}, got {d_k}")
    scale = host.inv_sqrt(d_k) if scale is None else float(scale)
    qs = q * scale
    if np.abs(qs).max(initial=0) > 1 or (np.linalg.norm(k, axis=-1) > 1 + 1e-6).any():
        raise ValueError("q, k: expected |scale * q_i| <= 1 and L2-normalised keys (||k|| <= 1)")
    if (g > 0).any():
        raise ValueError("g: expected log-decays <= 0")
    if ((beta < 0) | (beta > 1)).any():
        raise ValueError("beta: expected values in [0, 1]")
    s0 = np.zeros((n_h, d_k, v.shape[2])) if initial_state is None else initial_state
    s0 = _floats(s0, "initial_state", 3)
    if s0.shape != (n_h, d_k, v.shape[2]):
        raise ValueError(f"initial_state: expected shape {(n_h, d_k, v.shape[2])}, got {s0.shape}")
    if np.abs(v).max(initial=0) >= DATA_LIMIT or np.abs(s0).max(initial=0) >= DATA_LIMIT:
        raise ValueError(f"v, initial_state: expected |values| < {DATA_LIMIT:g}")
    kern = _kernels()
    alpha = kern.kda_decay(_quantize(np.maximum(g, -64.0), G_FRAC, np.int64))
    return (
        _quantize(qs, QK_FRAC, np.int32),
        _quantize(k, QK_FRAC, np.int32),
        _quantize(v, V_FRAC, np.int32),
        alpha,
        _quantize(beta, A_FRAC, np.int32),
        _quantize(s0, V_FRAC, np.int32),
    )


def _floats_out(o: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return o.astype(np.float64) / 2.0**V_FRAC, S.astype(np.float64) / 2.0**V_FRAC


def recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T, o_t = S_t^T (scale q_t)."""
    o, S, _ = _kernels().kda_recurrent(*_inputs(q, k, v, g, beta, scale, initial_state))
    return _floats_out(o, S)


def chunked(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None):
    """The same contract as `recurrent`, computed chunk by chunk (1 <= chunk_size <= 64)."""
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size: expected an int in 1..{MAX_CHUNK}, got {chunk_size!r}")
    args = _inputs(q, k, v, g, beta, scale, initial_state)
    o, S, _ = _kernels().kda_chunked(*args, chunk_size)
    return _floats_out(o, S)


def decay_gate(g_raw, A_log, dt_bias):
    """K3's lower-bounded gate g = -5 sigma(exp(A_log[h]) (g_raw + dt_bias[h])), in (-5, 0].

    g_raw [T, H, d_k], A_log [H], dt_bias [H, d_k]. exp(A_log) is a per-head parameter and is
    formed at this boundary; |A (g_raw + dt_bias)| saturates the sigmoid beyond 64.
    """
    g_raw = _floats(g_raw, "g_raw", 3)
    A_log, dt_bias = _floats(A_log, "A_log", 1), _floats(dt_bias, "dt_bias", 2)
    if A_log.shape != (g_raw.shape[1],) or dt_bias.shape != g_raw.shape[1:]:
        raise ValueError(f"A_log [H] and dt_bias [H, d_k]: expected H, d_k = {g_raw.shape[1:]}")
    a = host.exp(A_log)
    if (np.abs(g_raw) >= 64).any() or (np.abs(dt_bias) >= 64).any() or (a >= 64).any():
        raise ValueError("g_raw, dt_bias and exp(A_log): expected magnitudes below 64")
    g = _kernels().kda_gate(
        _quantize(g_raw, G_FRAC, np.int64),
        _quantize(a, G_FRAC, np.int64),
        _quantize(dt_bias, G_FRAC, np.int64),
    )
    return g.astype(np.float64) / 2.0**G_FRAC
