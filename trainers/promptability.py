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

Stages: `trainers.promptability_config` (the settings: `Config`, one flag each, `FULL_RUN`,
the configurations), `trainers.promptability_data` (1. the pre-trained T5; the tasks,
mixtures and batches), `trainers.promptability_train` (2.), `trainers.promptability_evaluate`
(3. and 5.), `trainers.promptability_report` (4.), `trainers.promptability_run` (the
pipeline, `run`); this file holds the flags and `main`.

Progress lines while it runs, the table at the end, `results.json` (every per-example
correctness, so every number can be recomputed) in `--output_dir`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.promptability_config import FULL_RUN, Config  # noqa: E402


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

#: What the program needs on the backend (a clear stop where one is not there yet).
NEEDS = (
    ("tf_metaalign.prompts", "prompt_t5"),
    ("tf_metaalign.prompts", "prompt_bert"),
    ("tf_metaalign.prompts.t5_lm", "PromptedT5LM"),
    ("tf_metaalign.trainers.prompt_meta", "PromptFOMAMLTrainer"),
    ("tf_metaalign.trainers.prompt_meta", "PromptReptileTrainer"),
)


def main(argv):
    del argv
    import warnings

    from trainers import startup

    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)
    from trainers import common

    common.require_on_backend("trainers.promptability", NEEDS, backend)
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
    results["backend"] = backend
    report.print_report(results, config.modes)
    common.write_json(out / "results.json", results)
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
