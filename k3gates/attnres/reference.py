"""Block Attention Residuals in float64 numpy, from K3-SPEC.md section 3 (arXiv 2603.15031).
Independent of kernels.py.

    keys    k_i = v_i / sqrt(mean(v_i^2) + eps)           (no norm weight)
    scores  s_i = k_i . w                                 (w = norm_w * proj_w, the pseudo-query)
    weights alpha = softmax_i(s)                          (over depth: the n sources)
    output  h = sum_i alpha_i v_i                         (the un-normalised sources)

For L = sum_t g_t . h_t the chain rule through the softmax gives
    dL/ds_i = alpha_i (u_i - sum_k alpha_k u_k),  u_i = g . v_i,   dL/dw = sum_t sum_i dL/ds_i k_i.

Layout: sources [n, T, d] (n sources of each of T tokens), w [d], g [T, d].
"""

from __future__ import annotations

import numpy as np

# Central differences of L(w) along each w_j check the analytic gradient above. Their error is
# h^2/6 |d^3 L/dw_j^3| (truncation) + 2^-52 |L| / h (rounding of L at w +- h e_j). Measured in
# units of max_j |dL/dw_j|: each further derivative of the softmax along w_j brings a factor
# at most the spread of k_ij over the sources, 2 max|k| <= 2 sqrt(d) = 16 for d = 64, so the
# truncation is about (h^2/6) 16^2 = 2^-22.6 relative with h = 2^-14 (an estimate of scale, not a
# bound); the rounding, with |L| <= 2^11 and max|dL/dw| >= 2^0 in the gate's problem, is below
# 2^-52 2^11 2^14 = 2^-27. Declared: 1e-6, a factor 6 above the truncation estimate. A wrong
# formula (a missing term of the softmax Jacobian) is off by O(1) in these units.
FD_STEP = 2.0**-14
FD_MAX_ERR = 1e-6


def keys(v: np.ndarray, eps: float) -> np.ndarray:
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


def softmax(s: np.ndarray, axis: int = 0) -> np.ndarray:
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attnres(v: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(h [T, d], alpha [n, T]) for sources v [n, T, d] and a pseudo-query w [d]."""
    s = keys(v, eps) @ w  # [n, T]
    alpha = softmax(s, axis=0)
    return np.einsum("nt,ntd->td", alpha, v), alpha


def grad_w(v: np.ndarray, w: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """dL/dw for L = sum_t g_t . h_t."""
    k = keys(v, eps)
    alpha = softmax(k @ w, axis=0)  # [n, T]
    u = np.einsum("td,ntd->nt", g, v)  # dL/dalpha
    ds = alpha * (u - np.sum(alpha * u, axis=0, keepdims=True))  # dL/ds
    return np.einsum("nt,ntd->d", ds, k)


def loss(v: np.ndarray, w: np.ndarray, g: np.ndarray, eps: float) -> float:
    return float(np.sum(g * attnres(v, w, eps)[0]))


def finite_difference_grad_w(v: np.ndarray, w: np.ndarray, g: np.ndarray, eps: float):
    """dL/dw by central differences of the float forward, step FD_STEP, one component at a time."""
    out = np.zeros_like(w)
    for j in range(w.size):
        e = np.zeros_like(w)
        e[j] = FD_STEP
        out[j] = (loss(v, w + e, g, eps) - loss(v, w - e, g, eps)) / (2 * FD_STEP)
    return out


def rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def sublayer(x: np.ndarray, m: np.ndarray, eps: float) -> np.ndarray:
    """The stand-in Attn / FFN: tanh(M RMSNorm(x)), per token."""
    return np.tanh(rmsnorm(x, eps) @ m.T)


def stack(emb: np.ndarray, wq: np.ndarray, mats: np.ndarray, block_size: int, eps: float):
    """K3's layer flow with Block AttnRes (K3-SPEC section 3), L = len(mats) / 2 layers.

    Returns the output of each AttnRes call (2L + 1 of them; the first is the embedding itself,
    since layer 0 has no blocks yet) as [2L + 1, T, d].
    """
    n_layers = mats.shape[0] // 2
    blocks: list[np.ndarray] = []
    prefix = emb.copy()
    outs = []

    def mix(w: np.ndarray) -> np.ndarray:
        return attnres(np.stack([*blocks, prefix]), w, eps)[0]

    for layer in range(n_layers):
        a = mix(wq[2 * layer]) if blocks else prefix.copy()
        outs.append(a)
        if layer % block_size == 0:
            blocks.append(prefix)
            prefix = np.zeros_like(prefix)
        prefix = prefix + sublayer(a, mats[2 * layer], eps)
        m = mix(wq[2 * layer + 1])
        outs.append(m)
        prefix = prefix + sublayer(m, mats[2 * layer + 1], eps)
    outs.append(mix(wq[2 * n_layers]))
    return np.stack(outs)


def train_w(v: np.ndarray, target: np.ndarray, w: np.ndarray, steps: int, lr: float, eps: float):
    """Full-batch gradient descent w <- w - lr dL/dw on L = 1/2 sum_t ||h_t - target_t||^2.

    Returns the loss before each step and after the last (divided by the token count T, as the
    gate reports it), and the final w.
    """
    w = w.copy()
    losses = np.zeros(steps + 1)
    for step in range(steps + 1):
        h = attnres(v, w, eps)[0]
        losses[step] = 0.5 * float(np.sum((h - target) ** 2)) / v.shape[1]
        if step < steps:
            w = w - lr * grad_w(v, w, h - target, eps)
    return losses, w
