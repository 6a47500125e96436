"""Adafactor with Mesh TensorFlow / t5x (T5) semantics; `factoring="last_two"` gives the
tensor2tensor (Pegasus) rule."""

import keras

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base
from tf_metaalign.optimizers import schedules

FACTORINGS = ("two_largest", "last_two")


def factored_dims(shape, factored=True, factoring="two_largest", min_dim_size_to_factor=128):
    """The two axes (kept_by_row, kept_by_col) a factored second moment uses, or None.

    "two_largest" (Mesh TensorFlow `AdafactorOptimizer._factored_dims`): the two largest
    axes, only if the second largest is >= min_dim_size_to_factor. Ties are broken as Mesh
    TensorFlow breaks them, `sorted(dims, key=lambda d: -d.size)` (stable): the earlier axis
    wins, so a (6, 5, 5) variable factors axes 0 and 1. t5x's `_factored_dims` may break a
    tie differently: it takes the last two of `np.argsort(shape)` (numpy's default sort,
    not guaranteed stable), which for (6, 5, 5) gives axes 0 and 2.
    "last_two" (tensor2tensor `_should_use_factored_second_moment_estimate`): the last two axes
    of every rank >= 2 variable whose last two sizes are >= min_dim_size_to_factor (t2t: 0).
    Returns (a, b) = (second largest, largest): "v_row" = mean of g^2 over axis b (keeps a),
    "v_col" = mean over axis a.

    Args:
      shape: the variable's shape.
      factored: False: never factor (None).
      factoring: "two_largest" or "last_two" (above).
      min_dim_size_to_factor: the smallest size of a factored axis.

    Returns:
      `(a, b)` as above, or None when the variable is not factored.

    Example:
      >>> from tf_metaalign.optimizers import factored_dims
      >>> factored_dims((6, 5, 5), min_dim_size_to_factor=2)  # ties: the earlier axis wins
      (1, 0)
      >>> factored_dims((512, 128)), factored_dims((512,)), factored_dims((512, 64))
      ((1, 0), None, None)
    """
    shape = tuple(int(d) for d in shape)
    if not factored or len(shape) < 2:
        return None
    if factoring == "two_largest":
        largest, second = sorted(range(len(shape)), key=lambda d: -shape[d])[:2]
        if shape[second] < min_dim_size_to_factor:
            return None
        return (second, largest)
    if factoring == "last_two":
        if min(shape[-2], shape[-1]) < min_dim_size_to_factor:
            return None
        return (len(shape) - 2, len(shape) - 1)
    raise ValueError(f"`factoring` must be one of {FACTORINGS}, got factoring={factoring!r}.")


