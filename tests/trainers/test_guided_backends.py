"""GuidedTrainer on both backends (backend-neutral: no TensorFlow import).

* TensorFlow == JAX at float64 (golden files written on TensorFlow, `golden_io`): the
  trajectory (weights, optimizer slots and counters, learned raw values, meta-optimizer
  slots, guided counters, logged hypergradients and guidance losses) from the same weights
  on the same batches, for learning-rate and beta_1 guidance with Adam and SGD (momentum:
  its beta_1), Adam recomputing the update in `apply_gradients` every 2nd step, and the
  reference preset (`reference="gradient_based_tuning"`) with flax's Adam and LAMB and the
  meta-gradient clip.
* Oracles on the running backend: the hypergradient of one update (`algorithms.guided.
  hypergradients`: forward-mode Duals on TensorFlow, `jax.jvp` on JAX) against a float64
  central difference of the guidance loss after that update; the reference preset against
  the NumPy re-derivation of the paper's code (tests/guided_oracles.py).
* JAX: 1 device == 2 devices (`keras.distribution.DataParallel`).
* The trainer declares both backends; an optimizer it cannot differentiate gives the same
  error on both.

About 20 s in either env on 2 loaded cores.
"""

import keras
import numpy as np
import pytest
from backends import data_parallel, requires_jax
from golden_io import check_golden, set_numpy_weights
from guided_oracles import BASE_LR, META_LR, N_TRAIN, STEPS, problem, reference_trajectory
from guided_oracles import flax_lamb as ref_flax_lamb
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.algorithms import guided as alg
from tf_metaalign.optimizers import flax_reference
from tf_metaalign.trainers import GuidedHyperparameters, GuidedTrainer

BACKENDS = ("tensorflow", "jax")


def _np(x):
    return np.asarray(ops.convert_to_numpy(x), dtype="float64")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 4))
    y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] - 0.5 * x[:, 3]], axis=-1)
    return x[:32], y[:32], x[32:], y[32:]


def _mlp(seed=0):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)]
    )
    set_numpy_weights(model, seed=200 + seed)
    return model


class _Record(keras.callbacks.Callback):
    def __init__(self, keys):
        super().__init__()
        self.keys, self.rows = keys, []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([float(np.asarray(logs[k])) for k in self.keys])


def _state(trainer):
    """Every number the step carries from one step to the next."""
    arrays = {f"w{i}": _np(v) for i, v in enumerate(trainer.model.trainable_variables)}
    optimizer = trainer.optimizer
    for i, v in enumerate(trainer.model.trainable_variables):
        for k, slot in optimizer.slots_for(v).items():
            arrays[f"slot{i}_{k}"] = _np(slot)
    arrays["iterations"] = _np(optimizer.iterations)
    arrays["learning_rate_scale"] = _np(optimizer.learning_rate_scale)
    for k, v in optimizer.hyperparameter_variables.items():
        arrays[f"opt_{k}"] = _np(v)
    guided = trainer.guided
    for n in guided.names:
        arrays[f"raw_{n}"] = _np(guided.raw[n])
        for k, v in guided.meta_slots[n].items():
            arrays[f"meta_{n}_{k}"] = _np(v)
    for name in ("guided_steps", "nonfinite_hypergrads"):
        arrays[name] = _np(getattr(guided, name))
    arrays["schedule_count"] = _np(guided.steps)
    return arrays


