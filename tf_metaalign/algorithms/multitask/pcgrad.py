"""PCGrad (Yu et al., NeurIPS 2020) on the Gram matrix of the shared gradients."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms.multitask.base import Combination, MultiTaskMethod, register


@register
class PCGrad(MultiTaskMethod):
    """PCGrad: each task gradient is projected off the others' it conflicts with, then
    summed (`gradient_surgery.pcgrad_coefficients`; the task order of every step is
    `gradient_surgery.random_order(seed, step)`, one permutation for all tasks i).

    On the SHARED variables only; task-specific variables keep their task's raw
    gradient (LibMTL `PCGrad` with `rep_grad=False`; the official code projects the
    gradient of every variable it is given).

    The task order, where the references differ (it matters from T = 3 on; for T = 2
    every order gives the same result): LibMTL draws a NEW random order for every task i
    (`random.shuffle(task_index)` inside the loop over i); the official `PCGrad_tf.py`
    calls `tf.random.shuffle(loss)` and discards the result, so it projects in index
    order; this draws ONE permutation per step, shared by every i, from (seed, step), so
    that runs are reproducible and resumable. LibMTL divides by ||g_j||^2 + 1e-8; a zero
    g_j (an absent task) projects nothing here.

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Example:
      >>> PCGrad()
      PCGrad()
    """

    name = "pcgrad"
    reference = "LibMTL PCGrad (one order per step); tianheyu927/PCGrad"

    def combine(self, inputs, state):
        order = GS.random_order(inputs.num_tasks, inputs.seed, inputs.step)
        return Combination(
            shared=GS.pcgrad_coefficients(inputs.gram, order), specific=ops.ones_like(inputs.losses)
        )
