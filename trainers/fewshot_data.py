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
    runs = omniglot.load_official_runs() if config.official_runs else None
    log(
        f"Omniglot: {len(classes)} characters -> meta-train {len(split.train)}"
        + (f" (x4 rotations = {len(train)} classes)" if config.rotations else "")
        + f", validation {len(split.validation)}, test {len(split.test)}"
        + (f"; official runs: {len(runs)}" if runs else "")
    )
    return Data(train, split.validation, split.test, runs)


def episode_batch_for_reptile(k):
    import tensorflow as tf

    def fn(x, y):
        sx, sy, qx = x
        ex = tf.concat([sx[0], qx[0]], 0)
        ey = tf.concat([sy[0], y[0]], 0)
        return tf.stack([ex] * k), tf.stack([ey] * k)

    return fn


def episode_batch_for_dotprod(ways, shots, queries):
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
