"""Hugging Face PEFT prompt-learning adapters in and out of the prompted keras-hub models
(tf_metaalign.prompts.peft_adapters), on tiny GPT-2, Llama (grouped-query attention) and
Gemma models.

Oracles: PEFT itself. `peft_fixtures/` holds tiny transformers models (read by keras-hub's
own HF converter), adapters PEFT trained and saved, and PEFT's logits and greedy tokens
(written by `peft_fixtures/make_peft_fixtures.py`; no torch needed here); the last tests
compare live against PEFT where torch, transformers and peft are installed (skipped
otherwise), in both directions: PEFT loading the adapters this package saves, and a
text-initialised prefix equal to the HF model reading the text first. T5: a shallow
PromptedT5 against PEFT's SEQ_2_SEQ_LM prompt tuning (the HF weights mapped to keras-hub's
T5Backbone by `t5_backbone_from_hf`: keras-hub has no HF T5 converter). Before the Gemma
fix (prefix keys copied without the rotary interleave, the shallow prompt scaled by
sqrt(hidden)) the fixture logits differed by 1.68 (prefix) and 0.55 (prompt); now ~1e-6.

Default tests take ~35 s on 2 cores (the live PEFT tests ~25 s more where peft is present).
"""

import importlib.util
import json
import os
import sys

import keras_hub
import numpy as np
import pytest
from keras import ops

from tf_metaalign import prompts
from tf_metaalign.prompts import causal_lm as C

FIXTURES = os.path.join(os.path.dirname(__file__), "peft_fixtures")
FAMILIES = ("gpt2", "llama", "gemma")
METHOD_MODE = {"prompt_tuning": "shallow", "prefix_tuning": "deep"}
L = 3
_BACKBONES = {}


def fixture_backbone(family):
    """The fixture's transformers model through keras-hub's own HF converter (once)."""
    if family not in _BACKBONES:
        path = os.path.join(FIXTURES, family, "base")
        _BACKBONES[family] = keras_hub.models.Backbone.from_preset(path)
    return _BACKBONES[family]


def expected(family):
    with np.load(os.path.join(FIXTURES, family, "expected.npz")) as data:
        return dict(data)


def numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


@pytest.mark.parametrize("method", sorted(METHOD_MODE))
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_trained_adapter_gives_peft_logits_and_greedy_tokens(family, method):
    """A PEFT-trained adapter loaded into the package gives PEFT's logits (right padding)
    and, through keras-hub's `generate` with the greedy sampler, PEFT's greedy tokens."""
    backbone = fixture_backbone(family)
    reference = expected(family)
    model = prompts.prompt_causal_lm(backbone, length=L, mode=METHOD_MODE[method], seed=9)
    prompts.load_peft_adapter(model, os.path.join(FIXTURES, family, method))
    x = {"token_ids": reference["token_ids"], "padding_mask": reference["padding_mask"]}
    real = x["padding_mask"] > 0
    np.testing.assert_allclose(
        numpy(model(x))[real], reference[f"{method}_logits"][real], rtol=2e-5, atol=2e-5
    )
    greedy = reference[f"{method}_greedy"]
    n = greedy.shape[1] - 4
    ids = np.zeros((1, greedy.shape[1]), "int32")
    ids[0, :n] = greedy[0, :n]
    mask = (np.arange(ids.shape[1]) < n)[None].astype("int32")
    model.compile(sampler="greedy")
    out = model.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
    np.testing.assert_array_equal(out["token_ids"], greedy)


def test_gemma_prefix_keys_are_interleaved_for_keras_hub_and_back():
    """PEFT's Gemma keys (rotary halves apart) are interleaved into keras-hub's cache layout
    (x_0, x_{d/2}, x_1, ...); values untouched; the inverse restores them."""
    backbone = fixture_backbone("gemma")
    model = prompts.prompt_causal_lm(backbone, length=L, mode="deep")
    prompts.load_peft_adapter(model, os.path.join(FIXTURES, "gemma", "prefix_tuning"))
    flat = numpy(model.prompt_variables[0]).reshape(L, 2, 2, 1, 8).transpose(1, 2, 0, 3, 4)
    cache = numpy(model.prefix_key_values())
    d = np.arange(8)
    np.testing.assert_array_equal(cache[:, 0][..., 0::2], flat[:, 0][..., d[:4]])
    np.testing.assert_array_equal(cache[:, 0][..., 1::2], flat[:, 0][..., d[4:]])
    np.testing.assert_array_equal(cache[:, 1], flat[:, 1])
    np.testing.assert_array_equal(C._gemma_keys_to_hf(cache[:, 0]), flat[:, 0])


