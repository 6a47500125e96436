"""P3 by name, from a local copy (there is no network here).

P3 (the Public Pool of Prompts; Sanh et al., "Multitask Prompted Training Enables Zero-Shot
Task Generalization", ICLR 2022) is what T0 and Wu et al., "Continued Pretraining for Better
Zero- and Few-Shot Promptability" (EMNLP 2022) continue pre-training on and evaluate with.
It lives on the Hugging Face hub as `bigscience/P3`, one folder per dataset-template pair
(`data/<name>/<split>.tfrecord-*`, e.g. `super_glue_rte_GPT_3_style`): `load_p3` reads a
local copy and otherwise raises `P3NotAvailableError` saying where it looked and what to use
instead (`trainers.experiments.prompted_tasks.offline_prompted_tasks`, P3-like tasks built
offline); `p3_prompted_examples` turns its records into `PromptedExample`s.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Mapping, Sequence

from tf_metaalign.prompts.templates import PromptedExample

__all__ = [
    "P3_REPOSITORY",
    "P3_EXAMPLE_NAMES",
    "P3NotAvailableError",
    "load_p3",
    "p3_prompted_examples",
]

P3_REPOSITORY = "bigscience/P3"
#: A few real P3 dataset-template names (held-out evaluation sets of T0 and of Wu et al.).
P3_EXAMPLE_NAMES = (
    "super_glue_rte_GPT_3_style",
    "super_glue_cb_GPT_3_style",
    "anli_GPT_3_style_r1",
    "super_glue_copa_best_option",
    "super_glue_wic_GPT_3_prompt",
    "super_glue_wsc.fixed_GPT_3_Style",
    "winogrande_winogrande_xl_fill_in_the_blank",
    "hellaswag_Predict_ending_with_hint",
    "story_cloze_2016_Answer_Given_options",
)
_P3_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class P3NotAvailableError(FileNotFoundError):
    """No local copy of the requested P3 dataset, and nothing is downloaded."""


def _p3_roots(data_dir) -> list[str]:
    roots = [str(data_dir)] if data_dir is not None else []
    if os.environ.get("P3_DATA_DIR"):
        roots.append(os.environ["P3_DATA_DIR"])
    return roots


def load_p3(
    name: str, split: str = "validation", data_dir: str | os.PathLike | None = None
) -> list[dict]:
    """The records of one P3 dataset-template pair, read from a local copy of P3.

    Args:
      name: the P3 name, e.g. "super_glue_rte_GPT_3_style" (`P3_EXAMPLE_NAMES`).
      split: "train", "validation" or "test" (file prefix in P3's folders).
      data_dir: a local copy of the `bigscience/P3` dataset repository (the folder that
        holds `data/`); default `$P3_DATA_DIR`. Get one on a machine with network access:
        `git lfs install && git clone https://huggingface.co/datasets/bigscience/P3`.

    Returns:
      one dict per record: every feature of the `tf.train.Example` (P3's
      `inputs_pretokenized`, `targets_pretokenized`, `answer_choices`, ... as str / list of
      str, token ids as lists of int). `p3_prompted_examples` turns them into
      `PromptedExample`s.

    Raises:
      ValueError: `name` or `split` is not a plausible P3 name.
      P3NotAvailableError: no local copy (nothing is ever downloaded: this project runs with
        no network). Use `offline_prompted_tasks()` for offline prompted tasks instead.
    """
    if not isinstance(name, str) or not _P3_NAME.match(name):
        raise ValueError(
            f"`name` must be a P3 dataset-template name such as "
            f"'super_glue_rte_GPT_3_style'; got {name!r}."
        )
    if split not in ("train", "validation", "test"):
        raise ValueError(f"`split` must be 'train', 'validation' or 'test'; got {split!r}.")
    tried = []
    for root in _p3_roots(data_dir):
        pattern = os.path.join(root, "data", name, f"{split}.tfrecord-*")
        tried.append(pattern)
        files = sorted(f for f in glob.glob(pattern) if not f.endswith(".json"))
        if files:
            return _read_examples(files)
    where = (
        ("; looked for " + ", ".join(tried))
        if tried
        else ("; no `data_dir` was given and $P3_DATA_DIR is not set")
    )
    raise P3NotAvailableError(
        f"P3 dataset {name!r} (split {split!r}) is not available offline{where}. P3 lives on "
        f"the Hugging Face hub as {P3_REPOSITORY!r} and this loader never downloads (there is "
        "no network at run time). On a machine with network access run `git lfs clone "
        "https://huggingface.co/datasets/bigscience/P3` and pass `data_dir=<that folder>` "
        "(or set P3_DATA_DIR); offline, use "
        "`trainers.experiments.prompted_tasks.offline_prompted_tasks()` instead."
    )


def _read_examples(files) -> list[dict]:
    import tensorflow as tf

    records = []
    for raw in tf.data.TFRecordDataset(files).as_numpy_iterator():
        example = tf.train.Example.FromString(raw)
        record = {}
        for key, feature in example.features.feature.items():
            kind = feature.WhichOneof("kind")
            values = list(getattr(feature, kind).value) if kind else []
            if kind == "bytes_list":
                values = [v.decode("utf-8") for v in values]
            # P3's text fields are single strings; answer_choices and token ids are lists.
            record[key] = (
                values[0]
                if kind == "bytes_list" and len(values) == 1 and key != "answer_choices"
                else values
            )
        records.append(record)
    return records


def p3_prompted_examples(records: Sequence[Mapping]) -> list[PromptedExample]:
    """P3 records -> `PromptedExample`s: input = `inputs_pretokenized`, target =
    `targets_pretokenized`, choices = `answer_choices` (when present), label = the index of
    the target among the choices (whitespace-stripped), else -1.

    (P3's "_score_eval" variants hold one row per answer choice with `is_correct`; use
    the plain variants, which carry `answer_choices`, for rank classification.)"""
    out = []
    for i, r in enumerate(records):
        if "inputs_pretokenized" not in r or "targets_pretokenized" not in r:
            raise ValueError(
                f"`records`[{i}] lacks inputs_pretokenized/targets_pretokenized; "
                f"its fields are {sorted(r)}."
            )
        target = str(r["targets_pretokenized"])
        choices = tuple(c.strip() for c in r.get("answer_choices", ()))
        label = choices.index(target.strip()) if target.strip() in choices else -1
        out.append(PromptedExample(str(r["inputs_pretokenized"]), target, choices, label))
    return out
