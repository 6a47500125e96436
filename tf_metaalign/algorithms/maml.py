"""MAML (Finn et al., 2017), Meta-SGD (Li et al., 2017), MAML++ (Antoniou et al., 2019)
and gradient sharing (Chang & Lipson) as pure computations on tensors.

Inputs are weights as lists of tensors (one per `model.trainable_variables`), the
model's non-trainable `state`, and per task a support batch and a query batch; nothing is
assigned. Two loss functions, both `loss_fn(params, state, batch) -> (loss, (new_state,
outputs))` (e.g. `MetaTrainer.loss_fn()` / `functional.make_loss_fn`):

* `inner_loss_fn`: the loss of ONE task's support set, in the task's own units (the
  trainer passes the compiled loss with Keras's per-replica division undone, so an inner
  step does not depend on the replica count);
* `query_loss_fn`: the loss of one task's query set in the caller's units (a trainer:
  Keras's per-replica units, so the outer gradients are what `apply_gradients` takes).

The inner loop (`adapt`) is plain SGD on tensors: for k = 1..K and every task t,

    theta_{t,k} = theta_{t,k-1} - alpha_k * Delta_{t,k},   theta_{t,0} = theta,
    Delta_{t,k} = grad L_t^support(theta_{t,k-1})      (or the gradient-sharing mix),

where alpha_k is a list with one entry per weight (a scalar: MAML, MAML++'s per-layer
per-step LSLR; a tensor of the weight's shape: Meta-SGD). ALL tasks take step k before any
takes step k + 1 (gradient sharing needs the sum over tasks at each step).

The meta-objective (`meta_gradient`) is the mean over tasks of sum_k w_k L_t^query(theta_{t,k}),
with w = (0, ..., 0, 1) (MAML) or MAML++'s multi-step loss weights
(`multi_step_loss_weights`). Its gradient with respect to theta and to the hyper-
parameters (alphas, m, lambda) is taken:

* second order (`first_order=False`): through the whole inner loop (nested gradient tapes;
  the inner gradients are differentiated, Hessian-vector products included). With
  `order_weight` (a scalar tensor, MAML++'s derivative-order annealing) the inner
  gradients' derivatives are multiplied by it: 1 = second order, 0 = first order (the
  cost stays that of second order);
* first order (`first_order=True`): the inner gradients are constants. The inner loop runs
  OUTSIDE the outer tape (no forward pass of it is recorded); on the tape only the
  elementwise update rule is replayed with those constant gradients, so theta_{t,K} =
  theta - sum_k alpha_k Delta_{t,k}: d theta_{t,K} / d theta = I (the FOMAML gradient is the
  query gradient at theta_{t,K}), and the alphas, m and lambda still get their (first-
  order) gradients.

State threading: the model's non-trainable state (BatchNorm statistics, Dropout seeds)
goes through the forward passes in the order: for k: for t: support pass; then for t: for
k in the query steps: query pass. Batch statistics are those of each pass's batch
(`training=True` in `loss_fn`), as in the reference MAML.

The backends: on TensorFlow the tasks run one after another (an unrolled loop of nested
gradient tapes, each task's step traced once). On JAX they run in parallel: every pass of
a step is one `jax.vmap` over the task axis (theta shared by the tasks at step 0, per task
after; on CPU by default an unrolled loop instead, `JAX_TASK_MAP`), all from the state
the step starts with, and the state after the T passes is
composed as TensorFlow's sequence gives it (`_compose_tasks`: exact for elementwise-
affine updates such as BatchNorm's moving statistics; integer seed states add their
increments; the multi-step query passes in TensorFlow's task-major order). The
meta-objective is one function of (theta, hyper) on both, differentiated by
`tf_metaalign.backend.value_and_grad` (a tape on TensorFlow, `jax.value_and_grad` on
JAX: second order through the inner `jax.grad`). The public functions take and return
per-task lists on both backends.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import keras
from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F
from tf_metaalign.algorithms.gradient_sharing import GradientSharing

LEARN_INNER_LEARNING_RATES = ("none", "per_parameter", "per_layer_per_step")


class AdaptResult(NamedTuple):
    """What `adapt` returns.

    Attributes:
      trajectories: per task, the list [theta_{t,0}, ..., theta_{t,K}] (each a list of
        tensors).
      state: the model's state after the support passes.
      support_losses: per step k, the mean over tasks of the support loss at
        theta_{t,k-1}.
      g_hat: gradient sharing's new [g_hat_1, ..., g_hat_K] (training), else None.
      record: per step, (task gradients, g_k or None): the constant inner gradients of a
        first-order run, replayed on the outer tape by `replay`.

    Example:
      >>> from tf_metaalign.algorithms import AdaptResult
      >>> AdaptResult._fields
      ('trajectories', 'state', 'support_losses', 'g_hat', 'record')
    """

    trajectories: list
    state: list
    support_losses: list
    g_hat: list | None
    record: list


class MetaGradientResult(NamedTuple):
    """What `meta_gradient` returns.

    Attributes:
      loss: the meta-objective (mean over tasks, `query_loss_fn`'s units).
      grads: d loss / d params (a list, like `params`).
      hyper_grads: d loss / d each tensor of `hyper` (same structure).
      state: the model's state after every pass.
      y_pred: the query outputs at theta_{t,K} of every task, concatenated along axis 0.
      g_hat: gradient sharing's new g_hat (list over steps), or None.
      support_losses: per step, the mean support loss over tasks.
      query_losses: per task, the query loss at theta_{t,K}.

    Example:
      >>> from tf_metaalign.algorithms import MetaGradientResult
      >>> MetaGradientResult._fields[:3]
      ('loss', 'grads', 'hyper_grads')
    """

    loss: object
    grads: list
    hyper_grads: dict
    state: list
    y_pred: object
    g_hat: list | None
    support_losses: list
    query_losses: list


# ------------------------------------------------------------- per-step statistics


class StepStatistics:
    """MAML++'s per-step batch-norm statistics: one copy per inner step of some entries
    of the model's state (the BatchNorm moving statistics), swapped in for the forward
    passes of that step.

    `indices`: the positions of those entries in the model's state; `values`: per step k,
    their values (a list of tensors). The support pass of inner step k (at theta_{t,k-1})
    and the query pass at theta_{t,k} run with copy k-1 in place and write their new
    statistics back into it (AntreasAntoniou/HowToTrainYourMAMLPytorch: `num_step`);
    the other entries of the state (Dropout seeds) are threaded through every pass as
    usual. A per-call accumulator: `adapt` and `query_objective` update `values`.

    Args:
      indices: the positions of the per-step entries in the model's state.
      values: per step k, their values (a list of tensors).

    Example:
      >>> from tf_metaalign.algorithms import StepStatistics
      >>> stats = StepStatistics([1], [[tf.constant(0.0)], [tf.constant(10.0)]])
      >>> state = stats.enter(1, [tf.constant(-1.0), tf.constant(5.0)])  # step 1's copy
      >>> [float(s) for s in state]
      [-1.0, 10.0]
      >>> _ = stats.leave(1, [state[0], state[1] + 1.0])  # the pass's new statistics
      >>> [[float(v) for v in step] for step in stats.values]
      [[0.0], [11.0]]

    References:
      Antoniou et al., "How to train your MAML", ICLR 2019 (per-step batch normalisation).
      https://arxiv.org/abs/1810.09502
    """

    def __init__(self, indices, values):
        self.indices = list(indices)
        self.values = [list(v) for v in values]

    def enter(self, step, state):
        state = list(state)
        for i, value in zip(self.indices, self.values[step]):
            state[i] = value
        return state

    def leave(self, step, state):
        self.values[step] = [state[i] for i in self.indices]
        return state


# ---------------------------------------------------------------------- validation


def validate_learn_inner_learning_rates(value):
    if value not in LEARN_INNER_LEARNING_RATES:
        raise ValueError(
            f"`learn_inner_learning_rates` must be one of {LEARN_INNER_LEARNING_RATES}; "
            f"got {value!r}."
        )
    return value


# ---------------------------------------------------------------------- pieces


def multi_step_loss_weights(steps: int, epoch, annealing_epochs: int, dtype="float32"):
    """MAML++'s per-step importance of the query losses at theta_1..theta_K.

    Epoch 0: uniform 1/K. Each epoch the non-final weights decrease by
    1/(K * annealing_epochs), down to 0.03/K, and the final one increases by (K-1) times
    that, up to 1 - (K-1) * 0.03/K (AntreasAntoniou/HowToTrainYourMAMLPytorch,
    `get_per_step_loss_importance_vector`). From epoch `annealing_epochs` on, only the
    final step's loss counts: (0, ..., 0, 1).

    Args:
      steps: K, the number of inner steps.
      epoch: the current epoch (a python number or a tensor).
      annealing_epochs: the epochs over which the weights anneal.
      dtype: the weights' dtype.

    Returns:
      A `[K]` tensor summing to 1.

    Example:
      >>> from tf_metaalign.algorithms import multi_step_loss_weights
      >>> for epoch in (0, 5, 10):
      ...     print([round(float(w), 4) for w in multi_step_loss_weights(3, epoch, 10)])
      [0.3333, 0.3333, 0.3333]
      [0.1667, 0.1667, 0.6667]
      [0.0, 0.0, 1.0]

    References:
      Antoniou et al., "How to train your MAML", ICLR 2019 (multi-step loss).
      https://arxiv.org/abs/1810.09502
    """
    dtype = keras.backend.standardize_dtype(dtype)
    k = float(steps)
    epoch = ops.cast(epoch, dtype)
    if steps == 1:
        return ops.ones([1], dtype)

    def c(value):  # a python number exact in dtype
        return F.scalar(value, dtype)

    decay = 1.0 / k / float(annealing_epochs)
    floor = 0.03 / k
    early = ops.maximum(c(1.0 / k) - epoch * c(decay), c(floor))
    final = ops.minimum(c(1.0 / k) + epoch * c(k - 1.0) * c(decay), c(1.0 - (k - 1.0) * floor))
    annealed = ops.concatenate(
        [ops.full([steps - 1], early, dtype=dtype), ops.reshape(final, [1])], 0
    )
    last_only = ops.one_hot(steps - 1, steps, dtype=dtype)
    return ops.where(epoch < c(float(annealing_epochs)), annealed, last_only)


def _task_gradient(inner_loss_fn, theta, state, batch, mode, order_weight, loss_scale=None):
    """(loss, grad, new_state) of one task's support loss at theta.

    mode: "const" (stop the gradient: first order), "diff" (second order). With
    `loss_scale`, the loss function's value is scaled by it: the gradient and the
    returned loss are divided by it."""
    loss, grad, (state, _) = backend.value_and_grad(inner_loss_fn, theta, state, batch)
    if loss_scale is not None:
        grad = [g / ops.cast(loss_scale, g.dtype) for g in grad]
        loss = loss / ops.cast(loss_scale, loss.dtype)
    if mode == "const":
        grad = [ops.stop_gradient(g) for g in grad]
    elif order_weight is not None:
        # Value g; derivative order_weight * dg (MAML++ derivative-order annealing).
        w = order_weight
        grad = [
            ops.stop_gradient(g) + ops.cast(w, g.dtype) * (g - ops.stop_gradient(g)) for g in grad
        ]
    return loss, grad, state


def _as(value, dtype):
    """`value` in `dtype` (a python float is converted in `dtype` directly, not via float32)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return F.scalar(value, dtype)
    return ops.cast(value, dtype)


def _sgd(theta, alpha, delta):
    return [t - _as(a, t.dtype) * _as(d, t.dtype) for t, a, d in zip(theta, alpha, delta)]


def _mean_over_tasks(values):
    """The mean of per-task scalars (a list, or on JAX a [T] tensor), summed in order."""
    if isinstance(values, (list, tuple)):
        return backend.add_n(values) / ops.cast(len(values), values[0].dtype)
    return ops.sum(values) / ops.cast(ops.shape(values)[0], values.dtype)


# ------------------------------------------------- the tasks in parallel (JAX: jax.vmap)


def _vectorized() -> bool:
    """Whether the tasks of a meta-batch run in parallel (`jax.vmap` over the task axis,
    JAX) or one after another (TensorFlow: an unrolled loop of nested tapes)."""
    return backend.is_jax()


def _jax():
    import jax

    return jax


def _stack_tasks(batches):
    """Per-task batches (a list) -> one batch with a leading task axis."""
    jax = _jax()
    return jax.tree.map(lambda *xs: ops.stack([ops.convert_to_tensor(x) for x in xs], 0), *batches)


def _task(stacked, t):
    return _jax().tree.map(lambda a: a[t], stacked)


def _floating(x) -> bool:
    return "float" in keras.backend.standardize_dtype(x.dtype)


def _state_slopes(loss_fn, theta, state, batch):
    """Per floating entry of `state`: the slope of the pass's state update, d new / d
    state along ones (`jax.jvp`; BatchNorm's moving statistics: the momentum). Under jit
    only the update itself is computed (nothing else reaches these tangents)."""
    jax = _jax()
    index = [i for i, s in enumerate(state) if _floating(s)]
    if not index:
        return {}
    theta = [ops.stop_gradient(p) for p in theta]
    batch = jax.tree.map(ops.stop_gradient, batch)

    def update(values):
        s = list(state)
        for i, v in zip(index, values):
            s[i] = v
        new_state = loss_fn(theta, s, batch)[1][0]
        return [new_state[i] for i in index]

    primals = [ops.stop_gradient(state[i]) for i in index]
    _, slopes = jax.jvp(update, (primals,), ([ops.ones_like(p) for p in primals],))
    return dict(zip(index, slopes))


def _compose_tasks(state, new_states, slopes):
    """The state after the T tasks' passes one after another (TensorFlow's order), from
    the T passes run in parallel from the same `state` (`new_states`: [T, ...] per entry).

    Exact for state updated elementwise-affinely in itself (BatchNorm's moving statistics
    s <- m s + (1 - m) b_t, counters): with slope a (`_state_slopes`) and c_t = new_t -
    a s, the sequence gives a^T s + sum_t a^(T-1-t) c_t. Integer entries (random-seed
    states) add up their increments."""
    out = []
    for i, (s, new) in enumerate(zip(state, new_states)):
        tasks = ops.shape(new)[0]
        if i in slopes:
            a = ops.cast(slopes[i], new.dtype)
            exponents = ops.reshape(
                ops.arange(tasks - 1, -1, -1, dtype=new.dtype), (tasks,) + (1,) * len(s.shape)
            )
            c = new - a * s
            out.append(a**tasks * s + ops.sum(ops.power(a, exponents) * c, axis=0))
        else:
            out.append(s + ops.cast(ops.sum(new - s, axis=0), s.dtype))
    return out


def _apply_pass(current, state_in, new_state, slopes):
    """One task's pass (run from `state_in`, giving `new_state`) applied to `current`."""
    out = []
    for i, (cur, s, new) in enumerate(zip(current, state_in, new_state)):
        if i in slopes:
            a = ops.cast(slopes[i], new.dtype)
            out.append(a * cur + (new - a * s))
        else:
            out.append(cur + (new - s))
    return out


#: How JAX runs the tasks of a meta-batch: "vmap" (`jax.vmap` over the task axis), "loop"
#: (an unrolled loop inside the jitted step), or "auto": "vmap" on GPU and TPU, "loop" on
#: CPU, where XLA turns vmapped per-task convolution kernels into a grouped convolution
#: that runs 8.7x slower than the loop (Conv-4 grad, 8 tasks x 80 images, 2 CPU cores).
#: Both give the same numbers (the same passes, every task from the same state).
JAX_TASK_MAP = "auto"


def _parallel_tasks() -> bool:
    mode = JAX_TASK_MAP
    if mode not in ("auto", "vmap", "loop"):
        raise ValueError(f"JAX_TASK_MAP must be 'auto', 'vmap' or 'loop'; got {mode!r}.")
    if mode == "auto":
        return _jax().default_backend() != "cpu"
    return mode == "vmap"


def _vmap(fn, shared):
    """`fn(theta, state, batch)` over the tasks (`JAX_TASK_MAP`): theta per task (or
    `shared`), the state the same for all, the batch per task; outputs stacked."""
    jax = _jax()
    if _parallel_tasks():
        return jax.vmap(fn, in_axes=(None if shared else 0, None, 0))

    def looped(theta, state, batch):
        tasks = ops.shape(jax.tree.leaves(batch)[0])[0]
        outputs = [
            fn(theta if shared else _task(theta, t), state, _task(batch, t)) for t in range(tasks)
        ]
        return jax.tree.map(lambda *xs: ops.stack(xs, 0), *outputs)

    return looped


# ------------------------------------------------------------------ the inner loop


def _adapt_steps(
    inner_loss_fn,
    params,
    state,
    supports,
    learning_rates,
    mode,
    order_weight,
    sharing,
    sharing_m,
    sharing_lambda,
    g_hat,
    g_hat_initialized,
    sharing_training,
    reduce,
    loss_scale,
    step_statistics,
):
    """The inner loop in the backend's layout: returns (trajectories, state, support
    losses, new g_hat, record). TensorFlow: `supports` a list per task, trajectories per
    task [theta_{t,0}, ..., theta_{t,K}]. JAX (`_vectorized`): `supports` stacked over a
    leading task axis, trajectories per step [theta, theta_1, ..., theta_K] with
    theta_k ([T, ...] per weight) for every task at once."""
    steps = len(learning_rates)

    def support_step(theta, state, batch):
        return _task_gradient(inner_loss_fn, theta, state, batch, mode, order_weight, loss_scale)

    state = list(state)
    support_losses, record, new_g_hat = [], [], []

    def step_directions(task_grads, k, stacked):
        """Delta_{t,k} for every task at step k; records (task gradients, g_k) and g_hat_k."""
        deltas, g, step_g_hat = _inner_directions(
            task_grads, k, mode, sharing, sharing_m, sharing_lambda, g_hat,
            g_hat_initialized, sharing_training, reduce, stacked=stacked,
        )  # fmt: skip
        if step_g_hat is not None:
            new_g_hat.append(step_g_hat)
        record.append((task_grads, g))
        return deltas

    if _vectorized():
        slopes = _state_slopes(inner_loss_fn, params, state, _task(supports, 0))

        def vector_step(theta, state, batch):
            loss, grad, new_state = support_step(theta, state, batch)
            return (loss, grad), new_state

        trajectory = [list(params)]
        for k in range(steps):
            if step_statistics is not None:
                state = step_statistics.enter(k, state)
            (losses, task_grads), new_states = _vmap(vector_step, k == 0)(
                trajectory[-1], state, supports
            )
            state = _compose_tasks(state, new_states, slopes)
            if step_statistics is not None:
                step_statistics.leave(k, state)
            deltas = step_directions(task_grads, k, stacked=True)
            trajectory.append(_sgd(trajectory[-1], learning_rates[k], deltas))
            support_losses.append(_mean_over_tasks(losses))
        return trajectory, state, support_losses, new_g_hat, record

    support_step = F.traced_once(support_step)
    thetas = [[list(params)] for _ in supports]
    for k in range(steps):
        task_grads, losses = [], []
        for t, batch in enumerate(supports):
            if step_statistics is not None:
                state = step_statistics.enter(k, state)
            loss, grad, state = support_step(thetas[t][-1], state, batch)
            if step_statistics is not None:
                step_statistics.leave(k, state)
            task_grads.append(grad)
            losses.append(loss)
        deltas = step_directions(task_grads, k, stacked=False)
        for t in range(len(supports)):
            thetas[t].append(_sgd(thetas[t][-1], learning_rates[k], deltas[t]))
        support_losses.append(_mean_over_tasks(losses))
    return thetas, state, support_losses, new_g_hat, record


def _inner_directions(
    task_grads, k, mode, sharing, sharing_m, sharing_lambda, g_hat, g_hat_initialized,
    sharing_training, reduce, stacked,
):  # fmt: skip
    """(Delta_{t,k} for every task, g_k or None, new g_hat_k or None) at step k."""
    if sharing is None:
        return task_grads, None, None
    if sharing_training:
        # First order: the shared direction is a constant too.
        g = sharing.shared_direction(task_grads, reduce, stacked=stacked)
        if mode == "const":
            g = [ops.stop_gradient(x) for x in g]
        s = sharing.step(
            task_grads, sharing_m[k], sharing_lambda[k], g_hat[k], g_hat_initialized, g=g,
            stacked=stacked,
        )  # fmt: skip
        return s.deltas, g, s.g_hat
    deltas = sharing.test_deltas(
        task_grads, sharing_lambda[k], g_hat[k], g_hat_initialized, stacked=stacked
    )
    return deltas, None, None


def _per_task(trajectory, tasks):
    """JAX's per-step trajectories -> per task [theta, theta_{t,1}, ..., theta_{t,K}]."""
    out = []
    for t in range(tasks):
        out.append([list(trajectory[0])] + [[x[t] for x in theta] for theta in trajectory[1:]])
    return out


def _per_step(trajectories):
    """Per-task trajectories -> JAX's per step (each step's weights stacked over tasks)."""
    steps = len(trajectories[0])
    return [
        [ops.stack(list(ws), 0) for ws in zip(*[traj[k] for traj in trajectories])]
        for k in range(steps)
    ]


def adapt(
    inner_loss_fn: Callable,
    params: Sequence,
    state: Sequence,
    support_batches: Sequence,
    learning_rates: Sequence[Sequence],
    first_order: bool = False,
    order_weight=None,
    sharing: GradientSharing | None = None,
    sharing_m=None,
    sharing_lambda=None,
    g_hat=None,
    g_hat_initialized=False,
    sharing_training: bool = True,
    reduce: Callable = F.all_reduce_sum,
    loss_scale=None,
    step_statistics: StepStatistics | None = None,
) -> AdaptResult:
    """K = len(learning_rates) inner SGD steps for every task (K = 0: every trajectory is
    [theta], no forward pass, the state unchanged; the unadapted score of meta-test).

    On JAX the tasks run in parallel (`jax.vmap` over the task axis, every pass of a step
    from the same state); the model's state after the passes is what running them one
    after another gives (exact for BatchNorm's moving statistics; see the module doc).

    Args:
      inner_loss_fn: the support loss of one task (see the module doc).
      params: theta (a list of tensors).
      state: the model's non-trainable state, threaded through the passes.
      support_batches: one support batch per task.
      learning_rates: per step k, a list over the weights of alpha (scalars or tensors of
        the weight's shape).
      first_order: when True the inner gradients are constants (stop_gradient).
      order_weight: second order only: scales the inner gradients' derivatives.
      sharing: a `GradientSharing`, or None (plain MAML).
      sharing_m: [K] tensor, the logits of the gates of g_hat.
      sharing_lambda: [K] tensor, the logits of the gates of the combination.
      g_hat: the stored [g_hat_1..g_hat_K] (each a list of tensors).
      g_hat_initialized: False at the first meta-iteration (bool or tensor).
      sharing_training: True: Algorithm 1 (g_hat updated); False: meta-test (Algorithm 2,
        the stored g_hat, no communication).
      reduce: the cross-replica sum of gradient sharing's S_k.
      loss_scale: when `inner_loss_fn` multiplies its loss by a loss scale (mixed
        precision), that scale: the inner gradients (and the reported losses) are divided
        by it.
      step_statistics: a `StepStatistics` (per-step BatchNorm statistics), updated.

    Returns:
      An `AdaptResult`.

    Example:
      >>> from tf_metaalign.algorithms import adapt
      >>> def loss_fn(params, state, batch):  # (x w - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> tasks = [(1.0, 2.0), (1.0, -2.0)]  # task 1: w = 2; task 2: w = -2
      >>> result = adapt(loss_fn, [tf.constant(0.0)], [], tasks, learning_rates=[[0.25]])
      >>> [[float(theta[0]) for theta in trajectory] for trajectory in result.trajectories]
      [[0.0, 1.0], [0.0, -1.0]]

    References:
      Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks",
      ICML 2017. https://arxiv.org/abs/1703.03400
    """
    if not support_batches:
        raise ValueError("adapt: no tasks (support_batches is empty).")
    steps = len(learning_rates)
    if steps == 0:
        # Zero inner steps (meta-test's unadapted score): theta itself for every task.
        return AdaptResult(
            [[list(params)] for _ in support_batches],
            list(state),
            [],
            [] if sharing is not None and sharing_training else None,
            [],
        )
    if sharing is not None and (sharing_m is None or sharing_lambda is None or g_hat is None):
        raise ValueError("adapt: gradient sharing needs sharing_m, sharing_lambda and g_hat.")
    tasks = len(support_batches)
    supports = _stack_tasks(support_batches) if _vectorized() else list(support_batches)
    trajectories, state, support_losses, new_g_hat, record = _adapt_steps(
        inner_loss_fn, list(params), state, supports, learning_rates,
        "const" if first_order else "diff", order_weight, sharing, sharing_m,
        sharing_lambda, g_hat, g_hat_initialized, sharing_training, reduce, loss_scale,
        step_statistics,
    )  # fmt: skip
    if _vectorized():
        trajectories = _per_task(trajectories, tasks)
    return AdaptResult(
        trajectories,
        state,
        support_losses,
        new_g_hat if sharing is not None and sharing_training else None,
        record,
    )


def _replay_steps(params, record, learning_rates, sharing, sharing_m, sharing_lambda, g_hat,
                  g_hat_initialized):  # fmt: skip
    """`replay` in the backend's layout (see `_adapt_steps`)."""
    new_g_hat = []
    stacked = _vectorized()
    if stacked:
        trajectory = [list(params)]
    else:
        trajectory = [[list(params)] for _ in range(len(record[0][0]))]
    for k, (task_grads, g) in enumerate(record):
        if sharing is None:
            deltas = task_grads
        else:
            s = sharing.step(
                task_grads, sharing_m[k], sharing_lambda[k], g_hat[k], g_hat_initialized, g=g,
                stacked=stacked,
            )  # fmt: skip
            deltas = s.deltas
            new_g_hat.append(s.g_hat)
        if stacked:
            trajectory.append(_sgd(trajectory[-1], learning_rates[k], deltas))
        else:
            for t, theta in enumerate(trajectory):
                theta.append(_sgd(theta[-1], learning_rates[k], deltas[t]))
    return trajectory, (new_g_hat if sharing is not None else None)


def replay(
    params,
    record,
    learning_rates,
    sharing=None,
    sharing_m=None,
    sharing_lambda=None,
    g_hat=None,
    g_hat_initialized=False,
):
    """The trajectories of `adapt` recomputed from its recorded (constant) gradients:
    no forward pass, only the update rule (differentiable in params, the learning rates,
    m and lambda). Returns (trajectories, new g_hat or None)."""
    trajectory, new_g_hat = _replay_steps(
        params, record, learning_rates, sharing, sharing_m, sharing_lambda, g_hat,
        g_hat_initialized,
    )  # fmt: skip
    if _vectorized():
        trajectory = _per_task(trajectory, ops.shape(record[0][0][0])[0])
    return trajectory, new_g_hat


def _query_steps(query_loss_fn, trajectories, state, queries, step_weights, step_statistics):
    """`query_objective` in the backend's layout (see `_adapt_steps`)."""
    if not _vectorized():
        per_task, finals, outputs = [], [], []
        query_loss_fn = F.traced_once(query_loss_fn)
        for traj, batch in zip(trajectories, queries):
            steps = len(traj) - 1
            terms = []
            ks = range(1, steps + 1) if step_weights is not None else [steps]
            for k in ks:
                if step_statistics is not None:
                    state = step_statistics.enter(k - 1, state)
                loss, (state, y_pred) = query_loss_fn(traj[k], state, batch)
                if step_statistics is not None:
                    step_statistics.leave(k - 1, state)
                if step_weights is not None:
                    terms.append(ops.cast(step_weights[k - 1], loss.dtype) * loss)
                else:
                    terms.append(loss)
            finals.append(loss)
            outputs.append(y_pred)
            per_task.append(backend.add_n(terms))
        objective = _mean_over_tasks(per_task)
        y_pred = keras.tree.map_structure(lambda *ys: ops.concatenate(ys, 0), *outputs)
        return objective, state, y_pred, finals
    jax = _jax()
    steps = len(trajectories) - 1
    tasks = ops.shape(jax.tree.leaves(queries)[0])[0]
    slopes = _state_slopes(query_loss_fn, trajectories[0], state, _task(queries, 0))
    passes = []
    for k in range(1, steps + 1) if step_weights is not None else [steps]:
        state_in = state
        if step_statistics is not None and k > 0:
            state_in = step_statistics.enter(k - 1, state)
        losses, (new_states, y_pred) = _vmap(query_loss_fn, k == 0)(
            trajectories[k], state_in, queries
        )
        passes.append((k, state_in, losses, new_states))
    if len(passes) == 1:
        k, state_in, losses, new_states = passes[0]
        state = _compose_tasks(state_in, new_states, slopes)
        if step_statistics is not None and k > 0:
            step_statistics.leave(k - 1, state)
        per_task = losses
        if step_weights is not None:
            per_task = ops.cast(step_weights[k - 1], losses.dtype) * losses
    else:  # TensorFlow's order: for each task, its passes k = 1..K
        for t in range(tasks):
            for k, state_in, _, new_states in passes:
                new = [s[t] for s in new_states]
                if step_statistics is not None:
                    state = step_statistics.enter(k - 1, state)
                state = _apply_pass(state, state_in, new, slopes)
                if step_statistics is not None:
                    step_statistics.leave(k - 1, state)
        per_task = backend.add_n(
            [ops.cast(step_weights[k - 1], losses.dtype) * losses for k, _, losses, _ in passes]
        )
    objective = _mean_over_tasks(per_task)
    y_pred = jax.tree.map(lambda a: ops.reshape(a, (-1,) + tuple(a.shape[2:])), y_pred)
    finals = passes[-1][2]
    return objective, state, y_pred, [finals[t] for t in range(tasks)]


def query_objective(
    query_loss_fn,
    trajectories,
    state,
    query_batches,
    step_weights=None,
    step_statistics: StepStatistics | None = None,
):
    """Mean over tasks of sum_k w_k L_t^query(theta_{t,k}) (k = 1..K; w = None: the last
    step only). Returns (objective, state, y_pred of theta_{t,K} concatenated, per-task
    losses at theta_{t,K}). With `step_statistics`, the pass at theta_{t,k} uses (and
    updates) copy k-1. On JAX the tasks run in parallel (as in `adapt`)."""
    queries = list(query_batches)
    if _vectorized():
        trajectories, queries = _per_step(trajectories), _stack_tasks(queries)
    return _query_steps(
        query_loss_fn, trajectories, list(state), queries, step_weights, step_statistics
    )


def meta_gradient(
    inner_loss_fn: Callable,
    query_loss_fn: Callable,
    params: Sequence,
    state: Sequence,
    support_batches: Sequence,
    query_batches: Sequence,
    hyper: dict,
    learning_rates_fn: Callable,
    first_order: bool = False,
    order_weight=None,
    step_weights=None,
    sharing: GradientSharing | None = None,
    g_hat=None,
    g_hat_initialized=False,
    reduce: Callable = F.all_reduce_sum,
    loss_scale=None,
    step_statistics: StepStatistics | None = None,
) -> MetaGradientResult:
    """The meta-objective and its gradient (see the module doc).

    The objective is one function of (theta, hyper) differentiated by the backend
    (`tf_metaalign.backend.value_and_grad`: a gradient tape around the inner loop's tapes
    on TensorFlow, `jax.value_and_grad` around the vmapped inner loop's `jax.grad` on
    JAX).

    Args:
      inner_loss_fn: as in `adapt`.
      query_loss_fn: the query loss of one task, `(params, state, batch) -> (loss, aux)`.
      params: theta.
      state: as in `adapt`.
      support_batches: one support batch per task.
      query_batches: one query batch per task.
      hyper: name -> tensor, the differentiated hyperparameters (e.g. learned learning
        rates, "sharing_m", "sharing_lambda"); `hyper_grads` has the same keys.
      learning_rates_fn: `hyper -> per step, a list over weights of alpha` (so the alphas
        can be functions of the differentiated tensors).
      step_weights: [K] multi-step loss weights, or None (final step only).
      loss_scale: the loss scale `inner_loss_fn` multiplies its loss by (see `adapt`);
        `query_loss_fn`'s scale is the caller's (the objective and gradients keep it).
      step_statistics: per-step BatchNorm statistics (`StepStatistics`), updated in place.
      first_order: as in `adapt`.
      order_weight: as in `adapt`.
      sharing: as in `adapt`.
      g_hat: as in `adapt`.
      g_hat_initialized: as in `adapt`.
      reduce: as in `adapt`.

    Returns:
      A `MetaGradientResult`.

    Example:
      >>> from tf_metaalign.algorithms import meta_gradient
      >>> def loss_fn(params, state, batch):  # (x w - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[0] * tf.ones([1])  # one example
      ...     return tf.reduce_mean((y_pred - y) ** 2), (state, y_pred)
      >>> tasks = [(1.0, 2.0), (1.0, -2.0)]
      >>> r = meta_gradient(
      ...     loss_fn, loss_fn, [tf.constant(0.0)], [], tasks, tasks,
      ...     hyper={"alpha": tf.constant(0.25)}, learning_rates_fn=lambda h: [[h["alpha"]]],
      ... )
      >>> float(r.loss), float(r.grads[0]), float(r.hyper_grads["alpha"])  # Meta-SGD's alpha
      (1.0, 0.0, -8.0)

    References:
      Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks",
      ICML 2017. https://arxiv.org/abs/1703.03400; Li et al., "Meta-SGD: Learning to
      Learn Quickly for Few-Shot Learning", 2017. https://arxiv.org/abs/1707.09835
    """
    params = [ops.convert_to_tensor(p) for p in params]
    if not learning_rates_fn({n: hyper[n] for n in hyper}):
        raise ValueError(
            "meta_gradient: at least one inner step (learning_rates_fn gives no step)."
        )
    if len(support_batches) != len(query_batches):
        raise ValueError(
            f"meta_gradient: {len(support_batches)} support batches but "
            f"{len(query_batches)} query batches."
        )
    names = sorted(hyper)
    hyper_values = [ops.convert_to_tensor(hyper[n]) for n in names]
    if _vectorized():
        supports, queries = _stack_tasks(support_batches), _stack_tasks(query_batches)
    else:
        supports, queries = list(support_batches), list(query_batches)
    state = list(state)

    def statistics(values):
        if step_statistics is None:
            return None
        return StepStatistics(step_statistics.indices, values)

    def sharing_args(h):
        if sharing is None:
            return (None, None, None, None, False)
        return (sharing, h["sharing_m"], h["sharing_lambda"], g_hat, g_hat_initialized)

    stats_values = None if step_statistics is None else step_statistics.values
    if first_order:
        # The inner loop off the outer gradient: constant gradients, then a replay on it.
        constant = dict(zip(names, [ops.stop_gradient(v) for v in hyper_values]))
        stats = statistics(stats_values)
        _, state, inner_losses, _, record = _adapt_steps(
            inner_loss_fn, [ops.stop_gradient(p) for p in params], state, supports,
            learning_rates_fn(constant), "const", None, *sharing_args(constant), True,
            reduce, loss_scale, stats,
        )  # fmt: skip
        stats_values = None if stats is None else stats.values

    def objective(values):
        p, h = values[: len(params)], dict(zip(names, values[len(params) :]))
        stats = statistics(stats_values)
        if first_order:
            sharing_, m, lam, g_hat_, initialized = sharing_args(h)
            trajectories, new_g_hat = _replay_steps(
                p, record, learning_rates_fn(h), sharing_, m, lam, g_hat_, initialized
            )
            inner_state, support_losses = state, inner_losses
        else:
            trajectories, inner_state, support_losses, new_g_hat, _ = _adapt_steps(
                inner_loss_fn, p, state, supports, learning_rates_fn(h), "diff",
                order_weight, *sharing_args(h), True, reduce, loss_scale, stats,
            )  # fmt: skip
            new_g_hat = new_g_hat if sharing is not None else None
        value, new_state, y_pred, finals = _query_steps(
            query_loss_fn, trajectories, inner_state, queries, step_weights, stats
        )
        aux = (new_state, y_pred, finals, new_g_hat, support_losses)
        aux += (None if stats is None else stats.values,)
        return value, aux

    loss, grads, aux = backend.value_and_grad(objective, params + hyper_values)
    new_state, y_pred, finals, new_g_hat, support_losses, new_stats = aux
    if step_statistics is not None:
        step_statistics.values = [list(v) for v in new_stats]
    n = len(params)
    new_g_hat = (
        None if new_g_hat is None else [[ops.stop_gradient(x) for x in step] for step in new_g_hat]
    )
    return MetaGradientResult(
        loss=loss,
        grads=list(grads[:n]),
        hyper_grads=dict(zip(names, grads[n:])),
        state=list(new_state),
        y_pred=y_pred,
        g_hat=new_g_hat,
        support_losses=[ops.stop_gradient(x) for x in support_losses],
        query_losses=[ops.stop_gradient(x) for x in finals],
    )


def adapt_and_evaluate(
    inner_loss_fn,
    query_loss_fn,
    params,
    state,
    support_batches,
    query_batches,
    learning_rates,
    **adapt_kwargs,
):
    """Meta-test: `adapt` (no outer tape; first order, since nothing is differentiated)
    then the query losses at theta_{t,K}.

    Args:
      inner_loss_fn: as in `adapt`.
      query_loss_fn: as in `meta_gradient`.
      params: theta.
      state: the model's state.
      support_batches: one support batch per task.
      query_batches: one query batch per task.
      learning_rates: as in `adapt`.
      **adapt_kwargs: other `adapt` arguments.

    Returns:
      `(mean query loss, state, y_pred concatenated over tasks, per-task losses,
      AdaptResult)`.

    Example:
      >>> from tf_metaalign.algorithms import adapt_and_evaluate
      >>> def loss_fn(params, state, batch):
      ...     x, y = batch
      ...     y_pred = x * params[0] * tf.ones([1])
      ...     return tf.reduce_mean((y_pred - y) ** 2), (state, y_pred)
      >>> tasks = [(1.0, 2.0), (1.0, -2.0)]
      >>> loss, _, y_pred, losses, _ = adapt_and_evaluate(
      ...     loss_fn, loss_fn, [tf.constant(0.0)], [], tasks, tasks, [[0.25], [0.25]]
      ... )
      >>> float(loss), y_pred.numpy().tolist()  # two steps: w = 1.5 and -1.5
      (0.25, [1.5, -1.5])
    """
    if not _vectorized():
        result = adapt(
            inner_loss_fn,
            params,
            state,
            support_batches,
            learning_rates,
            first_order=True,
            **adapt_kwargs,
        )
        objective, state, y_pred, finals = query_objective(
            query_loss_fn,
            result.trajectories,
            result.state,
            query_batches,
            step_statistics=adapt_kwargs.get("step_statistics"),
        )
        return objective, state, y_pred, finals, result
    # JAX: the tasks stay stacked from the support passes to the query passes.
    if not support_batches:
        raise ValueError("adapt: no tasks (support_batches is empty).")
    kwargs = dict(
        sharing=None, sharing_m=None, sharing_lambda=None, g_hat=None,
        g_hat_initialized=False, sharing_training=True, reduce=F.all_reduce_sum,
        loss_scale=None, step_statistics=None,
    )  # fmt: skip
    unknown = set(adapt_kwargs) - set(kwargs) - {"order_weight"}
    if unknown:
        raise TypeError(f"adapt_and_evaluate: unexpected arguments {sorted(unknown)}.")
    kwargs.update({k: v for k, v in adapt_kwargs.items() if k != "order_weight"})
    if (
        kwargs["sharing"] is not None
        and learning_rates
        and (
            kwargs["sharing_m"] is None
            or kwargs["sharing_lambda"] is None
            or kwargs["g_hat"] is None
        )
    ):
        raise ValueError("adapt: gradient sharing needs sharing_m, sharing_lambda and g_hat.")
    tasks = len(support_batches)
    supports, queries = _stack_tasks(support_batches), _stack_tasks(query_batches)
    if learning_rates:
        trajectory, state, support_losses, new_g_hat, record = _adapt_steps(
            inner_loss_fn, list(params), list(state), supports, learning_rates, "const", None,
            kwargs["sharing"], kwargs["sharing_m"], kwargs["sharing_lambda"], kwargs["g_hat"],
            kwargs["g_hat_initialized"], kwargs["sharing_training"], kwargs["reduce"],
            kwargs["loss_scale"], kwargs["step_statistics"],
        )  # fmt: skip
    else:
        trajectory, state, support_losses, new_g_hat, record = [list(params)], state, [], [], []
    objective, state, y_pred, finals = _query_steps(
        query_loss_fn, trajectory, list(state), queries, None, kwargs["step_statistics"]
    )
    sharing_out = (
        new_g_hat if kwargs["sharing"] is not None and kwargs["sharing_training"] else None
    )
    result = AdaptResult(_per_task(trajectory, tasks), state, support_losses, sharing_out, record)
    return objective, state, y_pred, finals, result
