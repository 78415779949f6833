"""Stable LatentMoE + Quantile Balancing in float64 numpy, from K3-SPEC.md section 4.

Independent of kernels.py: whole-array numpy, exactly as the equations are written.

    s = sigma(W_r x);  S = topk(s + b);  w_e = rsf s_e / sum_{e' in S} s_e'
    z = W_down x;  E_e(z) = w2_e SiTU-GLU(w1_e z, w3_e z)
    c = sum_{e in S} w_e E_e(z);  r = w_n c / sqrt(mean(c^2) + eps)
    y = W_up r + w2_s SiTU-GLU(w1_s x, w3_s x)

Quantile Balancing (kexue.fm/archives/11619): c_i = token i's (k+1)-th largest biased score,
m_ij = s_ij + b_j - c_i, q = m k / n, b_j <- b_j - (the (q+1)-th largest margin in column j).

Top-k ties go to the lower expert index (a stable sort), as in the kernels' documented rule.
"""

from __future__ import annotations

import numpy as np

from ..situ.reference import situ_glu, situ_glu_grad

# Central differences on the float loss (the backward's check): error <= h^2/6 |L'''| +
# 2^-52 |L| / h. For the gate's problem (8 tokens) |L| < 2^6 and third derivatives along one
# coordinate stay below 2^10 (|z|^3 |d3 SiTU| |w2| |dc| with |z| <= 8 and |d3 SiTU| <= 25):
# with h = 2^-14 that is 2^-28 * 2^10 / 6 + 2^-52 2^6 2^14 < 2^-20 < 1e-6; FD_MAX_ERR = 1e-5
# leaves a factor 10 for the derivative estimates.
FD_STEP = 2.0**-14
FD_MAX_ERR = 1e-5


def sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def scores(x: np.ndarray, w_r: np.ndarray) -> np.ndarray:
    """s = sigma(W_r x) for each token: [T, n]."""
    return sigmoid(x @ w_r.T)


def select(biased: np.ndarray, k: int) -> np.ndarray:
    """The top k of each row by decreasing value; equal values: the lower index first. [T, k]."""
    return np.argsort(-biased, axis=1, kind="stable")[:, :k]


def kth_gap(biased: np.ndarray, k: int) -> np.ndarray:
    """Per row, the k-th largest minus the (k+1)-th largest value: how far from a tie the
    selection is."""
    top = -np.sort(-biased, axis=1)
    return top[:, k - 1] - top[:, k]


def combine_weights(s: np.ndarray, idx: np.ndarray, rsf: float) -> np.ndarray:
    """w = rsf s_e / sum of the selected s: the unbiased scores, renormalised over the set."""
    sel = np.take_along_axis(s, idx, axis=1)
    return rsf * sel / sel.sum(axis=1, keepdims=True)


def rmsnorm(c: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)


