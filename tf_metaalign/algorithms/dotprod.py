"""Meta DotProd: gradient-dot-product maximisation as a regulariser.

Reference: Kedia, Chinthakindi, Ryu, "Beyond Reptile: Meta-Learned Dot-Product
Maximization between Gradients for Improved Single-Task Regularization", Algorithm 1.

For a pair of batches b1, b2 at weights theta::

    G1   = grad L(theta; b1)
    G2   = grad L(theta; b2)
    G21  = grad L(theta - alpha * G1; b2)
    G1G2 = (G21 - G2) / alpha            # ~= -H2 G1 (H2: Hessian of L(.; b2))
    G    = G1 + G2 + weight * G1G2      # alignment="dot"; the default "capped" bounds
                                        # the last term (see "Alignment" below)

Since d(G1.G2)/dtheta = H1 G2 + H2 G1, a descent step along G raises G1.G2 (the
H1 G2 half is dropped, as in the paper). With `method="exact"` the finite difference is
replaced by the exact Hessian-vector product `-H2 G1` (reverse-over-reverse).

The perturbation `alpha`
------------------------
`alpha` is the size of the finite-difference step along -G1. The paper uses 1e-7, which
in float32 is usually below the resolution of the weights (`theta - 1e-7*G1 == theta`
for most entries), so G21 - G2 is rounding noise. `alpha="auto"` (the default) uses the
standard forward-difference step for a directional derivative::

    alpha = sqrt(eps) * (1 + ||theta||) / ||G1||

where eps is the machine epsilon of the *compute* dtype (float32: 1.2e-7, so the step
moves theta by about 3.5e-4 (1 + ||theta||) in norm; bfloat16/float16 compute under
mixed precision use their own, larger eps). This balances truncation error (O(alpha))
against rounding error (O(eps/alpha)). When G1 = 0 the regulariser is exactly 0.

Alignment: the paper's objective and the bounded default
--------------------------------------------------------
Why Algorithm 1 can run away. With R = G1G2 ~= -H2 G1 the update direction is
G = G1 + G2 - weight * H2 G1 ~= (2I - weight*H2) g for G1 ~= G2 ~= g. Along an eigenvector
of H2 whose eigenvalue lambda exceeds 2/weight the step *ascends* the loss, and ascending
along a sharp direction sharpens the net further: G1.G2 is unbounded, since scaling the
logits (or any weight the output is homogeneous in) scales both gradients. Measured on a
from-scratch convnet (digits at 28x28, Adam 1e-3, weight 0.1): loss 2.1 -> 1.4 -> 29 ->
4.7e4 over 8 epochs, G1.G2 1.3 -> 1.8e8, accuracy 0.10 (docs/finetune.md, "Stability").

`alignment="dot"` is the paper's Algorithm 1, exactly as above:

    G = G1 + G2 + weight * R

`alignment="capped"` (the default) keeps R's direction and bounds its size relative to the
loss gradient of the pair:

    s = min(1, cap * ||G1 + G2|| / (weight * ||R||))
    G = G1 + G2 + s * weight * R

(global norms: the same s on every replica). Where `weight*||R|| <= cap*||G1+G2||` this is
the paper's step, bit for bit. Otherwise the regulariser is shrunk to `cap` times the
loss gradient, and then, with D = G1 + G2,

    D . G >= (1 - cap) ||D||^2 > 0     and     ||G|| <= (1 + cap) ||D||

so for `cap < 1` every step is a descent direction of L(b1) + L(b2) (to first order, for
SGD; Adam's positive diagonal preconditioner keeps the angle to D below asin(cap)) and
never more than (1 + cap) times the plain step: the H2-ascent that makes the paper's step
run away cannot dominate. It differs from the paper only on the steps where the bound
binds; `reg_ratio` (weight*||R|| / ||G1+G2||, before the cap) is logged to show how often.
Under a strategy, ||R|| needs the global R: one more all-reduce of a gradient-sized list
per regularised step (none with one replica).

Distribution
------------
Every gradient here is in Keras's per-replica units (the replica's loss divided by the
replica count), so the optimizer's cross-replica *sum* gives the global mean. The
perturbation must use the *global* G1, otherwise two replicas would regularise with a
different quantity than one: G1 (and G2, for the diagnostics) are all-reduced once per
step. The gradient returned is per-replica and linear in G1, G2, G21, so the
optimizer's sum yields exactly the single-replica `G` for the same global pair.

Backends
--------
Written once in `keras.ops`; autodiff (`F.value_and_grad`, `F.value_grad_and_hvp`) and the
all-reduces go through `tf_metaalign.functional`, so the same function runs on TensorFlow
(tapes, replica context) and on JAX (`jax.grad` / `jvp` over `stateless_call`). On JAX
`keras.distribution` runs one SPMD program over the global batch: one replica, the
all-reduces are identities. A tensor `apply_regularizer` selects with `ops.cond`
(`tf.cond` / `jax.lax.cond`; its branches assign nothing).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from keras import ops

from tf_metaalign import functional as F

METHODS = ("finite_difference", "exact")
ALIGNMENTS = ("capped", "dot")


@dataclasses.dataclass
class DotProdResult:
    """Everything one DotProd step computes (tensors; per-replica units, see module doc).

    Attributes:
      gradient: G = G1 + G2 + s * weight * G1G2 (s = 1 for alignment="dot", the cap's
        factor for "capped"; G1 + G2 when the regulariser is off), in the loss-scaled,
        per-replica units of the loss function.
      grad_1, grad_2: G1, G2 (same units).
      regularizer: G1G2 ~= -H2 G1 (same units; zeros when skipped), before the cap.
      loss_1, loss_2: the loss function's values on b1, b2 (same units).
      aux_1, aux_2: the loss function's aux outputs on b1, b2 (for a Keras model:
        `(new_state, y_pred)`).
      grad_dot: global G1 . G2, unscaled (true mean gradients).
      grad_cosine: global cos(G1, G2).
      alpha: the perturbation used (a scalar tensor).
      reg_ratio: global weight * ||G1G2|| / ||G1 + G2|| before the cap (0 when skipped).
      reg_scale: the factor s applied to weight * G1G2 (1 for alignment="dot").

    Example:
      >>> from tf_metaalign.algorithms import DotProdResult
      >>> import dataclasses
      >>> [field.name for field in dataclasses.fields(DotProdResult)][:4]
      ['gradient', 'grad_1', 'grad_2', 'regularizer']
    """

    gradient: list
    grad_1: list
    grad_2: list
    regularizer: list
    loss_1: Any
    loss_2: Any
    aux_1: Any
    aux_2: Any
    grad_dot: Any
    grad_cosine: Any
    alpha: Any
    reg_ratio: Any = None
    reg_scale: Any = None


def validate_options(
    weight, alpha, every=1, method="finite_difference", alignment="capped", cap=0.5
):
    """Check DotProd options; raise ValueError naming the offending argument."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise ValueError(f"`weight` must be a finite number >= 0; got {weight!r}.")
    if not math.isfinite(float(weight)) or weight < 0:
        raise ValueError(f"`weight` must be a finite number >= 0; got {weight!r}.")
    if isinstance(alpha, str):
        if alpha != "auto":
            raise ValueError(f'`alpha` must be "auto" or a finite number > 0; got {alpha!r}.')
    elif isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise ValueError(f'`alpha` must be "auto" or a finite number > 0; got {alpha!r}.')
    elif not math.isfinite(float(alpha)) or alpha <= 0:
        raise ValueError(f'`alpha` must be "auto" or a finite number > 0; got {alpha!r}.')
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"`every` must be an integer >= 1; got {every!r}.")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}; got {method!r}.")
    if alignment not in ALIGNMENTS:
        raise ValueError(
            f'`alignment` must be one of {ALIGNMENTS} ("dot" is the paper\'s Algorithm 1); '
            f"got {alignment!r}."
        )
    if (
        isinstance(cap, bool)
        or not isinstance(cap, (int, float, np.floating, np.integer))
        or not math.isfinite(float(cap))
        or cap <= 0
    ):
        raise ValueError(
            f"`cap` must be a finite number > 0 (< 1 keeps every step a descent direction); "
            f"got {cap!r}."
        )


