"""A Keras model evaluated at *given* weights, and algebra on lists of gradients.

Nothing in this module assigns a variable. Every function takes weights as tensors and
returns new tensors, so it can run inside `tf.function`, XLA (`jit_compile=True`) and any
`tf.distribute` strategy's replica context, and it can be differentiated through.

Conventions
-----------
* `params`: list of tensors, one per `model.trainable_variables`, in that order.
* `state`: list of tensors, one per `model.non_trainable_variables` (BatchNorm statistics,
  the random-seed state of Dropout layers, ...), in that order. Evaluating twice from the
  same `state` gives the same dropout masks; the returned `new_state` is what Keras would
  have assigned after the call.
* A *loss function* in the algorithms has the signature
  `loss_fn(params, state, batch) -> (loss, (new_state, outputs))`, in the style of
  `jax.value_and_grad(..., has_aux=True)`; `make_loss_fn` builds one from a Keras model.
* Loss scaling under a strategy follows Keras exactly: a compiled mean-reduced loss is
  already divided by the number of replicas (Keras's loss reduction), and
  the optimizer *sums* gradients across replicas, so per-replica gradients are in
  "replica-scaled" units whose sum is the global mean gradient. `all_reduce_sum` turns
  such per-replica values into the global value; `unscale_loss_for_distribution` turns a
  per-replica loss back into a number that does not depend on the replica count.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_metaalign import _compat

LossFn = Callable  # (params, state, batch) -> (loss, (new_state, outputs))

# --------------------------------------------------------------------------- model state


def selected_variable_ids(layer) -> set:
    """The ids of the variables `layer` trains: Keras's rule (each variable's own
    `trainable` flag, nothing when `layer.trainable` is False), except that a sublayer which
    selects its own trainable set (a `TrainableSelection`, e.g. a prompted model) contributes
    that set."""
    if not layer.trainable:
        return set()
    if isinstance(layer, TrainableSelection):
        return layer._selected_ids()
    return _flag_selected_ids(layer)


def _flag_selected_ids(layer) -> set:
    variables, sublayers = _compat.own_variables_and_sublayers(layer)
    ids = {id(v) for v in variables if v.trainable}
    for sublayer in sublayers:
        if isinstance(sublayer, TrainableSelection):
            ids |= selected_variable_ids(sublayer)
        else:  # Keras reads the flags below a trainable layer, not the sublayers' `trainable`
            ids |= _flag_selected_ids(sublayer)
    return ids


class TrainableSelection:
    """A `keras.Model` mixin: the model's trainable set is Keras's (each variable's own
    `trainable` flag), except that a sublayer which is itself a `TrainableSelection` (a
    prompted model, `tf_metaalign.prompts`) contributes the set it selects. Put it before
    `keras.Model` in the bases of a model that holds a prompted model (a task head around
    `prompt_bert`, `PromptedT5LM`; every `MetaTrainer` has it).

    Why: a prompted model selects what it trains without setting any flag on the backbone
    it shares with your own models (so `lm.trainable_variables` stays as it was), and Keras 3
    builds a model's `trainable_variables` / `trainable_weights` from the flags of the
    variables under it, never from its sublayers' `trainable_variables`; a plain
    `keras.Model` around `prompt_bert(backbone, train="prompt")` would train the backbone.

    `trainable_variables`, `non_trainable_variables`, `trainable_weights` and
    `non_trainable_weights` keep Keras's order (that of `variables` / `weights`) and split,
    so `stateless_call`, `fit` (TensorFlow's `trainable_weights`, JAX's
    `trainable_variables`), the optimizer and this module's `params` / `state` see one set;
    with no selecting sublayer inside, they are Keras's lists. A class that selects its own
    set overrides `_selected_ids` (the ids of the variables it trains; its `trainable` is
    checked before).

    Example:
      >>> import keras_hub
      >>> from tf_metaalign import prompts  # prompts.TrainableSelection is this class
      >>> backbone = keras_hub.models.BertBackbone(
      ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
      ...     intermediate_dim=16, max_sequence_length=8)
      >>> class Classifier(prompts.TrainableSelection, keras.Model):
      ...     def __init__(self, prompted):
      ...         super().__init__()
      ...         self.prompted, self.head = prompted, keras.layers.Dense(2)
      ...     def call(self, x):
      ...         return self.head(self.prompted(x)["pooled_output"])
      >>> model = Classifier(prompts.prompt_bert(backbone, length=2, train="prompt"))
      >>> _ = model({"token_ids": np.array([[2, 5, 6]]), "segment_ids": np.zeros((1, 3)),
      ...            "padding_mask": np.ones((1, 3))})
      >>> [v.name for v in model.trainable_variables]  # the prompt and the head
      ['prompt_embeddings', 'kernel', 'bias']
      >>> len(backbone.trainable_variables) == len(backbone.weights)  # still all yours
      True
    """

    def _selected_ids(self) -> set:
        """The ids of the variables this model trains (`selected_variable_ids` checked its
        `trainable`)."""
        return _flag_selected_ids(self)

    def _selected(self, variables, trained: bool) -> list:
        ids = selected_variable_ids(self)
        return [v for v in variables if (id(v) in ids) == trained]

    @property
    def trainable_variables(self):
        return self._selected(self.variables, True)

    @property
    def non_trainable_variables(self):
        return self._selected(self.variables, False)

    @property
    def trainable_weights(self):
        return self._selected(self.weights, True)

    @property
    def non_trainable_weights(self):
        return self._selected(self.weights, False)


def current_params(model: keras.Model) -> list[tf.Tensor]:
    """The current values of `model.trainable_variables`, as tensors."""
    return [tf.convert_to_tensor(v.value) for v in model.trainable_variables]


def current_state(model: keras.Model) -> list[tf.Tensor]:
    """The current values of `model.non_trainable_variables`, as tensors."""
    return [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]


def assign_state(model: keras.Model, new_state: Sequence[tf.Tensor]) -> None:
    """Write `new_state` into `model.non_trainable_variables` (what a stateful call does).

    Keras creates BatchNorm statistics and seed-generator states with aggregation
    "none"; assigning them from a replica context is what Keras's own layers do, and
    every replica computes the same value for the seed state.
    """
    variables = model.non_trainable_variables
    if len(new_state) != len(variables):
        raise ValueError(
            f"assign_state: `new_state` has {len(new_state)} tensors but the model has "
            f"{len(variables)} non-trainable variables."
        )
    for variable, value in zip(variables, new_state):
        variable.assign(value)


def _ensure_built(model: keras.Model) -> None:
    if not model.built:
        raise ValueError(
            f"The model {model.name!r} must be built (call it once on a batch, or give "
            "its Input shapes) before it can be evaluated at given weights."
        )


def stateless_forward(
    model: keras.Model,
    params: Sequence[tf.Tensor],
    state: Sequence[tf.Tensor],
    x,
    training: bool = True,
    exact_batch_norm: bool = True,
):
    """Run `model(x, training=training)` at weights `params`/`state`.

    Returns `(outputs, new_state, model_losses)` where `model_losses` are the losses the
    model adds itself (`add_loss`, activity and weight regularisers), computed at
    `params` (what `model.losses` holds after a call).

    `exact_batch_norm`: the model's `keras.layers.BatchNormalization` layers compute their
    training passes (no mask, renorm or synchronized statistics) with second derivatives
    that are right: Keras's own (TF's `tf.nn.moments`) stops a gradient inside the
    variance, harmless for first derivatives, wrong for second ones (a MAML meta-gradient
    through them is not the derivative of the query loss). Same values and first
    derivatives as Keras's layer up to rounding; `_compat.batch_norm_for_meta_gradients`.
    """
    _ensure_built(model)
    kwargs = {"training": training} if call_has_training_arg(model) else {}
    context = (
        _compat.batch_norm_for_meta_gradients(model)
        if exact_batch_norm
        else contextlib.nullcontext()
    )
    with context:
        outputs, new_state, losses = model.stateless_call(
            list(params), list(state), x, return_losses=True, **kwargs
        )
    return outputs, list(new_state), list(losses)


def traced_once(fn: Callable) -> Callable:
    """`fn` as ONE traced function, called for every task (and step) when the caller is
    already building a graph (`tf.function`, `fit`); else `fn` itself (eager stays eager).

    For inner loops unrolled over tasks x steps (MAML, prompt FOMAML/Reptile): traced
    inline, every call re-traces the model's forward pass, its gradient and (second
    order) the outer tape's gradient of that gradient. A nested `tf.function` is traced
    once per input signature, and its gradient functions are built once and reused for
    every call. Grappler inlines the calls before the graph runs: the run time does not
    change (keeping the calls with `_noinline` was 25% slower). Measured, MAML 8 tasks x 5
    steps, second order, 2 CPU cores: the first meta-step (tracing + graph optimisation)
    171 s -> 39 s. Python values are closed over; only tensors are arguments, and the
    function must not all-reduce (keep collectives outside it).

    Under XLA (`jit_compile=True`) `fn` itself: XLA compiles nested function calls and
    their gradient functions without inlining them first, and compiling got 6x slower
    (MAML battery model, second order: 135 s, 22 s inline).
    """
    if not tf.inside_function() or _compat.building_xla_function():
        return fn
    return tf.function(fn, autograph=False)


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes `training` (Keras passes it only then)."""
    return "training" in inspect.signature(model.call).parameters


