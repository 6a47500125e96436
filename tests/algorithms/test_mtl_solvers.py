"""The multi-objective methods of the multi-task engine (MGDA, CAGrad, IMTL) and their
in-graph solvers, against NumPy re-derivations of LibMTL's `weighting/{MGDA,CAGrad,IMTL}.py`
(torch-free ports below), closed forms (T = 2, orthogonal gradients), and brute-force
solutions (face enumeration of the simplex, dense grids, scipy's SLSQP as LibMTL calls
it), in float64, T = 2, 3, 5, with and without an absent task; each combine under
XLA giving the eager numbers."""

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.algorithms.multitask import base, solvers
from tf_metaalign.algorithms.multitask.cagrad import CAGrad
from tf_metaalign.algorithms.multitask.imtl import IMTL, imtl_g_weights
from tf_metaalign.algorithms.multitask.mgda import MGDA

from mtl_oracles import (  # NumPy re-derivations of the references, shared with
    # the backend-neutral tests (test_multitask_methods_backends.py)
    np_libmtl_mgda,
    np_enumerate_dual,
    np_libmtl_cagrad,
    np_cagrad_exact_w,
    np_libmtl_imtl,
)

TASKS = (2, 3, 5)
SEEDS = (0, 1, 2)
ABSENT = (None, 1)


# ---------------------------------------------------------------- helpers


def make_grads(num_tasks, seed, dim=12, absent=None):
    """Random task gradients with conflicts: a shared component of random sign and size
    plus task-specific noise of different scales; an absent task's row is 0."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=dim)
    g = (
        rng.normal(size=(num_tasks, dim)) * rng.uniform(0.2, 3.0, size=(num_tasks, 1))
        + rng.uniform(-1.0, 1.5, size=(num_tasks, 1)) * shared
    )
    losses = rng.uniform(0.2, 2.0, size=num_tasks)
    present = np.ones(num_tasks)
    if absent is not None:
        g[absent] = 0.0
        losses[absent] = 0.0
        present[absent] = 0.0
    return g, losses, present


def resolved(c):
    specific = c.shared if c.specific is None else c.specific
    weights = specific if c.loss_weights is None else c.loss_weights
    return c.shared, specific, weights, dict(c.state), dict(c.state_gradients)


def task_inputs(gram, losses, present):
    """The solvers' inputs at step 0, epoch 0, seed 0."""
    return base.TaskInputs(
        losses=losses,
        present=present,
        step=tf.constant(0, tf.int64),
        epoch=tf.constant(0, tf.int64),
        seed=0,
        gram=gram,
    )


_RUNNERS = {}


def combine(method, g, losses, present, state=None, jit=False):
    """method.combine on float64 inputs built from the gradient rows g; numpy outputs.
    jit=None: eager; False: a graph (tf.function, traced once per method and shape: the
    solvers' while loops are slow eagerly); True: XLA."""
    state = {k: tf.constant(v, tf.float64) for k, v in (state or {}).items()}
    gram = tf.constant(g @ g.T, tf.float64)

    def run(gram, losses, present, state):
        return resolved(method.combine(task_inputs(gram, losses, present), state))

    if jit is not None:
        key = (method, jit)
        if key not in _RUNNERS:
            _RUNNERS[key] = tf.function(run, jit_compile=jit)
        run = _RUNNERS[key]
    out = run(gram, tf.constant(losses, tf.float64), tf.constant(present, tf.float64), state)
    return tuple(
        x.numpy() if isinstance(x, tf.Tensor) else {k: v.numpy() for k, v in x.items()} for x in out
    )


def graph(fn, *args):
    """fn(*args) in a tf.function, numpy outputs."""
    out = tf.function(fn)(*args)
    return tuple(x.numpy() for x in out) if isinstance(out, tuple) else out.numpy()


def on_present(fn, g, present, *args):
    """Run a LibMTL port on the present tasks' rows only; its per-task outputs are put
    back at their positions (0 for absent tasks)."""
    idx = np.nonzero(present > 0)[0]
    return fn(g[idx], *[a[idx] if isinstance(a, np.ndarray) else a for a in args]), idx


# ---------------------------------------------------------------- LibMTL MGDA (NumPy)


# ---------------------------------------------------------------- brute force


