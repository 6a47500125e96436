"""Dynamic Weight Average (Liu et al., CVPR 2019, MTAN; LibMTL `DWA`)."""

from __future__ import annotations

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


@register
class DynamicWeightAverage(MultiTaskMethod):
    """Loss weights from the rate at which each task's EPOCH-AVERAGE loss falls:

        w = K softmax(r / T),   r_k = Lbar_k(e-1) / Lbar_k(e-2)

    in epoch e, where Lbar_k(e) is task k's training loss averaged over epoch e and K
    the number of tasks; w = 1 in the first two epochs (e = 0, 1). LibMTL `DWA`
    (`self.epoch > 1`: `train_loss_buffer[:, e-1] / train_loss_buffer[:, e-2]`, the
    buffer column written at the end of each epoch) with its default T = 2.0.

    State (checkpointed): `dwa_epoch` (the epoch being accumulated), `dwa_sums` /
    `dwa_counts` [T] (this epoch's per-step task losses and the number of steps each
    task was present in), `dwa_last` / `dwa_last_valid` and `dwa_before` /
    `dwa_before_valid` [T] (the averages of the last two epochs trained, and whether the
    task had any step in them). When `inputs.epoch` (epochs completed, kept by the
    trainer: `uses_epoch = True`) differs from `dwa_epoch`, the accumulated epoch's
    averages are pushed into the history (`before <- last <- sums / counts`) and the
    sums restart, BEFORE this step's weights are computed and its losses accumulated:
    the first step of epoch e sees Lbar(e-1), as in LibMTL.

    Differences from LibMTL, all invisible in a plain `fit` where every task is in every
    batch:
      * Lbar_k is the plain mean of the per-step losses over the steps of the epoch
        where task k is present (LibMTL's meter weights each batch's loss by its batch
        size: the same for equal batches; a ragged last batch counts as a full one here).
      * r_k = 1 where task k has no average in one of the two epochs (absent for a whole
        epoch) or Lbar_k(e-2) = 0 (LibMTL would divide by zero).
      * Absent tasks at a step get 0 and the softmax is over the present tasks, scaled by
        their number: the present tasks' weights sum to their count, as the weights 1 of
        the first two epochs do.
      * The history holds the last two epochs TRAINED: a run resumed at a later
        `initial_epoch`, or epochs without steps, do not leave gaps in it.

    Args:
      temperature: T, the softmax temperature (LibMTL `--T`, default 2.0).

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method
      >>> get_method("dwa", temperature=2.0)
      DynamicWeightAverage(temperature=2.0)
    """

    name = "dwa"
    uses_gradients = False
    uses_epoch = True
    kind = "loss"
    reference = "LibMTL DWA (NumPy re-derivation of train_loss_buffer)"

    def __init__(self, temperature: float = 2.0):
        self.temperature = check_number("temperature", temperature, 0.0, low_open=True)

    def state_spec(self, num_tasks):
        vector = (num_tasks,)
        return {
            "epoch": StateSpec(()),
            "sums": StateSpec(vector),
            "counts": StateSpec(vector),
            "last": StateSpec(vector),
            "last_valid": StateSpec(vector),
            "before": StateSpec(vector),
            "before_valid": StateSpec(vector),
        }

    def combine(self, inputs, state):
        acc = inputs.dtype
        present, losses = inputs.present, inputs.losses
        get = {k: ops.cast(v, acc) for k, v in state.items()}
        epoch = ops.cast(inputs.epoch, acc)
        # Roll over when the epoch changed and the accumulated epoch had any step.
        counts = get["counts"]
        changed = ops.cast(ops.not_equal(epoch, get["epoch"]), acc)
        roll = changed * ops.cast(ops.any(ops.greater(counts, 0)), acc)
        had = ops.cast(ops.greater(counts, 0), acc)
        average = ops.divide_no_nan(get["sums"], counts)
        last = get["last"] + roll * (average - get["last"])
        last_valid = get["last_valid"] + roll * (had - get["last_valid"])
        before = get["before"] + roll * (get["last"] - get["before"])
        before_valid = get["before_valid"] + roll * (get["last_valid"] - get["before_valid"])
        sums = (1.0 - changed) * get["sums"]
        counts = (1.0 - changed) * counts
        # Weights from the history.
        valid = ops.logical_and(
            ops.logical_and(ops.greater(last_valid, 0), ops.greater(before_valid, 0)),
            ops.greater(before, 0),
        )
        ratio = ops.where(valid, ops.divide_no_nan(last, before), ops.ones_like(losses))
        present_count = ops.sum(present)
        weights = present_count * masked_softmax(ratio / scalar(self.temperature, acc), present)
        new_state = {
            "epoch": epoch,
            "sums": sums + present * losses,
            "counts": counts + present,
            "last": last,
            "last_valid": last_valid,
            "before": before,
            "before_valid": before_valid,
        }
        return Combination(shared=weights, specific=weights, state=new_state)

    def get_config(self):
        return {"temperature": self.temperature}
