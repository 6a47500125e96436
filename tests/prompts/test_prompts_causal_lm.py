"""Soft prompts for keras-hub decoder LMs (tf_metaalign.prompts.causal_lm) on tiny random
GPT-2, Gemma and Llama (grouped-query attention) backbones built from configs.

Oracles: keras-hub's own CausalLM (L = 0: the same logits, the same generation), a NumPy
re-derivation of every decoder layer with the prefix prepended to its keys/values (GPT-2:
learned positions; Llama: rotary positions and GQA), the backbone reading the init text
first (a text-initialised prompt must equal it), full forward passes step by step
(generation with the cache), closed forms (the registered slice_update gradient), and
optionally Hugging Face's PyTorch GPT-2 given the prefix as `past_key_values`.
"""

import itertools
import sys

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from conftest import Recorder
from tiny_backbones import tiny_backbone
from tf_metaalign import prompts
from tf_metaalign.prompts import causal_lm as C
from tf_metaalign.prompts import evaluation as ev
from tf_metaalign.prompts.templates import PromptedExample

L = 3
V = 32
FAMILIES = ("gpt2", "gemma", "llama")
MODES = ("shallow", "deep")


def _slow_except(cases, *default):
    """`cases` for `pytest.mark.parametrize`: those in `default` run in the default suite,
    the others under -m slow (each builds, traces and runs keras-hub models)."""
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        params.append(case if case in default else pytest.param(*values, marks=pytest.mark.slow))
    return params


def tiny(family, seed=0):
    keras.utils.set_random_seed(seed)
    return tiny_backbone(family, vocabulary_size=V)


LM_CLASS = {
    "gpt2": keras_hub.models.GPT2CausalLM,
    "gemma": keras_hub.models.GemmaCausalLM,
    "llama": keras_hub.models.LlamaCausalLM,
}
_BUILT = {}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def backbone(family):
    """One backbone per family for the module, weights and trainability restored."""
    model = shared(family)
    initial = [v.numpy().copy() for v in model.weights]
    yield model
    model.trainable = True
    for v, value in zip(model.weights, initial):
        v.assign(value)


def shared(family):
    if family not in _BUILT:
        _BUILT[family] = tiny(family)
    return _BUILT[family]


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "token_ids": rng.integers(2, V, (2, 5)).astype("int32"),
        "padding_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "int32"),
    }


def numpy(x):
    return ops.convert_to_numpy(x)


# ------------------------------------------------------------------ plain equivalence


@pytest.mark.parametrize("mode", MODES)
def test_zero_length_prompt_equals_the_plain_causal_lm(backbone, family, mode):
    x = batch()
    expected = numpy(LM_CLASS[family](backbone=backbone, preprocessor=None)(x))
    got = numpy(prompts.prompt_causal_lm(backbone, length=0, mode=mode)(x))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_text_initialised_prompt_equals_reading_the_text_first(backbone, family, mode):
    """A prompt initialised from token ids (PEFT's TEXT init; for a deep prefix the keys and
    values the backbone computes for them) is, before training, the backbone reading those
    tokens before the input: same positions (learned / rotary), same mask, same heads."""
    text = [7, 11, 13]
    x = batch()
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, init=text)
    got = numpy(model(x))
    joined = {
        "token_ids": np.concatenate([np.tile(text, (2, 1)), x["token_ids"]], 1),
        "padding_mask": np.concatenate([np.ones((2, L), "int32"), x["padding_mask"]], 1),
    }
    plain = numpy(LM_CLASS[family](backbone=backbone, preprocessor=None)(joined))[:, L:]
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    assert np.abs(got - numpy(prompts.prompt_causal_lm(backbone, length=0)(x))).max() > 1e-3


def test_text_init_repeats_and_truncates_as_peft(backbone, family):
    table = backbone.token_embedding.embeddings.numpy()
    if family == "gemma":  # the rows as Gemma's first layer reads them (see _token_embeddings)
        table = table * np.sqrt(np.float32(backbone.hidden_dim))
    model = prompts.prompt_causal_lm(backbone, length=5, init=[4, 9])
    np.testing.assert_array_equal(model.prompt_variables[0].numpy(), table[[4, 9, 4, 9, 4]])

    class Tokenizer:
        def __call__(self, text):
            return [len(word) for word in text.split()]

    model = prompts.prompt_causal_lm(backbone, length=2, init="a bbb cc", tokenizer=Tokenizer())
    np.testing.assert_array_equal(model.prompt_variables[0].numpy(), table[[1, 3]])
    assert model.init == [1, 3]  # saved in the config as ids


