"""`trainer.save` writes the user's model with the optimizer state of the MODEL's variables.

A trainer that trains variables of its own (MAML's learned inner learning rates here) shares
one optimizer with the model; its slots for the trainer's variables made a model loaded from
the file skip the whole optimizer state (Keras: "Skipping variable loading for optimizer"),
so the loaded model's own `fit` restarted Adam from step 0 with zero moments.
"""

import warnings

import keras
import numpy as np

from tf_metaalign.trainers import MAMLTrainer, SAMTrainer

BACKENDS = ("tensorflow", "jax")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]
    )


def _episodes(seed=0, tasks=2, rows=3):
    rng = np.random.default_rng(seed)
    x = lambda: rng.normal(size=(tasks, rows, 4)).astype("float32")  # noqa: E731
    y = lambda: rng.integers(0, 2, (tasks, rows)).astype("int32")  # noqa: E731
    return (x(), y(), x()), y()


def _expected_state(optimizer, variables):
    """What an optimizer built on `variables` alone holds, in its order (the step, the
    learning rate, then each variable's slots), read off the shared `optimizer` by the
    slot names Keras derives from each variable's path."""
    by_path = {v.path: np.asarray(v.value) for v in optimizer.variables}
    prefix = optimizer.name + "/"
    state = [by_path[prefix + "iteration"], by_path[prefix + "learning_rate"]]
    for variable in variables:
        stem = prefix + variable.path.replace("/", "_")
        state += [by_path[stem + "_momentum"], by_path[stem + "_velocity"]]
    return state


def _assert_state(loaded, expected):
    got = [np.asarray(v.value) for v in loaded.variables]
    assert len(got) == len(expected), (len(got), len(expected))
    for i, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(a, b, err_msg=f"optimizer variable {i}")


def test_saved_model_reloads_the_slots_of_its_own_variables(tmp_path):
    model = _model()
    trainer = MAMLTrainer(
        model,
        inner_steps=1,
        inner_learning_rate=0.1,
        first_order=True,
        learn_inner_learning_rates="per_parameter",
    )
    trainer.compile(
        keras.optimizers.Adam(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _episodes()
    trainer.fit(x, y, batch_size=2, epochs=3, verbose=0)
    # The premise: the trainer trains a variable the model does not have.
    assert len(trainer.trainable_variables) > len(model.trainable_variables)
    shared = trainer.optimizer
    assert model.optimizer is shared

    path = str(tmp_path / "model.keras")
    trainer.save(path)
    assert model.optimizer is shared, "save must give the model its optimizer back"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    assert not skipped, skipped

    assert int(loaded.optimizer.iterations) == int(shared.iterations) == 3
    expected = _expected_state(shared, model.trainable_variables)
    assert all(np.any(slot != 0) for slot in expected[2:]), "training moved every slot"
    _assert_state(loaded.optimizer, expected)


def test_a_trainer_without_variables_of_its_own_saves_the_shared_optimizer(tmp_path):
    model = _model()
    trainer = SAMTrainer(model, rho=0.05)
    trainer.compile(
        keras.optimizers.Adam(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.integers(0, 2, 8).astype("int32")
    trainer.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    trainer.save(path)
    loaded = keras.saving.load_model(path)
    assert [id(v) for v in trainer.trainable_variables] == [
        id(v) for v in model.trainable_variables
    ]
    _assert_state(loaded.optimizer, _expected_state(trainer.optimizer, model.trainable_variables))
