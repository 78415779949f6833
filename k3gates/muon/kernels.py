"""Per-Head Muon (K3-SPEC section 5) in integers only: Newton-Schulz-5, the Muon step with
per-head slicing, QK-Clip, and an integer attention layer trained with it.

NS5 (KellerJordan/Muon): X_0 = G / (||G||_F + eps), transposed if tall; then five times
    A = X X^T,   B = b A + c A^2,   X <- a X + B X,   (a, b, c) = (3.4445, -4.7750, 2.0315).

Formats (X is held wide, m <= n, as int16 so the matmuls run as int16 x int16 -> int32):
    G, M, N          int64, any one format (NS5 is scale-invariant); |G| < 2^62
    X                int16 Q1.14 (X_FRAC): |X| <= ||X||_2 <= 1.2024 in exact arithmetic
    A = X X^T        int32 Q2.28, exact (no rounding)
    A_hi, A_lo       int16: A ~ A_hi 2^-14 + A_lo 2^-24 (A_lo = the rest, rounded; |A_lo| <= 2^9)
    A^2              Q.38 int64: A_hi^2 2^10 + A_hi A_lo + A_lo A_hi (A_lo^2, < m 2^-30, dropped)
    B                Q.58 int64: NS_B_Q30 A + NS_C_Q26 round(A^2 to Q.32); exact sums
    B_hi, B_lo       int16: B ~ B_hi 2^-13 + B_lo 2^-23 (|B_lo| <= 2^9)
    B X              Q.37 int64: (B_hi X) 2^10 + B_lo X, exact from B_hi, B_lo
    X_new            round((NS_A_Q28 X + (B X) 2^5) / 2^28): Q.14, saturated to int16 (counted)
Rounding: fx.rshift_round (half away from zero) everywhere, so NS5(-G) = -NS5(G) bit for bit.

Why int32 sums cannot overflow. The three matmuls of an iteration are the shared GEMM,
`k3gates.gemm.kernels.gemm_i16` (C = A B^T, int16 x int16 -> int32, exact; its gate is
gemm_exact). It bounds every partial sum of a row pair by Cauchy-Schwarz, |sum| <= ||a|| ||b||,
sums in int32 where that bound fits and in int64 where it does not, and clamps (and counts) only
an output that itself leaves int32: `guard`, which every NS5 entry point returns with the int16
saturations, is 0 when every sum was exact. For ||X||_2 <= 5/4 nothing is clamped (rows of X, A,
B are bounded by ||X||, ||X||^2 and ||B|| <= 2.81; |A_lo|, |B_lo| <= 2^9 keep
sqrt(m) 2^9 * 2^14.4 < 2^31 for m < 2^15), and the GEMM stays on its int32 path.

Normalisation (`_normalise`): G is rounded to |G| <= 2^31 when larger; its squared Frobenius
norm is summed exactly in two 31-bit halves and its square root taken by fx.isqrt to 30 bits,
so X_0 is within 1/2 + 2^-15 LSB of G / (||G||_F + eps), for m n <= 2^26 and eps_raw < 2^31.

Magnitudes, for ||X||_2 <= 5/4 (the premise the gates check with a float SVD of every iterate):
|A| <= 1.57 (2^28.7 raw), |A^2| <= 2.45 (Q.38: 2^39.3), b A in Q.58 < 2^60.9, c A^2 < 2^60.3,
|B| <= 2.81 (B_hi < 2^14.5), |a X| in Q.42 < 2^44.1, |B X| in Q.37 < 2^38.9: all in int64.

Error of one iteration (`ns_step`) against the exact iteration from the same integer X, in LSB
of Q.14, for ||X||_2 <= s = 5/4 and m rows (the derivation of `ns_step_bound_q10`):
    A exact; |A_hat - A| <= 2^-25 (A_lo's rounding), so per entry
    E_A2 <= 2 s^2 sqrt(m) 2^-25 (A d + d A, Cauchy-Schwarz) + m 2^-50 (d^2)
            + m 2^-30 (the dropped A_lo^2) + 2^-33 (A^2 rounded to Q.32)
    E_B  <= 2^-24 (B_lo's rounding) + |db| s^2 + |dc| s^4 + 2.0316 E_A2
            (|db| <= 2^-31.3, |dc| <= 2^-28.2: the coefficients' Q.30 / Q.26 rounding)
    |X_new - exact| <= 1/2 + 2^14 (|da| s + sqrt(m) s E_B)   (|da| <= 2^-30.38)
m = 32: 0.64 LSB; m = 128: 1.1; m = 512: 3.0. The bound grows with sqrt(m) because it is a
worst case over aligned rounding errors (Cauchy-Schwarz); measured errors are far smaller.

NS5 end to end has no comparable bound: the iteration is expansive by design (p(s)/s = a = 3.44
near 0, |p'| up to 3.97 on [0, 1.2024]), so a worst-case bound compounds to hundreds of times the
local one. NS5_TOL_LSB is a *declared tolerance*, from a first-order model: per singular value
pair, a perturbation made after step k is amplified by the product of divided differences of
p along the pair's trajectory; over inputs with sigma_min / ||G||_F >= 0.05 the largest such
products are 119 for the normalisation's 1/2 LSB and 53 summed over the five steps (scanned over
pairs of starting singular values in [0.05, 1]; tests/test_muon_kernels.py scans again). With the
local bound at m <= 64 (0.78 LSB): 0.5 * 119 + 0.78 * 53 = 101 LSB; declared 128 LSB = 2^-7.
The gates measure about 10 LSB.

Muon step (Moonlight, arXiv 2502.16982), per head slice (see `muon_step`):
    M <- mu M + G;  N = G + mu M (Nesterov) or M;  O = NS5(N_h) per head h;
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O,   A x B = the slice's shape.
Given O, the step is two roundings (decay, update): within 1025/1024 LSB of W's format
(STEP_MAX_ERR_LSB_Q10); M within 513/1024 LSB (MOMENTUM_MAX_ERR_LSB_Q10).
"""

