"""The prompt tests' tiny random keras-hub backbones, built from configs (no download).

`tiny_backbone(family)` is the one builder of the tiny T5 / BERT / GPT-2 / Gemma / Llama
backbones of tests/prompts/test_prompts_backends.py (golden files on both backends),
test_prompts_causal_lm.py and prompts/legacy_fixtures/make_legacy_fixtures.py (which
recorded an older tf_metaalign's outputs on the decoder ones: their configs must not
change); keyword arguments override the config (the one-layer GPT-2s of
tests/causal_lm_entries.py and prompts/test_prompt_meta_backends.py). It imports no
TensorFlow (the backend-neutral tests use it) and no tf_metaalign (the legacy fixtures'
script runs it under an old tf_metaalign).
"""

#: the tiny backbones' vocabulary
VOCABULARY = 32

#: per family: (the keras-hub backbone class name, its tiny config)
TINY_CONFIGS = {
    "t5": (
        "T5Backbone",
        dict(
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            key_value_dim=4,
            dropout=0.0,
        ),
    ),
    "bert": (
        "BertBackbone",
        dict(
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=16,
            dropout=0.0,
        ),
    ),
    "gpt2": (
        "GPT2Backbone",
        dict(
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=16,
            dropout=0.0,
        ),
    ),
    "gemma": (
        "GemmaBackbone",
        dict(
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=8,
            intermediate_dim=16,
            head_dim=4,
        ),
    ),
    # grouped-query attention: 4 query heads share 2 key/value heads
    "llama": (
        "LlamaBackbone",
        dict(
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=16,
            dropout=0.0,
        ),
    ),
}


def tiny_backbone(family, vocabulary_size=VOCABULARY, **overrides):
    """The tiny keras-hub backbone of `family` ("t5", "bert", "gpt2", "gemma" or "llama")
    with `overrides` applied to its config, its weights drawn from the global seed."""
    import keras_hub

    if family not in TINY_CONFIGS:
        raise ValueError(f"family must be one of {sorted(TINY_CONFIGS)}; got {family!r}.")
    class_name, config = TINY_CONFIGS[family]
    backbone_class = getattr(keras_hub.models, class_name)
    return backbone_class(**{**config, "vocabulary_size": vocabulary_size, **overrides})
