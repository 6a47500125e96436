"""Guided learning (Lichtarge et al.): learn the learning-rate scale and beta_1 online.

Two entry points share one implementation of the greedy step:

* `GuidedTrainer(model, guidance_data, ...)`: a `keras.Model` wrapper for `compile` + `fit`.
* `GuidedHyperparameters`: the learned raw values, the meta-optimizer state and the step
  itself (`GuidedHyperparameters.train_step`) for a custom training loop.

See `tf_metaalign.algorithms.guided` for the maths and docs/guided.md for usage.
"""
from __future__ import annotations

import logging
import numbers
from typing import Mapping

import keras
import numpy as np
import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign import optimizers as opt_lib
from tf_metaalign.algorithms import guided as alg
from tf_metaalign.optimizers import base as opt_base
from tf_metaalign.trainers.base import MetaTrainer
from tf_metaalign.trainers.pipeline import Preprocessed, preprocess_data

DEFAULT_HYPERPARAMETERS = ("learning_rate", "beta_1")
DEFAULT_META_LEARNING_RATE = 3e-5
#: hyperparameter names accepted as another name for the optimizer's own (SGD's momentum
#: is its first-moment coefficient, the paper's beta_1).
ALIASES = {"beta_1": ("momentum",)}


def supported_optimizers():
    """Names of the optimizers whose update can be differentiated (tf_metaalign.optimizers)."""
    names = []
    for name in opt_lib.__all__:
        obj = getattr(opt_lib, name)
        if isinstance(obj, type) and issubclass(obj, opt_base.BaseOptimizer) and (
            obj is not opt_base.BaseOptimizer
        ):
            names.append(name)
    return sorted(names)


def _unsupported_optimizer_error(optimizer, context="GuidedTrainer"):
    return ValueError(
        f"{context} differentiates through the optimizer's update, so the optimizer must be "
        f"one of tf_metaalign.optimizers: {', '.join(supported_optimizers())} (each has a pure "
        f"update rule); got {type(optimizer).__module__}.{type(optimizer).__name__}. "
        "Keras's built-in optimizers are not differentiable here: replace "
        "keras.optimizers.Adam(...) by tf_metaalign.optimizers.Adam(...)."
    )