import numpy as np

from ..fx.kernels import (
    bitlen,
    div_round,
    div_round_shift,
    isqrt,
    mul_round,
    rshift_round,
    rsqrt_norm,
    softmax_row_q31,
)
from ..gemm.kernels import gemm_i16, transpose_i16

# -- NS5 constants (each: raw integer, the real expression) --------------------------------------
NS_STEPS = 5
X_FRAC = 14  # X in Q1.14
NS_A_Q28 = 924625928  # round(3.4445 * 2**28), error 0.19 * 2^-28
NS_B_Q30 = -5127117210  # round(-4.7750 * 2**30), error 0.40 * 2^-30
NS_C_Q26 = 136331657  # round(2.0315 * 2**26), error 0.22 * 2^-26
A_LO_SHIFT = 4  # A_lo = round((A - A_hi 2^14) / 2^4): units 2^-24, |A_lo| <= 2^9
B_HI_SHIFT = 45  # B_hi = round(B / 2^45): Q.58 -> Q.13
B_LO_SHIFT = 35  # B_lo = round((B - B_hi 2^45) / 2^35): units 2^-23, |B_lo| <= 2^9
NORM_BITS = 31  # G is pre-shifted (rounded) to |G| <= 2^31 when larger
I16_MAX = (1 << 15) - 1
MASK31 = (1 << 31) - 1

# -- Muon step constants -------------------------------------------------------------------------
HYPER_FRAC = 30  # mu, lr, wd in Q.30
SCALE_DIV = 5  # 0.2 = 1/5 exactly: the update is divided by 5
MOMENTUM_MAX_ERR_LSB_Q10 = 513  # one rounding (mu M): 1/2 + 2^-10
STEP_MAX_ERR_LSB_Q10 = 1025  # two roundings (decay, update) + lr sqrt(max)'s < 2^-20: 1 + 2^-10
QKCLIP_MAX_ERR_LSB_Q10 = 1024  # 1/2 + |W| 2^-31 for |W_raw| <= 2^30: 1 LSB

# -- bounds, in LSB over 2**BOUND_FRAC --------------------------------------------------------------
BOUND_FRAC = 10
NS5_TOL_LSB = 128  # declared tolerance (see the module docstring): 2^-7 in Q.14
NS5_TOL_MAX_ROWS = 64  # the model behind NS5_TOL_LSB assumed m <= 64


def ns_step_bound_q10(m):
    """Upper bound on 2^10 x the error of one NS iteration (LSB of Q.14) with m rows, for
    ||X||_2 <= 5/4 (module docstring). Integer arithmetic, every term rounded up.

    Every quantity is an integer over 2^60; s = 5/4 (s^2 = 25/16, s^4 = 625/256), sqrt(m) is
    taken as r10 / 2^10 with r10 = ceil(sqrt(m) 2^10), |db| < 0.82 2^-31, |dc| < 0.88 2^-28,
    |da| < 0.77 2^-30, c_q / 2^26 < 2.0316 (tests/test_muon_kernels.py recomputes these).
    """
    r10 = isqrt(m << 20) + 1
    one = 1 << 60
    # E_A2 = 2 s^2 sqrt(m) 2^-25 + m 2^-50 + m 2^-30 + 2^-33
    e_a2 = (2 * 25 * r10 << 25) // 16 + 1 + (m << 10) + (m << 30) + (1 << 27)
    # E_B = 2^-24 + |db| s^2 + |dc| s^4 + 2.0316 E_A2
    e_b = (1 << 36) + (82 * 25 << 29) // (100 * 16) + 1 + (88 * 625 << 32) // (100 * 256) + 1
    e_b += (20316 * e_a2 + 9999) // 10000
    # 2^10 (1/2 + 2^14 (|da| s + sqrt(m) s E_B))
    total = (1 << 9) * one + (77 * 5 << 54) // (100 * 4) + 1 + ((r10 * 5 * e_b) << 14) // 4
    return (total + one - 1) // one


