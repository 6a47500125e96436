"""The MAML tests' shared pieces (no TensorFlow import): NumPy re-derivations -- the
gradient of Keras's MSE for a linear model, and Chang & Lipson's gradient-sharing inner
loop -- and the builders of the models, regression tasks and `algorithms.maml` arguments
they run on. Used by tests/algorithms/test_maml_algorithm_backends.py (both backends) and
test_maml.py's trainer tests."""

import keras
import numpy as np
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M


def _np_grad(params, x, y):
    """Gradient of Keras's MSE mean((x W + b - y)^2) at [W, b]."""
    w, b = params
    r = 2.0 * (x @ w + b - y) / y.size
    return [x.T @ r, r.sum(0)]


def np_sharing_inner_loop(theta0, tasks, alpha, m, lam, g_hat, initialized):
    """Chang & Lipson Algorithm 1's inner loop for a linear model, in NumPy."""
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    flat = lambda gs: np.concatenate([g.ravel() for g in gs])  # noqa: E731
    thetas = [[p.copy() for p in theta0] for _ in tasks]
    new_g_hat = []
    for k in range(len(m)):
        grads = [_np_grad(th, xs, ys) for th, ((xs, ys), _) in zip(thetas, tasks)]
        s = [sum(g[i] for g in grads) for i in range(2)]
        norm = np.linalg.norm(flat(s))
        g = [x / norm for x in s]
        gh = (
            [sig(m[k]) * a + (1 - sig(m[k])) * b for a, b in zip(g, g_hat[k])] if initialized else g
        )
        new_g_hat.append(gh)
        for t in range(len(tasks)):
            delta = [sig(lam[k]) * h + (1 - sig(lam[k])) * gt for h, gt in zip(gh, grads[t])]
            thetas[t] = [p - alpha * d for p, d in zip(thetas[t], delta)]
    return thetas, new_g_hat


# ------------------------------------------------------------------------- the builders


def tensor(value, dtype="float64"):
    return ops.convert_to_tensor(np.asarray(value, dtype=dtype))


def mlp(seed=0, dtype="float64"):
    """Dense(5, tanh) -> Dense(2) on 4 features."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(2, dtype=dtype),
        ]
    )


def linear_model(seed=0, dtype="float64"):
    """Dense(2) on 4 features (`_np_grad`'s model)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,), dtype=dtype), keras.layers.Dense(2, dtype=dtype)])


def regression_tasks(num_tasks, n_support=6, n_query=5, seed=0, dtype="float64"):
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


def mse_loss_fn(model):
    return F.make_loss_fn(model, keras.losses.MeanSquaredError())


def const_batches(batches):
    """NumPy batches -> tuples of tensors of the same dtypes."""
    return [tuple(tensor(a, a.dtype) for a in b) for b in batches]


def plain_lrs(alpha, steps, n):
    """MAML's fixed inner learning rate as `M.meta_gradient`'s `lrs_fn`: `alpha` for each
    of `n` variables at each of `steps` steps."""
    return lambda h: [[tensor(alpha)] * n for _ in range(steps)]


def algorithm_args(model, params, tasks):
    """The leading arguments of `M.meta_gradient` / `M.adapt_and_evaluate`: the model's MSE
    as inner and outer loss, `params`, the model's state and the tasks' support and query
    batches."""
    return (
        mse_loss_fn(model),
        mse_loss_fn(model),
        params,
        F.current_state(model),
        const_batches([t[0] for t in tasks]),
        const_batches([t[1] for t in tasks]),
    )


def model_meta_gradient(model, params, tasks, hyper, lrs_fn, **kw):
    """`M.meta_gradient` of `model`'s MSE on `tasks` at `params`."""
    return M.meta_gradient(*algorithm_args(model, params, tasks), hyper, lrs_fn, **kw)
