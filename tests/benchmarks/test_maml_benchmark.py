"""Smoke test of `benchmarks/maml_step.py` at tiny sizes: it runs, writes its JSON with the
expected structure, and its ratios are finite and positive. No timing assertions.

The PyTorch peer is replaced by a stub script printing the peer's two result lines, run
with this interpreter (so the subprocess path and the parsing are exercised without torch).
"""

import json
import math
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PEER = """\
print("torch second-order meta-step: 0.250 s")
print("torch first-order meta-step: 0.125 s")
"""


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # runs the benchmark script (30-45 s); timings are never asserted
def test_maml_step_benchmark_tiny(tmp_path):
    peer = tmp_path / "fake_peer.py"
    peer.write_text(FAKE_PEER)
    out = tmp_path / "maml_step.json"
    args = [
        sys.executable,
        "-m",
        "benchmarks.maml_step",
        "--configs=fomaml,fomaml_gs",
        "--filters=4",
        "--image_size=8",
        "--conv_blocks=1",
        "--tasks=2",
        "--queries=2",
        "--inner_steps=1",
        "--rounds=1",
        "--steps_per_round=1",
        "--warmup=1",
        f"--torch_python={sys.executable}",
        f"--peer={peer}",
        "--peer_runs=2",
        f"--output={out}",
    ]
    proc = subprocess.run(
        args,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in (
        "description",
        "episode",
        "model",
        "memory_kind",
        "targets",
        "environment",
        "results",
        "torch",
        "table",
    ):
        assert key in data, key
    assert data["episode"]["tasks"] == 2 and data["episode"]["inner_steps"] == 1
    assert set(data["results"]) == {"fomaml", "fomaml_gs"}
    plain, shared = data["results"]["fomaml"], data["results"]["fomaml_gs"]
    for r in (plain, shared):
        assert _finite_positive(r["median_step_ms"]) and _finite_positive(r["mean_step_ms"])
        assert r["timed_steps"] == 1 and r["first_order"] is True
        assert r["peak_mb"] is None or r["peak_mb"] >= 0
        assert _finite_positive(r["torch_ratio"]) and r["torch_s"] == 0.125
    assert plain["gradient_sharing"] is False and shared["gradient_sharing"] is True
    assert _finite_positive(shared["sharing_ratio"])
    assert isinstance(shared["meets_sharing_target"], bool)
    assert isinstance(plain["meets_torch_target"], bool) and "meets_torch_target" not in shared
    runs = data["torch"]["runs"]
    assert [r["run"] for r in runs] == ["before", "after"]
    assert all(r["second_order_s"] == 0.25 and r["first_order_s"] == 0.125 for r in runs)
    assert data["torch"]["reference_s"] == {"second": 0.25, "first": 0.125}
    assert data["torch"]["skipped"] is None
