"""`trainers.finetune --runs=...`: the study's loop over seeds and runs (the run stage
of `finetune_runs` per run, the report of `finetune_report` at the end)."""

from __future__ import annotations

import time

from trainers.finetune_runs import DESCRIPTIONS, SCALE_NOTE


def study(FLAGS, recorded_flags, settings_and_options, prepare, output_dir, progress, devices):
    """`--runs`: every run for every seed, the final measurements, the summary.

    `FLAGS`: the program's flags (`recorded_flags`: the names results.json records);
    `settings_and_options(seed)` and `prepare(seed, progress)` are `trainers.finetune`'s
    (passed in: the program runs as __main__, and importing it would define its flags
    twice)."""
    from absl import flags

    from trainers import common
    from trainers.finetune_report import MEASURES, study_tables, summarize
    from trainers.finetune_runs import final_measurements, run_one

    t0 = time.perf_counter()
    seeds = [FLAGS.seed + i for i in range(FLAGS.seeds)]
    progress(
        f"finetune study: dataset={FLAGS.dataset}, runs={','.join(FLAGS.runs)}, seeds "
        f"{seeds}, {FLAGS.steps} steps of batch {FLAGS.batch_size}; devices: "
        f"{', '.join(devices)}; results to {output_dir}"
    )
    rows_by_seed, histories = {}, {}
    for seed in seeds:
        # Each run traces its trainer and its Hessian-vector products: without this, a
        # MiniLM study grew past 10 GB by its third seed (measured) and was stopped.
        import gc

        import keras

        keras.backend.clear_session()
        gc.collect()
        settings, options = settings_and_options(seed)
        splits, model, initial_weights = prepare(seed, progress)
        rows_by_seed[seed] = {}
        for run in FLAGS.runs:
            name = f"{run}@{seed}"
            row, history, _ = run_one(
                name, model, initial_weights, splits, options, settings, output_dir, progress
            )
            row.update(
                final_measurements(
                    model,
                    splits,
                    FLAGS.batch_size,
                    FLAGS.sharpness_examples,
                    FLAGS.sharpness_iterations,
                    FLAGS.alignment_pairs,
                    seed,
                )
            )
            progress(
                f"{name}: lambda_max {row['sharpness']:.4g} ({row['sharpness_iterations']} "
                f"HVPs), final G1.G2 {row['final_grad_dot']:.4g}"
            )
            rows_by_seed[seed][run] = row
            histories[name] = history
        reference = rows_by_seed[seed].get("baseline") or rows_by_seed[seed][FLAGS.runs[0]]
        for row in rows_by_seed[seed].values():
            row["step_ratio"] = row["step_ms"] / reference["step_ms"]
        # The seeds done so far, kept if the study is stopped (rows only; the summary
        # and tables are written at the end).
        common.write_json(
            output_dir / "partial_rows.json", {str(k): v for k, v in rows_by_seed.items()}
        )
    summary = summarize(rows_by_seed, FLAGS.runs)
    per_run, differences = study_tables(summary)
    settings, options = settings_and_options(FLAGS.seed)
    header = (
        f"dataset={splits.name}: {len(FLAGS.runs)} runs x {len(seeds)} seeds, "
        f"{settings['optimizer']} lr={settings['learning_rate']:g}, {FLAGS.steps} steps of batch "
        f"{FLAGS.batch_size}; dotprod weight={options['weight']:g}, rho={FLAGS.rho:g}, "
        f"asam_rho={FLAGS.asam_rho:g}, gsam_alpha={FLAGS.gsam_alpha:g}, "
        f"inner_learning_rate={options['inner_learning_rate']:g}\n"
        "mean ± 95% t interval over the seeds; lambda_max and G1.G2 at the final weights on "
        f"the first {FLAGS.sharpness_examples} training examples (inference mode); cost x = "
        "median step time / the baseline's (same seed).\n"
        + "\n".join(f"  {run}: {DESCRIPTIONS[run]}" for run in FLAGS.runs)
        + f"\n{SCALE_NOTE}"
    )
    progress(f"done in {progress.elapsed():.1f} s")
    print(header)
    print(per_run)
    print("\npaired differences (same seed); * = the 95% interval excludes 0")
    print(differences)
    results = {
        "flags": common.flag_values(flags, recorded_flags),
        "settings": settings,
        "options": options,
        "measures": [k for k, _, _ in MEASURES],
        "descriptions": {run: DESCRIPTIONS[run] for run in FLAGS.runs},
        "rows": {str(s): rows for s, rows in rows_by_seed.items()},
        "summary": summary,
        "history": histories,
        "total_seconds": time.perf_counter() - t0,
        "table": per_run,
        "differences_table": differences,
    }
    path = common.write_json(output_dir / "results.json", results)
    print(f"results: {path}")
