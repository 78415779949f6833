"""MX quantisation throughput, measured in one run. Prints ratios; asserts nothing.

    python bench/bench_mxfp.py

- compiled vs interpreted: the same `quantize_mx` source under Pythran and under CPython, 2^20
  values (the interpreted run is the slow side, so it runs once);
- values/s for MXFP4 (quantise + pack to 4.25 bits/value) and MXFP8 (E4M3 quantise; the codes are
  already bytes), best of several runs over 2^22 values.

For scale (issue 2): a public pure-torch MX quantiser runs at about 38 M values/s (MXFP4) and
55 M values/s (MXFP8) on this kind of machine, producing fake-quantised floats, not packed codes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3gates.infra import compile as kcompile

PEER_MXFP4 = 38e6  # values/s, public pure-torch quantiser (issue 2's figure for this machine)
PEER_MXFP8 = 55e6


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    k = kcompile.load("k3gates.mxfp.kernels")
    py = kcompile.interpreted("k3gates.mxfp.kernels")
    rng = np.random.default_rng(0)
    n_ratio, n_rate = 1 << 20, 1 << 22
    x = rng.standard_normal(n_rate) * np.exp2(rng.integers(-20, 20, n_rate // 32)).repeat(32)
    bits = x.astype(np.float32).view(np.uint32)

    t_c = best_of(lambda: k.quantize_mx(bits[:n_ratio], 3), 5)
    t_i = best_of(lambda: py.quantize_mx(bits[:n_ratio], 3), 1)
    print(
        f"quantize_mx E4M3 on 2^20 values: compiled {t_c * 1e3:.1f} ms, "
        f"interpreted {t_i:.2f} s -> compiled/interpreted speed ratio {t_i / t_c:,.0f}x"
    )

    t4 = best_of(lambda: k.quantize_pack_fp4(bits), 7)
    t8 = best_of(lambda: k.quantize_mx(bits, 3), 7)
    r4, r8 = n_rate / t4, n_rate / t8
    print(
        f"MXFP4 quantise+pack: {r4 / 1e6:,.0f} M values/s "
        f"({r4 / PEER_MXFP4:.1f}x the 38 M/s pure-torch figure)"
    )
    print(
        f"MXFP8 quantise:      {r8 / 1e6:,.0f} M values/s "
        f"({r8 / PEER_MXFP8:.1f}x the 55 M/s pure-torch figure)"
    )


if __name__ == "__main__":
    main()
