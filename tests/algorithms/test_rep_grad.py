"""MultiTaskTrainer(rep_grad=True): task gradients at the shared representation z
(LibMTL's rep_grad; MGDA-UB), one backward pass through the encoder.

What must hold, and is tested:
* for coefficients c that do not depend on the gradients, the encoder's update
  J^T sum_t c_t dL_t/dz IS the parameter-level sum_t c_t g_t, for any encoder;
* for methods whose coefficients are invariant to scaling the Gram matrix (PCGrad,
  MGDA, CAGrad, IMTL-G), the representation-level and the parameter-level updates agree
  whenever the two Gram matrices are proportional: a linear encoder z = W x + b on a
  batch of identical inputs (every row x) has g_t = (r_t x^T, r_t), r_t = sum_b dL_t/dz_b,
  so <g_i, g_j> = (|x|^2 + 1) <r_i, r_j>;
* elsewhere they differ (documented in the trainer), and MGDA-UB equals a NumPy
  re-derivation of LibMTL's rep_grad MGDA.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from mtl_oracles import np_min_norm_element_from2
from test_multitask_outputs import LOSS_WEIGHTS, _softmax, compiled, data, two_head_model
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.data.multitask import PerTaskHead, one_head_per_task_model
from tf_metaalign.trainers.multitask import MultiTaskTrainer


class Fixed(methods.MultiTaskMethod):
    """A gradient method with fixed coefficients (the test's linear case)."""

    name = "fixed_for_test"

    def __init__(self, c=(0.3, 1.7)):
        self.c = tuple(c)

    def combine(self, inputs, state):
        return methods.Combination(shared=tf.constant(self.c, inputs.dtype))

    def get_config(self):
        return {"c": self.c}


def linear_encoder_model(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    z = keras.layers.Dense(3, name="encoder")(inputs)  # linear, with a bias
    return keras.Model(
        inputs,
        [keras.layers.Dense(1, name="priority")(z), keras.layers.Dense(3, name="department")(z)],
    )


def deep_model(seed=4):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name="e1")(inputs)
    h = keras.layers.Dense(5, activation="tanh", name="e2")(h)
    a = keras.layers.Dense(1, name="priority")(keras.layers.Dense(4, activation="relu")(h))
    return keras.Model(inputs, [a, keras.layers.Dense(3, name="department")(h)])


def train(make, method, x, y, rep_grad, lr=0.25, batch=8, epochs=1, **kwargs):
    trainer = compiled(MultiTaskTrainer(make(), method=method, rep_grad=rep_grad, **kwargs), lr=lr)
    history = trainer.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return [v.numpy() for v in trainer.model.trainable_variables], history.history


def assert_same(a, b, rtol=1e-11):
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * 1e-2)


def test_fixed_coefficients_agree_for_any_encoder(float64):
    x, y = data(n=24, seed=1)
    rep, _ = train(deep_model, Fixed(), x, y, rep_grad=True)
    param, _ = train(deep_model, Fixed(), x, y, rep_grad=False)
    assert_same(rep, param, 1e-12)
    ones, _ = train(deep_model, Fixed((1.0, 1.0)), x, y, rep_grad=True)
    assert np.abs(ones[0] - rep[0]).max() > 1e-4  # the coefficients reach the encoder


def identical_rows(n=24, seed=0):
    """Each batch of 8 holds one input row 8 times (different targets)."""
    x, y = data(n=n, seed=seed)
    x = np.repeat(x[::8], 8, axis=0)
    y["priority"] *= 3.0
    return x, y


@pytest.mark.parametrize(
    "method, rtol",
    [
        ("pcgrad", 1e-9),
        ("mgda", 1e-9),
        ("imtl", 1e-9),
        # LibMTL's CAGrad adds 1e-8 to sqrt(mean Gram) and to |g_w|: scale-invariant only
        # up to those
        ("cagrad", 1e-6),
    ],
)
def test_scale_invariant_methods_agree_on_a_linear_encoder_with_proportional_grams(
    float64, method, rtol
):
    x, y = identical_rows()
    rep, h_rep = train(linear_encoder_model, method, x, y, rep_grad=True, seed=1)
    param, h_param = train(linear_encoder_model, method, x, y, rep_grad=False, seed=1)
    assert_same(rep, param, rtol)
    # the cosine of the task gradients is the same at both levels here
    np.testing.assert_allclose(h_rep["task_cosine"], h_param["task_cosine"], rtol=1e-5)
    summed, _ = train(linear_encoder_model, Fixed((1.0, 1.0)), x, y, rep_grad=False)
    assert np.abs(summed[0] - param[0]).max() > 1e-4  # the method acted


