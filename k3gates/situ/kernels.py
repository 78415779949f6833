"""SiTU-GLU (K3-SPEC.md section 4) in integers only: forward, analytic backward, and integer SGD.

    SiTU-GLU(g, u) = [beta tanh(g/beta) sigma(g)] * [beta_lin tanh(u/beta_lin)],
    beta = 4, beta_lin = 25 (SITU_BETA, SITU_BETA_LIN), so |out| <= beta beta_lin = 100.

Formats. g, u: Q.frac in int64, 0 <= frac <= 56 (any magnitude: tanh and sigma saturate).
The three factors T_g = tanh(g/beta), S_g = sigma(g), T_u = tanh(u/beta_lin) are held in Q0.62
(k3gates.fx.kernels: tanh_q62 and sigmoid_q62, each within 2^-54 absolute), combined with the
exact Q0.62 high multiply, and rounded once into the output: Q7.24 (SITU_FRAC), which holds
+-100 inside int32. Rounding: half away from zero, as everywhere in fx, so the forward is odd in
u bit for bit. Division is only by the positive integers beta, beta_lin.

Bounds (output LSB, as integers over 2**BOUND_FRAC, like fx):
    beta_tanh_q24     beta tanh(x/beta), Q.24, beta <= 2^12       513/1024 LSB
    gate_factor_q24   beta tanh(g/beta) sigma(g), Q.24             513/1024 LSB
    situ_glu_q24      the forward, Q7.24, beta beta_lin <= 2^18    513/1024 LSB
    situ_glu_grad     dg, du in dout's format Q.fd, for beta <= 16 and
                      |dout_raw| max(beta, beta_lin) <= 2^38         513/1024 LSB
Each is 1/2 LSB for the final rounding plus a 2^-10 LSB margin; the analyses below leave all
earlier error under 2^-12 LSB.
"""

import numpy as np

from ..fx.kernels import (
    div_round,
    div_round_shift,
    mul_q62,
    mul_round,
    rshift_round,
    saturate,
    sigmoid_q62,
    tanh_q62,
)

BOUND_FRAC = 10
BETA_TANH_MAX_ERR_LSB_Q10 = 513  # 1/2 + 2^-10 LSB
GATE_FACTOR_MAX_ERR_LSB_Q10 = 513
SITU_MAX_ERR_LSB_Q10 = 513
SITU_GRAD_MAX_ERR_LSB_Q10 = 513

SITU_BETA = 4  # K3-SPEC section 4
SITU_BETA_LIN = 25
SITU_FRAC = 24  # output Q7.24: |out| <= 100 < 2^7
ONE = 1 << 62  # 1.0 in Q0.62
ARG_FRAC = 56  # fx's Q.56 argument format
TANH_SATURATED = 32  # tanh_q62 is exactly +-1 for |arg| >= 32

# the integer SGD trainer (train_mlp): every value Q.24; gradients summed in Q.32
TRAIN_FRAC = 24
GRAD_FRAC = 32
ERR_BITS = 28  # |yhat - y| saturates at 2^4 = 16 (2^28 raw), counted
WEIGHT_BITS = 30  # |w| saturates at 2^5 = 32 (2^29 raw; the signed 30-bit range), counted


# == the three factors ==========================================================================
def tanh_div_q62(x, frac, beta):
    """tanh(x / beta) in Q0.62 for x in Q.frac (0 <= frac <= 56) and an integer beta >= 1.

    x / beta is formed in Q.56 by one exact long division (error 2^-57, so tanh's error grows
    by at most 2^-57 to below 2^-53.9), after testing |x| // beta >= 32 2^frac, where tanh is 1
    in Q0.62; so the quotient stays below 2^62. Odd bit for bit.
    """
    a = abs(x)
    if a // beta >= (TANH_SATURATED << frac):
        t = ONE
    else:
        t = tanh_q62(div_round_shift(a, beta, ARG_FRAC - frac), ARG_FRAC)
    return t if x >= 0 else -t


def situ_parts(g, u, frac, beta, beta_lin):
    """(T_g, S_g, T_u) = (tanh(g/beta), sigma(g), tanh(u/beta_lin)), each in Q0.62."""
    return tanh_div_q62(g, frac, beta), sigmoid_q62(g, frac), tanh_div_q62(u, frac, beta_lin)


