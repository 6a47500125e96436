"""Offline stand-in for `keras.datasets.mnist.load_data()`: scikit-learn's bundled digits.

1,797 real 8x8 handwritten digits (values 0..16), split stratified 75/25 with a fixed
seed by `tf_metaalign.data.load_digits` (1,347 train, 450 test), upsampled to 28x28 with
bilinear interpolation and returned as MNIST is: uint8 in [0, 255], shape (n, 28, 28),
labels uint8. Not MNIST (10x fewer and coarser images): an example's numbers are compared
between the original program and its port, never with the published MNIST numbers.
"""

import numpy as np
import tensorflow as tf

from tf_metaalign.data import load_digits


def load_data(seed=0):
    """((x_train, y_train), (x_test, y_test)) as `keras.datasets.mnist.load_data()`."""
    splits = load_digits(seed=seed, flatten=False)  # float32 in [0, 1], (n, 8, 8, 1)

    def to28(x):
        x = tf.image.resize(x, (28, 28), method="bilinear").numpy()[..., 0]
        return np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)

    return (
        (to28(splits.x_train), splits.y_train.astype(np.uint8)),
        (to28(splits.x_test), splits.y_test.astype(np.uint8)),
    )
