"""Rank classification, the few-shot protocol, ARG and its paired bootstrap: oracles."""

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.prompts import evaluation as ev
from tf_metaalign.prompts.templates import PromptedExample, Template

EOS, PAD = 1, 0


class WordTokenizer:
    """text -> one id per whitespace-separated word (ids from 2; 0 = pad, 1 = EOS)."""

    def __init__(self):
        self.ids = {}

    def __call__(self, text):
        return [self.ids.setdefault(w, len(self.ids) + 2) for w in text.split()]


# ----------------------------------------------------------------------------- scoring


def test_choice_scores_mean_sum_and_padding_ignored():
    ll = np.array([[-1.0, -3.0, -1e9], [-0.5, -0.5, -0.5]])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(ev.choice_scores(ll, mask, "mean"), [-2.0, -0.5])
    np.testing.assert_allclose(ev.choice_scores(ll, mask, "sum"), [-4.0, -1.5])
    with pytest.raises(ValueError, match="reduction"):
        ev.choice_scores(ll, mask, "max")
    with pytest.raises(ValueError, match="no target token"):
        ev.choice_scores(ll, np.zeros_like(mask))


def test_token_log_likelihoods_equal_numpy_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)) * 30  # large logits: a naive exp would overflow
    targets = rng.integers(0, 5, size=(2, 3))
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        ev.token_log_likelihoods(logits, targets).numpy(), expected, rtol=1e-12, atol=1e-12
    )


def table_scorer(token_ll):
    """A scorer whose log-likelihood of a target token depends on the token id only
    (`token_ll[id]`); padding positions get a huge value that must be masked out."""

    def score_fn(input_ids, target_ids, target_mask):
        out = np.vectorize(lambda t: token_ll.get(int(t), -7.0))(target_ids).astype(np.float64)
        return tf.constant(np.where(target_mask > 0, out, 1e6))  # a tf tensor is fine

    return score_fn


def test_mean_and_sum_disagree_on_long_confident_choice():
    tok = WordTokenizer()
    short, long_ = "no", "yes indeed it is"
    example = PromptedExample("question ?", short, (short, long_), 0)
    tok("question ?")
    ids = {w: tok(w)[0] for w in "no yes indeed it is".split()}
    # The short choice: "no" (-1) + EOS (-0.75): mean -0.875, sum -1.75.
    # The long one: 4 words of -0.5 + EOS: mean -0.55 (higher), sum -2.75 (lower).
    token_ll = {
        ids["no"]: -1.0,
        ids["yes"]: -0.5,
        ids["indeed"]: -0.5,
        ids["it"]: -0.5,
        ids["is"]: -0.5,
        EOS: -0.75,
    }
    score_fn = table_scorer(token_ll)
    pred_mean, scores_mean, _ = ev.rank_classify_examples(
        score_fn, tok, [example], eos_id=EOS, reduction="mean"
    )
    pred_sum, scores_sum, _ = ev.rank_classify_examples(
        score_fn, tok, [example], eos_id=EOS, reduction="sum"
    )
    np.testing.assert_allclose(scores_mean, [[-0.875, -0.55]])
    np.testing.assert_allclose(scores_sum, [[-1.75, -2.75]])
    assert pred_mean.tolist() == [1] and pred_sum.tolist() == [0]


def matching_scorer(input_ids, target_ids, target_mask):
    """log p(token) = log 0.9 if the token occurs in the input, log 0.01 otherwise (EOS: 0)."""
    ll = np.full(target_ids.shape, np.log(0.01))
    for i in range(target_ids.shape[0]):
        ll[i, np.isin(target_ids[i], input_ids[i])] = np.log(0.9)
    ll[target_ids == EOS] = 0.0
    return ll


