"""SAMTrainer / GSAMTrainer on either backend (no TensorFlow import): fit == the NumPy
re-derivation, TensorFlow == JAX at float64 (golden files written on TensorFlow), rho = 0 ==
plain fit, state, precision, save/load, and on JAX 1 device == 2 devices.

The MirroredStrategy tests (1 replica == 2, m-sharpness per replica) are TensorFlow's:
tests/trainers/test_sam_trainer.py. Default tests here: 32 s on TensorFlow, about 100 s on
JAX (jit compiles per trainer), 2 cores at load 13.
"""

import keras
import numpy as np
import pytest
from keras import ops

from backends import data_parallel, requires_jax
from golden_io import check_golden, set_numpy_weights
from test_sam import MSE64, data64, mlp64, np_loss_and_grad, np_norm, np_sam_direction
from tf_metaalign import functional as F
from tf_metaalign.algorithms.sam import sam_gradient
from tf_metaalign.trainers import GSAMTrainer, SAMTrainer

BACKENDS = ("tensorflow", "jax")

MSE = keras.losses.MeanSquaredError()


def _np(x):
    return ops.convert_to_numpy(x)


def _weights(model):
    return [_np(v) for v in model.trainable_variables]


def _compile(trainer, lr=0.1, optimizer=None, **kwargs):
    dtype = trainer.model.trainable_variables[0].dtype
    trainer.compile(
        optimizer=optimizer or keras.optimizers.SGD(lr),
        loss=MSE64 if dtype == "float64" else MSE,
        **kwargs,
    )
    return trainer


def _numpy_sgd(w, x, y, batch, lr, perturbed, **options):
    """SGD on the SAM direction (NumPy), `perturbed(k)` deciding each step k."""
    w = [a.copy() for a in w]
    k = 0
    for start in range(0, len(x), batch):
        bx, by = x[start : start + batch], y[start : start + batch]
        if perturbed(k):
            d = np_sam_direction(w, bx, by, **options)
        else:
            d = np_loss_and_grad(w, bx, by)[1]
        w = [a - lr * b for a, b in zip(w, d)]
        k += 1
    return w


# ----------------------------------------------------------- against NumPy, float64


@pytest.mark.parametrize(
    "make, options",
    [
        (lambda m: SAMTrainer(m, rho=0.1), dict(rho=0.1)),
        (
            lambda m: SAMTrainer(m, rho=0.5, adaptive=True, eta=0.02),
            dict(rho=0.5, adaptive=True, eta=0.02, mask=[True, False, True, False]),
        ),
        (lambda m: GSAMTrainer(m, rho=0.2, alpha=0.3), dict(rho=0.2, alpha=0.3)),
    ],
    ids=["sam", "asam", "gsam"],
)
def test_fit_equals_numpy_sgd_on_the_sam_direction(float64, make, options):
    x, y = data64(24, seed=1)
    trainer = _compile(make(mlp64(seed=6)))
    w0 = _weights(trainer.model)
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: True, **options)
    for a, b in zip(_weights(trainer.model), expected):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    plain = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: False)
    assert not all(np.allclose(a, b, rtol=1e-6) for a, b in zip(expected, plain))


def test_rho_zero_equals_plain_fit_bit_for_bit(float64):
    x, y = data64(32, seed=2)
    trainer = _compile(SAMTrainer(mlp64(seed=7), rho=0.0), optimizer=keras.optimizers.Adam(0.01))
    h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    plain = mlp64(seed=7)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=MSE64)
    hp = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(plain)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(h.history["loss"], hp.history["loss"])


def test_every_k_counts_across_epochs_and_steps_per_execution(float64):
    # 5 batches per epoch: every=3 perturbs steps 0, 3, 6, 9 (the phase moves between epochs).
    x, y = data64(40, seed=3)
    trainer = _compile(SAMTrainer(mlp64(seed=8), rho=0.2, every=3), steps_per_execution=2)
    w0 = _weights(trainer.model)
    h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(trainer.steps_seen.numpy()) == 10
    w = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: k % 3 == 0, rho=0.2)
    w = _numpy_sgd(w, x, y, 8, 0.1, lambda k: (k + 5) % 3 == 0, rho=0.2)
    for a, b in zip(_weights(trainer.model), w):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert all(g > 0 for g in h.history["surrogate_gap"])
    # A schedule that restarted every epoch would differ (the test can fail).
    wrong = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: k % 3 == 0, rho=0.2)
    wrong = _numpy_sgd(wrong, x, y, 8, 0.1, lambda k: k % 3 == 0, rho=0.2)
    assert not all(np.allclose(a, b, rtol=1e-7) for a, b in zip(_weights(trainer.model), wrong))


