"""Soft prompts on a tiny random keras-hub T5Backbone (tf_metaalign.prompts.t5).

Oracles: the plain backbone (L = 0 must equal it bit for bit), a NumPy re-computation of
every attention block's weights from the layer's own weights (prefix never masked, no
position bias), a NumPy log-softmax of `T5Seq2SeqLM`'s logits, and bit-exact round trips.
"""

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from conftest import Recorder
from test_prompts_backends import PromptedLMHead
from tf_metaalign import prompts
from tf_metaalign.prompts import storage
from tf_metaalign.prompts.t5 import PromptedT5

L = 3


def tiny_t5(seed=0, tie=True, hidden_dim=16):
    """T5Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, ...)."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.T5Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=hidden_dim,
        intermediate_dim=32,
        key_value_dim=8,
        dropout=0.0,
        tie_embedding_weights=tie,
    )


_BUILT = {}


def shared_t5(tie=True):
    """One backbone per configuration for the whole module: building a keras-hub T5
    functional model costs ~4 s on the shared CPUs. The `backbone` fixture restores its
    weights and trainability after each test."""
    if tie not in _BUILT:
        _BUILT[tie] = tiny_t5(tie=tie)
    return _BUILT[tie]


@pytest.fixture
def backbone():
    yield from _restored(shared_t5(tie=True))


@pytest.fixture
def untied_backbone():
    yield from _restored(shared_t5(tie=False))


def _restored(model):
    initial = [v.numpy().copy() for v in model.weights]
    yield model
    model.trainable = True
    for v, value in zip(model.weights, initial):
        v.assign(value)


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "encoder_token_ids": rng.integers(2, 64, (2, 5)).astype("int32"),
        "encoder_padding_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "int32"),
        "decoder_token_ids": rng.integers(2, 64, (2, 4)).astype("int32"),
        "decoder_padding_mask": np.array([[1, 1, 1, 1], [1, 1, 1, 0]], "int32"),
    }


def as_numpy(outputs):
    return {k: ops.convert_to_numpy(v) for k, v in outputs.items()}


def all_attentions(backbone):
    """(name, T5MultiHeadAttention) for every attention block, encoder then decoder."""
    blocks = [
        (f"encoder{i}.self", layer.self_attention)
        for i, layer in enumerate(backbone.encoder_transformer_layers)
    ]
    for i, layer in enumerate(backbone.decoder_transformer_layers):
        blocks += [
            (f"decoder{i}.self", layer.self_attention),
            (f"decoder{i}.cross", layer.cross_attention),
        ]
    return blocks


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_zero_length_prompt_equals_plain_backbone_exactly(backbone, mode):
    x = batch()
    expected = as_numpy(backbone(x))
    got = as_numpy(prompts.prompt_t5(backbone, length=0, mode=mode)(x))
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_train_argument_selects_exactly_the_trainable_set(backbone, mode):
    transformer_ids = {id(v) for v in backbone.weights}
    model = prompts.prompt_t5(backbone, length=L, mode=mode, train="prompt")
    prompt_ids = {id(v) for v in model.prompt_variables}
    assert len(prompt_ids) == (1 if mode == "shallow" else 3)
    assert {id(v) for v in model.trainable_variables} == prompt_ids
    model.set_train("transformer")
    assert {id(v) for v in model.trainable_variables} == transformer_ids
    model.set_train("both")
    assert {id(v) for v in model.trainable_variables} == transformer_ids | prompt_ids
    # The layers are the backbone's own objects: no copy of any weight.
    assert {id(v) for v in model.weights} == transformer_ids | prompt_ids


def _fit_a_few_steps(model):
    lm = PromptedLMHead(model)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = batch()
    y = np.roll(x["decoder_token_ids"], -1, axis=1)
    lm.fit(x, y, batch_size=2, epochs=3, verbose=0)


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_prompt_only_training_leaves_every_transformer_weight_bit_identical(backbone, mode):
    model = prompts.prompt_t5(backbone, length=L, mode=mode, train="prompt")
    before = [v.numpy().copy() for v in backbone.weights]
    prompt_before = [v.numpy().copy() for v in model.prompt_variables]
    _fit_a_few_steps(model)
    for v, b in zip(backbone.weights, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    for v, b in zip(model.prompt_variables, prompt_before):
        assert np.abs(v.numpy() - b).max() > 1e-4, v.path


def test_transformer_only_training_leaves_the_prompt_identical(backbone):
    model = prompts.prompt_t5(backbone, length=L, mode="deep", train="transformer")
    before = [v.numpy().copy() for v in backbone.trainable_weights]
    prompt_before = [v.numpy().copy() for v in model.prompt_variables]
    _fit_a_few_steps(model)
    for v, b in zip(model.prompt_variables, prompt_before):
        np.testing.assert_array_equal(v.numpy(), b)
    moved = [np.abs(v.numpy() - b).max() > 0 for v, b in zip(backbone.trainable_weights, before)]
    assert sum(moved) >= len(moved) - 2  # all but possibly unused bias rows move


def test_stateless_forward_at_given_prompt_equals_assigning_it(backbone):
    """What the prompt FOMAML/Reptile inner loops need: the model at GIVEN prompt tensors
    (tf_metaalign.functional.stateless_forward; the transformer is the non-trainable state
    when train="prompt") equals the model with those values assigned."""
    from tf_metaalign import functional

    x = batch()
    model = prompts.prompt_t5(backbone, length=L, mode="deep", train="prompt")
    params = [v.numpy() + 0.5 for v in model.trainable_variables]
    state = functional.current_state(model)
    assert len(state) == len(backbone.weights)
    outputs, _, _ = functional.stateless_forward(model, params, state, x, training=False)
    for v, value in zip(model.trainable_variables, params):
        v.assign(value)
    for key, value in as_numpy(model(x)).items():
        np.testing.assert_array_equal(ops.convert_to_numpy(outputs[key]), value)


def _record_plain_pass(backbone, monkeypatch, x):
    """A Recorder on every attention block (`all_attentions`' names) and on the first
    encoder layer ("encoder0.input"), after the plain backbone's pass on x."""
    rec = Recorder(monkeypatch)
    for name, attention in all_attentions(backbone):
        rec.watch(name, attention)
    rec.watch("encoder0.input", backbone.encoder_transformer_layers[0])
    backbone(x)
    return rec


def test_deep_prompt_changes_every_attention_block_but_not_the_input(backbone, monkeypatch):
    x = batch()
    rec = _record_plain_pass(backbone, monkeypatch, x)
    plain = {
        name: ops.convert_to_numpy(rec.last(name)[2][0]) for name, _ in all_attentions(backbone)
    }
    plain_input = ops.convert_to_numpy(rec.last("encoder0.input")[0][0])
    prompts.prompt_t5(backbone, length=L, mode="deep")(x)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(rec.last("encoder0.input")[0][0]), plain_input
    )
    for name, _ in all_attentions(backbone):
        out = ops.convert_to_numpy(rec.last(name)[2][0])
        assert out.shape == plain[name].shape
        assert np.abs(out - plain[name]).min(axis=-1).max() > 1e-3, name


