"""The synthetic experiment (trainers/multitask_synthetic.py) at the program's defaults:
the findings that hold at every setting tried (docs/multitask.md has the sweep).

The paper's claim that Sequential Reptile ENDS with a higher inter-task cosine than MTL
holds at the default setting (the paper's Fig. 3 problem: final cosine +0.41 against MTL's
-0.33 to -0.48; MTL's end point moves between runs by float noise, since SGD ends in a
cycle around a loss cusp, and every end point seen is below 0) and is asserted there; its
last-20% average is higher by only 0.05 at the default, and over the six settings of the
sweep in docs/multitask.md it is not robust, which the docs report."""
import numpy as np

from tf_metaalign.data import synthetic as S
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
        [sys.executable, "-m", "trainers.multitask_synthetic", "--steps=60",
         f"--output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for method in program.METHODS:
        assert method in out.stdout
    assert (tmp_path / "results.json").exists() and (tmp_path / "trajectories.png").exists()
