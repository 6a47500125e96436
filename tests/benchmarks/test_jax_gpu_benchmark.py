"""`benchmarks/jax_gpu.py` (JAX, no TensorFlow): its hand-written baselines are the
computations they claim to be, and the script runs and writes its JSON.

* The hand-written plain step == one step of Keras `fit` (same weights, batch and dropout
  seed state): the baseline that the trainers and `fit` are compared with does fit's work.
* The regulariser of the hand-written finite-difference DotProd step ~= that of the
  exact-HVP one (same direction, same size; a sign or units error in either would
  separate them).
* The script at `--small` with one window writes the JSON: every configuration ran or (a
  trainer) was skipped with its error; ratios finite; the targets judged.

JAX env only (the script imports no TensorFlow and needs JAX); slow: ~1-2 min on 2 cores.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends import on_jax

BACKENDS = ("tensorflow", "jax")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not on_jax(), reason="benchmarks/jax_gpu.py runs on the JAX backend"),
]


@pytest.fixture(scope="module")
def jax_gpu():
    from absl import flags

    sys.path.insert(0, str(ROOT))
    from benchmarks import jax_gpu

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["jax_gpu", "--small"])
    flags.FLAGS.small = True
    return jax_gpu


def _one_step(hand_written):
    batch = hand_written.batches[0]
    hand_written.state, loss = hand_written.step(hand_written.state, batch, 0)
    return [np.asarray(v) for v in hand_written.state[0]], batch


def test_hand_written_plain_step_is_one_fit_step(jax_gpu):
    hand = jax_gpu.HandWritten("jax_plain")
    weights, (x, y) = _one_step(hand)
    model = jax_gpu.transformer_classifier()  # same seed: same weights and seed state
    model.compile(optimizer=jax_gpu.optimizer(), loss=jax_gpu.loss_object())
    model.fit(np.asarray(x), np.asarray(y), batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    initial = [np.asarray(v) for v in jax_gpu.transformer_classifier().trainable_variables]
    moved = 0
    for a, b, w0 in zip(weights, model.trainable_variables, initial):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
        moved += int(np.any(a != w0))
    assert moved == len(weights)  # every variable took the step


def test_finite_difference_dotprod_step_close_to_exact(jax_gpu, monkeypatch):
    import keras

    # SGD(1): the update is minus the gradient the step hands the optimizer.
    monkeypatch.setattr(jax_gpu, "optimizer", lambda: keras.optimizers.SGD(1.0))

    def gradient(config, weight):
        monkeypatch.setattr(jax_gpu, "DOTPROD_WEIGHT", weight)
        hand = jax_gpu.HandWritten(config)
        before = [np.asarray(v) for v in hand.state[0]]
        after, _ = _one_step(hand)
        return np.concatenate([(b - a).ravel() for a, b in zip(after, before)])

    pair = gradient("jax_dotprod_fd", 0.0)  # G1 + G2: the regulariser off
    reg_fd = gradient("jax_dotprod_fd", 0.1) - pair  # s * 0.1 * (G21 - G2) / alpha
    reg_exact = gradient("jax_dotprod_exact", 0.1) - pair  # s * 0.1 * (-H2 G1)
    cos = float(reg_fd @ reg_exact / (np.linalg.norm(reg_fd) * np.linalg.norm(reg_exact)))
    ratio = float(np.linalg.norm(reg_fd) / np.linalg.norm(reg_exact))
    assert np.linalg.norm(reg_exact) > 1e-3 * np.linalg.norm(pair)  # a regulariser to compare
    assert cos > 0.98 and 0.8 < ratio < 1.25, (cos, ratio)


def test_script_writes_its_json(tmp_path):
    out = tmp_path / "jax_gpu.json"
    configs = "fit,jax_plain,jax_sam,trainer_sam"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.jax_gpu",
            "--small",
            "--windows=1",
            f"--configs={configs}",
            f"--output={out}",
        ],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tensorflow_imported"] is False
    assert list(result["results"]) == configs.split(",")
    for name in ("fit", "jax_plain", "jax_sam"):
        r = result["results"][name]
        assert (
            r["status"] == "ran" and math.isfinite(r["median_step_ms"]) and r["median_step_ms"] > 0
        )
    ratio = result["results"]["jax_plain"]["comparisons"][0]
    assert ratio["reference"] == "fit" and math.isfinite(ratio["ratio"]) and ratio["ratio"] > 0
    sam = result["results"]["trainer_sam"]
    if sam["status"] == "ran":  # SAMTrainer on JAX: judged against the hand-written SAM
        (c,) = sam["comparisons"]
        assert c["reference"] == "jax_sam" and c["target"] == 1.05 and "pass" in c
        assert result["targets_judged"] == 1
    else:
        assert sam["status"] in ("not ported", "failed") and sam["error"]
    assert "jax_plain" in result["table"]
