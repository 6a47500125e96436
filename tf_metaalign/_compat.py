"""Every private Keras / TensorFlow API tf_metaalign uses, each behind one function.

A Keras or TensorFlow upgrade that removes or changes one of these breaks one function
here, and `tests/test_compat.py` names it and says what to change. Each function says why
no public API serves. The rest of the package uses public APIs only (`keras.Variable`,
`keras.name_scope`, `keras.StatelessScope`, `model.stateless_call`, `model.compute_loss`,
`optimizer.add_variable(..., aggregation=...)`, the public `optimizer.learning_rate`
property, a variable's `overwrite_with_gradient` attribute, ...).

Checked against Keras 3.15, TensorFlow 2.21 and JAX 0.10 (pinned in pyproject.toml).
TensorFlow is imported inside the functions that need it, so this module imports on the
JAX backend without TensorFlow.

This module imports nothing of tf_metaalign.
"""

from __future__ import annotations

import contextlib

import keras
from keras import ops

# ================================================================================================
# trainers and the functional core
# ================================================================================================


def compiled_loss(model: keras.Model):
    """The loss object `model.compile(loss=..., loss_weights=...)` built (or None).

    Private: `Model._compile_loss`. Keras exposes no public handle on the compiled
    loss; `compute_loss` reads it. The trainers evaluate the compiled loss at weights
    given as tensors and must call exactly what `fit` calls, so they need the object.
    """
    return model._compile_loss


@contextlib.contextmanager
def lent_loss(model: keras.Model, compile_loss, losses):
    """Within the block, `model.compute_loss` sees `compile_loss` as its compiled loss
    and `losses` as `model.losses`.

    Private: `Model._compile_loss` and `Layer._losses_override` (the latter is how
    Keras's own JAX trainer hands the losses of a stateless forward pass to
    `compute_loss`). No public API lets `compute_loss` (and a user's override of it)
    run on a forward pass made at given weights (`stateless_call`): `model.losses`
    would read the variables instead of the given weights, and the wrapped model is
    not the model `compile` was called on.
    """
    saved = (model._compile_loss, model._losses_override)
    model._compile_loss = compile_loss
    # `losses` wins only when non-empty (Keras tests the list's truth value).
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._compile_loss, model._losses_override = saved


@contextlib.contextmanager
def released_custom_gradients():
    """On leaving the block, the `tf.custom_gradient` gradient functions that graphs traced
    within it registered are unregistered again.

    Why: in graph mode `tf.custom_gradient` registers every traced use under a new name
    ("CustomGradient-<uid>") in TensorFlow's process-wide gradient registry, and nothing
    ever removes it. The registered function closes over the traced tensors, so the whole
    traced graph -- and the functions (`tf.cond` branches, ...) it added to the eager
    context -- lives until the process ends. Keras's optimizer all-reduces the gradients
    with `ReplicaContext.all_reduce`, which goes through `tf.custom_gradient` whenever no
    gradient is a `tf.IndexedSlices` (even with one replica): every train function that
    applies dense gradients is kept. The trainers densify every gradient, so each
    trainer's train function was kept (a fresh 2-layer transformer classifier, 256
    examples x 2 epochs: 61 MB per run for DotProdTrainer; plain `fit` of the same
    model, whose embedding gradient is an IndexedSlices, keeps nothing; plain `fit` of a
    model without an embedding keeps its train function too). The registry is read only
    while gradients of such a graph are built, i.e. during its trace: after the call that
    traced a train function, nothing needs the entries.

    Private: `tensorflow.python.framework.ops._gradient_registry` (a `Registry`; its
    `_registry` dict, name -> entry, in insertion order) and the "CustomGradient-" names
    of `tensorflow.python.ops.custom_gradient.generate_name`. TensorFlow has no public
    way to unregister a gradient.
    """
    from tensorflow.python.framework import ops

    registry = ops._gradient_registry._registry
    before = len(registry)
    try:
        yield
    finally:
        if len(registry) > before:
            # Entries are only ever removed here, each block removing only the names added
            # after it started: the names added within this block are the last ones.
            added = list(registry)[before:]
            for name in added:
                if name.startswith("CustomGradient-"):
                    del registry[name]


