"""Soft prompts (shallow and deep) for `keras_hub.models.T5Backbone`, scoring and greedy
generation.

Reference: Wu, Logan, Walsh, Bhagia, Groeneveld, Singh, Beltagy, "Continued Pretraining for
Better Zero- and Few-Shot Promptability" (EMNLP 2022), code allenai/better-promptability:

* shallow (`modules/with_prefix_embedding.py`): L learned vectors prepended to the encoder
  input embeddings, initialised from random rows among the first 5000 of the vocabulary
  embedding (Lester et al. 2021). The decoder cross-attends to the prompt positions too
  (they are part of the encoder sequence there).
* deep (`models/t5_with_prefix.py`): no input prompt; instead every attention block gets L
  learned key and value vectors prepended to its keys and values, in the encoder
  self-attention, the decoder self-attention and the decoder cross-attention. As in the
  reference (`T5StackWithPrefix.prefix_embed`, non-reparameterised), each stack holds ONE
  matrix [L, num_layers * 2 * num_heads * key_value_dim] read as
  [L, num_layers, 2 (key, value), num_heads, key_value_dim], initialised N(0, 1) like
  `torch.nn.Embedding`; the decoder has a second one for cross-attention
  (`prefix_embed_cross`). The prefixes are used as keys/values directly (not through the
  key/value projections), are never masked (mask 0 in the reference's additive mask, also
  under the causal mask) and get a zero position bias (`T5AttentionWithPrefix` concatenates
  zeros in front of the relative position bias), so T5's relative bias applies to the real
  positions only, with their own relative distances.

How keras-hub's layers are re-used (no fork, no weight copy): the prompted model holds the
backbone and calls the backbone's own layer objects. Shallow mode runs the backbone's own
encoder/decoder loops on the longer sequence. Deep mode enters through the layers' static
key/value cache argument: the cache holds [prefix ; the real keys/values], the latter made by
the layer's own layer norm and key/value projections, and a precomputed `position_bias`
(zeros for the prefix columns, the layer's own `compute_bias` over the real positions, plus
the padding/causal mask folded in as keras-hub folds it) is passed in, which the layer then
uses as is. (keras-hub's "updated cache" route would splice with `slice_update`, which has
no gradient in TF: XlaDynamicUpdateSlice.) A zero-length prompt is the plain backbone bit
for bit, in both modes.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from tf_metaalign.prompts.base import MODES as MODES  # the modes PromptedT5 accepts
from tf_metaalign.prompts.base import KeyValueCache, PromptedBackbone, check_backbone, check_mode

_MASK_VALUE = -1e9  # keras-hub T5MultiHeadAttention's additive mask value


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptedT5(PromptedBackbone):
    """A `keras_hub.models.T5Backbone` with a soft prompt, running the backbone's own layers.

    Args:
        backbone: a `keras_hub.models.T5Backbone` (built). Shared, not copied: training the
            transformer trains `backbone`'s variables; `train` sets no flag on it.
        length: L >= 0, the number of prompt vectors (shallow) or of key/value prefixes per
            attention block (deep). 20 in the paper.
        mode: "shallow" (prompt vectors prepended to the encoder input embeddings) or
            "deep" (key/value prefixes in every attention block: encoder self, decoder self,
            decoder cross). The reference uses one or the other, not both.
        train: "prompt" (the backbone frozen: MTL-P, prompt tuning), "transformer" (the
            prompt frozen: MTL-T) or "both" (MTL-TP). `trainable_variables` is exactly that
            set. Change later with `set_train`.
        init_vocabulary_rows: shallow init draws rows among the first this many rows of
            the token embedding (5000 in the paper).
        seed: seed of the initial prompt values.

    Inputs and outputs are the backbone's: a dict with `encoder_token_ids`,
    `encoder_padding_mask`, `decoder_token_ids`, `decoder_padding_mask` to a dict with
    `encoder_sequence_output` [B, S, H] and `decoder_sequence_output` [B, T, H]. In shallow
    mode the L prompt positions are DROPPED from `encoder_sequence_output`, so it stays
    aligned with `encoder_padding_mask` (the backbone's contract); the decoder still
    cross-attends to them (use `encode` for the full [B, L + S, H] sequence and its mask).

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> backbone = keras_hub.models.T5Backbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, dropout=0.0)
        >>> model = prompts.PromptedT5(backbone, length=3, mode="deep")
        >>> [(v.name, tuple(v.shape)) for v in model.trainable_variables]  # [L, 1 * 2 * 2 * 4]
        [('encoder_self_prefix', (3, 16)), ('decoder_self_prefix', (3, 16)),
         ('decoder_cross_prefix', (3, 16))]
        >>> x = {
        ...     "encoder_token_ids": np.array([[5, 6, 7, 1]]),
        ...     "encoder_padding_mask": np.array([[1, 1, 1, 1]]),
        ...     "decoder_token_ids": np.array([[0, 9, 10]]),
        ...     "decoder_padding_mask": np.array([[1, 1, 1]]),
        ... }
        >>> {name: tuple(y.shape) for name, y in model(x).items()}
        {'encoder_sequence_output': (1, 4, 8), 'decoder_sequence_output': (1, 3, 8)}
        >>> plain, reference = prompts.PromptedT5(backbone, length=0, mode="deep")(x), backbone(x)
        >>> all(np.array_equal(plain[name], reference[name]) for name in reference)  # bit for bit
        True

    References:
        Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
        EMNLP 2022 (allenai/better-promptability: `T5StackWithPrefix`,
        `T5AttentionWithPrefix`, `modules/with_prefix_embedding.py`); Lester et al., "The
        Power of Scale for Parameter-Efficient Prompt Tuning", EMNLP 2021.
    """

    ARCHITECTURE = "t5"

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
        check_backbone(backbone, "T5Backbone")
        super().__init__(
            backbone, length, check_mode(mode), train, init_vocabulary_rows, seed, **kwargs
        )
        self.num_heads = backbone.num_heads
        self.key_value_dim = backbone.key_value_dim or backbone.hidden_dim // backbone.num_heads

        if self.mode == "shallow":
            self.prompt_embeddings = self._shallow_prompt()
            self.prompt_variables = [self.prompt_embeddings]
        else:
            rng = np.random.default_rng(seed)
            width = backbone.num_layers * 2 * self.num_heads * self.key_value_dim
            self.prompt_variables = []
            for name in ("encoder_self_prefix", "decoder_self_prefix", "decoder_cross_prefix"):
                variable = self._add_prompt_variable(
                    name, rng.standard_normal((self.length, width))
                )
                setattr(self, name, variable)
                self.prompt_variables.append(variable)
        self._select_trainable()

    # --- forward ---------------------------------------------------------------------

    def _layer_prefixes(self, variable, layer_index, batch_size):
        """Layer `layer_index`'s (key, value) prefixes of a stack matrix, as [B, L, h, d]."""
        prefix = ops.reshape(
            ops.cast(variable, self.backbone.compute_dtype),
            (self.length, self.backbone.num_layers, 2, self.num_heads, self.key_value_dim),
        )
        key, value = prefix[:, layer_index, 0], prefix[:, layer_index, 1]
        shape = (batch_size, self.length, self.num_heads, self.key_value_dim)
        return ops.broadcast_to(key[None], shape), ops.broadcast_to(value[None], shape)

    def _prefixed_key_values(self, variable, layer_index, attention, key_value_inputs):
        """A keras-hub static attention cache [B, 2, L + K, h, d] (a `KeyValueCache`):
        the layer's prefixes, then the keys/values of `key_value_inputs` [B, K, H] through
        the layer's OWN key/value projections. Passed with `cache_update_index=None`
        (keras-hub's "static cache"), the attention uses it as its keys/values as is. (Not
        the "updated cache" route, which splices with `slice_update`: TF has no gradient
        for XlaDynamicUpdateSlice.)"""
        batch_size = ops.shape(key_value_inputs)[0]
        key, value = self._layer_prefixes(variable, layer_index, batch_size)

        def heads(states):
            return ops.reshape(states, (batch_size, -1, self.num_heads, self.key_value_dim))

        keys = heads(attention.key_projector(key_value_inputs))
        values = heads(attention.value_projector(key_value_inputs))
        return KeyValueCache(
            ops.concatenate([ops.cast(key, keys.dtype), keys], axis=1),
            ops.concatenate([ops.cast(value, values.dtype), values], axis=1),
        )

    def _prefixed_position_bias(self, attention, query_length, key_mask):
        """Relative position bias for prefix + real keys with the mask folded in, as
        keras-hub's `T5MultiHeadAttention` folds it: zeros (no position bias) for the L
        prefix columns, `attention.compute_bias` over the real positions only; `key_mask`
        [B, q, L + k] is 1 where attention is allowed (always 1 for the prefix)."""
        real = attention.compute_bias(query_length, query_length)
        prefix = ops.zeros((1, self.num_heads, query_length, self.length), dtype=real.dtype)
        bias = ops.concatenate([prefix, real], axis=-1)
        return bias + (1.0 - ops.cast(key_mask[:, None], bias.dtype)) * _MASK_VALUE

    def _with_prefix_ones(self, mask):
        """`mask` [..., k] with L ones prepended on its last axis (prompt never masked)."""
        mask = ops.cast(mask, "int32")
        ones = ops.ones(tuple(ops.shape(mask)[:-1]) + (self.length,), dtype="int32")
        return ops.concatenate([ones, mask], axis=-1)

    def encode(self, encoder_token_ids, encoder_padding_mask, training=False):
        """The encoder: returns (hidden [B, L + S, H] in shallow mode, [B, S, H] in deep
        mode; the matching padding mask [B, L + S] / [B, S], with the prompt's ones) -- the
        sequence and mask the decoder cross-attends to (before the deep cross prefixes)."""
        b = self.backbone
        x = b.token_embedding(encoder_token_ids)
        mask = ops.cast(encoder_padding_mask, "int32")
        batch_size, seq_length = ops.shape(x)[0], ops.shape(x)[1]
        if self.mode == "shallow":
            prompt = ops.cast(self.prompt_embeddings, x.dtype)
            prompt = ops.broadcast_to(prompt[None], (batch_size, self.length, b.hidden_dim))
            x = ops.concatenate([prompt, x], axis=1)
            mask = self._with_prefix_ones(mask)
        x = b.encoder_embedding_dropout(x, training=training)
        if self.mode == "shallow":
            # The backbone's own encoder loop, on the longer sequence.
            attention_mask = mask[:, None, :]
            position_bias = None
            for layer in b.encoder_transformer_layers:
                x, position_bias = layer(
                    x,
                    attention_mask=attention_mask,
                    position_bias=position_bias,
                    use_causal_mask=False,
                    training=training,
                )
        else:
            key_mask = self._with_prefix_ones(
                ops.broadcast_to(mask[:, None, :], (batch_size, seq_length, seq_length))
            )
            position_bias = self._prefixed_position_bias(
                b.encoder_transformer_layers[0].self_attention, seq_length, key_mask
            )
            for i, layer in enumerate(b.encoder_transformer_layers):
                # The layer normalises x again inside for its queries (same layer, same
                # result); its keys/values come from the cache.
                cache = self._prefixed_key_values(
                    self.encoder_self_prefix,
                    i,
                    layer.self_attention,
                    layer.self_attention_layer_norm(x),
                )
                x, position_bias, _, _ = layer(
                    x,
                    position_bias=position_bias,
                    use_causal_mask=False,
                    self_attention_cache=cache,
                    training=training,
                )
        x = b.encoder_layer_norm(x)
        x = b.encoder_dropout(x, training=training)
        return x, mask

    def decode(
        self,
        encoder_hidden_states,
        encoder_mask,
        decoder_token_ids,
        decoder_padding_mask,
        training=False,
    ):
        """The decoder [B, T, H], given `encode`'s outputs (teacher forcing, no cache)."""
        b = self.backbone
        x = b.token_embedding(decoder_token_ids)
        x = b.decoder_embedding_dropout(x, training=training)
        decoder_mask = ops.cast(decoder_padding_mask, "int32")
        if self.mode == "shallow":
            # The backbone's own decoder loop.
            encoder_attention_mask = encoder_mask[:, None, :]
            position_bias = None
            for layer in b.decoder_transformer_layers:
                x, position_bias = layer(
                    x,
                    attention_mask=decoder_mask[:, None, :],
                    position_bias=position_bias,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_attention_mask=encoder_attention_mask,
                    use_causal_mask=True,
                    training=training,
                )
        else:
            target_length = ops.shape(x)[1]
            causal = ops.arange(target_length)[:, None] >= ops.arange(target_length)[None, :]
            self_mask = ops.logical_and(causal[None], ops.cast(decoder_mask[:, None, :], "bool"))
            key_mask = self._with_prefix_ones(self_mask)
            position_bias = self._prefixed_position_bias(
                b.decoder_transformer_layers[0].self_attention, target_length, key_mask
            )
            # Cross-attention: keras-hub folds this mask in itself (zero bias there).
            encoder_attention_mask = self._with_prefix_ones(encoder_mask)[:, None, :]
            for i, layer in enumerate(b.decoder_transformer_layers):
                self_cache = self._prefixed_key_values(
                    self.decoder_self_prefix,
                    i,
                    layer.self_attention,
                    layer.self_attention_layer_norm(x),
                )
                cross_cache = self._prefixed_key_values(
                    self.decoder_cross_prefix, i, layer.cross_attention, encoder_hidden_states
                )
                x, position_bias, _, _ = layer(
                    x,
                    position_bias=position_bias,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_attention_mask=encoder_attention_mask,
                    use_causal_mask=True,
                    self_attention_cache=self_cache,
                    cross_attention_cache=cross_cache,
                    training=training,
                )
        x = b.decoder_layer_norm(x)
        return b.decoder_dropout(x, training=training)

    def call(self, inputs, training=False):
        encoder_hidden, encoder_mask = self.encode(
            inputs["encoder_token_ids"], inputs["encoder_padding_mask"], training=training
        )
        decoder_hidden = self.decode(
            encoder_hidden,
            encoder_mask,
            inputs["decoder_token_ids"],
            inputs["decoder_padding_mask"],
            training=training,
        )
        prompt_positions = self.length if self.mode == "shallow" else 0
        return {
            "encoder_sequence_output": encoder_hidden[:, prompt_positions:, :],
            "decoder_sequence_output": decoder_hidden,
        }

    def lm_logits(self, decoder_hidden_states):
        """Vocabulary logits exactly as `keras_hub.models.T5Seq2SeqLM._logits`: through the
        (reversed) token embedding, scaled by hidden_dim ** -0.5 when the weights are tied."""
        b = self.backbone
        if b.tie_embedding_weights:
            decoder_hidden_states = ops.multiply(
                decoder_hidden_states, ops.cast(b.hidden_dim**-0.5, decoder_hidden_states.dtype)
            )
        return b.token_embedding(decoder_hidden_states, reverse=True)


