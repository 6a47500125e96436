"""The optimizer contract: a pure `UpdateRule` and a Keras `BaseOptimizer` that calls it.

Every optimizer in this package writes its rule once, as `UpdateRule.update`, a pure function

    update(grad, var, slots, hparams, step, options) -> (new_var, new_slots)

with no variables and no Keras state. The Keras optimizer (`BaseOptimizer` subclass) only gathers
the slot variables, hyperparameters and per-variable options, calls the rule and assigns the
results. Code that differentiates through an optimizer step (MAML, hypergradients) calls the same
rule on tensors, so the rule trained with is the rule differentiated.

Conventions of the rule:
  grad, var:  tensors of the variable's shape; `grad` is the aggregated (all-reduced) gradient.
              `tf.IndexedSlices` gradients are densified.
  slots:      dict name -> tensor, in `slot_names(shape, options)` order.
  hparams:    dict name -> scalar (python number or tensor, possibly watched by a
              `tf.GradientTape`). "learning_rate" is required and is the EFFECTIVE rate of this
              step (schedule value times `learning_rate_scale`). Any other hyperparameter the
              rule knows (e.g. "beta_1") may be given; a missing one takes the value the rule was
              constructed with.
  step:       the 1-based count of this update (1 for the first update), a scalar.
  options:    per-variable static python dict (e.g. {"weight_decay": True}); `None` means
              `rule.default_options(shape)`.
Computation happens in float32, or in float64 when the variable is float64 (so derivatives can
be checked by finite differences). Slots are float32 whatever the variable dtype (float64 for a
float64 variable); `new_var` has the variable's dtype.

Hyperparameters are exact in float64. A python hyperparameter becomes
`tf.constant(float(x), tf.float64)` (`tf.cast(0.1, tf.float64)` would convert 0.1 to float32
first: 0.10000000149011612). Keras's own optimizers keep a fixed learning rate in a variable of
the floatx of their construction (float32 usually) and cast it to the variable's dtype; the
package's optimizers keep it in a float64 variable whatever floatx (as their
`variable_hyperparameters`), so a float64 variable -- or guided learning's float64 raw values
under floatx float32 -- is updated with the python rate exactly, while a float32 variable's
SGD step is Keras's bit for bit (the rule rounds the rate to float32 as Keras does). Where a
rate cannot be exact: a Keras `LearningRateSchedule` computes in float32 (this package's
schedules compute in float64 under `floatx="float64"`, float32 otherwise), and
`learning_rate_scale` (the learned scale of guided learning) is float32 under floatx float32
(float64 under float64). `learning_rate_tensor` says which dtype a rate is handed on in.
On JAX the rules run on `keras.ops` (`_math`) with the same numbers (float64 goldens equal
TensorFlow's, tests/optimizers/test_optimizers_backends.py), and a python hyperparameter is
converted by NumPy in the dtype asked for (as exact); but "float64" and the int64 step
count exist there only under `jax_enable_x64`: without it they are float32 / int32
(`_math.wide_float`, `counter_dtype`).

One optimizer step on tensors (nothing assigned, differentiable, for MAML/Reptile inner loops
and guided learning): `apply_rule` (the rule on every variable) and, with the optimizer's
hyperparameters, clipping and per-variable options, `BaseOptimizer.apply_on_tensors` on an
`OptimizerState`.
"""

import contextlib
import numbers
import re
from typing import NamedTuple

import keras
import numpy as np

from tf_metaalign import _compat
from tf_metaalign import functional
from tf_metaalign.optimizers import _math as M


# ----------------------------------------------------------------------------------------------
# Validation helpers (shared by every optimizer so the messages name the argument).


def check_learning_rate(learning_rate):
    """Returns `learning_rate` as Keras accepts it; raises if a number is negative."""
    if isinstance(learning_rate, bool):
        raise ValueError(f"`learning_rate` must be a number or a schedule, got {learning_rate!r}.")
    if isinstance(learning_rate, numbers.Number):
        if not learning_rate >= 0:
            raise ValueError(f"`learning_rate` must be >= 0, got learning_rate={learning_rate}.")
        return float(learning_rate)
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) or callable(
        learning_rate
    ):
        return learning_rate
    raise ValueError(
        "`learning_rate` must be a non-negative float, a "
        f"keras.optimizers.schedules.LearningRateSchedule or a callable; got {learning_rate!r}."
    )


def check_unit_interval(name, value, allow_none=False):
    """Checks 0 <= value < 1 (momentum/decay coefficients)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Number) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1), got {name}={value!r}.")
    return float(value)


def check_non_negative(name, value, allow_none=False, positive=False):
    if value is None and allow_none:
        return None
    bad = isinstance(value, bool) or not isinstance(value, numbers.Number)
    if not bad:
        bad = not (value > 0 if positive else value >= 0)
    if bad:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"`{name}` must be a number {bound}, got {name}={value!r}.")
    return float(value)


def check_adam_hyperparameters(beta_1, beta_2, epsilon):
    """`(beta_1, beta_2, epsilon)` checked as every Adam-family optimizer takes them:
    betas in [0, 1), epsilon >= 0."""
    return (
        check_unit_interval("beta_1", beta_1),
        check_unit_interval("beta_2", beta_2),
        check_non_negative("epsilon", epsilon),
    )


def check_name_patterns(name, patterns, allow_none=False):
    """Exclusion lists: a tuple/list of regex strings searched in the variable path."""
    if patterns is None and allow_none:
        return None
    if isinstance(patterns, str):
        patterns = (patterns,)
    if not isinstance(patterns, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a list or tuple of strings (regexes searched in variable paths "
            f"such as 'dense/bias'), got {name}={patterns!r}."
        )
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(
                f"`{name}` entries must be strings (regexes searched in the variable path), "
                f"got an entry of type {type(p).__name__}: {p!r}."
            )
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"`{name}` entry {p!r} is not a valid regex: {e}.") from None
    return tuple(patterns)


def matches_any(path, patterns):
    """BERT's exclusion test, `re.search(pattern, name)`, applied to the Keras variable path."""
    return any(re.search(p, path) is not None for p in patterns)


