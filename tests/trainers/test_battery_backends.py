"""One trainer battery, both backends (issues 29 and 30): the same entries and checks on
Keras's TensorFlow and JAX backends. The entries (tests/backend_battery.py) build every
trainer class of `tf_metaalign.trainers` (a test enforces it) with the constructor
arguments of its TensorFlow battery entry: DotProd, SAM / GSAM, the multi-task zoo, the
Reptile family, guided learning, MAML (second order with MAML++ and per-step BatchNorm
statistics; first order with Meta-SGD; both with gradient sharing), prompt FOMAML /
Reptile (on an MLP with an input offset, and on a prompted keras-hub GPT-2), and
prompt-only training of that GPT-2 (its backbone checked bit-identical). An entry whose
trainer class does not declare "jax" in `backends` is skipped on JAX ("not yet on JAX").

The checks (each trains the entry two ways and compares every number of the training
state: weights, model state, optimizer variables, the trainer's own state, integers
exactly; each also asserts that training moved what it compares):

1. `jit_equals_eager`: `compile(jit_compile=True)` == `run_eagerly=True`, at float64,
   weights and per-batch logs (loss and the entry's diagnostics).
2. `steps_per_execution`: 3 == 1 (5 batches an epoch: each epoch ends on a partial
   execution), with a Dropout layer; epoch logs too.
3. `mixed_bfloat16` (the TPU policy): trains, variables float32, everything finite, and
   the weight change of the run within 10% of float32's (and not identical to it).
4. `save_load`: `keras.saving.save_model(trainer)` + `load_model`: same class, config,
   compile config and state; continuing from the reloaded trainer == continuing the
   original (uninterrupted) one.
5. `model_as_itself`: after `fit`, `trainer.save` writes the USER'S model (it reloads as
   the model's class with the trained weights); `model.evaluate` / `predict` ==
   `trainer.evaluate` / `predict`, and the reloaded model evaluates the same (MAML,
   which evaluates episodes: `evaluate_tasks(inner_steps=0)` == `model.evaluate` on the
   query rows).
6. `resume`: `keras.callbacks.BackupAndRestore(save_freq=2)`, a run interrupted at the end
   of batch 3 of epoch 1 (after the save at batch 2: batch 3 is trained and lost), then a
   fresh trainer resumed from the backup == an uninterrupted run (with Dropout: its seed).
7. `devices` (JAX): `keras.distribution.DataParallel` over 2 host CPUs == 1 device.
8. `host_round_trip` (JAX): the jaxpr of the trainer's pure step
   (`tf_metaalign.backend.jax.stateless_train_step`, under `mixed_bfloat16`), every
   nested jaxpr and its HLO hold no host callback (`pure_callback`, `io_callback`,
   `debug_callback`); a second batch of the same shape neither retraces the step nor
   compiles anything.

`test_check_catches_a_flawed_trainer` shows every check failing on a trainer with the
one flaw it exists to catch (`backend_battery.BatteryTrainer(flaw=...)`).

On TensorFlow the TensorFlow battery stays as it is: tests/trainers/test_trainer_battery.py
(with tests/trainer_entries.py) runs its checks there, among them 2 replicas == 1
(MirroredStrategy), MultiWorkerMirroredStrategy, a SIGKILLed and restarted process, and
the step's graph and XLA lowering free of host round trips; checks 7 and 8 here are
JAX's counterparts of those and skip on TensorFlow.

A trainer with Dropout on JAX: while MetaTrainer's checkpointed copy of the seed state
shares the model's buffer (`backend_battery.jax_seed_state_aliasing`, detected at run time),
the Dropout checks (2, 6) are an xfail that says so; they run the day it is fixed.

Default run (measured on 2 shared cores): TensorFlow 35 tests, 124 s (60 s of CPU);
JAX 41 tests, 99 s (64 s of CPU) with DotProd, SAM/GSAM and the Reptile family ported.
Issue 30's entries add 4 default tests (MAML's resume, prompt FOMAML's jit == eager,
prompt-only GPT-2's save_load and model_as_itself) and the trainers' coverage test:
~40 s on JAX, ~30 s on TensorFlow (load ~4). The rest under -m slow (MAML: 27-165 s a
check on TensorFlow; the prompt trainers on GPT-2: 9-171 s). On TensorFlow, a check that
test_trainer_battery.py runs by default for the same trainer runs here under -m slow
(`covered_by_the_tensorflow_battery`: 23 tests, ~630 s of a loaded TensorFlow run's
durations, ~200 s quiet); TensorFlow's default here is then 36 tests (16 of them JAX-only skips).
"""

