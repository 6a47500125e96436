"""Which optimizers an algorithm can differentiate through (guided learning's hypergradient).

Guided learning differentiates one update with respect to its hyperparameters in forward
mode: on TensorFlow the rule runs with the hyperparameters as `forward_mode.Dual`s
(`tf_metaalign.forward_mode`), on JAX under `jax.jvp`. So an optimizer is supported when
its rule runs that way, which `forward_mode_error` checks by running it, not by its class:

* `forward_mode_error(optimizer)` / `supports_forward_mode(optimizer)`: the contract, probed;
* `supported_optimizers()`: the exported optimizer classes whose default configuration
  passes; `optimizer_classes()`: every exported optimizer class;
* `check_optimizer(optimizer, context)`: the checks guided learning makes on the optimizer
  it trains with; `resolve_hyperparameters(optimizer, names)`: learned names -> the
  optimizer's own;
* `as_rule_optimizer(optimizer)`: a Keras `Adam`/`AdamW`/`SGD` as the tf_metaalign optimizer
  with the identical rule (guided learning converts its optimizer and `meta_optimizer` so).
"""

import contextlib
import functools
import warnings

import keras
import numpy as np

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers.adam import Adam, AdamW
from tf_metaalign.optimizers.base import BaseOptimizer
from tf_metaalign.optimizers.sgd import SGD

if M.BACKEND == "tensorflow":
    import tensorflow as tf

    from tf_metaalign import forward_mode

    _eager_scope = tf.init_scope
else:
    _eager_scope = contextlib.nullcontext

#: variable shapes the probe runs the rule on: a scalar, a vector, a small matrix, and one
#: large enough for Adafactor's default `min_dim_size_to_factor=128` to factor.
PROBE_SHAPES = ((), (3,), (4, 3), (256, 192))
#: the learning rate `supported_optimizers` constructs each class with (Adafactor has no
#: default); the probe does not depend on its value.
PROBE_LEARNING_RATE = 0.01
#: hyperparameter names accepted as another name for the optimizer's own (SGD's momentum
#: is its first-moment coefficient, the paper's beta_1).
ALIASES = {"beta_1": ("momentum",)}


# ------------------------------------------------------------------------ forward mode


def forward_mode_error(optimizer):
    """None when `optimizer`'s update has forward-mode derivatives, else the reason.

    Runs `optimizer.rule.update` once per shape of `PROBE_SHAPES` (float32 variable, the
    rule's default options, positive slots, step 2) with every name of
    `optimizer.differentiable_hyperparameters` seeded as its own forward-mode direction
    (a `forward_mode.Dual` on TensorFlow, a `jax.jvp` tangent on JAX), at the values
    `optimizer.hyperparameters_at(0)` gives, and asks for the tangents of the new
    variable. An op without a forward-mode rule raises a TypeError there (`forward_mode`;
    on JAX, any op JAX cannot trace), whose message is returned. A branch of the rule that
    only other shapes or options take is not probed. Runs eagerly (`tf.init_scope` on
    TensorFlow), also when called while tracing a `tf.function`.

    Args:
      optimizer: a `BaseOptimizer`.

    Returns:
      None, or the reason (a string).

    Example:
      >>> from tf_metaalign.optimizers import Adam, forward_mode_error
      >>> print(forward_mode_error(Adam()))
      None
    """
    if not isinstance(optimizer, BaseOptimizer):
        return (
            f"{type(optimizer).__module__}.{type(optimizer).__name__} is not a "
            "tf_metaalign optimizer (it has no pure update rule)"
        )
    rule = optimizer.rule
    names = tuple(optimizer.differentiable_hyperparameters)
    with _eager_scope():
        hparams = dict(optimizer.hyperparameters_at(M.constant(0, M.counter_dtype())))
        values = []
        for name in names:
            value = hparams.get(name, rule.defaults.get(name))
            if value is None:
                return (
                    f"{type(optimizer).__name__} lists {name!r} in "
                    "`differentiable_hyperparameters` but has no value for it"
                )
            if isinstance(value, (int, float)):
                value = M.constant(float(value), M.wide_float())
            values.append(value)
        rng = np.random.default_rng(0)
        for shape in PROBE_SHAPES:
            options = rule.default_options(shape)
            var = M.constant(rng.normal(size=shape), "float32")
            grad = M.constant(rng.normal(size=shape), "float32")
            slots = {
                slot: M.constant(rng.uniform(0.1, 1.0, size=slot_shape), "float32")
                for slot, slot_shape in rule.slot_shapes(shape, options).items()
            }
            try:
                _probe_tangents(rule, grad, var, slots, hparams, names, values, options)
            except TypeError as error:
                return (
                    f"{type(optimizer).__name__}'s rule has no forward-mode derivative with "
                    f"respect to {list(names)} (a variable of shape {shape}): {error}"
                )
    return None


