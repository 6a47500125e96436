"""A real multilingual multi-task text classification set, offline: Django's catalogs.

`pip install django` ships gettext catalogs of its user-interface strings in ~99 languages,
one catalog per part of Django (`django/conf/locale/<lang>/...` for the core,
`django/contrib/<app>/locale/<lang>/...` for each contrib app). The task of a language:
given a translated UI string, say which part of Django it belongs to (the catalog's path).
One language = one task, all tasks share the label set, sizes are imbalanced (about 790
strings for the best-covered languages, under 200 for lb, my, am), and the MiniLM
tokenizer's English WordPiece vocabulary fits some scripts far better than others.

Labels. The 12 catalogs are very unequal (the core has ~330 strings per language; sessions
and sites have 6), so by default the five smallest apps are merged into one class
"other": 8 classes (`DEFAULT_LABELS`). Pass `labels=COMPONENTS` for the 12 raw ones.

Splits. `component_tasks` splits by the ENGLISH source string (msgid), once for all
languages: a test string's translation in any language is never trained on, so neither a
task's held-out score nor a zero-shot score on an unseen language can come from having
seen the same message in another language. An English msgid found in catalogs of two
different classes (e.g. "Delete" in both admin and core) is ambiguous and dropped
(`DjangoTasks.dropped_ambiguous` counts them).
"""

from __future__ import annotations

import dataclasses
import glob
import gettext
import hashlib
import os
from typing import Mapping, Sequence

import numpy as np

from trainers.experiments.translation import django_locale_root

#: The catalogs, as paths under the `django` package, in a fixed order.
COMPONENTS = (
    "conf",
    "contrib/admin",
    "contrib/admindocs",
    "contrib/auth",
    "contrib/contenttypes",
    "contrib/flatpages",
    "contrib/gis",
    "contrib/humanize",
    "contrib/postgres",
    "contrib/redirects",
    "contrib/sessions",
    "contrib/sites",
)

#: The default 8 classes: the seven largest catalogs and "other" (the five smallest apps,
#: 6 to 19 strings each per language).
DEFAULT_LABELS = {
    "core": ("conf",),
    "admin": ("contrib/admin",),
    "admindocs": ("contrib/admindocs",),
    "auth": ("contrib/auth",),
    "gis": ("contrib/gis",),
    "humanize": ("contrib/humanize",),
    "postgres": ("contrib/postgres",),
    "other": (
        "contrib/contenttypes",
        "contrib/flatpages",
        "contrib/redirects",
        "contrib/sessions",
        "contrib/sites",
    ),
}


def available_languages(root: str | None = None) -> list[str]:
    """Every language with at least one Django catalog, sorted."""
    root = root or django_locale_root()
    pattern = os.path.join(root, "**", "locale", "*", "LC_MESSAGES", "django.mo")
    return sorted({p.split(os.sep)[-3] for p in glob.glob(pattern, recursive=True)})


def load_component_strings(lang: str, root: str | None = None):
    """`[(english, translation, component), ...]` of one language, in a fixed order.

    Plural entries (tuple keys) and empty translations are skipped; message contexts
    ("context\\x04msgid") are stripped from the English side.
    """
    root = root or django_locale_root()
    rows = []
    for component in COMPONENTS:
        path = os.path.join(root, *component.split("/"), "locale", lang, "LC_MESSAGES", "django.mo")
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        for src, tgt in sorted((k, v) for k, v in catalog.items() if isinstance(k, str)):
            src = src.split("\x04", 1)[-1].strip()
            tgt = tgt.strip() if isinstance(tgt, str) else ""
            if src and tgt:
                rows.append((src, tgt, component))
    if not rows:
        raise ValueError(
            f"No Django catalog strings for language {lang!r} under {root}; available: "
            f"{', '.join(available_languages(root))}."
        )
    return rows


