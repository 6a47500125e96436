"""Reptile-family trainers: closed forms on quadratic losses, reductions to plain
training, the inner optimizer reset, save/restore mid-trajectory, argument errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign import algorithms as A
from tf_metaalign import optimizers as O
from tf_metaalign.trainers import (
    FOMAMLTrainer,
    MultiTaskReptileTrainer,
    ReptileTrainer,
    SequentialReptileTrainer,
)

TOL = dict(rtol=1e-10, atol=1e-12)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] - 0.5 * x[:, 3]], axis=1)
    return x, y


def _linear(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]
    )


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


def _grad(params, x, y):
    """Gradient of mean((x W + b - y)^2) (Keras's MSE on a Dense(2)) at [W, b]."""
    w, b = params
    r = 2.0 * (x @ w + b - y) / y.size
    return [x.T @ r, r.sum(0)]


def _loss(params, x, y):
    w, b = params
    return float(np.mean((x @ w + b - y) ** 2))


def _assert_close(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **TOL)


# ------------------------------------------------------------------ Sequential Reptile


@pytest.mark.parametrize("k, eta", [(3, 0.5), (2, 0.75)])
def test_sequential_reptile_equals_its_closed_form(float64, k, eta):
    x, y = _data(48)
    trainer = SequentialReptileTrainer(_linear(1), inner_steps=k, outer_learning_rate=eta)
    trainer.compile(optimizer=keras.optimizers.SGD(0.125), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    theta, losses = [p.copy() for p in phi], []
    for step in range(6):
        xb, yb = x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8]
        losses.append(_loss(theta, xb, yb))
        theta = [t - 0.125 * g for t, g in zip(theta, _grad(theta, xb, yb))]
        if (step + 1) % k == 0:
            phi = [p + eta * (t - p) for p, t in zip(phi, theta)]
            theta = [p.copy() for p in phi]
    _assert_close(_weights(trainer.model), phi)
    _assert_close([v.numpy() for v in trainer.slow_weights], phi)
    assert int(trainer.schedule.count.numpy()) == 6
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)


def test_sequential_reptile_k1_eta1_is_plain_training(float64):
    x, y = _data(48)
    plain = _mlp(0)
    plain.compile(keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    trainer = SequentialReptileTrainer(_mlp(0), inner_steps=1, outer_learning_rate=1.0)
    trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _assert_close(_weights(trainer.model), _weights(plain))
    _assert_close(
        [v.numpy() for v in trainer.optimizer.variables],
        [v.numpy() for v in plain.optimizer.variables],
    )


def test_incomplete_trajectory_is_discarded_at_the_end_of_fit(float64):
    x, y = _data(56)  # 7 steps, k = 3: the 7th starts a trajectory that fit discards
    trainer = SequentialReptileTrainer(_linear(2), inner_steps=3, outer_learning_rate=0.5)
    trainer.compile(optimizer=keras.optimizers.SGD(0.125), loss="mse")
    val = _data(16, seed=9)
    history = trainer.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0)
    phi_6 = _weights(trainer.model)
    # Same start again, one more (discarded) step, with validation at the end of the epoch.
    other = SequentialReptileTrainer(_linear(2), inner_steps=3, outer_learning_rate=0.5)
    other.compile(optimizer=keras.optimizers.SGD(0.125), loss="mse")
    history = other.fit(x, y, batch_size=8, shuffle=False, verbose=0, validation_data=val)
    _assert_close(_weights(other.model), phi_6)
    _assert_close([v.numpy() for v in other.slow_weights], phi_6)
    assert int(other.schedule.count.numpy()) == 9  # the next trajectory starts at step 9
    # The validation inside fit (model holding theta_1 of the new trajectory) was at phi.
    np.testing.assert_allclose(history.history["val_loss"][0], _loss(phi_6, *val), **TOL)
    # Outside fit, evaluate reads the model's variables (phi after fit).
    np.testing.assert_allclose(other.evaluate(*val, verbose=0), _loss(phi_6, *val), **TOL)
    other.model.layers[0].kernel.assign(np.zeros((4, 2)))
    zero = [np.zeros((4, 2)), other.model.layers[0].bias.numpy()]
    np.testing.assert_allclose(other.evaluate(*val, verbose=0), _loss(zero, *val), **TOL)


def _keras_adam(params, grads, m, v, t, lr=0.125, b1=0.5, b2=0.75, eps=1e-7):
    """Keras's Adam update (keras/src/optimizers/adam.py) at 1-based step t."""
    alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    m = [mi + (g - mi) * (1 - b1) for mi, g in zip(m, grads)]
    v = [vi + (g * g - vi) * (1 - b2) for vi, g in zip(v, grads)]
    params = [p - alpha * mi / (np.sqrt(vi) + eps) for p, mi, vi in zip(params, m, v)]
    return params, m, v


