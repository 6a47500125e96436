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

Stages: `trainers.fewshot_config` (the settings: `Config`, one flag each, and `FULL_RUN`),
`trainers.fewshot_data` (Omniglot splits, episode batches), `trainers.fewshot_run` (the
models, one training run, the evaluation, the sinusoid check), `trainers.fewshot_report`
(speed-ups, tables, plots); this file holds the flags and `main`.

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
from trainers.fewshot_config import FULL_RUN, Config  # noqa: E402
from trainers.fewshot_run import ONE_EPISODE_METHODS  # noqa: E402


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


#: What every run of the program needs: MAML (the methods, and the evaluator of Reptile's
#: and DotProd's runs), Reptile and DotProd.
NEEDS = (
    ("tf_metaalign.trainers", "MAMLTrainer"),
    ("tf_metaalign.trainers", "ReptileTrainer"),
    ("tf_metaalign.trainers", "DotProdTrainer"),
)


def main(argv):
    del argv
    from trainers import startup

    config = settings.program_config(Config, FULL_RUN)
    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)

    from trainers import common
    from trainers import fewshot_report as report
    from trainers.fewshot_data import prepare_data
    from trainers.fewshot_run import run_method, run_sinusoid

    common.require_on_backend("trainers.fewshot", NEEDS, backend)
    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    log(f"fewshot: backend {backend}, devices: {', '.join(devices)}; results to {out}")
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
            "backend": backend,
        },
    )
    log(f"results.json and {', '.join(p.name for p in paths)} in {out} ({total:.0f} s)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
