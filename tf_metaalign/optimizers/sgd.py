"""SGD with (Nesterov) momentum, Keras semantics, as a pure rule plus a Keras optimizer."""

import keras


from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base


class SGDRule(base.UpdateRule):
    """Keras `keras.optimizers.SGD` rule (learning rate inside the momentum buffer).

    Without momentum:   w <- w - lr * g
    With momentum mu:   m <- mu * m - lr * g
                        w <- w + m                       (nesterov=False)
                        w <- w + mu * m - lr * g         (nesterov=True)
    Slot "momentum" exists only when `has_momentum` (default: momentum > 0).

    Args:
      momentum: the default momentum mu.
      nesterov: Nesterov momentum.
      has_momentum: whether there is a momentum slot (None: momentum > 0); True keeps it
        for a momentum of 0 that will be learned.

    Example:
      >>> from tf_metaalign.optimizers import SGDRule
      >>> rule, w = SGDRule(momentum=0.9), keras.ops.array([1.0])
      >>> slots = rule.init_slots(w, None)
      >>> w, slots = rule.update(keras.ops.array([1.0]), w, slots, {"learning_rate": 0.1}, 1)
      >>> w, slots = rule.update(keras.ops.array([1.0]), w, slots, {"learning_rate": 0.1}, 2)
      >>> round(float(w[0]), 4), round(float(slots["momentum"][0]), 4)
      (0.71, -0.19)
    """

    hyperparameter_names = ("momentum",)

    def __init__(self, momentum=0.0, nesterov=False, has_momentum=None):
        super().__init__(momentum=momentum)
        self.nesterov = bool(nesterov)
        self.has_momentum = (momentum > 0) if has_momentum is None else bool(has_momentum)

    def slot_shapes(self, shape, options):
        return {"momentum": tuple(shape)} if self.has_momentum else {}

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, step, options, dtype = self._prepare(
            grad, var, slots, hparams, step, options
        )
        lr = M.cast(hp["learning_rate"], dtype)
        if not self.has_momentum:
            return self._finish(w - lr * g, var, {}, dtype)
        mu = M.cast(hp["momentum"], dtype)
        m = mu * slots["momentum"] - lr * g
        if self.nesterov:
            new_w = w + mu * m - lr * g
        else:
            new_w = w + m
        return self._finish(new_w, var, {"momentum": m}, dtype)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class SGD(base.BaseOptimizer):
    """Stochastic gradient descent with Keras's momentum semantics (see `SGDRule`).

    Args:
      learning_rate: float >= 0, a `LearningRateSchedule` or a callable.
      momentum: float in [0, 1); stored as the variable "momentum" (learnable) when > 0.
      nesterov: Nesterov momentum.
      aggregated_clipnorm: clip the all-reduced gradient list to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import SGD
      >>> w = keras.Variable([1.0])
      >>> opt = SGD(learning_rate=0.1, momentum=0.9)
      >>> for _ in range(2):
      ...     _ = opt.apply_gradients([(keras.ops.array([1.0]), w)])
      >>> round(float(w[0]), 4)  # 1 - 0.1 - (0.9 * 0.1 + 0.1)
      0.71
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.0,
        nesterov=False,
        aggregated_clipnorm=None,
        name="SGD",
        **kwargs,
    ):
        momentum = base.check_unit_interval("momentum", momentum)
        super().__init__(
            learning_rate,
            SGDRule(momentum=momentum, nesterov=nesterov),
            variable_hyperparameters={"momentum": momentum} if momentum > 0 else {},
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            **kwargs,
        )
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        self.differentiable_hyperparameters = (
            ("learning_rate", "momentum") if momentum > 0 else ("learning_rate",)
        )

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, nesterov=self.nesterov)
        return config
