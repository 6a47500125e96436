"""Helpers shared by the absl programs in `trainers/`: progress, timing, tables, JSON, TensorBoard.

Nothing here knows an algorithm: a program builds its runs (its settings and flags come
from `trainers.settings`), then uses `Progress` /
`ProgressCallback` (timestamped progress lines while it loads, trains and evaluates),
`StepTimer` (time per step, compilation excluded), `format_table` (a readable result
table), `write_json` (results.json) and `tensorboard_callback` / `write_summary`
(TensorBoard logs).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import keras
import numpy as np


class Progress:
    """Prints progress lines, `[  12.3 s] message`, timed from its creation (flushed)."""

    def __init__(self, stream=None):
        self.start = time.perf_counter()
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", file=self.stream or sys.stdout, flush=True)


class ProgressCallback(keras.callbacks.Callback):
    """A progress line after the first training step and every `every` steps after it.

    Each line: the run's name, step/total, the batch logs' values of `metrics` (Keras's
    running mean since the start of the current epoch), the mean time per step since the
    previous line and the time since training began. The first step's line notes that it
    includes tracing and compilation. Counts calls of `on_train_batch_end` (one per step
    with `steps_per_execution=1`), across epochs.
    """

    def __init__(
        self, log, name: str, total_steps: int, every: int, metrics: Sequence[str] = ("loss",)
    ):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be an integer >= 1; got {every!r}.")
        self.log = log
        self.name = name
        self.total_steps = total_steps
        self.every = every
        self.metrics = tuple(metrics)
        self.step = 0
        self._start = self._last = None
        self._last_step = 0

    def on_train_begin(self, logs=None):
        self.step, self._last_step = 0, 0
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step != 1 and self.step % self.every and self.step != self.total_steps:
            return
        now = time.perf_counter()
        logs = logs or {}
        values = "  ".join(f"{k} {float(logs[k]):.4f}" for k in self.metrics if k in logs)
        width = len(str(self.total_steps))
        if self.step == 1:
            timing = f"first step {now - self._start:.1f} s (incl. tracing and compilation)"
        else:
            per_step = 1000 * (now - self._last) / max(self.step - self._last_step, 1)
            timing = f"{per_step:.0f} ms/step  {now - self._start:.1f} s"
        self.log(f"{self.name}: step {self.step:>{width}}/{self.total_steps}  {values}  {timing}")
        self._last, self._last_step = now, self.step


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training batch; `warmup` first batches (tracing/compilation)
    are left out of the summary.

    With `steps_per_execution=k` each "batch" Keras reports is k steps; divide by k.
    """

    def __init__(self, warmup: int = 2):
        super().__init__()
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"`warmup` must be an integer >= 0; got {warmup!r}.")
        self.warmup = warmup
        self.times: list[float] = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is not None:
            self.times.append(time.perf_counter() - self._start)
            self._start = None

    @property
    def warm_times(self) -> list[float]:
        return self.times[self.warmup :]

    def mean(self) -> float:
        """Mean warm step time in seconds (NaN if there is no warm step)."""
        t = self.warm_times
        return float(np.mean(t)) if t else float("nan")

    def median(self) -> float:
        t = self.warm_times
        return float(np.median(t)) if t else float("nan")

    def first(self) -> float:
        """The first batch's time: tracing + compilation + one step."""
        return self.times[0] if self.times else float("nan")


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A fixed-width text table.

    Args:
      rows: one mapping per row.
      columns: `(key, header, format_spec)` triples, e.g. `("accuracy", "test acc", ".3f")`;
        a missing key prints "-".
    """
    if not columns:
        raise ValueError("`columns` is empty: nothing to print.")
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([_fmt(row.get(key), fmt) for key, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_jsonable(obj):
    """numpy scalars/arrays, Paths, tuples and NaN -> plain JSON values (NaN -> null)."""
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else obj
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path, obj) -> Path:
    """Write `obj` (made JSON-safe with `to_jsonable`) to `path`, creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_jsonable(obj), f, indent=2, sort_keys=False)
        f.write("\n")
    return path


def prepare_output_dir(output_dir, arg_name: str = "output_dir") -> Path:
    """Create `output_dir` (raise a clear error naming the flag if it cannot be)."""
    if not output_dir:
        raise ValueError(f"`--{arg_name}` is empty; give a folder for the results.")
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"`--{arg_name}`={str(path)!r} exists and is not a folder.")
    path.mkdir(parents=True, exist_ok=True)
    return path


