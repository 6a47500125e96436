"""`MultiTaskTrainer` on both backends (no TensorFlow import: the JAX env runs it too).

* TensorFlow == JAX at float64 through golden files (`golden_io.check_golden`, computed
  on TensorFlow): every registry method through `fit` on task-id rows (the "factored"
  pass, or one weighted pass for the loss-weighting methods), the two task layouts
  (`tasks="outputs"`: masked passes and the task-specific heads read from the graph),
  `rep_grad`, and the stateful methods (UW's trained log-variances, GradVac's targets,
  Nash-MTL's warm start) with their state in the golden.
* `sum` == plain Keras `fit` of the multi-output model, on the same backend.
* JAX: 1 device == 2 devices (`keras.distribution.DataParallel`: the step sees the global
  batch).
* The old per-method keywords == `method_options` == the method object, bit for bit, with
  a DeprecationWarning naming the new spelling; an unknown option names the method and its
  options.

Default run: ~2-3 min per backend on 2 busy cores (about 35 small fits); the outputs-layout
sweep of the rest of the registry is `slow`.
"""

import keras
import numpy as np
import pytest
from backends import data_parallel, on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops

from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.trainers import MultiTaskTrainer

BACKENDS = ("tensorflow", "jax")

T = 3
METHODS = methods.method_names()
#: The outputs-layout golden runs by default for these (stateful ones included); the
#: rest of the registry under -m slow.
OUTPUT_METHODS_DEFAULT = ("sum", "uw", "pcgrad", "gradvac", "nash_mtl")


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


def _rows_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh", name="encoder")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))


def _outputs_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh", name="encoder")(inputs)
    outputs = {
        t: keras.layers.Dense(1, name=t)(keras.layers.Dense(3, activation="tanh")(hidden))
        for t in ("a", "b", "c")
    }
    return keras.Model(inputs, outputs)


def _rows_data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    task_id = rng.integers(0, T, size=n).astype("int32")
    w = rng.normal(size=(T, 4))
    y = np.einsum("nd,nd->n", x, w[task_id])[:, None] + 0.1 * task_id[:, None]
    return {"inputs": x, "task_id": task_id}, y


def _outputs_data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    return x, {t: x[:, i : i + 1] * (i + 1) - 0.5 for i, t in enumerate(("a", "b", "c"))}


def _fit(trainer, x, y, epochs=2, **compile_kwargs):
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), **compile_kwargs)
    history = trainer.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return history


def _state_arrays(trainer):
    arrays = {f"w{i}": _np(w) for i, w in enumerate(trainer.model.trainable_variables)}
    for key, variable in trainer.method_state.items():
        arrays[f"state_{key}"] = _np(variable.value)
    return arrays


def _rows_trainer(method, **kwargs):
    model = _rows_model()
    set_numpy_weights(model, seed=1)
    return MultiTaskTrainer(model, num_tasks=T, method=method, seed=3, **kwargs)


def _outputs_trainer(method, **kwargs):
    model = _outputs_model()
    set_numpy_weights(model, seed=2)
    return MultiTaskTrainer(model, method=method, seed=3, **kwargs)


OUTPUT_LOSSES = {"a": "mse", "b": "mse", "c": "mse"}


# ------------------------------------------------------------ TensorFlow == JAX


@pytest.mark.parametrize("method", METHODS)
def test_every_method_on_task_rows_matches_the_golden(float64, method):
    trainer = _rows_trainer(method)
    x, y = _rows_data()
    _fit(trainer, x, y, loss="mse")
    assert trainer._task_passes_used() == "factored"
    check_golden(f"multitask_rows_{method}", _state_arrays(trainer))


@pytest.mark.parametrize(
    "method",
    [
        m if m in OUTPUT_METHODS_DEFAULT else pytest.param(m, marks=pytest.mark.slow)
        for m in METHODS
    ],
)
def test_every_method_on_output_tasks_matches_the_golden(float64, method):
    trainer = _outputs_trainer(method)
    x, y = _outputs_data()
    _fit(trainer, x, y, loss=OUTPUT_LOSSES)
    assert trainer.task_names == ["a", "b", "c"]
    assert len(trainer.task_specific_variables) == 12  # each output's two Dense layers
    check_golden(f"multitask_outputs_{method}", _state_arrays(trainer))