# ------------------------------------------------------------------ what trains


@pytest.mark.parametrize("mode", MODES)
def test_train_argument_selects_exactly_the_trainable_set(mode):
    backbone = tiny("gpt2")
    transformer = {id(v) for v in backbone.weights}
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, reparameterize=True)
    prompt = {id(v) for v in model.prompt_variables}
    assert len(prompt) == (7 if mode == "shallow" else 5)  # embedding + MLP kernels/biases
    assert all(v.path.split("/")[-1].startswith("prompt") for v in model.prompt_variables)
    assert {id(v) for v in model.trainable_variables} == prompt
    model.set_train("transformer")
    assert {id(v) for v in model.trainable_variables} == transformer
    model.set_train("both")
    assert {id(v) for v in model.trainable_variables} == transformer | prompt
    assert {id(v) for v in model.weights} == transformer | prompt  # no weight copied


def _fit(model, epochs=3):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    x = batch()
    y = np.roll(x["token_ids"], -1, axis=1)
    model.fit(x, y, sample_weight=x["padding_mask"], batch_size=2, epochs=epochs, verbose=0)


@pytest.mark.parametrize(
    "family,mode",
    _slow_except(itertools.product(FAMILIES, MODES), ("gpt2", "shallow"), ("llama", "deep")),
)
def test_prompt_only_training_leaves_every_backbone_weight_bit_identical(backbone, mode):
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, train="prompt")
    before = [v.numpy().copy() for v in backbone.weights]
    prompt_before = model.prompt_variables[0].numpy().copy()
    _fit(model)
    for v, b in zip(backbone.weights, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert np.abs(model.prompt_variables[0].numpy() - prompt_before).max() > 1e-4


def test_transformer_only_training_leaves_the_prompt_identical():
    backbone = tiny("llama")
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep", train="transformer")
    before = [v.numpy().copy() for v in backbone.trainable_weights]
    prompt_before = model.prompt_variables[0].numpy().copy()
    _fit(model, epochs=1)
    np.testing.assert_array_equal(model.prompt_variables[0].numpy(), prompt_before)
    moved = [np.abs(v.numpy() - b).max() > 0 for v, b in zip(backbone.trainable_weights, before)]
    assert sum(moved) == len(moved)


@pytest.mark.parametrize("mode", _slow_except(MODES, "deep"))
def test_reparameterised_prompt_trains_its_mlp_and_folds_to_the_same_model(mode):
    backbone = tiny("llama")
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, reparameterize=True)
    before = [v.numpy().copy() for v in model.prompt_variables]
    _fit(model, epochs=1)
    assert all(np.abs(v.numpy() - b).max() > 0 for v, b in zip(model.prompt_variables, before))
    x = batch()
    folded = model.fold_reparameterization()
    assert not folded.reparameterize and len(folded.prompt_variables) == 1
    np.testing.assert_allclose(numpy(folded(x)), numpy(model(x)), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ NumPy oracle


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * gamma + beta


def _rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def _rotary(x, start, wavelength=10000.0):
    """HF/keras-hub rotate-half RoPE of x [B, n, heads, d] at positions start.. ."""
    d = x.shape[-1]
    inverse = wavelength ** (-np.arange(0, d, 2) / d)
    angle = (start + np.arange(x.shape[1]))[:, None] * inverse[None]  # [n, d/2]
    cos = np.cos(np.concatenate([angle, angle], -1))[None, :, None]
    sin = np.sin(np.concatenate([angle, angle], -1))[None, :, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _attention(q, keys, values, allowed, scale):
    """q [B, S, h, d]; keys/values [B, L + S, h_kv, d] (the prefix first); GQA: query head
    j reads key/value head j // (h / h_kv)."""
    group = q.shape[2] // keys.shape[2]
    keys, values = np.repeat(keys, group, axis=2), np.repeat(values, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, keys) * scale
    scores = np.where(allowed[:, None], scores, -1e9)
    return np.einsum("bhqk,bkhd->bqhd", _softmax(scores), values)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _dense(layer, x):
    kernel = layer.kernel.numpy().astype(np.float64)
    out = np.tensordot(x, kernel, axes=1)
    bias = getattr(layer, "bias", None)
    return out if bias is None else out + bias.numpy()


def _gpt2_layer(layer, x, prefix_k, prefix_v, allowed):
    attention = layer._self_attention_layer
    norm = layer._self_attention_layer_norm
    h = _layer_norm(x, norm.gamma.numpy(), norm.beta.numpy())
    q, k, v = (
        _dense(d, h) for d in (attention._query_dense, attention._key_dense, attention._value_dense)
    )
    keys = np.concatenate([prefix_k, k], 1)
    values = np.concatenate([prefix_v, v], 1)
    out = _attention(q, keys, values, allowed, 1 / np.sqrt(q.shape[-1]))
    out = np.tensordot(out, attention._output_dense.kernel.numpy(), axes=2)
    x = x + out + attention._output_dense.bias.numpy()
    norm = layer._feedforward_layer_norm
    h = _layer_norm(x, norm.gamma.numpy(), norm.beta.numpy())
    h = _gelu_tanh(_dense(layer._feedforward_intermediate_dense, h))
    return x + _dense(layer._feedforward_output_dense, h)


def _llama_layer(layer, x, prefix_k, prefix_v, allowed, start):
    attention = layer._self_attention_layer
    h = _rms_norm(x, layer._self_attention_layernorm.scale.numpy())
    q = _rotary(_dense(attention._query_dense, h), start)
    k = _rotary(_dense(attention._key_dense, h), start)
    v = _dense(attention._value_dense, h)
    keys = np.concatenate([prefix_k, k], 1)  # the prefix: post-rotary, as a cache holds keys
    values = np.concatenate([prefix_v, v], 1)
    out = _attention(q, keys, values, allowed, 1 / np.sqrt(q.shape[-1]))
    x = x + np.tensordot(out, attention._output_dense.kernel.numpy(), axes=2)
    h = _rms_norm(x, layer._feedforward_layernorm.scale.numpy())
    gate = _dense(layer._feedforward_gate_dense, h)
    gate = gate / (1 + np.exp(-gate))
    return x + _dense(
        layer._feedforward_output_dense, _dense(layer._feedforward_intermediate_dense, h) * gate
    )


@pytest.mark.parametrize("family_name", ["gpt2", "llama"])
def test_deep_prefix_equals_numpy_attention_with_prepended_keys_values(family_name, monkeypatch):
    """Every decoder layer's output recomputed in float64 NumPy from its input, its own
    weights and the prefix prepended to its keys/values: never masked, visible to every
    query, the text at positions L.. (GPT-2's learned embeddings L..L+S-1 at the input;
    Llama's rotary L..), Llama's 2 key/value heads each serving 2 query heads."""
    backbone = tiny(family_name, seed=2)
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep", seed=4)
    model.prompt_variables[0].assign(model.prompt_variables[0].numpy() * 0.5)
    x = batch()
    x["padding_mask"] = np.array([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], "int32")
    rec = Recorder(monkeypatch)
    for i, layer in enumerate(backbone.transformer_layers):
        rec.watch(i, layer)
    logits = numpy(model(x))
    prefix = numpy(model.prefix_key_values()).astype(np.float64)  # [layers, 2, L, h_kv, d]
    s = x["token_ids"].shape[1]
    causal = np.arange(s)[:, None] + L >= np.arange(L + s)[None, :]
    keys_real = np.concatenate([np.ones((2, L), int), x["padding_mask"]], 1) > 0
    allowed = causal[None] & keys_real[:, None, :]
    tokens = backbone.token_embedding.embeddings.numpy()[x["token_ids"]].astype(np.float64)
    if family_name == "gpt2":
        positions = backbone.position_embedding.position_embeddings.numpy()[L : L + s]
        hidden = tokens + positions
    else:
        hidden = tokens
    np.testing.assert_allclose(numpy(rec.last(0)[0][0]), hidden, rtol=1e-6, atol=1e-6)
    for i, layer in enumerate(backbone.transformer_layers):
        layer_input = numpy(rec.last(i)[0][0]).astype(np.float64)
        key = np.broadcast_to(prefix[i, 0], (2,) + prefix.shape[2:])
        value = np.broadcast_to(prefix[i, 1], (2,) + prefix.shape[2:])
        if family_name == "gpt2":
            expected = _gpt2_layer(layer, layer_input, key, value, allowed)
        else:
            expected = _llama_layer(layer, layer_input, key, value, allowed, L)
        got = numpy(rec.last(i)[2][0])
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5, err_msg=f"layer {i}")
        hidden = expected
    if family_name == "gpt2":
        norm = backbone.layer_norm
        final = _layer_norm(hidden, norm.gamma.numpy(), norm.beta.numpy())
        expected_logits = final @ backbone.token_embedding.embeddings.numpy().T
    else:
        final = _rms_norm(hidden, backbone.layer_norm.scale.numpy())
        expected_logits = final @ backbone.token_embedding.reverse_embeddings.numpy()
    np.testing.assert_allclose(logits, expected_logits, rtol=2e-5, atol=2e-5)
    # The prefix matters: the padded row (one real token) still differs from the plain LM.
    plain = numpy(prompts.prompt_causal_lm(backbone, length=0)(x))
    assert np.abs(logits[1, 0] - plain[1, 0]).max() > 1e-3


def test_registered_slice_update_gradient_equals_closed_form():
    operand = tf.Variable(np.arange(12.0).reshape(2, 6))
    update = tf.Variable(np.ones((2, 2)))
    weights = tf.constant(np.arange(12.0).reshape(2, 6) + 1)
    for start in (1, 4, 9):  # 9: clamped to 4, as XLA clamps
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * ops.slice_update(operand, [0, start], update * 3.0))
        d_operand, d_update = tape.gradient(loss, [operand, update])
        first = min(start, 4)
        expected = weights.numpy().copy()
        expected[:, first : first + 2] = 0
        np.testing.assert_array_equal(d_operand.numpy(), expected)
        np.testing.assert_array_equal(d_update.numpy(), 3 * weights.numpy()[:, first : first + 2])


