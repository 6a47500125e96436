"""Start the Keras backend in the programs of `trainers/`: `start(backend)` picks it
(`--backend`, else `KERAS_BACKEND`) before Keras is imported, then starts it.

On JAX, `start` imports JAX and lists its devices (JAX starts quietly). On TensorFlow it
starts TensorFlow without its C++ start-up chatter:

`import tensorflow` writes, straight to file descriptor 2 from its C++ libraries, log
lines that `TF_CPP_MIN_LOG_LEVEL` does not hide, because they are written while the
libraries load, before TensorFlow reads that variable: absl's "WARNING: All log messages
before absl::InitializeLog() is called are written to STDERR" (once per library that
bundles absl), and INFO lines (oneDNN is on, no CUDA driver). On a machine that has the
CUDA libraries but no GPU, the first device query adds "E... failed call to cuInit",
after which TensorFlow runs on the CPU as it should. None of these can be fixed from
Python: they come from how the wheel was built and from the machine. So `start_tensorflow`
captures descriptor 2 while TensorFlow loads and finds its devices, then writes back
everything except those lines, honouring `TF_CPP_MIN_LOG_LEVEL` (INFO lines are dropped
at level >= 1, WARNING lines at >= 2) and dropping the cuInit error only when no GPU is
found. Stdlib only: import this module before anything imports TensorFlow.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

_ABSL_BANNER = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)
# absl / TensorFlow C++ log line: severity letter, MMDD, time, thread, file:line]
_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./-]+:\d+\]")
_CUINIT = re.compile(r"failed call to cuInit")


def filter_startup_log(text: str, min_log_level: int, have_gpu: bool) -> str:
    """The lines of `text` worth showing (see the module docstring); others are kept as is."""
    kept = []
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\n")
        if stripped == _ABSL_BANNER:
            continue
        match = _LOG_LINE.match(stripped)
        if match:
            severity = match.group(1)
            if severity == "I" and min_log_level >= 1:
                continue
            if severity == "W" and min_log_level >= 2:
                continue
            if severity == "E" and not have_gpu and _CUINIT.search(stripped):
                continue
        kept.append(line)
    return "".join(kept)


#: The Keras backends a program runs on (`--backend`).
BACKENDS = ("tensorflow", "jax")


def choose_backend(requested: str | None = None) -> str:
    """The Keras backend of the program: `requested` (its `--backend` flag), else
    `KERAS_BACKEND`, else Keras's own choice (`~/.keras/keras.json`, default tensorflow).

    Sets `KERAS_BACKEND` when `requested` is given, so it must run before Keras is imported;
    if Keras is already imported with another backend, a ValueError names both (a
    program cannot switch backends once Keras has loaded).
    """
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"`--backend` must be one of {', '.join(BACKENDS)}; got {requested!r}.")
    if "keras" in sys.modules:
        import keras

        loaded = keras.backend.backend()
        if requested is not None and requested != loaded:
            raise ValueError(
                f"`--backend={requested}`: Keras is already imported with the {loaded} "
                f"backend in this process; set KERAS_BACKEND={requested} before Keras loads."
            )
        return loaded
    if requested is not None:
        os.environ["KERAS_BACKEND"] = requested
    import keras

    return keras.backend.backend()


def start(requested: str | None = None) -> tuple[str, list[str]]:
    """Pick the backend (`choose_backend`) and start it: `(backend, device types)`, e.g.
    `("jax", ["CPU"])`. On TensorFlow, `start_tensorflow` (quietly)."""
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"`--backend` must be one of {', '.join(BACKENDS)}; got {requested!r}.")
    if requested == "tensorflow" or (
        requested is None
        and "keras" not in sys.modules
        and os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow"
    ):
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        # TensorFlow first: its start-up lines are filtered before Keras imports it.
        if "keras" not in sys.modules:
            devices = start_tensorflow()
            return choose_backend(requested), devices
    backend = choose_backend(requested)
    if backend == "tensorflow":
        return backend, start_tensorflow()
    if backend == "jax":
        import logging

        # absl's handler shows INFO lines; JAX's "Unable to initialize backend 'tpu'" on a
        # machine without one is such a line (JAX then runs on what it found).
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
        import jax

        return backend, sorted({d.platform.upper() for d in jax.devices()})
    return backend, []


def on_tensorflow() -> bool:
    """Whether the program runs on Keras's TensorFlow backend (after `start`)."""
    import keras

    return keras.backend.backend() == "tensorflow"


def start_tensorflow() -> list[str]:
    """Import TensorFlow and find its devices quietly; returns the device types found.

    Does nothing noisy if TensorFlow is already imported (its start-up lines are then
    already out).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        level = 0
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        return sorted({d.device_type for d in tf.config.list_physical_devices()})
    sys.stderr.flush()
    saved = os.dup(2)
    devices: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as capture:
        try:
            os.dup2(capture.fileno(), 2)
            import tensorflow as tf

            devices = sorted({d.device_type for d in tf.config.list_physical_devices()})
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            sys.stderr.write(filter_startup_log(text, level, have_gpu="GPU" in devices))
            sys.stderr.flush()
    return devices
