"""The JAX side of the seam (`tf_metaalign.backend`): `jax.value_and_grad` / `jax.jvp` on
`model.stateless_call`, conditional work whose branches may assign variables, and the pure
train step that runs a trainer's `train_step(data)`.

How a trainer's step runs on JAX
--------------------------------
Trainers write ONE `train_step(self, data)` in Keras's stateful style: they read
`variable.value`, `assign` new values, call `optimizer.apply_gradients` and update metrics.
Keras's JAX trainer calls `train_step(state, data)` with the values of every variable
(`state = (trainable, non_trainable, optimizer, metrics)`) and expects the new values back,
with nothing assigned inside `jax.jit`. `stateless_train_step` bridges the two: it runs the
trainer's step inside a `keras.StatelessScope` that maps every variable to its value in
`state`, so every read sees `state` and every assignment is recorded in the scope; the
recorded values are the new state. Keras's own jit, `steps_per_execution`, donation and
`keras.distribution` shardings then apply unchanged (`make_train_function`).

Several devices: with `keras.distribution.DataParallel` Keras jits the step once over the
global batch (SPMD), so `num_replicas()` is 1 here and a trainer computes what TensorFlow
computes on one replica, on any number of devices (means over the batch are global means).
"""

from __future__ import annotations

import contextlib
import logging

import jax
import keras
from keras import ops

from tf_metaalign import _compat
from tf_metaalign.backend.jax_pooling import max_pool_as_selects

name = "jax"


# ------------------------------------------------------------------------- autodiff


def value_and_grad(f, params, *args):
    """`(value, grads, aux)` of `f(params, *args) -> (value, aux)` at `params`."""
    params = list(params)
    (value, aux), grads = jax.value_and_grad(lambda p: f(p, *args), has_aux=True)(params)
    return value, list(grads), aux


def value_grad_and_hvp(f, params, args, vector):
    """`(value, grads, aux, H v)`: forward over reverse (`jax.jvp` of the gradient), the
    same numbers as TensorFlow's reverse over reverse at a lower cost."""
    params = list(params)
    vector = [ops.cast(ops.stop_gradient(v), p.dtype) for v, p in zip(vector, params)]

    def grad_fn(p):
        (value, aux), grads = jax.value_and_grad(lambda q: f(q, *args), has_aux=True)(p)
        return list(grads), (value, aux)

    grads, hv, (value, aux) = jax.jvp(grad_fn, (params,), (vector,), has_aux=True)
    return value, grads, aux, [ops.cast(h, g.dtype) for h, g in zip(hv, grads)]


def jvp(f, primals, tangents):
    """`(f(*primals), J_f tangents)` (`jax.jvp`)."""
    primals = tuple(primals)
    tangents = tuple(ops.cast(t, p.dtype) for t, p in zip(tangents, primals))
    return jax.jvp(f, primals, tangents)


def executing_eagerly() -> bool:
    """False while JAX traces (jit, grad) or Keras builds symbolically."""
    return _compat.jax_trace_state_clean() and not _compat.in_keras_symbolic_scope()


# ------------------------------------------------------------- control flow with state


class _RecordingScope(keras.StatelessScope):
    """A stateless scope that starts from another's values and records which variables
    it assigned (the branches of `cond`)."""

    def __init__(self, parent):
        super().__init__()
        self.state_mapping = dict(parent.state_mapping)
        self.assigned = {}

    def add_update(self, update):
        variable, value = update
        self.assigned[id(variable)] = variable
        super().add_update(update)


def _is_concrete(pred) -> bool:
    return not isinstance(pred, jax.core.Tracer)


def cond(pred, true_fn, false_fn):
    """`jax.lax.cond(pred, true_fn, false_fn)` whose branches may assign variables.

    Inside a trainer's stateless step, each branch runs in its own scope that starts from
    the step's current values; the variables either branch assigns are found by tracing the
    branches once abstractly (`jax.eval_shape`), returned as outputs of the cond, and
    recorded in the step's scope after it. A branch that does not assign a variable
    returns its value unchanged. A concrete `pred` (eager) runs one branch as Python.
    """
    if isinstance(pred, bool):
        return true_fn() if pred else false_fn()
    if _compat.jax_trace_state_clean() and _is_concrete(pred):
        return true_fn() if bool(pred) else false_fn()
    scope = _compat.current_stateless_scope()
    if scope is None:
        return jax.lax.cond(pred, true_fn, false_fn)

    assigned = {}
    for fn in (true_fn, false_fn):
        assigned.update(_discover(fn, scope)[0])
    return _cond_in_scope(pred, true_fn, false_fn, scope, assigned)


