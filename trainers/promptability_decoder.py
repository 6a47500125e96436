r"""A small decoder LM on the offline prompted tasks: zero-shot, and 16-shot prompt tuning
vs prefix tuning vs LoRA vs full fine-tuning at the same budget, over seeds.

    python -m trainers.promptability_decoder                  # the default run (~5 min, 2 cores)
    python -m trainers.promptability_decoder --seeds=0,1,2,3,4 --epochs=40

1. Pre-training (`trainers.experiments.small_gpt2.cached_pretrained_gpt2`): a keras-hub
   `GPT2Backbone` of a named size built from a config, pre-trained with the causal LM
   objective on the small T5's offline corpus (WordNet definitions and examples, Django's
   English UI strings) with the small T5's SentencePiece vocabulary (the same cache folder,
   `--cache_dir`): the weights are cached by a content hash of every setting.
2. The UNSEEN task types of `trainers.experiments.prompted_tasks` (part_of_speech,
   matching: 4 two-way datasets, `--templates_per_dataset` templates each). A decoder reads
   `EOS + input` (EOS is the corpus's document boundary: the vocabulary has no BOS; the
   input cut from the LEFT to `--input_length`, so a template's question at its end stays)
   and scores each answer choice `+ EOS` as its continuation: rank classification by the
   mean per-token log-likelihood (`prompts.causal_lm_score_fn`), as the T5 experiment.
3. Methods, each on the same pre-trained weights:
     zero_shot  the plain model, no training
     prompt     shallow prompt tuning (`prompts.prompt_causal_lm(mode="shallow")`, L
                virtual tokens, vocabulary-row init), the backbone frozen
     prefix     deep prefix tuning (mode="deep", L keys/values per layer, init from the
                backbone's own keys/values of L vocabulary tokens), the backbone frozen
     lora       keras-hub's `backbone.enable_lora(rank)` (query and value projections;
                A he-uniform, B zero), every other weight frozen
     full       every weight of the backbone
   Every trained method sees the same budget: `--shots` examples sampled per (dataset,
   template, seed) (`prompts.sample_few_shot`), `--epochs` epochs of batches of
   `--batch_size`, Adam at the method's own rate (`--learning_rates`), the loss the answer
   tokens' cross-entropy (what rank classification scores), the accuracy after the last
   step (no model selection). Every run starts from the pre-trained weights and a fresh
   optimizer state; the seed draws the 16 examples, the initial prompt / LoRA factors and
   the batch order.
4. Per method and seed: the accuracy averaged over the (dataset, template) pairs; over
   seeds its mean and 95% t interval, the paired differences (same seed: same examples)
   against zero-shot and full fine-tuning with their intervals (significant when the
   interval excludes 0), a paired bootstrap p-value over evaluation examples (seeds pooled),
   the trainable-parameter count and the measured median step time (ms, tracing
   excluded) with its ratio to full fine-tuning. References: chance (every task is 2-way)
   and always answering the majority label of the 16 sampled examples.

Progress lines while it runs, the table at the end, `results.json` in `--output_dir`
(per-example correctness of every run).

The program is split by stage: this module (the flags and `main`),
`promptability_decoder_config` (the settings: `Config`, one flag each),
`promptability_decoder_data` (pairs, token ids), `promptability_decoder_run` (the
pre-trained model, the methods, the runs, the step cost), `promptability_decoder_report`
(the summary and its table).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.promptability_decoder_config import Config  # noqa: E402


def define_flags():
    settings.define_program_flags(Config, "/tmp/tf_metaalign_promptability_decoder")


FLAGS = flags.FLAGS

#: What the program needs on the backend (a clear stop where one is not there yet).
NEEDS = (
    ("tf_metaalign.prompts", "prompt_causal_lm"),
    ("tf_metaalign.prompts", "causal_lm_score_fn"),
)


def main(argv):
    del argv
    from trainers import startup

    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)
    from trainers import common

    common.require_on_backend("trainers.promptability_decoder", NEEDS, backend)
    import warnings

    # keras-hub's CausalLM.fit makes a dataset of the arrays; Keras then warns that its
    # default shuffle=True is ignored (the order is drawn in `Method.train`).
    warnings.filterwarnings("ignore", message=r"`shuffle=True` was passed")

    config = settings.program_config(Config)
    try:
        out = common.prepare_output_dir(FLAGS.output_dir)
    except ValueError as e:
        raise app.UsageError(str(e))
    log = common.Progress()
    from trainers.promptability_decoder_report import format_report
    from trainers.promptability_decoder_run import run

    results = run(config, log)
    results["backend"] = backend
    print(format_report(results["summary"]))
    common.write_json(out / "results.json", results)
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
