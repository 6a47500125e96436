r"""Meta DotProd stability: plain fit vs DotProd's alignments, from scratch and fine-tuning.

    python -m benchmarks.dotprod_stability --runs='plain;dot:weight=0.1;capped:weight=0.1'
    python -m benchmarks.dotprod_stability --task=minilm --runs='plain;dot:weight=0.1'

`--task=minilm`: the pretrained MiniLM classifier (`text_encoder.build_text_classifier`,
mean pool + Dense, logits) fine-tuned on WordNet supersenses (45 classes, 24 tokens),
Adam(1e-4), `--steps` steps of batch 32 (the `trainers.finetune` defaults), one pass over
the first steps*32 training glosses, evaluated on 384 test glosses.

Each run: sklearn digits (1,347 train / 450 test) upsampled 3x to 24x24 and padded to
28x28, the keras-io MNIST convnet (Conv32-Pool-Conv64-Pool-Flatten-Dropout(0.5)-Dense10
softmax), Adam(1e-3), batch 64, the same initial weights and batch order. Prints the
per-epoch loss / grad_dot / reg_ratio and the final test loss / accuracy; `--output`
writes the rows as JSON. `plain` is the model's own `fit` (Adam ignores the factor 2 of
G1 + G2, so plain fit is the reference for the learning rate).
"""

from __future__ import annotations

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf

from tf_metaalign.data import load_digits


def digits_28(seed=0):
    d = load_digits(seed=seed, flatten=False)

    def up(x):
        x = np.repeat(np.repeat(x, 3, axis=1), 3, axis=2)  # 24x24
        return np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0))).astype("float32")

    return up(d.x_train), d.y_train, up(d.x_test), d.y_test


def convnet(seed=0, logits=False):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation=None if logits else "softmax"),
        ]
    )


def wordnet_minilm(seed, steps, batch, sequence_length=24, n_test=384):
    from trainers.experiments.wordnet import load_wordnet_supersenses
    from trainers.experiments import text_encoder

    text = load_wordnet_supersenses(seed=seed, relabel=True)
    tokenizer = text_encoder.load_minilm_tokenizer()
    n = steps * batch
    x = text_encoder.tokenize(text.x_train[:n], tokenizer, sequence_length)
    xt = text_encoder.tokenize(text.x_test[:n_test], tokenizer, sequence_length)

    def build():
        keras.utils.set_random_seed(seed)
        return text_encoder.build_text_classifier(
            text.num_classes, sequence_length=sequence_length, seed=seed
        )

    return (x, text.y_train[:n], xt, text.y_test[:n_test]), build


def parse(spec):
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        k, v = item.split("=")
        try:
            v = float(v) if "." in v or "e" in v else int(v)
        except ValueError:
            pass
        kwargs[k] = v
    return name, kwargs


def run(spec, data, epochs, batch, lr, seed, build=None, from_logits=False):
    from tf_metaalign.trainers import DotProdTrainer

    name, kwargs = parse(spec)
    x, y, xt, yt = data
    model = build() if build else convnet(seed, logits=from_logits)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    if name == "plain":
        trainer = model
    else:
        if name != "paper" and "alignment" not in kwargs:
            kwargs["alignment"] = name
        trainer = DotProdTrainer(model, **kwargs)
    trainer.compile(optimizer=keras.optimizers.Adam(lr), loss=loss, metrics=["accuracy"])
    keras.utils.set_random_seed(seed + 1)  # dropout and the shuffle: same for every run
    t0 = time.time()
    if build:  # fine-tuning: one pass, logged every 10 steps (as `epochs`)
        n = len(y)
        h = trainer.fit(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
            steps_per_epoch=10,
            epochs=n // (10 * batch),
            verbose=0,
        )
    else:
        h = trainer.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True)
    ev = model.evaluate(xt, yt, verbose=0, return_dict=True)
    hist = {k: [float(v) for v in vals] for k, vals in h.history.items()}
    row = dict(
        run=spec,
        test_loss=ev["loss"],
        test_acc=ev["accuracy"],
        train_loss=hist["loss"][-1],
        history=hist,
        seconds=time.time() - t0,
    )
    print(
        f"{spec:40s} test_acc={ev['accuracy']:.4f} test_loss={ev['loss']:.4f} "
        f"time={row['seconds']:.0f}s",
        flush=True,
    )
    for k in ("loss", "grad_dot", "reg_ratio", "accuracy"):
        if k in hist:
            print(f"   {k:10s} " + " ".join(f"{v:.4g}" for v in hist[k]), flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="plain;paper:weight=0.1")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    p.add_argument("--task", default="convnet", choices=["convnet", "minilm"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--logits", action="store_true", help="convnet: a logits output and from_logits=True"
    )
    a = p.parse_args()
    if a.task == "minilm":
        data, build = wordnet_minilm(a.seed, a.steps, a.batch)
        rows = [run(s, data, 0, a.batch, a.lr, a.seed, build, True) for s in a.runs.split(";")]
    else:
        data = digits_28(a.seed)
        rows = [
            run(s, data, a.epochs, a.batch, a.lr, a.seed, from_logits=a.logits)
            for s in a.runs.split(";")
        ]
    if a.output:
        with open(a.output, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
