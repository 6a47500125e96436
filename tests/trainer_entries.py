"""The trainers that `test_trainer_battery.py` checks: one `TrainerEntry` per trainer.

A new trainer joins the battery by appending ONE `TrainerEntry(...)` to `ENTRIES` at the
bottom of this file (see the two existing entries, and the top of
test_trainer_battery.py for what each field is used for). Nothing else needs editing:
the in-process checks and the subprocess worker (battery_worker.py) both look entries
up here by name.

Everything an entry builds must be deterministic (fixed seeds, unshuffled data), tiny
(an MLP of a few units) and fresh on every call (a new optimizer / loss object each time).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import keras
import numpy as np
from backend_battery import prompt_mlp, prompt_task_data, regression_data

# ------------------------------------------------------------------ shared building blocks


def mlp(dtype="float64", dropout=0.0, seed=0):
    """Input(4) -> Dense(5, tanh) -> [Dropout(dropout, seed=7)] -> Dense(2).

    `dtype=None` builds the layers in the global dtype policy (mixed_float16 check).
    """
    keras.utils.set_random_seed(seed)
    input_dtype = dtype or keras.backend.floatx()
    layers = [
        keras.Input((4,), dtype=input_dtype),
        keras.layers.Dense(5, activation="tanh", dtype=dtype),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=7, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
    return keras.Sequential(layers)


def contiguous_rows(global_batch, replicas):
    """Row order for one replica that matches `replicas` replicas: the identity.

    Right for any trainer whose step only depends on the global batch as a whole
    (per-replica gradients are all-reduced before anything else uses them).
    """
    del replicas
    return np.arange(global_batch)


def halves_of_each_replica_shard(global_batch, replicas):
    """Row order for a trainer that splits EACH REPLICA'S batch into halves b1 | b2.

    Keras gives replica r rows [r*p, (r+1)*p) of a global batch (p = global/replicas);
    replica r's b1 is the first p//2 of them. One replica must therefore see all the
    replicas' b1 rows first, then all their b2 rows: for 8 rows and 2 replicas,
    [0, 1, 4, 5, 2, 3, 6, 7].
    """
    p = global_batch // replicas
    h = p // 2
    first = [r * p + j for r in range(replicas) for j in range(h)]
    second = [r * p + j for r in range(replicas) for j in range(h, p)]
    return np.asarray(first + second)


# ---------------------------------------------------------------------------- the entry


@dataclasses.dataclass(frozen=True)
class TrainerEntry:
    """How the battery builds, trains and compares one trainer.

    Attributes:
      name: the pytest id and the name the worker script is given.
      make_trainer: `(model, data_dtype) -> trainer` (not compiled). `data_dtype` is the
        dtype of the training data (e.g. for held-out data the trainer keeps).
      compile_kwargs: `() -> dict` for `trainer.compile(**kwargs)`; NEW objects each call
        (the loss reads keras floatx when it is made). Use `optimizer=`, `loss=`, `metrics=`.
      state_variables: `.name`s of the trainer's algorithm-state variables (counters,
        learned values, meta-optimizer slots): every variable of the trainer that is
        neither the model's, the optimizer's nor the MetaTrainer base class's (a check
        enforces it). The snapshots compare all such variables whether listed or not.
      diagnostics: logged names (besides "loss") whose per-batch values must agree across
        replica counts / workers.
      replica_order: `(global_batch, replicas) -> permutation of range(global_batch)`: the
        order in which ONE replica must see the rows of a global batch to take exactly
        the step that `replicas` replicas take on it.
      make_model: `(dtype, dropout, seed) -> keras.Model`; dtype None = global policy.
      make_data: `(n, dtype, seed) -> (x, y)` numpy arrays.
      batch_size: the global batch size.
      dtype: the dtype of exactness checks (floatx is set to it while they run).
      tolerance: (rtol, atol) of every float comparison (integers are always compared
        exactly); keep it far below what one lost or repeated step changes.
      tolerances: check name -> (rtol, atol) overriding `tolerance` for that check.
      xfail: check name -> (reason, exception type): the check is expected to fail for
        this trainer with that exception (`xfail(strict=True, raises=...)`: another
        exception is a failure, and the day the check passes the marker must go).
      slow: check names run only with `-m slow` for this trainer.
      make_eval_data: `(n, dtype, seed) -> (x, y)`: what `trainer.evaluate` takes
        (ordinary model batches, or e.g. `{"inputs", "task_id"}` for MultiTaskTrainer).
      model_inputs: `x -> x` of the wrapped model, from `make_eval_data`'s x.
      ragged_last_batch: "trained" where a last batch of one row (NumPy data, a user
        cannot set drop_remainder) is trained on, on 1 and 2 replicas; else a regex of
        the ValueError the trainer refuses it with (a static structure it needs).
      ragged_replicas_exact: the ragged last batch gives the same training on 2 replicas
        as on 1. Keras's own fit does not: each replica's loss is the mean over ITS rows
        divided by the replica count, so uneven shards (1 row and 0 rows) weigh rows
        differently; MultiTaskTrainer normalises by the global per-task counts and is.
      logged_loss_tracks_progress: False where the logged "loss" is an objective whose
        weights move during training (Nash-MTL's alpha-weighted task losses grow as the
        gradients shrink): the mixed precision check then compares `evaluate`'s loss on
        `make_eval_data` before and after training instead.
      evaluates_model_batches: False where `trainer.evaluate` takes something else than
        `make_eval_data` (MAML's episodes: adapt, then score the query sets).
    """

    name: str
    make_trainer: Callable[[keras.Model, str], keras.Model]
    compile_kwargs: Callable[[], dict]
    state_variables: tuple[str, ...]
    diagnostics: tuple[str, ...] = ()
    replica_order: Callable[[int, int], np.ndarray] = contiguous_rows
    make_model: Callable[..., keras.Model] = mlp
    make_data: Callable[..., tuple] = regression_data
    batch_size: int = 8
    dtype: str = "float64"
    tolerance: tuple[float, float] = (1e-7, 1e-10)
    tolerances: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    xfail: Mapping[str, tuple[str, type]] = dataclasses.field(default_factory=dict)
    slow: frozenset = frozenset()
    make_eval_data: Callable[..., tuple] = regression_data
    model_inputs: Callable[[object], object] = lambda x: x
    evaluates_model_batches: bool = True
    logged_loss_tracks_progress: bool = True
    ragged_last_batch: str = "trained"
    ragged_replicas_exact: bool = False


def _mse():
    return keras.losses.MeanSquaredError()


# ------------------------------------------------------------------------------ entries


def _dotprod_trainer(model, data_dtype):
    from tf_metaalign.trainers import DotProdTrainer

    # every=2: the pair counter decides which steps are regularised, so a lost or
    # repeated step (resume, steps_per_execution, ...) shows in the weights.
    return DotProdTrainer(model, weight=0.3, every=2)


def _dotprod_compile():
    return dict(optimizer=keras.optimizers.Adam(0.01), loss=_mse(), metrics=["mae"])


def _sam_trainer(model, data_dtype):
    from tf_metaalign.trainers import SAMTrainer

    # ASAM (the scaled perturbation covers SAM's) and every=2: the step counter decides
    # which steps are perturbed, so a lost or repeated step shows in the weights.
    return SAMTrainer(model, rho=0.2, adaptive=True, every=2)


def _gsam_trainer(model, data_dtype):
    from tf_metaalign.trainers import GSAMTrainer

    # rho follows the learning-rate schedule (the optimizer's iterations): a lost or
    # repeated step changes rho and the weights.
    return GSAMTrainer(model, rho=0.2, rho_min=0.05, alpha=0.3, learning_rate_range=(0.002, 0.02))


def _gsam_compile():
    schedule = keras.optimizers.schedules.PolynomialDecay(0.02, 20, end_learning_rate=0.002)
    return dict(optimizer=keras.optimizers.Adam(schedule), loss=_mse(), metrics=["mae"])


def _guided_trainer(model, data_dtype):
    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers import GuidedTrainer

    guidance = regression_data(8, dtype=data_dtype, seed=5)
    return GuidedTrainer(model, guidance, meta_optimizer=O.Adam(0.05))


def _guided_compile():
    from tf_metaalign import optimizers as O

    return dict(optimizer=O.Adam(0.02), loss=_mse(), metrics=["mae"])


def _sequential_reptile_trainer(model, data_dtype):
    from tf_metaalign.trainers import SequentialReptileTrainer

    # inner_steps=3: 10 steps per run end mid-trajectory (fit discards it), the kill of
    # the backup check comes mid-trajectory; the reset commits the slots every outer step.
    return SequentialReptileTrainer(
        model, inner_steps=3, outer_learning_rate=0.5, reset_inner_optimizer=True
    )


def _sequential_reptile_compile():
    return dict(optimizer=keras.optimizers.Adam(0.01), loss=_mse(), metrics=["mae"])


#: k of the stacked trainers' entries.
STACKED_K = 2


def stacked_regression_data(n, dtype="float64", seed=0, k=STACKED_K):
    """`regression_data` of n*k rows as n elements `[k, ...]` (stack_axis=1: a global batch
    is [B, k, ...], so Keras's split of axis 0 gives each replica its share of every
    inner batch, and the rows of a batch keep `contiguous_rows` order)."""
    x, y = regression_data(n * k, dtype=dtype, seed=seed)
    return x.reshape(n, k, -1), y.reshape(n, k, -1)


def _reptile_trainer(model, data_dtype):
    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers import ReptileTrainer

    return ReptileTrainer(model, inner_steps=STACKED_K, inner_optimizer=O.Adam(0.05), stack_axis=1)


def _fomaml_trainer(model, data_dtype):
    from tf_metaalign.trainers import FOMAMLTrainer

    return FOMAMLTrainer(model, inner_steps=STACKED_K - 1, inner_optimizer=0.1, stack_axis=1)


def task_stacked_regression_data(n, dtype="float64", seed=0, tasks=2, k=STACKED_K):
    """n elements `[T, k, ...]` (stack_axis=1: a global batch is [B, T, k, ...]). Plain
    arrays: the battery indexes x by rows (the {"inputs", "task_id"} format is tested in
    tests/algorithms/test_reptile.py)."""
    x, y = regression_data(n * tasks * k, dtype=dtype, seed=seed)
    return x.reshape(n, tasks, k, -1), y.reshape(n, tasks, k, -1)


def _multi_task_reptile_trainer(model, data_dtype):
    from tf_metaalign.trainers import MultiTaskReptileTrainer

    return MultiTaskReptileTrainer(model, inner_steps=STACKED_K, inner_optimizer=0.1, stack_axis=1)


def _outer_compile():
    return dict(optimizer=keras.optimizers.Adam(0.02), loss=_mse(), metrics=["mae"])


def multitask_data(n, dtype="float64", seed=0, num_tasks=3):
    """Mixed multi-task batches: x = {"inputs": (n, 4), "task_id": int32 (n,)}, the tasks
    interleaved (row i is task i % num_tasks); task 1's targets are negated, so its
    gradient conflicts with the others' (PCGrad projects, GradNorm's weights move)."""
    x, y = regression_data(n, dtype=dtype, seed=seed)
    task_id = (np.arange(n) % num_tasks).astype("int32")
    y = np.where((task_id == 1)[:, None], -y, y).astype(dtype)
    return {"inputs": x, "task_id": task_id}, y


def _multitask_trainer(method, **options):
    def make(model, data_dtype):
        from tf_metaalign.trainers import MultiTaskTrainer

        return MultiTaskTrainer(model, num_tasks=3, method=method, **options)

    return make


def _multitask_compile():
    return dict(optimizer=keras.optimizers.Adam(0.01), loss=_mse(), metrics=["mae"])


ENTRIES = [
    TrainerEntry(
        name="dotprod",
        make_trainer=_dotprod_trainer,
        compile_kwargs=_dotprod_compile,
        state_variables=("count",),  # the `every` schedule's pair counter
        diagnostics=("grad_dot", "grad_cosine"),
        replica_order=halves_of_each_replica_shard,
        # The finite difference divides rounding noise by alpha ~ sqrt(eps): two exact
        # ways of running differ by up to ~1e-9 (measured), one lost step by ~1e-2.
        tolerance=(1e-6, 1e-8),
    ),
    TrainerEntry(
        name="guided",
        make_trainer=_guided_trainer,
        compile_kwargs=_guided_compile,
        state_variables=(
            "raw_learning_rate",
            "raw_beta_1",
            "meta_learning_rate_m",
            "meta_learning_rate_v",
            "meta_beta_1_m",
            "meta_beta_1_v",
            "count",
            "guided_steps",
            "nonfinite_hypergrads",
            "initialized",
        ),
        diagnostics=(
            "guidance_loss",
            "hypergrad_learning_rate",
            "hypergrad_beta_1",
            "learning_rate_scale",
            "beta_1",
        ),
    ),
]

#: The checks an entry leaves to -m slow where another entry runs its trainer's machinery
#: in the default suite (the suite's 20-minute budget): the two-process one, the ragged
#: last batch, the model after fit and ModelCheckpoint.
_SLOW_WHERE_COVERED = ("multi_worker", "ragged_last_batch", "model_after_fit", "model_checkpoint")

#: The fields of every MultiTaskTrainer entry on `multitask_data` (`{"inputs", "task_id"}`
#: batches): it normalises by the global per-task counts, so a ragged last batch is exact
#: on 2 replicas.
_MULTITASK_FIELDS = dict(
    compile_kwargs=_multitask_compile,
    diagnostics=("task_cosine",),
    make_data=multitask_data,
    make_eval_data=multitask_data,
    ragged_replicas_exact=True,
    model_inputs=lambda x: x["inputs"],
)

ENTRIES += [
    TrainerEntry(
        name="sequential_reptile",
        make_trainer=_sequential_reptile_trainer,
        compile_kwargs=_sequential_reptile_compile,
        # the trajectory counter and phi (the weights copy "slow", one per weight)
        state_variables=("count", "slow_0", "slow_1", "slow_2", "slow_3"),
    ),
    TrainerEntry(
        name="reptile",
        make_trainer=_reptile_trainer,
        compile_kwargs=_outer_compile,
        # the outer-step counter; the inner optimizer steps on tensors (no state kept)
        state_variables=("count",),
        make_data=stacked_regression_data,
    ),
    TrainerEntry(
        name="fomaml",
        make_trainer=_fomaml_trainer,
        compile_kwargs=_outer_compile,
        state_variables=("count",),
        make_data=stacked_regression_data,  # k = 1 inner batch + 1 query batch
        # "maml" runs MAMLTrainer's in the default suite, "reptile" the stacked inner loop's
        slow=_SLOW_WHERE_COVERED,
    ),
    TrainerEntry(
        name="multi_task_reptile",
        make_trainer=_multi_task_reptile_trainer,
        compile_kwargs=_outer_compile,
        state_variables=("count",),
        make_data=task_stacked_regression_data,
        slow=_SLOW_WHERE_COVERED,  # "reptile" runs the stacked inner loop's
    ),
    TrainerEntry(
        name="multitask_pcgrad",
        make_trainer=_multitask_trainer("pcgrad", seed=3),
        state_variables=("count",),  # the step counter the task order is drawn from
        **_MULTITASK_FIELDS,
    ),
    TrainerEntry(
        name="multitask_gradvac",
        make_trainer=_multitask_trainer("gradvac", method_options={"beta": 0.2}),
        state_variables=("count", "gradvac_targets"),
        **_MULTITASK_FIELDS,
        slow=_SLOW_WHERE_COVERED,  # "multitask_pcgrad" runs MultiTaskTrainer's
    ),
    TrainerEntry(
        name="multitask_gradnorm",
        make_trainer=_multitask_trainer("gradnorm", method_options={"learning_rate": 0.05}),
        state_variables=("count", "gradnorm_weights", "gradnorm_initial_losses", "gradnorm_seen"),
        **_MULTITASK_FIELDS,
        slow=_SLOW_WHERE_COVERED,  # "multitask_pcgrad" runs MultiTaskTrainer's
    ),
]


def _method_state(method, num_tasks=3):
    """The trainer variables of a registered multi-task method's state."""
    from tf_metaalign.algorithms import multitask as methods

    m = methods.get_method(method)
    names = [spec.name or f"{m.name}_{key}" for key, spec in m.state_spec(num_tasks).items()]
    return ("count", *names, *(("epochs_done",) if m.uses_epoch else ()))


