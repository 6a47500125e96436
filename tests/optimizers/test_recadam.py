"""RecAdam beyond the optimizer battery (whose NumPy oracle re-derives the reference's
step, tests/optimizers/test_optimizers.py::oracle_recadam): the pretrained slot, the annealing,
the warning, Adam as a special case, fit (also under XLA) and bad input."""

import warnings

import keras
import numpy as np
import pytest

from tf_metaalign import optimizers as O
from tf_metaalign.trainers import MultiTaskTrainer


def test_reference_defaults_warn_that_lambda_is_constant_one_half():
    with pytest.warns(UserWarning, match=r"anneal_k = anneal_t0 = 0 give 0.5"):
        O.RecAdam(1e-5)
    np.testing.assert_allclose(
        [float(O.anneal_lambda("sigmoid", t, 0.0, 0.0, 1.0)) for t in (1, 10, 1000)], 0.5
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        O.RecAdam(1e-5, anneal_k=0.1, anneal_t0=100)  # no warning
        O.RecAdam(1e-5, anneal_fun="constant")


def test_anneal_lambda_follows_the_reference_functions():
    t = np.arange(1.0, 30.0)
    sig = [float(O.anneal_lambda("sigmoid", s, 0.2, 10, 0.9)) for s in t]
    np.testing.assert_allclose(sig, 0.9 / (1 + np.exp(-0.2 * (t - 10))), rtol=1e-15)
    lin = [float(O.anneal_lambda("linear", s, 0.0, 8, 0.7)) for s in t]
    np.testing.assert_allclose(lin, np.minimum(1, t / 8) * 0.7, rtol=1e-15)
    assert float(O.anneal_lambda("constant", 5.0, 0.0, 0.0, 0.3)) == 0.3


def test_pretrained_slot_is_the_value_at_build_and_never_changes():
    v = keras.Variable(np.array([1.0, -2.0, 3.0], "float32"), name="w")
    opt = O.RecAdam(0.05, anneal_k=1.0, anneal_t0=2, pretrain_cof=2.0)
    for _ in range(4):
        opt.apply_gradients([(np.array([0.5, 0.5, -1.0], "float32"), v)])
    np.testing.assert_array_equal(opt.slots_for(v)["pretrained"].numpy(), [1.0, -2.0, 3.0])
    assert not np.allclose(v.numpy(), [1.0, -2.0, 3.0])
    # tensor step: initial_state takes the pretrained weights from the variables too
    state = O.RecAdam(0.05, anneal_k=1.0).initial_state([v])
    np.testing.assert_array_equal(state.slots[0]["pretrained"].numpy(), v.numpy())


def test_pull_toward_pretrained_weights_with_zero_gradient():
    # g = 0: the Adam part is 0, w - w* shrinks by (1 - lr (anneal_w - lambda) cof) per step.
    v = keras.Variable(np.array([2.0, -1.0], "float64"), name="w")
    opt = O.RecAdam(0.1, anneal_k=0.5, anneal_t0=3, pretrain_cof=1.0, epsilon=1e-8)
    opt.build([v])
    v.assign([3.0, 1.0])  # moved away from w* = (2, -1)
    dist = np.array([1.0, 2.0])
    for t in range(1, 4):
        opt.apply_gradients([(np.zeros(2), v)])
        lam = 1 / (1 + np.exp(-0.5 * (t - 3)))
        dist = dist * (1 - 0.1 * (1 - lam) * 1.0)
    # (Keras keeps the learning rate in float32: 0.1 is off by 1.5e-9 relative)
    np.testing.assert_allclose(v.numpy() - [2.0, -1.0], dist, rtol=1e-7)


def test_anneal_w_zero_is_keras_adam():
    a = keras.Variable(np.linspace(-1, 1, 6).reshape(2, 3).astype("float32"))
    b = keras.Variable(np.linspace(-1, 1, 6).reshape(2, 3).astype("float32"))
    ours = O.RecAdam(0.01, anneal_w=0.0, epsilon=1e-7, pretrain_cof=1e6)
    theirs = keras.optimizers.Adam(0.01, epsilon=1e-7)
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = rng.normal(size=(2, 3)).astype("float32")
        ours.apply_gradients([(g, a)])
        theirs.apply_gradients([(g, b)])
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_excluded_variables_are_keras_adam_and_the_others_are_pulled():
    """The reference's new-weights group (anneal_w = 0): a head excluded by path takes
    plain Adam steps while the pretrained body is still pulled toward its start."""
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="body"), keras.layers.Dense(1, name="head")]
    )
    ours = O.RecAdam(
        0.01,
        epsilon=1e-7,
        anneal_k=0.5,
        anneal_t0=3,
        pretrain_cof=5.0,
        exclude_from_recall=["head"],
    )
    theirs = keras.optimizers.Adam(0.01, epsilon=1e-7)
    twin = [keras.Variable(v.numpy()) for v in model.trainable_variables]
    start = [v.numpy() for v in model.trainable_variables]
    assert [
        ours_opt["recall"]
        for ours_opt in map(lambda v: ours.variable_options(v), model.trainable_variables)
    ] == [True, True, False, False]
    rng = np.random.default_rng(0)
    for _ in range(5):
        grads = [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
        ours.apply_gradients(zip(grads, model.trainable_variables))
        theirs.apply_gradients(zip(grads[2:], twin[2:]))
    head, twin_head = model.trainable_variables[2:], twin[2:]
    for a, b in zip(head, twin_head):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    # The body gets exactly what RecAdam without exclusions gives it, which is not Adam's.
    body_twin = [keras.Variable(v) for v in start[:2]]
    adam_twin = [keras.Variable(v) for v in start[:2]]
    reference = O.RecAdam(0.01, epsilon=1e-7, anneal_k=0.5, anneal_t0=3, pretrain_cof=5.0)
    adam = keras.optimizers.Adam(0.01, epsilon=1e-7)
    rng = np.random.default_rng(0)
    for _ in range(5):
        grads = [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
        reference.apply_gradients(zip(grads[:2], body_twin))
        adam.apply_gradients(zip(grads[:2], adam_twin))
    for a, b, c in zip(model.trainable_variables[:2], body_twin, adam_twin):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
        assert np.max(np.abs(a.numpy() - c.numpy())) > 1e-3
    assert O.RecAdam.from_config(ours.get_config()).exclude_from_recall_patterns == ("head",)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_keeps_the_initial_weights_as_pretrained(jit_compile):
    """The slot is assigned once at build, also when the optimizer is built while a
    (possibly XLA) train step is traced (MultiTaskTrainer builds it in finish_step)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    initial = [v.numpy() for v in model.trainable_variables]
    trainer = MultiTaskTrainer(model, num_tasks=2, method="pcgrad")
    opt = O.RecAdam(0.05, anneal_k=0.5, anneal_t0=3, pretrain_cof=1.0)
    trainer.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x = {
        "inputs": rng.normal(size=(16, 3)).astype("float32"),
        "task_id": (np.arange(16) % 2).astype("int32"),
    }
    trainer.fit(x, rng.normal(size=(16, 2)).astype("float32"), batch_size=4, epochs=2, verbose=0)
    for v, w0 in zip(model.trainable_variables, initial):
        np.testing.assert_array_equal(opt.slots_for(v)["pretrained"].numpy(), w0)
        assert not np.allclose(v.numpy(), w0)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(anneal_fun="cosine"), "anneal_fun"),
        (dict(anneal_fun="linear", anneal_t0=0), "anneal_t0"),
        (dict(anneal_k=float("nan")), "anneal_k"),
        (dict(anneal_t0="late", anneal_k=1.0), "anneal_t0"),
        (dict(anneal_w=-1.0, anneal_k=1.0), "anneal_w"),
        (dict(pretrain_cof=-5.0, anneal_k=1.0), "pretrain_cof"),
        (dict(correct_bias="yes", anneal_k=1.0), "correct_bias"),
        (dict(beta_1=1.0, anneal_k=1.0), "beta_1"),
        (dict(weight_decay_rate=-0.1, anneal_k=1.0), "weight_decay_rate"),
    ],
)
def test_bad_input_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        O.RecAdam(1e-3, **kwargs)
