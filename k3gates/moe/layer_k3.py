"""One LatentMoE layer at K3's size, in integers, on one process or sharded by expert on Dask.

The layer (K3-SPEC.md section 4), for each token x:

    s = sigma(W_r x);  S = topk(s + b);  w_e = rsf s_e / sum_{e' in S} s_e'      (router)
    z = W_down x                                                                 (to the latent)
    E_e(z) = w2_e SiTU-GLU(w1_e z, w3_e z),  w1_e, w3_e, w2_e in MXFP4           (routed experts)
    c = sum_{e in S} w_e E_e(z)                                                  (the combine)
    y = W_up RMSNorm(c) + w2_s SiTU-GLU(w1_s x, w3_s x)                          (+ shared experts)

K3's two shared experts are held as one SiTU-GLU of twice the width: the sum of two GLU experts
on the same input is exactly one GLU whose hidden units are the two sets side by side.

Expert parallelism. Worker i of W owns the experts [i n / W, (i+1) n / W). The client routes
(the integer router) and projects z = W_down x; each worker receives only the z rows of the
tokens routed to one of its experts, and the (row, expert, weight) triple of each such slot
(the all-to-all). It returns, per received token, the exact integer sum of its slots' terms
round(w_e E_e). The client adds the workers' sums: integer addition is exact and associative, so
c, and everything after it, is bit-identical to the single process's, in any worker order.

Weights. Every weight is generated from (seed, tensor id) by PCG64 raw 64-bit words (a stream
NumPy keeps stable) read as little-endian bytes, so any worker makes any expert's weights without
communication. The routed experts are generated directly as what K3 stores: packed E2M1 codes
(two per byte, the even index in the low nibble) and one E8M0 scale byte per 32 along the
reduction axis. Why codes rather than integer weights quantised by kernels_qat's kernels: the layer
reads exactly the bytes an MXFP4 checkpoint holds (4.25 bits per weight, 15.7 GB at K3's size),
no worker ever forms the 8-byte-per-weight master tensor (237 GB at K3's size), and generating
an expert costs one table lookup per code. Each code is drawn from CODE_COUNTS, the E2M1
rounding of N(0, 2^2) in units of the block scale (every code value, -0 included, occurs), and
each block's scale is 2^X_top or 2^(X_top - 1) at random, X_top = -(bitlen(K) // 2) for a
reduction length K: rows then have rms about 1.6 2^X_top, between 1.1 and 2.2 over sqrt(K), so
z, g, u and E keep an rms of about 1 to 2 through the layer. The dense weights (router, W_down,
W_up, the shared experts) stay in high precision, as in K3: Q.24 integers drawn uniformly from
|w| <= sqrt(3 / K) (rows of rms 1 / sqrt(K)); the norm weight from [1/2, 3/2]; x uniformly
from |x| <= sqrt(3).

Formats (int64; "Q.f" means v stands for v 2^-f); each product is exact before its one rounding:
    x, dense weights, w_n, rsf     Q.24      y                               Q.24
    b (frozen QB bias)             Q.40      wts (combine weights, router)   Q.56
    z = W_down x                   Q.40      (gemm_i64: exact Q.48 sum, rounded once)
    g = w1 z, u = w3 z             Q.40      (kernels_qat.packed_matmul: exact MX sum, once rounded)
    a = SiTU-GLU(g, u)             Q.24      (situ.situ_glu_array)
    E = w2 a                       Q.40      (packed_matmul)
    term = round(w_e E)            Q.40      (fx.mul_round_array); c = sum of terms, exact
    r = RMSNorm(c) w_n             Q.24      (moe.latent_rmsnorm)
    g_s = w1_s x, u_s = w3_s x     Q.48      exact (gemm_i64, no rounding); a_s Q.24
    y = round(W_up r + w2_s a_s)   Q.24      (two exact Q.48 sums, added, rounded once)

Worst-case magnitudes (the analysed domain; the kernels count anything outside and the layer
raises): |x| <= sqrt(3); dense rows L1 <= sqrt(3 K) so |z| <= sqrt(3) sqrt(3 d) (the premise
|z| < Z_MAX = 16 keeps packed_matmul's terms |z 2^40 code 2^s| below 2^48 with s <= 0, i.e. every
expert scale X <= 1); |a| <= 100 (SiTU), whose terms 2^30.7 12 2^(X + 15) stay below 2^48 for
X <= -2 (X_top(96) = -3 is the largest here); each sum of K <= 2^14 terms stays below 2^62.
|w_e| <= rsf <= 4, |E| <= E_MAX = 16 (premise): |term| < 2^46, c below 2^51. W_up r and w2_s a_s:
|r| <= 3/2 sqrt(d_l) and |a_s| <= 100 against rows of L1 <= sqrt(3 K) 2^24: each below 2^62
(gemm_i64's domain, checked per output), their sum below 2^63.
"""

