"""Meta DotProd: numerical oracles and equivalences for the algorithm and DotProdTrainer."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from conftest import two_cpu_strategy
from tf_metaalign import functional as F
from tf_metaalign.algorithms.dotprod import dotprod_gradient
from tf_metaalign.trainers import DotProdTrainer

MSE = keras.losses.MeanSquaredError()
# Keras losses compute in floatx (float32) unless told otherwise.
MSE64 = keras.losses.MeanSquaredError(dtype="float64")


def _mse(dtype):
    return MSE64 if dtype == "float64" else MSE


def _mlp(dtype="float32", seed=0, dropout=0.0, hidden=16):
    keras.utils.set_random_seed(seed)
    layers = [
        keras.Input((6,), dtype=dtype),
        keras.layers.Dense(hidden, activation="tanh", dtype=dtype),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
    return keras.Sequential(layers)


def _data(n=64, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(dtype)
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1).astype(dtype)
    return x, y


def _reference_minus_h2_g1(model, b1, b2):
    """-H2 G1 by a double-backward pass on the *assigned* model (independent of the library)."""
    variables = model.trainable_variables
    loss = _mse(variables[0].dtype)
    with tf.GradientTape() as t1:
        l1 = loss(b1[1], model(b1[0], training=True))
    g1 = [tf.stop_gradient(g) for g in t1.gradient(l1, variables)]
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            l2 = loss(b2[1], model(b2[0], training=True))
        g2 = inner.gradient(l2, variables)
        gv = tf.add_n([tf.reduce_sum(a * b) for a, b in zip(g2, g1)])
    return [-h for h in outer.gradient(gv, variables)]


def _regularizer(model, b1, b2, **kwargs):
    loss_fn = F.make_loss_fn(model, _mse(model.trainable_variables[0].dtype))
    r = dotprod_gradient(loss_fn, F.current_params(model), F.current_state(model), b1, b2, **kwargs)
    return r


def _halves(x, y):
    n = len(x) // 2
    return (x[:n], y[:n]), (x[n:], y[n:])


# ------------------------------------------------------------------ finite difference


def test_auto_alpha_float32_matches_exact_hessian_vector_product():
    model = _mlp()
    b1, b2 = _halves(*_data())
    exact = _reference_minus_h2_g1(model, b1, b2)
    fd = _regularizer(model, b1, b2, alpha="auto").regularizer
    cos = F.cosine(fd, exact).numpy()
    assert cos >= 0.99, cos
    rel = (F.global_norm(F.sub(fd, exact)) / F.global_norm(exact)).numpy()
    assert rel < 0.1, rel
    # method="exact" is the exact product itself.
    ex = _regularizer(model, b1, b2, method="exact").regularizer
    for a, b in zip(ex, exact):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_paper_alpha_is_far_off_in_float32_but_agrees_in_float64():
    model32 = _mlp("float32")
    b1, b2 = _halves(*_data())
    exact32 = _reference_minus_h2_g1(model32, b1, b2)
    fd32 = _regularizer(model32, b1, b2, alpha=1e-7).regularizer
    cos32 = F.cosine(fd32, exact32).numpy()
    rel32 = (F.global_norm(F.sub(fd32, exact32)) / F.global_norm(exact32)).numpy()
    assert rel32 > 0.5, (cos32, rel32)  # rounding noise dominates

    model64 = _mlp("float64")
    b1, b2 = _halves(*_data(dtype="float64"))
    exact64 = _reference_minus_h2_g1(model64, b1, b2)
    fd64 = _regularizer(model64, b1, b2, alpha=1e-7).regularizer
    assert F.cosine(fd64, exact64).numpy() > 0.9999
    rel64 = (F.global_norm(F.sub(fd64, exact64)) / F.global_norm(exact64)).numpy()
    assert rel64 < 1e-3, rel64


def test_quadratic_dotprod_equals_first_order_two_step_reptile():
    """On L_b = 1/2 t'A_b t - c_b't, G1 + G2 - beta*H2 G1 == (theta - theta_2)/beta exactly."""
    rng = np.random.default_rng(0)
    d = 7

    def spd():
        m = rng.normal(size=(d, d))
        return m @ m.T / d + np.eye(d)

    a = {1: tf.constant(spd()), 2: tf.constant(spd())}
    c = {1: tf.constant(rng.normal(size=(d,))), 2: tf.constant(rng.normal(size=(d,)))}

    def loss_fn(params, state, batch):
        t = params[0]
        return 0.5 * tf.tensordot(t, tf.linalg.matvec(a[batch], t), 1) - tf.tensordot(
            c[batch], t, 1
        ), (state, None)

    theta = tf.constant(rng.normal(size=(d,)))
    beta = 0.05
    for method in ("finite_difference", "exact"):
        r = dotprod_gradient(
            loss_fn, [theta], None, 1, 2, weight=beta, alpha=1e-3, method=method, alignment="dot"
        )  # the paper's objective

        # Reptile: two SGD steps with step beta on b1 then b2; pseudo-gradient (theta -
        # theta_2)/beta.
        def g(t, b):
            return tf.linalg.matvec(a[b], t) - c[b]

        t1 = theta - beta * g(theta, 1)
        t2 = t1 - beta * g(t1, 2)
        np.testing.assert_allclose(
            r.gradient[0].numpy(), ((theta - t2) / beta).numpy(), rtol=1e-8, atol=1e-9
        )


# ---------------------------------------------------------------------- the trainer


def _compile(trainer_or_model, lr=0.05, **kwargs):
    dtype = trainer_or_model.model.trainable_variables[0].dtype
    trainer_or_model.compile(optimizer=keras.optimizers.SGD(lr), loss=_mse(dtype), **kwargs)
    return trainer_or_model


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


def _assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _manual_dotprod_sgd(model, x, y, batch_size, lr, schedule, **kwargs):
    """The reference loop: dotprod_gradient per batch, theta -= lr * G, regulariser on
    `schedule(k)`."""
    loss_fn = F.make_loss_fn(model, _mse(model.trainable_variables[0].dtype))
    k = 0
    for epoch_batches in schedule["epochs"]:
        for start in range(0, len(x), batch_size)[:epoch_batches]:
            bx, by = x[start : start + batch_size], y[start : start + batch_size]
            n1 = len(bx) // 2
            r = dotprod_gradient(
                loss_fn,
                F.current_params(model),
                F.current_state(model),
                (bx[:n1], by[:n1]),
                (bx[n1:], by[n1:]),
                apply_regularizer=schedule["apply"](k),
                **kwargs,
            )
            for v, g in zip(model.trainable_variables, r.gradient):
                v.assign_sub(lr * g)
            k += 1


def test_weight_zero_equals_plain_training_with_g1_plus_g2(float64):
    x, y = _data(48, dtype="float64")
    trainer = _compile(DotProdTrainer(_mlp("float64", seed=3), weight=0.0))
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    ref = _mlp("float64", seed=3)
    opt = keras.optimizers.SGD(0.05)
    for _ in range(2):
        for s in range(0, 48, 16):
            grads = []
            for lo, hi in ((s, s + 8), (s + 8, s + 16)):
                with tf.GradientTape() as tape:
                    loss = MSE64(y[lo:hi], ref(x[lo:hi], training=True))
                grads.append(tape.gradient(loss, ref.trainable_variables))
            opt.apply_gradients(zip(F.add(*grads), ref.trainable_variables))
    _assert_weights_close(_weights(trainer.model), _weights(ref))


def test_every_schedule_counts_across_epochs_and_steps_per_execution(float64):
    x, y = _data(
        40, dtype="float64"
    )  # 5 batches of 8 per epoch: the phase of `every=3` shifts between epochs
    trainer = _compile(
        DotProdTrainer(_mlp("float64", seed=1), weight=0.5, every=3), steps_per_execution=2
    )
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(trainer.pairs_seen.numpy()) == 10

    ref = _mlp("float64", seed=1)
    _manual_dotprod_sgd(
        ref, x, y, 8, 0.05, {"epochs": [5, 5], "apply": lambda k: k % 3 == 0}, weight=0.5
    )
    _assert_weights_close(_weights(trainer.model), _weights(ref))

    # The test can fail: a schedule that restarts every epoch gives other weights.
    wrong = _mlp("float64", seed=1)
    _manual_dotprod_sgd(
        wrong, x, y, 8, 0.05, {"epochs": [5, 5], "apply": lambda k: (k % 5) % 3 == 0}, weight=0.5
    )
    assert not all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(_weights(trainer.model), _weights(wrong))
    )


@pytest.mark.parametrize("every", [1, 2])
def test_one_replica_equals_two(float64, every):
    x, y = _data(32, dtype="float64")
    # A global batch of 8 reaches replica r as rows [4r, 4r+4); each replica splits its own
    # shard, so the global b1 is rows {0,1,4,5} and b2 {2,3,6,7}. Feed one replica that order.
    order = np.concatenate(
        [[s + 0, s + 1, s + 4, s + 5, s + 2, s + 3, s + 6, s + 7] for s in range(0, 32, 8)]
    )

    single = _compile(DotProdTrainer(_mlp("float64", seed=2), weight=0.3, every=every))
    h1 = single.fit(x[order], y[order], batch_size=8, epochs=1, shuffle=False, verbose=0)

    strategy = two_cpu_strategy()
    with strategy.scope():
        double = _compile(DotProdTrainer(_mlp("float64", seed=2), weight=0.3, every=every))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    h2 = double.fit(ds, epochs=1, verbose=0)

    _assert_weights_close(_weights(single.model), _weights(double.model), rtol=1e-4, atol=1e-6)
    for key in ("loss", "grad_dot", "grad_cosine"):
        np.testing.assert_allclose(h1.history[key], h2.history[key], rtol=1e-4)


def test_jit_compile_equals_graph_and_run_eagerly(float64):
    x, y = _data(32, dtype="float64")
    results = {}
    for mode, kwargs in {
        "graph": {"jit_compile": False},
        "xla": {"jit_compile": True},
        "eager": {"run_eagerly": True},
    }.items():
        trainer = _compile(DotProdTrainer(_mlp("float64", seed=4), weight=0.2, every=2), **kwargs)
        h = trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results[mode] = (_weights(trainer.model), h.history["grad_dot"][0])
    for mode in ("xla", "eager"):
        _assert_weights_close(results["graph"][0], results[mode][0], rtol=1e-4)
        np.testing.assert_allclose(results["graph"][1], results[mode][1], rtol=1e-4)


def test_same_dropout_masks_for_g2_and_g21():
    """With dropout, G21 is taken with G2's masks: alpha->small gives -H2 G1 of that mask."""
    model = _mlp(dropout=0.5)
    b1, b2 = _halves(*_data())
    loss_fn = F.make_loss_fn(model, MSE)
    r = dotprod_gradient(
        loss_fn, F.current_params(model), F.current_state(model), b1, b2, method="exact"
    )
    fd = dotprod_gradient(loss_fn, F.current_params(model), F.current_state(model), b1, b2)
    assert F.cosine(fd.regularizer, r.regularizer).numpy() > 0.99


