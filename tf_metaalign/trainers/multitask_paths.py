"""How `MultiTaskTrainer` obtains the task gradients: one object per way.

A multi-task step is three parts, read top to bottom in this module:

1. The task layout (`RowTasks`, `OutputTasks`) turns a batch into T task losses:
   task-id rows masked and rescaled to each task's mean (`tasks="rows"`), or one task
   per compiled output loss (`tasks="outputs"`). It yields a `TaskBatch`.
2. A gradient path turns the task losses into the method's combination and the
   model's gradient, each in its own way:
     `LossWeighted`   no task gradients: ONE backward pass of sum_t w_t L_t (sum, UW,
                      DWA, RLW, FAMO; fit's cost for "sum");
     `MaskedPasses`   one forward pass, T backward passes (a pull-back per task), the
                      per-task gradients of every variable stacked [T, ...];
     `FactoredPasses` the Dense layers' Gram matrix and combination from their inputs
                      and output gradients, no per-task gradient formed;
     `RepGrad`        the task gradients at the shared representation z (`rep_grad`);
     `VectorizedPasses`, `GatheredPasses` (TensorFlow only, `multitask_tf`): each task's
                      rows in its own pass (dynamic shapes).
   Each returns a `PathResult`; the trainer's `train_step` only dispatches.
3. The method (`tf_metaalign.algorithms.multitask`) runs on the T x T quantities
   (`combine`).

Autodiff goes through `linearize` (one forward pass, pulled back as often as a path
needs): a persistent `tf.GradientTape` on TensorFlow, `jax.vjp` on JAX. Gradients with
respect to an intermediate tensor (the representation z, a Dense layer's pre-activation
output) are "taps": on TensorFlow the tape differentiates the recorded tensor; on JAX a
zero offset is added at that point and differentiated instead (the same derivative).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping, Optional

import keras
from keras import ops

from tf_metaalign import _compat
from tf_metaalign import functional as F
from tf_metaalign import model_graph
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods


def per_task_head_class():
    """`tf_metaalign.data.PerTaskHead`, or a class no layer is an instance of where that
    module cannot be imported (it needs TensorFlow until the data helpers are ported:
    no model then holds a PerTaskHead)."""
    try:
        from tf_metaalign.data import multitask as multitask_data
    except ImportError:
        return _NoPerTaskHead
    return multitask_data.PerTaskHead


class _NoPerTaskHead:
    pass


def is_task_batch_x(x) -> bool:
    """Whether a batch's `x` is in the multi-task format `{"inputs", "task_id"}`
    (`tf_metaalign.data.multitask.is_task_batch_x`)."""
    return isinstance(x, Mapping) and "inputs" in x and "task_id" in x


def model_inputs_of(x, model_takes_task_id: bool = False):
    """What the model is called on: `x["inputs"]`, or the whole dict with
    `model_takes_task_id`; any other `x` (plain inputs given to `evaluate` /
    `predict`) as it is (`tf_metaalign.data.multitask.model_inputs_of`)."""
    if not is_task_batch_x(x):
        return x
    return x if model_takes_task_id else x["inputs"]


def backend_name() -> str:
    return keras.backend.backend()


def _dtype(x) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def counter_dtype() -> str:
    """The step / epoch counters' integer dtype (`functional.counter_dtype` where the
    backend seam has it: int32 on JAX without x64)."""
    name = getattr(F, "counter_dtype", None)
    return name() if name is not None else "int64"


# ------------------------------------------------------------------------- autodiff


class Linearization:
    """One forward pass of `fn(params, offsets) -> (outputs, aux)`, pulled back as often
    as a path needs (`grad`). `outputs` is a dict of tensors or lists of tensors (what
    may be differentiated), `aux` anything (not differentiated). `taps` (name ->
    tensor, on TensorFlow) are the intermediate tensors `grad(..., wrt="taps")`
    differentiates; `fn` records them with `offsets.tap(name, tensor)`."""

    outputs: dict
    aux: Any

    def grad(self, target, wrt="params", cotangent=None, dense=True):
        """The gradient of `outputs[target]` (a name, or (name, index) for one item of
        a list; a list's gradient is that of its sum) with respect to the params
        (`wrt="params"`, a list of positions or "params": all) or the taps (a list of
        names), times `cotangent` (a tensor, or a list for a list target; None: ones).
        `dense`: zeros for what the target does not reach and dense tensors (False:
        as the tape gives them, TensorFlow only)."""
        raise NotImplementedError

    def stacked_grads(self, target):
        """The gradient of every item of the list `outputs[target]` with respect to the
        params, stacked per param ([T, ...] for T items; dense). One pull-back per item
        (on JAX: `jax.vmap` of the pull-back, one batched backward pass)."""
        grads = [self.grad((target, t)) for t in range(len(self.outputs[target]))]
        return [ops.stack([g[v] for g in grads]) for v in range(len(grads[0]))]


class _Offsets:
    """Passed to `fn`: `tap(name, tensor)` marks an intermediate tensor that `grad` may
    differentiate (and returns the tensor to use downstream)."""

    def __init__(self, values=None):
        self.values = values or {}
        self.recorded = {}

    def tap(self, name, tensor):
        offset = self.values.get(name)
        if offset is not None:
            tensor = tensor + ops.cast(offset, _dtype(tensor))
        self.recorded[name] = tensor
        return tensor


def linearize(fn, params, tap_names=()) -> Linearization:
    """`fn(params, offsets)` run once, differentiable afterwards (see `Linearization`)."""
    if backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        return multitask_tf.TapeLinearization(fn, params, _Offsets)
    return _VjpLinearization(fn, params, tap_names)


class _VjpLinearization(Linearization):
    """`jax.vjp` of `fn` at `params` (and zero offsets at the taps). The Keras state
    `fn` updates (the compiled loss's per-output trackers) is collected from a stateless
    scope inside the differentiated function and handed to the step's scope after; the
    aux values come back as `jax.vjp` returns them (primal values, not differentiated)."""

    def __init__(self, fn, params, tap_names):
        import jax

        params = list(params)
        outer = _compat.current_stateless_scope()

        def run(p, offsets):
            recorder = _Offsets(offsets)
            (outputs, aux), updates = _in_own_scope(lambda: fn(p, recorder), outer)
            outputs = dict(outputs)
            outputs["__taps__"] = {k: recorder.recorded[k] for k in offsets}
            return outputs, (aux, updates)

        offsets = {}
        if tap_names:

            def probe(p):
                recorder = _Offsets({name: None for name in tap_names})
                _in_own_scope(lambda: fn(p, recorder), outer)
                return {name: recorder.recorded[name] for name in tap_names}

            shapes = jax.eval_shape(probe, params)
            offsets = {n: jax.numpy.zeros(s.shape, s.dtype) for n, s in shapes.items()}
        outputs, self._pull, (aux, updates) = jax.vjp(run, params, offsets, has_aux=True)
        if outer is not None:
            outer.state_mapping.update(updates)
        self._taps = outputs.pop("__taps__")
        self.outputs, self.aux = outputs, aux

    def grad(self, target, wrt="params", cotangent=None, dense=True):
        import jax

        zeros = jax.numpy.zeros_like
        name, index = target if isinstance(target, tuple) else (target, None)
        cot = jax.tree_util.tree_map(zeros, self.outputs)
        cot["__taps__"] = jax.tree_util.tree_map(zeros, self._taps)
        value = self.outputs[name]

        def seed(v, c):
            return jax.numpy.ones_like(v) if c is None else jax.numpy.asarray(c, v.dtype)

        if index is not None:
            items = list(cot[name])
            items[index] = seed(value[index], cotangent)
            cot[name] = items
        elif isinstance(value, (list, tuple)):
            given = cotangent if cotangent is not None else [None] * len(value)
            cot[name] = [seed(v, c) for v, c in zip(value, given)]
        else:
            cot[name] = seed(value, cotangent)
        param_grads, offset_grads = self._pull(cot)
        if wrt == "params":
            return list(param_grads)
        return [offset_grads[w] if isinstance(w, str) else param_grads[w] for w in wrt]

    def stacked_grads(self, target):
        # The T pull-backs as one vmapped one: its dots read each activation once for
        # the T cotangents (T separate pull-backs read them T times). Equal to the
        # base class's T pull-backs up to summation order.
        import jax

        zeros = jax.numpy.zeros_like
        items = list(self.outputs[target])
        rest = {k: v for k, v in self.outputs.items() if k != target}
        cot_rest = jax.tree_util.tree_map(zeros, rest)
        cot_rest["__taps__"] = jax.tree_util.tree_map(zeros, self._taps)

        def pull(one_hot):
            cot = dict(cot_rest)
            cot[target] = [
                jax.numpy.ones_like(v) * one_hot[i].astype(v.dtype) for i, v in enumerate(items)
            ]
            return self._pull(cot)[0]

        eye = jax.numpy.eye(len(items), dtype=items[0].dtype)
        return list(jax.vmap(pull)(eye))


def _in_own_scope(fn, outer):
    """`fn()` in a stateless scope that starts from `outer`'s values; returns its result
    and the values it assigned (variable id -> value)."""
    scope = keras.StatelessScope()
    if outer is not None:
        scope.state_mapping = dict(outer.state_mapping)
    before = dict(scope.state_mapping)
    with scope:
        result = fn()
    updates = {k: v for k, v in scope.state_mapping.items() if before.get(k) is not v}
    return result, updates


# ------------------------------------------------------------------------ task layouts


@dataclasses.dataclass
class TaskBatch:
    """One batch as T tasks: the model's inputs and targets, `present` [T] (1 where the
    task has examples in the global batch), `task_losses_of(y_pred)` (the T local task
    losses, in Keras's per-replica units, summing over the replicas to the global ones),
    and for task-id rows the ids and the global counts."""

    model_x: Any
    y: Any
    sample_weight: Any
    present: Any
    task_losses_of: Callable
    compiled: Any
    acc: str
    task_id: Any = None
    counts: Any = None
    replicas: Any = None


class RowTasks:
    """tasks="rows": `x = {"inputs": ..., "task_id": int [B]}`; task t's loss is the
    compiled loss with sample weights `sample_weight * [task_id == t]` rescaled to the
    task's mean over the GLOBAL batch (see `MultiTaskTrainer`)."""

    name = "rows"

    def batch(self, trainer, x, y, sample_weight, compiled, acc) -> TaskBatch:
        T = trainer.num_tasks
        model_x = x if trainer.model_takes_task_id else x["inputs"]
        task_id = checked_task_ids(ops.cast(x["task_id"], "int32"), T)
        masks = [ops.cast(ops.equal(task_id, t), acc) for t in range(T)]
        local_batch = ops.cast(F.batch_size(task_id), acc)
        counts = F.all_reduce_sum(ops.stack([ops.sum(m) for m in masks]))
        replicas = ops.cast(F.num_replicas(), acc)
        # loss_t (per replica, Keras units) * B_local * R / n_t, summed over replicas,
        # is the task's mean loss over the global batch.
        factors = ops.divide_no_nan(local_batch * replicas, counts)
        present = ops.cast(counts > 0, acc)

        def task_losses_of(y_pred, model_losses=()):
            return [
                masked_task_loss(
                    trainer.model,
                    model_x,
                    y,
                    y_pred,
                    sample_weight,
                    masks[t],
                    factors[t],
                    compiled,
                    acc,
                    model_losses,
                )
                for t in range(T)
            ]

        return TaskBatch(
            model_x, y, sample_weight, present, task_losses_of, compiled, acc,
            task_id=task_id, counts=counts, replicas=replicas,
        )  # fmt: skip


class OutputTasks:
    """tasks="outputs": every example carries every task; task t's loss is output t's
    compiled loss times its loss weight, in Keras's per-replica units (summed over the
    replicas it is the global batch's loss, as fit's)."""

    name = "outputs"

    def batch(self, trainer, x, y, sample_weight, compiled, acc) -> TaskBatch:
        present = ops.ones([trainer.num_tasks], acc)

        def task_losses_of(y_pred, model_losses=()):
            return trainer._output_task_losses(
                x, y, y_pred, sample_weight, compiled, acc, model_losses
            )

        return TaskBatch(x, y, sample_weight, present, task_losses_of, compiled, acc)


def checked_task_ids(task_id, T):
    """`task_id`, checked to lie in [0, T) (TensorFlow: graph asserts every use waits
    for; JAX: checked when the step runs eagerly, not inside jit, as XLA drops TF's)."""
    if backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        return multitask_tf.checked_task_ids(task_id, T)
    if F.executing_eagerly() if hasattr(F, "executing_eagerly") else False:
        values = ops.convert_to_numpy(task_id)
        if (values < 0).any():
            raise ValueError("MultiTaskTrainer: a task_id is negative")
        if (values >= T).any():
            raise ValueError(f"MultiTaskTrainer: a task_id is >= num_tasks={T}")
    return task_id


def masked_task_loss(
    model, model_x, y, y_pred, sample_weight, mask, factor, compiled, acc, model_losses=()
):
    """Task loss from the whole batch's outputs: the compiled loss with the task's rows
    as sample weights, rescaled to the task's mean (see `MultiTaskTrainer`)."""
    weight = (
        mask if sample_weight is None else (mask * ops.cast(ops.reshape(sample_weight, [-1]), acc))
    )
    value = F.compute_loss(
        model,
        model_x,
        y,
        y_pred,
        ops.cast(weight, loss_weight_dtype(y)),
        held_model_losses(model_losses),
        training=True,
        loss=compiled,
    )
    return ops.cast(value, acc) * factor


def held_model_losses(model_losses):
    """The model's own losses as a task loss's value has always counted them, with no
    gradient: Keras's `compute_loss` given no losses reads `model.losses` (the values at
    the step's weights, not differentiated: their gradient is added once, after the
    combination). Given explicitly, held constant, so that no backend's autodiff reaches
    the weights through them."""
    return [ops.stop_gradient(loss) for loss in model_losses]


def loss_weight_dtype(y) -> str:
    """The dtype sample weights are given in: the targets' float dtype (float32 for
    integer labels)."""
    name = _dtype(keras.tree.flatten(y)[0])
    return name if "float" in name else "float32"


# ------------------------------------------------------------------------ the paths


@dataclasses.dataclass
class StepInputs:
    """What every path gets besides the batch: the model's weights and state at the
    step, the loss scale, the method's state values, `task_inputs(...)` (builds the
    method's `TaskInputs`) and the shared / task-specific positions."""

    params: list
    state: list
    loss_scale: Any
    method_state: dict
    task_inputs: Callable
    shared_index: list
    specific_index: list


@dataclasses.dataclass
class PathResult:
    """What a path returns: the global task losses [T], the method's `Combination`, the
    task cosine (None: not measured), the gradient per model variable (None: not
    reached, left to the optimizer as fit leaves it), the model's new state, its
    outputs and its own losses (regularisers; None if it has none)."""

    losses: Any
    combination: Any
    cosine: Optional[Any]
    gradient: list
    new_state: list
    y_pred: Any
    regularizer: Optional[Any] = None


def coefficients(combination, acc):
    """(shared, task-specific) coefficients of a method's Combination, in `acc`."""
    shared = ops.cast(combination.shared, acc)
    specific = shared if combination.specific is None else ops.cast(combination.specific, acc)
    return shared, specific


def combination_parts(method, inputs, state):
    """The method's combination as a tuple (what a compiled function returns) and the
    task cosine."""
    c = method.combine(inputs, state)
    cosine = GS.mean_pairwise_cosine(inputs.gram, inputs.present)
    parts = (c.shared, c.specific, c.loss_weights, dict(c.state), dict(c.state_gradients))
    return parts, cosine


def combine(trainer, inputs, method_state):
    """The method's `Combination` and the task cosine from the T x T quantities. On
    TensorFlow, with `compile_combination`, one XLA-compiled function
    (`multitask_tf.compiled_combine`); on JAX the step is compiled whole already."""
    method = trainer.method_object
    if backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        parts = multitask_tf.combine_parts(trainer, inputs, method_state)
    else:
        parts = combination_parts(method, inputs, dict(method_state))
    parts, cosine = parts
    shared, specific, loss_weights, state, state_gradients = parts
    return methods.Combination(
        shared=shared,
        specific=specific,
        loss_weights=loss_weights,
        state=state,
        state_gradients=state_gradients,
    ), cosine


def regularizer_of(model, model_x, y, y_pred, model_losses):
    """The model's own losses (regularisers, add_loss) as `fit` adds them (through the
    model's `compute_loss`), without the compiled loss; None if it has none."""
    if not model_losses:
        return None
    return F.compute_loss(
        model, model_x, y, y_pred, None, model_losses, training=True, loss=_no_compiled_loss
    )


def _no_compiled_loss(y_true, y_pred, sample_weight=None):
    """A compiled loss that adds nothing (Keras's compute_loss skips a None): the
    model's own losses alone."""
    return None


def _scaled(value, loss_scale):
    return value * ops.cast(loss_scale, _dtype(value))


class GradientPath:
    """One way of obtaining the task gradients (see the module doc)."""

    name = ""
    #: measures (and logs) the task cosine
    measures_cosine = True

    def step(self, trainer, batch: TaskBatch, inputs: StepInputs) -> PathResult:
        raise NotImplementedError


class LossWeighted(GradientPath):
    """A loss-weighting method (`uses_gradients=False`): the weights come from the
    losses alone, so ONE forward and ONE backward pass of sum_t w_t L_t.

    Its gradient goes to the optimizer as the tape returns it, as Keras's own TF trainer
    hands fit's: an Embedding's gradient stays IndexedSlices (Keras's optimizers apply
    it slice by slice) and a variable no loss reaches gets None (skipped). "sum" is
    then plain multi-output fit to the bit (tested with repeated tokens). On JAX the
    gradients are dense, as Keras's JAX trainer's are.
    """

    name = "loss_weighted"
    measures_cosine = False

    def step(self, trainer, batch, inputs):
        acc, scale = batch.acc, inputs.loss_scale
        model = trainer.model

        def forward(params, offsets):
            y_pred, new_state, model_losses = F.stateless_forward(
                model, params, inputs.state, batch.model_x, training=True
            )
            local = ops.stack(batch.task_losses_of(y_pred, model_losses))
            losses = F.all_reduce_sum(ops.stop_gradient(local))
            combination = trainer.method_object.combine(
                inputs.task_inputs(losses), inputs.method_state
            )
            weights = ops.stop_gradient(ops.cast(combination.shared, acc))
            total = ops.sum(weights * local) * ops.cast(scale, acc)
            regularizer = regularizer_of(model, batch.model_x, batch.y, y_pred, model_losses)
            if regularizer is not None:
                total = total + ops.cast(regularizer, acc) * ops.cast(scale, acc)
            c = combination
            parts = (c.shared, c.specific, c.loss_weights, dict(c.state), dict(c.state_gradients))
            return {"total": total}, (losses, parts, new_state, y_pred, regularizer)

        run = linearize(forward, inputs.params)
        gradient = run.grad("total", dense=False)
        losses, parts, new_state, y_pred, regularizer = run.aux
        combination = methods.Combination(*parts)
        return PathResult(losses, combination, None, gradient, new_state, y_pred, regularizer)


class StackedTaskGradients(GradientPath):
    """The paths that form every task's gradient of every variable, stacked [T, ...]
    per variable; the Gram matrix, the method and the combination read them in place."""

    def task_gradients(self, trainer, batch, inputs):
        """(T local task losses, [T, ...] per variable, new state, y_pred, regularizer,
        the regularizer's gradient or None)."""
        raise NotImplementedError

    def step(self, trainer, batch, inputs):
        acc, scale = batch.acc, inputs.loss_scale
        task_losses, stacked, new_state, y_pred, regularizer, reg_grads = self.task_gradients(
            trainer, batch, inputs
        )
        # Global per-task losses and gradients, identical on every replica.
        losses, stacked = F.all_reduce_sum((ops.stack(task_losses), stacked))
        method_inputs = inputs.task_inputs(losses, stacked)
        combination, cosine = combine(trainer, method_inputs, inputs.method_state)
        shared_c, specific_c = coefficients(combination, acc)
        specific_positions = set(inputs.specific_index)
        combined = []
        for v in range(len(stacked)):
            c = specific_c if v in specific_positions else shared_c
            combined.append(GS.stacked_combine([stacked[v]], c)[0])
        gradient = [g * ops.cast(scale, _dtype(g)) for g in F.replica_share(combined)]
        if reg_grads is not None:
            gradient = F.add(gradient, reg_grads)
        return PathResult(losses, combination, cosine, gradient, new_state, y_pred, regularizer)


class MaskedPasses(StackedTaskGradients):
    """One forward pass over the whole batch and T backward passes through it, each
    masked to a task: T times the backward cost of plain `fit`, static shapes (XLA)."""

    name = "masked"

    def task_gradients(self, trainer, batch, inputs):
        acc, scale = batch.acc, inputs.loss_scale
        model = trainer.model

        def forward(params, offsets):
            y_pred, new_state, model_losses = F.stateless_forward(
                model, params, inputs.state, batch.model_x, training=True
            )
            task_losses = batch.task_losses_of(y_pred, model_losses)
            outputs = {"scaled": [v * ops.cast(scale, acc) for v in task_losses]}
            regularizer = regularizer_of(model, batch.model_x, batch.y, y_pred, model_losses)
            if regularizer is not None:
                outputs["regularizer"] = _scaled(regularizer, scale)
            return outputs, (task_losses, new_state, y_pred, regularizer)

        run = linearize(forward, inputs.params)
        task_losses, new_state, y_pred, regularizer = run.aux
        inv_scale = 1.0 / ops.cast(scale, acc)
        stacked = [g * ops.cast(inv_scale, _dtype(g)) for g in run.stacked_grads("scaled")]
        reg_grads = run.grad("regularizer") if regularizer is not None else None
        return task_losses, stacked, new_state, y_pred, regularizer, reg_grads


class RepGrad(GradientPath):
    """Task gradients at the shared representation z (`rep_grad=True`, LibMTL's
    rep_grad; see `MultiTaskTrainer`): one forward pass, T backward passes through the
    heads (or ONE, for task-id rows whose heads do not mix rows), the method on the
    Gram matrix of r_t = sum over the batch of dL_t/dz, ONE backward pass of
    sum_t c_t dL_t/dz through the encoder."""

    name = "rep_grad"

    def step(self, trainer, batch, inputs):
        T, acc = trainer.num_tasks, batch.acc
        plan = trainer._rep_plan()
        model = trainer.model
        params = inputs.params
        scale = ops.cast(inputs.loss_scale, acc)
        task_id = batch.task_id

        def forward(params, offsets):
            with tapped_representation(plan, offsets):
                outputs, tap_state, model_losses = F.stateless_forward(
                    plan.tap,
                    [params[i] for i in plan.tap_params],
                    [inputs.state[i] for i in plan.tap_state],
                    batch.model_x,
                    training=True,
                )
            z = offsets.tap("z", outputs[-1]) if backend_name() == "tensorflow" else outputs[-1]
            y_pred = keras.tree.pack_sequence_as(model.output, outputs[:-1])
            task_losses = batch.task_losses_of(y_pred, model_losses)
            result = {"scaled": [v * scale for v in task_losses], "z": z}
            regularizer = regularizer_of(model, batch.model_x, batch.y, y_pred, model_losses)
            if regularizer is not None:
                result["regularizer"] = _scaled(regularizer, inputs.loss_scale)
            return result, (task_losses, tap_state, y_pred, regularizer)

        run = linearize(forward, params, tap_names=("z",))
        task_losses, tap_state, y_pred, regularizer = run.aux
        z = run.outputs["z"]
        new_state = list(inputs.state)
        for j, i in enumerate(plan.tap_state):
            new_state[i] = tap_state[j]
        rows_disjoint = task_id is not None and not plan.heads_mix_rows
        if rows_disjoint:
            # ONE backward pass through the heads: row r of d(sum_t L_t)/dz is
            # dL_task(r)/dz_r (the other tasks' losses weigh row r by 0).
            rep_rows = ops.cast(run.grad("scaled", wrt=["z"])[0], acc) / scale
            flat_rows = ops.reshape(rep_rows, [ops.shape(rep_rows)[0], -1])
            vectors = ops.segment_sum(flat_rows, task_id, num_segments=T)
        else:
            rep_grads, head_grads = [], []
            for t in range(T):
                # Through the heads only (the encoder's part of this graph is never used).
                g = run.grad(("scaled", t), wrt=["z"] + plan.heads)
                rep_grads.append(ops.cast(g[0], acc) / scale)
                head_grads.append([gi / ops.cast(scale, _dtype(gi)) for gi in g[1:]])
            # LibMTL: the representation gradient of each task summed over the batch.
            vectors = ops.stack([ops.reshape(ops.sum(r, axis=0), [-1]) for r in rep_grads])
        losses, vectors = F.all_reduce_sum((ops.stack(task_losses), vectors))
        gram = _gram(vectors)
        method_inputs = inputs.task_inputs(
            losses,
            [[vectors[t]] for t in range(T)],
            gram=gram,
            shared_variables=[_Representation(plan.rep)],
        )
        combination, cosine = combine(trainer, method_inputs, inputs.method_state)
        shared_c, specific_c = coefficients(combination, acc)
        # ONE backward pass through the encoder of sum_t c_t dL_t/dz (c held fixed): the
        # encoder's gradient sum_t c_t J^T dL_t/dz. Per replica: the optimizer's
        # cross-replica sum of these local parts is the global gradient.
        if rows_disjoint:
            row_c = ops.reshape(
                ops.take(shared_c, task_id, axis=0), [-1] + [1] * (len(rep_rows.shape) - 1)
            )
            combined_rep = rep_rows * row_c * scale
        else:
            combined_rep = _add_n([shared_c[t] * rep_grads[t] for t in range(T)]) * scale
        encoder_grads = run.grad("z", wrt=plan.encoder, cotangent=ops.cast(combined_rep, _dtype(z)))
        gradient = [None] * len(params)
        for i, g in zip(plan.encoder, encoder_grads):
            gradient[i] = g
        if rows_disjoint and plan.heads:
            # The heads' sum_t s_t g_t: one more backward pass through the heads only.
            scaled = run.outputs["scaled"]
            head_gradient = run.grad(
                "scaled",
                wrt=plan.heads,
                cotangent=[ops.cast(specific_c[t], _dtype(v)) for t, v in enumerate(scaled)],
            )
            for i, g in zip(plan.heads, head_gradient):
                gradient[i] = g
        for k, i in enumerate(plan.heads if not rows_disjoint else []):
            gradient[i] = GS.combine([[h[k]] for h in head_grads], specific_c)[0] * ops.cast(
                scale, _dtype(head_grads[0][k])
            )
        if regularizer is not None:
            gradient = F.add(gradient, run.grad("regularizer"))
        return PathResult(losses, combination, cosine, gradient, new_state, y_pred, regularizer)


def _add_n(tensors):
    if backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        return multitask_tf.add_n(tensors)
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _gram(vectors):
    """[T, T] inner products of the rows of `vectors` (TensorFlow: one transposed
    matmul, the op the trainer always used, so its numbers stay bit for bit)."""
    if backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        return multitask_tf.gram(vectors)
    return ops.matmul(vectors, ops.transpose(vectors))


@contextlib.contextmanager
def tapped_representation(plan, offsets):
    """On JAX, the layer that produces the representation z adds the tap's zero offset
    to its output (so `grad(wrt=["z"])` is dL/dz); on TensorFlow the tape
    differentiates z itself (nothing changes)."""
    if backend_name() == "tensorflow" or "z" not in offsets.values:
        yield
        return
    layer = plan.rep_layer
    keras_call = layer.call

    def call(*args, **kwargs):
        return offsets.tap("z", keras_call(*args, **kwargs))

    object.__setattr__(layer, "call", call)
    try:
        yield
    finally:
        object.__delattr__(layer, "call")


class FactoredPasses(GradientPath):
    """The gradient methods with no per-task gradient formed (task_passes="factored").

    Every shared variable is a Dense layer's kernel or bias (`MultiTaskTrainer.
    _factored_plan`). One forward pass over the batch records each such layer's inputs X
    and pre-activation outputs z; ONE backward pass of sum_t L_t gives dZ = dL/dz,
    whose row r is its own task's dL_t/dz_r (the rows do not interact: no state but
    dropout seeds). Then per layer (`gradient_surgery.dense_task_gram` /
    `dense_combined_gradient`): the Gram matrix S^T ((X X^T + 1) * (dZ dZ^T)) S over the
    GLOBAL batch (X, dZ and the task one-hots all-gathered from the replicas), and the
    combination sum_t c_t g_t = X^T (c_task(r) * dZ) from the replica's own rows (the
    optimizer sums the replicas' parts). Task-specific variables: the gradient of
    sum_t s_t L_t, a backward pass through the heads only. Losses, dropout masks and
    gradients are those of "masked" (tested equal).
    """

    name = "factored"

    def step(self, trainer, batch, inputs):
        plan = trainer._factored_plan()
        T, acc = trainer.num_tasks, batch.acc
        params, model = inputs.params, trainer.model
        shared_index, specific_index = inputs.shared_index, inputs.specific_index
        scale = ops.cast(inputs.loss_scale, acc)
        layers = [layer for layer, _, _ in plan]
        names = [f"dense_{k}" for k in range(len(layers))]
        seen = {}

        def forward(params, offsets):
            with recorded_dense_pre_activations(layers, offsets) as records:
                y_pred, new_state, model_losses = F.stateless_forward(
                    model, params, inputs.state, batch.model_x, training=True
                )
            stacked_losses = ops.stack(batch.task_losses_of(y_pred, model_losses))
            outputs = {
                "total": ops.sum(stacked_losses) * scale,
                "losses": stacked_losses,
            }
            regularizer = regularizer_of(model, batch.model_x, batch.y, y_pred, model_losses)
            if regularizer is not None:
                outputs["regularizer"] = _scaled(regularizer, inputs.loss_scale)
            calls = {layers[i].name: len(records.get(i, ())) for i in range(len(layers))}
            seen["calls"] = calls  # Python ints (not an aux value: jax.vjp takes arrays)
            xs = [records[i][0][0] for i in range(len(layers)) if calls[layers[i].name]]
            return outputs, (stacked_losses, new_state, y_pred, regularizer, xs)

        run = linearize(forward, params, tap_names=tuple(names))
        stacked_losses, new_state, y_pred, regularizer, xs = run.aux
        calls = seen["calls"]
        if any(n != 1 for n in calls.values()):
            raise ValueError(
                "MultiTaskTrainer(task_passes='factored'): each shared Dense layer must be "
                f"called once per forward pass; calls: {calls} (use task_passes='vectorized')."
            )
        dzs = run.grad("total", wrt=names)
        dzs = [ops.cast(dz, acc) / scale for dz in dzs]
        xs = [ops.cast(x, acc) for x in xs]
        onehot = ops.one_hot(batch.task_id, T, dtype=acc)
        # (zero padding rows of a replica with fewer rows add nothing: their one-hot is 0)
        gathered = F.all_gather_rows((xs, dzs, onehot))
        gram = _add_n(
            [
                GS.dense_task_gram(x, dz, gathered[2], has_bias=bias is not None)
                for x, dz, (_, _, bias) in zip(gathered[0], gathered[1], plan)
            ]
        )
        losses = F.all_reduce_sum(stacked_losses)
        # One shared variable's Gram matrix (GradNorm's layer norms): the kernel's alone,
        # or the bias's (S^T (dZ dZ^T) S: zero-width inputs).
        owner = {}
        for k, (_, kernel_i, bias_i) in enumerate(plan):
            owner[kernel_i], owner[bias_i] = (k, "kernel"), (k, "bias")

        def variable_gram(v):
            k, part = owner[shared_index[v]]
            x = gathered[0][k]
            if part == "bias":
                x = ops.zeros([ops.shape(x)[0], 0], _dtype(x))
            return GS.dense_task_gram(x, gathered[1][k], gathered[2], has_bias=part == "bias")

        method_inputs = inputs.task_inputs(losses, gram=gram, variable_gram=variable_gram)
        combination, cosine = combine(trainer, method_inputs, inputs.method_state)
        shared_c, specific_c = coefficients(combination, acc)
        row_c = ops.take(shared_c, batch.task_id, axis=0) * scale
        gradient = [None] * len(params)
        for x, dz, (_, kernel_i, bias_i) in zip(xs, dzs, plan):
            parts = GS.dense_combined_gradient(x, dz, row_c, has_bias=bias_i is not None)
            for i, g in zip((kernel_i, bias_i), parts):
                gradient[i] = ops.cast(g, _dtype(params[i]))
        if specific_index:
            specific = run.grad("losses", wrt=specific_index, cotangent=specific_c * scale)
            for i, g in zip(specific_index, specific):
                gradient[i] = g
        if regularizer is not None:
            gradient = F.add(gradient, run.grad("regularizer"))
        return PathResult(losses, combination, cosine, gradient, new_state, y_pred, regularizer)


@contextlib.contextmanager
def recorded_dense_pre_activations(layers, offsets):
    """`_compat.recorded_dense_pre_activations`, each layer's pre-activation z tapped
    (`offsets.tap`: on JAX a zero offset added there, what `grad(wrt=[name])`
    differentiates)."""
    with _compat.recorded_dense_pre_activations(layers) as records:
        if backend_name() == "tensorflow":
            yield records
            for k in range(len(layers)):
                if records.get(k):
                    offsets.tap(f"dense_{k}", records[k][0][1])
            return
        originals = {}
        for position, layer in enumerate(layers):
            recording = vars(layer)["call"]
            originals[position] = recording

            def call(inputs, training=None, _layer=layer, _position=position):
                z = keras.ops.matmul(inputs, _layer.kernel)
                if _layer.bias is not None:
                    z = keras.ops.add(z, _layer.bias)
                z = offsets.tap(f"dense_{_position}", z)
                records.setdefault(_position, []).append((inputs, z))
                return _layer.activation(z) if _layer.activation is not None else z

            object.__setattr__(layer, "call", call)
        try:
            yield records
        finally:
            for position, layer in enumerate(layers):
                object.__setattr__(layer, "call", originals[position])


class _Representation:
    """Stands for the shared representation where a method expects the shared variables
    (`TaskInputs.shared_variables`: GradNorm's layer, which it picks among those of rank
    >= 2): its path and the representation tensor's shape ([batch, ...])."""

    def __init__(self, tensor):
        self.path = f"representation/{tensor.name}"
        self.name = self.path
        self.shape = tuple(tensor.shape)


class RepPlan:
    """`rep_grad`'s plan: a functional model of the same graph that also returns the
    representation z, the positions of the encoder variables (those z depends on) and
    of the head variables (the rest, which must be task-specific) in
    `model.trainable_variables`, and the state mapping."""

    def __init__(self, tap, tap_params, tap_state, encoder, heads, rep):
        self.tap, self.tap_params, self.tap_state = tap, tap_params, tap_state
        self.encoder, self.heads, self.rep = encoder, heads, rep
        self.heads_mix_rows = False
        self.rep_layer = None


def rep_plan(trainer) -> RepPlan:
    """The representation-gradient plan (see `RepPlan`), errors naming what is wrong."""
    model = trainer.model
    if not model_graph.has_graph(model):
        raise ValueError(
            f"`rep_grad=True` needs a functional model (its graph says where the shared "
            f"representation is); the model {model.name!r} is a "
            f"{type(model).__name__} without one."
        )
    if trainer.representation is not None:
        rep = model_graph.layer_output(model, trainer.representation)
    elif trainer.tasks == "rows":
        rep = model_graph.layer_input(model, per_task_head_class())
        if rep is None:
            raise ValueError(
                "`rep_grad=True` with tasks='rows': the model has no (single) PerTaskHead "
                "layer whose input would be the shared representation; give "
                "`representation=<layer name>`."
            )
    else:
        rep = model_graph.shared_representation(model)
    variables = model.trainable_variables
    position = {id(v): i for i, v in enumerate(variables)}
    encoder = [position[id(v)] for v in model_graph.upstream_variables(model, rep)]
    shared, specific = trainer._variable_split()
    heads = [i for i in range(len(variables)) if i not in set(encoder)]
    not_specific = [variables[i].path for i in heads if i not in set(specific)]
    if not_specific:
        raise ValueError(
            f"`rep_grad=True`: the variables {not_specific} are shared by the tasks but "
            f"lie after the representation {rep.name!r} (the output of the last shared "
            "layer): name a later layer with `representation=`, or list the variables "
            "in `task_specific_variables` if each belongs to one task."
        )
    in_encoder = [variables[i].path for i in encoder if i in set(specific)]
    if in_encoder:
        raise ValueError(
            f"`rep_grad=True`: the task-specific variables {in_encoder} feed the "
            f"representation {rep.name!r}; the representation must come after every "
            "shared variable and before every task's own."
        )
    tap = keras.Model(model.input, list(model.outputs) + [rep], name=f"{model.name}_rep")
    tap_params = [position[id(v)] for v in tap.trainable_variables]
    state_position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    tap_state = [state_position[id(v)] for v in tap.non_trainable_variables]
    if len(tap_state) != len(model.non_trainable_variables):
        raise ValueError("`rep_grad=True`: the model has state outside its graph.")
    plan = RepPlan(tap, tap_params, tap_state, encoder, heads, rep)
    history = getattr(rep, "_keras_history", None)
    plan.rep_layer = history[0] if history is not None else None
    if backend_name() != "tensorflow" and (
        plan.rep_layer is None
        or len(getattr(plan.rep_layer, "_inbound_nodes", [])) != 1
        or len(keras.tree.flatten(plan.rep_layer.output)) != 1
    ):
        raise ValueError(
            f"`rep_grad=True` on JAX: the representation {rep.name!r} must be the single "
            "output of a layer called once in the model's graph (name another layer "
            "with `representation=`)."
        )
    # Tasks as rows: dL_t/dz is nonzero on task t's rows only, so ONE backward pass of
    # sum_t L_t through the heads gives every task's rows at once -- unless a layer
    # after z mixes the rows of the batch (BatchNorm: a layer with state, seeds aside).
    upstream = {
        id(v)
        for layer in _compat.flatten_layers(model)
        for v in layer.non_trainable_variables
        if set(map(id, layer.trainable_variables)) & {id(variables[i]) for i in encoder}
    }
    seeds = seed_states(model)
    plan.heads_mix_rows = any(
        id(v) not in upstream and id(v) not in seeds for v in model.non_trainable_variables
    )
    return plan


def seed_states(model):
    """ids of the state variables of the model's random-seed generators (dropout)."""
    return {
        id(generator.state)
        for layer in [model, *_compat.flatten_layers(model)]
        for generator in getattr(layer, "_seed_generators", None) or []
    }


def find_factored_plan(trainer):
    """(plan, None) where task_passes="factored" applies: [(layer, kernel index, bias
    index or None)], the plain Dense layers whose kernels and biases are ALL the shared
    variables; else (None, the reason)."""
    if trainer.tasks != "rows":
        return None, "it is for tasks='rows' (every row belongs to one task)"
    if trainer.method_object.reads_task_gradients:
        return None, (
            f"method {trainer.method_object.name!r} reads the task gradients themselves, "
            "which this pass never forms"
        )
    model = trainer.model
    seeds = seed_states(model)
    other = [v.path for v in model.non_trainable_variables if id(v) not in seeds]
    if other:
        return None, (
            f"the model has state other than dropout's seeds ({other[:3]}, e.g. "
            "BatchNorm statistics, which mix the rows of the batch)"
        )
    shared_index, _ = trainer._variable_split()
    variables = model.trainable_variables
    position = {id(v): i for i, v in enumerate(variables)}
    shared = {id(variables[i]) for i in shared_index}
    plan, covered = [], set()
    for layer in _compat.flatten_layers(model):
        if not _compat.is_plain_dense(layer) or id(layer.kernel) not in shared:
            continue
        bias = layer.bias
        if bias is not None and id(bias) not in shared:
            return None, f"Dense layer {layer.name!r}'s kernel is shared but its bias is not"
        if _compat.dense_input_rank(layer) != 2:
            return None, (
                f"Dense layer {layer.name!r} is not called once on [batch, features] "
                "inputs in the model's graph"
            )
        plan.append(
            (layer, position[id(layer.kernel)], None if bias is None else position[id(bias)])
        )
        covered |= {id(layer.kernel)} | (set() if bias is None else {id(bias)})
    left = [v.path for v in variables if id(v) in shared and id(v) not in covered]
    if left:
        return None, (
            "every shared variable must be the kernel or bias of a plain Dense layer on "
            f"[batch, features] inputs; these are not: {left[:4]}"
            f"{' ...' if len(left) > 4 else ''}"
        )
    return plan, None
