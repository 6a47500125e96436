"""colab/sam_quickstart.ipynb executed top to bottom (offline, in a fresh kernel), within a
time budget, and showing what it exists to show: plain / SAM / ASAM / GSAM on digits with
held-out accuracy and lambda_max per run, the surrogate-gap plot, and the custom-loop
`sam_gradient` equal to `SAMTrainer.fit`."""

import math
import re

import pytest

import notebook_lib as NB

NOTEBOOK = NB.ROOT / "colab" / "sam_quickstart.ipynb"
#: Budget for 2 shared CPU cores (kernel start included); the runs are a small MLP.
BUDGET_S = 120
RUNS = ("plain", "sam", "asam", "gsam")
NUMBER = r"[-+]?\d+\.\d+"


@pytest.fixture(scope="module")
def executed():
    return NB.execute(NOTEBOOK, timeout=240, needs=[("sklearn", "pip install scikit-learn")])


def test_notebook_is_stored_without_outputs():
    NB.check_stored_without_outputs(NOTEBOOK)


def test_runs_offline_within_budget_without_python_warnings(executed):
    NB.check_ran_cleanly(*executed, BUDGET_S)


def test_four_runs_with_accuracy_and_sharpness(executed):
    nb, _ = executed
    assert "surrogate_gap" in NB.stdout(NB.cell(nb, "histories, models = {}, {}"))
    out = NB.stdout(NB.cell(nb, "largest_hessian_eigenvalue(\n"))
    lines = out.splitlines()
    assert lines[0].split() == ["run", "test", "acc", "test", "loss", "lambda_max"]
    for run in RUNS:
        row = next(l for l in lines if l.startswith(run + " "))
        acc, loss, lam = (float(v) for v in re.findall(NUMBER, row))
        assert 0.5 < acc <= 1.0 and math.isfinite(loss) and lam > 0, row
    assert NB.has_png(NB.cell(nb, "surrogate gap"))


def test_custom_loop_equals_fit(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "def train_step(x, y):"))
    gap = float(re.search(r"max \|weight difference\| (\S+)", out).group(1))
    assert gap < 1e-5, out