def variable_path(variable):
    """The Keras path ("dense/kernel") of a Keras variable; the tf name otherwise."""
    path = getattr(variable, "path", None)
    if path is None:
        path = str(getattr(variable, "name", ""))
        if path.endswith(":0"):
            path = path[:-2]
    return path


# ----------------------------------------------------------------------------------------------


def compute_dtype_for(var):
    """float64 for float64 variables (exact finite-difference checks), float32 otherwise."""
    return "float64" if M.dtype_of(var) == "float64" else "float32"


def _to_float64(value):
    # tf.cast(python_float, float64) would round through float32 first. On JAX without
    # jax_enable_x64: float32 (`M.wide_float`).
    if isinstance(value, numbers.Number):
        return M.constant(float(value), M.wide_float())
    return M.cast(value, M.wide_float())


def learning_rate_tensor(value):
    """A learning rate (schedule value, fixed rate, callable rate's value) as a tensor.

    float64 when the rate is held in float64 -- a package optimizer's fixed rate always
    is (see the module doc), a package schedule's value under `floatx="float64"` -- or
    when it is a python number under floatx float64; float32 otherwise (a Keras schedule's
    value, a float32 rate). Never rounds a float64 rate through float32.
    """
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        dtype = M.wide_float() if keras.backend.floatx() == "float64" else "float32"
        return M.constant(float(value), dtype)
    value = M.convert_to_tensor(value)
    return value if M.dtype_of(value) == "float64" else M.cast(value, "float32")


def rms(x):
    """sqrt(mean(x^2)) over the whole tensor (Mesh TensorFlow's `reduce_rms`)."""
    return M.sqrt(M.mean(M.square(x)))


def moment_estimates(g, m, v, beta_1, beta_2, dtype):
    """The BERT/ALBERT and RecAdam moment updates, as their reference code writes them:

        m <- beta_1 * m + (1 - beta_1) * g
        v <- beta_2 * v + (1 - beta_2) * g^2

    `beta_1`, `beta_2` are the float64 scalars of `UpdateRule._prepare` (1 - beta computed
    in float64, then cast to `dtype`). `AdamRule` keeps Keras's form m + (1 - beta_1)(g - m)
    instead, which rounds differently. Returns `(m, v)`."""
    m = M.cast(beta_1, dtype) * m + M.cast(1.0 - beta_1, dtype) * g
    v = M.cast(beta_2, dtype) * v + M.cast(1.0 - beta_2, dtype) * M.square(g)
    return m, v


class UpdateRule:
    """A pure optimizer rule. Subclasses set `hyperparameter_names` and implement `update`.

    Attributes:
      hyperparameter_names: names this rule reads from `hparams` besides "learning_rate".
      defaults: name -> python float, the values used when `hparams` omits a name.

    Args:
      **defaults: the `defaults` (a name not in `hyperparameter_names` raises a ValueError).

    Example:
      >>> from tf_metaalign.optimizers import UpdateRule
      >>> class SignSGD(UpdateRule):
      ...     def slot_shapes(self, shape, options):
      ...         return {}
      ...     def update(self, grad, var, slots, hparams, step, options=None):
      ...         return var - hparams["learning_rate"] * keras.ops.sign(grad), {}
      >>> grad, w = keras.ops.array([-3.0, 0.5]), keras.ops.zeros((2,))
      >>> new_w, _ = SignSGD().update(grad, w, {}, {"learning_rate": 0.1}, step=1)
      >>> np.asarray(new_w)
      array([ 0.1, -0.1], dtype=float32)
    """

    hyperparameter_names = ()

    def __init__(self, **defaults):
        unknown = set(defaults) - set(self.hyperparameter_names)
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown hyperparameters {sorted(unknown)}.")
        self.defaults = dict(defaults)

    # -- per-variable structure ----------------------------------------------------------------
    def default_options(self, shape):
        """Options used when the caller passes `options=None`."""
        return {}

    def slot_shapes(self, shape, options):
        """dict slot name -> shape (ordered)."""
        raise NotImplementedError

    def slot_names(self, shape, options):
        options = self.default_options(shape) if options is None else options
        return tuple(self.slot_shapes(tuple(shape), options).keys())

    def init_slots(self, var, options):
        """Zero slots (float32; float64 for a float64 variable)."""
        shape = tuple(var.shape)
        options = self.default_options(shape) if options is None else options
        dtype = compute_dtype_for(var)
        return {
            name: M.zeros(slot_shape, dtype)
            for name, slot_shape in self.slot_shapes(shape, options).items()
        }

    # -- the rule -----------------------------------------------------------------------------
    def update(self, grad, var, slots, hparams, step, options=None):
        """Returns (new_var, new_slots). See the module docstring for the conventions."""
        raise NotImplementedError

    # -- helpers for subclasses ---------------------------------------------------------------
    def _prepare(self, grad, var, slots, hparams, step, options):
        """Returns (g, w, slots, hp, step, options, dtype).

        Tensors are cast to the compute dtype. Scalar hyperparameters and the step are cast to
        float64, so scalar coefficients such as 1 - beta_2 and beta_1^t are as exact as in the
        reference code (which computed them from Python floats); rules cast the coefficients to
        the compute dtype when they meet tensors.
        """
        dtype = compute_dtype_for(var)
        if options is None:
            options = self.default_options(tuple(var.shape))
        if "learning_rate" not in hparams:
            raise ValueError(f"{type(self).__name__}.update: hparams needs 'learning_rate'.")
        hp = {}
        for name in ("learning_rate",) + tuple(self.hyperparameter_names):
            value = hparams.get(name, self.defaults.get(name))
            hp[name] = None if value is None else _to_float64(value)
        g = M.cast(functional.densify([grad])[0], dtype)
        w = M.cast(var, dtype)
        slots = {k: M.cast(v, dtype) for k, v in slots.items()}
        step = _to_float64(step)
        return g, w, slots, hp, step, options, dtype

    @staticmethod
    def _finish(new_w, var, new_slots, dtype):
        return M.cast(new_w, var.dtype), {k: M.cast(v, dtype) for k, v in new_slots.items()}


