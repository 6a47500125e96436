r"""Multilingual multi-task fine-tuning of a pretrained encoder: Sequential Reptile, the
baselines it is measured against (Lee et al., ICLR 2022, Tables 2-4) and the multi-task
method zoo, on real data offline.

    python -m trainers.multitask                       # ~15 min on 2 quiet cores: 8 methods x 3
    seeds
    python -m trainers.multitask --methods=mtl,sequential_reptile --seeds=0
    python -m trainers.multitask --methods=zoo --seeds=0 --steps=40   # every registry method
    python -m trainers.multitask --methods=mtl,cagrad,nash_mtl \
        --method_options=cagrad.calpha=0.4,nash_mtl.optim_niter=10
    python -m trainers.multitask --full                # whole encoder, 5 seeds, 4x the steps

Data (`trainers.experiments.django_catalogs`): Django's gettext catalogs, one task per
language: a translated UI string -> the part of Django it belongs to (8 classes). The
training languages are imbalanced (de/fr/es/pl ~520 training strings, lb 117); the
zero-shot languages are never trained on (the paper's Table 3). The held-out strings are
the same English messages in every language (split by msgid), so no score comes from
having seen a message's translation in another language.

Model: the pretrained all-MiniLM-L6-v2 encoder (`trainers.experiments.text_encoder`), masked
mean pooling, dropout and a new linear head. By default only its top
`--trainable_layers=1` transformer layer is fine-tuned (with the head): the frozen layers'
outputs are computed once and cached, which is what makes 24 runs fit in minutes on 2
cores. `--trainable_layers=6` (`--full`) fine-tunes the whole encoder, embeddings
included.

Methods (every run of a seed starts from the same weights, the same head initialisation,
and sees the same number of examples, `--steps * num_tasks * --per_task_batch_size`):

  single_task         one model per language, each on `--steps` batches of
                      `--per_task_batch_size` of its own language (the examples of that
                      language MTL sees)
  mtl                 MultiTaskTrainer("sum"): every step a mixed batch with
                      `--per_task_batch_size` examples of every language
  <registry name>     MultiTaskTrainer(method=<name>) on the same mixed batches: every
                      method of `tf_metaalign.algorithms.multitask` (`method_names()`:
                      sum, rlw, uw, dwa, famo, gradnorm, pcgrad, gradvac, mgda, cagrad,
                      imtl, nash_mtl, aligned_mtl); the default run has pcgrad, gradvac
                      and gradnorm; `--methods=zoo` runs all of them ("sum" as "mtl").
                      Their hyperparameters: `--method_options=<method>.<argument>=<value>`
                      (the class's constructor arguments; `trainers.multitask_methods`)
  recadam             "sum" with RecAdam instead of Adam (pull toward the pretrained weights,
                      sigmoid annealing k = `--recadam_k`, t0 = steps / 4; the new head is
                      excluded from the pull, as the reference's new-weights group)
  reptile             MultiTaskReptileTrainer: per outer step one `--reptile_inner_steps`-step
                      Adam trajectory per language from the same phi, averaged; outer SGD
                      with rate `--outer_learning_rate`
  sequential_reptile  SequentialReptileTrainer: single-language batches of the mixed batch's
                      size, language t drawn with p_t ∝ N_t^q (`--q`, 0.2 as in the paper),
                      Adam inner steps, every `--inner_steps` steps
                      phi <- phi + `--outer_learning_rate` (theta - phi)

The model has ONE classification head shared by every language (the paper's setting: one
multilingual model, and the zero-shot languages need the head too), so every variable is
shared and the surgery / weighting acts on all of them (MultiTaskTrainer finds no
`PerTaskHead`; a model with per-task heads would have them treated as task-specific).

Stages: `trainers.multitask_config` (the settings: `Config`, one flag each, `FULL_RUN`, the
program's methods), `trainers.multitask_data` (catalogs, tokens, the frozen layers' cache),
`trainers.multitask_run` (the model, one method's run and its measurements),
`trainers.multitask_report` (means and t-intervals over seeds, the tables); this file holds
the flags and `main`.

Measured per run: accuracy on each training language's held-out strings and their average;
zero-shot accuracy on each unseen language; the mean pairwise cosine of the training
languages' gradients at the final weights (`callbacks.MultiTaskDiagnostics.measure`, on a
fixed batch of `--probe_examples` training strings per language, no dropout); the L2
distance of the encoder's trainable weights from the pretrained ones (the head is new and
left out). The table gives each quantity's mean over seeds with a 95% t-interval, and
`results.json` every run's values; progress lines are printed while it runs.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.multitask_config import FULL_RUN, Config  # noqa: E402


def define_flags():
    """The program's flags: one per `Config` setting, `--output_dir`, `--full` (only when it
    runs as a program: tests import its functions)."""
    settings.define_program_flags(
        Config,
        "/tmp/tf_metaalign_multitask",
        "The full run: the whole encoder (trainable_layers=6), sequence_length 32, 4x the "
        "steps, seeds 0-4, 12 training languages.",
    )


FLAGS = flags.FLAGS

#: What a method uses beyond `MultiTaskTrainer` (a run whose piece is not on the backend
#: yet is skipped with the reason: `common.unavailable`).
NEEDS = {
    "recadam": [("tf_metaalign.optimizers", "RecAdam")],
    "reptile": [("tf_metaalign.trainers", "MultiTaskReptileTrainer")],
    "sequential_reptile": [("tf_metaalign.trainers", "SequentialReptileTrainer")],
}


def main(argv):
    del argv
    from trainers import startup

    config = settings.program_config(Config, FULL_RUN)
    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)

    from trainers import common
    from trainers import multitask_report as report
    from trainers.multitask_data import prepare_data
    from trainers.multitask_run import run_method

    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    log(f"multitask: backend {backend}, devices: {', '.join(devices)}; results to {out}")
    missing = common.unavailable({m: NEEDS.get(m, ()) for m in config.methods})
    for m, reason in missing.items():
        log(f"{m}: skipped on {backend}: {reason}")
    methods = tuple(m for m in config.methods if m not in missing)
    data = prepare_data(config, log)
    runs = []
    total = len(config.seeds) * len(methods)
    for seed in config.seeds:
        for method in methods:
            log(f"run {len(runs) + 1}/{total}: {method}, seed {seed}")
            runs.append(run_method(method, data, seed, config, log))
            log(report.run_line(runs[-1]))
    rows = report.summarise(runs, methods)
    majority = report.majority_accuracy(data)
    report.print_tables(rows, data, config, majority)
    common.write_json(
        out / "results.json",
        {
            "config": dataclasses.asdict(config),
            "classes": list(data.class_names),
            "train_sizes": {lang: len(y) for lang, (_, y) in data.train.items()},
            "majority_accuracy": majority,
            "summary": rows,
            "runs": runs,
            "backend": backend,
            "skipped": missing,
        },
    )
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
