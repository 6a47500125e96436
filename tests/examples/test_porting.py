"""Porting a hand-written meta-learning loop onto the trainers (docs/porting.md).

* `inner_training`: with False the trainers' steps equal a hand-written GradientTape loop
  calling `model(x, training=False)` (BatchNorm on moving statistics); with True (the
  default) the same loop with `training=True`. MAML against nested tapes over explicit
  ops (an independent re-derivation of BatchNorm in both modes).
* the stacked elements of ReptileTrainer / FOMAMLTrainer: `stacked_batches` /
  `stack_task`, and the rank check naming `[k, B, *input_shape]`.
* `MAMLTrainer.adapt`: one task without its task axis, a missing feature axis,
  `inner_steps=0` (the unadapted score).
* last batches: what trains, what is refused up front, on one and two replicas.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign import optimizers as O
from tf_metaalign.data import EpisodeSampler, stack_task, stacked_batches
from tf_metaalign.trainers import (
    FOMAMLTrainer,
    MAMLTrainer,
    MultiTaskReptileTrainer,
    PromptFOMAMLTrainer,
    PromptReptileTrainer,
    ReptileTrainer,
    SequentialReptileTrainer,
)

TOL = dict(rtol=1e-9, atol=1e-12)


def _bn_model(seed=0):
    """Dense -> BatchNorm -> tanh -> Dense, with moving statistics far from (0, 1), so
    that moving and batch statistics give different steps."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(2),
        ]
    )
    bn = model.layers[1]
    bn.moving_mean.assign(np.linspace(-0.5, 0.5, 5))
    bn.moving_variance.assign(np.linspace(0.5, 2.0, 5))
    return model


def _stack(k, b, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(k, b, 4)), rng.normal(size=(k, b, 2))


def _hand_loop(model, batches, lr, training):
    """A keras-io style inner loop: a copy of the model, `copy(x, training=...)` under a
    GradientTape, plain SGD on its variables. Returns the copy."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    mse = keras.losses.MeanSquaredError()
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = mse(y, copy(x, training=training))
        grads = tape.gradient(loss, copy.trainable_variables)
        for v, g in zip(copy.trainable_variables, grads):
            v.assign_sub(lr * g)
    return copy


def _statistics(model):
    bn = model.layers[1]
    return [bn.moving_mean.numpy(), bn.moving_variance.numpy()]


# ------------------------------------------------------------ inner_training (stacked)


@pytest.mark.parametrize("training", [False, True])
def test_reptile_step_equals_a_hand_loop_with_the_same_batch_norm_mode(float64, training):
    xs, ys = _stack(3, 6, seed=1)
    model = _bn_model(2)
    phi = [v.numpy() for v in model.trainable_variables]
    before = _statistics(model)
    hand = _hand_loop(model, list(zip(xs, ys)), 0.25, training)
    trainer = ReptileTrainer(model, inner_steps=3, inner_optimizer=0.25, inner_training=training)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    trainer.fit(tf.data.Dataset.from_tensors((xs, ys)), verbose=0)
    for v, p, t in zip(model.trainable_variables, phi, hand.trainable_variables):
        np.testing.assert_allclose(v.numpy(), p + 0.5 * (t.numpy() - p), **TOL)
    for got, want, old in zip(_statistics(model), _statistics(hand), before):
        np.testing.assert_allclose(got, want, **TOL)
        if not training:  # moving statistics are read, never updated
            np.testing.assert_array_equal(got, old)


@pytest.mark.parametrize("training", [False, True])
def test_fomaml_step_equals_a_hand_loop_with_the_same_batch_norm_mode(float64, training):
    xs, ys = _stack(3, 6, seed=3)  # 2 inner batches + the query batch
    model = _bn_model(4)
    phi = [v.numpy() for v in model.trainable_variables]
    hand = _hand_loop(model, list(zip(xs[:2], ys[:2])), 0.25, training)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(ys[2], hand(xs[2], training=training))
    grads = tape.gradient(loss, hand.trainable_variables)
    trainer = FOMAMLTrainer(model, inner_steps=2, inner_optimizer=0.25, inner_training=training)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    history = trainer.fit(tf.data.Dataset.from_tensors((xs, ys)), verbose=0)
    for v, p, g in zip(model.trainable_variables, phi, grads):
        np.testing.assert_allclose(v.numpy(), p - 0.5 * g.numpy(), **TOL)
    np.testing.assert_allclose(history.history["loss"][0], float(loss), rtol=1e-9)
    for got, want in zip(_statistics(model), _statistics(hand)):
        np.testing.assert_allclose(got, want, **TOL)


def test_the_batch_norm_mode_changes_the_step(float64):
    xs, ys = _stack(2, 6, seed=5)
    out = []
    for training in (True, False):
        trainer = ReptileTrainer(
            _bn_model(6), inner_steps=2, inner_optimizer=0.25, inner_training=training
        )
        trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        trainer.fit(tf.data.Dataset.from_tensors((xs, ys)), verbose=0)
        out.append(trainer.model.layers[0].kernel.numpy())
    assert np.abs(out[0] - out[1]).max() > 1e-3


def test_inner_training_is_checked_and_saved():
    with pytest.raises(ValueError, match="inner_training"):
        ReptileTrainer(_bn_model(), inner_steps=2, inner_training="moving")
    with pytest.raises(ValueError, match="inner_training"):
        MAMLTrainer(_bn_model(), inner_training=0)
    trainer = FOMAMLTrainer(_bn_model(), inner_steps=2, inner_training=False)
    assert FOMAMLTrainer.from_config(trainer.get_config()).inner_training is False
    maml = MAMLTrainer(_bn_model(), inner_training=False)
    assert maml.transductive_evaluation is False  # evaluation follows training's passes
    again = MAMLTrainer.from_config(maml.get_config())
    assert again.inner_training is False and again.transductive_evaluation is False
    assert MAMLTrainer(_bn_model()).transductive_evaluation is True
    assert (
        MAMLTrainer(
            _bn_model(), inner_training=False, transductive_evaluation=True
        ).transductive_evaluation
        is True
    )


# ---------------------------------------------------------------- inner_training (MAML)


def _explicit_forward(params, x, moving, training, eps=1e-3):
    """The BN model's forward pass as explicit ops (BatchNorm re-derived)."""
    w1, b1, gamma, beta, w2, b2 = params
    h = tf.matmul(x, w1) + b1
    if training:
        mean = tf.reduce_mean(h, 0)
        var = tf.reduce_mean(tf.square(h - mean), 0)
    else:
        mean, var = moving
    h = (h - mean) / tf.sqrt(var + eps) * gamma + beta
    return tf.matmul(tf.tanh(h), w2) + b2