def step_tolerance_lsb(lr_q, max_dim, wf):
    """The full step's declared tolerance against float64 (NS5 included), in LSB of Q.wf:
    1 (two roundings) + lr 0.2 sqrt(max_dim) NS5_TOL_LSB 2^-14 2^wf, rounded up (sqrt(max_dim)
    taken as ceil(sqrt(max_dim) 2^10) / 2^10)."""
    r10 = isqrt(max_dim << 20) + 1
    num = lr_q * r10 * NS5_TOL_LSB << wf
    return 2 + num // (SCALE_DIV << (HYPER_FRAC + X_FRAC + 10))


# == scalar helpers ==============================================================================
# == scalar helpers ==============================================================================
# (Every helper below returns what it makes and mutates none of its arguments: Pythran types an
# array passed to a helper that stores into it as a combination with what is stored, and chains
# of such helpers made the C++ front end need more than 6 GiB.)
def _sat16(v):
    """v clamped to the int16 range [-2^15 + 1, 2^15 - 1] (symmetric, so negation is exact)."""
    return max(-I16_MAX, min(v, I16_MAX))


# == NS5 ==========================================================================================
# Its three matmuls per iteration are the shared integer GEMM (k3gates/gemm): C = A B^T, int16 x
# int16 -> int32, exact, each output clamped (and counted) only if it leaves int32.
def _split_a(a):
    """(parts, saturations): parts[:m] = A_hi = round(A / 2^14), parts[m:] = A_lo =
    round((A - A_hi 2^14) / 2^4), int16 [2m, m], from the exact Q.28 A (no saturation for
    |A| < 2)."""
    m = a.shape[0]
    parts = np.zeros((2 * m, m), dtype=np.int16)
    sat = np.zeros(m, dtype=np.int64)  # per row, so that the rows can run in parallel
    # omp parallel for
    for i in range(m):
        for j in range(m):
            v = int(a[i, j])
            h = rshift_round(v, X_FRAC)
            lo = rshift_round(v - h * (1 << X_FRAC), A_LO_SHIFT)
            sat[i] += (1 if _sat16(h) != h else 0) + (1 if _sat16(lo) != lo else 0)
            parts[i, j] = _sat16(h)
            parts[m + i, j] = _sat16(lo)
    return parts, int(np.sum(sat))


def _split_b(a, p):
    """(parts, saturations): B_hi (parts[:m]), B_lo (parts[m:]) of B = b A + c A^2 (Q.58), from
    the exact A (Q.28) and p[:m] = A_hi A_hi, p[m:] = A_lo A_hi (A symmetric, so A_hi A_lo =
    (A_lo A_hi)^T)."""
    m = a.shape[0]
    parts = np.zeros((2 * m, m), dtype=np.int16)
    sat = np.zeros(m, dtype=np.int64)  # per row, so that the rows can run in parallel
    # omp parallel for
    for i in range(m):
        for j in range(m):
            a2 = (int(p[i, j]) << 10) + int(p[m + i, j]) + int(p[m + j, i])
            # B = b A + c A^2 in Q.58 (A^2 rounded from Q.38 to Q.32 first)
            bq = NS_B_Q30 * int(a[i, j]) + NS_C_Q26 * rshift_round(a2, 6)
            h = rshift_round(bq, B_HI_SHIFT)
            lo = rshift_round(bq - h * (1 << B_HI_SHIFT), B_LO_SHIFT)
            sat[i] += (1 if _sat16(h) != h else 0) + (1 if _sat16(lo) != lo else 0)
            parts[i, j] = _sat16(h)
            parts[m + i, j] = _sat16(lo)
    return parts, int(np.sum(sat))


def _update_x(q, x):
    """(a X + B X in Q.14 as a new int16 [m, n], saturations), from q[:m] = B_hi X and
    q[m:] = B_lo X."""
    m = x.shape[0]
    n = x.shape[1]
    out = np.zeros((m, n), dtype=np.int16)
    sat = np.zeros(m, dtype=np.int64)  # per row, so that the rows can run in parallel
    # omp parallel for
    for i in range(m):
        for j in range(n):
            bx = (int(q[i, j]) << 10) + int(q[m + i, j])  # B X in Q.37
            # X <- a X + B X: Q.42 -> Q.14
            v = rshift_round(NS_A_Q28 * int(x[i, j]) + (bx << 5), 28)
            sat[i] += 1 if _sat16(v) != v else 0
            out[i, j] = _sat16(v)
    return out, int(np.sum(sat))


def _ns_iterate(x0, steps):
    """X <- a X + (b A + c A^2) X, A = X X^T, `steps` times from the wide int16 x0 [m, n]
    (Q.14). Returns (X, guard): outputs clamped to int32 or int16 (0 under the module
    docstring's premise)."""
    x = x0.copy()  # a value, not the argument's reference: Pythran cannot combine the two
    m = x0.shape[0]
    guard = 0
    for _ in range(steps):
        # A = X X^T, exact in Q.28
        a, g0 = gemm_i16(x, x)
        ahl, g1 = _split_a(a)
        # A^2 = A_hi A_hi 2^10 + A_hi A_lo + A_lo A_hi in Q.38 (A symmetric: rows serve as columns)
        p, g2 = gemm_i16(ahl, ahl[:m].copy())
        bhl, g3 = _split_b(a, p)
        # B X = (B_hi X) 2^10 + B_lo X in Q.37
        q, g4 = gemm_i16(bhl, transpose_i16(x))
        x, g5 = _update_x(q, x)
        guard += g0 + g1 + g2 + g3 + g4 + g5
    return x, guard


