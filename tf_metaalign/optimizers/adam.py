"""Adam, Keras semantics, as a pure rule plus a Keras optimizer."""

import keras


from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base


class AdamRule(base.UpdateRule):
    """The `keras.optimizers.Adam` rule (amsgrad=False), step t 1-based:

    m <- m + (1 - beta_1) * (g - m)
    v <- v + (1 - beta_2) * (g^2 - v)
    w <- w - lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)

    Args:
      beta_1: the default beta_1 (hparams may override it).
      beta_2: the default beta_2.
      epsilon: the default epsilon.

    Example:
      >>> from tf_metaalign.optimizers import AdamRule
      >>> rule, w = AdamRule(), keras.ops.array([1.0, 2.0])
      >>> new_w, slots = rule.update(
      ...     keras.ops.array([0.5, -0.5]), w, rule.init_slots(w, None), {"learning_rate": 0.1}, 1
      ... )
      >>> np.round(np.asarray(new_w), 4), sorted(slots)
      (array([0.9, 2.1], dtype=float32), ['m', 'v'])

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
      https://arxiv.org/abs/1412.6980
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon")

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        super().__init__(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)

    def slot_shapes(self, shape, options):
        return {"m": tuple(shape), "v": tuple(shape)}

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        b1, b2 = hp["beta_1"], hp["beta_2"]
        m = slots["m"] + M.cast(1.0 - b1, dtype) * (g - slots["m"])
        v = slots["v"] + M.cast(1.0 - b2, dtype) * (M.square(g) - slots["v"])
        alpha = hp["learning_rate"] * M.sqrt(1.0 - M.pow(b2, t)) / (1.0 - M.pow(b1, t))
        new_w = w - M.cast(alpha, dtype) * m / (M.sqrt(v) + M.cast(hp["epsilon"], dtype))
        return self._finish(new_w, var, {"m": m, "v": v}, dtype)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class Adam(base.BaseOptimizer):
    """Adam with the exact `keras.optimizers.Adam` update (see `AdamRule`).

    `beta_1` and `beta_2` are stored as variables (learnable, checkpointed).

    Args:
      learning_rate: float >= 0, schedule or callable.
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0 (Keras's 1e-7).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import Adam
      >>> w = keras.Variable([1.0, 2.0])
      >>> _ = Adam(learning_rate=0.1).apply_gradients([(keras.ops.array([0.5, -0.5]), w)])
      >>> np.round(w.numpy(), 4)  # the first step is lr * sign(g)
      array([0.9, 2.1], dtype=float32)

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
      https://arxiv.org/abs/1412.6980
    """

    differentiable_hyperparameters = ("learning_rate", "beta_1", "beta_2")

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        aggregated_clipnorm=None,
        name="Adam",
        **kwargs,
    ):
        beta_1, beta_2, epsilon = base.check_adam_hyperparameters(beta_1, beta_2, epsilon)
        super().__init__(
            learning_rate,
            AdamRule(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon),
            variable_hyperparameters={"beta_1": beta_1, "beta_2": beta_2},
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            **kwargs,
        )
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def get_config(self):
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon)
        return config


class AdamWRule(AdamRule):
    """The `keras.optimizers.AdamW` rule (Keras's decoupled decay, then `AdamRule`):

        w <- w - w * weight_decay * lr              (if options["weight_decay"])
        then the Adam update of `AdamRule` from the decayed w.

    As Keras does it: the decay uses this step's learning rate (the schedule's value) and
    no bias correction; the decayed value is what the Adam step updates.
    Options: {"weight_decay": bool}.

    Args:
      weight_decay: the default decay coefficient.
      beta_1: the default beta_1.
      beta_2: the default beta_2.
      epsilon: the default epsilon.

    Example:
      >>> from tf_metaalign.optimizers import AdamWRule
      >>> rule, w = AdamWRule(weight_decay=0.5), keras.ops.array([1.0, 2.0])
      >>> new_w, _ = rule.update(
      ...     keras.ops.zeros((2,)), w, rule.init_slots(w, None), {"learning_rate": 0.1}, 1,
      ...     {"weight_decay": True},
      ... )
      >>> np.round(np.asarray(new_w), 4)  # a zero gradient: only the decay, w * (1 - 0.5 * 0.1)
      array([0.95, 1.9 ], dtype=float32)

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
      https://arxiv.org/abs/1711.05101
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon", "weight_decay")

    def __init__(self, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        base.UpdateRule.__init__(
            self, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon
        )

    def default_options(self, shape):
        return {"weight_decay": True}

    def update(self, grad, var, slots, hparams, step, options=None):
        if options is None:
            options = self.default_options(tuple(var.shape))
        wd = hparams.get("weight_decay", self.defaults.get("weight_decay"))
        if options.get("weight_decay", True) and wd is not None:
            dtype = base.compute_dtype_for(var)
            c = lambda x: M.cast(base._to_float64(x), dtype)  # noqa: E731
            w = M.cast(var, dtype)
            # Keras: variable.assign_sub(variable * wd * lr), in the variable's dtype.
            var = M.cast(w - w * c(wd) * c(hparams["learning_rate"]), var.dtype)
        return AdamRule.update(self, grad, var, slots, hparams, step, options)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class AdamW(base.BaseOptimizer):
    """AdamW with the exact `keras.optimizers.AdamW` update (see `AdamWRule`), as a pure rule.

    Same arguments and defaults as Keras's (weight_decay 0.004, epsilon 1e-7), and Keras's
    own exclusions: `opt.exclude_from_weight_decay(var_list=..., var_names=...)` (names
    `re.search`ed in the variable's short name, as Keras does), called before `build`. The
    decay is part of the rule (not applied by Keras outside it), so the update can be
    taken on tensors and differentiated (guided learning); `beta_1` and `beta_2` are
    variables (learnable, checkpointed).

    Args:
      learning_rate: float >= 0, schedule or callable.
      weight_decay: the decoupled decay coefficient (Keras's 0.004).
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0 (Keras's 1e-7).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import AdamW
      >>> w, ref = keras.Variable([1.0, 2.0]), keras.Variable([1.0, 2.0])
      >>> g = keras.ops.array([0.5, -0.5])
      >>> _ = AdamW(learning_rate=0.1, weight_decay=0.5).apply_gradients([(g, w)])
      >>> keras_opt = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5)
      >>> _ = keras_opt.apply_gradients([(g, ref)])
      >>> np.round(w.numpy(), 4), bool(np.allclose(w.numpy(), ref.numpy()))
      (array([0.85, 2. ], dtype=float32), True)

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
      https://arxiv.org/abs/1711.05101
    """

    differentiable_hyperparameters = ("learning_rate", "beta_1", "beta_2")
    #: the rule applies `weight_decay` itself (Keras's generic decay is switched off).
    rule_applies_weight_decay = True

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay=0.004,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        aggregated_clipnorm=None,
        name="AdamW",
        **kwargs,
    ):
        weight_decay = base.check_non_negative("weight_decay", weight_decay)
        beta_1, beta_2, epsilon = base.check_adam_hyperparameters(beta_1, beta_2, epsilon)
        super().__init__(
            learning_rate,
            AdamWRule(weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon),
            variable_hyperparameters={"beta_1": beta_1, "beta_2": beta_2},
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            weight_decay=weight_decay,  # Keras's attribute and config entry
            **kwargs,
        )
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def _apply_weight_decay(self, variables):
        return  # the rule applies it (AdamWRule)

    def variable_options(self, variable):
        return {"weight_decay": bool(self.weight_decay) and self._use_weight_decay(variable)}

    def get_config(self):
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon)
        return config
