"""`DotProdTrainer`: Meta DotProd (Kedia et al., Algorithm 1) inside `model.fit`."""

from __future__ import annotations

import inspect
import logging

import keras
from keras import ops

from tf_metaalign.callbacks import DivergenceGuard

from tf_metaalign import functional as F
from tf_metaalign.algorithms import dotprod
from tf_metaalign.trainers.base import MetaTrainer


@keras.saving.register_keras_serializable(package="tf_metaalign")
class DotProdTrainer(MetaTrainer):
    """Train `model` with the Meta DotProd regulariser.

    Each batch that `fit` gives (per replica, under a strategy) is split in two:
    b1 = the first floor(n/2) examples, b2 = the rest. The gradient handed to the
    compiled optimizer is::

        R = (G(theta - alpha*G1; b2) - G2) / alpha          # ~= -H2 G1
        G = G1 + G2 + weight * R                             # alignment="dot" (the paper)
        G = G1 + G2 + s * weight * R,                        # alignment="capped" (default)
            s = min(1, cap * ||G1 + G2|| / (weight * ||R||))

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

    Stability: the paper's update is about (2I - weight*H2) g, so once weight*lambda_max(H2)
    passes ~2 it ascends the loss along the sharpest directions, which sharpens the net
    further (G1.G2 is unbounded: scaling the logits scales the gradients). Measured: the
    paper's weight=0.1 diverges on a from-scratch convnet (Adam 1e-3) and when fine-tuning
    MiniLM (Adam 1e-4). The default `alignment="capped"` is the paper's step wherever
    weight*||R|| <= cap*||G1+G2|| and otherwise shrinks R to that size, so every step is a
    descent direction of the pair's loss for cap < 1 (derivation and numbers:
    `tf_metaalign.algorithms.dotprod`, docs/finetune.md "Stability"). `fit` also adds a
    `DivergenceGuard` (`on_divergence`) that warns, or stops, when the loss or grad_dot
    explodes. With `weight=0` nothing is perturbed: G1 + G2 comes from two half passes
    and the diagnostics are still logged, which makes a baseline that measures G1.G2.

    Batches too small to split: when any replica's batch has fewer than 2 examples (the
    last batch of NumPy input; a global batch smaller than twice the replica count), the
    step is a plain step on the pair (b, b): G = G1 + G2 = 2 * grad L(b), the scale the
    learning rate was chosen for, without the regulariser and without diagnostics. The
    decision is global (the same on every replica); under a strategy each replica's share
    is weighted by its number of examples, so the step is 2 * the gradient of the mean
    over the global batch whatever the replica count (an empty replica contributes 0).
    The share of such steps is logged (`unsplit_fraction`, per epoch) and said once per
    `fit` in the log.

    Args:
      model: the Keras model to train (`trainer.model`).
      weight: the regulariser weight (the paper's LR_G1G2), >= 0.
      alpha: "auto" (a perturbation the compute dtype can represent:
        sqrt(eps)*(1+||theta||)/||G1||) or a float used as given. The paper's 1e-7 is
        unsafe in float32: theta - 1e-7*G1 rounds back to theta for most weights.
      every: apply the regulariser on every `every`-th pair only (1 = always).
      method: "finite_difference" (the paper) or "exact" (an exact Hessian-vector
        product instead of the finite difference; about 2x the cost of a backward pass).
      alignment: "capped" (default, bounded: see above) or "dot" (the paper's
        Algorithm 1 exactly, which can run away for large `weight`).
      cap: the bound of "capped": the regulariser's norm is at most `cap` times
        ||G1 + G2|| (< 1: every step descends the pair's loss). Default 0.5.
      on_divergence: "warn" (default), "stop" or None: `fit` adds a
        `tf_metaalign.callbacks.DivergenceGuard` with this action (unless the
        callbacks already hold one), checked every 50 batches and at epoch ends, that fires
        when the loss exceeds 10x its best value, rises and is above its first batch's
        value, or grad_dot grows 100x over its first epoch's value.
      accumulation_steps: accumulate this many pairs' gradients G before one optimizer
        update (their mean is applied). G is linear in G1, G2 and G21, so this is the same
        as accumulating the three separately and combining once. Implemented with the
        optimizer's own `gradient_accumulation_steps` (set at compile time), which
        accumulates after the cross-replica sum.

    On JAX (`KERAS_BACKEND=jax`; TensorFlow not needed) the same arguments, logs and
    numbers (float64 trajectories equal TensorFlow's, tested against golden files). What
    differs is multi-device training: under `keras.distribution.DataParallel` the step is
    one SPMD program that sees the GLOBAL batch, so b1 and b2 are the global batch's first
    and second halves on any number of devices (TensorFlow with one replica), whereas a
    `tf.distribute` strategy splits each replica's shard, so there the global b1 is the
    union of the shards' first halves. Both give replica-count-independent results; they
    differ from each other only in which examples form b1 and b2 on several devices. On
    JAX the batch size is always static, so a batch too small to split is decided at
    trace time, and skipped pairs (`every > 1`) always cost one full-batch pass.

    Under mixed precision (`keras.mixed_precision.set_global_policy("mixed_float16")` and
    a `LossScaleOptimizer`), gradients are of the scaled loss, and the perturbation
    theta - alpha*G1 is applied to the float32 variables with the unscaled G1.

    Use: `trainer.compile(optimizer=..., loss=..., metrics=[...])` (keywords: Keras's
    third positional argument is `loss_weights`), then `trainer.fit(...)`.

    Logs: loss, the compiled metrics, `grad_dot` (G1.G2 of the true mean gradients),
    `grad_cosine` and `reg_ratio` (weight * ||R|| / ||G1 + G2|| before the cap: above
    `cap` the cap binds), averaged over the regularised pairs, and `unsplit_fraction`.

    Example:
      >>> from tf_metaalign.trainers import DotProdTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = DotProdTrainer(model, weight=0.1)
      >>> trainer.compile(optimizer="sgd", loss="mse")
      >>> x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
      >>> history = trainer.fit(x, x.sum(axis=1, keepdims=True), batch_size=8, verbose=0)
      >>> sorted(history.history)
      ['grad_cosine', 'grad_dot', 'loss', 'reg_ratio', 'unsplit_fraction']
      >>> trainer.model is model  # the model trains, and saves, as itself
      True

    References:
      Kedia, Chinthakindi & Ryu, "Beyond Reptile: Meta-Learned Dot-Product Maximization
      between Gradients for Improved Single-Task Regularization", Findings of EMNLP 2021.
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model: keras.Model,
        weight: float = 0.1,
        alpha="auto",
        every: int = 1,
        method: str = "finite_difference",
        accumulation_steps: int = 1,
        alignment: str = "capped",
        cap: float = 0.5,
        on_divergence="warn",
        **kwargs,
    ):
        dotprod.validate_options(weight, alpha, every, method, alignment, cap)
        if on_divergence not in (None, *DivergenceGuard.ACTIONS):
            raise ValueError(
                f"`on_divergence` must be one of {(*DivergenceGuard.ACTIONS, None)}; "
                f"got {on_divergence!r}."
            )
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
        self.alignment = alignment
        self.cap = float(cap)
        self.on_divergence = on_divergence
        # Pairs seen since the start of training: drives the `every` schedule and is
        # checkpointed so a resumed run keeps its phase.
        self.schedule = self.every_k_steps(self.every, name="dotprod_pairs")
        self.add_diagnostic("grad_dot", "mean")
        self.add_diagnostic("grad_cosine", "mean")
        self.add_diagnostic("reg_ratio", "mean")
        # The share of the epoch's batches too small to split (plain steps, see above).
        self.add_diagnostic("unsplit_fraction", "mean")

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

    def _pair_plan(self, x):
        """(n, small, scale): the batch size, whether the step is a plain step on (b, b)
        (a python bool when known at trace time, else a bool tensor, the same on every
        replica) and the factor on this replica's gradient (None: 1)."""
        n = F.batch_size(x)
        replicas = F.num_replicas()
        if replicas == 1:
            # A python bool when the size is static (a trace of its own: no cond). Always
            # so on JAX, whose traces have static shapes.
            return n, n < 2, None
        # In the weights' accumulation dtype: n_r * R / N is not exact in float32 (e.g. 1.2).
        acc = F.accumulation_dtype(self.model.trainable_variables)
        n_t = ops.cast(n, acc)
        # One scalar all-reduce: any replica too small, and the global example count.
        too_small, total = ops.unstack(F.all_reduce_sum(ops.stack([ops.cast(n_t < 2.0, acc), n_t])))
        # Replica r's share of a plain step: its mean gradient weighted by n_r * R / N, so
        # the optimizer's sum is the gradient of the global mean (empty replicas: 0).
        scale = ops.divide_no_nan(n_t * float(replicas), total)
        return n, too_small > 0, scale

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        n, small, replica_scale = self._pair_plan(x)
        if isinstance(small, bool):
            n_1, start_2 = (n, 0) if small else (n // 2, n // 2)
        else:
            # Only on TensorFlow (a dynamic batch size); JAX's sizes are static.
            n_1 = ops.where(small, n, n // 2)
            start_2 = ops.where(small, ops.zeros_like(n_1), n // 2)
        batch_1 = keras.tree.map_structure(
            lambda t: None if t is None else t[:n_1], (x, y, sample_weight)
        )
        batch_2 = keras.tree.map_structure(
            lambda t: None if t is None else t[start_2:], (x, y, sample_weight)
        )

        loss_scale = self.loss_scale()
        params = F.current_params(self.model)
        state = F.current_state(self.model)
        acc = F.accumulation_dtype(params)
        split = ops.logical_not(small) if not isinstance(small, bool) else not small

        def with_dotprod(apply_regularizer=self.weight > 0):
            # weight == 0: G1 + G2 from two half passes, G21 never computed; the
            # diagnostics are still measured (a baseline that logs G1.G2).
            # A plain step on (b, b) (small) never applies the regulariser.
            if isinstance(apply_regularizer, bool) and isinstance(split, bool):
                apply = apply_regularizer and split
            else:
                apply = ops.logical_and(apply_regularizer, split)
            r = dotprod.dotprod_gradient(
                self.loss_fn(loss_scale=loss_scale),
                params,
                state,
                batch_1,
                batch_2,
                weight=self.weight,
                alpha=self.alpha,
                method=self.method,
                alignment=self.alignment,
                cap=self.cap,
                apply_regularizer=apply,
                gradient_scale=loss_scale,
                compute_dtype=self.model_compute_dtype(),
            )
            # On (b, b) the outputs of b are those of b1: b2's are left out.
            skip_2 = ops.where(small, n, 0) if not isinstance(small, bool) else (n if small else 0)
            y_pred = keras.tree.map_structure(
                lambda a, b: ops.concatenate([a, b[skip_2:]], axis=0), r.aux_1[1], r.aux_2[1]
            )
            measured = ops.cast(apply, acc) if self.weight > 0 else ops.cast(split, acc)
            # The logged loss in the accumulation dtype (float64 for float64 weights).
            size_1 = ops.cast(F.batch_size(batch_1[0]), acc)
            size_2 = ops.cast(F.batch_size(batch_2[0]), acc)
            loss = ops.divide_no_nan(
                size_1 * ops.cast(r.loss_1, acc) + size_2 * ops.cast(r.loss_2, acc),
                size_1 + size_2,
            )
            return (
                r.gradient,
                loss,
                y_pred,
                r.aux_2[0],
                r.grad_dot,
                r.grad_cosine,
                r.reg_ratio,
                measured,
            )

        def skipped():
            # G1 + G2 = grad(L(b1) + L(b2)), in one pass over the whole batch. On a batch
            # too small to split (dynamic size, one replica): b1 = b, b2 = empty (loss 0)
            # and the gradient doubled, i.e. 2 * grad L(b).
            _, grads, (new_state, y_pred, loss_1, loss_2) = F.value_and_grad(
                self.split_loss_fn(n_1, loss_scale=loss_scale),
                params,
                state,
                (x, y, sample_weight),
            )
            n_f, n_1f = ops.cast(n, acc), ops.cast(n_1, acc)
            loss = ops.divide_no_nan(
                n_1f * ops.cast(loss_1, acc) + (n_f - n_1f) * ops.cast(loss_2, acc),
                n_f,
            )
            if not isinstance(small, bool):
                grads = [g * ops.cast(ops.where(small, 2.0, 1.0), g.dtype) for g in grads]
            zero = F.scalar(0.0, acc)
            return grads, loss, y_pred, new_state, zero, zero, zero, zero

        if self.weight == 0 or small is True:
            outputs = with_dotprod(apply_regularizer=self.weight > 0 and small is False)
        else:
            # with_dotprod all-reduces G1 and G2: on several replicas the all-reduces run
            # on every pair and only the G21 pass is conditional (inside dotprod_gradient).
            outputs = self.schedule.cond(
                self.schedule.is_first(),
                with_dotprod,
                skipped,
                communicates=True,
                merged=lambda due: with_dotprod(apply_regularizer=due),
            )
        gradient, loss, y_pred, new_state, grad_dot, grad_cosine, reg_ratio, measured = outputs
        if replica_scale is not None:
            # Several replicas: a plain step's share is weighted by this replica's examples.
            factor = ops.where(small, replica_scale, 1.0)
            gradient = [g * ops.cast(factor, g.dtype) for g in gradient]

        # The loss of the whole batch: the size-weighted mean of the two halves.
        loss = loss / ops.cast(loss_scale, loss.dtype)
        # Skipped pairs (every > 1) do not measure G1.G2: weight 0 keeps them out of the mean.
        return self.finish_step(
            data,
            y_pred,
            loss,
            new_state=new_state,
            gradients=gradient,
            diagnostics={
                "grad_dot": (grad_dot, measured),
                "grad_cosine": (grad_cosine, measured),
                "reg_ratio": (reg_ratio, measured),
                "unsplit_fraction": ops.cast(small, "float32"),
            },
            where="the loss of the pair (b1, b2)",
        )

    def fit(self, *args, **kwargs):
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        extra = [_UnsplitBatchesReport()]
        if self.on_divergence is not None and not any(
            isinstance(c, DivergenceGuard) for c in callbacks
        ):
            extra.append(
                DivergenceGuard(
                    self.on_divergence,
                    every_n_batches=50,
                    advice=(
                        f"DotProdTrainer(weight={self.weight}, alignment={self.alignment!r}): "
                        "the Meta DotProd term can make the model grow its gradients to raise "
                        "G1.G2 (the paper's step ascends the loss once weight*lambda_max(H) "
                        'passes ~2). Lower `weight`, use alignment="capped" (the default) '
                        "or a smaller `cap`, or a lower learning rate. "
                        'on_divergence="stop" stops the run here.'
                    ),
                )
            )
        bound.arguments["callbacks"] = callbacks + extra
        return super().fit(*bound.args[1:], **bound.kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            weight=self.weight,
            alpha=self.alpha,
            every=self.every,
            method=self.method,
            accumulation_steps=self.accumulation_steps,
            alignment=self.alignment,
            cap=self.cap,
            on_divergence=self.on_divergence,
        )
        return config


class _UnsplitBatchesReport(keras.callbacks.Callback):
    """Says once per `fit` (at the first epoch end that had one) that batches too small
    to split were trained as plain steps."""

    def on_train_begin(self, logs=None):
        self._said = False

    def on_epoch_end(self, epoch, logs=None):
        fraction = float((logs or {}).get("unsplit_fraction", 0.0))
        if self._said or not fraction > 0:
            return
        self._said = True
        logging.warning(
            "DotProdTrainer: %.3g%% of epoch %d's batches had fewer than 2 examples on some "
            "replica, so they could not be split into b1, b2; each was trained as a plain "
            "step on (b, b) (G = 2 * grad L(b), no regulariser). Said once per fit; the "
            "share is logged as `unsplit_fraction`.",
            100 * fraction,
            epoch + 1,
        )
