"""Block AttnRes throughput: the compiled integer kernels against numpy float64 on the same inputs,
and compiled against interpreted, measured in one run.

    python bench/bench_attnres.py            # one OpenMP thread (a like-for-like core count)
    OMP_NUM_THREADS=2 python bench/bench_attnres.py

Shapes: K3-like depth (9 sources: 8 stored blocks and the prefix) over 4096 tokens of d = 256.
The integer forward is correctly rounded to 513/1024 LSB (h in Q.24, alpha in Q0.31); the float64
expressions carry float64's error. Ratios are integer time / float time (above 1: the integers
are slower). Best of five; the interpreted runs use a slice of the tokens and are scaled up.
Prints ratios; asserts nothing.
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

from k3gates.attnres import reference as ref
from k3gates.fx import quantize
from k3gates.infra import compile as kcompile

N_SRC, T, D = 9, 4096, 256
T_INTERP = 16  # tokens for the interpreted runs
F = 24
EPS = 1e-6


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    k = kcompile.load("k3gates.attnres.kernels")
    ki = kcompile.interpreted("k3gates.attnres.kernels")
    rng = np.random.default_rng(0)
    v = rng.standard_normal((N_SRC, T, D)) * 2.0 ** rng.uniform(-2, 3, (N_SRC, T, 1))
    w = rng.standard_normal(D) * 8 / (np.sqrt(D) * 16)  # sqrt(d) ||w|| about 8
    g = rng.standard_normal((T, D))
    qv, qw, qg = np.ascontiguousarray(quantize(v, F)), quantize(w, F), quantize(g, F)
    eps = round(EPS * 2 ** (2 * F))
    vf, wf, gf = qv / 2.0**F, qw / 2.0**F, qg / 2.0**F
    small = np.ascontiguousarray(qv[:, :T_INTERP])
    rows = [
        ("forward (h, alpha)", lambda: k.attnres_forward(qv, qw, eps, F, F),
         lambda: ref.attnres(vf, wf, EPS),
         lambda: ki.attnres_forward(small, qw, eps, F, F)),
        ("RMS keys", lambda: k.attnres_keys(qv, eps, F, 30), lambda: ref.keys(vf, EPS),
         lambda: ki.attnres_keys(small, eps, F, 30)),
        ("dL/dw", lambda: k.attnres_grad_w(qv, qw, qg, eps, F, F, F),
         lambda: ref.grad_w(vf, wf, gf, EPS),
         lambda: ki.attnres_grad_w(small, qw, np.ascontiguousarray(qg[:T_INTERP]), eps, F, F, F)),
    ]  # fmt: skip
    threads = os.environ["OMP_NUM_THREADS"]
    print(
        f"{N_SRC} sources x {T} tokens x d = {D}, best of 5, OMP_NUM_THREADS={threads}; "
        "numpy is one thread"
    )
    print(
        f"{'kernel':<20}{'int (ms)':>10}{'numpy f64 (ms)':>16}{'int/float':>11}"
        f"{'interp (ms, scaled)':>21}{'interp/int':>12}"
    )
    for name, integer, floating, interp in rows:
        integer(), floating()  # warm up (OpenMP pool, page faults)
        ti, tf = best_of(integer), best_of(floating)
        tp = best_of(interp, repeats=1) * T / T_INTERP
        print(f"{name:<20}{ti * 1e3:>10.1f}{tf * 1e3:>16.1f}{ti / tf:>10.2f}x{tp * 1e3:>21.0f}"
              f"{tp / ti:>11.0f}x")  # fmt: skip


if __name__ == "__main__":
    main()
