"""Max pooling as selects in JAX train steps (`tf_metaalign.backend.jax_pooling`).

* The select form == Keras's own JAX pool (`lax.reduce_window`): value, gradient and
  second derivative (a Hessian-vector product), bit for bit, on inputs full of ties
  (rounded values, a ReLU's zeros), 1-3 spatial dimensions, both data formats, "valid"
  with a remainder and "same" on multiples of the pool; overlapping windows and padded
  "same" fall back to Keras's pool.
* A MAML trainer over a ReLU + MaxPooling2D net on binary images (ties in every window):
  TensorFlow (golden) == JAX with the selects == JAX with XLA's pool, at float64.
"""

import keras
import numpy as np
import pytest
from backends import on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops

from tf_metaalign.algorithms import maml as M
from tf_metaalign.trainers import MAMLTrainer

BACKENDS = ("tensorflow", "jax")


def _pooling():
    if not on_jax():
        pytest.skip("the select form is JAX's")
    from tf_metaalign.backend import jax_pooling

    return jax_pooling


POOLS = [
    # (input shape, pool, strides, padding, data_format)
    ((2, 7, 3), 2, None, "valid", "channels_last"),  # 1-D, remainder dropped
    ((2, 6, 8, 3), (2, 2), None, "valid", "channels_last"),
    ((2, 6, 9, 3), (3, 3), (3, 3), "same", "channels_last"),
    ((2, 3, 5, 4), (2, 2), None, "valid", "channels_first"),  # remainder on both axes
    ((1, 4, 4, 6, 2), (2, 2, 3), None, "valid", "channels_last"),  # 3-D
]


def _tied(shape, seed):
    """Values rounded to one decimal with a quarter set to 0 (a ReLU's zeros)."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=shape), 1)
    x[rng.random(shape) < 0.25] = 0.0
    return x.astype("float32")


@pytest.mark.parametrize("case", range(len(POOLS)))
def test_select_form_equals_keras_pool_to_second_order(case):
    jax_pooling = _pooling()
    import jax
    import jax.numpy as jnp
    from keras.src.backend.jax import nn as keras_jax_nn

    shape, pool, strides, padding, data_format = POOLS[case]
    # Keras's layers always pass strides (its backend function mishandles None).
    strides = pool if strides is None else strides
    x = jnp.asarray(_tied(shape, case))

    def keras_pool(v):
        return keras_jax_nn.max_pool(v, pool, strides, padding, data_format)

    def select_pool(v):
        return jax_pooling.select_max_pool(v, pool, strides, padding, data_format)

    out = keras_pool(x)
    weights = jnp.asarray(np.random.default_rng(9).normal(size=out.shape).astype("float32"))
    tangent = jnp.asarray(_tied(shape, 100 + case))

    def derivatives(f):
        def loss(v):
            return jnp.sum(weights * jnp.tanh(f(v)))

        grad = jax.grad(loss)
        return f(x), grad(x), jax.jvp(grad, (x,), (tangent,))[1]

    for name, a, b in zip(
        ("value", "gradient", "hvp"), derivatives(keras_pool), derivatives(select_pool)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_overlapping_or_padded_windows_fall_back():
    jax_pooling = _pooling()
    x = np.zeros((1, 5, 5, 1), "float32")
    assert jax_pooling.select_max_pool(x, 3, 2) is None  # overlapping
    assert jax_pooling.select_max_pool(x, 2, 2, padding="same") is None  # pads the last window
    assert jax_pooling.select_max_pool(x, 5, 5, padding="same") is not None


@pytest.mark.parametrize("form", ["select", "xla"])
def test_keras_pooling_layers_go_through_the_swapped_function(form, monkeypatch):
    """Keras's MaxPooling2D traced inside `max_pool_as_selects` has no `reduce_window`
    with "select" (so the private hook in `_compat.keras_jax_nn` is still where Keras
    looks) and keeps it with "xla"; the function is restored after."""
    jax_pooling = _pooling()
    import jax

    from tf_metaalign import _compat

    monkeypatch.setattr(jax_pooling, "MAX_POOL", form)
    layer = keras.layers.MaxPooling2D(2)
    x = np.zeros((1, 4, 4, 1), "float32")
    keras_max_pool = _compat.keras_jax_nn().max_pool
    with jax_pooling.max_pool_as_selects():
        jaxpr = str(jax.make_jaxpr(lambda v: layer(v))(x))
    assert ("reduce_window" in jaxpr) == (form == "xla"), jaxpr
    assert _compat.keras_jax_nn().max_pool is keras_max_pool


def test_bad_setting_is_named(monkeypatch):
    jax_pooling = _pooling()
    monkeypatch.setattr(jax_pooling, "MAX_POOL", "fast")
    with pytest.raises(ValueError, match="MAX_POOL is 'fast'"):
        with jax_pooling.max_pool_as_selects():
            pass


def _binary_episodes(tasks, seed):
    """4x4 binary images (ties everywhere), 2 classes: ((sx, sy, qx), qy)."""
    rng = np.random.default_rng(seed)
    sx = (rng.random((tasks, 4, 6, 6, 1)) < 0.5).astype("float64")
    qx = (rng.random((tasks, 4, 6, 6, 1)) < 0.5).astype("float64")
    sy = np.tile(np.eye(2)[[0, 1, 0, 1]], (tasks, 1, 1))
    return (sx, sy, qx), sy.copy()


def _conv_maml():
    model = keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(3, 3, padding="same"),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    set_numpy_weights(model, seed=31)
    trainer = MAMLTrainer(model, inner_steps=2, inner_learning_rate=0.3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return trainer


@pytest.mark.parametrize("form", ["select", "xla"])
def test_maml_through_max_pool_equals_tensorflow(float64, form, monkeypatch):
    if on_jax():
        monkeypatch.setattr(_pooling(), "MAX_POOL", form)
        monkeypatch.setattr(M, "JAX_TASK_MAP", "loop")
    elif form == "xla":
        pytest.skip("one TensorFlow run makes the golden")
    x, y = _binary_episodes(4, seed=0)
    trainer = _conv_maml()
    history = trainer.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    arrays = {f"w{i}": ops.convert_to_numpy(w) for i, w in enumerate(trainer.model.weights)}
    arrays["loss"] = np.asarray(history.history["loss"])
    check_golden("maml_max_pool", arrays, rtol=1e-10, atol=1e-13)
