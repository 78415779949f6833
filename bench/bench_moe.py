"""LatentMoE throughput, measured in one run: the integer layer (router + latent experts + shared
expert) against the float64 numpy reference, and the compiled kernels against the same source
under CPython.

    python bench/bench_moe.py            # one OpenMP thread (a like-for-like core count)
    OMP_NUM_THREADS=2 python bench/bench_moe.py

Shape: the gates' test scale (64 experts, top-8, hidden 64, latent 32, expert width 16, shared
width 32). Tokens per second, best of five runs; the interpreted runs use fewer tokens (they are
per-token loops in CPython) and are scaled to tokens/s. The float64 reference is whole-array
numpy (BLAS matmuls, a Python loop over experts). Prints ratios; asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the extension loads OpenMP
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from k3gates.fx import quantize, value
from k3gates.infra import compile as kcompile
from k3gates.moe import gate as G
from k3gates.moe import reference as ref

TOKENS = 4096
INTERPRETED_TOKENS = 8


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    k = kcompile.load("k3gates.moe.kernels")
    interp = kcompile.interpreted("k3gates.moe.kernels")
    s = G.TEST
    p = G.params(G.SEED, s)
    qp = G.ints(p)
    rsf, rsf_f, eps, eps_f = G.scalars()
    x = G.tokens(G.SEED + 20, TOKENS, s.d)
    qx = G.q24(x)
    b = quantize(np.random.default_rng(0).normal(0, 0.05, s.n), 40)
    bf = value(b, 40)
    dc = np.ascontiguousarray(
        quantize(np.random.default_rng(1).uniform(-1, 1, (TOKENS, s.d_l)), 48)
    )

    def integer(kern, n_tok):
        xx = np.ascontiguousarray(qx[:n_tok])
        _, idx, wts = kern.router(xx, qp["w_r"], b, s.k, rsf)
        return G.run_layer(kern, xx, qp, idx, wts, eps)

    def floating():
        idx = ref.select(ref.scores(x, p["w_r"]) + bf, s.k)
        return ref.layer(x, idx, p, rsf_f, eps_f)

    _, idx, wts = k.router(qx, qp["w_r"], b, s.k, rsf)
    _, z, _, _ = G.run_layer(k, qx, qp, idx, wts, eps)
    zf, wf, dcf = value(z, 48), value(wts, 56), value(dc, 48)
    n_small = INTERPRETED_TOKENS
    rows = [
        (
            "layer (router + experts)",
            lambda: integer(k, TOKENS),
            floating,
            lambda: integer(interp, n_small),
        ),
        (
            "backward, routing fixed",
            lambda: k.expert_backward(z, idx, wts, dc, qp["w1"], qp["w3"], qp["w2"]),
            lambda: ref.expert_backward(zf, idx, wf, dcf, p["w1"], p["w3"], p["w2"]),
            lambda: interp.expert_backward(
                z[:n_small].copy(), idx[:n_small].copy(), wts[:n_small].copy(),
                dc[:n_small].copy(), qp["w1"], qp["w3"], qp["w2"],
            ),
        ),
    ]  # fmt: skip
    threads = os.environ["OMP_NUM_THREADS"]
    print(
        f"{s.n} experts, top-{s.k}, hidden {s.d}, latent {s.d_l}, expert width {s.f}; "
        f"{TOKENS} tokens (interpreted: {n_small}); best of 5; OMP_NUM_THREADS={threads}"
    )
    print(
        f"{'':<26}{'int tok/s':>12}{'f64 tok/s':>12}{'int/f64':>9}{'interp tok/s':>14}"
        f"{'compiled/interp':>17}"
    )
    for name, integer_fn, float_fn, interp_fn in rows:
        integer_fn(), float_fn()  # warm up (OpenMP pool, page faults)
        ti, tf = best_of(integer_fn), best_of(float_fn)
        tp = best_of(interp_fn, repeats=1)
        ri, rf, rp = TOKENS / ti, TOKENS / tf, n_small / tp
        print(f"{name:<26}{ri:>12.0f}{rf:>12.0f}{ri / rf:>8.2f}x{rp:>14.1f}{ri / rp:>16.0f}x")
    sb, _, _ = k.router(qx[:1024].copy(), qp["w_r"], b, s.k, rsf)
    sf = ref.scores(x[:1024], p["w_r"])
    tq, tqf = best_of(lambda: k.qb_update(sb, b, s.k)), best_of(lambda: ref.qb_update(sf, bf, s.k))
    tqi = best_of(lambda: interp.qb_update(sb, b, s.k), repeats=1)
    print(
        f"QB update, 1024 tokens: integer {tq * 1e3:.2f} ms, float64 {tqf * 1e3:.2f} ms "
        f"(int/f64 time {tq / tqf:.2f}x), interpreted {tqi * 1e3:.1f} ms "
        f"(compiled {tqi / tq:.0f}x faster)"
    )


if __name__ == "__main__":
    main()
