"""Gated MLA PROVEN on its own task (issue 15): induction, decode over the latent cache, and the
output gate held open."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BuildRun, check, gate_row

from k3gates.infra import compile as kc
from k3gates.infra.gate import REGISTRY, GateContext
from k3gates.k3mu.ops import IntOps
from k3gates.tasks import proof as P
from k3gates.tasks import seq as S
from k3gates.tasks.induction import gate as ind_gate
from k3gates.tasks.induction import task as I


# -- the published evidence -----------------------------------------------------------------------
def test_gatedmla_is_proven_by_induction(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "gatedmla")
    assert row["level"] == "PROVEN" and not row["killed"]
    g = gate_row(built_site, "mla_induction")
    assert g["passed"] and all(c["passed"] for c in g["checks"])
    acc = check(g, "induction_accuracy")["values"]
    assert acc["accuracy"] >= 0.95 and acc["minimum"] == ind_gate.ACCURACY_MIN
    assert acc["scored"] == I.HELD_OUT * I.HALF
    dec = check(g, "decode_equals_forward")
    assert dec["values"]["sequences"] == ind_gate.DECODED
    digests = dec["digests"]
    for i in range(ind_gate.DECODED):
        assert digests[f"sequence {i}: decode"] == digests[f"sequence {i}: forward"]
    below = check(g, "loss_below_threshold")["values"]
    assert below["final"] < below["threshold"] == ind_gate.THRESHOLD_BITS
    curve = check(g, "loss_curve")
    assert curve["bound"] == ind_gate.CURVE_REL_TOL and curve["measured"] <= curve["bound"]
    # both variants are reported, at equal steps
    series = g["artifacts"]["curve:held-out loss"]["series"]
    assert len(series["integer, gated"]) == len(series["integer, gate held open"])
    text = (built_site.out / "innovations" / "gatedmla" / "index.html").read_text()
    assert "Trained on its task" in text and "gate held open" in text and "<svg" in text


# -- decode over the latent cache -----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    ops = IntOps()
    return ops, kc.load(I.DECODE_KERNELS), S.init(I.CONFIG, 3)


def test_decode_equals_the_forward_and_a_corrupted_cache_does_not(model):
    ops, dec, p = model
    tokens, _ = I.sequences(np.random.default_rng(5), 1)
    prompt = tokens[0, : I.HALF + 1]
    gen, logits = I.decode(ops, dec, p, prompt, I.HALF)
    assert gen.size == I.CONTEXT and np.array_equal(gen[: prompt.size], prompt)
    assert np.array_equal(logits, I.forward_logits(ops, p, gen))

    class Forgetful:
        """The decode kernel, but each token's latent row is stored as zeros."""

        def mla_decode_step(self, *args):
            y, c_new, kr_new, bad = dec.mla_decode_step(*args)
            return y, np.zeros_like(c_new), kr_new, bad

    _, broken = I.decode(ops, Forgetful(), p, gen[:-1], 0)
    assert not np.array_equal(broken, I.forward_logits(ops, p, gen[:-1]))


def test_the_open_gate_gives_its_weights_no_gradient(model):
    _, _, p = model
    tokens, targets = I.sequences(np.random.default_rng(6), 2)
    grads = {}
    for name, ops in (("gated", IntOps()), ("open", I.OpenGateOps())):
        rec = S.forward(ops, p, I.CONFIG, tokens, targets)
        grads[name] = S.backward(ops, p, I.CONFIG, rec)
    assert np.any(grads["gated"]["0.attn.w_g"])
    assert not np.any(grads["open"]["0.attn.w_g"])  # sigma = 1 exactly: du = 0
    assert not np.array_equal(grads["gated"]["0.attn.w_o"], grads["open"]["0.attn.w_o"])


# -- the gate catches a broken training -----------------------------------------------------------
def test_a_zero_learning_rate_fails_the_threshold_and_the_accuracy(monkeypatch):
    monkeypatch.setitem(I.HYPER, "lr", 0.0)
    monkeypatch.setitem(I.HYPER, "lr_min", 0.0)
    # the CPython rerun of one step has nothing to do with the learning rate
    monkeypatch.setattr(P, "compiled_step", lambda *a, **k: None)
    ctx = GateContext(REGISTRY["mla_induction"])
    ind_gate.mla_induction(ctx)
    checks = {c.name: c.passed for c in ctx.checks}
    assert checks["start_loss"] and checks["decode_equals_forward"]
    assert not checks["loss_below_threshold"] and not checks["induction_accuracy"]
