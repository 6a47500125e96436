"""`trainers.finetune`'s data stage: the offline tasks and their models."""

from __future__ import annotations

DATASETS = ("wordnet", "digits")

LOADING = {
    "wordnet": "WordNet supersenses (glosses) and the MiniLM tokenizer; tokenizing",
    "digits": "scikit-learn digits",
}


def load_task(dataset: str, seed: int, config):
    """`(splits, build_model)`: data as numpy arrays and a function building a fresh model
    (with `config.portable`, its new layers drawn by `portable_initial_weights`).

    `config`: the program's `trainers.finetune.Config` (steps, batch_size, eval_examples,
    sequence_length, max_examples, parts_of_speech, hidden_units).
    """
    import keras

    from tf_metaalign.data import load_digits
    from trainers.experiments import text_encoder
    from trainers.experiments.wordnet import load_wordnet_supersenses

    f = config

    def _portable(model):
        if getattr(f, "portable", False):
            portable_initial_weights(model, seed)
        return model

    if dataset == "digits":
        splits = load_digits(seed=seed)

        def build_model():
            keras.utils.set_random_seed(seed)
            return _portable(
                keras.Sequential(
                    [
                        keras.Input((64,)),
                        keras.layers.Dense(f.hidden_units, activation="tanh"),
                        keras.layers.Dense(splits.num_classes),
                    ],
                    name="digits_mlp",
                )
            )

        return splits, build_model

    if dataset == "wordnet":
        text = load_wordnet_supersenses(
            f.parts_of_speech, seed=seed, max_examples=f.max_examples, relabel=True
        )
        tokenizer = text_encoder.load_minilm_tokenizer()
        # Tokenize only what the runs use: steps * batch_size training glosses (one pass).
        n_train = min(len(text.y_train), f.steps * f.batch_size)
        n_test = len(text.y_test) if not f.eval_examples else min(len(text.y_test), f.eval_examples)
        text.x_train = text_encoder.tokenize(text.x_train[:n_train], tokenizer, f.sequence_length)
        text.y_train = text.y_train[:n_train]
        text.x_test = text_encoder.tokenize(text.x_test[:n_test], tokenizer, f.sequence_length)
        text.y_test = text.y_test[:n_test]

        def build_model():
            keras.utils.set_random_seed(seed)
            return _portable(
                text_encoder.build_text_classifier(
                    text.num_classes, sequence_length=f.sequence_length, seed=seed
                )
            )

        return text, build_model

    raise ValueError(f"`--dataset` must be one of {DATASETS}; got {dataset!r}.")


def stacked_pairs(dataset, batch_size: int):
    """Each batch of `batch_size` as its two halves stacked `[2, batch_size // 2, ...]`: the
    (b1, b2) pair DotProd splits, as Reptile (k = 2 inner batches) and FOMAML (1 inner
    batch, 1 query batch) take it (`stack_axis=0`). `dataset`: a `tf.data.Dataset`, or an
    iterable of NumPy `(x, y)` batches (the NumPy route: a generator of the stacked pairs)."""
    import keras
    import numpy as np

    half = batch_size // 2

    if not hasattr(dataset, "map"):  # the NumPy route (JAX, --portable)

        def stack_numpy(t):
            t = np.asarray(t)[: 2 * half]
            return t.reshape((2, half) + t.shape[1:])

        return ((keras.tree.map_structure(stack_numpy, x), stack_numpy(y)) for x, y in dataset)
    import tensorflow as tf

    def stack(t):
        t = t[: 2 * half]
        return tf.reshape(t, tf.concat([[2, half], tf.shape(t)[1:]], 0))

    return dataset.map(lambda x, y: (tf.nest.map_structure(stack, x), stack(y)))


def fixed_batch(splits, examples: int):
    """The first `examples` training examples `(x, y)` (the sharpness and alignment
    measurements' data: the same for every run of a seed), as NumPy arrays."""
    import keras

    x = keras.tree.map_structure(lambda a: a[:examples], splits.x_train)
    return x, splits.y_train[:examples]


def portable_initial_weights(model, seed: int) -> None:
    """`--portable`: redraw the kernels of the model's own top-level Dense layers (the new
    layers: the digits MLP, the text classifier's head; a pretrained backbone is a nested
    model and keeps its weights) with NumPy, and zero their biases, so that both backends
    start from the same weights (Keras's initializers draw different numbers on TensorFlow
    and JAX). Glorot-uniform kernels, as `keras.layers.Dense`'s default."""
    import keras
    import numpy as np

    rng = np.random.default_rng([int(seed), 20261128])
    for layer in model.layers:
        if not isinstance(layer, keras.layers.Dense):
            continue
        fan_in, fan_out = layer.kernel.shape
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        kernel = rng.uniform(-limit, limit, size=(fan_in, fan_out))
        layer.kernel.assign(kernel.astype(keras.backend.standardize_dtype(layer.kernel.dtype)))
        if layer.bias is not None:
            layer.bias.assign(np.zeros(layer.bias.shape, layer.bias.dtype))


def static_tf_dataset(batches):
    """On TensorFlow, an endless generator of NumPy batches (the NumPy route, `--portable`)
    as a `tf.data.Dataset` whose elements have the first batch's static shapes: Keras's own
    generator adapter leaves the batch axis unknown, which a trainer that unrolls stacked
    batches (Reptile, FOMAML) refuses."""
    import itertools

    import keras
    import tensorflow as tf

    first = next(batches)
    signature = keras.tree.map_structure(
        lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), first
    )
    return tf.data.Dataset.from_generator(
        lambda: itertools.chain([first], batches), output_signature=signature
    )
