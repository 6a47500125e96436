"""Offline datasets: loaders returning numpy splits / `tf.data.Dataset`s with fixed seeds.

  load_digits               scikit-learn's 8x8 digits (1,797 images, 10 classes)
  load_wordnet_supersenses  WordNet gloss -> supersense (45 classes; `apt-get install wordnet-base`)
  wordnet_tasks             one WordNet task per part of speech
  text_encoder              the pretrained all-MiniLM-L6-v2 encoder through keras-hub, offline
  load_tfds                 a TFDS dataset already on disk (never downloads)
  translation               Django's gettext catalogs as English -> X translation pairs
  django_catalogs           Django's catalogs as multilingual tasks (UI string -> part of Django)
  multitask                 multi-task batches (p_t ∝ N_t^q), deterministic and resumable
  episodes                  N-way K-shot episodes with a task dimension, deterministic and resumable
  meta_batches              stacked [k, B, ...] elements for ReptileTrainer / FOMAMLTrainer
  omniglot                  Omniglot from the official zips (cached), class splits, rotations,
                            Lake's 20 runs of 20-way 1-shot
"""
from tf_metaalign.data.digits import load_digits
from tf_metaalign.data.splits import Splits, make_dataset
from tf_metaalign.data.tfds import load_tfds
from tf_metaalign.data.wordnet import (
    SUPERSENSES,
    load_wordnet_supersenses,
    wordnet_tasks,
)
from tf_metaalign.data import django_catalogs, multitask, text_encoder, translation
from tf_metaalign.data.multitask import (
    MultiTaskStream,
    model_inputs,
    one_head_per_task_model,
    task_ids,
    task_probabilities,
)

__all__ = [
    "Splits", "make_dataset", "load_digits", "load_wordnet_supersenses", "wordnet_tasks",
    "SUPERSENSES", "text_encoder", "load_tfds", "translation",
    "django_catalogs", "multitask", "MultiTaskStream", "task_probabilities", "model_inputs", "task_ids",
    "one_head_per_task_model",
]
# Few-shot episodes (N-way K-shot, deterministic and resumable) and Omniglot.
from tf_metaalign.data import episodes, omniglot  # noqa: E402
from tf_metaalign.data.episodes import EpisodeSampler, mean_confidence_interval  # noqa: E402
from tf_metaalign.data.omniglot import (  # noqa: E402
    augment_rotations,
    evaluate_official_runs,
    load_official_runs,
    load_omniglot,
    official_runs_dataset,
    split_classes,
)

__all__ += [
    "episodes", "omniglot", "EpisodeSampler", "mean_confidence_interval", "load_omniglot",
    "split_classes", "augment_rotations", "load_official_runs", "evaluate_official_runs",
    "official_runs_dataset",
]

# Stacked [k, B, ...] elements (ReptileTrainer / FOMAMLTrainer) from a task sampler.
from tf_metaalign.data import meta_batches  # noqa: E402
from tf_metaalign.data.meta_batches import stack_task, stacked_batches  # noqa: E402

__all__ += ["meta_batches", "stack_task", "stacked_batches"]

from tf_metaalign.data import prompted_tasks, small_t5, text_pretraining  # noqa: E402

__all__ += ["prompted_tasks", "small_t5", "text_pretraining"]
