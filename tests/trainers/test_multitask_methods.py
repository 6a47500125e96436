"""Every registered multi-task method inside MultiTaskTrainer: the trainer's step is the
method's combination of the per-task gradients with the shared / task-specific rule, on a
shared trunk with a `PerTaskHead` (LibMTL's `rep_grad=False` semantics), 1 replica == 2,
and state checkpointed. The methods' own combinations are checked against NumPy
re-derivations of the references in tests/test_mtl_*.py and test_gradient_surgery.py;
here the oracle computes each task's gradient with its own GradientTape on the model, so
the trainer's plumbing (task losses, units, the variable split, the single-pass path of
the loss-weighting methods) is what is tested.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.data.multitask import PerTaskHead
from tf_metaalign.trainers import MultiTaskTrainer

T = 3
METHODS = methods.method_names()


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), name="inputs", dtype="float64")
    task_id = keras.Input((), name="task_id", dtype="int32")
    h = keras.layers.Dense(5, activation="tanh", dtype="float64", name="trunk")(inputs)
    h = keras.layers.Dense(3, activation="tanh", dtype="float64", name="trunk_2")(h)
    out = PerTaskHead([2, 2, 2], dtype="float64", name="heads")([h, task_id])
    return keras.Model({"inputs": inputs, "task_id": task_id}, out)


def _data(n=12, seed=0, absent=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = rng.normal(size=(n, 2))
    task = (np.arange(n) % T).astype("int32")
    if absent is not None:
        task = np.where(task == absent, (absent + 1) % T, task).astype("int32")
    y[task == 1] *= -3.0
    return {"inputs": x, "task_id": task}, y


def _trainer(method, model=None, **kwargs):
    trainer = MultiTaskTrainer(
        model or _model(), num_tasks=T, method=method, model_takes_task_id=True, seed=5, **kwargs
    )
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.MeanSquaredError())
    return trainer


def _oracle_step(trainer, x, y):
    """-(the trainer's gradient) computed independently: task t's mean loss over its own
    rows and its gradient by a GradientTape on the model, the Gram matrix over the
    variables outside `PerTaskHead`, the method's combination at the trainer's state."""
    model = trainer.model
    variables = model.trainable_variables
    head_ids = {id(v) for v in model.get_layer("heads").trainable_variables}
    shared = [i for i, v in enumerate(variables) if id(v) not in head_ids]
    losses, grads, present = [], [], []
    mse = keras.losses.MeanSquaredError()
    for t in range(T):
        rows = np.flatnonzero(x["task_id"] == t)
        present.append(float(len(rows) > 0))
        if not len(rows):
            losses.append(tf.constant(0.0, tf.float64))
            grads.append([tf.zeros_like(v) for v in variables])
            continue
        with tf.GradientTape() as tape:
            out = model({"inputs": x["inputs"][rows], "task_id": x["task_id"][rows]}, training=True)
            loss = mse(y[rows], out)
        losses.append(tf.cast(loss, tf.float64))
        grads.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    shared_grads = [[g[i] for i in shared] for g in grads]
    inputs = methods.TaskInputs(
        losses=tf.stack(losses),
        present=tf.constant(present, tf.float64),
        step=tf.constant(0, tf.int64),
        epoch=tf.constant(0, tf.int64),
        seed=5,
        gram=GS.gram_matrix(shared_grads),
        task_grads=shared_grads,
        shared_variables=[variables[i] for i in shared],
    )
    state = {k: tf.convert_to_tensor(v.value) for k, v in trainer.method_state.items()}
    c = trainer.method_object.combine(inputs, state)
    shared_c = tf.cast(c.shared, tf.float64)
    specific_c = shared_c if c.specific is None else tf.cast(c.specific, tf.float64)
    out = []
    for v in range(len(variables)):
        coefficients = shared_c if v in shared else specific_c
        out.append(GS.combine([[g[v]] for g in grads], coefficients)[0].numpy())
    return out


@pytest.mark.parametrize("absent", [None, 2])
@pytest.mark.parametrize("method", METHODS)
def test_step_is_the_methods_combination_shared_and_task_specific(float64, method, absent):
    x, y = _data(absent=absent)
    trainer = _trainer(method)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    expected = _oracle_step(trainer, x, y)
    trainer.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in trainer.model.trainable_variables]
    for b, a, g, v in zip(before, after, expected, trainer.model.trainable_variables):
        np.testing.assert_allclose(b - a, g, rtol=1e-9, atol=1e-12, err_msg=v.path)
    assert np.all(np.isfinite(np.concatenate([np.ravel(a) for a in after])))


def test_heads_are_task_specific_and_the_old_rule_is_reachable(float64):
    """PCGrad on the shared trunk only, the heads' raw task gradients (LibMTL); with
    task_specific_variables="none" the surgery also acts on the heads (the earlier
    behaviour), which gives another step on this conflicting data."""
    x, y = _data()
    trainer = _trainer("pcgrad")
    names = [v.path for v in trainer.task_specific_variables]
    assert names and all(n.startswith("heads/") for n in names), names
    assert {v.path for v in trainer.shared_variables} == {
        "trunk/kernel",
        "trunk/bias",
        "trunk_2/kernel",
        "trunk_2/bias",
    }
    old = _trainer("pcgrad", task_specific_variables="none")
    assert not old.task_specific_variables
    for t in (trainer, old):
        t.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    heads = trainer.model.get_layer("heads").kernel.numpy()
    old_heads = old.model.get_layer("heads").kernel.numpy()
    assert np.max(np.abs(heads - old_heads)) > 1e-6


def test_user_named_task_specific_variables(float64):
    """A variable named task-specific gets sum_t g_t (raw, for PCGrad) instead of the
    surgery: naming the trunk's last layer moves it out of the Gram matrix."""
    x, y = _data()
    model = _model()
    extra = [v.path for v in model.get_layer("trunk_2").trainable_variables]
    trainer = _trainer("pcgrad", model=model, task_specific_variables=extra)
    specific = {trainer.model.trainable_variables[i].path for i in trainer._variable_split()[1]}
    assert set(extra) <= specific
    expected = _oracle_step_with_split(trainer, x, y, specific)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    trainer.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    for b, v, g in zip(before, trainer.model.trainable_variables, expected):
        np.testing.assert_allclose(b - v.numpy(), g, rtol=1e-9, atol=1e-12, err_msg=v.path)


def _oracle_step_with_split(trainer, x, y, specific_paths):
    model = trainer.model
    variables = model.trainable_variables
    mse = keras.losses.MeanSquaredError()
    grads = []
    for t in range(T):
        rows = np.flatnonzero(x["task_id"] == t)
        with tf.GradientTape() as tape:
            loss = mse(
                y[rows],
                model({"inputs": x["inputs"][rows], "task_id": x["task_id"][rows]}, training=True),
            )
        grads.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    shared = [i for i, v in enumerate(variables) if v.path not in specific_paths]
    gs = np.stack([np.concatenate([np.ravel(g[i].numpy()) for i in shared]) for g in grads])
    order = GS.random_order(T, 5, 0).numpy()
    pc = [gs[i].copy() for i in range(T)]
    for i in range(T):  # Yu et al. Algorithm 1 in NumPy (one order, as the trainer draws)
        for j in order:
            d = pc[i] @ gs[j]
            if j != i and d < 0:
                pc[i] = pc[i] - d / (gs[j] @ gs[j]) * gs[j]
    flat = np.sum(pc, axis=0)
    out, start = [], 0
    for v, var in enumerate(variables):
        if v in shared:
            n = int(np.prod(var.shape))
            out.append(flat[start : start + n].reshape(var.shape))
            start += n
        else:
            out.append(sum(g[v].numpy() for g in grads))
    return out


def test_gradnorm_measures_the_last_shared_layer_not_a_head(float64):
    trainer = _trainer("gradnorm")
    variables = trainer.model.trainable_variables
    shared, _ = trainer._variable_split()
    chosen = trainer.method_object.variable_index([variables[i] for i in shared])
    assert variables[shared[chosen]].path == "trunk_2/kernel"


#: Methods whose 1 replica == 2 runs by default elsewhere on a MultiTaskTrainer (the
#: default suite's budget): tests/algorithms (test_mtl_weighting.py's uw, dwa, famo;
#: test_mtl_nash_aligned.py's nash_mtl, aligned_mtl; test_gradient_surgery.py's gradvac),
#: test_multitask_factored.py's mgda and test_trainer_battery.py's "replicas" check
#: (multitask_uw, multitask_nash_mtl, multitask_gradvac, multitask_gradnorm,
#: multitask_outputs_mgda_rep_grad). Here under -m slow; the default suite keeps this
#: PerTaskHead model's split (shared / task-specific coefficients) on 2 replicas for sum,
#: rlw (single pass), pcgrad, cagrad and imtl (a specific combination unlike the shared).
_REPLICAS_COVERED = (
    "uw",
    "dwa",
    "famo",
    "nash_mtl",
    "aligned_mtl",
    "gradvac",
    "gradnorm",
    "mgda",
)
assert set(_REPLICAS_COVERED) <= set(METHODS), _REPLICAS_COVERED


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=pytest.mark.slow) if m in _REPLICAS_COVERED else m for m in METHODS],
)
def test_two_replicas_equal_one(float64, method):
    """Global per-task losses and gradients before the combination: 2 replicas take the
    steps 1 replica takes (two steps of Adam, method state compared too)."""
    x, y = _data(n=24, seed=3)

    def run(strategy):
        with strategy.scope():
            trainer = MultiTaskTrainer(
                _model(), num_tasks=T, method=method, model_takes_task_id=True, seed=5
            )
            trainer.compile(
                optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.MeanSquaredError()
            )
        trainer.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        return [v.numpy() for v in trainer.model.trainable_variables] + [
            v.numpy() for v in trainer.method_state.values()
        ]

    for a, b in zip(run(tf.distribute.get_strategy()), run(two_cpu_strategy())):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", [m for m in METHODS if methods.get_method(m).state_spec(T)])
