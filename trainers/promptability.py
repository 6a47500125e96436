r"""Continued pre-training for zero- and few-shot promptability, at small scale and offline
(Wu, Logan, Walsh, Bhagia, Groeneveld, Singh, Beltagy, EMNLP 2022; official code
allenai/better-promptability).

    python -m trainers.promptability                   # the default run (docs/promptability.md)
    python -m trainers.promptability --configurations=none,mtl_tp --modes=shallow
    python -m trainers.promptability --full            # the long run

No pretrained T5 exists offline, so the paper's pipeline is rebuilt small:

1. Pre-training (`trainers.experiments.small_t5.cached_pretrained_t5`): a keras-hub T5 of a
   named size built from a config, a SentencePiece vocabulary trained on the offline English
   corpus (WordNet definitions and examples, Django's UI strings), pre-trained with
   `--pretrain_objective` (span corruption, LM adaptation or both mixed; the paper starts from
   T5 v1.1 LM-adapted). Cached by a content hash under `--cache_dir` (outside the repository).
2. Continued pre-training on the TRAINING task types' prompted mixture
   (`trainers.experiments.prompted_tasks`: supersense, component, language_id; examples-proportional
   mixing
   capped at `--mixture_cap`), one run per configuration and prompt mode:
     none     no continued pre-training
     mtl_t    the transformer trained, no prompt (T0's recipe)
     mtl_p    the prompt only, the transformer frozen
     mtl_tp   both (the paper's recommendation)
     fomaml   `PromptFOMAMLTrainer`: per task `--inner_steps` prompt-only steps on support
              batches, then the query gradient of all weights at the adapted prompt
     reptile  `PromptReptileTrainer`: the same inner loop plus one all-weights step, outer
              gradient phi - mean_b phi_b
   Adafactor at `--learning_rate` (the paper: 1e-3) with the outer gradient clipped at 1.0;
   the meta-learners see as many examples as MTL: `--meta_batch` tasks (a task = one
   dataset-template pair drawn with the mixture's rates) of `--inner_steps` support batches
   and one query batch of `--task_batch_size` examples per meta-step.
3. On the UNSEEN evaluation task types (part_of_speech, matching), per dataset and template:
   zero-shot rank classification (mean per-token log-likelihood of each answer choice, EOS
   included) and the few-shot protocol (16 sampled training examples, prompt tuning for
   `--few_shot_epochs` epochs with the transformer frozen, final-epoch accuracy), for shallow
   and deep prompts. none and mtl_t have no trained prompt: zero-shot they run without one
   (the same numbers in both mode columns), few-shot they tune a fresh prompt
   (vocabulary-row init for shallow, N(0, 1) for deep, as the reference).
   The positive control (`--seen_examples`, 48 by default): zero-shot rank classification
   on held-out TEST examples of the TRAINING datasets, which says whether continued
   pre-training learned its own tasks at all (the unseen-task numbers mean little if not).
   Beside it, after every continued pre-training, the loss on `--fit_examples` later draws
   of the training mixture against the loss of knowing only each template's answer
   distribution (`label_prior_loss`): a model that learned anything about the inputs
   beats it.
4. The ARG table (Average Relative Gain over chance, datasets weighted equally) with paired
   bootstrap p-values of every configuration against none and of mtl_tp against mtl_t; the
   control's table likewise.
5. Shallow prompts on the pretrained all-MiniLM-L6-v2 encoder (`prompts.prompt_bert`,
   frozen encoder): 16-shot prompt tuning + a linear head vs the head alone, on the same
   unseen tasks (the templates' input texts, the label as the class).

Stages: `trainers.promptability_data` (1. the pre-trained T5; the tasks, mixtures and
batches), `trainers.promptability_train` (2.), `trainers.promptability_evaluate` (3. and 5.),
`trainers.promptability_report` (4.), `trainers.promptability_run` (the pipeline, `run`);
this file holds the settings (`Config`, one flag each) and `main`.

Progress lines while it runs, the table at the end, `results.json` (every per-example
correctness, so every number can be recomputed) in `--output_dir`.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.promptability_train import TRAIN  # noqa: E402
from trainers.settings import setting  # noqa: E402


#: The continued pre-training configurations (`TRAIN`: which weights each one trains).
CONFIGURATIONS = tuple(TRAIN)
MODES = ("shallow", "deep")
OBJECTIVES = ("span_corruption", "lm_adaptation", "both")


@dataclasses.dataclass
class Config:
    """Everything a run depends on: each field is also the flag of its name (`setting`);
    tests build it directly."""

    configurations: tuple[str, ...] = setting(
        CONFIGURATIONS, "Continued pre-training configurations.", choices=CONFIGURATIONS
    )
    modes: tuple[str, ...] = setting(MODES, "Prompt modes.", choices=MODES)
    cache_dir: str = setting(
        "/tmp/tf_metaalign_promptability_cache",
        "Where the pre-trained T5 and its SentencePiece model are cached (by content hash).",
    )
    seed: int = setting(0, "Seed of data draws, prompt inits, few-shot samples.")
    # 1. pre-training
    t5_size: str = setting("small", "small_t5.T5_SIZES name (tiny, small, base-ish).")
    vocabulary_size: int = setting(4000, "SentencePiece pieces (100 sentinels included).")
    corpus_max_texts: int = setting(0, "A random subset of the offline corpus (0: all of it).")
    pretrain_objective: str = setting(
        "both", "span_corruption, lm_adaptation or both (mixed).", choices=OBJECTIVES
    )
    pretrain_steps: int = setting(200, "Pre-training steps.")
    pretrain_batch_size: int = setting(32, "Pre-training batch.")
    pretrain_sequence_length: int = setting(64, "Pre-training encoder/decoder length.")
    pretrain_learning_rate: float = setting(1e-2, "Adafactor.t5 rate in pre-training.")
    # data
    max_train: int = setting(1000, "Training examples per prompted dataset.")
    eval_examples: int = setting(48, "Evaluation examples per unseen dataset (its test split).")
    templates_per_dataset: int = setting(2, "Templates per unseen dataset (0: all).")
    mixture_cap: int = setting(500, "Examples-proportional mixing cap.")
    encoder_length: int = setting(48, "Encoder tokens (EOS included).")
    decoder_length: int = setting(8, "Target tokens (EOS included).")
    # 2. continued pre-training
    prompt_length: int = setting(20, "L (20 in the paper).")
    steps: int = setting(60, "MTL continued pre-training steps.")
    batch_size: int = setting(16, "MTL batch size.")
    learning_rate: float = setting(
        1e-3, "Adafactor rate of continued pre-training (outer and inner)."
    )
    meta_batch: int = setting(2, "Tasks per meta-step.")
    inner_steps: int = setting(2, "Prompt-only inner steps per task.")
    task_batch_size: int = setting(4, "Examples per support and query batch.")
    # 3. evaluation
    shots: int = setting(16, "Few-shot training examples.")
    few_shot_epochs: int = setting(5, "Prompt-tuning epochs (100 in the paper).")
    few_shot_batch_size: int = setting(8, "Prompt-tuning batch.")
    few_shot_learning_rate: float = setting(0.3, "Adafactor rate of few-shot prompt tuning.")
    bootstrap_resamples: int = setting(1000, "Bootstrap resamples.")
    seen_examples: int = setting(
        48,
        "The positive control: zero-shot on this many held-out test examples of each "
        "TRAINING dataset (at most eval_examples; 0: no control): did continued "
        "pre-training learn its own tasks?",
    )
    fit_examples: int = setting(
        256,
        "After each continued pre-training, its loss on this many later draws of the "
        "training mixture, beside the loss of knowing only each template's answers.",
    )
    # 5. MiniLM
    minilm: bool = setting(True, "Also the MiniLM shallow-prompt experiment.")
    minilm_prompt_length: int = setting(20, "MiniLM prompt L.")
    minilm_sequence_length: int = setting(48, "MiniLM tokens per input text.")
    minilm_epochs: int = setting(30, "MiniLM few-shot epochs.")
    minilm_learning_rate: float = setting(1e-2, "MiniLM Adam rate.")
    log_every: int = setting(25, "Steps between progress lines.")

    def check(self):
        for name, allowed in (("configurations", CONFIGURATIONS), ("modes", MODES)):
            values = getattr(self, name)
            unknown = [v for v in values if v not in allowed]
            if unknown or not values:
                raise ValueError(
                    f"`{name}`: unknown {unknown} (or none given); choose from "
                    f"{', '.join(allowed)}."
                )
        if "none" not in self.configurations:
            raise ValueError("`configurations` must include 'none' (the p-values are against it).")
        if self.pretrain_objective not in OBJECTIVES:
            raise ValueError(
                f"`pretrain_objective` must be one of {OBJECTIVES}; got "
                f"{self.pretrain_objective!r}."
            )
        settings.check_integers(
            self,
            (
                "vocabulary_size",
                "pretrain_steps",
                "pretrain_batch_size",
                "pretrain_sequence_length",
                "max_train",
                "eval_examples",
                "mixture_cap",
                "fit_examples",
                "prompt_length",
                "steps",
                "batch_size",
                "meta_batch",
                "inner_steps",
                "task_batch_size",
                "shots",
                "few_shot_epochs",
                "few_shot_batch_size",
                "bootstrap_resamples",
                "minilm_prompt_length",
                "minilm_epochs",
                "log_every",
            ),
        )
        for name, zero in (
            ("corpus_max_texts", "all"),
            ("templates_per_dataset", "all"),
            ("seen_examples", "no control"),
        ):
            settings.check_integers(self, (name,), 0, f"(0: {zero})")
        for name, low in (
            ("encoder_length", 4),
            ("decoder_length", 2),
            ("minilm_sequence_length", 3),
        ):
            settings.check_integers(self, (name,), low)
        settings.check_positive(
            self,
            (
                "pretrain_learning_rate",
                "learning_rate",
                "few_shot_learning_rate",
                "minilm_learning_rate",
            ),
        )
        if self.shots > self.max_train:
            raise ValueError(f"`shots`={self.shots} exceeds `max_train`={self.max_train}.")
        if not self.cache_dir:
            raise ValueError("`cache_dir` is empty; give a folder for the pre-trained T5.")

    @property
    def meta_steps(self) -> int:
        """Meta-steps seeing as many examples as `steps` MTL batches (at least one)."""
        per_step = self.meta_batch * (self.inner_steps + 1) * self.task_batch_size
        return max(1, self.steps * self.batch_size // per_step)


FULL_RUN = {
    "pretrain_steps": 3000,
    "steps": 1000,
    "eval_examples": 200,
    "templates_per_dataset": 0,
    "few_shot_epochs": 100,
    "inner_steps": 7,
    "meta_batch": 8,
    "minilm_epochs": 100,
    "encoder_length": 64,
}


def define_flags():
    """The program's flags: one per `Config` setting, `--output_dir`, `--full` (only when it
    runs as a program: tests import its functions)."""
    settings.define_program_flags(
        Config,
        "/tmp/tf_metaalign_promptability",
        "The long run (FULL_RUN: more pre-training, continued pre-training, evaluation "
        "examples, all templates, 100 epochs).",
    )


FLAGS = flags.FLAGS


def main(argv):
    del argv
    import warnings

    from trainers import startup

    startup.start_tensorflow()  # before anything imports TensorFlow: no start-up chatter
    from trainers import common
    from trainers import promptability_report as report
    from trainers.promptability_run import run

    # keras-hub's T5 layers receive Keras masks they do not use (T5 takes explicit padding
    # masks, which the prompted model extends): the warning says nothing about this run.
    warnings.filterwarnings(
        "ignore",
        message=r"Layer '(self|cross)_attention' \(of type "
        r"T5MultiHeadAttention\) was passed an input with a mask",
    )

    config = settings.program_config(Config, FULL_RUN)
    try:
        out = common.prepare_output_dir(FLAGS.output_dir)
    except ValueError as e:
        raise app.UsageError(str(e))
    log = common.Progress()
    results, _ = run(config, log)
    report.print_report(results, config.modes)
    common.write_json(out / "results.json", results)
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
