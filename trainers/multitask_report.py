"""The multilingual multi-task program's report (`python -m trainers.multitask`): each
quantity's mean over seeds with a 95% t-interval, per-language accuracy, the majority-class
reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.multitask_config import Config
    from trainers.multitask_data import Data

SUMMARY_COLUMNS = (
    ("method", "method", "s"),
    ("average_accuracy", "avg held-out acc", "s"),
    ("zero_shot_average", "zero-shot acc", "s"),
    ("task_cosine", "task grad cos", "s"),
    ("distance_from_pretrained", "L2 from pretrained", "s"),
    ("seconds", "s/run", ".0f"),
)


def summarise(runs, methods) -> list[dict]:
    """One row per method: `mean ± half-width` (95% t-interval over seeds) per quantity."""
    import numpy as np

    from tf_metaalign.data.episodes import mean_confidence_interval

    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        row = {
            "method": method,
            "seeds": len(mine),
            "seconds": float(np.mean([r["seconds"] for r in mine])),
        }
        for key, fmt in (
            ("average_accuracy", ".3f"),
            ("zero_shot_average", ".3f"),
            ("task_cosine", ".3f"),
            ("distance_from_pretrained", ".2f"),
        ):
            values = [r[key] for r in mine if r[key] is not None]
            if not values:
                continue
            mean, half = mean_confidence_interval(values)
            row[key] = f"{mean:{fmt}} ± {half:{fmt}}" if len(values) > 1 else f"{mean:{fmt}}"
            row[key + "_mean"], row[key + "_ci95"] = mean, half
        languages = list(mine[0]["task_accuracy"]) + list(mine[0]["zero_shot_accuracy"])
        row["per_language"] = {
            lang: float(
                np.mean(
                    [r["task_accuracy"].get(lang, r["zero_shot_accuracy"].get(lang)) for r in mine]
                )
            )
            for lang in languages
        }
        rows.append(row)
    return rows


def per_language_table(rows, data: Data) -> str:
    from trainers import common

    languages = list(data.train) + list(data.zero_shot)
    columns = [("method", "method", "s")] + [
        (lang, lang + ("*" if lang in data.zero_shot else ""), ".3f") for lang in languages
    ]
    return common.format_table(
        [{"method": r["method"], **r["per_language"]} for r in rows], columns
    )


def majority_accuracy(data: Data) -> dict:
    """Accuracy of always answering the training set's most frequent class, per language."""
    import numpy as np

    counts = np.bincount(
        np.concatenate([y for _, y in data.train.values()]), minlength=len(data.class_names)
    )
    top = int(np.argmax(counts))
    return {
        lang: float(np.mean(y == top)) for lang, (_, y) in {**data.test, **data.zero_shot}.items()
    }


def run_line(r) -> str:
    """The progress line after one run."""
    return (
        f"{r['method']} seed {r['seed']}: held-out {r['average_accuracy']:.3f}"
        + (
            f"  zero-shot {r['zero_shot_average']:.3f}"
            if r["zero_shot_average"] is not None
            else ""
        )
        + (f"  task cos {r['task_cosine']:.3f}" if r["task_cosine"] is not None else "")
        + f"  L2 {r['distance_from_pretrained']:.2f}  ({r['seconds']:.0f} s)"
    )


def print_tables(rows, data: Data, config: Config, majority: dict) -> None:
    """The summary, the per-language table and the majority class, on stdout."""
    from trainers import common

    print()
    print(
        f"Mean over seeds {list(config.seeds)} ± 95% t-interval; held-out = the training "
        f"languages' held-out strings; zero-shot = unseen languages "
        f"({', '.join(config.zero_shot_languages)})."
    )
    print(common.format_table(rows, SUMMARY_COLUMNS))
    print()
    print("Accuracy per language (mean over seeds; * = zero-shot):")
    print(per_language_table(rows, data))
    print(
        f"\nmajority class: held-out "
        f"{sum(majority[l] for l in data.test) / len(data.test):.3f}, zero-shot "
        f"{sum(majority[l] for l in data.zero_shot) / max(1, len(data.zero_shot)):.3f}"
    )
