"""The loss-weighting methods of the multi-task engine (UW, DWA, RLW, FAMO) against
NumPy re-derivations of their references (LibMTL's `weighting/<Name>.py`, the official
FAMO code), in float64, over several steps / epochs, with and without absent tasks, and
each combine under XLA giving the eager numbers."""

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.algorithms.multitask import base
from tf_metaalign.algorithms.multitask.dwa import DynamicWeightAverage
from tf_metaalign.algorithms.multitask.famo import FAMO
from tf_metaalign.algorithms.multitask.rlw import RandomLossWeighting
from tf_metaalign.algorithms.multitask.uw import UncertaintyWeighting

from mtl_oracles import (  # NumPy re-derivations of the references, shared with
    # the backend-neutral tests (test_multitask_methods_backends.py)
    LibMTLUW,
    libmtl_dwa,
    TorchAdam,
    ReferenceFAMO,
)

TIGHT = dict(rtol=1e-12, atol=1e-13)
TASKS = (2, 3, 5)


# ---------------------------------------------------------------- helpers


def initial_state(method, num_tasks):
    state = {}
    for key, spec in method.state_spec(num_tasks).items():
        init = spec.initializer
        if init == "zeros":
            value = np.zeros(spec.shape)
        elif init == "ones":
            value = np.ones(spec.shape)
        else:
            value = np.full(spec.shape, float(init))
        state[key] = tf.constant(value, tf.float64)
    return state


def resolved(c):
    """(shared, specific, loss_weights, state, state_gradients) with the defaults of
    `Combination` filled in."""
    specific = c.shared if c.specific is None else c.specific
    weights = specific if c.loss_weights is None else c.loss_weights
    return c.shared, specific, weights, dict(c.state), dict(c.state_gradients)


_COMPILED = {}


def combine(method, losses, present, state, step=0, epoch=0, seed=0, jit=False):
    """One combine on float64 inputs; `jit=True` runs it under tf.function(jit_compile)."""
    args = (
        tf.constant(losses, tf.float64),
        tf.constant(present, tf.float64),
        tf.constant(step, tf.int64),
        tf.constant(epoch, tf.int64),
        dict(state),
    )

    def run(losses, present, step, epoch, state):
        inputs = base.TaskInputs(losses=losses, present=present, step=step, epoch=epoch, seed=seed)
        return resolved(method.combine(inputs, state))

    if jit:  # one compiled function per (method, seed): XLA compiles once per shape
        key = (id(method), seed)
        if key not in _COMPILED:
            _COMPILED[key] = (method, tf.function(run, jit_compile=True))
        run = _COMPILED[key][1]
    out = run(*args)
    return tuple(
        x.numpy() if isinstance(x, tf.Tensor) else {k: v.numpy() for k, v in x.items()} for x in out
    )


def presence(num_tasks, absent):
    present = np.ones(num_tasks)
    if absent is not None:
        present[absent] = 0.0
    return present


def check_common(shared, specific, present):
    assert np.all(np.isfinite(shared))
    np.testing.assert_array_equal(shared, specific)  # one backward pass: specific == shared
    np.testing.assert_array_equal(shared[present == 0], 0.0)


# ---------------------------------------------------------------- UW


@pytest.mark.parametrize("num_tasks", TASKS)
@pytest.mark.parametrize("absent", [None, 1])
def test_uw_matches_libmtl_over_steps(num_tasks, absent):
    rng = np.random.default_rng(num_tasks)
    method = UncertaintyWeighting()
    state = initial_state(method, num_tasks)
    np.testing.assert_array_equal(state["log_variances"], -0.5)
    assert method.state_spec(num_tasks)["log_variances"].trainable
    ref = LibMTLUW(num_tasks)
    present = presence(num_tasks, absent)
    lr = 0.3
    for step in range(3):
        losses = present * rng.uniform(0.1, 3.0, num_tasks)
        shared, specific, loss_weights, _, grads = combine(method, losses, present, state)
        weights, loss, grad = ref.backward(losses, present)
        check_common(shared, specific, present)
        np.testing.assert_allclose(shared, weights, **TIGHT)
        # the reported loss is LibMTL's UW loss, s/2 included
        np.testing.assert_allclose(np.sum(loss_weights * losses), loss, **TIGHT)
        np.testing.assert_allclose(grads["log_variances"], grad, **TIGHT)
        # the optimizer's step on s (same in both)
        ref.loss_scale = ref.loss_scale - lr * grad
        state = {
            "log_variances": tf.constant(
                state["log_variances"].numpy() - lr * grads["log_variances"], tf.float64
            )
        }
        np.testing.assert_allclose(state["log_variances"].numpy(), ref.loss_scale, **TIGHT)
    if absent is not None:
        np.testing.assert_array_equal(state["log_variances"].numpy()[absent], -0.5)