def test_rank_classification_picks_right_choice_with_variable_choices_and_chunks():
    tok = WordTokenizer()
    colours = ["red", "green", "blue", "light yellow"]
    template = Template(
        "colour", "The ball is {colour} . Which colour ?", lambda e: colours[: e["n"]]
    )
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(12):
        n = int(rng.integers(2, 5))
        label = int(rng.integers(0, n))
        examples.append(template.apply({"colour": colours[label], "n": n, "label": label}))
    pred, scores, labels = ev.rank_classify_examples(matching_scorer, tok, examples, eos_id=EOS)
    assert ev.accuracy(pred, labels) == 1.0
    # Absent choices score -inf; the scores equal a hand computation.
    for i, e in enumerate(examples):
        assert np.all(np.isneginf(scores[i, len(e.answer_choices) :]))
        for j, choice in enumerate(e.answer_choices):
            words = choice.split()
            hits = [np.log(0.9) if w in e.input_text.split() else np.log(0.01) for w in words]
            np.testing.assert_allclose(scores[i, j], np.sum(hits) / (len(words) + 1))
    # Chunked scoring (3 rows per call) gives the same answer.
    pred3, scores3, _ = ev.rank_classify_examples(
        matching_scorer, tok, examples, eos_id=EOS, batch_size=3
    )
    np.testing.assert_array_equal(pred3, pred)
    np.testing.assert_allclose(scores3, scores)


def test_rank_classification_errors():
    ids = np.zeros((2, 3), int)
    with pytest.raises(ValueError, match="choice_target_ids"):
        ev.rank_classification(matching_scorer, ids, np.zeros((3, 2, 4), int), np.ones((3, 2, 4)))
    with pytest.raises(ValueError, match="score_fn"):
        ev.rank_classification(
            lambda i, t, m: np.zeros((1, 1)), ids, np.ones((2, 2, 4), int), np.ones((2, 2, 4))
        )
    with pytest.raises(ValueError, match="choice_mask"):
        ev.rank_classification(
            matching_scorer,
            ids,
            np.ones((2, 2, 4), int),
            np.ones((2, 2, 4)),
            choice_mask=[[1, 1], [0, 0]],
        )
    with pytest.raises(ValueError, match="no answer choices"):
        ev.rank_classify_examples(matching_scorer, WordTokenizer(), [PromptedExample("a", "b")])


# ----------------------------------------------------------------------------- few-shot


def test_few_shot_protocol_with_fake_model():
    tasks = {
        "d1": {
            "t1": (list(range(100)), list(range(100, 110))),
            "t2": (list(range(100)), list(range(100, 110))),
        },
        "d2": {"t1": (list(range(50)), list(range(200, 204)))},
    }
    calls = []

    def build_model(dataset, template):
        calls.append((dataset, template))
        return {"seen": None, "epochs": 0}

    def train(model, examples, epochs):
        model["seen"], model["epochs"] = list(examples), epochs

    def evaluate(model, eval_examples):
        # Accuracy rises then falls with epochs: the protocol must report the FINAL state.
        correct_count = 3 if model["epochs"] == 100 else 0
        return np.arange(len(eval_examples)) < correct_count

    results = ev.few_shot_prompt_tuning(tasks, build_model, train, evaluate, seed=3)
    assert calls == [("d1", "t1"), ("d1", "t2"), ("d2", "t1")]  # a fresh model each
    for key, r in results.items():
        assert len(r.train_indices) == 16 and len(set(r.train_indices)) == 16
        np.testing.assert_array_equal(
            r.train_indices, ev.sample_few_shot(len(tasks[key[0]][key[1]][0]), 16, 3, *key)
        )
    assert results[("d1", "t1")].accuracy == 0.3 and results[("d2", "t1")].accuracy == 0.75
    # The results feed ARG directly: d1 (0.3-0.5)/0.5 = -0.4 for both templates, d2
    # (0.75-0.25)/0.25 = 2; the datasets averaged: 0.8.
    assert ev.average_relative_gain(results, {"d1": 2, "d2": 4}) == pytest.approx(0.8)
    # Seeded per dataset and template: deterministic, different across templates and seeds.
    again = ev.few_shot_prompt_tuning(tasks, build_model, train, evaluate, seed=3)
    np.testing.assert_array_equal(
        again[("d1", "t1")].train_indices, results[("d1", "t1")].train_indices
    )
    assert not np.array_equal(
        results[("d1", "t1")].train_indices, results[("d1", "t2")].train_indices
    )
    assert not np.array_equal(
        ev.sample_few_shot(100, 16, 4, "d1", "t1"), results[("d1", "t1")].train_indices
    )
    with pytest.raises(ValueError, match="num_shots"):
        ev.few_shot_prompt_tuning({"d": {"t": ([1, 2], [3])}}, build_model, train, evaluate)
    with pytest.raises(ValueError, match="evaluate"):
        ev.few_shot_prompt_tuning(tasks, build_model, train, lambda m, e: [0.5])


