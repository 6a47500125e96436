"""The trainer contract (tf_metaalign.trainers.base): Keras's loss path, diagnostics,
every-k-steps schedules, weights copies, committing weights, mid-epoch resumption."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.trainers import DotProdTrainer, GuidedTrainer
from tf_metaalign.trainers.base import (
    Diagnostic,
    EveryKSteps,
    MetaTrainer,
    commit_weights,
)
from tf_metaalign.functional import replica_safe_cond


def _data(n=32, seed=0, dtype="float64"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(dtype)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(dtype)
    return x, y


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


# ------------------------------------------------- the loss is the model's own fit loss


class PenalisedModel(keras.Model):
    """A subclassed model whose compute_loss override adds an output penalty (a common
    Keras idiom): plain fit trains on it, so every trainer must."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(2)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.5 * tf.reduce_mean(tf.square(y_pred))


def _two_output_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    a = keras.layers.Dense(1, name="a")(h)
    b = keras.layers.Dense(1, name="b", activity_regularizer=keras.regularizers.L2(0.01))(h)
    return keras.Model(inputs, [a, b])


MODELS = {
    "compute_loss_override": (
        lambda: PenalisedModel(),
        dict(loss="mse"),
        lambda y: y,
    ),
    "multi_output_loss_weights": (
        _two_output_model,
        dict(loss=["mse", "mae"], loss_weights=[0.3, 2.0]),
        lambda y: [y[:, :1], y[:, 1:]],
    ),
}


