"""One test per private Keras / TensorFlow API behind tf_metaalign._compat.

Each fails, after a Keras or TensorFlow upgrade that removes or changes the API, with a
message naming the API and what to change in tf_metaalign/_compat.py.
"""

import gc
import inspect
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from tf_metaalign import _compat
from tf_metaalign import forward_mode as fm
from tf_metaalign import optimizers as O


def _broken(api, used_for, change):
    return (
        f"The private API {api} changed or is gone in this Keras/TensorFlow version "
        f"(keras {keras.__version__}, tensorflow {tf.__version__}). tf_metaalign uses it for "
        f"{used_for}. Change tf_metaalign/_compat.py: {change}"
    )


def _parameters(function):
    return tuple(inspect.signature(function).parameters)


# ================================================================================================
# optimizers and forward mode
# ================================================================================================


def test_register_dispatchable_type():
    message = _broken(
        "tensorflow.python.util.dispatch.register_dispatchable_type",
        "forward_mode.Dual (tf.math ops dispatch to its chain rules)",
        "find TensorFlow's new registration of dispatchable types, or make Dual a "
        "tf.experimental.ExtensionType (which dispatches without registration).",
    )
    from tensorflow.python.util import dispatch

    assert callable(getattr(dispatch, "register_dispatchable_type", None)), message
    out = tf.math.multiply(fm.seed(tf.constant(2.0), 1, 0), tf.constant(3.0))
    assert isinstance(out, fm.Dual), message
    assert float(out.tangents[0]) == 3.0, message


def test_maybe_merge_call():
    message = _broken(
        "tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)",
        "committing an update in cross-replica context (assign_variable_update, "
        "BaseOptimizer._backend_update_step), as Keras's apply_gradients does",
        "use what Keras's TF optimizer now uses in _backend_update_step (or the public "
        "tf.distribute.get_replica_context().merge_call(fn, args=...)).",
    )
    interim = getattr(getattr(tf.__internal__, "distribute", None), "interim", None)
    assert callable(getattr(interim, "maybe_merge_call", None)), message
    strategy = tf.distribute.get_strategy()
    seen = []
    _compat.maybe_merge_call(lambda s, x: seen.append((s, x)), strategy, 7)
    assert seen == [(strategy, 7)], message


def test_optimizer_strategy():
    message = _broken(
        "keras.optimizers.Optimizer._distribution_strategy",
        "the strategy an optimizer's slot variables are colocated and updated with",
        "read the strategy Keras's TF optimizer now keeps (see keras/src/backend/tensorflow/"
        "optimizer.py), or record tf.distribute.get_strategy() in BaseOptimizer.__init__.",
    )
    strategy = two_cpu_strategy()
    with strategy.scope():
        opt = O.SGD(0.1)
    assert _compat.optimizer_strategy(opt) is strategy, message
    assert _compat.optimizer_strategy(O.SGD(0.1)) is tf.distribute.get_strategy(), message


def test_variable_index():
    message = _broken(
        "keras.optimizers.Optimizer._get_variable_index(variable)",
        "finding a variable's slots and options (slots_for, options_for, update_step)",
        "keep a dict from Keras's variable key to the index in BaseOptimizer.build, mapping "
        "a tf.Variable and a replica's copy of a mirrored variable to its container.",
    )
    a = keras.Variable(np.zeros((2,), "float32"), name="a")
    b = keras.Variable(np.zeros((3,), "float32"), name="b")
    opt = keras.optimizers.SGD(0.1)
    opt.build([a, b])
    assert _parameters(type(opt)._get_variable_index) == ("self", "variable"), message
    assert _compat.variable_index(opt, b) == 1, message
    assert _compat.variable_index(opt, b.value) == 1, message  # what update_step receives
    strategy = two_cpu_strategy()
    with strategy.scope():
        mirrored = keras.Variable(np.zeros((2,), "float32"), name="m")
        opt2 = keras.optimizers.SGD(0.1)
        opt2.build([a, mirrored])
    for copy in mirrored.value.values:  # each replica's copy
        assert _compat.variable_index(opt2, copy) == 1, message