def _frobenius(g, sh):
    """(R, e) with R 2^-e = ||round(g / 2^sh)||_F to 2^-29 relative, R in [2^30, 2^31) (0, 0
    for a zero matrix). The sum of squares (each < 2^62) is kept exactly as two 31-bit halves
    (hi < m n 2^31), its top bits (an even shift z) go through fx.isqrt:
    R = floor(sqrt(S_top 2^2k)), e = k - z/2 (e >= -14 for m n <= 2^26)."""
    hi = 0
    lo = 0
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            v = rshift_round(int(g[i, j]), sh)
            sq = v * v
            hi += sq >> 31
            lo += sq & MASK31
    hi += lo >> 31
    lo &= MASK31
    if hi == 0 and lo == 0:
        return 0, 0
    z = max(bitlen(hi) + 31 - 61, 0)  # S / 2^z < 2^61 + 2^31: top has at most 62 bits
    z += z & 1
    top = (hi >> (z - 31)) if z > 31 else (hi << (31 - z)) + (lo >> z)
    k = (62 - bitlen(top)) >> 1
    return isqrt(top << (2 * k)), k - (z >> 1)


def _normalise(g, eps_raw):
    """X_0 = G / (||G||_F + eps) in Q.14 (int16, G's own orientation), eps in G's units.

    G is first rounded to |G| <= 2^31 (shift sh, exact when |G| < 2^31 already). Then
    X_0 = round(G 2^(14 + e) / (R + eps 2^(e - sh))) with ||G|| ~ R 2^-e: error <= 1/2 + 2^-15
    LSB against the exact G / (||G|| + eps) of the rounded G; |X_0| <= 2^14.
    """
    m = g.shape[0]
    n = g.shape[1]
    x = np.zeros((m, n), dtype=np.int16)
    gmax = 0
    for i in range(m):
        for j in range(n):
            gmax = max(gmax, abs(int(g[i, j])))
    sh = max(bitlen(gmax) - NORM_BITS, 0)
    r, e = _frobenius(g, sh)
    if r == 0:
        return x
    d = r + ((eps_raw << (e - sh)) if e >= sh else rshift_round(eps_raw, sh - e))
    for i in range(m):
        for j in range(n):
            # X_0 = G / (||G|| + eps) in Q.14
            v = rshift_round(int(g[i, j]), sh)
            x[i, j] = div_round(v * (1 << (X_FRAC + e)), d)
    return x


def _columns_win(x):
    """For square X_0: True when sum_j ||col_j||^4 > sum_i ||row_i||^4 (exact, < 2^57). It picks
    the orientation of a square input so that NS5(G^T) = NS5(G)^T holds (transposing swaps the
    two sums), and is unchanged by permuting rows or columns. A tie keeps G as it is."""
    n = x.shape[0]
    rows = 0
    cols = 0
    for i in range(n):
        r = 0
        c = 0
        for j in range(n):
            r += int(x[i, j]) * int(x[i, j])
            c += int(x[j, i]) * int(x[j, i])
        rows += r * r
        cols += c * c
    return cols > rows


# pythran export ns5(int64[:,:] order(C), int64)
def ns5(G, eps_raw):
    """NS5(G) in Q1.14 (int16, G's shape) and the guard count (0: every sum was exact in int32
    and nothing saturated).

    G [m, n] int64 in any format, |G| < 2^62, m n <= 2^26; eps_raw >= 0 in G's units (< 2^31).
    A tall G (m > n) is iterated as G^T, a square G as G^T when its columns win `_columns_win`,
    so NS5(G^T) = NS5(G)^T exactly: both are the same integer computation on the same wide
    matrix. The zero matrix gives zeros.
    """
    m = G.shape[0]
    n = G.shape[1]
    x0 = _normalise(G, eps_raw)
    flip = m > n or (m == n and _columns_win(x0))
    if flip:
        x, guard = _ns_iterate(transpose_i16(x0), NS_STEPS)
        return transpose_i16(x), guard
    return _ns_iterate(x0, NS_STEPS)


# pythran export ns_step(int16[:,:] order(C))
def ns_step(X):
    """One NS iteration of a wide X (rows <= columns) in Q1.14: (X_new, guard count).
    Error <= ns_step_bound_q10(rows) / 2^10 LSB against the exact iteration of this X."""
    return _ns_iterate(X, 1)


# pythran export normalise(int64[:,:] order(C), int64)
def normalise(G, eps_raw):
    """X_0 = G / (||G||_F + eps) in Q1.14 (int16), no transposition (see `_normalise`)."""
    return _normalise(G, eps_raw)