def test_uw_gradient_is_autodiff_of_the_uw_loss():
    """state_gradients and the model weights are the derivatives of LibMTL's loss."""
    losses = tf.constant([0.7, 2.5, 1.1], tf.float64)
    s = tf.Variable([-0.5, 0.3, 1.2], dtype=tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(losses)
        loss = tf.reduce_sum(losses / (2 * tf.exp(s)) + s / 2)
    c = UncertaintyWeighting().combine(
        base.TaskInputs(
            losses, tf.ones(3, tf.float64), tf.constant(0, tf.int64), tf.constant(0, tf.int64), 0
        ),
        {"log_variances": s},
    )
    np.testing.assert_allclose(c.state_gradients["log_variances"], tape.gradient(loss, s), **TIGHT)
    np.testing.assert_allclose(c.shared, tape.gradient(loss, losses), **TIGHT)
    np.testing.assert_allclose(tf.reduce_sum(c.loss_weights * losses), loss, **TIGHT)


def test_uw_zero_loss_and_xla():
    method = UncertaintyWeighting(initial_log_variance=0.25)
    state = initial_state(method, 3)
    np.testing.assert_array_equal(state["log_variances"], 0.25)
    losses, present = np.array([0.0, 1.5, 0.0]), np.array([1.0, 1.0, 0.0])
    eager = combine(method, losses, present, state)
    shared, _, loss_weights, _, grads = eager
    assert np.all(np.isfinite(loss_weights))
    # the zero-loss task cannot carry its s/2 in the report; the training still sees it
    np.testing.assert_allclose(loss_weights[0], 0.5 * np.exp(-0.25), **TIGHT)
    np.testing.assert_allclose(
        grads["log_variances"], [0.5, 0.5 - 1.5 * 0.5 * np.exp(-0.25), 0.0], **TIGHT
    )
    jit = combine(method, losses, present, state, jit=True)
    for a, b in zip(eager[:3], jit[:3]):
        np.testing.assert_allclose(a, b, **TIGHT)
    np.testing.assert_allclose(eager[4]["log_variances"], jit[4]["log_variances"], **TIGHT)


# ---------------------------------------------------------------- DWA


def run_dwa(method, epoch_losses, presents=None, jit=False, epochs=None):
    num_tasks = len(epoch_losses[0][0])
    state = initial_state(method, num_tasks)
    out = []
    for e, batches in enumerate(epoch_losses):
        for b, losses in enumerate(batches):
            present = np.ones(num_tasks) if presents is None else presents[e][b]
            shared, specific, _, state, _ = combine(
                method, losses, present, state, epoch=e if epochs is None else epochs[e], jit=jit
            )
            check_common(shared, specific, present)
            out.append(shared)
    return out, state


@pytest.mark.parametrize("num_tasks", TASKS)
@pytest.mark.parametrize("temperature", [2.0, 0.5])
def test_dwa_matches_libmtl_across_epochs(num_tasks, temperature):
    rng = np.random.default_rng(10 + num_tasks)
    # 5 epochs of 3 batches, losses falling at task-dependent rates
    rates = rng.uniform(0.5, 0.95, num_tasks)
    epoch_losses = [
        [rates**e * rng.uniform(0.5, 2.0, num_tasks) for _ in range(3)] for e in range(5)
    ]
    ours, state = run_dwa(DynamicWeightAverage(temperature), epoch_losses)
    ref = libmtl_dwa(epoch_losses, num_tasks, temperature)
    np.testing.assert_allclose(np.array(ours), np.array(ref), **TIGHT)
    np.testing.assert_array_equal(np.array(ours[:6]), 1.0)  # the first two epochs
    assert not np.allclose(ours[-1], 1.0)
    # state: the epoch being accumulated and the last two epochs' averages
    np.testing.assert_equal(state["epoch"], 4.0)
    np.testing.assert_allclose(state["last"], np.mean(epoch_losses[3], axis=0), **TIGHT)
    np.testing.assert_allclose(state["before"], np.mean(epoch_losses[2], axis=0), **TIGHT)
    np.testing.assert_allclose(state["sums"], np.sum(epoch_losses[4], axis=0), **TIGHT)


def test_dwa_absent_tasks():
    """A task missing from some batches: its epoch average is over the batches it is
    in; at a step where it is absent it gets 0 and the others' weights sum to their
    count; a task absent for a whole epoch has ratio 1."""
    rng = np.random.default_rng(3)
    T, temperature = 3, 2.0
    epoch_losses, presents = [], []
    for e in range(5):
        batches, ps = [], []
        for b in range(4):
            p = np.ones(T)
            if b == 1:
                p[0] = 0.0
            if e == 2:
                p[2] = 0.0  # task 2 absent for all of epoch 2
            batches.append(p * rng.uniform(0.5, 2.0, T) * 0.8**e)
            ps.append(p)
        epoch_losses.append(batches)
        presents.append(ps)
    ours, _ = run_dwa(DynamicWeightAverage(temperature), epoch_losses, presents)
    # NumPy: per-task means over the present batches; ratio 1 without both averages
    averages = [
        np.sum(bs, axis=0) / np.maximum(np.sum(ps, axis=0), 1)
        for bs, ps in zip(epoch_losses, presents)
    ]
    valid = [np.sum(ps, axis=0) > 0 for ps in presents]
    k = 0
    for e in range(5):
        for b in range(4):
            p = presents[e][b]
            if e > 1:
                ok = valid[e - 1] & valid[e - 2]
                r = np.where(ok, averages[e - 1] / np.where(ok, averages[e - 2], 1), 1.0)
            else:
                r = np.ones(T)
            ex = p * np.exp(r / temperature)
            want = p.sum() * ex / ex.sum()
            np.testing.assert_allclose(ours[k], want, **TIGHT)
            np.testing.assert_allclose(ours[k].sum(), p.sum(), **TIGHT)
            k += 1


def test_dwa_history_is_the_epochs_trained_and_xla():
    """A run that starts (or resumes with fresh state) at epoch 7 weights 1 for its
    first two epochs, then follows LibMTL's rule on the epochs it trained; XLA ==
    eager."""
    rng = np.random.default_rng(4)
    epoch_losses = [[rng.uniform(0.5, 2.0, 3) for _ in range(2)] for _ in range(4)]
    ref = libmtl_dwa(epoch_losses, 3)
    ours, _ = run_dwa(DynamicWeightAverage(), epoch_losses, epochs=[7, 8, 9, 10])
    np.testing.assert_allclose(np.array(ours), np.array(ref), **TIGHT)
    jit, _ = run_dwa(DynamicWeightAverage(), epoch_losses, epochs=[7, 8, 9, 10], jit=True)
    np.testing.assert_allclose(np.array(jit), np.array(ref), **TIGHT)


def test_dwa_resume_mid_epoch_from_saved_state():
    """The state is all there is: continuing from a saved state == the continuous run."""
    rng = np.random.default_rng(5)
    epoch_losses = [[rng.uniform(0.5, 2.0, 2) for _ in range(3)] for _ in range(4)]
    method = DynamicWeightAverage()
    full, _ = run_dwa(method, epoch_losses)
    state = initial_state(method, 2)
    steps = [(e, losses) for e, bs in enumerate(epoch_losses) for losses in bs]
    for e, losses in steps[:7]:
        _, _, _, state, _ = combine(method, losses, np.ones(2), state, epoch=e)
    saved = {k: tf.constant(np.array(v), tf.float64) for k, v in state.items()}
    for i, (e, losses) in enumerate(steps[7:], start=7):
        shared, _, _, saved, _ = combine(method, losses, np.ones(2), saved, epoch=e)
        np.testing.assert_array_equal(shared, full[i])


# ---------------------------------------------------------------- RLW


def test_rlw_is_the_softmax_of_the_step_draw_and_reproducible():
    method = RandomLossWeighting()
    for num_tasks in TASKS:
        for seed, step in [(0, 0), (3, 17), (12345, 2**33 + 5)]:
            present = np.ones(num_tasks)
            a = combine(method, np.ones(num_tasks), present, {}, step=step, seed=seed)
            b = combine(method, np.ones(num_tasks), present, {}, step=step, seed=seed, jit=True)
            np.testing.assert_array_equal(
                a[0], combine(method, np.ones(num_tasks), present, {}, step=step, seed=seed)[0]
            )
            np.testing.assert_allclose(a[0], b[0], **TIGHT)
            draw = base.random_normal(seed, tf.constant(step, tf.int64), num_tasks).numpy()
            e = np.exp(draw - draw.max())
            np.testing.assert_allclose(a[0], e / e.sum(), **TIGHT)
            check_common(a[0], a[1], present)
    # other steps / seeds draw other weights
    w = [
        combine(method, np.ones(3), np.ones(3), {}, step=s, seed=sd)[0]
        for s, sd in [(0, 0), (1, 0), (0, 1)]
    ]
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[0], w[2])


