"""The backward pass of MoonViT3d's attention, GELU and patch merger in integers (K3-SPEC.md
section 9, per public ports). With gemm.gemm_i64 / gemm.sum_outer (linear layers), K3-μ's
rmsnorm_backward and longctx's rope_rotate (2D RoPE turned back), they give the gradients of one
vision block, the merger and the projector (k3gates.vision.backward runs the stages).

Gradients are Q.24 (int64), like K3-μ's. Every stage is one rounding of an exact value, so each
is held against float64 on the integers it received, within 1/2 LSB plus the terms stated.

Attention, one (segment, head) at a time, q, k in Q.20, v in Q.16, dO in Q.24; P (Q0.31) is
recomputed by the forward's own helper (kernels_block.head_attention), so it is the forward's P bit for
bit:

    dP_ij = round(dO_i . v_j / 2^20)                     Q.20, the dot exact (gemm_i64)
    D_i   = round(sum_j P_ij dP_ij / 2^31)               Q.20, the sum exact
    dS_ij = round(P_ij (dP_ij - D_i) scale / 2^89)       Q.24, the gradient of q_i . k_j;
                                                          scale = dh^-1/2 in Q0.62
    dq_i  = round(sum_j dS_ij k_j / 2^20)                 Q.24 (gemm_i64)
    dk_j  = round(sum_i dS_ij q_i / 2^20)                 Q.24 (gemm_i64)
    dv_j  = round(sum_i P_ij dO_i / 2^31)                 Q.24 (gemm_i64)

Errors against float64 on the same integers: 1/2 LSB each; dS adds |P (dP - D)| times the
scale's 2^-63, below 2^-30 LSB. Domain: |dP| < 2^30 raw (1024 real), so |P (dP - D)| < 2^62 and
sum_j P_ij dP_ij < (2^31 + n) 2^30 < 2^62; the three gemm_i64 products are inside gemm_i64's
domain or counted in `outside` (then the gradient is wrong and the caller stops).

GELU's derivative (tanh form), with t = tanh(c (u + a u^3)), c = sqrt(2/pi), a = 0.044715:

    GELU'(u) = (1 + t) / 2  +  u (1 - t^2) c (1 + 3 a u^2) / 2

formed in Q.56 from u clamped to |u| <= 8 (as the forward), then du = round(da GELU'(u) / 2^56).
The derivative's error is below 2^-46 real: tanh's 2^-54 and the argument's roundings make t
good to 2^-53; 1 - t^2 to 2^-52; times u c (1 + 3 a u^2) / 2 <= 4 8 = 2^5; the clamp moves
GELU' by below 2^-60. So |du error| <= 1/2 + |da_raw| 2^-46 LSB: within 1/2 + 2^-9 LSB
(GELU_BACK_ERR_Q10 / 2^10) for |da_raw| < 2^37 (|da| < 2^13 real).

Merger. The merge is linear: each merged value is the mean of its chunk's nf frames at one patch
(zero padding contributes nothing), so its adjoint hands every frame dm / nf, one div_round
(1/2 LSB; exact for a single frame).
"""

import numpy as np

from ..fx.kernels import div_round, mul_round, rshift_round, tanh_q62
from ..gemm.kernels import gemm_i64, transpose
from ..vision.kernels_block import (
    GELU_A_Q62,
    GELU_ARG_FRAC,
    GELU_CLAMP,
    ONE_Q56,
    ONE_Q61,
    SQRT_2_OVER_PI_Q62,
    column_block,
    head_attention,
)

G_FRAC = 24  # gradients: Q.24
V_FRAC = 16  # v: Q.16
QK_FRAC = 20  # q, k after RoPE: Q.20
P_FRAC = 31  # probabilities: Q0.31
DP_FRAC = 20  # dP and D: Q.20, room for |dP| up to 2^10
DP_MAX = 1 << 30  # |dP raw| below this keeps D's sum and P (dP - D) inside int64
GELU_A3_Q62 = 618634620941941950  # round(3 0.044715 2^62), exactly 3 GELU_A_Q62
GELU_BACK_ERR_Q10 = 514  # 1/2 + 2^-9 LSB, over 2^10
GELU_BACK_DA_MAX = 1 << 37  # |da raw| below this keeps GELU_BACK_ERR


