"""K3-μ glue in float64, written from the equations (K3-SPEC sections 3, 4, 10): the twin of
kernels_glue.py for the float training and the tests. Real values throughout (no Q formats); the
hyper-parameters are the kernels' Q.30 / Q.32 constants dequantised, so both sides run the same
numbers.

Gradients are of L = SUM over tokens of the cross-entropy in nats, as in the kernels.
"""

from __future__ import annotations

import math

import numpy as np

EPS = 4295 / 2**32  # RMSNorm / AttnRes-key eps: the kernels' EPS_Q32 (1e-6 rounded to Q.32)
BETA1 = 966367642 / 2**30  # 0.9 in Q.30
BETA2 = 1020054733 / 2**30  # 0.95 in Q.30
ADAM_EPS = 11 / 2**30  # 1e-8 in Q.30


# -- 1. embedding ------------------------------------------------------------------------------
def embed(tokens: np.ndarray, E: np.ndarray) -> np.ndarray:
    """x[n] = E[tokens[n]]: [N] ids, E [V, d] -> [N, d]."""
    return E[tokens].copy()


def embed_backward(tokens: np.ndarray, dx: np.ndarray, vocab: int) -> np.ndarray:
    """dE[v] = sum of dx[n] over the n with tokens[n] == v."""
    onehot = np.zeros((tokens.size, vocab))
    onehot[np.arange(tokens.size), tokens] = 1.0
    return onehot.T @ dx


# -- 2. RMSNorm --------------------------------------------------------------------------------
def rmsnorm_forward(
    x: np.ndarray, w: np.ndarray, eps: float = EPS
) -> tuple[np.ndarray, np.ndarray]:
    """y = w x / sqrt(mean(x^2) + eps) per row; returns (y, rstd [N])."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    return w * x * rstd[:, None], rstd


def rmsnorm_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, rstd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """With n = x r: dL/dn = dy w, dx = r (dL/dn - n mean(dL/dn n)), dw = sum over rows dy n."""
    n = x * rstd[:, None]
    gn = dy * w
    dx = rstd[:, None] * (gn - n * np.mean(gn * n, axis=-1, keepdims=True))
    return dx, np.sum(dy * n, axis=0)


# -- 3. Block AttnRes --------------------------------------------------------------------------
def attnres_forward(
    V: np.ndarray, w: np.ndarray, eps: float = EPS
) -> tuple[np.ndarray, np.ndarray, tuple]:
    """V [S, N, d], w [d] -> (h [N, d], alpha [N, S], cache). keys = V rsqrt(mean(V^2) + eps),
    scores = keys . w, alpha = softmax over the S sources, h = sum_s alpha_s V_s."""
    r = 1.0 / np.sqrt(np.mean(V * V, axis=-1) + eps)  # [S, N]
    keys = V * r[..., None]
    scores = np.einsum("snd,d->ns", keys, w)
    z = np.exp(scores - scores.max(axis=1, keepdims=True))
    alpha = z / z.sum(axis=1, keepdims=True)
    h = np.einsum("ns,snd->nd", alpha, V)
    return h, alpha, (r, keys, scores)


def attnres_backward(
    dh: np.ndarray, V: np.ndarray, w: np.ndarray, alpha: np.ndarray, cache: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """Chain rule through h = sum alpha V, the softmax, the scores key . w and the key's
    weightless RMSNorm. Returns (dV [S, N, d], dw [d])."""
    r, keys, _scores = cache
    dalpha = np.einsum("nd,snd->ns", dh, V)
    dscore = alpha * (dalpha - np.sum(alpha * dalpha, axis=1, keepdims=True))  # [N, S]
    dw = np.einsum("ns,snd->d", dscore, keys)
    dkey = dscore.T[..., None] * w  # [S, N, d]
    dV_key = r[..., None] * (dkey - keys * np.mean(dkey * keys, axis=-1, keepdims=True))
    dV = alpha.T[..., None] * dh[None] + dV_key
    return dV, dw


# -- 5. head and cross-entropy -----------------------------------------------------------------
def head_loss(xn: np.ndarray, W: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """z = xn W^T; loss = sum over tokens of logsumexp(z) - z_target; dlogits = softmax - onehot."""
    z = xn @ W.T
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    rows = np.arange(len(targets))
    loss = float(np.sum(lse - z[rows, targets]))
    p = np.exp(z - lse[:, None])
    p[rows, targets] -= 1.0
    return loss, p


def eval_loss(xn: np.ndarray, W: np.ndarray, targets: np.ndarray) -> float:
    return head_loss(xn, W, targets)[0]


def head_logits(xn: np.ndarray, W: np.ndarray) -> np.ndarray:
    """z = xn W^T (for sampling)."""
    return xn @ W.T


def head_backward(
    dlogits: np.ndarray, xn: np.ndarray, W: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """dxn = dlogits W, dW = dlogits^T xn."""
    return dlogits @ W, dlogits.T @ xn


# -- 6. AdamW ----------------------------------------------------------------------------------
def adamw_step(
    W: np.ndarray, m: np.ndarray, v: np.ndarray, G: np.ndarray, lr: float, step: int, wd: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AdamW (Loshchilov & Hutter), bias-corrected, decoupled decay; v holds squares here (the
    kernels keep sqrt(v))."""
    m = BETA1 * m + (1 - BETA1) * G
    v = BETA2 * v + (1 - BETA2) * G * G
    m_hat = m / (1 - BETA1**step)
    v_hat = v / (1 - BETA2**step)
    W = W - lr * wd * W - lr * m_hat / (np.sqrt(v_hat) + ADAM_EPS)
    return W, m, v


# -- 7. schedule -------------------------------------------------------------------------------
def lr_at(step: int, warmup: int, total: int, lr_max: float, lr_min: float) -> float:
    """Linear warm-up from 0 (lr_max step / warmup for 1 <= step <= warmup), then cosine decay
    to lr_min at `total`; lr_min after."""
    if step <= 0:
        return 0.0
    if step <= warmup:
        return lr_max * step / warmup
    if step >= total:
        return lr_min
    p = (step - warmup) / (total - warmup)
    return lr_min + (lr_max - lr_min) * 0.5 * (1.0 + math.cos(math.pi * p))


# -- 8. sampler --------------------------------------------------------------------------------
def sample_probs(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """softmax(logits / T) over the top k logits (ties: lower index first), 0 elsewhere."""
    nv = len(logits)
    k = nv if top_k <= 0 or top_k > nv else top_k
    order = np.lexsort((np.arange(nv), -logits))[:k]
    z = logits[order] / temperature
    e = np.exp(z - z.max())
    p = np.zeros(nv)
    p[order] = e / e.sum()
    return p
