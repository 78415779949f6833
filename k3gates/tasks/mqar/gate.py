"""KDA PROVEN on its own task (issue 15): multi-query associative recall (MQAR).

`kda_mqar` trains a one-KDA-layer model in integers on MQAR (task.py: 16 key-value pairs, then 48
queries, 128 tokens, a vocabulary of 64), beside its float64 twin and through the shared training
helper, and holds it to 95% of the held-out queries. The ablation fixes beta at 0 at equal steps.
The decay's input projection W_f stays at its initial value (task.py says why).
"""

from __future__ import annotations

import numpy as np

from k3gates.infra.gate import GateContext, digest, gate
from k3gates.k3mu.ops import KERNELS, IntOps
from k3gates.tasks import proof as P
from k3gates.tasks import seq as S

from . import task as Q

# The bounds below were declared before any run of this gate and never moved. The run's length
# was not: a first version trained 550 steps with W_f trained and failed loss_curve (30%) on a
# run two float64 runs 1e-6 apart could not agree on (task.py). With W_f fixed, over 550 steps
# the integer run held within 0.5% of its twin down to 0.063 bits/query (step 300), then left it
# by up to 17% below 0.05 bits, where two float64 runs 1e-6 apart also part (1.3% at step 450).
# The run stops at 350 steps, before that regime; the integer model's fidelity at losses below
# 0.05 bits/query is open (issue 15's closing note).
SEED = 1
STEPS = 350
EVAL_EVERY = 25
CURVE_REL_TOL = 0.03  # integer vs float64 held-out loss, relative, at every evaluation
THRESHOLD_BITS = 0.5  # a twelfth of the 6 bits/query of knowing nothing (64 tokens)
START_TOL_BITS = 0.1  # the untrained model starts within 0.1 bits of log2(64)
ACCURACY_MIN = 0.95  # held-out query accuracy (the bar)
ABLATION_MARGIN = 0.10  # beta = 0 must end at least 10 accuracy points lower
EQUIVALENCE_STEPS = 3  # the beta = 0 model against the layerless model, bit for bit
TINY = slice(24, 40)  # compiled == interpreted: 16 tokens of one sequence, 4 of them queries


@gate(
    "kda_mqar",
    innovation="kda",
    level="PROVEN",
    kernels=list(KERNELS.values()),
    bounds={"loss_curve": CURVE_REL_TOL},
    # 119 s alone; beside another gate and its own fresh rerun a build has seen it pass 300 s
    timeout=600,
    requires=["k3block_backward"],
    exclusive=True,  # its fresh rerun takes the other core
)
def kda_mqar(ctx: GateContext) -> None:
    """One KDA layer trained in integers recalls at least 95% of MQAR's held-out queries.

    MQAR here: 16 pairs, 128 tokens, vocabulary 64; W_f stays at its initial value. The loss
    ends below 0.5 bits/query, within 3% of its float64 twin at every evaluation, bit-identical
    in a fresh process; with beta fixed at 0, at equal steps, it is at least 10 points worse."""
    d = P.task_data(Q, SEED, STEPS)
    # before the training: a wrong kernel is caught in seconds, not after the whole run
    P.compiled_step(ctx, Q, d, seed=SEED, tiny=TINY, variants=(IntOps,))
    d, out, twin, int_s = P.train_beside_twin(
        ctx, Q, steps=STEPS, seed=SEED, eval_every=EVAL_EVERY, threshold=THRESHOLD_BITS,
        start_tol=START_TOL_BITS, unit="bits/query (held-out)", data=d,
    )  # fmt: skip
    acc = P.check_accuracy(ctx, "recall_accuracy", "queries", out, d["eval"], ACCURACY_MIN)
    h = dict(Q.HYPER)
    ablation = _ablation(ctx, d, h, acc)
    ctx.evidence(
        f"One KDA layer trained {STEPS} steps in integers on MQAR ({Q.PAIRS} pairs, "
        f"{Q.CONTEXT} tokens): {acc:.1%} of held-out queries, {out['val'][-1]:.3f} bits/query "
        f"(float64 twin {twin['val'][-1]:.3f}); beta fixed at 0: {ablation['accuracy'][-1]:.1%}"
    )
    _artifacts(ctx, out, twin, ablation, d, int_s)


