"""Offline T5 pre-training data: an English corpus, a T5-style SentencePiece vocabulary, and
T5's two unsupervised objectives (span corruption, LM adaptation) on token ids.

No pretrained T5 and no C4 exist offline, so the promptability experiment (Wu et al.,
"Continued Pretraining for Better Zero- and Few-Shot Promptability", EMNLP 2022) starts from
a small keras-hub T5 pre-trained here (see `trainers.experiments.small_t5`):

  english_corpus          WordNet glosses and example sentences + Django's English UI strings
  train_sentencepiece     a unigram SentencePiece model with T5's conventions (pad=0, eos=1,
                          unk=2, no bos, `<extra_id_k>` sentinels at the END of the
                          vocabulary), cached by a content hash of (corpus, settings)
  t5_tokenizer            `keras_hub.models.T5Tokenizer` on that model
  random_spans_noise_mask / noise_span_to_unique_sentinel / span_corruption / random_spans_helper
                          T5's span corruption (Raffel et al. 2020), a NumPy port of
                          `t5.data.preprocessors` (github.com/google-research/
                          text-to-text-transfer-transformer, t5/data/preprocessors.py)
  random_prefix_noise_mask / lm_adaptation
                          T5's `prefix_lm` objective, used for the "LM adapted" T5 v1.1
                          checkpoints (Lester et al. 2021) that Wu et al. start from
  pretraining_examples / pretraining_dataset
                          a deterministic stream of (inputs, targets) packed as
                          `T5Seq2SeqLM` features, and its `tf.data.Dataset`

Randomness: every function takes a `numpy.random.Generator` (or a seed). The mask
*distribution* is T5's; the draws are NumPy's, so masks are not bit-identical to T5's
`stateless_shuffle` ones for the same seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tf_metaalign.data.splits import check_positive_int

# T5's special ids (t5.data / seqio SentencePieceVocabulary): pad 0, eos 1, unk 2, no bos.
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
#: T5's default number of sentinels (`<extra_id_0>`..`<extra_id_99>`).
T5_NUM_EXTRA_IDS = 100
CORPUS_SOURCES = ("wordnet_definitions", "wordnet_examples", "django_msgids")
#: Django languages whose catalogs give the English msgids (the msgids are the same English
#: source strings in every language; the union of these well-covered ones holds nearly all).
DJANGO_MSGID_LANGUAGES = ("de", "fr", "es", "it", "nl", "pt_BR", "ru", "ja")
OBJECTIVES = ("span_corruption", "lm_adaptation", "both")


# ----------------------------------------------------------------------------------------
# 1. The corpus
# ----------------------------------------------------------------------------------------

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


def settings_hash(settings) -> str:
    """A short SHA-256 of JSON-able settings (key order ignored): a cache key of a
    pre-trained model (small_t5, small_gpt2)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def file_hash(path) -> str:
    """SHA-256 of a file's bytes (a SentencePiece model's, for cache keys)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_cached_backbone(model, cache_dir, name: str) -> dict | None:
    """The pre-trained backbone cached as `name` (`<model>-<settings_hash>`) loaded into
    `model.backbone`: its info (`cached` True), or None on a miss (nothing loaded)."""
    weights, meta = Path(cache_dir) / f"{name}.weights.h5", Path(cache_dir) / f"{name}.json"
    if not (weights.is_file() and meta.is_file()):
        return None
    model.backbone.load_weights(str(weights))
    info = json.loads(meta.read_text())
    info["cached"] = True
    return info


def save_cached_backbone(model, cache_dir, name: str, info: dict) -> dict:
    """Cache `model.backbone`'s weights and `info` as `name` (what `load_cached_backbone`
    reads); returns `info` with `cached` False. The weights are written to a temporary
    file and renamed, so a concurrent reader never sees half a file."""
    weights, meta = Path(cache_dir) / f"{name}.weights.h5", Path(cache_dir) / f"{name}.json"
    tmp = weights.with_name(f"tmp{os.getpid()}-" + weights.name)
    # The backbone holds every weight (the LM head is its tied ReversibleEmbedding); saving
    # the task model would also save the optimizer, which a loaded model's fresh one cannot
    # take.
    model.backbone.save_weights(str(tmp))
    os.replace(tmp, weights)
    meta.write_text(json.dumps(info, indent=1, default=float))
    info["cached"] = False
    return info


def history_lists(history) -> dict:
    """A Keras `History`'s curves as JSON-able lists."""
    return {
        k: (v if isinstance(v, (list, float, int)) else list(v)) for k, v in history.history.items()
    }


