"""Offline T5 pre-training: the corpus (`english_corpus`), the T5-convention vocabulary
(`t5_vocabulary`), span corruption and LM adaptation (`t5_objectives`, against T5's formulas
and hand cases), their packed examples (`text_pretraining`), and a tiny keras-hub T5 that
learns and caches (`small_t5`)."""

import itertools
import os

import numpy as np
import pytest

from trainers.experiments import english_corpus as EC
from trainers.experiments import t5_objectives as TO
from trainers.experiments import t5_vocabulary as TV
from trainers.experiments import text_pretraining as tp

WORDNET = os.path.isfile("/usr/share/wordnet/data.noun") or bool(os.environ.get("WORDNET_DIR"))
needs_wordnet = pytest.mark.skipif(
    not WORDNET, reason="WordNet (`apt-get install wordnet-base`) is not installed"
)
try:
    import django  # noqa: F401

    DJANGO = True
except ImportError:  # pragma: no cover - depends on the environment
    DJANGO = False

V = 200  # vocabulary of the NumPy tests: ids 3..99 are text, 100..199 sentinels (199 first)


def spans_of(mask):
    """[(start, end)] of the runs of True."""
    padded = np.concatenate([[False], mask, [False]]).astype(int)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2], edges[1::2]))


# ---------------------------------------------------------------- span corruption (NumPy)


def test_noise_counts_are_t5s_float32_rounding():
    # Hand values of T5's round(float32(L) * 0.15) and round(noise / 3), half to even:
    # 190*0.15 is 28.5 in float64 (-> 28, 9 spans) but 28.500002 in float32 (-> 29, 10 spans),
    # as tf.round(tf.cast(190, tf.float32) * 0.15) gives; 568 is T5's chunk for 512 inputs.
    assert TO.num_noise_tokens_and_spans(190) == (29, 10)
    assert TO.num_noise_tokens_and_spans(30) == (4, 1)  # 4.5 exactly -> 4 (half to even)
    assert TO.num_noise_tokens_and_spans(568) == (85, 28)
    assert TO.num_noise_tokens_and_spans(10) == (2, 1)  # 1.5 -> 2 (half to even); 2/3 -> 1
    assert TO.num_noise_tokens_and_spans(3) == (1, 1)  # at least one noise token
    assert TO.num_noise_tokens_and_spans(1) == (1, 1)  # T5 lifts length to 2
    assert TO.random_spans_helper(512) == (568, 114)  # T5's documented pair
    assert TO.random_spans_helper(64) == (70, 14)  # 60 kept + 3 sentinels + EOS; 10 + 3 + 1


@pytest.mark.parametrize("length", [2, 7, 30, 31, 64, 100, 190, 257, 568])
def test_random_spans_noise_mask_counts_and_alternation(length):
    noise, spans = TO.num_noise_tokens_and_spans(length)
    for seed in range(5):
        mask = TO.random_spans_noise_mask(length, rng=seed)
        assert mask.shape == (length,) and mask.dtype == bool
        assert mask.sum() == noise
        runs = spans_of(mask)
        assert len(runs) == spans
        # Non-noise first, noise last (T5 interleaves nonnoise, noise, ...).
        assert not mask[0] and mask[-1]


def test_random_spans_noise_mask_is_seeded_and_random():
    a = TO.random_spans_noise_mask(200, rng=1)
    assert np.array_equal(a, TO.random_spans_noise_mask(200, rng=1))
    masks = {TO.random_spans_noise_mask(200, rng=s).tobytes() for s in range(20)}
    assert len(masks) == 20
    # Every position is noise about 15% of the time (no bias to the end beyond T5's own:
    # the last token is always noise).
    freq = np.mean([TO.random_spans_noise_mask(200, rng=s) for s in range(400)], axis=0)
    assert abs(freq[1:-1].mean() - 29 / 198) < 0.01
    assert freq[-1] == 1.0 and freq[0] == 0.0


def test_sentinel_replacement_hand_case():
    tokens = np.arange(10, 20)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 1, 1], bool)
    assert TO.noise_span_to_unique_sentinel(tokens, mask, V).tolist() == [
        10,
        11,
        199,
        14,
        15,
        16,
        198,
    ]
    assert TO.nonnoise_span_to_unique_sentinel(tokens, mask, V).tolist() == [
        199,
        12,
        13,
        198,
        17,
        18,
        19,
    ]
    assert TV.sentinel_id(V) == 199 and TV.sentinel_id(V, 3) == 196


