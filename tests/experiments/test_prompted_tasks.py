"""Prompted tasks (`trainers.experiments.p3`, `.prompted_tasks`, `.prompted_mixture`): P3's
clear offline error, the offline tasks and their split, the mixture."""

import importlib.util
import os
import time

import numpy as np
import pytest
import tensorflow as tf

from trainers.experiments import p3
from trainers.experiments import prompted_mixture as pm
from trainers.experiments import prompted_tasks as pt
from trainers.experiments import wordnet
from tf_metaalign.prompts.templates import Template

HAVE_WORDNET = os.path.isfile(os.path.join(wordnet.DEFAULT_WORDNET_DIR, "data.noun"))
HAVE_DJANGO = importlib.util.find_spec("django") is not None
needs_wordnet = pytest.mark.skipif(
    not HAVE_WORDNET,
    reason="WordNet data files absent: `apt-get install wordnet-base` (/usr/share/wordnet/data.*)",
)
needs_django = pytest.mark.skipif(
    not HAVE_DJANGO, reason="Django absent: `pip install django` (its gettext catalogs)"
)


# ----------------------------------------------------------------------------- P3


def test_p3_offline_error_says_what_it_tried_and_what_to_use(monkeypatch, tmp_path):
    monkeypatch.delenv("P3_DATA_DIR", raising=False)
    with pytest.raises(p3.P3NotAvailableError) as info:
        p3.load_p3("super_glue_rte_GPT_3_style")
    message = str(info.value)
    for part in (
        "super_glue_rte_GPT_3_style",
        "bigscience/P3",
        "no network",
        "offline_prompted_tasks",
        "P3_DATA_DIR",
        "never downloads",
    ):
        assert part in message
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(
        p3.P3NotAvailableError, match=str(tmp_path / "data" / "super_glue_cb_GPT_3_style")
    ):
        p3.load_p3("super_glue_cb_GPT_3_style", split="train", data_dir=tmp_path)
    with pytest.raises(ValueError, match="name"):
        p3.load_p3("../etc/passwd")
    with pytest.raises(ValueError, match="split"):
        p3.load_p3("super_glue_rte_GPT_3_style", split="dev", data_dir=tmp_path)


def _bytes(*values):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode() for v in values]))


def test_p3_reads_a_local_copy_in_p3s_layout(tmp_path, monkeypatch):
    name = "super_glue_rte_GPT_3_style"
    folder = tmp_path / "data" / name
    folder.mkdir(parents=True)
    rows = [
        ("A dog runs.\nQuestion: An animal moves. True or False?", "True"),
        ("It rains.\nQuestion: It is dry. True or False?", "False"),
    ]
    with tf.io.TFRecordWriter(str(folder / "validation.tfrecord-00000-of-00001")) as w:
        for inputs, target in rows:
            features = {
                "inputs_pretokenized": _bytes(inputs),
                "targets_pretokenized": _bytes(target),
                "answer_choices": _bytes("True", "False"),
                "inputs": tf.train.Feature(int64_list=tf.train.Int64List(value=[5, 6])),
            }
            w.write(
                tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()
            )
    monkeypatch.setenv("P3_DATA_DIR", str(tmp_path))
    records = p3.load_p3(name)
    assert records[0]["inputs"] == [5, 6] and records[1]["targets_pretokenized"] == "False"
    examples = p3.p3_prompted_examples(records)
    assert [e.label for e in examples] == [0, 1]
    assert examples[0].answer_choices == ("True", "False")
    assert examples[1].input_text == rows[1][0]
    with pytest.raises(ValueError, match="inputs_pretokenized"):
        p3.p3_prompted_examples([{"inputs": [1]}])


# ----------------------------------------------------------------------------- offline tasks


@needs_wordnet
@needs_django
def test_offline_tasks_types_templates_and_held_out_types():
    start = time.perf_counter()
    tasks = pt.offline_prompted_tasks(max_train=300, max_test=100)
    build_seconds = time.perf_counter() - start
    assert build_seconds < 10, build_seconds
    assert len(tasks) >= 6 and len({d.task_type for d in tasks.values()}) >= 3
    for d in tasks.values():
        assert d.task_type in pt.TASK_TYPES
        assert 2 <= len(d.templates) <= 3, d
        assert 0 < len(d.train) <= 300 and 0 < len(d.test) <= 100
        for split in ("train", "test"):
            for name, examples in d.prompted(split).items():
                for e in examples:
                    assert len(e.answer_choices) == d.num_choices
                    assert e.target_text == e.answer_choices[e.label]
                    assert e.input_text and e.target_text
        # Every class appears among the training labels of the small label sets.
        if d.num_choices <= 8:
            assert {e["label"] for e in d.train} == set(range(d.num_choices)), d.name
    training, evaluation = pt.split_by_task_type(tasks)
    train_types = {d.task_type for d in training.values()}
    eval_types = {d.task_type for d in evaluation.values()}
    assert train_types == set(pt.TRAINING_TASK_TYPES)
    assert eval_types == set(pt.EVALUATION_TASK_TYPES) and not train_types & eval_types
    assert len(training) >= 3 and len(evaluation) >= 3
    # No leakage through the shared splits: no evaluation-task TEST text was trained on.
    wn_train = {
        e["gloss"]
        for n in ("wordnet_noun_supersense", "wordnet_verb_supersense")
        for e in tasks[n].train
    }
    assert not wn_train & {e["gloss"] for e in tasks["wordnet_noun_or_verb"].test}
    en_train = {e["text"] for e in tasks["django_component_en"].train}
    assert not en_train & {e["english"] for e in tasks["django_translation_match"].test}
    de_train = {e["text"] for e in tasks["django_language_id"].train}
    de_test = {
        e["translation"]
        for e in tasks["django_translation_match"].test
        if e["label"] == 1 and e["language"] == "German"
    }
    assert not de_train & de_test


