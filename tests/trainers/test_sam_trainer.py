"""SAMTrainer / GSAMTrainer under tf.distribute (TensorFlow only): 1 replica == 2, and
m-sharpness per replica. The backend-neutral tests (NumPy oracles, TensorFlow == JAX golden
trajectories, state, precision, save/load, JAX devices) are in test_sam_backends.py."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from test_sam import data64, mlp64, np_sam_direction
from test_sam_backends import _compile, _numpy_sgd, _weights
from tf_metaalign.trainers import GSAMTrainer, SAMTrainer


@pytest.mark.parametrize("every", [1, 2])
def test_one_replica_equals_two(float64, every):
    x, y = data64(32, seed=5)
    single = _compile(GSAMTrainer(mlp64(seed=10), rho=0.2, alpha=0.2, every=every))
    h1 = single.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    strategy = two_cpu_strategy()
    with strategy.scope():
        double = _compile(GSAMTrainer(mlp64(seed=10), rho=0.2, alpha=0.2, every=every))
    h2 = double.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    for a, b in zip(_weights(single.model), _weights(double.model)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for key in ("loss", "grad_norm", "surrogate_gap"):  # float32 metrics
        np.testing.assert_allclose(h1.history[key], h2.history[key], rtol=1e-6)


def test_m_sharpness_perturbs_each_replica_along_its_own_shard(float64):
    """Two replicas, m_sharpness=True: the step is the mean of the two shards' SAM
    directions (each perturbed along its own gradient); the global rule differs."""
    x, y = data64(16, seed=6)
    strategy = two_cpu_strategy()
    with strategy.scope():
        trainer = _compile(SAMTrainer(mlp64(seed=11), rho=0.3, m_sharpness=True))
    w0 = _weights(trainer.model)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    w = [a.copy() for a in w0]
    for s in (0, 8):
        shards = [
            np_sam_direction(w, x[s + r : s + r + 4], y[s + r : s + r + 4], 0.3) for r in (0, 4)
        ]
        w = [a - 0.1 * (b + c) / 2 for a, b, c in zip(w, *shards)]
    for a, b in zip(_weights(trainer.model), w):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    global_rule = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: True, rho=0.3)
    assert not all(np.allclose(a, b, rtol=1e-6) for a, b in zip(w, global_rule))
