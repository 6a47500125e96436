"""Guided learning (Lichtarge et al.): learn the learning-rate scale and beta_1 online.

Two entry points share one implementation of the greedy step:

* `GuidedTrainer(model, guidance_data, ...)`: a `keras.Model` wrapper for `compile` + `fit`.
* `GuidedHyperparameters`: the learned raw values, the meta-optimizer state and the step
  itself (`GuidedHyperparameters.train_step`) for a custom training loop.

See `tf_metaalign.algorithms.guided` for the maths and docs/guided.md for usage.

Both backends (`GuidedTrainer.backends`): on JAX the hypergradient's tangents come from
`jax.jvp` (`algorithms.guided`), the step runs purely (`trainers.base`), and guidance
data is a batch of arrays (a `tf.data.Dataset`, `split_guidance_batch` and
`example_fingerprints` need TensorFlow). Under `keras.distribution.DataParallel` the step
sees the global batch (one replica's semantics on any number of devices; docs/guided.md
"On JAX" says what that changes).
"""

from __future__ import annotations

import logging
import numbers
import re

import keras
import numpy as np
from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F
from tf_metaalign import optimizers as opt_lib
from tf_metaalign.algorithms import guided as alg
from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import flax_reference
from tf_metaalign.optimizers.differentiable import (
    as_rule_optimizer,
    check_optimizer,
    describe_conversion,
    resolve_hyperparameters,
    supported_optimizers,
)
from tf_metaalign.trainers.base import EveryKSteps, MetaTrainer, apply_gradients
from tf_metaalign.trainers.pipeline import Preprocessed, preprocess_data

BACKEND = keras.backend.backend()

DEFAULT_HYPERPARAMETERS = ("learning_rate", "beta_1")
DEFAULT_META_LEARNING_RATE = 3e-5
#: the values of `reference`: None (this package's semantics) or the paper's own code.
REFERENCES = (None, alg.REFERENCE)


def _check_reference(reference):
    if reference not in REFERENCES:
        raise ValueError(
            f"`reference` must be None (this package's semantics) or {alg.REFERENCE!r} (the "
            f"arithmetic of the paper's JAX code); got {reference!r}."
        )
    return reference


def _tf(what):
    return backend.require_tensorflow(
        what, "on JAX, give guidance_data as a batch (x, y) of NumPy arrays."
    )


def _is_tf_dataset(data):
    tf = backend.tensorflow_if_loaded()
    return tf is not None and isinstance(data, tf.data.Dataset)


