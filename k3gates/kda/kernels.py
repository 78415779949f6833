"""Kimi Delta Attention (K3-SPEC section 1) in integers only: the gate, the recurrent form and
the chunkwise-parallel form.

Per head the state S is d_k x d_v, and each token t does
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)
with a per-channel decay alpha_t = exp(g_t) and K3's bounded gate g = -5 sigma(A (g_raw + dt_bias)).
Written as S_t = Diag(alpha_t) S_{t-1} + k_t w_t^T with w_t = beta_t (v_t - (Diag(alpha_t)
S_{t-1})^T k_t), both forms below compute the same w_t: the recurrent one step by step, the
chunked one by forward substitution inside each chunk (the (I + L)^-1 of the chunk equations).

Formats (our choice; int32 storage, int64 arithmetic):
    q (already times scale), k    Q0.24   |x_i| <= 1, and ||k||_2 <= 1 (KDA's keys are unit)
    v, S, u, w, o                  Q.20    |x| < 2048; S and w saturate there (counted)
    alpha = exp(g), beta           Q0.30   [0, 1]
    g (log-decay), gate inputs     Q.24    g in [-64, 0]
Rounding: fx.rshift_round, half away from zero, once per stored quantity.

Worst-case magnitudes (d_k <= 128, chunk <= 64): a Q0.24 x Q.20 product is < 2^24 * 2^31 = 2^55
and a sum of 128 of them < 2^62; alpha * S < 2^61; beta (v - u) < 2^30 * 2^32 = 2^62. In the
chunked form the Q0.30 coefficients A, B and k-gamma (|.| <= 1 for unit vectors) multiply w
with |w| <= 2^24 (the analysed domain, |w| <= 16; the kernels report max |w| so a gate can hold
its inputs to it): a sum of 64 such products stays below 2^60.

Error bounds, in output LSB (2^-20), for ||scale q|| <= d_k^-1/2 and no saturation. The map
E -> (I - beta k k^T) Diag(alpha) E is non-expansive (beta <= 1, ||k|| <= 1, alpha <= 1), so
each token's roundings add to the 2-norm of a state column's error and never grow after:
- recurrent: decay (1/2 per entry: sqrt(d_k)/2), u (1/2), w (1/2), the k w^T update (1/2 per
  entry: sqrt(d_k)/2), so at most sqrt(d_k) + 1 per token; o_t = S_t^T q_t sees it through
  ||q|| <= d_k^-1/2, plus its own rounding: |o - o_exact| <= T (1 + 1/sqrt(d_k)) + 1/2
  <= 2T + 1. `recurrent_bound_lsb`.
- chunked: the same per-token terms through the decayed chunk-start state (sqrt(d_k)/2 + 1/2),
  the Q0.30 coefficients (64 terms of 2^-30 * 2^24 = 2^-6 each: 1), the cumulative products
  a_c and gamma (c roundings of 2^-31 relative on |S|, |w| <= 2^24: 1/2 each), w (1/2), and at
  each chunk end the state rebuild (1/2 + 1 per entry): per token at most sqrt(d_k) + 4, per
  chunk another 2 sqrt(d_k): |o - o_exact| <= T (2 + 4/sqrt(d_k)) + 2 T/C + 1.
  `chunked_bound_lsb`.
The two forms may therefore differ by rounding, never by more than the sum of their bounds:
they round different partial products (the chunked form rounds coefficients and decayed
chunk-start states, the recurrent form rounds the state every token).
"""

import numpy as np

from ..fx.kernels import exp_neg_q62, isqrt, mul_round, rshift_round, sigmoid_q62

