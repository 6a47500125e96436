"""Learning-rate schedules of T5, BERT and Pegasus as Keras `LearningRateSchedule`s.

Keras calls a schedule with `optimizer.iterations`, the number of updates already applied
(0 for the first update), which is the TF1 `global_step` the reference code reads.
"""

import keras

from tf_metaalign.optimizers import _math as M


def _check(name, value, minimum=0, positive=False, integer=False):
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and integer:
        ok = isinstance(value, int)
    if ok:
        ok = value > minimum if positive else value >= minimum
    if not ok:
        kind = "an int" if integer else "a number"
        bound = f"> {minimum}" if positive else f">= {minimum}"
        raise ValueError(f"`{name}` must be {kind} {bound}, got {name}={value!r}.")
    return value


def _dtype():
    """The schedules compute in float32, in float64 under `floatx="float64"` (so a float64
    run's rate is its python value, not that value rounded through float32). Python
    constants meet the step tensor in its dtype: exact."""
    return M.wide_float() if keras.backend.floatx() == "float64" else "float32"


@keras.saving.register_keras_serializable(package="tf_metaalign")
class T5InverseSquareRootSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """T5 pre-training: lr(step) = scale / sqrt(max(step, warmup_steps)) (step = global_step).

    With the T5 default warmup_steps=10000 this is 0.01 for the first 10k steps.

    Args:
      warmup_steps: the constant-rate steps (a positive int).
      scale: a factor of the rate (>= 0).

    Example:
      >>> from tf_metaalign.optimizers import T5InverseSquareRootSchedule
      >>> schedule = T5InverseSquareRootSchedule()
      >>> [round(float(schedule(step)), 6) for step in (0, 10_000, 40_000)]
      [0.01, 0.01, 0.005]

    References:
      Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
      Text-to-Text Transformer", JMLR 2020 (Sec. 3.1.2). https://arxiv.org/abs/1910.10683
    """

    def __init__(self, warmup_steps=10000, scale=1.0):
        self.warmup_steps = _check("warmup_steps", warmup_steps, positive=True, integer=True)
        self.scale = float(_check("scale", scale))

    def __call__(self, step):
        step = M.cast(step, _dtype())
        return self.scale * M.rsqrt(M.maximum(step, float(self.warmup_steps)))

    def get_config(self):
        return {"warmup_steps": self.warmup_steps, "scale": self.scale}