# ----------------------------------------------------------------------------------------------
# One step on tensors.


def apply_rule(rule, grads, params, slots, options, hparams, step):
    """One step of `rule` on every variable, on tensors: `(new_params, new_slots)`.

    `rule.update(grads[i], params[i], slots[i], hparams, step, options[i])` for every i, with
    the conventions of the module docstring. Nothing is assigned, and the result is
    differentiable with respect to the grads, params, slots and hparams (tapes, and forward
    mode for `forward_mode.Dual` hparams).

    Args:
      rule: an `UpdateRule`.
      grads: one aggregated gradient per variable (used as given: no clipping here).
      params: one tensor per variable, the values before the update.
      slots: one dict slot name -> tensor per variable.
      options: one options dict (None: the rule's defaults) per variable, or None for the
        rule's defaults everywhere.
      hparams: the rule's hyperparameters of this update ("learning_rate" is the effective
        rate).
      step: the 1-based count of this update.

    Returns:
      Two lists with one entry per variable: the new params and the new slot dicts.

    Example:
      >>> from tf_metaalign.optimizers import SGDRule, apply_rule
      >>> params = [keras.ops.array([1.0, 2.0]), keras.ops.array(3.0)]
      >>> grads = [keras.ops.array([1.0, -1.0]), keras.ops.array(2.0)]
      >>> new_params, new_slots = apply_rule(
      ...     SGDRule(), grads, params, [{}, {}], None, {"learning_rate": 0.5}, step=1
      ... )
      >>> [np.asarray(p).tolist() for p in new_params], new_slots
      ([[0.5, 2.5], 2.0], [{}, {}])
    """
    grads = _as_list(grads, "grads", "apply_rule")
    params = _as_list(params, "params", "apply_rule")
    slots = _as_list(slots, "slots", "apply_rule")
    options = (
        [None] * len(params) if options is None else _as_list(options, "options", "apply_rule")
    )
    if not (len(grads) == len(params) == len(slots) == len(options)):
        raise ValueError(
            "apply_rule: `grads`, `params`, `slots` and `options` must have one entry per "
            f"variable; got {len(grads)}, {len(params)}, {len(slots)}, {len(options)}."
        )
    new_params, new_slots = [], []
    for g, w, s, o in zip(grads, params, slots, options):
        new_w, new_s = rule.update(g, w, s, hparams, step, o)
        new_params.append(new_w)
        new_slots.append(new_s)
    return new_params, new_slots


class OptimizerState(NamedTuple):
    """A `BaseOptimizer`'s state as tensors, for `BaseOptimizer.apply_on_tensors`.

    A nest: it goes through `tf.nest`, `tf.function` arguments and results, and
    `tf.while_loop` loop variables.

    Attributes:
      slots: tuple with one dict slot name -> tensor per variable (the rule's slots; empty
        for a variable without any).
      iterations: int64 scalar, the number of updates done (Keras's `optimizer.iterations`):
        the next update is update number `iterations + 1`.

    Example:
      >>> from tf_metaalign.optimizers import Adam
      >>> w = keras.Variable(keras.ops.zeros((2, 3)))
      >>> state = Adam().initial_state([w])
      >>> sorted(state.slots[0]), int(state.iterations)
      (['m', 'v'], 0)
    """

    slots: tuple
    iterations: object


def _as_list(values, name, where):
    """`values` as a list with one entry per variable. A single tensor is refused, since
    `list(tensor)` would silently split it along its first axis."""
    if (
        isinstance(values, (keras.Variable, np.ndarray, dict))
        or keras.ops.is_tensor(values)
        or _is_tf_variable(values)
        or values is None
    ):
        raise ValueError(
            f"{where}: `{name}` must be a list with one entry per variable; got "
            f"{type(values).__name__}."
        )
    return list(values)


