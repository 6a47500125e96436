"""The promptability program's report (`python -m trainers.promptability`, step 4): the
Average Relative Gain tables with paired bootstrap p-values, the majority-class reference of
the positive control, and the printed summary."""

from __future__ import annotations

import os


def majority_correctness(pairs: dict) -> dict:
    """`{pair: 0/1 array}` of always answering the pair's most frequent TRAINING label (the
    first such label on a tie): the reference for ARG on imbalanced many-choice tasks, where
    a constant answer alone can score far above chance."""
    import numpy as np

    out = {}
    for key, (train, test) in pairs.items():
        labels, counts = np.unique([e.label for e in train], return_counts=True)
        answer = labels[np.argmax(counts)]
        out[key] = np.asarray([e.label == answer for e in test], "int64")
    return out


def pair_key(pair) -> str:
    """`(dataset, template)` -> "dataset/template" (the keys of results.json)."""
    return f"{pair[0]}/{pair[1]}"


SETTING_LABELS = {"zero_shot": "0-shot", "few_shot": "16-shot", "seen_zero_shot": "seen 0-shot"}


def arg_table(
    correct: dict,
    num_choices: dict,
    configurations,
    modes,
    resamples: int = 1000,
    seed: int = 0,
    settings=("zero_shot", "few_shot"),
    majority: dict | None = None,
) -> list[dict]:
    """One row per configuration: ARG of every (setting, mode) column, and the paired
    bootstrap p-values ("better than none"; for mtl_tp also "better than mtl_t"; with
    `majority`, every cell's "better than always answering the training majority").

    `correct[configuration][setting][mode]` = `{(dataset, template): 0/1 array}`;
    `num_choices` the answer-choice counts of the datasets of `settings`; `majority` the
    `majority_correctness` of the same pairs (the positive control's bar: on imbalanced
    tasks a constant answer scores far above chance)."""
    from tf_metaalign.prompts import evaluation as E

    rows = []
    for configuration in configurations:
        row = {"configuration": configuration}
        for setting in settings:
            for mode in modes:
                column = f"{setting}_{mode}"
                mine = correct[configuration][setting][mode]
                row[column] = E.average_relative_gain(mine, num_choices)
                for other in ("none", "mtl_t"):
                    if (
                        other == configuration
                        or other not in correct
                        or (other == "mtl_t" and configuration != "mtl_tp")
                    ):
                        continue
                    test = E.paired_bootstrap_arg(
                        mine, correct[other][setting][mode], num_choices, resamples, seed
                    )
                    row[f"{column}_p_vs_{other}"] = test.p_value
                if majority is not None:
                    row[f"{column}_p_vs_majority"] = E.paired_bootstrap_arg(
                        mine, majority, num_choices, resamples, seed
                    ).p_value
        rows.append(row)
    return rows


def format_arg_table(rows, modes, settings=("zero_shot", "few_shot")) -> str:
    from trainers import common

    cells, columns = [], [("configuration", "configuration", "s")]
    for setting in settings:
        for mode in modes:
            columns.append((f"{setting}_{mode}", f"{SETTING_LABELS[setting]} {mode}", "s"))
    for row in rows:
        cell = {"configuration": row["configuration"]}
        for key, _, _ in columns[1:]:
            text = f"{row[key]:+.3f}"
            if f"{key}_p_vs_none" in row:
                text += f" (p={row[f'{key}_p_vs_none']:.2f})"
            if f"{key}_p_vs_mtl_t" in row:
                text += f" [vs mtl_t p={row[f'{key}_p_vs_mtl_t']:.2f}]"
            if f"{key}_p_vs_majority" in row:
                text += f" {{vs majority p={row[f'{key}_p_vs_majority']:.2f}}}"
            cell[key] = text
        cells.append(cell)
    return common.format_table(cells, columns)


def print_report(results: dict, modes) -> None:
    """The ARG tables, the positive control, MiniLM and the timings of `results` (what
    `run` returns), on stdout."""
    print()
    print(
        f"Average Relative Gain over chance on the unseen tasks "
        f"({', '.join(results['num_choices'])}; {len(results['evaluation_pairs'])} "
        f"dataset-template pairs); (p) = paired bootstrap p-value of 'better than none', "
        f"[vs mtl_t] for mtl_tp; none/mtl_t 0-shot use no prompt (same in both modes):"
    )
    print(format_arg_table(results["arg_table"], modes))
    if results["seen_arg_table"]:
        print(
            f"\nThe positive control: zero-shot ARG on held-out test examples of the "
            f"TRAINING datasets ({', '.join(results['seen_num_choices'])}); always "
            f"answering the most frequent training label scores "
            f"{results['seen_majority_arg']:+.3f}; {{vs majority p}} = paired bootstrap "
            f"p-value of 'better than that' (the control passes where it is small):"
        )
        print(format_arg_table(results["seen_arg_table"], modes, settings=("seen_zero_shot",)))
    if results["minilm"]:
        m = results["minilm"]
        print(
            f"\nMiniLM (frozen), 16-shot: prompt+head ARG {m['prompt+head']['arg']:+.3f}, "
            f"head alone {m['head']['arg']:+.3f} (p = {m['p_prompt_better_than_head']:.2f})"
        )
    timings = results["timings_seconds"]
    print(
        "\ntime: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        + f"; load average at the start {results['load_average']['start'][0]:.1f}, at the "
        f"end {results['load_average']['end'][0]:.1f} on {os.cpu_count()} cores"
    )
