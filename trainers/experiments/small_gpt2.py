"""A small keras-hub GPT-2 built from a config and pre-trained offline with the causal LM
objective on the small T5's corpus and vocabulary (the decoder of the promptability
experiment, `trainers.promptability_decoder`; no pretrained decoder exists here).

  GPT2_SIZES / gpt2_config / build_gpt2
                             `keras_hub.models.GPT2CausalLM` around a `GPT2Backbone` of a
                             named size (dropout 0, as the T5's pre-training)
  causal_lm_chunks           the corpus as next-token examples: documents shuffled per pass,
                             each preceded by EOS (the document boundary, GPT-2's
                             <|endoftext|> role: T5's vocabulary has no BOS), concatenated and
                             cut into chunks of sequence_length + 1
  pretrain_gpt2              `model.fit` on those chunks (Adam, global-norm clipping 1.0)
  cached_pretrained_gpt2     corpus -> SentencePiece (the T5's, `t5_vocabulary.
                             train_sentencepiece`, shared cache) -> GPT-2 -> pre-training, the
                             weights cached under `cache_dir` by a content hash of the settings
                             (as `small_t5.cached_pretrained_t5`)

The corpus is `english_corpus.english_corpus()` (WordNet definitions and examples, Django's
English UI strings) and the vocabulary the same 4,000-piece T5 SentencePiece model: the
decoder and the small T5 read the same text with the same ids. A held-out slice of the
documents (`heldout_texts`, never trained on) gives the held-out nats per token next to a
unigram model's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import keras
import numpy as np

from tf_metaalign.data.splits import check_positive_int
from trainers.experiments.english_corpus import corpus_hash, english_corpus
from trainers.experiments.pretrained_cache import (
    file_hash,
    fit,
    history_lists,
    load_cached_backbone,
    save_cached_backbone,
    settings_hash,
)
from trainers.experiments.t5_vocabulary import (
    EOS_ID,
    T5_NUM_EXTRA_IDS,
    t5_tokenizer,
    tokenize_texts,
    train_sentencepiece,
)

#: Named sizes: "tiny" for tests, "small" pre-trains in minutes on 2 CPU cores.
GPT2_SIZES = {
    "tiny": dict(num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64),
    "small": dict(num_layers=4, num_heads=4, hidden_dim=128, intermediate_dim=512),
}


def gpt2_config(
    size: str = "small", vocabulary_size: int = 4000, max_sequence_length: int = 128, **overrides
) -> dict:
    """The `GPT2Backbone` arguments of a named size, dropout 0, with overrides."""
    if size not in GPT2_SIZES:
        raise ValueError(f"`size` must be one of {tuple(GPT2_SIZES)}; got {size!r}.")
    unknown = set(overrides) - set(GPT2_SIZES[size]) - {"dropout"}
    if unknown:
        raise ValueError(
            f"Unknown GPT-2 config overrides {sorted(unknown)}; allowed: "
            f"{sorted(set(GPT2_SIZES[size]) | {'dropout'})}."
        )
    check_positive_int(vocabulary_size, "vocabulary_size")
    check_positive_int(max_sequence_length, "max_sequence_length")
    return {
        "vocabulary_size": int(vocabulary_size),
        "max_sequence_length": int(max_sequence_length),
        "dropout": 0.0,
        **GPT2_SIZES[size],
        **overrides,
    }


def build_gpt2(config: dict, seed: int = 0):
    """`GPT2CausalLM(backbone=GPT2Backbone(**config), preprocessor=None)`, its initial
    weights drawn after `keras.utils.set_random_seed(seed)` (reseeds globally)."""
    import keras_hub

    keras.utils.set_random_seed(int(seed))
    backbone = keras_hub.models.GPT2Backbone(**config)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def heldout_split(num_texts: int, heldout: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(train_indices, heldout_indices)` of the corpus: `heldout` texts drawn with `seed`."""
    heldout = min(int(heldout), max(num_texts - 1, 0))
    order = np.random.default_rng([seed, 7]).permutation(num_texts)
    return np.sort(order[heldout:]), np.sort(order[:heldout])


