"""`MultiTaskTrainer`'s TensorFlow-only parts (imported only on the TensorFlow backend).

* `TapeLinearization`: `multitask_paths.linearize` on a persistent `tf.GradientTape`.
* `VectorizedPasses` ("vectorized": the T tasks' own rows in one `tf.vectorized_map`
  pass) and `GatheredPasses` ("gathered": each task's rows gathered, one pass per task):
  dynamic shapes, which JAX's jit does not take; on JAX "auto" picks "factored" or
  "masked" (and asking for these names the backend).
* The XLA-compiled combination shared by trainers (`compile_combination`): on JAX the
  whole step is one compiled function already.
* The task-id range checks (graph asserts), `tf.add_n` and the transposed matmul the
  trainer has always used (so its numbers stay bit for bit).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.trainers import multitask_paths as paths


class TapeLinearization(paths.Linearization):
    """One forward pass under a persistent tape, differentiated as often as needed."""

    def __init__(self, fn, params, offsets_class):
        self._params = list(params)
        self._offsets = offsets_class({})
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(self._params)
            self.outputs, self.aux = fn(self._params, self._offsets)
        self._tape = tape

    def grad(self, target, wrt="params", cotangent=None, dense=True):
        name, index = target if isinstance(target, tuple) else (target, None)
        value = self.outputs[name] if index is None else self.outputs[name][index]
        if wrt == "params":
            sources = self._params
        else:
            sources = [
                self._offsets.recorded[w] if isinstance(w, str) else self._params[w] for w in wrt
            ]
        if not dense:
            return self._tape.gradient(value, sources, output_gradients=cotangent)
        return F.dense_gradient(self._tape, value, sources, output_gradients=cotangent)


def checked_task_ids(task_id, T):
    """A task_id >= T would be no task's row (silently left out by the masks) or out of
    range of a [T] gather: every use of task_id waits for the check (XLA drops it)."""
    checks = [
        tf.debugging.assert_non_negative(
            task_id, message="MultiTaskTrainer: a task_id is negative"
        ),
        tf.debugging.assert_less(
            task_id, T, message=f"MultiTaskTrainer: a task_id is >= num_tasks={T}"
        ),
    ]
    with tf.control_dependencies([c for c in checks if c is not None]):
        return tf.identity(task_id)


def add_n(tensors):
    return tf.add_n(tensors)


def gram(vectors):
    return tf.matmul(vectors, vectors, transpose_b=True)


def after(value, assign, gradient):
    """`assign()` and `gradient` once `value` is computed (the state is assigned only
    once the loss is known finite)."""
    with tf.control_dependencies([value]):
        assign()
        return [None if g is None else tf.identity(g) for g in gradient]


# ------------------------------------------------------------- per-task passes on rows


class VectorizedPasses(paths.StackedTaskGradients):
    """Task t's loss and gradient over its own rows, the T tasks in ONE
    `tf.vectorized_map` pass over a [T, m, ...] batch.

    The rows are laid out task-major and padded: row (t, j) is task t's j-th row of this
    replica's batch, m the largest task count here (at least 1), padding rows are a zero
    row with weight 0. Each task's forward and backward pass over its m rows is then one
    batched computation: the FLOPs of one pass over T*m rows (= the batch when tasks are
    balanced). The task loss is the gathered path's: (Keras's mean over the m rows) * m *
    R / n_t. Model state: every task's forward starts from the step's state and the
    step's new state is task 0's (only dropout seeds are allowed, `check_vectorizable`:
    the T tasks draw the SAME masks for their j-th rows -- the one difference from
    "gathered", whose tasks draw in turn).
    """

    name = "vectorized"

    def task_gradients(self, trainer, batch, inputs):
        check_vectorizable(trainer)
        T, acc = trainer.num_tasks, batch.acc
        task_id, model_x, y, sample_weight = (
            batch.task_id,
            batch.model_x,
            batch.y,
            batch.sample_weight,
        )
        weight_dtype = paths.loss_weight_dtype(y)
        rows = tf.shape(task_id)[0]
        local_counts = tf.math.bincount(task_id, minlength=T, maxlength=T)
        m = tf.maximum(tf.reduce_max(local_counts), 1)
        order = tf.argsort(task_id, stable=True)
        sorted_ids = tf.gather(task_id, order)
        position = tf.range(rows) - tf.gather(tf.cumsum(local_counts, exclusive=True), sorted_ids)
        # index[t, j] = the batch row of task t's j-th row, or `rows` (the zero row).
        index = tf.tensor_scatter_nd_update(
            tf.fill([T, m], rows), tf.stack([sorted_ids, position], axis=1), order
        )
        valid = index < rows
        padded = tf.nest.map_structure(_with_zero_row, (model_x, y, sample_weight))
        gather = lambda a: None if a is None else tf.gather(a, index)  # noqa: E731
        x_t, y_t, w_t = tf.nest.map_structure(gather, padded)
        weight = tf.cast(valid, weight_dtype)
        if sample_weight is not None:
            weight = weight * tf.cast(tf.reshape(w_t, [T, m]), weight_dtype)
        factor = tf.math.divide_no_nan(tf.cast(m, acc) * batch.replicas, batch.counts)

        def one_task(args):
            return sub_batch_pass(trainer, batch, inputs, *args, "vectorized")

        values, stacked, states, preds = tf.vectorized_map(one_task, (x_t, y_t, weight, factor))
        task_losses = tf.unstack(values, num=T)
        new_state = [s[0] for s in states]
        # Predictions back in batch order (for the compiled metrics); the padding rows
        # land on row `rows`, dropped.
        flat_index = tf.reshape(index, [-1, 1])

        def unpad(p):
            p = tf.reshape(p, tf.concat([[-1], tf.shape(p)[2:]], axis=0))
            shape = tf.concat([[rows + 1], tf.shape(p)[1:]], axis=0)
            return tf.scatter_nd(flat_index, p, shape)[:rows]

        y_pred = tf.nest.map_structure(unpad, preds)
        return task_losses, list(stacked), new_state, y_pred, None, None


class GatheredPasses(paths.StackedTaskGradients):
    """Task t's loss and gradient from a forward and backward pass over its own rows.

    The per-replica task loss is (Keras's mean over the m gathered rows) * m * R / n_t =
    sum_{i in t, this replica} w_i l_i * R / n_t, the masked path's value. A task with
    no row on this replica runs on one dummy row with weight 0 (a Keras mean over zero
    rows is 0/0), and its state update is discarded: the batch gets one zero row
    appended for that (a replica may hold no row at all: the last, partial batch of an
    epoch under a strategy). The model's state (BatchNorm statistics, dropout seeds) is
    threaded through the T passes in task order.
    """

    name = "gathered"

    def task_gradients(self, trainer, batch, inputs):
        T = trainer.num_tasks
        task_id, sample_weight = batch.task_id, batch.sample_weight
        weight_dtype = paths.loss_weight_dtype(batch.y)
        pad_row = tf.cast(tf.shape(task_id)[0], tf.int64)  # the appended zero row
        padded = tf.nest.map_structure(_with_zero_row, (batch.model_x, batch.y, sample_weight))
        state = inputs.state
        task_losses, task_grads, rows_list, preds = [], [], [], []
        for t in range(T):
            rows = tf.reshape(tf.where(tf.equal(task_id, t)), [-1])
            n_local = tf.shape(rows)[0]
            present_here = n_local > 0
            safe_rows = tf.cond(present_here, lambda: rows, lambda: tf.reshape(pad_row, [1]))
            m = tf.shape(safe_rows)[0]
            gather = lambda a: None if a is None else tf.gather(a, safe_rows)  # noqa: E731
            x_t, y_t, w_t = tf.nest.map_structure(gather, padded)
            weight = tf.cast(tf.fill([m], tf.cast(present_here, tf.float32)), weight_dtype)
            if sample_weight is not None:
                weight = weight * tf.cast(tf.reshape(w_t, [-1]), weight_dtype)
            factor = tf.math.divide_no_nan(tf.cast(m, batch.acc) * batch.replicas, batch.counts[t])
            value, g, state_t, y_pred_t = sub_batch_pass(
                trainer,
                batch,
                dataclasses.replace(inputs, state=state),
                x_t,
                y_t,
                weight,
                factor,
                "gathered",
            )
            task_grads.append(g)
            task_losses.append(value)
            state = [tf.where(present_here, new, old) for new, old in zip(state_t, state)]
            rows_list.append(tf.cast(rows, tf.int32))
            preds.append(tf.nest.map_structure(lambda p: p[:n_local], y_pred_t))
        # Predictions back in batch order (for the compiled metrics).
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.dynamic_stitch(rows_list, list(parts)), *preds
        )
        stacked = [tf.stack([g[v] for g in task_grads]) for v in range(len(inputs.params))]
        return task_losses, stacked, state, y_pred, None, None


def sub_batch_pass(trainer, batch, inputs, x, y, weight, factor, passes):
    """One task's loss (Keras's mean over the sub-batch times `factor`, the task's share
    of the global batch) and its gradient (unscaled), from a forward and a backward pass
    over its rows: (loss, gradients, new state, predictions)."""
    acc, loss_scale, params = batch.acc, inputs.loss_scale, inputs.params
    with tf.GradientTape() as tape:
        tape.watch(params)
        y_pred, new_state, model_losses = F.stateless_forward(
            trainer.model, params, inputs.state, x, training=True
        )
        if model_losses:
            raise ValueError(
                f"MultiTaskTrainer(task_passes={passes!r}): the model has its own "
                "losses (regularisers, add_loss), which are not task losses; use "
                "task_passes='masked' (or 'auto', which picks it for such models)."
            )
        value = F.compute_loss(
            trainer.model, x, y, y_pred, weight, [], training=True, loss=batch.compiled
        )
        value = tf.cast(value, acc) * factor
        scaled = value * tf.cast(loss_scale, acc)
    g = F.dense_gradient(tape, scaled, params)
    inv_scale = 1.0 / tf.cast(loss_scale, acc)
    return value, [gi * tf.cast(inv_scale, gi.dtype) for gi in g], new_state, y_pred


def check_vectorizable(trainer):
    """The vectorized pass runs every task's forward pass from the step's state: it
    refuses state other than dropout's seeds (BatchNorm statistics would need the T
    updates threaded, as "gathered" does)."""
    if trainer._cache.vectorizable:
        return
    seeds = paths.seed_states(trainer.model)
    other = [v.path for v in trainer.model.non_trainable_variables if id(v) not in seeds]
    if other:
        raise ValueError(
            "MultiTaskTrainer(task_passes='vectorized') runs the T tasks' forward "
            "passes side by side from the step's state, so it takes no model state "
            f"other than dropout's seeds; the model has {other[:4]}"
            f"{' ...' if len(other) > 4 else ''} (e.g. BatchNorm statistics): use "
            "task_passes='gathered' (which threads the state through the tasks in "
            "order) or 'auto'."
        )
    trainer._cache.vectorizable = True


def _with_zero_row(a):
    """`a` with one zero (or empty-string) row appended along the batch axis."""
    if a is None:
        return None
    a = tf.convert_to_tensor(a)
    shape = tf.concat([[1], tf.shape(a)[1:]], axis=0)
    row = tf.fill(shape, "") if a.dtype == tf.string else tf.zeros(shape, a.dtype)
    return tf.concat([a, row], axis=0)


# --------------------------------------------------------- the compiled combination


def combine_parts(trainer, inputs, method_state):
    """The method's combination parts and the task cosine (`paths.combination_parts`).

    A gradient method's combination is hundreds of tiny ops on T x T matrices (T^2
    projections, a min-norm or Newton solver, an eigen-decomposition), whose per-op
    dispatch costs 0.3-2.9 ms a step on a CPU at T = 8: with `compile_combination=True`
    (the default) they run as ONE XLA-compiled function (0.2-0.3 ms) for the methods
    whose `compiles_well` is True (not CAGrad, whose face enumeration is slower under
    XLA on CPU, nor GradNorm, which reads the task gradients themselves). No collective
    sits inside (the inputs are already all-reduced), so it runs the same in a replica
    context and under an XLA-compiled step."""
    method = trainer.method_object
    args = (
        inputs.losses,
        inputs.present,
        inputs.step,
        inputs.epoch,
        inputs.gram,
        dict(method_state),
    )
    parts = None
    compiled = trainer.compile_combination and method.compiles_well
    if compiled:
        parts = _compiled_combination(method, inputs.seed, args)
    if parts is None:
        # Not compiled, or a method that reads the trainer's other inputs (task
        # gradients, variables) inside: a function of this trace (kept by XLA's cache).
        def run(losses, present, step, epoch, gram, state):
            fields = dataclasses.replace(
                inputs, losses=losses, present=present, step=step, epoch=epoch, gram=gram
            )
            return paths.combination_parts(method, fields, state)

        parts = tf.function(run, jit_compile=True)(*args) if compiled else run(*args)
    return parts


class _ReadsTrainerInputs(Exception):
    """A method read a TaskInputs field the shared compiled combination does not have."""


class _NotGiven:
    """`task_grads`, `shared_variables` and `variable_gram` in the shared compiled
    combination (tensors and variables of one trace and one trainer, which a function
    shared by trainers cannot close over): any use raises `_ReadsTrainerInputs`."""

    def __init__(self, field):
        self.field = field

    def _read(self, *args, **kwargs):
        raise _ReadsTrainerInputs(self.field)

    __getitem__ = __iter__ = __len__ = __bool__ = __call__ = __getattr__ = _read


#: The XLA-compiled combinations, one `tf.function(jit_compile=True)` per method
#: configuration (its class, its attributes, the seed), shared by every trainer. TF's XLA
#: cache keeps each compiled cluster for the life of the process, keyed by the function's
#: name: a new function per trainer (or per trace) kept 7.7-14.7 MB per run of the
#: battery MLP; one per configuration compiles once for each input signature.
#: Least recently used first; a handful in practice.
_COMPILED_COMBINATIONS = {}
_COMPILED_COMBINATIONS_MAX = 32


def _frozen(value):
    """A hashable form of a method's attribute (its type kept: 1, 1.0 and True differ);
    TypeError if it has none."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    hash(value)
    return (type(value), value)


