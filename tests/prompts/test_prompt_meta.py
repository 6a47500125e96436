"""Prompt-tuning FOMAML / Reptile (algorithms.prompt_meta, trainers.prompt_meta): one
meta-step against hand computations (NumPy, float64) on a linear model with an additive
prompt vector, the carried inner state against a re-derivation, first order, the prompt
selection and argument errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.algorithms import prompt_meta as P
from tf_metaalign.trainers.prompt_meta import (
    PromptFOMAMLTrainer,
    PromptReptileTrainer,
    default_adafactor,
)

TOL = dict(rtol=1e-10, atol=1e-12)
D, OUT, TASKS, T, NS, NQ = 3, 2, 2, 2, 4, 3
A_INNER = 0.25  # exact in float32 (the rules take the learning rate in float32)


@keras.saving.register_keras_serializable(package="tests_prompt_meta")
class Offset(keras.layers.Layer):
    """x + p: a learned input offset (the test's "soft prompt")."""

    def build(self, input_shape):
        self.offset = self.add_weight(
            shape=(input_shape[-1],),
            name="offset",
            initializer=keras.initializers.RandomNormal(seed=3),
        )

    def call(self, x):
        return x + self.offset


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((D,)), Offset(name="prompt"), keras.layers.Dense(OUT, name="dense")]
    )


def _meta_batch(seed=0, steps=T):
    rng = np.random.default_rng(seed)
    sx = rng.normal(size=(TASKS, steps, NS, D))
    sy = rng.normal(size=(TASKS, steps, NS, OUT))
    qx = rng.normal(size=(TASKS, NQ, D))
    qy = rng.normal(size=(TASKS, NQ, OUT))
    return sx, sy, qx, qy


# ------------------------------------------------------------------ NumPy oracle


def _grads(W, c, p, x, y):
    """MSE mean((x + p) W + c - y)^2 over all entries: gradients wrt (W, c, p)."""
    z = x + p
    r = z @ W + c - y
    dfo = 2 * r / r.size
    return z.T @ dfo, dfo.sum(0), (dfo @ W.T).sum(0)


def _loss(W, c, p, x, y):
    return np.mean(((x + p) @ W + c - y) ** 2)


def _adapt_prompt(W, c, p, sx, sy, a=A_INNER):
    for s in range(sx.shape[0]):
        p = p - a * _grads(W, c, p, sx[s], sy[s])[2]
    return p


def _weights(model):
    # trainable order: prompt offset, dense kernel, dense bias
    p, W, c = [v.numpy() for v in model.trainable_variables]
    return W, c, p


def _fit_one_step(trainer, batch, run_eagerly=False):
    sx, sy, qx, qy = batch
    trainer.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.MeanSquaredError(),
        run_eagerly=run_eagerly,
    )
    return trainer.fit((sx, sy, qx), qy, batch_size=TASKS, epochs=1, verbose=0, shuffle=False)


# ------------------------------------------------------------------ hand computations


def test_fomaml_meta_step_equals_hand_computation(float64):
    model = _model()
    W, c, p = _weights(model)
    batch = _meta_batch()
    sx, sy, qx, qy = batch
    trainer = PromptFOMAMLTrainer(model, inner_steps=T, inner_optimizer=O.SGD(A_INNER))
    history = _fit_one_step(trainer, batch)
    gW, gc, gp, qloss, sloss = 0, 0, 0, [], []
    for b in range(TASKS):
        pb = _adapt_prompt(W, c, p, sx[b], sy[b])
        dW, dc, dp = _grads(W, c, pb, qx[b], qy[b])  # transformer weights at phi
        gW, gc, gp = gW + dW / TASKS, gc + dc / TASKS, gp + dp / TASKS
        qloss.append(_loss(W, c, pb, qx[b], qy[b]))
        p_last = _adapt_prompt(W, c, p, sx[b][:-1], sy[b][:-1])
        sloss.append(_loss(W, c, p_last, sx[b][-1], sy[b][-1]))
    W1, c1, p1 = _weights(model)
    np.testing.assert_allclose(W1, W - gW, **TOL)
    np.testing.assert_allclose(c1, c - gc, **TOL)
    np.testing.assert_allclose(p1, p - gp, **TOL)
    np.testing.assert_allclose(history.history["loss"][0], np.mean(qloss), rtol=1e-6)
    np.testing.assert_allclose(history.history["support_loss"][0], np.mean(sloss), rtol=1e-6)


