"""`trainers.finetune --runs=...`: the study's loop over seeds and runs (the run stage
of `finetune_runs` per run, the report of `finetune_report` at the end)."""

from __future__ import annotations

import time

from trainers.finetune_runs import DESCRIPTIONS, SCALE_NOTE

#: The study's rows (and histories) of the seeds done so far, in `--output_dir`.
PARTIAL = "partial_rows.json"


def write_partial(output_dir, rows_by_seed: dict, histories: dict) -> None:
    """The seeds done so far, kept if the study is stopped (`--resume` continues from them;
    the summary and tables are written at the end)."""
    from trainers import common

    common.write_json(
        output_dir / PARTIAL,
        {"rows": {str(k): v for k, v in rows_by_seed.items()}, "histories": histories},
    )


def resumed_seeds(config, output_dir, seeds, progress) -> tuple[dict, dict]:
    """`(rows_by_seed, histories)` of the seeds a stopped study finished, when
    `config.resume`: read from `output_dir / PARTIAL`, each seed kept if it has a row for
    every run of `config.runs` (the other runs' rows dropped); empty otherwise. A file
    written before histories were kept holds rows only (`{seed: {run: row}}`)."""
    import json

    path = output_dir / PARTIAL
    if not (config.resume and path.is_file()):
        return {}, {}
    saved = json.loads(path.read_text())
    rows = saved.get("rows", saved) if isinstance(saved, dict) else {}
    kept = {
        int(seed): {run: seed_rows[run] for run in config.runs}
        for seed, seed_rows in rows.items()
        if int(seed) in seeds and all(run in seed_rows for run in config.runs)
    }
    histories = {
        name: history
        for name, history in saved.get("histories", {}).items()
        if name.rpartition("@")[0] in config.runs and int(name.rpartition("@")[2]) in kept
    }
    progress(
        f"resumed from {path}: seeds {sorted(kept) or 'none'} done"
        + (f" ({len(histories)} run histories)" if histories else " (histories not kept)")
    )
    return kept, histories


def study(config, recorded_settings, settings_and_options, prepare, output_dir, progress, devices):
    """`--runs`: every run for every seed, the final measurements, the summary.

    `config`: the program's `Config` (`recorded_settings`: what results.json records of it);
    `settings_and_options(config, seed)` and `prepare(config, seed, progress)` are
    `trainers.finetune`'s (passed in: the program runs as __main__, and importing it from
    here would load a second copy of it)."""
    import keras

    from trainers import common
    from trainers.finetune_report import MEASURES, study_tables, summarize
    from trainers.finetune_runs import final_measurements, run_one

    t0 = time.perf_counter()
    seeds = [config.seed + i for i in range(config.seeds)]
    progress(
        f"finetune study: dataset={config.dataset}, runs={','.join(config.runs)}, seeds "
        f"{seeds}, {config.steps} steps of batch {config.batch_size}; backend "
        f"{keras.backend.backend()}, devices: "
        f"{', '.join(devices)}; results to {output_dir}"
    )
    rows_by_seed, histories = resumed_seeds(config, output_dir, seeds, progress)
    dataset_name = config.dataset  # the loaded task's own name once a seed runs here
    for seed in seeds:
        if seed in rows_by_seed:
            continue
        # Each run traces its trainer and its Hessian-vector products: without this, a
        # MiniLM study grew past 10 GB by its third seed (measured) and was stopped.
        import gc

        import keras

        keras.backend.clear_session()
        gc.collect()
        settings, options = settings_and_options(config, seed)
        splits, model, initial_weights = prepare(config, seed, progress)
        dataset_name = splits.name
        rows_by_seed[seed] = {}
        for run in config.runs:
            name = f"{run}@{seed}"
            row, history, _ = run_one(
                name, model, initial_weights, splits, options, settings, output_dir, progress
            )
            row.update(
                final_measurements(
                    model,
                    splits,
                    config.batch_size,
                    config.sharpness_examples,
                    config.sharpness_iterations,
                    config.alignment_pairs,
                    seed,
                )
            )
            progress(
                f"{name}: lambda_max {row['sharpness']:.4g} ({row['sharpness_iterations']} "
                f"HVPs), final G1.G2 {row['final_grad_dot']:.4g}"
            )
            rows_by_seed[seed][run] = row
            histories[name] = history
        reference = rows_by_seed[seed].get("baseline") or rows_by_seed[seed][config.runs[0]]
        for row in rows_by_seed[seed].values():
            row["step_ratio"] = row["step_ms"] / reference["step_ms"]
        write_partial(output_dir, rows_by_seed, histories)
    summary = summarize(rows_by_seed, config.runs)
    per_run, differences = study_tables(summary)
    settings, options = settings_and_options(config, config.seed)
    header = (
        f"dataset={dataset_name}: {len(config.runs)} runs x {len(seeds)} seeds, "
        f"{settings['optimizer']} lr={settings['learning_rate']:g}, {config.steps} steps of batch "
        f"{config.batch_size}; dotprod weight={options['weight']:g}, rho={config.rho:g}, "
        f"asam_rho={config.asam_rho:g}, gsam_alpha={config.gsam_alpha:g}, "
        f"inner_learning_rate={options['inner_learning_rate']:g}\n"
        "mean ± 95% t interval over the seeds; lambda_max and G1.G2 at the final weights on "
        f"the first {config.sharpness_examples} training examples (inference mode); cost x = "
        "median step time / the baseline's (same seed).\n"
        + "\n".join(f"  {run}: {DESCRIPTIONS[run]}" for run in config.runs)
        + f"\n{SCALE_NOTE}"
    )
    progress(f"done in {progress.elapsed():.1f} s")
    print(header)
    print(per_run)
    print("\npaired differences (same seed); * = the 95% interval excludes 0")
    print(differences)
    results = {
        "flags": recorded_settings,
        "settings": settings,
        "options": options,
        "measures": [k for k, _, _ in MEASURES],
        "descriptions": {run: DESCRIPTIONS[run] for run in config.runs},
        "rows": {str(s): rows for s, rows in rows_by_seed.items()},
        "summary": summary,
        "history": histories,
        "total_seconds": time.perf_counter() - t0,
        "table": per_run,
        "differences_table": differences,
        "backend": keras.backend.backend(),
        "devices": devices,
    }
    path = common.write_json(output_dir / "results.json", results)
    print(f"results: {path}")
