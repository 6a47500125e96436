"""In-graph solvers on the simplex for the multi-objective methods (MGDA, CAGrad).

Everything here works on the T x T Gram matrix G_ij = <g_i, g_j> and a `present` mask
(absent tasks are left out of the simplex: their weight is 0), with static shapes and
loop bounds, so it runs inside one compiled train step (graph mode and XLA) and gives
the same numbers on every replica for the same inputs.

  * `min_norm_weights`: LibMTL's / the official MGDA `MinNormSolver.find_min_norm_element`
    (Sener & Koltun 2018): the best pair by the closed form on a segment, then (T >= 3)
    projected-gradient steps with an exact line search on the segment between the
    iterate and the new point, until the L1 change is below `stop_crit` or `max_iter`
    steps, in a `keras.ops.while_loop` with an early-stop flag.
  * `cagrad_weights`: the CAGrad dual  min_w  w^T G b + c ||g_w||  over the simplex,
    solved exactly by enumerating the faces of the simplex (closed form of the minimiser
    in each face's affine hull, feasibility check, best feasible objective), or by
    majorise-minimise projected gradient (`cagrad_weights_pgd`) for many tasks.
  * `project_to_simplex`: LibMTL's `_projection2simplex` (Euclidean projection).
"""

from __future__ import annotations

import itertools

import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from tf_metaalign.algorithms.gradient_surgery import matvec
from tf_metaalign.algorithms.multitask.base import scalar


def _dtype(x) -> str:
    return standardize_dtype(x.dtype)


def _present_mask(present, dtype):
    return ops.cast(ops.greater(ops.convert_to_tensor(present), 0), dtype)


def _first_true(cond):
    """Index of the first True entry of a 1-D bool tensor (len(cond) if none):
    deterministic, unlike argmin/argmax on ties."""
    n = int(cond.shape[0])
    idx = ops.arange(n, dtype="int32")
    return ops.min(ops.where(cond, idx, ops.full((n,), n, dtype="int32")))


def _first_min(values, valid):
    """Index of the first minimum of `values` over the `valid` entries (LibMTL's strict
    `if d < dmin` scan keeps the first of equal minima)."""
    v = ops.where(valid, values, ops.full_like(values, np.inf))
    return _first_true(ops.logical_and(valid, ops.equal(v, ops.min(v))))


def segment_min_norm(v11, v12, v22):
    """Min-norm point of the segment [x1, x2] from v11 = |x1|^2, v12 = <x1, x2>,
    v22 = |x2|^2: (gamma, cost) with gamma x1 + (1 - gamma) x2 the point and cost its
    squared norm. LibMTL's `_min_norm_element_from2` with exact end points: it returns
    gamma = 0.999 / 0.001 (cost v11 / v22) where the minimum is at x1 / x2; here 1 / 0."""
    one = ops.ones_like(v11)
    zero = ops.zeros_like(v11)
    denom = v11 + v22 - 2.0 * v12
    safe = ops.where(ops.greater(denom, 0), denom, one)
    gamma_mid = (v22 - v12) / safe
    at_1 = ops.greater_equal(v12, v11)
    at_2 = ops.logical_and(ops.logical_not(at_1), ops.greater_equal(v12, v22))
    gamma = ops.where(at_1, one, ops.where(at_2, zero, gamma_mid))
    cost = ops.where(at_1, v11, ops.where(at_2, v22, v22 + gamma_mid * (v12 - v22)))
    return gamma, cost


def project_to_simplex(y, present=None):
    """Euclidean projection of y onto the simplex of the present tasks (absent entries 0):
    LibMTL's `_projection2simplex` (sort descending, the first i with
    (sum_{k<=i} s_k - 1) / (i + 1) > s_{i+1} gives the threshold, else (sum y - 1) / m)."""
    y = ops.convert_to_tensor(y)
    dtype = _dtype(y)
    T = int(y.shape[0])
    mask = ops.ones_like(y) if present is None else _present_mask(present, dtype)
    on = ops.greater(mask, 0)
    m = ops.sum(ops.cast(on, "int32"))
    low = ops.min(ops.where(on, y, ops.full_like(y, np.inf))) - scalar(1.0, dtype)
    low = ops.where(ops.greater(m, 0), low, ops.zeros_like(low))
    s = ops.flip(ops.sort(ops.where(on, y, low)), axis=0)  # descending
    k = ops.arange(T, dtype="int32")
    tmax = (ops.cumsum(s) - scalar(1.0, dtype)) / ops.cast(k + 1, dtype)
    s_next = ops.concatenate([s[1:], low[None]], axis=0)
    cond = ops.logical_or(
        ops.logical_and(ops.less(k, m - 1), ops.greater(tmax, s_next)), ops.equal(k, m - 1)
    )
    kk = ops.minimum(_first_true(cond), T - 1)
    # a gather, not tmax[kk]: a strided slice at a tensor index is a compile-time
    # constant for XLA, which would recompile the step for every new kk
    threshold = ops.take(tmax, kk)
    return ops.where(on, ops.maximum(y - threshold, ops.zeros_like(y)), ops.zeros_like(y))