def beta_tanh_q24(x, frac, beta):
    """beta tanh(x / beta) in Q.24 for x in Q.frac. Error <= 1/2 + beta 2^-53.9 2^24 LSB,
    within BETA_TANH_MAX_ERR for beta <= 2^12."""
    return mul_round(tanh_div_q62(x, frac, beta), beta, 62 - SITU_FRAC)


def gate_factor_q24(g, frac, beta):
    """f(g) = beta tanh(g/beta) sigma(g) in Q.24 (the gate half of SiTU-GLU).

    Error: beta (2^-53.9 + 2^-55 + 2^-63) 2^24 + 1/2 LSB, within GATE_FACTOR_MAX_ERR for
    beta <= 2^12.
    """
    return mul_round(mul_q62(tanh_div_q62(g, frac, beta), sigmoid_q62(g, frac)), beta, 38)


# == forward ====================================================================================
def situ_from_parts(tg, sg, tu, beta, beta_lin):
    """beta beta_lin T_g S_g T_u in Q7.24 from Q0.62 factors: two Q0.62 products, one rounding.

    Each product adds 2^-63; the factors carry 2^-53.9, 2^-55, 2^-53.9, so the Q0.62 product is
    within 2^-52.4 and the output within 1/2 + beta beta_lin 2^-52.4 2^24 LSB: below
    SITU_MAX_ERR for beta beta_lin <= 2^18 (K3: 100, leaving 2^-21.8). |product| <= 2^62, so
    |out| <= beta beta_lin 2^24 exactly: the bound |out| <= 100 holds for the integers too.
    """
    # out = beta * beta_lin * tanh(g/beta) * sigma(g) * tanh(u/beta_lin)
    return mul_round(mul_q62(mul_q62(tg, sg), tu), beta * beta_lin, 62 - SITU_FRAC)


def situ_glu_q24(g, u, frac, beta, beta_lin):
    """SiTU-GLU(g, u) in Q7.24 for g, u in Q.frac. Error <= SITU_MAX_ERR (situ_from_parts)."""
    tg, sg, tu = situ_parts(g, u, frac, beta, beta_lin)
    return situ_from_parts(tg, sg, tu, beta, beta_lin)


# == backward ===================================================================================
def situ_grad_from_parts(tg, sg, tu, dout, beta, beta_lin):
    """(dg, du) = dout * (d out/dg, d out/du) in dout's own format, from the Q0.62 factors.

        d out/dg = h(u) f'(g),  f'(g) = (1 - T_g^2) S_g + beta T_g S_g (1 - S_g),  h = beta_lin T_u
        d out/du = f(g) h'(u),  f(g) = beta T_g S_g,  h'(u) = 1 - T_u^2

    f'(g) is held in Q(k).(62-k) with k = bitlen(beta) + 1 so that beta T S (1 - S) (at most
    beta/4) fits. From the factors' 2^-53.9 / 2^-55 errors: 1 - T_g^2 within 2^-52.9,
    T_g S_g (1 - S_g) within 2^-54.4, f'(g) within 2^-51.5 (beta = 4; beta 2^-54.4 grows with
    beta), T_u f'(g) within 2^-51.2, T_g S_g (1 - T_u^2) within 2^-52.1. So |dg - exact| <=
    1/2 + |dout_raw| beta_lin 2^-51.2 LSB and |du - exact| <= 1/2 + |dout_raw| beta 2^-52.1 LSB:
    within SITU_GRAD_MAX_ERR for beta <= 16 and |dout_raw| max(beta, beta_lin) <= 2^38.
    Saturated inputs give exactly 0 (T = +-1, or S in {0, 1}).
    """
    k = 1
    while (1 << (k - 1)) <= beta:
        k += 1
    sech2_g = ONE - mul_q62(tg, tg)
    ts = mul_q62(tg, mul_q62(sg, ONE - sg))
    fprime = rshift_round(mul_q62(sech2_g, sg), k) + beta * rshift_round(ts, k)  # Q(k).(62-k)
    # dg = dout * beta_lin * T_u * f'(g)
    dg = mul_round(dout * beta_lin, mul_q62(tu, fprime), 62 - k)
    # du = dout * beta * (T_g S_g) * (1 - T_u^2)
    du = mul_round(dout * beta, mul_q62(mul_q62(tg, sg), ONE - mul_q62(tu, tu)), 62)
    return dg, du


