"""Reptile, FOMAML and Sequential Reptile as pure pieces on tensors.

Every function takes weights as lists of tensors (one per trainable variable, the order
of `model.trainable_variables`), a `loss_fn(params, state, batch) -> (loss, (new_state,
y_pred))` (e.g. `MetaTrainer.loss_fn()` or `functional.make_loss_fn`) and batches
`(x, y)` / `(x, y, sample_weight)`; nothing is assigned.

* `inner_loop`: k steps of an inner optimizer's pure rule (`optimizer.apply_on_tensors`)
  from `params`, one batch per step. First order: each step's gradient is taken at the
  current tensors and nothing is kept on an outer tape (the trajectory is a constant for
  whoever differentiates the result, as in Reptile and FOMAML).
* `reptile_gradient(phi, theta_k)`: the Reptile pseudo-gradient phi - theta_k; an outer
  SGD step with rate eps on it is phi <- phi + eps (theta_k - phi).
* `fomaml_gradient`: the gradient of the loss on the query batch at theta_k.
* `outer_update(phi, theta, eta)`: phi + eta (theta - phi) (Sequential Reptile's outer step).

Units under a distribution strategy: `inner_loop` all-reduces (sums) each step's
per-replica gradients with `reduce` (default `functional.all_reduce_sum`), so the inner
optimizer sees the global-batch gradient (Keras's per-replica loss units sum to the
global mean) and theta_k is identical on every replica.

Backends: written in `keras.ops`, with the gradients from `functional.value_and_grad`
(a tape on TensorFlow, `jax.value_and_grad` on JAX). First order on both: every inner
gradient and every inner iterate passes `ops.stop_gradient`, so an outer `jax.grad` (or
tape) sees theta_k as a constant. On JAX `all_reduce_sum` is the identity (the step sees
the global batch under `keras.distribution`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from keras import ops

from tf_metaalign import functional as F

Tensor = object  # a backend tensor (tf.Tensor, jax.Array)


class InnerLoopResult(NamedTuple):
    """What `inner_loop` returns.

    Attributes:
      params: theta_k (a list of tensors).
      state: the model's non-trainable state after the k forward passes (Dropout seeds,
        BatchNorm statistics).
      optimizer_state: the inner optimizer's `OptimizerState` after k steps.
      losses: the k inner losses, each at the weights BEFORE its step, as `loss_fn`
        returns them (scaled by `loss_scale`, per-replica units).
      y_pred: the outputs of the last inner forward pass.

    Example:
      >>> from tf_metaalign.algorithms import InnerLoopResult
      >>> InnerLoopResult._fields
      ('params', 'state', 'optimizer_state', 'losses', 'y_pred')
    """

    params: list
    state: list
    optimizer_state: object
    losses: list
    y_pred: object


def inner_loop(
    loss_fn: Callable,
    params: Sequence[Tensor],
    state: Sequence[Tensor],
    batches: Sequence,
    optimizer,
    variables,
    optimizer_state=None,
    loss_scale=None,
    reduce: Callable = F.all_reduce_sum,
) -> InnerLoopResult:
    """k = len(batches) inner steps on tensors, first order.

    Args:
      loss_fn: `loss_fn(params, state, batch) -> (loss, (new_state, y_pred))`.
      params: the starting weights (phi).
      state: the model's non-trainable state, threaded through the k passes.
      batches: k batches, one per inner step.
      optimizer: a `tf_metaalign.optimizers.BaseOptimizer` (its `apply_on_tensors`).
      variables: the Keras variables the params are values of (options, constraints).
      optimizer_state: the inner optimizer's state to start from; default
        `optimizer.initial_state(variables)` (a fresh inner optimizer: zero slots, step 1
        first).
      loss_scale: when `loss_fn` multiplies its loss by a loss scale (mixed precision),
        that scale: the gradients are divided by it before the inner step.
      reduce: sums per-replica gradients over replicas (identity for one replica).

    Returns:
      An `InnerLoopResult`.

    Example:
      >>> from tf_metaalign.algorithms import inner_loop
      >>> from tf_metaalign.optimizers import SGD
      >>> def loss_fn(params, state, batch):  # mean squared error of y = x w
      ...     x, y = batch
      ...     y_pred = x @ params[0]
      ...     return ops.mean((y_pred - y) ** 2), (state, y_pred)
      >>> w = keras.Variable(np.zeros([1, 1], "float32"))
      >>> batch = (np.array([[1.0], [2.0]], "float32"), np.array([[2.0], [4.0]], "float32"))
      >>> result = inner_loop(loss_fn, [w.value], [], [batch] * 3, SGD(0.1), [w])
      >>> [round(float(loss), 3) for loss in result.losses]  # each step halves w's error
      [10.0, 2.5, 0.625]
      >>> round(float(result.params[0][0, 0]), 3)  # theta_3, w unchanged
      1.75
    """
    if not batches:
        raise ValueError("inner_loop: `batches` is empty (at least one inner step is needed).")
    theta = [ops.convert_to_tensor(p) for p in params]
    state = list(state)
    if optimizer_state is None:
        optimizer_state = optimizer.initial_state(variables)
    losses, y_pred = [], None
    for batch in batches:
        loss, grads, (state, y_pred) = F.value_and_grad(loss_fn, theta, state, batch)
        grads = reduce(grads)
        if loss_scale is not None:
            grads = [g / ops.cast(loss_scale, g.dtype) for g in grads]
        # First order: the trajectory is a constant for any outer tape / jax.grad.
        grads = [ops.stop_gradient(g) for g in grads]
        theta, optimizer_state = optimizer.apply_on_tensors(
            grads, theta, optimizer_state, variables
        )
        theta = [ops.stop_gradient(t) for t in theta]
        losses.append(loss)
    return InnerLoopResult(theta, state, optimizer_state, losses, y_pred)


def reptile_gradient(phi: Sequence[Tensor], theta: Sequence[Tensor]) -> list:
    """phi - theta_k: an outer SGD(eps) step on it is phi + eps (theta_k - phi).

    Args:
      phi: the weights before the inner loop.
      theta: theta_k, the weights after it.

    Returns:
      A list of tensors, one per weight: the pseudo-gradient to hand to the outer
      optimizer.

    Example:
      >>> from tf_metaalign.algorithms import reptile_gradient
      >>> delta = reptile_gradient([np.array([1.0, 1.0], "float32")], [np.array([0.5, 2.0])])
      >>> ops.convert_to_numpy(delta[0])
      array([ 0.5, -1. ], dtype=float32)

    References:
      Nichol et al., "On First-Order Meta-Learning Algorithms", 2018.
      https://arxiv.org/abs/1803.02999
    """
    out = []
    for p, t in zip(phi, theta):
        p = ops.convert_to_tensor(p)
        out.append(p - ops.cast(t, p.dtype))
    return out


def mean_reptile_gradient(phi: Sequence[Tensor], thetas: Sequence[Sequence[Tensor]]) -> list:
    """Multi-task Reptile: phi - mean_t theta_t (the mean of the T per-task pseudo-gradients).

    Args:
      phi: the weights before the inner loops.
      thetas: per task, its theta_k (a list of tensors).

    Returns:
      A list of tensors, one per weight.

    Example:
      >>> from tf_metaalign.algorithms import mean_reptile_gradient
      >>> phi = [ops.convert_to_tensor(1.0)]
      >>> float(mean_reptile_gradient(phi, [[np.float32(0.0)], [np.float32(3.0)]])[0])
      -0.5

    References:
      Nichol et al., "On First-Order Meta-Learning Algorithms", 2018.
      https://arxiv.org/abs/1803.02999
    """
    if not thetas:
        raise ValueError("mean_reptile_gradient: no task end points given.")
    n = len(thetas)
    out = []
    for i, p in enumerate(phi):
        deltas = [reptile_gradient([p], [th[i]])[0] for th in thetas]
        total = deltas[0]
        for d in deltas[1:]:  # summed in order, as tf.add_n
            total = total + d
        out.append(total / ops.cast(n, total.dtype))
    return out


def fomaml_gradient(loss_fn: Callable, theta: Sequence[Tensor], state, query_batch):
    """First-order MAML: `(loss, grads, (new_state, y_pred))` of the query loss at theta_k.

    Per-replica gradients in `loss_fn`'s units (not all-reduced): what
    `optimizer.apply_gradients` takes.

    Args:
      loss_fn: `loss_fn(params, state, batch) -> (loss, (new_state, y_pred))`.
      theta: theta_k, the adapted weights.
      state: the model's non-trainable state.
      query_batch: the batch of the outer (query) loss.

    Example:
      >>> from tf_metaalign.algorithms import fomaml_gradient
      >>> def loss_fn(params, state, batch):
      ...     x, y = batch
      ...     y_pred = x * params[0]
      ...     return ops.mean((y_pred - y) ** 2), (state, y_pred)
      >>> loss, grads, _ = fomaml_gradient(loss_fn, [ops.convert_to_tensor(1.0)], [], (2.0, 6.0))
      >>> float(loss), float(grads[0])  # (2 - 6)^2, 2 (2 - 6) 2
      (16.0, -16.0)

    References:
      Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks",
      ICML 2017 (Sec. 5.2, first-order approximation). https://arxiv.org/abs/1703.03400
    """
    return F.value_and_grad(loss_fn, theta, state, query_batch)


def outer_update(phi: Sequence[Tensor], theta: Sequence[Tensor], eta) -> list:
    """Sequential Reptile's outer step phi + eta (theta - phi) (eta = 1: phi <- theta).

    Args:
      phi: the weights before the inner loop.
      theta: the weights after it.
      eta: the outer step size (a python number or a scalar tensor).

    Returns:
      The new phi, a list of tensors.

    Example:
      >>> from tf_metaalign.algorithms import outer_update
      >>> phi, theta = [np.array([0.0, 2.0], "float32")], [np.array([1.0, 0.0], "float32")]
      >>> ops.convert_to_numpy(outer_update(phi, theta, eta=0.25)[0])
      array([0.25, 1.5 ], dtype=float32)

    References:
      Lee et al., "Sequential Reptile: Inter-Task Gradient Alignment for Multilingual
      Learning", ICLR 2022. https://arxiv.org/abs/2110.02600
    """
    out = []
    for p, t in zip(phi, theta):
        p = ops.convert_to_tensor(p)
        # F.scalar: a python eta exact in p's dtype (a cast would round it via float32).
        out.append(p + F.scalar(eta, p.dtype) * (ops.cast(t, p.dtype) - p))
    return out


def validate_steps(name, value):
    """An integer >= 1, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
    return int(value)


def validate_rate(name, value):
    """A finite number > 0, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number > 0; got {value!r}.")
    value = float(value)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"`{name}` must be a finite number > 0; got {value!r}.")
    return value