def _next_point(cur, grad, mask, n):
    """LibMTL's `_next_point`: a step along the projected gradient to the simplex's
    boundary (the smallest positive step length > 1e-7 at which a coordinate hits 0 or 1;
    1 if there is none), projected back onto the simplex."""
    dtype = _dtype(cur)
    proj = (grad - ops.sum(grad * mask) / n) * mask
    neg, pos = ops.less(proj, 0), ops.greater(proj, 0)
    one = ops.ones_like(proj)
    tm1 = -cur / ops.where(neg, proj, one)
    tm2 = (one - cur) / ops.where(pos, proj, one)
    eps = scalar(1e-7, dtype)
    ok1 = ops.logical_and(neg, ops.greater(tm1, eps))
    ok2 = ops.logical_and(pos, ops.greater(tm2, eps))
    inf = ops.full_like(proj, np.inf)
    min1 = ops.min(ops.where(ok1, tm1, inf))
    min2 = ops.min(ops.where(ok2, tm2, inf))
    t = ops.where(ops.any(ok1), min1, scalar(1.0, dtype))
    t = ops.where(ops.any(ok2), ops.minimum(t, min2), t)
    return project_to_simplex(proj * t + cur, mask)


def min_norm_weights(gram, present=None, max_iter: int = 250, stop_crit: float = 1e-5):
    """The weights w on the simplex (of the present tasks) of the min-norm element
    sum_t w_t g_t of the convex hull of the task gradients, from their Gram matrix
    (LibMTL `MGDA._find_min_norm_element`, the official `MinNormSolver`).

    T = 2 (or 2 present tasks): the exact min-norm point of the segment. T >= 3: start
    from the best pair; then up to `max_iter` LibMTL steps (`_next_point`, then the exact
    line search between the iterate and the new point); it stops (returning the iterate
    before the step, as LibMTL does) when the step's L1 change is < `stop_crit`.
    """
    gram = ops.convert_to_tensor(gram)
    dtype = _dtype(gram)
    T = int(gram.shape[0])
    mask = ops.ones((T,), dtype) if present is None else _present_mask(present, dtype)
    num = ops.sum(mask)
    if T == 1:
        return mask
    diag = ops.diagonal(gram)
    pairs = [(i, j) for i in range(T) for j in range(i + 1, T)]
    pi_np = np.array([p[0] for p in pairs], np.int32)
    pj_np = np.array([p[1] for p in pairs], np.int32)
    pi, pj = ops.convert_to_tensor(pi_np), ops.convert_to_tensor(pj_np)
    off_diagonal = ops.take(ops.reshape(gram, (-1,)), ops.convert_to_tensor(pi_np * T + pj_np))
    gamma, cost = segment_min_norm(ops.take(diag, pi), off_diagonal, ops.take(diag, pj))
    valid = ops.logical_and(ops.greater(ops.take(mask, pi), 0), ops.greater(ops.take(mask, pj), 0))
    best = ops.minimum(_first_min(cost, valid), len(pairs) - 1)
    g = ops.take(gamma, best)
    sol = g * ops.one_hot(ops.take(pi, best), T, dtype=dtype) + (1.0 - g) * ops.one_hot(
        ops.take(pj, best), T, dtype=dtype
    )
    # fewer than two present tasks: the single present task (or nothing)
    sol = ops.where(ops.greater_equal(num, 2), sol, mask)
    if T == 2:
        return sol
    stop = scalar(stop_crit, dtype)
    n = ops.maximum(num, scalar(1.0, dtype))

    def body(i, done, sol):
        grad_dir = -matvec(gram, sol)
        new = _next_point(sol, grad_dir, mask, n)
        gs = matvec(gram, sol)
        gn = matvec(gram, new)
        nc, _ = segment_min_norm(ops.sum(sol * gs), ops.sum(sol * gn), ops.sum(new * gn))
        new_sol = nc * sol + (1.0 - nc) * new
        small = ops.less(ops.sum(ops.abs(new_sol - sol)), stop)
        return i + 1, small, ops.where(small, sol, new_sol)

    def cond(i, done, sol):
        return ops.logical_and(ops.less(i, max_iter), ops.logical_not(done))

    start_done = ops.less(num, 3)
    _, _, sol = ops.while_loop(
        cond,
        body,
        (ops.convert_to_tensor(0, "int32"), start_done, sol),
        maximum_iterations=max_iter,
    )
    return sol


