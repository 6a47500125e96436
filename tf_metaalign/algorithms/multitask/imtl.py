"""IMTL (Liu et al., ICLR 2021): impartial multi-task learning, IMTL-G closed form on the
Gram matrix with IMTL-L's learned loss scales."""

from __future__ import annotations

import tensorflow as tf

from tf_metaalign.algorithms.multitask import solvers
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    register,
    scalar,
)


def imtl_g_weights(gram, present=None) -> tf.Tensor:
    """IMTL-G: the weights alpha (sum 1 over the present tasks) for which g = sum_t
    alpha_t g_t has equal projections on every unit gradient u_t = g_t / ||g_t||:
    <g, u_1 - u_t> = 0 for t != 1 (LibMTL `IMTL`: alpha_{2..T} = g_1 U^T (D U^T)^-1 with
    D_t = g_1 - g_t, U_t = u_1 - u_t, alpha_1 = 1 - sum alpha_{2..T}), as one T x T
    linear system on the Gram matrix. Absent tasks, and present tasks whose gradient is
    exactly 0 (u_t undefined), get alpha_t = 0; the reference task is the first of the
    rest. A singular system (gradients affinely dependent in that sense; LibMTL's inverse
    fails there) falls back to equal weights over those tasks. More tasks than gradient
    dimensions need not be singular: there the only g with equal projections on every
    u_t is often g = 0, and IMTL-G then returns weights whose combination is zero (no
    update; measured on the 2-D synthetic problem with 3 tasks, ||g|| ~ 1e-15)."""
    gram = tf.convert_to_tensor(gram)
    dtype = gram.dtype
    T = int(gram.shape[0])
    diag = tf.linalg.diag_part(gram)
    on = diag > 0
    if present is not None:
        on = tf.logical_and(on, tf.cast(present, dtype) > 0)
    mask = tf.cast(on, dtype)
    num = tf.reduce_sum(mask)
    norms = tf.sqrt(tf.where(on, diag, tf.ones_like(diag)))
    idx = tf.range(T, dtype=tf.int32)
    ref = tf.reduce_min(tf.where(on, idx, tf.fill([T], tf.constant(T, tf.int32))))
    ref = tf.minimum(ref, T - 1)
    # row t (present, != ref): sum_k alpha_k (G_k,ref / n_ref - G_k,t / n_t) = 0
    cond_rows = (
        tf.gather(gram, ref, axis=1)[None, :] / tf.gather(norms, ref)
        - tf.transpose(gram) / norms[:, None]
    )
    eye = tf.eye(T, dtype=dtype)
    is_ref = tf.equal(idx, ref)
    rows = tf.where(is_ref[:, None], mask[None, :], tf.where(on[:, None], cond_rows, eye))
    rhs = tf.cast(is_ref, dtype)
    alpha, ok = solvers.solve_linear(rows, rhs)
    alpha = alpha * mask
    equal = mask / tf.maximum(num, scalar(1.0, dtype))
    ok = tf.logical_and(ok, tf.reduce_all(tf.math.is_finite(alpha)))
    return tf.where(ok, alpha, equal)


@register
class IMTL(MultiTaskMethod):
    """IMTL (LibMTL `IMTL`: IMTL-G on the gradients of IMTL-L's scaled losses).

    IMTL-L: trainable loss scales s_t (state `imtl_loss_scale`, initially 0, trained by
    the compiled optimizer beside the model, as LibMTL trains its `loss_scale` parameter
    with the model's optimizer): task t's loss is e^{s_t} L_t - s_t, so its gradient is
    e^{s_t} g_t on the model and e^{s_t} L_t - 1 on s_t (`state_gradients`; LibMTL's
    per-task backward passes leave exactly that on `loss_scale`).

    IMTL-G on the scaled gradients g'_t = e^{s_t} g_t (Gram G'_ij = e^{s_i + s_j} G_ij):
    alpha (sum 1) with equal projections of g' = sum alpha_t g'_t on every unit vector
    g'_t / ||g'_t|| (`imtl_g_weights`). Shared gradient sum_t alpha_t e^{s_t} g_t;
    task-specific variables get e^{s_t} g_t (the gradient of their scaled loss); loss
    weights e^{s_t}. Absent tasks: alpha_t = 0 and no gradient on s_t.

    `learn_scales=False`: IMTL-G alone (s = 0, no state): G = sum_t alpha_t g_t.

    `kind` is "gradient" (the shared gradient is IMTL-G's combination), although with
    learned scales the task-specific variables get e^{s_t} g_t, the scaled loss's
    gradient, as in LibMTL.

    Dense task gradients: the trainer forms this method's per-task gradients as dense
    tensors, so an Embedding's sparse gradient is densified and the optimizer gets a
    dense update (see `tf_metaalign.algorithms.multitask.base`, "Sparse gradients").

    Args:
      learn_scales: train the IMTL-L scales (LibMTL's IMTL does; default True).

    Example:
      >>> IMTL()
      IMTL(learn_scales=True)
    """

    name = "imtl"
    kind = "gradient"
    uses_gradients = True
    reference = "LibMTL IMTL (IMTL-G closed form + IMTL-L loss scales)"

    def __init__(self, learn_scales: bool = True):
        if not isinstance(learn_scales, bool):
            raise ValueError(f"`learn_scales` must be True or False; got {learn_scales!r}.")
        self.learn_scales = learn_scales

    def state_spec(self, num_tasks):
        if not self.learn_scales:
            return {}
        return {"loss_scale": StateSpec((num_tasks,), trainable=True)}

    def combine(self, inputs, state):
        dtype = inputs.dtype
        present = tf.cast(inputs.present, dtype)
        gram = tf.cast(inputs.gram, dtype)
        if self.learn_scales:
            s = tf.cast(state["loss_scale"], dtype)
            scale = tf.exp(s)
        else:
            scale = tf.ones_like(inputs.losses)
        scaled = gram * scale[:, None] * scale[None, :]
        alpha = imtl_g_weights(scaled, present)
        result = Combination(shared=alpha * scale, specific=scale, loss_weights=scale)
        if self.learn_scales:
            result.state_gradients = {
                "loss_scale": tf.cast(
                    present * (scale * inputs.losses - 1.0), state["loss_scale"].dtype
                )
            }
        return result

    def get_config(self):
        return {"learn_scales": self.learn_scales}
