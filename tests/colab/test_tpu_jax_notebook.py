"""colab/tpu_jax.ipynb (the TPU recipe on Keras's JAX backend) executed top to bottom, offline,
in a fresh kernel whose KERAS_BACKEND is jax and which sees two host CPU devices, within a
time budget, and showing what it exists to show: the accelerator found, DataParallel over
every device, SAMTrainer and MultiTaskTrainer (PCGrad) learning from NumPy arrays (held-out
scores well above chance), and the user's models saved and reloaded as themselves with the
same predictions.

It needs JAX (the JAX test env, `.venv-jax`, no TensorFlow); in the TensorFlow env, which has
no JAX, the run is skipped (the stored-file check runs in both). About 40-90 s on 2 CPU cores.
"""

import os
import re
import time

import pytest

import notebook_lib as NB

BACKENDS = ("tensorflow", "jax")

NOTEBOOK = NB.ROOT / "colab" / "tpu_jax.ipynb"
#: Budget for 2 shared CPU cores (kernel start and JAX compilation included).
BUDGET_S = 180
HOST_DEVICES = 2
NUMBER = r"[-+]?\d+\.\d+(?:e[-+]?\d+)?"


@pytest.fixture(scope="module")
def executed():
    pytest.importorskip(
        "jax", reason="the notebook runs on Keras's JAX backend: run it in the JAX env (.venv-jax)"
    )
    nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")
    pytest.importorskip("ipykernel", reason="pip install ipykernel")
    # (notebook_lib.execute also needs matplotlib, which this notebook does not use and the
    # JAX env does not have.) The kernel: the JAX backend, two host devices for DataParallel.
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={HOST_DEVICES}".strip()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NB.ROOT)}}
    ).execute(env=env)
    return nb, time.perf_counter() - start


def test_notebook_is_stored_without_outputs():
    NB.check_stored_without_outputs(NOTEBOOK)
    text = NOTEBOOK.read_text()
    assert "tensorflow as tf" not in text and "import tensorflow" not in text


def test_runs_offline_within_budget_without_python_warnings(executed):
    NB.check_ran_cleanly(*executed, BUDGET_S)


def test_finds_the_devices_and_shards_over_all_of_them(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "platform = jax.devices()[0].platform"))
    assert re.search(rf"on jax; accelerator: cpu, {HOST_DEVICES} device\(s\)", out), out
    out = NB.stdout(NB.cell(nb, "keras.distribution.set_distribution("))
    assert f"DataParallel over {HOST_DEVICES} device(s)" in out, out


def test_sam_and_pcgrad_learn_from_numpy(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "trainer = SAMTrainer(model"))
    accuracy = float(re.search(rf"test accuracy ({NUMBER})", out).group(1))
    gap = float(re.search(rf"surrogate gap ({NUMBER})", out).group(1))
    # 3 balanced-ish classes (chance ~0.33); a linear teacher an MLP learns in 8 epochs.
    assert accuracy > 0.85 and gap == gap, out
    out = NB.stdout(NB.cell(nb, 'MultiTaskTrainer(mt_model, method="pcgrad")'))
    accuracy = float(re.search(rf"label accuracy ({NUMBER})", out).group(1))
    mse = float(re.search(rf"target mse ({NUMBER})", out).group(1))
    variance = float(re.search(rf"target variance ({NUMBER})", out).group(1))
    assert accuracy > 0.8 and mse < 0.2 * variance, out


def test_models_reload_as_themselves(executed):
    nb, _ = executed
    out = NB.stdout(NB.cell(nb, "keras.saving.load_model(path)"))
    lines = [l for l in out.splitlines() if "reloaded as" in l]
    assert len(lines) == 2, out
    assert (
        "sam_model: reloaded as Sequential" in out
        and "multitask_model: reloaded as Functional" in out
    ), out
    for line in lines:
        assert float(re.search(rf"difference\| ({NUMBER})", line).group(1)) == 0.0, line
