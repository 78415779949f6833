"""One shared integer GEMM, C = A B^T, exact: int16 x int16 -> int32, and int64 x int64 -> int64.

Both operands are row-major with K contiguous, A [M, K] and B [N, K], so every output is the dot
product of two contiguous rows and the inner loop reads both operands at unit stride; that is
the layout a training matmul already has for X W^T (W stored [out, in]) and for X X^T.

    gemm_i16(A int16 [M, K], B int16 [N, K]) -> (C int32 [M, N], sat)
        C = sat32(A B^T) exactly, sat = number of outputs clamped: 0 means C = A B^T.
        sat32 clamps to [-(2^31 - 1), 2^31 - 1] (symmetric, so C(-A, B) = -C(A, B) bit for bit);
        an exact -2^31 is clamped and counted too. Holds for every int16 input with K < 2^33.
    gemm_i64(A int64 [M, K], B int64 [N, K], shift) -> (C int64 [M, N], outside)
        C = rshift_round(A B^T, shift) exactly (fx rounding: half away from zero), shift 0..62
        (a shift outside is clamped into it; the library face refuses one),
        for every output whose row pair is in the domain (below); an output outside it is set
        to 0 and counted in `outside`: 0 means every output is exact.
    sum_outer(G int64 [R, P], A int64 [R, Q], shift) -> (C int64 [P, Q], outside)
        C = rshift_round(G^T A, shift): a weight gradient's sum over R tokens, exact even where
        the sum exceeds int64 (two limbs of G, two gemm_i64 calls, one rounding); `outside`
        counts limb outputs outside gemm_i64's domain (0: every output exact).

The training kernels share the layout helpers below (`transpose`, `token_rows`), so that one
copy of each exists.

Why int32 sums cannot overflow (gemm_i16). Any partial sum of a . b, over any subset of k in
any order (SIMD lanes, vpmaddwd's pairs, K blocks accumulated into C), obeys
|sum| <= ||a|| ||b|| (Cauchy-Schwarz). K * 2^30 < 2^31 fails for K >= 2 with full-range int16,
so instead the squared row norms ||a_i||^2, ||b_j||^2 are summed in int64 first (exact: each
term <= 2^30, K < 2^33) and an output takes the int32 path only when ||a_i||^2 ||b_j||^2 < 2^62,
i.e. every partial sum is at most 2^31 - 1 in magnitude (GUARD_LIMIT). The test is made per
micro-tile (one row of A against four rows of B, with the largest of the four norms; once for
all TILE_M rows when the tile's largest norm passes), so a few extreme rows send only their own
micro-tiles down the slow path: there the sum is formed in int64 (exact) and clamped. The fast
path is what gcc turns into vpmaddwd + vpaddd: rows of norm <= 5/4 in Q1.14 (NS5's iterates,
||X||_2 <= 5/4) give ||a||^2 ||b||^2 <= 2^57.3 and keep every tile on it, whatever K.

Domain of gemm_i64 (Hoelder): every partial sum of a . b is at most
min(||a||_1 ||b||_inf, ||a||_inf ||b||_1) in magnitude; an output is computed when that bound
is below 2^62 (HOELDER_LIMIT, one bit of headroom below int64's 2^63) and every element of both
rows is below 2^62 in magnitude. The L1 norms are summed with saturation at 2^62 (terms < 2^62:
no overflow), and a saturated norm fails the test, as its true value does. Simple sufficient
condition: K max|A| max|B| < 2^62, e.g. |A|, |B| < 2^25 with K <= 2^11, or Q.24 activations
|x| < 2^27 against Q.24 weights |w| < 2^24 with K <= 2^10. The rounding shift cannot overflow
(fx.rshift_round is exact for every int64 but -2^63).

Blocking (for this machine's 32 KiB L1d and 512 KiB L2 per core): rows of A are taken TILE_M at
a time (one `omp parallel for` iteration each, so threads own disjoint rows of C), K in blocks of
TILE_K; within a block, four rows of B (4 x TILE_K x 2 bytes = 16 KiB at most) stay in L1 while
the TILE_M rows of A (at most 256 KiB) stream from L2, and each row of A meets them in one
micro-kernel: four dot products sharing the load of a_ik, four independent int32 reductions that
gcc -O3 -march=native vectorises (more reductions per loop, measured, stop it vectorising).
Integer sums are exact in any order, so the result does not depend on the tiling or the thread
count: the gate checks both.
"""

