"""Every ```python example of README.md runs, as written, and does what it says.

An example uses names that stand for the reader's own objects (`model`, `x`, `y`,
`dataset`, ...); `EXAMPLES` gives each one those objects (small), the sizes shrunk for a
test (`scale`: each `(old, new)` text replacement must match exactly once, so an edit of
the README that changes a size fails here until the test follows), and a check of what
the example promises (the number of optimizer steps `fit` took, the model that reloads
as itself, the backbone left bit-identical). A README block that no entry claims, or an
entry whose block is gone, fails `test_every_readme_example_is_run`.

* The MAML example reads Omniglot from `$TF_METAALIGN_OMNIGLOT_DIR`; the test points it
  at `../shared/data/omniglot` beside the checkout (as tests/data/test_omniglot.py) unless
  it is set already, and skips, with the reason, where the zips are absent.
* The soft-prompt example loads keras-hub presets, which need a download: the test
  replaces the two `from_preset` calls with tiny models built from a config (a byte-level
  GPT-2 tokenizer, so text goes through the same preprocessor path), and is `slow`
  (46 s on 2 loaded cores: keras-hub's XLA compilations).

Default examples: 37 s on 2 cores at load 11 (the MAML one 22 s; Omniglot's first decode
adds ~15 s, cached afterwards in the loader's cache).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OMNIGLOT = ROOT.parent / "shared" / "data" / "omniglot"  # as tests/data/test_omniglot.py
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks():
    return BLOCK.findall(README.read_text())


# ----------------------------------------------------------------- the reader's objects


def _classifier(inputs=8, classes=4, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(classes, activation="softmax"),
        ]
    )


def _classification(n, inputs=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    return x, rng.integers(0, classes, n).astype("int32")


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _model_setup(n=128, batch=None):
    model = _classifier()
    x, y = _classification(n)
    names = {"model": model, "x": x, "y": y, "initial_weights": _weights(model)}
    if batch:
        names["dataset"] = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    return names


def _multitask_setup():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 16)).astype("float32")
    task_id = rng.integers(0, 3, 96).astype("int32")
    y = rng.integers(0, 4, 96).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices(({"inputs": x, "task_id": task_id}, y))
    return {"dataset": dataset.batch(48)}


def _reptile_setup():
    names = _model_setup()
    for lang, seed in (("en", 1), ("de", 2)):
        names[f"x_{lang}"], names[f"y_{lang}"] = _classification(64, seed=seed)
    return names


def _guided_setup():
    names = _model_setup(n=96)
    names["train_ds"] = tf.data.Dataset.from_tensor_slices((names["x"], names["y"])).batch(32)
    return names


def _byte_level_gpt2_causal_lm():
    """A 1-layer GPT-2 with a byte-level BPE tokenizer of 256 byte symbols (any text
    tokenizes) and its preprocessor: what `GPT2CausalLM.from_preset` gives, tiny."""
    import keras_hub

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols = [chr(b) for b in printable]
    symbols += [chr(256 + i) for i in range(256 - len(printable))]  # GPT-2's byte map
    vocabulary = {"<|endoftext|>": 0, **{s: i + 1 for i, s in enumerate(symbols)}}
    vocabulary["\u0120t"] = len(vocabulary)  # one merge (" t"): the tokenizer wants one
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["\u0120 t"])
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary),
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=64,
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=24)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def _tiny_t5():
    import keras_hub

    keras.utils.set_random_seed(0)
    return keras_hub.models.T5Backbone(
        vocabulary_size=64,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        key_value_dim=4,
    )


def _prompt_setup():
    lm = _byte_level_gpt2_causal_lm()
    return {
        "tiny_t5": _tiny_t5,
        "tiny_gpt2_causal_lm": lambda: lm,
        "backbone_weights": _weights(lm.backbone),
        "train_texts": ["a fine film", "a dull film", "great acting", "weak plot"],
    }


# ------------------------------------------------------------------------- the checks


def _steps(names, expected):
    assert int(names["trainer"].optimizer.iterations.numpy()) == expected


def _moved(names):
    after = _weights(names["model"])
    assert any(not np.array_equal(a, b) for a, b in zip(after, names["initial_weights"]))
    assert all(np.isfinite(a).all() for a in after)


def _check_dotprod(names):
    _steps(names, 8 * 2)  # 8 epochs of 128 / 64 batches
    _moved(names)
    loaded = keras.saving.load_model("model.keras")
    assert type(loaded) is type(names["model"])
    for a, b in zip(_weights(loaded), _weights(names["model"])):
        np.testing.assert_array_equal(a, b)


def _check_sam(names):
    _steps(names, 3 * 4)  # 3 epochs of 128 / 32 batches
    _moved(names)


def _check_multitask(names):
    _steps(names, 3 * 2)
    trainer, model = names["trainer"], names["model"]
    assert trainer.model is model and trainer.num_tasks == 3


def _check_sequential_reptile(names):
    _steps(names, 3 * 8)  # inner steps: 3 epochs of 8 batches, 6 trajectories of 4
    _moved(names)
    for v, s in zip(names["model"].trainable_variables, names["trainer"].slow_weights):
        np.testing.assert_array_equal(v.numpy(), s.numpy())  # the model holds phi


def _check_maml(names):
    _steps(names, 2)
    assert len(names["split"].train) > 100  # the Omniglot characters, not a stand-in


def _check_prompts(names):
    _steps({"trainer": names["prompted"]}, 3)  # 3 epochs of one batch of 4 texts
    for a, b in zip(_weights(names["lm"].backbone), names["backbone_weights"]):
        np.testing.assert_array_equal(a, b)  # only the prefix trains
    assert names["t5"].backbone is not None


def _check_optimizers(names):
    del names  # constructors only: what they build is tested in tests/optimizers


def _check_guided(names):
    _steps(names, 2)  # 3 batches of 32, the first held out as guidance
    _moved(names)


# ----------------------------------------------------------------------- the examples


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    marker: str  # a line of the block (identifies it)
    check: Callable[[dict], None]
    setup: Callable[[], dict] = dict
    scale: tuple[tuple[str, str], ...] = ()
    needs_omniglot: bool = False
    slow: bool = False


EXAMPLES = (
    Example(
        "dotprod",
        "trainer = DotProdTrainer(model, weight=0.1)",
        _check_dotprod,
        _model_setup,
    ),
    Example(
        "sam", "trainer = SAMTrainer(model, rho=0.05)", _check_sam, lambda: _model_setup(batch=32)
    ),
    Example(
        "multitask",
        "trainer = MultiTaskTrainer(model, num_tasks=3",
        _check_multitask,
        _multitask_setup,
    ),
    Example(
        "sequential_reptile",
        "trainer = SequentialReptileTrainer(model",
        _check_sequential_reptile,
        _reptile_setup,
        scale=(
            ("inner_steps=1000", "inner_steps=4"),
            ("steps_per_epoch=1000", "steps_per_epoch=8"),
        ),
    ),
    Example(
        "maml",
        "trainer = MAMLTrainer(conv4(ways=5)",
        _check_maml,
        scale=(
            ("filters=64", "filters=4"),
            ("queries=15", "queries=2"),
            ("tasks_per_batch=8", "tasks_per_batch=2"),
            ("inner_steps=5", "inner_steps=1"),
            ("steps_per_epoch=100, epochs=10", "steps_per_epoch=2, epochs=1"),
        ),
        needs_omniglot=True,
    ),
    Example(
        "prompts",
        "t5 = prompts.prompt_t5(",
        _check_prompts,
        _prompt_setup,
        scale=(
            ('keras_hub.models.T5Backbone.from_preset("t5_small_multi")', "tiny_t5()"),
            ('keras_hub.models.GPT2CausalLM.from_preset("gpt2_base_en")', "tiny_gpt2_causal_lm()"),
            ("max_length=30", "max_length=12"),
        ),
        slow=True,
    ),
    Example("optimizers", "O.Adafactor.t5(learning_rate=1e-3)", _check_optimizers),
    Example("guided", "trainer = GuidedTrainer(model, guidance)", _check_guided, _guided_setup),
)


def _block_of(example, blocks):
    found = [b for b in blocks if example.marker in b]
    assert len(found) == 1, f"{example.name}: {len(found)} README blocks hold {example.marker!r}"
    return found[0]


def test_every_readme_example_is_run():
    blocks = readme_blocks()
    claimed = [_block_of(e, blocks) for e in EXAMPLES]
    unclaimed = [b for b in blocks if b not in claimed]
    assert not unclaimed, f"README examples no test runs (add them to EXAMPLES): {unclaimed}"
    assert len(set(claimed)) == len(EXAMPLES)


@pytest.mark.parametrize(
    "example",
    [pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.slow else []) for e in EXAMPLES],
)
def test_readme_example_runs(example, tmp_path, monkeypatch):
    if example.needs_omniglot:
        if not os.environ.get("TF_METAALIGN_OMNIGLOT_DIR"):
            monkeypatch.setenv("TF_METAALIGN_OMNIGLOT_DIR", str(OMNIGLOT))
        root = Path(os.environ["TF_METAALIGN_OMNIGLOT_DIR"])
        if not (root / "images_background_small1.zip").is_file():
            pytest.skip(f"Omniglot's zips are not in {root} (set $TF_METAALIGN_OMNIGLOT_DIR)")
    code = _block_of(example, readme_blocks())
    for old, new in example.scale:
        assert code.count(old) == 1, f"{example.name}: {old!r} is not once in the README block"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)  # files the example writes (model.keras)
    keras.utils.set_random_seed(0)
    names = {"__name__": f"readme_{example.name}", **example.setup()}
    exec(compile(code, f"README.md[{example.name}]", "exec"), names)
    example.check(names)
