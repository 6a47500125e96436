"""Equal weighting ("sum", LibMTL's `EW`): G = sum_t g_t."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms.multitask.base import Combination, MultiTaskMethod, register


@register
class EqualWeighting(MultiTaskMethod):
    """G = sum_t grad L_t (LibMTL `EW`: `losses.sum().backward()`; its weights are 1, not
    1/T, whatever its docstring says). The plain multi-task baseline: one backward pass
    of the summed loss, the cost of plain `fit`.

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method
      >>> get_method("sum")
      EqualWeighting()
    """

    name = "sum"
    aliases = ("ew",)
    uses_gradients = False
    kind = "loss"
    reference = "LibMTL EW"

    def combine(self, inputs, state):
        return Combination(shared=ops.ones_like(inputs.losses))
