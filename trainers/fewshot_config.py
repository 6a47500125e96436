"""The few-shot program's settings (`python -m trainers.fewshot`): `Config`, each field
also the flag of its name (`trainers.settings`), and the `--full` preset `FULL_RUN`.

The program (`trainers.fewshot`) and its stages (`fewshot_data`, `fewshot_run`,
`fewshot_report`) import them from here, so imports run one way: program -> stages ->
settings. Stdlib and absl only: the program imports this before TensorFlow.
"""

from __future__ import annotations

import dataclasses

from trainers import settings
from trainers.settings import setting


METHODS = (
    "maml",
    "maml_gs",
    "metasgd",
    "metasgd_gs",
    "mamlpp",
    "mamlpp_gs",
    "fomaml",
    "reptile",
    "dotprod",
)


@dataclasses.dataclass
class Config:
    """Everything a run depends on: each field is also the flag of its name (`setting`);
    tests build it directly."""

    methods: tuple[str, ...] = setting(("maml", "maml_gs"), "Which methods.", choices=METHODS)
    task_batch_sizes: tuple[int, ...] = setting(
        (5, 1), "Tasks per meta-batch (MAML family; reptile/dotprod take 1)."
    )
    seeds: tuple[int, ...] = setting((0,), "Seeds (init, episodes).")
    inner_learning_rate_scales: tuple[float, ...] = setting(
        (1.0,), "Multipliers of --inner_learning_rate (10: the paper's 10x run)."
    )
    ways: int = setting(5, "N of the training / validation episodes.")
    shots: int = setting(1, "K-shot of every episode.")
    queries: int = setting(5, "Query examples per class (5-way episodes).")
    inner_steps: int = setting(1, "Inner SGD steps in meta-training.")
    inner_learning_rate: float = setting(0.1, "Inner SGD rate alpha.")
    evaluation_inner_steps: int = setting(3, "Inner SGD steps when evaluating (every method).")
    outer_learning_rate: float = setting(1e-3, "Outer Adam's rate.")
    filters: int = setting(16, "Conv-4 filters per layer (64 in the paper).")
    epochs: int = setting(10, "Epochs of meta-training.")
    steps_per_epoch: int = setting(60, "Meta-batches per epoch.")
    validation_episodes: int = setting(
        40, "Fixed 5-way validation episodes, scored after every epoch."
    )
    test_episodes: int = setting(100, "Test episodes (each of 5-way and 20-way).")
    validation_classes: int = setting(24, "Validation characters.")
    test_classes: int = setting(48, "Test characters.")
    rotations: bool = setting(True, "Rotations of meta-train characters as classes.")
    official_runs: bool = setting(True, "Score Lake's 20 official runs.")
    dotprod_weight: float = setting(0.1, "DotProd's regulariser weight.")
    sinusoid: bool = setting(True, "Run the sinusoid sanity check.")
    sinusoid_steps: int = setting(1500, "Sinusoid meta-batches.")
    sinusoid_tasks_per_batch: int = setting(10, "Sinusoid tasks per meta-batch.")
    sinusoid_test_tasks: int = setting(100, "Held-out sine waves.")
    log_every: int = setting(60, "Steps between progress lines.")

    def check(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(
                f"`methods`: unknown {unknown} (or none given); choose from {', '.join(METHODS)}."
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"`methods` lists a method twice: {list(self.methods)}.")
        if not self.seeds:
            raise ValueError("`seeds` is empty.")
        for name in ("task_batch_sizes", "seeds"):
            for v in getattr(self, name):
                if (
                    isinstance(v, bool)
                    or not isinstance(v, int)
                    or v < (1 if name == "task_batch_sizes" else 0)
                ):
                    raise ValueError(
                        f"`{name}` must hold integers >= "
                        f"{1 if name == 'task_batch_sizes' else 0}; got {v!r}."
                    )
        if not self.task_batch_sizes:
            raise ValueError("`task_batch_sizes` is empty.")
        if not self.inner_learning_rate_scales or any(
            not (isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0)
            for s in self.inner_learning_rate_scales
        ):
            raise ValueError(
                "`inner_learning_rate_scales` must be numbers > 0; got "
                f"{list(self.inner_learning_rate_scales)}."
            )
        settings.check_integers(
            self,
            (
                "ways",
                "shots",
                "queries",
                "inner_steps",
                "evaluation_inner_steps",
                "filters",
                "epochs",
                "steps_per_epoch",
                "validation_episodes",
                "test_episodes",
                "sinusoid_steps",
                "sinusoid_tasks_per_batch",
                "sinusoid_test_tasks",
                "log_every",
            ),
        )
        settings.check_positive(self, ("inner_learning_rate", "outer_learning_rate"))
        if self.dotprod_weight < 0:
            raise ValueError(f"`dotprod_weight` must be >= 0; got {self.dotprod_weight!r}.")
        if self.validation_classes < self.ways:
            raise ValueError(
                f"`validation_classes`={self.validation_classes} is fewer than `ways`={self.ways}."
            )
        if self.test_classes < 20:
            raise ValueError(
                f"`test_classes`={self.test_classes}: 20-way test episodes need "
                "at least 20 test characters."
            )
        if self.validation_classes + self.test_classes > 242 - self.ways:
            raise ValueError(
                "`validation_classes` + `test_classes` leave fewer than `ways` "
                "of the 242 characters for meta-training."
            )
        if self.shots + self.queries > 20:
            raise ValueError(
                f"`shots` + `queries` = {self.shots + self.queries}: Omniglot "
                "has 20 drawings per character."
            )
        if "dotprod" in self.methods and self.queries < self.shots:
            raise ValueError(
                "dotprod needs `queries` >= `shots` (b2 = `shots` query examples per class)."
            )


FULL_RUN = {
    "methods": METHODS,
    "task_batch_sizes": (5, 1),
    "seeds": (0, 1, 2),
    "inner_learning_rate_scales": (1.0, 10.0),
    "inner_steps": 5,
    "inner_learning_rate": 0.1,
    "evaluation_inner_steps": 5,
    "filters": 64,
    "epochs": 40,
    "steps_per_epoch": 100,
    "validation_episodes": 200,
    "test_episodes": 600,
    "queries": 15,
    "sinusoid_steps": 5000,
    "sinusoid_tasks_per_batch": 25,
    "sinusoid_test_tasks": 600,
}
