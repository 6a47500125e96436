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
"""
import numbers
import re

import keras
import numpy as np
import tensorflow as tf

from tf_metaalign import _compat
from tf_metaalign import functional


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
    return tf.float64 if tf.as_dtype(var.dtype) == tf.float64 else tf.float32


def _to_float64(value):
    # tf.cast(python_float, float64) would round through float32 first.
    if isinstance(value, numbers.Number):
        return tf.constant(float(value), tf.float64)
    return tf.cast(value, tf.float64)


def rms(x):
    return tf.sqrt(tf.reduce_mean(tf.square(x)))


class UpdateRule:
    """A pure optimizer rule. Subclasses set `hyperparameter_names` and implement `update`.

    Attributes:
      hyperparameter_names: names this rule reads from `hparams` besides "learning_rate".
      defaults: name -> python float, the values used when `hparams` omits a name.
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
            name: tf.zeros(slot_shape, dtype)
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
        g = tf.cast(functional.densify([grad])[0], dtype)
        w = tf.cast(var, dtype)
        slots = {k: tf.cast(v, dtype) for k, v in slots.items()}
        step = _to_float64(step)
        return g, w, slots, hp, step, options, dtype

    @staticmethod
    def _finish(new_w, var, new_slots, dtype):
        return tf.cast(new_w, var.dtype), {k: tf.cast(v, dtype) for k, v in new_slots.items()}


