"""Train/test splits shared by the offline loaders: a fixed-seed, stratified split."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tf_metaalign import backend

if TYPE_CHECKING:  # the annotations; TensorFlow is imported where a dataset is made
    import tensorflow as tf


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
    ) -> tf.data.Dataset:
        """Batches of `(x, y)` from the train split, shuffled with `seed` (same order each time)."""
        return make_dataset(
            self.x_train,
            self.y_train,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            repeat=repeat,
            drop_remainder=drop_remainder,
        )

    def test_dataset(self, batch_size: int) -> tf.data.Dataset:
        """Batches of `(x, y)` from the test split, in order."""
        return make_dataset(self.x_test, self.y_test, batch_size, shuffle=False)

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
) -> tf.data.Dataset:
    """A `tf.data.Dataset` of `(x, y)` batches; the shuffle order depends only on `seed`.

    Args:
      x: the examples (an array or a dict of arrays).
      y: the labels.
      batch_size: examples per batch.
      shuffle: shuffle the examples (again every epoch).
      seed: the shuffle's seed.
      repeat: repeat forever.
      drop_remainder: drop the last, smaller batch.

    Example:
      >>> from tf_metaalign.data import make_dataset
      >>> ds = make_dataset(np.zeros((10, 2)), np.arange(10), batch_size=4, shuffle=False)
      >>> [y.numpy().tolist() for _, y in ds]
      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    # Imported here: the split helpers and argument checks of this module run without it.
    tf = backend.require_tensorflow("tf_metaalign.data.make_dataset (a tf.data.Dataset)")
    batch_size = check_positive_int(batch_size, "batch_size")
    n = len(y)
    if n == 0:
        raise ValueError("`y` is empty: cannot make a dataset from an empty split.")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(2)
