"""Runnable docs for every public symbol, and the API reference built from them.

* Every class and function a user imports (each name in the `__all__` of the library's
  packages and of the top-level modules they export, e.g. `tf_metaalign.callbacks`) has a
  docstring of its own with an `Example:` section holding at least one `>>>` line, and
  that example runs and prints what it says (doctest, one test per symbol). A module in an
  `__all__` needs a docstring.
* `mkdocs build --strict` builds the API reference (mkdocs.yml, docs/api/*.md: one page
  per package, generated from these docstrings by mkdocstrings) without a warning: a
  docstring whose `Args:` name a parameter the signature lacks, or a page naming a symbol
  that no longer exists, fails it, and so does a link to a missing page or `#anchor`
  (mkdocs.yml's `validation`). `./run.sh docs` runs the same build.

On JAX (`.venv-jax`, no TensorFlow) the same tests run, the examples of the modules in
`BACKEND_NEUTRAL_EXAMPLES` included: those are written with NumPy and `keras.ops` (their
doctests get no `tf` on either backend, so a `tf.` in one fails in the TensorFlow env
too); the other examples use TensorFlow and run in the TensorFlow env only.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

BACKENDS = ("tensorflow", "jax")

ROOT = Path(__file__).resolve().parents[1]
#: the modules (and their submodules) whose examples run on both backends
BACKEND_NEUTRAL_EXAMPLES = ("tf_metaalign.optimizers",)
EXAMPLE_SECTION = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _exported(module, attr):
    """`module.attr`, or None where it needs TensorFlow and TensorFlow is not installed (on
    JAX: `tf_metaalign.forward_mode`; tests/test_backend_seam.py lists what may)."""
    try:
        return getattr(module, attr)
    except ImportError:
        if importlib.util.find_spec("tensorflow") is not None:
            raise
        return None


def _api_modules():
    """tf_metaalign and, through the `__all__` lists, every package it exports and every
    top-level module with an `__all__` of its own (callbacks, forward_mode, ...)."""
    found, todo = [], ["tf_metaalign"]
    while todo:
        name = todo.pop(0)
        module = importlib.import_module(name)
        found.append(module)
        for attr in module.__all__:
            value = _exported(module, attr)
            if not isinstance(value, types.ModuleType) or value.__name__ in todo:
                continue
            is_package = hasattr(value, "__path__")
            top_level = value.__name__.count(".") == 1
            if (is_package or top_level) and hasattr(value, "__all__"):
                if value not in found:
                    todo.append(value.__name__)
    return found


def _public_symbols():
    """(qualified name, object) for every exported class and function, each once."""
    symbols, seen = [], set()
    for module in _api_modules():
        for attr in module.__all__:
            value = _exported(module, attr)
            if isinstance(value, types.ModuleType) or not callable(value):
                continue
            if id(value) in seen:
                continue
            seen.add(id(value))
            symbols.append((f"{module.__name__}.{attr}", value))
    return symbols


def _exported_modules():
    modules = {}
    for module in _api_modules():
        for attr in module.__all__:
            value = _exported(module, attr)
            if isinstance(value, types.ModuleType):
                modules[value.__name__] = value
    return sorted(modules.items())


SYMBOLS = _public_symbols()

#: Exports whose docstrings still lack their Example (qualified names; empty: every export
#: has one). The list only shrinks: a symbol listed here that has an example fails
#: `test_the_pending_list_only_shrinks`.
PENDING: set[str] = set()


def test_the_collector_finds_every_package():
    names = {m.__name__ for m in _api_modules()}
    expected = {
        "tf_metaalign",
        "tf_metaalign.algorithms",
        "tf_metaalign.algorithms.multitask",
        "tf_metaalign.trainers",
        "tf_metaalign.optimizers",
        "tf_metaalign.prompts",
        "tf_metaalign.data",
        "tf_metaalign.callbacks",
        "tf_metaalign.forward_mode",
    }
    if importlib.util.find_spec("tensorflow") is None:
        expected.remove("tf_metaalign.forward_mode")  # TensorFlow code
    assert expected <= names, sorted(expected - names)
    assert len(SYMBOLS) > 100


def _own_docstring(obj):
    # A class's inherited docstring (inspect.getdoc's fallback) documents its parent.
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc) if doc else ""


@pytest.mark.parametrize(
    "name, module", _exported_modules(), ids=[n for n, _ in _exported_modules()]
)
def test_every_exported_module_has_a_docstring(name, module):
    assert (module.__doc__ or "").strip(), f"module {name} has no docstring"


def _backend_neutral(module_name):
    return any(
        module_name == prefix or module_name.startswith(prefix + ".")
        for prefix in BACKEND_NEUTRAL_EXAMPLES
    )


@pytest.fixture
def doctest_globs():
    """What every example may use without importing it: np, keras and the package (and, in
    the TensorFlow env, tf), with every random seed set, so that printed numbers are
    reproducible."""
    import keras
    import numpy as np

    import tf_metaalign

    keras.utils.set_random_seed(0)
    globs = {"np": np, "keras": keras, "tf_metaalign": tf_metaalign}
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        globs["tf"] = tf
    return globs


@pytest.mark.parametrize("name, obj", SYMBOLS, ids=[n for n, _ in SYMBOLS])
def test_every_public_symbol_has_a_runnable_example(name, obj, doctest_globs):
    if name in PENDING:
        pytest.skip("PENDING: no example yet")
    doc = _own_docstring(obj)
    assert doc, f"{name} has no docstring"
    assert EXAMPLE_SECTION.search(doc), f"{name}'s docstring has no 'Example:' section"
    examples = doctest.DocTestParser().get_examples(doc)
    assert examples, f"{name}'s docstring has no '>>>' example"

    neutral = _backend_neutral(obj.__module__)
    if "tf" not in doctest_globs and not neutral:
        pytest.skip("its example uses TensorFlow: it runs in the TensorFlow env")
    module = sys.modules[obj.__module__]
    globs = {**vars(module), **doctest_globs}
    if neutral:
        globs.pop("tf", None)
    test = doctest.DocTestParser().get_doctest(doc, globs, name, obj.__module__, 0)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report = []
    runner.run(test, out=report.append, clear_globs=True)
    assert runner.failures == 0, "".join(report)


def test_the_pending_list_only_shrinks():
    names = {name for name, _ in SYMBOLS}
    assert PENDING <= names, f"PENDING names symbols no longer exported: {PENDING - names}"
    done = sorted(
        name
        for name, obj in SYMBOLS
        if name in PENDING and EXAMPLE_SECTION.search(_own_docstring(obj))
    )
    assert not done, f"these have an Example now: remove them from PENDING: {done}"


def test_the_api_reference_builds_without_warnings(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).with_name("mkdocs"))
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'; the test extra has it)")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    # Broken links and anchors are warnings (so failures here), not mkdocs 1.6's default INFO.
    import yaml  # mkdocs's dependency

    validation = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["validation"]
    assert validation["anchors"] == validation["unrecognized_links"] == "warn", validation
    page = (tmp_path / "site" / "api" / "trainers" / "index.html").read_text()
    assert "DotProdTrainer" in page and "Example" in page
