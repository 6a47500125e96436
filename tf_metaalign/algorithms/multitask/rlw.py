"""Random Loss Weighting (Lin et al., TMLR 2022; LibMTL `RLW`)."""

from __future__ import annotations

from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    masked_softmax,
    random_normal,
    register,
)


@register
class RandomLossWeighting(MultiTaskMethod):
    """Fresh random loss weights at every step:

        w = softmax(n),   n ~ N(0, I_T)

    (LibMTL `RLW`: `F.softmax(torch.randn(self.task_num))`, weights summing to 1). The
    draw is `base.random_normal(seed, step, T)`, a pure function of the trainer's seed and
    step counter: eager, graph, XLA, every replica and a resumed run draw the same
    weights at the same step, and no RNG state needs checkpointing.

    Absent tasks (`present[t] == 0`) get 0 and the softmax is renormalised over the
    present ones (their weights sum to 1; each present task keeps its own draw n_t, so
    the relative weights of the present tasks are those of the full draw).

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method
      >>> get_method("rlw")
      RandomLossWeighting()
    """

    name = "rlw"
    aliases = ("random",)
    uses_gradients = False
    kind = "loss"
    reference = "LibMTL RLW (softmax of a standard normal draw)"

    def combine(self, inputs, state):
        draw = random_normal(inputs.seed, inputs.step, inputs.num_tasks, dtype=inputs.dtype)
        weights = masked_softmax(draw, inputs.present)
        return Combination(shared=weights, specific=weights)
