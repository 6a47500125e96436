"""`trainers/promptability_decoder.py` (a small GPT-2 on the offline prompted tasks:
zero-shot, prompt vs prefix vs LoRA vs full fine-tuning) and its pre-training
`trainers.experiments.small_gpt2`.

Fast: the teacher-forcing arrays against the rank-classification score (the training loss
IS the scored answer's nats), the pre-training chunks, the config errors and flags. The
default suite also trains each method once on a tiny GPT-2 (what trains, what stays
bit-identical, the parameter counts). Slow (`-m slow`): the whole program at a tiny budget
(a 2-layer GPT-2 pre-trained for 10 steps, one dataset, 4 shots, 2 seeds; 75 s on 2
shared cores at load 8, more the first time for the SentencePiece model and the
pre-training, cached after)."""

import dataclasses

import numpy as np
import pytest
from absl import flags

pytest.importorskip("django", reason="the offline prompted tasks need Django's catalogs")

from tf_metaalign.prompts.templates import PromptedExample  # noqa: E402
from trainers import promptability_decoder_config as DC  # noqa: E402
from trainers import promptability_decoder_data as DD  # noqa: E402
from trainers import promptability_decoder_report as DR  # noqa: E402
from trainers import promptability_decoder_run as DRun  # noqa: E402
from trainers import settings  # noqa: E402
from trainers.experiments import small_gpt2  # noqa: E402

CACHE = "/tmp/tf_metaalign_test_decoder_cache"  # shared by runs: pre-training is cached


class CharTokenizer:
    """One id per character (3 + ord % 50), called as a keras-hub tokenizer is."""

    def __call__(self, text):
        if isinstance(text, list):
            return [self(t) for t in text]
        return np.asarray([3 + ord(ch) % 50 for ch in text], np.int32)


def _example(text, choices, label):
    return PromptedExample(text, choices[label], list(choices), label)


def tiny_config(**overrides):
    values = dict(
        gpt2_size="tiny",
        vocabulary_size=600,
        corpus_max_texts=3000,
        pretrain_steps=10,
        pretrain_batch_size=8,
        pretrain_sequence_length=32,
        heldout_texts=100,
        max_sequence_length=32,
        max_train=40,
        eval_examples=8,
        datasets=("wordnet_gloss_match",),
        templates_per_dataset=1,
        input_length=24,
        answer_length=4,
        shots=4,
        epochs=3,
        batch_size=4,
        prompt_length=2,
        lora_rank=2,
        seeds=(0, 1),
        cost_rounds=1,
        cost_steps=2,
        bootstrap_resamples=100,
        log_every=5,
        cache_dir=CACHE,
    )
    values.update(overrides)
    return DC.Config(**values)


def test_the_training_loss_is_the_scored_answers_nats():
    """The masked cross-entropy on `training_arrays` == `answer_nll` through
    `causal_lm_score_fn` (one packing for training and for rank classification), and the
    weights sit exactly on the answer tokens' predictions (EOS included)."""
    import keras

    from tf_metaalign import prompts

    codec = DD.Codec(CharTokenizer(), input_length=6, answer_length=4)
    examples = [
        _example("a long input cut from the left", ["yes", "no"], 0),
        _example("hi", ["no", "yes"], 0),
        _example("abc", ["x", "yz"], 1),
    ]
    x, y, w = DD.training_arrays(examples, codec)
    # "hi": EOS h i | n o EOS: answer "no" -> its 2 ids + EOS, predicted from positions 2..4.
    hi, no = CharTokenizer()("hi").tolist(), CharTokenizer()("no").tolist()
    assert x["token_ids"][1, :6].tolist() == [DD.EOS_ID, *hi, *no, DD.EOS_ID]
    assert y[1, :5].tolist() == [*hi, *no, DD.EOS_ID]
    assert w[1].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    # Cut from the left: the input keeps its last 5 ids after the EOS.
    assert x["token_ids"][0, :6].tolist() == [DD.EOS_ID, *CharTokenizer()(" left").tolist()]

    keras.utils.set_random_seed(0)
    lm = small_gpt2.build_gpt2(small_gpt2.gpt2_config("tiny", 60, 16))
    logits = np.asarray(lm(x), np.float64)
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, y[..., None], -1)[..., 0]
    loss = float((nll * w).sum() / w.sum())
    score_fn = prompts.causal_lm_score_fn(DRun.TracedForward(lm), pad_id=DD.PAD_ID)
    np.testing.assert_allclose(DRun.answer_nll(score_fn, examples, codec), loss, rtol=1e-5)


