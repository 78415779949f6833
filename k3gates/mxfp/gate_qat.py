"""MXFP4 quantisation-aware training as K3 does it, the training form (STRONG): one routed expert
with MXFP4 (E2M1) weights and MXFP8 (E4M3) activations along the reduction axis, its forward as
exact integer MX products, its straight-through backward, both scale rules, and the packed
inference path at K3's expert size. Bounds come from k3gates/mxfp/kernels_qat.py and
k3gates/situ/kernels.py, declared before any run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from k3gates.fx.checks import check_compiled
from k3gates.infra.gate import GateContext, gate

from ..fx import host
from ..k3mu.ops import KERNELS, MXQAT
from ..situ import kernels as SK
from ..situ import reference as situ_ref
from . import expert as X
from . import reference_qat as ref

SEED = 20261207
HALF_LSB = 513 / 1024  # one rounding (1/2 LSB) with float64's own error as margin
SITU_LSB = SK.SITU_MAX_ERR_LSB_Q10 / 1024
SITU_GRAD_LSB = SK.SITU_GRAD_MAX_ERR_LSB_Q10 / 1024
Q24 = "LSB (2^-24)"
TOKENS, LATENT, HIDDEN = 256, 64, 128  # one expert at toy size: z [256, 64], w1, w3 [128, 64]
# w1 at K3's size: expert width 3072 x latent 3584 (K3-SPEC.md, "K3 as released")
K3_EXPERT = (3072, 3584)
K3_TOKENS = 8
RULES = {X.RULE_OCP: "ocp", X.RULE_ROUND_UP: "round-up"}
STAGES = ("g", "u", "situ", "y", "da", "dgdu", "dz", "dw1", "dw3", "dw2")


def _bounds() -> dict[str, float]:
    b = {}
    for rule in RULES.values():
        for s in STAGES:
            b[f"{rule}_{s}"] = {"situ": SITU_LSB, "dgdu": SITU_GRAD_LSB}.get(s, HALF_LSB)
    return b


@gate(
    "mxfp_qat",
    innovation="mxfp",
    level="STRONG",
    kernels=["k3gates.mxfp.kernels_qat", "k3gates.situ.kernels", "k3gates.mxfp.kernels",
             "k3gates.gemm.kernels", "k3gates.fx.kernels"],
    bounds=_bounds(),
    timeout=300,
    requires=["mxfp_quantize"],
)  # fmt: skip
def mxfp_qat(ctx: GateContext) -> None:
    """A routed expert fake-quantised to MXFP4 weights and MXFP8 activations, its forward by exact
    integer MX products and its straight-through backward, each stage within its declared bound
    of float64 on the integers it received, under both scale rules (OCP v1.0 and round-up); the
    packed MXFP4 weights, 4.25 bits each, give the fake-quantised forward bit for bit at K3's
    expert size."""
    k = X.Kernels(ctx.compiled)
    rng = np.random.default_rng([SEED, 1])
    std = {"w1": host.inv_sqrt(LATENT), "w3": host.inv_sqrt(LATENT), "w2": host.inv_sqrt(HIDDEN)}
    w = {name: np.round(rng.normal(0, std[name], shape)
                        * 2**X.W_FRAC).astype(np.int64)
         for name, shape in (("w1", (HIDDEN, LATENT)), ("w3", (HIDDEN, LATENT)),
                             ("w2", (LATENT, HIDDEN)))}  # fmt: skip
    z = np.round(rng.normal(0, 1, (TOKENS, LATENT)) * 2**X.FRAC).astype(np.int64)
    dy = np.round(rng.normal(0, 1, (TOKENS, LATENT)) * 2**X.FRAC).astype(np.int64)
    effect = []
    runs = {}
    for rule, name in RULES.items():
        s = X.forward(k, z, w, rule)
        d = X.backward(k, s, dy)
        runs[name] = s
        _quantisers(ctx, name, s, w, z)
        _stages(ctx, name, s, d, dy)
        effect.append(_effect(name, s, w, z))
    _rules(ctx, runs)
    bits = _packed(ctx, k, rng)
    _compiled(ctx, rng)
    ctx.artifact(
        "table:what each scale rule does to the expert (same weights and tokens)",
        {"columns": ["scale rule", "weights saturated", "activations saturated",
                     "RMS weight error (relative)", "RMS output error vs unquantised (relative)"],
         "rows": effect},
    )  # fmt: skip
    ctx.evidence(
        f"an expert with MXFP4 weights and MXFP8 activations: forward by exact integer MX "
        f"products and straight-through backward, every stage within its bound of float64 under "
        f"both scale rules; packed weights at K3's expert size ({K3_EXPERT[0]}×{K3_EXPERT[1]}) "
        f"{bits:g} bits each, bit-identical to the fake-quantised forward"
    )


def _real(a: np.ndarray, frac: int = X.FRAC) -> np.ndarray:
    return np.asarray(a, dtype=np.float64) * 2.0**-frac


def _quantisers(ctx: GateContext, rule: str, s: dict, w: dict, z: np.ndarray) -> None:
    """Every quantised tensor's scales, codes and saturation mask equal the reference's."""
    diffs = []
    for name, x, frac, fmt in (("w1", w["w1"], X.W_FRAC, "e2m1"), ("w3", w["w3"], X.W_FRAC, "e2m1"),
                               ("w2", w["w2"], X.W_FRAC, "e2m1"), ("z", z, X.FRAC, "e4m3"),
                               ("a", s["a"], X.FRAC, "e4m3")):  # fmt: skip
        scales, codes, sat, _ = ref.quantize(_real(x, frac), fmt, rule)
        q = s[f"{name}_q"]
        same = (np.array_equal(q["scales"], scales), np.array_equal(q["codes"], codes),
                np.array_equal(q["sat"], sat))  # fmt: skip
        if not all(same):
            diffs.append(f"{name}: scales {same[0]}, codes {same[1]}, sat {same[2]}")
    ctx.check(
        f"{rule}_quantisers",
        f"under the {rule} scale rule, the scales, element codes and saturation masks of the three "
        "MXFP4 weights and the two MXFP8 activations equal the float64 reference's, bit for bit",
        not diffs,
        message="; ".join(diffs),
        kind="deterministic",
    )


def _stages(ctx: GateContext, rule: str, s: dict, d: dict, dy: np.ndarray) -> None:
    """Every stage against float64 on the integers it received."""

    def hold(stage: str, got: np.ndarray, want: np.ndarray, about: str) -> None:
        ctx.check_reference(f"{rule}_{stage}", f"{about} (scale rule: {rule}) is within the "
                            "declared bound of float64 on the integers it received", got,
                            want * 2.0**X.FRAC, unit=Q24)  # fmt: skip

    def val(q: dict) -> np.ndarray:
        return q["n"] * np.exp2(q["e"].astype(np.float64))

    zq, w1, w3, w2, aq = (val(s[n]) for n in ("z_q", "w1_q", "w3_q", "w2_q", "a_q"))
    hold("g", s["g"], zq @ w1.T, "g = Q8(z) Q4(W1)ᵀ, an exact integer MX product rounded once")
    hold("u", s["u"], zq @ w3.T, "u = Q8(z) Q4(W3)ᵀ")
    hold("situ", s["a"], situ_ref.situ_glu(_real(s["g"]), _real(s["u"])), "SiTU-GLU(g, u)")
    hold("y", s["y"], aq @ w2.T, "y = Q8(a) Q4(W2)ᵀ")
    keep_a, keep_z = ~s["a_q"]["sat"], ~s["z_q"]["sat"]
    hold("da", d["da"], (_real(dy) @ w2) * keep_a,
         "the straight-through da = dy Q4(W2), zero where a saturated")  # fmt: skip
    dg, du = situ_ref.situ_glu_grad(_real(s["g"]), _real(s["u"]), _real(d["da"]))
    hold("dgdu", np.hstack([d["dg"], d["du"]]), np.hstack([dg, du]), "SiTU-GLU's backward")
    hold("dz", d["dz"], (_real(d["dg"]) @ w1 + _real(d["du"]) @ w3) * keep_z,
         "dz = dg Q4(W1) + du Q4(W3), one rounding, zero where z saturated")  # fmt: skip
    for name, grad, act in (("dw1", "dg", zq), ("dw3", "du", zq)):
        hold(name, d[name], (_real(d[grad]).T @ act) * ~s[f"w{name[-1]}_q"]["sat"],
             f"the master weight's straight-through d{name[1:].upper()} = {grad}ᵀ Q8(z), zero "
             "where the weight saturated")  # fmt: skip
    hold(
        "dw2",
        d["dw2"],
        (_real(dy).T @ aq) * ~s["w2_q"]["sat"],
        "the master weight's straight-through dW2 = dyᵀ Q8(a), zero where it saturated",
    )


def _rules(ctx: GateContext, runs: dict) -> None:
    """The two rules' scales on the same tensors (the three weights and z; a depends on the
    rule), block by block: round-up is OCP or one binade above it, never saturates, and differs
    from OCP on the blocks whose largest value passes the format's max."""
    ocp, up = runs["ocp"], runs["round-up"]
    differ, sat_ocp, sat_up, ok = 0, 0, 0, True
    for name in ("w1_q", "w3_q", "w2_q", "z_q"):
        step = up[name]["scales"].astype(np.int64) - ocp[name]["scales"].astype(np.int64)
        ok &= bool(np.isin(step, (0, 1)).all())
        differ += int(np.sum(step == 1))
        sat_ocp += int(ocp[name]["sat"].sum())
        sat_up += int(up[name]["sat"].sum())
    ctx.check(
        "scale_rules",
        "on the three weights and the tokens, round-up's scale is OCP's or one binade above it "
        "on every block, never saturates an element, and the two rules differ here: OCP "
        "saturates elements that round-up does not",
        ok and sat_up == 0 and sat_ocp > 0 and differ > 0,
        message=f"steps in {{0, 1}}: {ok}; blocks that differ {differ}; saturated OCP {sat_ocp}, "
        f"round-up {sat_up}",
        blocks_differ=differ,
        saturated_ocp=sat_ocp,
        saturated_round_up=sat_up,
    )


