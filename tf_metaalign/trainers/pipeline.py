"""Raw data for keras-hub tasks: apply the wrapped model's preprocessor in `fit` /
`evaluate` / `predict`.

A keras-hub `Task` (e.g. `BertTextClassifier.from_preset(...)`) is a `PipelineModel`: its
`fit(x, y)` takes raw data (strings, images), turns arrays and lists into a batched
`tf.data.Dataset` (or maps over the dataset it is given) and maps its
`preprocess_samples(x, y, sample_weight)` over the batches before Keras sees them. A
trainer wraps the task, so Keras's own `fit` sees the raw strings and fails
("Unrecognized data type"). `PipelineDataMixin`, the first base of every trainer, does
what keras-hub's `PipelineModel` does, with the *wrapped* model's `preprocess_samples`
(its own public method, so the preprocessing is exactly the task's):

* arrays / lists / tensors (`x`, `y`, `sample_weight`): sliced and batched with `tf.data`
  (`batch_size`, default 32), then `preprocess_samples` is mapped over each batch;
* a `tf.data.Dataset`: `preprocess_samples` is mapped over its (already batched) elements;
* `validation_data` (a dataset or `(x, y[, sample_weight])`) and `validation_split` the same way;
* `train_on_batch` / `test_on_batch` / `predict_on_batch`: `preprocess_samples` on the batch.

Differences from keras-hub 0.32's `PipelineModel`, all in favour of what Keras's `fit`
does with arrays: `shuffle=True` (the default) shuffles array inputs before batching
(keras-hub hands Keras a built dataset, where Keras ignores `shuffle` with a warning);
`validation_batch_size` is honoured; inputs always go through `tf.data` (keras-hub uses
`grain` when it is installed; the batches are the same). A `grain` dataset, a
`keras.utils.PyDataset` or a generator is refused with a clear error when the model has a
preprocessor: map `model.preprocess_samples` over it yourself, or pass a `tf.data.Dataset`.

Data already in the form the model's layers take (a dict keyed by the task's input names,
e.g. `token_ids`/`segment_ids`/`padding_mask`, no strings: what mapping the task's
preprocessor by hand gives) is passed through unchanged, so code written that way keeps
working (keras-hub's own `fit` would preprocess it again and fail).

A model without a preprocessor (any plain Keras model, or a keras-hub task built with
`preprocessor=None`) is not touched: every method calls `super()` with the arguments as
given, i.e. exactly Keras. keras-hub is never imported here (duck typing): a model is
treated as a pipeline when it has `preprocess_samples` and either a `preprocessor` that is
not None or a `preprocess_samples` of its own (defined outside keras-hub).
"""

from __future__ import annotations

import inspect

import keras
import numpy as np

from tf_metaalign import backend

UNBATCHED_INPUT_ERROR = (
    "`x`, `y`, and `sample_weight` must have a batch dimension when calling `fit()`, "
    "`evaluate()`, and `predict()`. Received an input with rank 0. Please add an outer "
    "dimension to your input, e.g., wrap it in a list."
)


def preprocess_samples_fn(model):
    """The wrapped model's `preprocess_samples(x, y=None, sample_weight=None)`, or None.

    None when the model has nothing to apply: no `preprocess_samples` (plain Keras), or a
    keras-hub task whose `preprocessor` is None and whose `preprocess_samples` is keras-hub's
    own (which then returns its inputs unchanged).
    """
    fn = getattr(model, "preprocess_samples", None)
    if not callable(fn):
        return None
    if getattr(model, "preprocessor", None) is not None:
        return fn
    defined_in = getattr(getattr(type(model), "preprocess_samples", None), "__module__", "") or ""
    if defined_in.startswith("keras_hub."):
        return None  # PipelineModel's / Task's identity default
    return fn