def _check_meta_gradient_clip(clip):
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not clip > 0:
        raise ValueError(f"`meta_gradient_clip` must be None or a float > 0; got {clip!r}.")
    return float(clip)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class GuidedHyperparameters(keras.layers.Layer):
    """The state of guided learning: learned raw values, meta-optimizer slots, counters.

    Variables (non-trainable, float64 raw values, "only_first_replica" aggregation, saved
    with whatever model tracks this layer): `raw_<name>`, the meta-optimizer's slots
    `meta_<name>_<slot>`, the `guidance_every` schedule's step counter
    (`schedule.count`, training steps seen), `guided_steps` (hypergradient steps taken),
    `nonfinite_hypergrads` (cumulative count of sanitised hypergradients) and
    `initialized`. The step itself is `tf_metaalign.algorithms.guided.guided_step`;
    `guided_update` runs it against a Keras model and optimizer (the trainer and a
    custom loop call the same function)::

        hyper = GuidedHyperparameters(("learning_rate", "beta_1"))   # in strategy scope
        optimizer = tf_metaalign.optimizers.Lamb(1e-3)
        optimizer.build(model.trainable_variables)
        hyper.bind(optimizer)
        train_loss = functional.make_loss_fn(model, loss, training=True)
        guide_loss = functional.make_loss_fn(model, loss, training=False)

        @tf.function
        def step(batch, guidance_batch):
            params, state = functional.current_params(model), functional.current_state(model)
            loss, grads, (new_state, _) = functional.value_and_grad(
                train_loss, params, state, batch
            )
            return guided_update(hyper, model, optimizer, guide_loss, grads, new_state,
                                 guidance_batch)

    Args:
      hyperparameters: names to learn; None = ("learning_rate", "beta_1"), dropping
        beta_1 for an optimizer without one. "beta_1" also names SGD's momentum.
      meta_optimizer: the optimizer whose rule and learning rate update the raw values
        (its variables are not used; the state lives here): a tf_metaalign optimizer or
        Keras's built-in Adam or SGD (same rule). Default: Adam(3e-5).
      guidance_every: take a hypergradient step every this many training steps.
      commit_forward_update: commit this step's update as computed in forward mode for
        the hypergradient (`algorithms.guided.hypergradients` computes exactly
        theta_{t+1} and the new slots) instead of recomputing it in
        `optimizer.apply_gradients`; the guidance pass then reads the updated
        variables, so no separate copy of theta_{t+1} exists. Used with
        `guidance_every=1`, no EMA and no loss scaling (any number of replicas: each
        assigns its copy, as `apply_gradients` does after its all-reduce); otherwise
        `apply_gradients`. The committed update equals the recomputed one to within an
        ulp (the compiler may fuse a multiply-subtract differently); False makes
        meta-lr 0 bit-identical to `fit`. (Configs saved with its former name
        `reuse_lookahead` still load.)
      reference: None (this package's semantics) or "gradient_based_tuning": the
        arithmetic of the paper's JAX code, see `GuidedTrainer` and docs/guided.md.
        Here it sets the activations and their inverse, the meta-optimizer (flax's Adam,
        `optimizers.flax_reference.FlaxAdam`; default FlaxAdam(3e-5)) and the order of
        sanitising and averaging over replicas.
      meta_gradient_clip: clip the hypergradient to [-c, c] before the meta step (the
        reference's `--use_grad_clip --grad_clip_limit`); None (default): no clipping.

    Example:
      >>> from tf_metaalign import functional, optimizers
      >>> from tf_metaalign.trainers import GuidedHyperparameters
      >>> optimizer = optimizers.SGD(0.1, momentum=0.9)
      >>> hyper = GuidedHyperparameters(meta_optimizer=optimizers.Adam(0.01))
      >>> hyper.bind(optimizer)  # SGD's momentum is its beta_1
      {'learning_rate': 'learning_rate', 'beta_1': 'momentum'}
      >>> {name: round(float(v), 4) for name, v in hyper.values().items()}
      {'learning_rate': 1.0, 'beta_1': 0.9}
    """

    def __init__(
        self,
        hyperparameters=None,
        meta_optimizer=None,
        guidance_every=1,
        commit_forward_update=True,
        reference=None,
        meta_gradient_clip=None,
        **kwargs,
    ):
        if "reuse_lookahead" in kwargs:  # its name before 0.2
            commit_forward_update = kwargs.pop("reuse_lookahead")
        super().__init__(**kwargs)
        self.reference = _check_reference(reference)
        self.meta_gradient_clip = _check_meta_gradient_clip(meta_gradient_clip)
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
            raise ValueError(
                "`hyperparameters` is empty: name at least one hyperparameter to learn."
            )
        if len(set(hyperparameters)) != len(hyperparameters):
            raise ValueError(f"`hyperparameters` has duplicates: {hyperparameters!r}.")
        if (
            isinstance(guidance_every, bool)
            or not isinstance(guidance_every, numbers.Integral)
            or guidance_every < 1
        ):
            raise ValueError(f"`guidance_every` must be an integer >= 1; got {guidance_every!r}.")
        if meta_optimizer is None:
            meta_optimizer = (
                flax_reference.FlaxAdam(DEFAULT_META_LEARNING_RATE)
                if self.reference
                else opt_lib.Adam(DEFAULT_META_LEARNING_RATE)
            )
        try:
            meta_optimizer = as_rule_optimizer(meta_optimizer)
        except ValueError as e:
            raise ValueError(f"`meta_optimizer`: {e}") from None
        if self.reference:
            # flax's Adam for an Adam (its epsilon kept: FlaxAdam's default is flax's 1e-8).
            meta_optimizer = flax_reference.as_flax_optimizer(meta_optimizer) or meta_optimizer
        if not isinstance(commit_forward_update, bool):
            raise ValueError(
                f"`commit_forward_update` must be True or False; got {commit_forward_update!r}."
            )
        self.names = tuple(hyperparameters)
        self.guidance_every = int(guidance_every)
        self.commit_forward_update = commit_forward_update
        self.meta_optimizer = meta_optimizer
        self.meta_rule = meta_optimizer.rule
        self.active = {}  # requested name -> optimizer hyperparameter name (after bind)
        self._bound_optimizer = None

        def state(name, dtype, shape=()):
            return self.add_weight(
                name=name,
                shape=shape,
                dtype=dtype,
                initializer="zeros",
                trainable=False,
                aggregation="only_first_replica",
            )

        # float64 / int64 (float32 / int32 on JAX without jax_enable_x64).
        wide, counter = M.wide_float(), F.counter_dtype()
        self.raw = {n: state(f"raw_{n}", wide) for n in self.names}
        self.meta_slots = {}
        for n in self.names:
            shapes = self.meta_rule.slot_shapes((), self.meta_rule.default_options(()))
            self.meta_slots[n] = {
                s: state(f"meta_{n}_{s}", wide, shape) for s, shape in shapes.items()
            }
        self.schedule = EveryKSteps(self.guidance_every, name="guidance_schedule")
        self.guided_steps = state("guided_steps", counter)
        self.nonfinite_hypergrads = state("nonfinite_hypergrads", counter)
        self.initialized = state("initialized", counter)
        self.built = True

    @property
    def steps(self):
        """Training steps seen (int64 variable)."""
        return self.schedule.count

    # ------------------------------------------------------------------------ setup

    def bind(self, optimizer, context="GuidedTrainer"):
        """Validates `optimizer`, resolves the names and sets the initial raw values.

        Initial values (only on first bind; a restored checkpoint keeps its values): the
        learning-rate scale 1 (raw 0); a coefficient at the optimizer's configured value,
        clipped to [0.01, 1 - 1e-5] (a configured 0, e.g. Adafactor beta_1=0.0, starts at
        0.01 since sigmoid(raw) = 0 has no gradient). A `LossScaleOptimizer` is checked
        by the optimizer it wraps.
        """
        inner = _unscaled(optimizer)
        check_optimizer(inner, context)
        self.active = resolve_hyperparameters(inner, self.names, explicit=self.explicit_names)
        self._bound_optimizer = optimizer
        if int(np.asarray(ops.convert_to_numpy(self.initialized))) == 0:
            for name, key in self.active.items():
                self.raw[name].assign(
                    alg.initial_raw(key, inner.rule.defaults.get(key), bool(self.reference))
                )
            self.initialized.assign(1)
        return self.active

    def logged_names(self):
        """The diagnostics `guided_update` reports for the bound optimizer."""
        names = ["learning_rate_scale", "effective_learning_rate"]
        names += [n for n in self.active if n != "learning_rate"]
        names += [f"hypergrad_{n}" for n in self.active]
        names += ["guidance_loss", "nonfinite_hypergrads"]
        return names

    def values(self):
        """name -> current learned value (learning_rate: the scale), float64 tensors."""
        return {
            n: alg.activate(k, F.read_value(self.raw[n]), bool(self.reference))
            for n, k in self.active.items()
        }

    def get_config(self):
        config = super().get_config()
        config.update(
            hyperparameters=list(self.names) if self.explicit_names else None,
            meta_optimizer=keras.optimizers.serialize(self.meta_optimizer),
            guidance_every=self.guidance_every,
            commit_forward_update=self.commit_forward_update,
            reference=self.reference,
            meta_gradient_clip=self.meta_gradient_clip,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # An option of the earlier tape-based pass 3, saved by files made before forward mode.
        config.pop("memory_efficient", None)
        config["meta_optimizer"] = keras.optimizers.deserialize(config["meta_optimizer"])
        return cls(**config)


def _as_rule_optimizer(optimizer, context="GuidedTrainer.compile"):
    """The optimizer `compile` trains with: a Keras Adam/AdamW/SGD (or its name) converted
    to the tf_metaalign optimizer with the same rule (logged once per conversion); a
    tf_metaalign optimizer unchanged; anything else a ValueError."""
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, (opt_lib.BaseOptimizer, keras.optimizers.LossScaleOptimizer)):
        return optimizer  # check_optimizer (in bind) says what is wrong with it, if anything
    try:
        converted = as_rule_optimizer(optimizer)
    except ValueError as error:
        raise ValueError(
            f"{context}: guided learning differentiates through the optimizer's update, so it "
            "trains with a tf_metaalign optimizer; Keras's Adam, AdamW and SGD (and their "
            f"names) are converted to one, but not this optimizer. {error} Supported: "
            f"{', '.join(supported_optimizers())} (tf_metaalign.optimizers)."
        ) from None
    logging.warning("%s: converted %s.", context, describe_conversion(optimizer, converted))
    return converted


