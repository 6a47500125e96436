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
By the chain rule ``h_k = < grad L_guide(theta_{t+1}), d theta_{t+1} / d raw_k >``. It
is computed without a Jacobian, a tape over the update, or a second model:

1. ``theta_{t+1}`` and, per learned value, the tangent ``d theta_{t+1} / d raw_k``: one
   evaluation of the elementwise update in forward mode (`update_with_tangents`,
   `forward_mode.Dual`). Its values are the step's update itself: `commit` assigns
   them, so the optimizer does not compute the update again;
2. ``v = grad L_guide(theta_{t+1})``: one forward + backward pass on the guidance batch
   (``training=False`` in the trainer: no dropout);
3. ``h_k = <v, tangent_k>``: one multiply-and-sum per variable and learned value.

Extra memory over plain training: one tangent per learned value (a parameter copy
each), held from the update to the end of the guidance pass; with `commit`, nothing
else (theta_{t+1} lives in the model's variables, g_t is freed after the update).
Without `commit`, also theta_{t+1} as a separate copy.

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

Backends
--------
On TensorFlow the tangents come from `tf_metaalign.forward_mode` (the rule runs once
with `forward_mode.Dual` hyperparameters). On JAX they come from JAX's own forward mode:
one `jax.jvp` of the whole update with respect to the raw values, the directions
batched by `jax.vmap` (the update's values are computed once, unbatched). The values are
the rule's own on both; under `jit` XLA fuses the update, its tangents and the commit,
so `commit` needs no groups there. On JAX there is one replica (`keras.distribution`
runs the step on the global batch), so the replica sums are the identity.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Mapping, Sequence

import keras
from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F

BACKEND = keras.backend.backend()

if BACKEND == "tensorflow":
    import tensorflow as tf

    from tf_metaalign import forward_mode as fm

    # TensorFlow's own ops: `forward_mode.Dual` raw values dispatch through them.
    _exp, _sigmoid, _minimum, _cast = tf.exp, tf.sigmoid, tf.minimum, tf.cast
    _is_dual = lambda x: isinstance(x, fm.Dual)  # noqa: E731
else:
    import jax

    fm = None
    _exp, _sigmoid, _minimum, _cast = ops.exp, ops.sigmoid, ops.minimum, ops.cast
    _is_dual = lambda x: False  # noqa: E731

#: value of a sigmoid-activated hyperparameter is capped at 1 - SIGMOID_CAP_MARGIN.
SIGMOID_CAP_MARGIN = 1e-5
#: a sigmoid-activated hyperparameter configured at 0 (e.g. Adafactor's beta_1=0.0) is
#: initialised here instead: logit(0) = -inf has no gradient, so it could never move.
SIGMOID_INIT_FLOOR = 1e-2
#: NaN hypergradients become 0 and +-inf become +-NONFINITE_REPLACEMENT (the reference).
NONFINITE_REPLACEMENT = 10.0
#: the name of the reference semantics (`activate`, `reduce_and_sanitize`, `guided_step`).
REFERENCE = "gradient_based_tuning"
#: the reference's sigmoid ceiling for beta_1/beta_2 ('sig' activation, activation_ceiling).
REFERENCE_SIGMOID_CEILING = 1.0 - 1e-5
#: the reference's inverse sigmoid clips the raw value to [-REFERENCE_RAW_BOUND, +...].
REFERENCE_RAW_BOUND = 500.0


# ----------------------------------------------------------------------- activations


def activation_name(name: str) -> str:
    """ "exp" for the learning rate (a scale of the schedule), "sigmoid" otherwise."""
    return "exp" if name == "learning_rate" else "sigmoid"


def activate(name: str, raw, reference: bool = False):
    """The hyperparameter value (or learning-rate scale) for a raw value; differentiable
    (by tapes, and in forward mode when `raw` is a `forward_mode.Dual`).

    The learning-rate scale is exp(raw) in both semantics. A coefficient is
    ``min(sigmoid(raw), 1 - 1e-5)`` by default; with `reference=True` it is the
    reference's 'sig' activation with steepness 1, floor 0 and ceiling 1 - 1e-5,
    ``(1 - 1e-5) * sigmoid(raw)`` (google-research `gradient_based_tuning`,
    guided_parameters_utils.activation_sig_fn and guided_parameters.lamb_adam_beta1): a
    slope smaller by the factor 1 - 1e-5 everywhere, and a value 1e-5 * sigmoid(raw) lower.

    Example:
      >>> from tf_metaalign.algorithms.guided import activate
      >>> raw = keras.ops.convert_to_tensor(2.0, "float32")
      >>> float(activate("beta_1", raw) - activate("beta_1", raw, reference=True)) > 5e-6
      True
    """
    if not _is_dual(raw):
        raw = ops.convert_to_tensor(raw)
    if activation_name(name) == "exp":
        return _exp(raw)
    if reference:
        return F.scalar(REFERENCE_SIGMOID_CEILING, raw.dtype) * _sigmoid(raw)
    # F.scalar: 1 - 1e-5 exact in raw's dtype (tf.cast would round it through float32).
    return _minimum(_sigmoid(raw), F.scalar(1.0 - SIGMOID_CAP_MARGIN, raw.dtype))


def initial_raw(name: str, value: float | None, reference: bool = False) -> float:
    """Inverse of `activate` for the initial value (a python float).

    The learning-rate scale starts at 1 (raw 0) whatever `value` is. A sigmoid
    hyperparameter starts at `value` clipped to [SIGMOID_INIT_FLOOR, 1 - 1e-5]
    (None counts as 0). With `reference=True`, the reference's inverse
    (guided_parameters_utils.activation_sig_inverter, ceiling c = 1 - 1e-5, floor 0):
    ``clip(-log(c / value - 1), -500, 500)``, so 0 maps to -500 (a coefficient that
    never moves: its gradient is 0) and c to 500; a value above c (where the reference
    takes the log of a negative number) is a ValueError.

    Example:
      >>> from tf_metaalign.algorithms.guided import initial_raw
      >>> round(initial_raw("beta_1", 0.9), 6), round(initial_raw("beta_1", 0.9, True), 6)
      (2.197225, 2.197325)
    """
    if activation_name(name) == "exp":
        return 0.0
    v = 0.0 if value is None else float(value)
    if reference:
        c = REFERENCE_SIGMOID_CEILING
        if v > c:
            raise ValueError(
                f"initial value of {name!r}: {v} is above the reference sigmoid's ceiling "
                f"1 - 1e-5 (reference={REFERENCE!r}); configure a smaller value."
            )
        if v <= 0.0:
            return -REFERENCE_RAW_BOUND
        if v == c:
            return REFERENCE_RAW_BOUND
        raw = -math.log(c / v - 1.0)
        return float(min(max(raw, -REFERENCE_RAW_BOUND), REFERENCE_RAW_BOUND))
    v = min(max(v, SIGMOID_INIT_FLOOR), 1.0 - SIGMOID_CAP_MARGIN)
    return float(math.log(v) - math.log1p(-v))


# ------------------------------------------------------------------ hyperparameters


def hyperparameters_from_raw(
    base_hparams: Mapping[str, Any],
    raw: Mapping[str, Any],
    dtype=None,
    reference: bool = False,
):
    """The `hparams` dict of `rule.update` with the learned values substituted.

    Args:
      base_hparams: the optimizer's hyperparameters for this step, with
        "learning_rate" = the SCHEDULE value (not multiplied by the learned scale).
      raw: name -> raw scalar (e.g. {"learning_rate": r1, "beta_1": r2}).
      dtype: dtype of the activated values handed to the rule (default: raw's dtype), or
        a dict name -> dtype. The trainer uses the dtypes of the optimizer's own variables
        (the learning-rate scale in floatx, float64 coefficients), so the rule sees exactly
        the values `BaseOptimizer` computes with: the learning rate is the schedule value
        times the scale, in the schedule value's dtype (float64 for a package optimizer's
        fixed rate), as `BaseOptimizer` multiplies them.
      reference: the reference's activations (`activate`).
    """
    hparams = dict(base_hparams)
    for name, r in raw.items():
        value = activate(name, r, reference)
        d = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        if d is not None:
            value = _cast(value, d)
        if name == "learning_rate":
            schedule = base_hparams["learning_rate"]
            if isinstance(schedule, numbers.Number):
                schedule = F.scalar(schedule, value.dtype)
            hparams["learning_rate"] = schedule * _cast(value, schedule.dtype)
        else:
            hparams[name] = value
    return hparams


# ------------------------------------------------------------------------- the step


def seeded_hyperparameters(base_hparams, raw, hparam_dtype=None, reference=False):
    """`hyperparameters_from_raw` with each raw value seeded as its own forward-mode
    direction: the learned entries are `forward_mode.Dual`s (direction k = raw k)."""
    names = list(raw)
    seeded = {name: fm.seed(raw[name], len(names), k) for k, name in enumerate(names)}
    return hyperparameters_from_raw(base_hparams, seeded, dtype=hparam_dtype, reference=reference)


#: the committed update runs in at most about this many sequential groups of variables.
UPDATE_GROUPS = 8


def _update_groups(params, max_groups=UPDATE_GROUPS):
    """Variable indices, largest first, cut into groups of at least 1/max_groups of the
    parameters each (a large variable is a group of its own)."""
    sizes = [math.prod(int(d or 0) for d in p.shape) for p in params]
    order = sorted(range(len(params)), key=lambda i: -sizes[i])
    target = sum(sizes) / max_groups
    groups, current, current_size = [], [], 0
    for i in order:
        current.append(i)
        current_size += sizes[i]
        if current_size >= target:
            groups.append(current)
            current, current_size = [], 0
    if current:
        groups.append(current)
    return groups


@dataclasses.dataclass
class UpdateWithTangents:
    """`update_with_tangents`'s result, one entry per variable.

    Attributes:
      new_params: theta_{t+1} at the given raw values (exactly `rule.update`'s values;
        with `commit`, the values `commit` returned).
      new_slots: the rule's new slots (dict per variable).
      tangents: per variable, one tensor per raw value: d theta_{t+1} / d raw_k.
    """

    new_params: list
    new_slots: list
    tangents: list


def update_with_tangents(
    rule,
    grads,
    params,
    slots,
    options,
    base_hparams,
    raw,
    step,
    hparam_dtype=None,
    commit=None,
    reference=False,
) -> UpdateWithTangents:
    """This step's update and its derivatives with respect to every raw value.

    One evaluation of `rule.update` per variable in forward mode (`forward_mode.Dual`):
    the update's values are computed by the same ops as in `rule.update`, and each op
    that depends on a raw value adds its tangent op, once per raw value.

    With `commit(i, new_var, new_slots) -> tensor` (see `hypergradients`), each variable's
    update is committed once its tangents exist, in a few groups of variables
    (`_update_groups`), each group after the previous group's commits, largest first:
    g_i and the update's temporaries are freed before the next group starts, so the
    extra memory peaks at about the rest of g_t plus one group's temporaries and
    tangents, instead of all tangents plus the temporaries of every variable at once;
    within a group the updates run in parallel (a chain of single small variables costs
    time on many-variable models). `new_params` then holds what `commit` returned.
    """
    grads, params, slots, options = list(grads), list(params), list(slots), list(options)
    if not (len(grads) == len(params) == len(slots) == len(options)):
        raise ValueError(
            "update_with_tangents: grads, params, slots and options must have one entry per "
            f"variable; got {len(grads)}, {len(params)}, {len(slots)}, {len(options)}."
        )
    n = len(raw)
    if BACKEND != "tensorflow":
        return _update_with_jvp(
            rule, grads, params, slots, options, base_hparams, raw, step, hparam_dtype, commit,
            reference,
        )  # fmt: skip
    hparams = seeded_hyperparameters(base_hparams, raw, hparam_dtype, reference)
    n_vars = len(params)
    out = UpdateWithTangents([None] * n_vars, [None] * n_vars, [None] * n_vars)
    groups = [list(range(n_vars))] if commit is None else _update_groups(params)
    previous = []
    for group in groups:
        committed = []
        with tf.control_dependencies(previous):
            for i in group:
                new_w, new_s = rule.update(grads[i], params[i], slots[i], hparams, step, options[i])
                t = fm.tangents(new_w, n)
                new_w = fm.primal(new_w)
                new_s = {k: fm.primal(x) for k, x in new_s.items()}
                if commit is not None:
                    # The tangents read theta_t, g_t and the old slots: computed before
                    # the assignment, so nothing of the old step outlives it.
                    with tf.control_dependencies(t):
                        new_w = commit(i, new_w, new_s)
                    committed.append(new_w)
                out.new_params[i], out.new_slots[i], out.tangents[i] = new_w, new_s, t
        previous = committed
    return out


def _update_with_jvp(
    rule, grads, params, slots, options, base_hparams, raw, step, hparam_dtype, commit, reference
):
    """`update_with_tangents` on JAX: the update of every variable under one `jax.jvp` with
    respect to the raw values, its directions batched by `jax.vmap` (the values, which do
    not depend on the tangents, are computed once: `out_axes=None`)."""
    names = list(raw)
    point = tuple(ops.convert_to_tensor(raw[n]) for n in names)

    def update(*values):
        hparams = hyperparameters_from_raw(
            base_hparams, dict(zip(names, values)), dtype=hparam_dtype, reference=reference
        )
        new = [
            rule.update(g, w, s, hparams, step, o)
            for g, w, s, o in zip(grads, params, slots, options)
        ]
        return [w for w, _ in new], [s for _, s in new]

    def along(direction):
        (new_params, new_slots), (tangents, _) = jax.jvp(update, point, tuple(direction))
        return (new_params, new_slots), tangents

    n = len(names)
    directions = [
        ops.convert_to_tensor([[float(i == k) for k in range(n)] for i in range(n)], p.dtype)[:, j]
        for j, p in enumerate(point)
    ]
    (new_params, new_slots), tangents = jax.vmap(along, out_axes=(None, 0))(directions)
    # per variable, one tangent per raw value
    tangents = [[t[k] for k in range(n)] for t in tangents]
    if commit is not None:
        new_params = [commit(i, w, s) for i, (w, s) in enumerate(zip(new_params, new_slots))]
    return UpdateWithTangents(list(new_params), list(new_slots), tangents)


def _inner(v, t):
    """<v, t> for a dense or IndexedSlices (embedding) gradient v, in v's dtype.

    `reduce_sum(v * t)`: on CPU 3x faster than `tensordot` of the flattened tensors (a
    matrix product of shapes (1, n) and (n, 1)), measured on 4M-element float32 tensors."""
    if BACKEND == "tensorflow" and isinstance(v, tf.IndexedSlices):
        v, t = v.values, tf.gather(t, v.indices)
    return ops.sum(v * ops.cast(t, v.dtype))


@dataclasses.dataclass
class HypergradientResult:
    """What `hypergradients` computes (local, per-replica units; see the module doc).

    Attributes:
      hypergradients: name -> d L_guide / d raw (scalar, raw's dtype).
      guidance_loss: the guidance loss at theta_{t+1} (times `guidance_weight`).
      new_params: theta_{t+1} at the given raw values.
      new_slots: the optimizer slots after this step's update.
      guidance_aux: the guidance loss function's aux output ((new_state, y_pred)).

    Example:
      >>> from tf_metaalign.algorithms import HypergradientResult
      >>> import dataclasses
      >>> [field.name for field in dataclasses.fields(HypergradientResult)][:2]
      ['hypergradients', 'guidance_loss']
    """

    hypergradients: dict
    guidance_loss: Any
    new_params: list
    new_slots: list
    guidance_aux: Any


def hypergradients(
    guide_loss_fn: Callable,
    rule,
    grads: Sequence[Any],
    params: Sequence[Any],
    slots: Sequence[Mapping[str, Any]],
    options: Sequence[Mapping | None],
    base_hparams: Mapping[str, Any],
    raw: Mapping[str, Any],
    step,
    state: Sequence[Any],
    guidance_batch,
    guidance_weight=None,
    hparam_dtype=None,
    commit=None,
    reference=False,
) -> HypergradientResult:
    """The greedy hypergradient ``d L_guide(theta_{t+1}(raw)) / d raw`` (local value).

    Args:
      guide_loss_fn: `loss_fn(params, state, batch) -> (loss, aux)` for the guidance
        loss (for a Keras model: `functional.make_loss_fn(model, loss, training=False)`).
      rule: the optimizer's pure `UpdateRule`.
      grads: the global (all-reduced, unscaled) training gradient g_t, one per variable.
      params: theta_t.
      slots: per variable, dict slot name -> tensor (slots before the step).
      options: per variable, the rule's static options (or None).
      base_hparams: the rule's hyperparameters for this step, "learning_rate" being the
        schedule value without the learned scale.
      raw: name -> raw scalar tensor of the learned hyperparameters.
      step: the 1-based update count of this step.
      state: the model's non-trainable state for the guidance evaluation.
      guidance_batch: `(x, y)` or `(x, y, sample_weight)`.
      guidance_weight: multiplies the guidance loss (unequal replica shards); None = 1.
      hparam_dtype: dtype of the activated values given to the rule (None: raw's dtype).
      commit: optional `commit(i, new_var, new_slots) -> tensor`: called for each
        variable once its update and tangents exist, e.g. to assign them to the model
        and optimizer; returns the value of theta_{t+1} to evaluate the guidance loss at
        (the variable read after its assignment). Saves the optimizer recomputing the
        update and keeps no separate copy of theta_{t+1}.
      reference: the reference's activations (`activate`).

    Returns:
      A `HypergradientResult` in per-replica units: call `reduce_and_sanitize` (inside
      the same replica context) for the global, sanitised values.

    Example:
      >>> from tf_metaalign.algorithms import hypergradients
      >>> from tf_metaalign.optimizers import SGDRule
      >>> def loss_fn(params, state, batch):  # (x w - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> w = keras.ops.convert_to_tensor(0.0)
      >>> g = keras.ops.convert_to_tensor(-4.0)  # the training gradient at w, of (w - 2)^2
      >>> result = hypergradients(
      ...     loss_fn, SGDRule(), [g], [w], [{}], [None], {"learning_rate": 0.25},
      ...     raw={"learning_rate": keras.ops.convert_to_tensor(0.0)}, step=1, state=[],
      ...     guidance_batch=(1.0, 2.0),
      ... )
      >>> float(result.new_params[0]), float(result.guidance_loss)  # w_1 = 0.25 e^raw * 4
      (1.0, 1.0)
      >>> float(result.hypergradients["learning_rate"])  # 2 (w_1 - 2) * dw_1/draw = -2 * 1
      -2.0

    References:
      Lichtarge, Alberti & Kumar, "Simple and Effective Gradient-Based Tuning of
      Sequence-to-Sequence Models" (guided learning; official JAX code: google-research
      `gradient_based_tuning`).
    """
    names = list(raw)
    raw_t = {n: ops.convert_to_tensor(raw[n]) for n in names}

    # Pass 1: theta_{t+1} and its tangents d theta_{t+1} / d raw_k (forward mode),
    # committed group by group when `commit` is given.
    look = update_with_tangents(
        rule,
        grads,
        params,
        slots,
        options,
        base_hparams,
        raw_t,
        step,
        hparam_dtype,
        commit,
        reference,
    )
    eval_params = look.new_params

    def weighted_loss_fn(p, s, b):
        value, aux = guide_loss_fn(p, s, b)
        if len(value.shape) != 0:  # a replica's empty shard: Keras's loss of no example is []
            value = ops.sum(value)
        if guidance_weight is not None:
            value = value * ops.cast(guidance_weight, value.dtype)
        return value, aux

    # Pass 2: v = grad L_guide(theta_{t+1}).
    guide_loss, v, aux = F.value_and_grad(weighted_loss_fn, eval_params, state, guidance_batch)

    # h_k = <v, d theta_{t+1} / d raw_k>, summed per variable in v's dtype and across
    # variables in float64.
    acc = F.accumulation_dtype(list(raw_t.values()))
    h = {}
    for k, name in enumerate(names):
        terms = [ops.cast(_inner(v_i, t_i[k]), acc) for v_i, t_i in zip(v, look.tangents)]
        h[name] = ops.cast(backend.add_n(terms), raw_t[name].dtype)
    return HypergradientResult(
        hypergradients=h,
        guidance_loss=guide_loss,
        new_params=look.new_params,
        new_slots=look.new_slots,
        guidance_aux=aux,
    )


def sanitize(h):
    """NaN -> 0, +inf -> +10, -inf -> -10 (the reference); returns (value, is_nonfinite)."""
    h = ops.convert_to_tensor(h)
    bad = ops.logical_not(ops.isfinite(h))
    limit = F.scalar(NONFINITE_REPLACEMENT, h.dtype)
    clean = ops.where(ops.isnan(h), ops.zeros_like(h), ops.clip(h, -limit, limit))
    clean = ops.where(bad, clean, h)
    return clean, bad


def clip_meta_gradient(h, limit):
    """`h` clipped to [-limit, limit] (the reference's ``--use_grad_clip``
    ``--grad_clip_limit``: `jnp.clip` of the averaged, sanitised hypergradient); None or 0
    leaves it unchanged.

    Example:
      >>> from tf_metaalign.algorithms.guided import clip_meta_gradient
      >>> float(clip_meta_gradient(keras.ops.convert_to_tensor(-3.0), 1.0))
      -1.0
    """
    if not limit:
        return h
    h = ops.convert_to_tensor(h)
    return ops.clip(h, -F.scalar(limit, h.dtype), F.scalar(limit, h.dtype))


def reduce_and_sanitize(
    hypergrads: Mapping[str, Any], guidance_loss, reference: bool = False, clip=None
):
    """Sum local hypergradients and guidance losses over replicas, then sanitise.

    Returns `(hypergradients, guidance_loss, n_nonfinite)`: dict name -> global sanitised
    scalar, the global guidance loss, and the number (int64) of non-finite entries
    replaced this step. Must be called in a replica context (or outside any strategy).

    With `reference=True` the order is the reference's (train.py's guidance step: each
    device's hypergradient goes through `jnp.nan_to_num(..., posinf=10, neginf=-10)`, then
    `jax.lax.pmean`): each replica's local value is brought to the units of a whole-batch
    value (times the replica count, as a device's mean over its shard is), sanitised, and
    the replicas' values are averaged; `n_nonfinite` counts every replica's replacements.
    The orders agree with one replica and whenever everything is finite; with a non-finite
    local value on one of R replicas, the default gives +-10 (or 0) for the sum while the
    reference averages +-10 with the other replicas' finite values. `clip` (a positive
    float or None) then clips the result (`clip_meta_gradient`), in either order.
    """
    names = list(hypergrads)
    values = [ops.convert_to_tensor(hypergrads[n]) for n in names]
    loss = ops.convert_to_tensor(guidance_loss)
    dtypes = [v.dtype for v in values] + [loss.dtype]
    replicas = F.num_replicas()
    counter = F.counter_dtype()
    # The widest float this backend holds (float32 on JAX without x64).
    wide = "float64" if counter == "int64" else "float32"
    n_bad = ops.convert_to_tensor(0, counter)
    if reference:
        local = []
        for x in values:
            clean, bad = sanitize(x * F.scalar(replicas, x.dtype))
            local.append(clean)
            n_bad += ops.cast(bad, counter)
        values = local
    # One all-reduce of a single dtype (a batched all-reduce concatenates its inputs).
    packed = ops.stack([ops.cast(v, wide) for v in values + [loss]])
    if reference:
        packed = ops.concatenate([packed, ops.cast(n_bad, wide)[None]], 0)
    packed = F.all_reduce_sum(packed)
    unpacked = [ops.cast(packed[i], d) for i, d in enumerate(dtypes)]
    values, loss = unpacked[:-1], unpacked[-1]
    out = {}
    if reference:
        n_bad = ops.cast(packed[-1], counter)
        for n, x in zip(names, values):
            out[n] = clip_meta_gradient(x / F.scalar(replicas, x.dtype), clip)
        return out, loss, n_bad
    for n, x in zip(names, values):
        clean, bad = sanitize(x)
        out[n] = clip_meta_gradient(clean, clip)
        n_bad += ops.cast(bad, counter)
    return out, loss, n_bad


def greedy_hypergradients(*args, **kwargs):
    """`hypergradients`, then `reduce_and_sanitize`: (h, guidance_loss, n_nonfinite, result).

    Args:
      *args: as for `hypergradients`.
      **kwargs: as for `hypergradients`.

    Returns:
      `(h, guidance_loss, n_nonfinite, result)`: the global sanitised hypergradients
      (name -> scalar), the global guidance loss, the number of non-finite entries
      replaced, and the `HypergradientResult`.

    Example:
      >>> from tf_metaalign.algorithms import greedy_hypergradients
      >>> from tf_metaalign.optimizers import SGDRule
      >>> def loss_fn(params, state, batch):
      ...     x, y = batch
      ...     y_pred = x * params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> scalar = keras.ops.convert_to_tensor
      >>> h, loss, n_nonfinite, _ = greedy_hypergradients(
      ...     loss_fn, SGDRule(), [scalar(-4.0)], [scalar(0.0)], [{}], [None],
      ...     {"learning_rate": 0.25}, raw={"learning_rate": scalar(0.0)}, step=1,
      ...     state=[], guidance_batch=(1.0, 2.0),
      ... )
      >>> float(h["learning_rate"]), float(loss), int(n_nonfinite)
      (-2.0, 1.0, 0)
    """
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


@dataclasses.dataclass
class GuidedStepResult:
    """What `guided_step` computes (global values, identical on every replica).

    Attributes:
      hypergradients: key -> sanitised global d L_guide / d raw (zeros when not applied).
      guidance_loss: the global guidance loss at theta_{t+1} (0 when not applied).
      n_nonfinite: int64, non-finite hypergradient entries replaced this step.
      values: key -> the activated value at raw_t that this step's update uses.
      new_raw: key -> raw_{t+1} (raw_t where not applied).
      new_meta_slots: key -> the meta-optimizer's slots after the step.
      update: the `UpdateWithTangents` of the step when it was computed (theta_{t+1},
        committed when `commit` was given), else None.
    """

    hypergradients: dict
    guidance_loss: Any
    n_nonfinite: Any
    values: dict
    new_raw: dict
    new_meta_slots: dict
    update: Any = None


def guided_step(
    guide_loss_fn: Callable,
    rule,
    grads,
    params,
    slots,
    options,
    base_hparams,
    raw,
    step,
    state,
    guidance_batch,
    *,
    meta_rule,
    meta_slots,
    meta_hparams,
    meta_step,
    apply=True,
    guidance_weight=None,
    hparam_dtype=None,
    commit=None,
    reference=False,
    meta_gradient_clip=None,
) -> GuidedStepResult:
    """One greedy guided-learning step on the learned raw values (pure but for `commit`).

    The hypergradient of the guidance loss at theta_{t+1} (`hypergradients`), summed
    over replicas and sanitised (`reduce_and_sanitize`), then one `meta_rule` step on
    every raw value (`meta_update`). Call it in a replica context (or outside any
    strategy) after the training gradient is known:

        loss, g, (new_state, _) = functional.value_and_grad(train_loss_fn, params, state, batch)
        grads = functional.all_reduce_sum(g)          # the global gradient g_t
        r = guided_step(guide_loss_fn, rule, grads, params, slots, options, base, raw, t,
                        new_state, guidance_batch, meta_rule=..., meta_slots=...,
                        meta_hparams={"learning_rate": meta_lr}, meta_step=s)
        # then: update the model with the hyperparameters r.values (the step's
        # lambda_t), and store r.new_raw / r.new_meta_slots.

    Args (besides those of `hypergradients`, keyed by the rule's hyperparameter names):
      meta_rule, meta_slots, meta_hparams, meta_step: the meta-optimizer's pure rule,
        its slots per raw value, its hyperparameters and 1-based step.
      apply: python True or a bool tensor: take the hypergradient step now (False:
        the raw values and meta slots are returned unchanged, nothing is computed but
        under `tf.cond`; the cond holds no cross-replica communication, so it is valid
        under any strategy). `commit` needs `apply=True`.
      commit: see `hypergradients` (commits theta_{t+1} as it is computed).
      reference: the reference's semantics (google-research `gradient_based_tuning`):
        its activations (`activate`) and its order of sanitising and averaging over
        replicas (`reduce_and_sanitize`). The rules (flax's Adam / LAMB) are the
        caller's choice: `meta_rule` and `rule`.
      meta_gradient_clip: clip the global hypergradient to [-c, c] before the meta step
        (the reference's `--use_grad_clip --grad_clip_limit=c`); None: no clipping.
    """
    names = list(raw)
    raw = {n: ops.convert_to_tensor(raw[n]) for n in names}
    if commit is not None and apply is not True:
        raise ValueError("guided_step: `commit` needs apply=True (every step takes the update).")
    holder = {}
    # The guidance loss in the parameters' accumulation dtype (float64 for float64 weights).
    loss_dtype = F.accumulation_dtype(list(params))

    def compute():
        result = hypergradients(
            guide_loss_fn,
            rule,
            grads,
            params,
            slots,
            options,
            base_hparams,
            raw,
            step,
            state,
            guidance_batch,
            guidance_weight=guidance_weight,
            hparam_dtype=hparam_dtype,
            commit=commit,
            reference=reference,
        )
        holder["update"] = UpdateWithTangents(result.new_params, result.new_slots, [])
        return [result.hypergradients[n] for n in names], ops.cast(result.guidance_loss, loss_dtype)

    # No cross-replica communication inside (reduce_and_sanitize comes after): a plain
    # conditional under any strategy.
    h_local, loss_local = F.replica_safe_cond(
        apply,
        compute,
        lambda: ([ops.zeros((), raw[n].dtype) for n in names], ops.zeros((), loss_dtype)),
        communicates=False,
    )
    if apply is not True:
        holder.pop("update", None)  # built inside the cond: not usable outside it
    h, guidance_loss, n_bad = reduce_and_sanitize(
        dict(zip(names, h_local)), loss_local, reference=reference, clip=meta_gradient_clip
    )
    updated = meta_update(meta_rule, raw, meta_slots, h, meta_hparams, meta_step)
    keep = apply is True

    def select(new, old):
        return new if keep else ops.where(apply, new, old)

    return GuidedStepResult(
        hypergradients=h,
        guidance_loss=guidance_loss,
        n_nonfinite=n_bad if keep else ops.where(apply, n_bad, ops.zeros_like(n_bad)),
        values={n: activate(n, raw[n], reference) for n in names},
        new_raw={n: select(updated[n][0], raw[n]) for n in names},
        new_meta_slots={
            n: {k: select(v, meta_slots[n][k]) for k, v in updated[n][1].items()} for n in names
        },
        update=holder.get("update"),
    )


def guidance_shard_bounds(n: int, replica_id, num_replicas: int):
    """`[start, end)` of a replica's contiguous shard of `n` guidance examples."""
    start = (n * replica_id) // num_replicas
    end = (n * (replica_id + 1)) // num_replicas
    return start, end


__all__ = [
    "GuidedStepResult",
    "HypergradientResult",
    "activate",
    "activation_name",
    "clip_meta_gradient",
    "greedy_hypergradients",
    "guided_step",
    "guidance_shard_bounds",
    "hyperparameters_from_raw",
    "hypergradients",
    "initial_raw",
    "meta_update",
    "reduce_and_sanitize",
    "sanitize",
    "update_with_tangents",
    "UpdateWithTangents",
]
