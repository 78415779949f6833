"""K3-μ Gated MLA (NoPE), forward and backward, integers only (K3-SPEC.md section 2).

Per sequence b (independent, causal), x [B, T, d] already RMS-normed by the caller, with the
query side at rows t0 .. T-1 only (t0 = 0 for the whole layer; the passkey model, whose last
layer is scored at its answer rows alone, runs t0 = T - 5, and its y is 0 above t0):

    a_q  = W_dq x,   c_q  = RMSNorm(a_q) * q_norm            [T, q_lora]
    q    = W_uq c_q  (head h: rows h (nope + rope) .., first nope q_C, then rope q_r)
    a_kv = W_dkv x,  c_kv = RMSNorm(a_kv) * kv_norm          [T, kv_lora]  (the latent cache)
    k_r  = W_kr x    (shared by all heads, NoPE: never rotated)
    k_C  = W_uk c_kv,  v = W_uv c_kv
    z_ts = (q_C,t . k_C,s + q_r,t . k_r,s) (nope + rope)^-1/2 for s <= t;  P = softmax_s(z)
    o_t  = sum_s P_ts v_s;   u = W_g x;   G = o * sigmoid(u);   y = W_o G

Sizes come from the shapes only: rope = rows(W_kr), H = (rows(W_uq) - rows(W_uk)) / rope,
nope = rows(W_uk) / H, dv = rows(W_uv) / H (K3-μ: H 2, nope 32, rope 16, dv 32, lora 32).

Formats ("Q.f": raw = round(value 2^f); every array int64, C order):
    x (input)                Q.16   |x| <= 2^5 (raw <= 2^21)
    W (all matrices), gains  Q.20   |W| <= 2^3 (raw <= 2^23)
    y (output)               Q.16
    dy, dx, weight grads     Q.24   (GRAD_FRAC)
    a_q, a_kv, u             Q.36   exact sums W x, never rounded (|a| <= 2^14: raw <= 2^50)
    n = a r (unit-RMS)       Q.24   |n| <= sqrt(lora) ; r = rsqrt(mean a^2 + eps) as (h, e):
                                    r = h 2^-e, 2^61 <= h <= 2^62 (fx.rsqrt_norm), cached [B,T,2]
    c_q, q, c_kv, k_r, k_C,
    v, o, G and every internal
    activation gradient      Q.24   (INT_FRAC) DOMAIN |.| < 2^7 (raw < 2^31, INT_LIM), counted
    scores z, dP, mu, dS     Q.32   (S_FRAC) |z| < 2^22, |dP|, |dS| < 2^7
    P                        Q0.31  fx.softmax_row_q31 (1.0 = 2^31)
    sigmoid(u)               Q0.62  fx.sigmoid_q62
    eps                      1e-6 = EPS_Q60 / 2^60
Rounding: half away from zero (fx.rshift_round, fx.mul_round, and round_limbs, which is the same
rounding of a two-limb integer), once per stored value; every sum before it is exact.

Int64 headroom. A weight product is <= 2^23 2^31 = 2^54, so W-times-activation sums over <= 2^8
terms stay below 2^62 (x products: 2^44). Products of two Q.24 activations (scores, dP, P v, dS k)
would overflow a sum, so one factor a is split, a = (a >> L) 2^L + (a & (2^L - 1)) (exact for
negative a: >> floors), and the two partial sums hi, lo are each exact in int64, total =
hi 2^L + lo, rounded once by round_limbs:
    DOT_LIMB 24:  a <= 2^31 (Q.24 or P): hi terms <= 2^7 2^31, lo terms < 2^24 2^31 = 2^55;
                  sums over <= 2^7 terms (head widths, query rows) stay below 2^62.
    SUM_LIMB 16:  a <= 2^40 (dS, a Q.24 gradient): dS's row sums of |dS| <= 2 max|dP| scale
                  (< 2^41 raw), so the hi limb of dq = sum_s dS k sums to < 2^57 at any T and
                  the lo limb to < T 2^16 2^31, below 2^63 for T <= 2^15 (BACKWARD_MAX_T);
                  weight gradients, a <= 2^31 and b <= 2^31: hi, lo <= 2^47, so up to 2^15
                  tokens (B T) per sum.
Sums over the T keys of one query row need no split where P is a factor: sum_s P_s <= 2^31 +
2^19.1 (fx's softmax, T <= 2^20), so o = sum_s P v (|v| < 2^31) is below 2^62.001 in one int64,
and mu = sum_s P dP splits dP at bit 24 (both limbs below 2^61 for |dP| < 2^22). So the forward
serves T <= 2^20 keys (FORWARD_MAX_T) and the backward T <= 2^15; beyond, the count below
refuses the call.
The count returned last by each kernel is the number of internal Q.24 values at or beyond
INT_LIM (outside the domain above); the face refuses a nonzero count.

Error bounds against float64 on the same integer inputs (module constants the tests use).
Every internal Q.24 value carries its own rounding (1/2 LSB = 2^-25) plus what it inherits through
exact sums: the scores' and dP's Q.32 roundings (2^-33, below 2^-30 after P and the sums), fx's
softmax (1/2 LSB of Q0.31 per P, times |v| summed over T keys: T 2^-32 |v|), fx's rsqrt (2^-59
relative) and the norm's 2^-26 relative sum of squares. In the domain (|values| < 2^7, row-L1
norms of the weights <= 2^3, T <= 128) the inherited part of an internal activation stays below a
few 2^-25, so
    y (Q.16)    FORWARD_MAX_ERR_LSB = 1: 1/2 for y's rounding plus W_o times the errors of G
                (<= 2^3 4 2^-25 = 2^-20 = 2^-4 Q.16 LSB)
    dx, weight and gain gradients (Q.24), summed over n tokens: backward_max_err_lsb(n) =
                16 + 2 n LSB: per token, |activation| times the inherited error of the
                gradient it multiplies (a few LSB of Q.24, from the chain dy -> dG -> do -> dP
                -> dS -> dq/dk -> dc -> da) plus |gradient| times the activation's error.
At T keys beyond 128, the softmax's 1/2 LSB of Q0.31 per key adds T 2^-32 |v| to o, so y's
bound is forward_max_err_lsb(T) (|v| < 2^3, W_o row L1 <= 2^3, as the trained models hold).
These are engineering bounds (the chain above with its measured constants), not proofs. Measured
(tests/test_k3mu_mla.py, K3-μ sizes, x, dy ~ N(0, 1)): B 2, T 12 (n = 24): y 0.50 LSB of Q.16,
dx 3.8, weight gradients 6-17 LSB of Q.24 (bound 64); B 8, T 64 (n = 512): y 0.51, dx 4.5,
weight gradients 25-97 LSB (bound 1040), i.e. below 1e-6 of each gradient's RMS.

Speed (compiled, one thread, B 8, T 64, d 64): forward ~32 ms, backward ~35 ms. The forward's
time is mostly fx's sigmoid and exp (one per gate element and per causal score).
"""

