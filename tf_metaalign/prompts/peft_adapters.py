"""Hugging Face PEFT prompt-learning adapters in and out of the prompted keras-hub models:
`load_peft_adapter` reads a PEFT prompt-tuning, P-tuning or prefix-tuning adapter
directory (`adapter_config.json` + `adapter_model.safetensors`) into a `PromptedCausalLM`
(GPT-2, Llama, Gemma) or a shallow `PromptedT5`; `save_peft_adapter` writes one that PEFT's
`PeftModel.from_pretrained` loads. Needs only `safetensors` and json (no torch).

What PEFT stores (peft 0.21: `utils/save_and_load.py`, `BasePromptEncoder.
_get_adapter_state_dict`, `PeftModel.get_prompt_embedding_to_save`): ONE tensor,
`prompt_embeddings`, the prompt encoder's OUTPUT (an MLP -- prefix_projection, P-tuning's
encoder -- already applied):

* prompt tuning / P-tuning: [num_virtual_tokens * num_transformer_submodules, token_dim],
  the virtual tokens' input embeddings, concatenated before the tokens' (`inputs_embeds`);
  a seq2seq model uses only the first num_virtual_tokens rows (`PeftModelForSeq2SeqLM.
  forward`), prepended to the encoder's input.
* prefix tuning: [num_virtual_tokens, num_layers * 2 * token_dim] read as [L, layer,
  key/value, num_attention_heads, token_dim // num_attention_heads] (`PeftModel.
  get_prompt`), given as `past_key_values`; under grouped-query attention num_attention_heads
  is the model's key/value heads (PEFT #1901).

Both are exactly the prompt variables of `PromptedCausalLM` (`prompt_values()`): the
prefix in PEFT's layout (Gemma's keys as Hugging Face caches them, see
`PromptedCausalLM.prefix_key_values`) and a shallow Gemma prompt unscaled, as transformers
>= 5.4 feeds it (its Gemma scales inside `embed_tokens`). So the values are copied as they
are: loading then saving gives the same bytes. Differences from PEFT: a model built with
`reparameterize=True` cannot load (as PEFT's `PrefixEncoder.load_prompt_embeddings`
cannot: the MLP's input cannot be recovered from its output); it saves its MLP's output, as
PEFT does. A T5 prefix (mode="deep") is not converted: PEFT's prefix tuning on T5 prefixes
the decoder self-attention only, with T5's relative position bias over the prefix, while
`PromptedT5`'s deep prompts are Wu et al.'s (encoder, decoder and cross attention, no
position bias on the prefix) -- another model, not another layout.
"""

from __future__ import annotations

import json
import os

import numpy as np
from keras import ops

from tf_metaalign.prompts.base import PromptedBackbone
from tf_metaalign.prompts.t5 import PromptedT5

__all__ = ["load_peft_adapter", "save_peft_adapter"]

CONFIG_NAME = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME
WEIGHTS_NAME = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
_TENSOR = "prompt_embeddings"
_ARCHITECTURE_KEY = "tf_metaalign_architecture"  # safetensors metadata (PEFT ignores it)
_SHALLOW_TYPES = ("PROMPT_TUNING", "P_TUNING")
_DEEP_TYPES = ("PREFIX_TUNING",)


def _expected(model):
    """(task_type, mode, the PEFT config values the adapter must have) for `model`."""
    if isinstance(model, PromptedT5):
        if model.mode != "shallow":
            raise ValueError(
                "PEFT adapters convert into a shallow PromptedT5 only (prompt tuning). PEFT's "
                "prefix tuning on T5 prefixes the decoder self-attention alone, with T5's "
                "relative position bias over the prefix; PromptedT5(mode='deep') follows Wu et "
                "al. (encoder, decoder and cross-attention prefixes without position bias): a "
                "different model, so it is not converted. Received a PromptedT5 with "
                "mode='deep'."
            )
        b = model.backbone
        dims = {"num_layers": b.num_layers, "token_dim": b.hidden_dim}
        dims["num_attention_heads"] = b.num_heads
        return "SEQ_2_SEQ_LM", "shallow", dims
    if not (isinstance(model, PromptedBackbone) and hasattr(model, "prefix_key_values")):
        raise ValueError(
            "`model` must be a PromptedCausalLM (GPT-2, Gemma, Llama: prompt or prefix "
            "tuning) or a PromptedT5 with mode='shallow' (prompt tuning); received "
            f"{type(model).__name__}."
        )
    b = model.backbone
    if model.mode == "shallow":
        heads = getattr(b, "num_heads", None) or b.num_query_heads
        dims = {"num_layers": b.num_layers, "token_dim": b.hidden_dim}
        dims["num_attention_heads"] = heads
    else:  # PEFT #1901: the key/value heads under grouped-query attention
        dims = {
            "num_layers": b.num_layers,
            "token_dim": model.num_key_value_heads * model.head_dim,
            "num_attention_heads": model.num_key_value_heads,
        }
    return "CAUSAL_LM", model.mode, dims


