"""RecAdam (Chen et al. 2020, "Recall and Learn"; Sanyuan-Chen/RecAdam RecAdam.py)."""

import contextlib
import math
import numbers
import warnings

import keras
import numpy as np

from tf_metaalign.optimizers import _math as M
from tf_metaalign.optimizers import base

ANNEAL_FUNCTIONS = ("sigmoid", "linear", "constant")


def anneal_lambda(anneal_fun, step, k, t0, weight):
    """The reference's `anneal_function` on a (float64) step tensor:
    sigmoid: weight / (1 + exp(-k (t - t0))); linear: weight * min(1, t / t0);
    constant: weight.

    Args:
      anneal_fun: "sigmoid", "linear" or "constant".
      step: the step t.
      k: the sigmoid's slope.
      t0: the sigmoid's midpoint, the linear ramp's length.
      weight: the scale (`anneal_w`).

    Example:
      >>> from tf_metaalign.optimizers import anneal_lambda
      >>> t = keras.ops.array([0.0, 100.0, 200.0])
      >>> lam = anneal_lambda("sigmoid", t, k=0.1, t0=100.0, weight=1.0)
      >>> [round(float(x), 4) for x in lam]  # float64 (float32 on JAX without x64)
      [0.0, 0.5, 1.0]"""
    dtype = M.wide_float()  # float64 (float32 on JAX without jax_enable_x64)
    step = M.cast(step, dtype)
    weight = M.constant(float(weight), dtype)
    if anneal_fun == "sigmoid":
        return weight / (
            1.0 + M.exp(M.constant(-float(k), dtype) * (step - M.constant(float(t0), dtype)))
        )
    if anneal_fun == "linear":
        return weight * M.minimum(M.constant(1.0, dtype), step / M.constant(float(t0), dtype))
    return weight + 0.0 * step


class RecAdamRule(base.UpdateRule):
    """The reference RecAdam step (`RecAdam.step`), t 1-based, lr the effective rate:

        m <- beta_1 m + (1 - beta_1) g ;  v <- beta_2 v + (1 - beta_2) g^2
        a  = lr sqrt(1 - beta_2^t) / (1 - beta_1^t)   (a = lr if not correct_bias)
        if anneal_w > 0:
            lambda = anneal(t)                           (anneal_lambda)
            w <- w - a lambda m / (sqrt(v) + epsilon)
            w <- w - lr (anneal_w - lambda) pretrain_cof (w - w_pretrained)   (the NEW w)
        else:
            w <- w - a m / (sqrt(v) + epsilon)
        w <- w - lr weight_decay_rate w                  (the NEW w; no-op at rate 0)

    A variable with the option `{"recall": False}` (`RecAdam(exclude_from_recall=...)`:
    the reference's parameter group of NEW weights, e.g. a task head, which it gives
    anneal_w = 0) takes the `else` branch: plain Adam.

    Slots: "m", "v" and "pretrained", the weights the quadratic penalty pulls toward:
    `init_slots` (and the optimizer's `build`) initialise it from the variable's value,
    and the update returns it unchanged. The annealing configuration is static (python
    values on the rule); the hyperparameters are learning_rate, beta_1, beta_2, epsilon
    and weight_decay_rate.

    Args:
      beta_1: the default beta_1.
      beta_2: the default beta_2.
      epsilon: the default epsilon.
      weight_decay_rate: the default decoupled decay.
      correct_bias: as in `RecAdam`.
      anneal_fun: as in `RecAdam`.
      anneal_k: as in `RecAdam`.
      anneal_t0: as in `RecAdam`.
      anneal_w: as in `RecAdam`.
      pretrain_cof: as in `RecAdam`.

    Example:
      >>> from tf_metaalign.optimizers import RecAdamRule
      >>> rule = RecAdamRule(anneal_fun="linear", anneal_t0=2, pretrain_cof=10.0)
      >>> w = keras.ops.array([2.0])
      >>> slots = rule.init_slots(w, None)  # "pretrained" = 2.0
      >>> new_w, _ = rule.update(keras.ops.array([0.0]), w + 1.0, slots, {"learning_rate": 0.01}, 1)
      >>> round(float(new_w[0]), 4)  # a zero gradient, lambda = 1/2: 3 - 0.01 * 0.5 * 10 * (3 - 2)
      2.95

    References:
      Chen et al., "Recall and Learn: Fine-tuning Deep Pretrained Language Models with Less
      Forgetting", EMNLP 2020. https://arxiv.org/abs/2004.12651
    """

    hyperparameter_names = ("beta_1", "beta_2", "epsilon", "weight_decay_rate")

    def __init__(
        self,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        weight_decay_rate=0.0,
        correct_bias=True,
        anneal_fun="sigmoid",
        anneal_k=0.0,
        anneal_t0=0.0,
        anneal_w=1.0,
        pretrain_cof=5000.0,
    ):
        super().__init__(
            beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay_rate=weight_decay_rate
        )
        self.correct_bias = bool(correct_bias)
        self.anneal_fun = anneal_fun
        self.anneal_k = float(anneal_k)
        self.anneal_t0 = float(anneal_t0)
        self.anneal_w = float(anneal_w)
        self.pretrain_cof = float(pretrain_cof)

    def default_options(self, shape):
        return {"recall": True}

    def slot_shapes(self, shape, options):
        return {"m": tuple(shape), "v": tuple(shape), "pretrained": tuple(shape)}

    def init_slots(self, var, options):
        slots = super().init_slots(var, options)
        slots["pretrained"] = M.cast(M.convert_to_tensor(var), slots["pretrained"].dtype)
        return slots

    def update(self, grad, var, slots, hparams, step, options=None):
        g, w, slots, hp, t, options, dtype = self._prepare(grad, var, slots, hparams, step, options)
        c = lambda x: M.cast(x, dtype)  # noqa: E731
        b1, b2, lr = hp["beta_1"], hp["beta_2"], hp["learning_rate"]
        m, v = base.moment_estimates(g, slots["m"], slots["v"], b1, b2, dtype)
        direction = m / (M.sqrt(v) + c(hp["epsilon"]))
        step_size = lr
        if self.correct_bias:
            step_size = lr * M.sqrt(1.0 - M.pow(b2, t)) / (1.0 - M.pow(b1, t))
        pretrained = slots["pretrained"]
        if self.anneal_w > 0.0 and options.get("recall", True):
            lam = anneal_lambda(self.anneal_fun, t, self.anneal_k, self.anneal_t0, self.anneal_w)
            w = w - c(step_size * lam) * direction
            pull = lr * (M.constant(self.anneal_w, M.wide_float()) - lam) * self.pretrain_cof
            w = w - c(pull) * (w - pretrained)
        else:
            w = w - c(step_size) * direction
        w = w - c(lr * hp["weight_decay_rate"]) * w
        return self._finish(w, var, {"m": m, "v": v, "pretrained": pretrained}, dtype)