def auto_alpha(params, direction, compute_dtype=None):
    """The `alpha="auto"` rule: sqrt(eps) * (1 + ||params||) / ||direction||.

    `eps` is the machine epsilon of `compute_dtype` (default: the params' dtype), but
    never smaller than that of the params' dtype. Returns 1.0 when ||direction|| == 0
    (any alpha then gives a zero regulariser).

    Args:
      params: the weights (a list of tensors).
      direction: the perturbation's direction (G1), one tensor per weight.
      compute_dtype: the dtype the model computes in (None: the params').

    Returns:
      A scalar tensor.

    Example:
      >>> from tf_metaalign.algorithms import auto_alpha
      >>> params, direction = ops.convert_to_tensor([3.0, 4.0]), ops.convert_to_tensor([0.0, 2.0])
      >>> alpha = auto_alpha([params], [direction])
      >>> round(float(alpha) / float(np.sqrt(np.finfo("float32").eps)), 6)  # (1 + 5) / 2
      3.0
    """
    acc = F.accumulation_dtype(params)
    eps = F.machine_epsilon(params[0].dtype)
    if compute_dtype is not None:
        eps = max(eps, F.machine_epsilon(compute_dtype))
    p_norm = ops.cast(F.global_norm(params), acc)
    d_norm = ops.cast(F.global_norm(direction), acc)
    safe = ops.where(d_norm > 0, d_norm, ops.ones_like(d_norm))
    return ops.where(d_norm > 0, math.sqrt(eps) * (1.0 + p_norm) / safe, ops.ones_like(d_norm))


