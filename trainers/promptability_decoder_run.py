"""`trainers.promptability_decoder`'s run: the pre-trained decoder, one `Method` per
compared method (compiled and traced once, reset per run), the runs over seeds and
(dataset, template) pairs, and the interleaved step-cost measurement."""

from __future__ import annotations

import dataclasses
import time

from trainers.experiments.pretrained_cache import fit
from trainers.promptability_decoder_data import (
    PAD_ID,
    Codec,
    prepare_pairs,
    ranking_arrays,
    training_arrays,
)

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_decoder_config import Config


class TracedForward:
    """`model(x)` as one compiled function (any batch and length): what
    `causal_lm_score_fn` calls, without re-tracing per call (`tf.function` on TensorFlow;
    on JAX `jax.jit` of `stateless_call`, the variables' current values passed in)."""

    def __init__(self, model):
        import keras

        self.model = model
        if keras.backend.backend() == "jax":
            import jax

            def forward(trainable, non_trainable, x):
                return model.stateless_call(trainable, non_trainable, x, training=False)[0]

            self.forward = jax.jit(forward)
            return
        import tensorflow as tf

        spec = tf.TensorSpec([None, None], tf.int32)

        @tf.function(input_signature=[{"token_ids": spec, "padding_mask": spec}])
        def forward(x):
            return model(x, training=False)

        self.forward = forward

    def __call__(self, x, training=False):
        import keras

        x = {k: keras.ops.cast(v, "int32") for k, v in x.items()}
        if keras.backend.backend() == "jax":
            return self.forward(
                [v.value for v in self.model.trainable_variables],
                [v.value for v in self.model.non_trainable_variables],
                x,
            )
        return self.forward(x)


def correctness(score_fn, examples, codec: Codec):
    """Per-example 0/1 correctness of rank classification (mean per-token log-likelihood)."""
    from tf_metaalign.prompts import rank_classification

    inputs, targets, target_mask, choice_mask, labels = ranking_arrays(examples, codec)
    predictions, _ = rank_classification(
        score_fn, inputs, targets, target_mask, choice_mask, reduction="mean"
    )
    return (predictions == labels).astype("int64")


def answer_nll(score_fn, examples, codec: Codec) -> float:
    """Nats per answer token (EOS included) of the right answers: the training loss."""
    import numpy as np

    inputs, targets, target_mask, _, labels = ranking_arrays(examples, codec)
    rows = np.arange(len(examples))
    target, mask = targets[rows, labels], target_mask[rows, labels]
    log_likelihoods = np.asarray(score_fn(inputs, target, mask))
    return float(-(log_likelihoods * mask).sum() / mask.sum())


def count(variables) -> int:
    import numpy as np

    return int(sum(np.prod(v.shape) for v in variables))


