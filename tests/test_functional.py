"""The functional core: a model evaluated at given weights == the model with those weights assigned."""
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
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=6, dropout=dropout,
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
        tf.constant(v.numpy() + 0.1 * rng.normal(size=v.shape).astype(v.dtype.name if hasattr(v.dtype, "name") else v.dtype))
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
    for a, b in zip(strategy.experimental_local_results(s_loss), strategy.experimental_local_results(r_loss)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5)
    for g, r in zip(s_grads, r_grads):
        for a, b in zip(strategy.experimental_local_results(g), strategy.experimental_local_results(r)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    # The all-reduced per-replica gradient equals the single-device full-batch gradient.
    single = _sequential() if kind == "sequential" else _bert_classifier(dropout=0.0)
    for v, p in zip(single.trainable_variables, params):
        v.assign(p)
    full_loss_fn = F.make_loss_fn(single, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
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
