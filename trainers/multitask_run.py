"""The multilingual multi-task program's runs (`python -m trainers.multitask`): the model
(the fine-tuned top of the pretrained encoder and a new head), one method's training from the
pretrained weights, and its measurements."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.multitask_config import Config
    from trainers.multitask_data import Data

from trainers import multitask_methods as MM
from trainers.multitask_config import ALIASES, PROGRAM_METHODS


def build_model(data: Data, seed: int, portable: bool = False):
    """(model, encoder weights): the fine-tuned part of the encoder at its pretrained
    values, masked mean pooling, dropout 0.1 and a new head initialised with `seed` (with
    `portable`, drawn by NumPy: the same head on either backend)."""
    import keras
    import keras_hub

    from trainers.experiments import text_encoder as TE

    num_classes = len(data.class_names)
    if not data.cached_layers:
        backbone = type(data.encoder).from_config(data.encoder.get_config())
        backbone.set_weights(data.encoder.get_weights())
        length = data.train[next(iter(data.train))][0]["token_ids"].shape[1]
        model = TE.build_text_classifier(
            num_classes, backbone=backbone, sequence_length=length, seed=seed
        )
        if portable:
            _portable_head(model.get_layer("head"), seed)
        return model, backbone.trainable_weights
    example = data.train[next(iter(data.train))][0]["hidden"]
    length, width = example.shape[1:]
    hidden = keras.Input((length, width), name="hidden")
    mask = keras.Input((length,), dtype="bool", name="padding_mask")
    x, encoder_weights = hidden, []
    for pretrained in data.encoder.transformer_layers[data.cached_layers :]:
        layer = keras_hub.layers.TransformerEncoder.from_config(pretrained.get_config())
        x = layer(x, padding_mask=mask)
        layer.set_weights(pretrained.get_weights())
        encoder_weights += layer.trainable_weights
    weights = keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1)
    pooled = keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(
        keras.ops.sum(weights, axis=1), 1.0
    )
    pooled = keras.layers.Dropout(0.1, seed=seed)(pooled)
    logits = keras.layers.Dense(
        num_classes,
        name="head",
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02, seed=seed),
    )(pooled)
    model = keras.Model({"hidden": hidden, "padding_mask": mask}, logits)
    if portable:
        _portable_head(model.get_layer("head"), seed)
    return model, encoder_weights


def _portable_head(head, seed: int) -> None:
    """`--portable`: the head's kernel drawn by NumPy from `seed` (truncated normal, stddev
    0.02, as its Keras initialiser, which draws other numbers on TensorFlow and JAX), its
    bias zero."""
    import keras
    import numpy as np

    rng = np.random.default_rng([int(seed), 20261128])
    shape = tuple(head.kernel.shape)
    kernel = rng.standard_normal(shape)
    while np.any(np.abs(kernel) > 2):  # truncated at two standard deviations
        redraw = np.abs(kernel) > 2
        kernel[redraw] = rng.standard_normal(int(redraw.sum()))
    head.kernel.assign((0.02 * kernel).astype(keras.backend.standardize_dtype(head.kernel.dtype)))
    head.bias.assign(np.zeros(head.bias.shape, keras.backend.standardize_dtype(head.bias.dtype)))


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def accuracy(model, split) -> dict:
    """Accuracy of `model` on each language of `split` (lang -> (x, y))."""
    import numpy as np

    out = {}
    for lang, (x, y) in split.items():
        # Eager calls: `predict` would retrace for every language's number of strings.
        logits = np.concatenate(
            [
                np.asarray(model({k: v[i : i + 256] for k, v in x.items()}, training=False))
                for i in range(0, len(y), 256)
            ]
        )
        out[lang] = float(np.mean(np.argmax(logits, -1) == y))
    return out


def run_method(method: str, data: Data, seed: int, config: Config, log=print) -> dict:
    """Train `method` from the pretrained weights (seed `seed`); its measured values."""
    import itertools

    import keras
    import numpy as np

    from tf_metaalign import optimizers as O
    from tf_metaalign.callbacks import MultiTaskDiagnostics
    from tf_metaalign.data.multitask import MultiTaskStream
    from tf_metaalign.trainers import (
        MultiTaskReptileTrainer,
        MultiTaskTrainer,
        SequentialReptileTrainer,
    )
    from trainers import common
    from trainers.multitask_data import probe_batches

    MM.check_methods((method,), PROGRAM_METHODS, ALIASES, flag="method")
    languages = list(data.train)
    num_tasks, b = len(languages), config.per_task_batch_size
    start = time.perf_counter()
    name = f"{method} seed {seed}"

    # On JAX the batches are the NumPy route's: the same batches as tf.data's on
    # TensorFlow (the stream's stateless draws, reproduced in NumPy), with no TensorFlow.
    as_numpy = keras.backend.backend() != "tensorflow"

    def fresh():
        keras.utils.set_random_seed(seed)
        model, encoder = build_model(data, seed, portable=config.portable)
        return model, encoder, [keras.ops.convert_to_numpy(w) for w in encoder]

    def distance(encoder, pretrained):
        return float(
            np.sqrt(
                sum(
                    np.sum((keras.ops.convert_to_numpy(w) - p) ** 2)
                    for w, p in zip(encoder, pretrained)
                )
            )
        )

    def take(batches, n, fn=None):
        """The first `n` batches (mapped by `fn`) of a tf.data.Dataset or a generator."""
        if as_numpy:
            batches = (fn(x, y) for x, y in batches) if fn else batches
            return (batch for batch in itertools.islice(batches, n))  # fit takes generators
        return (batches.map(fn) if fn else batches).take(n)

    if method == "single_task":
        scores, distances = {}, []
        for index, lang in enumerate(languages):
            model, encoder, pretrained = fresh()
            model.compile(optimizer=O.Adam(config.learning_rate), loss=_loss())
            stream = MultiTaskStream(
                {lang: data.train[lang]}, batch_size=b, seed=seed * 1000 + index
            )
            batches = take(
                stream.single_task_batches(as_numpy=as_numpy),
                config.steps,
                lambda x, y: (x["inputs"], y),
            )
            model.fit(batches, verbose=0, shuffle=False, steps_per_epoch=config.steps)
            scores[lang] = accuracy(model, {lang: data.test[lang]})[lang]
            distances.append(distance(encoder, pretrained))
            log(f"{name}: {lang} ({index + 1}/{num_tasks}) held-out accuracy {scores[lang]:.3f}")
        return {
            "method": method,
            "seed": seed,
            "task_accuracy": scores,
            "average_accuracy": float(np.mean(list(scores.values()))),
            "zero_shot_accuracy": {},
            "zero_shot_average": None,
            "task_cosine": None,
            "distance_from_pretrained": float(np.mean(distances)),
            "seconds": time.perf_counter() - start,
        }

    model, encoder, pretrained = fresh()
    stream = MultiTaskStream(data.train, batch_size=num_tasks * b, q=config.q, seed=seed)
    method_config = None
    if method == "recadam" or MM.registry_name(method, ALIASES):
        # Every registry method with its options; RecAdam is "sum" with another optimizer.
        mtl_method = (
            MM.build("mtl", {}, ALIASES)
            if method == "recadam"
            else MM.build(method, config.method_options, ALIASES)
        )
        method_config = {"name": mtl_method.name, "config": mtl_method.get_config()}
        # One shared head: no task-specific variables (see the module doc).
        trainer = MultiTaskTrainer(
            model, num_tasks=num_tasks, method=mtl_method, seed=seed, measure_task_cosine=True
        )
        optimizer = (
            O.RecAdam(
                config.learning_rate,
                anneal_k=config.recadam_k,
                anneal_t0=config.steps // 4,
                pretrain_cof=config.recadam_pretrain_cof,
                exclude_from_recall=["head"],
            )
            if method == "recadam"
            else O.Adam(config.learning_rate)
        )
        batches = take(stream.mixed_batches(per_task_batch_size=b, as_numpy=as_numpy), config.steps)
        steps = config.steps
    elif method == "reptile":
        k, tasks = config.reptile_inner_steps, config.reptile_tasks
        trainer = MultiTaskReptileTrainer(
            model, inner_steps=k, inner_optimizer=O.Adam(config.learning_rate)
        )
        optimizer = O.SGD(config.outer_learning_rate)

        def stack(x, y):  # task-major [tasks * k * b] -> [tasks, k, b, ...]
            def fold(t):
                return keras.ops.reshape(t, [tasks, k, b] + list(t.shape[1:]))

            def fold_numpy(t):
                return np.reshape(t, (tasks, k, b) + tuple(t.shape[1:]))

            fold = fold_numpy if as_numpy else fold
            return keras.tree.map_structure(fold, x), fold(y)

        # The inner loops are unrolled when traced (tasks x k steps): tracing time grows
        # with their product, hence a subset of tasks per outer step.
        steps = config.steps * num_tasks // (tasks * k)
        batches = take(
            stream.mixed_batches(
                tasks_per_batch=tasks, per_task_batch_size=k * b, as_numpy=as_numpy
            ),
            steps,
            stack,
        )
    else:  # sequential_reptile
        trainer = SequentialReptileTrainer(
            model, inner_steps=config.inner_steps, outer_learning_rate=config.outer_learning_rate
        )
        optimizer = O.Adam(config.learning_rate)
        batches = take(stream.single_task_batches(as_numpy=as_numpy), config.steps)
        steps = config.steps
    trainer.compile(optimizer=optimizer, loss=_loss())
    progress = common.ProgressCallback(
        log, name, steps, max(1, config.log_every * steps // config.steps)
    )
    trainer.fit(batches, verbose=0, shuffle=False, steps_per_epoch=steps, callbacks=[progress])
    diagnostics = MultiTaskDiagnostics(probe_batches(data, config))
    diagnostics.set_model(trainer)
    cosine = diagnostics.measure()["task_gradient_cosine"]
    scores = accuracy(model, data.test)
    zero_shot = accuracy(model, data.zero_shot)
    return {
        "method": method,
        "seed": seed,
        "task_accuracy": scores,
        "average_accuracy": float(np.mean(list(scores.values()))),
        "zero_shot_accuracy": zero_shot,
        "zero_shot_average": float(np.mean(list(zero_shot.values()))) if zero_shot else None,
        "task_cosine": cosine,
        "distance_from_pretrained": distance(encoder, pretrained),
        "method_config": method_config,
        "seconds": time.perf_counter() - start,
    }