@pytest.mark.parametrize("method", ["pcgrad", "mgda"])
def test_they_differ_in_general(float64, method):
    """Distinct rows: the Gram matrix of the batch-summed representation gradients is
    not proportional to the parameters' (LibMTL's rep_grad is a different method)."""
    x, y = data(n=24, seed=2)
    y["priority"] *= 3.0
    rep, _ = train(linear_encoder_model, method, x, y, rep_grad=True)
    param, _ = train(linear_encoder_model, method, x, y, rep_grad=False)
    assert np.abs(rep[0] - param[0]).max() > 1e-6


def np_mgda_ub(weights, x, y, lr):
    """One MGDA-UB step (LibMTL MGDA with rep_grad=True, mgda_gn='none') of
    `two_head_model` in NumPy: the min-norm weights of r_t = sum_b dL_t/dh_b, the trunk
    updated with sum_t w_t g_t (= J^T sum_t w_t dL_t/dh), the heads with their raw
    gradients."""
    W1, b1, Wa, ba, Wb, bb = weights
    B = len(x)
    h = np.tanh(x @ W1 + b1)
    a, logits = h @ Wa + ba, h @ Wb + bb
    dA = LOSS_WEIGHTS["priority"] * 2 * (a - y["priority"]) / B
    dB = LOSS_WEIGHTS["department"] * (_softmax(logits) - np.eye(3)[y["department"]]) / B
    dh = [dA @ Wa.T, dB @ Wb.T]
    r = np.stack([d.sum(0) for d in dh])
    G = r @ r.T
    gamma, _ = np_min_norm_element_from2(G[0, 0], G[0, 1], G[1, 1])
    w = np.array([gamma, 1 - gamma])
    dpre = (w[0] * dh[0] + w[1] * dh[1]) * (1 - h**2)
    return [
        W1 - lr * x.T @ dpre,
        b1 - lr * dpre.sum(0),
        Wa - lr * h.T @ dA,
        ba - lr * dA.sum(0),
        Wb - lr * h.T @ dB,
        bb - lr * dB.sum(0),
    ], w


def test_mgda_ub_equals_numpy_libmtl(float64):
    x, y = data(n=24, seed=3)
    y["priority"] *= 2.0
    model = two_head_model(seed=7)
    weights = [v.numpy() for v in model.trainable_variables]
    trainer = compiled(MultiTaskTrainer(model, method="mgda", rep_grad=True), lr=0.25)
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    ws = []
    for s in range(3):
        sl = slice(8 * s, 8 * s + 8)
        weights, w = np_mgda_ub(weights, x[sl], {k: v[sl] for k, v in y.items()}, 0.25)
        ws.append(w)
    assert_same([v.numpy() for v in trainer.model.trainable_variables], weights, 1e-10)
    assert any(0.01 < w[0] < 0.99 for w in ws)  # an interior min-norm point was used


def test_named_representation_and_xla(float64):
    x, y = data(n=16, seed=5)
    auto, _ = train(two_head_model, "mgda", x, y, rep_grad=True)
    named, _ = train(two_head_model, "mgda", x, y, rep_grad=True, representation="trunk")
    assert_same(auto, named, 1e-14)
    trainer = compiled(
        MultiTaskTrainer(two_head_model(), method="mgda", rep_grad=True), lr=0.25, jit_compile=True
    )
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_same([v.numpy() for v in trainer.model.trainable_variables], auto, 1e-10)


def test_two_replicas_equal_one(float64):
    """The encoder's gradient is pulled back per replica from the GLOBAL coefficients;
    the optimizer's cross-replica sum of those parts is the global gradient."""
    x, y = data(n=24, seed=6)

    def run(strategy):
        with strategy.scope():
            trainer = compiled(
                MultiTaskTrainer(deep_model(), method="mgda", rep_grad=True),
                optimizer=keras.optimizers.Adam(0.05),
            )
        h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return [v.numpy() for v in trainer.model.trainable_variables], h.history

    one, h1 = run(tf.distribute.get_strategy())
    two, h2 = run(two_cpu_strategy())
    assert_same(one, two, 1e-10)
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=1e-6)