@keras.saving.register_keras_serializable(package="tf_metaalign")
class BertSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """BERT `create_optimizer`: linear warmup, then polynomial decay counted from step 0.

        decayed(step) = (init_lr - end_lr) * (1 - min(step, num_train_steps)/num_train_steps)^power
                        + end_lr
        lr(step) = init_lr * step / num_warmup_steps   if step < num_warmup_steps
                   decayed(step)                        otherwise
    (step = global_step, so the first update has rate 0 when warming up, as in BERT.)

    Args:
      init_learning_rate: the peak rate (>= 0).
      num_train_steps: the step at which the decay reaches `end_learning_rate` (> 0).
      num_warmup_steps: the linear warmup's length (0: none).
      end_learning_rate: the rate after `num_train_steps`.
      power: the decay's exponent (1.0: linear, as BERT).

    Example:
      >>> from tf_metaalign.optimizers import BertSchedule
      >>> schedule = BertSchedule(1e-4, num_train_steps=100, num_warmup_steps=10)
      >>> [round(float(schedule(step)), 7) for step in (0, 5, 10, 55, 100)]
      [0.0, 5e-05, 9e-05, 4.5e-05, 0.0]

    References:
      Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
      Understanding", NAACL 2019 (`optimization.create_optimizer` of google-research/bert).
      https://arxiv.org/abs/1810.04805
    """

    def __init__(
        self,
        init_learning_rate,
        num_train_steps,
        num_warmup_steps=0,
        end_learning_rate=0.0,
        power=1.0,
    ):
        self.init_learning_rate = float(_check("init_learning_rate", init_learning_rate))
        self.num_train_steps = _check(
            "num_train_steps", num_train_steps, positive=True, integer=True
        )
        self.num_warmup_steps = _check("num_warmup_steps", num_warmup_steps, integer=True)
        self.end_learning_rate = float(_check("end_learning_rate", end_learning_rate))
        self.power = float(_check("power", power))

    def __call__(self, step):
        step = M.cast(step, _dtype())
        progress = M.minimum(step, float(self.num_train_steps)) / float(self.num_train_steps)
        decayed = (self.init_learning_rate - self.end_learning_rate) * M.pow(
            1.0 - progress, self.power
        ) + self.end_learning_rate
        if self.num_warmup_steps <= 0:
            return decayed
        warmup = self.init_learning_rate * step / float(self.num_warmup_steps)
        return M.where(step < float(self.num_warmup_steps), warmup, decayed)

    def get_config(self):
        return {
            "init_learning_rate": self.init_learning_rate,
            "num_train_steps": self.num_train_steps,
            "num_warmup_steps": self.num_warmup_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
        }


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PegasusSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Pegasus `estimator_utils`: lr = init_lr / 0.01 * rsqrt(max(step, 10000)), and with
    warmup (Pegasus fine-tuning from a checkpoint): min((step + 1) / warmup_steps * init_lr, lr).

    Args:
      init_learning_rate: init_lr (>= 0).
      warmup_steps: None (no warmup) or the warmup's length.
      decay_start_step: the 10000 above.

    Example:
      >>> from tf_metaalign.optimizers import PegasusSchedule
      >>> schedule = PegasusSchedule(0.01)
      >>> [round(float(schedule(step)), 6) for step in (0, 10_000, 40_000)]
      [0.01, 0.01, 0.005]

    References:
      Zhang et al., "PEGASUS: Pre-training with Extracted Gap-sentences for Abstractive
      Summarization", ICML 2020. https://arxiv.org/abs/1912.08777
    """

    def __init__(self, init_learning_rate, warmup_steps=None, decay_start_step=10000):
        self.init_learning_rate = float(_check("init_learning_rate", init_learning_rate))
        if warmup_steps is not None:
            _check("warmup_steps", warmup_steps, positive=True, integer=True)
        self.warmup_steps = warmup_steps
        self.decay_start_step = _check(
            "decay_start_step", decay_start_step, positive=True, integer=True
        )

    def __call__(self, step):
        step = M.cast(step, _dtype())
        lr = self.init_learning_rate / 0.01 * M.rsqrt(M.maximum(step, float(self.decay_start_step)))
        if self.warmup_steps is not None:
            lr = M.minimum((step + 1.0) / float(self.warmup_steps) * self.init_learning_rate, lr)
        return lr

    def get_config(self):
        return {
            "init_learning_rate": self.init_learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay_start_step": self.decay_start_step,
        }


@keras.saving.register_keras_serializable(package="tf_metaalign")
class AdafactorRelativeStep(keras.optimizers.schedules.LearningRateSchedule):
    """tensor2tensor Adafactor's default rate (`AdafactorOptimizer._learning_rate_default`):

        lr(step) = min(1e-2, 1 / sqrt(step + 1))      (x 0.05 without the parameter scale)

    with step = global_step, the number of updates already applied (so update t, 1-based,
    has rate min(1e-2, 1/sqrt(t)), as in HF `Adafactor(lr=None, relative_step=True)` whose
    step counter starts at 1). Constant 1e-2 for the first 10,000 updates, then 1/sqrt(t).
    `multiply_by_parameter_scale=False` multiplies by 0.05 as t2t does (HF does not).
    `Adafactor(learning_rate=None)` uses it.

    Args:
      multiply_by_parameter_scale: as the optimizer's (False: x 0.05).

    Example:
      >>> from tf_metaalign.optimizers import AdafactorRelativeStep
      >>> schedule = AdafactorRelativeStep()
      >>> [round(float(schedule(step)), 6) for step in (0, 9_999, 39_999)]
      [0.01, 0.01, 0.005]

    References:
      Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
      ICML 2018. https://arxiv.org/abs/1804.04235
    """

    def __init__(self, multiply_by_parameter_scale=True):
        if not isinstance(multiply_by_parameter_scale, bool):
            raise ValueError(
                "`multiply_by_parameter_scale` must be True or False, got "
                f"multiply_by_parameter_scale={multiply_by_parameter_scale!r}."
            )
        self.multiply_by_parameter_scale = multiply_by_parameter_scale

    def __call__(self, step):
        step = M.cast(step, _dtype())
        lr = M.minimum(M.rsqrt(step + 1.0), 0.01)
        if not self.multiply_by_parameter_scale:
            lr = lr * 0.05
        return lr

    def get_config(self):
        return {"multiply_by_parameter_scale": self.multiply_by_parameter_scale}