#: the battery's check names, which an entry's `xfail`, `slow` and `tolerances` may use
#: (tests/trainers/test_trainer_battery.py runs one test function per name).
CHECKS = (
    "entry",
    "eager",
    "jit_compile",
    "steps_per_execution",
    "replicas",
    "mixed_float16",
    "mixed_bfloat16",
    "keras_round_trip",
    "backup_machinery",
    "backup_and_restore",
    "multi_worker",
    "multi_worker_backup",
    "model_after_fit",
    "model_checkpoint",
    "ragged_last_batch",
    "no_host_round_trip",
    "repeated_runs",
)

#: The battery's checks that only the first two zoo entries run in the default suite
#: (tests/trainers/test_multitask_methods.py checks every method's step, 1 replica == 2 and its
#: checkpointed state there; the battery's slow runs cover the rest of each entry).
_ALL_BUT_ENTRY = tuple(check for check in CHECKS if check != "entry")


def _multitask_diagnostics(method):
    """task_cosine where it is measured: not for a loss-weighting method (no task
    gradients formed)."""
    from tf_metaalign.algorithms import multitask as methods

    return ("task_cosine",) if methods.get_method(method).uses_gradients else ()


# The method zoo (issue 19), one entry per registered method beyond the three above.
# UW (trainable state, trained by the compiled optimizer) and Nash-MTL (an in-graph
# Newton solver, under XLA too) run every check in the default suite but the two-process
# one; the others every check under -m slow.
ENTRIES += [
    TrainerEntry(
        name=f"multitask_{method}",
        make_trainer=_multitask_trainer(method, seed=3),
        state_variables=_method_state(method),
        **{
            **_MULTITASK_FIELDS,
            "diagnostics": _multitask_diagnostics(method),
        },
        slow=_SLOW_WHERE_COVERED if method in ("uw", "nash_mtl") else _ALL_BUT_ENTRY,
        # Solvers iterate to convergence: rounding differs between XLA and graph code at
        # 1e-12 and the steps then agree to ~1e-9.
        tolerances={"jit_compile": (1e-6, 1e-9)} if method in ("nash_mtl",) else {},
        # Nash-MTL's alpha and RLW's random weights move the logged weighted loss.
        logged_loss_tracks_progress=method not in ("nash_mtl", "rlw"),
    )
    for method in (
        "sum",
        "rlw",
        "uw",
        "dwa",
        "famo",
        "mgda",
        "cagrad",
        "imtl",
        "nash_mtl",
        "aligned_mtl",
    )
]