import numpy as np

from ..fx.kernels import (
    bitlen,
    div_round,
    mul_q62,
    mul_round,
    rms_rsqrt_row,
    rshift_round,
    rsqrt_q,
    sigmoid_q62,
    softmax_row_q31,
)
from ..gemm.kernels import gemm_i64, round_limbs, sum_outer, token_rows, transpose

ACT_FRAC = 16  # x, y
W_FRAC = 20  # weights, norm gains
GRAD_FRAC = 24  # dy, dx, weight gradients
A_FRAC = ACT_FRAC + W_FRAC  # 36: a_q, a_kv, u, exact
INT_FRAC = 24  # internal activations and gradients
S_FRAC = 32  # scores, dP, mu, dS
P_FRAC = 31  # softmax probabilities
INT_LIM = 1 << 31  # the internal Q.24 domain |raw| < 2^31
ONE_Q62 = 1 << 62
EPS_FRAC = 60
EPS_Q60 = 1152921504607  # round(1e-6 * 2**60): the LoRA RMSNorms' eps
NORM_BITS = 26  # the sum of squares uses a rounded to 26 significant bits (rel. err 2^-26)
DOT_LIMB = 24
DOT_MASK = (1 << DOT_LIMB) - 1
SUM_LIMB = 16
SUM_MASK = (1 << SUM_LIMB) - 1

FORWARD_MAX_ERR_LSB = 1  # y, Q.16 LSB (measured 0.50)
BACKWARD_BASE_ERR_LSB = 16  # Q.24 LSB, dx and any gradient
BACKWARD_ERR_PER_TOKEN_LSB = 2  # Q.24 LSB per token in a weight gradient's sum


FORWARD_MAX_T = 1 << 20  # fx's softmax bound on sum_s P
BACKWARD_MAX_T = 1 << 15  # dq's low limb: T 2^16 2^31 < 2^63


