"""What a prompt-only training step computes (issue 22): the frozen backbone gets no weight
gradient and no optimizer slot, the backward pass stops at the prompt (no gradient into the
token-embedding table below it), and a deep T5 prompt's keys and values reach keras-hub's
attention without the stacked cache whose two strided reads differentiated into dense
StridedSliceGrads (half of a deep prompt-only step on CPU).

No timing. The graph of Keras's own `train_step` is traced and reduced to what TensorFlow's
function runtime executes: the ancestors of the outputs and of the stateful ops (the
optimizer's variable updates, the metrics); every other op is pruned before it runs. (The
traced graph itself does hold weight-gradient ops for the frozen variables: Keras's
`trainable=False` does not reach the `tf.Variable`, so the tape watches their reads; those
ops feed nothing and are pruned, which a profile of the benchmark's step confirms: 141
MatMuls run per prompt-only step of the small T5, 219 per full step.) Every check also runs
on the same model with `train="both"`, where it must find what it must not find for "prompt".
"""

import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tf_metaalign import prompts
from tf_metaalign.prompts import causal_lm
from tf_metaalign.prompts import t5 as t5_module
from tf_metaalign.prompts.base import KeyValueCache

L = 3
HIDDEN = 24  # no activation reshaped to 2-D is [24, x]: B * (S + L) is 16 (T5, GPT-2), 27 (BERT)
_BUILT = {}


def tiny_backbone(family):
    if family not in _BUILT:
        keras.utils.set_random_seed(0)
        if family == "t5":
            _BUILT[family] = keras_hub.models.T5Backbone(
                vocabulary_size=50,
                num_layers=2,
                num_heads=2,
                hidden_dim=HIDDEN,
                intermediate_dim=40,
                key_value_dim=12,
                dropout=0.0,
                tie_embedding_weights=True,
            )
        elif family == "gpt2":
            _BUILT[family] = keras_hub.models.GPT2Backbone(
                vocabulary_size=50,
                num_layers=2,
                num_heads=2,
                hidden_dim=HIDDEN,
                intermediate_dim=40,
                max_sequence_length=32,
                dropout=0.0,
            )
        else:
            _BUILT[family] = keras_hub.models.BertBackbone(
                vocabulary_size=50,
                num_layers=2,
                num_heads=2,
                hidden_dim=HIDDEN,
                intermediate_dim=40,
                max_sequence_length=16,
                dropout=0.0,
            )
    return _BUILT[family]


@pytest.fixture
def restore():
    """The shared backbones' weights are restored after each test (and their trainability,
    which prompting no longer changes)."""
    saved = {name: [v.numpy().copy() for v in b.weights] for name, b in _BUILT.items()}
    yield
    for name, b in _BUILT.items():
        b.trainable = True
        for v, value in zip(b.weights, saved.get(name, [])):
            v.assign(value)


