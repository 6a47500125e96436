"""`trainers.finetune`'s report stage: the single-seed table, and the study's summary
over seeds (means, 95% intervals, paired differences and which are significant)."""

from __future__ import annotations

import math

TABLE_COLUMNS = (
    ("run", "run", "s"),
    ("test_accuracy", "test acc", ".4f"),
    ("test_loss", "test loss", ".4f"),
    ("train_loss", "train loss", ".4f"),
    ("mean_grad_dot", "mean G1.G2", ".4g"),
    ("mean_grad_cosine", "mean cos", ".4f"),
    ("step_ms", "ms/step (median)", ".1f"),
    ("first_step_s", "1st step s", ".1f"),
)

#: The study's per-run measures: key, column title, format.
MEASURES = (
    ("test_accuracy", "test acc", ".4f"),
    ("test_loss", "test loss", ".4f"),
    ("final_grad_dot", "G1.G2", ".3g"),
    ("sharpness", "lambda_max", ".3g"),
    ("step_ratio", "cost x", ".2f"),
)


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (scipy if present)."""
    try:
        from scipy import stats

        return float(stats.t.ppf(0.975, df))
    except ImportError:  # a table for the small df a study uses; 1.96 beyond
        table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}
        table.update({8: 2.306, 9: 2.262, 10: 2.228})
        return table.get(df, 1.96)


def interval(values):
    """`(mean, half_width)` of the 95% t interval of the mean (half_width None for n < 2)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    n = len(values)
    if not n:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile_975(n - 1) * sd / math.sqrt(n)


def summarize(rows_by_seed, runs, references=("baseline", "dotprod")):
    """The study summary.

    `rows_by_seed`: {seed: {run: row}} (rows with the MEASURES' keys). Returns a dict:
    `per_run`: run -> measure -> {mean, ci95, n}; `differences`: "run - reference" ->
    measure -> {mean, ci95, n, significant}: the paired difference over seeds (same seed:
    same initial weights, data order and dropout seed), significant at 95% when its
    interval excludes 0.
    """
    seeds = sorted(rows_by_seed)
    per_run = {}
    for run in runs:
        per_run[run] = {}
        for key, _, _ in MEASURES:
            mean, half = interval([rows_by_seed[s][run].get(key) for s in seeds])
            per_run[run][key] = {"mean": mean, "ci95": half, "n": len(seeds)}
    differences = {}
    for reference in references:
        if reference not in runs:
            continue
        for run in runs:
            if run == reference or (run, reference) == ("baseline", "dotprod"):
                continue
            entry = {}
            for key, _, _ in MEASURES:
                pairs = [
                    (rows_by_seed[s][run].get(key), rows_by_seed[s][reference].get(key))
                    for s in seeds
                ]
                diffs = [a - b for a, b in pairs if a is not None and b is not None]
                mean, half = interval(diffs)
                entry[key] = {
                    "mean": mean,
                    "ci95": half,
                    "n": len(diffs),
                    "significant": bool(half is not None and abs(mean) > half),
                }
            differences[f"{run} - {reference}"] = entry
    return {"seeds": seeds, "per_run": per_run, "differences": differences}


def _cell(stat, fmt):
    if stat["mean"] is None:
        return "-"
    if stat["ci95"] is None:
        return format(stat["mean"], fmt)
    return f"{format(stat['mean'], fmt)} ± {format(stat['ci95'], fmt)}"


def study_tables(summary):
    """Two text tables: per run (mean ± 95% half-width), and the paired differences
    (a `*` marks a significant one)."""
    from trainers import common

    rows = [
        {"run": run, **{k: _cell(stats[k], f) for k, _, f in MEASURES}}
        for run, stats in summary["per_run"].items()
    ]
    columns = [("run", "run", "s")] + [(k, title, "s") for k, title, _ in MEASURES]
    per_run = common.format_table(rows, columns)
    rows = []
    for name, stats in summary["differences"].items():
        row = {"run": name}
        for k, _, f in MEASURES:
            cell = _cell(stats[k], f)
            row[k] = cell + (" *" if stats[k]["significant"] else "")
        rows.append(row)
    differences = common.format_table(rows, [("run", "difference", "s")] + columns[1:])
    return per_run, differences