from __future__ import annotations

import functools
import resource
import time
from dataclasses import dataclass, field
from math import isqrt, sqrt

import numpy as np

from ..infra import compile as kcompile
from ..situ import kernels as situ_k
from . import kernels as moe_k

# -- formats (fractional bits) ---------------------------------------------------------------------
X_FRAC = 24  # x, y, every dense weight, w_n, rsf
B_FRAC = 40  # the router bias (moe.router's Q.40 scores)
WTS_FRAC = 56  # combine weights from moe.router
Z_FRAC = 40  # z, g, u, E and the combine c
A_FRAC = 24  # a = SiTU-GLU(g, u), and a_s (situ_glu_array's Q7.24)
S_FRAC = 48  # the shared experts' g_s, u_s and the exact y sums
R_FRAC = 24  # r = RMSNorm(c) w_n
EPS_Q56 = 72057594038  # round(1e-6 * 2**56): RMSNorm's eps in moe.latent_rmsnorm's Q.56
SITU_BETA, SITU_BETA_LIN = situ_k.SITU_BETA, situ_k.SITU_BETA_LIN  # 4 and 25

# -- MXFP4 generation ------------------------------------------------------------------------------
BLOCK = 32  # elements per E8M0 scale, along the reduction axis
E8M0_BIAS = 127
# How many of 128 draws get each E2M1 magnitude code 0..7 (values 0, .5, 1, 1.5, 2, 3, 4, 6):
# 128 (P(|N(0, 2^2)| < t_i) - P(|N(0, 2^2)| < t_{i-1})) rounded, the t_i the E2M1 rounding
# midpoints .25, .75, 1.25, 1.75, 2.5, 3.5, 5 (the last count takes everything above 5, saturated
# to 6). Mean |value| 1.582, rms 2.001 (in units of the block scale). Tests recompute it.
CODE_COUNTS = (13, 24, 23, 19, 22, 17, 8, 2)
EXPERT_STREAM, DENSE_STREAM = 1, 0  # the first word after the seed: which family of tensors

# -- the analysed domain, and the premises the bounds rest on (checked on the data) --------------
Z_MAX = 16  # |z| < 16: packed_matmul's terms stay in its exact domain
E_MAX = 16  # |E| <= 16
# Every expert row's L1 is at most 6 K 2^X_top, the format's worst case (an E2M1 value is at
# most 6 times its block's scale, a scale at most 2^X_top). The bounds below are a declared
# function of the largest row L1 of the experts a check uses (about 1.2 K 2^X_top here, measured
# on the weights before any output is compared), with this worst case as the default.
W_L1_MAX = 6
RHO_MIN_INV = 16  # rms(c) >= 1/16 on the sampled tokens (expected about 0.3 at rsf 1)
S_MIN_INV = 16  # each token's selected scores sum to >= 1/16 (moe's weights bound)
NORM_W_MAX = 1.5  # w_n in [1/2, 3/2]
RSF_MAX = 4


