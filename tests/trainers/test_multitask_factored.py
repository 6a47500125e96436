"""MultiTaskTrainer(task_passes="factored"): the gradient methods without per-task gradients.

* `gradient_surgery.dense_task_gram` / `dense_combined_gradient` == the Gram matrix and the
  combination of per-task gradients formed explicitly (NumPy);
* the trainer's "factored" step == its "masked" step (one forward pass, T masked backward
  passes) for every gradient method, on a shared-bottom model with per-task heads, with
  dropout (the same masks: both take one forward pass), a task absent from a batch,
  sample weights and a kernel regulariser; 1 replica == 2 (uneven batches: the Gram
  matrix needs the replicas' rows all-gathered); XLA == graph;
* "auto" picks it where it applies, and an explicit request says why it does not.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.data.multitask import one_head_per_task_model
from tf_metaalign.trainers import MultiTaskTrainer

T = 3
GRADIENT_METHODS = [
    name for name in methods.method_names() if methods.get_method(name).uses_gradients
]


@pytest.mark.parametrize("has_bias", [True, False])
def test_dense_task_gram_and_combination_equal_explicit_per_task_gradients(float64, has_bias):
    rng = np.random.default_rng(0)
    x, dz = rng.normal(size=(11, 4)), rng.normal(size=(11, 3))
    task = rng.integers(0, T, size=11)
    task[task == 2] = 1  # task 2 absent: a zero row and column
    onehot = np.eye(T)[task]
    grads = []
    for t in range(T):
        rows = task == t
        g = [x[rows].T @ dz[rows]] + ([dz[rows].sum(0)] if has_bias else [])
        grads.append(np.concatenate([a.ravel() for a in g]))
    grads = np.stack(grads)
    gram = GS.dense_task_gram(x, dz, onehot, has_bias=has_bias).numpy()
    np.testing.assert_allclose(gram, grads @ grads.T, rtol=1e-12, atol=1e-12)
    assert gram[2].tolist() == [0.0] * T
    c = np.array([0.3, -1.7, 2.0])
    combined = GS.dense_combined_gradient(x, dz, c[task], has_bias=has_bias)
    flat = np.concatenate([g.numpy().ravel() for g in combined])
    np.testing.assert_allclose(flat, c @ grads, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="rows, features"):
        GS.dense_task_gram(x[None], dz[None], onehot)


def _model(dropout=0.0, l2=0.0, batch_norm=False, layer_norm=False, seed=1):
    keras.utils.set_random_seed(seed)
    regularizer = keras.regularizers.L2(l2) if l2 else None
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", kernel_regularizer=regularizer)(inputs)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    if layer_norm:
        h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(5, activation="relu", use_bias=False)(h)
    return one_head_per_task_model(keras.Model(inputs, h), [2] * T)


def _data(n=27):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4))
    y = rng.normal(size=(n, 2))
    task = rng.integers(0, T, size=n).astype("int32")
    task[18:] = np.where(task[18:] == 2, 0, task[18:])  # task 2 absent from batch 3
    y[task == 1] *= -3.0  # a conflicting task
    return {"inputs": x, "task_id": task}, y


def _train(passes, method, strategy=None, jit_compile=False, weights=None, **model_kwargs):
    options = model_kwargs.pop("method_options", None)
    x, y = _data()
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        trainer = MultiTaskTrainer(
            _model(**model_kwargs),
            num_tasks=T,
            method=method,
            model_takes_task_id=True,
            task_passes=passes,
            method_options=options,
        )
        trainer.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=keras.losses.MeanSquaredError(),
            metrics=["mae"],
            jit_compile=jit_compile,
        )
    h = trainer.fit(x, y, sample_weight=weights, batch_size=9, epochs=2, shuffle=False, verbose=0)
    state = [v.numpy() for v in trainer.method_state.values()]
    return [v.numpy() for v in trainer.model.trainable_variables] + state, h.history, trainer


def _assert_same(a, b, rtol=1e-10):
    for u, v in zip(a[0], b[0]):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-12)
    for key in ("loss", "mae", "task_cosine"):
        np.testing.assert_allclose(a[1][key], b[1][key], rtol=1e-6)  # float32 metrics


@pytest.mark.parametrize("method", GRADIENT_METHODS)
def test_factored_equals_masked_for_every_gradient_method(float64, method):
    """GradNorm included: its layer norms are the square roots of the diagonal of its
    layer's own Gram matrix (`TaskInputs.variable_gram`), its weights method state."""
    factored = _train("factored", method)
    assert factored[2]._task_passes_used() == "factored"
    _assert_same(factored, _train("masked", method))


