"""MultiTaskTrainer with tasks='outputs': one task per output of a multi-output model
compiled with one loss per output (LibMTL's multi_input=False setting; the Keras
functional-API guide's ticket model), heads found from the functional graph."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from test_gradient_surgery import np_pcgrad
from test_mtl_nash_aligned import libmtl_nash_numpy
from test_mtl_solvers import np_cagrad_exact_w
from tf_metaalign import model_graph
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.trainers.multitask import MultiTaskTrainer


def losses():
    """Per-output losses (loss objects compute in the floatx of their creation: make them
    inside the float64 fixture)."""
    return {
        "priority": "mse",
        "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }


LOSS_WEIGHTS = {"priority": 1.0, "department": 0.5}


def two_head_model(seed=1, l2=0.0):
    """Shared trunk (tanh) -> a regression head and a 3-class head (two layers)."""
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(l2) if l2 else None
    inputs = keras.Input((4,), name="features")
    h = keras.layers.Dense(5, activation="tanh", name="trunk", kernel_regularizer=reg)(inputs)
    priority = keras.layers.Dense(1, name="priority")(h)
    department = keras.layers.Dense(3, name="department")(h)
    return keras.Model(inputs, [priority, department], name="ticket")


def data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = {"priority": rng.normal(size=(n, 1)), "department": rng.integers(0, 3, n)}
    return x, y


def compiled(trainer, lr=0.1, optimizer=None, **kwargs):
    trainer.compile(
        optimizer=optimizer or keras.optimizers.SGD(lr),
        loss=losses(),
        loss_weights=LOSS_WEIGHTS,
        **kwargs,
    )
    return trainer


class WeightsPerStep(keras.callbacks.Callback):
    def __init__(self, variables):
        super().__init__()
        self.variables, self.steps = variables, []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([v.numpy().copy() for v in self.variables])


# ------------------------------------------------------------------- the graph


def test_graph_split_of_a_shared_bottom_model():
    model = two_head_model()
    specific = model_graph.task_specific_variables(model)
    assert [[v.path for v in vs] for vs in specific] == [
        ["priority/kernel", "priority/bias"],
        ["department/kernel", "department/bias"],
    ]
    assert model_graph.shared_representation(model) is model.get_layer("trunk").output
    assert [
        v.path for v in model_graph.upstream_variables(model, model.get_layer("trunk").output)
    ] == ["trunk/kernel", "trunk/bias"]
    trainer = MultiTaskTrainer(model, method="pcgrad")
    assert trainer.tasks == "outputs" and trainer.num_tasks is None  # counted by compile
    assert compiled(trainer).num_tasks == 2
    shared, task_specific = trainer._variable_split()
    paths = [v.path for v in model.trainable_variables]
    assert [paths[i] for i in shared] == ["trunk/kernel", "trunk/bias"]
    assert sorted(paths[i] for i in task_specific) == sorted(
        ["priority/kernel", "priority/bias", "department/kernel", "department/bias"]
    )


def test_graph_split_deeper_heads_tied_layers_and_nested_trunk():
    inputs = keras.Input((4,))
    trunk = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, name="t1"), keras.layers.Dense(5, name="t2")],
        name="trunk",
    )
    h = trunk(inputs)
    tied = keras.layers.Dense(5, name="tied")  # called by both heads: shared
    a = keras.layers.Dense(1, name="a_out")(keras.layers.Dense(3, name="a_hidden")(tied(h)))
    b = keras.layers.Dense(2, name="b_out")(tied(keras.layers.Dense(5, name="b_pre")(h)))
    c = keras.layers.Dense(1, name="c_out")(h)
    model = keras.Model(inputs, [a, b, c])
    specific = [
        sorted(v.path.split("/")[0] for v in vs)
        for vs in model_graph.task_specific_variables(model)
    ]
    assert specific == [
        ["a_hidden", "a_hidden", "a_out", "a_out"],
        ["b_out", "b_out", "b_pre", "b_pre"],
        ["c_out", "c_out"],
    ]
    # The nodes both heads reach end at the trunk; "tied" is called once in each head,
    # so its calls are the heads' but its variables are shared: rep_grad refuses them.
    assert model_graph.shared_representation(model) is h
    with pytest.raises(ValueError, match=r"\['tied/kernel', 'tied/bias'\] are shared"):
        MultiTaskTrainer(model, method="mgda", rep_grad=True)
    # Two shared tensors read by heads: the representation must be named.
    x2 = keras.layers.Dense(5, name="side")(h)
    two = keras.Model(
        inputs,
        [
            keras.layers.Dense(1)(keras.layers.Add()([h, x2])),
            keras.layers.Dense(1)(keras.layers.Multiply()([h, x2])),
        ],
    )
    with pytest.raises(ValueError, match="representation=<layer name>"):
        model_graph.shared_representation(two)


def test_models_without_a_graph_share_everything_unless_told():
    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.trunk = keras.layers.Dense(5)
            self.a, self.b = keras.layers.Dense(1), keras.layers.Dense(3)

        def call(self, x):
            h = self.trunk(x)
            return [self.a(h), self.b(h)]

    model = TwoHeads()
    model(np.zeros((1, 4)))
    assert not model_graph.has_graph(model)
    with pytest.raises(ValueError, match="num_tasks"):
        MultiTaskTrainer(model, method="pcgrad")
    trainer = MultiTaskTrainer(model, num_tasks=2, tasks="outputs", method="pcgrad")
    assert trainer._variable_split()[1] == []
    trainer = MultiTaskTrainer(
        model,
        num_tasks=2,
        tasks="outputs",
        method="pcgrad",
        task_specific_variables=[*model.a.weights, *model.b.weights],
    )
    assert len(trainer._variable_split()[1]) == 4
    with pytest.raises(ValueError, match="functional"):
        MultiTaskTrainer(model, num_tasks=2, tasks="outputs", method="mgda", rep_grad=True)


# --------------------------------------------------- sum == plain multi-output fit


@pytest.mark.parametrize("l2", [0.0, 0.0625])
def test_sum_with_loss_weights_is_plain_multi_output_fit_step_for_step(float64, l2):
    """L_t = loss_weight_t * output t's compiled loss, so "sum" is fit's loss; the
    per-output losses, metrics and evaluate are Keras's (the model's own L2 loss is
    added once)."""
    x, y = data()
    metrics = {"priority": ["mae"], "department": ["accuracy"]}
    trainer = compiled(MultiTaskTrainer(two_head_model(l2=l2), method="sum"), metrics=metrics)
    plain = two_head_model(l2=l2)
    plain.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=losses(),
        loss_weights=LOSS_WEIGHTS,
        metrics=metrics,
    )
    runs = []
    for model, fitter in ((trainer.model, trainer), (plain, plain)):
        record = WeightsPerStep(model.trainable_variables)
        history = fitter.fit(
            x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[record]
        )
        runs.append((record.steps, history.history))
    (steps, h), (plain_steps, h_plain) = runs
    assert len(steps) == len(plain_steps) == 6
    for mine, theirs in zip(steps, plain_steps):
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)
    assert not np.allclose(steps[0][0], steps[-1][0])  # it trained
    for key in ("priority_loss", "department_loss", "priority_mae", "department_accuracy"):
        np.testing.assert_allclose(h[key], h_plain[key], rtol=1e-12, err_msg=key)
    np.testing.assert_allclose(h["loss"], h_plain["loss"], rtol=1e-6)  # float32 tracker
    assert trainer.task_names == ["priority", "department"]
    ev = trainer.evaluate(x, y, verbose=0, return_dict=True)
    ev_plain = plain.evaluate(x, y, verbose=0, return_dict=True)
    assert (
        set(ev)
        == set(ev_plain)
        == {"loss", "priority_loss", "department_loss", "priority_mae", "department_accuracy"}
    )
    for key in ev:
        np.testing.assert_allclose(ev[key], ev_plain[key], rtol=1e-12, err_msg=key)


def test_dict_outputs_and_per_output_sample_weights(float64):
    """A model with dict outputs and a dict of per-output sample weights: still fit."""

    def make():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(5, activation="tanh")(inputs)
        return keras.Model(
            inputs, {"priority": keras.layers.Dense(1)(h), "department": keras.layers.Dense(3)(h)}
        )

    x, y = data()
    rng = np.random.default_rng(5)
    sw = {"priority": rng.uniform(size=24), "department": rng.uniform(size=24)}
    trainer = compiled(MultiTaskTrainer(make(), method="sum"))
    plain = make()
    plain.set_weights(trainer.model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses(), loss_weights=LOSS_WEIGHTS)
    trainer.fit(x, y, sample_weight=sw, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, sample_weight=sw, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(trainer.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


# ------------------------------------------------ methods against NumPy (LibMTL)


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_two_head_grads(weights, x, y):
    """Losses and gradients of the two tasks (loss weights included) of `two_head_model`:
    per task, (shared [W1, b1] flat, head grads dict)."""
    W1, b1, Wa, ba, Wb, bb = weights
    B = len(x)
    h = np.tanh(x @ W1 + b1)
    a = h @ Wa + ba
    logits = h @ Wb + bb
    wa, wb = LOSS_WEIGHTS["priority"], LOSS_WEIGHTS["department"]
    p = _softmax(logits)
    onehot = np.eye(3)[y["department"]]
    losses = [
        wa * np.mean((a - y["priority"]) ** 2),
        wb * np.mean(-np.log(p[np.arange(B), y["department"]])),
    ]
    dA = wa * 2 * (a - y["priority"]) / B
    dB = wb * (p - onehot) / B
    out = []
    for d, W in ((dA, Wa), (dB, Wb)):
        dpre = (d @ W.T) * (1 - h**2)
        out.append(np.concatenate([(x.T @ dpre).ravel(), dpre.sum(0)]))
    heads = [(h.T @ dA, dA.sum(0)), (h.T @ dB, dB.sum(0))]
    return np.array(losses), np.array(out), heads


def np_train(method, steps, lr, batch, x, y, weights, options):
    W1, b1, Wa, ba, Wb, bb = [w.copy() for w in weights]
    for s in range(steps):
        sl = slice(s * batch, (s + 1) * batch)
        yb = {k: v[sl] for k, v in y.items()}
        losses, G, heads = np_two_head_grads([W1, b1, Wa, ba, Wb, bb], x[sl], yb)
        head_c = np.ones(2)
        if method == "sum":
            shared = G.sum(0)
        elif method == "pcgrad":
            shared = np_pcgrad(list(G), GS.random_order(2, options.get("seed", 0), s).numpy())
        elif method == "cagrad":
            calpha = options.get("calpha", 0.5)
            w = np_cagrad_exact_w(G, calpha)
            gw = G.T @ w
            c = calpha * np.sqrt((G @ G.T).mean() + 1e-8) + 1e-8
            shared = (G.mean(0) + c / (np.linalg.norm(gw) + 1e-8) * gw) / (1 + calpha**2)
        elif method == "nash_mtl":
            alpha, shared = libmtl_nash_numpy(G, np.ones(2), max_norm=options.get("max_norm", 1.0))
            head_c = alpha
        else:
            raise ValueError(method)
        W1 = W1 - lr * shared[: W1.size].reshape(W1.shape)
        b1 = b1 - lr * shared[W1.size :]
        (gWa, gba), (gWb, gbb) = [
            (head_c[t] * hw, head_c[t] * hb) for t, (hw, hb) in enumerate(heads)
        ]
        Wa, ba, Wb, bb = Wa - lr * gWa, ba - lr * gba, Wb - lr * gWb, bb - lr * gbb
    return [W1, b1, Wa, ba, Wb, bb]


@pytest.mark.parametrize(
    "method, options, rtol",
    [
        ("pcgrad", {"seed": 3}, 1e-10),
        ("cagrad", {"calpha": 0.4}, 1e-9),
        ("nash_mtl", {"max_norm": 0.5}, 1e-6),
    ],
)
def test_methods_on_two_outputs_equal_numpy_libmtl(float64, method, options, rtol):
    """Shared trunk: the method's combination of the two output losses' gradients; heads:
    their own raw gradients (LibMTL rep_grad=False; Nash-MTL: alpha_t times them)."""
    x, y = data(n=24, seed=4)
    y["priority"] *= 4.0  # a task that dominates, so that the methods act
    model = two_head_model(seed=7)
    weights = [v.numpy() for v in model.trainable_variables]
    seed = options.pop("seed", 0)
    trainer = compiled(
        MultiTaskTrainer(model, method=method, seed=seed, method_options=options), lr=0.25
    )
    h = trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # (a learning rate exact in float32: Keras keeps it in a float32 variable)
    expected = np_train(method, 3, 0.25, 8, x, y, weights, {"seed": seed, **options})
    for v, e in zip(trainer.model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=rtol, atol=rtol * 1e-2, err_msg=v.path)
    # the method acted: the trunk is not where the plain sum of the gradients takes it
    summed = np_train("sum", 3, 0.25, 8, x, y, weights, {})
    assert np.abs(summed[0] - expected[0]).max() > 1e-3
    assert np.isfinite(h.history["task_cosine"][0])


def test_two_replicas_equal_one(float64):
    x, y = data(n=24, seed=6)

    def run(strategy):
        with strategy.scope():
            trainer = compiled(
                MultiTaskTrainer(two_head_model(seed=5), method="pcgrad", seed=2),
                optimizer=keras.optimizers.Adam(0.05),
            )
        h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return [v.numpy() for v in trainer.model.trainable_variables], h.history

    one, h1 = run(tf.distribute.get_strategy())
    two, h2 = run(two_cpu_strategy())
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for key in ("loss", "priority_loss", "department_loss", "task_cosine"):
        np.testing.assert_allclose(h1[key], h2[key], rtol=1e-6, err_msg=key)


def test_xla_equals_eager(float64):
    x, y = data()
    results = []
    for jit in (False, True):
        trainer = compiled(
            MultiTaskTrainer(two_head_model(), method="pcgrad", seed=1), jit_compile=jit
        )
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append([v.numpy() for v in trainer.model.trainable_variables])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_config_round_trip():
    trainer = MultiTaskTrainer(two_head_model(), method="pcgrad", rep_grad=True)
    config = trainer.get_config()
    assert config["tasks"] == "outputs" and config["rep_grad"] is True
    again = MultiTaskTrainer.from_config(config)
    assert (again.tasks, again.num_tasks, again.rep_grad) == ("outputs", None, True)
    config = compiled(trainer).get_config()  # the count compile made
    again = MultiTaskTrainer.from_config(config)
    assert (again.tasks, again.num_tasks, again.rep_grad) == ("outputs", 2, True)


# ------------------------------------------------------------------- bad input


def test_bad_arguments_and_batches_are_clear_errors():
    single = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="1 output"):
        MultiTaskTrainer(single)
    with pytest.raises(ValueError, match="`tasks`"):
        MultiTaskTrainer(two_head_model(), tasks="columns")
    with pytest.raises(ValueError, match="num_tasks"):
        MultiTaskTrainer(two_head_model(), tasks="rows")
    with pytest.raises(ValueError, match="task_passes"):
        MultiTaskTrainer(two_head_model(), task_passes="gathered")
    with pytest.raises(ValueError, match="model_takes_task_id"):
        MultiTaskTrainer(two_head_model(), model_takes_task_id=True)
    with pytest.raises(ValueError, match="rep_grad"):
        MultiTaskTrainer(two_head_model(), method="sum", rep_grad=True)
    with pytest.raises(ValueError, match="representation"):
        MultiTaskTrainer(two_head_model(), method="pcgrad", representation="trunk")
    with pytest.raises(ValueError, match="no layer named 'nope'"):
        MultiTaskTrainer(two_head_model(), method="pcgrad", rep_grad=True, representation="nope")
    x, y = data()
    # three tasks declared on two outputs: at construction; one on two losses: at compile
    with pytest.raises(ValueError, match=r"`num_tasks`=3 .* `model` 'ticket' has 2 outputs"):
        MultiTaskTrainer(two_head_model(), num_tasks=3, tasks="outputs", method="pcgrad")
    trainer = MultiTaskTrainer(two_head_model(), num_tasks=1, tasks="outputs", method="pcgrad")
    with pytest.raises(ValueError, match=r"num_tasks=1\).*`loss` gives 2 outputs a loss"):
        compiled(trainer)

    # where compile cannot count (one loss for every output of a model without a graph)
    # the first step checks num_tasks against the compiled loss's terms
    class TwoOutputs(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(1), keras.layers.Dense(1)

        def call(self, x):
            return [self.a(x), self.b(x)]

    trainer = MultiTaskTrainer(TwoOutputs(), num_tasks=3, tasks="outputs", method="pcgrad")
    trainer.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"num_tasks=3\): the compiled loss has 2 output"):
        trainer.fit(x, [y["priority"], y["priority"]], batch_size=8, verbose=0)
    # a two-output model given task_id batches' trainer: the error says what to do
    trainer = MultiTaskTrainer(two_head_model(), num_tasks=2)
    trainer.compile(optimizer="sgd", loss=losses())
    with pytest.raises(ValueError, match="tasks='outputs'"):
        trainer.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.parametrize("rep_grad", [False, True])
def test_save_reload_and_resume(float64, tmp_path, rep_grad):
    """A saved outputs-setting trainer reloads (the representation model is not saved)
    and resumes as the original goes on."""
    x, y = data()
    method = "mgda" if rep_grad else "pcgrad"
    trainer = compiled(
        MultiTaskTrainer(two_head_model(), method=method, rep_grad=rep_grad),
        optimizer=keras.optimizers.Adam(0.05),
        metrics={"department": ["accuracy"]},
    )
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "trainer.keras")
    keras.saving.save_model(trainer, path)  # the trainer itself (trainer.save: the model)
    again = keras.models.load_model(path)
    assert (again.tasks, again.num_tasks, again.rep_grad) == ("outputs", 2, rep_grad)
    assert len(again.weights) == len(trainer.weights)
    h1 = trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    h2 = again.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    for a, b in zip(trainer.model.trainable_variables, again.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    assert set(h1) == set(h2)
    for key in h1:
        np.testing.assert_allclose(h1[key], h2[key], rtol=1e-6, err_msg=key)


# ------------------------------------------------- the _compat functions this uses


@pytest.mark.parametrize("built", [False, True])
def test_compat_recorded_loss_terms(built):
    """Keras's per-output terms, recorded without changing the compiled loss's result;
    the compiled loss is given back as it was (built or not)."""
    from tf_metaalign import _compat

    model = two_head_model()
    model.compile(
        loss={"priority": "mse", "department": "mse"},
        loss_weights={"priority": 2.0, "department": 0.5},
    )
    compile_loss = _compat.compiled_loss(model)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    y = [np.ones((6, 1), "float32"), np.zeros((6, 3), "float32")]
    y_pred = model(x)
    if built:
        compile_loss(y, y_pred)
    terms_before = None if not built else list(compile_loss._flat_losses)
    with _compat.recorded_loss_terms(compile_loss) as terms:
        total = compile_loss(y, y_pred)
    assert [w for _, w in terms] == [2.0, 0.5]
    expected = [np.mean((y_pred[0].numpy() - 1) ** 2), np.mean(y_pred[1].numpy() ** 2)]
    np.testing.assert_allclose([float(v) for v, _ in terms], expected, rtol=1e-6)
    np.testing.assert_allclose(float(total), 2 * expected[0] + 0.5 * expected[1], rtol=1e-6)
    assert _compat.compile_loss_names(compile_loss) == ["priority", "department"]
    assert "build" not in vars(compile_loss)
    if built:
        assert compile_loss._flat_losses == terms_before
    with _compat.recorded_loss_terms(compile_loss) as again:
        pass
    assert again == [] and len(terms) == 2  # nothing recorded outside the block


def test_compat_producing_node():
    from tf_metaalign import _compat

    model = two_head_model()
    trunk = model.get_layer("trunk")
    node, operation, inputs = _compat.producing_node(model.outputs[0])
    assert operation is model.get_layer("priority") and inputs[0] is trunk.output
    assert _compat.producing_node(model.inputs[0]) is None