class Method:
    """One method's model, compiled and traced once; `reset(seed)` puts it back at the
    pre-trained weights with a fresh (seeded) prompt / LoRA factors and optimizer state."""

    def __init__(self, name: str, pretrained_backbone, weights, config: Config):
        import keras
        import keras_hub

        from tf_metaalign import prompts
        from trainers import common
        from trainers.promptability_evaluate import FreshOptimizerState

        self.name, self.config = name, config
        self.pretrained = weights
        if name in ("prompt", "prefix", "zero_shot"):
            self.backbone = pretrained_backbone  # shared; train="prompt" leaves it out
        else:
            self.backbone = keras_hub.models.GPT2Backbone.from_config(
                pretrained_backbone.get_config()
            )
            self.backbone.set_weights(weights)
        self.lora, self.own = [], []
        if name in ("prompt", "prefix"):
            self.mode = "shallow" if name == "prompt" else "deep"
            self.model = prompts.prompt_causal_lm(
                self.backbone, config.prompt_length, self.mode, train="prompt", init="vocab"
            )
        else:
            if name == "full":
                self.backbone.trainable = True  # (prompting sets no flag; explicit all the same)
            if name == "lora":
                self.backbone.enable_lora(config.lora_rank)
                self.lora = [
                    (layer.lora_kernel_a, layer.lora_kernel_b)
                    for layer in self.backbone._flatten_layers(include_self=False)
                    if getattr(layer, "lora_enabled", False)
                ]
                lora_ids = {id(v) for pair in self.lora for v in pair}
                # The backbone's own weights, in the pretrained list's order.
                self.own = [w for w in self.backbone.weights if id(w) not in lora_ids]
            self.model = keras_hub.models.GPT2CausalLM(backbone=self.backbone, preprocessor=None)
        self.score_fn = prompts.causal_lm_score_fn(TracedForward(self.model), pad_id=PAD_ID)
        if name == "zero_shot":
            self.trainable = 0
            return
        self.model.compile(
            optimizer=keras.optimizers.Adam(config.rate(name)),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
            weighted_metrics=[],
            jit_compile=common.fit_jit_compile(),
        )
        self.trainable = count(self.model.trainable_variables)
        self.fresh_optimizer_state = FreshOptimizerState(
            self.model.optimizer, self.model.trainable_variables
        )
        self.step_times: list[float] = []
        self.first_fit_seconds = None

    def reset(self, seed: int):
        import keras
        import numpy as np

        from tf_metaalign import prompts

        if self.name in ("prompt", "prefix"):
            fresh = prompts.prompt_causal_lm(
                self.backbone, self.config.prompt_length, self.mode, init="vocab", seed=seed
            )
            self.model.prompt_variables[0].assign(fresh.prompt_variables[0].numpy())
        elif self.name == "lora":
            # keras-hub's enable_lora also trains the query / value biases: back to the
            # pre-trained values, and fresh factors (Keras's initializers: A he-uniform, B 0).
            for w, value in zip(self.own, self.pretrained):
                w.assign(value)
            initializer = keras.initializers.HeUniform(seed=seed)
            for a, b in self.lora:
                a.assign(initializer(a.shape, a.dtype))
                b.assign(np.zeros(b.shape, b.dtype))
        elif self.name == "full":
            self.backbone.set_weights(self.pretrained)
        self.fresh_optimizer_state()

    def train(self, examples, codec: Codec, seed: int):
        """`epochs` passes over `examples`, each in its own seeded order, in batches of
        `batch_size` (keras-hub's `CausalLM.fit` does not shuffle arrays: the order is
        drawn here). Returns the answer nats per token on `examples` before and after."""
        import numpy as np

        from trainers import common

        before = answer_nll(self.score_fn, examples, codec)
        x, y, w = training_arrays(examples, codec)
        rng = np.random.default_rng(seed)
        order = np.concatenate([rng.permutation(len(examples)) for _ in range(self.config.epochs)])
        timer = common.StepTimer(warmup=1)
        start = time.perf_counter()
        fit(
            self.model,
            {k: v[order] for k, v in x.items()},
            y[order],
            sample_weight=w[order],
            batch_size=self.config.batch_size,
            epochs=1,
            shuffle=False,  # the order is drawn above (Keras's own fit would reshuffle)
            verbose=0,
            callbacks=[timer],
        )
        if self.first_fit_seconds is None:
            self.first_fit_seconds = time.perf_counter() - start
        self.step_times += timer.warm_times
        return before, answer_nll(self.score_fn, examples, codec)


def pretrained_gpt2(config: Config, log=print):
    """`(model, tokenizer, info)`: the cached pre-trained `GPT2CausalLM`."""
    from trainers import common
    from trainers.experiments import small_gpt2
    from trainers.experiments.english_corpus import english_corpus

    corpus = english_corpus(max_texts=config.corpus_max_texts or None, seed=0)
    every = min(config.log_every, config.pretrain_steps)
    return small_gpt2.cached_pretrained_gpt2(
        config.cache_dir,
        corpus,
        size=config.gpt2_size,
        vocabulary_size=config.vocabulary_size,
        steps=config.pretrain_steps,
        batch_size=config.pretrain_batch_size,
        sequence_length=config.pretrain_sequence_length,
        learning_rate=config.pretrain_learning_rate,
        max_sequence_length=config.max_sequence_length,
        heldout_texts=config.heldout_texts,
        callbacks=(common.ProgressCallback(log, "pre-training", config.pretrain_steps, every),),
    )


def run_seed_key(seed: int, pair) -> int:
    from tf_metaalign.prompts.evaluation import stable_seed

    return stable_seed(seed, *pair)[0] % 2**31