# ------------------------------------------------------------------------ MAML family


def maml_task_data(n, dtype="float64", seed=0, n_support=3, n_query=3):
    """n tasks `((support_x, support_y, query_x), query_y)`, [n, N, ...] each: the rows of
    `regression_data` cut into tasks (a global batch of 8 tasks; Keras splits the tasks
    among the replicas, in `contiguous_rows` order)."""
    x, y = regression_data(n * (n_support + n_query), dtype=dtype, seed=seed)
    x = x.reshape(n, n_support + n_query, -1)
    y = y.reshape(n, n_support + n_query, -1)
    return (x[:, :n_support], y[:, :n_support], x[:, n_support:]), y[:, n_support:]


#: The fields of an entry whose trainer takes whole tasks (`tasks_per_batch`). It refuses a
#: ragged last batch of one task, and it logs float32 diagnostics: values that agree to
#: 1e-12 in float64 can round to neighbouring float32 numbers (1 ulp = 1.2e-7 relative);
#: one lost or repeated step changes them by > 1e-4.
TASK_BATCH_FIELDS = dict(ragged_last_batch="leave a last batch of 1 task", tolerance=(1e-6, 1e-10))


def _maml_trainer(**options):
    def make(model, data_dtype):
        from tf_metaalign.algorithms import GradientSharing
        from tf_metaalign.trainers import MAMLTrainer

        kwargs = dict(options)
        sharing = kwargs.pop("gradient_sharing", None)
        return MAMLTrainer(
            model,
            inner_steps=2,
            inner_learning_rate=0.2,
            tasks_per_batch=8,
            gradient_sharing=GradientSharing() if sharing else None,
            **kwargs,
        )

    return make


