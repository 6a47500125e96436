"""The trainer contract: the base of every Keras trainer.

`trainer = SomeTrainer(model, ...)`, then `trainer.compile(optimizer, loss=..., metrics=...)`
and `trainer.fit(...)` as for any Keras model. The wrapped model is `trainer.model`; it is
never rebuilt or cloned, so after training it is the user's model, trained, and
`trainer.model.save("m.keras")` (and `trainer.save`, which saves the user's model: see
`MetaTrainer.save`) / `keras.models.load_model` give it back as itself.
`trainer.evaluate` / `predict` run the wrapped model unchanged.

What a trainer subclass writes
------------------------------
Its algorithm lives in `tf_metaalign.algorithms`; the trainer's `train_step` only

1. unpacks the batch (`self.unpack(data)`) and evaluates the loss at weights given as
   tensors with `self.loss_fn()` (the loss `fit` would use, see below);
2. calls its algorithm;
3. ends with `return self.finish_step(...)`, the one way to end a step.

`finish_step` (in this order): checks the loss is finite before anything is assigned
(a NaN never reaches the weights); assigns the model's new non-trainable state (BatchNorm
statistics, dropout seeds); then EITHER applies a gradient with the compiled optimizer
(`gradients=`: all-reduce, clipping, accumulation, loss scaling as in `fit`) OR commits
new weights (`new_params=`: assigned identically on every replica, no optimizer) OR runs
the algorithm's own update (`update=`, a function, e.g. guided learning's committed
update); advances the step counters; reports the loss, the diagnostics and the
compiled metrics.

Cross-step state
----------------
* `add_state_variable(name, ...)`: a checkpointed scalar or tensor of the trainer
  (counters, learned values), created in the strategy scope.
* `add_weights_copy(name)`: one variable per trainable weight of the model, initialised
  from the model's weights when the model is built (now, or when the trainer is
  built): slow weights (Sequential Reptile's phi), the initial weights an L2 distance
  is measured from. Checkpointed with the trainer.
* `EveryKSteps`: an "every k steps" schedule that owns its checkpointed counter and the
  multi-replica rule for conditional work (`cond`, i.e. `functional.replica_safe_cond`).
All are saved by `trainer.save_weights` / `BackupAndRestore` /
`keras.saving.save_model(trainer, path)` (`trainer.save` saves the user's model).

Where the weights live. Inner loops inside one `train_step` (MAML, Reptile over one
task) keep the adapted weights as tensors (`tf_metaalign.functional`, the optimizers'
`apply_on_tensors`); the model's variables always hold the weights the user
evaluates and saves. A trajectory that spans many `train_step`s (Sequential Reptile)
keeps its FAST weights in the model's variables and its SLOW weights in
`add_weights_copy` state; such a trainer restores the slow weights into the model at
the end of `fit` so that what the user evaluates and saves is the slow weights.

Loss
----
`self.loss_fn()` evaluates `trainer.model.compute_loss` (see
`tf_metaalign.functional.compute_loss`) with the trainer's compiled loss: `loss_weights`,
multi-output models and an override of `compute_loss` in the wrapped model's class
behave as in the model's own `fit`; the model's own losses (`add_loss`, regularisers)
are added as Keras adds them. `trainer.compute_loss` (used by `evaluate`) is the same.

Diagnostics
-----------
`self.add_diagnostic(name, reduction)`: one mechanism for every logged algorithm
quantity. `"mean"`: the (weighted) mean over the epoch, reset each epoch, like the
loss; `"last"`: the last value given (steps with weight 0 keep the previous value),
never reset, so History holds each epoch's last value. Diagnostics are training-only:
`evaluate` does not report them.

Resuming mid-epoch
------------------
Keras's `BackupAndRestore(save_freq=N)` saves mid-epoch but on restore restarts the
interrupted epoch from its first batch. Every trainer counts the batches done in the
current epoch (`epoch_steps`, checkpointed) and, when a `fit` restored by
`BackupAndRestore` starts, skips that many batches of the restarted epoch (reading them,
not training on them), so the resumed run sees the same batches as an uninterrupted
one. This needs the data to come in the same order on the restarted epoch (no shuffle,
or a deterministic one).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import keras
from keras import ops

from tf_metaalign import _compat, backend
from tf_metaalign import functional as F
from tf_metaalign.trainers.pipeline import PipelineDataMixin

REDUCTIONS = ("mean", "last")
_SEED_STATES = "seed_states"


# --------------------------------------------------------------------- diagnostics


class Diagnostic(keras.metrics.Metric):
    """An algorithm quantity logged with a reduction (see the module doc).

    `update_state(value, weight=1.0)`: "mean" weights the value (weight 0 leaves the
    mean unchanged); "last" keeps the previous value where `weight` is 0.
    Under a strategy the per-replica values are combined as Keras combines metrics:
    the weighted mean over replicas, and for "last" the mean of the replicas' values
    (identical values stay as they are).

    Args:
      name: the logged name.
      reduction: "mean" or "last".
      dtype: the metric's dtype.

    Example:
      >>> from tf_metaalign.trainers import Diagnostic
      >>> mean, last = Diagnostic("grad_dot"), Diagnostic("scale", reduction="last")
      >>> for value, weight in [(2.0, 1.0), (4.0, 1.0), (100.0, 0.0)]:
      ...     mean.update_state(value, weight)
      ...     last.update_state(value, weight)
      >>> float(mean.result()), float(last.result())  # weight 0: left out / kept
      (3.0, 4.0)
    """

    def __init__(self, name, reduction="mean", dtype="float32"):
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"`reduction` of diagnostic {name!r} must be one of {REDUCTIONS}; "
                f"got {reduction!r}."
            )
        super().__init__(name=name, dtype=dtype)
        self.reduction = reduction
        if reduction == "mean":
            self.total = self.add_variable(
                (), "zeros", dtype=self.dtype, aggregation="sum", name="total"
            )
            self.count = self.add_variable(
                (), "zeros", dtype=self.dtype, aggregation="sum", name="count"
            )
        else:
            self.last = self.add_variable(
                (), "zeros", dtype=self.dtype, aggregation="mean", name="last"
            )

    def update_state(self, value, weight=1.0):
        value = ops.cast(value, self.dtype)
        weight = ops.cast(weight, self.dtype)
        if self.reduction == "mean":
            self.total.assign_add(value * weight)
            self.count.assign_add(weight)
        else:
            keep = F.read_value(self.last)
            self.last.assign(ops.where(weight > 0, value, keep))

    def result(self):
        if self.reduction == "mean":
            return ops.divide_no_nan(self.total.value, self.count.value)
        return F.read_value(self.last)

    def reset_state(self):
        if self.reduction == "mean":
            self.total.assign(0.0)
            self.count.assign(0.0)
        # "last" is never reset: History keeps each epoch's last value.


# ---------------------------------------------------------------- every k steps


class EveryKSteps(keras.layers.Layer):
    """An "every k steps" schedule with its own checkpointed counter.

    `count` is the number of steps seen (`functional.counter_dtype()`, saved with whatever
    model tracks this layer, so a resumed run keeps its phase across epochs and
    `steps_per_execution`).
    `is_first()` is true on steps 0, k, 2k, ... (the first step of each period),
    `is_last()` on steps k-1, 2k-1, ... (the last: an outer update after k inner steps);
    with k = 1 both are the python constant True (no `tf.cond` at all). `cond(...)`
    runs work conditionally under the multi-replica rule of `functional.replica_safe_cond`;
    `advance()` counts the step (call it once per step, e.g. via `finish_step`).

    Args:
      k: the period (an int >= 1).
      name: the layer's name.
      **kwargs: other `keras.layers.Layer` arguments.

    Example:
      >>> from tf_metaalign.trainers import EveryKSteps
      >>> schedule = EveryKSteps(3)
      >>> steps = []
      >>> for _ in range(6):
      ...     steps.append((bool(schedule.is_first()), bool(schedule.is_last())))
      ...     _ = schedule.advance()
      >>> steps
      [(True, False), (False, False), (False, True), (True, False), (False, False), (False, True)]
    """

    def __init__(self, k, name="every_k_steps", **kwargs):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` (steps per period) must be an integer >= 1; got {k!r}.")
        super().__init__(name=name, **kwargs)
        self.k = int(k)
        self.count = self.add_weight(
            name="count",
            shape=(),
            dtype=F.counter_dtype(),
            initializer="zeros",
            trainable=False,
            aggregation="only_first_replica",
        )
        self.built = True

    def phase(self):
        return ops.mod(F.read_value(self.count), self.k)

    def is_first(self):
        if self.k == 1:
            return True
        # A JAX step compiled for one phase (backend.jax.static_schedule_flag): a Python bool.
        static = backend.static_schedule_flag(self, "first")
        return ops.equal(self.phase(), 0) if static is None else static

    def is_last(self):
        if self.k == 1:
            return True
        static = backend.static_schedule_flag(self, "last")
        return ops.equal(self.phase(), self.k - 1) if static is None else static

    def cond(self, pred, true_fn, false_fn, communicates=False, merged=None):
        """`functional.replica_safe_cond` (see there)."""
        return F.replica_safe_cond(pred, true_fn, false_fn, communicates, merged)

    def advance(self):
        return self.count.assign_add(1)

    def get_config(self):
        return {**super().get_config(), "k": self.k}


# ------------------------------------------------------------------------ trainer


class MetaTrainer(F.TrainableSelection, PipelineDataMixin, keras.Model):
    """Owns the wrapped model, the loss at given weights, state, diagnostics, the end
    of a step and mid-epoch resumption (see the module doc).

    Args:
      model: the Keras model to train; it stays itself (`trainer.model`) and saves as itself.
        The trainer's trainable set is the model's (a prompted model's `train` selection
        included: `functional.TrainableSelection`) and the trainer's own.
      **kwargs: other `keras.Model` arguments.

    Example:
      >>> from tf_metaalign.trainers import DotProdTrainer, MetaTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = DotProdTrainer(model)
      >>> isinstance(trainer, MetaTrainer), trainer.model is model
      (True, True)
    """

    # The Keras backends this trainer's train_step runs on (a trainer not yet moved to
    # JAX says so with a clear error instead of failing inside its step).
    backends = ("tensorflow",)
    # On JAX, a step whose loss is not finite assigns nothing (one lax.cond around the
    # step's assignments; fit raises after it). Measured on 2 loaded CPU cores, a 13M-weight
    # MLP at batch 32: ~1.06-1.2x Keras's fit with it, 0.97-0.98x without (the cond keeps
    # XLA from updating the state in place). `trainer.nonfinite_guard = False` trades the
    # guarantee for that speed (fit still raises one step late, the NaN then in the weights,
    # as Keras's own JAX fit with TerminateOnNaN). TensorFlow always checks (check_numerics).
    nonfinite_guard = True

    def __init__(self, model: keras.Model, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"`model` must be a keras.Model (Keras 3); got {type(model).__name__}. "
                "tf.keras 2 / tf_keras models are not supported."
            )
        backend.check_backend(type(self).__name__, type(self).backends)
        _check_no_tf_strategy_on_jax(type(self).__name__)
        super().__init__(**kwargs)
        if backend.is_tensorflow():
            import tensorflow as tf

            strategy = tf.distribute.get_strategy()
            if (
                isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                or strategy.num_replicas_in_sync > 1
            ):
                # Keras 3.15's fit fails under MultiWorkerMirroredStrategy, and under any
                # strategy of several replicas when the first batch's shards differ in
                # size (it builds by averaging them: a first batch of 11 rows on 2 replicas).
                _compat.patch_keras_multi_worker_fit()
        self.model = model
        self._diagnostics = {}
        self._active_diagnostics = None  # None: all
        self._weight_copies = {}  # name -> list of variables (None until the model is built)
        self._seed_states = None  # copies of the model's seed states (see _restore_seed_states)
        # Schedules advanced by finish_step (the trainer's own, in creation order).
        self._schedules = []
        # Batches done in the current epoch: lets a fit restored by BackupAndRestore
        # skip the batches the interrupted epoch already trained on.
        self.epoch_steps = self.add_state_variable("epoch_steps", dtype=F.counter_dtype())
        if backend.is_jax():
            # Steps whose loss was not finite (they kept their state; fit raises after).
            self.nonfinite_loss_steps = self.add_state_variable(
                "nonfinite_loss_steps", dtype="int32"
            )
        self._skip_batches = None  # set when a fit starts; read at its first step
        self._building_from_training_batch = False  # see example_batch
        if model.built:
            # fit() never calls the trainer itself; it is built when its model is.
            self._create_weight_copies()
            self.built = True

    # ------------------------------------------------------------------ Keras plumbing

    def example_batch(self, x, y=None, sample_weight=None):
        """One model batch `(x, y, sample_weight)` within a TRAINING batch.

        Keras builds a model, its compiled loss and metrics from the first training
        batch before `fit` trains (`call`, `compute_loss`, `compute_metrics` on it; under
        a strategy, XLA, or on reload); a trainer whose batches are not model batches
        (stacked `[k, B, ...]` inner batches, episodes) overrides this, e.g. to return
        the first stacked batch. `evaluate` and `predict` take ordinary model batches and
        never use it. Identity by default.
        """
        return x, y, sample_weight

    def call(self, inputs, training=None):
        if self._building_from_training_batch:
            inputs = self.example_batch(inputs)[0]
        outputs = self.model(inputs, training=training)
        if F.executing_eagerly():
            # An eager first call builds the model: now the weights copies can exist.
            self._create_weight_copies()
        return outputs

    def build(self, input_shape=None):
        # The wrapped model is built by its first call (`call` above): `model.build`
        # would mark a subclassed model built without creating its variables.
        self.built = True

    @property
    def metrics(self):
        mine = {id(m) for m in self._diagnostics.values()}
        out = [m for m in super().metrics if id(m) not in mine]
        active = self._active_diagnostics
        return out + [m for n, m in self._diagnostics.items() if active is None or n in active]

    def test_step(self, *args):
        # Training diagnostics (grad_dot, ...) are not measured by evaluate(): leave them
        # out. TensorFlow calls test_step(data); JAX test_step(state, data) -> (logs, state).
        if backend.is_jax():
            logs, state = super().test_step(*args)
            return {k: v for k, v in logs.items() if k not in self._diagnostics}, state
        logs = super().test_step(*args)
        return {k: v for k, v in logs.items() if k not in self._diagnostics}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """The wrapped model's `compute_loss` with this trainer's compiled loss (what
        `evaluate` reports; training steps use `loss_fn`, the same loss at given weights)."""
        if self._building_from_training_batch:
            x, y, sample_weight = self.example_batch(x, y, sample_weight)
        return F.compute_loss(
            self.model,
            x,
            y,
            y_pred,
            sample_weight,
            self.model.losses,
            training=training,
            loss=self._compiled_loss(),
        )

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if self._building_from_training_batch:
            x, y, sample_weight = self.example_batch(x, y, sample_weight)
        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------------- state

    def add_state_variable(self, name, shape=(), dtype="float32", initializer="zeros"):
        """A non-trainable, checkpointed variable of the trainer (call in `__init__`).

        Its aggregation is "only_first_replica": every replica computes the same update,
        and the first one's is kept.
        """
        return self.add_weight(
            name=name,
            shape=shape,
            dtype=dtype,
            initializer=initializer,
            trainable=False,
            aggregation="only_first_replica",
        )

    def add_weights_copy(self, name):
        """Register a copy of the model's trainable weights (call in `__init__`).

        The variables (one per `model.trainable_variables`, same shapes and dtypes,
        non-trainable, checkpointed) are created in the strategy scope and initialised
        from the model's current weights once the model is built: now if it is, else
        when the trainer is built (`trainer(x)` on a batch; `fit` asks for it).
        `weights_copy(name)` returns them.
        """
        if name in self._weight_copies:
            raise ValueError(f"A weights copy named {name!r} exists already.")
        self._weight_copies[name] = None
        if self.model.built:
            self._create_weight_copies()

    def weights_copy(self, name):
        """The variables of the weights copy `name` (see `add_weights_copy`)."""
        copies = self._weight_copies.get(name)
        if copies is None:
            raise ValueError(
                f"The weights copy {name!r} does not exist yet: "
                + (
                    "register it with add_weights_copy() in __init__."
                    if name not in self._weight_copies
                    else "it is created when the model is built (call the trainer or fit first)."
                )
            )
        return copies

    def _create_weight_copies(self):
        if not self.model.built:
            return
        pending = [n for n, v in self._weight_copies.items() if v is None]
        if self._seed_states is None:
            pending.append(_SEED_STATES)
        if not pending:
            return
        with self._strategy_scope(), _compat.unlocked_state(self):
            for name in pending:
                if name == _SEED_STATES:
                    sources = [self.model.non_trainable_variables[i] for i in self._seed_indices()]
                else:
                    sources = self.model.trainable_variables
                copies = [
                    self.add_weight(
                        name=f"{name}_{i}",
                        shape=v.shape,
                        dtype=v.dtype,
                        initializer=_value_initializer(v),
                        trainable=False,
                        aggregation="only_first_replica",
                    )
                    for i, v in enumerate(sources)
                ]
                if name == _SEED_STATES:
                    self._seed_states = copies
                else:
                    self._weight_copies[name] = copies

    def _strategy_scope(self):
        """The scope state variables are created in: the strategy's on TensorFlow; on JAX
        Keras's distribution lays out the variables it finds."""
        if backend.is_tensorflow():
            return self.distribute_strategy.scope()
        return contextlib.nullcontext()

    def _seed_indices(self):
        """Positions of the random-seed states among the model's non-trainable variables."""
        return [
            i for i, v in enumerate(self.model.non_trainable_variables) if _compat.is_seed_state(v)
        ]

    def load_own_variables(self, store):
        # Called for the trainer by load_weights (BackupAndRestore) and load_model.
        super().load_own_variables(store)
        self._restore_seed_states()

    def _restore_seed_states(self):
        """Keras's weights files leave out the seed states of Dropout & co.; the trainer
        checkpoints a copy (updated by finish_step) and puts it back into the model when
        its weights are loaded, so a restored run draws the masks the interrupted run
        would have drawn."""
        if not self._seed_states:
            return
        variables = self.model.non_trainable_variables
        for i, copy in zip(self._seed_indices(), self._seed_states):
            variables[i].assign(ops.copy(copy.value))  # JAX: never one buffer for two

    def every_k_steps(self, k, name):
        """A tracked `EveryKSteps(k)` advanced once per `finish_step` (call in `__init__`)."""
        schedule = EveryKSteps(k, name=name)
        self._schedules.append(schedule)
        return schedule

    # ------------------------------------------------------------------- diagnostics

    def add_diagnostic(self, name, reduction="mean"):
        """Declare a logged algorithm quantity (call in `__init__`); see the module doc."""
        if name in self._diagnostics:
            raise ValueError(f"Diagnostic {name!r} is declared twice.")
        self._diagnostics[name] = Diagnostic(name, reduction)
        return self._diagnostics[name]

    def set_active_diagnostics(self, names):
        """Report only these diagnostics (e.g. once compile() knows which apply)."""
        unknown = set(names) - set(self._diagnostics)
        if unknown:
            raise ValueError(f"Unknown diagnostics {sorted(unknown)}.")
        self._active_diagnostics = set(names)

    # ---------------------------------------------------------------- loss at weights

    def _compiled_loss(self):
        """The trainer's compiled loss, or None to use the wrapped model's own compile
        loss (a model compiled by the user and wrapped with `compile(loss=None)`)."""
        return _compat.compiled_loss(self)

    def loss_fn(self, loss_scale=None, training=True):
        """`loss_fn(params, state, batch) -> (loss, (new_state, y_pred))` for `self.model`.

        The loss `fit` would compute (compiled loss, loss weights, the model's
        `compute_loss` and own losses) in Keras's per-replica units, times `loss_scale`.
        """
        return F.make_loss_fn(
            self.model, self._compiled_loss(), training=training, loss_scale=loss_scale
        )

    def split_loss_fn(self, n_first, loss_scale=None, training=True):
        """Like `loss_fn`, but `L(b1) + L(b2)` from one pass (`functional.make_split_loss_fn`)."""
        return F.make_split_loss_fn(
            self.model, self._compiled_loss(), n_first, training=training, loss_scale=loss_scale
        )

    def loss_scale(self):
        """The optimizer's loss scale (1 unless it is a `LossScaleOptimizer`)."""
        return self.optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32"))

    def model_compute_dtype(self):
        """The least precise compute dtype among the layers that hold weights.

        Not `model.dtype_policy`: a container (Sequential, functional) keeps the global
        policy of when it was built, while its layers may compute in float64 or float16.
        """
        dtypes = {
            layer.dtype_policy.compute_dtype
            for layer in _compat.flatten_layers(self.model)
            if layer.weights
            and "float" in keras.backend.standardize_dtype(layer.dtype_policy.compute_dtype)
        }
        if not dtypes:
            return self.model.dtype_policy.compute_dtype
        return max(dtypes, key=F.machine_epsilon)

    # ------------------------------------------------------------------ the step

    def unpack(self, data):
        """`(x, y, sample_weight)` of a batch; builds an unbuilt model on first use."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not self.model.built:
            # A subclassed model without Input shapes: build it by calling it once on a
            # model batch (`example_batch`: a training batch may be stacked or episodic).
            self.model(self.example_batch(x)[0], training=False)
        return x, y, sample_weight

    def static_tasks_per_replica(self, tasks):
        """This replica's number of tasks in a batch: `tasks` (the batch's static task
        dimension) when known, else `self.tasks_per_batch` (global) over the replicas. For
        trainers that unroll a loop over the tasks of a batch (MAML, prompt FOMAML /
        Reptile), which needs the number at trace time."""
        if tasks is not None:
            return tasks
        if getattr(self, "tasks_per_batch", None) is None:
            raise ValueError(
                f"{type(self).__name__} unrolls its loop over the tasks of a batch, so their "
                "number must be static: batch the task dataset with drop_remainder=True, or "
                "give `tasks_per_batch` (the global number of tasks per batch)."
            )
        replicas = F.num_replicas()
        if self.tasks_per_batch % replicas:
            raise ValueError(
                f"`tasks_per_batch`={self.tasks_per_batch} is not a multiple of "
                f"the {replicas} replicas."
            )
        return self.tasks_per_batch // replicas

    def check_finite_loss(self, loss, where="the training loss"):
        """Stop training with a clear error when `loss` is NaN or infinite.

        Skipped under a `LossScaleOptimizer`, whose job is to skip such steps (float16
        overflow is expected there). Returns `loss`, to be used downstream so that the
        check runs before the update.
        """
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return loss
        message = (
            f"{type(self).__name__}: {where} is not finite (NaN or inf). Lower the "
            "learning rate, check the data for NaN/inf, or use keras.callbacks."
            "TerminateOnNaN to stop without an error"
        )
        if backend.is_jax():
            # On JAX a step cannot raise: finish_step assigns nothing when the loss is not
            # finite, and fit raises this error after the step (backend.jax).
            from tf_metaalign.backend import jax as jax_backend

            self._loss_is_finite = jax_backend.check_finite_loss(self, loss, message)
            return loss
        import tensorflow as tf

        return tf.debugging.check_numerics(loss, message)

    def finish_step(
        self,
        data,
        y_pred,
        loss,
        *,
        new_state=None,
        gradients=None,
        new_params=None,
        update=None,
        diagnostics=None,
        where="the training loss",
    ):
        """The one way to end a `train_step`; returns its logs.

        Args:
          data: the batch `train_step` received (for the compiled metrics).
          y_pred: the model's outputs on the batch (compiled metrics).
          loss: the step's loss in Keras's per-replica units (as `loss_fn` returns it,
            divided by any loss scale): checked finite before anything is assigned,
            then logged as "loss" (independent of the replica count).
          new_state: the model's new non-trainable state (or None).
          gradients: apply these with the compiled optimizer (per-replica, as for
            `optimizer.apply_gradients` in `fit`), OR
          new_params: commit these weights to the model (identical on every replica;
            the optimizer is not used), OR
          update: a function run after the check and the state assignment that
            performs the algorithm's own update; it may return a dict of diagnostics.
          diagnostics: name -> value or (value, weight), see `add_diagnostic`.
        """
        given = [a is not None for a in (gradients, new_params, update)]
        if sum(given) > 1:
            raise ValueError("finish_step: give at most one of gradients, new_params, update.")
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if gradients is not None and not self.optimizer.built:
            # Build (create the slots) before the control-dependent block below: an XLA
            # function cannot lift variable creations that depend on a tensor.
            self.optimizer.build(self.model.trainable_variables)
        # Checked before anything is assigned, so a NaN never reaches the weights.
        self._loss_is_finite = True
        loss = self.check_finite_loss(loss, where)
        diagnostics = dict(diagnostics or {})

        def assign():
            if new_state is not None:
                F.assign_state(self.model, new_state)
                for i, copy in zip(self._seed_indices(), self._seed_states or []):
                    copy.assign(new_state[i])
            updated = {}
            if gradients is not None:
                apply_gradients(self.optimizer, gradients, self.model.trainable_variables)
            elif new_params is not None:
                commit_weights(self.model.trainable_variables, new_params)
            elif update is not None:
                updated = dict(update() or {})
            for schedule in self._schedules:
                schedule.advance()
            self.epoch_steps.assign_add(1)
            return updated

        if backend.is_jax() and self.nonfinite_guard:
            # One lax.cond on the loss's finiteness (the TensorFlow step raises instead).
            from tf_metaalign.backend import jax as jax_backend

            diagnostics.update(jax_backend.guarded(self._loss_is_finite, assign) or {})
        elif backend.is_jax():
            diagnostics.update(assign())
        else:
            with _after(loss):
                diagnostics.update(assign())
        _compat.loss_tracker(self).update_state(
            F.unscale_loss_for_distribution(loss), sample_weight=F.batch_size(x)
        )
        for name, value in diagnostics.items():
            value, weight = value if isinstance(value, tuple) else (value, 1.0)
            self._diagnostics[name].update_state(value, weight)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------- fit and mid-epoch resume

    def fit(self, *args, **kwargs):
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        if self.model.built:
            self._create_weight_copies()
        elif any(v is None for v in self._weight_copies.values()):
            raise ValueError(
                f"{type(self).__name__} keeps a copy of the model's weights, so the model must "
                "be built before fit(): give it Input shapes, or call the trainer (or the "
                "model) once on a batch, e.g. `trainer(x[:1])`."
            )
        # A fresh fit starts its first epoch at its first batch; a BackupAndRestore
        # restore (in on_train_begin) brings back the count of the interrupted epoch.
        self.epoch_steps.assign(0)
        self._skip_batches = None
        bound.arguments["callbacks"] = [_EpochStepsCallback(self)] + callbacks
        self._building_from_training_batch = True  # until the first step (example_batch)
        try:
            history = super().fit(*bound.args[1:], **bound.kwargs)
        finally:
            self._building_from_training_batch = False
        if backend.is_jax():
            from tf_metaalign.backend import jax as jax_backend

            jax_backend.raise_if_nonfinite(self)
        return history

    def make_train_function(self, force=False):
        if backend.is_jax():
            from tf_metaalign.backend import jax as jax_backend

            return jax_backend.make_train_function(self, force)
        train_function = super().make_train_function(force) or self.train_function
        if getattr(train_function, "_skips_restored_batches", False):
            return train_function

        def function(iterator):
            if self._skip_batches is None:
                # First step of this fit: after BackupAndRestore's on_train_begin.
                self._building_from_training_batch = False
                self._skip_batches = int(self.epoch_steps.numpy())
                if self._skip_batches:
                    logging.info(
                        "Resuming mid-epoch: skipping %d batches already trained on.",
                        self._skip_batches,
                    )
            if self._skip_batches >= self.steps_per_execution:
                for _ in range(self.steps_per_execution):
                    next(iterator)
                self._skip_batches -= self.steps_per_execution
                # The compiled metrics are built by the first trained step.
                built = all(getattr(m, "built", True) for m in self.metrics)
                return self.get_metrics_result() if built else {}
            while self._skip_batches > 0:  # a partial execution (not with whole saves)
                next(iterator)
                self._skip_batches -= 1
            # A trace registers the optimizer's all-reduce of the (dense) gradients as a
            # custom gradient in TensorFlow's global registry, which would keep the
            # traced graphs alive for the whole process (`_compat.released_custom_gradients`).
            with _compat.released_custom_gradients():
                return train_function(iterator)

        function._skips_restored_batches = True
        self.train_function = function
        return function

    # ------------------------------------------------------------------ compiling

    def compile(
        self,
        optimizer="rmsprop",
        loss=None,
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly=False,
        steps_per_execution=1,
        jit_compile="auto",
        auto_scale_loss=True,
    ):
        """`keras.Model.compile`; with a `loss`, the wrapped model is compiled too.

        The user's code keeps calling its own model after `trainer.fit` (`model.evaluate`,
        `model.predict`, `model.save`), so `model` is compiled with the trainer's loss,
        `loss_weights`, metrics (fresh instances of the same configuration) and the
        trainer's optimizer instance (so `model.save` keeps its slots and step). Then
        `model.evaluate(x, y)` reports what `trainer.evaluate(x, y)` reports, and
        `keras.models.load_model` gives the model back compiled, as a model trained with
        its own `fit` would be, with the optimizer's step and the slots of the model's
        variables (where the trainer trains variables of its own besides the model's, e.g.
        MAML's learned inner learning rates, `trainer.save` writes the optimizer state of
        the model's variables only; the trainer's own are in the trainer's weights: to
        resume the trainer, save its weights or the trainer itself,
        `keras.saving.save_model(trainer, path)`). With
        `loss=None` the trainer trains with the wrapped model's own compiled loss (a model
        the user compiled before wrapping it), and the model's compilation is left as the
        user made it.
        """
        super().compile(
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss,
        )
        if loss is None:
            return
        self.model.compile(
            # The trainer's optimizer (already wrapped in a LossScaleOptimizer where
            # Keras wraps one): one optimizer, so its state is saved with either model.
            optimizer=self.optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=_fresh_metrics(metrics),
            weighted_metrics=_fresh_metrics(weighted_metrics),
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=self.jit_compile,
            auto_scale_loss=False,
        )

    # ------------------------------------------------------------------ saving

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Save the USER'S MODEL (`trainer.model.save(...)`), not the trainer.

        So `keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True)` in
        `trainer.fit` writes the user's model at its best epoch, a file that
        `keras.saving.load_model` gives back as the user's model class in any process,
        without importing tf_metaalign (unless the model or its compiled optimizer or loss
        uses a class of tf_metaalign, e.g. `tf_metaalign.optimizers.Adam`, which
        `GuidedTrainer` compiles with: then import it, or `load_model(path, compile=False)`,
        which needs neither). The weights saved are the ones the user evaluates:
        `model_weights_to_save` (Sequential Reptile's slow weights phi in the middle of a
        trajectory).

        The trainer's whole state (the model's weights, the optimizer, the algorithm's
        state) is what `save_weights` / `load_weights` write and read: what
        `keras.callbacks.BackupAndRestore` and `ModelCheckpoint(save_weights_only=True)`
        call (restore such a file with `trainer.load_weights` into a trainer built the
        same way). `keras.saving.save_model(trainer, "t.keras")` saves the trainer itself
        (config, compile config and state; `load_model` then needs tf_metaalign imported).

        Args:
          filepath: where to write the `.keras` file (as `keras.Model.save`).
          overwrite: replace an existing file.
          zipped: as `keras.Model.save`.
          **kwargs: passed on to `keras.Model.save`.
        """
        with self.model_weights_to_save(), self._model_optimizer_to_save():
            return self.model.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    @contextlib.contextmanager
    def _model_optimizer_to_save(self):
        """A context in which the wrapped model's optimizer holds the trainer optimizer's
        state for the MODEL's variables only, so that the saved file reloads with its
        slots and step. Where the trainer trains variables of its own (MAML's learned inner
        learning rates, uncertainty weighting's task log-variances) the shared optimizer
        has slots for those too, and a model loaded from the file would skip the whole
        optimizer state ("Skipping variable loading for optimizer ..."): continuing with
        the loaded model's own `fit` would restart Adam's moments at zero. A copy of the
        optimizer (same class and configuration) built on the model's variables takes the
        iteration count and each model variable's slots, matched by their paths; it lives
        for the duration of the save. Where a slot has no match (an optimizer whose
        variables do not follow Keras's naming), the model keeps the shared optimizer."""
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        view = None
        if optimizer is not None and getattr(optimizer, "built", False):
            ours = [id(v) for v in self.trainable_variables]
            theirs = [id(v) for v in model.trainable_variables]
            # Equal lists: the shared optimizer is the model's own. A model variable the
            # trainer does not train (prompt-only training) has no slots to give.
            if ours != theirs and set(theirs) <= set(ours):
                view = _optimizer_state_for(optimizer, model.trainable_variables)
        if view is None:
            yield
            return
        model.optimizer = view
        try:
            yield
        finally:
            model.optimizer = optimizer

    def model_weights_to_save(self):
        """A context in which the wrapped model's variables hold the weights `save`
        writes (the weights the user evaluates). The model's own by default; a trainer
        whose model holds other weights during `fit` (Sequential Reptile's fast weights)
        puts its user-facing weights in for the duration and restores them after."""
        return contextlib.nullcontext()

    def compile_from_config(self, config):
        # Keras skips this for classes that override compile(); trainers may (to check
        # their options against the optimizer), and must still reload compiled.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self.model)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)