@dataclass(frozen=True)
class Shape:
    """One MoE layer's shape. Each field is a K3 figure at `K3`; `SMALL` keeps the structure."""

    n_experts: int  # routed experts; more experts = more weights, same compute per token
    top_k: int  # experts per token: the compute per token grows with it (moe.router: <= 31)
    n_shared: int  # shared experts, held as one SiTU-GLU of n_shared x shared_width
    hidden: int  # d: the residual stream's width
    latent: int  # d_l: the experts work here (LatentMoE); a multiple of 32 (MXFP4 blocks)
    expert_width: int  # f: each routed expert's SiTU-GLU width; a multiple of 32
    shared_width: int  # each shared expert's width (K3's is not public: taken as f)
    rsf_q24: int = 1 << 24  # routed_scaling_factor in Q.24: public sources say 1.0 or 2.827

    @property
    def expert_bytes(self) -> int:
        """One expert's MXFP4 bytes: 3 f d_l codes at 4 bits, one scale byte per 32."""
        n = 3 * self.expert_width * self.latent
        return n // 2 + n // BLOCK


K3 = Shape(896, 16, 2, 7168, 3584, 3072, 3072)
SMALL = Shape(32, 4, 2, 256, 128, 96, 96)
SCALES = {"k3": K3, "small": SMALL}


