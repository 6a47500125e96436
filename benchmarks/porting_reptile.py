r"""keras-io's hand-written Reptile loop against its port onto `ReptileTrainer`
(docs/porting.md), on scikit-learn's digits (offline, small enough for 2 shared cores).

    python -m benchmarks.porting_reptile                  # ~2-4 min on 2 shared CPU cores
    python -m benchmarks.porting_reptile --meta_iters=300 --out=/tmp/porting.json
    KERAS_BACKEND=jax python -m benchmarks.porting_reptile \
        --out=benchmarks/results/porting_reptile_jax.json  # the same on JAX

Either backend (the JSON records which): on TensorFlow the hand-written loop is keras-io's,
line for line (a `tf.GradientTape` of the per-example loss vector); on JAX it is that loop as
a JAX user writes it: `jax.grad` (jitted) of the summed per-example loss through
`model.stateless_call`, the same gradient, and the same eager `SGD.apply_gradients`. The
port is fed a `tf.data.Dataset` on TensorFlow (as published) and a `keras.utils.PyDataset`
of the same elements on JAX.

The loop is keras-io's `examples/vision/reptile.py` at a smaller scale: per meta-iteration
one N-way task (`--train_shots` examples of each of N classes drawn from the training
digits 0..6), `shuffle().batch(B).repeat(4)` inner SGD steps on
`sparse_categorical_crossentropy(labels, model(images))` (a per-example vector: the
gradient of the SUM over the batch), then `phi + (theta - phi) * (1 - i/n) * eps`; the
model is keras-io's conv_bn blocks (Conv2D stride 2 -> BatchNormalization -> ReLU) +
Dense softmax, smaller. Three runs from the same initial weights on the same task stream:

* `hand`: the hand-written loop (eager, as published);
* `port`: `ReptileTrainer(inner_training=False, inner_optimizer=B * lr)`, outer
  `SGD(PolynomialDecay(eps, n, 0))`: what docs/porting.md prescribes;
* `straight`: `ReptileTrainer(inner_optimizer=lr)` with the defaults (batch statistics,
  the compiled loss's mean): the port that ignores both differences.

Reported: the largest weight difference port vs hand after training (float32), the
wall time per meta-iteration of hand vs port (after the first, traced, iteration), and
the few-shot accuracy of each run with keras-io's own evaluation (adapt a copy by
`--eval_iters` summed-loss SGD steps on an N-way `--shots`-shot support set of the held-out
digits 7..9, then `model.predict` one query per class; `--eval_tasks` tasks), before
and after adaptation.
"""

from __future__ import annotations

import argparse
import json
import time

import keras
import numpy as np
from keras import ops

from tf_metaalign.data import stack_task
from tf_metaalign.trainers import ReptileTrainer

BACKEND = keras.backend.backend()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--meta_iters", type=int, default=300)
    p.add_argument("--ways", type=int, default=3)
    p.add_argument("--train_shots", type=int, default=10)
    p.add_argument("--inner_batch_size", type=int, default=10)
    p.add_argument("--repetitions", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=0.003)
    p.add_argument("--meta_step_size", type=float, default=0.25)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--eval_iters", type=int, default=5)
    p.add_argument("--eval_tasks", type=int, default=200)
    p.add_argument("--filters", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args()


def model_fn(args):
    keras.utils.set_random_seed(args.seed)
    inputs = keras.Input((8, 8, 1))
    x = inputs
    for _ in range(2):
        x = keras.layers.Conv2D(args.filters, 3, strides=2, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    outputs = keras.layers.Dense(args.ways, activation="softmax")(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs)


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0)[..., None].astype("float32")
    return {c: x[d.target == c] for c in range(10)}


def task_sampler(classes, labels, ways, shots, seed, query=False):
    """Task i: `shots` examples of each of `ways` classes drawn from `labels` (episode
    labels 0..ways-1), and with `query` one more example per class."""

    def task(i):
        rng = np.random.default_rng([seed, i])
        xs, ys, qx = [], [], []
        for label, c in enumerate(rng.choice(labels, ways, replace=False)):
            rows = rng.choice(len(classes[c]), shots + int(query), replace=False)
            xs.append(classes[c][rows[:shots]])
            ys += [label] * shots
            qx.append(classes[c][rows[shots:]])
        x, y = np.concatenate(xs), np.asarray(ys, "int32")
        return (x, y, np.concatenate(qx), np.arange(ways)) if query else (x, y)

    return task


_JAX_GRADS = {}


def _jax_gradient(model):
    """JAX: the gradient keras-io's tape takes of the per-example loss vector (that of its
    sum) at the model's variables, through `model.stateless_call` (`model(images)`: no
    `training` argument, as keras-io calls it), jitted once per model."""
    if id(model) not in _JAX_GRADS:
        import jax

        def loss(trainable, non_trainable, images, labels):
            preds, _ = model.stateless_call(trainable, non_trainable, images)
            return ops.sum(keras.losses.sparse_categorical_crossentropy(labels, preds))

        _JAX_GRADS[id(model)] = jax.jit(jax.grad(loss))
    return _JAX_GRADS[id(model)]


def inner_sgd(model, batches, lr):
    """keras-io's inner loop: model(images), the per-example loss vector, SGD."""
    optimizer = keras.optimizers.SGD(lr)
    if BACKEND == "jax":
        gradient = _jax_gradient(model)
        for images, labels in batches:
            grads = gradient(
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                images,
                labels,
            )
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return
    import tensorflow as tf

    for images, labels in batches:
        with tf.GradientTape() as tape:
            preds = model(images)
            loss = keras.losses.sparse_categorical_crossentropy(labels, preds)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))