def _head_backward(q_h, k_h, v_h, do_h, scale):
    """One head over one segment: (P, dP, D, dS, dq, dk, dv, outside) for q_h, k_h [n, dh]
    (Q.20), v_h [n, dh] (Q.16) and the output's gradient do_h [n, dh] (Q.24)."""
    n = q_h.shape[0]
    _z, p, _o, outside = head_attention(q_h, k_h, transpose(v_h), scale)  # the forward's own P
    dp, o1 = gemm_i64(do_h, v_h, G_FRAC + V_FRAC - DP_FRAC)
    d = np.zeros(n, dtype=np.int64)
    ds = np.zeros((n, n), dtype=np.int64)
    bad = 0
    # omp parallel for reduction(+:bad)
    for i in range(n):
        # D_i = sum_j P_ij dP_ij, exact, one rounding to Q.20
        acc = 0
        for j in range(n):
            if abs(dp[i, j]) >= DP_MAX:
                bad += 1
            acc += int(p[i, j]) * int(dp[i, j])
        d[i] = rshift_round(acc, P_FRAC)
        # dS_ij = P_ij (dP_ij - D_i) scale
        for j in range(n):
            ds[i, j] = mul_round(
                int(p[i, j]) * (int(dp[i, j]) - int(d[i])), scale, P_FRAC + DP_FRAC + 62 - G_FRAC
            )
    ds_t = transpose(ds)
    dq, o2 = gemm_i64(ds, transpose(k_h), QK_FRAC)
    dk, o3 = gemm_i64(ds_t, transpose(q_h), QK_FRAC)
    dv, o4 = gemm_i64(transpose(p), transpose(do_h), P_FRAC)
    return p, dp, d, ds, dq, dk, dv, outside + o1 + o2 + o3 + o4 + bad


def _scatter(dst, src, r0, c0):
    for r in range(src.shape[0]):
        for c in range(src.shape[1]):
            dst[r0 + r, c0 + c] = src[r, c]


