"""The promptability experiment program `trainers/promptability.py` (its stages in
`trainers/promptability_*.py`) and its LM wrapper `tf_metaalign.prompts.t5_lm`.

Fast: the data the program builds (teacher-forcing batches, meta-batches of one
dataset-template per task), the masked token loss against NumPy, the ARG table and its
p-values against `prompts.evaluation` recomputed by hand, the configuration errors.
Slow (`-m slow`; 4 min on 2 quiet cores, ~8 on shared ones, mostly tracing): a tiny Config end to
end with every configuration and both prompt modes.
"""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("django", reason="the offline prompted tasks need Django's catalogs")

from tf_metaalign.prompts import evaluation as E  # noqa: E402
from tf_metaalign.prompts import t5_lm  # noqa: E402
from trainers import promptability_config as PC  # noqa: E402
from trainers import promptability_data as PD  # noqa: E402
from trainers import promptability_evaluate as PE  # noqa: E402
from trainers import promptability_report as PR  # noqa: E402
from trainers import promptability_run as PRun  # noqa: E402
from trainers import promptability_train as PT  # noqa: E402

CACHE = "/tmp/tf_metaalign_test_promptability_cache"  # shared by runs: pre-training is cached


def tiny_config(**overrides):
    values = dict(
        t5_size="tiny",
        vocabulary_size=600,
        corpus_max_texts=3000,
        pretrain_steps=10,
        pretrain_batch_size=8,
        pretrain_sequence_length=32,
        max_train=64,
        eval_examples=16,
        templates_per_dataset=1,
        encoder_length=32,
        decoder_length=6,
        prompt_length=2,
        steps=4,
        batch_size=4,
        meta_batch=2,
        inner_steps=1,
        task_batch_size=2,
        shots=4,
        few_shot_epochs=1,
        few_shot_batch_size=4,
        bootstrap_resamples=200,
        minilm=True,
        minilm_prompt_length=2,
        minilm_sequence_length=16,
        minilm_epochs=1,
        log_every=2,
        cache_dir=CACHE,
    )
    values.update(overrides)
    return PC.Config(**values)


class CharTokenizer:
    """A stand-in tokenizer: one id per character (3 + ord % 50), as a keras-hub tokenizer
    is called (one string -> ids, a list -> a list of ids)."""

    def __call__(self, text):
        if isinstance(text, list):
            return [self(t) for t in text]
        return np.asarray([3 + ord(ch) % 50 for ch in text], np.int32)


def test_encode_examples_is_teacher_forcing_with_eos_and_pad_zero():
    x, y = t5_lm.encode_examples(
        [("abc", "xy"), ("abcdefgh", "long target")],
        CharTokenizer(),
        encoder_length=5,
        decoder_length=4,
    )
    t = CharTokenizer()
    np.testing.assert_array_equal(x["encoder_token_ids"][0], list(t("abc")) + [1, 0])
    np.testing.assert_array_equal(x["encoder_token_ids"][1], list(t("abcd")) + [1])  # cut
    np.testing.assert_array_equal(y[0], list(t("xy")) + [1, 0])
    np.testing.assert_array_equal(y[1], list(t("lon")) + [1])
    # Decoder input = targets shifted right with the pad id 0 as the start token.
    np.testing.assert_array_equal(x["decoder_token_ids"][:, 0], [0, 0])
    np.testing.assert_array_equal(x["decoder_token_ids"][:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x["decoder_padding_mask"][0], [1, 1, 1, 1])
    np.testing.assert_array_equal(x["encoder_padding_mask"][0], [1, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="decoder_length"):
        t5_lm.encode_examples([("a", "b")], CharTokenizer(), 5, 1)


def test_masked_token_loss_is_the_mean_over_real_target_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 7)).astype("float32")
    y = np.array([[3, 1, 0, 0], [5, 2, 6, 1]])
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, y[..., None], -1)[..., 0]
    expected = nll[y != 0].mean()  # 6 real tokens; Keras's default would divide by 8
    np.testing.assert_allclose(float(t5_lm.masked_token_loss()(y, logits)), expected, rtol=1e-5)