QK_FRAC = 24  # q (times scale) and k: Q0.24
V_FRAC = 20  # v, S, u, w, o: Q.20
A_FRAC = 30  # alpha, beta: Q0.30
G_FRAC = 24  # g and the gate's inputs: Q.24
ONE_A = 1 << A_FRAC  # 1.0 in Q0.30
DATA_MAX = (1 << 31) - 1  # int32: |S|, |w| saturate at 2048 - 2^-20
W_DOMAIN = 1 << 24  # |w| <= 16: the domain the chunked bound is stated for
GATE_LOWER = 5  # K3's gate g = -5 sigma(.), so alpha in (e^-5, 1)
MAX_DK = 128
MAX_CHUNK = 64
# bounds of the PARTIAL pieces, in output LSB over 2^10 (a kernel holds no float):
# 1/2 for the final rounding plus at most 2^-23 before it, declared as 1/2 + 2^-10
GATE_MAX_ERR_LSB_Q10 = 513
DECAY_MAX_ERR_LSB_Q10 = 513


def state_bound_lsb(t_len, d_k):
    """Declared bound on each entry of the final state, LSB: a column's 2-norm error, at most
    T (sqrt(d_k) + 1) for the recurrent form; the chunked form adds 2 sqrt(d_k) per chunk and
    3 per token, so T (sqrt(d_k) + 4) + 2 T sqrt(d_k) covers both for chunks >= 1."""
    r = isqrt(d_k) + 1  # >= sqrt(d_k)
    return t_len * (r + 4) + 2 * t_len * r


def recurrent_bound_lsb(t_len, d_k):
    """Declared bound of kda_recurrent against exact arithmetic, output LSB: T (1 + 1/sqrt(d_k))
    + 1/2, rounded up (see the module docstring), for ||scale q|| <= d_k^-1/2."""
    r = isqrt(d_k)  # floor(sqrt d_k) <= sqrt d_k, so t_len // r over-estimates t_len / sqrt(d_k)
    return t_len + (t_len + r - 1) // r + 1


def chunked_bound_lsb(t_len, d_k, chunk):
    """Declared bound of kda_chunked against exact arithmetic, output LSB:
    T (2 + 4/sqrt(d_k)) + 2 T/C + 1, rounded up (module docstring)."""
    r = isqrt(d_k)
    return 2 * t_len + (4 * t_len + r - 1) // r + (2 * t_len + chunk - 1) // chunk + 1


# -- the gate and the decay (the PARTIAL pieces) --------------------------------------------------
# pythran export kda_gate(int64[:,:,:] order(C), int64[:], int64[:,:] order(C))
def kda_gate(g_raw, a_head, dt_bias):
    """K3's lower-bounded gate g = -5 sigma(A_h (g_raw + dt_bias_h)) in Q.24, int64 [T, H, d_k].

    g_raw [T, H, d_k] and dt_bias [H, d_k] in Q.24 (|.| < 2^31), A_h = exp(A_log[h]) > 0 in
    Q.24 (|A| < 2^31). A (g_raw + dt_bias) is exact in Q.48 (< 2^63); sigma in Q0.62 (error
    < 2^-55); one rounding to Q.24: error <= 1/2 LSB + 5 * 2^-55 * 2^24 < 1/2 + 2^-28 LSB.
    """
    t_len, n_h, d_k = g_raw.shape[0], g_raw.shape[1], g_raw.shape[2]
    g = np.zeros((t_len, n_h, d_k), dtype=np.int64)
    for t in range(t_len):
        for h in range(n_h):
            for i in range(d_k):
                z = int(a_head[h]) * (int(g_raw[t, h, i]) + int(dt_bias[h, i]))
                # g = -5 sigma(z): 5 * Q0.62 -> Q.24 (the exact product needs 65 bits: mul_round)
                g[t, h, i] = -mul_round(GATE_LOWER, sigmoid_q62(z, 2 * G_FRAC), 62 - G_FRAC)
    return g


# pythran export kda_decay(int64[:,:,:] order(C))
def kda_decay(g):
    """alpha = exp(g) in Q0.30 (int32 [T, H, d_k]) for g <= 0 in Q.24 (g > 0 is taken as 0).

    exp in Q0.62 (error <= 2^-54 e^g + 2^-62), one rounding to Q0.30: error <= 1/2 + 2^-23 LSB.
    g < -64 gives 0.
    """
    t_len, n_h, d_k = g.shape[0], g.shape[1], g.shape[2]
    alpha = np.zeros((t_len, n_h, d_k), dtype=np.int32)
    for t in range(t_len):
        for h in range(n_h):
            for i in range(d_k):
                x = min(int(g[t, h, i]), 0)
                if x > -(64 << G_FRAC):
                    # alpha = exp(g): g in Q.24 -> t = -g in Q.56
                    alpha[t, h, i] = rshift_round(exp_neg_q62((-x) << (56 - G_FRAC)), 62 - A_FRAC)
    return alpha


