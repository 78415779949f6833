"""Integer RoPE for the models whose long context does come from RoPE scaling (K3-SPEC section 7).

K3's MLA is NoPE and its KDA layers carry position in their recurrence, so K3 itself uses none of
this. Other 1M-token models reach their window by rescaling RoPE's frequencies (NTK, YaRN), and
the census names that path, so here it is in integers.

A rotation angle is held as a *phase in turns*: an unsigned Q0.62 fraction of a full turn. The
phase of position m on frequency f is (m f) mod 2^62, computed exactly (`phase_q62`), so range
reduction is exact at any position: no angle ever grows, and phase(m) - phase(n) = phase(m - n)
(mod 2^62) bit for bit. sin and cos come from fx's sincos_q31 (Q0.31, error <= 1/2 + 2^-23 LSB).

The frequency table inv_freq[i] = base^(-2i/D), rescaled by NTK or YaRN, is a per-model constant:
it is derived exactly on the host (80-digit decimal logarithms, k3gates/fx/host.py, so the same
integers on every CPU) and handed in as f[i] = round(inv_freq[i] / (2 pi) * 2^62) turns per
position (|error| <= 1/2 of 2^-62 turns).
Everything per token is integer.

Formats (int32 storage, int64 arithmetic):
    x (a query or key row)    Q.X_FRAC = Q.20, |x_raw| <= 2^30 (so |x c - y s| <= 2^62)
    f (frequencies)           Q0.62 turns per position, 0 <= f < 2^62
    positions m               0 <= m < 2^31
    mscale (YaRN's factor)    Q.30, 0 < mscale <= 2^31 (a factor of at most 2)
    output                    Q.20, saturated to int32 (counted)
Rotation (the half-split layout of the HF convention: pairs (i, i + D/2)):
    out_i        = mscale (x_i cos theta_i - x_{i+D/2} sin theta_i)
    out_{i+D/2}  = mscale (x_{i+D/2} cos theta_i + x_i sin theta_i)
with one rounding, the exact product (x c - y s) * mscale / 2^61 by fx.mul_round.

Error against float64's rotation by the float frequencies, in output LSB (`rope_bound_q10`):
    1/2 (the one rounding)
  + mscale (|x| + |y|) (E + d)   with E = (1/2 + 2^-23) 2^-31, sin/cos's error, and d the angle
                                 error at position m_max: 2 pi m_max 2^-63 < 7 m_max 2^-63 from
                                 the frequency's rounding to 2^-62 turns, plus float64's own
                                 rounding of m freq, m_max 2^-53 for freq <= 1 rad per position.
"""

import numpy as np

from ..fx.kernels import mul_round, sincos_q31

PHASE_BITS = 62  # phases are Q0.62 turns
PHASE_MASK = (1 << PHASE_BITS) - 1
MASK31 = (1 << 31) - 1
X_FRAC = 20  # rotated rows: Q.20
MSCALE_FRAC = 30  # YaRN's attention factor: Q.30
ONE_MSCALE = 1 << MSCALE_FRAC
DATA_MAX = (1 << 31) - 1
BOUND_FRAC = 10  # bounds are integers over 2^10 (a kernel holds no float)
SINCOS_ERR_Q41 = 513  # sin/cos error (1/2 + 2^-23 of 2^-31, rounded up): 513 * 2^-41


def rope_bound_q10(x_max, mscale, pos_max):
    """The declared bound of rope_rotate in output LSB, as an integer over 2^10 (rounded up).

    x_max: the largest |x_raw| of the inputs; mscale in Q.30; pos_max: the largest position.
    1/2 + mscale 2 x_max (513 2^-41 + 7 pos_max 2^-63 + pos_max 2^-53), rounded up.
    """
    per_unit = (SINCOS_ERR_Q41 << 22) + 7 * pos_max + (pos_max << 10)  # E + d, units of 2^-63
    num = mscale * 2 * x_max * per_unit  # in units of 2^-(63 + 30) output LSB
    den_shift = 63 + MSCALE_FRAC - BOUND_FRAC
    return (1 << (BOUND_FRAC - 1)) + ((num + (1 << den_shift) - 1) >> den_shift)


def phase_q62(m, f):
    """(m f) mod 2^62 exactly, for 0 <= m < 2^31 and 0 <= f < 2^62: the angle in Q0.62 turns.

    With f = f_hi 2^31 + f_lo: m f = (m f_hi mod 2^31) 2^31 + m f_lo (mod 2^62), and every
    product stays below 2^62 (m, f_lo < 2^31; f_hi < 2^31), so nothing wraps.
    """
    hi = (m * (f >> 31)) & MASK31
    return ((hi << 31) + m * (f & MASK31)) & PHASE_MASK


# pythran export rope_phases(int64[:], int64[:])
def rope_phases(pos, freq):
    """phase[p, i] = (pos[p] freq[i]) mod 2^62, int64 [P, D/2], exact (phase_q62)."""
    phases = np.zeros((pos.shape[0], freq.shape[0]), dtype=np.int64)
    for p in range(pos.shape[0]):
        for i in range(freq.shape[0]):
            phases[p, i] = phase_q62(int(pos[p]), int(freq[i]))
    return phases


# pythran export rope_rotate(int32[:,:] order(C), int64[:], int64[:], int64)
def rope_rotate(x, pos, freq, mscale):
    """Rotate each row x[p] (Q.20, D = 2 len(freq) columns) to position pos[p]:
    (int32 [P, D] in Q.20, saturations). Error: `rope_bound_q10` output LSB."""
    n, half = x.shape[0], freq.shape[0]
    out = np.zeros((n, 2 * half), dtype=np.int32)
    sat = 0
    # omp parallel for reduction(+:sat)
    for p in range(n):
        m = int(pos[p])
        for i in range(half):
            # theta_i = m f_i (turns);  (out_i, out_{i+D/2}) = mscale R(theta_i) (x_i, x_{i+D/2})
            s, c = sincos_q31(phase_q62(m, int(freq[i])), PHASE_BITS)
            a = int(x[p, i])
            b = int(x[p, i + half])
            lo = mul_round(a * c - b * s, mscale, 31 + MSCALE_FRAC)
            hi = mul_round(b * c + a * s, mscale, 31 + MSCALE_FRAC)
            lo_c = min(max(lo, -DATA_MAX), DATA_MAX)
            hi_c = min(max(hi, -DATA_MAX), DATA_MAX)
            sat += (lo != lo_c) + (hi != hi_c)
            out[p, i] = lo_c
            out[p, i + half] = hi_c
    return out, sat
