"""Integer NS5 against float64 numpy NS5, measured in one run; and compiled against interpreted.

    python bench/bench_muon.py                     # OpenMP uses every core (2 here)
    OMP_NUM_THREADS=1 python bench/bench_muon.py

For each size: the compiled integer kernel `ns5` (int16 Q1.14 iterates, int16 x int16 -> int32
matmuls; the input quantised once, outside the timing) and the float64 numpy NS5 of the same
equations (BLAS, the threads numpy is built with), best of seven runs each. The speed ratio is
float time / integer time: above 1 the integer kernel is faster. Per iteration the integer kernel
does 5 int16 matmuls of m^2 n or m^3 multiply-adds (A = X X^T, then A_hi A_hi and A_lo A_hi, then
B_hi X and B_lo X: the lo halves keep its error bound at 0.6 to 3 LSB) where float64 does
2.5 (syrk, two gemms). Also the per-head Muon step, and compiled against interpreted at 32 x 32
(CPython runs the same kernel source). Prints; asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from k3gates.infra import compile as kcompile
from k3gates.muon import reference as ref


def best_of(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm up: the OpenMP pool, page faults, BLAS threads
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def q24(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.round(a * 2.0**24).astype(np.int64))


def main() -> None:
    k = kcompile.load("k3gates.muon.kernels")
    rng = np.random.default_rng(0)
    threads = os.environ.get("OMP_NUM_THREADS", "all cores")
    print(f"NS5, best of 7; integer kernel OMP_NUM_THREADS={threads}; numpy float64 with BLAS")
    print(f"{'shape':<12}{'int (ms)':>10}{'f64 (ms)':>10}{'f64/int':>9}{'GMAC/s int':>12}")
    for n in (128, 512):
        g = rng.standard_normal((n, n))
        gq = q24(g)
        ti = best_of(lambda gq=gq: k.ns5(gq, 2))
        tf = best_of(lambda g=g: ref.ns5(g))
        macs = 5 * 5 * n**3  # five iterations of five int16 matmuls
        rate = macs / ti / 1e9
        print(f"{n}x{n:<8}{ti * 1e3:>10.1f}{tf * 1e3:>10.1f}{tf / ti:>8.2f}x{rate:>12.1f}")

    heads, dh, d = 8, 64, 512
    p = {name: q24(rng.standard_normal((heads * dh, d)) * 0.02) for name in "WMG"}
    ti = best_of(lambda: k.muon_step(p["W"], p["M"], p["G"], 2**29, 2**25, 0, 1, heads, 0, 24, 2))
    w, m, g = (p[name] / 2.0**24 for name in "WMG")
    tf = best_of(lambda: ref.muon_step(w, m, g, mu=0.5, lr=2**-5, wd=0.0, heads=heads))
    print(
        f"per-head Muon step, W_Q {heads * dh}x{d} in {heads} heads of {dh}x{d}: "
        f"int {ti * 1e3:.1f} ms, f64 {tf * 1e3:.1f} ms, f64/int {tf / ti:.2f}x"
    )

    interp = kcompile.interpreted("k3gates.muon.kernels")
    small = q24(rng.standard_normal((32, 32)))
    tc = best_of(lambda: k.ns5(small, 2))
    ti = best_of(lambda: interp.ns5(small, 2), repeats=1)
    print(
        f"ns5 32x32: compiled {tc * 1e3:.3f} ms, interpreted {ti * 1e3:.0f} ms, "
        f"compiled is {ti / tc:.0f}x faster"
    )


if __name__ == "__main__":
    main()