# -- the recurrent (serve) form -------------------------------------------------------------------
def _round32(x, s):
    """fx.rshift_round(x, s), half away from zero, for results that fit int32 (1 <= s <= 62).

    floor((x + 2^(s-1) - [x < 0]) / 2^s) is that rounding; the floor shift is taken on the uint64
    bits, which agree with the signed shift in the low 32 bits kept. Written so that it
    vectorises (AVX2 has no 64-bit arithmetic shift); `round32_array` lets a gate hold it to
    fx.rshift_round.
    """
    return np.int32(np.uint64(x + (1 << (s - 1)) - (x < 0)) >> np.uint64(s))


def _fits32(x):
    """0 when -2^31 <= x < 2^31, else non-zero: an overflow test that vectorises."""
    return np.uint64(x + (1 << 31)) >> np.uint64(32)


def _recurrent_head(qs, keys, v, alpha, beta, S, o, stats, st, u, w, h):
    """kda_recurrent's work for head h, in place: S[h], o[:, h] and stats[h] (st, u and w are
    its scratch). A helper that receives the arrays it writes, so the caller fixes their types:
    inline, Pythran combined the element types of every array written and read in the loop, and
    g++ spent 200 s instantiating them. (`keys`, not `k`: Pythran 0.19 types a helper parameter
    named k as a scalar.)"""
    t_len, d_v = v.shape[0], v.shape[2]
    d_k = keys.shape[2]
    for i in range(d_k):
        for j in range(d_v):
            st[i * d_v + j] = S[h, i, j]
    sat = 0
    w_max = 0
    for t in range(t_len):
        for j in range(d_v):
            u[j] = 0
        # S' = Diag(alpha_t) S_{t-1};  u = S'^T k_t
        for i in range(d_k):
            a = np.int64(alpha[t, h, i])
            ki = np.int64(keys[t, h, i])
            row = st[i * d_v : (i + 1) * d_v]
            for j in range(d_v):
                s = _round32(a * np.int64(row[j]), A_FRAC)
                row[j] = s
                u[j] += ki * np.int64(s)
        # w = beta_t (v_t - u)
        b = np.int64(beta[t, h])
        for j in range(d_v):
            x = rshift_round(b * (np.int64(v[t, h, j]) - rshift_round(u[j], QK_FRAC)), A_FRAC)
            y = min(max(x, -DATA_MAX), DATA_MAX)
            sat += x != y
            w_max = max(w_max, abs(y))
            w[j] = y
            u[j] = 0
        # S_t = S' + k_t w^T;  u = S_t^T (scale q_t)
        for i in range(d_k):
            ki = np.int64(keys[t, h, i])
            qi = np.int64(qs[t, h, i])
            row = st[i * d_v : (i + 1) * d_v]
            overflow = np.uint64(0)
            for j in range(d_v):
                x = np.int64(row[j]) + np.int64(_round32(ki * w[j], QK_FRAC))
                overflow |= _fits32(x)
                y = np.int32(x)
                row[j] = y
                u[j] += qi * np.int64(y)
            if overflow != np.uint64(0):  # undo the wrapped row and redo it saturating
                for j in range(d_v):
                    wrapped = np.int64(row[j])
                    add = np.int64(_round32(ki * w[j], QK_FRAC))
                    x = np.int64(np.int32(wrapped - add)) + add  # S' fits int32: S' + add
                    y = min(max(x, -DATA_MAX), DATA_MAX)
                    sat += x != y
                    row[j] = y
                    u[j] += qi * (y - wrapped)
        for j in range(d_v):
            o[t, h, j] = min(max(rshift_round(u[j], QK_FRAC), -DATA_MAX), DATA_MAX)
    s_max = 0
    for i in range(d_k):
        for j in range(d_v):
            S[h, i, j] = st[i * d_v + j]
            s_max = max(s_max, abs(np.int64(st[i * d_v + j])))
    stats[h, 0] = sat
    stats[h, 1] = s_max
    stats[h, 2] = w_max


