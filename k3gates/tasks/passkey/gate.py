"""1M context PROVEN on its own task (issue 15): passkey retrieval, trained in integers.

`passkey_retrieval` trains a KDA layer and a Gated MLA layer (task.py says why not three KDA
layers, why one KDA head and why width 24) in integers on passkey retrieval (task.py), on a
curriculum that ends at 2^12 filler tokens, beside its float64 twin and through the shared
training helper; holds the exact-match accuracy at the trained length to 95%; then evaluates the
trained model, without further training, at 2^12, 2^14 and 2^16 filler tokens with the passkey
at five depths, and holds 2^16 to the accuracy declared below. The MLA layer's queries run at
the answer rows only (mla/kernels_train's with t0 = T - 5); the gate holds that run to the same
kernel's run at every row, bit for bit, and to float64 at 2^16 tokens.
"""

from __future__ import annotations

import time

import numpy as np

from k3gates.infra.gate import GateContext, digest, gate
from k3gates.k3mu.ops import KERNELS
from k3gates.mla import kernels_train as KM
from k3gates.mla import layer_train as layer_mla
from k3gates.mla import reference_train as reference_mla
from k3gates.tasks import proof as P
from k3gates.tasks import seq as S

from . import task as T

# Declared before any run of this gate.
SEED = 1
CURVE_REL_TOL = 0.03  # integer vs float64 held-out loss, relative, at every evaluation
THRESHOLD_BITS = 0.3  # a tenth of log2(10) = 3.3 bits/digit, the guess among the digits
# the start: the helper's at least 10x the threshold (the fixed head starts the model near 10
# bits/digit, above log2(vocabulary), so "within 0.2 bits of log2(vocabulary)" does not apply)
START_TOL_BITS = None
ACCURACY_MIN = 0.95  # exact-match passkeys at the trained length (the bar)
# At 2^16 filler tokens, 16x the trained length, never trained on: stated before the gate's
# first run, from integer trials of the same curriculum at seed 7 (6 of 6 passkeys at 2^16 with
# three KDA layers, 20 of 20 with one), with room for another seed.
ACCURACY_2_16_MIN = 0.75
LENGTHS = (1 << 12, 1 << 14, 1 << 16)  # filler tokens; 2^12 is the trained length
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the passkey sits, as a fraction of the filler
PER_CELL = {1 << 12: 8, 1 << 14: 4, 1 << 16: 4}  # passkeys per (length, depth)
# compiled == interpreted: the last 12 tokens of a first-phase sequence
TINY = slice(T.context(T.PHASES[0][1]) - 12, T.context(T.PHASES[0][1]))
EQUAL_T = 96  # the answer rows alone == every row, on held-out sequences cut this long
MLA_2_16 = "mla_rows_2_16"


@gate(
    "passkey_retrieval",
    innovation="longctx",
    level="PROVEN",
    kernels=list(KERNELS.values()),
    bounds={
        "loss_curve": CURVE_REL_TOL,
        MLA_2_16: KM.forward_max_err_lsb(T.context(LENGTHS[-1])),
    },
    timeout=400,
    requires=["longctx_kda_backward", "k3block_backward"],
    exclusive=True,
)
def passkey_retrieval(ctx: GateContext) -> None:
    """A KDA layer and a Gated MLA layer trained in integers on passkey retrieval retrieve at
    least 95% of held-out passkeys at their trained length, 2^12 filler tokens, and at least 75%
    at 2^16 without training there.

    The loss ends below 0.3 bits/digit, within 3% of its float64 twin at every evaluation,
    bit-identical in a fresh process; the MLA layer run at the answer rows alone equals the
    same layer run at every row, bit for bit, and float64 at 2^16 tokens within its bound."""
    d = P.task_data(T, SEED, T.STEPS)
    # before the training: a wrong kernel is caught in seconds, not after the whole run
    P.compiled_step(ctx, T, d, seed=SEED, tiny=TINY, variants=(T.RowsInt,))
    _, out, twin, int_s = P.train_beside_twin(
        ctx, T, steps=T.STEPS, seed=SEED, eval_every=T.EVAL_AT, threshold=THRESHOLD_BITS,
        start_tol=START_TOL_BITS, unit="bits/digit (held-out, at the phase's length)", data=d,
        ops=(T.RowsInt, T.RowsFloat),
    )  # fmt: skip
    ops = T.RowsInt(ctx.compiled)
    p = out["params"]
    t0 = time.perf_counter()
    grid = _grid(ops, p)
    grid_s = time.perf_counter() - t0
    trained = grid[LENGTHS[0]]
    acc = float(np.mean(np.concatenate(trained)))
    ctx.check(
        "passkey_accuracy",
        f"at the trained length ({LENGTHS[0]:,} filler tokens) the trained integer model "
        f"retrieves at least {ACCURACY_MIN:.0%} of {sum(map(len, trained))} held-out passkeys "
        f"({PER_CELL[LENGTHS[0]]} at each of {len(DEPTHS)} depths), every digit right",
        acc >= ACCURACY_MIN,
        message=f"exact-match accuracy {acc:.4f} < {ACCURACY_MIN}",
        accuracy=acc,
        minimum=ACCURACY_MIN,
    )
    far = float(np.mean(np.concatenate(grid[LENGTHS[-1]])))
    ctx.check(
        "accuracy_2_16",
        f"at {LENGTHS[-1]:,} filler tokens, 16× the trained length and never trained on, the "
        f"model retrieves at least {ACCURACY_2_16_MIN:.0%} of the passkeys (declared before the "
        "run)",
        far >= ACCURACY_2_16_MIN,
        message=f"exact-match accuracy {far:.4f} < {ACCURACY_2_16_MIN}",
        accuracy=far,
        minimum=ACCURACY_2_16_MIN,
        per_depth={
            f"{dep:g}": float(np.mean(c)) for dep, c in zip(DEPTHS, grid[LENGTHS[-1]], strict=True)
        },
    )
    _rows_equal_full(ctx, ops, p, d)
    _rows_against_float(ctx, ops, p)
    ctx.evidence(
        f"A KDA layer ({T.CONFIG.kda_heads} head) and a Gated MLA layer (d = {T.CONFIG.d}), "
        f"trained {T.STEPS} "
        f"steps in integers on passkey retrieval: {acc:.0%} of passkeys at {LENGTHS[0]:,} "
        "filler tokens, "
        + ", ".join(f"{np.mean(np.concatenate(grid[n])):.0%} at {n:,}" for n in LENGTHS[1:])
        + f"; held-out loss {out['val'][-1]:.3f} bits/digit (float64 twin {twin['val'][-1]:.3f})"
    )
    _artifacts(ctx, d, out, twin, grid, int_s, grid_s)