def _ablation(ctx: GateContext, d: dict, h: dict, acc: float) -> dict:
    """beta = 0 at equal steps. It is first shown to be the layerless model bit for bit over
    EQUIVALENCE_STEPS steps (same losses, same embedding, head and norm), then the layerless
    model, which costs no KDA work, is trained for the full run."""
    few = d["train"][:EQUIVALENCE_STEPS]
    zero = S.run(Q.beta_zero_ops(ctx.compiled), S.init(Q.CONFIG, SEED), Q.CONFIG, few,
                 d["eval"], EQUIVALENCE_STEPS, h, 1, Q.FIXED)  # fmt: skip
    bare = S.run(IntOps(ctx.compiled), S.init(Q.NO_LAYER, SEED), Q.NO_LAYER, few, d["eval"],
                 EQUIVALENCE_STEPS, h, 1)  # fmt: skip
    shared = sorted(bare["params"])
    a = (np.array(zero["val"] + zero["train"]), *[zero["params"][k] for k in shared])
    b = (np.array(bare["val"] + bare["train"]), *[bare["params"][k] for k in shared])
    start = S.init(Q.CONFIG, SEED)
    moved = [k for k in zero["params"] if k.startswith("0.")
             and not np.array_equal(zero["params"][k], start[k])]  # fmt: skip
    ctx.check(
        "beta_zero_is_layerless",
        f"with beta fixed at 0 the KDA layer adds exactly 0 and learns nothing: over "
        f"{EQUIVALENCE_STEPS} training steps its losses, embedding, head and norm equal the "
        "model without the layer bit for bit, and none of its weights moves",
        digest(*a) == digest(*b) and not moved,
        message=f"differs from the layerless model, or these moved: {moved}",
        kind="deterministic",
        digests={"beta = 0": digest(*a), "no layer": digest(*b)},
    )
    ablation = S.run(IntOps(ctx.compiled), S.init(Q.NO_LAYER, SEED), Q.NO_LAYER, d["train"],
                     d["eval"], STEPS, h, EVAL_EVERY)  # fmt: skip
    worse = ablation["accuracy"][-1]
    ctx.check(
        "ablation_worse",
        f"at equal steps the model with beta fixed at 0 answers at least "
        f"{ABLATION_MARGIN:.0%} fewer held-out queries (no delta-rule write, no recall)",
        worse <= acc - ABLATION_MARGIN,
        message=f"beta = 0 reaches {worse:.4f}, within {ABLATION_MARGIN} of {acc:.4f}",
        accuracy=acc,
        ablation_accuracy=worse,
        margin=ABLATION_MARGIN,
    )
    return ablation


def _artifacts(ctx, out, twin, ablation, d, int_s) -> None:
    ctx.artifact(
        "curve:held-out loss",
        {
            "x": out["eval_steps"],
            "series": {
                "integer KDA": out["val"],
                "float64 twin": twin["val"],
                "beta fixed at 0 (integer)": ablation["val"],
            },
            "threshold": THRESHOLD_BITS,
            "xlabel": "step",
            "ylabel": "bits/query (held-out)",
        },
    )
    tokens = STEPS * Q.BATCH * Q.CONTEXT
    rows = [
        ["task", f"{Q.PAIRS} key-value pairs then {Q.QUERIES} queries, {Q.CONTEXT} tokens, "
                 f"vocabulary {Q.VOCAB}"],
        ["steps; sequences per step", f"{STEPS}; {Q.BATCH}"],
        ["held-out query accuracy (integer; float64 twin; beta fixed at 0)",
         f"{out['accuracy'][-1]:.1%}; {twin['accuracy'][-1]:.1%}; "
         f"{ablation['accuracy'][-1]:.1%}"],
        ["held-out bits/query (integer; float64 twin; beta fixed at 0)",
         f"{out['val'][-1]:.4f}; {twin['val'][-1]:.4f}; {ablation['val'][-1]:.4f}"],
        ["integer training, tokens/s", f"{tokens / int_s:,.0f}"],
    ]  # fmt: skip
    ctx.artifact("table:run", {"columns": ["", "value"], "rows": rows})
    ctx.artifact("table:published MQAR accuracy (float), beside this run", _anchor(out))
    tok, tgt = d["eval"]
    q = np.flatnonzero(tgt[0] >= 0)[:8]
    pairs = " ".join(f"{tok[0, 2 * i]}→{tok[0, 2 * i + 1]}" for i in range(Q.PAIRS))
    rows = [[pairs if j == 0 else "", int(tok[0, p]), int(tgt[0, p]), int(out["pred"][j])]
            for j, p in enumerate(q)]  # fmt: skip
    ctx.artifact(
        "table:sample (the first held-out sequence, its first 8 queries)",
        {"columns": ["pairs shown", "query key", "value", "predicted"], "rows": rows},
    )


# Zoology (Arora et al. 2023, arXiv 2312.04927), Figure 2, the panel "Sequence Length: 128":
# 8 key-value pairs, a vocabulary of 8192, model width 64; accuracies read off the published
# plot (HazyResearch/zoology, assets/figure2.png) to the nearest 0.05, not published as numbers.
ZOOLOGY_FIG2_SEQ128_D64 = {
    "attention": 0.98,
    "BaseConv": 0.37,
    "H3": 0.25,
    "Hyena": 0.20,
    "RWKV (a gated linear recurrence)": 0.18,
}


def _anchor(out: dict) -> dict:
    setting = "128 tokens, 8 pairs, vocabulary 8192, width 64 (float, read off Zoology Fig. 2)"
    rows = [[name, setting, f"{acc:.2f}"] for name, acc in ZOOLOGY_FIG2_SEQ128_D64.items()]
    rows.append(
        ["KDA, one layer (this build, integers)",
         f"{Q.CONTEXT} tokens, {Q.PAIRS} pairs, vocabulary {Q.VOCAB}, width {Q.CONFIG.d}",
         f"{out['accuracy'][-1]:.2f}"]
    )  # fmt: skip
    return {"columns": ["model", "setting", "query accuracy"], "rows": rows}
