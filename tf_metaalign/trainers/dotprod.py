"""`DotProdTrainer`: Meta DotProd (Kedia et al., Algorithm 1) inside `model.fit`."""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign.algorithms import dotprod
from tf_metaalign.trainers.base import MetaTrainer


@keras.saving.register_keras_serializable(package="tf_metaalign")
class DotProdTrainer(MetaTrainer):
    """Train `model` with the Meta DotProd regulariser.

    Each batch that `fit` gives (per replica, under a strategy) is split in two:
    b1 = the first floor(n/2) examples, b2 = the rest (a batch of fewer than 2 examples
    is an error). The gradient handed to the compiled optimizer is exactly::

        G = G1 + G2 + weight * (G(theta - alpha*G1; b2) - G2) / alpha

    where G1, G2 are the gradients of the compiled loss plus the model's own losses on
    b1 and b2 (see `tf_metaalign.algorithms.dotprod`). On pairs where the regulariser is
    skipped (`every > 1`: it runs on pairs 0, every, 2*every, ... counted from the start
    of training, across epochs and `steps_per_execution`), G = G1 + G2, computed as
    grad(L(b1) + L(b2)) in one pass over the whole batch (the losses on the two slices of
    the output), which costs what plain training costs (with one replica; under a
    multi-replica strategy skipped pairs take two half passes, because an all-reduce
    cannot sit inside `tf.cond` there); `grad_dot`/`grad_cosine` are averaged over the
    regularised pairs only. Note that G1+G2 is the sum of two
    half-batch mean gradients, i.e. twice the full-batch gradient, as in the paper;
    pick the learning rate accordingly.

    Stability: the update is about (I - weight*H2) G, so it diverges once weight exceeds
    roughly 1/lambda_max(H2); measured here, the paper's weight=0.1 diverged when
    fine-tuning MiniLM with Adam(1e-4) (0.01 was stable). With `weight=0` nothing is
    perturbed: G1 + G2 comes from two half passes and the diagnostics are still logged,
    which makes a baseline that measures G1.G2.

    Args:
      model: the Keras model to train (`trainer.model`).
      weight: the regulariser weight (the paper's LR_G1G2), >= 0.
      alpha: "auto" (a perturbation the compute dtype can represent:
        sqrt(eps)*(1+||theta||)/||G1||) or a float used as given. The paper's 1e-7 is
        unsafe in float32: theta - 1e-7*G1 rounds back to theta for most weights.
      every: apply the regulariser on every `every`-th pair only (1 = always).
      method: "finite_difference" (the paper) or "exact" (an exact Hessian-vector
        product instead of the finite difference; about 2x the cost of a backward pass).
      accumulation_steps: accumulate this many pairs' gradients G before one optimizer
        update (their mean is applied). G is linear in G1, G2 and G21, so this is the same
        as accumulating the three separately and combining once. Implemented with the
        optimizer's own `gradient_accumulation_steps` (set at compile time), which
        accumulates after the cross-replica sum.

    Under mixed precision (`keras.mixed_precision.set_global_policy("mixed_float16")` and
    a `LossScaleOptimizer`), gradients are of the scaled loss, and the perturbation
    theta - alpha*G1 is applied to the float32 variables with the unscaled G1.

    Use: `trainer.compile(optimizer=..., loss=..., metrics=[...])` (keywords: Keras's
    third positional argument is `loss_weights`), then `trainer.fit(...)`.

    Logs: loss, the compiled metrics, `grad_dot` (G1.G2 of the true mean gradients) and
    `grad_cosine`.
    """

    def __init__(
        self,
        model: keras.Model,
        weight: float = 0.1,
        alpha="auto",
        every: int = 1,
        method: str = "finite_difference",
        accumulation_steps: int = 1,
        **kwargs,
    ):
        dotprod.validate_options(weight, alpha, every, method)
        if (
            isinstance(accumulation_steps, bool)
            or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1
        ):
            raise ValueError(
                f"`accumulation_steps` must be an integer >= 1; got {accumulation_steps!r}."
            )
        super().__init__(model, **kwargs)
        self.weight = float(weight)
        self.alpha = alpha if alpha == "auto" else float(alpha)
        self.every = int(every)
        self.method = method
        self.accumulation_steps = int(accumulation_steps)
        # Pairs seen since the start of training: drives the `every` schedule and is
        # checkpointed so a resumed run keeps its phase.
        self.schedule = self.every_k_steps(self.every, name="dotprod_pairs")
        self.add_diagnostic("grad_dot", "mean")
        self.add_diagnostic("grad_cosine", "mean")

    @property
    def pairs_seen(self):
        """Pairs (train steps) seen since the start of training (a checkpointed int64)."""
        return self.schedule.count

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        super().compile(optimizer, *args, **kwargs)
        if self.accumulation_steps > 1:
            inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
            current = getattr(inner, "gradient_accumulation_steps", None)
            if current not in (None, 1, self.accumulation_steps):
                raise ValueError(
                    f"DotProdTrainer(accumulation_steps={self.accumulation_steps}) conflicts "
                    f"with the optimizer's gradient_accumulation_steps={current}."
                )
            if inner.built and current != self.accumulation_steps:
                raise ValueError(
                    "`accumulation_steps` needs an optimizer that is not built yet "
                    "(compile with a fresh optimizer)."
                )
            inner.gradient_accumulation_steps = self.accumulation_steps

    def _pair_sizes(self, x):
        n = F.batch_size(x)
        message = (
            "DotProdTrainer splits each batch into halves b1 and b2, so every batch "
            "(per replica) needs at least 2 examples"
        )
        if isinstance(n, int):
            if n < 2:
                raise ValueError(
                    f"{message}; got batch size {n}. Use a larger batch_size (or "
                    "drop_remainder=True)."
                )
        else:
            tf.debugging.assert_greater_equal(n, 2, message=message + " (batch size)")
        return n // 2, n

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        n_1, n = self._pair_sizes(x)
        batch_1, batch_2 = F.split_batch((x, y, sample_weight), n_1)

        loss_scale = self.loss_scale()
        params = F.current_params(self.model)
        state = F.current_state(self.model)
        acc = F.accumulation_dtype(params)

        def with_dotprod(apply_regularizer=self.weight > 0):
            # weight == 0: G1 + G2 from two half passes, G21 never computed; the
            # diagnostics are still measured (a baseline that logs G1.G2).
            r = dotprod.dotprod_gradient(
                self.loss_fn(loss_scale=loss_scale),
                params,
                state,
                batch_1,
                batch_2,
                weight=self.weight,
                alpha=self.alpha,
                method=self.method,
                apply_regularizer=apply_regularizer,
                gradient_scale=loss_scale,
                compute_dtype=self.model_compute_dtype(),
            )
            y_pred = tf.nest.map_structure(
                lambda a, b: tf.concat([a, b], axis=0), r.aux_1[1], r.aux_2[1]
            )
            measured = tf.cast(apply_regularizer, acc) if self.weight > 0 else tf.constant(1.0, acc)
            return (r.gradient, r.loss_1, r.loss_2, y_pred, r.aux_2[0],
                    r.grad_dot, r.grad_cosine, measured)

        def skipped():
            # G1 + G2 = grad(L(b1) + L(b2)), in one pass over the whole batch.
            _, grads, (new_state, y_pred, loss_1, loss_2) = F.value_and_grad(
                self.split_loss_fn(n_1, loss_scale=loss_scale), params, state,
                (x, y, sample_weight),
            )
            zero = tf.constant(0.0, acc)
            return grads, loss_1, loss_2, y_pred, new_state, zero, zero, zero

        if self.weight == 0:
            outputs = with_dotprod()
        else:
            # with_dotprod all-reduces G1 and G2: on several replicas the all-reduces run
            # on every pair and only the G21 pass is conditional (inside dotprod_gradient).
            outputs = self.schedule.cond(
                self.schedule.is_first(), with_dotprod, skipped, communicates=True,
                merged=lambda due: with_dotprod(apply_regularizer=due),
            )
        gradient, loss_1, loss_2, y_pred, new_state, grad_dot, grad_cosine, measured = outputs

        # The loss of the whole batch: the size-weighted mean of the two halves.
        n_f = tf.cast(n, tf.float32)
        n_1f = tf.cast(n_1, tf.float32)
        loss = (
            n_1f * tf.cast(loss_1, tf.float32)
            + (n_f - n_1f) * tf.cast(loss_2, tf.float32)
        ) / (n_f * tf.cast(loss_scale, tf.float32))
        # Skipped pairs (every > 1) do not measure G1.G2: weight 0 keeps them out of the mean.
        return self.finish_step(
            data, y_pred, loss, new_state=new_state, gradients=gradient,
            diagnostics={"grad_dot": (grad_dot, measured), "grad_cosine": (grad_cosine, measured)},
            where="the loss of the pair (b1, b2)",
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            weight=self.weight,
            alpha=self.alpha,
            every=self.every,
            method=self.method,
            accumulation_steps=self.accumulation_steps,
        )
        return config
