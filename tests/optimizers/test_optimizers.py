"""Tests for tf_metaalign.optimizers: one battery applied to every optimizer (optax style).

The NumPy oracles below are written from the reference formulas (Mesh TensorFlow / t5x
Adafactor, tensor2tensor Adafactor, BERT AdamWeightDecayOptimizer, BERT/ALBERT LAMB, tf-addons
LAMB, Keras SGD/Adam), in float64, without calling the package's TF code.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from optimizer_registry import REGISTRY, learning_rate_at
from tf_metaalign import optimizers as O

# ---------------------------------------------------------------------------------------------
# Variables: rank 0-3, including shapes where T5 and Pegasus factoring differ, with Keras paths
# that exercise BERT's exclusions.
VARIABLES = [
    ("scalar/w", ()),
    ("dense/bias", (7,)),
    ("layer_norm/gamma", (16,)),
    ("zero_init/w", (9,)),  # ||w|| = 0: LAMB's trust ratio 1, Adafactor's epsilon_2 floor
    ("dense/kernel", (64, 32)),  # T5: unfactored (32 < 128); Pegasus: factored
    ("attention/kernel", (512, 256)),
    ("einsum/kernel", (4, 256, 192)),
    ("einsum_t/kernel", (256, 4, 192)),  # T5: axes (0, 2); Pegasus: axes (1, 2)
    ("tied/kernel", (20, 16, 16)),  # a tie: Mesh TF factors axes 0 and 1 (not 0 and 2)
]
STEPS = 5

# name -> (factory, oracle config): the shared registry (tests/optimizer_registry.py).
CASES = {name: (config.factory, config.oracle) for name, config in REGISTRY.items()}


def make_variables(dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for path, shape in VARIABLES:
        scope, name = path.split("/")
        with keras.name_scope(scope):
            value = rng.normal(size=shape).astype("float32")
            if scope == "zero_init":
                value = np.zeros(shape, "float32")
            out.append(keras.Variable(value, name=name, dtype=dtype))
    return out


def make_gradients(step, seed=1):
    rng = np.random.default_rng(seed + 1000 * step)
    # Different scales per variable so update clipping and trust ratios are exercised.
    return [
        (rng.normal(size=s) * (0.1 + i)).astype("float32") for i, (_, s) in enumerate(VARIABLES)
    ]


# ---------------------------------------------------------------------------------------------
# NumPy oracles (float64), one function per reference.


def _rms(x):
    return np.sqrt(np.mean(np.square(x)))


def _excluded(path, patterns):
    return any(re.search(p, path) for p in patterns)


def oracle_sgd(c, path, w, g, state, t):
    lr = learning_rate_at(c, t - 1)
    if c["momentum"] == 0:
        return w - lr * g
    m = c["momentum"] * state.get("m", 0.0) - lr * g  # keras.optimizers.SGD
    state["m"] = m
    if c["nesterov"]:
        return w + c["momentum"] * m - lr * g
    return w + m


def oracle_adam(c, path, w, g, state, t):
    m = c["b1"] * state.get("m", 0.0) + (1 - c["b1"]) * g
    v = c["b2"] * state.get("v", 0.0) + (1 - c["b2"]) * g * g
    state.update(m=m, v=v)
    alpha = learning_rate_at(c, t - 1) * np.sqrt(1 - c["b2"] ** t) / (1 - c["b1"] ** t)
    return w - alpha * m / (np.sqrt(v) + c["eps"])


def oracle_keras_adamw(c, path, w, g, state, t):
    # keras.optimizers.AdamW: the decay (this step's rate), then Adam from the decayed w
    w = w - w * c["wd"] * learning_rate_at(c, t - 1)
    return oracle_adam(c, path, w, g, state, t)


def oracle_bert_adam(c, path, w, g, state, t):
    # google-research/bert optimization.py AdamWeightDecayOptimizer.apply_gradients
    next_m = c["b1"] * state.get("m", 0.0) + (1 - c["b1"]) * g
    next_v = c["b2"] * state.get("v", 0.0) + (1 - c["b2"]) * np.square(g)
    update = next_m / (np.sqrt(next_v) + c["eps"])
    if c["wd"] and not _excluded(path, c["exclude"]):
        update += c["wd"] * w
    state.update(m=next_m, v=next_v)
    return w - learning_rate_at(c, t - 1) * update


def oracle_lamb(c, path, w, g, state, t):
    # BERT/ALBERT lamb_optimizer.py; tf-addons lamb.py when bias-corrected
    next_m = c["b1"] * state.get("m", 0.0) + (1 - c["b1"]) * g
    next_v = c["b2"] * state.get("v", 0.0) + (1 - c["b2"]) * np.square(g)
    state.update(m=next_m, v=next_v)
    m, v = next_m, next_v
    if c["bc"]:
        m, v = m / (1 - c["b1"] ** t), v / (1 - c["b2"] ** t)
    update = m / (np.sqrt(v) + c["eps"])
    if c["wd"] and not _excluded(path, c["exclude"]):
        update += c["wd"] * w
    la_patterns = c["exclude"] if c["exclude_la"] is None else c["exclude_la"]
    ratio = 1.0
    if not _excluded(path, la_patterns):
        w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(update)
        if w_norm > 0 and g_norm > 0:
            ratio = w_norm / g_norm
    return w - ratio * learning_rate_at(c, t - 1) * update


def oracle_mesh_adafactor(c, path, w, g, state, t):
    # mesh_tensorflow/optimize.py AdafactorOptimizer.apply_grad (+ t5x step_offset,
    # weight_decay_rate, exclusion from parameter scale); global step = t - 1.
    decay_rate = 1.0 - (t - c["offset"]) ** -0.8 if t > c["offset"] else 0.0
    grad_squared = np.square(g) + 1e-30
    shape = w.shape
    factored = None
    if c["factored"] and len(shape) >= 2:
        sorted_dims = sorted(range(len(shape)), key=lambda d: -shape[d])  # stable, as Mesh
        if shape[sorted_dims[1]] >= c["min_dim"]:
            factored = sorted_dims[:2]
    lr = learning_rate_at(c, t - 1)
    update_scale = lr
    if c["parameter_scale"] and not _excluded(path, c["exclude_ps"]):
        update_scale = max(_rms(w), 1e-3) * lr
    if factored:
        d0, d1 = factored
        vr = decay_rate * state.get("vr", 0.0) + (1 - decay_rate) * grad_squared.mean(axis=d0)
        vc = decay_rate * state.get("vc", 0.0) + (1 - decay_rate) * grad_squared.mean(axis=d1)
        state.update(vr=vr, vc=vc)
        vr_full = np.expand_dims(vr, d0)  # indexed by d1 (and any unfactored dims)
        vc_full = np.expand_dims(vc, d1)  # indexed by d0
        long_term_mean = vr_full.mean(axis=d1, keepdims=True)
        x = g / np.sqrt(vr_full / long_term_mean) / np.sqrt(vc_full)
    else:
        v = decay_rate * state.get("v", 0.0) + (1 - decay_rate) * grad_squared
        state["v"] = v
        x = g / np.sqrt(v)
    if c["clipping"] is not None:
        x = x / max(1.0, _rms(x) / c["clipping"])
    subtrahend = x * update_scale
    if c["b1"] is not None:
        subtrahend = state.get("m", 0.0) * c["b1"] + subtrahend * (1 - c["b1"])
        state["m"] = subtrahend
    if c["wd"] is not None:
        return (1 - c["wd"]) * w - subtrahend
    return w - subtrahend


def oracle_t2t_adafactor(c, path, w, g, state, t):
    # tensor2tensor/utils/adafactor.py _resource_apply_dense (beta1=0, factored, param scale)
    decay_rate = 1.0 - t**-0.8
    mixing_rate = 1.0 - decay_rate
    grad_squared = np.square(g) + 1e-30
    update_scale = learning_rate_at(c, t - 1) * max(_rms(w), 1e-3)
    if w.ndim >= 2:
        vr = decay_rate * state.get("vr", 0.0) + mixing_rate * grad_squared.mean(axis=-1)
        vc = decay_rate * state.get("vc", 0.0) + mixing_rate * grad_squared.mean(axis=-2)
        state.update(vr=vr, vc=vc)
        long_term_mean = vr.mean(axis=-1, keepdims=True)
        r_factor = 1 / np.sqrt(vr / long_term_mean)
        c_factor = 1 / np.sqrt(vc)
        x = g * r_factor[..., None] * c_factor[..., None, :]
    else:
        v = decay_rate * state.get("v", 0.0) + mixing_rate * grad_squared
        state["v"] = v
        x = g / np.sqrt(v)
    x = x / max(1.0, _rms(x) / 1.0)
    return w - x * update_scale


def oracle_recadam(c, path, w, g, state, t):
    # Sanyuan-Chen/RecAdam RecAdam.py RecAdam.step (torch in-place ops, re-derived in NumPy)
    pp = state.setdefault("pp", w.copy())  # the pretrained weights: the initial values
    exp_avg = c["b1"] * state.get("m", 0.0) + (1.0 - c["b1"]) * g
    exp_avg_sq = c["b2"] * state.get("v", 0.0) + (1.0 - c["b2"]) * g * g
    state.update(m=exp_avg, v=exp_avg_sq)
    denom = np.sqrt(exp_avg_sq) + c["eps"]
    lr = learning_rate_at(c, t - 1)
    step_size = lr
    if c["bias"]:
        step_size = step_size * np.sqrt(1.0 - c["b2"] ** t) / (1.0 - c["b1"] ** t)
    p = w.copy()
    if c["w"] > 0.0:
        if c["fun"] == "sigmoid":
            lam = float(1 / (1 + np.exp(-c["k"] * (t - c["t0"])))) * c["w"]
        elif c["fun"] == "linear":
            lam = min(1, t / c["t0"]) * c["w"]
        else:
            lam = c["w"]
        p = p + (-step_size * lam) * exp_avg / denom
        p = p + (-lr * (c["w"] - lam) * c["cof"]) * (p - pp)
    else:
        p = p + (-step_size) * exp_avg / denom
    if c["wd"] > 0.0:
        p = p + (-lr * c["wd"]) * p
    return p


ORACLES = {
    "recadam": oracle_recadam,
    "sgd": oracle_sgd,
    "adam": oracle_adam,
    "keras_adamw": oracle_keras_adamw,
    "bert_adam": oracle_bert_adam,
    "lamb": oracle_lamb,
    "mesh_adafactor": oracle_mesh_adafactor,
    "t2t_adafactor": oracle_t2t_adafactor,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
    factory, config = CASES[case]
    opt = factory()
    variables = make_variables()
    ws = [v.numpy().astype(np.float64) for v in variables]
    states = [{} for _ in variables]
    oracle = ORACLES[config["kind"]]
    for t in range(1, STEPS + 1):
        grads = make_gradients(t)
        opt.apply_gradients(zip(grads, variables))
        grads64 = [g.astype(np.float64) for g in grads]
        if config.get("clipnorm") is not None:  # the aggregated gradient, clipped as a whole
            norm = np.sqrt(sum(np.sum(np.square(g)) for g in grads64))
            grads64 = [g * config["clipnorm"] / max(norm, config["clipnorm"]) for g in grads64]
        ws = [
            oracle(config, path, w, g, s, t)
            for (path, _), w, g, s in zip(VARIABLES, ws, grads64, states)
        ]
    for (path, _), v, w in zip(VARIABLES, variables, ws):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-6, err_msg=f"{case} {path}")
        # the update actually moved the variable (guards against a vacuous pass)
    assert not np.allclose(variables[4].numpy(), make_variables()[4].numpy())


# ---------------------------------------------------------------------------------------------
# The contract: rule.update on the same inputs gives what apply_gradients gives.


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_equals_apply_gradients(case):
    opt = CASES[case][0]()
    variables = make_variables()
    opt.apply_gradients(zip(make_gradients(1), variables))  # non-trivial slots
    opt.learning_rate_scale.assign(0.5)
    hp_names = [n for n in opt.differentiable_hyperparameters if n != "learning_rate"]
    for name in hp_names:  # learned values assigned between steps are used
        opt.hyperparameter_variables[name].assign(0.8)
    # the aggregated gradient as the update uses it (clipped when aggregated_clipnorm is set)
    grads = opt.clip_aggregated(make_gradients(2))
    hparams = opt.current_hyperparameters()
    assert set(opt.differentiable_hyperparameters) <= set(hparams)
    step = opt.iterations + 1
    expected = []
    for g, v in zip(grads, variables):
        slots = {k: s.value for k, s in opt.slots_for(v).items()}
        assert tuple(slots) == opt.rule.slot_names(v.shape, opt.options_for(v))
        expected.append(opt.rule.update(g, v.value, slots, hparams, step, opt.options_for(v)))
    opt.apply_gradients(zip(make_gradients(2), variables))
    for v, (new_var, new_slots) in zip(variables, expected):
        np.testing.assert_allclose(v.numpy(), new_var.numpy(), rtol=0, atol=1e-7)
        for k, s in opt.slots_for(v).items():
            np.testing.assert_allclose(s.numpy(), new_slots[k].numpy(), rtol=0, atol=1e-7)


def test_options_resolve_for_tf_variable_and_bert_paths():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="feedforward_output_dense")(inputs)
    h = keras.layers.LayerNormalization(name="self_attention_layer_norm")(h)
    h = keras.layers.LayerNormalization()(h)  # default name "layer_normalization"
    model = keras.Model(inputs, keras.layers.EinsumDense("ab,bc->ac", (4,), bias_axes="c")(h))
    opt = O.Lamb(0.01)
    opt.build(model.trainable_variables)
    decay = {v.path: opt.options_for(v)["weight_decay"] for v in model.trainable_variables}
    assert decay == {
        "feedforward_output_dense/kernel": True,
        "feedforward_output_dense/bias": False,
        "self_attention_layer_norm/gamma": False,
        "self_attention_layer_norm/beta": False,
        "layer_normalization/gamma": False,
        "layer_normalization/beta": False,
        "einsum_dense/kernel": True,
        "einsum_dense/bias": False,
    }, decay
    for v in model.trainable_variables:  # the tf.Variable Keras hands update_step resolves too
        assert opt.options_for(v.value) == opt.options_for(v)
        assert opt.options_for(v)["layer_adaptation"] == opt.options_for(v)["weight_decay"]
        assert opt.slots_for(v.value).keys() == opt.slots_for(v).keys()


# ---------------------------------------------------------------------------------------------
# Derivatives through the rule: central finite differences in float64.


@pytest.mark.parametrize("case", sorted(CASES))
def test_hyperparameter_derivatives_match_finite_differences(case):
    opt = CASES[case][0]()
    rng = np.random.default_rng(3)
    shapes = {"dense/kernel": (6, 5), "dense/bias": (5,), "scalar/w": ()}
    w0 = {p: rng.normal(size=s) for p, s in shapes.items()}
    target = {p: rng.normal(size=s) for p, s in shapes.items()}
    probe = {p: rng.normal(size=s) for p, s in shapes.items()}
    # options as the optimizer decides them (factored (6, 5) when min_dim_size allows)
    options = {}
    for p, s in shapes.items():
        scope, name = p.split("/")
        with keras.name_scope(scope):
            options[p] = opt.variable_options(keras.Variable(np.zeros(s, "float32"), name=name))
    opt.build([])  # creates the hyperparameter variables
    # update 5's values (after a warmup schedule's first steps, whose rate may be 0)
    base_hp = {k: float(v.numpy()) for k, v in opt.hyperparameters_at(4).items()}

    def objective(hp):
        total = tf.constant(0.0, tf.float64)
        for p in shapes:
            w = tf.constant(w0[p])
            slots = opt.rule.init_slots(w, options[p])
            for t in range(1, 4):
                g = 2.0 * (w - target[p])  # the gradient depends on the trajectory
                w, slots = opt.rule.update(
                    g, w, slots, hp, tf.constant(float(t), tf.float64), options[p]
                )
            total += tf.reduce_sum(w * probe[p])
        return total

    for name in opt.differentiable_hyperparameters:
        x = tf.Variable(base_hp[name], dtype=tf.float64)
        with tf.GradientTape() as tape:
            hp = {k: tf.constant(v, tf.float64) for k, v in base_hp.items()}
            hp[name] = x
            value = objective(hp)
        analytic = float(tape.gradient(value, x))
        h = 1e-6 * max(1.0, abs(base_hp[name]))
        plus = {**base_hp, name: base_hp[name] + h}
        minus = {**base_hp, name: base_hp[name] - h}
        numeric = float(objective(plus) - objective(minus)) / (2 * h)
        assert abs(analytic) > 1e-8, (case, name)
        np.testing.assert_allclose(
            analytic, numeric, rtol=1e-5, atol=1e-8, err_msg=f"{case} d/d{name}"
        )


# ---------------------------------------------------------------------------------------------
# Keras integration: config, save/restore, dtypes, memory.


def _run(opt, variables, steps, start=1):
    for t in range(start, start + steps):
        opt.apply_gradients(zip(make_gradients(t), variables))


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_round_trip(case):
    opt = CASES[case][0]()
    clone = type(opt).from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()
    a, b = make_variables(), make_variables()
    _run(opt, a, 2)
    _run(clone, b, 2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    serialized = keras.optimizers.serialize(opt)
    assert type(keras.optimizers.deserialize(serialized)) is type(opt)


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_and_restore_mid_training_continues_identically(case, tmp_path):
    factory = CASES[case][0]
    opt, variables = factory(), make_variables()
    _run(opt, variables, 2)
    opt.learning_rate_scale.assign(0.7)
    checkpoint = tf.train.Checkpoint(optimizer=opt, variables=variables)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    store = {}
    opt.save_own_variables(store)  # what model.save(".keras") writes
    _run(opt, variables, 2, start=3)

    for restore in ("checkpoint", "keras_store"):
        opt2, variables2 = factory(), make_variables(seed=9)
        opt2.build(variables2)
        if restore == "checkpoint":
            tf.train.Checkpoint(optimizer=opt2, variables=variables2).restore(
                path
            ).assert_consumed()
        else:
            opt2.load_own_variables(store)
            ref = tf.train.Checkpoint(variables=variables2)
            ref.read(path).expect_partial()
        assert float(opt2.learning_rate_scale.numpy()) == pytest.approx(0.7)
        _run(opt2, variables2, 2, start=3)
        for x, y in zip(variables, variables2):
            np.testing.assert_array_equal(x.numpy(), y.numpy(), err_msg=restore)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["adafactor_t5", "lamb", "adam_weight_decay", "sgd_nesterov"])
def test_low_precision_variables_keep_float32_slots(case, dtype):
    opt = CASES[case][0]()
    variables = make_variables(dtype=dtype)
    before = [v.numpy().astype(np.float32) for v in variables]
    _run(opt, variables, 2)
    for v, b in zip(variables, before):
        assert v.dtype == dtype
        assert np.all(np.isfinite(v.numpy().astype(np.float32)))
        for s in opt.slots_for(v).values():
            assert s.dtype == "float32"
    assert not np.array_equal(variables[5].numpy().astype(np.float32), before[5])


def test_factored_slot_bytes_4096_square():
    v = keras.Variable(np.zeros((4096, 4096), "float32"), name="kernel", dtype="bfloat16")
    for opt in (O.Adafactor.t5(), O.Adafactor.pegasus(0.01)):
        opt.build([v])
        slots = opt.slots_for(v)
        assert set(slots) == {"v_row", "v_col"}
        nbytes = sum(int(np.prod(s.shape)) * 4 for s in slots.values())
        assert nbytes == 2 * 4096 * 4  # 32 KiB, versus 64 MiB for a full float32 slot
        assert all(s.dtype == "float32" for s in slots.values())


def test_factoring_rules():
    t5 = dict(factoring="two_largest", min_dim_size_to_factor=128)
    peg = dict(factoring="last_two", min_dim_size_to_factor=0)
    assert O.factored_dims((64, 32), **t5) is None
    assert O.factored_dims((64, 32), **peg) == (0, 1)
    assert O.factored_dims((512, 256), **t5) == (1, 0)
    assert O.factored_dims((4, 256, 192), **t5) == (2, 1)
    assert O.factored_dims((256, 4, 192), **t5) == (2, 0)
    assert O.factored_dims((256, 4, 192), **peg) == (1, 2)
    assert O.factored_dims((300,), **peg) is None
    assert O.factored_dims((300, 300), factored=False, **t5) is None
    # Ties as Mesh TensorFlow breaks them (stable sort by decreasing size: earlier axis first).
    assert set(O.factored_dims((6, 5, 5), min_dim_size_to_factor=2)) == {0, 1}
    assert O.factored_dims((6, 5, 5), min_dim_size_to_factor=2) == (1, 0)
    assert set(O.factored_dims((5, 6, 5), min_dim_size_to_factor=2)) == {0, 1}
    assert set(O.factored_dims((4, 5, 5), min_dim_size_to_factor=2)) == {1, 2}


# ---------------------------------------------------------------------------------------------
# Parity with Keras built-ins where they coincide.


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (
            lambda: O.Lamb(
                0.01,
                weight_decay_rate=0.0,
                bias_correction=True,
                epsilon=1e-7,
                exclude_from_weight_decay=(),
            ),
            lambda: keras.optimizers.Lamb(0.01, epsilon=1e-7),
        ),
        # BERT's decay equals AdamW's decoupled decay once bias correction is the identity.
        (
            lambda: O.AdamWeightDecay(
                0.01,
                weight_decay_rate=0.05,
                beta_1=0.0,
                beta_2=0.0,
                epsilon=1e-7,
                exclude_from_weight_decay=(),
            ),
            lambda: keras.optimizers.AdamW(
                0.01, weight_decay=0.05, beta_1=0.0, beta_2=0.0, epsilon=1e-7
            ),
        ),
        (lambda: O.Adam(0.01), lambda: keras.optimizers.Adam(0.01)),
        (
            lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
            lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        ),
    ],
    ids=["lamb", "adamw", "adam", "sgd"],
)
def test_parity_with_keras_builtins(ours, theirs):
    a, b = make_variables(), make_variables()
    o, k = ours(), theirs()
    for t in range(1, STEPS + 1):
        # |g| >= 1: Keras writes v += (g^2 - v)(1 - beta_2), which with beta_2 = 0 loses a
        # g^2 much smaller than the previous v to float32 rounding (BERT's beta_2 v +
        # (1 - beta_2) g^2 does not); bounded gradients compare the rules, not that rounding.
        grads = [np.sign(g) * (1.0 + np.abs(g)) for g in make_gradients(t)]
        o.apply_gradients(zip(grads, a))
        k.apply_gradients(zip(grads, b))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Distribution: 1 replica equals 2; clipping of the aggregated gradient.

GLOBAL_BATCH = 8


def _replica_run(factory, strategy):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, GLOBAL_BATCH, 6)).astype("float32")
    y = rng.normal(size=(3, GLOBAL_BATCH, 4)).astype("float32")
    w0 = rng.normal(size=(6, 4)).astype("float32")
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        with keras.name_scope("dense"):
            kernel = keras.Variable(w0, name="kernel")
            bias = keras.Variable(np.zeros(4, "float32"), name="bias")
        opt = factory()
        opt.build([kernel, bias])

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            pred = tf.matmul(xb, kernel.value) + bias.value
            # per-replica loss divided by the GLOBAL batch, as Keras's compute_loss does
            loss = tf.reduce_sum(tf.square(pred - yb)) / GLOBAL_BATCH
        grads = tape.gradient(loss, [kernel.value, bias.value])
        opt.apply_gradients(zip(grads, [kernel, bias]))

    @tf.function
    def step(xb, yb):
        if strategy is None:
            replica_step(xb, yb)
            return
        n = strategy.num_replicas_in_sync
        per = GLOBAL_BATCH // n

        def split(t):
            return strategy.experimental_distribute_values_from_function(
                lambda ctx: t[
                    ctx.replica_id_in_sync_group * per : (ctx.replica_id_in_sync_group + 1) * per
                ]
            )

        strategy.run(replica_step, args=(split(xb), split(yb)))

    for i in range(3):
        step(tf.constant(x[i]), tf.constant(y[i]))
    return kernel.numpy(), bias.numpy()


REPLICA_CASES = {
    "sgd_nesterov": CASES["sgd_nesterov"][0],
    "lamb": CASES["lamb"][0],
    "adafactor_pegasus": lambda: O.Adafactor.pegasus(0.05),
    "adam_weight_decay_aggregated_clip": lambda: O.AdamWeightDecay(0.01, aggregated_clipnorm=0.05),
}


@pytest.mark.parametrize("case", sorted(REPLICA_CASES))
def test_one_replica_equals_two(case):
    one = _replica_run(REPLICA_CASES[case], None)
    two = _replica_run(REPLICA_CASES[case], two_cpu_strategy())
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_keras_global_clipnorm_is_per_replica_but_aggregated_clipnorm_is_not():
    # The documented contrast: Keras clips each replica's share before the all-reduce.
    def keras_clip():
        return O.AdamWeightDecay(0.01, global_clipnorm=0.05)

    one, two = _replica_run(keras_clip, None), _replica_run(keras_clip, two_cpu_strategy())
    assert max(np.abs(a - b).max() for a, b in zip(one, two)) > 1e-3


def test_aggregated_clipnorm_clips_the_global_gradient():
    w0 = np.ones((3, 2), "float32")
    grads = [np.full((3, 2), 3.0, "float32"), np.full((2,), 4.0, "float32")]
    a = [keras.Variable(w0, name="kernel"), keras.Variable(np.zeros(2, "float32"), name="b")]
    O.SGD(1.0, aggregated_clipnorm=0.5).apply_gradients(zip(grads, a))
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    np.testing.assert_allclose(a[0].numpy(), w0 - grads[0] * 0.5 / norm, rtol=1e-6)
    np.testing.assert_allclose(a[1].numpy(), -grads[1] * 0.5 / norm, rtol=1e-6)
    with pytest.raises(ValueError, match="aggregated_clipnorm"):
        O.SGD(1.0, aggregated_clipnorm=-1.0)


def test_keras_gradient_accumulation_still_works():
    opt = O.AdamWeightDecay(0.01, gradient_accumulation_steps=2)
    ref = O.AdamWeightDecay(0.01)
    a, b = make_variables(), make_variables()
    g1, g2 = make_gradients(1), make_gradients(2)
    opt.apply_gradients(zip(g1, a))
    opt.apply_gradients(zip(g2, a))
    ref.apply_gradients(zip([(x + y) / 2 for x, y in zip(g1, g2)], b))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)


def test_fit_with_schedule_and_saved_model_round_trip(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = O.Adafactor.t5(O.T5InverseSquareRootSchedule(warmup_steps=2), min_dim_size_to_factor=2)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is O.Adafactor
    # the schedule came back: its value at any step (1 / sqrt(max(step, 2)))
    assert float(loaded.optimizer.learning_rate_at(8)) == pytest.approx(1 / np.sqrt(8))
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for v, lv in zip(opt.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(v.numpy(), lv.numpy())


# ---------------------------------------------------------------------------------------------
# Schedules.


def test_schedules_follow_reference_formulas():
    t5 = O.T5InverseSquareRootSchedule(warmup_steps=10000)
    assert float(t5(0)) == pytest.approx(0.01)
    assert float(t5(40000)) == pytest.approx(1 / 200)
    bert = O.BertSchedule(1e-4, num_train_steps=1000, num_warmup_steps=100)
    assert float(bert(0)) == 0.0
    assert float(bert(50)) == pytest.approx(5e-5)
    # after warmup the polynomial decay counts from step 0, not from the end of warmup
    assert float(bert(100)) == pytest.approx(1e-4 * (1 - 100 / 1000))
    assert float(bert(2000)) == pytest.approx(0.0)
    peg = O.PegasusSchedule(0.01)
    assert float(peg(0)) == pytest.approx(0.01)
    assert float(peg(40000)) == pytest.approx(0.01 / 0.01 / 200)
    peg_w = O.PegasusSchedule(1e-3, warmup_steps=100)
    assert float(peg_w(9)) == pytest.approx(10 / 100 * 1e-3)
    assert float(peg_w(5000)) == pytest.approx(1e-3 / 0.01 / 100)
    for s in (t5, bert, peg_w):
        assert type(s).from_config(s.get_config()).get_config() == s.get_config()


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: O.Adafactor(-1.0), "learning_rate"),
        (lambda: O.AdamWeightDecay(-0.1), "learning_rate"),
        (lambda: O.Lamb(0.01, beta_1=1.0), "beta_1"),
        (lambda: O.AdamWeightDecay(0.01, beta_1=-0.1), "beta_1"),
        (lambda: O.Adafactor(0.01, beta_1=1.5), "beta_1"),
        (lambda: O.Adam(0.01, beta_2=1.0), "beta_2"),
        (lambda: O.SGD(0.01, momentum=1.0), "momentum"),
        (lambda: O.Adafactor(0.01, factoring="first_two"), "factoring"),
        (
            lambda: O.AdamWeightDecay(0.01, exclude_from_weight_decay=[keras.layers.Dense]),
            "exclude_from_weight_decay",
        ),
        (lambda: O.Lamb(0.01, exclude_from_layer_adaptation=3), "exclude_from_layer_adaptation"),
        (
            lambda: O.Adafactor(0.01, exclude_from_parameter_scale=[1]),
            "exclude_from_parameter_scale",
        ),
        (lambda: O.Adafactor(0.01, clipping_threshold=0.0), "clipping_threshold"),
        (lambda: O.Lamb(0.01, weight_decay_rate=-1.0), "weight_decay_rate"),
        (lambda: O.BertSchedule(1e-4, num_train_steps=0), "num_train_steps"),
    ],
)
def test_bad_input_names_the_argument(make, argument):
    with pytest.raises((ValueError, TypeError), match=argument):
        make()


def test_assign_update_commits_a_rule_result_like_apply_gradients():
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(3,)).astype("float32")]
    grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in values]
    a = [keras.Variable(v) for v in values]
    b = [keras.Variable(v) for v in values]
    opt_a, opt_b = O.Lamb(0.1), O.Lamb(0.1)
    opt_a.build(a)
    opt_b.build(b)
    opt_a.apply_gradients(zip(grads, a))
    hp = opt_b.current_hyperparameters()
    results = [
        opt_b.rule.update(
            g,
            tf.convert_to_tensor(v),
            {k: s.value for k, s in opt_b.slots_for(v).items()},
            hp,
            tf.constant(1.0),
            opt_b.options_for(v),
        )
        for g, v in zip(grads, b)
    ]
    opt_b.assign_update(b, [r[0] for r in results], [r[1] for r in results])
    assert int(opt_b.iterations.numpy()) == int(opt_a.iterations.numpy()) == 1
    for va, vb in zip(a, b):
        np.testing.assert_array_max_ulp(va.numpy(), vb.numpy(), maxulp=2)
        for (ka, sa), (kb, sb) in zip(opt_a.slots_for(va).items(), opt_b.slots_for(vb).items()):
            np.testing.assert_array_max_ulp(sa.numpy(), sb.numpy(), maxulp=2)


def test_assign_update_under_two_replicas_assigns_every_copy_like_apply_gradients():
    """Each replica commits its (identical) update to its own copies, without any
    communication; the result is what apply_gradients does with the all-reduced gradient."""
    rng = np.random.default_rng(1)
    values = [rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(3,)).astype("float32")]
    grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in values]
    strategy = two_cpu_strategy()
    with strategy.scope():
        a = [keras.Variable(v) for v in values]
        b = [keras.Variable(v) for v in values]
        opt_a, opt_b = O.Lamb(0.1), O.Lamb(0.1)
        opt_a.build(a)
        opt_b.build(b)

    @tf.function
    def step():
        def replica_fn():
            opt_a.apply_gradients(zip([g / 2.0 for g in grads], a))  # summed over 2 replicas
            hp = opt_b.current_hyperparameters()
            t = tf.cast(opt_b.iterations + 1, tf.float32)
            results = [
                opt_b.rule.update(
                    g,
                    tf.convert_to_tensor(v),
                    {k: tf.convert_to_tensor(s.value) for k, s in opt_b.slots_for(v).items()},
                    hp,
                    t,
                    opt_b.options_for(v),
                )
                for g, v in zip(grads, b)
            ]
            opt_b.assign_update(b, [r[0] for r in results], [r[1] for r in results])

        strategy.run(replica_fn)

    step()
    step()
    assert int(opt_b.iterations.numpy()) == int(opt_a.iterations.numpy()) == 2
    for va, vb in zip(a, b):
        copies_a, copies_b = va.value.values, vb.value.values
        assert len(copies_b) == 2
        for ca, cb in zip(copies_a, copies_b):
            np.testing.assert_array_max_ulp(ca.numpy(), cb.numpy(), maxulp=4)
        for (_, sa), (_, sb) in zip(opt_a.slots_for(va).items(), opt_b.slots_for(vb).items()):
            for ca, cb in zip(sa.value.values, sb.value.values):
                np.testing.assert_array_max_ulp(ca.numpy(), cb.numpy(), maxulp=4)


# ---------------------------------------------------------------------------------------------
# The registry covers every exported optimizer.


def test_every_exported_optimizer_has_a_registry_entry():
    classes = O.optimizer_classes()
    assert {c.__name__ for c in classes} >= {"Adafactor", "Adam", "AdamWeightDecay", "Lamb", "SGD"}
    covered = {type(config.factory()) for config in REGISTRY.values()}
    missing = [c.__name__ for c in classes if c not in covered]
    assert not missing, (
        f"tf_metaalign.optimizers exports {missing} but tests/optimizer_registry.py has no "
        "configuration of it: add one (with its NumPy oracle)."
    )


# ---------------------------------------------------------------------------------------------
# One update on tensors (apply_on_tensors): equals apply_gradients, assigns nothing,
# differentiable.


def _values(variables):
    return [tf.convert_to_tensor(v.value) for v in variables]


def _assert_state_equals_optimizer(state, opt, variables, tensors, where):
    for v, t, slots in zip(variables, tensors, state.slots):
        np.testing.assert_array_equal(t.numpy(), v.numpy(), err_msg=f"{where} {v.path}")
        slot_vars = opt.slots_for(v)
        assert set(slots) == set(slot_vars), where
        for k, s in slot_vars.items():
            np.testing.assert_array_equal(
                slots[k].numpy(), s.numpy(), err_msg=f"{where} {v.path}/{k}"
            )
    assert int(state.iterations) == int(opt.iterations.numpy()), where


@pytest.mark.parametrize("built", [False, True], ids=["from_initial_state", "from_current_state"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_steps_equal_apply_gradients(case, built):
    """k = 3 tensor steps == k apply_gradients calls: params, slots and iterations."""
    factory = CASES[case][0]
    reference, reference_vars = factory(), make_variables()
    tensor_opt, tensor_vars = factory(), make_variables()
    if built:
        # Start mid-training, with learned values assigned between steps.
        for opt, variables in ((reference, reference_vars), (tensor_opt, tensor_vars)):
            _run(opt, variables, 2)
            opt.learning_rate_scale.assign(0.5)
            for name in opt.hyperparameter_variables:
                opt.hyperparameter_variables[name].assign(0.8)
        state, start = tensor_opt.current_state(), 3
        assert int(state.iterations) == 2
        variables_arg = None  # the options the optimizer decided in build()
    else:
        state, start = tensor_opt.initial_state(tensor_vars), 1
        assert not tensor_opt.built  # the tensor step needs no built optimizer
        variables_arg = tensor_vars
    before = [v.numpy() for v in tensor_vars]
    params = _values(tensor_vars)
    for t in range(start, start + 3):
        grads = make_gradients(t)
        params, state = tensor_opt.apply_on_tensors(grads, params, state, variables=variables_arg)
        reference.apply_gradients(zip(grads, reference_vars))
    _assert_state_equals_optimizer(state, reference, reference_vars, params, case)
    for v, b in zip(tensor_vars, before):  # nothing assigned
        np.testing.assert_array_equal(v.numpy(), b)
    assert not np.allclose(params[4].numpy(), before[4])


@pytest.mark.parametrize(
    "case",
    ["adam", "bert_adam_weight_decay_schedule", "lamb", "adafactor_t5_momentum", "sgd_nesterov"],
)
def test_tensor_step_in_tf_function_and_while_loop_equals_eager(case):
    """The state is a nest: a tf.function argument/result and a tf.while_loop variable
    (a Reptile inner loop carrying Adam's state)."""
    opt = CASES[case][0]()
    variables = make_variables()
    targets = [tf.constant(g) for g in make_gradients(7)]

    def inner_step(params, state):
        grads = [2.0 * (p - t) for p, t in zip(params, targets)]  # depends on the params
        return opt.apply_on_tensors(grads, params, state, variables=variables)

    params, state = _values(variables), opt.initial_state(variables)
    for _ in range(3):
        params, state = inner_step(params, state)

    graph_params, graph_state = tf.function(inner_step)(
        _values(variables), opt.initial_state(variables)
    )
    eager_params, eager_state = inner_step(_values(variables), opt.initial_state(variables))
    for a, b in zip(graph_params, eager_params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert int(graph_state.iterations) == int(eager_state.iterations) == 1

    @tf.function
    def inner_loop(params, state):
        def body(i, params, state):
            new_params, new_state = inner_step(params, state)
            return i + 1, new_params, new_state

        _, params, state = tf.while_loop(lambda i, *_: i < 3, body, (tf.constant(0), params, state))
        return params, state

    loop_params, loop_state = inner_loop(_values(variables), opt.initial_state(variables))
    assert isinstance(loop_state, O.OptimizerState)
    assert int(loop_state.iterations) == 3
    for a, b in zip(loop_params, params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    for sa, sb in zip(loop_state.slots, state.slots):
        for k in sb:
            np.testing.assert_allclose(sa[k].numpy(), sb[k].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_tensor_step_in_tf_function_equals_eager(case):
    # Python constants inside a rule must take the variable's dtype in graphs too (an
    # Adafactor update-clipping `tf.maximum(1.0, rms)` raised a float32/float64 TypeError
    # only inside tf.function).
    opt = CASES[case][0]()
    variables = make_variables(dtype="float64")
    grads = [tf.constant(g, tf.float64) for g in make_gradients(3)]

    def step(params, state):
        return opt.apply_on_tensors(grads, params, state, variables=variables)

    eager_params, _ = step(_values(variables), opt.initial_state(variables))
    graph_params, _ = tf.function(step)(_values(variables), opt.initial_state(variables))
    for a, b, v in zip(graph_params, eager_params, variables):
        assert a.dtype == tf.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    if "schedule" not in case:  # warm-up schedules start at a zero learning rate
        assert any(
            not np.array_equal(a.numpy(), v.numpy()) for a, v in zip(graph_params, variables)
        )


def test_tensor_step_gradient_of_sgd_is_the_closed_form():
    # loss = 0.5 a p^2 -> g = a p -> p' = p - lr a p, so d <c, p'> / d p = c (1 - lr a).
    lr, a = 0.1, tf.constant([0.5, 2.0, 3.0])
    c = tf.constant([1.0, -2.0, 0.5])
    v = keras.Variable(np.array([1.0, -1.0, 2.0], "float32"), name="w")
    opt = O.SGD(lr, momentum=0.9)
    p = tf.convert_to_tensor(v.value)
    with tf.GradientTape() as tape:
        tape.watch(p)
        new, state = opt.apply_on_tensors([a * p], [p], opt.initial_state([v]), variables=[v])
        objective = tf.reduce_sum(c * new[0])
    np.testing.assert_allclose(
        tape.gradient(objective, p).numpy(), (c * (1 - lr * a)).numpy(), rtol=1e-6
    )
    # the momentum buffer after one step: -lr * g
    np.testing.assert_allclose(state.slots[0]["momentum"].numpy(), (-lr * a * p).numpy(), rtol=1e-6)


def test_tensor_step_of_adam_is_differentiable_in_the_gradients():
    variables = make_variables()
    opt = O.Adam(0.01)
    state = opt.initial_state(variables)
    params = _values(variables)
    _, state = opt.apply_on_tensors(make_gradients(1), params, state, variables=variables)
    grads = [tf.constant(g) for g in make_gradients(2)]
    with tf.GradientTape() as tape:
        tape.watch(grads)
        new, _ = opt.apply_on_tensors(grads, params, state, variables=variables)
        objective = tf.add_n([tf.reduce_sum(p) for p in new])
    for g, d in zip(grads, tape.gradient(objective, grads)):
        assert d is not None and np.any(d.numpy() != 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_step_derivative_matches_finite_differences(case):
    """d <probe, theta_2> / d theta_0 along a direction, through two tensor steps whose
    gradients depend on the params (a MAML inner loop), against central differences in
    float64."""
    opt = CASES[case][0]()
    # Small variables (the same paths, so the same options): Adam's first step is close to
    # lr * sign(g), whose derivative is huge where |g| ~ epsilon; among few elements none is.
    small = {
        "dense/kernel": (3, 4),
        "attention/kernel": (6, 5),
        "einsum/kernel": (4, 3, 5),
        "einsum_t/kernel": (6, 4, 5),
        "tied/kernel": (6, 5, 5),
    }
    rng = np.random.default_rng(11)
    variables = []
    for path, shape in VARIABLES:
        scope, name = path.split("/")
        shape = small.get(path, shape)
        value = np.zeros(shape) if scope == "zero_init" else rng.normal(size=shape)
        with keras.name_scope(scope):
            variables.append(keras.Variable(value, name=name, dtype="float64"))
    targets = [tf.constant(rng.normal(size=v.shape)) for v in variables]
    probes = [tf.constant(rng.normal(size=v.shape)) for v in variables]
    # No direction on the zero-initialised variable: ||w|| = 0 is a kink of LAMB's trust
    # ratio and of Adafactor's parameter scale, where a one-sided change is not the derivative.
    direction = [
        tf.zeros(v.shape, tf.float64)
        if "zero_init" in v.path
        else tf.constant(rng.normal(size=v.shape))
        for v in variables
    ]

    def objective(params):
        state = opt.initial_state(variables)
        for _ in range(2):
            grads = [2.0 * (p - t) for p, t in zip(params, targets)]
            params, state = opt.apply_on_tensors(grads, params, state, variables=variables)
        return tf.add_n([tf.reduce_sum(p * c) for p, c in zip(params, probes)])

    theta = _values(variables)
    with tf.GradientTape() as tape:
        tape.watch(theta)
        value = objective(theta)
    analytic = float(
        sum(tf.reduce_sum(g * d) for g, d in zip(tape.gradient(value, theta), direction))
    )
    eps = 1e-6
    plus = objective([p + eps * d for p, d in zip(theta, direction)])
    minus = objective([p - eps * d for p, d in zip(theta, direction)])
    numeric = float(plus - minus) / (2 * eps)
    assert abs(analytic) > 1e-3
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, err_msg=case)


def test_tensor_step_assigns_nothing():
    opt = CASES["adafactor_t5_momentum"][0]()
    variables = make_variables()
    _run(opt, variables, 2)
    snapshot = [v.numpy() for v in opt.variables + variables]
    params, state = opt.apply_on_tensors(make_gradients(3), _values(variables), opt.current_state())
    assert int(state.iterations) == 3 and int(opt.iterations.numpy()) == 2
    for v, s in zip(opt.variables + variables, snapshot):
        np.testing.assert_array_equal(v.numpy(), s)


def test_tensor_step_follows_apply_gradients_for_keras_special_cases():
    """A None gradient (skipped), an `overwrite_with_gradient` variable (takes its
    gradient), a `constraint` (applied after the update) and `loss_scale_factor`."""

    def variables():
        with keras.name_scope("special"):
            kept = keras.Variable(np.ones((3,), "float32"), name="kept")
            overwritten = keras.Variable(np.zeros((2,), "float32"), name="scale")
            constrained = keras.Variable(np.full((4,), 0.01, "float32"), name="kernel")
            plain = keras.Variable(np.ones((2, 2), "float32"), name="dense_kernel")
        overwritten.overwrite_with_gradient = True
        constrained.constraint = keras.constraints.NonNeg()
        return [kept, overwritten, constrained, plain]

    grads = [
        None,
        np.array([5.0, 6.0], "float32"),
        np.ones(4, "float32"),
        np.full((2, 2), 3.0, "float32"),
    ]
    reference, ref_vars = O.Adam(0.1, loss_scale_factor=4.0), variables()
    opt, tensor_vars = O.Adam(0.1, loss_scale_factor=4.0), variables()
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        reference.apply_gradients(zip(grads, ref_vars))
    state = opt.initial_state(tensor_vars)
    assert state.slots[1] == {}
    params, state = opt.apply_on_tensors(grads, _values(tensor_vars), state, variables=tensor_vars)
    for v, p in zip(ref_vars, params):
        np.testing.assert_array_equal(p.numpy(), v.numpy(), err_msg=v.path)
    np.testing.assert_array_equal(params[2].numpy(), np.zeros(4))  # NonNeg clipped it at 0
    np.testing.assert_array_equal(params[1].numpy(), [5.0, 6.0])
    np.testing.assert_array_equal(state.slots[0]["m"].numpy(), np.zeros(3))  # untouched


def test_tensor_step_with_hyperparameters_given():
    variables = make_variables()
    opt = O.Adam(0.01)
    state = opt.initial_state(variables)
    beta_1 = tf.constant(0.5, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(beta_1)
        _, state1 = opt.apply_on_tensors(
            make_gradients(1),
            _values(variables),
            state,
            variables=variables,
            hyperparameters={"beta_1": beta_1},
        )
        new, _ = opt.apply_on_tensors(
            make_gradients(2),
            _values(variables),
            state1,
            variables=variables,
            hyperparameters={"beta_1": beta_1},
        )
        objective = tf.reduce_sum(new[4])
    assert float(tape.gradient(objective, beta_1)) != 0.0
    reference = O.Adam(0.01, beta_1=0.5)
    ref_state = reference.initial_state(variables)
    ref_new, _ = reference.apply_on_tensors(
        make_gradients(1), _values(variables), ref_state, variables=variables
    )
    new1, _ = opt.apply_on_tensors(
        make_gradients(1),
        _values(variables),
        state,
        variables=variables,
        hyperparameters={"beta_1": 0.5},
    )
    for a, b in zip(new1, ref_new):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_clip_aggregated_is_what_apply_gradients_applies():
    w0 = [np.ones((3, 2), "float32"), np.zeros((2,), "float32")]
    grads = [np.full((3, 2), 3.0, "float32"), np.full((2,), 4.0, "float32")]
    variables = [keras.Variable(w, name=f"w{i}") for i, w in enumerate(w0)]
    opt = O.SGD(1.0, aggregated_clipnorm=0.5)  # w <- w - 1 * clipped(g)
    clipped = opt.clip_aggregated(grads)
    opt.apply_gradients(zip(grads, variables))
    for v, w, c in zip(variables, w0, clipped):
        np.testing.assert_array_equal(v.numpy(), w - c.numpy())
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    assert norm > 0.5
    np.testing.assert_allclose(
        np.sqrt(sum(np.sum(c.numpy().astype(np.float64) ** 2) for c in clipped)), 0.5, rtol=1e-6
    )
    # IndexedSlices are densified; None entries stay; no clipping without aggregated_clipnorm.
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
    out = O.SGD(1.0).clip_aggregated([sparse, None])
    np.testing.assert_array_equal(out[0].numpy(), [[0, 0], [1, 2], [0, 0]])
    assert out[1] is None


@pytest.mark.parametrize(
    "make, call, match",
    [
        (lambda: O.Adam(0.1, clipnorm=1.0), None, "clipnorm"),
        (lambda: O.Adam(0.1, global_clipnorm=1.0), None, "global_clipnorm"),
        (lambda: O.Adam(0.1, clipvalue=1.0), None, "clipvalue"),
        (lambda: O.Adam(0.1, weight_decay=0.1), None, "weight_decay"),
        (lambda: O.Adam(0.1, use_ema=True), None, "use_ema"),
        (lambda: O.Adam(0.1, gradient_accumulation_steps=2), None, "gradient_accumulation_steps"),
        (O.Adam, lambda o, g, p, s, v: o.apply_on_tensors(g, p, s.slots, variables=v), "`state`"),
        (O.Adam, lambda o, g, p, s, v: o.apply_on_tensors(g[:1], p, s, variables=v), "`grads`"),
        (O.Adam, lambda o, g, p, s, v: o.apply_on_tensors(g, p, s), "`variables`"),
        (
            O.Adam,
            lambda o, g, p, s, v: o.apply_on_tensors(g, p, s, variables=v[:1]),
            "`variables` has 1",
        ),
        (
            O.Adam,
            lambda o, g, p, s, v: o.apply_on_tensors(g[0], p, s, variables=v),
            "`grads` must be a list",
        ),
        (
            O.Adam,
            lambda o, g, p, s, v: o.apply_on_tensors(
                g, p, s, variables=v, hyperparameters={"gamma": 1.0}
            ),
            "gamma",
        ),
        (O.Adam, lambda o, g, p, s, v: o.apply_on_tensors([None, None], p, s, variables=v), "None"),
        (
            O.Adam,
            lambda o, g, p, s, v: O.SGD(0.1, momentum=0.9).apply_on_tensors(g, p, s, variables=v),
            r"state.slots\[0\]",
        ),
        (
            O.Adam,
            lambda o, g, p, s, v: O.apply_rule(o.rule, g, p, s.slots[:1], None, {}, 1.0),
            "apply_rule",
        ),
        (O.Adam, lambda o, g, p, s, v: o.current_state(), "built"),
    ],
)
def test_tensor_step_bad_input_is_a_clear_error(make, call, match):
    opt = make()
    variables = [
        keras.Variable(np.ones((2, 2), "float32"), name="k"),
        keras.Variable(np.ones((2,), "float32"), name="b"),
    ]
    grads = [tf.ones((2, 2)), tf.ones((2,))]
    state = opt.initial_state(variables)
    with pytest.raises(ValueError, match=match):
        if call is None:
            opt.apply_on_tensors(grads, _values(variables), state, variables=variables)
        else:
            call(opt, grads, _values(variables), state, variables)


# ---------------------------------------------------------------------------------------------
# Keras's Adam and SGD as tf_metaalign optimizers; guided learning's optimizer checks.


@pytest.mark.parametrize(
    "make_keras, make_ours",
    [
        (
            lambda: keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6),
            lambda: O.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6),
        ),
        (
            lambda: keras.optimizers.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
            ),
            lambda: O.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)),
        ),
        (
            lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
            lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
        ),
        (
            lambda: keras.optimizers.SGD(
                O.BertSchedule(0.1, num_train_steps=10, num_warmup_steps=2), momentum=0.5
            ),
            lambda: O.SGD(
                O.BertSchedule(0.1, num_train_steps=10, num_warmup_steps=2), momentum=0.5
            ),
        ),
        (lambda: keras.optimizers.SGD(0.1), lambda: O.SGD(0.1)),
        (
            lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, beta_1=0.8),
            lambda: O.AdamW(0.01, weight_decay=0.05, beta_1=0.8),
        ),
        # Keras's Adam with a weight_decay is AdamW (the same decoupled decay).
        (
            lambda: keras.optimizers.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5), weight_decay=0.1
            ),
            lambda: O.AdamW(
                keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5),
                weight_decay=0.1,
                name="adam",
            ),
        ),
    ],
    ids=[
        "adam",
        "adam_schedule",
        "sgd_nesterov",
        "sgd_momentum_schedule",
        "sgd",
        "adamw",
        "adam_weight_decay_schedule",
    ],
)
def test_keras_optimizer_as_rule_optimizer_updates_like_keras(make_keras, make_ours):
    keras_opt = make_keras()
    converted = O.as_rule_optimizer(make_keras())
    ours = make_ours()
    assert type(converted) is type(ours)
    assert converted.rule.defaults == ours.rule.defaults
    runs = {}
    for name, opt in (("keras", keras_opt), ("converted", converted), ("ours", ours)):
        variables = make_variables()
        for t in range(1, 4):
            grads = [np.sign(g) * (1.0 + np.abs(g)) for g in make_gradients(t)]  # see parity test
            opt.apply_gradients(zip(grads, variables))
        runs[name] = [v.numpy() for v in variables]
    for a, b, c in zip(runs["keras"], runs["converted"], runs["ours"]):
        np.testing.assert_array_equal(b, c)
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    assert not np.allclose(runs["ours"][4], make_variables()[4].numpy())