import dataclasses

import keras
import numpy as np
import pytest
from backend_battery import (
    BATCH,
    BY_NAME,
    CHECKS,
    DROPOUT,
    ENTRIES,
    BatteryTrainer,
    CompileCounter,
    InterruptAt,
    Interrupted,
    assert_logs_same,
    assert_same,
    _np,
    assert_trained,
    build,
    counting_train_step_calls,
    data,
    dtype_policy,
    fit,
    jax_seed_state_aliasing,
    jax_step_problems,
    snapshot,
    take_rows,
)
from backends import BACKEND, data_parallel, on_jax, on_tensorflow
from prompt_precision import float64_attention_softmax  # noqa: F401 (an entry's fixture)

BACKENDS = ("tensorflow", "jax")

_TF_BATTERY = "tests/trainers/test_trainer_battery.py"


#: On TensorFlow, a check of this battery that tests/trainers/test_trainer_battery.py runs in
#: the default suite for the same trainer (with the same constructor arguments) is a
#: duplicate there: this battery's check -> the TensorFlow battery's checks that cover it
#: (jit == eager: its eager == traced and XLA == traced; resume: its SIGKILL and resume).
_TF_BATTERY_CHECKS = {
    "jit_equals_eager": ("eager", "jit_compile"),
    "steps_per_execution": ("steps_per_execution",),
    "mixed_bfloat16": ("mixed_bfloat16",),
    "save_load": ("keras_round_trip",),
    "model_as_itself": ("model_after_fit",),
    "resume": ("backup_and_restore",),
}
#: entry -> the TensorFlow battery's entry (tests/trainer_entries.py) of the same trainer and
#: arguments. Not "plain" and "prompt_only_gpt2" (this battery's own trainer), "gsam" (its
#: TensorFlow checks are slow there), "guided" (here it converts Keras's Adam; there it
#: is given the package's). "meta_sgd_first_order": MAMLTrainer's resume runs there as the
#: "maml" entry's kill and resume (learned rates, gradient sharing, epoch schedules).
_TF_COVERED_BY = {
    **{
        name: name
        for name in (
            "dotprod",
            "sam",
            "multitask_pcgrad",
            "multitask_uw",
            "multitask_gradvac",
            "multitask_outputs_pcgrad",
            "sequential_reptile",
            "reptile",
            "fomaml",
            "multi_task_reptile",
            "prompt_fomaml",
        )
    },
    "meta_sgd_first_order": "maml",
}


def covered_by_the_tensorflow_battery(entry, check):
    """True where, on TensorFlow, test_trainer_battery.py's default suite runs `check` for
    `entry`'s trainer (every covering check default there, none an xfail): the check then
    runs here under -m slow on TensorFlow (the suite's budget); JAX runs it by default."""
    name = _TF_COVERED_BY.get(entry.name)
    if name is None or check not in _TF_BATTERY_CHECKS:
        return False
    from trainer_entries import BY_NAME as TF_BY_NAME

    tf_entry = TF_BY_NAME[name]
    return all(
        c not in tf_entry.slow and c not in tf_entry.xfail for c in _TF_BATTERY_CHECKS[check]
    )


