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
from keras import ops
from keras.backend import standardize_dtype

from tf_metaalign import functional as F

# Every function here is written once in `keras.ops`: it runs on TensorFlow (eager,
# tf.function, XLA) and on JAX (eager, jit), in float32 with JAX's x64 off (no
# float64 or int64 is created unless the inputs are float64 / int64).


# ------------------------------------------------------------------------ helpers


def _dtype(x) -> str:
    """The dtype of a tensor as a name ("float32", "float64", ...)."""
    return standardize_dtype(x.dtype)


def _acc(tensors) -> str:
    """`functional.accumulation_dtype` as a name."""
    return standardize_dtype(F.accumulation_dtype(tensors))


def matvec(a, x, transpose_a=False):
    """`a @ x` for a matrix (or a batch of matrices) `a` [..., m, n] and a vector (batch)
    `x` [..., n] (`a^T x` with `transpose_a`): a matmul with x as one column, the product
    `tf.linalg.matvec` computes."""
    if transpose_a:
        a = ops.swapaxes(a, -1, -2)
    return ops.matmul(a, ops.expand_dims(x, -1))[..., 0]


def _vector(values, dtype):
    """A list of python numbers as an exact `dtype` vector (converted from float64
    directly, not through float32); a tensor or array is converted as it is."""
    if isinstance(values, (list, tuple)) and all(
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        for v in values
    ):
        return ops.convert_to_tensor(np.asarray(values, dtype=dtype))
    return ops.convert_to_tensor(values)


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


def gram_matrix(task_grads):
    """`G[i, j] = <g_i, g_j>` over all variables, [T, T], in the accumulation dtype
    (float64 if any gradient is float64, else float32).

    Variable by variable, the T gradients are stacked as rows of a [T, n] matrix M and
    M M^T is one matrix product (one read of the gradients; measured 2.5-3x faster on CPU
    than T(T+1)/2 separate dot products, each of which reads two gradients and writes
    their product), then symmetrised (exactly symmetric whatever the product's rounding).
    Transient memory: one stacked copy of ONE variable's T gradients at a time.

    Example:
      >>> from tf_metaalign.algorithms import gradient_surgery as GS
      >>> g1 = [np.array([1.0, 0.0]), np.array(2.0)]
      >>> g2 = [np.array([-1.0, 1.0]), np.array(0.5)]
      >>> np.asarray(GS.gram_matrix([g1, g2])).tolist()
      [[5.0, 0.0], [0.0, 2.25]]
    """
    T = _check_task_grads(task_grads, "gram_matrix")
    task_grads = [[ops.convert_to_tensor(g) for g in grads] for grads in task_grads]
    acc = _acc([g for grads in task_grads for g in grads])
    if not task_grads[0]:
        return ops.zeros((T, T), dtype=acc)
    return stacked_gram_matrix(
        [
            ops.stack([ops.cast(grads[v], acc) for grads in task_grads])
            for v in range(len(task_grads[0]))
        ]
    )


def stacked_gram_matrix(stacked):
    """`gram_matrix` of gradients given STACKED by variable: `stacked[v]` is [T, *shape
    of variable v]` (task t's gradient in row t), as a vectorized per-task pass returns
    them; no copy is made. [T, T] in the accumulation dtype, exactly symmetric."""
    if not stacked:
        raise ValueError("stacked_gram_matrix: `stacked` holds no variable's gradients.")
    T = stacked[0].shape[0]
    if T is None or any(g.shape[0] != T for g in stacked):
        raise ValueError(
            "stacked_gram_matrix: every `stacked[v]` must have the same static "
            f"leading dimension T; got {[tuple(g.shape) for g in stacked]}."
        )
    acc = _acc(stacked)
    total = ops.zeros((T, T), dtype=acc)
    for g in stacked:
        rows = ops.reshape(ops.cast(g, acc), (T, -1))
        total = total + ops.matmul(rows, ops.transpose(rows))
    return 0.5 * (total + ops.transpose(total))


def stacked_combine(stacked, coefficients) -> list:
    """`combine` of gradients given stacked by variable ([T, ...] each): one
    contraction of the task dimension per variable (in each gradient's dtype)."""
    coefficients = _vector(coefficients, _acc(stacked))
    return [ops.tensordot(ops.cast(coefficients, _dtype(g)), g, axes=1) for g in stacked]