def test_reptile_meta_step_equals_hand_computation(float64):
    model = _model()
    W, c, p = _weights(model)
    batch = _meta_batch(seed=1)
    sx, sy, qx, qy = batch
    trainer = PromptReptileTrainer(model, inner_steps=T, inner_optimizer=O.SGD(A_INNER))
    _fit_one_step(trainer, batch)
    ends = []
    for b in range(TASKS):
        pb = _adapt_prompt(W, c, p, sx[b], sy[b])
        dW, dc, dp = _grads(W, c, pb, qx[b], qy[b])
        ends.append((W - A_INNER * dW, c - A_INNER * dc, pb - A_INNER * dp))  # full step
    # gradient phi - mean_b phi_b; outer SGD(1): phi <- mean_b phi_b
    W1, c1, p1 = _weights(model)
    np.testing.assert_allclose(W1, np.mean([e[0] for e in ends], 0), **TOL)
    np.testing.assert_allclose(c1, np.mean([e[1] for e in ends], 0), **TOL)
    np.testing.assert_allclose(p1, np.mean([e[2] for e in ends], 0), **TOL)


def test_one_support_batch_is_reused_at_every_inner_step(float64):
    """S = 1 (the reference FOMAML config) == the batch repeated T times."""
    batch = _meta_batch(seed=2, steps=1)
    sx, sy, qx, qy = batch
    results = []
    for s_x, s_y in ((sx, sy), (np.repeat(sx, T, 1), np.repeat(sy, T, 1))):
        model = _model()
        _fit_one_step(
            PromptFOMAMLTrainer(model, inner_steps=T, inner_optimizer=O.SGD(A_INNER)),
            (s_x, s_y, qx, qy),
        )
        results.append(_weights(model))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ carried Adafactor state


def _adafactor():
    return default_adafactor(0.05)


# The package's Adafactor rule fails when TRACED on float64 variables with update clipping
# (`tf.maximum(1.0, rms)` in optimizers/adafactor.py makes a float32 constant in a graph):
# the float64 Adafactor tests run eagerly.
EAGER = True


def _fomaml_adafactor_oracle(model, batch, carry):
    """The chain re-derived step by step with NumPy gradients and the package's rule on
    tensors (`apply_on_tensors`): carried = one state through every inner step of every
    task; reset = a fresh state per task."""
    W, c, p = _weights(model)
    sx, sy, qx, qy = batch
    opt = _adafactor()
    prompt_var = [model.trainable_variables[0]]
    state = opt.initial_state(prompt_var)
    g_total = [0, 0, 0]
    for b in range(TASKS):
        if not carry:
            state = opt.initial_state(prompt_var)
        pb = p
        for s in range(T):
            gp = _grads(W, c, pb, sx[b, s], sy[b, s])[2]
            (pb,), state = opt.apply_on_tensors(
                [tf.constant(gp)], [tf.constant(pb)], state, prompt_var
            )
            pb = pb.numpy()
        g = _grads(W, c, pb, qx[b], qy[b])
        g_total = [t + gi / TASKS for t, gi in zip(g_total, g)]
    return (W - g_total[0], c - g_total[1], p - g_total[2]), state


@pytest.mark.parametrize("carry", [True, False])
def test_fomaml_adafactor_state_carried_or_reset_matches_rederivation(float64, carry):
    batch = _meta_batch(seed=3)
    sx, sy, qx, qy = batch
    reference = _model()
    expected, state = _fomaml_adafactor_oracle(reference, batch, carry)
    model = _model()
    trainer = PromptFOMAMLTrainer(
        model, inner_steps=T, inner_optimizer=_adafactor(), carry_inner_state=carry
    )
    _fit_one_step(trainer, batch, run_eagerly=EAGER)
    for got, want in zip(_weights(model), expected):
        np.testing.assert_allclose(got, want, **TOL)
    names = {v.name: v for v in trainer.variables if v.name.startswith("inner_")}
    if carry:
        assert int(names["inner_prompt_iterations"].numpy()) == TASKS * T
        np.testing.assert_allclose(
            names["inner_prompt_v_0"].numpy(), state.slots[0]["v"].numpy(), **TOL
        )
    else:
        assert not names  # nothing carried, nothing stored


def test_carried_and_reset_state_give_different_steps(float64):
    """The carry is not a no-op (so the test above can fail)."""
    batch = _meta_batch(seed=3)
    a, _ = _fomaml_adafactor_oracle(_model(), batch, True)
    b, _ = _fomaml_adafactor_oracle(_model(), batch, False)
    assert np.max(np.abs(a[2] - b[2])) > 1e-4


