"""The few-shot program's report (`python -m trainers.fewshot`): Chang & Lipson's speed-up,
the tables and the plots."""

from __future__ import annotations

#: The original / gradient-sharing pairs whose speed-up is reported.
GS_PAIRS = (("maml", "maml_gs"), ("metasgd", "metasgd_gs"), ("mamlpp", "mamlpp_gs"))


def first_epoch_of_best(curve) -> int:
    """The earliest epoch (1-based) at which `curve` (validation accuracy per epoch)
    reaches its maximum."""
    values = [float(v) for v in curve]
    if not values:
        raise ValueError("`curve` is empty.")
    best = max(values)
    return values.index(best) + 1


def epochs_to_reach(curve, target) -> int | None:
    """The earliest epoch (1-based) at which `curve` reaches `target` (None: never)."""
    for i, v in enumerate(curve):
        if float(v) >= float(target):
            return i + 1
    return None


def speed_up(og_curve, gs_curve) -> float:
    """Chang & Lipson's speed-up (E_OG - E_GS) / E_GS, E = the earliest epoch reaching the
    run's best validation accuracy (`first_epoch_of_best`)."""
    e_og, e_gs = first_epoch_of_best(og_curve), first_epoch_of_best(gs_curve)
    return (e_og - e_gs) / e_gs


def speed_ups(runs) -> list[dict]:
    """Per OG/GS pair run with the same task batch, rate scale and seed: the speed-up."""
    index = {(r["method"], r["task_batch"], r["inner_lr_scale"], r["seed"]): r for r in runs}
    out = []
    for og, gs in GS_PAIRS:
        for (m, tb, scale, seed), r in index.items():
            if m != og or (gs, tb, scale, seed) not in index:
                continue
            g = index[(gs, tb, scale, seed)]
            out.append(
                {
                    "pair": f"{og} vs {gs}",
                    "task_batch": tb,
                    "inner_lr_scale": scale,
                    "seed": seed,
                    "epoch_og": r["best_epoch"],
                    "epoch_gs": g["best_epoch"],
                    "speed_up": speed_up(r["val_curve"], g["val_curve"]),
                    "best_val_og": r["best_val"],
                    "best_val_gs": g["best_val"],
                }
            )
            # A variant for runs still improving at their last epoch (then E = the last
            # epoch for both): the epochs GS needs to reach OG's best validation accuracy.
            reach = epochs_to_reach(g["val_curve"], r["best_val"])
            out[-1]["epoch_gs_to_og_best"] = reach
            out[-1]["speed_up_to_og_best"] = (
                None if reach is None else (r["best_epoch"] - reach) / reach
            )
    return out


RUN_COLUMNS = (
    ("method", "method", "s"),
    ("task_batch", "tb", "d"),
    ("inner_learning_rate", "alpha", "g"),
    ("seed", "seed", "d"),
    ("best_val", "best val", ".3f"),
    ("best_epoch", "@ep", "d"),
    ("test_5way_str", "5-way 1-shot", "s"),
    ("test_20way_str", "20-way 1-shot", "s"),
    ("official_str", "official 20 runs", "s"),
    ("seconds", "time s", ".0f"),
)
SPEED_COLUMNS = (
    ("pair", "pair", "s"),
    ("task_batch", "tb", "d"),
    ("inner_lr_scale", "lr x", "g"),
    ("seed", "seed", "d"),
    ("epoch_og", "E_OG", "d"),
    ("epoch_gs", "E_GS", "d"),
    ("speed_up", "speed-up", "+.0%"),
    ("best_val_og", "best val OG", ".3f"),
    ("best_val_gs", "best val GS", ".3f"),
    ("epoch_gs_to_og_best", "E_GS(OG best)", "d"),
    ("speed_up_to_og_best", "speed-up(OG best)", "+.0%"),
)
SINE_COLUMNS = (
    ("method", "method", "s"),
    ("seed", "seed", "d"),
    ("steps", "meta-batches", "d"),
    ("mse_0_str", "MSE unadapted", "s"),
    ("mse_1_str", "MSE 1 step", "s"),
    ("mse_10_str", "MSE 10 steps", "s"),
    ("seconds", "time s", ".0f"),
)


