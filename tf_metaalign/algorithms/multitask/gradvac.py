"""Gradient Vaccine (Wang et al., ICLR 2021), global variant, on the Gram matrix."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    check_number,
    register,
)


@register
class GradVac(MultiTaskMethod):
    """GradVac (`gradient_surgery.gradvac_coefficients`): EMA targets phi_hat per ordered
    task pair (state `gradvac_targets` [T, T], checkpointed), `beta` their EMA rate.

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      beta: the targets' EMA rate, in [0, 1] (LibMTL's default 0.5; the paper's 1e-2).

    Example:
      >>> GradVac(beta=0.2)
      GradVac(beta=0.2)
    """

    name = "gradvac"
    reference = "LibMTL GradVac (global cosine)"

    def __init__(self, beta: float = 1e-2):
        self.beta = check_number("beta", beta, 0.0, 1.0)

    def state_spec(self, num_tasks):
        return {"targets": StateSpec((num_tasks, num_tasks))}

    def combine(self, inputs, state):
        order = GS.random_order(inputs.num_tasks, inputs.seed, inputs.step)
        result = GS.gradvac_coefficients(inputs.gram, state["targets"], order, beta=self.beta)
        return Combination(
            shared=result.coefficients,
            specific=ops.ones_like(inputs.losses),
            state={"targets": result.targets},
        )

    def get_config(self):
        return {"beta": self.beta}
