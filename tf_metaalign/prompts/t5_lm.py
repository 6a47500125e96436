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

from tf_metaalign.prompts.t5 import PromptedT5, _check_prompted_t5

__all__ = ["PromptedT5LM", "masked_token_loss", "encode_examples"]

PAD_ID = 0
EOS_ID = 1


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptedT5LM(keras.Model):
    """`inputs -> logits [B, T, V]` of a `PromptedT5` (`prompted.lm_logits` of its decoder
    output). Inputs: the backbone's dict (`encoder_token_ids`, `encoder_padding_mask`,
    `decoder_token_ids`, `decoder_padding_mask`)."""

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
    where Keras's default would divide by every position, padding included)."""
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

    `examples`: objects with `input_text` and `target_text` (`PromptedExample`) or
    `(input_text, target_text)` pairs (`PromptedMixture.take`). Inputs are cut to
    `encoder_length - 1` tokens and targets to `decoder_length - 1` before their EOS.
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