def prompt_t5(
    backbone,
    length=20,
    mode="shallow",
    train="prompt",
    init_vocabulary_rows=5000,
    seed=0,
    name=None,
) -> PromptedT5:
    """A `PromptedT5` around `backbone` (see its docstring for the arguments).

    Args:
        backbone: a built `keras_hub.models.T5Backbone` (shared, not copied).
        length: L >= 0, prompt vectors (shallow) or key/value prefixes per block (deep).
        mode: "shallow" or "deep".
        train: "prompt", "transformer" or "both".
        init_vocabulary_rows: shallow init draws among this many first vocabulary rows.
        seed: seed of the initial prompt values.
        name: the model's name (None: Keras's default).

    Returns:
        The `PromptedT5`.

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> backbone = keras_hub.models.T5Backbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, dropout=0.0)
        >>> model = prompts.prompt_t5(backbone, length=3)  # shallow; prompt tuning
        >>> [(v.name, tuple(v.shape)) for v in model.trainable_variables]
        [('prompt_embeddings', (3, 8))]
        >>> table = backbone.token_embedding.embeddings.numpy()
        >>> prompt = model.prompt_embeddings.numpy()
        >>> [np.flatnonzero((table == p).all(-1)).tolist() for p in prompt]  # vocabulary rows
        [[2], [11], [25]]
        >>> x = {
        ...     "encoder_token_ids": np.array([[5, 6, 1, 0]]),
        ...     "encoder_padding_mask": np.array([[1, 1, 1, 0]]),
        ...     "decoder_token_ids": np.array([[0, 9, 10]]),
        ...     "decoder_padding_mask": np.array([[1, 1, 1]]),
        ... }
        >>> hidden, mask = model.encode(x["encoder_token_ids"], x["encoder_padding_mask"])
        >>> tuple(hidden.shape), np.asarray(mask).tolist()  # L + S positions, prompt first
        ((1, 7, 8), [[1, 1, 1, 1, 1, 1, 0]])
        >>> tuple(model(x)["encoder_sequence_output"].shape)  # the prompt positions dropped
        (1, 4, 8)
        >>> model.set_train("both")
        >>> len(model.trainable_variables) == 1 + len(backbone.trainable_variables)
        True

    References:
        Wu et al., EMNLP 2022 (allenai/better-promptability); Lester et al., EMNLP 2021
        (prompt tuning, initialised from vocabulary rows).
    """
    return PromptedT5(
        backbone,
        length=length,
        mode=mode,
        train=train,
        init_vocabulary_rows=init_vocabulary_rows,
        seed=seed,
        name=name,
    )