def _maml_tasks(tasks=2, seed=8):
    rng = np.random.default_rng(seed)
    return (
        (
            rng.normal(size=(tasks, 6, 4)),
            rng.normal(size=(tasks, 6, 2)),
            rng.normal(size=(tasks, 5, 4)),
        ),
        rng.normal(size=(tasks, 5, 2)),
    )


@pytest.mark.parametrize("training", [False, True])
def test_maml_step_equals_nested_tapes_over_explicit_ops(float64, training):
    (sx, sy, qx), qy = _maml_tasks()
    model = _bn_model(9)
    phi = [tf.constant(v.numpy()) for v in model.trainable_variables]
    moving = [tf.constant(s) for s in _statistics(model)]
    alpha, beta = 0.3, 0.5

    def mse(p, x, y):
        return tf.reduce_mean(tf.square(_explicit_forward(p, x, moving, training) - y))

    with tf.GradientTape() as outer:
        outer.watch(phi)
        losses = []
        for t in range(2):
            with tf.GradientTape() as inner:
                inner.watch(phi)
                support = mse(phi, sx[t], sy[t])
            grads = inner.gradient(support, phi)
            adapted = [p - alpha * g for p, g in zip(phi, grads)]
            losses.append(mse(adapted, qx[t], qy[t]))
        meta = tf.add_n(losses) / 2.0
    meta_grads = outer.gradient(meta, phi)
    trainer = MAMLTrainer(model, inner_steps=1, inner_learning_rate=alpha, inner_training=training)
    trainer.compile(optimizer=keras.optimizers.SGD(beta), loss="mse")
    history = trainer.fit(tf.data.Dataset.from_tensors(((sx, sy, qx), qy)), verbose=0)
    for v, p, g in zip(model.trainable_variables, phi, meta_grads):
        np.testing.assert_allclose(v.numpy(), p.numpy() - beta * g.numpy(), **TOL)
    np.testing.assert_allclose(history.history["loss"][0], float(meta), rtol=1e-9)
    if not training:
        for got, want in zip(_statistics(model), moving):
            np.testing.assert_array_equal(got, want.numpy())