def rows_model(seed=5):
    keras.utils.set_random_seed(seed)
    backbone = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh")], name="backbone"
    )
    return one_head_per_task_model(backbone, [2, 2, 2])


def test_rows_setting_per_task_head(float64):
    """tasks='rows' (task_id batches): the representation is the PerTaskHead's input."""
    rng = np.random.default_rng(0)
    x = {"inputs": rng.normal(size=(27, 4)), "task_id": rng.integers(0, 3, 27).astype("int32")}
    y = rng.normal(size=(27, 2))

    def run(method, rep_grad):
        trainer = MultiTaskTrainer(
            rows_model(), num_tasks=3, method=method, model_takes_task_id=True, rep_grad=rep_grad
        )
        trainer.compile(optimizer=keras.optimizers.SGD(0.25), loss="mse")
        trainer.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
        return [v.numpy() for v in trainer.model.trainable_variables]

    c = (0.5, 1.25, 2.0)
    assert_same(run(Fixed(c), True), run(Fixed(c), False), 1e-12)
    rep = run("mgda", True)
    assert all(np.isfinite(v).all() for v in rep)
    assert np.abs(rep[0] - run("mgda", False)[0]).max() > 1e-6


@pytest.mark.parametrize("method", ["pcgrad", "mgda", "gradnorm", "imtl", "nash_mtl"])
def test_rows_one_head_pass_equals_one_pass_per_task(float64, method):
    """tasks='rows': every task's dL_t/dz from ONE backward pass of sum_t L_t (the rows
    are disjoint) and the heads' sum_t s_t g_t from one more == the T per-task backward
    passes (taken when a layer after z mixes rows), with task-specific coefficients
    s_t != 1 (GradNorm, IMTL, Nash-MTL) and a task absent from a batch."""
    rng = np.random.default_rng(1)
    task = rng.integers(0, 3, 27).astype("int32")
    task[18:] = np.where(task[18:] == 2, 0, task[18:])
    x = {"inputs": rng.normal(size=(27, 4)), "task_id": task}
    y = rng.normal(size=(27, 2))
    runs = []
    for heads_mix_rows in (False, True):
        trainer = MultiTaskTrainer(
            rows_model(), num_tasks=3, method=method, model_takes_task_id=True, rep_grad=True
        )
        trainer.compile(optimizer=keras.optimizers.SGD(0.25), loss="mse")
        assert trainer._rep_plan().heads_mix_rows is False
        trainer._rep_plan().heads_mix_rows = heads_mix_rows
        h = trainer.fit(x, y, batch_size=9, epochs=2, shuffle=False, verbose=0)
        runs.append(([v.numpy() for v in trainer.model.trainable_variables], h.history))
    assert_same(runs[0][0], runs[1][0], 1e-11)
    for key in runs[0][1]:
        np.testing.assert_allclose(runs[0][1][key], runs[1][1][key], rtol=1e-9)


def test_rows_heads_with_batch_norm_take_one_pass_per_task():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="inputs")
    task_id = keras.Input((), dtype="int32", name="task_id")
    z = keras.layers.Dense(5, activation="tanh", name="trunk")(inputs)
    h = keras.layers.BatchNormalization(center=False, scale=False)(z)
    out = PerTaskHead([2, 2], name="heads")([h, task_id])
    model = keras.Model({"inputs": inputs, "task_id": task_id}, out)
    trainer = MultiTaskTrainer(
        model,
        num_tasks=2,
        method="pcgrad",
        model_takes_task_id=True,
        rep_grad=True,
        representation="trunk",
    )
    assert trainer._rep_plan().heads_mix_rows is True
    assert (
        MultiTaskTrainer(
            rows_model(), num_tasks=3, method="pcgrad", model_takes_task_id=True, rep_grad=True
        )
        ._rep_plan()
        .heads_mix_rows
        is False
    )


def test_rep_grad_errors():
    with pytest.raises(ValueError, match="rep_grad"):
        MultiTaskTrainer(two_head_model(), method="uw", rep_grad=True)
    with pytest.raises(ValueError, match="PerTaskHead"):
        MultiTaskTrainer(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
            num_tasks=2,
            method="mgda",
            rep_grad=True,
        )
    # a task-specific variable in front of the representation
    with pytest.raises(ValueError, match="feed the representation"):
        MultiTaskTrainer(
            two_head_model(), method="mgda", rep_grad=True, task_specific_variables=["trunk/bias"]
        )