def _tf_variable(variable):
    """The `tf.Variable` of a Keras variable (what tf.distribute's APIs take)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


# ----------------------------------------------------------------------------------------------


class BaseOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer whose `update_step` calls a pure `UpdateRule`.

    Besides Keras's own state (iterations, learning rate) it keeps, created in `build()` and
    saved with the optimizer:
      * `learning_rate_scale`: non-trainable float32 scalar, initial 1.0, that multiplies the
        learning rate (or schedule value) of every update;
      * one float64 scalar variable per name in `variable_hyperparameters` (e.g. "beta_1"), so
        another algorithm can assign learned values between steps. float64 because the
        reference implementations computed 1 - beta_2 from Python floats: in float32,
        1 - float32(0.999) is off by 1.3e-5 relative, a visible change of the update.
    Per-variable static options (weight-decay exclusion, factoring, ...) are decided once in
    `build()` from the Keras variable path, because the TF backend hands `update_step` the
    underlying `tf.Variable`, which has no `.path`.

    Gradient clipping. Keras's `clipnorm`/`global_clipnorm`/`clipvalue` are applied by Keras in
    *replica* context, i.e. to each replica's local gradient before the all-reduce (with Keras's
    loss scaling by 1/num_replicas, a per-replica gradient is about 1/num_replicas of the global
    mean gradient, so `global_clipnorm=c` acts like a threshold of about c*num_replicas on the
    aggregate). `aggregated_clipnorm=c` instead all-reduces (sums) the gradients first and then
    rescales the whole aggregated gradient list by `min(1, c / global_norm)`, identically on
    every replica, so 1 replica and N replicas clip the same gradient.
    BERT (`optimization.create_optimizer`) calls `tf.clip_by_global_norm(grads, 1.0)` on each
    TPU shard's gradient of that shard's MEAN loss, before `CrossShardOptimizer` averages the
    shards: per-shard clipping. On one replica BERT, `global_clipnorm` and `aggregated_clipnorm`
    coincide; on N replicas BERT's per-shard clipping at c is Keras's `global_clipnorm=c / N`
    (Keras's per-replica gradient is 1/N of a shard-mean gradient), while
    `aggregated_clipnorm=c` clips the gradient of the global-batch mean loss, independent of N.
    """

    #: names of hyperparameters whose derivative flows through `rule.update` (first is always
    #: "learning_rate"; its variable is `learning_rate_scale`).
    differentiable_hyperparameters = ("learning_rate",)

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
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.aggregated_clipnorm = aggregated_clipnorm
        self._rule = rule
        # name -> initial python float; the variables are created in build().
        self._initial_hyperparameters = dict(variable_hyperparameters or {})
        self._hyperparameter_variables = {}
        self._learning_rate_scale = None
        self._slot_variables = []  # per trainable variable: dict name -> keras Variable
        self._variable_options = []  # per trainable variable: static dict

    # -- public contract ------------------------------------------------------------------------
    @property
    def rule(self):
        return self._rule

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

        "learning_rate" (float32) is schedule(iterations) (or the fixed rate) times
        `learning_rate_scale`; the others (float64) are the current values of their variables.
        `rule.update(g, var, slots, optimizer.current_hyperparameters(), optimizer.iterations + 1,
        optimizer.options_for(var))` is exactly the update `apply_gradients` makes next.
        """
        self._check_built("current_hyperparameters()")
        return self._hyperparameters(self.schedule_learning_rate())

    def schedule_learning_rate(self):
        """The learning rate of the next update before `learning_rate_scale` (the schedule's
        value at `iterations`, or the fixed rate), float32."""
        return tf.cast(self.learning_rate, tf.float32)

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

        Subclasses override; called once per variable in build().
        """
        return self.rule.default_options(tuple(variable.shape))

    # -- Keras hooks ----------------------------------------------------------------------------
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._learning_rate_scale = self.add_variable(
            shape=(),
            initializer="ones",
            dtype="float32",
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
                initializer=np.asarray(float(value), "float64"),
                dtype="float64",
                aggregation="only_first_replica",
                name=hp_name,
            )
        self._slot_variables = []
        self._variable_options = []
        strategy = _compat.optimizer_strategy(self)
        for variable in variables:
            if getattr(variable, "overwrite_with_gradient", False):
                self._slot_variables.append({})
                self._variable_options.append({})
                continue
            options = self.variable_options(variable)
            shapes = self.rule.slot_shapes(tuple(variable.shape), options)
            float64 = keras.backend.standardize_dtype(variable.dtype) == "float64"
            slots = {}
            prefix = variable_path(variable).replace("/", "_")
            for slot_name, slot_shape in shapes.items():
                # Next to the variable, as Keras's add_variable_from_reference places
                # slots (which cannot be used: its slot takes the variable's dtype).
                with strategy.extended.colocate_vars_with(_tf_variable(variable)):
                    slots[slot_name] = self.add_variable(
                        shape=slot_shape,
                        initializer="zeros",
                        dtype="float64" if float64 else "float32",
                        name=f"{prefix}_{slot_name}",
                    )
            self._slot_variables.append(slots)
            self._variable_options.append(options)

    def update_step(self, gradient, variable, learning_rate):
        index = _compat.variable_index(self, variable)
        slot_vars = self._slot_variables[index]
        options = self._variable_options[index]
        hparams = self._hyperparameters(learning_rate)
        step = tf.cast(self.iterations + 1, tf.float32)
        slots = {k: tf.convert_to_tensor(v.value) for k, v in slot_vars.items()}
        new_var, new_slots = self.rule.update(
            gradient, tf.convert_to_tensor(variable), slots, hparams, step, options
        )
        self.assign(variable, new_var)
        for k, v in slot_vars.items():
            self.assign(v, new_slots[k])

    def assign_update(self, variables, new_values, new_slots):
        """Commit an update already computed with `rule.update`: what `apply_gradients`
        does after the rule (assign variables and slots, count the iteration).

        For code that computed `rule.update` itself (guided learning's lookahead) and
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
            var.assign(tf.cast(value, var.dtype))
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
        # (all-reduce, then `update_step` per variable in a merge call) with the clipping of
        # the aggregate between the all-reduce and the update.
        if self.aggregated_clipnorm is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        trainable_variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = _compat.all_reduce_sum_gradients(
            self, list(zip(functional.densify(grads), trainable_variables))
        )
        clipped, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], self.aggregated_clipnorm)
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
        lr = tf.cast(learning_rate, tf.float32) * tf.convert_to_tensor(
            self._learning_rate_scale.value
        )
        hparams = {"learning_rate": lr}
        for hp_name, v in self._hyperparameter_variables.items():
            hparams[hp_name] = tf.convert_to_tensor(v.value)
        return hparams

    def _check_built(self, what):
        if not self.built:
            raise ValueError(
                f"{type(self).__name__}.{what} needs the optimizer to be built: call "
                "`optimizer.build(model.trainable_variables)` first."
            )