class EpochCounter(keras.callbacks.Callback):
    """Counts finished epochs in a checkpointed trainer variable (`epochs_done`: DWA's
    loss history, MAML's per-epoch schedules). `with_epoch_counter` puts it BEFORE the
    user's callbacks, so BackupAndRestore saves the new count with the epoch."""

    def __init__(self, variable):
        super().__init__()
        self._variable = [variable]  # a list: not tracked

    def on_epoch_end(self, epoch, logs=None):
        self._variable[0].assign_add(1)


def with_epoch_counter(args, kwargs, variable):
    """`fit`'s (args, kwargs) with an `EpochCounter(variable)` first among the callbacks
    (given by keyword or position)."""
    bound = inspect.signature(keras.Model.fit).bind(None, *args, **kwargs)
    callbacks = list(bound.arguments.get("callbacks") or [])
    bound.arguments["callbacks"] = [EpochCounter(variable)] + callbacks
    return bound.args[1:], bound.kwargs


class _EpochStepsCallback(keras.callbacks.Callback):
    """Resets the trainer's `epoch_steps` at each epoch's end, before any user callback
    (so `BackupAndRestore`'s end-of-epoch save records 0)."""

    def __init__(self, trainer):
        super().__init__()
        self._trainer = [trainer]  # a list: not tracked as a sublayer

    def on_epoch_end(self, epoch, logs=None):
        self._trainer[0].epoch_steps.assign(0)


