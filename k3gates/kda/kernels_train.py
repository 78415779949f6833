"""K3-μ Kimi Delta Attention layer (K3-SPEC.md §1) in integers only: forward and backward.

The layer, per sequence (causal), x [B, T, d] already RMS-normed, N = 3 H dk channels, dv = dk:
    u = W_qkv x;  c_t = sum_j conv[:, j] u_{t-3+j};  a = SiLU(c)
    q = a_q / sqrt(|a_q|^2 + eps) dk^-1/2,  k = a_k / sqrt(|a_k|^2 + eps),  v = a_v  (per head)
    beta = sigmoid(W_b x);  sg = sigmoid(a_head (W_f x + dt_bias));  alpha = exp(-5 sg)
    S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T,  o_t = S_t^T q_t,  S_0 = 0
    y = W_o (RMSNorm(o) norm_w * sigmoid(W_go x))
The backward is backpropagation through time over the stored states (reference_kda.py lists
the equations). Everything rounds with fx.rshift_round (half away from zero), once per stored
value; exp, sigmoid, SiLU and the norms' rsqrt come from fx.kernels.

How the module is cut (compile memory). g++'s memory goes into the C++ types Pythran derives,
not into optimisation: a helper with loop-carried variables (fx.bitlen, div_round_shift,
rsqrt_norm, sigmoid_q62's reciprocal, exp_neg_q62) called on a value whose type is itself built
up in the same function (a local array written and read back, a variable reassigned in a loop)
makes those types nest without bound; one such call took g++ past its 6 GiB cap. So: every
such helper takes values read straight from an input array or an int argument, which is why
the forward runs as six passes (kda_fwd_lin, _act, _qkv, _rec, _rms, _out), each handing the
next its inputs; bitlen of a data value is an inline 63-step loop (`nb = k + 1`: a plain int
type); and no name is reused for values of different origin. The module compiles in about a
minute within 0.7 GB.

Formats ("Q.f": raw = round(value 2^f)), all int64, with the magnitudes the kernels assume:
    x, y                      Q.16   |x| <= 2^5 (contract)
    weights                   Q.20   |W| <= 2^3; a_head (a fixed buffer) in [1, 16]
    dy, dx, weight gradients  Q.24   |dy| <= 2^6
    u = W_qkv x               Q.24   |u| < 2^14 (64 products of 2^5 2^3), raw < 2^38
    c (conv out), a = SiLU(c) Q.32   |c| < 2^19 (raw < 2^51; silu_q's domain is 2^62)
    q (with dk^-1/2), k       Q.24   unit vectors (|k| <= 1, |q| <= dk^-1/2)
    v, S, o                   Q.26   and the gradients of q, k, v, o, alpha, beta
    dS (the state gradient G) Q.24
                              domain: |S|, |dS| < 2^37 / 2^ceil(log2(dk)/2) raw, so every row
                              and column 2-norm is < 2^37 raw (2^11 real for S, 2^13 for dS);
                              v is held to the same entry limit, do to 2^37 raw (2^11 real).
                              The head RMSNorm's 1/sqrt(eps) = 1000 amplifies dy beyond that
                              when a head's o is near 0 (e.g. at t = 0; training met do of
                              2362 real), so kda_bwd_rec scales such a sequence's do into the
                              domain (the recurrence is linear in do) and scales its outputs
                              back. A forward state beyond the domain, or a dS still beyond
                              it at the largest scaling, is counted in `flags`, and the face
                              raises StateDomainError
    alpha, beta               Q.24   (0, 1]
    sigmoid(z), sigmoid(gz)   Q.30   [0, 1]
    RMSNorm(o) without gain   Q.30   |.| <= sqrt(dv)
    o_n, gated                Q.24
    norm (h, e) pairs                value h 2^-e, h in [2^61, 2^62] (fx.rsqrt_norm)
    weight-gradient sums      Q.40   exact int64 sums of one-rounding products; |grad| < 2^23
                                     (dW_o: an exact Q.48 token sum, two limbs, see kda_bwd_out)
In the recurrence, a unit k or q (2^24 raw) times a state column (2-norm < 2^37) sums below
2^61 by Cauchy-Schwarz. Where two wide vectors meet (S do, G e, P G^T k, e . G^T k) one side is
put in block floating point first: shifted right by the `_bfp_shift` that brings its 2-norm
under 2^24 (relative precision >= 2^-24 of the vector's norm), and the sum shifted back.
dalpha_i = sum_j dP_ij S_ij splits S into 14-bit limbs (two products below 2^60).

Error against float64 on the same integer inputs (measured on the K3-μ shapes and declared
with margin in the constants below; the tests hold the kernels to them). Bounds are in output
LSB as a relative part of the output's max-abs plus an absolute part:
    forward y:   Y_MAX_ERR_LSB
    backward:    GRAD_MAX_ERR_REL_Q20 * max|ref| / 2^20 + GRAD_MAX_ERR_LSB
The error sources are the per-token roundings of S (1/2 LSB of Q.26 per entry; the map
S -> (I - beta k k^T) Diag(alpha) S is non-expansive, so T of them add), of u, q, k, alpha,
beta in Q.24 (2^-25 each, the leading terms) and the final rounding into Q.16 / Q.24. Measured
(tests/test_k3mu_kda.py, d = 8 and d = 64): forward <= 0.6 LSB, backward <= 2e-5 of max-abs,
so the declared bounds hold a margin of 25x and 50x.
"""

import numpy as np

from ..fx.kernels import (
    ONE_Q62,
    bitlen,
    div_round,
    div_round_shift,
    exp_neg_q62,
    mul_q62,
    mul_round,
    rshift_round,
    rsqrt_norm,
    sigmoid_q62,
    silu_q,
)
from ..gemm.kernels import gemm_i64, sum_outer, token_rows, transpose

