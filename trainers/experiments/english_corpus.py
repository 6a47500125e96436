"""An offline English corpus for pre-training small language models (the small T5 of
`trainers.experiments.small_t5`, the small GPT-2 of `.small_gpt2`): WordNet 3.0's glosses and
example sentences and Django's English UI strings.

  english_corpus        the de-duplicated texts in a fixed order (`CORPUS_SOURCES`)
  split_wordnet_gloss   a gloss -> (definition, example sentences)
  corpus_statistics     texts / words / characters of a corpus
  corpus_hash           a SHA-256 of the texts (the cache keys of vocabularies and models)
"""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

from tf_metaalign.data.splits import check_positive_int

CORPUS_SOURCES = ("wordnet_definitions", "wordnet_examples", "django_msgids")
#: Django languages whose catalogs give the English msgids (the msgids are the same English
#: source strings in every language; the union of these well-covered ones holds nearly all).
DJANGO_MSGID_LANGUAGES = ("de", "fr", "es", "it", "nl", "pt_BR", "ru", "ja")

_QUOTED = re.compile(r'"([^"]+)"')


def split_wordnet_gloss(gloss: str) -> tuple[str, list[str]]:
    """A WordNet gloss -> (definition, example sentences).

    A gloss reads `definition; "example one"; "example two"` (wndb(5WN)): the examples are
    the double-quoted parts, the definition what comes before the first quote.
    """
    definition = gloss.split('"', 1)[0].strip().rstrip(";").strip()
    examples = [e.strip() for e in _QUOTED.findall(gloss) if e.strip()]
    return definition, examples


def english_corpus(
    sources: Sequence[str] = CORPUS_SOURCES,
    include_lemma: bool = True,
    max_texts: int | None = None,
    seed: int = 0,
    wordnet_dir=None,
    django_languages: Sequence[str] = DJANGO_MSGID_LANGUAGES,
) -> list[str]:
    """An offline English corpus: a de-duplicated list of strings in a fixed order.

    Sources (`CORPUS_SOURCES`):
      "wordnet_definitions": every WordNet 3.0 synset's definition (117,659 synsets, via
          `trainers.experiments.wordnet.read_synsets`), as "lemma: definition" with
          `include_lemma`;
      "wordnet_examples": the quoted example sentences of the glosses;
      "django_msgids": Django's English UI strings (the msgids of its gettext catalogs,
          via `trainers.experiments.django_catalogs.load_component_strings`).
    Texts keep source order (parts of speech noun, verb, adj, adv; file order); duplicates
    keep their first occurrence. `max_texts` keeps a random subset of that size drawn with
    `seed` (in corpus order). With all sources (measured): 166,621 texts, 1,613,876 words,
    10.0M characters (`corpus_statistics`); about 2.8M ids with a 4,000-piece vocabulary.
    """
    if isinstance(sources, str):
        sources = (sources,)
    sources = tuple(sources)
    unknown = [s for s in sources if s not in CORPUS_SOURCES]
    if not sources or unknown:
        raise ValueError(
            f"`sources` must be a non-empty subset of {CORPUS_SOURCES}; got {sources!r}."
        )
    texts: list[str] = []
    if "wordnet_definitions" in sources or "wordnet_examples" in sources:
        from trainers.experiments.wordnet import PARTS_OF_SPEECH, read_synsets

        for pos in PARTS_OF_SPEECH:
            glosses, _, lemmas = read_synsets(pos, wordnet_dir)
            for gloss, lemma in zip(glosses, lemmas):
                definition, examples = split_wordnet_gloss(gloss)
                if "wordnet_definitions" in sources and definition:
                    texts.append(f"{lemma}: {definition}" if include_lemma else definition)
                if "wordnet_examples" in sources:
                    texts.extend(examples)
    if "django_msgids" in sources:
        from trainers.experiments.django_catalogs import load_component_strings

        for lang in django_languages:
            texts.extend(src for src, _, _ in load_component_strings(lang))
    texts = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    if max_texts is not None:
        max_texts = check_positive_int(max_texts, "max_texts")
        if max_texts < len(texts):
            keep = np.sort(np.random.default_rng(seed).choice(len(texts), max_texts, replace=False))
            texts = [texts[i] for i in keep]
    return texts


def corpus_statistics(texts: Sequence[str]) -> dict:
    """`{"texts", "words" (whitespace-separated), "characters"}` of a corpus."""
    return {
        "texts": len(texts),
        "words": sum(len(t.split()) for t in texts),
        "characters": sum(len(t) for t in texts),
    }


def corpus_hash(texts: Sequence[str]) -> str:
    """A SHA-256 of the texts (order matters), for cache keys."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()