# ------------------------------------------------------------------------- CAGrad


def _faces(T):
    """All non-empty subsets of range(T) as a [2^T - 1, T] 0/1 matrix, and the first
    member of each."""
    rows, first = [], []
    for k in range(1, T + 1):
        for subset in itertools.combinations(range(T), k):
            row = np.zeros(T)
            row[list(subset)] = 1.0
            rows.append(row)
            first.append(subset[0])
    return np.array(rows), np.array(first, np.int32)


def cagrad_objective(w, gram, gb, c):
    """LibMTL's CAGrad dual objective  w^T G b + c sqrt(w^T G w + 1e-8)."""
    dtype = _dtype(gram)
    quad = ops.sum(w * matvec(gram, w), axis=-1)
    return ops.sum(w * gb, axis=-1) + c * ops.sqrt(
        ops.maximum(quad, ops.zeros_like(quad)) + scalar(1e-8, dtype)
    )


def cagrad_weights(gram, gb, c, present=None):
    """argmin over the simplex (of the present tasks) of  w . gb + c ||g_w||  with
    ||g_w||^2 = w^T G w (CAGrad's dual: gb = G b, b the average's weights), exactly.

    Face enumeration: the minimiser lies in the relative interior of some face S of the
    simplex; in S's affine hull, writing g_w = p0 + P (with p0 the hull's min-norm point
    and P a vector of its direction space), the stationary point is
    P = -(|g_w| / c) Pi(a)  (a = sum_t b_t g_t, Pi the projection on the direction space),
    |g_w| = |p0| / sqrt(1 - |Pi(a)|^2 / c^2), which exists iff |Pi(a)| < c. Every face is
    solved at once on the Gram matrix (pseudo-inverses by `eigh`), the candidates with
    non-negative weights (to sqrt(eps)) are clipped onto the simplex and the one with the
    smallest objective (`cagrad_objective`, LibMTL's, with its 1e-8) is returned. The
    returned point is always feasible, so rounding can only pick a slightly worse face,
    never a point below the optimum. Cost: 2^T - 1 eigen-decompositions of T x T.
    """
    gram = ops.convert_to_tensor(gram)
    dtype = _dtype(gram)
    T = int(gram.shape[0])
    gb = ops.cast(gb, dtype)
    c = ops.cast(c, dtype)
    mask = ops.ones((T,), dtype) if present is None else _present_mask(present, dtype)
    faces_np, first_np = _faces(T)
    faces = ops.convert_to_tensor(faces_np.astype(dtype))
    first = ops.convert_to_tensor(first_np)
    e0 = ops.one_hot(first, T, dtype=dtype)  # [F, T]
    rest = faces - e0  # [F, T]
    g0 = ops.take(gram, first, axis=0)  # [F, T]  G[i0, :]
    g00 = ops.take(ops.diagonal(gram), first)  # [F]
    m = gram[None] - g0[:, :, None] - g0[:, None, :] + g00[:, None, None]
    m = m * rest[:, :, None] * rest[:, None, :]
    r = (g0 - g00[:, None]) * rest
    q = (gb[None] - ops.take(gb, first)[:, None]) * rest
    lam, vec = ops.linalg.eigh(m)
    eps = np.finfo(dtype).eps
    top = ops.max(ops.abs(lam), axis=-1, keepdims=True)
    keep = ops.greater(lam, scalar(100.0 * T * eps, dtype) * top)
    inv = ops.where(keep, 1.0 / ops.where(keep, lam, ops.ones_like(lam)), ops.zeros_like(lam))

    def pinv(x):  # M^+ x, batched
        return matvec(vec, inv * matvec(vec, x, transpose_a=True))

    mr, mq = pinv(r), pinv(q)
    p2 = ops.maximum(g00 - ops.sum(r * mr, -1), ops.zeros_like(g00))
    s2 = ops.sum(q * mq, -1) / (c * c)
    one = ops.ones_like(s2)
    nu = ops.sqrt(p2 / ops.where(ops.less(s2, 1.0), one - s2, one))
    z = (-mr - (nu / c)[:, None] * mq) * rest
    w = z + e0 * (1.0 - ops.sum(z, -1))[:, None]
    tol = scalar(float(np.sqrt(eps)), dtype)
    inside = ops.all(ops.logical_or(ops.less_equal(faces, 0), ops.greater(mask[None], 0)), axis=-1)
    valid = ops.logical_and(
        ops.logical_and(inside, ops.less(s2, 1.0)), ops.greater_equal(ops.min(w, -1), -tol)
    )
    wc = ops.maximum(w, ops.zeros_like(w))
    wc = wc / ops.maximum(ops.sum(wc, -1, keepdims=True), ops.full((1, 1), tol, dtype=dtype))
    values = cagrad_objective(wc, gram, gb, c)
    best = ops.minimum(_first_min(values, valid), int(faces_np.shape[0]) - 1)
    return ops.where(ops.any(valid), ops.take(wc, best, axis=0), ops.zeros((T,), dtype))