X_FRAC = 16  # activations x, y
W_FRAC = 20  # weights
CONV_SHIFT = 12  # conv (Q.20) x u (Q.24) = Q.44 -> c in Q.32
D_FRAC = 24  # dy, dx, gradients
U_FRAC = 24  # u = W_qkv x
F_FRAC = 24  # the gate's input W_f x + dt_bias (|.| < 2^15, raw < 2^39)
C_FRAC = 32  # conv output c and a = SiLU(c)
K_FRAC = 24  # q, k, alpha, beta
S_FRAC = 26  # v, S, o and the gradients of q, k, v, o, alpha, beta
DS_FRAC = 24  # dS (the state's gradient, G)
G_FRAC = 30  # sigmoid(z), sigmoid(gz), RMSNorm(o)
ACC_FRAC = 40  # weight-gradient sums
ONE_K = 1 << K_FRAC
ONE_G = 1 << G_FRAC
EPS_Q64 = 18446744073710  # round(1e-6 * 2**64): the L2 norms' eps for squares of Q.32
EPS_Q56 = 72057594038  # round(1e-6 * 2**56): the head RMSNorm's eps, rescaled to Q.(2 S_FRAC)
GATE_LOWER = 5  # K3's gate g = -5 sigma(.)
CONV = 4  # short-convolution kernel size
BFP_BITS = 24  # block floating point: a vector's 2-norm is brought under 2^24 raw
LIMB = 14  # dalpha's split of S into high and low limbs
STATE_NORM_BITS = 37  # the recurrence's domain: state row/column 2-norms < 2^37 raw
DO_SHIFT_STEP = 2  # kda_bwd_rec: how much further do is pre-shifted when dS left the domain
DO_SHIFT_TRIES = 16  # ... and how many times: up to 30 bits beyond do's own domain
# declared error bounds (the tests use these very constants)
Y_MAX_ERR_LSB = 16  # forward y, Q.16 LSB
GRAD_MAX_ERR_REL_Q20 = 1 << 10  # backward: 2^-10 (about 1e-3) of the max-abs of each output ...
GRAD_MAX_ERR_LSB = 64  # ... plus 64 LSB of Q.24


def _half_bits(n):
    """ceil(log2(n) / 2) rounded up so that 2^result >= sqrt(n), for n >= 1."""
    return (bitlen(n) + 1) >> 1


def _bfp_shift(m, n):
    """The right shift that brings a vector of n entries with max |entry| m under 2-norm 2^24.
    (kda_bwd_rec computes it inline, with bitlen(m) as a loop: see the module docstring.)"""
    return max(0, bitlen(m) + _half_bits(n) - BFP_BITS)


def _rsr(x, s):
    """x / 2^s rounded half away from zero (= fx.rshift_round) for a run-time 0 <= s <= 62 and
    |x| < 2^62, without a branch on s or on the sign (the negation is (q ^ sg) - sg with
    sg = x >> 63 in {0, -1}). Exact."""
    m = abs(x)
    q = (m + ((1 << s) >> 1)) >> s
    sg = x >> 63
    return (q ^ sg) - sg


def _mult(h, s, base):
    """The multiplier h 2^-s as an integer over 2^base (one rounding), so that a loop can use
    mul_round(a, M, base) with a constant shift. h <= 2^62; s >= base (the callers' norms are
    at most 1/sqrt(eps) = 1000 < 2^10, so s >= base holds for the bases chosen); 0 beyond."""
    if s - base > 62:
        return 0
    return rshift_round(h, max(s - base, 0))


def _norm_shift(m, n):
    """The right shift of n values with max |value| m that keeps their sum of squares < 2^62.
    (The kernels compute it inline, with bitlen(m) as a loop: see the module docstring.)"""
    return max(0, bitlen(m) - ((62 - bitlen(n)) >> 1))


def _state_limit(dk, dv):
    """Largest |S|, |dS| raw entry of the domain: rows and columns then have 2-norm < 2^37."""
    return (1 << STATE_NORM_BITS) >> _half_bits(max(dk, dv))