def _eager_scope():
    """`tf.init_scope()` on TensorFlow; nothing on JAX."""
    if M.BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


def _check_anneal(anneal_fun, anneal_k, anneal_t0, anneal_w, pretrain_cof):
    if anneal_fun not in ANNEAL_FUNCTIONS:
        raise ValueError(f"`anneal_fun` must be one of {ANNEAL_FUNCTIONS}; got {anneal_fun!r}.")
    for name, value in (("anneal_k", anneal_k), ("anneal_t0", anneal_t0)):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Number)
            or not math.isfinite(value)
        ):
            raise ValueError(f"`{name}` must be a finite number; got {name}={value!r}.")
    anneal_w = base.check_non_negative("anneal_w", anneal_w)
    pretrain_cof = base.check_non_negative("pretrain_cof", pretrain_cof)
    if anneal_fun == "linear" and not anneal_t0 > 0:
        raise ValueError(
            f"`anneal_t0` must be > 0 with anneal_fun='linear' (lambda = min(1, t / t0)); "
            f"got anneal_t0={anneal_t0!r}."
        )
    if anneal_fun == "sigmoid" and anneal_k == 0 and anneal_w > 0:
        warnings.warn(
            "RecAdam: anneal_k=0 makes the sigmoid annealing constant: lambda(t) = "
            "anneal_w / (1 + exp(0)) = anneal_w / 2 at every step"
            + (
                " (the reference's defaults anneal_k = anneal_t0 = 0 give 0.5)"
                if anneal_t0 == 0
                else ""
            )
            + ". Set anneal_k > 0 (the paper uses 0.05 to 1) and anneal_t0 for an annealed "
            "schedule.",
            UserWarning,
            stacklevel=3,
        )
    return float(anneal_k), float(anneal_t0), anneal_w, pretrain_cof