def first_task_query_set(x, y=None, sample_weight=None):
    """The first task's query set `(query_x[0], query_y[0], query_sample_weight[0])` of a
    task batch `x = (support_x, support_y, query_x)` with a leading task dimension (MAML,
    prompt FOMAML / Reptile): a model batch, what their `example_batch` returns. Any other
    `x` is returned as it is. Missing parts stay None."""
    if not (isinstance(x, (tuple, list)) and len(x) == 3):
        return x, y, sample_weight

    def first(nest):
        return None if nest is None else keras.tree.map_structure(lambda a: a[0], nest)

    return first(x[2]), first(y), first(sample_weight)


def _fresh_metrics(metrics):
    """New metric objects of the same configuration (a metric object updated by two
    compiled models would mix their results); names and functions stay as they are."""
    if metrics is None:
        return None
    try:
        return keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(metrics))
    except Exception:  # an unregistered custom metric: share it (still correct when the
        return metrics  # two models are not evaluated at the same time)


def commit_weights(variables, values):
    """Assign `values` to `variables` on every replica (call in a replica context).

    The values must be identical on every replica (computed from all-reduced
    quantities); each replica's copy is assigned, nothing is communicated but the
    merge (`ReplicaContext.merge_call`), which is why this may not sit inside `tf.cond`
    under MirroredStrategy. Outside any strategy it is a plain assignment.

    Args:
      variables: the variables to assign.
      values: one value per variable, identical on every replica.

    Example:
      >>> from tf_metaalign.trainers import commit_weights
      >>> v = keras.Variable([0.0, 0.0])
      >>> commit_weights([v], [np.array([1.0, 2.0], "float32")])
      >>> v.numpy()
      array([1., 2.], dtype=float32)
    """
    variables, values = list(variables), list(values)
    if len(variables) != len(values):
        raise ValueError(f"commit_weights: {len(values)} values for {len(variables)} variables.")
    if F.num_replicas() == 1:
        for v, x in zip(variables, values):
            v.assign(ops.cast(x, v.dtype))
        return
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()

    def merge_fn(strategy, values):
        for v, x in zip(variables, values):
            strategy.extended.update(
                v.value,
                lambda var, x: var.assign(tf.cast(x, var.dtype)),
                args=(x,),
                group=False,
            )

    ctx.merge_call(merge_fn, args=(values,))


