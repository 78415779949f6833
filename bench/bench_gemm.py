"""The shared integer GEMM against numpy float32 `@` (OpenBLAS sgemm), measured in one run.

    python bench/bench_gemm.py               # both sides on every core (2 here)
    python bench/bench_gemm.py --threads 1   # both sides on one core

For each square size (256, 512, 1024): `gemm_i16` (int16 x int16 -> int32, C = A B^T), `gemm_i64`
(int64 x int64 -> int64, with its rounding shift) and numpy float32 `A @ B.T`, on the same
values, best of several runs each, interleaved so that a burst of load on a shared machine hits
all sides alike. The ratio is integer multiply-adds/s over sgemm's (above 1: the integer kernel
is faster). Issue 14 aims at >= 0.5x sgemm at 512^2 for gemm_i16.

Threads: OMP_NUM_THREADS (Pythran's OpenMP) and OPENBLAS_NUM_THREADS are set to the same count
before numpy loads, and OMP_WAIT_POLICY=PASSIVE, so that the OpenMP threads of one side do not
spin on the cores the other side's threads need. The CPU model and the load average are printed:
on a machine shared with other jobs the figures are noisy. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _threads() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both sides")
    p.add_argument("--repeats", type=int, default=7, help="best of this many runs")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before numpy and the kernels load
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return args.threads, args.repeats


THREADS, REPEATS = _threads()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402  (after the thread counts are set)

from k3gates.infra import compile as kcompile  # noqa: E402

SIZES = (256, 512, 1024)
X_FRAC = 14  # operands in Q1.14 with rows of norm about 1, as NS5's iterates (||X||_2 <= 5/4):
# ||a||^2 ||b||^2 is about 2^56 < 2^62, so every micro-tile takes gemm_i16's int32 path


def operand(rng: np.random.Generator, n: int) -> np.ndarray:
    """An n x n int16 matrix in Q1.14 whose rows have norm about 1."""
    x = rng.standard_normal((n, n)) * (2.0**X_FRAC / np.sqrt(n))
    return np.clip(np.round(x), -32767, 32767).astype(np.int16)


def interleaved_best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best time of each function over `repeats` rounds, one call of each per round."""
    for fn in fns.values():
        fn()  # warm up: the OpenMP pool, BLAS threads, page faults
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    k = kcompile.load("k3gates.gemm.kernels")
    load = os.getloadavg()
    print(f"CPU: {kcompile.cpu_model()} ({os.cpu_count()} cores; "
          f"{kcompile.cpu_vector_extensions()})")  # fmt: skip
    print(
        f"threads: OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = {THREADS}, OMP_WAIT_POLICY=PASSIVE; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; best of {REPEATS}"
    )
    rng = np.random.default_rng(0)
    head = f"{'M=N=K':<7}{'i16 GMAC/s':>11}{'i64 GMAC/s':>11}{'sgemm GMAC/s':>13}"
    print(head + f"{'i16/sgemm':>11}{'i64/sgemm':>11}  exact")
    for n in SIZES:
        a, b = operand(rng, n), operand(rng, n)
        a64, b64 = a.astype(np.int64), b.astype(np.int64)
        af, bf = a.astype(np.float32), b.astype(np.float32)
        c16, sat = k.gemm_i16(a, b)
        c64, outside = k.gemm_i64(a64, b64, 0)
        want = a64 @ b64.T  # exact: |sum| <= n 2^30 < 2^63
        exact = sat == 0 and outside == 0 and np.array_equal(c16, want)
        exact = exact and np.array_equal(c64, want)
        t = interleaved_best(
            {
                "i16": lambda a=a, b=b: k.gemm_i16(a, b),
                "i64": lambda a=a64, b=b64: k.gemm_i64(a, b, 0),
                "sgemm": lambda a=af, b=bf: a @ b.T,
            },
            REPEATS if n < 1024 else max(2, REPEATS // 2),
        )
        rate = {name: n**3 / s / 1e9 for name, s in t.items()}
        print(
            f"{n:<7}{rate['i16']:>11.1f}{rate['i64']:>11.1f}{rate['sgemm']:>13.1f}"
            f"{rate['i16'] / rate['sgemm']:>10.2f}x{rate['i64'] / rate['sgemm']:>10.2f}x  "
            + ("yes" if exact else "NO")
        )
    n = 512  # full-range int16: every micro-tile fails the guard and takes the int64 path
    a = rng.integers(-(2**15), 2**15, (n, n)).astype(np.int16)
    b = rng.integers(-(2**15), 2**15, (n, n)).astype(np.int16)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    t = interleaved_best(
        {"i16": lambda: k.gemm_i16(a, b), "sgemm": lambda: af @ bf.T}, max(2, REPEATS // 2)
    )
    print(
        f"full-range int16 at {n}^2 (the guarded int64 path, clamping): "
        f"{n**3 / t['i16'] / 1e9:.1f} GMAC/s, {t['sgemm'] / t['i16']:.2f}x sgemm"
    )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")


if __name__ == "__main__":
    main()
