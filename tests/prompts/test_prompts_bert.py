"""Shallow soft prompts on a tiny random keras-hub BertBackbone (tf_metaalign.prompts.bert).

Oracles: the plain backbone (L = 0 equals it bit for bit), a NumPy re-computation of the
embedding sequence `[CLS], prompt, rest` (positions, segments, LayerNorm) from the backbone's
own weights, the attention weights (prompt never masked), bit-exact round trips.
"""

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from conftest import Recorder
from tf_metaalign import prompts
from tf_metaalign.prompts.bert import PromptedBert

L = 3
H = 16


def tiny_bert(seed=0):
    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=H,
        intermediate_dim=32,
        max_sequence_length=16,
        dropout=0.0,
    )


_BUILT = []


@pytest.fixture
def backbone():
    """One backbone for the module (a keras-hub functional build costs seconds on the shared
    CPUs); its weights and trainability are restored after each test."""
    if not _BUILT:
        _BUILT.append(tiny_bert())
    model = _BUILT[0]
    initial = [v.numpy().copy() for v in model.weights]
    yield model
    model.trainable = True
    for v, value in zip(model.weights, initial):
        v.assign(value)


def batch():
    rng = np.random.default_rng(1)
    token_ids = rng.integers(3, 64, (2, 6)).astype("int32")
    token_ids[:, 0] = 2  # [CLS]
    return {
        "token_ids": token_ids,
        "segment_ids": np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], "int32"),
        "padding_mask": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], "int32"),
    }


def as_numpy(outputs):
    return {k: ops.convert_to_numpy(v) for k, v in outputs.items()}


def test_zero_length_prompt_equals_plain_backbone_exactly(backbone):
    x = batch()
    expected = as_numpy(backbone(x))
    got = as_numpy(prompts.prompt_bert(backbone, length=0)(x))
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_train_argument_selects_exactly_the_trainable_set(backbone):
    transformer = {id(v) for v in backbone.weights}
    model = prompts.prompt_bert(backbone, length=L, train="prompt")
    prompt = {id(model.prompt_embeddings)}
    assert {id(v) for v in model.trainable_variables} == prompt
    model.set_train("transformer")
    assert {id(v) for v in model.trainable_variables} == transformer
    model.set_train("both")
    assert {id(v) for v in model.trainable_variables} == transformer | prompt
    assert {id(v) for v in model.weights} == transformer | prompt  # no weight copied


def test_prompt_embeddings_initialised_from_first_vocabulary_rows(backbone):
    table = backbone.token_embedding.embeddings.numpy()
    model = prompts.prompt_bert(backbone, length=L, init_vocabulary_rows=10, seed=4)
    rows = [
        int(np.flatnonzero((table[:10] == p).all(-1))[0]) for p in model.prompt_embeddings.numpy()
    ]
    assert len(set(rows)) == L and max(rows) < 10
    again = prompts.prompt_bert(backbone, length=L, init_vocabulary_rows=10, seed=4)
    np.testing.assert_array_equal(again.prompt_embeddings.numpy(), model.prompt_embeddings.numpy())


