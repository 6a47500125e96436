"""The functional core: a model evaluated at given weights == the model with them assigned."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from conftest import two_cpu_strategy
from tf_metaalign import functional as F


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.drop = keras.layers.Dropout(0.3)
        self.d2 = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.d2(self.drop(self.d1(x), training=training))


def _sequential():
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )


def _functional_bn_dropout():
    inp = keras.Input((5,))
    h = keras.layers.Dense(8, kernel_regularizer=keras.regularizers.L2(1e-2))(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Dropout(0.4)(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _subclassed():
    m = Subclassed()
    m(np.zeros((2, 5), "float32"))
    return m


def _bert_classifier(dropout=0.2):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=6,
        dropout=dropout,
    )
    inputs = {
        "token_ids": keras.Input((6,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((6,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((6,), dtype="int32", name="padding_mask"),
    }
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


MODELS = {
    "sequential": _sequential,
    "functional_bn_dropout": _functional_bn_dropout,
    "subclassed_dropout": _subclassed,
    "keras_hub_bert": _bert_classifier,
}


def _batch(kind, n=8, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    if kind == "keras_hub_bert":
        x = {
            "token_ids": rng.integers(1, 50, size=(n, 6)).astype("int32"),
            "segment_ids": np.zeros((n, 6), "int32"),
            "padding_mask": np.ones((n, 6), "int32"),
        }
    else:
        x = rng.normal(size=(n, 5)).astype("float32")
    return x, y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _other_weights(model, seed=1):
    rng = np.random.default_rng(seed)
    return [
        tf.constant(
            v.numpy()
            + 0.1
            * rng.normal(size=v.shape).astype(v.dtype.name if hasattr(v.dtype, "name") else v.dtype)
        )
        for v in model.trainable_variables
    ]


def _stateful_loss_and_grads(model, x, y):
    """The reference: assign, then an ordinary stateful call under a tape."""
    with tf.GradientTape() as tape:
        out = model(x, training=True)
        loss = LOSS(y, out) + tf.add_n(model.losses) if model.losses else LOSS(y, out)
    grads = F.densify(tape.gradient(loss, model.trainable_variables))
    return loss, grads, [v.numpy() for v in model.non_trainable_variables]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gradients_at_given_weights_equal_gradients_after_assigning(kind):
    keras.utils.set_random_seed(0)
    model = MODELS[kind]()
    x, y = _batch(kind)
    params = _other_weights(model)
    state = F.current_state(model)
    loss_fn = F.make_loss_fn(model, LOSS)

    loss, grads, (new_state, _) = F.value_and_grad(loss_fn, params, state, (x, y))
    # Nothing was assigned by the stateless evaluation.
    for v, s in zip(model.non_trainable_variables, state):
        np.testing.assert_array_equal(v.numpy(), s.numpy())

    for v, p in zip(model.trainable_variables, params):
        v.assign(p)
    ref_loss, ref_grads, ref_state = _stateful_loss_and_grads(model, x, y)
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5, atol=1e-6)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-6)
    # The returned state is what the stateful call assigned (BN statistics, seeds).
    for s, r in zip(new_state, ref_state):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-5, atol=1e-6)


def test_same_state_gives_same_dropout_mask_and_new_state_gives_another():
    keras.utils.set_random_seed(0)
    model = _subclassed()
    x, y = _batch("subclassed_dropout", n=16)
    loss_fn = F.make_loss_fn(model, LOSS)
    params, state = F.current_params(model), F.current_state(model)
    l1, (s1, _) = loss_fn(params, state, (x, y))
    l2, _ = loss_fn(params, state, (x, y))
    l3, _ = loss_fn(params, s1, (x, y))
    assert l1.numpy() == l2.numpy()
    assert l1.numpy() != l3.numpy()


@pytest.mark.parametrize("kind", ["sequential", "keras_hub_bert"])
def test_gradients_at_given_weights_under_mirrored_strategy(kind):
    strategy = two_cpu_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        # No dropout: the masks of two devices cannot match those of one.
        model = _sequential() if kind == "sequential" else _bert_classifier(dropout=0.0)
    x, y = _batch(kind, n=8)
    params = _other_weights(model)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss_fn = F.make_loss_fn(model, loss_obj)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    dist_batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def stateless(batch):
        def step(b):
            loss, grads, _ = F.value_and_grad(loss_fn, params, F.current_state(model), b)
            return loss, F.all_reduce_sum(grads)

        return strategy.run(step, args=(batch,))

    @tf.function
    def stateful(batch):
        def step(b):
            bx, by = b
            with tf.GradientTape() as tape:
                loss = loss_obj(by, model(bx, training=True))
            grads = F.densify(tape.gradient(loss, model.trainable_variables))
            return loss, F.all_reduce_sum(grads)

        return strategy.run(step, args=(batch,))

    s_loss, s_grads = stateless(dist_batch)
    for v, p in zip(model.trainable_variables, params):
        v.assign(p)
    r_loss, r_grads = stateful(dist_batch)
    for a, b in zip(
        strategy.experimental_local_results(s_loss), strategy.experimental_local_results(r_loss)
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5)
    for g, r in zip(s_grads, r_grads):
        for a, b in zip(
            strategy.experimental_local_results(g), strategy.experimental_local_results(r)
        ):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    # The all-reduced per-replica gradient equals the single-device full-batch gradient.
    single = _sequential() if kind == "sequential" else _bert_classifier(dropout=0.0)
    for v, p in zip(single.trainable_variables, params):
        v.assign(p)
    full_loss_fn = F.make_loss_fn(
        single, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    _, full_grads, _ = F.value_and_grad(full_loss_fn, params, F.current_state(single), (x, y))
    for g, r in zip(s_grads, full_grads):
        np.testing.assert_allclose(
            strategy.experimental_local_results(g)[0].numpy(), r.numpy(), rtol=1e-4, atol=1e-6
        )


def test_gradient_algebra_matches_numpy():
    rng = np.random.default_rng(0)
    a = [rng.normal(size=(3, 4)), rng.normal(size=(5,)), rng.normal(size=())]
    b = [rng.normal(size=(3, 4)), rng.normal(size=(5,)), rng.normal(size=())]
    ta = [tf.constant(x, tf.float64) for x in a]
    tb = [tf.constant(x, tf.float64) for x in b]
    flat_a = np.concatenate([np.ravel(x) for x in a])
    flat_b = np.concatenate([np.ravel(x) for x in b])
    np.testing.assert_allclose(F.dot(ta, tb).numpy(), flat_a @ flat_b, rtol=1e-12)
    np.testing.assert_allclose(F.global_norm(ta).numpy(), np.linalg.norm(flat_a), rtol=1e-12)
    np.testing.assert_allclose(
        F.cosine(ta, tb).numpy(),
        flat_a @ flat_b / np.linalg.norm(flat_a) / np.linalg.norm(flat_b),
        rtol=1e-12,
    )
    for r, x, y in zip(F.axpy(2.0, ta, tb), a, b):
        np.testing.assert_allclose(r.numpy(), 2 * x + y)
    for r, x, y in zip(F.sub(ta, tb), a, b):
        np.testing.assert_allclose(r.numpy(), x - y)
    assert F.cosine(F.zeros_like(ta), tb).numpy() == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        F.dot(ta, tb[:2])


def test_unbuilt_model_gives_clear_error():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built"):
        F.stateless_forward(model, [], [], np.zeros((1, 3), "float32"))


def _bn_model(dtype, image=True, **bn_kwargs):
    keras.utils.set_random_seed(3)
    if image:
        body = [
            keras.Input((6, 6, 2), dtype=dtype),
            keras.layers.Conv2D(4, 3, padding="same", dtype=dtype),
        ]
    else:
        body = [keras.Input((5,), dtype=dtype), keras.layers.Dense(4, dtype=dtype)]
    return keras.Sequential(
        body
        + [
            keras.layers.BatchNormalization(momentum=0.7, dtype=dtype, **bn_kwargs),
            keras.layers.Activation("tanh", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def _bn_problem(dtype, image=True, **bn_kwargs):
    model = _bn_model(dtype, image, **bn_kwargs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 6, 6, 2) if image else (5, 5))
    y = rng.normal(size=(5, 3))
    # Non-trivial statistics, so that the momentum update shows.
    state = [tf.cast(s + 0.5, dtype) for s in F.current_state(model)]
    v = [rng.normal(size=p.shape) for p in model.trainable_variables]
    return model, tf.constant(x, dtype), tf.constant(y, dtype), state, v


def _loss_grad_hvp(model, x, y, state, params, v, exact):
    """(outputs, new state, gradient, Hessian-vector product H v) of a squared loss."""

    def gradient(params):
        with tf.GradientTape() as tape:
            tape.watch(params)
            out, new_state, _ = F.stateless_forward(model, params, state, x, exact_batch_norm=exact)
            loss = tf.reduce_sum(tf.square(out - y))
        return out, new_state, tape.gradient(loss, params)

    with tf.GradientTape() as outer:
        outer.watch(params)
        out, new_state, grads = gradient(params)
        gv = tf.add_n([tf.reduce_sum(g * tf.cast(u, g.dtype)) for g, u in zip(grads, v)])
    return out, new_state, grads, outer.gradient(gv, params), gradient


@pytest.mark.parametrize("image", [True, False], ids=["conv", "dense"])
def test_batch_norm_second_derivatives_equal_finite_differences(float64, image):
    # Float64, so the non-fused exact path: H v equals a central difference of the
    # gradient along v. Keras's own layer (exact_batch_norm=False) does NOT: tf.nn.moments
    # stops the gradient of the mean inside the variance. (If this second assertion ever
    # fails, Keras/TF fixed it and the workaround can go.)
    model, x, y, state, v = _bn_problem("float64", image)
    params = F.current_params(model)
    out, new_state, grads, hvp, gradient = _loss_grad_hvp(model, x, y, state, params, v, True)
    eps = 1e-5
    plus = gradient([p + eps * u for p, u in zip(params, v)])[2]
    minus = gradient([p - eps * u for p, u in zip(params, v)])[2]
    fd = [(a - b) / (2 * eps) for a, b in zip(plus, minus)]
    scale = max(float(tf.reduce_max(tf.abs(f))) for f in fd)
    for h, f in zip(hvp, fd):
        np.testing.assert_allclose(h.numpy(), f.numpy(), rtol=1e-6, atol=1e-7 * scale)
    keras_out, keras_state, keras_grads, keras_hvp, _ = _loss_grad_hvp(
        model, x, y, state, params, v, False
    )
    for a, b in zip([out] + new_state + grads, [keras_out] + keras_state + keras_grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    assert max(float(tf.reduce_max(tf.abs(h - f))) for h, f in zip(keras_hvp, fd)) > 1e-3 * scale


@pytest.mark.parametrize("bn_kwargs", [{}, {"center": False, "scale": False}])
def test_float32_batch_norm_pass_equals_the_float64_one(bn_kwargs):
    # In float32 (computed in float32, statistics cast back as Keras does): outputs, new
    # moving statistics, gradient and H v equal the float64 pass to float32 rounding.
    model32, x, y, state, v = _bn_problem("float32", True, **bn_kwargs)
    model64 = _bn_model("float64", True, **bn_kwargs)
    model64.set_weights([w.astype("float64") for w in model32.get_weights()])
    cast = lambda ts: [tf.cast(t, tf.float64) for t in ts]  # noqa: E731
    want = _loss_grad_hvp(
        model64, cast([x])[0], cast([y])[0], cast(state), F.current_params(model64), v, True
    )[:4]

    got = tf.function(
        lambda: _loss_grad_hvp(model32, x, y, state, F.current_params(model32), v, True)[:4]
    )()
    for got_item, want_item in zip(got, want):  # outputs, state, gradient, H v
        want_item = tf.nest.flatten(want_item)
        scale = max(float(tf.reduce_max(tf.abs(b))) for b in want_item)
        for a, b in zip(tf.nest.flatten(got_item), want_item):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5 * scale)
    assert (
        max(float(tf.reduce_max(tf.abs(a - tf.cast(b, tf.float32)))) for a, b in zip(got[1], state))
        > 0.1
    )  # the statistics moved


def test_exact_batch_norm_leaves_other_passes_to_keras():
    # Inference passes go through Keras's call (bit-identical to the model's own call);
    # the layer's own `call` is back after each pass.
    model, x, _, _, _ = _bn_problem("float32", True)
    layer = model.layers[1]
    params, state = F.current_params(model), F.current_state(model)
    np.testing.assert_array_equal(
        model(x, training=False).numpy(),
        F.stateless_forward(model, params, state, x, training=False)[0].numpy(),
    )
    F.stateless_forward(model, params, state, x, training=True)
    assert "call" not in vars(layer)


def test_traced_once_is_one_function_in_a_graph_and_fn_itself_eagerly_and_under_xla():
    calls = []

    def square(x):
        calls.append(1)  # counts traces (Python runs once per trace)
        return x * x

    assert F.traced_once(square) is square  # eager: nothing to trace
    seen = {}

    @tf.function
    def graph(x):
        fn = F.traced_once(square)
        seen["graph"] = fn
        return fn(x) + fn(x + 1.0) + fn(x + 2.0)

    @tf.function(jit_compile=True)
    def xla(x):
        fn = F.traced_once(square)
        seen["xla"] = fn
        return fn(x) + fn(x + 1.0)

    np.testing.assert_allclose(graph(tf.constant(1.0)).numpy(), 1.0 + 4.0 + 9.0)
    assert seen["graph"] is not square and len(calls) == 1  # three calls, one trace
    calls.clear()
    np.testing.assert_allclose(xla(tf.constant(1.0)).numpy(), 1.0 + 4.0)
    # Under XLA the calls are inlined (nested functions made XLA compile 6x slower).
    assert seen["xla"] is square and len(calls) == 2
