"""The K3 block's backward pass, proven on K3-μ (issue 14, STRONG).

K3-μ is K3's layer flow at toy size (model.py): KDA, KDA, KDA, Gated MLA with Block AttnRes on
the residual path and a LatentMoE FFN after each attention. `k3block_backward` runs its forward
and backward in integers and holds every parameter's gradient against the float64 twin (the same
model on each component's reference.py, same weights and tokens), and the twin itself against
finite differences of its own loss.
"""

from __future__ import annotations

import time

import numpy as np

from k3gates import fresh
from k3gates.gate import THREAD_COUNTS, GateContext, digest, gate

from . import corpus
from .model import GRAD_FRAC, Config, backward, dequantize_params, forward, initial, windows
from .ops import KERNELS, FloatOps, IntOps

SEED = 1
SHAPE = {"batch": 2, "context": 16}  # two sequences of 16 characters at K3-μ's full width
TINY = {"batch": 1, "context": 4}  # compiled == interpreted: the interpreted model is slow
STARTS = (1000, 50_000)  # where the two training windows start
FD_PICKS = 3  # finite differences: entries per parameter tensor
FD_STEP = 1e-5
# Declared before any run. The twin's gradient against central differences of its own loss,
# relative to each tensor's gradient RMS: float64 with h = 1e-5 leaves ~1e-9, so 1e-4 can only
# fail on a wrong derivative.
FD_REL_TOL = 1e-4
# The integer gradients against the twin's, max |difference| over each tensor relative to its
# RMS: a declared tolerance (each stage is within ~1e-5 of its output's RMS, by its component's
# bound; these compound over 4 layers and 26 stages): 2%.
E2E_REL_TOL = 0.02
LOSS_REL_TOL = 1e-4  # the integer summed loss against the twin's, relative
BACKWARD_KERNELS = [KERNELS[k] for k in ("glue", "kda", "mla", "moe")]


def _cfg(**shape: int) -> Config:
    _text, vocab = corpus.load()
    return Config(vocab=len(vocab), **shape)


def _tokens(cfg: Config, starts: tuple[int, ...]) -> np.ndarray:
    text, vocab = corpus.load()
    ids = corpus.encode(text, vocab)
    return windows(ids, np.array(starts[: cfg.batch], dtype=np.int64), cfg.context)


def block_gradients(shape: dict, starts: tuple[int, ...], interpreted: bool = False) -> tuple:
    """Every integer gradient (name order) and the summed loss of K3-μ at `shape` on the windows
    at `starts`: one call, so a fresh process can rerun it (k3gates.fresh)."""
    from k3gates import compile as kcompile

    cfg = _cfg(**shape)
    ops = IntOps(kcompile.interpreted if interpreted else kcompile.load)
    params = initial(cfg, SEED)
    rec = forward(ops, params, cfg, _tokens(cfg, starts))
    grads = backward(ops, params, cfg, rec)
    return (np.array([rec["loss_q"]], dtype=np.int64), *[grads[k] for k in sorted(grads)])