def _layer_norm(x, gamma, beta, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def test_cls_kept_first_prompt_after_it_and_real_positions_unchanged(backbone, monkeypatch):
    """The transformer's input, recomputed in NumPy from the backbone's weights:
    LN([tok(CLS)+pos0+seg, p_1+seg0, ..., p_L+seg0, tok(x_1)+pos1+seg, ...])."""
    x = batch()
    model = prompts.prompt_bert(backbone, length=L)
    rec = Recorder(monkeypatch)
    rec.watch("layer0", backbone.transformer_layers[0])
    out = as_numpy(model(x))
    got = ops.convert_to_numpy(rec.last("layer0")[0][0])
    tok = backbone.token_embedding.embeddings.numpy()[x["token_ids"]]
    pos = backbone.position_embedding.position_embeddings.numpy()[:6]
    seg_table = backbone.segment_embedding.embeddings.numpy()
    real = tok + pos[None] + seg_table[x["segment_ids"]]
    prompt = np.broadcast_to(model.prompt_embeddings.numpy() + seg_table[0], (2, L, H))
    sequence = np.concatenate([real[:, :1], prompt, real[:, 1:]], axis=1)
    norm = backbone.embeddings_layer_norm
    expected = _layer_norm(sequence, norm.gamma.numpy(), norm.beta.numpy())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Outputs: prompt positions dropped; the pooled output reads [CLS] at position 0.
    assert out["sequence_output"].shape == (2, 6, H)
    full, _ = model.encode(x["token_ids"], x["segment_ids"], x["padding_mask"])
    full = ops.convert_to_numpy(full)
    np.testing.assert_array_equal(out["sequence_output"][:, 0], full[:, 0])
    np.testing.assert_array_equal(out["sequence_output"][:, 1:], full[:, 1 + L :])
    np.testing.assert_allclose(
        out["pooled_output"],
        np.tanh(
            full[:, 0] @ backbone.pooled_dense.kernel.numpy() + backbone.pooled_dense.bias.numpy()
        ),
        rtol=1e-5,
        atol=1e-6,
    )


def test_padding_mask_extended_and_prompt_never_masked(backbone, monkeypatch):
    x = batch()
    x["padding_mask"] = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], "int32")
    model = prompts.prompt_bert(backbone, length=L)
    _, mask = model.encode(x["token_ids"], x["segment_ids"], x["padding_mask"])
    np.testing.assert_array_equal(
        ops.convert_to_numpy(mask),
        np.concatenate(
            [x["padding_mask"][:, :1], np.ones((2, L), "int32"), x["padding_mask"][:, 1:]], 1
        ),
    )
    rec = Recorder(monkeypatch)
    rec.watch("layer0", backbone.transformer_layers[0])
    model(x)
    # The attention weights of the first layer on the recorded input and padding mask
    # (Keras's MultiHeadAttention may take a fused path that exposes no weights).
    args, kwargs, _ = rec.last("layer0")
    np.testing.assert_array_equal(
        ops.convert_to_numpy(kwargs["padding_mask"]), ops.convert_to_numpy(mask)
    )
    _, weights = backbone.transformer_layers[0](
        args[0], padding_mask=kwargs["padding_mask"], return_attention_scores=True
    )
    weights = ops.convert_to_numpy(weights)  # [B, heads, q, k]
    assert (weights[..., 1 : 1 + L] > 1e-6).all()  # the prompt: attended by every query
    assert (weights[0, ..., 1 + L :] == 0).all()  # row 0: only [CLS] and the prompt are real
    np.testing.assert_allclose(weights[0, ..., : 1 + L].sum(-1), 1.0, rtol=1e-6)


class PooledOutput(prompts.TrainableSelection, keras.Model):
    def __init__(self, prompted):
        super().__init__()
        self.prompted = prompted

    def call(self, x):
        return self.prompted(x)["pooled_output"]


def _fit_a_few_steps(model):
    head = PooledOutput(model)
    head.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    head.fit(batch(), np.ones((2, H), "float32"), batch_size=2, epochs=3, verbose=0)


