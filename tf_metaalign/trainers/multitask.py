"""`MultiTaskTrainer`: multi-task learning on mixed batches with gradient surgery."""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_metaalign.data import multitask as multitask_data
from tf_metaalign import _compat
from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
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

    Methods (the gradient G given to the compiled optimizer):
      "sum": G = sum_t grad L_t. On batches where every task has B/T examples and the
        compiled loss is a mean, fit's loss on the union is (1/T) sum_t L_t, so G is
        exactly T times plain `fit`'s gradient (plain fit with SGD at T * lr is the same
        training).
      "pcgrad": Yu et al. 2020 (see `gradient_surgery.pcgrad_coefficients`); the task
        order is a permutation drawn from a stateless RNG on (seed, step), step = the
        trainer's checkpointed step counter: deterministic and resumable.
      "gradvac": Wang et al. 2021, global cosine (over the whole model), EMA targets per
        ordered task pair, beta = `gradvac_beta`, updated AFTER their use in each pair
        (`gradient_surgery.gradvac_coefficients`); same task order as PCGrad.
      "gradnorm": Chen et al. 2018: G = sum_t w_t grad L_t with learned weights w
        (initially 1), then w takes one step of its own (learning rate
        `gradnorm_learning_rate`, asymmetry `gradnorm_alpha`) on the gradient norms at
        one shared weight W and is renormalised to sum to T
        (`gradient_surgery.gradnorm_update`). W: `gradnorm_variable` (an index into
        `model.trainable_variables` or a variable path); default the LAST trainable
        variable of rank >= 2 (the last shared kernel of a single-head model: give it
        explicitly when the last kernel is a per-task head). L_t(0) is the loss of
        task t at the first step it appears in.

    Mixed precision: the per-task gradients are unscaled (divided by the loss scale)
    before the combination and the combined gradient scaled back for the
    LossScaleOptimizer.

    State (checkpointed trainer variables): `count` (steps, drives the RNG),
    `gradvac_targets` [T, T], `gradnorm_weights` [T], `gradnorm_initial_losses` [T],
    `gradnorm_seen` [T]. Logs: "loss" = sum_t w_t L_t (w = 1 but for GradNorm) and
    "task_cosine", the mean pairwise cosine of the task gradients (before surgery) over
    the tasks present.
    """

    def __init__(
        self,
        model: keras.Model,
        num_tasks: int,
        method: str = "sum",
        model_takes_task_id: bool = False,
        seed: int = 0,
        gradvac_beta: float = 1e-2,
        gradnorm_alpha: float = 1.5,
        gradnorm_learning_rate: float = 0.025,
        gradnorm_variable=None,
        task_passes: str = "auto",
        **kwargs,
    ):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"`num_tasks` must be an integer >= 1; got {num_tasks!r}.")
        if method not in GS.METHODS:
            raise ValueError(f"`method` must be one of {GS.METHODS}; got {method!r}.")
        if not isinstance(model_takes_task_id, bool):
            raise ValueError(
                f"`model_takes_task_id` must be a bool; got {model_takes_task_id!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        for name, value, low, high in (("gradvac_beta", gradvac_beta, 0.0, 1.0),
                                       ("gradnorm_alpha", gradnorm_alpha, 0.0, None),
                                       ("gradnorm_learning_rate", gradnorm_learning_rate, 0.0,
                                        None)):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or value < low or (high is not None and value > high)):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"`{name}` must be a number {bound}; got {value!r}.")
        if gradnorm_variable is not None and (
                isinstance(gradnorm_variable, bool)
                or not isinstance(gradnorm_variable, (int, str))):
            raise ValueError(
                "`gradnorm_variable` must be None, an index into model.trainable_variables "
                f"or a variable path; got {gradnorm_variable!r}.")
        if task_passes not in TASK_PASSES:
            raise ValueError(f"`task_passes` must be one of {TASK_PASSES}; got {task_passes!r}.")
        super().__init__(model, **kwargs)
        self.task_passes = task_passes
        self.num_tasks = num_tasks
        self.method = method
        self.model_takes_task_id = model_takes_task_id
        self.seed = seed
        self.gradvac_beta = float(gradvac_beta)
        self.gradnorm_alpha = float(gradnorm_alpha)
        self.gradnorm_learning_rate = float(gradnorm_learning_rate)
        self.gradnorm_variable = gradnorm_variable
        self.steps = self.every_k_steps(1, name="multitask_steps")
        T = num_tasks
        if method == "gradvac":
            self.gradvac_targets = self.add_state_variable("gradvac_targets", (T, T), "float64")
        if method == "gradnorm":
            self.gradnorm_weights = self.add_state_variable(
                "gradnorm_weights", (T,), "float64", initializer="ones")
            self.gradnorm_initial_losses = self.add_state_variable(
                "gradnorm_initial_losses", (T,), "float64")
            self.gradnorm_seen = self.add_state_variable("gradnorm_seen", (T,), "float64")
        self.add_diagnostic("task_cosine", "mean")
        if model.built and method == "gradnorm":
            self._gradnorm_index()  # a bad `gradnorm_variable` fails now

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

    def _gradnorm_index(self):
        variables = self.model.trainable_variables
        choice = self.gradnorm_variable
        if choice is None:
            ranked = [i for i, v in enumerate(variables) if len(v.shape) >= 2]
            if not ranked:
                raise ValueError(
                    "MultiTaskTrainer(method='gradnorm'): the model has no trainable weight of "
                    "rank >= 2; pass `gradnorm_variable` (index or path).")
            return ranked[-1]
        if isinstance(choice, int):
            if not -len(variables) <= choice < len(variables):
                raise ValueError(
                    f"`gradnorm_variable`={choice} is out of range: the model has "
                    f"{len(variables)} trainable variables.")
            return choice % len(variables)
        paths = [v.path for v in variables]
        if choice not in paths:
            raise ValueError(f"`gradnorm_variable`={choice!r} is not a trainable variable path "
                             f"of the model; paths: {paths}.")
        return paths.index(choice)

    # -------------------------------------------------------------------- step

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
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

        if self._gathered_passes():
            task_losses, task_grads, new_state, y_pred = self._gathered_task_passes(
                params, state, model_x, y, sample_weight, task_id, counts, replicas,
                loss_scale, compiled, acc)
            regularizer = reg_grads = None
        else:
            task_losses, task_grads, new_state, y_pred, regularizer, reg_grads = (
                self._masked_task_passes(params, state, model_x, y, sample_weight, masks,
                                         factors, loss_scale, compiled, acc))

        # Global per-task losses and gradients, identical on every replica.
        losses, task_grads = F.all_reduce_sum((tf.stack(task_losses), task_grads))
        gram = GS.gram_matrix(task_grads)
        cosine = GS.mean_pairwise_cosine(gram, present)
        step = tf.convert_to_tensor(self.steps.count.value)

        weights = tf.ones([T], acc)
        assignments = []
        if self.method in ("pcgrad", "gradvac"):
            order = GS.random_order(T, self.seed, step)
        if self.method == "sum":
            coefficients = weights
        elif self.method == "pcgrad":
            coefficients = GS.pcgrad_coefficients(gram, order)
        elif self.method == "gradvac":
            result = GS.gradvac_coefficients(
                gram, tf.convert_to_tensor(self.gradvac_targets.value), order,
                beta=self.gradvac_beta)
            coefficients = result.coefficients
            assignments.append((self.gradvac_targets, result.targets))
        else:  # gradnorm
            weights = tf.cast(tf.convert_to_tensor(self.gradnorm_weights.value), acc)
            coefficients = weights
            seen = tf.cast(tf.convert_to_tensor(self.gradnorm_seen.value), acc)
            first = present * (1.0 - seen)
            initial = tf.cast(tf.convert_to_tensor(self.gradnorm_initial_losses.value), acc)
            initial = initial + first * (losses - initial)
            index = self._gradnorm_index()
            layer_norms = tf.stack([F.global_norm([g[index]]) for g in task_grads])
            new_weights = GS.gradnorm_update(
                weights, tf.cast(layer_norms, acc), losses, initial, present,
                alpha=self.gradnorm_alpha, learning_rate=self.gradnorm_learning_rate)
            assignments += [(self.gradnorm_weights, new_weights),
                            (self.gradnorm_initial_losses, initial),
                            (self.gradnorm_seen, tf.maximum(seen, present))]

        combined = GS.combine(task_grads, coefficients)
        gradient = [g * tf.cast(loss_scale, g.dtype) for g in F.replica_share(combined)]
        if reg_grads is not None:
            gradient = F.add(gradient, reg_grads)
        total = tf.reduce_sum(weights * losses)
        if regularizer is not None:
            total = total + tf.cast(F.all_reduce_sum(regularizer), acc)
        loss = F.scale_loss_for_distribution(tf.cast(total, tf.float32))
        # The state is assigned only once the loss is known finite (finish_step checks
        # it again before the model's variables are touched).
        loss = self.check_finite_loss(loss)
        with tf.control_dependencies([loss]):
            for variable, value in assignments:
                variable.assign(tf.cast(value, variable.dtype))
            gradient = [tf.identity(g) for g in gradient]
        n_present = tf.reduce_sum(present)
        return self.finish_step(
            data, y_pred, loss, new_state=new_state, gradients=gradient,
            diagnostics={"task_cosine": (cosine, tf.cast(n_present >= 2, tf.float32))},
            where="the multi-task loss",
        )

    def _masked_task_passes(self, params, state, model_x, y, sample_weight, masks, factors,
                            loss_scale, compiled, acc):
        """One forward pass over the batch, T masked backward passes (static shapes)."""
        T = self.num_tasks
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, model_x, training=True)
            task_losses = []
            for t in range(T):
                weight = masks[t] if sample_weight is None else (
                    masks[t] * tf.cast(tf.reshape(sample_weight, [-1]), acc))
                value = F.compute_loss(self.model, model_x, y, y_pred,
                                       tf.cast(weight, _loss_weight_dtype(y)), [],
                                       training=True, loss=compiled)
                task_losses.append(tf.cast(value, acc) * factors[t])
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
            method=self.method,
            model_takes_task_id=self.model_takes_task_id,
            seed=self.seed,
            gradvac_beta=self.gradvac_beta,
            gradnorm_alpha=self.gradnorm_alpha,
            gradnorm_learning_rate=self.gradnorm_learning_rate,
            gradnorm_variable=self.gradnorm_variable,
            task_passes=self.task_passes,
        )
        return config


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
