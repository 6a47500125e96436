"""Soft prompts for keras-hub decoder-only language models: shallow prompt tuning and deep
prefix tuning for `GPT2Backbone`, `GemmaBackbone` and `LlamaBackbone`, generation through
keras-hub's own `CausalLM.generate`, and answer scoring for rank classification.

This module imports keras-hub (the `hub` extra); `tf_metaalign.prompts` loads it on first
use of one of its names.

References:

* Lester, Al-Rfou, Constant, "The Power of Scale for Parameter-Efficient Prompt Tuning"
  (EMNLP 2021): shallow prompt tuning, L virtual-token embeddings before the input.
* Li, Liang, "Prefix-Tuning" (ACL 2021) and Liu et al., "P-Tuning v2" (ACL 2022): deep
  prefixes, L learned keys and values prepended in every attention layer, optionally
  reparameterised by an MLP during training (Li & Liang: "initializing the prefix with
  activations of real words" helps).
* Liu et al., "GPT Understands, Too" (P-tuning, 2021): the MLP prompt encoder.
* Hugging Face PEFT (`tuners/prompt_tuning`, `tuners/prefix_tuning`, `tuners/p_tuning`,
  `PeftModel.get_prompt`), whose semantics this follows:

  - shallow: `inputs_embeds = concat(prompt, token embeddings)`; the backbone then treats
    the prompt as tokens at positions 0..L-1 (GPT-2 adds its learned position embeddings
    0..L+S-1, the rotary position of the text starts at L), the attention mask gets L ones.
    Gemma: the prompt is NOT scaled by sqrt(hidden_dim); the tokens' embeddings are, before
    the concatenation -- as PEFT on transformers >= 5.4, whose Gemma scales inside
    `embed_tokens`. So a Gemma prompt is in the units of the first layer's input: a
    "vocab" / text init holds the token rows times sqrt(hidden_dim) (it still equals reading
    those tokens), and "random" is PEFT's N(0, 1) in those units. (transformers < 5.4
    scaled `inputs_embeds`, prompt included: `load_peft_adapter(...,
    gemma_legacy_scaling=True)` reads such an adapter.)
  - deep: the prefix is `past_key_values`: per layer L keys and L values of
    `num_key_value_heads` heads (grouped-query attention: PEFT #1901; each key/value head
    serves its group of query heads as the layer's own keys do), used as the CACHED keys
    and values are (post-rotary for Gemma/Llama), never masked; the text follows at
    positions L..L+S-1 (HF computes position ids from the cache length: GPT-2's learned
    position embeddings too). The flat prefix matrix is [L, num_layers * 2 * kv_heads *
    head_dim] read as [L, layer, key/value, head, head_dim], PEFT's layout, the keys as HF
    caches them (Gemma: keras-hub caches rotated keys with the rotary halves interleaved;
    `prefix_key_values` interleaves, a text init's activations are de-interleaved), so a
    PEFT prefix-tuning adapter's `prompt_embeddings` IS this matrix (`load_peft_adapter`).
  - `reparameterize=True`: deep, PEFT's `PrefixEncoder(prefix_projection=True)`: an
    embedding [L, kv_heads * head_dim] -> Linear -> tanh -> Linear to the flat prefix;
    shallow, P-tuning's MLP `PromptEncoder`: Linear -> ReLU -> Linear -> ReLU -> Linear.
    Linear layers initialised as `torch.nn.Linear` (uniform +-1/sqrt(fan_in)).
    `fold_reparameterization()` turns a trained model into the plain one (the MLP output
    stored as the prompt), as PEFT saves only the prefix for inference.
  - initialisation: "random" is PEFT's RANDOM (N(0, 1), `torch.nn.Embedding`); a text (or
    token ids) is PEFT's TEXT (the ids repeated / truncated to L). Differences: "vocab"
    draws rows WITHOUT replacement among the first `init_vocabulary_rows` (5000, Lester et
    al. and this package's T5/BERT prompts; PEFT's SAMPLE_VOCAB draws from the whole
    vocabulary with replacement: pass `init_vocabulary_rows=vocabulary_size` for the
    range); the text is tokenized without special tokens (an HF tokenizer may add BOS);
    and a deep prefix accepts "vocab" / text too: its initial keys/values are those the
    backbone computes for the tokens (Li & Liang's real-word activations), so at
    initialisation the model equals the backbone reading those tokens before the input.

Saved prompts and their format (`PROMPT_FORMAT_VERSION`, recorded as "prompt_format_version"
in `prompt_metadata()` -- a `save_prompt` file --, in `get_config()` -- a `.keras` file -- and
beside the variables in a weights file -- `save_weights`, `BackupAndRestore`, the `.keras`
file's weights): version 2 holds the conventions above (PEFT's). Version 1 is every file
without the record (tf_metaalign before 2026-11-27), whose Gemma conventions differ: the
forward pass multiplied a shallow prompt by sqrt(hidden_dim) (with the token embeddings,
after the concatenation), and a deep prefix held its keys in keras-hub's interleaved rotary
layout. Loading a version-1 Gemma prompt -- `load_prompt`, `keras.models.load_model`,
`load_weights` (of the model or of a trainer holding it) -- converts it so that the model
computes what the saved one computed, with a warning: a shallow prompt (or, reparameterised,
its MLP's last kernel and bias) is multiplied by sqrt(hidden_dim) in the variable's dtype (one
rounding, the product the old forward pass computed: in float32 the first layer's input is
bit-identical), a deep prefix's (or its MLP's last layer's) key columns are permuted (exact).
GPT-2 and Llama files of version 1 load unchanged. A version newer than this code's is
refused. Not converted: optimizer state restored with the model (e.g. Adam's or Adafactor's
moments, a prompt trainer's carried inner state) stays in the old units for its remaining
life (docs/promptability.md), and prompt values assigned by hand (`set_weights`,
`tf.train.Checkpoint`) carry no format: they are taken as version 2.

Mechanism (one for the three families; the backbone's own layer objects and weights, no
copy): shallow runs the backbone's embedding step and layers on the longer sequence. Deep
calls every decoder layer through its own key/value-cache interface, the route keras-hub's
`generate` takes: the layer gets a cache holding the prefix at positions 0..L-1 and
`cache_update_index=L`, so the layer's own code computes the text's keys/values (its
projections, its rotary embedding at positions L..), writes them after the prefix, builds
its causal mask with the prefix visible to every query, and repeats the key/value heads
for grouped-query attention. The padding mask given to the layers is [ones(L); mask].
TensorFlow registers no gradient for `XlaDynamicUpdateSlice` (what `keras.ops.slice_update`
runs), through which the layer writes the cache: on TensorFlow, importing this module
registers the exact one (an identity on the kept part, a slice for the update) when none is
registered. (JAX differentiates `lax.dynamic_update_slice` itself.)

Generation: `PromptedCausalLM` IS a `keras_hub.models.CausalLM`: `compile(sampler=...)` and
`generate(...)` are keras-hub's own, and `generate_step` is the family's own
(`GPT2CausalLM.generate_step`, ...) run on this model's `_build_cache` / `call_with_cache`:
the cache is L positions longer, its first L filled once per call (the deep prefix, or the
shallow prompt's keys/values computed by the layers), and every index is shifted by L.
"""