def cases(check):
    """One pytest.param per entry: skipped on JAX where its trainer is not there yet,
    `slow` where the check is not in the entry's `default` (on TensorFlow also where the
    TensorFlow battery runs it by default: `covered_by_the_tensorflow_battery`), its known
    failures xfail."""
    assert check in CHECKS, check
    params = []
    for entry in ENTRIES:
        marks = []
        if on_jax() and not entry.on_jax():
            marks.append(pytest.mark.skip(reason="not yet on JAX"))
        if check in entry.xfail:
            reason, raises, backends = entry.xfail[check]
            if BACKEND in backends:
                marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
        if check not in entry.default or (
            on_tensorflow() and covered_by_the_tensorflow_battery(entry, check)
        ):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(entry, id=entry.name, marks=marks))
    return params


def _names(entry):
    return ["loss", *entry.diagnostics]


# ------------------------------------------------------------------- the checks


def check_jit_equals_eager(entry):
    x, y = data(entry)
    runs = []
    for options in ({"jit_compile": True}, {"run_eagerly": True}):
        trainer = build(entry, **options)
        if "jit_compile" in options:
            assert trainer.jit_compile is True, f"{entry.name}: Keras turned XLA off"
        initial = snapshot(trainer)
        frozen = [_np(v) for v in entry.frozen(trainer.model)] if entry.frozen else []
        logs, _ = fit(trainer, x, y)
        runs.append((initial, snapshot(trainer), logs))
        if entry.frozen:
            after = [_np(v) for v in entry.frozen(trainer.model)]
            assert frozen and len(after) == len(frozen)
            assert_same(
                dict(enumerate(after)), dict(enumerate(frozen)), 0.0, 0.0, "frozen variables"
            )
    (initial, jit, jit_logs), (_, eager, eager_logs) = runs
    assert_trained(initial, jit, entry.name)
    rtol, atol = entry.rtol_atol("jit_equals_eager")
    assert_same(jit, eager, rtol, atol, f"{entry.name}: jit_compile=True vs run_eagerly=True")
    assert_logs_same(jit_logs, eager_logs, _names(entry), rtol, atol)


def _dropout_trains(restored=False):
    """A trainer with Dropout trains on this backend (also after a restore), or the check
    is an xfail that says why."""
    aliasing = jax_seed_state_aliasing() if on_jax() else frozenset()
    if "created" in aliasing or (restored and aliasing):
        pytest.xfail(
            "JAX: MetaTrainer's copy of the Dropout seed state shares the model's buffer "
            f"({', '.join(sorted(aliasing))}: trainers.base._value_initializer / "
            "_restore_seed_states need ops.copy): fit fails with 'Attempt to donate the "
            "same buffer twice'"
        )


def check_steps_per_execution(entry):
    _dropout_trains()
    x, y = data(entry)
    runs = []
    for steps in (3, 1):
        trainer = build(entry, dropout=DROPOUT, steps_per_execution=steps)
        initial = snapshot(trainer)
        _, history = fit(trainer, x, y)
        runs.append((initial, snapshot(trainer), history))
    (initial, three, history_3), (_, one, history_1) = runs
    assert_trained(initial, one, entry.name)
    rtol, atol = entry.rtol_atol("steps_per_execution")
    assert_same(three, one, rtol, atol, f"{entry.name}: steps_per_execution=3 vs 1")
    assert sorted(history_3) == sorted(history_1), (sorted(history_3), sorted(history_1))
    assert_same(
        {k: np.asarray(v) for k, v in history_3.items()},
        {k: np.asarray(v) for k, v in history_1.items()},
        rtol,
        atol,
        "History",
    )


