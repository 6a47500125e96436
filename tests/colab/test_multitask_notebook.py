"""colab/multitask_quickstart.ipynb executed top to bottom (offline, in a fresh kernel),
within a time budget, and showing what it exists to show: the three methods on the
synthetic problem with their final inter-task cosines and the trajectory plot, the task
probabilities at q = 0.2, History's diagnostics curves, a held-out accuracy table per
task, and phi in the model after Sequential Reptile's fit, saved and reloaded."""

import math
import re

import numpy as np
import pytest

import notebook_lib as NB

ROOT = NB.ROOT
NOTEBOOK = ROOT / "colab" / "multitask_quickstart.ipynb"
#: Measured: 26-53 s on 2 shared CPU cores (kernel start included), depending on the load.
BUDGET_S = 90
METHODS = ("mtl", "pcgrad", "sequential_reptile")
TASKS = {"rot0": 640, "rot90": 320, "rot180": 160, "rot270": 80}
NUMBER = r"[-+]?\d+\.\d+"


@pytest.fixture(scope="module")
def executed():
    return NB.execute(NOTEBOOK, timeout=180, needs=[("sklearn", "pip install scikit-learn")])


def test_notebook_is_stored_without_outputs():
    """Like dotprod_quickstart.ipynb: the file holds code, not a run's results."""
    NB.check_stored_without_outputs(NOTEBOOK)


def test_runs_offline_within_budget_without_python_warnings(executed):
    NB.check_ran_cleanly(*executed, BUDGET_S)


def test_synthetic_problem_three_methods_cosines_and_trajectory_plot(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "run_method(method"))
    table = out.splitlines()
    assert table[0].split()[:3] == ["method", "final", "phi"]
    for method in METHODS:
        row = next(l for l in table if l.startswith(method + " "))
        values = [float(v) for v in re.findall(NUMBER, row)]
        assert len(values) >= 8 and all(math.isfinite(v) for v in values), row
    cosines = {
        m: (float(final), float(tail))
        for m, final, tail in re.findall(
            rf"^(\w+)\s+final inter-task cosine ({NUMBER})"
            rf"\s+\(mean over the last 20%: ({NUMBER})\)",
            out,
            flags=re.M,
        )
    }
    assert sorted(cosines) == sorted(METHODS), out
    assert all(-1.0 <= c <= 1.0 for pair in cosines.values() for c in pair)
    # The trajectories on the loss surface, drawn inline.
    assert NB.has_png(NB.cell(nb, "contourf"))
    # The claim the notebook checks itself (it asserts it), printed.
    check = NB.stdout(NB.cell(nb, 'summary["sequential_reptile"]["tail_loss"] <'))
    sr, mtl = map(
        float, re.search(rf"sequential_reptile ({NUMBER}) < mtl ({NUMBER})", check).groups()
    )
    assert sr < mtl


def test_task_probabilities_and_batches(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "MultiTaskStream(tasks"))
    rows = {
        m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4)))
        for m in re.finditer(rf"^(rot\d+)\s+(\d+)\s+({NUMBER})\s+({NUMBER})$", out, flags=re.M)
    }
    assert {k: v[0] for k, v in rows.items()} == TASKS, out
    sizes = np.array([TASKS[k] for k in TASKS], float)
    proportional = np.array([rows[k][1] for k in TASKS])
    tempered = np.array([rows[k][2] for k in TASKS])
    np.testing.assert_allclose(proportional, sizes / sizes.sum(), atol=6e-4)
    np.testing.assert_allclose(tempered, sizes**0.2 / (sizes**0.2).sum(), atol=6e-4)
    out = NB.stdout(NB.cell(nb, "next(iter(stream.single_task_batches()))"))
    assert re.search(r"single-task batch: \(32, 64\)\s+task_id values: \[\d\]", out), out
    assert "mixed batch:       (32, 64)  examples per task: [8 8 8 8]" in out, out


def test_real_fit_diagnostics_curves_and_accuracy_table(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "def train(method)"))
    for method in METHODS:
        line = next(l for l in out.splitlines() if l.startswith(method + " "))
        assert "task_gradient_cosine" in line and "distance_from_initial" in line, line
    # History's cosine and distance curves, drawn inline.
    assert NB.has_png(NB.cell(nb, 'history["task_gradient_cosine"], marker'))
    out = NB.stdout(NB.cell(nb, "def accuracy(model"))
    header = next(l for l in out.splitlines() if l.startswith("method"))
    assert header.split() == ["method", *TASKS, "mean", "cosine", "distance"]
    for method in METHODS:
        row = next(l for l in out.splitlines() if l.startswith(method + " "))
        values = [float(v) for v in row.split()[1:]]
        accuracies, mean, cosine, distance = values[:4], values[4], values[5], values[6]
        assert len(values) == 7 and all(math.isfinite(v) for v in values), row
        # Chance is 0.1; every method learns every rotated task.
        assert all(0.4 < a <= 1.0 for a in accuracies), row
        assert mean == pytest.approx(np.mean(accuracies), abs=1e-3)
        assert -1.0 <= cosine <= 1.0 and distance > 0.0, row


def test_phi_is_in_the_model_after_fit_and_saving_round_trips(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, 'runs["sequential_reptile"]'))
    steps = 300  # STEPS_PER_EPOCH * EPOCHS, a multiple of K = 5
    assert f"inner steps taken: {steps} (K = 5)" in out, out
    assert "model weights == phi (slow weights): True" in out, out
    # A partial trajectory (3 < K steps) is discarded when fit returns.
    assert (
        "after 3 more steps: phi unchanged: True | model weights == phi: True | "
        f"counter moved to the next trajectory: {steps + 5}"
    ) in out, out
    assert "reloaded model predicts the same: True" in out, out
    assert (
        f"reloaded trainer: SequentialReptileTrainer | slow weights equal: True | "
        f"counter: {steps + 5}"
    ) in out, out
