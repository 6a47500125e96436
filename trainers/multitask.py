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

Stages: `trainers.multitask_data` (catalogs, tokens, the frozen layers' cache),
`trainers.multitask_run` (the model, one method's run and its measurements),
`trainers.multitask_report` (means and t-intervals over seeds, the tables); this file holds
the settings (`Config`, one flag each) and `main`.

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

from trainers import multitask_methods as MM  # noqa: E402
from trainers import settings  # noqa: E402
from trainers.multitask_run import ALIASES, PROGRAM_METHODS  # noqa: E402
from trainers.settings import setting  # noqa: E402

#: The default run: the paper's baselines (Lee et al. Tables 2-4).
METHODS = (
    "single_task",
    "mtl",
    "pcgrad",
    "gradvac",
    "gradnorm",
    "recadam",
    "reptile",
    "sequential_reptile",
)
TRAIN_LANGUAGES = ("de", "fr", "es", "pl", "ro", "hr", "cy", "lb")
ZERO_SHOT_LANGUAGES = ("it", "nl", "sw")


@dataclasses.dataclass
class Config:
    """Everything a run depends on: each field is also the flag of its name (`setting`);
    tests build it directly."""

    methods: tuple[str, ...] = MM.methods_setting(METHODS, PROGRAM_METHODS, ALIASES)
    #: {method: {constructor argument: value}} for the registry methods run.
    method_options: dict = MM.method_options_setting()
    train_languages: tuple[str, ...] = setting(TRAIN_LANGUAGES, "Training languages (tasks).")
    zero_shot_languages: tuple[str, ...] = setting(
        ZERO_SHOT_LANGUAGES, "Unseen languages, evaluated zero-shot."
    )
    seeds: tuple[int, ...] = setting((0, 1, 2), "Seeds (initial head, data order).")
    steps: int = setting(
        120, "MTL steps; every method sees steps x tasks x per_task_batch_size examples."
    )
    per_task_batch_size: int = setting(
        4,
        "Examples per task in a mixed batch (Sequential Reptile's single-task "
        "batches have tasks x this many).",
    )
    learning_rate: float = setting(1e-3, "Adam's rate (the inner rate of the Reptiles).")
    trainable_layers: int = setting(1, "Top transformer layers fine-tuned (6: the whole encoder).")
    sequence_length: int = setting(16, "Tokens per string.")
    q: float = setting(0.2, "Sequential Reptile's task sampling p_t ∝ N_t^q.")
    inner_steps: int = setting(10, "Sequential Reptile's K.")
    reptile_inner_steps: int = setting(5, "Reptile's k per task.")
    reptile_tasks: int = setting(4, "Reptile's tasks per outer step (drawn with p_t ∝ N_t^q).")
    outer_learning_rate: float = setting(0.5, "eta of both Reptiles.")
    recadam_k: float = setting(0.1, "RecAdam's annealing slope k.")
    recadam_pretrain_cof: float = setting(100.0, "RecAdam's gamma.")
    probe_examples: int = setting(32, "Training strings per language for the gradient cosine.")
    test_fraction: float = setting(
        0.25, "Share of each language's strings held out (split by message, as in every language)."
    )
    split_seed: int = setting(0, "Seed of the held-out split.")
    log_every: int = setting(20, "Steps between progress lines.")

    def __post_init__(self):
        if isinstance(self.methods, str):
            self.methods = tuple(self.methods.split(","))
        self.methods = MM.expand(self.methods, ALIASES)  # "zoo" -> every registry method
        self.method_options = MM.parse_method_options(self.method_options)

    def check(self):
        MM.check_methods(self.methods, PROGRAM_METHODS, ALIASES)
        MM.check_method_options(self.method_options, self.methods, ALIASES)
        if len(self.train_languages) < 2:
            raise ValueError(
                "`train_languages` needs at least two languages (tasks); got "
                f"{list(self.train_languages)}."
            )
        overlap = set(self.train_languages) & set(self.zero_shot_languages)
        if overlap:
            raise ValueError(
                f"`zero_shot_languages` must not be trained on; both lists have {sorted(overlap)}."
            )
        if not self.seeds:
            raise ValueError("`seeds` is empty.")
        settings.check_integers(
            self,
            (
                "steps",
                "per_task_batch_size",
                "trainable_layers",
                "inner_steps",
                "reptile_inner_steps",
                "reptile_tasks",
                "probe_examples",
                "log_every",
            ),
        )
        if self.reptile_tasks > len(self.train_languages):
            raise ValueError(
                f"`reptile_tasks`={self.reptile_tasks} is more than the "
                f"{len(self.train_languages)} training languages."
            )
        if (self.steps * len(self.train_languages)) % (
            self.reptile_tasks * self.reptile_inner_steps
        ):
            raise ValueError(
                f"`steps` x languages = {self.steps * len(self.train_languages)} must be a "
                f"multiple of `reptile_tasks` x `reptile_inner_steps` = "
                f"{self.reptile_tasks * self.reptile_inner_steps} (Reptile sees the same "
                "examples as MTL)."
            )
        settings.check_positive(self, ("learning_rate", "outer_learning_rate"))


FULL_RUN = {
    "trainable_layers": 6,
    "sequence_length": 32,
    "steps": 480,
    "seeds": (0, 1, 2, 3, 4),
    "learning_rate": 1e-4,
    "train_languages": TRAIN_LANGUAGES + ("pt", "sv", "tr", "ast"),
}


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


def main(argv):
    del argv
    from trainers import common
    from trainers import multitask_report as report
    from trainers.multitask_data import prepare_data
    from trainers.multitask_run import run_method

    config = settings.program_config(Config, FULL_RUN)
    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    data = prepare_data(config, log)
    runs = []
    total = len(config.seeds) * len(config.methods)
    for seed in config.seeds:
        for method in config.methods:
            log(f"run {len(runs) + 1}/{total}: {method}, seed {seed}")
            runs.append(run_method(method, data, seed, config, log))
            log(report.run_line(runs[-1]))
    rows = report.summarise(runs, config.methods)
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
        },
    )
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