# ----------------------------------------------------------------- mean vs sum (scale)


def test_a_summing_hand_loop_is_matched_by_the_learning_rate_factor_or_a_sum_loss(float64):
    """keras-io's loop differentiates the per-example loss VECTOR: the gradient of the
    SUM over the B examples. The trainers use the compiled loss (a mean): inner SGD at
    B * lr, or a compiled loss with reduction="sum" at lr, is the hand loop."""
    xs, ys = _stack(3, 6, seed=11)
    model = _bn_model(12)
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    for x, y in zip(xs, ys):  # the hand loop, summing
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y, copy(x))
        grads = tape.gradient(per_example, copy.trainable_variables)
        for v, g in zip(copy.trainable_variables, grads):
            v.assign_sub(0.03125 * g)
    for lr, loss in (
        (6 * 0.03125, "mse"),
        (0.03125, keras.losses.MeanSquaredError(reduction="sum")),
    ):
        m = _bn_model(12)
        trainer = ReptileTrainer(m, inner_steps=3, inner_optimizer=lr, inner_training=False)
        trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
        trainer.fit(tf.data.Dataset.from_tensors((xs, ys)), verbose=0)
        for v, t in zip(m.trainable_variables, copy.trainable_variables):
            np.testing.assert_allclose(v.numpy(), t.numpy(), **TOL)


def test_maml_summing_over_tasks_with_adam_is_adam_with_epsilon_over_t(float64):
    """A hand MAML loop that SUMS the query losses of its T tasks hands Adam T times the
    trainer's gradient (a mean over tasks): Adam's step is the same up to epsilon, which
    acts as epsilon / T; Adam(epsilon=eps / T) on the trainer is the hand loop."""
    (sx, sy, qx), qy = _maml_tasks(tasks=2, seed=13)
    model = _bn_model(14)
    moving = [tf.constant(s) for s in _statistics(model)]
    eps, lr = 0.05, 0.01  # a large epsilon: the difference is visible
    params = [tf.Variable(v.numpy()) for v in model.trainable_variables]

    def mse(p, x, y):
        return tf.reduce_mean(tf.square(_explicit_forward(p, x, moving, True) - y))

    hand_adam = keras.optimizers.Adam(lr, epsilon=eps)
    for _ in range(2):  # two meta-steps: Adam's state matters too
        with tf.GradientTape() as outer:
            total = 0.0
            for t in range(2):
                with tf.GradientTape() as inner:
                    support = mse(params, sx[t], sy[t])
                grads = inner.gradient(support, params)
                total += mse([p - 0.3 * g for p, g in zip(params, grads)], qx[t], qy[t])
        hand_adam.apply_gradients(zip(outer.gradient(total, params), params))
    data = tf.data.Dataset.from_tensors(((sx, sy, qx), qy)).repeat(2)
    results = {}
    for name, epsilon in (("eps/T", eps / 2), ("eps", eps)):
        trainer = MAMLTrainer(_bn_model(14), inner_steps=1, inner_learning_rate=0.3)
        trainer.compile(optimizer=keras.optimizers.Adam(lr, epsilon=epsilon), loss="mse")
        trainer.fit(data, verbose=0)
        results[name] = [v.numpy() for v in trainer.model.trainable_variables]
    for got, want in zip(results["eps/T"], params):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-8, atol=1e-12)
    assert max(np.abs(a - b.numpy()).max() for a, b in zip(results["eps"], params)) > 1e-5


# -------------------------------------------------------------------- stacked elements