def test_causal_lm_chunks_are_eos_separated_documents_in_seeded_order():
    docs = [np.array([5, 6]), np.array([7]), np.array([8, 9, 10])]
    rows = small_gpt2.causal_lm_chunks(docs, sequence_length=3, count=3, seed=4)
    assert rows.shape == (3, 4)
    one_pass = rows[:2].reshape(-1).tolist()  # 9 ids per pass: 2 rows of 4, 1 dropped
    order = np.random.default_rng([4, 0]).permutation(3)
    stream = [i for k in order for i in [1, *docs[k].tolist()]]
    assert one_pass == stream[:8]
    np.testing.assert_array_equal(rows, small_gpt2.causal_lm_chunks(docs, 3, 3, seed=4))


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="max_sequence_length"):
        tiny_config(prompt_length=20).check()
    with pytest.raises(ValueError, match="learning_rates"):
        DC._parse_rates(["prompt=0.1", "adapter=1"])
    assert DC._parse_rates(["lora=0.5"]) == {"lora": 0.5}
    assert tiny_config(learning_rates={"lora": 0.5}).rate("lora") == 0.5
    assert tiny_config().rate("full") == DC.DEFAULT_RATES["full"]
    with pytest.raises(ValueError, match="seeds"):
        tiny_config(seeds=(1, 1)).check()


def test_every_setting_is_a_flag_with_help():
    values = flags.FlagValues()
    names = settings.define_flags_from(DC.Config, values)
    assert names == [f.name for f in dataclasses.fields(DC.Config) if f.metadata.get("flag")]
    assert all(values[n].help.strip() for n in names)
    values(["program", "--learning_rates=prefix=0.05", "--seeds=3,4"])
    config = settings.config_from_flags(DC.Config, values)
    assert config.learning_rates == {"prefix": 0.05} and config.seeds == (3, 4)


def _lora_count(layers, hidden, heads, rank):
    """keras-hub's enable_lora on the query and value EinsumDense layers (kernel [H, heads,
    head_dim]): A [H, heads, r], B [r, head_dim], and the layer's bias [heads, head_dim]
    (the targeted layer is set trainable whole)."""
    head_dim = hidden // heads
    return layers * 2 * (hidden * heads * rank + rank * head_dim + hidden)


def test_methods_train_what_they_say_and_leave_the_rest_bit_identical():
    """On a tiny GPT-2 (no pre-training): one short training run of each trained method.
    Prompt and prefix train their prompt only (the shared backbone bit-identical), LoRA its
    factors and q/v biases (its other weights bit-identical), full a copy; the counts are
    the formulas; `reset` puts LoRA / full back at the pre-trained weights."""
    import keras

    keras.utils.set_random_seed(0)
    config = tiny_config(shots=4, epochs=2, batch_size=2, input_length=8, answer_length=3)
    backbone = small_gpt2.build_gpt2(small_gpt2.gpt2_config("tiny", 60, 32)).backbone
    weights = [w.numpy().copy() for w in backbone.weights]
    codec = DD.Codec(CharTokenizer(), config.input_length, config.answer_length)
    shots = [_example(t, ["no", "yes"], i % 2) for i, t in enumerate(["ab", "cd", "ef", "gh"])]
    size = small_gpt2.GPT2_SIZES["tiny"]
    layers, hidden, heads = size["num_layers"], size["hidden_dim"], size["num_heads"]
    expected = {
        "prompt": config.prompt_length * hidden,
        "prefix": config.prompt_length * layers * 2 * hidden,
        "lora": _lora_count(layers, hidden, heads, config.lora_rank),
        "full": backbone.count_params(),
    }
    for name in DC.TRAINED:
        method = DRun.Method(name, backbone, weights, config)
        assert method.trainable == expected[name], name
        method.reset(3)
        start = [v.numpy().copy() for v in method.model.trainable_variables]
        before, after = method.train(shots, codec, seed=3)
        assert after < before, name
        moved = [
            not np.array_equal(v.numpy(), s)
            for v, s in zip(method.model.trainable_variables, start)
        ]
        assert any(moved), name
        assert all(np.array_equal(w.numpy(), p) for w, p in zip(backbone.weights, weights)), name
        if name == "lora":
            trained = {id(v) for v in method.model.trainable_variables}
            frozen = [(w, p) for w, p in zip(method.own, weights) if id(w) not in trained]
            assert len(frozen) == len(weights) - layers * 2  # all but the q / v biases
            assert all(np.array_equal(w.numpy(), p) for w, p in frozen)
        if name in ("lora", "full"):
            method.reset(3)
            own = method.own if name == "lora" else method.backbone.weights
            assert all(np.array_equal(w.numpy(), p) for w, p in zip(own, weights))
            if name == "lora":  # fresh factors: B = 0, so the model is the pre-trained one
                assert all(not b.numpy().any() for _, b in method.lora)