def test_rlw_absent_task_renormalises():
    method = RandomLossWeighting()
    full = combine(method, np.ones(5), np.ones(5), {}, step=9, seed=2)[0]
    present = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    shared, specific, _, _, _ = combine(method, np.ones(5), present, {}, step=9, seed=2)
    check_common(shared, specific, present)
    want = present * full / np.sum(present * full)
    np.testing.assert_allclose(shared, want, **TIGHT)
    none = combine(method, np.zeros(5), np.zeros(5), {}, step=9, seed=2)[0]
    np.testing.assert_array_equal(none, 0.0)


def test_rlw_distribution():
    """Over 4000 steps: mean weight 1/T for every task, and the mean largest weight that
    of softmax(N(0, I)) (NumPy Monte Carlo)."""
    T, n = 3, 4000
    method = RandomLossWeighting()

    @tf.function
    def weights(steps):
        return tf.map_fn(
            lambda s: (
                method.combine(
                    base.TaskInputs(
                        tf.ones(T, tf.float64),
                        tf.ones(T, tf.float64),
                        s,
                        tf.constant(0, tf.int64),
                        7,
                    ),
                    {},
                ).shared
            ),
            steps,
            fn_output_signature=tf.float64,
        )

    w = weights(tf.range(n, dtype=tf.int64)).numpy()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, **TIGHT)
    np.testing.assert_allclose(w.mean(axis=0), 1.0 / T, atol=0.01)
    draws = np.random.default_rng(0).standard_normal((200000, T))
    ref = np.exp(draws) / np.exp(draws).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(w.max(axis=1).mean(), ref.max(axis=1).mean(), atol=0.01)
    np.testing.assert_allclose(w.std(axis=0), ref.std(axis=0), atol=0.01)


