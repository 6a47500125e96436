"""Keras's global float precision for tests (a module of its own: conftest.py, the
trainer battery and its subprocess workers, which do not import conftest, all use it)."""

import contextlib

import keras


@contextlib.contextmanager
def global_float_precision(dtype):
    """Keras's floatx AND its global dtype policy set to `dtype`, both restored after.

    Keras's compiled loss computes in floatx, and layers built without a dtype follow the
    GLOBAL dtype policy, which Keras fixes the first time it is read (from the floatx of that
    moment) or when it is set. Setting floatx alone is not enough and worse than useless: a
    float64 block that happened to be the first to read the policy left it at float64 for
    every later test in that pytest-xdist worker. (That was the flake of
    test_dotprod_real_data.py's seed 2: its model was initialised in float64, other random
    draws, and DotProd's G1.G2 came out 0.2973 against the baseline's 0.3002.)"""
    old_floatx, old_policy = keras.backend.floatx(), keras.config.dtype_policy()
    keras.backend.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(old_policy)
        keras.backend.set_floatx(old_floatx)