def _probe_tangents(rule, grad, var, slots, hparams, names, values, options):
    """The tangents of one update along each of `names` (a TypeError when the rule has
    none): `forward_mode.Dual`s on TensorFlow, `jax.jvp` on JAX."""
    if M.BACKEND == "tensorflow":
        hparams = dict(hparams)
        for k, (name, value) in enumerate(zip(names, values)):
            hparams[name] = forward_mode.seed(value, len(names), k)
        new_var, _ = rule.update(grad, var, slots, hparams, 2.0, options)
        return forward_mode.tangents(new_var, len(names))
    import jax

    def update(*point):
        return rule.update(grad, var, slots, {**hparams, **dict(zip(names, point))}, 2.0, options)[
            0
        ]

    values = tuple(M.convert_to_tensor(v) for v in values)

    def tangents():
        return [
            jax.jvp(
                update,
                values,
                tuple(M.constant(float(i == k), M.dtype_of(v)) for i, v in enumerate(values)),
            )[1]
            for k in range(len(values))
        ]

    try:
        # Traced, not run: whether JAX can differentiate the rule is a property of its
        # trace (and tracing is ~10x cheaper than running the ops one by one).
        return jax.eval_shape(tangents)
    except (TypeError, ImportError, NotImplementedError, ValueError) as error:
        # e.g. a rule written in TensorFlow's ops, which JAX cannot trace
        raise TypeError(f"{type(error).__name__}: {error}") from None


def supports_forward_mode(optimizer):
    """Whether `optimizer`'s update has forward-mode derivatives (`forward_mode_error`).

    Args:
      optimizer: a `BaseOptimizer`.

    Example:
      >>> from tf_metaalign.optimizers import SGD, supports_forward_mode
      >>> supports_forward_mode(SGD(momentum=0.9, nesterov=True))
      True
    """
    return forward_mode_error(optimizer) is None


def optimizer_classes():
    """The optimizer classes `tf_metaalign.optimizers` exports (each `BaseOptimizer`
    subclass in its `__all__` that this backend can import), sorted by name.

    Example:
      >>> from tf_metaalign.optimizers import optimizer_classes
      >>> [cls.__name__ for cls in optimizer_classes()]
      ['Adafactor', 'Adam', 'AdamW', 'AdamWeightDecay', 'Lamb', 'RecAdam', 'SGD']
    """
    from tf_metaalign import optimizers  # the package, which imports this module

    classes = []
    for name in optimizers.__all__:
        try:
            obj = getattr(optimizers, name)
        except ImportError:  # not on this backend (a module that needs TensorFlow)
            continue
        if isinstance(obj, type) and issubclass(obj, BaseOptimizer) and obj is not BaseOptimizer:
            classes.append(obj)
    return sorted(classes, key=lambda cls: cls.__name__)


