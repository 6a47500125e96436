"""The backend-neutral oracles of tests/algorithms/test_maml.py, on both backends (this
module imports no TensorFlow; on JAX the tasks of `algorithms.maml` run vmapped): the
meta-gradient against central finite differences, first order against the FOMAML closed
form, Meta-SGD's rates and gradient sharing's gates against finite differences, gradient
sharing against a NumPy re-derivation and against plain MAML at a gate of exactly 0, and
MAML++'s multi-step loss weights (before the port they ran in test_maml.py, TF only).
The NumPy re-derivations and the builders are tests/maml_oracles.py's."""

import keras
import numpy as np
import pytest
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.algorithms.gradient_sharing import GradientSharing

from maml_oracles import (
    _np_grad,
    algorithm_args,
    const_batches,
    linear_model,
    mlp,
    model_meta_gradient,
    mse_loss_fn,
    np_sharing_inner_loop,
    plain_lrs,
    regression_tasks,
    tensor,
)

BACKENDS = ("tensorflow", "jax")

#: ~20 s eager on JAX (test_maml_backends.py checks the meta-gradient along directions there);
#: a few seconds on TensorFlow, where it stays in the default suite.
slow_on_jax = pytest.mark.slow if keras.backend.backend() == "jax" else (lambda test: test)


def _numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def _flat(ts):
    return np.concatenate([np.ravel(np.asarray(t)) for t in ts])


def _unflat(v, like):
    out, i = [], 0
    for t in like:
        n = int(np.prod(t.shape))
        out.append(tensor(np.reshape(v[i : i + n], t.shape)))
        i += n
    return out


def _objective(model, params, tasks, lrs_fn, hyper, **kw):
    """The post-adaptation mean query loss (no tape: for finite differences)."""
    loss, *_ = M.adapt_and_evaluate(*algorithm_args(model, params, tasks), lrs_fn(hyper), **kw)
    return float(loss)


def _central_difference(f, x, eps=1e-5):
    g = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


# --------------------------------------------------------------- second-order MAML


@slow_on_jax
def test_maml_meta_gradient_equals_finite_differences(float64):
    model = mlp(1)
    tasks = regression_tasks(3)
    params = F.current_params(model)
    lrs = plain_lrs(0.3, 2, len(params))
    r = model_meta_gradient(model, params, tasks, {}, lrs)
    fd = _central_difference(
        lambda v: _objective(model, _unflat(v, params), tasks, lrs, {}), _flat(params)
    )
    np.testing.assert_allclose(_flat(r.grads), fd, rtol=1e-6, atol=1e-9)
    # Second order differs from first order here (the test can tell them apart).
    fo = model_meta_gradient(model, params, tasks, {}, lrs, first_order=True)
    assert np.max(np.abs(_flat(fo.grads) - fd)) > 1e-4
    np.testing.assert_allclose(float(r.loss), _objective(model, params, tasks, lrs, {}), rtol=1e-12)