CASES = {
    # name: (optimizer, trainer keywords)
    "adam_lr_beta1": (lambda: O.Adam(0.05), {}),
    "sgd_momentum_lr_beta1": (lambda: O.SGD(0.1, momentum=0.9), {}),
    "adam_recomputed_every2": (
        lambda: O.Adam(0.05, beta_2=0.99),
        {"commit_forward_update": False, "guidance_every": 2},
    ),
    "reference_flaxadam_clip": (
        lambda: O.Adam(0.05, epsilon=1e-6),
        {"reference": alg.REFERENCE, "meta_gradient_clip": 0.02},
    ),
    "reference_flaxlamb": (
        lambda: flax_reference.FlaxLamb(0.02),
        {"reference": alg.REFERENCE, "meta_gradient_clip": 1.0},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_guided_tensorflow_equals_jax(float64, case):
    make_optimizer, kwargs = CASES[case]
    x, y, xg, yg = _data()
    trainer = GuidedTrainer(
        _mlp(), guidance_data=(xg, yg), meta_optimizer=O.Adam(META_LR), **kwargs
    )
    trainer.compile(make_optimizer(), loss="mse")
    if kwargs.get("reference"):
        assert isinstance(trainer.optimizer, flax_reference._FlaxOptimizer)
        assert isinstance(trainer.guided.meta_optimizer, flax_reference.FlaxAdam)
    keys = ["loss", "guidance_loss", "hypergrad_learning_rate", "hypergrad_beta_1", "beta_1"]
    record = _Record(keys)
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    arrays = _state(trainer)
    arrays["logs"] = np.array(record.rows)
    assert int(arrays["iterations"]) == 8
    assert float(arrays["raw_learning_rate"]) != 0.0  # the values moved
    # atol: beta_1's first hypergradient is 0 in exact arithmetic (Adam's m_hat = g at
    # step 1 whatever beta_1); the backends' rounding leaves +-1e-17 there.
    golden = check_golden(f"guided_{case}", arrays, atol=1e-14)
    assert abs(golden["logs"][0, 3]) < 1e-15
    assert np.abs(golden["logs"][:, 2]).max() > 1e-6  # nonzero hypergradients


def _fit_state(case, epochs=1):
    make_optimizer, kwargs = CASES[case]
    x, y, xg, yg = _data()
    trainer = GuidedTrainer(
        _mlp(), guidance_data=(xg, yg), meta_optimizer=O.Adam(META_LR), **kwargs
    )
    trainer.compile(make_optimizer(), loss="mse")
    trainer.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return _state(trainer)


@requires_jax
@pytest.mark.parametrize(
    "case", ["adam_lr_beta1", pytest.param("reference_flaxlamb", marks=pytest.mark.slow)]
)
def test_one_device_equals_two_on_jax(float64, case):
    one = _fit_state(case)
    with data_parallel(2):
        two = _fit_state(case)
    assert set(one) == set(two)
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-9, atol=1e-14, err_msg=key)


# ------------------------------------------------------------ the hypergradient oracle


def _one_update_problem(make_optimizer, seed=0):
    x, y, xg, yg = _data(seed)
    model = _mlp(seed)
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    mse = keras.losses.MeanSquaredError()
    train_loss = F.make_loss_fn(model, mse, training=True)
    guide_loss = F.make_loss_fn(model, mse, training=False)
    params, state = F.current_params(model), F.current_state(model)
    rng = np.random.default_rng(seed + 1)
    # nonzero slots, as after some steps: beta_1 then acts through m's history
    slots = [
        {k: ops.convert_to_tensor(rng.uniform(0.0, 0.1, size=tuple(p.shape))) for k in s}
        for p, s in zip(params, [optimizer.rule.slot_shapes(tuple(p.shape), {}) for p in params])
    ]
    _, grads, _ = F.value_and_grad(train_loss, params, state, (x, y, None))
    options = [optimizer.options_for(v) for v in model.trainable_variables]
    base = optimizer.current_hyperparameters()
    return dict(
        rule=optimizer.rule, grads=grads, params=params, slots=slots, options=options,
        base=base, state=state, batch=(xg, yg, None), loss=guide_loss,
    )  # fmt: skip


def _guide_loss_after_update(p, raw, reference):
    hparams = alg.hyperparameters_from_raw(p["base"], raw, reference=reference)
    new = [
        p["rule"].update(g, w, s, hparams, 3.0, o)[0]
        for g, w, s, o in zip(p["grads"], p["params"], p["slots"], p["options"])
    ]
    return float(_np(p["loss"](new, p["state"], p["batch"])[0]))


@pytest.mark.parametrize(
    "make_optimizer, names, reference",
    [
        (lambda: O.Adam(0.05), ("learning_rate", "beta_1"), False),
        (lambda: O.SGD(0.1, momentum=0.9), ("learning_rate", "momentum"), False),
        (lambda: flax_reference.FlaxAdam(0.05), ("learning_rate", "beta_1"), True),
        (lambda: flax_reference.FlaxLamb(0.02), ("learning_rate", "beta_1"), True),
    ],
    ids=["adam", "sgd_momentum", "flax_adam", "flax_lamb"],
)
def test_hypergradient_equals_central_difference(float64, make_optimizer, names, reference):
    p = _one_update_problem(make_optimizer)
    point = {"learning_rate": 0.3, names[1]: 1.7}
    raw = {n: ops.convert_to_tensor(np.float64(v)) for n, v in point.items()}
    result = alg.hypergradients(
        p["loss"], p["rule"], p["grads"], p["params"], p["slots"], p["options"], p["base"],
        raw, 3.0, p["state"], p["batch"], reference=reference,
    )  # fmt: skip
    # theta_{t+1} is the rule's own update at these values
    hparams = alg.hyperparameters_from_raw(p["base"], raw, reference=reference)
    for got, g, w, s, o in zip(
        result.new_params, p["grads"], p["params"], p["slots"], p["options"]
    ):
        np.testing.assert_allclose(_np(got), _np(p["rule"].update(g, w, s, hparams, 3.0, o)[0]))
    d = 1e-6
    for name in names:
        up, down = dict(point), dict(point)
        up[name] += d
        down[name] -= d
        fd = (
            _guide_loss_after_update(p, {k: np.float64(v) for k, v in up.items()}, reference)
            - _guide_loss_after_update(p, {k: np.float64(v) for k, v in down.items()}, reference)
        ) / (2 * d)
        h = float(_np(result.hypergradients[name]))
        assert abs(h) > 1e-4, name  # not a vacuous zero
        assert h == pytest.approx(fd, rel=1e-6, abs=1e-10), name


# ------------------------------------------------------ the reference preset's oracle


def _linear_trajectory(optimizer, clip=None):
    x, y, xg, yg, w, b = problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.layers[0].kernel.assign(w[:, None])
    model.layers[0].bias.assign(np.array([b]))
    trainer = GuidedTrainer(
        model, guidance_data=(xg, yg[:, None]), meta_optimizer=flax_reference.FlaxAdam(META_LR),
        reference=alg.REFERENCE, meta_gradient_clip=clip,
    )  # fmt: skip
    trainer.compile(optimizer, loss="mse")
    record = _Record(["hypergrad_learning_rate", "hypergrad_beta_1"])
    trainer.fit(
        x, y[:, None], batch_size=N_TRAIN, epochs=STEPS, shuffle=False, verbose=0,
        callbacks=[record],
    )  # fmt: skip
    params = [_np(model.layers[0].kernel)[:, 0], _np(model.layers[0].bias)[0]]
    return params, trainer.learned_values(), record.rows


@pytest.mark.parametrize("rule, clip", [("adam", None), ("adam", 2e-3), ("lamb", None)])
def test_reference_preset_reproduces_the_papers_arithmetic(float64, rule, clip):
    if rule == "adam":
        ours = _linear_trajectory(flax_reference.FlaxAdam(BASE_LR, epsilon=1e-6), clip)
        ref = reference_trajectory(eps=1e-6, clip=clip)
    else:
        ours = _linear_trajectory(flax_reference.FlaxLamb(BASE_LR), clip)
        ref = reference_trajectory(clip=clip, model_rule=ref_flax_lamb)
    (params, values, rows), (rparams, rvalues, rhs) = ours, ref
    for a, e in zip(params, rparams):
        np.testing.assert_allclose(a, e, rtol=1e-9)
    for k in rvalues:
        assert values[k] == pytest.approx(rvalues[k], rel=1e-9)
    for row, rh in zip(rows, rhs):
        # the central difference is good to ~1e-9
        assert row[0] == pytest.approx(rh["learning_rate"], rel=1e-6, abs=1e-12)
        assert row[1] == pytest.approx(rh["beta_1"], rel=1e-6, abs=1e-12)
    if clip:
        assert max(abs(row[0]) for row in rows) == pytest.approx(clip)  # the clip acted


# ------------------------------------------------------------------ construction


def test_declares_both_backends():
    assert GuidedTrainer.backends == ("tensorflow", "jax")


def test_unsupported_optimizer_is_the_same_clear_error_on_both():
    _, _, xg, yg = _data()
    trainer = GuidedTrainer(_mlp(), guidance_data=(xg, yg))
    with pytest.raises(ValueError, match=r"GuidedTrainer.compile: guided learning .* not this"):
        trainer.compile("rmsprop", loss="mse")
    with pytest.raises(ValueError, match=r"Supported: .*Adam.*SGD"):
        trainer.compile(keras.optimizers.Adam(amsgrad=True), loss="mse")
    with pytest.raises(ValueError, match=r"must be one of tf_metaalign.optimizers: .*Adam"):
        GuidedHyperparameters().bind(keras.optimizers.RMSprop())
    with pytest.raises(ValueError, match="`meta_optimizer`"):
        GuidedTrainer(_mlp(), guidance_data=(xg, yg), meta_optimizer=keras.optimizers.Adagrad())
    with pytest.raises(ValueError, match="`reference`"):
        GuidedTrainer(_mlp(), guidance_data=(xg, yg), reference="flax")


class _PythonFloatRule(O.SGDRule):
    """SGD reading its learning rate as a Python float: no derivative on either backend
    (a Dual, or a JAX tracer, has no value to convert)."""

    def update(self, grad, var, slots, hparams, step, options=None):
        return super().update(
            grad, var, slots, {"learning_rate": float(hparams["learning_rate"])}, step, options
        )


def test_a_rule_without_forward_mode_is_refused_on_both():
    optimizer = O.SGD(0.1)
    assert O.forward_mode_error(optimizer) is None
    optimizer._rule = _PythonFloatRule()
    reason = O.forward_mode_error(optimizer)
    assert reason is not None and "SGD's rule has no forward-mode derivative" in reason
    _, _, xg, yg = _data()
    trainer = GuidedTrainer(_mlp(), guidance_data=(xg, yg))
    with pytest.raises(ValueError, match=r"in forward mode .* does not support: SGD's rule"):
        trainer.compile(optimizer, loss="mse")