@keras.saving.register_keras_serializable(package="tf_metaalign")
class RecAdam(base.BaseOptimizer):
    """RecAdam: Adam plus an annealed quadratic pull toward the pretrained weights
    (see `RecAdamRule` for the exact update, the reference's).

    The objective is lambda(t) L_target + (1 - lambda(t)) gamma/2 ||w - w*||^2, with
    lambda(t) = anneal_w / (1 + exp(-anneal_k (t - anneal_t0))) by default. The pretrained
    weights w* are the variables' values when the optimizer is BUILT (the first
    `apply_gradients`, or `build`): a per-variable slot "pretrained", checkpointed with the
    optimizer. Build the optimizer (or fit) from the pretrained weights.

    Args:
      learning_rate: float >= 0, schedule or callable.
      beta_1: in [0, 1) (variable, learnable).
      beta_2: in [0, 1) (variable, learnable).
      epsilon: >= 0 (reference 1e-6).
      weight_decay_rate: the reference's `weight_decay` (decoupled, applied last,
        lr * rate * w); named so because Keras's own `weight_decay` argument is applied
        outside the rule.
      correct_bias: Adam's bias correction of the step size (reference default True).
      anneal_fun: "sigmoid", "linear" (lambda = anneal_w min(1, t / anneal_t0)) or
        "constant" (lambda = anneal_w: no pull at all).
      anneal_k: the slope of the sigmoid (reference default 0; with `anneal_t0` = 0 too
        the lambda is the constant anneal_w / 2: a warning says so).
      anneal_t0: the midpoint of the sigmoid (reference default 0).
      anneal_w: the scale of lambda; 0 turns RecAdam into plain Adam (the reference's
        `anneal_w > 0` test).
      pretrain_cof: gamma, the coefficient of the quadratic penalty (reference 5000,
        meant for learning rates ~1e-5: lr * pretrain_cof must stay well below 1).
      exclude_from_recall: regex patterns searched in the variable path; matching
        variables are new weights with no pretrained value (a task head): they take plain
        Adam steps, no annealing and no pull (the reference puts them in a parameter group
        with anneal_w = 0).
      aggregated_clipnorm: clip the all-reduced gradients to this global norm.
      name: the optimizer's name.
      **kwargs: other `keras.optimizers.Optimizer` arguments.

    Example:
      >>> from tf_metaalign.optimizers import RecAdam
      >>> w = keras.Variable([1.0])  # the pretrained value, taken when the optimizer builds
      >>> opt = RecAdam(learning_rate=0.01, anneal_fun="linear", anneal_t0=2, pretrain_cof=10.0)
      >>> for _ in range(3):
      ...     _ = opt.apply_gradients([(keras.ops.array([-1.0]), w)])  # the task pulls w up
      >>> float(opt.slots_for(w)["pretrained"][0]), round(float(w[0]), 4)  # Adam alone: 1.03
      (1.0, 1.0247)

    References:
      Chen et al., "Recall and Learn: Fine-tuning Deep Pretrained Language Models with Less
      Forgetting", EMNLP 2020. https://arxiv.org/abs/2004.12651
    """

    differentiable_hyperparameters = ("learning_rate", "beta_1", "beta_2")

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        weight_decay_rate=0.0,
        correct_bias=True,
        anneal_fun="sigmoid",
        anneal_k=0.0,
        anneal_t0=0.0,
        anneal_w=1.0,
        pretrain_cof=5000.0,
        exclude_from_recall=None,
        aggregated_clipnorm=None,
        name="RecAdam",
        **kwargs,
    ):
        beta_1, beta_2, epsilon = base.check_adam_hyperparameters(beta_1, beta_2, epsilon)
        weight_decay_rate = base.check_non_negative("weight_decay_rate", weight_decay_rate)
        if not isinstance(correct_bias, bool):
            raise ValueError(f"`correct_bias` must be a bool; got correct_bias={correct_bias!r}.")
        anneal_k, anneal_t0, anneal_w, pretrain_cof = _check_anneal(
            anneal_fun, anneal_k, anneal_t0, anneal_w, pretrain_cof
        )
        exclude = base.check_name_patterns("exclude_from_recall", exclude_from_recall or ())
        super().__init__(
            learning_rate,
            RecAdamRule(
                beta_1,
                beta_2,
                epsilon,
                weight_decay_rate,
                correct_bias,
                anneal_fun,
                anneal_k,
                anneal_t0,
                anneal_w,
                pretrain_cof,
            ),
            variable_hyperparameters={"beta_1": beta_1, "beta_2": beta_2},
            aggregated_clipnorm=aggregated_clipnorm,
            name=name,
            **kwargs,
        )
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.weight_decay_rate = weight_decay_rate
        self.correct_bias = correct_bias
        self.anneal_fun = anneal_fun
        self.anneal_k, self.anneal_t0 = anneal_k, anneal_t0
        self.anneal_w, self.pretrain_cof = anneal_w, pretrain_cof
        self.exclude_from_recall_patterns = exclude

    def variable_options(self, variable):
        return {
            "recall": not base.matches_any(
                base.variable_path(variable), self.exclude_from_recall_patterns
            )
        }

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # The "pretrained" slots start as the variables' values (build creates slots as
        # zeros). On TensorFlow under init_scope: a build traced inside a train step must
        # assign once, now, not become an op of the step that would reset the slot at every
        # step. On JAX Keras builds the optimizer eagerly, before the jitted step.
        with _eager_scope():
            for variable, slots in zip(variables, self._slot_variables):
                if "pretrained" in slots:
                    value = M.cast(M.convert_to_tensor(variable), slots["pretrained"].dtype)
                    if M.BACKEND != "tensorflow":
                        # A copy: JAX donates each state buffer to the jitted step, and
                        # the slot must not share the variable's buffer.
                        value = np.array(keras.ops.convert_to_numpy(value))
                    slots["pretrained"].assign(value)

    def get_config(self):
        config = super().get_config()
        config.update(
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            weight_decay_rate=self.weight_decay_rate,
            correct_bias=self.correct_bias,
            anneal_fun=self.anneal_fun,
            anneal_k=self.anneal_k,
            anneal_t0=self.anneal_t0,
            anneal_w=self.anneal_w,
            pretrain_cof=self.pretrain_cof,
            exclude_from_recall=list(self.exclude_from_recall_patterns),
        )
        return config
