"""fx throughput against numpy float64 on the same 2^22 inputs, measured in one run.

    python bench/bench_fx.py            # one OpenMP thread (a like-for-like core count)
    OMP_NUM_THREADS=2 python bench/bench_fx.py

For each function: the compiled integer kernel (on the inputs quantised once, outside the timing)
and the numpy float64 expression of the same math, best of five runs each. The ratio is
integer time / float time: above 1 the integer kernel is slower. The integer kernels are
correctly rounded to 513/1024 LSB of their Q0.31 (or stated) output format; the float64
expressions carry float64's error. Prints ratios; asserts nothing.
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

from k3gates.fx import quantize
from k3gates.infra import compile as kcompile

N = 1 << 22
ROWS, COLS = 4096, 1024  # 2^22 values for the row functions


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cases(k, rng: np.random.Generator) -> list[tuple[str, Callable, Callable]]:
    x = rng.uniform(-16, 16, N)
    xn = -np.abs(x)
    pos = np.exp2(rng.uniform(-20, 20, N))
    turns = rng.random(N)
    s = rng.normal(0, 3, (ROWS, COLS))
    w = rng.normal(1, 0.2, COLS)
    qx, qn, qs = quantize(x, 32), quantize(xn, 32), np.ascontiguousarray(quantize(s, 24))
    m, e = np.frexp(pos)
    qpos, fin = np.ldexp(m, 53).astype(np.int64), (53 - e).astype(np.int64)
    fout = (38 + (e + 1) // 2).astype(np.int64)
    phase = (turns * 2**40).astype(np.int64)
    qw, eps = quantize(w, 28), round(1e-6 * 2**48)
    sig = lambda v: 1 / (1 + np.exp(-v))
    return [
        ("exp (x <= 0)", lambda: k.exp_q31_array(qn, 32), lambda: np.exp(xn)),
        ("sigmoid", lambda: k.sigmoid_q31_array(qx, 32), lambda: sig(x)),
        ("tanh", lambda: k.tanh_q31_array(qx, 32), lambda: np.tanh(x)),
        ("silu", lambda: k.silu_array(qx, 32), lambda: x * sig(x)),
        ("rsqrt", lambda: k.rsqrt_array(qpos, fin, fout), lambda: 1 / np.sqrt(pos)),
        ("sin+cos (turns)", lambda: k.sincos_q31_array(phase, 40),
         lambda: (np.sin(2 * np.pi * turns), np.cos(2 * np.pi * turns))),
        ("softmax rows of 1024", lambda: k.softmax_q31(qs, 24), lambda: _softmax(s)),
        ("rmsnorm rows of 1024", lambda: k.rmsnorm(qs, qw, eps, 24, 28, 30, 0),
         lambda: w * s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6)),
        ("l2norm rows of 1024", lambda: k.l2norm(qs, eps, 24, 31, 0),
         lambda: s / np.sqrt(np.sum(s * s, axis=-1, keepdims=True) + 1e-6)),
    ]  # fmt: skip


def _softmax(s: np.ndarray) -> np.ndarray:
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def main() -> None:
    k = kcompile.load("k3gates.fx.kernels")
    situ = kcompile.load("k3gates.situ.kernels")
    rng = np.random.default_rng(0)
    rows = cases(k, rng)
    g, u = rng.uniform(-16, 16, N), rng.uniform(-100, 100, N)
    qg, qu = quantize(g, 24), quantize(u, 24)
    rows.append(
        (
            "SiTU-GLU forward",
            lambda: situ.situ_glu_array(qg, qu, 24, 4, 25),
            lambda: 4 * np.tanh(g / 4) * (1 / (1 + np.exp(-g))) * 25 * np.tanh(u / 25),
        )
    )
    threads = os.environ["OMP_NUM_THREADS"]
    print(f"2^22 inputs per function, best of 5, OMP_NUM_THREADS={threads}; numpy is one thread")
    print(
        f"{'function':<24}{'fx int (ms)':>12}{'numpy f64 (ms)':>16}{'int/float':>11}{'M/s int':>10}"
    )
    for name, integer, floating in rows:
        integer(), floating()  # warm up (OpenMP pool, page faults)
        ti, tf = best_of(integer), best_of(floating)
        print(f"{name:<24}{ti * 1e3:>12.1f}{tf * 1e3:>16.1f}{ti / tf:>10.2f}x{N / ti / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