def corpus_hash(texts: Sequence[str]) -> str:
    """A SHA-256 of the texts (order matters), for cache keys."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------
# 2. The SentencePiece vocabulary
# ----------------------------------------------------------------------------------------


def sentinel_id(vocabulary_size: int, index: int = 0) -> int:
    """The id of `<extra_id_{index}>`: T5 counts sentinels DOWN from the last id
    (`t5.data.preprocessors.sentinel_id` is `vocabulary.vocab_size - 1`)."""
    return int(vocabulary_size) - 1 - int(index)


def _check_int(name, value, minimum):
    # `splits.check_positive_int` with another lower bound (0 extra ids, length >= 2, ...).
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {name}={value!r}.")
    return int(value)


def train_sentencepiece(
    corpus: Sequence[str],
    directory: str | os.PathLike,
    vocabulary_size: int = 4000,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    normalization_rule_name: str = "nmt_nfkc",
    max_sentence_length: int = 4192,
) -> Path:
    """Trains (or reuses) a SentencePiece model with T5's conventions; returns its path.

    The model has `vocabulary_size` pieces in all: `vocabulary_size - num_extra_ids`
    trained pieces with `<pad>`=0, `</s>`=1, `<unk>`=2 and no `<s>` (T5's spiece.model),
    then `num_extra_ids` sentinels appended at the END, `<extra_id_0>` last
    (id vocabulary_size-1), `<extra_id_1>` before it, ... as seqio's
    `SentencePieceVocabulary(extra_ids=100)` numbers them. T5 keeps its sentinels outside
    the proto; keras-hub's `T5Tokenizer` has no `extra_ids` argument, so here they are
    USER_DEFINED pieces of the proto itself: `tokenizer.token_to_id("<extra_id_0>")` and
    `tokenizer.vocabulary_size()` then agree with T5's numbering, and the text
    "<extra_id_0>" encodes to that one id.

    The file is `directory/spm-<hash>.model`, the hash covering the corpus and every
    setting: an existing file is reused (training is deterministic, but takes seconds to
    minutes). `directory` must not be inside a git work tree you do not mean to dirty.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    vocabulary_size = _check_int("vocabulary_size", vocabulary_size, 8)
    num_extra_ids = _check_int("num_extra_ids", num_extra_ids, 0)
    if num_extra_ids > T5_NUM_EXTRA_IDS:
        raise ValueError(
            f"`num_extra_ids` must be at most {T5_NUM_EXTRA_IDS} (T5's sentinels); "
            f"got {num_extra_ids}."
        )
    if vocabulary_size - num_extra_ids < 8:
        raise ValueError(
            f"`vocabulary_size` ({vocabulary_size}) must exceed `num_extra_ids` "
            f"({num_extra_ids}) by at least 8 trained pieces."
        )
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"`model_type` must be 'unigram' or 'bpe'; got {model_type!r}.")
    if not 0.0 < float(character_coverage) <= 1.0:
        raise ValueError(f"`character_coverage` must be in (0, 1]; got {character_coverage!r}.")
    if isinstance(corpus, str) or len(corpus) == 0:
        raise ValueError("`corpus` must be a non-empty sequence of strings.")
    settings = dict(
        vocabulary_size=vocabulary_size,
        num_extra_ids=num_extra_ids,
        model_type=model_type,
        character_coverage=float(character_coverage),
        normalization_rule_name=normalization_rule_name,
        max_sentence_length=max_sentence_length,
        version=1,
    )
    key = hashlib.sha256(
        (corpus_hash(corpus) + json.dumps(settings, sort_keys=True)).encode()
    ).hexdigest()[:16]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"spm-{key}.model"
    if path.is_file():
        return path
    import io

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=buffer,
        vocab_size=vocabulary_size - num_extra_ids,
        model_type=model_type,
        character_coverage=character_coverage,
        normalization_rule_name=normalization_rule_name,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        max_sentence_length=max_sentence_length,
        num_threads=1,
        # A small corpus cannot always fill the requested vocabulary: fail loudly instead.
        hard_vocab_limit=True,
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    for index in reversed(range(num_extra_ids)):
        piece = proto.pieces.add()
        piece.piece = f"<extra_id_{index}>"
        piece.score = 0.0
        piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(proto.SerializeToString())
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a model
    return path