def loss_tracker(model: keras.Model):
    """The `Mean` metric `fit` reports as "loss".

    Private: `Trainer._loss_tracker`. Keras's own `train_step` updates it; a
    `train_step` override that computes the loss itself has no public way to report
    it under the name "loss" (a second metric named "loss" would clash).
    """
    return model._loss_tracker


def flatten_layers(model: keras.Model):
    """Every layer nested in `model` (not `model` itself), depth first.

    Private: `Layer._flatten_layers`. `model.layers` lists only the direct children,
    and a layer that holds sublayers (a keras-hub TransformerEncoder) has no public
    list of them.
    """
    return list(model._flatten_layers(include_self=False))


@contextlib.contextmanager
def recorded_loss_terms(compile_loss):
    """Within the block, every call of `compile_loss` (a `CompileLoss`, what
    `compile(loss=..., loss_weights=...)` builds) appends to the yielded list one
    `(value, loss_weight)` per output loss, in Keras's order: `value` is what that
    output's loss function returned, before Keras casts it to the compiled loss's
    dtype and multiplies it by the weight. The compiled loss's own result (the total,
    its per-output loss trackers) is unchanged.

    Private: `CompileLoss._flat_losses` (the per-output `(path, loss, loss_weights,
    name)` terms, built at the first call) and an instance `build` while it is not yet
    built. Keras has no public per-output loss values; the multi-task trainer needs each
    output's loss exactly as `fit` computes it (the target/prediction matching, nested
    sample weights, `loss_weights`) without re-implementing `CompileLoss.call`.
    """
    record = []
    original = {"terms": None}

    def wrap():
        terms = compile_loss._flat_losses
        original["terms"] = terms

        def recorder(fn, weight):
            def call(y_true, y_pred, sample_weight=None):
                value = fn(y_true, y_pred, sample_weight)
                record.append((value, weight))
                return value

            return call

        compile_loss._flat_losses = [
            term._replace(loss=recorder(term.loss, term.loss_weights)) for term in terms
        ]

    patched_build = False
    if compile_loss.built:
        wrap()
    else:
        keras_build = type(compile_loss).build

        def build(y_true, y_pred):
            keras_build(compile_loss, y_true, y_pred)
            wrap()

        compile_loss.build = build
        patched_build = True
    try:
        yield record
    finally:
        if patched_build:
            del compile_loss.build
        if original["terms"] is not None:
            compile_loss._flat_losses = original["terms"]


def compile_loss_names(compile_loss):
    """The names of a built `CompileLoss`'s per-output terms (the output names Keras
    logs as `<name>_loss`), in its order; None if it is not built.

    Private: `CompileLoss._flat_losses` (see `recorded_loss_terms`).
    """
    if not getattr(compile_loss, "built", False):
        return None
    return [term.name for term in compile_loss._flat_losses]


def producing_node(tensor):
    """`(operation, input_tensors)` of the functional-graph node that produced the
    KerasTensor `tensor`, or None for a graph input (`keras.Input`).

    Private: `KerasTensor._keras_history`, `Operation._inbound_nodes` and the `Node`
    class (`keras.src.ops.node`). Keras exposes a functional model's layers but not its
    connectivity; `tf_metaalign.model_graph` walks it to find which layers feed one
    output only (task-specific heads) and the shared representation.
    """
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    node = history.operation._inbound_nodes[history.node_index]
    if node.is_input:
        return None
    return node, history.operation, list(node.input_tensors)


