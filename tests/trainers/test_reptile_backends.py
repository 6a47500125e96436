"""The Reptile family on both backends (backend-neutral: no TensorFlow import).

* TensorFlow == JAX at float64: each trainer's trajectory (weights, slow weights,
  counters, optimizer state, logged losses, evaluate / predict) from the same weights on
  the same batches, against a golden file written on TensorFlow (`golden_io`).
* Resume: save_weights mid-run, reload into a fresh trainer, continue == uninterrupted.
* NumPy oracles: Sequential Reptile's and Reptile's / FOMAML's / multi-task Reptile's
  outer updates re-derived from the inner SGD / Adam trajectory; the inner loop is first
  order (nothing of it reaches an outer gradient).
* JAX: 1 device == 2 devices (`keras.distribution.DataParallel`).
* The user's model saves (at phi) and loads as itself.

NumPy input only (stack_axis=1 elements `[B, k, ...]`: Keras batches axis 0), so the
same batches reach both backends. About 40 s on 2 loaded cores (TensorFlow env).
"""

import keras
import numpy as np
import pytest
from backends import data_parallel, jax_devices, on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops

from tf_metaalign import algorithms as A
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.trainers import (
    FOMAMLTrainer,
    MultiTaskReptileTrainer,
    ReptileTrainer,
    SequentialReptileTrainer,
)

BACKENDS = ("tensorflow", "jax")

TOL = dict(rtol=1e-10, atol=1e-12)
B = 8  # examples per inner batch


def _data(n, seed=0, lead=()):
    """Regression rows x [n, *lead, 4] -> y [n, *lead, 2] (float64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *lead, 4))
    y = np.stack([np.sin(x[..., 0]) + x[..., 1], x[..., 2] - 0.5 * x[..., 3]], axis=-1)
    return x, y


def _set_weights(model, seed):
    """Weights drawn by NumPy: the same on both backends (Keras's initializers are not)."""
    set_numpy_weights(model, seed=100 + seed)
    return model


def _linear(seed=0):
    return _set_weights(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), seed)


def _mlp(seed=0):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]
    )
    return _set_weights(model, seed)


def _np(values):
    return [np.asarray(ops.convert_to_numpy(v), dtype="float64") for v in values]


def _weights(model):
    return _np(model.trainable_variables)


def _assert_close(a, b, tol=TOL):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol)


# ------------------------------------------------------------------------- the cases


def _sequential_reptile():
    trainer = SequentialReptileTrainer(
        _mlp(1), inner_steps=3, outer_learning_rate=0.5, reset_inner_optimizer=True
    )
    # The package's Adam: its betas are exact in float64 on both backends (Keras's Adam
    # rounds them through float32 on TensorFlow only).
    trainer.compile(optimizer=O.Adam(0.01), loss="mse", metrics=["mae"])
    return trainer


def _reptile():
    trainer = ReptileTrainer(_mlp(2), inner_steps=3, inner_optimizer=O.Adam(0.05), stack_axis=1)
    trainer.compile(optimizer=O.Adam(0.01, beta_1=0.5), loss="mse")
    return trainer


def _fomaml():
    trainer = FOMAMLTrainer(_mlp(3), inner_steps=2, inner_optimizer=0.1, stack_axis=1)
    # The package's SGD: Keras's rounds a python momentum through float32 on TensorFlow.
    trainer.compile(optimizer=O.SGD(0.05, momentum=0.9), loss="mse")
    return trainer


def _multi_task_reptile():
    trainer = MultiTaskReptileTrainer(
        _mlp(4), inner_steps=2, inner_optimizer=O.SGD(0.1, momentum=0.5), stack_axis=1
    )
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return trainer


#: name -> (make a compiled trainer, the leading stacked axes of an element after B)
CASES = {
    "sequential_reptile": (_sequential_reptile, ()),
    "reptile": (_reptile, (3,)),
    "fomaml": (_fomaml, (3,)),
    "multi_task_reptile": (_multi_task_reptile, (2, 2)),
}


def _case_data(name, steps, seed=0):
    lead = CASES[name][1]
    return _data(B * steps, seed, lead)


def _model_batch(x):
    """One ordinary model batch within (stacked) elements: builds a fresh trainer."""
    while x.ndim > 2:
        x = x[:, 0]
    return x[:1]