# pythran export attention_backward(int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int64[:,:] order(C), int64[:], int64, int64)
def attention_backward(qs, keys, vals, d_o, cu, n_heads, scale):
    """(dq, dk [N, H dh] Q.24 for the RoPE'd q, k; dv [N, H dh] Q.24; outside): the gradients
    of `kernels_block.attention` for its output's gradient d_o [N, H dh] (Q.24), one (segment,
    head) at a time. `outside` counts products outside gemm_i64's domain and |dP| >= 2^30 raw:
    0 means every gradient is as stated."""
    dh = qs.shape[1] // n_heads
    dq = np.zeros((qs.shape[0], qs.shape[1]), dtype=np.int64)
    dk = np.zeros((qs.shape[0], qs.shape[1]), dtype=np.int64)
    dv = np.zeros((qs.shape[0], qs.shape[1]), dtype=np.int64)
    outside = 0
    for s in range(cu.shape[0] - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        for head in range(n_heads):
            c0 = head * dh
            out = _head_backward(column_block(qs, lo, hi, c0, dh), column_block(keys, lo, hi, c0, dh),
                                 column_block(vals, lo, hi, c0, dh), column_block(d_o, lo, hi, c0, dh),
                                 scale)  # fmt: skip
            _scatter(dq, out[4], lo, c0)
            _scatter(dk, out[5], lo, c0)
            _scatter(dv, out[6], lo, c0)
            outside += out[7]
    return dq, dk, dv, outside


# pythran export attention_backward_head(int32[:,:] order(C), int32[:,:] order(C), int32[:,:] order(C), int64[:,:] order(C), int64[:], int64, int64, int64, int64)
def attention_backward_head(qs, keys, vals, d_o, cu, n_heads, scale, seg, head):
    """Every stage of one (segment, head), by the same helper as `attention_backward`:
    (P Q0.31, dP, D Q.20, dS, dq, dk, dv Q.24) over the segment's n tokens ([n, n], [n], [n, dh])."""
    dh = qs.shape[1] // n_heads
    lo, hi = int(cu[seg]), int(cu[seg + 1])
    c0 = head * dh
    p, dp, d, ds, dq, dk, dv, _bad = _head_backward(
        column_block(qs, lo, hi, c0, dh), column_block(keys, lo, hi, c0, dh),
        column_block(vals, lo, hi, c0, dh), column_block(d_o, lo, hi, c0, dh), scale,
    )  # fmt: skip
    return p, dp, d, ds, dq, dk, dv


def gelu_grad_q56(u):
    """GELU'(u) in Q.56 for u in Q.16 (error below 2^-46 real; module docstring)."""
    uc = min(max(u, -GELU_CLAMP), GELU_CLAMP)
    u2 = uc * uc  # Q.32, < 2^38
    # t = tanh(c (u + a u^3)): the forward's argument, in Q.56
    inner = ONE_Q56 + mul_round(u2, GELU_A_Q62, 32 + 62 - GELU_ARG_FRAC)
    t = tanh_q62(mul_round(mul_round(uc, inner, 16), SQRT_2_OVER_PI_Q62, 62), GELU_ARG_FRAC)
    # (1 + t) / 2 in Q.56
    half_one_plus_t = rshift_round(ONE_Q61 + rshift_round(t, 1), 62 - GELU_ARG_FRAC)
    # u (1 - t^2) c (1 + 3 a u^2) / 2 in Q.56
    sech2 = (1 << 62) - mul_round(t, t, 62)  # Q.62
    slope = mul_round(ONE_Q56 + mul_round(u2, GELU_A3_Q62, 32 + 62 - GELU_ARG_FRAC),
                      SQRT_2_OVER_PI_Q62, 62)  # fmt: skip
    return half_one_plus_t + mul_round(uc, mul_round(sech2, slope, 62), 16 + 1)


# pythran export gelu_backward(int64[:,:] order(C), int64[:,:] order(C))
def gelu_backward(u, da):
    """du = da GELU'(u) [N, M] (Q.24) for the GELU input u (Q.16) and the output's gradient da
    (Q.24): within 1/2 + 2^-9 LSB of float64 for |da raw| < 2^37."""
    out = np.zeros((u.shape[0], u.shape[1]), dtype=np.int64)
    # omp parallel for
    for i in range(u.shape[0]):
        for j in range(u.shape[1]):
            out[i, j] = mul_round(int(da[i, j]), gelu_grad_q56(int(u[i, j])), GELU_ARG_FRAC)
    return out


# pythran export merge_backward(int64[:,:] order(C), int64, int64, int64, int64)
def merge_backward(dm, frames, chunk, gh, gw):
    """The adjoint of kernels_block.merge: dm [chunks ceil(gh/2) ceil(gw/2), 4 D] (Q.24) ->
    dx [frames gh gw, D] (Q.24), each frame of a chunk given dm / nf (one div_round)."""
    d = dm.shape[1] // 4
    mh, mw = (gh + 1) // 2, (gw + 1) // 2
    dx = np.zeros((frames * gh * gw, d), dtype=np.int64)
    for ch in range((frames + chunk - 1) // chunk):
        f0 = ch * chunk
        nf = min(chunk, frames - f0)
        for i in range(mh):
            for j in range(mw):
                tok = (ch * mh + i) * mw + j
                for part in range(4):
                    r, c = 2 * i + part // 2, 2 * j + part % 2
                    if r < gh and c < gw:
                        for e in range(d):
                            share = div_round(int(dm[tok, part * d + e]), nf)
                            for f in range(f0, f0 + nf):
                                dx[(f * gh + r) * gw + c, e] = share
    return dx