def test_reptile_carries_prompt_and_other_counts_separately(float64):
    """Prompt: T + 1 updates per task; the other weights: 1 per task (HF counts per
    parameter); the carried state continues into the next meta-batch."""
    model = _model()
    trainer = PromptReptileTrainer(model, inner_steps=T, inner_optimizer=_adafactor())
    sx, sy, qx, qy = _meta_batch(seed=4)
    trainer.compile(
        optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.MeanSquaredError(), run_eagerly=EAGER
    )
    trainer.fit((sx, sy, qx), qy, batch_size=TASKS, epochs=2, verbose=0, shuffle=False)
    names = {v.name: v for v in trainer.variables}
    assert int(names["inner_prompt_iterations"].numpy()) == 2 * TASKS * (T + 1)
    assert int(names["inner_other_iterations"].numpy()) == 2 * TASKS


def test_reptile_adafactor_carried_state_matches_rederivation(float64):
    """Reptile with the paper's Adafactor carried across tasks: the prompt's state takes
    T inner updates and the full step's update (its own count), the other weights' state
    only the full step's; phi <- mean_b phi_b (outer SGD(1))."""
    batch = _meta_batch(seed=8)
    sx, sy, qx, qy = batch
    model = _model()
    W, c, p = _weights(model)
    opt = _adafactor()
    prompt_var, other_vars = model.trainable_variables[:1], model.trainable_variables[1:]
    prompt_state, other_state = opt.initial_state(prompt_var), opt.initial_state(other_vars)

    def step(grads, values, state, variables):
        new, state = opt.apply_on_tensors(
            [tf.constant(g) for g in grads], [tf.constant(v) for v in values], state, variables
        )
        return [n.numpy() for n in new], state

    ends = []
    for b in range(TASKS):
        pb = p
        for s in range(T):
            (pb,), prompt_state = step(
                [_grads(W, c, pb, sx[b, s], sy[b, s])[2]], [pb], prompt_state, prompt_var
            )
        dW, dc, dp = _grads(W, c, pb, qx[b], qy[b])
        (pb,), prompt_state = step([dp], [pb], prompt_state, prompt_var)
        (Wb, cb), other_state = step([dW, dc], [W, c], other_state, other_vars)
        ends.append((Wb, cb, pb))
    expected = [np.mean([e[i] for e in ends], 0) for i in range(3)]

    trainer = PromptReptileTrainer(_model(), inner_steps=T, inner_optimizer=_adafactor())
    _fit_one_step(trainer, batch, run_eagerly=EAGER)
    for got, want in zip(_weights(trainer.model), expected):
        np.testing.assert_allclose(got, want, **TOL)
    names = {v.name: v.numpy() for v in trainer.variables}
    np.testing.assert_allclose(names["inner_prompt_v_0"], prompt_state.slots[0]["v"].numpy(), **TOL)
    # the (3, 2) kernel is factored (HF factors every rank >= 2 variable)
    np.testing.assert_allclose(
        names["inner_other_v_row_0"], other_state.slots[0]["v_row"].numpy(), **TOL
    )
    np.testing.assert_allclose(names["inner_other_v_1"], other_state.slots[1]["v"].numpy(), **TOL)
    assert names["inner_prompt_iterations"] == TASKS * (T + 1)


# ------------------------------------------------------------------ first order


