"""GuidedTrainer: plain-training equivalence, replicas, save/restore, bad input, custom loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_cpu_strategy
from optimizer_registry import factories
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.trainers.guided import (
    GuidedHyperparameters,
    GuidedTrainer,
    guided_update,
    split_guidance_batch,
)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _model(seed=0, dropout=0.0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=3))
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


# A few configurations of the shared registry (tests/optimizer_registry.py); the Adafactor
# ones factor this model's kernels (min_dim_size_to_factor <= 2), adafactor_pegasus without
# momentum (T5's default: only the learning rate is learnable).
OPTS = factories("adam", "sgd_momentum", "lamb", "adafactor_factored_momentum", "adafactor_pegasus")


@pytest.mark.parametrize("commit_forward_update", [False, True])
@pytest.mark.parametrize("key", sorted(OPTS))
def test_meta_learning_rate_zero_equals_plain_training(key, commit_forward_update):
    x, y = _data()
    plain = _model(dropout=0.2)
    plain.compile(OPTS[key](), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    model = _model(dropout=0.2)
    trainer = GuidedTrainer(
        model,
        _data(16, seed=5),
        meta_optimizer=O.Adam(0.0),
        commit_forward_update=commit_forward_update,
    )
    trainer.compile(OPTS[key](), loss="mse")
    hist = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    if not commit_forward_update:  # the same update path as plain training: bit-identical
        for a, b in zip(_weights(plain), _weights(model)):
            np.testing.assert_array_equal(a, b)
    # commit_forward_update: the guided step commits its own lookahead update (the same rule on the
    # same inputs,
    # in another graph): bit-identical for most rules, within an ulp where the compiler
    # fuses LAMB's last multiply-subtract differently. Any real difference is >> 2 ulp.
    for a, b in zip(_weights(plain), _weights(model)):
        np.testing.assert_array_max_ulp(a, b, maxulp=2)
    assert hist.history["learning_rate_scale"][-1] == 1.0
    assert np.isfinite(hist.history["guidance_loss"]).all()
    assert hist.history["hypergrad_learning_rate"][-1] != 0.0


def _run_guided(strategy, steps_x, meta_lr=0.05, key="adam"):
    x, y = steps_x
    with strategy.scope():
        model = _model()
        trainer = GuidedTrainer(model, _data(16, seed=5), meta_optimizer=O.Adam(meta_lr))
        trainer.compile(OPTS[key](), loss="mse")
    hist = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return trainer, hist


@pytest.mark.parametrize("key", ["adam", "sgd_momentum"])
def test_one_replica_equals_two(key):
    data = _data()
    t1, h1 = _run_guided(tf.distribute.OneDeviceStrategy("/cpu:0"), data, key=key)
    t2, h2 = _run_guided(two_cpu_strategy(), data, key=key)
    for a, b in zip(_weights(t1.model), _weights(t2.model)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    v1, v2 = t1.learned_values(), t2.learned_values()
    assert v1["learning_rate"] != 1.0  # the values did move
    for n in v1:
        np.testing.assert_allclose(v1[n], v2[n], rtol=1e-5)
    for k in ("loss", "guidance_loss", "hypergrad_learning_rate", "learning_rate_scale"):
        np.testing.assert_allclose(h1.history[k], h2.history[k], rtol=2e-4, err_msg=k)


def _make_trainer(meta_lr=0.05):
    trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=O.Adam(meta_lr))
    trainer.compile(O.Lamb(0.02), loss="mse")
    return trainer


def test_save_restore_continues_identically(tmp_path):
    x, y = _data()
    a = _make_trainer()
    a.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "guided.weights.h5")
    a.save_weights(path)
    saved = a.learned_values()
    saved_slots = {k: v.numpy() for k, v in a.guided.meta_slots["learning_rate"].items()}
    a.fit(x[32:], y[32:], batch_size=16, epochs=1, shuffle=False, verbose=0)

    b = _make_trainer()
    b.optimizer.build(b.model.trainable_variables)
    b.load_weights(path)
    assert b.learned_values() == saved
    for k, v in b.guided.meta_slots["learning_rate"].items():
        np.testing.assert_array_equal(v.numpy(), saved_slots[k])
        assert np.any(v.numpy() != 0)
    assert int(b.guided.guided_steps.numpy()) == 2
    b.fit(x[32:], y[32:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    for u, v in zip(_weights(a.model), _weights(b.model)):
        np.testing.assert_array_equal(u, v)
    assert a.learned_values() == b.learned_values()
    # Re-compiling a restored trainer keeps the learned values.
    b.compile(O.Lamb(0.02), loss="mse")
    assert b.learned_values() == a.learned_values()


def test_custom_loop_matches_trainer():
    x, y = _data(32)
    trainer = _make_trainer()
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    model = _model()
    optimizer = O.Lamb(0.02)
    optimizer.build(model.trainable_variables)
    hyper = GuidedHyperparameters(meta_optimizer=O.Adam(0.05))
    hyper.bind(optimizer)
    mse = keras.losses.MeanSquaredError()
    train_loss = F.make_loss_fn(model, mse, training=True)
    guide_loss = F.make_loss_fn(model, mse, training=False)
    guidance = tuple(tf.constant(t) for t in _data(16, seed=5))

    @tf.function
    def step(batch):
        params, state = F.current_params(model), F.current_state(model)
        loss, grads, (new_state, _) = F.value_and_grad(train_loss, params, state, batch)
        guided_update(hyper, model, optimizer, guide_loss, grads, new_state, guidance)
        F.assign_state(model, new_state)
        return loss

    for i in range(2):
        step((tf.constant(x[16 * i : 16 * (i + 1)]), tf.constant(y[16 * i : 16 * (i + 1)])))
    for u, v in zip(_weights(trainer.model), _weights(model)):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)
    got = {n: float(v) for n, v in hyper.values().items()}
    for n, v in trainer.learned_values().items():
        np.testing.assert_allclose(got[n], v, rtol=1e-7)


def test_guidance_every_and_dataset_cycling():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices(_data(48, seed=9)).batch(16)
    trainer = GuidedTrainer(_model(), ds, meta_optimizer=O.Adam(0.05), guidance_every=2)
    trainer.compile(O.Adam(0.02), loss="mse")
    assert trainer.guidance.num_batches == 3
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 4 steps
    assert int(trainer.guided.steps.numpy()) == 4
    assert int(trainer.guided.guided_steps.numpy()) == 2


def _labelled_data(n=64, seed=0):
    """x as above, y = the example's index (float): identifies every example."""
    x, _ = _data(n, seed)
    return x, np.arange(n, dtype="float32")[:, None]