def compute_loss(
    model: keras.Model, x, y, y_pred, sample_weight, model_losses, training=True, loss=None
):
    """`model.compute_loss(x, y, y_pred, sample_weight, training)`, the loss `fit` uses,
    for outputs computed at given weights.

    It honours `compile(loss=..., loss_weights=...)`, multi-output models and an
    override of `compute_loss` in the model's class. `model_losses` (from
    `stateless_forward`) stand in for `model.losses`. `loss`: the compiled loss to use
    instead of the model's own (a trainer passes its compiled loss; a custom loop may
    pass any `loss(y_true, y_pred, sample_weight)`, e.g. a `keras.losses.Loss`);
    None = the model's own `compile` loss. Model losses are added as Keras adds them.
    """
    compile_loss = _compat.compiled_loss(model) if loss is None else loss
    if compile_loss is None and not model_losses and _uses_keras_compute_loss(model):
        raise ValueError(
            f"No loss to compute for the model {model.name!r}: pass `loss=` to compile() "
            "(of the trainer, or of the model in a custom loop), or give the model losses "
            "of its own (add_loss, regularisers)."
        )
    with _compat.lent_loss(model, compile_loss, model_losses):
        if "training" in inspect.signature(model.compute_loss).parameters:
            return model.compute_loss(x, y, y_pred, sample_weight, training=training)
        return model.compute_loss(x, y, y_pred, sample_weight)