def _width(mode, dims):
    if mode == "shallow":
        return dims["token_dim"]
    return dims["num_layers"] * 2 * dims["token_dim"]


def _gemma_scale(model, gemma_legacy_scaling):
    """The factor between a transformers < 5.4 Gemma prompt and this package's: sqrt(H)."""
    if not isinstance(gemma_legacy_scaling, bool):
        raise ValueError(
            f"`gemma_legacy_scaling` must be True or False; received {gemma_legacy_scaling!r}."
        )
    if not gemma_legacy_scaling:
        return None
    if getattr(model, "ARCHITECTURE", None) != "gemma" or model.mode != "shallow":
        raise ValueError(
            "`gemma_legacy_scaling=True` applies to a shallow Gemma prompt only (transformers "
            "< 5.4 scaled Gemma's `inputs_embeds`, the prompt included, by sqrt(hidden_size)); "
            f"received a {type(model).__name__} with architecture="
            f"{getattr(model, 'ARCHITECTURE', None)!r}, mode={model.mode!r}."
        )
    return np.sqrt(np.float32(model.backbone.hidden_dim))


def load_peft_adapter(model, path, gemma_legacy_scaling=False) -> None:
    """Assign a Hugging Face PEFT prompt-learning adapter to `model`'s prompt variable.

    Args:
      model: a `PromptedCausalLM` built with the adapter's method (mode="shallow" for
        PEFT's PROMPT_TUNING / P_TUNING, mode="deep" for PREFIX_TUNING), its
        `num_virtual_tokens` as `length` and `reparameterize=False`; or a
        `PromptedT5(mode="shallow")` for a SEQ_2_SEQ_LM prompt-tuning adapter.
      path: the adapter directory (`adapter_config.json` and `adapter_model.safetensors`,
        what PEFT's `save_pretrained` writes).
      gemma_legacy_scaling: True for a Gemma prompt-tuning adapter trained with
        transformers < 5.4, whose Gemma multiplied `inputs_embeds` -- the prompt included --
        by sqrt(hidden_size): the prompt is multiplied by it on loading (not bit-exact).
        The adapter file does not say which; transformers >= 5.4 (the default) scales the
        tokens' embeddings only.

    Returns:
      None; the model's prompt variable holds the adapter's `prompt_embeddings` (the first
      `length` rows of a seq2seq prompt), cast to its dtype.

    Raises:
      ValueError: not a prompt-learning adapter (e.g. LoRA: the message names the PEFT
        types accepted), a task type, method, num_virtual_tokens, layer / head / width
        count or tensor shape other than the model's, files missing, or a
        `reparameterize=True` model.

    Example:
      >>> import os, tempfile
      >>> import keras_hub
      >>> from tf_metaalign import prompts
      >>> backbone = keras_hub.models.LlamaBackbone(
      ...     vocabulary_size=32, num_layers=1, num_query_heads=4, num_key_value_heads=2,
      ...     hidden_dim=8, intermediate_dim=16)
      >>> tuned = prompts.prompt_causal_lm(backbone, length=2, mode="deep", seed=0)
      >>> directory = prompts.save_peft_adapter(tuned, os.path.join(tempfile.mkdtemp(), "a"))
      >>> sorted(os.listdir(directory))
      ['adapter_config.json', 'adapter_model.safetensors']
      >>> fresh = prompts.prompt_causal_lm(backbone, length=2, mode="deep", seed=1)
      >>> prompts.load_peft_adapter(fresh, directory)
      >>> bool(np.array_equal(fresh.prompt_variables[0], tuned.prompt_variables[0]))
      True
      >>> prompts.load_peft_adapter(prompts.prompt_causal_lm(backbone, length=3, mode="deep"),
      ...                           directory)
      Traceback (most recent call last):
      ...
      ValueError: The adapter in '...' has num_virtual_tokens=2 but the model has length=3: ...

    References:
      Hugging Face PEFT 0.21 (`PromptEmbedding`, `PrefixEncoder`, `PeftModel.get_prompt`,
      `utils/save_and_load.py`); Lester et al. 2021; Li & Liang 2021.
    """
    from safetensors import safe_open

    task_type, mode, dims = _expected(model)
    scale = _gemma_scale(model, gemma_legacy_scaling)
    directory = os.fspath(path)
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(
            f"`path` {directory!r} is not a PEFT adapter directory: it has no {CONFIG_NAME}."
        )
    if not os.path.isfile(weights_path):
        extra = ""
        if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
            extra = (
                " It has adapter_model.bin (a torch pickle, not read here): save the adapter "
                "with PEFT's save_pretrained(..., safe_serialization=True)."
            )
        raise ValueError(f"`path` {directory!r} has no {WEIGHTS_NAME}.{extra}")
    with open(config_path) as f:
        config = json.load(f)
    peft_type = config.get("peft_type")
    accepted = _SHALLOW_TYPES + _DEEP_TYPES if task_type == "CAUSAL_LM" else _SHALLOW_TYPES
    if peft_type not in accepted:
        raise ValueError(
            f"The adapter in {directory!r} has peft_type={peft_type!r}; a {type(model).__name__} "
            f"loads a prompt-learning adapter: one of {accepted}."
        )
    if config.get("task_type") not in (None, task_type):
        raise ValueError(
            f"The adapter in {directory!r} has task_type={config.get('task_type')!r}; a "
            f"{type(model).__name__} expects task_type={task_type!r}."
        )
    adapter_mode = "shallow" if peft_type in _SHALLOW_TYPES else "deep"
    if adapter_mode != mode:
        raise ValueError(
            f"The adapter in {directory!r} is {peft_type} (mode={adapter_mode!r}) but the model "
            f"has mode={mode!r}: build it with mode={adapter_mode!r}."
        )
    length = config.get("num_virtual_tokens")
    if length != model.length:
        raise ValueError(
            f"The adapter in {directory!r} has num_virtual_tokens={length!r} but the model has "
            f"length={model.length}: build the model with length={length}."
        )
    for key, value in dims.items():
        if key == "num_attention_heads" and mode == "shallow":
            continue  # unused by prompt tuning
        if config.get(key) not in (None, value):
            raise ValueError(
                f"The adapter in {directory!r} has {key}={config.get(key)!r} but the model's "
                f"backbone gives {key}={value} ({_describe(model)}): it was made for another "
                "model."
            )
    if getattr(model, "reparameterize", False):
        raise ValueError(
            "`model` was built with reparameterize=True: an adapter holds the prompt itself "
            "(the MLP's output), from which the MLP's input cannot be recovered; load it into "
            "a model built with reparameterize=False (or `fold_reparameterization()`)."
        )
    with safe_open(weights_path, framework="np") as f:
        names = list(f.keys())
        if _TENSOR not in names:
            raise ValueError(
                f"The adapter in {directory!r} has no {_TENSOR!r} tensor (it holds {names}): "
                "not a prompt-learning adapter."
            )
        metadata = f.metadata() or {}
        value = f.get_tensor(_TENSOR)
    saved_architecture = metadata.get(_ARCHITECTURE_KEY)
    architecture = getattr(model, "ARCHITECTURE", None)
    if saved_architecture is not None and saved_architecture != architecture:
        raise ValueError(
            f"The adapter in {directory!r} was saved from a {saved_architecture!r} model; the "
            f"model is {architecture!r}."
        )
    submodules = config.get("num_transformer_submodules") or 1
    width = _width(mode, dims)
    if value.ndim != 2 or value.shape[1] != width or value.shape[0] < model.length:
        raise ValueError(
            f"The adapter's {_TENSOR!r} in {directory!r} has shape {tuple(value.shape)}; the "
            f"model expects [{model.length * submodules}, {width}] (num_virtual_tokens * "
            "num_transformer_submodules, "
            + ("token_dim" if mode == "shallow" else "num_layers * 2 * token_dim")
            + ")."
        )
    value = value[: model.length]
    if scale is not None:
        value = value.astype("float32") * scale
    variable = model.prompt_variables[0]
    variable.assign(value.astype(variable.dtype))