from __future__ import annotations

import warnings

import keras
import keras_hub
import numpy as np
from keras import ops

from tf_metaalign import backend
from tf_metaalign.prompts import storage
from tf_metaalign.prompts.base import MODES as MODES  # the modes PromptedCausalLM accepts
from tf_metaalign.prompts.base import KeyValueCache, PromptedBackbone, check_mode

__all__ = [
    "PROMPT_FORMAT_VERSION",
    "SUPPORTED_BACKBONES",
    "PromptedCausalLM",
    "prompt_causal_lm",
    "causal_lm_token_log_likelihoods",
    "causal_lm_score_fn",
]

INITS = ("random", "vocab")
#: The conventions of a saved prompt (module docstring): 1 = no record, before 2026-11-27
#: (Gemma's shallow prompt scaled by sqrt(hidden_dim) in the forward pass, Gemma's prefix keys
#: interleaved); 2 = PEFT's on transformers >= 5.4. Written by `save_prompt`, `get_config`
#: and `save_weights` (the key below), checked and converted from on every load.
PROMPT_FORMAT_VERSION = 2
_FORMAT_KEY = "prompt_format_version"

#: The keras-hub backbones (and subclasses, e.g. Llama3Backbone) `prompt_causal_lm` accepts.
SUPPORTED_BACKBONES = ("GPT2Backbone", "GemmaBackbone", "LlamaBackbone")

_FAMILIES = (
    ("gpt2", keras_hub.models.GPT2Backbone, keras_hub.models.GPT2CausalLM),
    ("gemma", keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM),
    ("llama", keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM),
)


# ------------------------------------------------------------ the gradient of slice_update


def _dynamic_update_slice_gradient(op, grad):
    """d/d(input): `grad` with the updated window zeroed; d/d(update): `grad` on the window.
    Start indices are clamped as XLA clamps them (the update always fits)."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla

    operand, update, start = op.inputs
    dtype = start.dtype
    start = tf.clip_by_value(
        start,
        tf.zeros_like(start),
        tf.shape(operand, out_type=dtype) - tf.shape(update, out_type=dtype),
    )
    grad_operand = xla.dynamic_update_slice(grad, tf.zeros_like(update), start)
    grad_update = tf.slice(grad, start, tf.shape(update, out_type=dtype))
    return grad_operand, grad_update, None


def _register_gradient():
    if not backend.is_tensorflow():
        return
    import tensorflow as tf

    try:
        tf.RegisterGradient("XlaDynamicUpdateSlice")(_dynamic_update_slice_gradient)
    except KeyError:  # registered already (a later TensorFlow, or another library)
        pass


_register_gradient()


# ------------------------------------------------------------------------- the families


def _family(backbone):
    """(name, keras-hub CausalLM class) of a supported backbone, else a ValueError."""
    for name, backbone_class, lm_class in _FAMILIES:
        if isinstance(backbone, backbone_class):
            return name, lm_class
    raise ValueError(
        "`backbone_or_causal_lm` must be a keras-hub decoder-only backbone of a supported "
        f"family -- {', '.join(SUPPORTED_BACKBONES)} (or a subclass such as Llama3Backbone), "
        "or a CausalLM around one (GPT2CausalLM, GemmaCausalLM, LlamaCausalLM); received "
        f"{type(backbone).__name__}. (BERT-family encoders: prompt_bert; T5: prompt_t5.)"
    )


def _gemma_keys_from_hf(keys):
    """Keys [..., d] with Hugging Face's rotary layout (halves apart) -> keras-hub Gemma's
    cache layout (halves interleaved: x_0, x_{d/2}, x_1, ...; `GemmaAttention._apply_rope`)."""
    return ops.reshape(ops.stack(ops.split(keys, 2, axis=-1), axis=-1), ops.shape(keys))


def _gemma_keys_to_hf(keys):
    """The inverse of `_gemma_keys_from_hf` on a NumPy array."""
    return np.concatenate([keys[..., 0::2], keys[..., 1::2]], axis=-1)


def _check_format(version, source):
    """A saved prompt's `prompt_format_version` if this code reads it, else a ValueError."""
    if (
        isinstance(version, bool)
        or not isinstance(version, (int, np.integer))
        or not 1 <= version <= PROMPT_FORMAT_VERSION
    ):
        raise ValueError(
            f"{source} has prompt_format_version={version!r}; this tf_metaalign reads 1 to "
            f"{PROMPT_FORMAT_VERSION}. A newer tf_metaalign wrote it: load it with that version "
            "(its conventions are not known here)."
        )
    return int(version)


def _torch_linear(rng, fan_in, fan_out):
    """`torch.nn.Linear`'s default initial (kernel [in, out], bias [out]): U(+-1/sqrt(in))."""
    bound = 1.0 / np.sqrt(fan_in)
    return (
        rng.uniform(-bound, bound, (fan_in, fan_out)),
        rng.uniform(-bound, bound, (fan_out,)),
    )