def _ids(batch):
    return {int(i) for i in np.asarray(batch[1]).ravel()}


@pytest.mark.parametrize(
    "make, holdout, repeats",
    [
        (lambda ds: ds.shuffle(64).batch(8), "identity", 1),  # reshuffles per epoch
        (lambda ds: ds.shuffle(64, seed=3).batch(8), "identity", 1),
        (lambda ds: ds.batch(8).repeat(2), "identity", 2),  # examples come back
        (lambda ds: ds.shuffle(64, reshuffle_each_iteration=False).batch(8), "position", 1),
        (lambda ds: ds.batch(8), "position", 1),
    ],
    ids=["shuffle", "shuffle_seeded", "repeat", "shuffle_once", "plain"],
)
def test_split_guidance_batch_never_trains_on_guidance_examples(make, holdout, repeats):
    """3 epochs: no example trained on is a guidance example, and every other example is
    trained on once per epoch (twice with repeat(2))."""
    ds = make(tf.data.Dataset.from_tensor_slices(_labelled_data()))
    guidance, rest = split_guidance_batch(ds, num_batches=1)
    held_out = _ids(guidance)
    assert len(held_out) == 8
    for _ in range(3):
        trained = [int(i) for b in rest for i in b[1].numpy().ravel()]
        assert not held_out & set(trained)
        assert sorted(trained) == sorted(list(set(range(64)) - held_out) * repeats)
    if holdout == "position":  # the batches are the dataset's own, unchanged
        assert rest.element_spec == ds.element_spec
    # the number of batches is kept (Keras then knows each epoch's length)
    assert int(rest.cardinality()) == int(ds.cardinality()) - (holdout == "position")