def test_as_rule_optimizer_keeps_ours_and_refuses_others():
    ours = O.Lamb(0.01)
    assert O.as_rule_optimizer(ours) is ours
    keras_opt = keras.optimizers.Adam(0.01, global_clipnorm=2.0, name="meta")
    converted = O.as_rule_optimizer(keras_opt)
    assert converted.global_clipnorm == 2.0 and converted.name == "meta"
    for other in (keras.optimizers.Adadelta(0.01), keras.optimizers.RMSprop(0.01), "adam"):
        with pytest.raises(
            ValueError,
            match=r"keras.optimizers.Adam / AdamW \(amsgrad=False\) "
            r"and keras.optimizers.SGD; got .*",
        ):
            O.as_rule_optimizer(other)
    with pytest.raises(ValueError, match="amsgrad"):
        O.as_rule_optimizer(keras.optimizers.Adam(0.01, amsgrad=True))
    with pytest.raises(ValueError, match="AdamW\\(amsgrad=True\\)"):
        O.as_rule_optimizer(keras.optimizers.AdamW(0.01, amsgrad=True))
    with pytest.raises(ValueError, match=r"SGD\(weight_decay=0.1\) has no tf_metaalign rule"):
        O.as_rule_optimizer(keras.optimizers.SGD(0.01, weight_decay=0.1))


