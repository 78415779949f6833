"""1M context PROVEN on its own task (issue 15): passkey retrieval, K3-μ's MLA layer with its
queries at the last rows only (mla.kernels_train's t0), and the gate's published evidence."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BuildRun, check, gate_row

from k3gates.infra import compile as kc
from k3gates.infra.gate import REGISTRY, GateContext
from k3gates.mla import kernels_train as KM
from k3gates.mla import layer_train as layer_mla
from k3gates.mla import reference_train as R
from k3gates.tasks import proof as P
from k3gates.tasks.passkey import gate as pk_gate
from k3gates.tasks.passkey import task as T

D = 16


@pytest.fixture(scope="module")
def mla():
    return kc.load("k3gates.mla.kernels_train")


def _weights(seed: int) -> dict[str, np.ndarray]:
    p = layer_mla.init(np.random.default_rng(seed), D)
    return {k: np.round(v * 2**20).astype(np.int64) for k, v in p.items()}


def _inputs(seed: int, b: int, t: int, t0: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(b, t, D)) * 2**16).astype(np.int64)
    dy = np.zeros((b, t, D), dtype=np.int64)
    dy[:, t0:] = np.round(rng.normal(size=(b, t - t0, D)) * 2**24)
    return x, dy


# -- the layer with its queries at the last rows ---------------------------------------------------
@pytest.mark.parametrize("t, t0", [(40, 35), (96, 1), (128, 127)])
def test_the_last_rows_are_the_whole_layer_bit_for_bit(mla, t, t0):
    p = _weights(1)
    x, dy = _inputs(2, 2, t, t0)
    y, cache = layer_mla.forward(mla, x, p, t0)
    y_full, cache_full = layer_mla.forward(mla, x, p)
    assert np.array_equal(y[:, t0:], y_full[:, t0:]) and not y[:, :t0].any()
    dx, g = layer_mla.backward(mla, dy, x, p, cache)
    dx_full, g_full = layer_mla.backward(mla, dy, x, p, cache_full)
    assert np.array_equal(dx, dx_full)
    assert all(np.array_equal(g[k], g_full[k]) for k in layer_mla.WEIGHTS)


def test_a_broken_row_is_seen(mla):
    """The bit-for-bit comparison above can fail: one flipped LSB in one output row shows."""
    p = _weights(1)
    x, _ = _inputs(2, 1, 40, 35)
    y, _ = layer_mla.forward(mla, x, p, 35)
    y[0, 37, 3] += 1
    assert not np.array_equal(y[:, 35:], layer_mla.forward(mla, x, p)[0][:, 35:])


def test_the_float_last_rows_are_the_whole_float_layer():
    rng = np.random.default_rng(3)
    p = layer_mla.init(rng, D)
    x, dy = rng.normal(size=(2, 30, D)), rng.normal(size=(2, 30, D))
    y, cache = R.forward(x, p, 24)
    y_full, cache_full = R.forward(x, p)
    assert np.allclose(y[:, 24:], y_full[:, 24:], rtol=0, atol=1e-12) and not y[:, :24].any()
    dx, g = R.backward(dy, x, p, cache)
    dy_cut = dy.copy()
    dy_cut[:, :24] = 0
    dx_full, g_full = R.backward(dy_cut, x, p, cache_full)
    assert np.allclose(dx, dx_full, rtol=0, atol=1e-12)
    assert all(np.allclose(g[k], g_full[k], rtol=0, atol=1e-12) for k in g)


def test_a_long_row_against_float64_within_its_bound(mla):
    """3,000 keys: y within forward_max_err_lsb(T), in the domain that bound assumes (|v| < 2^3,
    W_o row L1 <= 2^3)."""
    p = _weights(4)
    t, t0 = 3000, 2995
    x, dy = _inputs(5, 1, t, t0)
    y, cache = layer_mla.forward(mla, x, p, t0)
    v = cache[10]
    assert np.abs(v).max() < 2**3 * 2**24
    assert np.abs(p["w_o"]).sum(axis=1).max() <= 2**3 * 2**20
    pf = {k: w * 2.0**-20 for k, w in p.items()}
    y_ref, cache_ref = R.forward(x * 2.0**-16, pf, t0)
    err = np.abs(y[:, t0:] - y_ref[:, t0:] * 2**16).max()
    assert 0 < err <= KM.forward_max_err_lsb(t)
    dx, _ = layer_mla.backward(mla, dy, x, p, cache)
    dx_ref, _ = R.backward(dy * 2.0**-24, x * 2.0**-16, pf, cache_ref)
    assert np.abs(dx - dx_ref * 2**24).max() < 64


def test_a_count_outside_the_domain_is_refused(mla):
    p = _weights(1)
    x, dy = _inputs(2, 1, 40, 35)
    _, cache = layer_mla.forward(mla, x, p, 35)

    class Counting:
        """The kernel, with one more value counted outside its domain (the face must refuse)."""

        def mla_backward(self, *args):
            out = mla.mla_backward(*args)
            return (*out[:-1], out[-1] + 1)

    with pytest.raises(layer_mla.DomainError, match="mla_backward"):
        layer_mla.backward(Counting(), dy, x, p, cache)


# -- the task -------------------------------------------------------------------------------------
def test_a_sequence_hides_its_passkey_at_the_depth_asked():
    tokens, targets = T.sequences(np.random.default_rng(0), 3, 100, 0.25)
    assert tokens.shape == targets.shape == (3, T.context(100))
    n = T.prompt().size
    for seq, want in zip(tokens, targets, strict=True):
        assert np.array_equal(seq[:n], T.prompt())
        at = int(np.flatnonzero(seq == T.KEY)[0])
        assert at == n + 25 and seq[-T.DIGITS] == T.ASK
        key = seq[at + 1 : at + 1 + T.DIGITS]
        assert np.array_equal(want[-T.ANSWER :], key) and (want[: -T.ANSWER] == -1).all()
        assert np.unique(key).size == T.DIGITS and (key < T.KEY).all() and (key >= 1).all()
        assert np.array_equal(seq[-T.DIGITS + 1 :], key[:-1])  # the answer so far, teacher-forced
        filler = np.delete(seq, np.r_[:n, at : at + 1 + T.DIGITS, seq.size - T.DIGITS : seq.size])
        assert (filler >= T.FILLER0).all() and filler.size == 100


def test_exact_match_needs_every_digit():
    want = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    pred = want.copy()
    pred[7] = 1
    assert T.exact_match(pred, want).tolist() == [True, False]


# -- the gate -------------------------------------------------------------------------------------
def test_passkey_evidence_is_published_and_consistent(built_site: BuildRun):
    g = gate_row(built_site, "passkey_retrieval")
    heat = g["artifacts"]["heatmap:passkeys retrieved, by context length and depth"]
    assert heat["columns"] == [f"{n:,}" for n in pk_gate.LENGTHS]
    trained = [row[0] for row in heat["values"]]
    acc = check(g, "passkey_accuracy")
    assert acc["values"]["accuracy"] == pytest.approx(np.mean(trained))
    assert acc["passed"] and acc["values"]["accuracy"] >= pk_gate.ACCURACY_MIN == 0.95
    far = check(g, "accuracy_2_16")
    assert far["values"]["minimum"] == pk_gate.ACCURACY_2_16_MIN
    assert far["values"]["accuracy"] == pytest.approx(np.mean([row[-1] for row in heat["values"]]))
    assert far["passed"] and far["values"]["accuracy"] >= pk_gate.ACCURACY_2_16_MIN
    assert check(g, "rows_equal_full")["passed"]
    text = (built_site.out / "innovations" / "longctx" / "index.html").read_text()
    assert "passkeys retrieved, by context length and depth" in text
    assert text.count('fill="hsl(') == len(pk_gate.LENGTHS) * len(pk_gate.DEPTHS)


def test_a_zero_learning_rate_fails_the_threshold_and_the_accuracy(monkeypatch):
    monkeypatch.setitem(T.HYPER, "cycles", ((100, 0.0, 0.0),))
    # the CPython rerun of one step and the long contexts have nothing to do with the rate, and
    # weights that never move fail the same way after 100 steps as after the whole curriculum
    monkeypatch.setattr(P, "compiled_step", lambda *a, **k: None)
    monkeypatch.setattr(T, "PHASES", ((100, *T.PHASES[0][1:]),))
    monkeypatch.setattr(T, "STEPS", 100)
    monkeypatch.setattr(T, "EVAL_AT", (50,))
    monkeypatch.setattr(pk_gate, "LENGTHS", (1 << 12,))
    monkeypatch.setattr(pk_gate, "_rows_against_float", lambda *a: None)
    ctx = GateContext(REGISTRY["passkey_retrieval"])
    pk_gate.passkey_retrieval(ctx)
    checks = {c.name: c.passed for c in ctx.checks}
    assert checks["start_loss"] and checks["rows_equal_full"]
    assert not checks["loss_below_threshold"] and not checks["passkey_accuracy"]
