"""CAGrad (Liu et al., NeurIPS 2021): conflict-averse gradient descent on the Gram matrix."""

from __future__ import annotations

from keras import ops

from tf_metaalign.algorithms.gradient_surgery import matvec
from tf_metaalign.algorithms.multitask import solvers
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    check_number,
    register,
    scalar,
)

SOLVERS = ("auto", "exact", "pgd")


@register
class CAGrad(MultiTaskMethod):
    """CAGrad: d = (g0 + lambda g_w) / r, with g0 = (1/T) sum_t g_t the average gradient,

        w = argmin_{w >= 0, sum w = 1}  g_w . g0 + c ||g_w||,   g_w = sum_t w_t g_t,
        c = calpha sqrt(||g0||^2 + 1e-8) + 1e-8,   lambda = c / (||g_w|| + 1e-8),

    and r = 1 (`rescale=0`), 1 + calpha^2 (`rescale=1`, the default) or 1 + calpha
    (`rescale=2`): LibMTL `CAGrad.backward` and the official Cranial-XIX/CAGrad
    `cagrad()`, the same formula with their 1e-8 terms. As coefficients on the task
    gradients: shared[t] = (1/T + lambda w_t) / r. Task-specific variables keep their raw
    task gradients (specific = 1). Absent tasks are left out (T = the number of present
    tasks, their w_t = 0); with calpha = 0 this is the average gradient.

    Solver: the references run scipy's SLSQP from the uniform weights (tolerance ~1e-6 on
    the objective). Here, in the graph, `solver="exact"` enumerates the 2^T - 1 faces of
    the simplex with the minimiser of each face in closed form
    (`solvers.cagrad_weights`: exact to rounding, checked against a NumPy enumeration and
    a dense grid), and `solver="pgd"` runs `iterations` majorise-minimise projected
    gradient steps with restarted momentum (`solvers.cagrad_weights_pgd`: for many
    tasks). "auto" (default): exact for T <= 8, pgd above (XLA on CPU, float32: exact
    1.7 / 2.6 / 47 ms at T = 5 / 8 / 10, pgd 500 steps 1.9 / 1.9 / 3.3 ms; pgd reaches
    1e-7 relative on the dual objective on random gradients, fewer digits when the
    optimum's g_w is near 0, i.e. strongly conflicting tasks). The exact solver minimises
    ||g_w|| without LibMTL's 1e-8 under the square root (it picks among its candidates
    with LibMTL's objective), a difference of order 1e-8 / ||g_w||^2 in w.

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      calpha: c in the paper, >= 0 (LibMTL's default 0.5).
      rescale: 0, 1 (default) or 2, as above.
      solver: "auto", "exact" or "pgd".
      iterations: the pgd solver's number of steps.

    Example:
      >>> CAGrad(calpha=0.4)
      CAGrad(calpha=0.4, rescale=1, solver='auto', iterations=500)
    """

    name = "cagrad"
    kind = "gradient"
    uses_gradients = True
    reference = "LibMTL CAGrad; Cranial-XIX/CAGrad (SLSQP replaced by an exact in-graph solver)"
    compiles_well = False  # its face enumeration is slower under XLA on CPU

    def __init__(
        self, calpha: float = 0.5, rescale: int = 1, solver: str = "auto", iterations: int = 500
    ):
        self.calpha = check_number("calpha", calpha, 0.0)
        if isinstance(rescale, bool) or rescale not in (0, 1, 2):
            raise ValueError(f"`rescale` (CAGrad's rescaling) must be 0, 1 or 2; got {rescale!r}.")
        self.rescale = int(rescale)
        if solver not in SOLVERS:
            raise ValueError(
                f"`solver` (CAGrad's dual solver) must be one of {SOLVERS}; got {solver!r}."
            )
        self.solver = solver
        self.iterations = check_number("iterations", iterations, 1, integer=True)

    def dual_weights(self, gram, present) -> tuple:
        """(w, c): the dual's solution on the simplex of the present tasks, and c."""
        gram = ops.convert_to_tensor(gram)
        dtype = gram.dtype
        T = int(gram.shape[0])
        mask = ops.cast(ops.greater(ops.cast(present, dtype), 0), dtype)
        num = ops.maximum(ops.sum(mask), scalar(1.0, dtype))
        b = mask / num
        g0_norm = ops.sqrt(
            ops.sum(gram * mask[:, None] * mask[None, :]) / (num * num) + scalar(1e-8, dtype)
        )
        c = scalar(self.calpha, dtype) * g0_norm + scalar(1e-8, dtype)
        gb = matvec(gram, b)
        exact = self.solver == "exact" or (self.solver == "auto" and T <= 8)
        if exact:
            w = solvers.cagrad_weights(gram, gb, c, mask)
        else:
            w = solvers.cagrad_weights_pgd(gram, gb, c, mask, self.iterations)
        return w, c

    def coefficients(self, gram, present):
        """shared[t] = (b_t + lambda w_t) / r, on any Gram matrix."""
        gram = ops.convert_to_tensor(gram)
        dtype = gram.dtype
        mask = ops.cast(ops.greater(ops.cast(present, dtype), 0), dtype)
        num = ops.maximum(ops.sum(mask), scalar(1.0, dtype))
        w, c = self.dual_weights(gram, mask)
        gw_norm = ops.sqrt(ops.maximum(ops.sum(w * matvec(gram, w)), scalar(0.0, dtype)))
        lmbda = c / (gw_norm + scalar(1e-8, dtype))
        r = {0: 1.0, 1: 1.0 + self.calpha**2, 2: 1.0 + self.calpha}[self.rescale]
        return (mask / num + lmbda * w) / scalar(r, dtype)

    def combine(self, inputs, state):
        gram = ops.cast(inputs.gram, inputs.dtype)
        return Combination(
            shared=self.coefficients(gram, inputs.present), specific=ops.ones_like(inputs.losses)
        )

    def get_config(self):
        return {
            "calpha": self.calpha,
            "rescale": self.rescale,
            "solver": self.solver,
            "iterations": self.iterations,
        }
