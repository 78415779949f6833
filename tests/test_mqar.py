"""KDA PROVEN on its own task (issue 15): multi-query associative recall, and the beta = 0
ablation."""

from __future__ import annotations

import numpy as np
from conftest import BuildRun, check, gate_row

from k3gates.infra.gate import REGISTRY, GateContext
from k3gates.k3mu.model import sub
from k3gates.k3mu.ops import IntOps
from k3gates.tasks import proof as P
from k3gates.tasks import seq as S
from k3gates.tasks.mqar import gate as mq_gate
from k3gates.tasks.mqar import task as Q


# -- the published evidence -----------------------------------------------------------------------
def test_kda_is_proven_by_mqar(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "kda")
    assert row["level"] == "PROVEN" and not row["killed"]
    g = gate_row(built_site, "kda_mqar")
    assert g["passed"] and all(c["passed"] for c in g["checks"])
    acc = check(g, "recall_accuracy")["values"]
    assert acc["accuracy"] >= 0.95 and acc["minimum"] == mq_gate.ACCURACY_MIN
    assert acc["scored"] == Q.HELD_OUT * Q.QUERIES  # the scored positions are the queries
    curve = check(g, "loss_curve")
    assert curve["bound"] == mq_gate.CURVE_REL_TOL and curve["measured"] <= curve["bound"]
    below = check(g, "loss_below_threshold")["values"]
    assert below["final"] < below["threshold"] == mq_gate.THRESHOLD_BITS
    # the ablation is reported beside the model, at equal steps, and is worse by the margin
    abl = check(g, "ablation_worse")["values"]
    assert abl["ablation_accuracy"] <= abl["accuracy"] - mq_gate.ABLATION_MARGIN
    series = g["artifacts"]["curve:held-out loss"]["series"]
    assert len(series["integer KDA"]) == len(series["beta fixed at 0 (integer)"])
    anchor = g["artifacts"]["table:published MQAR accuracy (float), beside this run"]["rows"]
    assert {r[0] for r in anchor} >= set(mq_gate.ZOOLOGY_FIG2_SEQ128_D64)
    text = (built_site.out / "innovations" / "kda" / "index.html").read_text()
    assert "Trained on its task" in text and "Zoology" in text and "<svg" in text


# -- the task -------------------------------------------------------------------------------------
def test_every_query_asks_for_the_value_its_key_was_shown_with():
    tokens, targets = Q.sequences(np.random.default_rng(2), 4)
    assert tokens.shape == (4, Q.CONTEXT) and Q.CONTEXT >= 128 and Q.PAIRS >= 16
    for tok, tgt in zip(tokens, targets, strict=True):
        keys, values = tok[0 : 2 * Q.PAIRS : 2], tok[1 : 2 * Q.PAIRS : 2]
        assert len(set(keys.tolist())) == Q.PAIRS and keys.max() < Q.KEYS <= values.min()
        shown = dict(zip(keys.tolist(), values.tolist(), strict=True))
        asked = np.flatnonzero(tgt >= 0)
        assert asked.size == Q.QUERIES and asked.min() >= 2 * Q.PAIRS
        for pos in asked:
            assert tgt[pos] == shown[int(tok[pos])] == tok[pos + 1]


# -- the ablation ---------------------------------------------------------------------------------
def test_beta_zero_makes_the_layer_add_nothing_and_learn_nothing():
    p = S.init(Q.CONFIG, 4)
    tokens, targets = Q.sequences(np.random.default_rng(4), 2)
    out = {}
    for name, ops in (("kda", IntOps()), ("beta0", Q.beta_zero_ops(IntOps().load))):
        xn = ops.norm(ops.embed(tokens.reshape(-1), p["emb"]), p["0.norm"])[0]
        y, _ = ops.layer("kda", xn.reshape(2, Q.CONTEXT, -1), sub(p, "0.attn."))
        grads = S.backward(ops, p, Q.CONFIG, S.forward(ops, p, Q.CONFIG, tokens, targets))
        out[name] = (y, grads)
    assert np.any(out["kda"][0]) and not np.any(out["beta0"][0])
    layer = [k for k in out["kda"][1] if k.startswith("0.attn.")]
    assert any(np.any(out["kda"][1][k]) for k in layer)
    assert not any(np.any(out["beta0"][1][k]) for k in layer)


def test_the_layerless_check_fails_when_beta_is_not_zeroed(monkeypatch):
    # the "ablation" left as the full model: it is not the layerless model, and the check says so
    monkeypatch.setattr(Q, "beta_zero_ops", IntOps)
    monkeypatch.setattr(mq_gate, "STEPS", 20)
    ctx = GateContext(REGISTRY["kda_mqar"])
    d = S.data(Q.sequences, mq_gate.SEED, 20, Q.BATCH, Q.HELD_OUT)
    mq_gate._ablation(ctx, d, dict(Q.HYPER), acc=1.0)
    checks = {c.name: c.passed for c in ctx.checks}
    assert checks == {"beta_zero_is_layerless": False, "ablation_worse": True}


# -- the gate catches a broken training -----------------------------------------------------------
def test_a_zero_learning_rate_fails_the_threshold_and_the_recall(monkeypatch):
    monkeypatch.setitem(Q.HYPER, "lr", 0.0)
    monkeypatch.setitem(Q.HYPER, "lr_min", 0.0)
    monkeypatch.setattr(mq_gate, "STEPS", 40)  # a learning rate of 0 learns nothing at any length
    # the CPython rerun of one step has nothing to do with the learning rate
    monkeypatch.setattr(P, "compiled_step", lambda *a, **k: None)
    ctx = GateContext(REGISTRY["kda_mqar"])
    mq_gate.kda_mqar(ctx)
    checks = {c.name: c.passed for c in ctx.checks}
    assert checks["start_loss"] and checks["rerun_fresh"] and checks["beta_zero_is_layerless"]
    assert not checks["loss_below_threshold"] and not checks["recall_accuracy"]
