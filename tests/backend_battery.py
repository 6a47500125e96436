"""Machinery and entries of the backend-neutral trainer battery
(tests/trainers/test_battery_backends.py): no TensorFlow import, so the same entries and
checks run on Keras's TensorFlow and JAX backends.

An entry builds one trainer with the constructor arguments of its TensorFlow battery entry
(tests/trainer_entries.py), on the same tiny MLP and deterministic data (the builders
below are TensorFlow-free copies of that module's). A check trains the entry two ways
and compares *snapshots*: every number of the training state (model weights, model
state such as Dropout's seed, optimizer variables, the trainer's own state), as NumPy
arrays keyed by kind, integers exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Mapping

import keras
import numpy as np
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.trainers import MetaTrainer

#: 5 global batches of 8 per epoch: an odd count, so steps_per_execution=3 ends each epoch
#: on a partial execution and an every=2 schedule's phase shifts between epochs.
N_ROWS, BATCH, EPOCHS = 40, 8, 2
DROPOUT = 0.25

# ------------------------------------------------------------------ models and data


def mlp(dtype="float64", dropout=0.0, seed=0):
    """Input(4) -> Dense(5, tanh) -> [Dropout(dropout, seed=7)] -> Dense(2)
    (trainer_entries.mlp). `dtype=None` builds the layers in the global dtype policy."""
    keras.utils.set_random_seed(seed)
    layers = [
        keras.Input((4,), dtype=dtype or keras.backend.floatx()),
        keras.layers.Dense(5, activation="tanh", dtype=dtype),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=7, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
    return keras.Sequential(layers)


def regression_data(n, dtype="float64", seed=0):
    """x: (n, 4) normal; y: (n, 2) a smooth function of x (trainer_entries.regression_data)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3] - 0.5 * x[:, 0]], axis=1)
    return x.astype(dtype), y.astype(dtype)


STACKED_K = 2


def stacked_regression_data(n, dtype="float64", seed=0, k=STACKED_K):
    """n elements `[k, ...]` (stack_axis=1), as trainer_entries.stacked_regression_data."""
    x, y = regression_data(n * k, dtype=dtype, seed=seed)
    return x.reshape(n, k, -1), y.reshape(n, k, -1)


def task_stacked_regression_data(n, dtype="float64", seed=0, tasks=2, k=STACKED_K):
    """n elements `[T, k, ...]` (stack_axis=1)."""
    x, y = regression_data(n * tasks * k, dtype=dtype, seed=seed)
    return x.reshape(n, tasks, k, -1), y.reshape(n, tasks, k, -1)


def multitask_data(n, dtype="float64", seed=0, num_tasks=3):
    """`{"inputs", "task_id"}` batches, tasks interleaved, task 1's targets negated."""
    x, y = regression_data(n, dtype=dtype, seed=seed)
    task_id = (np.arange(n) % num_tasks).astype("int32")
    y = np.where((task_id == 1)[:, None], -y, y).astype(dtype)
    return {"inputs": x, "task_id": task_id}, y


