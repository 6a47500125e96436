"""MAMLTrainer (MAML / Meta-SGD / MAML++ / gradient sharing) on TensorFlow: its step is the
algorithm's meta-gradient, first order equals the FOMAML closed form, gradient sharing
follows a NumPy re-derivation and equals plain MAML at a gate of exactly 0, two replicas
equal one, evaluate / predict adapt per task. The algorithm's own oracles (finite
differences, the FOMAML closed form, Meta-SGD's rates, gradient sharing against NumPy and
at a gate of exactly 0, MAML++'s loss weights) run on both backends in
test_maml_algorithm_backends.py; the builders and NumPy re-derivations are
tests/maml_oracles.py's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.algorithms.gradient_sharing import GradientSharing
from tf_metaalign.trainers import MAMLTrainer

from conftest import two_cpu_strategy
from maml_oracles import (
    _np_grad,
    const_batches,
    linear_model,
    mlp,
    model_meta_gradient,
    mse_loss_fn,
    np_sharing_inner_loop,
    plain_lrs,
    regression_tasks,
)


def _task_arrays(num_tasks, seed=0, n_support=6, n_query=5):
    tasks = regression_tasks(num_tasks, n_support, n_query, seed=seed)
    sx = np.stack([t[0][0] for t in tasks])
    sy = np.stack([t[0][1] for t in tasks])
    qx = np.stack([t[1][0] for t in tasks])
    qy = np.stack([t[1][1] for t in tasks])
    return (sx, sy, qx), qy


def _task_list(x, y, indices):
    """`_task_arrays`' tasks `indices` as `regression_tasks` gives them: [((xs, ys), (xq, yq))]."""
    return [((x[0][t], x[1][t]), (x[2][t], y[t])) for t in indices]


def _assert_outer_sgd_step(model, phi, grads):
    """The model's weights are phi - 0.5 * grads (one step of `_trainer`'s SGD(0.5))."""
    for v, p, g in zip(model.trainable_variables, phi, grads):
        np.testing.assert_allclose(v.numpy(), p.numpy() - 0.5 * g.numpy(), rtol=1e-10, atol=1e-12)


def _dataset(x, y, tasks_per_batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(tasks_per_batch, drop_remainder=True)


def _trainer(model, optimizer=None, **kwargs):
    trainer = MAMLTrainer(model, **kwargs)
    trainer.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.5),
        loss=keras.losses.MeanSquaredError(),
        metrics=["mae"],
    )
    return trainer


def test_trainer_step_is_the_algorithms_meta_gradient(float64):
    x, y = _task_arrays(4, seed=7)
    for first_order in (False, True):
        trainer = _trainer(mlp(5), inner_steps=2, inner_learning_rate=0.3, first_order=first_order)
        phi = F.current_params(trainer.model)
        tasks = _task_list(x, y, range(4))
        r = model_meta_gradient(
            trainer.model, phi, tasks, {}, plain_lrs(0.3, 2, 4), first_order=first_order
        )
        history = trainer.fit(_dataset(x, y, 4), verbose=0)
        _assert_outer_sgd_step(trainer.model, phi, r.grads)
        np.testing.assert_allclose(history.history["loss"][0], float(r.loss), rtol=1e-10)
        assert int(trainer.outer_steps.numpy()) == 1


def test_trainer_first_order_equals_the_fomaml_closed_form(float64):
    x, y = _task_arrays(6, seed=8)
    trainer = _trainer(linear_model(6), inner_steps=2, inner_learning_rate=0.2, first_order=True)
    phi = [v.numpy() for v in trainer.model.trainable_variables]
    trainer.fit(_dataset(x, y, 3), verbose=0)  # 2 outer steps of 3 tasks
    for start in (0, 3):
        grad = [np.zeros_like(p) for p in phi]
        for t in range(start, start + 3):
            theta = [p.copy() for p in phi]
            for _ in range(2):
                theta = [a - 0.2 * g for a, g in zip(theta, _np_grad(theta, x[0][t], x[1][t]))]
            grad = [a + g / 3 for a, g in zip(grad, _np_grad(theta, x[2][t], y[t]))]
        phi = [p - 0.5 * g for p, g in zip(phi, grad)]
    for v, p in zip(trainer.model.trainable_variables, phi):
        np.testing.assert_allclose(v.numpy(), p, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "traced"])