import numpy as np

from ..fx.kernels import rshift_round

# -- exactness constants (each: raw integer, the real expression) --------------------------------
EXACT_LSB = 0  # both kernels are exact: the gate's declared bound
GUARD_LIMIT = 4611686018427387904  # 2**62: ||a||^2 ||b||^2 < 2^62 <=> |a . b| <= 2^31 - 1
I32_MAX = 2147483647  # 2**31 - 1
I64_MAX = 9223372036854775807  # 2**63 - 1
I64_ELEM_LIMIT = 4611686018427387904  # 2**62: gemm_i64 needs |element| < 2^62
HOELDER_LIMIT = 4611686018427387904  # 2**62: gemm_i64 needs min(|a|_1 |b|_inf, ..) < 2^62
MAX_SHIFT = 62  # gemm_i64's shift range is 0..MAX_SHIFT
SUM_LIMB = 16  # sum_outer splits G as (G >> 16) 2^16 + (G & 0xFFFF)
SUM_MASK = 65535  # 2**16 - 1
# -- tiling --------------------------------------------------------------------------------------
TILE_M = 64  # rows of A per parallel tile: TILE_M x TILE_K int16 = 256 KiB, half of L2
TILE_K = 2048  # K block: a B micro-panel (4 rows) is 16 KiB, half of L1d
NR = 4  # rows of B per micro-kernel (more reductions per loop stop gcc vectorising)


def _sat32(v):
    """v clamped to [-(2^31 - 1), 2^31 - 1]."""
    return max(-I32_MAX, min(v, I32_MAX))


