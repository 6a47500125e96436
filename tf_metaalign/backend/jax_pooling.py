"""Max pooling in a JAX train step as element-wise selects (XLA CPU's gradient is slow).

Keras's JAX `max_pool` is `lax.reduce_window(max)`. Its gradient is XLA's
`select_and_scatter` and its forward-mode derivative `_select_and_gather_add` (which a
second-order method such as MAML differentiates again); XLA's CPU backend runs both as
scalar loops. Measured on the 2-core CPU of our CI (Conv-4's first block: 80 x 28 x 28 x 64,
pool 2): the gradient of the pool takes 37.8 ms on JAX against 1.8 ms for TensorFlow's
`MaxPoolGrad`; a second-order MAML inner step of Conv-4 went from 336 to 238 ms with the
form below.

For non-overlapping windows (strides == pool size; "valid" padding, or "same" where every
spatial size is a multiple of the pool, which is then the same thing) a max pool is a
tournament of `where(a >= b, a, b)` over the window's shifted slices, taken in the
window's row-major order. Its value is the max, and its derivatives (of every order) send
each window's cotangent to the FIRST maximal element in row-major order: the tie rule of
XLA's `select_and_scatter` (`ge`) and of TensorFlow's `MaxPoolGrad`, so gradients are
bit-identical to Keras's own pool even where a window holds equal values (binary images,
a ReLU's zeros). Only a NaN differs: it propagates through `lax.max` but not through the
comparisons.

`MAX_POOL` picks the form: "auto" (the selects on a CPU, Keras's own pool elsewhere: on a
GPU or TPU XLA's pooling kernels are fast), "select" or "xla". It applies to what a
trainer's step traces (`backend.jax.stateless_train_step`); `evaluate` and `predict` run
Keras's own pool (the forward value is the same).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

#: "auto" | "select" | "xla" (see the module docstring).
MAX_POOL = "auto"
_CHOICES = ("auto", "select", "xla")


def _spatial(value, rank, name):
    value = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(value) != rank:
        raise ValueError(f"`{name}` {value} does not have {rank} spatial entries.")
    return value


def select_max_pool(inputs, pool_size, strides=None, padding="valid", data_format=None):
    """Keras's `max_pool` (same signature) as selects, or None where the windows overlap
    or pad (the caller then uses Keras's own pool)."""
    import keras

    data_format = (data_format or keras.config.image_data_format()).lower()
    rank = inputs.ndim - 2
    pool = _spatial(pool_size, rank, "pool_size")
    strides = pool if strides is None else _spatial(strides, rank, "strides")
    first = 1 if data_format == "channels_last" else 2
    sizes = inputs.shape[first : first + rank]
    if strides != pool or any(not isinstance(n, int) for n in sizes):
        return None
    if padding.lower() == "same" and any(n % p for n, p in zip(sizes, pool)):
        return None  # "same" pads the last window: not a plain tournament
    candidates = [inputs]
    for axis, (n, p) in enumerate(zip(sizes, pool), start=first):
        m = n // p  # "valid" drops the remainder, as reduce_window does
        split = []
        for c in candidates:
            c = lax.slice_in_dim(c, 0, m * p, axis=axis)
            c = c.reshape(c.shape[:axis] + (m, p) + c.shape[axis + 1 :])
            split += [lax.index_in_dim(c, i, axis=axis + 1, keepdims=False) for i in range(p)]
        candidates = split
    # Row-major window order; pairing neighbours keeps "the first maximum wins" (>= keeps
    # the left one, and every left operand comes before its right one).
    while len(candidates) > 1:
        paired = [jnp.where(a >= b, a, b) for a, b in zip(candidates[0::2], candidates[1::2])]
        candidates = paired + candidates[len(paired) * 2 :]
    return candidates[0]


def _use_selects() -> bool:
    if MAX_POOL not in _CHOICES:
        raise ValueError(
            f"tf_metaalign.backend.jax_pooling.MAX_POOL is {MAX_POOL!r}; expected one of "
            f"{_CHOICES}."
        )
    if MAX_POOL == "auto":
        return jax.default_backend() == "cpu"
    return MAX_POOL == "select"


@contextlib.contextmanager
def max_pool_as_selects():
    """While tracing: Keras's JAX `max_pool` goes through `select_max_pool` where the
    windows do not overlap (per `MAX_POOL`)."""
    if not _use_selects():
        yield
        return
    from tf_metaalign import _compat

    keras_jax_nn = _compat.keras_jax_nn()
    keras_max_pool = keras_jax_nn.max_pool

    def max_pool(inputs, pool_size, strides=None, padding="valid", data_format=None):
        out = select_max_pool(inputs, pool_size, strides, padding, data_format)
        if out is None:
            return keras_max_pool(inputs, pool_size, strides, padding, data_format)
        return out

    keras_jax_nn.max_pool = max_pool
    try:
        yield
    finally:
        keras_jax_nn.max_pool = keras_max_pool