def _unscaled(optimizer):
    """The optimizer a `LossScaleOptimizer` wraps (the optimizer itself otherwise)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _optimizer_variable(optimizer, key):
    if key == "learning_rate":
        return optimizer.learning_rate_scale
    variables = optimizer.hyperparameter_variables
    if key not in variables:
        raise ValueError(
            f"{type(optimizer).__name__} keeps no variable for {key!r} (it has "
            f"{sorted(variables)}), so a learned value cannot be applied."
        )
    return variables[key]


def guided_update(
    hyper, model, optimizer, guide_loss_fn, grads, new_state, guidance_batch, guidance_weight=None
):
    """Run `algorithms.guided.guided_step` against a Keras model and optimizer.

    `grads` is this replica's training gradient of the (loss-scaled, under a
    `LossScaleOptimizer`) loss at the model's current weights, as `apply_gradients`
    takes it; `new_state` the model's state after the training forward pass (the
    guidance loss is evaluated from it). Updates the model with this step's
    hyperparameters lambda_t (committing the forward-mode update, or
    `optimizer.apply_gradients`), then stores lambda_{t+1} and the counters. Call in a
    replica context (inside `train_step` / `strategy.run`); each replica passes its
    own shard of the guidance batch with `guidance_weight = n_shard * replicas /
    n_guidance` (None for equal shards). Returns the diagnostics
    (name -> (value, weight)) listed by `hyper.logged_names()`.

    Args:
      hyper: the bound `GuidedHyperparameters`.
      model: the Keras model.
      optimizer: the compiled optimizer (`hyper.bind` checked it).
      guide_loss_fn: the guidance loss (`functional.make_loss_fn(..., training=False)`).
      grads: the training gradient (above).
      new_state: the model's state after the training pass.
      guidance_batch: this replica's guidance batch.
      guidance_weight: `n_shard * replicas / n_guidance`, or None for equal shards.

    Returns:
      The diagnostics, name -> (value, weight).

    Example:
      >>> from tf_metaalign import functional, optimizers
      >>> from tf_metaalign.trainers import GuidedHyperparameters, guided_update
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> optimizer = optimizers.SGD(0.1, momentum=0.9)
      >>> optimizer.build(model.trainable_variables)
      >>> hyper = GuidedHyperparameters(meta_optimizer=optimizers.Adam(0.01))
      >>> _ = hyper.bind(optimizer)
      >>> mse = keras.losses.MeanSquaredError()
      >>> train_loss = functional.make_loss_fn(model, mse)
      >>> guide_loss = functional.make_loss_fn(model, mse, training=False)
      >>> x = np.ones((4, 3), "float32")
      >>> params, state = functional.current_params(model), functional.current_state(model)
      >>> _, grads, (new_state, _) = functional.value_and_grad(
      ...     train_loss, params, state, (x, x[:, :1])
      ... )
      >>> guidance_batch = (x, 2 * x[:, :1])
      >>> logs = guided_update(
      ...     hyper, model, optimizer, guide_loss, grads, new_state, guidance_batch
      ... )
      >>> sorted(logs)[:3]
      ['beta_1', 'effective_learning_rate', 'guidance_loss']
      >>> round(float(hyper.values()["learning_rate"]), 4)  # the guidance asks for larger steps
      1.0101
    """
    if optimizer is not hyper._bound_optimizer:
        raise ValueError("guided_update: call `hyper.bind(optimizer)` with this optimizer first.")
    inner = _unscaled(optimizer)
    if not inner.built:
        raise ValueError(
            "The optimizer must be built before the guided step: call "
            "`optimizer.build(model.trainable_variables)` first."
        )
    variables = list(model.trainable_variables)
    apply = hyper.schedule.is_first()
    scaled = inner is not optimizer
    loss_scale = optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32")) if scaled else None

    g_global = F.all_reduce_sum(grads)
    if scaled:
        # Gradients of the scaled loss: unscale for the rule; a non-finite gradient
        # (float16 overflow) skips the hypergradient step as the optimizer skips the update.
        g_global = [g / ops.cast(loss_scale, g.dtype) for g in g_global]
        finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in g_global]))
        apply = ops.logical_and(apply, finite)
    g_global = inner.clip_aggregated(g_global)

    names = list(hyper.active)
    keys = [hyper.active[n] for n in names]
    raw = {hyper.active[n]: F.read_value(hyper.raw[n]) for n in names}
    meta_slots = {
        hyper.active[n]: {k: F.read_value(v) for k, v in hyper.meta_slots[n].items()} for n in names
    }
    base = inner.current_hyperparameters()
    schedule_lr = inner.schedule_learning_rate()
    base["learning_rate"] = schedule_lr
    slots = [{k: F.read_value(v) for k, v in inner.slots_for(var).items()} for var in variables]
    opt_vars = {k: _optimizer_variable(inner, k) for k in keys}
    meta_lr = hyper.meta_optimizer.learning_rate_at(F.read_value(hyper.guided_steps))

    # With a hypergradient every step, the forward-mode update IS this step's update:
    # commit it (group by group) instead of recomputing it in apply_gradients.
    commit_now = (
        hyper.commit_forward_update
        and hyper.guidance_every == 1
        and not scaled
        and not getattr(inner, "use_ema", False)
    )
    commit = None
    if commit_now:

        def commit(i, new_value, new_slots):
            if BACKEND != "tensorflow":
                # In the pure step's scope: assignments are recorded, nothing to replicate.
                for k, slot in inner.slots_for(variables[i]).items():
                    slot.assign(new_slots[k])
                variables[i].assign(ops.cast(new_value, variables[i].dtype))
                return new_value
            return inner.assign_variable_update(variables[i], new_value, new_slots)

    guide = guide_loss_fn
    if scaled:

        def guide(p, s, b):  # scaled like the training loss, against float16 underflow
            value, aux = guide_loss_fn(p, s, b)
            return value * ops.cast(loss_scale, value.dtype), aux

    r = alg.guided_step(
        guide,
        inner.rule,
        g_global,
        F.current_params(model),
        slots,
        [inner.options_for(v) for v in variables],
        base,
        raw,
        ops.cast(F.read_value(inner.iterations) + 1, "float32"),
        new_state,
        guidance_batch,
        meta_rule=hyper.meta_rule,
        meta_slots=meta_slots,
        meta_hparams={"learning_rate": ops.cast(meta_lr, M.wide_float())},
        meta_step=ops.cast(F.read_value(hyper.guided_steps) + 1, M.wide_float()),
        apply=apply,
        guidance_weight=guidance_weight,
        hparam_dtype={k: opt_vars[k].dtype for k in keys},
        commit=commit,
        reference=bool(hyper.reference),
        meta_gradient_clip=hyper.meta_gradient_clip,
    )
    h, guidance_loss = r.hypergradients, r.guidance_loss
    if scaled:
        h = {k: v / ops.cast(loss_scale, v.dtype) for k, v in h.items()}
        guidance_loss = guidance_loss / ops.cast(loss_scale, guidance_loss.dtype)

    # The model update, with this step's hyperparameters (lambda_t).
    for k in keys:
        opt_vars[k].assign(ops.cast(r.values[k], opt_vars[k].dtype))
    if commit_now:
        inner.iterations.assign_add(1)  # the variables were committed in guided_step
    else:
        apply_gradients(optimizer, grads, variables)

    for n, k in zip(names, keys):
        hyper.raw[n].assign(r.new_raw[k])
        for slot, var in hyper.meta_slots[n].items():
            var.assign(r.new_meta_slots[k][slot])
    hyper.guided_steps.assign_add(ops.cast(apply, hyper.guided_steps.dtype))
    hyper.schedule.advance()
    hyper.nonfinite_hypergrads.assign_add(ops.cast(r.n_nonfinite, hyper.nonfinite_hypergrads.dtype))

    weight = ops.cast(apply, "float32")
    scale = F.read_value(inner.learning_rate_scale)
    if "learning_rate" in keys:
        scale = ops.cast(r.values["learning_rate"], scale.dtype)
    logs = {
        "learning_rate_scale": scale,
        # As the optimizer multiplies them (`BaseOptimizer`): in the rate's dtype.
        "effective_learning_rate": schedule_lr * ops.cast(scale, schedule_lr.dtype),
        "guidance_loss": (guidance_loss, weight),
        "nonfinite_hypergrads": F.read_value(hyper.nonfinite_hypergrads),
    }
    for n, k in zip(names, keys):
        if n != "learning_rate":
            logs[n] = ops.cast(r.values[k], scale.dtype)  # floatx, as the scale
        logs[f"hypergrad_{n}"] = (h[k], weight)
    return logs


# ----------------------------------------------------------------------------- data


HOLDOUTS = ("auto", "position", "identity")

#: ops in a dataset's functions that draw random numbers (augmentation): an example is then
#: another tensor each epoch, which identity cannot recognise.
_RANDOM_OPS = re.compile(r"Random|^Stateful|^Rng")


def _dataset_graph(dataset):
    """The dataset's serialized GraphDef, or None when it cannot be serialized."""
    tf = _tf("split_guidance_batch")
    try:
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(dataset._as_serialized_graph().numpy())
        return graph
    except Exception:  # e.g. a stateful op with no serialization: order unknown
        return None