def _pm(mean, ci, percent=True):
    if mean is None:
        return None
    if percent:
        return f"{100 * mean:.1f} ± {100 * ci:.1f}"
    return f"{mean:.3f} ± {ci:.3f}"


def table_rows(runs):
    rows = []
    for r in runs:
        row = dict(r)
        row["test_5way_str"] = _pm(r.get("test_5way"), r.get("test_5way_ci"))
        row["test_20way_str"] = _pm(r.get("test_20way"), r.get("test_20way_ci"))
        row["official_str"] = _pm(r.get("official"), r.get("official_ci"))
        rows.append(row)
    return rows


def sine_rows(sine):
    rows = []
    for r in sine:
        row = dict(r)
        for n in (0, 1, 10):
            row[f"mse_{n}_str"] = _pm(r[f"mse_{n}"], r[f"mse_{n}_ci"], percent=False)
        rows.append(row)
    return rows


def plot(runs, out) -> list:
    """val_accuracy.png and sharing.png (GS runs) in `out`; returns the paths written."""
    from trainers.common import figure

    paths = []
    groups = sorted({(r["task_batch"], r["inner_lr_scale"]) for r in runs})
    fig = figure(figsize=(5 * len(groups), 4))
    axes = fig.subplots(1, len(groups), squeeze=False)
    for ax, (tb, scale) in zip(axes[0], groups):
        for r in runs:
            if (r["task_batch"], r["inner_lr_scale"]) == (tb, scale):
                ax.plot(
                    range(1, len(r["val_curve"]) + 1),
                    r["val_curve"],
                    marker="o",
                    label=f"{r['method']} s{r['seed']}",
                )
        ax.set_title(f"task batch {tb}, inner lr x{scale:g}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("5-way 1-shot validation accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "val_accuracy.png")
    fig.savefig(paths[-1], dpi=100)
    gs_runs = [r for r in runs if r.get("sharing_m")]
    if gs_runs:
        fig = figure(figsize=(10, 4))
        axes = fig.subplots(1, 2)
        for ax, key, label in zip(
            axes, ("sharing_m", "sharing_lambda"), ("sigmoid(m)", "sigmoid(lambda)")
        ):
            for r in gs_runs:
                ax.plot(
                    range(1, len(r[key]) + 1),
                    r[key],
                    marker="o",
                    label=f"{r['method']} tb{r['task_batch']} x{r['inner_lr_scale']:g} "
                    f"s{r['seed']}",
                )
            ax.set_xlabel("epoch")
            ax.set_ylabel(f"mean {label}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "sharing.png")
        fig.savefig(paths[-1], dpi=100)
    return paths


def run_line(r) -> str:
    """The progress line after one run."""
    return (
        f"{r['method']} tb{r['task_batch']}: best val {r['best_val']:.3f} (epoch "
        f"{r['best_epoch']}), test 5-way {_pm(r['test_5way'], r['test_5way_ci'])}, 20-way "
        f"{_pm(r['test_20way'], r['test_20way_ci'])}"
        + (f", official {_pm(r['official'], r['official_ci'])}" if "official" in r else "")
        + f"  ({r['seconds']:.0f} s)"
    )


def print_tables(runs, speed, sine) -> None:
    """The runs' table, the speed-ups and the sinusoid check, on stdout."""
    from trainers import common

    print()
    print(
        "Omniglot, accuracy in % ± 95% t-interval (test: over episodes; official: over "
        "Lake's 20 runs), at the final weights:"
    )
    print(common.format_table(table_rows(runs), RUN_COLUMNS))
    if speed:
        print(
            "\nSpeed-up (E_OG - E_GS) / E_GS, E = earliest epoch reaching the run's best "
            "validation accuracy:"
        )
        print(common.format_table(speed, SPEED_COLUMNS))
    if sine:
        print("\nSinusoid regression (K=10), query MSE of held-out waves ± 95% t-interval:")
        print(common.format_table(sine_rows(sine), SINE_COLUMNS))
