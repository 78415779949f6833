"""Gated MLA throughput, measured in one run: integer decode vs float64 numpy, compiled vs
interpreted, naive vs absorbed.

    python bench/bench_mla.py            # one OpenMP thread (a like-for-like core count)
    OMP_NUM_THREADS=2 python bench/bench_mla.py

1. Per-token decode over a latent cache (absorbed path): the compiled integer kernel
   mla_decode_attend against the same math in float64 numpy (W_UK^T q, scores against c_KV and
   k_R, softmax, W_UV sum p c), at H 8, kv_lora 128, rope 32, nope 64, d_v 64, for caches of
   1024 and 8192 tokens. The integer step is exact and bit-identical to the full forward; the
   float one is not.
2. One head over 2^18 latents at K3's widths (kv_lora 512, rope 64, nope 128, d_v 128): the
   integer step's time, to extrapolate the 2^20-token case (linear in the cache length).
3. Compiled vs interpreted (CPython) on a small decode step and a small full forward.
4. The full causal forward, naive vs absorbed, compiled, at T 256.
Best of five runs each. Prints ratios; asserts nothing.
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

from k3gates.infra import compile as kcompile

DIMS = {"H": 8, "kv_lora": 128, "rope": 32, "nope": 64, "d_v": 64}


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def problem(rng: np.random.Generator, n: int, d: dict, t_len: int = 1) -> dict:
    def q(a: np.ndarray, frac: int) -> np.ndarray:
        return np.ascontiguousarray(np.round(a * 2.0**frac).astype(np.int32))

    h, kv, rope, nope, d_v = d["H"], d["kv_lora"], d["rope"], d["nope"], d["d_v"]
    f = {
        "q": rng.standard_normal((t_len, h, nope + rope)) * 0.3,
        "c": rng.standard_normal((n, kv)),
        "k_r": rng.standard_normal((n, rope)),
        "w_uk": rng.standard_normal((h, nope, kv)) / np.sqrt(kv),
        "w_uv": rng.standard_normal((h, d_v, kv)) / np.sqrt(kv),
    }
    ints = {
        "q": q(f["q"], 20),
        "c": q(f["c"], 16),
        "k_r": q(f["k_r"], 16),
        "w_uk": q(f["w_uk"], 16),
        "w_uv": q(f["w_uv"], 16),
    }
    return {"f": f, "i": ints, "n": n}


def float_decode(f: dict) -> np.ndarray:
    nope = f["w_uk"].shape[1]
    qa = np.einsum("hij,hi->hj", f["w_uk"], f["q"][0, :, :nope])  # [H, kv_lora]
    s = qa @ f["c"].T + f["q"][0, :, nope:] @ f["k_r"].T  # [H, n]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hij,hj->hi", f["w_uv"], p @ f["c"])


def int_decode(k, i: dict, n: int) -> tuple:
    return k.mla_decode_attend(i["q"], 0, i["c"], i["k_r"], n, i["w_uk"], i["w_uv"])


def main() -> None:
    k = kcompile.load("k3gates.mla.kernels")
    ki = kcompile.interpreted("k3gates.mla.kernels")
    rng = np.random.default_rng(0)
    print(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; numpy float64 as it comes")
    print("\n1. per-token decode over a latent cache, H=8, kv_lora=128, rope=32, nope=64, d_v=64")
    print(f"{'cache':>8}{'int (ms)':>11}{'f64 (ms)':>11}{'int/float':>11}{'int tok/s':>11}")
    for n in (1024, 8192):
        pr = problem(rng, n, DIMS)
        int_decode(k, pr["i"], n)  # warm up
        ti = best_of(lambda pr=pr, n=n: int_decode(k, pr["i"], n))
        tf = best_of(lambda pr=pr: float_decode(pr["f"]))
        print(f"{n:>8}{ti * 1e3:>11.2f}{tf * 1e3:>11.2f}{ti / tf:>10.2f}x{1 / ti:>11.0f}")

    k3 = {"H": 1, "kv_lora": 512, "rope": 64, "nope": 128, "d_v": 128}
    n = 1 << 18
    pr = problem(rng, n, k3)
    ti = best_of(lambda: int_decode(k, pr["i"], n), repeats=3)
    print(f"\n2. one head over 2^18 latents at K3's widths: {ti * 1e3:.0f} ms "
          f"(2^20 tokens x 96 heads, linearly: {ti * 4 * 96:.1f} s per token per layer on "
          f"{os.environ['OMP_NUM_THREADS']} thread(s))")  # fmt: skip

    print("\n3. compiled vs interpreted (CPython), same inputs, bit-identical outputs")
    small = problem(rng, 128, {"H": 2, "kv_lora": 32, "rope": 8, "nope": 16, "d_v": 16}, 32)
    si = small["i"]
    cases = [
        ("decode step, cache 128", lambda m: int_decode(m, si, 128)),
        ("absorbed forward, T 32", lambda m: m.mla_attend_absorbed(
            si["q"], si["c"][:32], si["k_r"][:32], si["w_uk"], si["w_uv"])),
        ("naive forward, T 32", lambda m: m.mla_attend_naive(
            si["q"], si["c"][:32], si["k_r"][:32], si["w_uk"], si["w_uv"])),
    ]  # fmt: skip
    print(f"{'kernel':<26}{'compiled (ms)':>15}{'CPython (ms)':>14}{'speed-up':>10}")
    for name, fn in cases:
        fn(k)
        tc, tp = best_of(lambda fn=fn: fn(k)), best_of(lambda fn=fn: fn(ki), repeats=1)
        print(f"{name:<26}{tc * 1e3:>15.3f}{tp * 1e3:>14.1f}{tp / tc:>9.0f}x")

    print("\n4. full causal attention, T=256, H=8 (compiled): naive vs absorbed")
    full = problem(rng, 256, DIMS, 256)
    fi = full["i"]
    args = (fi["q"], fi["c"], fi["k_r"], fi["w_uk"], fi["w_uv"])
    tn = best_of(lambda: k.mla_attend_naive(*args), repeats=3)
    ta = best_of(lambda: k.mla_attend_absorbed(*args), repeats=3)
    same = np.array_equal(k.mla_attend_naive(*args)[0], k.mla_attend_absorbed(*args)[0])
    print(f"naive {tn * 1e3:.1f} ms, absorbed {ta * 1e3:.1f} ms, absorbed/naive {ta / tn:.2f}x, "
          f"outputs bit-identical: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