def test_all_reduce_sum_gradients():
    message = _broken(
        "keras.optimizers.Optimizer._all_reduce_sum_gradients(grads_and_vars)",
        "the all-reduce before aggregated clipping in BaseOptimizer._backend_update_step",
        "all-reduce as Keras's TF _backend_update_step now does (e.g. "
        "tf.distribute.get_replica_context().all_reduce(SUM, grads), skipping None "
        "gradients and the cross-replica context).",
    )
    assert _parameters(keras.optimizers.SGD._all_reduce_sum_gradients) == (
        "self",
        "grads_and_vars",
    ), message
    strategy = two_cpu_strategy()
    with strategy.scope():
        v = keras.Variable(np.zeros((2,), "float32"), name="v")
        opt = keras.optimizers.SGD(0.1)

    @tf.function
    def run():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            g = tf.fill((2,), tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
            return _compat.all_reduce_sum_gradients(opt, [(g, v.value)])[0][0]

        return strategy.run(replica_fn)

    for value in strategy.experimental_local_results(run()):
        np.testing.assert_array_equal(value.numpy(), [3.0, 3.0], err_msg=message)
    # one replica (the default strategy): the gradient itself
    w = keras.Variable(np.zeros((2,), "float32"), name="w")
    reduced = _compat.all_reduce_sum_gradients(
        keras.optimizers.SGD(0.1), [(tf.ones((2,)), w.value)]
    )
    np.testing.assert_array_equal(reduced[0][0].numpy(), [1.0, 1.0], err_msg=message)


def test_distributed_update_step():
    message = _broken(
        "keras.optimizers.Optimizer._distributed_tf_update_step(distribution, "
        "grads_and_vars, learning_rate)",
        "the per-variable update after aggregated clipping in BaseOptimizer._backend_update_step",
        "call what Keras's TF _backend_update_step now calls after its all-reduce, or "
        "distribution.extended.update(var, update_step, args=(grad, learning_rate), "
        "group=False) per variable.",
    )
    assert _parameters(keras.optimizers.SGD._distributed_tf_update_step) == (
        "self",
        "distribution",
        "grads_and_vars",
        "learning_rate",
    ), message
    v = keras.Variable(np.ones((2,), "float32"), name="v")
    opt = keras.optimizers.SGD(0.5)
    opt.build([v])
    update = _compat.distributed_update_step(opt)
    update(tf.distribute.get_strategy(), [(tf.ones((2,)), v.value)], 0.5)
    np.testing.assert_array_equal(v.numpy(), [0.5, 0.5], err_msg=message)


def test_backend_update_step_hook():
    message = _broken(
        "keras.optimizers.Optimizer._backend_update_step(grads, trainable_variables, "
        "learning_rate), overridden by BaseOptimizer",
        "aggregated_clipnorm (clipping the all-reduced gradients before the update)",
        "override the hook Keras's apply_gradients now calls with the per-replica "
        "gradients after its own clipping, and update BACKEND_UPDATE_STEP_HOOK/_ARGS.",
    )
    hook = getattr(keras.optimizers.Optimizer, _compat.BACKEND_UPDATE_STEP_HOOK, None)
    assert callable(hook), message
    assert _parameters(hook) == _compat.BACKEND_UPDATE_STEP_ARGS, message
    assert _compat.BACKEND_UPDATE_STEP_HOOK in O.BaseOptimizer.__dict__, message

    calls = []

    class Spy(keras.optimizers.SGD):
        def _backend_update_step(self, grads, trainable_variables, learning_rate):
            calls.append(len(grads))
            return super()._backend_update_step(grads, trainable_variables, learning_rate)

    v = keras.Variable(np.ones((2,), "float32"), name="v")
    Spy(0.5).apply_gradients([(np.ones((2,), "float32"), v)])
    assert calls == [1], message
    np.testing.assert_array_equal(v.numpy(), [0.5, 0.5], err_msg=message)
    # and through it, BaseOptimizer clips the aggregate (see test_optimizers for the values)
    w = keras.Variable(np.zeros((2,), "float32"), name="w")
    O.SGD(1.0, aggregated_clipnorm=1.0).apply_gradients([(np.array([3.0, 4.0], "float32"), w)])
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6, err_msg=message)