def test_trainer_gate_exactly_zero_equals_plain_maml(float64, run_eagerly):
    # Eager: bit for bit. Traced: Grappler optimises the two graphs (the inner steps are
    # nested functions it inlines) in different contexts, so float64 rounding may differ
    # in the last bit; one lost or wrong term would differ by far more.
    x, y = _task_arrays(8, seed=9)
    plain = _trainer(mlp(3), keras.optimizers.Adam(0.02), inner_steps=2, inner_learning_rate=0.3)
    shared = _trainer(
        mlp(3),
        keras.optimizers.Adam(0.02),
        inner_steps=2,
        inner_learning_rate=0.3,
        gradient_sharing=GradientSharing(initial_m=0.3, initial_lambda=-np.inf),
    )
    for trainer in (plain, shared):
        trainer.run_eagerly = run_eagerly
        trainer.fit(_dataset(x, y, 4), epochs=2, verbose=0)
    for a, b in zip(shared.model.trainable_variables, plain.model.trainable_variables):
        if run_eagerly:
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        else:
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-14, atol=1e-16)
    assert np.all(np.isneginf(shared.sharing_lambda.numpy()))
    assert int(shared.g_hat_initialized.numpy()) == 1


def test_trainer_g_hat_and_gates_follow_numpy(float64):
    """Two meta-iterations on a linear model: the stored g_hat equals Algorithm 1's inner
    loop re-derived in NumPy from the weights, m, lambda and g_hat the trainer had before
    each iteration; m and lambda both move (non-zero outer gradients)."""
    x, y = _task_arrays(6, seed=10)
    trainer = _trainer(
        linear_model(7),
        keras.optimizers.SGD(0.5),
        inner_steps=2,
        inner_learning_rate=0.25,
        gradient_sharing=GradientSharing(),
    )
    g_hat = None
    for step, start in enumerate((0, 3)):
        theta = [v.numpy() for v in trainer.model.trainable_variables]
        m, lam = trainer.sharing_m.numpy(), trainer.sharing_lambda.numpy()
        tasks = _task_list(x, y, range(start, start + 3))
        _, want = np_sharing_inner_loop(theta, tasks, 0.25, m, lam, g_hat, step > 0)
        sub = tuple(a[start : start + 3] for a in x), y[start : start + 3]
        trainer.fit(_dataset(*sub, 3), verbose=0)
        for k in range(2):
            for v, w in zip(trainer.weights_copy(f"g_hat_{k}"), want[k]):
                np.testing.assert_allclose(v.numpy(), w, rtol=1e-10, atol=1e-12)
        g_hat = want
    assert int(trainer.g_hat_initialized.numpy()) == 1
    assert np.all(trainer.sharing_m.numpy() != 0)  # moved at the second iteration
    assert np.all(trainer.sharing_lambda.numpy() != 0)


@pytest.mark.parametrize("learn", ["per_parameter", "per_layer_per_step"])
def test_learned_inner_learning_rates_receive_gradients(float64, learn):
    x, y = _task_arrays(4, seed=11)
    trainer = _trainer(
        mlp(2),
        keras.optimizers.SGD(0.5),
        inner_steps=2,
        inner_learning_rate=0.1,
        learn_inner_learning_rates=learn,
    )
    before = [v.numpy() for v in trainer.inner_learning_rate_variables]
    phi = F.current_params(trainer.model)
    history = trainer.fit(_dataset(x, y, 4), verbose=0)
    after = [v.numpy() for v in trainer.inner_learning_rate_variables]
    # The outer SGD step moved every learning rate by -0.5 * its meta-gradient.
    if learn == "per_parameter":
        hyper = {f"lr_{i}": tf.constant(b) for i, b in enumerate(before)}
        fn = lambda h: [[h[f"lr_{i}"] for i in range(4)]] * 2  # noqa: E731
    else:
        hyper = {"lslr": tf.constant(before[0])}
        fn = lambda h: [[h["lslr"][k, i] for i in range(4)] for k in range(2)]  # noqa: E731
    tasks = _task_list(x, y, range(4))
    r = model_meta_gradient(trainer.model, phi, tasks, hyper, fn)
    for name, b, a in zip(sorted(r.hyper_grads, key=lambda n: (len(n), n)), before, after):
        g = r.hyper_grads[name].numpy()
        assert np.all(g != 0), name
        np.testing.assert_allclose(a, b - 0.5 * g, rtol=1e-10, atol=1e-12)
    assert "inner_learning_rate" in history.history


