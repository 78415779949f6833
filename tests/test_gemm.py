"""The shared integer GEMM (k3gates/gemm): exactness on random and extreme inputs, compiled ==
interpreted, the library face's checks, and that its gate catches a broken kernel."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates import gemm as face
from k3gates.gemm import gate as gemm_gate
from k3gates.gemm import kernels as K
from k3gates.gemm import reference as ref
from k3gates.infra import compile as kc
from k3gates.infra import faults
from k3gates.infra.gate import REGISTRY, GateContext, bit_equal

MOD = "k3gates.gemm.kernels"
I32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def k():
    return kc.load(MOD)


def _want16(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    exact = a.astype(np.int64) @ b.astype(np.int64).T  # exact: |sum| <= K 2^30 < 2^63
    return np.clip(exact, -I32_MAX, I32_MAX), int(np.count_nonzero(np.abs(exact) > I32_MAX))


def test_constants_are_the_expressions_they_stand_for():
    assert K.GUARD_LIMIT == 2**62 and K.HOELDER_LIMIT == 2**62 and K.I64_ELEM_LIMIT == 2**62
    assert K.I32_MAX == 2**31 - 1 and K.I64_MAX == 2**63 - 1
    # the guard: na nb <= GUARD_LIMIT - 1 means |a . b| <= sqrt(2^62 - 1) < 2^31
    assert (K.GUARD_LIMIT - 1) < (2**31) ** 2
    assert K.TILE_M * K.TILE_K * 2 <= 256 * 1024 and K.NR * K.TILE_K * 2 <= 16 * 1024


@pytest.mark.parametrize(
    ("m", "n", "kk"), [(1, 1, 1), (5, 3, 7), (67, 130, 45), (2 * K.TILE_M + 1, 9, K.TILE_K + 5)]
)
@pytest.mark.parametrize("top", [1 << 8, 1 << 15])
def test_gemm_i16_is_exact_and_counts_its_clamps(k, m, n, kk, top):
    rng = np.random.default_rng(m * 1000 + n + top)
    a = rng.integers(-top, top, (m, kk)).astype(np.int16)
    b = rng.integers(-top, top, (n, kk)).astype(np.int16)
    c, sat = k.gemm_i16(a, b)
    want, want_sat = _want16(a, b)
    assert c.dtype == np.int32 and np.array_equal(c, want)
    assert sat == want_sat


def test_gemm_i16_hits_the_int32_limits_exactly(k):
    e = gemm_gate._edge_rows(3)
    crafted = e[-len(gemm_gate.CRAFTED) :]
    for a, b in ((e, e), (crafted, np.repeat(crafted, K.NR, axis=0))):
        c, sat = k.gemm_i16(a, b)
        want, want_sat = _want16(a, b)
        assert np.array_equal(c, want) and sat == want_sat
    c, _ = k.gemm_i16(crafted, crafted)
    assert c[0, 1] == 2**31 - 1  # exact, unclamped
    assert c[2, 2] == 2**31 - 1  # 2^31, clamped
    assert c[3, 4] == -(2**31 - 1)  # -2^31, clamped
    assert c[5, 2] == 2**31 - 2**16  # the guard just holds: the int32 path


def test_gemm_i16_is_odd_and_order_independent(k):
    rng = np.random.default_rng(3)
    a = rng.integers(-(2**15), 2**15, (70, 33)).astype(np.int16)
    b = rng.integers(-300, 300, (11, 33)).astype(np.int16)
    neg = np.maximum(a, -(2**15) + 1)  # -(-2^15) is not int16
    c, _ = k.gemm_i16(neg, b)
    cn, _ = k.gemm_i16(-neg, b)
    assert np.array_equal(cn, -c)
    perm = rng.permutation(70)
    cp, _ = k.gemm_i16(np.ascontiguousarray(neg[perm]), b)
    assert np.array_equal(cp[np.argsort(perm)], c)


@pytest.mark.parametrize("shift", [0, 1, 17, 62])
def test_gemm_i64_is_exact_inside_its_domain_and_zero_outside(k, shift):
    rng = np.random.default_rng(shift)
    for a, b, _ in gemm_gate._i64_cases(rng):
        c, outside = k.gemm_i64(a, b, shift)
        want, want_outside = ref.gemm_i64(a, b, shift)
        assert c.ravel().tolist() == want and outside == want_outside


def test_round_shift_reference_rounds_half_away_from_zero():
    assert [ref.round_shift(x, 1) for x in (1, 3, 5, -1, -3, -5)] == [1, 2, 3, -1, -2, -3]
    assert ref.round_shift(-7, 0) == -7 and ref.round_shift(2**62 - 1, 62) == 1


def test_compiled_equals_interpreted_on_both_paths(k):
    py = kc.interpreted(MOD)
    e = gemm_gate._edge_rows(5)
    crafted = e[-len(gemm_gate.CRAFTED) :]
    a = np.concatenate([e[:9], crafted])
    b = np.concatenate([np.repeat(crafted[2:3], K.NR, axis=0), e[-9:]])
    with np.errstate(over="raise"):
        assert bit_equal(k.gemm_i16(a, b), py.gemm_i16(a, b))
    a64, b64 = gemm_gate._k1_extremes()
    rng = np.random.default_rng(5)
    x = np.concatenate([gemm_gate._i64_operands(rng, 6, 9, 30), np.pad(a64, ((0, 0), (0, 8)))])
    y = np.concatenate([gemm_gate._i64_operands(rng, 5, 9, 20), np.pad(b64, ((0, 0), (0, 8)))])
    for s in (0, 17):
        assert bit_equal(k.gemm_i64(x, y, s), py.gemm_i64(x, y, s))


def test_the_edge_inputs_catch_an_off_by_one_guard(monkeypatch):
    """With the guard's limit one too high, the norms 2^31 x 2^31 = 2^62 take the int32 path and
    2^31 wraps: the gate's edge rows expose it (run interpreted, where the break is patched in)."""
    py = kc.interpreted(MOD)
    crafted = gemm_gate._edge_rows(3)[-len(gemm_gate.CRAFTED) :]
    b = np.repeat(crafted, K.NR, axis=0)
    want, _ = _want16(crafted, b)
    monkeypatch.setattr(py, "_cap32", lambda nb: K.I64_MAX if nb == 0 else K.GUARD_LIMIT // nb)
    with np.errstate(over="ignore"):  # the int32 sum wraps, as the compiled one would
        c, _ = py.gemm_i16(crafted, b)
    assert not np.array_equal(c, want)


def _run_gate(monkeypatch, fault: str | None) -> GateContext:
    spec = REGISTRY["gemm_exact"]
    if fault is not None:
        module = faults.GuardedModule(kc.load_extension(kc.ensure(MOD)), MOD, fault)
        monkeypatch.setattr(GateContext, "compiled", lambda self, modname=None: module)
    ctx = GateContext(spec)
    spec.func(ctx)
    ctx.finish()
    return ctx


def test_the_gate_passes(monkeypatch):
    ctx = _run_gate(monkeypatch, None)
    assert [c.name for c in ctx.checks if not c.passed] == []
    assert {c.kind for c in ctx.checks} >= {"compiled", "reference", "deterministic", "property"}


# +1 on a clamped 2^31 - 1 wraps inside the fault itself, which numpy reports
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_the_gate_fails_on_a_corrupted_output(monkeypatch):
    failed = {c.name for c in _run_gate(monkeypatch, "lsb").checks if not c.passed}
    assert {"i16_random", "i16_edges", "i64_exact"} <= failed


def test_face_checks_its_arguments():
    a = np.zeros((2, 3), dtype=np.int16)
    with pytest.raises(ValueError, match="B must be int16, got int32"):
        face.gemm_i16(a, np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match=r"same K, got \(2, 3\) and \(2, 4\)"):
        face.gemm_i16(a, np.zeros((2, 4), dtype=np.int16))
    with pytest.raises(ValueError, match=r"shift must be in 0\.\.62, got 63"):
        face.gemm_i64(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), 63)
    with pytest.raises(ValueError, match="1 outputs outside the domain"):
        face.gemm_i64(np.full((1, 1), 2**62, np.int64), np.ones((1, 1), np.int64))
    with pytest.raises(ValueError, match="X must be finite"):
        face.matmul_nt([[np.nan]], [[1.0]])


def test_face_matmul_nt_is_the_exact_product_of_its_quantised_operands():
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((9, 300)), rng.standard_normal((5, 300)) * 1e-3
    y = face.matmul_nt(x, w)
    assert np.max(np.abs(y - x @ w.T)) < 1e-3 * np.max(np.abs(x @ w.T))
    big = np.full((2, 8), 30000.0)  # sums beyond int32: the int64 kernel takes over
    assert np.array_equal(face.matmul_nt(big, big), big @ big.T)
