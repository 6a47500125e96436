r"""Few-shot Omniglot with MAML-family meta-learners, with and without gradient sharing
(Chang & Lipson), plus Reptile, FOMAML and DotProd, and a sinusoid sanity check.

    python -m trainers.fewshot                 # default: ~7 min on 2 shared CPU cores
    python -m trainers.fewshot --full          # the paper-like run (hours: see docs/fewshot.md)
    python -m trainers.fewshot --methods=maml,maml_gs,reptile --task_batch_sizes=5 --seeds=0,1

Data: the two small Omniglot background sets (242 characters after deduplication), split
by character into meta-train / validation / test classes (`--validation_classes`,
`--test_classes`); the meta-train characters get their 90/180/270 degree rotations as
extra classes (`--rotations`); the held-out characters are not rotated. Lake's official
20 runs (20-way 1-shot, evaluation alphabets, so no alphabet in common with training) are
scored too.

Model: Conv-4 = 4 x [Conv 3x3 (`--filters`), BatchNorm, ReLU, MaxPool 2] + Dense(ways) on
28x28x1 images. Transductive BatchNorm (batch statistics of the support / query set) in
training and evaluation, as the reference MAML.

Methods (`--methods`); every MAML-family method is a `MAMLTrainer` with K=`--inner_steps`
inner SGD steps at alpha = `--inner_learning_rate` x `--inner_learning_rate_scales`, outer
Adam(`--outer_learning_rate`):

  maml, maml_gs         second-order MAML; _gs: gradient_sharing=True
  metasgd, metasgd_gs   learn_inner_learning_rates="per_parameter" (Meta-SGD)
  mamlpp, mamlpp_gs     MAML++: "per_layer_per_step" (LSLR) + multi-step loss (annealed over
                        half the epochs); no per-step BatchNorm (not in MAMLTrainer)
  fomaml                MAMLTrainer(first_order=True) on the same task batches
  reptile               ReptileTrainer, one episode per step: each of its K inner batches is
                        the whole episode (support + query examples, N*(K_shot+Q) images),
                        outer Adam on the pseudo-gradient phi - theta_K
  dotprod               DotProdTrainer (weight `--dotprod_weight`), one episode per step as a
                        plain classification batch: b1 = the support set, b2 = the first
                        `shots` query examples of each class (so |b1| = |b2|)

The MAML-family methods (fomaml included) run at every `--task_batch_sizes`; reptile and
dotprod take one episode per step, so they run once per seed and rate (listed as task
batch 1).

Evaluation (the same for every method): each episode is adapted with the evaluation inner
loop of a MAMLTrainer (`--evaluation_inner_steps` SGD steps at alpha on the support set;
for MAML-family runs the trainer itself, i.e. its learned rates and gradient sharing with
the stored g_hat; for reptile / dotprod a plain MAMLTrainer wrapped around the trained
model), then scored on its query set. 20-way episodes (and the official runs) use a
20-way copy of the model: same body, the 5-way head's columns averaged and repeated 20
times (all classes start equal; the labels of an episode are a random permutation anyway),
learned inner rates / gradient-sharing state copied likewise.

Stages: `trainers.fewshot_data` (Omniglot splits, episode batches), `trainers.fewshot_run`
(the models, one training run, the evaluation, the sinusoid check), `trainers.fewshot_report`
(speed-ups, tables, plots); this file holds the settings (`Config`, one flag each) and `main`.

Per run: validation accuracy after every epoch (`--steps_per_epoch` meta-batches) on a
fixed set of `--validation_episodes` 5-way episodes; the best one and the earliest epoch
reaching it; test accuracy on `--test_episodes` 5-way 1-shot and 20-way 1-shot episodes of
the test characters (mean +- 95% t-interval over episodes) and on the official runs (+- CI
over the 20 runs), at the FINAL weights; wall time. Per OG/GS pair: the paper's speed-up
(E_OG - E_GS) / E_GS with E the earliest epoch reaching the run's best validation
accuracy. Plots (PNG): validation accuracy per epoch, and sigmoid(m), sigmoid(lambda) per
epoch of the gradient-sharing runs. Sinusoid regression (Finn et al.): MAML vs MAML+GS,
query MSE of held-out waves before and after adaptation.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.fewshot_run import ONE_EPISODE_METHODS  # noqa: E402
from trainers.settings import setting  # noqa: E402


METHODS = (
    "maml",
    "maml_gs",
    "metasgd",
    "metasgd_gs",
    "mamlpp",
    "mamlpp_gs",
    "fomaml",
    "reptile",
    "dotprod",
)


@dataclasses.dataclass
class Config:
    """Everything a run depends on: each field is also the flag of its name (`setting`);
    tests build it directly."""

    methods: tuple[str, ...] = setting(("maml", "maml_gs"), "Which methods.", choices=METHODS)
    task_batch_sizes: tuple[int, ...] = setting(
        (5, 1), "Tasks per meta-batch (MAML family; reptile/dotprod take 1)."
    )
    seeds: tuple[int, ...] = setting((0,), "Seeds (init, episodes).")
    inner_learning_rate_scales: tuple[float, ...] = setting(
        (1.0,), "Multipliers of --inner_learning_rate (10: the paper's 10x run)."
    )
    ways: int = setting(5, "N of the training / validation episodes.")
    shots: int = setting(1, "K-shot of every episode.")
    queries: int = setting(5, "Query examples per class (5-way episodes).")
    inner_steps: int = setting(1, "Inner SGD steps in meta-training.")
    inner_learning_rate: float = setting(0.1, "Inner SGD rate alpha.")
    evaluation_inner_steps: int = setting(3, "Inner SGD steps when evaluating (every method).")
    outer_learning_rate: float = setting(1e-3, "Outer Adam's rate.")
    filters: int = setting(16, "Conv-4 filters per layer (64 in the paper).")
    epochs: int = setting(10, "Epochs of meta-training.")
    steps_per_epoch: int = setting(60, "Meta-batches per epoch.")
    validation_episodes: int = setting(
        40, "Fixed 5-way validation episodes, scored after every epoch."
    )
    test_episodes: int = setting(100, "Test episodes (each of 5-way and 20-way).")
    validation_classes: int = setting(24, "Validation characters.")
    test_classes: int = setting(48, "Test characters.")
    rotations: bool = setting(True, "Rotations of meta-train characters as classes.")
    official_runs: bool = setting(True, "Score Lake's 20 official runs.")
    dotprod_weight: float = setting(0.1, "DotProd's regulariser weight.")
    sinusoid: bool = setting(True, "Run the sinusoid sanity check.")
    sinusoid_steps: int = setting(1500, "Sinusoid meta-batches.")
    sinusoid_tasks_per_batch: int = setting(10, "Sinusoid tasks per meta-batch.")
    sinusoid_test_tasks: int = setting(100, "Held-out sine waves.")
    log_every: int = setting(60, "Steps between progress lines.")

    def check(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(
                f"`methods`: unknown {unknown} (or none given); choose from {', '.join(METHODS)}."
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"`methods` lists a method twice: {list(self.methods)}.")
        if not self.seeds:
            raise ValueError("`seeds` is empty.")
        for name in ("task_batch_sizes", "seeds"):
            for v in getattr(self, name):
                if (
                    isinstance(v, bool)
                    or not isinstance(v, int)
                    or v < (1 if name == "task_batch_sizes" else 0)
                ):
                    raise ValueError(
                        f"`{name}` must hold integers >= "
                        f"{1 if name == 'task_batch_sizes' else 0}; got {v!r}."
                    )
        if not self.task_batch_sizes:
            raise ValueError("`task_batch_sizes` is empty.")
        if not self.inner_learning_rate_scales or any(
            not (isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0)
            for s in self.inner_learning_rate_scales
        ):
            raise ValueError(
                "`inner_learning_rate_scales` must be numbers > 0; got "
                f"{list(self.inner_learning_rate_scales)}."
            )
        settings.check_integers(
            self,
            (
                "ways",
                "shots",
                "queries",
                "inner_steps",
                "evaluation_inner_steps",
                "filters",
                "epochs",
                "steps_per_epoch",
                "validation_episodes",
                "test_episodes",
                "sinusoid_steps",
                "sinusoid_tasks_per_batch",
                "sinusoid_test_tasks",
                "log_every",
            ),
        )
        settings.check_positive(self, ("inner_learning_rate", "outer_learning_rate"))
        if self.dotprod_weight < 0:
            raise ValueError(f"`dotprod_weight` must be >= 0; got {self.dotprod_weight!r}.")
        if self.validation_classes < self.ways:
            raise ValueError(
                f"`validation_classes`={self.validation_classes} is fewer than `ways`={self.ways}."
            )
        if self.test_classes < 20:
            raise ValueError(
                f"`test_classes`={self.test_classes}: 20-way test episodes need "
                "at least 20 test characters."
            )
        if self.validation_classes + self.test_classes > 242 - self.ways:
            raise ValueError(
                "`validation_classes` + `test_classes` leave fewer than `ways` "
                "of the 242 characters for meta-training."
            )
        if self.shots + self.queries > 20:
            raise ValueError(
                f"`shots` + `queries` = {self.shots + self.queries}: Omniglot "
                "has 20 drawings per character."
            )
        if "dotprod" in self.methods and self.queries < self.shots:
            raise ValueError(
                "dotprod needs `queries` >= `shots` (b2 = `shots` query examples per class)."
            )


FULL_RUN = {
    "methods": METHODS,
    "task_batch_sizes": (5, 1),
    "seeds": (0, 1, 2),
    "inner_learning_rate_scales": (1.0, 10.0),
    "inner_steps": 5,
    "inner_learning_rate": 0.1,
    "evaluation_inner_steps": 5,
    "filters": 64,
    "epochs": 40,
    "steps_per_epoch": 100,
    "validation_episodes": 200,
    "test_episodes": 600,
    "queries": 15,
    "sinusoid_steps": 5000,
    "sinusoid_tasks_per_batch": 25,
    "sinusoid_test_tasks": 600,
}


def define_flags():
    """The program's flags: one per `Config` setting, `--output_dir`, `--full` (only when it
    runs as a program: tests import its functions)."""
    settings.define_program_flags(
        Config,
        "/tmp/tf_metaalign_fewshot",
        "The full run (see docs/fewshot.md): every method, K=5 at 0.1 and the 10x run, 64 "
        "filters, 40 x 100 meta-batches, 3 seeds, 600 test episodes. Flags given explicitly "
        "still win.",
    )


FLAGS = flags.FLAGS


def main(argv):
    del argv
    from trainers import common
    from trainers import fewshot_report as report
    from trainers.fewshot_data import prepare_data
    from trainers.fewshot_run import run_method, run_sinusoid

    config = settings.program_config(Config, FULL_RUN)
    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    start = time.perf_counter()
    sine = []
    if config.sinusoid:
        for seed in config.seeds:
            for gs in (False, True):
                sine.append(run_sinusoid(config, seed, gs, log))
    data = prepare_data(config, log)
    plan = []
    for seed in config.seeds:
        for scale in config.inner_learning_rate_scales:
            for tb in config.task_batch_sizes:
                for method in config.methods:
                    if method in ONE_EPISODE_METHODS and tb != config.task_batch_sizes[-1]:
                        continue
                    plan.append((method, 1 if method in ONE_EPISODE_METHODS else tb, scale, seed))
    runs = []
    for i, (method, tb, scale, seed) in enumerate(plan):
        log(f"run {i + 1}/{len(plan)}: {method}, task batch {tb}, inner lr x{scale:g}, seed {seed}")
        runs.append(run_method(method, tb, scale, seed, data, config, log))
        log(report.run_line(runs[-1]))
    speed = report.speed_ups(runs)
    paths = report.plot(runs, out)
    report.print_tables(runs, speed, sine)
    total = time.perf_counter() - start
    common.write_json(
        out / "results.json",
        {
            "config": dataclasses.asdict(config),
            "runs": runs,
            "speed_ups": speed,
            "sinusoid": sine,
            "plots": [p.name for p in paths],
            "seconds": total,
        },
    )
    log(f"results.json and {', '.join(p.name for p in paths)} in {out} ({total:.0f} s)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