def test_split_guidance_batch_by_position_on_a_reshuffling_dataset_leaks():
    """Why identity is needed: take/skip on a reshuffling dataset draw other examples each
    iteration (the behaviour before identity holdout; kept as holdout="position")."""
    ds = tf.data.Dataset.from_tensor_slices(_labelled_data()).shuffle(64, seed=1).batch(8)
    guidance, rest = split_guidance_batch(ds, holdout="position")
    leaked = [
        len(_ids(guidance) & {int(i) for b in rest for i in b[1].numpy().ravel()}) for _ in range(3)
    ]
    assert min(leaked) >= 4, leaked  # most of the 8 "held out" examples are trained on


def test_split_guidance_batch_trains_a_guided_trainer_on_a_shuffled_dataset():
    """The identity-filtered batches (some smaller) train like any others."""
    ds = tf.data.Dataset.from_tensor_slices(_labelled_data(64)).shuffle(64).batch(16)
    guidance, rest = split_guidance_batch(ds)
    trainer = GuidedTrainer(_model(), guidance, meta_optimizer=O.Adam(0.05))
    trainer.compile(O.Adam(0.02), loss="mse")
    hist = trainer.fit(rest, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert trainer.learned_values()["learning_rate"] != 1.0
    assert int(trainer.guided.steps.numpy()) >= 6  # 48 examples in 3-4 batches per epoch


def test_split_guidance_batch_refuses_what_identity_cannot_hold_out():
    base = tf.data.Dataset.from_tensor_slices(_labelled_data())
    augmented = base.shuffle(64).map(lambda x, y: (x + tf.random.uniform(tf.shape(x)), y)).batch(8)
    with pytest.raises(
        ValueError,
        match=r"reshuffles every epoch.*draw random numbers.*Split "
        r"before shuffling.*reshuffle_each_iteration=False",
    ):
        split_guidance_batch(augmented)
    # augmentation on an unshuffled dataset: the same batches every epoch, held out by position
    _, rest = split_guidance_batch(
        base.map(lambda x, y: (x + tf.random.uniform(tf.shape(x)), y)).batch(8)
    )
    assert len(list(rest)) == 7
    texts = tf.data.Dataset.from_tensor_slices(
        (tf.ragged.constant([[1], [2, 3], [4, 5, 6], [7]]), tf.range(4))
    ).shuffle(4)
    padded = texts.map(lambda t, y: (t.to_tensor() if hasattr(t, "to_tensor") else t, y))
    with pytest.raises(ValueError, match="padded per batch"):
        split_guidance_batch(padded.padded_batch(2))
    with pytest.raises(ValueError, match="holdout"):
        split_guidance_batch(base.batch(8), holdout="random")


def test_split_guidance_batch():
    ds = tf.data.Dataset.from_tensor_slices(_data(64)).batch(16)
    guidance, rest = split_guidance_batch(ds)
    assert guidance[0].shape == (16, 4)
    assert len(list(rest)) == 3
    with pytest.raises(ValueError, match="empty"):
        split_guidance_batch(ds.take(0))


def test_learns_momentum_of_sgd_as_beta_1():
    trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=O.Adam(0.05))
    trainer.compile(O.SGD(0.05, momentum=0.5), loss="mse")
    assert trainer.guided.active == {"learning_rate": "learning_rate", "beta_1": "momentum"}
    # At step 1 the momentum buffer is 0, so d theta / d momentum = 0: h is 0 at first.
    hist = trainer.fit(*_data(64), batch_size=16, epochs=1, verbose=0)
    assert hist.history["beta_1"][0] != 0.5
    # Plain SGD: the default names drop beta_1.
    t2 = GuidedTrainer(_model(), _data(16, seed=5))
    t2.compile(O.SGD(0.05), loss="mse")
    assert list(t2.guided.active) == ["learning_rate"]
    assert "beta_1" not in t2.fit(*_data(32), batch_size=16, verbose=0).history


