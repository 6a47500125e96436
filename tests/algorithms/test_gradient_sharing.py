"""algorithms.GradientSharing on its own: the shared direction (normalised sum over every
replica's tasks), the g_hat rule, the meta-test rule (Algorithm 2) and the trainer's
evaluate with the stored g_hat, against NumPy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign.algorithms import GradientSharing
from tf_metaalign.trainers import MAMLTrainer


def _sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def _grads(rng, tasks, shapes=((3, 2), (2,))):
    return [[rng.normal(size=s) for s in shapes] for _ in range(tasks)]


def _tf(grads):
    return [[tf.constant(g) for g in task] for task in grads]


def test_step_equals_numpy():
    rng = np.random.default_rng(0)
    grads = _grads(rng, 3)
    g_hat = [rng.normal(size=g.shape) for g in grads[0]]
    m, lam = 0.7, -0.4
    s = GradientSharing().step(
        _tf(grads),
        tf.constant(m, tf.float64),
        tf.constant(lam, tf.float64),
        [tf.constant(h) for h in g_hat],
        initialized=True,
    )
    total = [sum(t[i] for t in grads) for i in range(2)]
    norm = np.sqrt(sum(np.sum(x * x) for x in total))
    g = [x / norm for x in total]
    want_hat = [_sig(m) * a + (1 - _sig(m)) * b for a, b in zip(g, g_hat)]
    for a, b in zip(s.g, g):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12)
    for a, b in zip(s.g_hat, want_hat):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12)
    for task, delta in zip(grads, s.deltas):
        for gt, h, d in zip(task, want_hat, delta):
            np.testing.assert_allclose(d.numpy(), _sig(lam) * h + (1 - _sig(lam)) * gt, rtol=1e-12)
    # i = 1: g_hat = g (m unused).
    first = GradientSharing().step(
        _tf(grads),
        tf.constant(m, tf.float64),
        tf.constant(lam, tf.float64),
        [tf.constant(h) for h in g_hat],
        initialized=False,
    )
    for a, b in zip(first.g_hat, g):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12)


def test_zero_sum_gives_a_zero_direction_not_nan():
    grads = [[tf.constant([1.0, -2.0])], [tf.constant([-1.0, 2.0])]]
    g = GradientSharing.shared_direction(grads)
    np.testing.assert_array_equal(g[0].numpy(), [0.0, 0.0])


def test_meta_test_rule_uses_the_stored_g_hat():
    rng = np.random.default_rng(1)
    grads = _grads(rng, 2)
    g_hat = [rng.normal(size=g.shape) for g in grads[0]]
    lam = 0.3
    deltas = GradientSharing().test_deltas(
        _tf(grads), tf.constant(lam, tf.float64), [tf.constant(h) for h in g_hat]
    )
    for task, delta in zip(grads, deltas):
        for gt, h, d in zip(task, g_hat, delta):
            np.testing.assert_allclose(d.numpy(), _sig(lam) * h + (1 - _sig(lam)) * gt, rtol=1e-12)
    # Never trained: g_hat is taken as 0.
    deltas = GradientSharing().test_deltas(
        _tf(grads),
        tf.constant(lam, tf.float64),
        [tf.constant(h) for h in g_hat],
        initialized=tf.constant(False),
    )
    for task, delta in zip(grads, deltas):
        for gt, d in zip(task, delta):
            np.testing.assert_allclose(d.numpy(), (1 - _sig(lam)) * gt, rtol=1e-12)


def test_the_shared_direction_sums_every_replicas_tasks():
    rng = np.random.default_rng(2)
    grads = _grads(rng, 4)
    want = GradientSharing.shared_direction(_tf(grads))
    strategy = two_cpu_strategy()

    def per_replica(ctx):
        r = ctx.replica_id_in_sync_group
        mine = tf.gather(
            tf.stack(
                [
                    tf.stack([tf.constant(t[0]) for t in grads[:2]]),
                    tf.stack([tf.constant(t[0]) for t in grads[2:]]),
                ]
            ),
            r,
        )
        mine_b = tf.gather(
            tf.stack(
                [
                    tf.stack([tf.constant(t[1]) for t in grads[:2]]),
                    tf.stack([tf.constant(t[1]) for t in grads[2:]]),
                ]
            ),
            r,
        )
        return GradientSharing.shared_direction([[mine[0], mine_b[0]], [mine[1], mine_b[1]]])

    got = strategy.run(tf.function(lambda: per_replica(tf.distribute.get_replica_context())))
    for i in range(2):
        for value in strategy.experimental_local_results(got[i]):
            np.testing.assert_allclose(value.numpy(), want[i].numpy(), rtol=1e-12)


def test_config_round_trip_and_errors():
    s = GradientSharing(initial_m=0.5, initial_lambda=float("-inf"))
    assert GradientSharing.from_config(s.get_config()).get_config() == s.get_config()
    with pytest.raises(ValueError, match="initial_m"):
        GradientSharing(initial_m="0")


def test_trainer_evaluate_uses_the_stored_g_hat(float64):
    rng = np.random.default_rng(3)
    sx, sy = rng.normal(size=(4, 5, 4)), rng.normal(size=(4, 5, 2))
    qx, qy = rng.normal(size=(4, 5, 4)), rng.normal(size=(4, 5, 2))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    trainer = MAMLTrainer(
        model,
        inner_steps=2,
        inner_learning_rate=0.2,
        gradient_sharing=GradientSharing(initial_lambda=0.5),
    )
    trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    data = tf.data.Dataset.from_tensor_slices(((sx, sy, qx), qy)).batch(2, drop_remainder=True)
    trainer.fit(data, verbose=0)
    g_hat_before = [[v.numpy() for v in trainer.weights_copy(f"g_hat_{k}")] for k in range(2)]
    loss = trainer.evaluate(data, verbose=0)
    # NumPy Algorithm 2 for a linear model with Keras's MSE.
    lam = trainer.sharing_lambda.numpy()
    losses = []
    for t in range(4):
        theta = [v.numpy() for v in model.trainable_variables]
        for k in range(2):
            w, b = theta
            r = 2.0 * (sx[t] @ w + b - sy[t]) / sy[t].size
            grad = [sx[t].T @ r, r.sum(0)]
            theta = [
                p - 0.2 * (_sig(lam[k]) * h + (1 - _sig(lam[k])) * g)
                for p, h, g in zip(theta, g_hat_before[k], grad)
            ]
        losses.append(np.mean((qx[t] @ theta[0] + theta[1] - qy[t]) ** 2))
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-10)
    # evaluate neither changes g_hat nor anything else.
    for k in range(2):
        for v, h in zip(trainer.weights_copy(f"g_hat_{k}"), g_hat_before[k]):
            np.testing.assert_array_equal(v.numpy(), h)
