"""Uncertainty weighting (Kendall et al., CVPR 2018; LibMTL `UW`): learned log-variances."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    check_number,
    register,
    scalar,
)


@register
class UncertaintyWeighting(MultiTaskMethod):
    """Homoscedastic-uncertainty weighting: the objective

        loss = sum_t  L_t / (2 exp(s_t)) + s_t / 2

    with one log-variance s_t per task, initialised to `initial_log_variance` (-0.5) and
    trained by the MODEL's optimizer beside the model (LibMTL `UW`: `loss_scale` is an
    `nn.Parameter` of the model, initialised to -0.5, and `loss.backward()` fills its
    gradient). So the model's gradient is sum_t w_t grad L_t with

        w_t = shared[t] = specific[t] = 1 / (2 exp(s_t))

    (s detached: one backward pass of sum_t w_t L_t), and the state gradient handed to
    the optimizer is

        d loss / d s_t = -L_t / (2 exp(s_t)) + 1/2      (`state_gradients["log_variances"]`).

    Absent tasks (`present[t] == 0`) are left out of the objective: w_t = 0 and their
    s_t gets a zero gradient (LibMTL's tasks are always present; a task missing from a
    batch would otherwise still be pulled towards s_t -> -inf by the s_t/2 term).

    Reported loss (`loss_weights`): LibMTL's UW loss itself, s_t/2 included. The term
    s_t/2 is not a multiple of L_t, so it is carried by its own task's loss weight,
    `loss_weights[t] = 1/(2 exp(s_t)) + s_t / (2 L_t)` (then sum_t loss_weights[t] L_t
    is exactly the UW loss); a present task whose loss is exactly 0 cannot carry it and
    reports 1/(2 exp(s_t)) (its s_t/2 is then missing from the reported number, not from
    the training). The reported loss can be negative (s_t < 0 once L_t < 1).

    State: `uw_log_variances` [T] (trainable: trained by the model's optimizer, so with
    its learning rate, schedule and weight decay, as in LibMTL).

    Args:
      initial_log_variance: the initial s_t (LibMTL: -0.5).

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method
      >>> get_method("uw")
      UncertaintyWeighting(initial_log_variance=-0.5)
    """

    name = "uw"
    aliases = ("uncertainty",)
    uses_gradients = False
    kind = "loss"
    reference = "LibMTL UW (NumPy re-derivation)"

    def __init__(self, initial_log_variance: float = -0.5):
        self.initial_log_variance = check_number("initial_log_variance", initial_log_variance)

    def state_spec(self, num_tasks):
        return {
            "log_variances": StateSpec(
                (num_tasks,), initializer=self.initial_log_variance, trainable=True
            )
        }

    def combine(self, inputs, state):
        acc = inputs.dtype
        present, losses = inputs.present, inputs.losses
        s = ops.cast(state["log_variances"], acc)
        half = scalar(0.5, acc)
        weights = present * half * ops.exp(-s)
        grad_s = present * (half - weights * losses)
        nonzero = ops.not_equal(losses, ops.zeros_like(losses))
        safe = ops.where(nonzero, losses, ops.ones_like(losses))
        carried = ops.where(
            ops.logical_and(nonzero, ops.greater(present, 0)), half * s / safe, ops.zeros_like(s)
        )
        return Combination(
            shared=weights,
            specific=weights,
            loss_weights=weights + carried,
            state_gradients={"log_variances": grad_s},
        )

    def get_config(self):
        return {"initial_log_variance": self.initial_log_variance}