def _maml_state(learned, sharing=True, epochs=True, k=2, weights=4):
    names = ["count", *learned]
    if epochs:
        names.append("epochs_done")
    if sharing:
        names += ["sharing_m", "sharing_lambda", "g_hat_initialized"]
        names += [f"g_hat_{s}_{i}" for s in range(k) for i in range(weights)]
    return tuple(names)


_MAML_FIELDS = dict(
    compile_kwargs=_outer_compile,
    diagnostics=("support_loss", "inner_learning_rate", "sharing_m", "sharing_lambda"),
    make_data=maml_task_data,
    evaluates_model_batches=False,
    **TASK_BATCH_FIELDS,
)

ENTRIES += [
    TrainerEntry(
        # Second order, MAML++ (LSLR, multi-step loss annealed over 2 epochs, first order
        # in epoch 0 then second order) and gradient sharing, all at once.
        name="maml",
        make_trainer=_maml_trainer(
            learn_inner_learning_rates="per_layer_per_step",
            gradient_sharing=True,
            multi_step_loss=True,
            multi_step_loss_epochs=2,
            first_order_epochs=1,
        ),
        state_variables=_maml_state(["inner_learning_rates"]),
        # "meta_sgd_first_order" runs these for MAMLTrainer in the default suite (the
        # ragged batch is refused up front, task_batches.py; 50-110 s each here, loaded)
        slow=("ragged_last_batch", "model_after_fit", "model_checkpoint"),
        **_MAML_FIELDS,
    ),
    TrainerEntry(
        # First order (inner loop off the outer tape), Meta-SGD, gradient sharing.
        name="meta_sgd_first_order",
        make_trainer=_maml_trainer(
            first_order=True, learn_inner_learning_rates="per_parameter", gradient_sharing=True
        ),
        # The "maml" entry runs the other checks in the default suite; here the two
        # replicas check (first order all-reduces differently) and, for MAMLTrainer, the
        # ragged last batch, the model after fit and ModelCheckpoint (cheaper than
        # second order); the rest under -m slow (the suite's 20-minute budget).
        slow=(
            "backup_and_restore",
            "backup_machinery",
            "multi_worker",
            "jit_compile",
            "steps_per_execution",
            "keras_round_trip",
            "mixed_float16",
            "mixed_bfloat16",
            "eager",
        ),
        state_variables=_maml_state([f"inner_learning_rate_{i}" for i in range(4)], epochs=False),
        **_MAML_FIELDS,
    ),
]