# == the Muon step ================================================================================
def _scale_q40(lr_q, max_dim):
    """lr 0.2 sqrt(max_dim) in Q.40 (lr in Q.30, max_dim >= 1): sqrt(x) = x rsqrt(x) from
    fx.rsqrt_norm (relative error 2^-59.5), the 1/5 by one exact division, lr by mul_round.
    Error <= 1/2 + lr (1/2 + 1/10 + 2^-19.5 sqrt(max_dim)) < 1.1 units of 2^-40 for lr <= 1."""
    h, e = rsqrt_norm(max_dim, 0)  # 1 / sqrt(max_dim) = h 2^-e
    s40 = div_round(mul_round(max_dim, h, e - 40), SCALE_DIV)  # 0.2 sqrt(max_dim) in Q.40
    return mul_round(lr_q, s40, HYPER_FRAC)


def _slice(N, h, dh, axis):
    """Head h's slice of N: rows h dh .. (h+1) dh (axis 0) or those columns (axis 1), copied."""
    rows = dh if axis == 0 else N.shape[0]
    cols = N.shape[1] if axis == 0 else dh
    out = np.zeros((rows, cols), dtype=np.int64)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = N[i + h * dh, j] if axis == 0 else N[i, j + h * dh]
    return out


# pythran export momentum(int64[:,:] order(C), int64[:,:] order(C), int64, int64)
def momentum(M, G, mu_q, nesterov):
    """(M_new, N): M_new = mu M + G and N = G + mu M_new (nesterov) or M_new, each with one
    rounding of mu x (mu in Q.30, fx.mul_round): within 1/2 LSB of G's format."""
    rows = M.shape[0]
    cols = M.shape[1]
    m_new = np.zeros((rows, cols), dtype=np.int64)
    nest = np.zeros((rows, cols), dtype=np.int64)
    for i in range(rows):
        for j in range(cols):
            # M <- mu M + G;  N = G + mu M (Nesterov)
            v = mul_round(int(M[i, j]), mu_q, HYPER_FRAC) + int(G[i, j])
            m_new[i, j] = v
            nest[i, j] = int(G[i, j]) + mul_round(v, mu_q, HYPER_FRAC) if nesterov else v
    return m_new, nest


# pythran export muon_step(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64, int64, int64, int64, int64, int64, int64, int64)
def muon_step(W, M, G, mu_q, lr_q, wd_q, nesterov, heads, axis, wf, eps_raw):
    """One Muon step with per-head NS5: (W_new, M_new, guard).

    W [r, c] in Q.wf, 0 <= wf <= 28, |W| < 2^61; M and G [r, c] in one format of the caller's,
    with |mu M + G| < 2^61; mu, lr, wd in Q.30 with 0 <= mu < 1, 0 <= lr <= 1, lr wd <= 1;
    nesterov 0 or 1; heads >= 1 dividing the sliced axis (axis 0: rows, as W_Q, W_K, W_V hold
    their heads; axis 1: columns, as W_O); eps_raw in G's units. heads = 1 is plain Muon.
        M_new = mu M + G;  N = G + mu M_new (nesterov) or M_new       (`momentum`)
        O_h = NS5(N_h), Q.14, for each head slice N_h, of shape A x B
        W_new = W - lr wd W - lr 0.2 sqrt(max(A, B)) O_h
    Given O, W_new is within 1 + 2^-10 LSB of the exact expression (STEP_MAX_ERR): the decay is
    one rounding of the exact 124-bit product W lr wd; the update one rounding of f O with
    f = lr 0.2 sqrt(max(A, B)) in Q.40 (`_scale_q40`: within 1.1 2^-40), which moves it by at
    most 1.1 |O| 2^(wf - 40) < 2^-10.9 LSB for |O| <= 2 and wf <= 28.
    """
    rows = W.shape[0]
    cols = W.shape[1]
    m_new, nest = momentum(M, G, mu_q, nesterov)
    w_new = np.zeros((rows, cols), dtype=np.int64)
    decay = lr_q * wd_q  # lr wd in Q.60, exact
    dh = (rows if axis == 0 else cols) // heads
    guard = 0
    for h in range(heads):
        o, g = ns5(_slice(nest, h, dh, axis), eps_raw)
        guard += g
        f = _scale_q40(lr_q, max(o.shape[0], o.shape[1]))
        for i in range(o.shape[0]):
            for j in range(o.shape[1]):
                r = i + h * dh if axis == 0 else i
                c = j if axis == 0 else j + h * dh
                w = int(W[r, c])
                # W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O
                step = mul_round(f, int(o[i, j]), 40 + X_FRAC - wf)
                w_new[r, c] = w - mul_round(w, decay, 2 * HYPER_FRAC) - step
    return w_new, m_new, guard