def _built(make, seed):
    keras.utils.set_random_seed(seed)
    model = make()
    model(np.zeros((1, 4)))
    return model


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_guided_at_meta_lr_zero_trains_on_the_loss_plain_fit_trains_on(kind, float64):
    make, compile_kwargs, targets = MODELS[kind]
    x, y = _data()
    plain = _built(make, 1)
    plain.compile(O.Adam(0.02), **compile_kwargs)
    h_plain = plain.fit(x, targets(y), batch_size=8, epochs=1, shuffle=False, verbose=0)

    model = _built(make, 1)
    trainer = GuidedTrainer(
        model, (x[:8], targets(y[:8])), meta_optimizer=O.Adam(0.0), commit_forward_update=False
    )
    trainer.compile(O.Adam(0.02), **compile_kwargs)
    h = trainer.fit(x, targets(y), batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(plain), _weights(model)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(h.history["loss"], h_plain.history["loss"], rtol=1e-12)
    # evaluate() reports the same loss as the model's own evaluate().
    np.testing.assert_allclose(
        trainer.evaluate(x, targets(y), verbose=0),
        plain.evaluate(x, targets(y), verbose=0),
        rtol=1e-12,
    )


def test_the_override_is_not_ignored(float64):
    """The test above can fail: dropping the override trains other weights."""
    x, y = _data()
    plain = _built(lambda: PenalisedModel(), 1)
    plain.compile(O.Adam(0.02), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loss_fn = F.make_loss_fn(_built(lambda: PenalisedModel(), 1), keras.losses.MeanSquaredError())
    m = _built(lambda: PenalisedModel(), 1)
    value, _ = F.make_loss_fn(m, keras.losses.MeanSquaredError())(
        F.current_params(m), F.current_state(m), (x, y)
    )
    expected = np.mean((m(x).numpy() - y) ** 2) + 0.5 * np.mean(m(x).numpy() ** 2)
    np.testing.assert_allclose(float(value), expected, rtol=1e-10)
    del loss_fn


def test_dotprod_weight_zero_on_a_multi_output_model_is_plain_fit_at_half_rate(float64):
    """DotProd's G1 + G2 (halves of equal size) is twice the batch gradient: SGD at half
    the rate is plain fit, with loss weights, two outputs and an activity regulariser
    (Keras adds the latter once per loss evaluation: once per half, so it counts double
    against the full batch; hence no regulariser here beyond the loss weights)."""
    x, y = _data()
    make = lambda: keras.Model(*_two_heads())  # noqa: E731
    plain = _built(make, 2)
    plain.compile(keras.optimizers.SGD(0.1), loss=["mse", "mse"], loss_weights=[0.3, 2.0])
    plain.fit(x, [y[:, :1], y[:, 1:]], batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = _built(make, 2)
    trainer = DotProdTrainer(model, weight=0.0)
    trainer.compile(
        optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mse"], loss_weights=[0.3, 2.0]
    )
    trainer.fit(x, [y[:, :1], y[:, 1:]], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(plain), _weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def _two_heads():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return inputs, [keras.layers.Dense(1)(h), keras.layers.Dense(1)(h)]


def test_no_loss_anywhere_is_a_clear_error():
    keras.utils.set_random_seed(0)
    trainer = DotProdTrainer(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    trainer.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="No loss to compute.*compile"):
        trainer.fit(*_data(8, dtype="float32"), batch_size=4, verbose=0)


# ---------------------------------------------------------------------- diagnostics


def test_diagnostic_reductions():
    mean, last = Diagnostic("m", "mean"), Diagnostic("l", "last")
    for value, weight in [(1.0, 1.0), (5.0, 3.0), (100.0, 0.0)]:
        mean.update_state(value, weight)
        last.update_state(value, weight)
    assert float(mean.result()) == pytest.approx((1 + 15) / 4)
    assert float(last.result()) == 5.0  # weight 0 keeps the previous value
    mean.reset_state()
    last.reset_state()
    assert float(mean.result()) == 0.0 and float(last.result()) == 5.0
    with pytest.raises(ValueError, match="reduction"):
        Diagnostic("x", "median")


# -------------------------------------------------------------------- every k steps


def test_every_k_steps_phases_and_bad_k():
    s = EveryKSteps(3)
    firsts, lasts = [], []
    for _ in range(7):
        firsts.append(bool(s.is_first()))
        lasts.append(bool(s.is_last()))
        s.advance()
    assert firsts == [True, False, False, True, False, False, True]
    assert lasts == [False, False, True, False, False, True, False]
    assert EveryKSteps(1).is_first() is True  # python constant: no tf.cond at all
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="`k`"):
            EveryKSteps(bad)


def test_replica_safe_cond_under_two_replicas_runs_communication_unconditionally():
    strategy = two_cpu_strategy()

    @tf.function
    def run(pred):
        def replica_fn():
            rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)

            def on():  # communicates: an all-reduce
                return F.all_reduce_sum(rid + 1.0)

            return replica_safe_cond(pred, on, lambda: tf.constant(-1.0), communicates=True)

        return strategy.experimental_local_results(strategy.run(replica_fn))

    assert [float(v) for v in run(tf.constant(True))] == [3.0, 3.0]
    assert [float(v) for v in run(tf.constant(False))] == [-1.0, -1.0]


# ------------------------------------------------------------- weights copies, commits


class CopyTrainer(MetaTrainer):
    """A minimal trainer: commits w - 0.1 * (w - initial) each step (pulls nothing at
    step 0) and SGD otherwise; exercises add_weights_copy and new_params."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.add_weights_copy("initial")

    def train_step(self, data):
        x, y, sw = self.unpack(data)
        loss, grads, (state, y_pred) = F.value_and_grad(
            self.loss_fn(), F.current_params(self.model), F.current_state(self.model), (x, y, sw)
        )
        grads = F.all_reduce_sum(grads)
        new = [p - 0.1 * g for p, g in zip(F.current_params(self.model), grads)]
        return self.finish_step(data, y_pred, loss, new_state=state, new_params=new)


def test_weights_copy_is_made_when_the_model_is_built_and_is_checkpointed(tmp_path):
    class Unbuilt(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    x, y = _data(16, dtype="float32")
    keras.utils.set_random_seed(0)
    trainer = CopyTrainer(Unbuilt())
    with pytest.raises(ValueError, match="created when the model is built"):
        trainer.weights_copy("initial")
    trainer.compile(loss="mse")
    with pytest.raises(ValueError, match="must be built before fit"):
        trainer.fit(x, y, batch_size=8, verbose=0)
    trainer(x[:1])  # builds the model, then the copy from its weights
    initial = [v.numpy() for v in trainer.model.trainable_variables]
    trainer.fit(x, y, batch_size=8, verbose=0)
    copy = trainer.weights_copy("initial")
    for a, b in zip(copy, initial):
        np.testing.assert_array_equal(a.numpy(), b)
    assert len(copy) == 2 and all(not v.trainable for v in copy)
    # The copy holds the weights of the model when it was built, not the trained ones.
    assert not np.allclose(copy[0].numpy(), trainer.model.trainable_variables[0].numpy())
    path = str(tmp_path / "t.weights.h5")
    trainer.save_weights(path)
    keras.utils.set_random_seed(5)
    other = CopyTrainer(Unbuilt())
    other.compile(loss="mse")
    other(x[:1])
    other.load_weights(path)
    for a, b in zip(copy, other.weights_copy("initial")):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_committed_weights_under_two_replicas_equal_one_replica():
    x, y = _data(32, dtype="float32")
    results = []
    for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"), two_cpu_strategy()):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            trainer = CopyTrainer(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
            trainer.compile(loss="mse")
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
        results.append(_weights(trainer.model))
        if strategy.num_replicas_in_sync == 2:
            for v in trainer.model.trainable_variables:  # every replica's copy was assigned
                a, b = [c.numpy() for c in v.value.values]
                np.testing.assert_array_equal(a, b)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(
        results[0][0],
        CopyTrainer(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        .model.trainable_variables[0]
        .numpy(),
    )


def test_commit_weights_checks_lengths():
    v = keras.Variable(np.zeros(2, "float32"))
    with pytest.raises(ValueError, match="2 values for 1 variables"):
        commit_weights([v], [np.ones(2), np.ones(2)])


def test_finish_step_takes_one_update_kind():
    trainer = CopyTrainer(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    trainer.compile(loss="mse")
    with pytest.raises(ValueError, match="at most one"):
        trainer.finish_step(
            (np.zeros((1, 4)), np.zeros((1, 2))),
            None,
            tf.constant(0.0),
            gradients=[],
            new_params=[],
        )


# ----------------------------------------------------------- resuming mid-epoch


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_batch, epoch):
        super().__init__()
        self.at_batch, self.epoch, self.current = at_batch, epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.at_batch:
            raise KeyboardInterrupt("simulated crash")


def _dotprod_run(backup_dir=None, interrupt=None):
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(2),
        ]
    )
    trainer = DotProdTrainer(model, weight=0.2, every=2)
    trainer.compile(optimizer=O.Adam(0.01), loss="mse")
    callbacks = []
    if backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir, save_freq=3))
    if interrupt:
        callbacks.append(interrupt)
    x, y = _data(64, dtype="float32")
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return trainer


def test_backup_and_restore_resumes_mid_epoch_to_the_uninterrupted_weights(tmp_path):
    reference = _dotprod_run()
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _dotprod_run(backup, _Interrupt(at_batch=4, epoch=1))  # saved after batch 2 of epoch 1
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 1
    resumed = _dotprod_run(backup)
    for a, b in zip(reference.weights, resumed.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    for a, b in zip(reference.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    assert int(resumed.pairs_seen.numpy()) == 16


def test_a_fresh_fit_never_skips_batches():
    """An interrupted fit without BackupAndRestore, then fit again: the new fit starts
    at its first batch (as plain Keras does)."""
    x, y = _data(32, dtype="float32")
    keras.utils.set_random_seed(0)
    trainer = DotProdTrainer(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), weight=0.0
    )
    trainer.compile(optimizer=O.SGD(0.1), loss="mse")
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[_Interrupt(1, 0)])
    assert int(trainer.epoch_steps.numpy()) == 2
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(trainer.pairs_seen.numpy()) == 6


# --------------------------- the shapes the next trainers take (toys with closed forms)


class StackedReptile(MetaTrainer):
    """First-order Reptile on one task: k inner SGD steps on a stacked [k, B, ...] batch,
    computed on tensors (nothing assigned), then the pseudo-gradient phi - theta_k to
    the compiled (outer) optimizer. With outer SGD(1) it is k plain SGD steps."""

    def __init__(self, model, inner_learning_rate, **kwargs):
        super().__init__(model, **kwargs)
        self.inner = O.SGD(inner_learning_rate)

    def example_batch(self, x, y=None, sample_weight=None):
        return x[0], None if y is None else y[0], sample_weight

    def train_step(self, data):
        x, y, _ = self.unpack(data)
        phi, state = F.current_params(self.model), F.current_state(self.model)
        theta, inner_state = phi, self.inner.initial_state(self.model.trainable_variables)
        for i in range(x.shape[0]):
            loss, g, (state, y_pred) = F.value_and_grad(self.loss_fn(), theta, state, (x[i], y[i]))
            theta, inner_state = self.inner.apply_on_tensors(
                F.all_reduce_sum(g), theta, inner_state, self.model.trainable_variables
            )
        delta = F.replica_share([p - t for p, t in zip(phi, theta)])
        return self.finish_step((x[-1], y[-1]), y_pred, loss, new_state=state, gradients=delta)


class SlowWeightsReptile(MetaTrainer):
    """Sequential-Reptile shape: the model's variables hold the fast weights (one
    compiled-optimizer step per train_step), a weights copy holds phi; after every
    k-th step phi <- phi + eta * (theta - phi), committed to both."""

    def __init__(self, model, k, eta, **kwargs):
        super().__init__(model, **kwargs)
        self.k, self.eta = k, eta
        self.schedule = self.every_k_steps(k, name="trajectory")
        self.add_weights_copy("slow")

    def train_step(self, data):
        x, y, sw = self.unpack(data)
        loss, grads, (state, y_pred) = F.value_and_grad(
            self.loss_fn(), F.current_params(self.model), F.current_state(self.model), (x, y, sw)
        )

        def update():
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            slow = self.weights_copy("slow")
            theta = F.current_params(self.model)
            phi = [tf.convert_to_tensor(v.value) for v in slow]
            outer = [p + self.eta * (t - p) for p, t in zip(phi, theta)]
            due = self.schedule.is_last()
            # A commit communicates: select, then commit unconditionally (replica_safe_cond's rule).
            fast, new_phi = replica_safe_cond(
                due, lambda: (outer, outer), lambda: (theta, phi), communicates=True
            )
            commit_weights(self.model.trainable_variables, fast)
            for v, value in zip(slow, new_phi):
                v.assign(value)

        return self.finish_step(data, y_pred, loss, new_state=state, update=update)


def _mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]
    )


def _plain_sgd(seed, x, y, lr, batch_size):
    # lr exactly representable in float32: the package's optimizers keep the learning
    # rate in float32 (as Keras does under floatx float32), Keras's own under floatx.
    model = _mlp(seed)
    model.compile(keras.optimizers.SGD(lr), loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_stacked_inner_loop_with_outer_sgd_1_is_plain_sgd(float64, replicas):
    x, y = _data(48)
    plain = _plain_sgd(0, x, y, 0.125, 8)
    strategy = two_cpu_strategy() if replicas == 2 else tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        trainer = StackedReptile(_mlp(0), inner_learning_rate=0.125)
        trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    stacked = (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8, True).batch(3, True)
    )  # [3, 8, ...]
    if replicas == 2:  # each replica gets its half of every inner batch
        stacked = stacked.map(lambda a, b: (_interleave_halves(a), _interleave_halves(b)))
    trainer.fit(stacked, verbose=0)
    for a, b in zip(_weights(plain), _weights(trainer.model)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def _interleave_halves(t):
    """[k, B, ...] -> [2k, B/2, ...]: the first k rows are the first halves of the k inner
    batches, the last k their second halves. MirroredStrategy splits the leading axis, so
    replica r gets [k, B/2, ...] holding its half of every inner batch."""
    k, b = tf.shape(t)[0], tf.shape(t)[1]
    rest = tf.shape(t)[2:]
    halves = tf.reshape(t, tf.concat([[k, 2, b // 2], rest], 0))
    halves = tf.transpose(halves, tf.concat([[1, 0, 2], tf.range(3, tf.rank(halves))], 0))
    return tf.reshape(halves, tf.concat([[2 * k, b // 2], rest], 0))


@pytest.mark.parametrize("k, eta", [(1, 1.0), (3, 0.5)])
def test_slow_weights_trajectory_equals_its_closed_form(float64, k, eta):
    x, y = _data(48)
    trainer = SlowWeightsReptile(_mlp(1), k=k, eta=eta)
    trainer.compile(optimizer=keras.optimizers.SGD(0.125), loss="mse")
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # Oracle: plain SGD steps; after every k-th, phi + eta (theta - phi) for both.
    model = _mlp(1)
    phi = [v.numpy() for v in model.trainable_variables]
    for step, start in enumerate(range(0, 48, 8)):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(
                y[start : start + 8], model(x[start : start + 8])
            )
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            v.assign_sub(0.125 * g)
        if (step + 1) % k == 0:
            phi = [p + eta * (v.numpy() - p) for p, v in zip(phi, model.trainable_variables)]
            for v, p in zip(model.trainable_variables, phi):
                v.assign(p)
    for a, b in zip(_weights(model), _weights(trainer.model)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(phi, trainer.weights_copy("slow")):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)
    if k == 1 and eta == 1.0:  # K = 1, eta = 1 is plain training
        for a, b in zip(_weights(_plain_sgd(1, x, y, 0.125, 8)), _weights(trainer.model)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
