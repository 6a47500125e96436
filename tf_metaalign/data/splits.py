"""Train/test splits shared by the offline loaders: a fixed-seed, stratified split.

`make_dataset` (and `Splits.train_dataset` / `test_dataset`) make a `tf.data.Dataset`;
with `as_numpy=True` the batches come as NumPy arrays without TensorFlow (for Keras's
`fit` on JAX): in order, the same batches as the tf.data route; shuffled, another order
(tf.data's shuffle depends on TensorFlow's global seed and cannot be reproduced), drawn
from `(seed, epoch)`. Or give `fit` the arrays themselves (`fit(x, y, batch_size=...)`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import itertools

import numpy as np

from tf_metaalign.data._numpy_route import NumpyBatches, tensorflow_for


@dataclasses.dataclass
class Splits:
    """A dataset split in two, as numpy arrays.

    Attributes:
      x_train: the training examples (`x` may be a dict of arrays, e.g. tokenized text).
      y_train: their integer labels in `[0, num_classes)`.
      x_test: the test examples.
      y_test: their labels.
      num_classes: number of classes.
      class_names: one name per class.
      name: the dataset's name.

    Example:
      >>> from tf_metaalign.data import Splits
      >>> splits = Splits(np.zeros((8, 2)), np.arange(8) % 2, np.zeros((2, 2)), np.array([0, 1]),
      ...                 num_classes=2, class_names=["neg", "pos"], name="toy")
      >>> splits.x_train.shape, splits.class_names[splits.y_test[1]]
      ((8, 2), 'pos')
    """

    x_train: Any
    y_train: np.ndarray
    x_test: Any
    y_test: np.ndarray
    num_classes: int
    class_names: Sequence[str]
    name: str = ""

    def train_dataset(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        repeat: bool = False,
        drop_remainder: bool = False,
        as_numpy: bool = False,
    ):
        """Batches of `(x, y)` from the train split, shuffled with `seed` (same order each
        time); see `make_dataset` (and its `as_numpy`)."""
        return make_dataset(
            self.x_train,
            self.y_train,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            repeat=repeat,
            drop_remainder=drop_remainder,
            as_numpy=as_numpy,
        )

    def test_dataset(self, batch_size: int, as_numpy: bool = False):
        """Batches of `(x, y)` from the test split, in order (see `make_dataset`)."""
        return make_dataset(self.x_test, self.y_test, batch_size, shuffle=False, as_numpy=as_numpy)

    def __repr__(self):
        return (
            f"Splits(name={self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
            f"num_classes={self.num_classes})"
        )


def check_positive_int(value, arg_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{arg_name}` must be an integer >= 1; got {value!r}.")
    return int(value)


def check_fraction(value, arg_name: str = "test_fraction") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.floating))
        or not (0.0 < float(value) < 1.0)
    ):
        raise ValueError(f"`{arg_name}` must be a number strictly between 0 and 1; got {value!r}.")
    return float(value)


def take(x, index):
    """Index an array, or every array of a dict, with `index`."""
    if isinstance(x, dict):
        return {k: v[index] for k, v in x.items()}
    return x[index]


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int):
    """Indices `(train, test)`: each class split `test_fraction` to test (at least one
    example of every class with >= 2 examples goes to each side), shuffled with `seed`."""
    test_fraction = check_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_test = int(round(len(idx) * test_fraction))
        if len(idx) >= 2:
            n_test = min(max(n_test, 1), len(idx) - 1)
        else:
            n_test = 0
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train = rng.permutation(np.concatenate(train))
    test = rng.permutation(np.concatenate(test))
    if len(train) == 0 or len(test) == 0:
        raise ValueError(
            f"The split is empty (train={len(train)}, test={len(test)} examples from "
            f"{len(labels)}); use more examples or another `test_fraction`."
        )
    return train, test


def make_dataset(
    x,
    y,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    repeat: bool = False,
    drop_remainder: bool = False,
    as_numpy: bool = False,
):
    """A `tf.data.Dataset` of `(x, y)` batches; the shuffle order depends only on `seed`.

    Args:
      x: the examples (an array or a dict of arrays).
      y: the labels.
      batch_size: examples per batch.
      shuffle: shuffle the examples (again every epoch).
      seed: the shuffle's seed.
      repeat: repeat forever.
      drop_remainder: drop the last, smaller batch.
      as_numpy: NumPy batches, without TensorFlow: a `keras.utils.PyDataset` (with
        `repeat`, an infinite generator). Unshuffled, the tf.data route's batches;
        shuffled, epoch e's order is `np.random.default_rng([seed, e]).permutation(n)`
        (a PyDataset's epoch advances at the end of each `fit` epoch).

    Example:
      >>> from tf_metaalign.data import make_dataset
      >>> ds = make_dataset(np.zeros((10, 2)), np.arange(10), batch_size=4, shuffle=False)
      >>> [y.numpy().tolist() for _, y in ds]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    n = len(y)
    if n == 0:
        raise ValueError("`y` is empty: cannot make a dataset from an empty split.")
    if as_numpy:
        return _numpy_batches(x, y, n, batch_size, shuffle, seed, repeat, drop_remainder)
    tf = tensorflow_for("make_dataset")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(2)


def _numpy_batches(x, y, n, batch_size, shuffle, seed, repeat, drop_remainder):
    """`make_dataset(..., as_numpy=True)`."""
    x, y = _as_arrays(x), np.asarray(y)

    def order(epoch):
        return np.random.default_rng([int(seed), epoch]).permutation(n) if shuffle else np.arange(n)

    if repeat:  # batches run across epochs, as tf.data's `.repeat().batch()`

        def forever():
            pending = np.zeros([0], np.int64)
            for epoch in itertools.count():
                pending = np.concatenate([pending, order(epoch)])
                while len(pending) >= batch_size:
                    index, pending = pending[:batch_size], pending[batch_size:]
                    yield take(x, index), y[index]

        return forever()
    epoch = [0]

    def batch(i):
        index = order(epoch[0])[i * batch_size : (i + 1) * batch_size]
        return take(x, index), y[index]

    def next_epoch():
        epoch[0] += 1

    length = n // batch_size if drop_remainder else -(-n // batch_size)
    if length == 0:
        raise ValueError(
            f"`batch_size`={batch_size} with `drop_remainder=True` leaves no batch of the "
            f"{n} examples."
        )
    return NumpyBatches(batch, length, on_epoch_end=next_epoch)


def _as_arrays(x):
    if isinstance(x, dict):
        return {k: np.asarray(v) for k, v in x.items()}
    return np.asarray(x)