def figure(**kwargs):
    """A matplotlib `Figure` drawn by the Agg canvas (`figure(figsize=...)`, then
    `fig.subplots(...)`, `fig.savefig(path)`): no pyplot, so a notebook's or a GUI's
    backend is left as it is (`matplotlib.use` would switch it for the whole process)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def writes_tensorboard() -> bool:
    """Whether the programs write TensorBoard logs: on Keras's TensorFlow backend (Keras's
    TensorBoard callback and `write_summary` write through `tf.summary`); on JAX they
    write none (results.json holds the same numbers)."""
    return keras.backend.backend() == "tensorflow"


def tensorboard_callback(log_dir, update_freq="epoch") -> keras.callbacks.TensorBoard:
    """Keras's TensorBoard callback writing scalars only (no graph, no profiling)."""
    return keras.callbacks.TensorBoard(
        log_dir=str(log_dir),
        update_freq=update_freq,
        write_graph=False,
        write_images=False,
        profile_batch=0,
    )


def tensorboard_callbacks(log_dir, update_freq="epoch") -> list:
    """`[tensorboard_callback(log_dir)]` where `writes_tensorboard()`, else `[]`."""
    return [tensorboard_callback(log_dir, update_freq)] if writes_tensorboard() else []


def write_summary(log_dir, scalars: Mapping[str, float], step: int = 0) -> None:
    """Write `scalars` as TensorBoard scalars at `step` (e.g. final test metrics); nothing
    where not `writes_tensorboard()`."""
    if not writes_tensorboard():
        return
    import tensorflow as tf

    writer = tf.summary.create_file_writer(str(log_dir))
    with writer.as_default():
        for name, value in scalars.items():
            if value is not None and np.isfinite(value):
                tf.summary.scalar(name, float(value), step=step)
    writer.flush()
    writer.close()


def flag_values(flags_module, names: Iterable[str]) -> dict:
    """The values of the named absl flags, as a dict (for results.json)."""
    return {name: getattr(flags_module.FLAGS, name) for name in names}


def unavailable(needs: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, str]:
    """The runs that cannot run on this backend, each with the reason: `needs` maps a run
    (a method's name) to the `(module, name)` pairs it uses (e.g. `{"recadam":
    [("tf_metaalign.optimizers", "RecAdam")]}`); a name the package exports as a stand-in
    (a TensorFlow-only piece on JAX, `tf_metaalign._exports`) raises ImportError when used,
    and its message (what is missing, what to run instead) is the reason."""
    import importlib

    missing = {}
    for run, pieces in needs.items():
        for module, name in pieces:
            try:
                piece = getattr(importlib.import_module(module), name)
            except ImportError as e:
                if getattr(e, "name", None) == "tensorflow":  # the module imports it
                    missing[run] = (
                        f"{module}.{name} needs TensorFlow ({module} imports it), which is "
                        "not installed here."
                    )
                else:
                    missing[run] = str(e)
                break
            backends = getattr(piece, "backends", None)  # a trainer's (MetaTrainer.backends)
            if backends is not None and keras.backend.backend() not in backends:
                missing[run] = (
                    f"{module}.{name} runs on {', '.join(backends)} only, not on "
                    f"{keras.backend.backend()} (yet)."
                )
                break
    return missing


def require_on_backend(program: str, needs: Sequence[tuple[str, str]], backend: str) -> None:
    """Stop `program` with a clear message (SystemExit, status 1) when a piece it needs
    (`(module, name)` pairs, as `unavailable` takes them) is not on `backend` yet."""
    missing = unavailable({program: needs})
    if missing:
        raise SystemExit(
            f"{program}: cannot run on the {backend} backend yet: {missing[program]} "
            "(--backend=tensorflow runs it)."
        )


def compiled(fn, variables=None, **tf_function_kwargs):
    """`fn` compiled where that is safe: `tf.function(fn, **tf_function_kwargs)` on
    TensorFlow (it reads the variables when called). On JAX with `variables` (every variable
    `fn` reads): `jax.jit` of `fn` run in a `keras.StatelessScope` that maps them to values
    passed in at every call (what `stateless_call` does for a model's `call`), so the
    compiled function reads their CURRENT values. Without `variables`, `fn` as it is
    (eager) off TensorFlow: a plain `jax.jit` would bake the variables' values of its first
    call into the function, and they change as the model trains."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, **tf_function_kwargs)
    if variables is None or keras.backend.backend() != "jax":
        return fn
    import jax

    variables = list(variables)

    def pure(values, *args):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return fn(*args)

    jitted = jax.jit(pure)

    def call(*args):
        return jitted([v.value for v in variables], *args)

    return call


def fit_jit_compile() -> bool:
    """`compile(jit_compile=...)` for the programs' own `fit`s: False on TensorFlow (a
    `tf.function` graph), True on JAX, where False is Keras's eager train step (4-6x slower
    per step on the promptability decoder's GPT-2)."""
    return keras.backend.backend() == "jax"
