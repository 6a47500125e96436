"""Nash-MTL (Navon et al., ICML 2022): the Nash bargaining solution of the tasks, solved
in-graph with damped Newton steps on the T x T Gram matrix."""

from __future__ import annotations

import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from tf_metaalign.algorithms.gradient_surgery import matvec
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    check_number,
    register,
    scalar,
)


def nash_bargaining_weights(gram, present, iterations: int = 20):
    """alpha > 0 with (M alpha)_i = 1 / alpha_i for the present tasks, M = `gram`.

    The solution is the unique minimiser of the strictly convex, self-concordant
        f(alpha) = 1/2 alpha^T M alpha - sum_i log alpha_i
    (stationarity: M alpha - 1/alpha = 0), found by `iterations` damped Newton steps
    (Nesterov's self-concordant scheme: step 1/(1 + lambda) while the Newton decrement
    lambda >= 1/4, full steps after, which converge quadratically). Each step stays
    strictly positive: in the variables alpha the Newton step d satisfies
    |d_i| / alpha_i <= lambda, so alpha_i changes by less than a factor 2 per damped step.

    Numerics: M is divided by its Frobenius norm s (as the reference does; alpha for M is
    alpha' / sqrt(s) for the alpha' of M / s), the Newton system is solved in the
    scaled form (D M D + I) v = alpha o (M alpha) - 1, D = diag(alpha) (eigenvalues >= 1,
    so well conditioned at any alpha), and the start is the closed form of a diagonal M,
    1/sqrt(M_ii), times the best common factor sqrt(T / v^T M v).

    Absent tasks (present 0) and present tasks with a zero gradient (M_ii = 0: no utility
    to bargain over, the problem has no solution) are left out: they get alpha = 0 and
    the others the solution of the bargaining among themselves.

    When the bargaining has no solution (some positive combination of the gradients is
    0: no common descent direction), f is unbounded below and alpha grows by < 2x per
    step: finite after a fixed count, and Nash-MTL's `max_norm` clipping bounds the
    combined gradient.

    Returns:
      (alpha [T], residual): residual = max_i |alpha_i (M alpha)_i - 1| over the solved
      tasks (0 at the exact solution; the relative form of M alpha - 1/alpha).
    """
    gram = ops.convert_to_tensor(gram)
    dtype = standardize_dtype(gram.dtype)
    T = int(gram.shape[0])
    one = scalar(1.0, dtype)
    present = ops.cast(present, dtype)
    gram = 0.5 * (gram + ops.transpose(gram))
    diag = ops.diagonal(gram)
    active = ops.cast(ops.logical_and(ops.greater(present, 0), ops.greater(diag, 0)), dtype)
    pair = active[:, None] * active[None, :]
    masked = gram * pair
    scale = ops.sqrt(ops.sum(ops.square(masked)))
    safe_scale = ops.where(ops.greater(scale, 0), scale, one)
    # Left-out tasks become decoupled dummies with M_ii = 1 (their alpha converges to 1
    # and is zeroed at the end); the solved block is exactly the present tasks' problem.
    m = masked / safe_scale + ops.diag(one - active)
    start = ops.rsqrt(ops.diagonal(m))
    quad = ops.tensordot(start, matvec(m, start), 1)
    # quad ~ 0: no bargaining solution (opposed gradients); start at a finite point.
    eps = scalar(float(np.finfo(dtype).eps), dtype)
    alpha = start * ops.sqrt(scalar(float(T), dtype) / ops.maximum(quad, eps))
    quarter = scalar(0.25, dtype)
    eye = ops.eye(T, dtype=dtype)

    def newton_step(k, alpha):
        u = alpha * matvec(m, alpha) - one  # D (M alpha - 1/alpha)
        system = alpha[:, None] * m * alpha[None, :] + eye
        v = ops.linalg.solve(system, u[:, None])[:, 0]
        decrement = ops.sqrt(ops.maximum(ops.tensordot(u, v, 1), ops.zeros((), dtype)))
        step = ops.where(ops.less(decrement, quarter), one, one / (one + decrement))
        return k + 1, alpha * (one - step * v)

    _, alpha = ops.while_loop(
        lambda k, a: ops.less(k, iterations),
        newton_step,
        (ops.convert_to_tensor(0, "int32"), alpha),
        maximum_iterations=iterations,
    )
    residual = ops.max(ops.abs(alpha * matvec(m, alpha) - one) * active)
    alpha = alpha * active / ops.sqrt(safe_scale)
    return alpha, residual


