"""The promptability program's pipeline (`python -m trainers.promptability`): `run`
pre-trains (or loads) the T5, prepares the data, runs every continued pre-training, evaluates
each configuration and assembles results.json."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_config import Config

from trainers.promptability_config import PROMPTLESS
from trainers.promptability_data import (
    Tokenize,
    fit_draws,
    label_prior_loss,
    meta_batches,
    mtl_batches,
    prepare_tasks,
    pretrained_t5,
)
from trainers.promptability_evaluate import Evaluator, evaluate_configuration, minilm_experiment
from trainers.promptability_report import arg_table, majority_correctness, pair_key
from trainers.promptability_train import build_prompted, continued_pretraining, token_loss


def run(config: Config, log=print):
    """The whole pipeline. Returns `(results, weights)`: `results` is what results.json
    holds; `weights` the pre-trained transformer weights ("pretrained") and those after each
    continued pre-training ("<configuration>/<mode>", "mtl_t"), as NumPy arrays."""
    import numpy as np

    from tf_metaalign.prompts import evaluation as E
    from tf_metaalign.prompts.t5_lm import encode_examples

    config.check()
    started = time.perf_counter()
    load_start = os.getloadavg()
    timings = {}
    log(
        f"pre-training a {config.t5_size} T5 ({config.pretrain_objective}, "
        f"{config.pretrain_steps} steps) or loading it from {config.cache_dir}"
    )
    t5, tokenizer, info = pretrained_t5(config, log)
    backbone = t5.backbone
    pretrained = [np.array(w) for w in backbone.get_weights()]
    timings["pretraining"] = time.perf_counter() - started
    log(
        f"T5 {'loaded from the cache' if info['cached'] else 'pre-trained'} "
        f"({backbone.count_params():,} parameters, vocabulary {backbone.vocabulary_size}) in "
        f"{timings['pretraining']:.0f} s"
    )
    t = time.perf_counter()
    tasks = prepare_tasks(config)
    tokenize = Tokenize(tokenizer, config.encoder_length)
    texts = [
        text
        for train, test in tasks.pairs.values()
        for e in list(train) + list(test)
        for text in (e.input_text,) + tuple(e.answer_choices)
    ]
    texts += [
        text
        for _, test in tasks.seen_pairs.values()
        for e in test
        for text in (e.input_text,) + tuple(e.answer_choices)
    ]
    tokenize.prefill(texts)
    data = {"mtl": mtl_batches(tasks, config, tokenizer)}
    if {"fomaml", "reptile"} & set(config.configurations):
        data["meta"] = meta_batches(tasks, config, tokenizer)
    draws = fit_draws(tasks, config)
    data["fit"] = encode_examples(
        [d[2:] for d in draws], tokenizer, config.encoder_length, config.decoder_length
    )
    fit = {
        "examples": len(draws),
        "label_prior_loss": label_prior_loss(draws, tasks, data["fit"][1]),
        "pretrained_loss": token_loss(
            build_prompted(backbone, config, "shallow", "prompt", 0)[1], *data["fit"]
        ),
    }
    timings["data"] = time.perf_counter() - t
    control = f", {len(tasks.seen_pairs)} seen-task control pairs" if tasks.seen_pairs else ""
    log(
        f"{len(tasks.training)} training datasets, {len(tasks.evaluation)} unseen datasets, "
        f"{len(tasks.pairs)} evaluation (dataset, template) pairs{control}; data in "
        f"{timings['data']:.0f} s"
    )
    log(
        f"loss on {fit['examples']} later mixture draws (nats per target token): knowing only "
        f"each template's answers {fit['label_prior_loss']:.3f}; the pre-trained T5 "
        f"{fit['pretrained_loss']:.3f}"
    )

    # Continued pre-training: every run from the pre-trained weights.
    weights = {"pretrained": pretrained}
    continued, learned_prompts = [], {}
    t = time.perf_counter()
    for configuration in config.configurations:
        if configuration == "none":
            continue
        for mode in config.modes if configuration != "mtl_t" else (None,):
            backbone.set_weights(pretrained)
            record = continued_pretraining(
                configuration, mode or config.modes[0], backbone, data, config, log
            )
            key = configuration if mode is None else f"{configuration}/{mode}"
            weights[key] = [np.array(w) for w in backbone.get_weights()]
            record["transformer_max_abs_change"] = float(
                max(
                    np.max(np.abs(a - b)) if a.size else 0.0
                    for a, b in zip(weights[key], pretrained)
                )
            )
            if mode is not None:
                learned_prompts.setdefault(configuration, {})[mode] = record["prompt"]
            record.pop("prompt")
            continued.append(record)
            log(
                f"{key}: {record['steps']} steps, {record['examples']} examples, loss "
                f"{record['mean_loss']:.3f} over the run, {record['end_loss']:.3f} at its end "
                f"(answer priors alone {fit['label_prior_loss']:.3f}), transformer max |change| "
                f"{record['transformer_max_abs_change']:.3g} ({record['seconds']:.0f} s)"
            )
    timings["continued_pretraining"] = time.perf_counter() - t

    # Evaluation: one evaluator per mode (+ a prompt-free one), each traced once.
    t = time.perf_counter()
    backbone.set_weights(pretrained)
    evaluators = {
        mode: Evaluator(backbone, config, tokenize, mode, config.prompt_length)
        for mode in config.modes
    }
    evaluators["plain"] = Evaluator(backbone, config, tokenize, "shallow", 0)
    correct = {}
    for configuration in config.configurations:
        if configuration in PROMPTLESS:
            transformer = pretrained if configuration == "none" else weights["mtl_t"]
            correct[configuration] = evaluate_configuration(
                configuration, evaluators, transformer, {}, tasks, config, log
            )
            continue
        # A prompt configuration has one transformer (and prompt) per mode.
        correct[configuration] = {}
        for mode in config.modes:
            part = evaluate_configuration(
                configuration,
                evaluators,
                weights[f"{configuration}/{mode}"],
                {mode: learned_prompts[configuration][mode]},
                tasks,
                dataclasses.replace(config, modes=(mode,)),
                log,
            )
            for setting in part:
                correct[configuration].setdefault(setting, {}).update(part[setting])
    timings["evaluation"] = time.perf_counter() - t
    backbone.set_weights(pretrained)

    rows = arg_table(
        correct,
        tasks.num_choices,
        config.configurations,
        config.modes,
        config.bootstrap_resamples,
        config.seed,
    )
    majority = majority_correctness(tasks.seen_pairs) if tasks.seen_pairs else None
    seen_rows = (
        arg_table(
            correct,
            tasks.seen_num_choices,
            config.configurations,
            config.modes,
            config.bootstrap_resamples,
            config.seed,
            settings=("seen_zero_shot",),
            majority=majority,
        )
        if tasks.seen_pairs
        else None
    )
    minilm = None
    if config.minilm:
        t = time.perf_counter()
        minilm = minilm_experiment(tasks, config, log)
        timings["minilm"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - started
    results = {
        "config": dataclasses.asdict(config),
        "pretraining": {k: info.get(k) for k in ("key", "settings", "cached", "history")},
        "t5_parameters": int(backbone.count_params()),
        "evaluation_pairs": [pair_key(k) for k in tasks.pairs],
        "num_choices": tasks.num_choices,
        "chance": {d: 1.0 / c for d, c in tasks.num_choices.items()},
        "continued_pretraining": continued,
        # The fit of continued pre-training: `label_prior_loss` and the pre-trained model's
        # loss on `examples` later mixture draws (each record's `end_loss` is on the same).
        "fit": fit,
        "correct": {
            c: {
                s: {m: {pair_key(k): v for k, v in per.items()} for m, per in by_setting.items()}
                for s, by_setting in settings.items()
            }
            for c, settings in correct.items()
        },
        "accuracy": {
            c: {
                s: {
                    m: {pair_key(k): float(np.mean(v)) for k, v in per.items()}
                    for m, per in by_setting.items()
                }
                for s, by_setting in settings.items()
            }
            for c, settings in correct.items()
        },
        "arg_table": rows,
        # The positive control (None when `seen_examples` is 0): zero-shot on held-out test
        # examples of the training datasets; its per-example correctness is
        # correct[configuration]["seen_zero_shot"].
        "seen_pairs": [pair_key(k) for k in tasks.seen_pairs],
        "seen_num_choices": tasks.seen_num_choices,
        "seen_arg_table": seen_rows,
        "seen_majority_arg": (
            E.average_relative_gain(majority, tasks.seen_num_choices) if tasks.seen_pairs else None
        ),
        "minilm": minilm,
        "timings_seconds": timings,
        "load_average": {
            "start": list(load_start),
            "end": list(os.getloadavg()),
            "cpus": os.cpu_count(),
        },
    }
    return results, weights