def dense_task_gram(inputs, output_grads, task_onehot, has_bias=True):
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
    inputs, output_grads = ops.convert_to_tensor(inputs), ops.convert_to_tensor(output_grads)
    acc = _acc([inputs, output_grads])
    x = ops.cast(inputs, acc)
    dz = ops.cast(output_grads, acc)
    if len(x.shape) != 2 or len(dz.shape) != 2:
        raise ValueError(
            "dense_task_gram: `inputs` and `output_grads` must be [rows, features]; got "
            f"{tuple(x.shape)} and {tuple(dz.shape)}."
        )
    s = ops.cast(task_onehot, acc)
    xx = ops.matmul(x, ops.transpose(x))
    if has_bias:
        xx = xx + 1.0
    k = xx * ops.matmul(dz, ops.transpose(dz))
    gram = ops.matmul(ops.transpose(s), ops.matmul(k, s))
    return 0.5 * (gram + ops.transpose(gram))


def dense_combined_gradient(inputs, output_grads, row_coefficients, has_bias=True):
    """sum_t c_t g_t for ONE Dense layer, as ONE weight-gradient product:
    kernel X^T (c_row * dZ), bias sum_r c_row dz_r, where `row_coefficients[r]` is the
    coefficient of row r's task (see `dense_task_gram` for X, dZ). Returns
    `[kernel_gradient]` or `[kernel_gradient, bias_gradient]`, in the accumulation
    dtype of the inputs."""
    inputs, output_grads = ops.convert_to_tensor(inputs), ops.convert_to_tensor(output_grads)
    acc = _acc([inputs, output_grads])
    weighted = ops.cast(output_grads, acc) * ops.expand_dims(ops.cast(row_coefficients, acc), 1)
    kernel = ops.matmul(ops.transpose(ops.cast(inputs, acc)), weighted)
    return [kernel, ops.sum(weighted, axis=0)] if has_bias else [kernel]


def combine(task_grads, coefficients) -> list:
    """`sum_t coefficients[t] * task_grads[t]`, variable by variable (in each gradient's dtype)."""
    T = _check_task_grads(task_grads, "combine")
    task_grads = [[ops.convert_to_tensor(g) for g in grads] for grads in task_grads]
    # A python list is converted in the gradients' accumulation dtype (a list of python
    # floats would otherwise become float32: 0.1 -> 0.10000000149011612).
    coefficients = _vector(coefficients, _acc([g for grads in task_grads for g in grads]))
    if len(coefficients.shape) != 1 or coefficients.shape[0] != T:
        raise ValueError(
            f"combine: `coefficients` must have shape [{T}] (one per task); got "
            f"{tuple(coefficients.shape)}."
        )
    out = []
    for v in range(len(task_grads[0])):
        total = None
        for t in range(T):
            g = task_grads[t][v]
            term = ops.cast(coefficients[t], _dtype(g)) * g
            total = term if total is None else total + term
        out.append(total)
    return out


def mean_pairwise_cosine(gram, present=None):
    """Mean of cos(g_i, g_j) over the pairs i < j of present tasks (0 if fewer than 2)."""
    gram = ops.convert_to_tensor(gram)
    dtype = _dtype(gram)
    T = int(gram.shape[0])
    present = ops.ones((T,), dtype) if present is None else ops.cast(present, dtype)
    norms = ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0))
    total = ops.zeros((), dtype)
    count = ops.zeros((), dtype)
    for i in range(T):
        for j in range(i + 1, T):
            w = present[i] * present[j]
            total = total + w * ops.divide_no_nan(gram[i, j], norms[i] * norms[j])
            count = count + w
    return ops.divide_no_nan(total, count)


# ------------------------------------------------------------ integer hashing (uint32)
#
# Random draws (task orders, RLW's weights) are integer hashes of (seed, step): eager,
# graph, XLA, jit and a resumed run draw the same, on both backends. All arithmetic is
# uint32 (a product wraps modulo 2^32 on TensorFlow and JAX alike), so it needs no int64:
# the step's low 32 bits come from an int32 or int64 step alike, its high 32 bits are 0
# for an int32 step (JAX without x64) and the same 0 for an int64 step below 2^31.

_MUL1 = np.uint32(0x7FEB352D)
_MUL2 = np.uint32(0x846CA68B)


def _hash32(x):
    """The "lowbias32" integer hash (C. Wellons) on uint32 tensors."""
    x = ops.bitwise_xor(x, ops.right_shift(x, 16))
    x = ops.multiply(x, ops.convert_to_tensor(_MUL1))
    x = ops.bitwise_xor(x, ops.right_shift(x, 15))
    x = ops.multiply(x, ops.convert_to_tensor(_MUL2))
    return ops.bitwise_xor(x, ops.right_shift(x, 16))


def _uint32(x):
    """The low 32 bits of an integer (a python int or an integer tensor) as uint32."""
    if isinstance(x, (int, np.integer)):
        return ops.convert_to_tensor(np.uint32(int(x) & 0xFFFFFFFF))
    return ops.cast(x, "uint32")  # modulo 2^32, on both backends