# == exported array versions ====================================================================
# pythran export beta_tanh_array(int64[:], int64, int64)
def beta_tanh_array(x, frac, beta):
    """beta_tanh_q24 elementwise."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(x.shape[0]):
        out[i] = beta_tanh_q24(int(x[i]), frac, beta)
    return out


# pythran export gate_factor_array(int64[:], int64, int64)
def gate_factor_array(g, frac, beta):
    """gate_factor_q24 elementwise."""
    out = np.zeros(g.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(g.shape[0]):
        out[i] = gate_factor_q24(int(g[i]), frac, beta)
    return out


# pythran export situ_glu_array(int64[:], int64[:], int64, int64, int64)
def situ_glu_array(g, u, frac, beta, beta_lin):
    """situ_glu_q24 elementwise: Q7.24 outputs."""
    out = np.zeros(g.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(g.shape[0]):
        out[i] = situ_glu_q24(int(g[i]), int(u[i]), frac, beta, beta_lin)
    return out


# pythran export situ_glu_grad_array(int64[:], int64[:], int64[:], int64, int64, int64)
def situ_glu_grad_array(g, u, dout, frac, beta, beta_lin):
    """(dg, du) elementwise, in dout's format (situ_grad_from_parts)."""
    dg = np.zeros(g.shape[0], dtype=np.int64)
    du = np.zeros(g.shape[0], dtype=np.int64)
    # omp parallel for
    for i in range(g.shape[0]):
        tg, sg, tu = situ_parts(int(g[i]), int(u[i]), frac, beta, beta_lin)
        dg[i], du[i] = situ_grad_from_parts(tg, sg, tu, int(dout[i]), beta, beta_lin)
    return dg, du


# == integer SGD on a SiTU-GLU MLP (the PROVEN gate) ============================================
def _forward_sample(x, n, w1, w3, w2, tg, sg, tu, act):
    """y_hat for sample n of y_hat = w2 . SiTU-GLU(w1 x, w3 x); the factors are kept for the
    backward pass. Magnitudes: |w| < 2^29, |x| <= 2^27 raw and d <= 64 keep w.x below 2^62;
    each w2 a (< 2^29 2^30.7) is rounded to Q.40 before the sum, so h <= 2^10 fits."""
    h = w2.shape[0]
    beta = SITU_BETA  # (a global passed as an argument upsets Pythran's constness analysis)
    beta_lin = SITU_BETA_LIN
    acc_y = 0
    # y_hat = sum_j w2_j SiTU-GLU(g_j, u_j)
    for j in range(h):
        # g = w1 x, u = w3 x in Q.24 (Q.48 products, one rounding)
        acc_g = 0
        acc_u = 0
        for k in range(x.shape[1]):
            xv = int(x[n, k])
            acc_g += int(w1[j, k]) * xv
            acc_u += int(w3[j, k]) * xv
        g = rshift_round(acc_g, TRAIN_FRAC)
        u = rshift_round(acc_u, TRAIN_FRAC)
        tg[j], sg[j], tu[j] = situ_parts(g, u, TRAIN_FRAC, beta, beta_lin)
        act[j] = situ_from_parts(int(tg[j]), int(sg[j]), int(tu[j]), beta, beta_lin)
        acc_y += rshift_round(int(w2[j]) * int(act[j]), 8)
    return rshift_round(acc_y, 16)


