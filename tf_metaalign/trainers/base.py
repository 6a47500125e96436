"""The base of every Keras trainer: a `keras.Model` that wraps a user's model.

`trainer = SomeTrainer(model, ...)`, then `trainer.compile(optimizer, loss, metrics)` and
`trainer.fit(...)` as for any Keras model. The wrapped model is `trainer.model`; it is
never rebuilt or cloned, so after training it is the user's model, trained, and
`trainer.model.save("m.keras")` / `keras.models.load_model` give it back as itself.
`trainer.evaluate` / `predict` run the wrapped model unchanged (Keras's own test and
predict steps). Cross-step state of an algorithm (counters, slow weights, running
gradients, learned hyperparameters) is created with `add_state_variable` in the strategy
scope and saved with `trainer.save_weights` / `BackupAndRestore`.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign.trainers.pipeline import PipelineDataMixin


class MetaTrainer(PipelineDataMixin, keras.Model):
    """Owns the wrapped model, the loss at given weights, metrics and diagnostics."""

    #: names of the per-step diagnostics a subclass logs (each a `keras.metrics.Mean`).
    diagnostic_names: tuple[str, ...] = ()

    def __init__(self, model: keras.Model, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"`model` must be a keras.Model (Keras 3); got {type(model).__name__}. "
                "tf.keras 2 / tf_keras models are not supported."
            )
        super().__init__(**kwargs)
        self.model = model
        if model.built:
            # fit() never calls the trainer itself; it is built when its model is.
            self.built = True
        self._diagnostics = {
            name: keras.metrics.Mean(name=name) for name in self.diagnostic_names
        }

    # ------------------------------------------------------------------ Keras plumbing

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def build(self, input_shape=None):
        if not self.model.built and input_shape is not None:
            self.model.build(input_shape)
        self.built = True

    @property
    def metrics(self):
        return super().metrics + list(self._diagnostics.values())

    def test_step(self, data):
        # Training diagnostics (grad_dot, ...) are not measured by evaluate(): leave them out.
        logs = super().test_step(data)
        return {k: v for k, v in logs.items() if k not in self._diagnostics}

    def add_state_variable(self, name, shape=(), dtype="float32", initializer="zeros"):
        """A non-trainable, checkpointed variable of the trainer (call in `__init__`).

        Its aggregation is "only_first_replica": every replica computes the same update,
        and the first one's is kept.
        """
        return self.add_weight(
            name=name,
            shape=shape,
            dtype=dtype,
            initializer=initializer,
            trainable=False,
            aggregation="only_first_replica",
        )

    def _ensure_model_built(self, x):
        if not self.model.built:
            # A subclassed model without Input shapes: build it by calling it once.
            self.model(x, training=False)

    # ---------------------------------------------------------------- loss at weights

    def _compiled_loss(self):
        """`loss(y, y_pred, sample_weight)`: the compiled loss (0 if only model losses)."""
        if self._compile_loss is None and not self.model.losses:
            raise ValueError(
                f"{type(self).__name__}: no loss to compute. Pass `loss=` to compile()."
            )
        compile_loss = self._compile_loss

        def compiled(y, y_pred, sample_weight):
            if compile_loss is None:
                return tf.constant(0.0)
            return compile_loss(y, y_pred, sample_weight)

        return compiled

    def loss_fn(self, loss_scale=None, training=True):
        """`loss_fn(params, state, batch) -> (loss, (new_state, y_pred))` for `self.model`.

        The loss is the compiled loss plus the model's own losses, both divided by the
        number of replicas exactly as Keras's `train_step` does, times `loss_scale`.
        """
        return F.make_loss_fn(
            self.model, self._compiled_loss(), training=training, loss_scale=loss_scale
        )

    def split_loss_fn(self, n_first, loss_scale=None, training=True):
        """Like `loss_fn`, but `L(b1) + L(b2)` from one pass (`functional.make_split_loss_fn`)."""
        return F.make_split_loss_fn(
            self.model, self._compiled_loss(), n_first, training=training, loss_scale=loss_scale
        )

    def loss_scale(self):
        """The optimizer's loss scale (1 unless it is a `LossScaleOptimizer`)."""
        return self.optimizer.scale_loss(tf.constant(1.0, tf.float32))

    def model_compute_dtype(self):
        """The least precise compute dtype among the layers that hold weights.

        Not `model.dtype_policy`: a container (Sequential, functional) keeps the global
        policy of when it was built, while its layers may compute in float64 or float16.
        """
        dtypes = {
            layer.dtype_policy.compute_dtype
            for layer in self.model._flatten_layers(include_self=False)
            if layer.weights
            and tf.as_dtype(layer.dtype_policy.compute_dtype).is_floating
        }
        if not dtypes:
            return self.model.dtype_policy.compute_dtype
        return max(dtypes, key=F.machine_epsilon)

    def check_finite_loss(self, loss, where="the training loss"):
        """Stop training with a clear error when `loss` is NaN or infinite.

        Skipped under a `LossScaleOptimizer`, whose job is to skip such steps (float16
        overflow is expected there). Returns `loss`, to be used downstream so that the
        check runs before the update.
        """
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return loss
        return tf.debugging.check_numerics(
            loss,
            f"{type(self).__name__}: {where} is not finite (NaN or inf). Lower the "
            "learning rate, check the data for NaN/inf, or use keras.callbacks."
            "TerminateOnNaN to stop without an error",
        )

    # ---------------------------------------------------------------------- reporting

    def update_loss_tracker(self, per_replica_loss, n_examples):
        """Log a per-replica (replica-scaled) loss as the replica-count-free value."""
        self._loss_tracker.update_state(
            F.unscale_loss_for_distribution(per_replica_loss), sample_weight=n_examples
        )

    def update_diagnostics(self, **values):
        """`name=value` or `name=(value, sample_weight)` for each diagnostic."""
        for name, value in values.items():
            if isinstance(value, tuple):
                self._diagnostics[name].update_state(value[0], sample_weight=value[1])
            else:
                self._diagnostics[name].update_state(value)

    def compile_from_config(self, config):
        # Keras skips this for classes that override compile(); trainers may (to check
        # their options against the optimizer), and must still reload compiled.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self.model)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)