# pythran export kda_fwd_lin(int64[:,:,:] order(C), int64[:,:] order(C), int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:], int64[:], int64[:,:] order(C), int)
def kda_fwd_lin(x, w_qkv, conv, w_b, w_f, dt_bias, a_head, w_go, dk):
    """Forward, linear part (projections and the causal conv): (u [B,T,N] Q.24,
    c [B,T,N] Q.32, z [B,T,2Hdk+H]: the sigmoid arguments W_go x (Q.36), a_head (W_f x +
    dt_bias) (Q.44), W_b x (Q.36), and the number of projection outputs outside the shared
    GEMM's exact int64 domain (0 for the formats above)).
    The forward is cut into passes (kda_fwd_lin, kda_fwd_act, kda_fwd_qkv, kda_fwd_rec,
    kda_fwd_out) so that every non-linear helper (sigmoid, exp, rsqrt) takes values read from
    an input array: Pythran's C++ types of their internals then stay small, where values
    computed in the same function made g++ exceed its memory cap."""
    n_b, n_t = x.shape[0], x.shape[1]
    n_h = a_head.shape[0]
    hk = n_h * dk
    n3 = 3 * hk
    u = np.zeros((n_b, n_t, n3), dtype=np.int64)
    c = np.zeros((n_b, n_t, n3), dtype=np.int64)
    z = np.zeros((n_b, n_t, 2 * hk + n_h), dtype=np.int64)
    xr = token_rows(x)
    # u = W_qkv x (Q.36 -> Q.24); gz, beta and the gate's arguments from W_go, W_b, W_f
    ur, o1 = gemm_i64(xr, w_qkv, X_FRAC + W_FRAC - U_FRAC)
    gz, o2 = gemm_i64(xr, w_go, 0)
    fz, o3 = gemm_i64(xr, w_f, X_FRAC + W_FRAC - F_FRAC)
    bz, o4 = gemm_i64(xr, w_b, 0)
    outside = o1 + o2 + o3 + o4
    # omp parallel for
    for b in range(n_b):
        for t in range(n_t):
            r = b * n_t + t
            for ch in range(n3):
                u[b, t, ch] = ur[r, ch]
            for m in range(hk):
                z[b, t, m] = gz[r, m]
                # z = a_head (W_f x + dt_bias) in Q.44 (a_head <= 16: < 2^63)
                z[b, t, hk + m] = int(a_head[m // dk]) * (int(fz[r, m]) + (int(dt_bias[m]) << 4))
            for h in range(n_h):
                z[b, t, 2 * hk + h] = bz[r, h]
        # causal depthwise conv (Q.44 products rounded to Q.32)
        # (taps outermost: no branch inside the channel loop for gcc to unswitch)
        for t in range(n_t):
            for j in range(CONV):
                src = t - (CONV - 1) + j
                if src >= 0:
                    for ch in range(n3):
                        # one rounding per product: 4 products of 2^61 could pass 2^63
                        c[b, t, ch] += rshift_round(
                            int(conv[ch, j]) * int(u[b, src, ch]), CONV_SHIFT
                        )
    return u, c, z, outside


# pythran export kda_fwd_act(int64[:,:,:] order(C), int64[:,:,:] order(C))
def kda_fwd_act(c, z):
    """Forward, the sigmoids: (a = SiLU(c) [B,T,N] Q.32, gs [B,T,Hdk] Q.30, sg [B,T,Hdk] Q.30,
    ga [B,T,Hdk] Q.56 (the decay's exponent 5 sg), beta [B,T,H] Q.24)."""
    n_b, n_t, n3 = c.shape[0], c.shape[1], c.shape[2]
    hk = n3 // 3
    n_h = z.shape[2] - 2 * hk
    act = np.zeros((n_b, n_t, n3), dtype=np.int64)
    gs = np.zeros((n_b, n_t, hk), dtype=np.int64)
    sg = np.zeros((n_b, n_t, hk), dtype=np.int64)
    ga = np.zeros((n_b, n_t, hk), dtype=np.int64)
    beta = np.zeros((n_b, n_t, n_h), dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        for t in range(n_t):
            for m in range(hk):
                gs[b, t, m] = rshift_round(
                    sigmoid_q62(int(z[b, t, m]), X_FRAC + W_FRAC), 62 - G_FRAC
                )
                s62 = sigmoid_q62(int(z[b, t, hk + m]), W_FRAC + F_FRAC)
                sg[b, t, m] = rshift_round(s62, 62 - G_FRAC)
                ga[b, t, m] = GATE_LOWER * rshift_round(s62, 6)
            for h in range(n_h):
                s62 = sigmoid_q62(int(z[b, t, 2 * hk + h]), X_FRAC + W_FRAC)
                beta[b, t, h] = rshift_round(s62, 62 - K_FRAC)
            for ch in range(n3):
                act[b, t, ch] = silu_q(int(c[b, t, ch]), C_FRAC)
    return act, gs, sg, ga, beta


# pythran export kda_fwd_qkv(int64[:,:,:] order(C), int64[:,:,:] order(C), int)
def kda_fwd_qkv(act, ga, dk):
    """Forward, the L2 norms and the decay: (qkv [B,T,N] (q, k Q.24; v Q.26), nrm [B,T,2H,2]
    (the L2 norms' (h, e), q's including dk^-1/2), alpha = exp(-5 sg) [B,T,Hdk] Q.24,
    flags [B] (v entries outside the domain))."""
    n_b, n_t, n3 = act.shape[0], act.shape[1], act.shape[2]
    hk = n3 // 3
    n_h = hk // dk
    qkv = np.zeros((n_b, n_t, n3), dtype=np.int64)
    nrm = np.zeros((n_b, n_t, 2 * n_h, 2), dtype=np.int64)
    alpha = np.zeros((n_b, n_t, hk), dtype=np.int64)
    flags = np.zeros(n_b, dtype=np.int64)
    hs, es = rsqrt_norm(dk, 0)  # dk^-1/2 = hs 2^-es
    limit = _state_limit(dk, dk)
    nsh = (62 - bitlen(dk)) >> 1  # the norm shift is max(0, bitlen(m) - nsh)
    # omp parallel for
    for b in range(n_b):
        for t in range(n_t):
            for m in range(hk):
                alpha[b, t, m] = rshift_round(exp_neg_q62(int(ga[b, t, m])), 62 - K_FRAC)
            # q, k: L2 normalisation per head (q also times dk^-1/2); v to Q.26
            for hh in range(2 * n_h):
                base = hh * dk
                m = 0
                for i in range(dk):
                    m = max(m, abs(int(act[b, t, base + i])))
                nb = 0
                for k in range(63):
                    if (m >> k) != 0:
                        nb = k + 1
                r = max(0, nb - nsh)
                acc = rshift_round(EPS_Q64, 2 * r)
                for i in range(dk):
                    a = _rsr(int(act[b, t, base + i]), r)
                    acc += a * a
                hn = 0
                en = 0
                if acc > 0:
                    hn, en = rsqrt_norm(acc, 2 * C_FRAC - 2 * r)
                if hh < n_h:
                    hn = mul_q62(hn, hs)
                    en = en + es - 62
                nrm[b, t, hh, 0] = hn
                nrm[b, t, hh, 1] = en
                mk = _mult(hn, en + C_FRAC - K_FRAC, 60)  # Q.32 -> Q.24, s >= 60
                for i in range(dk):
                    qkv[b, t, base + i] = mul_round(int(act[b, t, base + i]), mk, 60)
            for i in range(hk):
                vv = rshift_round(int(act[b, t, 2 * hk + i]), C_FRAC - S_FRAC)
                qkv[b, t, 2 * hk + i] = vv
                if abs(vv) > limit:
                    flags[b] += 1
    return qkv, nrm, alpha, flags


# pythran export kda_fwd_rec(int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C))
def kda_fwd_rec(qkv, alpha, beta):
    """Forward, the recurrence: (S [B,T,H,dk,dv] Q.26 (S_t after token t), o [B,T,Hdk] Q.26,
    flags [B] (state entries outside the domain)). Each step gathers its head's vectors and
    state into small local arrays that the hot loops index with bare loop variables."""
    n_b, n_t = qkv.shape[0], qkv.shape[1]
    n_h = beta.shape[2]
    hk = alpha.shape[2]
    dk = hk // n_h
    S = np.zeros((n_b, n_t, n_h, dk, dk), dtype=np.int64)
    o = np.zeros((n_b, n_t, hk), dtype=np.int64)
    flags = np.zeros(n_b, dtype=np.int64)
    limit = _state_limit(dk, dk)
    # omp parallel for
    for b in range(n_b):
        st = np.zeros((dk, dk), dtype=np.int64)  # the head's state
        vec = np.zeros((6, dk), dtype=np.int64)
        # rows of vec: 0 q, 1 k, 2 v, 3 alpha, 4 P^T k then S_t^T q, 5 w
        for t in range(n_t):
            if flags[b] > 0:
                continue  # out of the domain: the face raises; skip the rest
            # the recurrence, per head: P = Diag(alpha) S_{t-1}, w = beta (v - P^T k),
            # S_t = P + k w^T, o = S_t^T q (S_{t-1} read at tp, scaled by live: no branch)
            tp = max(t - 1, 0)
            live = 1 if t > 0 else 0
            over = 0
            for h in range(n_h):
                qo = h * dk
                ko = hk + h * dk
                vo = 2 * hk + h * dk
                for j in range(dk):
                    vec[0, j] = qkv[b, t, qo + j]
                    vec[1, j] = qkv[b, t, ko + j]
                    vec[2, j] = qkv[b, t, vo + j]
                    vec[3, j] = alpha[b, t, qo + j]
                    vec[4, j] = 0
                for i in range(dk):
                    for j in range(dk):
                        st[i, j] = int(S[b, tp, h, i, j]) * live
                for i in range(dk):
                    al = int(vec[3, i])
                    ki = int(vec[1, i])
                    for j in range(dk):
                        p = rshift_round(al * int(st[i, j]), K_FRAC)
                        st[i, j] = p
                        vec[4, j] += ki * p
                bt = int(beta[b, t, h])
                for j in range(dk):
                    e = int(vec[2, j]) - rshift_round(int(vec[4, j]), K_FRAC)
                    vec[5, j] = rshift_round(bt * e, K_FRAC)
                    vec[4, j] = 0
                for i in range(dk):
                    ki = int(vec[1, i])
                    qi = int(vec[0, i])
                    for j in range(dk):
                        s = int(st[i, j]) + rshift_round(ki * int(vec[5, j]), K_FRAC)
                        st[i, j] = s
                        vec[4, j] += qi * s
                        over += int(abs(s) > limit)
                for i in range(dk):
                    for j in range(dk):
                        S[b, t, h, i, j] = st[i, j]
                for j in range(dk):
                    o[b, t, qo + j] = rshift_round(int(vec[4, j]), K_FRAC)
            flags[b] += over
    return S, o, flags


# pythran export kda_fwd_rms(int64[:,:,:] order(C), int)
def kda_fwd_rms(o, dk):
    """Forward, the head RMSNorm's argument: ms [B,T,H,2], the pair (mean(o^2) + eps as an
    integer, its fractional bits) that kda_fwd_out hands to fx.rsqrt_norm."""
    n_b, n_t, hk = o.shape[0], o.shape[1], o.shape[2]
    n_h = hk // dk
    ms = np.zeros((n_b, n_t, n_h, 2), dtype=np.int64)
    bdk = bitlen(dk)
    nsh = (62 - bdk) >> 1  # the norm shift is max(0, bitlen(m) - nsh)
    # omp parallel for
    for b in range(n_b):
        for t in range(n_t):
            for h in range(n_h):
                qo = h * dk
                # mean(o^2) + eps over dv, as in fx.rms_rsqrt_row
                m = 0
                for j in range(dk):
                    m = max(m, abs(int(o[b, t, qo + j])))
                nb = 0
                for k in range(63):
                    if (m >> k) != 0:
                        nb = k + 1
                r = max(0, nb - nsh)
                acc = dk * rshift_round(EPS_Q56, 56 - 2 * S_FRAC + 2 * r)
                for j in range(dk):
                    a = _rsr(int(o[b, t, qo + j]), r)
                    acc += a * a
                na = 0
                for k in range(63):
                    if (acc >> k) != 0:
                        na = k + 1
                s2 = max(0, 61 - na + bdk)
                ms[b, t, h, 0] = div_round_shift(acc, dk, s2)
                ms[b, t, h, 1] = 2 * S_FRAC - 2 * r + s2
    return ms


# pythran export kda_fwd_out(int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:],
#     int64[:,:] order(C), int64[:,:,:,:] order(C))
def kda_fwd_out(o, gs, norm_w, w_o, ms):
    """Forward, output side (the head RMSNorm, the output gate, W_o): (y [B,T,d] Q.16,
    oh [B,T,Hdk] Q.30 (RMSNorm(o) before the gain), rn [B,T,H,2] (its (h, e)),
    gated [B,T,Hdk] Q.24, W_o's outputs outside the GEMM's domain). Error of y (the whole
    forward): Y_MAX_ERR_LSB output LSB."""
    n_b, n_t, hk = o.shape[0], o.shape[1], o.shape[2]
    d = w_o.shape[0]
    dk = norm_w.shape[0]
    n_h = hk // dk
    oh = np.zeros((n_b, n_t, hk), dtype=np.int64)
    rn = np.zeros((n_b, n_t, n_h, 2), dtype=np.int64)
    gated = np.zeros((n_b, n_t, hk), dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        for t in range(n_t):
            for h in range(n_h):
                qo = h * dk
                hr, er = rsqrt_norm(int(ms[b, t, h, 0]), int(ms[b, t, h, 1]))
                rn[b, t, h, 0] = hr
                rn[b, t, h, 1] = er
                mr = _mult(hr, er + S_FRAC - G_FRAC, 48)  # s >= 48
                for j in range(dk):
                    ohv = mul_round(int(o[b, t, qo + j]), mr, 48)
                    oh[b, t, qo + j] = ohv
                    on = rshift_round(ohv * int(norm_w[j]), G_FRAC + W_FRAC - K_FRAC)
                    gated[b, t, qo + j] = rshift_round(on * int(gs[b, t, qo + j]), G_FRAC)
    # y = W_o gated (Q.44 -> Q.16)
    yr, outside = gemm_i64(token_rows(gated), w_o, W_FRAC + K_FRAC - X_FRAC)
    y = np.zeros((n_b, n_t, d), dtype=np.int64)
    for b in range(n_b):
        for t in range(n_t):
            for j in range(d):
                y[b, t, j] = yr[b * n_t + t, j]
    return y, oh, rn, gated, outside


# pythran export kda_bwd_out(int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:,:] order(C), int64[:,:,:] order(C), int64[:], int64[:,:] order(C))
def kda_bwd_out(dy, gated, oh, rn, gs, norm_w, w_o):
    """Backward, output side (W_o, the output gate, the head RMSNorm): (do [B,T,Hdk] Q.26,
    dgz [B,T,Hdk] Q.24, dw_o [d, Hdk] Q.24, dnorm_w [dk] Q.24, the GEMM outputs outside their
    exact domain: W_o^T dy's and dw_o's). dw_o = sum_t dy_t gated_t^T is one exact token sum
    (gemm.sum_outer: Q.48 products, a sum beyond int64 held in two limbs), rounded once."""
    n_b, n_t = dy.shape[0], dy.shape[1]
    n_h = rn.shape[2]
    dk = norm_w.shape[0]
    hk = n_h * dk
    out_do = np.zeros((n_b, n_t, hk), dtype=np.int64)
    out_dgz = np.zeros((n_b, n_t, hk), dtype=np.int64)
    g_nw = np.zeros((n_b, dk), dtype=np.int64)
    # dgated = W_o^T dy: Q.44 -> Q.32
    dgr, outside = gemm_i64(token_rows(dy), transpose(w_o), W_FRAC + D_FRAC - 32)
    # omp parallel for
    for b in range(n_b):
        dov = np.zeros((n_t, hk), dtype=np.int64)  # do, Q.26
        dgz = np.zeros((n_t, hk), dtype=np.int64)  # Q.24
        don = np.zeros(hk, dtype=np.int64)
        # -- output side: y = W_o gated, gated = o_n sigmoid(gz), o_n = RMSNorm(o) norm_w --
        for t in range(n_t):
            for m in range(hk):
                dgm = int(dgr[b * n_t + t, m])  # dgated Q.32
                gsv = int(gs[b, t, m])
                ohv = int(oh[b, t, m])
                don[m] = mul_round(dgm, gsv, G_FRAC)  # Q.32
                on = rshift_round(ohv * int(norm_w[m % dk]), G_FRAC + W_FRAC - K_FRAC)
                gsd = rshift_round(gsv * (ONE_G - gsv), G_FRAC)  # sigma (1 - sigma), Q.30
                dgz[t, m] = mul_round(mul_round(dgm, on, K_FRAC), gsd, 32 + G_FRAC - D_FRAC)
                g_nw[b, m % dk] += mul_round(int(don[m]), ohv, 32 + G_FRAC - ACC_FRAC)
            # RMSNorm back: do = r (w don - oh mean(oh w don))
            for h in range(n_h):
                qo = h * dk
                mdot = 0
                for j in range(dk):
                    wd = mul_round(int(don[qo + j]), int(norm_w[j]), W_FRAC)
                    mdot += mul_round(int(oh[b, t, qo + j]), wd, G_FRAC)
                mean = div_round(mdot, dk)
                hr = int(rn[b, t, h, 0])
                er = int(rn[b, t, h, 1])
                mr = _mult(hr, er + 32 - S_FRAC, 56)  # s >= 56
                for j in range(dk):
                    wd = mul_round(int(don[qo + j]), int(norm_w[j]), W_FRAC)
                    tv = wd - mul_round(int(oh[b, t, qo + j]), mean, G_FRAC)
                    dov[t, qo + j] = mul_round(tv, mr, 56)
        for t in range(n_t):
            for m in range(hk):
                out_do[b, t, m] = dov[t, m]
                out_dgz[b, t, m] = dgz[t, m]
    # dW_o = sum_t dy_t gated_t^T: Q.24 x Q.24 = Q.48 -> Q.24, one rounding
    dw_o, o2 = sum_outer(token_rows(dy), token_rows(gated), K_FRAC)
    return out_do, out_dgz, dw_o, _reduce2(g_nw), outside + o2


# pythran export kda_bwd_rec(int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:] order(C), int64[:,:,:,:,:] order(C))
def kda_bwd_rec(do, qkv, alpha, beta, S):
    """Backward through time: (dqkv [B,T,N] (dq, dk, dv) Q.26, dalpha [B,T,Hdk] Q.26,
    dbeta [B,T,H] Q.26, flags [B] (dS entries outside the domain at the largest pre-shift)).
    The backward through time is linear in do. A (sequence, head) whose do or dS would leave
    the domain runs with do shifted right by s bits (rounded: <= 2^(s-1) LSB per entry) and
    its outputs shifted back left; s grows by DO_SHIFT_STEP until dS fits. Wherever the domain
    holds unshifted, s = 0: the same arithmetic, bit for bit.
    Each step gathers its head's vectors and states into small local arrays that the hot loops
    index with bare loop variables only (no loop-invariant index for gcc to unswitch on)."""
    n_b, n_t = qkv.shape[0], qkv.shape[1]
    n_h = beta.shape[2]
    dk = S.shape[3]
    hk = n_h * dk
    n3 = 3 * hk
    out_dqkv = np.zeros((n_b, n_t, n3), dtype=np.int64)
    out_dal = np.zeros((n_b, n_t, hk), dtype=np.int64)
    out_dbt = np.zeros((n_b, n_t, n_h), dtype=np.int64)
    flags = np.zeros(n_b, dtype=np.int64)
    limit = _state_limit(dk, dk)
    # do only meets unit q (G += q do^T: 2^24 2^37 < 2^61) and, in block floating point, S
    do_limit = 1 << STATE_NORM_BITS
    lo_mask = (1 << LIMB) - 1
    hb = _half_bits(dk)  # 2^hb >= sqrt(dk)
    # omp parallel for
    for b in range(n_b):
        G = np.zeros((dk, dk), dtype=np.int64)  # dL/dS_t 2^-s, Q.24
        P = np.zeros((dk, dk), dtype=np.int64)  # Diag(alpha_t) S_{t-1}, Q.26
        sc = np.zeros((dk, dk), dtype=np.int64)  # S_t
        sp = np.zeros((dk, dk), dtype=np.int64)  # S_{t-1} (0 at t = 0)
        vec = np.zeros((13, dk), dtype=np.int64)
        # rows of vec: 0 q, 1 k, 2 v, 3 alpha, 4 do 2^-s, 5 block-floating-point vector,
        # 6 e = v - P^T k (Q.26), 7 G^T k then beta G^T k (Q.24), 8 its bfp copy,
        # 9 dq, 10 dk, 11 dv, 12 dalpha
        for h in range(n_h):
            qo = h * dk
            ko = hk + h * dk
            vo = 2 * hk + h * dk
            mdo = 0
            for t in range(n_t):
                for j in range(dk):
                    mdo = max(mdo, abs(int(do[b, t, qo + j])))
            s_do = 0  # the smallest shift that brings every do entry into the domain
            for k in range(63):
                if (mdo >> k) > do_limit:
                    s_do = k + 1
            over = 1
            for attempt in range(DO_SHIFT_TRIES):
                if over == 0:
                    break
                if attempt > 0:
                    s_do += DO_SHIFT_STEP
                over = 0
                for i in range(dk):
                    for j in range(dk):
                        G[i, j] = 0
                for tr in range(n_t):
                    t = n_t - 1 - tr
                    tp = max(t - 1, 0)
                    live = 1 if t > 0 else 0
                    for j in range(dk):
                        vec[0, j] = qkv[b, t, qo + j]
                        vec[1, j] = qkv[b, t, ko + j]
                        vec[2, j] = qkv[b, t, vo + j]
                        vec[3, j] = alpha[b, t, qo + j]
                        vec[4, j] = _rsr(int(do[b, t, qo + j]), s_do)
                    for i in range(dk):
                        for j in range(dk):
                            sc[i, j] = S[b, t, h, i, j]
                            sp[i, j] = int(S[b, tp, h, i, j]) * live
                    bt = int(beta[b, t, h])
                    # dq = S_t do (do in block floating point); G += q do^T
                    m = 0
                    for j in range(dk):
                        m = max(m, abs(int(vec[4, j])))
                    nb = 0
                    for k in range(63):
                        if (m >> k) != 0:
                            nb = k + 1
                    sh = min(max(0, nb + hb - BFP_BITS), S_FRAC)
                    for j in range(dk):
                        vec[5, j] = _rsr(int(vec[4, j]), sh)
                    for i in range(dk):
                        acc = 0
                        for j in range(dk):
                            acc += int(sc[i, j]) * int(vec[5, j])
                        vec[9, i] = _rsr(acc, S_FRAC - sh)
                        qi = int(vec[0, i])
                        for j in range(dk):
                            G[i, j] += rshift_round(qi * int(vec[4, j]), K_FRAC + S_FRAC - DS_FRAC)
                    # P = Diag(alpha) S_{t-1}, e = v - P^T k, gk = G^T k
                    for j in range(dk):
                        vec[6, j] = 0
                        vec[7, j] = 0
                    for i in range(dk):
                        al = int(vec[3, i])
                        ki = int(vec[1, i])
                        for j in range(dk):
                            p = rshift_round(al * int(sp[i, j]), K_FRAC)
                            P[i, j] = p
                            vec[6, j] += ki * p
                            vec[7, j] += ki * int(G[i, j])
                    me = 0
                    mg = 0
                    for j in range(dk):
                        vec[6, j] = int(vec[2, j]) - rshift_round(int(vec[6, j]), K_FRAC)
                        vec[7, j] = rshift_round(int(vec[7, j]), K_FRAC)
                        me = max(me, abs(int(vec[6, j])))
                        mg = max(mg, abs(int(vec[7, j])))
                    nb = 0
                    for k in range(63):
                        if (me >> k) != 0:
                            nb = k + 1
                    she = min(max(0, nb + hb - BFP_BITS), DS_FRAC)
                    ng = 0
                    for k in range(63):
                        if (mg >> k) != 0:
                            ng = k + 1
                    shg = min(max(0, ng + hb - BFP_BITS), DS_FRAC)
                    acc = 0
                    for j in range(dk):
                        vec[5, j] = _rsr(int(vec[6, j]), she)
                        vec[8, j] = _rsr(int(vec[7, j]), shg)
                        acc += int(vec[7, j]) * int(vec[5, j])
                    dbeta = _rsr(acc, DS_FRAC - she)  # dbeta = k^T G e
                    for j in range(dk):
                        vec[7, j] = rshift_round(bt * int(vec[7, j]), K_FRAC)  # beta G^T k, Q.24
                        vec[11, j] = int(vec[7, j]) * (1 << (S_FRAC - DS_FRAC))  # dv
                    # dk = beta (G e - P G^T k); dP = G - k dv^T; dalpha; G <- Diag(alpha) dP
                    for i in range(dk):
                        acc = 0
                        acp = 0
                        for j in range(dk):
                            acc += int(G[i, j]) * int(vec[5, j])
                            acp += int(P[i, j]) * int(vec[8, j])
                        xv = _rsr(acc, DS_FRAC - she) - _rsr(acp, DS_FRAC - shg)
                        vec[10, i] = rshift_round(bt * xv, K_FRAC)
                        ki = int(vec[1, i])
                        al = int(vec[3, i])
                        hi = 0
                        lo = 0
                        for j in range(dk):
                            dp = int(G[i, j]) - rshift_round(ki * int(vec[7, j]), K_FRAC)
                            spv = int(sp[i, j])
                            hi += dp * (spv >> LIMB)
                            lo += dp * (spv & lo_mask)
                            gn = rshift_round(al * dp, K_FRAC)
                            G[i, j] = gn
                            over += int(abs(gn) > limit)
                        vec[12, i] = rshift_round(hi + rshift_round(lo, LIMB), DS_FRAC - LIMB)
                    for j in range(dk):
                        out_dqkv[b, t, qo + j] = int(vec[9, j]) << s_do
                        out_dqkv[b, t, ko + j] = int(vec[10, j]) << s_do
                        out_dqkv[b, t, vo + j] = int(vec[11, j]) << s_do
                        out_dal[b, t, qo + j] = int(vec[12, j]) << s_do
                    out_dbt[b, t, h] = dbeta << s_do
            flags[b] += over
    return out_dqkv, out_dal, out_dbt, flags


# pythran export kda_bwd_in(int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:] order(C), int64[:,:,:,:] order(C), int64[:,:,:] order(C),
#     int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:], int64[:,:] order(C),
#     int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C))
def kda_bwd_in(
    dqkv_in, dal, dbt, dgz, x, u, c, qkv, nrm, alpha, sg, beta, a_head,
    w_qkv, conv, w_b, w_f, w_go,
):  # fmt: skip
    """Backward, input side (gates, L2 norms, SiLU, conv, the projections): (dx [B,T,d],
    dw_qkv, dconv, dw_b, dw_f, ddt_bias, dw_go, all Q.24; the projections' outputs outside the
    GEMM's domain). Weight gradients are exact Q.40 sums over all B T tokens, rounded once.
    Error (the whole backward): GRAD_MAX_ERR_REL_Q20 / 2^20 of each output's max-abs +
    GRAD_MAX_ERR_LSB LSB."""
    n_b, n_t, d = x.shape[0], x.shape[1], x.shape[2]
    n_h = a_head.shape[0]
    hk = alpha.shape[2]
    dk = hk // n_h
    n3 = 3 * hk
    n_g = n3 + n_h + 2 * hk
    # every projection's input gradient, one row per token: [du (Q.24) | dbz | dfz | dgz]
    dz_all = np.zeros((n_b * n_t, n_g), dtype=np.int64)
    g_conv = np.zeros((n_b, n3, CONV), dtype=np.int64)
    g_dt = np.zeros((n_b, hk), dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        dqkv = np.zeros((n_t, n3), dtype=np.int64)  # dq, dk, dv Q.26, then da Q.32
        dc = np.zeros((n_t, n3), dtype=np.int64)  # dc Q.24
        du = np.zeros((n_t, n3), dtype=np.int64)  # du Q.44
        dfz = np.zeros((n_t, hk), dtype=np.int64)  # Q.24
        dbz = np.zeros((n_t, n_h), dtype=np.int64)  # Q.24
        for t in range(n_t):
            for m in range(n3):
                dqkv[t, m] = dqkv_in[b, t, m]
        # -- gates, L2 norms, SiLU --
        for t in range(n_t):
            for m in range(hk):
                # dz = dalpha alpha (-5) sigma (1 - sigma); dfz = a_head dz (also d dt_bias)
                t1 = mul_round(int(dal[b, t, m]), int(alpha[b, t, m]), K_FRAC)  # Q.26
                sgv = int(sg[b, t, m])
                sgd = rshift_round(sgv * (ONE_G - sgv), G_FRAC)  # Q.30
                dz = -mul_round(GATE_LOWER * t1, sgd, S_FRAC + G_FRAC - 32)  # Q.32
                f32 = mul_round(dz, int(a_head[m // dk]), W_FRAC)
                g_dt[b, m] += f32 * (1 << (ACC_FRAC - 32))
                dfz[t, m] = rshift_round(f32, 32 - D_FRAC)
            for h in range(n_h):
                bv = int(beta[b, t, h])
                bsg = rshift_round(bv * (ONE_K - bv), K_FRAC)  # beta (1 - beta), Q.24
                dbz[t, h] = rshift_round(int(dbt[b, t, h]) * bsg, S_FRAC + K_FRAC - D_FRAC)
            for hh in range(2 * n_h):
                base = hh * dk
                dot = 0
                for i in range(dk):
                    dot += int(qkv[b, t, base + i]) * int(dqkv[t, base + i])
                dot = rshift_round(dot, K_FRAC)  # Q.26
                # q = a s dk^-1/2: da = s dk^-1/2 (dq - dk q (q . dq)); k: da = s (dk - k (k . dk))
                mult = dk if hh < n_h else 1
                hn = int(nrm[b, t, hh, 0])
                en = int(nrm[b, t, hh, 1])
                mn = _mult(hn, en + S_FRAC - 32, 46)  # s >= 46
                for i in range(dk):
                    tv = int(dqkv[t, base + i]) - mult * rshift_round(
                        int(qkv[b, t, base + i]) * dot, K_FRAC
                    )
                    dqkv[t, base + i] = mul_round(tv, mn, 46)  # da Q.32
            for i in range(hk):
                dqkv[t, 2 * hk + i] = int(dqkv[t, 2 * hk + i]) * (1 << (32 - S_FRAC))
            for ch in range(n3):
                # SiLU'(c) = sigma(c) (1 + c (1 - sigma(c))), Q.32
                cv = int(c[b, t, ch])
                s62 = sigmoid_q62(cv, C_FRAC)
                dsil = mul_round(s62, (1 << 32) + mul_round(cv, ONE_Q62 - s62, 62), 62)
                dc[t, ch] = mul_round(int(dqkv[t, ch]), dsil, 64 - D_FRAC)
        # -- the causal conv back: dconv = sum_t dc_t u_{t-3+j}, du_s = sum_j conv_j dc_{s+3-j}
        for t in range(n_t):
            for j in range(CONV):
                src = t - (CONV - 1) + j
                if src >= 0:
                    for ch in range(n3):
                        dcv = int(dc[t, ch])
                        g_conv[b, ch, j] += mul_round(
                            dcv, int(u[b, src, ch]), D_FRAC + U_FRAC - ACC_FRAC
                        )
                        du[src, ch] += int(conv[ch, j]) * dcv
        for t in range(n_t):
            r = b * n_t + t
            for ch in range(n3):
                dz_all[r, ch] = rshift_round(int(du[t, ch]), W_FRAC)  # du Q.24
            for h in range(n_h):
                dz_all[r, n3 + h] = dbz[t, h]
            for m in range(hk):
                dz_all[r, n3 + n_h + m] = dfz[t, m]
                dz_all[r, n3 + n_h + hk + m] = dgz[b, t, m]
    # -- the projections, by the shared GEMM: weight gradients G^T x (Q.24 x Q.16 = Q.40, exact
    # over all B T tokens, rounded once to Q.24) and dx = the sum of W^T g (Q.44, rounded once)
    g_all, o1 = gemm_i64(transpose(dz_all), transpose(token_rows(x)), ACC_FRAC - D_FRAC)
    w_all = np.zeros((n_g, d), dtype=np.int64)
    for i in range(d):
        for ch in range(n3):
            w_all[ch, i] = w_qkv[ch, i]
        for h in range(n_h):
            w_all[n3 + h, i] = w_b[h, i]
        for m in range(hk):
            w_all[n3 + n_h + m, i] = w_f[m, i]
            w_all[n3 + n_h + hk + m, i] = w_go[m, i]
    dxr, o2 = gemm_i64(dz_all, transpose(w_all), W_FRAC)
    dx = np.zeros((n_b, n_t, d), dtype=np.int64)
    for b in range(n_b):
        for t in range(n_t):
            for i in range(d):
                dx[b, t, i] = dxr[b * n_t + t, i]
    return (
        dx,
        g_all[0:n3].copy(),
        _reduce3(g_conv),
        g_all[n3 : n3 + n_h].copy(),
        g_all[n3 + n_h : n3 + n_h + hk].copy(),
        _reduce2(g_dt),
        g_all[n3 + n_h + hk : n_g].copy(),
        o1 + o2,
    )


def _reduce3(g):
    """sum over sequences of [B, R, C] Q.40, rounded once to Q.24."""
    out = np.zeros((g.shape[1], g.shape[2]), dtype=np.int64)
    for r in range(g.shape[1]):
        for col in range(g.shape[2]):
            acc = 0
            for b in range(g.shape[0]):
                acc += int(g[b, r, col])
            out[r, col] = rshift_round(acc, ACC_FRAC - D_FRAC)
    return out


def _reduce2(g):
    """sum over sequences of [B, R] Q.40, rounded once to Q.24."""
    out = np.zeros(g.shape[1], dtype=np.int64)
    for r in range(g.shape[1]):
        acc = 0
        for b in range(g.shape[0]):
            acc += int(g[b, r])
        out[r] = rshift_round(acc, ACC_FRAC - D_FRAC)
    return out