def check_mixed_bfloat16(entry):
    """bfloat16 keeps 8 bits of mantissa: a step's relative error is ~0.4%; 10 steps."""
    runs = {}
    for policy in ("float32", "mixed_bfloat16"):
        with dtype_policy(policy):
            x, y = data(entry, dtype="float32")
            trainer = build(entry, dtype=None)  # layers in the global policy
            assert not isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
            initial = snapshot(trainer)
            logs, _ = fit(trainer, x, y)
            runs[policy] = (initial, snapshot(trainer), logs, trainer)
    initial, final, logs, trainer = runs["mixed_bfloat16"]
    assert trainer.model_compute_dtype() == "bfloat16"
    assert_trained(initial, final, entry.name)
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)
    bad = [k for k, v in final.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
    assert not bad, f"{entry.name}: non-finite after mixed_bfloat16 training: {bad}"
    for name in _names(entry):
        values = np.asarray([step[name] for step in logs], dtype="float64")
        assert np.isfinite(values).all(), (name, values)
    reference_initial, reference_final = runs["float32"][:2]
    keys = [k for k in final if k.startswith("weights/")]
    for k in keys:
        np.testing.assert_array_equal(initial[k], reference_initial[k])  # the same start
    delta = np.concatenate([(final[k] - initial[k]).ravel() for k in keys])
    reference = np.concatenate([(reference_final[k] - reference_initial[k]).ravel() for k in keys])
    error = np.linalg.norm(delta - reference) / np.linalg.norm(reference)
    assert error <= 0.1, f"{entry.name}: bfloat16's weight change off float32's by {error:.3f}"
    assert error > 0, f"{entry.name}: bfloat16 and float32 runs identical (policy not applied?)"


def _json(config):
    import json

    return json.dumps(config, sort_keys=True, default=str)


def check_save_load(entry, tmp_path):
    x, y = data(entry)
    cut = 3 * BATCH  # 3 steps first: an odd step count (the phase of every=2 schedules)
    first = (take_rows(x, slice(None, cut)), take_rows(y, slice(None, cut)))
    rest = (take_rows(x, slice(cut, None)), take_rows(y, slice(cut, None)))
    trainer = build(entry)
    initial = snapshot(trainer)
    fit(trainer, *first, epochs=1)
    path = str(tmp_path / f"{entry.name}.keras")
    keras.saving.save_model(trainer, path)  # the trainer itself (trainer.save: the model)
    loaded = keras.saving.load_model(path)

    assert type(loaded) is type(trainer)
    assert _json(loaded.get_config()) == _json(trainer.get_config())
    assert _json(loaded.get_compile_config()) == _json(trainer.get_compile_config())
    saved = snapshot(trainer)
    assert_trained(initial, saved, entry.name)
    assert_same(snapshot(loaded), saved, 0.0, 0.0, f"{entry.name}: reloaded vs saved")
    fit(trainer, *rest, epochs=2)
    fit(loaded, *rest, epochs=2)
    rtol, atol = entry.rtol_atol("save_load")
    assert_same(
        snapshot(loaded),
        snapshot(trainer),
        rtol,
        atol,
        f"{entry.name}: continued from the reloaded vs the uninterrupted trainer",
    )


def _trainer_scores(trainer, x, y):
    logs = trainer.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    return logs, trainer.predict(x, verbose=0)


def check_model_as_itself(entry, tmp_path):
    x, y = data(entry)
    trainer = build(entry)
    fit(trainer, x, y, epochs=1)
    make_eval = entry.make_eval_data or entry.make_data
    x_eval, y_eval = make_eval(16, dtype="float64", seed=1)
    x_model, y_model = entry.model_inputs(x_eval), entry.model_targets(y_eval)
    model = trainer.model
    path = str(tmp_path / "model.keras")
    trainer.save(path)  # the user's model
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model), f"trainer.save wrote a {type(loaded).__name__}"
    assert_same(
        {str(i): w for i, w in enumerate(loaded.get_weights())},
        {str(i): w for i, w in enumerate(model.get_weights())},
        0.0,
        0.0,
        f"{entry.name}: the saved model's weights vs trainer.model's",
    )
    got = model.evaluate(x_model, y_model, batch_size=8, verbose=0, return_dict=True)
    again = loaded.evaluate(x_model, y_model, batch_size=8, verbose=0, return_dict=True)
    expected, predicted = (entry.trainer_scores or _trainer_scores)(trainer, x_eval, y_eval)
    assert sorted(got) == sorted(expected) and "loss" in got and len(got) > 1, (got, expected)
    rtol, atol = entry.rtol_atol("model_as_itself")
    as_arrays = lambda logs: {k: np.asarray(v) for k, v in logs.items()}  # noqa: E731
    assert_same(as_arrays(again), as_arrays(got), 0.0, 0.0, "reloaded vs trained model.evaluate")
    assert_same(as_arrays(got), as_arrays(expected), rtol, atol, "model vs trainer.evaluate")
    np.testing.assert_allclose(
        keras.tree.flatten(model.predict(x_model, verbose=0)),
        keras.tree.flatten(predicted),
        rtol=rtol,
        atol=atol,
    )


