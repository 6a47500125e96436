"""Fixtures of the backend-neutral prompt tests: float64 where a backend computes in less
(TensorFlow's GELU constants, JAX's attention softmax), so that TensorFlow == JAX at
float64 checks the prompts, not those."""

import keras
import numpy as np
import pytest


@pytest.fixture
def float64_attention_softmax():
    """On JAX, `jax.nn.dot_product_attention` (what Keras's `ops.dot_product_attention`
    runs, e.g. in `MultiHeadAttention`) with its softmax in the inputs' float64 (on
    TensorFlow: nothing). JAX's `_dot_product_attention_core` always casts the attention
    logits to float32 for the softmax ("always carried out in fp32"), so float64 attention
    on JAX is float32-accurate (~1e-7) for a reason that has nothing to do with the
    prompts; this keeps the float64 logits (the same computation otherwise)."""
    if keras.backend.backend() != "jax":
        yield
        return
    import importlib

    jnp = importlib.import_module("jax.numpy")
    functions = importlib.import_module("jax._src.nn.functions")
    original = functions._dot_product_attention_core

    def core(query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen, *args):
        if query.dtype != jnp.float64 or q_seqlen is not None or args[-1]:
            return original(
                query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen, *args
            )
        logits = jnp.einsum("BTNH,BSNH->BNTS", query, key) * jnp.array(scale, query.dtype)
        if bias is not None:
            logits = (logits + bias).astype(logits.dtype)
        logits = functions._apply_masks(logits, mask, is_causal, q_seqlen, kv_seqlen, args[0])
        probs = functions.softmax(logits, axis=-1).astype(key.dtype)
        return jnp.einsum("BNTS,BSNH->BTNH", probs, value)

    functions._dot_product_attention_core = core
    try:
        yield
    finally:
        functions._dot_product_attention_core = original


@pytest.fixture
def exact_gelu(float64_attention_softmax):
    """On TensorFlow, GELU computed with float64 constants for the test (on JAX: nothing).

    `tf.nn.gelu` (Keras's GELU on TensorFlow) casts its Python constants (sqrt(1/2);
    sqrt(2/pi), 0.044715) through float32, so at float64 it is off by up to 5e-9 (against
    scipy's erf; JAX's `jax.nn.gelu` is exact to 4e-16): BERT, GPT-2 and Gemma would then
    differ between the backends by ~1e-7 for a reason that has nothing to do with the
    prompts. The golden files hold TensorFlow's result with this exact GELU (JAX's formulas,
    in TensorFlow ops)."""
    if keras.backend.backend() != "tensorflow":
        yield
        return
    import importlib

    tf = importlib.import_module("tensorflow")  # TensorFlow env only
    nn = importlib.import_module("keras.src.backend.tensorflow.nn")
    original = nn.gelu

    def gelu(x, approximate=True):
        x = tf.convert_to_tensor(x)
        if x.dtype != tf.float64:
            return original(x, approximate)
        if approximate:
            c = tf.constant(np.sqrt(2 / np.pi), tf.float64)
            k = tf.constant(0.044715, tf.float64)
            return x * (0.5 * (1.0 + tf.tanh(c * (x + k * x**3))))
        return x * (tf.math.erfc(-x * tf.constant(np.sqrt(0.5), tf.float64)) / 2)

    nn.gelu = gelu
    try:
        yield
    finally:
        nn.gelu = original
