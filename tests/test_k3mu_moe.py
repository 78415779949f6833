"""K3-μ LatentMoE FFN: the float reference against finite differences, the integer kernels against
the float reference (within the bounds moe/kernels_train.py declares), compiled == interpreted, and
Quantile Balancing's loads.

The selection is discrete, so the float reference is always given the integer run's selection
(`reference_moe.forward(..., idx=...)`): a near-tie can never make these tests flaky. How often
the float reference's own top-k agrees is asserted loosely (>= 90% of tokens), not exactly.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from k3gates.infra import compile as kc
from k3gates.moe import kernels_train as K
from k3gates.moe import layer_train as L
from k3gates.moe import reference_train as R

MOD = "k3gates.moe.kernels_train"
A, W, G, BF = 16, 20, 24, 40  # Q-formats: activations, weights, gradients, QB bias


@pytest.fixture(scope="module")
def compiled():
    return kc.load(MOD)


@pytest.fixture(scope="module")
def interpreted():
    return importlib.import_module(MOD)


def frac(name: str) -> int:
    return BF if name == "bias" else W


def pd_of(pq: dict) -> dict:
    return {k: v * 2.0 ** -frac(k) for k, v in pq.items()}


def problem(seed: int, b: int, t: int, d: int, bias_sd: float = 0.05):
    """Integer inputs (x Q.16, p Q.20 / bias Q.40, dy Q.24) and their dequantised values."""
    rng = np.random.default_rng(seed)
    pr = L.init(rng, d)
    pr["bias"] = rng.normal(0.0, bias_sd, L.N_EXPERTS)
    pr["w_n"] = 1.0 + 0.3 * rng.normal(size=L.d_latent(d))
    pq = {k: np.round(v * 2.0 ** frac(k)).astype(np.int64) for k, v in pr.items()}
    pd = {k: v * 2.0 ** -frac(k) for k, v in pq.items()}
    x = np.round(rng.normal(0.0, 1.0, (b, t, d)) * 2**A).astype(np.int64)
    dy = np.round(rng.normal(0.0, 0.5, (b, t, d)) * 2**G).astype(np.int64)
    return x, pq, pd, dy


# -- 1. the float backward against central finite differences -----------------------------------
def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(3)
    d, n, k, d_l, h, h_s = 6, 4, 2, 4, 3, 5
    p = {
        "w_r": rng.normal(0, 1, (n, d)), "bias": rng.normal(0, 0.1, n),
        "w_down": rng.normal(0, 0.5, (d_l, d)), "w1": rng.normal(0, 0.7, (n, h, d_l)),
        "w3": rng.normal(0, 3, (n, h, d_l)), "w2": rng.normal(0, 0.7, (n, d_l, h)),
        "w_n": rng.normal(1, 0.3, d_l), "w_up": rng.normal(0, 0.5, (d, d_l)),
        "ws1": rng.normal(0, 0.7, (h_s, d)), "ws3": rng.normal(0, 3, (h_s, d)),
        "ws2": rng.normal(0, 0.5, (d, h_s)),
    }  # fmt: skip
    x = rng.normal(0, 1, (2, 3, d))
    dy = rng.normal(0, 1, (2, 3, d))
    rsf = 1.7  # a non-unit routed scaling factor exercises its gradient path
    _, cache = R.forward(x, p, k=k, rsf=rsf)
    idx = cache["idx"]  # held fixed: the backward holds the selection fixed

    def loss(xv, pv):
        return float(np.sum(dy * R.forward(xv, pv, idx=idx, k=k, rsf=rsf)[0]))

    dx, grads = R.backward(dy, x, p, cache)
    eps = 1e-6
    checks = [("x", x, dx)] + [(nm, p[nm], grads[nm]) for nm in grads]
    assert set(grads) == set(L.TRAINED)
    for name, arr, g in checks:
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            up = loss(x, p)
            arr[i] = old - eps
            down = loss(x, p)
            arr[i] = old
            num[i] = (up - down) / (2 * eps)
        err = np.abs(num - g).max()
        assert err <= 1e-6 * max(1.0, np.abs(num).max()), (name, err)
        assert np.abs(num).max() > 1e-3, name  # a zero gradient would pass trivially


# -- the declared forward bound (moe/kernels_train.py's docstring), on the data ---------------
def forward_bound(pd: dict, cr: dict) -> np.ndarray:
    """Per-output bound (real units) on |y_int - y_float|: 1/2 LSB of Q.16 plus FWD_SLACK times
    the first-order propagation of the kernels' internal roundings (u = 2^-25 each)."""
    u = 2.0**-25
    floor = 2.0**-45
    idx = cr["idx"]
    n_tok, d_l = cr["z"].shape
    e_z = np.full((n_tok, d_l), u)
    e_g = u + np.einsum("nkhl,nl->nkh", np.abs(pd["w1"][idx]), e_z)
    e_u = u + np.einsum("nkhl,nl->nkh", np.abs(pd["w3"][idx]), e_z)
    e_a = u + floor + np.abs(cr["dadg"]) * e_g + np.abs(cr["dadu"]) * e_u
    e_e = np.einsum("nklh,nkh->nkl", np.abs(pd["w2"][idx]), e_a)
    k = idx.shape[1]
    d_w = cr["rsf"] * (k + 1) * 2.0**-54 / cr["tot"]  # scores' and ratios' roundings
    e_c = np.einsum("nk,nkl->nl", np.abs(cr["w"]), e_e) + k * u
    e_c += np.einsum("nk,nkl->nl", np.broadcast_to(d_w, cr["w"].shape), np.abs(cr["E"]))
    ch = np.abs(cr["chat"])
    e_ch = (e_c + ch * np.sum(ch * e_c, axis=1, keepdims=True) / d_l) / cr["rho"]
    e_ch += u + ch * 2.0**-58
    e_r = np.abs(pd["w_n"]) * e_ch + u
    e_as = np.full(cr["a_s"].shape, u + floor)
    e_y = e_r @ np.abs(pd["w_up"]).T + e_as @ np.abs(pd["ws2"]).T
    return 2.0 ** -(A + 1) + K.FWD_SLACK_Q2 / 4 * e_y


