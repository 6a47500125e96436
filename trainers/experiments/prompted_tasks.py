"""Offline prompted tasks: P3-like prompted datasets built from the sources of
../shared/DATA.md, split by task type as P3 / T0 split them.

P3 itself (Sanh et al., ICLR 2022; what T0 and Wu et al., EMNLP 2022 continue pre-training
on and evaluate with) is not here: `trainers.experiments.p3.load_p3` reads a local copy of
it. The offline substitute (`offline_prompted_tasks`) builds prompted datasets from WordNet
3.0 and Django's gettext catalogs (through the loaders `trainers.experiments.wordnet` and
`.django_catalogs`), 2-3 templates each, and splits them as P3/T0 do: whole TASK TYPES are
held out (T0 trains on e.g. QA, sentiment, topic classification and evaluates on NLI,
coreference, sentence completion, word sense).

  type            datasets                                         split
  supersense      wordnet_noun_supersense (26-way),                training
                  wordnet_verb_supersense (15-way)
  component       django_component_en, django_component_de (8-way) training
  language_id     django_language_id (6-way)                       training
  part_of_speech  wordnet_noun_or_verb, wordnet_adj_or_adv (2-way)  evaluation (unseen)
  matching        wordnet_gloss_match, django_translation_match     evaluation (unseen)
                  (yes/no: does this gloss define this word / is this the translation)

Leakage: the WordNet tasks share one synset-level train/test split (a test synset of one
task is a test synset of every task); the Django tasks share `component_tasks`'s split by
English msgid (a test string is never trained on, in any language or task).

The training datasets are mixed for continued pre-training by
`trainers.experiments.prompted_mixture.PromptedMixture` (T5's examples-proportional
mixing with an artificial limit).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

import numpy as np

from tf_metaalign.data.splits import check_fraction, check_positive_int
from tf_metaalign.prompts.templates import Template

__all__ = [
    "PromptedDataset",
    "TASK_TYPES",
    "TRAINING_TASK_TYPES",
    "EVALUATION_TASK_TYPES",
    "offline_prompted_tasks",
    "split_by_task_type",
]


#: task type -> what it asks.
TASK_TYPES = {
    "supersense": "WordNet gloss -> semantic category (lexicographer file)",
    "component": "Django UI string -> the part of Django it comes from",
    "language_id": "translated Django UI string -> its language",
    "part_of_speech": "WordNet gloss -> the part of speech of the word it defines",
    "matching": "yes/no: does a gloss define a word / is a string the translation of another",
}
TRAINING_TASK_TYPES = ("supersense", "component", "language_id")
EVALUATION_TASK_TYPES = ("part_of_speech", "matching")


@dataclasses.dataclass
class PromptedDataset:
    """One dataset: raw examples (dicts of fields, `label` the right choice) and templates.

    All templates of a dataset have the same number of answer choices (`num_choices`),
    so that its chance accuracy is `1 / num_choices` (for ARG).
    """

    name: str
    task_type: str
    templates: tuple
    train: list
    test: list
    num_choices: int

    def prompted(self, split: str = "train", template: str | None = None):
        """`{template name: [PromptedExample]}` of a split, or one template's list."""
        if split not in ("train", "test"):
            raise ValueError(f"`split` must be 'train' or 'test'; got {split!r}.")
        names = [t.name for t in self.templates]
        if template is not None and template not in names:
            raise ValueError(
                f"`template`={template!r} is not a template of {self.name!r}; "
                f"its templates are {names}."
            )
        examples = getattr(self, split)
        chosen = [t for t in self.templates if template in (None, t.name)]
        out = {t.name: [t.apply(e) for e in examples] for t in chosen}
        return out[template] if template is not None else out

    def __repr__(self):
        return (
            f"PromptedDataset({self.name!r}, type={self.task_type!r}, "
            f"train={len(self.train)}, test={len(self.test)}, "
            f"choices={self.num_choices}, templates={[t.name for t in self.templates]})"
        )


