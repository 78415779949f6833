"""The K3 block's layer schedule and the attention memory it implies, in integers.

K3 stacks 93 layers: three KDA layers, then one Gated MLA layer, repeated, with a final MLA layer
(1-based MLA layers 4, 8, ..., 92 and 93; K3-SPEC.md). `layer_schedule` writes that rule for any
depth and period; `attention_bytes` adds up what the attention layers hold at a context length:
a KDA layer keeps a state of fixed size, an MLA layer a latent cache that grows by one row per
token.

Formats: plain integers (int64 arithmetic). Domain and worst-case magnitudes: n_layers <= 2^16,
a KDA state < 2^31 bytes, an MLA row < 2^20 bytes per token, tokens <= 2^24, so
n_kda * state < 2^47 and n_mla * row * tokens < 2^60: the total is below 2^61 and exact.
`attention_bytes` returns -1 outside that domain. Error bound: 0, nothing is rounded.
"""

import numpy as np

from ..fx.kernels import bitlen, rmsnorm_row, rshift_round, sigmoid_q62, silu_q


# pythran export layer_schedule(int, int)
def layer_schedule(n_layers, period):
    """int8 [n_layers]: 1 (Gated MLA) where the 1-based layer l has l % period == 0 or
    l == n_layers, else 0 (KDA)."""
    kinds = np.zeros(n_layers, dtype=np.int8)
    for i in range(n_layers):
        layer = i + 1
        # MLA at l = period, 2 period, ..., and the last layer l = n_layers
        if layer % period == 0 or layer == n_layers:
            kinds[i] = 1
    return kinds


# pythran export attention_bytes(int8[:], int, int, int)
def attention_bytes(kinds, kda_state_bytes, mla_bytes_per_token, tokens):
    """Bytes the attention layers of a stack hold at `tokens` tokens: each KDA layer its fixed
    state, each MLA layer mla_bytes_per_token per token. -1 when an input is outside the exact
    domain (see the module docstring)."""
    if kda_state_bytes < 0 or kda_state_bytes >= 1 << 31:
        return -1
    if mla_bytes_per_token < 0 or mla_bytes_per_token >= 1 << 20:
        return -1
    if tokens < 0 or tokens > 1 << 24 or kinds.shape[0] > 1 << 16:
        return -1
    n_mla = 0
    for i in range(kinds.shape[0]):
        n_mla += int(kinds[i])
    n_kda = kinds.shape[0] - n_mla
    # total = n_kda S + n_mla c T
    return n_kda * kda_state_bytes + n_mla * mla_bytes_per_token * tokens


# == the composed block's glue (the HAVE gate k3block_forward) ==================================
# The block runs three KDA layers and one Gated MLA layer with Block AttnRes on the residual path
# and the LatentMoE FFN after each, on the kernels of k3gates.kda, .mla, .moe, .attnres and .fx.
# The functions below are only what no module has: the block's RMSNorm with its format change,
# the KDA layer's short convolution with SiLU and its beta, and the saturating residual add.
#
# Formats (int64 arithmetic; "Q.f" means v stands for v 2^-f):
#     residual stream (embedding, prefix, blocks, AttnRes a and m)  Q.24 int64, |.| <= 64
#         (RES_LIM = 2^30 raw: k3gates.attnres's source domain V_MAX)
#     attention layers' normed input x                              Q.16 (mla's X_FRAC)
#     FFN normed input                                              Q.24 (moe's X_FRAC)
#     KDA projections, conv outputs, v, o, o_n, the layers' y      Q.20 (kda's V_FRAC)
#     glue weights: conv taps, beta rows, head-norm weights         Q.16
#     block RMSNorm weights                                         Q.24
# Rounding: fx.rshift_round (half away from zero), once per stored value. Bounds are integers
# over 2^BOUND_FRAC in output LSB (a kernel holds no float); each is 1/2 LSB for the final
# rounding plus the 2^-10 LSB margin fx uses for everything before it.
BOUND_FRAC = 10
RES_FRAC = 24
RES_LIM = 1 << 30
X_FRAC = 16
ACT_FRAC = 20
GLUE_W_FRAC = 16
NORM_W_FRAC = 24
RESIDUAL_MAX_ERR_LSB_Q10 = 0  # the add is exact (a left shift and an integer sum)
NORM_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10, see norm_rows
CONV_SILU_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10, see conv_silu
BETA_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10, see head_sigmoid
NORM_MAX_WIDTH = 128  # the widest row norm_rows' bound is stated for
CONV_ACC_LIM = 1 << 44  # |conv| < 256 in Q.36: the domain conv_silu's bound is stated for