def test_two_replicas_equal_one_with_gradient_sharing(float64):
    x, y = _task_arrays(8, seed=12)
    kwargs = dict(
        inner_steps=2,
        inner_learning_rate=0.2,
        gradient_sharing=GradientSharing(),
        learn_inner_learning_rates="per_layer_per_step",
        multi_step_loss=True,
        multi_step_loss_epochs=2,
    )
    single = _trainer(mlp(4), keras.optimizers.Adam(0.02), **kwargs)
    h1 = single.fit(_dataset(x, y, 4), epochs=2, verbose=0)
    with two_cpu_strategy().scope():
        double = _trainer(mlp(4), keras.optimizers.Adam(0.02), **kwargs)
    h2 = double.fit(_dataset(x, y, 4), epochs=2, verbose=0)
    for a, b in zip(double.variables, single.variables):
        np.testing.assert_allclose(
            np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-9, atol=1e-12, err_msg=a.path
        )
    for key in h1.history:
        np.testing.assert_allclose(h2.history[key], h1.history[key], rtol=1e-9, err_msg=key)
    assert int(double.epochs_done.numpy()) == 2


def test_derivative_order_annealing_is_first_order_then_second(float64):
    x, y = _task_arrays(4, seed=13)
    annealed = _trainer(mlp(6), inner_steps=2, inner_learning_rate=0.3, first_order_epochs=1)
    first = _trainer(mlp(6), inner_steps=2, inner_learning_rate=0.3, first_order=True)
    second = _trainer(mlp(6), inner_steps=2, inner_learning_rate=0.3)
    for t in (annealed, first, second):
        t.fit(_dataset(x, y, 4), epochs=1, verbose=0)
    for a, b in zip(annealed.model.trainable_variables, first.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    assert not np.allclose(
        first.model.trainable_variables[0].numpy(),
        second.model.trainable_variables[0].numpy(),
        rtol=1e-8,
    )
    # Epoch 2 is second order: one step from the same weights as `second` would take.
    phi = F.current_params(annealed.model)
    tasks = _task_list(x, y, range(4))
    r = model_meta_gradient(annealed.model, phi, tasks, {}, plain_lrs(0.3, 2, 4))
    annealed.fit(_dataset(x, y, 4), epochs=1, verbose=0)
    _assert_outer_sgd_step(annealed.model, phi, r.grads)
    assert int(annealed.epochs_done.numpy()) == 2


def _classification_tasks(num_tasks, ways=3, shots=4, seed=0):
    rng = np.random.default_rng(seed)
    sx, sy, qx, qy = [], [], [], []
    for _ in range(num_tasks):
        centres = rng.normal(size=(ways, 4)) * 2
        labels = np.repeat(np.arange(ways), shots)
        sx.append(centres[labels] + rng.normal(size=(ways * shots, 4)))
        qx.append(centres[labels] + rng.normal(size=(ways * shots, 4)))
        sy.append(labels)
        qy.append(labels)
    return (np.asarray(sx), np.asarray(sy), np.asarray(qx)), np.asarray(qy)


def test_evaluate_adapts_and_reports_query_accuracy(float64):
    x, y = _classification_tasks(4, seed=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    trainer = MAMLTrainer(model, inner_steps=2, inner_learning_rate=0.5, evaluation_inner_steps=3)
    trainer.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    logs = trainer.evaluate(_dataset(x, y, 2), verbose=0, return_dict=True)
    for steps, result in (
        (3, logs),
        (1, trainer.evaluate_tasks(_dataset(x, y, 2), inner_steps=1, verbose=0, return_dict=True)),
    ):
        adapted = trainer.adapt(x[0], x[1], inner_steps=steps)
        correct, losses = [], []
        for t, weights in enumerate(adapted):
            logits = model.stateless_call(weights, model.non_trainable_variables, x[2][t])[0]
            correct.append(np.argmax(logits.numpy(), -1) == y[t])
            losses.append(
                float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[t], logits))
            )
        np.testing.assert_allclose(result["accuracy"], np.mean(correct), rtol=1e-12)
        np.testing.assert_allclose(result["loss"], np.mean(losses), rtol=1e-10)
    assert set(logs) == {"loss", "accuracy"}