def int_vs_float_forward(mod, x, pq, pd):
    y, cache = L.forward(mod, x, pq)
    yr, cr = R.forward(x * 2.0**-A, pd, idx=cache[1])
    yr = yr.reshape(-1, x.shape[-1])
    err = np.abs(y.reshape(yr.shape) * 2.0**-A - yr)
    bound = forward_bound(pd, cr)
    rms = np.sqrt(np.mean(yr**2))
    return y, cache, cr, err, bound, rms


# -- 2. integer forward against float --------------------------------------------------------------
def test_forward_int_vs_float(compiled):
    x, pq, pd, _ = problem(11, 2, 12, 64)
    _, cache, cr, err, bound, rms = int_vs_float_forward(compiled, x, pq, pd)
    assert np.all(err <= bound), (err.max() * 2**A, bound.max() * 2**A)
    assert bound.max() <= 0.05 * rms, (bound.max(), rms)
    assert rms > 0.1  # a real signal, so an all-zero output fails
    # the float reference's own top-k agrees with the integer selection on (nearly) every token
    own = R.select(cr["s"], pd["bias"], L.TOP_K)
    assert np.mean(np.all(own == cache[1], axis=1)) >= 0.9
    # scores Q.40 within one LSB of float's sigma
    assert np.abs(cache[0] * 2.0**-BF - cr["s"]).max() <= 2.0**-BF
    print(f"forward: max err {err.max() * 2**A:.3f} LSB, bound {bound.max() * 2**A:.3f} LSB,")
    print(f"  rms {rms:.3f} ({rms * 2**A:.0f} LSB), relative {err.max() / rms:.2e}")


# -- 3. integer backward against float -------------------------------------------------------------
def backward_errors(mod, x, pq, pd, dy):
    _, cache = L.forward(mod, x, pq)
    dx, grads = L.backward(mod, dy, x, pq, cache)
    _, cr = R.forward(x * 2.0**-A, pd, idx=cache[1])
    dxr, gr = R.backward(dy * 2.0**-G, x * 2.0**-A, pd, cr)
    out = {}
    for name, v, ref in [("x", dx, dxr)] + [(nm, grads[nm], gr[nm]) for nm in gr]:
        err = np.abs(v * 2.0**-G - ref).max()
        bound = 2.0 ** -(G + 1) + K.BWD_REL_Q30 * 2.0**-30 * np.abs(ref).max()
        rms = np.sqrt(np.mean(ref**2))
        out[name] = (err, bound, rms)
    assert set(grads) == set(L.TRAINED)
    return out


