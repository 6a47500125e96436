"""tf_metaalign.callbacks: MultiTaskDiagnostics against NumPy closed forms;
MultiWorkerBackupAndRestore in one process (its 2-worker job: the trainer battery's
multi_worker_backup check)."""

import itertools
import os

import keras
import numpy as np
import pytest

from tf_metaalign.callbacks import MultiTaskDiagnostics
from tf_metaalign.trainers import DotProdTrainer


def _tasks(seed=0, n=16):
    rng = np.random.default_rng(seed)
    out = {}
    for t, name in enumerate(["a", "b", "c"]):
        x = rng.normal(size=(n, 3)).astype("float32")
        w = rng.normal(size=(3, 2)) * (t + 1)
        out[name] = (x, (x @ w).astype("float32"))
    return out


def _linear(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])


def _numpy_grad(w, x, y):
    # d/dW mean((xW - y)^2) over all n*d entries
    return 2.0 * x.T @ (x @ w - y) / y.size


def test_cosine_and_distance_equal_closed_forms():
    tasks = _tasks()
    model = _linear()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callback = MultiTaskDiagnostics(tasks)
    callback.set_model(model)
    w0 = model.trainable_variables[0].numpy().astype(np.float64)
    callback.reset_initial_weights()
    w1 = w0 + 0.3
    model.trainable_variables[0].assign(w1)
    values = callback.measure()
    grads = [_numpy_grad(w1, x.astype(np.float64), y.astype(np.float64)) for x, y in tasks.values()]
    cos = [
        np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b)
        for a, b in itertools.combinations(grads, 2)
    ]
    np.testing.assert_allclose(values["task_gradient_cosine"], np.mean(cos), rtol=1e-5)
    np.testing.assert_allclose(values["distance_from_initial"], np.linalg.norm(w1 - w0), rtol=1e-5)


def test_in_history_with_a_trainer_and_with_multitask_dict_batches(tmp_path):
    tasks = _tasks()
    batches = {
        name: ({"inputs": x, "task_id": np.full(len(x), t, "int32")}, y)
        for t, (name, (x, y)) in enumerate(tasks.items())
    }
    trainer = DotProdTrainer(_linear(), weight=0.0)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = MultiTaskDiagnostics(batches, every_n_batches=2, log_dir=tmp_path)
    x = np.concatenate([v[0] for v in tasks.values()])
    y = np.concatenate([v[1] for v in tasks.values()])
    history = trainer.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback]
    )
    for key in ("task_gradient_cosine", "distance_from_initial"):
        assert len(history.history[key]) == 2 and np.isfinite(history.history[key]).all()
    # Distance grows from 0 as training moves the weights; 12 batches -> 6 periodic + 2 epoch ends.
    assert (
        0
        < history.history["distance_from_initial"][0]
        < history.history["distance_from_initial"][1]
    )
    assert len(callback.history) == 8
    assert list((tmp_path / "diagnostics").iterdir())


def test_bad_arguments():
    with pytest.raises(ValueError, match="`task_batches`.*at least two"):
        MultiTaskDiagnostics({"a": _tasks()["a"]})
    with pytest.raises(ValueError, match="every_n_batches"):
        MultiTaskDiagnostics(_tasks(), every_n_batches=0)
    with pytest.raises(ValueError, match=r"task_batches\['a'\]"):
        MultiTaskDiagnostics({"a": np.zeros(3), "b": _tasks()["b"]})


# ------------------------------------------------------------ MultiWorkerBackupAndRestore


class _Interrupt(keras.callbacks.Callback):
    """Raises at the end of batch `batch` of epoch `epoch` (after the backup callbacks
    listed before it have saved): a process that dies there."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def _backup_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    return x, (x @ rng.normal(size=(3, 2))).astype("float32")


def _backup_trainer(seed=0):
    trainer = DotProdTrainer(_linear(seed), weight=0.3, every=2)
    trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return trainer


def _fit(trainer, callbacks, epochs=2):
    x, y = _backup_data()
    trainer.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def _weights(trainer):
    """The trainer's variables (the model's, its own state) and the optimizer's."""
    return [np.asarray(v) for v in [*trainer.variables, *trainer.optimizer.variables]]