def test_meta_batches_draw_each_task_from_one_dataset_and_template():
    config = tiny_config(
        steps=8, batch_size=4, meta_batch=2, inner_steps=2, task_batch_size=2, seen_examples=5
    )
    assert config.meta_steps == 8 * 4 // (2 * 3 * 2) == 2
    tasks = PD.prepare_tasks(config)
    tokenizer = CharTokenizer()
    (sx, sy, qx), qy = PD.meta_batches(tasks, config, tokenizer)
    m = config.meta_steps * config.meta_batch
    assert sx["encoder_token_ids"].shape == (m, 2, 2, config.encoder_length)
    assert sy.shape == (m, 2, 2, config.decoder_length)
    assert qx["decoder_token_ids"].shape == (m, 2, config.decoder_length)
    assert qy.shape == (m, 2, config.decoder_length)
    # Every task's examples come from the mixture draw's dataset and template.
    from trainers.experiments.prompted_mixture import PromptedMixture

    mixture = PromptedMixture(tasks.training, cap=config.mixture_cap, seed=config.seed)
    for k in range(m):
        name, _, template_name = mixture.draw(k)
        dataset = tasks.training[name]
        template = next(t for t in dataset.templates if t.name == template_name)
        targets = {
            tuple(
                t5_lm.encode_examples(
                    [("", template.apply(e).target_text)], tokenizer, 4, config.decoder_length
                )[1][0]
            )
            for e in dataset.train
        }
        for row in list(sy[k].reshape(-1, config.decoder_length)) + list(qy[k]):
            assert tuple(row) in targets
    # No training example of an unseen task type is used.
    assert not set(tasks.training) & set(tasks.evaluation)
    assert {d for d, _ in tasks.pairs} == set(tasks.evaluation)
    # The positive control scores the training datasets' TEST examples only (none of them is
    # a training example), with their own choice counts; off, it is empty.
    assert {d for d, _ in tasks.seen_pairs} == set(tasks.training)
    assert tasks.seen_num_choices == {n: d.num_choices for n, d in tasks.training.items()}
    for (name, template), (_, test) in tasks.seen_pairs.items():
        dataset = tasks.training[name]
        # A seeded sample of 5, the same examples under every template, not the first 5
        # (test splits are ordered by class).
        whole = dataset.prompted("test", template)
        keep = E.sample_few_shot(len(whole), 5, config.seed, name, "control")
        assert test == [whole[i] for i in keep]
        trained = {e.input_text for e in dataset.prompted("train", template)}
        assert not trained & {e.input_text for e in test}
    # Not the first examples: on Django's component split (ordered by class) the first 16
    # are one class; the control's sample is not.
    wide = PD.prepare_tasks(dataclasses.replace(config, seen_examples=8, eval_examples=64))
    component = wide.training["django_component_en"]
    assert len({e["label"] for e in component.test[:16]}) == 1
    assert len({e.label for e in wide.seen_pairs[("django_component_en", "which_part")][1]}) > 1
    off = PD.prepare_tasks(dataclasses.replace(config, seen_examples=0))
    assert (
        off.seen_pairs == {}
        and off.seen_num_choices == {}
        and off.pairs.keys() == tasks.pairs.keys()
    )