def forward_max_err_lsb(t_len):
    """Declared bound of y (Q.16 LSB) against float64 with T keys: FORWARD_MAX_ERR_LSB plus the
    softmax's 1/2 LSB of Q0.31 per key through o (|v| < 2^3) and W_o (row L1 <= 2^3): T 2^-32
    2^3 2^3 in real units, 2^16 of that in LSB."""
    return FORWARD_MAX_ERR_LSB + (t_len >> 10)


def backward_max_err_lsb(n_tokens):
    """Declared bound (Q.24 LSB) of dx and each weight gradient summed over n_tokens tokens."""
    return BACKWARD_BASE_ERR_LSB + BACKWARD_ERR_PER_TOKEN_LSB * n_tokens


# == scalar helpers ==============================================================================
def sizes(w_uq, w_uk, w_uv, w_kr):
    """(H, nope, rope, dv) from the weight shapes (module docstring)."""
    rope = w_kr.shape[0]
    n_heads = (w_uq.shape[0] - w_uk.shape[0]) // rope
    return n_heads, w_uk.shape[0] // n_heads, rope, w_uv.shape[0] // n_heads


def out_of_domain(a):
    """Number of values of the 2-D array a with |raw| >= INT_LIM."""
    n = 0
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            if abs(int(a[t, j])) >= INT_LIM:
                n += 1
    return n


# == per-sequence helpers ========================================================================
# Each takes 2-D arrays [T, n] of one sequence and returns new arrays: a helper that mutates
# several array arguments makes Pythran's type inference (and g++) explode.
def take(a, b):
    """A copy of a[b] (a [B, T, n]) as a 2-D array."""
    out = np.zeros((a.shape[1], a.shape[2]), dtype=np.int64)
    for t in range(a.shape[1]):
        for j in range(a.shape[2]):
            out[t, j] = a[b, t, j]
    return out


def put(dst, b, src):
    """dst[b] = src (dst [B, T, n], src [T, n])."""
    for t in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[b, t, j] = src[t, j]


def rows_of(a, t0):
    """A copy of rows t0.. of a [B, T, n]."""
    out = np.zeros((a.shape[0], a.shape[1] - t0, a.shape[2]), dtype=np.int64)
    for b in range(a.shape[0]):
        for t in range(a.shape[1] - t0):
            for j in range(a.shape[2]):
                out[b, t, j] = a[b, t0 + t, j]
    return out


def pad_rows(a, t_len):
    """[T, n] with a [R, n] in its last R rows and 0 above."""
    out = np.zeros((t_len, a.shape[1]), dtype=np.int64)
    t0 = t_len - a.shape[0]
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[t0 + t, j] = a[t, j]
    return out


def project(src, w, shift, bad, b):
    """out[t, j] = round(sum_i w[j, i] src[t, i] / 2^shift), by the shared GEMM: exact sum, one
    rounding. An output outside the GEMM's exact int64 domain is 0 and counted in bad[b]."""
    out, outside = gemm_i64(src, w, shift)
    bad[b] += outside
    return out


def project_t(src, w, bad, b):
    """out[t, j] = sum_i w[i, j] src[t, i], exact and unrounded (W^T applied to a gradient), by
    the shared GEMM; outside its domain as `project`."""
    out, outside = gemm_i64(src, transpose(w), 0)
    bad[b] += outside
    return out


def round_sum2(a, b, shift):
    """round((a + b) / 2^shift), elementwise."""
    out = np.zeros((a.shape[0], a.shape[1]), dtype=np.int64)
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[t, j] = rshift_round(int(a[t, j]) + int(b[t, j]), shift)
    return out


def norm_rows(a, gain):
    """RMSNorm of each row of a (Q.36): (nrm = a r in Q.24, c = gain nrm in Q.24, r = (h, e)).

    The sum of squares uses a shifted to NORM_BITS significant bits (eps shifted alike), so it
    fits int64 for rows up to 2^9 wide; then fx.rms_rsqrt_row (one long division, rsqrt_norm).
    nrm = mul_round(a, h, e + 12) is one rounding of the exact product.
    """
    t_len = a.shape[0]
    width = a.shape[1]
    nrm = np.zeros((t_len, width), dtype=np.int64)
    c = np.zeros((t_len, width), dtype=np.int64)
    r = np.zeros((t_len, 2), dtype=np.int64)
    row = np.zeros((1, width), dtype=np.int64)
    for t in range(t_len):
        m = 0
        for j in range(width):
            m = max(m, abs(int(a[t, j])))
        sh = max(bitlen(m) - NORM_BITS, 0)
        for j in range(width):
            row[0, j] = rshift_round(int(a[t, j]), sh)
        frac = A_FRAC - sh
        es = 2 * frac - EPS_FRAC
        eps = EPS_Q60 << max(es, 0) if es >= 0 else rshift_round(EPS_Q60, max(-es, 0))
        h, e = rms_rsqrt_row(row, 0, width, eps, frac, 0)
        r[t, 0] = h
        r[t, 1] = e
        for j in range(width):
            v = 0 if h == 0 else mul_round(int(a[t, j]), h, e + A_FRAC - INT_FRAC)
            nrm[t, j] = v
            c[t, j] = rshift_round(v * int(gain[j]), W_FRAC)
    return nrm, c, r