def _value_initializer(variable):
    """A Keras initializer that returns `variable`'s current value."""

    def initializer(shape, dtype=None):
        # A copy: on JAX two variables holding one buffer break the jitted step's
        # donation of its state ("Attempt to donate the same buffer twice").
        return ops.copy(ops.cast(F.read_value(variable), dtype or variable.dtype))

    return initializer


def apply_gradients(optimizer, gradients, variables):
    """`optimizer.apply_gradients(zip(gradients, variables))`, also inside a JAX trainer's
    stateless step (`tf_metaalign.backend.jax.apply_gradients`)."""
    if backend.is_jax():
        from tf_metaalign.backend import jax as jax_backend

        return jax_backend.apply_gradients(optimizer, gradients, variables)
    return optimizer.apply_gradients(zip(gradients, variables))


def _after(tensor):
    """Run the block after `tensor` is computed (TF: control dependencies; JAX: data flow
    orders the step)."""
    if backend.is_tensorflow():
        import tensorflow as tf

        return tf.control_dependencies([tensor])
    return contextlib.nullcontext()


def _check_no_tf_strategy_on_jax(what):
    """On JAX, a trainer built inside a `tf.distribute` strategy's scope gets a clear error."""
    if not backend.is_jax():
        return
    tf = backend.tensorflow_if_loaded()
    if tf is not None and tf.distribute.has_strategy():
        raise ValueError(
            f"{what} was created inside a tf.distribute strategy "
            f"({type(tf.distribute.get_strategy()).__name__}), but Keras runs on JAX here: "
            "tf.distribute does not drive JAX. Use keras.distribution instead, e.g. "
            "keras.distribution.set_distribution(keras.distribution.DataParallel()) "
            "before building the model (see docs/tpu.md)."
        )


def _optimizer_state_for(optimizer, variables):
    """A new optimizer of `optimizer`'s class and configuration, built on `variables`, with
    `optimizer`'s values for every variable it has (the step, the learning rate, each
    variable's slots: same paths, as Keras names slots after their variable's path); None
    if one is missing or a path is ambiguous."""
    source = {}
    for v in optimizer.variables:
        if v.path in source:
            return None
        source[v.path] = v
    view = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    view.build(variables)
    pairs = []
    for v in view.variables:
        match = source.get(v.path)
        if match is None or tuple(match.shape) != tuple(v.shape) or match.dtype != v.dtype:
            return None
        pairs.append((v, match))
    for v, match in pairs:
        v.assign(match.value)
    return view