def scale_loss_for_distribution(value):
    """Divide a per-replica loss by the replica count exactly as Keras does.

    Private: `keras.src.losses.loss.scale_loss_for_distribution` (not exported). The
    trainers must use Keras's own rule so their losses and gradients have the units
    of `fit`'s.
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.scale_loss_for_distribution(value)


def unscale_loss_for_distribution(value):
    """Undo `scale_loss_for_distribution` (what `fit` logs as "loss").

    Private: `keras.src.losses.loss.unscale_loss_for_distribution` (not exported).
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.unscale_loss_for_distribution(value)


@contextlib.contextmanager
def unlocked_state(layer: keras.layers.Layer):
    """Allow `layer.add_weight` on a built layer within the block.

    Private: `Layer._tracker` (lock / unlock; Keras itself unlocks it to quantize a
    built layer). A trainer keeps copies of the wrapped model's weights (slow weights,
    initial weights) whose shapes exist only once the model is built, which for a
    subclassed model happens at its first call, after the trainer is built.
    """
    tracker = getattr(layer, "_tracker", None)
    was_locked = bool(tracker is not None and tracker.locked)
    if was_locked:
        tracker.unlock()
    try:
        yield
    finally:
        if was_locked:
            tracker.lock()


def is_seed_state(variable) -> bool:
    """Whether `variable` is the state of a `keras.random.SeedGenerator` (Dropout's).

    Private: the variable's name, "seed_generator_state" (Keras names it so and does
    not mark it otherwise). Keras's weights files (`save_weights`, `.keras`,
    `BackupAndRestore`) leave these states out, so a restored run would draw other
    dropout masks; the trainers checkpoint them themselves.
    """
    return variable.name == "seed_generator_state"


# ================================================================================================
# optimizers and forward mode
# ================================================================================================

# -- tf_metaalign.forward_mode ---------------------------------------------------------------------


def register_dispatchable_type(cls):
    """Lets `tf.experimental.dispatch_for_api` dispatch on instances of the plain class `cls`.

    Private API: `tensorflow.python.util.dispatch.register_dispatchable_type`.
    Why no public API serves: type-based dispatch only considers `tf.ExtensionType`s
    (which register themselves) and registered types. `forward_mode.Dual` is a plain class
    on purpose: an ExtensionType would need a TypeSpec for a tuple of optional tangents
    and would be rebuilt by TensorFlow at every op. TensorFlow registers its own
    `RaggedTensorValue` the same way.
    """
    from tensorflow.python.util import dispatch  # the private module, imported only here

    return dispatch.register_dispatchable_type(cls)


# -- tf_metaalign.optimizers.base.BaseOptimizer ---------------------------------------------------

#: The private Keras hook `BaseOptimizer` overrides (it must stay a method of the class, so it
#: cannot live here): `keras.optimizers.Optimizer._backend_update_step(self, grads,
#: trainable_variables, learning_rate)`, called by `apply_gradients` after Keras's own
#: clipping and weight decay, with the per-replica gradients and the learning rate. Keras's
#: TF backend all-reduces the gradients in it and then calls `update_step` per variable in
#: a cross-replica merge call. Why no public API serves: `update_step` sees one variable's
#: gradient, so a norm of the whole ALL-REDUCED gradient list (`aggregated_clipnorm`) can
#: only be taken in this hook; Keras's public `global_clipnorm` clips before the
#: all-reduce. tests/test_compat.py checks the name, the signature and that
#: `apply_gradients` calls it.
BACKEND_UPDATE_STEP_HOOK = "_backend_update_step"
BACKEND_UPDATE_STEP_ARGS = ("self", "grads", "trainable_variables", "learning_rate")


def maybe_merge_call(fn, strategy, *args, **kwargs):
    """Runs `fn(strategy, *args, **kwargs)` in cross-replica context, as Keras's
    `apply_gradients` does for its update.

    Private API: `tf.__internal__.distribute.interim.maybe_merge_call`.
    Why no public API serves: the public `ReplicaContext.merge_call` always synchronises
    the replicas; `maybe_merge_call` skips the merge where the strategy supports it
    (MirroredStrategy without merge calls) and is what Keras's own update uses, so our
    committed updates take the same path as `apply_gradients`.
    """
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args, **kwargs)


