"""WordNet 3.0 gloss -> supersense (lexicographer file) classification, offline.

Needs the Debian/Ubuntu package `wordnet-base` (`apt-get install wordnet-base`), which
puts `data.{noun,verb,adj,adv}` in `/usr/share/wordnet`; or point `wordnet_dir` (or the
`WORDNET_DIR` environment variable) at any folder with those files (the "dict" folder of
the Princeton WordNet 3.0 distribution has the same layout).

Each synset line of a `data.<pos>` file reads::

    offset lex_filenum ss_type w_cnt word lex_id ... | gloss

The example is the gloss (the text after `|`), the label the lexicographer file number
(field 2): one of 45 supersenses (`SUPERSENSES`), e.g. `noun.animal`, `verb.motion`.
The parts of speech use disjoint supersenses: noun 26 classes, verb 15, adj 3, adv 1
(so an adverb-only task has a single class).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from tf_metaalign.data.splits import Splits, check_positive_int, stratified_split

DEFAULT_WORDNET_DIR = "/usr/share/wordnet"
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")

#: The 45 WordNet lexicographer files, by number (WordNet's `lexnames`).
SUPERSENSES = (
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
)
NUM_SUPERSENSES = len(SUPERSENSES)


class WordNetNotFoundError(FileNotFoundError):
    """The WordNet data files are missing."""


def wordnet_dir(wordnet_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding `data.<pos>`: `wordnet_dir`, else $WORDNET_DIR, else the apt path."""
    path = Path(wordnet_dir or os.environ.get("WORDNET_DIR") or DEFAULT_WORDNET_DIR)
    return path


def _check_pos(parts_of_speech) -> tuple[str, ...]:
    if isinstance(parts_of_speech, str):
        parts_of_speech = (parts_of_speech,)
    parts_of_speech = tuple(parts_of_speech)
    if not parts_of_speech:
        raise ValueError(f"`parts_of_speech` is empty; give some of {PARTS_OF_SPEECH}.")
    for pos in parts_of_speech:
        if pos not in PARTS_OF_SPEECH:
            raise ValueError(f"`parts_of_speech` must be among {PARTS_OF_SPEECH}; got {pos!r}.")
    return parts_of_speech


def read_synsets(pos: str, wordnet_dir_: str | os.PathLike | None = None):
    """All synsets of one part of speech: `(glosses, supersense_ids, lemmas)` lists.

    `lemmas` are each synset's first word (underscores replaced by spaces).
    """
    (pos,) = _check_pos(pos)
    folder = wordnet_dir(wordnet_dir_)
    path = folder / f"data.{pos}"
    if not path.is_file():
        raise WordNetNotFoundError(
            f"WordNet file {path} not found (argument `wordnet_dir`={str(folder)!r}). "
            "Install it with `apt-get install wordnet-base`, or pass `wordnet_dir` / set "
            "WORDNET_DIR to a folder holding data.noun, data.verb, data.adj, data.adv."
        )
    glosses, labels, lemmas = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  "):  # licence header
                continue
            head, sep, gloss = line.partition(" | ")
            if not sep:
                continue
            fields = head.split()
            glosses.append(gloss.strip())
            labels.append(int(fields[1]))
            lemmas.append(fields[4].replace("_", " "))
    if not glosses:
        raise WordNetNotFoundError(f"No synsets parsed from {path}: is it a WordNet data file?")
    return glosses, labels, lemmas


def load_wordnet_supersenses(
    parts_of_speech: Sequence[str] | str = PARTS_OF_SPEECH,
    test_fraction: float = 0.2,
    seed: int = 0,
    max_examples: int | None = None,
    include_lemma: bool = False,
    relabel: bool = False,
    wordnet_dir: str | os.PathLike | None = None,
) -> Splits:
    """Gloss -> supersense classification, split stratified with a fixed `seed`.

    Args:
      parts_of_speech: which `data.<pos>` files to read (default: all four, 117,659
        synsets, 45 classes).
      test_fraction: fraction of each class held out.
      seed: seed of the subsample and the split.
      max_examples: if given, a stratified random subsample of about this many synsets
        (before the split), drawn with `seed`.
      include_lemma: prefix each gloss with the synset's first word ("dog: a member of...").
      relabel: number the classes present 0..k-1 (e.g. 15 for verbs) instead of using the
        45 global supersense ids.
      wordnet_dir: folder with the data files (default $WORDNET_DIR or /usr/share/wordnet).

    Returns:
      `Splits` whose `x` are numpy arrays of python strings and `y` int32 labels.
    """
    parts = _check_pos(parts_of_speech)
    texts, labels = [], []
    for pos in parts:
        g, l, w = read_synsets(pos, wordnet_dir)
        if include_lemma:
            g = [f"{lemma}: {gloss}" for lemma, gloss in zip(w, g)]
        texts.extend(g)
        labels.extend(l)
    texts = np.array(texts, dtype=object)
    labels = np.array(labels, dtype=np.int32)
    if max_examples is not None:
        max_examples = check_positive_int(max_examples, "max_examples")
        if max_examples < len(labels):
            # Stratified: every class keeps about max_examples/len(labels) of its synsets
            # (at least one), so the result holds about max_examples (per-class rounding).
            keep, _ = stratified_split(labels, 1.0 - max_examples / len(labels), seed)
            keep = np.sort(keep)
            texts, labels = texts[keep], labels[keep]
    if relabel:
        present = np.unique(labels)
        names = [SUPERSENSES[i] for i in present]
        labels = np.searchsorted(present, labels).astype(np.int32)
    else:
        names = list(SUPERSENSES)
    train, test = stratified_split(labels, test_fraction, seed)
    return Splits(
        x_train=texts[train],
        y_train=labels[train],
        x_test=texts[test],
        y_test=labels[test],
        num_classes=len(names),
        class_names=names,
        name="wordnet_" + "+".join(parts),
    )


def wordnet_tasks(
    test_fraction: float = 0.2,
    seed: int = 0,
    max_examples: int | None = None,
    relabel: bool = True,
    wordnet_dir=None,
) -> dict[str, Splits]:
    """One task per part of speech: `{"noun": Splits, "verb": ..., "adj": ..., "adv": ...}`.

    With `relabel=True` each task numbers its own classes (noun 26, verb 15, adj 3, adv 1).
    """
    return {
        pos: load_wordnet_supersenses(
            pos,
            test_fraction=test_fraction,
            seed=seed,
            max_examples=max_examples,
            relabel=relabel,
            wordnet_dir=wordnet_dir,
        )
        for pos in PARTS_OF_SPEECH
    }
