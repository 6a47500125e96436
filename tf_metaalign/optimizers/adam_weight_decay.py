"""BERT's AdamWeightDecayOptimizer (google-research/bert optimization.py)."""

import keras

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base

BERT_EXCLUDE_FROM_WEIGHT_DECAY = ("LayerNorm", "layer_norm", "bias")


class AdamWeightDecayRule(base.UpdateRule):
    """BERT's rule: Adam without bias correction, L2 decay added to the update (its first
    steps are 3-6.6x Adam's at the same rate: see `AdamWeightDecay`).

        m <- beta_1 * m + (1 - beta_1) * g
        v <- beta_2 * v + (1 - beta_2) * g^2
        u  = m / (sqrt(v) + epsilon)  [+ weight_decay_rate * w   if options["weight_decay"]]
        w <- w - learning_rate * u

    `w` in the decay term is the value before this step. Options: {"weight_decay": bool}.

    Args:
      weight_decay_rate: the default decay coefficient.
      beta_1: the default beta_1.
      beta_2: the default beta_2.
      epsilon: the default epsilon.

    Example:
      >>> from tf_metaalign.optimizers import AdamWeightDecayRule
      >>> rule, w = AdamWeightDecayRule(), keras.ops.array([1.0])
      >>> new_w, _ = rule.update(
      ...     keras.ops.array([0.5]), w, rule.init_slots(w, None), {"learning_rate": 0.1}, 1,
      ...     {"weight_decay": False},
      ... )
      >>> round(float(new_w[0]), 4)  # 1 - 0.1 * 0.05 / sqrt(0.00025): 3.16x Adam's first step
      0.6838
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon", "weight_decay_rate")

    def __init__(self, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-6):
        super().__init__(
            weight_decay_rate=weight_decay_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon
        )

    def default_options(self, shape):
        return {"weight_decay": True}

    def slot_shapes(self, shape, options):
        return {"m": tuple(shape), "v": tuple(shape)}

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, _, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        c = lambda x: M.cast(x, dtype)  # noqa: E731  (float64 scalar -> compute dtype)
        m, v = base.moment_estimates(g, slots["m"], slots["v"], hp["beta_1"], hp["beta_2"], dtype)
        update = m / (M.sqrt(v) + c(hp["epsilon"]))
        if options.get("weight_decay", True):
            update = update + c(hp["weight_decay_rate"]) * w
        return self._finish(w - c(hp["learning_rate"]) * update, var, {"m": m, "v": v}, dtype)


def decay_options(variable, weight_decay_rate, exclude_from_weight_decay):
    """BERT's `_do_use_weight_decay`: off when the rate is 0/None or a pattern matches."""
    if not weight_decay_rate:
        return False
    return not base.matches_any(base.variable_path(variable), exclude_from_weight_decay)


class _DecayExcludingAdam(base.BaseOptimizer):
    """What BERT's two optimizers, `AdamWeightDecay` and `Lamb`, share around their rules:
    the checked arguments, beta_1, beta_2 and weight_decay_rate as learnable variables,
    the decay option decided per variable from the exclusion patterns (`decay_options`),
    and the config.

    Args:
      learning_rate: float >= 0, schedule or callable.
      make_rule: `make_rule(weight_decay_rate, beta_1, beta_2, epsilon)` -> the
        `UpdateRule`, called with the checked values.
      weight_decay_rate: float >= 0.
      beta_1: in [0, 1).
      beta_2: in [0, 1).
      epsilon: >= 0.
      exclude_from_weight_decay: regex patterns searched in the variable path.
      aggregated_clipnorm: as in `BaseOptimizer`.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.
    """

    differentiable_hyperparameters = ("learning_rate", "beta_1", "beta_2", "weight_decay_rate")

    def __init__(
        self,
        learning_rate,
        make_rule,
        weight_decay_rate,
        beta_1,
        beta_2,
        epsilon,
        exclude_from_weight_decay,
        aggregated_clipnorm,
        name,
        **kwargs,
    ):
        weight_decay_rate = base.check_non_negative("weight_decay_rate", weight_decay_rate)
        beta_1, beta_2, epsilon = base.check_adam_hyperparameters(beta_1, beta_2, epsilon)
        exclude = base.check_name_patterns("exclude_from_weight_decay", exclude_from_weight_decay)
        super().__init__(
            learning_rate,
            make_rule(weight_decay_rate, beta_1, beta_2, epsilon),
            variable_hyperparameters={
                "beta_1": beta_1,
                "beta_2": beta_2,
                "weight_decay_rate": weight_decay_rate,
            },
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            **kwargs,
        )
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude_from_weight_decay_patterns = exclude

    def variable_options(self, variable):
        return {
            "weight_decay": decay_options(
                variable, self.weight_decay_rate, self.exclude_from_weight_decay_patterns
            )
        }

    def get_config(self):
        config = super().get_config()
        config.update(
            weight_decay_rate=self.weight_decay_rate,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            exclude_from_weight_decay=list(self.exclude_from_weight_decay_patterns),
        )
        return config


