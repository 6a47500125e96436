"""colab/fewshot_quickstart.ipynb executed top to bottom (offline, in a fresh kernel),
within a time budget, and showing what it exists to show: Omniglot's 242 small-set
characters split by character, a few of them drawn, one 5-way 1-shot meta-batch's shapes,
plain MAML and gradient sharing meta-trained from the same weights (History's validation
accuracy and gates, plotted), and a table of 5-way 1-shot test accuracy (95% CI) and Lake's
20 official runs of 20-way 1-shot.

Needs the Omniglot files in ../shared/data/omniglot (or $TF_METAALIGN_OMNIGLOT_DIR);
skipped, with the reason, without them."""

import math
import re

import pytest

from tf_metaalign.data.omniglot import default_omniglot_root

import notebook_lib as NB

ROOT = NB.ROOT
NOTEBOOK = ROOT / "colab" / "fewshot_quickstart.ipynb"
#: Measured: 71-85 s on 2 shared CPU cores at load average 4-6 (kernel start included),
#: most of it TensorFlow's import and tracing the two trainers' unrolled inner loops; the
#: run is deterministic (the same accuracies in every run).
BUDGET_S = 150
METHODS = ("maml", "sharing")
NUMBER = r"[-+]?\d+\.\d+"
DATA_FILES = ("images_background_small1.zip", "images_background_small2.zip", "all_runs.zip")


@pytest.fixture(scope="module")
def executed():
    root = default_omniglot_root()
    missing = [f for f in DATA_FILES if not (root / f).is_file()]
    if missing:
        pytest.skip(f"Omniglot files {missing} not in {root} (set $TF_METAALIGN_OMNIGLOT_DIR)")
    return NB.execute(NOTEBOOK, timeout=300)


def test_notebook_is_stored_without_outputs():
    """Like the other notebooks: the file holds code, not a run's results."""
    NB.check_stored_without_outputs(NOTEBOOK)


def test_runs_offline_within_budget_without_python_warnings(executed):
    NB.check_ran_cleanly(*executed, BUDGET_S)


def test_characters_split_and_drawn(executed):
    nb, _ = executed
    cell = NB.cell(nb, "split_classes(classes")
    assert "242 characters: 170 meta-train, 24 validation, 48 test" in NB.stdout(cell)
    assert NB.has_png(cell)


def test_one_five_way_one_shot_meta_batch(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "train_episodes.batch(0)"))
    assert (
        "EpisodeSampler(num_classes=170, ways=5, shots=1, queries=5, tasks_per_batch=2, seed=0)"
    ) in out, out
    shapes = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^(\w+)\s+(\([\d, ]+\))\s+(\w+)$", out, flags=re.M)
    }
    assert shapes == {
        "support_x": ("(2, 5, 28, 28, 1)", "float32"),
        "support_y": ("(2, 5)", "int32"),
        "query_x": ("(2, 25, 28, 28, 1)", "float32"),
        "query_y": ("(2, 25)", "int32"),
    }, out
    # Class-major layout: one shot per way, then 5 queries per way.
    assert "support_y of task 0: [0 1 2 3 4]" in out, out
    assert (
        "query_y of task 0: [" + " ".join(str(j) for j in range(5) for _ in range(5)) + "]" in out
    ), out


def test_maml_and_gradient_sharing_fit_history_and_plots(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "def meta_train("))
    for method in METHODS:
        line = next(l for l in out.splitlines() if l.startswith(method + " "))
        assert re.search(rf"{method}\s+200 meta-batches in\s+{NUMBER} s", line), line
        train, val = map(
            float, re.search(rf"train ({NUMBER}), validation ({NUMBER})", line).groups()
        )
        assert 0.0 <= train <= 1.0 and 0.0 <= val <= 1.0, line
        keys = line.split("History: ")[1].split(", ")
        assert {"loss", "accuracy", "val_accuracy", "val_loss", "support_loss"} <= set(keys)
        # Only gradient sharing learns and logs the gates.
        assert ({"sharing_m", "sharing_lambda"} <= set(keys)) == (method == "sharing"), line
    # Validation accuracy of both methods and sigmoid(m), sigmoid(lambda), drawn inline.
    cell = NB.cell(nb, 'history["sharing_m"]')
    assert NB.has_png(cell)
    gates = {
        name: [float(v) for v in re.findall(NUMBER, row)]
        for name, row in re.findall(
            r"^sigmoid\((m|lambda)\) per epoch:\s+\[(.*)\]$", NB.stdout(cell), flags=re.M
        )
    }
    assert sorted(gates) == ["lambda", "m"], NB.stdout(cell)
    for values in gates.values():  # one per epoch, sigmoids that start near sigmoid(0)
        assert len(values) == 8 and all(0.0 < v < 1.0 for v in values), values
        assert abs(values[0] - 0.5) < 0.1, values


def test_evaluation_table_five_way_ci_and_lakes_runs(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "evaluate_official_runs(adapt_and_predict"))
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["method", "5-way", "val"], out
    for method in METHODS:
        row = next(l for l in lines if l.startswith(method + " "))
        m = re.fullmatch(
            rf"{method}\s+({NUMBER})\s+({NUMBER}) ± ({NUMBER})\s+({NUMBER}) ± "
            rf"({NUMBER})\s+({NUMBER})",
            row.strip(),
        )
        assert m, row
        values = [float(v) for v in m.groups()]
        assert all(math.isfinite(v) for v in values), row
        val, five, five_ci, lake, lake_ci, error = values
        assert 0.0 <= val <= 1.0 and 0.0 <= lake <= 1.0
        assert 0.0 < five_ci < 0.1 and 0.0 <= lake_ci < 0.2, row
        assert error == pytest.approx(1.0 - lake, abs=1.5e-3), row
        # 5-way chance is 0.2; both meta-trained initialisations clear it on held-out
        # characters (measured 0.409 +- 0.017 and 0.484 +- 0.020, in every run).
        assert five - five_ci > 0.25, row
        # 20-way chance is 0.05; measured 0.135-0.140 (5 test-time inner steps).
        assert lake > 0.08, row
    assert "chance: 5-way 0.200, 20-way 0.050; 200 test episodes, 20 official runs" in out, out