def test_method_state_is_checkpointed(float64, method, tmp_path):
    """The method's state (GradVac's targets, GradNorm's weights, UW's log-variances, ...)
    is saved with the trainer and restored: two more steps from a reloaded checkpoint
    equal two more steps of the original."""
    x, y = _data(n=24, seed=4)
    trainer = _trainer(method)
    trainer.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "t.weights.h5")
    trainer.save_weights(path)
    other = _trainer(method, model=_model(seed=9))
    other(x)  # built
    other.optimizer.build(other.trainable_variables)
    other.load_weights(path)
    for a, b in zip(trainer.method_state.values(), other.method_state.values()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for t in (trainer, other):
        t.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(trainer.weights, other.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)


def test_sum_takes_one_backward_pass_and_equals_plain_fit(float64):
    """ "sum" is one forward and one backward pass of the summed task losses: with B/T
    rows per task and a mean loss, SGD(lr) on it == plain fit with SGD(T * lr)."""
    x, y = _data(n=12)
    trainer = _trainer("sum")
    plain = _model()
    plain.compile(optimizer=keras.optimizers.SGD(float(T)), loss=keras.losses.MeanSquaredError())
    trainer.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(trainer.model.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    assert not trainer._needs_task_gradients()


def test_method_objects_and_config_round_trip():
    trainer = MultiTaskTrainer(
        _model(), num_tasks=T, method=methods.GradVac(beta=0.3), model_takes_task_id=True
    )
    config = trainer.get_config()
    assert config["method"] == {"name": "gradvac", "config": {"beta": 0.3}}
    again = MultiTaskTrainer.from_config(config)
    assert again.method_object == methods.GradVac(beta=0.3)
    assert MultiTaskTrainer(
        _model(), num_tasks=T, method="gradvac", method_options={"beta": 0.3}
    ).method_object == methods.GradVac(0.3)
    with pytest.raises(ValueError, match="beta"):
        methods.get_method("pcgrad", beta=0.3)
    with pytest.raises(ValueError, match="constructor"):
        methods.get_method(methods.PCGrad(), beta=0.3)


@pytest.mark.parametrize("method", METHODS)
def test_combination_compiles_once_under_xla(method):
    """The combination under XLA does not bake a data-dependent value into the program (a
    strided slice at a tensor index, a shape from the data): XLA would then recompile the
    train step on every new value (MGDA's simplex projection did: 1.9 s per step). The
    HLO compiled for three different sets of task gradients and losses is the same."""
    trainer = _trainer(method)
    variables = trainer.model.trainable_variables
    head_ids = {id(v) for v in trainer.model.get_layer("heads").trainable_variables}
    shared = [v for v in variables if id(v) not in head_ids]
    method_object = trainer.method_object
    if isinstance(method_object, methods.GradNorm):
        method_object.variable_index(shared)

    @tf.function(jit_compile=True)
    def combine(flat_grads, losses, step):
        task_grads = [flat_grads[t * len(shared) : (t + 1) * len(shared)] for t in range(T)]
        inputs = methods.TaskInputs(
            losses=losses,
            present=tf.ones([T], tf.float64),
            step=step,
            epoch=tf.constant(0, tf.int64),
            seed=5,
            gram=GS.gram_matrix(task_grads),
            task_grads=task_grads,
            shared_variables=shared,
        )
        state = {k: tf.convert_to_tensor(v.value) for k, v in trainer.method_state.items()}
        c = method_object.combine(inputs, state)
        return c.shared, c.state

    programs = set()
    for seed in range(3):
        rng = np.random.default_rng(seed)
        flat = [tf.constant(rng.normal(size=v.shape)) for _ in range(T) for v in shared]
        args = (flat, tf.constant(rng.uniform(0.5, 2.0, size=T)), tf.constant(seed, tf.int64))
        shared_c, _ = combine(*args)
        assert np.all(np.isfinite(shared_c.numpy()))
        programs.add(combine.experimental_get_compiler_ir(*args)(stage="hlo"))
    assert len(programs) == 1


@pytest.mark.parametrize("method", [m for m in METHODS if methods.get_method(m).uses_gradients])
def test_compiled_combination_equals_graph_ops(float64, method):
    """`compile_combination=True` (the default: the T x T algebra as one XLA function)
    trains as the plain graph ops do, state and logged task cosine included."""
    x, y = _data(absent=2)
    runs = []
    for compiled in (True, False):
        trainer = _trainer(method, compile_combination=compiled)
        h = trainer.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        runs.append(
            (
                [v.numpy() for v in trainer.model.trainable_variables]
                + [v.numpy() for v in trainer.method_state.values()],
                h.history,
            )
        )
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for key in runs[0][1]:
        np.testing.assert_allclose(runs[0][1][key], runs[1][1][key], rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="compile_combination"):
        _trainer(method, compile_combination="yes")


def test_compiled_combination_is_shared_by_trainers(float64):
    """Fresh trainers with the same method configuration reuse ONE compiled combination
    (and its XLA executable: TF's XLA cache keeps every compiled function for the
    process, so a function per trainer kept 8-15 MB per run); another configuration gets
    its own."""
    from tf_metaalign.trainers import multitask_tf as trainer_module

    def shared_functions(method_type):
        return [
            f
            for key, f in trainer_module._COMPILED_COMBINATIONS.items()
            if key[0] is method_type and key[2] == 5
        ]

    x, y = _data()
    seen = [{id(f) for f in shared_functions(methods.GradVac)}]  # other tests' configurations
    for method in (methods.GradVac(beta=0.3), methods.GradVac(beta=0.3), methods.GradVac(0.7)):
        _trainer(method).fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        seen.append(
            {id(f): f.experimental_get_tracing_count() for f in shared_functions(methods.GradVac)}
        )
    assert len(seen[1]) == len(seen[0]) + 1 and seen[2] == seen[1], seen  # reused, no retrace
    assert len(seen[3]) == len(seen[1]) + 1, seen


class _GradientNormWeighting(methods.MultiTaskMethod):
    """Reads the task gradients themselves with `compiles_well` left True (a user's
    method): the shared compiled combination cannot give them."""

    name = "gradient_norm_weighting_test"
    reads_task_gradients = True

    def combine(self, inputs, state):
        norms = tf.stack([tf.linalg.global_norm(g) for g in inputs.task_grads])
        return methods.Combination(shared=inputs.present / (1.0 + norms))


def test_compiled_combination_of_a_method_reading_task_gradients(float64):
    """Such a method still trains, compiled as before (a function of the trace), equal
    to the graph ops."""
    x, y = _data()
    runs, method = [], _GradientNormWeighting()
    for compiled in (True, False):
        trainer = _trainer(method, compile_combination=compiled)
        trainer.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        runs.append([v.numpy() for v in trainer.model.trainable_variables])
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert not np.allclose(runs[0][0], _model().trainable_variables[0].numpy())
    from tf_metaalign.trainers import multitask_tf as trainer_module

    shared = [f for k, f in trainer_module._COMPILED_COMBINATIONS.items() if k[0] is type(method)]
    assert shared == [None]  # tried once, then compiled per trace


@pytest.mark.parametrize("positional", [False, True])
def test_epoch_counter_runs_before_the_users_callbacks(positional):
    """DWA reads the epoch: the trainer's counter ends each epoch BEFORE the user's
    callbacks (BackupAndRestore among them must save the new count), callbacks given by
    keyword or by position."""
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, int(trainer.epochs_done.numpy())))

    x, y = _data()
    trainer = _trainer("dwa")
    if positional:  # fit(x, y, batch_size, epochs, verbose, callbacks)
        trainer.fit(x, y, 6, 3, 0, [Probe()], shuffle=False)
    else:
        trainer.fit(x, y, batch_size=6, epochs=3, verbose=0, callbacks=[Probe()], shuffle=False)
    assert seen == [(0, 1), (1, 2), (2, 3)]
