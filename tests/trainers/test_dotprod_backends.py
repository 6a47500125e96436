"""Meta DotProd on either Keras backend: this module imports no TensorFlow, so the JAX
environment (KERAS_BACKEND=jax, no TensorFlow installed) runs it as well as the TF one.

* TensorFlow == JAX at float64: golden trajectories (`tests/golden/dotprod_*.npz`,
  written on TensorFlow by this module with TF_METAALIGN_WRITE_GOLDEN=1) for each method
  and alignment, `every` > 1 with `steps_per_execution`, and gradient accumulation: the
  same weights, the same batches, a few steps of `fit`.
* Numerical oracles on both: the capped / dot gradient on quadratics (closed form), and
  one `fit` step of a tanh MLP against NumPy backprop with a central-difference
  Hessian-vector product (independent of every autodiff in the package).
* weight 0 == plain Keras `fit` on the same backend, at twice the learning rate
  (G1 + G2 = 2 grad L(b) on equal halves).
* compile / fit / evaluate / predict / save + load, and resumed == uninterrupted.
* On JAX: 1 device == 2 devices under `keras.distribution.DataParallel`.

Default suite: about 26 s on TensorFlow, 75 s on JAX (20 s of CPU; 2 shared cores).
"""

import keras
import numpy as np
import pytest
from keras import ops

from backends import on_jax, requires_jax
from golden_io import check_golden
from tf_metaalign.algorithms.dotprod import dotprod_gradient
from tf_metaalign.trainers import DotProdTrainer

BACKENDS = ("tensorflow", "jax")  # collected in the JAX environment too

IN, HIDDEN, OUT = 3, 4, 2


def _initial_weights(seed=0):
    """The MLP's weights from NumPy (Keras's initializers draw differently per backend)."""
    rng = np.random.default_rng(seed)
    return [
        rng.normal(scale=0.7, size=(IN, HIDDEN)),
        rng.normal(scale=0.1, size=(HIDDEN,)),
        rng.normal(scale=0.7, size=(HIDDEN, OUT)),
        rng.normal(scale=0.1, size=(OUT,)),
    ]


def _mlp(seed=0):
    model = keras.Sequential(
        [
            keras.Input((IN,)),
            keras.layers.Dense(HIDDEN, activation="tanh"),
            keras.layers.Dense(OUT),
        ]
    )
    model.set_weights(_initial_weights(seed))
    return model


def _data(n=24, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN))
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 1] * x[:, 2]], axis=1)
    return x.astype(keras.backend.floatx()), y.astype(keras.backend.floatx())


def _weights(model):
    return [np.asarray(ops.convert_to_numpy(v)) for v in model.trainable_variables]


def _fit(trainer_kwargs, optimizer, epochs=2, batch_size=8, n=24, **fit_kwargs):
    """A DotProdTrainer on `_mlp()`: compile, fit on `_data(n)` in order; returns
    (trainer, history)."""
    x, y = _data(n)
    trainer = DotProdTrainer(_mlp(), **trainer_kwargs)
    compile_kwargs = {}
    if "steps_per_execution" in fit_kwargs:
        compile_kwargs["steps_per_execution"] = fit_kwargs.pop("steps_per_execution")
    trainer.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    history = trainer.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return trainer, history


# ---------------------------------------------------------------- TensorFlow == JAX

GOLDEN_CASES = {
    # name: (trainer kwargs, optimizer, compile's steps_per_execution, golden rtol)
    "fd_capped": (dict(weight=2.0, alpha=1e-3), "sgd", 1, 1e-10),
    "fd_auto_dot": (dict(weight=0.3, alignment="dot"), "sgd", 1, None),
    "exact_capped": (dict(weight=2.0, method="exact", cap=0.25), "momentum", 1, 1e-10),
    "exact_dot": (dict(weight=0.3, method="exact", alignment="dot"), "sgd", 1, 1e-10),
    "fd_every3_spe2": (dict(weight=1.0, every=3, alpha=1e-3), "sgd", 2, 1e-10),
    "exact_accum2": (dict(weight=1.0, method="exact", accumulation_steps=2), "momentum", 1, 1e-10),
}
# The finite difference (G21 - G2) / alpha turns the backends' last-bit differences in G21
# and G2 (summation order) into ~eps / alpha relative differences in R. Measured JAX vs
# TensorFlow: the exact cases <= 4e-14; alpha=1e-4 7e-11, alpha=1e-3 (used here) 9e-12;
# alpha="auto" (~1e-8 here) 5e-8, checked at 1e-6. TensorFlow vs itself: <= 5e-15.
AUTO_ALPHA_RTOL = 1e-6