def _text_ids(init, tokenizer, length):
    """PEFT's TEXT init: the text's token ids, repeated then truncated to `length`."""
    if isinstance(init, str):
        if tokenizer is None:
            raise ValueError(
                f"`init`={init!r} is a text: it needs a tokenizer -- pass `tokenizer=` (e.g. "
                "a keras_hub GPT2Tokenizer) or a CausalLM with a preprocessor, or give the "
                "token ids instead."
            )
        ids = np.asarray(ops.convert_to_numpy(tokenizer(init))).reshape(-1)
    else:
        ids = np.asarray(init).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise ValueError(
                f"`init` must be 'random', 'vocab', a text or a sequence of token ids; "
                f"received {init!r}."
            )
    if ids.size == 0:
        raise ValueError(f"`init`={init!r} gives no token.")
    ids = np.tile(ids, -(-length // ids.size))[:length]
    return ids.astype("int32")


# ------------------------------------------------------------------------- the model


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptedCausalLM(PromptedBackbone, keras_hub.models.CausalLM):
    """A keras-hub decoder-only LM (GPT-2, Gemma, Llama) with a soft prompt: a
    `keras_hub.models.CausalLM` from `{"token_ids", "padding_mask"}` [B, S] to logits
    [B, S, V], running the backbone's own layers (see the module docstring for the
    semantics and the references).

    Args:
        backbone: a built `GPT2Backbone`, `GemmaBackbone` or `LlamaBackbone` (or subclass);
            shared, not copied (`train` sets no flag on it).
        length: L >= 0 virtual tokens (shallow) or key/value prefixes per layer (deep).
        mode: "shallow" (prompt tuning: L embeddings before the input's) or "deep" (prefix
            tuning / P-tuning v2: L keys and values before the text's in every layer).
        train: "prompt", "transformer" or "both": `trainable_variables` is exactly that set
            (`set_train` changes it).
        init: "random", "vocab", a text, or token ids (see the module docstring); None:
            "vocab" for shallow, "random" for deep (the T5 prompts' defaults).
        reparameterize: train the prompt through an MLP (deep: prefix tuning's; shallow:
            P-tuning's); `fold_reparameterization()` removes it.
        reparameterize_hidden_dim: the MLP's hidden width (PEFT's `encoder_hidden_size`);
            None: the embedding's width (PEFT's default).
        init_vocabulary_rows: "vocab" draws among this many first rows of the vocabulary.
        seed: seed of every initial value.
        preprocessor: a keras-hub `CausalLMPreprocessor` for string input to `fit` /
            `generate` (taken from the CausalLM when one is given to `prompt_causal_lm`).
        tokenizer: tokenizes a text `init` (default: the preprocessor's tokenizer).

    The prompt variables' names start with "prompt" (the prompt FOMAML / Reptile trainers'
    default selection). A zero-length prompt is the plain backbone (the same computation).
    Loading a saved `.keras` file needs this module imported (`tf_metaalign.prompts.
    PromptedCausalLM` imports it). Every saved file records `prompt_format_version`; a Gemma
    prompt saved before 2026-11-27 (no record) is converted on load, with a warning, to
    compute what it computed (the module docstring; docs/promptability.md).

    Example:

    >>> import keras_hub, numpy as np
    >>> from tf_metaalign import prompts
    >>> backbone = keras_hub.models.LlamaBackbone(
    ...     vocabulary_size=32, num_layers=1, num_query_heads=4, num_key_value_heads=2,
    ...     hidden_dim=8, intermediate_dim=16)
    >>> model = prompts.PromptedCausalLM(backbone, length=2, mode="deep", reparameterize=True)
    >>> [tuple(v.shape) for v in model.trainable_variables][:2]  # embedding, first Linear
    [(2, 4), (4, 4)]
    >>> tuple(model.prefix_key_values().shape)  # layers, key/value, L, kv heads, head dim
    (1, 2, 2, 2, 2)
    >>> folded = model.fold_reparameterization()
    >>> x = {"token_ids": np.array([[3, 4, 5]]), "padding_mask": np.array([[1, 1, 1]])}
    >>> bool(np.allclose(folded(x), model(x), atol=1e-6))
    True

    References:
        Li & Liang 2021 (prefix tuning); Lester et al. 2021 (prompt tuning); Hugging Face
        PEFT (`PrefixEncoder`, `PromptEmbedding`, `PromptEncoder`).
    """

    ARCHITECTURE = None  # per instance: "gpt2", "gemma" or "llama"

    def __init__(
        self,
        backbone,
        length=20,
        mode="shallow",
        train="prompt",
        init=None,
        reparameterize=False,
        reparameterize_hidden_dim=None,
        init_vocabulary_rows=5000,
        seed=0,
        preprocessor=None,
        tokenizer=None,
        **kwargs,
    ):
        family, lm_class = _family(backbone)
        check_mode(mode)
        if not isinstance(reparameterize, bool):
            raise ValueError(f"`reparameterize` must be True or False; got {reparameterize!r}.")
        if reparameterize_hidden_dim is not None and (
            isinstance(reparameterize_hidden_dim, bool)
            or not isinstance(reparameterize_hidden_dim, (int, np.integer))
            or reparameterize_hidden_dim < 1
        ):
            raise ValueError(
                "`reparameterize_hidden_dim` must be an integer >= 1 or None; got "
                f"{reparameterize_hidden_dim!r}."
            )
        super().__init__(backbone, length, mode, train, init_vocabulary_rows, seed, **kwargs)
        self.ARCHITECTURE = family
        self._lm_class = lm_class
        self.preprocessor = preprocessor
        self.dtype_policy = backbone.dtype_policy
        self.reparameterize = reparameterize
        self.reparameterize_hidden_dim = reparameterize_hidden_dim
        if family == "gpt2":
            self.num_key_value_heads = backbone.num_heads
            self.head_dim = backbone.hidden_dim // backbone.num_heads
        elif family == "gemma":
            self.num_key_value_heads = backbone.num_key_value_heads
            self.head_dim = backbone.head_dim
        else:
            self.num_key_value_heads = backbone.num_key_value_heads
            self.head_dim = backbone.hidden_dim // backbone.num_query_heads
        if tokenizer is None and preprocessor is not None:
            tokenizer = getattr(preprocessor, "tokenizer", None)
        self.init = self._resolve_init(init, tokenizer)
        self._create_prompt()
        self._select_trainable()

    # --- construction -------------------------------------------------------------

    @property
    def _prefix_width(self):
        return self.backbone.num_layers * 2 * self.num_key_value_heads * self.head_dim

    def _resolve_init(self, init, tokenizer):
        """ "random", "vocab" or a list of token ids (a text is tokenized once, here)."""
        if init is None:
            return "vocab" if self.mode == "shallow" else "random"
        if isinstance(init, str) and init in INITS:
            if self.length and self.reparameterize and self.mode == "deep" and init != "random":
                raise ValueError(
                    "`init` must be 'random' with mode='deep' and reparameterize=True (the "
                    "prefix MLP's input is a free embedding, as in PEFT's PrefixEncoder); "
                    f"received init={init!r}."
                )
            return init
        if self.reparameterize and self.mode == "deep":
            raise ValueError(
                "A text / token-id `init` needs reparameterize=False in deep mode (it sets "
                "the prefix itself); received reparameterize=True."
            )
        return [int(i) for i in _text_ids(init, tokenizer, max(self.length, 1))[: self.length]]

    def _init_ids(self):
        if self.init == "vocab":
            return storage.vocabulary_row_ids(
                self.backbone.vocabulary_size, self.length, self.init_vocabulary_rows, self.seed
            )
        return np.asarray(self.init, "int32")

    def _create_prompt(self):
        storage.check_train(self.train)
        rng = np.random.default_rng(self.seed)
        hidden_dim = self.backbone.hidden_dim
        table = None
        if self.init != "random":
            ids = self._init_ids()  # "vocab": the rows storage.vocabulary_rows_init draws
            if self.mode == "shallow":  # the tokens' rows as the first layer reads them
                table = ops.convert_to_numpy(self._token_embeddings(ids))
            else:
                table = self._activation_prefix(ids)
        self.prompt_variables = []
        if not self.reparameterize:
            if table is None:
                width = hidden_dim if self.mode == "shallow" else self._prefix_width
                table = rng.standard_normal((self.length, width))
            name = "prompt_embeddings" if self.mode == "shallow" else "prompt_prefix"
            self.prompt_variables.append(self._add_prompt_variable(name, table))
            return
        if self.mode == "shallow":
            width = hidden_dim
            if table is None:
                table = rng.standard_normal((self.length, width))
            hidden = self.reparameterize_hidden_dim or width
            shapes = [(width, hidden), (hidden, hidden), (hidden, width)]
        else:  # PEFT PrefixEncoder: token_dim = kv_heads * head_dim
            width = self.num_key_value_heads * self.head_dim
            table = rng.standard_normal((self.length, width))
            hidden = self.reparameterize_hidden_dim or width
            shapes = [(width, hidden), (hidden, self._prefix_width)]
        self.prompt_variables.append(self._add_prompt_variable("prompt_embeddings", table))
        for i, (fan_in, fan_out) in enumerate(shapes):
            kernel, bias = _torch_linear(rng, fan_in, fan_out)
            self.prompt_variables.extend(
                [
                    self._add_prompt_variable(f"prompt_mlp_{i}_kernel", kernel),
                    self._add_prompt_variable(f"prompt_mlp_{i}_bias", bias),
                ]
            )

    def _activation_prefix(self, ids):
        """[L, num_layers * 2 * kv_heads * head_dim]: the keys/values each layer computes
        for `ids` at positions 0..L-1 (what a shallow prompt of those tokens gives)."""
        ids = ops.convert_to_tensor(np.asarray(ids, "int32")[None])
        cache = self._run_prefix_layers(self._token_embeddings(ids))  # [1, layers, 2, L, kv, d]
        cache = ops.convert_to_numpy(ops.cast(cache[0], "float32"))
        if self.ARCHITECTURE == "gemma":  # keras-hub's interleaved rotary keys -> PEFT's
            cache[:, 0] = _gemma_keys_to_hf(cache[:, 0])
        return np.transpose(cache, (2, 0, 1, 3, 4)).reshape(self.length, -1)

    # --- the prompt's values --------------------------------------------------------

    def _mlp(self, x):
        weights = self.prompt_variables[1:]
        layers = len(weights) // 2
        activation = ops.relu if self.mode == "shallow" else ops.tanh
        for i in range(layers):
            kernel, bias = (ops.cast(w, x.dtype) for w in weights[2 * i : 2 * i + 2])
            x = ops.matmul(x, kernel) + bias
            if i < layers - 1:
                x = activation(x)
        return x

    def prompt_values(self):
        """The effective prompt: shallow [L, hidden_dim] embeddings; deep the flat prefix
        [L, num_layers * 2 * kv_heads * head_dim]; through the MLP when reparameterised."""
        value = ops.cast(self.prompt_variables[0], self.backbone.compute_dtype)
        return self._mlp(value) if self.reparameterize else value

    def prefix_key_values(self):
        """Deep mode: the prefix as keras-hub's per-layer cache entries,
        [num_layers, 2 (key, value), L, kv_heads, head_dim].

        The flat prefix (`prompt_values()`, the variable) is in PEFT's layout: the keys as
        Hugging Face caches them, rotary halves unpermuted. keras-hub's Gemma attention
        caches its rotated keys with the halves interleaved (x_0, x_{d/2}, x_1, ...,
        `GemmaAttention._apply_rope`, to match the original JAX Gemma), so for Gemma the keys
        are interleaved here; GPT-2 (no rotary) and Llama (rotate-half, as HF) are unchanged.
        """
        if self.mode != "deep":
            raise ValueError("`prefix_key_values` is defined for mode='deep' only.")
        flat = ops.reshape(
            self.prompt_values(),
            (self.length, self.backbone.num_layers, 2, self.num_key_value_heads, self.head_dim),
        )
        prefix = ops.transpose(flat, (1, 2, 0, 3, 4))
        if self.ARCHITECTURE != "gemma":
            return prefix
        keys = _gemma_keys_from_hf(prefix[:, 0])
        return ops.stack([keys, prefix[:, 1]], axis=1)

    def fold_reparameterization(self, name=None):
        """The same model without the MLP: a new `PromptedCausalLM` (same backbone, mode,
        length, train) whose prompt variable holds the MLP's output. Its logits equal this
        model's; train and save it for inference (PEFT saves only the prefix)."""
        if not self.reparameterize:
            raise ValueError(
                "`fold_reparameterization` needs a model built with reparameterize=True."
            )
        folded = PromptedCausalLM(
            self.backbone,
            length=self.length,
            mode=self.mode,
            train=self.train,
            init="random",
            seed=self.seed,
            preprocessor=self.preprocessor,
            name=name,
        )
        folded.prompt_variables[0].assign(
            ops.cast(self.prompt_values(), folded.prompt_variables[0].dtype)
        )
        return folded

    # --- the backbone's pieces, per family -----------------------------------------

    def _token_embeddings(self, token_ids):
        """Tokens [B, n] -> their input embeddings [B, n, H], in the units of a shallow
        prompt: the embedding rows, times sqrt(hidden_dim) for Gemma (the backbone's own
        scaling, which Hugging Face transformers >= 5.4 applies inside `embed_tokens`, so
        that PEFT's prompt, concatenated after it, is not scaled)."""
        x = self.backbone.token_embedding(token_ids)
        if self.ARCHITECTURE == "gemma":
            return x * ops.cast(ops.sqrt(self.backbone.hidden_dim), x.dtype)
        return x

    def _embed(self, embeddings, start_index, training=False):
        """The backbone's step from input embeddings [B, n, H] (`_token_embeddings`, a
        shallow prompt) to the first layer's input, for positions start_index.. : GPT-2
        adds its learned position embeddings (and dropout); Gemma and Llama: as is."""
        b = self.backbone
        if self.ARCHITECTURE == "gpt2":
            positions = b.position_embedding(embeddings, start_index=start_index)
            x = b.embeddings_add((embeddings, positions))
            return b.embeddings_dropout(x, training=training)
        return embeddings

    def _layer(self, layer, x, padding_mask, cache=None, cache_update_index=None, training=False):
        """One decoder layer through its own call signature; returns x, or (x, cache)."""
        if self.ARCHITECTURE == "gemma":  # no `training` argument: the call context's
            if cache is None:
                return layer(x, padding_mask=padding_mask)
            return layer(
                x, padding_mask=padding_mask, cache=cache, cache_update_index=cache_update_index
            )
        kwargs = {"decoder_padding_mask": padding_mask, "training": training}
        if cache is not None:
            kwargs.update(
                self_attention_cache=cache, self_attention_cache_update_index=cache_update_index
            )
        return layer(x, **kwargs)

    def _check_positions(self, sequence_length):
        """GPT-2's learned positions end at max_sequence_length: L + S must fit."""
        limit = getattr(self.backbone, "max_sequence_length", None)
        if self.ARCHITECTURE != "gpt2" or limit is None or sequence_length is None:
            return
        if self.length + int(sequence_length) > limit:
            raise ValueError(
                f"The prompt (length {self.length}) and a sequence of {int(sequence_length)} "
                f"tokens need {self.length + int(sequence_length)} positions; the GPT-2 "
                f"backbone has max_sequence_length={limit}."
            )

    def _run_prefix_layers(self, prompt_embeddings):
        """The keys/values every layer computes for `prompt_embeddings` [B, L, H] read as
        tokens at positions 0..L-1: [B, num_layers, 2, L, kv_heads, head_dim]."""
        x = self._embed(prompt_embeddings, 0)
        batch_size = ops.shape(x)[0]
        shape = (batch_size, 2, self.length, self.num_key_value_heads, self.head_dim)
        caches = []
        for layer in self.backbone.transformer_layers:
            x, cache = self._layer(layer, x, None, ops.zeros(shape, x.dtype), 0)
            caches.append(cache)
        return ops.stack(caches, axis=1)

    # --- forward --------------------------------------------------------------------

    def sequence_output(self, token_ids, padding_mask=None, training=False):
        """The final hidden states [B, S, H] of the real tokens (the backbone's output,
        prompt positions dropped)."""
        b = self.backbone
        token_ids = ops.convert_to_tensor(token_ids, "int32")
        if padding_mask is None:
            padding_mask = ops.ones_like(token_ids)
        mask = ops.cast(padding_mask, "int32")
        self._check_positions(token_ids.shape[1])
        x = self._token_embeddings(token_ids)
        batch_size, length = ops.shape(x)[0], self.length
        ones = ops.ones((batch_size, length), "int32")
        if length and self.mode == "deep":
            x = self._embed(x, length, training)
            mask = ops.concatenate([ones, mask], axis=1)
            prefix = ops.cast(self.prefix_key_values(), x.dtype)
            real = ops.zeros(
                (batch_size, ops.shape(x)[1], self.num_key_value_heads, self.head_dim), x.dtype
            )
            shape = (batch_size,) + tuple(prefix.shape[2:])
            for i, layer in enumerate(b.transformer_layers):
                # Keys and values held apart: a stacked cache's reads differentiate into
                # dense StridedSliceGrads (see KeyValueCache).
                keys, values = (
                    ops.concatenate([ops.broadcast_to(prefix[i, j][None], shape), real], axis=1)
                    for j in (0, 1)
                )
                cache = KeyValueCache(keys, values)
                x, _ = self._layer(layer, x, mask, cache, length, training)
        else:
            if length:
                prompt = ops.cast(self.prompt_values(), x.dtype)[None]
                prompt = ops.broadcast_to(prompt, (batch_size, length, b.hidden_dim))
                x = ops.concatenate([prompt, x], axis=1)
                mask = ops.concatenate([ones, mask], axis=1)
            x = self._embed(x, 0, training)
            for layer in b.transformer_layers:
                x = self._layer(layer, x, mask, training=training)
            x = x[:, length:]
        return b.layer_norm(x)

    def call(self, inputs, training=False):
        if not isinstance(inputs, dict) or "token_ids" not in inputs:
            raise ValueError(
                "A PromptedCausalLM takes {'token_ids': [B, S], 'padding_mask': [B, S]} (the "
                f"backbone's inputs); received {type(inputs).__name__}."
            )
        hidden = self.sequence_output(
            inputs["token_ids"], inputs.get("padding_mask"), training=training
        )
        return self.backbone.token_embedding(hidden, reverse=True)

    # --- keras-hub generation --------------------------------------------------------

    def _build_cache(self, token_ids):
        """keras-hub's cache [B, num_layers, 2, L + T, kv_heads, head_dim] with the
        prompt's keys/values at 0..L-1 (filled here, once), then `token_ids` prefilled."""
        b = self.backbone
        batch_size, max_length = ops.shape(token_ids)[0], ops.shape(token_ids)[1]
        self._check_positions(token_ids.shape[1])
        shape = (batch_size, b.num_layers, 2, max_length, self.num_key_value_heads, self.head_dim)
        cache = ops.zeros(shape, dtype=self.backbone.compute_dtype)
        if self.length:
            if self.mode == "deep":
                prefix = ops.cast(self.prefix_key_values(), cache.dtype)[None]
            else:
                prompt = ops.cast(self.prompt_values(), cache.dtype)[None]
                prefix = ops.cast(self._run_prefix_layers(prompt), cache.dtype)
            prefix = ops.broadcast_to(prefix, (batch_size,) + tuple(prefix.shape[1:]))
            cache = ops.concatenate([prefix, cache], axis=3)
        _, hidden_states, cache = self.call_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """keras-hub's `CausalLM.call_with_cache` for `token_ids` at text position
        `cache_update_index` (cache position L + it). Returns (logits, hidden, cache)."""
        b = self.backbone
        index = cache_update_index + self.length
        x = self._embed(self._token_embeddings(token_ids), index)
        caches = []
        for i, layer in enumerate(b.transformer_layers):
            x, next_cache = self._layer(layer, x, None, cache[:, i, ...], index)
            caches.append(next_cache)
        cache = ops.stack(caches, axis=1)
        hidden_states = b.layer_norm(x)
        logits = b.token_embedding(hidden_states, reverse=True)
        return logits, hidden_states, cache

    # --- fit / evaluate / predict without a preprocessor ----------------------------

    def _without_pipeline(self):
        """On JAX, with no preprocessor: keras-hub's `PipelineModel` would batch the data
        with tf.data or grain to map a preprocessor over it (an ImportError without either),
        though there is nothing to map; Keras's own data adapters take the token arrays."""
        return self.preprocessor is None and backend.is_jax()

    def fit(self, *args, **kwargs):
        if self._without_pipeline():
            return keras.Model.fit(self, *args, **kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        if self._without_pipeline():
            return keras.Model.evaluate(self, *args, **kwargs)
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if self._without_pipeline():
            return keras.Model.predict(self, *args, **kwargs)
        return super().predict(*args, **kwargs)

    def generate_step(self, inputs, stop_token_ids=None):
        """The family's own keras-hub `generate_step` (sampler loop, stop tokens), on this
        model's cache."""
        return self._lm_class.generate_step(self, inputs, stop_token_ids=stop_token_ids)

    # --- saving ---------------------------------------------------------------------

    def prompt_metadata(self):
        metadata = super().prompt_metadata()
        metadata["reparameterize"] = self.reparameterize
        metadata[_FORMAT_KEY] = PROMPT_FORMAT_VERSION
        return metadata

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "init": self.init,
                "reparameterize": self.reparameterize,
                "reparameterize_hidden_dim": self.reparameterize_hidden_dim,
                "preprocessor": (
                    None if self.preprocessor is None else keras.layers.serialize(self.preprocessor)
                ),
                _FORMAT_KEY: PROMPT_FORMAT_VERSION,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # No key: a .keras file of format 1, whose weights (no record either) load_own_variables
        # converts; a newer format is refused here, before anything is built.
        _check_format(config.pop(_FORMAT_KEY, 1), "The model config")
        if isinstance(config.get("preprocessor"), dict):
            config["preprocessor"] = keras.layers.deserialize(config["preprocessor"])
        return super().from_config(config)

    def save_own_variables(self, store):
        """Keras's (the prompt variables), and the prompt format beside them, so that a
        weights file (`save_weights`, `BackupAndRestore`), which carries no config, says which
        conventions its values are in."""
        super().save_own_variables(store)
        store[_FORMAT_KEY] = np.asarray(PROMPT_FORMAT_VERSION, "int32")

    def load_own_variables(self, store):
        """Keras's, then a file without the format record (format 1: written before it
        existed) is converted to this format (`_upgrade_prompt`)."""
        keys = list(store.keys())
        version = 1
        if _FORMAT_KEY in keys:
            version = int(np.asarray(store[_FORMAT_KEY]))
            store = {k: store[k] for k in keys if k != _FORMAT_KEY}
        _check_format(version, f"The weights of {self.name!r}")
        super().load_own_variables(store)
        if self._needs_upgrade(version):
            values = self._upgrade_prompt(
                [v.numpy() for v in self.prompt_variables],
                version,
                f"The weights of {self.name!r} (a weights or .keras file)",
            )
            for variable, value in zip(self.prompt_variables, values):
                variable.assign(value)

    def _upgrade_saved_prompt(self, values, metadata, source):
        """`storage.load_prompt`'s hook: `values` (one array per prompt variable) read from a
        prompt file with `metadata`, in this format's conventions."""
        version = metadata.get(_FORMAT_KEY, 1)
        _check_format(version, source)
        if not self._needs_upgrade(version):
            return values
        return self._upgrade_prompt(values, version, source)

    def _needs_upgrade(self, version):
        return version < 2 and self.ARCHITECTURE == "gemma" and self.length > 0

    def _upgrade_prompt(self, values, version, source):
        """Format-1 Gemma prompt values -> format 2, the same function (module docstring).

        Shallow: the old forward pass fed `prompt * cast(sqrt(hidden_dim))` (in the compute
        dtype) to the first layer; the prompt (or the MLP's last kernel and bias, whose output
        it is) is multiplied by the same constant, in the variable's dtype. Deep: the old
        prefix held keras-hub's interleaved keys; their columns (of the prefix, or of the
        MLP's last kernel and bias) are permuted to Hugging Face's layout."""
        values = [np.asarray(v) for v in values]
        dtype = self.prompt_variables[0].dtype
        last = [len(values) - 2, len(values) - 1] if self.reparameterize else [0]
        for i in last:
            if self.mode == "shallow":
                scale = ops.cast(ops.sqrt(self.backbone.hidden_dim), dtype)
                values[i] = ops.convert_to_numpy(ops.cast(values[i], dtype) * scale)
            else:
                shape = values[i].shape
                split = shape[:-1] + (-1, 2, self.num_key_value_heads, self.head_dim)
                value = values[i].reshape(split).copy()
                value[..., 0, :, :] = _gemma_keys_to_hf(value[..., 0, :, :])
                values[i] = value.reshape(shape)
        what = (
            f"multiplied by sqrt(hidden_dim) = sqrt({self.backbone.hidden_dim}) in {dtype} "
            "(what the old forward pass did; now only the token embeddings are scaled)"
            if self.mode == "shallow"
            else "its keys' rotary halves de-interleaved to Hugging Face's layout (exact)"
        )
        part = "its MLP's last layer" if self.reparameterize else "the values"
        warnings.warn(
            f"{source} holds a Gemma {self.mode} prompt of prompt_format_version {version} "
            f"(saved by tf_metaalign before 2026-11-27): converted to format "
            f"{PROMPT_FORMAT_VERSION} (PEFT's conventions) -- {part} {what} -- so the model "
            "computes what the saved one did. Save it again to write the new format. An "
            "optimizer state restored with it is not converted (see docs/promptability.md).",
            UserWarning,
            stacklevel=3,
        )
        return values


def prompt_causal_lm(
    backbone_or_causal_lm,
    length=20,
    mode="shallow",
    train="prompt",
    init=None,
    reparameterize=False,
    reparameterize_hidden_dim=None,
    init_vocabulary_rows=5000,
    seed=0,
    tokenizer=None,
    name=None,
) -> PromptedCausalLM:
    """Prompt or prefix tuning for a keras-hub decoder-only LM (GPT-2, Gemma, Llama).

    Args:
        backbone_or_causal_lm: a `GPT2Backbone`, `GemmaBackbone` or `LlamaBackbone` (or a
            subclass), or a `GPT2CausalLM` / `GemmaCausalLM` / `LlamaCausalLM` (its backbone
            and preprocessor are used; its weights are shared, not copied).
        length: L >= 0 virtual tokens (shallow) or prefix keys/values per layer (deep).
        mode: "shallow" (prompt tuning) or "deep" (prefix tuning / P-tuning v2).
        train: "prompt" (the backbone frozen), "transformer" or "both".
        init: "random", "vocab", a text (PEFT's TEXT init; tokenized by `tokenizer` or the
            CausalLM's preprocessor) or token ids; None: "vocab" (shallow) / "random" (deep).
        reparameterize: train through the prefix-tuning (deep) / P-tuning (shallow) MLP;
            fold it away after training with `fold_reparameterization()`.
        reparameterize_hidden_dim: the MLP's hidden width (None: the embedding width).
        init_vocabulary_rows: "vocab" draws among this many first vocabulary rows.
        seed: seed of the initial prompt.
        tokenizer: tokenizes a text `init`.
        name: the model's name.

    Returns:
        A `PromptedCausalLM`: a keras-hub `CausalLM` (logits for `fit`, `generate` with
        keras-hub's samplers and cache) whose `trainable_variables` are what `train` says.

    Raises:
        ValueError: an unsupported backbone (the message names the supported ones), or a
            bad `length` / `mode` / `train` / `init`.

    Example:

    >>> import keras_hub, numpy as np
    >>> from tf_metaalign import prompts
    >>> backbone = keras_hub.models.GPT2Backbone(
    ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
    ...     intermediate_dim=16, max_sequence_length=16)
    >>> model = prompts.prompt_causal_lm(backbone, length=3, mode="deep")
    >>> [v.name for v in model.trainable_variables]
    ['prompt_prefix']
    >>> x = {"token_ids": np.array([[5, 6, 7, 0]]), "padding_mask": np.array([[1, 1, 1, 0]])}
    >>> model(x).shape
    TensorShape([1, 4, 32])
    >>> model.compile(sampler="greedy")
    >>> model.generate(x, stop_token_ids=None)["token_ids"].shape
    (1, 4)

    References:
        Lester et al. 2021 (prompt tuning); Li & Liang 2021 (prefix tuning); Liu et al.
        2022 (P-tuning v2); Hugging Face PEFT's prompt_tuning / prefix_tuning / p_tuning.
    """
    backbone, preprocessor = backbone_or_causal_lm, None
    if isinstance(backbone_or_causal_lm, keras_hub.models.CausalLM) and not isinstance(
        backbone_or_causal_lm, PromptedCausalLM
    ):
        backbone = backbone_or_causal_lm.backbone
        preprocessor = backbone_or_causal_lm.preprocessor
    return PromptedCausalLM(
        backbone,
        length=length,
        mode=mode,
        train=train,
        init=init,
        reparameterize=reparameterize,
        reparameterize_hidden_dim=reparameterize_hidden_dim,
        init_vocabulary_rows=init_vocabulary_rows,
        seed=seed,
        preprocessor=preprocessor,
        tokenizer=tokenizer,
        name=name,
    )


# ------------------------------------------------------------------------- scoring


def causal_lm_token_log_likelihoods(
    model, input_ids, input_padding_mask, target_ids, target_padding_mask=None, training=False
):
    """log p(y_t | x, y_<t) [N, T] of each target (answer) token after its input, by one
    forward pass of a decoder over the packed sequence `x_1..x_n, y_1..y_m`.

    Args:
        model: a `PromptedCausalLM` or any keras-hub `CausalLM` (`{"token_ids",
            "padding_mask"} -> logits`).
        input_ids: [N, S] int, each row's real tokens first (right padding); every row
            needs at least one (a BOS), as a decoder predicts the first answer token from
            the last input token.
        input_padding_mask: [N, S] 0/1, 1 on the real input tokens.
        target_ids: [N, T] int, the answer continuations (right padding).
        target_padding_mask: [N, T] 0/1, 1 on the real answer tokens (None: all ones).
        training: passed to the model.

    Returns:
        [N, T] float32 log-likelihoods (float64 for a float64 model), 0 where
        `target_padding_mask` is 0.

    Example:

    >>> import keras_hub, numpy as np
    >>> from tf_metaalign import prompts
    >>> lm = prompts.prompt_causal_lm(keras_hub.models.GPT2Backbone(
    ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
    ...     intermediate_dim=16, max_sequence_length=16), length=2)
    >>> ll = prompts.causal_lm_token_log_likelihoods(
    ...     lm, [[3, 4, 0]], [[1, 1, 0]], [[7, 8]], [[1, 0]])
    >>> ll.shape, float(ll[0, 1])
    (TensorShape([1, 2]), 0.0)

    References:
        Brown et al. 2020 (GPT-3: rank classification by the answer's likelihood);
        Sanh et al. 2022 (T0's rank classification).
    """
    input_ids = ops.convert_to_tensor(input_ids, "int32")
    target_ids = ops.convert_to_tensor(target_ids, "int32")
    input_mask = ops.cast(ops.convert_to_tensor(input_padding_mask), "int32")
    if target_padding_mask is None:
        target_padding_mask = ops.ones_like(target_ids)
    target_mask = ops.cast(ops.convert_to_tensor(target_padding_mask), "int32")
    input_lengths = ops.sum(input_mask, axis=-1)
    input_lengths = _assert_positive(
        input_lengths,
        "every input row needs at least one real token (e.g. a BOS) before its answer",
    )
    target_lengths = ops.sum(target_mask, axis=-1)
    s, t = ops.shape(input_ids)[1], ops.shape(target_ids)[1]
    j = ops.arange(s + t, dtype="int32")[None, :]
    packed_mask = j < (input_lengths + target_lengths)[:, None]  # [N, S + T]
    from_input = j < input_lengths[:, None]
    input_index = ops.broadcast_to(ops.minimum(j, s - 1), ops.shape(packed_mask))
    input_part = ops.take_along_axis(input_ids, input_index, axis=1)
    target_index = ops.clip(j - input_lengths[:, None], 0, t - 1)
    target_part = ops.take_along_axis(target_ids, target_index, axis=1)
    packed = ops.where(packed_mask, ops.where(from_input, input_part, target_part), 0)
    logits = model(
        {"token_ids": packed, "padding_mask": ops.cast(packed_mask, "int32")}, training=training
    )
    # float32 at least (half-precision logits), float64 logits kept as they are
    dtype = "float64" if keras.backend.standardize_dtype(logits.dtype) == "float64" else "float32"
    log_probs = ops.log_softmax(ops.cast(logits, dtype), axis=-1)
    # Target t sits at packed position n + t and is predicted by position n + t - 1.
    read = input_lengths[:, None] - 1 + ops.arange(t, dtype="int32")[None, :]
    read = ops.clip(read, 0, s + t - 1)
    per_position = ops.take_along_axis(log_probs, read[..., None], axis=1)  # [N, T, V]
    picked = ops.take_along_axis(per_position, target_ids[..., None], axis=-1)[..., 0]
    return ops.where(target_mask > 0, picked, ops.zeros_like(picked))


def _assert_positive(lengths, message):
    """`lengths`, checked > 0: on TensorFlow by an assertion op (also in a traced function),
    on JAX when the values are concrete (a jitted caller's traced values are not checked)."""
    if backend.is_tensorflow():
        import tensorflow as tf

        tf.debugging.assert_positive(lengths, message=message)
        return lengths
    try:
        values = np.asarray(lengths)
    except Exception:  # a traced value (inside jax.jit)
        return lengths
    if not (values > 0).all():
        raise ValueError(f"`input_padding_mask`: {message}; row lengths {values.tolist()}.")
    return lengths


def causal_lm_score_fn(model, pad_id=0, training=False):
    """A `score_fn` for `rank_classification` / `rank_classify_examples` from a decoder:
    `score_fn(input_ids, target_ids, target_mask) -> [N, T]` log-likelihoods of each
    answer token after its input (`causal_lm_token_log_likelihoods`). The inputs arrive
    padded with `pad_id` (give `rank_classify_examples` the same `pad_id`): trailing
    `pad_id` tokens of an input row are padding.

    Example:

    >>> import keras_hub, numpy as np
    >>> from tf_metaalign import prompts
    >>> lm = prompts.prompt_causal_lm(keras_hub.models.GPT2Backbone(
    ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
    ...     intermediate_dim=16, max_sequence_length=16), length=2)
    >>> predictions, scores = prompts.rank_classification(
    ...     prompts.causal_lm_score_fn(lm), [[3, 4]], [[[7, 1], [8, 1]]], [[[1, 1], [1, 1]]])
    >>> scores.shape
    (1, 2)

    References:
        Sanh et al. 2022 (T0); Wu et al. 2022 (the mean per-token reduction).
    """

    def score_fn(input_ids, target_ids, target_mask):
        ids = np.asarray(input_ids)
        real = ids != pad_id
        lengths = np.where(real.any(-1), ids.shape[1] - np.argmax(real[:, ::-1], axis=-1), 0)
        mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype("int32")
        return ops.convert_to_numpy(
            causal_lm_token_log_likelihoods(
                model, ids, mask, target_ids, target_mask, training=training
            )
        )

    return score_fn
