"""The seam between Keras 3's backends: autodiff, control flow with state, and reductions
across devices, one small interface with one implementation per backend.

Everything else in tf_metaalign is written once, in `keras.ops`; what differs between the
backends lives here, chosen once at import from `keras.backend.backend()`:

* `tf_metaalign.backend.tensorflow`: gradient tapes, the `tf.distribute` replica context
  (per-replica values, all-reduces), `tf.cond` under the multi-replica rule.
* `tf_metaalign.backend.jax`: `jax.value_and_grad` / `jax.jvp` on `model.stateless_call`,
  `jax.lax.cond` whose branches may assign variables (run inside the trainer's stateless
  step), and the pure `train_step(state, data)` that runs a trainer's step.

The interface (the same names in both modules, re-exported here):

  name                       "tensorflow" or "jax"
  value_and_grad(f, params, *args) -> (value, grads, aux)   f(params, *args) -> (value, aux)
  value_grad_and_hvp(f, params, *args, vector=...) -> (value, grads, aux, H v)
  jvp(f, primals, tangents) -> (outputs, output_tangents)
  executing_eagerly()        False while a step is traced (tf.function, jax.jit)
  cond(pred, true_fn, false_fn)          branches may assign variables
  num_replicas()             replicas whose per-replica values are combined (1 on JAX: the
                             step sees the global batch, see docs/tpu.md)
  all_reduce_sum(nest), all_gather_rows(nest), replica_share(nest), replica_id()
  scale_loss_for_distribution(x), unscale_loss_for_distribution(x)
  traced_once(fn)
  counter_dtype()            "int64" (TF; JAX with x64) or "int32" (JAX without x64)
  densify(tensors), add_n(tensors), read_value(variable)  (a snapshot tensor)
  static_schedule_flag(schedule, which)  is_first/is_last as a Python bool in a JAX step
                             compiled for one phase (host-scheduled), else None

`require_tensorflow(what)` imports TensorFlow for a TensorFlow-only feature, or raises an
ImportError that names the feature and what to use instead.
"""

from __future__ import annotations

import importlib

import keras

name = keras.backend.backend()

if name == "tensorflow":
    from tf_metaalign.backend import tensorflow as _impl
elif name == "jax":
    from tf_metaalign.backend import jax as _impl
else:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tf_metaalign runs on Keras 3's TensorFlow and JAX backends; KERAS_BACKEND is {name!r}. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before importing keras."
    )

value_and_grad = _impl.value_and_grad
value_grad_and_hvp = _impl.value_grad_and_hvp
jvp = _impl.jvp
executing_eagerly = _impl.executing_eagerly
cond = _impl.cond
num_replicas = _impl.num_replicas
all_reduce_sum = _impl.all_reduce_sum
all_gather_rows = _impl.all_gather_rows
replica_share = _impl.replica_share
replica_id = _impl.replica_id
scale_loss_for_distribution = _impl.scale_loss_for_distribution
unscale_loss_for_distribution = _impl.unscale_loss_for_distribution
traced_once = _impl.traced_once
counter_dtype = _impl.counter_dtype
densify = _impl.densify
add_n = _impl.add_n
read_value = _impl.read_value
static_schedule_flag = _impl.static_schedule_flag


def is_tensorflow() -> bool:
    """Whether Keras runs on TensorFlow in this process.

    Example:
      >>> import keras
      >>> from tf_metaalign import backend
      >>> backend.is_tensorflow() == (keras.backend.backend() == "tensorflow")
      True
    """
    return name == "tensorflow"


def is_jax() -> bool:
    """Whether Keras runs on JAX in this process.

    Example:
      >>> import keras
      >>> from tf_metaalign import backend
      >>> backend.is_jax() == (keras.backend.backend() == "jax")
      True
    """
    return name == "jax"


def require_tensorflow(what: str, instead: str = ""):
    """The `tensorflow` module, for a feature that needs it (`what`), or an ImportError
    that names the feature and, when given, what to use instead (`instead`).

    Example:
      >>> from tf_metaalign import backend
      >>> tf = backend.require_tensorflow("load_tfds", "NumPy arrays")  # doctest: +SKIP
      >>> # without TensorFlow: ImportError: load_tfds needs TensorFlow, which is not
      >>> # installed (Keras backend: 'jax'). Instead: NumPy arrays
    """
    import sys

    loaded = sys.modules.get("tensorflow")
    if loaded is not None:  # no import machinery inside traced (autograph) code
        return loaded
    try:
        return importlib.import_module("tensorflow")
    except ImportError as error:
        hint = f" Instead: {instead}" if instead else ""
        raise ImportError(
            f"{what} needs TensorFlow, which is not installed (Keras backend: {name!r}).{hint}"
        ) from error


def tensorflow_if_loaded():
    """The `tensorflow` module if something already imported it, else None (to recognise
    TensorFlow objects, e.g. a `tf.data.Dataset`, without importing TensorFlow)."""
    import sys

    return sys.modules.get("tensorflow")


def check_backend(feature: str, backends=("tensorflow", "jax")) -> None:
    """Raise a clear NotImplementedError when `feature` does not run on the current backend.

    Example:
      >>> import keras
      >>> from tf_metaalign import backend
      >>> backend.check_backend("SAMTrainer", ("tensorflow", "jax"))  # runs on both: no error
      >>> other = "jax" if keras.backend.backend() == "tensorflow" else "tensorflow"
      >>> try:
      ...     backend.check_backend("SomeTrainer", (other,))
      ... except NotImplementedError as error:
      ...     print("runs on" in str(error))
      True
    """
    if name not in backends:
        raise NotImplementedError(
            f"{feature} runs on Keras's {' and '.join(backends)} backend"
            f"{'s' if len(backends) > 1 else ''} only; this process uses {name!r}. "
            + (
                "It is being moved to JAX (issue 30). Until then run it with "
                "KERAS_BACKEND=tensorflow."
                if name == "jax"
                else ""
            )
        )


# The public part: which backend runs, and the errors for what one lacks. The interface above
# is the package's plumbing; code written against it uses `tf_metaalign.functional`.
__all__ = ["name", "is_tensorflow", "is_jax", "require_tensorflow", "check_backend"]