def _optimizer(name):
    # Not Keras's Adam: on TensorFlow it casts its python betas and epsilon to float64
    # through float32 (`ops.cast(0.9, "float64")` is 0.8999999762), on JAX exactly, so
    # Keras's own Adam differs between the backends at ~1e-5 relative after a few steps.
    # Momentum 0.5 is exact in float32: a stateful optimizer both backends agree on.
    return keras.optimizers.SGD(0.05, momentum=0.5 if name == "momentum" else 0.0)


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_fit_trajectory_equals_the_tensorflow_golden(float64, case):
    kwargs, optimizer, steps_per_execution, rtol = GOLDEN_CASES[case]
    trainer, history = _fit(kwargs, _optimizer(optimizer), steps_per_execution=steps_per_execution)
    x, _ = _data()
    arrays = {f"weight_{i}": w for i, w in enumerate(_weights(trainer.model))}
    arrays["predictions"] = np.asarray(trainer.model.predict(x, verbose=0))
    # Logged values: the loss in float64; the diagnostics are float32 metrics.
    arrays["loss"] = np.asarray(history.history["loss"], "float64")
    for name in ("grad_dot", "grad_cosine", "reg_ratio"):
        arrays[name] = np.asarray(history.history[name], "float64")
    arrays["pairs_seen"] = np.asarray(int(ops.convert_to_numpy(trainer.pairs_seen)))
    check_golden(f"dotprod_{case}", arrays, rtol=rtol or AUTO_ALPHA_RTOL)


# ------------------------------------------------------------------ numerical oracles


def _quadratic(rng, d=5):
    """L_b(t) = 1/2 t'A_b t - c_b't for b in (1, 2): G_b = A_b t - c_b, H_b = A_b."""

    def spd():
        m = rng.normal(size=(d, d))
        return m @ m.T / d + np.eye(d)

    a = {1: spd(), 2: 5.0 * spd()}
    c = {1: rng.normal(size=(d,)), 2: rng.normal(size=(d,))}

    def loss_fn(params, state, batch):
        t = params[0]
        aa = ops.convert_to_tensor(a[batch], t.dtype)
        cc = ops.convert_to_tensor(c[batch], t.dtype)
        return 0.5 * ops.sum(t * ops.matmul(aa, t)) - ops.sum(cc * t), (state, None)

    return a, c, loss_fn