def test_batch_norm_statistics_come_from_the_clean_pass_only(float64):
    keras.utils.set_random_seed(9)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, dtype="float64"),
            keras.layers.BatchNormalization(momentum=0.5, dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    x, y = data64(8, seed=4)
    # Copies (JAX's fit donates the variables' buffers): w and the state before the step.
    params = [ops.convert_to_tensor(_np(p)) for p in F.current_params(model)]
    state = [ops.convert_to_tensor(_np(s)) for s in F.current_state(model)]
    # What one plain training pass at w would leave in the moving statistics.
    _, expected_state, _ = F.stateless_forward(model, params, state, x)
    trainer = _compile(SAMTrainer(model, rho=0.5))
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for v, e in zip(model.non_trainable_variables, expected_state):
        np.testing.assert_allclose(_np(v), _np(e), rtol=1e-12)
    # The perturbed pass's statistics differ (so keeping them would show).
    r = sam_gradient(F.make_loss_fn(model, MSE64), params, state, (x, y), rho=0.5)
    _, perturbed_state, _ = F.stateless_forward(
        model, F.offset_params(params, r.perturbation, 1.0), state, x
    )
    assert not np.allclose(_np(perturbed_state[0]), _np(expected_state[0]), rtol=1e-6)


def test_gsam_rho_follows_the_optimizer_schedule(float64):
    x, y = data64(32, seed=9)
    lr = keras.optimizers.schedules.PolynomialDecay(0.1, 3, end_learning_rate=0.01)
    trainer = GSAMTrainer(
        mlp64(seed=14), rho=0.2, rho_min=0.02, alpha=0.1, learning_rate_range=(0.01, 0.1)
    )
    _compile(trainer, optimizer=keras.optimizers.SGD(lr))
    rhos = []
    cb = keras.callbacks.LambdaCallback(on_batch_end=lambda b, logs: rhos.append(logs["rho"]))
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    # lr at steps 0..3: 0.1, 0.07, 0.04, 0.01 -> rho 0.2, 0.14, 0.08, 0.02.
    np.testing.assert_allclose(rhos, [0.2, 0.14, 0.08, 0.02], rtol=1e-6)
    with pytest.raises(ValueError, match="`learning_rate_range`"):
        GSAMTrainer(mlp64(), rho=0.2, rho_min=0.02)


# ------------------------------------------------------------------- precision


def test_mixed_precision_is_finite_and_close_to_float32():
    x, y = (a.astype("float32") for a in data64(32, seed=7))

    def model():
        keras.utils.set_random_seed(12)
        return keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(16, "tanh"), keras.layers.Dense(2)]
        )

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        trainer = SAMTrainer(model(), rho=0.1)
        trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE)
        assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)
    assert np.isfinite(h.history["loss"]).all() and np.isfinite(h.history["grad_norm"]).all()
    fp32 = SAMTrainer(model(), rho=0.1)
    fp32.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE)
    h32 = fp32.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(fp32.model)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2)
    # grad_norm is the unscaled ||g||: a loss-scaled one would be 2^15 times larger.
    np.testing.assert_allclose(h.history["grad_norm"], h32.history["grad_norm"], rtol=0.05)


def test_mixed_bfloat16_is_finite_and_close_to_float32():
    """bfloat16 compute, float32 weights: e(w) and the diagnostics accumulate in float32."""
    x, y = (a.astype("float32") for a in data64(32, seed=7))

    def fit(policy):
        keras.mixed_precision.set_global_policy(policy)
        try:
            keras.utils.set_random_seed(12)
            model = keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(16, "tanh"), keras.layers.Dense(2)]
            )
            trainer = GSAMTrainer(model, rho=0.1, alpha=0.2, adaptive=True)
            trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE)
            h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return model, h.history

    model, h = fit("mixed_bfloat16")
    model32, h32 = fit("float32")
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert np.isfinite(h["loss"]).all() and np.isfinite(h["surrogate_gap"]).all()
    for a, b in zip(_weights(model), _weights(model32)):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-2)
    np.testing.assert_allclose(h["grad_norm"], h32["grad_norm"], rtol=0.05)


