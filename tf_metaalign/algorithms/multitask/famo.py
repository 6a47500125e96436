"""FAMO: Fast Adaptive Multitask Optimization (Liu et al., NeurIPS 2023)."""

from __future__ import annotations

import numpy as np
from keras import ops

from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    check_number,
    masked_softmax,
    register,
    scalar,
)

# torch.optim.Adam's defaults (the reference's `w_opt`).
_BETA1, _BETA2, _ADAM_EPSILON = 0.9, 0.999, 1e-8
# The reference's D = L - min_losses + 1e-8.
_LOSS_EPSILON = 1e-8


@register
class FAMO(MultiTaskMethod):
    """Loss weights that balance the tasks' log-loss decrease rates, from task logits w
    with an Adam optimizer of their own (official Cranial-XIX/FAMO `FAMO`, LibMTL `FAMO`).

    The reference back-propagates, at every step,

        z = softmax(w),  D_t = L_t - min_losses_t + 1e-8,  c = sum_t z_t / D_t  (detached)
        loss = sum_t log(D_t) z_t / c

    whose gradient is sum_t (z_t / (c D_t)) grad L_t, so here

        shared[t] = specific[t] = z_t / (c D_t)      (one backward pass of sum_t w_t L_t).

    Then, AFTER the model's optimizer step, it calls `update(curr_losses)` with the
    losses of the SAME batch re-computed at the updated parameters: delta_t =
    log(D_t(prev losses)) - log(D_t(curr losses)), d = J_softmax(w)^T delta (the
    gradient of softmax(w) . delta), and one `torch.optim.Adam(lr=w_lr,
    weight_decay=gamma)` step on w (L2 weight decay: gradient d + gamma w; betas (0.9,
    0.999), eps 1e-8, bias-corrected). The next step's weights use the updated w.

    This method takes no second forward pass: at step k it first updates w with
    delta = log D(L_{k-1}) - log D(L_k), the previous step's losses (at the parameters
    before the previous update) against this step's (at the parameters after it, but on
    THIS step's batch), then computes this step's weights from the updated w. So w has
    had k updates when step k's weights are computed, as in the reference; the update
    sees the loss change across batches instead of on one batch (identical to the
    reference when every step trains on the same batch: full-batch training, which is
    what the tests check). Step 0 has no previous losses and makes no update.

    Absent tasks: a task absent at this step gets weight 0 and is left out of c; the
    logits' update uses only the tasks present at both steps (delta and the softmax
    Jacobian restricted to them: the other logits move only by the weight decay); no
    update at all when no task is present at both steps. D is clamped at 1e-8
    (L_t < min_losses_t would make the reference's log NaN). The official code's
    `max_norm` gradient clipping is not part of the method: use the optimizer's
    `clipnorm`/`global_clipnorm` for it (LibMTL does not clip).

    Reported loss (`loss_weights`): the plain sum of the present tasks' losses (the FAMO
    objective sum_t z_t log(D_t) / c is scale-free and c changes every step, so it is
    not a number to watch).

    State (checkpointed): `famo_logits` [T] (w, initially 0), `famo_prev_losses` [T],
    `famo_prev_present` [T] (the has-previous flag, per task: 1 where the previous step
    had the task), the Adam moments `famo_adam_m`, `famo_adam_v` [T] and its step count
    `famo_adam_step`.

    Args:
      w_lr: the logits' Adam learning rate (LibMTL `FAMO_w_lr`, 0.025).
      gamma: the logits' weight decay (LibMTL `FAMO_w_gamma`, 1e-3; the official
        class's default is 1e-5, its experiments tune it).
      min_losses: the tasks' lower bounds on the loss (0: a number for all tasks or one
        per task; the reference's `set_min_losses`).

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method
      >>> get_method("famo", w_lr=0.025, gamma=1e-3)
      FAMO(w_lr=0.025, gamma=0.001, min_losses=0.0)
    """

    name = "famo"
    uses_gradients = False
    kind = "loss"
    reference = "Cranial-XIX/FAMO and LibMTL FAMO (NumPy re-derivation, full batch)"

    def __init__(self, w_lr: float = 0.025, gamma: float = 1e-3, min_losses=0.0):
        self.w_lr = check_number("w_lr", w_lr, 0.0)
        self.gamma = check_number("gamma", gamma, 0.0)
        if isinstance(min_losses, (list, tuple)):
            if not min_losses:
                raise ValueError(
                    "`min_losses` must be a number or a non-empty sequence of "
                    "numbers (one per task); got []."
                )
            self.min_losses = tuple(
                check_number(f"min_losses[{i}]", v) for i, v in enumerate(min_losses)
            )
        else:
            self.min_losses = check_number("min_losses", min_losses)

    def _min_losses(self, num_tasks, dtype):
        if isinstance(self.min_losses, tuple):
            if len(self.min_losses) != num_tasks:
                raise ValueError(
                    f"FAMO `min_losses` has {len(self.min_losses)} entries; expected one per "
                    f"task ({num_tasks})."
                )
            return ops.convert_to_tensor(np.asarray(self.min_losses, dtype=dtype))
        return ops.full((num_tasks,), scalar(self.min_losses, dtype), dtype=dtype)

    def state_spec(self, num_tasks):
        self._min_losses(num_tasks, "float32")  # a wrong length fails when built
        vector = (num_tasks,)
        return {
            "logits": StateSpec(vector),
            "prev_losses": StateSpec(vector),
            "prev_present": StateSpec(vector),
            "adam_m": StateSpec(vector),
            "adam_v": StateSpec(vector),
            "adam_step": StateSpec(()),
        }

    def _d(self, losses, min_losses):
        gap = ops.maximum(losses - min_losses, ops.zeros_like(losses))
        return gap + scalar(_LOSS_EPSILON, gap.dtype)

    def combine(self, inputs, state):
        acc = inputs.dtype
        present, losses = inputs.present, inputs.losses
        get = {k: ops.cast(v, acc) for k, v in state.items()}
        min_losses = self._min_losses(inputs.num_tasks, acc)
        one = scalar(1.0, acc)

        # The logits' update from the previous step's losses to this step's.
        both = present * get["prev_present"]
        delta = both * (
            ops.log(self._d(get["prev_losses"], min_losses)) - ops.log(self._d(losses, min_losses))
        )
        logits = get["logits"]
        z_both = masked_softmax(logits, both)
        d = z_both * (delta - ops.sum(z_both * delta))  # J_softmax^T delta
        grad = d + scalar(self.gamma, acc) * logits
        update = ops.any(ops.greater(both, 0))
        beta1, beta2 = scalar(_BETA1, acc), scalar(_BETA2, acc)
        step = get["adam_step"] + one
        m = beta1 * get["adam_m"] + (one - beta1) * grad
        v = beta2 * get["adam_v"] + (one - beta2) * grad * grad
        bias1 = one - ops.power(beta1, step)
        bias2 = one - ops.power(beta2, step)
        moved = logits - (scalar(self.w_lr, acc) / bias1) * m / (
            ops.sqrt(v) / ops.sqrt(bias2) + scalar(_ADAM_EPSILON, acc)
        )
        logits = ops.where(update, moved, logits)
        new_state = {
            "logits": logits,
            "adam_m": ops.where(update, m, get["adam_m"]),
            "adam_v": ops.where(update, v, get["adam_v"]),
            "adam_step": ops.where(update, step, get["adam_step"]),
            "prev_losses": losses,
            "prev_present": present,
        }

        # This step's weights from the updated logits.
        z = masked_softmax(logits, present)
        d_now = self._d(losses, min_losses)
        ratio = present * z / d_now
        weights = ops.divide_no_nan(ratio, ops.sum(ratio))
        return Combination(shared=weights, specific=weights, loss_weights=present, state=new_state)

    def get_config(self):
        return {"w_lr": self.w_lr, "gamma": self.gamma, "min_losses": self.min_losses}