@pytest.mark.parametrize("method", ["finite_difference", "exact"])
@pytest.mark.parametrize("weight, cap", [(0.01, 0.5), (2.0, 0.25)])
def test_dotprod_gradient_equals_the_closed_form_on_quadratics(float64, method, weight, cap):
    """R = -A2 G1 (the finite difference is exact up to rounding on a quadratic); the cap
    binds for weight 2 and not for 0.01."""
    rng = np.random.default_rng(int(weight * 100) + int(cap * 10))
    a, c, loss_fn = _quadratic(rng)
    theta = rng.normal(size=(5,))
    g1, g2 = a[1] @ theta - c[1], a[2] @ theta - c[2]
    reg = -a[2] @ g1
    pair = g1 + g2
    ratio = weight * np.linalg.norm(reg) / np.linalg.norm(pair)
    expected = {"dot": pair + weight * reg, "capped": pair + min(1.0, cap / ratio) * weight * reg}
    assert (ratio > cap) == (weight == 2.0)
    for alignment, want in expected.items():
        r = dotprod_gradient(
            loss_fn,
            [ops.convert_to_tensor(theta)],
            None,
            1,
            2,
            weight=weight,
            alpha=1e-4,
            method=method,
            alignment=alignment,
            cap=cap,
        )
        np.testing.assert_allclose(ops.convert_to_numpy(r.gradient[0]), want, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(ops.convert_to_numpy(r.reg_ratio), ratio, rtol=1e-6)
        np.testing.assert_allclose(ops.convert_to_numpy(r.grad_dot), g1 @ g2, rtol=1e-12)


def _np_mse_grad(weights, x, y):
    """The gradient of Keras's "mse" (mean over batch and outputs) of the tanh MLP, by
    hand-written backprop; flattened in trainable_variables order."""
    w1, b1, w2, b2 = weights
    h = np.tanh(x @ w1 + b1)
    d = 2.0 * (h @ w2 + b2 - y) / y.size
    dz = (d @ w2.T) * (1.0 - h**2)
    return np.concatenate([(x.T @ dz).ravel(), dz.sum(0), (h.T @ d).ravel(), d.sum(0)])


def _unflatten(flat, like):
    out, start = [], 0
    for w in like:
        out.append(flat[start : start + w.size].reshape(w.shape))
        start += w.size
    return out


def _np_dotprod_step(weights, x, y, weight, alignment, cap):
    """G = G1 + G2 + s * weight * R with R = -H2 G1, H2 G1 by a central difference of
    the NumPy gradient (step 1e-5: error ~1e-10 relative)."""
    n1 = len(x) // 2
    theta = np.concatenate([w.ravel() for w in weights])
    grad = lambda t, lo, hi: _np_mse_grad(_unflatten(t, weights), x[lo:hi], y[lo:hi])  # noqa: E731
    g1, g2 = grad(theta, 0, n1), grad(theta, n1, len(x))
    h = 1e-5 / np.linalg.norm(g1)
    reg = -(grad(theta + h * g1, n1, len(x)) - grad(theta - h * g1, n1, len(x))) / (2 * h)
    pair = g1 + g2
    ratio = weight * np.linalg.norm(reg) / np.linalg.norm(pair)
    s = min(1.0, cap / ratio) if alignment == "capped" else 1.0
    return theta, pair, pair + s * weight * reg, g1 @ g2, ratio


@pytest.mark.parametrize(
    "method, alignment, weight, rtol",
    [
        ("exact", "dot", 0.3, 1e-8),
        ("exact", "capped", 2.0, 1e-8),
        ("finite_difference", "capped", 2.0, 1e-6),  # alpha="auto": ~sqrt(eps) truncation
    ],
)
def test_one_fit_step_equals_numpy_backprop_and_central_difference_hvp(
    float64, method, alignment, weight, rtol
):
    x, y = _data(n=16)
    lr, cap = 0.1, 0.5
    theta, pair, g, grad_dot, ratio = _np_dotprod_step(
        _initial_weights(), x, y, weight, alignment, cap
    )
    if alignment == "capped":
        assert ratio > cap  # the cap binds: the test checks the cap's factor too
    trainer, history = _fit(
        dict(weight=weight, method=method, alignment=alignment, cap=cap),
        keras.optimizers.SGD(lr),
        epochs=1,
        batch_size=16,
        n=16,
    )
    got = np.concatenate([w.ravel() for w in _weights(trainer.model)])
    atol = rtol * lr * np.abs(g).max()
    np.testing.assert_allclose(got, theta - lr * g, rtol=0, atol=atol)
    # The regulariser moved the step far beyond the tolerance (the check is not vacuous).
    assert np.abs(lr * (g - pair)).max() > 1e3 * atol
    # The logged diagnostics are float32 metrics.
    np.testing.assert_allclose(history.history["grad_dot"][0], grad_dot, rtol=1e-6)
    np.testing.assert_allclose(history.history["reg_ratio"][0], ratio, rtol=1e-6)


# ------------------------------------------------------------- knob at zero == plain fit


def test_weight_zero_equals_plain_fit_at_twice_the_learning_rate(float64):
    """weight=0: G = G1 + G2, the sum of the halves' mean gradients = 2 grad L(b) on equal
    halves, so SGD(lr) on DotProd == plain Keras fit with SGD(2 lr) on the same backend."""
    trainer, history = _fit(dict(weight=0.0), keras.optimizers.SGD(0.05), epochs=2)
    plain = _mlp()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    plain_history = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    # The logged loss is the whole batch's mean, as plain fit logs it.
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-11)
    moved = max(np.abs(a - b).max() for a, b in zip(_weights(plain), _initial_weights()))
    assert moved > 1e-2  # the runs trained