# SAM / ASAM / GSAM (issue 21): the global perturbation makes R replicas take the step of
# one on the global batch (contiguous rows). GSAM shares SAMTrainer's step: the default
# suite runs its replica and precision checks, the rest under -m slow.
ENTRIES += [
    TrainerEntry(
        name="sam",
        make_trainer=_sam_trainer,
        compile_kwargs=_dotprod_compile,
        state_variables=("count",),  # the `every` schedule's step counter
        diagnostics=("grad_norm", "surrogate_gap"),
        # surrogate_gap is a float32 metric of a difference of losses (~0.2): 2 replicas
        # and 1 round it to neighbouring float32 numbers (3e-8); a lost step moves it 1e-3.
        tolerances={"replicas": (1e-6, 1e-7)},
        # The subprocess checks (a kill and resume, two workers; ~40 s) under -m slow:
        # "dotprod" runs them in the default suite on the same MetaTrainer / EveryKSteps
        # machinery (the suite's 20-minute budget).
        slow=("multi_worker", "backup_machinery", "backup_and_restore"),
    ),
    TrainerEntry(
        name="gsam",
        make_trainer=_gsam_trainer,
        compile_kwargs=_gsam_compile,
        state_variables=("count",),
        diagnostics=("grad_norm", "surrogate_gap", "rho"),
        # rho comes from the float32 learning rate of the schedule: XLA, eager and graph
        # round it differently (1.5e-8), and the weights then differ by ~1e-9; one lost or
        # repeated step changes them by ~1e-3.
        tolerance=(1e-6, 1e-8),
        tolerances={"replicas": (1e-6, 1e-7)},  # float32 metrics, as "sam"
        slow=tuple(
            c for c in CHECKS if c not in ("entry", "replicas", "mixed_float16", "keras_round_trip")
        ),
    ),
]

