"""Prompt templates: filled texts, answer choices (fixed and per example), clear errors."""

import pytest

from tf_metaalign.prompts.templates import PromptedExample, Template, apply_templates

DJANGO = Template(
    "which_part",
    "Which part of Django does this string come from? {text}",
    ["core", "admin", "auth"],
)


def test_apply_fixed_choices():
    out = DJANGO.apply({"text": "Log out", "label": 1, "unused": 3})
    assert out == PromptedExample(
        "Which part of Django does this string come from? Log out",
        "admin",
        ("core", "admin", "auth"),
        1,
    )
    assert DJANGO.fields == ("text", "label")


def test_target_template_choices_from_fields_and_callable():
    t = Template(
        "nli",
        "{premise} Question: {hypothesis} True or False?",
        ["True", "False"],
        target_template="Answer: {answer}.",
    )
    out = t.apply({"premise": "A dog runs.", "hypothesis": "An animal moves.", "label": 0})
    assert out.input_text == "A dog runs. Question: An animal moves. True or False?"
    assert out.target_text == "Answer: True." and out.label == 0
    # Choices that use fields of the example (a coreference-style template).
    coref = Template("who", "{sentence} Who is 'she'?", ["{option1}", "{option2}"])
    out = coref.apply(
        {"sentence": "Ann met Bo; she smiled.", "option1": "Ann", "option2": "Bo", "label": 0}
    )
    assert out.answer_choices == ("Ann", "Bo") and out.target_text == "Ann"
    assert coref.fields == ("sentence", "option1", "option2", "label")
    # A callable: the choices of each example.
    per_example = Template("pick", "Pick: {text}", lambda e: e["options"].split("|"))
    out = per_example.apply({"text": "x", "options": "a|b|c", "label": 2})
    assert out.answer_choices == ("a", "b", "c") and out.target_text == "c"
    # No choices: a generation template; the target reads the fields.
    gen = Template("translate", "Translate to German: {en}", None, target_template="{de}")
    assert gen.apply({"en": "Yes", "de": "Ja"}) == PromptedExample(
        "Translate to German: Yes", "Ja", (), -1
    )


def test_several_templates_per_dataset():
    other = Template(
        "app", "{text}\nDjango app:", ["core", "admin", "auth"], label_field="component"
    )
    examples = [
        {"text": "Log out", "label": 1, "component": 1},
        {"text": "Password", "label": 2, "component": 2},
    ]
    out = apply_templates([DJANGO, other], examples)
    assert list(out) == ["which_part", "app"]
    assert [e.target_text for e in out["app"]] == ["admin", "auth"]
    assert out["app"][0].input_text == "Log out\nDjango app:"
    with pytest.raises(ValueError, match="duplicate"):
        apply_templates([DJANGO, DJANGO], examples)


def test_clear_errors():
    with pytest.raises(ValueError, match=r"no field 'text'.*input template"):
        DJANGO.apply({"txt": "Log out", "label": 0})
    with pytest.raises(ValueError, match="label field 'label'"):
        DJANGO.apply({"text": "Log out"})
    with pytest.raises(ValueError, match="not an index"):
        DJANGO.apply({"text": "Log out", "label": 3})
    with pytest.raises(ValueError, match="integer index"):
        DJANGO.apply({"text": "Log out", "label": "admin"})
    with pytest.raises(ValueError, match="no field 'option2'.*answer choice"):
        Template("who", "{s}", ["{option1}", "{option2}"]).apply(
            {"s": "x", "option1": "a", "label": 0}
        )
    with pytest.raises(ValueError, match="plain names"):
        Template("bad", "{0} and {x.y}", ["a"])
    with pytest.raises(ValueError, match="input_template"):
        Template("leak", "{text} -> {answer}", ["a", "b"])
    with pytest.raises(ValueError, match="answer_choices"):
        Template("empty", "{text}", [])
    with pytest.raises(ValueError, match="answer_choices"):
        Template("nochoices", "{text}", None)  # the default target needs {answer}
    with pytest.raises(ValueError, match="not a valid format"):
        Template("braces", "{text", ["a"])
    with pytest.raises(ValueError, match="reserved"):
        DJANGO.apply({"text": "x", "label": 0, "answer": "y"})
    with pytest.raises(ValueError, match="non-empty sequence of str"):
        Template("f", "{t}", lambda e: "ab").apply({"t": 1, "label": 0})