# pythran export qk_clip(int64[:,:] order(C), int64[:,:] order(C), int64[:], int64, int64)
def qk_clip(Wq, Wk, s_max, tau, heads):
    """QK-Clip (Kimi K2, arXiv 2507.20534): gamma_h = min(1, tau / S_max^h); head h's rows of
    W_Q and W_K are each scaled by sqrt(gamma_h), so its logits scale by gamma_h.

    Wq, Wk [heads * dh, d] in any Q.f (|W_raw| <= 2^30 for the bound); s_max [heads] and tau
    in one format, 0 < tau, s_max < 2^61. Heads with s_max <= tau are returned bit-identical.
    sqrt(gamma) = floor(sqrt(gamma 2^62)) 2^-31 (gamma 2^62 by exact long division, rounded), so
    each scaled weight is within 1/2 + |W_raw| 2^-31 LSB: QKCLIP_MAX_ERR for |W_raw| <= 2^30.
    Returns (Wq', Wk', the number of heads clipped).
    """
    rows = Wq.shape[0]
    dh = rows // heads
    wq = Wq.copy()
    wk = Wk.copy()
    clipped = 0
    for h in range(heads):
        s = int(s_max[h])
        if s <= tau:
            continue
        clipped += 1
        # sqrt(gamma) in Q.31, gamma = tau / S_max < 1
        r = isqrt(div_round_shift(tau, s, 62))
        for i in range(h * dh, (h + 1) * dh):
            for j in range(Wq.shape[1]):
                wq[i, j] = mul_round(int(Wq[i, j]), r, 31)
                wk[i, j] = mul_round(int(Wk[i, j]), r, 31)
    return wq, wk, clipped


# == an attention layer trained with per-head Muon (the PROVEN gate) ==============================
# Formats: x, y, q, k, v, o, y_hat, e and every backward activation in Q.24 (TRAIN_FRAC), int64,
# saturated to |.| < 2^31 raw (128.0, counted); weights Q.24, saturated to |W| < 2^29 raw (32.0);
# attention probabilities Q0.31 (fx.softmax_row_q31); gradients summed in Q.32 (GRAD_FRAC).
# Every product of two such values is < 2^62 and is rounded (fx.rshift_round) *before* it is
# summed, so every sum is exact and independent of the order of its terms (sequence order,
# token order): the trainer is bit-identical under any permutation of the batch.
TRAIN_FRAC = 24
GRAD_FRAC = 32
P_FRAC = 31  # softmax output, Q0.31
ACT_BITS = 32  # activations saturate to the signed 32-bit range
WEIGHT_BITS = 30  # weights saturate to the signed 30-bit range (|W| < 32)


def _satn(v, bits):
    """v clamped to [-2^(bits-1) + 1, 2^(bits-1) - 1]."""
    hi = (1 << (bits - 1)) - 1
    return max(-hi, min(v, hi))


def _proj(a, r0, t_len, W):
    """(out, saturations): out[t, r] = sum_k W[r, k] a[r0 + t, k] in Q.24, each product
    rounded, t < t_len."""
    out = np.zeros((t_len, W.shape[0]), dtype=np.int64)
    sat = 0
    for t in range(t_len):
        for r in range(W.shape[0]):
            acc = 0
            # out_tr = sum_k W_rk a_tk
            for k in range(W.shape[1]):
                acc += rshift_round(int(W[r, k]) * int(a[r0 + t, k]), TRAIN_FRAC)
            sat += 1 if _satn(acc, ACT_BITS) != acc else 0
            out[t, r] = _satn(acc, ACT_BITS)
    return out, sat


def _proj_t(e, W):
    """(out, saturations): out[t, j] = sum_i W[i, j] e[t, i], the backward of `_proj`."""
    out = np.zeros((e.shape[0], W.shape[1]), dtype=np.int64)
    sat = 0
    for t in range(e.shape[0]):
        for j in range(W.shape[1]):
            acc = 0
            # out_tj = sum_i W_ij e_ti
            for i in range(W.shape[0]):
                acc += rshift_round(int(W[i, j]) * int(e[t, i]), TRAIN_FRAC)
            sat += 1 if _satn(acc, ACT_BITS) != acc else 0
            out[t, j] = _satn(acc, ACT_BITS)
    return out, sat


def _attention_probs(q, k, heads, scale_shift):
    """P [H T, T] in Q0.31: row h T + t = softmax_u(q_t^h . k_u^h / sqrt(d_h)), sqrt(d_h) =
    2^scale_shift, the logits in Q.24 (each product rounded), fx.softmax_row_q31 per row."""
    t_len = q.shape[0]
    dh = q.shape[1] // heads
    s = np.zeros((heads * t_len, t_len), dtype=np.int64)
    for h in range(heads):
        for t in range(t_len):
            for u in range(t_len):
                acc = 0
                # s_tu = q_t . k_u / sqrt(d_h)
                for c in range(h * dh, (h + 1) * dh):
                    acc += rshift_round(int(q[t, c]) * int(k[u, c]), TRAIN_FRAC + scale_shift)
                s[h * t_len + t, u] = acc
    p = np.zeros((heads * t_len, t_len), dtype=np.int64)
    for i in range(heads * t_len):
        softmax_row_q31(s, i, t_len, TRAIN_FRAC, p)
    return p


