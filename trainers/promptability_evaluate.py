"""The promptability program's evaluation (`python -m trainers.promptability`, steps 3 and
5): zero-shot rank classification and few-shot prompt tuning of each configuration, and the
frozen MiniLM's prompt + head against its head alone."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_config import Config
    from trainers.promptability_data import Tasks, Tokenize

from trainers.promptability_report import pair_key
from trainers.promptability_train import adafactor_optimizer, build_prompted


class FreshOptimizerState:
    """Puts an optimizer back to its state as first built, before each few-shot run.

    Restores EVERY optimizer variable to its value after `build`: the slots and the step
    count, and also the hyperparameter variables Keras keeps among `optimizer.variables`
    (the learning rate; this package's `learning_rate_scale`). Zeroing them all, as a
    first version did, set the learning rate to 0 and no few-shot run trained."""

    def __init__(self, optimizer, variables):
        optimizer.build(variables)
        self.optimizer = optimizer
        self.values = [v.numpy() for v in optimizer.variables]

    def __call__(self):
        for variable, value in zip(self.optimizer.variables, self.values):
            variable.assign(value)


class JittedScorer:
    """`log_likelihoods(inputs, targets, mask)` compiled on JAX (`common.compiled` over the
    model's variables: it reads their current values, as the prompt and weights change
    between calls), on inputs padded up to a few shapes so that the evaluation's many
    (dataset, template) shapes share compilations: rows to a power of two (copies of the
    first row), input and target lengths to a multiple of 8 (padding id 0, mask 0). Exact:
    the encoder masks padded inputs (`inputs != 0`), the decoder is causal and the added
    target positions come after the real ones, rows are independent; the result is cut
    back to the call's shape (tested against the eager function)."""

    def __init__(self, model, log_likelihoods):
        from trainers import common

        self.compiled = common.compiled(log_likelihoods, variables=model.variables)

    def __call__(self, inputs, targets, mask):
        import numpy as np

        rows, length = inputs.shape
        target_length = targets.shape[1]
        padded_rows = max(8, 1 << (rows - 1).bit_length())

        def pad(array, columns, fill):
            out = np.full((padded_rows, columns), fill, array.dtype)
            out[:rows, : array.shape[1]] = array
            out[rows:, : array.shape[1]] = array[:1]
            return out

        inputs = pad(inputs, -(-length // 8) * 8, 0)
        targets = pad(targets, -(-target_length // 8) * 8, 0)
        mask = pad(mask, targets.shape[1], 0)
        out = self.compiled(inputs, targets, mask)
        return out[:rows, :target_length]


class Evaluator:
    """One prompted model per mode on ONE backbone, traced once: rank classification and
    few-shot prompt tuning for any (transformer weights, prompt) assigned to it."""

    def __init__(self, backbone, config: Config, tokenize: Tokenize, mode: str, length: int):
        import keras

        from tf_metaalign import prompts
        from tf_metaalign.prompts.t5_lm import masked_token_loss
        from trainers import common

        self.config, self.tokenize, self.mode = config, tokenize, mode
        self.prompted, self.lm = build_prompted(backbone, config, mode, "prompt", length)
        self.lm.compile(
            optimizer=adafactor_optimizer(config.few_shot_learning_rate),
            loss=masked_token_loss(),
            jit_compile=common.fit_jit_compile(),
        )
        self.fresh_optimizer_state = FreshOptimizerState(
            self.lm.optimizer, self.lm.trainable_variables
        )
        prompted = self.prompted

        def log_likelihoods(inputs, targets, mask):
            return prompts.t5_token_log_likelihoods(prompted, inputs, inputs != 0, targets, mask)

        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            spec = tf.TensorSpec([None, None], tf.int32)
            log_likelihoods = tf.function(
                log_likelihoods, input_signature=[spec] * 3, reduce_retracing=True
            )
        else:
            log_likelihoods = JittedScorer(prompted, log_likelihoods)
        self._log_likelihoods = log_likelihoods

    def score_fn(self, inputs, targets, mask):
        import numpy as np

        import keras

        return keras.ops.convert_to_numpy(
            self._log_likelihoods(
                np.asarray(inputs, np.int32),
                np.asarray(targets, np.int32),
                np.asarray(mask, np.int32),
            )
        )

    def correctness(self, examples):
        """Per-example 0/1 correctness of rank classification (mean log-likelihood)."""
        from tf_metaalign.prompts import rank_classify_examples

        predictions, _, labels = rank_classify_examples(
            self.score_fn, self.tokenize, examples, eos_id=None, reduction="mean", batch_size=256
        )
        return (predictions == labels).astype("int64")

    def fresh_prompt(self, seed: int):
        """The reference's initial prompt: vocabulary rows (shallow), N(0, 1) (deep)."""
        import numpy as np

        from tf_metaalign.prompts import storage

        if self.mode == "shallow":
            table = self.prompted.backbone.token_embedding.embeddings.numpy()
            return [storage.vocabulary_rows_init(table, self.prompted.length, 5000, seed)]
        rng = np.random.default_rng(seed)
        return [
            rng.standard_normal(v.shape).astype(v.dtype) for v in self.prompted.prompt_variables
        ]

    def set_prompt(self, values):
        for variable, value in zip(self.prompted.prompt_variables, values):
            variable.assign(value)

    def tune(self, examples, epochs: int):
        """Prompt tuning from the assigned prompt with a fresh optimizer state (as first
        built: `FreshOptimizerState`). Keras shuffles with the
        global seed, which the caller sets per (dataset, template)."""
        from tf_metaalign.prompts.t5_lm import encode_examples

        self.fresh_optimizer_state()
        x, y = encode_examples(
            examples,
            self.tokenize.tokenizer,
            self.config.encoder_length,
            self.config.decoder_length,
        )
        self.lm.fit(
            x, y, batch_size=self.config.few_shot_batch_size, epochs=epochs, verbose=0, shuffle=True
        )


def evaluate_configuration(
    configuration, evaluators, weights, prompts_by_mode, tasks: Tasks, config: Config, log=print
) -> dict:
    """Zero-shot and few-shot correctness of one configuration, per mode (and zero-shot
    on the training datasets' test examples, "seen_zero_shot", when `tasks` has them)."""
    import keras

    from tf_metaalign.prompts import evaluation as E

    zero_shot_sets = {"zero_shot": tasks.pairs}
    if tasks.seen_pairs:
        zero_shot_sets["seen_zero_shot"] = tasks.seen_pairs
    out = {setting: {} for setting in zero_shot_sets} | {"few_shot": {}}
    plain = None
    for mode in config.modes:
        evaluator = evaluators[mode]
        evaluator.prompted.backbone.set_weights(weights)
        learned = prompts_by_mode.get(mode)
        start = time.perf_counter()
        if learned is not None:
            evaluator.set_prompt(learned)
            zero = {
                s: {k: evaluator.correctness(test) for k, (_, test) in pairs.items()}
                for s, pairs in zero_shot_sets.items()
            }
        elif plain is None:  # no prompt of its own: the plain model, the same in every mode
            plain = zero = {
                s: {k: evaluators["plain"].correctness(test) for k, (_, test) in pairs.items()}
                for s, pairs in zero_shot_sets.items()
            }
        else:
            zero = plain
        for setting, per_pair in zero.items():
            out[setting][mode] = per_pair
        fresh_seed = [config.seed, 2]

        def build(dataset, template):
            keras.utils.set_random_seed(E.stable_seed(config.seed, dataset, template)[0] % 2**31)
            evaluator.set_prompt(
                learned if learned is not None else evaluator.fresh_prompt(fresh_seed)
            )
            return evaluator

        def train(model, examples, epochs):
            model.tune(examples, epochs)

        def evaluate(model, examples):
            return model.correctness(examples)

        few = E.few_shot_prompt_tuning(
            tasks.nested(),
            build,
            train,
            evaluate,
            config.shots,
            config.few_shot_epochs,
            config.seed,
        )
        out["few_shot"][mode] = {k: r.correct.astype("int64") for k, r in few.items()}
        seen = (
            ""
            if not tasks.seen_pairs
            else "  seen-task zero-shot ARG "
            + format(
                E.average_relative_gain(out["seen_zero_shot"][mode], tasks.seen_num_choices), "+.3f"
            )
        )
        unseen = E.average_relative_gain(zero["zero_shot"], tasks.num_choices)
        log(
            f"{configuration}/{mode}: zero-shot ARG {unseen:+.3f}  few-shot ARG "
            f"{E.average_relative_gain(out['few_shot'][mode], tasks.num_choices):+.3f}{seen}  "
            f"({time.perf_counter() - start:.0f} s)"
        )
    return out


def minilm_experiment(tasks: Tasks, config: Config, log=print) -> dict:
    """Frozen MiniLM: 16-shot prompt tuning + a linear head vs the head alone, on the
    unseen tasks (the template's input text -> the label as a class)."""
    import keras
    import numpy as np

    from tf_metaalign import prompts
    from trainers import common
    from trainers.experiments import text_encoder as TE
    from tf_metaalign.prompts import evaluation as E

    tokenizer, backbone = TE.load_minilm_tokenizer(), TE.load_minilm_backbone()
    classes = max(tasks.num_choices.values())

    class Classifier(prompts.TrainableSelection, keras.Model):
        """Prompted MiniLM -> masked mean of the token outputs -> linear head (trains the
        prompt and the head: the prompted model's `train="prompt"` selection)."""

        def __init__(self, length):
            super().__init__()
            self.prompted = prompts.prompt_bert(backbone, length, train="prompt", seed=config.seed)
            self.head = keras.layers.Dense(classes)

        def call(self, x, training=False):
            seq = self.prompted(x, training=training)["sequence_output"]
            mask = keras.ops.cast(x["padding_mask"], seq.dtype)[..., None]
            pooled = keras.ops.sum(seq * mask, 1) / keras.ops.maximum(keras.ops.sum(mask, 1), 1)
            return self.head(pooled)

    def inputs(examples):
        return TE.tokenize(
            [e.input_text for e in examples], tokenizer, config.minilm_sequence_length
        )

    out, runs = {}, {}
    for variant, length in (("prompt+head", config.minilm_prompt_length), ("head", 0)):
        model = Classifier(length)
        model(inputs(next(iter(tasks.pairs.values()))[0][:2]))
        initial = [v.numpy() for v in model.trainable_variables]
        model.compile(
            optimizer=keras.optimizers.Adam(config.minilm_learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=common.fit_jit_compile(),
        )
        fresh_optimizer_state = FreshOptimizerState(model.optimizer, model.trainable_variables)
        start = time.perf_counter()

        def build(
            dataset,
            template,
            model=model,
            initial=initial,
            fresh_optimizer_state=fresh_optimizer_state,
        ):
            keras.utils.set_random_seed(E.stable_seed(config.seed, dataset, template)[0] % 2**31)
            for v, value in zip(model.trainable_variables, initial):
                v.assign(value)
            fresh_optimizer_state()
            return model

        def train(model, examples, epochs):
            y = np.asarray([e.label for e in examples])
            model.fit(
                inputs(examples), y, batch_size=config.few_shot_batch_size, epochs=epochs, verbose=0
            )

        def evaluate(model, examples):
            logits = model.predict(inputs(examples), batch_size=128, verbose=0)
            return (np.argmax(logits, -1) == np.asarray([e.label for e in examples])).astype(
                "int64"
            )

        before = [w.numpy().copy() for w in backbone.weights]
        results = E.few_shot_prompt_tuning(
            tasks.nested(), build, train, evaluate, config.shots, config.minilm_epochs, config.seed
        )
        frozen = all(np.array_equal(w.numpy(), b) for w, b in zip(backbone.weights, before))
        runs[variant] = {k: r.correct.astype("int64") for k, r in results.items()}
        out[variant] = {
            "arg": E.average_relative_gain(runs[variant], tasks.num_choices),
            "encoder_bit_identical": frozen,
            "seconds": time.perf_counter() - start,
            "correct": {pair_key(k): v for k, v in runs[variant].items()},
        }
        log(
            f"MiniLM {variant}: 16-shot ARG {out[variant]['arg']:+.3f} "
            f"({out[variant]['seconds']:.0f} s)"
        )
    test = E.paired_bootstrap_arg(
        runs["prompt+head"],
        runs["head"],
        tasks.num_choices,
        config.bootstrap_resamples,
        config.seed,
    )
    out["p_prompt_better_than_head"] = test.p_value
    return out