def test_first_order_equals_the_fomaml_closed_form(float64):
    model = linear_model(2)
    tasks = regression_tasks(3, seed=4)
    params = F.current_params(model)
    alpha, steps = 0.2, 3
    r = model_meta_gradient(model, params, tasks, {}, plain_lrs(alpha, steps, 2), first_order=True)
    expected = [np.zeros_like(_numpy(p)) for p in params]
    for (xs, ys), (xq, yq) in tasks:
        theta = [_numpy(p) for p in params]
        for _ in range(steps):
            theta = [t - alpha * g for t, g in zip(theta, _np_grad(theta, xs, ys))]
        expected = [e + g / len(tasks) for e, g in zip(expected, _np_grad(theta, xq, yq))]
    for a, b in zip(r.grads, expected):
        np.testing.assert_allclose(_numpy(a), b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------- Meta-SGD, LSLR


def _meta_sgd_lrs(h):
    return [[h["lr_0"], h["lr_1"]], [h["lr_0"], h["lr_1"]]]


def test_meta_sgd_learning_rates_get_gradients_equal_to_finite_differences(float64):
    model = linear_model(3)
    tasks = regression_tasks(2, seed=5)
    params = F.current_params(model)
    rng = np.random.default_rng(0)
    hyper = {
        "lr_0": tensor(0.1 + 0.1 * rng.random((4, 2))),
        "lr_1": tensor(0.1 + 0.1 * rng.random((2,))),
    }
    for first_order in (False, True):
        r = model_meta_gradient(model, params, tasks, hyper, _meta_sgd_lrs, first_order=first_order)
        got = _flat([r.hyper_grads["lr_0"], r.hyper_grads["lr_1"]])
        assert np.all(np.abs(got) > 0)
        if first_order:
            continue

        def f(v):
            h = dict(zip(["lr_0", "lr_1"], _unflat(v, [hyper["lr_0"], hyper["lr_1"]])))
            return _objective(model, params, tasks, _meta_sgd_lrs, h)

        fd = _central_difference(f, _flat([hyper["lr_0"], hyper["lr_1"]]))
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-10)


# ---------------------------------------------------------------- gradient sharing


def _sharing_setup(seed=0, tasks=3):
    model = mlp(seed)
    params = F.current_params(model)
    rng = np.random.default_rng(seed + 10)
    g_hat = [[tensor(rng.normal(size=p.shape)) for p in params] for _ in range(2)]
    return model, regression_tasks(tasks, seed=seed), params, g_hat


def _sharing_objective(model, params, tasks, m, lam, g_hat, initialized):
    """The training-time objective (Algorithm 1's inner loop) without a tape."""
    sharing = GradientSharing()
    r = M.adapt(
        mse_loss_fn(model),
        params,
        F.current_state(model),
        const_batches([t[0] for t in tasks]),
        plain_lrs(0.3, 2, len(params))({}),
        first_order=True,
        sharing=sharing,
        sharing_m=tensor(m),
        sharing_lambda=tensor(lam),
        g_hat=g_hat,
        g_hat_initialized=initialized,
    )
    obj, *_ = M.query_objective(
        mse_loss_fn(model), r.trajectories, r.state, const_batches([t[1] for t in tasks])
    )
    return float(obj)


@pytest.mark.parametrize(
    "initialized", [pytest.param(False, marks=pytest.mark.slow), True]
)  # fmt: skip
def test_sharing_m_and_lambda_gradients_equal_finite_differences(float64, initialized):
    model, tasks, params, g_hat = _sharing_setup(1)
    m0, lam0 = np.array([0.3, -0.2]), np.array([0.1, 0.4])
    r = model_meta_gradient(
        model,
        params,
        tasks,
        {"sharing_m": tensor(m0), "sharing_lambda": tensor(lam0)},
        plain_lrs(0.3, 2, len(params)),
        sharing=GradientSharing(),
        g_hat=g_hat,
        g_hat_initialized=initialized,
    )
    gm, gl = _numpy(r.hyper_grads["sharing_m"]), _numpy(r.hyper_grads["sharing_lambda"])
    fd_m = _central_difference(
        lambda v: _sharing_objective(model, params, tasks, v, lam0, g_hat, initialized), m0
    )
    fd_l = _central_difference(
        lambda v: _sharing_objective(model, params, tasks, m0, v, g_hat, initialized), lam0
    )
    np.testing.assert_allclose(gl, fd_l, rtol=1e-6, atol=1e-10)
    assert np.all(np.abs(gl) > 1e-6)
    np.testing.assert_allclose(gm, fd_m, rtol=1e-6, atol=1e-10)
    if initialized:
        assert np.all(np.abs(gm) > 1e-6)
    else:
        np.testing.assert_array_equal(gm, 0.0)  # i = 1: g_hat = g_k, m unused
    # theta through the shared direction too (second order).
    fd = _central_difference(
        lambda v: _sharing_objective(
            model, _unflat(v, params), tasks, m0, lam0, g_hat, initialized
        ),
        _flat(params),
    )
    np.testing.assert_allclose(_flat(r.grads), fd, rtol=1e-6, atol=1e-9)


