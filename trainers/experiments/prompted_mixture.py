"""A mixture of prompted datasets for continued pre-training: T5's "examples-proportional
mixing with an artificial limit" (Raffel et al. 2020, Sec. 3.5.2; T0 uses it with a 500k
cap). Dataset m is drawn with rate `min(N_m, cap) / sum_n min(N_n, cap)`, then one of its
examples and one of its templates uniformly; draw k is a pure function of `(seed, k)`.

The datasets are `trainers.experiments.prompted_tasks.PromptedDataset`s (the offline
prompted tasks, split by task type there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping

import numpy as np

from tf_metaalign.data.multitask import task_probabilities
from tf_metaalign.data.splits import check_positive_int

if TYPE_CHECKING:
    from trainers.experiments.prompted_tasks import PromptedDataset

__all__ = ["mixing_rates", "PromptedMixture"]


def mixing_rates(sizes: Mapping[str, int], cap: int) -> dict[str, float]:
    """Examples-proportional mixing with an artificial limit (Raffel et al. 2020, 3.5.2):
    `r_m = min(N_m, cap) / sum_n min(N_n, cap)`."""
    cap = check_positive_int(cap, "cap")
    if not isinstance(sizes, Mapping) or not sizes:
        raise ValueError("`sizes` must be a non-empty mapping dataset -> number of examples.")
    for name, n in sizes.items():
        check_positive_int(n, f"sizes[{name!r}]")
    return task_probabilities(sizes, weights=[min(int(n), cap) for n in sizes.values()])


class PromptedMixture:
    """A deterministic multi-task prompted stream of `(input_text, target_text)` pairs.

    Draw k is a pure function of `(seed, k)`: dataset m with probability `mixing_rates`,
    then a uniform example of its split and a uniform template. So `examples(start=k)`
    resumes a stream exactly (pass the number of pairs already consumed).
    """

    def __init__(
        self,
        datasets: Mapping[str, PromptedDataset],
        cap: int = 500_000,
        seed: int = 0,
        split: str = "train",
    ):
        if not isinstance(datasets, Mapping) or not datasets:
            raise ValueError("`datasets` must be a non-empty mapping name -> PromptedDataset.")
        if split not in ("train", "test"):
            raise ValueError(f"`split` must be 'train' or 'test'; got {split!r}.")
        self.datasets = dict(datasets)
        self.names = list(self.datasets)
        self.split = split
        self.seed = int(seed)
        sizes = {n: len(getattr(d, split)) for n, d in self.datasets.items()}
        empty = [n for n, s in sizes.items() if s == 0]
        if empty:
            raise ValueError(f"`datasets` {empty} have no {split} examples.")
        self.rates = mixing_rates(sizes, cap)
        self._cumulative = np.cumsum(list(self.rates.values()))

    def draw(self, k: int) -> tuple[str, int, str]:
        """`(dataset name, example index, template name)` of draw k."""
        rng = np.random.default_rng([self.seed, int(k)])
        m = int(
            min(np.searchsorted(self._cumulative, rng.random(), side="right"), len(self.names) - 1)
        )
        dataset = self.datasets[self.names[m]]
        index = int(rng.integers(len(getattr(dataset, self.split))))
        template = dataset.templates[int(rng.integers(len(dataset.templates)))]
        return self.names[m], index, template.name

    def examples(self, start: int = 0, with_names: bool = False) -> Iterator[tuple]:
        """Endless `(input_text, target_text)` pairs from draw `start` on
        (`(dataset, template, input_text, target_text)` with `with_names=True`)."""
        k = int(start)
        while True:
            name, index, template_name = self.draw(k)
            dataset = self.datasets[name]
            template = next(t for t in dataset.templates if t.name == template_name)
            p = template.apply(getattr(dataset, self.split)[index])
            yield (
                (name, template_name, p.input_text, p.target_text)
                if with_names
                else (p.input_text, p.target_text)
            )
            k += 1

    def take(self, n: int, start: int = 0, with_names: bool = False) -> list[tuple]:
        n = check_positive_int(n, "n")
        stream = self.examples(start, with_names)
        return [next(stream) for _ in range(n)]