# Built last: entries appended above (ENTRIES += [...]) are looked up by name by the
# subprocess checks (battery_worker.py).
BY_NAME = {e.name: e for e in ENTRIES}


# ------------------------------------------------------------ prompt FOMAML / Reptile


# The prompt trainers' MLP and tasks: backend_battery's (TensorFlow-free), one copy.


def prompt_fomaml_trainer(model, data_dtype):
    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer

    # A fresh inner optimizer per task: replica-count independent (see the Reptile entry).
    return PromptFOMAMLTrainer(
        model,
        inner_steps=STACKED_K,
        inner_optimizer=O.Adam(0.05),
        carry_inner_state=False,
        tasks_per_batch=8,
    )


def _prompt_reptile_trainer(model, data_dtype):
    from tf_metaalign.trainers.prompt_meta import PromptReptileTrainer, default_adafactor

    # The paper's Adafactor (update clipping included), carried across tasks and
    # meta-batches.
    return PromptReptileTrainer(
        model, inner_steps=STACKED_K, inner_optimizer=default_adafactor(0.05), tasks_per_batch=8
    )


_PROMPT_MLP_FIELDS = dict(
    compile_kwargs=_outer_compile,
    diagnostics=("support_loss",),
    make_model=prompt_mlp,
    make_data=prompt_task_data,
    **TASK_BATCH_FIELDS,
)

