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

Progress lines while it runs, the table at the end, `results.json` (every per-example
correctness, so every number can be recomputed) in `--output_dir`.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

CONFIGURATIONS = ("none", "mtl_t", "mtl_p", "mtl_tp", "fomaml", "reptile")
MODES = ("shallow", "deep")
#: Which weights each configuration trains in continued pre-training (None: no training).
TRAIN = {
    "none": None,
    "mtl_t": "transformer",
    "mtl_p": "prompt",
    "mtl_tp": "both",
    "fomaml": "both",
    "reptile": "both",
}
#: Configurations with no prompt of their own (zero-shot without one, few-shot fresh).
PROMPTLESS = ("none", "mtl_t")
OBJECTIVES = ("span_corruption", "lm_adaptation", "both")


@dataclasses.dataclass
class Config:
    """Everything a run depends on (the program's flags; tests build it directly)."""

    configurations: tuple = CONFIGURATIONS
    modes: tuple = MODES
    cache_dir: str = "/tmp/tf_metaalign_promptability_cache"
    seed: int = 0
    # 1. pre-training
    t5_size: str = "small"
    vocabulary_size: int = 4000
    corpus_max_texts: int = 0  # 0: the whole offline corpus
    pretrain_objective: str = "both"
    pretrain_steps: int = 200
    pretrain_batch_size: int = 32
    pretrain_sequence_length: int = 64
    pretrain_learning_rate: float = 1e-2
    # data
    max_train: int = 1000
    eval_examples: int = 48
    templates_per_dataset: int = 2  # 0: all
    mixture_cap: int = 500
    encoder_length: int = 48
    decoder_length: int = 8
    # 2. continued pre-training
    prompt_length: int = 20
    steps: int = 60
    batch_size: int = 16
    learning_rate: float = 1e-3
    meta_batch: int = 2
    inner_steps: int = 2
    task_batch_size: int = 4
    # 3. evaluation
    shots: int = 16
    few_shot_epochs: int = 5
    few_shot_batch_size: int = 8
    few_shot_learning_rate: float = 0.3
    bootstrap_resamples: int = 1000
    seen_examples: int = 48  # the positive control; 0: none
    fit_examples: int = 256  # later mixture draws: the end loss vs the label prior's
    # 5. MiniLM
    minilm: bool = True
    minilm_prompt_length: int = 20
    minilm_sequence_length: int = 48
    minilm_epochs: int = 30
    minilm_learning_rate: float = 1e-2
    log_every: int = 25

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
        for name in (
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
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        for name, zero in (
            ("corpus_max_texts", "all"),
            ("templates_per_dataset", "all"),
            ("seen_examples", "no control"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an integer >= 0 (0: {zero}); got {value!r}.")
        for name, low in (
            ("encoder_length", 4),
            ("decoder_length", 2),
            ("minilm_sequence_length", 3),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}; got {value!r}.")
        for name in (
            "pretrain_learning_rate",
            "learning_rate",
            "few_shot_learning_rate",
            "minilm_learning_rate",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0; got {getattr(self, name)!r}.")
        if self.shots > self.max_train:
            raise ValueError(f"`shots`={self.shots} exceeds `max_train`={self.max_train}.")
        if not self.cache_dir:
            raise ValueError("`cache_dir` is empty; give a folder for the pre-trained T5.")

    @property
    def meta_steps(self) -> int:
        """Meta-steps seeing as many examples as `steps` MTL batches (at least one)."""
        per_step = self.meta_batch * (self.inner_steps + 1) * self.task_batch_size
        return max(1, self.steps * self.batch_size // per_step)


def define_flags():
    """The program's flags (only when it runs as a program: tests import its functions)."""
    c = Config()
    flags.DEFINE_list(
        "configurations",
        list(c.configurations),
        f"Continued pre-training configurations ({', '.join(CONFIGURATIONS)}).",
    )
    flags.DEFINE_list("modes", list(c.modes), "Prompt modes (shallow, deep).")
    flags.DEFINE_string(
        "cache_dir",
        c.cache_dir,
        "Where the pre-trained T5 and its SentencePiece model are cached (by content hash).",
    )
    flags.DEFINE_integer("seed", c.seed, "Seed of data draws, prompt inits, few-shot samples.")
    flags.DEFINE_string("t5_size", c.t5_size, "small_t5.T5_SIZES name (tiny, small, base-ish).")
    flags.DEFINE_integer(
        "vocabulary_size", c.vocabulary_size, "SentencePiece pieces (100 sentinels included)."
    )
    flags.DEFINE_integer(
        "corpus_max_texts",
        c.corpus_max_texts,
        "A random subset of the offline corpus (0: all of it).",
    )
    flags.DEFINE_string(
        "pretrain_objective",
        c.pretrain_objective,
        "span_corruption, lm_adaptation or both (mixed).",
    )
    flags.DEFINE_integer("pretrain_steps", c.pretrain_steps, "Pre-training steps.")
    flags.DEFINE_integer("pretrain_batch_size", c.pretrain_batch_size, "Pre-training batch.")
    flags.DEFINE_integer(
        "pretrain_sequence_length",
        c.pretrain_sequence_length,
        "Pre-training encoder/decoder length.",
    )
    flags.DEFINE_float(
        "pretrain_learning_rate", c.pretrain_learning_rate, "Adafactor.t5 rate in pre-training."
    )
    flags.DEFINE_integer("max_train", c.max_train, "Training examples per prompted dataset.")
    flags.DEFINE_integer(
        "eval_examples", c.eval_examples, "Evaluation examples per unseen dataset (its test split)."
    )
    flags.DEFINE_integer(
        "templates_per_dataset", c.templates_per_dataset, "Templates per unseen dataset (0: all)."
    )
    flags.DEFINE_integer("mixture_cap", c.mixture_cap, "Examples-proportional mixing cap.")
    flags.DEFINE_integer("encoder_length", c.encoder_length, "Encoder tokens (EOS included).")
    flags.DEFINE_integer("decoder_length", c.decoder_length, "Target tokens (EOS included).")
    flags.DEFINE_integer("prompt_length", c.prompt_length, "L (20 in the paper).")
    flags.DEFINE_integer("steps", c.steps, "MTL continued pre-training steps.")
    flags.DEFINE_integer("batch_size", c.batch_size, "MTL batch size.")
    flags.DEFINE_float(
        "learning_rate",
        c.learning_rate,
        "Adafactor rate of continued pre-training (outer and inner).",
    )
    flags.DEFINE_integer("meta_batch", c.meta_batch, "Tasks per meta-step.")
    flags.DEFINE_integer("inner_steps", c.inner_steps, "Prompt-only inner steps per task.")
    flags.DEFINE_integer(
        "task_batch_size", c.task_batch_size, "Examples per support and query batch."
    )
    flags.DEFINE_integer("shots", c.shots, "Few-shot training examples.")
    flags.DEFINE_integer(
        "few_shot_epochs", c.few_shot_epochs, "Prompt-tuning epochs (100 in the paper)."
    )
    flags.DEFINE_integer("few_shot_batch_size", c.few_shot_batch_size, "Prompt-tuning batch.")
    flags.DEFINE_float(
        "few_shot_learning_rate",
        c.few_shot_learning_rate,
        "Adafactor rate of few-shot prompt tuning.",
    )
    flags.DEFINE_integer("bootstrap_resamples", c.bootstrap_resamples, "Bootstrap resamples.")
    flags.DEFINE_integer(
        "seen_examples",
        c.seen_examples,
        "The positive control: zero-shot "
        "on this many held-out test examples of each TRAINING dataset (at "
        "most eval_examples; 0: no control): did continued pre-training "
        "learn its own tasks?",
    )
    flags.DEFINE_integer(
        "fit_examples",
        c.fit_examples,
        "After each continued "
        "pre-training, its loss on this many later draws of the training "
        "mixture, beside the loss of knowing only each template's answers.",
    )
    flags.DEFINE_bool("minilm", c.minilm, "Also the MiniLM shallow-prompt experiment.")
    flags.DEFINE_integer("minilm_prompt_length", c.minilm_prompt_length, "MiniLM prompt L.")
    flags.DEFINE_integer("minilm_epochs", c.minilm_epochs, "MiniLM few-shot epochs.")
    flags.DEFINE_float("minilm_learning_rate", c.minilm_learning_rate, "MiniLM Adam rate.")
    flags.DEFINE_integer("log_every", c.log_every, "Steps between progress lines.")
    flags.DEFINE_bool(
        "full",
        False,
        "The long run (FULL_RUN: more pre-training, continued "
        "pre-training, evaluation examples, all templates, 100 epochs).",
    )
    flags.DEFINE_string("output_dir", "/tmp/tf_metaalign_promptability", "Where results go.")


FLAGS = flags.FLAGS

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


def config_from_flags() -> Config:
    from trainers import common

    converted = dict(configurations=tuple(FLAGS.configurations), modes=tuple(FLAGS.modes))
    return common.config_from_flags(Config, FLAGS, converted, FULL_RUN if FLAGS.full else None)


# --------------------------------------------------------------------------- 1. pre-training


def pretrained_t5(config: Config, log=None):
    """`(model, tokenizer, info)`: the cached pre-trained `T5Seq2SeqLM` (trained on a miss,
    with a progress line through `log` every `log_every` steps)."""
    from trainers.experiments import small_t5
    from trainers.experiments import text_pretraining as tp
    from trainers import common

    callbacks = (
        ()
        if log is None
        else (
            common.ProgressCallback(
                log,
                "pre-training",
                config.pretrain_steps,
                min(config.log_every, config.pretrain_steps),
            ),
        )
    )

    corpus = tp.english_corpus(max_texts=config.corpus_max_texts or None, seed=config.seed)
    return small_t5.cached_pretrained_t5(
        config.cache_dir,
        corpus,
        size=config.t5_size,
        vocabulary_size=config.vocabulary_size,
        objective=config.pretrain_objective,
        steps=config.pretrain_steps,
        batch_size=config.pretrain_batch_size,
        sequence_length=config.pretrain_sequence_length,
        learning_rate=config.pretrain_learning_rate,
        seed=config.seed,
        progress=False,
        callbacks=callbacks,
    )


class Tokenize:
    """`text -> ids` for rank classification: the tokenizer's ids cut to `length - 1`, then
    EOS (the encoder input as in training; a choice's target with its EOS). Memoised."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer, self.length, self.cache = tokenizer, length, {}

    def prefill(self, texts):
        import numpy as np

        from tf_metaalign.prompts.t5_lm import EOS_ID

        texts = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if texts:
            for text, ids in zip(texts, self.tokenizer(texts)):
                self.cache[text] = [int(i) for i in np.asarray(ids).reshape(-1)][
                    : self.length - 1
                ] + [EOS_ID]

    def __call__(self, text):
        if text not in self.cache:
            self.prefill([text])
        return self.cache[text]


# --------------------------------------------------------------------------------- data


@dataclasses.dataclass
class Tasks:
    training: dict  # name -> PromptedDataset
    evaluation: dict
    pairs: dict  # (dataset, template) -> (train PromptedExamples, test PromptedExamples)
    num_choices: dict  # dataset -> C
    # The positive control: the TRAINING datasets' held-out test examples, as `pairs`
    # (`Config.seen_examples` of each; empty when it is 0).
    seen_pairs: dict = dataclasses.field(default_factory=dict)
    seen_num_choices: dict = dataclasses.field(default_factory=dict)

    def nested(self) -> dict:
        """`pairs` as `few_shot_prompt_tuning` takes them: {dataset: {template: pair}}."""
        out = {}
        for (dataset, template), pair in self.pairs.items():
            out.setdefault(dataset, {})[template] = pair
        return out


def prepare_tasks(config: Config) -> Tasks:
    import numpy as np

    from trainers.experiments import prompted_tasks as PT
    from tf_metaalign.prompts.evaluation import sample_few_shot

    datasets = PT.offline_prompted_tasks(
        max_train=config.max_train, max_test=config.eval_examples, seed=config.seed
    )
    training, evaluation = PT.split_by_task_type(datasets)

    def pairs(chosen, limit=None):
        out = {}
        for name, dataset in chosen.items():
            train, test = dataset.prompted("train"), dataset.prompted("test")
            keep = np.arange(len(dataset.test))
            if limit is not None and limit < len(keep):
                # A seeded sample (the same for every template), not the first `limit`:
                # test splits are ordered by class (the first 48 of Django's component test
                # split are all "core").
                keep = sample_few_shot(len(keep), limit, config.seed, name, "control")
            for t in dataset.templates[: config.templates_per_dataset or None]:
                out[(name, t.name)] = (train[t.name], [test[t.name][i] for i in keep])
        return out

    seen = training if config.seen_examples else {}
    return Tasks(
        training,
        evaluation,
        pairs(evaluation),
        {n: d.num_choices for n, d in evaluation.items()},
        pairs(seen, config.seen_examples),
        {n: d.num_choices for n, d in seen.items()},
    )


def training_mixture(tasks: Tasks, config: Config):
    """The training datasets' prompted mixture (size-proportional, capped), seeded: the one
    stream that MTL batches, meta-learning tasks and the fit draws all come from."""
    from trainers.experiments.prompted_tasks import PromptedMixture

    return PromptedMixture(tasks.training, cap=config.mixture_cap, seed=config.seed)


def mtl_batches(tasks: Tasks, config: Config, tokenizer):
    """The continued pre-training stream for MTL: `steps x batch_size` mixture draws."""
    from tf_metaalign.prompts.t5_lm import encode_examples

    mixture = training_mixture(tasks, config)
    return encode_examples(
        mixture.take(config.steps * config.batch_size),
        tokenizer,
        config.encoder_length,
        config.decoder_length,
    )


def fit_draws(tasks: Tasks, config: Config) -> list:
    """`config.fit_examples` draws `(dataset, template, input_text, target_text)` of the
    training mixture right after the MTL stream's: more examples of the same distribution
    (training-split examples, as the stream's are), not seen in this order."""
    return training_mixture(tasks, config).take(
        config.fit_examples, start=config.steps * config.batch_size, with_names=True
    )


def label_prior_loss(draws, tasks: Tasks, target_ids) -> float:
    """Nats per target token of the predictor that knows each (dataset, template)'s
    distribution of target texts over its training split and nothing of the input:
    `sum -log p(target) / sum tokens` over `draws`, the tokens counted in `target_ids`, the
    draws' targets as `encode_examples` gives them (cut as in training, EOS included, 0 =
    padding), so that it divides by the same count as the models' `token_loss`.

    The reference for the continued pre-training loss: a model at or above it has learned
    the answer priors at best, nothing that rank classification could read from an input."""
    import collections
    import math

    import numpy as np

    priors = {}
    for name, dataset in tasks.training.items():
        train = dataset.prompted("train")
        for template in dataset.templates:
            counts = collections.Counter(e.target_text for e in train[template.name])
            total = sum(counts.values())
            priors[(name, template.name)] = {t: c / total for t, c in counts.items()}
    nll = -sum(math.log(priors[(name, template)][target]) for name, template, _, target in draws)
    return nll / float(np.count_nonzero(target_ids))


def token_loss(lm, x, y, batch_size: int = 64) -> float:
    """`lm`'s mean target-token cross-entropy over ALL of `(x, y)` (`encode_examples`):
    summed over the real tokens and divided by their count once, where Keras's `evaluate`
    would average per-batch means."""
    import numpy as np

    from tf_metaalign.prompts.evaluation import token_log_likelihoods

    nll = tokens = 0.0
    for start in range(0, len(y), batch_size):
        sl = slice(start, start + batch_size)
        logits = lm({k: v[sl] for k, v in x.items()})
        real = y[sl] != 0
        nll -= float(np.sum(np.where(real, token_log_likelihoods(logits, y[sl]).numpy(), 0)))
        tokens += float(real.sum())
    return nll / tokens


def meta_batches(tasks: Tasks, config: Config, tokenizer):
    """`((support_x [M, S, N, ...], support_y, query_x [M, N, ...]), query_y)` for
    `meta_steps * meta_batch` tasks (M). Task k is the dataset and template of the mixture's
    draw k (so tasks follow the mixing rates); its support and query examples are distinct
    training examples of that dataset under that template."""
    import numpy as np

    from tf_metaalign.prompts.t5_lm import encode_examples

    mixture = training_mixture(tasks, config)
    s, n = config.inner_steps, config.task_batch_size
    examples = []
    count = config.meta_steps * config.meta_batch
    for k in range(count):
        name, _, template_name = mixture.draw(k)
        dataset = tasks.training[name]
        template = next(t for t in dataset.templates if t.name == template_name)
        rng = np.random.default_rng([config.seed, 1, k])
        rows = rng.choice(
            len(dataset.train), size=(s + 1) * n, replace=(s + 1) * n > len(dataset.train)
        )
        examples += [template.apply(dataset.train[i]) for i in rows]
    x, y = encode_examples(examples, tokenizer, config.encoder_length, config.decoder_length)

    def shape(a, query):
        a = a.reshape((count, s + 1, n) + a.shape[1:])
        return a[:, s] if query else a[:, :s]

    support_x = {k: shape(v, False) for k, v in x.items()}
    query_x = {k: shape(v, True) for k, v in x.items()}
    return (support_x, shape(y, False), query_x), shape(y, True)


# ------------------------------------------------------------------- 2. continued pre-training


def _optimizer(learning_rate, clip=True):
    from tf_metaalign.trainers.prompt_meta import default_adafactor

    # The paper: Adafactor at 1e-3 (HF settings), the gradient clipped at global norm 1.0.
    return default_adafactor(learning_rate, **({"global_clipnorm": 1.0} if clip else {}))


def build_prompted(backbone, config: Config, mode: str, train: str, length=None):
    from tf_metaalign import prompts
    from tf_metaalign.prompts.t5_lm import PromptedT5LM

    prompted = prompts.prompt_t5(
        backbone,
        config.prompt_length if length is None else length,
        mode,
        train=train,
        seed=config.seed,
    )
    return prompted, PromptedT5LM(prompted)


def continued_pretraining(
    configuration: str, mode: str, backbone, data, config: Config, log=print
) -> dict:
    """Trains `backbone` in place (and a new prompt) as `configuration` says; returns the
    run's record with the prompt values (None for mtl_t), `mean_loss` (Keras's loss of the
    run: the mean over ALL its steps, not the last one) and, when `data` has "fit" (an
    `encode_examples` pair), `end_loss`: the trained model's `token_loss` on it."""
    import numpy as np

    from tf_metaalign.prompts.t5_lm import masked_token_loss
    from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer, PromptReptileTrainer
    from trainers import common

    train = TRAIN[configuration]
    length = 0 if configuration == "mtl_t" else config.prompt_length
    prompted, lm = build_prompted(backbone, config, mode, train, length)
    start = time.perf_counter()
    name = f"{configuration}/{mode}" if configuration != "mtl_t" else configuration
    if configuration in ("fomaml", "reptile"):
        (sx, sy, qx), qy = data["meta"]
        lm({k: v[0, 0] for k, v in sx.items()})  # build (the trainer's state needs it)
        cls = PromptFOMAMLTrainer if configuration == "fomaml" else PromptReptileTrainer
        model = cls(
            lm,
            prompt_variables=list(prompted.prompt_variables),
            inner_steps=config.inner_steps,
            inner_optimizer=_optimizer(config.learning_rate, clip=False),
        )
        import tensorflow as tf

        batches = tf.data.Dataset.from_tensor_slices(((sx, sy, qx), qy)).batch(
            config.meta_batch, drop_remainder=True
        )
        steps, examples = (
            config.meta_steps,
            qy.shape[0] * (config.inner_steps + 1) * config.task_batch_size,
        )
        fit_args = dict(x=batches, shuffle=False)
    else:
        model = lm
        x, y = data["mtl"]
        steps, examples = config.steps, len(y)
        fit_args = dict(x=x, y=y, batch_size=config.batch_size, shuffle=False)
    model.compile(
        optimizer=_optimizer(config.learning_rate), loss=masked_token_loss(), jit_compile=False
    )
    progress = common.ProgressCallback(
        log, name, steps, max(1, config.log_every * steps // config.steps)
    )
    history = model.fit(**fit_args, epochs=1, verbose=0, callbacks=[progress])
    seconds = time.perf_counter() - start
    prompt = (
        [np.array(v.numpy()) for v in prompted.prompt_variables]
        if configuration != "mtl_t"
        else None
    )
    return {
        "configuration": configuration,
        "mode": mode if configuration != "mtl_t" else None,
        "steps": steps,
        "examples": int(examples),
        "mean_loss": float(history.history["loss"][-1]),
        "prompt": prompt,
        "end_loss": token_loss(lm, *data["fit"]) if "fit" in data else None,
        "seconds": seconds,
    }


# ---------------------------------------------------------------------------- 3. evaluation


class FreshOptimizerState:
    """Puts an optimizer back to its state as first built, before each few-shot run.

    Restores EVERY optimizer variable to its value after `build`: the slots and the step
    count, and also the hyperparameter variables Keras keeps among `optimizer.variables`
    (the learning rate; this package's `learning_rate_scale`). Zeroing them all, as a
    first version did, set the learning rate to 0 and no few-shot run trained."""

    def __init__(self, optimizer, variables):
        optimizer.build(variables)
        self.optimizer = optimizer
        self.values = [v.numpy() for v in optimizer.variables]

    def __call__(self):
        for variable, value in zip(self.optimizer.variables, self.values):
            variable.assign(value)


class Evaluator:
    """One prompted model per mode on ONE backbone, traced once: rank classification and
    few-shot prompt tuning for any (transformer weights, prompt) assigned to it."""

    def __init__(self, backbone, config: Config, tokenize: Tokenize, mode: str, length: int):
        import tensorflow as tf

        from tf_metaalign import prompts
        from tf_metaalign.prompts.t5_lm import masked_token_loss

        self.config, self.tokenize, self.mode = config, tokenize, mode
        self.prompted, self.lm = build_prompted(backbone, config, mode, "prompt", length)
        self.lm.compile(
            optimizer=_optimizer(config.few_shot_learning_rate),
            loss=masked_token_loss(),
            jit_compile=False,
        )
        self.fresh_optimizer_state = FreshOptimizerState(
            self.lm.optimizer, self.lm.trainable_variables
        )
        prompted = self.prompted

        @tf.function(
            input_signature=[tf.TensorSpec([None, None], tf.int32)] * 3, reduce_retracing=True
        )
        def log_likelihoods(inputs, targets, mask):
            return prompts.t5_token_log_likelihoods(prompted, inputs, inputs != 0, targets, mask)

        self._log_likelihoods = log_likelihoods

    def score_fn(self, inputs, targets, mask):
        import numpy as np

        return self._log_likelihoods(
            np.asarray(inputs, np.int32), np.asarray(targets, np.int32), np.asarray(mask, np.int32)
        ).numpy()

    def correctness(self, examples):
        """Per-example 0/1 correctness of rank classification (mean log-likelihood)."""
        from tf_metaalign.prompts import rank_classify_examples

        predictions, _, labels = rank_classify_examples(
            self.score_fn, self.tokenize, examples, eos_id=None, reduction="mean", batch_size=256
        )
        return (predictions == labels).astype("int64")

    def fresh_prompt(self, seed: int):
        """The reference's initial prompt: vocabulary rows (shallow), N(0, 1) (deep)."""
        import numpy as np

        from tf_metaalign.prompts import storage

        if self.mode == "shallow":
            table = self.prompted.backbone.token_embedding.embeddings.numpy()
            return [storage.vocabulary_rows_init(table, self.prompted.length, 5000, seed)]
        rng = np.random.default_rng(seed)
        return [
            rng.standard_normal(v.shape).astype(v.dtype) for v in self.prompted.prompt_variables
        ]

    def set_prompt(self, values):
        for variable, value in zip(self.prompted.prompt_variables, values):
            variable.assign(value)

    def tune(self, examples, epochs: int):
        """Prompt tuning from the assigned prompt with a fresh optimizer state (as first
        built: `FreshOptimizerState`). Keras shuffles with the
        global seed, which the caller sets per (dataset, template)."""
        from tf_metaalign.prompts.t5_lm import encode_examples

        self.fresh_optimizer_state()
        x, y = encode_examples(
            examples,
            self.tokenize.tokenizer,
            self.config.encoder_length,
            self.config.decoder_length,
        )
        self.lm.fit(
            x, y, batch_size=self.config.few_shot_batch_size, epochs=epochs, verbose=0, shuffle=True
        )


def evaluate_configuration(
    configuration, evaluators, weights, prompts_by_mode, tasks: Tasks, config: Config, log=print
) -> dict:
    """Zero-shot and few-shot correctness of one configuration, per mode (and zero-shot
    on the training datasets' test examples, "seen_zero_shot", when `tasks` has them)."""
    import keras

    from tf_metaalign.prompts import evaluation as E

    zero_shot_sets = {"zero_shot": tasks.pairs}
    if tasks.seen_pairs:
        zero_shot_sets["seen_zero_shot"] = tasks.seen_pairs
    out = {setting: {} for setting in zero_shot_sets} | {"few_shot": {}}
    plain = None
    for mode in config.modes:
        evaluator = evaluators[mode]
        evaluator.prompted.backbone.set_weights(weights)
        learned = prompts_by_mode.get(mode)
        start = time.perf_counter()
        if learned is not None:
            evaluator.set_prompt(learned)
            zero = {
                s: {k: evaluator.correctness(test) for k, (_, test) in pairs.items()}
                for s, pairs in zero_shot_sets.items()
            }
        elif plain is None:  # no prompt of its own: the plain model, the same in every mode
            plain = zero = {
                s: {k: evaluators["plain"].correctness(test) for k, (_, test) in pairs.items()}
                for s, pairs in zero_shot_sets.items()
            }
        else:
            zero = plain
        for setting, per_pair in zero.items():
            out[setting][mode] = per_pair
        fresh_seed = [config.seed, 2]

        def build(dataset, template):
            keras.utils.set_random_seed(E.stable_seed(config.seed, dataset, template)[0] % 2**31)
            evaluator.set_prompt(
                learned if learned is not None else evaluator.fresh_prompt(fresh_seed)
            )
            return evaluator

        def train(model, examples, epochs):
            model.tune(examples, epochs)

        def evaluate(model, examples):
            return model.correctness(examples)

        few = E.few_shot_prompt_tuning(
            tasks.nested(),
            build,
            train,
            evaluate,
            config.shots,
            config.few_shot_epochs,
            config.seed,
        )
        out["few_shot"][mode] = {k: r.correct.astype("int64") for k, r in few.items()}
        seen = (
            ""
            if not tasks.seen_pairs
            else "  seen-task zero-shot ARG "
            + format(
                E.average_relative_gain(out["seen_zero_shot"][mode], tasks.seen_num_choices), "+.3f"
            )
        )
        unseen = E.average_relative_gain(zero["zero_shot"], tasks.num_choices)
        log(
            f"{configuration}/{mode}: zero-shot ARG {unseen:+.3f}  few-shot ARG "
            f"{E.average_relative_gain(out['few_shot'][mode], tasks.num_choices):+.3f}{seen}  "
            f"({time.perf_counter() - start:.0f} s)"
        )
    return out


def majority_correctness(pairs: dict) -> dict:
    """`{pair: 0/1 array}` of always answering the pair's most frequent TRAINING label (the
    first such label on a tie): the reference for ARG on imbalanced many-choice tasks, where
    a constant answer alone can score far above chance."""
    import numpy as np

    out = {}
    for key, (train, test) in pairs.items():
        labels, counts = np.unique([e.label for e in train], return_counts=True)
        answer = labels[np.argmax(counts)]
        out[key] = np.asarray([e.label == answer for e in test], "int64")
    return out


# ------------------------------------------------------------------------------- 4. ARG


def _key(pair) -> str:
    return f"{pair[0]}/{pair[1]}"


def _unkey(key: str) -> tuple:
    return tuple(key.split("/", 1))


SETTING_LABELS = {"zero_shot": "0-shot", "few_shot": "16-shot", "seen_zero_shot": "seen 0-shot"}


def arg_table(
    correct: dict,
    num_choices: dict,
    configurations,
    modes,
    resamples: int = 1000,
    seed: int = 0,
    settings=("zero_shot", "few_shot"),
    majority: dict | None = None,
) -> list[dict]:
    """One row per configuration: ARG of every (setting, mode) column, and the paired
    bootstrap p-values ("better than none"; for mtl_tp also "better than mtl_t"; with
    `majority`, every cell's "better than always answering the training majority").

    `correct[configuration][setting][mode]` = `{(dataset, template): 0/1 array}`;
    `num_choices` the answer-choice counts of the datasets of `settings`; `majority` the
    `majority_correctness` of the same pairs (the positive control's bar: on imbalanced
    tasks a constant answer scores far above chance)."""
    from tf_metaalign.prompts import evaluation as E

    rows = []
    for configuration in configurations:
        row = {"configuration": configuration}
        for setting in settings:
            for mode in modes:
                column = f"{setting}_{mode}"
                mine = correct[configuration][setting][mode]
                row[column] = E.average_relative_gain(mine, num_choices)
                for other in ("none", "mtl_t"):
                    if (
                        other == configuration
                        or other not in correct
                        or (other == "mtl_t" and configuration != "mtl_tp")
                    ):
                        continue
                    test = E.paired_bootstrap_arg(
                        mine, correct[other][setting][mode], num_choices, resamples, seed
                    )
                    row[f"{column}_p_vs_{other}"] = test.p_value
                if majority is not None:
                    row[f"{column}_p_vs_majority"] = E.paired_bootstrap_arg(
                        mine, majority, num_choices, resamples, seed
                    ).p_value
        rows.append(row)
    return rows


def format_arg_table(rows, modes, settings=("zero_shot", "few_shot")) -> str:
    from trainers import common

    cells, columns = [], [("configuration", "configuration", "s")]
    for setting in settings:
        for mode in modes:
            columns.append((f"{setting}_{mode}", f"{SETTING_LABELS[setting]} {mode}", "s"))
    for row in rows:
        cell = {"configuration": row["configuration"]}
        for key, _, _ in columns[1:]:
            text = f"{row[key]:+.3f}"
            if f"{key}_p_vs_none" in row:
                text += f" (p={row[f'{key}_p_vs_none']:.2f})"
            if f"{key}_p_vs_mtl_t" in row:
                text += f" [vs mtl_t p={row[f'{key}_p_vs_mtl_t']:.2f}]"
            if f"{key}_p_vs_majority" in row:
                text += f" {{vs majority p={row[f'{key}_p_vs_majority']:.2f}}}"
            cell[key] = text
        cells.append(cell)
    return common.format_table(cells, columns)


# ---------------------------------------------------------------------------- 5. MiniLM


def minilm_experiment(tasks: Tasks, config: Config, log=print) -> dict:
    """Frozen MiniLM: 16-shot prompt tuning + a linear head vs the head alone, on the
    unseen tasks (the template's input text -> the label as a class)."""
    import keras
    import numpy as np

    from tf_metaalign import prompts
    from trainers.experiments import text_encoder as TE
    from tf_metaalign.prompts import evaluation as E

    tokenizer, backbone = TE.load_minilm_tokenizer(), TE.load_minilm_backbone()
    classes = max(tasks.num_choices.values())

    class Classifier(keras.Model):
        """Prompted MiniLM -> masked mean of the token outputs -> linear head."""

        def __init__(self, length):
            super().__init__()
            self.prompted = prompts.prompt_bert(backbone, length, train="prompt", seed=config.seed)
            self.head = keras.layers.Dense(classes)

        def call(self, x, training=False):
            seq = self.prompted(x, training=training)["sequence_output"]
            mask = keras.ops.cast(x["padding_mask"], seq.dtype)[..., None]
            pooled = keras.ops.sum(seq * mask, 1) / keras.ops.maximum(keras.ops.sum(mask, 1), 1)
            return self.head(pooled)

    def inputs(examples):
        return TE.tokenize(
            [e.input_text for e in examples], tokenizer, config.minilm_sequence_length
        )

    out, runs = {}, {}
    for variant, length in (("prompt+head", config.minilm_prompt_length), ("head", 0)):
        model = Classifier(length)
        model(inputs(next(iter(tasks.pairs.values()))[0][:2]))
        initial = [v.numpy() for v in model.trainable_variables]
        model.compile(
            optimizer=keras.optimizers.Adam(config.minilm_learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        fresh_optimizer_state = FreshOptimizerState(model.optimizer, model.trainable_variables)
        start = time.perf_counter()

        def build(
            dataset,
            template,
            model=model,
            initial=initial,
            fresh_optimizer_state=fresh_optimizer_state,
        ):
            keras.utils.set_random_seed(E.stable_seed(config.seed, dataset, template)[0] % 2**31)
            for v, value in zip(model.trainable_variables, initial):
                v.assign(value)
            fresh_optimizer_state()
            return model

        def train(model, examples, epochs):
            y = np.asarray([e.label for e in examples])
            model.fit(
                inputs(examples), y, batch_size=config.few_shot_batch_size, epochs=epochs, verbose=0
            )

        def evaluate(model, examples):
            logits = model.predict(inputs(examples), batch_size=128, verbose=0)
            return (np.argmax(logits, -1) == np.asarray([e.label for e in examples])).astype(
                "int64"
            )

        before = [w.numpy().copy() for w in backbone.weights]
        results = E.few_shot_prompt_tuning(
            tasks.nested(), build, train, evaluate, config.shots, config.minilm_epochs, config.seed
        )
        frozen = all(np.array_equal(w.numpy(), b) for w, b in zip(backbone.weights, before))
        runs[variant] = {k: r.correct.astype("int64") for k, r in results.items()}
        out[variant] = {
            "arg": E.average_relative_gain(runs[variant], tasks.num_choices),
            "encoder_bit_identical": frozen,
            "seconds": time.perf_counter() - start,
            "correct": {_key(k): v for k, v in runs[variant].items()},
        }
        log(
            f"MiniLM {variant}: 16-shot ARG {out[variant]['arg']:+.3f} "
            f"({out[variant]['seconds']:.0f} s)"
        )
    test = E.paired_bootstrap_arg(
        runs["prompt+head"],
        runs["head"],
        tasks.num_choices,
        config.bootstrap_resamples,
        config.seed,
    )
    out["p_prompt_better_than_head"] = test.p_value
    return out


# ------------------------------------------------------------------------------- the run


def run(config: Config, log=print):
    """The whole pipeline. Returns `(results, weights)`: `results` is what results.json
    holds; `weights` the pre-trained transformer weights ("pretrained") and those after each
    continued pre-training ("<configuration>/<mode>", "mtl_t"), as NumPy arrays."""
    import numpy as np

    from tf_metaalign.prompts import evaluation as E
    from tf_metaalign.prompts.t5_lm import encode_examples

    config.check()
    started = time.perf_counter()
    load_start = os.getloadavg()
    timings = {}
    log(
        f"pre-training a {config.t5_size} T5 ({config.pretrain_objective}, "
        f"{config.pretrain_steps} steps) or loading it from {config.cache_dir}"
    )
    t5, tokenizer, info = pretrained_t5(config, log)
    backbone = t5.backbone
    pretrained = [np.array(w) for w in backbone.get_weights()]
    timings["pretraining"] = time.perf_counter() - started
    log(
        f"T5 {'loaded from the cache' if info['cached'] else 'pre-trained'} "
        f"({backbone.count_params():,} parameters, vocabulary {backbone.vocabulary_size}) in "
        f"{timings['pretraining']:.0f} s"
    )
    t = time.perf_counter()
    tasks = prepare_tasks(config)
    tokenize = Tokenize(tokenizer, config.encoder_length)
    texts = [
        text
        for train, test in tasks.pairs.values()
        for e in list(train) + list(test)
        for text in (e.input_text,) + tuple(e.answer_choices)
    ]
    texts += [
        text
        for _, test in tasks.seen_pairs.values()
        for e in test
        for text in (e.input_text,) + tuple(e.answer_choices)
    ]
    tokenize.prefill(texts)
    data = {"mtl": mtl_batches(tasks, config, tokenizer)}
    if {"fomaml", "reptile"} & set(config.configurations):
        data["meta"] = meta_batches(tasks, config, tokenizer)
    draws = fit_draws(tasks, config)
    data["fit"] = encode_examples(
        [d[2:] for d in draws], tokenizer, config.encoder_length, config.decoder_length
    )
    fit = {
        "examples": len(draws),
        "label_prior_loss": label_prior_loss(draws, tasks, data["fit"][1]),
        "pretrained_loss": token_loss(
            build_prompted(backbone, config, "shallow", "prompt", 0)[1], *data["fit"]
        ),
    }
    timings["data"] = time.perf_counter() - t
    control = f", {len(tasks.seen_pairs)} seen-task control pairs" if tasks.seen_pairs else ""
    log(
        f"{len(tasks.training)} training datasets, {len(tasks.evaluation)} unseen datasets, "
        f"{len(tasks.pairs)} evaluation (dataset, template) pairs{control}; data in "
        f"{timings['data']:.0f} s"
    )
    log(
        f"loss on {fit['examples']} later mixture draws (nats per target token): knowing only "
        f"each template's answers {fit['label_prior_loss']:.3f}; the pre-trained T5 "
        f"{fit['pretrained_loss']:.3f}"
    )

    # Continued pre-training: every run from the pre-trained weights.
    weights = {"pretrained": pretrained}
    continued, learned_prompts = [], {}
    t = time.perf_counter()
    for configuration in config.configurations:
        if configuration == "none":
            continue
        for mode in config.modes if configuration != "mtl_t" else (None,):
            backbone.set_weights(pretrained)
            record = continued_pretraining(
                configuration, mode or config.modes[0], backbone, data, config, log
            )
            key = configuration if mode is None else f"{configuration}/{mode}"
            weights[key] = [np.array(w) for w in backbone.get_weights()]
            record["transformer_max_abs_change"] = float(
                max(
                    np.max(np.abs(a - b)) if a.size else 0.0
                    for a, b in zip(weights[key], pretrained)
                )
            )
            if mode is not None:
                learned_prompts.setdefault(configuration, {})[mode] = record["prompt"]
            record.pop("prompt")
            continued.append(record)
            log(
                f"{key}: {record['steps']} steps, {record['examples']} examples, loss "
                f"{record['mean_loss']:.3f} over the run, {record['end_loss']:.3f} at its end "
                f"(answer priors alone {fit['label_prior_loss']:.3f}), transformer max |change| "
                f"{record['transformer_max_abs_change']:.3g} ({record['seconds']:.0f} s)"
            )
    timings["continued_pretraining"] = time.perf_counter() - t

    # Evaluation: one evaluator per mode (+ a prompt-free one), each traced once.
    t = time.perf_counter()
    backbone.set_weights(pretrained)
    evaluators = {
        mode: Evaluator(backbone, config, tokenize, mode, config.prompt_length)
        for mode in config.modes
    }
    evaluators["plain"] = Evaluator(backbone, config, tokenize, "shallow", 0)
    correct = {}
    for configuration in config.configurations:
        if configuration in PROMPTLESS:
            transformer = pretrained if configuration == "none" else weights["mtl_t"]
            correct[configuration] = evaluate_configuration(
                configuration, evaluators, transformer, {}, tasks, config, log
            )
            continue
        # A prompt configuration has one transformer (and prompt) per mode.
        correct[configuration] = {}
        for mode in config.modes:
            part = evaluate_configuration(
                configuration,
                evaluators,
                weights[f"{configuration}/{mode}"],
                {mode: learned_prompts[configuration][mode]},
                tasks,
                dataclasses.replace(config, modes=(mode,)),
                log,
            )
            for setting in part:
                correct[configuration].setdefault(setting, {}).update(part[setting])
    timings["evaluation"] = time.perf_counter() - t
    backbone.set_weights(pretrained)

    rows = arg_table(
        correct,
        tasks.num_choices,
        config.configurations,
        config.modes,
        config.bootstrap_resamples,
        config.seed,
    )
    majority = majority_correctness(tasks.seen_pairs) if tasks.seen_pairs else None
    seen_rows = (
        arg_table(
            correct,
            tasks.seen_num_choices,
            config.configurations,
            config.modes,
            config.bootstrap_resamples,
            config.seed,
            settings=("seen_zero_shot",),
            majority=majority,
        )
        if tasks.seen_pairs
        else None
    )
    minilm = None
    if config.minilm:
        t = time.perf_counter()
        minilm = minilm_experiment(tasks, config, log)
        timings["minilm"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - started
    results = {
        "config": dataclasses.asdict(config),
        "pretraining": {k: info.get(k) for k in ("key", "settings", "cached", "history")},
        "t5_parameters": int(backbone.count_params()),
        "evaluation_pairs": [_key(k) for k in tasks.pairs],
        "num_choices": tasks.num_choices,
        "chance": {d: 1.0 / c for d, c in tasks.num_choices.items()},
        "continued_pretraining": continued,
        # The fit of continued pre-training: `label_prior_loss` and the pre-trained model's
        # loss on `examples` later mixture draws (each record's `end_loss` is on the same).
        "fit": fit,
        "correct": {
            c: {
                s: {m: {_key(k): v for k, v in per.items()} for m, per in by_setting.items()}
                for s, by_setting in settings.items()
            }
            for c, settings in correct.items()
        },
        "accuracy": {
            c: {
                s: {
                    m: {_key(k): float(np.mean(v)) for k, v in per.items()}
                    for m, per in by_setting.items()
                }
                for s, by_setting in settings.items()
            }
            for c, settings in correct.items()
        },
        "arg_table": rows,
        # The positive control (None when `seen_examples` is 0): zero-shot on held-out test
        # examples of the training datasets; its per-example correctness is
        # correct[configuration]["seen_zero_shot"].
        "seen_pairs": [_key(k) for k in tasks.seen_pairs],
        "seen_num_choices": tasks.seen_num_choices,
        "seen_arg_table": seen_rows,
        "seen_majority_arg": (
            E.average_relative_gain(majority, tasks.seen_num_choices) if tasks.seen_pairs else None
        ),
        "minilm": minilm,
        "timings_seconds": timings,
        "load_average": {
            "start": list(load_start),
            "end": list(os.getloadavg()),
            "cpus": os.cpu_count(),
        },
    }
    return results, weights


def main(argv):
    del argv
    import warnings

    from trainers import startup

    startup.start_tensorflow()  # before anything imports TensorFlow: no start-up chatter
    from trainers import common

    # keras-hub's T5 layers receive Keras masks they do not use (T5 takes explicit padding
    # masks, which the prompted model extends): the warning says nothing about this run.
    warnings.filterwarnings(
        "ignore",
        message=r"Layer '(self|cross)_attention' \(of type "
        r"T5MultiHeadAttention\) was passed an input with a mask",
    )

    try:
        config = config_from_flags()
        out = common.prepare_output_dir(FLAGS.output_dir)
    except ValueError as e:
        raise app.UsageError(str(e))
    log = common.Progress()
    results, _ = run(config, log)
    print()
    print(
        f"Average Relative Gain over chance on the unseen tasks "
        f"({', '.join(results['num_choices'])}; {len(results['evaluation_pairs'])} "
        f"dataset-template pairs); (p) = paired bootstrap p-value of 'better than none', "
        f"[vs mtl_t] for mtl_tp; none/mtl_t 0-shot use no prompt (same in both modes):"
    )
    print(format_arg_table(results["arg_table"], config.modes))
    if results["seen_arg_table"]:
        print(
            f"\nThe positive control: zero-shot ARG on held-out test examples of the "
            f"TRAINING datasets ({', '.join(results['seen_num_choices'])}); always "
            f"answering the most frequent training label scores "
            f"{results['seen_majority_arg']:+.3f}; {{vs majority p}} = paired bootstrap "
            f"p-value of 'better than that' (the control passes where it is small):"
        )
        print(
            format_arg_table(results["seen_arg_table"], config.modes, settings=("seen_zero_shot",))
        )
    if results["minilm"]:
        m = results["minilm"]
        print(
            f"\nMiniLM (frozen), 16-shot: prompt+head ARG {m['prompt+head']['arg']:+.3f}, "
            f"head alone {m['head']['arg']:+.3f} (p = {m['p_prompt_better_than_head']:.2f})"
        )
    timings = results["timings_seconds"]
    print(
        "\ntime: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        + f"; load average at the start {results['load_average']['start'][0]:.1f}, at the "
        f"end {results['load_average']['end'][0]:.1f} on {os.cpu_count()} cores"
    )
    common.write_json(out / "results.json", results)
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
