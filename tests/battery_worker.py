"""Subprocess worker of the trainer battery: runs one named scenario for one named entry.

    python tests/battery_worker.py ENTRY SCENARIO --out RESULT.npz [options]

Scenarios:
  backup  fit(EPOCHS) with keras.callbacks.BackupAndRestore(--backup-dir,
          save_freq=--save-freq) and a Dropout layer. Unless the file --marker exists,
          the process writes it (with the backup's training_metadata.json) and kills
          itself with SIGKILL at the end of batch --kill-batch of epoch --kill-epoch
          (--kill-batch -1: never). Run the same command again to resume. On completion
          writes the snapshot (battery_lib.snapshot) plus meta/batches_trained.
  mwms    one worker of a tf.distribute.MultiWorkerMirroredStrategy cluster (TF_CONFIG
          set by the caller; one CPU device per worker). First records which rows of
          each global batch this worker's replica receives from Keras's fit
          (--rows, JSON), then trains the entry; the chief (task 0) alone writes the
          snapshot and the per-batch logs to --out.
          With --backup-dir: no row probe; fit with
          tf_metaalign.callbacks.MultiWorkerBackupAndRestore (Keras's own with
          --keras-backup) and a Dropout layer; worker --kill-task kills itself as in
          `backup` (one --marker for the cluster); every worker that finishes writes
          its snapshot plus meta/batches_trained and meta/task_id to --out.
  mwms-cluster
          starts --workers `mwms` workers on 127.0.0.1 (free ports, TF_CONFIG each;
          the backup options passed on) and waits for them (at most --timeout seconds).
          The first failure loses the job: the others get --grace seconds to exit by
          themselves, then are killed. --out is a directory: worker<i>.npz,
          rows<i>.json, worker<i>.log and cluster.json (each worker's return code,
          whether the launcher killed it, when it exited, its output tail). Imports no
          TensorFlow itself. TensorFlow's gRPC server listens on every interface
          (grpc_server_lib binds "0.0.0.0:<port>" whatever TF_CONFIG says), so the
          test runs this scenario in a network namespace that has only loopback.
  runs    --runs + 1 fresh trainings of the entry in this one process (build, compile,
          `fit` as the other checks do; then `del`, `gc.collect()`,
          `keras.backend.clear_session()`), after --runs + 1 plain `fit`s of the battery
          MLP in the same loop. After each: the resident set size (MB, after glibc's
          `malloc_trim`), the number of
          functions in TensorFlow's eager context and of `tf.custom_gradient` entries in
          its gradient registry. Writes them as JSON to --out.

The process uses the default single CPU device (no logical split, unlike conftest.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow imports keras's scikit-learn wrappers, which import scikit-learn (about a
# second per process); nothing here uses it, and Keras treats it as optional.
sys.modules.setdefault("sklearn", None)
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if "PYTHONPATH" not in os.environ:  # run by hand: test this checkout's tf_metaalign
    sys.path.insert(1, os.path.dirname(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("entry")
    p.add_argument("scenario", choices=("backup", "mwms", "mwms-cluster", "runs"))
    p.add_argument("--out", required=True)
    p.add_argument("--backup-dir")
    p.add_argument("--save-freq", type=int, default=2)
    p.add_argument("--kill-epoch", type=int, default=1)
    p.add_argument("--kill-batch", type=int, default=-1)
    p.add_argument("--marker", help="default: OUT.killed")
    p.add_argument("--dropout", type=float, default=0.25)
    p.add_argument("--rows")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--kill-task", type=int, default=1, help="mwms: the worker that kills itself")
    p.add_argument("--keras-backup", action="store_true", help="Keras's own BackupAndRestore")
    p.add_argument("--grace", type=float, default=30, help="cluster: wait after a failure")
    p.add_argument("--runs", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.scenario == "mwms-cluster":
        sys.exit(run_cluster(args))
    import faulthandler

    # The launcher asks a worker it is about to kill where it is (its log shows it).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import tensorflow as tf

    strategy = None
    if args.scenario == "mwms":
        # Must exist before any other TensorFlow op runs in this process.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        # Keras 3.15's fit fails under MWMS for any model (the probe below is a plain
        # Keras model): the package's workaround, which trainers apply themselves.
        from tf_metaalign import _compat

        _compat.patch_keras_multi_worker_fit()

    import keras
    import numpy as np

    import battery_lib as B
    from trainer_entries import BY_NAME

    entry = BY_NAME[args.entry]

    if args.scenario == "backup":
        run_backup(entry, args, keras, np, B)
    elif args.scenario == "runs":
        run_repeated(entry, args, tf, keras, B)
    elif args.backup_dir:
        run_mwms_backup(entry, args, strategy, keras, np, B)
    else:
        run_mwms(entry, args, strategy, tf, keras, np, B)


# ----------------------------------------------------------------------------- backup


def _killer(keras, args, marker):
    """A callback that writes `marker` (with the backup's training_metadata.json) and
    kills this process with SIGKILL at the end of batch --kill-batch of epoch
    --kill-epoch, unless `marker` exists (the resumed run)."""

    class Killer(keras.callbacks.Callback):
        epoch = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) != (args.kill_epoch, args.kill_batch):
                return
            if os.path.exists(marker):
                return  # the resumed run: do not kill again
            metadata = os.path.join(args.backup_dir, "training_metadata.json")
            with open(marker, "w") as f:
                f.write(open(metadata).read() if os.path.exists(metadata) else "no backup")
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    return Killer()


def _counter(keras):
    """A callback counting the batches this process trains (`.batches`)."""

    class Counter(keras.callbacks.Callback):
        batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

    return Counter()


def run_backup(entry, args, keras, np, B):
    from precision import global_float_precision

    if not args.backup_dir:
        sys.exit("backup: --backup-dir is required")
    marker = args.marker or args.out + ".killed"
    counter = _counter(keras)
    with global_float_precision(entry.dtype):
        x, y = B.data(entry)
        trainer = B.build(entry, dropout=args.dropout)
        callbacks = [
            keras.callbacks.BackupAndRestore(args.backup_dir, save_freq=args.save_freq),
            counter,
        ]
        if args.kill_batch >= 0:
            callbacks.append(_killer(keras, args, marker))
        B.fit(entry, trainer, x, y, callbacks=callbacks)
        result = B.snapshot(entry, trainer)
    result["meta/batches_trained"] = np.asarray(counter.batches)
    np.savez(args.out, **result)


# ------------------------------------------------------------------------------- runs


def _retained(tf):
    """What one process keeps: (resident MB, eager-context functions, custom gradients)."""
    import ctypes

    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    try:  # the C heap's free pages back to the system: RSS then counts live memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    custom = sum(name.startswith("CustomGradient-") for name in ops._gradient_registry.list())
    return (
        resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        len(context.context().list_function_names()),
        custom,
    )


def run_repeated(entry, args, tf, keras, B):
    import gc

    from precision import global_float_precision
    from trainer_entries import mlp, regression_data

    def plain():
        x, y = regression_data(B.N_ROWS)
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        model.fit(B.dataset(x, y, 8), epochs=B.EPOCHS, verbose=0, shuffle=False)

    def trainer():
        x, y = B.data(entry)
        B.fit(entry, B.build(entry), x, y)

    result = {"runs": args.runs}
    for name, train in (("plain", plain), ("trainer", trainer)):
        kept = []
        for _ in range(args.runs + 1):  # the first run warms up (imports, caches)
            with global_float_precision(entry.dtype):
                train()
            gc.collect()
            keras.backend.clear_session()
            gc.collect()
            kept.append(_retained(tf))
        result[name] = dict(zip(("rss_mb", "functions", "custom_gradients"), zip(*kept)))
    with open(args.out, "w") as f:
        json.dump(result, f)


# ------------------------------------------------------------------------------- mwms


def _free_ports(n):
    import socket

    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


#: Worker options the cluster launcher passes on to each `mwms` worker (the backup scenario).
_FORWARDED = (
    "backup_dir",
    "save_freq",
    "kill_epoch",
    "kill_batch",
    "kill_task",
    "marker",
    "dropout",
)


def _worker_command(args, index):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        args.entry,
        "mwms",
        "--out",
        os.path.join(args.out, f"worker{index}.npz"),
    ]
    if not args.backup_dir:
        return cmd + ["--rows", os.path.join(args.out, f"rows{index}.json")]
    for name in _FORWARDED:
        value = getattr(args, name)
        if value is not None:
            cmd += ["--" + name.replace("_", "-"), str(value)]
    return cmd + (["--keras-backup"] if args.keras_backup else [])


def run_cluster(args):
    """Start the workers; wait for all of them (at most --timeout s). When one fails (a
    non-zero exit, SIGKILL included), the job is lost, as a cluster manager sees it: the
    others get --grace seconds to exit by themselves (their collectives fail), then are
    killed. cluster.json records each worker's return code, whether
    the launcher killed it, and when each exited (seconds after the start)."""
    import subprocess
    import time

    os.makedirs(args.out, exist_ok=True)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(args.workers)]}
    procs = []
    start = time.monotonic()
    for index in range(args.workers):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        log = open(os.path.join(args.out, f"worker{index}.log"), "w+")
        cmd = _worker_command(args, index)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    exited = [None] * args.workers
    killed = [False] * args.workers

    def poll():
        for i, (p, _) in enumerate(procs):
            if exited[i] is None and p.poll() is not None:
                exited[i] = round(time.monotonic() - start, 2)
        return [p.returncode for p, _ in procs]

    deadline = start + args.timeout
    first_failure = None
    while time.monotonic() < deadline:
        codes = poll()
        if all(c is not None for c in codes):
            break
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = time.monotonic()
            deadline = min(deadline, first_failure + args.grace)
        time.sleep(0.1)
    poll()
    for i, (p, _) in enumerate(procs):  # timed out, or the job is lost: kill the rest
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)  # its Python stacks into its log (faulthandler)
            time.sleep(2)
            p.kill()
            p.wait()
            killed[i] = True
            exited[i] = round(time.monotonic() - start, 2)
    outputs = []
    for _, log in procs:
        log.seek(0)
        outputs.append(log.read()[-4000:])
        log.close()
    codes = [p.returncode for p, _ in procs]
    with open(os.path.join(args.out, "cluster.json"), "w") as f:
        json.dump(
            {
                "cluster": cluster,
                "returncodes": codes,
                "killed_by_launcher": killed,
                "exited_after_s": exited,
                "first_failure_after_s": None
                if first_failure is None
                else round(first_failure - start, 2),
                "outputs": outputs,
            },
            f,
        )
    return 0 if all(c == 0 for c in codes) else 1


def record_rows(strategy, tf, keras, np, global_batch, n_rows):
    """The row ids each global batch delivers to this worker's replica under fit."""
    seen = []

    class RowProbe(keras.Model):
        def call(self, x):
            return x

        def train_step(self, data):
            ids, _ = data

            def record(values):
                seen.append([int(v) for v in values.numpy()])
                return np.int32(0)

            done = tf.py_function(record, [ids[:, 0]], Tout=tf.int32)
            return {"recorded": tf.cast(done, tf.float32)}  # Keras needs a non-empty log

    with strategy.scope():
        probe = RowProbe()
        probe.built = True
        probe.compile(optimizer="sgd")
    ids = np.arange(n_rows, dtype=np.float32)[:, None]
    probe.fit(
        tf.data.Dataset.from_tensor_slices((ids, ids)).batch(global_batch),
        epochs=1,
        verbose=0,
    )
    return seen


def run_mwms(entry, args, strategy, tf, keras, np, B):
    from precision import global_float_precision

    task_id = strategy.cluster_resolver.task_id
    rows = record_rows(strategy, tf, keras, np, entry.batch_size, B.N_ROWS)
    with open(args.rows, "w") as f:
        json.dump({"task_id": task_id, "replicas": strategy.num_replicas_in_sync, "rows": rows}, f)
    with global_float_precision(entry.dtype):
        x, y = B.data(entry)
        trainer = B.build(entry, strategy=strategy)
        logs, _ = B.fit(entry, trainer, x, y)
        result = B.snapshot(entry, trainer)
    if task_id == 0:  # only the chief writes results
        names = ["loss", *entry.diagnostics]
        for name, values in B.logs_as_arrays(logs, names).items():
            result[f"logs/{name}"] = values
        np.savez(args.out, **result)


def run_mwms_backup(entry, args, strategy, keras, np, B):
    """One worker of the killed / resumed / uninterrupted multi-worker backup runs: fit
    with a backup callback (the package's `MultiWorkerBackupAndRestore`, or Keras's own
    with --keras-backup) and a Dropout layer; worker --kill-task kills itself as in the
    `backup` scenario. Every worker that finishes writes its snapshot to --out."""
    from precision import global_float_precision

    from tf_metaalign.callbacks import MultiWorkerBackupAndRestore

    task_id = strategy.cluster_resolver.task_id
    marker = args.marker or args.out + ".killed"
    backup = keras.callbacks.BackupAndRestore if args.keras_backup else MultiWorkerBackupAndRestore
    counter = _counter(keras)
    with global_float_precision(entry.dtype):
        x, y = B.data(entry)
        trainer = B.build(entry, strategy=strategy, dropout=args.dropout)
        callbacks = [backup(args.backup_dir, save_freq=args.save_freq), counter]
        if args.kill_batch >= 0 and task_id == args.kill_task:
            callbacks.append(_killer(keras, args, marker))
        B.fit(entry, trainer, x, y, callbacks=callbacks)
        result = B.snapshot(entry, trainer)
    result["meta/batches_trained"] = np.asarray(counter.batches)
    result["meta/task_id"] = np.asarray(task_id)
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()
