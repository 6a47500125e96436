"""flax's (pre-optax) Adam and LAMB, the optimizers of guided learning's reference code.

The reference of `GuidedTrainer` (google-research `gradient_based_tuning`) trains the model
with `flax.optim.LAMB` by default (or `flax.optim.Adam`) and updates the learned raw values
with `flax.optim.Adam`. Both differ from the package's Keras-semantics `Adam` and BERT's
`Lamb`; `GuidedTrainer(..., reference="gradient_based_tuning")` trains with these instead.
The arithmetic is rewritten here from `flax/optim/adam.py` and `flax/optim/lamb.py`
(flax <= 0.5); step t 1-based:

    m <- beta_1 * m + (1 - beta_1) * g
    v <- beta_2 * v + (1 - beta_2) * g^2
    m_hat = m / (1 - beta_1^t),  v_hat = v / (1 - beta_2^t)
    u = m_hat / (sqrt(v_hat) + epsilon)            # epsilon AFTER bias correction

    Adam:  w <- w - lr * u - lr * weight_decay * w
    LAMB:  u <- u + weight_decay * w               (every variable)
           r = ||w|| / ||u|| if ||w|| + ||u|| > 0 else 1   (every variable: no exclusions)
           w <- w - lr * r * u

Keras's Adam (`optimizers.Adam`) adds epsilon to sqrt(v) *before* bias correction
(`lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)`): at the paper's
epsilon 1e-6 and gradients of size 1e-6 a first step differs by tens of percent.
flax's LAMB freezes a variable that is all zeros (||w|| = 0 gives r = 0), e.g. biases
initialised at zero; BERT's `Lamb` uses r = 1 there and excludes biases and LayerNorm
from the trust ratio by name. One deviation: where ||u|| = 0 < ||w|| flax computes
r = inf and 0 * inf = NaN; here r = 1 (the zero update leaves w unchanged).

Both backends: the rules are written in `optimizers._math`'s ops plus `where` and
`reduce_sum` below (TensorFlow's own ops on TensorFlow, so guided learning's
`forward_mode.Dual`s dispatch through them; `keras.ops` on JAX, where `jax.jvp`
differentiates them).
"""

import keras
import numpy as np

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base

if M.BACKEND == "tensorflow":
    import tensorflow as tf

    _where, _reduce_sum = tf.where, tf.reduce_sum
    _ones_like, _zeros_like = tf.ones_like, tf.zeros_like
else:
    from keras import ops

    _where, _reduce_sum = ops.where, ops.sum
    _ones_like, _zeros_like = ops.ones_like, ops.zeros_like


def safe_norm(x):
    """L2 norm whose derivative is 0 (not NaN) at x = 0 (`optimizers.lamb.safe_norm`'s
    formula, repeated here so flax's LAMB does not need BERT's LAMB module)."""
    sq = _reduce_sum(M.square(x))
    positive = sq > 0
    return _where(positive, M.sqrt(_where(positive, sq, _ones_like(sq))), _zeros_like(sq))


def _moments_and_direction(g, slots, hp, t, dtype):
    """flax's moment updates and bias-corrected direction m_hat / (sqrt(v_hat) + eps)."""
    c = lambda x: M.cast(x, dtype)  # noqa: E731  (float64 scalar -> compute dtype)
    b1, b2 = hp["beta_1"], hp["beta_2"]
    m, v = base.moment_estimates(g, slots["m"], slots["v"], b1, b2, dtype)
    m_hat = m / c(1.0 - M.pow(b1, t))
    v_hat = v / c(1.0 - M.pow(b2, t))
    return m, v, m_hat / (M.sqrt(v_hat) + c(hp["epsilon"]))