def test_accumulation_steps_apply_the_mean_of_the_pairs_gradients(float64):
    x, y = _data(32, dtype="float64")
    trainer = _compile(DotProdTrainer(_mlp("float64", seed=5), weight=0.4, accumulation_steps=2))
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    ref = _mlp("float64", seed=5)
    loss_fn = F.make_loss_fn(ref, MSE64)
    for s in range(0, 32, 16):
        gs = []
        for t in (s, s + 8):
            bx, by = x[t : t + 8], y[t : t + 8]
            gs.append(
                dotprod_gradient(
                    loss_fn,
                    F.current_params(ref),
                    F.current_state(ref),
                    (bx[:4], by[:4]),
                    (bx[4:], by[4:]),
                    weight=0.4,
                ).gradient
            )
        for v, a, b in zip(ref.trainable_variables, *gs):
            v.assign_sub(0.05 * (a + b) / 2)
    _assert_weights_close(_weights(trainer.model), _weights(ref))


def test_mixed_precision_trains_and_perturbs_float32_variables():
    x, y = _data(32)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        trainer = DotProdTrainer(_mlp(seed=6), weight=0.2)
        trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss=MSE)
        assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        h = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        mp_weights = _weights(trainer.model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)
    assert np.isfinite(h.history["loss"]).all() and np.isfinite(h.history["grad_dot"]).all()
    fp32 = _compile(DotProdTrainer(_mlp(seed=6), weight=0.2))
    h32 = fp32.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    # float16 compute: close to the float32 run, not equal.
    _assert_weights_close(mp_weights, _weights(fp32.model), rtol=0, atol=2e-2)
    np.testing.assert_allclose(h.history["grad_dot"], h32.history["grad_dot"], rtol=0.1)