def check_optimizer(optimizer, context="GuidedTrainer"):
    """Raises unless `optimizer` is a supported, differentiable tf_metaalign optimizer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"{context} does not support LossScaleOptimizer (mixed_float16): train in float32 "
            "or bfloat16 (mixed_bfloat16 needs no loss scaling)."
        )
    if not isinstance(optimizer, opt_base.BaseOptimizer):
        raise _unsupported_optimizer_error(optimizer, context)
    for attr in ("clipnorm", "global_clipnorm", "clipvalue"):
        if getattr(optimizer, attr, None) is not None:
            raise ValueError(
                f"{context}: the optimizer's `{attr}` clips each replica's gradient before the "
                "all-reduce, which the differentiated update cannot reproduce; use the "
                "optimizer's `aggregated_clipnorm` instead."
            )
    if getattr(optimizer, "weight_decay", None):
        raise ValueError(
            f"{context}: Keras's generic `weight_decay` argument is applied outside the "
            "optimizer's rule; use AdamWeightDecay/Lamb/Adafactor's `weight_decay_rate`."
        )
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps not in (None, 1):
        raise ValueError(
            f"{context} does not support gradient_accumulation_steps={steps}: the hypergradient "
            "is taken through every optimizer update."
        )


def resolve_hyperparameters(optimizer, names, explicit=True):
    """Maps requested names to the optimizer's hyperparameter names.

    Returns a dict requested name -> optimizer name ("learning_rate" -> "learning_rate",
    "beta_1" -> "beta_1", or "momentum" for SGD with momentum). An unknown name raises
    an error listing the optimizer's differentiable hyperparameters; with
    `explicit=False` (the default names) a name the optimizer lacks is dropped.
    """
    available = tuple(getattr(optimizer, "differentiable_hyperparameters", ("learning_rate",)))
    resolved = {}
    for name in names:
        candidates = (name,) + ALIASES.get(name, ())
        match = next((c for c in candidates if c in available), None)
        if match is None:
            if not explicit:
                continue
            raise ValueError(
                f"Unknown hyperparameter {name!r} for {type(optimizer).__name__}: this optimizer "
                f"can learn {list(available)}"
                + (
                    " (Adafactor learns beta_1 only when constructed with beta_1 set, e.g. 0.0)"
                    if isinstance(optimizer, opt_lib.Adafactor) and name == "beta_1"
                    else ""
                )
                + "."
            )
        if match in resolved.values():
            raise ValueError(f"`hyperparameters` names {match!r} twice ({names}).")
        resolved[name] = match
    if not resolved:
        raise ValueError("`hyperparameters` is empty: name at least one hyperparameter to learn.")
    return resolved


def _meta_learning_rate(meta_optimizer):
    lr = getattr(meta_optimizer, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr):
        return lr
    return float(keras.ops.convert_to_numpy(lr))


class LastValue(keras.metrics.Metric):
    """A metric that reports the last value it was given (identical on every replica).

    It is not reset between epochs, so History holds each epoch's last value and the
    batch-level logs (TensorBoard `update_freq="batch"`) each step's value.
    """

    def __init__(self, name, dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self.last = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, aggregation="mean", name="last"
        )

    def update_state(self, value, apply=True):
        value = tf.cast(value, self.dtype)
        if apply is not True:
            value = tf.where(apply, value, tf.convert_to_tensor(self.last.value))
        self.last.assign(value)

    def result(self):
        return tf.convert_to_tensor(self.last.value)

    def reset_state(self):
        pass


@keras.saving.register_keras_serializable(package="tf_metaalign")
class GuidedHyperparameters(keras.layers.Layer):
    """Learned raw hyperparameters, their meta-optimizer state, and the greedy step.

    Variables (non-trainable, float64 raw values, "only_first_replica" aggregation, saved
    with whatever model tracks this layer): `raw_<name>`, the meta-optimizer's slots
    `meta_<name>_<slot>`, `guided_steps` (hypergradient steps taken), `steps` (training
    steps), `nonfinite_hypergrads` (cumulative count of sanitised hypergradients) and
    `initialized`.

    For a custom loop::

        hyper = GuidedHyperparameters(("learning_rate", "beta_1"))   # in strategy scope
        optimizer = tf_metaalign.optimizers.Lamb(1e-3)
        optimizer.build(model.trainable_variables)
        hyper.bind(optimizer)
        train_loss = functional.make_loss_fn(model, loss, training=True)
        guide_loss = functional.make_loss_fn(model, loss, training=False)

        @tf.function
        def step(batch, guidance_batch):
            return hyper.train_step(model, optimizer, train_loss, guide_loss, batch, guidance_batch)

    `train_step` applies the update to `model` (committing the update computed with the
    tangents, see `reuse_lookahead`, or with `optimizer.apply_gradients`) and updates the
    raw values; it returns a dict with "loss" (per-replica units), "y_pred",
    "new_state" and "logs" (see `GuidedTrainer`). Under a strategy call it inside
    `strategy.run`; each replica passes its own shard of the guidance batch with
    `guidance_weight = n_shard * replicas / n_guidance` (1 for equal shards).

    Args:
      hyperparameters: names to learn; None = ("learning_rate", "beta_1"), dropping
        beta_1 for an optimizer without one. "beta_1" also names SGD's momentum.
      meta_optimizer: a tf_metaalign optimizer whose rule and learning rate update the raw
        values (its variables are not used; the state lives here). Default: Adam(3e-5).
      guidance_every: take a hypergradient step every this many training steps.
      reuse_lookahead: commit this step's update as computed with the tangents (pass 1
        of `algorithms.guided.hypergradients` computes exactly theta_{t+1} and the new
        slots) instead of recomputing it in `optimizer.apply_gradients`; the guidance
        pass then reads the updated variables, so no separate copy of theta_{t+1}
        exists. Used with `guidance_every=1` and no EMA (any number of replicas: each
        assigns its copy, as `apply_gradients` does after its all-reduce); otherwise
        `apply_gradients`. The committed update equals the recomputed one to within an
        ulp (the compiler may fuse a multiply-subtract differently); False makes
        meta-lr 0 bit-identical to `fit`.
    """

    def __init__(self, hyperparameters=None, meta_optimizer=None, guidance_every=1,
                 reuse_lookahead=True, **kwargs):
        super().__init__(**kwargs)
        self.explicit_names = hyperparameters is not None
        if hyperparameters is None:
            hyperparameters = DEFAULT_HYPERPARAMETERS
        if isinstance(hyperparameters, str):
            hyperparameters = (hyperparameters,)
        if not isinstance(hyperparameters, (list, tuple)) or not all(
            isinstance(n, str) for n in hyperparameters
        ):
            raise ValueError(
                "`hyperparameters` must be a tuple of names such as ('learning_rate', 'beta_1'); "
                f"got {hyperparameters!r}."
            )
        if not hyperparameters:
            raise ValueError("`hyperparameters` is empty: name at least one hyperparameter to learn.")
        if len(set(hyperparameters)) != len(hyperparameters):
            raise ValueError(f"`hyperparameters` has duplicates: {hyperparameters!r}.")
        if (
            isinstance(guidance_every, bool)
            or not isinstance(guidance_every, numbers.Integral)
            or guidance_every < 1
        ):
            raise ValueError(f"`guidance_every` must be an integer >= 1; got {guidance_every!r}.")
        if meta_optimizer is None:
            meta_optimizer = opt_lib.Adam(DEFAULT_META_LEARNING_RATE)
        if not isinstance(meta_optimizer, opt_base.BaseOptimizer):
            raise ValueError(
                "`meta_optimizer` must be one of tf_metaalign.optimizers "
                f"({', '.join(supported_optimizers())}), used for its pure rule and learning "
                f"rate; got {type(meta_optimizer).__name__}."
            )
        if not isinstance(reuse_lookahead, bool):
            raise ValueError(f"`reuse_lookahead` must be True or False; got {reuse_lookahead!r}.")
        self.names = tuple(hyperparameters)
        self.guidance_every = int(guidance_every)
        self.reuse_lookahead = reuse_lookahead
        self.meta_optimizer = meta_optimizer
        self.meta_rule = meta_optimizer.rule
        self.meta_learning_rate = _meta_learning_rate(meta_optimizer)
        self.active = {}  # requested name -> optimizer hyperparameter name (after bind)
        self._bound_optimizer = None

        def state(name, dtype, shape=()):
            return self.add_weight(
                name=name, shape=shape, dtype=dtype, initializer="zeros",
                trainable=False, aggregation="only_first_replica",
            )

        self.raw = {n: state(f"raw_{n}", "float64") for n in self.names}
        self.meta_slots = {}
        for n in self.names:
            shapes = self.meta_rule.slot_shapes((), self.meta_rule.default_options(()))
            self.meta_slots[n] = {
                s: state(f"meta_{n}_{s}", "float64", shape) for s, shape in shapes.items()
            }
        self.guided_steps = state("guided_steps", "int64")
        self.steps = state("steps", "int64")
        self.nonfinite_hypergrads = state("nonfinite_hypergrads", "int64")
        self.initialized = state("initialized", "int64")
        self.built = True

    # ------------------------------------------------------------------------ setup

    def bind(self, optimizer, context="GuidedTrainer"):
        """Validates `optimizer`, resolves the names and sets the initial raw values.

        Initial values (only on first bind; a restored checkpoint keeps its values): the
        learning-rate scale 1 (raw 0); a coefficient at the optimizer's configured value,
        clipped to [0.01, 1 - 1e-5] (a configured 0, e.g. Adafactor beta_1=0.0, starts at
        0.01 since sigmoid(raw) = 0 has no gradient).
        """
        check_optimizer(optimizer, context)
        self.active = resolve_hyperparameters(optimizer, self.names, explicit=self.explicit_names)
        self._bound_optimizer = optimizer
        if int(self.initialized.numpy()) == 0:
            for name, key in self.active.items():
                self.raw[name].assign(alg.initial_raw(key, optimizer.rule.defaults.get(key)))
            self.initialized.assign(1)
        return self.active

    def logged_names(self):
        names = ["learning_rate_scale", "effective_learning_rate"]
        names += [n for n in self.active if n != "learning_rate"]
        names += [f"hypergrad_{n}" for n in self.active]
        names += ["guidance_loss", "nonfinite_hypergrads"]
        return names

    def values(self):
        """name -> current learned value (learning_rate: the scale), float64 tensors."""
        return {n: alg.activate(k, tf.convert_to_tensor(self.raw[n].value)) for n, k in self.active.items()}

    # --------------------------------------------------------------------- the step

    def _optimizer_variable(self, optimizer, key):
        if key == "learning_rate":
            return optimizer.learning_rate_scale
        variables = optimizer.hyperparameter_variables
        if key not in variables:
            raise ValueError(
                f"{type(optimizer).__name__} keeps no variable for {key!r} (it has "
                f"{sorted(variables)}), so a learned value cannot be applied."
            )
        return variables[key]

    def train_step(
        self,
        model,
        optimizer,
        train_loss_fn,
        guide_loss_fn,
        batch,
        guidance_batch,
        guidance_weight=None,
    ):
        """One greedy guided step (see the class doc). Call in a replica context."""
        if optimizer is not self._bound_optimizer:
            raise ValueError(
                "GuidedHyperparameters.train_step: call `bind(optimizer)` with this optimizer first."
            )
        if not optimizer.built:
            raise ValueError(
                "The optimizer must be built before the guided step: call "
                "`optimizer.build(model.trainable_variables)` first."
            )
        variables = list(model.trainable_variables)
        every = self.guidance_every
        if every == 1:
            apply = tf.constant(True)
        else:
            apply = tf.equal(tf.math.floormod(tf.convert_to_tensor(self.steps.value), every), 0)

        params = F.current_params(model)
        state = F.current_state(model)
        loss, g_local, (new_state, y_pred) = F.value_and_grad(train_loss_fn, params, state, batch)
        grads = F.all_reduce_sum(g_local)
        if getattr(optimizer, "aggregated_clipnorm", None) is not None:
            grads, _ = tf.clip_by_global_norm(grads, optimizer.aggregated_clipnorm)

        names = list(self.active)
        keys = [self.active[n] for n in names]
        raw = {n: tf.convert_to_tensor(self.raw[n].value) for n in names}
        base = optimizer.current_hyperparameters()
        schedule_lr = optimizer.schedule_learning_rate()
        base["learning_rate"] = schedule_lr
        step = tf.cast(optimizer.iterations + 1, tf.float32)
        slots = [
            {k: tf.convert_to_tensor(v.value) for k, v in optimizer.slots_for(var).items()}
            for var in variables
        ]
        options = [optimizer.options_for(var) for var in variables]
        rule_raw = {self.active[n]: raw[n] for n in names}
        opt_vars = {n: self._optimizer_variable(optimizer, self.active[n]) for n in names}
        rule_dtypes = {self.active[n]: opt_vars[n].dtype for n in names}

        # With a hypergradient every step, pass 1's values ARE this step's update:
        # `reuse_lookahead` assigns them (group by group) instead of recomputing the
        # update in apply_gradients (see the class doc).
        commit_lookahead = (
            self.reuse_lookahead
            and every == 1
            and not getattr(optimizer, "use_ema", False)
        )
        if commit_lookahead:

            def commit(i, new_value, new_slots):
                return optimizer.assign_variable_update(variables[i], new_value, new_slots)
        else:
            commit = None

        def compute():
            result = alg.hypergradients(
                guide_loss_fn, optimizer.rule, grads, params, slots, options, base, rule_raw,
                step, new_state, guidance_batch, guidance_weight=guidance_weight,
                hparam_dtype=rule_dtypes, commit=commit,
            )
            return (
                [result.hypergradients[k] for k in keys],
                tf.cast(result.guidance_loss, tf.float32),
            )

        if every == 1:
            h_local, loss_local = compute()
        else:
            h_local, loss_local = tf.cond(
                apply,
                compute,
                lambda: ([tf.zeros((), tf.float64) for _ in keys], tf.zeros((), tf.float32)),
            )
        h, guidance_loss, n_bad = alg.reduce_and_sanitize(dict(zip(names, h_local)), loss_local)

        # Meta-optimizer step on the raw values (identical on every replica).
        meta_step = tf.cast(self.guided_steps + 1, tf.float64)
        meta_lr = self.meta_learning_rate
        if callable(meta_lr):
            meta_lr = meta_lr(tf.convert_to_tensor(self.guided_steps.value))
        meta_hparams = {"learning_rate": tf.cast(meta_lr, tf.float64)}
        meta_slots = {
            n: {k: tf.convert_to_tensor(v.value) for k, v in self.meta_slots[n].items()}
            for n in names
        }
        updated = alg.meta_update(self.meta_rule, raw, meta_slots, h, meta_hparams, meta_step)

        # The real update, with the hyperparameters of this step (lambda_t).
        values = {n: alg.activate(self.active[n], raw[n]) for n in names}
        for n in names:
            opt_vars[n].assign(tf.cast(values[n], opt_vars[n].dtype))
        F.assign_state(model, new_state)
        if commit_lookahead:
            optimizer.iterations.assign_add(1)  # the variables were assigned in pass 1
        else:
            optimizer.apply_gradients(zip(g_local, variables))

        for n in names:
            new_raw, new_slots = updated[n]
            self.raw[n].assign(tf.where(apply, new_raw, raw[n]))
            for k, var in self.meta_slots[n].items():
                var.assign(tf.where(apply, new_slots[k], meta_slots[n][k]))
        self.guided_steps.assign_add(tf.cast(apply, tf.int64))
        self.steps.assign_add(1)
        self.nonfinite_hypergrads.assign_add(tf.where(apply, n_bad, tf.zeros_like(n_bad)))

        scale = tf.convert_to_tensor(optimizer.learning_rate_scale.value)
        if "learning_rate" in self.active.values():
            scale = tf.cast(values[names[keys.index("learning_rate")]], tf.float32)
        logs = {
            "learning_rate_scale": (scale, True),
            "effective_learning_rate": (schedule_lr * scale, True),
            "guidance_loss": (guidance_loss, apply),
            "nonfinite_hypergrads": (
                tf.convert_to_tensor(self.nonfinite_hypergrads.value), True,
            ),
        }
        for n in names:
            if n != "learning_rate":
                logs[n] = (tf.cast(values[n], tf.float32), True)
            logs[f"hypergrad_{n}"] = (h[n], apply)
        return {
            "loss": loss,
            "y_pred": y_pred,
            "new_state": new_state,
            "guidance_applied": apply,
            "logs": logs,
        }

    def get_config(self):
        config = super().get_config()
        config.update(
            hyperparameters=list(self.names) if self.explicit_names else None,
            meta_optimizer=keras.optimizers.serialize(self.meta_optimizer),
            guidance_every=self.guidance_every,
            reuse_lookahead=self.reuse_lookahead,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # An option of the earlier tape-based pass 3, saved by files made before forward mode.
        config.pop("memory_efficient", None)
        config["meta_optimizer"] = keras.optimizers.deserialize(config["meta_optimizer"])
        return cls(**config)


# ----------------------------------------------------------------------------- data


def split_guidance_batch(dataset: tf.data.Dataset, num_batches: int = 1):
    """Split held-out guidance data off the front of a batched training dataset.

    Returns `(guidance, rest)`: with `num_batches=1` the first batch as a tuple of
    tensors, else a `tf.data.Dataset` of the first `num_batches` batches; `rest` is
    `dataset.skip(num_batches)` (those batches are never trained on).
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset; got {type(dataset).__name__}.")
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"`num_batches` must be an integer >= 1; got {num_batches!r}.")
    head = list(dataset.take(num_batches))
    if not head:
        raise ValueError("split_guidance_batch: `dataset` is empty; there is no batch to hold out.")
    rest = dataset.skip(num_batches)
    if num_batches == 1:
        return head[0], rest
    return tf.data.Dataset.from_tensor_slices(_stack(head)), rest


