"""The prompt variables of a prompted model: their initial values, which weights train,
and saving / loading the prompt on its own.

Shared by `prompts.t5` and `prompts.bert`. A prompted model (`PromptedT5`,
`PromptedBert`) exposes `prompt_variables` (a list of `keras.Variable`),
`prompt_metadata()` (what a prompt file must match) and `set_train(train)`.

Reference: Wu et al., "Continued Pretraining for Better Zero- and Few-Shot
Promptability" (EMNLP 2022), code allenai/better-promptability:
`modules/with_prefix_embedding.py` initialises a shallow prompt from
`np.random.permutation(range(5000))[:n_prefix]` rows of the vocabulary embedding
(following Lester et al. 2021), and `models/prefix_transformer.py` saves only the
prompt weights when the transformer is frozen (`on_save_checkpoint`).
"""

from __future__ import annotations

import json
import os

import numpy as np

TRAIN_CHOICES = ("prompt", "transformer", "both")
_METADATA_KEY = "__prompt_metadata__"


def check_length(length) -> int:
    """`length` as an int >= 0, or a ValueError naming it."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(
            f"`length` must be an integer >= 0 (the number of prompt vectors); "
            f"received length={length!r}."
        )
    return int(length)


def check_train(train) -> str:
    if train not in TRAIN_CHOICES:
        raise ValueError(
            f"`train` must be one of {TRAIN_CHOICES} (which weights train: the "
            f"prompt only, the transformer only, or both); received train={train!r}."
        )
    return train


def vocabulary_row_ids(
    vocabulary_size: int, length: int, init_vocabulary_rows: int, seed: int
) -> np.ndarray:
    """`length` token ids drawn without replacement among the first `init_vocabulary_rows`
    of a vocabulary of `vocabulary_size` tokens (Lester et al. 2021; the reference's
    `np.random.permutation(range(5000))[:n_prefix]`), seeded.

    When fewer ids are available than `length` (tiny vocabularies), they are drawn with
    replacement.
    """
    if (
        isinstance(init_vocabulary_rows, bool)
        or not isinstance(init_vocabulary_rows, (int, np.integer))
        or init_vocabulary_rows < 1
    ):
        raise ValueError(
            f"`init_vocabulary_rows` must be an integer >= 1; received "
            f"init_vocabulary_rows={init_vocabulary_rows!r}."
        )
    available = min(int(init_vocabulary_rows), int(vocabulary_size))
    rng = np.random.default_rng(seed)
    if length <= available:
        return rng.permutation(available)[:length]
    return rng.integers(0, available, size=length)


def vocabulary_rows_init(
    embeddings, length: int, init_vocabulary_rows: int, seed: int
) -> np.ndarray:
    """Initial shallow prompt: the rows of the embedding matrix `embeddings` whose ids
    `vocabulary_row_ids` draws. The result is a NumPy copy used as the variable's initial
    value only.
    """
    table = np.asarray(embeddings)
    return table[vocabulary_row_ids(table.shape[0], length, init_vocabulary_rows, seed)]


def apply_train(train: str, prompt_variables, trainable: bool = True) -> None:
    """Set the prompt variables' own `trainable` flag: True when `train` ("prompt",
    "transformer" or "both") trains the prompt and the prompted model is `trainable`.

    The backbone is not touched: it is shared with the caller's models, and the prompted
    model leaves it out of its trainable set itself when `train="prompt"`
    (`base.TrainableSelection`).
    """
    check_train(train)
    for variable in prompt_variables:
        variable.trainable = bool(trainable) and train in ("prompt", "both")


def save_prompt(model, path) -> str:
    """Write ONLY the prompt variables of `model` (a `PromptedT5` / `PromptedBert`) to
    `path` (`.npz`, NumPy's own format; a missing suffix is added). Returns the path.

    The file holds one array per prompt variable (by its name) and the metadata
    `model.prompt_metadata()` (architecture, mode, length, shapes) that `load_prompt`
    checks, so that a prompt is never silently loaded into a model it was not made for.

    Args:
      model: a prompted model (`PromptedT5`, `PromptedBert`, `PromptedCausalLM`).
      path: the file to write (a str or path-like).

    Returns:
      The path written, ending in `.npz`.

    Example:
      >>> import os, tempfile
      >>> import keras_hub
      >>> from tf_metaalign import prompts
      >>> backbone = keras_hub.models.BertBackbone(
      ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
      ...     intermediate_dim=16, max_sequence_length=8)
      >>> model = prompts.prompt_bert(backbone, length=2)
      >>> path = prompts.save_prompt(model, os.path.join(tempfile.mkdtemp(), "prompt"))
      >>> os.path.basename(path)
      'prompt.npz'
      >>> with np.load(path) as saved:  # the prompt only, and what it was made for
      ...     sorted(saved), np.array_equal(saved["prompt_embeddings"], model.prompt_embeddings)
      (['__prompt_metadata__', 'prompt_embeddings'], True)
      >>> model.prompt_metadata()
      {'architecture': 'bert', 'mode': 'shallow', 'length': 2,
       'shapes': {'prompt_embeddings': [2, 8]}}

    References:
      Wu et al., EMNLP 2022: the reference saves only the prompt weights when the
      transformer is frozen (`PrefixTransformer.on_save_checkpoint`,
      allenai/better-promptability).
    """
    _check_prompted(model)
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    arrays = {v.name: np.asarray(v.numpy()) for v in model.prompt_variables}
    arrays[_METADATA_KEY] = np.asarray(json.dumps(model.prompt_metadata()))
    np.savez(path, **arrays)
    return path


def load_prompt(model, path) -> None:
    """Assign the prompt saved by `save_prompt` at `path` to `model`'s prompt variables.

    Raises a ValueError when the file was made for another architecture, mode or length,
    or holds arrays of other shapes (the backbone's hidden size, layers or heads differ).
    A `PromptedCausalLM` also reads the file's `prompt_format_version`: an older Gemma prompt
    is converted to the current conventions (with a warning), a newer one refused
    (`tf_metaalign.prompts.causal_lm`'s docstring).

    Args:
      model: a prompted model (`PromptedT5`, `PromptedBert`, `PromptedCausalLM`).
      path: a file written by `save_prompt`.

    Returns:
      None; `model.prompt_variables` hold the saved values.

    Example:
      >>> import os, tempfile
      >>> import keras_hub
      >>> from tf_metaalign import prompts
      >>> backbone = keras_hub.models.BertBackbone(
      ...     vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
      ...     intermediate_dim=16, max_sequence_length=8)
      >>> tuned = prompts.prompt_bert(backbone, length=2, seed=0)
      >>> path = prompts.save_prompt(tuned, os.path.join(tempfile.mkdtemp(), "prompt.npz"))
      >>> fresh = prompts.prompt_bert(backbone, length=2, seed=1)
      >>> prompts.load_prompt(fresh, path)
      >>> bool(np.array_equal(fresh.prompt_embeddings, tuned.prompt_embeddings))
      True
      >>> prompts.load_prompt(prompts.prompt_bert(backbone, length=3), path)
      Traceback (most recent call last):
      ...
      ValueError: The prompt in '...prompt.npz' has length=2 but the model expects length=3.

    References:
      Wu et al., EMNLP 2022 (allenai/better-promptability: prompt-only checkpoints).
    """
    _check_prompted(model)
    with np.load(os.fspath(path), allow_pickle=False) as data:
        if _METADATA_KEY not in data:
            raise ValueError(
                f"`path` {path!r} is not a prompt file written by save_prompt "
                f"(no {_METADATA_KEY!r} entry)."
            )
        saved = json.loads(str(data[_METADATA_KEY]))
        expected = model.prompt_metadata()
        for key in ("architecture", "mode", "length"):
            if saved.get(key) != expected[key]:
                raise ValueError(
                    f"The prompt in {path!r} has {key}={saved.get(key)!r} but the "
                    f"model expects {key}={expected[key]!r}."
                )
        values = []
        for variable in model.prompt_variables:
            if variable.name not in data:
                raise ValueError(
                    f"The prompt in {path!r} has no array {variable.name!r}; it "
                    f"holds {sorted(k for k in data if k != _METADATA_KEY)}."
                )
            value = data[variable.name]
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"The prompt array {variable.name!r} in {path!r} has shape "
                    f"{tuple(value.shape)} but the model's variable has shape "
                    f"{tuple(variable.shape)}."
                )
            values.append(value)
    upgrade = getattr(model, "_upgrade_saved_prompt", None)  # older formats (causal_lm)
    if upgrade is not None:
        values = upgrade(values, saved, f"The prompt file {os.fspath(path)!r}")
    for variable, value in zip(model.prompt_variables, values):
        variable.assign(value.astype(variable.dtype))


def _check_prompted(model):
    if not (hasattr(model, "prompt_variables") and hasattr(model, "prompt_metadata")):
        raise ValueError(
            f"`model` must be a prompted model (PromptedT5 or PromptedBert); "
            f"received {type(model).__name__}."
        )
