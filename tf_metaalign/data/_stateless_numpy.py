"""TensorFlow's stateless random ops on the CPU, reproduced in NumPy (no TensorFlow).

The data helpers' batches are pure functions of `(seed, k)` drawn with
`tf.random.experimental.stateless_split`, `tf.random.stateless_uniform`,
`tf.random.stateless_categorical` and `tf.math.top_k` / `tf.argsort`. Their NumPy routes
(what feeds the JAX trainers without TensorFlow) draw the same numbers here, so both routes
give the same batches:

* Philox-4x32-10 (Salmon et al., SC'11) with TensorFlow's seed scrambling
  (`GenerateKey` in tensorflow/core/kernels/stateless_random_ops.cc: the seed pair is
  the counter of one Philox call under a fixed key; that call's output is the key and the
  high half of the counter);
* float32 uniforms from the low 23 bits of each 32-bit output (`Uint32ToFloat`), 64-bit
  integers from pairs of outputs (`UniformFullIntDistribution`);
* `stateless_categorical` as its CPU kernel (multinomial_op.cc): one double from the first
  two outputs (`SimplePhilox::RandDouble`), an upper bound in the unnormalised CDF of
  `exp(logits - max)` in float64;
* top-k / argsort order: by value, ties to the lower index (TensorFlow's documented order).

Checked against TensorFlow 2.21 on random seeds and shapes (tests/data/test_numpy_routes_tf.py).
`gumbel` is the one inexact piece: TensorFlow's float32 log runs Eigen's vectorised
approximation on groups of 8 values (AVX) and the C library's on the rest; here it is
the correctly rounded log, which equals TensorFlow's for vectors shorter than 8 and
differs in the last bit for about 1 value in 4 of longer ones (measured).
"""

from __future__ import annotations

import math

import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_MASK64 = (1 << 64) - 1


def _philox(key, counter, n: int) -> np.ndarray:
    """`n` consecutive Philox-4x32-10 outputs `[n, 4]` (uint32) from `key` (2 ints) and the
    128-bit `counter` (4 ints, low word first), the i-th at counter + i."""
    i = np.arange(n, dtype=np.uint64)
    words = []
    carry = i
    for w in range(4):
        total = np.uint64(counter[w]) + carry  # < 2^64: counter word < 2^32, carry < 2^63
        words.append(total & _M32)
        carry = total >> np.uint64(32)
    x0, x1, x2, x3 = words
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * x0
        p1 = np.uint64(0xCD9E8D57) * x2
        x0, x1, x2, x3 = (
            (p1 >> np.uint64(32)) ^ x1 ^ k0,
            p1 & _M32,
            (p0 >> np.uint64(32)) ^ x3 ^ k1,
            p0 & _M32,
        )
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return np.stack([x0, x1, x2, x3], axis=1).astype(np.uint32)


def _key_counter(seed):
    s0, s1 = (int(s) & _MASK64 for s in seed)
    mix = _philox(
        [0x3EC8F720, 0x02461E29], [s0 & 0xFFFFFFFF, s0 >> 32, s1 & 0xFFFFFFFF, s1 >> 32], 1
    )
    mix = [int(v) for v in mix[0]]
    return mix[:2], [0, 0, mix[2], mix[3]]


def _bits(seed, n: int) -> np.ndarray:
    key, counter = _key_counter(seed)
    return _philox(key, counter, (n + 3) // 4).reshape(-1)[:n]


def seed_pair(seed: int, salt: int, k: int):
    """`tf.stack([tf.constant(seed, tf.int64) * 2 + salt, k])` as Python ints (int64 wrap)."""
    return [_wrap64(int(seed) * 2 + int(salt)), _wrap64(int(k))]


def _wrap64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def split(seed, num: int) -> np.ndarray:
    """`tf.random.experimental.stateless_split(int64 seed, num)`: int64 `[num, 2]`."""
    bits = _bits(seed, 4 * num).astype(np.uint64).reshape(-1, 2)
    return (bits[:, 0] | (bits[:, 1] << np.uint64(32))).view(np.int64).reshape(num, 2)


def uniform(shape, seed) -> np.ndarray:
    """`tf.random.stateless_uniform(shape, seed)`: float32 in [0, 1)."""
    shape = tuple(int(s) for s in shape)
    bits = _bits(seed, math.prod(shape))
    values = ((bits & np.uint32(0x7FFFFF)) | np.uint32(127 << 23)).view(np.float32)
    return (values - np.float32(1.0)).reshape(shape)


def categorical(logits, seed) -> int:
    """`tf.random.stateless_categorical(logits[None], 1, seed)[0, 0]` for one row of
    float32 `logits`."""
    x0, x1 = (int(v) for v in _bits(seed, 2))
    mantissa = ((x0 & 0xFFFFF) << 32) | x1
    u = float(np.array([(1023 << 52) | mantissa], np.uint64).view(np.float64)[0]) - 1.0
    logits = np.asarray(logits, np.float32)
    finite = np.isfinite(logits)
    top = float(logits[finite].max()) if finite.any() else float(np.finfo(np.float32).min)
    cdf = np.cumsum(np.where(finite, np.exp(logits.astype(np.float64) - top), 0.0))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def top_k_indices(values, k: int) -> np.ndarray:
    """`tf.math.top_k(values, k).indices` along the last axis (int32): largest first,
    ties to the lower index."""
    order = np.argsort(-np.asarray(values), axis=-1, kind="stable")
    return order[..., :k].astype(np.int32)


def argsort(values) -> np.ndarray:
    """`tf.argsort(values, axis=-1)` (ascending, ties to the lower index), int32."""
    return np.argsort(np.asarray(values), axis=-1, kind="stable").astype(np.int32)


def gumbel(u) -> np.ndarray:
    """`-tf.math.log(-tf.math.log(u))` in float32, with the correctly rounded log (see the
    module doc)."""

    def log32(x):
        return np.log(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)

    return -log32(-log32(u))