def _state(trainer):
    """Everything a trajectory leaves: the model's weights, the trainer's own state (slow
    weights, counters), the optimizer's variables; as float64 arrays."""
    return {
        "weights": _weights(trainer.model),
        # the slow weights phi (Sequential Reptile) and the step / outer-step counter
        "trainer_state": _np(getattr(trainer, "slow_weights", [])) + _np([trainer.schedule.count]),
        "optimizer": _np(trainer.optimizer.variables),
    }


def _flat(state, prefix=""):
    out = {}
    for key, values in state.items():
        for i, v in enumerate(values):
            out[f"{prefix}{key}_{i}"] = np.asarray(v, "float64")
    return out


# -------------------------------------------------- TensorFlow == JAX (golden files)


@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_matches_the_tensorflow_golden(float64, name):
    """Two epochs (Sequential Reptile: 16 steps of K = 3, the last trajectory discarded
    at the end of fit; the stacked trainers: 2 x 3 outer steps) with validation, then
    evaluate and predict; every number against the TensorFlow golden file."""
    steps = 8 if name == "sequential_reptile" else 3
    x, y = _case_data(name, steps)
    vx, vy = _data(16, seed=5)
    trainer = CASES[name][0]()
    history = trainer.fit(
        x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_data=(vx, vy)
    )
    arrays = _flat(_state(trainer))
    for key, values in history.history.items():
        arrays[f"history_{key}"] = np.asarray(values, "float64")
    arrays["evaluate"] = np.asarray(trainer.evaluate(vx, vy, verbose=0), "float64")
    arrays["predict"] = np.asarray(trainer.predict(vx[:4], verbose=0), "float64")
    if name == "sequential_reptile":
        count = int(ops.convert_to_numpy(trainer.schedule.count))
        assert count == 18  # 16 steps, the 16th's trajectory discarded: the next starts at 18
        _assert_close(_np(trainer.slow_weights), _weights(trainer.model))  # phi in the model
    else:
        assert int(ops.convert_to_numpy(trainer.outer_steps)) == 2 * steps
    check_golden(f"reptile_{name}", arrays)


class _SaveAt(keras.callbacks.Callback):
    def __init__(self, batch, path):
        super().__init__()
        self.batch, self.path = batch, path

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.save_weights(self.path)


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_equals_uninterrupted(float64, name, tmp_path):
    """save_weights after 5 of 9 steps (Sequential Reptile: theta_2 of the second
    trajectory), a fresh trainer loads it and trains the last 4: the same model, trainer
    state and optimizer state as the uninterrupted run (and the TensorFlow golden's)."""
    x, y = _case_data(name, 9, seed=1)
    path = str(tmp_path / "mid.weights.h5")
    reference = CASES[name][0]()
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[_SaveAt(4, path)])
    resumed = CASES[name][0]()
    resumed(_model_batch(x))
    resumed.optimizer.build(resumed.model.trainable_variables)
    resumed.load_weights(path)
    if name == "sequential_reptile":
        assert int(ops.convert_to_numpy(resumed.schedule.count)) == 5
    resumed.fit(x[5 * B :], y[5 * B :], batch_size=B, shuffle=False, verbose=0)
    want, got = _state(reference), _state(resumed)
    for key in want:
        _assert_close(got[key], want[key])
    check_golden(f"reptile_{name}_resumed", _flat(got))


# ----------------------------------------------------------------- NumPy oracles


def _grad(params, x, y):
    """Gradient of mean((x W + b - y)^2) (Keras's MSE on a Dense(2)) at [W, b]."""
    w, b = params
    r = 2.0 * (x @ w + b - y) / y.size
    return [x.T @ r, r.sum(0)]


def _loss(params, x, y):
    w, b = params
    return float(np.mean((x @ w + b - y) ** 2))


def _np_adam(params, grads, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-7):
    """Keras's Adam update (keras/src/optimizers/adam.py) at 1-based step t."""
    alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    m = [mi + (g - mi) * (1 - b1) for mi, g in zip(m, grads)]
    v = [vi + (g * g - vi) * (1 - b2) for vi, g in zip(v, grads)]
    params = [p - alpha * mi / (np.sqrt(vi) + eps) for p, mi, vi in zip(params, m, v)]
    return params, m, v


