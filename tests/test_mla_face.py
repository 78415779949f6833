"""The k3gates.mla library face: forward, decode_step, backward, float in and out.

The float64 model here is written from K3-SPEC section 2 in this file, without the package's
reference.py. The face quantises its inputs to Q.16, so the model runs on those quantised values;
end to end (projections, RMSNorms, attention, gate, o_proj) no bound is derived, so the tolerance
below is a stated one: the gate's problem measures about 13 LSB of Q.20 here, the test allows 64.
"""

from __future__ import annotations

import numpy as np
import pytest

import k3gates.mla as mla

DIMS = {"T": 24, "H": 3, "D": 40, "q_lora": 32, "kv_lora": 48, "rope": 8, "nope": 16, "d_v": 16}
LSB = 2.0**-20
TOL_Y = 64 * LSB  # stated end-to-end tolerance (no derived bound; see the module docstring)


def q16(a: np.ndarray) -> np.ndarray:
    """The face's quantisation (ties cannot occur for these draws)."""
    return np.round(np.asarray(a) * 2**16) / 2**16


def make(seed: int = 3, d: dict = DIMS) -> tuple[np.ndarray, dict]:
    rng = np.random.default_rng(seed)
    h, dqk = d["H"], d["nope"] + d["rope"]

    def lin(rows, cols, gain=1.0):
        return rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)

    w = {
        "w_dq": lin(d["q_lora"], d["D"]),
        "w_q_norm": 1 + 0.1 * rng.standard_normal(d["q_lora"]),
        "w_uq": lin(h * dqk, d["q_lora"], 2.0),
        "w_dkv": lin(d["kv_lora"] + d["rope"], d["D"]),
        "w_kv_norm": 1 + 0.1 * rng.standard_normal(d["kv_lora"]),
        "w_uk": rng.standard_normal((h, d["nope"], d["kv_lora"])) / np.sqrt(d["kv_lora"]),
        "w_uv": rng.standard_normal((h, d["d_v"], d["kv_lora"])) / np.sqrt(d["kv_lora"]),
        "w_g": lin(h * d["d_v"], d["D"]),
        "w_o": lin(d["D"], h * d["d_v"]),
    }
    return rng.standard_normal((d["T"], d["D"])), w


def internals(x: np.ndarray, w: dict, eps: float = 1e-6) -> dict:
    """Independent float64 MLA internals from K3-SPEC section 2 (NoPE, scale (nope+rope)^-1/2)."""
    h, kv_lora = w["w_uk"].shape[0], w["w_uk"].shape[2]

    def rms(a, g):
        return g * a / np.sqrt(np.mean(a**2, axis=-1, keepdims=True) + eps)

    c_q = rms(x @ w["w_dq"].T, w["w_q_norm"])
    dqk = w["w_uq"].shape[0] // h
    q = (c_q @ w["w_uq"].T).reshape(len(x), h, dqk) * dqk**-0.5
    kv = x @ w["w_dkv"].T
    return {"q": q, "c": rms(kv[:, :kv_lora], w["w_kv_norm"]), "k_r": kv[:, kv_lora:],
            "u": x @ w["w_g"].T}  # fmt: skip


