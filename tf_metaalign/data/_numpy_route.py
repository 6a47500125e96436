"""The NumPy route of the data helpers: what feeds `fit` without TensorFlow.

Every helper that makes a `tf.data.Dataset` also takes `as_numpy=True`, which gives the
same batches as NumPy arrays, without TensorFlow:

* an infinite stream is a Python generator (Keras's `fit` takes it with
  `steps_per_epoch`, and goes on where the last epoch stopped, as with an infinite
  `tf.data.Dataset`);
* a finite set is a `keras.utils.PyDataset` (`NumpyBatches`): `len()`, `ds[i]`, iterated
  again from its first batch for every epoch and every `evaluate`, as a finite
  `tf.data.Dataset` is. Keras's `fit` shuffles the ORDER of a finite PyDataset's batches
  unless it is given `shuffle=False` (a `tf.data.Dataset` it never shuffles): pass
  `shuffle=False` for the tf.data route's order.

Without TensorFlow, the tf.data route raises an ImportError that names the helper and
this route (`tensorflow_for`).
"""

from __future__ import annotations

import itertools

import keras

from tf_metaalign import backend


def tensorflow_for(what: str, gives: str = "a tf.data.Dataset"):
    """The `tensorflow` module for the TensorFlow route of `what` (e.g.
    "MultiTaskStream.single_task_batches", which `gives` a tf.data.Dataset), or an
    ImportError naming `what` and its NumPy route (`what(..., as_numpy=True)`)."""
    return backend.require_tensorflow(
        f"{what} ({gives})",
        f"{what}(..., as_numpy=True) gives the same batches as NumPy arrays, which Keras's "
        "fit takes on every backend (see tf_metaalign.data).",
    )


def generate(batch_fn, start: int):
    """Batches `batch_fn(start)`, `batch_fn(start + 1)`, ... forever."""
    for k in itertools.count(start):
        yield batch_fn(k)


class NumpyBatches(keras.utils.PyDataset):
    """A finite sequence of batches: `ds[i]` is `batch_fn(start + i)`, for i < `length`.

    Args:
      batch_fn: `k -> batch` (a nest of NumPy arrays).
      length: the number of batches.
      start: the index of the first batch.
      on_epoch_end: called (no arguments) at the end of every epoch of `fit`.
    """

    def __init__(self, batch_fn, length: int, start: int = 0, on_epoch_end=None):
        super().__init__()
        self._batch_fn = batch_fn
        self._length = int(length)
        self._start = int(start)
        self._on_epoch_end = on_epoch_end

    def __len__(self):
        return self._length

    @property
    def num_batches(self):
        return self._length

    def __getitem__(self, index):
        if not -self._length <= index < self._length:
            raise IndexError(f"batch {index} of {self._length}")
        return self._batch_fn(self._start + index % self._length)

    def __iter__(self):
        for i in range(self._length):
            yield self[i]

    def on_epoch_end(self):
        if self._on_epoch_end is not None:
            self._on_epoch_end()

    def __repr__(self):
        return f"NumpyBatches({self._length} batches)"