def optimizer_strategy(optimizer):
    """The `tf.distribute.Strategy` a Keras optimizer was created under.

    Private API: `keras.optimizers.Optimizer._distribution_strategy` (TF backend).
    Why no public API serves: `tf.distribute.get_strategy()` returns the strategy of the
    CURRENT scope, which need not be the one the optimizer (and so its variables) belongs
    to; Keras keeps the optimizer's strategy only in this attribute.
    """
    return optimizer._distribution_strategy


def variable_index(optimizer, variable):
    """The position of `variable` in the list a Keras optimizer was built with.

    Accepts the Keras variable, its `tf.Variable` (what Keras hands `update_step`), or one
    replica's copy of a mirrored variable.
    Private API: `keras.optimizers.Optimizer._get_variable_index(variable)`.
    Why no public API serves: mapping a replica's copy back to its mirrored container needs
    TensorFlow internals (`_distributed_container`) that Keras's `_var_key` already handles.
    """
    return optimizer._get_variable_index(variable)


def all_reduce_sum_gradients(optimizer, grads_and_vars):
    """Keras's all-reduce (sum over replicas) of `(gradient, variable)` pairs, as
    `apply_gradients` does it; unchanged outside a replica context.

    Private API: `keras.optimizers.Optimizer._all_reduce_sum_gradients(grads_and_vars)`
    (TF backend).
    Why not the public `ReplicaContext.all_reduce`: the overridden `_backend_update_step`
    must all-reduce exactly as Keras's own does (None gradients, no replica context), so
    that with `aggregated_clipnorm=None` it is Keras's step.
    """
    return optimizer._all_reduce_sum_gradients(grads_and_vars)


def distributed_update_step(optimizer):
    """Keras's cross-replica update, `fn(distribution, grads_and_vars, learning_rate)`: calls
    `optimizer.update_step` on every device's copy of every variable.

    Private API: `keras.optimizers.Optimizer._distributed_tf_update_step` (TF backend).
    Why no public API serves: it is the second half of Keras's `_backend_update_step`; the
    override calls it so that, besides the clipping, the update is Keras's.
    """
    return optimizer._distributed_tf_update_step


# ================================================================================================
# model classes
# ================================================================================================


def functional_model_classes() -> tuple:
    """The classes Keras puts into a `keras.Model` subclass's hierarchy once an instance of
    it is built functionally (`Functional` and its base `Function`, in MRO order).

    Private: `keras.src.models.functional.Functional` (Keras exports it only as the class of
    `keras.Model(inputs, outputs)`) and the behaviour of `inject_functional_model_class`
    (keras/src/models/model.py): a subclass called with `inputs=`/`outputs=` gets its
    `__bases__`, and those of every class between it and `keras.Model`, rewritten so that
    `Functional` replaces `keras.Model` -- in the shared class objects, for every other
    subclass of them too (keras-team/keras#17270). `tf_metaalign.prompts` keeps these
    classes out of its models' hierarchy, which extends keras-hub's functional `CausalLM`.
    """
    from keras.src.models.functional import Functional

    return tuple(c for c in Functional.__mro__ if c not in keras.Model.__mro__)


def own_variables_and_sublayers(layer) -> tuple[list, list]:
    """(the variables `layer` holds itself, its direct sublayers), in the order Keras's
    `layer.variables` visits them.

    Private: `Layer._trainable_variables`, `_non_trainable_variables`, `_layers`. Keras 3
    collects a model's `trainable_variables` from each variable's own `trainable` flag
    over `variables` (keras/src/layers/layer.py); a model that selects the trainable set
    of a sublayer itself (`tf_metaalign.prompts.TrainableSelection`) walks the same tree.
    """
    return layer._trainable_variables + layer._non_trainable_variables, list(layer._layers)


