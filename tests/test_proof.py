"""The task gates' shared helper (k3gates/tasks/proof.py): the float64 twin trains in a fresh
process, and what comes back is the run the gate would have made itself."""

from __future__ import annotations

import numpy as np
import pytest

from k3gates.infra.fresh import FreshRunError
from k3gates.k3mu.ops import FloatOps
from k3gates.tasks import proof as P
from k3gates.tasks import seq as S
from k3gates.tasks.mqar import task as Q

STEPS, SEED = 3, 5


def test_the_twin_from_a_fresh_process_is_the_run_made_here():
    h = dict(Q.HYPER)
    twin = P._Twin(Q.__name__, STEPS, SEED, 1, h, FloatOps).result()
    d = P.task_data(Q, SEED, STEPS)
    here = S.run(FloatOps(), S.twin_params(S.init(Q.CONFIG, SEED)), Q.CONFIG, d["train"],
                 d["eval"], STEPS, h, 1, getattr(Q, "FIXED", ()))  # fmt: skip
    assert twin["eval_steps"] == here["eval_steps"] and len(twin["val"]) == STEPS + 1
    assert np.array_equal(twin["val"], here["val"])
    assert twin["params"].keys() == here["params"].keys()
    assert all(np.array_equal(twin["params"][k], here["params"][k]) for k in here["params"])


def test_a_twin_whose_process_fails_raises_in_the_gate_with_its_output():
    with pytest.raises(FreshRunError, match=r"No module named 'k3gates\.no_such_task'"):
        P._Twin("k3gates.no_such_task", STEPS, SEED, 1, dict(Q.HYPER), FloatOps).result()