# ---------------------------------------------------------------- FAMO


@pytest.mark.parametrize("num_tasks", TASKS)
@pytest.mark.parametrize("options", [{}, {"w_lr": 0.3, "gamma": 0.01, "min_losses": 0.05}])
def test_famo_matches_reference_full_batch(num_tasks, options):
    """Full-batch training (the reference's re-computed losses of step k's batch after
    the update ARE step k+1's losses): 5 steps, 4 logit updates."""
    rng = np.random.default_rng(20 + num_tasks)
    losses = [rng.uniform(0.2, 2.0, num_tasks) * 0.7**k for k in range(5)]
    losses = [np.maximum(l, 0.1) for l in losses]
    ref = ReferenceFAMO(num_tasks, **options)
    method = FAMO(**options)
    state = initial_state(method, num_tasks)
    present = np.ones(num_tasks)
    for k, L in enumerate(losses):
        want = ref.backward(L)
        shared, specific, loss_weights, state, _ = combine(method, L, present, state, step=k)
        check_common(shared, specific, present)
        np.testing.assert_allclose(shared, want, **TIGHT)
        np.testing.assert_array_equal(loss_weights, present)
        np.testing.assert_allclose(state["logits"], ref.w, **TIGHT)
        np.testing.assert_equal(state["adam_step"], ref.opt.t)
        if k + 1 < len(losses):
            ref.update_w(losses[k + 1])
    assert not np.allclose(state["logits"], 0.0)


