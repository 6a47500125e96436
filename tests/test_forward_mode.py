"""Forward-mode tangents (tf_metaalign.forward_mode) against float64 finite differences.

The guided-learning hypergradient is <v, tangent>, so every optimizer rule's tangent with
respect to every hyperparameter it reads is checked here, together with the promise that
the primal is exactly `rule.update` (the committed update is the optimizer's update).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from optimizer_registry import REGISTRY
from tf_metaalign import forward_mode as fm
from tf_metaalign import optimizers as O

#: variables of several ranks, with paths that switch the path-dependent options (a bias:
#: no weight decay or layer adaptation in AdamWeightDecay/Lamb, no parameter scale in
#: adafactor_t5_momentum).
VARIABLES = [
    ("dense/kernel", (6, 4)),
    ("einsum/kernel", (2, 3, 5)),
    ("dense/bias", (7,)),
    ("scalar/w", ()),
]


def _linear_in_learning_rate(opt):
    """Whether the step is learning_rate * (something independent of it): not SGD with
    momentum (the buffer holds earlier rates) nor Adafactor with beta_1 or weight decay."""
    if isinstance(opt, O.SGD):
        return opt.momentum == 0
    if isinstance(opt, O.Adafactor):
        return opt.beta_1 is None and opt.weight_decay_rate is None
    return isinstance(opt, (O.Adam, O.AdamWeightDecay, O.Lamb))


def _options(opt, path, shape):
    """The options the optimizer decides for a variable at `path` (as build() does)."""
    scope, name = path.split("/")
    with keras.name_scope(scope):
        return opt.variable_options(keras.Variable(np.zeros(shape, "float32"), name=name))


def _inputs(rule, shape, options, seed):
    rng = np.random.default_rng(seed)
    w = tf.constant(rng.normal(size=shape), tf.float64)
    g = tf.constant(rng.normal(size=shape), tf.float64)
    slots = {}
    for name, slot_shape in rule.slot_shapes(shape, options).items():
        value = rng.uniform(0.05, 0.5, size=slot_shape)
        if name == "m" or name == "momentum":
            value = rng.normal(size=slot_shape) * 0.3
        slots[name] = tf.constant(value, tf.float64)
    return w, g, slots


def _hyperparameters(rule):
    values = {"learning_rate": 0.03}
    for name in rule.hyperparameter_names:
        default = rule.defaults.get(name)
        if default is not None and name != "epsilon":
            values[name] = default
    return values


@pytest.mark.parametrize("variable", VARIABLES, ids=lambda v: v[0])
@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_rule_tangent_equals_central_difference_and_primal_is_the_update(key, variable):
    opt = REGISTRY[key].factory()
    rule = opt.rule
    path, shape = variable
    options = _options(opt, path, shape)
    w, g, slots = _inputs(rule, shape, options, seed=len(shape) + 3)
    values = _hyperparameters(rule)
    names = sorted(values)
    step = 4.0

    def update_at(hv):
        hp = {n: tf.constant(hv[n], tf.float64) for n in names}
        return rule.update(g, w, slots, hp, step, options)

    duals = {
        n: fm.seed(tf.constant(values[n], tf.float64), len(names), k) for k, n in enumerate(names)
    }
    new_w, new_slots = rule.update(g, w, slots, duals, step, options)
    tangents = fm.tangents(new_w, len(names))

    plain_w, plain_slots = update_at(values)
    np.testing.assert_array_equal(fm.primal(new_w).numpy(), plain_w.numpy())
    for k in plain_slots:
        np.testing.assert_array_equal(fm.primal(new_slots[k]).numpy(), plain_slots[k].numpy())

    for k, name in enumerate(names):
        eps = 1e-6 * max(1.0, abs(values[name]))
        plus = update_at(dict(values, **{name: values[name] + eps}))[0].numpy()
        minus = update_at(dict(values, **{name: values[name] - eps}))[0].numpy()
        fd = (plus - minus) / (2 * eps)
        t = tangents[k].numpy()
        assert t.shape == tuple(shape)
        np.testing.assert_allclose(t, fd, rtol=1e-5, atol=1e-8, err_msg=f"{key}/{name}")
        if name == "learning_rate" and _linear_in_learning_rate(opt):
            # These rules are linear in the learning rate: the tangent is the step itself.
            step_taken = (plain_w - w).numpy() / values["learning_rate"]
            np.testing.assert_allclose(t, step_taken, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("key", ["adam", "lamb", "adafactor_factored_momentum"])
def test_primal_is_bitwise_the_float32_update_in_a_graph(key):
    rule = REGISTRY[key].factory().rule
    shape = (64, 48)
    rng = np.random.default_rng(0)
    w = tf.constant(rng.normal(size=shape), tf.float32)
    g = tf.constant(rng.normal(size=shape) * 1e-2, tf.float32)
    options = rule.default_options(shape)
    slots = {
        n: tf.constant(rng.uniform(1e-6, 1e-3, size=s), tf.float32)
        for n, s in rule.slot_shapes(shape, options).items()
    }
    hp = {n: tf.constant(v, tf.float64) for n, v in _hyperparameters(rule).items()}
    hp["learning_rate"] = tf.constant(1e-3, tf.float32)

    @tf.function
    def both():
        plain = rule.update(g, w, slots, hp, 3.0, options)[0]
        duals = {n: fm.seed(v, len(hp), k) for k, (n, v) in enumerate(sorted(hp.items()))}
        return plain, fm.primal(rule.update(g, w, slots, duals, 3.0, options)[0])

    plain, dual = both()
    np.testing.assert_array_equal(plain.numpy(), dual.numpy())


def test_elementary_chain_rules():
    x, y = 1.7, 0.6

    def f(a, b):
        return (a**b) * tf.sqrt(a) / tf.exp(b) - tf.math.rsqrt(a) + tf.square(b) * tf.sigmoid(a)

    def f64(a, b):
        return f(tf.constant(a, tf.float64), tf.constant(b, tf.float64)).numpy()

    out, (da, db) = fm.jvp(
        f, [tf.constant(x, tf.float64), tf.constant(y, tf.float64)], [[1.0, None], [None, 1.0]]
    )
    eps = 1e-6
    np.testing.assert_allclose(out.numpy(), f64(x, y))
    np.testing.assert_allclose(
        da.numpy(), (f64(x + eps, y) - f64(x - eps, y)) / (2 * eps), rtol=1e-8
    )
    np.testing.assert_allclose(
        db.numpy(), (f64(x, y + eps) - f64(x, y - eps)) / (2 * eps), rtol=1e-8
    )


def test_max_min_where_follow_tensorflow_gradient_conventions():
    a = tf.constant([1.0, 2.0, 3.0], tf.float64)
    b = tf.constant([1.0, 5.0, 0.0], tf.float64)
    directions = [[tf.ones(3, tf.float64), None], [None, tf.ones(3, tf.float64)]]
    _, (da, db) = fm.jvp(tf.maximum, [a, b], directions)
    np.testing.assert_array_equal(da.numpy(), [1.0, 0.0, 1.0])  # tie -> x, like TF's gradient
    np.testing.assert_array_equal(db.numpy(), [0.0, 1.0, 0.0])
    _, (da, db) = fm.jvp(tf.minimum, [a, b], directions)
    np.testing.assert_array_equal(da.numpy(), [1.0, 1.0, 0.0])
    _, (dw,) = fm.jvp(
        lambda s: tf.where(a > 1.5, s * a, 1.0), [tf.constant(2.0, tf.float64)], [[1.0]]
    )
    np.testing.assert_array_equal(dw.numpy(), [0.0, 2.0, 3.0])


def test_a_scalar_tangent_is_broadcast_before_reductions_and_reshapes():
    """`s + zeros((3, 4))` keeps a scalar tangent; a sum over the 12 elements must be 12."""
    zeros = tf.zeros((3, 4), tf.float64)
    s = tf.constant(0.5, tf.float64)
    _, (t,) = fm.jvp(lambda v: tf.reduce_sum(v + zeros), [s], [[1.0]])
    assert float(t) == 12.0
    _, (t,) = fm.jvp(lambda v: tf.reduce_mean(v + zeros, axis=0), [s], [[1.0]])
    np.testing.assert_array_equal(t.numpy(), np.ones(4))
    _, (t,) = fm.jvp(lambda v: tf.expand_dims(v + zeros, 1), [s], [[1.0]])
    assert t.shape == (3, 1, 4)
    _, (t,) = fm.jvp(lambda v: v + zeros, [s], [[1.0]])
    assert t.shape == (3, 4)  # `tangents` expands to the primal's shape


def test_no_tangent_costs_nothing_and_comparisons_are_plain():
    x = tf.constant([1.0, -2.0])
    dual = fm.seed(tf.constant(3.0), 2, 0)
    out = dual * x
    assert isinstance(out, fm.Dual) and out.tangents[1] is None
    assert not isinstance(x * 2.0, fm.Dual)
    assert (dual > 2.0).dtype == tf.bool
    assert isinstance(tf.ones_like(dual), tf.Tensor)


def test_an_op_without_a_rule_is_a_clear_error():
    dual = fm.seed(tf.constant(0.3), 1, 0)
    with pytest.raises(TypeError, match="forward_mode"):
        tf.math.tanh(dual)
    with pytest.raises(TypeError, match="truth value"):
        bool(dual)


# --------------------------------------------------------------- the support probe


class _AtanSGDRule(O.SGDRule):
    """SGD followed by an op without a forward-mode rule (tf.math.atan)."""

    def update(self, grad, var, slots, hparams, step, options=None):
        new_var, new_slots = super().update(grad, var, slots, hparams, step, options)
        return tf.math.atan(new_var), new_slots


class _NormClippedAdamRule(O.AdamRule):
    """Adam whose step is rescaled by a tf.linalg.norm (no forward-mode rule)."""

    def update(self, grad, var, slots, hparams, step, options=None):
        new_var, new_slots = super().update(grad, var, slots, hparams, step, options)
        step_taken = new_var - var
        return var + step_taken / (1.0 + tf.linalg.norm(step_taken)), new_slots


class _AtanSGD(O.BaseOptimizer):
    def __init__(self, learning_rate=0.1, name="AtanSGD", **kwargs):
        super().__init__(learning_rate, _AtanSGDRule(), name=name, **kwargs)


class _NormClippedAdam(O.BaseOptimizer):
    differentiable_hyperparameters = ("learning_rate", "beta_1")

    def __init__(self, learning_rate=0.1, name="NormClippedAdam", **kwargs):
        super().__init__(
            learning_rate,
            _NormClippedAdamRule(),
            variable_hyperparameters={"beta_1": 0.9},
            name=name,
            **kwargs,
        )


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_registry_optimizer_supports_forward_mode(key):
    assert O.forward_mode_error(REGISTRY[key].factory()) is None


@pytest.mark.parametrize("make, op", [(_AtanSGD, "Atan"), (_NormClippedAdam, "norm")])
def test_a_rule_with_an_op_without_forward_mode_is_reported_unsupported(make, op):
    optimizer = make()
    # the optimizer itself trains normally: only its forward mode is missing
    v = keras.Variable(np.ones((2, 3), "float32"))
    optimizer.apply_gradients([(np.ones((2, 3), "float32"), v)])
    assert not O.supports_forward_mode(optimizer)
    reason = O.forward_mode_error(optimizer)
    assert type(optimizer).__name__ in reason and "forward_mode" in reason
    with pytest.raises(ValueError, match="forward mode.*" + type(optimizer).__name__):
        O.check_optimizer(optimizer, "GuidedTrainer")
    assert O.supports_forward_mode(O.SGD(0.1)) and O.supports_forward_mode(O.Adam(0.1))


def test_supported_optimizers_come_from_the_probe():
    assert O.supported_optimizers() == (
        "Adafactor",
        "Adam",
        "AdamW",
        "AdamWeightDecay",
        "Lamb",
        "RecAdam",
        "SGD",
    )
    assert [c.__name__ for c in O.optimizer_classes()] == list(O.supported_optimizers())
    assert not O.supports_forward_mode(keras.optimizers.Adam(0.1))