@pytest.mark.parametrize("method", ["pcgrad", "mgda", "nash_mtl"])
def test_rep_grad_matches_the_golden(float64, method):
    trainer = _outputs_trainer(method, rep_grad=True)
    x, y = _outputs_data()
    _fit(trainer, x, y, loss=OUTPUT_LOSSES)
    check_golden(f"multitask_rep_grad_{method}", _state_arrays(trainer))


@pytest.mark.parametrize("method", ["gradvac", "uw"])
def test_masked_passes_on_rows_with_a_task_specific_head_match_the_golden(float64, method):
    trainer = _rows_trainer(
        method,
        task_passes="masked",
        task_specific_variables=["head/kernel", "head/bias"],
        measure_task_cosine=True,
    )
    x, y = _rows_data()
    history = _fit(trainer, x, y, loss="mse")
    assert "task_cosine" in history.history
    check_golden(f"multitask_rows_masked_{method}", _state_arrays(trainer))


# ------------------------------------------------------------- oracles, same backend


def test_sum_is_plain_multi_output_fit(float64):
    plain = _outputs_model()
    set_numpy_weights(plain, seed=2)
    trainer = _outputs_trainer("sum")
    x, y = _outputs_data()
    _fit(plain, x, y, loss=OUTPUT_LOSSES)
    _fit(trainer, x, y, loss=OUTPUT_LOSSES)
    for a, b in zip(plain.trainable_variables, trainer.model.trainable_variables):
        np.testing.assert_allclose(_np(b), _np(a), rtol=1e-13, atol=1e-15)


@pytest.mark.skipif(not on_jax(), reason="JAX devices (TF: the two-replica tests)")
@pytest.mark.parametrize("layout, method", [("rows", "pcgrad"), ("outputs", "nash_mtl")])
def test_one_device_equals_two_devices_on_jax(float64, layout, method):
    make, data, compile_kwargs = {
        "rows": (_rows_trainer, _rows_data, {"loss": "mse"}),
        "outputs": (_outputs_trainer, _outputs_data, {"loss": OUTPUT_LOSSES}),
    }[layout]
    x, y = data()
    one = make(method)
    _fit(one, x, y, **compile_kwargs)
    with data_parallel(2):
        two = make(method)
        _fit(two, x, y, **compile_kwargs)
    for a, b in zip(_state_arrays(one).values(), _state_arrays(two).values()):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ method options


def test_old_keywords_equal_method_options_and_the_method_object(float64):
    x, y = _rows_data()
    with pytest.warns(DeprecationWarning, match=r"method_options=\{'beta': 0.2\}"):
        old = _rows_trainer("gradvac", gradvac_beta=0.2)
    new = _rows_trainer("gradvac", method_options={"beta": 0.2})
    obj = _rows_trainer(methods.GradVac(beta=0.2))
    results = []
    for trainer in (old, new, obj):
        _fit(trainer, x, y, epochs=1, loss="mse")
        results.append(_state_arrays(trainer))
    for other in results[1:]:
        for key, value in results[0].items():
            np.testing.assert_array_equal(other[key], value)
    with pytest.warns(DeprecationWarning, match="learning_rate"):
        old = _rows_trainer("gradnorm", gradnorm_learning_rate=0.05, gradnorm_alpha=1.0)
    assert old.method_object == methods.GradNorm(learning_rate=0.05, alpha=1.0)


def test_bad_method_options_name_the_method_and_its_options():
    with pytest.raises(ValueError, match=r"method='pcgrad'.*PCGrad.*options"):
        _rows_trainer("pcgrad", method_options={"beta": 0.1})
    with pytest.raises(ValueError, match=r"\['rank'\].*'cagrad'.*calpha"):
        _rows_trainer("cagrad", method_options={"rank": 2})
    with pytest.raises(ValueError, match="gradvac_beta"):
        _rows_trainer("pcgrad", gradvac_beta=0.1)
    with pytest.raises(ValueError, match="once"):
        _rows_trainer("gradvac", gradvac_beta=0.1, method_options={"beta": 0.2})


def test_tensorflow_only_passes_name_the_backend():
    if not on_jax():
        assert _rows_trainer("pcgrad", task_passes="gathered").task_passes == "gathered"
        return
    with pytest.raises(ValueError, match="task_passes.*TensorFlow"):
        _rows_trainer("pcgrad", task_passes="vectorized")
