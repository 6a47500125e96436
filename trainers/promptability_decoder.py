r"""A small decoder LM on the offline prompted tasks: zero-shot, and 16-shot prompt tuning
vs prefix tuning vs LoRA vs full fine-tuning at the same budget, over seeds.

    python -m trainers.promptability_decoder                  # the default run (~25 min, 2 cores)
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
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.settings import setting  # noqa: E402

METHODS = ("zero_shot", "prompt", "prefix", "lora", "full")
TRAINED = METHODS[1:]
#: The datasets of the unseen task types (`prompted_tasks.EVALUATION_TASK_TYPES`).
UNSEEN_DATASETS = (
    "wordnet_noun_or_verb",
    "wordnet_adj_or_adv",
    "wordnet_gloss_match",
    "django_translation_match",
)
EOS_ID, PAD_ID = 1, 0  # the T5 SentencePiece model's (text_pretraining.EOS_ID / PAD_ID)


def _parse_rates(items) -> dict:
    rates = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in TRAINED:
            raise ValueError(
                f"`--learning_rates` takes method=rate items, method one of {TRAINED}; got "
                f"{item!r}."
            )
        rates[name] = float(value)
    return rates


DEFAULT_RATES = {"prompt": 9e-2, "prefix": 3e-2, "lora": 9e-3, "full": 3e-4}


@dataclasses.dataclass
class Config:
    """Everything a run depends on; each field is also the flag of its name."""

    methods: tuple[str, ...] = setting(METHODS, "Methods.", choices=METHODS)
    seeds: tuple[int, ...] = setting((0, 1, 2), "Seeds (few-shot samples, inits, batch order).")
    cache_dir: str = setting(
        "/tmp/tf_metaalign_promptability_cache",
        "Where the pre-trained GPT-2 and the SentencePiece model are cached (by content hash; "
        "the promptability program's T5 shares the folder and the vocabulary).",
    )
    # 1. pre-training
    gpt2_size: str = setting("small", "small_gpt2.GPT2_SIZES name (tiny, small).")
    vocabulary_size: int = setting(4000, "SentencePiece pieces (the small T5's).")
    corpus_max_texts: int = setting(0, "A random subset of the offline corpus (0: all of it).")
    pretrain_steps: int = setting(1200, "Causal LM pre-training steps.")
    pretrain_batch_size: int = setting(32, "Pre-training batch.")
    pretrain_sequence_length: int = setting(64, "Pre-training tokens per row.")
    pretrain_learning_rate: float = setting(1e-3, "Adam rate of pre-training.")
    max_sequence_length: int = setting(
        128, "GPT-2 positions (>= prompt_length + input_length + answer_length)."
    )
    heldout_texts: int = setting(2000, "Corpus texts held out of pre-training (its held-out loss).")
    # 2. tasks
    max_train: int = setting(500, "Training examples per prompted dataset (the shots' pool).")
    eval_examples: int = setting(48, "Evaluation examples per dataset (its test split).")
    evaluate_on: str = setting(
        "test",
        "test: the datasets' test splits; dev: `eval_examples` TRAINING-split examples kept "
        "out of the shots' pool (to choose learning rates without the test split).",
        choices=("test", "dev"),
    )
    datasets: tuple[str, ...] = setting(
        (), "Unseen datasets to evaluate on (default: all four).", choices=UNSEEN_DATASETS
    )
    templates_per_dataset: int = setting(2, "Templates per dataset (0: all).")
    input_length: int = setting(48, "Input tokens, the leading EOS included (cut from the left).")
    answer_length: int = setting(8, "Answer tokens, the final EOS included.")
    # 3. methods
    shots: int = setting(16, "Training examples per (dataset, template, seed).")
    epochs: int = setting(20, "Epochs over the shots (steps = epochs * ceil(shots / batch)).")
    batch_size: int = setting(8, "Training batch.")
    prompt_length: int = setting(20, "L of the shallow prompt and of the deep prefix.")
    lora_rank: int = setting(4, "LoRA rank.")
    learning_rates: dict = setting(
        default_factory=dict,
        help="Adam rate per method, method=rate items (default "
        + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_RATES.items())
        + "; given items replace those).",
        parse=_parse_rates,
    )
    cost_rounds: int = setting(
        3, "Rounds of the interleaved step-time measurement (0: none; the in-run medians only)."
    )
    cost_steps: int = setting(10, "Steps per method per round of the step-time measurement.")
    bootstrap_resamples: int = setting(1000, "Bootstrap resamples.")
    log_every: int = setting(100, "Pre-training steps between progress lines.")

    def check(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(
                f"`methods`: unknown {unknown} (or none given); choose from {', '.join(METHODS)}."
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"`seeds` must be distinct and non-empty; got {self.seeds!r}.")
        settings.check_integers(
            self,
            (
                "vocabulary_size",
                "pretrain_steps",
                "pretrain_batch_size",
                "pretrain_sequence_length",
                "max_train",
                "eval_examples",
                "shots",
                "epochs",
                "batch_size",
                "prompt_length",
                "lora_rank",
                "max_sequence_length",
                "cost_steps",
                "bootstrap_resamples",
                "log_every",
            ),
        )
        settings.check_integers(self, ("corpus_max_texts", "templates_per_dataset"), 0, "(0: all)")
        settings.check_integers(self, ("heldout_texts", "cost_rounds"), 0)
        settings.check_integers(self, ("input_length",), 2)
        settings.check_integers(self, ("answer_length",), 2)
        settings.check_positive(self, ("pretrain_learning_rate",))
        for name, rate in self.learning_rates.items():
            if not rate > 0:
                raise ValueError(f"`learning_rates`: {name}={rate!r} must be > 0.")
        if self.shots > self.max_train:
            raise ValueError(f"`shots`={self.shots} exceeds `max_train`={self.max_train}.")
        if not self.cache_dir:
            raise ValueError("`cache_dir` is empty; give a folder for the pre-trained GPT-2.")
        needed = max(
            self.prompt_length + self.input_length + self.answer_length,
            self.pretrain_sequence_length,
        )
        if self.max_sequence_length < needed:
            raise ValueError(
                f"`max_sequence_length`={self.max_sequence_length} is below the {needed} "
                "positions that prompt_length + input_length + answer_length (and "
                "pretrain_sequence_length) need."
            )

    def rate(self, method: str) -> float:
        return {**DEFAULT_RATES, **self.learning_rates}[method]

    @property
    def steps(self) -> int:
        """Optimizer steps of every trained run."""
        return self.epochs * math.ceil(self.shots / self.batch_size)


# ----------------------------------------------------------------------------- data


class Codec:
    """Token ids of the decoder's inputs and answers, memoised: an input is `EOS + ids`,
    cut from the left to `input_length`; an answer is `ids + EOS`, cut to `answer_length`."""

    def __init__(self, tokenizer, input_length: int, answer_length: int):
        self.tokenizer, self.cache = tokenizer, {}
        self.input_length, self.answer_length = input_length, answer_length

    def ids(self, text: str) -> list[int]:
        import numpy as np

        if text not in self.cache:
            self.cache[text] = [int(i) for i in np.asarray(self.tokenizer(text)).reshape(-1)]
        return self.cache[text]

    def input_ids(self, text: str) -> list[int]:
        ids = self.ids(text)
        return [EOS_ID] + ids[max(0, len(ids) - (self.input_length - 1)) :]

    def answer_ids(self, text: str) -> list[int]:
        return self.ids(text)[: self.answer_length - 1] + [EOS_ID]


def training_arrays(examples, codec: Codec):
    """`(x, y, sample_weight)` of teacher forcing on `input + answer`, padded to
    input_length + answer_length: `y[t]` is token t + 1, weighted 1 where it is an answer
    token (the continuation rank classification scores)."""
    import numpy as np

    width = codec.input_length + codec.answer_length
    ids = np.zeros((len(examples), width + 1), np.int32)
    weights = np.zeros((len(examples), width), np.float32)
    mask = np.zeros((len(examples), width), np.int32)
    for row, example in enumerate(examples):
        inp = codec.input_ids(example.input_text)
        ans = codec.answer_ids(example.answer_choices[example.label])
        ids[row, : len(inp) + len(ans)] = inp + ans
        mask[row, : len(inp) + len(ans)] = 1
        weights[row, len(inp) - 1 : len(inp) - 1 + len(ans)] = 1.0
    x = {"token_ids": ids[:, :-1], "padding_mask": mask}
    return x, ids[:, 1:], weights


def ranking_arrays(examples, codec: Codec):
    """`rank_classification`'s inputs `[N, S]` (pad 0), choice targets `[N, C, T]`, their
    mask and the choice mask, and the labels."""
    import numpy as np

    num_choices = max(len(e.answer_choices) for e in examples)
    inputs = np.zeros((len(examples), codec.input_length), np.int32)
    targets = np.zeros((len(examples), num_choices, codec.answer_length), np.int32)
    target_mask = np.zeros_like(targets)
    choice_mask = np.zeros((len(examples), num_choices), bool)
    for i, example in enumerate(examples):
        inp = codec.input_ids(example.input_text)
        inputs[i, : len(inp)] = inp
        for j, choice in enumerate(example.answer_choices):
            ans = codec.answer_ids(choice)
            targets[i, j, : len(ans)] = ans
            target_mask[i, j, : len(ans)] = 1
            choice_mask[i, j] = True
    labels = np.asarray([e.label for e in examples], np.int64)
    return inputs, targets, target_mask, choice_mask, labels


def prepare_pairs(config: Config) -> tuple[dict, dict]:
    """`({(dataset, template): (train examples, test examples)}, {dataset: choices})` of
    the unseen task types."""
    from trainers.experiments import prompted_tasks as PT

    datasets = PT.offline_prompted_tasks(
        max_train=config.max_train, max_test=config.eval_examples, seed=0
    )
    _, evaluation = PT.split_by_task_type(datasets)
    if config.datasets:
        evaluation = {n: evaluation[n] for n in config.datasets}
    pairs = {}
    for name, dataset in evaluation.items():
        train, test = dataset.prompted("train"), dataset.prompted("test")
        for template in dataset.templates[: config.templates_per_dataset or None]:
            examples = train[template.name]
            if config.evaluate_on == "dev":
                if len(examples) < config.shots + config.eval_examples:
                    raise ValueError(
                        f"{name!r} has {len(examples)} training examples: fewer than "
                        f"shots + eval_examples ({config.shots + config.eval_examples}) for "
                        "evaluate_on='dev'."
                    )
                cut = len(examples) - config.eval_examples
                pairs[(name, template.name)] = (examples[:cut], examples[cut:])
            else:
                pairs[(name, template.name)] = (examples, test[template.name])
    return pairs, {n: d.num_choices for n, d in evaluation.items()}


# ----------------------------------------------------------------------------- models


class TracedForward:
    """`model(x)` as one traced function (any batch and length): what `causal_lm_score_fn`
    calls, without re-tracing per call."""

    def __init__(self, model):
        import tensorflow as tf

        spec = tf.TensorSpec([None, None], tf.int32)

        @tf.function(input_signature=[{"token_ids": spec, "padding_mask": spec}])
        def forward(x):
            return model(x, training=False)

        self.forward = forward

    def __call__(self, x, training=False):
        import tensorflow as tf

        return self.forward({k: tf.cast(v, tf.int32) for k, v in x.items()})


def correctness(score_fn, examples, codec: Codec):
    """Per-example 0/1 correctness of rank classification (mean per-token log-likelihood)."""
    from tf_metaalign.prompts import rank_classification

    inputs, targets, target_mask, choice_mask, labels = ranking_arrays(examples, codec)
    predictions, _ = rank_classification(
        score_fn, inputs, targets, target_mask, choice_mask, reduction="mean"
    )
    return (predictions == labels).astype("int64")


def answer_nll(score_fn, examples, codec: Codec) -> float:
    """Nats per answer token (EOS included) of the right answers: the training loss."""
    import numpy as np

    inputs, targets, target_mask, _, labels = ranking_arrays(examples, codec)
    rows = np.arange(len(examples))
    target, mask = targets[rows, labels], target_mask[rows, labels]
    log_likelihoods = np.asarray(score_fn(inputs, target, mask))
    return float(-(log_likelihoods * mask).sum() / mask.sum())


def count(variables) -> int:
    import numpy as np

    return int(sum(np.prod(v.shape) for v in variables))


class Method:
    """One method's model, compiled and traced once; `reset(seed)` puts it back at the
    pre-trained weights with a fresh (seeded) prompt / LoRA factors and optimizer state."""

    def __init__(self, name: str, pretrained_backbone, weights, config: Config):
        import keras
        import keras_hub

        from tf_metaalign import prompts
        from trainers.promptability_evaluate import FreshOptimizerState

        self.name, self.config = name, config
        self.pretrained = weights
        if name in ("prompt", "prefix", "zero_shot"):
            self.backbone = pretrained_backbone  # shared, frozen
        else:
            self.backbone = keras_hub.models.GPT2Backbone.from_config(
                pretrained_backbone.get_config()
            )
            self.backbone.set_weights(weights)
        self.lora, self.own = [], []
        if name in ("prompt", "prefix"):
            self.mode = "shallow" if name == "prompt" else "deep"
            self.model = prompts.prompt_causal_lm(
                self.backbone, config.prompt_length, self.mode, train="prompt", init="vocab"
            )
        else:
            if name == "full":
                self.backbone.trainable = True  # the copied config says False (frozen above)
            if name == "lora":
                self.backbone.enable_lora(config.lora_rank)
                self.lora = [
                    (layer.lora_kernel_a, layer.lora_kernel_b)
                    for layer in self.backbone._flatten_layers(include_self=False)
                    if getattr(layer, "lora_enabled", False)
                ]
                lora_ids = {id(v) for pair in self.lora for v in pair}
                # The backbone's own weights, in the pretrained list's order.
                self.own = [w for w in self.backbone.weights if id(w) not in lora_ids]
            self.model = keras_hub.models.GPT2CausalLM(backbone=self.backbone, preprocessor=None)
        self.score_fn = prompts.causal_lm_score_fn(TracedForward(self.model), pad_id=PAD_ID)
        if name == "zero_shot":
            self.trainable = 0
            return
        self.model.compile(
            optimizer=keras.optimizers.Adam(config.rate(name)),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
            weighted_metrics=[],
            jit_compile=False,
        )
        self.trainable = count(self.model.trainable_variables)
        self.fresh_optimizer_state = FreshOptimizerState(
            self.model.optimizer, self.model.trainable_variables
        )
        self.step_times: list[float] = []
        self.first_fit_seconds = None

    def reset(self, seed: int):
        import keras
        import numpy as np

        from tf_metaalign import prompts

        if self.name in ("prompt", "prefix"):
            fresh = prompts.prompt_causal_lm(
                self.backbone, self.config.prompt_length, self.mode, init="vocab", seed=seed
            )
            self.model.prompt_variables[0].assign(fresh.prompt_variables[0].numpy())
        elif self.name == "lora":
            # keras-hub's enable_lora also trains the query / value biases: back to the
            # pre-trained values, and fresh factors (Keras's initializers: A he-uniform, B 0).
            for w, value in zip(self.own, self.pretrained):
                w.assign(value)
            initializer = keras.initializers.HeUniform(seed=seed)
            for a, b in self.lora:
                a.assign(initializer(a.shape, a.dtype))
                b.assign(np.zeros(b.shape, b.dtype))
        elif self.name == "full":
            self.backbone.set_weights(self.pretrained)
        self.fresh_optimizer_state()

    def train(self, examples, codec: Codec, seed: int):
        """`epochs` passes over `examples`, each in its own seeded order, in batches of
        `batch_size` (keras-hub's `CausalLM.fit` does not shuffle arrays: the order is
        drawn here). Returns the answer nats per token on `examples` before and after."""
        import numpy as np

        from trainers import common

        before = answer_nll(self.score_fn, examples, codec)
        x, y, w = training_arrays(examples, codec)
        rng = np.random.default_rng(seed)
        order = np.concatenate([rng.permutation(len(examples)) for _ in range(self.config.epochs)])
        timer = common.StepTimer(warmup=1)
        start = time.perf_counter()
        self.model.fit(
            {k: v[order] for k, v in x.items()},
            y[order],
            sample_weight=w[order],
            batch_size=self.config.batch_size,
            epochs=1,
            verbose=0,
            callbacks=[timer],
        )
        if self.first_fit_seconds is None:
            self.first_fit_seconds = time.perf_counter() - start
        self.step_times += timer.warm_times
        return before, answer_nll(self.score_fn, examples, codec)


# ----------------------------------------------------------------------------- the run


def pretrained_gpt2(config: Config, log=print):
    """`(model, tokenizer, info)`: the cached pre-trained `GPT2CausalLM`."""
    from trainers import common
    from trainers.experiments import small_gpt2
    from trainers.experiments import text_pretraining as tp

    corpus = tp.english_corpus(max_texts=config.corpus_max_texts or None, seed=0)
    every = min(config.log_every, config.pretrain_steps)
    return small_gpt2.cached_pretrained_gpt2(
        config.cache_dir,
        corpus,
        size=config.gpt2_size,
        vocabulary_size=config.vocabulary_size,
        steps=config.pretrain_steps,
        batch_size=config.pretrain_batch_size,
        sequence_length=config.pretrain_sequence_length,
        learning_rate=config.pretrain_learning_rate,
        max_sequence_length=config.max_sequence_length,
        heldout_texts=config.heldout_texts,
        callbacks=(common.ProgressCallback(log, "pre-training", config.pretrain_steps, every),),
    )


def run_seed_key(seed: int, pair) -> int:
    from tf_metaalign.prompts.evaluation import stable_seed

    return stable_seed(seed, *pair)[0] % 2**31


def run(config: Config, log=print) -> dict:
    """The experiment (module docstring); returns the results (JSON-ready but for arrays)."""
    import keras
    import numpy as np

    from tf_metaalign.prompts.evaluation import sample_few_shot

    start = time.perf_counter()
    lm, tokenizer, info = pretrained_gpt2(config, log)
    backbone = lm.backbone
    log(
        f"GPT-2 {config.gpt2_size}: {backbone.count_params():,} parameters, "
        f"{'cached' if info['cached'] else 'pre-trained'}; held-out nats/token "
        f"{info['heldout_nll']:.3f} (unigram {info['heldout_nll_unigram']:.3f}, "
        f"uniform {info['uniform_nll']:.3f})"
    )
    codec = Codec(tokenizer, config.input_length, config.answer_length)
    pairs, num_choices = prepare_pairs(config)
    log(f"{len(pairs)} (dataset, template) pairs: {', '.join('/'.join(p) for p in pairs)}")
    pretrained = [w.numpy().copy() for w in backbone.weights]

    samples = {
        (seed, pair): sample_few_shot(len(train), config.shots, seed, *pair)
        for seed in config.seeds
        for pair, (train, _) in pairs.items()
    }
    majority = {}
    for (seed, pair), index in samples.items():
        train, test = pairs[pair]
        labels = np.asarray([train[i].label for i in index])
        answer = np.bincount(labels).argmax()
        majority.setdefault(str(seed), {})[pair] = np.asarray(
            [e.label == answer for e in test], "int64"
        )

    results = {
        "config": dataclasses.asdict(config),
        "steps_per_run": config.steps,
        "pretraining": {k: v for k, v in info.items() if k != "history"}
        | {"loss_curve": info["history"].get("loss")},
        "pairs": ["/".join(p) for p in pairs],
        "num_choices": num_choices,
        "majority": {s: {"/".join(k): v for k, v in m.items()} for s, m in majority.items()},
        "methods": {},
    }
    trained_methods = {}
    for name in config.methods:
        method_start = time.perf_counter()
        method = Method(name, backbone, pretrained, config)
        if name != "zero_shot":
            trained_methods[name] = method
        per_seed = {}
        losses = {}
        if name == "zero_shot":
            correct = {
                pair: correctness(method.score_fn, test, codec) for pair, (_, test) in pairs.items()
            }
            per_seed = {str(seed): correct for seed in config.seeds}
        else:
            for seed in config.seeds:
                per_seed[str(seed)] = {}
                for pair, (train, test) in pairs.items():
                    key = run_seed_key(seed, pair)
                    keras.utils.set_random_seed(key)
                    method.reset(key)
                    shots = [train[i] for i in samples[(seed, pair)]]
                    losses[f"{seed}/{'/'.join(pair)}"] = method.train(shots, codec, key)
                    per_seed[str(seed)][pair] = correctness(method.score_fn, test, codec)
        bit_identical = {
            "pretrained_backbone": all(
                np.array_equal(w.numpy(), p) for w, p in zip(backbone.weights, pretrained)
            )
        }
        if name == "lora":
            trained = {id(v) for v in method.model.trainable_variables}
            bit_identical["frozen_weights"] = all(
                np.array_equal(w.numpy(), p)
                for w, p in zip(method.own, pretrained)
                if id(w) not in trained
            )
        entry = {
            "trainable_parameters": method.trainable,
            "learning_rate": None if name == "zero_shot" else config.rate(name),
            "accuracy": {
                s: float(np.mean([c.mean() for c in per_pair.values()]))
                for s, per_pair in per_seed.items()
            },
            "correct": {s: {"/".join(k): v for k, v in c.items()} for s, c in per_seed.items()},
            "bit_identical": bit_identical,
            "seconds": time.perf_counter() - method_start,
        }
        if name != "zero_shot":
            entry |= {
                "step_ms_median": 1000 * float(np.median(method.step_times)),
                "step_ms_mean": 1000 * float(np.mean(method.step_times)),
                "first_fit_seconds": method.first_fit_seconds,
                "answer_nll_before_after": losses,
            }
        results["methods"][name] = entry
        accuracies = list(entry["accuracy"].values())
        log(
            f"{name}: accuracy {np.mean(accuracies):.3f} (seeds "
            f"{', '.join(f'{a:.3f}' for a in accuracies)}), {method.trainable:,} trainable"
            + (
                f", {entry['step_ms_median']:.0f} ms/step, answer nats/token "
                f"{np.mean([b for b, _ in losses.values()]):.2f} -> "
                f"{np.mean([a for _, a in losses.values()]):.2f} on the shots"
                if name != "zero_shot"
                else ""
            )
            + f"  ({entry['seconds']:.0f} s)"
        )
    if config.cost_rounds and len(trained_methods) > 0:
        first_pair = next(iter(pairs))
        shots = [pairs[first_pair][0][i] for i in samples[(config.seeds[0], first_pair)]]
        cost = step_costs(trained_methods, shots, codec, config)
        for name, value in cost.items():
            results["methods"][name]["step_ms_interleaved"] = value
        log(
            "step cost, methods interleaved: "
            + ", ".join(f"{n} {v:.1f} ms" for n, v in cost.items())
        )
    results["seconds"] = time.perf_counter() - start
    results["summary"] = summarize(results, config)
    return results


def step_costs(methods: dict, examples, codec: Codec, config: Config) -> dict:
    """Median ms per training step of each method, measured in `cost_rounds` rounds that
    take the methods in turn (each round: `cost_steps` steps of batches of `batch_size` of
    `examples`, its first step left out): the shared machine's load drifts, and
    interleaving spreads it over the methods alike. The methods' weights are reset after."""
    import numpy as np

    from trainers import common

    x, y, w = training_arrays(examples, codec)
    order = np.resize(np.arange(len(examples)), (config.cost_steps + 1) * config.batch_size)
    times = {name: [] for name in methods}
    for _ in range(config.cost_rounds):
        for name, method in methods.items():
            timer = common.StepTimer(warmup=1)
            method.model.fit(
                {k: v[order] for k, v in x.items()},
                y[order],
                sample_weight=w[order],
                batch_size=config.batch_size,
                epochs=1,
                verbose=0,
                callbacks=[timer],
            )
            times[name] += timer.warm_times
    for method in methods.values():
        method.reset(0)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


