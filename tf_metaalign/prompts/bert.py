"""Shallow soft prompts for `keras_hub.models.BertBackbone`-family encoders (BERT, MiniLM).

The paper (Wu et al., EMNLP 2022; allenai/better-promptability) prompts T5; this is the
same shallow prompt (`modules/with_prefix_embedding.py`: L learned vectors, initialised
from random rows among the first 5000 of the vocabulary embedding) on an encoder-only model,
with `[CLS]` kept first: the sequence is `[CLS], p_1..p_L, x_1..x_{S-1}`, so the pooled
output still reads position 0.

Position embeddings (a choice): the real tokens keep their own positions 0..S-1, exactly
the embeddings the plain backbone gives them, so L = 0 is the plain backbone, prompting does
not shorten the usable `max_sequence_length`, and the text sits at its pretrained positions.
The prompt vectors get the segment-0 embedding and no position embedding: any constant
added to a learned vector is absorbed by it, so a position embedding there would only
change the initial value. Attention in BERT has no relative bias, so nothing else depends
on positions.
"""

from __future__ import annotations

import keras
from keras import ops

from tf_metaalign.prompts.base import PromptedBackbone, check_backbone


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptedBert(PromptedBackbone):
    """A `keras_hub.models.BertBackbone` (or subclass) with a shallow soft prompt after
    `[CLS]`, running the backbone's own layers and weights.

    Args:
        backbone: a built `BertBackbone`; shared, not copied (`train` sets no flag on it).
        length: L >= 0 prompt vectors.
        mode: "shallow" only (deep prefixes are implemented for T5; a ValueError otherwise).
        train: "prompt", "transformer" or "both": `trainable_variables` is exactly that set.
        init_vocabulary_rows: initial prompt rows are drawn among this many first rows of the
            token embedding (5000 in the paper).
        seed: seed of the initial rows.

    Inputs/outputs are the backbone's: `token_ids`, `segment_ids`, `padding_mask` [B, S] to
    `sequence_output` [B, S, H] (the L prompt positions DROPPED, so it stays aligned with the
    inputs; `encode` returns the full [B, 1 + L + S - 1, H]) and `pooled_output` [B, H] (the
    backbone's `pooled_dense` on `[CLS]`). The padding mask is extended by L ones.

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> backbone = keras_hub.models.BertBackbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, max_sequence_length=8)
        >>> model = prompts.PromptedBert(backbone, length=2)
        >>> x = {
        ...     "token_ids": np.array([[2, 5, 6, 0]]),  # [CLS], two tokens, padding
        ...     "segment_ids": np.zeros((1, 4), "int32"),
        ...     "padding_mask": np.array([[1, 1, 1, 0]]),
        ... }
        >>> {name: tuple(y.shape) for name, y in model(x).items()}
        {'sequence_output': (1, 4, 8), 'pooled_output': (1, 8)}
        >>> hidden, mask = model.encode(x["token_ids"], x["segment_ids"], x["padding_mask"])
        >>> tuple(hidden.shape), np.asarray(mask).tolist()  # [CLS], the prompt, the rest
        ((1, 6, 8), [[1, 1, 1, 1, 1, 0]])
        >>> plain, reference = prompts.PromptedBert(backbone, length=0)(x), backbone(x)
        >>> all(np.array_equal(plain[name], reference[name]) for name in reference)  # bit for bit
        True

    References:
        Wu et al., EMNLP 2022 (allenai/better-promptability:
        `modules/with_prefix_embedding.py`); Lester et al., EMNLP 2021 (prompt tuning);
        Devlin et al., NAACL 2019 (BERT).
    """

    ARCHITECTURE = "bert"

    def __init__(
        self,
        backbone,
        length=20,
        mode="shallow",
        train="prompt",
        init_vocabulary_rows=5000,
        seed=0,
        **kwargs,
    ):
        check_backbone(backbone, "BertBackbone")
        if mode != "shallow":
            raise ValueError(
                f"`mode` must be 'shallow' for BERT-family encoders (deep "
                f"key/value prefixes are implemented for T5 only); received "
                f"mode={mode!r}."
            )
        super().__init__(backbone, length, mode, train, init_vocabulary_rows, seed, **kwargs)
        self.prompt_embeddings = self._shallow_prompt()
        self.prompt_variables = [self.prompt_embeddings]
        self._select_trainable()

    def encode(self, token_ids, segment_ids, padding_mask, training=False):
        """The transformer output over `[CLS], prompt, rest` [B, L + S, H] and its padding
        mask [B, L + S] (ones at the prompt)."""
        b = self.backbone
        tokens = b.token_embedding(token_ids)
        positions = b.position_embedding(tokens)  # positions 0..S-1 of the real tokens
        segments = b.segment_embedding(segment_ids)
        x = b.embeddings_add((tokens, positions, segments))
        batch_size = ops.shape(x)[0]
        prompt = ops.cast(self.prompt_embeddings, x.dtype)[None]
        prompt = prompt + b.segment_embedding(ops.zeros((batch_size, self.length), "int32"))
        x = ops.concatenate([x[:, :1], prompt, x[:, 1:]], axis=1)
        mask = ops.cast(padding_mask, "int32")
        mask = ops.concatenate(
            [mask[:, :1], ops.ones((batch_size, self.length), "int32"), mask[:, 1:]], axis=1
        )
        x = b.embeddings_layer_norm(x)
        x = b.embeddings_dropout(x, training=training)
        for layer in b.transformer_layers:
            x = layer(x, padding_mask=mask, training=training)
        return x, mask

    def call(self, inputs, training=False):
        x, _ = self.encode(
            inputs["token_ids"], inputs["segment_ids"], inputs["padding_mask"], training=training
        )
        sequence_output = ops.concatenate([x[:, :1], x[:, 1 + self.length :]], axis=1)
        return {
            "sequence_output": sequence_output,
            "pooled_output": self.backbone.pooled_dense(x[:, 0, :]),
        }


def prompt_bert(
    backbone,
    length=20,
    mode="shallow",
    train="prompt",
    init_vocabulary_rows=5000,
    seed=0,
    name=None,
) -> PromptedBert:
    """A `PromptedBert` around `backbone` (see its docstring for the arguments).

    Args:
        backbone: a built `BertBackbone` (or subclass); shared, not copied.
        length: L >= 0 prompt vectors.
        mode: "shallow" only.
        train: "prompt", "transformer" or "both".
        init_vocabulary_rows: initial rows are drawn among this many first vocabulary rows.
        seed: seed of the initial rows.
        name: the model's name (None: Keras's default).

    Returns:
        The `PromptedBert`.

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> backbone = keras_hub.models.BertBackbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, max_sequence_length=8)
        >>> model = prompts.prompt_bert(backbone, length=2)  # prompt tuning
        >>> [(v.name, tuple(v.shape)) for v in model.trainable_variables]
        [('prompt_embeddings', (2, 8))]
        >>> model.set_train("transformer")  # the prompt frozen, the backbone trains
        >>> "prompt_embeddings" in [v.name for v in model.trainable_variables]
        False
        >>> len(model.trainable_variables) == len(backbone.weights)
        True

    References:
        Wu et al., EMNLP 2022 (allenai/better-promptability); Lester et al., EMNLP 2021.
    """
    return PromptedBert(
        backbone,
        length=length,
        mode=mode,
        train=train,
        init_vocabulary_rows=init_vocabulary_rows,
        seed=seed,
        name=name,
    )