def _tf():
    # keras-hub's preprocessors run on tf.data (keras-hub needs TensorFlow for them on any
    # backend): imported only when a model with a preprocessor is given data.
    return backend.require_tensorflow(
        "Applying a keras-hub task's preprocessor to fit/evaluate/predict data",
        "preprocess the data yourself (model.preprocessor), or build the task with "
        "preprocessor=None and pass token ids.",
    )


def _is_tf_dataset(x):
    tf = backend.tensorflow_if_loaded()
    return tf is not None and isinstance(x, tf.data.Dataset)


def _model_input_names(model):
    """The keys of a functional model's dict of inputs (e.g. a keras-hub task's), or None."""
    try:
        inputs = model.input
    except (AttributeError, ValueError):
        return None
    return set(inputs) if isinstance(inputs, dict) else None


def _x_of(x):
    """The features of data given to fit/evaluate/predict: `x`, or a dataset's element's `x`."""
    if _is_tf_dataset(x):
        spec = x.element_spec
        return spec[0] if isinstance(spec, tuple) else spec
    return x


def already_preprocessed(model, x):
    """Whether `x` (arrays or a dataset) is already in the form the model's layers take.

    True when its features are a dict keyed exactly by the functional model's input names
    (e.g. `token_ids`, `segment_ids`, `padding_mask`) holding no strings: data someone
    mapped the task's preprocessor over by hand, which a preprocessor would reject. It is
    passed through, so such code keeps working (keras-hub's own `fit` raises instead).
    """
    features = _x_of(x)
    names = _model_input_names(model)
    if not isinstance(features, dict) or names is None or set(features) != names:
        return False
    for leaf in keras.tree.flatten(features):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or _is_string_dtype(dtype):
            return False
    return True


def _is_string_dtype(dtype):
    if isinstance(dtype, np.dtype) or isinstance(dtype, type):
        return np.dtype(dtype).kind in "SUO"
    return getattr(dtype, "name", str(dtype)) == "string"


def _check_supported(x, where):
    if x is None or _is_tf_dataset(x):
        return
    kind = None
    if isinstance(x, keras.utils.PyDataset):
        kind = "a keras.utils.PyDataset"
    elif inspect.isgenerator(x) or type(x).__module__.split(".")[0] == "grain":
        kind = f"a {type(x).__module__.split('.')[0]}.{type(x).__name__}"
    if kind is not None:
        raise ValueError(
            f"`{where}` is {kind}, but the wrapped model has a preprocessor, which the trainer "
            "applies only to arrays, lists, tensors or a tf.data.Dataset (as keras-hub's "
            "PipelineModel does). Pass a tf.data.Dataset, or apply "
            "`model.preprocess_samples(x, y, sample_weight)` to your batches yourself."
        )


def _map_leaves(inputs, fn):
    # tf.data's structure rules: tuples and dicts are structure, a list is one tensor.
    if isinstance(inputs, tuple):
        return tuple(_map_leaves(i, fn) for i in inputs)
    if isinstance(inputs, dict):
        return {k: _map_leaves(v, fn) for k, v in inputs.items()}
    return fn(inputs)


def _flatten_leaves(inputs):
    if isinstance(inputs, tuple):
        return [leaf for i in inputs for leaf in _flatten_leaves(i)]
    if isinstance(inputs, dict):
        return [leaf for v in inputs.values() for leaf in _flatten_leaves(v)]
    return [inputs]


def _to_slicable(leaf):
    """numpy arrays, tensors, lists and scalars as they are; other array-likes as numpy."""
    if leaf is None or isinstance(leaf, (np.ndarray, list, str, bytes)):
        return leaf
    tf = backend.tensorflow_if_loaded()
    if tf is not None and isinstance(leaf, (tf.Tensor, tf.RaggedTensor)):
        return leaf
    if hasattr(leaf, "__array__"):
        return np.asarray(leaf)
    return leaf