_CARRIED = (
    "the inner optimizer state is chained through each replica's tasks (as through "
    "each DDP process's in the reference), so R replicas differ from 1"
)

_WORKER_LOCAL = (
    "under MultiWorkerMirroredStrategy each worker keeps its own replica's chain of the "
    "carried inner optimizer state ('only_first_replica' broadcasts within a worker only: "
    "measured, the two workers' states differ by up to 0.6 in an uninterrupted job), and "
    "the chief's backup holds the chief's: a restarted job gives every worker the chief's "
    "chain (the restarted workers then differ from the uninterrupted ones by ~1e-3)"
)

ENTRIES += [
    TrainerEntry(
        name="prompt_fomaml",
        make_trainer=prompt_fomaml_trainer,
        state_variables=("count",),
        **_PROMPT_MLP_FIELDS,
    ),
    TrainerEntry(
        name="prompt_reptile",
        make_trainer=_prompt_reptile_trainer,
        state_variables=(
            "count",
            "inner_prompt_v_0",
            "inner_prompt_iterations",
            "inner_other_v_row_0",
            "inner_other_v_col_0",
            "inner_other_v_1",
            "inner_other_v_row_2",
            "inner_other_v_col_2",
            "inner_other_v_3",
            "inner_other_iterations",
        ),
        **_PROMPT_MLP_FIELDS,
        xfail={
            "replicas": (_CARRIED, AssertionError),
            "multi_worker": (_CARRIED, AssertionError),
            "multi_worker_backup": (_WORKER_LOCAL, AssertionError),
        },
        # The default suite keeps what exercises its carried Adafactor state (save/load,
        # kill and resume, eager == traced); prompt_fomaml runs every check.
        slow=(
            "multi_worker",
            "jit_compile",
            "replicas",
            "mixed_float16",
            "mixed_bfloat16",
            "steps_per_execution",
            "ragged_last_batch",
        ),
    ),
]