def test_no_other_private_api_in_optimizers_and_forward_mode():
    """Private Keras/TF modules and attributes are used only through _compat."""
    import pathlib
    import re

    root = pathlib.Path(O.__file__).parent
    files = sorted(root.glob("*.py")) + [pathlib.Path(fm.__file__)]
    private = re.compile(
        r"keras\.src|tensorflow\.python|tf\.__internal__|"
        r"\b(?:self|optimizer)\._(?:get_variable_index|distribution_strategy|"
        r"all_reduce_sum_gradients|distributed_tf_update_step|track_variable|"
        r"overwrite_variable_with_gradient|get_current_learning_rate|learning_rate\b)"
    )
    offenders = [
        f"{path.name}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, "use tf_metaalign._compat (or the public API) instead:\n" + "\n".join(
        offenders
    )


# ------------------------------------------------------------------------ trainers


def _compiled_model():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, activity_regularizer=keras.regularizers.L2(0.1))]
    )
    model.compile(loss="mse")
    return model


def test_compiled_loss_is_the_object_compute_loss_calls():
    model = _compiled_model()
    loss = _compat.compiled_loss(model)
    assert loss is not None and callable(loss), (
        "keras Model._compile_loss is gone or no longer the compiled loss: update "
        "tf_metaalign._compat.compiled_loss (trainers evaluate the compiled loss at given weights)."
    )
    y, p = np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")
    np.testing.assert_allclose(float(loss(y, p, None)), 1.0)


def test_lent_loss_reaches_compute_loss_and_is_given_back():
    model = _compiled_model()
    own = _compat.compiled_loss(model)
    y, p = np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")
    extra = [tf.constant(5.0)]
    with _compat.lent_loss(model, lambda *_: tf.constant(2.0), extra):
        value = float(model.compute_loss(None, y, p, None))
    assert value == 7.0, (
        "Model.compute_loss no longer reads Model._compile_loss / Layer._losses_override: "
        "update tf_metaalign._compat.lent_loss (the trainers' loss at given weights)."
    )
    assert _compat.compiled_loss(model) is own and not model._losses_override


def test_loss_tracker_is_fits_loss_metric():
    model = _compiled_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss", (
        "Trainer._loss_tracker changed: update tf_metaalign._compat.loss_tracker "
        "(trainers report their loss under the name 'loss' through it)."
    )
    assert tracker in model.metrics


def test_flatten_layers_lists_nested_layers():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="deep")])
    outer = keras.Sequential([keras.Input((3,)), inner])
    names = [layer.name for layer in _compat.flatten_layers(outer)]
    assert "deep" in names, (
        "Layer._flatten_layers changed: update tf_metaalign._compat.flatten_layers."
    )


def test_loss_scaling_for_distribution_matches_replica_count():
    assert float(_compat.scale_loss_for_distribution(tf.constant(6.0))) == 6.0
    strategy = two_cpu_strategy()
    scaled = strategy.run(lambda: _compat.scale_loss_for_distribution(tf.constant(6.0)))
    assert [float(v) for v in strategy.experimental_local_results(scaled)] == [3.0, 3.0], (
        "keras.src.losses.loss.scale_loss_for_distribution changed: update tf_metaalign._compat."
    )
    unscaled = strategy.run(lambda: _compat.unscale_loss_for_distribution(tf.constant(3.0)))
    assert [float(v) for v in strategy.experimental_local_results(unscaled)] == [6.0, 6.0]


def _traced_all_reduce_gradient():
    """Traces (and runs) a function whose gradient goes through an all-reduce of a dense
    tensor (what Keras's optimizer does to the gradients); returns (weak reference to the
    traced graph, the gradient of sum(x^2) at x = [1, 2])."""

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            (y,) = tf.distribute.get_replica_context().all_reduce("sum", [x * x])
        return tape.gradient(y, x)

    graph = weakref.ref(gradient.get_concrete_function(tf.TensorSpec([2])).graph)
    return graph, gradient(tf.constant([1.0, 2.0])).numpy()