def test_nonfinite_gradient_skips_the_step_without_moving_the_weights():
    """A loss scale that overflows float16: the LossScaleOptimizer skips the step (weights
    and slots unchanged) and halves its scale; the perturbation did not move anything."""
    x, y = (a.astype("float32") for a in data64(8, seed=8))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(13)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, "tanh"), keras.layers.Dense(2)]
        )
        trainer = SAMTrainer(model, rho=0.1)
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0**40
        )
        trainer.compile(optimizer=optimizer, loss=MSE)
        before = _weights(model)
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for a, b in zip(_weights(model), before):
        np.testing.assert_array_equal(a, b)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**39
    assert int(trainer.steps_seen.numpy()) == 1


# --------------------------------------------------------------- save, options


@pytest.mark.parametrize(
    "make",
    [
        lambda m: SAMTrainer(m, rho=0.2, adaptive=True, every=2),
        lambda m: GSAMTrainer(
            m, rho=0.2, rho_min=0.05, alpha=0.3, every=2, learning_rate_range=(0.01, 0.1)
        ),
    ],
    ids=["asam", "gsam"],
)
def test_trainer_and_model_save_and_reload(float64, tmp_path, make):
    x, y = data64(24, seed=10)
    trainer = _compile(make(mlp64(seed=15)))
    trainer.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    keras.saving.save_model(trainer, tmp_path / "t.keras")  # the trainer (trainer.save: the model)
    resumed = keras.models.load_model(tmp_path / "t.keras")
    assert type(resumed) is type(trainer) and int(resumed.steps_seen.numpy()) == 1
    options = {k: v for k, v in trainer.get_config().items() if k not in ("model", "name")}
    assert {k: resumed.get_config()[k] for k in options} == options
    trainer.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed.fit(x[8:], y[8:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_weights(trainer.model), _weights(resumed.model)):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    # The user's model evaluates, predicts and saves as itself.
    trainer.save(tmp_path / "m.keras")
    model = keras.models.load_model(tmp_path / "m.keras")
    assert not isinstance(model, SAMTrainer)
    np.testing.assert_allclose(
        _np(model.predict(x, verbose=0)), _np(trainer.predict(x, verbose=0)), rtol=1e-12
    )
    np.testing.assert_allclose(
        trainer.evaluate(x, y, verbose=0),
        np.mean((_np(trainer.model.predict(x, verbose=0)) - y) ** 2),
        rtol=1e-10,
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rho": -1.0}, "rho"),
        ({"every": 0}, "every"),
        ({"m_sharpness": "yes"}, "m_sharpness"),
        ({"adaptive": 1}, "adaptive"),
    ],
)
def test_bad_options_name_the_argument(float64, kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        SAMTrainer(mlp64(), **kwargs)


# ------------------------------------------- TensorFlow == JAX, float64, golden files

GOLDEN_CASES = {
    "sam": lambda m: SAMTrainer(m, rho=0.1),
    "asam": lambda m: SAMTrainer(m, rho=0.5, adaptive=True, eta=0.02),
    "gsam_schedule": lambda m: GSAMTrainer(
        m, rho=0.2, rho_min=0.05, alpha=0.3, learning_rate_range=(0.0625, 0.125)
    ),
    "every3": lambda m: SAMTrainer(m, rho=0.2, every=3),
    "m_sharpness": lambda m: GSAMTrainer(m, rho=0.3, alpha=0.2, m_sharpness=True),
}


def _golden_model(case):
    """The golden cases' model, its weights drawn by NumPy (`set_numpy_weights`: Keras's
    seeded initializers draw differently on each backend)."""
    if case != "gsam_schedule":
        model = mlp64()
    else:
        # With BatchNormalization: the kept state (the clean pass's statistics) compared too.
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="float64"),
                keras.layers.Dense(5, "tanh", dtype="float64"),
                keras.layers.BatchNormalization(momentum=0.8, dtype="float64"),
                keras.layers.Dense(2, dtype="float64"),
            ]
        )
    set_numpy_weights(model, seed=21)
    return model


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_tensorflow_equals_jax_on_golden_trajectories(float64, case):
    """5 batches x 2 epochs from the same weights (the golden's) on the same batches, SGD
    on a schedule (not Adam: Keras's own Adam differs between the backends at float64, its
    python betas go through float32 on TensorFlow): the weights, state and logs equal
    TensorFlow's (the files are written on TensorFlow, so in the TensorFlow env this checks
    TensorFlow still gives them)."""
    model = _golden_model(case)
    x, y = data64(40, seed=22)
    init = {f"init_{i}": _np(v) for i, v in enumerate(model.weights)}
    trainer = GOLDEN_CASES[case](model)
    # Every learning rate of this schedule is exact in float32 (TensorFlow computes a
    # schedule of python floats in float32, JAX under x64 in float64).
    lr = keras.optimizers.schedules.PolynomialDecay(0.125, 8, end_learning_rate=0.0625)
    trainer.compile(optimizer=keras.optimizers.SGD(lr), loss=MSE64)
    h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    arrays = dict(init)
    arrays.update({f"weight_{i}": _np(v) for i, v in enumerate(model.weights)})
    arrays["predictions"] = _np(model.predict(x[:8], verbose=0))
    check_golden(f"sam_{case}", arrays)
    # The logs are float32 metrics: compared to float32 rounding.
    logs = {k: np.asarray(v, "float64") for k, v in h.history.items()}
    check_golden(f"sam_{case}_logs", logs, rtol=1e-6)


