"""Guided learning: the greedy hypergradient of one optimizer step.

Reference: Lichtarge, Alberti, Kumar, "Simple and Effective Gradient-Based Tuning of
Sequence-to-Sequence Models" (official JAX code: google-research `gradient_based_tuning`).

At step t, with the (all-reduced) training gradient ``g_t`` at ``theta_t``::

    theta_{t+1}(raw) = rule.update(g_t, theta_t, slots_t, hparams(raw), t)
    h_t              = d L_guide(theta_{t+1}(raw)) / d raw          (raw = raw_t)

Only this one optimizer step is differentiated (``theta_t``, ``g_t`` and the slots are
constants: the "greedy" or short-horizon hypergradient). Learned hyperparameters pass
through activations (`activate`): the learning rate is ``schedule * exp(raw)`` (the raw
value multiplies the optimizer's own schedule, so the schedule is kept; exp(0) = 1), and
a coefficient in [0, 1) such as ``beta_1`` is ``min(sigmoid(raw), 1 - 1e-5)``.

Cost: the inner-product structure
---------------------------------
By the chain rule ``h = < grad L_guide(theta_{t+1}), d theta_{t+1} / d raw >``. It is
computed in three passes, none of which forms a Jacobian or a second model:

1. ``theta_{t+1} = update(raw)`` (elementwise, no tape);
2. ``v = grad L_guide(theta_{t+1})``: one forward + backward pass on the guidance batch
   (``training=False`` in the trainer: no dropout);
3. ``h = d/d raw < stop_gradient(v), update(raw) >``: the elementwise update again, under
   a tape over the scalar raw values only. Its forward values are the step's update
   itself: `commit` can assign them, so the optimizer need not compute the update a
   fourth time.

Extra memory: ``theta_{t+1}`` (during the guidance pass) and ``v``, plus the tape's
intermediates of the update in pass 3: for all variables at once by default, for one
variable at a time with ``sequential=True`` (slower: the chain removes parallelism).

Distribution
------------
``grads`` must be the global (all-reduced) gradient, identical on every replica. Each
replica evaluates its own shard of the guidance batch with a guidance loss in Keras's
per-replica units (mean over the shard divided by the replica count, times
``guidance_weight = n_shard * replicas / n_guidance`` for unequal shards), so the
*sum* over replicas of the local hypergradients and losses is the single-replica value.
`reduce_and_sanitize` performs that sum, then replaces NaN by 0 and +-inf by +-10 (as the
reference's ``jnp.nan_to_num(..., posinf=10.0, neginf=-10.0)``) and counts the
non-finite entries. The raw values and their meta-optimizer are then updated
identically on every replica.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from tf_metaalign import functional as F

#: value of a sigmoid-activated hyperparameter is capped at 1 - SIGMOID_CAP_MARGIN.
SIGMOID_CAP_MARGIN = 1e-5
#: a sigmoid-activated hyperparameter configured at 0 (e.g. Adafactor's beta_1=0.0) is
#: initialised here instead: logit(0) = -inf has no gradient, so it could never move.
SIGMOID_INIT_FLOOR = 1e-2
#: NaN hypergradients become 0 and +-inf become +-NONFINITE_REPLACEMENT (the reference).
NONFINITE_REPLACEMENT = 10.0


# ----------------------------------------------------------------------- activations


def activation_name(name: str) -> str:
    """"exp" for the learning rate (a scale of the schedule), "sigmoid" otherwise."""
    return "exp" if name == "learning_rate" else "sigmoid"


def activate(name: str, raw):
    """The hyperparameter value (or learning-rate scale) for a raw value; differentiable."""
    raw = tf.convert_to_tensor(raw)
    if activation_name(name) == "exp":
        return tf.exp(raw)
    return tf.minimum(tf.sigmoid(raw), tf.cast(1.0 - SIGMOID_CAP_MARGIN, raw.dtype))


def initial_raw(name: str, value: float | None) -> float:
    """Inverse of `activate` for the initial value (a python float).

    The learning-rate scale starts at 1 (raw 0) whatever `value` is. A sigmoid
    hyperparameter starts at `value` clipped to [SIGMOID_INIT_FLOOR, 1 - 1e-5]
    (None counts as 0).
    """
    if activation_name(name) == "exp":
        return 0.0
    v = 0.0 if value is None else float(value)
    v = min(max(v, SIGMOID_INIT_FLOOR), 1.0 - SIGMOID_CAP_MARGIN)
    return float(math.log(v) - math.log1p(-v))


# ------------------------------------------------------------------ hyperparameters


def hyperparameters_from_raw(
    base_hparams: Mapping[str, Any],
    raw: Mapping[str, tf.Tensor],
    dtype=None,
):
    """The `hparams` dict of `rule.update` with the learned values substituted.

    Args:
      base_hparams: the optimizer's hyperparameters for this step, with
        "learning_rate" = the SCHEDULE value (not multiplied by the learned scale).
      raw: name -> raw scalar (e.g. {"learning_rate": r1, "beta_1": r2}).
      dtype: dtype of the activated values handed to the rule (default: raw's dtype), or
        a dict name -> dtype. The trainer uses the dtypes of the optimizer's own variables
        (float32 learning-rate scale, float64 coefficients), so the rule sees exactly the
        values `BaseOptimizer` computes with.
    """
    hparams = dict(base_hparams)
    for name, r in raw.items():
        value = activate(name, r)
        d = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        if d is not None:
            value = tf.cast(value, d)
        if name == "learning_rate":
            schedule = tf.cast(base_hparams["learning_rate"], value.dtype)
            hparams["learning_rate"] = schedule * value
        else:
            hparams[name] = value
    return hparams


def lookahead(rule, grads, params, slots, options, hparams, step):
    """``theta_{t+1}``: `rule.update` applied to every variable (new params only)."""
    if not (len(grads) == len(params) == len(slots) == len(options)):
        raise ValueError(
            "lookahead: grads, params, slots and options must have one entry per variable; "
            f"got {len(grads)}, {len(params)}, {len(slots)}, {len(options)}."
        )
    return [
        rule.update(g, w, s, hparams, step, o)[0]
        for g, w, s, o in zip(grads, params, slots, options)
    ]


# ------------------------------------------------------------------------- the step


@dataclasses.dataclass
class HypergradientResult:
    """What `hypergradients` computes (local, per-replica units; see the module doc).

    Attributes:
      hypergradients: name -> d L_guide / d raw (scalar, raw's dtype).
      guidance_loss: the guidance loss at theta_{t+1} (times `guidance_weight`).
      new_params: theta_{t+1} at the given raw values.
      guidance_aux: the guidance loss function's aux output ((new_state, y_pred)).
    """

    hypergradients: dict
    guidance_loss: tf.Tensor
    new_params: list
    guidance_aux: Any


def hypergradients(
    guide_loss_fn: Callable,
    rule,
    grads: Sequence[tf.Tensor],
    params: Sequence[tf.Tensor],
    slots: Sequence[Mapping[str, tf.Tensor]],
    options: Sequence[Mapping | None],
    base_hparams: Mapping[str, Any],
    raw: Mapping[str, tf.Tensor],
    step,
    state: Sequence[tf.Tensor],
    guidance_batch,
    guidance_weight=None,
    hparam_dtype=None,
    commit=None,
    sequential=False,
) -> HypergradientResult:
    """The greedy hypergradient ``d L_guide(theta_{t+1}(raw)) / d raw`` (local value).

    Args:
      guide_loss_fn: `loss_fn(params, state, batch) -> (loss, aux)` for the guidance
        loss (for a Keras model: `functional.make_loss_fn(model, loss, training=False)`).
      rule: the optimizer's pure `UpdateRule`.
      grads: the global (all-reduced, unscaled) training gradient g_t, one per variable.
      params: theta_t; slots: per variable, dict slot name -> tensor (slots before the
        step); options: per variable, the rule's static options (or None).
      base_hparams: the rule's hyperparameters for this step, "learning_rate" being the
        schedule value without the learned scale.
      raw: name -> raw scalar tensor of the learned hyperparameters.
      step: the 1-based update count of this step.
      state: the model's non-trainable state for the guidance evaluation.
      guidance_batch: `(x, y)` or `(x, y, sample_weight)`.
      guidance_weight: multiplies the guidance loss (unequal replica shards); None = 1.
      hparam_dtype: dtype of the activated values given to the rule (None: raw's dtype).
      commit: optional `commit(i, new_var, new_slots) -> op`, called for each variable
        with pass 3's forward values (this step's update at the given raw values): e.g.
        assign them, instead of recomputing the update in `apply_gradients`.
      sequential: run pass 3 one variable after another (control dependencies), so the
        tape holds one variable's intermediates at a time: less memory, more time (see
        `GuidedTrainer(memory_efficient=...)` for measurements).

    Returns a `HypergradientResult` in per-replica units: call `reduce_and_sanitize`
    (inside the same replica context) for the global, sanitised values.
    """
    names = list(raw)
    raw_t = {n: tf.convert_to_tensor(raw[n]) for n in names}
    params = list(params)

    # Pass 1: theta_{t+1} at the current raw values (no tape, nothing kept).
    hparams = hyperparameters_from_raw(base_hparams, raw_t, dtype=hparam_dtype)
    new_params = lookahead(rule, grads, params, slots, options, hparams, step)

    def weighted_loss_fn(p, s, b):
        value, aux = guide_loss_fn(p, s, b)
        if guidance_weight is not None:
            value = value * tf.cast(guidance_weight, value.dtype)
        return value, aux

    # Pass 2: v = grad L_guide(theta_{t+1}).
    guide_loss, v, aux = F.value_and_grad(weighted_loss_fn, new_params, state, guidance_batch)
    v = [tf.stop_gradient(x) for x in v]

    # Pass 3: h = d/d raw <v, theta_{t+1}(raw)>, the update re-run under a tape over raw,
    # per variable (with `sequential`, chained by control dependencies so the tape's
    # intermediates exist for one variable at a time). Its forward values are this
    # step's update, which `commit` may assign (saving the optimizer a recomputation).
    raw_list = list(raw_t.values())
    acc = tf.float64 if any(r.dtype == tf.float64 for r in raw_list) else tf.float32
    h_sum = [tf.zeros((), acc) for _ in names]
    deps = []
    for i, (g, w, s_i, o, v_i) in enumerate(zip(grads, params, slots, options, v)):
        with tf.control_dependencies(deps):
            with tf.GradientTape() as tape:
                tape.watch(raw_list)
                hp = hyperparameters_from_raw(base_hparams, raw_t, dtype=hparam_dtype)
                new_w, new_s = rule.update(g, w, s_i, hp, step, o)
                inner = tf.reduce_sum(tf.cast(v_i, acc) * tf.cast(new_w, acc))
            h_i = tape.gradient(inner, raw_list, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            committed = commit(i, new_w, new_s) if commit is not None else None
            if sequential:
                deps = [tf.identity(x) for x in h_i] + ([committed] if committed is not None else [])
        h_sum = [a + tf.cast(b, acc) for a, b in zip(h_sum, h_i)]
    h = {n: tf.cast(x, raw_t[n].dtype) for n, x in zip(names, h_sum)}
    return HypergradientResult(
        hypergradients=h, guidance_loss=guide_loss, new_params=new_params, guidance_aux=aux
    )


def sanitize(h: tf.Tensor):
    """NaN -> 0, +inf -> +10, -inf -> -10 (the reference); returns (value, is_nonfinite)."""
    h = tf.convert_to_tensor(h)
    bad = tf.logical_not(tf.math.is_finite(h))
    clean = tf.where(
        tf.math.is_nan(h),
        tf.zeros_like(h),
        tf.clip_by_value(h, -NONFINITE_REPLACEMENT, NONFINITE_REPLACEMENT),
    )
    clean = tf.where(bad, clean, h)
    return clean, bad


def reduce_and_sanitize(hypergrads: Mapping[str, tf.Tensor], guidance_loss):
    """Sum local hypergradients and guidance losses over replicas, then sanitise.

    Returns `(hypergradients, guidance_loss, n_nonfinite)`: dict name -> global sanitised
    scalar, the global guidance loss, and the number (int64) of non-finite entries
    replaced this step. Must be called in a replica context (or outside any strategy).
    """
    names = list(hypergrads)
    values = [tf.convert_to_tensor(hypergrads[n]) for n in names]
    loss = tf.convert_to_tensor(guidance_loss)
    dtypes = [v.dtype for v in values] + [loss.dtype]
    # One all-reduce of a single dtype (a batched all-reduce concatenates its inputs).
    packed = tf.stack([tf.cast(v, tf.float64) for v in values + [loss]])
    packed = F.all_reduce_sum(packed)
    unpacked = [tf.cast(packed[i], d) for i, d in enumerate(dtypes)]
    values, loss = unpacked[:-1], unpacked[-1]
    out, n_bad = {}, tf.constant(0, tf.int64)
    for n, x in zip(names, values):
        clean, bad = sanitize(x)
        out[n] = clean
        n_bad += tf.cast(bad, tf.int64)
    return out, loss, n_bad


def greedy_hypergradients(*args, **kwargs):
    """`hypergradients` followed by `reduce_and_sanitize`: (h, guidance_loss, n_nonfinite, result)."""
    result = hypergradients(*args, **kwargs)
    h, loss, n_bad = reduce_and_sanitize(result.hypergradients, result.guidance_loss)
    return h, loss, n_bad, result


def meta_update(meta_rule, raw, meta_slots, h, meta_hparams, meta_step):
    """One meta-optimizer step on each raw value: name -> (new_raw, new_slots).

    `meta_rule` is a pure `UpdateRule` (default: Adam); `h` must be the global sanitised
    hypergradient, so every replica computes the same new values.
    """
    out = {}
    for name in raw:
        out[name] = meta_rule.update(h[name], raw[name], meta_slots[name], meta_hparams, meta_step)
    return out


def guidance_shard_bounds(n: int, replica_id, num_replicas: int):
    """`[start, end)` of a replica's contiguous shard of `n` guidance examples."""
    start = (n * replica_id) // num_replicas
    end = (n * (replica_id + 1)) // num_replicas
    return start, end


__all__ = [
    "HypergradientResult",
    "activate",
    "activation_name",
    "greedy_hypergradients",
    "guidance_shard_bounds",
    "hyperparameters_from_raw",
    "hypergradients",
    "initial_raw",
    "lookahead",
    "meta_update",
    "reduce_and_sanitize",
    "sanitize",
]
