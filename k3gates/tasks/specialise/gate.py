"""LatentMoE PROVEN on its own task (issue 15): expert specialisation under Quantile Balancing.

`moe_specialise` trains one LatentMoE layer in integers, beside its float64 twin and through the
shared training helper, on a task of K clusters with their own linear maps (clusters.py):
Quantile Balancing holds every expert's load near its target while the router learns to send
each cluster to its own expert. A dense FFN of the same active width is trained beside it.
"""

from __future__ import annotations

import math
import time

import numpy as np

from k3gates.infra.gate import GateContext, digest, gate
from k3gates.infra.training import check_training, start_rerun
from k3gates.k3mu.ops import KERNELS, FloatOps, IntOps

from . import clusters as C

TRAINING_KERNELS = list(KERNELS.values())  # K3-μ's kernels and Muon's

# == latentmoe PROVEN: expert specialisation under Quantile Balancing ======================
# Declared before any run of this gate. The run's length was sized from a float64 trial of the
# task (600 steps reached 0.43 bits/token).
MOE_SEED = 1
MOE_STEPS = 800
MOE_EVAL_EVERY = 40
MOE_CURVE_REL_TOL = 0.03  # integer vs float64 held-out loss, relative, at every evaluation
MOE_THRESHOLD_BITS = 0.5  # a sixth of the 3 bits/token of knowing nothing (8 classes)
MOE_START_TOL_BITS = 0.1  # the untrained model starts within 0.1 bits of log2(8)
LOAD_BAND = 0.3  # after warm-up, every expert's load within ±30% of q = m k / n at every step
AGREEMENT_MIN = 0.9  # the router's top expert is the token's cluster's, up to naming
COMPILED_TOKENS = 8  # compiled == interpreted: one step on 8 tokens (CPython is slow)


@gate(
    "moe_specialise",
    innovation="latentmoe",
    level="PROVEN",
    kernels=TRAINING_KERNELS,
    bounds={"loss_curve": MOE_CURVE_REL_TOL},
    timeout=300,
    requires=["k3block_backward"],
    exclusive=True,  # its fresh rerun takes the other core
)
def moe_specialise(ctx: GateContext) -> None:
    """A LatentMoE layer trained in integers on K = 4 clusters with their own linear maps:
    held-out loss below 0.5 bits/token, within 3% of its float64 twin, Quantile Balancing
    holding every expert's load within ±30% of its target, and each cluster routed to its own
    expert on at least 90% of held-out tokens."""
    steps, every, h = MOE_STEPS, MOE_EVAL_EVERY, dict(C.HYPER)
    rerun = start_rerun(
        ctx,
        "train_int",
        (steps, MOE_SEED, every, h),
        python_module="k3gates.tasks.specialise.clusters",
    )
    d = C.data(MOE_SEED, steps)
    t0 = time.perf_counter()
    out = C.run(IntOps(ctx.compiled), C.init(MOE_SEED), d, steps, h=h, eval_every=every)
    int_s = time.perf_counter() - t0
    twin = C.run(FloatOps(), C.twin_params(C.init(MOE_SEED)), d, steps, h=h, eval_every=every)
    dense = C.run(FloatOps(), C.twin_params(C.init(MOE_SEED, dense=True)), d, steps, h=h,
                  eval_every=every, dense=True)  # fmt: skip
    check_training(
        ctx,
        curve=np.array(out["val"]),
        twin=np.array(twin["val"]),
        threshold=MOE_THRESHOLD_BITS,
        unit="bits/token (held-out)",
        rerun=rerun,
        first=C.result_arrays(out),  # audit: a run's outputs
        start_near=(math.log2(C.CLASSES), MOE_START_TOL_BITS),
    )
    _loads(ctx, np.array(out["loads"]), h["warmup"])
    agree = out["agreement"][-1]
    ctx.check(
        "cluster_agreement",
        f"on {C.EVAL_TOKENS} held-out tokens the router's top expert is the token's cluster's "
        f"on at least {AGREEMENT_MIN:.0%} of them, under the best one-to-one naming of experts "
        "by clusters",
        agree >= AGREEMENT_MIN,
        message=f"agreement {agree:.4f} < {AGREEMENT_MIN}",
        agreement=agree,
        minimum=AGREEMENT_MIN,
        naming=list(out["perm"]),
        start=out["agreement"][0],
    )
    _compiled_step(ctx, h)
    ctx.evidence(
        f"LatentMoE trained {steps} steps in integers on {C.K} clusters: held-out "
        f"{out['val'][-1]:.3f} bits/token (float64 twin {twin['val'][-1]:.3f}, dense FFN of the "
        f"same active width {dense['val'][-1]:.3f}), accuracy {out['accuracy'][-1]:.1%}, "
        f"router-cluster agreement {agree:.1%}"
    )
    _moe_artifacts(ctx, out, twin, dense, d, int_s)


