"""float64 is float64 everywhere (issue 19, item 4).

`tf.cast(0.4, tf.float64)` converts the Python float to float32 first
(0.4000000059604645), and a float32 variable holding a learning rate rounds it the same
way: a float64 run then differs from its float64 NumPy oracle by ~1e-9 relative instead of
~1e-16. Every test here uses hyperparameters that are NOT exact in float32 (0.1, 0.4,
0.3, ...) and compares a float64 run with a NumPy re-derivation at ~1e-13, where any
float32 rounding of a hyperparameter shows (relative error >= 1e-9).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import test_optimizers as TO
from test_reptile import _data, _grad, _linear, _weights  # the Reptile tests' problem
from optimizer_registry import REGISTRY
from tf_metaalign import algorithms as A
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.trainers import (
    FOMAMLTrainer,
    ReptileTrainer,
    SequentialReptileTrainer,
)

TOL = dict(rtol=1e-13, atol=1e-15)
# An op-for-op NumPy re-derivation of a long rule (Adafactor's factored second moments,
# LAMB's trust ratio) rounds differently from TF's kernels (reduction order): a few ulps
# per op over five steps; float32 rounding of a hyperparameter is >= 1e-9.
RULE_TOL = dict(rtol=1e-12, atol=1e-14)


def _assert_close(a, b, tol=TOL):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol)


def test_python_floats_are_not_exact_in_float32():
    """The premise: these values change when rounded through float32."""
    for value in (0.1, 0.4, 0.3, 0.05, 0.01):
        assert float(np.float32(value)) != value
        assert float(tf.cast(value, tf.float64)) != value  # what the issue is about
        assert float(F.scalar(value, tf.float64)) == value


def test_scalar_helper():
    assert F.scalar(0.4, tf.float64).dtype == tf.float64
    assert F.scalar(0.4, "float32").dtype == tf.float32
    assert float(F.scalar(np.float64(0.4), tf.float64)) == 0.4
    assert float(F.scalar(tf.constant(0.4, tf.float64), tf.float64)) == 0.4
    assert F.scalar(tf.constant(0.5, tf.float32), tf.float64).dtype == tf.float64
    assert float(F.scalar(3, tf.float64)) == 3.0
    with pytest.raises(ValueError, match="value"):
        F.scalar("0.4", tf.float64)


# ------------------------------------------------------------------ Reptile family


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda: keras.optimizers.SGD(0.1), lambda: O.SGD(0.1)],
    ids=["keras_sgd", "ours"],
)
def test_sequential_reptile_float64_equals_numpy(float64, make_optimizer):
    """6 steps, k = 3, eta = 0.4, inner SGD(0.1): NumPy to 1e-13 (was ~1e-9 off)."""
    x, y = _data(48)
    k, eta, lr = 3, 0.4, 0.1
    trainer = SequentialReptileTrainer(_linear(1), inner_steps=k, outer_learning_rate=eta)
    trainer.compile(optimizer=make_optimizer(), loss="mse")
    phi = _weights(trainer.model)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    theta = [p.copy() for p in phi]
    for step in range(6):
        xb, yb = x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8]
        theta = [t - lr * g for t, g in zip(theta, _grad(theta, xb, yb))]
        if (step + 1) % k == 0:
            phi = [p + eta * (t - p) for p, t in zip(phi, theta)]
            theta = [p.copy() for p in phi]
    _assert_close(_weights(trainer.model), phi)
    _assert_close([v.numpy() for v in trainer.slow_weights], phi)


def test_outer_update_takes_eta_exactly(float64):
    phi = [tf.constant([1.0, -2.0], tf.float64)]
    theta = [tf.constant([3.0, 5.0], tf.float64)]
    out = A.reptile.outer_update(phi, theta, 0.4)
    np.testing.assert_array_equal(
        out[0].numpy(), np.array([1.0, -2.0]) + 0.4 * np.array([2.0, 7.0])
    )


def _stacked(x, y, k, b):
    """Elements of k batches of b stacked on axis 0: (k, b, ...)."""
    n = len(x) // (k * b)
    xs = x[: n * k * b].reshape(n, k, b, -1)
    ys = y[: n * k * b].reshape(n, k, b, -1)
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(1).map(lambda a, c: (a[0], c[0]))


@pytest.mark.parametrize("inner", [0.1, "ours"])
@pytest.mark.parametrize("outer", ["keras", "ours"])
def test_reptile_float64_equals_numpy(float64, inner, outer):
    x, y = _data(48)
    k, eps, lr = 3, 0.3, 0.1
    inner_optimizer = O.SGD(lr) if inner == "ours" else lr
    trainer = ReptileTrainer(_linear(6), inner_steps=k, inner_optimizer=inner_optimizer)
    trainer.compile(
        optimizer=O.SGD(eps) if outer == "ours" else keras.optimizers.SGD(eps), loss="mse"
    )
    phi = _weights(trainer.model)
    trainer.fit(_stacked(x, y, k, 8), verbose=0, shuffle=False)
    for element in range(2):
        theta = [p.copy() for p in phi]
        for i in range(k):
            s = 8 * (k * element + i)
            theta = [t - lr * g for t, g in zip(theta, _grad(theta, x[s : s + 8], y[s : s + 8]))]
        phi = [p + eps * (t - p) for p, t in zip(phi, theta)]
    _assert_close(_weights(trainer.model), phi)


def test_fomaml_float64_equals_numpy(float64):
    x, y = _data(64)
    k, lr, inner_lr = 3, 0.3, 0.1
    trainer = FOMAMLTrainer(_linear(7), inner_steps=k, inner_optimizer=inner_lr)
    trainer.compile(optimizer=O.SGD(lr), loss="mse")
    phi = _weights(trainer.model)
    trainer.fit(_stacked(x, y, k + 1, 8), verbose=0, shuffle=False)
    for element in range(2):
        theta = [p.copy() for p in phi]
        for i in range(k):
            s = 8 * ((k + 1) * element + i)
            theta = [
                t - inner_lr * g for t, g in zip(theta, _grad(theta, x[s : s + 8], y[s : s + 8]))
            ]
        s = 8 * ((k + 1) * element + k)
        phi = [p - lr * g for p, g in zip(phi, _grad(theta, x[s : s + 8], y[s : s + 8]))]
    _assert_close(_weights(trainer.model), phi)


# ------------------------------------------------------------------ optimizers


def _float64_variables():
    rng = np.random.default_rng(0)
    out = []
    for path, shape in TO.VARIABLES:
        if int(np.prod(shape)) > 4096:  # keep it small: the rules are per variable
            continue
        scope, name = path.split("/")
        with keras.name_scope(scope):
            value = np.zeros(shape) if scope == "zero_init" else rng.normal(size=shape)
            out.append((path, keras.Variable(value, name=name, dtype="float64")))
    return out


@pytest.mark.parametrize("case", sorted(REGISTRY))
@pytest.mark.parametrize("how", ["apply_gradients", "apply_on_tensors"])
def test_optimizer_float64_update_equals_numpy(float64, case, how):
    """Every registry optimizer (learning rates 0.01 / 0.05 / 0.1, schedules included),
    float64 variables under floatx float64, 5 updates: its NumPy oracle to 1e-12."""
    config = REGISTRY[case]
    opt = config.factory()
    named = _float64_variables()
    paths = [p for p, _ in named]
    variables = [v for _, v in named]
    ws = [v.numpy() for v in variables]
    states = [{} for _ in variables]
    oracle = TO.ORACLES[config.oracle["kind"]]
    params = [tf.convert_to_tensor(v) for v in variables]
    state = opt.initial_state(variables) if how == "apply_on_tensors" else None
    rng = np.random.default_rng(1)
    for t in range(1, 6):
        grads = [rng.normal(size=v.shape) * (0.1 + i) for i, v in enumerate(variables)]
        if how == "apply_gradients":
            opt.apply_gradients(zip([tf.constant(g) for g in grads], variables))
        else:
            params, state = opt.apply_on_tensors(
                [tf.constant(g) for g in grads], params, state, variables
            )
        if config.oracle.get("clipnorm") is not None:
            c = config.oracle["clipnorm"]
            norm = np.sqrt(sum(np.sum(np.square(g)) for g in grads))
            grads = [g * c / max(norm, c) for g in grads]
        ws = [oracle(config.oracle, p, w, g, s, t) for p, w, g, s in zip(paths, ws, grads, states)]
    got = (
        [v.numpy() for v in variables] if how == "apply_gradients" else [p.numpy() for p in params]
    )
    for path, a, b in zip(paths, got, ws):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, **RULE_TOL, err_msg=f"{case} {path}")


def test_learning_rate_is_float64_under_float64(float64):
    opt = O.SGD(0.1)
    assert opt.learning_rate_at(tf.constant(0, tf.int64)).dtype == tf.float64
    assert float(opt.learning_rate_at(tf.constant(0, tf.int64))) == 0.1
    var = keras.Variable(np.ones(3), dtype="float64")
    opt.build([var])
    assert float(opt.current_hyperparameters()["learning_rate"]) == 0.1


def test_fixed_learning_rate_is_held_in_float64_under_float32():
    """Keras would hold 0.1 in a float32 variable; the package's optimizers hold a fixed
    rate in float64 whatever floatx (as their other hyperparameters), so float64 values
    updated under floatx float32 (guided learning's raw values) see the exact rate. A
    float32 variable's SGD update is still Keras's, bit for bit (the rule rounds the rate
    to float32 as Keras does). Schedules and the scale stay float32 under float32."""
    opt = O.SGD(0.1)
    assert opt.learning_rate.dtype == "float64"
    assert float(opt.learning_rate_at(tf.constant(0, tf.int64))) == 0.1
    assert [v.name for v in opt.variables] == ["iteration", "learning_rate"]
    opt.learning_rate = 0.3  # Keras's setter (callbacks such as ReduceLROnPlateau)
    assert float(opt.learning_rate.numpy()) == 0.3
    assert O.SGD(0.1).get_config()["learning_rate"] == 0.1
    scheduled = O.Adam(O.BertSchedule(0.1, num_train_steps=10))
    assert scheduled.learning_rate_at(tf.constant(1, tf.int64)).dtype == tf.float32
    ours, theirs = O.SGD(0.1), keras.optimizers.SGD(0.1)
    a = keras.Variable(np.linspace(-1, 1, 5).astype("float32"))
    b = keras.Variable(np.linspace(-1, 1, 5).astype("float32"))
    g = tf.constant(np.linspace(0.3, 2.0, 5).astype("float32"))
    for _ in range(3):
        ours.apply_gradients([(g, a)])
        theirs.apply_gradients([(g, b)])
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert ours.learning_rate_scale.dtype == "float32"
    # A float64 tensor step under floatx float32 (e.g. guided learning's raw values).
    p = [tf.constant([1.0, 2.0], tf.float64)]
    var = keras.Variable(np.zeros(2), dtype="float64")
    new, _ = O.SGD(0.1).apply_on_tensors(
        [tf.constant([1.0, 3.0], tf.float64)], p, O.SGD(0.1).initial_state([var]), [var]
    )
    np.testing.assert_array_equal(new[0].numpy(), [1.0 - 0.1 * 1.0, 2.0 - 0.1 * 3.0])


def test_schedules_are_float64_under_float64(float64):
    for schedule, step, expected in [
        (O.BertSchedule(0.1, num_train_steps=10, num_warmup_steps=3), 1, 0.1 / 3),
        (O.BertSchedule(0.1, num_train_steps=10, num_warmup_steps=3), 5, 0.1 * (1 - 5 / 10)),
        (O.T5InverseSquareRootSchedule(warmup_steps=10, scale=0.3), 30, 0.3 / np.sqrt(30)),
        (O.AdafactorRelativeStep(), 20000, 1 / np.sqrt(20001)),
        (O.AdafactorRelativeStep(multiply_by_parameter_scale=False), 3, 0.01 * 0.05),
        (O.PegasusSchedule(0.1), 20000, 0.1 / 0.01 / np.sqrt(20000)),
        (O.PegasusSchedule(0.1, warmup_steps=30000), 20000, 20001 / 30000 * 0.1),
    ]:
        value = schedule(tf.constant(step, tf.int64))
        assert value.dtype == tf.float64, schedule
        np.testing.assert_allclose(float(value), expected, rtol=1e-15, err_msg=str(schedule))


# ------------------------------------------------------------------ MAML


def _maml_tasks(num_tasks, seed=0, n_support=6, n_query=5):
    rng = np.random.default_rng(seed)
    sx, sy, qx, qy = [], [], [], []
    for _ in range(num_tasks):
        a = rng.normal(size=(4, 2))
        xs, xq = rng.normal(size=(n_support, 4)), rng.normal(size=(n_query, 4))
        f = lambda x: np.tanh(x @ a) + 0.1 * x[:, :2]  # noqa: E731
        sx.append(xs), sy.append(f(xs)), qx.append(xq), qy.append(f(xq))
    return (np.stack(sx), np.stack(sy), np.stack(qx)), np.stack(qy)


@pytest.mark.parametrize("multi_step_loss", [False, True])
def test_fomaml_trainer_float64_equals_numpy(float64, multi_step_loss):
    """Inner rate 0.1, outer package SGD(0.3), K = 3 (MAML++'s epoch-0 step weights 1/3):
    NumPy to 1e-13."""
    from tf_metaalign.trainers import MAMLTrainer

    x, y = _maml_tasks(6, seed=8)
    k, alpha, lr = 3, 0.1, 0.3
    trainer = MAMLTrainer(
        _linear(6),
        inner_steps=k,
        inner_learning_rate=alpha,
        first_order=True,
        multi_step_loss=multi_step_loss,
    )
    trainer.compile(optimizer=O.SGD(lr), loss=keras.losses.MeanSquaredError())
    phi = _weights(trainer.model)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(3, drop_remainder=True), verbose=0)
    for start in (0, 3):
        grad = [np.zeros_like(p) for p in phi]
        for t in range(start, start + 3):
            theta = [p.copy() for p in phi]
            for step in range(k):
                theta = [a - alpha * g for a, g in zip(theta, _grad(theta, x[0][t], x[1][t]))]
                if multi_step_loss or step == k - 1:
                    w = 1.0 / k if multi_step_loss else 1.0
                    grad = [a + w * g / 3 for a, g in zip(grad, _grad(theta, x[2][t], y[t]))]
        phi = [p - lr * g for p, g in zip(phi, grad)]
    _assert_close(_weights(trainer.model), phi)


@pytest.mark.parametrize("learn", ["per_parameter", "per_layer_per_step"])
def test_maml_learned_inner_learning_rates_start_exactly(float64, learn):
    from tf_metaalign.trainers import MAMLTrainer

    trainer = MAMLTrainer(
        _linear(0), inner_steps=2, inner_learning_rate=0.1, learn_inner_learning_rates=learn
    )
    for v in trainer.inner_learning_rate_variables:
        assert v.dtype == "float64"
        np.testing.assert_array_equal(v.numpy(), np.full(v.shape, 0.1))


def test_multi_step_loss_weights_in_float64(float64):
    from tf_metaalign.algorithms import maml as M

    w = M.multi_step_loss_weights(3, 2, 10, dtype=tf.float64).numpy()
    decay = 1.0 / 3 / 10
    np.testing.assert_allclose(w, [1 / 3 - 2 * decay] * 2 + [1 / 3 + 2 * 2 * decay], rtol=1e-15)


# ------------------------------------------------------------------ Meta DotProd


@pytest.mark.parametrize("method", ["finite_difference", "exact"])
def test_dotprod_trainer_float64_equals_numpy(float64, method):
    """weight 0.1, alpha 0.3 (the gradient of the MSE of a linear model is affine, so the
    finite difference is -H2 G1 for any alpha), uncapped, outer package SGD(0.1), 2 steps:
    weights and the logged loss == NumPy at 1e-13."""
    from tf_metaalign.trainers import DotProdTrainer

    x, y = _data(16)
    weight, alpha, lr = 0.1, 0.3, 0.1
    trainer = DotProdTrainer(_linear(3), weight=weight, alpha=alpha, method=method, alignment="dot")
    trainer.compile(optimizer=O.SGD(lr), loss="mse")
    theta = _weights(trainer.model)
    history = trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    losses = []
    for s in (0, 8):
        b1, b2 = (x[s : s + 4], y[s : s + 4]), (x[s + 4 : s + 8], y[s + 4 : s + 8])
        g1, g2 = _grad(theta, *b1), _grad(theta, *b2)
        if method == "exact":  # H2 G1 = G2(theta + G1) - G2(theta): affine gradient
            reg = [-(a - b) for a, b in zip(_grad([t + g for t, g in zip(theta, g1)], *b2), g2)]
        else:
            g21 = _grad([t - alpha * g for t, g in zip(theta, g1)], *b2)
            reg = [(a - b) / alpha for a, b in zip(g21, g2)]
        losses.append(0.5 * (_mse(theta, *b1) + _mse(theta, *b2)))
        theta = [t - lr * (a + b + weight * r) for t, a, b, r in zip(theta, g1, g2, reg)]
    # The FD quotient divides rounding errors of G21 - G2 by alpha: 1e-12.
    _assert_close(_weights(trainer.model), theta, dict(rtol=1e-12, atol=1e-15))
    np.testing.assert_allclose(history.history["loss"][0], np.mean(losses), **TOL)


def _mse(params, x, y):
    w, b = params
    return float(np.mean((x @ w + b - y) ** 2))


def test_dotprod_two_replicas_uneven_batch_float64_equals_numpy(float64):
    """Two replicas, a last global batch of 3 (2 + 1 examples: a plain step on (b, b),
    each replica's gradient weighted by n_r * R / N = 4/3 and 2/3, not exact in
    float32): NumPy to 1e-13."""
    from conftest import two_cpu_strategy
    from tf_metaalign.trainers import DotProdTrainer

    x, y = _data(11)
    weight, alpha, lr = 0.1, 0.3, 0.1
    strategy = two_cpu_strategy()
    with strategy.scope():
        trainer = DotProdTrainer(_linear(4), weight=weight, alpha=alpha, alignment="dot")
        trainer.compile(optimizer=O.SGD(lr), loss="mse")
    theta = _weights(trainer.model)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    # Step 1: replica r splits its 4 rows [4r, 4r + 4): b1 = {0, 1, 4, 5}, b2 = {2, 3, 6, 7}.
    b1 = (x[[0, 1, 4, 5]], y[[0, 1, 4, 5]])
    b2 = (x[[2, 3, 6, 7]], y[[2, 3, 6, 7]])
    g1, g2 = _grad(theta, *b1), _grad(theta, *b2)
    g21 = _grad([t - alpha * g for t, g in zip(theta, g1)], *b2)
    theta = [t - lr * (a + b + weight * (c - b) / alpha) for t, a, b, c in zip(theta, g1, g2, g21)]
    # Step 2: 3 examples, a plain step on (b, b): 2 * the gradient of the global mean.
    theta = [t - lr * 2.0 * g for t, g in zip(theta, _grad(theta, x[8:], y[8:]))]
    _assert_close(_weights(trainer.model), theta, dict(rtol=1e-12, atol=1e-15))


# ------------------------------------------------------------------ guided learning


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


@pytest.mark.parametrize("momentum", [None, 0.3])
def test_guided_trainer_float64_equals_numpy(float64, momentum):
    """SGD(0.1) (with momentum 0.3: learned as beta_1 through the capped sigmoid) whose
    learning-rate scale (and momentum) a meta SGD(0.3) learns on a guidance batch, 3
    steps: the weights and raw values == NumPy at 1e-13."""
    from tf_metaalign.trainers.guided import GuidedTrainer

    x, y = _data(24)
    xg, yg = _data(6, seed=5)
    lr, meta_lr = 0.1, 0.3
    trainer = GuidedTrainer(_linear(2), (xg, yg), meta_optimizer=O.SGD(meta_lr))
    trainer.compile(O.SGD(lr) if momentum is None else O.SGD(lr, momentum=momentum), loss="mse")
    theta = _weights(trainer.model)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    m = [np.zeros_like(t) for t in theta]
    raw_lr = 0.0
    raw_mu = None if momentum is None else np.log(momentum) - np.log1p(-momentum)
    for s in range(0, 24, 8):
        g = _grad(theta, x[s : s + 8], y[s : s + 8])
        lr_eff = lr * np.exp(raw_lr)
        if raw_mu is None:
            new = [t - lr_eff * a for t, a in zip(theta, g)]
        else:
            mu = min(_sigmoid(raw_mu), 1.0 - 1e-5)
            m_new = [mu * b - lr_eff * a for b, a in zip(m, g)]
            new = [t + b for t, b in zip(theta, m_new)]
        v = _grad(new, xg, yg)
        h_lr = sum(np.sum(a * (-lr_eff * b)) for a, b in zip(v, g))
        if raw_mu is not None:
            h_mu = sum(np.sum(a * (mu * (1 - mu) * b)) for a, b in zip(v, m))
            raw_mu = raw_mu - meta_lr * h_mu
            m = m_new
        raw_lr = raw_lr - meta_lr * h_lr
        theta = new
    _assert_close(_weights(trainer.model), theta)
    np.testing.assert_allclose(trainer.guided.raw["learning_rate"].numpy(), raw_lr, **TOL)
    if raw_mu is not None:
        np.testing.assert_allclose(trainer.guided.raw["beta_1"].numpy(), raw_mu, **TOL)
        assert raw_mu != np.log(momentum) - np.log1p(-momentum)  # it moved


def test_guided_activation_cap_is_exact(float64):
    from tf_metaalign.algorithms import guided as G

    capped = G.activate("beta_1", tf.constant(30.0, tf.float64))
    assert float(capped) == 1.0 - 1e-5


# ------------------------------------------------------------------ gradient surgery


def test_combine_takes_python_coefficients_exactly():
    from tf_metaalign.algorithms import gradient_surgery as S

    g = [[tf.constant([1.0, 3.0], tf.float64)], [tf.constant([-2.0, 5.0], tf.float64)]]
    out = S.combine(g, [0.1, 0.4])
    assert out[0].dtype == tf.float64
    np.testing.assert_array_equal(
        out[0].numpy(), 0.1 * np.array([1.0, 3.0]) + 0.4 * np.array([-2.0, 5.0])
    )


def test_gradnorm_update_takes_python_lists_exactly():
    from tf_metaalign.algorithms import gradient_surgery as S

    w = np.array([1.3, 0.7])
    norms, losses, initial = [0.3, 0.9], [0.7, 0.2], [1.1, 0.6]
    out = S.gradnorm_update(
        tf.constant(w), norms, losses, initial, alpha=1.5, learning_rate=0.1
    ).numpy()
    ratio = np.array(losses) / np.array(initial)
    r = ratio / ratio.mean()
    target = (w * np.array(norms)).mean() * r**1.5
    new = w - 0.1 * np.sign(w * np.array(norms) - target) * np.array(norms)
    np.testing.assert_allclose(out, new * 2 / new.sum(), **TOL)


def test_gradient_sharing_gates_take_python_logits_exactly():
    from tf_metaalign.algorithms.gradient_sharing import GradientSharing

    h = [tf.constant([1.0, -2.0], tf.float64)]
    g = [tf.constant([0.5, 3.0], tf.float64)]
    s = _sigmoid(0.4)
    out = GradientSharing.combine(h, g, 0.4)[0].numpy()
    np.testing.assert_allclose(
        out, s * np.array([1.0, -2.0]) + (1 - s) * np.array([0.5, 3.0]), **TOL
    )
    out = GradientSharing.update_g_hat(g, h, 0.4, True)[0].numpy()
    np.testing.assert_allclose(
        out, s * np.array([0.5, 3.0]) + (1 - s) * np.array([1.0, -2.0]), **TOL
    )


def test_dotprod_gradient_scale_is_exact(float64):
    """A python `gradient_scale` of 0.3 unscales G1 for the diagnostics exactly."""
    from tf_metaalign.algorithms.dotprod import dotprod_gradient

    x, y = _data(8)
    model = _linear(5)
    loss = F.make_loss_fn(model, keras.losses.MeanSquaredError())

    def scaled(p, s, b):
        value, aux = loss(p, s, b)
        return value * 0.3, aux

    params = F.current_params(model)
    r = dotprod_gradient(
        scaled,
        params,
        F.current_state(model),
        (x[:4], y[:4]),
        (x[4:], y[4:]),
        weight=0.1,
        alpha=0.3,
        gradient_scale=0.3,
    )
    theta = [p.numpy() for p in params]
    g1, g2 = _grad(theta, x[:4], y[:4]), _grad(theta, x[4:], y[4:])
    np.testing.assert_allclose(float(r.grad_dot), sum(np.sum(a * b) for a, b in zip(g1, g2)), **TOL)
