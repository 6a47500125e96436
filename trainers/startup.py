"""Start TensorFlow in the programs of `trainers/` without its C++ start-up chatter.

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