@pytest.mark.parametrize(
    "model_kwargs", [dict(dropout=0.5), dict(l2=0.0625)], ids=["dropout", "regularizer"]
)
def test_factored_equals_masked_with_dropout_weights_and_model_losses(float64, model_kwargs):
    """Dropout: both take ONE forward pass over the batch, so the masks are the same
    (unlike "vectorized", which shares them across tasks). A kernel regulariser's gradient
    is added once, after the combination, as "masked" adds it."""
    weights = np.linspace(0.5, 2.0, 27)
    factored = _train("factored", "pcgrad", weights=weights, **model_kwargs)
    _assert_same(factored, _train("masked", "pcgrad", weights=weights, **model_kwargs))


def test_factored_gradnorm_on_a_bias_equals_masked(float64):
    """GradNorm's layer may be a bias: its Gram matrix is S^T (dZ dZ^T) S."""
    options = {"variable": 1, "learning_rate": 0.3}  # the first Dense layer's bias
    _assert_same(
        _train("factored", "gradnorm", method_options=options),
        _train("masked", "gradnorm", method_options=options),
    )


@pytest.mark.parametrize("method", ["pcgrad", "mgda"])
def test_factored_two_replicas_equal_one(float64, method):
    """The Gram matrix of the GLOBAL per-task gradients has cross-replica terms: the
    replicas' rows (4 and 5 of a batch of 9) are all-gathered for it."""
    _assert_same(_train("factored", method), _train("factored", method, two_cpu_strategy()))


def test_factored_under_xla_equals_the_graph_step(float64):
    """Its shapes are static (X, dZ [B, d], the Gram matrix [T, T]), so "auto" takes it
    under jit_compile=True too, where "vectorized" has no static shape."""
    xla = _train("auto", "cagrad", jit_compile=True)
    assert xla[2]._task_passes_used() == "factored"
    _assert_same(xla, _train("factored", "cagrad"))


def test_auto_takes_factored_where_it_applies_and_says_why_not_elsewhere():
    def used(model, method="pcgrad", **kwargs):
        trainer = MultiTaskTrainer(
            model, num_tasks=T, method=method, model_takes_task_id=True, **kwargs
        )
        return trainer._task_passes_used()

    assert used(_model()) == "factored"
    assert used(_model(dropout=0.5)) == "factored"
    assert used(_model(l2=0.1)) == "factored"
    assert used(_model(layer_norm=True)) == "vectorized"
    assert used(_model(batch_norm=True)) == "gathered"
    assert used(_model(), method="gradnorm") == "factored"
    cases = [
        (_model(layer_norm=True), "pcgrad", "layer_normalization"),
        (_model(batch_norm=True), "pcgrad", "moving_mean"),
    ]
    x, y = _data(9)
    for model, method, message in cases:
        trainer = MultiTaskTrainer(
            model, num_tasks=T, method=method, model_takes_task_id=True, task_passes="factored"
        )
        trainer.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match=f"(?s)task_passes='factored'.*{message}"):
            trainer.fit(x, y, batch_size=9, verbose=0)
    with pytest.raises(ValueError, match="task_passes"):
        MultiTaskTrainer(_model(), num_tasks=2, tasks="outputs", task_passes="factored")


def test_a_dense_layer_called_twice_is_refused():
    """A Dense layer reused on two inputs has a gradient summed over two calls, whose
    Gram matrix the one-call formula does not give: "auto" does not take the pass."""
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh")
    h = shared(shared(inputs))
    model = one_head_per_task_model(keras.Model(inputs, h), [2] * T)
    trainer = MultiTaskTrainer(model, num_tasks=T, method="pcgrad", model_takes_task_id=True)
    assert trainer._task_passes_used() == "vectorized"
