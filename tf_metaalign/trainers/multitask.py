"""`MultiTaskTrainer`: multi-task learning on mixed batches with gradient surgery."""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_metaalign.data import multitask as multitask_data
from tf_metaalign import _compat
from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.trainers.base import MetaTrainer

#: How the per-task losses and gradients are computed (see `MultiTaskTrainer`).
TASK_PASSES = ("auto", "gathered", "masked")




@keras.saving.register_keras_serializable(package="tf_metaalign")
class MultiTaskTrainer(MetaTrainer):
    """Train `model` on batches that mix T tasks, combining the per-task gradients.

    Batches: `(x, y)` or `(x, y, sample_weight)` with
    `x = {"inputs": <model inputs>, "task_id": int [B]}`; the model is called on
    `x["inputs"]`, or on the whole dict with `model_takes_task_id=True` (per-task heads).
    `evaluate` / `predict` take the same dicts (or plain model inputs).

    Per-task losses. One forward pass over the whole batch; task t's loss is the trainer's
    compiled loss (`functional.compute_loss`, the loss `fit` uses) evaluated with the
    sample weights `sample_weight * [task_id == t]` and rescaled to the task's MEAN:
    with Keras's default "sum_over_batch_size" reduction, the masked loss is
    `sum_{i in t} w_i l_i / B`, so it is multiplied by `B / n_t`, where n_t is the number of
    task-t examples in the GLOBAL batch (all replicas): L_t = sum_{i in t} w_i l_i / n_t.
    (Sample-weight masks rather than evaluating on boolean-masked sub-batches: the shapes
    stay static, so it runs under XLA, and the forward pass is shared.) A task absent
    from the batch has L_t = 0 and a zero gradient and is left out of the surgery and the
    diagnostics. The model's own losses (regularisers, `add_loss`) are not task losses:
    their gradient is added once, after the combination, as `fit` adds it. Other loss
    reductions ("sum", a `compute_loss` override) are scaled the same way: the task loss
    is then B/n_t times that reduction of the task's examples.

    Per-task passes (`task_passes`):
      "gathered": each task's loss and gradient come from a forward and a backward pass
        over that task's own rows of the batch (gathered by `task_id`): T passes over
        sub-batches cost about one pass over the whole batch. The shapes are dynamic,
        so it does not run under XLA. The model's state (BatchNorm moving statistics,
        dropout seeds) is threaded through the T forward passes in task order, so
        BatchNorm normalises each task's examples with that task's batch statistics.
      "masked": one forward pass over the whole batch and T backward passes through it
        (a persistent tape), each masked to a task: T times the backward cost of plain
        `fit`, static shapes (XLA).
      "auto" (default): "masked" under `jit_compile=True` or when the model has its own
        losses (regularisers, `add_loss`: the masked path adds their gradient exactly as
        `fit` does), else "gathered". Both give the same task losses and gradients for
        a model without state (tested).
    Under a strategy the per-task losses and gradients are all-reduced BEFORE the
    combination (PCGrad, GradVac and GradNorm are non-linear in the gradients: combining
    per-replica gradients would not give the global batch's update), so the combination
    sees the global per-task gradients on every replica and 1 replica == N replicas; the
    combined gradient is handed to the optimizer divided by the replica count
    (`functional.replica_share`), whose cross-replica sum gives it back.

    Methods (`method=`): a name (`"pcgrad"`) or a method object (`PCGrad()`,
    `GradVac(beta=0.2)`, ... from `tf_metaalign.algorithms.multitask`, whose registry
    lists them all: `methods.method_names()`); a name takes its options from
    `method_options={...}`. Each turns the global per-task losses L_t and gradients g_t
    into coefficients (see `tf_metaalign.algorithms.multitask.base`):
      shared variables:        G = sum_t c_t g_t   (the surgery / weighting)
      task-specific variables: G = sum_t s_t g_t   (their own task's gradient: s = 1 for
                               the gradient methods, s = the loss weights for the
                               loss-weighting ones, as LibMTL does).
    "sum" (equal weighting, LibMTL's EW): G = sum_t grad L_t, from ONE backward pass of
    the summed loss; on batches where every task has B/T examples and the compiled loss
    is a mean, that is exactly T times plain `fit`'s gradient. Loss-weighting methods
    (`uses_gradients = False`: sum, UW, DWA, RLW, FAMO) take one backward pass of
    sum_t w_t L_t; the gradient methods (PCGrad, GradVac, GradNorm, ...) take T. The
    per-task-gradient `task_cosine` diagnostic is measured by the gradient methods, and
    by the others only with `measure_task_cosine=True` (it costs T backward passes).

    Shared vs task-specific variables (`task_specific_variables`): by default the
    variables of every `PerTaskHead` layer in the model (the heads of
    `data.one_head_per_task_model`) are task-specific and the rest shared; give a list
    of further variables (or variable paths) to add them; "none" treats every variable
    as shared (this trainer's behaviour before: surgery over the heads too). The surgery,
    the Gram matrix, `task_cosine` and GradNorm's layer are over the shared variables.

    The old keyword shortcuts `gradvac_beta`, `gradnorm_alpha`, `gradnorm_learning_rate`,
    `gradnorm_variable` still set those methods' options (an error with any other method).

    Mixed precision: the per-task gradients are unscaled (divided by the loss scale)
    before the combination and the combined gradient scaled back for the
    LossScaleOptimizer.

    State (checkpointed trainer variables): `count` (steps, drives the RNG), the method's
    own (`<method>_<key>`, e.g. `gradvac_targets` [T, T], `gradnorm_weights` [T]), and
    `epochs_done` for the methods that read the epoch (DWA). Logs: "loss" =
    sum_t w_t L_t with the method's loss weights, and "task_cosine", the mean pairwise
    cosine of the task gradients (before surgery) over the tasks present.
    """

    def __init__(
        self,
        model: keras.Model,
        num_tasks: int,
        method="sum",
        model_takes_task_id: bool = False,
        seed: int = 0,
        method_options=None,
        task_specific_variables=None,
        measure_task_cosine=None,
        task_passes: str = "auto",
        gradvac_beta=None,
        gradnorm_alpha=None,
        gradnorm_learning_rate=None,
        gradnorm_variable=None,
        **kwargs,
    ):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"`num_tasks` must be an integer >= 1; got {num_tasks!r}.")
        if not isinstance(model_takes_task_id, bool):
            raise ValueError(
                f"`model_takes_task_id` must be a bool; got {model_takes_task_id!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        if task_passes not in TASK_PASSES:
            raise ValueError(f"`task_passes` must be one of {TASK_PASSES}; got {task_passes!r}.")
        if measure_task_cosine not in (None, True, False):
            raise ValueError(f"`measure_task_cosine` must be None, True or False; got "
                             f"{measure_task_cosine!r}.")
        if method_options is not None and not isinstance(method_options, dict):
            raise ValueError(f"`method_options` must be a dict of the method's arguments; got "
                             f"{method_options!r}.")
        options = dict(method_options or {})
        shortcuts = {"gradvac_beta": ("gradvac", "beta", gradvac_beta),
                     "gradnorm_alpha": ("gradnorm", "alpha", gradnorm_alpha),
                     "gradnorm_learning_rate": ("gradnorm", "learning_rate",
                                                gradnorm_learning_rate),
                     "gradnorm_variable": ("gradnorm", "variable", gradnorm_variable)}
        for arg, (owner, key, value) in shortcuts.items():
            if value is None:
                continue
            if method != owner:
                raise ValueError(f"`{arg}` is an option of method={owner!r}; got method="
                                 f"{method!r} (give a method's options to its object or in "
                                 "`method_options`).")
            options[key] = value
        self.method_object = methods.get_method(method, **options)
        self._task_specific_request = _check_task_specific_request(task_specific_variables)
        super().__init__(model, **kwargs)
        self.task_passes = task_passes
        self.num_tasks = num_tasks
        self.method = self.method_object.name
        self.model_takes_task_id = model_takes_task_id
        self.seed = seed
        self.measure_task_cosine = measure_task_cosine
        self.steps = self.every_k_steps(1, name="multitask_steps")
        self.method_state = {}
        self._trainable_method_state = {}
        for key, spec in self.method_object.state_spec(num_tasks).items():
            name = spec.name or f"{self.method}_{key}"
            initializer = spec.initializer
            if isinstance(initializer, (int, float)):
                initializer = keras.initializers.Constant(float(initializer))
            if spec.trainable:
                variable = self.add_weight(name=name, shape=spec.shape, dtype=spec.dtype,
                                           initializer=initializer, trainable=True)
                self._trainable_method_state[key] = variable
            else:
                variable = self.add_state_variable(name, spec.shape, spec.dtype, initializer)
            self.method_state[key] = variable
            setattr(self, name, variable)
        self.epochs_done = (self.add_state_variable("epochs_done", dtype="int64")
                            if getattr(self.method_object, "uses_epoch", False) else None)
        self.add_diagnostic("task_cosine", "mean")
        if model.built:
            self._variable_split()  # bad task_specific_variables / GradNorm layer fail now

    # ----------------------------------------------------------------- batches

    def model_inputs(self, x):
        return multitask_data.model_inputs_of(x, self.model_takes_task_id)

    def call(self, inputs, training=None):
        return super().call(self.model_inputs(inputs), training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(self.model_inputs(x), y, y_pred, sample_weight, training)

    def unpack(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not multitask_data.is_task_batch_x(x):
            raise ValueError(
                "MultiTaskTrainer: a training batch's x must be a dict {'inputs': <model "
                "inputs>, 'task_id': int [B]}; got "
                + (f"a dict with keys {sorted(x)}" if isinstance(x, dict)
                   else type(x).__name__) + ".")
        task_id = x["task_id"]
        if not task_id.dtype.is_integer or task_id.shape.rank != 1:
            raise ValueError(
                "MultiTaskTrainer: x['task_id'] must be an integer vector [B] (the task of "
                f"each example); got dtype {task_id.dtype.name}, shape {task_id.shape}.")
        if not self.model.built:
            self.model(self.model_inputs(x), training=False)
        return x, y, sample_weight

    def _variable_split(self):
        """(shared, task-specific) positions in `model.trainable_variables`."""
        variables = self.model.trainable_variables
        request = self._task_specific_request
        specific = set()
        if request != "none":
            for layer in _compat.flatten_layers(self.model):
                if isinstance(layer, multitask_data.PerTaskHead):
                    specific |= {id(v) for v in layer.trainable_variables}
            by_id = {id(v) for v in variables}
            by_path = {v.path: v for v in variables}
            for item in request or ():
                if isinstance(item, str):
                    if item not in by_path:
                        raise ValueError(
                            f"`task_specific_variables`: {item!r} is not the path of a "
                            f"trainable variable of the model; paths: {sorted(by_path)}.")
                    specific.add(id(by_path[item]))
                elif id(item) in by_id:
                    specific.add(id(item))
                else:
                    raise ValueError(
                        "`task_specific_variables`: "
                        f"{getattr(item, 'path', item)!r} is not a trainable variable of the "
                        "model (give the model's own variables or their paths).")
        shared = [i for i, v in enumerate(variables) if id(v) not in specific]
        task_specific = [i for i, v in enumerate(variables) if id(v) in specific]
        if not shared and self.method_object.uses_gradients:
            raise ValueError(
                f"MultiTaskTrainer(method={self.method!r}): every trainable variable is "
                "task-specific, so there is no shared gradient to combine; check "
                "`task_specific_variables`.")
        if isinstance(self.method_object, methods.GradNorm):
            self.method_object.variable_index([variables[i] for i in shared])
        return shared, task_specific

    def _needs_task_gradients(self):
        if self.measure_task_cosine is not None:
            return self.method_object.uses_gradients or self.measure_task_cosine
        return self.method_object.uses_gradients

    # -------------------------------------------------------------------- step

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        method = self.method_object
        T = self.num_tasks
        loss_scale = self.loss_scale()
        params, state = F.current_params(self.model), F.current_state(self.model)
        acc = F.accumulation_dtype(params)
        compiled = self._compiled_loss()
        model_x = x if self.model_takes_task_id else x["inputs"]

        task_id = tf.cast(x["task_id"], tf.int32)
        masks = [tf.cast(tf.equal(task_id, t), acc) for t in range(T)]
        local_batch = tf.cast(F.batch_size(task_id), acc)
        counts = F.all_reduce_sum(tf.stack([tf.reduce_sum(m) for m in masks]))
        replicas = tf.cast(F.num_replicas(), acc)
        # loss_t (per replica, Keras units) * B_local * R / n_t, summed over replicas,
        # is the task's mean loss over the global batch.
        factors = tf.math.divide_no_nan(local_batch * replicas, counts)
        present = tf.cast(counts > 0, acc)
        shared_index, specific_index = self._variable_split()
        variables = self.model.trainable_variables
        step = tf.convert_to_tensor(self.steps.count.value)
        epoch = (tf.convert_to_tensor(self.epochs_done.value) if self.epochs_done is not None
                 else tf.constant(0, tf.int64))
        method_state = {k: tf.convert_to_tensor(v.value) for k, v in self.method_state.items()}

        def task_inputs(losses, task_grads=None):
            shared_grads = gram = None
            if task_grads is not None:
                shared_grads = [[g[i] for i in shared_index] for g in task_grads]
                gram = (GS.gram_matrix(shared_grads) if shared_index
                        else tf.zeros([T, T], acc))
            return methods.TaskInputs(
                losses=losses, present=present, step=step, epoch=epoch, seed=self.seed,
                gram=gram, task_grads=shared_grads,
                shared_variables=[variables[i] for i in shared_index])

        regularizer = None
        if self._needs_task_gradients():
            if self._gathered_passes():
                task_losses, task_grads, new_state, y_pred = self._gathered_task_passes(
                    params, state, model_x, y, sample_weight, task_id, counts, replicas,
                    loss_scale, compiled, acc)
                reg_grads = None
            else:
                task_losses, task_grads, new_state, y_pred, regularizer, reg_grads = (
                    self._masked_task_passes(params, state, model_x, y, sample_weight, masks,
                                             factors, loss_scale, compiled, acc))
            # Global per-task losses and gradients, identical on every replica.
            losses, task_grads = F.all_reduce_sum((tf.stack(task_losses), task_grads))
            inputs = task_inputs(losses, task_grads)
            cosine = GS.mean_pairwise_cosine(inputs.gram, present)
            cosine_weight = tf.cast(tf.reduce_sum(present) >= 2, tf.float32)
            combination = method.combine(inputs, method_state)
            shared_c, specific_c = _coefficients(combination, acc)
            specific_positions = set(specific_index)
            combined = []
            for v in range(len(variables)):
                c = specific_c if v in specific_positions else shared_c
                combined.append(GS.combine([[g[v]] for g in task_grads], c)[0])
            gradient = [g * tf.cast(loss_scale, g.dtype) for g in F.replica_share(combined)]
            if reg_grads is not None:
                gradient = F.add(gradient, reg_grads)
        else:
            # A loss-weighting method: the weights come from the losses alone, so ONE
            # backward pass of sum_t w_t L_t (the cost of plain fit for "sum").
            (gradient, losses, combination, new_state, y_pred,
             regularizer) = self._weighted_loss_pass(
                params, state, model_x, y, sample_weight, masks, factors, loss_scale,
                compiled, acc, task_inputs, method_state)
            cosine = tf.constant(0.0, acc)
            cosine_weight = tf.constant(0.0, tf.float32)
            shared_c, _ = _coefficients(combination, acc)

        # The reported loss weighs each task as the method weighs its loss: the loss
        # weights it names, else its task-specific coefficients (1 for the gradient
        # methods, the weights of a weighting method).
        loss_weights = next(tf.cast(w, acc) for w in (
            combination.loss_weights, combination.specific, shared_c) if w is not None)
        total = tf.reduce_sum(loss_weights * losses)
        if regularizer is not None:
            total = total + tf.cast(F.all_reduce_sum(regularizer), acc)
        loss = F.scale_loss_for_distribution(tf.cast(total, tf.float32))
        # The state is assigned only once the loss is known finite (finish_step checks
        # it again before the model's variables are touched).
        loss = self.check_finite_loss(loss)
        with tf.control_dependencies([loss]):
            for key, value in combination.state.items():
                variable = self.method_state[key]
                variable.assign(tf.cast(value, variable.dtype))
            gradient = [tf.identity(g) for g in gradient]
        diagnostics = {"task_cosine": (cosine, cosine_weight)}
        if not self._trainable_method_state:
            return self.finish_step(data, y_pred, loss, new_state=new_state, gradients=gradient,
                                    diagnostics=diagnostics, where="the multi-task loss")
        # Trainable method state (UW's log-variances): trained by the compiled optimizer
        # beside the model, with its global gradient shared out like the model's.
        keys = list(self._trainable_method_state)
        extra_vars = [self._trainable_method_state[k] for k in keys]
        extra = F.replica_share([tf.cast(combination.state_gradients[k], v.dtype)
                                 * tf.cast(loss_scale, v.dtype)
                                 for k, v in zip(keys, extra_vars)])
        all_vars = list(variables) + extra_vars
        if not self.optimizer.built:
            self.optimizer.build(all_vars)

        def update():
            self.optimizer.apply_gradients(zip(list(gradient) + extra, all_vars))

        return self.finish_step(data, y_pred, loss, new_state=new_state, update=update,
                                diagnostics=diagnostics, where="the multi-task loss")

    def _weighted_loss_pass(self, params, state, model_x, y, sample_weight, masks, factors,
                            loss_scale, compiled, acc, task_inputs, method_state):
        """One forward and ONE backward pass of sum_t w_t L_t (w from the method)."""
        T = self.num_tasks
        with tf.GradientTape() as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, model_x, training=True)
            local = tf.stack([self._masked_task_loss(model_x, y, y_pred, sample_weight,
                                                     masks[t], factors[t], compiled, acc)
                              for t in range(T)])
            losses = F.all_reduce_sum(tf.stop_gradient(local))
            combination = self.method_object.combine(task_inputs(losses), method_state)
            weights = tf.stop_gradient(tf.cast(combination.shared, acc))
            total = tf.reduce_sum(weights * local) * tf.cast(loss_scale, acc)
            regularizer = None
            if model_losses:
                zero = tf.zeros_like(masks[0], dtype=_loss_weight_dtype(y))
                regularizer = F.compute_loss(self.model, model_x, y, y_pred, zero,
                                             model_losses, training=True, loss=compiled)
                total = total + tf.cast(regularizer, acc) * tf.cast(loss_scale, acc)
        gradient = F.densify(tape.gradient(total, params,
                                           unconnected_gradients=tf.UnconnectedGradients.ZERO))
        return gradient, losses, combination, new_state, y_pred, regularizer

    def _masked_task_loss(self, model_x, y, y_pred, sample_weight, mask, factor, compiled, acc):
        """Task loss from the whole batch's outputs: the compiled loss with the task's
        rows as sample weights, rescaled to the task's mean (see the class doc)."""
        weight = mask if sample_weight is None else (
            mask * tf.cast(tf.reshape(sample_weight, [-1]), acc))
        value = F.compute_loss(self.model, model_x, y, y_pred,
                               tf.cast(weight, _loss_weight_dtype(y)), [],
                               training=True, loss=compiled)
        return tf.cast(value, acc) * factor

    def fit(self, *args, **kwargs):
        if self.epochs_done is not None:
            callbacks = list(kwargs.pop("callbacks", None) or [])
            kwargs["callbacks"] = callbacks + [_EpochCounter(self.epochs_done)]
        return super().fit(*args, **kwargs)

    def _masked_task_passes(self, params, state, model_x, y, sample_weight, masks, factors,
                            loss_scale, compiled, acc):
        """One forward pass over the batch, T masked backward passes (static shapes)."""
        T = self.num_tasks
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, model_x, training=True)
            task_losses = [self._masked_task_loss(model_x, y, y_pred, sample_weight, masks[t],
                                                  factors[t], compiled, acc)
                           for t in range(T)]
            scaled = [v * tf.cast(loss_scale, acc) for v in task_losses]
            regularizer = None
            if model_losses:
                zero = tf.zeros_like(masks[0], dtype=_loss_weight_dtype(y))
                regularizer = F.compute_loss(self.model, model_x, y, y_pred, zero,
                                             model_losses, training=True, loss=compiled)
                regularizer_scaled = regularizer * tf.cast(loss_scale, regularizer.dtype)
        inv_scale = 1.0 / tf.cast(loss_scale, acc)
        task_grads = []
        for t in range(T):
            g = F.densify(tape.gradient(scaled[t], params,
                                        unconnected_gradients=tf.UnconnectedGradients.ZERO))
            task_grads.append([gi * tf.cast(inv_scale, gi.dtype) for gi in g])
        reg_grads = None
        if regularizer is not None:
            reg_grads = F.densify(tape.gradient(regularizer_scaled, params,
                                                unconnected_gradients=tf.UnconnectedGradients.ZERO))
        del tape
        return task_losses, task_grads, new_state, y_pred, regularizer, reg_grads

    def _gathered_passes(self):
        if self.task_passes != "auto":
            return self.task_passes == "gathered"
        return not (getattr(self, "jit_compile", False) is True or self.model.losses
                    or any(getattr(layer, "activity_regularizer", None) is not None
                           for layer in [self.model, *_compat.flatten_layers(self.model)]))

    def _gathered_task_passes(self, params, state, model_x, y, sample_weight, task_id,
                              counts, replicas, loss_scale, compiled, acc):
        """Task t's loss and gradient from a forward and backward pass over its own rows.

        The per-replica task loss is (Keras's mean over the m gathered rows) * m * R /
        n_t = sum_{i in t, this replica} w_i l_i * R / n_t, the masked path's value. A
        task with no row on this replica runs on one dummy row with weight 0 (a Keras
        mean over zero rows is 0/0), and its state update is discarded: the batch gets one
        zero row appended for that (a replica may hold no row at all: the last, partial
        batch of an epoch under a strategy).
        """
        T = self.num_tasks
        tf.debugging.assert_less(task_id, T, message="MultiTaskTrainer: a task_id is >= num_tasks")
        inv_scale = 1.0 / tf.cast(loss_scale, acc)
        weight_dtype = _loss_weight_dtype(y)
        pad_row = tf.cast(tf.shape(task_id)[0], tf.int64)  # the appended zero row
        padded = tf.nest.map_structure(
            _with_zero_row, (model_x, y, sample_weight))
        task_losses, task_grads, rows_list, preds = [], [], [], []
        for t in range(T):
            rows = tf.reshape(tf.where(tf.equal(task_id, t)), [-1])
            n_local = tf.shape(rows)[0]
            present_here = n_local > 0
            safe_rows = tf.cond(present_here, lambda: rows,
                                lambda: tf.reshape(pad_row, [1]))
            m = tf.shape(safe_rows)[0]
            gather = lambda a: None if a is None else tf.gather(a, safe_rows)  # noqa: E731
            x_t, y_t, w_t = tf.nest.map_structure(gather, padded)
            weight = tf.cast(tf.fill([m], tf.cast(present_here, tf.float32)), weight_dtype)
            if sample_weight is not None:
                weight = weight * tf.cast(tf.reshape(w_t, [-1]), weight_dtype)
            with tf.GradientTape() as tape:
                tape.watch(params)
                y_pred_t, state_t, model_losses = F.stateless_forward(
                    self.model, params, state, x_t, training=True)
                if model_losses:
                    raise ValueError(
                        "MultiTaskTrainer(task_passes='gathered'): the model has its own "
                        "losses (regularisers, add_loss), which are not task losses; use "
                        "task_passes='masked' (or 'auto', which picks it for such models).")
                value = F.compute_loss(self.model, x_t, y_t, y_pred_t, weight, [],
                                       training=True, loss=compiled)
                value = tf.cast(value, acc) * tf.math.divide_no_nan(
                    tf.cast(m, acc) * replicas, counts[t])
                scaled = value * tf.cast(loss_scale, acc)
            g = F.densify(tape.gradient(scaled, params,
                                        unconnected_gradients=tf.UnconnectedGradients.ZERO))
            task_grads.append([gi * tf.cast(inv_scale, gi.dtype) for gi in g])
            task_losses.append(value)
            state = [tf.where(present_here, new, old) for new, old in zip(state_t, state)]
            rows_list.append(tf.cast(rows, tf.int32))
            preds.append(tf.nest.map_structure(lambda p: p[:n_local], y_pred_t))
        # Predictions back in batch order (for the compiled metrics).
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.dynamic_stitch(rows_list, list(parts)), *preds)
        return task_losses, task_grads, state, y_pred

    def get_config(self):
        config = super().get_config()
        config.update(
            num_tasks=self.num_tasks,
            method=methods.serialize_method(self.method_object),
            model_takes_task_id=self.model_takes_task_id,
            seed=self.seed,
            task_specific_variables=(
                self._task_specific_request if self._task_specific_request in (None, "none")
                else [getattr(v, "path", v) for v in self._task_specific_request]),
            measure_task_cosine=self.measure_task_cosine,
            task_passes=self.task_passes,
        )
        return config