def t5_tokenizer(model_path: str | os.PathLike):
    """`keras_hub.models.T5Tokenizer` on a model from `train_sentencepiece`."""
    import keras_hub

    return keras_hub.models.T5Tokenizer(proto=str(model_path))


def normalize_text(text: str, normalization_rule_name: str = "nmt_nfkc") -> str:
    """`text` as SentencePiece's normalizer sees it (NFKC + whitespace collapsed and
    stripped): what `detokenize(tokenize(text))` returns when no piece is `<unk>`."""
    import sentencepiece as spm

    normalizer = spm.SentencePieceNormalizer(rule_name=normalization_rule_name)
    return normalizer.normalize(text).replace("\u2581", " ").strip()


def tokenize_texts(texts: Sequence[str], tokenizer, batch_size: int = 4096) -> list[np.ndarray]:
    """Each text -> an int32 numpy array of ids (no EOS), batched through the tokenizer."""
    out: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        rows = tokenizer(list(texts[start : start + batch_size]))
        # keras-hub returns python lists for python-list input, a RaggedTensor otherwise.
        rows = rows.to_list() if hasattr(rows, "to_list") else rows
        out.extend(np.asarray(row, np.int32) for row in rows)
    return out


# ----------------------------------------------------------------------------------------
# 3. T5's objectives on token ids (NumPy ports of t5.data.preprocessors)
# ----------------------------------------------------------------------------------------


