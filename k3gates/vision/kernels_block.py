"""MoonViT3d's attention, GELU and temporal-pool patch merger in integers (K3-SPEC.md section 9,
per public ports); with fx.rmsnorm and gemm.gemm_i64 they make one vision block and the projector
(k3gates.vision.block runs the stages). Each stage has one rounding of an exact value, so each is
held against float64 on the integers it received.

Attention, bidirectional inside each image or chunk. Tokens are packed; cu [S + 1] holds the
segment starts (cu[0] = 0, cu[S] = N), and a query attends to the keys of its own segment only.
Per head of width dh (q, k in Q.20 after 2D RoPE, v in Q.16):

    z_j = round(q . k_j  scale / 2^(40 + 62 - 24))     Q.24; q . k_j exact; scale = dh^-1/2 in
                                                          Q0.62 (fx.rsqrt_q)
    P = softmax(z)                                       Q0.31, fx.softmax_row_q31
    o = round(sum_j P_j v_j / 2^31)                      Q.16; the sum exact

Both sums are gemm.gemm_i64 (exact inside its domain; a product outside it is counted and
returned, never silently wrong), one (segment, head) at a time, so scores and probabilities take
n^2 int64 per head for a segment of n tokens (128 MiB each at n = 4096).

Errors against float64 on the same integers: z within 1/2 LSB plus |q.k| times the scale's 2^-63
(below 2^-20 LSB for |q.k| < 2^19 real, the most q . k reaches in its domain); P within fx's
513/1024 LSB of its own logits; o within 1/2 LSB of its own P and v.

GELU (tanh form), for x in Q.16:

    GELU(x) = x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2

The argument is formed in Q.56 from x clamped to |x| <= 8 (beyond, tanh is within 2e^-49 of +-1,
so the clamp moves the output by below |x| 2^-70), tanh from fx.tanh_q62 (error < 2^-54), and the
product rounded once: error <= 1/2 + |x_raw| 2^-52 LSB, within 513/1024 LSB for |x_raw| < 2^42.

Merger. The frames of a chunk (up to 4) are averaged (an exact sum, one div_round: 1/2 LSB), the
patch grid is padded with zero patches to even sides, and each 2 x 2 group (rows 2i, 2i + 1,
columns 2j, 2j + 1, read row-major) is concatenated into one token of 4 D values.

Formats (int64 arithmetic): x, o and GELU values in Q.16, |raw| < 2^40; the attention's inputs
arrive as int32, half the memory of the packed batch (the caller checks their domain before the
cast), and are widened per head for gemm_i64: q, k in Q.20 with |raw| < 2^26, so q . k over 128
values stays below 2^59, and v in Q.16 with |raw| < 2^30, so sum_j P_j v_j stays below (2^31 +
n) 2^30 < 2^62; z in Q.24; P in Q0.31.
"""

import numpy as np

from ..fx.kernels import div_round, mul_round, rshift_round, softmax_row_q31, tanh_q62
from ..gemm.kernels import gemm_i64

Z_FRAC = 24  # attention logits: Q.24
QK_FRAC = 40  # q . k of two Q.20 rows
P_FRAC = 31  # probabilities: Q0.31
GELU_ARG_FRAC = 56  # GELU's tanh argument: Q.56
GELU_CLAMP = 8 << 16  # |x| beyond 8 (Q.16) leaves tanh saturated to below 2^-70
SQRT_2_OVER_PI_Q62 = 3679593073373651226  # round(sqrt(2/pi) 2^62), from 100 digits of pi
GELU_A_Q62 = 206211540313980650  # round(0.044715 2^62)
ONE_Q56 = 1 << 56
ONE_Q61 = 1 << 61


def _segment_of(cu, row):
    """(lo, hi): the packed segment holding token `row`."""
    s = 0
    while cu[s + 1] <= row:
        s += 1
    return int(cu[s]), int(cu[s + 1])


def column_block(x, r0, r1, c0, width):
    """x[r0:r1, c0:c0 + width] as a C-contiguous int64 array (gemm_i64's layout)."""
    out = np.zeros((r1 - r0, width), dtype=np.int64)
    for r in range(r1 - r0):
        for c in range(width):
            out[r, c] = x[r0 + r, c0 + c]
    return out


def _columns_t(x, r0, r1, c0, width):
    """The transpose of x[r0:r1, c0:c0 + width], C-contiguous int64 [width, r1 - r0]."""
    out = np.zeros((width, r1 - r0), dtype=np.int64)
    for r in range(r1 - r0):
        for c in range(width):
            out[c, r] = x[r0 + r, c0 + c]
    return out


