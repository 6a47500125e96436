r"""Time per step of SAM / ASAM / GSAM beside Meta DotProd, as ratios to plain `fit`.

    python -m benchmarks.sam_overhead                   # ~8 min on 2 CPU cores
    python -m benchmarks.sam_overhead --memory          # + peak RSS per configuration

`benchmarks/dotprod_overhead.py` with the sharpness-aware configurations: the same model
(a ReLU MLP on synthetic data, Adam), the same interleaved rounds (every configuration
runs in each round, in a shuffled order, so load from other processes falls on all of
them alike), the same ratio (median step time / plain's median, in the same run; for
sam_every=10 and every=10 the amortized ratio: per round of 10 steps, its mean step / plain's).

Configurations: plain, every=1 and every=10 (DotProdTrainer, weight 0.1), sam
(SAMTrainer rho 0.05), sam_every=10, asam (adaptive, rho 0.5), gsam (GSAMTrainer,
alpha 0.1). Targets (issue 21): sam <= 2.05x (its floor is two full-batch forward +
backward passes where plain does one), sam_every=10 <= 1.15x. Writes
`benchmarks/results/sam_overhead.json`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

from benchmarks import dotprod_overhead  # noqa: E402  (defines the flags)

CONFIGS = ["plain", "every=1", "every=10", "sam", "sam_every=10", "asam", "gsam"]


def main(argv):
    flags.FLAGS.set_default("configs", CONFIGS)
    flags.FLAGS.set_default("memory", False)
    # 8 rounds of 10 steps: each round holds one perturbed step of every=10, and the
    # median over 8 rounds is not moved by one round that a load spike hit.
    flags.FLAGS.set_default("rounds", 8)
    flags.FLAGS.set_default("steps_per_round", 10)
    flags.FLAGS.set_default(
        "output", str(Path(__file__).resolve().parent / "results" / "sam_overhead.json")
    )
    # set_default does not touch flags given on the command line.
    dotprod_overhead.main(argv)


if __name__ == "__main__":
    app.run(main)
