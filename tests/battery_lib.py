"""Machinery of the trainer battery, shared by test_trainer_battery.py and battery_worker.py.

Builds a trainer from a `TrainerEntry`, trains it on the entry's deterministic data, and
takes a *snapshot*: every number that defines the training state, as numpy arrays keyed
by kind (model weights, model state such as Dropout's seed, optimizer variables, the
trainer's algorithm state), so two runs can be compared key by key.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

#: rows of the training data: 5 global batches of 8 per epoch (an odd count, so
#: steps_per_execution=3 ends each epoch on a partial execution and DotProd's every=2
#: phase shifts between epochs).
N_ROWS = 40
EPOCHS = 2


def data(entry, dtype=None, n=N_ROWS):
    return entry.make_data(n, dtype=dtype or entry.dtype, seed=0)


def take_rows(x, rows):
    """`x[rows]` for an array or a nest of arrays (dict batches: multi-task data)."""
    return tf.nest.map_structure(lambda a: a[rows], x)


def num_rows(x):
    """The number of rows of an array or of a nest of arrays."""
    return len(tf.nest.flatten(x)[0])


def dataset(x, y, batch_size):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def build(entry, strategy=None, dtype="entry", dropout=0.0, **compile_overrides):
    """A compiled trainer; `dtype=None` builds the model in the global policy."""
    model_dtype = entry.dtype if dtype == "entry" else dtype
    data_dtype = model_dtype or keras.backend.floatx()
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = entry.make_model(dtype=model_dtype, dropout=dropout, seed=0)
        trainer = entry.make_trainer(model, data_dtype)
        trainer.compile(**entry.compile_kwargs(), **compile_overrides)
    return trainer


class BatchLogs(keras.callbacks.Callback):
    """Records the logs of every training batch (floats)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def fit(entry, trainer, x, y, epochs=EPOCHS, callbacks=(), **fit_kwargs):
    """Unshuffled fit on batches of `entry.batch_size`.

    Returns `(batch_logs, history)`: the logs of every `on_train_batch_end` call and
    `History.history` (per-epoch logs).
    """
    recorder = BatchLogs()
    history = trainer.fit(
        dataset(x, y, entry.batch_size),
        epochs=epochs,
        verbose=0,
        shuffle=False,  # ignored for a dataset (already unshuffled); silences a warning
        callbacks=[recorder, *callbacks],
        **fit_kwargs,
    )
    return recorder.logs, history.history


def trainer_state(trainer):
    """The trainer's own variables -- neither the model's nor the optimizer's -- keyed by
    name (`name#k` for the k-th repeat of a name, in the trainer's variable order).

    This is the algorithm's state (counters, learned values, meta-optimizer slots) plus
    whatever the MetaTrainer base class keeps, found without being named, so a variable
    the base class or a trainer adds is compared by every check automatically.
    """
    known = {id(v) for v in trainer.model.variables}
    known |= {id(v) for v in trainer.optimizer.variables}
    out = {}
    for v in trainer.variables:
        if id(v) in known:
            continue
        key, k = v.name, 1
        while key in out:
            key, k = f"{v.name}#{k}", k + 1
        out[key] = v
    return out


def base_class_state_names():
    """Names of the variables that MetaTrainer itself gives every trainer."""
    from tf_metaalign.trainers import MetaTrainer

    # With a Dropout layer: the base class checkpoints the model's seed states too.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), keras.layers.Dropout(0.1)])
    bare = MetaTrainer(model)
    bare.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return {key.split("#")[0] for key in trainer_state(bare)}


def check_entry_state(entry, trainer):
    """`entry.state_variables` all exist, and every own variable of the trainer is either
    listed there or one of the base class's: an entry names all its algorithm's state.

    Returns the problems found (empty when the entry is right)."""
    names = [key.split("#")[0] for key in trainer_state(trainer)]
    problems = [f"listed but missing: {n!r}" for n in entry.state_variables if n not in names]
    base = base_class_state_names()
    problems += [
        f"not listed in state_variables: {n!r}"
        for n in names
        if n not in entry.state_variables and n not in base
    ]
    return problems


def snapshot(entry, trainer):
    """Every number of the training state, keyed `kind/index` or `state/name`.

    Optimizer variables are keyed by index only: their names embed layer names, which
    differ between two models built in one process.
    """
    out = {}
    for i, v in enumerate(trainer.model.trainable_variables):
        out[f"weights/{i}"] = np.asarray(v.numpy())
    for i, v in enumerate(trainer.model.non_trainable_variables):
        out[f"model_state/{i}"] = np.asarray(v.numpy())  # Dropout seed, BatchNorm stats
    for i, v in enumerate(trainer.optimizer.variables):
        out[f"optimizer/{i}"] = np.asarray(v.numpy())
    out["optimizer/iterations"] = np.asarray(trainer.optimizer.iterations.numpy())
    for name, v in trainer_state(trainer).items():
        out[f"state/{name}"] = np.asarray(v.numpy())
    missing = [n for n in entry.state_variables if f"state/{n}" not in out]
    assert not missing, f"{entry.name}: no trainer variable named {missing}; has {sorted(out)}"
    return out


def tolerance(entry, check):
    return entry.tolerances.get(check, entry.tolerance)


def assert_same(a, b, rtol, atol, what="", keys=None):
    """Every key of two snapshots agrees (integers exactly); one message listing all
    the keys that differ, with their largest absolute difference."""
    if keys is None:
        assert sorted(a) == sorted(b), f"{what}: different keys {sorted(set(a) ^ set(b))}"
        keys = sorted(a)
    bad = []
    for k in keys:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            bad.append(f"{k}: shape {x.shape} vs {y.shape}")
        elif x.dtype.kind in "iub":
            if not np.array_equal(x, y):
                bad.append(f"{k}: {x.ravel()[:4]} vs {y.ravel()[:4]}")
        elif not np.allclose(x, y, rtol=rtol, atol=atol):
            diff = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            bad.append(f"{k}: max |diff| {diff:.3g}")
    assert not bad, f"{what} differ (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(bad)


def max_relative_difference(a, b, keys=None):
    """Largest |a-b| / (|b| + 1e-12) over float keys (for reporting / tuning tolerances)."""
    worst = 0.0
    for k in keys or sorted(a):
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if x.size:
            worst = max(worst, float(np.max(np.abs(x - y) / (np.abs(y) + 1e-12))))
    return worst


def assert_trained(entry, before, after):
    """The weights, the optimizer and the algorithm state all moved: a comparison of
    two runs is not vacuous (e.g. a zero learning rate would make any two runs equal)."""
    for kind in ("weights/", "optimizer/", "state/"):
        keys = [k for k in before if k.startswith(kind)]
        if kind == "state/" and not keys:
            continue
        moved = [k for k in keys if not np.array_equal(before[k], after[k])]
        assert moved, f"{entry.name}: no {kind[:-1]} variable changed in training"


def logs_as_arrays(logs, names):
    """Per-batch logs -> {name: array over batches} for the given names."""
    return {n: np.asarray([step[n] for step in logs]) for n in names}