def outermost_call():
    """(the layer whose `__call__` began the Keras call now running, its `training`), or
    (None, None) outside any call.

    Private: `keras.src.backend.common.global_state`'s "current_call_ctx" (a `CallContext`
    with `entry_layer` and `training`), which `Layer.__call__` sets. A prompted model reads
    it to tell when a model around it is being trained (`fit`: `self(x, training=True)`).
    """
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    if context is None:
        return None, None
    return context.entry_layer, getattr(context, "training", None)


# ================================================================================================
# Keras's fit under MultiWorkerMirroredStrategy
# ================================================================================================

_MULTI_WORKER_FIT_PATCHED = []


def patch_keras_multi_worker_fit():
    """Work around two Keras 3.15 bugs that make every `fit` under
    `MultiWorkerMirroredStrategy` fail (a plain `keras.Sequential` too; upstream
    keras-team/keras#20585, tensorflow/tensorflow#72388). Idempotent; the trainers call
    it when they are created under that strategy.

    Private: `keras.src.backend.tensorflow.trainer` (`TensorFlowTrainer._maybe_symbolic_build`,
    `reduce_per_replica`, `_collective_all_reduce_multi_worker`). No public API reaches
    the code that fails:

    1. `_maybe_symbolic_build` peeks at one distributed batch and calls
       `strategy.reduce("MEAN", (x, y), axis=None)` on the whole nest, which the
       multi-worker eager reduce refuses. The batch is only used for its shapes and
       dtypes: each tensor's local value serves.
    2. `reduce_per_replica(logs, reduction="auto")` reduces each log with
       `strategy.reduce("MEAN", v, axis=0)`, which fails on scalar logs. They are reduced
       across replicas only (axis=None): the mean of the replicas' values, what the
       single-host path computes.
    """
    if _MULTI_WORKER_FIT_PATCHED:
        return
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = tf_trainer.reduce_per_replica

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return tf.distribute.get_strategy().experimental_local_results(value)[0]
        return value

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is not None and iterator is not None:
            for _, _, it in iterator:
                with self.distribute_strategy.scope():
                    data_batch = tf.nest.map_structure(local, next(it))
                break
            iterator = None
        return original_build(self, iterator=iterator, data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
            strategy
        ):
            return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original_reduce(values, strategy, reduction)

    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    _MULTI_WORKER_FIT_PATCHED.append(True)


# ------------------------------------------------------- batch norm for meta-gradients


def building_xla_function() -> bool:
    """Whether the graph being built is (or is inside) a `jit_compile=True` function:
    Keras's `compile(jit_compile=True)` train step, or a user's XLA `tf.function`.

    Through TF's private `control_flow_util.GraphOrParentsInXlaContext`, what
    `tf.function` itself asks before opening an XLA context.
    """
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def _batch_norm_axis(layer):
    axis = layer.axis
    if isinstance(axis, (list, tuple)):
        axis = axis[0] if len(axis) == 1 else None
    return axis