def causal_lm_chunks(
    token_docs: Sequence[np.ndarray],
    sequence_length: int,
    count: int,
    seed: int = 0,
    eos_id: int = EOS_ID,
) -> np.ndarray:
    """`count` rows of `sequence_length + 1` ids: the documents of each pass shuffled with
    `(seed, pass)`, each as `[eos_id] + ids`, concatenated and cut (the last partial chunk
    of a pass dropped). Row r's inputs are `[:, :-1]`, its next-token labels `[:, 1:]`."""
    sequence_length = check_positive_int(sequence_length, "sequence_length")
    count = check_positive_int(count, "count")
    docs = [np.asarray(d, np.int32) for d in token_docs if len(d)]
    if not docs:
        raise ValueError("`token_docs` holds no tokens.")
    eos = np.asarray([eos_id], np.int32)
    width, rows, epoch = sequence_length + 1, [], 0
    while sum(len(r) for r in rows) < count:
        order = np.random.default_rng([seed, epoch]).permutation(len(docs))
        stream = np.concatenate([x for i in order for x in (eos, docs[i])])
        usable = stream.size // width
        if usable == 0:
            raise ValueError(
                f"The corpus holds fewer tokens ({stream.size}) than one chunk ({width}); "
                "lower `sequence_length`."
            )
        rows.append(stream[: usable * width].reshape(usable, width))
        epoch += 1
    return np.concatenate(rows)[:count]


def compile_for_pretraining(model, learning_rate: float = 1e-3, jit_compile="auto"):
    """Adam (global-norm clipping 1.0) and token cross-entropy from logits, averaged over
    the real tokens (`mean_with_sample_weight`); no metrics (keras-hub's CausalLM would add
    its own weighted accuracy)."""
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=learning_rate, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[],
        jit_compile=jit_compile,
    )
    return model


