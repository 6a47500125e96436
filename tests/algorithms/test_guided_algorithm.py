"""The greedy hypergradient (tf_metaalign.algorithms.guided) against float64 oracles."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from optimizer_registry import REGISTRY
from tf_metaalign import functional as F
from tf_metaalign import optimizers as opt_lib
from tf_metaalign.algorithms import guided
from tf_metaalign.optimizers.base import apply_rule


def _mse(y, p, sample_weight=None):
    return tf.reduce_mean(tf.square(y - p))


def _model64(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    return model


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = rng.normal(size=(n, 2))
    return tf.constant(x), tf.constant(y)


# Every configuration of the shared registry (tests/optimizer_registry.py), learning every
# hyperparameter it can differentiate.
OPTIMIZERS = {
    name: (config.factory, config.factory().differentiable_hyperparameters)
    for name, config in REGISTRY.items()
}


def _setup(make_opt, warmup_steps=2):
    """A float64 model, its optimizer's rule/options and non-trivial slots at step 3."""
    model = _model64()
    optimizer = make_opt()
    optimizer.build(model.trainable_variables)
    rule = optimizer.rule
    options = [optimizer.options_for(v) for v in model.trainable_variables]
    params = F.current_params(model)
    state = F.current_state(model)
    loss_fn = F.make_loss_fn(model, _mse, training=True)
    slots = [rule.init_slots(p, o) for p, o in zip(params, options)]
    base = {"learning_rate": tf.constant(0.05, tf.float64)}
    for name, v in rule.defaults.items():
        if v is not None:
            base[name] = tf.constant(v, tf.float64)
    # A few real steps so the slots (momenta, second moments) are non-trivial.
    for step in range(1, warmup_steps + 1):
        _, g, _ = F.value_and_grad(loss_fn, params, state, _data(8, 100 + step))
        new = [
            rule.update(gi, p, s, base, float(step), o)
            for gi, p, s, o in zip(g, params, slots, options)
        ]
        params = [n[0] for n in new]
        slots = [n[1] for n in new]
    _, g, _ = F.value_and_grad(loss_fn, params, state, _data(8, 7))
    guide_fn = F.make_loss_fn(model, _mse, training=False)
    return dict(
        rule=rule,
        grads=g,
        params=params,
        slots=slots,
        options=options,
        base_hparams=base,
        step=float(warmup_steps + 1),
        state=state,
        guidance_batch=_data(6, 11),
        guide_fn=guide_fn,
        optimizer=optimizer,
    )


def _raw_point(names, rule):
    # Away from the initial values, so the test is not special to raw=0 / the default.
    raw = {}
    for n in names:
        base = guided.initial_raw(n, rule.defaults.get(n))
        raw[n] = tf.constant(base + (0.3 if n == "learning_rate" else -0.2), tf.float64)
    return raw


def _hypergradients(s, raw):
    """`guided.hypergradients` at `_setup`'s point `s` and the raw hyperparameters `raw`."""
    return guided.hypergradients(
        s["guide_fn"],
        s["rule"],
        s["grads"],
        s["params"],
        s["slots"],
        s["options"],
        s["base_hparams"],
        raw,
        s["step"],
        s["state"],
        s["guidance_batch"],
    )


def _guide_loss_at(s, raw):
    hp = guided.hyperparameters_from_raw(s["base_hparams"], raw)
    new, _ = apply_rule(s["rule"], s["grads"], s["params"], s["slots"], s["options"], hp, s["step"])
    return float(s["guide_fn"](new, s["state"], s["guidance_batch"])[0])