def _effect(rule: str, s: dict, w: dict, z: np.ndarray) -> list:
    """What the rule costs: saturated counts and relative RMS errors against no quantisation."""
    wq = np.hstack([(s[n]["n"] * np.exp2(s[n]["e"].astype(np.float64))).ravel()
                    for n in ("w1_q", "w3_q", "w2_q")])  # fmt: skip
    wr = np.hstack([_real(w[n], X.W_FRAC).ravel() for n in ("w1", "w3", "w2")])
    zf = _real(z)
    g, u = zf @ _real(w["w1"], X.W_FRAC).T, zf @ _real(w["w3"], X.W_FRAC).T
    y = situ_ref.situ_glu(g, u) @ _real(w["w2"], X.W_FRAC).T
    rms = np.sqrt(np.mean((_real(s["y"]) - y) ** 2)) / np.sqrt(np.mean(y**2))
    sat_w = sum(int(s[n]["sat"].sum()) for n in ("w1_q", "w3_q", "w2_q"))
    sat_a = sum(int(s[n]["sat"].sum()) for n in ("z_q", "a_q"))
    err_w = np.sqrt(np.mean((wq - wr) ** 2)) / np.sqrt(np.mean(wr**2))
    return [rule, sat_w, sat_a, f"{err_w:.4f}", f"{rms:.4f}"]