def _loads(ctx: GateContext, loads: np.ndarray, warmup: int) -> None:
    q = C.TOKENS * C.layer_moe.TOP_K // C.K
    after = loads[warmup:]
    rel = after / q
    worst = int(np.argmax(np.abs(rel - 1.0).max(axis=1)))
    ctx.check(
        "loads_in_band",
        f"after the {warmup}-step warm-up, at every one of {after.shape[0]} steps every "
        f"expert's load is within ±{LOAD_BAND:.0%} of the target q = m k / n = {q} tokens "
        "(Quantile Balancing sets the bias after each step)",
        bool(np.all(np.abs(rel - 1.0) <= LOAD_BAND)),
        message=f"step {warmup + worst + 1}: loads {after[worst].tolist()} against q = {q}",
        target=q,
        band=LOAD_BAND,
        min_load=int(after.min()),
        max_load=int(after.max()),
        steps=int(after.shape[0]),
    )


def _compiled_step(ctx: GateContext, h: dict) -> None:
    n = COMPILED_TOKENS
    t0 = time.perf_counter()
    compiled = C.train_int(1, MOE_SEED, 1, h, tokens=n, held_out=n)
    t1 = time.perf_counter()
    interpreted = C.train_int(1, MOE_SEED, 1, h, tokens=n, held_out=n, interpreted=True)
    t2 = time.perf_counter()
    ctx.check(
        "compiled_step",
        f"one whole training step on {n} tokens (forward, backward, Muon and AdamW, Quantile "
        "Balancing) and its evaluations give bit-identical results compiled and run by CPython "
        "from the same sources",
        digest(*compiled) == digest(*interpreted),
        kind="compiled",
        digests={"compiled": digest(*compiled), "interpreted": digest(*interpreted)},
        speed_ratio=(t2 - t1) / max(t1 - t0, 1e-9),
    )


def _moe_artifacts(ctx, out, twin, dense, d, int_s) -> None:
    ctx.artifact(
        "curve:held-out loss",
        {
            "x": out["eval_steps"],
            "series": {
                "integer LatentMoE": out["val"],
                "float64 twin": twin["val"],
                "dense FFN, float64": dense["val"],
            },
            "threshold": MOE_THRESHOLD_BITS,
            "xlabel": "step",
            "ylabel": "bits/token (held-out)",
        },
    )
    loads = np.array(out["loads"])
    rows = [
        ["task", f"{C.K} clusters, {C.CLASSES} classes, width {C.D}, map rank {C.R}"],
        ["steps; tokens per step", f"{len(out['train'])}; {C.TOKENS}"],
        ["held-out bits/token (integer; float64 twin; dense FFN)",
         f"{out['val'][-1]:.4f}; {twin['val'][-1]:.4f}; {dense['val'][-1]:.4f}"],
        ["held-out accuracy (integer; float64 twin; dense FFN)",
         f"{out['accuracy'][-1]:.1%}; {twin['accuracy'][-1]:.1%}; {dense['accuracy'][-1]:.1%}"],
        ["router-cluster agreement (start; end)",
         f"{out['agreement'][0]:.1%}; {out['agreement'][-1]:.1%}"],
        ["expert loads after warm-up (min; max; target)",
         f"{loads[C.HYPER['warmup']:].min()}; {loads[C.HYPER['warmup']:].max()}; "
         f"{C.TOKENS * C.layer_moe.TOP_K // C.K}"],
        ["dense FFN hidden width (= top-k × expert hidden + shared hidden)", C.DENSE_HIDDEN],
        ["integer training, tokens/s", f"{len(out['train']) * C.TOKENS / int_s:,.0f}"],
    ]  # fmt: skip
    ctx.artifact("table:run", {"columns": ["", "value"], "rows": rows})
    ev = d["eval"]
    pick = [int(i) for c in range(C.K) for i in np.flatnonzero(ev["cluster"] == c)[:2]]
    sample_rows = [
        [i, int(ev["cluster"][i]), int(out["expert"][i]), int(ev["label"][i]),
         int(out["pred"][i])]
        for i in pick
    ]  # fmt: skip
    ctx.artifact(
        "table:sample (held-out tokens, the trained integer model)",
        {
            "columns": ["token", "cluster", "top expert", "label", "predicted"],
            "rows": sample_rows,
        },
    )