def split_for_validation(x, y, sample_weight, validation_split):
    """Keras's `validation_split`: the last `validation_split` of the examples, unshuffled.

    Returns `((x, y, sample_weight), validation_data)`.
    """
    arrays = _map_leaves((x, y, sample_weight), _to_slicable)
    leaves = [a for a in _flatten_leaves(arrays) if a is not None]
    if not leaves:
        return arrays, arrays
    n = len(leaves[0])
    split_at = int(n * (1.0 - validation_split))
    if split_at == 0 or split_at == n:
        raise ValueError(
            f"Training data contains {n} samples, which is not sufficient to split it into a "
            f"validation and training set as specified by `validation_split={validation_split}`."
        )

    def part(start, end):
        return _map_leaves(arrays, lambda a: None if a is None else a[start:end])

    return part(0, split_at), part(split_at, n)


def make_dataset(
    preprocess_samples, x=None, y=None, sample_weight=None, batch_size=None, shuffle=False
):
    """A `tf.data.Dataset` of preprocessed batches, as keras-hub's `PipelineModel` builds it.

    `x` a `tf.data.Dataset` (batched): `preprocess_samples` mapped over its elements
    (`y`, `sample_weight` must be None). Otherwise `(x, y, sample_weight)` (arrays, lists,
    tensors, nested in tuples/dicts) are sliced along their first axis, shuffled if
    `shuffle`, batched by `batch_size` (default 32), and mapped.
    """
    if _is_tf_dataset(x):
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValueError(
                    f"When `x` is a tf.data.Dataset, please do not provide `{name}`; include "
                    "it in the dataset's elements."
                )
        ds = x
        tf = _tf()
    else:
        tf = _tf()
        inputs = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        inputs = keras.tree.map_structure(_to_slicable, inputs)
        try:
            ds = tf.data.Dataset.from_tensor_slices(inputs)
        except ValueError as e:
            if "only supported for rank >= 1" in str(e):
                raise ValueError(UNBATCHED_INPUT_ERROR) from e
            raise
        if shuffle:
            ds = ds.shuffle(int(ds.cardinality()), reshuffle_each_iteration=True)
        ds = ds.batch(batch_size or 32)
    return ds.map(preprocess_samples, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
        tf.data.AUTOTUNE
    )


class Preprocessed:
    """Marks data as already preprocessed: `preprocess_data` returns `.data` untouched."""

    def __init__(self, data):
        self.data = data


def preprocess_data(model, data):
    """`data` preprocessed for `model`: a batch `(x, y[, sample_weight])` or a tf.data.Dataset.

    For data a trainer takes besides `fit`'s (e.g. `GuidedTrainer`'s `guidance_data`).
    Returned unchanged when the model has no preprocessor, when it is already in the
    model's input form (see `already_preprocessed`), or wrapped in `Preprocessed`.
    """
    if isinstance(data, Preprocessed):
        return data.data
    fn = preprocess_samples_fn(model)
    if fn is None or data is None:
        return data
    if _is_tf_dataset(data):
        return data if already_preprocessed(model, data) else make_dataset(fn, data)
    batch = tuple(data) if isinstance(data, (tuple, list)) and len(data) in (2, 3) else (data,)
    if already_preprocessed(model, batch[0]):
        return data
    return fn(*batch)


def _bind(method, args, kwargs):
    """The arguments of a call to `method` by name (positional ones included)."""
    return dict(inspect.signature(method).bind(*args, **kwargs).arguments)