# --------------------------------------------------------- JAX: 1 device == 2 devices


@requires_jax
@pytest.mark.parametrize("every", [1, 2])
def test_one_device_equals_two_on_jax(float64, every):
    x, y = data64(32, seed=5)
    results = []
    for devices in (1, 2):
        with data_parallel(devices):
            trainer = _compile(GSAMTrainer(mlp64(seed=10), rho=0.2, alpha=0.2, every=every))
            h = trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            results.append((_weights(trainer.model), h.history))
    (w1, h1), (w2, h2) = results
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for key in ("loss", "grad_norm", "surrogate_gap"):  # float32 metrics
        np.testing.assert_allclose(h1[key], h2[key], rtol=1e-6)


@requires_jax
@pytest.mark.parametrize(
    "make, options, every",
    [
        (lambda m: SAMTrainer(m, rho=0.3, m_sharpness=True), dict(rho=0.3), 1),
        (
            lambda m: GSAMTrainer(m, rho=0.4, alpha=0.2, adaptive=True, m_sharpness=True),
            dict(rho=0.4, alpha=0.2, adaptive=True, mask=[True, False, True, False]),
            1,
        ),
        (lambda m: SAMTrainer(m, rho=0.3, every=2, m_sharpness=True), dict(rho=0.3), 2),
    ],
    ids=["sam", "gsam_asam", "sam_every2"],
)
def test_m_sharpness_on_two_devices_perturbs_each_devices_rows(float64, make, options, every):
    """As TensorFlow's two replicas (test_sam_trainer.py): a perturbed step is the mean of
    the two shards' SAM directions, each perturbed along its own gradient (a step of
    `every` that is not perturbed: the plain gradient); the global rule differs."""
    x, y = data64(32, seed=6)
    with data_parallel(2):
        trainer = _compile(make(mlp64(seed=11)))
        w0 = _weights(trainer.model)
        h = trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    w, norms = [a.copy() for a in w0], []
    for k, s in enumerate(range(0, 32, 8)):
        shards = [(x[s + r : s + r + 4], y[s + r : s + r + 4]) for r in (0, 4)]
        if k % every:
            directions = [np_loss_and_grad(w, bx, by)[1] for bx, by in shards]
        else:
            for bx, by in shards:  # the logged ||g|| (ASAM: ||T g||): the shards' mean
                g = np_loss_and_grad(w, bx, by)[1]
                mask = options.get("mask") or [False] * len(w)
                t = [np.abs(p) + 0.01 if m else 1.0 for p, m in zip(w, mask)]
                norms.append(np_norm([ti * gi for ti, gi in zip(t, g)]))
            directions = [np_sam_direction(w, bx, by, **options) for bx, by in shards]
        w = [a - 0.1 * (b + c) / 2 for a, b, c in zip(w, *directions)]
    for a, b in zip(_weights(trainer.model), w):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    global_rule = _numpy_sgd(w0, x, y, 8, 0.1, lambda k: k % every == 0, **options)
    assert not all(np.allclose(a, b, rtol=1e-6) for a, b in zip(w, global_rule))
    np.testing.assert_allclose(h.history["grad_norm"], [np.mean(norms)], rtol=1e-6)
