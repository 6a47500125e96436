"""`MAMLTrainer` on both backends (backend-neutral: no TensorFlow import).

* TensorFlow == JAX at float64: the trainer's trajectory (weights, BatchNorm statistics,
  learned inner rates, gradient sharing's m, lambda and g_hat, MAML++'s per-step
  statistics, optimizer state, logged losses) from the same weights (NumPy-drawn) on the
  same episodes, then `evaluate`, `predict` and `adapt` on other episodes, against golden
  files written on TensorFlow: second order, first order, Meta-SGD, MAML++ (LSLR,
  multi-step loss, per-step BatchNorm statistics, derivative-order annealing), gradient
  sharing. On JAX the tasks run in parallel (`jax.vmap`); TensorFlow runs them one after
  another: the goldens show the same numbers, BatchNorm statistics included.
* The second-order meta-gradient through BatchNorm (batch statistics) against float64
  central finite differences of the adapted query loss, on each backend.
* JAX: 1 device == 2 devices (`keras.distribution.DataParallel`).

NumPy episodes only (support_x [T, N, 4], ...): the same batches reach both backends.
"""

import keras
import numpy as np
import pytest
from backends import data_parallel, jax_devices, on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.trainers import MAMLTrainer

BACKENDS = ("tensorflow", "jax")

TOL = dict(rtol=1e-10, atol=1e-12)
TASKS = 3  # tasks per meta-batch


def _episodes(num_tasks, seed=0, n_support=5, n_query=4):
    """Regression tasks y = tanh(x A_t) + 0.1 x[:, :2]: ((sx, sy, qx), qy), float64."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(num_tasks, 4, 2))
    sx = rng.normal(size=(num_tasks, n_support, 4))
    qx = rng.normal(size=(num_tasks, n_query, 4))

    def f(x):
        return np.tanh(x @ a) + 0.1 * x[..., :2]

    return (sx, f(sx), qx), f(qx)


def _bn_model(seed=0):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(2),
        ]
    )
    set_numpy_weights(model, seed=200 + seed)
    return model


CASES = {
    "second_order": dict(inner_steps=2, inner_learning_rate=0.3),
    "first_order": dict(inner_steps=2, inner_learning_rate=0.3, first_order=True),
    "meta_sgd": dict(
        inner_steps=2, inner_learning_rate=0.2, learn_inner_learning_rates="per_parameter"
    ),
    "maml_pp": dict(
        inner_steps=2,
        inner_learning_rate=0.2,
        learn_inner_learning_rates="per_layer_per_step",
        multi_step_loss=True,
        multi_step_loss_epochs=2,
        first_order_epochs=1,
        per_step_batch_norm_statistics=True,
    ),
    "sharing": dict(inner_steps=2, inner_learning_rate=0.3, gradient_sharing=True),
}


def _trainer(name, seed=0):
    trainer = MAMLTrainer(_bn_model(seed), **CASES[name])
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return trainer


def _np(values):
    return [np.asarray(ops.convert_to_numpy(v), dtype="float64") for v in values]


def _float_variables(trainer):
    """Every floating variable of the trainer (the model's, the learned rates, m, lambda,
    g_hat, the per-step statistics), by position."""
    floats = [v for v in trainer.variables if "float" in keras.backend.standardize_dtype(v.dtype)]
    return {f"v{i:02d}_{v.name}": np.asarray(ops.convert_to_numpy(v)) for i, v in enumerate(floats)}


def _run(name):
    """fit 2 epochs of 2 meta-batches, then evaluate / predict / adapt on new episodes."""
    x, y = _episodes(2 * TASKS, seed=1)
    trainer = _trainer(name)
    history = trainer.fit(x, y, batch_size=TASKS, epochs=2, shuffle=False, verbose=0)
    arrays = _float_variables(trainer)
    for key, values in history.history.items():
        arrays[f"log_{key}"] = np.asarray(values, dtype="float64")
    (sx, sy, qx), qy = _episodes(TASKS, seed=2)
    logs = trainer.evaluate((sx, sy, qx), qy, batch_size=TASKS, verbose=0, return_dict=True)
    arrays["evaluate_loss"] = np.asarray(logs["loss"])
    arrays["predict"] = np.asarray(trainer.predict((sx, sy, qx), batch_size=TASKS, verbose=0))
    adapted = trainer.adapt(sx, sy)
    for t, weights in enumerate(adapted):
        for i, w in enumerate(_np(weights)):
            arrays[f"adapt_{t}_{i}"] = w
    return trainer, arrays


@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_equals_tensorflow(float64, name, monkeypatch):
    # JAX: the tasks vmapped (what GPUs and TPUs run; CPUs loop by default).
    monkeypatch.setattr(M, "JAX_TASK_MAP", "vmap")
    _, arrays = _run(name)
    check_golden(f"maml_{name}", arrays, **TOL)


@pytest.mark.parametrize("name", ["second_order", pytest.param("maml_pp", marks=pytest.mark.slow)])
def test_trajectory_with_the_task_loop_equals_tensorflow(float64, name, monkeypatch):
    """JAX's unrolled task loop (its CPU default) gives the same trajectory."""
    if not on_jax():
        pytest.skip("JAX_TASK_MAP is JAX's")
    monkeypatch.setattr(M, "JAX_TASK_MAP", "loop")
    _, arrays = _run(name)
    check_golden(f"maml_{name}", arrays, **TOL)