def _batch_norm_training_call(layer, keras_call, inputs, training=None, mask=None):
    """`keras.layers.BatchNormalization.call` with derivatives of every order right.

    Keras 3 takes the batch moments from `ops.moments` (TF: `tf.nn.moments`; JAX: the
    same stop), whose variance is
    mean((x - stop_gradient(mean))^2): its first derivative is exact (the stopped term's
    derivative is zero at the mean), its SECOND derivative is not, so a second-order
    meta-gradient (MAML) through a Keras BatchNormalization is wrong (measured: a
    Hessian-vector product off by 0.23 on values of 2.5 against float64 finite
    differences). Training passes of a trainable layer without mask, renorm or
    cross-replica statistics are computed here instead, with mean and variance =
    mean((x - mean)^2), nothing stopped. Same semantics as Keras's training pass:
    normalise with the batch mean and the BIASED batch variance (computed in float32 at
    least, as Keras), then moving = moving * momentum + batch * (1 - momentum). Every other
    pass: Keras's own `call`.

    Not TensorFlow's fused kernel (`FusedBatchNormV3`, exact second derivative too): a
    second-order MAMLTrainer with gradient sharing built after another trainer in the same
    process failed with "InvalidArgumentError: 4406 nodes in a cycle" in its train
    function (reproduced with trainers.fewshot --methods=maml,maml_gs; not with this
    formulation), and it was not measurably faster here (Conv-4, 2 tasks, second order,
    2 loaded CPU cores: 464 vs 477 ms per meta-step, Keras's own layer 438 ms).
    """
    inputs = ops.convert_to_tensor(inputs)
    if not (
        training
        and layer.trainable
        and mask is None
        and not layer.renorm
        and not getattr(layer, "synchronized", False)
    ):
        return keras_call(inputs, training=training, mask=mask)
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    compute_dtype = "float64" if dtype == "float64" else "float32"
    x = ops.cast(inputs, compute_dtype)
    rank = len(x.shape)
    axis = _batch_norm_axis(layer) % rank
    channels = x.shape[axis]
    gamma = (
        ops.cast(layer.gamma, compute_dtype) if layer.scale else ops.ones([channels], compute_dtype)
    )
    beta = (
        ops.cast(layer.beta, compute_dtype)
        if layer.center
        else ops.zeros([channels], compute_dtype)
    )
    reduce_axes = [a for a in range(rank) if a != axis]
    shape = [1] * rank
    shape[axis] = channels
    mean = ops.mean(x, reduce_axes)
    centred = x - ops.reshape(mean, shape)
    variance = ops.mean(ops.square(centred), reduce_axes)
    outputs = centred * ops.reshape(
        gamma * ops.rsqrt(variance + layer.epsilon), shape
    ) + ops.reshape(beta, shape)
    momentum = layer.momentum
    layer.moving_mean.assign(
        ops.cast(
            ops.cast(layer.moving_mean, compute_dtype) * momentum + mean * (1.0 - momentum),
            layer.moving_mean.dtype,
        )
    )
    layer.moving_variance.assign(
        ops.cast(
            ops.cast(layer.moving_variance, compute_dtype) * momentum + variance * (1.0 - momentum),
            layer.moving_variance.dtype,
        )
    )
    return ops.cast(outputs, layer.compute_dtype)


@contextlib.contextmanager
def batch_norm_for_meta_gradients(model: keras.Model):
    """While active, the `keras.layers.BatchNormalization` layers of `model` (the class
    itself, not subclasses, which may override `call`) compute their training passes
    with exact higher derivatives (`_batch_norm_training_call`).

    Private: it sets an instance `call` (Keras's `Operation.__call__` looks `self.call`
    up on the instance) and removes it on exit.
    """
    patched = []
    for layer in flatten_layers(model):
        if type(layer) is keras.layers.BatchNormalization and "call" not in vars(layer):
            keras_call = type(layer).call.__get__(layer)

            def call(inputs, training=None, mask=None, _layer=layer, _keras_call=keras_call):
                return _batch_norm_training_call(_layer, _keras_call, inputs, training, mask)

            object.__setattr__(layer, "call", call)
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            object.__delattr__(layer, "call")


def is_plain_dense(layer) -> bool:
    """`layer` is a `keras.layers.Dense` computing `activation(x @ kernel + bias)` as
    Keras 3.15 writes it: the class itself (a subclass may override `call`), no LoRA, not
    quantized, `call` not replaced on the instance. Read by
    `recorded_dense_pre_activations`, which re-writes that `call`."""
    return (
        type(layer) is keras.layers.Dense
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
        and "call" not in vars(layer)
    )