def _order_varies(dataset, graph):
    """Why another iteration of `dataset` may not start with the same batches, or None."""
    if graph is None:
        return "its graph cannot be inspected"
    if dataset.options().deterministic is False:
        return "options().deterministic is False"
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    for node in nodes:
        op, attr = node.op, node.attr
        if "Dataset" not in op:
            continue
        if "Shuffle" in op:
            if "reshuffle_each_iteration" not in attr or attr["reshuffle_each_iteration"].b:
                return f"it reshuffles every epoch ({op} with reshuffle_each_iteration=True)"
        elif "Repeat" in op:
            return f"it repeats ({op}: the held-out examples come back)"
        elif "Generator" in op:
            return "its examples come from a Python generator (order unknown)"
        elif op.startswith("Random"):
            return f"it draws its order at random ({op})"
        elif "deterministic" in attr and attr["deterministic"].s == b"false":
            return f"its order is not deterministic ({op} with deterministic=False)"
    return None


def _draws_random_numbers(graph):
    return graph is not None and any(
        _RANDOM_OPS.search(n.op) for f in graph.library.function for n in f.node_def
    )


def _identity_error(dataset, reason, why_not):
    return ValueError(
        f"split_guidance_batch: cannot hold the guidance examples out of this dataset for "
        f"good: {reason}, so `skip` would train on other examples than those held out, and "
        f"{why_not}. Split before shuffling (`guidance = ds.take(k)` and `train = "
        "ds.skip(k)` on the unshuffled examples, then shuffle, augment and batch `train` "
        "only), or shuffle with reshuffle_each_iteration=False."
    )


