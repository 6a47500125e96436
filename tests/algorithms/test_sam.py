"""SAM, ASAM, GSAM as pure functions: float64 NumPy re-derivations and closed forms.

Backend-neutral (no TensorFlow import): the same oracles run on TensorFlow and on JAX."""

import keras
import numpy as np
import pytest
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import sam
from tf_metaalign.algorithms.sam import (
    gsam_direction,
    gsam_rho,
    largest_hessian_eigenvalue,
    sam_gradient,
    sam_perturbation,
)

BACKENDS = ("tensorflow", "jax")

MSE64 = keras.losses.MeanSquaredError(dtype="float64")

# ----------------------------------------------------------------- the NumPy oracle


def mlp64(seed=0, dropout=0.0):
    """Input(4) -> Dense(5, tanh) -> [Dropout] -> Dense(2), float64."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,), dtype="float64"), keras.layers.Dense(5, "tanh", dtype="float64")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=3, dtype="float64"))
    layers.append(keras.layers.Dense(2, dtype="float64"))
    return keras.Sequential(layers)


def data64(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1)
    return x, y


def np_loss_and_grad(w, x, y):
    """MSE of tanh(x W1 + b1) W2 + b2 and its gradient, by hand in float64."""
    w1, b1, w2, b2 = w
    h = np.tanh(x @ w1 + b1)
    f = h @ w2 + b2
    d = 2.0 * (f - y) / f.size
    dh = (d @ w2.T) * (1.0 - h**2)
    return np.mean((f - y) ** 2), [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def np_norm(v):
    return np.sqrt(sum(np.sum(a * a) for a in v))


def np_sam_direction(w, x, y, rho, adaptive=False, eta=0.01, mask=None, alpha=None):
    """The SAM / ASAM / GSAM direction at w, re-derived from the papers' formulas."""
    _, g = np_loss_and_grad(w, x, y)
    mask = mask or [True] * len(w)
    t = [np.abs(p) + eta if (adaptive and m) else np.ones_like(p) for p, m in zip(w, mask)]
    norm = np_norm([ti * gi for ti, gi in zip(t, g)])
    e = [rho * ti * ti * gi / norm for ti, gi in zip(t, g)]
    _, gp = np_loss_and_grad([p + ei for p, ei in zip(w, e)], x, y)
    if alpha is None:
        return gp
    c = sum(np.sum(a * b) for a, b in zip(g, gp)) / sum(np.sum(b * b) for b in gp)
    return [b - alpha * (a - c * b) for a, b in zip(g, gp)]


def _lib(model, x, y, **kwargs):
    loss_fn = F.make_loss_fn(model, MSE64)
    return sam_gradient(loss_fn, F.current_params(model), F.current_state(model), (x, y), **kwargs)


def _np(x):
    return ops.convert_to_numpy(x)


def _assert_lists_close(a, b, rtol=1e-10, atol=1e-13):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(_np(u), _np(v), rtol=rtol, atol=atol)


# ------------------------------------------------------------- against NumPy, float64


@pytest.mark.parametrize(
    "options",
    [
        dict(rho=0.05),
        dict(rho=0.5, adaptive=True, eta=0.01, mask=[True, False, True, False]),
        dict(rho=0.3, alpha=0.2),
        dict(rho=0.5, adaptive=True, eta=0.0, mask=None, alpha=0.4),
    ],
    ids=["sam", "asam_biases_unscaled", "gsam", "gsam_asam_eta0"],
)
def test_direction_equals_numpy_rederivation(float64, options):
    model = mlp64(seed=1)
    x, y = data64(8)
    w = [_np(v) for v in model.trainable_variables]
    expected = np_sam_direction(
        w,
        x,
        y,
        options["rho"],
        adaptive=options.get("adaptive", False),
        eta=options.get("eta", 0.01),
        mask=options.get("mask"),
        alpha=options.get("alpha"),
    )
    r = _lib(
        model,
        x,
        y,
        rho=options["rho"],
        adaptive=options.get("adaptive", False),
        eta=options.get("eta", 0.01),
        adaptive_mask=options.get("mask"),
        gsam_alpha=options.get("alpha"),
    )
    _assert_lists_close(r.gradient, expected)
    # ... and it is not the clean gradient (the test can fail).
    _, g = np_loss_and_grad(w, x, y)
    assert np_norm([a - b for a, b in zip(expected, g)]) > 1e-3 * np_norm(g)
    # The diagnostics: the clean loss, the perturbed loss - the clean one, ||g||.
    loss, _ = np_loss_and_grad(w, x, y)
    np.testing.assert_allclose(_np(r.loss), loss, rtol=1e-12)
    e = r.perturbation
    loss_p, _ = np_loss_and_grad([p + _np(ei) for p, ei in zip(w, e)], x, y)
    np.testing.assert_allclose(_np(r.surrogate_gap), loss_p - loss, rtol=1e-9)


