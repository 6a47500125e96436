"""Prompt templates: an example dict -> (input text, target text, answer choices, label).

A prompt in P3 / promptsource (Sanh et al., "Multitask Prompted Training Enables Zero-Shot
Task Generalization", ICLR 2022; Bach et al., "PromptSource", ACL 2022 demo) is an input
template, a target template and, for classification, a list of answer choices: e.g. for
NLI the input "If {premise} is true, is it also true that {hypothesis}?", the choices
["yes", "maybe", "no"] and the target the choice of the example's label. Wu et al.,
"Continued Pretraining for Better Zero- and Few-Shot Promptability" (EMNLP 2022) combine
such a natural-language template with a learned soft prompt ("hybrid prompt tuning") and
report every number averaged over several templates per dataset.

Here a template uses Python `str.format` fields (`{text}`), not promptsource's Jinja, so
that it needs nothing beyond the standard library. The target template may use the
example's fields and `{answer}` (= `answer_choices[label]`), as promptsource's
`{{ answer_choices[label] }}`. Answer choices are a fixed list or a function of the
example (e.g. the two candidates of a coreference example).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ANSWER_FIELD", "Template", "PromptedExample", "apply_templates", "template_fields"]

#: The reserved field of a target template: the right answer choice.
ANSWER_FIELD = "answer"


def template_fields(template: str, arg_name: str = "template") -> tuple[str, ...]:
    """The field names of a `str.format` template, in order of first use.

    Only plain names are allowed (`{text}`, not `{0}`, `{}` or `{x.y}`): an example is a
    flat dict, and a positional or attribute field would fail only when applied.
    """
    if not isinstance(template, str):
        raise ValueError(
            f"`{arg_name}` must be a str with {{field}} placeholders; "
            f"got {type(template).__name__}."
        )
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # unbalanced braces
        raise ValueError(f"`{arg_name}`={template!r} is not a valid format string: {e}.") from e
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(
                f"`{arg_name}`={template!r} has the field {{{name}}}: fields "
                "must be plain names of the example's keys, e.g. {text}."
            )
        if name not in names:
            names.append(name)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class PromptedExample:
    """One example under one template.

    Attributes:
      input_text: the filled input template (what the encoder reads).
      target_text: the filled target template (what the decoder is trained to produce).
      answer_choices: the filled answer choices (rank classification scores each one as
        a target), or `()` for a template without choices (generation).
      label: index of the right choice in `answer_choices`, or -1 without choices.

    Example:
      >>> from tf_metaalign import prompts
      >>> example = prompts.PromptedExample("Is the sky blue?", "yes", ("yes", "no"), 0)
      >>> example.answer_choices[example.label] == example.target_text
      True
      >>> prompts.PromptedExample("Translate to English: chat", "cat")  # generation
      PromptedExample(input_text='Translate to English: chat', target_text='cat',
                      answer_choices=(), label=-1)

    References:
      Sanh et al., ICLR 2022 (T0, P3); Bach et al., "PromptSource", ACL 2022 demo.
    """

    input_text: str
    target_text: str
    answer_choices: tuple[str, ...] = ()
    label: int = -1


@dataclasses.dataclass(frozen=True)
class Template:
    """An input template, a target template and the answer choices of one prompt.

    Args:
      name: the template's name (unique within a dataset; P3 names a dataset-template
        pair "<dataset>_<template name>").
      input_template: `str.format` string over the example's fields.
      answer_choices: a sequence of strings (each may use the example's fields), or a
        callable `example -> sequence of str`; `None` for a template without choices.
      target_template: `str.format` string over the example's fields and `{answer}`
        (the right choice); default "{answer}".
      label_field: the example's key holding the index of the right choice.

    Example:
      >>> from tf_metaalign import prompts
      >>> nli = prompts.Template(
      ...     "does_it_follow",
      ...     "If {premise} is true, is it also true that {hypothesis}?",
      ...     answer_choices=["yes", "maybe", "no"],
      ... )
      >>> nli.fields
      ('premise', 'hypothesis', 'label')
      >>> example = nli.apply({"premise": "A dog runs", "hypothesis": "an animal moves",
      ...                      "label": 0})
      >>> example.input_text
      'If A dog runs is true, is it also true that an animal moves?'
      >>> example.target_text, example.answer_choices, example.label
      ('yes', ('yes', 'maybe', 'no'), 0)
      >>> coreference = prompts.Template(  # choices that depend on the example
      ...     "who", "{sentence} Who is {pronoun}?", lambda e: [e["a"], e["b"]],
      ...     target_template="{pronoun} is {answer}.")
      >>> coreference.apply(
      ...     {"sentence": "Ann thanked Bo.", "pronoun": "she", "a": "Ann", "b": "Bo", "label": 0}
      ... ).target_text
      'she is Ann.'

    References:
      Sanh et al., "Multitask Prompted Training Enables Zero-Shot Task Generalization",
      ICLR 2022; Bach et al., "PromptSource", ACL 2022 demo.
    """

    name: str
    input_template: str
    answer_choices: Sequence[str] | Callable[[Mapping[str, Any]], Sequence[str]] | None
    target_template: str = "{" + ANSWER_FIELD + "}"
    label_field: str = "label"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"`name` must be a non-empty str; got {self.name!r}.")
        if ANSWER_FIELD in template_fields(self.input_template, "input_template"):
            raise ValueError(
                f"`input_template` of template {self.name!r} uses "
                f"{{{ANSWER_FIELD}}}: the answer may appear only in the target."
            )
        target_fields = template_fields(self.target_template, "target_template")
        choices = self.answer_choices
        if choices is None:
            if ANSWER_FIELD in target_fields:
                raise ValueError(
                    f"Template {self.name!r}: `target_template` uses "
                    f"{{{ANSWER_FIELD}}} but `answer_choices` is None."
                )
        elif not callable(choices):
            if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
                raise ValueError(
                    f"Template {self.name!r}: `answer_choices` must be a "
                    f"non-empty sequence of str or a callable; got {choices!r}."
                )
            for c in choices:
                template_fields(c, "answer_choices")
            object.__setattr__(self, "answer_choices", tuple(choices))

    @property
    def fields(self) -> tuple[str, ...]:
        """The example keys the template reads (the label field when it has choices)."""
        names = list(template_fields(self.input_template))
        for n in template_fields(self.target_template):
            if n != ANSWER_FIELD and n not in names:
                names.append(n)
        if isinstance(self.answer_choices, tuple):
            for c in self.answer_choices:
                names += [n for n in template_fields(c) if n not in names]
        if self.answer_choices is not None:
            names.append(self.label_field)
        return tuple(names)

    def _format(self, text: str, values: Mapping[str, Any], what: str) -> str:
        try:
            return text.format_map(values)
        except KeyError as e:
            field = e.args[0]
            raise ValueError(
                f"Template {self.name!r}: the example has no field {field!r} needed by its "
                f"{what} {text!r}; the example's fields are {sorted(values)}."
            ) from None

    def choices_for(self, example: Mapping[str, Any]) -> tuple[str, ...]:
        """The answer choices filled for `example` (`()` without choices)."""
        if self.answer_choices is None:
            return ()
        if callable(self.answer_choices):
            choices = self.answer_choices(example)
            if (
                isinstance(choices, str)
                or not isinstance(choices, Sequence)
                or not choices
                or not all(isinstance(c, str) for c in choices)
            ):
                raise ValueError(
                    f"Template {self.name!r}: `answer_choices(example)` must "
                    f"return a non-empty sequence of str; got {choices!r}."
                )
            return tuple(choices)
        return tuple(self._format(c, example, "answer choice") for c in self.answer_choices)

    def apply(self, example: Mapping[str, Any]) -> PromptedExample:
        """`example` (a dict of fields) -> `PromptedExample`.

        Raises ValueError naming the template and the field when a field is missing, and
        when the label is not an index into the choices.
        """
        if not isinstance(example, Mapping):
            raise ValueError(
                f"Template {self.name!r}: `example` must be a mapping of fields; "
                f"got {type(example).__name__}."
            )
        if ANSWER_FIELD in example:
            raise ValueError(
                f"Template {self.name!r}: the example has a field "
                f"{ANSWER_FIELD!r}, reserved for the right answer choice."
            )
        input_text = self._format(self.input_template, example, "input template")
        choices = self.choices_for(example)
        label = -1
        values = dict(example)
        if choices:
            if self.label_field not in example:
                raise ValueError(
                    f"Template {self.name!r}: the example has no label field "
                    f"{self.label_field!r}; the example's fields are {sorted(example)}."
                )
            raw = example[self.label_field]
            if isinstance(raw, bool) or not hasattr(raw, "__index__"):
                raise ValueError(
                    f"Template {self.name!r}: `{self.label_field}` must be an "
                    f"integer index into the answer choices; got {raw!r}."
                )
            label = int(raw)
            if not 0 <= label < len(choices):
                raise ValueError(
                    f"Template {self.name!r}: `{self.label_field}`={label} is not "
                    f"an index into the {len(choices)} answer choices {choices}."
                )
            values[ANSWER_FIELD] = choices[label]
        target_text = self._format(self.target_template, values, "target template")
        return PromptedExample(input_text, target_text, choices, label)


def apply_templates(
    templates: Sequence[Template] | Template, examples: Sequence[Mapping[str, Any]]
) -> dict[str, list[PromptedExample]]:
    """Every template applied to every example: `{template.name: [PromptedExample, ...]}`.

    Args:
      templates: a `Template` or a non-empty sequence of them, with distinct names.
      examples: the examples, each a mapping of fields.

    Returns:
      `{template.name: [PromptedExample per example]}`, in the order of `templates`.

    Example:
      >>> from tf_metaalign import prompts
      >>> templates = [
      ...     prompts.Template("question", "{text} Is this review positive?", ["no", "yes"]),
      ...     prompts.Template("rating", "Review: {text} Rating:", ["bad", "good"]),
      ... ]
      >>> prompted = prompts.apply_templates(templates, [{"text": "Great film.", "label": 1}])
      >>> [(name, e.input_text, e.target_text) for name, (e,) in prompted.items()]
      [('question', 'Great film. Is this review positive?', 'yes'),
       ('rating', 'Review: Great film. Rating:', 'good')]

    References:
      Wu et al., EMNLP 2022 (every number averaged over several templates per dataset).
    """
    if isinstance(templates, Template):
        templates = (templates,)
    templates = tuple(templates)
    if not templates or not all(isinstance(t, Template) for t in templates):
        raise ValueError(
            f"`templates` must be a non-empty sequence of Template; got {templates!r}."
        )
    names = [t.name for t in templates]
    if len(set(names)) != len(names):
        raise ValueError(f"`templates` have duplicate names: {names}.")
    return {t.name: [t.apply(e) for e in examples] for t in templates}