def keras_io_meta_step(model, batches, learning_rate, meta_step_size):
    """The meta step of keras-io's reptile.py, line for line: `inner_sgd` on `batches` from
    the current weights, then weights <- old + (new - old) * meta_step_size."""
    old = model.get_weights()
    inner_sgd(model, batches, learning_rate)
    new = model.get_weights()
    model.set_weights([o + (n - o) * meta_step_size for o, n in zip(old, new)])


def train_hand(args, train_elements):
    model = model_fn(args)
    times = []
    for i, (xs, ys) in enumerate(train_elements):
        start = time.perf_counter()
        step = (1 - i / args.meta_iters) * args.meta_step_size
        keras_io_meta_step(model, zip(xs, ys), args.learning_rate, step)
        times.append(time.perf_counter() - start)
    return model, times


class _Times(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def __init__(self):
        super().__init__()
        self.times = []


def train_trainer(args, data, k, inner_training, inner_lr):
    model = model_fn(args)
    trainer = ReptileTrainer(
        model, inner_steps=k, inner_optimizer=inner_lr, inner_training=inner_training
    )
    trainer.compile(
        optimizer=keras.optimizers.SGD(
            keras.optimizers.schedules.PolynomialDecay(
                args.meta_step_size, decay_steps=args.meta_iters, end_learning_rate=0.0
            )
        ),
        loss="sparse_categorical_crossentropy",
    )
    timer = _Times()
    history = trainer.fit(
        data,
        steps_per_epoch=args.meta_iters,
        epochs=1,
        verbose=0,
        callbacks=[timer],
        shuffle=False,  # a PyDataset (JAX) would be read in a shuffled order
    )
    return model, timer.times, float(history.history["loss"][-1])


def evaluate(args, model, test_task):
    """keras-io's evaluation: a copy adapted by summed-loss SGD on the support set (one
    batch, `eval_iters` times), `predict` on one query per class."""
    copy = keras.models.clone_model(model)
    scores = {"unadapted": [], "adapted": []}
    for i in range(args.eval_tasks):
        x, y, qx, qy = test_task(i)
        copy.set_weights(model.get_weights())
        scores["unadapted"].append(float(np.mean(np.argmax(copy.predict(qx, verbose=0), -1) == qy)))
        inner_sgd(copy, [(x, y)] * args.eval_iters, args.learning_rate)
        scores["adapted"].append(float(np.mean(np.argmax(copy.predict(qx, verbose=0), -1) == qy)))
    return {k: float(np.mean(v)) for k, v in scores.items()}


class _Elements(keras.utils.PyDataset):
    """The stacked elements, one per step (JAX: no tf.data)."""

    def __init__(self, xs, ys):
        super().__init__()
        self.xs, self.ys = xs, ys

    def __len__(self):
        return len(self.xs)

    def __getitem__(self, i):
        return self.xs[i], self.ys[i]


def main():
    args = parse()
    classes = digits()
    pool = args.ways * args.train_shots
    k = -(-pool // args.inner_batch_size) * args.repetitions  # batches per pass x passes
    train = task_sampler(classes, np.arange(7), args.ways, args.train_shots, args.seed)
    # stacked_batches(train, k, B, seed=seed)'s elements, without tf.data (JAX).
    elements = [
        stack_task(*train(i), k, args.inner_batch_size, np.random.default_rng([args.seed, i]))
        for i in range(args.meta_iters)
    ]
    test = task_sampler(classes, np.arange(7, 10), args.ways, args.shots, args.seed + 1, query=True)
    xs, ys = np.stack([e[0] for e in elements]), np.stack([e[1] for e in elements])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        element_data = tf.data.Dataset.from_tensor_slices((xs, ys))
    else:
        element_data = _Elements(xs, ys)
    hand, hand_times = train_hand(args, elements)
    port, port_times, _ = train_trainer(
        args, element_data, k, False, args.inner_batch_size * args.learning_rate
    )
    straight, _, _ = train_trainer(args, element_data, k, True, args.learning_rate)
    initial = model_fn(args)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(port.get_weights(), hand.get_weights()))
    moved = max(
        float(np.abs(a - b).max()) for a, b in zip(hand.get_weights(), initial.get_weights())
    )
    result = {
        "backend": BACKEND,
        "config": vars(args),
        "inner_steps": k,
        "max_abs_weight_difference_port_vs_hand": diff,
        "max_abs_weight_change_of_hand": moved,
        "seconds_per_meta_iteration": {
            "hand_median": float(np.median(hand_times[1:])),
            "port_median": float(np.median(port_times[1:])),
        },
        "port_over_hand": float(np.median(port_times[1:]) / np.median(hand_times[1:])),
        "accuracy": {
            "initial": evaluate(args, initial, test),
            "hand": evaluate(args, hand, test),
            "port": evaluate(args, port, test),
            "straight": evaluate(args, straight, test),
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