def _check_prompted_t5(model):
    if not isinstance(model, PromptedT5):
        raise ValueError(
            f"`model` must be a PromptedT5 (see prompt_t5); received {type(model).__name__}."
        )


def shift_right(target_ids, start_token_id=0):
    """Teacher-forcing decoder inputs: `[start, y_0, ..., y_{T-2}]` (T5's decoder start is
    the pad id 0, as in `T5Seq2SeqLMPreprocessor`).

    Args:
        target_ids: [B, T] int, the targets.
        start_token_id: the decoder's start token (0, T5's pad id).

    Returns:
        [B, T] int32, the decoder inputs.

    Example:
        >>> from tf_metaalign import prompts
        >>> np.asarray(prompts.shift_right([[5, 6, 1], [7, 1, 0]]))
        array([[0, 5, 6],
               [0, 7, 1]], dtype=int32)

    References:
        Raffel et al., JMLR 2020 (T5); `keras_hub.models.T5Seq2SeqLMPreprocessor`.
    """
    target_ids = ops.convert_to_tensor(target_ids, "int32")
    start = ops.full((ops.shape(target_ids)[0], 1), start_token_id, dtype="int32")
    return ops.concatenate([start, target_ids[:, :-1]], axis=1)


def t5_token_log_likelihoods(
    model,
    encoder_token_ids,
    encoder_padding_mask,
    target_ids,
    target_padding_mask=None,
    start_token_id=0,
    training=False,
):
    """Per-token log-likelihoods log p(y_t | y_<t, x) [B, T] of `target_ids` given the
    encoder input, by teacher forcing (decoder input = `shift_right(target_ids)`), through
    the LM head exactly as `T5Seq2SeqLM` computes its logits (`PromptedT5.lm_logits`), then
    a log-softmax over the vocabulary. Positions where `target_padding_mask` is 0 get 0.

    Rank classification (the paper's evaluation) takes the mean (or sum) of these over each
    answer choice's tokens, EOS included: `sum(ll) / sum(mask)` as in the reference's
    `PrefixTransformer.get_predictions`.

    Args:
        model: a `PromptedT5`.
        encoder_token_ids: [B, S] int array or tensor, the inputs.
        encoder_padding_mask: [B, S] 0/1, 1 on the real input tokens.
        target_ids: [B, T] int, the targets (EOS included).
        target_padding_mask: [B, T] 0/1, 1 on the real target tokens (None: all ones).
        start_token_id: the decoder's start token (0, T5's pad id).
        training: passed to the model (dropout).

    Returns:
        [B, T] float32 log-likelihoods, 0 where `target_padding_mask` is 0.

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> model = prompts.prompt_t5(keras_hub.models.T5Backbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, dropout=0.0), length=2)
        >>> inputs, input_mask = np.array([[5, 6, 1]]), np.array([[1, 1, 1]])
        >>> target = np.array([[9, 1, 0]])  # a token, EOS, padding
        >>> ll = prompts.t5_token_log_likelihoods(
        ...     model, inputs, input_mask, target, np.array([[1, 1, 0]]))
        >>> ll.shape, float(ll[0, 2]) == 0.0
        (TensorShape([1, 3]), True)
        >>> hidden = model.decode(  # teacher forcing by hand: T5Seq2SeqLM's logits
        ...     *model.encode(inputs, input_mask), prompts.shift_right(target), np.ones((1, 3)))
        >>> logits = model.lm_logits(hidden).numpy()[0]
        >>> log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        >>> bool(np.allclose(ll[0, :2], log_softmax[[0, 1], [9, 1]], atol=1e-5))
        True

    References:
        Wu et al., EMNLP 2022 (`PrefixTransformer.get_predictions`,
        allenai/better-promptability); `keras_hub.models.T5Seq2SeqLM`.
    """
    _check_prompted_t5(model)
    target_ids = ops.convert_to_tensor(target_ids, "int32")
    if target_padding_mask is None:
        target_padding_mask = ops.ones_like(target_ids)
    decoder_token_ids = shift_right(target_ids, start_token_id)
    # The decoder's own padding mask: position t reads y_{t-1}; the start token is real.
    decoder_padding_mask = shift_right(target_padding_mask, 1)
    encoder_hidden, encoder_mask = model.encode(
        encoder_token_ids, encoder_padding_mask, training=training
    )
    hidden = model.decode(
        encoder_hidden, encoder_mask, decoder_token_ids, decoder_padding_mask, training=training
    )
    logits = ops.cast(model.lm_logits(hidden), "float32")
    log_probs = ops.log_softmax(logits, axis=-1)
    picked = ops.take_along_axis(log_probs, target_ids[..., None], axis=-1)[..., 0]
    return picked * ops.cast(target_padding_mask, picked.dtype)


