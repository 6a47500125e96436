"""The few array ops the optimizer rules (and the tensor step) are written in, per backend.

On TensorFlow they ARE TensorFlow's ops (`tf.cast`, `tf.sqrt`, ...): the rules keep their
numbers bit for bit, and `forward_mode.Dual` hyperparameters keep being dispatched through
them (guided learning's forward-mode update: a `keras.ops` function converts its input
to a tensor first, which a `Dual` refuses). On JAX they are `keras.ops`. A rule written
with these names runs on both backends (`SGDRule`, `AdamRule`).

float64 and int64 on JAX exist only under `jax_enable_x64`: `wide_float()` /
`counter_dtype()` name the widest dtype available ("float64"/"int64" on TensorFlow and on
JAX with x64; "float32"/"int32" on JAX without), so nothing silently asks JAX for a
dtype it would truncate with a warning.
"""

from __future__ import annotations

import keras
import numpy as np

BACKEND = keras.backend.backend()


def _jax_x64() -> bool:
    import jax

    return bool(jax.config.jax_enable_x64)


def wide_float() -> str:
    """ "float64", or "float32" on JAX without `jax_enable_x64`."""
    return "float32" if BACKEND == "jax" and not _jax_x64() else "float64"


def counter_dtype() -> str:
    """ "int64", or "int32" on JAX without `jax_enable_x64` (an optimizer step count)."""
    return "int32" if BACKEND == "jax" and not _jax_x64() else "int64"


def dtype_name(dtype) -> str:
    """A dtype (or a tensor's `.dtype`) as Keras's name: "float32", "float64", ..."""
    return keras.backend.standardize_dtype(dtype)


def dtype_of(x) -> str:
    return dtype_name(x.dtype)


if BACKEND == "tensorflow":
    import tensorflow as tf

    cast = tf.cast
    convert_to_tensor = tf.convert_to_tensor
    sqrt = tf.sqrt
    square = tf.square
    pow = tf.pow
    zeros = tf.zeros

    def constant(value, dtype):
        """A python number as a tensor of `dtype`, exact (no rounding through float32)."""
        return tf.constant(value, dtype)

    def clip_by_global_norm(tensors, clip_norm):
        return tf.clip_by_global_norm(tensors, clip_norm)[0]

    maximum = tf.maximum
    minimum = tf.minimum
    rsqrt = tf.math.rsqrt
    exp = tf.exp
    expand_dims = tf.expand_dims
    where = tf.where
    logical_and = tf.logical_and
    ones_like = tf.ones_like
    zeros_like = tf.zeros_like

    def mean(x, axis=None, keepdims=False):
        return tf.reduce_mean(x, axis=axis, keepdims=keepdims)

    def sum(x, axis=None, keepdims=False):  # noqa: A001  (the ops name)
        return tf.reduce_sum(x, axis=axis, keepdims=keepdims)

else:
    from keras import ops

    cast = ops.cast
    convert_to_tensor = ops.convert_to_tensor
    sqrt = ops.sqrt
    square = ops.square
    zeros = ops.zeros

    def constant(value, dtype):
        """A python number as a tensor of `dtype`, exact (NumPy converts in `dtype`)."""
        return ops.convert_to_tensor(np.asarray(value, dtype_name(dtype)))

    def clip_by_global_norm(tensors, clip_norm):
        """`tf.clip_by_global_norm`'s formula: t * clip_norm / max(norm, clip_norm)."""
        norm = ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(t)) for t in tensors])))
        norm = ops.cast(norm, dtype_of(tensors[0]))
        scale = clip_norm * ops.minimum(1.0 / norm, 1.0 / clip_norm)
        return [t * ops.cast(scale, dtype_of(t)) for t in tensors]

    def _like(value, other):
        """A python number as a tensor of `other`'s dtype (as TensorFlow converts a python
        operand; keras.ops would take floatx instead, widening a float32 tensor under
        floatx float64)."""
        if isinstance(value, (int, float)) and hasattr(other, "dtype"):
            return ops.convert_to_tensor(np.asarray(value, dtype_of(other)))
        return value

    def _pair(x, y):
        return _like(x, y), _like(y, x)

    def maximum(x, y):
        return ops.maximum(*_pair(x, y))

    def minimum(x, y):
        return ops.minimum(*_pair(x, y))

    def pow(x, y):  # noqa: A001  (TensorFlow's name)
        return ops.power(*_pair(x, y))

    def where(condition, x, y):
        return ops.where(condition, *_pair(x, y))

    rsqrt = ops.rsqrt
    exp = ops.exp
    expand_dims = ops.expand_dims
    logical_and = ops.logical_and
    ones_like = ops.ones_like
    zeros_like = ops.zeros_like
    mean = ops.mean
    sum = ops.sum  # noqa: A001  (the ops name)