def cagrad_weights_pgd(gram, gb, c, present=None, iterations: int = 500):
    """The CAGrad dual by majorise-minimise projected gradient (for many tasks, where
    `cagrad_weights`'s 2^T faces are too many): from the uniform weights, `iterations`
    steps w <- Proj(y - rho/(c lambda_max(G)) grad f(y)) with rho = sqrt(y^T G y + 1e-8)
    (one gradient step on the quadratic majoriser of c sqrt(.) at y, so f never
    increases), with Nesterov momentum restarted whenever f would increase. Converges to
    ~1e-9 relative objective in a few hundred steps on well-separated gradients, slower
    when the optimum's g_w is near 0 (strongly conflicting tasks)."""
    gram = ops.convert_to_tensor(gram)
    dtype = _dtype(gram)
    T = int(gram.shape[0])
    gb = ops.cast(gb, dtype)
    c = ops.cast(c, dtype)
    mask = ops.ones((T,), dtype) if present is None else _present_mask(present, dtype)
    w0 = mask / ops.maximum(ops.sum(mask), scalar(1.0, dtype))
    lam = ops.maximum(ops.max(ops.linalg.eigh(gram)[0]), scalar(1e-30, dtype))
    eps8 = scalar(1e-8, dtype)

    def f(w):
        return cagrad_objective(w, gram, gb, c)

    def body(i, w, y, tk):
        gy = matvec(gram, y)
        rho = ops.sqrt(ops.maximum(ops.sum(y * gy), 0.0) + eps8)
        step = rho / (c * lam)
        wn = project_to_simplex(y - step * (gb + c * gy / rho), mask)
        worse = ops.greater(f(wn), f(w))
        tn = (1.0 + ops.sqrt(1.0 + 4.0 * tk * tk)) / 2.0
        y_next = ops.where(worse, w, wn + ((tk - 1.0) / tn) * (wn - w))
        return (i + 1, ops.where(worse, w, wn), y_next, ops.where(worse, scalar(1.0, dtype), tn))

    _, w, _, _ = ops.while_loop(
        lambda i, *_: ops.less(i, iterations),
        body,
        (ops.convert_to_tensor(0, "int32"), w0, w0, scalar(1.0, dtype)),
        maximum_iterations=iterations,
    )
    return w


# --------------------------------------------------------------------- linear solve


def solve_linear(a, b):
    """x with a x = b (a [T, T], b [T]) by Gaussian elimination with partial pivoting, in
    the graph (unrolled over T; a library solve or LU raises on a singular matrix
    outside XLA on TensorFlow). Returns (x, ok): ok is False where a pivot is below
    1e3 T eps max|a| (numerically singular); x is then finite but meaningless."""
    a = ops.convert_to_tensor(a)
    dtype = _dtype(a)
    T = int(a.shape[0])
    eps = np.finfo(dtype).eps
    tiny = scalar(1e3 * T * eps, dtype) * ops.max(ops.abs(a))
    aug = ops.concatenate([a, ops.cast(b, dtype)[:, None]], axis=1)  # [T, T + 1]
    ok = ops.convert_to_tensor(True)
    rows = ops.arange(T, dtype="int32")
    for k in range(T):
        col = ops.abs(aug[:, k])
        col = ops.where(ops.greater_equal(rows, k), col, -ops.ones_like(col))
        p = ops.cast(ops.argmax(col), "int32")
        perm = ops.where(ops.equal(rows, k), p, ops.where(ops.equal(rows, p), k, rows))
        aug = ops.take(aug, perm, axis=0)
        pivot = aug[k, k]
        big = ops.greater(ops.abs(pivot), tiny)
        ok = ops.logical_and(ok, big)
        safe = ops.where(big, pivot, ops.ones_like(pivot))
        factors = ops.where(ops.greater(rows, k), aug[:, k] / safe, ops.zeros_like(aug[:, k]))
        aug = aug - factors[:, None] * aug[k][None, :]
    x = [None] * T
    for k in reversed(range(T)):
        acc = aug[k, T]
        for j in range(k + 1, T):
            acc = acc - aug[k, j] * x[j]
        pivot = aug[k, k]
        x[k] = acc / ops.where(ops.greater(ops.abs(pivot), tiny), pivot, ops.ones_like(pivot))
    return ops.stack(x), ok
