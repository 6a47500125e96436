"""PCGrad (Yu et al., NeurIPS 2020) on the Gram matrix of the shared gradients."""
from __future__ import annotations

import tensorflow as tf

from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms.multitask.base import Combination, MultiTaskMethod, register


@register
class PCGrad(MultiTaskMethod):
    """PCGrad: each task gradient is projected off the others' it conflicts with, then
    summed (`gradient_surgery.pcgrad_coefficients`; the task order of every step is
    `gradient_surgery.random_order(seed, step)`, one permutation for all tasks i).

    On the SHARED variables only; task-specific variables keep their task's raw
    gradient (LibMTL `PCGrad` with `rep_grad=False`; the official code projects the
    shared gradient too).

    Example:
      >>> PCGrad()
      PCGrad()
    """

    name = "pcgrad"
    reference = "LibMTL PCGrad (one order per step); tianheyu927/PCGrad"

    def combine(self, inputs, state):
        order = GS.random_order(inputs.num_tasks, inputs.seed, inputs.step)
        return Combination(shared=GS.pcgrad_coefficients(inputs.gram, order),
                           specific=tf.ones_like(inputs.losses))
