"""Timing and memory helpers for the benchmarks (usable by any benchmark script).

* `warm_fit_timing(model_or_trainer, dataset, steps, warmup)`: run `fit` and return the
  per-step wall times after `warmup` steps (the first step traces and compiles).
* `PeakMemory`: peak memory during a block: TensorFlow's allocator peak on the device
  that runs the block (the first GPU, else "CPU:0"; TF 2.21 keeps allocator statistics
  for the CPU too): `get_memory_info(device)["peak"]` after `reset_memory_stats`, minus the
  memory allocated when the block starts: exact, per block, tensors only (no compiler or
  Python memory). Only if the allocator has no
  statistics: the process RSS sampled by a thread (psutil), peak minus start
  (approximate; dominated by tracing/compilation). On the JAX backend (no TensorFlow
  needed): always the RSS fallback.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time

import numpy as np

from trainers.common import StepTimer  # noqa: F401  (re-exported for benchmarks)


def warm_fit_timing(model, dataset, steps: int, warmup: int = 3, **fit_kwargs) -> dict:
    """Fit `steps + warmup` steps; per-step times of the last `steps` (compilation excluded).

    Returns `{"mean_s", "median_s", "min_s", "std_s", "steps", "first_step_s"}`.
    """
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1; got {steps}.")
    timer = StepTimer(warmup=warmup)
    model.fit(
        dataset,
        steps_per_epoch=steps + warmup,
        epochs=1,
        verbose=0,
        callbacks=[timer],
        **fit_kwargs,
    )
    t = timer.warm_times
    return {
        "mean_s": float(np.mean(t)),
        "median_s": float(np.median(t)),
        "min_s": float(np.min(t)),
        "std_s": float(np.std(t)),
        "steps": len(t),
        "first_step_s": timer.first(),
    }


def _tf():
    """TensorFlow when Keras runs on it, else None (a JAX environment may lack it)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return tf


def gpu_device() -> str | None:
    tf = _tf()
    if tf is None:
        import keras

        if keras.backend.backend() == "jax":
            import jax

            gpus = [d for d in jax.devices() if d.platform == "gpu"]
            return f"GPU:{gpus[0].id}" if gpus else None
        return None
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name.replace("/device:", "") if gpus else None


class PeakMemory:
    """`with PeakMemory() as m: ...` then `m.peak_bytes`, `m.kind` ("gpu_allocator_peak",
    "cpu_allocator_peak" or, as a fallback, "cpu_rss_delta")."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self._tf = tf = _tf()
        self.device = gpu_device() if tf is not None else None
        self.kind = "gpu_allocator_peak" if self.device else "cpu_rss_delta"
        if self.device is None and tf is not None:
            try:
                tf.config.experimental.get_memory_info("CPU:0")
                self.device, self.kind = "CPU:0", "cpu_allocator_peak"
            except (ValueError, tf.errors.OpError):
                pass
        self.peak_bytes = None
        self._stop = threading.Event()

    def _rss(self) -> int:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self):
        if self.device:
            self._tf.config.experimental.reset_memory_stats(self.device)
            self._start = int(self._tf.config.experimental.get_memory_info(self.device)["current"])
        else:
            self._start = self._peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device:
            # Peak minus what was allocated at the start: what this block added at its
            # worst (optimizer slots, activations, the algorithm's temporaries), not
            # what earlier blocks left alive.
            peak = int(self._tf.config.experimental.get_memory_info(self.device)["peak"])
            self.peak_bytes = peak - self._start
        else:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, self._rss())
            self.peak_bytes = int(self._peak - self._start)
        return False


def environment() -> dict:
    """What the numbers were measured on."""
    import keras

    tf = _tf()
    backend = keras.backend.backend()
    return {
        "backend": backend,
        "tensorflow": tf.__version__ if tf is not None else None,
        "jax": __import__("jax").__version__ if backend == "jax" else None,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu_device(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")


median = statistics.median


def relu_mlp(input_dim: int, width: int, depth: int, num_classes: int, seed: int = 0):
    """Input(input_dim) -> depth x Dense(width, relu) -> Dense(num_classes): the
    benchmarks' weight-bound model (seeded)."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((input_dim,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="mlp")


def interleaved_rounds(
    configs, run, rounds: int, steps_per_round: int, seed: int = 0, on_step_times=None
):
    """Time every configuration in `rounds` rounds; each round runs every configuration for
    `steps_per_round` steps in a shuffled order, so load from other processes on a shared
    machine falls on all of them alike.

    `run(config, steps, timer)` runs `steps` steps with the Keras callback `timer` (a
    `StepTimer`); `on_step_times(config, times)` sees each run's step times. Prints a line
    per round (the median so far of each configuration). Returns
    `(times, round_medians)`: configuration -> every timed step, and -> each round's median.
    """
    import random

    configs = list(configs)
    times = {c: [] for c in configs}
    round_medians = {c: [] for c in configs}
    rng = random.Random(seed)
    for r in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for config in order:
            timer = StepTimer(warmup=0)
            run(config, steps_per_round, timer)
            times[config].extend(timer.times)
            round_medians[config].append(float(np.median(timer.times)))
            if on_step_times is not None:
                on_step_times(config, timer.times)
        print(
            f"round {r}: "
            + ", ".join(f"{c} {1000 * np.median(times[c]):.1f}" for c in configs)
            + " ms",
            flush=True,
        )
    return times, round_medians