# ----------------------------------------------------------------------------- ARG


def test_arg_equals_hand_computation():
    acc = {("d1", "t1"): 0.75, ("d1", "t2"): 0.5, ("d2", "t1"): 0.5}
    choices = {"d1": 2, "d2": 4}
    # Gains: d1/t1 (0.75-0.5)/0.5 = 0.5, d1/t2 0, d2/t1 (0.5-0.25)/0.25 = 1.
    assert ev.average_relative_gain(acc, choices) == pytest.approx((0.25 + 1.0) / 2)
    assert ev.average_relative_gain(acc, choices, "template") == pytest.approx(1.5 / 3)
    # Per-example arrays are reduced to their accuracy.
    arrays = {k: np.arange(4) < round(4 * v) for k, v in acc.items()}
    assert ev.average_relative_gain(arrays, choices) == pytest.approx(0.625)
    assert ev.relative_gain(0.25, 4) == 0.0
    with pytest.raises(ValueError, match="num_choices"):
        ev.average_relative_gain(acc, {"d1": 2})
    with pytest.raises(ValueError, match="num_choices"):
        ev.relative_gain(0.5, 1)
    with pytest.raises(ValueError, match="weighting"):
        ev.average_relative_gain(acc, choices, "example")


def _methods(rng, n=200):
    keys = [("d1", "t1"), ("d1", "t2"), ("d2", "t1")]
    good = {k: (rng.random(n) < 0.9).astype(float) for k in keys}
    bad = {k: (rng.random(n) < 0.5).astype(float) for k in keys}
    return keys, good, bad


def test_bootstrap_p_values():
    keys, good, bad = _methods(np.random.default_rng(0))
    choices = {"d1": 2, "d2": 2}
    r = ev.paired_bootstrap_arg(good, bad, choices, num_resamples=1000, seed=0)
    assert r.p_value == 0.0 and r.difference > 0.5
    assert r.arg_a == pytest.approx(ev.average_relative_gain(good, choices))
    assert ev.paired_bootstrap_arg(bad, good, choices, seed=0).p_value == 1.0
    # Identical methods: every resampled difference is 0, so mid-p gives exactly 0.5.
    assert ev.paired_bootstrap_arg(good, dict(good), choices).p_value == 0.5
    # Same accuracy, different examples right (rolled): p near 0.5.
    rolled = {k: np.roll(v, 7) for k, v in good.items()}
    p = ev.paired_bootstrap_arg(good, rolled, choices, num_resamples=2000, seed=1).p_value
    assert 0.3 < p < 0.7
    # Deterministic under the seed, different for another seed.
    a = ev.paired_bootstrap_arg(good, rolled, choices, num_resamples=300, seed=5)
    b = ev.paired_bootstrap_arg(good, rolled, choices, num_resamples=300, seed=5)
    c = ev.paired_bootstrap_arg(good, rolled, choices, num_resamples=300, seed=6)
    np.testing.assert_array_equal(a.differences, b.differences)
    assert a.p_value == b.p_value and not np.array_equal(a.differences, c.differences)
    # The bootstrap distribution's spread matches the paired closed form (per-task variance
    # of the mean difference of the relative gains, weighted): an independent oracle.
    w = {("d1", "t1"): 0.25, ("d1", "t2"): 0.25, ("d2", "t1"): 0.5}
    var = sum(w[k] ** 2 * np.var((good[k] - rolled[k]) / 0.5) / len(good[k]) for k in keys)
    big = ev.paired_bootstrap_arg(good, rolled, choices, num_resamples=4000, seed=2)
    assert np.std(big.differences) == pytest.approx(np.sqrt(var), rel=0.06)


def test_bootstrap_errors():
    keys, good, bad = _methods(np.random.default_rng(0), n=10)
    with pytest.raises(ValueError, match="same"):
        ev.paired_bootstrap_arg(good, {keys[0]: bad[keys[0]]}, 2)
    with pytest.raises(ValueError, match="paired"):
        ev.paired_bootstrap_arg(good, {k: v[:5] for k, v in bad.items()}, 2)
    with pytest.raises(ValueError, match="0/1"):
        ev.paired_bootstrap_arg(good, {k: v * 0.5 for k, v in bad.items()}, 2)
    with pytest.raises(ValueError, match="num_resamples"):
        ev.paired_bootstrap_arg(good, bad, 2, num_resamples=0)