def _high_uint32(x):
    """Bits 32..63 of an integer as uint32 (0 for a 32-bit tensor)."""
    if isinstance(x, (int, np.integer)):
        return ops.convert_to_tensor(np.uint32((int(x) >> 32) & 0xFFFFFFFF))
    x = ops.convert_to_tensor(x)
    if _dtype(x) in ("int64", "uint64"):
        return ops.cast(ops.right_shift(x, 32), "uint32")
    return ops.convert_to_tensor(np.uint32(0))


def _step_key(seed_key, step):
    """hash(hash(seed_key ^ step_low) ^ step_high) with seed_key = hash(...) of the seed."""
    h = _hash32(ops.bitwise_xor(seed_key, _uint32(step)))
    return ops.bitwise_xor(h, _high_uint32(step))


def _hash_keys(key, n):
    """n uint32 keys hash(key ^ k), k = 0..n-1."""
    return _hash32(ops.bitwise_xor(key, ops.convert_to_tensor(np.arange(n, dtype=np.uint32))))


def _stable_argsort(keys):
    """The stable ascending argsort of a small 1-D tensor, as int32, by counting (uint32
    keys compare as they are: no int64, no backend's sort with its own tie rule)."""
    n = int(keys.shape[0])
    idx = np.arange(n, dtype=np.int32)
    ki, kj = ops.expand_dims(keys, 1), ops.expand_dims(keys, 0)
    earlier = ops.convert_to_tensor(idx[None, :] < idx[:, None])
    before = ops.logical_or(
        ops.less(kj, ki), ops.logical_and(ops.equal(kj, ki), earlier)
    )  # [i, j]: j sorts before i
    rank = ops.sum(ops.cast(before, "int32"), axis=1)
    places = ops.cast(ops.equal(ops.expand_dims(rank, 0), idx[:, None]), "int32")
    return ops.sum(places * idx[None, :], axis=1)


def random_order(num_tasks, seed, step):
    """A permutation of range(num_tasks) (int32), a pure function of (seed, step).

    Each task gets the key hash(hash(hash(seed) ^ step_low) ^ step_high ^ task) (a
    32-bit integer hash, in uint32 arithmetic) and the tasks are sorted by key (ties by
    task index). Integer arithmetic only, so eager, graph, XLA, JAX's jit and a resumed
    run draw the same order on both backends (TensorFlow's stateless RNG ops do not:
    measured, `stateless_uniform` with a seed read from a variable gives other numbers
    under XLA). `step` may be a python int or an int32 / int64 tensor (the same order for
    the same step below 2^31).

    Example:
      >>> from tf_metaalign.algorithms import gradient_surgery as GS
      >>> [np.asarray(GS.random_order(4, seed=0, step=s)).tolist() for s in range(3)]
      [[0, 3, 1, 2], [0, 2, 1, 3], [1, 0, 3, 2]]
    """
    key = _step_key(_hash32(_uint32(seed)), step)
    return _stable_argsort(_hash_keys(key, num_tasks))


def _scalar(value, dtype):
    """A python number as an exact `dtype` constant (a cast of a python float would
    round it through float32 first); tensors are cast (`functional.scalar`)."""
    return F.scalar(value, dtype)


def _one_hot(j, T, dtype):
    return ops.one_hot(j, T, dtype=dtype)


def _check_order(order, T, where):
    if isinstance(order, (list, tuple, np.ndarray)):
        order = np.asarray(order).astype(np.int32)
    order = ops.cast(ops.convert_to_tensor(order), "int32")
    if len(order.shape) != 1 or order.shape[0] != T:
        raise ValueError(
            f"{where}: `order` must be a permutation of range({T}); got shape {tuple(order.shape)}."
        )
    return order


# ------------------------------------------------------------------------- PCGrad