@needs_wordnet
@needs_django
def test_offline_tasks_deterministic_under_seed():
    a = pt.offline_prompted_tasks(max_train=50, max_test=20, seed=1)
    b = pt.offline_prompted_tasks(max_train=50, max_test=20, seed=1)
    c = pt.offline_prompted_tasks(max_train=50, max_test=20, seed=2)
    assert all(a[n].train == b[n].train and a[n].test == b[n].test for n in a)
    assert any(a[n].train != c[n].train for n in a)


@needs_django
def test_offline_tasks_one_source_and_errors():
    tasks = pt.offline_prompted_tasks(max_train=20, max_test=10, sources=("django",))
    assert all(n.startswith("django_") for n in tasks) and len(tasks) == 4
    with pytest.raises(ValueError, match="sources"):
        pt.offline_prompted_tasks(sources=("p3",))
    with pytest.raises(ValueError, match="languages"):
        pt.offline_prompted_tasks(sources=("django",), languages=("de",))
    with pytest.raises(ValueError, match="max_train"):
        pt.offline_prompted_tasks(max_train=0)
    with pytest.raises(ValueError, match="template"):
        tasks["django_language_id"].prompted("train", template="nope")


# ----------------------------------------------------------------------------- mixture


def fake_datasets(sizes):
    templates = (Template("t1", "one {x}", ["a", "b"]), Template("t2", "two {x}", ["a", "b"]))
    return {
        name: pt.PromptedDataset(
            name,
            "supersense",
            templates,
            [{"x": f"{name}{i}", "label": i % 2} for i in range(n)],
            [{"x": "t", "label": 0}],
            2,
        )
        for name, n in sizes.items()
    }


def test_mixing_rates_closed_form_and_empirical_frequencies():
    sizes = {"small": 50, "medium": 300, "large": 1000}
    cap = 400
    rates = pm.mixing_rates(sizes, cap)
    np.testing.assert_allclose(list(rates.values()), np.array([50, 300, 400]) / 750)
    mixture = pm.PromptedMixture(fake_datasets(sizes), cap=cap, seed=0)
    n = 6000
    draws = [mixture.draw(k) for k in range(n)]
    counts = np.array([sum(d[0] == name for d in draws) for name in sizes])
    p = np.array(list(rates.values()))
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) < 4 * sigma), (counts, n * p)
    # The cap binds: "large" has 20x the examples of "small" but only 8x the rate.
    assert counts[2] / counts[0] < 12
    # Templates are drawn uniformly; examples are the templates applied.
    t1 = sum(d[2] == "t1" for d in draws)
    assert abs(t1 - n / 2) < 4 * np.sqrt(n / 4)
    pairs = mixture.take(20, with_names=True)
    for (name, template, text, target), (_, index, _) in zip(pairs, draws):
        ex = mixture.datasets[name].train[index]
        assert text == ("one " if template == "t1" else "two ") + ex["x"]
        assert target == "ab"[ex["label"]]
    # No cap binding: proportional to size.
    np.testing.assert_allclose(
        list(pm.mixing_rates(sizes, 10**6).values()), np.array([50, 300, 1000]) / 1350
    )


def test_mixture_deterministic_and_resumable():
    datasets = fake_datasets({"a": 30, "b": 70})
    m = pm.PromptedMixture(datasets, cap=50, seed=3)
    assert m.take(15)[5:] == pm.PromptedMixture(datasets, cap=50, seed=3).take(10, start=5)
    assert m.take(15) != pm.PromptedMixture(datasets, cap=50, seed=4).take(15)
    with pytest.raises(ValueError, match="cap"):
        pm.mixing_rates({"a": 3}, 0)
    with pytest.raises(ValueError, match="sizes"):
        pm.mixing_rates({"a": 0}, 3)
    with pytest.raises(ValueError, match="no train examples"):
        pm.PromptedMixture(fake_datasets({"a": 0, "b": 3}))
