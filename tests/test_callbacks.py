"""tf_metaalign.callbacks.MultiTaskDiagnostics against NumPy closed forms."""

import itertools

import keras
import numpy as np
import pytest

from tf_metaalign.callbacks import MultiTaskDiagnostics
from tf_metaalign.trainers import DotProdTrainer


def _tasks(seed=0, n=16):
    rng = np.random.default_rng(seed)
    out = {}
    for t, name in enumerate(["a", "b", "c"]):
        x = rng.normal(size=(n, 3)).astype("float32")
        w = rng.normal(size=(3, 2)) * (t + 1)
        out[name] = (x, (x @ w).astype("float32"))
    return out


def _linear(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])


def _numpy_grad(w, x, y):
    # d/dW mean((xW - y)^2) over all n*d entries
    return 2.0 * x.T @ (x @ w - y) / y.size


def test_cosine_and_distance_equal_closed_forms():
    tasks = _tasks()
    model = _linear()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callback = MultiTaskDiagnostics(tasks)
    callback.set_model(model)
    w0 = model.trainable_variables[0].numpy().astype(np.float64)
    callback.reset_initial_weights()
    w1 = w0 + 0.3
    model.trainable_variables[0].assign(w1)
    values = callback.measure()
    grads = [_numpy_grad(w1, x.astype(np.float64), y.astype(np.float64)) for x, y in tasks.values()]
    cos = [
        np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b)
        for a, b in itertools.combinations(grads, 2)
    ]
    np.testing.assert_allclose(values["task_gradient_cosine"], np.mean(cos), rtol=1e-5)
    np.testing.assert_allclose(values["distance_from_initial"], np.linalg.norm(w1 - w0), rtol=1e-5)


def test_in_history_with_a_trainer_and_with_multitask_dict_batches(tmp_path):
    tasks = _tasks()
    batches = {
        name: ({"inputs": x, "task_id": np.full(len(x), t, "int32")}, y)
        for t, (name, (x, y)) in enumerate(tasks.items())
    }
    trainer = DotProdTrainer(_linear(), weight=0.0)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = MultiTaskDiagnostics(batches, every_n_batches=2, log_dir=tmp_path)
    x = np.concatenate([v[0] for v in tasks.values()])
    y = np.concatenate([v[1] for v in tasks.values()])
    history = trainer.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback]
    )
    for key in ("task_gradient_cosine", "distance_from_initial"):
        assert len(history.history[key]) == 2 and np.isfinite(history.history[key]).all()
    # Distance grows from 0 as training moves the weights; 12 batches -> 6 periodic + 2 epoch ends.
    assert (
        0
        < history.history["distance_from_initial"][0]
        < history.history["distance_from_initial"][1]
    )
    assert len(callback.history) == 8
    assert list((tmp_path / "diagnostics").iterdir())


def test_bad_arguments():
    with pytest.raises(ValueError, match="`task_batches`.*at least two"):
        MultiTaskDiagnostics({"a": _tasks()["a"]})
    with pytest.raises(ValueError, match="every_n_batches"):
        MultiTaskDiagnostics(_tasks(), every_n_batches=0)
    with pytest.raises(ValueError, match=r"task_batches\['a'\]"):
        MultiTaskDiagnostics({"a": np.zeros(3), "b": _tasks()["b"]})
