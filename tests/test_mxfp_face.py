"""The mxfp library face, against values worked out by hand from the OCP MX v1.0 definitions."""

from fractions import Fraction

import numpy as np
import pytest

import k3gates.mxfp as mx


def block(*head: float, fill: float = 0.0) -> np.ndarray:
    return np.array(list(head) + [fill] * (32 - len(head)), dtype=np.float32)


def test_e4m3_of_ones():
    # amax = 1 -> floor(log2) = 0 -> X = 0 - emax(8) = -8 -> byte 119; 1 / 2^-8 = 2^8 -> S.1111.000
    scales, codes = mx.quantize(block(fill=1.0), "e4m3")
    assert scales.tolist() == [119] and set(codes.tolist()) == {0x78}
    assert mx.dequantize(scales, codes, "e4m3").tolist() == [1.0] * 32


def test_e2m1_round_half_to_even_and_saturation():
    # amax 4 -> X = 0; 2.5 ties to 2 (even mantissa), 3.5 to 4, 0.25 to 0, 0.75 to 1, 5 to 4
    x = block(4.0, 2.5, 3.5, 0.25, 0.75, 5.0, -2.5, 1.25)
    s, c = mx.quantize(x, "e2m1")
    assert s.tolist() == [127]
    assert mx.dequantize(s, c, "e2m1")[:8].tolist() == [4.0, 2.0, 4.0, 0.0, 1.0, 4.0, -2.0, 1.0]
    # 7 lies between 6 and 8 with X = 0: the tie goes to 8 (even), which saturates to 6, never NaN
    s, c = mx.quantize(block(7.0, 1.0), "e2m1")
    assert s.tolist() == [127] and c[0] == 0b0111
    assert mx.dequantize(s, c, "e2m1")[:2].tolist() == [6.0, 1.0]


def test_e4m3_saturates_to_448_not_nan():
    s, c = mx.quantize(block(511.0, 1.0), "e4m3")  # X = 0, 511 > 448
    assert s.tolist() == [127] and c[0] == 0x7E
    assert mx.dequantize(s, c, "e4m3")[0] == 448.0


def test_nan_or_inf_gives_the_nan_scale():
    for bad in (np.nan, np.inf, -np.inf):
        s, c = mx.quantize(block(bad, 1.0), "e5m2")
        assert s.tolist() == [0xFF] and not c.any()
        assert np.isnan(mx.dequantize(s, c, "e5m2")).all()


def test_all_zero_block_and_signed_zero():
    s, c = mx.quantize(block(-0.0, 0.0, -0.0), "e4m3")
    assert s.tolist() == [0] and c[:3].tolist() == [0x80, 0x00, 0x80]
    y = mx.dequantize(s, c, "e4m3")
    assert (y == 0).all() and np.signbit(y[:3]).tolist() == [True, False, True]


def test_underflow_clamps_the_scale_to_two_to_the_minus_127():
    x = block(2.0**-130, 2.0**-149)  # shared_exp = -130 - 8 < -127
    s, c = mx.quantize(x, "e4m3")
    assert s.tolist() == [0]
    # 2^-130 / 2^-127 = 2^-3 (an E4M3 subnormal multiple of 2^-9); 2^-149 underflows to 0
    assert mx.dequantize(s, c, "e4m3")[:2].tolist() == [2.0**-130, 0.0]


def test_element_nan_codes_dequantize_to_nan_and_e5m2_inf_to_inf():
    s = np.array([127], dtype=np.uint8)
    c = np.zeros(32, dtype=np.uint8)
    c[0], c[1] = 0x7F, 0xFF
    assert np.isnan(mx.dequantize(s, c, "e4m3")[:2]).all()
    c[0], c[1], c[2] = 0x7C, 0xFC, 0x7D
    y = mx.dequantize(s, c, "e5m2")
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2])


def test_fp4_packing_low_nibble_is_the_even_index_and_bits_per_value():
    x = np.tile(np.array([1.0, -6.0, 0.5, 3.0], dtype=np.float32), 64)
    s, c = mx.quantize(x, "e2m1")
    packed = mx.pack_fp4(c)
    assert packed[0] == (c[0] | (c[1] << 4))
    assert np.array_equal(mx.unpack_fp4(packed), c)
    assert mx.bits_per_value(s, packed, x.size) == 4.25


def test_dot_is_exact():
    sa, ca = mx.quantize(block(fill=1.0), "e4m3")
    sb, cb = mx.quantize(block(fill=0.5), "e2m1")
    assert mx.dot(sa, ca, "e4m3", sb, cb, "e2m1") == 16.0
    # blocks whose float64 accumulation in order would lose the small one: 2^60 + 1 - 2^60
    a = np.zeros(96, dtype=np.float32)
    a[0], a[32], a[64] = 2.0**60, 1.0, -(2.0**60)
    b = np.zeros(96, dtype=np.float32)
    b[0], b[32], b[64] = 1.0, 1.0, 1.0
    sa, ca = mx.quantize(a, "e4m3")
    sb, cb = mx.quantize(b, "e2m1")
    assert mx.dot(sa, ca, "e4m3", sb, cb, "e2m1", exact=True) == Fraction(1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mx.quantize(np.zeros(31, np.float32), "e2m1"), "multiple of 32, got 31"),
        (
            lambda: mx.quantize(np.zeros(32, np.float64), "e2m1"),
            "expected dtype float32, got float64",
        ),
        (lambda: mx.quantize(np.zeros((2, 32), np.float32), "e2m1"), "expected a 1-D array"),
        (lambda: mx.quantize([0.0] * 32, "e2m1"), "expected a numpy array"),
        (lambda: mx.quantize(np.zeros(32, np.float32), "e3m4"), "unknown MX element format 'e3m4'"),
        (
            lambda: mx.dequantize(np.zeros(2, np.uint8), np.zeros(32, np.uint8), "e2m1"),
            "32 codes per scale",
        ),
        (
            lambda: mx.dequantize(np.zeros(1, np.uint8), np.full(32, 16, np.uint8), "e2m1"),
            "e2m1 codes are 4-bit",
        ),
    ],
)
def test_bad_input_raises_value_error_saying_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