def head_attention(q_h, k_h, v_t, scale):
    """One head over one segment: (z Q.24, P Q0.31, o Q.16, products outside gemm_i64's exact
    domain) for the query rows q_h [m, dh] (Q.20), keys k_h [n, dh] (Q.20), values v_t [dh, n]
    (Q.16, transposed)."""
    dots, out_a = gemm_i64(q_h, k_h, 0)  # q . k_j exactly, Q.40
    z = np.zeros((q_h.shape[0], k_h.shape[0]), dtype=np.int64)
    p = np.zeros((q_h.shape[0], k_h.shape[0]), dtype=np.int64)
    # omp parallel for
    for r in range(q_h.shape[0]):
        # z_j = q . k_j scale, Q.40 x Q0.62 -> Q.24;  P = softmax(z)
        for j in range(k_h.shape[0]):
            z[r, j] = mul_round(int(dots[r, j]), scale, QK_FRAC + 62 - Z_FRAC)
        softmax_row_q31(z, r, k_h.shape[0], Z_FRAC, p)
    o, out_b = gemm_i64(p, v_t, P_FRAC)  # o = sum_j P_j v_j, one rounding to Q.16
    return z, p, o, out_a + out_b


# pythran export attention(int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int64[:], int64, int64)
def attention(qs, keys, vals, cu, n_heads, scale):
    """(o [N, H dh] Q.16, products outside gemm_i64's domain): every token attends to its own
    segment (cu) in every head, one (segment, head) at a time."""
    dh = qs.shape[1] // n_heads
    o = np.zeros((qs.shape[0], qs.shape[1]), dtype=np.int64)
    outside = 0
    for s in range(cu.shape[0] - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        for head in range(n_heads):
            c0 = head * dh
            k_h = column_block(keys, lo, hi, c0, dh)
            v_t = _columns_t(vals, lo, hi, c0, dh)
            _z, _p, o_h, bad = head_attention(column_block(qs, lo, hi, c0, dh), k_h, v_t, scale)
            outside += bad
            for r in range(hi - lo):
                for c in range(dh):
                    o[lo + r, c0 + c] = o_h[r, c]
    return o, outside


# pythran export attention_row(int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int64[:], int64, int64, int64, int64)
def attention_row(qs, keys, vals, cu, n_heads, scale, row, head):
    """The stages of one query row and head, by the same code as `attention` (head_attention on one
    row): (z [n] Q.24, P [n] Q0.31, o [dh] Q.16) over the n keys of the row's segment."""
    dh = qs.shape[1] // n_heads
    lo, hi = _segment_of(cu, row)
    c0 = head * dh
    z, p, o, _bad = head_attention(column_block(qs, row, row + 1, c0, dh), column_block(keys, lo, hi, c0, dh),
                          _columns_t(vals, lo, hi, c0, dh), scale)  # fmt: skip
    return z[0].copy(), p[0].copy(), o[0].copy()


def gelu_q16(x):
    """GELU(x) (tanh form) in Q.16 for x in Q.16."""
    xc = min(max(x, -GELU_CLAMP), GELU_CLAMP)
    # arg = sqrt(2/pi) x (1 + 0.044715 x^2), in Q.56 (|arg| < 24.7)
    inner = ONE_Q56 + mul_round(xc * xc, GELU_A_Q62, 32 + 62 - GELU_ARG_FRAC)
    arg = mul_round(mul_round(xc, inner, 16), SQRT_2_OVER_PI_Q62, 62)
    t = tanh_q62(arg, GELU_ARG_FRAC)
    # y = x (1 + t) / 2, (1 + t) in Q0.61
    return mul_round(x, ONE_Q61 + rshift_round(t, 1), 62)


# pythran export gelu(int64[:,:] order(C))
def gelu(x):
    """GELU of every value of x [N, M] (Q.16)."""
    out = np.zeros((x.shape[0], x.shape[1]), dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = gelu_q16(int(x[i, j]))
    return out


# pythran export merge(int64[:,:] order(C), int64, int64, int64, int64)
def merge(x, frames, chunk, gh, gw):
    """x [frames gh gw, D] (Q.16, frame-major, each frame row-major over the grid): the chunks'
    frame means merged 2 x 2, [chunks ceil(gh/2) ceil(gw/2), 4 D] Q.16."""
    d = x.shape[1]
    mh, mw = (gh + 1) // 2, (gw + 1) // 2
    chunks = (frames + chunk - 1) // chunk
    out = np.zeros((chunks * mh * mw, 4 * d), dtype=np.int64)
    for ch in range(chunks):
        f0 = ch * chunk
        nf = min(chunk, frames - f0)
        for i in range(mh):
            for j in range(mw):
                tok = (ch * mh + i) * mw + j
                for part in range(4):
                    r, c = 2 * i + part // 2, 2 * j + part % 2
                    if r < gh and c < gw:
                        # mean over the chunk's frames of patch (r, c)
                        for e in range(d):
                            acc = 0
                            for f in range(f0, f0 + nf):
                                acc += int(x[(f * gh + r) * gw + c, e])
                            out[tok, part * d + e] = div_round(acc, nf)
    return out