def test_famo_weights_are_the_gradient_of_the_famo_loss():
    """shared = d/dL of the reference loss sum(log(D) z / c) with c and z detached
    (autodiff), for arbitrary logits."""
    losses = tf.constant([0.4, 1.7, 0.9], tf.float64)
    logits = tf.constant([0.3, -0.2, 0.5], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(losses)
        z = tf.nn.softmax(logits)
        D = losses + 1e-8
        c = tf.stop_gradient(tf.reduce_sum(z / D))
        loss = tf.reduce_sum(tf.math.log(D) * z / c)
    state = {k: tf.zeros_like(v) for k, v in initial_state(FAMO(), 3).items()}
    state["logits"] = logits
    c_ = FAMO().combine(
        base.TaskInputs(
            losses, tf.ones(3, tf.float64), tf.constant(0, tf.int64), tf.constant(0, tf.int64), 0
        ),
        state,
    )
    np.testing.assert_allclose(c_.shared, tape.gradient(loss, losses), **TIGHT)


def test_famo_absent_tasks_and_xla():
    """A task absent at a step: weight 0, left out of c; the next update uses only the
    tasks present at both steps (restricted softmax Jacobian, other logits decay)."""
    T = 4
    rng = np.random.default_rng(8)
    losses = [rng.uniform(0.3, 2.0, T) for _ in range(5)]
    presents = [
        np.ones(T),
        np.array([1.0, 0, 1, 1]),
        np.ones(T),
        np.ones(T),
        np.array([0.0, 1, 1, 0]),
    ]
    method = FAMO(w_lr=0.1, gamma=0.01)
    state = initial_state(method, T)
    # NumPy model of the documented semantics
    w, opt, prev, prev_p = np.zeros(T), TorchAdam(0.1, 0.01), None, np.zeros(T)
    for k in range(5):
        p = presents[k]
        L = p * losses[k]
        both = p * prev_p
        if both.any():
            zb = both * np.exp(w) / np.sum(both * np.exp(w))
            delta = both * (np.log(np.maximum(prev, 0) + 1e-8) - np.log(L + 1e-8))
            w = opt.step(w, (np.diag(zb) - np.outer(zb, zb)).T @ delta)
        z = p * np.exp(w) / np.sum(p * np.exp(w))
        ratio = z / (L + 1e-8)
        want = ratio / ratio.sum()
        eager = combine(method, L, p, state, step=k)
        jit = combine(method, L, p, state, step=k, jit=True)
        shared, specific, _, new_state, _ = eager
        check_common(shared, specific, p)
        np.testing.assert_allclose(shared, want, **TIGHT)
        np.testing.assert_allclose(new_state["logits"], w, **TIGHT)
        np.testing.assert_allclose(jit[0], shared, **TIGHT)
        for key in new_state:
            np.testing.assert_allclose(jit[3][key], new_state[key], **TIGHT)
        state = new_state
        prev, prev_p = L, p
    # no task at all: zeros, no update
    shared, _, _, after, _ = combine(method, np.zeros(T), np.zeros(T), state, step=5)
    np.testing.assert_array_equal(shared, 0.0)
    np.testing.assert_array_equal(after["logits"], state["logits"])


def test_famo_per_task_min_losses_and_clamp():
    method = FAMO(min_losses=[0.1, 0.2])
    state = initial_state(method, 2)
    shared = combine(method, [0.3, 0.1], np.ones(2), state)[0]  # task 1 below its bound
    D = np.array([0.2, 0.0]) + 1e-8
    np.testing.assert_allclose(shared, (0.5 / D) / np.sum(0.5 / D), **TIGHT)
    with pytest.raises(ValueError, match="min_losses"):
        method.state_spec(3)


# ---------------------------------------------------------------- API


@pytest.mark.parametrize(
    "cls, name",
    [
        (UncertaintyWeighting, "uw"),
        (DynamicWeightAverage, "dwa"),
        (RandomLossWeighting, "rlw"),
        (FAMO, "famo"),
    ],
)
def test_registry_and_config(cls, name):
    method = base.get_method(name)
    assert type(method) is cls
    assert method.kind == "loss" and method.uses_gradients is False and method.reference
    assert base.get_method(base.serialize_method(method)) == method
    hash(method)


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: UncertaintyWeighting(initial_log_variance="a"), "initial_log_variance"),
        (lambda: DynamicWeightAverage(temperature=0.0), "temperature"),
        (lambda: DynamicWeightAverage(temperature=-1), "temperature"),
        (lambda: FAMO(w_lr=-0.1), "w_lr"),
        (lambda: FAMO(gamma="x"), "gamma"),
        (lambda: FAMO(min_losses=[]), "min_losses"),
        (lambda: FAMO(min_losses=[0.0, None]), "min_losses"),
        (lambda: base.get_method("rlw", temperature=1.0), "rlw"),
    ],
)
def test_bad_arguments_name_the_argument(make, argument):
    with pytest.raises(ValueError, match=argument):
        make()