# ------------------------------------------------------------------ generation


def _no_cache_greedy(model, token_ids, padding_mask):
    """keras-hub's generation rule (fill every position a row's mask leaves free, from the
    shortest prompt on) by full forward passes, no cache."""
    ids = np.array(token_ids)
    start = int(np.asarray(padding_mask).sum(-1).min())
    for index in range(start, ids.shape[1]):
        logits = numpy(model({"token_ids": ids, "padding_mask": np.ones_like(ids)}))
        ids[:, index] = np.where(
            padding_mask[:, index] > 0, ids[:, index], logits[:, index - 1].argmax(-1)
        )
    return ids


def _generation_inputs():
    x = batch(seed=5)
    ids = np.zeros((2, 8), "int32")
    mask = np.zeros((2, 8), "int32")
    ids[:, :5], mask[:, :5] = x["token_ids"], x["padding_mask"]
    ids *= mask
    return {"token_ids": ids, "padding_mask": mask}


@pytest.mark.parametrize(
    "family,mode",
    _slow_except(itertools.product(FAMILIES, MODES), ("gpt2", "deep"), ("gemma", "shallow")),
)
def test_greedy_generation_with_cache_equals_without_and_full_forward_argmax(backbone, mode):
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, init="random", seed=1)
    model.compile(sampler="greedy")
    inputs = _generation_inputs()
    cached = model.generate(dict(inputs), stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(cached, _no_cache_greedy(model, **inputs))
    # Teacher forcing over the result: every generated token is the argmax after its prefix.
    logits = numpy(model({"token_ids": cached, "padding_mask": np.ones_like(cached)}))
    generated = inputs["padding_mask"] == 0
    np.testing.assert_array_equal(cached[generated], logits[:, :-1].argmax(-1)[generated[:, 1:]])
    plain = prompts.prompt_causal_lm(backbone, length=0)
    plain.compile(sampler="greedy")
    assert not np.array_equal(
        cached, plain.generate(dict(inputs), stop_token_ids=None)["token_ids"]
    )


@pytest.mark.parametrize("family", _slow_except(FAMILIES, "gpt2"))
def test_zero_length_generation_equals_keras_hub_generate(backbone, family):
    inputs = _generation_inputs()
    lm = LM_CLASS[family](backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    model = prompts.prompt_causal_lm(backbone, length=0)
    model.compile(sampler="greedy")
    expected = lm.generate(dict(inputs), stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(
        model.generate(dict(inputs), stop_token_ids=None)["token_ids"], expected
    )


class RecordingSampler(keras_hub.samplers.RandomSampler):
    """Random sampling (seeded) that keeps every step's distribution (run eagerly)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def get_next_token(self, probabilities):
        self.seen.append(numpy(probabilities))
        return super().get_next_token(probabilities)


@pytest.mark.parametrize(
    "family_name,mode", [("llama", "deep"), pytest.param("gpt2", "shallow", marks=pytest.mark.slow)]
)
def test_sampling_draws_from_the_full_forward_distribution(family_name, mode):
    """Sampling with the cache: each step's distribution is the softmax (temperature 2) of
    the full forward pass's logits over the tokens so far; the stop token ends a row."""
    backbone = shared(family_name)
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, init="random", seed=3)
    sampler = RecordingSampler(temperature=2.0, seed=7)
    model.compile(sampler=sampler, run_eagerly=True)
    inputs = _generation_inputs()
    out = model.generate(dict(inputs), stop_token_ids=None)["token_ids"]
    start = int(inputs["padding_mask"].sum(-1).min())
    logits = numpy(model({"token_ids": out, "padding_mask": np.ones_like(out)}))
    assert len(sampler.seen) == out.shape[1] - start
    for step, probabilities in enumerate(sampler.seen):
        index = start + step
        expected = _softmax(logits[:, index - 1].astype(np.float64) / 2.0)
        np.testing.assert_allclose(probabilities, expected, rtol=1e-4, atol=1e-6)
        free = inputs["padding_mask"][:, index] == 0
        assert (expected[np.arange(2), out[:, index]][free] > 0).all()
    assert len({tuple(row) for row in out[:, start:]}) > 1 or out.shape[0] == 1


# ------------------------------------------------------------------ scoring


class WordIds:
    """word -> a token id in [2, V)."""

    def __init__(self):
        self.ids = {}

    def __call__(self, text):
        return [self.ids.setdefault(w, 2 + len(self.ids) % (V - 2)) for w in text.split()]


def test_rank_classification_and_arg_with_a_decoder():
    """Each choice's score is the mean log-likelihood of its tokens (EOS included) after the
    input, recomputed by running the decoder on that input + choice alone; predictions,
    accuracy and ARG follow from those scores."""
    backbone = shared("gpt2")
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep", init="random", seed=2)
    tokenize, eos = WordIds(), 1
    examples = [
        PromptedExample("a b c ?", "d", ("d", "e f"), 0),
        PromptedExample("g ?", "h", ("i", "h", "j k l"), 1),
        PromptedExample("m n ?", "o", ("p", "o"), 1),
    ]
    score_fn = prompts.causal_lm_score_fn(model, pad_id=0)
    predictions, scores, labels = ev.rank_classify_examples(
        score_fn, tokenize, examples, eos_id=eos, pad_id=0
    )
    for i, example in enumerate(examples):
        source = tokenize(example.input_text)
        for j, choice in enumerate(example.answer_choices):
            target = tokenize(choice) + [eos]
            ids = np.array([source + target], "int32")
            log_probs = numpy(model({"token_ids": ids, "padding_mask": np.ones_like(ids)}))[0]
            log_probs = (
                log_probs
                - np.log(
                    np.exp(log_probs - log_probs.max(-1, keepdims=True)).sum(-1, keepdims=True)
                )
                - log_probs.max(-1, keepdims=True)
            )
            n = len(source)
            expected = np.mean([log_probs[n - 1 + t, token] for t, token in enumerate(target)])
            np.testing.assert_allclose(scores[i, j], expected, rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(scores[i, len(example.answer_choices) :]))
    np.testing.assert_array_equal(predictions, scores.argmax(-1))
    correct = {("d", "t"): predictions == labels}
    chance = np.mean([1 / len(e.answer_choices) for e in examples])
    arg = ev.average_relative_gain(correct, {"d": 3})
    assert arg == pytest.approx((np.mean(predictions == labels) - 1 / 3) * 3)
    assert chance > 0
    with pytest.raises(tf.errors.InvalidArgumentError, match="at least one real token"):
        prompts.causal_lm_token_log_likelihoods(model, [[0, 0]], [[0, 0]], [[3]])


# ------------------------------------------------------------------ saving, errors


def test_prompt_file_and_keras_file_round_trip_bit_exactly(tmp_path):
    backbone = tiny("llama")
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep", seed=1, train="both")
    model.prompt_variables[0].assign(model.prompt_variables[0].numpy() + 0.25)
    path = prompts.save_prompt(model, tmp_path / "prefix")
    other = prompts.prompt_causal_lm(backbone, length=L, mode="deep", seed=2)
    prompts.load_prompt(other, path)
    x = batch()
    np.testing.assert_array_equal(numpy(other(x)), numpy(model(x)))
    with pytest.raises(ValueError, match="mode"):
        prompts.load_prompt(prompts.prompt_causal_lm(backbone, length=L), path)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, C.PromptedCausalLM) and loaded.mode == "deep"
    assert loaded.ARCHITECTURE == "llama" and loaded.length == L
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(numpy(loaded(x)), numpy(model(x)))


def test_bad_arguments_raise_clear_errors():
    backbone = shared("gpt2")
    bert = keras_hub.models.BertBackbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16
    )
    with pytest.raises(
        ValueError, match="GPT2Backbone, GemmaBackbone, LlamaBackbone.*BertBackbone"
    ):
        prompts.prompt_causal_lm(bert)
    with pytest.raises(ValueError, match="mode"):
        prompts.prompt_causal_lm(backbone, mode="medium")
    with pytest.raises(ValueError, match="train"):
        prompts.prompt_causal_lm(backbone, train="all")
    with pytest.raises(ValueError, match="length"):
        prompts.prompt_causal_lm(backbone, length=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        prompts.prompt_causal_lm(backbone, init="a text")
    with pytest.raises(ValueError, match="init"):
        prompts.prompt_causal_lm(backbone, init=[0.5])
    with pytest.raises(ValueError, match="'random'"):
        prompts.prompt_causal_lm(backbone, mode="deep", init="vocab", reparameterize=True)
    with pytest.raises(ValueError, match="max_sequence_length=16"):
        prompts.prompt_causal_lm(backbone, length=12)({"token_ids": np.ones((1, 5), "int32")})


def test_causal_lm_is_accepted_and_its_preprocessor_kept():
    backbone = shared("gpt2")
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model = prompts.prompt_causal_lm(lm, length=L)
    assert model.backbone is backbone and isinstance(model, keras_hub.models.CausalLM)


# ------------------------------------------------------------------ Hugging Face GPT-2


def test_deep_prefix_equals_hugging_face_gpt2_with_past_key_values():
    """Optional: the logits of a deep-prefixed GPT-2 equal transformers' GPT2LMHeadModel
    given the same weights and the prefix as `past_key_values` (HF then places the text at
    positions L.. and the attention mask covers the prefix)."""
    sys.modules.setdefault("triton", None)  # torch after TensorFlow: no triton (segfaults)
    torch = pytest.importorskip("torch", reason="optional: torch")
    transformers = pytest.importorskip("transformers", reason="optional: transformers")
    backbone = shared("gpt2")
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep", seed=5)
    config = transformers.GPT2Config(
        vocab_size=V,
        n_positions=16,
        n_embd=8,
        n_layer=2,
        n_head=2,
        n_inner=16,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()

    def t(a):
        return torch.tensor(np.asarray(a), dtype=torch.float32)

    state = {
        "transformer.wte.weight": t(backbone.token_embedding.embeddings.numpy()),
        "transformer.wpe.weight": t(backbone.position_embedding.position_embeddings.numpy()),
        "transformer.ln_f.weight": t(backbone.layer_norm.gamma.numpy()),
        "transformer.ln_f.bias": t(backbone.layer_norm.beta.numpy()),
    }
    for i, layer in enumerate(backbone.transformer_layers):
        a = layer._self_attention_layer
        p = f"transformer.h.{i}."
        qkv = [
            d.kernel.numpy().reshape(8, 8) for d in (a._query_dense, a._key_dense, a._value_dense)
        ]
        bias = [d.bias.numpy().reshape(8) for d in (a._query_dense, a._key_dense, a._value_dense)]
        state.update(
            {
                p + "ln_1.weight": t(layer._self_attention_layer_norm.gamma.numpy()),
                p + "ln_1.bias": t(layer._self_attention_layer_norm.beta.numpy()),
                p + "attn.c_attn.weight": t(np.concatenate(qkv, 1)),
                p + "attn.c_attn.bias": t(np.concatenate(bias)),
                p + "attn.c_proj.weight": t(a._output_dense.kernel.numpy().reshape(8, 8)),
                p + "attn.c_proj.bias": t(a._output_dense.bias.numpy()),
                p + "ln_2.weight": t(layer._feedforward_layer_norm.gamma.numpy()),
                p + "ln_2.bias": t(layer._feedforward_layer_norm.beta.numpy()),
                p + "mlp.c_fc.weight": t(layer._feedforward_intermediate_dense.kernel.numpy()),
                p + "mlp.c_fc.bias": t(layer._feedforward_intermediate_dense.bias.numpy()),
                p + "mlp.c_proj.weight": t(layer._feedforward_output_dense.kernel.numpy()),
                p + "mlp.c_proj.bias": t(layer._feedforward_output_dense.bias.numpy()),
            }
        )
    hf.load_state_dict(state, strict=False)
    hf.lm_head.weight = hf.transformer.wte.weight
    x = batch()
    prefix = numpy(model.prefix_key_values())  # [layers, 2, L, heads, d]
    legacy = tuple(
        tuple(
            t(np.broadcast_to(prefix[i, j].transpose(1, 0, 2)[None], (2, 2, L, 4))) for j in (0, 1)
        )
        for i in range(2)
    )
    if hasattr(transformers, "DynamicCache"):
        # Filled layer by layer: `update` exists in transformers 4.36+ and 5 (5 dropped
        # `from_legacy_cache`); older versions take the legacy tuples.
        past = transformers.DynamicCache()
        for i, (key, value) in enumerate(legacy):
            past.update(key, value, i)
    else:
        past = legacy
    mask = np.concatenate([np.ones((2, L), "int64"), x["padding_mask"]], 1)
    with torch.no_grad():
        expected = hf(
            input_ids=torch.tensor(x["token_ids"], dtype=torch.long),
            attention_mask=torch.tensor(mask),
            past_key_values=past,
        ).logits.numpy()
    real = x["padding_mask"] > 0
    np.testing.assert_allclose(numpy(model(x))[real], expected[real], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ prompt meta-learning


def test_prompt_fomaml_meta_step_on_a_prompted_decoder():
    """The prompt FOMAML trainer takes a prompted decoder as its model (its default prompt
    selection finds the prefix): one meta-step over 2 tasks moves the prefix and leaves the
    frozen backbone bit-identical (train="prompt")."""
    import trainer_entries  # noqa: F401  (first: it imports causal_lm_entries at its end)
    from causal_lm_entries import decoder_task_data

    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer

    backbone = tiny("gpt2")
    model = prompts.prompt_causal_lm(backbone, length=2, mode="deep")
    trainer = PromptFOMAMLTrainer(model, inner_steps=2, inner_optimizer=O.SGD(0.5))
    assert [v.name for v in trainer.prompt_variables] == ["prompt_prefix"]
    trainer.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [v.numpy().copy() for v in backbone.weights]
    prefix = model.prompt_variables[0].numpy().copy()
    x, y = decoder_task_data(2, steps=2)
    history = trainer.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["support_loss"][0])
    for v, b in zip(backbone.weights, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)
    assert np.abs(model.prompt_variables[0].numpy() - prefix).max() > 1e-4
