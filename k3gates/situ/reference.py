"""SiTU-GLU in float64 numpy, written from K3-SPEC.md section 4 (independent of kernels.py).

    f(g) = beta tanh(g / beta) sigma(g)           (the gate half, beta = 4)
    h(u) = beta_lin tanh(u / beta_lin)            (the linear half, beta_lin = 25)
    SiTU-GLU(g, u) = f(g) h(u),  |SiTU-GLU| < beta beta_lin = 100

Backward, by the product and chain rules:
    d/dg = h(u) f'(g),  f'(g) = sech^2(g/beta) sigma(g) + beta tanh(g/beta) sigma(g) (1 - sigma(g))
    d/du = f(g) h'(u),  h'(u) = sech^2(u / beta_lin)
"""

from __future__ import annotations

import numpy as np

from ..fx.reference import sigmoid

BETA = 4.0
BETA_LIN = 25.0

# Central differences on the float forward, to check the analytic backward above:
# error <= h^2/6 max|d3 out| + eps max|out| / h. With h = 2^-17, max|d3 out/dg3| < 25 * 2 and
# max|out| < 100: 50 * 2^-34 / 6 + 2^-52 * 100 * 2^17 = 5e-10 + 3e-9 < 1e-8; declared 1e-7 leaves
# a factor 10 for the third-derivative estimate.
FD_STEP = 2.0**-17
FD_MAX_ERR = 1e-7


def gate_factor(g: np.ndarray, beta: float = BETA) -> np.ndarray:
    return beta * np.tanh(g / beta) * sigmoid(g)


def beta_tanh(x: np.ndarray, beta: float) -> np.ndarray:
    return beta * np.tanh(x / beta)


def situ_glu(g: np.ndarray, u: np.ndarray, beta: float = BETA, beta_lin: float = BETA_LIN):
    return gate_factor(g, beta) * beta_tanh(u, beta_lin)


def situ_glu_grad(
    g: np.ndarray, u: np.ndarray, dout: np.ndarray, beta: float = BETA, beta_lin: float = BETA_LIN
) -> tuple[np.ndarray, np.ndarray]:
    t = np.tanh(g / beta)
    s = sigmoid(g)
    f_prime = (1.0 - t * t) * s + beta * t * s * (1.0 - s)
    tu = np.tanh(u / beta_lin)
    return dout * beta_lin * tu * f_prime, dout * beta * t * s * (1.0 - tu * tu)


def finite_difference_grad(g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d out/dg, d out/du) by central differences of the float forward, step FD_STEP."""
    h = FD_STEP
    dg = (situ_glu(g + h, u) - situ_glu(g - h, u)) / (2 * h)
    du = (situ_glu(g, u + h) - situ_glu(g, u - h)) / (2 * h)
    return dg, du


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """g sigma(g) u: the beta -> infinity limit of SiTU-GLU."""
    return g * sigmoid(g) * u


def train_mlp(
    x: np.ndarray,
    y: np.ndarray,
    w1: np.ndarray,
    w3: np.ndarray,
    w2: np.ndarray,
    steps: int,
    lr: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Full-batch gradient descent on mean (y_hat - y)^2, y_hat = w2 . SiTU-GLU(w1 x, w3 x).

    The same update as the integer trainer: w <- w - lr sum_n e_n d y_hat_n / dw, e = y_hat - y
    (lr carries MSE's 2/N). Returns the loss before each step and after the last, and the weights.
    """
    w1, w3, w2 = w1.copy(), w3.copy(), w2.copy()
    losses = np.zeros(steps + 1)
    for t in range(steps + 1):
        g, u = x @ w1.T, x @ w3.T  # [N, H]
        a = situ_glu(g, u)
        e = a @ w2 - y  # [N]
        losses[t] = np.mean(e * e)
        if t == steps:
            break
        dg, du = situ_glu_grad(g, u, e[:, None] * w2[None, :])
        w2 -= lr * (e @ a)
        w1 -= lr * (dg.T @ x)
        w3 -= lr * (du.T @ x)
    return losses, w1, w3, w2