def _encode_array(t):
    """A tensor as JSON-able config (values, shape, dtype)."""
    a = np.asarray(t)
    return {"values": a.ravel().tolist(), "shape": list(a.shape), "dtype": a.dtype.name}


def _decode_array(d):
    return np.asarray(d["values"], dtype=d["dtype"]).reshape(d["shape"])


def _stack(batches):
    return tf.nest.map_structure(lambda *t: tf.stack(t), *batches)


def _as_batch(element, arg="guidance_data"):
    if isinstance(element, dict):
        raise ValueError(f"`{arg}` elements must be (x, y) or (x, y, sample_weight) tuples, not a dict.")
    if not isinstance(element, (tuple, list)) or len(element) not in (2, 3):
        raise ValueError(
            f"`{arg}` must be a batch (x, y) / (x, y, sample_weight) or a tf.data.Dataset of "
            f"such batches; got {type(element).__name__}"
            + (f" of length {len(element)}" if isinstance(element, (tuple, list)) else "")
            + "."
        )
    return tuple(tf.nest.map_structure(tf.convert_to_tensor, tuple(element)))


class GuidanceData:
    """Held-out guidance batches, stacked so a step picks one by index (cycled).

    A fixed batch is one batch; a `tf.data.Dataset` is read once, at most `max_batches`
    batches (an infinite or longer dataset is truncated, with a warning), all of the same
    shapes (a smaller final batch is dropped). Under a strategy each replica evaluates a
    contiguous shard of the chosen batch, weighted so the total equals one replica's value.
    Not tracked by Keras (plain python object holding constant tensors).
    """

    def __init__(self, data, max_batches=64):
        if isinstance(data, tf.data.Dataset):
            batches = [_as_batch(b) for b in data.take(max_batches + 1)]
            if len(batches) > max_batches:
                logging.warning(
                    "guidance_data: using the first %d batches of the dataset (max_guidance_batches).",
                    max_batches,
                )
                batches = batches[:max_batches]
            if not batches:
                raise ValueError("`guidance_data` is an empty dataset: give at least one batch.")
        else:
            batches = [_as_batch(data)]
        shapes = [tuple(t.shape for t in tf.nest.flatten(b)) for b in batches]
        if len(batches) > 1 and shapes[-1] != shapes[0]:
            batches, shapes = batches[:-1], shapes[:-1]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                "`guidance_data` batches must all have the same shapes (use drop_remainder=True "
                "and padded_batch with fixed padded_shapes)."
            )
        n = F.batch_size(batches[0][0])
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"`guidance_data` batches must hold at least one example; got {n}.")
        self.batch_size = n
        self.num_batches = len(batches)
        self.has_sample_weight = len(batches[0]) == 3
        self.stacked = _stack(batches)

    def shard(self, index):
        """This replica's part of batch `index` and its weight (see the class doc)."""
        batch = tf.nest.map_structure(lambda t: tf.gather(t, index), self.stacked)
        replicas = F.num_replicas()
        if replicas == 1:
            return batch, None
        if self.batch_size < replicas:
            raise ValueError(
                f"The guidance batch has {self.batch_size} examples, fewer than the "
                f"{replicas} replicas: use a guidance batch of at least {replicas}."
            )
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        start, end = alg.guidance_shard_bounds(self.batch_size, rid, replicas)
        shard = tf.nest.map_structure(lambda t: t[start:end], batch)
        weight = tf.cast((end - start) * replicas, tf.float32) / float(self.batch_size)
        return shard, weight

    def batches(self):
        return [
            tf.nest.map_structure(lambda t: t[i].numpy(), self.stacked)
            for i in range(self.num_batches)
        ]


