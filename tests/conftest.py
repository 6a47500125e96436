"""Test setup for both Keras backends.

TensorFlow env (KERAS_BACKEND=tensorflow, the default): two logical CPU devices so
MirroredStrategy tests run on any machine (the split must happen before TensorFlow
initialises its devices, so it lives here, imported by pytest before any test module).

JAX env (KERAS_BACKEND=jax, `.venv-jax`: no TensorFlow): two host CPU devices for
`keras.distribution` tests (XLA_FLAGS, set before jax loads), and only the BACKEND-NEUTRAL
test modules are collected: those that declare `BACKENDS = ("tensorflow", "jax")` at
module level (they must not import tensorflow). The others are TensorFlow's.
"""

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")

if BACKEND == "jax":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=2").strip()

import pytest  # noqa: E402

if BACKEND == "tensorflow":
    import tensorflow as tf  # noqa: E402

    _cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:  # devices already initialised (e.g. by another plugin)
        pass

_NEUTRAL = re.compile(r"""^BACKENDS = \(["']tensorflow["'], ["']jax["']\)""", re.M)


def pytest_ignore_collect(collection_path, config):
    """In the JAX env, collect only the backend-neutral test modules."""
    if BACKEND != "jax" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return not _NEUTRAL.search(collection_path.read_text())


# tests/ mirrors the library (tests/algorithms, tests/trainers, ...). The shared helpers
# (precision, trainer_entries, ...) sit in tests/ itself, and a few test modules import
# another folder's NumPy oracles by module name (test_multitask_outputs uses
# test_gradient_surgery's np_pcgrad): every test folder is importable whatever order pytest
# collects them in (the basenames are unique; tests/test_package_shape.py checks it).
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS)] + sorted(
    str(d) for d in _TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))
)

from precision import global_float_precision  # noqa: E402

_STRATEGY = []


def two_cpu_strategy():
    """A MirroredStrategy over two logical CPUs (the test stand-in for 2 GPUs; TensorFlow).

    One instance per process: a second MirroredStrategy over the same devices reuses
    collective instance keys, and its all-reduces then fail with "Shape mismatch in
    the collective instance".
    """
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _STRATEGY[0]


@pytest.fixture
def float64():
    """Exact equivalences are checked in float64 (`global_float_precision`; on JAX with
    64-bit types on for the test: `tf_metaalign.backend.jax.enable_x64`)."""
    if BACKEND == "jax":
        from tf_metaalign.backend.jax import enable_x64

        with enable_x64(), global_float_precision("float64"):
            yield
        return
    with global_float_precision("float64"):
        yield


@pytest.fixture(autouse=True)
def _global_float_precision_is_restored():
    """Every test must leave Keras's floatx and global dtype policy at float32: a test that
    leaks either silently changes the numbers of the tests that run after it in the same
    worker (and which tests those are depends on how xdist deals out the files)."""
    import keras

    yield
    floatx, policy = keras.backend.floatx(), keras.config.dtype_policy().name
    if (floatx, policy) != ("float32", "float32"):
        keras.config.set_dtype_policy("float32")  # so later tests run clean
        keras.backend.set_floatx("float32")
        pytest.fail(
            f"this test left Keras's floatx {floatx!r} and global dtype policy "
            f"{policy!r} (both must be 'float32' after a test: use the `float64` "
            "fixture or `global_float_precision`)",
            pytrace=False,
        )


class Recorder:
    """Wraps the `call` of layers (instance attribute) to record their inputs/outputs."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.records = monkeypatch, {}

    def watch(self, name, layer):
        original = layer.call

        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            self.records.setdefault(name, []).append((args, kwargs, out))
            return out

        self.monkeypatch.setattr(layer, "call", call)

    def last(self, name):
        return self.records[name][-1]