@pytest.mark.parametrize("length", [5, 30, 64, 150])
def test_span_corruption_invariants(length):
    rng = np.random.default_rng(0)
    for _ in range(10):
        tokens = rng.integers(3, V - 100, size=length).astype(np.int32)
        inputs, targets = TO.span_corruption(tokens, V, rng)
        noise, spans = TO.num_noise_tokens_and_spans(length)
        assert inputs[-1] == TV.EOS_ID and targets[-1] == TV.EOS_ID
        in_sent = inputs[inputs >= V - 100]
        tg_sent = targets[targets >= V - 100]
        # Sentinels descend from the last id, one per span, the same in inputs and targets.
        assert in_sent.tolist() == list(range(V - 1, V - 1 - spans, -1))
        assert tg_sent.tolist() == in_sent.tolist()
        assert targets[0] == V - 1
        assert len(targets) == noise + spans + 1
        assert len(inputs) == length - noise + spans + 1
        restored = TO.restore_from_span_corruption(inputs, targets, V)
        assert np.array_equal(restored, tokens)


def test_span_corruption_refuses_too_many_spans():
    with pytest.raises(ValueError, match="num_extra_ids"):
        TO.span_corruption(np.arange(200) % 50 + 3, V, 0, num_extra_ids=5)


def test_lm_adaptation_splits_text_uniformly():
    tokens = np.arange(3, 13, dtype=np.int32)
    cuts = []
    for seed in range(300):
        inputs, targets = TO.lm_adaptation(tokens, seed)
        assert inputs[-1] == TV.EOS_ID and targets[-1] == TV.EOS_ID
        assert np.array_equal(np.concatenate([inputs[:-1], targets[:-1]]), tokens)
        cuts.append(len(inputs) - 1)
    # T5's random_prefix_noise_mask at density 0.5: the prefix has 1..length-1 tokens.
    assert set(cuts) == set(range(1, 10))
    with pytest.raises(ValueError, match="noise_density"):
        TO.random_prefix_noise_mask(10, 0, noise_density=0.7)


# ------------------------------------------------------------------ the streams of examples


def _docs():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 80, size=rng.integers(1, 30)).astype(np.int32) for _ in range(60)]


def test_pretraining_examples_pack_and_restore_the_shuffled_stream():
    docs, L = _docs(), 32
    chunk = tp.chunk_length_for("span_corruption", L)
    examples = list(tp.pretraining_examples(docs, "span_corruption", L, V, seed=5, repeat=False))
    # The stream re-derived: pass 0 shuffles the documents with rng([seed, 0]) first.
    order = np.random.default_rng([5, 0]).permutation(len(docs))
    stream = np.concatenate([docs[i] for i in order])
    assert len(examples) == len(stream) // chunk
    # T5's short span-corruption targets (random_spans_helper(32) = (34, 8)): nothing is cut,
    # since the restored ids below are the whole stream.
    assert tp.decoder_length_for("span_corruption", L) == 8
    assert all(y.shape == (8,) for _, y, _ in examples)
    restored = []
    for x, y, w in examples:
        # keras-hub's T5 packing: decoder input = <pad> + labels[:-1]; weights on targets.
        assert x["decoder_token_ids"][0] == TV.PAD_ID
        assert np.array_equal(x["decoder_token_ids"][1:], y[:-1])
        assert np.array_equal(x["decoder_padding_mask"], w > 0)
        n_in = int(x["encoder_padding_mask"].sum())
        assert x["encoder_token_ids"][n_in - 1] == TV.EOS_ID
        restored.append(TO.restore_from_span_corruption(x["encoder_token_ids"][:n_in], y[w > 0], V))
    assert np.array_equal(np.concatenate(restored), stream[: len(examples) * chunk])
    again = list(tp.pretraining_examples(docs, "span_corruption", L, V, seed=5, repeat=False))
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(examples, again))


def test_pretraining_examples_both_alternates_objectives():
    docs, L = _docs(), 24
    examples = list(itertools.islice(tp.pretraining_examples(docs, "both", L, V, seed=0), 6))
    first_target = [int(y[0]) for _, y, _ in examples]
    assert [t == V - 1 for t in first_target] == [True, False] * 3  # span corr. starts <X0>
    x, y, w = examples[1]
    n_in = int(x["encoder_padding_mask"].sum())
    assert n_in - 1 + int(w.sum()) - 1 == L - 1  # prefix + rest == one LM chunk
    with pytest.raises(ValueError, match="objective"):
        next(tp.pretraining_examples(docs, "mlm", L, V))