def _packed(ctx: GateContext, k: X.Kernels, rng: np.random.Generator) -> float:
    """One expert matrix at K3's size stored packed (two E2M1 codes per byte, one E8M0 byte per
    32): the bytes per weight, and its product equal to the fake-quantised one, bit for bit."""
    rows, kk = K3_EXPERT
    w = np.round(rng.normal(0, host.inv_sqrt(kk), (rows, kk)) * 2**X.W_FRAC).astype(np.int64)
    a = np.round(rng.normal(0, 1, (K3_TOKENS, kk)) * 2**X.FRAC).astype(np.int64)
    wq = k.quantize(w, X.W_FRAC, X.E2M1, X.RULE_ROUND_UP)
    aq = k.quantize(a, X.FRAC, X.E4M3, X.RULE_ROUND_UP)
    packed, scales = k.pack(wq)
    bits = 8 * (packed.nbytes + scales.nbytes) / w.size
    fake = k.matmul(aq, wq)
    out, outside = k.mx.packed_matmul(aq["n"], aq["e"], packed, scales, X.FRAC)
    ctx.check(
        "packed_inference",
        f"at K3's expert size ({rows}×{kk}) the weights stored packed take {bits:g} bits each "
        f"(two E2M1 codes per byte and one E8M0 byte per 32: 4.25), and {K3_TOKENS} tokens "
        "through the packed path, which decodes each nibble in its loop, give the fake-quantised "
        "forward's output bit for bit",
        bits == 4.25 and outside == 0 and np.array_equal(out, fake),
        message=f"bits {bits}; outside {outside}; equal {np.array_equal(out, fake)}",
        kind="deterministic",
        bits_per_weight=bits,
        bytes_packed=int(packed.nbytes),
        bytes_scales=int(scales.nbytes),
    )
    return bits