def num_noise_tokens_and_spans(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's deterministic counts in `random_spans_noise_mask`:
        num_noise_tokens = clip(round(max(length, 2) * noise_density), 1, length - 1)
        num_noise_spans  = max(round(num_noise_tokens / mean_noise_span_length), 1)
    computed in float32 with round-half-to-even, as T5's `tf.round(tf.cast(.., tf.float32))`
    (float32 matters: 190 * 0.15 is 28.5 in float64 (-> 28) but 28.500002 in float32 (-> 29);
    166 lengths below 20,000 differ)."""
    length = max(int(length), 2)
    noise = int(np.round(np.float32(length) * np.float32(noise_density)))
    noise = min(max(noise, 1), length - 1)
    spans = int(np.round(np.float32(noise) / np.float32(mean_noise_span_length)))
    return noise, max(spans, 1)


def _random_segmentation(num_items: int, num_segments: int, rng) -> np.ndarray:
    # T5's `_random_segmentation`: shuffle (num_segments - 1) segment starts among the
    # num_items - 1 gaps; every partition into non-empty segments is equally likely.
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_id = np.cumsum(np.concatenate([[0], first_in_segment]))
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0, rng=None
) -> np.ndarray:
    """T5's `random_spans_noise_mask` (t5/data/preprocessors.py): a bool mask of `length`.

    Spans alternate non-noise, noise, non-noise, ..., starting with non-noise and ending
    with noise; `num_noise_tokens_and_spans` gives the counts; the span lengths are two
    independent uniform random segmentations. `rng`: a `numpy.random.Generator` or seed.
    """
    length = _check_int("length", length, 1)
    if not 0.0 < float(noise_density) < 1.0:
        raise ValueError(f"`noise_density` must be in (0, 1); got {noise_density!r}.")
    if float(mean_noise_span_length) < 1.0:
        raise ValueError(f"`mean_noise_span_length` must be >= 1; got {mean_noise_span_length!r}.")
    rng = np.random.default_rng(rng)
    orig_length, length = length, max(length, 2)  # T5: "increase length to avoid degeneracy"
    num_noise, num_spans = num_noise_tokens_and_spans(length, noise_density, mean_noise_span_length)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_index = np.repeat(np.arange(2 * num_spans), interleaved)
    return (span_index % 2 == 1)[:orig_length]


def noise_span_to_unique_sentinel(
    tokens: np.ndarray, noise_mask: np.ndarray, vocabulary_size: int
) -> np.ndarray:
    """T5's `noise_span_to_unique_sentinel`: each noise span -> one sentinel, the k-th span
    (0-based) getting `sentinel_id(vocabulary_size, k)` = vocabulary_size - 1 - k."""
    tokens = np.asarray(tokens)
    noise_mask = np.asarray(noise_mask, bool)
    if tokens.shape != noise_mask.shape or tokens.ndim != 1:
        raise ValueError(
            f"`tokens` and `noise_mask` must be 1-D of one shape; got "
            f"{tokens.shape} and {noise_mask.shape}."
        )
    prev_is_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise = noise_mask & ~prev_is_noise
    subsequent_noise = noise_mask & prev_is_noise
    sentinels = vocabulary_size - np.cumsum(first_noise)  # = V - 1 - k at the k-th span
    out = np.where(first_noise, sentinels, tokens).astype(tokens.dtype)
    return out[~subsequent_noise]


def nonnoise_span_to_unique_sentinel(tokens, noise_mask, vocabulary_size) -> np.ndarray:
    """T5's `nonnoise_span_to_unique_sentinel`: the same on the complement mask."""
    return noise_span_to_unique_sentinel(tokens, ~np.asarray(noise_mask, bool), vocabulary_size)


def span_corruption(
    tokens,
    vocabulary_size: int,
    rng=None,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    eos_id: int = EOS_ID,
) -> tuple[np.ndarray, np.ndarray]:
    """T5's span corruption of one token sequence: `(inputs, targets)`, each ending in EOS.

    `t5.data.preprocessors.span_corruption` = `denoise(noise_mask_fn=random_spans_noise_mask,
    inputs_fn=noise_span_to_unique_sentinel, targets_fn=nonnoise_span_to_unique_sentinel)`,
    with seqio appending EOS to both features. Since the mask starts with non-noise and ends
    with noise: inputs = n_0 <X_0> n_1 <X_1> ... n_{k-1} <X_{k-1}> </s> and
    targets = <X_0> s_0 <X_1> s_1 ... <X_{k-1}> s_{k-1} </s>, with <X_j> = id V - 1 - j.
    Raises if the spans need more than `num_extra_ids` sentinels.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"`tokens` must be a non-empty 1-D id array; got shape {tokens.shape}.")
    _, num_spans = num_noise_tokens_and_spans(tokens.size, noise_density, mean_noise_span_length)
    if num_spans > num_extra_ids:
        raise ValueError(
            f"A sequence of {tokens.size} tokens has {num_spans} noise spans but "
            f"only `num_extra_ids`={num_extra_ids} sentinels exist; use shorter "
            "sequences."
        )
    mask = random_spans_noise_mask(tokens.size, noise_density, mean_noise_span_length, rng)
    eos = np.array([eos_id], np.int32)
    inputs = np.concatenate([noise_span_to_unique_sentinel(tokens, mask, vocabulary_size), eos])
    targets = np.concatenate([nonnoise_span_to_unique_sentinel(tokens, mask, vocabulary_size), eos])
    return inputs, targets


def random_spans_helper(
    inputs_length: int = 512, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's `random_spans_helper`: the raw chunk length whose span-corrupted inputs (with
    one sentinel per span and EOS) fill `inputs_length`, and the targets' length.
    T5: inputs_length 512 -> (568, 114). Uses Python's `round`, as T5 does here."""
    inputs_length = _check_int("inputs_length", inputs_length, 2)

    def lengths(tokens_length):
        num_noise = int(round(tokens_length * noise_density))
        num_nonnoise = tokens_length - num_noise
        num_spans = int(round(num_noise / mean_noise_span_length))
        return num_nonnoise + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:  # T5's "minor hack"
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def random_prefix_noise_mask(length: int, rng=None, noise_density: float = 0.5) -> np.ndarray:
    """T5's `random_prefix_noise_mask` (the `prefix_lm` objective): noise = a suffix.

    The prefix has n ~ Uniform{min_n, ..., length - 1} tokens, min_n =
    clip(round((1 - 2 * noise_density) * (length - 1)), 1, length - 1); at T5's
    noise_density 0.5 the split point is uniform over 1..length-1, so both parts are
    non-empty.
    """
    length = _check_int("length", length, 2)
    if not 0.0 < float(noise_density) <= 0.5:
        raise ValueError(
            f"`noise_density` must be in (0, 0.5] (T5 raises above 0.5); got {noise_density!r}."
        )
    rng = np.random.default_rng(rng)
    max_inputs = length - 1
    min_inputs = min(
        max_inputs,
        max(1, int(np.round(np.float32(1 - 2 * noise_density) * np.float32(max_inputs)))),
    )
    num_inputs = int(rng.integers(min_inputs, max_inputs + 1))
    return np.arange(length) >= num_inputs


def lm_adaptation(
    tokens, rng=None, noise_density: float = 0.5, eos_id: int = EOS_ID
) -> tuple[np.ndarray, np.ndarray]:
    """LM adaptation (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt
    Tuning", sec. 3.2; T5's `prefix_lm` preprocessor): inputs = a random prefix + EOS,
    targets = the rest + EOS, so `inputs[:-1] ++ targets[:-1] == tokens`."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(
            f"`tokens` must be a 1-D id array of at least 2 ids; got shape {tokens.shape}."
        )
    mask = random_prefix_noise_mask(tokens.size, rng, noise_density)
    eos = np.array([eos_id], np.int32)
    return np.concatenate([tokens[~mask], eos]), np.concatenate([tokens[mask], eos])


def restore_from_span_corruption(
    inputs,
    targets,
    vocabulary_size: int,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    eos_id: int = EOS_ID,
) -> np.ndarray:
    """Inverts `span_corruption`: each sentinel of `inputs` replaced by what follows the same
    sentinel in `targets` (up to the next sentinel or EOS). Trailing EOS/pad are dropped."""

    def strip(ids):
        ids = list(np.asarray(ids).tolist())
        while ids and ids[-1] in (eos_id, PAD_ID):
            ids.pop()
        return ids

    first_sentinel = vocabulary_size - num_extra_ids
    spans, current = {}, None
    for t in strip(targets):
        if t >= first_sentinel:
            current = t
            spans[current] = []
        elif current is None:
            raise ValueError("`targets` must start with a sentinel.")
        else:
            spans[current].append(t)
    out = []
    for t in strip(inputs):
        out.extend(spans[t] if t >= first_sentinel else [t])
    return np.asarray(out, np.int32)


# ----------------------------------------------------------------------------------------
# 4. Streams of model features
# ----------------------------------------------------------------------------------------


def pack_seq2seq(inputs, targets, encoder_length: int, decoder_length: int) -> tuple:
    """One example -> `T5Seq2SeqLM` features, as keras-hub's `T5Seq2SeqLMPreprocessor`
    packs them: encoder = inputs padded with <pad>; decoder input = <pad> (T5's decoder
    start) + targets[:-1]; labels = targets; sample weight 1 on real target positions.
    Returns `(x: dict, y, sample_weight)` of numpy arrays (truncating over-long parts)."""
    inputs = np.asarray(inputs, np.int32)[:encoder_length]
    targets = np.asarray(targets, np.int32)[:decoder_length]
    enc = np.full(encoder_length, PAD_ID, np.int32)
    enc[: inputs.size] = inputs
    labels = np.full(decoder_length, PAD_ID, np.int32)
    labels[: targets.size] = targets
    dec = np.concatenate([[PAD_ID], labels[:-1]]).astype(np.int32)
    weight = np.arange(decoder_length) < targets.size
    x = {
        "encoder_token_ids": enc,
        "encoder_padding_mask": np.arange(encoder_length) < inputs.size,
        "decoder_token_ids": dec,
        "decoder_padding_mask": weight.copy(),
    }
    return x, labels, weight.astype(np.float32)


def chunk_length_for(
    objective: str,
    sequence_length: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> int:
    """How many raw tokens one example of `objective` consumes so that its inputs (and its
    targets) fit `sequence_length`: `random_spans_helper` for span corruption, and
    sequence_length - 1 for LM adaptation (each part plus EOS fits)."""
    if objective == "span_corruption":
        return random_spans_helper(sequence_length, noise_density, mean_noise_span_length)[0]
    if objective == "lm_adaptation":
        return sequence_length - 1
    raise ValueError(
        f"`objective` must be 'span_corruption' or 'lm_adaptation'; got {objective!r}."
    )


def decoder_length_for(
    objective: str,
    sequence_length: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> int:
    """The decoder length of `objective`'s examples: span corruption's targets are short
    (`random_spans_helper`'s targets length, as T5 packs 512 inputs with 114 targets), so
    they are padded only that far; LM adaptation and "both" use `sequence_length`."""
    if objective == "span_corruption":
        return random_spans_helper(sequence_length, noise_density, mean_noise_span_length)[1]
    if objective in OBJECTIVES:
        return int(sequence_length)
    raise ValueError(f"`objective` must be one of {OBJECTIVES}; got {objective!r}.")


def pretraining_examples(
    token_docs: Sequence[np.ndarray],
    objective: str,
    sequence_length: int,
    vocabulary_size: int,
    seed: int = 0,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    repeat: bool = True,
) -> Iterator[tuple]:
    """An endless (or one-pass with `repeat=False`) deterministic stream of packed examples.

    As T5's pre-training pipeline (`reduce_concat_tokens` + `split_tokens` + the objective):
    each pass shuffles the documents (seed, pass), concatenates their ids into one stream,
    cuts it into chunks (`chunk_length_for`; the last partial chunk is dropped) and applies
    the objective to each chunk. `objective="both"` alternates span corruption and LM
    adaptation chunk by chunk. Yields `pack_seq2seq` triples with encoder length
    `sequence_length` and decoder length `decoder_length_for(objective, sequence_length)`.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}; got {objective!r}.")
    sequence_length = _check_int("sequence_length", sequence_length, 4)
    docs = [np.asarray(d, np.int32) for d in token_docs if len(d)]
    if not docs:
        raise ValueError("`token_docs` holds no tokens.")
    kinds = ("span_corruption", "lm_adaptation") if objective == "both" else (objective,)
    lengths = {
        k: chunk_length_for(k, sequence_length, noise_density, mean_noise_span_length)
        for k in kinds
    }
    decoder_length = decoder_length_for(
        objective, sequence_length, noise_density, mean_noise_span_length
    )
    epoch = 0
    while True:
        rng = np.random.default_rng([seed, epoch])
        stream = np.concatenate([docs[i] for i in rng.permutation(len(docs))])
        position, index = 0, 0
        while True:
            kind = kinds[index % len(kinds)]
            chunk = stream[position : position + lengths[kind]]
            if chunk.size < lengths[kind]:
                break
            position += lengths[kind]
            index += 1
            if kind == "span_corruption":
                pair = span_corruption(
                    chunk,
                    vocabulary_size,
                    rng,
                    noise_density,
                    mean_noise_span_length,
                    num_extra_ids,
                )
            else:
                pair = lm_adaptation(chunk, rng)
            yield pack_seq2seq(*pair, sequence_length, decoder_length)
        if index == 0:
            raise ValueError(
                f"The corpus holds fewer tokens ({stream.size}) than one chunk "
                f"({max(lengths.values())}); lower `sequence_length`."
            )
        epoch += 1
        if not repeat:
            return


def pretraining_dataset(
    token_docs,
    objective: str,
    sequence_length: int,
    vocabulary_size: int,
    batch_size: int,
    seed: int = 0,
    **kwargs,
):
    """`pretraining_examples` as a batched `tf.data.Dataset` of `(x, y, sample_weight)`."""
    import tensorflow as tf

    batch_size = check_positive_int(batch_size, "batch_size")
    L = int(sequence_length)
    D = decoder_length_for(
        objective, L, kwargs.get("noise_density", 0.15), kwargs.get("mean_noise_span_length", 3.0)
    )
    signature = (
        {
            "encoder_token_ids": tf.TensorSpec((L,), tf.int32),
            "encoder_padding_mask": tf.TensorSpec((L,), tf.bool),
            "decoder_token_ids": tf.TensorSpec((D,), tf.int32),
            "decoder_padding_mask": tf.TensorSpec((D,), tf.bool),
        },
        tf.TensorSpec((D,), tf.int32),
        tf.TensorSpec((D,), tf.float32),
    )
    ds = tf.data.Dataset.from_generator(
        lambda: pretraining_examples(token_docs, objective, L, vocabulary_size, seed, **kwargs),
        output_signature=signature,
    )
    return ds.batch(batch_size, drop_remainder=True).prefetch(2)


def stack_examples(examples) -> tuple:
    """A list of `pack_seq2seq` triples -> one batch `(x, y, sample_weight)` of arrays."""
    examples = list(examples)
    if not examples:
        raise ValueError("`examples` is empty.")
    x = {k: np.stack([e[0][k] for e in examples]) for k in examples[0][0]}
    return x, np.stack([e[1] for e in examples]), np.stack([e[2] for e in examples])


def unigram_cross_entropy(
    train_labels, train_weights, heldout_labels, heldout_weights, vocabulary_size: int
) -> float:
    """Nats per target token of a unigram model of the training targets (add-one smoothed
    counts over the vocabulary) on the held-out targets: the loss a model reaches by
    predicting token frequencies only. Only positions with weight > 0 count."""
    train = np.asarray(train_labels)[np.asarray(train_weights) > 0]
    held = np.asarray(heldout_labels)[np.asarray(heldout_weights) > 0]
    counts = np.bincount(train, minlength=vocabulary_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[held].mean())


def unigram_entropy(labels, weights) -> float:
    """Entropy (nats) of the empirical token distribution of `labels` where weight > 0: the
    best any unigram model can do on these very targets (a lower bound on
    `unigram_cross_entropy`)."""
    held = np.asarray(labels)[np.asarray(weights) > 0]
    p = np.bincount(held).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())
