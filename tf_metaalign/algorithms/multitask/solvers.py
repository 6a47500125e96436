"""In-graph solvers on the simplex for the multi-objective methods (MGDA, CAGrad).

Everything here works on the T x T Gram matrix G_ij = <g_i, g_j> and a `present` mask
(absent tasks are left out of the simplex: their weight is 0), with static shapes and
loop bounds, so it runs inside one compiled train step (graph mode and XLA) and gives
the same numbers on every replica for the same inputs.

  * `min_norm_weights`: LibMTL's / the official MGDA `MinNormSolver.find_min_norm_element`
    (Sener & Koltun 2018): the best pair by the closed form on a segment, then (T >= 3)
    projected-gradient steps with an exact line search on the segment between the
    iterate and the new point, until the L1 change is below `stop_crit` or `max_iter`
    steps, in a `tf.while_loop` with an early-stop flag.
  * `cagrad_weights`: the CAGrad dual  min_w  w^T G b + c ||g_w||  over the simplex,
    solved exactly by enumerating the faces of the simplex (closed form of the minimiser
    in each face's affine hull, feasibility check, best feasible objective), or by
    majorise-minimise projected gradient (`cagrad_weights_pgd`) for many tasks.
  * `project_to_simplex`: LibMTL's `_projection2simplex` (Euclidean projection).
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

from tf_metaalign.algorithms.multitask.base import scalar


def _present_mask(present, dtype):
    return tf.cast(tf.convert_to_tensor(present) > 0, dtype)


def _first_true(cond):
    """Index of the first True entry of a 1-D bool tensor (len(cond) if none):
    deterministic, unlike argmin/argmax on ties."""
    n = int(cond.shape[0])
    idx = tf.range(n, dtype=tf.int32)
    return tf.reduce_min(tf.where(cond, idx, tf.fill([n], tf.constant(n, tf.int32))))


def _first_min(values, valid):
    """Index of the first minimum of `values` over the `valid` entries (LibMTL's strict
    `if d < dmin` scan keeps the first of equal minima)."""
    big = tf.fill(tf.shape(values), tf.constant(np.inf, values.dtype))
    v = tf.where(valid, values, big)
    return _first_true(tf.logical_and(valid, tf.equal(v, tf.reduce_min(v))))


def segment_min_norm(v11, v12, v22):
    """Min-norm point of the segment [x1, x2] from v11 = |x1|^2, v12 = <x1, x2>,
    v22 = |x2|^2: (gamma, cost) with gamma x1 + (1 - gamma) x2 the point and cost its
    squared norm. LibMTL's `_min_norm_element_from2` with exact end points: it returns
    gamma = 0.999 / 0.001 (cost v11 / v22) where the minimum is at x1 / x2; here 1 / 0."""
    one = tf.ones_like(v11)
    zero = tf.zeros_like(v11)
    denom = v11 + v22 - 2.0 * v12
    safe = tf.where(denom > 0, denom, one)
    gamma_mid = (v22 - v12) / safe
    at_1 = v12 >= v11
    at_2 = tf.logical_and(tf.logical_not(at_1), v12 >= v22)
    gamma = tf.where(at_1, one, tf.where(at_2, zero, gamma_mid))
    cost = tf.where(at_1, v11, tf.where(at_2, v22, v22 + gamma_mid * (v12 - v22)))
    return gamma, cost


def project_to_simplex(y, present=None):
    """Euclidean projection of y onto the simplex of the present tasks (absent entries 0):
    LibMTL's `_projection2simplex` (sort descending, the first i with
    (sum_{k<=i} s_k - 1) / (i + 1) > s_{i+1} gives the threshold, else (sum y - 1) / m)."""
    y = tf.convert_to_tensor(y)
    dtype = y.dtype
    T = int(y.shape[0])
    mask = tf.ones_like(y) if present is None else _present_mask(present, dtype)
    on = mask > 0
    m = tf.reduce_sum(tf.cast(on, tf.int32))
    big = tf.fill([T], tf.constant(np.inf, dtype))
    low = tf.reduce_min(tf.where(on, y, big)) - scalar(1.0, dtype)
    low = tf.where(m > 0, low, tf.zeros_like(low))
    s = tf.sort(tf.where(on, y, tf.fill([T], low)), direction="DESCENDING")
    k = tf.range(T, dtype=tf.int32)
    tmax = (tf.cumsum(s) - scalar(1.0, dtype)) / tf.cast(k + 1, dtype)
    s_next = tf.concat([s[1:], low[None]], axis=0)
    cond = tf.logical_or(tf.logical_and(k < m - 1, tmax > s_next), tf.equal(k, m - 1))
    kk = tf.minimum(_first_true(cond), T - 1)
    # a gather, not tmax[kk]: a strided slice at a tensor index is a compile-time
    # constant for XLA, which would recompile the step for every new kk
    threshold = tf.gather(tmax, kk)
    return tf.where(on, tf.maximum(y - threshold, tf.zeros_like(y)), tf.zeros_like(y))


def _next_point(cur, grad, mask, n):
    """LibMTL's `_next_point`: a step along the projected gradient to the simplex's
    boundary (the smallest positive step length > 1e-7 at which a coordinate hits 0 or 1;
    1 if there is none), projected back onto the simplex."""
    dtype = cur.dtype
    proj = (grad - tf.reduce_sum(grad * mask) / n) * mask
    neg, pos = proj < 0, proj > 0
    one = tf.ones_like(proj)
    tm1 = -cur / tf.where(neg, proj, one)
    tm2 = (one - cur) / tf.where(pos, proj, one)
    eps = scalar(1e-7, dtype)
    ok1 = tf.logical_and(neg, tm1 > eps)
    ok2 = tf.logical_and(pos, tm2 > eps)
    inf = tf.fill(tf.shape(proj), tf.constant(np.inf, dtype))
    min1 = tf.reduce_min(tf.where(ok1, tm1, inf))
    min2 = tf.reduce_min(tf.where(ok2, tm2, inf))
    t = tf.where(tf.reduce_any(ok1), min1, scalar(1.0, dtype))
    t = tf.where(tf.reduce_any(ok2), tf.minimum(t, min2), t)
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
    gram = tf.convert_to_tensor(gram)
    dtype = gram.dtype
    T = int(gram.shape[0])
    mask = tf.ones([T], dtype) if present is None else _present_mask(present, dtype)
    num = tf.reduce_sum(mask)
    if T == 1:
        return mask
    diag = tf.linalg.diag_part(gram)
    pairs = [(i, j) for i in range(T) for j in range(i + 1, T)]
    pi = tf.constant([p[0] for p in pairs], tf.int32)
    pj = tf.constant([p[1] for p in pairs], tf.int32)
    gamma, cost = segment_min_norm(
        tf.gather(diag, pi), tf.gather_nd(gram, tf.stack([pi, pj], 1)), tf.gather(diag, pj)
    )
    valid = tf.logical_and(tf.gather(mask, pi) > 0, tf.gather(mask, pj) > 0)
    best = tf.minimum(_first_min(cost, valid), len(pairs) - 1)
    g = tf.gather(gamma, best)
    sol = g * tf.one_hot(tf.gather(pi, best), T, dtype=dtype) + (1.0 - g) * tf.one_hot(
        tf.gather(pj, best), T, dtype=dtype
    )
    # fewer than two present tasks: the single present task (or nothing)
    sol = tf.where(num >= 2, sol, mask)
    if T == 2:
        return sol
    stop = scalar(stop_crit, dtype)
    n = tf.maximum(num, scalar(1.0, dtype))

    def body(i, done, sol):
        grad_dir = -tf.linalg.matvec(gram, sol)
        new = _next_point(sol, grad_dir, mask, n)
        gs = tf.linalg.matvec(gram, sol)
        gn = tf.linalg.matvec(gram, new)
        nc, _ = segment_min_norm(
            tf.reduce_sum(sol * gs), tf.reduce_sum(sol * gn), tf.reduce_sum(new * gn)
        )
        new_sol = nc * sol + (1.0 - nc) * new
        small = tf.reduce_sum(tf.abs(new_sol - sol)) < stop
        return i + 1, small, tf.where(small, sol, new_sol)

    def cond(i, done, sol):
        return tf.logical_and(i < max_iter, tf.logical_not(done))

    start_done = num < 3
    _, _, sol = tf.while_loop(
        cond, body, (tf.constant(0, tf.int32), start_done, sol), maximum_iterations=max_iter
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
    dtype = gram.dtype
    quad = tf.reduce_sum(w * tf.linalg.matvec(gram, w), axis=-1)
    return tf.reduce_sum(w * gb, axis=-1) + c * tf.sqrt(
        tf.maximum(quad, tf.zeros_like(quad)) + scalar(1e-8, dtype)
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
    gram = tf.convert_to_tensor(gram)
    dtype = gram.dtype
    T = int(gram.shape[0])
    gb = tf.cast(gb, dtype)
    c = tf.cast(c, dtype)
    mask = tf.ones([T], dtype) if present is None else _present_mask(present, dtype)
    faces_np, first_np = _faces(T)
    faces = tf.constant(faces_np, dtype)
    first = tf.constant(first_np)
    e0 = tf.one_hot(first, T, dtype=dtype)  # [F, T]
    rest = faces - e0  # [F, T]
    g0 = tf.gather(gram, first)  # [F, T]  G[i0, :]
    g00 = tf.gather(tf.linalg.diag_part(gram), first)  # [F]
    m = gram[None] - g0[:, :, None] - g0[:, None, :] + g00[:, None, None]
    m = m * rest[:, :, None] * rest[:, None, :]
    r = (g0 - g00[:, None]) * rest
    q = (gb[None] - tf.gather(gb, first)[:, None]) * rest
    lam, vec = tf.linalg.eigh(m)
    eps = np.finfo(dtype.as_numpy_dtype).eps
    top = tf.reduce_max(tf.abs(lam), axis=-1, keepdims=True)
    keep = lam > scalar(100.0 * T * eps, dtype) * top
    inv = tf.where(keep, 1.0 / tf.where(keep, lam, tf.ones_like(lam)), tf.zeros_like(lam))

    def pinv(x):  # M^+ x, batched
        return tf.linalg.matvec(vec, inv * tf.linalg.matvec(vec, x, transpose_a=True))

    mr, mq = pinv(r), pinv(q)
    p2 = tf.maximum(g00 - tf.reduce_sum(r * mr, -1), tf.zeros_like(g00))
    s2 = tf.reduce_sum(q * mq, -1) / (c * c)
    one = tf.ones_like(s2)
    nu = tf.sqrt(p2 / tf.where(s2 < 1.0, one - s2, one))
    z = (-mr - (nu / c)[:, None] * mq) * rest
    w = z + e0 * (1.0 - tf.reduce_sum(z, -1))[:, None]
    tol = scalar(float(np.sqrt(eps)), dtype)
    inside = tf.reduce_all(tf.logical_or(faces <= 0, mask[None] > 0), axis=-1)
    valid = tf.logical_and(tf.logical_and(inside, s2 < 1.0), tf.reduce_min(w, -1) >= -tol)
    wc = tf.maximum(w, tf.zeros_like(w))
    wc = wc / tf.maximum(tf.reduce_sum(wc, -1, keepdims=True), tf.fill([1, 1], tol))
    values = cagrad_objective(wc, gram, gb, c)
    best = tf.minimum(_first_min(values, valid), int(faces_np.shape[0]) - 1)
    return tf.where(tf.reduce_any(valid), tf.gather(wc, best), tf.zeros([T], dtype))


def cagrad_weights_pgd(gram, gb, c, present=None, iterations: int = 500):
    """The CAGrad dual by majorise-minimise projected gradient (for many tasks, where
    `cagrad_weights`'s 2^T faces are too many): from the uniform weights, `iterations`
    steps w <- Proj(y - rho/(c lambda_max(G)) grad f(y)) with rho = sqrt(y^T G y + 1e-8)
    (one gradient step on the quadratic majoriser of c sqrt(.) at y, so f never
    increases), with Nesterov momentum restarted whenever f would increase. Converges to
    ~1e-9 relative objective in a few hundred steps on well-separated gradients, slower
    when the optimum's g_w is near 0 (strongly conflicting tasks)."""
    gram = tf.convert_to_tensor(gram)
    dtype = gram.dtype
    T = int(gram.shape[0])
    gb = tf.cast(gb, dtype)
    c = tf.cast(c, dtype)
    mask = tf.ones([T], dtype) if present is None else _present_mask(present, dtype)
    w0 = mask / tf.maximum(tf.reduce_sum(mask), scalar(1.0, dtype))
    lam = tf.maximum(tf.reduce_max(tf.linalg.eigvalsh(gram)), scalar(1e-30, dtype))
    eps8 = scalar(1e-8, dtype)

    def f(w):
        return cagrad_objective(w, gram, gb, c)

    def body(i, w, y, tk):
        gy = tf.linalg.matvec(gram, y)
        rho = tf.sqrt(tf.maximum(tf.reduce_sum(y * gy), 0.0) + eps8)
        step = rho / (c * lam)
        wn = project_to_simplex(y - step * (gb + c * gy / rho), mask)
        worse = f(wn) > f(w)
        tn = (1.0 + tf.sqrt(1.0 + 4.0 * tk * tk)) / 2.0
        y_next = tf.where(worse, w, wn + ((tk - 1.0) / tn) * (wn - w))
        return (i + 1, tf.where(worse, w, wn), y_next, tf.where(worse, scalar(1.0, dtype), tn))

    _, w, _, _ = tf.while_loop(
        lambda i, *_: i < iterations,
        body,
        (tf.constant(0, tf.int32), w0, w0, scalar(1.0, dtype)),
        maximum_iterations=iterations,
    )
    return w


# --------------------------------------------------------------------- linear solve


def solve_linear(a, b):
    """x with a x = b (a [T, T], b [T]) by Gaussian elimination with partial pivoting, in
    the graph (unrolled over T; `tf.linalg.solve` / `lu` raise on a singular matrix
    outside XLA). Returns (x, ok): ok is False where a pivot is below 1e3 T eps max|a|
    (numerically singular); x is then finite but meaningless."""
    a = tf.convert_to_tensor(a)
    dtype = a.dtype
    T = int(a.shape[0])
    eps = np.finfo(dtype.as_numpy_dtype).eps
    tiny = scalar(1e3 * T * eps, dtype) * tf.reduce_max(tf.abs(a))
    aug = tf.concat([a, tf.cast(b, dtype)[:, None]], axis=1)  # [T, T + 1]
    ok = tf.constant(True)
    rows = tf.range(T, dtype=tf.int32)
    for k in range(T):
        col = tf.abs(aug[:, k])
        col = tf.where(rows >= k, col, -tf.ones_like(col))
        p = tf.cast(tf.argmax(col), tf.int32)
        perm = tf.where(tf.equal(rows, k), p, tf.where(tf.equal(rows, p), k, rows))
        aug = tf.gather(aug, perm)
        pivot = aug[k, k]
        ok = tf.logical_and(ok, tf.abs(pivot) > tiny)
        safe = tf.where(tf.abs(pivot) > tiny, pivot, tf.ones_like(pivot))
        factors = tf.where(rows > k, aug[:, k] / safe, tf.zeros_like(aug[:, k]))
        aug = aug - factors[:, None] * aug[k][None, :]
    x = [None] * T
    for k in reversed(range(T)):
        acc = aug[k, T]
        for j in range(k + 1, T):
            acc = acc - aug[k, j] * x[j]
        pivot = aug[k, k]
        x[k] = acc / tf.where(tf.abs(pivot) > tiny, pivot, tf.ones_like(pivot))
    return tf.stack(x), ok