def test_as_rule_optimizer_carries_keras_weight_decay_exclusions():
    """keras AdamW's exclude_from_weight_decay (names searched in the short variable name,
    and variables by identity) decide the converted rule's per-variable decay."""
    variables = [
        keras.Variable(np.ones((3, 2), "float32"), name="kernel"),
        keras.Variable(np.ones((2,), "float32"), name="bias"),
        keras.Variable(np.ones((2,), "float32"), name="gamma"),
    ]
    keras_opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    keras_opt.exclude_from_weight_decay(var_list=[variables[2]], var_names=["bias"])
    converted = O.as_rule_optimizer(keras_opt)
    converted.build(variables)
    assert [converted.options_for(v)["weight_decay"] for v in variables] == [True, False, False]
    runs = {}
    for name, opt in (("keras", keras_opt), ("converted", converted)):
        vs = (
            variables
            if name == "converted"
            else [keras.Variable(v.numpy(), name=v.name) for v in variables]
        )
        if name == "keras":
            opt.exclude_from_weight_decay(var_list=[vs[2]], var_names=["bias"])
        for t in range(1, 3):
            opt.apply_gradients(zip([np.full(v.shape, 0.5 * t, "float32") for v in vs], vs))
        runs[name] = [v.numpy() for v in vs]
    for a, b in zip(runs["keras"], runs["converted"]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    # the decay moved the kernel further than the excluded bias (same gradients)
    assert runs["converted"][0][0, 0] < runs["converted"][1][0]


def test_adafactor_default_learning_rate_is_t2t_relative_step():
    """Adafactor() has t2t's default rate min(1e-2, 1/sqrt(t)) at update t (1-based; the
    schedule gets the updates already applied, t - 1), x 0.05 without parameter scale."""
    opt = O.Adafactor()
    assert isinstance(opt.get_config()["learning_rate"], dict)  # a serialized schedule
    for t in (1, 2, 100, 10_000, 10_001, 40_000, 1_000_000):
        expected = min(1e-2, 1.0 / np.sqrt(t))
        np.testing.assert_allclose(
            float(opt.learning_rate_at(tf.constant(t - 1, tf.int64))),
            expected,
            rtol=1e-6,
            err_msg=f"update {t}",
        )
        unscaled = O.Adafactor(multiply_by_parameter_scale=False)
        np.testing.assert_allclose(
            float(unscaled.learning_rate_at(tf.constant(t - 1, tf.int64))),
            0.05 * expected,
            rtol=1e-6,
        )
    # the rate the update uses: an unfactored, unscaled, unclipped step at update 40,000
    # from zero slots: v = (1 - rho) g^2 = t^-0.8 g^2, so it moves by lr * sign(g) * t^0.4.
    opt = O.Adafactor(multiply_by_parameter_scale=False, clipping_threshold=None)
    var = keras.Variable(np.zeros((3,), "float32"))
    opt.build([var])
    opt.iterations.assign(39_999)
    opt.apply_gradients([(tf.constant([1.0, -2.0, 3.0]), var)])
    np.testing.assert_allclose(
        var.numpy(), -0.05 * 0.005 * 40_000**0.4 * np.sign([1.0, -2.0, 3.0]), rtol=1e-5
    )
    restored = O.Adafactor.from_config(O.Adafactor().get_config())
    assert isinstance(restored.learning_rate_at(0), tf.Tensor)
    np.testing.assert_allclose(float(restored.learning_rate_at(tf.constant(39_999))), 0.005)


def test_check_optimizer_messages():
    O.check_optimizer(O.Adam(0.01))  # supported: no error
    with pytest.raises(
        ValueError, match="Adafactor, Adam, AdamW, AdamWeightDecay, Lamb, RecAdam, SGD"
    ):
        O.check_optimizer(keras.optimizers.Adam(0.01))
    O.check_optimizer(O.AdamW(0.01, weight_decay=0.1))  # the decay is in its rule
    with pytest.raises(ValueError, match="not differentiable"):
        O.check_optimizer(keras.optimizers.SGD(0.01), "MyLoop")
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        O.check_optimizer(keras.optimizers.LossScaleOptimizer(O.Adam(0.01)))
    with pytest.raises(ValueError, match="MyLoop.*`global_clipnorm`.*aggregated_clipnorm"):
        O.check_optimizer(O.Adam(0.01, global_clipnorm=1.0), "MyLoop")
    with pytest.raises(ValueError, match="weight_decay"):
        O.check_optimizer(O.Adam(0.01, weight_decay=0.1))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        O.check_optimizer(O.Adam(0.01, gradient_accumulation_steps=2))


def test_resolve_hyperparameters():
    assert O.resolve_hyperparameters(O.SGD(0.1, momentum=0.5), ("learning_rate", "beta_1")) == {
        "learning_rate": "learning_rate",
        "beta_1": "momentum",
    }
    assert O.resolve_hyperparameters(O.SGD(0.1), ("learning_rate", "beta_1"), explicit=False) == {
        "learning_rate": "learning_rate"
    }
    with pytest.raises(ValueError, match=r"'gamma'.*\['learning_rate', 'beta_1', 'beta_2'\]"):
        O.resolve_hyperparameters(O.Adam(0.1), ("learning_rate", "gamma"))
    with pytest.raises(ValueError, match="Adafactor learns beta_1 only"):
        O.resolve_hyperparameters(O.Adafactor(0.1), ("beta_1",))
    with pytest.raises(ValueError, match="twice"):
        O.resolve_hyperparameters(O.SGD(0.1, momentum=0.5), ("beta_1", "momentum"))
    with pytest.raises(ValueError, match="empty"):
        O.resolve_hyperparameters(O.SGD(0.1), ("beta_1",), explicit=False)


def test_adam_weight_decay_first_steps_are_larger_than_adams_as_documented():
    """No bias correction: for a steady gradient, AdamWeightDecay's update t is
    (1 - 0.9^t) / sqrt(1 - 0.999^t) times Adam's (3.16x at step 1, 6.57x at step 12), the
    figures its docstring and the README give."""
    ratios = []
    a, b = keras.Variable(np.zeros((3,), "float32")), keras.Variable(np.zeros((3,), "float32"))
    ours = O.AdamWeightDecay(1e-3, weight_decay_rate=0.0, epsilon=1e-12)
    adam = O.Adam(1e-3, epsilon=1e-12)
    g = np.array([0.5, -1.0, 2.0], "float32")
    for t in range(1, 101):
        before_a, before_b = a.numpy(), b.numpy()
        ours.apply_gradients([(g, a)])
        adam.apply_gradients([(g, b)])
        ratios.append(np.abs(a.numpy() - before_a) / np.abs(b.numpy() - before_b))
    expected = [(1 - 0.9**t) / np.sqrt(1 - 0.999**t) for t in range(1, 101)]
    np.testing.assert_allclose(
        np.array(ratios), np.array(expected)[:, None] * np.ones(3), rtol=2e-3
    )
    np.testing.assert_allclose(
        [expected[0], expected[11], expected[99]], [3.16, 6.57, 3.24], atol=0.01
    )
