"""Prompt FOMAML and prompt Reptile on both backends (backend-neutral: no TensorFlow import).

* TensorFlow == JAX at float64: each trainer's trajectory over 3 meta-batches (the model's
  weights, the carried inner optimizer state, the outer optimizer's variables, the logged
  losses), from the same weights (NumPy draws) on the same batches, against golden files
  written on TensorFlow (`golden_io`); with the inner state carried and reset, and on a
  tiny keras-hub GPT-2 with a soft prompt (`prompt_causal_lm`, train="both").
* A NumPy oracle of the first FOMAML meta-step (both backends).
* JAX: 1 device == 2 devices (`keras.distribution.DataParallel`).
"""

import keras
import numpy as np
import pytest
from backends import data_parallel, on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops
from prompt_precision import exact_gelu, float64_attention_softmax  # noqa: F401 (fixtures)

EXACT_GELU = pytest.mark.usefixtures("exact_gelu")  # see prompt_precision

from tf_metaalign import optimizers as O
from tf_metaalign.trainers import PromptFOMAMLTrainer, PromptReptileTrainer

BACKENDS = ("tensorflow", "jax")

TOL = dict(rtol=1e-10, atol=1e-12)
D, OUT, TASKS, T, NS, NQ = 3, 2, 4, 2, 4, 3
A_INNER = 0.25


class Offset(keras.layers.Layer):
    """x + p: a learned input offset (the test's "soft prompt")."""

    def build(self, input_shape):
        self.offset = self.add_weight(shape=(input_shape[-1],), name="offset")

    def call(self, x):
        return x + self.offset


def _model(seed=0):
    model = keras.Sequential(
        [keras.Input((D,)), Offset(name="prompt"), keras.layers.Dense(OUT, name="dense")]
    )
    set_numpy_weights(model, seed=20 + seed)
    return model


def _data(steps=3, seed=0, support_steps=T):
    rng = np.random.default_rng(seed)
    n = TASKS * steps
    sx = rng.normal(size=(n, support_steps, NS, D))
    sy = rng.normal(size=(n, support_steps, NS, OUT))
    qx = rng.normal(size=(n, NQ, D))
    qy = rng.normal(size=(n, NQ, OUT))
    return (sx, sy, qx), qy


def _np(values):
    return [np.asarray(ops.convert_to_numpy(v), "float64") for v in values]


def _trajectory(trainer, x, y, batch_size=TASKS):
    history = trainer.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    out = {}
    for i, v in enumerate(_np(trainer.model.trainable_variables)):
        out[f"weights_{i}"] = v
    inner = [v for v in trainer.variables if "inner_" in v.path]
    for i, v in enumerate(_np(inner)):
        out[f"inner_{i}"] = v
    for i, v in enumerate(_np(trainer.optimizer.variables)):
        out[f"optimizer_{i}"] = v
    out["loss"] = np.asarray(history.history["loss"])
    out["support_loss"] = np.asarray(history.history["support_loss"])
    out["outer_steps"] = np.asarray(_np([trainer.outer_steps])[0])
    return out


def _fomaml(carry):
    trainer = PromptFOMAMLTrainer(
        _model(1), inner_steps=T, inner_optimizer=O.Adam(0.05), carry_inner_state=carry
    )
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return trainer


def _reptile(carry):
    trainer = PromptReptileTrainer(
        _model(2),
        inner_steps=T,
        inner_optimizer=O.SGD(0.1, momentum=0.5),
        carry_inner_state=carry,
    )
    # The package's Adam: its betas are exact in float64 on both backends.
    trainer.compile(optimizer=O.Adam(0.01), loss="mse")
    return trainer


CASES = {
    "fomaml_carried": lambda: _fomaml(True),
    "fomaml_reset": lambda: _fomaml(False),
    "reptile_carried": lambda: _reptile(True),
    "reptile_reset": lambda: _reptile(False),
}


def test_trainers_declare_both_backends():
    assert PromptFOMAMLTrainer.backends == ("tensorflow", "jax")
    assert PromptReptileTrainer.backends == ("tensorflow", "jax")