@pytest.mark.parametrize("reset", [False, True])
def test_reset_inner_optimizer_zeroes_adams_slots_not_its_step(float64, reset):
    x, y = _data(48)
    k, eta = 2, 0.5
    trainer = SequentialReptileTrainer(
        _linear(3), inner_steps=k, outer_learning_rate=eta, reset_inner_optimizer=reset
    )
    trainer.compile(optimizer=keras.optimizers.Adam(0.125, beta_1=0.5, beta_2=0.75), loss="mse")
    phi = _weights(trainer.model)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    theta = [p.copy() for p in phi]
    m = [np.zeros_like(p) for p in phi]
    v = [np.zeros_like(p) for p in phi]
    for step in range(6):
        xb, yb = x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8]
        # t = the global step: the reset leaves `iterations` (bias correction) alone.
        theta, m, v = _keras_adam(theta, _grad(theta, xb, yb), m, v, t=step + 1)
        if (step + 1) % k == 0:
            phi = [p + eta * (t - p) for p, t in zip(phi, theta)]
            theta = [p.copy() for p in phi]
            if reset:
                m = [np.zeros_like(p) for p in phi]
                v = [np.zeros_like(p) for p in phi]
    _assert_close(_weights(trainer.model), phi)
    opt = trainer.optimizer
    assert int(opt.iterations.numpy()) == 6
    _assert_close([s.numpy() for s in opt._momentums], m)
    _assert_close([s.numpy() for s in opt._velocities], v)
    if reset:
        assert all(not np.any(s.numpy()) for s in opt._momentums + opt._velocities)


def test_reset_with_a_package_optimizer_zeroes_its_slots(float64):
    x, y = _data(32)
    trainer = SequentialReptileTrainer(
        _linear(3), inner_steps=2, outer_learning_rate=0.5, reset_inner_optimizer=True
    )
    trainer.compile(optimizer=O.Adam(0.125), loss="mse")
    trainer.fit(x[:24], y[:24], batch_size=8, shuffle=False, verbose=0)  # 3 steps: discard
    slots = [
        s
        for var in trainer.model.trainable_variables
        for s in trainer.optimizer.slots_for(var).values()
    ]
    assert slots and all(not np.any(s.numpy()) for s in slots)
    assert int(trainer.optimizer.iterations.numpy()) == 3
    assert float(trainer.optimizer.learning_rate_scale.numpy()) == 1.0


class _SaveAt(keras.callbacks.Callback):
    def __init__(self, batch, path):
        super().__init__()
        self.batch, self.path = batch, path

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.save_weights(self.path)


def test_save_and_restore_mid_trajectory_continues_identically(float64, tmp_path):
    x, y = _data(72)  # 9 steps, k = 3
    path = str(tmp_path / "mid.weights.h5")

    def make():
        t = SequentialReptileTrainer(_mlp(4), inner_steps=3, outer_learning_rate=0.5)
        t.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return t

    reference = make()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[_SaveAt(4, path)])
    resumed = make()
    resumed(x[:1])
    resumed.optimizer.build(resumed.model.trainable_variables)
    resumed.load_weights(path)  # after 5 steps: theta_2 of the second trajectory
    assert int(resumed.schedule.count.numpy()) == 5
    resumed.fit(x[40:], y[40:], batch_size=8, shuffle=False, verbose=0)
    _assert_close(_weights(resumed.model), _weights(reference.model))
    _assert_close(
        [v.numpy() for v in resumed.slow_weights], [v.numpy() for v in reference.slow_weights]
    )
    _assert_close(
        [v.numpy() for v in resumed.optimizer.variables],
        [v.numpy() for v in reference.optimizer.variables],
    )


def test_sequential_reptile_config_round_trip():
    trainer = SequentialReptileTrainer(
        _linear(), inner_steps=4, outer_learning_rate=0.25, reset_inner_optimizer=True
    )
    clone = SequentialReptileTrainer.from_config(trainer.get_config())
    assert (clone.inner_steps, clone.outer_learning_rate, clone.reset_inner_optimizer) == (
        4,
        0.25,
        True,
    )


# ------------------------------------------------------------- stacked Reptile / FOMAML


def _stacked(x, y, k, b, axis):
    """Rows -> elements of k batches of b: [k, b, ...] (axis 0) or [b, k, ...] (axis 1)."""
    n = len(x) // (k * b)
    xs = x[: n * k * b].reshape(n, k, b, -1)
    ys = y[: n * k * b].reshape(n, k, b, -1)
    if axis == 1:
        xs, ys = xs.transpose(0, 2, 1, 3), ys.transpose(0, 2, 1, 3)
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(1).map(lambda a, c: (a[0], c[0]))


