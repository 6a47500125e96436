"""tf_metaalign.callbacks on both backends, in the `fit` of a minimal trainer (the seam's
PlainTrainer) and of a plain Keras model: MultiTaskDiagnostics against NumPy closed forms
at the weights of the batch it measures (on JAX those are the values Keras keeps out of
the variables during an epoch), DivergenceGuard, MultiWorkerBackupAndRestore's resume ==
an uninterrupted run, and the TensorFlow-only options' errors. ~15 s per backend."""

import importlib.util
import itertools

import keras
import numpy as np
import pytest
from test_backend_seam import PlainTrainer

from tf_metaalign import backend
from tf_metaalign.callbacks import (
    DivergenceGuard,
    MultiTaskDiagnostics,
    MultiWorkerBackupAndRestore,
)

BACKENDS = ("tensorflow", "jax")

HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


def _linear(seed=0):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.weights])
    return model


def _tasks(n=8):
    rng = np.random.default_rng(1)
    out = {}
    for t, name in enumerate(["a", "b", "c"]):
        x = rng.normal(size=(n, 3)).astype("float32")
        out[name] = (x, (x @ rng.normal(size=(3, 2)) * (t + 1)).astype("float32"))
    return out


def _train_data(n=24):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, (x @ rng.normal(size=(3, 2))).astype("float32")


def _closed_form(weights, initial, tasks):
    """(mean pairwise cosine of the mse gradients, distance from `initial`) in float64."""
    w, b = (np.asarray(v, np.float64) for v in weights)
    grads = []
    for x, y in tasks.values():
        x, y = x.astype(np.float64), y.astype(np.float64)
        r = 2.0 * (x @ w + b - y) / y.size
        grads.append(np.concatenate([(x.T @ r).ravel(), r.sum(0)]))
    cos = [
        a @ c / np.linalg.norm(a) / np.linalg.norm(c) for a, c in itertools.combinations(grads, 2)
    ]
    flat = np.concatenate([np.ravel(v) for v in weights]).astype(np.float64)
    distance = np.linalg.norm(flat - np.concatenate([np.ravel(v) for v in initial]))
    return float(np.mean(cos)), float(distance)


class WeightsAtBatchEnd(keras.callbacks.Callback):
    """The network's weights after every batch (read through `self.model`, which puts
    them back into the variables on JAX)."""

    def __init__(self, network):
        super().__init__()
        self.network = network
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.model  # noqa: B018 - syncs the state on JAX, as the callback under test does
        self.weights.append([np.array(w) for w in self.network.get_weights()])


@pytest.mark.parametrize("wrap", ["plain", "trainer"])
def test_diagnostics_between_batches_measure_that_batchs_weights(wrap):
    x, y = _train_data()
    tasks = _tasks()

    def run(callbacks_for):
        network = _linear()
        model = PlainTrainer(network) if wrap == "trainer" else network
        model.compile(keras.optimizers.SGD(0.05), "mse")
        callbacks = callbacks_for(network)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return network, callbacks

    initial = _linear().get_weights()
    network, (diagnostics, recorder) = run(
        lambda net: [MultiTaskDiagnostics(tasks, every_n_batches=2), WeightsAtBatchEnd(net)]
    )
    # every 2nd batch of 6, then each epoch's end: steps 2, 3 (end), 4, 6, 6 (end)
    assert [step for step, _ in diagnostics.history] == [2, 3, 4, 6, 6]
    for step, values in diagnostics.history:
        cosine, distance = _closed_form(recorder.weights[step - 1], initial, tasks)
        np.testing.assert_allclose(values["task_gradient_cosine"], cosine, rtol=2e-5)
        np.testing.assert_allclose(values["distance_from_initial"], distance, rtol=2e-5)
    # measuring between batches does not change the training
    plain, _ = run(lambda net: [])
    for a, b in zip(plain.get_weights(), network.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_diagnostics_go_into_history():
    x, y = _train_data()
    network = _linear()
    trainer = PlainTrainer(network)
    trainer.compile(keras.optimizers.SGD(0.05), "mse")
    history = trainer.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[MultiTaskDiagnostics(_tasks())]
    )
    cosine, distance = _closed_form(network.get_weights(), _linear().get_weights(), _tasks())
    np.testing.assert_allclose(history.history["task_gradient_cosine"][-1], cosine, rtol=2e-5)
    np.testing.assert_allclose(history.history["distance_from_initial"][-1], distance, rtol=2e-5)