@pytest.mark.parametrize("case", sorted(CASES))
def test_trajectory_equals_tensorflow(float64, case):
    trainer = CASES[case]()
    x, y = _data()
    check_golden(f"prompt_meta_{case}", _trajectory(trainer, x, y), **TOL)


def test_fomaml_first_step_equals_numpy(float64):
    """Per task: T inner SGD steps on the prompt p; the outer gradient is the mean over the
    tasks of the query gradients of (W, c, p) at the adapted prompt."""
    trainer = PromptFOMAMLTrainer(_model(3), inner_steps=T, inner_optimizer=O.SGD(A_INNER))
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    p, W, c = _np(trainer.model.trainable_variables)
    (sx, sy, qx), qy = _data(steps=1)

    def grads(W, c, p, x, y):
        z = x + p
        r = z @ W + c - y
        d = 2 * r / r.size
        return z.T @ d, d.sum(0), (d @ W.T).sum(0)

    total = [np.zeros_like(W), np.zeros_like(c), np.zeros_like(p)]
    for t in range(TASKS):
        q = p
        for s in range(T):
            q = q - A_INNER * grads(W, c, q, sx[t, s], sy[t, s])[2]
        total = [a + b / TASKS for a, b in zip(total, grads(W, c, q, qx[t], qy[t]))]
    trainer.fit((sx, sy, qx), qy, batch_size=TASKS, epochs=1, shuffle=False, verbose=0)
    got_p, got_W, got_c = _np(trainer.model.trainable_variables)
    np.testing.assert_allclose(got_W, W - total[0], **TOL)
    np.testing.assert_allclose(got_c, c - total[1], **TOL)
    np.testing.assert_allclose(got_p, p - total[2], **TOL)


def _prompted_gpt2():
    pytest.importorskip("keras_hub")

    from tf_metaalign import prompts
    from tiny_backbones import tiny_backbone

    backbone = tiny_backbone("gpt2", vocabulary_size=16, num_layers=1)
    model = prompts.prompt_causal_lm(backbone, length=2, mode="deep", train="both", seed=5)
    set_numpy_weights(model, seed=30, scale=0.3)
    return model


@pytest.mark.slow  # 12 s on JAX
@EXACT_GELU
def test_prompt_reptile_on_a_prompted_gpt2_equals_tensorflow(float64):
    """The paper's setting in miniature: the inner loop adapts the deep prefix only, the
    outer step moves the prefix and the transformer."""
    model = _prompted_gpt2()
    trainer = PromptReptileTrainer(model, inner_steps=2, inner_optimizer=O.SGD(0.5))
    trainer.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(4)
    tasks, n, s = 2 * 2, 2, 4

    def tokens(*shape):
        return {
            "token_ids": rng.integers(2, 16, shape + (s,)).astype("int32"),
            "padding_mask": np.ones(shape + (s,), "int32"),
        }

    support_x = tokens(tasks, 2, n)
    support_y = rng.integers(2, 16, (tasks, 2, n, s)).astype("int32")
    query_x = tokens(tasks, n)
    query_y = rng.integers(2, 16, (tasks, n, s)).astype("int32")
    backbone_before = _np(model.backbone.weights)
    out = _trajectory(trainer, (support_x, support_y, query_x), query_y, batch_size=2)
    moved = [np.abs(a - b).max() > 0 for a, b in zip(_np(model.backbone.weights), backbone_before)]
    assert any(moved)  # train="both": the outer step moves the transformer too
    check_golden("prompt_meta_reptile_gpt2", out, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "case", ["fomaml_carried", pytest.param("reptile_carried", marks=pytest.mark.slow)]
)
def test_one_device_equals_two_on_jax(float64, case):
    if not on_jax():
        pytest.skip("keras.distribution on JAX (TensorFlow: tests/prompts/test_prompt_meta.py)")
    x, y = _data(steps=2)
    one = _trajectory(CASES[case](), x, y)
    with data_parallel(2):
        two = _trajectory(CASES[case](), x, y)
    for key in one:
        np.testing.assert_allclose(two[key], one[key], err_msg=key, **TOL)
