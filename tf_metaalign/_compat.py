"""Every private Keras / TensorFlow API the package uses, in one place.

Each function wraps one private API, says why no public API serves, and has a test in
`tests/test_compat.py` that fails with a message naming the API if an upgrade of Keras
or TensorFlow removes or changes it. Code elsewhere in the package calls these
functions and never reaches into `keras.src`, `tensorflow.python`, `tf.__internal__`
or a Keras object's private attributes itself.

Pinned: TensorFlow 2.21, Keras 3.15 (setup.py).
"""
from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

# ------------------------------------------------------------------------ trainers


def compiled_loss(model: keras.Model):
    """The loss object `model.compile(loss=..., loss_weights=...)` built (or None).

    Private: `Model._compile_loss`. Keras exposes no public handle on the compiled
    loss; `compute_loss` reads it. The trainers evaluate the compiled loss at weights
    given as tensors and must call exactly what `fit` calls, so they need the object.
    """
    return model._compile_loss


@contextlib.contextmanager
def lent_loss(model: keras.Model, compile_loss, losses):
    """Within the block, `model.compute_loss` sees `compile_loss` as its compiled loss
    and `losses` as `model.losses`.

    Private: `Model._compile_loss` and `Layer._losses_override` (the latter is how
    Keras's own JAX trainer hands the losses of a stateless forward pass to
    `compute_loss`). No public API lets `compute_loss` (and a user's override of it)
    run on a forward pass made at given weights (`stateless_call`): `model.losses`
    would read the variables instead of the given weights, and the wrapped model is
    not the model `compile` was called on.
    """
    saved = (model._compile_loss, model._losses_override)
    model._compile_loss = compile_loss
    # `losses` wins only when non-empty (Keras tests the list's truth value).
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._compile_loss, model._losses_override = saved


def loss_tracker(model: keras.Model):
    """The `Mean` metric `fit` reports as "loss".

    Private: `Trainer._loss_tracker`. Keras's own `train_step` updates it; a
    `train_step` override that computes the loss itself has no public way to report
    it under the name "loss" (a second metric named "loss" would clash).
    """
    return model._loss_tracker


def flatten_layers(model: keras.Model):
    """Every layer nested in `model` (not `model` itself), depth first.

    Private: `Layer._flatten_layers`. `model.layers` lists only the direct children,
    and a layer that holds sublayers (a keras-hub TransformerEncoder) has no public
    list of them.
    """
    return list(model._flatten_layers(include_self=False))


def scale_loss_for_distribution(value):
    """Divide a per-replica loss by the replica count exactly as Keras does.

    Private: `keras.src.losses.loss.scale_loss_for_distribution` (not exported). The
    trainers must use Keras's own rule so their losses and gradients have the units
    of `fit`'s.
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.scale_loss_for_distribution(value)


def unscale_loss_for_distribution(value):
    """Undo `scale_loss_for_distribution` (what `fit` logs as "loss").

    Private: `keras.src.losses.loss.unscale_loss_for_distribution` (not exported).
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.unscale_loss_for_distribution(value)


def set_initial_epoch(model: keras.Model, epoch: int | None):
    """The epoch `fit` starts at, as `keras.callbacks.BackupAndRestore` sets it.

    Private: `Trainer._initial_epoch`. Only read here (tests); Keras's own callback
    writes it on restore.
    """
    model._initial_epoch = epoch


@contextlib.contextmanager
def unlocked_state(layer: keras.layers.Layer):
    """Allow `layer.add_weight` on a built layer within the block.

    Private: `Layer._tracker` (lock / unlock; Keras itself unlocks it to quantize a
    built layer). A trainer keeps copies of the wrapped model's weights (slow weights,
    initial weights) whose shapes exist only once the model is built, which for a
    subclassed model happens at its first call, after the trainer is built.
    """
    tracker = getattr(layer, "_tracker", None)
    was_locked = bool(tracker is not None and tracker.locked)
    if was_locked:
        tracker.unlock()
    try:
        yield
    finally:
        if was_locked:
            tracker.lock()


def is_seed_state(variable) -> bool:
    """Whether `variable` is the state of a `keras.random.SeedGenerator` (Dropout's).

    Private: the variable's name, "seed_generator_state" (Keras names it so and does
    not mark it otherwise). Keras's weights files (`save_weights`, `.keras`,
    `BackupAndRestore`) leave these states out, so a restored run would draw other
    dropout masks; the trainers checkpoint them themselves.
    """
    return variable.name == "seed_generator_state"