def _mix(p, v, heads, shift):
    """(out, saturations): out[t, h d_h + c] = sum_u p[h T + t, u] v[u, h d_h + c] / 2^shift
    (p in Q0.31 and shift 31: o = P V; p = dS in Q.24 and shift 24: dQ = dS K)."""
    t_len = v.shape[0]
    dh = v.shape[1] // heads
    out = np.zeros((t_len, v.shape[1]), dtype=np.int64)
    sat = 0
    for h in range(heads):
        for t in range(t_len):
            for c in range(h * dh, (h + 1) * dh):
                acc = 0
                # out_tc = sum_u p_tu v_uc
                for u in range(t_len):
                    acc += rshift_round(int(p[h * t_len + t, u]) * int(v[u, c]), shift)
                sat += 1 if _satn(acc, ACT_BITS) != acc else 0
                out[t, c] = _satn(acc, ACT_BITS)
    return out, sat


def _mix_t(p, a, heads, shift):
    """(out, saturations): out[u, h d_h + c] = sum_t p[h T + t, u] a[t, h d_h + c] / 2^shift
    (dV = P^T dO with shift 31, dK = dS^T Q with shift 24)."""
    t_len = a.shape[0]
    dh = a.shape[1] // heads
    out = np.zeros((t_len, a.shape[1]), dtype=np.int64)
    sat = 0
    for h in range(heads):
        for u in range(t_len):
            for c in range(h * dh, (h + 1) * dh):
                acc = 0
                # out_uc = sum_t p_tu a_tc
                for t in range(t_len):
                    acc += rshift_round(int(p[h * t_len + t, u]) * int(a[t, c]), shift)
                sat += 1 if _satn(acc, ACT_BITS) != acc else 0
                out[u, c] = _satn(acc, ACT_BITS)
    return out, sat


def _dlogits(p, do, v, heads, scale_shift):
    """(dS, saturations of dp): dS[h T + t, u] = p_tu (dp_tu - sum_u' p_tu' dp_tu') / sqrt(d_h)
    with dp_tu = dO_t^h . v_u^h, the softmax backward, in Q.24 (p (dp - c) by mul_round)."""
    t_len = v.shape[0]
    dh = v.shape[1] // heads
    ds = np.zeros((heads * t_len, t_len), dtype=np.int64)
    dp = np.zeros(t_len, dtype=np.int64)
    sat = 0
    for h in range(heads):
        for t in range(t_len):
            row = h * t_len + t
            c_t = 0
            for u in range(t_len):
                acc = 0
                # dp_tu = dO_t . v_u
                for c in range(h * dh, (h + 1) * dh):
                    acc += rshift_round(int(do[t, c]) * int(v[u, c]), TRAIN_FRAC)
                sat += 1 if _satn(acc, ACT_BITS) != acc else 0
                dp[u] = _satn(acc, ACT_BITS)
                c_t += rshift_round(int(p[row, u]) * int(dp[u]), P_FRAC)
            # ds_tu = p_tu (dp_tu - c_t) / sqrt(d_h)
            for u in range(t_len):
                ds[row, u] = mul_round(int(p[row, u]), int(dp[u]) - c_t, P_FRAC + scale_shift)
    return ds, sat


def _outer(a, b, r0):
    """out[i, j] = sum_t a[t, i] b[r0 + t, j] in Q.32 (each Q.48 product rounded to Q.32)."""
    out = np.zeros((a.shape[1], b.shape[1]), dtype=np.int64)
    for i in range(a.shape[1]):
        for j in range(b.shape[1]):
            acc = 0
            # dW_ij = sum_t a_ti b_tj
            for t in range(a.shape[0]):
                acc += rshift_round(int(a[t, i]) * int(b[r0 + t, j]), 2 * TRAIN_FRAC - GRAD_FRAC)
            out[i, j] = acc
    return out


def _errors(y_hat, y, r0):
    """(e, loss, saturations): e = y_hat - y[r0 ..] (Q.24, saturated) and sum round(e^2) in Q.24."""
    e = np.zeros((y_hat.shape[0], y_hat.shape[1]), dtype=np.int64)
    loss = 0
    sat = 0
    for t in range(y_hat.shape[0]):
        for j in range(y_hat.shape[1]):
            d = int(y_hat[t, j]) - int(y[r0 + t, j])
            sat += 1 if _satn(d, ACT_BITS) != d else 0
            e[t, j] = _satn(d, ACT_BITS)
            loss += rshift_round(int(e[t, j]) * int(e[t, j]), TRAIN_FRAC)
    return e, loss, sat


