"""MultiTaskTrainer as plain Keras `fit` sees a multi-output model (issue 28): the
gradient of a loss-weighting method reaches the optimizer in fit's form (an Embedding's
sparse IndexedSlices), an output without a loss is no task, `num_tasks` is checked
against the model, and `task_cosine` is logged only where it is measured.

The default tests here take ~90 s on 2 shared, busy cores (~35 s of CPU); -m slow
adds ~14 s."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from test_multitask_outputs import WeightsPerStep
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.data import one_head_per_task_model
from tf_metaalign.trainers.multitask import MultiTaskTrainer

WEIGHTING = [name for name in methods.method_names() if not methods.get_method(name).uses_gradients]
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
}


def ticket_model(seed=1, aux=False):
    """keras-io's multi-input, multi-output ticket model (the functional API guide),
    small: a title and a body, each through its own Embedding table (pooled instead of
    the guide's LSTM), a priority regression head and a department classifier; `aux`
    adds a third output trained by no loss."""
    keras.utils.set_random_seed(seed)
    title = keras.Input((5,), dtype="int32", name="title")
    body = keras.Input((6,), dtype="int32", name="body")
    pool = keras.layers.GlobalAveragePooling1D
    t = pool()(keras.layers.Embedding(7, 4, name="title_embedding")(title))
    b = pool()(keras.layers.Embedding(9, 4, name="body_embedding")(body))
    h = keras.layers.Dense(6, activation="tanh", name="trunk")(keras.layers.Concatenate()([t, b]))
    outputs = [
        keras.layers.Dense(1, name="priority")(h),
        keras.layers.Dense(3, name="department")(h),
    ]
    if aux:
        outputs.append(keras.layers.Dense(2, name="aux")(h))
    return keras.Model({"title": title, "body": body}, outputs, name="ticket")


def ticket_data(n=8, seed=0, aux=False):
    """Tokens drawn from 3 (title) and 4 (body) ids: every batch repeats tokens, within
    a row and across rows (the case where sparse and dense updates differ)."""
    rng = np.random.default_rng(seed)
    x = {"title": rng.integers(0, 3, (n, 5)), "body": rng.integers(0, 4, (n, 6))}
    y = [rng.normal(size=(n, 1)), rng.integers(0, 3, n)]
    if aux:
        y.append(np.zeros((n, 2)))
    return {k: v.astype("int32") for k, v in x.items()}, y


def ticket_losses(aux=False):
    losses = ["mse", keras.losses.SparseCategoricalCrossentropy(from_logits=True)]
    return losses + [None] if aux else losses


def _fit_both(trainer, plain, x, y, epochs=2, batch_size=4):
    runs = []
    for model, fitter in ((trainer.model, trainer), (plain, plain)):
        record = WeightsPerStep(model.trainable_variables)
        history = fitter.fit(
            x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[record]
        )
        runs.append((record.steps, history.history))
    return runs


# ------------------------------------------------- sparse gradients, as fit has them


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sum_on_embeddings_is_plain_multi_output_fit_to_the_bit(optimizer):
    """Keras's optimizers apply an Embedding's IndexedSlices slice by slice (a repeated
    token adds the sum of its slices' squares to the second moment / accumulator); "sum"
    hands them the tape's gradient as fit does, so every weight is bitwise fit's, step
    for step (densified: 12 of the title table's 28 entries differed after the first
    step, by up to 48% (Adagrad), 4.7x (RMSprop), 13x (Adam) of their value)."""
    x, y = ticket_data()
    kwargs = dict(loss=ticket_losses(), loss_weights=[1.0, 0.3])
    trainer = MultiTaskTrainer(ticket_model(), method="sum")
    trainer.compile(optimizer=OPTIMIZERS[optimizer](), **kwargs)
    plain = ticket_model()
    plain.compile(optimizer=OPTIMIZERS[optimizer](), **kwargs)
    (steps, h), (plain_steps, h_plain) = _fit_both(trainer, plain, x, y)
    assert len(steps) == len(plain_steps) == 4
    paths = [v.path for v in plain.trainable_variables]
    for step, (mine, theirs) in enumerate(zip(steps, plain_steps)):
        for path, a, b in zip(paths, mine, theirs):
            np.testing.assert_array_equal(a, b, err_msg=f"{path} after step {step + 1}")
    assert not np.allclose(steps[-1][0], ticket_model().trainable_variables[0].numpy())
    for key in ("priority_loss", "department_loss"):
        np.testing.assert_array_equal(h[key], h_plain[key], err_msg=key)


def _first_step_weights(trainer, x, y, loss_weights):
    """The method's task weights at the first step: its `combine` on the step's losses
    (at the initial weights) and its initial state."""
    preds = trainer.model(x, training=True)
    fns = [keras.losses.MeanSquaredError(), ticket_losses()[1]]
    losses = tf.constant(
        [w * float(fn(t, p)) for w, fn, t, p in zip(loss_weights, fns, y, preds)], tf.float64
    )
    inputs = methods.TaskInputs(
        losses=losses,
        present=tf.ones([2], tf.float64),
        step=tf.constant(0, tf.int64),
        epoch=tf.constant(0, tf.int64),
        seed=trainer.seed,
    )
    state = {k: tf.convert_to_tensor(v.value) for k, v in trainer.method_state.items()}
    return trainer.method_object.combine(inputs, state).shared.numpy()


@pytest.mark.parametrize(
    "method",
    # one of the path's methods by default (UW: trainable state, the optimizer's own
    # update): the others under -m slow; "sum" is the bitwise test above
    [m if m == "uw" else pytest.param(m, marks=pytest.mark.slow) for m in WEIGHTING if m != "sum"],
)
def test_loss_weighting_methods_hand_fit_the_sparse_gradient(float64, method):
    """A loss-weighting method's first step is plain fit's with the loss weights
    multiplied by the method's weights w_t (its `combine` at the initial state), under
    Adagrad (whose first step, unlike Adam's, depends on the gradient's scale: the
    weights matter), on the repeated-token batch: the embedding tables get the sparse
    update."""
    x, y = ticket_data(n=4)
    loss_weights = [1.0, 0.3]
    trainer = MultiTaskTrainer(ticket_model(), method=method, seed=5)
    trainer.compile(
        optimizer=OPTIMIZERS["adagrad"](), loss=ticket_losses(), loss_weights=loss_weights
    )
    w = _first_step_weights(trainer, x, y, loss_weights)
    plain = ticket_model()
    plain.compile(
        optimizer=OPTIMIZERS["adagrad"](),
        loss=ticket_losses(),
        loss_weights=[float(a * b) for a, b in zip(w, loss_weights)],
    )
    (steps, _), (plain_steps, _) = _fit_both(trainer, plain, x, y, epochs=1, batch_size=4)
    for v, a, b in zip(plain.trainable_variables, steps[0], plain_steps[0]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"{method}: {v.path}")


def test_gradient_methods_train_embeddings_densified():
    """A gradient method forms the per-task gradients dense (documented): it trains the
    ticket model, and its step differs from the sparse one by the Adam accumulators."""
    x, y = ticket_data()
    trainer = MultiTaskTrainer(ticket_model(), method="pcgrad")
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=ticket_losses())
    history = trainer.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert np.isfinite(history["task_cosine"]).all()


# ------------------------------------------------------ outputs without a loss


@pytest.mark.parametrize("form", ["list", "dict"])
def test_an_output_without_a_loss_is_no_task(form):
    """keras-io's `[loss1, loss2, None]` (or `{"aux": None}`): num_tasks=None counts the
    two outputs with a loss, "sum" is plain fit to the bit, and the aux head, reached by
    no loss, is left untouched by both (its gradient None, as fit has it)."""
    x, y = ticket_data(aux=True)
    names = ["priority", "department", "aux"]
    loss = ticket_losses(aux=True)
    if form == "dict":
        loss, y = dict(zip(names, loss)), dict(zip(names, y))
    trainer = MultiTaskTrainer(ticket_model(aux=True), method="sum")
    assert trainer.num_tasks is None  # counted by compile
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    assert trainer.num_tasks == 2
    plain = ticket_model(aux=True)
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    aux_before = [v.numpy().copy() for v in trainer.model.get_layer("aux").trainable_variables]
    (steps, h), (plain_steps, _) = _fit_both(trainer, plain, x, y, epochs=1)
    for mine, theirs in zip(steps, plain_steps):
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    for v, before in zip(trainer.model.get_layer("aux").trainable_variables, aux_before):
        np.testing.assert_array_equal(v.numpy(), before)
    assert trainer.task_names == ["priority", "department"]
    assert {"priority_loss", "department_loss"} <= set(h) and "aux_loss" not in h


def test_an_output_without_a_loss_under_gradient_methods_and_resume(tmp_path):
    """PCGrad counts the same two tasks; UW's (trainable) and DWA's state is created by
    compile for the counted tasks, saves, reloads and resumes as the original goes on."""
    x, y = ticket_data(aux=True)
    trainer = MultiTaskTrainer(ticket_model(aux=True), method="pcgrad")
    trainer.compile(optimizer="adam", loss=ticket_losses(aux=True))
    assert trainer.num_tasks == 2
    history = trainer.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    for method in ("uw", "dwa"):
        trainer = MultiTaskTrainer(ticket_model(aux=True), method=method)
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=ticket_losses(aux=True))
        spec = trainer.method_object.state_spec(2)
        assert {k: tuple(v.shape) for k, v in trainer.method_state.items()} == {
            k: tuple(s.shape) for k, s in spec.items()
        }
        trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        path = str(tmp_path / f"{method}.keras")
        keras.saving.save_model(trainer, path)  # the trainer itself
        again = keras.models.load_model(path)
        assert again.num_tasks == 2
        for a, b in zip(trainer.weights, again.weights):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
        trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        again.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(trainer.weights, again.weights):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=a.path)


def test_counting_errors_name_the_arguments():
    x, y = ticket_data(aux=True)
    trainer = MultiTaskTrainer(ticket_model(aux=True))
    with pytest.raises(ValueError, match=r"`loss` gives 1 of the model's 3 outputs a loss"):
        trainer.compile(optimizer="sgd", loss=["mse", None, None])
    trainer = MultiTaskTrainer(ticket_model(aux=True))
    trainer.compile(optimizer="sgd", loss=ticket_losses(aux=True))
    with pytest.raises(ValueError, match=r"num_tasks=2\) \(counted by an earlier compile\)"):
        trainer.compile(optimizer="sgd", loss=["mse", "mse", "mse"])
    trainer = MultiTaskTrainer(ticket_model(aux=True), num_tasks=3, tasks="outputs")
    with pytest.raises(ValueError, match=r"num_tasks=3\): the compiled `loss` gives 2 outputs"):
        trainer.compile(optimizer="sgd", loss=ticket_losses(aux=True))


# ---------------------------------------------------- num_tasks against the model


def three_head_model():
    backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh")])
    keras.utils.set_random_seed(0)
    return one_head_per_task_model(backbone, [2, 2, 2])


def rows_data(n=12, num_tasks=3, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "inputs": rng.normal(size=(n, 3)).astype("float32"),
        "task_id": (np.arange(n) % num_tasks).astype("int32"),
    }
    return x, rng.integers(0, 2, n)


@pytest.mark.parametrize("num_tasks", [2, 4])
def test_num_tasks_is_checked_against_the_per_task_heads(num_tasks):
    """num_tasks=2 on three heads failed in a GatherV2 at the first step, num_tasks=4
    trained silently: both are refused when the trainer is made, naming both arguments."""
    with pytest.raises(ValueError, match=rf"`num_tasks`={num_tasks}, but the `model` .* 3 task"):
        MultiTaskTrainer(three_head_model(), num_tasks=num_tasks, model_takes_task_id=True)
    MultiTaskTrainer(three_head_model(), num_tasks=3, model_takes_task_id=True)  # fits


@pytest.mark.parametrize("task_passes", ["factored", "masked", "gathered"])
def test_a_task_id_out_of_range_is_a_clear_error(task_passes):
    """A model without per-task heads: a task_id >= num_tasks is no task's row (the
    masked pass ignored it, the factored one failed in a gather): an error naming
    num_tasks, in every pass (graph mode; XLA drops in-graph assertions)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    trainer = MultiTaskTrainer(model, num_tasks=2, method="pcgrad", task_passes=task_passes)
    trainer.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = rows_data(num_tasks=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="task_id is >= num_tasks=2"):
        trainer.fit(x, y, batch_size=12, verbose=0)


# ------------------------------------------------------------------------- logs


def test_task_cosine_is_logged_only_where_measured():
    """The loss-weighting methods measure no task cosine (a logged 0.0 read as
    "orthogonal tasks"): it is among the trainer's metrics only for the gradient methods
    or with measure_task_cosine=True, and then logged in [-1, 1]."""

    def make(method, measure=None):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        trainer = MultiTaskTrainer(model, num_tasks=3, method=method, measure_task_cosine=measure)
        trainer.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return trainer

    for method in methods.method_names():
        measured = methods.get_method(method).uses_gradients
        names = [m.name for m in make(method).metrics]
        assert ("task_cosine" in names) == measured, (method, names)
        assert "task_cosine" in [m.name for m in make(method, measure=True).metrics]
    x, y = rows_data()
    for method, measure in (("sum", None), ("uw", True), ("pcgrad", None)):
        history = make(method, measure).fit(x, y, batch_size=6, epochs=1, verbose=0).history
        assert ("task_cosine" in history) == (method != "sum"), (method, sorted(history))
        if method != "sum":
            assert -1.0 <= history["task_cosine"][0] <= 1.0 and history["task_cosine"][0] != 0


def test_sum_on_embeddings_two_replicas_equal_plain_fit_on_them(float64):
    """Under a MirroredStrategy the sparse gradient goes through Keras's own cross-replica
    reduction, as fit's: "sum" on 2 replicas == plain fit on 2 replicas (float64)."""
    x, y = ticket_data()
    strategy = two_cpu_strategy()
    with strategy.scope():
        trainer = MultiTaskTrainer(ticket_model(), method="sum")
        trainer.compile(optimizer=OPTIMIZERS["adam"](), loss=ticket_losses())
        plain = ticket_model()
        plain.compile(optimizer=OPTIMIZERS["adam"](), loss=ticket_losses())
    (steps, _), (plain_steps, _) = _fit_both(trainer, plain, x, y, epochs=1)
    for mine, theirs in zip(steps, plain_steps):
        for v, a, b in zip(plain.trainable_variables, mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=v.path)
