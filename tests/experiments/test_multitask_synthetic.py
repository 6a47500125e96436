"""The synthetic experiment (trainers/multitask_synthetic.py) at the program's defaults:
the findings that hold at every setting tried (docs/multitask.md has the sweep).

The paper's claim that Sequential Reptile ENDS with a higher inter-task cosine than MTL
holds at the default setting (the paper's Fig. 3 problem: final cosine +0.41 against MTL's
-0.33 to -0.48; MTL's end point moves between runs by float noise, since SGD ends in a
cycle around a loss cusp, and every end point seen is below 0) and is asserted there; its
last-20% average is higher by only 0.05 at the default, and over the six settings of the
sweep in docs/multitask.md it is not robust, which the docs report."""

import numpy as np
import pytest

from trainers.experiments import synthetic as S
from trainers import multitask_synthetic as program


def test_sequential_reptile_reaches_a_lower_loss_than_mtl_and_aligns_better_than_reptile():
    """... and ends with a higher inter-task cosine than MTL (see the module docstring)."""
    runs = {m: program.run_method(m, 1800) for m in ("mtl", "sequential_reptile", "reptile")}
    tails = {m: program.tail_averages(points) for m, (_, points) in runs.items()}
    loss, cosine = {m: t[0] for m, t in tails.items()}, {m: t[1] for m, t in tails.items()}
    assert loss["sequential_reptile"] < loss["mtl"] - 2.0
    assert cosine["sequential_reptile"] > cosine["reptile"] + 0.2
    final = {m: S.mean_pairwise_cosine(points[-1]) for m, (_, points) in runs.items()}
    assert final["sequential_reptile"] > 0.3 and final["mtl"] < 0.0
    # Every run starts at the paper's start point and records phi at every step
    # (Sequential Reptile: its slow weights).
    for method, (_, points) in runs.items():
        np.testing.assert_allclose(points[0], S.START)
    assert len(runs["mtl"][1]) == 1800 // 3 + 1 and len(runs["sequential_reptile"][1]) == 1800 + 1


def test_program_end_to_end_writes_table_json_and_png(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.multitask_synthetic",
            "--steps=60",
            f"--output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for method in program.METHODS:
        assert method in out.stdout
    assert (tmp_path / "results.json").exists() and (tmp_path / "trajectories.png").exists()


def test_program_runs_the_zoo(tmp_path):
    """`--methods=zoo`: every registry method but UW (negative losses, said in the output),
    with `--method_options`; a bad option is a usage error naming the flag."""
    import json
    import subprocess
    import sys

    from tf_metaalign.algorithms.multitask import method_names

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.multitask_synthetic",
            "--steps=30",
            "--methods=zoo",
            "--method_options=cagrad.calpha=0.4",
            f"--output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    expected = ["mtl"] + [m for m in method_names()[1:] if m != "uw"]
    assert [r["method"] for r in runs] == expected
    assert "'zoo' without uw" in out.stdout
    for run in runs:
        assert np.all(np.isfinite(run["final_phi"]))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.multitask_synthetic",
            "--steps=3",
            "--methods=cagrad",
            "--method_options=cagrad.calpha=x",
            f"--output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "`method_options`: cagrad" in bad.stderr


def test_registry_methods_run_with_their_options():
    """Any registry method runs on the synthetic problem with options passed through.
    Oracle: CAGrad with calpha = 0 is the average gradient (d = g0 = sum_t g_t / T,
    rescale 1 + 0^2 = 1), so CAGrad(calpha=0) at learning rate 0.3 takes MTL's ("sum")
    steps at 0.1, and calpha = 0.4 does not."""
    mtl = program.run_method("mtl", 60, learning_rate=0.1)[1]
    averaged = program.run_method(
        "cagrad", 60, learning_rate=0.3, method_options={"cagrad": {"calpha": 0.0}}
    )[1]
    np.testing.assert_allclose(averaged, mtl, rtol=1e-5, atol=1e-4)
    conflict_averse = program.run_method(
        "cagrad", 60, learning_rate=0.3, method_options="cagrad.calpha=0.4"
    )[1]
    assert np.max(np.abs(conflict_averse - mtl)) > 0.1
    # Options are checked against the method's class, naming the flag.
    with pytest.raises(ValueError, match=r"`method_options`: cagrad .*`calpha` must be"):
        program.run_method("cagrad", 3, method_options="cagrad.calpha=-1")
    with pytest.raises(ValueError, match=r"`method`: unknown \['nope'\]"):
        program.run_method("nope", 3)
    # Uncertainty weighting has no optimum on negative losses: refused with the reason.
    with pytest.raises(ValueError, match="task losses are negative"):
        program.run_method("uw", 3)