def test_quadratic_sam_step_in_closed_form(float64):
    """L = 1/2 w'Aw - c'w: g = Aw - c, and SAM's gradient is g + rho A g / ||g||."""
    rng = np.random.default_rng(0)
    m = rng.normal(size=(6, 6))
    a = m @ m.T / 6 + np.eye(6)
    c = rng.normal(size=6)
    w0 = rng.normal(size=6)

    a_t, c_t = ops.convert_to_tensor(a), ops.convert_to_tensor(c)
    w_t = [ops.convert_to_tensor(w0)]

    def loss_fn(params, state, batch):
        (w,) = params
        return 0.5 * ops.sum(w * ops.matmul(a_t, w)) - ops.sum(c_t * w), (state, None)

    g = a @ w0 - c
    rho = 0.2
    r = sam_gradient(loss_fn, w_t, None, None, rho=rho)
    np.testing.assert_allclose(_np(r.gradient[0]), g + rho * a @ g / np.linalg.norm(g), 1e-12)
    np.testing.assert_allclose(_np(r.perturbation[0]), rho * g / np.linalg.norm(g), 1e-12)
    # The surrogate gap of a quadratic: rho g'g/|g| + rho^2/2 u'Au = rho |g| + rho^2 u'Au/2.
    u = g / np.linalg.norm(g)
    np.testing.assert_allclose(
        _np(r.surrogate_gap), rho * np.linalg.norm(g) + 0.5 * rho**2 * u @ a @ u, rtol=1e-12
    )
    # ASAM, T = |w| + eta: g + A e, e = rho T^2 g / ||T g||.
    t = np.abs(w0) + 0.1
    e = rho * t * t * g / np.linalg.norm(t * g)
    r = sam_gradient(loss_fn, w_t, None, None, rho=rho, adaptive=True, eta=0.1)
    np.testing.assert_allclose(_np(r.gradient[0]), g + a @ e, rtol=1e-12)
    # GSAM: g_p - alpha (g - proj_{g_p} g); orthogonal to ... the residual is orthogonal to g_p.
    gp = g + rho * a @ g / np.linalg.norm(g)
    perp = g - (g @ gp) / (gp @ gp) * gp
    r = sam_gradient(loss_fn, w_t, None, None, rho=rho, gsam_alpha=0.3)
    np.testing.assert_allclose(_np(r.gradient[0]), gp - 0.3 * perp, rtol=1e-12)
    assert abs(perp @ gp) < 1e-10 * np.linalg.norm(gp) ** 2


def test_rho_zero_and_gsam_alpha_zero_are_sam_exactly(float64):
    model = mlp64(seed=2)
    x, y = data64(8)
    clean = _lib(model, x, y, rho=0.0)
    loss_fn = F.make_loss_fn(model, MSE64)
    _, g, _ = F.value_and_grad(loss_fn, F.current_params(model), F.current_state(model), (x, y))
    for a, b in zip(clean.gradient, g):
        np.testing.assert_array_equal(_np(a), _np(b))
    sam_r = _lib(model, x, y, rho=0.1)
    gsam_r = _lib(model, x, y, rho=0.1, gsam_alpha=0.0)
    for a, b in zip(sam_r.gradient, gsam_r.gradient):
        np.testing.assert_array_equal(_np(a), _np(b))


def test_perturbation_is_built_from_the_unscaled_gradient(float64):
    """A loss scale of 2^10: the same e(w), the same ||g||, gradients 2^10 times larger."""
    model = mlp64(seed=3)
    x, y = data64(8)
    params, state = F.current_params(model), F.current_state(model)
    plain = sam_gradient(F.make_loss_fn(model, MSE64), params, state, (x, y), rho=0.1)
    scaled = sam_gradient(
        F.make_loss_fn(model, MSE64, loss_scale=1024.0),
        params,
        state,
        (x, y),
        rho=0.1,
        gradient_scale=1024.0,
    )
    _assert_lists_close(scaled.perturbation, plain.perturbation, rtol=1e-12)
    np.testing.assert_allclose(_np(scaled.grad_norm), _np(plain.grad_norm), rtol=1e-12)
    np.testing.assert_allclose(_np(scaled.surrogate_gap), _np(plain.surrogate_gap), 1e-9)
    _assert_lists_close(scaled.gradient, [1024.0 * g for g in plain.gradient], rtol=1e-12)