@pytest.mark.parametrize(
    "method",
    [UncertaintyWeighting(), DynamicWeightAverage(), RandomLossWeighting(), FAMO()],
    ids=repr,
)
def test_float32_losses_with_float64_state(method):
    """A float32 model: the combine works in the losses' dtype (state cast to it), under
    XLA, and agrees with float64 to float32 precision over 4 steps across 3 epochs."""
    rng = np.random.default_rng(1)
    T = 3
    run = tf.function(
        lambda l, p, step, epoch, s: resolved(
            method.combine(base.TaskInputs(l, p, step, epoch, 5), s)
        ),
        jit_compile=True,
    )
    states = {tf.float32: initial_state(method, T), tf.float64: initial_state(method, T)}
    for k in range(4):
        losses = rng.uniform(0.2, 2.0, T)
        present = np.array([1.0, 1.0, float(k != 2)])
        out = {}
        for dtype in (tf.float32, tf.float64):
            c = run(
                tf.constant(losses * present, dtype),
                tf.constant(present, dtype),
                tf.constant(k, tf.int64),
                tf.constant(k // 2 + k % 2, tf.int64),
                states[dtype],
            )
            assert c[0].dtype == dtype
            states[dtype] = {
                **states[dtype],
                **{key: tf.cast(v, tf.float64) for key, v in c[3].items()},
            }
            out[dtype] = [c[0].numpy(), c[2].numpy()]
        for a, b in zip(out[tf.float32], out[tf.float64]):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- through the trainer


def _trainer_data(rows=27):
    """`rows` examples of 3 tasks (task = row % 3) of a linear regression, task 1's
    targets flipped and scaled (a conflicting task); also the Nash-MTL / Aligned-MTL tests'."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, 4)), rng.normal(size=(rows, 2))
    task = (np.arange(rows) % 3).astype("int32")
    y[task == 1] *= -3.0  # a conflicting task
    return x, y, task


def _task_losses_and_grads(W, b, x, y, task):
    """MSE of a linear model per task (mean over the task's rows and the 2 outputs) and
    its gradient."""
    losses, grads = [], []
    for t in range(3):
        X, Y = x[task == t], y[task == t]
        R = X @ W + b - Y
        losses.append(np.mean(R**2))
        grads.append((X.T @ R / len(X), R.sum(0) / len(X)))
    return np.array(losses), grads


@pytest.mark.parametrize("name", ["famo", "uw", "dwa", "rlw"])
def test_multitask_trainer_equals_numpy_reference(float64, name):
    """MultiTaskTrainer(method=name) with SGD on a linear model == the NumPy reference
    loop: FAMO full-batch (5 steps: then the reference's re-computed losses ARE the next
    step's, so this is the official algorithm exactly), UW full-batch with s trained by
    the same SGD, DWA over 4 epochs of 3 batches (LibMTL's buffer), RLW over 12 steps."""
    import keras
    from tf_metaalign.trainers import MultiTaskTrainer

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
    )
    x, y, task = _trainer_data()
    lr, seed = 0.05, 3
    full_batch = name in ("famo", "uw")
    batch, epochs = (27, 5) if full_batch else (9, 4)
    trainer = MultiTaskTrainer(model, num_tasks=3, method=name, seed=seed)
    W, b = [v.numpy().copy() for v in model.trainable_variables]
    W0 = W
    trainer.compile(optimizer=keras.optimizers.SGD(lr), loss=keras.losses.MeanSquaredError())
    trainer.fit(
        {"inputs": x, "task_id": task}, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0
    )

    famo, s, history, step = ReferenceFAMO(3), np.full(3, -0.5), [], 0
    for e in range(epochs):
        history.append([])
        for i in range(0, 27, batch):
            rows = slice(i, i + batch)
            L, G = _task_losses_and_grads(W, b, x[rows], y[rows], task[rows])
            if name == "famo":
                if step:
                    famo.update_w(L)  # the previous step's batch re-evaluated
                w = famo.backward(L)
            elif name == "uw":
                w = 0.5 * np.exp(-s)
                s = s - lr * (0.5 - w * L)
            elif name == "dwa":
                w = libmtl_dwa(history[:-1] + [[L]], 3)[-1] if e > 1 else np.ones(3)
            else:
                draw = base.random_normal(seed, tf.constant(step, tf.int64), 3).numpy()
                w = np.exp(draw) / np.exp(draw).sum()
            history[-1].append(L)
            W = W - lr * sum(wt * g[0] for wt, g in zip(w, G))
            b = b - lr * sum(wt * g[1] for wt, g in zip(w, G))
            step += 1
    assert np.abs(W - W0).max() > 0.1
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), W, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), b, rtol=1e-12, atol=1e-13)
    if name == "famo":
        np.testing.assert_allclose(trainer.famo_logits.numpy(), famo.w, **TIGHT)
    if name == "uw":
        np.testing.assert_allclose(trainer.uw_log_variances.numpy(), s, **TIGHT)