class _EpochCounter(keras.callbacks.Callback):
    """Counts completed epochs in a checkpointed trainer variable (DWA's loss history)."""

    def __init__(self, variable):
        super().__init__()
        self._variable = [variable]  # a list: not tracked

    def on_epoch_end(self, epoch, logs=None):
        self._variable[0].assign_add(1)


def _check_task_specific_request(request):
    if request is None or request == "none":
        return request
    if isinstance(request, str) or not isinstance(request, (list, tuple)):
        raise ValueError(
            '`task_specific_variables` must be None (the PerTaskHead layers\' variables), '
            '"none" (every variable shared) or a list of the model\'s variables or their '
            f"paths; got {request!r}.")
    return list(request)


def _coefficients(combination, acc):
    """(shared, task-specific) coefficients of a method's Combination, in `acc`."""
    shared = tf.cast(combination.shared, acc)
    specific = shared if combination.specific is None else tf.cast(combination.specific, acc)
    return shared, specific


def _with_zero_row(a):
    """`a` with one zero (or empty-string) row appended along the batch axis."""
    if a is None:
        return None
    a = tf.convert_to_tensor(a)
    shape = tf.concat([[1], tf.shape(a)[1:]], axis=0)
    row = tf.fill(shape, "") if a.dtype == tf.string else tf.zeros(shape, a.dtype)
    return tf.concat([a, row], axis=0)


def _loss_weight_dtype(y):
    """The dtype sample weights are given in: the targets' float dtype (float32 for
    integer labels)."""
    first = tf.nest.flatten(y)[0]
    return first.dtype if first.dtype.is_floating else tf.float32