# pythran export attention_grads(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64, int64, int64, int64[:])
def attention_grads(x, y, Wq, Wk, Wv, Wo, t_len, heads, scale_shift, order):
    """Loss and gradients of one attention layer, y_hat = concat_h softmax(q k^T / sqrt(d_h)) v
    W_O^T, q = W_Q x, k = W_K x, v = W_V x, loss = sum (y_hat - y)^2 (dW = d/dW of half of it).

    x, y [n_seq T, d] in Q.24 (rows n T .. n T + T - 1 are sequence n); W_Q, W_K, W_V
    [H d_h, d] and W_O [d, H d_h] in Q.24; sqrt(d_h) = 2^scale_shift; `order` the order the
    sequences are visited in (any permutation gives the same bits). Returns (loss in Q.24 (the sum
    of the rounded squares), dW_Q, dW_K, dW_V, dW_O in Q.32, saturations).
    """
    d = x.shape[1]
    hd = Wq.shape[0]
    g_q = np.zeros((hd, d), dtype=np.int64)
    g_k = np.zeros((hd, d), dtype=np.int64)
    g_v = np.zeros((hd, d), dtype=np.int64)
    g_o = np.zeros((d, hd), dtype=np.int64)
    loss = 0
    sat = 0
    for idx in range(order.shape[0]):
        r0 = int(order[idx]) * t_len
        # forward: q, k, v = W x;  P = softmax(q k^T / sqrt(d_h));  o = P v;  y_hat = W_O o
        q, s1 = _proj(x, r0, t_len, Wq)
        k, s2 = _proj(x, r0, t_len, Wk)
        v, s3 = _proj(x, r0, t_len, Wv)
        p = _attention_probs(q, k, heads, scale_shift)
        o, s4 = _mix(p, v, heads, P_FRAC)
        y_hat, s5 = _proj(o, 0, t_len, Wo)
        e, sq, s6 = _errors(y_hat, y, r0)
        # backward: dW_O = e o^T;  dO = W_O^T e;  dV = P^T dO;  dS;  dQ = dS K;  dK = dS^T Q
        do, s7 = _proj_t(e, Wo)
        dv, s8 = _mix_t(p, do, heads, P_FRAC)
        ds, s9 = _dlogits(p, do, v, heads, scale_shift)
        dq, s10 = _mix(ds, k, heads, TRAIN_FRAC)
        dk, s11 = _mix_t(ds, q, heads, TRAIN_FRAC)
        g_o = g_o + _outer(e, o, 0)
        g_q = g_q + _outer(dq, x, r0)
        g_k = g_k + _outer(dk, x, r0)
        g_v = g_v + _outer(dv, x, r0)
        loss += sq
        sat += s1 + s2 + s3 + s4 + s5 + s6 + s7 + s8 + s9 + s10 + s11
    return loss, g_q, g_k, g_v, g_o, sat


def _clamped(W):
    """(W clamped to |W| < 2^29 raw (32.0 in Q.24), how many were clamped)."""
    out = np.zeros((W.shape[0], W.shape[1]), dtype=np.int64)
    sat = 0
    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            v = int(W[i, j])
            sat += 1 if _satn(v, WEIGHT_BITS) != v else 0
            out[i, j] = _satn(v, WEIGHT_BITS)
    return out, sat


# pythran export train_attention(int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64[:,:] order(C), int64, int64, int64, int64, int64, int64, int64, int64, int64[:])
def train_attention(
    x, y, Wq0, Wk0, Wv0, Wo0, steps, t_len, heads, scale_shift, lr_q, mu_q, wd_q, eps_raw, order
):
    """Full-batch training of the attention layer of `attention_grads` with per-head Muon
    (`muon_step`, Nesterov): W_Q, W_K, W_V sliced by rows, W_O by columns, one slice per head.

    Returns (losses [steps + 1]: the mean squared error in Q.24 before each step and after the
    last; W_Q, W_K, W_V, W_O; saturations; NS5 guard count).
    """
    n_out = x.shape[0] * x.shape[1]
    wq = Wq0.copy()
    wk = Wk0.copy()
    wv = Wv0.copy()
    wo = Wo0.copy()
    m_q = np.zeros((wq.shape[0], wq.shape[1]), dtype=np.int64)
    m_k = np.zeros((wk.shape[0], wk.shape[1]), dtype=np.int64)
    m_v = np.zeros((wv.shape[0], wv.shape[1]), dtype=np.int64)
    m_o = np.zeros((wo.shape[0], wo.shape[1]), dtype=np.int64)
    losses = np.zeros(steps + 1, dtype=np.int64)
    sat = 0
    guard = 0
    for t in range(steps + 1):
        loss, g_q, g_k, g_v, g_o, s = attention_grads(
            x, y, wq, wk, wv, wo, t_len, heads, scale_shift, order
        )
        losses[t] = div_round(loss, n_out)
        sat += s
        if t == steps:
            break
        # per-head Muon: W_Q, W_K, W_V by rows (axis 0), W_O by columns (axis 1)
        nq, m_q, g1 = muon_step(wq, m_q, g_q, mu_q, lr_q, wd_q, 1, heads, 0, TRAIN_FRAC, eps_raw)
        nk, m_k, g2 = muon_step(wk, m_k, g_k, mu_q, lr_q, wd_q, 1, heads, 0, TRAIN_FRAC, eps_raw)
        nv, m_v, g3 = muon_step(wv, m_v, g_v, mu_q, lr_q, wd_q, 1, heads, 0, TRAIN_FRAC, eps_raw)
        no, m_o, g4 = muon_step(wo, m_o, g_o, mu_q, lr_q, wd_q, 1, heads, 1, TRAIN_FRAC, eps_raw)
        wq, c1 = _clamped(nq)
        wk, c2 = _clamped(nk)
        wv, c3 = _clamped(nv)
        wo, c4 = _clamped(no)
        guard += g1 + g2 + g3 + g4
        sat += c1 + c2 + c3 + c4
    return losses, wq, wk, wv, wo, sat, guard