@pytest.mark.slow
def test_tiny_run_rows_counts_frozen_weights_and_intervals():
    config = tiny_config()
    config.check()
    results = DRun.run(config, log=lambda message: None)
    methods = results["methods"]
    assert list(methods) == list(DC.METHODS)
    rows = {row["method"]: row for row in results["summary"]}
    assert list(rows) == [*DC.METHODS, "majority"]

    # Trainable parameters: the formula of each method.
    size = small_gpt2.GPT2_SIZES["tiny"]
    layers, hidden, heads = size["num_layers"], size["hidden_dim"], size["num_heads"]
    r, length = config.lora_rank, config.prompt_length
    assert methods["zero_shot"]["trainable_parameters"] == 0
    assert methods["prompt"]["trainable_parameters"] == length * hidden
    assert methods["prefix"]["trainable_parameters"] == length * layers * 2 * hidden
    assert methods["lora"]["trainable_parameters"] == _lora_count(layers, hidden, heads, r)
    full = small_gpt2.build_gpt2(small_gpt2.gpt2_config("tiny", 600, 32)).backbone
    assert methods["full"]["trainable_parameters"] == full.count_params()

    # Prompt-only training leaves the shared pre-trained backbone bit-identical; LoRA its
    # frozen weights; full fine-tuning trains a copy (the pre-trained one stays) and fits
    # its shots (the answer nats fall).
    for name in DC.METHODS:
        assert methods[name]["bit_identical"]["pretrained_backbone"], name
    assert methods["lora"]["bit_identical"]["frozen_weights"]
    before, after = np.asarray(list(methods["full"]["answer_nll_before_after"].values())).T
    assert (after < before).all()

    # Per seed: the accuracy is the mean over the pairs of the stored correctness; over
    # seeds: the mean and the 95% t interval (t_{0.975, 1} = 12.706), which contains it.
    for name in DC.METHODS:
        per_seed = []
        for seed in ("0", "1"):
            pairs = methods[name]["correct"][seed]
            assert len(pairs) == 1 and all(len(v) == config.eval_examples for v in pairs.values())
            per_seed.append(np.mean([np.mean(v) for v in pairs.values()]))
            assert methods[name]["accuracy"][seed] == pytest.approx(per_seed[-1])
        row = rows[name]
        assert row["accuracy"] == pytest.approx(np.mean(per_seed))
        assert row["ci95"] == pytest.approx(12.706 * np.std(per_seed, ddof=1) / np.sqrt(2))
        assert row["accuracy"] - row["ci95"] <= np.mean(per_seed) <= row["accuracy"] + row["ci95"]
        if name != "full":
            diffs = [methods[name]["accuracy"][s] - methods["full"]["accuracy"][s] for s in "01"]
            assert row["minus_full"] == pytest.approx(np.mean(diffs))
            assert row["minus_full_significant"] == (
                row["minus_full_ci95"] is not None and abs(np.mean(diffs)) > row["minus_full_ci95"]
            )
    assert rows["full"]["step_vs_full"] == pytest.approx(1.0)
    assert all(rows[m]["step_ms"] > 0 for m in DC.TRAINED)
    assert "zero_shot" not in {m for m in methods if "step_ms_interleaved" in methods[m]}
    text = DR.format_report(results["summary"])
    assert all(name in text for name in DC.METHODS)