def pretrain_gpt2(
    model,
    token_docs: Sequence[np.ndarray],
    steps: int = 1000,
    batch_size: int = 32,
    sequence_length: int = 64,
    learning_rate: float = 1e-3,
    seed: int = 0,
    log_every: int | None = None,
    jit_compile="auto",
    callbacks: Sequence = (),
):
    """Pre-trains `model` (a `GPT2CausalLM`) on `steps` batches of `causal_lm_chunks`
    (next-token prediction on every position). Returns the Keras history with "seconds"
    and "tokens_per_second" (after the first logged interval, which traces) added."""
    steps = check_positive_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    log_every = max(1, steps // 20 if log_every is None else int(log_every))
    log_every = min(log_every, steps)
    chunks = causal_lm_chunks(token_docs, sequence_length, steps * batch_size, seed)
    x = {"token_ids": chunks[:, :-1], "padding_mask": np.ones_like(chunks[:, :-1])}
    y = chunks[:, 1:]
    compile_for_pretraining(model, learning_rate, jit_compile)
    epochs = max(1, steps // log_every)
    start = time.perf_counter()
    first = []

    class _FirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if not first:
                first.append(time.perf_counter())

    # The rows are already in a seeded shuffled order: shuffle=False keeps every step's
    # batch a function of the settings.
    history = fit(
        model,
        x,
        y,
        batch_size=batch_size,
        steps_per_epoch=log_every,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[_FirstEpoch(), *callbacks],
    )
    end = time.perf_counter()
    steady = (epochs - 1) * log_every * batch_size * sequence_length
    history.history["seconds"] = end - start
    history.history["tokens_per_second"] = (
        steady / (end - first[0]) if epochs > 1 and end > first[0] else float("nan")
    )
    history.history["steps"] = [log_every * (i + 1) for i in range(epochs)]
    return history


def heldout_nll(model, token_docs, sequence_length: int, count: int = 64) -> float:
    """Mean nats per token of next-token prediction on `count` chunks of `token_docs`
    (computed in NumPy from the logits)."""
    chunks = causal_lm_chunks(token_docs, sequence_length, count, seed=12345)
    total, n = 0.0, 0
    for start in range(0, count, 32):
        rows = chunks[start : start + 32]
        x = {"token_ids": rows[:, :-1], "padding_mask": np.ones_like(rows[:, :-1])}
        logits = np.asarray(model(x, training=False), np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= float(np.take_along_axis(log_p, rows[:, 1:, None], -1).sum())
        n += rows[:, 1:].size
    return total / n


def unigram_nll(train_docs, heldout_docs, vocabulary_size: int) -> float:
    """Nats per token on `heldout_docs` of the add-one unigram model of `train_docs`
    (EOS counted once per document, as the chunks hold it)."""
    counts = np.ones(vocabulary_size)
    for d in train_docs:
        np.add.at(counts, d, 1)
    counts[EOS_ID] += len(train_docs)
    log_p = np.log(counts / counts.sum())
    total = sum(float(log_p[d].sum()) + log_p[EOS_ID] for d in heldout_docs)
    return -total / sum(len(d) + 1 for d in heldout_docs)


def cached_pretrained_gpt2(
    cache_dir: str | os.PathLike,
    corpus: Sequence[str] | None = None,
    size: str = "small",
    vocabulary_size: int = 4000,
    steps: int = 1500,
    batch_size: int = 32,
    sequence_length: int = 64,
    learning_rate: float = 1e-3,
    seed: int = 0,
    max_sequence_length: int = 128,
    heldout_texts: int = 2000,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    callbacks: Sequence = (),
):
    """A pre-trained small GPT-2 paid for once: `(model, tokenizer, info)`.

    The vocabulary is `train_sentencepiece(corpus, cache_dir / "spm", vocabulary_size,
    num_extra_ids)`, the small T5's (the same file when the settings match); the weights
    are `cache_dir / "gpt2-<hash>.weights.h5"`, the hash covering the corpus, the
    vocabulary file's bytes, the config and every training setting. A hit builds the model
    and loads the weights; a miss trains on the corpus minus `heldout_texts` texts and saves.
    `info`: the settings, the hash, the loss curve, tokens per second, the held-out nats per
    token of the model and of a unigram model, and `cached`.
    """
    corpus = english_corpus() if corpus is None else list(corpus)
    cache_dir = Path(cache_dir)
    spm_path = train_sentencepiece(corpus, cache_dir / "spm", vocabulary_size, num_extra_ids)
    tokenizer = t5_tokenizer(spm_path)
    config = gpt2_config(size, tokenizer.vocabulary_size(), max_sequence_length)
    settings = dict(
        config=config,
        objective="causal_lm",
        steps=steps,
        batch_size=batch_size,
        sequence_length=sequence_length,
        learning_rate=learning_rate,
        seed=seed,
        heldout_texts=heldout_texts,
        corpus=corpus_hash(corpus),
        spm=file_hash(spm_path),
        version=1,
    )
    key = settings_hash(settings)
    name = f"gpt2-{key}"
    model = build_gpt2(config, seed)
    info = load_cached_backbone(model, cache_dir, name)
    if info is not None:
        return model, tokenizer, info
    docs = tokenize_texts(corpus, tokenizer)
    train_index, heldout_index = heldout_split(len(docs), heldout_texts, seed)
    train_docs = [docs[i] for i in train_index]
    heldout_docs = [docs[i] for i in heldout_index] or train_docs[:100]
    before = heldout_nll(model, heldout_docs, sequence_length)
    history = pretrain_gpt2(
        model,
        train_docs,
        steps,
        batch_size,
        sequence_length,
        learning_rate,
        seed,
        callbacks=callbacks,
    )
    info = {
        "key": key,
        "settings": settings,
        "spm_path": str(spm_path),
        "parameters": int(model.backbone.count_params()),
        "history": history_lists(history),
        "heldout_nll_initial": before,
        "heldout_nll": heldout_nll(model, heldout_docs, sequence_length),
        "heldout_nll_unigram": unigram_nll(train_docs, heldout_docs, config["vocabulary_size"]),
        "uniform_nll": float(np.log(config["vocabulary_size"])),
    }
    return model, tokenizer, save_cached_backbone(model, cache_dir, name, info)