def test_gemma_prompt_is_unscaled_and_text_init_holds_the_scaled_rows():
    """A Gemma shallow prompt enters the layers as it is (PEFT on transformers >= 5.4); a
    token init therefore holds the embedding rows times sqrt(hidden_dim), and the prompted
    model equals the plain model reading those tokens first."""
    backbone = fixture_backbone("gemma")
    text = [7, 11, 13]
    model = prompts.prompt_causal_lm(backbone, length=L, init=text)
    rows = backbone.token_embedding.embeddings.numpy()[text]
    np.testing.assert_allclose(numpy(model.prompt_variables[0]), rows * 4.0, rtol=1e-6)
    x = {"token_ids": np.array([[5, 6, 9]], "int32"), "padding_mask": np.ones((1, 3), "int32")}
    got = numpy(model(x))  # before a plain CausalLM is built (see wt_prompt_lm's fix)
    joined = {"token_ids": np.array([text + [5, 6, 9]], "int32"), "padding_mask": np.ones((1, 6))}
    plain = numpy(keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)(joined))
    np.testing.assert_allclose(got, plain[:, L:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["shallow", "deep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_round_trips_exactly(tmp_path, family, mode):
    """Ours -> a PEFT adapter -> ours: the same values bit for bit, and saving again writes
    the same config bytes and the same tensor (PEFT's one `prompt_embeddings`)."""
    backbone = fixture_backbone(family)
    tuned = prompts.prompt_causal_lm(backbone, length=L, mode=mode, seed=1)
    first = prompts.save_peft_adapter(tuned, tmp_path / "first")
    with open(os.path.join(first, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["peft_type"] == ("PROMPT_TUNING" if mode == "shallow" else "PREFIX_TUNING")
    assert config["task_type"] == "CAUSAL_LM" and config["num_virtual_tokens"] == L
    fresh = prompts.prompt_causal_lm(backbone, length=L, mode=mode, seed=2)
    assert not np.array_equal(fresh.prompt_variables[0], tuned.prompt_variables[0])
    prompts.load_peft_adapter(fresh, first)
    np.testing.assert_array_equal(fresh.prompt_variables[0], tuned.prompt_variables[0])
    second = prompts.save_peft_adapter(fresh, tmp_path / "second")
    with open(os.path.join(first, "adapter_config.json"), "rb") as a:
        with open(os.path.join(second, "adapter_config.json"), "rb") as b:
            assert a.read() == b.read()
    first, second = (_read_tensor(path) for path in (first, second))
    assert first[1] == second[1]  # the metadata (its order in the header is not fixed)
    np.testing.assert_array_equal(first[0], second[0])
    assert first[0].dtype == second[0].dtype == np.float32


def _read_tensor(directory):
    from safetensors import safe_open

    with safe_open(os.path.join(directory, "adapter_model.safetensors"), "np") as f:
        assert list(f.keys()) == ["prompt_embeddings"]
        return f.get_tensor("prompt_embeddings"), f.metadata()


@pytest.mark.parametrize("mode", ["shallow", "deep"])
def test_reparameterised_model_saves_its_mlp_output(tmp_path, mode):
    """As PEFT saves its prompt encoder's output: loaded into a plain model it gives the
    reparameterised model's logits."""
    backbone = fixture_backbone("llama")
    model = prompts.prompt_causal_lm(backbone, length=L, mode=mode, reparameterize=True)
    path = prompts.save_peft_adapter(model, tmp_path / "adapter")
    plain = prompts.prompt_causal_lm(backbone, length=L, mode=mode)
    prompts.load_peft_adapter(plain, path)
    x = {"token_ids": np.array([[5, 6, 9]], "int32"), "padding_mask": np.ones((1, 3), "int32")}
    np.testing.assert_allclose(numpy(plain(x)), numpy(model(x)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reparameterize=True"):
        prompts.load_peft_adapter(model, path)


def test_shallow_t5_round_trips_and_reads_a_seq2seq_adapter(tmp_path):
    """PromptedT5(mode="shallow") <-> PEFT SEQ_2_SEQ_LM prompt tuning: saved with
    num_transformer_submodules=1; a PEFT file of 2 * L rows (its seq2seq default) loads its
    first L, the ones PEFT's forward uses. A deep PromptedT5 is refused (another model)."""
    from safetensors.numpy import save_file

    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16
    )
    tuned = prompts.prompt_t5(backbone, length=L, seed=0)
    path = prompts.save_peft_adapter(tuned, tmp_path / "t5")
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["task_type"], config["token_dim"], config["num_layers"]) == (
        "SEQ_2_SEQ_LM",
        8,
        1,
    )
    fresh = prompts.prompt_t5(backbone, length=L, seed=1)
    prompts.load_peft_adapter(fresh, path)
    np.testing.assert_array_equal(fresh.prompt_embeddings, tuned.prompt_embeddings)
    rows = np.random.default_rng(0).standard_normal((2 * L, 8)).astype("float32")
    save_file({"prompt_embeddings": rows}, os.path.join(path, "adapter_model.safetensors"))
    config["num_transformer_submodules"] = 2
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    prompts.load_peft_adapter(fresh, path)
    np.testing.assert_array_equal(fresh.prompt_embeddings, rows[:L])
    with pytest.raises(ValueError, match="mode='deep'"):
        prompts.load_peft_adapter(prompts.prompt_t5(backbone, length=L, mode="deep"), path)
    with pytest.raises(ValueError, match="task_type='CAUSAL_LM'"):
        prompts.load_peft_adapter(
            prompts.prompt_causal_lm(fixture_backbone("gpt2"), length=L), path
        )


def t5_backbone_from_hf(directory):
    """keras-hub's T5Backbone holding a transformers T5 checkpoint (config.json +
    model.safetensors; ReLU feed-forward, tied embeddings), mapped here: keras-hub has no HF
    T5 converter. Dense kernels are the transposed torch weights."""
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(directory, "model.safetensors"))
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=config["vocab_size"],
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        hidden_dim=config["d_model"],
        intermediate_dim=config["d_ff"],
        key_value_dim=config["d_kv"],
        dropout=0.0,
        activation="relu",
        use_gated_activation=False,
        layer_norm_epsilon=config["layer_norm_epsilon"],
    )
    backbone.token_embedding.embeddings.assign(weights["shared.weight"])

    def attention(layer, prefix):
        for name in ("query", "key", "value", "output"):
            kernel = weights[f"{prefix}.{name[0]}.weight"].T
            getattr(layer, f"{name}_projector").kernel.assign(kernel)
        if layer.use_relative_attention_bias:
            layer.relative_attention_bias.assign(
                weights[f"{prefix}.relative_attention_bias.weight"]
            )

    for stack in ("encoder", "decoder"):
        layers = getattr(backbone, f"{stack}_transformer_layers")
        for i, layer in enumerate(layers):
            p = f"{stack}.block.{i}.layer"
            attention(layer.self_attention, f"{p}.0.SelfAttention")
            layer.self_attention_layer_norm.weight.assign(weights[f"{p}.0.layer_norm.weight"])
            ff = 1
            if stack == "decoder":
                attention(layer.cross_attention, f"{p}.1.EncDecAttention")
                layer.cross_attention_layer_norm.weight.assign(weights[f"{p}.1.layer_norm.weight"])
                ff = 2
            layer.input_projector.kernel.assign(weights[f"{p}.{ff}.DenseReluDense.wi.weight"].T)
            layer.output_projector.kernel.assign(weights[f"{p}.{ff}.DenseReluDense.wo.weight"].T)
            layer.layer_norm.weight.assign(weights[f"{p}.{ff}.layer_norm.weight"])
        norm = getattr(backbone, f"{stack}_layer_norm")
        norm.weight.assign(weights[f"{stack}.final_layer_norm.weight"])
    return backbone


def test_peft_t5_prompt_tuning_adapter_gives_peft_logits():
    """A PEFT-trained SEQ_2_SEQ_LM prompt-tuning adapter (PEFT's default 2 * L rows, the first
    L used) in a shallow PromptedT5 gives PEFT's logits (keras-hub T5Seq2SeqLM's head)."""
    backbone = t5_backbone_from_hf(os.path.join(FIXTURES, "t5", "base"))
    reference = expected("t5")
    model = prompts.prompt_t5(backbone, length=L, seed=9)
    prompts.load_peft_adapter(model, os.path.join(FIXTURES, "t5", "prompt_tuning"))
    x = {name: reference[name] for name in reference if name.endswith(("_ids", "_mask"))}
    logits = numpy(model.lm_logits(model(x)["decoder_sequence_output"]))
    np.testing.assert_allclose(logits, reference["prompt_tuning_logits"], rtol=2e-5, atol=2e-5)
    plain = numpy(
        model.lm_logits(prompts.prompt_t5(backbone, length=0)(x)["decoder_sequence_output"])
    )
    assert np.abs(plain - logits).max() > 1e-2  # the prompt matters


def test_gemma_legacy_scaling_converts_by_sqrt_hidden(tmp_path):
    """transformers < 5.4 scaled a Gemma prompt by sqrt(hidden) with the tokens: such an
    adapter is multiplied by it on loading, divided on saving."""
    backbone = fixture_backbone("gemma")
    path = os.path.join(FIXTURES, "gemma", "prompt_tuning")
    model = prompts.prompt_causal_lm(backbone, length=L)
    prompts.load_peft_adapter(model, path)
    plain = numpy(model.prompt_variables[0])
    prompts.load_peft_adapter(model, path, gemma_legacy_scaling=True)
    np.testing.assert_allclose(numpy(model.prompt_variables[0]), plain * 4.0, rtol=1e-6)
    out = prompts.save_peft_adapter(model, tmp_path / "legacy", gemma_legacy_scaling=True)
    prompts.load_peft_adapter(model, out)
    np.testing.assert_allclose(numpy(model.prompt_variables[0]), plain, rtol=1e-6)
    deep = prompts.prompt_causal_lm(backbone, length=L, mode="deep")
    with pytest.raises(ValueError, match="shallow Gemma prompt only"):
        prompts.load_peft_adapter(deep, path, gemma_legacy_scaling=True)


def _write_adapter(directory, config, tensors):
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    if tensors is not None:
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    return directory


def test_bad_adapters_and_models_raise_errors_naming_what_was_expected(tmp_path):
    llama = fixture_backbone("llama")
    gemma = fixture_backbone("gemma")
    prefix = os.path.join(FIXTURES, "llama", "prefix_tuning")
    prompt = os.path.join(FIXTURES, "llama", "prompt_tuning")
    lora = _write_adapter(
        tmp_path / "lora",
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8},
        {"base_model.model.layers.0.q_proj.lora_A.weight": np.zeros((8, 16), "float32")},
    )
    deep = prompts.prompt_causal_lm(llama, length=L, mode="deep")
    with pytest.raises(ValueError, match="peft_type='LORA'.*PROMPT_TUNING.*PREFIX_TUNING"):
        prompts.load_peft_adapter(deep, lora)
    with pytest.raises(ValueError, match="num_virtual_tokens=3 .* length=4"):
        prompts.load_peft_adapter(prompts.prompt_causal_lm(llama, length=4, mode="deep"), prefix)
    with pytest.raises(ValueError, match="PROMPT_TUNING .*mode='shallow'.* build it with"):
        prompts.load_peft_adapter(deep, prompt)
    with pytest.raises(ValueError, match="num_attention_heads=2 .*num_attention_heads=1"):
        prompts.load_peft_adapter(prompts.prompt_causal_lm(gemma, length=L, mode="deep"), prefix)
    with pytest.raises(ValueError, match="PromptedCausalLM .* PromptedT5 .*PromptedBert"):
        bert = keras_hub.models.BertBackbone(
            vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=16
        )
        prompts.load_peft_adapter(prompts.prompt_bert(bert, length=L), prompt)
    # Same shapes, another family: the architecture this package recorded is checked.
    saved = prompts.save_peft_adapter(
        prompts.prompt_causal_lm(fixture_backbone("gpt2"), length=L), tmp_path / "gpt2"
    )
    with pytest.raises(ValueError, match="saved from a 'gpt2' model; the model is 'llama'"):
        prompts.load_peft_adapter(prompts.prompt_causal_lm(llama, length=L), saved)
    wrong = _write_adapter(
        tmp_path / "shape",
        json.load(open(os.path.join(prefix, "adapter_config.json"))),
        {"prompt_embeddings": np.zeros((L, 30), "float32")},
    )
    with pytest.raises(ValueError, match=r"shape \(3, 30\).*\[3, 32\]"):
        prompts.load_peft_adapter(deep, wrong)
    empty = _write_adapter(tmp_path / "bin", {"peft_type": "PREFIX_TUNING"}, None)
    open(os.path.join(empty, "adapter_model.bin"), "wb").close()
    with pytest.raises(ValueError, match="safe_serialization=True"):
        prompts.load_peft_adapter(deep, empty)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        prompts.load_peft_adapter(deep, tmp_path)
    with pytest.raises(ValueError, match="gemma_legacy_scaling"):
        prompts.load_peft_adapter(deep, prefix, gemma_legacy_scaling="yes")


# ------------------------------------------------------------------ live against PEFT


def _peers():
    sys.modules.setdefault("triton", None)  # torch after TensorFlow: no triton (segfaults)
    pytest.importorskip("torch", reason="optional: torch")
    pytest.importorskip("transformers", reason="optional: transformers")
    peft = pytest.importorskip("peft", reason="optional: peft")
    spec = importlib.util.spec_from_file_location(
        "make_peft_fixtures", os.path.join(FIXTURES, "make_peft_fixtures.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return peft, script


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_our_adapters_and_gives_our_logits(tmp_path, family):
    """Optional (torch, transformers, peft): for GPT-2, Llama (GQA) and Gemma, the HF model
    converted to keras-hub by its own converter; our random prompt, our text-initialised
    prefix (activations the backbone computes), saved with `save_peft_adapter` and loaded by
    `PeftModel.from_pretrained`, give PEFT the package's logits; PEFT with the text prefix
    equals the HF model reading the text first."""
    peft, script = _peers()
    import torch

    hf = script.hf_model(family, seed=4)
    hf.save_pretrained(tmp_path / "base")
    backbone = keras_hub.models.Backbone.from_preset(str(tmp_path / "base"))
    x = script.batch(seed=2)
    real = x["padding_mask"] > 0
    text = [7, 11, 13]
    cases = {
        "shallow": prompts.prompt_causal_lm(backbone, length=L, init="random", seed=3),
        "deep": prompts.prompt_causal_lm(backbone, length=L, mode="deep", seed=3),
        "deep_text": prompts.prompt_causal_lm(backbone, length=L, mode="deep", init=text),
    }
    for name, model in cases.items():
        path = prompts.save_peft_adapter(model, tmp_path / name)
        wrapped = peft.PeftModel.from_pretrained(script.hf_model(family, seed=4), path).eval()
        got = script.peft_logits(wrapped, x)
        np.testing.assert_allclose(
            numpy(model(x))[real], got[real], rtol=5e-5, atol=5e-5, err_msg=f"{family} {name}"
        )
    joined = np.concatenate([np.tile(text, (2, 1)), x["token_ids"]], 1)
    mask = np.concatenate([np.ones((2, L), "int64"), x["padding_mask"]], 1)
    with torch.no_grad():
        reading = hf(
            input_ids=torch.tensor(joined, dtype=torch.long), attention_mask=torch.tensor(mask)
        ).logits.numpy()[:, L:]
    np.testing.assert_allclose(got[real], reading[real], rtol=5e-5, atol=5e-5)


def test_peft_loads_our_t5_prompt_and_gives_our_logits(tmp_path):
    """Optional (torch, transformers, peft): a shallow PromptedT5's prompt saved with
    `save_peft_adapter` (num_transformer_submodules=1) and loaded by PEFT into the HF T5
    whose weights the keras-hub backbone holds gives PEFT the package's logits."""
    peft, script = _peers()
    hf = script.hf_model("t5", seed=4)
    hf.save_pretrained(tmp_path / "base")
    backbone = t5_backbone_from_hf(str(tmp_path / "base"))
    model = prompts.prompt_t5(backbone, length=L, seed=3)
    path = prompts.save_peft_adapter(model, tmp_path / "t5")
    wrapped = peft.PeftModel.from_pretrained(script.hf_model("t5", seed=4), path).eval()
    x = script.t5_batch(seed=2)
    got = script.peft_t5_logits(wrapped, x)
    ours = numpy(model.lm_logits(model(x)["decoder_sequence_output"]))
    np.testing.assert_allclose(ours, got, rtol=5e-5, atol=5e-5)