def norm_back(dc, gain, nrm, r):
    """da = r (w - n mean(w n)), w = gain dc (Q.24), for c = gain a r; da in Q.24.

    mean(w n) exact in Q.48, rounded to Q.40 and divided by the width (div_round); w - n mu in
    Q.40; then times r = h 2^-e, one rounding.
    """
    t_len = dc.shape[0]
    width = dc.shape[1]
    da = np.zeros((t_len, width), dtype=np.int64)
    w = np.zeros(width, dtype=np.int64)
    for t in range(t_len):
        hi = 0
        lo = 0
        for j in range(width):
            wj = rshift_round(int(dc[t, j]) * int(gain[j]), W_FRAC)
            w[j] = wj
            nj = int(nrm[t, j])
            hi += (wj >> DOT_LIMB) * nj
            lo += (wj & DOT_MASK) * nj
        mu = div_round(round_limbs(hi, lo, DOT_LIMB, 8), width)  # Q.40
        h = int(r[t, 0])
        e = int(r[t, 1])
        for j in range(width):
            diff = (int(w[j]) << 16) - mul_round(int(nrm[t, j]), mu, INT_FRAC)
            da[t, j] = 0 if h == 0 else mul_round(diff, h, e + 16)
    return da


def gate(u, o):
    """(sigmoid(u) in Q0.62, G = o sigmoid(u) in Q.24) for u in Q.36, o in Q.24."""
    sg = np.zeros((u.shape[0], u.shape[1]), dtype=np.int64)
    gated = np.zeros((u.shape[0], u.shape[1]), dtype=np.int64)
    for t in range(u.shape[0]):
        for k in range(u.shape[1]):
            s = sigmoid_q62(int(u[t, k]), A_FRAC)
            sg[t, k] = s
            gated[t, k] = mul_round(int(o[t, k]), s, 62)
    return sg, gated


def gate_back(dg, sg, o):
    """(do = dG sigma, du = dG o sigma (1 - sigma)), Q.24, from dG in Q.24 (one rounding each)."""
    d_o = np.zeros((dg.shape[0], dg.shape[1]), dtype=np.int64)
    du = np.zeros((dg.shape[0], dg.shape[1]), dtype=np.int64)
    for t in range(dg.shape[0]):
        for k in range(dg.shape[1]):
            g = int(dg[t, k])
            s = int(sg[t, k])
            d_o[t, k] = mul_round(g, s, 62)
            du[t, k] = mul_round(g * int(o[t, k]), mul_q62(s, ONE_Q62 - s), 62 + INT_FRAC)
    return d_o, du


