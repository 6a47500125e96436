"""IMTL (Liu et al., ICLR 2021): impartial multi-task learning, IMTL-G closed form on the
Gram matrix with IMTL-L's learned loss scales."""

from __future__ import annotations

from keras import ops
from keras.backend import standardize_dtype

from tf_metaalign.algorithms.multitask import solvers
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    register,
    scalar,
)


def imtl_g_weights(gram, present=None):
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
    gram = ops.convert_to_tensor(gram)
    dtype = standardize_dtype(gram.dtype)
    T = int(gram.shape[0])
    diag = ops.diagonal(gram)
    on = ops.greater(diag, 0)
    if present is not None:
        on = ops.logical_and(on, ops.greater(ops.cast(present, dtype), 0))
    mask = ops.cast(on, dtype)
    num = ops.sum(mask)
    norms = ops.sqrt(ops.where(on, diag, ops.ones_like(diag)))
    idx = ops.arange(T, dtype="int32")
    ref = ops.min(ops.where(on, idx, ops.full((T,), T, dtype="int32")))
    ref = ops.minimum(ref, T - 1)
    # row t (present, != ref): sum_k alpha_k (G_k,ref / n_ref - G_k,t / n_t) = 0
    cond_rows = (
        ops.take(gram, ref, axis=1)[None, :] / ops.take(norms, ref)
        - ops.transpose(gram) / norms[:, None]
    )
    eye = ops.eye(T, dtype=dtype)
    is_ref = ops.equal(idx, ref)
    rows = ops.where(is_ref[:, None], mask[None, :], ops.where(on[:, None], cond_rows, eye))
    rhs = ops.cast(is_ref, dtype)
    alpha, ok = solvers.solve_linear(rows, rhs)
    alpha = alpha * mask
    equal = mask / ops.maximum(num, scalar(1.0, dtype))
    ok = ops.logical_and(ok, ops.all(ops.isfinite(alpha)))
    return ops.where(ok, alpha, equal)


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
        present = ops.cast(inputs.present, dtype)
        gram = ops.cast(inputs.gram, dtype)
        if self.learn_scales:
            s = ops.cast(state["loss_scale"], dtype)
            scale = ops.exp(s)
        else:
            scale = ops.ones_like(inputs.losses)
        scaled = gram * scale[:, None] * scale[None, :]
        alpha = imtl_g_weights(scaled, present)
        result = Combination(shared=alpha * scale, specific=scale, loss_weights=scale)
        if self.learn_scales:
            result.state_gradients = {
                "loss_scale": ops.cast(
                    present * (scale * inputs.losses - 1.0),
                    standardize_dtype(state["loss_scale"].dtype),
                )
            }
        return result

    def get_config(self):
        return {"learn_scales": self.learn_scales}
