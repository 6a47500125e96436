"""The promptability program's data (`python -m trainers.promptability`): 1. the
pre-trained small T5 (cached), the memoised tokenizer of rank classification; the prompted
tasks, the training mixture, MTL batches, meta-learning tasks and the fit draws."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_config import Config


def pretrained_t5(config: Config, log=None):
    """`(model, tokenizer, info)`: the cached pre-trained `T5Seq2SeqLM` (trained on a miss,
    with a progress line through `log` every `log_every` steps)."""
    from trainers.experiments import small_t5
    from trainers.experiments.english_corpus import english_corpus
    from trainers import common

    callbacks = (
        ()
        if log is None
        else (
            common.ProgressCallback(
                log,
                "pre-training",
                config.pretrain_steps,
                min(config.log_every, config.pretrain_steps),
            ),
        )
    )

    corpus = english_corpus(max_texts=config.corpus_max_texts or None, seed=config.seed)
    return small_t5.cached_pretrained_t5(
        config.cache_dir,
        corpus,
        size=config.t5_size,
        vocabulary_size=config.vocabulary_size,
        objective=config.pretrain_objective,
        steps=config.pretrain_steps,
        batch_size=config.pretrain_batch_size,
        sequence_length=config.pretrain_sequence_length,
        learning_rate=config.pretrain_learning_rate,
        seed=config.seed,
        progress=False,
        callbacks=callbacks,
    )


class Tokenize:
    """`text -> ids` for rank classification: the tokenizer's ids cut to `length - 1`, then
    EOS (the encoder input as in training; a choice's target with its EOS). Memoised."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer, self.length, self.cache = tokenizer, length, {}

    def prefill(self, texts):
        import numpy as np

        from tf_metaalign.prompts.t5_lm import EOS_ID

        texts = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if texts:
            for text, ids in zip(texts, self.tokenizer(texts)):
                self.cache[text] = [int(i) for i in np.asarray(ids).reshape(-1)][
                    : self.length - 1
                ] + [EOS_ID]

    def __call__(self, text):
        if text not in self.cache:
            self.prefill([text])
        return self.cache[text]


@dataclasses.dataclass
class Tasks:
    training: dict  # name -> PromptedDataset
    evaluation: dict
    pairs: dict  # (dataset, template) -> (train PromptedExamples, test PromptedExamples)
    num_choices: dict  # dataset -> C
    # The positive control: the TRAINING datasets' held-out test examples, as `pairs`
    # (`Config.seen_examples` of each; empty when it is 0).
    seen_pairs: dict = dataclasses.field(default_factory=dict)
    seen_num_choices: dict = dataclasses.field(default_factory=dict)

    def nested(self) -> dict:
        """`pairs` as `few_shot_prompt_tuning` takes them: {dataset: {template: pair}}."""
        out = {}
        for (dataset, template), pair in self.pairs.items():
            out.setdefault(dataset, {})[template] = pair
        return out


def prepare_tasks(config: Config) -> Tasks:
    import numpy as np

    from trainers.experiments import prompted_tasks as PT
    from tf_metaalign.prompts.evaluation import sample_few_shot

    datasets = PT.offline_prompted_tasks(
        max_train=config.max_train, max_test=config.eval_examples, seed=config.seed
    )
    training, evaluation = PT.split_by_task_type(datasets)

    def pairs(chosen, limit=None):
        out = {}
        for name, dataset in chosen.items():
            train, test = dataset.prompted("train"), dataset.prompted("test")
            keep = np.arange(len(dataset.test))
            if limit is not None and limit < len(keep):
                # A seeded sample (the same for every template), not the first `limit`:
                # test splits are ordered by class (the first 48 of Django's component test
                # split are all "core").
                keep = sample_few_shot(len(keep), limit, config.seed, name, "control")
            for t in dataset.templates[: config.templates_per_dataset or None]:
                out[(name, t.name)] = (train[t.name], [test[t.name][i] for i in keep])
        return out

    seen = training if config.seen_examples else {}
    return Tasks(
        training,
        evaluation,
        pairs(evaluation),
        {n: d.num_choices for n, d in evaluation.items()},
        pairs(seen, config.seen_examples),
        {n: d.num_choices for n, d in seen.items()},
    )


def training_mixture(tasks: Tasks, config: Config):
    """The training datasets' prompted mixture (size-proportional, capped), seeded: the one
    stream that MTL batches, meta-learning tasks and the fit draws all come from."""
    from trainers.experiments.prompted_mixture import PromptedMixture

    return PromptedMixture(tasks.training, cap=config.mixture_cap, seed=config.seed)


def mtl_batches(tasks: Tasks, config: Config, tokenizer):
    """The continued pre-training stream for MTL: `steps x batch_size` mixture draws."""
    from tf_metaalign.prompts.t5_lm import encode_examples

    mixture = training_mixture(tasks, config)
    return encode_examples(
        mixture.take(config.steps * config.batch_size),
        tokenizer,
        config.encoder_length,
        config.decoder_length,
    )


def fit_draws(tasks: Tasks, config: Config) -> list:
    """`config.fit_examples` draws `(dataset, template, input_text, target_text)` of the
    training mixture right after the MTL stream's: more examples of the same distribution
    (training-split examples, as the stream's are), not seen in this order."""
    return training_mixture(tasks, config).take(
        config.fit_examples, start=config.steps * config.batch_size, with_names=True
    )


def label_prior_loss(draws, tasks: Tasks, target_ids) -> float:
    """Nats per target token of the predictor that knows each (dataset, template)'s
    distribution of target texts over its training split and nothing of the input:
    `sum -log p(target) / sum tokens` over `draws`, the tokens counted in `target_ids`, the
    draws' targets as `encode_examples` gives them (cut as in training, EOS included, 0 =
    padding), so that it divides by the same count as the models' `token_loss`.

    The reference for the continued pre-training loss: a model at or above it has learned
    the answer priors at best, nothing that rank classification could read from an input."""
    import collections
    import math

    import numpy as np

    priors = {}
    for name, dataset in tasks.training.items():
        train = dataset.prompted("train")
        for template in dataset.templates:
            counts = collections.Counter(e.target_text for e in train[template.name])
            total = sum(counts.values())
            priors[(name, template.name)] = {t: c / total for t, c in counts.items()}
    nll = -sum(math.log(priors[(name, template)][target]) for name, template, _, target in draws)
    return nll / float(np.count_nonzero(target_ids))


def meta_batches(tasks: Tasks, config: Config, tokenizer):
    """`((support_x [M, S, N, ...], support_y, query_x [M, N, ...]), query_y)` for
    `meta_steps * meta_batch` tasks (M). Task k is the dataset and template of the mixture's
    draw k (so tasks follow the mixing rates); its support and query examples are distinct
    training examples of that dataset under that template."""
    import numpy as np

    from tf_metaalign.prompts.t5_lm import encode_examples

    mixture = training_mixture(tasks, config)
    s, n = config.inner_steps, config.task_batch_size
    examples = []
    count = config.meta_steps * config.meta_batch
    for k in range(count):
        name, _, template_name = mixture.draw(k)
        dataset = tasks.training[name]
        template = next(t for t in dataset.templates if t.name == template_name)
        rng = np.random.default_rng([config.seed, 1, k])
        rows = rng.choice(
            len(dataset.train), size=(s + 1) * n, replace=(s + 1) * n > len(dataset.train)
        )
        examples += [template.apply(dataset.train[i]) for i in rows]
    x, y = encode_examples(examples, tokenizer, config.encoder_length, config.decoder_length)

    def shape(a, query):
        a = a.reshape((count, s + 1, n) + a.shape[1:])
        return a[:, s] if query else a[:, :s]

    support_x = {k: shape(v, False) for k, v in x.items()}
    query_x = {k: shape(v, True) for k, v in x.items()}
    return (support_x, shape(y, False), query_x), shape(y, True)
