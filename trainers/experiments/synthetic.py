"""The synthetic multi-task problem of the Sequential Reptile paper (Lee et al., Fig. 3).

Three tasks in 2-D with optima x_1 = (0, 10), x_2 = (0, 0), x_3 = (10, 0); the shared
parameter phi starts at (20, 5). Task i's loss is

    L_i(phi) = -200 * exp(-0.2 * ||phi - x_i||)

NOTE: the paper prints `-200 * exp(0.2 * ||phi - x_i||)`, which has no minimum at x_i (it
decreases without bound away from it): a sign typo. The decaying form above has its
minimum -200 at x_i, as the paper's figure shows.

The model is a Keras model whose only weight is phi (`point_model`): it ignores its input
and outputs phi for every example; the target of an example of task i is x_i, and
`SyntheticTaskLoss` is L_i averaged over the batch. So any trainer and any data stream of
the package run on it unchanged (`synthetic_tasks` gives the per-task examples in the
form `tf_metaalign.data.multitask.MultiTaskStream` takes). Written in `keras.ops`: it
runs on either Keras backend.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

OPTIMA = ((0.0, 10.0), (0.0, 0.0), (10.0, 0.0))
START = (20.0, 5.0)
SCALE = 200.0
RATE = 0.2


def task_loss(phi, optimum):
    """L_i(phi) in numpy (phi [..., 2]), e.g. for a contour plot of the loss surface."""
    d = np.linalg.norm(np.asarray(phi, np.float64) - np.asarray(optimum, np.float64), axis=-1)
    return -SCALE * np.exp(-RATE * d)


def task_gradient(phi, optimum):
    """dL_i/dphi in closed form (numpy): 200*0.2*exp(-0.2 d) * (phi - x_i) / d."""
    phi, optimum = np.asarray(phi, np.float64), np.asarray(optimum, np.float64)
    diff = phi - optimum
    d = np.linalg.norm(diff)
    return SCALE * RATE * np.exp(-RATE * d) * diff / d


def mean_pairwise_cosine(phi):
    """The average pairwise cosine between the three task gradients at phi."""
    grads = [task_gradient(phi, x) for x in OPTIMA]
    cos = []
    for i in range(len(grads)):
        for j in range(i + 1, len(grads)):
            cos.append(grads[i] @ grads[j] / np.linalg.norm(grads[i]) / np.linalg.norm(grads[j]))
    return float(np.mean(cos))


@keras.saving.register_keras_serializable(package="tf_metaalign")
class SyntheticTaskLoss(keras.losses.Loss):
    """The batch mean of L_i(y_pred) with y_true = x_i (the optimum of each example's task)."""

    def __init__(self, name="synthetic_task_loss", reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        diff = y_pred - ops.cast(y_true, y_pred.dtype)
        d = ops.sqrt(ops.sum(ops.square(diff), axis=-1))  # as tf.norm computes it
        return -SCALE * ops.exp(-RATE * d)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PointLayer(keras.layers.Layer):
    """phi in R^2 (initialised at `start`), output for every example of the batch."""

    def __init__(self, start=START, **kwargs):
        super().__init__(**kwargs)
        self.start = tuple(float(v) for v in start)
        self.phi = self.add_weight(
            name="phi", shape=(2,), initializer=keras.initializers.Constant(self.start)
        )

    def call(self, x):
        return ops.zeros_like(x[:, :1], dtype=self.phi.dtype) + self.phi

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 2)

    def get_config(self):
        return {**super().get_config(), "start": list(self.start)}


def point_model(start=START, dtype="float32"):
    """A Keras model whose one weight is phi; its input (any [B, 1]) is ignored."""
    inputs = keras.Input((1,), dtype=dtype)
    return keras.Model(inputs, PointLayer(start, dtype=dtype, name="phi")(inputs), name="point")


def synthetic_tasks(examples_per_task=8, names=("task_1", "task_2", "task_3"), dtype="float32"):
    """name -> (x, y): `examples_per_task` dummy inputs, each with target x_i."""
    return {
        name: (
            np.zeros((examples_per_task, 1), dtype),
            np.tile(np.asarray(optimum, dtype), (examples_per_task, 1)),
        )
        for name, optimum in zip(names, OPTIMA)
    }


__all__ = [
    "OPTIMA",
    "START",
    "PointLayer",
    "SyntheticTaskLoss",
    "mean_pairwise_cosine",
    "point_model",
    "synthetic_tasks",
    "task_gradient",
    "task_loss",
]
