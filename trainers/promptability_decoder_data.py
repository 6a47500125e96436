"""`trainers.promptability_decoder`'s data: the unseen prompted tasks as (dataset,
template) pairs, and a decoder's token ids of their inputs and answers (teacher-forcing
rows for training, `rank_classification`'s arrays for scoring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.promptability_decoder_config import Config

EOS_ID, PAD_ID = 1, 0  # the T5 SentencePiece model's (t5_vocabulary.EOS_ID / PAD_ID)


class Codec:
    """Token ids of the decoder's inputs and answers, memoised: an input is `EOS + ids`,
    cut from the left to `input_length`; an answer is `ids + EOS`, cut to `answer_length`."""

    def __init__(self, tokenizer, input_length: int, answer_length: int):
        self.tokenizer, self.cache = tokenizer, {}
        self.input_length, self.answer_length = input_length, answer_length

    def ids(self, text: str) -> list[int]:
        import numpy as np

        if text not in self.cache:
            self.cache[text] = [int(i) for i in np.asarray(self.tokenizer(text)).reshape(-1)]
        return self.cache[text]

    def input_ids(self, text: str) -> list[int]:
        ids = self.ids(text)
        return [EOS_ID] + ids[max(0, len(ids) - (self.input_length - 1)) :]

    def answer_ids(self, text: str) -> list[int]:
        return self.ids(text)[: self.answer_length - 1] + [EOS_ID]


def training_arrays(examples, codec: Codec):
    """`(x, y, sample_weight)` of teacher forcing on `input + answer`, padded to
    input_length + answer_length: `y[t]` is token t + 1, weighted 1 where it is an answer
    token (the continuation rank classification scores)."""
    import numpy as np

    width = codec.input_length + codec.answer_length
    ids = np.zeros((len(examples), width + 1), np.int32)
    weights = np.zeros((len(examples), width), np.float32)
    mask = np.zeros((len(examples), width), np.int32)
    for row, example in enumerate(examples):
        inp = codec.input_ids(example.input_text)
        ans = codec.answer_ids(example.answer_choices[example.label])
        ids[row, : len(inp) + len(ans)] = inp + ans
        mask[row, : len(inp) + len(ans)] = 1
        weights[row, len(inp) - 1 : len(inp) - 1 + len(ans)] = 1.0
    x = {"token_ids": ids[:, :-1], "padding_mask": mask}
    return x, ids[:, 1:], weights


def ranking_arrays(examples, codec: Codec):
    """`rank_classification`'s inputs `[N, S]` (pad 0), choice targets `[N, C, T]`, their
    mask and the choice mask, and the labels."""
    import numpy as np

    num_choices = max(len(e.answer_choices) for e in examples)
    inputs = np.zeros((len(examples), codec.input_length), np.int32)
    targets = np.zeros((len(examples), num_choices, codec.answer_length), np.int32)
    target_mask = np.zeros_like(targets)
    choice_mask = np.zeros((len(examples), num_choices), bool)
    for i, example in enumerate(examples):
        inp = codec.input_ids(example.input_text)
        inputs[i, : len(inp)] = inp
        for j, choice in enumerate(example.answer_choices):
            ans = codec.answer_ids(choice)
            targets[i, j, : len(ans)] = ans
            target_mask[i, j, : len(ans)] = 1
            choice_mask[i, j] = True
    labels = np.asarray([e.label for e in examples], np.int64)
    return inputs, targets, target_mask, choice_mask, labels


def prepare_pairs(config: Config) -> tuple[dict, dict]:
    """`({(dataset, template): (train examples, test examples)}, {dataset: choices})` of
    the unseen task types."""
    from trainers.experiments import prompted_tasks as PT

    datasets = PT.offline_prompted_tasks(
        max_train=config.max_train, max_test=config.eval_examples, seed=0
    )
    _, evaluation = PT.split_by_task_type(datasets)
    if config.datasets:
        evaluation = {n: evaluation[n] for n in config.datasets}
    pairs = {}
    for name, dataset in evaluation.items():
        train, test = dataset.prompted("train"), dataset.prompted("test")
        for template in dataset.templates[: config.templates_per_dataset or None]:
            examples = train[template.name]
            if config.evaluate_on == "dev":
                if len(examples) < config.shots + config.eval_examples:
                    raise ValueError(
                        f"{name!r} has {len(examples)} training examples: fewer than "
                        f"shots + eval_examples ({config.shots + config.eval_examples}) for "
                        "evaluate_on='dev'."
                    )
                cut = len(examples) - config.eval_examples
                pairs[(name, template.name)] = (examples[:cut], examples[cut:])
            else:
                pairs[(name, template.name)] = (examples, test[template.name])
    return pairs, {n: d.num_choices for n, d in evaluation.items()}
