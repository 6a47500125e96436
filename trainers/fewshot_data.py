"""The few-shot program's data (`python -m trainers.fewshot`): the Omniglot splits and
the episodes as Reptile's and DotProd's batches."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.fewshot_config import Config


@dataclasses.dataclass
class Data:
    train: dict
    validation: dict
    test: dict
    runs: list | None


def prepare_data(config: Config, log=print) -> Data:
    from tf_metaalign.data import omniglot

    classes = omniglot.load_omniglot()
    split = omniglot.split_classes(
        classes, counts=(None, config.validation_classes, config.test_classes), seed=0
    )
    train = omniglot.augment_rotations(split.train) if config.rotations else split.train
    runs = None
    if config.official_runs:
        try:
            runs = omniglot.load_official_runs()
        except ImportError as e:  # decoding the runs' PNGs needs TensorFlow (not on JAX)
            log(f"the official runs are skipped: {e}")
    log(
        f"Omniglot: {len(classes)} characters -> meta-train {len(split.train)}"
        + (f" (x4 rotations = {len(train)} classes)" if config.rotations else "")
        + f", validation {len(split.validation)}, test {len(split.test)}"
        + (f"; official runs: {len(runs)}" if runs else "")
    )
    return Data(train, split.validation, split.test, runs)


def on_numpy_route() -> bool:
    """Whether the program feeds NumPy batches (the samplers' `as_numpy` route): on every
    backend but TensorFlow (the same batches as tf.data's)."""
    import keras

    return keras.backend.backend() != "tensorflow"


def map_batches(batches, fn):
    """`batches.map(fn)` for a tf.data.Dataset; for the NumPy route's generator, a
    generator of `fn(x, y)`."""
    if hasattr(batches, "map"):
        return batches.map(fn)
    return (fn(x, y) for x, y in batches)


def episode_batch_for_reptile(k, as_numpy: bool = False):
    """`(x, y) -> ([k, S+Q, ...], [k, S+Q])`: Reptile's k inner batches, each the whole
    episode (support and query). `as_numpy`: on NumPy batches."""
    if as_numpy:
        import numpy as np

        def fn_numpy(x, y):
            sx, sy, qx = x
            ex = np.concatenate([sx[0], qx[0]], 0)
            ey = np.concatenate([sy[0], y[0]], 0)
            return np.stack([ex] * k), np.stack([ey] * k)

        return fn_numpy
    import tensorflow as tf

    def fn(x, y):
        sx, sy, qx = x
        ex = tf.concat([sx[0], qx[0]], 0)
        ey = tf.concat([sy[0], y[0]], 0)
        return tf.stack([ex] * k), tf.stack([ey] * k)

    return fn


def episode_batch_for_dotprod(ways, shots, queries, as_numpy: bool = False):
    """`(x, y) -> (x, y)`: DotProd's batch, the support set then `shots` queries per class
    (two halves of equal size). `as_numpy`: on NumPy batches."""
    if as_numpy:
        import numpy as np

        def fn_numpy(x, y):
            sx, sy, qx = x
            q = np.reshape(qx[0], [ways, queries, 28, 28, 1])[:, :shots]
            qy = np.reshape(y[0], [ways, queries])[:, :shots]
            return (
                np.concatenate([sx[0], np.reshape(q, [ways * shots, 28, 28, 1])], 0),
                np.concatenate([sy[0], np.reshape(qy, [-1])], 0),
            )

        return fn_numpy
    import tensorflow as tf

    def fn(x, y):
        sx, sy, qx = x
        q = tf.reshape(qx[0], [ways, queries, 28, 28, 1])[:, :shots]
        qy = tf.reshape(y[0], [ways, queries])[:, :shots]
        return (
            tf.concat([sx[0], tf.reshape(q, [ways * shots, 28, 28, 1])], 0),
            tf.concat([sy[0], tf.reshape(qy, [-1])], 0),
        )

    return fn