class FlaxAdamRule(base.UpdateRule):
    """`flax.optim.Adam`: epsilon after bias correction, decoupled decay (module doc).

    Args:
      beta_1: the default beta_1 (flax's 0.9).
      beta_2: the default beta_2 (0.999).
      epsilon: the default epsilon (flax's 1e-8).
      weight_decay: the default decay, relative to the learning rate (flax's 0).

    Example:
      >>> from tf_metaalign.optimizers.flax_reference import FlaxAdamRule
      >>> rule, w = FlaxAdamRule(epsilon=0.5), keras.ops.array([1.0, 2.0])
      >>> new_w, _ = rule.update(
      ...     keras.ops.array([0.5, -0.5]), w, rule.init_slots(w, None),
      ...     {"learning_rate": 0.1}, 1,
      ... )
      >>> np.round(np.asarray(new_w), 4)  # lr * g / (|g| + eps): epsilon after bias correction
      array([0.95, 2.05], dtype=float32)

    References:
      flax `flax/optim/adam.py` (flax <= 0.5), as used by google-research
      `gradient_based_tuning`.
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon", "weight_decay")

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.0):
        super().__init__(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay)

    def slot_shapes(self, shape, options):
        return {"m": tuple(shape), "v": tuple(shape)}

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        m, v, direction = _moments_and_direction(g, slots, hp, t, dtype)
        lr = M.cast(hp["learning_rate"], dtype)
        new_w = w - lr * direction
        if hp["weight_decay"] is not None:
            new_w = new_w - lr * M.cast(hp["weight_decay"], dtype) * w
        return self._finish(new_w, var, {"m": m, "v": v}, dtype)


class FlaxLambRule(FlaxAdamRule):
    """`flax.optim.LAMB`: bias-corrected, trust ratio on every variable (module doc).

    Args:
      beta_1: the default beta_1 (0.9).
      beta_2: the default beta_2 (0.999).
      epsilon: the default epsilon (flax's 1e-6).
      weight_decay: the default decay, added to the direction (flax's 0).

    Example:
      >>> from tf_metaalign.optimizers.flax_reference import FlaxLambRule
      >>> rule = FlaxLambRule()
      >>> w = keras.ops.array([[3.0, 4.0], [0.0, 0.0]])
      >>> new_w, _ = rule.update(
      ...     keras.ops.ones((2, 2)), w, rule.init_slots(w, None), {"learning_rate": 0.1}, 1
      ... )
      >>> np.round(np.asarray(new_w), 3)  # r = ||w|| / ||u|| = 5 / 2
      array([[ 2.75,  3.75],
             [-0.25, -0.25]], dtype=float32)
      >>> zero = keras.ops.zeros((2,))  # a variable at zero stays there (r = 0)
      >>> new_zero, _ = rule.update(
      ...     keras.ops.ones((2,)), zero, rule.init_slots(zero, None), {"learning_rate": 0.1}, 1
      ... )
      >>> np.asarray(new_zero)
      array([0., 0.], dtype=float32)

    References:
      flax `flax/optim/lamb.py` (flax <= 0.5), the default model optimizer of google-research
      `gradient_based_tuning`; You et al., "Large Batch Optimization for Deep Learning",
      ICLR 2020.
    """

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-6, weight_decay=0.0):
        super().__init__(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay)

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        m, v, direction = _moments_and_direction(g, slots, hp, t, dtype)
        if hp["weight_decay"] is not None:
            direction = direction + M.cast(hp["weight_decay"], dtype) * w
        w_norm, u_norm = safe_norm(w), safe_norm(direction)
        # flax: where(|w| + |u| > 0, |w| / |u|, 1); |u| = 0 < |w| gives 1 here, not inf.
        one = M.constant(1.0, dtype)
        ratio = _where(u_norm > 0, w_norm / _where(u_norm > 0, u_norm, one), one)
        new_w = w - M.cast(hp["learning_rate"], dtype) * ratio * direction
        return self._finish(new_w, var, {"m": m, "v": v}, dtype)


class _FlaxOptimizer(base.BaseOptimizer):
    differentiable_hyperparameters = ("learning_rate", "beta_1", "beta_2")
    rule_class = FlaxAdamRule
    default_epsilon = 1e-8
    rule_applies_weight_decay = True

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=None,
        weight_decay=0.0,
        aggregated_clipnorm=None,
        name=None,
        **kwargs,
    ):
        epsilon = self.default_epsilon if epsilon is None else epsilon
        beta_1, beta_2, epsilon = base.check_adam_hyperparameters(beta_1, beta_2, epsilon)
        weight_decay = base.check_non_negative("weight_decay", weight_decay)
        super().__init__(
            learning_rate,
            self.rule_class(
                beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay
            ),
            variable_hyperparameters={"beta_1": beta_1, "beta_2": beta_2},
            aggregated_clipnorm=aggregated_clipnorm,
            name=name or type(self).__name__,
            **kwargs,
        )
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.flax_weight_decay = weight_decay

    def _apply_weight_decay(self, variables):
        return  # the rule applies it

    def get_config(self):
        config = super().get_config()
        config.update(
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            weight_decay=self.flax_weight_decay,
        )
        return config


@keras.saving.register_keras_serializable(package="tf_metaalign")
class FlaxAdam(_FlaxOptimizer):
    """`flax.optim.Adam` as a Keras optimizer (`FlaxAdamRule`; epsilon 1e-8 by default).

    Guided learning's meta-optimizer in the reference semantics, and its model optimizer
    when the reference trains with `--model_optimizer_type=adam`.

    Args:
      learning_rate: float >= 0, schedule or callable.
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0, added after bias correction (None: flax's 1e-8).
      weight_decay: flax's decoupled decay relative to the learning rate (default 0).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers.flax_reference import FlaxAdam
      >>> w = keras.Variable([1.0, 2.0])
      >>> _ = FlaxAdam(learning_rate=0.1).apply_gradients([(keras.ops.array([0.5, -0.5]), w)])
      >>> np.round(w.numpy(), 4)
      array([0.9, 2.1], dtype=float32)

    References:
      flax `flax/optim/adam.py` (flax <= 0.5).
    """


@keras.saving.register_keras_serializable(package="tf_metaalign")
class FlaxLamb(_FlaxOptimizer):
    """`flax.optim.LAMB` as a Keras optimizer (`FlaxLambRule`; epsilon 1e-6 by default).

    The default model optimizer of the reference (`--model_optimizer_type=lamb`): bias
    corrected, the trust ratio on every variable, and variables at zero left frozen.

    Args:
      learning_rate: float >= 0, schedule or callable.
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0, added after bias correction (None: flax's 1e-6).
      weight_decay: added to the direction inside the trust ratio (default 0).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers.flax_reference import FlaxLamb
      >>> w, b = keras.Variable([3.0, 4.0]), keras.Variable([0.0, 0.0])
      >>> _ = FlaxLamb(0.1).apply_gradients([(keras.ops.ones((2,)), w), (keras.ops.ones((2,)), b)])
      >>> np.round(w.numpy(), 3), b.numpy()  # the zero bias does not move
      (array([2.646, 3.646], dtype=float32), array([0., 0.], dtype=float32))

    References:
      flax `flax/optim/lamb.py` (flax <= 0.5).
    """

    rule_class = FlaxLambRule
    default_epsilon = 1e-6


def as_flax_optimizer(optimizer):
    """The flax-semantics counterpart of an Adam or LAMB (else None).

    `optimizers.Adam` -> `FlaxAdam` and `optimizers.Lamb` -> `FlaxLamb` with the same
    learning rate (or schedule), betas and epsilon (LAMB's `weight_decay_rate` becomes
    flax's `weight_decay`, on every variable: the name exclusions have no counterpart);
    `FlaxAdam` / `FlaxLamb` unchanged; anything else None.

    Example:
      >>> from tf_metaalign import optimizers
      >>> from tf_metaalign.optimizers.flax_reference import as_flax_optimizer
      >>> opt = as_flax_optimizer(optimizers.Adam(0.01, epsilon=1e-6))
      >>> type(opt).__name__, float(opt.learning_rate), opt.epsilon
      ('FlaxAdam', 0.01, 1e-06)
    """
    from tf_metaalign.optimizers.adam import Adam

    try:
        from tf_metaalign.optimizers.lamb import Lamb
    except ModuleNotFoundError:  # BERT's LAMB not yet on this backend: nothing to convert
        Lamb = None

    if isinstance(optimizer, _FlaxOptimizer):
        return optimizer
    if type(optimizer) is Adam:
        target, decay = FlaxAdam, 0.0
    elif Lamb is not None and type(optimizer) is Lamb:
        target, decay = FlaxLamb, optimizer.rule.defaults.get("weight_decay_rate") or 0.0
    else:
        return None
    schedule = optimizer._learning_rate_schedule
    if schedule is None:  # a fixed rate (read eagerly; also a mirrored variable's)
        if M.BACKEND == "tensorflow":
            with tf.init_scope():
                schedule = float(optimizer.learning_rate_at(tf.constant(0, tf.int64)).numpy())
        else:
            zero = M.constant(0, M.counter_dtype())
            schedule = float(np.asarray(optimizer.learning_rate_at(zero)))
    learning_rate = schedule
    return target(
        learning_rate,
        beta_1=optimizer.beta_1,
        beta_2=optimizer.beta_2,
        epsilon=optimizer.epsilon,
        weight_decay=decay,
        aggregated_clipnorm=optimizer.aggregated_clipnorm,
    )


__all__ = ["FlaxAdam", "FlaxAdamRule", "FlaxLamb", "FlaxLambRule", "as_flax_optimizer"]
