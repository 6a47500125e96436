"""What a checkpoint of `trainer.fit` holds (tf_metaalign.trainers.base, `MetaTrainer.save`).

* `keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True)`: the USER'S model
  at its best epoch, which `keras.saving.load_model` reloads in a fresh process that never
  imports tf_metaalign, as the model's own class, with that epoch's weights (a model
  compiled with the package's optimizer, as GuidedTrainer compiles it: `compile=False`).
* Sequential Reptile: the checkpoint is phi (what its validation measures), and the save
  leaves training as it was (a run checkpointing every batch == one that does not).
* `save_weights_only=True` / `BackupAndRestore`: the trainer's whole state (the battery's
  `model_checkpoint` and `backup_and_restore` checks, for every trainer).

About 15 s in all (one fresh process, ~8 s of it).
"""

import subprocess
import sys
import textwrap

import keras
import numpy as np

from tf_metaalign.trainers import DotProdTrainer, GuidedTrainer, SequentialReptileTrainer


def _mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    )


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype("float32")
    return x, y


class _EpochWeights(keras.callbacks.Callback):
    """The wrapped model's weights at every epoch's end."""

    def __init__(self, model):
        super().__init__()
        self._user_model = [model]  # a list: not tracked
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([np.array(w) for w in self._user_model[0].get_weights()])


def test_best_checkpoint_is_the_users_model_reloading_without_the_package(tmp_path):
    model = _mlp(seed=0)
    x, y = _data(64, seed=1)
    # Validation targets of the opposite sign: the better the fit, the worse val_loss, so
    # the best epoch is the first and the last epoch's weights are not the checkpoint.
    x_val, y_val = _data(32, seed=2)
    trainer = DotProdTrainer(model, weight=0.1)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    path = tmp_path / "best.keras"
    epochs = _EpochWeights(model)
    history = trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=4,
        shuffle=False,
        verbose=0,
        validation_data=(x_val, -y_val),
        callbacks=[keras.callbacks.ModelCheckpoint(path, save_best_only=True), epochs],
    )
    val_loss = history.history["val_loss"]
    best = int(np.argmin(val_loss))
    assert best != len(val_loss) - 1, val_loss  # else the test could not tell them apart
    assert not np.allclose(epochs.weights[best][0], epochs.weights[-1][0])

    # GuidedTrainer compiles the model with tf_metaalign's Adam: its checkpoint reloads
    # without the package with compile=False (as documented).
    guided_model = _mlp(seed=5)
    guided = GuidedTrainer(guided_model, guidance_data=(x_val, y_val))
    guided.compile(optimizer="adam", loss="mse")
    guided_path = tmp_path / "guided.keras"
    guided.fit(
        x,
        y,
        batch_size=16,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(guided_path)],
    )

    # A fresh process that imports Keras only.
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        import keras
        model = keras.saving.load_model({str(path)!r})
        guided = keras.saving.load_model({str(guided_path)!r}, compile=False)
        assert "tf_metaalign" not in sys.modules, "loading imported tf_metaalign"
        np.savez({str(tmp_path / "guided.npz")!r}, *guided.get_weights())
        np.savez({str(tmp_path / "loaded.npz")!r}, *model.get_weights())
        print(type(model).__module__, type(model).__name__)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,  # not the checkout: `tf_metaalign` is not importable from the cwd
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-2:] == [type(model).__module__, type(model).__name__]
    loaded = np.load(tmp_path / "loaded.npz")
    got = [loaded[f"arr_{i}"] for i in range(len(loaded.files))]
    assert len(got) == len(epochs.weights[best])
    for a, b in zip(got, epochs.weights[best]):
        np.testing.assert_array_equal(a, b)
    loaded = np.load(tmp_path / "guided.npz")
    got = [loaded[f"arr_{i}"] for i in range(len(loaded.files))]
    assert len(got) == len(guided_model.get_weights())
    for a, b in zip(got, guided_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_sequential_reptile_checkpoints_phi_and_training_goes_on_unchanged(tmp_path):
    x, y = _data(56, seed=3)  # 7 batches of 8: each epoch ends mid-trajectory (K = 3)
    finals = []
    for checkpoint in (False, True):
        trainer = SequentialReptileTrainer(_mlp(seed=4), inner_steps=3, outer_learning_rate=0.5)
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        saved_phi = []
        callbacks = []
        if checkpoint:
            callbacks = [
                keras.callbacks.ModelCheckpoint(tmp_path / "every_batch.keras", save_freq=1),
                keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda batch, logs, t=trainer: saved_phi.append(
                        ([s.numpy() for s in t.slow_weights], int(t.schedule.count.numpy()))
                    )
                ),
            ]
        trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        finals.append([v.numpy() for v in trainer.model.trainable_variables])
        if checkpoint:
            phi, count = saved_phi[-1]
            assert count % 3 != 0  # the last save came mid-trajectory (theta != phi)
            loaded = keras.saving.load_model(tmp_path / "every_batch.keras")
            for a, b in zip(loaded.trainable_variables, phi):
                np.testing.assert_array_equal(a.numpy(), b)
    for a, b in zip(*finals):
        np.testing.assert_array_equal(a, b)
