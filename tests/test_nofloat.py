"""The static audit catches each way a float can enter a kernel, and passes integer code."""

from pathlib import Path

import pytest

from k3gates.nofloat import audit_file, audit_source

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
        ("import numpy as np\ny = np.zeros(3, dtype=np.float64)", "float dtype `float64`"),
        ("import numpy as np\ny = a.astype('f8')", "float dtype string 'f8'"),
        ("import numpy as np\ny = np.zeros(3, dtype='float32')", "float dtype string 'float32'"),
        ("import numpy as np\ny = np.sqrt(a)", "`np.sqrt` returns a float"),
        ("import numpy as np\ny = np.mean(a)", "`np.mean` returns a float"),
        ("import math\ny = math.exp(a)", "`math.exp` returns a float"),
        ("from math import sqrt", "`from math import sqrt` returns a float"),
        ("import numpy as np\ny = np.random.rand(3)", "`np.random` returns a float"),
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


def test_every_kernels_module_in_the_project_is_integer_only():
    kernels = sorted((ROOT / "k3gates").glob("*/kernels.py"))
    assert kernels, "no kernels modules found"
    for path in kernels:
        assert audit_file(path) == [], path


def test_the_floaty_fixture_is_caught():
    findings = audit_file(ROOT / "tests/fixtures/fixture_gates/floaty/kernels.py")
    assert {f.what.split(" ")[0] for f in findings} >= {"true", "float"}