def _backward_sample(x, n, e, w2, tg, sg, tu, act, g1, g3, g2):
    """Accumulate dL/dw (up to the factor 2/N, folded into the learning rate) for sample n.

    dL/dw2 = e a, dL/da = e w2, (dL/dg, dL/du) = situ_grad(dL/da), dL/dw1 = dL/dg x^T,
    dL/dw3 = dL/du x^T; every product is rounded to Q.32 (GRAD_FRAC) before it is summed, so the
    sums are exact and independent of the sample order.
    """
    beta = SITU_BETA
    beta_lin = SITU_BETA_LIN
    # dw2_j += e a_j;  (dg_j, du_j) = situ_grad(e w2_j);  dw1_jk += dg_j x_k;  dw3_jk += du_j x_k
    for j in range(w2.shape[0]):
        g2[j] += mul_round(e, int(act[j]), 2 * TRAIN_FRAC - GRAD_FRAC)
        da = rshift_round(e * int(w2[j]), TRAIN_FRAC)
        dg, du = situ_grad_from_parts(int(tg[j]), int(sg[j]), int(tu[j]), da, beta, beta_lin)
        for k in range(x.shape[1]):
            g1[j, k] += mul_round(dg, int(x[n, k]), 2 * TRAIN_FRAC - GRAD_FRAC)
            g3[j, k] += mul_round(du, int(x[n, k]), 2 * TRAIN_FRAC - GRAD_FRAC)
    return 0


def _sgd_update(w, grad, lr_num, lr_shift):
    """w <- saturate(w - lr grad) in place, lr = lr_num / 2^lr_shift; returns how many
    weights saturated. grad is Q.32, so the step is grad lr_num / 2^(lr_shift + 8)."""
    count = 0
    # w_i <- saturate(w_i - lr grad_i)
    for i in range(w.shape[0]):
        v = int(w[i]) - mul_round(int(grad[i]), lr_num, lr_shift + GRAD_FRAC - TRAIN_FRAC)
        c = saturate(v, WEIGHT_BITS)
        count += 1 if c != v else 0
        w[i] = c
    return count


# pythran export train_mlp(int64[:,:] order(C), int64[:], int64[:,:] order(C), int64[:,:] order(C), int64[:], int64, int64, int64, int64[:])
def train_mlp(x, y, w1_init, w3_init, w2_init, steps, lr_num, lr_shift, order):
    """Full-batch integer gradient descent on MSE for y_hat = w2 . SiTU-GLU(w1 x, w3 x).

    x [N, d] and y [N] in Q.24 (|x|, |y| <= 8), weights in Q.24 (|w| < 32, saturating, counted),
    lr = lr_num / 2^lr_shift applied to sum_n e dy_hat/dw (so lr includes MSE's 2/N).
    `order` is the order the samples are visited in; every sum is exact, so any permutation
    gives the same bits. Returns (losses [steps + 1], the MSE in Q.24 before each step and after
    the last; w1, w3, w2; saturations of |y_hat - y| at 16 and of the weights at 32).
    """
    n_samples = x.shape[0]
    hidden = w2_init.shape[0]
    w1 = w1_init.copy()
    w3 = w3_init.copy()
    w2 = w2_init.copy()
    tg = np.zeros(hidden, dtype=np.int64)
    sg = np.zeros(hidden, dtype=np.int64)
    tu = np.zeros(hidden, dtype=np.int64)
    act = np.zeros(hidden, dtype=np.int64)
    losses = np.zeros(steps + 1, dtype=np.int64)
    saturations = 0
    for t in range(steps + 1):
        g1 = np.zeros((hidden, x.shape[1]), dtype=np.int64)
        g3 = np.zeros((hidden, x.shape[1]), dtype=np.int64)
        g2 = np.zeros(hidden, dtype=np.int64)
        loss = 0
        for idx in range(n_samples):
            n = int(order[idx])
            y_hat = _forward_sample(x, n, w1, w3, w2, tg, sg, tu, act)
            e = saturate(y_hat - int(y[n]), ERR_BITS + 1)
            saturations += 1 if e != y_hat - int(y[n]) else 0
            # loss = mean (y_hat - y)^2, each square rounded to Q.24
            loss += rshift_round(e * e, TRAIN_FRAC)
            if t < steps:
                _backward_sample(x, n, e, w2, tg, sg, tu, act, g1, g3, g2)
        losses[t] = div_round(loss, n_samples)
        if t < steps:
            saturations += _sgd_update(w1.reshape(-1), g1.reshape(-1), lr_num, lr_shift)
            saturations += _sgd_update(w3.reshape(-1), g3.reshape(-1), lr_num, lr_shift)
            saturations += _sgd_update(w2, g2, lr_num, lr_shift)
    return losses, w1, w3, w2, saturations
