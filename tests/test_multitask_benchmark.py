"""Smoke test of `benchmarks/multitask_overhead.py` at tiny sizes: it runs, and its JSON has
the structure the results file documents (no timing assertions: ratios are only checked
to be finite and positive)."""
import json
import math
import os
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # runs the benchmark script (30-45 s); timings are never asserted
def test_multitask_overhead_smoke(tmp_path):
    out = tmp_path / "multitask_overhead.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.multitask_overhead", "--num_tasks=3",
         "--per_task_batch=4", "--input_dim=5", "--width=8", "--depth=1",
         "--num_classes=3", "--inner_steps=2", "--rounds=2", "--steps_per_round=1",
         "--warmup=1", f"--output={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "wrote" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("description", "targets_ratio_to_mtl", "notes", "model", "num_tasks", "global_batch",
                "environment", "results", "table", "jit_compile"):
        assert key in data, key
    assert data["num_tasks"] == 3 and data["global_batch"] == 12
    results = data["results"]
    expected = {"plain", "mtl", "pcgrad", "gradvac", "gradnorm", "sequential_reptile_k=2",
                "sequential_reptile_k=1", "ref_per_task_sum", "ref_per_task_pcgrad", "mtl_masked"}
    assert set(results) == expected
    for name, r in results.items():
        assert r["config"] == name
        assert r["timed_steps"] == 2
        for key in ("median_step_ms", "mean_step_ms", "ratio_to_mtl", "ratio_to_plain",
                    "ratio_to_mtl_mean", "ratio_to_plain_mean"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        for ref in ("mtl", "plain"):
            assert len(r[f"ratio_to_{ref}_per_round"]) == 2
            value = r[f"ratio_to_{ref}_median_of_rounds"]
            assert math.isfinite(value) and value > 0, (name, ref, value)
    assert results["mtl"]["ratio_to_mtl"] == 1.0
    assert results["plain"]["ratio_to_plain"] == 1.0
    for name in ("pcgrad", "gradvac", "sequential_reptile_k=2", "sequential_reptile_k=1"):
        assert isinstance(results[name]["meets_target"], bool)
        assert results[name]["target_ratio_to_mtl"] in (1.5, 1.05)
    assert "meets_target" not in results["gradnorm"]
    assert data["task_passes"] == "auto"
    assert isinstance(results["sequential_reptile_k=2"]["meets_target_vs_plain"], bool)