def test_shallow_prompt_changes_only_the_encoder_input(backbone, monkeypatch):
    x = batch()
    rec = _record_plain_pass(backbone, monkeypatch, x)
    plain_input = ops.convert_to_numpy(rec.last("encoder0.input")[0][0])
    plain_decoder_self = ops.convert_to_numpy(rec.last("decoder0.self")[2][0])
    plain_cross = ops.convert_to_numpy(rec.last("decoder0.cross")[2][0])
    model = prompts.prompt_t5(backbone, length=L, mode="shallow")
    model(x)
    # The input: the prompt rows, then the plain token embeddings unchanged.
    prompted_input = ops.convert_to_numpy(rec.last("encoder0.input")[0][0])
    np.testing.assert_array_equal(
        prompted_input[:, :L], np.broadcast_to(model.prompt_embeddings.numpy(), (2, L, 16))
    )
    np.testing.assert_array_equal(prompted_input[:, L:], plain_input)
    # No block gets parameters of its own: the first decoder self-attention, which sees
    # only the decoder input, is unchanged bit for bit; what reads the encoder changes.
    np.testing.assert_array_equal(
        ops.convert_to_numpy(rec.last("decoder0.self")[2][0]), plain_decoder_self
    )
    prompted_cross = ops.convert_to_numpy(rec.last("decoder0.cross")[2][0])
    assert np.abs(prompted_cross - plain_cross).max() > 1e-3
    assert [v.name for v in model.prompt_variables] == ["prompt_embeddings"]


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def test_deep_prefix_attention_weights_equal_numpy_no_mask_no_position_bias(backbone, monkeypatch):
    """Every attention block's weights, recomputed in NumPy: the L prefix columns hold
    exp(q . p_k) with NO position bias and are never masked (also for padded-out encoders,
    all real tokens but one padded, and under the decoder's causal mask). float32 model,
    float64 NumPy: the bias values are ~0.25, far above the 1e-5 tolerance."""
    x = batch()
    x["encoder_padding_mask"] = np.array([[0, 0, 1, 0, 0], [1, 1, 1, 0, 0]], "int32")
    model = prompts.prompt_t5(backbone, length=L, mode="deep")
    rec = Recorder(monkeypatch)
    for name, attention in all_attentions(backbone):
        rec.watch(name, attention)
        rec.watch(name + ".weights", attention.dropout_layer)
    model(x)
    heads, d = 2, 8
    prefixes = {
        "encoder": model.encoder_self_prefix.numpy(),
        "decoder.self": model.decoder_self_prefix.numpy(),
        "decoder.cross": model.decoder_cross_prefix.numpy(),
    }
    enc_mask, dec_mask = x["encoder_padding_mask"], x["decoder_padding_mask"]
    S, T = enc_mask.shape[1], dec_mask.shape[1]
    enc_bias = ops.convert_to_numpy(
        backbone.encoder_transformer_layers[0].self_attention.compute_bias(S, S)
    )[0]
    dec_bias = ops.convert_to_numpy(
        backbone.decoder_transformer_layers[0].self_attention.compute_bias(T, T)
    )[0]
    encoder_output = None
    for name, attention in all_attentions(backbone):
        stack, kind = name.split(".")
        layer_index = int(stack[-1])
        args, kwargs, _ = rec.last(name)
        hidden = ops.convert_to_numpy(args[0])
        q = (hidden @ attention.query_projector.kernel.numpy()).reshape(2, -1, heads, d)
        if kind == "cross":
            encoder_output = ops.convert_to_numpy(kwargs["key_value_states"])
            kv_input, bias, allowed = encoder_output, 0.0, enc_mask[:, None, :]
            table = prefixes["decoder.cross"]
        elif stack.startswith("encoder"):
            allowed = np.broadcast_to(enc_mask[:, None, :], (2, S, S))
            kv_input, bias = hidden, enc_bias
            table = prefixes["encoder"]
        else:
            causal = np.tril(np.ones((T, T), bool))
            kv_input, bias, allowed = hidden, dec_bias, causal[None] & (dec_mask[:, None, :] > 0)
            table = prefixes["decoder.self"]
        k = (kv_input @ attention.key_projector.kernel.numpy()).reshape(2, -1, heads, d)
        prefix = table.reshape(L, 2, 2, heads, d)[:, layer_index]  # [L, layers, k/v, h, d]
        prefix_key = prefix[:, 0]
        real = np.einsum("bqnd,bknd->bnqk", q, k) + bias
        real = np.where(np.asarray(allowed, bool)[:, None], real, real - 1e9)
        on_prefix = np.einsum("bqnd,knd->bnqk", q, prefix_key)  # no bias, no mask
        expected = _softmax(np.concatenate([on_prefix, real], axis=-1))
        got = ops.convert_to_numpy(rec.last(name + ".weights")[0][0])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
        assert (got[..., :L] > 0).all(), name  # the prefix is never masked
    # The encoder row with one real token: everything but prefix + that token is zero.
    enc_weights = ops.convert_to_numpy(rec.last("encoder0.self.weights")[0][0])[0]
    assert np.all(enc_weights[..., L + np.array([0, 1, 3, 4])] == 0.0)
    np.testing.assert_allclose(
        enc_weights[..., :L].sum(-1) + enc_weights[..., L + 2], 1.0, rtol=1e-6
    )


