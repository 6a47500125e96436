"""GradNorm (Chen et al., ICML 2018): task weights learned from gradient norms."""

from __future__ import annotations

from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    check_number,
    register,
)


@register
class GradNorm(MultiTaskMethod):
    """G = sum_t w_t g_t with weights w (initially 1) that take one step of their own per
    training step (`gradient_surgery.gradnorm_update`: learning rate `learning_rate`,
    asymmetry `alpha`, renormalised to sum to T), measured at ONE shared weight W.

    W: `variable`, a path of a shared variable or an index into the shared variables;
    default the LAST shared variable of rank >= 2 (the paper's "last shared layer"; a
    per-task head is task-specific and never picked), else the last shared one (with
    `rep_grad`, the shared representation). Task-specific variables receive
    w_t times their task's gradient (the task's loss weight, as LibMTL's GradNorm
    back-propagates the weighted loss sum). L_t(0) is the loss of task t at the first step
    it appears in. State: `gradnorm_weights`, `gradnorm_initial_losses`, `gradnorm_seen`.

    LibMTL's GradNorm differs: its weights are T softmax(p) with p trained by the model's
    optimizer, its norms are over ALL shared parameters, and it starts after epoch 0; this
    follows the paper's Algorithm 1 (one layer, renormalised weights).

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Example:
      >>> GradNorm(alpha=1.5, learning_rate=0.025)
      GradNorm(alpha=1.5, learning_rate=0.025, variable=None)
    """

    name = "gradnorm"
    kind = "loss"
    reference = "Chen et al. 2018, Algorithm 1 (NumPy re-derivation)"
    compiles_well = False  # reads the task gradients: keep them out of an XLA call

    def __init__(self, alpha: float = 1.5, learning_rate: float = 0.025, variable=None):
        self.alpha = check_number("alpha", alpha, 0.0)
        self.learning_rate = check_number("learning_rate", learning_rate, 0.0)
        if variable is not None and (
            isinstance(variable, bool) or not isinstance(variable, (int, str))
        ):
            raise ValueError(
                "`variable` (GradNorm's shared weight W) must be None, an index into the "
                f"shared variables or a variable path; got {variable!r}."
            )
        self.variable = variable

    def state_spec(self, num_tasks):
        return {
            "weights": StateSpec((num_tasks,), initializer="ones"),
            "initial_losses": StateSpec((num_tasks,)),
            "seen": StateSpec((num_tasks,)),
        }

    def variable_index(self, shared_variables) -> int:
        """The position of W among the shared variables (errors name `variable`)."""
        choice = self.variable
        if choice is None:
            ranked = [i for i, v in enumerate(shared_variables) if len(v.shape) >= 2]
            if ranked:
                return ranked[-1]
            if not shared_variables:
                raise ValueError(
                    "GradNorm: there is no shared variable to measure; pass "
                    "`variable` (a shared variable's index or path)."
                )
            # No kernel (rep_grad: the shared representation is the one "variable"): the
            # last shared one.
            return len(shared_variables) - 1
        if isinstance(choice, int):
            if not -len(shared_variables) <= choice < len(shared_variables):
                raise ValueError(
                    f"GradNorm `variable` (gradnorm_variable)={choice} is out of range: there are "
                    f"{len(shared_variables)} shared variables."
                )
            return choice % len(shared_variables)
        paths = [v.path for v in shared_variables]
        if choice not in paths:
            raise ValueError(
                f"GradNorm `variable` (gradnorm_variable)={choice!r} is not the path of a shared "
                f"variable; shared paths: {paths}."
            )
        return paths.index(choice)

    def combine(self, inputs, state):
        acc = inputs.dtype
        present, losses = inputs.present, inputs.losses
        weights = ops.cast(state["weights"], acc)
        seen = ops.cast(state["seen"], acc)
        first = present * (1.0 - seen)
        initial = ops.cast(state["initial_losses"], acc)
        initial = initial + first * (losses - initial)
        index = self.variable_index(inputs.shared_variables)
        if inputs.task_grads is not None:
            layer_norms = ops.stack([F.global_norm([g[index]]) for g in inputs.task_grads])
        else:  # no per-task gradient formed (task_passes="factored"): ||g_t||^2 = G_tt
            diagonal = ops.diagonal(inputs.variable_gram(index))
            layer_norms = ops.sqrt(ops.maximum(diagonal, 0.0))
        new_weights = GS.gradnorm_update(
            weights,
            ops.cast(layer_norms, acc),
            losses,
            initial,
            present,
            alpha=self.alpha,
            learning_rate=self.learning_rate,
        )
        return Combination(
            shared=weights,
            specific=weights,
            state={
                "weights": new_weights,
                "initial_losses": initial,
                "seen": ops.maximum(seen, present),
            },
        )

    def get_config(self):
        return {"alpha": self.alpha, "learning_rate": self.learning_rate, "variable": self.variable}