def _compiled(ctx: GateContext, rng: np.random.Generator) -> None:
    mod = "k3gates.mxfp.kernels_qat"
    x = rng.integers(-(1 << 24), 1 << 24, (3, 64))
    x[1, :32] = 0  # an all-zero block
    x[2, 5] = 7 << 20  # a block whose amax passes E2M1's max under OCP
    for rule in RULES:
        check_compiled(ctx, f"compiled_quantize_{RULES[rule]}", "quantize_fx", x, 20, 0, rule,
                       inputs="3 rows of 64 Q.20 values, an all-zero block and one over max",
                       modname=mod)  # fmt: skip
    check_compiled(ctx, "compiled_quantize_e4m3", "quantize_fx", x, 24, 3, 0,
                   inputs="the same rows as Q.24 activations to E4M3", modname=mod)  # fmt: skip
    a, ea = rng.integers(-(1 << 17), 1 << 17, (4, 64)), rng.integers(-20, -10, (4, 64))
    b, eb = rng.integers(-12, 13, (5, 64)), rng.integers(-8, -2, (5, 64))
    check_compiled(ctx, "compiled_dyadic_matmul", "dyadic_matmul", a, ea, b, eb, 24,
                   inputs="4 x 5 outputs over 64 terms, mixed exponents", modname=mod)  # fmt: skip
    big_a, big_e = rng.integers(-(1 << 17), 1 << 17, (64, 256)), rng.integers(-20, -10, (64, 256))
    big_b, big_f = rng.integers(-12, 13, (96, 256)), rng.integers(-8, -2, (96, 256))
    ctx.check_threads(
        "threads_dyadic_matmul",
        "dyadic_matmul over 64 x 96 outputs of 256 terms gives the same bits with 1 and with 2 "
        "OpenMP threads",
        "dyadic_matmul", big_a, big_e, big_b, big_f, 24, modname=mod,
    )  # fmt: skip


# == PROVEN: K3-μ trained with MXFP4 QAT on its routed experts ==================================
# Declared before any run. K3-μ's recipe, data, schedule and success threshold are
# k3mu_training's (k3gates/k3mu/train.py); only the routed experts change.
T_SEED = 1  # K3-μ's seed (k3mu_training's): the same initial weights and batches
TRAIN_STEPS = 100
TINY_CONTEXT = 4  # compiled == interpreted: the interpreted model is slow
EVAL_EVERY = 10
CURVE_REL_TOL = 0.03  # the QAT integer run against its float64 fake-quant twin, every evaluation
QAT_REL_TOL = 0.03  # the QAT integer run against the unquantised integer run, every evaluation
# The two sides' validation loss at the initial weights, relative: k3block_backward's 1e-4 for the
# unquantised model. Quantisation adds no error of its own (both sides quantise the same values
# by the same definition); where the two sides' inputs to a quantiser differ by their rounding, an
# element can land one grid step apart, on a few of 32 x 2048 elements.
INIT_REL_TOL = 1e-4
# The kernel's MXFP4 values of the trained weights against the float64 reference quantiser's: 0,
# both are exact by definition (K3-SPEC section 11; mxfp.kernels_qat).
# K3's routed experts (K3-SPEC, "K3 as released"): per MoE layer 896 experts, w1, w3 and w2 each
# 3072 x 3584 weights; 92 MoE layers (93 layers, layer 0 a dense FFN)
K3_EXPERT_WEIGHTS = 896 * 3 * 3072 * 3584
K3_MOE_LAYERS = 92
EXPERT_MATRICES = ("w1", "w3", "w2")
VARIANTS_TABLE = "table:the variants' validation loss, and K3's expert memory"