class AdafactorRule(base.UpdateRule):
    """Adafactor (Shazeer & Stern 2018) as in Mesh TensorFlow `AdafactorOptimizer` and t5x.

    With a 1-based step t and d = decay_rate (an exponent, 0.8 in T5/Pegasus):
        rho  = 1 - max(t - decay_offset, 1)^(-d)                  second-moment decay
        G    = g^2 + epsilon_1
        factored over axes (a, b):
            v_row <- rho * v_row + (1 - rho) * mean_b(G)          (shape without axis b)
            v_col <- rho * v_col + (1 - rho) * mean_a(G)          (shape without axis a)
            v_hat  = v_row[.., b=new] * v_col[.., a=new] / mean_a(v_row)
        unfactored:
            v     <- rho * v + (1 - rho) * G;  v_hat = v
        x    = g / sqrt(v_hat)
        x    = x / max(1, RMS(x) / clipping_threshold)            (skipped when None)
        s    = learning_rate * max(RMS(w), epsilon_2)   if options["parameter_scale"]
               learning_rate                            otherwise
        u    = s * x
        with beta_1 (not None):  m <- beta_1 * m + (1 - beta_1) * u;  u = m   (no debiasing)
        w   <- w - u                                 (weight_decay_rate None or option off)
        w   <- (1 - weight_decay_rate) * w - u       (t5x; the decay is not scaled by the rate)
    RMS is over the whole variable. The learning rate is used as given (no 1/sqrt(t) cap).
    Options: {"factored_dims": (a, b) or None, "parameter_scale": bool, "weight_decay": bool}.
    Slots: "v_row", "v_col" (factored) or "v", then "m" when beta_1 is not None.

    Args:
      beta_1: as in `Adafactor`.
      decay_rate: as in `Adafactor`.
      decay_offset: as in `Adafactor`.
      epsilon_1: as in `Adafactor`.
      epsilon_2: as in `Adafactor`.
      clipping_threshold: as in `Adafactor`.
      factored: as in `Adafactor`.
      factoring: as in `Adafactor`.
      min_dim_size_to_factor: as in `Adafactor`.
      multiply_by_parameter_scale: as in `Adafactor`.
      weight_decay_rate: as in `Adafactor`.

    Example:
      >>> from tf_metaalign.optimizers import AdafactorRule
      >>> rule = AdafactorRule(min_dim_size_to_factor=2)
      >>> w = keras.ops.ones((2, 3))
      >>> options = {"factored_dims": (0, 1), "parameter_scale": False, "weight_decay": False}
      >>> slots = rule.init_slots(w, options)
      >>> hparams = {"learning_rate": 0.1}
      >>> new_w, new_slots = rule.update(keras.ops.ones((2, 3)), w, slots, hparams, 1, options)
      >>> np.round(np.asarray(new_w)[0], 4), sorted(new_slots)
      (array([0.9, 0.9, 0.9], dtype=float32), ['v_col', 'v_row'])

    References:
      Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
      ICML 2018. https://arxiv.org/abs/1804.04235
    """

    hyperparameter_names = ("beta_1", "decay_rate", "weight_decay_rate")

    def __init__(
        self,
        beta_1=None,
        decay_rate=0.8,
        decay_offset=0,
        epsilon_1=1e-30,
        epsilon_2=1e-3,
        clipping_threshold=1.0,
        factored=True,
        factoring="two_largest",
        min_dim_size_to_factor=128,
        multiply_by_parameter_scale=True,
        weight_decay_rate=None,
    ):
        super().__init__(beta_1=beta_1, decay_rate=decay_rate, weight_decay_rate=weight_decay_rate)
        self.use_momentum = beta_1 is not None
        self.decay_offset = decay_offset
        self.epsilon_1 = epsilon_1
        self.epsilon_2 = epsilon_2
        self.clipping_threshold = clipping_threshold
        self.factored = factored
        self.factoring = factoring
        self.min_dim_size_to_factor = min_dim_size_to_factor
        self.multiply_by_parameter_scale = multiply_by_parameter_scale
        self.use_weight_decay = weight_decay_rate is not None

    def default_options(self, shape):
        return {
            "factored_dims": factored_dims(
                shape, self.factored, self.factoring, self.min_dim_size_to_factor
            ),
            "parameter_scale": bool(self.multiply_by_parameter_scale),
            "weight_decay": self.use_weight_decay,
        }

    def slot_shapes(self, shape, options):
        shape = tuple(shape)
        dims = options.get("factored_dims")
        shapes = {}
        if dims is not None:
            a, b = dims
            shapes["v_row"] = tuple(d for i, d in enumerate(shape) if i != b)
            shapes["v_col"] = tuple(d for i, d in enumerate(shape) if i != a)
        else:
            shapes["v"] = shape
        if self.use_momentum:
            shapes["m"] = shape
        return shapes

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        c = lambda x: M.cast(x, dtype)  # noqa: E731  (float64 scalar -> compute dtype)
        decay = 1.0 - M.pow(M.maximum(t - float(self.decay_offset), 1.0), -hp["decay_rate"])
        rho, mixing = c(decay), c(1.0 - decay)
        g_sq = M.square(g) + self.epsilon_1
        new_slots = {}
        dims = options.get("factored_dims")
        if dims is not None:
            a, b = dims
            v_row = rho * slots["v_row"] + mixing * M.mean(g_sq, axis=b)
            v_col = rho * slots["v_col"] + mixing * M.mean(g_sq, axis=a)
            new_slots["v_row"], new_slots["v_col"] = v_row, v_col
            a_in_row = a if a < b else a - 1  # axis a's index once axis b is removed
            row_mean = M.mean(v_row, axis=a_in_row, keepdims=True)
            row_factor = M.rsqrt(v_row / row_mean)
            col_factor = M.rsqrt(v_col)
            x = g * M.expand_dims(row_factor, axis=b) * M.expand_dims(col_factor, axis=a)
        else:
            v = rho * slots["v"] + mixing * g_sq
            new_slots["v"] = v
            x = g * M.rsqrt(v)
        if self.clipping_threshold is not None:
            x = x / M.maximum(c(1.0), base.rms(x) / c(self.clipping_threshold))
        scale = c(hp["learning_rate"])
        if options.get("parameter_scale", False):
            scale = scale * M.maximum(base.rms(w), self.epsilon_2)
        u = scale * x
        if self.use_momentum:
            b1 = hp["beta_1"]
            u = c(b1) * slots["m"] + c(1.0 - b1) * u
            new_slots["m"] = u
        if options.get("weight_decay", False) and hp["weight_decay_rate"] is not None:
            new_w = c(1.0 - hp["weight_decay_rate"]) * w - u
        else:
            new_w = w - u
        return self._finish(new_w, var, new_slots, dtype)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class Adafactor(base.BaseOptimizer):
    """Adafactor with Mesh TensorFlow (T5) semantics; see `AdafactorRule` for the exact rule.

    `Adafactor.t5(...)` and `Adafactor.pegasus(...)` give the two reference configurations.

    Args:
      learning_rate: float >= 0, schedule or callable, used as given (no hidden cap); or
        None (the default): tensor2tensor's relative step, `schedules.AdafactorRelativeStep`,
        min(1e-2, 1/sqrt(t)) at update t (1-based), x 0.05 when
        `multiply_by_parameter_scale=False`, as t2t's `_learning_rate_default` and HF's
        `Adafactor(lr=None, relative_step=True)` (HF without the 0.05).
      beta_1: None (no momentum, no "m" slot) or in [0, 1) (variable "beta_1", learnable).
      decay_rate: exponent d of the second-moment decay 1 - (t - decay_offset)^-d, in (0, 1].
      decay_offset: steps subtracted from the 1-based step in the decay (t5x `step_offset`);
        steps <= decay_offset use the first-step decay (0).
      epsilon_1: added to g^2. epsilon_2: floor of the parameter scale.
      clipping_threshold: update clipping threshold (>0) or None.
      factored: use factored second moments.
      factoring: "two_largest" (Mesh TF / t5x) or "last_two" (tensor2tensor).
      min_dim_size_to_factor: factor only when both factored dims are at least this size.
      multiply_by_parameter_scale: scale the update by max(RMS(w), epsilon_2).
      exclude_from_parameter_scale: regex patterns; matching variable paths are not scaled.
      weight_decay_rate: None, or t5x's decay w <- (1 - rate) w - u (not scaled by the rate).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      **kwargs: other `keras.optimizers.Optimizer` arguments.
    Slots are float32 (float64 for float64 variables); a factored variable has only "v_row"
    and "v_col" (no full-size second-moment slot).

    Example:
      >>> from tf_metaalign.optimizers import Adafactor
      >>> opt = Adafactor(learning_rate=0.01, min_dim_size_to_factor=2)
      >>> w = keras.Variable(keras.ops.ones((3, 4)))
      >>> _ = opt.apply_gradients([(keras.ops.full((3, 4), 0.5), w)])
      >>> {k: tuple(v.shape) for k, v in opt.slots_for(w).items()}  # factored: rows, columns
      {'v_row': (3,), 'v_col': (4,)}
      >>> round(float(w[0, 0]), 4)  # 1 - 0.01 * RMS(w) * sign(g): the update is clipped to RMS 1
      0.99

    References:
      Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
      ICML 2018. https://arxiv.org/abs/1804.04235
    """

    def __init__(
        self,
        learning_rate=None,
        beta_1=None,
        decay_rate=0.8,
        decay_offset=0,
        epsilon_1=1e-30,
        epsilon_2=1e-3,
        clipping_threshold=1.0,
        factored=True,
        factoring="two_largest",
        min_dim_size_to_factor=128,
        multiply_by_parameter_scale=True,
        exclude_from_parameter_scale=(),
        weight_decay_rate=None,
        aggregated_clipnorm=None,
        name="Adafactor",
        **kwargs,
    ):
        beta_1 = base.check_unit_interval("beta_1", beta_1, allow_none=True)
        decay_rate = base.check_non_negative("decay_rate", decay_rate, positive=True)
        if decay_rate > 1:
            raise ValueError(f"`decay_rate` must be in (0, 1], got decay_rate={decay_rate}.")
        if isinstance(decay_offset, bool) or not isinstance(decay_offset, int) or decay_offset < 0:
            raise ValueError(
                f"`decay_offset` must be an int >= 0, got decay_offset={decay_offset!r}."
            )
        epsilon_1 = base.check_non_negative("epsilon_1", epsilon_1)
        epsilon_2 = base.check_non_negative("epsilon_2", epsilon_2)
        clipping_threshold = base.check_non_negative(
            "clipping_threshold", clipping_threshold, allow_none=True, positive=True
        )
        if factoring not in FACTORINGS:
            raise ValueError(
                f"`factoring` must be one of {FACTORINGS}, got factoring={factoring!r}."
            )
        if (
            isinstance(min_dim_size_to_factor, bool)
            or not isinstance(min_dim_size_to_factor, int)
            or min_dim_size_to_factor < 0
        ):
            raise ValueError(
                "`min_dim_size_to_factor` must be an int >= 0, got "
                f"min_dim_size_to_factor={min_dim_size_to_factor!r}."
            )
        exclude_ps = base.check_name_patterns(
            "exclude_from_parameter_scale", exclude_from_parameter_scale
        )
        weight_decay_rate = base.check_unit_interval(
            "weight_decay_rate", weight_decay_rate, allow_none=True
        )
        if learning_rate is None:
            learning_rate = schedules.AdafactorRelativeStep(bool(multiply_by_parameter_scale))
        rule = AdafactorRule(
            beta_1=beta_1,
            decay_rate=decay_rate,
            decay_offset=decay_offset,
            epsilon_1=epsilon_1,
            epsilon_2=epsilon_2,
            clipping_threshold=clipping_threshold,
            factored=bool(factored),
            factoring=factoring,
            min_dim_size_to_factor=min_dim_size_to_factor,
            multiply_by_parameter_scale=bool(multiply_by_parameter_scale),
            weight_decay_rate=weight_decay_rate,
        )
        variable_hparams = {}
        if beta_1 is not None:
            variable_hparams["beta_1"] = beta_1
        super().__init__(
            learning_rate,
            rule,
            variable_hyperparameters=variable_hparams,
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            **kwargs,
        )
        self.beta_1 = beta_1
        self.decay_rate = decay_rate
        self.decay_offset = decay_offset
        self.epsilon_1 = epsilon_1
        self.epsilon_2 = epsilon_2
        self.clipping_threshold = clipping_threshold
        self.factored = bool(factored)
        self.factoring = factoring
        self.min_dim_size_to_factor = min_dim_size_to_factor
        self.multiply_by_parameter_scale = bool(multiply_by_parameter_scale)
        self.exclude_from_parameter_scale_patterns = exclude_ps
        self.weight_decay_rate = weight_decay_rate
        self.differentiable_hyperparameters = (
            ("learning_rate", "beta_1") if beta_1 is not None else ("learning_rate",)
        )

    @classmethod
    def t5(cls, learning_rate=1e-3, **kwargs):
        """T5 (Mesh TensorFlow) Adafactor: no momentum, decay 0.8, two largest dims >= 128,
        update clipping 1.0, parameter scale on. T5 fine-tuning uses a constant 1e-3; T5
        pre-training `schedules.T5InverseSquareRootSchedule(10000)`."""
        config = dict(
            beta_1=None,
            decay_rate=0.8,
            clipping_threshold=1.0,
            factoring="two_largest",
            min_dim_size_to_factor=128,
            multiply_by_parameter_scale=True,
        )
        config.update(kwargs)
        return cls(learning_rate, **config)

    @classmethod
    def pegasus(cls, learning_rate=None, **kwargs):
        """Pegasus (tensor2tensor) Adafactor: beta1=0 (no momentum), decay 0.8, the last two
        dims of every rank >= 2 variable factored, clipping 1.0, parameter scale on. The default
        rate is Pegasus's `schedules.PegasusSchedule(0.01)`."""
        if learning_rate is None:
            learning_rate = schedules.PegasusSchedule(0.01)
        config = dict(
            beta_1=None,
            decay_rate=0.8,
            clipping_threshold=1.0,
            factoring="last_two",
            min_dim_size_to_factor=0,
            multiply_by_parameter_scale=True,
        )
        config.update(kwargs)
        return cls(learning_rate, **config)

    def variable_options(self, variable):
        options = self.rule.default_options(tuple(variable.shape))
        if options["parameter_scale"] and base.matches_any(
            base.variable_path(variable), self.exclude_from_parameter_scale_patterns
        ):
            options["parameter_scale"] = False
        return options

    def get_config(self):
        config = super().get_config()
        config.update(
            beta_1=self.beta_1,
            decay_rate=self.decay_rate,
            decay_offset=self.decay_offset,
            epsilon_1=self.epsilon_1,
            epsilon_2=self.epsilon_2,
            clipping_threshold=self.clipping_threshold,
            factored=self.factored,
            factoring=self.factoring,
            min_dim_size_to_factor=self.min_dim_size_to_factor,
            multiply_by_parameter_scale=self.multiply_by_parameter_scale,
            exclude_from_parameter_scale=list(self.exclude_from_parameter_scale_patterns),
            weight_decay_rate=self.weight_decay_rate,
        )
        return config
