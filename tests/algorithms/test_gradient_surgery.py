"""Gradient surgery (PCGrad, GradVac, GradNorm) and MultiTaskTrainer against hand
computations and NumPy re-derivations of the references (tianheyu927/PCGrad, LibMTL's
GradVac and GradNorm), written here on flat vectors without the package's TF code."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.trainers import MultiTaskTrainer

from mtl_oracles import (  # NumPy re-derivations of the references, shared with
    # the backend-neutral tests (test_multitask_methods_backends.py)
    np_pcgrad,
    np_gradvac,
    np_gradnorm,
)


def _as_lists(vectors, shapes=((2,),)):
    """Flat task vectors -> per-task gradient lists split into `shapes`."""
    out = []
    for v in vectors:
        parts, start = [], 0
        for s in shapes:
            n = int(np.prod(s))
            parts.append(tf.constant(np.reshape(v[start : start + n], s), tf.float64))
            start += n
        out.append(parts)
    return out


def _flat(grads):
    return np.concatenate([np.ravel(g.numpy()) for g in grads])


# ------------------------------------------------------------------ NumPy references


# --------------------------------------------------------------------- pure functions


def test_pcgrad_anti_parallel_cancels():
    # g2 = -g1/2: each is projected onto the normal plane of the other -> both vanish.
    grads = _as_lists([np.array([2.0, 0.0]), np.array([-1.0, 0.0])])
    out = GS.pcgrad(grads, tf.constant([0, 1]))
    np.testing.assert_allclose(_flat(out), [0.0, 0.0], atol=1e-15)


def test_pcgrad_orthogonal_is_the_plain_sum():
    grads = _as_lists([np.array([3.0, 0.0]), np.array([0.0, -2.0])])
    np.testing.assert_allclose(_flat(GS.pcgrad(grads, tf.constant([1, 0]))), [3.0, -2.0])


def test_pcgrad_conflicting_by_hand():
    # g1 = (1, 0), g2 = (-1, 1), <g1, g2> = -1:
    # g1' = g1 + 1/2 g2 = (0.5, 0.5), g2' = g2 + 1 g1 = (0, 1); sum (0.5, 1.5).
    grads = _as_lists([np.array([1.0, 0.0]), np.array([-1.0, 1.0])])
    np.testing.assert_allclose(_flat(GS.pcgrad(grads, tf.constant([0, 1]))), [0.5, 1.5])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pcgrad_random_three_tasks_equals_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    shapes = ((3, 2), (4,), ())
    base = rng.normal(size=11)
    # correlated tasks with conflicts, so several projections happen
    vectors = [base * s + rng.normal(size=11) for s in (1.0, -0.8, 0.3)]
    order = rng.permutation(3)
    out = GS.pcgrad(_as_lists(vectors, shapes), tf.constant(order))
    np.testing.assert_allclose(_flat(out), np_pcgrad(vectors, order), rtol=1e-12, atol=1e-12)
    assert not np.allclose(np_pcgrad(vectors, order), np.sum(vectors, axis=0))


def test_gradvac_three_steps_equal_numpy_reference():
    rng = np.random.default_rng(5)
    targets_tf = tf.zeros([3, 3], tf.float64)
    targets_np = np.zeros((3, 3))
    moved = False
    for step in range(3):
        base = rng.normal(size=7)
        vectors = [base * s + rng.normal(size=7) for s in (1.0, -0.6, 0.5)]
        if step == 2:
            vectors[1] = np.zeros(7)  # an absent task: its pairs are skipped
        order = rng.permutation(3)
        grads = _as_lists(vectors, ((7,),))
        result = GS.gradvac_coefficients(
            GS.gram_matrix(grads), targets_tf, tf.constant(order), beta=0.1
        )
        expected, targets_np = np_gradvac(vectors, targets_np, order, beta=0.1)
        targets_tf = result.targets
        np.testing.assert_allclose(
            _flat(GS.combine(grads, result.coefficients)), expected, rtol=1e-10, atol=1e-12
        )
        np.testing.assert_allclose(targets_tf.numpy(), targets_np, rtol=1e-12, atol=1e-14)
        moved |= not np.allclose(expected, np.sum(vectors, axis=0))
    assert moved
    assert np.all(np.diag(targets_np) == 0)  # no self pairs


def test_gradnorm_update_equals_numpy_reference():
    rng = np.random.default_rng(2)
    w = np.ones(3)
    for _ in range(3):
        norms, losses, initial = (
            rng.uniform(0.5, 2, 3),
            rng.uniform(0.5, 2, 3),
            rng.uniform(1, 2, 3),
        )
        present = np.array([1.0, 1.0, 0.0])
        new = GS.gradnorm_update(
            tf.constant(w), norms, losses, initial, present, alpha=1.5, learning_rate=0.1
        ).numpy()
        expected = np_gradnorm(w, norms, losses, initial, present, 1.5, 0.1)
        np.testing.assert_allclose(new, expected, rtol=1e-13)
        assert new.sum() == pytest.approx(3.0)
        w = new
    assert not np.allclose(w, 1.0)


def test_random_order_is_a_deterministic_permutation_of_seed_and_step():
    orders = [tuple(GS.random_order(4, 7, s).numpy()) for s in range(20)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert len(set(orders)) > 5
    assert orders == [tuple(GS.random_order(4, 7, s).numpy()) for s in range(20)]
    assert orders != [tuple(GS.random_order(4, 8, s).numpy()) for s in range(20)]
    jit = tf.function(lambda s: GS.random_order(4, 7, s), jit_compile=True)
    assert orders == [tuple(jit(tf.constant(s, tf.int64)).numpy()) for s in range(20)]


def test_mean_pairwise_cosine():
    grads = _as_lists(
        [np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0]), np.array([0.0, 0.0])]
    )
    c = float(GS.mean_pairwise_cosine(GS.gram_matrix(grads), [1, 1, 1, 0]))
    assert c == pytest.approx((0 + 2 * np.sqrt(0.5)) / 3)


# ----------------------------------------------------- the trainer against NumPy


def _linear_model(l2=0.0):
    keras.utils.set_random_seed(1)
    regularizer = keras.regularizers.L2(l2) if l2 else None
    return keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(2, dtype="float64", kernel_regularizer=regularizer),
        ]
    )


def _batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(27, 4))
    y = rng.normal(size=(27, 2))
    task = rng.integers(0, 3, size=27).astype("int32")
    task[18:] = np.where(task[18:] == 2, 0, task[18:])  # task 2 absent from batch 3
    y[task == 1] *= -3.0  # conflicting task
    return x, y, task


def _np_task_grads(W, b, x, y, task, T):
    """Per-task mean-MSE losses and flat gradients [W, b] of the linear model."""
    losses, grads, present = np.zeros(T), [], np.zeros(T)
    for t in range(T):
        m = task == t
        if not m.any():
            grads.append(np.zeros(W.size + b.size))
            continue
        present[t] = 1
        err = x[m] @ W + b - y[m]
        losses[t] = np.mean(np.mean(err**2, axis=1))
        d = 2 * err / (err.shape[1] * m.sum())
        grads.append(np.concatenate([(x[m].T @ d).ravel(), d.sum(0)]))
    return losses, grads, present


def _np_trainer(method, steps, lr, batch, options):
    x, y, task = _batches()
    model = _linear_model()
    W, b = (v.numpy().astype(np.float64) for v in model.trainable_variables)
    T = 3
    targets, gn_w, initial, seen = np.zeros((T, T)), np.ones(T), np.zeros(T), np.zeros(T)
    for s in range(steps):
        sl = slice(s * batch, (s + 1) * batch)
        losses, gs, present = _np_task_grads(W, b, x[sl], y[sl], task[sl], T)
        order = GS.random_order(T, options.get("seed", 0), s).numpy()
        if method == "sum":
            g = np.sum(gs, axis=0)
        elif method == "pcgrad":
            g = np_pcgrad(gs, order)
        elif method == "gradvac":
            g, targets = np_gradvac(gs, targets, order, options.get("gradvac_beta", 1e-2))
        else:
            initial = np.where((present == 1) & (seen == 0), losses, initial)
            seen = np.maximum(seen, present)
            g = np.sum([w * gi for w, gi in zip(gn_w, gs)], axis=0)
            norms = np.array([np.linalg.norm(gi[: W.size]) for gi in gs])
            gn_w = np_gradnorm(
                gn_w,
                norms,
                losses,
                initial,
                present,
                options.get("gradnorm_alpha", 1.5),
                options.get("gradnorm_learning_rate", 0.025),
            )
        # the model's own losses (L2 on W) are added once, after the surgery
        g = g + np.concatenate([2 * options.get("l2", 0.0) * W.ravel(), np.zeros(b.size)])
        W = W - lr * g[: W.size].reshape(W.shape)
        b = b - lr * g[W.size :]
    return W, b, dict(targets=targets, weights=gn_w, initial=initial)


@pytest.mark.parametrize(
    "method, options",
    [
        ("sum", {}),
        ("pcgrad", {"seed": 4}),
        ("gradvac", {"gradvac_beta": 0.2}),
        ("gradnorm", {"gradnorm_learning_rate": 0.3}),
        # the model's own loss (L2 on the kernel; 1/16 is exact in float32, through which
        # Keras rounds a regulariser's factor: 0.05 would differ by 4e-9 relative)
        ("pcgrad", {"seed": 1, "l2": 0.0625}),
    ],
)
@pytest.mark.parametrize("task_passes", ["factored", "vectorized", "gathered", "masked"])
def test_trainer_three_steps_equal_numpy_rederivation(float64, method, options, task_passes):
    lr, batch = 0.1, 9
    x, y, task = _batches()
    kwargs = {k: v for k, v in options.items() if k != "l2"}
    if options.get("l2") and task_passes in ("vectorized", "gathered"):
        # the model's own losses: "gathered" and "vectorized" refuse them, "auto" masks
        with pytest.raises(ValueError, match="task_passes='masked'"):
            trainer = MultiTaskTrainer(
                _linear_model(options["l2"]),
                num_tasks=3,
                method=method,
                task_passes=task_passes,
                **kwargs,
            )
            trainer.compile(
                optimizer=keras.optimizers.SGD(lr), loss=keras.losses.MeanSquaredError()
            )
            trainer.fit({"inputs": x, "task_id": task}, y, batch_size=batch, verbose=0)
        task_passes = "auto"
    kwargs["task_passes"] = task_passes
    trainer = MultiTaskTrainer(
        _linear_model(options.get("l2", 0.0)), num_tasks=3, method=method, **kwargs
    )
    trainer.compile(optimizer=keras.optimizers.SGD(lr), loss=keras.losses.MeanSquaredError())
    trainer.fit(
        {"inputs": x, "task_id": task}, y, batch_size=batch, epochs=1, shuffle=False, verbose=0
    )
    W, b, state = _np_trainer(method, 3, lr, batch, options)
    np.testing.assert_allclose(
        trainer.model.trainable_variables[0].numpy(), W, rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(
        trainer.model.trainable_variables[1].numpy(), b, rtol=1e-10, atol=1e-12
    )
    if method == "gradvac":
        np.testing.assert_allclose(
            trainer.gradvac_targets.numpy(), state["targets"], rtol=1e-10, atol=1e-12
        )
        assert np.abs(state["targets"]).max() > 0.01
    if method == "gradnorm":
        np.testing.assert_allclose(trainer.gradnorm_weights.numpy(), state["weights"], rtol=1e-10)
        np.testing.assert_allclose(
            trainer.gradnorm_initial_losses.numpy(), state["initial"], rtol=1e-10
        )
        assert not np.allclose(state["weights"], 1.0)
    assert int(trainer.steps.count.numpy()) == 3


def test_sum_is_T_times_plain_fit_on_balanced_batches(float64):
    """Each batch holds B/T examples of every task and MSE is a mean: fit's loss on the
    union is (1/T) sum_t L_t, so "sum" with SGD(lr) == plain fit with SGD(T * lr)."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(24, 4)), rng.normal(size=(24, 2))
    task = (np.arange(24) % 3).astype("int32")
    trainer = MultiTaskTrainer(_linear_model(), num_tasks=3, method="sum")
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.MeanSquaredError())
    h = trainer.fit(
        {"inputs": x, "task_id": task}, y, batch_size=6, epochs=2, shuffle=False, verbose=0
    )
    plain = _linear_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.15), loss=keras.losses.MeanSquaredError())
    h_plain = plain.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(trainer.model.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    # the logged loss is the sum of the task losses: T times fit's
    # (Keras's loss tracker averages in float32)
    np.testing.assert_allclose(
        h.history["loss"], 3 * np.asarray(h_plain.history["loss"]), rtol=1e-6
    )


@pytest.mark.parametrize(
    "method, task_passes",
    [
        ("gradvac", "masked"),
        ("sum", "masked"),
        ("gradvac", "gathered"),
        ("pcgrad", "gathered"),
        ("gradvac", "vectorized"),
        ("pcgrad", "vectorized"),
    ],
)
def test_two_replicas_equal_one(float64, method, task_passes):
    """The per-task losses and gradients are all-reduced before the surgery: 2 replicas
    (each seeing other task counts) take the step 1 replica takes on the global batch."""
    x, y, task = _batches()
    data = {"inputs": x[:24], "task_id": task[:24]}

    def run(strategy):
        with strategy.scope():
            options = {"gradvac_beta": 0.3} if method == "gradvac" else {}
            trainer = MultiTaskTrainer(
                _linear_model(), num_tasks=3, method=method, task_passes=task_passes, **options
            )
            trainer.compile(
                optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.MeanSquaredError()
            )
        h = trainer.fit(data, y[:24], batch_size=8, epochs=2, shuffle=False, verbose=0)
        state = [v.numpy() for v in trainer.weights if v.name == "gradvac_targets"]
        return [v.numpy() for v in trainer.model.trainable_variables] + state, h.history

    one, h1 = run(tf.distribute.get_strategy())
    two, h2 = run(two_cpu_strategy())
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # ("sum" measures no task cosine: it logs none)
    for k in ("loss", "task_cosine") if method != "sum" else ("loss",):
        np.testing.assert_allclose(h1[k], h2[k], rtol=1e-6)  # float32 metrics


def test_model_takes_task_id_with_per_task_heads(float64):
    inputs = keras.Input((4,), name="inputs", dtype="float64")
    task_id = keras.Input((), name="task_id", dtype="int32")
    heads = keras.layers.Dense(3 * 2, dtype="float64")(
        keras.layers.Dense(5, activation="tanh", dtype="float64")(inputs)
    )
    heads = keras.layers.Reshape((3, 2), dtype="float64")(heads)
    one_hot = keras.ops.one_hot(task_id, 3, dtype="float64")
    out = keras.ops.einsum("bt,btk->bk", one_hot, heads)
    model = keras.Model({"inputs": inputs, "task_id": task_id}, out)
    x, y, task = _batches()
    trainer = MultiTaskTrainer(
        model, num_tasks=3, method="gradnorm", model_takes_task_id=True, gradnorm_variable=0
    )
    trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError())
    data = {"inputs": x, "task_id": task}
    h = trainer.fit(data, y, batch_size=9, epochs=3, shuffle=False, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    assert np.isfinite(trainer.evaluate(data, y, verbose=0))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(num_tasks=0), "num_tasks"),
        (dict(num_tasks=2.0), "num_tasks"),
        (dict(num_tasks=2, method="mgda-nope"), "method"),
        (dict(num_tasks=2, method="pcgrad", method_options={"beta": 0.1}), "beta"),
        (dict(num_tasks=2, method="sum", gradvac_beta=0.1), "gradvac_beta"),
        (dict(num_tasks=2, task_specific_variables="heads"), "task_specific_variables"),
        (dict(num_tasks=2, task_specific_variables=["nope/kernel"]), "task_specific_variables"),
        (dict(num_tasks=2, measure_task_cosine="yes"), "measure_task_cosine"),
        (dict(num_tasks=2, model_takes_task_id="yes"), "model_takes_task_id"),
        (dict(num_tasks=2, seed=None), "seed"),
        (dict(num_tasks=2, gradvac_beta=1.5), "gradvac_beta"),
        (dict(num_tasks=2, gradnorm_alpha=-1), "gradnorm_alpha"),
        (dict(num_tasks=2, gradnorm_learning_rate="fast"), "gradnorm_learning_rate"),
        (dict(num_tasks=2, method="gradnorm", gradnorm_variable=9), "gradnorm_variable"),
        (dict(num_tasks=2, method="gradnorm", gradnorm_variable="dense/nope"), "gradnorm_variable"),
        (dict(num_tasks=2, task_passes="vmap"), "task_passes"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        MultiTaskTrainer(_linear_model(), **kwargs)


def test_bad_batches_are_clear_errors():
    x, y, task = _batches()
    trainer = MultiTaskTrainer(_linear_model(), num_tasks=3)
    trainer.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="task_id"):
        trainer.fit(x.astype("float32"), y, batch_size=9, verbose=0)
    with pytest.raises(ValueError, match=r"x\['task_id'\] must be an integer"):
        trainer.fit({"inputs": x, "task_id": task.astype("float32")}, y, batch_size=9, verbose=0)


