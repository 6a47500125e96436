"""The multilingual multi-task program's data (`python -m trainers.multitask`): Django's
catalogs per language, tokenized, with the frozen encoder layers run once; the fixed probe
batches of the gradient cosine."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.multitask_config import Config


@dataclasses.dataclass
class Data:
    """Model inputs per language and split: `train[lang] = (x, y)`, x a dict of arrays."""

    class_names: tuple
    train: dict
    test: dict
    zero_shot: dict
    encoder: object  # the pretrained backbone
    cached_layers: int  # frozen transformer layers whose outputs x holds (0: token ids)


def prepare_data(config: Config, log=print) -> Data:
    """Load the catalogs, tokenize, and (trainable_layers < 6) run the frozen layers once."""
    import keras
    import numpy as np

    from trainers.experiments import django_catalogs as D
    from trainers.experiments import text_encoder as TE

    languages = tuple(config.train_languages) + tuple(config.zero_shot_languages)
    log(f"loading Django catalogs for {len(languages)} languages")
    tasks = D.component_tasks(languages, test_fraction=config.test_fraction, seed=config.split_seed)
    log("loading the MiniLM encoder and tokenizer")
    tokenizer, backbone = TE.load_minilm_tokenizer(), TE.load_minilm_backbone()
    num_layers = len(backbone.transformer_layers)
    if config.trainable_layers > num_layers:
        raise ValueError(
            f"`trainable_layers`={config.trainable_layers}: the encoder has {num_layers} layers."
        )
    cached = num_layers - config.trainable_layers
    if cached:
        cut = backbone.get_layer(f"transformer_layer_{cached - 1}").output
        frozen = keras.Model(backbone.inputs, cut)

    def inputs(texts):
        tokens = TE.tokenize(texts, tokenizer, sequence_length=config.sequence_length)
        if not cached:
            return tokens
        hidden = frozen.predict(tokens, batch_size=128, verbose=0)
        return {"hidden": hidden.astype(np.float32), "padding_mask": tokens["padding_mask"]}

    start = time.perf_counter()
    train, test, zero_shot = {}, {}, {}
    for lang in config.train_languages:
        train[lang] = (inputs(tasks.train[lang][0]), tasks.train[lang][1])
        test[lang] = (inputs(tasks.test[lang][0]), tasks.test[lang][1])
    for lang in config.zero_shot_languages:
        zero_shot[lang] = (inputs(tasks.test[lang][0]), tasks.test[lang][1])
    sizes = ", ".join(f"{lang} {len(y)}" for lang, (_, y) in train.items())
    log(
        f"{'encoded' if cached else 'tokenized'} {sum(len(y) for _, y in train.values())} "
        f"training strings ({sizes}) in {time.perf_counter() - start:.0f} s"
        + (f" (the frozen {cached} layers run once)" if cached else "")
    )
    return Data(tasks.class_names, train, test, zero_shot, backbone, cached)


def probe_batches(data: Data, config: Config):
    """A fixed batch of `probe_examples` training strings per language (the first ones of
    a fixed permutation), for the gradient cosine."""
    import numpy as np

    batches = {}
    for lang, (x, y) in data.train.items():
        rows = np.random.default_rng(1234).permutation(len(y))[: config.probe_examples]
        batches[lang] = ({k: v[rows] for k, v in x.items()}, y[rows])
    return batches
