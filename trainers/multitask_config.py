"""The multilingual multi-task program's settings (`python -m trainers.multitask`):
`Config`, each field also the flag of its name (`trainers.settings`), the `--full` preset
`FULL_RUN`, and the program's own methods beside the registry's (`PROGRAM_METHODS`,
`ALIASES`).

The program (`trainers.multitask`) and its stages (`multitask_data`, `multitask_run`,
`multitask_report`) import them from here, so imports run one way: program -> stages ->
settings. Stdlib and absl only: the program imports this before TensorFlow.
"""

from __future__ import annotations

import dataclasses

from trainers import multitask_methods as MM
from trainers import settings
from trainers.settings import setting

#: The program's own methods (not in the multi-task registry). Every registry method is
#: accepted too (`MM.known(PROGRAM_METHODS, ALIASES)`), and "zoo" for all of them.
PROGRAM_METHODS = ("single_task", "recadam", "reptile", "sequential_reptile")
#: Program names of registry methods: "mtl" runs the registry's "sum" (equal weighting).
ALIASES = {"mtl": "sum"}

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
    portable: bool = setting(
        False,
        "Draw the new head with NumPy: the same start on either --backend (the batches are "
        "the same on both anyway; dropout's masks still differ between backends).",
    )

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