# K3-μ's kernels and the quantiser; mxfp's packer and situ's kernels: the export (expert.Kernels
# loads both)
K3MU_KERNELS = [*KERNELS.values(), MXQAT, "k3gates.mxfp.kernels", "k3gates.situ.kernels"]


@gate(
    "mxfp_training",
    innovation="mxfp",
    level="PROVEN",
    kernels=K3MU_KERNELS,
    bounds={"loss_curve": CURVE_REL_TOL, "qat_vs_unquantised": QAT_REL_TOL,
            "init_twin": INIT_REL_TOL, "quantiser_exact": 0},
    timeout=900,
    requires=["mxfp_qat", "k3block_backward"],
    exclusive=True,  # its fresh rerun takes the other core
)  # fmt: skip
def mxfp_training(ctx: GateContext) -> None:
    """K3-μ trained on Shakespeare in integers with MXFP4 quantisation-aware training on its
    routed experts, as K3 trains them: within 3% of the unquantised integer run and of its
    float64 fake-quant twin at every evaluation, below the success threshold, bit-identical in a
    fresh process, and its packed MXFP4 export evaluating to the same validation loss, bit for
    bit."""
    import math

    from k3gates.infra.training import check_training, start_rerun

    from ..k3mu import corpus
    from ..k3mu import train as T
    from ..k3mu.checks import check_compiled_run
    from ..k3mu.model import Config, dequantize_params, forward, initial
    from ..k3mu.ops import FloatOps, IntOps

    _text, vocab = corpus.load()
    cfg = Config(vocab=len(vocab))
    d = T.data(cfg)
    val = T.val_batch(d["val"], cfg)
    start = initial(cfg, T_SEED)
    check_compiled_run(
        ctx,
        "compiled_qat",
        "the compiled kernels and the same sources run by CPython give bit-identical loss and "
        f"gradients of the whole fake-quantised model ({TINY_CONTEXT} characters)",
        qat_gradients,
    )
    qat_ops, twin_ops = IntOps(ctx.compiled, qat="train"), FloatOps(qat="train")
    init_int = T.evaluate(qat_ops, start, cfg, val)
    init_flt = T.evaluate(twin_ops, dequantize_params(start), cfg, val)
    ctx.check_reference(
        "init_twin",
        "at the initial weights, the fake-quantised integer model's validation loss is within "
        f"{INIT_REL_TOL:g} (relative) of the float64 fake-quant twin's",
        np.array([init_int / init_flt]),
        np.ones(1),
        unit="integer / float64 loss",
        integer_bits=init_int,
        float64_bits=init_flt,
    )
    steps, every = TRAIN_STEPS, EVAL_EVERY
    rerun = start_rerun(ctx, "train_int", (vars(cfg), steps, T_SEED, every, False, "train"),
                        python_module="k3gates.k3mu.train")  # fmt: skip

    def beside() -> tuple[dict, dict]:
        plain = T.run(IntOps(ctx.compiled), initial(cfg, T_SEED), cfg, d, steps, T_SEED,
                      eval_every=every)  # fmt: skip
        twin = T.run(twin_ops, dequantize_params(initial(cfg, T_SEED)), cfg, d, steps, T_SEED,
                     eval_every=every)  # fmt: skip
        return plain, twin

    # the compiled kernels release the GIL: the unquantised run and the twin train in a thread
    # beside the QAT run (and its fresh rerun), so three runs cost little more wall time than two
    with ThreadPoolExecutor(1) as pool:
        side = pool.submit(beside)
        qat = T.run(qat_ops, initial(cfg, T_SEED), cfg, d, steps, T_SEED, eval_every=every)
        plain, twin = side.result()
    check_training(
        ctx,
        curve=np.array(qat["val"]),
        twin=np.array(twin["val"]),
        threshold=T.threshold(),
        unit="bits/char (validation)",
        rerun=rerun,
        first=T.result_arrays(qat),
        start_near=(math.log2(cfg.vocab), T.START_TOL_BITS),
    )
    # reported beside, not a check: the same checkpoint format reached without QAT
    cast = T.evaluate(qat_ops, plain["params"], cfg, val)
    ctx.check_reference(
        "qat_vs_unquantised",
        f"at every evaluation the QAT run's validation loss is within {QAT_REL_TOL:g} (relative) "
        "of the unquantised integer run's, trained from the same weights on the same batches",
        np.array(qat["val"]) / np.array(plain["val"]),
        np.ones(len(plain["val"])),
        unit="QAT / unquantised loss",
        qat_bits=qat["val"],
        unquantised_bits=plain["val"],
        direct_cast_bits=cast,
    )
    k = X.Kernels(ctx.compiled)
    export = _export(k, qat["params"])
    stored = sum(packed.nbytes + scales.nbytes for packed, scales, _shape in export.values())
    bits = 8 * stored / sum(int(np.prod(shape)) for _p, _s, shape in export.values())
    decoded = {**qat["params"], **_decode(k, export)}
    quantised = _fake_quantised(qat_ops, qat["params"])
    real = dequantize_params(qat["params"])
    # audit: reference codes
    want = [ref.quantize(real[n].reshape(-1, real[n].shape[2]), "e2m1", "round-up")[3].ravel()
            for n in export]  # fmt: skip
    ctx.check_reference(
        "quantiser_exact",
        f"the trained experts' {len(export)} matrices, quantised to MXFP4 by the integer kernel "
        "(as the training's forward does), equal the float64 reference quantiser's values of the "
        "same weights, exactly",
        np.concatenate([quantised[n].ravel() for n in export]).astype(np.float64),
        np.concatenate(want) * 2.0**X.W_FRAC,
        unit="LSB (2^-20)",
        matrices=len(export),
    )
    same_weights = all(np.array_equal(decoded[n], quantised[n]) for n in export)
    loss_qat = forward(qat_ops, qat["params"], cfg, val, grad=False)["loss_q"]
    loss_packed = forward(IntOps(ctx.compiled, qat="packed"), decoded, cfg, val, grad=False)[
        "loss_q"
    ]
    ctx.check(
        "packed_export",
        f"the trained experts exported packed ({len(export)} matrices; two E2M1 codes per byte "
        f"and one E8M0 byte per 32: {bits:g} bits per weight, measured from the stored bytes) "
        "decode to exactly the MXFP4 weights the training used, and the model evaluated from "
        "them gives the same validation loss, bit for bit",
        bits == 4.25 and same_weights and loss_packed == loss_qat,
        message=f"bits {bits}; same weights {same_weights}; loss {loss_packed} vs {loss_qat}",
        kind="deterministic",
        bits_per_weight=bits,
        loss_q_packed=int(loss_packed),
        loss_q_qat=int(loss_qat),
    )
    _report(ctx, T, {"qat": qat, "plain": plain, "twin": twin}, cast, bits)


