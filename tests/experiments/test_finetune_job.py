"""`python -m trainers.finetune` end to end (digits, tiny flags), the shared program
helpers, and the Colab quick-start notebook executed top to bottom."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_job(*args, timeout=120):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "trainers.finetune", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_finetune_digits_end_to_end(tmp_path):
    proc = _run_job(
        "--dataset=digits",
        "--steps=6",
        "--log_every=3",
        "--batch_size=32",
        "--weight=0.3",
        f"--output_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # The table: a header row and one row per run.
    lines = out.splitlines()
    header = next(i for i, l in enumerate(lines) if l.startswith("run "))
    for col in ("test acc", "test loss", "mean G1.G2", "mean cos", "ms/step"):
        assert col in lines[header]
    assert lines[header + 2].startswith("baseline") and lines[header + 3].startswith("dotprod")
    assert "baseline = DotProdTrainer(weight=0" in out
    # Progress while it runs: the phases, and each run's step 1 and every --log_every
    # steps, before the table; and no warnings (the job passes shuffle=False with its
    # dataset, and TensorFlow's start-up chatter is filtered).
    progress = lines[:header]
    for phase in ("loading scikit-learn digits", "built digits_mlp", "done in"):
        assert any(phase in l for l in progress), (phase, progress)
    for name in ("baseline", "dotprod"):
        for step in ("1/6", "3/6", "6/6"):
            assert any(
                l.startswith("[") and f"] {name}: step {step}  loss " in l for l in progress
            ), (name, step, progress)
        assert any(f"] {name}: test acc " in l for l in progress)
    assert "UserWarning" not in out + proc.stderr, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in results["runs"]] == ["baseline", "dotprod"]
    assert results["flags"]["steps"] == 6 and results["flags"]["dataset"] == "digits"
    assert results["dataset"]["num_classes"] == 10 and results["dataset"]["test_examples"] == 450
    for r in results["runs"]:
        for key in (
            "test_accuracy",
            "test_loss",
            "mean_grad_dot",
            "mean_grad_cosine",
            "step_time_s",
            "first_step_s",
        ):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["step_time_s"] > 0
    assert results["runs"][1]["weight"] == 0.3 and results["runs"][0]["weight"] == 0.0
    for name in ("baseline", "dotprod"):
        assert results["history"][name]["steps"] == [3, 6]
        assert len(results["history"][name]["grad_dot"]) == 2
        assert list((tmp_path / "tensorboard" / name).rglob("events.out.tfevents.*"))
    # Same init and data order: the first logged interval's G1.G2 is measured on the
    # same pairs at the same first weights, so the two runs start from the same value
    # (they differ only through the regulariser's effect on steps 2-3).
    h = results["history"]
    assert abs(h["baseline"]["grad_dot"][0] - h["dotprod"]["grad_dot"][0]) < 0.5 * abs(
        h["baseline"]["grad_dot"][0]
    )


def test_finetune_single_algorithm_and_bad_flags(tmp_path):
    proc = _run_job(
        "--dataset=digits",
        "--algorithm=dotprod",
        "--steps=2",
        "--log_every=2",
        "--batch_size=16",
        "--every=2",
        "--method=exact",
        f"--output_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in results["runs"]] == ["dotprod"]
    assert results["runs"][0]["every"] == 2 and results["runs"][0]["method"] == "exact"

    from absl import flags

    from trainers import finetune, settings

    for argv, name in (
        (["--steps=0"], "--steps"),
        (["--batch_size=1"], "--batch_size"),
        (["--alpha=fast"], "--alpha"),
        (["--weight=-1"], "--weight"),
        (["--runs=sam,sam"], "--runs"),
        (["--learning_rate=0"], "--learning_rate"),
    ):
        values = flags.FlagValues()
        settings.define_flags_from(finetune.Config, values)
        values(["finetune", *argv])
        with pytest.raises(ValueError, match=name):
            settings.config_from_flags(finetune.Config, values)
    proc = _run_job("--dataset=digits", "--steps=0", f"--output_dir={tmp_path}")
    assert proc.returncode != 0 and "`--steps` must be >= 1; got 0." in proc.stderr


def test_common_helpers(tmp_path):
    import numpy as np

    from trainers import common

    table = common.format_table(
        [{"run": "a", "x": 1.23456, "y": float("nan")}, {"run": "bb", "x": np.float32(2.0)}],
        [("run", "run", "s"), ("x", "x", ".2f"), ("y", "why", ".1f")],
    )
    assert table.splitlines()[0].split() == ["run", "x", "why"]
    assert table.splitlines()[2].split() == ["a", "1.23", "n/a"]
    assert table.splitlines()[3].split() == ["bb", "2.00", "-"]
    path = common.write_json(
        tmp_path / "d" / "r.json",
        {"a": np.float32(1.5), "b": np.arange(2), "c": float("inf"), "p": tmp_path},
    )
    assert json.loads(path.read_text()) == {"a": 1.5, "b": [0, 1], "c": None, "p": str(tmp_path)}
    with pytest.raises(ValueError, match="output_dir"):
        common.prepare_output_dir("")
    with pytest.raises(ValueError, match="columns"):
        common.format_table([], [])
    timer = common.StepTimer(warmup=1)
    for _ in range(3):
        timer.on_train_batch_begin(0)
        time.sleep(0.01)
        timer.on_train_batch_end(0)
    assert len(timer.warm_times) == 2 and timer.mean() >= 0.009
    common.write_summary(tmp_path / "tb", {"acc": 0.5, "bad": float("nan")}, step=3)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_startup_log_filter_and_progress_callback():
    from trainers import common, startup

    log = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795398117.552194    6243 port.cc:153] oneDNN custom operations are on.\n"
        "W0000 00:00:1795398117.6    6243 some_file.cc:12] a warning\n"
        "E0000 00:00:1795398119.141297    6243 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL\n"
        "E0000 00:00:1795398119.2    6243 other.cc:1] a real error\n"
        "a Python line\n"
    )
    assert startup.filter_startup_log(log, 2, have_gpu=False) == (
        "E0000 00:00:1795398119.2    6243 other.cc:1] a real error\na Python line\n"
    )
    kept = startup.filter_startup_log(log, 0, have_gpu=True).splitlines()
    assert len(kept) == 5 and not any("absl::InitializeLog" in l for l in kept)
    assert any("cuInit" in l for l in kept)  # with a GPU, a failed cuInit matters

    lines = []
    callback = common.ProgressCallback(
        lines.append, "run", total_steps=5, every=2, metrics=("loss", "grad_dot")
    )
    callback.on_train_begin()
    for step in range(5):
        callback.on_train_batch_end(step, {"loss": 1.0 + step, "grad_dot": 0.5, "accuracy": 0.1})
    assert [l.split("  ")[0] for l in lines] == [
        "run: step 1/5",
        "run: step 2/5",
        "run: step 4/5",
        "run: step 5/5",
    ]
    assert "loss 1.0000  grad_dot 0.5000  first step" in lines[0] and "accuracy" not in lines[0]
    assert "ms/step" in lines[1]


def test_colab_quickstart_notebook_runs_offline():
    nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")
    pytest.importorskip("ipykernel", reason="pip install ipykernel")
    pytest.importorskip("matplotlib", reason="pip install matplotlib")
    nb = nbformat.read(ROOT / "colab" / "dotprod_quickstart.ipynb", as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    elapsed = time.perf_counter() - start
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "baseline" in outputs and "dotprod" in outputs
    assert any(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert elapsed < 60, f"notebook took {elapsed:.0f} s (budget: 60 s)"


@pytest.mark.slow  # ~20-40 s: 6 runs in a subprocess (the report's algebra is tested below)
def test_finetune_study_runs_seeds_intervals_and_significance(tmp_path):
    """`--runs` with `--seeds`: every run for every seed, lambda_max and G1.G2 measured
    at the final weights, the summary with intervals and paired differences; a stopped
    study resumed with `--resume` == the uninterrupted one."""
    study_args = (
        "--dataset=digits",
        "--steps=4",
        "--log_every=2",
        "--batch_size=16",
        "--seeds=2",
        "--runs=baseline,sam,reptile",
        "--sharpness_examples=32",
        "--sharpness_iterations=3",
        "--alignment_pairs=1",
    )
    proc = _run_job(*study_args, f"--output_dir={tmp_path}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "paired differences (same seed)" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["rows"]) == ["0", "1"]
    for seed_rows in results["rows"].values():
        assert sorted(seed_rows) == ["baseline", "reptile", "sam"]
        for row in seed_rows.values():
            for key in ("test_accuracy", "sharpness", "final_grad_dot", "step_ratio"):
                assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row)
            assert 1 <= row["sharpness_iterations"] <= 3
        assert seed_rows["baseline"]["step_ratio"] == 1.0
    summary = results["summary"]
    assert sorted(summary["differences"]) == ["reptile - baseline", "sam - baseline"]
    assert summary["per_run"]["sam"]["test_accuracy"]["n"] == 2

    # Stopped after seed 0 (its partial file as an old study wrote it: rows only), then
    # --resume: seed 0's rows are kept as they were, seed 1 is run again and equals the
    # uninterrupted study's.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (resumed_dir / "partial_rows.json").write_text(json.dumps({"0": results["rows"]["0"]}))
    proc = _run_job(*study_args, f"--output_dir={resumed_dir}", "--resume", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seeds [0] done" in proc.stderr + proc.stdout
    resumed = json.loads((resumed_dir / "results.json").read_text())
    assert resumed["rows"]["0"] == results["rows"]["0"]
    for run, row in resumed["rows"]["1"].items():
        for key in ("test_accuracy", "test_loss", "sharpness", "final_grad_dot"):
            assert math.isclose(row[key], results["rows"]["1"][run][key], rel_tol=1e-6), (run, key)
    assert sorted(resumed["history"]) == ["baseline@1", "reptile@1", "sam@1"]
    # Every seed done: --resume only reports (the rows and histories as they were).
    proc = _run_job(*study_args, f"--output_dir={resumed_dir}", "--resume", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((resumed_dir / "results.json").read_text())
    assert again["rows"] == resumed["rows"] and again["history"] == resumed["history"]


def test_study_intervals_and_paired_differences():
    from trainers.finetune_report import interval, summarize

    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302652729911275 / math.sqrt(3))
    assert interval([5.0]) == (5.0, None)
    rows = {
        s: {
            "baseline": {"test_accuracy": 0.5 + 0.1 * s, "sharpness": 2.0},
            "sam": {"test_accuracy": 0.52 + 0.1 * s, "sharpness": 2.0 + 0.01 * (-1) ** s},
        }
        for s in range(4)
    }
    diff = summarize(rows, ["baseline", "sam"])["differences"]["sam - baseline"]
    # Paired: the seeds' spread cancels, +0.02 on every seed is significant...
    assert diff["test_accuracy"]["mean"] == pytest.approx(0.02)
    assert diff["test_accuracy"]["significant"]
    # ... and a difference of +-0.01 around 0 is not.
    assert not diff["sharpness"]["significant"]
