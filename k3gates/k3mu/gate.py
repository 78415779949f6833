"""The K3 block's training rungs, proven on K3-μ (issue 14).

K3-μ is K3's layer flow at toy size (model.py): KDA, KDA, KDA, Gated MLA with Block AttnRes on
the residual path and a LatentMoE FFN after each attention.

- STRONG `k3block_backward` runs its forward and backward in integers and holds every parameter's
  gradient against the float64 twin (the same model on each component's reference.py, same
  weights and tokens), and the twin itself against finite differences of its own loss.
- PROVEN `k3mu_training` trains it from scratch on Shakespeare in integers beside the float64
  twin (same initial weights, batches, schedule and optimisers), through the shared training
  helper.
- `k3mu_replay` verifies the committed long run without re-training it. It stands at STRONG:
  PROVEN is earned only by training in the build, through the shared training helper.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time

import numpy as np

from k3gates.infra import fresh
from k3gates.infra.gate import THREAD_COUNTS, GateContext, digest, gate
from k3gates.infra.training import check_training, start_rerun

from . import cli, corpus
from . import train as T
from .checks import check_compiled_run
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
BACKWARD_KERNELS = [KERNELS["glue"], KERNELS["kda"], KERNELS["mla"], KERNELS["moe"]]


def _cfg(**shape: int) -> Config:
    _text, vocab = corpus.load()
    return Config(vocab=len(vocab), **shape)


def _tokens(cfg: Config, starts: tuple[int, ...]) -> np.ndarray:
    text, vocab = corpus.load()
    ids = corpus.encode(text, vocab)
    return windows(ids, np.array(starts[: cfg.batch], dtype=np.int64), cfg.context)


def block_gradients(shape: dict, starts: tuple[int, ...], interpreted: bool = False) -> tuple:
    """Every integer gradient (name order) and the summed loss of K3-μ at `shape` on the windows
    at `starts`: one call, so a fresh process can rerun it (k3gates.infra.fresh)."""
    from k3gates.infra import compile as kcompile

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
    check_compiled_run(
        ctx,
        "compiled_block",
        "the compiled kernels and the same sources run by CPython give bit-identical gradients "
        f"of the whole model ({TINY['batch']} sequence of {TINY['context']} characters)",
        functools.partial(block_gradients, TINY, STARTS),
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


# == PROVEN: training ===========================================================================
# The tolerance and the threshold were declared before any run. The run's length was sized to
# the 5-minute budget from a 120-step trial of both sides (validation 3.27 bits/char).
TRAIN_STEPS = 100
EVAL_EVERY = 10
CURVE_REL_TOL = 0.03  # integer vs float64 validation loss, relative, at every evaluation
TRAINING_KERNELS = list(KERNELS.values())  # the model's kernels and Muon's
NARROW = {"d": 16, "batch": 1, "context": 4}  # compiled == interpreted: Muon runs slowly in CPython


@gate(
    "k3mu_training",
    innovation="k3block",
    level="PROVEN",
    kernels=TRAINING_KERNELS,
    bounds={"loss_curve": CURVE_REL_TOL},
    timeout=900,
    requires=["k3block_backward"],
    exclusive=True,  # its fresh rerun takes the other core
)
def k3mu_training(ctx: GateContext) -> None:
    """K3-μ trained from scratch in integers on Shakespeare: validation loss at least 0.3
    bits/char below the bigram model, within 3% of its float64 twin at every evaluation, and
    bit-identical in a fresh process with another thread count."""
    cfg = _cfg()
    d = T.data(cfg)
    base = T.baselines()
    steps, every = TRAIN_STEPS, EVAL_EVERY
    rerun = start_rerun(
        ctx, "train_int", (vars(cfg), steps, SEED, every), python_module="k3gates.k3mu.train"
    )
    t0 = time.perf_counter()
    out = T.run(IntOps(ctx.compiled), initial(cfg, SEED), cfg, d, steps, SEED, eval_every=every)
    int_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    twin = T.run(FloatOps(), dequantize_params(initial(cfg, SEED)), cfg, d, steps, SEED,
                 eval_every=every)  # fmt: skip
    flt_s = time.perf_counter() - t0
    check_training(
        ctx,
        curve=np.array(out["val"]),
        twin=np.array(twin["val"]),
        threshold=T.threshold(),
        unit="bits/char (validation)",
        rerun=rerun,
        first=T.result_arrays(out),
        start_near=(math.log2(cfg.vocab), T.START_TOL_BITS),
    )
    tok = out["tokens"]
    tail = steps // 10
    ctx.evidence(
        f"K3-μ trained {steps} steps ({tok:,} characters) in integers: validation "
        f"{out['val'][-1]:.3f} bits/char, float64 twin {twin['val'][-1]:.3f}, bigram "
        f"{base['bigram']:.3f}; {tok / int_s:,.0f} characters/s"
    )
    ctx.artifact(
        "curve:validation loss",
        {
            "x": out["eval_steps"],
            "series": {"integer": out["val"], "float64 twin": twin["val"]},
            "threshold": T.threshold(),
            "lines": T.baseline_lines(base),
            "xlabel": "step",
            "ylabel": "bits/char (validation)",
        },
    )
    rows = [
        ["steps; characters seen", f"{steps}; {tok:,}"],
        ["characters/s (integer, beside its fresh-process rerun; float64 twin)",
         f"{tok / int_s:,.0f}; {tok / flt_s:,.0f}"],
        ["train bits/char, last 10 steps (integer; float64)",
         f"{np.mean(out['train'][-tail:]):.4f}; {np.mean(twin['train'][-tail:]):.4f}"],
        ["validation bits/char (integer; float64)",
         f"{out['val'][-1]:.4f}; {twin['val'][-1]:.4f}"],
        *[[f"{k} baseline", f"{base[k]:.4f}"] for k in ("uniform", "unigram", "bigram", "trigram")],
    ]  # fmt: skip
    ctx.artifact("table:run", {"columns": ["", "K3-μ"], "rows": rows})
    ctx.artifact("table:architecture", architecture(cfg, out["params"]))
    check_compiled_run(
        ctx,
        "compiled_step",
        "one whole training step (forward, backward, Muon and AdamW updates, Quantile "
        "Balancing) of a narrow K3-μ (d = 16) gives bit-identical weights compiled and run by "
        "CPython from the same sources",
        functools.partial(T.train_int, vars(_cfg(**NARROW)), 1, SEED, 1),
    )


def architecture(cfg: Config, p: dict) -> dict:
    """Every size of the model, read off the weights the gate trained."""
    from ..kda import layer_train as layer_kda
    from ..moe import layer_train as layer_moe

    kinds = cfg.kinds()
    kda, mla = kinds.index("kda"), kinds.index("mla")
    w1 = p[f"{kda}.ffn.w1"]
    rows = [
        ["vocabulary (characters)", cfg.vocab],
        ["width d", cfg.d],
        ["layers", ", ".join(k.upper() for k in kinds)],
        ["context × batch (characters per step)", f"{cfg.context} × {cfg.batch}"],
        ["KDA: heads × d_k (= d_v), short conv",
         f"{p[f'{kda}.attn.a_head'].size} × {p[f'{kda}.attn.norm_w'].size}, {layer_kda.CONV}"],
        ["Gated MLA: q_lora, kv_lora (c_kv), shared key part",
         f"{p[f'{mla}.attn.q_norm'].size}, {p[f'{mla}.attn.kv_norm'].size}, "
         f"{p[f'{mla}.attn.w_kr'].shape[0]}"],
        ["LatentMoE: routed experts, top-k, latent, expert hidden",
         f"{w1.shape[0]}, {layer_moe.TOP_K}, {w1.shape[2]}, {w1.shape[1]}"],
        ["shared expert hidden", p[f"{kda}.ffn.ws1"].shape[0]],
        ["head", "untied from the embedding"],
        ["parameters (trained)", f"{sum(int(v.size) for k, v in p.items() if _trained(k)):,}"],
    ]  # fmt: skip
    return {"columns": ["", "K3-μ"], "rows": rows}


# == The committed long run, verified without re-training ====================================
RUN = cli.RUNS / "long"
SAMPLE = {"prompt": "ROMEO:", "chars": 300, "seed": 1, "temperature": 0.8, "top_k": 20}
SAMPLE_COMPILED_CHARS = 3  # the interpreted model takes seconds per character


@gate(
    "k3mu_replay",
    innovation="k3block",
    level="STRONG",
    kernels=TRAINING_KERNELS,
    bounds={"checkpoint_twin": LOSS_REL_TOL},
    timeout=600,
    requires=["k3block_backward"],
)
def k3mu_replay(ctx: GateContext) -> None:
    """The committed long K3-μ run, verified without re-training: the checkpoint's validation
    loss re-evaluated in integers equals the recorded one bit for bit, and the first K steps
    replayed from the recorded seed reach the recorded weight digest bit for bit."""
    from .sample import sample

    folder = RUN  # inside the gate's folder, so its bytes are part of the result's inputs
    meta = cli.load_meta(folder)
    ckpt = folder / "checkpoint.npz"
    sha = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    ctx.check(
        "checkpoint_intact",
        "the checkpoint's bytes have the SHA-256 recorded when the run wrote it",
        sha == meta["checkpoint_sha256"],
        message=f"{ckpt.name}: sha256 {sha[:16]}… differs from the recorded "
        f"{meta['checkpoint_sha256'][:16]}…",
        file=ckpt.name,
    )
    cfg = Config(**meta["config"])
    d = T.data(cfg)
    ops = IntOps(ctx.compiled)
    try:
        params = cli.load_checkpoint(folder)
        loss_q, _ = cli.validation_loss_q(ops, params, cfg, d["val"])
        why = f"re-evaluated {loss_q} differs from the recorded {meta['val_loss_q32']} (Q.32 nats)"
    except ValueError as e:
        params, loss_q, why = None, None, str(e)
    ctx.check(
        "checkpoint_val_loss",
        f"the checkpoint's summed validation loss over {meta['val_tokens']:,} held-out "
        "characters, re-evaluated in integers here, equals the recorded one bit for bit",
        loss_q == meta["val_loss_q32"],
        message=why,
        kind="deterministic",
        recorded_q32=meta["val_loss_q32"],
        measured_q32=loss_q,
    )
    k = int(meta["checkpoint_every"])
    out = T.run(ops, initial(cfg, meta["seed"]), cfg, d, k, meta["seed"], h=meta["recipe"],
                eval_every=k, total=meta["steps"], checkpoint_every=k)  # fmt: skip
    got, want = out["digests"][k], meta["digests"].get(str(k))
    ctx.check(
        "replay_digest",
        f"the first {k} training steps, replayed here from seed {meta['seed']}, reach the weight "
        f"digest the long run recorded at step {k}, bit for bit",
        got == want,
        message=f"step {k}: replayed {got[:16]}… differs from the recorded {str(want)[:16]}…",
        kind="deterministic",
        step=k,
    )
    if params is not None:
        _checkpoint_twin(ctx, ops, params, cfg, d)
        _sampler_compiled(ctx, params, cfg)
    bits = meta["val_bits"]
    ctx.check(
        "below_bigram",
        f"the committed run's validation loss is at least {T.BELOW_BIGRAM_BITS} bits/char below "
        "the bigram model",
        bits <= T.threshold(),
        message=f"{bits:.4f} bits/char > {T.threshold():.4f}",
        bits=bits,
        threshold=T.threshold(),
    )
    base = T.baselines()
    curve = meta["curve"]
    ctx.artifact(
        "curve:the long run's validation loss (integer)",
        {
            "x": curve["eval_steps"],
            "series": {"integer": curve["val_bits"]},
            "threshold": T.threshold(),
            "lines": T.baseline_lines(base),
            "xlabel": "step",
            "ylabel": "bits/char (validation)",
        },
    )
    prov = meta["provenance"]
    rows = [
        ["command", meta["command"]],
        ["steps; characters seen", f"{meta['steps']}; {meta['tokens']:,}"],
        ["validation, whole held-out split",
         f"{bits:.4f} bits/char = {meta['val_nats']:.4f} nats/char"],
        ["nanoGPT's CPU configuration (float, published)", f"{T.NANOGPT_NATS} nats/char"],
        ["characters/s while training", f"{meta['tokens_per_s']:,} on {prov['cpu']}"],
        ["trained at", f"commit {prov['commit'][:12]}, {prov['started']}"],
    ]  # fmt: skip
    ctx.artifact("table:long run", {"columns": ["", ""], "rows": rows})
    if params is not None:
        ctx.artifact("text:sample", sample(ops, params, cfg, **SAMPLE))
    ctx.evidence(
        f"committed run: {meta['steps']} steps, validation {meta['val_nats']:.3f} nats/char "
        f"({bits:.3f} bits; nanoGPT's CPU configuration: {T.NANOGPT_NATS} nats), re-evaluated and "
        "replayed bit for bit"
    )


def _checkpoint_twin(ctx: GateContext, ops: IntOps, params: dict, cfg: Config, d: dict) -> None:
    val = T.val_batch(d["val"], cfg)
    got = T.evaluate(ops, params, cfg, val)
    want = T.evaluate(FloatOps(), dequantize_params(params), cfg, val)
    ctx.check_reference(
        "checkpoint_twin",
        f"on the trained checkpoint, the integer model's loss over {val.shape[0]} validation "
        f"windows is within {LOSS_REL_TOL:g} (relative) of the float64 twin's on the same weights",
        np.array([got / want]),
        np.ones(1),
        unit="integer / float64 loss",
        integer_bits=got,
        float64_bits=want,
    )


def _sampler_compiled(ctx: GateContext, params: dict, cfg: Config) -> None:
    from k3gates.infra import compile as kcompile

    from .sample import sample

    short = {**SAMPLE, "chars": SAMPLE_COMPILED_CHARS}
    t0 = time.perf_counter()
    compiled = sample(IntOps(kcompile.load), params, cfg, **short)
    t1 = time.perf_counter()
    interpreted = sample(IntOps(kcompile.interpreted), params, cfg, **short)
    t2 = time.perf_counter()
    ctx.check(
        "compiled_sampler",
        f"the sampler's first {SAMPLE_COMPILED_CHARS} characters from the checkpoint are the "
        "same compiled and run by CPython from the same sources",
        compiled == interpreted,
        kind="compiled",
        message=f"compiled {compiled!r} != interpreted {interpreted!r}",
        text=compiled,
        speed_ratio=(t2 - t1) / max(t1 - t0, 1e-9),
    )
