"""A `PromptedT5` as a `keras.Model` from T5 inputs to vocabulary logits, for `fit`.

`PromptedT5` keeps the backbone's contract (a dict of hidden states), so it cannot be
compiled with a token loss directly; `PromptedT5LM` adds the LM head exactly as
`keras_hub.models.T5Seq2SeqLM` computes its logits (`PromptedT5.lm_logits`). Its weights
are the `PromptedT5`'s (shared, not copied), so `set_train` on the prompted model selects
what `fit` trains. `masked_token_loss` is the matching loss: the mean token cross-entropy
over the real target tokens (padding = id 0, T5's pad, never a real target).

`encode_examples` turns `PromptedExample`s into teacher-forcing batches as T5 trains on
them (Raffel et al. 2020; the reference better-promptability feeds HF T5 `labels`, from
which the decoder input is the labels shifted right with the pad id as the start token):
encoder = input tokens + EOS, target = target tokens + EOS, decoder input =
`shift_right(target)`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
import numpy as np

from tf_metaalign.prompts.base import TrainableSelection
from tf_metaalign.prompts.t5 import PromptedT5, _check_prompted_t5

__all__ = ["PromptedT5LM", "masked_token_loss", "encode_examples"]

PAD_ID = 0
EOS_ID = 1


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptedT5LM(TrainableSelection, keras.Model):
    """`inputs -> logits [B, T, V]` of a `PromptedT5` (`prompted.lm_logits` of its decoder
    output). Inputs: the backbone's dict (`encoder_token_ids`, `encoder_padding_mask`,
    `decoder_token_ids`, `decoder_padding_mask`).

    Args:
      prompted: a `PromptedT5`; shared, not copied (its `set_train` selects what `fit`
        trains).
      **kwargs: other `keras.Model` arguments (`name`).

    Example:
      >>> import keras_hub
      >>> from tf_metaalign import prompts
      >>> backbone = keras_hub.models.T5Backbone(
      ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
      ...     intermediate_dim=16, dropout=0.0)
      >>> lm = prompts.PromptedT5LM(prompts.prompt_t5(backbone, length=2))
      >>> vocabulary = {"great": 5, "film": 6, "positive": 7}
      >>> x, y = prompts.encode_examples(
      ...     [("great film", "positive")], lambda text: [vocabulary[w] for w in text.split()],
      ...     encoder_length=4, decoder_length=3)
      >>> lm(x).shape  # [B, T, V]
      TensorShape([1, 3, 32])
      >>> initial_loss = float(prompts.masked_token_loss()(y, lm(x)))
      >>> backbone_weights = [w.numpy() for w in backbone.weights]
      >>> prompt = lm.prompt_variables[0].numpy()
      >>> lm.compile(  # (eager: nothing to trace for these two steps)
      ...     optimizer=keras.optimizers.SGD(0.1), loss=prompts.masked_token_loss(),
      ...     run_eagerly=True)
      >>> [v.name for v in lm.trainable_variables]  # prompt_t5's default train="prompt"
      ['prompt_embeddings']
      >>> history = lm.fit(x, y, epochs=2, verbose=0).history
      >>> bool(abs(history["loss"][0] - initial_loss) < 1e-5)  # the first step's loss
      True
      >>> np.array_equal(prompt, lm.prompt_variables[0])  # the prompt trained ...
      False
      >>> all(np.array_equal(w, v) for w, v in zip(backbone_weights, backbone.weights))
      True

    References:
      Wu et al., EMNLP 2022 (prompt tuning a T5; allenai/better-promptability);
      `keras_hub.models.T5Seq2SeqLM` (the LM head).
    """

    def __init__(self, prompted: PromptedT5, **kwargs):
        super().__init__(**kwargs)
        _check_prompted_t5(prompted)
        self.prompted = prompted

    @property
    def prompt_variables(self):
        return self.prompted.prompt_variables

    def call(self, inputs, training=False):
        hidden = self.prompted(inputs, training=training)["decoder_sequence_output"]
        return self.prompted.lm_logits(hidden)

    def get_config(self):
        return {"name": self.name, "prompted": keras.saving.serialize_keras_object(self.prompted)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["prompted"] = keras.saving.deserialize_keras_object(config["prompted"])
        return cls(**config)


def masked_token_loss() -> keras.losses.Loss:
    """Token cross-entropy from logits, averaged over the target tokens whose id is not the
    pad id 0 (`ignore_class=0` masks them; `mean_with_sample_weight` divides by their count,
    where Keras's default would divide by every position, padding included).

    Returns:
      A `keras.losses.SparseCategoricalCrossentropy`, for `PromptedT5LM.compile`.

    Example:
      >>> from tf_metaalign import prompts
      >>> logits = np.log([[[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.4, 0.3, 0.3]]])
      >>> y = np.array([[2, 1, 0]])  # the third target token is padding (id 0)
      >>> loss = prompts.masked_token_loss()(y, logits)
      >>> round(float(loss), 4)  # (log 4 + log 2) / 2: the mean over the 2 real tokens
      1.0397

    References:
      Raffel et al., JMLR 2020 (T5: padding never a target); Wu et al., EMNLP 2022
      (allenai/better-promptability: HF T5 `labels` with padding ignored).
    """
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=PAD_ID, reduction="mean_with_sample_weight"
    )


def _ids(tokenize: Callable, text: str) -> list[int]:
    return [int(i) for i in np.asarray(tokenize(text)).reshape(-1).tolist()]


def encode_examples(
    examples: Sequence, tokenize: Callable, encoder_length: int, decoder_length: int
) -> tuple[dict, np.ndarray]:
    """`(x, y)` for `PromptedT5LM`: x the backbone's input dict (int32 / bool arrays), y the
    target ids `[N, decoder_length]` (0 = padding, ignored by `masked_token_loss`).

    Inputs are cut to `encoder_length - 1` tokens and targets to `decoder_length - 1`
    before their EOS.

    Args:
      examples: objects with `input_text` and `target_text` (`PromptedExample`) or
        `(input_text, target_text)` pairs (`PromptedMixture.take`).
      tokenize: `text -> token ids` (a list, NumPy array or 1-D tensor), adding no EOS.
      encoder_length: S, the encoder length (>= 2).
      decoder_length: T, the decoder length (>= 2).

    Returns:
      `(x, y)`: x the backbone's input dict (`encoder_token_ids` [N, S],
      `encoder_padding_mask`, `decoder_token_ids` [N, T], `decoder_padding_mask`), y the
      target ids [N, T].

    Example:
      >>> from tf_metaalign import prompts
      >>> vocabulary = {"great": 5, "film": 6, "positive": 7}
      >>> x, y = prompts.encode_examples(
      ...     [("great film", "positive")], lambda text: [vocabulary[w] for w in text.split()],
      ...     encoder_length=4, decoder_length=3)
      >>> x["encoder_token_ids"], x["encoder_padding_mask"]  # + EOS (1), padded with 0
      (array([[5, 6, 1, 0]], dtype=int32), array([[ True,  True,  True, False]]))
      >>> y  # the targets: + EOS, padded with 0
      array([[7, 1, 0]], dtype=int32)
      >>> x["decoder_token_ids"], x["decoder_padding_mask"]  # shift_right(y), start token 0
      (array([[0, 7, 1]], dtype=int32), array([[ True,  True,  True]]))

    References:
      Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
      Transformer", JMLR 2020; Wu et al., EMNLP 2022 (allenai/better-promptability).
    """
    for value, name in ((encoder_length, "encoder_length"), (decoder_length, "decoder_length")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 2:
            raise ValueError(
                f"`{name}` must be an integer >= 2 (at least one token and EOS); got {value!r}."
            )
    examples = list(examples)
    if not examples:
        raise ValueError("`examples` is empty.")
    n = len(examples)
    encoder = np.zeros((n, encoder_length), np.int32)
    target = np.zeros((n, decoder_length), np.int32)
    for i, e in enumerate(examples):
        source, goal = (e.input_text, e.target_text) if hasattr(e, "input_text") else e
        ids = _ids(tokenize, source)[: encoder_length - 1] + [EOS_ID]
        encoder[i, : len(ids)] = ids
        ids = _ids(tokenize, goal)[: decoder_length - 1] + [EOS_ID]
        target[i, : len(ids)] = ids
    decoder = np.concatenate([np.full((n, 1), PAD_ID, np.int32), target[:, :-1]], axis=1)
    decoder_mask = np.concatenate([np.ones((n, 1), bool), target[:, :-1] != PAD_ID], axis=1)
    x = {
        "encoder_token_ids": encoder,
        "encoder_padding_mask": encoder != PAD_ID,
        "decoder_token_ids": decoder,
        "decoder_padding_mask": decoder_mask,
    }
    return x, target