def dotprod_gradient(
    loss_fn,
    params,
    state,
    batch_1,
    batch_2,
    *,
    weight: float = 0.1,
    alpha="auto",
    method: str = "finite_difference",
    alignment: str = "capped",
    cap: float = 0.5,
    apply_regularizer=True,
    gradient_scale=1.0,
    compute_dtype=None,
    all_reduce: bool = True,
) -> DotProdResult:
    """One Meta DotProd step (Algorithm 1): the combined gradient and diagnostics.

    Args:
      loss_fn: `loss_fn(params, state, batch) -> (loss, (new_state, outputs))`; pure
        (see `tf_metaalign.functional.make_loss_fn`). If your loss has no state, accept
        and return it unchanged (e.g. `None`).
      params: list of weight tensors (not variables) at which to evaluate.
      state: the loss function's state. b1 is evaluated from `state`, b2 from the state
        b1 returned, and G21 from that same state, so G2 and G21 see the same dropout
        masks. `aux_2[0]` is the state to keep.
      batch_1: b1, the first batch of the pair.
      batch_2: b2, the second.
      weight: the regulariser weight (the paper's LR_G1G2, default 0.1).
      alpha: the finite-difference step; "auto" (see module doc) or a float used as
        given (1e-7, the paper's value, is unsafe in float32).
      method: "finite_difference" (Algorithm 1) or "exact" (Hessian-vector product).
      alignment: "capped" (default: the regulariser is shrunk to at most
        `cap * ||G1 + G2||`, see the module doc) or "dot" (the paper's G, uncapped).
      cap: the bound of "capped" (< 1: every step is a descent direction of the pair's
        loss); ignored by "dot".
      apply_regularizer: python bool or bool tensor; when False, G = G1 + G2 and the
        G21 pass is skipped (`ops.cond`: tf.cond / jax.lax.cond).
      gradient_scale: the factor the loss function multiplied the loss by (a mixed
        precision loss scale); used to unscale G1 for the perturbation and diagnostics.
      compute_dtype: the dtype the model computes in (for the "auto" eps).
      all_reduce: all-reduce G1/G2 across replicas for the perturbation and the
        diagnostics (required for replica-count invariance; no-op with one replica).

    Returns:
      A `DotProdResult`.

    In a custom loop under a strategy::

        loss_fn = tf_metaalign.functional.make_loss_fn(model, keras.losses.MeanSquaredError())

        @tf.function
        def train_step(b1, b2):
            def step(b1, b2):
                params = tf_metaalign.functional.current_params(model)
                state = tf_metaalign.functional.current_state(model)
                r = dotprod_gradient(loss_fn, params, state, b1, b2, weight=0.1)
                tf_metaalign.functional.assign_state(model, r.aux_2[0])
                optimizer.apply_gradients(zip(r.gradient, model.trainable_variables))
                return r.grad_dot
            return strategy.run(step, args=(b1, b2))

    Example:
      >>> from tf_metaalign.algorithms import dotprod_gradient
      >>> def loss_fn(params, state, batch):  # (x w - y)^2
      ...     x, y = batch
      ...     y_pred = x * params[0]
      ...     return (y_pred - y) ** 2, (state, y_pred)
      >>> r = dotprod_gradient(
      ...     loss_fn, [ops.convert_to_tensor(0.0)], [], (1.0, 2.0), (2.0, 4.0),
      ...     weight=0.1, method="exact", alignment="dot",
      ... )
      >>> float(r.grad_1[0]), float(r.grad_2[0]), float(r.regularizer[0])  # -H2 G1 = -8 * -4
      (-4.0, -16.0, 32.0)
      >>> round(float(r.gradient[0]), 4), float(r.grad_dot)  # G1 + G2 + 0.1 * 32
      (-16.8, 64.0)

    References:
      Kedia, Chinthakindi & Ryu, "Beyond Reptile: Meta-Learned Dot-Product Maximization
      between Gradients for Improved Single-Task Regularization", Findings of EMNLP 2021
      (Algorithm 1).
    """
    validate_options(weight, alpha, 1, method, alignment, cap)
    params = list(params)

    loss_1, g1, aux_1 = F.value_and_grad(loss_fn, params, state, batch_1)
    state_1 = aux_1[0] if isinstance(aux_1, (tuple, list)) else None
    acc = F.accumulation_dtype(params)

    def perturbation_direction(g1_global):
        # The true (unscaled) global mean gradient G1, in each parameter's dtype.
        return F.unscale_gradients(g1_global, gradient_scale, [p.dtype for p in params])

    if method == "finite_difference":
        loss_2, g2, aux_2 = F.value_and_grad(loss_fn, params, state_1, batch_2)
        g1_global, g2_global = F.all_reduce_sum((g1, g2)) if all_reduce else (g1, g2)
        direction = perturbation_direction(g1_global)
        alpha_t = (
            auto_alpha(params, direction, compute_dtype)
            if alpha == "auto"
            else F.scalar(float(alpha), acc)
        )

        def regularizer():
            perturbed = F.offset_params(params, direction, -alpha_t)
            _, g21, _ = F.value_and_grad(loss_fn, perturbed, state_1, batch_2)
            inv_alpha = 1.0 / alpha_t
            return [
                ops.cast((ops.cast(a, acc) - ops.cast(b, acc)) * inv_alpha, b.dtype)
                for a, b in zip(g21, g2)
            ]

        if isinstance(apply_regularizer, bool):
            reg = regularizer() if apply_regularizer else F.zeros_like(g2)
        else:
            # Pure branches (no assignment): `ops.cond` is tf.cond / jax.lax.cond.
            reg = ops.cond(apply_regularizer, regularizer, lambda: F.zeros_like(g2))

    else:  # exact Hessian-vector product, reverse over reverse
        g1_global = F.all_reduce_sum(g1) if all_reduce else g1
        direction = [ops.stop_gradient(d) for d in perturbation_direction(g1_global)]
        alpha_t = F.scalar(0.0, acc)

        def g2_and_hvp():
            # d/dtheta (G2 . v) = H2 v with v = G1 held constant; the regulariser is -H2 G1.
            l2, g2_, a2, hv = F.value_grad_and_hvp(loss_fn, params, state_1, batch_2, direction)
            return l2, g2_, a2, [-h for h in hv]

        def g2_only():
            l2, g2_, a2 = F.value_and_grad(loss_fn, params, state_1, batch_2)
            return l2, g2_, a2, F.zeros_like(g2_)

        if isinstance(apply_regularizer, bool):
            loss_2, g2, aux_2, reg = g2_and_hvp() if apply_regularizer else g2_only()
        else:
            loss_2, g2, aux_2, reg = ops.cond(apply_regularizer, g2_and_hvp, g2_only)
        # A second all-reduce (G2 exists only after the branch); diagnostics only.
        g2_global = F.all_reduce_sum(g2) if all_reduce else g2

    unscaled_g1 = F.unscale_gradients(g1_global, gradient_scale, [acc] * len(params))
    unscaled_g2 = F.unscale_gradients(g2_global, gradient_scale, [acc] * len(params))
    weight_t = F.scalar(float(weight), acc)
    if apply_regularizer is False or weight == 0:
        reg_ratio, reg_scale = F.scalar(0.0, acc), F.scalar(1.0, acc)
    else:
        # The global R (one all-reduce, outside any cond; zeros on skipped pairs).
        reg_global = F.all_reduce_sum(reg) if all_reduce else reg
        unscale = 1.0 / F.scalar(gradient_scale, acc)  # a python scale exact in acc
        reg_norm = weight_t * ops.cast(F.global_norm(reg_global), acc) * unscale
        pair_norm = ops.cast(F.global_norm(F.add(unscaled_g1, unscaled_g2)), acc)
        reg_ratio = ops.divide_no_nan(reg_norm, pair_norm)
        if alignment == "capped":
            cap_t = F.scalar(float(cap), acc)
            reg_scale = ops.where(
                reg_norm > cap_t * pair_norm,
                ops.divide_no_nan(cap_t * pair_norm, reg_norm),
                F.scalar(1.0, acc),
            )
        else:
            reg_scale = F.scalar(1.0, acc)
    factor = weight_t * reg_scale
    gradient = [a + b + ops.cast(factor, r.dtype) * r for a, b, r in zip(g1, g2, reg)]
    return DotProdResult(
        gradient=gradient,
        grad_1=g1,
        grad_2=g2,
        regularizer=reg,
        loss_1=loss_1,
        loss_2=loss_2,
        aux_1=aux_1,
        aux_2=aux_2,
        grad_dot=F.dot(unscaled_g1, unscaled_g2),
        grad_cosine=F.cosine(unscaled_g1, unscaled_g2),
        alpha=alpha_t,
        reg_ratio=reg_ratio,
        reg_scale=reg_scale,
    )