@pytest.mark.parametrize("reset", [False, True])
def test_sequential_reptile_equals_numpy_with_adam(float64, reset):
    """theta_k = Adam steps (global step t for the bias correction, slots zeroed at each
    outer step with `reset_inner_optimizer`), phi <- phi + eta (theta_K - phi)."""
    x, y = _data(56)  # 7 steps, K = 3: the 7th is discarded at the end of fit
    k, eta, lr, b1, b2 = 3, 0.5, 0.125, 0.5, 0.75
    trainer = SequentialReptileTrainer(
        _linear(3), inner_steps=k, outer_learning_rate=eta, reset_inner_optimizer=reset
    )
    trainer.compile(optimizer=keras.optimizers.Adam(lr, beta_1=b1, beta_2=b2), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    theta = [p.copy() for p in phi]
    m = [np.zeros_like(p) for p in phi]
    v = [np.zeros_like(p) for p in phi]
    losses = []
    for step in range(7):
        xb, yb = x[B * step : B * step + B], y[B * step : B * step + B]
        losses.append(_loss(theta, xb, yb))
        theta, m, v = _np_adam(theta, _grad(theta, xb, yb), m, v, step + 1, lr, b1, b2)
        if (step + 1) % k == 0:
            phi = [p + eta * (t - p) for p, t in zip(phi, theta)]
            theta = [p.copy() for p in phi]
            if reset:
                m = [np.zeros_like(p) for p in phi]
                v = [np.zeros_like(p) for p in phi]
    _assert_close(_weights(trainer.model), phi)
    _assert_close(_np(trainer.slow_weights), phi)
    assert int(ops.convert_to_numpy(trainer.schedule.count)) == 9
    assert int(ops.convert_to_numpy(trainer.optimizer.iterations)) == 7
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)
    if reset:  # the discarded trajectory's slots are zeroed too
        assert all(not np.any(s) for s in _np(trainer.optimizer.variables[2:]))


@pytest.mark.parametrize("name", ["reptile", "fomaml", "multi_task_reptile"])
def test_stacked_trainers_equal_numpy(float64, name):
    """Reptile: phi + eps (theta_k - phi); FOMAML: phi - lr grad L(theta_k; query);
    multi-task Reptile: phi + eps (mean_t theta_t - phi); theta from inner SGD(alpha) on
    tensors, a fresh inner optimizer per task."""
    alpha, outer = 0.125, 0.5
    k, tasks = 3, (2 if name == "multi_task_reptile" else 1)
    lead = {"reptile": (k,), "fomaml": (k + 1,), "multi_task_reptile": (tasks, k)}[name]
    x, y = _data(3 * B, seed=2, lead=lead)
    cls = {"reptile": ReptileTrainer, "fomaml": FOMAMLTrainer}.get(name, MultiTaskReptileTrainer)
    trainer = cls(_linear(6), inner_steps=k, inner_optimizer=O.SGD(alpha), stack_axis=1)
    trainer.compile(optimizer=keras.optimizers.SGD(outer), loss="mse")
    phi = _weights(trainer.model)
    history = trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    logged = []
    for element in range(3):
        xe, ye = x[B * element : B * element + B], y[B * element : B * element + B]
        if name != "multi_task_reptile":
            xe, ye = xe[:, None], ye[:, None]  # one task
        ends = []
        for t in range(tasks):
            theta = [p.copy() for p in phi]
            for i in range(k):
                if name != "fomaml":
                    logged.append(_loss(theta, xe[:, t, i], ye[:, t, i]))
                theta = [
                    w - alpha * g for w, g in zip(theta, _grad(theta, xe[:, t, i], ye[:, t, i]))
                ]
            ends.append(theta)
        if name == "fomaml":
            qx, qy = xe[:, 0, k], ye[:, 0, k]
            logged.append(_loss(ends[0], qx, qy))
            phi = [p - outer * g for p, g in zip(phi, _grad(ends[0], qx, qy))]
        else:
            mean = [np.mean([e[j] for e in ends], axis=0) for j in range(2)]
            phi = [p + outer * (m - p) for p, m in zip(phi, mean)]
    _assert_close(_weights(trainer.model), phi)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(logged), **TOL)


def test_inner_loop_is_first_order(float64):
    """d sum(theta_k) / d phi through `inner_loop` is zero (stop_gradient on JAX, nothing
    on the tape on TensorFlow); the same sum through a plain SGD step is not."""
    model = _linear(8)
    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
    x, y = _data(16)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]

    def through(inner):
        def total(params, state, batch):
            theta = inner(params)
            return sum(ops.sum(t) for t in theta), (state, None)

        _, grads, _ = F.value_and_grad(total, F.current_params(model), [], None)
        return [np.zeros(1) if g is None else ops.convert_to_numpy(g) for g in grads]

    def first_order(params):
        return A.inner_loop(
            loss_fn, params, [], batches, O.SGD(0.1), model.trainable_variables
        ).params

    def unrolled(params):  # the same SGD steps, differentiated through
        for batch in batches:
            _, grads, _ = F.value_and_grad(loss_fn, params, [], batch)
            params = [p - 0.1 * g for p, g in zip(params, grads)]
        return params

    assert all(not np.any(g) for g in through(first_order))
    assert any(np.any(g) for g in through(unrolled))