def test_inner_loop_touches_only_the_prompt_and_is_off_the_tape(float64):
    model = _model()
    sx, sy, qx, qy = _meta_batch(seed=5)
    variables = model.trainable_variables
    indices = P.prompt_indices(variables)
    assert indices == (0,)
    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
    params = F.current_params(model)
    batches = [(tf.constant(sx[0, s]), tf.constant(sy[0, s])) for s in range(T)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(params)
        r = P.prompt_inner_loop(
            loss_fn, params, F.current_state(model), batches, indices, O.SGD(A_INNER), variables
        )
        prompt_sum = tf.reduce_sum(r.params[0])
    for before, after in zip(params[1:], r.params[1:]):
        np.testing.assert_array_equal(before.numpy(), after.numpy())
    # First order: the adapted prompt is a constant for an outer tape.
    assert tape.gradient(prompt_sum, params[0]) is None


def test_fomaml_has_no_second_order_term(float64):
    """The prompt gradient is dL_q/dp at p_T (closed form), not (I - a H)^T dL_q/dp."""
    model = _model()
    W, c, p = _weights(model)
    sx, sy, qx, qy = _meta_batch(seed=6)
    loss_fn = F.make_loss_fn(model, keras.losses.MeanSquaredError())
    tasks = [
        (
            [(tf.constant(sx[0, s]), tf.constant(sy[0, s])) for s in range(T)],
            (tf.constant(qx[0]), tf.constant(qy[0])),
        )
    ]
    result = P.prompt_fomaml(
        loss_fn,
        F.current_params(model),
        F.current_state(model),
        tasks,
        (0,),
        O.SGD(A_INNER),
        model.trainable_variables,
    )
    pT = _adapt_prompt(W, c, p, sx[0], sy[0])
    first = _grads(W, c, pT, qx[0], qy[0])[2]
    np.testing.assert_allclose(result.gradients[0].numpy(), first, **TOL)
    # The second-order one differs: the Hessian of the support loss wrt p is 2 W W^T / size.
    jac = np.eye(D)
    for s in range(T):
        jac = (np.eye(D) - A_INNER * 2 * W @ W.T * NS / (NS * OUT)) @ jac
    second = jac.T @ first
    assert np.max(np.abs(second - first)) > 1e-3


# ------------------------------------------------------------------ selection, errors


def test_prompt_selection_forms():
    model = _model()
    variables = model.trainable_variables
    assert P.prompt_indices(variables) == (0,)
    assert P.prompt_indices(variables, [variables[1]]) == (1,)
    assert P.prompt_indices(variables, lambda path: "/dense/" in path) == (1, 2)
    trainer = PromptFOMAMLTrainer(model, prompt_variables="dense/bias")
    assert [v.path for v in trainer.prompt_variables] == [model.name + "/dense/bias"]
    by_variable = PromptFOMAMLTrainer(model, prompt_variables=[variables[2]])
    assert by_variable.get_config()["prompt_variables"] == [2]  # paths change on reload
    assert PromptFOMAMLTrainer(model, prompt_variables=[2]).prompt_variables[0] is variables[2]
    with pytest.raises(ValueError, match="prompt_variables"):
        PromptFOMAMLTrainer(model, prompt_variables=[5])
    with pytest.raises(ValueError, match="prompt_variables"):
        P.prompt_indices(variables, lambda path: False)
    with pytest.raises(ValueError, match="prompt_variables"):
        P.prompt_indices(variables, [keras.Variable(1.0)])


def test_argument_errors():
    model = _model()
    with pytest.raises(ValueError, match="inner_steps"):
        PromptFOMAMLTrainer(model, inner_steps=0)
    with pytest.raises(ValueError, match="inner_optimizer"):
        PromptFOMAMLTrainer(model, inner_optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="carry_inner_state"):
        PromptReptileTrainer(model, carry_inner_state="yes")
    trainer = PromptFOMAMLTrainer(model, inner_steps=3, inner_optimizer=O.SGD(0.1))
    trainer.compile(optimizer="sgd", loss="mse")
    sx, sy, qx, qy = _meta_batch(steps=2)
    with pytest.raises(ValueError, match="inner_steps=3"):
        trainer.fit((sx, sy, qx), qy, batch_size=TASKS, epochs=1, verbose=0)


# ------------------------------------------------------------------ two replicas


@pytest.mark.parametrize("trainer_class", [PromptFOMAMLTrainer, PromptReptileTrainer])
def test_two_replicas_split_the_tasks_and_average_over_all(float64, trainer_class):
    """Each replica adapts its own tasks in the task's units (with SGD, a wrong replica
    factor changes the inner step) and the outer gradient is the mean over all tasks: the
    2-replica step equals the 1-replica hand-checked one (fresh inner state per task)."""
    from conftest import two_cpu_strategy

    batch = _meta_batch(seed=7)
    sx, sy, qx, qy = batch
    results = []
    for strategy in (None, two_cpu_strategy()):
        scope = strategy.scope() if strategy is not None else tf.init_scope()
        with scope:
            model = _model()
            trainer = trainer_class(
                model, inner_steps=T, inner_optimizer=O.SGD(A_INNER), carry_inner_state=False
            )
            trainer.compile(
                optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.MeanSquaredError()
            )
        history = trainer.fit(
            (sx, sy, qx), qy, batch_size=TASKS, epochs=1, verbose=0, shuffle=False
        )
        results.append((_weights(model), history.history))
    (w1, h1), (w2, h2) = results
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, **TOL)
    np.testing.assert_allclose(h2["loss"], h1["loss"], rtol=1e-6)
    np.testing.assert_allclose(h2["support_loss"], h1["support_loss"], rtol=1e-6)
