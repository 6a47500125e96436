"""Reptile-family trainers: `SequentialReptileTrainer` (Lee et al., ICLR 2022), and the
single-task first-order `ReptileTrainer` and `FOMAMLTrainer` (the Meta DotProd paper's
baselines).

On JAX (`KERAS_BACKEND=jax`) the same trainers run as pure steps (docs/trainers.md, "On
JAX"): phi, the counters and the optimizer state are part of the step's state; with
`keras.distribution.DataParallel` the step sees the global batch, so each inner gradient
is the global-batch gradient TensorFlow all-reduces, and N devices compute what one does.

Two shapes (docs/trainers.md, "Where the weights live"):

* `SequentialReptileTrainer`: a trajectory spans `inner_steps` train steps. The model's
  variables hold the FAST weights theta (each train step is one ordinary, data-parallel
  step of the COMPILED optimizer, the inner optimizer); a weights copy "slow" holds phi.
  After every `inner_steps`-th step, phi <- phi + eta (theta - phi) is committed to both.
* `ReptileTrainer` / `FOMAMLTrainer`: the whole inner loop runs inside one train step on
  a stacked batch, on tensors (`optimizer.apply_on_tensors`), first order; the compiled
  optimizer is the OUTER optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import keras
from keras import ops

from tf_metaalign import _compat, backend
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.algorithms import reptile as R
from tf_metaalign.trainers.base import MetaTrainer, commit_weights


def _select(pred, a, b):
    """`a` where `pred` else `b`, element-wise over two lists (python bool: no op)."""
    if isinstance(pred, bool):
        return list(a) if pred else list(b)
    return [ops.where(pred, x, y) for x, y in zip(a, b)]


def _read(variable):
    """A copy of a variable's current value (`F.read_value`, a snapshot that later
    assignments leave alone), so that assigning it to another variable outside a step
    (`end_trajectory`, `model_weights_to_save`) does not make two variables share one JAX
    buffer, which the jitted step's state donation refuses."""
    return ops.copy(F.read_value(variable))


def _rank(t):
    """The rank of `t` (a tensor or spec), or None when unknown (a TensorShape of
    unknown rank)."""
    try:
        return len(t.shape)
    except (TypeError, ValueError):
        return None


def _mean_loss(losses, loss_scale):
    """The mean of the (loss-scaled) inner losses, unscaled: sum / (n * loss_scale),
    summed in order (as tf.add_n)."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total / (len(losses) * ops.cast(loss_scale, total.dtype))


def _slot_variables(optimizer, variables):
    """The per-variable state of `optimizer` (the slots: Adam's m and v, momentum...).

    Not its iteration count, learning rate, hyperparameter variables or a
    LossScaleOptimizer's loss scale. tf_metaalign optimizers: `slots_for`; Keras
    optimizers: every variable except `iterations` and the learning rate (this includes
    gradient-accumulation buffers).
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, O.BaseOptimizer):
        return [s for v in variables for s in optimizer.slots_for(v).values()]
    skip = {id(optimizer.iterations)}
    lr = getattr(optimizer, "_learning_rate", None)
    if isinstance(lr, keras.Variable):
        skip.add(id(lr))
    return [v for v in optimizer.variables if id(v) not in skip]


def _stateless_test_step(trainer, step, state, data):
    """JAX: `(logs, state)` of a stateful-style `step(data)` (reads `variable.value`,
    updates metrics) run on Keras's test state `(trainable, non_trainable, metrics)`
    values, inside a `keras.StatelessScope` (as `backend.jax.stateless_train_step` runs a
    train step)."""
    groups = (
        list(trainer.trainable_variables),
        list(trainer.non_trainable_variables),
        list(trainer.metrics_variables),
    )
    mapping = [(v, value) for vs, values in zip(groups, state) for v, value in zip(vs, values)]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = step(data)
    new_state = []
    for variables, values in zip(groups, state):
        current = [scope.get_current_value(v) for v in variables]
        new_state.append([old if new is None else new for new, old in zip(current, values)])
    return logs, tuple(new_state)