def t5_generate(
    model,
    encoder_token_ids,
    encoder_padding_mask,
    max_length,
    start_token_id=0,
    end_token_id=1,
    pad_token_id=0,
):
    """Greedy decoding with a `PromptedT5`: [B, max_length] generated ids (the start token
    not included); after a row's `end_token_id` the row is `pad_token_id`
    (`end_token_id=None`: always generate `max_length` tokens). With L = 0 this is
    `T5Seq2SeqLM`'s greedy generation (tested against its cached `generate_step`).

    Simple on purpose: the encoder runs once, the decoder is recomputed on the whole prefix
    at each step (no key/value cache: O(max_length^2) decoder work), which is enough for
    the short answers of prompted tasks. Eager NumPy loop; not traced.

    Args:
        model: a `PromptedT5`.
        encoder_token_ids: [B, S] int array or tensor, the inputs.
        encoder_padding_mask: [B, S] 0/1, 1 on the real input tokens.
        max_length: the number of tokens to generate, >= 1.
        start_token_id: the decoder's start token (0, T5's pad id).
        end_token_id: the EOS id that ends a row (1, T5's EOS), or None.
        pad_token_id: what fills a row after its EOS.

    Returns:
        [B, max_length] int32 NumPy array.

    Example:
        >>> import keras_hub
        >>> from tf_metaalign import prompts
        >>> model = prompts.prompt_t5(keras_hub.models.T5Backbone(
        ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        ...     intermediate_dim=16, dropout=0.0), length=2)
        >>> inputs, input_mask = np.array([[5, 6, 1]]), np.array([[1, 1, 1]])
        >>> ids = prompts.t5_generate(model, inputs, input_mask, max_length=4, end_token_id=None)
        >>> ids.shape, ids.dtype
        ((1, 4), dtype('int32'))
        >>> start = np.zeros((1, 1), "int32")  # the decoder's start token, its mask 1 below
        >>> hidden = model.decode(*model.encode(inputs, input_mask), start, start + 1)
        >>> int(ids[0, 0]) == int(np.argmax(model.lm_logits(hidden)[0, 0]))  # greedy
        True
        >>> stop = int(ids[0, 0])  # taken as the EOS: the row ends there, padded with 0
        >>> prompts.t5_generate(model, inputs, input_mask, 4, end_token_id=stop)[0].tolist() == [
        ...     stop, 0, 0, 0]
        True

    References:
        `keras_hub.models.T5Seq2SeqLM.generate` (greedy sampler); Wu et al., EMNLP 2022.
    """
    _check_prompted_t5(model)
    if (
        isinstance(max_length, bool)
        or not isinstance(max_length, (int, np.integer))
        or max_length < 1
    ):
        raise ValueError(f"`max_length` must be an integer >= 1; received {max_length!r}.")
    encoder_hidden, encoder_mask = model.encode(encoder_token_ids, encoder_padding_mask)
    batch_size = int(ops.shape(encoder_hidden)[0])
    decoder_ids = np.full((batch_size, 1), start_token_id, dtype="int32")
    done = np.zeros((batch_size,), dtype=bool)
    for _ in range(max_length):
        hidden = model.decode(encoder_hidden, encoder_mask, decoder_ids, np.ones_like(decoder_ids))
        next_ids = np.argmax(
            ops.convert_to_numpy(model.lm_logits(hidden[:, -1:, :]))[:, 0], axis=-1
        ).astype("int32")
        next_ids = np.where(done, pad_token_id, next_ids)
        if end_token_id is not None:
            done |= next_ids == end_token_id
        decoder_ids = np.concatenate([decoder_ids, next_ids[:, None]], axis=1)
        if done.all():
            break
    generated = decoder_ids[:, 1:]
    if generated.shape[1] < max_length:
        generated = np.pad(
            generated, ((0, 0), (0, max_length - generated.shape[1])), constant_values=pad_token_id
        )
    return generated
