"""The packages' exports on either backend: each module is imported when the package is,
as before (static imports, which the API reference reads), each inside
`try: ... except ModuleNotFoundError as e: unavailable(globals(), e, module, names)`; a module
that needs TensorFlow where it is not installed (a Keras-on-JAX environment) leaves its
names to the package's `__getattr__` (`missing_attribute`), which raises a clear ImportError.

So `import tf_metaalign` works without TensorFlow, everything that runs on JAX is there,
and `tf_metaalign.trainers.MAMLTrainer` (say) names what it needs instead of failing
with "No module named 'tensorflow'" deep inside an import.
"""

from __future__ import annotations


def _needs_tensorflow(error: ModuleNotFoundError) -> bool:
    return (error.name or "").split(".")[0] in ("tensorflow", "tensorflow_text", "tf_keras")


def unavailable(namespace: dict, error: ModuleNotFoundError, module: str, names=()) -> None:
    """In a package's `except ModuleNotFoundError` around `from module import names`: re-raise
    unless TensorFlow is what is missing; else record `names` as needing TensorFlow (the
    package's `missing_attribute` then raises a clear ImportError for them)."""
    if not _needs_tensorflow(error):
        raise error
    unavailable_names = namespace.setdefault("_UNAVAILABLE", {})
    for name in names:
        unavailable_names[name] = module


def missing_attribute(namespace: dict, package: str):
    """A module `__getattr__` for `package`: a name whose module needs TensorFlow raises an
    ImportError that says so and what to do."""

    def __getattr__(name):
        module = namespace.get("_UNAVAILABLE", {}).get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        raise ImportError(
            f"{package}.{name} needs TensorFlow ({module} imports it), which is not installed "
            "here: it is TensorFlow code (on Keras's JAX backend, JAX's own transformations "
            "do its work: e.g. `jax.jvp` for forward mode); run it with TensorFlow installed "
            "and KERAS_BACKEND=tensorflow."
        )

    return __getattr__
