"""The compiled-equals-interpreted check of a whole model run, shared by the gates that run K3-μ
whole (k3mu/gate.py, mxfp/gate_qat.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from k3gates.infra.gate import GateContext, digest


def check_compiled_run(ctx: GateContext, name: str, proves: str, run: Callable[..., tuple]) -> bool:
    """`run()` by the compiled kernels against `run(interpreted=True)`, the same kernel sources
    run by CPython: bit-identical outputs (their digests), and how many times slower CPython
    was."""
    t0 = time.perf_counter()
    compiled = digest(*run())
    t1 = time.perf_counter()
    interpreted = digest(*run(interpreted=True))
    t2 = time.perf_counter()
    return ctx.check(
        name,
        proves,
        compiled == interpreted,
        kind="compiled",
        digests={"compiled": compiled, "interpreted": interpreted},
        speed_ratio=(t2 - t1) / max(t1 - t0, 1e-9),
    )