def _subsample(rows: list, limit: int, rng: np.random.Generator) -> list:
    if len(rows) <= limit:
        return list(rows)
    return [rows[i] for i in np.sort(rng.choice(len(rows), limit, replace=False))]


def _wordnet_split(wordnet_dir, test_fraction, seed):
    """`{pos: (train_synsets, test_synsets)}`, each a list of (gloss, lexname, word)."""
    from trainers.experiments.wordnet import PARTS_OF_SPEECH, SUPERSENSES, read_synsets

    out = {}
    for k, pos in enumerate(PARTS_OF_SPEECH):
        glosses, labels, lemmas = read_synsets(pos, wordnet_dir)
        rows = [(g, SUPERSENSES[l], w) for g, l, w in zip(glosses, labels, lemmas)]
        order = np.random.default_rng([seed, 7, k]).permutation(len(rows))
        n_test = int(round(test_fraction * len(rows)))
        out[pos] = (
            [rows[i] for i in np.sort(order[n_test:])],
            [rows[i] for i in np.sort(order[:n_test])],
        )
    return out


def _category(lexname: str) -> str:
    # "noun.animal" -> "animal"; "noun.Tops" -> "top concept"
    name = lexname.split(".", 1)[1]
    return "top concept" if name == "Tops" else name


def _supersense_dataset(pos, split, limits, rng) -> PromptedDataset:
    train_rows, test_rows = split[pos]
    classes = sorted({r[1] for r in train_rows + test_rows})
    choices = [_category(c) for c in classes]
    options = ", ".join(choices)
    kind = {"noun": "a thing", "verb": "an action or event"}[pos]

    def rows(source, limit):
        picked = _subsample(source, limit, rng)
        return [
            {"gloss": g, "word": w, "options": options, "label": classes.index(c)}
            for g, c, w in picked
        ]

    templates = (
        Template(
            "category_of_definition",
            f"Which semantic category does this definition of {kind} belong to? {{gloss}}",
            choices,
        ),
        Template("word_and_definition", "{word}: {gloss}\nSemantic category:", choices),
        Template(
            "options_listed", "Definition: {gloss}\nPick its category among: {options}.", choices
        ),
    )
    return PromptedDataset(
        f"wordnet_{pos}_supersense",
        "supersense",
        templates,
        rows(train_rows, limits[0]),
        rows(test_rows, limits[1]),
        len(choices),
    )