def test_shallow_prompt_positions_are_unmasked_and_masks_extended(backbone, monkeypatch):
    x = batch()
    x["encoder_padding_mask"] = np.array([[0, 0, 1, 0, 0], [1, 1, 1, 0, 0]], "int32")
    model = prompts.prompt_t5(backbone, length=L, mode="shallow")
    hidden, mask = model.encode(x["encoder_token_ids"], x["encoder_padding_mask"])
    assert hidden.shape == (2, L + 5, 16)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(mask),
        np.concatenate([np.ones((2, L), "int32"), x["encoder_padding_mask"]], 1),
    )
    rec = Recorder(monkeypatch)
    rec.watch("w", backbone.encoder_transformer_layers[0].self_attention.dropout_layer)
    out = as_numpy(model(x))
    assert out["encoder_sequence_output"].shape == (2, 5, 16)  # prompt positions dropped
    np.testing.assert_array_equal(
        out["encoder_sequence_output"], ops.convert_to_numpy(hidden)[:, L:]
    )
    weights = ops.convert_to_numpy(rec.last("w")[0][0])[0]  # first row: one real token
    assert (weights[..., :L] > 1e-6).all()
    assert (weights[..., L + np.array([0, 1, 3, 4])] < 1e-30).all()


@pytest.mark.parametrize("tie", [True, False])
def test_token_log_likelihoods_equal_log_softmax_of_t5seq2seqlm_logits(
    backbone, untied_backbone, tie
):
    backbone = backbone if tie else untied_backbone
    x = batch()
    target = np.array([[5, 9, 12, 1], [7, 3, 1, 0]], "int32")
    target_mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], "int32")
    model = prompts.prompt_t5(backbone, length=0)
    got = ops.convert_to_numpy(
        prompts.t5_token_log_likelihoods(
            model, x["encoder_token_ids"], x["encoder_padding_mask"], target, target_mask
        )
    )
    lm = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    decoder_ids = np.concatenate([np.zeros((2, 1), "int32"), target[:, :-1]], 1)
    decoder_mask = np.concatenate([np.ones((2, 1), "int32"), target_mask[:, :-1]], 1)
    logits = ops.convert_to_numpy(
        lm(
            {
                "encoder_token_ids": x["encoder_token_ids"],
                "encoder_padding_mask": x["encoder_padding_mask"],
                "decoder_token_ids": decoder_ids,
                "decoder_padding_mask": decoder_mask,
            }
        )
    )
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs = log_probs - np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_probs, target[..., None], -1)[..., 0] * target_mask
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[1, 3] == 0.0