def _to_tensors(data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    if y is not None:
        y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
    if sample_weight is not None:
        sample_weight = keras.tree.map_structure(keras.ops.convert_to_tensor, sample_weight)
    return x, y, sample_weight


class PipelineDataMixin:
    """Applies the wrapped model's preprocessor to `fit`/`evaluate`/`predict` data.

    The first base of `MetaTrainer` (`class MetaTrainer(PipelineDataMixin, keras.Model)`);
    it reads the wrapped model from `self.model`. See the module docstring.
    """

    def _preprocess_samples(self, x=None):
        """The wrapped model's preprocessing for data `x`, or None to leave `x` to Keras."""
        model = getattr(self, "model", None)
        fn = preprocess_samples_fn(model)
        if fn is None or (x is not None and already_preprocessed(model, x)):
            return None
        return fn

    @staticmethod
    def _first_arg(args, kwargs):
        return args[0] if args else kwargs.get("x")

    def fit(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        if preprocess is None:
            return super().fit(*args, **kwargs)
        a = _bind(super().fit, args, kwargs)
        x, y, sample_weight = a.pop("x", None), a.pop("y", None), a.pop("sample_weight", None)
        batch_size = a.pop("batch_size", None)
        validation_data = a.pop("validation_data", None)
        validation_split = a.pop("validation_split", 0.0)
        validation_batch_size = a.pop("validation_batch_size", None)
        shuffle = a.pop("shuffle", True)
        _check_supported(x, "x")
        _check_supported(validation_data, "validation_data")
        if validation_split and validation_data is None:
            if _is_tf_dataset(x):
                raise ValueError(
                    "`validation_split` is only supported for arrays, lists or tensors, not a "
                    "tf.data.Dataset; pass `validation_data` instead."
                )
            (x, y, sample_weight), validation_data = split_for_validation(
                x, y, sample_weight, validation_split
            )
        built_here = not _is_tf_dataset(x)
        x = make_dataset(
            preprocess, x, y, sample_weight, batch_size, shuffle=bool(shuffle) and built_here
        )
        if validation_data is not None:
            if _is_tf_dataset(validation_data):
                validation_data = make_dataset(preprocess, validation_data)
            else:
                vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(validation_data)
                validation_data = make_dataset(
                    preprocess, vx, vy, vsw, validation_batch_size or batch_size
                )
        # A dataset the caller built keeps Keras's handling of `shuffle` (it warns that it
        # is ignored); arrays were shuffled above, so Keras gets shuffle=False for them.
        return super().fit(
            x=x, validation_data=validation_data, shuffle=shuffle if not built_here else False, **a
        )

    def evaluate(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        # Inside fit(), Keras evaluates the validation data fit() already preprocessed.
        if preprocess is None or kwargs.get("_use_cached_eval_dataset", False):
            return super().evaluate(*args, **kwargs)
        a = _bind(super().evaluate, args, kwargs)
        extra = a.pop("kwargs", {})
        x, y, sample_weight = a.pop("x", None), a.pop("y", None), a.pop("sample_weight", None)
        _check_supported(x, "x")
        x = make_dataset(preprocess, x, y, sample_weight, a.pop("batch_size", None))
        return super().evaluate(x=x, **a, **extra)

    def predict(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        if preprocess is None:
            return super().predict(*args, **kwargs)
        a = _bind(super().predict, args, kwargs)
        x = a.pop("x", None)
        _check_supported(x, "x")
        x = make_dataset(preprocess, x, batch_size=a.pop("batch_size", None))
        return super().predict(x=x, **a)

    def train_on_batch(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        if preprocess is None:
            return super().train_on_batch(*args, **kwargs)
        a = _bind(super().train_on_batch, args, kwargs)
        x, y, sw = _to_tensors(
            preprocess(a.pop("x"), a.pop("y", None), a.pop("sample_weight", None))
        )
        return super().train_on_batch(x=x, y=y, sample_weight=sw, **a)

    def test_on_batch(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        if preprocess is None:
            return super().test_on_batch(*args, **kwargs)
        a = _bind(super().test_on_batch, args, kwargs)
        x, y, sw = _to_tensors(
            preprocess(a.pop("x"), a.pop("y", None), a.pop("sample_weight", None))
        )
        return super().test_on_batch(x=x, y=y, sample_weight=sw, **a)

    def predict_on_batch(self, *args, **kwargs):
        preprocess = self._preprocess_samples(self._first_arg(args, kwargs))
        if preprocess is None:
            return super().predict_on_batch(*args, **kwargs)
        a = _bind(super().predict_on_batch, args, kwargs)
        x, _, _ = _to_tensors(preprocess(a.pop("x")))
        return super().predict_on_batch(x=x, **a)