def _discover(fn, scope):
    """Traces `fn()` once abstractly in a recording scope over `scope`: the variables it
    assigns ({key: variable}) and its outputs' shapes (`jax.ShapeDtypeStruct`s)."""
    probe = _RecordingScope(scope) if scope is not None else contextlib.nullcontext()

    def traced():
        with probe:
            return fn()

    shapes = jax.eval_shape(traced)
    return (probe.assigned if scope is not None else {}), shapes


def _cond_in_scope(pred, true_fn, false_fn, scope, assigned):
    """`jax.lax.cond` of two branches that assign (at most) the variables `assigned`:
    each branch runs in its own recording scope, returns their values as outputs, and
    they are recorded in `scope` after the cond."""
    keys = list(assigned)

    def branch(fn):
        def run():
            inner = _RecordingScope(scope)
            with inner:
                outputs = fn()
            values = []
            for key in keys:
                value = inner.state_mapping.get(key)
                if value is None:  # a variable the step had not read or written yet
                    value = assigned[key].value
                values.append(ops.cast(value, assigned[key].dtype))
            return outputs, values

        return run

    outputs, values = jax.lax.cond(pred, branch(true_fn), branch(false_fn))
    for key, value in zip(keys, values):
        scope.add_update((assigned[key], value))
    return outputs


def guarded(pred, fn):
    """`fn()` (which may assign variables) where `pred`; else nothing is assigned and the
    outputs are zeros of `fn`'s outputs. One `jax.lax.cond`: the skipped branch costs
    nothing, and the taken one updates the state in place (no select over the state).
    `fn` is traced twice at trace time (one abstract pass finds its outputs and the
    variables it assigns; then the cond's branch)."""
    if isinstance(pred, bool) or (_compat.jax_trace_state_clean() and _is_concrete(pred)):
        return fn() if bool(pred) else None
    scope = _compat.current_stateless_scope()
    assigned, shapes = _discover(fn, scope)

    def skip():
        return jax.tree.map(lambda s: ops.zeros(s.shape, s.dtype), shapes)

    if scope is None:
        return jax.lax.cond(pred, fn, skip)
    return _cond_in_scope(pred, fn, skip, scope, assigned)


# ---------------------------------------------------------------------- distribution


def num_replicas() -> int:
    """1: under `keras.distribution` the step is one SPMD program over the global batch."""
    return 1


def replica_id():
    return 0


def scale_loss_for_distribution(value):
    return value


def unscale_loss_for_distribution(value):
    return value


def all_reduce_sum(tensors):
    return tensors


def all_gather_rows(tensors):
    return tensors


def replica_share(tensors):
    return tensors


def traced_once(fn):
    """`fn` itself: `jax.jit` traces the step once; nested functions need nothing more."""
    return fn


def counter_dtype() -> str:
    return "int64" if jax.config.jax_enable_x64 else "int32"


# ------------------------------------------------------------------- the optimizer


def apply_gradients(optimizer, grads, variables):
    """`optimizer.apply_gradients(zip(grads, variables))` inside a stateless step.

    When `variables` are the variables the optimizer was built with (in order), Keras's
    `optimizer.stateless_apply` runs (what Keras's own JAX step calls; a
    `LossScaleOptimizer`'s skip of non-finite steps is written there without state), and
    the new values are assigned in the step's scope. Otherwise `optimizer.apply` runs in
    the scope (its assignments are recorded there).
    """
    variables = list(variables)
    built = list(optimizer._trainable_variables)
    scope = _compat.current_stateless_scope()
    if scope is None or [id(v) for v in variables] != [id(v) for v in built]:
        if scope is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise NotImplementedError(
                "On JAX a LossScaleOptimizer (mixed_float16) can only apply gradients to "
                "all the variables it was built with."
            )
        optimizer.apply(list(grads), variables)
        return
    optimizer_values = [v.value for v in optimizer.variables]
    new_params, new_optimizer_values = optimizer.stateless_apply(
        optimizer_values, list(grads), [v.value for v in variables]
    )
    for variable, value in zip(variables, new_params):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer_values):
        variable.assign(value)


# ------------------------------------------------------------------ the train step


def _state_variables(trainer):
    optimizer_variables = list(trainer.optimizer.variables) if trainer.optimizer else []
    return (
        list(trainer.trainable_variables),
        list(trainer.non_trainable_variables),
        optimizer_variables,
        list(trainer.metrics_variables),
    )