def expert(z: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """E(z) = w2 SiTU-GLU(w1 z, w3 z) for rows z."""
    return situ_glu(z @ w1.T, z @ w3.T) @ w2.T


def combine(z, idx, wts, w1, w3, w2) -> np.ndarray:
    """c_t = sum_j wts_tj E_{idx_tj}(z_t): [T, d_l]."""
    c = np.zeros_like(z)
    for j in range(idx.shape[1]):
        for e in np.unique(idx[:, j]):
            rows = idx[:, j] == e
            c[rows] += wts[rows, j, None] * expert(z[rows], w1[e], w3[e], w2[e])
    return c


def layer(x, idx, p, rsf, eps) -> dict[str, np.ndarray]:
    """The layer on the given routing idx, with the weights renormalised from float64 scores.

    p holds w_r, w_down, w1, w3, w2, w_n, w_up, ws1, ws3, ws2 (shapes as in kernels.moe_layer).
    Returns y and the intermediates z, c, r, s and the weights.
    """
    s = scores(x, p["w_r"])
    wts = combine_weights(s, idx, rsf)
    z = x @ p["w_down"].T
    c = combine(z, idx, wts, p["w1"], p["w3"], p["w2"])
    r = rmsnorm(c, p["w_n"], eps)
    shared = situ_glu(x @ p["ws1"].T, x @ p["ws3"].T) @ p["ws2"].T
    return {"y": r @ p["w_up"].T + shared, "z": z, "c": c, "r": r, "s": s, "wts": wts}


def expert_outputs(z, idx, w1, w3, w2) -> np.ndarray:
    """E_{idx_tj}(z_t) for every token and slot: [T, k, d_l]."""
    out = np.zeros((*idx.shape, w2.shape[1]))
    for j in range(idx.shape[1]):
        for e in np.unique(idx[:, j]):
            rows = idx[:, j] == e
            out[rows, j] = expert(z[rows], w1[e], w3[e], w2[e])
    return out


def qb_update(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """One Quantile Balancing update on the batch s [m, n]: the new bias, q = floor(m k / n)."""
    m, n = s.shape
    q = (m * k) // n
    biased = s + b
    c = -np.sort(-biased, axis=1)[:, k]  # (k+1)-th largest
    margins = biased - c[:, None]
    return b - (-np.sort(-margins, axis=0)[q, :])  # (q+1)-th largest in each column


def loads(idx: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(idx.ravel(), minlength=n)


def expert_backward(z, idx, wts, dc, w1, w3, w2) -> dict[str, np.ndarray]:
    """Gradients of L = sum_t dc_t . c_t with the routing (idx, wts) fixed.

    dL/dwts_tj = dc_t . E_j;  dE = wts dc;  da = w2^T dE;  (dg, du) = SiTU-GLU's chain rule;
    dL/dw2 += dE a^T, dL/dw1 += dg z^T, dL/dw3 += du z^T, dL/dz += w1^T dg + w3^T du.
    """
    T, k = idx.shape
    out = {
        "dwts": np.zeros((T, k)),
        "dz": np.zeros_like(z),
        "dw1": np.zeros_like(w1),
        "dw3": np.zeros_like(w3),
        "dw2": np.zeros_like(w2),
    }
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            g, u = w1[e] @ z[t], w3[e] @ z[t]
            a = situ_glu(g, u)
            out["dwts"][t, j] = dc[t] @ (w2[e] @ a)
            dE = wts[t, j] * dc[t]
            dg, du = situ_glu_grad(g, u, w2[e].T @ dE)
            out["dw2"][e] += np.outer(dE, a)
            out["dw1"][e] += np.outer(dg, z[t])
            out["dw3"][e] += np.outer(du, z[t])
            out["dz"][t] += w1[e].T @ dg + w3[e].T @ du
    return out


def backward_loss(z, idx, wts, dc, w1, w3, w2) -> float:
    """L = sum_t dc_t . c_t, the function the backward differentiates."""
    return float(np.sum(dc * combine(z, idx, wts, w1, w3, w2)))


def finite_differences(z, idx, wts, dc, w1, w3, w2, picks) -> dict[str, np.ndarray]:
    """Central differences of backward_loss at the coordinates in `picks` (name -> index tuples),
    step FD_STEP."""
    args = {"z": z, "wts": wts, "w1": w1, "w3": w3, "w2": w2}
    out = {}
    for name, coords in picks.items():
        vals = []
        for coord in coords:
            plus = {key: v.copy() for key, v in args.items()}
            minus = {key: v.copy() for key, v in args.items()}
            plus[name][coord] += FD_STEP
            minus[name][coord] -= FD_STEP
            lp = backward_loss(plus["z"], idx, plus["wts"], dc, plus["w1"], plus["w3"], plus["w2"])
            lm = backward_loss(
                minus["z"], idx, minus["wts"], dc, minus["w1"], minus["w3"], minus["w2"]
            )
            vals.append((lp - lm) / (2 * FD_STEP))
        out[name] = np.array(vals)
    return out
