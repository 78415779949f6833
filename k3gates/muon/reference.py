"""Per-Head Muon in float64 numpy, written from K3-SPEC.md section 5 (independent of kernels.py).

NS5 (KellerJordan/Muon `muon.py`):
    X_0 = G / (||G||_F + eps), transposed if tall;
    five times: A = X X^T, B = b A + c A^2, X <- a X + B X,  (a, b, c) = (3.4445, -4.7750, 2.0315).
Muon with Nesterov momentum and Moonlight's scaling (arXiv 2502.16982):
    M <- mu M + G;  O = NS5(G + mu M);  W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O.
Per-Head Muon (our reading of "optimize attention heads independently"): the step above on each
head's slice of W_Q, W_K, W_V (rows) and of W_O (columns), A x B being the slice's shape.
QK-Clip (Kimi K2, arXiv 2507.20534): gamma_h = min(1, tau / S_max^h), W_Q^h, W_K^h *= sqrt(gamma_h).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def ns_iteration(X: np.ndarray, matmul: Callable = np.matmul) -> np.ndarray:
    """One Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T (X wide)."""
    a, b, c = NS_COEFFS
    A = matmul(X, X.T)
    B = b * A + c * matmul(A, A)
    return a * X + matmul(B, X)


def ns5(G: np.ndarray, eps: float = EPS, matmul: Callable = np.matmul) -> np.ndarray:
    """NS5(G): Frobenius normalisation, transposed if tall, five iterations."""
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / (np.linalg.norm(X) + eps)
    for _ in range(NS_STEPS):
        X = ns_iteration(X, matmul)
    return X.T if tall else X


def head_slices(shape: tuple[int, int], heads: int, axis: int) -> list[tuple[slice, slice]]:
    """Index pairs of each head's slice: rows (axis 0: W_Q, W_K, W_V) or columns (axis 1: W_O)."""
    dh = shape[axis] // heads
    every = slice(None)
    return [
        (slice(h * dh, (h + 1) * dh), every) if axis == 0 else (every, slice(h * dh, (h + 1) * dh))
        for h in range(heads)
    ]


def muon_step(
    W: np.ndarray,
    M: np.ndarray,
    G: np.ndarray,
    *,
    mu: float,
    lr: float,
    wd: float,
    nesterov: bool = True,
    heads: int = 1,
    axis: int = 0,
    eps: float = EPS,
    orthogonalise: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(W_new, M_new) of one (per-head) Muon step. `orthogonalise` replaces NS5 when given (the
    gates pass the integer kernel's O to check the rest of the step on its own)."""
    M_new = mu * M + G
    N = G + mu * M_new if nesterov else M_new
    W_new = W * (1.0 - lr * wd)
    for h, sl in enumerate(head_slices(W.shape, heads, axis)):
        O = ns5(N[sl], eps) if orthogonalise is None else orthogonalise(h, N[sl])  # noqa: E741
        W_new[sl] -= lr * 0.2 * np.sqrt(max(N[sl].shape)) * O
    return W_new, M_new


def qk_clip(
    Wq: np.ndarray, Wk: np.ndarray, s_max: np.ndarray, tau: float, heads: int
) -> tuple[np.ndarray, np.ndarray]:
    """Scale head h's rows of W_Q and W_K by sqrt(min(1, tau / S_max^h))."""
    Wq, Wk = Wq.copy(), Wk.copy()
    for h, sl in enumerate(head_slices(Wq.shape, heads, 0)):
        gamma = min(1.0, tau / s_max[h])
        Wq[sl] *= np.sqrt(gamma)
        Wk[sl] *= np.sqrt(gamma)
    return Wq, Wk


# == the attention layer of the PROVEN gate ======================================================
def softmax(s: np.ndarray) -> np.ndarray:
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def attention(x: np.ndarray, W: dict[str, np.ndarray], heads: int) -> tuple[np.ndarray, dict]:
    """y = concat_h softmax(q_h k_h^T / sqrt(d_h)) v_h W_O^T for x [n, T, d]; also the cache."""
    n, t_len, _ = x.shape
    dh = W["q"].shape[0] // heads
    q, k, v = ((x @ W[name].T).reshape(n, t_len, heads, dh) for name in "qkv")
    p = softmax(np.einsum("nthc,nuhc->nhtu", q, k) / np.sqrt(dh))  # [n, H, T, T]
    o = np.einsum("nhtu,nuhc->nthc", p, v).reshape(n, t_len, heads * dh)
    return o @ W["o"].T, {"q": q, "k": k, "v": v, "p": p, "o": o}


def attention_grads(
    x: np.ndarray, y: np.ndarray, W: dict[str, np.ndarray], heads: int
) -> tuple[float, dict[str, np.ndarray]]:
    """(sum of squared errors, d/dW of half of it): the chain rule through the layer above."""
    n, t_len, d = x.shape
    dh = W["q"].shape[0] // heads
    y_hat, c = attention(x, W, heads)
    e = y_hat - y
    do = (e @ W["o"]).reshape(n, t_len, heads, dh)
    dv = np.einsum("nhtu,nthc->nuhc", c["p"], do)
    dp = np.einsum("nthc,nuhc->nhtu", do, c["v"])
    ds = c["p"] * (dp - (c["p"] * dp).sum(axis=-1, keepdims=True)) / np.sqrt(dh)
    dq = np.einsum("nhtu,nuhc->nthc", ds, c["k"])
    dk = np.einsum("nhtu,nthc->nuhc", ds, c["q"])
    flat = x.reshape(-1, d)
    grads = {
        "q": dq.reshape(-1, heads * dh).T @ flat,
        "k": dk.reshape(-1, heads * dh).T @ flat,
        "v": dv.reshape(-1, heads * dh).T @ flat,
        "o": e.reshape(-1, d).T @ c["o"].reshape(-1, heads * dh),
    }
    return float(np.sum(e * e)), grads


def train_attention(
    x: np.ndarray,
    y: np.ndarray,
    W0: dict[str, np.ndarray],
    *,
    heads: int,
    steps: int,
    lr: float,
    mu: float,
    wd: float,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Full-batch per-head Muon (Nesterov) on the attention layer: W_Q, W_K, W_V by rows, W_O by
    columns. Returns the mean squared error before each step and after the last, and W."""
    W = {name: w.copy() for name, w in W0.items()}
    M = {name: np.zeros_like(w) for name, w in W.items()}
    losses = np.zeros(steps + 1)
    for t in range(steps + 1):
        loss, G = attention_grads(x, y, W, heads)
        losses[t] = loss / y.size
        if t == steps:
            break
        for name in "qkvo":
            W[name], M[name] = muon_step(
                W[name], M[name], G[name], mu=mu, lr=lr, wd=wd, heads=heads,
                axis=1 if name == "o" else 0,
            )  # fmt: skip
    return losses, W