def test_arg_table_equals_evaluation_arg_and_bootstrap():
    rng = np.random.default_rng(1)
    pairs = [("a", "t1"), ("a", "t2"), ("b", "t1")]
    choices = {"a": 2, "b": 3}
    correct = {
        c: {
            s: {
                m: {k: (rng.random(20) < 0.4 + 0.1 * i).astype(int) for k in pairs}
                for m in ("shallow", "deep")
            }
            for s in ("zero_shot", "few_shot")
        }
        for i, c in enumerate(("none", "mtl_t", "mtl_tp"))
    }
    rows = PR.arg_table(
        correct, choices, ("none", "mtl_t", "mtl_tp"), ("shallow", "deep"), resamples=300, seed=3
    )
    by_name = {r["configuration"]: r for r in rows}
    for c in ("none", "mtl_t", "mtl_tp"):
        for s in ("zero_shot", "few_shot"):
            for m in ("shallow", "deep"):
                acc = {k: v.mean() for k, v in correct[c][s][m].items()}
                # Hand ARG: datasets weigh equally, templates averaged within a dataset.
                gain = {k: (a - 1 / choices[k[0]]) * choices[k[0]] for k, a in acc.items()}
                hand = ((gain[("a", "t1")] + gain[("a", "t2")]) / 2 + gain[("b", "t1")]) / 2
                assert by_name[c][f"{s}_{m}"] == pytest.approx(hand, abs=1e-12)
    p = E.paired_bootstrap_arg(
        correct["mtl_tp"]["few_shot"]["deep"], correct["mtl_t"]["few_shot"]["deep"], choices, 300, 3
    ).p_value
    assert by_name["mtl_tp"]["few_shot_deep_p_vs_mtl_t"] == p
    assert "zero_shot_shallow_p_vs_none" not in by_name["none"]
    assert "few_shot_deep_p_vs_mtl_t" not in by_name["mtl_t"]
    assert "mtl_tp" in PR.format_arg_table(rows, ("shallow", "deep"))
    # The control's table: one setting, its own datasets' choice counts.
    seen = {c: {"seen_zero_shot": correct[c]["zero_shot"]} for c in correct}
    majority = {k: (rng.random(20) < 0.5).astype(int) for k in pairs}
    seen_rows = PR.arg_table(
        seen,
        {"a": 4, "b": 3},
        ("none", "mtl_t", "mtl_tp"),
        ("shallow", "deep"),
        300,
        3,
        settings=("seen_zero_shot",),
        majority=majority,
    )
    acc = {k: v.mean() for k, v in correct["mtl_t"]["zero_shot"]["deep"].items()}
    gain = {k: (a - 1 / c) * c for (k, a), c in zip(acc.items(), (4, 4, 3))}
    hand = ((gain[("a", "t1")] + gain[("a", "t2")]) / 2 + gain[("b", "t1")]) / 2
    assert seen_rows[1]["seen_zero_shot_deep"] == pytest.approx(hand, abs=1e-12)
    assert set(seen_rows[1]) == {
        "configuration",
        "seen_zero_shot_shallow",
        "seen_zero_shot_deep",
        "seen_zero_shot_shallow_p_vs_none",
        "seen_zero_shot_deep_p_vs_none",
        "seen_zero_shot_shallow_p_vs_majority",
        "seen_zero_shot_deep_p_vs_majority",
    }
    # Every cell, none's too, against always-the-majority (the control's bar).
    for row, c in zip(seen_rows, ("none", "mtl_t", "mtl_tp")):
        assert (
            row["seen_zero_shot_deep_p_vs_majority"]
            == E.paired_bootstrap_arg(
                correct[c]["zero_shot"]["deep"], majority, {"a": 4, "b": 3}, 300, 3
            ).p_value
        )
    text = PR.format_arg_table(seen_rows, ("shallow", "deep"), settings=("seen_zero_shot",))
    assert "seen 0-shot deep" in text and "16-shot" not in text
    assert "{vs majority p=" in text and "vs majority" not in PR.format_arg_table(
        rows, ("shallow", "deep")
    )


class _OneTemplateDataset:
    """A stand-in `PromptedDataset`: one template "t" whose training targets are given."""

    def __init__(self, targets):
        from tf_metaalign.prompts.templates import PromptedExample

        self.templates = [type("T", (), {"name": "t"})()]
        self._train = [PromptedExample(f"input {i}", t) for i, t in enumerate(targets)]

    def prompted(self, split):
        assert split == "train"
        return {"t": self._train}


def test_label_prior_loss_is_the_answer_distribution_entropy_per_token():
    """By hand: targets "a" x3 and "bb" x1 under one template; a draw of each costs
    -log(3/4) and -log(1/4) nats over 1+EOS and 2+EOS characters (CharTokenizer), and with
    decoder_length 2 "bb" is cut to 1 token + EOS, as training cuts it."""
    tasks = PD.Tasks(
        training={"d": _OneTemplateDataset(["a", "a", "bb", "a"])},
        evaluation={},
        pairs={},
        num_choices={},
    )
    draws = [("d", "t", "x", "a"), ("d", "t", "y", "bb")]
    nll = np.log(4 / 3) + np.log(4)
    for decoder_length, tokens in ((8, 5), (2, 4)):
        _, y = t5_lm.encode_examples([d[2:] for d in draws], CharTokenizer(), 4, decoder_length)
        assert PD.label_prior_loss(draws, tasks, y) == pytest.approx(nll / tokens)


