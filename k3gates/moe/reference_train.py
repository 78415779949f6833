"""K3-μ's Stable LatentMoE FFN in float64 (K3-SPEC.md section 4), written from the equations.

    s = sigma(W_r x);  S = top-k of s + b (ties: lower expert index);  w_e = rsf s_e / sum_S s
    z = W_down x;  E_e(z) = w2[e] SiTU-GLU(w1[e] z, w3[e] z)
    c = sum_{e in S} w_e E_e;  r = w_n c / sqrt(mean(c^2) + eps)
    y = W_up r + ws2 SiTU-GLU(ws1 x, ws3 x)
    SiTU-GLU(g, u) = [beta tanh(g/beta) sigma(g)] [beta_lin tanh(u/beta_lin)], beta 4, beta_lin 25

Real-valued p (the bias in real score units). The backward holds the selection fixed; the
gradient reaches W_r through the renormalised weights. Quantile Balancing: `qb_update`.
`forward(x, p, idx=...)` takes a given selection [N, k] (the tests pass the integer run's, so a
near-tie cannot make them flaky); without it the reference selects by itself.
"""

from __future__ import annotations

import numpy as np

from . import reference
from .reference import qb_update as qb_update  # the same update, on this file's scores

TOP_K = 2
RSF = 1.0
EPS = 1e-6
BETA = 4.0
BETA_LIN = 25.0


def sigmoid(v: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * v))  # = 1 / (1 + e^-v), without overflow


def situ(g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(SiTU-GLU(g, u), d/dg, d/du)."""
    tg = np.tanh(g / BETA)
    sg = sigmoid(g)
    f = BETA * tg * sg
    fp = (1.0 - tg**2) * sg + BETA * tg * sg * (1.0 - sg)
    tu = np.tanh(u / BETA_LIN)
    hu = BETA_LIN * tu
    hp = 1.0 - tu**2
    return f * hu, fp * hu, f * hp


def select(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Top-k of s + b per row, by decreasing biased score; ties: the lower index first."""
    return reference.select(s + b, k)


def forward(x, p, idx=None, k=TOP_K, rsf=RSF, q8=None):
    """`q8` (quantisation-aware training): a function quantising rows along their last axis,
    applied to the experts' inputs z and a; p's expert weights are then the quantised ones."""
    b_, t_, d = x.shape
    xf = x.reshape(-1, d)  # [N, d]
    s = sigmoid(xf @ p["w_r"].T)  # [N, n]
    if idx is None:
        idx = select(s, p["bias"], k)
    idx = np.asarray(idx)
    sel = np.take_along_axis(s, idx, axis=1)  # [N, k]
    tot = sel.sum(axis=1, keepdims=True)
    w = rsf * sel / tot  # [N, k]
    z = xf @ p["w_down"].T  # [N, d_l]
    if q8 is not None:
        z = q8(z)
    g = np.einsum("nkhl,nl->nkh", p["w1"][idx], z)  # [N, k, h_e]
    u = np.einsum("nkhl,nl->nkh", p["w3"][idx], z)
    a, dadg, dadu = situ(g, u)
    if q8 is not None:  # straight-through: dadg, dadu stay SiTU's own at (g, u)
        a = q8(a.reshape(-1, a.shape[2])).reshape(a.shape)
    big_e = np.einsum("nklh,nkh->nkl", p["w2"][idx], a)  # [N, k, d_l]
    c = np.einsum("nk,nkl->nl", w, big_e)  # [N, d_l]
    rho = np.sqrt(np.mean(c**2, axis=1, keepdims=True) + EPS)
    chat = c / rho
    r = chat * p["w_n"]
    gs = xf @ p["ws1"].T
    us = xf @ p["ws3"].T
    a_s, dsdg, dsdu = situ(gs, us)
    y = r @ p["w_up"].T + a_s @ p["ws2"].T
    cache = dict(s=s, idx=idx, sel=sel, tot=tot, w=w, z=z, a=a, dadg=dadg, dadu=dadu,
                 E=big_e, c=c, rho=rho, chat=chat, r=r, a_s=a_s, dsdg=dsdg, dsdu=dsdu,
                 rsf=rsf)  # fmt: skip
    return y.reshape(b_, t_, -1), cache


def backward(dy, x, p, cache):
    d = x.shape[-1]
    xf = x.reshape(-1, d)
    g_y = dy.reshape(-1, d)
    cc = cache
    idx = cc["idx"]
    grads = {"w_up": g_y.T @ cc["r"], "ws2": g_y.T @ cc["a_s"]}
    dr = g_y @ p["w_up"]
    das = g_y @ p["ws2"]
    dgs = das * cc["dsdg"]
    dus = das * cc["dsdu"]
    grads["ws1"] = dgs.T @ xf
    grads["ws3"] = dus.T @ xf
    dx = dgs @ p["ws1"] + dus @ p["ws3"]
    # RMSNorm: r = w_n c / rho
    grads["w_n"] = np.sum(dr * cc["chat"], axis=0)
    gr = dr * p["w_n"]
    chat = cc["chat"]
    dc = (gr - chat * np.mean(chat * gr, axis=1, keepdims=True)) / cc["rho"]
    # combine: c = sum_j w_j E_j
    dw = np.einsum("nl,nkl->nk", dc, cc["E"])
    d_e = cc["w"][:, :, None] * dc[:, None, :]  # [N, k, d_l]
    da = np.einsum("nklh,nkl->nkh", p["w2"][idx], d_e)
    dg = da * cc["dadg"]
    du = da * cc["dadu"]
    dz = np.einsum("nkhl,nkh->nl", p["w1"][idx], dg) + np.einsum("nkhl,nkh->nl", p["w3"][idx], du)
    grads["w_down"] = dz.T @ xf
    dx += dz @ p["w_down"]
    n = p["w1"].shape[0]
    dw1 = np.zeros_like(p["w1"])
    dw3 = np.zeros_like(p["w3"])
    dw2 = np.zeros_like(p["w2"])
    dwr = np.zeros((n, d))
    # each expert's gradient sums over the (token, slot) pairs routed to it
    tok, slot = np.nonzero(idx >= 0)
    dl_pairs = []
    for e in range(n):
        at = idx[tok, slot] == e
        t_e, k_e = tok[at], slot[at]
        dw1[e] = dg[t_e, k_e].T @ cc["z"][t_e]
        dw3[e] = du[t_e, k_e].T @ cc["z"][t_e]
        dw2[e] = d_e[t_e, k_e].T @ cc["a"][t_e, k_e]
        dl_pairs.append((e, t_e, k_e))
    grads.update(w1=dw1, w3=dw3, w2=dw2)
    # router: w_j = rsf s_j / S, s = sigma(l)
    sel, tot = cc["sel"], cc["tot"]
    ds = cc["rsf"] / tot * (dw - np.sum(dw * sel / tot, axis=1, keepdims=True))
    dl = ds * sel * (1.0 - sel)  # [N, k]
    for e, t_e, k_e in dl_pairs:
        dwr[e] = dl[t_e, k_e] @ xf[t_e]
    grads["w_r"] = dwr
    dx += np.einsum("nk,nkd->nd", dl, p["w_r"][idx])
    return dx.reshape(x.shape), grads


def loads(cache: dict) -> np.ndarray:
    """Tokens per expert under the cached selection."""
    return np.bincount(cache["idx"].ravel(), minlength=cache["s"].shape[1])