def test_pure_functions_reject_bad_shapes():
    grads = _as_lists([np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match="coefficients"):
        GS.combine(grads, tf.ones([3]))
    with pytest.raises(ValueError, match="task_grads"):
        GS.gram_matrix([grads[0], grads[1][:0]])
    with pytest.raises(ValueError, match="targets"):
        GS.gradvac_coefficients(GS.gram_matrix(grads), tf.zeros([3, 3]), [0, 1])
    with pytest.raises(ValueError, match="order"):
        GS.pcgrad_coefficients(GS.gram_matrix(grads), [0, 1, 2])


@pytest.mark.parametrize("weighted", [False, True])
def test_vectorized_gathered_and_masked_passes_give_the_same_training_and_metrics(
    float64, weighted
):
    """The three ways of computing per-task gradients are the same computation for a
    stateless model (unbalanced tasks, a task absent from a batch, sample weights); the
    compiled metrics see the predictions in batch order."""
    x, y, task = _batches()
    weights = np.linspace(0.5, 2.0, len(x)) if weighted else None
    runs = {}
    for passes in ("vectorized", "gathered", "masked"):
        inner = keras.Sequential(
            [
                keras.Input((4,), dtype="float64"),
                keras.layers.Dense(5, activation="tanh", dtype="float64"),
                keras.layers.Dense(2, dtype="float64"),
            ]
        )
        keras.utils.set_random_seed(3)
        inner.set_weights(
            [
                np.random.default_rng(i).normal(size=w.shape)
                for i, w in enumerate(inner.get_weights())
            ]
        )
        trainer = MultiTaskTrainer(inner, num_tasks=3, method="pcgrad", task_passes=passes)
        trainer.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=keras.losses.MeanSquaredError(),
            metrics=["mae"],
            weighted_metrics=["mse"] if weighted else None,
        )
        h = trainer.fit(
            {"inputs": x, "task_id": task},
            y,
            sample_weight=weights,
            batch_size=9,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        runs[passes] = ([v.numpy() for v in trainer.model.trainable_variables], h.history)
    for passes in ("gathered", "masked"):
        for a, b in zip(runs["vectorized"][0], runs[passes][0]):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        for key in runs[passes][1]:
            np.testing.assert_allclose(runs["vectorized"][1][key], runs[passes][1][key], rtol=1e-6)
    assert set(runs["vectorized"][1]) >= {"loss", "mae", "task_cosine"}


def _normed_model(dropout=False, l2=0.0):
    regularizer = keras.regularizers.L2(l2) if l2 else None
    layers = [keras.Input((4,)), keras.layers.LayerNormalization()]
    layers += [keras.layers.Dropout(0.5)] if dropout else []
    return keras.Sequential(layers + [keras.layers.Dense(2, kernel_regularizer=regularizer)])


def _dropout_model(batch_norm=False):
    keras.utils.set_random_seed(2)
    layers = [keras.Input((4,)), keras.layers.Dense(16, activation="relu")]
    layers.append(keras.layers.BatchNormalization() if batch_norm else keras.layers.Dropout(0.5))
    return keras.Sequential(layers + [keras.layers.Dense(2)])


def test_auto_picks_the_per_task_pass_by_model():
    # Dense layers only: "factored" (tests/trainers/test_multitask_factored.py), also with
    # dropout, model losses and under XLA
    assert MultiTaskTrainer(_linear_model(), num_tasks=2)._task_passes_used() == "factored"
    assert MultiTaskTrainer(_dropout_model(), num_tasks=2)._task_passes_used() == "factored"
    assert MultiTaskTrainer(_linear_model(0.1), num_tasks=2)._task_passes_used() == "factored"
    trainer = MultiTaskTrainer(_linear_model(), num_tasks=2)
    trainer.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert trainer._task_passes_used() == "factored"
    # another shared layer: vectorized without state, gathered with, masked under XLA
    # or with model losses
    assert MultiTaskTrainer(_normed_model(), num_tasks=2)._task_passes_used() == "vectorized"
    assert (
        MultiTaskTrainer(_normed_model(dropout=True), num_tasks=2)._task_passes_used() == "gathered"
    )
    assert MultiTaskTrainer(_normed_model(l2=0.1), num_tasks=2)._task_passes_used() == "masked"
    trainer = MultiTaskTrainer(_normed_model(), num_tasks=2)
    trainer.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert trainer._task_passes_used() == "masked"
    assert (
        MultiTaskTrainer(_linear_model(), num_tasks=2, task_passes="gathered")._task_passes_used()
        == "gathered"
    )


def test_vectorized_passes_share_dropout_masks_across_tasks_and_refuse_batch_norm():
    """The documented difference: with dropout, "vectorized" gives the T tasks the same
    masks for their j-th rows, so two tasks with the same rows at the same positions have
    identical gradients (cosine 1), where "gathered" draws each task's masks in turn."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4, 4)).astype("float32")
    x = np.concatenate([rows, rows])
    y = np.concatenate([rng.normal(size=(4, 2))] * 2).astype("float32")
    task = np.array([0] * 4 + [1] * 4, "int32")
    cosines = {}
    for passes in ("vectorized", "gathered"):
        trainer = MultiTaskTrainer(
            _dropout_model(), num_tasks=2, method="pcgrad", task_passes=passes
        )
        trainer.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        h = trainer.fit(
            {"inputs": x, "task_id": task}, y, batch_size=8, epochs=3, shuffle=False, verbose=0
        )
        cosines[passes] = np.asarray(h.history["task_cosine"])
    np.testing.assert_allclose(cosines["vectorized"], 1.0, rtol=1e-6)
    assert np.all(cosines["gathered"] < 0.999)
    trainer = MultiTaskTrainer(
        _dropout_model(batch_norm=True), num_tasks=2, method="pcgrad", task_passes="vectorized"
    )
    trainer.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="(?s)moving_mean.*task_passes='gathered'"):
        trainer.fit({"inputs": x, "task_id": task}, y, batch_size=8, verbose=0)


@pytest.mark.parametrize(
    "dtypes", [("float32", "float32"), ("float64", "float64"), ("float32", "float64")]
)
def test_gram_matrix_matches_pairwise_dots(dtypes):
    """gram_matrix (one stacked product per variable) == the T(T+1)/2 pairwise dot
    products over all variables; symmetric; float64 when any gradient is; graph and XLA."""
    rng = np.random.default_rng(5)
    shapes = [(3, 4), (), (5,), (2, 1, 3)]
    T = 4
    grads = [
        [tf.constant(rng.normal(size=s), dtypes[v % 2]) for v, s in enumerate(shapes)]
        for _ in range(T)
    ]
    flat = np.stack(
        [np.concatenate([np.ravel(g.numpy()).astype(np.float64) for g in gs]) for gs in grads]
    )
    expected = flat @ flat.T
    acc = tf.float64 if "float64" in dtypes else tf.float32
    for fn in (
        GS.gram_matrix,
        tf.function(GS.gram_matrix),
        tf.function(GS.gram_matrix, jit_compile=True),
    ):
        gram = fn(grads)
        assert gram.dtype == acc and gram.shape == (T, T)
        np.testing.assert_array_equal(gram.numpy(), gram.numpy().T)
        np.testing.assert_allclose(
            gram.numpy(), expected, rtol=1e-12 if acc == tf.float64 else 1e-5, atol=1e-5
        )


def test_gram_matrix_of_no_variables_is_zero():
    gram = GS.gram_matrix([[], [], []])
    assert gram.dtype == tf.float32
    np.testing.assert_array_equal(gram.numpy(), np.zeros((3, 3)))
