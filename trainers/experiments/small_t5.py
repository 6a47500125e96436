"""A small keras-hub T5 built from a config and pre-trained offline (the first stage of the
promptability experiment; no pretrained T5 exists here).

  T5_SIZES / build_t5        `keras_hub.models.T5Seq2SeqLM` (T5 v1.1 style: gated GELU,
                             untied embeddings, no dropout in pre-training) of a named size
  pretrain_t5                `model.fit` on span corruption / LM adaptation / both
                             (`trainers.experiments.text_pretraining`) with the package's Adafactor
                             (T5's settings) or Adam; returns the history
  heldout_loss               nats per target token on fixed held-out examples
  cached_pretrained_t5       corpus -> SentencePiece -> T5 -> pre-training, each stage cached
                             under `cache_dir` by a content hash of its settings

Measured (2 shared CPU cores, "small" = 2.6M parameters with a 4,000-piece vocabulary,
span corruption, batch 32, sequence length 64, `Adafactor.t5` at a constant 1e-2, corpus
`english_corpus()` minus 3,000 held-out texts): about 1.5 steps/s, i.e. 6.1k encoder+decoder
positions/s (1,500 steps in 17 min) with the decoder then padded to 64; with T5's short
targets (`decoder_length_for`: 14) 1.3 steps/s under a heavier load of the shared machine,
so no speed-up could be measured there. Held-out nats per target token, every 100 steps from
100 to 1,500: 5.32 5.07 4.82 4.73 4.65 4.61 4.57 4.56 4.53 4.51 4.47 4.47 4.43 4.43 4.41
(uniform: ln 4000 = 8.29); a unigram model of the training targets scores 5.67, the
held-out targets' own unigram entropy is 5.41. So 100 steps already beat unigram
frequency (by 0.35 nats), 200 steps clearly (0.6), and by more than 1 nat from 500 steps.

Wu et al. (EMNLP 2022) start from T5 v1.1 "LM adapted" (Lester et al. 2021): span
corruption (Raffel et al. 2020) then 100k steps of the prefix-LM objective; `objective="both"`
mixes the two instead of running them in sequence.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import keras
import numpy as np

from tf_metaalign.data.splits import check_positive_int
from trainers.experiments import text_pretraining as tp
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
    T5_NUM_EXTRA_IDS,
    t5_tokenizer,
    tokenize_texts,
    train_sentencepiece,
)

#: Named sizes. "tiny" is for tests; "small" pre-trains in minutes on 2 CPU cores; "base-ish"
#: is a long run (T5-small's widths, fewer layers).
T5_SIZES = {
    "tiny": dict(num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64, key_value_dim=16),
    "small": dict(
        num_layers=4, num_heads=4, hidden_dim=128, intermediate_dim=256, key_value_dim=32
    ),
    "base-ish": dict(
        num_layers=6, num_heads=8, hidden_dim=512, intermediate_dim=1024, key_value_dim=64
    ),
}
#: T5 v1.1 (the checkpoints LM adaptation starts from): gated GELU, untied input/output
#: embeddings, epsilon 1e-6; dropout 0 during pre-training (T5 v1.1's pre-training setting).
T5_V1_1 = dict(
    activation="gelu",
    use_gated_activation=True,
    layer_norm_epsilon=1e-6,
    tie_embedding_weights=False,
    dropout=0.0,
)
OPTIMIZERS = ("adafactor", "adam")


def t5_config(size: str = "small", vocabulary_size: int = 4000, **overrides) -> dict:
    """The `T5Backbone` arguments of a named size (`T5_SIZES` + `T5_V1_1`), with overrides."""
    if size not in T5_SIZES:
        raise ValueError(f"`size` must be one of {tuple(T5_SIZES)}; got {size!r}.")
    unknown = set(overrides) - set(T5_SIZES[size]) - set(T5_V1_1)
    if unknown:
        raise ValueError(
            f"Unknown T5 config overrides {sorted(unknown)}; allowed: "
            f"{sorted(set(T5_SIZES[size]) | set(T5_V1_1))}."
        )
    check_positive_int(vocabulary_size, "vocabulary_size")
    return {"vocabulary_size": int(vocabulary_size), **T5_SIZES[size], **T5_V1_1, **overrides}


def build_t5(config: dict, seed: int = 0):
    """`T5Seq2SeqLM(backbone=T5Backbone(**config), preprocessor=None)`.

    The initial weights are drawn after `keras.utils.set_random_seed(seed)` (keras-hub's T5
    layers take no seed), so they are a function of (config, seed); this reseeds Python,
    NumPy and TensorFlow globally."""
    import keras_hub

    keras.utils.set_random_seed(int(seed))
    backbone = keras_hub.models.T5Backbone(**config)
    return keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)


def make_optimizer(name: str = "adafactor", learning_rate: float = 1e-2):
    """T5's pre-training optimizer: `Adafactor.t5` (no momentum, decay 0.8, update clipping
    1.0, parameter scale), at a constant rate (T5 uses 1e-2 with inverse-square-root decay
    after 10k steps; runs here are shorter). "adam": `keras.optimizers.Adam`."""
    if name == "adafactor":
        from tf_metaalign.optimizers import Adafactor

        return Adafactor.t5(learning_rate=learning_rate)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate=learning_rate)
    raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}; got {name!r}.")


def compile_for_pretraining(
    model, optimizer="adafactor", learning_rate: float = 1e-2, jit_compile="auto"
):
    """Compiles with token cross-entropy from logits averaged over the real target tokens
    (`reduction="mean_with_sample_weight"`: Keras's default divides by every position,
    padding included) and a weighted token accuracy. A fresh optimizer state."""
    if isinstance(optimizer, str):
        optimizer = make_optimizer(optimizer, learning_rate)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=jit_compile,
    )
    return model


class _Timer(keras.callbacks.Callback):
    """Wall time of the whole fit and of the part after the first epoch (which traces)."""

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()
        self.first_epoch_end = None

    def on_epoch_end(self, epoch, logs=None):
        if self.first_epoch_end is None:
            self.first_epoch_end = time.perf_counter()

    def on_train_end(self, logs=None):
        end = time.perf_counter()
        self.seconds = end - self.start
        self.steady_seconds = end - (self.first_epoch_end or self.start)


def pretrain_t5(
    model,
    tokenizer,
    corpus: Sequence[str] | None,
    objective: str = "span_corruption",
    steps: int = 1000,
    batch_size: int = 32,
    sequence_length: int = 64,
    learning_rate: float = 1e-2,
    seed: int = 0,
    progress: bool = True,
    optimizer: str = "adafactor",
    log_every: int | None = None,
    token_docs: Sequence[np.ndarray] | None = None,
    jit_compile="auto",
    callbacks: Sequence = (),
):
    """Pre-trains `model` (a `T5Seq2SeqLM`) with `model.fit` on a stream (`tf.data` on
    TensorFlow, NumPy batches on other backends) of `objective` ("span_corruption",
    "lm_adaptation" or "both") built from `corpus`.

    `steps` optimizer steps of `batch_size` examples whose encoder and decoder inputs have
    `sequence_length` ids (span corruption's decoder: `tp.decoder_length_for`, shorter). The
    history has one entry every `log_every` steps (default steps // 20):
    `history.history["loss"]` is the mean nats per target token over those steps.
    `optimizer`: "adafactor" (`Adafactor.t5`), "adam" or a Keras optimizer (the model is
    compiled here with a fresh optimizer state). `token_docs` (the corpus already
    tokenized; `corpus` may then be None) skips tokenization. `seed` seeds the data stream
    (shuffles and masks), not the weights (`build_t5`). Adds to `history.history`:
    "tokens_per_second" (encoder + decoder positions per second after the first logged
    interval, which includes tracing), "seconds" and "steps" (the step count at each entry).
    `callbacks` go to `model.fit` (one "epoch" = `log_every` steps).
    """
    if objective not in tp.OBJECTIVES:
        raise ValueError(f"`objective` must be one of {tp.OBJECTIVES}; got {objective!r}.")
    steps = check_positive_int(steps, "steps")
    log_every = steps // 20 if log_every is None else log_every
    log_every = min(check_positive_int(max(log_every, 1), "log_every"), steps)
    if token_docs is None:
        token_docs = tokenize_texts(corpus, tokenizer)
    vocabulary_size = int(tokenizer.vocabulary_size())
    model_vocab = int(model.backbone.vocabulary_size)
    if model_vocab != vocabulary_size:
        raise ValueError(
            f"The model's vocabulary ({model_vocab}) differs from the tokenizer's "
            f"({vocabulary_size})."
        )
    ds = tp.pretraining_dataset(
        token_docs, objective, sequence_length, vocabulary_size, batch_size, seed
    )
    # Always compiled here: keras-hub's Task compiles itself at construction with its own
    # defaults (Adam 2e-5, a loss averaged over padding too).
    compile_for_pretraining(model, optimizer, learning_rate, jit_compile)
    timer = _Timer()
    epochs = max(1, steps // log_every)
    # shuffle=False: the stream shuffles itself (Keras warns that it ignores shuffle=True).
    history = fit(
        model,
        ds.repeat() if hasattr(ds, "repeat") else ds,  # the NumPy route's stream is endless
        steps_per_epoch=log_every,
        epochs=epochs,
        shuffle=False,
        verbose=2 if progress else 0,
        callbacks=[timer, *callbacks],
    )
    steady_steps = (epochs - 1) * log_every
    positions = sequence_length + tp.decoder_length_for(objective, sequence_length)
    history.history["seconds"] = timer.seconds
    history.history["tokens_per_second"] = (
        positions * batch_size * steady_steps / timer.steady_seconds
        if steady_steps and timer.steady_seconds > 0
        else float("nan")
    )
    history.history["steps"] = [log_every * (i + 1) for i in range(epochs)]
    return history


def heldout_loss(model, x, y, sample_weight, batch_size: int = 64) -> float:
    """Mean nats per real target token (weight > 0), computed from the logits in NumPy."""
    total, count = 0.0, 0.0
    for start in range(0, len(y), batch_size):
        xb = {k: v[start : start + batch_size] for k, v in x.items()}
        logits = np.asarray(model(xb, training=False), np.float64)
        logits = logits - logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        yb, wb = y[start : start + batch_size], sample_weight[start : start + batch_size]
        nll = -np.take_along_axis(log_p, yb[..., None], -1)[..., 0]
        total += float((nll * wb).sum())
        count += float(wb.sum())
    return total / count


def cached_pretrained_t5(
    cache_dir: str | os.PathLike,
    corpus: Sequence[str] | None = None,
    size: str = "small",
    vocabulary_size: int = 4000,
    objective: str = "span_corruption",
    steps: int = 2000,
    batch_size: int = 32,
    sequence_length: int = 64,
    learning_rate: float = 1e-2,
    seed: int = 0,
    optimizer: str = "adafactor",
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    progress: bool = True,
    config_overrides: dict | None = None,
    callbacks: Sequence = (),
):
    """A pre-trained T5 paid for once: `(model, tokenizer, info)`.

    The SentencePiece model is `train_sentencepiece(corpus, cache_dir / "spm")` (default
    corpus: `english_corpus()`); the weights are
    `cache_dir / "t5-<hash>.weights.h5"`, the hash covering the corpus, the vocabulary file's
    bytes, the model config and every training setting. A hit builds the model from the config
    and loads the weights (no training); a miss trains and saves (`callbacks` go to `fit`,
    e.g. progress lines; not part of the hash). `info` holds the settings,
    the hash, the history ("token_nll" curve, tokens per second) and `cached` (True on a hit).
    """
    corpus = english_corpus() if corpus is None else list(corpus)
    cache_dir = Path(cache_dir)
    spm_path = train_sentencepiece(corpus, cache_dir / "spm", vocabulary_size, num_extra_ids)
    tokenizer = t5_tokenizer(spm_path)
    config = t5_config(size, tokenizer.vocabulary_size(), **(config_overrides or {}))
    settings = dict(
        config=config,
        objective=objective,
        steps=steps,
        batch_size=batch_size,
        sequence_length=sequence_length,
        learning_rate=learning_rate,
        seed=seed,
        optimizer=optimizer,
        corpus=corpus_hash(corpus),
        spm=file_hash(spm_path),
        version=1,
    )
    key = settings_hash(settings)
    name = f"t5-{key}"
    model = build_t5(config, seed)
    info = load_cached_backbone(model, cache_dir, name)
    if info is not None:
        return model, tokenizer, info
    history = pretrain_t5(
        model,
        tokenizer,
        corpus,
        objective,
        steps,
        batch_size,
        sequence_length,
        learning_rate,
        seed,
        progress,
        optimizer,
        callbacks=callbacks,
    )
    info = {
        "key": key,
        "settings": settings,
        "spm_path": str(spm_path),
        "history": history_lists(history),
    }
    return model, tokenizer, save_cached_backbone(model, cache_dir, name, info)