def test_prompt_only_training_leaves_every_transformer_weight_bit_identical(backbone):
    model = prompts.prompt_bert(backbone, length=L, train="prompt")
    before = [v.numpy().copy() for v in backbone.weights]
    prompt_before = model.prompt_embeddings.numpy().copy()
    _fit_a_few_steps(model)
    for v, b in zip(backbone.weights, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert np.abs(model.prompt_embeddings.numpy() - prompt_before).max() > 1e-4


def test_transformer_only_training_leaves_the_prompt_identical(backbone):
    model = prompts.prompt_bert(backbone, length=L, train="transformer")
    prompt_before = model.prompt_embeddings.numpy().copy()
    kernel_before = backbone.pooled_dense.kernel.numpy().copy()
    _fit_a_few_steps(model)
    np.testing.assert_array_equal(model.prompt_embeddings.numpy(), prompt_before)
    assert np.abs(backbone.pooled_dense.kernel.numpy() - kernel_before).max() > 1e-4


def test_prompt_and_whole_model_round_trip_bit_exactly(backbone, tmp_path):
    x = batch()
    model = prompts.prompt_bert(backbone, length=L, seed=1)
    model.prompt_embeddings.assign(model.prompt_embeddings.numpy() + 0.5)
    path = prompts.save_prompt(model, tmp_path / "bert_prompt.npz")
    other = prompts.prompt_bert(backbone, length=L, seed=2)
    prompts.load_prompt(other, path)
    np.testing.assert_array_equal(other.prompt_embeddings.numpy(), model.prompt_embeddings.numpy())
    model.save(tmp_path / "bert.keras")
    loaded = keras.models.load_model(tmp_path / "bert.keras")
    assert isinstance(loaded, PromptedBert) and loaded.length == L and loaded.train == "prompt"
    assert [id(v) for v in loaded.trainable_variables] == [id(loaded.prompt_embeddings)]
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=b.path)
    expected = as_numpy(model(x))
    for key, value in as_numpy(loaded(x)).items():
        np.testing.assert_array_equal(value, expected[key])


def test_bad_arguments_raise_value_errors(backbone, tmp_path):
    with pytest.raises(ValueError, match="'shallow' for BERT"):
        prompts.prompt_bert(backbone, mode="deep")
    with pytest.raises(ValueError, match="length"):
        prompts.prompt_bert(backbone, length=-2)
    with pytest.raises(ValueError, match="train"):
        prompts.prompt_bert(backbone, train="all")
    with pytest.raises(ValueError, match="init_vocabulary_rows"):
        prompts.prompt_bert(backbone, init_vocabulary_rows=0)
    with pytest.raises(ValueError, match="BertBackbone"):
        prompts.prompt_bert(keras.Sequential([keras.layers.Dense(2)]))
    path = prompts.save_prompt(prompts.prompt_bert(backbone, length=L), tmp_path / "p")
    with pytest.raises(ValueError, match="length=3 but the model expects length=4"):
        prompts.load_prompt(prompts.prompt_bert(backbone, length=L + 1), path)
    with np.load(path) as data:  # the same file claiming to be a T5 prompt
        arrays = dict(data)
    arrays["__prompt_metadata__"] = np.asarray(
        str(arrays["__prompt_metadata__"]).replace('"bert"', '"t5"')
    )
    np.savez(tmp_path / "t5.npz", **arrays)
    with pytest.raises(ValueError, match="architecture='t5'"):
        prompts.load_prompt(prompts.prompt_bert(backbone, length=L), tmp_path / "t5.npz")


def test_prompt_only_fit_under_two_replicas_equals_one_device(backbone):
    """MirroredStrategy (two logical CPUs): Keras divides the mean loss by the replica
    count and sums the replicas' gradients, so the trained prompt equals one device's."""
    from conftest import two_cpu_strategy

    x, y = batch(), np.linspace(-1, 1, 2 * H).reshape(2, H).astype("float32")

    def train(scope_backbone):
        model = prompts.prompt_bert(scope_backbone, length=L, train="prompt", seed=5)
        head = PooledOutput(model)
        head.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        head.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False)
        return model.prompt_embeddings.numpy()

    expected = train(backbone)
    with two_cpu_strategy().scope():
        replicated = tiny_bert()
        replicated.set_weights([v.numpy() for v in backbone.weights])
        got = train(replicated)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert (
        np.abs(
            expected - prompts.prompt_bert(backbone, length=L, seed=5).prompt_embeddings.numpy()
        ).max()
        > 1e-4
    )  # it trained
