"""MXFP4 quantisation-aware training's integer kernels (k3gates.mxfp.kernels_qat) at small sizes:
the packed inference path against the fake-quantised forward, the straight-through gradient against
float64, and the two scale rules on the blocks where they part. The gate (mxfp_qat) holds every
stage at its bound."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import check, gate_row

from k3gates.infra import compile as kcompile
from k3gates.mxfp import expert as X
from k3gates.mxfp import gate_qat as G
from k3gates.mxfp import reference_qat as ref


@pytest.fixture(scope="module")
def k() -> X.Kernels:
    return X.Kernels(kcompile.load)


def _expert(rng, n=32, latent=64, hidden=64):
    w = {name: np.round(rng.normal(0, 0.12, shape) * 2**20).astype(np.int64)
         for name, shape in (("w1", (hidden, latent)), ("w3", (hidden, latent)),
                             ("w2", (latent, hidden)))}  # fmt: skip
    z = np.round(rng.normal(0, 1, (n, latent)) * 2**24).astype(np.int64)
    return w, z


def test_packed_inference_equals_the_fake_quantised_forward_bit_for_bit(k):
    rng = np.random.default_rng(1)
    w, z = _expert(rng)
    s = X.forward(k, z, w, 1)
    packed, scales = k.pack(s["w2_q"])
    assert 8 * (packed.nbytes + scales.nbytes) / w["w2"].size == 4.25
    y, outside = k.mx.packed_matmul(s["a_q"]["n"], s["a_q"]["e"], packed, scales, X.FRAC)
    assert outside == 0 and np.array_equal(y, s["y"]) and np.abs(y).max() > 1 << 20
    # one flipped nibble changes the output: the comparison can fail
    packed[3, 5] ^= 0x10
    y2, _ = k.mx.packed_matmul(s["a_q"]["n"], s["a_q"]["e"], packed, scales, X.FRAC)
    assert not np.array_equal(y2, s["y"])


@pytest.mark.parametrize("rule", ["ocp", "round-up"])
def test_the_straight_through_gradient_is_float64s(k, rule):
    """The integer STE gradients of the master weights and of z against the float64 STE run
    from the same integer weights and tokens, within 1e-3 of each gradient's largest value."""
    rng = np.random.default_rng(2)
    w, z = _expert(rng)
    dy = np.round(rng.normal(0, 1, z.shape) * 2**24).astype(np.int64)
    s = X.forward(k, z, w, ("ocp", "round-up").index(rule))
    d = X.backward(k, s, dy)
    wf = {n: v * 2.0**-20 for n, v in w.items()}
    sf = ref.expert_forward(z * 2.0**-24, wf, rule)
    sf = ref.expert_output(sf, ref.situ_glu(sf["g"], sf["u"]), rule)
    df = ref.expert_backward(sf, dy * 2.0**-24)
    for name in ("dz", "dw1", "dw3", "dw2"):
        assert np.abs(d[name] * 2.0**-24 - df[name]).max() <= 1e-3 * np.abs(df[name]).max(), name
    if rule == "ocp":  # OCP saturates some weights: their master gradient is exactly zero
        assert s["w1_q"]["sat"].any() and not d["dw1"][s["w1_q"]["sat"]].any()


@pytest.mark.parametrize(
    ("fmt", "fmt_name", "frac", "amax", "ocp_x", "up_x"),
    [(0, "e2m1", 20, 7.0, 0, 1), (0, "e2m1", 20, 6.0, 0, 0), (0, "e2m1", 20, 6.5, 0, 1),
     (3, "e4m3", 24, 480.0, 0, 1), (3, "e4m3", 24, 448.0, 0, 0), (0, "e2m1", 20, 0.75, -3, -3)],
)  # fmt: skip
def test_the_two_scale_rules_each_match_their_definition(k, fmt, fmt_name, frac, amax, ocp_x,
                                                        up_x):  # fmt: skip
    """OCP: X = floor(log2 amax) - emax. Round-up: the smallest X with amax <= max 2^X. They
    differ exactly when amax / 2^X_ocp passes the format's max (7 > 6, 480 > 448)."""
    block = np.zeros((1, 32), dtype=np.int64)
    block[0, 0] = round(amax * 2**frac)
    block[0, 1] = -round(amax / 2 * 2**frac)
    for rule, want in ((0, ocp_x), (1, up_x)):
        scales, codes, sat = k.mx.quantize_fx(block, frac, fmt, rule)
        assert int(scales[0, 0]) - 127 == want, (rule, amax)
        r_scales, r_codes, r_sat, _ = ref.quantize(block * 2.0**-frac, fmt_name,
                                                   ("ocp", "round-up")[rule])  # fmt: skip
        assert np.array_equal(scales, r_scales) and np.array_equal(codes, r_codes)
        assert np.array_equal(sat.astype(bool), r_sat)
        assert bool(sat[0, 0]) == (rule == 0 and ocp_x != up_x)  # only OCP saturates


def test_a_product_outside_the_exact_domain_stops_the_expert(k):
    rng = np.random.default_rng(3)
    w, z = _expert(rng)
    s = X.forward(k, z, w, 1)
    with pytest.raises(OverflowError, match="dyadic_matmul's exact domain"):
        X.backward(k, s, np.full(z.shape, 1 << 50, dtype=np.int64))


def test_mxfp_training_reports_qat_direct_cast_and_unquantised_losses(built_site):
    """Issue 17, acceptance 3: the three validation losses are in the gate's evidence, as the
    values of its QAT check, in its table and in its sentence; and the packed export's loss is
    the QAT run's, bit for bit."""
    row = gate_row(built_site, "mxfp_training")
    assert row["level"] == "PROVEN" and row["innovation"] == "mxfp"
    values = check(row, "qat_vs_unquantised")["values"]
    qat, plain = values["qat_bits"], values["unquantised_bits"]
    cast = values["direct_cast_bits"]
    assert len(qat) == len(plain) == G.TRAIN_STEPS // G.EVAL_EVERY + 1
    worst = max(abs(q / p - 1) for q, p in zip(qat, plain, strict=True))
    assert check(row, "qat_vs_unquantised")["passed"] == (worst <= G.QAT_REL_TOL)
    assert qat[-1] < qat[0] and plain[-1] < plain[0] and cast > 0
    table = dict(row["artifacts"][G.VARIANTS_TABLE]["rows"])
    found = [v for k, v in table.items() if k.startswith("validation bits/char")]
    assert len(found) == 4  # and the float64 fake-quant twin's
    assert {f"{x:.4f}" for x in (qat[-1], plain[-1], cast)} <= set(found), (found, values)
    for figure in (qat[-1], plain[-1], cast):
        assert f"{figure:.4f}" in row["summary"], row["summary"]
    packed = check(row, "packed_export")
    assert packed["values"]["loss_q_packed"] == packed["values"]["loss_q_qat"]
    assert packed["values"]["bits_per_weight"] == 4.25