def test_sharing_gate_exactly_zero_equals_plain_maml(float64):
    model, tasks, params, g_hat = _sharing_setup(2)
    args = algorithm_args(model, params, tasks)
    plain = M.meta_gradient(*args, {}, plain_lrs(0.3, 2, len(params)))
    for initialized in (False, True):
        shared = M.meta_gradient(
            *args,
            {
                "sharing_m": tensor([0.5, -1.0]),
                "sharing_lambda": tensor([-np.inf, -np.inf]),
            },
            plain_lrs(0.3, 2, len(params)),
            sharing=GradientSharing(initial_lambda=float("-inf")),
            g_hat=g_hat,
            g_hat_initialized=initialized,
        )
        assert float(shared.loss) == float(plain.loss)
        for a, b in zip(shared.grads, plain.grads):
            np.testing.assert_array_equal(_numpy(a), _numpy(b))
        np.testing.assert_array_equal(_numpy(shared.hyper_grads["sharing_lambda"]), 0.0)


@pytest.mark.parametrize("initialized", [False, True])
def test_g_hat_update_equals_numpy(float64, initialized):
    model = linear_model(4)
    tasks = regression_tasks(3, seed=6)
    params = F.current_params(model)
    rng = np.random.default_rng(3)
    g_hat = [[rng.normal(size=p.shape) for p in params] for _ in range(3)]
    m, lam = np.array([0.2, -0.7, 1.1]), np.array([-0.3, 0.5, 0.0])
    r = M.adapt(
        mse_loss_fn(model),
        params,
        F.current_state(model),
        const_batches([t[0] for t in tasks]),
        plain_lrs(0.25, 3, 2)({}),
        sharing=GradientSharing(),
        sharing_m=tensor(m),
        sharing_lambda=tensor(lam),
        g_hat=[[tensor(x) for x in step] for step in g_hat],
        g_hat_initialized=tensor(initialized),
    )
    thetas, new_g_hat = np_sharing_inner_loop(
        [_numpy(p) for p in params], tasks, 0.25, m, lam, g_hat, initialized
    )
    for got, want in zip(r.g_hat, new_g_hat):
        for a, b in zip(got, want):
            np.testing.assert_allclose(_numpy(a), b, rtol=1e-10, atol=1e-12)
    for traj, want in zip(r.trajectories, thetas):
        for a, b in zip(traj[-1], want):
            np.testing.assert_allclose(_numpy(a), b, rtol=1e-10, atol=1e-12)


def test_multi_step_loss_weights_follow_maml_plus_plus():
    w0 = _numpy(M.multi_step_loss_weights(5, 0, 10))
    np.testing.assert_allclose(w0, np.full(5, 0.2), rtol=1e-6)
    w3 = _numpy(M.multi_step_loss_weights(5, 3, 10))
    np.testing.assert_allclose(w3[:4], 0.2 - 3 * 0.02, rtol=1e-6)
    np.testing.assert_allclose(w3[4], 0.2 + 3 * 4 * 0.02, rtol=1e-6)
    w9 = _numpy(M.multi_step_loss_weights(5, 9, 10))
    np.testing.assert_allclose(w9, [0.02] * 4 + [0.92], rtol=1e-6)
    w49 = _numpy(M.multi_step_loss_weights(5, 49, 50))
    np.testing.assert_allclose(w49[:4], 0.006, rtol=1e-6)  # the floor 0.03 / K
    np.testing.assert_allclose(w49[4], 1 - 4 * 0.006, rtol=1e-6)  # the cap
    np.testing.assert_array_equal(_numpy(M.multi_step_loss_weights(5, 10, 10)), [0, 0, 0, 0, 1])
