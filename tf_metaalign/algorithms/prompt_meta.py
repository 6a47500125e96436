"""Prompt-tuning FOMAML and Reptile (Wu et al., "Continued Pretraining for Better Zero- and
Few-Shot Promptability", EMNLP 2022) as pure pieces on tensors.

Reference: allenai/better-promptability, `better_promptability/models/meta_learner.py`,
`MetaLearner.forward` (configs `configs/fomaml.jsonnet`, `configs/reptile.jsonnet`). Per task
b of a meta-batch of B tasks, from the meta weights phi (transformer and prompt):

* inner loop: T = `adaptation_steps` steps of the inner optimizer on the PROMPT only (the
  learner's transformer parameters have `requires_grad=False`, so they get no gradient and
  the optimizer skips them), on the task's support batches (the FOMAML config reuses ONE
  support batch for every step, `different_inner_loop_batches=False`; the Reptile config cuts
  the support batch into T batches, `different_inner_loop_batches=True`);
* `learner.unfreeze()`, then the query loss's gradient for ALL parameters at the adapted
  prompt (transformer weights still phi's):
  - FOMAML: `p.grad += l.grad`; outer gradient = mean over the B tasks of these gradients;
  - Reptile: one more step of the SAME inner optimizer on all parameters with that
    gradient, giving phi_b; `p.grad += -phi_b`, then `p.grad = p.grad / B + p`: the outer
    gradient is phi - mean_b phi_b. The reference code does NOT divide by the inner rate
    alpha (the paper writes the update with 1/alpha); with its Adafactor outer optimizer
    (update g / sqrt(E[g^2])) such a constant factor changes only the clipping at 1.0
    and epsilon_1, so we follow the code. B is the number of tasks of the meta-batch.
* `reuse_inner_opt_state=True` (the default): the inner optimizer's state_dict is saved
  after each task and loaded before the next, so it is CARRIED across the tasks of a
  meta-batch AND across meta-batches (one chain for the whole training). For Reptile the
  chain holds the prompt's state (T + 1 updates per task) and the transformer's (1 update
  per task); HF Adafactor counts steps per parameter, which is why the prompt and the other
  variables keep separate `OptimizerState`s (separate iteration counts) here.
* Under DDP each process runs its own tasks (the meta-batch is split among processes) and
  the gradients are averaged over processes: the outer gradient is the mean over ALL tasks.

Not in the inner loop: gradient clipping (Lightning's `gradient_clip_val=1.0` clips the
OUTER gradient only; use the outer optimizer's `aggregated_clipnorm=1.0`).

Units: the tasks of a replica are its own (nothing is all-reduced in the inner loop), so
the inner gradients are taken in the task's own units (Keras's per-replica division of
the compiled loss undone: `task_units`); the gradients returned for the outer optimizer are
in Keras's per-replica units (what `apply_gradients` sums over replicas).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.algorithms import reptile as R

DEFAULT_PROMPT_SUBSTRING = "prompt"


def prompt_indices(variables: Sequence, prompt_variables=None) -> tuple[int, ...]:
    """Positions among `variables` (e.g. `model.trainable_variables`) of the prompt.

    Raises a ValueError when the selection is empty or names a variable not in `variables`.

    Args:
      variables: the variables, e.g. `model.trainable_variables`.
      prompt_variables: None (every variable whose `.path` contains "prompt"), a list of
        variables among `variables`, or a predicate `path -> bool` on `variable.path`.

    Returns:
      A tuple of positions.

    Example:
      >>> from tf_metaalign.algorithms import prompt_indices
      >>> variables = [keras.Variable(1.0, name="kernel"), keras.Variable(0.0, name="soft_prompt")]
      >>> prompt_indices(variables), prompt_indices(variables, lambda path: path == "kernel")
      ((1,), (0,))
    """
    variables = list(variables)
    if prompt_variables is None:
        chosen = [i for i, v in enumerate(variables) if DEFAULT_PROMPT_SUBSTRING in _path(v)]
        what = f'variables whose path contains "{DEFAULT_PROMPT_SUBSTRING}"'
    elif callable(prompt_variables):
        chosen = [i for i, v in enumerate(variables) if prompt_variables(_path(v))]
        what = "variables whose path the `prompt_variables` predicate accepts"
    elif isinstance(prompt_variables, (list, tuple)):
        ids = {id(v): i for i, v in enumerate(variables)}
        missing = [_path(v) for v in prompt_variables if id(v) not in ids]
        if missing:
            raise ValueError(
                f"`prompt_variables` must be trainable variables of the model; {missing} are not."
            )
        chosen = sorted({ids[id(v)] for v in prompt_variables})
        what = "variables in `prompt_variables`"
    else:
        raise ValueError(
            "`prompt_variables` must be None, a list of the model's variables or a "
            f"predicate on `variable.path`; got {type(prompt_variables).__name__}."
        )
    if not chosen:
        raise ValueError(
            f"`prompt_variables`: no trainable variable selected (looked for {what} among "
            f"{[_path(v) for v in variables]})."
        )
    return tuple(chosen)


def _path(variable):
    return getattr(variable, "path", None) or variable.name


def take(values: Sequence, indices: Sequence[int]) -> list:
    return [values[i] for i in indices]


def merge(values: Sequence, indices: Sequence[int], replacement: Sequence) -> list:
    """`values` with `values[indices[j]] = replacement[j]`."""
    out = list(values)
    for i, r in zip(indices, replacement):
        out[i] = r
    return out


def complement(indices: Sequence[int], n: int) -> tuple[int, ...]:
    chosen = set(indices)
    return tuple(i for i in range(n) if i not in chosen)


def task_units(grads):
    """Gradients of a replica-local task in the task's own units: Keras divides a compiled
    loss by the replica count, nothing is all-reduced, so multiply by it back."""
    n = F.num_replicas()
    return grads if n == 1 else F.scale(n, grads)


def prompt_inner_loop(
    loss_fn: Callable,
    params,
    state,
    batches,
    indices,
    optimizer,
    variables,
    optimizer_state=None,
    loss_scale=None,
    reduce: Callable = task_units,
) -> R.InnerLoopResult:
    """T = len(batches) first-order inner steps on the PROMPT only (`R.inner_loop` on a
    loss of the prompt tensors, the other weights held at `params`): no gradient of the
    other weights is computed and they are returned unchanged. `optimizer_state` covers the
    prompt variables only (`optimizer.initial_state(take(variables, indices))`).

    Args:
      loss_fn: as in `prompt_fomaml`.
      params: phi, one tensor per trainable variable.
      state: the model's non-trainable state.
      batches: the T inner batches.
      indices: positions of the prompt variables (`prompt_indices`).
      optimizer: the inner optimizer.
      variables: the trainable Keras variables.
      optimizer_state: the prompt's inner optimizer state; None = fresh.
      loss_scale: the loss scale `loss_fn` multiplies its loss by, or None.
      reduce: sums per-replica gradients (see `inner_loop`).

    Returns:
      An `InnerLoopResult` whose `params` is the full list (adapted prompt merged in).

    Example:
      >>> from tf_metaalign.algorithms import prompt_inner_loop
      >>> from tf_metaalign.optimizers import SGD
      >>> variables = [keras.Variable(0.0, name="prompt"), keras.Variable(1.0, name="w")]
      >>> def loss_fn(params, state, batch):  # (x w + prompt - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[1] + params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> params = [v.value for v in variables]
      >>> r = prompt_inner_loop(loss_fn, params, [], [(1.0, 3.0)], (0,), SGD(0.25), variables)
      >>> [float(p) for p in r.params]  # the prompt moved, w did not
      [1.0, 1.0]
    """
    fixed = [ops.stop_gradient(ops.convert_to_tensor(p)) for p in params]

    def prompt_loss_fn(prompt, state, batch):
        return loss_fn(merge(fixed, indices, prompt), state, batch)

    result = R.inner_loop(
        prompt_loss_fn,
        take(fixed, indices),
        state,
        batches,
        optimizer,
        take(variables, indices),
        optimizer_state=optimizer_state,
        loss_scale=loss_scale,
        reduce=reduce,
    )
    return result._replace(params=merge(fixed, indices, result.params))


class PromptMetaResult(NamedTuple):
    """What `prompt_fomaml` / `prompt_reptile` return for one meta-batch (one replica).

    Attributes:
      gradients: the outer gradient, one tensor per variable, in Keras's per-replica
        units (hand it to `apply_gradients`; the cross-replica sum is the mean over ALL
        tasks). Reptile: times `loss_scale` when given (what a LossScaleOptimizer divides
        back).
      state: the model's non-trainable state after every pass (threaded through the
        tasks).
      optimizer_states: the inner optimizer's state after the last task: (prompt state,)
        for FOMAML, (prompt state, other variables' state) for Reptile.
      support_losses: per task, the loss of its LAST inner step (before that step), the
        reference's logged "support_loss" (per-replica units, divided by any loss scale).
      query_losses: per task, the query loss at the adapted prompt (per-replica units).
      y_pred: per task, the query outputs at the adapted prompt.

    Example:
      >>> from tf_metaalign.algorithms import PromptMetaResult
      >>> PromptMetaResult._fields[:3]
      ('gradients', 'state', 'optimizer_states')
    """

    gradients: list
    state: list
    optimizer_states: tuple
    support_losses: list
    query_losses: list
    y_pred: list


def _check_tasks(tasks):
    if not tasks:
        raise ValueError("`tasks` is empty: a meta-batch needs at least one task.")
    for t, (support, _) in enumerate(tasks):
        if not support:
            raise ValueError(f"`tasks[{t}]` has no support batch (at least one inner step).")


def prompt_fomaml(
    loss_fn: Callable,
    params,
    state,
    tasks,
    indices,
    optimizer,
    variables,
    optimizer_states=None,
    carry_inner_state=True,
    loss_scale=None,
    reduce: Callable = task_units,
) -> PromptMetaResult:
    """Prompt FOMAML over one meta-batch (`MetaLearner.forward`, algorithm "fomaml").

    Args:
      loss_fn: `loss_fn(params, state, batch) -> (loss, (new_state, y_pred))` in Keras's
        per-replica units, times `loss_scale` when given.
      params: phi, one tensor per trainable variable.
      state: the model's non-trainable state.
      tasks: list of `(support_batches, query_batch)`, one per task of this replica.
      indices: positions of the prompt variables (`prompt_indices`).
      optimizer: the inner optimizer (a `tf_metaalign.optimizers.BaseOptimizer`).
      variables: the trainable Keras variables (options, constraints of the rule).
      optimizer_states: `(prompt state,)` to start from; None = fresh.
      carry_inner_state: True: the inner state runs on from task to task (the reference's
        `reuse_inner_opt_state=True`); False: every task starts from `optimizer_states`.
      loss_scale: the loss scale `loss_fn` multiplies its loss by, or None.
      reduce: how per-task gradients are put in Keras's per-replica units.

    Outer gradient: (1/B) sum_b grad_phi L_query(prompt_b, transformer phi).

    Returns:
      A `PromptMetaResult`.

    Example:
      >>> from tf_metaalign.algorithms import prompt_fomaml
      >>> from tf_metaalign.optimizers import SGD
      >>> variables = [keras.Variable(0.0, name="prompt"), keras.Variable(1.0, name="w")]
      >>> def loss_fn(params, state, batch):  # (x w + prompt - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[1] + params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> task = ([(1.0, 3.0)], (1.0, 3.0))  # (support batches, query batch)
      >>> params = [v.value for v in variables]
      >>> r = prompt_fomaml(loss_fn, params, [], [task], (0,), SGD(0.25), variables)
      >>> [float(g) for g in r.gradients], float(r.query_losses[0])  # at prompt 1: residual -1
      ([-2.0, -2.0], 1.0)

    References:
      Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
      EMNLP 2022.
    """
    _check_tasks(tasks)
    loss_fn = F.traced_once(loss_fn)  # one trace for every task's passes
    prompt_vars = take(variables, indices)
    start = (
        optimizer_states[0]
        if optimizer_states is not None
        else optimizer.initial_state(prompt_vars)
    )
    inner_state, total = start, None
    support_losses, query_losses, outputs = [], [], []
    for support, query in tasks:
        r = prompt_inner_loop(
            loss_fn,
            params,
            state,
            support,
            indices,
            optimizer,
            variables,
            inner_state if carry_inner_state else start,
            loss_scale,
            reduce,
        )
        query_loss, grads, (state, y_pred) = F.value_and_grad(loss_fn, r.params, r.state, query)
        total = grads if total is None else F.add(total, grads)
        inner_state = r.optimizer_state
        support_losses.append(_unscaled(r.losses[-1], loss_scale))
        query_losses.append(_unscaled(query_loss, loss_scale))
        outputs.append(y_pred)
    gradients = F.scale(1.0 / len(tasks), total)
    return PromptMetaResult(
        gradients,
        state,
        (inner_state if carry_inner_state else start,),
        support_losses,
        query_losses,
        outputs,
    )


def prompt_reptile(
    loss_fn: Callable,
    params,
    state,
    tasks,
    indices,
    optimizer,
    variables,
    optimizer_states=None,
    carry_inner_state=True,
    loss_scale=None,
    reduce: Callable = task_units,
) -> PromptMetaResult:
    """Prompt Reptile over one meta-batch (`MetaLearner.forward`, algorithm "reptile").

    Per task: T prompt-only inner steps, then ONE step of the same inner optimizer on all
    variables with the query-loss gradient at the adapted prompt (task units), giving
    phi_b. Outer gradient: phi - mean_b phi_b (the reference's `p.grad / B + p`), returned
    as this replica's share (`functional.replica_share`), so that the optimizer's sum over
    replicas is phi - (mean over all tasks) (equal task counts per replica).
    `optimizer_states`: `(prompt state, other variables' state)`; None = fresh. Arguments
    otherwise as `prompt_fomaml`.

    Args:
      loss_fn: as in `prompt_fomaml`.
      params: as in `prompt_fomaml`.
      state: as in `prompt_fomaml`.
      tasks: as in `prompt_fomaml`.
      indices: as in `prompt_fomaml`.
      optimizer: as in `prompt_fomaml`.
      variables: as in `prompt_fomaml`.
      optimizer_states: `(prompt state, other variables' state)`; None = fresh.
      carry_inner_state: as in `prompt_fomaml`.
      loss_scale: as in `prompt_fomaml`.
      reduce: as in `prompt_fomaml`.

    Returns:
      A `PromptMetaResult`.

    Example:
      >>> from tf_metaalign.algorithms import prompt_reptile
      >>> from tf_metaalign.optimizers import SGD
      >>> variables = [keras.Variable(0.0, name="prompt"), keras.Variable(1.0, name="w")]
      >>> def loss_fn(params, state, batch):  # (x w + prompt - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[1] + params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> task = ([(1.0, 3.0)], (1.0, 3.0))
      >>> params = [v.value for v in variables]
      >>> r = prompt_reptile(loss_fn, params, [], [task], (0,), SGD(0.25), variables)
      >>> [float(g) for g in r.gradients]  # phi - phi_b, phi_b = (1.5, 1.5)
      [-1.5, -0.5]

    References:
      Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
      EMNLP 2022.
    """
    _check_tasks(tasks)
    loss_fn = F.traced_once(loss_fn)  # one trace for every task's passes
    others = complement(indices, len(params))
    prompt_vars, other_vars = take(variables, indices), take(variables, others)
    if optimizer_states is None:
        start = (optimizer.initial_state(prompt_vars), optimizer.initial_state(other_vars))
    else:
        start = tuple(optimizer_states)
    phi = [ops.convert_to_tensor(p) for p in params]
    inner_states, ends = start, []
    support_losses, query_losses, outputs = [], [], []
    for support, query in tasks:
        prompt_state, other_state = inner_states if carry_inner_state else start
        r = prompt_inner_loop(
            loss_fn,
            phi,
            state,
            support,
            indices,
            optimizer,
            variables,
            prompt_state,
            loss_scale,
            reduce,
        )
        query_loss, grads, (state, y_pred) = F.value_and_grad(loss_fn, r.params, r.state, query)
        grads = reduce(grads)
        if loss_scale is not None:
            grads = [g / ops.cast(loss_scale, g.dtype) for g in grads]
        grads = [ops.stop_gradient(g) for g in grads]
        # The full-model step: one update of every variable, each group at its own count.
        new_prompt, prompt_state = optimizer.apply_on_tensors(
            take(grads, indices), take(r.params, indices), r.optimizer_state, prompt_vars
        )
        new_params = merge(r.params, indices, new_prompt)
        if others:
            new_other, other_state = optimizer.apply_on_tensors(
                take(grads, others), take(r.params, others), other_state, other_vars
            )
            new_params = merge(new_params, others, new_other)
        ends.append([ops.stop_gradient(p) for p in new_params])
        inner_states = (prompt_state, other_state)
        support_losses.append(_unscaled(r.losses[-1], loss_scale))
        query_losses.append(_unscaled(query_loss, loss_scale))
        outputs.append(y_pred)
    delta = R.mean_reptile_gradient(phi, ends)
    if loss_scale is not None:
        delta = [d * ops.cast(loss_scale, d.dtype) for d in delta]
    return PromptMetaResult(
        F.replica_share(delta),
        state,
        inner_states if carry_inner_state else start,
        support_losses,
        query_losses,
        outputs,
    )


def _unscaled(loss, loss_scale):
    return loss if loss_scale is None else loss / ops.cast(loss_scale, loss.dtype)