def two_head_mlp(dtype="float64", dropout=0.0, seed=0):
    """A trunk and two heads "a", "b" (multitask_outputs_entries.two_head_mlp)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype=dtype or keras.backend.floatx())
    h = keras.layers.Dense(5, activation="tanh", dtype=dtype, name="trunk")(inputs)
    if dropout:
        h = keras.layers.Dropout(dropout, seed=7, dtype=dtype)(h)
    a = keras.layers.Dense(3, activation="tanh", dtype=dtype, name="a_hidden")(h)
    a = keras.layers.Dense(1, dtype=dtype, name="a")(a)
    b = keras.layers.Dense(1, dtype=dtype, name="b")(h)
    return keras.Model(inputs, [a, b], name="two_heads")


def two_output_data(n, dtype="float64", seed=0):
    x, y = regression_data(n, dtype=dtype, seed=seed)
    flip = np.where(np.arange(n) % 2 == 0, -3.0, 1.0).astype(dtype)
    return x, {"a": y[:, :1], "b": (y[:, 1:] * flip[:, None] + x[:, :1]).astype(dtype)}


def take_rows(x, rows):
    return keras.tree.map_structure(lambda a: a[rows], x)


# MAML's episodes (trainer_entries.maml_task_data): an element is one task, so a batch of
# BATCH elements is a meta-batch of 8 tasks and N_ROWS elements are 40 tasks.


def maml_task_data(n, dtype="float64", seed=0, n_support=3, n_query=3):
    """n tasks `((support_x, support_y, query_x), query_y)`, [n, N, ...] each: the rows of
    `regression_data` cut into tasks (trainer_entries.maml_task_data)."""
    x, y = regression_data(n * (n_support + n_query), dtype=dtype, seed=seed)
    x = x.reshape(n, n_support + n_query, -1)
    y = y.reshape(n, n_support + n_query, -1)
    return (x[:, :n_support], y[:, :n_support], x[:, n_support:]), y[:, n_support:]


def query_rows(x):
    """The model batch of a task batch's (or a query set's) rows: [T, N, ...] -> [T N, ...]."""
    if isinstance(x, tuple):  # (support_x, support_y, query_x)
        x = x[2]
    return keras.tree.map_structure(lambda a: a.reshape((-1,) + a.shape[2:]), x)


def bn_mlp(dtype="float64", dropout=0.0, seed=0):
    """Input(4) -> Dense(5, no bias) -> BatchNormalization -> tanh -> [Dropout] -> Dense(2):
    MAML's second derivatives through batch statistics, MAML++'s per-step statistics.

    No bias before BatchNorm (the usual practice; BatchNorm's beta is the bias): with batch
    statistics the loss does not depend on it, its gradient is rounding noise (float32
    4e-8, bfloat16 5e-4), which Adam turns into steps of +-lr under bfloat16, so the
    mixed_bfloat16 check measured that noise, not the trainer: 10 steps moved it by 0.2
    against float32's 0.002, 25% (JAX) / 33% (TensorFlow) of the weight change with it,
    1.3% / 2.3% without it; Keras's own fit of this model does the same (25-28%,
    0.4% on the other weights)."""
    keras.utils.set_random_seed(seed)
    layers = [
        keras.Input((4,), dtype=dtype or keras.backend.floatx()),
        keras.layers.Dense(5, use_bias=False, dtype=dtype),
        keras.layers.BatchNormalization(momentum=0.9, dtype=dtype),
        keras.layers.Activation("tanh", dtype=dtype),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=7, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
    return keras.Sequential(layers)


# The prompt trainers' tasks (trainer_entries.prompt_mlp / prompt_task_data, TensorFlow-free).


@keras.saving.register_keras_serializable(package="backend_battery")
class PromptOffset(keras.layers.Layer):
    """x + p: a learned input offset standing in for a soft prompt (its path holds
    "prompt", which the prompt trainers select by default)."""

    def build(self, input_shape):
        self.offset = self.add_weight(
            shape=(input_shape[-1],),
            name="offset",
            initializer=keras.initializers.RandomNormal(seed=11),
        )

    def call(self, x):
        return x + ops.cast(self.offset, x.dtype)


def prompt_mlp(dtype="float64", dropout=0.0, seed=0):
    """`mlp` with a `PromptOffset` named "prompt" on its input."""
    keras.utils.set_random_seed(seed)
    layers = [
        keras.Input((4,), dtype=dtype or keras.backend.floatx()),
        PromptOffset(name="prompt", dtype=dtype),
        keras.layers.Dense(5, activation="tanh", dtype=dtype),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=7, dtype=dtype))
    layers.append(keras.layers.Dense(2, dtype=dtype))
    return keras.Sequential(layers)


def _cut_tasks(x, y, n, steps, n_support):
    """Rows [n * per_task, ...] (nests of arrays) -> ((support_x [n, S, N_s, ...],
    support_y, query_x [n, N_q, ...]), query_y)."""
    cut = steps * n_support

    def split(a):
        a = a.reshape((n, -1) + a.shape[1:])
        return a[:, :cut].reshape((n, steps, n_support) + a.shape[2:]), a[:, cut:]

    if isinstance(x, dict):
        parts = {k: split(v) for k, v in x.items()}
        support_x = {k: p[0] for k, p in parts.items()}
        query_x = {k: p[1] for k, p in parts.items()}
    else:
        support_x, query_x = split(x)
    support_y, query_y = split(y)
    return (support_x, support_y, query_x), query_y


def prompt_task_data(n, dtype="float64", seed=0, steps=STACKED_K, n_support=2, n_query=2):
    """n tasks `((support_x [S, N_s, 4], support_y, query_x [N_q, 4]), query_y)`: the rows
    of `regression_data` cut into tasks (trainer_entries.prompt_task_data)."""
    x, y = regression_data(n * (steps * n_support + n_query), dtype=dtype, seed=seed)
    return _cut_tasks(x, y, n, steps, n_support)


# A prompted keras-hub decoder (causal_lm_entries, TensorFlow-free): a one-layer GPT-2
# (hidden 4, 2 heads) with a deep prefix of 2 positions, on next-token batches.

VOCABULARY, TOKENS = 16, 4


def prompted_gpt2(dtype="float64", dropout=0.0, seed=0, train="both"):
    """A one-layer GPT-2 (hidden 4, 2 heads) with a deep prefix of 2 positions
    (`train="prompt"`: prompt-only training); skips the test where keras-hub is not
    installed (the `hub` extra). causal_lm_entries uses it too."""
    import pytest

    pytest.importorskip("keras_hub")

    from tf_metaalign import prompts
    from tiny_backbones import tiny_backbone

    keras.utils.set_random_seed(seed)
    backbone = tiny_backbone(
        "gpt2",
        vocabulary_size=VOCABULARY,
        num_layers=1,
        hidden_dim=4,
        intermediate_dim=8,
        max_sequence_length=8,
        dropout=dropout,
        dtype=dtype,
    )
    return prompts.prompt_causal_lm(backbone, length=2, mode="deep", train=train, seed=seed)


def token_batches(n, dtype="float64", seed=0):
    """n rows of TOKENS token ids (the last row's final token padded) and their next
    tokens, next = (3 * token + 1) mod VOCABULARY (causal_lm_entries.token_batches)."""
    del dtype  # token ids whatever the float dtype
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, VOCABULARY, (n, 1))]
    for _ in range(TOKENS):
        ids.append((3 * ids[-1] + 1) % VOCABULARY)
    ids = np.concatenate(ids, 1).astype("int32")
    mask = np.ones((n, TOKENS), "int32")
    mask[-1, -1] = 0
    return {"token_ids": ids[:, :-1] * mask, "padding_mask": mask}, ids[:, 1:]


def decoder_task_data(n, dtype="float64", seed=0, steps=STACKED_K, n_support=2, n_query=2):
    """n tasks of `token_batches` rows, cut as `prompt_task_data` cuts its rows."""
    x, y = token_batches(n * (steps * n_support + n_query), seed=seed)
    return _cut_tasks(x, y, n, steps, n_support)


# ------------------------------------------------------------- the battery's own trainer


@keras.saving.register_keras_serializable(package="backend_battery")
class BatteryTrainer(MetaTrainer):
    """The MetaTrainer contract at its simplest (tests/test_backend_seam.py's PlainTrainer
    with its period in the config): Keras's gradient step, a counter assigned in a
    conditional branch every `period` steps, a diagnostic. Runs on both backends now, so
    the battery is proven on both before the library's trainers are.

    `flaw` names one way of being wrong that exactly one check must catch (the battery's
    own tests, test_battery_backends.py::test_check_catches_a_flawed_trainer):
      "eager": a different step when run eagerly;
      "steps_per_execution": the update depends on the steps per execution;
      "bfloat16": the update's sign flips under a bfloat16 compute dtype;
      "config": `period` left out of the config (a reloaded trainer has another);
      "resume": `firsts` not restored by `load_weights` (an unsaved state variable);
      "devices": the gradient divided by the device count (TensorFlow's replica scaling
        applied where the step sees the global batch);
      "host_callback": a `jax.debug.callback` inside a loop of the step;
      "model_save": `save` writes the trainer, not the user's model.
    """

    backends = ("tensorflow", "jax")

    def __init__(self, model, period=2, flaw=None, **kwargs):
        super().__init__(model, **kwargs)
        self.period, self.flaw = period, flaw
        self.every = self.every_k_steps(period, "every")
        self.firsts = self.add_state_variable("firsts")
        self.add_diagnostic("grad_norm")

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        loss, grads, (new_state, y_pred) = F.value_and_grad(
            self.loss_fn(),
            F.current_params(self.model),
            F.current_state(self.model),
            (x, y, sample_weight),
        )

        def count():
            self.firsts.assign_add(ops.convert_to_tensor(1.0, self.firsts.dtype))
            return ops.convert_to_tensor(1.0, "float32")

        F.cond(self.every.is_first(), count, lambda: ops.convert_to_tensor(0.0, "float32"))
        grads = [g * self._flaw_factor(g) for g in grads]
        if self.flaw == "host_callback":
            import jax

            def noisy(i, total):
                jax.debug.callback(lambda v: None, total)
                return total + 1.0

            loss = loss + 0.0 * ops.fori_loop(0, 2, noisy, ops.zeros((), loss.dtype))
        return self.finish_step(
            data,
            y_pred,
            loss,
            new_state=new_state,
            gradients=grads,
            diagnostics={"grad_norm": F.global_norm(grads)},
        )

    def _flaw_factor(self, g):
        factor = 1.0
        if self.flaw == "eager" and F.executing_eagerly():
            factor = 1.001
        elif self.flaw == "steps_per_execution":
            factor = 1.0 + 0.01 * (self.steps_per_execution - 1)
        elif self.flaw == "bfloat16" and self.model_compute_dtype() == "bfloat16":
            factor = -1.0
        elif self.flaw == "devices" and keras.distribution.distribution() is not None:
            factor = 1.0 / len(keras.distribution.distribution().device_mesh.devices.flat)
        return ops.cast(factor, g.dtype)

    def load_own_variables(self, store):
        super().load_own_variables(store)
        if self.flaw == "resume":
            self.firsts.assign(0.0)

    def save(self, filepath, *args, **kwargs):
        if self.flaw == "model_save":
            return keras.Model.save(self, filepath, *args, **kwargs)
        return super().save(filepath, *args, **kwargs)

    def get_config(self):
        config = {**super().get_config(), "period": self.period, "flaw": self.flaw}
        if self.flaw == "config":
            del config["period"]
        return config


# ---------------------------------------------------------------------------- entries


def _mse():
    return keras.losses.MeanSquaredError()


def _adam_compile(learning_rate=0.01):
    def compile_kwargs():
        return dict(optimizer=keras.optimizers.Adam(learning_rate), loss=_mse(), metrics=["mae"])

    return compile_kwargs


def _gsam_compile():
    schedule = keras.optimizers.schedules.PolynomialDecay(0.02, 20, end_learning_rate=0.002)
    return dict(optimizer=keras.optimizers.Adam(schedule), loss=_mse(), metrics=["mae"])


def _outputs_compile():
    return dict(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"a": _mse(), "b": _mse()},
        loss_weights={"a": 1.0, "b": 0.5},
        metrics={"a": ["mae"]},
    )


def _library(name):
    """`() -> tf_metaalign.trainers.<name>` (read when needed: on JAX without TensorFlow a
    trainer not yet moved there is a stand-in name that raises ImportError)."""

    def get():
        import tf_metaalign.trainers

        return getattr(tf_metaalign.trainers, name)

    get.__name__ = name
    return get


def _make(name, **options):
    """`make_trainer(model, data_dtype)`: `tf_metaalign.trainers.<name>(model, **options)`."""

    def make(model, data_dtype):
        return _library(name)()(model, **options)

    return make


@dataclasses.dataclass(frozen=True)
class BatteryEntry:
    """How the battery builds and trains one trainer (cf. trainer_entries.TrainerEntry).

    Attributes:
      name: the pytest id.
      trainer_class: `() -> class`: its `backends` says whether it runs on JAX yet (an
        ImportError there counts as "not yet").
      make_trainer: `(model, data_dtype) -> trainer` (not compiled).
      compile_kwargs: `() -> dict`, new objects each call.
      make_model: `(dtype, dropout, seed) -> keras.Model`; dtype None = global policy.
      make_data: `(n, dtype, seed) -> (x, y)`; also what `trainer.evaluate` takes unless
        `make_eval_data` is given.
      model_inputs: `x -> x` of the wrapped model, from evaluation data's x.
      model_targets: `y -> y` of the wrapped model, from evaluation data's y.
      trainer_scores: `(trainer, x, y) -> (evaluate's logs, predictions)` of the trainer on
        evaluation data that the wrapped model's `evaluate` / `predict` on
        `model_inputs(x)`, `model_targets(y)` must equal (default: `trainer.evaluate`,
        `trainer.predict`; MAML: its unadapted score, `evaluate_tasks(inner_steps=0)`).
      frozen: `model -> variables` that training must leave bit-identical (prompt-only
        training's backbone), checked by `jit_equals_eager`.
      fixtures: pytest fixtures every check of the entry runs under (by name).
      tolerance: (rtol, atol) of the float comparisons; `tolerances` per check.
      default: the checks this entry runs in the default suite (the others under
        -m slow): every check runs by default for a few entries, each trainer family
        runs a few checks (the suite's time budget).
      xfail: check -> (reason, exception type, backends): a known failure on those
        backends (`xfail(strict=True)`: the day it passes, the marker must go).
      diagnostics: logged names compared per batch besides "loss".
    """

    name: str
    trainer_class: Callable[[], type]
    make_trainer: Callable[[keras.Model, str], keras.Model]
    compile_kwargs: Callable[[], dict] = _adam_compile()
    make_model: Callable[..., keras.Model] = mlp
    make_data: Callable[..., tuple] = regression_data
    make_eval_data: Callable[..., tuple] | None = None
    model_inputs: Callable[[object], object] = lambda x: x
    model_targets: Callable[[object], object] = lambda y: y
    trainer_scores: Callable[..., tuple] | None = None
    frozen: Callable[[keras.Model], list] | None = None
    fixtures: tuple[str, ...] = ()
    diagnostics: tuple[str, ...] = ()
    tolerance: tuple[float, float] = (1e-10, 1e-12)
    tolerances: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    default: frozenset = frozenset()
    xfail: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    def on_jax(self) -> bool:
        try:
            return "jax" in getattr(self.trainer_class(), "backends", ())
        except ImportError:
            return False

    def rtol_atol(self, check):
        return self.tolerances.get(check, self.tolerance)


#: The checks (one test function each in test_battery_backends.py).
CHECKS = (
    "jit_equals_eager",
    "steps_per_execution",
    "mixed_bfloat16",
    "save_load",
    "model_as_itself",
    "resume",
    "devices",
    "host_round_trip",
)
ALL = frozenset(CHECKS)

_MULTITASK = dict(
    make_data=multitask_data,
    model_inputs=lambda x: x["inputs"],
    diagnostics=("task_cosine",),
)
_STACKED = dict(
    compile_kwargs=_adam_compile(0.02),
    make_data=stacked_regression_data,
    make_eval_data=regression_data,  # evaluate / predict take model batches
)

ENTRIES = [
    BatteryEntry(
        name="plain",
        trainer_class=lambda: BatteryTrainer,
        make_trainer=lambda model, data_dtype: BatteryTrainer(model, period=2),
        diagnostics=("grad_norm",),
        default=ALL,
    ),
    BatteryEntry(
        name="dotprod",
        trainer_class=_library("DotProdTrainer"),
        make_trainer=_make("DotProdTrainer", weight=0.3, every=2),
        diagnostics=("grad_dot", "grad_cosine"),
        # The finite difference divides rounding noise by alpha ~ sqrt(eps): two exact ways
        # of running differ by up to 4.6e-10 (measured: XLA vs eager on TensorFlow; 2 vs 1
        # devices on JAX, 5.2e-10), one lost or repeated step by ~1e-2.
        tolerance=(1e-7, 1e-8),
        default={"jit_equals_eager", "steps_per_execution", "resume", "devices", "host_round_trip"},
    ),
    BatteryEntry(
        name="sam",
        trainer_class=_library("SAMTrainer"),
        make_trainer=_make("SAMTrainer", rho=0.2, adaptive=True, every=2),
        diagnostics=("grad_norm", "surrogate_gap"),
        default={"jit_equals_eager", "mixed_bfloat16", "save_load", "devices", "host_round_trip"},
    ),
    BatteryEntry(
        name="gsam",  # SAMTrainer's step ("sam") with a rho schedule
        trainer_class=_library("GSAMTrainer"),
        make_trainer=_make(
            "GSAMTrainer", rho=0.2, rho_min=0.05, alpha=0.3, learning_rate_range=(0.002, 0.02)
        ),
        compile_kwargs=_gsam_compile,
        diagnostics=("grad_norm", "surrogate_gap", "rho"),
        # rho comes from the schedule's float32 learning rate, which XLA and eager round
        # differently on TensorFlow: the weights then differ by up to 8.7e-10 (measured;
        # 1e-10 on JAX); one lost or repeated step changes them by ~1e-3.
        tolerance=(1e-7, 1e-8),
        default={"jit_equals_eager"},
    ),
    BatteryEntry(
        name="multitask_pcgrad",  # task-id batches
        trainer_class=_library("MultiTaskTrainer"),
        make_trainer=_make("MultiTaskTrainer", num_tasks=3, method="pcgrad", seed=3),
        **_MULTITASK,
        default={
            "jit_equals_eager",
            "steps_per_execution",
            "model_as_itself",
            "devices",
            "host_round_trip",
        },
    ),
    BatteryEntry(
        name="multitask_uw",  # a trainable method state, trained by the compiled optimizer
        trainer_class=_library("MultiTaskTrainer"),
        make_trainer=_make("MultiTaskTrainer", num_tasks=3, method="uw", seed=3),
        **{**_MULTITASK, "diagnostics": ()},
        default={"save_load", "resume"},
    ),
    BatteryEntry(
        name="multitask_gradvac",  # a method state assigned in the step
        trainer_class=_library("MultiTaskTrainer"),
        make_trainer=_make("MultiTaskTrainer", num_tasks=3, method="gradvac", gradvac_beta=0.2),
        **_MULTITASK,
        default={"resume"},
    ),
    BatteryEntry(
        name="multitask_nash_mtl",  # an in-step Newton solver
        trainer_class=_library("MultiTaskTrainer"),
        make_trainer=_make("MultiTaskTrainer", num_tasks=3, method="nash_mtl", seed=3),
        **_MULTITASK,
    ),
    BatteryEntry(
        name="multitask_outputs_pcgrad",  # tasks="outputs": a loss per output
        trainer_class=_library("MultiTaskTrainer"),
        make_trainer=_make("MultiTaskTrainer", method="pcgrad", seed=3),
        compile_kwargs=_outputs_compile,
        make_model=two_head_mlp,
        make_data=two_output_data,
        diagnostics=("task_cosine",),
        default={"save_load", "devices"},
    ),
    BatteryEntry(
        name="sequential_reptile",  # slow weights across steps
        trainer_class=_library("SequentialReptileTrainer"),
        make_trainer=_make(
            "SequentialReptileTrainer",
            inner_steps=3,
            outer_learning_rate=0.5,
            reset_inner_optimizer=True,
        ),
        default={"steps_per_execution", "model_as_itself", "resume", "devices", "host_round_trip"},
    ),
    BatteryEntry(
        name="reptile",  # the stacked inner loop
        trainer_class=_library("ReptileTrainer"),
        make_trainer=lambda model, data_dtype: _library("ReptileTrainer")()(
            model, inner_steps=STACKED_K, inner_optimizer=_tensor_adam(0.05), stack_axis=1
        ),
        **_STACKED,
        default={"jit_equals_eager", "mixed_bfloat16", "save_load", "devices", "host_round_trip"},
    ),
    BatteryEntry(
        name="fomaml",
        trainer_class=_library("FOMAMLTrainer"),
        make_trainer=_make(
            "FOMAMLTrainer", inner_steps=STACKED_K - 1, inner_optimizer=0.1, stack_axis=1
        ),
        **_STACKED,
        default={"jit_equals_eager"},
    ),
    BatteryEntry(
        name="multi_task_reptile",
        trainer_class=_library("MultiTaskReptileTrainer"),
        make_trainer=_make(
            "MultiTaskReptileTrainer", inner_steps=STACKED_K, inner_optimizer=0.1, stack_axis=1
        ),
        compile_kwargs=_adam_compile(0.02),
        make_data=task_stacked_regression_data,
        make_eval_data=regression_data,
        default={"resume"},
    ),
    BatteryEntry(
        name="guided",  # hypergradients through the compiled Adam (converted from Keras's)
        trainer_class=_library("GuidedTrainer"),
        make_trainer=lambda model, data_dtype: _library("GuidedTrainer")()(
            model,
            guidance_data=regression_data(8, data_dtype, seed=11),
            meta_optimizer=keras.optimizers.Adam(0.01),
        ),
        diagnostics=("hypergrad_learning_rate", "hypergrad_beta_1", "guidance_loss"),
        # jit == eager under -m slow: 17 s on JAX (the eager step runs op by op)
        default={"save_load", "resume"},
    ),
]


# --------------------------------------------------- MAML (issue 30): episode batches


def _maml(**options):
    """`make_trainer` of MAMLTrainer: 2 inner steps of 0.2 on meta-batches of BATCH tasks
    (trainer_entries._maml_trainer); `gradient_sharing=True`: a default GradientSharing."""

    def make(model, data_dtype):
        from tf_metaalign.algorithms import GradientSharing

        kwargs = dict(options)
        sharing = GradientSharing() if kwargs.pop("gradient_sharing", False) else None
        return _library("MAMLTrainer")()(
            model,
            inner_steps=2,
            inner_learning_rate=0.2,
            tasks_per_batch=BATCH,
            gradient_sharing=sharing,
            **kwargs,
        )

    return make


def _unadapted_scores(trainer, x, y):
    """MAML's evaluation with 0 inner steps (`evaluate_tasks(inner_steps=0)`: theta on every
    query set) and `predict` on the query rows (a model batch: the model's outputs)."""
    logs = trainer.evaluate_tasks(
        x, y, inner_steps=0, batch_size=BATCH, verbose=0, return_dict=True
    )
    return logs, trainer.predict(query_rows(x), verbose=0)


_EPISODES = dict(
    compile_kwargs=_adam_compile(0.02),
    make_data=maml_task_data,
    model_inputs=query_rows,
    model_targets=query_rows,
    trainer_scores=_unadapted_scores,
    diagnostics=("support_loss", "inner_learning_rate", "sharing_m", "sharing_lambda"),
)

ENTRIES += [
    BatteryEntry(
        # Second order and MAML++ at once on a BatchNorm MLP: LSLR (learned rates per
        # layer and step), the multi-step loss annealed over 2 epochs, first order in
        # epoch 0 then second order (derivative-order annealing, epochs_done), per-step
        # BatchNorm statistics, gradient sharing. transductive_evaluation=False: evaluate
        # normalises with the statistics (0 inner steps: the model's own, as model.evaluate).
        name="maml_pp",
        trainer_class=_library("MAMLTrainer"),
        make_trainer=_maml(
            learn_inner_learning_rates="per_layer_per_step",
            multi_step_loss=True,
            multi_step_loss_epochs=2,
            first_order_epochs=1,
            per_step_batch_norm_statistics=True,
            gradient_sharing=True,
            transductive_evaluation=False,
        ),
        make_model=bn_mlp,
        **_EPISODES,
        # Every check under -m slow: 45-165 s each on TensorFlow (2 loaded cores), the
        # second-order step unrolled over 8 tasks compiles slowly; JAX's goldens of the
        # same options run by default (tests/trainers/test_maml_backends.py).
    ),
    BatteryEntry(
        # First order (FOMAML: the inner loop off the outer gradient), Meta-SGD (a learned
        # rate per weight), gradient sharing.
        name="meta_sgd_first_order",
        trainer_class=_library("MAMLTrainer"),
        make_trainer=_maml(
            first_order=True, learn_inner_learning_rates="per_parameter", gradient_sharing=True
        ),
        **_EPISODES,
        default={"resume"},
    ),
]


# ------------------------------- prompt FOMAML / Reptile (issue 30): tasks of inner steps


def _prompt_fomaml(model, data_dtype):
    """trainer_entries.prompt_fomaml_trainer: a fresh inner Adam per task."""
    from tf_metaalign import optimizers as O

    return _library("PromptFOMAMLTrainer")()(
        model,
        inner_steps=STACKED_K,
        inner_optimizer=O.Adam(0.05),
        carry_inner_state=False,
        tasks_per_batch=BATCH,
    )


def _prompt_reptile_adafactor(model, data_dtype):
    """trainer_entries._prompt_reptile_trainer: the paper's Adafactor (update clipping
    included), carried across tasks and meta-batches."""
    from tf_metaalign.trainers.prompt_meta import default_adafactor

    return _library("PromptReptileTrainer")()(
        model,
        inner_steps=STACKED_K,
        inner_optimizer=default_adafactor(0.05),
        tasks_per_batch=BATCH,
    )


def _prompt_reptile_sgd(model, data_dtype):
    """causal_lm_entries._reptile: inner SGD, reset per task."""
    from tf_metaalign import optimizers as O

    return _library("PromptReptileTrainer")()(
        model,
        inner_steps=STACKED_K,
        inner_optimizer=O.SGD(0.1),
        carry_inner_state=False,
        tasks_per_batch=BATCH,
    )


def _decoder_compile():
    return dict(
        optimizer=keras.optimizers.Adam(0.02),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )


_PROMPT_TASKS = dict(
    compile_kwargs=_adam_compile(0.02),
    make_model=prompt_mlp,
    make_data=prompt_task_data,
    make_eval_data=regression_data,  # evaluate / predict take model batches
    diagnostics=("support_loss",),
)

#: JAX computes float64 attention's softmax in float32 (`jax.nn.dot_product_attention`):
#: jit and eager differed by up to 8.7e-6 in the weights (prompt FOMAML's inner Adam
#: amplifies it), 2 devices and 1 by 7e-9; the decoder entries run under the fixture
#: that keeps it float64 (tests/prompts/prompt_precision.py), and a looser tolerance;
#: one lost or repeated step moves the weights by ~1e-2.
_DECODER_TOLERANCE = (1e-6, 1e-8)
_DECODER_FIXTURES = ("float64_attention_softmax",)

#: keras-hub models build, trace and train slowly: every check of the prompt trainers on
#: the decoder runs under -m slow (9-76 s each on TensorFlow, 20-171 s on JAX, on 2
#: loaded cores).
_DECODER_TASKS = dict(
    compile_kwargs=_decoder_compile,
    make_model=prompted_gpt2,
    make_data=decoder_task_data,
    make_eval_data=token_batches,
    diagnostics=("support_loss",),
    tolerance=_DECODER_TOLERANCE,
    fixtures=_DECODER_FIXTURES,
)

ENTRIES += [
    BatteryEntry(
        name="prompt_fomaml",
        trainer_class=_library("PromptFOMAMLTrainer"),
        make_trainer=_prompt_fomaml,
        **_PROMPT_TASKS,
        default={"jit_equals_eager"},
    ),
    BatteryEntry(
        name="prompt_reptile",  # carried Adafactor state (factored second moments)
        trainer_class=_library("PromptReptileTrainer"),
        make_trainer=_prompt_reptile_adafactor,
        **_PROMPT_TASKS,
    ),
    BatteryEntry(
        # A prompted keras-hub GPT-2 (deep prefix, train="both"): the inner loop adapts
        # the prefix, the outer step trains the prefix and the transformer.
        name="prompt_fomaml_gpt2",
        trainer_class=_library("PromptFOMAMLTrainer"),
        make_trainer=_prompt_fomaml,
        **_DECODER_TASKS,
    ),
    BatteryEntry(
        name="prompt_reptile_gpt2",
        trainer_class=_library("PromptReptileTrainer"),
        make_trainer=_prompt_reptile_sgd,
        **_DECODER_TASKS,
    ),
    BatteryEntry(
        # Prompt-only training (prompts.prompt_causal_lm(train="prompt")) under the
        # MetaTrainer contract (the battery's trainer: Keras's gradient step): the prefix
        # trains, the GPT-2 backbone stays bit-identical.
        name="prompt_only_gpt2",
        trainer_class=lambda: BatteryTrainer,
        make_trainer=lambda model, data_dtype: BatteryTrainer(model, period=2),
        compile_kwargs=_decoder_compile,
        make_model=functools.partial(prompted_gpt2, train="prompt"),
        make_data=token_batches,
        diagnostics=("grad_norm",),
        tolerance=_DECODER_TOLERANCE,
        fixtures=_DECODER_FIXTURES,
        frozen=lambda model: model.backbone.weights,
        # keras-hub in the default suite where it is cheap: 2-7 s each on either backend
        # (2 loaded cores; jit == eager 10 s on TensorFlow, 30 s on JAX: -m slow).
        default={"save_load", "model_as_itself"},
    ),
]
BY_NAME = {e.name: e for e in ENTRIES}


def _tensor_adam(learning_rate):
    from tf_metaalign import optimizers as O

    return O.Adam(learning_rate)


# ------------------------------------------------------------------ build, fit, snapshot


def build(entry, dtype="float64", dropout=0.0, make_trainer=None, **compile_overrides):
    """A compiled trainer of the entry (`dtype=None`: the model in the global policy)."""
    model = entry.make_model(dtype=dtype, dropout=dropout, seed=0)
    trainer = (make_trainer or entry.make_trainer)(model, dtype or keras.backend.floatx())
    trainer.compile(**entry.compile_kwargs(), **compile_overrides)
    return trainer


def data(entry, dtype="float64", n=N_ROWS, seed=0):
    return entry.make_data(n, dtype=dtype, seed=seed)


class BatchLogs(keras.callbacks.Callback):
    """The logs of every training batch (floats)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def fit(trainer, x, y, epochs=EPOCHS, callbacks=()):
    """Unshuffled fit on batches of `BATCH`: `(per-batch logs, History.history)`."""
    recorder = BatchLogs()
    history = trainer.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, *callbacks],
    )
    return recorder.logs, history.history


def trainer_state(trainer):
    """The trainer's own variables (neither the model's nor the optimizer's), by name
    (`name#k` for the k-th repeat of a name)."""
    known = {id(v) for v in trainer.model.variables} | {id(v) for v in trainer.optimizer.variables}
    out = {}
    for v in trainer.variables:
        if id(v) in known:
            continue
        key, k = v.name, 1
        while key in out:
            key, k = f"{v.name}#{k}", k + 1
        out[key] = v
    return out


def _np(v):
    return np.asarray(ops.convert_to_numpy(v.value if hasattr(v, "value") else v))


def snapshot(trainer):
    """Every number of the training state, keyed `kind/index` or `state/name`."""
    out = {}
    for i, v in enumerate(trainer.model.trainable_variables):
        out[f"weights/{i}"] = _np(v)
    for i, v in enumerate(trainer.model.non_trainable_variables):
        out[f"model_state/{i}"] = _np(v)  # Dropout seed, BatchNorm statistics
    for i, v in enumerate(trainer.optimizer.variables):
        out[f"optimizer/{i}"] = _np(v)
    for name, v in trainer_state(trainer).items():
        out[f"state/{name}"] = _np(v)
    return out


def assert_same(a, b, rtol, atol, what=""):
    """Every key of two snapshots agrees (integers exactly); one message listing every key
    that differs with its largest absolute difference."""
    assert sorted(a) == sorted(b), f"{what}: different keys {sorted(set(a) ^ set(b))}"
    bad = []
    for k in sorted(a):
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            bad.append(f"{k}: shape {x.shape} vs {y.shape}")
        elif x.dtype.kind in "iub":
            if not np.array_equal(x, y):
                bad.append(f"{k}: {x.ravel()[:4]} vs {y.ravel()[:4]}")
        elif not np.allclose(x, y, rtol=rtol, atol=atol):
            diff = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            bad.append(f"{k}: max |diff| {diff:.3g}")
    assert not bad, f"{what} differ (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(bad)


def assert_logs_same(a, b, names, rtol, atol, what="per-batch logs"):
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} batches"
    assert_same(
        {n: np.asarray([s[n] for s in a]) for n in names},
        {n: np.asarray([s[n] for s in b]) for n in names},
        rtol,
        atol,
        what,
    )


def assert_trained(before, after, what=""):
    """The weights, the optimizer and (where there is any) the trainer's state moved: a
    comparison of two runs is never vacuous."""
    for kind in ("weights/", "optimizer/", "state/"):
        keys = [k for k in before if k.startswith(kind)]
        moved = [k for k in keys if not np.array_equal(before[k], after[k])]
        assert moved or (kind == "state/" and not keys), f"{what}: no {kind[:-1]} changed"


@contextlib.contextmanager
def dtype_policy(name):
    """Keras's global dtype policy set to `name`, restored after."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


class Interrupted(Exception):
    """Raised by `InterruptAt`: a run that stops mid-epoch (a preempted job)."""


class InterruptAt(keras.callbacks.Callback):
    """Raises `Interrupted` at the end of batch `batch` of epoch `epoch` (after the
    callbacks before it in the list, e.g. BackupAndRestore, have run)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Interrupted(f"interrupted at epoch {self.epoch}, batch {batch}")


@functools.cache
def jax_seed_state_aliasing() -> frozenset:
    """Where MetaTrainer's checkpointed copy of a Dropout seed state and the model's seed
    state share one buffer on JAX: {"created"} after the copy is made
    (`trainers.base._value_initializer`), {"restored"} after a restore
    (`_restore_seed_states`: assigning an array assigns that buffer), or both. Keras's
    jitted step donates its state, so `fit` of any trainer with a Dropout layer then
    fails: "Attempt to donate the same buffer twice"."""
    trainer = BatteryTrainer(mlp("float32", dropout=0.5))

    def aliased():
        seeds = [trainer.model.non_trainable_variables[i] for i in trainer._seed_indices()]
        return any(
            a.value.unsafe_buffer_pointer() == b.value.unsafe_buffer_pointer()
            for a, b in zip(seeds, trainer._seed_states or [])
        )

    found = {"created"} if aliased() else set()
    trainer._restore_seed_states()  # what load_weights (BackupAndRestore) runs
    return frozenset(found | ({"restored"} if aliased() else set()))


# --------------------------------------------------------- JAX: the step stays on device

#: Primitives that call back into Python from a jitted JAX program.
HOST_CALLBACK_PRIMITIVES = frozenset({"pure_callback", "io_callback", "debug_callback"})


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def host_callbacks(jaxpr, where="<step>"):
    """`"<where>: <primitive>"` for every host callback in `jaxpr` and in every jaxpr
    nested in it (jit, cond branches, while / scan bodies, custom_jvp / vjp rules)."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in HOST_CALLBACK_PRIMITIVES or "callback" in name:
            found.append(f"{where}: {name}")
        for sub in _subjaxprs(eqn.params):
            found += host_callbacks(sub, f"{where}/{name}")
    return found


def jax_step_state(trainer):
    """The `state` Keras's JAX trainer passes to the train step: the values of
    (trainable, non-trainable, optimizer, metrics) variables."""
    return (
        [v.value for v in trainer.trainable_variables],
        [v.value for v in trainer.non_trainable_variables],
        [v.value for v in trainer.optimizer.variables],
        [v.value for v in trainer.metrics_variables],
    )


def jax_step_problems(trainer, batch):
    """Host callbacks in the jaxpr of the trainer's pure train step
    (`tf_metaalign.backend.jax.stateless_train_step`) on `batch`, and in the HLO that
    `jax.jit` lowers it to (a callback is a custom call there)."""
    import jax

    from tf_metaalign.backend import jax as jax_backend

    def step(state, batch):
        return jax_backend.stateless_train_step(trainer, state, batch)

    state = jax_step_state(trainer)
    problems = host_callbacks(jax.make_jaxpr(step)(state, batch).jaxpr)
    hlo = jax.jit(step).lower(state, batch).as_text()
    problems += [
        f"HLO: {line.strip()[:200]}"
        for line in hlo.splitlines()
        if "custom_call" in line and "callback" in line
    ]
    return problems


class CompileCounter:
    """`with CompileCounter() as c:` counts XLA compilations (JAX's
    `/jax/core/compile/backend_compile_duration` events) in the block: `c.count`."""

    _EVENT = "/jax/core/compile/backend_compile_duration"
    _active: list = []
    _registered = False

    def __init__(self):
        self.count = 0

    @classmethod
    def _listen(cls, event, duration, **kwargs):
        if event == cls._EVENT:
            for counter in cls._active:
                counter.count += 1

    def __enter__(self):
        if not CompileCounter._registered:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(CompileCounter._listen)
            CompileCounter._registered = True
        CompileCounter._active.append(self)
        return self

    def __exit__(self, *exc):
        CompileCounter._active.remove(self)


@contextlib.contextmanager
def counting_train_step_calls(trainer):
    """`with counting_train_step_calls(trainer) as calls:` `calls[0]` = the times the
    trainer's class `train_step` body ran in the block (once per JAX trace)."""
    cls = type(trainer)
    own = cls.__dict__.get("train_step")
    original = cls.train_step
    calls = [0]

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    cls.train_step = counted
    try:
        yield calls
    finally:
        if own is None:
            del cls.train_step
        else:
            cls.train_step = own