def test_predict_is_the_adapted_model_on_each_query_set(float64):
    """predict == the model called at adapt's weights on each task's query set (the
    evaluation passes: training=True, batch statistics)."""
    trainer = _trainer("second_order")
    (sx, sy, qx), _ = _episodes(TASKS, seed=4)
    predicted = trainer.predict((sx, sy, qx), batch_size=TASKS, verbose=0)
    adapted = trainer.adapt(sx, sy)
    state = F.current_state(trainer.model)
    for t in range(TASKS):
        out, _ = trainer.model.stateless_call(
            adapted[t], state, ops.convert_to_tensor(qx[t]), training=True
        )
        np.testing.assert_allclose(predicted[t], ops.convert_to_numpy(out), **TOL)


def test_second_order_through_batch_norm_equals_finite_differences(float64):
    """d/dtheta of the adapted query loss (2 inner steps through BatchNorm's batch
    statistics) == central differences in float64: the second derivatives of BatchNorm
    are exact on this backend."""
    model = _bn_model(3)
    (sx, sy, qx), qy = _episodes(2, seed=5)
    supports = [(sx[t], sy[t]) for t in range(2)]
    queries = [(qx[t], qy[t]) for t in range(2)]
    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
    params, state = F.current_params(model), F.current_state(model)
    n = len(params)

    def lrs(h):
        return [[0.3] * n, [0.3] * n]

    r = M.meta_gradient(loss_fn, loss_fn, params, state, supports, queries, {}, lrs)
    flat = np.concatenate([np.ravel(p) for p in _np(params)])

    def objective(vector):
        weights, i = [], 0
        for p in params:
            size = int(np.prod(p.shape))
            weights.append(ops.convert_to_tensor(vector[i : i + size].reshape(p.shape)))
            i += size
        loss, *_ = M.adapt_and_evaluate(
            loss_fn, loss_fn, weights, state, supports, queries, lrs({})
        )
        return float(loss)

    # Directional derivatives along random directions (each a central difference).
    eps = 1e-5
    directions = np.random.default_rng(7).normal(size=(3, flat.size))
    fd = np.array(
        [(objective(flat + eps * v) - objective(flat - eps * v)) / (2 * eps) for v in directions]
    )
    got = directions @ np.concatenate([np.ravel(g) for g in _np(r.grads)])
    np.testing.assert_allclose(got, fd, rtol=1e-7, atol=1e-10)
    # First order differs here: the check can tell them apart.
    fo = M.meta_gradient(
        loss_fn, loss_fn, params, state, supports, queries, {}, lrs, first_order=True
    )
    fo_got = directions @ np.concatenate([np.ravel(g) for g in _np(fo.grads)])
    assert np.max(np.abs(fo_got - fd)) > 1e-4


@pytest.mark.skipif(not on_jax(), reason="keras.distribution: JAX")
@pytest.mark.parametrize("name", ["second_order", pytest.param("maml_pp", marks=pytest.mark.slow)])
def test_two_devices_equal_one(float64, name):
    """DataParallel over 2 CPU devices: Keras shards the tasks and the step sees the
    global meta-batch, so the trainer computes what one device computes."""
    jax_devices(2)
    x, y = _episodes(4, seed=6)
    results = []
    for devices in (1, 2):
        with data_parallel(devices):
            trainer = _trainer(name)
            history = trainer.fit(x, y, batch_size=2, shuffle=False, verbose=0)
            results.append((_float_variables(trainer), history.history["loss"]))
    (one, loss_one), (two, loss_two) = results
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(loss_two, loss_one, rtol=1e-9)


def test_fit_on_the_numpy_episode_route_equals_fit_on_its_arrays():
    """`SinusoidTasks.dataset(n, as_numpy=True)` (no TensorFlow) feeds `fit` and
    `evaluate`: the same training as the same batches given as arrays."""
    from tf_metaalign.data.sinusoid import SinusoidTasks

    tasks = SinusoidTasks(shots=5, queries=5, tasks_per_batch=2, seed=3)
    results = []
    for route in ("pydataset", "arrays"):
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        set_numpy_weights(model, seed=9)
        # tasks_per_batch: TensorFlow traces a PyDataset's batches with a dynamic task axis.
        trainer = MAMLTrainer(model, inner_steps=1, inner_learning_rate=0.05, tasks_per_batch=2)
        trainer.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        if route == "pydataset":
            history = trainer.fit(tasks.dataset(3, as_numpy=True), shuffle=False, verbose=0)
            loss = trainer.evaluate(tasks.dataset(1, as_numpy=True), verbose=0)
        else:
            batches = [tasks.batch(i) for i in range(3)]
            x = tuple(np.concatenate([b[0][j] for b in batches]) for j in range(3))
            y = np.concatenate([b[1] for b in batches])
            history = trainer.fit(x, y, batch_size=2, shuffle=False, verbose=0)
            (sx, sy, qx), qy = tasks.batch(0)
            loss = trainer.evaluate((sx, sy, qx), qy, batch_size=2, verbose=0)
        results.append((_np(model.trainable_variables), history.history["loss"], loss))
    (w1, h1, l1), (w2, h2, l2) = results
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(h1, h2, rtol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