def dense_input_rank(layer):
    """The rank of a functional-graph Dense layer's input (None when the layer has no
    graph node or more than one: the rank is then not known before a call)."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if len(nodes) != 1:
        return None
    tensors = getattr(nodes[0], "input_tensors", None) or ()
    return len(tensors[0].shape) if len(tensors) == 1 else None


@contextlib.contextmanager
def recorded_dense_pre_activations(layers):
    """While active, each layer of `layers` (plain Dense layers, `is_plain_dense`)
    records `(inputs, z)` of every call into the yielded dict (keyed by the layer's
    position in `layers`), z = inputs @ kernel + bias, the pre-activation output, and
    returns `activation(z)`: Dense's own `call` (keras/src/layers/core/dense.py),
    computed the same way, with z a tensor a GradientTape can differentiate against.

    Private: it sets an instance `call` (Keras's `Operation.__call__` looks `self.call`
    up on the instance) and removes it on exit; `tests/test_compat.py` checks it
    reproduces Dense's outputs.
    """
    records = {}
    for position, layer in enumerate(layers):
        if not is_plain_dense(layer):
            raise ValueError(f"{layer.name!r} is not a plain keras.layers.Dense layer")

        def call(inputs, training=None, _layer=layer, _position=position):
            z = keras.ops.matmul(inputs, _layer.kernel)
            if _layer.bias is not None:
                z = keras.ops.add(z, _layer.bias)
            records.setdefault(_position, []).append((inputs, z))
            return _layer.activation(z) if _layer.activation is not None else z

        object.__setattr__(layer, "call", call)
    try:
        yield records
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")


# ================================================================================================
# the JAX backend
# ================================================================================================


def jax_trace_state_clean() -> bool:
    """Whether JAX is not tracing (no jit, grad or vmap under way).

    Private: `jax._src.core.trace_state_clean`. JAX has no public "am I tracing" test; the
    trainers ask it only where TensorFlow asks `tf.executing_eagerly()` (a model built by
    an eager first call, a Python branch on a concrete predicate).
    """
    from jax._src import core

    return core.trace_state_clean()


def in_keras_symbolic_scope() -> bool:
    """Whether Keras is building symbolically (`compute_output_spec`, the first build).

    Private: `keras.src.backend.common.symbolic_scope.in_symbolic_scope` (not exported).
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def current_stateless_scope():
    """The innermost active `keras.StatelessScope`, or None.

    Private: `keras.src.backend.common.stateless_scope.get_stateless_scope` (Keras
    exports the scope class, not the accessor). The JAX step threads state through it.
    """
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def keras_jax_promotes_64_bit(enabled: bool) -> bool:
    """Let Keras's type promotion keep float64/int64 on JAX (`enabled`), or restore its
    default (64-bit results computed as 32-bit); returns the previous setting.

    Private: `keras.src.backend.common.dtypes.BIT64_TO_BIT32_DTYPE`. Keras 3.15 maps every
    64-bit result type to 32 bits on JAX "to be aligned with JAX's default" (x64 off),
    whatever `jax_enable_x64` says, so `ops.tanh` of a float64 tensor is float32 there and
    a float64 model computes partly in float32. With x64 on, JAX itself keeps 64 bits;
    Keras's table is the only thing in the way, and no public setting changes it.
    """
    from keras.src.backend.common import dtypes

    table = dtypes.BIT64_TO_BIT32_DTYPE
    previous = table.get("float64") == "float64"
    if enabled:
        table.update({"int64": "int64", "uint64": "uint64", "float64": "float64"})
        table.update({"complex128": "complex128"})
    else:
        table.update(
            {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}
        )
    return previous


def keras_jax_nn():
    """Keras's JAX `nn` module, whose `max_pool` `keras.ops.max_pool` (and so Keras's
    pooling layers) calls at trace time.

    Private: `keras.src.backend.jax.nn`. `backend.jax_pooling` swaps its `max_pool` for
    an exact element-wise form while a trainer's step is traced (XLA CPU's gradient of
    `reduce_window` is a scalar loop); Keras has no public hook for a backend op.
    """
    from keras.src.backend.jax import nn

    return nn