def _uses_keras_compute_loss(model):
    return type(model).compute_loss is keras.Model.compute_loss


def make_loss_fn(
    model: keras.Model,
    loss: Callable | None = None,
    training: bool = True,
    loss_scale: tf.Tensor | float | None = None,
) -> LossFn:
    """A pure `loss_fn(params, state, batch) -> (loss, (new_state, outputs))` for `model`.

    Args:
      model: a built Keras model (Sequential, functional, subclassed, keras-hub backbone).
      loss: the compiled loss: called as `loss(y_true, y_pred, sample_weight)`, e.g. a
        `keras.losses.Loss` or a trainer's compiled loss; None = the model's own
        `compile` loss. The value is what `fit` would compute at these weights:
        `model.compute_loss` (see `compute_loss`), so Keras mean-reduced losses are
        already divided by the number of replicas under a strategy, and the model's
        own losses are added as Keras adds them.
      training: passed to the model's `call`.
      loss_scale: multiplies the returned loss (mixed-precision loss scaling); the
        unscaled loss is not returned, divide by the same factor.

    `batch` is `(x, y)` or `(x, y, sample_weight)`.
    """

    def loss_fn(params, state, batch):
        x, y, sample_weight = unpack_batch(batch)
        outputs, new_state, model_losses = stateless_forward(
            model, params, state, x, training=training
        )
        value = compute_loss(
            model, x, y, outputs, sample_weight, model_losses, training=training, loss=loss
        )
        if loss_scale is not None:
            value = value * tf.cast(loss_scale, value.dtype)
        return value, (new_state, outputs)

    return loss_fn