def test_backward_int_vs_float(compiled):
    x, pq, pd, dy = problem(12, 2, 12, 64)
    for name, (err, bound, rms) in backward_errors(compiled, x, pq, pd, dy).items():
        assert err <= bound, (name, err * 2**G, bound * 2**G)
        assert bound <= 0.05 * rms, (name, bound, rms)
        assert rms > 1e-3, name
        print(f"d{name}: err {err * 2**G:.2f} LSB, bound {bound * 2**G:.1f}, rel {err / rms:.1e}")


# -- 4. compiled == interpreted, bit for bit ------------------------------------------------------
def test_compiled_equals_interpreted(compiled, interpreted):
    x, pq, _, dy = problem(5, 1, 5, 16, bias_sd=0.2)
    x[0, :2] = -np.abs(x[0, :2])  # negative inputs: Pythran's // and % trap
    for name in ("w_r", "w_down", "w1", "w2", "w_up", "ws2", "w_n"):
        pq[name] = pq[name].copy()
        pq[name].flat[::3] = -np.abs(pq[name].flat[::3])
    y1, c1 = L.forward(compiled, x, pq)
    y2, c2 = L.forward(interpreted, x, pq)
    assert np.array_equal(y1, y2)
    for a, b in zip(c1, c2, strict=True):
        assert np.array_equal(a, b)
    dx1, g1 = L.backward(compiled, dy, x, pq, c1)
    dx2, g2 = L.backward(interpreted, dy, x, pq, c2)
    assert np.array_equal(dx1, dx2)
    for name in g1:
        assert np.array_equal(g1[name], g2[name]), name
    assert np.array_equal(L.qb_update(compiled, c1, pq), L.qb_update(interpreted, c2, pq))