#: check 6: BackupAndRestore(save_freq=2) saves after epoch 0's batches 1 and 3 and epoch
#: 1's batches 0 and 2 (its counter runs across epochs); the run stops at the end of epoch
#: 1's batch 3, so batch 3 is trained and lost with the run.
SAVE_FREQ, STOP_EPOCH, STOP_BATCH = 2, 1, 3


class SnapshotAt(keras.callbacks.Callback):
    """The trainer's `snapshot` at the end of batch `batch` of epoch `epoch`, or with
    `epoch=None` at the start of training (after the callbacks before it: a restore)."""

    def __init__(self, epoch=None, batch=None):
        super().__init__()
        self.at, self.epoch, self.taken = (epoch, batch), None, None

    def on_train_begin(self, logs=None):
        if self.at == (None, None):
            self.taken = snapshot(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            self.taken = snapshot(self.model)


def check_resume(entry, tmp_path):
    _dropout_trains(restored=True)
    x, y = data(entry)
    reference = build(entry, dropout=DROPOUT)
    initial = snapshot(reference)
    fit(reference, x, y)
    uninterrupted = snapshot(reference)
    assert_trained(initial, uninterrupted, entry.name)

    backup_dir = str(tmp_path / "backup")
    interrupted = build(entry, dropout=DROPOUT)
    saved = SnapshotAt(STOP_EPOCH, STOP_BATCH - 1)  # what the last backup holds
    callbacks = [
        keras.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ),
        saved,
        InterruptAt(STOP_EPOCH, STOP_BATCH),
    ]
    with pytest.raises(Interrupted):
        fit(interrupted, x, y, callbacks=callbacks)
    resumed = build(entry, dropout=DROPOUT)
    restored = SnapshotAt()
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
    fit(resumed, x, y, callbacks=[backup, restored])
    # The resumed run started from the backup (not afresh), all of it...
    assert_trained(initial, saved.taken, entry.name)
    assert_same(restored.taken, saved.taken, 0.0, 0.0, f"{entry.name}: restored vs backed up")
    # ... and ended where the uninterrupted run did: no step lost or repeated.
    rtol, atol = entry.rtol_atol("resume")
    assert_same(snapshot(resumed), uninterrupted, rtol, atol, f"{entry.name}: resumed vs not")


def check_devices(entry):
    x, y = data(entry)
    runs = []
    for n in (1, 2):
        with data_parallel(n):
            trainer = build(entry)
            initial = snapshot(trainer)
            logs, _ = fit(trainer, x, y)
            runs.append((initial, snapshot(trainer), logs))
    (initial, one, logs_1), (_, two, logs_2) = runs
    assert_trained(initial, one, entry.name)
    rtol, atol = entry.rtol_atol("devices")
    assert_same(two, one, rtol, atol, f"{entry.name}: 2 devices vs 1")
    assert_logs_same(logs_2, logs_1, _names(entry), rtol, atol)


