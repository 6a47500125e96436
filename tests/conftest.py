"""Test setup: two logical CPU devices so MirroredStrategy tests run on any machine.

The logical-device split must happen before TensorFlow initialises its devices, so it
lives here, imported by pytest before any test module.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialised (e.g. by another plugin)
    pass


_STRATEGY = []


def two_cpu_strategy():
    """A MirroredStrategy over two logical CPUs (the test stand-in for 2 GPUs).

    One instance per process: a second MirroredStrategy over the same devices reuses
    collective instance keys, and its all-reduces then fail with "Shape mismatch in
    the collective instance".
    """
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _STRATEGY[0]


@pytest.fixture
def float64():
    """Exact equivalences are checked in float64. Keras's compiled loss computes in floatx,
    and layers built without a dtype follow the GLOBAL dtype policy, which Keras fixes the
    first time it is read (from the floatx of that moment) or when a test sets it: so both
    are set, and both restored (tests that set only floatx passed alone and failed after
    other tests, at float32 precision)."""
    import keras

    keras.backend.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.set_floatx("float32")


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
