"""`benchmarks/prompt_overhead.py`: the committed results file and a smoke run at tiny sizes
have the documented structure, and every ratio in them is recomputed from their own
timings, memory peaks, slot bytes and parameter counts (no timing is asserted: only the
arithmetic and the structure, plus what is exact: the prompt-only configurations train
exactly the prompt's parameters and keep optimizer slots for nothing else)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "prompt_overhead.json"
T5_KEYS = (
    "config",
    "median_step_ms",
    "mean_step_ms",
    "round_median_step_ms",
    "timed_steps",
    "first_step_s",
    "peak_memory_bytes",
    "memory_kind",
    "model_params",
    "trainable_params",
    "trainable_bytes",
    "optimizer_slot_bytes",
)


def check_ratio(value, numerator, denominator):
    if value is None:  # NaN is written as null: only for a zero denominator
        assert denominator in (0, None), (numerator, denominator)
        return
    np.testing.assert_allclose(value, numerator / denominator, rtol=1e-12)


def check_results(data, rounds):
    """The structure of the JSON, and every ratio recomputed from its own numbers."""
    for key in (
        "description",
        "model",
        "batch_size",
        "prompt_length",
        "meta_tasks",
        "inner_steps",
        "optimizer",
        "environment",
        "results",
        "ratios",
        "table",
        "ratio_table",
        "notes",
        "wall_time_s",
    ):
        assert key in data, key
    env = data["environment"]
    assert len(env["load_average_start"]) == 3 and len(env["load_average_end"]) == 3
    results, L = data["results"], data["prompt_length"]
    t5 = data["model"]["t5"]
    for name, r in results.items():
        for key in T5_KEYS:
            assert key in r, (name, key)
        assert r["config"] == name
        assert len(r["round_median_step_ms"]) == rounds
        expected_steps = rounds * (
            data["meta_steps_per_round"]
            if name in ("t5_fomaml", "t5_reptile")
            else data["steps_per_round"]
        )
        assert r["timed_steps"] == expected_steps, name
        assert r["median_step_ms"] > 0 and r["mean_step_ms"] > 0
        assert r["trainable_bytes"] == 4 * r["trainable_params"]  # float32
        assert r["optimizer_slot_bytes"] > 0
    # Exact: what trains. Shallow: [L, hidden]; deep: 3 x [L, layers x 2 x heads x kv].
    shallow = L * t5["hidden_dim"]
    deep = 3 * L * t5["num_layers"] * 2 * t5["num_heads"] * t5["key_value_dim"]
    full = results["t5_full"]["trainable_params"]
    assert full == results["t5_full"]["model_params"]
    assert results["t5_shallow_prompt"]["trainable_params"] == shallow
    assert results["t5_deep_prompt"]["trainable_params"] == deep
    assert results["t5_shallow_both"]["trainable_params"] == full + shallow
    assert results["t5_deep_both"]["trainable_params"] == full + deep
    # Slots for the prompt only: fewer slot bytes than the prompt-free full model by far.
    for name in ("t5_shallow_prompt", "t5_deep_prompt"):
        assert results[name]["optimizer_slot_bytes"] < results["t5_full"]["optimizer_slot_bytes"]
    # The same-length baselines are the plain backbones (every weight trains; MiniLM's
    # head too, as in bert_full).
    for name in ("t5_full_long", "gpt2_full", "gpt2_full_long"):
        if name in results:
            assert results[name]["trainable_params"] == results[name]["model_params"], name
    if "bert_full_long" in results:
        assert (
            results["bert_full_long"]["trainable_params"]
            == results["bert_full"]["trainable_params"]
            > results["bert_full"]["model_params"]
        )
    gpt2 = data["model"].get("gpt2")
    if gpt2 is not None:  # GPT-2: shallow [L, hidden]; deep [L, layers x 2 x hidden]
        full = results["gpt2_full"]["trainable_params"]
        shallow = L * gpt2["hidden_dim"]
        deep = L * gpt2["num_layers"] * 2 * gpt2["hidden_dim"]
        assert results["gpt2_shallow_prompt"]["trainable_params"] == shallow
        assert results["gpt2_deep_prompt"]["trainable_params"] == deep
        assert results["gpt2_shallow_both"]["trainable_params"] == full + shallow
        assert results["gpt2_deep_both"]["trainable_params"] == full + deep
    for name in ("t5_fomaml", "t5_reptile"):
        r = results[name]
        assert r["tasks"] == data["meta_tasks"] and r["inner_steps"] == data["inner_steps"]
        np.testing.assert_allclose(
            r["median_per_task_ms"], r["median_step_ms"] / r["tasks"], rtol=1e-12
        )
        mode = data["prompt_mode_meta"]
        pieces = (
            r["inner_steps"] * results[f"t5_{mode}_prompt"]["median_step_ms"]
            + results[f"t5_{mode}_both"]["median_step_ms"]
        )
        np.testing.assert_allclose(r["pieces_per_task_ms"], pieces, rtol=1e-12)
        check_ratio(r["per_task_over_pieces"], r["median_per_task_ms"], pieces)
        assert r["inner_state_bytes"] > 0
    # Every ratio from the results' own numbers.
    assert data["ratios"], "no ratios"
    for pair, entry in data["ratios"].items():
        a, b = pair.split("/")
        for key in (
            "median_step_ms",
            "mean_step_ms",
            "peak_memory_bytes",
            "optimizer_slot_bytes",
            "trainable_params",
        ):
            check_ratio(entry[f"{key}_ratio"], results[a][key], results[b][key])
        if "min_step_ms_ratio" in entry:
            check_ratio(
                entry["min_step_ms_ratio"], results[a]["min_step_ms"], results[b]["min_step_ms"]
            )
        per_round = [
            x / y
            for x, y in zip(results[a]["round_median_step_ms"], results[b]["round_median_step_ms"])
        ]
        np.testing.assert_allclose(entry["step_ms_ratio_per_round"], per_round, rtol=1e-12)
        np.testing.assert_allclose(
            entry["step_ms_ratio_median_of_rounds"], float(np.median(per_round)), rtol=1e-12
        )
    for pair in (
        "t5_shallow_prompt/t5_full",
        "t5_deep_prompt/t5_full",
        "t5_fomaml/t5_full",
        "t5_reptile/t5_full",
    ):
        assert pair in data["ratios"], pair


def test_committed_results_are_consistent():
    """The committed `benchmarks/results/prompt_overhead.json` (the default run)."""
    data = json.loads(RESULTS.read_text())
    check_results(data, data["rounds"])
    assert data["model"]["bert"] is None or "bert_shallow_prompt/bert_full" in data["ratios"]
    for name in data["results"]:
        assert math.isfinite(data["results"][name]["median_step_ms"])


def test_unknown_configuration_is_a_clear_error():
    from benchmarks import prompt_overhead

    with pytest.raises(ValueError, match="`--configs`: unknown configuration"):
        prompt_overhead.check_configs(["t5_full", "t5_prefix"], bert=True)
    assert prompt_overhead.check_configs(["t5_full", "bert_full"], bert=False) == ["t5_full"]
    assert prompt_overhead.check_configs(["t5_full", "gpt2_full"], bert=True, decoder=False) == [
        "t5_full"
    ]


@pytest.mark.slow  # runs the benchmark script: 2 min on 2 quiet cores, 3.5-7 at load 5-6 (tracing)
def test_prompt_overhead_smoke(tmp_path):
    out = tmp_path / "prompt_overhead.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.prompt_overhead",
            "--t5_size=tiny",
            "--t5_vocabulary_size=64",
            "--batch_size=2",
            "--encoder_length=5",
            "--decoder_length=3",
            "--prompt_length=2",
            "--meta_tasks=2",
            "--inner_steps=2",
            "--rounds=2",
            "--steps_per_round=1",
            "--warmup=1",
            "--nobert",
            "--gpt2_size=tiny",
            "--gpt2_batch_size=2",
            "--gpt2_sequence_length=5",
            f"--output={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "wrote" in proc.stdout
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and data["model"]["bert"] is None
    assert set(data["results"]) == {
        "t5_full",
        "t5_full_long",
        "t5_shallow_prompt",
        "t5_deep_prompt",
        "t5_shallow_both",
        "t5_deep_both",
        "t5_fomaml",
        "t5_reptile",
        "gpt2_full",
        "gpt2_full_long",
        "gpt2_shallow_prompt",
        "gpt2_deep_prompt",
        "gpt2_shallow_both",
        "gpt2_deep_both",
    }
    check_results(data, rounds=2)