def test_released_custom_gradients_unregisters_them_and_frees_the_graph():
    from tensorflow.python.framework import ops

    def custom():
        return {n for n in ops._gradient_registry.list() if n.startswith("CustomGradient-")}

    before = custom()
    graph, _ = _traced_all_reduce_gradient()
    gc.collect()
    assert custom() - before and graph() is not None, (
        "TensorFlow no longer keeps a graph-mode tf.custom_gradient (ReplicaContext.all_reduce "
        "of dense tensors) registered: if the graph is freed, "
        "tf_metaalign._compat.released_custom_gradients and its use in MetaTrainer's "
        "make_train_function can go (tests/trainers/test_trainer_battery.py repeated_runs "
        "checks the trainers)."
    )
    before = custom()
    other = f"TfMetaalignTestGradient{ops.uid()}"
    with _compat.released_custom_gradients():
        graph, grad = _traced_all_reduce_gradient()
        # Another gradient registered in the block is not a custom gradient: it stays.
        ops.RegisterGradient(other)(lambda op, g: g)
    gc.collect()
    np.testing.assert_allclose(grad, [2.0, 4.0])  # traced with the custom gradient in place
    assert custom() == before and graph() is None, (
        "tensorflow.python.framework.ops._gradient_registry._registry (name -> gradient "
        "function) or the 'CustomGradient-' names of custom_gradient.generate_name changed: "
        "update tf_metaalign._compat.released_custom_gradients (without it every trainer's "
        "train function stays in memory until the process ends)."
    )
    assert ops._gradient_registry.lookup(other) is not None


def test_unlocked_state_allows_adding_weights_to_a_built_layer():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    with pytest.raises(ValueError):
        layer.add_weight(shape=(), name="late")
    with _compat.unlocked_state(layer):
        layer.add_weight(shape=(), name="late")
    assert len(layer.weights) == 3, (
        "Layer._tracker lock/unlock changed: update _compat.unlocked_state."
    )
    with pytest.raises(ValueError):  # locked again
        layer.add_weight(shape=(), name="later")


def test_seed_generator_states_are_recognised_and_still_not_saved(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5, seed=1)])
    seeds = [v for v in model.non_trainable_variables if _compat.is_seed_state(v)]
    assert len(seeds) == 1, (
        "Keras's SeedGenerator state variable is no longer named 'seed_generator_state': "
        "update tf_metaalign._compat.is_seed_state."
    )
    model(np.ones((2, 3)), training=True)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5, seed=1)])
    other.load_weights(path)
    lost = not np.array_equal(seeds[0].numpy(), other.non_trainable_variables[0].numpy())
    # If Keras starts saving seed states, the trainers' own copy (trainers/base.py
    # _restore_seed_states) is redundant but harmless: this says so.
    assert lost, "Keras now saves SeedGenerator states: the trainers' seed-state copy can go."


def test_keras_multi_worker_fit_internals_are_still_there():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    for name in ("reduce_per_replica", "_collective_all_reduce_multi_worker"):
        assert callable(getattr(tf_trainer, name, None)), _broken(
            f"keras.src.backend.tensorflow.trainer.{name}",
            "fit under MultiWorkerMirroredStrategy (patch_keras_multi_worker_fit)",
            "check whether Keras fixed keras-team/keras#20585 and drop the patch, or adapt it.",
        )
    assert _parameters(tf_trainer.TensorFlowTrainer._maybe_symbolic_build) == (
        "self",
        "iterator",
        "data_batch",
    ), _broken(
        "TensorFlowTrainer._maybe_symbolic_build",
        "fit under MultiWorkerMirroredStrategy",
        "adapt patch_keras_multi_worker_fit to the new signature.",
    )