# ----------------------------------------------------------------------------- report


def summarize(results: dict, config: Config) -> list[dict]:
    """One row per method (and the majority reference): accuracy mean and 95% t interval
    over seeds, paired differences against zero-shot and full fine-tuning (interval,
    significance) and the paired bootstrap p-value over examples (seeds pooled), the
    trainable parameters and the step time ratio to full fine-tuning."""
    import numpy as np

    from tf_metaalign.prompts.evaluation import paired_bootstrap_arg
    from trainers.finetune_report import interval

    methods = results["methods"]
    seeds = [str(s) for s in config.seeds]
    majority = results["majority"]
    accuracy = {m: [methods[m]["accuracy"][s] for s in seeds] for m in methods}
    accuracy["majority"] = [np.mean([v.mean() for v in majority[s].values()]) for s in seeds]
    correct = {m: methods[m]["correct"] for m in methods} | {"majority": majority}

    def pooled(name):  # {(seed, pair): correctness}: each seed's pairs as their own pairs
        return {(s, p): np.asarray(v) for s in seeds for p, v in correct[name][s].items()}

    def step_ms(name):
        entry = methods.get(name, {})
        return entry.get("step_ms_interleaved", entry.get("step_ms_median"))

    full_step = step_ms("full")
    total_parameters = methods["full"]["trainable_parameters"] if "full" in methods else None
    rows = []
    for name in [*methods, "majority"]:
        mean, half = interval(accuracy[name])
        row = {
            "method": name,
            "accuracy": mean,
            "ci95": half,
            "seeds": accuracy[name],
            "trainable_parameters": methods.get(name, {}).get("trainable_parameters"),
        }
        if row["trainable_parameters"] is not None and total_parameters:
            row["trainable_fraction"] = row["trainable_parameters"] / total_parameters
        step = step_ms(name)
        if step is not None:
            row["step_ms"] = step
            row["step_vs_full"] = step / full_step if full_step else None
        for other in ("zero_shot", "full"):
            if other == name or other not in methods:
                continue
            diffs = [a - b for a, b in zip(accuracy[name], accuracy[other])]
            d_mean, d_half = interval(diffs)
            row[f"minus_{other}"] = d_mean
            row[f"minus_{other}_ci95"] = d_half
            row[f"minus_{other}_significant"] = d_half is not None and abs(d_mean) > d_half
            row[f"p_better_than_{other}"] = paired_bootstrap_arg(
                pooled(name), pooled(other), 2, config.bootstrap_resamples, 0, weighting="template"
            ).p_value
        rows.append(row)
    return rows