# --------------------------------------------------------------------------- bad input


def _fit_guided(optimizer, x, y, epochs=2):
    trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=O.Adam(0.05))
    trainer.compile(optimizer, loss="mse")
    hist = trainer.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return trainer, hist


@pytest.mark.parametrize(
    "keras_optimizer, ours",
    [
        ("adam", lambda: O.Adam(1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7)),
        (lambda: keras.optimizers.Adam(1e-3), lambda: O.Adam(1e-3)),
        (
            lambda: keras.optimizers.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.02, 3, 0.5), beta_1=0.8, epsilon=1e-6
            ),
            lambda: O.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.02, 3, 0.5), beta_1=0.8, epsilon=1e-6
            ),
        ),
        ("adamw", lambda: O.AdamW(1e-3, weight_decay=0.004)),
        (
            lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
            lambda: O.AdamW(0.01, weight_decay=0.1),
        ),
        ("sgd", lambda: O.SGD(0.01)),
        (
            lambda: keras.optimizers.SGD(0.05, momentum=0.5, nesterov=True),
            lambda: O.SGD(0.05, momentum=0.5, nesterov=True),
        ),
    ],
    ids=["adam_name", "adam", "adam_schedule", "adamw_name", "adamw", "sgd_name", "sgd_nesterov"],
)
def test_keras_optimizer_is_converted_and_trains_like_the_packages_own(
    keras_optimizer, ours, caplog
):
    """compile("adam") / compile(keras.optimizers.Adam(1e-3)) == compile(O.Adam(1e-3)),
    step for step: the same rule and hyperparameters (logged)."""
    x, y = _data()
    made = keras_optimizer if isinstance(keras_optimizer, str) else keras_optimizer()
    with caplog.at_level("WARNING"):
        converted, h1 = _fit_guided(made, x, y)
    assert "GuidedTrainer.compile: converted keras" in caplog.text
    assert isinstance(converted.optimizer, O.BaseOptimizer)
    reference, h2 = _fit_guided(ours(), x, y)
    assert type(converted.optimizer) is type(reference.optimizer)
    assert converted.optimizer.rule.defaults == reference.optimizer.rule.defaults
    for a, b in zip(_weights(converted.model), _weights(reference.model)):
        np.testing.assert_array_equal(a, b)
    assert converted.learned_values() == reference.learned_values()
    assert converted.learned_values()["learning_rate"] != 1.0  # the meta-step moved it
    np.testing.assert_array_equal(h1.history["loss"], h2.history["loss"])


