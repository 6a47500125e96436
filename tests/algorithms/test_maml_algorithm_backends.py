"""The backend-neutral oracles of tests/algorithms/test_maml.py, on both backends (this
module imports no TensorFlow; on JAX the tasks of `algorithms.maml` run vmapped): the
meta-gradient against central finite differences, first order against the FOMAML closed
form, Meta-SGD's rates and gradient sharing's gates against finite differences, gradient
sharing against a NumPy re-derivation and against plain MAML at a gate of exactly 0, and
MAML++'s multi-step loss weights (before the port they ran in test_maml.py, TF only).
The NumPy re-derivations are tests/maml_oracles.py's."""

import keras
import numpy as np
import pytest
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.algorithms.gradient_sharing import GradientSharing

from maml_oracles import _np_grad, np_sharing_inner_loop

BACKENDS = ("tensorflow", "jax")

#: ~20 s eager on JAX (test_maml_backends.py checks the meta-gradient along directions there);
#: a few seconds on TensorFlow, where it stays in the default suite.
slow_on_jax = pytest.mark.slow if keras.backend.backend() == "jax" else (lambda test: test)


def _tensor(value, dtype="float64"):
    return ops.convert_to_tensor(np.asarray(value, dtype=dtype))


def _numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def _mlp(seed=0, dtype="float64"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(2, dtype=dtype),
        ]
    )


def _linear(seed=0, dtype="float64"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,), dtype=dtype), keras.layers.Dense(2, dtype=dtype)])