def _pm(mean, half, fmt=".3f"):
    if mean is None:
        return "-"
    return format(mean, fmt) + ("" if half is None else f" ± {format(half, fmt)}")


def format_report(rows: list[dict]) -> str:
    from trainers import common

    table = []
    for row in rows:
        cells = {
            "method": row["method"],
            "accuracy": _pm(row["accuracy"], row["ci95"]),
            "trainable": row.get("trainable_parameters"),
            "fraction": row.get("trainable_fraction"),
            "step_ms": row.get("step_ms"),
            "step_vs_full": row.get("step_vs_full"),
        }
        for other in ("zero_shot", "full"):
            if f"minus_{other}" in row:
                mark = "*" if row[f"minus_{other}_significant"] else ""
                cells[f"vs_{other}"] = (
                    _pm(row[f"minus_{other}"], row[f"minus_{other}_ci95"], "+.3f") + mark
                )
                cells[f"p_{other}"] = row[f"p_better_than_{other}"]
        table.append(cells)
    return common.format_table(
        table,
        (
            ("method", "method", "s"),
            ("accuracy", "accuracy (95% CI)", "s"),
            ("vs_zero_shot", "- zero-shot", "s"),
            ("p_zero_shot", "p>0-shot", ".3f"),
            ("vs_full", "- full FT", "s"),
            ("p_full", "p>full", ".3f"),
            ("trainable", "trainable", ",d"),
            ("fraction", "of full", ".2%"),
            ("step_ms", "ms/step", ".1f"),
            ("step_vs_full", "x full", ".2f"),
        ),
    )


# ----------------------------------------------------------------------------- main


def define_flags():
    settings.define_program_flags(Config, "/tmp/tf_metaalign_promptability_decoder")


FLAGS = flags.FLAGS


def main(argv):
    del argv
    from trainers import startup

    startup.start_tensorflow()
    import warnings

    from trainers import common

    # keras-hub's CausalLM.fit makes a dataset of the arrays; Keras then warns that its
    # default shuffle=True is ignored (the order is drawn in `Method.train`).
    warnings.filterwarnings("ignore", message=r"`shuffle=True` was passed")

    config = settings.program_config(Config)
    try:
        out = common.prepare_output_dir(FLAGS.output_dir)
    except ValueError as e:
        raise app.UsageError(str(e))
    log = common.Progress()
    results = run(config, log)
    print(format_report(results["summary"]))
    common.write_json(out / "results.json", results)
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
