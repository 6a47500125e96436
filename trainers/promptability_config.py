"""The promptability program's settings (`python -m trainers.promptability`): `Config`,
each field also the flag of its name (`trainers.settings`), the `--full` preset
`FULL_RUN`, and the continued pre-training configurations (`TRAIN`: which weights each
one trains).

The program (`trainers.promptability`) and its stages (`promptability_data`, `_train`,
`_evaluate`, `_report`, `_run`) import them from here, so imports run one way: program ->
stages -> settings. Stdlib and absl only: the program imports this before TensorFlow.
"""

from __future__ import annotations

import dataclasses

from trainers import settings
from trainers.settings import setting

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