def save_peft_adapter(model, path, base_model_name_or_path=None, gemma_legacy_scaling=False):
    """Write `model`'s prompt as a Hugging Face PEFT adapter directory that
    `peft.PeftModel.from_pretrained(hf_model, path)` loads: `adapter_config.json`
    (PROMPT_TUNING for a shallow prompt, PREFIX_TUNING for a deep prefix; CAUSAL_LM, or
    SEQ_2_SEQ_LM for a PromptedT5) and `adapter_model.safetensors` (`prompt_embeddings`,
    float32; the model's architecture in the file's metadata, which `load_peft_adapter`
    checks and PEFT ignores).

    Args:
      model: a `PromptedCausalLM` (a reparameterised one saves its MLP's output, as PEFT
        saves its prompt encoder's output) or a `PromptedT5(mode="shallow")`.
      path: the directory to write (created; existing adapter files are replaced).
      base_model_name_or_path: recorded in the config for PEFT (the HF model the keras-hub
        backbone was converted from), or None.
      gemma_legacy_scaling: write a shallow Gemma prompt for transformers < 5.4 (divided by
        sqrt(hidden_dim); see `load_peft_adapter`).

    Returns:
      The directory written.

    Example:
      >>> import json, os, tempfile
      >>> import keras_hub
      >>> from tf_metaalign import prompts
      >>> backbone = keras_hub.models.GPT2Backbone(
      ...     vocabulary_size=32, num_layers=2, num_heads=2, hidden_dim=8,
      ...     intermediate_dim=16, max_sequence_length=16)
      >>> model = prompts.prompt_causal_lm(backbone, length=3, mode="deep")
      >>> directory = prompts.save_peft_adapter(model, os.path.join(tempfile.mkdtemp(), "a"))
      >>> config = json.load(open(os.path.join(directory, "adapter_config.json")))
      >>> config["peft_type"], config["num_virtual_tokens"], config["token_dim"]
      ('PREFIX_TUNING', 3, 8)

    References:
      Hugging Face PEFT 0.21 (`PeftConfig.save_pretrained`, `utils/save_and_load.py`).
    """
    from safetensors.numpy import save_file

    task_type, mode, dims = _expected(model)
    scale = _gemma_scale(model, gemma_legacy_scaling)
    if getattr(model, "reparameterize", False):
        value = model.prompt_values()  # the MLP's output, as PEFT saves its encoder's
    else:  # the variable itself, not a compute-dtype copy (mixed precision stays exact)
        value = model.prompt_variables[0]
    value = np.asarray(ops.convert_to_numpy(ops.cast(value, "float32")))
    if scale is not None:
        value = value / scale
    config = {
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "modules_to_save": None,
        "num_transformer_submodules": 1,
        "num_virtual_tokens": model.length,
        "peft_type": "PROMPT_TUNING" if mode == "shallow" else "PREFIX_TUNING",
        "revision": None,
        "task_type": task_type,
        **dims,
    }
    if mode == "shallow":
        config.update(
            prompt_tuning_init="RANDOM",
            prompt_tuning_init_text=None,
            tokenizer_kwargs=None,
            tokenizer_name_or_path=None,
        )
    else:
        config.update(
            encoder_hidden_size=dims["token_dim"], init_weights=None, prefix_projection=False
        )
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(dict(sorted(config.items())), f, indent=2)
        f.write("\n")
    save_file(
        {_TENSOR: np.ascontiguousarray(value)},
        os.path.join(directory, WEIGHTS_NAME),
        metadata={"format": "pt", _ARCHITECTURE_KEY: str(getattr(model, "ARCHITECTURE", ""))},
    )
    return directory


def _describe(model):
    return f"{type(model).__name__}, architecture={getattr(model, 'ARCHITECTURE', None)!r}"
