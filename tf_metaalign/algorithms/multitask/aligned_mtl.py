"""Aligned-MTL (Senushkin et al., CVPR 2023): align the task gradients' principal
components (condition number 1) by an eigen-decomposition of the T x T Gram matrix."""

from __future__ import annotations

import tensorflow as tf

from tf_metaalign.algorithms.multitask.base import Combination, MultiTaskMethod, register, scalar

#: torch.finfo().eps of the reference (torch's default dtype, float32), whatever the
#: Gram matrix's dtype: the numerical-rank tolerance is max(lambda) * T * this.
RANK_EPS = 1.1920928955078125e-07

SCALE_MODES = ("min", "median", "rmse")


def refined_eigh(m, sweeps: int = 2):
    """tf.linalg.eigh(m) polished by `sweeps` cyclic Jacobi sweeps on V^T m V, sorted
    ascending. XLA's eigh (Jacobi with a loose stopping rule) leaves eigenvector
    residuals |m V - V diag(lambda)| up to ~1e-8 max(lambda) in float64 at T = 8 (LAPACK:
    ~1e-15); started that close to diagonal, Jacobi converges quadratically, so two sweeps
    bring XLA to LAPACK's accuracy (eager and XLA then agree to ~1e-14). Cost (XLA CPU,
    float32, whole `aligned_mtl_weights`): 0.35 ms at T = 10, 27 ms at T = 40."""
    dtype = m.dtype
    T = int(m.shape[0])
    lam, vec = tf.linalg.eigh(m)
    if T < 2 or sweeps == 0:
        return lam, vec
    pairs = [(i, j) for i in range(T) for j in range(i + 1, T)]
    table = tf.constant(pairs, tf.int32)
    one, zero = tf.ones([], dtype), tf.zeros([], dtype)

    def body(k, a, v):
        i, j = table[k % len(pairs), 0], table[k % len(pairs), 1]
        aii, ajj, aij = a[i, i], a[j, j], a[i, j]
        nonzero = tf.not_equal(aij, zero)
        tau = (ajj - aii) / (2.0 * tf.where(nonzero, aij, one))
        t = tf.where(tau >= 0, one, -one) / (tf.abs(tau) + tf.sqrt(one + tau * tau))
        t = tf.where(nonzero, t, zero)
        c = tf.math.rsqrt(one + t * t)
        s = t * c
        # The rotation J (J_ii = J_jj = c, J_ij = s, J_ji = -s) touches two columns of
        # A J and V J and two rows of J^T (A J): rank-2 updates, O(T^2) each.
        ei, ej = tf.one_hot(i, T, dtype=dtype), tf.one_hot(j, T, dtype=dtype)

        def columns(x):
            xi, xj = tf.gather(x, i, axis=1), tf.gather(x, j, axis=1)
            return (
                x
                + ((c - one) * xi - s * xj)[:, None] * ei[None, :]
                + (s * xi + (c - one) * xj)[:, None] * ej[None, :]
            )

        b = columns(a)
        bi, bj = tf.gather(b, i, axis=0), tf.gather(b, j, axis=0)
        a = (
            b
            + ei[:, None] * ((c - one) * bi - s * bj)[None, :]
            + ej[:, None] * (s * bi + (c - one) * bj)[None, :]
        )
        return k + 1, 0.5 * (a + tf.transpose(a)), columns(v)

    a = tf.matmul(vec, tf.matmul(m, vec), transpose_a=True)
    _, a, vec = tf.while_loop(
        lambda k, a, v: k < sweeps * len(pairs),
        body,
        (tf.constant(0), 0.5 * (a + tf.transpose(a)), vec),
        maximum_iterations=sweeps * len(pairs),
    )
    lam = tf.linalg.diag_part(a)
    order = tf.argsort(lam)
    return tf.gather(lam, order), tf.gather(vec, order, axis=1)


