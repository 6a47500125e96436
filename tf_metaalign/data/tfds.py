"""TensorFlow Datasets by name, read from disk only (`download=False`, no GCS)."""

from __future__ import annotations

import os


class DatasetNotPreparedError(FileNotFoundError):
    """The TFDS dataset is not prepared in `data_dir`."""


def load_tfds(
    name: str,
    split="train",
    data_dir: str | os.PathLike | None = None,
    as_supervised: bool = True,
    shuffle_files: bool = False,
    **kwargs,
):
    """`tfds.load(name, split=split, data_dir=data_dir, download=False)`.

    The dataset must already be prepared under `data_dir` (default: $TFDS_DATA_DIR or
    ~/tensorflow_datasets), e.g. by `tfds build <name> --data_dir=...` on a machine with
    network access. Nothing is downloaded; a missing dataset raises
    `DatasetNotPreparedError` naming `name` and `data_dir`, an unknown name a ValueError.

    Args:
      name: the TFDS name (e.g. "mnist", "glue/sst2").
      split: the TFDS split.
      data_dir: where the prepared dataset lies (None: TFDS's default).
      as_supervised: `(x, y)` pairs rather than feature dicts.
      shuffle_files: as in `tfds.load`.
      **kwargs: other `tfds.load` arguments (not `download`).

    Returns:
      What `tfds.load` returns (a `tf.data.Dataset` for one split).

    Example:
      >>> import tempfile
      >>> from tf_metaalign.data import load_tfds
      >>> try:  # an empty data_dir: nothing is downloaded
      ...     load_tfds("mnist", data_dir=tempfile.mkdtemp())
      ... except Exception as e:
      ...     print(type(e).__name__)
      DatasetNotPreparedError
    """
    from tf_metaalign import backend

    backend.require_tensorflow(
        "load_tfds (TensorFlow Datasets yields tf.data.Datasets)",
        "install tensorflow-cpu beside JAX (Keras's JAX fit takes a tf.data.Dataset), or "
        "load the data as NumPy arrays.",
    )
    import tensorflow_datasets as tfds

    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty TFDS dataset name; got {name!r}.")
    if split is None or (isinstance(split, str) and not split):
        raise ValueError(f"`split` must name a split (e.g. 'train', 'test[:10%]'); got {split!r}.")
    data_dir = str(data_dir) if data_dir is not None else os.environ.get("TFDS_DATA_DIR")
    try:
        builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(
            f"`name`={name!r} is not a TFDS dataset known to this tensorflow-datasets "
            f"install ({e.__class__.__name__})."
        ) from e
    if not _is_prepared(builder):
        raise DatasetNotPreparedError(
            f"TFDS dataset `name`={name!r} is not prepared in `data_dir`={builder.data_dir!r} "
            "and loaders never download. Prepare it on a machine with network access "
            f"(`tfds build {name} --data_dir=<dir>`) and pass `data_dir=<dir>`."
        )
    return tfds.load(
        name,
        split=split,
        data_dir=data_dir,
        download=False,
        as_supervised=as_supervised,
        shuffle_files=shuffle_files,
        try_gcs=False,
        **kwargs,
    )


def _is_prepared(builder) -> bool:
    data_dir = builder.data_dir
    return os.path.isdir(data_dir) and os.path.isfile(os.path.join(data_dir, "dataset_info.json"))