def qat_gradients(interpreted: bool = False) -> tuple:
    """The fake-quantised K3-μ's summed loss (Q.32) and every gradient, in name order, on one
    window of TINY_CONTEXT characters at full width, by the compiled kernels or by CPython."""
    from k3gates.infra import compile as kcompile

    from ..k3mu import corpus
    from ..k3mu.model import Config, backward, forward, initial, windows
    from ..k3mu.ops import IntOps

    text, vocab = corpus.load()
    cfg = Config(vocab=len(vocab), batch=1, context=TINY_CONTEXT)
    tokens = windows(corpus.encode(text, vocab), np.array([1000]), cfg.context)
    ops = IntOps(kcompile.interpreted if interpreted else kcompile.load, qat="train")
    params = initial(cfg, T_SEED)
    rec = forward(ops, params, cfg, tokens)
    grads = backward(ops, params, cfg, rec)
    return (np.array([rec["loss_q"]], dtype=np.int64), *[grads[k] for k in sorted(grads)])


def _expert_names(params: dict) -> list[str]:
    return sorted(n for n in params if n.split(".")[-1] in EXPERT_MATRICES and ".ffn." in n)


def _fake_quantised(ops, params: dict) -> dict[str, np.ndarray]:
    """Every routed-expert matrix as the QAT forward reads it (ops.mx: MXFP4, Q.20)."""
    out = {}
    for name in _expert_names(params):
        prefix, leaf = name.rsplit(".", 1)
        layer = {m: params[f"{prefix}.{m}"] for m in EXPERT_MATRICES}
        out[name] = ops.mx.experts(layer)[leaf]
    return out