def test_arguments_are_checked():
    model = linear_model(0, dtype="float32")
    with pytest.raises(ValueError, match="inner_steps"):
        MAMLTrainer(model, inner_steps=0)
    with pytest.raises(ValueError, match="inner_learning_rate"):
        MAMLTrainer(model, inner_learning_rate=-1.0)
    with pytest.raises(ValueError, match="learn_inner_learning_rates"):
        MAMLTrainer(model, learn_inner_learning_rates="per_layer")
    with pytest.raises(ValueError, match="first_order_epochs"):
        MAMLTrainer(model, first_order=True, first_order_epochs=2)
    with pytest.raises(ValueError, match="gradient_sharing"):
        MAMLTrainer(model, gradient_sharing="yes")
    with pytest.raises(ValueError, match="initial_lambda"):
        GradientSharing(initial_lambda=float("nan"))
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="built"):
        MAMLTrainer(unbuilt, learn_inner_learning_rates="per_parameter")
    trainer = MAMLTrainer(model)
    trainer.compile(optimizer="sgd", loss="mse")
    flat = np.zeros((8, 4), "float32")
    with pytest.raises(ValueError, match="support_x, support_y, query_x"):
        trainer.fit(flat, np.zeros((8, 2), "float32"), verbose=0)
    with pytest.raises(ValueError, match="leading task dimension"):
        trainer.fit(
            tf.data.Dataset.from_tensors(((flat, flat[:, :2], flat), flat[:, :2])), verbose=0
        )
    with pytest.raises(ValueError, match="drop_remainder|tasks_per_batch"):
        x, y = _task_arrays(4)
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2), verbose=0)


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(2),
        ]
    )


def test_per_step_batch_norm_statistics(float64):
    """MAML++ per-step statistics: training is unchanged (batch statistics), copy k is the
    model's statistics updated by the passes of step k only (support passes at theta_{t,k},
    then for the last step the query passes at theta_{t,K}), the model keeps the last
    step's copy."""
    x, y = _task_arrays(2, seed=14)
    plain = _trainer(_bn_model(1), inner_steps=2, inner_learning_rate=0.3)
    per_step = _trainer(
        _bn_model(1), inner_steps=2, inner_learning_rate=0.3, per_step_batch_norm_statistics=True
    )
    model = per_step.model
    phi, s0 = F.current_params(model), F.current_state(model)
    assert len(s0) == 2 and len(per_step.step_statistics) == 2
    plain.fit(_dataset(x, y, 2), verbose=0)
    per_step.fit(_dataset(x, y, 2), verbose=0)
    for a, b in zip(per_step.model.trainable_variables, plain.model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # The reference: the trajectories do not depend on the statistics (batch statistics).
    r = M.adapt(
        mse_loss_fn(model),
        phi,
        s0,
        const_batches([(x[0][t], x[1][t]) for t in range(2)]),
        plain_lrs(0.3, 2, 6)({}),
    )

    def run(state, passes):
        for weights, inputs in passes:
            _, state = model.stateless_call(weights, state, tf.constant(inputs), training=True)
        return state

    copy0 = run(s0, [(r.trajectories[t][0], x[0][t]) for t in range(2)])
    copy1 = run(
        s0,
        [(r.trajectories[t][1], x[0][t]) for t in range(2)]
        + [(r.trajectories[t][2], x[2][t]) for t in range(2)],
    )
    for got, want in zip(per_step.step_statistics, (copy0, copy1)):
        for v, w in zip(got, want):
            np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-12)
    for v, w in zip(model.non_trainable_variables, copy1):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-12)
    # Evaluation with moving statistics uses copy k at step k.
    per_step.transductive_evaluation = False
    per_step.test_function = None
    loss = per_step.evaluate(_dataset(x, y, 2), verbose=0, return_dict=True)["loss"]
    stats = [[v.numpy() for v in copies] for copies in per_step.step_statistics]
    losses = []
    for t in range(2):
        theta = F.current_params(model)
        for k in range(2):
            with tf.GradientTape() as tape:
                tape.watch(theta)
                out = model.stateless_call(theta, stats[k], tf.constant(x[0][t]), training=False)[0]
                value = keras.losses.MeanSquaredError()(x[1][t], out)
            theta = [p - 0.3 * g for p, g in zip(theta, tape.gradient(value, theta))]
        out = model.stateless_call(theta, stats[1], tf.constant(x[2][t]), training=False)[0]
        losses.append(float(keras.losses.MeanSquaredError()(y[t], out)))
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-10)