class ClassifierHead(prompts.TrainableSelection, keras.Model):
    """A head on a prompted BERT that trains what the prompted model's `train` selects."""

    def __init__(self, encoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.head(self.encoder(x, training=training)["pooled_output"])


def prompted_model(family, mode, train):
    """(compiled Keras model, prompted backbone, batch (x, y)) with Adam (two full slots per
    trainable variable, so the slots name exactly what trains)."""
    rng = np.random.default_rng(1)
    backbone = tiny_backbone(family)
    if family == "t5":
        prompted = prompts.prompt_t5(backbone, length=L, mode=mode, train=train)
        model = prompts.PromptedT5LM(prompted)
        y = rng.integers(2, 50, (2, 4)).astype("int32")
        x = {
            "encoder_token_ids": rng.integers(2, 50, (2, 5)).astype("int32"),
            "encoder_padding_mask": np.ones((2, 5), "int32"),
            "decoder_token_ids": ops.convert_to_numpy(prompts.shift_right(y)),
            "decoder_padding_mask": np.ones((2, 4), "int32"),
        }
        loss = prompts.masked_token_loss()
    elif family == "gpt2":
        prompted = model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, train=train)
        x = {
            "token_ids": rng.integers(1, 50, (2, 5)).astype("int32"),
            "padding_mask": np.ones((2, 5), "int32"),
        }
        y = rng.integers(1, 50, (2, 5)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        prompted = prompts.prompt_bert(backbone, length=L, train=train)
        model = ClassifierHead(prompted)
        x = {
            "token_ids": rng.integers(2, 50, (3, 6)).astype("int32"),
            "segment_ids": np.zeros((3, 6), "int32"),
            "padding_mask": np.ones((3, 6), "int32"),
        }
        y = rng.integers(0, 3, (3,)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    built(model, x)
    return model, prompted, (x, y)


def built(model, x):
    """The model and its optimizer built as `fit` builds them before the first step."""
    model(x)
    model.optimizer.build(model.trainable_variables)


def executed_operations(concrete_function):
    """The ops of a traced function that its runtime executes: the ancestors (through data
    and control inputs) of its outputs and of its stateful ops."""
    graph = concrete_function.graph
    roots = [t.op for t in graph.outputs]
    roots += [op for op in graph.get_operations() if op.op_def.is_stateful]
    seen, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return [op for op in graph.get_operations() if op.name in seen]


def traced_train_step(model, data):
    x, y = data
    data = (tf.nest.map_structure(tf.constant, x), tf.constant(y))
    return executed_operations(tf.function(model.train_step).get_concrete_function(data))


def gradient_outputs(operations):
    """(op, shape) of every float output of the executed gradient ops."""
    return [
        (op, tuple(t.shape))
        for op in operations
        if op.name.startswith("gradient_tape/")
        for t in op.outputs
        if t.dtype.is_floating and t.shape.is_fully_defined()
    ]


def weight_gradient_shapes(operations, variables):
    """The shapes among `variables`' that some executed gradient op produces (a weight
    gradient: the activation gradients here have other shapes)."""
    wanted = {tuple(v.shape) for v in variables if len(v.shape) >= 1}
    return {shape for _, shape in gradient_outputs(operations) if shape in wanted}


def gradients_below_the_prompt(operations, prompted):
    """Executed gradient ops of the prompted backbone's embedding lookups (token, segment,
    position: what runs before the prompt joins the sequence). The tape names an op's
    gradient ops under "gradient_tape/" + the op's scope. (The tied LM heads of T5 and
    GPT-2 read the token embedding too, above the decoder: not a lookup, not counted.)"""
    scopes = {
        op.name.rsplit("/", 1)[0]
        for op in operations
        if not op.name.startswith("gradient_tape/")
        and re.match(rf"(.*/)?{prompted.name}", op.name)
        and re.search(r"/(token|segment|position)_embedding(_\d+)?/[^/]+$", op.name)
        # A lookup (a gather, or the position table's slice); not the tied LM head's
        # reverse projection (a matmul, above the decoder: its gradient is d hidden).
        and (op.type in ("GatherV2", "ResourceGather") or "/position_embedding" in op.name)
    }
    assert scopes, "no embedding lookup found"
    return [
        op.name
        for op in operations
        if any(op.name.startswith(f"gradient_tape/{scope}/") for scope in scopes)
    ]


def frozen_shapes(backbone, prompted):
    """Shapes of the backbone's matrices, none of which a prompt variable has."""
    prompt = {tuple(v.shape) for v in prompted.prompt_variables}
    return {tuple(v.shape) for v in backbone.weights if len(v.shape) >= 2} - prompt


@pytest.mark.parametrize(
    "family,mode",
    [("t5", "shallow"), ("t5", "deep"), ("bert", "shallow"), ("gpt2", "shallow"), ("gpt2", "deep")],
    ids=str,
)
def test_prompt_only_step_runs_no_weight_gradient_and_stops_at_the_prompt(restore, family, mode):
    backbone = tiny_backbone(family)
    model, prompted, data = prompted_model(family, mode, "prompt")
    # What trains, and the optimizer's slots: exactly two per trainable variable (Adam),
    # of their shapes -- nothing for the frozen backbone.
    trainable = model.trainable_variables
    expected = [v for v in prompted.prompt_variables] + (
        list(model.head.trainable_variables) if family == "bert" else []
    )
    assert {id(v) for v in trainable} == {id(v) for v in expected}
    slots = [v for v in model.optimizer.variables if len(v.shape) >= 1]
    assert sorted(tuple(v.shape) for v in slots) == sorted(2 * [tuple(v.shape) for v in trainable])
    frozen = frozen_shapes(backbone, prompted)
    executed = traced_train_step(model, data)
    assert weight_gradient_shapes(executed, backbone.weights) & frozen == set()
    assert gradients_below_the_prompt(executed, prompted) == []

    # The control: the same model trained whole runs a weight gradient of every backbone
    # matrix, and differentiates the token-embedding lookup below the prompt.
    prompted.set_train("both")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss)
    built(model, data[0])
    executed = traced_train_step(model, data)
    # (Every kernel's gradient is dense; a lookup table's, such as T5's relative position
    # bias, can be sparse, of another shape.)
    kernels = {tuple(v.shape) for v in backbone.weights if v.path.endswith("kernel")}
    assert len(kernels) >= 3 and kernels <= frozen
    assert weight_gradient_shapes(executed, backbone.weights) >= kernels
    below = gradients_below_the_prompt(executed, prompted)
    assert any("/token_embedding" in name for name in below)


def _stacked_cache_slice_grads(operations, batch_size):
    """StridedSliceGrads that write a [B, 2, K, h, d] tensor with K > L: the gradient of a
    read of a stacked cache (prefix + real keys). (The per-layer reads of a prefix matrix,
    [L, layers, 2, h, d] for T5, [layers, 2, L, h, d] for GPT-2, differentiate into small
    ones, which do not count here.)"""
    return [
        op.name
        for op in operations
        if op.type == "StridedSliceGrad"
        and op.outputs[0].shape.rank == 5
        and tuple(op.outputs[0].shape)[:2] == (batch_size, 2)
        and op.outputs[0].shape[2] > L
    ]


def _deep_prefix_gradients(family, prompted, x):
    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            if family == "t5":
                logits = prompted.lm_logits(prompted(x)["decoder_sequence_output"])
            else:
                logits = prompted(x)
            loss = tf.reduce_sum(logits**2)
        variables = [v.value for v in prompted.prompt_variables]
        return tape.gradient(loss, variables)

    concrete = gradients.get_concrete_function()
    return [g.numpy() for g in gradients()], executed_operations(concrete)


@pytest.mark.parametrize("family,module,blocks", [("t5", t5_module, 6), ("gpt2", causal_lm, 2)])
def test_deep_keys_values_reach_the_attention_unstacked_with_the_same_gradient(
    restore, monkeypatch, family, module, blocks
):
    """The deep prefixes' gradient through `KeyValueCache` equals the gradient through
    keras-hub's stacked [B, 2, K, h, d] cache, and no StridedSliceGrad of that shape (the
    dense gradient of a read of the stacked cache) runs; with the stacked cache, one runs
    per read (2 per attention block: T5 6 blocks here, GPT-2 2 layers). GPT-2's layers also
    take `ops.shape` of the cache (its causal mask): `KeyValueCache.__tf_tensor__`."""
    _, prompted, (x, _) = prompted_model(family, "deep", "prompt")
    x = tf.nest.map_structure(tf.constant, x)
    unstacked, executed = _deep_prefix_gradients(family, prompted, x)
    assert _stacked_cache_slice_grads(executed, batch_size=2) == []

    monkeypatch.setattr(
        module, "KeyValueCache", lambda keys, values: ops.stack([keys, values], axis=1)
    )
    stacked, executed = _deep_prefix_gradients(family, prompted, x)
    assert len(_stacked_cache_slice_grads(executed, batch_size=2)) == 2 * blocks
    for a, b in zip(unstacked, stacked):
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_key_value_cache_reads_and_rejects_other_indices():
    keys, values = tf.ones((2, 3, 4, 5)), tf.zeros((2, 3, 4, 5))
    cache = KeyValueCache(keys, values)
    assert cache[:, 0, ...] is keys and cache[:, 1, ...] is values
    assert tuple(int(d) for d in cache.shape) == (2, 2, 3, 4, 5)
    assert tuple(ops.shape(cache)) == (2, 2, 3, 4, 5)  # through __tf_tensor__
    np.testing.assert_array_equal(tf.convert_to_tensor(cache), tf.stack([keys, values], 1))
    for index in ((slice(None), 2, Ellipsis), (slice(1, None), 0, Ellipsis), 0):
        with pytest.raises(TypeError, match="supports only the reads"):
            cache[index]