def _export(k: X.Kernels, params: dict) -> dict[str, tuple]:
    """The routed experts as stored for inference: name -> (packed codes [R, K/2], E8M0 scales
    [R, K/32], the matrix's shape), by the kernels' quantiser (round-up) and mxfp's packer."""
    out = {}
    for name in _expert_names(params):
        w = params[name]
        q = k.quantize(w.reshape(-1, w.shape[2]), X.W_FRAC, X.E2M1, X.RULE_ROUND_UP)
        packed, scales = k.pack(q)
        out[name] = (packed, scales, w.shape)
    return out


def _decode(k: X.Kernels, export: dict[str, tuple]) -> dict[str, np.ndarray]:
    """The stored bytes back to Q.20 weights: unpacked codes, their exact values n 2^e
    (kernels_qat's `values`), written in Q.20 (exact: every E2M1 value of these scales is a
    multiple of 2^-20, which the comparison with the training's weights confirms)."""
    out = {}
    for name, (packed, scales, shape) in export.items():
        codes = k.mxfp.unpack_fp4(np.ascontiguousarray(packed.ravel()))
        n, e = k.mx.values(scales, np.ascontiguousarray(codes.reshape(-1, shape[2])), X.E2M1)
        s = e + X.W_FRAC
        if np.any(s < 0):
            raise ValueError(f"{name}: a scale below Q.20's resolution")
        out[name] = (n << s).reshape(shape)
    return out


def _report(ctx: GateContext, T, runs: dict, cast: float, bits: float) -> None:
    qat, plain, twin = runs["qat"], runs["plain"], runs["twin"]
    ctx.evidence(
        f"K3-μ trained {TRAIN_STEPS} steps with MXFP4 QAT on its routed experts: validation "
        f"{qat['val'][-1]:.4f} bits/char; unquantised integer run {plain['val'][-1]:.4f}; "
        f"float64 fake-quant twin {twin['val'][-1]:.4f}; the unquantised run's experts cast to "
        f"MXFP4 after training (no QAT) {cast:.4f}"
    )
    ctx.artifact(
        "curve:validation loss",
        {
            "x": qat["eval_steps"],
            "series": {"integer, MXFP4 QAT": qat["val"],
                       "float64 fake-quant twin": twin["val"],
                       "integer, unquantised": plain["val"]},
            "threshold": T.threshold(),
            "lines": T.baseline_lines(T.baselines()),
            "xlabel": "step",
            "ylabel": "bits/char (validation)",
        },
    )  # fmt: skip

    def gib(weights: int, b: float) -> str:
        at_b, at_bf16 = weights * b / 8 / 2**30, weights * 2 / 2**30
        return f"{at_b:,.1f} GiB at {b:g} bits; {at_bf16:,.1f} GiB at bf16"

    rows = [
        ["bits per expert weight (packed codes and scales, measured)", f"{bits:g}"],
        ["K3's routed experts, one MoE layer (896 × 3 × 3072 × 3584 weights)",
         gib(K3_EXPERT_WEIGHTS, bits)],
        [f"K3's routed experts, all {K3_MOE_LAYERS} MoE layers",
         gib(K3_MOE_LAYERS * K3_EXPERT_WEIGHTS, bits)],
        ["validation bits/char, unquantised integer run", f"{plain['val'][-1]:.4f}"],
        ["validation bits/char, MXFP4 QAT integer run (= from its packed export)",
         f"{qat['val'][-1]:.4f}"],
        ["validation bits/char, float64 fake-quant twin", f"{twin['val'][-1]:.4f}"],
        ["validation bits/char, unquantised run cast to MXFP4 after training (no QAT)",
         f"{cast:.4f}"],
    ]  # fmt: skip
    ctx.artifact(VARIANTS_TABLE, {"columns": ["", "K3-μ"], "rows": rows})
