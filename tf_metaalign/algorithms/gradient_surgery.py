"""Multi-task gradient combination (gradient surgery) as pure functions.

Every function takes the per-task gradients as a list of T gradient lists
(`task_grads[t][v]`: task t's gradient of variable v) or only their Gram matrix, and
returns tensors; nothing is assigned (the trainer keeps the state: GradVac's targets,
GradNorm's weights and initial losses).

Coefficient space. PCGrad and GradVac only ever replace a task gradient g_i by g_i plus
multiples of the ORIGINAL gradients g_j, so after the surgery g_i' = sum_j A_ij g_j, and
every dot product they need is a quadratic form of the Gram matrix G_jk = <g_j, g_k>
(global over all variables): <g_i', g_j> = (A G)_ij, ||g_i'||^2 = (A G A^T)_ii. The
functions below run the algorithms on G (T(T+1)/2 dot products over the model, then
O(T^3) scalar work) and return the combination coefficients `c_j = sum_i A_ij`; the
combined gradient is `combine(task_grads, c) = sum_j c_j g_j`, the same vector as
summing the surgically modified g_i' (up to rounding).

References: PCGrad (Yu et al. 2020, "Gradient Surgery for Multi-Task Learning",
tianheyu927/PCGrad), GradVac (Wang et al. 2021, "Gradient Vaccine", as in
median-research-group/LibMTL `GradVac`), GradNorm (Chen et al. 2018, as in LibMTL
`GradNorm`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_metaalign import functional as F


# ------------------------------------------------------------------------ helpers


def _check_task_grads(task_grads, where):
    if not isinstance(task_grads, (list, tuple)) or not task_grads:
        raise ValueError(
            f"{where}: `task_grads` must be a non-empty list with one gradient list per task; "
            f"got {type(task_grads).__name__}."
        )
    n = len(task_grads[0])
    for t, g in enumerate(task_grads):
        if not isinstance(g, (list, tuple)):
            raise ValueError(
                f"{where}: `task_grads[{t}]` must be a list of tensors (one per variable); got "
                f"{type(g).__name__}."
            )
        if len(g) != n:
            raise ValueError(
                f"{where}: `task_grads[{t}]` has {len(g)} tensors but `task_grads[0]` has {n}."
            )
    return len(task_grads)


def gram_matrix(task_grads) -> tf.Tensor:
    """`G[i, j] = <g_i, g_j>` over all variables, [T, T], in the accumulation dtype
    (float64 if any gradient is float64, else float32).

    Variable by variable, the T gradients are stacked as rows of a [T, n] matrix M and
    M M^T is one matrix product (one read of the gradients; measured 2.5-3x faster on CPU
    than T(T+1)/2 separate dot products, each of which reads two gradients and writes
    their product), then symmetrised (exactly symmetric whatever the product's rounding).
    Transient memory: one stacked copy of ONE variable's T gradients at a time.
    """
    T = _check_task_grads(task_grads, "gram_matrix")
    acc = F.accumulation_dtype([g for grads in task_grads for g in grads])
    if not task_grads[0]:
        return tf.zeros([T, T], acc)
    return stacked_gram_matrix(
        [
            tf.stack([tf.cast(grads[v], acc) for grads in task_grads])
            for v in range(len(task_grads[0]))
        ]
    )


def stacked_gram_matrix(stacked) -> tf.Tensor:
    """`gram_matrix` of gradients given STACKED by variable: `stacked[v]` is [T, *shape
    of variable v]` (task t's gradient in row t), as a vectorized per-task pass returns
    them; no copy is made. [T, T] in the accumulation dtype, exactly symmetric."""
    if not stacked:
        raise ValueError("stacked_gram_matrix: `stacked` holds no variable's gradients.")
    T = stacked[0].shape[0]
    if T is None or any(g.shape[0] != T for g in stacked):
        raise ValueError(
            "stacked_gram_matrix: every `stacked[v]` must have the same static "
            f"leading dimension T; got {[g.shape for g in stacked]}."
        )
    acc = F.accumulation_dtype(stacked)
    total = tf.zeros([T, T], acc)
    for g in stacked:
        rows = tf.reshape(tf.cast(g, acc), [T, -1])
        total += tf.matmul(rows, rows, transpose_b=True)
    return 0.5 * (total + tf.transpose(total))


def stacked_combine(stacked, coefficients) -> list[tf.Tensor]:
    """`combine` of gradients given stacked by variable ([T, ...] each): one
    contraction of the task dimension per variable (in each gradient's dtype)."""
    acc = F.accumulation_dtype(stacked)
    coefficients = tf.convert_to_tensor(coefficients, dtype_hint=acc)
    return [tf.tensordot(tf.cast(coefficients, g.dtype), g, axes=1) for g in stacked]


def dense_task_gram(inputs, output_grads, task_onehot, has_bias=True) -> tf.Tensor:
    """The [T, T] Gram matrix of the per-task gradients of ONE Dense layer (kernel, and
    bias when `has_bias`), from its inputs and output gradients, without forming them.

    With rows r of the batch, x_r = `inputs[r]` [d_in], dz_r = `output_grads[r]`
    [d_out] (the loss's gradient at the layer's pre-activation output) and every row
    belonging to one task (`task_onehot` [B, T], rows of zeros allowed), task t's kernel
    gradient is g_t = sum_{r in t} x_r dz_r^T and its bias gradient sum_{r in t} dz_r, so

        <g_i, g_j> = sum_{r in i, s in j} (x_r . x_s + [has_bias]) (dz_r . dz_s)
                   = (S^T ((X X^T + [has_bias]) * (dZ dZ^T)) S)_ij

    (Goodfellow 2015, "Efficient per-example gradient computations"; the "ghost norm"
    of Li et al. 2022 is its diagonal for one row per task). Cost B^2 (d_in + d_out)
    against the T d_in d_out of writing the T gradients out and reading them back.
    The per-row gradients dz_r are task t's own when the rows do not interact (no
    BatchNorm in training mode): then the gradient of sum_t L_t at row r is that of
    its task's loss. In the accumulation dtype of the inputs, exactly symmetric.
    """
    acc = F.accumulation_dtype([inputs, output_grads])
    x = tf.cast(inputs, acc)
    dz = tf.cast(output_grads, acc)
    if x.shape.rank != 2 or dz.shape.rank != 2:
        raise ValueError(
            "dense_task_gram: `inputs` and `output_grads` must be [rows, features]; got "
            f"{x.shape} and {dz.shape}."
        )
    s = tf.cast(task_onehot, acc)
    xx = tf.matmul(x, x, transpose_b=True)
    if has_bias:
        xx = xx + 1.0
    k = xx * tf.matmul(dz, dz, transpose_b=True)
    gram = tf.matmul(s, tf.matmul(k, s), transpose_a=True)
    return 0.5 * (gram + tf.transpose(gram))


def dense_combined_gradient(inputs, output_grads, row_coefficients, has_bias=True):
    """sum_t c_t g_t for ONE Dense layer, as ONE weight-gradient product:
    kernel X^T (c_row * dZ), bias sum_r c_row dz_r, where `row_coefficients[r]` is the
    coefficient of row r's task (see `dense_task_gram` for X, dZ). Returns
    `[kernel_gradient]` or `[kernel_gradient, bias_gradient]`, in the accumulation
    dtype of the inputs."""
    acc = F.accumulation_dtype([inputs, output_grads])
    weighted = tf.cast(output_grads, acc) * tf.cast(row_coefficients, acc)[:, None]
    kernel = tf.matmul(tf.cast(inputs, acc), weighted, transpose_a=True)
    return [kernel, tf.reduce_sum(weighted, axis=0)] if has_bias else [kernel]


def combine(task_grads, coefficients) -> list[tf.Tensor]:
    """`sum_t coefficients[t] * task_grads[t]`, variable by variable (in each gradient's dtype)."""
    T = _check_task_grads(task_grads, "combine")
    # A python / NumPy list is converted in the gradients' accumulation dtype (a list of
    # python floats would otherwise become float32: 0.1 -> 0.10000000149011612).
    acc = F.accumulation_dtype([g for grads in task_grads for g in grads])
    coefficients = tf.convert_to_tensor(coefficients, dtype_hint=acc)
    if coefficients.shape.rank != 1 or coefficients.shape[0] != T:
        raise ValueError(
            f"combine: `coefficients` must have shape [{T}] (one per task); got "
            f"{coefficients.shape}."
        )
    out = []
    for v in range(len(task_grads[0])):
        total = None
        for t in range(T):
            g = task_grads[t][v]
            term = tf.cast(coefficients[t], g.dtype) * g
            total = term if total is None else total + term
        out.append(total)
    return out


def mean_pairwise_cosine(gram, present=None) -> tf.Tensor:
    """Mean of cos(g_i, g_j) over the pairs i < j of present tasks (0 if fewer than 2)."""
    gram = tf.convert_to_tensor(gram)
    T = int(gram.shape[0])
    if present is None:
        present = tf.ones([T], gram.dtype)
    present = tf.cast(present, gram.dtype)
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    total = tf.constant(0.0, gram.dtype)
    count = tf.constant(0.0, gram.dtype)
    for i in range(T):
        for j in range(i + 1, T):
            w = present[i] * present[j]
            total += w * tf.math.divide_no_nan(gram[i, j], norms[i] * norms[j])
            count += w
    return tf.math.divide_no_nan(total, count)


def _hash32(x):
    """The "lowbias32" integer hash (C. Wellons) on uint32 tensors."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
    x = x * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
    x = x * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _uint32(x):
    x = tf.cast(x, tf.int64)
    return tf.cast(tf.bitwise.bitwise_and(x, 0xFFFFFFFF), tf.uint32)


def random_order(num_tasks, seed, step) -> tf.Tensor:
    """A permutation of range(num_tasks) (int32), a pure function of (seed, step).

    Each task gets the key hash(hash(hash(seed) ^ step_low) ^ step_high ^ task) (a
    32-bit integer hash) and the tasks are sorted by key. Integer arithmetic only, so
    eager, graph, XLA and a resumed run draw the same order (TensorFlow's stateless RNG
    ops do not: measured, `stateless_uniform` with a seed read from a variable gives other
    numbers under XLA).
    """
    step = tf.cast(step, tf.int64)
    h = _hash32(_uint32(seed))
    h = _hash32(tf.bitwise.bitwise_xor(h, _uint32(step)))
    h = tf.bitwise.bitwise_xor(h, _uint32(tf.bitwise.right_shift(step, 32)))
    keys = _hash32(tf.bitwise.bitwise_xor(h, tf.constant(list(range(num_tasks)), tf.uint32)))
    return tf.cast(tf.argsort(tf.cast(keys, tf.int64), stable=True), tf.int32)


def _scalar(value, dtype):
    """A python number as an exact `dtype` constant (`tf.cast` of a python float would
    round it through float32 first); tensors are cast (`functional.scalar`)."""
    return F.scalar(value, dtype)


def _one_hot(j, T, dtype):
    return tf.one_hot(j, T, dtype=dtype)


def _check_order(order, T, where):
    order = tf.cast(tf.convert_to_tensor(order), tf.int32)
    if order.shape.rank != 1 or order.shape[0] != T:
        raise ValueError(
            f"{where}: `order` must be a permutation of range({T}); got shape {order.shape}."
        )
    return order


# ------------------------------------------------------------------------- PCGrad


def pcgrad_coefficients(gram, order) -> tf.Tensor:
    """PCGrad (Yu et al., Algorithm 1) on the Gram matrix: the coefficients c with
    `sum_i g_i^PC = sum_j c_j g_j`.

    For each task i (in index order, each independently): g_i' = g_i; for j in `order`
    (one permutation of the tasks, shared by every i), j != i: if <g_i', g_j> < 0 (g_j the
    ORIGINAL gradient),
    g_i' <- g_i' - <g_i', g_j> / ||g_j||^2 * g_j. A zero g_j (a task absent from the
    batch) projects nothing.

    The references differ in the order (from T = 3 on): LibMTL's `PCGrad` draws a new
    random order for every task i; the official `PCGrad_tf.py` calls
    `tf.random.shuffle(loss)` and discards the result, so it projects in index order.
    One order per step, drawn by the caller (`random_order(seed, step)` in the
    trainer), is reproducible and resumable; with `order = range(T)` this is the
    official code's computation.
    """
    gram = tf.convert_to_tensor(gram)
    T = int(gram.shape[0])
    order = _check_order(order, T, "pcgrad_coefficients")
    dtype = gram.dtype
    rows = []
    for i in range(T):
        a = _one_hot(i, T, dtype)
        for k in range(T):
            j = order[k]
            g_j = tf.gather(gram, j, axis=1)  # <g_m, g_j> for every m
            inner = tf.reduce_sum(a * g_j)
            coef = tf.math.divide_no_nan(inner, tf.gather(g_j, j))
            apply = tf.logical_and(tf.not_equal(j, i), inner < 0)
            a = a - tf.where(apply, coef, tf.zeros_like(coef)) * _one_hot(j, T, dtype)
        rows.append(a)
    return tf.reduce_sum(tf.stack(rows), axis=0)


def pcgrad(task_grads, order) -> list[tf.Tensor]:
    """The PCGrad update direction `sum_i g_i^PC` (see `pcgrad_coefficients`)."""
    return combine(task_grads, pcgrad_coefficients(gram_matrix(task_grads), order))


# ------------------------------------------------------------------------- GradVac


class GradVacResult(NamedTuple):
    coefficients: tf.Tensor  # [T]: combined = sum_j c_j g_j
    targets: tf.Tensor  # [T, T]: the updated EMA targets phi_hat_ij


def gradvac_coefficients(gram, targets, order, beta=1e-2) -> GradVacResult:
    """Gradient Vaccine (Wang et al. 2021, global variant) on the Gram matrix.

    For each task i: g_i' = g_i; for j in `order` (shared by every i), j != i and both
    gradients non-zero:
      phi = cos(g_i', g_j)  (g_i' the current, modified g_i; g_j the original)
      if phi < phi_hat_ij:
        g_i' <- g_i' + ||g_i'|| (phi_hat sqrt(1 - phi^2) - phi sqrt(1 - phi_hat^2))
                       / (||g_j|| sqrt(1 - phi_hat^2)) * g_j
      phi_hat_ij <- (1 - beta) phi_hat_ij + beta phi       (AFTER its use, per pair)
    The targets are per ordered pair (i, j), over the whole model (one global cosine, not
    per layer), and EMA-updated with the cosine measured before that pair's adjustment,
    as LibMTL's GradVac does. A pair with an absent task (zero gradient) is skipped and
    keeps its target.
    """
    gram = tf.convert_to_tensor(gram)
    T = int(gram.shape[0])
    order = _check_order(order, T, "gradvac_coefficients")
    dtype = gram.dtype
    targets = tf.cast(tf.convert_to_tensor(targets), dtype)
    if targets.shape != (T, T):
        raise ValueError(
            f"gradvac_coefficients: `targets` must have shape [{T}, {T}]; got {targets.shape}."
        )
    beta = _scalar(beta, dtype)
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.0))
    rows, new_targets = [], []
    for i in range(T):
        a = _one_hot(i, T, dtype)
        target_row = targets[i]
        for k in range(T):
            j = order[k]
            g_j = tf.gather(gram, j, axis=1)
            norm_j = tf.gather(norms, j)
            norm_i = tf.sqrt(tf.maximum(tf.reduce_sum(a * tf.linalg.matvec(gram, a)), 0.0))
            phi = tf.math.divide_no_nan(tf.reduce_sum(a * g_j), norm_i * norm_j)
            phi_hat = tf.gather(target_row, j)
            valid = tf.logical_and(tf.not_equal(j, i), tf.logical_and(norm_i > 0, norm_j > 0))
            root_hat = tf.sqrt(tf.maximum(1.0 - phi_hat * phi_hat, 0.0))
            root = tf.sqrt(tf.maximum(1.0 - phi * phi, 0.0))
            w = tf.math.divide_no_nan(norm_i * (phi_hat * root - phi * root_hat), norm_j * root_hat)
            adjust = tf.logical_and(valid, phi < phi_hat)
            a = a + tf.where(adjust, w, tf.zeros_like(w)) * _one_hot(j, T, dtype)
            updated = (1.0 - beta) * phi_hat + beta * phi
            target_row = target_row + tf.where(
                valid, updated - phi_hat, tf.zeros_like(phi_hat)
            ) * _one_hot(j, T, dtype)
        rows.append(a)
        new_targets.append(target_row)
    return GradVacResult(tf.reduce_sum(tf.stack(rows), axis=0), tf.stack(new_targets))


# ------------------------------------------------------------------------- GradNorm


def gradnorm_update(
    weights, layer_norms, losses, initial_losses, present=None, alpha=1.5, learning_rate=0.025
) -> tf.Tensor:
    """One GradNorm step (Chen et al. 2018, Algorithm 1) on the task weights.

    Args:
      weights: [T] current task weights w_i (they weight this step's gradient).
      layer_norms: [T] ||grad_W L_i|| of the UNWEIGHTED task losses at the chosen shared
        weight W.
      losses, initial_losses: [T] L_i(t) and L_i(0).
      present: [T] 1 for the tasks in the batch (others are left out of every mean and
        keep their weight), default all.
    With G_i = w_i ||grad_W L_i||, G_bar the mean of G over present tasks,
    r_i = (L_i / L_i(0)) / mean_present(L / L(0)), the target G_bar r_i^alpha is a
    constant and L_grad = sum_i |G_i - G_bar r_i^alpha|, so dL_grad/dw_i =
    sign(G_i - target_i) ||grad_W L_i||. Returns w - learning_rate * dL_grad/dw,
    renormalised so that the weights sum to T.
    """
    weights = tf.convert_to_tensor(weights)
    dtype = weights.dtype
    T = int(weights.shape[0])

    def cast(v):
        # Numbers and python lists converted in `dtype` directly (not via float32).
        if isinstance(v, (int, float, np.integer, np.floating)):
            return _scalar(v, dtype)
        return tf.cast(tf.convert_to_tensor(v, dtype_hint=dtype), dtype)

    layer_norms, losses, initial_losses = cast(layer_norms), cast(losses), cast(initial_losses)
    present = tf.ones([T], dtype) if present is None else cast(present)
    n_present = tf.reduce_sum(present)
    G = weights * layer_norms
    G_bar = tf.math.divide_no_nan(tf.reduce_sum(present * G), n_present)
    ratio = tf.math.divide_no_nan(losses, initial_losses)
    mean_ratio = tf.math.divide_no_nan(tf.reduce_sum(present * ratio), n_present)
    r = tf.math.divide_no_nan(ratio, mean_ratio)
    target = tf.stop_gradient(G_bar * tf.pow(r, cast(alpha)))
    grad = present * tf.sign(G - target) * layer_norms
    new = weights - cast(learning_rate) * grad
    return new * tf.math.divide_no_nan(tf.cast(T, dtype), tf.reduce_sum(new))


__all__ = [
    "GradVacResult",
    "combine",
    "gradnorm_update",
    "gradvac_coefficients",
    "gram_matrix",
    "mean_pairwise_cosine",
    "pcgrad",
    "pcgrad_coefficients",
    "random_order",
]