@gate(
    "k3block_backward",
    innovation="k3block",
    level="STRONG",
    kernels=BACKWARD_KERNELS,
    bounds={"end_to_end": E2E_REL_TOL, "fd_twin": FD_REL_TOL, "loss": LOSS_REL_TOL},
    timeout=600,
)
def k3block_backward(ctx: GateContext) -> None:
    """K3-μ's block backward in integers: every gradient through KDA, Gated MLA, AttnRes, the
    LatentMoE FFN, the norms, the head and the embedding within 2% of its RMS of the float64
    twin's, the twin within 1e-4 of finite differences, bit-identical across thread counts."""
    cfg = _cfg(**SHAPE)
    tokens = _tokens(cfg, STARTS)
    params = initial(cfg, SEED)
    iops = IntOps(ctx.compiled)
    rec = forward(iops, params, cfg, tokens)
    g_int = backward(iops, params, cfg, rec)
    real = dequantize_params(params)
    fops = FloatOps()
    frec = forward(fops, real, cfg, tokens)
    g_flt = backward(fops, real, cfg, frec)
    ctx.check_reference(
        "loss",
        f"the integer model's summed cross-entropy over {rec['tokens']} characters is within "
        f"{LOSS_REL_TOL:g} (relative) of the float64 twin's",
        np.array([rec["loss"] / frec["loss"]]),
        np.ones(1),
        unit="integer / float64 loss",
        integer_nats=rec["loss"],
        float64_nats=frec["loss"],
    )
    _end_to_end(ctx, g_int, g_flt)
    _finite_differences(ctx, fops, real, cfg, tokens, g_flt)
    trained = sorted(g_flt)
    silent = [k for k in trained if not np.any(g_int[k])]
    ctx.check(
        "every_parameter_reached",
        f"the backward reaches every one of the {len(trained)} trained tensors (each has a "
        "nonzero integer gradient) and only those: the QB biases and fixed KDA decay rates get "
        "none",
        not silent and set(g_int) == set(trained) == {k for k in params if _trained(k)},
        message=f"no gradient reaches {silent}" if silent else "trained set differs",
        tensors=len(trained),
    )
    # this run's result, in block_gradients' form, so the reruns below are held to it
    here = (np.array([rec["loss_q"]], dtype=np.int64), *[g_int[k] for k in sorted(g_int)])
    swapped = block_gradients(SHAPE, STARTS[::-1])
    ctx.check(
        "batch_order",
        "the two sequences in the other order give bit-identical gradients and loss (every sum "
        "over tokens is an exact integer sum)",
        digest(*here) == digest(*swapped),
        kind="deterministic",
        digests={"in order": digest(*here), "swapped": digest(*swapped)},
    )
    runs = {"this process": digest(*here)}
    for n in THREAD_COUNTS:
        runs[f"fresh process, OMP_NUM_THREADS={n}"] = fresh.run_digest(
            "k3gates.k3mu.gate", "block_gradients", (SHAPE, STARTS), threads=n, python=True
        )
    ctx.check_digests(
        "threads",
        "the whole forward and backward in fresh processes with 1 and 2 OpenMP threads gives "
        "bit-identical gradients",
        runs,
    )
    t0 = time.perf_counter()
    compiled = block_gradients(TINY, STARTS)
    t1 = time.perf_counter()
    interpreted = block_gradients(TINY, STARTS, interpreted=True)
    t2 = time.perf_counter()
    ctx.check(
        "compiled_block",
        "the compiled kernels and the same sources run by CPython give bit-identical gradients "
        f"of the whole model ({TINY['batch']} sequence of {TINY['context']} characters)",
        digest(*compiled) == digest(*interpreted),
        kind="compiled",
        digests={"compiled": digest(*compiled), "interpreted": digest(*interpreted)},
        speed_ratio=(t2 - t1) / max(t1 - t0, 1e-9),
    )
    worst = max(trained, key=lambda k: _rel(g_int[k], g_flt[k]))
    ctx.evidence(
        f"K3-μ (3 KDA + 1 Gated MLA, LatentMoE, AttnRes; d={cfg.d}): all {len(trained)} "
        f"integer gradients within {_rel(g_int[worst], g_flt[worst]):.2g} of their RMS of "
        f"float64 (worst {worst})"
    )


def _trained(name: str) -> bool:
    return not name.endswith((".bias", ".a_head"))


def _rel(gi: np.ndarray, gf: np.ndarray) -> float:
    rms = float(np.sqrt(np.mean(gf * gf))) or 1.0
    return float(np.abs(gi.astype(np.float64) * 2.0**-GRAD_FRAC - gf).max()) / rms


def _end_to_end(ctx: GateContext, g_int: dict, g_flt: dict) -> None:
    got, want = [], []
    for name in sorted(g_flt):
        w = g_flt[name]
        rms = float(np.sqrt(np.mean(w * w))) or 1.0
        got.append(g_int[name].astype(np.float64).ravel() * 2.0**-GRAD_FRAC / rms)
        want.append(w.ravel() / rms)
    ctx.check_reference(
        "end_to_end",
        f"each of the {len(want)} parameter gradients of the integer model is within "
        f"{E2E_REL_TOL:g} of its RMS of the float64 twin's on the same weights and tokens",
        np.concatenate(got),
        np.concatenate(want),
        unit="gradient RMS",
    )


def _finite_differences(ctx, fops, real, cfg, tokens, g_flt) -> None:
    rng = np.random.default_rng(SEED)
    got, want = [], []
    for name in sorted(g_flt):
        g = g_flt[name]
        rms = float(np.sqrt(np.mean(g * g))) or 1.0
        for flat in rng.choice(g.size, size=min(FD_PICKS, g.size), replace=False):
            i = np.unravel_index(int(flat), g.shape)
            w0 = real[name][i]
            real[name][i] = w0 + FD_STEP
            up = forward(fops, real, cfg, tokens, grad=False)["loss"]
            real[name][i] = w0 - FD_STEP
            down = forward(fops, real, cfg, tokens, grad=False)["loss"]
            real[name][i] = w0
            got.append((up - down) / (2 * FD_STEP) / rms)
            want.append(g[i] / rms)
    ctx.check_reference(
        "fd_twin",
        f"the float64 twin's gradient equals central finite differences of its own loss at "
        f"{len(want)} entries, {FD_PICKS} in each parameter tensor (relative to its RMS)",
        np.array(got),
        np.array(want),
        unit="gradient RMS",
    )
