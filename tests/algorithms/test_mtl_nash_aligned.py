"""Nash-MTL and Aligned-MTL on the multi-task method engine, against NumPy re-derivations
of the references (LibMTL `Nash_MTL` / AvivNavon/nash-mtl, LibMTL `Aligned_MTL` /
SamsungLabs/MTL `ProcrustesSolver`), closed forms and brute-force solutions.

Oracles in float64 with tight tolerances; every combine also under XLA (== eager)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.algorithms.multitask import base
from tf_metaalign.algorithms.multitask import aligned_mtl as AM
from tf_metaalign.algorithms.multitask import nash as NM

from test_mtl_weighting import _trainer_data  # the weighting tests' conflicting tasks

from mtl_oracles import (  # NumPy re-derivations of the references, shared with
    # the backend-neutral tests (test_multitask_methods_backends.py)
    coordinate_descent_nash,
    libmtl_nash_numpy,
    libmtl_aligned_numpy,
    official_procrustes_numpy,
)


def inputs_from(G, present=None, step=0, losses=None):
    """TaskInputs for task gradients G [T, D] (rows of absent tasks are zeroed)."""
    T = G.shape[0]
    present = np.ones(T) if present is None else np.asarray(present, np.float64)
    G = G * present[:, None]
    losses = np.abs(np.arange(1, T + 1, dtype=np.float64)) if losses is None else losses
    return base.TaskInputs(
        losses=tf.constant(losses * present),
        present=tf.constant(present),
        step=tf.constant(step, tf.int64),
        epoch=tf.constant(0, tf.int64),
        seed=3,
        gram=tf.constant(G @ G.T),
        task_grads=[[tf.constant(g)] for g in G],
        shared_variables=[],
    )


def xla_combine(method):
    """`method.combine` under tf.function(jit_compile=True) (tensors in, TaskInputs
    rebuilt inside): one compiled function per method, called with several inputs."""

    @tf.function(jit_compile=True)
    def run(losses, present, step, gram, state):
        out = method.combine(
            base.TaskInputs(
                losses=losses,
                present=present,
                step=step,
                epoch=tf.constant(0, tf.int64),
                seed=3,
                gram=gram,
            ),
            state,
        )
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}

    def call(inputs, state):
        return base.Combination(
            **run(inputs.losses, inputs.present, inputs.step, inputs.gram, state)
        )

    return call


def random_grads(rng, T, D=12, conflict=True):
    G = rng.normal(size=(T, D))
    if conflict:  # a common direction with random signs: negative cosines too
        G += rng.uniform(-1.5, 1.5, size=(T, 1)) * rng.normal(size=D)
    return G * 10.0 ** rng.uniform(-1, 1, size=(T, 1))


CASES = [(T, seed, absent) for T in (2, 3, 5) for seed in (0, 1, 2) for absent in (None, 1)]


def present_of(T, absent):
    p = np.ones(T)
    if absent is not None:
        p[absent] = 0.0
    return p


# ------------------------------------------------------------------ Nash-MTL oracles


def combined(G, coefficients):
    return G.T @ np.asarray(coefficients)


@pytest.mark.parametrize("T,seed,absent", CASES)
def test_nash_matches_numpy_libmtl(T, seed, absent):
    rng = np.random.default_rng(100 + seed)
    G = random_grads(rng, T)
    present = present_of(T, absent)
    G = G * present[:, None]
    method = NM.NashMTL()
    out = method.combine(inputs_from(G, present), {"prev_alpha": tf.ones([T], tf.float64)})
    alpha, shared = libmtl_nash_numpy(G, present)
    np.testing.assert_allclose(out.specific.numpy(), alpha, rtol=1e-11, atol=0)
    np.testing.assert_allclose(out.loss_weights.numpy(), alpha, rtol=1e-11, atol=0)
    np.testing.assert_allclose(combined(G, out.shared.numpy()), shared, rtol=1e-10, atol=1e-13)
    # the solved alpha satisfies M alpha = 1/alpha on the present tasks
    idx = np.flatnonzero(present)
    M = G[idx] @ G[idx].T
    a = out.specific.numpy()[idx]
    np.testing.assert_allclose(a * (M @ a), 1.0, rtol=1e-12)
    if absent is not None:
        assert out.shared.numpy()[absent] == 0.0 and out.specific.numpy()[absent] == 0.0
    # clip: at the solution alpha^T M alpha = T, so the shared gradient has norm ~1
    np.testing.assert_allclose(
        np.linalg.norm(combined(G, out.shared.numpy())),
        np.sqrt(len(idx)) / (np.sqrt(len(idx)) + 1e-6),
        rtol=1e-12,
    )


@pytest.mark.parametrize("T", [2, 3, 5, 8])
def test_nash_solver_matches_coordinate_descent(T):
    rng = np.random.default_rng(T)
    for _ in range(3):
        G = random_grads(rng, T, D=T + 2)
        M = G @ G.T
        alpha, residual = NM.nash_bargaining_weights(tf.constant(M), tf.ones([T], tf.float64))
        brute = coordinate_descent_nash(M)
        np.testing.assert_allclose(alpha.numpy(), brute, rtol=1e-10)
        assert residual.numpy() < 1e-12
        # the residual of the stationarity M alpha - 1/alpha, relative to 1/alpha
        a = alpha.numpy()
        assert np.max(np.abs(M @ a - 1.0 / a) * a) < 1e-12


def test_nash_diagonal_closed_form_and_scale():
    # orthogonal gradients: M diagonal, alpha_i = 1/sqrt(M_ii) = 1/||g_i||
    norms = np.array([0.01, 1.0, 30.0, 4.0])
    G = np.diag(norms) @ np.eye(4, 6)
    out = NM.NashMTL(max_norm=0.0).combine(inputs_from(G), {"prev_alpha": tf.ones([4], tf.float64)})
    np.testing.assert_allclose(out.specific.numpy(), 1.0 / norms, rtol=1e-14)
    np.testing.assert_allclose(out.shared.numpy(), 1.0 / norms, rtol=1e-14)  # no clip
    # scaling all gradients by c scales alpha by 1/c (M by c^2)
    G = random_grads(np.random.default_rng(7), 3)
    a1, _ = NM.nash_bargaining_weights(tf.constant(G @ G.T), tf.ones([3], tf.float64))
    a2, _ = NM.nash_bargaining_weights(tf.constant(1e6 * G @ G.T), tf.ones([3], tf.float64))
    np.testing.assert_allclose(a2.numpy() * 1e3, a1.numpy(), rtol=1e-12)


def test_nash_hard_problems_converge():
    """Condition numbers up to ~1e11, gradient norms over 6 decades, cosines to -0.95:
    20 Newton steps reach |alpha_i (M alpha)_i - 1| < 1e-12 (worst measured 2.4e-13)."""
    rng = np.random.default_rng(11)
    worst = 0.0
    fn = NM.nash_bargaining_weights
    for _ in range(40):
        T = int(rng.integers(2, 9))
        D = int(rng.integers(T, 3 * T + 1))
        G = rng.normal(size=(T, D)) + rng.uniform(-2, 2, size=(T, 1)) * rng.normal(size=D)
        G *= 10.0 ** rng.uniform(-3, 3, size=(T, 1))
        _, residual = fn(tf.constant(G @ G.T), tf.ones([T], tf.float64))
        worst = max(worst, float(residual))
    assert worst < 1e-12, worst


def test_nash_opposite_gradients_stay_finite():
    # g2 = -g1: no bargaining solution (f unbounded); alpha grows but stays finite and
    # the clipped shared gradient has norm <= max_norm; a zero-gradient task is left out.
    g = np.array([[1.0, 2.0, 0.0], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    out = NM.NashMTL().combine(inputs_from(g), {"prev_alpha": tf.ones([3], tf.float64)})
    assert np.all(np.isfinite(out.shared.numpy())) and np.all(np.isfinite(out.specific))
    assert np.linalg.norm(combined(g, out.shared.numpy())) <= 1.0
    assert out.specific.numpy()[2] == 0.0
    for dtype in (tf.float32, tf.float64):
        alpha, _ = NM.nash_bargaining_weights(tf.constant(g @ g.T, dtype), tf.ones([3], dtype))
        assert np.all(np.isfinite(alpha.numpy())) and np.all(alpha.numpy()[:2] > 0)
    # all absent: zeros, no NaN
    out = NM.NashMTL().combine(
        inputs_from(g, present=[0, 0, 0]), {"prev_alpha": tf.ones([3], tf.float64)}
    )
    np.testing.assert_array_equal(out.shared.numpy(), 0.0)


def test_nash_update_every_state_over_steps():
    """update_weights_every=3: solve at steps 0 and 3, reuse prev_alpha at 1, 2, 4, 5
    (clip on the current gradients every step, as LibMTL); a task absent at an update
    step keeps its previous alpha in the state (and gets 0 now)."""
    T = 3
    rng = np.random.default_rng(5)
    method = NM.NashMTL(update_weights_every=3)
    state = {k: tf.ones(s.shape, tf.float64) for k, s in method.state_spec(T).items()}
    ref_prev = np.ones(T)
    for step in range(6):
        G = random_grads(rng, T)
        present = np.ones(T) if step != 3 else np.array([1.0, 0.0, 1.0])
        G = G * present[:, None]
        out = method.combine(inputs_from(G, present, step=step), state)
        if step % 3 == 0:
            alpha, _ = libmtl_nash_numpy(G, present)
            ref_prev = np.where(present > 0, alpha, ref_prev)
        else:
            alpha = ref_prev * present
        shared = combined(G, alpha)
        shared = shared * min(1.0, 1.0 / (np.linalg.norm(shared) + 1e-6))
        np.testing.assert_allclose(out.specific.numpy(), alpha, rtol=1e-11)
        np.testing.assert_allclose(combined(G, out.shared.numpy()), shared, rtol=1e-10)
        np.testing.assert_allclose(out.state["prev_alpha"].numpy(), ref_prev, rtol=1e-11)
        state = dict(out.state)
    assert ref_prev[1] != 1.0  # solved at step 0, kept through the absent update at 3


def test_nash_xla_equals_eager():
    G = random_grads(np.random.default_rng(9), 4)
    present = np.array([1.0, 1.0, 0.0, 1.0])
    for method in (NM.NashMTL(), NM.NashMTL(update_weights_every=2, max_norm=0.5)):
        compiled = xla_combine(method)
        state = {"prev_alpha": tf.constant([0.5, 2.0, 3.0, 1.5], tf.float64)}
        for step in (0, 1):
            inputs = inputs_from(G, present, step=step)
            eager = method.combine(inputs, state)
            xla = compiled(inputs, state)
            for a, b in (
                (eager.shared, xla.shared),
                (eager.specific, xla.specific),
                (eager.state["prev_alpha"], xla.state["prev_alpha"]),
            ):
                np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-12, atol=1e-300)


def test_nash_float32():
    G = random_grads(np.random.default_rng(4), 3).astype(np.float32)
    T = 3
    inputs = base.TaskInputs(
        losses=tf.ones([T]),
        present=tf.ones([T]),
        step=tf.constant(0, tf.int64),
        epoch=tf.constant(0, tf.int64),
        seed=0,
        gram=tf.constant(G @ G.T),
    )
    out = NM.NashMTL().combine(inputs, {"prev_alpha": tf.ones([T], tf.float64)})
    assert out.shared.dtype == tf.float32 and out.state["prev_alpha"].dtype == tf.float64
    alpha, _ = libmtl_nash_numpy(G.astype(np.float64), np.ones(T))
    np.testing.assert_allclose(out.specific.numpy(), alpha, rtol=2e-5)


def test_nash_against_cvxpy_reference():
    """LibMTL's own CCP (cvxpy + ECOS), when those are installed: equal to ~1e-6 where
    the CCP ends at the bargaining point (all its constraints active)."""
    cp = pytest.importorskip("cvxpy")
    pytest.importorskip("ecos")  # the reference's solver (not bundled with cvxpy >= 1.6)
    rng = np.random.default_rng(0)
    checked = 0
    for T in (2, 3, 5):
        for _ in range(3):
            G = rng.normal(size=(T, 20)) * rng.uniform(0.1, 3, size=(T, 1))
            M = G @ G.T
            nf = np.linalg.norm(M)
            a = cp.Variable(T, nonneg=True)
            prev = cp.Parameter(T)
            Gp = cp.Parameter((T, T))
            tag = 1 / prev + (1 / (Gp @ prev)) @ Gp
            phi = tag @ (a - prev)
            Ga = Gp @ a
            cons = [-cp.log(a[i] * nf) - cp.log(Ga[i]) <= 0 for i in range(T)]
            prob = cp.Problem(cp.Minimize(cp.sum(Ga) + phi / nf), cons)
            Gp.value = M / nf
            alpha = np.ones(T)
            for _ in range(20):
                a.value, prev.value = alpha, alpha
                prob.solve(solver=cp.ECOS, warm_start=True, max_iters=100)
                done = (
                    np.linalg.norm(M / nf @ alpha - 1 / (alpha + 1e-10)) < 1e-3
                    or np.linalg.norm(a.value - alpha) < 1e-6
                )
                if done:
                    break
                alpha = a.value
            ours, _ = NM.nash_bargaining_weights(tf.constant(M), tf.ones([T], tf.float64))
            if np.max(np.abs(alpha * (M @ alpha) - 1)) < 1e-4:  # CCP at the bargaining point
                np.testing.assert_allclose(ours.numpy(), alpha, rtol=1e-5)
                checked += 1
    assert checked >= 6


def test_nash_bad_arguments():
    with pytest.raises(ValueError, match="update_weights_every"):
        NM.NashMTL(update_weights_every=0)
    with pytest.raises(ValueError, match="optim_niter"):
        NM.NashMTL(optim_niter=2.5)
    with pytest.raises(ValueError, match="max_norm"):
        NM.NashMTL(max_norm=-1.0)
    m = base.get_method("nash_mtl", update_weights_every=2)
    assert m == NM.NashMTL(update_weights_every=2)
    assert base.get_method(base.serialize_method(m)) == m
    assert base.get_method("nashmtl").kind == "loss"


# ------------------------------------------------------------------ Aligned-MTL oracles


def aligned_reference(G, present, fn=libmtl_aligned_numpy):
    idx = np.flatnonzero(present)
    alpha = np.zeros(len(G))
    alpha[idx] = fn(G[idx])
    return alpha


@pytest.mark.parametrize("T,seed,absent", CASES)
def test_aligned_matches_numpy_libmtl(T, seed, absent):
    rng = np.random.default_rng(200 + seed)
    G = random_grads(rng, T)
    present = present_of(T, absent)
    G = G * present[:, None]
    out = AM.AlignedMTL().combine(inputs_from(G, present), {})
    alpha = aligned_reference(G, present)
    np.testing.assert_allclose(out.shared.numpy(), alpha, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(combined(G, out.shared.numpy()), combined(G, alpha), rtol=1e-10)
    np.testing.assert_array_equal(out.specific.numpy(), np.ones(T))
    if absent is not None:
        assert out.shared.numpy()[absent] == 0.0


@pytest.mark.parametrize("scale_mode", ["min", "median", "rmse"])
@pytest.mark.parametrize("T", [2, 3, 4, 5])
def test_aligned_matches_official_procrustes(scale_mode, T):
    rng = np.random.default_rng(T)
    G = random_grads(rng, T)
    out = AM.AlignedMTL(scale_mode=scale_mode).combine(inputs_from(G), {})
    grad, weights = official_procrustes_numpy(G, scale_mode)
    np.testing.assert_allclose(out.shared.numpy(), weights, rtol=1e-10)
    np.testing.assert_allclose(combined(G, out.shared.numpy()), grad, rtol=1e-10)


def test_aligned_rank_deficient():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(3, 10))
    cases = [
        np.stack([g[0], g[1], g[0] + 2.0 * g[1]]),  # rank 2 of 3
        np.stack([g[0], g[0], g[1]]),  # duplicated task
        np.stack([g[0], 3.0 * g[0], -g[0]]),  # rank 1
        np.stack([g[0], g[1], g[2], g[0] - g[1]])[:, :3],
    ]  # 4 tasks in 3-D
    for G in cases:
        for mode in AM.SCALE_MODES:
            out = AM.AlignedMTL(scale_mode=mode).combine(inputs_from(G), {}).shared.numpy()
            grad, weights = official_procrustes_numpy(G, mode)
            np.testing.assert_allclose(combined(G, out), grad, rtol=1e-9, atol=1e-12)
        out = AM.AlignedMTL().combine(inputs_from(G), {}).shared.numpy()
        np.testing.assert_allclose(
            combined(G, out),
            combined(G, aligned_reference(G, np.ones(len(G)))),
            rtol=1e-9,
            atol=1e-12,
        )
    # all gradients zero: nothing to align
    out = AM.AlignedMTL().combine(inputs_from(np.zeros((3, 4))), {}).shared.numpy()
    np.testing.assert_array_equal(out, 0.0)


def test_aligned_closed_forms():
    # orthogonal gradients: B = sqrt(l_min) diag(1/||g_i||), alpha_i = min||g|| / ||g_i||
    norms = np.array([2.0, 0.5, 8.0])
    G = np.diag(norms) @ np.eye(3, 5)
    out = AM.AlignedMTL().combine(inputs_from(G), {}).shared.numpy()
    np.testing.assert_allclose(out, 0.5 / norms, rtol=1e-14)
    # equal norms: equal weights 1 (B = I)
    out = AM.AlignedMTL().combine(inputs_from(np.eye(3, 5) * 3.0), {}).shared.numpy()
    np.testing.assert_allclose(out, 1.0, rtol=1e-14)
    # the aligned gradients G^T B are orthogonal with equal squared norm l_min
    G = random_grads(np.random.default_rng(8), 4)
    M = G @ G.T
    lam, V = np.linalg.eigh(M)
    B = np.sqrt(lam[0]) * V @ np.diag(lam**-0.5) @ V.T
    aligned = G.T @ B
    np.testing.assert_allclose(aligned.T @ aligned, lam[0] * np.eye(4), atol=1e-10 * lam[0])
    out = AM.AlignedMTL().combine(inputs_from(G), {}).shared.numpy()
    np.testing.assert_allclose(out, B.sum(0), rtol=1e-11)


def test_aligned_xla_equals_eager():
    rng = np.random.default_rng(12)
    G = random_grads(rng, 4)
    G_def = np.stack([G[0], G[1], G[0] + G[1], G[3]])
    for mode in ("min", "median"):
        method = AM.AlignedMTL(scale_mode=mode)
        compiled = xla_combine(method)
        for g, present in ((G, [1, 0, 1, 1]), (G_def, [1, 1, 1, 1])):
            inputs = inputs_from(g, present)
            np.testing.assert_allclose(
                compiled(inputs, {}).shared.numpy(),
                method.combine(inputs, {}).shared.numpy(),
                rtol=1e-11,
                atol=1e-14,
            )


def test_aligned_bad_arguments():
    with pytest.raises(ValueError, match="scale_mode"):
        AM.AlignedMTL(scale_mode="max")
    m = base.get_method("amtl", scale_mode="rmse")
    assert m == AM.AlignedMTL(scale_mode="rmse")
    assert base.get_method(base.serialize_method(m)) == m
    assert m.kind == "gradient" and m.uses_gradients


# ---------------------------------------------------------------- through the trainer


def _numpy_step_weights(method, G, present, step, prev):
    if isinstance(method, NM.NashMTL):
        if step % method.update_weights_every == 0:
            alpha, shared = libmtl_nash_numpy(G, present, method.max_norm)
            prev = np.where(present > 0, alpha, prev)
        else:
            alpha = prev * present
            shared = G.T @ alpha
            shared = shared * min(1.0, method.max_norm / (np.linalg.norm(shared) + 1e-6))
        return shared, prev
    return G.T @ aligned_reference(G, present), prev


@pytest.mark.parametrize(
    "method", [NM.NashMTL(update_weights_every=2), AM.AlignedMTL()], ids=["nash_mtl", "aligned_mtl"]
)
def test_multitask_trainer_equals_numpy_reference(float64, method):
    """MultiTaskTrainer(method=<object>) with SGD on a linear model (all variables shared)
    == the NumPy loop: per-task mean-MSE gradients of the batch, the method's combined
    gradient (LibMTL re-derivations above), SGD; 2 epochs of 3 batches of 8; Nash's
    prev_alpha state too."""
    import keras
    from tf_metaalign.trainers import MultiTaskTrainer

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
    )
    x, y, task = _trainer_data(24)
    lr = 0.1
    trainer = MultiTaskTrainer(model, num_tasks=3, method=method, seed=0)
    W, b = [v.numpy().copy() for v in model.trainable_variables]
    W0 = W
    trainer.compile(optimizer=keras.optimizers.SGD(lr), loss=keras.losses.MeanSquaredError())
    trainer.fit({"inputs": x, "task_id": task}, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    prev, step = np.ones(3), 0
    for _ in range(2):
        for i in range(0, 24, 8):
            X, Y, t = x[i : i + 8], y[i : i + 8], task[i : i + 8]
            grads = []
            for k in range(3):
                R = X[t == k] @ W + b - Y[t == k]
                grads.append(2.0 * np.concatenate([(X[t == k].T @ R).ravel(), R.sum(0)]) / R.size)
            shared, prev = _numpy_step_weights(method, np.stack(grads), np.ones(3), step, prev)
            W = W - lr * shared[:8].reshape(4, 2)
            b = b - lr * shared[8:]
            step += 1
    assert np.abs(W - W0).max() > 0.05
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), W, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), b, rtol=1e-11, atol=1e-13)
    if isinstance(method, NM.NashMTL):
        np.testing.assert_allclose(trainer.method_state["prev_alpha"].numpy(), prev, rtol=1e-11)


@pytest.mark.parametrize(
    "method", [NM.NashMTL(update_weights_every=2), AM.AlignedMTL()], ids=["nash_mtl", "aligned_mtl"]
)
def test_two_replicas_equal_one(float64, method):
    """Global Gram matrix on every replica: 2 replicas take the steps 1 replica takes."""
    import keras
    from conftest import two_cpu_strategy
    from tf_metaalign.trainers import MultiTaskTrainer

    x, y, task = _trainer_data(24)

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [keras.Input((4,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
            )
            trainer = MultiTaskTrainer(model, num_tasks=3, method=method, seed=2)
            trainer.compile(
                optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.MeanSquaredError()
            )
        trainer.fit(
            {"inputs": x, "task_id": task}, y, batch_size=8, epochs=2, shuffle=False, verbose=0
        )
        state = {k: v.numpy() for k, v in trainer.method_state.items()}
        return [v.numpy() for v in model.trainable_variables], state

    one, state1 = run(tf.distribute.get_strategy())
    two, state2 = run(two_cpu_strategy())
    for a, b in zip(one + list(state1.values()), two + list(state2.values())):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_docstring_examples():
    import doctest

    for module in (NM, AM):
        result = doctest.testmod(
            module, extraglobs={"NashMTL": NM.NashMTL, "AlignedMTL": AM.AlignedMTL}
        )
        assert result.attempted >= 1 and result.failed == 0, module.__name__