def make_split_loss_fn(
    model: keras.Model,
    loss: Callable | None,
    n_first,
    training: bool = True,
    loss_scale: tf.Tensor | float | None = None,
) -> LossFn:
    """`L(b1) + L(b2)` from ONE forward pass over the whole batch.

    `loss_fn(params, state, batch) -> (L1 + L2, (new_state, outputs, L1, L2))`, where b1 is
    the first `n_first` examples and b2 the rest, each loss computed on its slice of the
    outputs (so any reduction is respected) and each including the model's own losses,
    exactly as two `make_loss_fn` evaluations would. Its gradient is G1 + G2 at the cost of
    one full-batch pass instead of two half-batch passes; only layers that mix examples
    (BatchNormalization in training mode) see the whole batch instead of each half.
    """

    def loss_fn(params, state, batch):
        x, y, sample_weight = unpack_batch(batch)
        outputs, new_state, model_losses = stateless_forward(
            model, params, state, x, training=training
        )
        first, second = split_batch((x, y, outputs, sample_weight), n_first)
        values = [
            compute_loss(model, *part, model_losses, training=training, loss=loss)
            for part in (first, second)
        ]
        if loss_scale is not None:
            values = [v * tf.cast(loss_scale, v.dtype) for v in values]
        return values[0] + values[1], (new_state, outputs, values[0], values[1])

    return loss_fn


def unpack_batch(batch):
    """`(x,)`, `(x, y)` or `(x, y, sample_weight)` -> `(x, y, sample_weight)` (Keras's rule)."""
    return keras.utils.unpack_x_y_sample_weight(tuple(batch) if isinstance(batch, list) else batch)


def value_and_grad(loss_fn: LossFn, params, state, batch):
    """`(loss, grads, aux)` of `loss_fn` at `params`; `grads` are dense tensors."""
    params = list(params)
    with tf.GradientTape() as tape:
        tape.watch(params)
        value, aux = loss_fn(params, state, batch)
    return value, dense_gradient(tape, value, params), aux


def value_grad_and_hvp(loss_fn: LossFn, params, state, batch, vector):
    """`(loss, grads, aux, H v)` of `loss_fn` at `params`: the gradient and the exact
    Hessian-vector product with `vector` (held constant), reverse over reverse.

    `H v = d/dparams (grads . v)`; about twice the cost of `value_and_grad`. `H v` is
    in the dtypes of `grads`. Used by Meta DotProd's `method="exact"` (-H2 G1) and by the
    sharpness measure `algorithms.sam.largest_hessian_eigenvalue` (power iteration).
    """
    params = list(params)
    vector = [tf.stop_gradient(v) for v in vector]
    with tf.GradientTape() as outer:
        outer.watch(params)
        with tf.GradientTape() as inner:
            inner.watch(params)
            value, aux = loss_fn(params, state, batch)
        grads = dense_gradient(inner, value, params)
        grads_dot_v = dot(grads, vector)
    hv = dense_gradient(outer, grads_dot_v, params)
    return value, grads, aux, [tf.cast(h, g.dtype) for h, g in zip(hv, grads)]


def unscale_gradients(grads, gradient_scale, dtypes=None) -> list[tf.Tensor]:
    """`grads / gradient_scale` (a mixed-precision loss scale), computed in the
    accumulation dtype and cast to `dtypes` (one per gradient; default: the accumulation
    dtype). A python scale is exact in that dtype (`scalar`). What a perturbation of the
    weights must be built from: the true gradient, not the loss-scaled one."""
    grads = list(grads)
    acc = accumulation_dtype(grads)
    unscale = 1.0 / scalar(gradient_scale, acc)
    dtypes = [acc] * len(grads) if dtypes is None else list(dtypes)
    return [tf.cast(tf.cast(g, acc) * unscale, d) for g, d in zip(grads, dtypes)]


def offset_params(params, direction, step) -> list[tf.Tensor]:
    """`params + step * direction` in each parameter's dtype: the weights at which a
    two-pass algorithm takes its second gradient (Meta DotProd: step = -alpha along G1;
    SAM: step = 1 along e(w)). `step` is a scalar tensor or a python number."""
    _check_same_length(params, direction, "offset_params")
    return [p + tf.cast(step, p.dtype) * tf.cast(d, p.dtype) for p, d in zip(params, direction)]


