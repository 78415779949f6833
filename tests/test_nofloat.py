"""The static audit catches each way a float can enter a kernel, and passes integer code."""

from pathlib import Path

import pytest

from k3gates.infra.nofloat import audit_file, audit_source

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("x = 0.5", "float literal 0.5"),
        ("x = 1e3", "float literal 1000.0"),
        ("x = 2j", "float literal 2j"),
        ("y = a / b", "true division"),
        ("a /= 3", "true division"),
        ("y = a ** -1", "negative power"),
        ("y = float(a)", "`float` makes a float"),
        ("import numpy as np\ny = np.zeros(3, dtype=np.float64)", "`np.float64` is not on the"),
        ("import numpy as np\ny = a.astype('f8')", "float dtype string 'f8'"),
        ("import numpy as np\ny = np.zeros(3, dtype='float32')", "float dtype string 'float32'"),
        ("import numpy as np\ny = np.sqrt(a)", "`np.sqrt` is not on the integer allow-list"),
        ("import numpy as np\ny = np.mean(a)", "`np.mean` is not on the integer allow-list"),
        ("import math\ny = math.exp(a)", "`math.exp` is not on the integer allow-list"),
        ("from math import sqrt", "`from math import sqrt` is not on the kernel import allow-list"),
        (
            "import numpy as np\ny = np.random.rand(3)",
            "`np.random` is not on the integer allow-list",
        ),
        ("y = complex(a, b)", "`complex` makes a float"),
        ("y = a ** -1.5", "float literal 1.5"),
    ],
)
def test_each_float_construct_is_found_with_its_line(source, what):
    findings = audit_source(source, "k.py")
    assert findings, f"{source!r} passed the audit"
    assert any(what in f.what for f in findings), [str(f) for f in findings]
    assert str(findings[0]).startswith(f"k.py:{source.count(chr(10)) + 1}:")


def test_integer_code_passes():
    source = '''
"""Docstrings may talk about float32 and 0.5 freely."""
import math
import numpy as np
# and so may comments: x / 2.0
def f(a, b):
    """Returns a // b as int64."""
    out = np.zeros(4, dtype=np.int64)
    out[0] = (a + (1 << 3)) >> 4
    out[1] = a // b + a % b + math.isqrt(b) + 2 ** 10
    return out
'''
    assert audit_source(source) == []


KERNELS = sorted((ROOT / "k3gates").rglob("kernels*.py"))


def test_the_project_has_kernels_modules():
    assert len(KERNELS) >= 10, KERNELS


@pytest.mark.parametrize("path", KERNELS, ids=[p.relative_to(ROOT).as_posix() for p in KERNELS])
def test_every_kernels_module_in_the_project_is_integer_only(path):
    assert [str(f) for f in audit_file(path)] == []


def test_the_floaty_fixture_is_caught():
    findings = audit_file(ROOT / "tests/fixtures/fixture_gates/floaty/kernels.py")
    assert {f.what.split(" ")[0] for f in findings} >= {"true", "float"}
    assert {f.line for f in findings} == {6}


def test_a_kernel_smuggling_a_float_past_the_old_audit_is_caught(tmp_path):
    """A whole module, as the runner audits it: each line below passed the old audit."""
    kernel = tmp_path / "kernels.py"
    kernel.write_text(
        "import math as m\n"
        "import numpy as np\n"
        "\n"
        "\n"
        "# pythran export smuggle(int64[:], float64)\n"
        "def smuggle(x, y):\n"
        "    acc = np.zeros(x.shape[0])\n"
        "    acc[0] = x.mean() + m.sqrt(x[0]) + np.pi + pow(x[1], -1) + x[2] ** (0 - 1)\n"
        "    return acc\n",
        encoding="utf-8",
    )
    findings = audit_file(kernel)
    assert {(f.line, f.what.split("`")[1]) for f in findings} == {
        (5, "# pythran export"),
        (7, "np.zeros"),
        (8, ".mean"),
        (8, "math.sqrt"),
        (8, "np.pi"),
        (8, "pow(x[1], -1)"),
        (8, "x[2] ** (0 - 1)"),
    }
    assert all(str(f).startswith(f"{kernel}:{f.line}: ") for f in findings)


def test_findings_come_in_line_order_without_repeats():
    source = "import numpy as np\ny = np.sqrt(np.sqrt(a)) / 2\nz = np.pi\n"
    findings = audit_source(source, "k.py")
    assert [f.line for f in findings] == sorted(f.line for f in findings)
    assert len({(f.line, f.what) for f in findings}) == len(findings)
    assert sorted(str(f) for f in findings) == [
        "k.py:2: `np.sqrt` is not on the integer allow-list",
        "k.py:2: true division `/` (use `//` by a positive divisor, or a shift)",
        "k.py:3: `np.pi` is not on the integer allow-list",
    ]