def check_host_round_trip(entry, second_rows=BATCH):
    """The step has no host callback, and a batch of a shape the trainer has seen compiles
    nothing. A trainer with an "every k" schedule (k <= 4 here) gets one program per
    combination of the schedule's flags it asks (`backend.jax.static_schedule_flag`): the
    first fit runs 4 steps, so every phase has been compiled before the second fit."""
    warm = 4 * BATCH
    with dtype_policy("mixed_bfloat16"):
        x, y = data(entry, dtype="float32")
        trainer = build(entry, dtype=None)
        assert trainer.jit_compile is True
        first = (take_rows(x, slice(None, warm)), take_rows(y, slice(None, warm)))
        second = (
            take_rows(x, slice(warm, warm + second_rows)),
            take_rows(y, slice(warm, warm + second_rows)),
        )
        with counting_train_step_calls(trainer) as traces, CompileCounter() as compiled:
            fit(trainer, *first, epochs=1)
        assert 1 <= traces[0] <= 3 and compiled.count >= 1, (traces, compiled.count)
        first = (take_rows(x, slice(None, BATCH)), take_rows(y, slice(None, BATCH)))
        problems = jax_step_problems(trainer, first)
        assert not problems, f"{entry.name}: the step calls the host:\n  " + "\n  ".join(problems)
        with counting_train_step_calls(trainer) as traces, CompileCounter() as compiled:
            fit(trainer, *second, epochs=1)
        assert (traces[0], compiled.count) == (0, 0), (
            f"{entry.name}: a second batch of the same shape traced the step {traces[0]} "
            f"times and compiled {compiled.count} programs"
        )


# ---------------------------------------------------------------- the tests


def _use_fixtures(entry, request):
    for name in entry.fixtures:
        request.getfixturevalue(name)


@pytest.mark.parametrize("entry", cases("jit_equals_eager"))
def test_jit_equals_eager(entry, float64, request):
    _use_fixtures(entry, request)
    check_jit_equals_eager(entry)


@pytest.mark.parametrize("entry", cases("steps_per_execution"))
def test_steps_per_execution_3_equals_1(entry, float64, request):
    _use_fixtures(entry, request)
    check_steps_per_execution(entry)


@pytest.mark.parametrize("entry", cases("mixed_bfloat16"))
def test_mixed_bfloat16_trains_finite_and_close_to_float32(entry, request):
    _use_fixtures(entry, request)
    check_mixed_bfloat16(entry)


@pytest.mark.parametrize("entry", cases("save_load"))
def test_save_load_then_continue_equals_uninterrupted(entry, float64, tmp_path, request):
    _use_fixtures(entry, request)
    check_save_load(entry, tmp_path)


@pytest.mark.parametrize("entry", cases("model_as_itself"))
def test_wrapped_model_evaluates_predicts_and_saves_as_itself(entry, float64, tmp_path, request):
    _use_fixtures(entry, request)
    check_model_as_itself(entry, tmp_path)


@pytest.mark.parametrize("entry", cases("resume"))
def test_resume_from_backup_equals_uninterrupted(entry, float64, tmp_path, request):
    _use_fixtures(entry, request)
    check_resume(entry, tmp_path)


@pytest.mark.parametrize("entry", cases("devices"))
def test_one_device_equals_two_devices(entry, float64, request):
    _use_fixtures(entry, request)
    if on_tensorflow():
        pytest.skip(f"JAX's keras.distribution (TensorFlow: {_TF_BATTERY}, 2 replicas == 1)")
    check_devices(entry)


@pytest.mark.parametrize("entry", cases("host_round_trip"))
def test_step_has_no_host_callback_and_compiles_once(entry, request):
    _use_fixtures(entry, request)
    if on_tensorflow():
        pytest.skip(f"JAX's step (TensorFlow: {_TF_BATTERY}, no_host_round_trip)")
    check_host_round_trip(entry)


# -------------------------------------------------------- every check can fail