def _two_pos_dataset(name, pos_pair, split, limits, rng, templates) -> PromptedDataset:
    def rows(part, limit):
        per_class = [_subsample(split[p][part], limit // 2, rng) for p in pos_pair]
        out = [
            {"gloss": g, "word": w, "label": label}
            for label, picked in enumerate(per_class)
            for g, _, w in picked
        ]
        return [out[i] for i in rng.permutation(len(out))]

    return PromptedDataset(
        name, "part_of_speech", templates, rows(0, limits[0]), rows(1, limits[1]), 2
    )


def _gloss_match_dataset(split, limits, rng) -> PromptedDataset:
    def rows(part, limit):
        pool = [r for pos in ("noun", "verb", "adj") for r in split[pos][part]]
        picked = _subsample(pool, limit, rng)
        out = []
        for i, (gloss, _, word) in enumerate(picked):
            match = i % 2 == 0  # balanced yes/no
            if not match:  # another synset's gloss, whose first word differs
                j = int(rng.integers(len(pool)))
                while pool[j][2] == word:
                    j = int(rng.integers(len(pool)))
                gloss = pool[j][0]
            out.append({"gloss": gloss, "word": word, "label": int(match)})
        return out

    yes_no = ["no", "yes"]
    templates = (
        Template("does_it_define", 'Does "{gloss}" define the word "{word}"?', yes_no),
        Template(
            "dictionary_entry", "Dictionary entry: {word} - {gloss}\nIs this entry correct?", yes_no
        ),
        Template("true_false", '"{word}" means: {gloss}. True or false?', ["false", "true"]),
    )
    return PromptedDataset(
        "wordnet_gloss_match", "matching", templates, rows(0, limits[0]), rows(1, limits[1]), 2
    )


#: Language code -> English name, for the Django language tasks.
LANGUAGE_NAMES = {
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "it": "Italian",
    "nl": "Dutch",
    "pt": "Portuguese",
}
#: Django's default classes (`django_catalogs.DEFAULT_LABELS`) -> answer choices.
COMPONENT_CHOICES = {
    "core": "core",
    "admin": "admin",
    "admindocs": "admin documentation",
    "auth": "authentication",
    "gis": "GIS",
    "humanize": "humanize",
    "postgres": "PostgreSQL",
    "other": "other apps",
}


def _django_datasets(languages, limits, seed, rng, root) -> list[PromptedDataset]:
    from trainers.experiments.django_catalogs import component_tasks

    tasks = component_tasks(list(languages), seed=seed, root=root)
    choices = [COMPONENT_CHOICES[c] for c in tasks.class_names]
    first = languages[0]
    component_templates = (
        Template("which_part", "Which part of Django does this string come from? {text}", choices),
        Template("ui_string", 'Django user-interface string: "{text}"\nComponent:', choices),
    )
    names = [LANGUAGE_NAMES.get(lang, lang) for lang in languages]

    def component_rows(part, english, limit):
        texts, labels = getattr(tasks, part)[first]
        msgids = (tasks.train_msgids if part == "train" else tasks.test_msgids)[first]
        rows = [
            {"text": m if english else t, "label": int(y)} for t, y, m in zip(texts, labels, msgids)
        ]
        return _subsample(rows, limit, rng)

    def language_rows(part, limit):
        rows = [
            {"text": t, "label": k}
            for k, lang in enumerate(languages)
            for t in getattr(tasks, part)[lang][0]
        ]
        return _subsample(rows, limit, rng)

    def translation_rows(part, limit):
        out = []
        for k, lang in enumerate(languages):
            texts = getattr(tasks, part)[lang][0]
            msgids = (tasks.train_msgids if part == "train" else tasks.test_msgids)[lang]
            for i, (text, msgid) in enumerate(zip(texts, msgids)):
                match = i % 2 == 0
                if not match:  # another string's translation in the same language
                    j = (i + 1 + int(rng.integers(len(texts) - 1))) % len(texts)
                    if texts[j] == text:
                        continue
                    text = texts[j]
                out.append(
                    {
                        "english": msgid,
                        "translation": text,
                        "language": names[k],
                        "label": int(match),
                    }
                )
        return _subsample(out, limit, rng)

    en_name = f"django_component_{first}"
    yes_no = ["no", "yes"]
    return [
        PromptedDataset(
            "django_component_en",
            "component",
            component_templates,
            component_rows("train", True, limits[0]),
            component_rows("test", True, limits[1]),
            len(choices),
        ),
        PromptedDataset(
            en_name,
            "component",
            (
                Template(
                    "which_part",
                    "Which part of Django does this translated string come from? {text}",
                    choices,
                ),
            )
            + component_templates[1:],
            component_rows("train", False, limits[0]),
            component_rows("test", False, limits[1]),
            len(choices),
        ),
        PromptedDataset(
            "django_language_id",
            "language_id",
            (
                Template("what_language", "What language is this? {text}", names),
                Template("language_suffix", "{text}\nLanguage:", names),
                Template(
                    "identify",
                    'Identify the language of this user-interface string: "{text}"',
                    names,
                ),
            ),
            language_rows("train", limits[0]),
            language_rows("test", limits[1]),
            len(names),
        ),
        PromptedDataset(
            "django_translation_match",
            "matching",
            (
                Template(
                    "is_translation",
                    'Is "{translation}" the {language} translation of "{english}"?',
                    yes_no,
                ),
                Template(
                    "same_meaning",
                    "English: {english}\n{language}: {translation}\nDo they mean the same?",
                    yes_no,
                ),
            ),
            translation_rows("train", limits[0]),
            translation_rows("test", limits[1]),
            2,
        ),
    ]


def offline_prompted_tasks(
    max_train: int = 1000,
    max_test: int = 200,
    seed: int = 0,
    sources: Sequence[str] = ("wordnet", "django"),
    languages: Sequence[str] = tuple(LANGUAGE_NAMES),
    wordnet_dir: str | os.PathLike | None = None,
    django_root: str | None = None,
    test_fraction: float = 0.2,
) -> dict[str, PromptedDataset]:
    """The offline prompted datasets (module docstring), `{name: PromptedDataset}`.

    Args:
      max_train, max_test: at most this many examples per dataset and split (a seeded
        subsample; the defaults keep building everything to a few seconds).
      seed: seed of the subsamples, the WordNet synset split, the Django msgid split and the
        negatives of the matching tasks.
      sources: "wordnet" (needs `apt-get install wordnet-base`) and/or "django" (needs
        `pip install django`); a missing source raises its loader's error.
      languages: Django catalogs for language identification and translation matching; the
        first also gives `django_component_<lang>`.
      test_fraction: WordNet's held-out share of synsets (Django's split is
        `component_tasks`'s, 25% of msgids).
    """
    max_train = check_positive_int(max_train, "max_train")
    max_test = check_positive_int(max_test, "max_test")
    test_fraction = check_fraction(test_fraction, "test_fraction")
    if isinstance(sources, str) or not sources or not set(sources) <= {"wordnet", "django"}:
        raise ValueError(
            f"`sources` must be a non-empty sequence of 'wordnet', 'django'; got {sources!r}."
        )
    if isinstance(languages, str) or len(languages) < 2 or len(set(languages)) != len(languages):
        raise ValueError(
            f"`languages` must be at least two distinct Django language codes; got {languages!r}."
        )
    rng = np.random.default_rng(seed)
    limits = (max_train, max_test)
    datasets = []
    if "wordnet" in sources:
        split = _wordnet_split(wordnet_dir, test_fraction, seed)
        datasets += [
            _supersense_dataset("noun", split, limits, rng),
            _supersense_dataset("verb", split, limits, rng),
        ]
        datasets.append(
            _two_pos_dataset(
                "wordnet_noun_or_verb",
                ("noun", "verb"),
                split,
                limits,
                rng,
                (
                    Template(
                        "noun_or_verb",
                        "Is this the definition of a noun or a verb? {gloss}",
                        ["noun", "verb"],
                    ),
                    Template(
                        "pos_suffix", "{gloss}\nPart of speech (noun or verb):", ["noun", "verb"]
                    ),
                    Template(
                        "thing_or_action",
                        'Does "{gloss}" describe a thing or an action?',
                        ["a thing", "an action"],
                    ),
                ),
            )
        )
        datasets.append(
            _two_pos_dataset(
                "wordnet_adj_or_adv",
                ("adj", "adv"),
                split,
                limits,
                rng,
                (
                    Template(
                        "adjective_or_adverb",
                        "Is this the definition of an adjective or an adverb? {gloss}",
                        ["adjective", "adverb"],
                    ),
                    Template(
                        "describes",
                        '"{gloss}" describes a...',
                        ["quality of a thing", "way of doing"],
                    ),
                ),
            )
        )
        datasets.append(_gloss_match_dataset(split, limits, rng))
    if "django" in sources:
        datasets += _django_datasets(tuple(languages), limits, seed, rng, django_root)
    return {d.name: d for d in datasets}


def split_by_task_type(
    datasets: Mapping[str, PromptedDataset], evaluation_types: Sequence[str] = EVALUATION_TASK_TYPES
):
    """`(training, evaluation)` dicts: the datasets of `evaluation_types` are held out whole
    (unseen task types, as T0 holds out NLI, coreference, ...), the others train."""
    unknown = set(evaluation_types) - {d.task_type for d in datasets.values()} - set(TASK_TYPES)
    if unknown:
        raise ValueError(
            f"`evaluation_types` has unknown task types {sorted(unknown)}; "
            f"known: {sorted(TASK_TYPES)}."
        )
    training = {n: d for n, d in datasets.items() if d.task_type not in evaluation_types}
    evaluation = {n: d for n, d in datasets.items() if d.task_type in evaluation_types}
    return training, evaluation
