"""NumPy re-derivations for the MAML tests (no TensorFlow, no Keras): the gradient of
Keras's MSE for a linear model, and Chang & Lipson's gradient-sharing inner loop. Used by
tests/algorithms/test_maml_algorithm_backends.py (both backends) and test_maml.py's trainer
tests."""

import numpy as np


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
