"""`trainers.promptability_decoder`'s report: per method the accuracy over seeds with
its interval, paired differences against zero-shot and full fine-tuning, the bootstrap
p-value, trainable parameters and step cost; the printed table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_decoder_config import Config


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
    """ "mean ± half" (the half-width unsigned, whatever sign `fmt` gives the mean)."""
    if mean is None:
        return "-"
    return format(mean, fmt) + ("" if half is None else f" ± {format(half, fmt.lstrip('+'))}")


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