def _row_sq(x):
    """||x_i||^2 for every row of an int16 matrix, in int64: exact (terms <= 2^30, K < 2^33)."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    for i in range(x.shape[0]):
        s = 0
        for k in range(x.shape[1]):
            v = int(x[i, k])
            s += v * v
        out[i] = s
    return out


def _cap32(nb):
    """The largest ||a||^2 whose product with nb stays below GUARD_LIMIT (all, when nb = 0)."""
    return I64_MAX if nb == 0 else (GUARD_LIMIT - 1) // nb


def _quad_caps(nb, n4):
    """_cap32 of the largest squared norm in each group of NR rows of B (the micro-tiles)."""
    caps = np.zeros(n4 // NR, dtype=np.int64)
    for q in range(n4 // NR):
        j = q * NR
        caps[q] = _cap32(max(max(nb[j], nb[j + 1]), max(nb[j + 2], nb[j + 3])))
    return caps


def _dot_i64(a, i, b, j):
    """a_i . b_j summed in int64: exact for int16 rows with K < 2^33 (each product, exact in
    int32 as |a b| <= 2^30, is widened before the sum)."""
    s = 0
    for k in range(a.shape[1]):
        s += int(np.int32(a[i, k]) * np.int32(b[j, k]))
    return s


def _quad_i64(a, b, out, i, j):
    """out[i, j..j+3] = sat32(a_i . b_(j+r)) from exact int64 sums (products in int32, widened),
    four at a time like `_micro_i16`. Returns how many of the four were clamped."""
    s0 = 0
    s1 = 0
    s2 = 0
    s3 = 0
    for k in range(a.shape[1]):
        v = np.int32(a[i, k])
        s0 += int(v * np.int32(b[j, k]))
        s1 += int(v * np.int32(b[j + 1, k]))
        s2 += int(v * np.int32(b[j + 2, k]))
        s3 += int(v * np.int32(b[j + 3, k]))
    out[i, j] = _sat32(s0)
    out[i, j + 1] = _sat32(s1)
    out[i, j + 2] = _sat32(s2)
    out[i, j + 3] = _sat32(s3)
    n = 1 if _sat32(s0) != s0 else 0  # (Pythran adds bools as bools: count as ints)
    n += 1 if _sat32(s1) != s1 else 0
    n += 1 if _sat32(s2) != s2 else 0
    return n + (1 if _sat32(s3) != s3 else 0)


def _micro_i16(a, b, out, i, j, k0, k1):
    """out[i, j..j+3] += sum_{k0 <= k < k1} a_ik b_(j+r)k: four int32 reductions sharing each
    load of a_ik (gcc: vpmaddwd + vpaddd). The caller has checked the guard."""
    av = a[i, k0:k1]
    b0 = b[j, k0:k1]
    b1 = b[j + 1, k0:k1]
    b2 = b[j + 2, k0:k1]
    b3 = b[j + 3, k0:k1]
    s0 = np.int32(0)
    s1 = np.int32(0)
    s2 = np.int32(0)
    s3 = np.int32(0)
    for k in range(k1 - k0):
        v = np.int32(av[k])
        s0 += v * np.int32(b0[k])
        s1 += v * np.int32(b1[k])
        s2 += v * np.int32(b2[k])
        s3 += v * np.int32(b3[k])
    out[i, j] += s0
    out[i, j + 1] += s1
    out[i, j + 2] += s2
    out[i, j + 3] += s3


def _block_i16(a, b, out, i0, i1, k0, k1, na, caps, tile_na):
    """out[i, j] += sum_{k0 <= k < k1} a_ik b_jk in int32 over the micro-tiles of rows i0..i1
    whose Cauchy-Schwarz guard holds (tested once per group of NR rows of B when the tile's
    largest row norm, tile_na, passes); the others are left to `_slow_i16`."""
    for q in range(caps.shape[0]):
        j = q * NR
        whole = tile_na <= caps[q]
        for i in range(i0, i1):
            if whole or na[i] <= caps[q]:
                _micro_i16(a, b, out, i, j, k0, k1)


def _slow_i16(a, b, out, i0, i1, na, nb, caps):
    """The outputs `_block_i16` skipped (guard failed) and the last n % NR columns: exact int64
    sums (or, where the pair's own guard holds, an int32 one), clamped. Returns the clamp count."""
    n4 = caps.shape[0] * NR
    sat = 0
    for i in range(i0, i1):
        for q in range(caps.shape[0]):
            if na[i] > caps[q]:
                sat += _quad_i64(a, b, out, i, q * NR)
        for j in range(n4, b.shape[0]):
            if na[i] <= _cap32(nb[j]):
                s32 = np.int32(0)
                for k in range(a.shape[1]):
                    s32 += np.int32(a[i, k]) * np.int32(b[j, k])
                out[i, j] = s32
            else:
                s = _dot_i64(a, i, b, j)
                c = _sat32(s)
                sat += 1 if c != s else 0
                out[i, j] = c
    return sat


# pythran export gemm_i16(int16[:,:] order(C), int16[:,:] order(C))
def gemm_i16(a, b):
    """(C, sat): C int32 [M, N] = sat32(A B^T) exactly for A int16 [M, K], B int16 [N, K];
    sat = outputs clamped to +-(2^31 - 1) (0: C = A B^T). See the module docstring."""
    m = a.shape[0]
    n = b.shape[0]
    kk = a.shape[1]
    out = np.zeros((m, n), dtype=np.int32)
    na = _row_sq(a)
    nb = _row_sq(b)
    caps = _quad_caps(nb, n - n % NR)
    tiles = (m + TILE_M - 1) // TILE_M
    sat_tile = np.zeros(tiles, dtype=np.int64)
    # omp parallel for
    for t in range(tiles):
        i0 = t * TILE_M
        i1 = min(i0 + TILE_M, m)
        tile_na = np.max(na[i0:i1])
        for k0 in range(0, kk, TILE_K):
            _block_i16(a, b, out, i0, i1, k0, min(k0 + TILE_K, kk), na, caps, tile_na)
        sat_tile[t] = _slow_i16(a, b, out, i0, i1, na, nb, caps)
    return out, int(np.sum(sat_tile))


# == gemm_i64 ====================================================================================
def _row_norms_i64(x):
    """(L1, Linf) of every row of an int64 matrix; a row holding an element with |v| >= 2^62
    gets Linf = 2^62 (outside the domain). L1 saturates at 2^62 (s, w <= 2^62: s + w < 2^63)."""
    l1 = np.zeros(x.shape[0], dtype=np.int64)
    linf = np.zeros(x.shape[0], dtype=np.int64)
    for i in range(x.shape[0]):
        s = 0
        top = 0
        for k in range(x.shape[1]):
            v = int(x[i, k])
            if v <= -I64_ELEM_LIMIT or v >= I64_ELEM_LIMIT:
                top = I64_ELEM_LIMIT
                v = 0
            w = v if v >= 0 else -v
            s = min(s + w, I64_ELEM_LIMIT)
            top = max(top, w)
        l1[i] = s
        linf[i] = top
    return l1, linf


def _in_domain(l1a, infa, l1b, infb):
    """True when every partial sum of a . b fits int64 by Hoelder (see the module docstring)."""
    if infa >= I64_ELEM_LIMIT or infb >= I64_ELEM_LIMIT:
        return False
    if infa == 0 or infb == 0:
        return True
    return l1a <= (HOELDER_LIMIT - 1) // infb or l1b <= (HOELDER_LIMIT - 1) // infa


def _block_i64(a, b, acc, ok, i0, i1, k0, k1):
    """acc[i, j] += sum_{k0 <= k < k1} a_ik b_jk in int64 for the pairs with ok[i, j]; four rows
    of B per micro-kernel, the last n % NR one at a time."""
    n = b.shape[0]
    n4 = n - n % NR
    for j in range(0, n4, NR):
        b0 = b[j, k0:k1]
        b1 = b[j + 1, k0:k1]
        b2 = b[j + 2, k0:k1]
        b3 = b[j + 3, k0:k1]
        for i in range(i0, i1):
            if not (ok[i, j] and ok[i, j + 1] and ok[i, j + 2] and ok[i, j + 3]):
                continue  # one pair outside the domain: these four go one at a time below
            av = a[i, k0:k1]
            s0 = 0
            s1 = 0
            s2 = 0
            s3 = 0
            for k in range(k1 - k0):
                v = int(av[k])
                s0 += v * int(b0[k])
                s1 += v * int(b1[k])
                s2 += v * int(b2[k])
                s3 += v * int(b3[k])
            acc[i, j] += s0
            acc[i, j + 1] += s1
            acc[i, j + 2] += s2
            acc[i, j + 3] += s3
    for i in range(i0, i1):
        for j in range(n):
            quad = j < n4 and ok[i, j - j % NR] and ok[i, j - j % NR + 1]
            quad = quad and ok[i, j - j % NR + 2] and ok[i, j - j % NR + 3]
            if ok[i, j] and not quad:
                s = 0
                for k in range(k0, k1):
                    s += int(a[i, k]) * int(b[j, k])
                acc[i, j] += s


# pythran export gemm_i64(int64[:,:] order(C), int64[:,:] order(C), int64)
def gemm_i64(a, b, shift):
    """(C, outside): C int64 [M, N] = rshift_round(A B^T, shift) exactly for A int64 [M, K],
    B int64 [N, K], 0 <= shift <= 62, on the domain; outside it C = 0, counted in `outside`."""
    m = a.shape[0]
    n = b.shape[0]
    kk = a.shape[1]
    s = max(0, min(shift, MAX_SHIFT))
    l1a, infa = _row_norms_i64(a)
    l1b, infb = _row_norms_i64(b)
    ok = np.zeros((m, n), dtype=np.bool_)
    for i in range(m):
        for j in range(n):
            ok[i, j] = _in_domain(l1a[i], infa[i], l1b[j], infb[j])
    acc = np.zeros((m, n), dtype=np.int64)
    tiles = (m + TILE_M - 1) // TILE_M
    # omp parallel for
    for t in range(tiles):
        i0 = t * TILE_M
        i1 = min(i0 + TILE_M, m)
        for k0 in range(0, kk, TILE_K):
            _block_i64(a, b, acc, ok, i0, i1, k0, min(k0 + TILE_K, kk))
        for i in range(i0, i1):
            for j in range(n):
                acc[i, j] = rshift_round(int(acc[i, j]), s) if ok[i, j] else 0
    return acc, m * n - int(np.sum(ok))


# == layouts and token sums ======================================================================
def transpose(a):
    """A^T as a new C-order int64 array: the GEMM reduces along rows of both operands."""
    out = np.zeros((a.shape[1], a.shape[0]), dtype=np.int64)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[j, i] = a[i, j]
    return out


def transpose_i16(a):
    """A^T as a new C-order int16 array (gemm_i16's operands)."""
    out = np.zeros((a.shape[1], a.shape[0]), dtype=np.int16)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[j, i] = a[i, j]
    return out


def token_rows(a):
    """[B, T, n] as a new [B T, n] array: one row per token, a GEMM operand."""
    n_t = a.shape[1]
    out = np.zeros((a.shape[0] * n_t, a.shape[2]), dtype=np.int64)
    for b in range(a.shape[0]):
        for t in range(n_t):
            for j in range(a.shape[2]):
                out[b * n_t + t, j] = a[b, t, j]
    return out


def round_limbs(hi, lo, limb, s):
    """(hi 2^limb + lo) / 2^s rounded half away from zero (fx.rshift_round of the exact total,
    which may exceed int64). Exact for 0 <= s <= 62, 1 <= limb <= 32, any hi and lo with
    |hi| < 2^62 and |lo| < 2^62; the result must fit int64.

    lo is normalised into [0, 2^limb) (carry into hi); the total is then negative iff hi is, and
    a negative total is negated limb-wise, so only non-negative numbers are shifted.
    """
    h = hi + (lo >> limb)
    low = lo & ((1 << limb) - 1)
    neg = h < 0
    if neg:  # -(h 2^limb + low) = (-h - 1) 2^limb + (2^limb - low)
        if low == 0:
            h = -h
        else:
            h = -h - 1
            low = (1 << limb) - low
    low += (1 << s) >> 1  # half of 2^s (0 when s = 0)
    if s >= limb:
        q = (h + (low >> limb)) >> max(s - limb, 0)
    else:
        q = h * (1 << max(limb - s, 0)) + (low >> max(s, 0))
    return -q if neg else q


def _limb_t(g, shift, mask):
    """[P, R]: g [R, P] transposed, each value (v >> shift) & mask (mask -1: every bit)."""
    out = np.zeros((g.shape[1], g.shape[0]), dtype=np.int64)
    for r in range(g.shape[0]):
        for p in range(g.shape[1]):
            out[p, r] = (int(g[r, p]) >> shift) & mask
    return out


# pythran export sum_outer(int64[:,:] order(C), int64[:,:] order(C), int64)
def sum_outer(g, a, shift):
    """(C, outside): C [P, Q] = rshift_round(sum_r g[r, p] a[r, q], shift), 0 <= shift <= 62,
    for g int64 [R, P] and a int64 [R, Q] (rows are tokens). Exact: g = (g >> SUM_LIMB)
    2^SUM_LIMB + (g & SUM_MASK), each limb's token sum exact by gemm_i64, the two-limb total
    rounded once (round_limbs), so a sum beyond int64 is still exact. `outside` counts the limb
    outputs gemm_i64 leaves outside its domain (those outputs are wrong): 0 means C is exact.
    Domain, sufficient: R max|g| max|a| < 2^(62 + SUM_LIMB) and R 2^SUM_LIMB max|a| < 2^62;
    and the rounded result must fit int64."""
    a_t = transpose(a)
    his, o1 = gemm_i64(_limb_t(g, SUM_LIMB, -1), a_t, 0)
    los, o2 = gemm_i64(_limb_t(g, 0, SUM_MASK), a_t, 0)
    out = np.zeros((g.shape[1], a.shape[1]), dtype=np.int64)
    s = max(0, min(shift, MAX_SHIFT))
    for p in range(g.shape[1]):
        for q in range(a.shape[1]):
            out[p, q] = round_limbs(int(his[p, q]), int(los[p, q]), SUM_LIMB, s)
    return out, o1 + o2