def test_greedy_generation_is_the_argmax_of_teacher_forced_logits(backbone):
    x = batch()
    model = prompts.prompt_t5(backbone, length=L, mode="deep")
    generated = prompts.t5_generate(
        model, x["encoder_token_ids"], x["encoder_padding_mask"], max_length=6, end_token_id=1
    )
    assert generated.shape == (2, 6)
    hidden, mask = model.encode(x["encoder_token_ids"], x["encoder_padding_mask"])
    decoder_ids = prompts.shift_right(generated)
    logits = ops.convert_to_numpy(
        model.lm_logits(model.decode(hidden, mask, decoder_ids, np.ones_like(generated)))
    )
    for row in range(2):
        ended = np.flatnonzero(generated[row] == 1)
        stop = ended[0] + 1 if len(ended) else 6
        np.testing.assert_array_equal(generated[row, :stop], logits[row, :stop].argmax(-1))
        assert (generated[row, stop:] == 0).all()


def test_zero_length_greedy_generation_equals_t5seq2seqlm_cached_greedy(backbone):
    x = batch()
    lm = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    max_length = 6
    decoder_ids = np.zeros((2, max_length + 1), "int32")  # the start token, then room
    decoder_mask = np.zeros((2, max_length + 1), "int32")
    decoder_mask[:, 0] = 1
    inputs = {
        "encoder_token_ids": x["encoder_token_ids"],
        "encoder_padding_mask": x["encoder_padding_mask"],
        "decoder_token_ids": decoder_ids,
        "decoder_padding_mask": decoder_mask,
    }
    expected = lm.generate_step(inputs, stop_token_ids=None)
    expected = ops.convert_to_numpy(expected["decoder_token_ids"])[:, 1:]
    got = prompts.t5_generate(
        prompts.prompt_t5(backbone, length=0),
        x["encoder_token_ids"],
        x["encoder_padding_mask"],
        max_length=max_length,
        end_token_id=None,
    )
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_prompt_saved_and_loaded_alone_bit_exactly(backbone, tmp_path, mode):
    source = prompts.prompt_t5(backbone, length=L, mode=mode, seed=1)
    path = prompts.save_prompt(source, tmp_path / "prompt")
    assert path.endswith(".npz")
    target = prompts.prompt_t5(backbone, length=L, mode=mode, seed=2)
    assert not np.array_equal(
        target.prompt_variables[0].numpy(), source.prompt_variables[0].numpy()
    )
    prompts.load_prompt(target, path)
    for a, b in zip(target.prompt_variables, source.prompt_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = batch()
    for key, value in as_numpy(source(x)).items():
        np.testing.assert_array_equal(as_numpy(target(x))[key], value)
    with np.load(path) as data:  # only the prompt
        assert sorted(data) == sorted(
            [v.name for v in source.prompt_variables] + [storage._METADATA_KEY]
        )


def test_prompt_file_mismatches_raise_clear_errors(backbone, tmp_path):
    model = prompts.prompt_t5(backbone, length=L, mode="shallow")
    path = prompts.save_prompt(model, tmp_path / "p.npz")
    with pytest.raises(ValueError, match="length"):
        prompts.load_prompt(prompts.prompt_t5(backbone, length=L + 1), path)
    with pytest.raises(ValueError, match="mode"):
        prompts.load_prompt(prompts.prompt_t5(backbone, length=L, mode="deep"), path)
    # A prompt of another hidden size (same architecture, mode and length): the file as a
    # hidden_dim=32 backbone's prompt would be written.
    with np.load(path) as data:
        arrays = dict(data)
    arrays["prompt_embeddings"] = np.zeros((L, 32), "float32")
    np.savez(tmp_path / "wide.npz", **arrays)
    with pytest.raises(ValueError, match=r"shape \(3, 32\).*\(3, 16\)"):
        prompts.load_prompt(model, tmp_path / "wide.npz")
    np.savez(tmp_path / "other.npz", prompt_embeddings=np.zeros((L, 16)))
    with pytest.raises(ValueError, match="not a prompt file"):
        prompts.load_prompt(model, tmp_path / "other.npz")
    with pytest.raises(ValueError, match="prompted model"):
        prompts.save_prompt(backbone, tmp_path / "q.npz")


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_whole_model_keras_file_round_trips_bit_exactly(backbone, tmp_path, mode):
    model = prompts.prompt_t5(backbone, length=L, mode=mode, train="both", seed=3)
    for v in model.prompt_variables:  # not the initial value: a trained prompt
        v.assign(v.numpy() + 0.25)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, PromptedT5) and loaded.mode == mode and loaded.length == L
    assert len(loaded.weights) == len(model.weights)
    for a, b in zip(loaded.weights, model.weights):
        assert a.shape == b.shape  # (unnamed keras-hub sublayers get new auto names)
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=b.path)
    assert len(loaded.trainable_variables) == len(model.trainable_variables)
    x = batch()
    for key, value in as_numpy(model(x)).items():
        np.testing.assert_array_equal(as_numpy(loaded(x))[key], value)


def test_bad_arguments_raise_value_errors(backbone):
    with pytest.raises(ValueError, match="mode"):
        prompts.prompt_t5(backbone, mode="medium")
    with pytest.raises(ValueError, match="length"):
        prompts.prompt_t5(backbone, length=-1)
    with pytest.raises(ValueError, match="train"):
        prompts.prompt_t5(backbone, train="decoder")
    with pytest.raises(ValueError, match="T5Backbone"):
        prompts.prompt_t5(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="max_length"):
        prompts.t5_generate(
            prompts.prompt_t5(backbone, length=1),
            np.ones((1, 2), "int32"),
            np.ones((1, 2), "int32"),
            max_length=0,
        )
