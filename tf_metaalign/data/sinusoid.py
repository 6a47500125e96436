"""Sinusoid regression tasks (Finn et al., 2017, section 5.1), the usual MAML sanity check.

A task is a sine wave `y = amplitude * sin(x - phase)` with amplitude ~ U[0.1, 5.0] and
phase ~ U[0, pi]; inputs x ~ U[-5, 5]. A K-shot task gives K (x, y) points to adapt on
(the support set) and further points of the same wave to score the adapted model on (the
query set). Batches are in the episode format of `tf_metaalign.data.episodes` (what
`MAMLTrainer` takes):

    ((support_x [T, K, 1], support_y [T, K, 1], query_x [T, Q, 1]), query_y [T, Q, 1])

all float32. Batch i is a pure function of `(seed, i)` (numpy's `default_rng([seed, i])`),
so a run is reproducible and the evaluation tasks (another seed) are fixed.

`dataset(num_batches)` is a `tf.data.Dataset`; `dataset(num_batches, as_numpy=True)` the
same batches as a `keras.utils.PyDataset` (no TensorFlow; for `fit` on JAX, with
`shuffle=False` to keep the order).
"""

from __future__ import annotations

import keras
import numpy as np

from tf_metaalign.data._numpy_route import NumpyBatches, tensorflow_for
from tf_metaalign.data.splits import check_positive_int

__all__ = ["AMPLITUDE_RANGE", "PHASE_RANGE", "INPUT_RANGE", "sinusoid", "SinusoidTasks"]

AMPLITUDE_RANGE = (0.1, 5.0)
PHASE_RANGE = (0.0, float(np.pi))
INPUT_RANGE = (-5.0, 5.0)


def sinusoid(x, amplitude, phase):
    """`amplitude * sin(x - phase)` (numpy broadcasting)."""
    return np.asarray(amplitude) * np.sin(np.asarray(x) - np.asarray(phase))


class SinusoidTasks:
    """K-shot sinusoid regression tasks.

    Args:
      shots: K, support points per task.
      queries: Q, query points per task.
      tasks_per_batch: T, tasks per batch.
      seed: integer; batch i depends only on `(seed, i)`.
    """

    def __init__(
        self, shots: int = 10, queries: int = 10, tasks_per_batch: int = 25, seed: int = 0
    ):
        self.shots = check_positive_int(shots, "shots")
        self.queries = check_positive_int(queries, "queries")
        self.tasks_per_batch = check_positive_int(tasks_per_batch, "tasks_per_batch")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"`seed` must be an integer >= 0; got {seed!r}.")
        self.seed = int(seed)

    def batch(self, i: int, with_tasks: bool = False):
        """Batch `i` as numpy arrays `((sx, sy, qx), qy)`; with `with_tasks`, also
        `(amplitude [T], phase [T])`."""
        rng = np.random.default_rng([self.seed, int(i)])
        t, k, q = self.tasks_per_batch, self.shots, self.queries
        amplitude = rng.uniform(*AMPLITUDE_RANGE, size=t)
        phase = rng.uniform(*PHASE_RANGE, size=t)
        x = rng.uniform(*INPUT_RANGE, size=(t, k + q, 1))
        y = sinusoid(x, amplitude[:, None, None], phase[:, None, None])
        x, y = x.astype(np.float32), y.astype(np.float32)
        out = ((x[:, :k], y[:, :k], x[:, k:]), y[:, k:])
        return (out, (amplitude, phase)) if with_tasks else out

    def dataset(self, num_batches: int, as_numpy: bool = False):
        """Batches 0 .. num_batches-1, in memory (small: T * (K + Q) points each): a
        `tf.data.Dataset`, or with `as_numpy` a `keras.utils.PyDataset` of the same
        batches (no TensorFlow)."""
        num_batches = check_positive_int(num_batches, "num_batches")
        if as_numpy:
            return NumpyBatches(self.batch, num_batches)
        tf = tensorflow_for("SinusoidTasks.dataset")
        batches = [self.batch(i) for i in range(num_batches)]
        stacked = keras.tree.map_structure(lambda *a: np.stack(a), *batches)
        return tf.data.Dataset.from_tensor_slices(stacked)