def aligned_mtl_weights(gram, present, scale_mode: str = "min"):
    """alpha [T] with sum_t alpha_t g_t = Aligned-MTL's combined gradient.

    M = V diag(lambda) V^T (tf.linalg.eigh, `refined_eigh`), kept: the eigenvalues
    lambda_k > tol = max(lambda) * n * eps (n the number of present tasks, eps float32's, as the
    reference's torch.finfo()), r of them; B = c V_r diag(lambda_r^-1/2) V_r^T with c =
    sqrt(min kept lambda) (`scale_mode="min"`), sqrt(the lower median of the kept
    lambda) ("median", torch.median) or sqrt(their mean) ("rmse"); alpha = B^T 1.

    Rank deficiency as the reference: the eigen-directions of (numerically) zero
    eigenvalues are dropped, i.e. B = c (M^+)^(1/2) on the range of M, which is basis
    independent (degenerate eigenvalues give the same B). Absent tasks (zero rows of M)
    fall in the null space and get alpha = 0 (multiplied by `present` to be exact). All
    gradients zero: alpha = 0.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"`scale_mode` must be one of {SCALE_MODES}; got {scale_mode!r}.")
    dtype = gram.dtype
    T = int(gram.shape[0])
    zero = tf.zeros([], dtype)
    pair = present[:, None] * present[None, :]
    m = 0.5 * (gram + tf.transpose(gram)) * pair
    lam, vec = refined_eigh(m)  # ascending
    n = tf.reduce_sum(present)
    tol = tf.reduce_max(lam) * tf.maximum(n, scalar(1.0, dtype)) * scalar(RANK_EPS, dtype)
    keep = lam > tol
    keep_f = tf.cast(keep, dtype)
    rank = tf.reduce_sum(tf.cast(keep, tf.int32))
    safe_lam = tf.where(keep, lam, tf.ones_like(lam))
    if scale_mode == "min":
        # Kept eigenvalues are the top `rank` of the ascending list.
        level = tf.gather(lam, tf.minimum(T - rank, T - 1))
    elif scale_mode == "median":
        level = tf.gather(lam, tf.minimum(T - rank + tf.math.floordiv(rank - 1, 2), T - 1))
    else:
        level = tf.math.divide_no_nan(tf.reduce_sum(lam * keep_f), tf.cast(rank, dtype))
    level = tf.where(rank > 0, tf.maximum(level, zero), zero)
    inv_sqrt = keep_f * tf.math.rsqrt(safe_lam)
    ones = tf.ones([T], dtype)
    projected = tf.linalg.matvec(vec, ones, transpose_a=True)  # V^T 1
    alpha = tf.sqrt(level) * tf.linalg.matvec(vec, inv_sqrt * projected)
    return alpha * present


@register
class AlignedMTL(MultiTaskMethod):
    """Aligned-MTL: with M = G G^T = V diag(lambda) V^T (the Gram matrix of the shared
    task gradients), the aligned gradients are G^T B with

        B = sqrt(lambda_min) V diag(lambda^-1/2) V^T

    (the Procrustes solution of "closest gradients with condition number 1", rescaled by
    the smallest singular value), and the update is their sum, i.e. the combination

        shared = alpha = B^T 1,   shared gradient = sum_t alpha_t g_t.

    Task-specific variables keep their task's raw gradient (`specific = 1`: LibMTL's
    per-task backward passes with `rep_grad=False`; the official code's default
    `scale_decoder_grad=False`). The reported loss is the plain sum (loss_weights 1).

    Rank deficiency as the reference (LibMTL `Aligned_MTL`, SamsungLabs/MTL
    `ProcrustesSolver`): eigenvalues <= max(lambda) * T * eps (eps = float32's, the
    reference's `torch.finfo()`, also for float64 inputs) are dropped with their
    eigenvectors and lambda_min is the smallest kept one; see `aligned_mtl_weights`.
    Absent tasks count as not there (T = the present count; alpha 0).

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      scale_mode: "min" (LibMTL and the paper: sqrt of the smallest kept eigenvalue),
        "median" or "rmse" (the official code's other modes: sqrt of the lower median /
        the mean of the kept eigenvalues).

    Example:
      >>> AlignedMTL()
      AlignedMTL(scale_mode='min')
    """

    name = "aligned_mtl"
    aliases = ("amtl",)
    kind = "gradient"
    uses_gradients = True
    reference = "LibMTL Aligned_MTL; SamsungLabs/MTL ProcrustesSolver (NumPy re-derivation)"

    def __init__(self, scale_mode: str = "min"):
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"`scale_mode` must be one of {SCALE_MODES}; got {scale_mode!r}.")
        self.scale_mode = scale_mode

    def combine(self, inputs, state):
        acc = inputs.dtype
        alpha = aligned_mtl_weights(
            tf.cast(inputs.gram, acc), tf.cast(inputs.present, acc), self.scale_mode
        )
        return Combination(shared=alpha, specific=tf.ones_like(inputs.losses))

    def get_config(self):
        return {"scale_mode": self.scale_mode}
