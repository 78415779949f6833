"""`python -m k3gates.moe`: one LatentMoE layer, expert-parallel, checked against float64.

    python -m k3gates.moe --scale small --workers 2 --tokens 32 --single
    python -m k3gates.moe --scale k3 --workers 2 --tokens 16 --sample 4 --json moe_layer_k3.json

The K3 run holds 15.7 GB of MXFP4 experts across the workers (7.8 GB each with 2) and 1.4 GiB of
dense Q.24 weights on the client: it needs about 20 GB of free memory. Measured on this 2-core
machine: an expert generates in 0.3 s and runs a token in 0.3 s (3 x 11M exact MX terms), so
loading takes about 2.5 minutes per worker, the forward about 2.5 s per token over 2 workers, and
the float64 check about 1.6 s per sampled expert (4 tokens: up to 64 experts). Do not pass
--single at K3's size (one process would regenerate every routed expert).

--workers N starts a LocalCluster of N worker processes (one thread each, no Dask memory limit:
a K3 shard is resident by design); --scheduler tcp://HOST:PORT uses running workers instead (each
must import this checkout and reach the compiled-kernel cache). Each worker generates and keeps
its contiguous range of experts, then the batch runs once. Printed: per-worker peak memory and
weight bytes, all-to-all bytes (sent and returned), tokens/s, the CPU model, and the float64
check on a sample of tokens within the bounds declared in layer.py. Exit status 1 if the check
(or, with --single, bit-identity with the single-process forward) fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from ..infra import compile as kcompile
from . import layer_k3 as L
from . import reference_k3 as R

SEED = 20260708


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3gates.moe", description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=sorted(L.SCALES), default="small")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    where.add_argument("--scheduler", help="a running Dask scheduler, tcp://HOST:PORT")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--sample", type=int, default=R.SAMPLE_TOKENS, help="tokens checked in float64")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--single", action="store_true", help="also run in one process; compare bits")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p.parse_args(argv)


def _client(args: argparse.Namespace):
    import distributed

    if args.scheduler:
        return None, distributed.Client(args.scheduler, timeout=20)
    cluster = distributed.LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
        memory_limit=0, silence_logs=logging.ERROR, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return cluster, distributed.Client(cluster)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> dict:
    shape = L.SCALES[args.scale]
    layer = L.LatentMoE(shape, args.seed)
    x = L.make_input(shape, args.seed, args.tokens)
    cluster, client = _client(args)
    try:
        owners = layer.workers(client)
        start = time.perf_counter()
        loads = layer.load(client)
        load_s = time.perf_counter() - start
        result = layer.forward_parallel(client, x)
        peaks = client.run(L.peak_rss_bytes)
        for a, lo, hi in owners:
            client.run(L.drop_shard, shape, args.seed, lo, hi, workers=[a])
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    out = {"scale": args.scale, "shape": shape.__dict__, "seed": args.seed, "tokens": args.tokens,
           "cpu": kcompile.cpu_model(), "load_s": load_s, "forward_s": result.stats["seconds"],
           "tokens_per_s": result.stats["tokens_per_s"], "workers": {}}  # fmt: skip
    for a, lo, hi in owners:
        out["workers"][a] = {"expert_range": [lo, hi], **loads[a], **result.stats["workers"][a],
                             "peak_rss_bytes": peaks[a]}  # fmt: skip
    out["client_peak_rss_bytes"] = L.peak_rss_bytes()
    if args.single:
        single = layer.forward(x)
        out["single_s"] = single.stats["seconds"]
        out["bit_identical"] = bool(
            np.array_equal(single.y, result.y) and np.array_equal(single.c, result.c)
        )
    tokens = R.sample_tokens(args.tokens, args.sample, args.seed)
    out["check"] = R.check(shape, args.seed, x, result, tokens, layer.dense)
    return out


def report(out: dict) -> None:
    print(f"LatentMoE at scale {out['scale']}: {out['shape']}")
    print(f"CPU: {out['cpu']}")
    for a, w in out["workers"].items():
        print(f"  worker {a}: experts [{w['expert_range'][0]}, {w['expert_range'][1]}), weights "
              f"{_gib(w['weight_bytes'])} generated in {w['load_s']:.1f} s, peak RSS "
              f"{_gib(w['peak_rss_bytes'])}; all-to-all: sent {w['sent_bytes']} B for "
              f"{w['tokens']} tokens, returned {w['returned_bytes']} B; "
              f"compute {w['compute_s']:.2f} s")  # fmt: skip
    print(f"  client peak RSS {_gib(out['client_peak_rss_bytes'])}")
    rate = f"{out['tokens_per_s']:.3f} tokens/s"
    print(f"forward: {out['tokens']} tokens in {out['forward_s']:.2f} s = {rate} "
          f"(weights loaded in {out['load_s']:.1f} s)")  # fmt: skip
    if "bit_identical" in out:
        print(f"expert-parallel == single process, bit for bit: {out['bit_identical']}")
    chk = out["check"]
    print(f"float64 check ({chk['seconds']:.1f} s) on {len(chk['tokens'])} tokens, "
          f"{chk['experts']} experts: "
          f"selection agrees {chk['selection_agrees']} ({chk['near_ties']} near-ties), "
          f"premises {chk['premises']}, largest expert row L1 "
          f"{chk['max_row_l1_ratio']:.3f} K 2^X_top (the bounds' l1_ratio)")  # fmt: skip
    for name in ("c", "y"):
        v = chk[name]
        print(f"  {name}: max error {v['max_err_lsb']:.3g} LSB of Q.24 <= bound "
              f"{v['bound_lsb']:.4g}: {v['ok']} (bound / rms {v['bound_over_rms']:.3g}, "
              f"zero output fails: {v['zero_fails']})")  # fmt: skip
    print(f"check: {'PASS' if chk['ok'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out = run(args)
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["check"]["ok"] and out.get("bit_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