# -- 5. Quantile Balancing -----------------------------------------------------------------------
def test_quantile_balancing_loads(compiled):
    """K3-SPEC section 4: after one update on a fixed batch each expert receives about
    q = N k / n tokens. One step moves the thresholds c_i too, so it is approximate (float64
    behaves the same); a few more steps on the same batch settle within a few percent."""
    x, pq, _, _ = problem(21, 4, 64, 64, bias_sd=0.0)
    # a skewed router: expert 0 favoured, expert 3 disfavoured
    skew = np.round(np.outer([0.15, 0.05, -0.05, -0.15], np.ones(64)) / 8 * 2**W).astype(np.int64)
    pq["w_r"] = pq["w_r"] + skew
    xs = x + np.int64(2**A // 2)  # a shared mean direction makes the skew bite
    n_tok = xs.shape[0] * xs.shape[1]
    q = n_tok * L.TOP_K // L.N_EXPERTS
    _, cache = L.forward(compiled, xs, pq)
    before = L.loads(cache)
    assert np.abs(before - q).max() > q // 2  # the test starts far from balanced
    new_b = L.qb_update(compiled, cache, pq)
    # the integer update equals float64's on the same scores within 2 LSB of Q.40
    ref_b = R.qb_update(cache[0] * 2.0**-BF, pq["bias"] * 2.0**-BF, L.TOP_K)
    assert np.abs(new_b * 2.0**-BF - ref_b).max() <= 2 * 2.0**-BF
    # the float twin's QB path through the face gives the same update on these scores
    _, cr = R.forward(xs * 2.0**-A, dict(pd_of(pq), bias=pq["bias"] * 2.0**-BF))
    twin = L.qb_update_reference(cr, {"bias": pq["bias"] * 2.0**-BF}, R)
    assert np.abs(twin - ref_b).max() < 2.0**-30
    assert L.loads(cr).sum() == n_tok * L.TOP_K
    history = [before]
    for _ in range(3):
        pq = dict(pq, bias=new_b)
        _, cache = L.forward(compiled, xs, pq)
        history.append(L.loads(cache))
        new_b = L.qb_update(compiled, cache, pq)
    after = history[1]
    assert after.sum() == n_tok * L.TOP_K
    dev = [int(np.abs(h - q).max()) for h in history]
    # about q after one update (within 35%, from 3/4 off), within 20% after three
    assert dev[1] <= 35 * q // 100 and dev[1] <= dev[0] // 2, (history, q)
    assert dev[-1] <= q // 5 and dev[3] <= dev[1], (history, q)
    print(f"QB: q = {q}, loads per update {[h.tolist() for h in history]}")


def test_params_and_init_agree():
    assert (R.TOP_K, R.RSF) == (L.TOP_K, L.RSF)  # the float twin runs the same settings
    p = L.init(np.random.default_rng(0), 64)
    assert [nm for nm, _, _ in L.PARAMS] == list(p)
    for name, shape, opt in L.PARAMS:
        assert p[name].shape == shape(64), name
        assert opt[0] in ("muon", "adamw", "fixed")


# -- 6. quantisation-aware training: the routed experts fake-quantised (mxfp_training) ---------
# Declared before the first run: the QAT layer against the float64 fake-quant reference, max
# |error| relative to the RMS of the float64 value: 1% for y, 2% for every gradient (the
# unquantised layer is within 5% of RMS by its bound; a quantiser whose two inputs differ by their
# rounding may land one grid step apart, on a few elements).
QAT_Y_REL, QAT_GRAD_REL = 0.01, 0.02


@pytest.fixture(scope="module")
def mx():
    return L.MX(kc.load("k3gates.mxfp.kernels_qat"))


def _q(rows: np.ndarray, fmt: str) -> np.ndarray:
    from k3gates.mxfp import reference_qat as mxq

    return mxq.quantize(rows, fmt, "round-up")[3]


def _quantised(pd: dict) -> dict:
    q = {n: _q(pd[n].reshape(-1, pd[n].shape[2]), "e2m1").reshape(pd[n].shape)
         for n in ("w1", "w3", "w2")}  # fmt: skip
    return {**pd, **q}


def test_qat_quantises_the_experts_weights_and_z_exactly(compiled, mx):
    """MXFP4 weights and MXFP8 z, bit for bit as the float64 reference quantiser gives them;
    and the quantisation is real: the layer's output moves."""
    x, pq, pd, _ = problem(13, 2, 12, 64)
    pe = mx.experts(pq)
    for n in ("w1", "w3", "w2"):
        assert np.array_equal(pe[n] * 2.0**-W, _quantised(pd)[n]), n
        assert not np.array_equal(pe[n], pq[n]), n
    y_plain, plain = L.forward(compiled, x, pq)
    y_qat, qat = L.forward(compiled, x, pq, mx=mx)
    assert np.array_equal(qat[4] * 2.0**-24, _q(plain[4] * 2.0**-24, "e4m3"))  # z
    assert not np.array_equal(qat[4], plain[4])
    moved = np.abs(y_qat - y_plain).max() / np.sqrt(np.mean(y_plain.astype(float) ** 2))
    assert moved > 1e-3, moved


def test_qat_forward_and_straight_through_backward_against_float64(compiled, mx):
    x, pq, pd, dy = problem(14, 2, 12, 64)
    y, cache = L.forward(compiled, x, pq, mx=mx)
    dx, grads = L.backward(compiled, dy, x, pq, cache, mx=mx)
    pdq = _quantised(pd)
    yr, cr = R.forward(x * 2.0**-A, pdq, idx=cache[1], q8=lambda r: _q(r, "e4m3"))
    dxr, gr = R.backward(dy * 2.0**-G, x * 2.0**-A, pdq, cr)
    rms = np.sqrt(np.mean(yr**2))
    assert np.abs(y * 2.0**-A - yr).max() <= QAT_Y_REL * rms
    for name, v, want in [("x", dx, dxr)] + [(n, grads[n], gr[n]) for n in gr]:
        rms = np.sqrt(np.mean(want**2))
        assert rms > 1e-3, name
        assert np.abs(v * 2.0**-G - want).max() <= QAT_GRAD_REL * rms, name


def test_qat_compiled_equals_interpreted(compiled, interpreted, mx):
    x, pq, _, dy = problem(15, 1, 3, 64)
    mx_py = L.MX(importlib.import_module("k3gates.mxfp.kernels_qat"))
    y1, c1 = L.forward(compiled, x, pq, mx=mx)
    y2, c2 = L.forward(interpreted, x, pq, mx=mx_py)
    assert np.array_equal(y1, y2)
    dx1, g1 = L.backward(compiled, dy, x, pq, c1, mx=mx)
    dx2, g2 = L.backward(interpreted, dy, x, pq, c2, mx=mx_py)
    assert np.array_equal(dx1, dx2)
    for name in g1:
        assert np.array_equal(g1[name], g2[name]), name