def test_unconvertible_optimizer_is_a_clear_error():
    trainer = GuidedTrainer(_model(), _data(16))
    for optimizer, name in (
        (keras.optimizers.Adadelta(0.01), "Adadelta"),
        ("rmsprop", "RMSprop"),
        (keras.optimizers.Adam(0.01, amsgrad=True), "amsgrad"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"GuidedTrainer.compile: .*Keras's Adam, AdamW and "
            rf"SGD .* converted.*{name}.*Supported: Adafactor, "
            r"Adam, AdamW, AdamWeightDecay, Lamb, RecAdam, SGD",
        ):
            trainer.compile(optimizer, loss="mse")
    # converted, then refused for what the differentiated update cannot reproduce
    with pytest.raises(ValueError, match="`global_clipnorm`.*aggregated_clipnorm"):
        trainer.compile(keras.optimizers.Adam(0.01, global_clipnorm=1.0), loss="mse")


def test_unknown_hyperparameter_lists_the_optimizer_ones():
    trainer = GuidedTrainer(_model(), _data(16), hyperparameters=("learning_rate", "gamma"))
    with pytest.raises(ValueError, match=r"'gamma'.*\['learning_rate', 'beta_1', 'beta_2'\]"):
        trainer.compile(O.Adam(0.01), loss="mse")
    t2 = GuidedTrainer(_model(), _data(16), hyperparameters=("learning_rate", "beta_1"))
    with pytest.raises(ValueError, match="beta_1.*Adafactor learns beta_1 only"):
        t2.compile(O.Adafactor(0.01), loss="mse")


def test_bad_arguments():
    with pytest.raises(ValueError, match="empty dataset"):
        GuidedTrainer(_model(), tf.data.Dataset.from_tensor_slices(_data(16)).batch(4).take(0))
    with pytest.raises(ValueError, match="at least one example"):
        GuidedTrainer(_model(), (np.zeros((0, 4), "float32"), np.zeros((0, 1), "float32")))
    with pytest.raises(ValueError, match="guidance_data"):
        GuidedTrainer(_model(), None)
    with pytest.raises(ValueError, match="guidance_every"):
        GuidedTrainer(_model(), _data(16), guidance_every=0)
    with pytest.raises(ValueError, match="hyperparameters"):
        GuidedTrainer(_model(), _data(16), hyperparameters=())
    with pytest.raises(ValueError, match="meta_optimizer"):
        GuidedTrainer(_model(), _data(16), meta_optimizer=keras.optimizers.RMSprop())
    trainer = GuidedTrainer(_model(), _data(16))
    with pytest.raises(ValueError, match="aggregated_clipnorm"):
        trainer.compile(O.Adam(0.01, global_clipnorm=1.0), loss="mse")


def test_nonfinite_hypergradients_are_sanitised_and_counted():
    x, y = _data(32)
    gx, gy = _data(16, seed=5)
    gy[0, 0] = np.nan  # a NaN guidance target: NaN guidance loss and hypergradients
    trainer = GuidedTrainer(_model(), (gx, gy), meta_optimizer=O.Adam(0.05))
    trainer.compile(O.Adam(0.02), loss="mse")
    hist = trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert hist.history["nonfinite_hypergrads"][-1] == 4.0  # 2 steps x 2 hyperparameters
    assert hist.history["hypergrad_learning_rate"][-1] == 0.0
    assert trainer.learned_values()["learning_rate"] == 1.0  # NaN -> 0: Adam does not move
    assert all(np.isfinite(w).all() for w in _weights(trainer.model))


@pytest.mark.parametrize("key", ["adam", "lamb"])
def test_committed_and_recomputed_update_follow_one_trajectory(key):
    """Committing the forward-mode update or recomputing it in apply_gradients is one
    algorithm: same learned values, same weights."""
    x, y = _data()
    results = {}
    for name, kwargs in {"default": {}, "recompute": {"commit_forward_update": False}}.items():
        model = _model()
        trainer = GuidedTrainer(model, _data(16, seed=5), meta_optimizer=O.Adam(0.05), **kwargs)
        trainer.compile(OPTS[key](), loss="mse")
        trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results[name] = (_weights(model), trainer.learned_values())
    ref_w, ref_v = results["default"]
    assert ref_v["learning_rate"] != 1.0  # the meta-optimizer did move the values
    for name in ("recompute",):
        w, v = results[name]
        for a, b in zip(ref_w, w):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for n in ref_v:
            np.testing.assert_allclose(ref_v[n], v[n], rtol=1e-5)


def test_trainer_saves_and_reloads_with_its_options_and_learned_values(tmp_path):
    x, y = _data()
    trainer = GuidedTrainer(
        _model(), _data(16, seed=5), meta_optimizer=O.Adam(0.05), commit_forward_update=False
    )
    trainer.compile(O.Adam(0.02), loss="mse")
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    keras.saving.save_model(trainer, tmp_path / "guided.keras")  # the trainer itself
    loaded = keras.models.load_model(tmp_path / "guided.keras")
    assert isinstance(loaded, GuidedTrainer)
    assert not loaded.guided.commit_forward_update
    for n, v in trainer.learned_values().items():
        np.testing.assert_allclose(loaded.learned_values()[n], v, rtol=1e-12)
    np.testing.assert_allclose(
        loaded.model.predict(x, verbose=0), trainer.model.predict(x, verbose=0), rtol=1e-6
    )


def test_mixed_float16_trains_finite_and_skips_overflowing_steps():
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=O.Adam(0.05))
        trainer.compile(O.Adam(0.02), loss="mse")
        assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        hist = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)
    assert all(np.isfinite(w).all() for w in _weights(trainer.model))
    assert np.isfinite(hist.history["loss"]).all()
    values = trainer.learned_values()
    assert values["learning_rate"] != 1.0 and np.isfinite(list(values.values())).all()
    # A step whose scaled gradient overflowed (the loss scale starts at 2^15) is skipped
    # by the optimizer and takes no hypergradient step either.
    applied = int(trainer.optimizer.inner_optimizer.iterations.numpy())
    assert applied < 8 and int(trainer.guided.guided_steps.numpy()) == applied
    # Close to the float32 run (the hypergradient is unscaled like the gradient): within
    # one skipped meta-step of Adam(0.05) on the raw value.
    ref = _make_trainer_with(O.Adam(0.02))
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert (
        abs(np.log(values["learning_rate"]) - np.log(ref.learned_values()["learning_rate"])) < 0.1
    )
    assert np.sign(np.log(values["learning_rate"])) == np.sign(
        np.log(ref.learned_values()["learning_rate"])
    )


