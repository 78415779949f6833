"""k3gates.infra.fresh: a kernel call in a new process, its digest and its peak memory."""

import numpy as np

from k3gates.infra import fresh
from k3gates.infra.gate import digest


def test_run_peak_measures_the_memory_the_call_takes_and_the_same_digest():
    rng = np.random.default_rng(3)
    a = rng.integers(-(1 << 20), 1 << 20, (1024, 64), dtype=np.int64)
    b = rng.integers(-(1 << 20), 1 << 20, (2048, 64), dtype=np.int64)
    args = (a, b, 20)
    rep = fresh.run_peak("k3gates.gemm.kernels", "gemm_i64", args, threads=1)
    out_bytes = 1024 * 2048 * 8  # C int64 [1024, 2048]: 16 MiB, every page written
    assert rep["output_bytes"][0] == out_bytes
    # the OS saw at least the output become resident during the call, and not 10x more
    assert out_bytes <= rep["peak_growth_bytes"] < 10 * out_bytes
    assert rep["digest"] == fresh.run_digest("k3gates.gemm.kernels", "gemm_i64", args, threads=2)
    from k3gates.infra import compile as kcompile

    here = kcompile.load("k3gates.gemm.kernels").gemm_i64(*args)
    assert rep["digest"] == digest(*here)