# MultiTaskTrainer(tasks="outputs"): a two-output model compiled with a loss per output.
from multitask_outputs_entries import OUTPUT_ENTRIES  # noqa: E402

ENTRIES += OUTPUT_ENTRIES

BY_NAME = {e.name: e for e in ENTRIES}  # rebuilt with the entries appended above

# The prompt trainers on a prompted keras-hub decoder (prompts.prompt_causal_lm).
from causal_lm_entries import DECODER_ENTRIES  # noqa: E402

ENTRIES += DECODER_ENTRIES


def _slow_except(check: str, default) -> list:
    """ENTRIES with `check` under -m slow for every entry but those named in `default`
    (and those that already have it slow)."""
    assert set(default) <= {e.name for e in ENTRIES}, default
    return [
        entry
        if entry.name in default or check in entry.slow
        else dataclasses.replace(entry, slow=(*entry.slow, check))
        for entry in ENTRIES
    ]


BY_NAME = {e.name: e for e in ENTRIES}

# The "no_host_round_trip" check traces each step twice (XLA in bfloat16, graph in float32)
# and lowers the XLA one to HLO: 3-13 s an entry on 2 shared cores, 40-75 s for MAML's
# second order and the keras-hub decoders. The default suite runs it for one entry per
# trainer family among the cheap ones (the MetaTrainer base with its `every` schedule,
# the forward-mode guided update, the stacked inner loop, SAM, MultiTaskTrainer with a
# trainable method state); every other entry runs it under -m slow.
HOST_SCAN_DEFAULT = ("dotprod", "guided", "fomaml", "sam", "multitask_uw")
ENTRIES = _slow_except("no_host_round_trip", HOST_SCAN_DEFAULT)

BY_NAME = {e.name: e for e in ENTRIES}

# The "multi_worker_backup" check (a 2-worker MultiWorkerMirroredStrategy job loses a
# worker to SIGKILL mid-epoch and is restarted from MultiWorkerBackupAndRestore's backup;
# three 2-process launches: 38 s of CPU for "dotprod", 34 s on 2 cores at load 5, 85-135 s
# at load 8-12; 70-210 s per other entry at load 10) runs for one trainer of each
# family, the worker killed alternating between the chief (0) and the other (1): the
# MetaTrainer base with its `every` schedule, SAM, MultiTaskTrainer, Sequential Reptile
# (slow weights across steps), the stacked Reptile loop, MAML (learned rates, gradient
# sharing, epoch schedules), guided learning (a learned optimizer), the prompt
# meta-trainers (prompt Reptile's carried Adafactor state: a strict xfail, see its
# entry). Its machinery (tf_metaalign.callbacks.MultiWorkerBackupAndRestore,
# MetaTrainer's mid-epoch skip) is the same for every entry. The default suite runs
# "dotprod" only; the rest -m slow.
MULTI_WORKER_BACKUP_KILLED = {
    "dotprod": 0,
    "sam": 1,
    "multitask_pcgrad": 0,
    "sequential_reptile": 1,
    "reptile": 0,
    "maml": 1,
    "guided": 0,
    "prompt_fomaml": 1,
    "prompt_reptile": 0,
}
MULTI_WORKER_BACKUP_DEFAULT = ("dotprod",)
assert set(MULTI_WORKER_BACKUP_KILLED) <= set(BY_NAME), MULTI_WORKER_BACKUP_KILLED
ENTRIES = _slow_except("multi_worker_backup", MULTI_WORKER_BACKUP_DEFAULT)

# The "repeated_runs" check (a subprocess that trains the entry 3 times after 3 plain fits:
# ~15 s of CPU an entry) runs in the default suite for the MetaTrainer base (every trainer's
# train function goes through it) and one trainer whose inner loop nests traced functions;
# every other entry runs it under -m slow.
REPEATED_RUNS_DEFAULT = ("dotprod", "maml")
ENTRIES = _slow_except("repeated_runs", REPEATED_RUNS_DEFAULT)

BY_NAME = {e.name: e for e in ENTRIES}