def simplex_grid(steps):
    """Every point of the 2-simplex with coordinates in multiples of 1/steps."""
    pts = [
        (i / steps, j / steps, (steps - i - j) / steps)
        for i in range(steps + 1)
        for j in range(steps + 1 - i)
    ]
    return np.array(pts)


# ================================================================ MGDA


@pytest.mark.parametrize("normalization", ["none", "l2", "loss", "loss+"])
@pytest.mark.parametrize("absent", ABSENT)
@pytest.mark.parametrize("num_tasks", TASKS)
def test_mgda_matches_libmtl(num_tasks, absent, normalization):
    """The combined shared gradient == LibMTL's MGDA (NumPy port, exact segment end
    points), on the present tasks; absent tasks get coefficient 0."""
    method = MGDA(normalization=normalization)
    for seed in SEEDS:
        g, losses, present = make_grads(num_tasks, seed, absent=absent)
        shared, specific, weights, _, _ = combine(method, g, losses, present)
        (expected, sol), idx = on_present(
            lambda gg, ll: np_libmtl_mgda(gg, ll, normalization), g, present, losses
        )
        # rounding over up to 250 iterations: 1e-9 of the largest component
        np.testing.assert_allclose(
            shared @ g, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max()
        )
        assert np.all(shared[present == 0] == 0.0)
        np.testing.assert_array_equal(specific, np.ones(num_tasks))
        np.testing.assert_array_equal(weights, np.ones(num_tasks))


