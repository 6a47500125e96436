"""Writes the Hugging Face PEFT fixtures that tests/prompts/test_peft_adapters.py reads.

For each decoder family (GPT-2, Llama with grouped-query attention, Gemma) a tiny random
transformers model (`base/`: config.json + model.safetensors, what keras-hub's HF converter
reads), a PEFT prompt-tuning and a prefix-tuning adapter trained a few Adam steps by PEFT
itself (`prompt_tuning/`, `prefix_tuning/`: adapter_config.json + adapter_model.safetensors,
PEFT's `save_pretrained`), and PEFT's outputs on a fixed batch (`expected.npz`): the logits
of both adapters (right padding) and greedy continuations by a loop over PEFT's forward
(PEFT 0.21's prompt-learning `generate` is broken on transformers 5.x). For T5 (`t5/`):
the base model, a SEQ_2_SEQ_LM prompt-tuning adapter and PEFT's logits (the test maps the
weights to keras-hub's T5Backbone itself: keras-hub has no HF T5 converter).

Run from the repository root, with the peers on PYTHONPATH (never needed by the suite):

    PYTHONPATH=/tmp/peers python tests/prompts/peft_fixtures/make_peft_fixtures.py

Last run with torch 2.13.0 (CPU), transformers 5.24.0, peft 0.21.2. The test module imports
these functions too, to compare against PEFT live where it is installed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("gpt2", "llama", "gemma")
METHODS = ("prompt_tuning", "prefix_tuning")
VOCABULARY = 48
LENGTH = 3  # num_virtual_tokens
GREEDY_STEPS = 4
INIT_STD = 0.25  # not HF's 0.02: logits of order 1, so that a wrong layout or scale shows


def _torch():
    sys.modules.setdefault("triton", None)  # torch after TensorFlow: no triton (segfaults)
    import torch

    return torch


def hf_t5_config():
    """A tiny T5 (2 + 2 layers, 2 heads of 8, ReLU feed-forward, tied embeddings)."""
    import transformers

    return transformers.T5Config(
        vocab_size=VOCABULARY,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        feed_forward_proj="relu",
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def hf_config(family):
    """A tiny transformers config: 2 layers; Llama 4 query heads sharing 2 key/value heads;
    Gemma hidden 16 (its embedding scale sqrt(16) = 4), 2 query heads sharing 1."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCABULARY,
            n_positions=32,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=64,  # keras-hub's converter assumes 4 * n_embd
            bos_token_id=1,
            eos_token_id=1,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=INIT_STD,
        )
    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCABULARY,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            initializer_range=INIT_STD,
        )
    return transformers.GemmaConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=INIT_STD,
    )


def hf_model(family, seed=0):
    """The tiny transformers causal LM of `family`, random weights from `seed` (float32,
    eval mode; norm weights perturbed so that they matter)."""
    torch = _torch()
    import transformers

    torch.manual_seed(seed)
    if family == "t5":
        model = transformers.T5ForConditionalGeneration(hf_t5_config())
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln_" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.float().eval()


def batch(seed=1):
    """Two rows of 5 tokens, the second right-padded to 3 real tokens."""
    rng = np.random.default_rng(seed)
    return {
        "token_ids": rng.integers(2, VOCABULARY, (2, 5)).astype("int32"),
        "padding_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "int32"),
    }