def run(config: Config, log=print) -> dict:
    """The experiment (module docstring); returns the results (JSON-ready but for arrays)."""
    import keras
    import numpy as np

    from tf_metaalign.prompts.evaluation import sample_few_shot

    start = time.perf_counter()
    lm, tokenizer, info = pretrained_gpt2(config, log)
    backbone = lm.backbone
    log(
        f"GPT-2 {config.gpt2_size}: {backbone.count_params():,} parameters, "
        f"{'cached' if info['cached'] else 'pre-trained'}; held-out nats/token "
        f"{info['heldout_nll']:.3f} (unigram {info['heldout_nll_unigram']:.3f}, "
        f"uniform {info['uniform_nll']:.3f})"
    )
    codec = Codec(tokenizer, config.input_length, config.answer_length)
    pairs, num_choices = prepare_pairs(config)
    log(f"{len(pairs)} (dataset, template) pairs: {', '.join('/'.join(p) for p in pairs)}")
    pretrained = [w.numpy().copy() for w in backbone.weights]

    samples = {
        (seed, pair): sample_few_shot(len(train), config.shots, seed, *pair)
        for seed in config.seeds
        for pair, (train, _) in pairs.items()
    }
    majority = {}
    for (seed, pair), index in samples.items():
        train, test = pairs[pair]
        labels = np.asarray([train[i].label for i in index])
        answer = np.bincount(labels).argmax()
        majority.setdefault(str(seed), {})[pair] = np.asarray(
            [e.label == answer for e in test], "int64"
        )

    results = {
        "config": dataclasses.asdict(config),
        "steps_per_run": config.steps,
        "pretraining": {k: v for k, v in info.items() if k != "history"}
        | {"loss_curve": info["history"].get("loss")},
        "pairs": ["/".join(p) for p in pairs],
        "num_choices": num_choices,
        "majority": {s: {"/".join(k): v for k, v in m.items()} for s, m in majority.items()},
        "methods": {},
    }
    trained_methods = {}
    for name in config.methods:
        method_start = time.perf_counter()
        method = Method(name, backbone, pretrained, config)
        if name != "zero_shot":
            trained_methods[name] = method
        per_seed = {}
        losses = {}
        if name == "zero_shot":
            correct = {
                pair: correctness(method.score_fn, test, codec) for pair, (_, test) in pairs.items()
            }
            per_seed = {str(seed): correct for seed in config.seeds}
        else:
            for seed in config.seeds:
                per_seed[str(seed)] = {}
                for pair, (train, test) in pairs.items():
                    key = run_seed_key(seed, pair)
                    keras.utils.set_random_seed(key)
                    method.reset(key)
                    shots = [train[i] for i in samples[(seed, pair)]]
                    losses[f"{seed}/{'/'.join(pair)}"] = method.train(shots, codec, key)
                    per_seed[str(seed)][pair] = correctness(method.score_fn, test, codec)
        bit_identical = {
            "pretrained_backbone": all(
                np.array_equal(w.numpy(), p) for w, p in zip(backbone.weights, pretrained)
            )
        }
        if name == "lora":
            trained = {id(v) for v in method.model.trainable_variables}
            bit_identical["frozen_weights"] = all(
                np.array_equal(w.numpy(), p)
                for w, p in zip(method.own, pretrained)
                if id(w) not in trained
            )
        entry = {
            "trainable_parameters": method.trainable,
            "learning_rate": None if name == "zero_shot" else config.rate(name),
            "accuracy": {
                s: float(np.mean([c.mean() for c in per_pair.values()]))
                for s, per_pair in per_seed.items()
            },
            "correct": {s: {"/".join(k): v for k, v in c.items()} for s, c in per_seed.items()},
            "bit_identical": bit_identical,
            "seconds": time.perf_counter() - method_start,
        }
        if name != "zero_shot":
            entry |= {
                "step_ms_median": 1000 * float(np.median(method.step_times)),
                "step_ms_mean": 1000 * float(np.mean(method.step_times)),
                "first_fit_seconds": method.first_fit_seconds,
                "answer_nll_before_after": losses,
            }
        results["methods"][name] = entry
        accuracies = list(entry["accuracy"].values())
        log(
            f"{name}: accuracy {np.mean(accuracies):.3f} (seeds "
            f"{', '.join(f'{a:.3f}' for a in accuracies)}), {method.trainable:,} trainable"
            + (
                f", {entry['step_ms_median']:.0f} ms/step, answer nats/token "
                f"{np.mean([b for b, _ in losses.values()]):.2f} -> "
                f"{np.mean([a for _, a in losses.values()]):.2f} on the shots"
                if name != "zero_shot"
                else ""
            )
            + f"  ({entry['seconds']:.0f} s)"
        )
    if config.cost_rounds and len(trained_methods) > 0:
        first_pair = next(iter(pairs))
        shots = [pairs[first_pair][0][i] for i in samples[(config.seeds[0], first_pair)]]
        cost = step_costs(trained_methods, shots, codec, config)
        for name, value in cost.items():
            results["methods"][name]["step_ms_interleaved"] = value
        log(
            "step cost, methods interleaved: "
            + ", ".join(f"{n} {v:.1f} ms" for n, v in cost.items())
        )
    results["seconds"] = time.perf_counter() - start
    from trainers.promptability_decoder_report import summarize

    results["summary"] = summarize(results, config)
    return results


def step_costs(methods: dict, examples, codec: Codec, config: Config) -> dict:
    """Median ms per training step of each method, measured in `cost_rounds` rounds that
    take the methods in turn (each round: `cost_steps` steps of batches of `batch_size` of
    `examples`, its first step left out): the shared machine's load drifts, and
    interleaving spreads it over the methods alike. The methods' weights are reset after."""
    import numpy as np

    from trainers import common

    x, y, w = training_arrays(examples, codec)
    order = np.resize(np.arange(len(examples)), (config.cost_steps + 1) * config.batch_size)
    times = {name: [] for name in methods}
    for _ in range(config.cost_rounds):
        for name, method in methods.items():
            timer = common.StepTimer(warmup=1)
            fit(
                method.model,
                {k: v[order] for k, v in x.items()},
                y[order],
                sample_weight=w[order],
                batch_size=config.batch_size,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[timer],
            )
            times[name] += timer.warm_times
    for method in methods.values():
        method.reset(0)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}
