"""Gradient sharing (Chang & Lipson, "Accelerating Meta-Learning by Sharing Gradients",
Algorithms 1 and 2) as pure pieces on tensors.

The regulariser mixes each task's inner gradient with a running, normalised gradient
shared by all tasks of the meta-batch. With K inner steps it has trainable
`m, lambda in R^K` (initialised at 0) and one running direction `g_hat_k` per inner step
(non-trainable state). At inner step k of meta-iteration i, with T tasks in the batch:

    g_k       = S_k / ||S_k||,   S_k = sum_t grad L_t(theta_{t,k-1})   (global norm over all
                                                                          weights; 0 if S_k = 0)
    g_hat_k   = g_k                                           at i = 1 (not initialised)
              = sigmoid(m_k) g_k + (1 - sigmoid(m_k)) g_hat_k  otherwise
    Delta_t,k = sigmoid(lambda_k) g_hat_k + (1 - sigmoid(lambda_k)) grad L_t(theta_{t,k-1})
    theta_t,k = theta_t,k-1 - alpha Delta_t,k

All tasks take step k before any takes step k + 1; under a distribution strategy the sum
over tasks S_k is over every replica's tasks (`reduce`, default
`functional.all_reduce_sum`, one all-reduce per inner step). Everything here is
differentiable: a second-order outer step differentiates theta, m and lambda through g_k
(the gradient of an all-reduce SUM is an all-reduce SUM, so the per-replica outer
gradients still sum to the global one). At meta-test time (Algorithm 2) the inner loop
uses the stored g_hat_k and does not update it (`test_deltas`).

A gate exactly at 0: `sigmoid(-inf) == 0` exactly in floating point, so
`GradientSharing(initial_lambda=float("-inf"))` gives Delta = grad L_t exactly (plain
MAML, the outer gradient of lambda is exactly 0 and Adam/SGD keep lambda at -inf);
`initial_m=float("-inf")` freezes g_hat at its first value, `+inf` makes g_hat = g_k.

The variables (m, lambda, g_hat, the "initialised" flag) are owned by whoever uses this
(e.g. `tf_metaalign.trainers.MAMLTrainer`, which checkpoints and logs them); this module
only computes with their values.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F


class SharingStep(NamedTuple):
    """One inner step of gradient sharing.

    deltas: per task, the list of update directions Delta_{t,k} (one tensor per weight).
    g_hat: the new g_hat_k (list of tensors). g: the normalised shared direction g_k.
    """

    deltas: list
    g_hat: list
    g: list


def _check_gate(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"`{name}` must be a number (+-inf allowed); got {value!r}.")
    return float(value)


class GradientSharing:
    """The gradient-sharing rule (see the module doc); a configuration, no variables.

    Args:
      initial_m: initial value of every m_k (the paper: 0, i.e. sigmoid = 0.5).
      initial_lambda: initial value of every lambda_k (the paper: 0). `float("-inf")`
        gives a gate exactly 0: plain MAML.

    Example:
      >>> from tf_metaalign.algorithms import GradientSharing
      >>> task_grads = [[tf.constant([3.0, 4.0])], [tf.constant([3.0, -4.0])]]
      >>> g = GradientSharing.shared_direction(task_grads, reduce=lambda grads: grads)
      >>> g[0].numpy()  # the normalised sum of the tasks' gradients
      array([1., 0.], dtype=float32)
      >>> GradientSharing.combine(g, task_grads[1], lambda_k=0.0)[0].numpy()  # gate 1/2
      array([ 2., -2.], dtype=float32)

    References:
      Chang & Lipson, "Accelerating Meta-Learning by Sharing Gradients", 2020
      (Algorithms 1 and 2).
    """

    def __init__(self, initial_m=0.0, initial_lambda=0.0):
        self.initial_m = _check_gate("initial_m", initial_m)
        self.initial_lambda = _check_gate("initial_lambda", initial_lambda)

    def get_config(self):
        return {"initial_m": self.initial_m, "initial_lambda": self.initial_lambda}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return (
            f"GradientSharing(initial_m={self.initial_m!r}, initial_lambda={self.initial_lambda!r})"
        )

    # ------------------------------------------------------------------ the maths

    @staticmethod
    def shared_direction(task_grads, reduce: Callable = F.all_reduce_sum, stacked=False) -> list:
        """g_k = S / ||S||, S = the sum of the tasks' gradients over every replica.

        `task_grads`: per task a list of tensors, or with `stacked=True` one list of
        tensors with a leading task axis (the vectorised inner loop on JAX)."""
        if not task_grads:
            raise ValueError("GradientSharing: no task gradients given.")
        if stacked:
            total = [ops.sum(g, axis=0) for g in task_grads]
        else:
            total = [backend.add_n(list(gs)) for gs in zip(*task_grads)]
        total = list(reduce(total))
        norm = F.global_norm(total)
        return [ops.divide_no_nan(s, ops.cast(norm, s.dtype)) for s in total]

    @staticmethod
    def update_g_hat(g: Sequence, g_hat: Sequence, m_k, initialized):
        """g_hat_k = g_k if not `initialized`, else s g_k + (1 - s) g_hat_k, s = sigmoid(m_k)."""
        out = []
        for gi, hi in zip(g, g_hat):
            s = ops.sigmoid(F.scalar(m_k, gi.dtype))  # a python m_k exact in gi's dtype
            mixed = s * gi + (1 - s) * ops.cast(hi, gi.dtype)
            if isinstance(initialized, bool):
                out.append(mixed if initialized else gi)
            else:
                out.append(ops.where(ops.cast(initialized, "bool"), mixed, gi))
        return out

    @staticmethod
    def combine(g_hat: Sequence, task_grad: Sequence, lambda_k) -> list:
        """Delta = sigmoid(lambda_k) g_hat_k + (1 - sigmoid(lambda_k)) grad L_t (`task_grad`
        may carry a leading task axis: g_hat broadcasts over it)."""
        out = []
        for h, g in zip(g_hat, task_grad):
            s = ops.sigmoid(F.scalar(lambda_k, g.dtype))
            out.append(s * ops.cast(h, g.dtype) + (1 - s) * g)
        return out

    def step(
        self,
        task_grads,
        m_k,
        lambda_k,
        g_hat,
        initialized,
        g=None,
        reduce: Callable = F.all_reduce_sum,
        stacked=False,
    ) -> SharingStep:
        """One training inner step (Algorithm 1) for all tasks of the batch.

        Args:
          task_grads: per task, grad L_t(theta_{t,k-1}) (a list per task).
          m_k: the g_hat gate's logit, a scalar (a tensor: differentiated by an outer
            tape).
          lambda_k: the combination gate's logit, a scalar (likewise).
          g_hat: the stored g_hat_k (from the previous meta-iteration).
          initialized: whether `g_hat` holds a value (False at i = 1); bool or tensor.
          g: g_k if already computed (a first-order replay), else computed with `reduce`.
          reduce: the cross-replica sum of S_k.
          stacked: `task_grads` is one list of tensors with a leading task axis (the
            vectorised inner loop on JAX); `deltas` is then stacked likewise.
        """
        if g is None:
            g = self.shared_direction(task_grads, reduce, stacked=stacked)
        new_g_hat = self.update_g_hat(g, g_hat, m_k, initialized)
        if stacked:
            deltas = self.combine(new_g_hat, task_grads, lambda_k)
        else:
            deltas = [self.combine(new_g_hat, tg, lambda_k) for tg in task_grads]
        return SharingStep(deltas, new_g_hat, list(g))

    def test_deltas(self, task_grads, lambda_k, g_hat, initialized=True, stacked=False) -> list:
        """Meta-test inner step (Algorithm 2): the stored g_hat_k, not updated. Before
        any training step (`initialized` false) g_hat_k is taken as 0. `stacked`: as in
        `step`."""
        if not isinstance(initialized, bool):
            g_hat = [ops.where(ops.cast(initialized, "bool"), h, ops.zeros_like(h)) for h in g_hat]
        elif not initialized:
            g_hat = [ops.zeros_like(h) for h in g_hat]
        if stacked:
            return self.combine(g_hat, task_grads, lambda_k)
        return [self.combine(g_hat, tg, lambda_k) for tg in task_grads]


def as_gradient_sharing(value):
    """None, True, a dict (its config) or a `GradientSharing` -> GradientSharing or None."""
    if value is None or value is False:
        return None
    if value is True:
        return GradientSharing()
    if isinstance(value, dict):
        return GradientSharing.from_config(value)
    if isinstance(value, GradientSharing):
        return value
    raise ValueError(
        "`gradient_sharing` must be None, True, a GradientSharing or its config dict; "
        f"got {value!r}."
    )