def _conv_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(2, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def test_an_unstacked_batch_is_named_with_the_expected_shape():
    trainer = ReptileTrainer(_conv_model(), inner_steps=3, inner_optimizer=0.1)
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    x, y = np.zeros((6, 8, 8, 1), "float32"), np.zeros((6, 3), "float32")
    with pytest.raises(ValueError, match=r"\[k=3, B, \*input_shape\] = \[k=3, B, 8, 8, 1\]"):
        trainer.fit(x, y, batch_size=2, verbose=0)
    fomaml = FOMAMLTrainer(_conv_model(), inner_steps=2, inner_optimizer=0.1, stack_axis=1)
    fomaml.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    with pytest.raises(ValueError, match=r"\[B, k=3, 8, 8, 1\].*stacked_batches"):
        fomaml.fit(tf.data.Dataset.from_tensors((x, y)), verbose=0)
    # Stacked twice (rank + 2): named too.
    twice = tf.data.Dataset.from_tensors(
        (np.zeros((1, 3, 2, 8, 8, 1), "float32"), np.zeros((1, 3, 2, 3), "float32"))
    )
    with pytest.raises(ValueError, match=r"rank 5"):
        trainer.fit(twice, verbose=0)


def test_a_non_static_number_of_stacked_batches_is_refused():
    trainer = ReptileTrainer(_conv_model(), inner_steps=3, inner_optimizer=0.1)
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    rows = tf.data.Dataset.from_tensor_slices(
        (np.zeros((14, 2, 8, 8, 1), "float32"), np.zeros((14, 2, 3), "float32"))
    )
    with pytest.raises(ValueError, match="drop_remainder=True"):
        trainer.fit(rows.batch(3), verbose=0)  # 14 = 4 * 3 + 2: the shape is [None, ...]


def test_stack_task_makes_passes_in_fresh_orders():
    x = np.arange(7)[:, None] * np.ones((1, 3))
    y = np.arange(7)
    xs, ys = stack_task(x, y, num_batches=3, batch_size=4, rng=np.random.default_rng(0))
    assert xs.shape == (3, 4, 3) and ys.shape == (3, 4)
    flat = ys.reshape(-1)
    assert sorted(flat[:7]) == list(range(7))  # the first pass: every example once
    assert len(set(flat[7:])) == 5  # the second pass starts over, without repeats
    np.testing.assert_array_equal(xs[..., 0], ys)  # x and y stay paired
    in_order, _ = stack_task(x, y, 2, 4)
    np.testing.assert_array_equal(in_order[..., 0].reshape(-1), [0, 1, 2, 3, 4, 5, 6, 0])
    axis1, _ = stack_task(x, y, 3, 4, np.random.default_rng(0), stack_axis=1)
    np.testing.assert_array_equal(axis1, np.swapaxes(xs, 0, 1))
    with pytest.raises(ValueError, match="same number of examples"):
        stack_task(x, y[:3], 2, 2)


def test_stacked_batches_from_a_callable_train_a_reptile_trainer(float64):
    def task(i):
        rng = np.random.default_rng([99, i])
        return rng.normal(size=(10, 4)), rng.normal(size=(10, 2))

    ds = stacked_batches(task, num_batches=3, batch_size=4, num_elements=2, seed=5)
    assert ds.element_spec[0].shape == (3, 4, 4) and ds.element_spec[1].shape == (3, 4, 2)
    got = list(ds.as_numpy_iterator())
    for i, (xs, ys) in enumerate(got):
        want = stack_task(*task(i), 3, 4, np.random.default_rng([5, i]))
        np.testing.assert_array_equal(xs, want[0])
        np.testing.assert_array_equal(ys, want[1])
    resumed = list(stacked_batches(task, 3, 4, num_elements=1, seed=5, start=1).as_numpy_iterator())
    np.testing.assert_array_equal(resumed[0][0], got[1][0])
    # The elements are what ReptileTrainer takes: its steps equal stepping by hand.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    phi = [v.numpy() for v in model.trainable_variables]
    hand = _hand_loop(model, list(zip(got[0][0], got[0][1])), 0.25, True)
    trainer = ReptileTrainer(model, inner_steps=3, inner_optimizer=0.25)  # exact in float32
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    trainer.fit(ds.take(1), verbose=0)
    for v, t in zip(model.trainable_variables, hand.trainable_variables):
        np.testing.assert_allclose(v.numpy(), t.numpy(), **TOL)
    assert any(np.abs(v.numpy() - p).max() > 0 for v, p in zip(model.trainable_variables, phi))


def test_stacked_batches_from_an_episode_sampler():
    rng = np.random.default_rng(0)
    classes = {f"c{c}": rng.normal(size=(6, 2)).astype("float32") + 10 * c for c in range(5)}
    sampler = EpisodeSampler(classes, ways=3, shots=2, queries=1, tasks_per_batch=2, seed=4)
    ds = stacked_batches(sampler, num_batches=4, batch_size=3, num_elements=4, stack_axis=1)
    assert ds.element_spec[0].shape == (3, 4, 2) and ds.element_spec[1].shape == (3, 4)
    for i, (xs, ys) in enumerate(ds.as_numpy_iterator()):
        (sx, sy, _), _ = sampler.batch(i // 2)
        pool = {tuple(r) + (int(l),) for r, l in zip(sx[i % 2].numpy(), sy[i % 2].numpy())}
        drawn = {tuple(r) + (int(l),) for r, l in zip(xs.reshape(-1, 2), ys.reshape(-1))}
        assert drawn == pool  # 12 draws from the 6 support examples: each, twice
    with pytest.raises(ValueError, match="task_sampler"):
        stacked_batches([1, 2], 2, 2)


# ------------------------------------------------------------------- MAMLTrainer.adapt


def _sinusoid_trainer(**kwargs):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    trainer = MAMLTrainer(model, inner_steps=1, inner_learning_rate=0.01, **kwargs)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return trainer


def test_adapt_refuses_one_task_without_its_task_axis():
    trainer = _sinusoid_trainer()
    x = np.linspace(-5, 5, 10, dtype="float32")[:, None]
    with pytest.raises(ValueError, match=r"ONE task.*support_x\[None\]"):
        trainer.adapt(x, np.sin(x))  # [10, 1]: not ten one-example tasks
    with pytest.raises(ValueError, match=r"feature axis.*support_x\[\.\.\., None\]"):
        trainer.adapt(np.zeros((25, 10), "float32"), np.zeros((25, 10), "float32"))
    with pytest.raises(ValueError, match="support_y"):
        trainer.adapt(x[None], np.sin(x))
    adapted = trainer.adapt(x[None], np.sin(x)[None])
    assert len(adapted) == 1
    model = trainer.model
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(np.sin(x), model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    for a, v, g in zip(adapted[0], model.trainable_variables, grads):
        np.testing.assert_allclose(a.numpy(), v.numpy() - 0.01 * g.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sharing", [False, True], ids=["maml", "gradient_sharing"])
def test_zero_inner_steps_is_the_unadapted_score(sharing):
    trainer = _sinusoid_trainer(gradient_sharing=True if sharing else None)
    model = trainer.model
    rng = np.random.default_rng(3)
    sx, qx = rng.uniform(-5, 5, (4, 10, 1)), rng.uniform(-5, 5, (4, 7, 1))
    sy, qy = np.sin(sx), np.sin(qx)
    theta = trainer.adapt(sx, sy, inner_steps=0)
    assert len(theta) == 4
    for weights in theta:
        for a, v in zip(weights, model.trainable_variables):
            np.testing.assert_array_equal(a.numpy(), v.numpy())
    data = tf.data.Dataset.from_tensors(((sx, sy, qx), qy))
    unadapted = trainer.evaluate_tasks(data, inner_steps=0, verbose=0, return_dict=True)
    want = float(np.mean((model.predict(qx.reshape(-1, 1), verbose=0) - qy.reshape(-1, 1)) ** 2))
    np.testing.assert_allclose(unadapted["loss"], want, rtol=1e-5)
    one = trainer.evaluate_tasks(data, inner_steps=1, verbose=0, return_dict=True)
    assert one["loss"] != unadapted["loss"]
    with pytest.raises(ValueError, match="inner_steps"):
        trainer.adapt(sx, sy, inner_steps=-1)


# ------------------------------------------------------------------------ last batches


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)]
    )


def _task_arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return (
        (
            rng.normal(size=(n, 5, 4)).astype("float32"),
            rng.normal(size=(n, 5, 2)).astype("float32"),
            rng.normal(size=(n, 3, 4)).astype("float32"),
        ),
        rng.normal(size=(n, 3, 2)).astype("float32"),
    )


def _maml(**kwargs):
    trainer = MAMLTrainer(_mlp(), inner_steps=1, inner_learning_rate=0.1, **kwargs)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return trainer


def test_maml_refuses_a_short_last_batch_before_training():
    x, y = _task_arrays(9)
    for kwargs in ({}, {"tasks_per_batch": 4}):
        trainer = _maml(**kwargs)
        before = [v.numpy() for v in trainer.model.trainable_variables]
        with pytest.raises(ValueError, match=r"last batch of 1 task.*multiple of batch_size"):
            trainer.fit(x, y, batch_size=4, verbose=0)
        assert int(trainer.outer_steps.numpy()) == 0  # refused before any step
        for v, b in zip(trainer.model.trainable_variables, before):
            np.testing.assert_array_equal(v.numpy(), b)
    trainer = _maml()
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    with pytest.raises(ValueError, match=r"drop_remainder=True.*tasks_per_batch"):
        trainer.fit(ds.batch(4), verbose=0)
    with pytest.raises(ValueError, match=r"validation_data.*multiple of batch_size"):
        trainer.fit(
            ds.batch(4, drop_remainder=True),
            validation_data=(x, y),
            validation_batch_size=2,
            verbose=0,
        )
    with pytest.raises(ValueError, match="multiple of batch_size"):
        trainer.evaluate(x, y, batch_size=2, verbose=0)
    first8 = tuple(a[:8] for a in x)
    history = trainer.fit(first8, y[:8], batch_size=4, verbose=0)  # what the error advises
    assert int(trainer.outer_steps.numpy()) == 2 and np.isfinite(history.history["loss"][0])
    # tasks_per_batch with a dynamic task dimension: the short batch is named at run time.
    trainer = _maml(tasks_per_batch=4)
    with pytest.raises(ValueError, match=r"tasks_per_batch=4 .*last, smaller batch"):
        trainer.fit(ds.batch(4), verbose=0)
    assert int(trainer.outer_steps.numpy()) == 2  # the two full batches trained


def test_prompt_trainers_refuse_a_short_last_batch_before_training():
    class Offset(keras.layers.Layer):
        def build(self, shape):
            self.offset = self.add_weight(shape=(shape[-1],), name="offset")

        def call(self, x):
            return x + self.offset

    rng = np.random.default_rng(0)
    sx, sy = rng.normal(size=(3, 1, 4, 3)), rng.normal(size=(3, 1, 4, 2))
    qx, qy = rng.normal(size=(3, 2, 3)), rng.normal(size=(3, 2, 2))
    for cls in (PromptFOMAMLTrainer, PromptReptileTrainer):
        model = keras.Sequential([keras.Input((3,)), Offset(name="prompt"), keras.layers.Dense(2)])
        trainer = cls(model, inner_steps=2, inner_optimizer=O.SGD(0.1), carry_inner_state=False)
        trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with pytest.raises(ValueError, match=r"last batch of 1 task"):
            trainer.fit((sx, sy, qx), qy, batch_size=2, verbose=0)
        trainer.fit((sx[:2], sy[:2], qx[:2]), qy[:2], batch_size=2, verbose=0)
        assert int(trainer.outer_steps.numpy()) == 1


def test_two_replicas_last_batches():
    """One example in the last batch of NumPy input (one replica gets none): the stacked
    trainers and Sequential Reptile train it; task counts that do not split among the
    replicas are refused before training."""
    strategy = two_cpu_strategy()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 3, 4)), rng.normal(size=(5, 3, 2))
    with strategy.scope():
        reptile = ReptileTrainer(_mlp(), inner_steps=3, inner_optimizer=0.1, stack_axis=1)
        reptile.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        sequential = SequentialReptileTrainer(_mlp(), inner_steps=2, outer_learning_rate=0.5)
        sequential.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        maml = _maml()
    history = reptile.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert int(reptile.outer_steps.numpy()) == 3 and np.isfinite(history.history["loss"][0])
    assert all(np.isfinite(v.numpy()).all() for v in reptile.model.trainable_variables)
    history = sequential.fit(x[:, 0], y[:, 0], batch_size=2, shuffle=False, verbose=0)
    assert int(sequential.schedule.count.numpy()) == 4  # 3 steps, then the discard
    assert np.isfinite(history.history["loss"][0])
    tx, ty = _task_arrays(6)
    with pytest.raises(ValueError, match=r"3 tasks per batch do not split evenly among the 2"):
        maml.fit(
            tf.data.Dataset.from_tensor_slices((tx, ty)).batch(3, drop_remainder=True), verbose=0
        )
    with pytest.raises(ValueError, match=r"batch_size=3 .* among the 2 replicas"):
        maml.fit(tx, ty, batch_size=3, verbose=0)
    assert int(maml.outer_steps.numpy()) == 0


def test_multi_task_reptile_names_a_dynamic_task_count():
    trainer = MultiTaskReptileTrainer(_mlp(), inner_steps=3, inner_optimizer=0.1)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 3, 2, 4)), rng.normal(size=(5, 3, 2, 2))
    with pytest.raises(ValueError, match=r"drop_remainder=True.*stack_axis=1"):
        trainer.fit(x, y, batch_size=2, verbose=0)
