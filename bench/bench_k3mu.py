"""K3-μ training throughput: the integer model against its float64 twin, measured in one run.

    python bench/bench_k3mu.py               # both on every core (2 here)
    python bench/bench_k3mu.py --threads 1   # both on one core

Both sides train the same model (model.py) from the same initial weights on the same batches
with the same optimisers: the integer side on the compiled kernels, the twin on the float64
references (NumPy, OpenBLAS). Steps alternate between the two in blocks, so a burst of load on a
shared machine hits both alike; each side's figure is its best block. The ratio is integer
characters/s over float64's (above 1: the integer model trains faster). Issue 14 aims at >= 1x.

OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are set to the same count before numpy loads, and
OMP_WAIT_POLICY=PASSIVE. The CPU model and the load average are printed. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both sides")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per side")
    p.add_argument("--steps", type=int, default=8, help="training steps per block")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before numpy and the kernels load
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return args


ARGS = _args()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402  (after the thread counts are set)

from k3gates.infra import compile as kcompile  # noqa: E402
from k3gates.k3mu import corpus  # noqa: E402
from k3gates.k3mu import train as T  # noqa: E402
from k3gates.k3mu.model import Config, dequantize_params, initial, param_specs  # noqa: E402
from k3gates.k3mu.ops import FloatOps, IntOps  # noqa: E402


def main() -> None:
    load = os.getloadavg()
    print(f"CPU: {kcompile.cpu_model()} ({os.cpu_count()} cores; "
          f"{kcompile.cpu_vector_extensions()})")  # fmt: skip
    print(
        f"threads: OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = {ARGS.threads}, "
        f"OMP_WAIT_POLICY=PASSIVE; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    cfg = Config(vocab=len(corpus.load()[1]))
    d = T.data(cfg)
    total = ARGS.blocks * ARGS.steps
    offsets = T.batch_offsets(d["train"].size, cfg, total, seed=1)
    h = {**T.HYPER, "steps": total}
    sides = {}
    for name, ops, params in (
        ("integer", IntOps(), initial(cfg, 1)),
        ("float64 twin", FloatOps(), dequantize_params(initial(cfg, 1))),
    ):
        state = {n: ops.init_state(spec, params[n]) for n, spec in param_specs(cfg).items()}
        sides[name] = (ops, params, state)
    best = dict.fromkeys(sides, float("inf"))
    losses = {name: [] for name in sides}
    for block in range(ARGS.blocks):
        for name, (ops, params, state) in sides.items():
            t0 = time.perf_counter()
            for i in range(ARGS.steps):
                t = block * ARGS.steps + i + 1
                tokens = T.windows(d["train"], offsets[t - 1], cfg.context)
                losses[name].append(T.step(ops, params, state, cfg, tokens, t, h))
            best[name] = min(best[name], time.perf_counter() - t0)
    chars = ARGS.steps * cfg.batch * cfg.context
    rate = {name: chars / s for name, s in best.items()}
    print(f"K3-μ d={cfg.d}, {cfg.layers} layers, batch {cfg.batch} x context {cfg.context}; "
          f"best of {ARGS.blocks} blocks of {ARGS.steps} steps")  # fmt: skip
    for name in sides:
        per_step = best[name] / ARGS.steps
        print(f"  {name:<13} {rate[name]:>8.0f} characters/s  ({per_step:.3f} s/step)")
    gap = float(np.max(np.abs(np.array(losses["integer"]) - np.array(losses["float64 twin"]))))
    print(f"integer / float64 twin: {rate['integer'] / rate['float64 twin']:.2f}x "
          f"(same batches; largest train-loss gap {gap:.4f} bits/char)")  # fmt: skip
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")


if __name__ == "__main__":
    main()