def _grid(ops, p: dict) -> dict[int, list[np.ndarray]]:
    """Per length, per depth: which held-out passkeys the trained model retrieves (exact
    match), two sequences per call (one per core)."""
    grid: dict[int, list[np.ndarray]] = {}
    for i, n in enumerate(LENGTHS):
        grid[n] = []
        for j, depth in enumerate(DEPTHS):
            rng = np.random.default_rng([SEED, 2, i, j])
            hits = []
            for _ in range(PER_CELL[n] // 2):
                tokens, targets = T.sequences(rng, 2, n, depth)
                rec = S.forward(ops, p, T.CONFIG, tokens, targets, grad=False)
                pred = S.predictions(ops, p, rec)
                hits.append(T.exact_match(pred, rec["want"]))
            grid[n].append(np.concatenate(hits))
    return grid


def _rows_equal_full(ctx: GateContext, ops, p: dict, d: dict) -> None:
    """The MLA layer run at the answer rows alone against the same layer at every row, on the
    trained MLA layer's input of two held-out sequences cut to EQUAL_T tokens: y at the answer
    rows, and dx and every weight gradient with dy = 0 above them, bit for bit."""
    tokens, targets = (a[:2, -EQUAL_T:] for a in d["held_out"][T.TRAINED])
    x = _mla_input(ops, p, tokens, targets)
    w = _mla_weights(p)
    mla = ctx.compiled(KERNELS["mla"])
    t0 = EQUAL_T - T.ANSWER
    y, cache = layer_mla.forward(mla, x, w, t0)
    y_full, cache_full = layer_mla.forward(mla, x, w)
    rng = np.random.default_rng([SEED, 3])
    dy = np.zeros_like(x)
    dy[:, t0:] = rng.integers(-(1 << 24), 1 << 24, dy[:, t0:].shape)
    dx, g = layer_mla.backward(mla, dy, x, w, cache)
    dx_full, g_full = layer_mla.backward(mla, dy, x, w, cache_full)
    same = [np.array_equal(y[:, t0:], y_full[:, t0:]), not y[:, :t0].any(),
            np.array_equal(dx, dx_full)] + [np.array_equal(g[k], g_full[k]) for k in g]  # fmt: skip
    ctx.check(
        "rows_equal_full",
        f"the MLA layer run at the {T.ANSWER} answer rows only equals the same layer run at every "
        f"row, on the trained layer and two {EQUAL_T}-token held-out sequences: y at those rows, "
        "and dx and every weight gradient for a loss on them, bit for bit",
        all(same),
        message=f"{same.count(False)} of {len(same)} arrays differ",
        kind="deterministic",
        digests={"answer rows: y, dx, grads": digest(y[:, t0:], dx, *g.values()),
                 "every row: y, dx, grads": digest(y_full[:, t0:], dx_full, *g_full.values())},
    )  # fmt: skip


def _mla_input(ops, p: dict, tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The trained model's MLA layer input (RMSNorm of the residual after the KDA layer),
    [B, T, d] Q.16."""
    rec = S.forward(ops, p, T.CONFIG, tokens, targets, grad=False)
    b, t = tokens.shape
    return np.ascontiguousarray(rec["tape"][T.MLA][1].reshape(b, t, -1))


def _mla_weights(p: dict) -> dict:
    prefix = f"{T.MLA}.attn."
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


def _rows_against_float(ctx: GateContext, ops, p: dict) -> None:
    """The trained MLA layer at 2^16 filler tokens against float64 on the same integer input."""
    tokens, targets = T.sequences(np.random.default_rng([SEED, 4]), 1, LENGTHS[-1], 0.5)
    x = _mla_input(ops, p, tokens, targets)
    w = _mla_weights(p)
    t0 = tokens.shape[1] - T.ANSWER
    y, _ = layer_mla.forward(ctx.compiled(KERNELS["mla"]), x, w, t0)
    wf = S.twin_params({k: v for k, v in w.items()})
    y_ref, _ = reference_mla.forward(x * 2.0**-16, wf, t0)
    ctx.check_reference(
        MLA_2_16,
        f"the trained MLA layer's output at the answer rows, attending over "
        f"{tokens.shape[1]:,} keys, against float64 on the same integer input (bound: the "
        "softmax's 1/2 LSB per key summed over the keys, mla.kernels_train.forward_max_err_lsb)",
        y[:, t0:],
        y_ref[:, t0:] * 2.0**16,
        unit="Q.16 LSB",
    )


def _artifacts(ctx, d, out, twin, grid, int_s, grid_s) -> None:
    ctx.artifact(
        "curve:held-out loss at each phase's length",
        {
            "x": out["eval_steps"],
            "series": {"integer": out["val"], "float64 twin": twin["val"]},
            "threshold": THRESHOLD_BITS,
            "xlabel": "step",
            "ylabel": "bits/digit (held-out, at the phase's filler length)",
        },
    )
    ctx.artifact(
        "heatmap:passkeys retrieved, by context length and depth",
        {
            "columns": [f"{n:,}" for n in LENGTHS],
            "rows": [f"{dep:.0%}" for dep in DEPTHS],
            "values": [[float(np.mean(grid[n][j])) for n in LENGTHS] for j in range(len(DEPTHS))],
            "counts": [[int(grid[n][j].size) for n in LENGTHS] for j in range(len(DEPTHS))],
            "xlabel": "filler tokens (trained at 4,096)",
            "ylabel": "passkey depth",
            "caption": "each cell is the share of its held-out passkeys the trained integer model "
            "retrieves, every digit right (red 0%, green 100%)",
        },
    )
    tokens = sum(n * b * T.context(f) for n, f, b in T.PHASES)
    rows = [
        ["task", f"{T.DIGITS} distinct digits hidden in Shakespeare, asked for at the end"],
        ["prompt (the first tokens of every sequence)", "Find"],
        ["curriculum (steps × sequences at filler tokens)",
         ", ".join(f"{n} × {b} at {f:,}" for n, f, b in T.PHASES)],
        ["learning rate per phase (peak → end)",
         ", ".join(f"{lr:g} → {lr_min:g}" for _, lr, lr_min in T.HYPER["cycles"])],
        ["model", f"embedding + previous-token embedding, KDA ({T.CONFIG.kda_heads} head), "
                  f"Gated MLA, fixed head, d = {T.CONFIG.d}, vocabulary {T.VOCAB}"],
        ["exact-match passkeys, by length",
         "; ".join(f"{np.mean(np.concatenate(grid[n])):.0%} at {n:,}" for n in LENGTHS)],
        ["held-out bits/digit (integer; float64 twin)",
         f"{out['val'][-1]:.4f}; {twin['val'][-1]:.4f}"],
        ["integer training, tokens/s", f"{tokens / int_s:,.0f}"],
        ["evaluation of the grid, seconds", f"{grid_s:.1f}"],
    ]  # fmt: skip
    ctx.artifact("table:run", {"columns": ["", "value"], "rows": rows})
    tokens, targets = d["held_out"][T.TRAINED]
    sample = tokens[0]
    at = int(np.flatnonzero(sample == T.KEY)[0])
    ctx.artifact(
        "table:sample (one held-out sequence)",
        {
            "columns": ["", "value"],
            "rows": [
                ["length; passkey at token", f"{sample.size:,}; {at:,}"],
                ["passkey", " ".join(str(int(t) - T.FIRST_DIGIT) for t in targets[0][-T.ANSWER :])],
                ["answered (integer model)",
                 " ".join(str(int(t) - T.FIRST_DIGIT) for t in out["pred"][: T.ANSWER])],
            ],
        },
    )  # fmt: skip