# -------------------------------------------------------------------------- trainer


@keras.saving.register_keras_serializable(package="tf_metaalign")
class GuidedTrainer(MetaTrainer):
    """Train `model` while learning its optimizer's learning-rate scale and beta_1.

    Each step t (see `tf_metaalign.algorithms.guided`): the training gradient g_t; the
    hypergradient h_t = d L_guide(theta_{t+1}) / d raw_lambda_t through one update of the
    compiled optimizer, with L_guide the compiled loss (plus the model's own losses) on a
    held-out guidance batch evaluated with `training=False` (no dropout); the model update
    theta_{t+1} computed with lambda_t (via `optimizer.apply_gradients`); then
    raw_lambda_{t+1} = meta_optimizer(raw_lambda_t, h_t). Non-finite h are sanitised as the
    reference does (NaN -> 0, +-inf -> +-10) and counted.

    Args:
      model: the Keras model to train (`trainer.model`).
      guidance_data: a held-out batch `(x, y)` / `(x, y, sample_weight)` (numpy or
        tensors), or a finite `tf.data.Dataset` of such batches (read once, at most
        `max_guidance_batches`, cycled one batch per hypergradient step). See
        `split_guidance_batch` to hold out the first batch of a training dataset. For a
        keras-hub task with a preprocessor, raw data (e.g. strings) is preprocessed by the
        task, as `fit`'s is (`tf_metaalign.trainers.pipeline`).
      hyperparameters: what to learn; default ("learning_rate", "beta_1") (beta_1 dropped
        when the optimizer has none). "learning_rate" learns a scale exp(raw) (starting at
        1) of the optimizer's schedule; "beta_1" (SGD: its momentum) is sigmoid(raw),
        starting at the configured value. Other names in the optimizer's
        `differentiable_hyperparameters` (beta_2, ...) are learned through a sigmoid too.
      meta_optimizer: a tf_metaalign optimizer (its rule and learning rate), default
        `tf_metaalign.optimizers.Adam(3e-5)` as in the paper.
      guidance_every: take a hypergradient step every this many training steps.
      max_guidance_batches: how many batches of a guidance dataset to keep.
      reuse_lookahead: see `GuidedHyperparameters` (True, the default: commit the update
        computed for the hypergradient, one optimizer update fewer per step; False:
        recompute it in `apply_gradients`, bit-identical to `fit` at meta learning rate 0).

    Compile with one of `tf_metaalign.optimizers` (SGD, Adam, AdamWeightDecay, Lamb,
    Adafactor). Logs, per step (batch-level logs, TensorBoard `update_freq="batch"`) and
    per epoch (History: the epoch's last value): `learning_rate_scale`,
    `effective_learning_rate`, the learned values (e.g. `beta_1`), `hypergrad_<name>`
    (the sanitised hypergradient w.r.t. the raw value), `guidance_loss` (at theta_{t+1})
    and `nonfinite_hypergrads` (cumulative count).
    """

    def __init__(
        self,
        model: keras.Model,
        guidance_data,
        hyperparameters=None,
        meta_optimizer=None,
        guidance_every: int = 1,
        max_guidance_batches: int = 64,
        reuse_lookahead: bool = True,
        **kwargs,
    ):
        if guidance_data is None:
            raise ValueError("`guidance_data` is required: a held-out batch (x, y) or a dataset.")
        if (
            isinstance(max_guidance_batches, bool)
            or not isinstance(max_guidance_batches, int)
            or max_guidance_batches < 1
        ):
            raise ValueError(
                f"`max_guidance_batches` must be an integer >= 1; got {max_guidance_batches!r}."
            )
        # Raw guidance data for a keras-hub task goes through the task's preprocessor, as fit's does.
        guidance = GuidanceData(preprocess_data(model, guidance_data), max_guidance_batches)
        super().__init__(model, **kwargs)
        self._guidance = [guidance]  # a list hides the holder from Keras's tracking
        self.max_guidance_batches = max_guidance_batches
        self.guided = GuidedHyperparameters(
            hyperparameters, meta_optimizer, guidance_every,
            reuse_lookahead=reuse_lookahead, name="guided_hyperparameters",
        )
        all_names = (
            ["learning_rate_scale", "effective_learning_rate", "guidance_loss", "nonfinite_hypergrads"]
            + [n for n in self.guided.names if n != "learning_rate"]
            + [f"hypergrad_{n}" for n in self.guided.names]
        )
        self._guided_metrics = {n: LastValue(n) for n in all_names}

    @property
    def guidance(self) -> GuidanceData:
        return self._guidance[0]

    @property
    def metrics(self):
        active = set(self.guided.logged_names()) if self.guided.active else set()
        mine = {id(m) for m in self._guided_metrics.values()}
        out = [m for m in super().metrics if id(m) not in mine]
        return out + [m for n, m in self._guided_metrics.items() if n in active]

    def test_step(self, data):
        logs = super().test_step(data)
        return {k: v for k, v in logs.items() if k not in self._guided_metrics}

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        if isinstance(optimizer, str):
            raise _unsupported_optimizer_error(keras.optimizers.get(optimizer))
        super().compile(optimizer, *args, **kwargs)
        self.guided.bind(self.optimizer)

    def learned_values(self):
        """dict name -> current learned value (python floats; learning_rate: the scale)."""
        return {n: float(v) for n, v in self.guided.values().items()}

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._ensure_model_built(x)
        if not self.optimizer.built:
            # Keras builds optimizers lazily in apply_gradients; the guided step reads the
            # slots before that (first trace only, like Keras's own lazy build).
            self.optimizer.build(self.model.trainable_variables)
        index = tf.math.floormod(
            tf.convert_to_tensor(self.guided.guided_steps.value), self.guidance.num_batches
        )
        guidance_batch, weight = self.guidance.shard(index)
        out = self.guided.train_step(
            self.model,
            self.optimizer,
            self.loss_fn(),
            self.loss_fn(training=False),
            (x, y, sample_weight),
            guidance_batch,
            guidance_weight=weight,
        )
        self.update_loss_tracker(out["loss"], F.batch_size(x))
        for name, (value, apply) in out["logs"].items():
            self._guided_metrics[name].update_state(value, apply)
        return self.compute_metrics(x, y, out["y_pred"], sample_weight=sample_weight)

    def get_config(self):
        config = super().get_config()
        config.update(
            guidance_data={
                "num_batches": self.guidance.num_batches,
                # (x, y[, sample_weight]) with a leading batch-index axis; x may be a dict.
                "stacked": [
                    {k: _encode_array(v) for k, v in e.items()} if isinstance(e, dict)
                    else _encode_array(e)
                    for e in self.guidance.stacked
                ],
            },
            hyperparameters=list(self.guided.names) if self.guided.explicit_names else None,
            meta_optimizer=keras.optimizers.serialize(self.guided.meta_optimizer),
            guidance_every=self.guided.guidance_every,
            max_guidance_batches=self.max_guidance_batches,
            reuse_lookahead=self.guided.reuse_lookahead,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        data = config["guidance_data"]
        if isinstance(data, dict) and "stacked" in data:
            stacked = tuple(
                {k: _decode_array(v) for k, v in e.items()} if "values" not in e
                else _decode_array(e)
                for e in data["stacked"]
            )
            config["guidance_data"] = Preprocessed(  # stored after preprocessing
                tf.nest.map_structure(lambda a: a[0], stacked) if data["num_batches"] == 1
                else tf.data.Dataset.from_tensor_slices(stacked)
            )
        config.pop("memory_efficient", None)  # see GuidedHyperparameters.from_config
        config["meta_optimizer"] = keras.optimizers.deserialize(config["meta_optimizer"])
        return super().from_config(config, custom_objects=custom_objects)


__all__ = [
    "GuidanceData",
    "GuidedHyperparameters",
    "GuidedTrainer",
    "LastValue",
    "check_optimizer",
    "resolve_hyperparameters",
    "split_guidance_batch",
    "supported_optimizers",
]