def test_pretraining_dataset_batches_the_example_stream():
    docs, L = _docs(), 24
    ds = tp.pretraining_dataset(docs, "both", L, V, batch_size=4, seed=2)
    ((x, y, w),) = ds.take(1).as_numpy_iterator()
    ex, ey, ew = tp.stack_examples(
        itertools.islice(tp.pretraining_examples(docs, "both", L, V, seed=2), 4)
    )
    assert np.array_equal(y, ey) and np.array_equal(w, ew)
    assert all(np.array_equal(x[k], ex[k]) for k in ex)
    assert x["encoder_padding_mask"].dtype == bool and y.dtype == np.int32
    # The NumPy route (the default off TensorFlow): the same batches, endlessly.
    batches = tp.pretraining_dataset(docs, "both", L, V, batch_size=4, seed=2, as_numpy=True)
    nx, ny, nw = next(batches)
    assert np.array_equal(ny, y) and np.array_equal(nw, w)
    assert all(np.array_equal(nx[k], x[k]) and nx[k].dtype == x[k].dtype for k in x)
    ((_, y2, _),) = ds.skip(7).take(1).as_numpy_iterator()
    for _ in range(6):
        next(batches)
    assert np.array_equal(next(batches)[1], y2)


def test_unigram_baselines_by_hand():
    train, held = np.array([[5, 5, 6, 0]]), np.array([[5, 6, 6, 0]])
    w_train, w_held = np.array([[1, 1, 1, 0]]), np.array([[1, 1, 1, 0]])
    # add-one counts over V=8: token 5 -> 3/11, token 6 -> 2/11
    expected = -(np.log(3 / 11) + 2 * np.log(2 / 11)) / 3
    assert np.isclose(tp.unigram_cross_entropy(train, w_train, held, w_held, 8), expected)
    assert np.isclose(
        tp.unigram_entropy(held, w_held), -(1 / 3 * np.log(1 / 3) + 2 / 3 * np.log(2 / 3))
    )


# ------------------------------------------------------------------- corpus and vocabulary


def test_split_wordnet_gloss():
    gloss = (
        'an assemblage of parts that is regarded as a single entity; "how big is that '
        'part compared to the whole?"; "the team is a unit"'
    )
    definition, examples = EC.split_wordnet_gloss(gloss)
    assert definition == "an assemblage of parts that is regarded as a single entity"
    assert examples == ["how big is that part compared to the whole?", "the team is a unit"]


@needs_wordnet
@pytest.mark.skipif(not DJANGO, reason="Django (`pip install django`) is not installed")
def test_english_corpus_is_deterministic_and_sized():
    corpus = EC.english_corpus()
    stats = EC.corpus_statistics(corpus)
    # Measured: 166,621 texts, 1,613,876 words.
    assert 150_000 < stats["texts"] < 200_000 and 1_400_000 < stats["words"] < 1_900_000
    assert len(set(corpus)) == len(corpus)
    assert corpus[0] == (
        "entity: that which is perceived or known or inferred to have its own "
        "distinct existence (living or nonliving)"
    )
    assert "Password (again)" in corpus  # a Django msgid
    assert EC.english_corpus(max_texts=500, seed=1) == EC.english_corpus(max_texts=500, seed=1)
    with pytest.raises(ValueError, match="sources"):
        EC.english_corpus(sources=("c4",))


@pytest.fixture(scope="module")
def small_corpus():
    if WORDNET:
        return EC.english_corpus(
            sources=("wordnet_definitions", "wordnet_examples"), max_texts=3000, seed=0
        )
    pytest.skip("WordNet (`apt-get install wordnet-base`) is not installed")


