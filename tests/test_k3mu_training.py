"""K3-μ trained in integers (issue 14, acceptance 1-5): the k3mu_training evidence in the
published census, the committed long run and its replay, a two-process digest, and the sampler."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, BuildRun, check, gate_row

from k3gates.infra import fresh
from k3gates.k3mu import cli, corpus, gate

RUN = cli.RUNS / "long"


# -- acceptance 1, 2: the census ------------------------------------------------------------------
def test_k3block_is_proven_by_the_training_gates(built_site: BuildRun):
    row = next(r for r in built_site.census["innovations"] if r["id"] == "k3block")
    assert row["level"] == "PROVEN" and not row["killed"]
    for gate_id in ("k3block_backward", "k3mu_training", "k3mu_replay"):
        g = gate_row(built_site, gate_id)
        assert g["passed"] and all(c["passed"] for c in g["checks"]), gate_id


def test_k3mu_training_evidence(built_site: BuildRun):
    g = gate_row(built_site, "k3mu_training")
    base = json.loads((ROOT / "k3gates/k3mu/data/baselines.json").read_text())
    below = check(g, "loss_below_threshold")["values"]
    # the threshold is the bigram baseline less 0.3 bits/char, and the integer run is under it
    assert below["threshold"] == pytest.approx(base["bigram"] - 0.3)
    assert below["final"] <= base["bigram"] - 0.3
    start = check(g, "start_loss")["values"]
    assert abs(start["start"] - math.log2(len(corpus.load()[1]))) <= 0.1
    curve = check(g, "loss_curve")
    assert curve["bound"] == gate.CURVE_REL_TOL and curve["measured"] <= curve["bound"]
    digests = check(g, "rerun_fresh")["digests"]
    assert len(digests) == 2 and len(set(digests.values())) == 1
    assert any("OMP_NUM_THREADS=1" in k for k in digests)
    assert any("OMP_NUM_THREADS=2" in k for k in digests)


def test_the_build_verifies_the_committed_run(built_site: BuildRun):
    g = gate_row(built_site, "k3mu_replay")
    for name in ("checkpoint_intact", "checkpoint_val_loss", "replay_digest", "below_bigram"):
        assert check(g, name)["passed"], name
    assert RUN.joinpath("checkpoint.npz").stat().st_size <= 5 * 2**20


# -- acceptance 3: 20 steps in two processes ------------------------------------------------------
def test_twenty_steps_are_bit_identical_in_two_processes_and_thread_counts():
    small = gate._cfg(d=16, batch=2, context=16)
    args = (vars(small), 20, 7, 10)
    runs = [
        fresh.run_digest("k3gates.k3mu.train", "train_int", args, threads=n, python=True)
        for n in (1, 2)
    ]
    assert runs[0] == runs[1]
    other_seed = (vars(small), 20, 8, 10)
    assert fresh.run_digest("k3gates.k3mu.train", "train_int", other_seed, threads=1,
                            python=True) != runs[0]  # fmt: skip


# -- acceptance 4: a corrupted run is reported failed, by check name --------------------------
def replay_with(damaged: Path, data: bytes) -> str:
    """Run k3mu_replay (as the build does, in its own process) with `damaged` replaced by
    `data`, then put the committed bytes back. The run folder is one of the gate's inputs, so
    the result of the damaged run is never reused for the committed one."""
    committed = damaged.read_bytes()
    try:
        damaged.write_bytes(data)
        proc = subprocess.run(
            [sys.executable, "-m", "k3gates", "run", "k3mu_replay"],
            capture_output=True, text=True, timeout=1800, cwd=ROOT,
        )  # fmt: skip
    finally:
        damaged.write_bytes(committed)
    return proc.stdout + proc.stderr


def failed_checks(out: str) -> set[str]:
    return {ln.split()[1] for ln in out.splitlines() if ln.strip().startswith("FAIL")}


def test_a_corrupted_checkpoint_byte_fails_by_name():
    ckpt = RUN / "checkpoint.npz"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x01
    out = replay_with(ckpt, bytes(data))
    assert {"checkpoint_intact", "checkpoint_val_loss"} <= failed_checks(out), out[-3000:]
    assert "gate k3mu_replay (k3block, STRONG): failed" in out


def test_a_corrupted_recorded_digest_fails_by_name():
    meta_path = RUN / "run.json"
    meta = json.loads(meta_path.read_text())
    k = str(meta["checkpoint_every"])
    d = meta["digests"][k]
    meta["digests"][k] = d[:-1] + ("0" if d[-1] != "0" else "1")
    out = replay_with(meta_path, (json.dumps(meta, indent=1) + "\n").encode())
    assert failed_checks(out) == {"replay_digest"}, out[-3000:]
    assert "gate k3mu_replay (k3block, STRONG): failed" in out


# -- acceptance 5: the sampler -------------------------------------------------------------------
def sample_cli(seed: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "k3gates", "sample", "k3mu", "--prompt", "ROMEO:", "--chars",
         "80", "--seed", str(seed)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=True,
    )  # fmt: skip
    return proc.stdout


def test_sample_is_the_same_text_for_a_seed_and_differs_with_another():
    first, again, other = sample_cli(1), sample_cli(1), sample_cli(2)
    assert first.startswith("ROMEO:") and len(first.rstrip("\n")) == len("ROMEO:") + 80
    assert first == again
    assert other != first


def test_sample_refuses_characters_outside_the_vocabulary():
    proc = subprocess.run(
        [sys.executable, "-m", "k3gates", "sample", "k3mu", "--prompt", "ROMEO€", "--chars", "5"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0 and "not in the vocabulary" in proc.stderr
    assert "Traceback" not in proc.stderr
