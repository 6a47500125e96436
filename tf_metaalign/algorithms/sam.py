"""Sharpness-aware minimisation: SAM, ASAM and GSAM as pure functions.

SAM (Foret et al., ICLR 2021) minimises max_{||e|| <= rho} L(w + e) with the first-order
solution of the inner maximisation::

    g    = grad L(w; b)                       # the clean gradient
    e(w) = rho * g / ||g||                    # SAM
    e(w) = rho * T^2 g / ||T g||,             # ASAM (Kwon et al., ICML 2021),
           T = |w| + eta (element-wise) on weights, 1 on biases
    g_p  = grad L(w + e(w); b)                # the gradient at the perturbed weights
    update: the optimizer applies g_p at w    # (not at w + e(w))

GSAM (Zhuang et al., ICLR 2022) also minimises the surrogate gap h = L(w + e) - L(w):
it decomposes the clean gradient g into its parts parallel and orthogonal to g_p and
descends g_p while ascending along the orthogonal part::

    g_perp = g - (g . g_p / ||g_p||^2) g_p
    update direction = g_p - alpha * g_perp
    rho_t  = rho_min + (rho_max - rho_min) * (lr_t - lr_min) / (lr_max - lr_min)

(`gsam_rho`: rho follows the learning-rate schedule). `alpha = 0` and a constant rho are
SAM exactly.

Reference semantics, and where this module differs
---------------------------------------------------
* SAM matches google-research/sam (`sam_jax/training_utils/flax_training.py`,
  `get_sam_gradient`): both passes on the same batch with the same randomness (the same
  dropout masks: both are evaluated from the same `state`, as flax's same `prng_key`),
  the model state (BatchNorm moving statistics, the dropout seed) kept from the first
  pass only (the perturbed pass's is discarded: optax's `opaque_mode` reason, GSAM's
  `disable_running_stats`). davda54/sam's closure draws new dropout masks for the second
  pass; here the masks are the clean pass's, so that g_p differs from g only by the
  perturbation.
* The zero-gradient case: google-research/sam divides by ||g|| (NaN at 0), davda54/sam
  by ||g|| + 1e-12 (a perturbation of size rho/1e-12 * ||g|| for tiny gradients). Here
  e = 0 exactly where ||g|| = 0 (the step is then the plain gradient), and e = rho g/||g||
  otherwise, with no epsilon: the step size is rho for every non-zero gradient. A
  non-finite g gives a non-finite e (so a LossScaleOptimizer skips the step).
* ASAM matches SamsungLabs/ASAM (`asam.py`): T = |w| + eta on parameters whose PyTorch
  name contains "weight", 1 on the others (the biases); `adaptive_mask` says which
  parameters are scaled (the trainers: every variable but those named "bias" / "beta").
  davda54/sam's `adaptive=True` is eta = 0 with every parameter scaled; big_vision's GSAM
  `adaptive_perturbation` (rho |w| g / ||g||) is a different rule and is not offered.
* GSAM matches big_vision (`trainers/proj/gsam/gsam.py`, `minimize_fp=True`, the paper's
  Algorithm 1) and juntang-zhuang/GSAM: same decomposition, same rho schedule. Their
  `eps` terms are left out as above (g_perp = 0 where g_p = 0).
* Distribution. Every gradient here is in Keras's per-replica units (the optimizer sums
  over replicas). By default (`all_reduce=True`) the perturbation uses the *global*
  gradient (all-reduced), so R replicas take exactly the step of one replica on the
  global batch (google-research/sam's `sync_perturbations=True`). `all_reduce=False` is
  m-sharpness (the SAM paper's per-accelerator perturbation, google-research/sam's
  default, big_vision's per-worker GSAM): each replica perturbs along its own shard's
  gradient and the optimizer averages the replicas' g_p. GSAM's decomposition uses the
  same (global or per-replica) vectors. On JAX a step sees the global batch (one SPMD
  program over the devices of a `keras.distribution`): there is one replica,
  `all_reduce` changes nothing, and per-device perturbations are the caller's to make
  (`SAMTrainer(m_sharpness=True)` vectorizes this function over the devices' rows).
* Mixed precision. The loss function may multiply the loss by a loss scale
  (`gradient_scale`); the perturbation and the diagnostics use the unscaled gradient,
  and the returned gradient is in the loss function's (scaled) units, for the
  LossScaleOptimizer to unscale, check and skip.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
from keras import ops

from tf_metaalign import backend
from tf_metaalign import functional as F


@dataclasses.dataclass
class SAMResult:
    """Everything one SAM / ASAM / GSAM step computes (tensors, per-replica units).

    Attributes:
      gradient: what to apply at w: g_p (SAM, ASAM), g_p - alpha * g_perp (GSAM), or the
        clean gradient g on a step that is not perturbed; in the loss function's
        (loss-scaled, per-replica) units.
      grad_clean: g, the gradient at w (same units).
      grad_perturbed: g_p, the gradient at w + e(w) (same units; g when not perturbed).
      perturbation: e(w), one tensor per parameter in its dtype (zeros when not perturbed).
      loss: L(w; b), the clean loss (the loss function's units).
      perturbed_loss: L(w + e; b) (same units; the clean loss when not perturbed).
      aux: the clean pass's aux output (for a Keras model: `(new_state, y_pred)`): the
        state to keep.
      grad_norm: ||g|| of the unscaled gradient the perturbation was built from (ASAM:
        ||T g||), as the mean gradient of the global batch (all_reduce) or of this
        replica's shard (m-sharpness).
      rho: the rho used (a scalar tensor).
      surrogate_gap: (L(w + e) - L(w)) / gradient_scale on this replica (0 when not
        perturbed).

    Example:
      >>> from keras import ops
      >>> def loss_fn(params, state, batch):
      ...     return ops.sum(params[0] ** 2), (state, None)
      >>> r = sam_gradient(loss_fn, [ops.convert_to_tensor([0.0, 2.0])], None, None, rho=1.0)
      >>> float(r.loss), float(r.perturbed_loss), float(r.surrogate_gap), float(r.grad_norm)
      (4.0, 9.0, 5.0, 4.0)
    """

    gradient: list
    grad_clean: list
    grad_perturbed: list
    perturbation: list
    loss: Any
    perturbed_loss: Any
    aux: Any
    grad_norm: Any
    rho: Any
    surrogate_gap: Any


def _is_number(x):
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def validate_options(rho, adaptive=False, eta=0.01, every=1, alpha=None):
    """Check SAM / ASAM / GSAM options; raise ValueError naming the offending argument."""
    if not _is_number(rho) or not math.isfinite(float(rho)) or rho < 0:
        raise ValueError(f"`rho` must be a finite number >= 0; got {rho!r}.")
    if not isinstance(adaptive, bool):
        raise ValueError(f"`adaptive` must be True (ASAM) or False (SAM); got {adaptive!r}.")
    if not _is_number(eta) or not math.isfinite(float(eta)) or eta < 0:
        raise ValueError(f"`eta` (ASAM's T = |w| + eta) must be a finite number >= 0; got {eta!r}.")
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"`every` must be an integer >= 1; got {every!r}.")
    if alpha is not None and (not _is_number(alpha) or not math.isfinite(float(alpha))):
        raise ValueError(f"`alpha` (GSAM) must be a finite number; got {alpha!r}.")


def sam_perturbation(params, grads, rho, *, adaptive=False, eta=0.01, adaptive_mask=None):
    """e(w): the first-order worst-case perturbation of size rho (SAM) or ASAM's.

    Args:
      params: the weights w (tensors).
      grads: the TRUE gradient g at w (unscaled; global or per-replica, as wanted).
      rho: the neighbourhood size (python number or scalar tensor).
      adaptive: False: e = rho g / ||g|| (SAM). True: e = rho T^2 g / ||T g|| with
        T = |w| + eta (ASAM).
      eta: ASAM's offset (SamsungLabs/ASAM's default 0.01).
      adaptive_mask: one bool per parameter: which get T = |w| + eta (ASAM's "weights");
        the others get T = 1. None: all.

    Returns:
      `(e, norm)`: e in each parameter's dtype; norm = ||g|| (ASAM: ||T g||) in the
      accumulation dtype. e = 0 where norm = 0; e is NaN where norm is not finite.

    Example:
      >>> from keras import ops
      >>> w, g = ops.convert_to_tensor([1.0, 2.0]), ops.convert_to_tensor([3.0, 4.0])
      >>> e, norm = sam_perturbation([w], [g], 0.5)
      >>> [round(float(v), 3) for v in e[0]], float(norm)
      ([0.3, 0.4], 5.0)

    References:
      Foret et al., "Sharpness-Aware Minimization for Efficiently Improving
      Generalization", ICLR 2021, eq. 2. Kwon et al., "ASAM: Adaptive Sharpness-Aware
      Minimization for Scale-Invariant Learning of Deep Neural Networks", ICML 2021.
    """
    params, grads = list(params), list(grads)
    acc = F.accumulation_dtype(params)
    mask = [True] * len(params) if adaptive_mask is None else list(adaptive_mask)
    if len(mask) != len(params) or len(grads) != len(params):
        raise ValueError(
            f"sam_perturbation: {len(params)} params, {len(grads)} grads and "
            f"{len(mask)} adaptive_mask entries; expected one of each per parameter."
        )
    g = [ops.cast(x, acc) for x in grads]
    if adaptive:
        eta_t = F.scalar(eta, acc)
        t = [ops.abs(ops.cast(p, acc)) + eta_t if m else None for p, m in zip(params, mask)]
    else:
        t = [None] * len(params)
    tg = [x if s is None else s * x for x, s in zip(g, t)]
    norm = F.global_norm(tg)
    safe = ops.where(norm > 0, norm, ops.ones_like(norm))
    scale = ops.where(norm > 0, F.scalar(rho, acc) / safe, ops.zeros_like(norm))
    # A non-finite gradient must give a non-finite step (a LossScaleOptimizer skips it).
    scale = ops.where(ops.isfinite(norm), scale, F.scalar(float("nan"), acc))
    e = [ops.cast(scale * (x if s is None else s * x), p.dtype) for x, s, p in zip(tg, t, params)]
    return e, norm


def gsam_rho(learning_rate, rho_max, rho_min=None, lr_max=None, lr_min=None, dtype=None):
    """GSAM's rho_t, linear in the learning rate (big_vision `gsam_gradient`)::

        rho_t = rho_min + (rho_max - rho_min) * (lr - lr_min) / (lr_max - lr_min)

    rho_max when `rho_min` is None or equal to `rho_max`, or when lr_max == lr_min.
    `learning_rate`: a number, a tensor or a variable (`optimizer.learning_rate`).
    Returns a scalar tensor of `dtype`, computed in it (default: float64 if
    `learning_rate` is, else float32; `GSAMTrainer` passes the weights' accumulation
    dtype, so float64 weights get a float64 rho from a float32 learning rate on every
    backend).

    Example:
      >>> round(float(gsam_rho(0.05, rho_max=0.1, rho_min=0.02, lr_max=0.1, lr_min=0.0)), 6)
      0.06

    References:
      Zhuang et al., "Surrogate Gap Minimization Improves Sharpness-Aware Training",
      ICLR 2022, Algorithm 1 (rho_t).
    """
    lr = ops.convert_to_tensor(learning_rate)
    if dtype is None:
        dtype = "float64" if keras.backend.standardize_dtype(lr.dtype) == "float64" else "float32"
    lr = ops.cast(lr, dtype)
    if rho_min is None or float(rho_min) == float(rho_max) or lr_max is None:
        return F.scalar(rho_max, dtype)
    if lr_min is None or float(lr_max) == float(lr_min):
        return F.scalar(rho_max, dtype)
    fraction = (lr - F.scalar(lr_min, dtype)) / F.scalar(float(lr_max) - float(lr_min), dtype)
    return F.scalar(rho_min, dtype) + F.scalar(float(rho_max) - float(rho_min), dtype) * fraction


def gsam_direction(grad_clean, grad_perturbed, alpha, global_clean=None, global_perturbed=None):
    """GSAM's update direction g_p - alpha * g_perp, g_perp = g - (g.g_p/||g_p||^2) g_p.

    The coefficient is computed from `global_clean` / `global_perturbed` (default: the
    given gradients) and applied to `grad_clean` / `grad_perturbed`: with the all-reduced
    vectors as the globals and this replica's as the gradients, the optimizer's sum over
    replicas is the direction of the global gradients (the map is linear in them once the
    coefficient is fixed). Where g_p = 0 the coefficient is 0.

    Example:
      >>> from keras import ops
      >>> g, gp = ops.convert_to_tensor([1.0, 1.0]), ops.convert_to_tensor([2.0, 0.0])
      >>> d = gsam_direction([g], [gp], 0.5)
      >>> [float(v) for v in d[0]]
      [2.0, -0.5]

    References:
      Zhuang et al., ICLR 2022, Algorithm 1; big_vision `gsam_gradient`
      (minimize_fp=True).
    """
    global_clean = grad_clean if global_clean is None else global_clean
    global_perturbed = grad_perturbed if global_perturbed is None else global_perturbed
    acc = F.accumulation_dtype(list(grad_clean))
    coef = ops.divide_no_nan(
        F.dot(global_clean, global_perturbed), F.dot(global_perturbed, global_perturbed)
    )
    alpha_t = F.scalar(alpha, acc)
    return [
        ops.cast(
            ops.cast(gp, acc) - alpha_t * (ops.cast(g, acc) - coef * ops.cast(gp, acc)), gp.dtype
        )
        for g, gp in zip(grad_clean, grad_perturbed)
    ]


def sam_gradient(
    loss_fn,
    params,
    state,
    batch,
    *,
    rho=0.05,
    adaptive: bool = False,
    eta: float = 0.01,
    adaptive_mask=None,
    gsam_alpha=None,
    perturb=True,
    gradient_scale=1.0,
    all_reduce: bool = True,
) -> SAMResult:
    """One SAM / ASAM / GSAM step: the gradient to apply at w, and diagnostics.

    Args:
      loss_fn: `loss_fn(params, state, batch) -> (loss, (new_state, outputs))`; pure
        (`tf_metaalign.functional.make_loss_fn`).
      params: the weights w (tensors, not variables).
      state: the loss function's state. Both passes start from it (same dropout masks);
        `aux[0]`, the clean pass's new state, is the one to keep.
      batch: the batch b (both passes).
      rho: the neighbourhood size (python number or scalar tensor, e.g. `gsam_rho`).
      adaptive: ASAM's perturbation (see `sam_perturbation`); `eta`, `adaptive_mask` too.
      gsam_alpha: None: SAM / ASAM (apply g_p). A number: GSAM's alpha (apply
        g_p - alpha * g_perp).
      perturb: python bool or bool tensor; False: the clean gradient g is returned and
        the perturbed pass is skipped (`functional.replica_safe_cond`: `tf.cond` /
        `jax.lax.cond`; the all-reduces still run, outside it, as MirroredStrategy
        requires).
      gradient_scale: the factor the loss function multiplied the loss by (a mixed
        precision loss scale): the perturbation is built from g / gradient_scale.
      all_reduce: True: the perturbation (and GSAM's decomposition) uses the global
        gradients (one all-reduce of g, one more of g_p for GSAM); False: this replica's
        own (m-sharpness; no communication). No-op with one replica.

    Returns:
      A `SAMResult`; apply `result.gradient` at w (e.g. `optimizer.apply_gradients`).

    Example:
      >>> from keras import ops
      >>> def loss_fn(params, state, batch):  # L(w) = w^2 (w.w)
      ...     (w,) = params
      ...     return ops.sum(w**2), (state, None)
      >>> r = sam_gradient(loss_fn, [ops.convert_to_tensor([3.0, 4.0])], None, None, rho=0.5)
      >>> [round(float(v), 3) for v in r.gradient[0]]  # 2 (w + 0.5 w/|w|) = 2.2 w
      [6.6, 8.8]

    In a custom loop under a strategy (as `dotprod_gradient`)::

        loss_fn = tf_metaalign.functional.make_loss_fn(model, keras.losses.MeanSquaredError())

        @tf.function
        def train_step(batch):
            def step(batch):
                r = sam_gradient(loss_fn, F.current_params(model), F.current_state(model),
                                 batch, rho=0.05)
                F.assign_state(model, r.aux[0])
                optimizer.apply_gradients(zip(r.gradient, model.trainable_variables))
                return r.loss
            return strategy.run(step, args=(batch,))

    On JAX, the same step as a pure jitted function of values (Keras's stateless API;
    several devices: shard the batch, e.g. with `keras.distribution.DataParallel`)::

        @jax.jit
        def train_step(params, state, optimizer_vars, batch):
            r = sam_gradient(loss_fn, params, state, batch, rho=0.05)
            params, optimizer_vars = optimizer.stateless_apply(optimizer_vars, r.gradient, params)
            return params, r.aux[0], optimizer_vars, r.loss

    References:
      Foret et al., ICLR 2021 (SAM); Kwon et al., ICML 2021 (ASAM); Zhuang et al.,
      ICLR 2022 (GSAM). google-research/sam, SamsungLabs/ASAM, google-research/big_vision
      (trainers/proj/gsam). See the module doc for where this differs.
    """
    validate_options(
        rho if _is_number(rho) else 0.0,
        adaptive,
        eta,
        1,
        gsam_alpha if gsam_alpha is None or _is_number(gsam_alpha) else 0.0,
    )
    params = list(params)
    acc = F.accumulation_dtype(params)
    rho_t = F.scalar(rho, acc)

    loss, g, aux = F.value_and_grad(loss_fn, params, state, batch)
    g_reduced = F.all_reduce_sum(g) if all_reduce else g
    true_g = F.unscale_gradients(g_reduced, gradient_scale, [acc] * len(params))
    e, norm = sam_perturbation(
        params, true_g, rho_t, adaptive=adaptive, eta=eta, adaptive_mask=adaptive_mask
    )
    # The logged norm is that of a mean gradient: the global batch's (the all-reduced sum of
    # Keras's per-replica units) or this shard's (R times its per-replica units).
    replicas = F.num_replicas()
    grad_norm = norm if (all_reduce or replicas == 1) else norm * float(replicas)

    def perturbed_pass():
        value, grads, _ = F.value_and_grad(loss_fn, F.offset_params(params, e, 1.0), state, batch)
        return value, grads

    def clean():
        return loss, list(g)

    if isinstance(perturb, bool):
        loss_p, g_p = perturbed_pass() if perturb else clean()
    else:
        loss_p, g_p = F.replica_safe_cond(perturb, perturbed_pass, clean)

    if gsam_alpha is None:
        gradient = g_p
    else:
        # The coefficient from the same vectors the perturbation used (one more all-reduce).
        gp_reduced = F.all_reduce_sum(g_p) if all_reduce else g_p
        gsam = gsam_direction(g, g_p, gsam_alpha, g_reduced, gp_reduced)
        if isinstance(perturb, bool):
            gradient = gsam if perturb else list(g)
        else:
            gradient = [ops.where(perturb, a, b) for a, b in zip(gsam, g)]

    on = ops.cast(perturb, acc) if not isinstance(perturb, bool) else float(perturb)
    unscale = 1.0 / F.scalar(gradient_scale, acc)
    gap = (ops.cast(loss_p, acc) - ops.cast(loss, acc)) * unscale * on
    if isinstance(perturb, bool) and not perturb:
        e = F.zeros_like(e)
    elif not isinstance(perturb, bool):
        e = [ops.where(perturb, x, ops.zeros_like(x)) for x in e]
    return SAMResult(
        gradient=gradient,
        grad_clean=list(g),
        grad_perturbed=list(g_p),
        perturbation=e,
        loss=loss,
        perturbed_loss=loss_p,
        aux=aux,
        grad_norm=grad_norm,
        rho=rho_t,
        surrogate_gap=gap,
    )


def largest_hessian_eigenvalue(
    loss_fn, params, state, batch, *, iterations: int = 20, seed: int = 0, tolerance=1e-3
):
    """The largest-magnitude eigenvalue of the loss Hessian at `params`, by power
    iteration on exact Hessian-vector products (`functional.value_grad_and_hvp`): the
    usual sharpness measure (lambda_max; Keskar et al. 2017, Foret et al. 2021 fig. 3).

    Starts from a seeded Gaussian vector and stops after `iterations` products or when
    the Rayleigh quotient changes by less than `tolerance` (relative). Call it eagerly
    (outside `tf.function` / `jax.jit`): the loop is python (it stops early), each
    product one compiled function (`tf.function` on TensorFlow, `jax.jit` on JAX).
    Nothing is assigned (every product starts from `state`). At a point that is not a minimum
    the largest-magnitude eigenvalue may be negative; it is returned with its sign.

    Returns:
      `(eigenvalue, vector, iterations_run)`: the Rayleigh quotient v.Hv of the last unit
      vector v (a python float), v (tensors), and the number of products taken.

    Example:
      >>> from keras import ops
      >>> a = ops.convert_to_tensor([[3.0, 1.0], [1.0, 2.0]])  # eigenvalues 3.618, 1.382
      >>> def loss_fn(params, state, batch):
      ...     (w,) = params
      ...     return 0.5 * ops.sum(w * ops.matmul(a, w)), (state, None)
      >>> lam, _, _ = largest_hessian_eigenvalue(loss_fn, [ops.zeros(2)], None, None)
      >>> round(lam, 2)
      3.62

    References:
      Foret et al., ICLR 2021, section 4.2 (Hessian spectra); Yao et al., "PyHessian",
      2020 (power iteration on Hessian-vector products).
    """
    params = list(params)
    rng = np.random.default_rng(seed)
    v = [ops.cast(rng.normal(size=tuple(p.shape)), p.dtype) for p in params]
    norm = F.global_norm(v)
    v = [x / ops.cast(norm, x.dtype) for x in v]

    def product(vector):
        return F.value_grad_and_hvp(loss_fn, params, state, batch, vector)[3]

    product = _compiled(product)
    eigenvalue, previous, done = 0.0, None, 0
    for done in range(1, iterations + 1):
        hv = product(v)
        eigenvalue = float(F.dot(v, hv))
        norm = F.global_norm(hv)
        if float(norm) == 0.0:
            break
        v = [ops.cast(h, x.dtype) / ops.cast(norm, x.dtype) for h, x in zip(hv, v)]
        if previous is not None and abs(eigenvalue - previous) <= tolerance * abs(eigenvalue):
            break
        previous = eigenvalue
    return eigenvalue, v, done


def _compiled(fn):
    """`fn` compiled once for the eager loop of `largest_hessian_eigenvalue` (`jax.jit` on
    JAX, `tf.function` on TensorFlow); `fn` itself while a step is being traced."""
    if not F.executing_eagerly():
        return fn
    if backend.is_jax():
        import jax

        return jax.jit(fn)
    tf = backend.require_tensorflow("largest_hessian_eigenvalue")
    return tf.function(fn, autograph=False)