def example_fingerprints(batch):
    """One int64 per example of a batch (nest of dense tensors with a leading batch axis):
    a fingerprint (`tf.fingerprint`, farmhash) of the bytes of all its tensors. Needs
    TensorFlow."""
    tf = _tf("example_fingerprints")
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(batch)]
    prints = [tf.fingerprint(t) for t in leaves]
    combined = tf.fingerprint(tf.concat(prints, axis=1))
    return tf.bitcast(combined, tf.int64)


def split_guidance_batch(dataset, num_batches: int = 1, holdout: str = "auto"):
    """Split held-out guidance data off a batched training dataset, for good.

    Returns `(guidance, rest)`: with `num_batches=1` the first batch as a tuple of
    tensors, else a `tf.data.Dataset` of the first `num_batches` batches; `rest` the
    training dataset, which never yields a guidance example in any epoch:

    * by position (`holdout="position"`, or "auto" when every iteration of `dataset`
      yields the same batches in the same order): `rest = dataset.skip(num_batches)`,
      the batches unchanged;
    * by identity (`holdout="identity"`, or "auto" when another iteration may differ: a
      `shuffle` with `reshuffle_each_iteration=True`, the default; a `repeat`; a Python
      generator; a random choice of datasets; `deterministic=False`): each example of
      every training batch is recognised by a fingerprint of its tensors
      (`example_fingerprints`) and dropped when it is a guidance example (an exact
      duplicate of one included). A batch that held guidance examples comes out smaller,
      so an epoch sees every other example once (the number of batches is kept: a batch
      made only of guidance examples comes out empty, a step with a zero gradient);
      `skip` could not do that: on a reshuffling dataset `take` and `skip` draw
      different examples every epoch (6-7 of 8 "held out" examples were trained on in
      every epoch). Logged.

    Identity needs examples that are the same tensors in every epoch. It refuses (a
    ValueError saying to split before shuffling) a varying dataset whose examples are
    ragged or sparse, padded per batch (a dimension other than the batch one not static,
    as `padded_batch` without fixed `padded_shapes` makes it), or drawn from random
    numbers in its map functions (augmentation after the shuffle: the same example is a
    different tensor each epoch); `holdout="identity"` skips only the last check (say so
    when the random ops do not change the examples). Random augmentation in a Python
    generator cannot be seen: hold the guidance data out before it.

    Example:
      >>> from tf_metaalign.trainers import split_guidance_batch
      >>> data = tf.data.Dataset.range(10).map(lambda i: (tf.cast(i, "float32"), i)).batch(2)
      >>> guidance, training = split_guidance_batch(data)
      >>> guidance[1].numpy().tolist(), [y.numpy().tolist() for _, y in training]
      ([0, 1], [[2, 3], [4, 5], [6, 7], [8, 9]])

    Needs TensorFlow (`tf.data`).
    """
    tf = _tf("split_guidance_batch")
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset; got {type(dataset).__name__}.")
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"`num_batches` must be an integer >= 1; got {num_batches!r}.")
    if holdout not in HOLDOUTS:
        raise ValueError(f"`holdout` must be one of {HOLDOUTS}; got {holdout!r}.")
    head = list(dataset.take(num_batches))
    if not head:
        raise ValueError("split_guidance_batch: `dataset` is empty; there is no batch to hold out.")
    guidance = head[0] if num_batches == 1 else tf.data.Dataset.from_tensor_slices(_stack(head))
    graph = _dataset_graph(dataset) if holdout != "position" else None
    reason = _order_varies(dataset, graph) if holdout == "auto" else None
    if holdout == "position" or (holdout == "auto" and reason is None):
        return guidance, dataset.skip(num_batches)
    reason = reason or "holdout='identity'"

    specs = tf.nest.flatten(dataset.element_spec)
    if not all(isinstance(spec, tf.TensorSpec) for spec in specs):
        raise _identity_error(
            dataset,
            reason,
            "its examples are not all dense tensors (ragged "
            "or sparse), which identity cannot compare",
        )
    if not all(spec.shape.rank and spec.shape[1:].is_fully_defined() for spec in specs):
        raise _identity_error(
            dataset,
            reason,
            "an example's shape depends on its batch "
            "(padded per batch, or no batch axis), so identity cannot "
            "recognise it in another batch",
        )
    if holdout == "auto" and _draws_random_numbers(graph):
        raise _identity_error(
            dataset,
            reason,
            "its map functions draw random numbers "
            "(augmentation?), so an example is another tensor every epoch "
            "and identity cannot recognise it (holdout='identity' if they "
            "do not change the examples)",
        )
    held_out = tf.concat([example_fingerprints(b) for b in head], axis=0)

    def drop_guidance(*element):
        element = element[0] if len(element) == 1 else element
        prints = example_fingerprints(element)
        keep = tf.logical_not(tf.reduce_any(tf.equal(prints[:, None], held_out[None, :]), axis=1))
        return tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), element)

    logging.info(
        "split_guidance_batch: holding the %d guidance examples out by identity, since %s; "
        "training batches that held one come out smaller.",
        int(held_out.shape[0]),
        reason,
    )
    # `map` keeps the number of batches (a `filter` of emptied batches would make it
    # unknown: Keras then warns every epoch and fixes the count of later epochs to the first's).
    return guidance, dataset.map(drop_guidance)


