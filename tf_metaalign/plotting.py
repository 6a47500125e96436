"""Plots of learned hyperparameter schedules (guided learning) to PNG.

* `ScheduleRecorder`: a Keras callback keeping every batch's logs of chosen keys
  (`learning_rate_scale`, `beta_1`, `effective_learning_rate`, ...), per step.
* `plot_schedules(runs, path, keys)`: one panel per key, one line per run; `runs` maps a
  run name to a dict key -> list of per-step values (e.g. `recorder.values`).
* `SchedulePlotCallback(path)`: records and writes the plot when training ends.

Draws with matplotlib's Agg canvas on a `Figure` of its own (no display needed, and
pyplot's backend is not switched).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import keras

DEFAULT_KEYS = ("learning_rate_scale", "effective_learning_rate", "beta_1")


class ScheduleRecorder(keras.callbacks.Callback):
    """Records `keys` from each training batch's logs into `self.values[key]` (floats)."""

    def __init__(self, keys: Sequence[str] = DEFAULT_KEYS):
        super().__init__()
        self.keys = tuple(keys)
        self.values = {k: [] for k in self.keys}

    def on_train_batch_end(self, batch, logs=None):
        for k in self.keys:
            if logs and k in logs:
                self.values[k].append(float(logs[k]))


def plot_schedules(runs: Mapping[str, Mapping[str, Sequence[float]]], path, keys=None, title=None):
    """Write a PNG with one panel per key and one line per run; returns `path`."""
    # A Figure of its own, drawn by the Agg canvas: pyplot's global backend (a notebook's
    # inline backend, a GUI session) is left as it is.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("plot_schedules: `runs` is empty.")
    if keys is None:
        keys = [k for k in DEFAULT_KEYS if any(r.get(k) for r in runs.values())]
    keys = [k for k in keys if any(r.get(k) for r in runs.values())]
    if not keys:
        raise ValueError("plot_schedules: none of the runs has values for the requested keys.")
    fig = Figure(figsize=(4.5 * len(keys), 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(keys), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, values in runs.items():
            v = values.get(key)
            if v:
                ax.plot(range(1, len(v) + 1), v, label=name, linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    return path


class SchedulePlotCallback(ScheduleRecorder):
    """Records the schedules and writes `plot_schedules({name: values}, path)` at train end."""

    def __init__(self, path, keys: Sequence[str] = DEFAULT_KEYS, name="run"):
        super().__init__(keys)
        self.path = path
        self.name = name

    def on_train_end(self, logs=None):
        if any(self.values.values()):
            plot_schedules({self.name: self.values}, self.path)
