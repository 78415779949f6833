"""LatentMoE PROVEN on its own task (issue 15): expert specialisation under Quantile Balancing.

The gate's figures from the published census, and the gate run in this process with its
training broken in two ways, each of which must fail by name."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BuildRun, check, gate_row

from k3gates.infra.gate import REGISTRY, GateContext
from k3gates.k3mu.ops import IntOps
from k3gates.tasks.specialise import clusters as C
from k3gates.tasks.specialise import gate as spec_gate


def run_gate() -> dict[str, bool]:
    ctx = GateContext(REGISTRY["moe_specialise"])
    spec_gate.moe_specialise(ctx)
    return {c.name: c.passed for c in ctx.checks}


# -- the published evidence -----------------------------------------------------------------------
def test_latentmoe_is_proven_on_its_task(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "latentmoe")
    assert row["level"] == "PROVEN" and not row["killed"]
    assert row["next"].startswith("top of the ladder")
    g = gate_row(built_site, "moe_specialise")
    assert g["passed"] and all(c["passed"] for c in g["checks"])
    below = check(g, "loss_below_threshold")["values"]
    assert below["threshold"] == spec_gate.MOE_THRESHOLD_BITS
    assert below["final"] < below["threshold"]
    start = check(g, "start_loss")["values"]
    assert abs(start["start"] - np.log2(C.CLASSES)) <= spec_gate.MOE_START_TOL_BITS
    loads = check(g, "loads_in_band")["values"]
    q = C.TOKENS * C.layer_moe.TOP_K // C.K
    assert loads["target"] == q and loads["band"] == spec_gate.LOAD_BAND
    assert (
        (1 - loads["band"]) * q <= loads["min_load"] <= loads["max_load"] <= (1 + loads["band"]) * q
    )
    agree = check(g, "cluster_agreement")["values"]
    assert agree["agreement"] >= 0.9 and sorted(agree["naming"]) == list(range(C.K))
    curve = check(g, "loss_curve")
    assert curve["bound"] == spec_gate.MOE_CURVE_REL_TOL and curve["measured"] <= curve["bound"]
    digests = check(g, "rerun_fresh")["digests"]
    assert len(digests) == 2 and len(set(digests.values())) == 1
    # the dense baseline is reported beside the experts, from the same build
    table = g["artifacts"]["table:run"]["rows"]
    losses = next(r for r in table if r[0].startswith("held-out bits/token"))[1]
    assert len(losses.split("; ")) == 3
    assert "dense FFN, float64" in g["artifacts"]["curve:held-out loss"]["series"]


def test_the_innovation_page_shows_the_task_curves_and_sample(built_site: BuildRun):
    text = (built_site.out / "innovations" / "latentmoe" / "index.html").read_text()
    assert "Trained on its task" in text and "moe_specialise" in text
    assert "<svg" in text and "dense FFN, float64" in text and "float64 twin" in text
    assert "held-out tokens, the trained integer model" in text


# -- the gate catches a broken training ---------------------------------------------------------
def test_agreement_is_one_under_any_naming_and_low_for_a_blind_router():
    cluster = np.repeat(np.arange(C.K), 25)
    assert C.agreement(cluster, np.array([2, 0, 3, 1])[cluster])[0] == 1.0
    assert C.agreement(cluster, np.zeros_like(cluster))[0] == 1 / C.K


def test_a_zero_learning_rate_fails_the_threshold(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(C.HYPER, "lr", 0.0)
    monkeypatch.setitem(C.HYPER, "lr_min", 0.0)
    checks = run_gate()
    assert checks["start_loss"]  # it starts where an untrained model does ...
    assert not checks["loss_below_threshold"]  # ... and stays there


class NoBalancing(IntOps):
    """Quantile Balancing switched off: the bias never moves."""

    def qb(self, p: dict, cache) -> np.ndarray:
        return p["bias"]


def test_training_without_quantile_balancing_fails_the_load_band(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(spec_gate, "IntOps", NoBalancing)
    checks = run_gate()
    assert not checks["loads_in_band"]