@register
class NashMTL(MultiTaskMethod):
    """Nash-MTL: the task weights alpha are the Nash bargaining solution

        (G G^T alpha)_i = 1 / alpha_i,  alpha > 0      (M = G G^T = `inputs.gram`)

    (the paper's Claim 3.2), the shared gradient is sum_t alpha_t g_t clipped to norm
    `max_norm`, and the task-specific variables get alpha_t g_t (the reference
    back-propagates sum_t alpha_t L_t and clips only the shared parameters):

        shared   = alpha * min(1, max_norm / (sqrt(alpha^T M alpha) + 1e-6))
        specific = loss_weights = alpha

    (torch's `clip_grad_norm_` factor, computed from the Gram matrix: the combined
    gradient's norm is sqrt(alpha^T M alpha); `max_norm=0` turns clipping off, as in
    the reference). At the exact solution alpha^T M alpha = T, so with the default
    max_norm=1 the shared gradient always has norm ~1.

    Every `update_weights_every` steps (`inputs.step % update_weights_every == 0`,
    the first step included) alpha is solved anew; in between the previous solution is
    reused (state `nash_mtl_prev_alpha` [T], checkpointed; initial ones as the
    reference's `prvs_alpha`). A task absent at an update step keeps its previous
    alpha in the state; absent tasks always get coefficient 0.

    Solver (`nash_bargaining_weights`): the reference (official AvivNavon/nash-mtl and
    LibMTL `Nash_MTL`) runs up to `optim_niter` = 20 steps of the concave-convex
    procedure with cvxpy/ECOS on M / ||M||_F, warm-started at the previous alpha:
        min_alpha sum(M alpha) + phi_lin(alpha)  s.t.  alpha_i (M alpha)_i >= 1,
    phi(alpha) = sum_i log alpha_i + log (M alpha)_i linearised at the last iterate (its
    `normalization_factor` cancels out: it solves the problem of the UNnormalised M).
    This runs `optim_niter` damped Newton steps on f(alpha) = 1/2 alpha^T M alpha -
    sum log alpha, whose minimiser is the exact solution of M alpha = 1/alpha; in
    float64 20 steps reach max_i |alpha_i (M alpha)_i - 1| < 1e-12 (worst 2.4e-13 over 300
    random Gram matrices, T = 2..8, gradient norms over 6 decades, cosines down to -0.98,
    condition numbers up to 6e11; tests/algorithms/test_mtl_nash_aligned.py checks 40 such).

    How close to the reference (measured by running LibMTL's code with cvxpy 1.9.3 /
    ECOS on 240 random problems, T = 2, 3, 5, D = 20, gradient norms over 2 decades,
    half with a shared conflicting direction, first step, CCP started at ones): in 79%
    the CCP stops at the bargaining point and agrees with this to <= 2e-5 relative
    (median 1e-6: ECOS's tolerance and the stopping rule). In 21% (none for T=2 without
    conflicts, 37% for T=5 with conflicts) it returns a different point: the CCP's
    fixed point is a KKT point of the problem above, which is the bargaining point only
    while every constraint's multiplier there, lambda = 1 + (diag(1/alpha) +
    M diag(alpha))^-1 M 1, is >= 0 (that sign test classifies 94% of the draws right);
    typically when a task's gradient opposes the others' sum (<g_i, sum_j g_j> < 0)
    its constraint goes inactive and the CCP raises its alpha_i above the bargaining value
    (alpha_i (M alpha)_i = 4.95 instead of 1 in one T=5 example; weights up to 28x the
    bargaining ones). This returns the paper's bargaining solution there; the shared
    gradient's norm is the same (max_norm) either way, its direction differs.

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      update_weights_every: solve every this many steps (LibMTL default 1).
      optim_niter: Newton iterations of the in-graph solver (LibMTL's name and default
        20, there CCP iterations).
      max_norm: clip the shared gradient to this norm; 0 disables (default 1.0).

    Example:
      >>> NashMTL(update_weights_every=1, optim_niter=20, max_norm=1.0)
      NashMTL(update_weights_every=1, optim_niter=20, max_norm=1.0)
    """

    name = "nash_mtl"
    aliases = ("nashmtl",)
    kind = "loss"
    uses_gradients = True
    reference = (
        "Navon et al. 2022 (M alpha = 1/alpha, in-graph Newton); LibMTL Nash_MTL / "
        "AvivNavon/nash-mtl (CCP with cvxpy) agree where the CCP reaches it"
    )

    def __init__(self, update_weights_every: int = 1, optim_niter: int = 20, max_norm: float = 1.0):
        self.update_weights_every = check_number(
            "update_weights_every", update_weights_every, 1, integer=True
        )
        self.optim_niter = check_number("optim_niter", optim_niter, 1, 1000, integer=True)
        self.max_norm = check_number("max_norm", max_norm, 0.0)

    def state_spec(self, num_tasks):
        return {"prev_alpha": StateSpec((num_tasks,), initializer="ones")}

    def combine(self, inputs, state):
        acc = inputs.dtype
        present = ops.cast(inputs.present, acc)
        gram = ops.cast(inputs.gram, acc)
        prev = ops.cast(state["prev_alpha"], acc)
        solved, _ = nash_bargaining_weights(gram, present, self.optim_niter)
        if self.update_weights_every == 1:
            alpha = solved
            new_prev = ops.where(ops.greater(present, 0), solved, prev)
        else:
            step = ops.convert_to_tensor(inputs.step)  # int32 or int64: its own dtype
            update = ops.equal(ops.mod(step, self.update_weights_every), 0)
            alpha = ops.where(update, solved, prev) * present
            new_prev = ops.where(ops.logical_and(update, ops.greater(present, 0)), solved, prev)
        if self.max_norm > 0:
            norm = ops.sqrt(
                ops.maximum(ops.tensordot(alpha, matvec(gram, alpha), 1), ops.zeros((), acc))
            )
            clip = ops.minimum(
                scalar(1.0, acc), scalar(self.max_norm, acc) / (norm + scalar(1e-6, acc))
            )
            shared = alpha * clip
        else:
            shared = alpha
        return Combination(
            shared=shared,
            specific=alpha,
            loss_weights=alpha,
            state={"prev_alpha": ops.cast(new_prev, standardize_dtype(state["prev_alpha"].dtype))},
        )

    def get_config(self):
        return {
            "update_weights_every": self.update_weights_every,
            "optim_niter": self.optim_niter,
            "max_norm": self.max_norm,
        }
