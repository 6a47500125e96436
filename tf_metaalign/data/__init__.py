"""Reusable data pieces: multi-task streams, episodes, per-task heads, standard loaders.

  multitask                 multi-task batches (p_t ∝ N_t^q), deterministic and resumable;
                            `PerTaskHead` and `one_head_per_task_model`
  episodes                  N-way K-shot episodes with a task dimension, deterministic and resumable
  meta_batches              stacked [k, B, ...] elements for ReptileTrainer / FOMAMLTrainer
  omniglot                  Omniglot from the official zips (cached), class splits, rotations,
                            Lake's 20 runs of 20-way 1-shot
  sinusoid                  the MAML paper's sinusoid regression tasks
  load_digits               scikit-learn's 8x8 digits (1,797 images, 10 classes)
  load_tfds                 a TFDS dataset already on disk (never downloads)
  Splits, make_dataset      numpy splits and their `tf.data.Dataset`s

On JAX (or anywhere without TensorFlow): `import tf_metaalign.data` needs no TensorFlow,
and every helper that makes a `tf.data.Dataset` takes `as_numpy=True` for the same batches
as NumPy arrays, which Keras's `fit` takes on every backend: an infinite stream as a Python
generator (`fit(..., steps_per_epoch=...)`), a finite set as a `keras.utils.PyDataset`
(`fit` shuffles a finite PyDataset's batch order unless `shuffle=False`). The streams
(`MultiTaskStream`, `EpisodeSampler`) draw TensorFlow's stateless random numbers in NumPy,
so both routes give the same batches and a run can resume on either (`make_dataset`'s
shuffle is the exception: its NumPy order is its own). Without TensorFlow a tf.data route
raises an ImportError naming its `as_numpy` route; where TensorFlow is installed beside JAX
(`tensorflow-cpu`), the tf.data routes feed Keras's JAX `fit` too. Decoding Omniglot's
PNGs needs TensorFlow (`load_omniglot` reads its cache without it).

Our experiments' task builders and pipelines (WordNet, Django catalogs, translation,
prompted tasks, the small T5 and its pre-training, the MiniLM encoder, the synthetic
problems) are not library code: they live in the repository's `trainers/experiments/`."""

from tf_metaalign._exports import missing_attribute, unavailable

try:
    from tf_metaalign.data import episodes
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.episodes", ["episodes"])
try:
    from tf_metaalign.data import meta_batches
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.meta_batches", ["meta_batches"])
try:
    from tf_metaalign.data import multitask
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.multitask", ["multitask"])
try:
    from tf_metaalign.data import omniglot
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.omniglot", ["omniglot"])
try:
    from tf_metaalign.data import sinusoid
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.sinusoid", ["sinusoid"])
try:
    from tf_metaalign.data.digits import (
        load_digits,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.digits", ["load_digits"])
try:
    from tf_metaalign.data.episodes import (
        EpisodeSampler,
        mean_confidence_interval,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.data.episodes",
        ["EpisodeSampler", "mean_confidence_interval"],
    )
try:
    from tf_metaalign.data.meta_batches import (
        stack_task,
        stacked_batches,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(), _error, "tf_metaalign.data.meta_batches", ["stack_task", "stacked_batches"]
    )
try:
    from tf_metaalign.data.multitask import (
        MultiTaskStream,
        PerTaskHead,
        model_inputs,
        one_head_per_task_model,
        task_ids,
        task_probabilities,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.data.multitask",
        [
            "MultiTaskStream",
            "PerTaskHead",
            "model_inputs",
            "one_head_per_task_model",
            "task_ids",
            "task_probabilities",
        ],
    )
try:
    from tf_metaalign.data.omniglot import (
        augment_rotations,
        evaluate_official_runs,
        load_official_runs,
        load_omniglot,
        official_runs_dataset,
        split_classes,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.data.omniglot",
        [
            "augment_rotations",
            "evaluate_official_runs",
            "load_official_runs",
            "load_omniglot",
            "official_runs_dataset",
            "split_classes",
        ],
    )
try:
    from tf_metaalign.data.splits import (
        Splits,
        make_dataset,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.splits", ["Splits", "make_dataset"])
try:
    from tf_metaalign.data.tfds import (
        load_tfds,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data.tfds", ["load_tfds"])

__all__ = [
    "episodes",
    "meta_batches",
    "multitask",
    "omniglot",
    "sinusoid",
    "MultiTaskStream",
    "PerTaskHead",
    "model_inputs",
    "one_head_per_task_model",
    "task_ids",
    "task_probabilities",
    "EpisodeSampler",
    "mean_confidence_interval",
    "stack_task",
    "stacked_batches",
    "load_digits",
    "load_omniglot",
    "split_classes",
    "augment_rotations",
    "load_official_runs",
    "evaluate_official_runs",
    "official_runs_dataset",
    "load_tfds",
    "Splits",
    "make_dataset",
]
__getattr__ = missing_attribute(globals(), "tf_metaalign.data")
