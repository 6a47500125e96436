"""Keras callbacks of the package.

`MultiTaskDiagnostics`: the quantities the Sequential Reptile paper reports during
multi-task training, measured periodically on fixed per-task batches:

* `task_gradient_cosine`: the average pairwise cosine similarity between the task
  gradients (Lee et al., Fig. 3 and Table 4: higher means better aligned tasks);
* `distance_from_initial`: the L2 distance of the trainable weights from their values when
  training began (less forgetting of the pretrained weights is a smaller distance).

Both go into the epoch logs (so `History` holds them) and, with `log_dir`, into TensorBoard
as scalars at the measured step.

`DivergenceGuard`: warns (or stops training) with the cause when the loss or a logged
gradient dot product explodes, not only on NaN. `DotProdTrainer` adds one itself
(`on_divergence=`).

`MultiWorkerBackupAndRestore`: Keras's `BackupAndRestore` made safe under
`tf.distribute.MultiWorkerMirroredStrategy` (the chief writes the backup, every worker
restores it); Keras's own unchanged everywhere else.

On JAX: all three run in `fit` as on TensorFlow (written in `keras.ops` and NumPy; no
TensorFlow needed). Keras's JAX `fit` keeps the variables' values out of the variables
during an epoch; a callback's `self.model` puts them back (Keras's `Callback.model` calls
`jax_state_sync()`), which is how these callbacks read the weights between batches.
`MultiTaskDiagnostics(log_dir=...)` writes TensorBoard summaries with `tf.summary`, so it
needs TensorFlow installed (without it: an ImportError at construction naming
`log_dir`); `MultiWorkerBackupAndRestore` is Keras's `BackupAndRestore` in a one-process
JAX job and refuses a multi-process one (see its docstring).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import tempfile
import warnings
from typing import Mapping

import keras
import numpy as np
from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F


class MultiTaskDiagnostics(keras.callbacks.Callback):
    """Measure the mean pairwise task-gradient cosine and the distance from the initial
    weights every `every_n_batches` training batches and at the end of every epoch.

    Args:
      task_batches: task name -> one fixed batch `(x, y)` or `(x, y, sample_weight)` of
        that task (at least two tasks). `x` may be the multi-task dict
        `{"inputs": ..., "task_id": ...}` of `tf_metaalign.data.multitask`; the model then
        receives `x["inputs"]`, or the whole dict with `model_takes_task_id=True`.
      every_n_batches: also measure every this many batches (None: at epoch ends only).
      log_dir: write the values to TensorBoard there (a `diagnostics` subfolder; with
        `tf.summary`, so TensorFlow must be installed, on either backend).
      model_takes_task_id: see `task_batches`.

    The gradients are those of the loss `fit` trains on (a tf_metaalign trainer's
    `loss_fn`, or the compiled loss of a plain Keras model) at the current weights, with
    `training=False` (no dropout), on each task's batch. The initial weights are taken at
    the start of the first `fit` (kept across later `fit` calls of the same callback);
    call `reset_initial_weights()` to measure from now. The gradients are computed by one
    compiled function (`tf.function` on TensorFlow, `jax.jit` on JAX) traced once.

    Example:
      >>> from tf_metaalign.callbacks import MultiTaskDiagnostics
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> x = np.ones((4, 3), "float32")
      >>> tasks = {"a": (x, np.zeros((4, 1), "float32")), "b": (x, 2 * np.ones((4, 1), "float32"))}
      >>> diagnostics = MultiTaskDiagnostics(tasks)
      >>> history = model.fit(x, np.ones((4, 1)), epochs=1, verbose=0, callbacks=[diagnostics])
      >>> sorted(k for k in history.history if k != "loss")
      ['distance_from_initial', 'task_gradient_cosine']
      >>> round(history.history["task_gradient_cosine"][0], 3)  # y=0 and y=2 pull apart
      -1.0

    References:
      Lee et al., "Sequential Reptile: Inter-Task Gradient Alignment for Multilingual
      Learning", ICLR 2022 (Fig. 3 and Table 4). https://arxiv.org/abs/2110.02600
    """

    def __init__(
        self,
        task_batches: Mapping,
        every_n_batches: int | None = None,
        log_dir=None,
        model_takes_task_id: bool = False,
    ):
        super().__init__()
        if not isinstance(task_batches, Mapping) or len(task_batches) < 2:
            raise ValueError(
                "`task_batches` must map at least two task names to a batch (x, y); got "
                f"{type(task_batches).__name__}"
                + (
                    f" with {len(task_batches)} task(s)"
                    if isinstance(task_batches, Mapping)
                    else ""
                )
                + "."
            )
        _check_every_n_batches(every_n_batches)
        if log_dir is not None:
            backend.require_tensorflow(
                "MultiTaskDiagnostics(log_dir=...) (TensorBoard summaries via tf.summary)",
                "log_dir=None: the values still go into the epoch logs (History, and a "
                "logger after this callback) and into `self.history`.",
            )
        self.task_names = list(task_batches)
        self._batches = [
            _model_batch(task_batches[n], model_takes_task_id, n) for n in self.task_names
        ]
        self.every_n_batches = every_n_batches
        self.log_dir = log_dir
        self._writer = None
        self._initial = None
        self._gradients = None
        self._seen = 0
        self.history = []  # (step, {name: value}) of every measurement

    # ----------------------------------------------------------------- measurement

    def _network(self):
        # A tf_metaalign trainer wraps the network whose weights are measured.
        return self.model.model if hasattr(self.model, "loss_fn") else self.model

    def _loss_fn(self):
        if hasattr(self.model, "loss_fn"):  # a tf_metaalign trainer: the loss it trains on
            return self.model.loss_fn(training=False)
        return F.make_loss_fn(self.model, training=False)

    def reset_initial_weights(self):
        self._initial = [ops.copy(v.value) for v in self._network().trainable_variables]

    def measure(self):
        """{"task_gradient_cosine": ..., "distance_from_initial": ...} at the current weights."""
        network = self._network()
        if self._initial is None:
            self.reset_initial_weights()
        if self._gradients is None:
            loss_fn = self._loss_fn()

            def gradients(params, state, batch):
                return F.value_and_grad(loss_fn, params, state, batch)[1]

            self._gradients = _compiled(gradients)
        params, state = F.current_params(network), F.current_state(network)
        grads = [self._gradients(params, state, b) for b in self._batches]
        cosines = [float(F.cosine(a, b)) for a, b in itertools.combinations(grads, 2)]
        distance = float(F.global_norm(F.sub(params, self._initial)))
        return {"task_gradient_cosine": float(np.mean(cosines)), "distance_from_initial": distance}

    def _record(self, values):
        step = self._seen
        self.history.append((step, values))
        if self.log_dir is not None:
            tf = backend.require_tensorflow("MultiTaskDiagnostics(log_dir=...)")
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(str(self.log_dir) + "/diagnostics")
            with self._writer.as_default():
                for name, value in values.items():
                    tf.summary.scalar(name, value, step=step)
            self._writer.flush()

    # ------------------------------------------------------------------ Keras hooks

    def on_train_begin(self, logs=None):
        if self._initial is None:
            self.reset_initial_weights()

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self.every_n_batches and self._seen % self.every_n_batches == 0:
            self._record(self.measure())

    def on_epoch_end(self, epoch, logs=None):
        values = self.measure()
        self._record(values)
        if logs is not None:  # History (and a TensorBoard callback after this one) see them
            logs.update(values)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class DivergenceGuard(keras.callbacks.Callback):
    """Warn, or stop training, when the loss or a gradient dot product runs away.

    Checked at every epoch end (and every `every_n_batches` batches, on the running
    epoch means Keras logs, when given), from the logs alone (nothing is recomputed; the
    first batch's loss of the fit is read once, as the starting reference):

    * the loss is not finite;
    * the loss is more than `loss_ratio` times the best loss so far (the first batch's
      and every check's), above the previous check's value (rising) and above the first
      batch's loss (worse than at the start: a loss falling towards 0 that rises from
      0.001 to 0.02 is noise, not divergence);
    * `|monitor|` (default "grad_dot", when logged) is more than `grad_dot_ratio` times
      its first epoch's value.

    A run that is already diverged by the first epoch end is caught by the loss rules
    (the first batch is the reference); the `monitor` rule starts at the second epoch.

    It fires once per `fit`: `action="warn"` emits a `RuntimeWarning` (and a log line)
    naming the cause and `advice`; `action="stop"` does the same and sets
    `model.stop_training`. `fired` holds the message (None while healthy).

    Args:
      action: "warn" or "stop".
      loss_ratio: > 1.
      grad_dot_ratio: > 1; None: do not watch `monitor`.
      monitor: the logged dot-product name.
      every_n_batches: also check every this many batches (None: epoch ends only).
      advice: appended to the message (what to do).

    Example:
      >>> import warnings
      >>> from tf_metaalign.callbacks import DivergenceGuard
      >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer=keras.optimizers.SGD(10.0), loss="mse")  # far too large
      >>> x = np.linspace(-3, 3, 32).astype("float32")[:, None]
      >>> guard = DivergenceGuard(action="stop", advice="lower the learning rate")
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")
      ...     history = model.fit(x, 5 * x, batch_size=8, epochs=20, verbose=0, callbacks=[guard])
      >>> len(history.history["loss"]) < 20, guard.fired  # doctest: +ELLIPSIS
      (True, 'Training is diverging (epoch 1): ...lower the learning rate')
    """

    ACTIONS = ("warn", "stop")

    def __init__(
        self,
        action="warn",
        loss_ratio=10.0,
        grad_dot_ratio=100.0,
        monitor="grad_dot",
        every_n_batches=None,
        advice="",
    ):
        super().__init__()
        if action not in self.ACTIONS:
            raise ValueError(f"`action` must be one of {self.ACTIONS}; got {action!r}.")
        for name, value, allow_none in (
            ("loss_ratio", loss_ratio, False),
            ("grad_dot_ratio", grad_dot_ratio, True),
        ):
            if value is None and allow_none:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 1
            ):
                raise ValueError(f"`{name}` must be a finite number > 1; got {value!r}.")
        _check_every_n_batches(every_n_batches)
        self.action = action
        self.loss_ratio = float(loss_ratio)
        self.grad_dot_ratio = None if grad_dot_ratio is None else float(grad_dot_ratio)
        self.monitor = monitor
        self.every_n_batches = every_n_batches
        self.advice = advice
        self.fired = None

    def on_train_begin(self, logs=None):
        self.fired = None
        self._best_loss = None
        self._last_loss = None
        self._first_dot = None
        self._first_loss = None
        self._epoch = 0

    def _check(self, logs, where, at_epoch_end):
        if self.fired is not None or not logs or "loss" not in logs:
            return
        loss = float(logs["loss"])
        cause = None
        if not math.isfinite(loss):
            cause = f"the loss is {loss}"
        elif (
            self._best_loss is not None
            and self._best_loss > 0
            and loss > self.loss_ratio * self._best_loss
            and self._last_loss is not None
            and loss > self._last_loss
            and (self._first_loss is None or loss > self._first_loss)
        ):
            cause = (
                f"the loss {loss:.4g} is {loss / self._best_loss:.3g}x its best value "
                f"{self._best_loss:.4g} and rising"
            )
        dot = logs.get(self.monitor) if self.grad_dot_ratio is not None else None
        if cause is None and dot is not None and self._first_dot:
            dot = float(dot)
            if not math.isfinite(dot) or abs(dot) > self.grad_dot_ratio * self._first_dot:
                cause = f"{self.monitor} grew from {self._first_dot:.4g} (first epoch) to {dot:.4g}"
        # A loss of exactly 0 is not a reference: a fit resumed by BackupAndRestore logs
        # the reset metrics (0) for the batches it skips.
        usable = math.isfinite(loss) and loss != 0.0
        if usable:
            self._best_loss = loss if self._best_loss is None else min(self._best_loss, loss)
        if at_epoch_end:
            if dot is not None and self._first_dot is None and math.isfinite(float(dot)):
                self._first_dot = abs(float(dot)) or None
        if usable:
            self._last_loss = loss
        if cause is None:
            return
        self.fired = f"Training is diverging ({where}): {cause}." + (
            f" {self.advice}" if self.advice else ""
        )
        logging.warning("%s", self.fired)
        warnings.warn(self.fired, RuntimeWarning, stacklevel=2)
        if self.action == "stop":
            self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        if self._first_loss is None and logs and "loss" in logs:
            first = float(logs["loss"])  # the loss at the start: the first reference
            if math.isfinite(first) and first != 0.0:
                self._first_loss = self._best_loss = self._last_loss = first
        if self.every_n_batches and (batch + 1) % self.every_n_batches == 0:
            self._check(logs, f"epoch {self._epoch + 1}, batch {batch + 1}", False)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._check(logs, f"epoch {epoch + 1}", True)


class MultiWorkerBackupAndRestore(keras.callbacks.Callback):
    """`keras.callbacks.BackupAndRestore` that also resumes a
    `tf.distribute.MultiWorkerMirroredStrategy` job after a worker is lost.

    Keras 3.15's `BackupAndRestore` knows nothing of workers (tf.keras 2's did): under
    MultiWorkerMirroredStrategy every worker writes the same `latest.weights.h5` and
    `training_metadata.json` in `backup_dir`, concurrently, and every worker deletes
    `backup_dir` when its training ends. Where `backup_dir` is shared (it must be, for
    the workers to resume from one state) two workers' writes race on one HDF5 file
    (measured with two workers on one host: `BlockingIOError: ... unable to lock file`
    at their first save; docs/trainers.md), and a worker that ends first can delete the
    directory under another's last save. This callback follows tf.keras 2's convention:

    * the chief (`strategy.extended.should_checkpoint`: worker 0, or the "chief" task)
      backs up into `backup_dir` exactly as Keras's callback does, and deletes it at
      the end of training (with `delete_checkpoint`);
    * every other worker makes the same saves (so a save that reads a variable through
      a collective still has every worker join it) into a temporary directory of its
      own, deleted after each save, and never writes `backup_dir`;
    * at the start of `fit`, every worker restores from `backup_dir` (a non-chief from
      a private copy of its files, so Keras's `double_checkpoint` fallback never writes
      the chief's directory): the job resumes from the chief's last backup.

    `backup_dir` must therefore be storage every worker reads (a shared file system,
    GCS). The backup is the chief's: state that differs between workers is restored with
    the chief's value on every worker. Trainers keep their state identical on every
    replica, except `PromptReptileTrainer(carry_inner_state=True)`, whose carried inner
    optimizer state is each worker's own under this strategy ("only_first_replica"
    variables are synchronised within a worker, not across workers): it does not resume
    exactly (tested, a strict xfail of the battery).

    Outside a multi-worker strategy this is Keras's `BackupAndRestore` with the same
    arguments. On JAX, so it is in a one-process job (one host, any number of its
    devices, `keras.distribution.DataParallel` included); a multi-process JAX job
    (`jax.distributed`, `jax.process_count() > 1`) raises NotImplementedError at the
    start of `fit`: its processes would race on one backup as tf.distribute's workers
    do, and the coordination here is tf.distribute's (run such a job on TensorFlow with
    `MultiWorkerMirroredStrategy`, or back up from one process yourself). With a
    trainer of this package, a restart resumes mid-epoch exactly, on either backend
    (the trainers skip the batches the interrupted epoch trained; see
    `tf_metaalign.trainers.MetaTrainer`; tested on both); a plain Keras model restarts
    the interrupted epoch from its first batch, as under Keras's own callback.

    When one worker dies, the others cannot go on (each step is a collective):
    TensorFlow's coordination service aborts their collectives once the lost worker's
    heartbeats stop (measured 4-21 s after a SIGKILL; on an overloaded host a survivor
    can wait longer), and the job must be stopped and restarted as a whole, every worker
    with the same command: the cluster manager's job, not this callback's.

    Args:
      backup_dir: the directory of the chief's backup (see above).
      save_freq: "epoch", or back up every `save_freq` batches.
      double_checkpoint: keep the previous backup too, restored if the latest cannot be
        read (a chief killed while writing).
      delete_checkpoint: the chief deletes `backup_dir` when training ends.

    Example:
      >>> import tempfile
      >>> from tf_metaalign.callbacks import MultiWorkerBackupAndRestore
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> backup = MultiWorkerBackupAndRestore(tempfile.mkdtemp(), save_freq=2)
      >>> x = np.ones((8, 2), "float32")
      >>> len(model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=[backup]).epoch)
      2
    """

    def __init__(
        self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True
    ):
        super().__init__()
        self.backup_dir = backup_dir
        self._options = dict(
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        # Keras's callback checks the arguments (an empty backup_dir, a bad save_freq).
        keras.callbacks.BackupAndRestore(backup_dir, **self._options)
        self._backup = None  # Keras's callback that writes this worker's backups
        self._private_dir = None  # a non-chief's directory (saves, restore copy)

    def on_train_begin(self, logs=None):
        if self._is_chief():
            self._private_dir = None
            self._backup = keras.callbacks.BackupAndRestore(self.backup_dir, **self._options)
        else:
            self._private_dir = tempfile.mkdtemp(prefix="backup_and_restore_worker_")
            self._restore_from_copy()
            self._backup = keras.callbacks.BackupAndRestore(
                os.path.join(self._private_dir, "saves"), **self._options
            )
        self._backup.set_model(self.model)
        self._backup.on_train_begin(logs)  # the chief restores here (a non-chief: nothing)

    def _is_chief(self):
        # False on a multi-worker strategy's non-chief workers only.
        if backend.is_jax():
            import jax

            if jax.process_count() > 1:
                raise NotImplementedError(
                    "MultiWorkerBackupAndRestore coordinates tf.distribute workers; this JAX "
                    f"job has {jax.process_count()} processes (jax.distributed), whose backups "
                    "would race on one `backup_dir`. Run a multi-worker job on TensorFlow "
                    "with MultiWorkerMirroredStrategy, or use it in a one-process JAX job "
                    "(any number of local devices)."
                )
            return True
        return self.model.distribute_strategy.extended.should_checkpoint

    def _restore_from_copy(self):
        copy = os.path.join(self._private_dir, "restore")
        if os.path.isdir(self.backup_dir):
            shutil.copytree(self.backup_dir, copy)
        restorer = keras.callbacks.BackupAndRestore(
            copy, **{**self._options, "delete_checkpoint": True}
        )
        restorer.set_model(self.model)
        restorer.on_train_begin()
        shutil.rmtree(copy, ignore_errors=True)

    def on_epoch_end(self, epoch, logs=None):
        self._backup.on_epoch_end(epoch, logs)
        self._drop_private_save()

    def on_train_batch_end(self, batch, logs=None):
        self._backup.on_train_batch_end(batch, logs)
        self._drop_private_save()

    def _drop_private_save(self):
        if self._private_dir is not None:
            shutil.rmtree(os.path.join(self._private_dir, "saves"), ignore_errors=True)

    def on_train_end(self, logs=None):
        self._backup.on_train_end(logs)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None


def _check_every_n_batches(every_n_batches):
    """None (no check within an epoch) or an integer >= 1, else a ValueError naming it."""
    if every_n_batches is not None and (
        isinstance(every_n_batches, bool)
        or not isinstance(every_n_batches, int)
        or every_n_batches < 1
    ):
        raise ValueError(
            f"`every_n_batches` must be None or an integer >= 1; got {every_n_batches!r}."
        )


def _model_batch(batch, model_takes_task_id, name):
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            f"`task_batches[{name!r}]` must be a batch (x, y) or (x, y, sample_weight); got "
            f"{type(batch).__name__}."
        )
    x, *rest = batch
    if isinstance(x, Mapping) and "task_id" in x:
        from tf_metaalign.data.multitask import model_inputs

        x = model_inputs(x, model_takes_task_id)
    return tuple(keras.tree.map_structure(ops.convert_to_tensor, (x, *rest)))


def _compiled(fn):
    """`fn` traced once: `tf.function` on TensorFlow, `jax.jit` on JAX."""
    if backend.is_jax():
        import jax

        return jax.jit(fn)
    tf = backend.require_tensorflow("MultiTaskDiagnostics on the TensorFlow backend")
    return tf.function(fn)


__all__ = ["DivergenceGuard", "MultiTaskDiagnostics", "MultiWorkerBackupAndRestore"]
