"""MGDA (Sener & Koltun, NeurIPS 2018): the min-norm element of the convex hull of the
task gradients, on the Gram matrix."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms.multitask import solvers
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    check_number,
    register,
)

NORMALIZATIONS = ("none", "l2", "loss", "loss+")


@register
class MGDA(MultiTaskMethod):
    """MGDA: G = sum_t (w_t / n_t) g_t, with w the min-norm point of the simplex for the
    normalised gradients g_t / n_t:

        w = argmin_{w >= 0, sum w = 1} || sum_t w_t g_t / n_t ||^2

    n_t by `normalization` (LibMTL's `mgda_gn`): "none" 1, "l2" ||g_t||, "loss" L_t,
    "loss+" L_t ||g_t||. As LibMTL `MGDA.backward` (with `rep_grad=False`), the
    weights multiply the NORMALISED gradients, so the shared coefficients are w_t / n_t;
    task-specific variables keep their raw task gradients (specific = 1), and the
    reported loss is the plain sum, as for the other gradient methods.

    Solver (`solvers.min_norm_weights`): LibMTL's / the official `MinNormSolver`, in the
    graph: the best pair in closed form (exact for T = 2), then up to `max_iter`
    projected-gradient steps with an exact line search, stopping when the L1 change of w
    is < `stop_crit` (LibMTL: 250 and 1e-5). One difference: LibMTL's segment solver
    returns 0.999 / 0.001 instead of 1 / 0 when the minimum is at an end point; this
    uses the exact end point (so T = 2 gives the exact min-norm point of the segment).
    With the defaults the weights are within ~1e-5 of the exact min-norm point; more
    iterations and `stop_crit=0` converge to it.

    Absent tasks are left out of the simplex (LibMTL on the present tasks only; a zero
    gradient would otherwise be the min-norm point). A normaliser that is 0 (a present
    task with zero gradient under "l2", zero loss under "loss") is replaced by 1 (LibMTL
    would divide by zero).

    MGDA-UB (the paper's upper bound, LibMTL `rep_grad=True`): call
    `min_norm_weights(gram, losses, present)` with the Gram matrix of the gradients of the
    shared REPRESENTATION and apply the returned weights w unscaled (LibMTL applies `sol`,
    not sol / n, to the representation gradients).

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      normalization: "none" (LibMTL's default), "l2", "loss" or "loss+".
      max_iter: the solver's maximum number of iterations (T >= 3).
      stop_crit: the solver stops when the L1 change of the weights is below this.

    Example:
      >>> MGDA(normalization="l2")
      MGDA(normalization='l2', max_iter=250, stop_crit=1e-05)
    """

    name = "mgda"
    kind = "gradient"
    uses_gradients = True
    reference = "LibMTL MGDA (MinNormSolver, mgda_gn); isl-org/MultiObjectiveOptimization"

    def __init__(self, normalization: str = "none", max_iter: int = 250, stop_crit: float = 1e-5):
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"`normalization` (MGDA's gradient normalisation, LibMTL's "
                f"mgda_gn) must be one of {NORMALIZATIONS}; got "
                f"{normalization!r}."
            )
        self.normalization = normalization
        self.max_iter = check_number("max_iter", max_iter, 0, integer=True)
        self.stop_crit = check_number("stop_crit", stop_crit, 0.0)

    def normalizers(self, gram, losses, present):
        """n_t (1 for absent tasks and where it would be 0)."""
        gram = ops.convert_to_tensor(gram)
        dtype = gram.dtype
        losses = ops.cast(losses, dtype)
        norms = ops.sqrt(ops.maximum(ops.diagonal(gram), ops.zeros_like(losses)))
        if self.normalization == "none":
            n = ops.ones_like(losses)
        elif self.normalization == "l2":
            n = norms
        elif self.normalization == "loss":
            n = losses
        else:
            n = losses * norms
        ok = ops.logical_and(ops.greater(ops.cast(present, dtype), 0), ops.not_equal(n, 0.0))
        return ops.where(ok, n, ops.ones_like(n))

    def min_norm_weights(self, gram, losses, present):
        """w: the min-norm weights of the normalised gradients (sum 1 over the present
        tasks). Works on any Gram matrix (e.g. the representation's, for MGDA-UB)."""
        gram = ops.convert_to_tensor(gram)
        n = self.normalizers(gram, losses, present)
        normed = gram / (n[:, None] * n[None, :])
        return solvers.min_norm_weights(normed, present, self.max_iter, self.stop_crit)

    def combine(self, inputs, state):
        gram = ops.cast(inputs.gram, inputs.dtype)
        n = self.normalizers(gram, inputs.losses, inputs.present)
        w = solvers.min_norm_weights(
            gram / (n[:, None] * n[None, :]), inputs.present, self.max_iter, self.stop_crit
        )
        return Combination(shared=w / n, specific=ops.ones_like(inputs.losses))

    def get_config(self):
        return {
            "normalization": self.normalization,
            "max_iter": self.max_iter,
            "stop_crit": self.stop_crit,
        }