def test_mgda_libmtl_end_points_differ_by_at_most_1e_3():
    """Where LibMTL returns 0.999 / 0.001 at a segment's end point the weights differ by
    0.001 (the documented difference); elsewhere they agree."""
    g = np.array([[1.0, 0.0], [3.0, 1.0]])  # <g1, g2> = 3 >= |g1|^2: the min is g1
    shared, _, _, _, _ = combine(MGDA(), g, np.ones(2), np.ones(2))
    np.testing.assert_array_equal(shared, [1.0, 0.0])
    _, sol = np_libmtl_mgda(g, np.ones(2), "none", ends=(0.999, 0.001))
    np.testing.assert_allclose(sol, [0.999, 0.001], rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", range(6))
def test_mgda_two_tasks_closed_form(seed):
    """T = 2: the min-norm point of the segment [g1, g2]:
    gamma = clip(<g2 - g1, g2> / |g1 - g2|^2, 0, 1)."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(2, 7)) * rng.uniform(0.1, 3.0, size=(2, 1))
    if seed % 3 == 0:  # an end point is the minimum
        g[1] = 2.5 * g[0] + 0.1 * rng.normal(size=7)
    d = g[0] - g[1]
    gamma = np.clip((g[1] - g[0]) @ g[1] / (d @ d), 0.0, 1.0)
    shared, _, _, _, _ = combine(MGDA(), g, np.ones(2), np.ones(2))
    np.testing.assert_allclose(shared, [gamma, 1 - gamma], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("num_tasks", TASKS)
def test_mgda_orthogonal_equal_norm_gives_equal_weights(num_tasks):
    g = 1.7 * np.linalg.qr(np.random.default_rng(num_tasks).normal(size=(8, num_tasks)))[0].T
    shared, _, _, _, _ = combine(
        MGDA(max_iter=1000, stop_crit=0.0), g, np.ones(num_tasks), np.ones(num_tasks)
    )
    np.testing.assert_allclose(shared, np.full(num_tasks, 1.0 / num_tasks), atol=1e-10)
    # orthogonal, unequal norms: w_t proportional to 1 / |g_t|^2
    scales = np.arange(1.0, num_tasks + 1.0)
    shared, _, _, _, _ = combine(
        MGDA(max_iter=1000, stop_crit=0.0),
        g * scales[:, None],
        np.ones(num_tasks),
        np.ones(num_tasks),
    )
    inv = 1.0 / (1.7 * scales) ** 2
    np.testing.assert_allclose(shared, inv / inv.sum(), atol=1e-10)


@pytest.mark.parametrize("num_tasks", (3, 5))
def test_mgda_solver_matches_brute_force(num_tasks):
    """T >= 3: the in-graph solver against the exact min-norm point (face enumeration):
    with LibMTL's defaults the min norm is reached to 1e-6 relative; run to convergence
    (stop_crit=0, 2000 iterations) the weights agree to 1e-7. T = 3 also against a dense
    grid of the simplex (no grid point has a smaller norm)."""
    for seed in SEEDS:
        g, _, present = make_grads(num_tasks, seed + 10, dim=4 if seed == 2 else 12)
        gram = g @ g.T
        exact = np_enumerate_dual(gram, np.zeros(num_tasks), 1.0)
        best = exact @ gram @ exact
        w = graph(solvers.min_norm_weights, tf.constant(gram), present)
        assert abs(w.sum() - 1.0) < 1e-12 and w.min() >= 0.0
        assert best - 1e-12 <= w @ gram @ w <= best * (1 + 1e-6) + 1e-12
        w = graph(
            lambda gr, p: solvers.min_norm_weights(gr, p, 2000, 0.0), tf.constant(gram), present
        )
        np.testing.assert_allclose(w, exact, atol=1e-7)
        if num_tasks == 3:
            grid = simplex_grid(300)
            norms = np.einsum("ni,ij,nj->n", grid, gram, grid)
            assert w @ gram @ w <= norms.min() + 1e-12


def test_mgda_weights_on_any_gram_for_mgda_ub():
    """`min_norm_weights` works on any Gram matrix (the representation's for MGDA-UB)
    and returns LibMTL's `sol` (applied unscaled to the representation gradients)."""
    rng = np.random.default_rng(3)
    rep = rng.normal(size=(4, 9))
    losses = rng.uniform(0.5, 2.0, size=4)
    for gn in ("none", "l2", "loss", "loss+"):
        w = graph(
            MGDA(normalization=gn).min_norm_weights, tf.constant(rep @ rep.T), losses, np.ones(4)
        )
        _, sol = np_libmtl_mgda(rep, losses, gn)
        np.testing.assert_allclose(w, sol, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_tasks", (3, 5))
def test_mgda_xla_matches_eager(num_tasks):
    for gn in ("none", "loss+"):
        g, losses, present = make_grads(num_tasks, 4, absent=1)
        eager = combine(MGDA(normalization=gn), g, losses, present, jit=None)[0]
        xla = combine(MGDA(normalization=gn), g, losses, present, jit=True)[0]
        np.testing.assert_allclose(xla, eager, rtol=1e-12, atol=1e-14)


def test_mgda_degenerate_inputs():
    """One present task: its gradient; none: zeros; a present zero gradient: MGDA's
    answer 0 (Pareto-stationary), never NaN, also under "l2"."""
    g, losses, _ = make_grads(3, 0)
    present = np.array([0.0, 1.0, 0.0])
    shared = combine(MGDA(), g * present[:, None], losses * present, present)[0]
    np.testing.assert_array_equal(shared, [0.0, 1.0, 0.0])
    shared = combine(MGDA(), g * 0.0, losses * 0.0, np.zeros(3))[0]
    np.testing.assert_array_equal(shared, np.zeros(3))
    g[2] = 0.0
    for gn in ("none", "l2"):
        shared = combine(MGDA(normalization=gn), g, losses, np.ones(3))[0]
        assert np.all(np.isfinite(shared))
        np.testing.assert_allclose(shared @ g, 0.0, atol=1e-12)


def test_mgda_arguments_are_checked():
    with pytest.raises(ValueError, match="`normalization`.*'l1'"):
        MGDA(normalization="l1")
    with pytest.raises(ValueError, match="`max_iter`"):
        MGDA(max_iter=-1)
    with pytest.raises(ValueError, match="`stop_crit`"):
        MGDA(stop_crit=-1e-3)
    assert base.get_method("mgda", normalization="l2") == MGDA(normalization="l2")


# ================================================================ CAGrad


@pytest.mark.parametrize("rescale", [0, 1, 2])
@pytest.mark.parametrize("absent", ABSENT)
@pytest.mark.parametrize("num_tasks", TASKS)
def test_cagrad_matches_libmtl(num_tasks, absent, rescale):
    """The combined gradient == LibMTL's formula on the exact dual solution (NumPy face
    enumeration) to 1e-9, and == LibMTL with its own SLSQP solve to 1e-4 (SLSQP's
    tolerance), whose dual objective is never below ours."""
    method = CAGrad(rescale=rescale)
    for seed in SEEDS:
        g, losses, present = make_grads(num_tasks, seed, absent=absent)
        shared, specific, _, _, _ = combine(method, g, losses, present)
        np.testing.assert_array_equal(specific, np.ones(num_tasks))
        assert np.all(shared[present == 0] == 0.0)
        idx = np.nonzero(present)[0]
        sub = g[idx]
        exact, _ = np_libmtl_cagrad(sub, rescale=rescale, w=np_cagrad_exact_w(sub))
        np.testing.assert_allclose(shared @ g, exact, rtol=1e-9, atol=1e-11)
        slsqp, w_slsqp = np_libmtl_cagrad(sub, rescale=rescale)
        np.testing.assert_allclose(shared @ g, slsqp, rtol=1e-4, atol=1e-4 * np.abs(slsqp).max())


def _dual(w, gram, c):
    T = gram.shape[0]
    return w @ gram @ np.full(T, 1.0 / T) + c * np.sqrt(w @ gram @ w + 1e-8)


@pytest.mark.parametrize("calpha", [0.1, 0.5, 0.9, 2.0])
def test_cagrad_dual_solver_vs_brute_force(calpha):
    """The exact in-graph dual solver: == the NumPy face enumeration (1e-8) for T = 2,
    3, 5 including rank-deficient Gram matrices and a near-cancelling pair; T = 3: no
    point of a 300-step grid of the simplex has a smaller dual objective; never above
    SLSQP's."""
    from scipy.optimize import minimize

    method = CAGrad(calpha=calpha, solver="exact")
    for num_tasks in TASKS:
        for seed in SEEDS:
            g, _, present = make_grads(num_tasks, seed + 20, dim=3 if seed == 1 else 12)
            if seed == 2:
                g[1] = -0.8 * g[0] + 0.01 * np.random.default_rng(seed).normal(size=g.shape[1])
            gram = g @ g.T
            w, c = graph(method.dual_weights, tf.constant(gram), present)
            c = float(c)
            exact = np_cagrad_exact_w(g, calpha)
            np.testing.assert_allclose(w, exact, atol=1e-8)
            assert abs(w.sum() - 1) < 1e-12 and w.min() >= 0
            res = minimize(
                lambda x: _dual(x, gram, c),
                np.full(num_tasks, 1 / num_tasks),
                bounds=[(0, 1)] * num_tasks,
                constraints=({"type": "eq", "fun": lambda x: 1 - sum(x)},),
            )
            assert _dual(w, gram, c) <= _dual(res.x, gram, c) + 1e-12
            if num_tasks == 3:
                grid = simplex_grid(300)
                values = grid @ gram @ np.full(3, 1 / 3) + c * np.sqrt(
                    np.einsum("ni,ij,nj->n", grid, gram, grid) + 1e-8
                )
                assert _dual(w, gram, c) <= values.min() + 1e-12


def test_cagrad_pgd_solver_close_to_exact():
    """The many-task solver (pgd) against the exact one: dual objective within 1e-7
    relative after 500 steps on T = 3, 5, 8 random gradients; T = 9 with a conflicting
    pair: 1e-9, g_w to 1e-5."""
    for num_tasks in (3, 5, 8):
        for seed in SEEDS[:2]:
            g, _, present = make_grads(num_tasks, seed + 30)
            gram = tf.constant(g @ g.T)
            w_e, c = graph(CAGrad(solver="exact").dual_weights, gram, present)
            w_p, _ = graph(CAGrad(solver="pgd").dual_weights, gram, present)
            f_e, f_p = _dual(w_e, g @ g.T, float(c)), _dual(w_p, g @ g.T, float(c))
            assert f_e <= f_p + 1e-12
            assert f_p - f_e <= 1e-7 * abs(f_e) + 1e-12
    # T = 9 (past "auto"'s exact range) with a near-cancelling pair: against the NumPy
    # enumeration (which drops LibMTL's 1e-8 under the root: pgd may be below it)
    g, _, present = make_grads(9, 33, dim=20)
    g[1] = -0.7 * g[0] + 0.01 * np.random.default_rng(0).normal(size=20)
    gram = g @ g.T
    w_p, c = graph(CAGrad(solver="pgd").dual_weights, tf.constant(gram), present)
    w_e = np_cagrad_exact_w(g)
    f_e, f_p = _dual(w_e, gram, float(c)), _dual(w_p, gram, float(c))
    assert abs(f_p - f_e) <= 1e-9 * abs(f_e)
    np.testing.assert_allclose(w_p @ g, w_e @ g, rtol=0, atol=1e-5 * np.linalg.norm(w_e @ g))


def test_cagrad_special_cases():
    """calpha = 0: the average gradient (lambda w ~ 1e-8); T = 2 orthogonal equal-norm
    gradients: w = (1/2, 1/2) by symmetry, d = (1 + calpha) g0 / r."""
    g, losses, present = make_grads(3, 5)
    shared = combine(CAGrad(calpha=0.0, rescale=0), g, losses, present)[0]
    np.testing.assert_allclose(shared, np.full(3, 1 / 3), atol=1e-7)
    g = np.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    shared = combine(CAGrad(calpha=0.5, rescale=0), g, np.ones(2), np.ones(2))[0]
    g0n = np.sqrt(2.0 + 1e-8)
    c = 0.5 * g0n + 1e-8
    lam = c / (np.sqrt(2.0) + 1e-8)
    np.testing.assert_allclose(shared, np.full(2, 0.5 + lam * 0.5), rtol=1e-12)


@pytest.mark.parametrize("solver", ["exact", "pgd"])
def test_cagrad_xla_matches_eager(solver):
    g, losses, present = make_grads(5, 6, absent=1)
    method = CAGrad(solver=solver, iterations=60)
    eager = combine(method, g, losses, present, jit=None)[0]
    xla = combine(method, g, losses, present, jit=True)[0]
    np.testing.assert_allclose(xla, eager, rtol=1e-10, atol=1e-12)


def test_cagrad_arguments_are_checked():
    with pytest.raises(ValueError, match="`calpha`"):
        CAGrad(calpha=-0.1)
    with pytest.raises(ValueError, match="`rescale`"):
        CAGrad(rescale=3)
    with pytest.raises(ValueError, match="`solver`"):
        CAGrad(solver="slsqp")
    with pytest.raises(ValueError, match="`iterations`"):
        CAGrad(iterations=0)
    assert base.get_method("cagrad", calpha=0.4) == CAGrad(calpha=0.4)


# ================================================================ IMTL


@pytest.mark.parametrize("absent", ABSENT)
@pytest.mark.parametrize("num_tasks", TASKS)
def test_imtl_matches_libmtl_over_three_steps(num_tasks, absent):
    """The combined gradient, task-specific factors and the loss scales' gradient ==
    LibMTL's IMTL, over 3 steps in which both sides train s by SGD (lr 0.3) with it."""
    method = IMTL()
    assert method.state_spec(num_tasks)["loss_scale"].trainable
    for seed in SEEDS:
        s = np.zeros(num_tasks)
        for step in range(3):
            g, losses, present = make_grads(num_tasks, 100 * seed + step, absent=absent)
            shared, specific, weights, state, grads = combine(
                method, g, losses, present, {"loss_scale": s}
            )
            assert state == {}
            idx = np.nonzero(present)[0]
            new, alpha, scale, grad_s = np_libmtl_imtl(g[idx], losses[idx], s[idx])
            np.testing.assert_allclose(shared @ g, new, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(shared[idx], alpha * scale, rtol=1e-10, atol=1e-12)
            assert np.all(shared[present == 0] == 0.0)
            np.testing.assert_allclose(specific, np.exp(s), rtol=1e-15)
            np.testing.assert_allclose(weights, np.exp(s), rtol=1e-15)
            np.testing.assert_allclose(grads["loss_scale"][idx], grad_s, rtol=1e-14)
            assert np.all(grads["loss_scale"][present == 0] == 0.0)
            s = s - 0.3 * grads["loss_scale"]
        assert np.any(s != 0.0)


@pytest.mark.parametrize("num_tasks", TASKS)
def test_imtl_g_equal_projections_and_closed_form(num_tasks):
    """IMTL-G's defining property: the combined gradient has the same projection on every
    task's unit gradient; orthogonal gradients: alpha_t proportional to 1 / |g_t|."""
    for seed in SEEDS:
        g, _, present = make_grads(num_tasks, seed + 40)
        alpha = imtl_g_weights(tf.constant(g @ g.T)).numpy()
        d = alpha @ g
        proj = g @ d / np.linalg.norm(g, axis=1)
        np.testing.assert_allclose(proj, proj[0], rtol=1e-10)
        assert abs(alpha.sum() - 1) < 1e-12
    q = np.linalg.qr(np.random.default_rng(num_tasks).normal(size=(9, num_tasks)))[0].T
    norms = np.arange(1.0, num_tasks + 1.0) * 0.7
    alpha = imtl_g_weights(tf.constant((q * norms[:, None]) @ (q * norms[:, None]).T)).numpy()
    np.testing.assert_allclose(alpha, (1 / norms) / (1 / norms).sum(), rtol=1e-12)


def test_imtl_without_scales_and_degenerate_inputs():
    """learn_scales=False: IMTL-G alone, no state; more tasks than gradient dimensions
    (LibMTL's inverse fails): equal weights over the tasks, finite, also under XLA; one
    present task: its gradient."""
    g, losses, present = make_grads(3, 7)
    method = IMTL(learn_scales=False)
    assert method.state_spec(3) == {}
    shared, specific, _, _, grads = combine(method, g, losses, present)
    _, alpha, _, _ = np_libmtl_imtl(g, losses, np.zeros(3))
    np.testing.assert_allclose(shared, alpha, rtol=1e-10)
    np.testing.assert_array_equal(specific, np.ones(3))
    assert grads == {}
    g, losses, present = make_grads(5, 8, dim=3)
    for jit in (False, True):
        shared = combine(method, g, losses, present, jit=jit)[0]
        np.testing.assert_allclose(shared, np.full(5, 0.2), rtol=1e-15)
    present = np.array([0.0, 0.0, 1.0, 0.0, 0.0])
    shared = combine(method, g * present[:, None], losses * present, present)[0]
    np.testing.assert_array_equal(shared, present)


@pytest.mark.parametrize("num_tasks", (2, 5))
def test_imtl_xla_matches_eager(num_tasks):
    g, losses, present = make_grads(num_tasks, 9, absent=1 if num_tasks > 2 else None)
    state = {"loss_scale": np.linspace(-0.3, 0.4, num_tasks)}
    eager = combine(IMTL(), g, losses, present, state, jit=None)
    xla = combine(IMTL(), g, losses, present, state, jit=True)
    for a, b in zip(eager[:3], xla[:3]):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(xla[4]["loss_scale"], eager[4]["loss_scale"], rtol=1e-14)


def test_imtl_arguments_are_checked():
    with pytest.raises(ValueError, match="`learn_scales`"):
        IMTL(learn_scales=1)
    assert base.get_method("imtl", learn_scales=False) == IMTL(learn_scales=False)


@pytest.mark.parametrize("num_tasks", (5,))
def test_float32_inputs_agree_with_float64_under_xla(num_tasks):
    """float32 losses and Gram matrix (a float32 model), float64 state: the same
    coefficients as float64 to 1e-4 of the largest, under XLA."""
    g, losses, present = make_grads(num_tasks, 11, dim=30, absent=1)
    for method in (MGDA(normalization="l2"), CAGrad(), IMTL()):
        state = {
            k: tf.constant(np.full(spec.shape, 0.1), tf.float64)
            for k, spec in method.state_spec(num_tasks).items()
        }
        out = {}
        for dtype in (tf.float32, tf.float64):

            @tf.function(jit_compile=True)
            def run(gram, losses, present):
                c = method.combine(task_inputs(gram, losses, present), state)
                return c.shared, dict(c.state_gradients)

            shared, grads = run(
                tf.constant(g @ g.T, dtype), tf.constant(losses, dtype), tf.constant(present, dtype)
            )
            assert shared.dtype == dtype
            for key, value in grads.items():
                assert value.dtype == tf.float64, key
            out[dtype] = shared.numpy()
        np.testing.assert_allclose(
            out[tf.float32], out[tf.float64], rtol=0, atol=1e-4 * np.abs(out[tf.float64]).max()
        )