@pytest.mark.parametrize("name", ["uw", "dwa", "famo"])
def test_two_replicas_equal_one(float64, name):
    """The method sees the global losses on every replica: 2 replicas take the steps 1
    replica takes (model, UW's log-variances trained by Adam, the methods' state)."""
    import keras
    from conftest import two_cpu_strategy
    from tf_metaalign.trainers import MultiTaskTrainer

    x, y, task = _trainer_data()
    data = {"inputs": x[:24], "task_id": task[:24]}

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [keras.Input((4,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
            )
            trainer = MultiTaskTrainer(model, num_tasks=3, method=name, seed=2)
            trainer.compile(
                optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.MeanSquaredError()
            )
        h = trainer.fit(data, y[:24], batch_size=8, epochs=3, shuffle=False, verbose=0)
        state = {k: v.numpy() for k, v in trainer.method_state.items()}
        return [v.numpy() for v in model.trainable_variables], state, h.history["loss"]

    one, state1, loss1 = run(tf.distribute.get_strategy())
    two, state2, loss2 = run(two_cpu_strategy())
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for key in state1:
        np.testing.assert_allclose(state1[key], state2[key], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss1, loss2, rtol=1e-6)  # float32 metrics
    if name == "uw":
        assert np.abs(state1["log_variances"] + 0.5).max() > 0.05
    if name == "dwa":
        np.testing.assert_equal(state1["epoch"], 2.0)