@pytest.mark.parametrize("axis", [0, 1])
def test_reptile_with_outer_sgd_1_is_k_plain_sgd_steps(float64, axis):
    x, y = _data(48)
    plain = _mlp(5)
    plain.compile(keras.optimizers.SGD(0.125), loss="mse")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    trainer = ReptileTrainer(_mlp(5), inner_steps=3, inner_optimizer=0.125, stack_axis=axis)
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    trainer.fit(_stacked(x, y, 3, 8, axis), verbose=0, shuffle=False)
    _assert_close(_weights(trainer.model), _weights(plain))


def test_reptile_equals_its_closed_form(float64):
    x, y = _data(48)
    k, eps = 3, 0.25
    trainer = ReptileTrainer(_linear(6), inner_steps=k, inner_optimizer=O.SGD(0.125))
    trainer.compile(optimizer=keras.optimizers.SGD(eps), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(_stacked(x, y, k, 8, 0), verbose=0, shuffle=False)
    losses = []
    for element in range(2):
        theta = [p.copy() for p in phi]
        for i in range(k):
            s = 8 * (k * element + i)
            losses.append(_loss(theta, x[s : s + 8], y[s : s + 8]))
            theta = [t - 0.125 * g for t, g in zip(theta, _grad(theta, x[s : s + 8], y[s : s + 8]))]
        phi = [p + eps * (t - p) for p, t in zip(phi, theta)]
    _assert_close(_weights(trainer.model), phi)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)


def test_fomaml_equals_its_closed_form(float64):
    x, y = _data(64)
    k, lr = 3, 0.5
    trainer = FOMAMLTrainer(_linear(7), inner_steps=k, inner_optimizer=0.125, stack_axis=1)
    trainer.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(_stacked(x, y, k + 1, 8, 1), verbose=0, shuffle=False)
    query_losses = []
    for element in range(2):
        theta = [p.copy() for p in phi]
        for i in range(k):
            s = 8 * ((k + 1) * element + i)
            theta = [t - 0.125 * g for t, g in zip(theta, _grad(theta, x[s : s + 8], y[s : s + 8]))]
        s = 8 * ((k + 1) * element + k)
        query_losses.append(_loss(theta, x[s : s + 8], y[s : s + 8]))
        phi = [p - lr * g for p, g in zip(phi, _grad(theta, x[s : s + 8], y[s : s + 8]))]
    _assert_close(_weights(trainer.model), phi)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(query_losses), **TOL)


def test_inner_loop_keeps_nothing_on_the_outer_tape(float64):
    model = _linear(8)
    from tf_metaalign import functional as F

    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
    x, y = _data(16)
    phi = F.current_params(model)
    with tf.GradientTape() as tape:
        tape.watch(phi)
        r = A.inner_loop(
            loss_fn,
            phi,
            [],
            [(x[:8], y[:8]), (x[8:], y[8:])],
            O.SGD(0.1),
            model.trainable_variables,
        )
        total = tf.add_n([tf.reduce_sum(t) for t in r.params])
    assert all(g is None for g in tape.gradient(total, phi))


def test_stacked_trainers_config_round_trip():
    trainer = FOMAMLTrainer(_linear(), inner_steps=4, inner_optimizer=O.Adam(0.01), stack_axis=1)
    clone = FOMAMLTrainer.from_config(trainer.get_config())
    assert (clone.inner_steps, clone.stack_axis, clone.num_stacked) == (4, 1, 5)
    assert isinstance(clone.inner_optimizer, O.Adam)
    clone = ReptileTrainer.from_config(ReptileTrainer(_linear(), 2, 0.5).get_config())
    assert isinstance(clone.inner_optimizer, O.SGD) and clone.num_stacked == 2


# ------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(inner_steps=0, outer_learning_rate=1.0), "inner_steps"),
        (dict(inner_steps=2.0, outer_learning_rate=1.0), "inner_steps"),
        (dict(inner_steps=2, outer_learning_rate=0.0), "outer_learning_rate"),
        (dict(inner_steps=2, outer_learning_rate="1"), "outer_learning_rate"),
        (
            dict(inner_steps=2, outer_learning_rate=1.0, reset_inner_optimizer="yes"),
            "reset_inner_optimizer",
        ),
    ],
)
def test_sequential_reptile_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        SequentialReptileTrainer(_linear(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(inner_steps=-1), "inner_steps"),
        (dict(inner_steps=2, inner_optimizer=-0.1), "inner_optimizer"),
        (dict(inner_steps=2, inner_optimizer="adam"), "inner_optimizer"),
        (dict(inner_steps=2, inner_optimizer=keras.optimizers.SGD(0.1)), "inner_optimizer"),
        (dict(inner_steps=2, stack_axis=2), "stack_axis"),
    ],
)
@pytest.mark.parametrize("cls", [ReptileTrainer, FOMAMLTrainer])
def test_stacked_trainers_bad_arguments(cls, kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}"):
        cls(_linear(), **kwargs)


