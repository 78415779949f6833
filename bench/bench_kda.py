"""KDA throughput, measured in one run (issue 4's bench). Prints ratios; asserts nothing.

    python bench/bench_kda.py

At T = 1024 tokens, H = 4 heads, d_k = d_v = 64 (issue 4's figures are at this shape):
- integer recurrent KDA (compiled) against the same recurrence in float64 numpy, a loop over t
  vectorised over heads (the issue's "float64 numpy loop");
- compiled against interpreted (the interpreted run is far slower, so it does 8 tokens);
- the chunked form (C = 16, 64) against the recurrent form;
- achieved integer multiply-adds per second against this CPU's int32 multiply-add rate, measured
  here by bench/peak_kernel.py (a vectorised in-cache int32 dot product, same compiler flags).
  The recurrence does 4 d_k d_v multiply-adds per head and token (decay, S^T k, the k w^T update,
  S^T q); that count, not the instructions executed, is the "achieved" figure.
Threads: one OpenMP thread, then two (heads run in parallel; this machine has 2 cores).

Then the 2^20-token runs of the longctx_1m gate, at its shapes, timed once each: the KDA layer
(H = 2, d = 32, sixteen calls of 2^16 tokens with the state carried) and one MLA decode query over
a 2^20-row latent cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from k3gates.infra import compile as kcompile  # noqa: E402

T, H, D = 1024, 4, 64
MACS_PER_TOKEN = 4 * H * D * D


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def inputs(t_len: int) -> tuple:
    rng = np.random.default_rng(0)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((t_len, H, D))) * D**-0.5
    k = unit(rng.standard_normal((t_len, H, D)))
    v = rng.standard_normal((t_len, H, D))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((t_len, H, D))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((t_len, H))))
    return q, k, v, g, beta


def quantised(kern, q, k, v, g, beta) -> tuple:
    def fx(a, frac, dtype=np.int32):
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(dtype))

    alpha = kern.kda_decay(fx(g, 24, np.int64))
    s0 = np.zeros((H, D, D), dtype=np.int32)
    return fx(q, 24), fx(k * (1 - 2.0**-23), 24), fx(v, 20), alpha, fx(beta, 30), s0


def numpy_loop(q, k, v, g, beta) -> np.ndarray:
    """S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T, o_t = S_t^T q_t in float64."""
    alpha = np.exp(g)
    S = np.zeros((H, D, D))
    o = np.zeros_like(v)
    for t in range(q.shape[0]):
        S = alpha[t][:, :, None] * S
        w = beta[t][:, None] * (v[t] - np.einsum("hi,hij->hj", k[t], S))
        S += k[t][:, :, None] * w[:, None, :]
        o[t] = np.einsum("hi,hij->hj", q[t], S)
    return o


def peak_macs_per_s() -> float:
    kern = kcompile.load("peak_kernel")
    a = np.arange(1024, dtype=np.int32) * 7 + 1
    b = np.arange(1024, dtype=np.int32) * 3 - 5
    reps = 200_000
    kern.int32_mac(a, b, 10)
    return reps * a.size / best_of(lambda: kern.int32_mac(a, b, reps), 3)


def run(threads: int) -> None:
    kern = kcompile.load("k3gates.kda.kernels")
    q, k, v, g, beta = inputs(T)
    args = quantised(kern, q, k, v, g, beta)
    kern.kda_recurrent(*args)
    t_rec = best_of(lambda: kern.kda_recurrent(*args), 5)
    t_c16 = best_of(lambda: kern.kda_chunked(*args, 16), 3)
    t_c64 = best_of(lambda: kern.kda_chunked(*args, 64), 3)
    t_np = best_of(lambda: numpy_loop(q, k, v, g, beta), 3)
    rec = T / t_rec
    print(f"threads={threads}  T={T}, H={H}, d_k=d_v={D}")
    row = "  {:<30}{:>10,.0f} tokens/s -> {}"
    print(row.format("integer recurrent (compiled)", rec, "1.00x"))
    print(row.format("float64 numpy loop", T / t_np, f"integer is {t_np / t_rec:.2f}x faster"))
    print(row.format("integer chunked C=16", T / t_c16, f"{t_rec / t_c16:.2f}x the recurrent"))
    print(row.format("integer chunked C=64", T / t_c64, f"{t_rec / t_c64:.2f}x the recurrent"))
    peak = peak_macs_per_s()
    achieved = rec * MACS_PER_TOKEN
    print(
        f"  achieved {achieved / 1e9:.2f} G int multiply-adds/s; measured int32 peak "
        f"{peak / 1e9:.2f} G/s per core -> {achieved / peak:.0%} of one core's peak, "
        f"{achieved / (peak * threads):.0%} of {threads} cores'; roofline "
        f"{peak * threads / MACS_PER_TOKEN:,.0f} tokens/s"
    )


def interpreted_ratio() -> None:
    kern = kcompile.load("k3gates.kda.kernels")
    py = kcompile.interpreted("k3gates.kda.kernels")
    args = quantised(kern, *inputs(8))
    t_c = best_of(lambda: kern.kda_recurrent(*args), 5)
    t_i = best_of(lambda: py.kda_recurrent(*args), 1)
    print(f"compiled vs interpreted (8 tokens): {t_i / t_c:,.0f}x")


def long_runs() -> None:
    """The longctx_1m gate's 2^20-token workloads, with the gate's own input generators."""
    from k3gates.k3block import gate_longctx as lg

    kda = kcompile.load("k3gates.kda.kernels")
    mla = kcompile.load("k3gates.mla.kernels")
    # The KDA layer: sixteen calls of 2^16 tokens, the integer state carried, as the gate's
    # "2^16" split does; drawing the inputs is timed apart from the kernels.
    state = np.zeros((lg.KDA_H, lg.KDA_D, lg.KDA_D), dtype=np.int32)
    t_draw = t_kda = 0.0
    sat = 0
    for i in range(lg.LONG // lg.PIECE):
        t0 = time.perf_counter()
        p = lg._kda_piece(i)
        t1 = time.perf_counter()
        alpha = kda.kda_decay(p["g"])
        _, state, stats = kda.kda_recurrent(p["qs"], p["k"], p["v"], alpha, p["beta"], state)
        t_kda += time.perf_counter() - t1
        t_draw += t1 - t0
        sat += int(stats[0])
    m = lg._mla_cache(np.random.default_rng(1), lg.LONG, 1)
    args = (m["q"], 0, m["c_kv"], m["k_r"], lg.LONG, m["w_uk"], m["w_uv"])
    mla.mla_decode_attend(*args)
    t_mla = best_of(lambda: mla.mla_decode_attend(*args), 3)
    print("2^20 tokens, the longctx_1m gate's shapes (both cores):")
    print(
        f"  KDA layer H={lg.KDA_H}, d={lg.KDA_D}: {lg.LONG / t_kda:,.0f} tokens/s "
        f"({t_kda:.1f} s of kernels for 2^20, plus {t_draw:.1f} s drawing inputs; "
        f"saturations {sat})"
    )
    print(
        f"  MLA decode over a 2^20-row cache (H={lg.MLA_H}, kv_lora={lg.MLA_KV}): "
        f"{lg.LONG / t_mla:,.0f} cached rows/s ({t_mla:.2f} s per query)"
    )


def main() -> None:
    if os.environ.get("OMP_NUM_THREADS"):
        run(int(os.environ["OMP_NUM_THREADS"]))
        return
    interpreted_ratio()
    for threads in (1, 2):  # OpenMP reads the count once per process: one child per count
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, __file__], env=env, check=True)
    long_runs()


if __name__ == "__main__":
    main()