def _make_trainer_with(optimizer):
    trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=O.Adam(0.05))
    trainer.compile(optimizer, loss="mse")
    return trainer


def test_configs_saved_with_reuse_lookahead_still_load():
    trainer = GuidedTrainer(_model(), _data(16, seed=5), reuse_lookahead=False)
    assert trainer.guided.commit_forward_update is False
    config = trainer.get_config()
    config["reuse_lookahead"] = config.pop("commit_forward_update")
    assert GuidedTrainer.from_config(config).guided.commit_forward_update is False
    layer_config = trainer.guided.get_config()
    layer_config["reuse_lookahead"] = layer_config.pop("commit_forward_update")
    assert GuidedHyperparameters.from_config(layer_config).commit_forward_update is False


def test_nan_loss_stops_before_anything_is_committed():
    x, y = _data(32)
    y[2, 0] = np.nan
    trainer = _make_trainer()
    trainer.optimizer.build(trainer.model.trainable_variables)
    before = _weights(trainer.model)
    with pytest.raises(Exception, match="not finite"):
        trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(before, _weights(trainer.model)):
        np.testing.assert_array_equal(a, b)
    assert int(trainer.optimizer.iterations.numpy()) == 0
    assert int(trainer.guided.steps.numpy()) == 0


def test_keras_builtin_meta_optimizer_gives_the_results_of_the_packages_own():
    """A user passes keras.optimizers.Adam(...) as the meta-optimizer: it updates a few
    scalars with the same rule as tf_metaalign.optimizers.Adam."""
    x, y = _data()
    runs = {}
    for name, meta in {
        "keras": keras.optimizers.Adam(0.05),
        "ours": O.Adam(0.05),
        "keras_sgd": keras.optimizers.SGD(0.5, momentum=0.5),
        "ours_sgd": O.SGD(0.5, momentum=0.5),
    }.items():
        trainer = GuidedTrainer(_model(), _data(16, seed=5), meta_optimizer=meta)
        trainer.compile(O.Adam(0.02), loss="mse")
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        runs[name] = (trainer.learned_values(), _weights(trainer.model))
    for a, b in (("keras", "ours"), ("keras_sgd", "ours_sgd")):
        assert runs[a][0]["learning_rate"] != 1.0
        assert runs[a][0] == runs[b][0]
        for u, v in zip(runs[a][1], runs[b][1]):
            np.testing.assert_array_equal(u, v)
    assert runs["keras"][0] != runs["keras_sgd"][0]