def _tasks(num_tasks, n_support=6, n_query=5, seed=0, dtype="float64"):
    """Per task: a random linear-ish regression problem -> (support, query) numpy batches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_tasks):
        a = rng.normal(size=(4, 2))
        xs, xq = rng.normal(size=(n_support, 4)), rng.normal(size=(n_query, 4))
        f = lambda x: np.tanh(x @ a) + 0.1 * x[:, :2]  # noqa: E731
        out.append(
            ((xs.astype(dtype), f(xs).astype(dtype)), (xq.astype(dtype), f(xq).astype(dtype)))
        )
    return out


def _loss_fn(model):
    return F.make_loss_fn(model, keras.losses.MeanSquaredError())


def _const(batches):
    return [tuple(_tensor(a, a.dtype) for a in b) for b in batches]


def _flat(ts):
    return np.concatenate([np.ravel(np.asarray(t)) for t in ts])


def _unflat(v, like):
    out, i = [], 0
    for t in like:
        n = int(np.prod(t.shape))
        out.append(_tensor(np.reshape(v[i : i + n], t.shape)))
        i += n
    return out


def _objective(model, params, tasks, lrs_fn, hyper, **kw):
    """The post-adaptation mean query loss (no tape: for finite differences)."""
    loss, *_ = M.adapt_and_evaluate(*_algorithm_args(model, params, tasks), lrs_fn(hyper), **kw)
    return float(loss)


def _central_difference(f, x, eps=1e-5):
    g = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


def _plain_lrs(alpha, steps, n):
    return lambda h: [[_tensor(alpha)] * n for _ in range(steps)]


def _algorithm_args(model, params, tasks):
    """The leading arguments of `M.meta_gradient` / `M.adapt_and_evaluate`: the model's MSE
    as inner and outer loss, `params`, the model's state and the tasks' support and query
    batches."""
    return (
        _loss_fn(model),
        _loss_fn(model),
        params,
        F.current_state(model),
        _const([t[0] for t in tasks]),
        _const([t[1] for t in tasks]),
    )


def _meta_gradient(model, params, tasks, hyper, lrs_fn, **kw):
    return M.meta_gradient(*_algorithm_args(model, params, tasks), hyper, lrs_fn, **kw)


# --------------------------------------------------------------- second-order MAML


@slow_on_jax
def test_maml_meta_gradient_equals_finite_differences(float64):
    model = _mlp(1)
    tasks = _tasks(3)
    params = F.current_params(model)
    lrs = _plain_lrs(0.3, 2, len(params))
    r = _meta_gradient(model, params, tasks, {}, lrs)
    fd = _central_difference(
        lambda v: _objective(model, _unflat(v, params), tasks, lrs, {}), _flat(params)
    )
    np.testing.assert_allclose(_flat(r.grads), fd, rtol=1e-6, atol=1e-9)
    # Second order differs from first order here (the test can tell them apart).
    fo = _meta_gradient(model, params, tasks, {}, lrs, first_order=True)
    assert np.max(np.abs(_flat(fo.grads) - fd)) > 1e-4
    np.testing.assert_allclose(float(r.loss), _objective(model, params, tasks, lrs, {}), rtol=1e-12)


def test_first_order_equals_the_fomaml_closed_form(float64):
    model = _linear(2)
    tasks = _tasks(3, seed=4)
    params = F.current_params(model)
    alpha, steps = 0.2, 3
    r = _meta_gradient(model, params, tasks, {}, _plain_lrs(alpha, steps, 2), first_order=True)
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
    model = _linear(3)
    tasks = _tasks(2, seed=5)
    params = F.current_params(model)
    rng = np.random.default_rng(0)
    hyper = {
        "lr_0": _tensor(0.1 + 0.1 * rng.random((4, 2))),
        "lr_1": _tensor(0.1 + 0.1 * rng.random((2,))),
    }
    for first_order in (False, True):
        r = _meta_gradient(model, params, tasks, hyper, _meta_sgd_lrs, first_order=first_order)
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
    model = _mlp(seed)
    params = F.current_params(model)
    rng = np.random.default_rng(seed + 10)
    g_hat = [[_tensor(rng.normal(size=p.shape)) for p in params] for _ in range(2)]
    return model, _tasks(tasks, seed=seed), params, g_hat


def _sharing_objective(model, params, tasks, m, lam, g_hat, initialized):
    """The training-time objective (Algorithm 1's inner loop) without a tape."""
    sharing = GradientSharing()
    r = M.adapt(
        _loss_fn(model),
        params,
        F.current_state(model),
        _const([t[0] for t in tasks]),
        _plain_lrs(0.3, 2, len(params))({}),
        first_order=True,
        sharing=sharing,
        sharing_m=_tensor(m),
        sharing_lambda=_tensor(lam),
        g_hat=g_hat,
        g_hat_initialized=initialized,
    )
    obj, *_ = M.query_objective(
        _loss_fn(model), r.trajectories, r.state, _const([t[1] for t in tasks])
    )
    return float(obj)


@pytest.mark.parametrize(
    "initialized", [pytest.param(False, marks=pytest.mark.slow), True]
)  # fmt: skip
def test_sharing_m_and_lambda_gradients_equal_finite_differences(float64, initialized):
    model, tasks, params, g_hat = _sharing_setup(1)
    m0, lam0 = np.array([0.3, -0.2]), np.array([0.1, 0.4])
    r = _meta_gradient(
        model,
        params,
        tasks,
        {"sharing_m": _tensor(m0), "sharing_lambda": _tensor(lam0)},
        _plain_lrs(0.3, 2, len(params)),
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
    args = _algorithm_args(model, params, tasks)
    plain = M.meta_gradient(*args, {}, _plain_lrs(0.3, 2, len(params)))
    for initialized in (False, True):
        shared = M.meta_gradient(
            *args,
            {
                "sharing_m": _tensor([0.5, -1.0]),
                "sharing_lambda": _tensor([-np.inf, -np.inf]),
            },
            _plain_lrs(0.3, 2, len(params)),
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
    model = _linear(4)
    tasks = _tasks(3, seed=6)
    params = F.current_params(model)
    rng = np.random.default_rng(3)
    g_hat = [[rng.normal(size=p.shape) for p in params] for _ in range(3)]
    m, lam = np.array([0.2, -0.7, 1.1]), np.array([-0.3, 0.5, 0.0])
    r = M.adapt(
        _loss_fn(model),
        params,
        F.current_state(model),
        _const([t[0] for t in tasks]),
        _plain_lrs(0.25, 3, 2)({}),
        sharing=GradientSharing(),
        sharing_m=_tensor(m),
        sharing_lambda=_tensor(lam),
        g_hat=[[_tensor(x) for x in step] for step in g_hat],
        g_hat_initialized=_tensor(initialized),
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