def _compiled_combination(method, seed, args):
    """`combination_parts` through the method configuration's shared compiled function:
    the method's tensors all enter as arguments, the method and the seed as constants.
    None where the method cannot share one (unhashable attributes, or it reads the task
    gradients, variables or `variable_gram` inside): the caller compiles its own."""
    try:
        key = (type(method), _frozen(vars(method)), seed)
        hash(key)
    except TypeError:
        return None
    function = _COMPILED_COMBINATIONS.pop(key, False)
    if function is None:
        _COMPILED_COMBINATIONS[key] = None
        return None
    if function is False:

        def combination(losses, present, step, epoch, gram, state):
            inputs = methods.TaskInputs(
                losses=losses,
                present=present,
                step=step,
                epoch=epoch,
                seed=seed,
                gram=gram,
                task_grads=_NotGiven("task_grads"),
                shared_variables=_NotGiven("shared_variables"),
                variable_gram=_NotGiven("variable_gram"),
            )
            return paths.combination_parts(method, inputs, state)

        function = tf.function(combination, jit_compile=True)
    try:
        parts = function(*args)
    except _ReadsTrainerInputs:
        function, parts = None, None
    _COMPILED_COMBINATIONS[key] = function
    while len(_COMPILED_COMBINATIONS) > _COMPILED_COMBINATIONS_MAX:
        del _COMPILED_COMBINATIONS[next(iter(_COMPILED_COMBINATIONS))]
    return parts