class _TaskIdInputs:
    """Multi-task batches: `x = {"inputs": model inputs, "task_id": int32 [B]}`. The model
    is given `x["inputs"]` unless `model_takes_task_id` (then the whole dict). Any other
    `x` goes to the model as it is."""

    def _model_inputs(self, x):
        # `tf_metaalign.data.multitask.model_inputs_of`, written here because that module
        # (its MultiTaskStream) imports TensorFlow, which a JAX user may not have.
        if isinstance(x, Mapping) and "inputs" in x and "task_id" in x:
            return x if self.model_takes_task_id else x["inputs"]
        return x

    def call(self, inputs, training=None):
        return super().call(self._model_inputs(inputs), training=training)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; got {value!r}.")
    return value


# ------------------------------------------------------------------ Sequential Reptile


@keras.saving.register_keras_serializable(package="tf_metaalign")
class SequentialReptileTrainer(_TaskIdInputs, MetaTrainer):
    """Sequential Reptile (Lee et al., ICLR 2022) inside `model.fit`.

    Per outer step: theta_0 = phi; for k = 1..K (K = `inner_steps`), one train step on
    the batch `fit` gives (each batch from one task, as sampled upstream by the data):
    theta_k = InnerOptimizer(theta_{k-1}, grad L(theta_{k-1}; B_k)); then
    phi <- phi + eta (theta_K - phi) and theta restarts from the new phi.

    The COMPILED optimizer is the inner optimizer: each train step is an ordinary
    `apply_gradients` on the model's variables (the fast weights theta; all-reduce,
    clipping, loss scaling as in `fit`). Its state (slots, iteration count) is kept
    across outer steps, as in the public implementations. phi lives in the weights copy
    "slow" (`trainer.weights_copy("slow")`, variables `slow_0`, `slow_1`, ...); the
    trajectory position is the schedule counter `trainer.schedule.count`. Both are
    checkpointed with the trainer (`save_weights`, `BackupAndRestore`, `.keras`), so a
    run stopped mid-trajectory resumes exactly.

    With K = 1 and eta = 1 it is plain training.

    On JAX the outer update is a `jax.lax.cond` inside the pure step (its branches assign
    phi, the model and, with `reset_inner_optimizer`, the slots); under
    `keras.distribution.DataParallel` every step is one step on the global batch, as on
    one TensorFlow replica (TensorFlow's multi-replica step gives the same numbers: its
    inner step is the all-reduced `apply_gradients`).

    What the user gets is phi:
    * at the end of `fit`, if the last trajectory is incomplete (the step count is not a
      multiple of K), it is DISCARDED: phi is committed into the model, the counter is
      moved to the start of the next trajectory and (with `reset_inner_optimizer`) the
      slots are zeroed. No partial outer step is applied: a partial trajectory is not
      what the method's outer update averages over, and discarding keeps the result of a
      fit independent of how its steps are split into further fits only up to whole
      trajectories (choose `steps_per_epoch * epochs` as a multiple of K to lose nothing).
      A `fit` that ends with an exception (interrupted) leaves theta in the model
      (`BackupAndRestore` then resumes the trajectory exactly).
    * `trainer.evaluate` (and the validation of `fit`, `validation_data`) evaluates the
      model at phi while `fit` runs (a `test_step` at the slow weights, no assignment);
      outside `fit` the model's variables are evaluated, which hold phi after `fit`.
    * During `fit` the wrapped model's variables hold theta: `trainer.model.save` /
      `model.evaluate` in a callback mid-trajectory see theta. `trainer.save` (what
      `keras.callbacks.ModelCheckpoint` calls) writes the model at phi, the weights its
      validation measured (`model_weights_to_save`: phi put in for the save, theta back
      after); `save_weights` (`BackupAndRestore`) checkpoints both (phi as `slow_*`).

    Args:
      model: the Keras model to train (`trainer.model`).
      inner_steps: K, the train steps (batches) per outer step, >= 1.
      outer_learning_rate: eta > 0 (1 = phi <- theta_K).
      reset_inner_optimizer: when True, at every outer step (and when `fit` discards a
        partial trajectory) the compiled optimizer's SLOTS are zeroed (Adam's m and v,
        momentum buffers, Keras optimizers' gradient-accumulation buffers: every
        per-variable state; for a LossScaleOptimizer, its inner optimizer's). NOT reset:
        its `iterations` (so learning-rate schedules and `optimizer.iterations` keep
        counting train steps), hence Adam's bias correction 1 - beta^t keeps using the
        global step t, and the loss scale. Default False (state kept across outer steps).
      model_takes_task_id: with multi-task batches `x = {"inputs": ..., "task_id": ...}`,
        give the model the whole dict (True) or `x["inputs"]` (False, the default).

    Example:
      >>> from tf_metaalign.trainers import SequentialReptileTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = SequentialReptileTrainer(model, inner_steps=2, outer_learning_rate=0.5)
      >>> trainer.compile(optimizer="sgd", loss="mse")  # the inner optimizer
      >>> x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
      >>> history = trainer.fit(x, x.sum(axis=1, keepdims=True), batch_size=4, verbose=0)
      >>> history.history["loss"][0] > 0
      True

    References:
      Lee et al., "Sequential Reptile: Inter-Task Gradient Alignment for Multilingual
      Learning", ICLR 2022. https://arxiv.org/abs/2110.02600
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model,
        inner_steps,
        outer_learning_rate,
        reset_inner_optimizer=False,
        model_takes_task_id=False,
        **kwargs,
    ):
        inner_steps = R.validate_steps("inner_steps", inner_steps)
        outer_learning_rate = R.validate_rate("outer_learning_rate", outer_learning_rate)
        _check_bool("reset_inner_optimizer", reset_inner_optimizer)
        self.model_takes_task_id = _check_bool("model_takes_task_id", model_takes_task_id)
        super().__init__(model, **kwargs)
        self.inner_steps = inner_steps
        self.outer_learning_rate = outer_learning_rate
        self.reset_inner_optimizer = reset_inner_optimizer
        self.schedule = self.every_k_steps(inner_steps, name="trajectory")
        self.add_weights_copy("slow")
        self._evaluate_at_slow = False

    @property
    def slow_weights(self):
        """phi: the slow weights (variables of the weights copy "slow")."""
        return self.weights_copy("slow")

    def unpack(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return super().unpack((self._model_inputs(x), y, sample_weight))

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        data = (x, y, sample_weight)
        if not self.optimizer.built:  # before the control-dependent block (XLA)
            self.optimizer.build(self.model.trainable_variables)
        loss_scale = self.loss_scale()
        scaled_loss, grads, (new_state, y_pred) = F.value_and_grad(
            self.loss_fn(loss_scale=loss_scale),
            F.current_params(self.model),
            F.current_state(self.model),
            (x, y, sample_weight),
        )
        loss = scaled_loss / ops.cast(loss_scale, scaled_loss.dtype)

        def update():
            variables = self.model.trainable_variables
            self.optimizer.apply_gradients(zip(grads, variables))  # one inner step
            slow = self.weights_copy("slow")
            due = self.schedule.is_last()

            def outer_step(due):
                # phi <- phi + eta (theta - phi) into both copies where `due`: a python
                # True (under tf.cond, one replica) or a boolean tensor (several replicas:
                # a commit communicates and may not sit inside tf.cond, so select, then
                # commit unconditionally on every step).
                theta = F.current_params(self.model)
                phi = [_read(v) for v in slow]
                outer = R.outer_update(phi, theta, self.outer_learning_rate)
                commit_weights(variables, _select(due, outer, theta))
                for v, value in zip(slow, _select(due, outer, phi)):
                    v.assign(value)
                if self.reset_inner_optimizer:
                    self._zero_slots(due)
                return ops.convert_to_tensor(due)

            # One replica: the outer update runs only at the trajectory's end (tf.cond),
            # so a step costs an inner step, not an inner step plus two weight copies.
            self.schedule.cond(
                due,
                lambda: outer_step(True),
                lambda: ops.convert_to_tensor(False),
                communicates=True,
                merged=outer_step,
            )

        return self.finish_step(data, y_pred, loss, new_state=new_state, update=update)

    def _zero_slots(self, due):
        slots = _slot_variables(self.optimizer, self.model.trainable_variables)
        if not slots:
            return
        values = [_read(s) for s in slots]
        commit_weights(slots, _select(due, [ops.zeros_like(v) for v in values], values))

    def test_step(self, *args):
        # TensorFlow calls test_step(data); JAX test_step(state, data) -> (logs, state).
        if not self._evaluate_at_slow:
            return super().test_step(*args)
        if backend.is_jax():
            return _stateless_test_step(self, self._test_at_slow, *args)
        return self._test_at_slow(*args)

    def _test_at_slow(self, data):
        # During fit: evaluate the model at phi (the slow weights), assigning nothing.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x = self._model_inputs(x)
        phi = [_read(v) for v in self.weights_copy("slow")]
        loss, (_, y_pred) = self.loss_fn(training=False)(
            phi, F.current_state(self.model), (x, y, sample_weight)
        )
        _compat.loss_tracker(self).update_state(
            F.unscale_loss_for_distribution(loss), sample_weight=F.batch_size(x)
        )
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return {k: v for k, v in logs.items() if k not in self._diagnostics}

    def fit(self, *args, **kwargs):
        self._evaluate_at_slow = True
        self.test_function = None  # traced for phi during this fit
        try:
            history = super().fit(*args, **kwargs)
        finally:
            self._evaluate_at_slow = False
            self.test_function = None  # evaluate() outside fit: the model's variables
        self.end_trajectory()
        return history

    @contextlib.contextmanager
    def model_weights_to_save(self):
        # Between steps (callbacks run between steps, so nothing trains meanwhile).
        count = int(self.schedule.count.numpy())
        if count % self.inner_steps == 0 or not self.model.built:
            yield  # at a trajectory's start the model holds phi
            return
        variables = self.model.trainable_variables
        theta = [_read(v) for v in variables]
        for v, s in zip(variables, self.weights_copy("slow")):
            v.assign(_read(s))
        try:
            yield
        finally:
            for v, t in zip(variables, theta):
                v.assign(t)

    def end_trajectory(self):
        """Discard an incomplete trajectory: commit phi into the model and move the
        counter to the next trajectory's start (zeroing the slots with
        `reset_inner_optimizer`). A no-op at a trajectory boundary. `fit` calls it."""
        count = int(self.schedule.count.numpy())
        if count % self.inner_steps == 0:
            return
        for v, s in zip(self.model.trainable_variables, self.weights_copy("slow")):
            v.assign(_read(s))
        self.schedule.count.assign(count + self.inner_steps - count % self.inner_steps)
        if self.reset_inner_optimizer:
            for s in _slot_variables(self.optimizer, self.model.trainable_variables):
                s.assign(ops.zeros_like(s.value))

    def get_config(self):
        return {
            **super().get_config(),
            "inner_steps": self.inner_steps,
            "outer_learning_rate": self.outer_learning_rate,
            "reset_inner_optimizer": self.reset_inner_optimizer,
            "model_takes_task_id": self.model_takes_task_id,
        }


# ------------------------------------------------------------- stacked inner loops


class _StackedInnerLoopTrainer(_TaskIdInputs, MetaTrainer):
    """Shared by ReptileTrainer and FOMAMLTrainer: a stacked batch, an inner optimizer
    on tensors, the compiled optimizer as the outer optimizer."""

    _extra_batches = 0  # FOMAML: + 1 query batch
    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model,
        inner_steps,
        inner_optimizer=0.1,
        stack_axis=0,
        model_takes_task_id=False,
        inner_training=True,
        **kwargs,
    ):
        inner_steps = R.validate_steps("inner_steps", inner_steps)
        self.model_takes_task_id = _check_bool("model_takes_task_id", model_takes_task_id)
        self.inner_training = _check_bool("inner_training", inner_training)
        if isinstance(inner_optimizer, dict):  # from get_config
            inner_optimizer = keras.optimizers.deserialize(inner_optimizer)
        if isinstance(inner_optimizer, (int, float)) and not isinstance(inner_optimizer, bool):
            R.validate_rate("inner_optimizer (a learning rate)", inner_optimizer)
            inner_optimizer = float(inner_optimizer)
        elif not isinstance(inner_optimizer, O.BaseOptimizer):
            raise ValueError(
                "`inner_optimizer` must be a learning rate (a number > 0, for SGD) or a "
                "tf_metaalign optimizer (which can step on tensors: apply_on_tensors); got "
                f"{inner_optimizer!r}."
            )
        if stack_axis not in (0, 1) or isinstance(stack_axis, bool):
            raise ValueError(f"`stack_axis` must be 0 or 1; got {stack_axis!r}.")
        super().__init__(model, **kwargs)
        self.inner_steps = inner_steps
        self.stack_axis = stack_axis
        self._inner_config = inner_optimizer
        self.inner_optimizer = (
            O.SGD(inner_optimizer) if isinstance(inner_optimizer, float) else inner_optimizer
        )
        # Outer steps (tasks) seen: `trainer.outer_steps`, checkpointed.
        self.schedule = self.every_k_steps(1, name="outer_steps")

    @property
    def outer_steps(self):
        """Outer steps taken since the start of training (a checkpointed int64)."""
        return self.schedule.count

    @property
    def num_stacked(self):
        """Batches stacked in one training element: k (Reptile) or k + 1 (FOMAML)."""
        return self.inner_steps + self._extra_batches

    def _pick(self, nest, *index):
        """The batch at `index` of the stacked axes (after the batch axis for stack_axis=1)."""

        def one(t):
            if t is None:
                return None
            return t[index] if self.stack_axis == 0 else t[(slice(None),) + index]

        return keras.tree.map_structure(one, nest)

    def example_batch(self, x, y=None, sample_weight=None):
        # Keras builds the model, loss and metrics from a training batch: its first
        # stacked batch is a model batch. The rank is checked first, so that a wrongly
        # stacked element is named as such, not as a Conv2D / Dense input error.
        self._check_rank(x, [f"k={self.num_stacked}"])
        return self._pick((x, y, sample_weight), 0)

    def unpack(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return super().unpack((self._model_inputs(x), y, sample_weight))

    def _layout(self, stacked):
        """The element layout in words, e.g. "[k=3, B, *input_shape]"."""
        names = list(stacked) + ["B"]
        if self.stack_axis == 1:
            names = ["B"] + list(stacked)
        return "[" + ", ".join(names) + ", *input_shape]"

    def _check_rank(self, x, stacked):
        """The element's x must have the model's input rank + len(stacked) (the stacked
        axes): a clear error naming the expected shape, not a Conv2D / Dense error deep
        in the model (an element that was not stacked, or stacked twice)."""
        try:
            inputs = keras.tree.flatten(self.model.inputs)
        except (AttributeError, ValueError):  # a subclassed model: no symbolic inputs
            return
        given = keras.tree.flatten(x)
        if len(given) != 1 or len(inputs) != 1:
            return  # several inputs: their order in `x` may not be the model's
        for t, i in zip(given, inputs):
            rank, want = _rank(t), len(i.shape) + len(stacked)
            if rank is not None and rank != want:
                expected = self._layout(stacked).replace(
                    "*input_shape", ", ".join(str(d) for d in i.shape[1:]) or ""
                )
                expected = expected.replace(", ]", "]")
                raise ValueError(
                    f"{type(self).__name__}(inner_steps={self.inner_steps}, stack_axis="
                    f"{self.stack_axis}) needs training elements {self._layout(stacked)} "
                    f"= {expected} (rank {want}) for the model's input of shape "
                    f"{tuple(i.shape)}; got x of shape {tuple(t.shape)} (rank {rank}). "
                    + (
                        "A model batch without the stacked axes: build the elements with "
                        "`tf_metaalign.data.stacked_batches`."
                        if rank == want - len(stacked)
                        else "Build the elements with `tf_metaalign.data.stacked_batches`."
                    )
                )

    def _batches(self, x, y, sample_weight):
        self._check_rank(x, [f"k={self.num_stacked}"])
        first = next(t for t in keras.tree.flatten(x) if t is not None)
        n = first.shape[self.stack_axis] if _rank(first) else None
        layout = self._layout([f"k={self.num_stacked}"])
        if n is None:
            raise ValueError(
                f"{type(self).__name__}(inner_steps={self.inner_steps}) unrolls its "
                f"{self.num_stacked} stacked batches, so their number must be static; got x "
                f"of shape {first.shape} (axis {self.stack_axis} unknown: an element built "
                "with `.batch(k)` without drop_remainder=True, whose last element may hold "
                "fewer batches). Batch with drop_remainder=True, or build the elements with "
                f"`tf_metaalign.data.stacked_batches`. Expected {layout}."
            )
        if n != self.num_stacked:
            raise ValueError(
                f"{type(self).__name__}(inner_steps={self.inner_steps}) needs training "
                f"elements that stack {self.num_stacked} batches along axis {self.stack_axis} "
                f"({layout}, per replica); got {n} (x shape {first.shape}). Under several "
                "replicas, Keras splits axis 0: use stack_axis=1 ([B, k, ...]) so that each "
                "replica gets its share of every inner batch."
            )
        return [self._pick((x, y, sample_weight), i) for i in range(self.num_stacked)]

    def _inner(self, batches, loss_scale):
        phi = F.current_params(self.model)
        variables = self.model.trainable_variables
        result = R.inner_loop(
            self.loss_fn(loss_scale=loss_scale, training=self.inner_training),
            phi,
            F.current_state(self.model),
            batches[: self.inner_steps],
            self.inner_optimizer,
            variables,
            loss_scale=loss_scale,
        )
        return phi, result

    def get_config(self):
        inner = self._inner_config
        return {
            **super().get_config(),
            "inner_steps": self.inner_steps,
            "inner_optimizer": inner
            if isinstance(inner, float)
            else keras.optimizers.serialize(inner),
            "stack_axis": self.stack_axis,
            "model_takes_task_id": self.model_takes_task_id,
            "inner_training": self.inner_training,
        }


@keras.saving.register_keras_serializable(package="tf_metaalign")
class ReptileTrainer(_StackedInnerLoopTrainer):
    """First-order Reptile on one task per train step.

    Each training element stacks k = `inner_steps` batches: `[k, B, ...]` (stack_axis=0)
    or `[B, k, ...]` (stack_axis=1, the layout for several replicas: Keras splits axis 0,
    so each replica gets its share of every inner batch). From phi (the model's
    variables), k steps of the inner optimizer run on tensors (each step's gradient
    all-reduced: the global inner batch), giving theta_k; the compiled (OUTER) optimizer
    then applies the pseudo-gradient phi - theta_k. Units: the value handed to
    `apply_gradients` per replica is (phi - theta_k) / replicas (`replica_share`, times
    the loss scale under mixed precision), so the optimizer's cross-replica sum is exactly
    phi - theta_k: outer SGD(eps) is phi + eps (theta_k - phi), and outer SGD(1) is k
    plain inner-optimizer steps. The inner optimizer starts fresh (zero slots, step 1) at
    every train step.

    Logs "loss": the mean of the k inner losses (each at the weights before its step);
    compiled metrics: on the last inner batch.

    Args:
      model: the Keras model to train.
      inner_steps: k >= 1.
      inner_optimizer: a learning rate (SGD) or a tf_metaalign optimizer (stepped with
        `apply_on_tensors`; never built, holds no variables).
      stack_axis: 0 ([k, B, ...]) or 1 ([B, k, ...]).
      model_takes_task_id: with multi-task batches `x = {"inputs": ..., "task_id": ...}`
        (stacked like the rest), give the model the whole dict (True) or `x["inputs"]`.
      inner_training: the `training` flag of the step's forward passes (the inner loop,
        and FOMAML's query pass). True (the default, transductive): BatchNorm normalises
        each inner batch with its own statistics (and updates the moving statistics from
        them), Dropout is active: what the reference code does (openai/supervised-reptile's
        OmniglotModel calls `tf.layers.batch_normalization(out, training=True)`, in
        training and evaluation; cbfinn/maml's `tf.contrib.layers.batch_norm` keeps its
        default `is_training=True`). False: the passes of a hand-written loop that calls
        `model(x)` (keras-io's Reptile example): BatchNorm normalises with its moving
        statistics, which the step then never updates, and Dropout is off. See
        docs/porting.md.

    On JAX the inner loop's gradients are the global batch's (the step sees the global
    batch under `keras.distribution.DataParallel`), which is what TensorFlow's all-reduce
    gives per replica: the same numbers on any number of devices. NumPy elements are
    batched along axis 0, so give them as `[B, k, ...]` with stack_axis=1 (or `[k, B, ...]`
    elements from a generator / `keras.utils.PyDataset`).

    Elements: `tf_metaalign.data.stacked_batches` builds them from a task sampler. An
    element whose rank is not the model's input rank + 1 (a model batch that was not
    stacked) is refused with an error naming the expected shape `[k, B, *input_shape]`;
    so is an element whose number of stacked batches is not static (`.batch(k)` without
    drop_remainder=True). A last element with fewer EXAMPLES per batch (B) trains as
    usual; under several replicas with stack_axis=1 a replica may get no example of the
    last element (it then contributes nothing to the summed gradients, as in Keras's own
    `fit`).

    Example:
      >>> from tf_metaalign.trainers import ReptileTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = ReptileTrainer(model, inner_steps=2, inner_optimizer=0.1)
      >>> trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
      >>> x = np.random.default_rng(0).normal(size=(4, 2, 5, 3)).astype("float32")  # [k=2, B=5]
      >>> data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=-1, keepdims=True)))
      >>> history = trainer.fit(data, verbose=0)  # 4 tasks, one per step
      >>> sorted(history.history)
      ['loss']

    References:
      Nichol et al., "On First-Order Meta-Learning Algorithms", 2018.
      https://arxiv.org/abs/1803.02999
    """

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        batches = self._batches(x, y, sample_weight)
        loss_scale = self.loss_scale()
        phi, r = self._inner(batches, loss_scale)
        delta = R.reptile_gradient(phi, r.params)
        scale = ops.cast(loss_scale, phi[0].dtype) if phi else 1.0
        gradients = F.replica_share([d * ops.cast(scale, d.dtype) for d in delta])
        loss = _mean_loss(r.losses, loss_scale)
        return self.finish_step(batches[-1], r.y_pred, loss, new_state=r.state, gradients=gradients)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class FOMAMLTrainer(_StackedInnerLoopTrainer):
    """First-order MAML on one task per train step.

    Each training element stacks k + 1 batches (k = `inner_steps`): `[k+1, B, ...]`
    (stack_axis=0) or `[B, k+1, ...]` (stack_axis=1); batches 0..k-1 are the inner
    (support) batches, batch k the query. From phi (the model's variables), k inner steps
    on tensors give theta_k (first order: the trajectory is not differentiated); the
    compiled (OUTER) optimizer applies the query-loss gradient at theta_k, as plain
    per-replica gradients (Keras's per-replica loss units, of the scaled loss under
    mixed precision): exactly what `fit` hands `apply_gradients`, so outer SGD(lr) is
    phi - lr * grad L(theta_k; query) on the global query batch.

    Logs "loss": the query loss at theta_k (the meta-objective); compiled metrics on the
    query batch. Arguments as `ReptileTrainer`.

    Example:
      >>> from tf_metaalign.trainers import FOMAMLTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = FOMAMLTrainer(model, inner_steps=1, inner_optimizer=0.1)
      >>> trainer.compile(optimizer="adam", loss="mse")
      >>> x = np.random.default_rng(0).normal(size=(4, 2, 5, 3)).astype("float32")  # inner + query
      >>> data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=-1, keepdims=True)))
      >>> history = trainer.fit(data, verbose=0)
      >>> trainer.num_stacked, sorted(history.history)
      (2, ['loss'])

    References:
      Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks",
      ICML 2017 (first-order approximation). https://arxiv.org/abs/1703.03400
    """

    _extra_batches = 1

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        batches = self._batches(x, y, sample_weight)
        loss_scale = self.loss_scale()
        _, r = self._inner(batches, loss_scale)
        scaled, grads, (state, y_pred) = R.fomaml_gradient(
            self.loss_fn(loss_scale=loss_scale, training=self.inner_training),
            r.params,
            r.state,
            batches[-1],
        )
        loss = scaled / ops.cast(loss_scale, scaled.dtype)
        return self.finish_step(batches[-1], y_pred, loss, new_state=state, gradients=grads)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class MultiTaskReptileTrainer(_StackedInnerLoopTrainer):
    """Reptile over T tasks per train step (Nichol et al.'s batched Reptile; the baseline
    Sequential Reptile is compared with).

    Each training element stacks T tasks of k = `inner_steps` batches: `[T, k, B, ...]`
    (stack_axis=0) or `[B, T, k, ...]` (stack_axis=1, for several replicas). From the
    same phi, one k-step trajectory per task on tensors (each inner gradient all-reduced)
    gives theta_t; the compiled (OUTER) optimizer applies phi - mean_t theta_t, handed
    over as `replica_share` (times the loss scale) exactly like `ReptileTrainer`: outer
    SGD(eps) is phi + eps (mean_t theta_t - phi). T = 1 is `ReptileTrainer`. T is read
    from the batch's static shape. The inner optimizer starts fresh for every task.

    Logs "loss": the mean of the T*k inner losses; compiled metrics on the last task's
    last batch. Arguments as `ReptileTrainer`.

    Example:
      >>> from tf_metaalign.trainers import MultiTaskReptileTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = MultiTaskReptileTrainer(model, inner_steps=2, inner_optimizer=0.1)
      >>> trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
      >>> x = np.random.default_rng(0).normal(size=(4, 3, 2, 5, 3)).astype("float32")  # [T, k, B]
      >>> data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=-1, keepdims=True)))
      >>> history = trainer.fit(data, verbose=0)
      >>> sorted(history.history)
      ['loss']

    References:
      Nichol et al., "On First-Order Meta-Learning Algorithms", 2018.
      https://arxiv.org/abs/1803.02999
    """

    def _tasks(self, x, y, sample_weight):
        self._check_rank(x, ["T", f"k={self.inner_steps}"])
        first = next(t for t in keras.tree.flatten(x) if t is not None)
        layout = "[T, k, B, ...]" if self.stack_axis == 0 else "[B, T, k, ...]"
        rank_needed = 2 + self.stack_axis
        if _rank(first) is None or _rank(first) < rank_needed + 1:
            raise ValueError(
                f"MultiTaskReptileTrainer needs training elements {layout} (stack_axis="
                f"{self.stack_axis}); got x of shape {first.shape}."
            )
        tasks = first.shape[self.stack_axis]
        steps = first.shape[self.stack_axis + 1]
        if tasks is None or steps != self.inner_steps:
            raise ValueError(
                f"MultiTaskReptileTrainer(inner_steps={self.inner_steps}) needs training "
                f"elements {layout} with a static T and k = {self.inner_steps}; got x of "
                f"shape {first.shape}. The loop over the T tasks is unrolled: batch the "
                "tasks with drop_remainder=True (NumPy input: a number of elements that is "
                "a multiple of batch_size), or use stack_axis=1 ([B, T, k, ...]: Keras "
                "batches and splits B, T stays static)."
            )
        return [
            [self._pick((x, y, sample_weight), t, i) for i in range(self.inner_steps)]
            for t in range(tasks)
        ]

    def example_batch(self, x, y=None, sample_weight=None):
        self._check_rank(x, ["T", f"k={self.inner_steps}"])
        return self._pick((x, y, sample_weight), 0, 0)

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        tasks = self._tasks(x, y, sample_weight)
        loss_scale = self.loss_scale()
        phi = F.current_params(self.model)
        state = F.current_state(self.model)
        variables = self.model.trainable_variables
        ends, losses, y_pred = [], [], None
        for batches in tasks:
            r = R.inner_loop(
                self.loss_fn(loss_scale=loss_scale, training=self.inner_training),
                phi,
                state,
                batches,
                self.inner_optimizer,
                variables,
                loss_scale=loss_scale,
            )
            ends.append(r.params)
            losses += r.losses
            state, y_pred = r.state, r.y_pred
        delta = R.mean_reptile_gradient(phi, ends)
        gradients = F.replica_share([d * ops.cast(loss_scale, d.dtype) for d in delta])
        loss = _mean_loss(losses, loss_scale)
        return self.finish_step(tasks[-1][-1], y_pred, loss, new_state=state, gradients=gradients)