_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def machine_epsilon(dtype) -> float:
    """Machine epsilon of a floating dtype (bfloat16 included, which numpy lacks)."""
    name = tf.as_dtype(dtype).name
    if name not in _EPS:
        raise ValueError(f"machine_epsilon: {name} is not a floating dtype.")
    return _EPS[name]


# ------------------------------------------------------------------- gradient algebra


def densify(tensors: Sequence) -> list[tf.Tensor]:
    """IndexedSlices (embedding gradients) -> dense tensors; other tensors unchanged."""
    return [tf.convert_to_tensor(t) for t in tensors]


def dense_gradient(tape, target, sources, output_gradients=None) -> list[tf.Tensor]:
    """`tape.gradient(target, sources)` as the algorithms combine gradients: zeros for a
    source the target does not reach (a task that does not use a head) and dense tensors
    (an embedding's IndexedSlices densified), so gradients can be added, stacked and
    dotted."""
    return densify(
        tape.gradient(
            target,
            sources,
            output_gradients=output_gradients,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
    )


def add(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    _check_same_length(a, b, "add")
    return [x + tf.cast(y, x.dtype) for x, y in zip(a, b)]


def sub(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    _check_same_length(a, b, "sub")
    return [x - tf.cast(y, x.dtype) for x, y in zip(a, b)]


def scale(s, a: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """`s * x` for each x of `a` (a python `s` exact in each x's dtype: `scalar`)."""
    return [scalar(s, x.dtype) * x for x in a]


def axpy(s, x: Sequence[tf.Tensor], y: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """`s * x + y`, elementwise over the lists (in `y`'s dtypes)."""
    _check_same_length(x, y, "axpy")
    return [scalar(s, b.dtype) * tf.cast(a, b.dtype) + b for a, b in zip(x, y)]


def scalar(value, dtype) -> tf.Tensor:
    """A hyperparameter as a scalar of `dtype`, exact in it.

    A python or NumPy number becomes `tf.constant(float(value), dtype)`: `tf.cast(0.4,
    tf.float64)` would first convert 0.4 to a float32 tensor (0.4000000059604645). A
    tensor or variable is cast (its value is whatever its own dtype holds: a float32
    variable's 0.4 stays float32's 0.4).
    """
    dtype = tf.as_dtype(dtype)
    if isinstance(value, bool) or isinstance(value, str):
        raise ValueError(f"scalar: `value` must be a number or a tensor; got {value!r}.")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return tf.constant(float(value) if dtype.is_floating else value, dtype)
    if isinstance(value, np.ndarray):
        return tf.constant(value.astype(dtype.as_numpy_dtype), dtype)
    return tf.cast(value, dtype)


def zeros_like(a: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.zeros_like(x) for x in a]


def dot(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
    """Inner product of two gradient lists, accumulated in float32 (float64 if given)."""
    _check_same_length(a, b, "dot")
    if not a:
        return tf.constant(0.0)
    acc = accumulation_dtype(a)
    return tf.add_n([tf.reduce_sum(tf.cast(x, acc) * tf.cast(y, acc)) for x, y in zip(a, b)])


def global_norm(a: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.sqrt(dot(a, a))


def cosine(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
    """Cosine similarity of two gradient lists; 0 when either is zero."""
    return tf.math.divide_no_nan(dot(a, b), global_norm(a) * global_norm(b))


def accumulation_dtype(tensors) -> tf.DType:
    """float64 if any of `tensors` is float64, else float32: the dtype sums, norms and
    scalar diagnostics over a list of tensors accumulate in (never float16)."""
    return tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32


def _check_same_length(a, b, op):
    if len(a) != len(b):
        raise ValueError(f"{op}: gradient lists differ in length ({len(a)} vs {len(b)}).")


# ---------------------------------------------------------------------- distribution


def num_replicas() -> int:
    """Replicas in sync of the current strategy (1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def scale_loss_for_distribution(value):
    """Divide a per-replica loss by the replica count, as Keras does for compiled losses."""
    return _compat.scale_loss_for_distribution(value)


def unscale_loss_for_distribution(value):
    """Undo `scale_loss_for_distribution`: a loss value independent of the replica count."""
    return _compat.unscale_loss_for_distribution(value)


def all_reduce_sum(tensors):
    """Sum a nest of per-replica tensors over replicas (identity with one replica).

    Must be called in a replica context (inside `strategy.run` / `train_step`).
    """
    if num_replicas() == 1:
        return tensors
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "all_reduce_sum must be called in a replica context (inside strategy.run)."
        )
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


def all_gather_rows(tensors):
    """Every replica's rows of a nest of [rows, ...] tensors, concatenated in replica
    order (identity with one replica); a replica with fewer rows than the largest is
    padded with zero rows (callers must be indifferent to zero rows).

    Built on an all-reduce (each replica writes its rows into its own block of a zero
    buffer), which works under every strategy: `ReplicaContext.all_gather` fails inside
    Keras's step under MultiWorkerMirroredStrategy ("destinations can not be empty").
    The block size is the static row count when the trace knows it (XLA-friendly), else
    the largest replica's. Must be called in a replica context.
    """
    replicas = num_replicas()
    if replicas == 1:
        return tensors
    context = tf.distribute.get_replica_context()
    flat = tf.nest.flatten(tensors)
    rows = tf.shape(flat[0])[0]
    static_rows = flat[0].shape[0]
    replica = tf.cast(context.replica_id_in_sync_group, tf.int32)
    if static_rows is not None:
        block = static_rows
    else:
        counts = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.one_hot(replica, replicas, dtype=tf.float32) * tf.cast(rows, tf.float32),
        )
        block = tf.cast(tf.reduce_max(counts), tf.int32)
    buffers = []
    for t in flat:
        padded = tf.pad(t, [[0, block - rows]] + [[0, 0]] * (t.shape.rank - 1))
        shape = tf.concat([[replicas, block], tf.shape(t)[1:]], axis=0)
        buffers.append(tf.scatter_nd([[replica]], padded[None], shape))
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, buffers)
    out = [tf.reshape(s, [-1, *t.shape[1:]]) for s, t in zip(summed, flat)]
    return tf.nest.pack_sequence_as(tensors, out)


def replica_safe_cond(pred, true_fn, false_fn, communicates=False, merged=None):
    """`tf.cond(pred, true_fn, false_fn)` that is valid under any strategy.

    Under MirroredStrategy a cross-replica communication (all-reduce,
    `optimizer.apply_gradients`, a commit of mirrored variables) may not sit inside
    `tf.cond`. Branches that do not communicate (`communicates=False`) are always run
    with `tf.cond`. Communicating branches are run with `tf.cond` on one replica; on
    several replicas `merged(pred)` is called instead, which must do the
    communication unconditionally and the rest under `pred` (default: run both
    branches and select their outputs with `tf.where`; their side effects then both
    happen, so only use the default for side-effect-free branches).
    """
    if isinstance(pred, bool):
        return true_fn() if pred else false_fn()
    if not communicates or num_replicas() == 1:
        return tf.cond(pred, true_fn, false_fn)
    if merged is not None:
        return merged(pred)
    on, off = true_fn(), false_fn()
    return tf.nest.map_structure(lambda a, b: tf.where(pred, a, b), on, off)


def replica_share(tensors):
    """The per-replica part of a global value that is identical on every replica: the
    value divided by the replica count, so that the optimizer's cross-replica *sum* in
    `apply_gradients` gives the value back (e.g. a Reptile pseudo-gradient phi - theta
    computed from all-reduced quantities). Identity with one replica."""
    n = num_replicas()
    if n == 1:
        return tensors
    return tf.nest.map_structure(lambda t: t / tf.cast(n, t.dtype), tensors)


# ----------------------------------------------------------------------------- batches


def batch_size(x) -> tf.Tensor:
    """The leading dimension of the first tensor of a nest (dynamic if unknown)."""
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    static = first.shape[0] if first.shape.rank else None
    return static if static is not None else tf.shape(first)[0]


def split_batch(batch, n_first):
    """Split every tensor of a nest along axis 0 into `[:n_first]` and `[n_first:]`."""

    def head(t):
        return None if t is None else t[:n_first]

    def tail(t):
        return None if t is None else t[n_first:]

    return (
        tf.nest.map_structure(head, batch),
        tf.nest.map_structure(tail, batch),
    )