def test_a_batch_of_one_is_a_plain_step_at_twice_the_gradient(float64):
    """9 examples, batch 8: the last batch (1 example) cannot be split, so it is the plain
    step on (b, b), G = 2 grad L(b), without the regulariser: == plain fit at 2x lr there."""
    x, y = _data(9)
    trainer = DotProdTrainer(_mlp(), weight=0.5, alpha=1e-3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    trainer.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = _mlp()
    plain.set_weights(trainer.model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = trainer.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert history.history["unsplit_fraction"] == [1.0]
    assert int(ops.convert_to_numpy(trainer.pairs_seen)) == 2


# ------------------------------------------------ compile, fit, evaluate, predict, save


def test_fit_evaluate_predict_save_load_and_resume(float64, tmp_path):
    x, y = _data()
    kwargs = dict(weight=0.5, every=2, method="finite_difference", alpha=1e-4)
    trainer, _ = _fit(kwargs, keras.optimizers.Adam(0.01), epochs=1)  # 3 pairs: odd phase
    model = trainer.model
    assert int(ops.convert_to_numpy(trainer.pairs_seen)) == 3

    # predict / evaluate are the user's model's, and equal a NumPy forward pass.
    w1, b1, w2, b2 = _weights(model)
    forward = np.tanh(x @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(trainer.predict(x, verbose=0), forward, rtol=1e-12)
    np.testing.assert_allclose(model.predict(x, verbose=0), forward, rtol=1e-12)
    loss = trainer.evaluate(x, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(loss, np.mean((forward - y) ** 2), rtol=1e-12)

    # The user's model saves and loads as itself.
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded) is type(model)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), forward, rtol=1e-12)

    # The trainer saves with its optimizer and schedule; resumed == uninterrupted.
    keras.saving.save_model(trainer, tmp_path / "trainer.keras")  # (trainer.save: the model)
    resumed = keras.models.load_model(tmp_path / "trainer.keras")
    assert isinstance(resumed, DotProdTrainer)
    assert int(ops.convert_to_numpy(resumed.pairs_seen)) == 3
    assert (resumed.weight, resumed.every, resumed.alpha) == (0.5, 2, 1e-4)
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(resumed.model)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert int(ops.convert_to_numpy(resumed.pairs_seen)) == 6


# --------------------------------------------------------------- 1 device == 2 devices


@requires_jax
@pytest.mark.parametrize(
    "case",
    [
        dict(weight=1.0, every=2, alpha=1e-4),
        dict(weight=2.0, method="exact", cap=0.25, accumulation_steps=2),
    ],
    ids=["fd_every2", "exact_capped_accum2"],
)
def test_two_jax_devices_equal_one(float64, case):
    """On JAX the step sees the GLOBAL batch under DataParallel (one SPMD program), so
    its halves are the global batch's halves on any number of devices."""
    import jax

    assert on_jax() and len(jax.devices()) >= 2
    one, _ = _fit(case, keras.optimizers.Adam(0.01))
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:2]))
    try:
        two, _ = _fit(case, keras.optimizers.Adam(0.01))
        kernel = two.model.trainable_variables[0].value
        assert len(kernel.sharding.device_set) == 2  # really on two devices
    finally:
        keras.distribution.set_distribution(None)
    for a, b in zip(_weights(one.model), _weights(two.model)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