def test_wrongly_stacked_batches_name_the_layout(float64):
    x, y = _data(48)
    trainer = FOMAMLTrainer(_linear(), inner_steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"stack 4 batches along axis 0"):
        trainer.fit(_stacked(x, y, 3, 8, 0), verbose=0, shuffle=False)


# ------------------------------------------------------------------ multi-task Reptile


def _task_stacked(x, y, tasks, k, b, axis, task_ids=False):
    """Rows -> elements of T tasks of k batches of b: [T, k, b, ...] or [b, T, k, ...]."""
    n = len(x) // (tasks * k * b)
    xs = x[: n * tasks * k * b].reshape(n, tasks, k, b, -1)
    ys = y[: n * tasks * k * b].reshape(n, tasks, k, b, -1)
    if axis == 1:
        xs, ys = xs.transpose(0, 3, 1, 2, 4), ys.transpose(0, 3, 1, 2, 4)
    if task_ids:
        ids = np.broadcast_to(
            np.arange(tasks, dtype="int32")[None, :, None, None], (n, tasks, k, b)
        ).copy()
        if axis == 1:
            ids = ids.transpose(0, 3, 1, 2)
        xs = {"inputs": xs, "task_id": ids}
    return (
        tf.data.Dataset.from_tensor_slices((xs, ys))
        .batch(1)
        .map(lambda a, c: (tf.nest.map_structure(lambda t: t[0], a), c[0]))
    )


@pytest.mark.parametrize("axis, task_ids", [(0, False), (1, True)])
def test_multi_task_reptile_equals_its_closed_form(float64, axis, task_ids):
    x, y = _data(64)
    tasks, k, eps = 2, 2, 0.5
    trainer = MultiTaskReptileTrainer(
        _linear(9), inner_steps=k, inner_optimizer=0.125, stack_axis=axis
    )
    trainer.compile(optimizer=keras.optimizers.SGD(eps), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(
        _task_stacked(x, y, tasks, k, 8, axis, task_ids), verbose=0, shuffle=False
    )
    losses = []
    for element in range(2):
        ends = []
        for t in range(tasks):
            theta = [p.copy() for p in phi]
            for i in range(k):
                s = 8 * (k * (tasks * element + t) + i)
                losses.append(_loss(theta, x[s : s + 8], y[s : s + 8]))
                theta = [
                    w - 0.125 * g for w, g in zip(theta, _grad(theta, x[s : s + 8], y[s : s + 8]))
                ]
            ends.append(theta)
        mean = [np.mean([e[j] for e in ends], axis=0) for j in range(2)]
        phi = [p + eps * (m - p) for p, m in zip(phi, mean)]
    _assert_close(_weights(trainer.model), phi)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)
    assert int(trainer.outer_steps.numpy()) == 2


def test_multi_task_reptile_with_one_task_is_reptile(float64):
    x, y = _data(48)
    single = ReptileTrainer(_mlp(3), inner_steps=3, inner_optimizer=O.Adam(0.05))
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    single.fit(_stacked(x, y, 3, 8, 0), verbose=0, shuffle=False)
    multi = MultiTaskReptileTrainer(_mlp(3), inner_steps=3, inner_optimizer=O.Adam(0.05))
    multi.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    multi.fit(_task_stacked(x, y, 1, 3, 8, 0), verbose=0, shuffle=False)
    _assert_close(_weights(multi.model), _weights(single.model))


def test_multi_task_reptile_names_the_layout(float64):
    x, y = _data(48)
    trainer = MultiTaskReptileTrainer(_linear(), inner_steps=2)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"\[T, k, B, \.\.\.\] with a static T and k = 2"):
        trainer.fit(_task_stacked(x, y, 2, 3, 8, 0), verbose=0, shuffle=False)


def test_sequential_reptile_takes_multi_task_batches(float64):
    x, y = _data(48)
    ids = np.repeat(np.arange(6, dtype="int32") % 2, 8)
    results = []
    for as_dict in (False, True):
        trainer = SequentialReptileTrainer(_mlp(2), inner_steps=2, outer_learning_rate=0.5)
        trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        inputs = {"inputs": x, "task_id": ids} if as_dict else x
        history = trainer.fit(
            inputs, y, batch_size=8, shuffle=False, verbose=0, validation_data=(inputs, y)
        )
        results.append(
            (_weights(trainer.model), history.history, trainer.evaluate(inputs, y, verbose=0))
        )
    _assert_close(results[0][0], results[1][0])
    for key in results[0][1]:
        np.testing.assert_allclose(results[0][1][key], results[1][1][key], **TOL)
    np.testing.assert_allclose(results[0][2], results[1][2], **TOL)
