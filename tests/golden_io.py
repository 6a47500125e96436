"""TensorFlow == JAX through golden files: `check_golden(name, arrays)`.

A golden file `tests/golden/<name>.npz` holds what a backend-neutral test computed ON
TENSORFLOW at float64 (same weights, same batches). The test computes the same arrays on
the backend it runs on and compares: in the TensorFlow env that checks the file is still
TensorFlow's result; in the JAX env (no TensorFlow) it checks JAX == TensorFlow.

(Re)write a golden: run the test in the TensorFlow env with TF_METAALIGN_WRITE_GOLDEN=1,
then commit the .npz (keep it small: small models).
"""

import os
from pathlib import Path

import keras
import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"


def check_golden(name, arrays, rtol=1e-10, atol=0.0):
    """Compare `arrays` (name -> array-like) with the golden file `name` (see the module doc).
    Returns the golden arrays."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    path = GOLDEN / f"{name}.npz"
    if os.environ.get("TF_METAALIGN_WRITE_GOLDEN") == "1":
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError("golden files are written on TensorFlow (the reference)")
        GOLDEN.mkdir(exist_ok=True)
        np.savez_compressed(path, **arrays)
        return arrays
    if not path.exists():
        raise AssertionError(
            f"no golden file {path.name}: write it in the TensorFlow env with "
            "TF_METAALIGN_WRITE_GOLDEN=1"
        )
    with np.load(path) as stored:
        golden = {k: stored[k] for k in stored.files}
    assert set(golden) == set(arrays), (
        f"{name}: keys differ: golden {sorted(golden)}, computed {sorted(arrays)}"
    )
    for key, value in arrays.items():
        expected = golden[key]
        assert value.shape == expected.shape, (
            f"{name}[{key}]: shape {value.shape} != {expected.shape}"
        )
        np.testing.assert_allclose(
            value,
            expected,
            rtol=rtol,
            atol=atol,
            err_msg=f"{name}[{key}] ({keras.backend.backend()})",
        )
    return golden


def set_numpy_weights(model, seed=0, scale=0.5):
    """Give `model` the same weights on every backend (Keras's initializers draw different
    numbers on TensorFlow and JAX): each float weight from NumPy's N(0, scale^2), a
    BatchNormalization's `moving_variance` (and `gamma`) 1 + |N|; integer weights (seed
    states) are left as they are. Returns the weights set."""
    rng = np.random.default_rng(seed)
    values = []
    for w in model.weights:
        dtype = keras.backend.standardize_dtype(w.dtype)
        if "float" not in dtype:
            values.append(keras.ops.convert_to_numpy(w.value))
            continue
        v = rng.normal(scale=scale, size=tuple(w.shape))
        if w.name in ("moving_variance", "gamma"):
            v = 1.0 + np.abs(v)
        values.append(v.astype(dtype))
    for w, v in zip(model.weights, values):
        w.assign(v)
    return values