def test_token_loss_weighs_every_token_once_across_batches():
    """`token_loss` = sum of token NLLs / number of real tokens over all rows, whatever the
    batch size (Keras's `evaluate` would average the per-batch means instead)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 7)).astype("float32")
    y = np.array([[3, 1, 0, 0], [5, 2, 6, 1], [4, 1, 0, 0]])
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, y[..., None], -1)[..., 0]
    expected = nll[y != 0].sum() / (y != 0).sum()

    def lm(x):
        return logits[x["row"]]

    x = {"row": np.arange(3)}
    for batch_size in (1, 2, 64):
        assert PT.token_loss(lm, x, y, batch_size) == pytest.approx(expected, rel=1e-6)
    per_batch_means = np.mean([nll[:2][y[:2] != 0].mean(), nll[2:][y[2:] != 0].mean()])
    assert abs(per_batch_means - expected) > 1e-3  # what batch-averaging would have given


def test_majority_correctness_answers_the_most_frequent_training_label():
    from types import SimpleNamespace as Example

    train = [Example(label=y) for y in (2, 0, 2, 1, 2, 0)]
    test = [Example(label=y) for y in (2, 1, 2, 0)]
    tie = [Example(label=y) for y in (3, 1, 1, 3)]  # a tie: the smaller label
    out = PR.majority_correctness({("a", "t"): (train, test), ("b", "t"): (tie, test)})
    np.testing.assert_array_equal(out[("a", "t")], [1, 0, 1, 0])
    np.testing.assert_array_equal(out[("b", "t")], [0, 1, 0, 0])
    # A constant answer scores above chance on an imbalanced many-choice task: 1/2 right
    # of 4 choices is ARG (0.5 - 0.25) * 4 = +1.
    assert E.average_relative_gain({("a", "t"): out[("a", "t")]}, {"a": 4}) == 1.0


def test_config_errors_name_the_argument():
    for kwargs, name in (
        (dict(configurations=("mtl_t",)), "configurations"),
        (dict(configurations=("none", "t0")), "configurations"),
        (dict(modes=("wide",)), "modes"),
        (dict(pretrain_objective="mlm"), "pretrain_objective"),
        (dict(steps=0), "steps"),
        (dict(templates_per_dataset=-1), "templates_per_dataset"),
        (dict(seen_examples=-1), "seen_examples"),
        (dict(decoder_length=1), "decoder_length"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(shots=2000), "shots"),
    ):
        with pytest.raises(ValueError, match=name):
            PC.Config(**kwargs).check()
    PC.Config().check()
    PC.Config(**PC.FULL_RUN).check()


@pytest.mark.slow
def test_program_end_to_end_tiny(tmp_path):
    from tf_metaalign import prompts
    from trainers import common

    config = tiny_config()
    results, weights = PRun.run(config, log=lambda m: None)
    path = common.write_json(tmp_path / "results.json", results)
    saved = json.loads(path.read_text())

    # Every configuration, both modes, zero- and few-shot, for every evaluation pair.
    pairs = saved["evaluation_pairs"]
    assert [r["configuration"] for r in saved["arg_table"]] == list(PC.CONFIGURATIONS)
    for c in PC.CONFIGURATIONS:
        for s in ("zero_shot", "few_shot"):
            for m in PC.MODES:
                assert set(saved["correct"][c][s][m]) == set(pairs)
        for m in PC.MODES:
            assert set(saved["correct"][c]["seen_zero_shot"][m]) == set(saved["seen_pairs"])
    # The positive control's table, recomputed from its stored correctness, with its
    # p-values against always answering the training majority.
    majority = PR.majority_correctness(PD.prepare_tasks(config).seen_pairs)
    for row in saved["seen_arg_table"]:
        for m in PC.MODES:
            per = {
                tuple(k.split("/", 1)): np.asarray(v)
                for k, v in saved["correct"][row["configuration"]]["seen_zero_shot"][m].items()
            }
            assert row[f"seen_zero_shot_{m}"] == pytest.approx(
                E.average_relative_gain(per, saved["seen_num_choices"]), abs=1e-12
            )
            assert (
                row[f"seen_zero_shot_{m}_p_vs_majority"]
                == E.paired_bootstrap_arg(
                    per,
                    majority,
                    saved["seen_num_choices"],
                    config.bootstrap_resamples,
                    config.seed,
                ).p_value
            )
    # ARG recomputed from the stored per-example correctness equals the table.
    choices = saved["num_choices"]
    for row in saved["arg_table"]:
        for s in ("zero_shot", "few_shot"):
            for m in PC.MODES:
                per = {
                    tuple(k.split("/", 1)): np.asarray(v)
                    for k, v in saved["correct"][row["configuration"]][s][m].items()
                }
                assert row[f"{s}_{m}"] == pytest.approx(
                    E.average_relative_gain(per, choices), abs=1e-12
                )
                if row["configuration"] != "none":
                    none = {
                        tuple(k.split("/", 1)): np.asarray(v)
                        for k, v in saved["correct"]["none"][s][m].items()
                    }
                    assert (
                        row[f"{s}_{m}_p_vs_none"]
                        == E.paired_bootstrap_arg(
                            per, none, choices, config.bootstrap_resamples, config.seed
                        ).p_value
                    )
    # Prompt-only continued pre-training leaves the transformer bit-identical; the others
    # move it.
    for key in ("mtl_p/shallow", "mtl_p/deep"):
        for a, b in zip(weights[key], weights["pretrained"]):
            np.testing.assert_array_equal(a, b)
    for key in ("mtl_t", "mtl_tp/shallow", "mtl_tp/deep", "fomaml/deep", "reptile/shallow"):
        assert any(not np.array_equal(a, b) for a, b in zip(weights[key], weights["pretrained"]))
    changes = {
        (r["configuration"], r["mode"]): r["transformer_max_abs_change"]
        for r in saved["continued_pretraining"]
    }
    assert changes[("mtl_p", "shallow")] == changes[("mtl_p", "deep")] == 0.0
    assert changes[("mtl_t", None)] > 0
    # Zero-shot "none" == a direct rank classification of the pre-trained model (eager, its
    # own tokenization: ids + EOS), no prompt.
    model, tokenizer, info = PD.pretrained_t5(config)
    assert info["cached"]
    for a, b in zip(model.backbone.get_weights(), weights["pretrained"]):
        np.testing.assert_array_equal(a, b)
    plain = prompts.prompt_t5(model.backbone, length=0)

    def tokenize(text):
        return list(np.asarray(tokenizer(text)))[: config.encoder_length - 1] + [1]

    def score(inputs, targets, mask):
        return prompts.t5_token_log_likelihoods(plain, inputs, inputs != 0, targets, mask)

    tasks = PD.prepare_tasks(config)
    assert saved["seen_majority_arg"] == pytest.approx(
        E.average_relative_gain(
            PR.majority_correctness(tasks.seen_pairs), saved["seen_num_choices"]
        ),
        abs=1e-12,
    )
    for (dataset, template), (_, test) in tasks.pairs.items():
        predictions, _, labels = prompts.rank_classify_examples(score, tokenize, test)
        for mode in PC.MODES:
            np.testing.assert_array_equal(
                saved["correct"]["none"]["zero_shot"][mode][f"{dataset}/{template}"],
                (predictions == labels).astype(int),
            )
    # The fit measurement: the pre-trained and the MTL-T model's loss on the later mixture
    # draws, recomputed as ONE batch of Keras's masked loss (a token-weighted mean), and
    # the label-prior loss as `label_prior_loss` computes it on the same draws.
    fit_x, fit_y = t5_lm.encode_examples(
        [d[2:] for d in PD.fit_draws(tasks, config)],
        tokenizer,
        config.encoder_length,
        config.decoder_length,
    )
    assert saved["fit"]["examples"] == len(fit_y) == config.fit_examples
    plain_lm = t5_lm.PromptedT5LM(plain)
    end = {
        r["configuration"]: r["end_loss"]
        for r in saved["continued_pretraining"]
        if r["mode"] is None
    }
    for key, expected in (("pretrained", saved["fit"]["pretrained_loss"]), ("mtl_t", end["mtl_t"])):
        model.backbone.set_weights(weights[key])
        assert float(t5_lm.masked_token_loss()(fit_y, plain_lm(fit_x))) == pytest.approx(
            expected, rel=1e-5
        ), key
    assert saved["fit"]["label_prior_loss"] == PD.label_prior_loss(
        PD.fit_draws(tasks, config), tasks, fit_y
    )
    assert all(r["end_loss"] > 0 and r["mean_loss"] > 0 for r in saved["continued_pretraining"])
    # MiniLM: both variants, the encoder frozen.
    for variant in ("prompt+head", "head"):
        assert saved["minilm"][variant]["encoder_bit_identical"] is True
        per = {
            tuple(k.split("/", 1)): np.asarray(v)
            for k, v in saved["minilm"][variant]["correct"].items()
        }
        assert saved["minilm"][variant]["arg"] == pytest.approx(
            E.average_relative_gain(per, choices), abs=1e-12
        )


def test_fresh_optimizer_state_restores_slots_and_keeps_the_learning_rate():
    """The few-shot runs start from the optimizer as first built: the slots and the step
    count back to their initial values, the learning rate (a Keras optimizer variable too)
    left at its value. Zeroing every optimizer variable set the rate to 0: no run trained."""
    import keras

    for optimizer, rate in (
        (PT.adafactor_optimizer(0.3), 0.3),
        (keras.optimizers.Adam(0.01), 0.01),
    ):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        reset = PE.FreshOptimizerState(model.optimizer, model.trainable_variables)
        initial = [v.numpy().copy() for v in model.optimizer.variables]
        x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
        for _ in range(2):  # a run, the reset, and a second run that trains as the first
            reset()
            before = [w.numpy().copy() for w in model.trainable_variables]
            model.fit(x, y, epochs=2, verbose=0)
            assert any(
                not np.array_equal(w.numpy(), b) for w, b in zip(model.trainable_variables, before)
            )
        assert int(model.optimizer.iterations.numpy()) == 2  # counted from 0 again
        reset()
        for v, value in zip(model.optimizer.variables, initial):
            np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)
        assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(rate)


@pytest.mark.parametrize("mode, length", [("shallow", 0), ("shallow", 3), ("deep", 3)])
def test_rank_classification_scores_are_the_teacher_forced_training_loss(mode, length):
    """A == B: for every answer choice, the program's rank-classification score
    (`Evaluator.score_fn` through `Tokenize`, mean over the choice's tokens with EOS) equals
    minus the `masked_token_loss` that continued pre-training minimises on the same example
    with that choice as its target (`encode_examples` + `PromptedT5LM`): the same
    tokenization, EOS, decoder start and padding. So a model that fits its training mixture
    is read out by rank classification on it; the long run's failed control is not an
    evaluation artefact (docs/promptability.md)."""
    import keras

    from trainers.experiments import small_t5
    from tf_metaalign.prompts.templates import PromptedExample

    config = tiny_config(encoder_length=12, decoder_length=6)
    backbone = small_t5.build_t5(small_t5.t5_config("tiny", vocabulary_size=60)).backbone
    tokenizer = CharTokenizer()
    evaluator = PE.Evaluator(
        backbone, config, PD.Tokenize(tokenizer, config.encoder_length), mode, length
    )
    if length:  # a prompt far from zero, so that it matters
        evaluator.set_prompt(evaluator.fresh_prompt(seed=3))
    examples = [
        PromptedExample("is this German?", "yes", ("yes", "no", "maybe"), 0),
        PromptedExample(
            "a much longer input than the encoder takes", "no", ("yes", "no", "maybe"), 1
        ),
        PromptedExample("x", "ab", ("ab", "b"), 0),
    ]
    _, scores, _ = E.rank_classify_examples(
        evaluator.score_fn, evaluator.tokenize, examples, eos_id=None, reduction="mean"
    )
    loss = t5_lm.masked_token_loss()
    for i, example in enumerate(examples):
        for c, choice in enumerate(example.answer_choices):
            x, y = t5_lm.encode_examples(
                [(example.input_text, choice)],
                tokenizer,
                config.encoder_length,
                config.decoder_length,
            )
            expected = -float(loss(y, evaluator.lm(x)))
            np.testing.assert_allclose(
                scores[i, c],
                expected,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"example {i}, choice {choice!r}",
            )
    assert np.isinf(scores[2, 2]) and scores[2, 2] < 0  # the padding choice
    keras.backend.clear_session()