def _is_tf_variable(value):
    if M.BACKEND != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(value, tf.Variable)


def _tf_variable(variable):
    """The `tf.Variable` of a Keras variable (what tf.distribute's APIs take)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _slot_placement(optimizer):
    """`colocate(variable)`: the context in which a slot of `variable` is created. On
    TensorFlow next to the variable (as Keras's add_variable_from_reference places slots);
    on JAX Keras's distribution lays out the optimizer's variables itself."""
    if M.BACKEND != "tensorflow":
        return lambda variable: contextlib.nullcontext()
    strategy = _compat.optimizer_strategy(optimizer)
    return lambda variable: strategy.extended.colocate_vars_with(_tf_variable(variable))


@contextlib.contextmanager
def _floatx(dtype):
    old = keras.backend.floatx()
    keras.backend.set_floatx(dtype)
    try:
        yield
    finally:
        keras.backend.set_floatx(old)


def _schedule_or_none(learning_rate):
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        return learning_rate
    return None


# ----------------------------------------------------------------------------------------------


class BaseOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer whose `update_step` calls a pure `UpdateRule`.

    Besides Keras's own state (iterations, learning rate) it keeps, created in `build()` and
    saved with the optimizer:
      * `learning_rate_scale`: non-trainable float32 scalar (float64 under
        `floatx="float64"`), initial 1.0, that multiplies the learning rate (or schedule
        value) of every update;
      * one float64 scalar variable per name in `variable_hyperparameters` (e.g. "beta_1"), so
        another algorithm can assign learned values between steps. float64 because the
        reference implementations computed 1 - beta_2 from Python floats: in float32,
        1 - float32(0.999) is off by 1.3e-5 relative, a visible change of the update.
    Per-variable static options (weight-decay exclusion, factoring, ...) are decided once in
    `build()` from the Keras variable path, because the TF backend hands `update_step` the
    underlying `tf.Variable`, which has no `.path`.

    One update on tensors, assigning nothing: `apply_on_tensors(grads, params, state)` with
    `state = initial_state(variables)` or `current_state()` (see `apply_on_tensors`).

    Gradient clipping. Keras's `clipnorm`/`global_clipnorm`/`clipvalue` are applied by Keras in
    *replica* context, i.e. to each replica's local gradient before the all-reduce (with Keras's
    loss scaling by 1/num_replicas, a per-replica gradient is about 1/num_replicas of the global
    mean gradient, so `global_clipnorm=c` acts like a threshold of about c*num_replicas on the
    aggregate). `aggregated_clipnorm=c` instead all-reduces (sums) the gradients first and then
    rescales the whole aggregated gradient list by `min(1, c / global_norm)`
    (`clip_aggregated`), identically on every replica, so 1 replica and N replicas clip the
    same gradient.
    BERT (`optimization.create_optimizer`) calls `tf.clip_by_global_norm(grads, 1.0)` on each
    TPU shard's gradient of that shard's MEAN loss, before `CrossShardOptimizer` averages the
    shards: per-shard clipping. On one replica BERT, `global_clipnorm` and `aggregated_clipnorm`
    coincide; on N replicas BERT's per-shard clipping at c is Keras's `global_clipnorm=c / N`
    (Keras's per-replica gradient is 1/N of a shard-mean gradient), while
    `aggregated_clipnorm=c` clips the gradient of the global-batch mean loss, independent of N.

    Args:
      learning_rate: float >= 0, a `LearningRateSchedule` or a callable.
      rule: the `UpdateRule`.
      variable_hyperparameters: name -> initial value of the hyperparameters kept as
        float64 variables (learnable, checkpointed).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm (above).
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import SGD
      >>> w = keras.Variable([1.0, 2.0])
      >>> opt = SGD(learning_rate=0.1)  # a BaseOptimizer
      >>> state = opt.initial_state([w])
      >>> grads = [keras.ops.array([1.0, 1.0])]
      >>> new_params, new_state = opt.apply_on_tensors(grads, [w.value], state, [w])
      >>> new_w = np.asarray(new_params[0])
      >>> np.round(new_w, 4), int(new_state.iterations), w.numpy()  # w unchanged
      (array([0.9, 1.9], dtype=float32), 1, array([1., 2.], dtype=float32))
    """

    #: names of hyperparameters whose derivative flows through `rule.update` (first is always
    #: "learning_rate"; its variable is `learning_rate_scale`).
    differentiable_hyperparameters = ("learning_rate",)
    #: True when the rule applies Keras's `weight_decay` argument itself (`AdamW`), so the
    #: tensor step and guided learning accept it; otherwise Keras applies it outside the rule.
    rule_applies_weight_decay = False

    def __init__(
        self,
        learning_rate,
        rule,
        variable_hyperparameters=None,
        aggregated_clipnorm=None,
        name=None,
        **kwargs,
    ):
        learning_rate = check_learning_rate(learning_rate)
        aggregated_clipnorm = check_non_negative(
            "aggregated_clipnorm", aggregated_clipnorm, allow_none=True, positive=True
        )
        if aggregated_clipnorm is not None and kwargs.get("global_clipnorm") is not None:
            raise ValueError("Set at most one of `aggregated_clipnorm` and `global_clipnorm`.")
        # Keras keeps a fixed rate in a variable of the current floatx (float32 usually: 0.1
        # would become 0.10000000149011612). The rules compute their scalar coefficients in
        # float64 (`UpdateRule._prepare`), and float64 values -- float64 variables, guided
        # learning's raw values, updated by a meta-optimizer under any floatx -- must get
        # the python rate exactly: Keras creates it in float64 here (the only variable
        # its constructor sizes by floatx), as `variable_hyperparameters` are. A float32
        # variable's update is unchanged but for coefficients computed from the rate.
        with _floatx(M.wide_float()):
            super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.aggregated_clipnorm = aggregated_clipnorm
        # Kept to evaluate the schedule at any iteration (`learning_rate_at`): Keras's public
        # `learning_rate` evaluates it only at the optimizer's own `iterations`.
        self._learning_rate_schedule = _schedule_or_none(learning_rate)
        self._rule = rule
        # name -> initial python float; the variables are created in build().
        self._initial_hyperparameters = dict(variable_hyperparameters or {})
        self._hyperparameter_variables = {}
        self._learning_rate_scale = None
        # Per trainable variable, decided in build(): dict name -> slot variable, the static
        # options, whether Keras overwrites it with its gradient, its constraint.
        self._slot_variables = []
        self._variable_options = []
        self._overwrite_with_gradient = []
        self._constraints = []

    # -- public contract ------------------------------------------------------------------------
    @property
    def rule(self):
        return self._rule

    @property
    def learning_rate(self):
        return super().learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)
        self._learning_rate_schedule = _schedule_or_none(learning_rate)

    @property
    def learning_rate_scale(self):
        self._check_built("learning_rate_scale")
        return self._learning_rate_scale

    @property
    def hyperparameter_variables(self):
        """dict name -> scalar variable (e.g. {"beta_1": <Variable>}), after build()."""
        self._check_built("hyperparameter_variables")
        return dict(self._hyperparameter_variables)

    def current_hyperparameters(self):
        """dict name -> scalar tensor for the NEXT update.

        "learning_rate" (float32; float64 when the rate is held in float64, see
        `learning_rate_tensor`) is schedule(iterations) (or the fixed rate) times
        `learning_rate_scale`; the others (float64) are the current values of their variables.
        `rule.update(g, var, slots, optimizer.current_hyperparameters(), optimizer.iterations + 1,
        optimizer.options_for(var))` is exactly the update `apply_gradients` makes next.
        """
        self._check_built("current_hyperparameters()")
        return self._hyperparameters(self.schedule_learning_rate())

    def hyperparameters_at(self, iterations):
        """The rule's `hparams` for update number `iterations + 1`; works unbuilt.

        "learning_rate" (float32, or float64 as `learning_rate_tensor` says):
        `learning_rate_at(iterations)` times `learning_rate_scale`
        (1 before `build`). Each other name of the optimizer's variable hyperparameters
        (float64): its variable's current value, or before `build` its configured value.
        """
        if self.built:
            return self._hyperparameters(self.learning_rate_at(iterations))
        hparams = {"learning_rate": self.learning_rate_at(iterations)}
        for hp_name, value in self._initial_hyperparameters.items():
            if value is not None:
                hparams[hp_name] = _to_float64(value)
        return hparams

    def schedule_learning_rate(self):
        """The learning rate of the next update before `learning_rate_scale` (the schedule's
        value at `iterations`, or the fixed rate): float32, or float64 when the rate is
        held in float64 (`learning_rate_tensor`)."""
        return learning_rate_tensor(self.learning_rate)

    def learning_rate_at(self, iterations):
        """The learning rate of update number `iterations + 1` before `learning_rate_scale`:
        the schedule's value at `iterations` (Keras calls a schedule with the number of
        updates already applied), else the fixed rate (or a callable rate's value). float32,
        or float64 when the rate is held in float64 (`learning_rate_tensor`: under
        `floatx="float64"` the fixed rate and this package's schedules are)."""
        if self._learning_rate_schedule is not None:
            return learning_rate_tensor(self._learning_rate_schedule(iterations))
        return learning_rate_tensor(self.learning_rate)

    def slots_for(self, variable):
        """dict slot name -> slot variable (rule.slot_names order) for a Keras or tf variable."""
        self._check_built("slots_for()")
        return dict(self._slot_variables[_compat.variable_index(self, variable)])

    def options_for(self, variable):
        """The static per-variable options decided in build()."""
        self._check_built("options_for()")
        return dict(self._variable_options[_compat.variable_index(self, variable)])

    def variable_options(self, variable):
        """Decides the static options of one variable (a Keras variable with `.path`).

        Subclasses override; called once per variable in build() (and by `initial_state`).
        """
        return self.rule.default_options(tuple(variable.shape))

    def clip_aggregated(self, grads):
        """The aggregated gradients as the update uses them (a list, None entries kept).

        Densified; with `aggregated_clipnorm=c`, the whole list rescaled by
        `min(1, c / global_norm)` (`tf.clip_by_global_norm`). `grads` must be the aggregated
        (all-reduced) gradient: `apply_gradients` calls this after its all-reduce,
        `apply_on_tensors` on the gradients it is given.
        """
        grads = _as_list(grads, "grads", "clip_aggregated")
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = functional.densify([grads[i] for i in present])
        if self.aggregated_clipnorm is not None and dense:
            dense = M.clip_by_global_norm(dense, self.aggregated_clipnorm)
        out = list(grads)
        for i, g in zip(present, dense):
            out[i] = g
        return out

    # -- one update on tensors ------------------------------------------------------------------
    def initial_state(self, variables):
        """The state before the first update, for `apply_on_tensors`: zero slots, 0 iterations.

        Works without building the optimizer. Each variable gets the slots `build` would give
        it: the rule's slots for the options `variable_options` decides from its Keras path,
        float32 (float64 for a float64 variable), none for an `overwrite_with_gradient`
        variable.

        Args:
          variables: the Keras variables to update (e.g. `model.trainable_variables`).
        """
        slots = []
        for variable in _as_list(variables, "variables", "initial_state"):
            options, overwrite, _ = self._variable_record(variable)
            slots.append({} if overwrite else self.rule.init_slots(variable, options))
        return OptimizerState(tuple(slots), M.constant(0, M.counter_dtype()))

    def current_state(self, variables=None):
        """A built optimizer's state as tensors: its slot variables' and `iterations`' values.

        Args:
          variables: the (Keras or tf) variables whose slots to read, all of them the
            optimizer was built with; default: every built variable, in build order.
        """
        self._check_built("current_state()")
        if variables is None:
            slot_variables = list(self._slot_variables)
        else:
            slot_variables = [
                self._slot_variables[_compat.variable_index(self, v)]
                for v in _as_list(variables, "variables", "current_state")
            ]
        slots = tuple(
            {k: M.convert_to_tensor(v.value) for k, v in s.items()} for s in slot_variables
        )
        iterations = M.convert_to_tensor(self.iterations)
        return OptimizerState(slots, M.cast(iterations, M.counter_dtype()))

    def apply_on_tensors(self, grads, params, state, variables=None, hyperparameters=None):
        """One update on tensors: `(new_params, new_state)`, assigning nothing.

        Exactly the update `apply_gradients` would make from the same values and state, in
        its order: a variable with `overwrite_with_gradient` takes its gradient; a None
        gradient leaves its variable and slots unchanged (Keras skips it); the others are
        divided by `loss_scale_factor` (when set), clipped by `clip_aggregated`
        (`aggregated_clipnorm`), updated by `rule.update` with step `state.iterations + 1`
        (see `apply_rule`), and a variable's `constraint` is applied to its new value. The
        gradients are taken to be the aggregate: this step never all-reduces (under a
        strategy, pass gradients already summed over replicas) and never calls
        `apply_gradients`. Differentiable with respect to grads, params, slots and
        hyperparameters (MAML inner loops); the state carries slots and count from step to
        step (Reptile inner loops), through `tf.function` and `tf.while_loop`.

        Not supported (a ValueError names the argument): Keras's `clipnorm`,
        `global_clipnorm`, `clipvalue` (applied to each replica's gradient before the
        all-reduce; use `aggregated_clipnorm`), Keras's generic `weight_decay` (use the
        optimizers' own `weight_decay_rate`), `use_ema` (the moving average is state this
        step does not carry) and `gradient_accumulation_steps`.

        Args:
          grads: one gradient (tensor, `tf.IndexedSlices` or None) per variable.
          params: the variables' values before the update, one tensor per variable.
          state: an `OptimizerState` (from `initial_state`, `current_state` or a previous
            call) for the same variables.
          variables: the Keras variables the params are values of, which decide each
            variable's options (from its path), `overwrite_with_gradient` and `constraint`
            as `build` does. Default: the variables the optimizer was built with (it must
            then be built).
          hyperparameters: dict name -> value replacing the optimizer's values for this
            update (e.g. {"beta_1": b} to differentiate with respect to b); "learning_rate"
            is the effective rate. Default: `hyperparameters_at(state.iterations)`.
        Returns `(new_params, new_state)`: a list with one tensor per variable (in the
        params' dtypes) and the `OptimizerState` after the update (`iterations + 1`).
        """
        self._check_tensor_step_supported()
        if not isinstance(state, OptimizerState):
            raise ValueError(
                "apply_on_tensors: `state` must be an OptimizerState (from `initial_state`, "
                f"`current_state` or a previous `apply_on_tensors`); got {type(state).__name__}."
            )
        grads = _as_list(grads, "grads", "apply_on_tensors")
        params = [M.convert_to_tensor(p) for p in _as_list(params, "params", "apply_on_tensors")]
        if not len(grads) == len(params) == len(state.slots):
            raise ValueError(
                "apply_on_tensors: `grads`, `params` and `state.slots` must have one entry per "
                f"variable; got {len(grads)}, {len(params)}, {len(state.slots)}."
            )
        records = self._records_for(params, variables)
        for i, (p, s, (options, overwrite, _)) in enumerate(zip(params, state.slots, records)):
            expected = () if overwrite else self.rule.slot_names(tuple(p.shape), options)
            if set(s) != set(expected):
                raise ValueError(
                    f"apply_on_tensors: `state.slots[{i}]` holds {sorted(s)}, but "
                    f"{type(self).__name__} keeps {sorted(expected)} for this variable (shape "
                    f"{tuple(p.shape)}): make the state with this optimizer's `initial_state` "
                    "or `current_state` for these variables."
                )
        if all(g is None for g in grads):
            raise ValueError("apply_on_tensors: every entry of `grads` is None.")

        iterations = M.cast(state.iterations, M.counter_dtype())
        hparams = self._hyperparameters_for_update(iterations, hyperparameters)
        step = M.cast(iterations + 1, "float32")
        new_params, new_slots = list(params), list(state.slots)
        updated = []
        for i, (g, (_, overwrite, _)) in enumerate(zip(grads, records)):
            if g is None:
                continue
            if overwrite:
                new_params[i] = M.cast(functional.densify([g])[0], params[i].dtype)
            else:
                updated.append(i)
        update_grads = [grads[i] for i in updated]
        if self.loss_scale_factor is not None:
            update_grads = [g / self.loss_scale_factor for g in functional.densify(update_grads)]
        values, slots = apply_rule(
            self.rule,
            self.clip_aggregated(update_grads),
            [params[i] for i in updated],
            [state.slots[i] for i in updated],
            [records[i][0] for i in updated],
            hparams,
            step,
        )
        for i, value, s in zip(updated, values, slots):
            constraint = records[i][2]
            new_params[i] = value if constraint is None else constraint(value)
            new_slots[i] = s
        return new_params, OptimizerState(tuple(new_slots), iterations + 1)

    # -- Keras hooks ----------------------------------------------------------------------------
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # float64 under floatx float64, like Keras's own learning-rate variable, so a
        # learned scale (guided learning) is not rounded through float32 there.
        self._learning_rate_scale = self.add_variable(
            shape=(),
            initializer="ones",
            dtype="float64" if keras.backend.floatx() == "float64" else "float32",
            aggregation="only_first_replica",
            name="learning_rate_scale",
        )
        for hp_name, value in self._initial_hyperparameters.items():
            if value is None:
                continue
            # A float64 array as initializer keeps the python float exactly (a Constant
            # initializer would round it through float32).
            self._hyperparameter_variables[hp_name] = self.add_variable(
                shape=(),
                initializer=np.asarray(float(value), M.wide_float()),
                dtype=M.wide_float(),
                aggregation="only_first_replica",
                name=hp_name,
            )
        self._slot_variables = []
        self._variable_options = []
        self._overwrite_with_gradient = []
        self._constraints = []
        colocate = _slot_placement(self)
        for variable in variables:
            options, overwrite, constraint = self._variable_record(variable)
            slots = {}
            if not overwrite:
                shapes = self.rule.slot_shapes(tuple(variable.shape), options)
                float64 = keras.backend.standardize_dtype(variable.dtype) == "float64"
                prefix = variable_path(variable).replace("/", "_")
                for slot_name, slot_shape in shapes.items():
                    # Next to the variable, as Keras's add_variable_from_reference places
                    # slots (which cannot be used: its slot takes the variable's dtype).
                    with colocate(variable):
                        slots[slot_name] = self.add_variable(
                            shape=slot_shape,
                            initializer="zeros",
                            dtype="float64" if float64 else "float32",
                            name=f"{prefix}_{slot_name}",
                        )
            self._slot_variables.append(slots)
            self._variable_options.append(options)
            self._overwrite_with_gradient.append(overwrite)
            self._constraints.append(constraint)

    def update_step(self, gradient, variable, learning_rate):
        index = _compat.variable_index(self, variable)
        slot_vars = self._slot_variables[index]
        options = self._variable_options[index]
        hparams = self._hyperparameters(learning_rate)
        step = M.cast(self.iterations + 1, "float32")
        slots = {k: M.convert_to_tensor(v.value) for k, v in slot_vars.items()}
        new_var, new_slots = self.rule.update(
            gradient, M.convert_to_tensor(variable), slots, hparams, step, options
        )
        self.assign(variable, new_var)
        for k, v in slot_vars.items():
            self.assign(v, new_slots[k])

    def assign_update(self, variables, new_values, new_slots):
        """Commit an update already computed with `rule.update`: what `apply_gradients`
        does after the rule (assign variables and slots, count the iteration).

        For code that computed `rule.update` itself (guided learning's forward-mode update) and
        should not pay for the update a second time. Call it where you would call
        `apply_gradients` (in a replica context under a strategy). The values must be the
        same on every replica, i.e. computed from all-reduced gradients: each replica
        assigns its own copy of each variable, nothing is communicated.
        """
        if not (len(variables) == len(new_values) == len(new_slots)):
            raise ValueError(
                "assign_update: variables, new_values and new_slots must have one entry per "
                f"variable; got {len(variables)}, {len(new_values)}, {len(new_slots)}."
            )
        for variable, value, slots in zip(variables, new_values, new_slots):
            self.assign_variable_update(variable, value, slots)
        self.iterations.assign_add(1)

    def assign_variable_update(self, variable, new_value, new_slots):
        """`assign_update` for one variable, without counting the iteration (the caller
        adds 1 to `iterations` once all variables are committed).

        Returns the variable's new value as read back after the assignment (this
        replica's copy under a strategy): evaluating the model at it reads the variable's
        buffer instead of keeping `new_value` alive as a separate copy.
        """
        slot_vars = self._slot_variables[_compat.variable_index(self, variable)]
        target = _tf_variable(variable)

        def assign_one_copy(var, value, slots):
            # `var` is one device's copy under a mirrored strategy; `self.assign` on the
            # slot variables assigns the copy of the device being updated.
            for k, v in slot_vars.items():
                self.assign(v, slots[k])
            var.assign(M.cast(value, var.dtype))
            return var.read_value()

        def assign_all_copies(distribution, value, slots):
            # group=True: the per-device reads come back as one mirrored value, which the
            # replica context unwraps to this replica's copy (the default strategy: the read).
            return distribution.extended.update(
                target, assign_one_copy, args=(value, slots), group=True
            )

        return _compat.maybe_merge_call(
            assign_all_copies, _compat.optimizer_strategy(self), new_value, dict(new_slots)
        )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Keras's private hook (see _compat.BACKEND_UPDATE_STEP_HOOK): Keras's own TF step
        # (all-reduce, then `update_step` per variable in a merge call) with
        # `clip_aggregated` between the all-reduce and the update.
        if self.aggregated_clipnorm is None or M.BACKEND != "tensorflow":
            # JAX: Keras's step is the update on the global gradients, so clip them first.
            if self.aggregated_clipnorm is not None:
                grads = self.clip_aggregated(grads)
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        trainable_variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = _compat.all_reduce_sum_gradients(
            self, list(zip(functional.densify(grads), trainable_variables))
        )
        clipped = self.clip_aggregated([g for g, _ in grads_and_vars])
        _compat.maybe_merge_call(
            _compat.distributed_update_step(self),
            _compat.optimizer_strategy(self),
            list(zip(clipped, [v for _, v in grads_and_vars])),
            learning_rate,
        )

    def get_config(self):
        config = super().get_config()
        config["aggregated_clipnorm"] = self.aggregated_clipnorm
        return config

    # -- internals ------------------------------------------------------------------------------
    def _hyperparameters(self, learning_rate):
        lr = learning_rate_tensor(learning_rate)
        lr = lr * M.cast(M.convert_to_tensor(self._learning_rate_scale.value), lr.dtype)
        hparams = {"learning_rate": lr}
        for hp_name, v in self._hyperparameter_variables.items():
            hparams[hp_name] = M.convert_to_tensor(v.value)
        return hparams

    def _hyperparameters_for_update(self, iterations, overrides):
        hparams = self.hyperparameters_at(iterations)
        if overrides is None:
            return hparams
        if not isinstance(overrides, dict):
            raise ValueError(
                "apply_on_tensors: `hyperparameters` must be a dict name -> value, got "
                f"{type(overrides).__name__}."
            )
        known = ("learning_rate",) + tuple(self.rule.hyperparameter_names)
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(
                f"apply_on_tensors: `hyperparameters` names {unknown}, which "
                f"{type(self).__name__}'s rule does not read; it reads {list(known)}."
            )
        hparams.update(overrides)
        return hparams

    def _variable_record(self, variable):
        """(options, overwrite_with_gradient, constraint) of one variable, as build decides."""
        if getattr(variable, "overwrite_with_gradient", False):
            return {}, True, None
        return self.variable_options(variable), False, getattr(variable, "constraint", None)

    def _records_for(self, params, variables):
        if variables is None:
            if not self.built:
                raise ValueError(
                    "apply_on_tensors: pass `variables` (the Keras variables the params are "
                    "values of, e.g. model.trainable_variables: their paths decide per-variable "
                    "options) or build the optimizer first."
                )
            records = list(
                zip(self._variable_options, self._overwrite_with_gradient, self._constraints)
            )
            source = "the optimizer was built with"
        else:
            records = [
                self._variable_record(v)
                for v in _as_list(variables, "variables", "apply_on_tensors")
            ]
            source = "`variables` has"
        if len(records) != len(params):
            raise ValueError(
                f"apply_on_tensors: {source} {len(records)} variables but `params` has "
                f"{len(params)} entries."
            )
        return records

    def _check_tensor_step_supported(self):
        name = type(self).__name__
        for attr in ("clipnorm", "global_clipnorm", "clipvalue"):
            value = getattr(self, attr, None)
            if value:
                raise ValueError(
                    f"apply_on_tensors does not support Keras's `{attr}` ({name} has "
                    f"{attr}={value}): Keras applies it to each replica's gradient before the "
                    "all-reduce, and the tensor step takes the aggregated gradient; use "
                    "`aggregated_clipnorm` instead."
                )
        if self.weight_decay and not self.rule_applies_weight_decay:
            raise ValueError(
                f"apply_on_tensors does not support Keras's generic `weight_decay` ({name} has "
                f"weight_decay={self.weight_decay}), applied outside the optimizer's rule; use "
                "AdamWeightDecay/Lamb/Adafactor's `weight_decay_rate`."
            )
        if self.use_ema:
            raise ValueError(
                f"apply_on_tensors does not support `use_ema=True` ({name}): the moving "
                "average is optimizer state the tensor step does not carry."
            )
        if self.gradient_accumulation_steps:
            raise ValueError(
                "apply_on_tensors does not support `gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}` ({name}): it makes one update from the "
                "gradients it is given."
            )

    def _check_built(self, what):
        if not self.built:
            raise ValueError(
                f"{type(self).__name__}.{what} needs the optimizer to be built: call "
                "`optimizer.build(model.trainable_variables)` first."
            )
