"""A Keras model evaluated at *given* weights, and algebra on lists of gradients.

Nothing in this module assigns a variable. Every function takes weights as tensors and
returns new tensors, so it can run inside `tf.function`, XLA (`jit_compile=True`) and any
`tf.distribute` strategy's replica context on TensorFlow, inside `jax.jit` on JAX, and it can
be differentiated through. It is written once, in `keras.ops`; autodiff, conditional work and
reductions across replicas come from `tf_metaalign.backend` (one implementation per backend).

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
* Tensors are the backend's (`Tensor`, `jax.Array`); dtypes are named as Keras names
  them ("float32", "float64": `keras.backend.standardize_dtype`).
* Loss scaling under a strategy (TensorFlow) follows Keras exactly: a compiled mean-reduced loss is
  already divided by the number of replicas (Keras's loss reduction), and
  the optimizer *sums* gradients across replicas, so per-replica gradients are in
  "replica-scaled" units whose sum is the global mean gradient. `all_reduce_sum` turns
  such per-replica values into the global value; `unscale_loss_for_distribution` turns a
  per-replica loss back into a number that does not depend on the replica count. On JAX
  the step sees the global batch (one SPMD program over the devices): one "replica".
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Sequence

import keras
import numpy as np
from keras import ops

from tf_metaalign import _compat, backend

LossFn = Callable  # (params, state, batch) -> (loss, (new_state, outputs))
Tensor = object  # the backend's tensor type (tf.Tensor, jax.Array)

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


def current_params(model: keras.Model) -> list[Tensor]:
    """The current values of `model.trainable_variables`, as tensors."""
    return [backend.read_value(v) for v in model.trainable_variables]


def current_state(model: keras.Model) -> list[Tensor]:
    """The current values of `model.non_trainable_variables`, as tensors."""
    return [backend.read_value(v) for v in model.non_trainable_variables]


def read_value(variable) -> Tensor:
    """A variable's current value as a tensor: a snapshot that later assignments do not
    change (on TensorFlow Keras's `ops.convert_to_tensor(variable)` returns the variable)."""
    return backend.read_value(variable)


def assign_state(model: keras.Model, new_state: Sequence[Tensor]) -> None:
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
    params: Sequence[Tensor],
    state: Sequence[Tensor],
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
    """`fn` as ONE traced function for inner loops unrolled over tasks x steps (MAML,
    prompt FOMAML/Reptile): on TensorFlow a nested `tf.function` when the caller is
    building a graph (see `tf_metaalign.backend.tensorflow.traced_once` for the
    measurements), else `fn`; on JAX `fn` itself (`jax.jit` traces the step once)."""
    return backend.traced_once(fn)


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
    loss_scale: Tensor | float | None = None,
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
            value = value * ops.cast(loss_scale, value.dtype)
        return value, (new_state, outputs)

    return loss_fn


def make_split_loss_fn(
    model: keras.Model,
    loss: Callable | None,
    n_first,
    training: bool = True,
    loss_scale: Tensor | float | None = None,
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
            values = [v * ops.cast(loss_scale, v.dtype) for v in values]
        return values[0] + values[1], (new_state, outputs, values[0], values[1])

    return loss_fn


def unpack_batch(batch):
    """`(x,)`, `(x, y)` or `(x, y, sample_weight)` -> `(x, y, sample_weight)` (Keras's rule)."""
    return keras.utils.unpack_x_y_sample_weight(tuple(batch) if isinstance(batch, list) else batch)


def value_and_grad(loss_fn: LossFn, params, state, batch):
    """`(loss, grads, aux)` of `loss_fn` at `params`; `grads` are dense tensors (zeros
    for a weight the loss does not reach)."""
    return backend.value_and_grad(loss_fn, params, state, batch)


def value_grad_and_hvp(loss_fn: LossFn, params, state, batch, vector):
    """`(loss, grads, aux, H v)` of `loss_fn` at `params`: the gradient and the exact
    Hessian-vector product with `vector` (held constant).

    `H v = d/dparams (grads . v)`; about twice the cost of `value_and_grad` (TensorFlow:
    reverse over reverse; JAX: forward over reverse). `H v` is in the dtypes of `grads`.
    Used by Meta DotProd's `method="exact"` (-H2 G1) and by the sharpness measure
    `algorithms.sam.largest_hessian_eigenvalue` (power iteration).
    """
    return backend.value_grad_and_hvp(loss_fn, params, (state, batch), vector)


def jvp(fn: Callable, primals, tangents):
    """`(fn(*primals), J_fn tangents)`: forward mode (TF: `ForwardAccumulator`; JAX:
    `jax.jvp`); tangents take the primals' dtypes."""
    return backend.jvp(fn, primals, tangents)


def executing_eagerly() -> bool:
    """False while a step is traced (`tf.function`, `jax.jit`) or built symbolically."""
    return backend.executing_eagerly()


def counter_dtype() -> str:
    """The dtype of step counters: "int64", or "int32" on JAX without `jax_enable_x64`
    (where JAX has no 64-bit integers)."""
    return backend.counter_dtype()


def unscale_gradients(grads, gradient_scale, dtypes=None) -> list[Tensor]:
    """`grads / gradient_scale` (a mixed-precision loss scale), computed in the
    accumulation dtype and cast to `dtypes` (one per gradient; default: the accumulation
    dtype). A python scale is exact in that dtype (`scalar`). What a perturbation of the
    weights must be built from: the true gradient, not the loss-scaled one."""
    grads = list(grads)
    acc = accumulation_dtype(grads)
    unscale = 1.0 / scalar(gradient_scale, acc)
    dtypes = [acc] * len(grads) if dtypes is None else list(dtypes)
    return [ops.cast(ops.cast(g, acc) * unscale, d) for g, d in zip(grads, dtypes)]


def offset_params(params, direction, step) -> list[Tensor]:
    """`params + step * direction` in each parameter's dtype: the weights at which a
    two-pass algorithm takes its second gradient (Meta DotProd: step = -alpha along G1;
    SAM: step = 1 along e(w)). `step` is a scalar tensor or a python number."""
    _check_same_length(params, direction, "offset_params")
    return [p + ops.cast(step, p.dtype) * ops.cast(d, p.dtype) for p, d in zip(params, direction)]


_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def machine_epsilon(dtype) -> float:
    """Machine epsilon of a floating dtype (bfloat16 included, which numpy lacks)."""
    name = keras.backend.standardize_dtype(dtype)
    if name not in _EPS:
        raise ValueError(f"machine_epsilon: {name} is not a floating dtype.")
    return _EPS[name]


# ------------------------------------------------------------------- gradient algebra


def densify(tensors: Sequence) -> list[Tensor]:
    """IndexedSlices (TensorFlow's embedding gradients) -> dense tensors; other tensors
    unchanged."""
    return backend.densify(tensors)


def dense_gradient(tape, target, sources, output_gradients=None) -> list[Tensor]:
    """TensorFlow only: `tape.gradient(target, sources)` as the algorithms combine
    gradients (zeros for unreached sources, dense tensors). Backend-neutral code uses
    `value_and_grad`."""
    from tf_metaalign.backend import tensorflow as tf_backend

    return tf_backend.dense_gradient(tape, target, sources, output_gradients)


def add(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    _check_same_length(a, b, "add")
    return [x + ops.cast(y, x.dtype) for x, y in zip(a, b)]


def sub(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    _check_same_length(a, b, "sub")
    return [x - ops.cast(y, x.dtype) for x, y in zip(a, b)]


def scale(s, a: Sequence[Tensor]) -> list[Tensor]:
    """`s * x` for each x of `a` (a python `s` exact in each x's dtype: `scalar`)."""
    return [scalar(s, x.dtype) * x for x in a]


def axpy(s, x: Sequence[Tensor], y: Sequence[Tensor]) -> list[Tensor]:
    """`s * x + y`, elementwise over the lists (in `y`'s dtypes)."""
    _check_same_length(x, y, "axpy")
    return [scalar(s, b.dtype) * ops.cast(a, b.dtype) + b for a, b in zip(x, y)]


def scalar(value, dtype) -> Tensor:
    """A hyperparameter as a scalar of `dtype`, exact in it.

    A python or NumPy number is converted in `dtype` directly: `tf.cast(0.4, tf.float64)`
    would first convert 0.4 to a float32 tensor (0.4000000059604645). A tensor or variable
    is cast (its value is whatever its own dtype holds: a float32 variable's 0.4 stays
    float32's 0.4).
    """
    dtype = keras.backend.standardize_dtype(dtype)
    if isinstance(value, bool) or isinstance(value, str):
        raise ValueError(f"scalar: `value` must be a number or a tensor; got {value!r}.")
    if isinstance(value, (int, float, np.integer, np.floating)):
        floating = "float" in dtype
        return ops.convert_to_tensor(float(value) if floating else int(value), dtype)
    if isinstance(value, np.ndarray):
        return ops.convert_to_tensor(value.astype(dtype), dtype)
    return ops.cast(value, dtype)


def zeros_like(a: Sequence[Tensor]) -> list[Tensor]:
    return [ops.zeros_like(x) for x in a]


def dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Inner product of two gradient lists, accumulated in float32 (float64 if given)."""
    _check_same_length(a, b, "dot")
    if not a:
        return ops.convert_to_tensor(0.0, "float32")
    acc = accumulation_dtype(a)
    return backend.add_n([ops.sum(ops.cast(x, acc) * ops.cast(y, acc)) for x, y in zip(a, b)])


def global_norm(a: Sequence[Tensor]) -> Tensor:
    return ops.sqrt(dot(a, a))


def cosine(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Cosine similarity of two gradient lists; 0 when either is zero."""
    return ops.divide_no_nan(dot(a, b), global_norm(a) * global_norm(b))


def accumulation_dtype(tensors) -> str:
    """ "float64" if any of `tensors` is float64, else "float32": the dtype sums, norms and
    scalar diagnostics over a list of tensors accumulate in (never float16)."""
    return (
        "float64"
        if any(keras.backend.standardize_dtype(t.dtype) == "float64" for t in tensors)
        else "float32"
    )


def _check_same_length(a, b, op):
    if len(a) != len(b):
        raise ValueError(f"{op}: gradient lists differ in length ({len(a)} vs {len(b)}).")


# ---------------------------------------------------------------------- distribution


def num_replicas() -> int:
    """Replicas in sync of the current strategy (1 outside any strategy; 1 on JAX, where the
    step sees the global batch)."""
    return backend.num_replicas()


def scale_loss_for_distribution(value):
    """Divide a per-replica loss by the replica count, as Keras does for compiled losses."""
    return backend.scale_loss_for_distribution(value)


def unscale_loss_for_distribution(value):
    """Undo `scale_loss_for_distribution`: a loss value independent of the replica count."""
    return backend.unscale_loss_for_distribution(value)


def all_reduce_sum(tensors):
    """Sum a nest of per-replica tensors over replicas (identity with one replica; see
    `tf_metaalign.backend.tensorflow.all_reduce_sum`). Call it in a replica context."""
    return backend.all_reduce_sum(tensors)


def all_gather_rows(tensors):
    """Every replica's rows of a nest of [rows, ...] tensors, concatenated in replica order,
    zero-padded to the largest replica's (identity with one replica; see
    `tf_metaalign.backend.tensorflow.all_gather_rows`)."""
    return backend.all_gather_rows(tensors)


def cond(pred, true_fn, false_fn):
    """`cond(pred, true_fn, false_fn)` whose branches may assign variables (TF: `tf.cond`;
    JAX: `jax.lax.cond` with the assignments threaded through the trainer's stateless
    step). A python bool runs one branch. Branches that communicate across replicas need
    `replica_safe_cond`."""
    return backend.cond(pred, true_fn, false_fn)


def replica_safe_cond(pred, true_fn, false_fn, communicates=False, merged=None):
    """`cond(pred, true_fn, false_fn)` that is valid under any strategy.

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
        return backend.cond(pred, true_fn, false_fn)
    if merged is not None:
        return merged(pred)
    on, off = true_fn(), false_fn()
    return keras.tree.map_structure(lambda a, b: ops.where(pred, a, b), on, off)


def replica_share(tensors):
    """The per-replica part of a global value that is identical on every replica: the
    value divided by the replica count, so that the optimizer's cross-replica *sum* in
    `apply_gradients` gives the value back (e.g. a Reptile pseudo-gradient phi - theta
    computed from all-reduced quantities). Identity with one replica."""
    return backend.replica_share(tensors)


# ----------------------------------------------------------------------------- batches


def batch_size(x) -> Tensor:
    """The leading dimension of the first tensor of a nest (dynamic if unknown)."""
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    static = first.shape[0] if len(first.shape) else None
    return static if static is not None else ops.shape(first)[0]


def split_batch(batch, n_first):
    """Split every tensor of a nest along axis 0 into `[:n_first]` and `[n_first:]`."""

    def head(t):
        return None if t is None else t[:n_first]

    def tail(t):
        return None if t is None else t[n_first:]

    return (
        keras.tree.map_structure(head, batch),
        keras.tree.map_structure(tail, batch),
    )
