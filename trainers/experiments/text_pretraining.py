"""Offline T5 pre-training examples: a deterministic stream of T5's unsupervised objectives
(span corruption, LM adaptation) packed as `T5Seq2SeqLM` features.

No pretrained T5 and no C4 exist offline, so the promptability experiment (Wu et al.,
"Continued Pretraining for Better Zero- and Few-Shot Promptability", EMNLP 2022) starts from
a small keras-hub T5 pre-trained here (`trainers.experiments.small_t5`). The pipeline, one
module per concern:

  english_corpus      the offline English corpus (`trainers.experiments.english_corpus`)
  t5_vocabulary       a T5-style SentencePiece vocabulary and T5's special ids
  t5_objectives       span corruption and LM adaptation on token ids (NumPy ports of T5's)
  text_pretraining    (this module) their examples as model features:
    pack_seq2seq / chunk_length_for / decoder_length_for
                      one (inputs, targets) pair -> `T5Seq2SeqLM` features, and the lengths
    pretraining_examples / pretraining_dataset
                      a deterministic stream of packed examples, and its `tf.data.Dataset`
    stack_examples    a list of examples -> one batch
    unigram_cross_entropy / unigram_entropy
                      the losses of predicting token frequencies only (reference points)
  pretrained_cache    the cache of pre-trained backbones, keyed by their settings
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np

from tf_metaalign.data.splits import check_positive_int
from trainers.experiments.t5_objectives import lm_adaptation, random_spans_helper, span_corruption
from trainers.experiments.t5_vocabulary import PAD_ID, T5_NUM_EXTRA_IDS, check_int

OBJECTIVES = ("span_corruption", "lm_adaptation", "both")


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
    sequence_length = check_int("sequence_length", sequence_length, 4)
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
    as_numpy: bool | None = None,
    **kwargs,
):
    """`pretraining_examples` as a batched `tf.data.Dataset` of `(x, y, sample_weight)`.

    `as_numpy` (default: on every Keras backend but TensorFlow): an endless generator of
    the same batches as NumPy arrays (`stack_examples` of `batch_size` examples), for
    `model.fit(..., steps_per_epoch=...)` without TensorFlow.
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    if as_numpy is None:
        import keras

        as_numpy = keras.backend.backend() != "tensorflow"
    if as_numpy:
        return _numpy_batches(
            pretraining_examples(
                token_docs, objective, sequence_length, vocabulary_size, seed, **kwargs
            ),
            batch_size,
        )
    import tensorflow as tf

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


def _numpy_batches(examples, batch_size):
    """Consecutive `batch_size` examples of `examples`, stacked; the last partial batch
    dropped (as `pretraining_dataset`'s `drop_remainder`)."""
    while True:
        chunk = list(itertools.islice(examples, batch_size))
        if len(chunk) < batch_size:
            return
        yield stack_examples(chunk)


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