@dataclasses.dataclass
class DjangoTasks:
    """One task per language. `train[lang]` / `test[lang]` are `(texts, labels)` with
    `texts` a list of str and `labels` int32 indices into `class_names`; `train_msgids` /
    `test_msgids[lang]` the English source string of each text."""

    class_names: tuple
    train: dict
    test: dict
    dropped_ambiguous: int
    train_msgids: dict
    test_msgids: dict

    def sizes(self, split: str = "train") -> dict:
        return {lang: len(texts) for lang, (texts, _) in getattr(self, split).items()}


def _test_msgid(msgid: str, test_fraction: float, seed: int) -> bool:
    # A hash of (seed, msgid): the same English string falls in the same split for every
    # language and every run, whatever languages are loaded.
    digest = hashlib.sha256(f"{seed}\x00{msgid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < test_fraction


def component_tasks(
    languages: Sequence[str],
    test_fraction: float = 0.25,
    seed: int = 0,
    labels: Mapping[str, Sequence[str]] | Sequence[str] | None = None,
    root: str | None = None,
    min_train: int = 1,
) -> DjangoTasks:
    """Django's catalogs as `DjangoTasks`: translated UI string -> the part of Django.

    Args:
      languages: catalog language codes (`available_languages()`), one task each.
      test_fraction: share of English msgids held out (the same ones for every language).
      seed: seed of the msgid split.
      labels: class name -> catalogs (default `DEFAULT_LABELS`), or a sequence of catalogs
        (one class each, e.g. `COMPONENTS`).
      min_train: a language with fewer training strings raises.
    """
    if isinstance(languages, str) or not languages:
        raise ValueError(
            f"`languages` must be a non-empty sequence of language codes; got {languages!r}."
        )
    if len(set(languages)) != len(languages):
        raise ValueError(f"`languages` has duplicates: {list(languages)!r}.")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1); got {test_fraction!r}.")
    labels = DEFAULT_LABELS if labels is None else labels
    if not isinstance(labels, Mapping):
        labels = {c: (c,) for c in labels}
    class_of = {}
    for index, (name, catalogs) in enumerate(labels.items()):
        for catalog in catalogs:
            if catalog not in COMPONENTS:
                raise ValueError(
                    f"`labels`[{name!r}] names an unknown catalog {catalog!r}; known: {COMPONENTS}."
                )
            if catalog in class_of:
                raise ValueError(f"`labels`: catalog {catalog!r} is in two classes.")
            class_of[catalog] = index
    rows = {lang: load_component_strings(lang, root) for lang in languages}
    # An English msgid in catalogs of two classes (in any loaded language) is ambiguous.
    seen: dict[str, set] = {}
    for lang_rows in rows.values():
        for src, _, component in lang_rows:
            if component in class_of:
                seen.setdefault(src, set()).add(class_of[component])
    ambiguous = {src for src, classes in seen.items() if len(classes) > 1}
    train, test, msgids = {}, {}, {"train": {}, "test": {}}
    for lang, lang_rows in rows.items():
        parts = {"train": ([], [], []), "test": ([], [], [])}
        done = set()
        for src, tgt, component in lang_rows:
            if component not in class_of or src in ambiguous or src in done:
                continue
            done.add(src)
            split = "test" if _test_msgid(src, test_fraction, seed) else "train"
            parts[split][0].append(tgt)
            parts[split][1].append(class_of[component])
            parts[split][2].append(src)
        if len(parts["train"][0]) < min_train or not parts["test"][0]:
            raise ValueError(
                f"Language {lang!r} has {len(parts['train'][0])} training and "
                f"{len(parts['test'][0])} test strings (min_train={min_train})."
            )
        train[lang] = (parts["train"][0], np.asarray(parts["train"][1], np.int32))
        test[lang] = (parts["test"][0], np.asarray(parts["test"][1], np.int32))
        msgids["train"][lang], msgids["test"][lang] = parts["train"][2], parts["test"][2]
    return DjangoTasks(tuple(labels), train, test, len(ambiguous), msgids["train"], msgids["test"])