def check_finite_loss(trainer, loss, message):
    """Whether `loss` is finite (a boolean tensor), recorded for the step. Inside a stateless
    step `finish_step` then runs its assignments under `guarded(finite, ...)`: a step whose
    loss is not finite assigns nothing there, counts itself in the trainer's
    `nonfinite_loss_steps`, and fit raises `FloatingPointError(message)` right after
    (`make_train_function`). Eagerly, a concrete loss is checked at once (and raises)."""
    finite = ops.all(ops.isfinite(loss))
    checks = getattr(trainer, "_finite_checks", None)
    if checks is None:
        if _compat.jax_trace_state_clean() and not bool(finite):
            raise FloatingPointError(message)
        return True
    checks.append(finite)
    trainer._finite_message = message
    return finite


def stateless_train_step(trainer, state, data):
    """`(logs, new_state)`: the trainer's `train_step(data)` run purely on `state`.

    A step whose loss is not finite assigns nothing in `finish_step` (its assignments run
    under `guarded`), counts itself in `nonfinite_loss_steps`, and fit raises after it."""
    groups = _state_variables(trainer)
    mapping = [(v, value) for vs, values in zip(groups, state) for v, value in zip(vs, values)]
    trainer._finite_checks = []
    try:
        with keras.StatelessScope(state_mapping=mapping) as scope, max_pool_as_selects():
            logs = type(trainer).train_step(trainer, data)
        checks = trainer._finite_checks
    finally:
        trainer._finite_checks = None
    new_state = []
    for variables, values in zip(groups, state):
        new_values = []
        for variable, old in zip(variables, values):
            new = scope.get_current_value(variable)
            new_values.append(old if new is None else new)
        new_state.append(new_values)
    if checks:
        finite = checks[0]
        for check in checks[1:]:
            finite = ops.logical_and(finite, check)
        index = _nonfinite_index(trainer)
        count = state[1][index] + ops.cast(ops.logical_not(finite), state[1][index].dtype)
        new_state[1][index] = count
        logs = dict(logs)
        logs[_NONFINITE_LOG] = count
    return logs, tuple(new_state)


_NONFINITE_LOG = "__nonfinite_loss_steps__"


def _nonfinite_index(trainer):
    return next(
        i
        for i, v in enumerate(trainer.non_trainable_variables)
        if v is trainer.nonfinite_loss_steps
    )


def raise_if_nonfinite(trainer):
    """Raise the recorded non-finite-loss error for the counts fit has not checked yet."""
    pending = getattr(trainer, "_pending_nonfinite", None) or []
    trainer._pending_nonfinite = []
    for baseline, count in pending:
        if int(count) > baseline:
            raise FloatingPointError(getattr(trainer, "_finite_message", "loss is not finite"))


#: While a host-scheduled step is traced (see `make_train_function`): {id(schedule): the
#: phase its program is for}, and the set of (id(schedule), "first" | "last") it asked.
_STATIC_PHASES: tuple[dict, set] | None = None


def static_schedule_flag(schedule, which):
    """`schedule.is_first()` (`which="first"`) or `is_last()` ("last") as a Python bool
    in a step compiled for one phase of the schedule, else None.

    `make_train_function` compiles one program per combination of the flags a trainer's
    step asks of its `EveryKSteps` schedules (those advanced once per step; DotProd's
    `every=10` asks only `is_first`: two programs) and picks the program on the host from
    counters it read once at the start of `fit`. A skipped "every k" step then runs only
    its own work, with no `lax.cond`: on a CPU a cond costs the skipped step ~1.2x a plain
    one even in hand-written JAX, and on a GPU a cond reads its predicate back to the host."""
    if _STATIC_PHASES is None:
        return None
    phases, asked = _STATIC_PHASES
    phase = phases.get(id(schedule))
    if phase is None:
        return None
    asked.add((id(schedule), which))
    return phase == 0 if which == "first" else phase == schedule.k - 1


@contextlib.contextmanager
def _static_phases(phases, asked):
    global _STATIC_PHASES
    previous, _STATIC_PHASES = _STATIC_PHASES, (phases, asked)
    try:
        yield
    finally:
        _STATIC_PHASES = previous


