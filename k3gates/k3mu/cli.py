"""`python -m k3gates train k3mu` and `python -m k3gates sample k3mu`: the long run and its samples.

A run folder holds:
    checkpoint.npz   every final weight, int64 (Q.20; the QB biases Q.40)
    run.json         the command, config, recipe, seed, the curves, the validation loss of the
                     final checkpoint as the integer kernels summed it, the weight digests every
                     K steps, and provenance (commit, CPU, date, tokens/s)
The build re-evaluates the checkpoint and replays the first K steps (gate k3mu_replay).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..infra import compile as kcompile
from . import train as T
from .model import Config

RUNS = Path(__file__).resolve().parent / "runs"


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save(folder: Path, params: dict[str, np.ndarray], meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / "checkpoint.npz", **params)
    (folder / "run.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_meta(folder: Path) -> dict:
    """The run record, or a clear error naming the file."""
    path = folder / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; train one with `python -m k3gates train k3mu`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


def load_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint's int64 weights, or a ValueError naming the file and the reason."""
    path = folder / "checkpoint.npz"
    try:
        with np.load(path) as z:
            params = {k: np.ascontiguousarray(z[k]) for k in z.files}
    except Exception as e:  # a missing file, a corrupt zip or member: several kinds
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    bad = sorted(k for k, v in params.items() if v.dtype != np.int64)
    if bad:
        raise ValueError(f"{path}: weights must be int64, not {bad}")
    return params


def validation_loss_q(ops, params: dict, cfg: Config, val_ids: np.ndarray) -> tuple[int, int]:
    """The integer summed cross-entropy (Q.32 nats) over every whole window of the validation
    split, and the token count: what a replay must reproduce bit for bit."""
    n = (val_ids.size - 1) // cfg.context
    starts = np.arange(n, dtype=np.int64) * cfg.context
    total, tokens = 0, 0
    for i in range(0, n, 64):
        rec = T.forward(ops, params, cfg, T.windows(val_ids, starts[i : i + 64], cfg.context),
                        grad=False)  # fmt: skip
        total += rec["loss_q"]
        tokens += rec["tokens"]
    return total, tokens


def train_command(steps: int, out: Path, seed: int, every: int) -> int:
    from .ops import IntOps

    _text, vocab = T.corpus.load()
    cfg = Config(vocab=len(vocab))
    d = T.data(cfg)
    ops = IntOps()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = T.run(ops, T.initial(cfg, seed), cfg, d, steps, seed, eval_every=max(1, steps // 40),
                   progress=T.print_progress, checkpoint_every=every)  # fmt: skip
    sys.stderr.write("\n")
    loss_q, tokens = validation_loss_q(ops, result["params"], cfg, d["val"])
    meta = {
        "command": f"python -m k3gates train k3mu --steps {steps} --out {out} --seed {seed} "
        f"--every {every}",
        "config": vars(cfg),
        "recipe": T.HYPER,
        "seed": seed,
        "steps": steps,
        "tokens": result["tokens"],
        "checkpoint_every": every,
        "digests": {str(k): v for k, v in result["digests"].items()},
        "final_digest": T.params_digest(result["params"]),
        "curve": {
            "eval_steps": result["eval_steps"],
            "val_bits": result["val"],
            "train_bits": result["train"],
        },
        "val_loss_q32": loss_q,
        "val_tokens": tokens,
        "val_bits": loss_q * 2.0**-32 / tokens / np.log(2),
        "val_nats": loss_q * 2.0**-32 / tokens,
        "seconds": round(result["seconds"], 1),
        "tokens_per_s": round(result["tokens"] / result["seconds"]),  # audit: a figure to print
        "provenance": {"commit": _commit(), "cpu": kcompile.cpu_model(), "started": started},
    }
    save(out, result["params"], meta)
    meta["checkpoint_sha256"] = hashlib.sha256((out / "checkpoint.npz").read_bytes()).hexdigest()
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"val {meta['val_bits']:.4f} bits/char ({meta['val_nats']:.4f} nats) over {tokens} "
          f"tokens; {meta['tokens_per_s']} tokens/s; wrote {out}")  # fmt: skip
    return 0


def sample_command(prompt: str, chars: int, seed: int, temperature: float, top_k: int,
                   run: Path) -> int:  # fmt: skip
    from .ops import IntOps
    from .sample import sample

    meta, params = load_meta(run), load_checkpoint(run)
    print(
        sample(IntOps(), params, Config(**meta["config"]), prompt, chars, seed, temperature, top_k)
    )
    return 0