def test_recorded_dense_pre_activations_reproduce_dense_and_record_each_call():
    """`recorded_dense_pre_activations` re-writes Dense's `call` (activation(x @ kernel +
    bias), keras/src/layers/core/dense.py): the outputs must stay Keras's own, at given
    weights (stateless_call) too, and each call's (inputs, pre-activation) recorded; the
    instance `call` is removed on exit. `is_plain_dense` refuses what it cannot re-write."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(4, activation="tanh")
    model = keras.Model(inputs, keras.layers.Dense(2)(dense(inputs)))
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    expected = model(x).numpy()
    params = [v.value * 2.0 for v in model.trainable_variables]
    expected_at = model.stateless_call(params, [], x)[0].numpy()
    assert _compat.is_plain_dense(dense) and _compat.dense_input_rank(dense) == 2
    with _compat.recorded_dense_pre_activations([dense]) as records:
        np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-6)
        out_at = model.stateless_call(params, [], x)[0].numpy()
    np.testing.assert_allclose(out_at, expected_at, rtol=1e-6)
    assert len(records[0]) == 2
    (x0, z0), (_, z1) = records[0]
    np.testing.assert_allclose(x0.numpy(), x)
    np.testing.assert_allclose(z0.numpy(), x @ dense.kernel.numpy() + dense.bias.numpy(), rtol=1e-5)
    np.testing.assert_allclose(z1.numpy(), x @ params[0].numpy() + params[1].numpy(), rtol=1e-5)
    assert "call" not in vars(dense)
    lora = keras.layers.Dense(2)
    lora.build((None, 3))
    lora.enable_lora(1)
    assert not _compat.is_plain_dense(lora)
    assert not _compat.is_plain_dense(keras.layers.EinsumDense("ab,bc->ac", (2,)))
    with pytest.raises(ValueError, match="plain keras.layers.Dense"):
        with _compat.recorded_dense_pre_activations([lora]):
            pass


def test_functional_model_classes_are_what_keras_injects_into_a_subclass():
    """A keras.Model subclass built with inputs/outputs gets exactly these classes put into
    its hierarchy (Keras's inject_functional_model_class), before keras.Model."""

    class Subclass(keras.Model):
        pass

    inputs = keras.Input((2,))
    Subclass(inputs=inputs, outputs=keras.layers.Dense(1)(inputs))
    injected = Subclass.__mro__[1 : Subclass.__mro__.index(keras.Model)]
    assert injected == _compat.functional_model_classes(), _broken(
        "keras.src.models.functional.Functional / inject_functional_model_class",
        "keeping Functional out of the prompted models' class hierarchy "
        "(tf_metaalign.prompts.base.SubclassedModelType)",
        f"functional_model_classes must return {injected}.",
    )


def test_own_variables_and_sublayers_walk_what_keras_variables_walks():
    """Every variable of `layer.variables` but the seed states is a variable some layer in
    the walk holds itself, in Keras's order (a frozen sublayer included)."""

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.bias = self.add_weight(shape=(1,), name="bias")
            self.dense = keras.layers.Dense(2)
            self.norm = keras.layers.BatchNormalization()
            self.norm.trainable = False

        def call(self, x):
            return self.norm(self.dense(x)) + self.bias

    model = Model()
    model(np.ones((1, 3), "float32"))

    def walk(layer):
        variables, sublayers = _compat.own_variables_and_sublayers(layer)
        return list(variables) + [v for s in sublayers for v in walk(s)]

    expected = [v for v in model.variables if not _compat.is_seed_state(v)]
    assert [id(v) for v in walk(model)] == [id(v) for v in expected], _broken(
        "Layer._trainable_variables / _non_trainable_variables / _layers",
        "a model's trainable set honouring a prompted model's `train` "
        "(tf_metaalign.functional.TrainableSelection)",
        "own_variables_and_sublayers must return what Layer.variables walks.",
    )


def test_outermost_call_names_the_model_whose_call_began():
    """Inside a sublayer's call, the outermost model being called and its `training`."""
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            seen.append(_compat.outermost_call())
            return x

    class Outer(keras.Model):
        def __init__(self):
            super().__init__()
            self.probe = Probe()

        def call(self, x, training=None):
            return self.probe(x)

    outer = Outer()
    outer(np.ones((1, 2), "float32"))  # builds (Keras may run the probe on its own then)
    seen.clear()
    outer(np.ones((1, 2), "float32"), training=True)
    assert _compat.outermost_call() == (None, None)
    assert seen == [(outer, True)], _broken(
        "keras.src.backend.common.global_state 'current_call_ctx' (CallContext)",
        "the error when a plain model trains a prompt-only model's backbone "
        "(tf_metaalign.prompts.base.PromptedBackbone._check_outer_model)",
        "outermost_call must return (entry_layer, training) of the current call.",
    )