def make_train_function(trainer, force=False):
    """Keras's JAX `make_train_function`, running the trainer's step through
    `stateless_train_step`, and skipping the batches a restored interrupted epoch already
    trained on (`MetaTrainer`'s mid-epoch resume; the count is read from the state)."""
    if trainer.train_function is not None and not force:
        return trainer.train_function

    def step(state, data):
        return stateless_train_step(trainer, state, data)

    non_trainable = trainer.non_trainable_variables
    index = next(i for i, v in enumerate(non_trainable) if v is trainer.epoch_steps)
    jitted = not trainer.run_eagerly and trainer.jit_compile
    # "Every k" schedules advanced once per step (`MetaTrainer.every_k_steps`): their phase
    # is known on the host, so each phase class gets its own program (no lax.cond).
    schedules = [s for s in getattr(trainer, "_schedules", ()) if s.k > 1] if jitted else []
    count_indices = [
        next(i for i, v in enumerate(non_trainable) if v is s.count) for s in schedules
    ]
    counts, carried = [], [None]  # host copies of the counters; the state they follow
    if jitted:
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, trainer._get_state_sharding_spec())
        programs = {}
        asked = set()  # the flags the traced programs asked: they make a program's key

        def program(phases):
            def phased_step(state, data):
                with _static_phases(dict(zip(map(id, schedules), phases)), asked):
                    return step(state, data)

            return jax.jit(phased_step, donate_argnums=0, out_shardings=out_shardings)

        def key(phases):
            flags = []
            for s, phase in zip(schedules, phases):
                if (id(s), "first") in asked:
                    flags.append(phase == 0)
                if (id(s), "last") in asked:
                    flags.append(phase == s.k - 1)
            return tuple(flags), len(asked)

        def host_scheduled_step(state, data):
            phases = [c % s.k for c, s in zip(counts, schedules)]
            function = programs.get(key(phases))
            if function is None:
                function = program(phases)
                outputs = function(state, data)  # traced now: `asked` may have grown
                programs[key(phases)] = function
            else:
                outputs = function(state, data)
            # A step whose loss is not finite keeps its counters; fit raises one call later.
            counts[:] = [c + 1 for c in counts]
            return outputs

        iterator_step = trainer._make_function(host_scheduled_step)
    else:
        iterator_step = trainer._make_function(step)

    def function(state, iterator):
        if trainer._skip_batches is None:
            trainer._building_from_training_batch = False
            trainer._skip_batches = int(state[1][index])
            trainer._pending_nonfinite = []
            trainer._nonfinite_baseline = int(state[1][_nonfinite_index(trainer)])
            if trainer._skip_batches:
                logging.info(
                    "Resuming mid-epoch: skipping %d batches already trained on.",
                    trainer._skip_batches,
                )
        if trainer._skip_batches >= trainer.steps_per_execution:
            for _ in range(trainer.steps_per_execution):
                next(iterator)
            trainer._skip_batches -= trainer.steps_per_execution
            return {}, state
        while trainer._skip_batches > 0:
            next(iterator)
            trainer._skip_batches -= 1
        if schedules and state[1] is not carried[0]:
            # A state that fit did not carry from the last call (a new fit or epoch, a
            # callback's sync, train_on_batch): the schedules' counters as it holds them.
            counts[:] = [int(state[1][i]) for i in count_indices]
        # A step whose loss was not finite kept its state; its count comes back as a
        # log. Checked one call late, so that the host does not wait for each step.
        pending = trainer._pending_nonfinite
        if len(pending) > 1:
            trainer._pending_nonfinite = pending[:-1]
            raise_if_nonfinite(trainer)
            trainer._pending_nonfinite = pending[-1:]
        logs, state = iterator_step(state, iterator)
        carried[0] = state[1]
        if _NONFINITE_LOG in logs:
            logs = dict(logs)
            trainer._pending_nonfinite.append(
                (trainer._nonfinite_baseline, logs.pop(_NONFINITE_LOG))
            )
        return logs, state

    trainer.train_function = function
    return function


def densify(tensors) -> list:
    """JAX's gradients are dense already."""
    return list(tensors)


def add_n(tensors):
    """The sum of same-shaped tensors, left to right."""
    tensors = list(tensors)
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


# ----------------------------------------------------------------------- float64


class enable_x64:
    """64-bit floats and integers on Keras's JAX backend: `jax_enable_x64` on AND Keras's
    type promotion told to keep them (Keras 3.15 computes 64-bit results in 32 bits on JAX
    otherwise: `_compat.keras_jax_promotes_64_bit`). Call `enable_x64()` once before
    building a float64 model, or use it as a context manager (restores both after).

    Example:
      >>> from tf_metaalign.backend import jax as jax_backend  # doctest: +SKIP
      >>> jax_backend.enable_x64()  # doctest: +SKIP
    """

    def __init__(self, enabled: bool = True):
        self._previous = (jax.config.jax_enable_x64, _compat.keras_jax_promotes_64_bit(enabled))
        jax.config.update("jax_enable_x64", enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        jax.config.update("jax_enable_x64", self._previous[0])
        _compat.keras_jax_promotes_64_bit(self._previous[1])


def read_value(variable):
    """The variable's current value (through the step's stateless scope)."""
    return ops.convert_to_tensor(getattr(variable, "value", variable))
