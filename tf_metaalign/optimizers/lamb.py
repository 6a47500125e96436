"""LAMB as in google-research/bert and ALBERT `lamb_optimizer.py` (and the tf-addons variant)."""

import functools

import keras

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base
from tf_metaalign.optimizers.adam_weight_decay import (
    BERT_EXCLUDE_FROM_WEIGHT_DECAY,
    _DecayExcludingAdam,
)


def safe_norm(x):
    """L2 norm whose derivative is 0 (not NaN) at x = 0."""
    sq = M.sum(M.square(x))
    positive = sq > 0
    return M.where(positive, M.sqrt(M.where(positive, sq, M.ones_like(sq))), M.zeros_like(sq))


class LambRule(base.UpdateRule):
    """The BERT/ALBERT LAMB rule; `bias_correction=True` gives tf-addons / Model Garden LAMB.

        m <- beta_1 * m + (1 - beta_1) * g
        v <- beta_2 * v + (1 - beta_2) * g^2
        (bias_correction: m_hat = m / (1 - beta_1^t), v_hat = v / (1 - beta_2^t); else m, v)
        u  = m_hat / (sqrt(v_hat) + epsilon)  [+ weight_decay_rate * w  if options["weight_decay"]]
        r  = ||w|| / ||u|| if options["layer_adaptation"] and both norms > 0, else 1
        w <- w - learning_rate * r * u

    The decay is inside the trust ratio (it enters ||u||). Norms are over the whole variable.
    Options: {"weight_decay": bool, "layer_adaptation": bool}.

    Args:
      weight_decay_rate: the default decay coefficient.
      beta_1: the default beta_1.
      beta_2: the default beta_2.
      epsilon: the default epsilon.
      bias_correction: as in `Lamb`.

    Example:
      >>> from tf_metaalign.optimizers import LambRule
      >>> rule, w = LambRule(bias_correction=True), keras.ops.array([3.0, 4.0])
      >>> new_w, _ = rule.update(
      ...     keras.ops.array([1.0, 1.0]), w, rule.init_slots(w, None), {"learning_rate": 0.1}, 1,
      ...     {"weight_decay": False, "layer_adaptation": True},
      ... )
      >>> np.round(np.asarray(new_w), 3)  # u = (1, 1), r = 5 / sqrt(2)
      array([2.646, 3.646], dtype=float32)

    References:
      You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
      minutes", ICLR 2020. https://arxiv.org/abs/1904.00962
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon", "weight_decay_rate")

    def __init__(
        self, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-6, bias_correction=False
    ):
        super().__init__(
            weight_decay_rate=weight_decay_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon
        )
        self.bias_correction = bool(bias_correction)

    def default_options(self, shape):
        return {"weight_decay": True, "layer_adaptation": True}

    def slot_shapes(self, shape, options):
        return {"m": tuple(shape), "v": tuple(shape)}

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        c = lambda x: M.cast(x, dtype)  # noqa: E731  (float64 scalar -> compute dtype)
        b1, b2 = hp["beta_1"], hp["beta_2"]
        m, v = base.moment_estimates(g, slots["m"], slots["v"], b1, b2, dtype)
        if self.bias_correction:
            m_hat = m / c(1.0 - M.pow(b1, t))
            v_hat = v / c(1.0 - M.pow(b2, t))
        else:
            m_hat, v_hat = m, v
        update = m_hat / (M.sqrt(v_hat) + c(hp["epsilon"]))
        if options.get("weight_decay", True):
            update = update + c(hp["weight_decay_rate"]) * w
        if options.get("layer_adaptation", True):
            w_norm = safe_norm(w)
            u_norm = safe_norm(update)
            ok = M.logical_and(w_norm > 0, u_norm > 0)
            ratio = M.where(ok, w_norm / M.where(ok, u_norm, M.ones_like(u_norm)), 1.0)
            update = ratio * update
        return self._finish(w - c(hp["learning_rate"]) * update, var, {"m": m, "v": v}, dtype)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class Lamb(_DecayExcludingAdam):
    """LAMB with the BERT/ALBERT semantics by default (see `LambRule`).

    Args:
      learning_rate: float >= 0, schedule or callable.
      weight_decay_rate: float >= 0 (variable, learnable).
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0 (1e-6 as in BERT/ALBERT and tf-addons).
      exclude_from_weight_decay: regex patterns `re.search`ed in the Keras variable path (the
        mapping from BERT names is in `AdamWeightDecay`'s docstring).
      exclude_from_layer_adaptation: patterns for variables whose trust ratio is 1; `None`
        (default) uses `exclude_from_weight_decay`, as ALBERT's lamb_optimizer does.
      bias_correction: False: BERT/ALBERT; True: tf-addons / Model Garden LAMB.
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import Lamb
      >>> w = keras.Variable([3.0, 4.0])  # ||w|| = 5
      >>> _ = Lamb(learning_rate=0.1, weight_decay_rate=0.0).apply_gradients(
      ...     [(keras.ops.array([1.0, 1.0]), w)]
      ... )
      >>> np.round(w.numpy(), 3)  # lr * ||w|| * u / ||u||: 0.1 * 5 / sqrt(2) off each entry
      array([2.646, 3.646], dtype=float32)

    References:
      You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
      minutes", ICLR 2020. https://arxiv.org/abs/1904.00962
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay_rate=0.01,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        exclude_from_weight_decay=BERT_EXCLUDE_FROM_WEIGHT_DECAY,
        exclude_from_layer_adaptation=None,
        bias_correction=False,
        aggregated_clipnorm=None,
        name="Lamb",
        **kwargs,
    ):
        exclude_la = base.check_name_patterns(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation, allow_none=True
        )
        super().__init__(
            learning_rate,
            functools.partial(LambRule, bias_correction=bias_correction),
            weight_decay_rate,
            beta_1,
            beta_2,
            epsilon,
            exclude_from_weight_decay,
            aggregated_clipnorm,
            name,
            **kwargs,
        )
        self.bias_correction = bool(bias_correction)
        self.exclude_from_layer_adaptation_patterns = exclude_la

    def variable_options(self, variable):
        layer_exclusions = self.exclude_from_layer_adaptation_patterns
        if layer_exclusions is None:
            layer_exclusions = self.exclude_from_weight_decay_patterns
        return {
            **super().variable_options(variable),
            "layer_adaptation": not base.matches_any(
                base.variable_path(variable), layer_exclusions
            ),
        }

    def get_config(self):
        config = super().get_config()
        config.update(
            exclude_from_layer_adaptation=(
                None
                if self.exclude_from_layer_adaptation_patterns is None
                else list(self.exclude_from_layer_adaptation_patterns)
            ),
            bias_correction=self.bias_correction,
        )
        return config