def _encode_array(t):
    """A tensor as JSON-able config (values, shape, dtype)."""
    a = np.asarray(t)
    return {"values": a.ravel().tolist(), "shape": list(a.shape), "dtype": a.dtype.name}


def _decode_array(d):
    return np.asarray(d["values"], dtype=d["dtype"]).reshape(d["shape"])


def _stack(batches):
    return keras.tree.map_structure(lambda *t: ops.stack(t), *batches)


def _as_batch(element, arg="guidance_data"):
    if isinstance(element, dict):
        raise ValueError(
            f"`{arg}` elements must be (x, y) or (x, y, sample_weight) tuples, not a dict."
        )
    if not isinstance(element, (tuple, list)) or len(element) not in (2, 3):
        raise ValueError(
            f"`{arg}` must be a batch (x, y) / (x, y, sample_weight) or a tf.data.Dataset of "
            f"such batches; got {type(element).__name__}"
            + (f" of length {len(element)}" if isinstance(element, (tuple, list)) else "")
            + "."
        )
    return tuple(keras.tree.map_structure(ops.convert_to_tensor, tuple(element)))


class _Batches(list):
    """Guidance batches restored from a config (a list, not one batch (x, y))."""


class GuidanceData:
    """Held-out guidance batches, stacked so a step picks one by index (cycled).

    A fixed batch is one batch; a `tf.data.Dataset` is read once, at most `max_batches`
    batches (an infinite or longer dataset is truncated, with a warning), all of the same
    shapes (a smaller final batch is dropped). Under a strategy each replica evaluates a
    contiguous shard of the chosen batch, weighted so the total equals one replica's value
    (with fewer examples than replicas some shards are empty, of weight 0).
    Not tracked by Keras (plain python object holding constant tensors).
    """

    def __init__(self, data, max_batches=64):
        if isinstance(data, _Batches):  # from_config's batches (no tf.data on JAX)
            batches = [_as_batch(b) for b in data]
        elif _is_tf_dataset(data):
            batches = [_as_batch(b) for b in data.take(max_batches + 1)]
            if len(batches) > max_batches:
                logging.warning(
                    "guidance_data: using the first %d batches of the dataset "
                    "(max_guidance_batches).",
                    max_batches,
                )
                batches = batches[:max_batches]
            if not batches:
                raise ValueError("`guidance_data` is an empty dataset: give at least one batch.")
        else:
            batches = [_as_batch(data)]
        shapes = [tuple(tuple(t.shape) for t in keras.tree.flatten(b)) for b in batches]
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
        batch = keras.tree.map_structure(lambda t: ops.take(t, index, axis=0), self.stacked)
        replicas = F.num_replicas()
        if replicas == 1:
            return batch, None
        tf = _tf("GuidanceData.shard")  # several replicas: a tf.distribute strategy
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        start, end = alg.guidance_shard_bounds(self.batch_size, rid, replicas)
        shard = tf.nest.map_structure(lambda t: t[start:end], batch)
        # float64: n_r * R / N is not exact in float32 (cast to the loss's dtype later).
        weight = tf.cast((end - start) * replicas, tf.float64) / float(self.batch_size)
        return shard, weight


