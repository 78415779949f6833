"""Issue 47: every integer a kernel receives is derived the same way on every CPU.

Statically (k3gates/infra/inputaudit.py): every place a gate, a library face or a model module turns
a value into integers, followed back to where the value came from, uses no transcendental function,
no power with a non-integer exponent and no BLAS product. At run time: the inputs of the gates
that once went through such functions are derived again in a process whose NumPy takes its AVX2
code paths and whose OpenBLAS takes its Haswell kernels, and they are the same bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from k3gates.infra import inputaudit
from k3gates.infra.discover import GatePackage, gate_files


@pytest.fixture(scope="module")
def audit() -> inputaudit.Audit:
    return inputaudit.audit(ROOT)


def test_every_conversion_to_kernel_integers_uses_exact_operations(audit):
    # the audit reads every gate file discovery finds, and finds conversions in each gate file
    # (the gate API, infra/gate.py, feeds no kernel)
    gates = {f.resolve() for f in gate_files(GatePackage(ROOT / "k3gates"))}
    assert gates <= {f.resolve() for f in inputaudit.audited_files(ROOT)}
    with_sites = {s.path.resolve() for s in audit.sites}
    assert gates - with_sites == {(ROOT / "k3gates" / "infra" / "gate.py").resolve()}
    assert not audit.findings, "\n".join(str(f) for f in audit.findings)


def test_every_site_the_audit_does_not_follow_says_why(audit):
    """The conversions that make no kernel input, each with its reason (printed with -s)."""
    waived = [s for s in audit.sites if s.reason]
    for s in waived:
        print(f"{s.path.relative_to(ROOT)}:{s.line} ({s.function}) {s.text}: {s.reason}")
        assert len(s.reason) >= 10, s


def _audit_with(tmp_path: Path, path: str, old: str, new: str) -> list[str]:
    """The findings after replacing `old` by `new` in a copy of the project's sources."""
    for pkg in ("k3gates", "scale_k3"):
        for p in (ROOT / pkg).rglob("*.py"):
            dst = tmp_path / p.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(p.read_text())
    target = tmp_path / path
    text = target.read_text()
    assert old in text, (path, old)
    target.write_text(text.replace(old, new))
    return [str(f) for f in inputaudit.audit(tmp_path).findings]


def test_the_audit_fails_when_the_rope_table_goes_back_to_float_pow(tmp_path):
    """The acceptance of issue 47: longctx_rope's table built again as base ** (-2i/D) in
    float64 (ref.inv_freq, as it was until issue 47) is found."""
    found = _audit_with(
        tmp_path,
        "k3gates/longctx/gate.py",
        'f = table_q62("plain", 10000, 1, 0)[0]',
        "f = np.round(ref.inv_freq(HEAD_DIM, 10000.0) * 2.0**62 / (2 * np.pi)).astype(np.int64)",
    )
    assert any("longctx/gate.py" in f and "non-integer exponent" in f for f in found), found


@pytest.mark.parametrize(
    ("path", "old", "new", "what"),
    [
        # a transcendental ufunc on the way to an input
        ("k3gates/kda/gate.py", "host.sigmoid(rng.standard_normal((t_len, n_h)))",
         "1.0 / (1.0 + np.exp(-rng.standard_normal((t_len, n_h))))", "np.exp"),
        # a float power in a weight's initial scale
        ("k3gates/moe/layer_train.py", "host.inv_sqrt(fan_in)", "fan_in**-0.5",
         "non-integer exponent"),
        # a BLAS product in a teacher's targets
        ("k3gates/situ/gate.py", "g, u = host.matmul(x, t1.T), host.matmul(x, t3.T)",
         "g, u = x @ t1.T, x @ t3.T", "matrix product"),
        # a libm logarithm in a format choice of a library face
        ("k3gates/fx/__init__.py", "k = max(0, host.ceil_log2(biggest) - 60)",
         "k = max(0, int(np.ceil(np.log2(biggest))) - 60)", "np.log2"),
    ],
)  # fmt: skip
def test_each_kind_of_finding_is_found(tmp_path, path, old, new, what):
    found = _audit_with(tmp_path, path, old, new)
    assert any(path in f and what in f for f in found), found


# -- at run time: the same inputs with NumPy's and OpenBLAS's AVX2 paths -----------------------

# NumPy 2's names for the AVX-512 groups, and OpenBLAS's AVX2 core: on an AVX2 machine these
# change nothing, on an AVX-512 machine they make this process compute as an AVX2 machine would
AVX2_ENV = {"NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
            "OPENBLAS_CORETYPE": "Haswell"}  # fmt: skip

INPUTS = textwrap.dedent(
    """
    import hashlib, json
    import numpy as np
    from k3gates.longctx import gate as longctx
    from k3gates.k3block import gate_longctx
    from k3gates.kda import gate as kda
    from k3gates.kda import gate_grad as kdagrad
    from k3gates.attnres import gate as attnres
    from k3gates.muon import gate as muon
    from k3gates.situ import gate as situ
    from k3gates.tasks.specialise import clusters
    from k3gates.fx import gate as fxgate
    import k3gates.vision as vision

    def h(*arrays):
        d = hashlib.sha256()
        for a in arrays:
            d.update(np.ascontiguousarray(a).tobytes())
        return d.hexdigest()[:16]

    out = {}
    for name in ("plain", "ntk", "yarn"):
        out["rope " + name] = h(*longctx.table_q62(name, 10000, 8 if name == "ntk" else 32, 32768))
    out["vision tables"] = h(vision.time_turns(64), vision.rope_turns())
    out["kda problem"] = h(*kda._problem(np.random.default_rng(3), 64, 2, 16, 16).values())
    out["kdagrad inputs"] = h(*kdagrad._inputs(64).values())
    out["longctx kda piece"] = h(*gate_longctx._kda_piece(3).values())
    out["attnres sources"] = h(attnres.sources(np.random.default_rng(3), 8))
    out["attnres teacher"] = h(*attnres.teacher_problem(5).values())
    out["muon teacher"] = h(*muon.attention_data(5).values())
    out["situ teacher"] = h(*situ.regression_data(5).values())
    task = clusters.task(5)
    out["specialise"] = h(*clusters.sample(task, np.random.default_rng(6), 256).values())
    out["fx rows"] = h(fxgate._norm_rows(np.random.default_rng(3))[0],
                       fxgate._softmax_rows(np.random.default_rng(3)))
    print(json.dumps(out))
    """
)


def _inputs(env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", INPUTS],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_kernel_inputs_are_the_same_bits_on_avx2_paths():
    here, avx2 = _inputs({}), _inputs(AVX2_ENV)
    assert len(here) == 13
    assert here == avx2


def test_the_avx2_paths_do_change_cpu_dependent_floats():
    """The comparison above can fail: the same switch changes np.exp's bits here, when this
    machine has AVX-512 (on an AVX2 machine it has nothing to switch, and says so)."""
    probe = (
        "import hashlib, numpy as np; x = np.random.default_rng(0).standard_normal(1 << 16); "
        "print(hashlib.sha256(np.exp(x).tobytes()).hexdigest())"
    )

    def run(env: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env},
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout

    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX-512 here: NumPy already takes its AVX2 paths")
    assert run({}) != run(AVX2_ENV)