def test_model_saves_and_reloads_as_itself_and_trainer_resumes_identically(tmp_path, float64):
    x, y = _data(48, dtype="float64")
    model = _mlp("float64", seed=7)
    trainer = _compile(DotProdTrainer(model, weight=0.3, every=2), lr=0.05)
    trainer.fit(
        x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0
    )  # 3 pairs: odd phase
    assert trainer.model is model

    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded) is type(model)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)

    keras.saving.save_model(trainer, tmp_path / "trainer.keras")  # the trainer itself
    resumed = keras.models.load_model(tmp_path / "trainer.keras")
    assert isinstance(resumed, DotProdTrainer) and int(resumed.pairs_seen.numpy()) == 3
    assert (resumed.weight, resumed.every) == (0.3, 2)

    trainer.fit(x[24:], y[24:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed.fit(x[24:], y[24:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_weights_close(_weights(trainer.model), _weights(resumed.model), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"weight": -0.1}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": "tiny"}, "alpha"),
        ({"every": 0}, "every"),
        ({"every": 1.5}, "every"),
        ({"method": "hessian"}, "method"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
    ],
)
def test_bad_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        DotProdTrainer(_mlp(), **kwargs)


def test_batches_of_one_are_plain_steps_not_an_error(float64):
    """A batch that cannot be split used to be an error; it is now a plain step on (b, b):
    G = 2 * grad L(b), so batch_size=1 DotProd == plain SGD at twice the learning rate
    (more in tests/trainers/test_dotprod_stability.py)."""
    x, y = _data(8, dtype="float64")
    trainer = _compile(DotProdTrainer(_mlp("float64", seed=15), weight=0.3))
    h = trainer.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert h.history["unsplit_fraction"] == [1.0] and np.isfinite(h.history["loss"]).all()
    plain = _mlp("float64", seed=15)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=MSE64)
    plain.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    _assert_weights_close(_weights(trainer.model), _weights(plain), rtol=1e-9, atol=1e-12)


def test_odd_batch_is_split_and_reported_loss_is_the_batch_mean():
    x, y = _data(7)
    trainer = _compile(DotProdTrainer(_mlp(seed=8), weight=0.1), lr=0.0)
    h = trainer.fit(x, y, batch_size=7, epochs=1, verbose=0)
    expected = MSE(y, trainer.model(x, training=False)).numpy()
    np.testing.assert_allclose(h.history["loss"][0], expected, rtol=1e-5)


def test_keras_optimizer_not_a_model_is_rejected():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        DotProdTrainer(lambda x: x)


def test_custom_loop_example_under_strategy_equals_fit(float64):
    """The README's custom-loop example (tf.function + strategy.run) == DotProdTrainer.fit."""
    x, y = _data(32, dtype="float64")
    strategy = two_cpu_strategy()
    with strategy.scope():
        model = _mlp("float64", seed=9)
        optimizer = keras.optimizers.SGD(0.05)
        trainer = _compile(DotProdTrainer(_mlp("float64", seed=9), weight=0.3))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    trainer.fit(ds, epochs=1, verbose=0)

    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError(dtype="float64"))

    @tf.function
    def train_step(batch):
        def step(batch):
            bx, by = batch
            b1, b2 = F.split_batch((bx, by), tf.shape(bx)[0] // 2)
            r = dotprod_gradient(
                loss_fn,
                F.current_params(model),
                F.current_state(model),
                b1,
                b2,
                weight=0.3,
                alpha="auto",
            )
            F.assign_state(model, r.aux_2[0])
            optimizer.apply_gradients(zip(r.gradient, model.trainable_variables))
            return r.grad_dot

        return strategy.run(step, args=(batch,))

    for batch in strategy.experimental_distribute_dataset(ds):
        train_step(batch)
    _assert_weights_close(_weights(trainer.model), _weights(model), rtol=1e-9, atol=1e-12)


def test_nan_loss_stops_with_a_clear_error_before_touching_the_weights():
    x, y = _data(16)
    y[3, 0] = np.nan
    trainer = _compile(DotProdTrainer(_mlp(seed=10)))
    before = _weights(trainer.model)
    with pytest.raises(Exception, match="not finite"):
        trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    _assert_weights_close(before, _weights(trainer.model), rtol=0, atol=0)
    assert int(trainer.pairs_seen.numpy()) == 0