# pythran export kda_recurrent(int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C))
def kda_recurrent(qs, k, v, alpha, beta, s0):
    """The recurrent form over T tokens and H heads: (o int32 [T, H, d_v], S int32 [H, d_k, d_v],
    stats int64 [3] = (saturations, max |S| at the end, max |w|)).

    qs = scale q and k: [T, H, d_k] Q0.24; v: [T, H, d_v] Q.20; alpha: [T, H, d_k] Q0.30;
    beta: [T, H] Q0.30; s0: the initial state [H, d_k, d_v] Q.20. Heads run in parallel; each is
    one exact integer sequence, so the result is the same for any thread count.
    Error: `recurrent_bound_lsb(T, d_k)` output LSB; any T (the state is O(1) in T).

    The state is held flat per head (row i at i d_v) and each row update is stored as int32
    while an OR of overflow bits is kept: loops the compiler vectorises. Each row is reached by
    a slice: indexed directly, st[i d_v + j] kept a check for a negative index that reads the
    array's shape, and clang could not vectorise past the int64 stores that might change it. A row that overflowed (never
    within the analysed domain) is redone with saturation and counted.
    """
    t_len, n_h, d_v = v.shape[0], v.shape[1], v.shape[2]
    d_k = k.shape[2]
    o = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    S = s0.copy()
    stats = np.zeros((n_h, 3), dtype=np.int64)
    # omp parallel for
    for h in range(n_h):
        st = np.zeros(d_k * d_v, dtype=np.int32)  # S[h], Q.20
        u = np.zeros(d_v, dtype=np.int64)  # S'^T k_t, then S_t^T q_t: Q.44
        w = np.zeros(d_v, dtype=np.int64)  # Q.20
        _recurrent_head(qs, k, v, alpha, beta, S, o, stats, st, u, w, h)
    total = np.zeros(3, dtype=np.int64)
    for h in range(n_h):
        total[0] += stats[h, 0]
        total[1] = max(total[1], stats[h, 1])
        total[2] = max(total[2], stats[h, 2])
    return o, S, total