#: flaw of BatteryTrainer -> the check that must catch it (and its arguments).
FLAWS = {
    "eager": (check_jit_equals_eager, {}, "jit_compile=True vs run_eagerly=True"),
    "steps_per_execution": (check_steps_per_execution, {}, "steps_per_execution=3 vs 1"),
    "bfloat16": (check_mixed_bfloat16, {}, "weight change off float32's"),
    "config": (check_save_load, {"tmp_path": None}, "continued from the reloaded"),
    "model_save": (
        check_model_as_itself,
        {"tmp_path": None},
        "trainer.save wrote a BatteryTrainer",
    ),
    "resume": (check_resume, {"tmp_path": None}, "restored vs backed up"),
    "devices": (check_devices, {}, "2 devices vs 1"),
    "host_callback": (check_host_round_trip, {}, "the step calls the host"),
    "second_batch_shape": (
        check_host_round_trip,
        {"second_rows": BATCH - 1},
        "a second batch of the same shape",
    ),
}
_JAX_ONLY = ("devices", "host_callback", "second_batch_shape")


@pytest.mark.parametrize("flaw", list(FLAWS))
def test_check_catches_a_flawed_trainer(flaw, request, tmp_path):
    """Each check fails (AssertionError) on `BatteryTrainer` with the flaw it exists to
    catch ("second_batch_shape": no flaw, a second batch of 7 rows must recompile)."""
    if on_tensorflow() and flaw in _JAX_ONLY:
        pytest.skip("a check of JAX's step and devices")
    check, kwargs, message = FLAWS[flaw]
    if check not in (check_mixed_bfloat16, check_host_round_trip):
        request.getfixturevalue("float64")
    kwargs = {k: tmp_path if k == "tmp_path" else v for k, v in kwargs.items()}
    trainer_flaw = None if flaw == "second_batch_shape" else flaw
    period = 4 if flaw == "config" else 2  # the reloaded config says 2 (the default)
    entry = dataclasses.replace(
        BY_NAME["plain"],
        make_trainer=lambda model, data_dtype: BatteryTrainer(
            model, period=period, flaw=trainer_flaw
        ),
    )
    with pytest.raises(AssertionError, match=message):
        check(entry, **kwargs)


def test_entries_name_known_checks_and_every_check_runs_by_default():
    for entry in ENTRIES:
        for field in ("default", "xfail", "tolerances"):
            unknown = set(getattr(entry, field)) - set(CHECKS)
            assert not unknown, f"{entry.name}.{field} names no check: {sorted(unknown)}"
    library = [e for e in ENTRIES if e.name != "plain"]
    for check in CHECKS:
        runs = [e.name for e in library if check in e.default]
        assert len(runs) >= 2, f"{check}: in the default suite for {runs} only"


def test_tensorflow_duplicates_name_tensorflow_battery_entries():
    """`_TF_COVERED_BY` names entries of both batteries (a renamed entry would otherwise
    leave its checks default on TensorFlow without anyone noticing)."""
    if not on_tensorflow():
        pytest.skip("the TensorFlow battery runs on TensorFlow")
    from trainer_entries import BY_NAME as TF_BY_NAME

    for name, tf_name in _TF_COVERED_BY.items():
        assert name in BY_NAME and tf_name in TF_BY_NAME, (name, tf_name)
    assert set(_TF_BATTERY_CHECKS) <= set(CHECKS)


def test_every_trainer_of_the_package_has_an_entry():
    """Every trainer class that `tf_metaalign.trainers` exports (its `__all__`) is built by
    at least one entry (MetaTrainer itself: through the battery's own BatteryTrainer)."""
    import tf_metaalign.trainers as T

    from tf_metaalign.trainers import MetaTrainer

    exported = []
    for name in T.__all__:
        try:
            value = getattr(T, name)
        except ImportError:  # a stand-in name on this backend: not a trainer here
            continue
        if isinstance(value, type) and issubclass(value, MetaTrainer) and value is not MetaTrainer:
            exported.append(name)
    covered = set()
    for entry in ENTRIES:
        try:
            covered.add(entry.trainer_class().__name__)
        except ImportError:
            pass
    assert len(exported) >= 10, exported
    missing = sorted(set(exported) - covered)
    assert not missing, f"trainers without a battery entry: {missing}"