def test_validation_during_fit_is_the_adapted_query_loss(float64):
    x, y = _task_arrays(8, seed=15)
    val = _task_arrays(4, seed=16)
    trainer = _trainer(
        mlp(8),
        keras.optimizers.Adam(0.01),
        inner_steps=2,
        inner_learning_rate=0.3,
        gradient_sharing=GradientSharing(),
    )
    history = trainer.fit(_dataset(x, y, 4), validation_data=_dataset(*val, 2), epochs=2, verbose=0)
    after = trainer.evaluate(_dataset(*val, 2), verbose=0, return_dict=True)
    np.testing.assert_allclose(history.history["val_loss"][-1], after["loss"], rtol=1e-12)
    np.testing.assert_allclose(history.history["val_mae"][-1], after["mae"], rtol=1e-12)
    assert "val_sharing_m" not in history.history


def test_predict_adapts_each_task(float64):
    x, y = _task_arrays(4, seed=17)
    trainer = _trainer(mlp(9), inner_steps=2, inner_learning_rate=0.3)
    trainer.fit(_dataset(x, y, 2), verbose=0)
    data = tf.data.Dataset.from_tensor_slices(x).batch(2, drop_remainder=True)
    predictions = trainer.predict(data, verbose=0)
    assert predictions.shape == (4, 5, 2)
    adapted = trainer.adapt(x[0], x[1])
    model = trainer.model
    for t, weights in enumerate(adapted):
        want = model.stateless_call(weights, model.non_trainable_variables, x[2][t])[0]
        np.testing.assert_allclose(predictions[t], want.numpy(), rtol=1e-12)
    # An ordinary model batch: the wrapped model.
    np.testing.assert_allclose(
        trainer.predict(x[2][0], verbose=0), model.predict(x[2][0], verbose=0), rtol=1e-12
    )


def test_evaluate_and_predict_on_two_replicas_equal_one(float64):
    # Under a strategy each replica adapts its own tasks (evaluation needs no
    # communication, even with gradient sharing: the stored g_hat is used); the logged
    # query loss and metrics are over ALL tasks and `predict` returns every task's
    # outputs in the order of the data.
    x, y = _task_arrays(8, seed=21)
    kwargs = dict(
        inner_steps=2,
        inner_learning_rate=0.2,
        gradient_sharing=GradientSharing(),
        evaluation_inner_steps=3,
    )
    single = _trainer(mlp(6), keras.optimizers.Adam(0.02), **kwargs)
    single.fit(_dataset(x, y, 4), verbose=0)  # g_hat initialised, gates moved
    with two_cpu_strategy().scope():
        double = _trainer(mlp(6), keras.optimizers.Adam(0.02), **kwargs)
    double.set_weights(single.get_weights())
    assert int(double.g_hat_initialized.numpy()) == 1
    want = single.evaluate(_dataset(x, y, 4), verbose=0, return_dict=True)
    got = double.evaluate(_dataset(x, y, 4), verbose=0, return_dict=True)
    assert set(got) == {"loss", "mae"}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, err_msg=key)
    data = tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True)
    np.testing.assert_allclose(
        double.predict(data, verbose=0), single.predict(data, verbose=0), rtol=1e-10, atol=1e-12
    )
    # A meaningful comparison: adaptation changed the outputs.
    model = single.model
    plain = np.stack([model.predict(x[2][t], verbose=0) for t in range(8)])
    assert np.abs(single.predict(data, verbose=0) - plain).max() > 1e-3