def peft_model(model, method, seed=0, steps=5, prefix_projection=False):
    """`model` wrapped by PEFT (prompt tuning, RANDOM init; or prefix tuning), then trained
    `steps` Adam steps (lr 0.05) on random sequences by PEFT's forward and loss."""
    torch = _torch()
    import peft

    torch.manual_seed(seed)
    task_type = "SEQ_2_SEQ_LM" if model.config.model_type == "t5" else "CAUSAL_LM"
    if method == "prompt_tuning":  # seq2seq: PEFT's default 2 * LENGTH rows, the first used
        config = peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=LENGTH)
    else:
        config = peft.PrefixTuningConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=LENGTH,
            prefix_projection=prefix_projection,
            encoder_hidden_size=12,
        )
    wrapped = peft.get_peft_model(model, config)
    optimizer = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=0.05)
    generator = np.random.default_rng(seed)
    for _ in range(steps):
        ids = torch.tensor(generator.integers(2, VOCABULARY, (4, 6)), dtype=torch.long)
        loss = wrapped(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return wrapped.eval()


def peft_logits(wrapped, x):
    """PEFT's logits [B, S, V] of the real positions of `x` (the virtual tokens' dropped)."""
    torch = _torch()
    with torch.no_grad():
        logits = wrapped(
            input_ids=torch.tensor(x["token_ids"], dtype=torch.long),
            attention_mask=torch.tensor(x["padding_mask"], dtype=torch.long),
        ).logits.numpy()
    return logits[:, -x["token_ids"].shape[1] :]


def t5_batch(seed=1):
    """Encoder tokens (the second row right-padded) and decoder tokens, as keras-hub's
    T5Backbone inputs."""
    rng = np.random.default_rng(seed)
    return {
        "encoder_token_ids": rng.integers(2, VOCABULARY, (2, 5)).astype("int32"),
        "encoder_padding_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "int32"),
        "decoder_token_ids": np.concatenate(
            [np.zeros((2, 1), "int32"), rng.integers(2, VOCABULARY, (2, 3)).astype("int32")], 1
        ),
        "decoder_padding_mask": np.ones((2, 4), "int32"),
    }


def peft_t5_logits(wrapped, x):
    """PEFT's seq2seq logits [B, T, V] for a `t5_batch`."""
    torch = _torch()

    def t(name):
        return torch.tensor(x[name], dtype=torch.long)

    with torch.no_grad():
        return wrapped(
            input_ids=t("encoder_token_ids"),
            attention_mask=t("encoder_padding_mask"),
            decoder_input_ids=t("decoder_token_ids"),
            decoder_attention_mask=t("decoder_padding_mask"),
        ).logits.numpy()


def write_t5(directory):
    """T5: the base model, a prompt-tuning adapter (PEFT's 2 * L rows) and its logits."""
    out = os.path.join(directory, "t5")
    hf_model("t5").save_pretrained(os.path.join(out, "base"))
    wrapped = peft_model(hf_model("t5"), "prompt_tuning", seed=3)
    wrapped.save_pretrained(os.path.join(out, "prompt_tuning"))
    x = t5_batch()
    np.savez(
        os.path.join(out, "expected.npz"), prompt_tuning_logits=peft_t5_logits(wrapped, x), **x
    )
    for path in (os.path.join(out, "prompt_tuning", "README.md"),):
        if os.path.exists(path):
            os.remove(path)
    return out


def peft_greedy(wrapped, token_ids, steps=GREEDY_STEPS):
    """Greedy continuation of `token_ids` [1, n] by `steps` full forward passes of PEFT."""
    ids = np.asarray(token_ids, "int32")
    for _ in range(steps):
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        step = np.argmax(peft_logits(wrapped, x)[:, -1], axis=-1)
        ids = np.concatenate([ids, step[:, None].astype("int32")], axis=1)
    return ids


def write(family, directory):
    """The fixtures of `family` under `directory`/`family`."""
    out = os.path.join(directory, family)
    model = hf_model(family)
    model.save_pretrained(os.path.join(out, "base"))
    x = batch()
    expected = {"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]}
    for method in METHODS:
        # The Llama prefix is trained through PEFT's MLP (prefix_projection): its file holds
        # the MLP's output all the same.
        wrapped = peft_model(
            hf_model(family),
            method,
            seed=3,
            prefix_projection=(family == "llama" and method == "prefix_tuning"),
        )
        wrapped.save_pretrained(os.path.join(out, method))
        expected[f"{method}_logits"] = peft_logits(wrapped, x)
        expected[f"{method}_greedy"] = peft_greedy(wrapped, x["token_ids"][:1, :4])
    np.savez(os.path.join(out, "expected.npz"), **expected)
    for name in ("README.md",):
        path = os.path.join(out, "base", name)
        if os.path.exists(path):
            os.remove(path)
    for method in METHODS:
        path = os.path.join(out, method, "README.md")
        if os.path.exists(path):
            os.remove(path)
    return out


def main(directory=HERE):
    import peft
    import torch
    import transformers

    for family in FAMILIES:
        print("wrote", write(family, directory))
    print("wrote", write_t5(directory))
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    with open(os.path.join(directory, "versions.json"), "w") as f:
        json.dump(versions, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
