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

Our experiments' task builders and pipelines (WordNet, Django catalogs, translation,
prompted tasks, the small T5 and its pre-training, the MiniLM encoder, the synthetic
problems) are not library code: they live in the repository's `trainers/experiments/`.
"""

from tf_metaalign._exports import export, missing_attribute

_PACKAGE = "tf_metaalign.data"
_MODULES = ["episodes", "meta_batches", "multitask", "omniglot", "sinusoid"]
_EXPORTS = {
    "tf_metaalign.data.digits": ["load_digits"],
    "tf_metaalign.data.episodes": ["EpisodeSampler", "mean_confidence_interval"],
    "tf_metaalign.data.meta_batches": ["stack_task", "stacked_batches"],
    "tf_metaalign.data.multitask": [
        "MultiTaskStream",
        "PerTaskHead",
        "model_inputs",
        "one_head_per_task_model",
        "task_ids",
        "task_probabilities",
    ],
    "tf_metaalign.data.omniglot": [
        "augment_rotations",
        "evaluate_official_runs",
        "load_official_runs",
        "load_omniglot",
        "official_runs_dataset",
        "split_classes",
    ],
    "tf_metaalign.data.splits": ["Splits", "make_dataset"],
    "tf_metaalign.data.tfds": ["load_tfds"],
}
for _name in _MODULES:
    export(globals(), f"{_PACKAGE}.{_name}", as_module=_name)
for _module, _names in _EXPORTS.items():
    export(globals(), _module, _names)

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
__getattr__ = missing_attribute(globals(), _PACKAGE)