@keras.saving.register_keras_serializable(package="tf_metaalign")
class AdamWeightDecay(_DecayExcludingAdam):
    """BERT's AdamWeightDecayOptimizer as a Keras 3 optimizer (see `AdamWeightDecayRule`).

    No bias correction; epsilon 1e-6; the decay `weight_decay_rate * w` is added to the Adam
    direction before multiplying by the learning rate (so it follows the schedule).

    Not a drop-in for Keras's "adam" at the same learning rate. Without bias correction
    the early steps are larger: for a steady gradient, update t is
    (1 - beta_1^t) / sqrt(1 - beta_2^t) times Adam's, i.e. 3.2x at step 1, up to 6.6x
    around step 12, 3.2x at step 100, 1.26x at step 1000 (1.0 from about step 3000; beta
    0.9/0.999). BERT pairs it with a warmup (`BertSchedule(num_warmup_steps=...)`) and
    rates around 2e-5..1e-4. Swapped in for `keras.optimizers.Adam` at Adam's rate
    without a warmup, one text model stalled at 0.500 accuracy where Keras's Adam reached
    0.975. For Keras's Adam (or AdamW) semantics use `tf_metaalign.optimizers.Adam`
    (or `AdamW`); use this one to reproduce BERT, with BERT's schedule.

    Exclusions. BERT tests `re.search(pattern, name)` on TF1 names such as
    "bert/encoder/layer_0/attention/output/LayerNorm/gamma" and ".../dense/bias". Here each
    pattern is `re.search`ed in the Keras variable PATH, decided once in `build()`:
      BERT (TF1) name                    Keras 3 / keras-hub path                    excluded by
      .../LayerNorm/gamma, /beta        .../self_attention_layer_norm/gamma, /beta   "layer_norm"
      (keras default LayerNormalization) layer_normalization/gamma                    "layer_norm"
      .../dense/bias                     .../feedforward_output_dense/bias            "bias"
      .../query/bias (EinsumDense)       .../self_attention_layer/query/bias          "bias"
    Keras's own AdamW instead matches `variable.name` (the short name, e.g. "gamma"), so
    "layer_norm" never matches there.

    Args:
      learning_rate: float >= 0, schedule or callable.
      weight_decay_rate: float >= 0 (variable "weight_decay_rate", learnable).
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0.
      exclude_from_weight_decay: regex patterns searched in the variable path.
      aggregated_clipnorm: clip the all-reduced gradients to this global norm (BERT clips at
        1.0; see `BaseOptimizer`).
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import AdamWeightDecay
      >>> layer = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="ones")
      >>> layer.build((None, 1))
      >>> opt = AdamWeightDecay(learning_rate=0.1, weight_decay_rate=0.5)
      >>> variables = layer.trainable_variables
      >>> _ = opt.apply_gradients([(keras.ops.zeros(v.shape), v) for v in variables])
      >>> np.round([float(layer.kernel[0, 0]), float(layer.bias[0])], 4)  # no decay of "bias"
      array([0.95, 1.  ])

    References:
      Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
      Understanding", NAACL 2019 (`optimization.AdamWeightDecayOptimizer` of
      google-research/bert). https://arxiv.org/abs/1810.04805
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay_rate=0.01,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        exclude_from_weight_decay=BERT_EXCLUDE_FROM_WEIGHT_DECAY,
        aggregated_clipnorm=None,
        name="AdamWeightDecay",
        **kwargs,
    ):
        super().__init__(
            learning_rate,
            AdamWeightDecayRule,
            weight_decay_rate,
            beta_1,
            beta_2,
            epsilon,
            exclude_from_weight_decay,
            aggregated_clipnorm,
            name,
            **kwargs,
        )