def test_zero_gradient_gives_no_perturbation_and_nonfinite_gives_nan():
    e, norm = sam_perturbation([ops.ones(3)], [ops.zeros(3)], 0.05)
    assert float(norm) == 0.0 and np.all(_np(e[0]) == 0.0)
    e, _ = sam_perturbation([ops.ones(3)], [ops.convert_to_tensor([1.0, np.inf, 0.0])], 0.05)
    assert not np.isfinite(_np(e[0])).all()
    e, _ = sam_perturbation([ops.ones(3)], [ops.convert_to_tensor([1.0, np.nan, 0.0])], 0.05)
    assert np.isnan(_np(e[0])).all()


def test_same_dropout_masks_in_both_passes(float64):
    """rho -> 0 with dropout: g_p -> g only if the perturbed pass reuses the clean masks."""
    model = mlp64(seed=4, dropout=0.5)
    x, y = data64(16)
    r = _lib(model, x, y, rho=1e-7)
    diff = float(F.global_norm(F.sub(r.grad_perturbed, r.grad_clean)))
    assert diff < 1e-5 * float(F.global_norm(r.grad_clean)), diff


def test_gsam_rho_follows_the_learning_rate():
    assert float(gsam_rho(0.1, 0.2, 0.02, lr_max=0.1, lr_min=0.001)) == pytest.approx(0.2)
    assert float(gsam_rho(0.001, 0.2, 0.02, lr_max=0.1, lr_min=0.001)) == pytest.approx(0.02)
    mid = 0.001 + 0.25 * 0.099
    assert float(gsam_rho(mid, 0.2, 0.02, lr_max=0.1, lr_min=0.001)) == pytest.approx(0.065)
    assert float(gsam_rho(0.3, 0.2)) == pytest.approx(0.2)  # constant
    d = gsam_direction([ops.convert_to_tensor([1.0, 0.0])], [ops.zeros(2)], 0.5)
    assert np.all(_np(d[0]) == [-0.5, 0.0])  # g_p = 0: g_perp = g


def np_hessian(w, x, y, h=1e-5):
    """The loss Hessian of `np_loss_and_grad` by central differences of its (exact)
    gradient, symmetrised: an oracle independent of any autodiff (error ~h^2)."""
    shapes = [p.shape for p in w]
    flat = np.concatenate([p.ravel() for p in w])

    def grad(v):
        parts = np.split(v, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
        _, g = np_loss_and_grad([p.reshape(s) for p, s in zip(parts, shapes)], x, y)
        return np.concatenate([a.ravel() for a in g])

    columns = []
    for i in range(flat.size):
        step = np.zeros_like(flat)
        step[i] = h
        columns.append((grad(flat + step) - grad(flat - step)) / (2 * h))
    hessian = np.stack(columns, axis=1)
    return 0.5 * (hessian + hessian.T)


def test_largest_hessian_eigenvalue_matches_numpy_eigvalsh(float64):
    """The MLP's Hessian (NumPy, finite differences of the hand-written gradient) and a
    quadratic's (its matrix): power iteration == the top of numpy.linalg.eigvalsh."""
    model = mlp64(seed=5)
    x, y = data64(16)
    loss_fn = F.make_loss_fn(model, MSE64)
    params, state = F.current_params(model), F.current_state(model)
    eig = np.linalg.eigvalsh(np_hessian([_np(p) for p in params], x, y))
    top = eig[np.argmax(np.abs(eig))]
    lam, v, steps = largest_hessian_eigenvalue(
        loss_fn, params, state, (x, y), iterations=200, tolerance=1e-10
    )
    np.testing.assert_allclose(lam, top, rtol=1e-6)
    assert steps < 200

    # A quadratic 1/2 w'Aw with a negative eigenvalue of the largest magnitude: its sign kept.
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    a = q @ np.diag([-4.0, 2.5, 1.0, 0.5, -0.2]) @ q.T
    a_t = ops.convert_to_tensor(a)

    def quadratic(params, state, batch):
        (w,) = params
        return 0.5 * ops.sum(w * ops.matmul(a_t, w)), (state, None)

    lam, v, _ = largest_hessian_eigenvalue(
        quadratic,
        [ops.convert_to_tensor(rng.normal(size=5))],
        None,
        None,
        iterations=500,
        tolerance=1e-12,
    )
    eig = np.linalg.eigvalsh(a)
    np.testing.assert_allclose(lam, eig[np.argmax(np.abs(eig))], rtol=1e-8)
    np.testing.assert_allclose(np.abs(_np(v[0]) @ q[:, 0]), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rho": -0.1}, "rho"),
        ({"rho": float("nan")}, "rho"),
        ({"rho": 0.1, "adaptive": "yes"}, "adaptive"),
        ({"rho": 0.1, "eta": -1.0}, "eta"),
        ({"rho": 0.1, "every": 0}, "every"),
        ({"rho": 0.1, "alpha": float("inf")}, "alpha"),
    ],
)
def test_bad_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        sam.validate_options(**kwargs)