# -------------------------------------------------------------------------- trainer


@keras.saving.register_keras_serializable(package="tf_metaalign")
class GuidedTrainer(MetaTrainer):
    """Train `model` while learning its optimizer's learning-rate scale and beta_1.

    Each step t (see `tf_metaalign.algorithms.guided`): the training gradient g_t; the
    hypergradient h_t = d L_guide(theta_{t+1}) / d raw_lambda_t through one update of the
    compiled optimizer, with L_guide the compiled loss (plus the model's own losses) on a
    held-out guidance batch evaluated with `training=False` (no dropout); the model update
    theta_{t+1} computed with lambda_t; then raw_lambda_{t+1} = meta_optimizer(raw_lambda_t,
    h_t). Non-finite h are sanitised as the reference does (NaN -> 0, +-inf -> +-10) and
    counted.

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
      meta_optimizer: the meta-optimizer (its rule and learning rate): a tf_metaalign
        optimizer or Keras's built-in Adam/SGD; default Adam(3e-5) as in the paper.
      guidance_every: take a hypergradient step every this many training steps.
      max_guidance_batches: how many batches of a guidance dataset to keep.
      commit_forward_update: see `GuidedHyperparameters` (True, the default: commit the
        update computed for the hypergradient, one optimizer update fewer per step;
        False: recompute it in `apply_gradients`, bit-identical to `fit` at meta
        learning rate 0). Formerly `reuse_lookahead` (still accepted).
      reference: None (default: this package's semantics) or "gradient_based_tuning":
        the arithmetic of the paper's JAX code (google-research `gradient_based_tuning`)
        in its five places of difference (docs/guided.md, "The reference's semantics"):
        beta_1 = (1 - 1e-5) * sigmoid(raw) and the reference's inverse at initialisation;
        flax's Adam as the meta-optimizer (epsilon 1e-8 after bias correction; default
        FlaxAdam(3e-5)); `compile` trains an Adam as flax's Adam (epsilon after bias
        correction) and a Lamb as flax's LAMB (`optimizers.flax_reference`); on several
        TensorFlow replicas each replica's hypergradient is sanitised before they are
        averaged (on JAX the step sees the global batch: one device's order).
      meta_gradient_clip: clip the hypergradient to [-c, c] before the meta step (the
        reference's `--use_grad_clip --grad_clip_limit=c`, off by default there too).

    Compile with one of `tf_metaalign.optimizers` (SGD, Adam, AdamW, AdamWeightDecay, Lamb,
    Adafactor, RecAdam), or Keras's Adam, AdamW or SGD ("adam", `keras.optimizers.Adam(1e-3)`,
    ...), which `compile` converts to the tf_metaalign optimizer with the same rule and
    hyperparameters (logged; see `compile`); under `mixed_float16` Keras wraps it in a
    `LossScaleOptimizer`, which is
    supported (the update is then recomputed by the optimizer, which skips steps whose
    gradient overflowed; those steps take no hypergradient step). Logs, per step
    (batch-level logs, TensorBoard `update_freq="batch"`) and per epoch (History: the
    epoch's last value): `learning_rate_scale`, `effective_learning_rate`, the learned
    values (e.g. `beta_1`), `hypergrad_<name>` (the sanitised hypergradient w.r.t. the raw
    value), `guidance_loss` (at theta_{t+1}) and `nonfinite_hypergrads` (cumulative count).

    Example:
      >>> from tf_metaalign.trainers import GuidedTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> x = np.random.default_rng(0).normal(size=(24, 3)).astype("float32")
      >>> y = x.sum(axis=1, keepdims=True)
      >>> trainer = GuidedTrainer(model, guidance_data=(x[16:], y[16:]))
      >>> trainer.compile(optimizer="adam", loss="mse")  # converted to tf_metaalign's Adam
      >>> history = trainer.fit(x[:16], y[:16], batch_size=8, verbose=0)
      >>> sorted(k for k in history.history if k.startswith("hypergrad"))
      ['hypergrad_beta_1', 'hypergrad_learning_rate']

    References:
      Lichtarge, Alberti & Kumar, "Simple and Effective Gradient-Based Tuning of
      Sequence-to-Sequence Models" (official JAX code: google-research
      `gradient_based_tuning`).
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model: keras.Model,
        guidance_data,
        hyperparameters=None,
        meta_optimizer=None,
        guidance_every: int = 1,
        max_guidance_batches: int = 64,
        commit_forward_update: bool = True,
        reference: str | None = None,
        meta_gradient_clip: float | None = None,
        **kwargs,
    ):
        if "reuse_lookahead" in kwargs:  # its name before 0.2
            commit_forward_update = kwargs.pop("reuse_lookahead")
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
        # Raw guidance data for a keras-hub task goes through the task's preprocessor, as fit's
        # does.
        guidance = GuidanceData(preprocess_data(model, guidance_data), max_guidance_batches)
        super().__init__(model, **kwargs)
        self._guidance = [guidance]  # a list hides the holder from Keras's tracking
        self.max_guidance_batches = max_guidance_batches
        self.guided = GuidedHyperparameters(
            hyperparameters,
            meta_optimizer,
            guidance_every,
            commit_forward_update=commit_forward_update,
            reference=reference,
            meta_gradient_clip=meta_gradient_clip,
            name="guided_hyperparameters",
        )
        for name in (
            "learning_rate_scale",
            "effective_learning_rate",
            "guidance_loss",
            "nonfinite_hypergrads",
        ):
            self.add_diagnostic(name, "last")
        for name in self.guided.names:
            if name != "learning_rate":
                self.add_diagnostic(name, "last")
            self.add_diagnostic(f"hypergrad_{name}", "last")

    @property
    def guidance(self) -> GuidanceData:
        return self._guidance[0]

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """`keras.Model.compile`, with a Keras optimizer converted to a pure rule.

        `optimizer` may be a tf_metaalign optimizer, or what `model.compile` takes for
        Adam, AdamW and SGD ("adam", "adamw", "sgd", `keras.optimizers.Adam(...)`, ...):
        those are converted by `optimizers.as_rule_optimizer` to the tf_metaalign optimizer
        with the same rule and hyperparameters (learning rate or schedule, betas, epsilon,
        weight decay and its exclusions, momentum, Nesterov, name, clipping), which is
        logged (a warning: the instance passed is not the one trained; read
        `trainer.optimizer`). Anything that cannot be converted (e.g. "rmsprop",
        `keras.optimizers.Adadelta`, amsgrad) raises a ValueError listing what is supported.
        With `reference="gradient_based_tuning"`, an Adam (also one converted from Keras's)
        becomes flax's Adam and a Lamb flax's LAMB (`optimizers.flax_reference.
        as_flax_optimizer`, logged); other optimizers are trained as they are.
        """
        optimizer = _as_rule_optimizer(optimizer)
        if self.guided.reference:
            flax_optimizer = flax_reference.as_flax_optimizer(optimizer)
            if flax_optimizer is not None and flax_optimizer is not optimizer:
                logging.warning(
                    "GuidedTrainer.compile(reference=%r): training %s as %s (flax's rule).",
                    self.guided.reference,
                    type(optimizer).__name__,
                    type(flax_optimizer).__name__,
                )
                optimizer = flax_optimizer
        super().compile(optimizer, *args, **kwargs)
        self.guided.bind(self.optimizer)
        self.set_active_diagnostics(self.guided.logged_names())

    def learned_values(self):
        """dict name -> current learned value (python floats; learning_rate: the scale)."""
        return {n: float(v) for n, v in self.guided.values().items()}

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        optimizer = _unscaled(self.optimizer)
        if not optimizer.built:
            # Keras builds optimizers lazily in apply_gradients; the guided step reads the
            # slots before that (first trace only, like Keras's own lazy build).
            self.optimizer.build(self.model.trainable_variables)
        index = ops.mod(F.read_value(self.guided.guided_steps), self.guidance.num_batches)
        guidance_batch, weight = self.guidance.shard(index)
        loss_scale = self.loss_scale()
        loss, grads, (new_state, y_pred) = F.value_and_grad(
            self.loss_fn(loss_scale=loss_scale),
            F.current_params(self.model),
            F.current_state(self.model),
            (x, y, sample_weight),
        )

        def update():
            return guided_update(
                self.guided,
                self.model,
                self.optimizer,
                self.loss_fn(training=False),
                grads,
                new_state,
                guidance_batch,
                guidance_weight=weight,
            )

        # The state is assigned by finish_step after the guided step has read `new_state`.
        return self.finish_step(
            data,
            y_pred,
            loss / ops.cast(loss_scale, loss.dtype),
            update=update,
            new_state=new_state,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            guidance_data={
                "num_batches": self.guidance.num_batches,
                # (x, y[, sample_weight]) with a leading batch-index axis; x may be a dict.
                "stacked": [
                    {k: _encode_array(v) for k, v in e.items()}
                    if isinstance(e, dict)
                    else _encode_array(e)
                    for e in self.guidance.stacked
                ],
            },
            hyperparameters=list(self.guided.names) if self.guided.explicit_names else None,
            meta_optimizer=keras.optimizers.serialize(self.guided.meta_optimizer),
            guidance_every=self.guided.guidance_every,
            max_guidance_batches=self.max_guidance_batches,
            commit_forward_update=self.guided.commit_forward_update,
            reference=self.guided.reference,
            meta_gradient_clip=self.guided.meta_gradient_clip,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        data = config["guidance_data"]
        if isinstance(data, dict) and "stacked" in data:
            stacked = tuple(
                {k: _decode_array(v) for k, v in e.items()}
                if "values" not in e
                else _decode_array(e)
                for e in data["stacked"]
            )
            n = data["num_batches"]
            batches = _Batches(
                keras.tree.map_structure(lambda a, i=i: a[i], stacked) for i in range(n)
            )
            config["guidance_data"] = Preprocessed(  # stored after preprocessing
                batches[0] if n == 1 else batches
            )
        config.pop("memory_efficient", None)  # see GuidedHyperparameters.from_config
        config["meta_optimizer"] = keras.optimizers.deserialize(config["meta_optimizer"])
        return super().from_config(config, custom_objects=custom_objects)


__all__ = [
    "GuidanceData",
    "GuidedHyperparameters",
    "GuidedTrainer",
    "guided_update",
    "example_fingerprints",
    "split_guidance_batch",
]
