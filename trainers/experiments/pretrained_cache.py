"""The cache of small pre-trained models (`trainers.experiments.small_t5`, `.small_gpt2`):
a backbone's weights and its record, keyed by a hash of every setting it depends on.

  settings_hash                               a short SHA-256 of JSON-able settings
  file_hash                                   SHA-256 of a file (a SentencePiece model's)
  load_cached_backbone / save_cached_backbone a backbone's weights and record in the cache
  history_lists                               a Keras `History` as JSON-able lists
  fit                                         `model.fit`, past keras-hub's data pipeline
                                              where there is nothing to preprocess
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def settings_hash(settings) -> str:
    """A short SHA-256 of JSON-able settings (key order ignored): a cache key of a
    pre-trained model (small_t5, small_gpt2)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def file_hash(path) -> str:
    """SHA-256 of a file's bytes (a SentencePiece model's, for cache keys)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_cached_backbone(model, cache_dir, name: str) -> dict | None:
    """The pre-trained backbone cached as `name` (`<model>-<settings_hash>`) loaded into
    `model.backbone`: its info (`cached` True), or None on a miss (nothing loaded)."""
    weights, meta = Path(cache_dir) / f"{name}.weights.h5", Path(cache_dir) / f"{name}.json"
    if not (weights.is_file() and meta.is_file()):
        return None
    model.backbone.load_weights(str(weights))
    info = json.loads(meta.read_text())
    info["cached"] = True
    return info


def save_cached_backbone(model, cache_dir, name: str, info: dict) -> dict:
    """Cache `model.backbone`'s weights and `info` as `name` (what `load_cached_backbone`
    reads); returns `info` with `cached` False. The weights are written to a temporary
    file and renamed, so a concurrent reader never sees half a file."""
    weights, meta = Path(cache_dir) / f"{name}.weights.h5", Path(cache_dir) / f"{name}.json"
    tmp = weights.with_name(f"tmp{os.getpid()}-" + weights.name)
    # The backbone holds every weight (the LM head is its tied ReversibleEmbedding); saving
    # the task model would also save the optimizer, which a loaded model's fresh one cannot
    # take.
    model.backbone.save_weights(str(tmp))
    os.replace(tmp, weights)
    meta.write_text(json.dumps(info, indent=1, default=float))
    info["cached"] = False
    return info


def history_lists(history) -> dict:
    """A Keras `History`'s curves as JSON-able lists."""
    return {
        k: (v if isinstance(v, (list, float, int)) else list(v)) for k, v in history.history.items()
    }


def fit(model, *args, **kwargs):
    """`model.fit(*args, **kwargs)` for a keras-hub task: without a preprocessor and off
    TensorFlow, Keras's own `fit` (keras-hub's `PipelineModel.fit` would batch the data
    with tf.data or grain to map a preprocessor over it, an ImportError without either,
    though there is nothing to map; Keras's data adapters take the arrays and generators)."""
    import keras

    if getattr(model, "preprocessor", None) is None and keras.backend.backend() != "tensorflow":
        return keras.Model.fit(model, *args, **kwargs)
    return model.fit(*args, **kwargs)