def pcgrad_coefficients(gram, order):
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

    Example:
      >>> from tf_metaalign.algorithms import gradient_surgery as GS
      >>> gram = np.array([[1.0, -0.5], [-0.5, 1.0]])  # two conflicting unit gradients
      >>> np.asarray(GS.pcgrad_coefficients(gram, [0, 1])).tolist()
      [1.5, 1.5]
    """
    gram = ops.convert_to_tensor(gram)
    T = int(gram.shape[0])
    order = _check_order(order, T, "pcgrad_coefficients")
    dtype = _dtype(gram)
    rows = []
    for i in range(T):
        a = _one_hot(i, T, dtype)
        for k in range(T):
            j = order[k]
            g_j = ops.take(gram, j, axis=1)  # <g_m, g_j> for every m
            inner = ops.sum(a * g_j)
            coef = ops.divide_no_nan(inner, ops.take(g_j, j))
            apply = ops.logical_and(ops.not_equal(j, i), ops.less(inner, 0.0))
            a = a - ops.where(apply, coef, ops.zeros_like(coef)) * _one_hot(j, T, dtype)
        rows.append(a)
    return ops.sum(ops.stack(rows), axis=0)


def pcgrad(task_grads, order) -> list:
    """The PCGrad update direction `sum_i g_i^PC` (see `pcgrad_coefficients`)."""
    return combine(task_grads, pcgrad_coefficients(gram_matrix(task_grads), order))


# ------------------------------------------------------------------------- GradVac


class GradVacResult(NamedTuple):
    coefficients: object  # [T]: combined = sum_j c_j g_j
    targets: object  # [T, T]: the updated EMA targets phi_hat_ij


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
    keeps its target. The targets are computed in the Gram matrix's dtype.
    """
    gram = ops.convert_to_tensor(gram)
    T = int(gram.shape[0])
    order = _check_order(order, T, "gradvac_coefficients")
    dtype = _dtype(gram)
    targets = ops.cast(ops.convert_to_tensor(targets), dtype)
    if tuple(targets.shape) != (T, T):
        raise ValueError(
            f"gradvac_coefficients: `targets` must have shape [{T}, {T}]; got "
            f"{tuple(targets.shape)}."
        )
    beta = _scalar(beta, dtype)
    norms = ops.sqrt(ops.maximum(ops.diagonal(gram), 0.0))
    rows, new_targets = [], []
    for i in range(T):
        a = _one_hot(i, T, dtype)
        target_row = targets[i]
        for k in range(T):
            j = order[k]
            g_j = ops.take(gram, j, axis=1)
            norm_j = ops.take(norms, j)
            norm_i = ops.sqrt(ops.maximum(ops.sum(a * matvec(gram, a)), 0.0))
            phi = ops.divide_no_nan(ops.sum(a * g_j), norm_i * norm_j)
            phi_hat = ops.take(target_row, j)
            valid = ops.logical_and(
                ops.not_equal(j, i),
                ops.logical_and(ops.greater(norm_i, 0.0), ops.greater(norm_j, 0.0)),
            )
            root_hat = ops.sqrt(ops.maximum(1.0 - phi_hat * phi_hat, 0.0))
            root = ops.sqrt(ops.maximum(1.0 - phi * phi, 0.0))
            w = ops.divide_no_nan(norm_i * (phi_hat * root - phi * root_hat), norm_j * root_hat)
            adjust = ops.logical_and(valid, ops.less(phi, phi_hat))
            a = a + ops.where(adjust, w, ops.zeros_like(w)) * _one_hot(j, T, dtype)
            updated = (1.0 - beta) * phi_hat + beta * phi
            target_row = target_row + ops.where(
                valid, updated - phi_hat, ops.zeros_like(phi_hat)
            ) * _one_hot(j, T, dtype)
        rows.append(a)
        new_targets.append(target_row)
    return GradVacResult(ops.sum(ops.stack(rows), axis=0), ops.stack(new_targets))


# ------------------------------------------------------------------------- GradNorm


def gradnorm_update(
    weights, layer_norms, losses, initial_losses, present=None, alpha=1.5, learning_rate=0.025
):
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
    renormalised so that the weights sum to T (in the weights' dtype).
    """
    weights = ops.convert_to_tensor(weights)
    dtype = _dtype(weights)
    T = int(weights.shape[0])

    def cast(v):
        # Numbers and python lists converted in `dtype` directly (not via float32).
        if isinstance(v, (int, float, np.integer, np.floating)):
            return _scalar(v, dtype)
        return ops.cast(_vector(v, dtype), dtype)

    layer_norms, losses, initial_losses = cast(layer_norms), cast(losses), cast(initial_losses)
    present = ops.ones((T,), dtype) if present is None else cast(present)
    n_present = ops.sum(present)
    G = weights * layer_norms
    G_bar = ops.divide_no_nan(ops.sum(present * G), n_present)
    ratio = ops.divide_no_nan(losses, initial_losses)
    mean_ratio = ops.divide_no_nan(ops.sum(present * ratio), n_present)
    r = ops.divide_no_nan(ratio, mean_ratio)
    target = ops.stop_gradient(G_bar * ops.power(r, cast(alpha)))
    grad = present * ops.sign(G - target) * layer_norms
    new = weights - cast(learning_rate) * grad
    return new * ops.divide_no_nan(_scalar(T, dtype), ops.sum(new))


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