# == deterministic weights ========================================================================
def _words(seed: int, stream: int, tensor: int, part: int, n_bytes: int) -> np.ndarray:
    """n_bytes bytes of PCG64's raw output for (seed, stream, tensor, part), little-endian."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, stream, tensor, part]))
    words = bits.random_raw((n_bytes + 7) // 8).astype("<u8", copy=False)
    return words.view(np.uint8)[:n_bytes]


@functools.cache
def _code_table() -> np.ndarray:
    """A random byte -> an E2M1 code: bit 7 the sign, the low 7 bits by CODE_COUNTS."""
    mags = np.repeat(np.arange(8, dtype=np.uint8), CODE_COUNTS)  # 128 magnitude codes
    return np.concatenate([mags, mags | 8]).astype(np.uint8)


def x_top(k: int) -> int:
    """The larger of a matrix's two block scale exponents, for reduction length k."""
    return -(k.bit_length() // 2)


def mxfp4_matrix(seed: int, tensor: int, part: int, rows: int, k: int) -> tuple[np.ndarray, ...]:
    """(packed uint8 [rows, k/2], scales uint8 [rows, k/32]) of one MXFP4 matrix."""
    codes = _code_table()[_words(seed, EXPERT_STREAM, tensor, 2 * part, rows * k)]
    codes = codes.reshape(rows, k)
    # two codes per byte, the even index in the low nibble (mxfp.pack_fp4's layout)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    coin = _words(seed, EXPERT_STREAM, tensor, 2 * part + 1, rows * (k // BLOCK)) & 1
    scales = (E8M0_BIAS + x_top(k) - coin).astype(np.uint8).reshape(rows, k // BLOCK)
    return np.ascontiguousarray(packed), scales


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert as stored: w1, w3 [f, d_l] and w2 [d_l, f] in packed MXFP4."""

    w1: tuple[np.ndarray, np.ndarray]  # (packed [f, d_l/2], scales [f, d_l/32])
    w3: tuple[np.ndarray, np.ndarray]
    w2: tuple[np.ndarray, np.ndarray]  # (packed [d_l, f/2], scales [d_l, f/32])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pair in (self.w1, self.w3, self.w2) for a in pair)


def expert_weights(shape: Shape, seed: int, e: int) -> ExpertWeights:
    """Expert e's weights, the same bits on every machine: tensor id e, parts 0, 1, 2."""
    if not 0 <= e < shape.n_experts:
        raise ValueError(f"expert id: expected 0 <= e < {shape.n_experts}, got {e}")
    f, d_l = shape.expert_width, shape.latent
    return ExpertWeights(
        w1=mxfp4_matrix(seed, e, 0, f, d_l),
        w3=mxfp4_matrix(seed, e, 1, f, d_l),
        w2=mxfp4_matrix(seed, e, 2, d_l, f),
    )


def _uniform(seed: int, tensor: int, shape: tuple[int, ...], limit: int) -> np.ndarray:
    """int64 uniform on [-limit, limit] (modulo reduction of raw words; bias below 2^-30)."""
    n = int(np.prod(shape))
    words = _words(seed, DENSE_STREAM, tensor, 0, 8 * n).view("<u8")
    return ((words % np.uint64(2 * limit + 1)).astype(np.int64) - limit).reshape(shape)


def _dense_limit(k: int) -> int:
    """floor(2^24 sqrt(3 / k)): uniform Q.24 weights of rms 1 / sqrt(k)."""
    return isqrt((3 << 48) // k)


@dataclass(frozen=True)
class DenseWeights:
    """The non-expert weights, Q.24 int64 unless stated (K3 keeps them in high precision)."""

    w_r: np.ndarray  # [n, d]      router
    b: np.ndarray  # [n]           frozen Quantile Balancing bias, Q.40, |b| <= 2^-5
    w_down: np.ndarray  # [d_l, d]
    w_n: np.ndarray  # [d_l]       latent RMSNorm weight in [1/2, 3/2]
    w_up: np.ndarray  # [d, d_l]
    w1_s: np.ndarray  # [f_s, d]   the shared experts, side by side (f_s = n_shared x width)
    w3_s: np.ndarray  # [f_s, d]
    w2_s: np.ndarray  # [d, f_s]


def dense_weights(shape: Shape, seed: int) -> DenseWeights:
    d, d_l, n = shape.hidden, shape.latent, shape.n_experts
    f_s = shape.n_shared * shape.shared_width
    return DenseWeights(
        w_r=_uniform(seed, 0, (n, d), _dense_limit(d)),
        b=_uniform(seed, 1, (n,), 1 << (B_FRAC - 5)),
        w_down=_uniform(seed, 2, (d_l, d), _dense_limit(d)),
        w_n=(1 << X_FRAC) + _uniform(seed, 3, (d_l,), 1 << (X_FRAC - 1)),
        w_up=_uniform(seed, 4, (d, d_l), _dense_limit(d_l)),
        w1_s=_uniform(seed, 5, (f_s, d), _dense_limit(d)),
        w3_s=_uniform(seed, 6, (f_s, d), _dense_limit(d)),
        w2_s=_uniform(seed, 7, (d, f_s), _dense_limit(f_s)),
    )


def make_input(shape: Shape, seed: int, tokens: int) -> np.ndarray:
    """x [tokens, d] in Q.24, uniform on |x| <= sqrt(3) (rms 1)."""
    return _uniform(seed, 100, (tokens, shape.hidden), isqrt(3 << 48))


# == the kernels ==================================================================================
class Kernels:
    """The compiled kernels the layer calls (loaded from the content-hash cache)."""

    def __init__(self) -> None:
        self.moe = kcompile.load("k3gates.moe.kernels")
        self.mx = kcompile.load("k3gates.mxfp.kernels_qat")
        self.gemm = kcompile.load("k3gates.gemm.kernels")
        self.situ = kcompile.load("k3gates.situ.kernels")
        self.fx = kcompile.load("k3gates.fx.kernels")

    def gemm_exact(self, a: np.ndarray, b: np.ndarray, shift: int, what: str) -> np.ndarray:
        """rshift_round(a b^T, shift), exact; an output outside gemm_i64's domain raises."""
        c, outside = self.gemm.gemm_i64(np.ascontiguousarray(a), np.ascontiguousarray(b), shift)
        if outside:
            raise OverflowError(f"{what}: {outside} outputs outside gemm_i64's exact domain")
        return c

    def mx_matmul(self, a: np.ndarray, frac_a: int, w: tuple, frac: int, what: str) -> np.ndarray:
        """round(a W^T) in Q.frac, a in Q.frac_a against a packed MXFP4 W: exact, one rounding."""
        ea = np.full(a.shape, -frac_a, dtype=np.int64)
        c, outside = self.mx.packed_matmul(np.ascontiguousarray(a), ea, w[0], w[1], frac)
        if outside:
            raise OverflowError(f"{what}: {outside} terms outside packed_matmul's exact domain")
        return c


@functools.cache
def kernels() -> Kernels:
    """One Kernels per process (the client's, and each Dask worker's)."""
    return Kernels()


# == the routed experts ===========================================================================
def expert_forward(k: Kernels, z: np.ndarray, w: ExpertWeights) -> np.ndarray:
    """E = w2 SiTU-GLU(w1 z, w3 z) for rows z [P, d_l] (Q.40): [P, d_l] in Q.40."""
    g = k.mx_matmul(z, Z_FRAC, w.w1, Z_FRAC, "g = w1 z")
    u = k.mx_matmul(z, Z_FRAC, w.w3, Z_FRAC, "u = w3 z")
    # a = beta tanh(g / beta) sigma(g) beta_lin tanh(u / beta_lin), Q.40 in, Q7.24 out
    a = k.situ.situ_glu_array(g.ravel(), u.ravel(), Z_FRAC, SITU_BETA, SITU_BETA_LIN)
    return k.mx_matmul(a.reshape(g.shape), A_FRAC, w.w2, Z_FRAC, "E = w2 a")


@dataclass(frozen=True)
class Routing:
    """The router's choice and the latent input, for T tokens."""

    idx: np.ndarray  # [T, k] experts by decreasing biased score (ties: the lower id)
    wts: np.ndarray  # [T, k] Q.56, rsf s_e / sum s over the chosen set
    z: np.ndarray  # [T, d_l] Q.40, W_down x


@dataclass(frozen=True)
class ShardMessage:
    """What one worker receives: the rows it needs and the slots routed to its experts."""

    lo: int  # its experts are [lo, hi)
    hi: int
    tokens: np.ndarray  # [R] the received tokens' positions in the batch (ascending)
    z: np.ndarray  # [R, d_l] Q.40, their latent rows
    pair_row: np.ndarray  # [P] each slot's row in z
    pair_expert: np.ndarray  # [P] its expert, lo <= e < hi
    pair_weight: np.ndarray  # [P] its combine weight, Q.56

    @property
    def nbytes(self) -> int:
        arrays = (self.tokens, self.z, self.pair_row, self.pair_expert, self.pair_weight)
        return sum(a.nbytes for a in arrays)


def shard_message(routing: Routing, lo: int, hi: int) -> ShardMessage:
    """The all-to-all's payload for the worker owning experts [lo, hi)."""
    mine = (routing.idx >= lo) & (routing.idx < hi)
    tok, slot = np.nonzero(mine)  # token order, then slot order
    tokens = np.unique(tok)
    return ShardMessage(
        lo=lo,
        hi=hi,
        tokens=tokens,
        z=np.ascontiguousarray(routing.z[tokens]),
        pair_row=np.searchsorted(tokens, tok),
        pair_expert=routing.idx[tok, slot],
        pair_weight=routing.wts[tok, slot],
    )


def shard_partial(k: Kernels, msg: ShardMessage, weights_for) -> np.ndarray:
    """[R, d_l] Q.40: per received token, the exact sum over its slots here of round(w_e E_e)."""
    d_l = msg.z.shape[1]
    partial = np.zeros((msg.tokens.size, d_l), dtype=np.int64)
    for e in np.unique(msg.pair_expert):
        pairs = np.nonzero(msg.pair_expert == e)[0]
        rows = msg.pair_row[pairs]
        big = np.abs(msg.z[rows]).max(initial=0)
        if big >= Z_MAX << Z_FRAC:
            raise OverflowError(f"z: |z| = {big / 2**Z_FRAC:.3g} >= Z_MAX = {Z_MAX} (expert {e})")
        E = expert_forward(k, msg.z[rows], weights_for(int(e)))
        # term_j = round(w_j E_j): Q.56 x Q.40 -> Q.40, one rounding each
        w = np.repeat(msg.pair_weight[pairs], d_l)
        terms = k.fx.mul_round_array(E.ravel(), w, WTS_FRAC).reshape(E.shape)
        # c_t += term_j: exact integer addition (np.add.at: a token may sit in several rows)
        np.add.at(partial, rows, terms)
    return partial


def combine(n_tokens: int, d_l: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """c [T, d_l] Q.40: the workers' (tokens, partial) added exactly, in any order."""
    c = np.zeros((n_tokens, d_l), dtype=np.int64)
    for tokens, partial in parts:
        c[tokens] += partial  # each token once per part: plain fancy-index addition
    return c


def expert_ranges(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous expert ranges [i n / W, (i+1) n / W) for W workers."""
    return [(i * n // workers, (i + 1) * n // workers) for i in range(workers)]


# == the worker side (runs inside a Dask worker process) ==========================================
_RESIDENT: dict[tuple, dict[int, ExpertWeights]] = {}  # (shape, seed, lo, hi) -> its experts


def load_shard(shape: Shape, seed: int, lo: int, hi: int) -> dict:
    """Generate and keep experts [lo, hi) in this process, as a worker loads its shard."""
    start = time.perf_counter()
    store = {e: expert_weights(shape, seed, e) for e in range(lo, hi)}
    _RESIDENT[(shape, seed, lo, hi)] = store
    return {
        "experts": hi - lo,
        "weight_bytes": sum(w.nbytes for w in store.values()),
        "load_s": time.perf_counter() - start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_shard(shape: Shape, seed: int, msg: ShardMessage) -> tuple[np.ndarray, float]:
    """(partial, seconds) for msg; resident experts if loaded, else generated on demand."""
    start = time.perf_counter()
    store = _RESIDENT.get((shape, seed, msg.lo, msg.hi), {})
    partial = shard_partial(
        kernels(), msg, lambda e: store[e] if e in store else expert_weights(shape, seed, e)
    )
    return partial, time.perf_counter() - start


def drop_shard(shape: Shape, seed: int, lo: int, hi: int) -> None:
    _RESIDENT.pop((shape, seed, lo, hi), None)


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pinned(client, address: str, fn, *args):
    """fn(*args) as a task on that worker only (its experts live there), never cached."""
    return client.submit(fn, *args, workers=[address], allow_other_workers=False, pure=False)


# == the layer ====================================================================================
@dataclass
class Result:
    y: np.ndarray  # [T, d] Q.24
    c: np.ndarray  # [T, d_l] Q.40, the combine
    routing: Routing
    parts: list[tuple[np.ndarray, np.ndarray]]  # (tokens, partial) per shard, as combined
    stats: dict = field(default_factory=dict)


class LatentMoE:
    """One layer: its shape, its seed, the client-side weights and kernels."""

    def __init__(self, shape: Shape, seed: int) -> None:
        if shape.rsf_q24 > RSF_MAX << X_FRAC or shape.top_k > moe_k.MAX_TOPK:
            raise ValueError(f"shape: rsf <= {RSF_MAX} and top_k <= {moe_k.MAX_TOPK} expected")
        if shape.latent % BLOCK or shape.expert_width % BLOCK:
            raise ValueError("shape: latent and expert_width must be multiples of 32 (MXFP4)")
        self.shape, self.seed = shape, seed
        self.k = kernels()
        self.dense = dense_weights(shape, seed)

    def route(self, x: np.ndarray) -> Routing:
        """The integer router (moe.router) and z = W_down x, rounded once into Q.40."""
        s = self.shape
        _, idx, wts = self.k.moe.router(x, self.dense.w_r, self.dense.b, s.top_k, s.rsf_q24)
        z = self.k.gemm_exact(x, self.dense.w_down, 2 * X_FRAC - Z_FRAC, "z = W_down x")
        return Routing(idx=idx, wts=wts, z=z)

    def shared_sum(self, x: np.ndarray) -> np.ndarray:
        """w2_s SiTU-GLU(w1_s x, w3_s x), the exact Q.48 sum (not rounded)."""
        g_s = self.k.gemm_exact(x, self.dense.w1_s, 0, "g_s = w1_s x")  # Q.48, exact
        u_s = self.k.gemm_exact(x, self.dense.w3_s, 0, "u_s = w3_s x")
        a_s = self.k.situ.situ_glu_array(g_s.ravel(), u_s.ravel(), S_FRAC, SITU_BETA,
                                         SITU_BETA_LIN).reshape(g_s.shape)  # fmt: skip
        return self.k.gemm_exact(a_s, self.dense.w2_s, 0, "w2_s a_s")

    def finish(self, c: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """y = round(W_up RMSNorm(c) w_n + shared) in Q.24."""
        r = self.k.moe.latent_rmsnorm(c, self.dense.w_n, EPS_Q56, Z_FRAC, R_FRAC)
        up = self.k.gemm_exact(r, self.dense.w_up, 0, "W_up r")  # Q.48, exact
        # y = W_up r + w2_s a_s: two exact sums below 2^62 each, one rounding
        total = (up + shared).ravel()
        return self.k.fx.rshift_round_array(total, S_FRAC - X_FRAC).reshape(up.shape)

    def forward_from_routing(self, x: np.ndarray, routing: Routing, weights_for=None) -> Result:
        """The whole layer in this process, on a given routing (all experts as one shard)."""
        s = self.shape
        get = weights_for or (lambda e: expert_weights(s, self.seed, e))
        msg = shard_message(routing, 0, s.n_experts)
        parts = [(msg.tokens, shard_partial(self.k, msg, get))]
        c = combine(x.shape[0], s.latent, parts)
        return Result(self.finish(c, self.shared_sum(x)), c, routing, parts)

    def forward(self, x: np.ndarray) -> Result:
        """The single-process forward."""
        start = time.perf_counter()
        out = self.forward_from_routing(x, self.route(x))
        out.stats["seconds"] = time.perf_counter() - start
        return out

    # -- expert-parallel --------------------------------------------------------------------------
    def workers(self, client) -> list[tuple[str, int, int]]:
        """(worker address, lo, hi): the sorted workers own contiguous expert ranges."""
        addrs = sorted(client.scheduler_info()["workers"])
        ranges = expert_ranges(self.shape.n_experts, len(addrs))
        return [(a, lo, hi) for a, (lo, hi) in zip(addrs, ranges, strict=True)]

    def load(self, client) -> dict[str, dict]:
        """Each worker generates and keeps its shard of experts; returns its statistics."""
        futures = {
            a: _pinned(client, a, load_shard, self.shape, self.seed, lo, hi)
            for a, lo, hi in self.workers(client)
        }
        return {a: f.result() for a, f in futures.items()}

    def forward_parallel(self, client, x: np.ndarray) -> Result:
        """The expert-parallel forward: route here, experts on their workers, combine here."""
        start = time.perf_counter()
        routing = self.route(x)
        futures, sent = [], {}
        for a, lo, hi in self.workers(client):
            msg = shard_message(routing, lo, hi)
            sent[a] = msg.nbytes
            fut = _pinned(client, a, run_shard, self.shape, self.seed, msg)
            futures.append((a, msg.tokens, fut))
        shared = self.shared_sum(x)  # the client's share, while the workers compute
        parts, stats = [], {"workers": {}}
        for a, tokens, fut in futures:
            partial, seconds = fut.result()
            parts.append((tokens, partial))
            stats["workers"][a] = {"sent_bytes": sent[a], "returned_bytes": partial.nbytes,
                                   "tokens": int(tokens.size), "compute_s": seconds}  # fmt: skip
        c = combine(x.shape[0], self.shape.latent, parts)
        y = self.finish(c, shared)
        stats["seconds"] = time.perf_counter() - start
        stats["tokens_per_s"] = x.shape[0] / stats["seconds"]
        return Result(y, c, routing, parts, stats)


# == the declared bounds ==========================================================================
# Each bound holds against the exact layer on the same integer inputs, the same routing and the
# same (exactly dequantised) weights, for the premises above, plus float64's own worst-case error
# in the reference (gamma_n = n 2^-53 for a length-n dot product; the reference forms its products
# of Q.24 integers exactly in int64 and rounds them once). Declared before any run; units: real,
# then LSB of Q.24 for both c and y. The chain for one token and one expert (l1 = l1_ratio K
# 2^X_top, the largest row L1 of w1, w3 (K = d_l) and of w2 (K = f)):
#   dz = 2^-41 (one rounding of an exact sum) + 16 2^-53 (float64's rounding of its exact z)
#   dg = l1_1 dz + 2^-41 (exact MX sum, one rounding) + gamma_{d_l} l1_1 Z_MAX (float64's sum)
#   da = 513/1024 2^-24 (situ_glu_array) + (24 + 4) dg (SiTU's slopes, moe.kernels)
#   dE = l1_2 da + 2^-41 + gamma_f l1_2 100 (|a| <= 100)
#   dc = rsf dE + k (E_MAX dw + 2^-41), dw = moe.kernels.weights_bound_q10(k) / 1024 2^-40
# RMSNorm, r_j = w_j c_j / rho: |dr_j| <= |w_j| dc (1/rho + |c_j| / rho^2) to first order, so
# |W_up dr|_o <= NORM_W_MAX dc RHO_MIN_INV (|U_o|_1 + |U_o|_2 sqrt(d_l)) <= ... 2 sqrt(3 d_l)
# (uniform rows: |U_o|_1 <= sqrt(3 d_l), |U_o|_2 <= sqrt(3)); r's own rounding 514/1024 LSB
# (moe's RMS bound) times |U_o|_1; the shared experts' a_s within 513/1024 LSB (exact inputs)
# times |w2_s row|_1 <= sqrt(3 f_s); y's rounding 1/2 LSB; float64's W_up r and w2_s a_s sums
# gamma_{d_l} sqrt(3 d_l) 3/2 sqrt(d_l) and gamma_{f_s} sqrt(3 f_s) 100; a 2 LSB margin for
# second-order terms.
MARGIN_LSB = 2
SITU_ERR_Q10 = situ_k.SITU_MAX_ERR_LSB_Q10  # 513: 1/2 + 2^-10 LSB of Q.24
RMS_ERR_Q10 = moe_k.RMS_MAX_ERR_LSB_Q10  # 514


def declared_bounds(shape: Shape, l1_ratio: float = W_L1_MAX) -> dict[str, float]:
    """{"c": ..., "y": ...}: the declared bounds in LSB of Q.24 (see the comment above), for
    expert rows whose L1 is at most l1_ratio K 2^X_top."""
    d_l, f, k = shape.latent, shape.expert_width, shape.top_k
    f_s = shape.n_shared * shape.shared_width
    rsf = shape.rsf_q24 / 2**X_FRAC
    u53 = 2.0**-53
    h40, lsb = 2.0**-41, 2.0**-24
    l1_1 = l1_ratio * d_l * 2.0 ** x_top(d_l)
    l1_2 = l1_ratio * f * 2.0 ** x_top(f)
    dz = h40 + Z_MAX * u53
    dg = l1_1 * dz + h40 + d_l * u53 * l1_1 * Z_MAX
    da = SITU_ERR_Q10 / 1024 * lsb + (moe_k.SITU_DG_MAX + moe_k.SITU_DU_MAX) * dg
    de = l1_2 * da + h40 + f * u53 * l1_2 * 100
    dw = moe_k.weights_bound_q10(k) / 1024 * 2.0**-40
    dc = rsf * de + k * (E_MAX * dw + h40)
    prop = NORM_W_MAX * dc * RHO_MIN_INV * 2 * sqrt(3 * d_l)
    own = (RMS_ERR_Q10 / 1024 * sqrt(3 * d_l) + SITU_ERR_Q10 / 1024 * sqrt(3 * f_s) + 0.5) * lsb
    f64 = d_l * u53 * sqrt(3 * d_l) * NORM_W_MAX * sqrt(d_l) + f_s * u53 * sqrt(3 * f_s) * 100
    return {"c": dc / lsb + MARGIN_LSB, "y": (prop + own + f64) / lsb + MARGIN_LSB}
