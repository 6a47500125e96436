"""scikit-learn's digits: 1,797 real 8x8 handwritten digits, 10 classes (bundled, offline)."""

from __future__ import annotations

import numpy as np

from tf_metaalign.data.splits import Splits, stratified_split, take


def load_digits(test_fraction: float = 0.25, seed: int = 0, flatten: bool = True) -> Splits:
    """The digits, scaled to [0, 1], split stratified with a fixed `seed`.

    Args:
      test_fraction: fraction of each class held out for test (default 0.25: 1,347 train,
        450 test).
      seed: the split's seed; the same seed gives the same split.
      flatten: `x` of shape (n, 64) if True, else (n, 8, 8, 1).

    Returns:
      `Splits` with float32 `x` and int32 `y` (10 classes).

    Example:
      >>> from tf_metaalign.data import load_digits
      >>> digits = load_digits()
      >>> digits.x_train.shape, digits.x_test.shape, digits.num_classes, float(digits.x_train.max())
      ((1347, 64), (450, 64), 10, 1.0)
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as e:  # pragma: no cover - sklearn is a test/examples extra
        raise ImportError("load_digits needs scikit-learn: `pip install scikit-learn`.") from e
    bunch = _sk_load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    if not flatten:
        x = x.reshape(-1, 8, 8, 1)
    train, test = stratified_split(y, test_fraction, seed)
    return Splits(
        x_train=take(x, train),
        y_train=y[train],
        x_test=take(x, test),
        y_test=y[test],
        num_classes=10,
        class_names=[str(i) for i in range(10)],
        name="digits",
    )