def test_divergence_guard_stops_a_diverging_fit_and_spares_a_healthy_one():
    x = np.linspace(-3, 3, 32).astype("float32")[:, None]

    def fit(learning_rate):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.set_weights([np.ones((1, 1), "float32"), np.zeros(1, "float32")])
        model.compile(keras.optimizers.SGD(learning_rate), "mse")
        guard = DivergenceGuard(action="stop", every_n_batches=2, advice="lower it")
        with pytest.warns(RuntimeWarning) if learning_rate > 1 else _no_warning():
            history = model.fit(
                x, 5 * x, batch_size=8, epochs=20, shuffle=False, verbose=0, callbacks=[guard]
            )
        return len(history.history["loss"]), guard.fired

    epochs, fired = fit(10.0)
    assert epochs == 1 and fired.startswith("Training is diverging (epoch 1, batch 2)")
    assert fired.endswith("lower it")
    assert fit(0.01) == (20, None)


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


class StopAt(keras.callbacks.Callback):
    """Raise (a lost worker) at `epoch`, `batch`."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("worker lost")


@pytest.mark.parametrize("wrap, save_freq", [("plain", "epoch"), ("trainer", 2)])
def test_backup_resume_equals_an_uninterrupted_fit(tmp_path, wrap, save_freq):
    x, y = _train_data()

    def model():
        network = _linear()
        trainer = PlainTrainer(network) if wrap == "trainer" else network
        trainer.compile(keras.optimizers.Adam(0.01), "mse")
        return network, trainer

    def fit(trainer, *callbacks):
        trainer.fit(
            x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=list(callbacks)
        )

    reference, trainer = model()
    fit(trainer)
    backup = str(tmp_path / "backup")
    _, trainer = model()
    with pytest.raises(RuntimeError, match="worker lost"):
        fit(trainer, MultiWorkerBackupAndRestore(backup, save_freq=save_freq), StopAt(1, 4))
    resumed, trainer = model()
    fit(trainer, MultiWorkerBackupAndRestore(backup, save_freq=save_freq))
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not backend.is_jax(), reason="JAX processes")
def test_backup_refuses_a_multi_process_jax_job(tmp_path, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    model = _linear()
    model.compile("sgd", "mse")
    x, y = _train_data()
    with pytest.raises(NotImplementedError, match="2 processes.*MultiWorkerMirroredStrategy"):
        model.fit(x, y, verbose=0, callbacks=[MultiWorkerBackupAndRestore(str(tmp_path))])


@pytest.mark.skipif(HAS_TENSORFLOW, reason="the error of an environment without TensorFlow")
def test_tensorboard_logs_without_tensorflow_name_log_dir(tmp_path):
    with pytest.raises(ImportError, match=r"log_dir=\.\.\..*needs TensorFlow.*log_dir=None"):
        MultiTaskDiagnostics(_tasks(), log_dir=str(tmp_path))


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="tf.summary needs TensorFlow")
def test_tensorboard_logs_where_tensorflow_is_installed(tmp_path):
    """On either backend (on JAX: JAX beside tensorflow-cpu)."""
    x, y = _train_data()
    model = _linear()
    model.compile("sgd", "mse")
    diagnostics = MultiTaskDiagnostics(_tasks(), log_dir=str(tmp_path))
    model.fit(x, y, epochs=2, verbose=0, callbacks=[diagnostics])
    events = list((tmp_path / "diagnostics").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
