"""Which Keras backend the tests run on, and marks for backend-specific tests.

A test module that runs on both backends declares, at module level,
`BACKENDS = ("tensorflow", "jax")` (conftest.py collects only such modules in the JAX env)
and imports no tensorflow.
"""

import keras
import pytest

BACKEND = keras.backend.backend()


def on_jax() -> bool:
    return BACKEND == "jax"


def on_tensorflow() -> bool:
    return BACKEND == "tensorflow"


requires_tensorflow = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow backend only")
requires_jax = pytest.mark.skipif(BACKEND != "jax", reason="JAX backend only")


def jax_devices(n):
    """`n` JAX devices (the JAX conftest makes two host CPUs), or a skip."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return devices[:n]


class data_parallel:
    """`with data_parallel(n):` runs the block under `keras.distribution.DataParallel` over
    `n` JAX devices (the global distribution is restored after). Build the model inside."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.previous = keras.distribution.distribution()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax_devices(self.n))
        )
        return self

    def __exit__(self, *exc):
        keras.distribution.set_distribution(self.previous)