# -- the chunkwise-parallel (training) form -------------------------------------------------------
# One exported function with its loops inline: Pythran's type inference of helpers that take and
# mutate several arrays made g++ exhaust memory.
# pythran export kda_chunked(int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:,:] order(C), int32[:,:] order(C), int32[:,:,:] order(C), int)
def kda_chunked(qs, k, v, alpha, beta, s0, chunk):
    """The chunkwise-parallel form, chunk size `chunk` (1..64): same arguments and results as
    kda_recurrent. Inside a chunk every w comes from the chunk-start state S0 and the earlier w's
    of the chunk (forward substitution: the (I + L)^-1 of the chunk equations), every o from
    those w's, and the state is rebuilt once per chunk. Gamma_{s->c} = prod_{r=s+1..c} alpha_r
    takes the place of the equations' a_c / a_s, so nothing is divided by a small decay.
    Error: `chunked_bound_lsb(T, d_k, chunk)` output LSB, for |w| <= 16.
    """
    t_len, n_h, d_v = v.shape[0], v.shape[1], v.shape[2]
    d_k = k.shape[2]
    o = np.zeros((t_len, n_h, d_v), dtype=np.int32)
    S = s0.copy()
    st = np.zeros((n_h, 3), dtype=np.int64)  # per head: saturations, max |S|, max |w|
    # omp parallel for
    for h in range(n_h):
        a = np.zeros(d_k, dtype=np.int64)  # a_c = prod alpha since the chunk start, Q0.30
        gamma = np.zeros(d_k, dtype=np.int64)  # Gamma_{s->c}, Q0.30
        kg = np.zeros((chunk, d_k), dtype=np.int64)  # Gamma_{s->c} k_s, Q0.24
        coef = np.zeros((2, chunk), dtype=np.int64)  # k_c^T kg[s], qs_c^T kg[s]: Q0.30
        pr = np.zeros((2, d_v), dtype=np.int64)  # (a_c S0)^T k_c, (a_c S0)^T qs_c: Q.44
        w = np.zeros((chunk, d_v), dtype=np.int64)  # Q.20
        for t0 in range(0, t_len, chunk):
            c_len = min(chunk, t_len - t0)
            for i in range(d_k):
                a[i] = ONE_A
            for c in range(c_len):
                t = t0 + c
                # a_c = a_{c-1} alpha_t;  pr = (Diag(a_c) S0)^T [k_c, qs_c], S0 decayed and rounded
                for i in range(d_k):
                    a[i] = rshift_round(a[i] * int(alpha[t, h, i]), A_FRAC)
                for j in range(d_v):
                    pr[0, j] = 0
                    pr[1, j] = 0
                for i in range(d_k):
                    ai = a[i]
                    ki = int(k[t, h, i])
                    qi = int(qs[t, h, i])
                    for j in range(d_v):
                        d = rshift_round(ai * int(S[h, i, j]), A_FRAC)
                        pr[0, j] += ki * d
                        pr[1, j] += qi * d
                # coef[., s] = [k_c, qs_c]^T Gamma_{s->c} k_s for s = c..0
                for i in range(d_k):
                    gamma[i] = ONE_A
                for r in range(c + 1):
                    s = c - r
                    if s < c:
                        for i in range(d_k):
                            gamma[i] = rshift_round(gamma[i] * int(alpha[t0 + s + 1, h, i]), A_FRAC)
                    ak = 0
                    bq = 0
                    for i in range(d_k):
                        x = rshift_round(int(k[t0 + s, h, i]) * gamma[i], QK_FRAC)
                        kg[s, i] = x
                        ak += int(k[t, h, i]) * x
                        bq += int(qs[t, h, i]) * x
                    coef[0, s] = rshift_round(ak, QK_FRAC)
                    coef[1, s] = rshift_round(bq, QK_FRAC)
                # u_c = (a_c S0)^T k_c + sum_{s<c} coef[0, s] w_s;  w_c = beta_c (v_c - u_c)
                b = int(beta[t, h])
                for j in range(d_v):
                    acc = 0
                    for s in range(c):
                        acc += coef[0, s] * w[s, j]
                    u = rshift_round(pr[0, j], QK_FRAC) + rshift_round(acc, A_FRAC)
                    x = rshift_round(b * (int(v[t, h, j]) - u), A_FRAC)
                    y = min(max(x, -DATA_MAX), DATA_MAX)
                    st[h, 0] += x != y
                    st[h, 2] = max(st[h, 2], abs(y))
                    w[c, j] = y
                # o_c = (a_c S0)^T qs_c + sum_{s<=c} coef[1, s] w_s
                for j in range(d_v):
                    acc = 0
                    for s in range(c + 1):
                        acc += coef[1, s] * w[s, j]
                    x = rshift_round(pr[1, j], QK_FRAC) + rshift_round(acc, A_FRAC)
                    o[t, h, j] = min(max(x, -DATA_MAX), DATA_MAX)
            # S <- Diag(a_C) S0 + sum_s (Gamma_{s->C} k_s) w_s^T  (kg holds Gamma_{s->C} k_s now)
            for i in range(d_k):
                for j in range(d_v):
                    acc = 0
                    for s in range(c_len):
                        acc += kg[s, i] * w[s, j]
                    x = rshift_round(a[i] * int(S[h, i, j]), A_FRAC) + rshift_round(acc, A_FRAC)
                    y = min(max(x, -DATA_MAX), DATA_MAX)
                    st[h, 0] += x != y
                    st[h, 1] = max(st[h, 1], abs(y))
                    S[h, i, j] = y
    total = np.zeros(3, dtype=np.int64)
    for h in range(n_h):
        total[0] += st[h, 0]
        total[1] = max(total[1], st[h, 1])
        total[2] = max(total[2], st[h, 2])
    return o, S, total
