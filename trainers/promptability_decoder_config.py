"""`trainers.promptability_decoder`'s settings: `Config`, each field also the flag of its
name (`trainers.settings`), the methods and their default learning rates, and the unseen
datasets the program evaluates on.

The program (`trainers.promptability_decoder`) and its stages (`promptability_decoder_data`,
`_run`, `_report`) import them from here, so imports run one way: program -> stages ->
settings. Stdlib and absl only: the program imports this before TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math

from trainers import settings
from trainers.settings import setting

#: The datasets of the unseen task types (`prompted_tasks.EVALUATION_TASK_TYPES`).
UNSEEN_DATASETS = (
    "wordnet_noun_or_verb",
    "wordnet_adj_or_adv",
    "wordnet_gloss_match",
    "django_translation_match",
)


METHODS = ("zero_shot", "prompt", "prefix", "lora", "full")
TRAINED = METHODS[1:]


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