# ------------------------------------------------------------- batches that do not divide


@pytest.mark.parametrize("replicas", [1, 2])
def test_last_batch_of_one_example_trains_like_plain_fit(replicas):
    """NumPy input of 33 examples, batch_size 32: the last batch holds 1 example (on 2
    replicas one of them gets none). The run goes on, and at meta learning rate 0 it is
    plain `fit` under the same strategy, uneven batch included."""
    strategy = two_cpu_strategy() if replicas == 2 else tf.distribute.OneDeviceStrategy("/cpu:0")
    x, y = _data(33)
    with strategy.scope():
        plain = _model()
        plain.compile(O.Adam(0.02), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    runs = {}
    for meta_lr in (0.0, 0.05):
        with strategy.scope():
            trainer = GuidedTrainer(
                _model(),
                _data(8, seed=5),
                meta_optimizer=O.Adam(meta_lr),
                commit_forward_update=False,
            )
            trainer.compile(O.Adam(0.02), loss="mse")
        hist = trainer.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert int(trainer.guided.steps.numpy()) == 4 == int(trainer.guided.guided_steps.numpy())
        assert np.isfinite(hist.history["loss"]).all()
        assert np.isfinite(hist.history["guidance_loss"]).all()
        runs[meta_lr] = trainer
    for a, b in zip(_weights(plain), _weights(runs[0.0].model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert runs[0.05].learned_values()["learning_rate"] != 1.0
    assert all(np.isfinite(w).all() for w in _weights(runs[0.05].model))


def test_guidance_batch_smaller_than_the_replica_count_equals_one_replica():
    """A guidance batch of 1 example on 2 replicas: one replica's shard is empty (weight 0);
    the hypergradients and learned values are the single-replica ones."""
    x, y = _data(32)
    results = {}
    for name, strategy in (
        ("one", tf.distribute.OneDeviceStrategy("/cpu:0")),
        ("two", two_cpu_strategy()),
    ):
        with strategy.scope():
            trainer = GuidedTrainer(_model(), _data(1, seed=5), meta_optimizer=O.Adam(0.05))
            trainer.compile(O.Adam(0.02), loss="mse")
        hist = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results[name] = (trainer.learned_values(), hist.history)
    (v1, h1), (v2, h2) = results["one"], results["two"]
    assert v1["learning_rate"] != 1.0
    for n in v1:
        np.testing.assert_allclose(v1[n], v2[n], rtol=1e-5)
    for k in ("guidance_loss", "hypergrad_learning_rate"):
        np.testing.assert_allclose(h1[k], h2[k], rtol=2e-4, err_msg=k)


def test_first_batch_not_divisible_by_the_replicas_trains_on_two_replicas():
    """A first batch of 11 examples on 2 replicas (shards of 6 and 5; Keras 3.15's own
    fit fails there building the model), and an identity-held-out shuffled dataset,
    whose batches have any size."""
    x, y = _data(64)
    odd = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda a, b: (a[:11], b[:11]))
    shuffled = tf.data.Dataset.from_tensor_slices(_labelled_data(64)).shuffle(64, seed=0).batch(16)
    guidance, rest = split_guidance_batch(shuffled)
    for data, guide in ((odd, _data(8, seed=5)), (rest, guidance)):
        with two_cpu_strategy().scope():
            trainer = GuidedTrainer(_model(), guide, meta_optimizer=O.Adam(0.05))
            trainer.compile(O.Adam(0.02), loss="mse")
        hist = trainer.fit(data, epochs=2, verbose=0)
        assert np.isfinite(hist.history["loss"]).all()
        assert int(trainer.guided.steps.numpy()) == 8
        assert trainer.learned_values()["learning_rate"] != 1.0