def layer(q, c, k_r, u, w) -> np.ndarray:
    """y from the internals: causal softmax attention with k = W_UK c (+ shared k_R), v = W_UV c,
    then W_O (o * sigmoid(u))."""
    nope = w["w_uk"].shape[1]
    k = np.einsum("hij,sj->shi", w["w_uk"], c)
    v = np.einsum("hij,sj->shi", w["w_uv"], c)
    s = np.einsum("thi,shi->hts", q[..., :nope], k) + np.einsum("thr,sr->hts", q[..., nope:], k_r)
    s = np.where(np.tril(np.ones(s.shape[1:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shi->thi", p, v).reshape(len(q), -1)
    return (o / (1 + np.exp(-u))) @ w["w_o"].T


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, dict, mla.MLAWeights]:
    x, w = make()
    return x, w, mla.MLAWeights(**w)


def test_forward_matches_an_independent_float64_model(case):
    x, w, weights = case
    y = mla.forward(x, weights)
    assert y.dtype == np.float64 and y.shape == x.shape
    wq = {n: q16(a) for n, a in w.items()}
    want = layer(**internals(q16(x), wq), w=wq)
    assert np.abs(y - want).max() <= TOL_Y
    assert np.abs(want).max() > 0.1  # the comparison is not vacuous


def test_decode_steps_reproduce_the_forward_bit_for_bit(case):
    x, _, weights = case
    y = mla.forward(x, weights)
    cache = None
    rows = []
    for t in range(len(x)):
        y_t, cache = mla.decode_step(x[t], cache, weights)
        rows.append(y_t)
    np.testing.assert_array_equal(np.stack(rows), y)
    assert cache.length == len(x)
    assert cache.values_per_token == DIMS["kv_lora"] + DIMS["rope"]
    assert cache.bytes_per_token == 4 * (DIMS["kv_lora"] + DIMS["rope"])


def test_the_cache_is_far_smaller_than_mha_at_k3_dims():
    # K3-SPEC section 2: 512 + 64 latent values against 96 (192 + 128) for plain MHA K and V
    assert mla.mha_values_per_token(96, 128, 64, 128) == 96 * (192 + 128) == 30720
    assert mla.mha_values_per_token(96, 128, 64, 128) / (512 + 64) == pytest.approx(53.333, 1e-4)


def test_a_shut_gate_silences_the_layer(case):
    x, w, _ = case
    shut = dict(w, w_g=np.zeros_like(w["w_g"]))
    shut["w_g"][:, 0] = -15.0
    x8 = x.copy()
    x8[:, 0] = 8.0  # every gate logit is -120: sigma is exactly 0
    assert not mla.forward(x8, mla.MLAWeights(**shut)).any()


def test_backward_matches_finite_differences_of_the_float_model(case):
    x, w, weights = case
    rng = np.random.default_rng(9)
    dy = 0.5 * rng.standard_normal(x.shape)
    g = mla.backward(x, weights, dy)
    wq = {n: q16(a) for n, a in w.items()}
    z = internals(q16(x), wq)
    names = {"dq": "q", "dc_kv": "c", "dk_r": "k_r", "du": "u"}
    h = 2.0**-18
    for gname, zname in names.items():
        assert g[gname].shape == z[zname].reshape(g[gname].shape).shape
        for _ in range(6):
            idx = tuple(int(rng.integers(0, n)) for n in z[zname].shape)
            plus = {k: v.copy() for k, v in z.items()}
            minus = {k: v.copy() for k, v in z.items()}
            plus[zname][idx] += h
            minus[zname][idx] -= h
            fd = np.sum(dy * (layer(**plus, w=wq) - layer(**minus, w=wq))) / (2 * h)
            got = g[gname][idx]
            # the face differentiates at its own integer internals (within ~2^-17 of z): 1e-4
            assert abs(got - fd) <= 1e-4 * (1 + abs(fd)), (gname, idx, got, fd)


def test_custom_scale_and_eps_are_used(case):
    x, w, weights = case
    other = mla.MLAWeights(**w, scale=0.05, eps=1e-3)
    assert not np.array_equal(mla.forward(x, other), mla.forward(x, weights))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, w, W: mla.forward(x[:, :5], W), "x: expected a last axis of D = 40"),
        (lambda x, w, W: mla.forward(x * 1e3, W), "x: expected |values| < 256"),
        (lambda x, w, W: mla.forward(x.tolist(), W), "x: expected a numpy array of real numbers"),
        (lambda x, w, W: mla.forward(np.full_like(x, np.nan), W), "x: expected finite values"),
        (lambda x, w, W: mla.forward(x, w), "weights: expected an MLAWeights, got dict"),
        (lambda x, w, W: mla.decode_step(x, None, W), "x_t: expected 1 dimensions"),
        (lambda x, w, W: mla.decode_step(x[0], "cache", W), "cache: expected a LatentCache"),
        (lambda x, w, W: mla.backward(x, W, np.ones((2, 40))), "dy: expected shape (24, 40)"),
        (lambda x, w, W: mla.backward(x, W, np.full(x.shape, 20.0)), "dy: expected |values| < 16"),
        (lambda x, w, W: mla.MLAWeights(**dict(w, w_uv=w["w_uv"][:, :, :3])),
         "w_uv: expected shape (3, 16, 48)"),
        (lambda x, w, W: mla.MLAWeights(**dict(w, w_o=w["w_o"] * 100)),
         "w_o: expected |values| < 16"),
        (lambda x, w, W: mla.MLAWeights(**dict(w, w_q_norm=w["w_q_norm"] * 10)),
         "w_q_norm: expected |values| < 8"),
        (lambda x, w, W: mla.MLAWeights(**w, eps=-1.0), "eps: expected a number in [0, 1024)"),
        (lambda x, w, W: mla.MLAWeights(**w, scale=2.0), "scale: expected None or a number"),
        (lambda x, w, W: mla.forward(x, mla.MLAWeights(**dict(w, w_uv=15 * np.sign(w["w_uv"])))),
         "intermediate values left the kernels' formats and saturated"),  # |v| ~ 15 sqrt(48)
    ],
)  # fmt: skip
def test_bad_input_raises_value_error_saying_what_was_expected(case, call, message):
    x, w, weights = case
    with pytest.raises(ValueError) as e:
        call(x, w, weights)
    assert message in str(e.value)


def test_a_cache_from_other_dims_is_refused(case):
    x, _, weights = case
    other = mla.MLAWeights(**make(4, dict(DIMS, kv_lora=32))[1])
    _, cache = mla.decode_step(x[0], None, other)
    with pytest.raises(ValueError, match="cache: expected rows of kv_lora = 48 and rope = 8"):
        mla.decode_step(x[0], cache, weights)