# pythran export norm_rows(int64[:,:] order(C), int64[:], int64, int64, int64, int64, int64)
def norm_rows(x, w, eps, fx, fw, fy, lim):
    """RMSNorm of each row into another format: out[t] = w x[t] / sqrt(mean(x[t]^2) + eps) in
    Q.fy, saturated at +-lim; returns (out int64 [T, n], saturations, the largest acc_shift).

    x in Q.fx with |x_raw| <= 2^31 (the residual stream: |x_raw| <= 2^30), w in Q.fw with
    |w_raw| <= 2^31, eps in Q.(2 fx) (<= 2^40). Each row takes the least acc_shift k >= 0 with
    2 bitlen(max|x|) + bitlen(n) - k <= 61 and calls fx.rmsnorm_row with eps >> k rounded, so
    the rounded sum of squares stays below 2^61 + n/2 + n eps < 2^62 for any row.
    Error, for n <= NORM_MAX_WIDTH = 128 and |out_raw| < 2^31: fx's 1/2 + |y_raw| 2^-59
    (< 2^-28 here), and when k > 0 the rounded squares and eps move the output by at most
    |y_raw| n / (4 acc) with acc >= 2^(58 - bitlen n): |y_raw| 2^(2 bitlen(n) - 60) <= 2^-13.
    Float64's own RMSNorm (relative 2^-50 on |y| < 2^7) adds < 2^-19 LSB: NORM_MAX_ERR =
    513/1024 LSB of Q.fy.
    """
    t_len, n = x.shape[0], x.shape[1]
    out = np.zeros((t_len, n), dtype=np.int64)
    y = np.zeros((t_len, n), dtype=np.int64)
    sat = 0
    top_shift = 0
    for t in range(t_len):
        amax = 0
        for j in range(n):
            amax = max(amax, abs(int(x[t, j])))
        k = max(0, 2 * bitlen(int(amax)) + bitlen(int(n)) - 61)
        top_shift = max(top_shift, k)
        # y_t = w x_t / sqrt(mean(x_t^2) + eps), rounded once into Q.fy
        rmsnorm_row(x, t, w, rshift_round(int(eps), int(k)), fx, fw, fy, k, y)
        for j in range(n):
            v = int(y[t, j])
            c = max(-lim, min(v, lim))
            sat += 1 if c != v else 0
            out[t, j] = c
    return out, sat, top_shift


# pythran export conv_silu(int64[:,:] order(C), int64[:,:] order(C), int64)
def conv_silu(u, wc, lim):
    """SiLU of the causal depthwise convolution (K3-SPEC section 1: q, k, v = SiLU(conv(W x))):
    out[t, c] = SiLU(sum_j wc[c, j] u[t - K + 1 + j, c]) in Q.20, saturated at +-lim; returns
    (out int64 [T, C], saturations). Rows before the first token count as zero (causal).

    u [T, C] in Q.20 (|u_raw| < 2^31), wc [C, K] in Q.16 (|wc| < 16, K = 4 in K3). The sum is
    exact in Q.36 (< K 2^31 2^20 = 2^53); fx.silu_q takes it unrounded and rounds once in Q.36
    (error 1/2 + |acc| 2^-55 LSB of Q.36), then one rounding to Q.20.
    Error, for |conv| < 256 (|acc| < 2^44, CONV_ACC_LIM): 1/2 LSB + 2^-16 (1/2 + 2^-11) LSB
    from the Q.36 SiLU, + float64's own 2^-24 LSB: CONV_SILU_MAX_ERR = 513/1024 LSB of Q.20.
    """
    t_len, ch = u.shape[0], u.shape[1]
    kw = wc.shape[1]
    out = np.zeros((t_len, ch), dtype=np.int64)
    sat = 0
    for t in range(t_len):
        for c in range(ch):
            acc = 0
            # acc = sum_j wc[c, j] u[t - K + 1 + j, c], Q.36
            for j in range(kw):
                s = t - kw + 1 + j
                if s >= 0:
                    acc += int(wc[c, j]) * int(u[s, c])
            v = rshift_round(silu_q(acc, ACT_FRAC + GLUE_W_FRAC), GLUE_W_FRAC)
            o = max(-lim, min(v, lim))
            sat += 1 if o != v else 0
            out[t, c] = o
    return out, sat


# pythran export head_sigmoid(int32[:,:] order(C), int64[:,:] order(C))
def head_sigmoid(x, wb):
    """KDA's beta_t = sigma(W_b x_t), one scalar per head (K3-SPEC section 1): int32 [T, H] in
    Q0.30 (kda's A_FRAC), in [0, 2^30].

    x [T, D] in Q.16 (|x| < 256), wb [H, D] in Q.16 (|wb| < 16): the logit is exact in Q.32
    (< D 2^24 2^20 = 2^57 for D <= 2^13), fx.sigmoid_q62 (within 2^-55) takes it unrounded,
    one rounding into Q0.30. Error 1/2 + 2^30 2^-55 LSB, and float64's sigma < 2^-22 LSB:
    BETA_MAX_ERR = 513/1024 LSB of Q0.30.
    """
    t_len, d = x.shape[0], x.shape[1]
    n_h = wb.shape[0]
    beta = np.zeros((t_len, n_h), dtype=np.int32)
    for t in range(t_len):
        for h in range(n_h):
            acc = 0
            # the logit W_b[h] . x_t in Q.32
            for i in range(d):
                acc += int(wb[h, i]) * int(x[t, i])
            beta[t, h] = rshift_round(sigmoid_q62(acc, 2 * GLUE_W_FRAC), 62 - 30)
    return beta


# pythran export residual_add(int64[:,:] order(C), int64[:,:] order(C), int64, int64)
def residual_add(prefix, y, shift, lim):
    """prefix + y 2^shift, saturated at +-lim: the residual stream's update (K3-SPEC section 3,
    steps 3 and 4: prefix += Attn(...), prefix += FFN(...)). Returns (out int64 [T, D],
    saturations). A sublayer's y in Q.(24 - shift) moves exactly into the stream's Q.24
    (shift 4 for the attention layers' Q.20, 0 for the FFN's Q.24). Exact below lim:
    RESIDUAL_MAX_ERR = 0. |prefix| <= lim <= 2^62, 0 <= shift <= 30, |y| < 2^31.
    """
    t_len, d = prefix.shape[0], prefix.shape[1]
    out = np.zeros((t_len, d), dtype=np.int64)
    sat = 0
    for t in range(t_len):
        for j in range(d):
            v = int(prefix[t, j]) + int(y[t, j]) * (1 << max(shift, 0))
            c = max(-lim, min(v, lim))
            sat += 1 if c != v else 0
            out[t, j] = c
    return out, sat
