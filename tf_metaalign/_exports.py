"""The packages' exports on either backend: each module is imported when the package is,
as before; a module that needs TensorFlow where it is not installed (a Keras-on-JAX
environment) leaves its names to a stand-in that raises a clear ImportError when used.

So `import tf_metaalign` works without TensorFlow, everything that runs on JAX is there,
and `tf_metaalign.trainers.MAMLTrainer` (say) names what it needs instead of failing
with "No module named 'tensorflow'" deep inside an import.
"""

from __future__ import annotations

import importlib


def _needs_tensorflow(error: ModuleNotFoundError) -> bool:
    return (error.name or "").split(".")[0] in ("tensorflow", "tensorflow_text", "tf_keras")


def export(namespace: dict, module: str, names=(), as_module: str | None = None) -> bool:
    """Import `module` and put `names` (and, with `as_module`, the module itself under that
    name) into `namespace` (a package's globals). Without TensorFlow, a module that needs it
    is recorded in `namespace["_UNAVAILABLE"]` instead; returns whether it imported."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if not _needs_tensorflow(error):
            raise
        unavailable = namespace.setdefault("_UNAVAILABLE", {})
        for name in (*names, *([as_module] if as_module else [])):
            unavailable[name] = module
        return False
    for name in names:
        namespace[name] = getattr(mod, name)
    if as_module:
        namespace[as_module] = mod
    return True


def missing_attribute(namespace: dict, package: str):
    """A module `__getattr__` for `package`: a name whose module needs TensorFlow raises an
    ImportError that says so and what to do."""

    def __getattr__(name):
        module = namespace.get("_UNAVAILABLE", {}).get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        raise ImportError(
            f"{package}.{name} needs TensorFlow ({module} imports it), which is not installed "
            "here. On Keras's JAX backend it is not available yet (issue 30 moves the MAML "
            "family, guided learning, the optimizers and soft prompts to JAX); run it with "
            "TensorFlow installed and KERAS_BACKEND=tensorflow."
        )

    return __getattr__