@pytest.fixture(scope="module")
def vocabulary(small_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    path = TV.train_sentencepiece(small_corpus, folder, vocabulary_size=1000)
    return path, TV.t5_tokenizer(path)


def test_vocabulary_has_t5_conventions(vocabulary):
    path, tokenizer = vocabulary
    assert tokenizer.vocabulary_size() == 1000
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert tokenizer.pad_token_id == 0 and tokenizer.end_token_id == 1
    assert "<s>" not in tokenizer.get_vocabulary()
    for k in range(100):
        assert tokenizer.token_to_id(f"<extra_id_{k}>") == TV.sentinel_id(1000, k)
    ids = np.asarray(tokenizer("a dog <extra_id_7> barked"))
    assert TV.sentinel_id(1000, 7) in ids.tolist()


def test_vocabulary_round_trips_normalised_text(vocabulary, small_corpus):
    _, tokenizer = vocabulary
    texts = small_corpus[:300]
    decoded = tokenizer.detokenize(tokenizer(texts))
    decoded = [
        d.decode() if isinstance(d, bytes) else str(d)
        for d in (decoded.numpy().tolist() if hasattr(decoded, "numpy") else decoded)
    ]
    assert decoded == [TV.normalize_text(t) for t in texts]


def test_vocabulary_cache_and_errors(small_corpus, tmp_path):
    first = TV.train_sentencepiece(small_corpus[:800], tmp_path, vocabulary_size=400)
    mtime = first.stat().st_mtime_ns
    assert TV.train_sentencepiece(small_corpus[:800], tmp_path, vocabulary_size=400) == first
    assert first.stat().st_mtime_ns == mtime
    other = TV.train_sentencepiece(small_corpus[:800], tmp_path, vocabulary_size=450)
    assert other != first
    with pytest.raises(ValueError, match="num_extra_ids"):
        TV.train_sentencepiece(small_corpus, tmp_path, vocabulary_size=400, num_extra_ids=101)
    with pytest.raises(ValueError, match="vocabulary_size"):
        TV.train_sentencepiece(small_corpus, tmp_path, vocabulary_size=50, num_extra_ids=100)


# ---------------------------------------------------------------------- the tiny T5 learns


def test_tiny_t5_pretraining_beats_unigram_baseline(vocabulary, small_corpus):
    from trainers.experiments import small_t5

    _, tokenizer = vocabulary
    vocab = tokenizer.vocabulary_size()
    train, held = small_corpus[:2700], small_corpus[2700:]
    docs, held_docs = TV.tokenize_texts(train, tokenizer), TV.tokenize_texts(held, tokenizer)
    L = 32
    hx, hy, hw = tp.stack_examples(
        tp.pretraining_examples(held_docs, "span_corruption", L, vocab, seed=1, repeat=False)
    )
    tx, ty, tw = tp.stack_examples(
        itertools.islice(tp.pretraining_examples(docs, "span_corruption", L, vocab, seed=0), 1000)
    )
    baseline = tp.unigram_cross_entropy(ty, tw, hy, hw, vocab)
    model = small_t5.build_t5(small_t5.t5_config("tiny", vocab), seed=0)
    before = small_t5.heldout_loss(model, hx, hy, hw)
    history = small_t5.pretrain_t5(
        model,
        tokenizer,
        train,
        "span_corruption",
        steps=30,
        batch_size=16,
        sequence_length=L,
        learning_rate=0.1,
        progress=False,
        token_docs=docs,
        log_every=10,
    )
    after = small_t5.heldout_loss(model, hx, hy, hw)
    assert before > np.log(vocab) - 0.5 > baseline  # starts near uniform
    assert after < baseline - 0.1, (before, after, baseline)
    assert len(history.history["loss"]) == 3 and history.history["steps"] == [10, 20, 30]
    # Span corruption's short decoder (decoder_length_for) loses nothing: the same targets
    # padded to the encoder's length give the same loss (causal decoder, padding after).
    n_in = hx["encoder_padding_mask"].sum(1)
    wide = tp.stack_examples(
        tp.pack_seq2seq(hx["encoder_token_ids"][i, : n_in[i]], hy[i, hw[i] > 0], L, L)
        for i in range(len(hy))
    )
    assert wide[1].shape[1] == L > hy.shape[1]
    assert np.isclose(small_t5.heldout_loss(model, *wide), after, rtol=1e-5)
    assert history.history["tokens_per_second"] > 0


def test_cached_pretrained_t5_round_trips_weights_bit_exactly(small_corpus, tmp_path):
    from trainers.experiments import small_t5

    kwargs = dict(
        corpus=small_corpus[:800],
        size="tiny",
        vocabulary_size=400,
        steps=2,
        batch_size=4,
        sequence_length=16,
        learning_rate=0.1,
        seed=3,
        progress=False,
    )
    trained, tokenizer, info = small_t5.cached_pretrained_t5(tmp_path, **kwargs)
    assert info["cached"] is False and len(info["history"]["loss"]) == 2
    loaded, tokenizer2, info2 = small_t5.cached_pretrained_t5(tmp_path, **kwargs)
    assert info2["cached"] is True and info2["key"] == info["key"]
    assert tokenizer2.vocabulary_size() == tokenizer.vocabulary_size() == 400
    assert len(loaded.weights) == len(trained.weights)
    # The hit rebuilds the model at the same seed, so without a working load it would hold
    # the untrained initial weights, which the 2 training steps changed.
    for a, b in zip(trained.weights, loaded.weights):
        # (Keras numbers layer names per process, so paths differ between the two models.)
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b)), a.path
    assert sorted(p.name for p in tmp_path.glob("t5-*")) == [
        f"t5-{info['key']}.json",
        f"t5-{info['key']}.weights.h5",
    ]


def test_small_t5_bad_arguments(vocabulary):
    from trainers.experiments import small_t5

    with pytest.raises(ValueError, match="size"):
        small_t5.t5_config("xl", 1000)
    with pytest.raises(ValueError, match="overrides"):
        small_t5.t5_config("tiny", 1000, num_experts=4)
    with pytest.raises(ValueError, match="optimizer"):
        small_t5.make_optimizer("sgd")
    model = small_t5.build_t5(small_t5.t5_config("tiny", 500), seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        small_t5.pretrain_t5(model, vocabulary[1], ["a b c"], steps=1, progress=False)
    with pytest.raises(ValueError, match="objective"):
        small_t5.pretrain_t5(model, vocabulary[1], ["a b c"], objective="mlm", progress=False)