@pytest.mark.parametrize("key", sorted(OPTIMIZERS))
def test_hypergradient_equals_central_finite_difference(key):
    make_opt, names = OPTIMIZERS[key]
    s = _setup(make_opt)
    raw = _raw_point(names, s["rule"])
    result = _hypergradients(s, raw)
    for name in names:
        eps = 1e-5
        plus = dict(raw, **{name: raw[name] + eps})
        minus = dict(raw, **{name: raw[name] - eps})
        fd = (_guide_loss_at(s, plus) - _guide_loss_at(s, minus)) / (2 * eps)
        h = float(result.hypergradients[name])
        assert abs(fd) > 1e-8, f"{key}/{name}: degenerate test (zero derivative)"
        np.testing.assert_allclose(h, fd, rtol=1e-6, atol=1e-10, err_msg=f"{key}/{name}")


def test_sgd_closed_form():
    s = _setup(OPTIMIZERS["sgd"][0])
    raw = {"learning_rate": tf.constant(0.4, tf.float64)}
    lr = float(s["base_hparams"]["learning_rate"])
    result = _hypergradients(s, raw)
    new = [p - lr * math.exp(0.4) * g for p, g in zip(s["params"], s["grads"])]
    for a, b in zip(result.new_params, new):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12)
    _, v, _ = F.value_and_grad(s["guide_fn"], new, s["state"], s["guidance_batch"])
    closed = -lr * math.exp(0.4) * float(F.dot(v, s["grads"]))
    np.testing.assert_allclose(float(result.hypergradients["learning_rate"]), closed, rtol=1e-10)


def test_activations_and_initial_values():
    assert guided.initial_raw("learning_rate", 0.123) == 0.0
    np.testing.assert_allclose(float(guided.activate("learning_rate", 0.0)), 1.0)
    for b in (0.1, 0.5, 0.9):
        np.testing.assert_allclose(
            float(
                guided.activate("beta_1", tf.constant(guided.initial_raw("beta_1", b), tf.float64))
            ),
            b,
            rtol=1e-12,
        )
    # Configured 0 / None: the floor, so the sigmoid has a gradient.
    np.testing.assert_allclose(
        float(
            guided.activate("beta_1", tf.constant(guided.initial_raw("beta_1", 0.0), tf.float64))
        ),
        guided.SIGMOID_INIT_FLOOR,
    )
    # The cap.
    assert float(guided.activate("beta_1", tf.constant(50.0, tf.float64))) == pytest.approx(
        1 - 1e-5
    )


def test_sanitize_like_the_reference():
    h = {
        "a": tf.constant(np.nan),
        "b": tf.constant(np.inf),
        "c": tf.constant(-np.inf),
        "d": tf.constant(3.0, tf.float64),
    }
    out, loss, n_bad = guided.reduce_and_sanitize(h, tf.constant(1.0))
    assert float(out["a"]) == 0.0 and float(out["b"]) == 10.0 and float(out["c"]) == -10.0
    assert float(out["d"]) == 3.0  # finite values are not clipped
    assert int(n_bad) == 3 and float(loss) == 1.0


def test_meta_update_is_adam_on_raw():
    rule = opt_lib.AdamRule()
    raw = {"learning_rate": tf.constant(0.0, tf.float64)}
    slots = {"learning_rate": rule.init_slots(raw["learning_rate"], None)}
    out = guided.meta_update(
        rule,
        raw,
        slots,
        {"learning_rate": tf.constant(2.0, tf.float64)},
        {"learning_rate": 0.1},
        1.0,
    )
    new_raw, _ = out["learning_rate"]
    # First Adam step moves by ~ -lr * sign(h).
    np.testing.assert_allclose(float(new_raw), -0.1, rtol=1e-5)


def test_committed_update_groups_cover_every_variable_once_largest_first():
    shapes = [(784, 64), (64,), (64, 64), (64,), (64, 10), (10,)] + [(3, 3)] * 20
    params = [tf.zeros(s) for s in shapes]
    groups = guided._update_groups(params, max_groups=4)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(params)))
    sizes = [int(np.prod(s)) for s in shapes]
    assert [sizes[i] for i in flat] == sorted(sizes, reverse=True)
    assert len(groups) <= 5 and groups[0] == [0]
    assert guided._update_groups([]) == []
