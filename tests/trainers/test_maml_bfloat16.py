"""`MAMLTrainer` under `mixed_bfloat16` (both backends): the inner loop adapts the float32
master weights, not their bfloat16 casts.

Keras's mixed policy keeps variables in float32 and casts them to bfloat16 at each layer
call; an inner loop that stepped the cast weights would lose every update smaller than
half a bfloat16 ulp (w - lr * g == w when |lr * g| < |w| 2^-9): here lr * g ~ 1e-4 on
weights of ~1 (bfloat16's spacing at 1 is 2^-7). The inner steps, first order (the
trainer's `adapt`, evaluation) and second order (`algorithms.maml.adapt` with the inner
gradients differentiable, the train step's path), must move the weights by lr * g as in
float32, and the learned rates (MAML++'s LSLR) are float32 variables.

(The battery's `maml_pp` bfloat16 check once failed for another reason, which
tests/backend_battery.py's `bn_mlp` explains: a Dense bias before BatchNorm.)
"""

import keras
import numpy as np
import pytest
from backend_battery import dtype_policy

from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.trainers import MAMLTrainer

BACKENDS = ("tensorflow", "jax")

LR = 1e-4  # lr * g ~ 1e-4: below half of bfloat16's spacing (2^-8) at the weights' 1.0


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.ones((3, 2), "float32"), np.ones((2,), "float32")])
    return model


def _support(tasks=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(tasks, 4, 3)).astype("float32")
    return x, np.zeros((tasks, 4, 2), "float32")  # g = d mse / dw ~ 1 (w = 1, y = 0)


def _trainer_step(policy, learn):
    with dtype_policy(policy):
        model = _model()
        trainer = MAMLTrainer(
            model, inner_steps=1, inner_learning_rate=LR, learn_inner_learning_rates=learn
        )
        trainer.compile(optimizer="sgd", loss="mse")
        assert trainer.model_compute_dtype() == policy.replace("mixed_", "")
        assert all(v.dtype == "float32" for v in trainer.trainable_variables)
        theta = [np.asarray(v) for v in model.trainable_variables]
        adapted = trainer.adapt(*_support())
    for task in adapted:
        assert [keras.backend.standardize_dtype(w.dtype) for w in task] == ["float32"] * 2
    return [[t - np.asarray(w) for t, w in zip(theta, task)] for task in adapted]


@pytest.mark.parametrize("learn", ["none", "per_layer_per_step"])
def test_adapt_steps_the_float32_weights(learn):
    """trainer.adapt under mixed_bfloat16: every weight moves, by float32's lr * g."""
    bfloat16, float32 = _trainer_step("mixed_bfloat16", learn), _trainer_step("float32", learn)
    for steps, reference in zip(bfloat16, float32):
        for step, ref in zip(steps, reference):
            assert np.all(np.abs(ref) > 1e-6 * LR)  # float32 moves every weight
            assert np.all(step != 0), f"a bfloat16 inner step lost its update: {step}"
            # the bfloat16 gradient: ~0.4% per product, a few products summed
            np.testing.assert_allclose(step, ref, rtol=0.05)


def test_second_order_inner_loop_keeps_float32_masters():
    """algorithms.maml.adapt, second order (the train step's inner loop): float32
    trajectories, theta_1 = theta - lr * g to float32 rounding (g: the step's recorded
    gradient)."""
    with dtype_policy("mixed_bfloat16"):
        model = _model()
        loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
        x, y = _support()
        theta = F.current_params(model)
        result = M.adapt(
            loss_fn,
            theta,
            F.current_state(model),
            [(x[t], y[t]) for t in range(len(x))],
            [[LR, LR]],
            first_order=False,
        )
    for t, trajectory in enumerate(result.trajectories):
        grads = result.record[0][0]
        task_grads = grads[t] if isinstance(grads[0], (list, tuple)) else [g[t] for g in grads]
        for w0, w1, g in zip(trajectory[0], trajectory[1], task_grads):
            assert keras.backend.standardize_dtype(w1.dtype) == "float32"
            w0, w1, g = np.asarray(w0), np.asarray(w1), np.asarray(g, "float32")
            assert np.all(np.abs(g) > 1e-2), g
            # w0 - w1 in float32 at |w| ~ 1: exact to half an ulp (6e-8); bfloat16: 0
            np.testing.assert_allclose(w0 - w1, LR * g, rtol=1e-6, atol=1.2e-7)