@functools.lru_cache(maxsize=None)
def supported_optimizers():
    """Names (sorted) of the exported optimizer classes whose default configuration
    (`cls(learning_rate=PROBE_LEARNING_RATE)`) passes `forward_mode_error`.

    Example:
      >>> from tf_metaalign.optimizers import supported_optimizers
      >>> supported_optimizers()
      ('Adafactor', 'Adam', 'AdamW', 'AdamWeightDecay', 'Lamb', 'RecAdam', 'SGD')
    """
    names = []
    for cls in optimizer_classes():
        # A probe, not the user's optimizer: no constructor warnings (RecAdam's defaults warn).
        with _eager_scope(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = cls(learning_rate=PROBE_LEARNING_RATE)
        if forward_mode_error(optimizer) is None:
            names.append(cls.__name__)
    return tuple(names)


# ----------------------------------------------------------------- guided learning


def _unsupported_optimizer_error(optimizer, context="GuidedTrainer"):
    return ValueError(
        f"{context} differentiates through the optimizer's update, so the optimizer must be "
        f"one of tf_metaalign.optimizers: {', '.join(supported_optimizers())} (each has a pure "
        f"update rule); got {type(optimizer).__module__}.{type(optimizer).__name__}. "
        "Keras's built-in optimizers are not differentiable here: replace "
        "keras.optimizers.Adam(...) by tf_metaalign.optimizers.Adam(...) "
        "(tf_metaalign.optimizers.as_rule_optimizer converts a Keras Adam, AdamW or SGD; "
        "GuidedTrainer.compile converts them itself)."
    )


def check_optimizer(optimizer, context="GuidedTrainer"):
    """Raises a ValueError unless guided learning can differentiate `optimizer`'s update.

    It must be a tf_metaalign optimizer whose rule passes `forward_mode_error`, without
    LossScaleOptimizer, Keras's per-replica clipping (`clipnorm`, `global_clipnorm`,
    `clipvalue`), Keras's generic `weight_decay` or `gradient_accumulation_steps`.
    `context` names the caller in the messages.

    Args:
      optimizer: the optimizer to check.
      context: the caller's name, for the messages.

    Example:
      >>> from tf_metaalign.optimizers import Adam, check_optimizer
      >>> check_optimizer(Adam())  # passes
      >>> try:
      ...     check_optimizer(keras.optimizers.Adam())
      ... except ValueError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      GuidedTrainer differentiates through the optimizer's update, so the optimizer must ...
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"{context} does not support LossScaleOptimizer (mixed_float16): train in float32 "
            "or bfloat16 (mixed_bfloat16 needs no loss scaling)."
        )
    if not isinstance(optimizer, BaseOptimizer):
        raise _unsupported_optimizer_error(optimizer, context)
    for attr in ("clipnorm", "global_clipnorm", "clipvalue"):
        if getattr(optimizer, attr, None) is not None:
            raise ValueError(
                f"{context}: the optimizer's `{attr}` clips each replica's gradient before the "
                "all-reduce, which the differentiated update cannot reproduce; use the "
                "optimizer's `aggregated_clipnorm` instead."
            )
    if getattr(optimizer, "weight_decay", None) and not optimizer.rule_applies_weight_decay:
        raise ValueError(
            f"{context}: Keras's generic `weight_decay` argument is applied outside the "
            "optimizer's rule; use tf_metaalign.optimizers.AdamW (Keras's decoupled decay in "
            "the rule) or AdamWeightDecay/Lamb/Adafactor's `weight_decay_rate`."
        )
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps not in (None, 1):
        raise ValueError(
            f"{context} does not support gradient_accumulation_steps={steps}: the hypergradient "
            "is taken through every optimizer update."
        )
    reason = forward_mode_error(optimizer)
    if reason is not None:
        raise ValueError(
            f"{context} differentiates through the optimizer's update in forward mode "
            f"(tf_metaalign.forward_mode), which this optimizer does not support: {reason}. "
            f"Supported: {', '.join(supported_optimizers())}."
        )


def resolve_hyperparameters(optimizer, names, explicit=True):
    """Maps requested names to the optimizer's hyperparameter names.

    An unknown name raises an error listing the optimizer's differentiable
    hyperparameters; with `explicit=False` (the default names) a name the optimizer lacks
    is dropped.

    Args:
      optimizer: a `BaseOptimizer`.
      names: the requested names (e.g. guided learning's "learning_rate", "beta_1").
      explicit: whether the user named them (False: defaults, dropped when missing).

    Returns:
      A dict requested name -> optimizer name ("learning_rate" -> "learning_rate",
      "beta_1" -> "beta_1", or "momentum" for SGD with momentum).

    Example:
      >>> from tf_metaalign.optimizers import SGD, resolve_hyperparameters
      >>> resolve_hyperparameters(SGD(momentum=0.9), ["learning_rate", "beta_1"])
      {'learning_rate': 'learning_rate', 'beta_1': 'momentum'}
      >>> resolve_hyperparameters(SGD(), ["learning_rate", "beta_1"], explicit=False)
      {'learning_rate': 'learning_rate'}
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
                    if type(optimizer).__name__ == "Adafactor" and name == "beta_1"
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


# ------------------------------------------------------------- Keras optimizers


#: `keras.optimizers.Optimizer` arguments every tf_metaalign optimizer passes through to Keras.
_KERAS_BASE_ARGUMENTS = (
    "name",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def _learning_rate_from_config(config, optimizer):
    """The learning rate in a Keras optimizer's config: a float, or the deserialized
    schedule (a `LearningRateSchedule`) or callable."""
    value = config["learning_rate"]
    if isinstance(value, np.floating):  # Keras's JAX config holds a NumPy float32
        value = float(value)
    if isinstance(value, float):
        held = getattr(optimizer, "_learning_rate", None)
        if isinstance(held, keras.Variable) and held.dtype == "float32":
            # Keras held the rate in float32 (its config reads 0.0010000000474974513 for
            # 1e-3); the package's optimizers hold it in float64: take the shortest decimal
            # that rounds to the same float32 (the number the user wrote), so the converted
            # optimizer's float32 steps are Keras's and its float64 uses are exact.
            value = float(np.format_float_scientific(np.float32(value), unique=True))
        return value
    if not isinstance(value, dict):
        return value
    try:
        return keras.saving.deserialize_keras_object(value)
    except Exception as error:  # whatever deserialization raises, say which argument failed
        raise ValueError(
            f"as_rule_optimizer: cannot rebuild the learning rate of {type(optimizer).__name__} "
            f"from its config ({value!r}): {error}. Register the schedule with "
            "keras.saving.register_keras_serializable, or build the tf_metaalign optimizer "
            "directly."
        ) from None


def _keras_weight_decay_exclusions(source, target):
    """Carries Keras's `exclude_from_weight_decay(var_list, var_names)` state over (private
    Keras attributes, read as Keras's own `_use_weight_decay` reads them)."""
    variables = getattr(source, "_exclude_from_weight_decay", None)
    pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
    if variables:
        target._exclude_from_weight_decay = set(variables)
    if pattern is not None:
        target._exclude_from_weight_decay_pattern = pattern
    target._exclude_from_weight_decay_cache = dict()


#: what `as_rule_optimizer` converts: Keras class -> (tf_metaalign class, rule arguments).
_CONVERTIBLE = {
    keras.optimizers.Adam: (Adam, ("beta_1", "beta_2", "epsilon")),
    keras.optimizers.AdamW: (AdamW, ("beta_1", "beta_2", "epsilon", "weight_decay")),
    keras.optimizers.SGD: (SGD, ("momentum", "nesterov")),
}


def as_rule_optimizer(optimizer):
    """A tf_metaalign optimizer with the same update as `optimizer` (its configuration, not
    its state: iterations and slots start afresh).

    * a tf_metaalign optimizer (`BaseOptimizer`) is returned unchanged;
    * `keras.optimizers.Adam` (amsgrad=False) -> `tf_metaalign.optimizers.Adam`, or
      `tf_metaalign.optimizers.AdamW` when it has a `weight_decay` (Keras's Adam with
      `weight_decay` is AdamW: the same decoupled decay);
    * `keras.optimizers.AdamW` (amsgrad=False) -> `tf_metaalign.optimizers.AdamW`, with the
      exclusions set by `exclude_from_weight_decay()`;
    * `keras.optimizers.SGD` (momentum, nesterov; no `weight_decay`) ->
      `tf_metaalign.optimizers.SGD`;
    with the learning rate (float, or the schedule rebuilt from the config), the rule's
    coefficients and Keras's own arguments (name, clipping, EMA, ...) taken from the public
    `get_config()`. The rules are Keras's own, rewritten as pure functions, so
    `apply_gradients` gives the same updates. Anything else (other classes, subclasses,
    amsgrad, SGD's weight_decay) raises a ValueError saying what is supported.

    Args:
      optimizer: a Keras or tf_metaalign optimizer.

    Returns:
      A `BaseOptimizer`.

    Example:
      >>> from tf_metaalign.optimizers import as_rule_optimizer
      >>> opt = as_rule_optimizer(keras.optimizers.Adam(0.01, weight_decay=0.1))
      >>> # the rate is held in float64 (float32 on JAX without x64): rounded here
      >>> type(opt).__name__, round(float(opt.learning_rate), 6), opt.weight_decay
      ('AdamW', 0.01, 0.1)
    """
    if isinstance(optimizer, BaseOptimizer):
        return optimizer
    kind = type(optimizer)
    if kind not in _CONVERTIBLE:
        raise ValueError(
            "as_rule_optimizer: supported are the tf_metaalign optimizers "
            f"({', '.join(cls.__name__ for cls in optimizer_classes())}), "
            "keras.optimizers.Adam / AdamW (amsgrad=False) and keras.optimizers.SGD; got "
            f"{kind.__module__}.{kind.__name__}."
        )
    config = optimizer.get_config()
    target, rule_arguments = _CONVERTIBLE[kind]
    if config.get("amsgrad"):
        raise ValueError(
            f"as_rule_optimizer: keras.optimizers.{kind.__name__}(amsgrad=True) has no "
            "tf_metaalign rule; use amsgrad=False (tf_metaalign.optimizers.Adam / AdamW are "
            "Keras's Adam / AdamW without amsgrad)."
        )
    if target is Adam and config.get("weight_decay"):
        target, rule_arguments = _CONVERTIBLE[keras.optimizers.AdamW]
    if target is SGD and config.get("weight_decay"):
        raise ValueError(
            f"as_rule_optimizer: keras.optimizers.SGD(weight_decay={config['weight_decay']}) "
            "has no tf_metaalign rule (Keras applies the decay outside the SGD update); use "
            "weight_decay=None, or tf_metaalign.optimizers.AdamW."
        )
    arguments = {
        name: config[name] for name in rule_arguments + _KERAS_BASE_ARGUMENTS if name in config
    }
    if target is not AdamW:
        arguments.pop("weight_decay", None)  # None here (a decay was refused or moved above)
    converted = target(learning_rate=_learning_rate_from_config(config, optimizer), **arguments)
    if target is AdamW:
        _keras_weight_decay_exclusions(optimizer, converted)
    return converted


def describe_conversion(source, converted):
    """One line for the log: which Keras optimizer became which tf_metaalign one, and with
    what configuration.

    Args:
      source: the Keras optimizer.
      converted: `as_rule_optimizer(source)`.

    Example:
      >>> from tf_metaalign.optimizers import as_rule_optimizer, describe_conversion
      >>> source = keras.optimizers.SGD(0.1, momentum=0.9)
      >>> text = describe_conversion(source, as_rule_optimizer(source))
      >>> # learning_rate=0.1 (float64; on JAX without x64 the float32 0.10000000149011612)
      >>> print(text.split(" -> ")[1])  # doctest: +ELLIPSIS
      tf_metaalign.optimizers.SGD(learning_rate=0.1...
    """
    config = converted.get_config()
    keys = ("learning_rate", "beta_1", "beta_2", "epsilon", "weight_decay", "momentum", "nesterov")
    shown = ", ".join(f"{k}={config[k]!r}" for k in keys if config.get(k) is not None)
    return (
        f"{type(source).__module__}.{type(source).__name__} -> "
        f"tf_metaalign.optimizers.{type(converted).__name__}({shown}): the same update rule "
        "and hyperparameters, as a pure rule guided learning can differentiate"
    )


__all__ = [
    "ALIASES",
    "PROBE_SHAPES",
    "as_rule_optimizer",
    "check_optimizer",
    "describe_conversion",
    "forward_mode_error",
    "optimizer_classes",
    "resolve_hyperparameters",
    "supported_optimizers",
    "supports_forward_mode",
]