def test_task_id_batches_train_as_plain_inputs(float64):
    """x = {"inputs", "task_id"} gives the model x["inputs"]: the same run as plain x
    (fit with validation, evaluate)."""
    x, y = _data(48)
    ids = np.repeat(np.arange(6, dtype="int32") % 2, 8)
    results = []
    for inputs in (x, {"inputs": x, "task_id": ids}):
        trainer = SequentialReptileTrainer(_mlp(2), inner_steps=2, outer_learning_rate=0.5)
        trainer.compile(optimizer=O.Adam(0.01), loss="mse")
        history = trainer.fit(
            inputs, y, batch_size=B, shuffle=False, verbose=0, validation_data=(inputs, y)
        )
        results.append((_weights(trainer.model), history.history["val_loss"]))
    _assert_close(results[1][0], results[0][0])
    np.testing.assert_allclose(results[1][1], results[0][1], **TOL)


# -------------------------------------------------------- the user's model, saved


def test_save_writes_phi_and_loads_as_the_users_model(float64, tmp_path):
    """Mid-trajectory `trainer.save` writes the model at phi (the slow weights), which
    `keras.saving.load_model` gives back as a plain Sequential; the trainer keeps theta."""
    x, y = _data(40)  # 5 steps of K = 3: theta_2 of the second trajectory at the end

    class SaveAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                self.phi = _np(self.model.slow_weights)
                self.theta = _weights(self.model.model)
                self.model.save(str(tmp_path / "phi.keras"))
                self.after = _weights(self.model.model)

    trainer = _sequential_reptile()
    callback = SaveAt()
    trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[callback])
    assert not np.allclose(callback.phi[0], callback.theta[0])
    _assert_close(callback.after, callback.theta)  # theta put back after the save
    loaded = keras.saving.load_model(str(tmp_path / "phi.keras"))
    assert type(loaded) is keras.Sequential
    _assert_close(_weights(loaded), callback.phi)
    # fit's end discards the partial trajectory: the model holds phi, as loaded.
    _assert_close(_weights(trainer.model), callback.phi)
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded.predict(x[:4], verbose=0)),
        ops.convert_to_numpy(trainer.predict(x[:4], verbose=0)),
        **TOL,
    )


@pytest.mark.parametrize("name", ["sequential_reptile", "reptile"])
def test_saved_trainer_loads_and_trains_on(float64, name, tmp_path):
    """`keras.saving.save_model(trainer)` mid-run, `load_model` (config, compile config,
    state: phi and the counter, the inner optimizer's config), then one more epoch: the
    same as the trainer that was saved."""
    x, y = _case_data(name, 4, seed=4)
    trainer = CASES[name][0]()
    trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "trainer.keras")
    keras.saving.save_model(trainer, path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(trainer)
    assert loaded.inner_steps == trainer.inner_steps
    for key, values in _state(trainer).items():
        _assert_close(_state(loaded)[key], values)
    trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for key, values in _state(trainer).items():
        _assert_close(_state(loaded)[key], values)


# ------------------------------------------------------------ 1 device == 2 devices


@pytest.mark.skipif(not on_jax(), reason="keras.distribution: JAX")
@pytest.mark.parametrize("name", list(CASES))
def test_two_devices_equal_one(float64, name):
    """DataParallel over 2 CPU devices: Keras shards the batch and the step sees the
    global batch, so every trainer computes what one device computes (see the
    trainers' docstrings: on JAX the per-replica semantics are the one-replica ones)."""
    jax_devices(2)
    x, y = _case_data(name, 6, seed=3)
    results = []
    for devices in (1, 2):
        with data_parallel(devices):
            trainer = CASES[name][0]()
            history = trainer.fit(x, y, batch_size=B, shuffle=False, verbose=0)
            results.append((_state(trainer), history.history["loss"]))
    (one, loss_one), (two, loss_two) = results
    for key in one:
        _assert_close(two[key], one[key], dict(rtol=1e-9, atol=1e-12))
    np.testing.assert_allclose(loss_two, loss_one, rtol=1e-9)