def _interrupted(callback, at=(1, 3)):
    """A trainer whose fit with `callback` died at `at` (epoch, batch)."""
    trainer = _backup_trainer()
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(trainer, [callback, _Interrupt(*at)])
    return trainer


def test_multi_worker_backup_on_one_worker_is_keras_backup_and_restore(tmp_path):
    """Outside a multi-worker strategy: the same backup files as Keras's callback, and a
    resume equal to an uninterrupted fit (DotProd's `every=2` counter shows a lost or
    repeated step)."""
    from tf_metaalign.callbacks import MultiWorkerBackupAndRestore

    for bad in ({"backup_dir": ""}, {"backup_dir": str(tmp_path), "save_freq": "batch"}):
        with pytest.raises(ValueError, match="backup_dir|save_freq"):
            MultiWorkerBackupAndRestore(**bad)
    ours, theirs = tmp_path / "ours", tmp_path / "keras"
    _interrupted(MultiWorkerBackupAndRestore(str(ours), save_freq=2))
    _interrupted(keras.callbacks.BackupAndRestore(str(theirs), save_freq=2))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    metadata = (ours / "training_metadata.json").read_text()
    assert (
        metadata == (theirs / "training_metadata.json").read_text() == ('{"epoch": 1, "batch": 2}')
    )

    resumed = _backup_trainer(seed=1)  # other initial weights: all must come from the backup
    _fit(resumed, [MultiWorkerBackupAndRestore(str(ours), save_freq=2)])
    uninterrupted = _backup_trainer()
    _fit(uninterrupted, [])
    assert not ours.exists()  # deleted at the end, as Keras's
    for a, b in zip(_weights(resumed), _weights(uninterrupted)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_non_chief_worker_restores_the_chief_backup_and_never_writes_it(tmp_path, monkeypatch):
    """A non-chief worker (`_is_chief()` False, as `should_checkpoint` is on a
    MultiWorkerMirroredStrategy's other workers) restores the chief's backup -- the
    previous one where the latest cannot be read (double_checkpoint) -- saves only into
    its private directory (under TMPDIR, removed after each save and at the end) and
    leaves `backup_dir` byte for byte as the chief wrote it. The 2-process job is the
    trainer battery's `multi_worker_backup` check."""
    import tempfile

    from tf_metaalign.callbacks import MultiWorkerBackupAndRestore

    backup = tmp_path / "backup"
    options = dict(save_freq=1, double_checkpoint=True)
    chief = _interrupted(MultiWorkerBackupAndRestore(str(backup), **options), at=(1, 1))
    at_kill = _weights(chief)  # the backup holds them (save_freq=1: saved at the kill)
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))

    def files():
        return {p.name: p.read_bytes() for p in backup.iterdir()}

    def non_chief_restores(expected_weights):
        written = files()
        worker = _backup_trainer(seed=1)
        assert len(_weights(worker)) < len(expected_weights)  # the optimizer: not built yet
        callback = MultiWorkerBackupAndRestore(str(backup), **options)
        monkeypatch.setattr(callback, "_is_chief", lambda: False)
        callback.set_model(worker)
        callback.on_train_begin()
        assert len(_weights(worker)) == len(expected_weights)
        for a, b in zip(_weights(worker), expected_weights):
            np.testing.assert_array_equal(a, b)
        assert worker._initial_epoch == 1
        for batch in range(3):  # saves (save_freq=1): into its private dir, then removed
            callback.on_train_batch_end(batch)
            assert [p.name for p in private.iterdir()] == [os.path.basename(callback._private_dir)]
            assert not os.listdir(callback._private_dir)
        callback.on_train_end()
        assert not list(private.iterdir())
        assert files() == written

    non_chief_restores(at_kill)
    # The latest backup unreadable (a chief killed while writing it): the previous one.
    previous = _backup_trainer(seed=2)
    previous.optimizer.build(previous.trainable_variables)  # its slots are in the backup
    copy = tmp_path / "previous.weights.h5"  # load_weights wants the .weights.h5 suffix
    copy.write_bytes((backup / "latest.weights.h5.bkp").read_bytes())
    previous.load_weights(str(copy))
    assert any(not np.array_equal(a, b) for a, b in zip(_weights(previous), at_kill))
    (backup / "latest.weights.h5").write_bytes(b"not an HDF5 file")
    non_chief_restores(_weights(previous))