# == attention: query rows t0 .. T-1 against every key ==========================================
def attend(q, kc, kr, v, n_heads, scale, t0):
    """(P [H, R, T] Q0.31, o [R, H dv] Q.24): query row r is sequence row t0 + r and sees keys
    0 .. t0 + r. Scores exact in Q.48, to Q.40, then times scale to Q.32; o = sum_s P v exact in one int64, rounded once."""
    n_rows = q.shape[0]
    t_len = kc.shape[0]
    rope = kr.shape[1]
    qw = q.shape[1] // n_heads
    nope = qw - rope
    dv = v.shape[1] // n_heads
    p = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
    o = np.zeros((n_rows, n_heads * dv), dtype=np.int64)
    z = np.zeros((1, t_len), dtype=np.int64)
    pr = np.zeros((1, t_len), dtype=np.int64)
    acc = np.zeros(dv, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            n = t0 + r + 1
            # z_s = (q_C . k_C,s + q_r . k_r,s) scale: exact in Q.48, to Q.40, then Q.32
            for s in range(n):
                hi = 0
                lo = 0
                for i in range(nope):
                    a = int(q[r, hh * qw + i])
                    c = int(kc[s, hh * nope + i])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                for i in range(rope):
                    a = int(q[r, hh * qw + nope + i])
                    c = int(kr[s, i])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                z[0, s] = mul_round(round_limbs(hi, lo, DOT_LIMB, 8), scale, 70)
            softmax_row_q31(z, 0, n, S_FRAC, pr)
            # o = sum_s P_s v_s, exact in Q.55
            for j in range(dv):
                acc[j] = 0
            for s in range(n):
                a = int(pr[0, s])
                p[hh, r, s] = a
                for j in range(dv):
                    acc[j] += a * int(v[s, hh * dv + j])
            for j in range(dv):
                o[r, hh * dv + j] = rshift_round(int(acc[j]), P_FRAC)
    return p, o


def scores_back(p, v, d_o, scale, t0):
    """dS [H, R, T] in Q.32: dP = do . v (Q.32), mu = sum_s P dP (Q.32), dS = P (dP - mu) scale,
    mu's limbs split on dP (rows of any length)."""
    n_heads = p.shape[0]
    n_rows = p.shape[1]
    t_len = p.shape[2]
    dv = v.shape[1] // n_heads
    ds = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
    dp = np.zeros(t_len, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            n = t0 + r + 1
            for s in range(n):
                hi = 0
                lo = 0
                for j in range(dv):
                    a = int(d_o[r, hh * dv + j])
                    c = int(v[s, hh * dv + j])
                    hi += (a >> DOT_LIMB) * c
                    lo += (a & DOT_MASK) * c
                dp[s] = round_limbs(hi, lo, DOT_LIMB, 16)  # Q.48 -> Q.32
            hi = 0
            lo = 0
            for s in range(n):
                a = int(p[hh, r, s])
                hi += a * (int(dp[s]) >> DOT_LIMB)
                lo += a * (int(dp[s]) & DOT_MASK)
            mu = round_limbs(hi, lo, DOT_LIMB, P_FRAC)  # Q.63 -> Q.32
            for s in range(n):
                d = mul_round(int(dp[s]) - mu, scale, 62)
                ds[hh, r, s] = mul_round(int(p[hh, r, s]), d, P_FRAC)
    return ds


def query_back(ds, kc, kr, t0):
    """dq [R, H (nope + rope)] in Q.24: dq_t = sum_s dS_ts [k_C,s | k_r,s] (exact, Q.56)."""
    n_heads = ds.shape[0]
    n_rows = ds.shape[1]
    rope = kr.shape[1]
    nope = kc.shape[1] // n_heads
    qw = nope + rope
    dq = np.zeros((n_rows, n_heads * qw), dtype=np.int64)
    his = np.zeros(qw, dtype=np.int64)
    los = np.zeros(qw, dtype=np.int64)
    for hh in range(n_heads):
        for r in range(n_rows):
            for i in range(qw):
                his[i] = 0
                los[i] = 0
            for s in range(t0 + r + 1):
                a = int(ds[hh, r, s])
                ah = a >> SUM_LIMB
                al = a & SUM_MASK
                for i in range(nope):
                    c = int(kc[s, hh * nope + i])
                    his[i] += ah * c
                    los[i] += al * c
                for i in range(rope):
                    c = int(kr[s, i])
                    his[nope + i] += ah * c
                    los[nope + i] += al * c
            for i in range(qw):
                dq[r, hh * qw + i] = round_limbs(int(his[i]), int(los[i]), SUM_LIMB, S_FRAC)
    return dq


def key_back(ds, q, rope, t0):
    """(dk_C [T, H nope], dk_r [T, rope]) in Q.24: dk_C,s = sum_{t >= t0, s} dS_ts q_C,t per
    head, dk_r,s the same over every head's q_r (exact, Q.56)."""
    n_heads = ds.shape[0]
    n_rows = ds.shape[1]
    t_len = ds.shape[2]
    qw = q.shape[1] // n_heads
    nope = qw - rope
    dkc = np.zeros((t_len, n_heads * nope), dtype=np.int64)
    dkr = np.zeros((t_len, rope), dtype=np.int64)
    his = np.zeros(qw, dtype=np.int64)  # [nope: this head's k_C | rope: k_r over all heads]
    los = np.zeros(qw, dtype=np.int64)
    for s in range(t_len):
        for i in range(qw):
            his[i] = 0
            los[i] = 0
        for hh in range(n_heads):
            for i in range(nope):
                his[i] = 0
                los[i] = 0
            for r in range(max(s - t0, 0), n_rows):
                a = int(ds[hh, r, s])
                ah = a >> SUM_LIMB
                al = a & SUM_MASK
                for i in range(qw):
                    c = int(q[r, hh * qw + i])
                    his[i] += ah * c
                    los[i] += al * c
            for i in range(nope):
                dkc[s, hh * nope + i] = round_limbs(int(his[i]), int(los[i]), SUM_LIMB, S_FRAC)
        for i in range(rope):
            dkr[s, i] = round_limbs(int(his[nope + i]), int(los[nope + i]), SUM_LIMB, S_FRAC)
    return dkc, dkr


def value_back(p, d_o, t0):
    """dv [T, H dv] in Q.24: dv_s = sum_{t >= t0, s} P_ts do_t per head (exact, Q.55)."""
    n_heads = p.shape[0]
    n_rows = p.shape[1]
    t_len = p.shape[2]
    dv = d_o.shape[1] // n_heads
    dvv = np.zeros((t_len, n_heads * dv), dtype=np.int64)
    his = np.zeros(dv, dtype=np.int64)
    los = np.zeros(dv, dtype=np.int64)
    for hh in range(n_heads):
        for s in range(t_len):
            for j in range(dv):
                his[j] = 0
                los[j] = 0
            for r in range(max(s - t0, 0), n_rows):
                a = int(p[hh, r, s])
                ah = a >> DOT_LIMB
                al = a & DOT_MASK
                for j in range(dv):
                    c = int(d_o[r, hh * dv + j])
                    his[j] += ah * c
                    los[j] += al * c
            for j in range(dv):
                dvv[s, hh * dv + j] = round_limbs(int(his[j]), int(los[j]), DOT_LIMB, P_FRAC)
    return dvv


# == weight gradients ============================================================================
def weight_grad(g, a, shift, bad):
    """out[i, j] = round(sum_{b,t} g[b,t,i] a[b,t,j] / 2^shift): one exact token sum by the
    shared GEMM (gemm.sum_outer: g in two limbs, one rounding). Outputs outside the GEMM's
    domain counted in bad[0]."""
    out, outside = sum_outer(token_rows(g), token_rows(a), shift)
    bad[0] += outside
    return out


def gain_grad(g, nrm):
    """out[j] = round(sum_{b,t} g[b,t,j] nrm[b,t,j] / 2^24): the RMSNorm gain's gradient."""
    out = np.zeros(g.shape[2], dtype=np.int64)
    for j in range(g.shape[2]):
        hi = 0
        lo = 0
        for b in range(g.shape[0]):
            for t in range(g.shape[1]):
                x = int(g[b, t, j])
                y = int(nrm[b, t, j])
                hi += (x >> SUM_LIMB) * y
                lo += (x & SUM_MASK) * y
        out[j] = round_limbs(hi, lo, SUM_LIMB, INT_FRAC)
    return out


# == exports =====================================================================================
# pythran export mla_forward(int64[:,:,:] order(C), int, int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C))
def mla_forward(x, t0, w_dq, q_norm, w_uq, w_dkv, kv_norm, w_kr, w_uk, w_uv, w_g, w_o):
    """y [B, T, d] Q.16 (0 at rows < t0) and the cache (n_q, r_q, c_q, q [B, R, .], n_kv, r_kv,
    c_kv, k_r, k_c, v [B, T, .], p [B, H, R, T], o, sg, gated [B, R, .]), then the count of
    values outside the domain (a T beyond FORWARD_MAX_T counts as one)."""
    n_b, t_len, d = x.shape[0], x.shape[1], x.shape[2]
    n_rows = t_len - t0
    n_heads, nope, rope, dv = sizes(w_uq, w_uk, w_uv, w_kr)
    ql = w_dq.shape[0]
    kl = w_dkv.shape[0]
    hv = n_heads * dv
    scale = rsqrt_q(nope + rope, 0, 62)  # (nope + rope)^-1/2 in Q0.62
    xq_all = rows_of(x, t0)
    n_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    c_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    r_q_all = np.zeros((n_b, n_rows, 2), dtype=np.int64)
    q_all = np.zeros((n_b, n_rows, w_uq.shape[0]), dtype=np.int64)
    n_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    c_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    r_kv_all = np.zeros((n_b, t_len, 2), dtype=np.int64)
    k_r_all = np.zeros((n_b, t_len, rope), dtype=np.int64)
    k_c_all = np.zeros((n_b, t_len, n_heads * nope), dtype=np.int64)
    v_all = np.zeros((n_b, t_len, hv), dtype=np.int64)
    p_all = np.zeros((n_b, n_heads, n_rows, t_len), dtype=np.int64)
    o_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    sg_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    gated_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    y_all = np.zeros((n_b, t_len, d), dtype=np.int64)
    bad = np.zeros(n_b, dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        xb = take(x, b)
        xq = take(xq_all, b)
        n_q, c_q, r_q = norm_rows(project(xq, w_dq, 0, bad, b), q_norm)  # W_dq x exact in Q.36
        q = project(c_q, w_uq, W_FRAC, bad, b)  # Q.44 -> Q.24
        n_kv, c_kv, r_kv = norm_rows(project(xb, w_dkv, 0, bad, b), kv_norm)
        k_r = project(xb, w_kr, A_FRAC - INT_FRAC, bad, b)  # Q.36 -> Q.24
        k_c = project(c_kv, w_uk, W_FRAC, bad, b)
        v = project(c_kv, w_uv, W_FRAC, bad, b)
        p, o = attend(q, k_c, k_r, v, n_heads, scale, t0)
        sg, gated = gate(project(xq, w_g, 0, bad, b), o)  # u = W_g x exact in Q.36
        # y = W_o G at the query rows, Q.44 -> Q.16; 0 above them
        put(y_all, b, pad_rows(project(gated, w_o, INT_FRAC + W_FRAC - ACT_FRAC, bad, b), t_len))
        put(n_q_all, b, n_q)
        put(c_q_all, b, c_q)
        put(r_q_all, b, r_q)
        put(q_all, b, q)
        put(n_kv_all, b, n_kv)
        put(c_kv_all, b, c_kv)
        put(r_kv_all, b, r_kv)
        put(k_r_all, b, k_r)
        put(k_c_all, b, k_c)
        put(v_all, b, v)
        for hh in range(n_heads):
            for r in range(n_rows):
                for s in range(t_len):
                    p_all[b, hh, r, s] = p[hh, r, s]
        put(o_all, b, o)
        put(sg_all, b, sg)
        put(gated_all, b, gated)
        bad[b] += (
            out_of_domain(c_q)
            + out_of_domain(q)
            + out_of_domain(c_kv)
            + out_of_domain(k_r)
            + out_of_domain(k_c)
            + out_of_domain(v)
        )
    n_bad = int(np.sum(bad)) + (1 if t_len > FORWARD_MAX_T else 0)
    return (
        y_all,
        n_q_all,
        r_q_all,
        c_q_all,
        q_all,
        n_kv_all,
        r_kv_all,
        c_kv_all,
        k_r_all,
        k_c_all,
        v_all,
        p_all,
        o_all,
        sg_all,
        gated_all,
        n_bad,
    )


# pythran export mla_backward(int64[:,:,:] order(C), int64[:,:,:] order(C), int, int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C), int64[:,:,:] order(C))
def mla_backward(
    dy,
    x,
    t0,
    w_dq,
    q_norm,
    w_uq,
    w_dkv,
    kv_norm,
    w_kr,
    w_uk,
    w_uv,
    w_g,
    w_o,
    n_q_all,
    r_q_all,
    c_q_all,
    q_all,
    n_kv_all,
    r_kv_all,
    c_kv_all,
    k_r_all,
    k_c_all,
    v_all,
    p_all,
    o_all,
    sg_all,
    gated_all,
):
    """dx [B, T, d] Q.24, the gradients of w_dq, q_norm, w_uq, w_dkv, kv_norm, w_kr, w_uk, w_uv,
    w_g, w_o (Q.24, summed over all tokens), then the out-of-domain count (a T beyond
    BACKWARD_MAX_T counts as one), for L = sum dy . y; dy at rows < t0 meets y = 0 there and
    adds nothing."""
    n_b, t_len, d = x.shape[0], x.shape[1], x.shape[2]
    n_rows = t_len - t0
    n_heads, nope, rope, dv = sizes(w_uq, w_uk, w_uv, w_kr)
    ql = w_dq.shape[0]
    kl = w_dkv.shape[0]
    hv = n_heads * dv
    scale = rsqrt_q(nope + rope, 0, 62)
    dyq_all = rows_of(dy, t0)
    xq_all = rows_of(x, t0)
    du_all = np.zeros((n_b, n_rows, hv), dtype=np.int64)
    dq_all = np.zeros((n_b, n_rows, w_uq.shape[0]), dtype=np.int64)
    dkc_all = np.zeros((n_b, t_len, n_heads * nope), dtype=np.int64)
    dv_all = np.zeros((n_b, t_len, hv), dtype=np.int64)
    dkr_all = np.zeros((n_b, t_len, rope), dtype=np.int64)
    dc_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    da_q_all = np.zeros((n_b, n_rows, ql), dtype=np.int64)
    dc_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    da_kv_all = np.zeros((n_b, t_len, kl), dtype=np.int64)
    dx_all = np.zeros((n_b, t_len, d), dtype=np.int64)
    bad = np.zeros(n_b, dtype=np.int64)
    # omp parallel for
    for b in range(n_b):
        p = np.zeros((n_heads, n_rows, t_len), dtype=np.int64)
        for hh in range(n_heads):
            for r in range(n_rows):
                for s in range(t_len):
                    p[hh, r, s] = p_all[b, hh, r, s]
        zero = np.zeros((n_rows, hv), dtype=np.int64)
        dg = round_sum2(project_t(take(dyq_all, b), w_o, bad, b), zero, W_FRAC)  # dG = W_o^T dy
        d_o, du = gate_back(dg, take(sg_all, b), take(o_all, b))
        ds = scores_back(p, take(v_all, b), d_o, scale, t0)
        dq = query_back(ds, take(k_c_all, b), take(k_r_all, b), t0)
        dkc, dkr = key_back(ds, take(q_all, b), rope, t0)
        dvv = value_back(p, d_o, t0)
        dc_kv = round_sum2(project_t(dkc, w_uk, bad, b), project_t(dvv, w_uv, bad, b), W_FRAC)
        zq = np.zeros((n_rows, ql), dtype=np.int64)
        dc_q = round_sum2(project_t(dq, w_uq, bad, b), zq, W_FRAC)
        da_q = norm_back(dc_q, q_norm, take(n_q_all, b), take(r_q_all, b))
        da_kv = norm_back(dc_kv, kv_norm, take(n_kv_all, b), take(r_kv_all, b))
        # dx = W_g^T du + W_kr^T dk_r + W_dq^T da_q + W_dkv^T da_kv, exact in Q.44, one rounding
        # (du and da_q are 0 above the query rows)
        acc = round_sum2(project_t(pad_rows(du, t_len), w_g, bad, b),
                         project_t(dkr, w_kr, bad, b), 0)  # fmt: skip
        acc = round_sum2(acc, project_t(pad_rows(da_q, t_len), w_dq, bad, b), 0)
        put(dx_all, b, round_sum2(acc, project_t(da_kv, w_dkv, bad, b), W_FRAC))
        put(du_all, b, du)
        put(dq_all, b, dq)
        put(dkc_all, b, dkc)
        put(dv_all, b, dvv)
        put(dkr_all, b, dkr)
        put(dc_q_all, b, dc_q)
        put(da_q_all, b, da_q)
        put(dc_kv_all, b, dc_kv)
        put(da_kv_all, b, da_kv)
        bad[b] += (
            out_of_domain(dg)
            + out_of_domain(du)
            + out_of_domain(dq)
            + out_of_domain(dkc)
            + out_of_domain(dvv)
            + out_of_domain(dkr)
            + out_of_domain(dc_q)
            + out_of_domain(dc_kv)
            + out_of_domain(da_q)
            + out_of_domain(da_kv)
        )
    xs = A_FRAC - W_FRAC  # a Q.24 gradient times Q.16 x = Q.40 -> Q.24: 16
    wbad = np.zeros(1, dtype=np.int64)
    g_dq = weight_grad(da_q_all, xq_all, xs, wbad)
    g_qn = gain_grad(dc_q_all, n_q_all)
    g_uq = weight_grad(dq_all, c_q_all, INT_FRAC, wbad)
    g_dkv = weight_grad(da_kv_all, x, xs, wbad)
    g_kvn = gain_grad(dc_kv_all, n_kv_all)
    g_kr = weight_grad(dkr_all, x, xs, wbad)
    g_uk = weight_grad(dkc_all, c_kv_all, INT_FRAC, wbad)
    g_uv = weight_grad(dv_all, c_kv_all, INT_FRAC, wbad)
    g_g = weight_grad(du_all, xq_all, xs, wbad)
    g_o = weight_grad(dyq_all, gated_all, INT_FRAC, wbad)
    n_bad = int(np.sum(bad)) + int(wbad[0]) + (1 if t_len > BACKWARD_MAX_T else 0)
    return dx_all, g_dq, g_qn, g_uq, g_dkv, g_kvn, g_kr, g_uk, g_uv, g_g, g_o, n_bad
