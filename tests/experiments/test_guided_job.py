"""`python -m trainers.guided` end to end on tiny flags: the table, results.json, the plots."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_guided_experiment_end_to_end(tmp_path):
    pytest.importorskip("django", reason="the Django translation catalogs: pip install django")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.guided",
            "--steps=4",
            "--batch_size=8",
            "--guidance_size=8",
            "--dim=16",
            "--heads=2",
            "--ff_dim=16",
            "--beta_1_inits=0.5",
            "--optimizers=adafactor",
            f"--output_dir={tmp_path}",
        ],
        # One optimizer (each is 5 traced runs, ~50 s on 2 cores); LAMB takes the same
        # program path, and GuidedTrainer's own tests run it.
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert {r["optimizer"] for r in rows} == {"adafactor"}
    assert len(rows) == 5  # baseline, lr, beta_1, both, beta_1@0.5
    assert results["flags"]["steps"] == 4
    for r in rows:
        assert math.isfinite(r["dev_loss"]) and 0.0 <= r["dev_token_accuracy"] <= 1.0, r
    for opt in ("adafactor",):
        for png in (f"{opt}_schedules.png", f"{opt}_beta_1_inits.png"):
            assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "dev loss" in proc.stdout
