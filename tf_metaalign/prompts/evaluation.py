"""Evaluation of prompted models: rank classification, the few-shot protocol, ARG.

Reference: Wu, Logan, Walsh, Bhagia, Groeneveld, Singh, Beltagy, "Continued Pretraining for
Better Zero- and Few-Shot Promptability" (EMNLP 2022); official code allenai/
better-promptability. Nothing here depends on a model: the model enters as callables.

Rank classification (T0's evaluation, Sanh et al. 2022; Brown et al. 2020): every answer
choice is scored as the target sequence given the input, and the prediction is the choice
of highest score. The score is the MEAN per-token log-likelihood of the choice's target
tokens, EOS included (`reduction="mean"`, the paper's default; the reference computes
`-loss.sum(-1) / (target_mask.sum(-1) + 1e-6)` in `PrefixTransformer.get_predictions`,
better_promptability/models/prefix_transformer.py, and masks absent choices with the
dtype's minimum), or the SUM (`reduction="sum"`, the total log-probability of the choice,
which favours short choices).

Few-shot protocol (the paper's few-shot setting): for every evaluation dataset and template, 16
training examples sampled with a seed, prompt tuning for 100 epochs, and the accuracy after
the FINAL epoch (no model selection: 16 examples leave none for a development set).

Average Relative Gain (ARG; the paper's aggregate, after Ye et al. 2021, CrossFit): the
relative gain of an accuracy over chance, `(accuracy - chance) / chance` with `chance = 1 /
number of answer choices`, averaged over templates and datasets. Averaging: by default each
DATASET weighs the same (its templates are averaged first), so a dataset with many templates
does not dominate; `weighting="template"` averages every (dataset, template) pair equally,
as the reference's `aggregate_results.py` averages accuracies over its dataset-template
tasks. The two agree when every dataset has the same number of templates. (The paper's text
was not available offline to confirm which one it uses; see the tests for the hand
computation.) Significance: a paired bootstrap over evaluation examples (below).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from tf_metaalign.data.splits import check_positive_int

__all__ = [
    "REDUCTIONS",
    "token_log_likelihoods",
    "choice_scores",
    "rank_classification",
    "rank_classify_examples",
    "accuracy",
    "sample_few_shot",
    "FewShotResult",
    "few_shot_prompt_tuning",
    "relative_gain",
    "average_relative_gain",
    "BootstrapResult",
    "paired_bootstrap_arg",
]

REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}; got {reduction!r}.")
    return reduction


# ----------------------------------------------------------------------- rank classification


def token_log_likelihoods(logits, target_ids):
    """`log softmax(logits)[..., target_id]` per token: `[..., T, V]`, `[..., T]` -> `[..., T]`.

    Turns a teacher-forced decoder's logits into what `score_fn` returns (`ops.log_softmax`,
    stable for large logits, read at the targets).

    Args:
      logits: `[..., T, V]` float, the decoder's logits at each target position.
      target_ids: `[..., T]` int, the target tokens.

    Returns:
      A `[..., T]` tensor of the backend of log-likelihoods, in the dtype of `logits`.

    Example:
      >>> from tf_metaalign import prompts
      >>> logits = np.log([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]])  # log-probabilities
      >>> ll = prompts.token_log_likelihoods(logits, [[0, 1]])
      >>> # p(0) at the first token, p(1) at the second
      >>> np.exp(keras.ops.convert_to_numpy(ll)).round(4).tolist()
      [[0.5, 0.8]]

    References:
      Wu et al., EMNLP 2022 (allenai/better-promptability: the token losses of
      `PrefixTransformer.get_predictions`).
    """
    from keras import ops

    logits = ops.convert_to_tensor(logits)
    target_ids = ops.cast(ops.convert_to_tensor(target_ids), "int32")
    log_probs = ops.log_softmax(logits, axis=-1)
    return ops.take_along_axis(log_probs, target_ids[..., None], axis=-1)[..., 0]


def choice_scores(token_log_likelihoods, target_mask, reduction: str = "mean") -> np.ndarray:
    """Per-sequence scores from per-token log-likelihoods `[..., T]` and a 0/1 mask `[..., T]`.

    `mean`: `sum(ll * mask) / sum(mask)`; `sum`: `sum(ll * mask)`. Masked tokens (padding)
    count for nothing whatever their log-likelihood. A sequence with no token raises.

    Args:
      token_log_likelihoods: `[..., T]` per-token log-likelihoods.
      target_mask: `[..., T]` 0/1, 1 on the real target tokens (of the same shape).
      reduction: "mean" (the paper's default) or "sum".

    Returns:
      The scores `[...]`, a float64 NumPy array.

    Example:
      >>> from tf_metaalign import prompts
      >>> ll = np.log([[0.5, 0.25, 0.9], [0.5, 0.5, 0.5]])
      >>> mask = [[1, 1, 0], [1, 1, 1]]  # the first sequence's third token is padding
      >>> np.exp(prompts.choice_scores(ll, mask)).round(4).tolist()  # geometric means
      [0.3536, 0.5]
      >>> np.exp(prompts.choice_scores(ll, mask, reduction="sum")).round(4).tolist()
      [0.125, 0.125]

    References:
      Wu et al., EMNLP 2022: `-loss.sum(-1) / (target_mask.sum(-1) + 1e-6)` in
      `PrefixTransformer.get_predictions` (allenai/better-promptability).
    """
    _check_reduction(reduction)
    ll = np.asarray(token_log_likelihoods, np.float64)
    mask = np.asarray(target_mask, np.float64)
    if ll.shape != mask.shape:
        raise ValueError(
            f"`token_log_likelihoods` has shape {ll.shape} but `target_mask` "
            f"{mask.shape}; they must match."
        )
    lengths = mask.sum(-1)
    if np.any(lengths <= 0):
        raise ValueError(
            "`target_mask` has a sequence with no target token; every choice "
            "needs at least one (its EOS)."
        )
    total = np.where(mask > 0, ll, 0.0).sum(-1)
    return total / lengths if reduction == "mean" else total


def rank_classification(
    score_fn: Callable,
    input_ids,
    choice_target_ids,
    choice_target_mask,
    choice_mask=None,
    reduction: str = "mean",
    batch_size: int | None = None,
):
    """Rank classification on pre-tokenized inputs.

    Args:
      score_fn: `score_fn(input_ids[N, S], target_ids[N, T], target_mask[N, T]) ->
        token_log_likelihoods[N, T]`: log p(target token t | input, target tokens < t) of
        each target token (teacher forcing). Anything array-like (numpy, tf) is accepted.
        The input padding, if any, is the model's business (e.g. a pad id it masks).
      input_ids: `[B, S]` int, one row per example.
      choice_target_ids: `[B, C, T]` int: the C answer choices of each example as target
        token ids (EOS included), padded to T.
      choice_target_mask: `[B, C, T]` 0/1: 1 on the real target tokens.
      choice_mask: optional `[B, C]` 0/1: 1 for real choices, when examples have fewer than
        C choices (the padding choices are never predicted).
      reduction: "mean" (the paper's default) or "sum" per-token log-likelihood.
      batch_size: score at most this many (input, choice) rows per `score_fn` call
        (default: all `B * C` in one call).

    Returns:
      `(predictions[B] int64, scores[B, C] float64)`; padding choices score -inf. Ties go
      to the first choice (numpy's argmax).

    Example:
      >>> from tf_metaalign import prompts
      >>> def score_fn(input_ids, target_ids, target_mask):  # a toy model: p = 0.9 for
      ...     # the input's first token, 0.1 for any other
      ...     return np.where(target_ids == input_ids[:, :1], np.log(0.9), np.log(0.1))
      >>> input_ids = [[7, 3], [8, 3]]
      >>> choices = [[[7, 1], [8, 1]]] * 2  # choices 7 and 8, each with its EOS (id 1)
      >>> predictions, scores = prompts.rank_classification(
      ...     score_fn, input_ids, choices, np.ones((2, 2, 2)))
      >>> predictions.tolist(), np.exp(scores).round(4).tolist()  # exp(mean(log p))
      ([0, 1], [[0.3, 0.1], [0.1, 0.3]])
      >>> predictions, scores = prompts.rank_classification(
      ...     score_fn, input_ids, choices, np.ones((2, 2, 2)), choice_mask=[[1, 1], [1, 0]])
      >>> predictions.tolist(), np.exp(scores).round(4).tolist()  # the padding choice: -inf
      ([0, 0], [[0.3, 0.1], [0.1, 0.0]])

    References:
      Sanh et al., ICLR 2022 (T0's rank classification); Brown et al. 2020; Wu et al.,
      EMNLP 2022 (`PrefixTransformer.get_predictions`, allenai/better-promptability).
    """
    _check_reduction(reduction)
    input_ids = np.asarray(input_ids)
    target_ids = np.asarray(choice_target_ids)
    target_mask = np.asarray(choice_target_mask)
    if input_ids.ndim != 2:
        raise ValueError(f"`input_ids` must be [B, S]; got shape {input_ids.shape}.")
    if target_ids.ndim != 3 or target_ids.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"`choice_target_ids` must be [B, C, T] with B={input_ids.shape[0]} "
            f"(the rows of `input_ids`); got shape {target_ids.shape}."
        )
    if target_mask.shape != target_ids.shape:
        raise ValueError(
            f"`choice_target_mask` has shape {target_mask.shape}; it must match "
            f"`choice_target_ids` {target_ids.shape}."
        )
    b, c, t = target_ids.shape
    if choice_mask is None:
        choice_mask = np.ones((b, c), bool)
    choice_mask = np.asarray(choice_mask).astype(bool)
    if choice_mask.shape != (b, c):
        raise ValueError(f"`choice_mask` must be [B, C] = {(b, c)}; got {choice_mask.shape}.")
    if not choice_mask.any(-1).all():
        raise ValueError("`choice_mask` leaves an example with no answer choice.")
    if batch_size is not None and (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, (int, np.integer))
        or batch_size < 1
    ):
        raise ValueError(f"`batch_size` must be an integer >= 1 or None; got {batch_size!r}.")
    # Only real choices are scored; a padding choice's rows would be wasted model calls.
    rows_b, rows_c = np.nonzero(choice_mask)
    flat_inputs = input_ids[rows_b]
    flat_targets = target_ids[rows_b, rows_c]
    flat_mask = target_mask[rows_b, rows_c]
    step = len(rows_b) if batch_size is None else int(batch_size)
    pieces = []
    for start in range(0, len(rows_b), step):
        sl = slice(start, start + step)
        ll = np.asarray(score_fn(flat_inputs[sl], flat_targets[sl], flat_mask[sl]))
        if ll.shape != flat_targets[sl].shape:
            raise ValueError(
                f"`score_fn` returned shape {ll.shape} for targets of shape "
                f"{flat_targets[sl].shape}; it must return one log-likelihood "
                "per target token."
            )
        pieces.append(ll)
    flat_scores = choice_scores(np.concatenate(pieces), flat_mask, reduction)
    scores = np.full((b, c), -np.inf)
    scores[rows_b, rows_c] = flat_scores
    return np.argmax(scores, -1), scores


def _pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    length = max(len(r) for r in rows)
    ids = np.full((len(rows), length), pad_id, np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def _token_list(tokenize, text: str, must_be_non_empty: bool = False) -> list[int]:
    ids = np.asarray(tokenize(text)).reshape(-1).tolist()
    if not ids and must_be_non_empty:
        raise ValueError(
            f"`tokenize` gave no token for the answer choice {text!r} and no "
            "`eos_id` was given: a choice needs at least one target token."
        )
    return [int(i) for i in ids]


def rank_classify_examples(
    score_fn: Callable,
    tokenize: Callable,
    examples: Sequence,
    eos_id: int | None = None,
    pad_id: int = 0,
    reduction: str = "mean",
    batch_size: int | None = None,
):
    """Rank classification of `PromptedExample`s (or any objects with `input_text`,
    `answer_choices` and `label`) with a tokenizer-like callable.

    Args:
      score_fn: as in `rank_classification`.
      tokenize: `text -> token ids` (a list, numpy array or 1-D tensor), e.g. a keras-hub
        tokenizer called on one string. It must not add EOS itself when `eos_id` is given.
      examples: the examples; they may have different numbers of choices.
      eos_id: appended to every choice's target ids (the paper scores EOS too); `None` if
        `tokenize` already ends targets with EOS.
      pad_id: the id used to pad inputs and targets.
      reduction: as in `rank_classification`.
      batch_size: as in `rank_classification`.

    Returns:
      `(predictions[B], scores[B, C], labels[B])`; `accuracy(predictions, labels)` is the
      accuracy.

    Example:
      >>> from tf_metaalign import prompts
      >>> def score_fn(input_ids, target_ids, target_mask):  # a toy model: p = 0.9 for
      ...     # the input's first token, 0.1 for any other
      ...     return np.where(target_ids == input_ids[:, :1], np.log(0.9), np.log(0.1))
      >>> vocabulary = {"seven": 7, "eight": 8, "again?": 3}
      >>> def tokenize(text):
      ...     return [vocabulary[word] for word in text.split()]
      >>> template = prompts.Template("echo", "{word} again?", ["seven", "eight"])
      >>> examples = prompts.apply_templates(
      ...     template, [{"word": "seven", "label": 0}, {"word": "eight", "label": 0}])["echo"]
      >>> predictions, scores, labels = prompts.rank_classify_examples(
      ...     score_fn, tokenize, examples, eos_id=1)
      >>> predictions.tolist(), labels.tolist(), prompts.accuracy(predictions, labels)
      ([0, 1], [0, 0], 0.5)

    References:
      Sanh et al., ICLR 2022 (T0's rank classification); Wu et al., EMNLP 2022 (EOS
      scored with the answer; allenai/better-promptability).
    """
    examples = list(examples)
    if not examples:
        raise ValueError("`examples` is empty.")
    for i, e in enumerate(examples):
        if not getattr(e, "answer_choices", ()):
            raise ValueError(
                f"`examples`[{i}] has no answer choices: rank classification "
                "needs a template with `answer_choices`."
            )
    inputs, _ = _pad([_token_list(tokenize, e.input_text) for e in examples], pad_id)
    extra = [] if eos_id is None else [int(eos_id)]
    num_choices = max(len(e.answer_choices) for e in examples)
    targets = [
        [
            _token_list(tokenize, ch, must_be_non_empty=eos_id is None) + extra
            for ch in e.answer_choices
        ]
        for e in examples
    ]
    t = max(len(seq) for ex in targets for seq in ex)
    ids = np.full((len(examples), num_choices, t), pad_id, np.int64)
    mask = np.zeros_like(ids)
    choice_mask = np.zeros((len(examples), num_choices), bool)
    for i, ex in enumerate(targets):
        for j, seq in enumerate(ex):
            ids[i, j, : len(seq)] = seq
            mask[i, j, : len(seq)] = 1
            choice_mask[i, j] = True
    predictions, scores = rank_classification(
        score_fn, inputs, ids, mask, choice_mask, reduction=reduction, batch_size=batch_size
    )
    labels = np.asarray([e.label for e in examples], np.int64)
    return predictions, scores, labels


def accuracy(predictions, labels) -> float:
    """The fraction of `predictions` equal to `labels`.

    Args:
      predictions: the predicted labels (any array-like, not empty).
      labels: the true labels, of the same shape.

    Returns:
      The accuracy, a Python float.

    Example:
      >>> from tf_metaalign import prompts
      >>> prompts.accuracy([0, 1, 1, 2], [0, 1, 2, 2])
      0.75

    References:
      Wu et al., EMNLP 2022: the accuracy of rank classification, the paper's metric.
    """
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or predictions.size == 0:
        raise ValueError(
            f"`predictions` {predictions.shape} and `labels` {labels.shape} must "
            "be non-empty and of one shape."
        )
    return float(np.mean(predictions == labels))


# ----------------------------------------------------------------------- few-shot protocol


def stable_seed(*parts) -> list[int]:
    """Seed entropy from names: the CRC-32 of each part's `str`, the same in every process
    (Python's `hash()` of a str changes between processes; crc32 does not).

    Args:
      *parts: anything with a `str` (dataset and template names, numbers).

    Returns:
      A list of ints in [0, 2**32), one per part, for `np.random.default_rng([seed, *...])`
      (as `sample_few_shot` uses it).

    Example:
      >>> import zlib
      >>> from tf_metaalign import prompts
      >>> prompts.stable_seed("rte", "does_it_follow")
      [3737078793, 651579561]
      >>> prompts.stable_seed(3) == prompts.stable_seed("3") == [zlib.crc32(b"3")]
      True

    References:
      ISO-HDLC CRC-32 (`zlib.crc32`).
    """
    return [zlib.crc32(str(p).encode()) for p in parts]


def sample_few_shot(
    num_examples: int, num_shots: int = 16, seed: int = 0, dataset: str = "", template: str = ""
) -> np.ndarray:
    """The indices of the `num_shots` training examples of one (dataset, template):
    sampled without replacement, a pure function of `(seed, dataset, template)`.

    Args:
      num_examples: the number of training examples to sample from.
      num_shots: how many to sample (16 in the paper); at most `num_examples`.
      seed: the protocol's seed.
      dataset: the dataset's name (part of the seed).
      template: the template's name (part of the seed).

    Returns:
      The sorted indices, an int64 NumPy array `[num_shots]`.

    Example:
      >>> from tf_metaalign import prompts
      >>> prompts.sample_few_shot(100, num_shots=4, seed=0, dataset="rte", template="t1")
      array([43, 66, 82, 95])
      >>> prompts.sample_few_shot(100, num_shots=4, seed=0, dataset="rte", template="t2")
      array([ 1, 23, 66, 98])

    References:
      Wu et al., EMNLP 2022: 16 training examples per dataset and template, sampled with
      a seed (the few-shot setting).
    """
    check_positive_int(num_examples, "num_examples")
    check_positive_int(num_shots, "num_shots")
    if num_shots > num_examples:
        raise ValueError(
            f"`num_shots`={num_shots} exceeds the {num_examples} training "
            f"examples of dataset {dataset!r} template {template!r}."
        )
    rng = np.random.default_rng([int(seed)] + stable_seed(dataset, template))
    return np.sort(rng.choice(num_examples, size=num_shots, replace=False))


@dataclasses.dataclass
class FewShotResult:
    """One (dataset, template) of the few-shot protocol.

    Attributes:
      accuracy: the mean of `correct`.
      correct: the per-example 0/1 correctness on the evaluation examples after the final
        epoch (for the bootstrap).
      train_indices: the sampled training examples (`sample_few_shot`).

    Example:
      >>> from tf_metaalign import prompts
      >>> result = prompts.FewShotResult(0.75, np.array([1.0, 0.0, 1.0, 1.0]), np.array([3, 8]))
      >>> bool(result.accuracy == result.correct.mean())
      True
      >>> prompts.average_relative_gain({("rte", "t1"): result}, num_choices=2)
      0.5

    References:
      Wu et al., EMNLP 2022 (the few-shot setting: accuracy after the final epoch).
    """

    accuracy: float
    correct: np.ndarray
    train_indices: np.ndarray


def few_shot_prompt_tuning(
    tasks: Mapping[str, Mapping[str, tuple[Sequence, Sequence]]],
    build_model: Callable[[str, str], Any],
    train: Callable[[Any, list, int], Any],
    evaluate: Callable[[Any, Sequence], Any],
    num_shots: int = 16,
    epochs: int = 100,
    seed: int = 0,
) -> dict[tuple[str, str], FewShotResult]:
    """The paper's few-shot prompt-tuning protocol, on any model.

    For every dataset and template: `model = build_model(dataset, template)` (a fresh
    prompt on the continued-pretrained model: the caller resets whatever was tuned before),
    `num_shots` training examples sampled by `sample_few_shot(..., seed, dataset,
    template)`, `train(model, examples, epochs)` (prompt tuning for `epochs` epochs over
    those examples; it may return a new model, else `model` is kept), then
    `evaluate(model, eval_examples)` once, after the final epoch (no model selection).

    Args:
      tasks: `{dataset: {template: (train_examples, eval_examples)}}`.
      build_model: `(dataset, template) -> model`, a fresh prompt for one task.
      train: `(model, examples, epochs) -> model or None`, the prompt tuning.
      evaluate: returns the per-example correctness (a 1-D 0/1 or bool array, one entry per
        evaluation example), so that `paired_bootstrap_arg` can resample it.
      num_shots: the training examples sampled per (dataset, template) (16 in the paper).
      epochs: the epochs of training (100 in the paper).
      seed: the sampling seed (`sample_few_shot`).

    Returns:
      `{(dataset, template): FewShotResult}`, in the order of `tasks`.

    Example:
      >>> from tf_metaalign import prompts
      >>> train_set = [("good", 1)] * 9 + [("bad", 0)] * 3  # (text, label) pairs
      >>> eval_set = [("fine", 1), ("awful", 0), ("great", 1)]
      >>> def build_model(dataset, template):  # a toy "model": the majority label
      ...     return {"label": None}
      >>> def train(model, examples, epochs):
      ...     labels = [label for _, label in examples]
      ...     model["label"] = max(set(labels), key=labels.count)
      >>> def evaluate(model, examples):
      ...     return [label == model["label"] for _, label in examples]
      >>> results = prompts.few_shot_prompt_tuning(
      ...     {"toy": {"t1": (train_set, eval_set)}}, build_model, train, evaluate,
      ...     num_shots=4, epochs=1)
      >>> result = results["toy", "t1"]
      >>> result.train_indices.tolist(), result.correct.tolist()  # 3 of 4 shots say 1
      ([2, 4, 6, 10], [1.0, 0.0, 1.0])
      >>> bool(np.array_equal(result.train_indices, prompts.sample_few_shot(12, 4, 0, "toy", "t1")))
      True

    References:
      Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
      EMNLP 2022 (allenai/better-promptability).
    """
    check_positive_int(num_shots, "num_shots")
    check_positive_int(epochs, "epochs")
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError(
            "`tasks` must be a non-empty mapping {dataset: {template: "
            "(train_examples, eval_examples)}}."
        )
    results = {}
    for dataset, templates in tasks.items():
        if not isinstance(templates, Mapping) or not templates:
            raise ValueError(
                f"`tasks`[{dataset!r}] must be a non-empty mapping {{template: "
                "(train_examples, eval_examples)}}."
            )
        for template, pair in templates.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(
                    f"`tasks`[{dataset!r}][{template!r}] must be a pair "
                    "(train_examples, eval_examples)."
                )
            train_examples, eval_examples = pair
            index = sample_few_shot(len(train_examples), num_shots, seed, dataset, template)
            model = build_model(dataset, template)
            trained = train(model, [train_examples[i] for i in index], int(epochs))
            model = model if trained is None else trained
            correct = np.asarray(evaluate(model, eval_examples)).astype(np.float64).reshape(-1)
            if correct.size != len(eval_examples) or not np.isin(correct, (0.0, 1.0)).all():
                raise ValueError(
                    f"`evaluate` must return one 0/1 correctness per evaluation "
                    f"example ({len(eval_examples)} for {dataset!r}/{template!r});"
                    f" got {correct.size} values."
                )
            results[(dataset, template)] = FewShotResult(float(correct.mean()), correct, index)
    return results


# ----------------------------------------------------------------------- ARG and bootstrap


def relative_gain(accuracy_: float, num_choices: int) -> float:
    """`(accuracy - chance) / chance` with `chance = 1 / num_choices`.

    Args:
      accuracy_: an accuracy in [0, 1].
      num_choices: the number of answer choices, >= 2.

    Returns:
      The relative gain over chance, a Python float (0 at chance, -1 at accuracy 0).

    Example:
      >>> from tf_metaalign import prompts
      >>> prompts.relative_gain(0.75, 2), prompts.relative_gain(0.5, 2)
      (0.5, 0.0)
      >>> round(prompts.relative_gain(0.5, 3), 6)  # chance 1/3
      0.5

    References:
      Ye et al., "CrossFit", EMNLP 2021; Wu et al., EMNLP 2022 (ARG).
    """
    if (
        isinstance(num_choices, bool)
        or not isinstance(num_choices, (int, np.integer))
        or num_choices < 2
    ):
        raise ValueError(f"`num_choices` must be an integer >= 2; got {num_choices!r}.")
    chance = 1.0 / num_choices
    return (float(accuracy_) - chance) / chance


WEIGHTINGS = ("dataset", "template")


def _choices_of(num_choices, key) -> int:
    dataset = key[0]
    if isinstance(num_choices, Mapping):
        if key in num_choices:
            return num_choices[key]
        if dataset in num_choices:
            return num_choices[dataset]
        raise ValueError(f"`num_choices` has no entry for dataset {dataset!r} (or for {key!r}).")
    return num_choices


def _check_keys(results, arg_name) -> list:
    if not isinstance(results, Mapping) or not results:
        raise ValueError(
            f"`{arg_name}` must be a non-empty mapping {{(dataset, template): value}}}}."
        )
    for key in results:
        if not isinstance(key, tuple) or len(key) != 2:
            raise ValueError(f"`{arg_name}` keys must be (dataset, template) pairs; got {key!r}.")
    return list(results)


def _weights(keys, weighting) -> np.ndarray:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"`weighting` must be one of {WEIGHTINGS}; got {weighting!r}.")
    if weighting == "template":
        return np.full(len(keys), 1.0 / len(keys))
    per_dataset = {}
    for d, _ in keys:
        per_dataset[d] = per_dataset.get(d, 0) + 1
    return np.asarray([1.0 / (len(per_dataset) * per_dataset[d]) for d, _ in keys])


def average_relative_gain(
    accuracies: Mapping[tuple[str, str], Any],
    num_choices: Mapping[Hashable, int] | int,
    weighting: str = "dataset",
) -> float:
    """ARG = the average over datasets and templates of `relative_gain(accuracy, choices)`.

    Args:
      accuracies: `{(dataset, template): accuracy}`; a value may also be a `FewShotResult`
        or a per-example 0/1 array (its mean is the accuracy).
      num_choices: the number of answer choices, `{dataset: C}` or `{(dataset, template):
        C}`, or one int for all.
      weighting: "dataset" (default: mean over templates, then over datasets) or
        "template" (every (dataset, template) pair weighs the same).

    Returns:
      The ARG, a Python float.

    Example:
      >>> from tf_metaalign import prompts
      >>> accuracies = {("rte", "t1"): 0.75, ("rte", "t2"): 0.25, ("copa", "t1"): 1.0}
      >>> prompts.average_relative_gain(accuracies, num_choices=2)  # mean(0.5, -0.5), 1.0
      0.5
      >>> round(prompts.average_relative_gain(accuracies, 2, weighting="template"), 4)
      0.3333

    References:
      Ye et al., "CrossFit", EMNLP 2021; Wu et al., EMNLP 2022 (Average Relative Gain;
      `aggregate_results.py` in allenai/better-promptability).
    """
    keys = _check_keys(accuracies, "accuracies")
    gains = np.asarray(
        [relative_gain(_accuracy_of(accuracies[k]), _choices_of(num_choices, k)) for k in keys]
    )
    return float(np.dot(_weights(keys, weighting), gains))


def _accuracy_of(value) -> float:
    if isinstance(value, FewShotResult):
        return value.accuracy
    value = np.asarray(value, np.float64)
    if value.size == 0:
        raise ValueError("An accuracy entry is an empty array.")
    return float(value.mean())


@dataclasses.dataclass
class BootstrapResult:
    """What `paired_bootstrap_arg` returns.

    Attributes:
      arg_a: the observed ARG of method A.
      arg_b: the observed ARG of method B.
      difference: arg_a - arg_b.
      p_value: the one-sided bootstrap p-value of "ARG(A) > ARG(B)".
      num_resamples: the number of resamples.
      differences: the resampled differences, `[num_resamples]`.

    Example:
      >>> from tf_metaalign import prompts
      >>> a = {("rte", "t1"): [1, 1, 1, 0, 1, 1, 0, 1]}
      >>> b = {("rte", "t1"): [1, 0, 1, 0, 0, 1, 0, 1]}
      >>> result = prompts.paired_bootstrap_arg(a, b, num_choices=2)
      >>> result.differences.shape, result.p_value  # mid-p: ties count one half
      ((1000,), 0.043)
      >>> float(np.mean(result.differences < 0) + 0.5 * np.mean(result.differences == 0))
      0.043

    References:
      Koehn, EMNLP 2004; Berg-Kirkpatrick et al., EMNLP 2012 (paired bootstrap).
    """

    arg_a: float
    arg_b: float
    difference: float
    p_value: float
    num_resamples: int
    differences: np.ndarray


def paired_bootstrap_arg(
    correct_a: Mapping[tuple[str, str], Any],
    correct_b: Mapping[tuple[str, str], Any],
    num_choices: Mapping[Hashable, int] | int,
    num_resamples: int = 1000,
    seed: int = 0,
    weighting: str = "dataset",
) -> BootstrapResult:
    """Paired bootstrap p-value for "method A has a higher ARG than method B".

    Both methods are evaluated on the same examples: `correct_a[(dataset, template)]` and
    `correct_b[...]` are 0/1 per-example correctness arrays (or `FewShotResult`s) of equal
    length, aligned example by example. Each resample draws, independently for every
    (dataset, template), as many example indices with replacement as it has examples, the
    SAME indices for A and B (paired: the example difficulty cancels), and recomputes
    ARG(A) - ARG(B). The p-value is the fraction of resamples where the difference is
    below 0, ties counting one half (mid-p: two identical methods get exactly 0.5, not 1):
    small p means A is better. `num_resamples` (default 1000, as is usual in NLP
    significance tests, Koehn 2004; Berg-Kirkpatrick et al. 2012) bounds the resolution
    at 1/num_resamples. Deterministic given `seed`.

    Args:
      correct_a: `{(dataset, template): per-example 0/1 correctness}` of method A.
      correct_b: the same for method B, on the same examples.
      num_choices: as in `average_relative_gain`.
      num_resamples: the number of bootstrap resamples.
      seed: the resampling seed.
      weighting: as in `average_relative_gain`.

    Returns:
      A `BootstrapResult`.

    Example:
      >>> from tf_metaalign import prompts
      >>> a = {("rte", "t1"): [1, 1, 1, 0, 1, 1, 0, 1]}  # accuracy 0.75
      >>> b = {("rte", "t1"): [1, 0, 1, 0, 0, 1, 0, 1]}  # accuracy 0.5, chance
      >>> result = prompts.paired_bootstrap_arg(a, b, num_choices=2, seed=0)
      >>> result.arg_a, result.arg_b, result.difference, result.p_value
      (0.5, 0.0, 0.5, 0.043)
      >>> prompts.paired_bootstrap_arg(a, a, num_choices=2).p_value  # identical methods
      0.5

    References:
      Koehn, "Statistical Significance Tests for Machine Translation Evaluation", EMNLP
      2004; Berg-Kirkpatrick, Burkett, Klein, "An Empirical Investigation of Statistical
      Significance in NLP", EMNLP 2012.
    """
    keys = _check_keys(correct_a, "correct_a")
    if set(keys) != set(_check_keys(correct_b, "correct_b")):
        raise ValueError(
            f"`correct_a` and `correct_b` must have the same (dataset, template) "
            f"keys; got {sorted(keys)} and {sorted(correct_b)}."
        )
    if (
        isinstance(num_resamples, bool)
        or not isinstance(num_resamples, (int, np.integer))
        or num_resamples < 1
    ):
        raise ValueError(f"`num_resamples` must be an integer >= 1; got {num_resamples!r}.")
    keys = sorted(keys)  # the resampling order must not depend on the dicts' order
    weights = _weights(keys, weighting)
    rng = np.random.default_rng(int(seed))
    observed = np.zeros(2)
    resampled = np.zeros((2, num_resamples))
    for key, w in zip(keys, weights):
        a, b = (
            _correctness(c[key], name, key)
            for c, name in ((correct_a, "correct_a"), (correct_b, "correct_b"))
        )
        if a.shape != b.shape:
            raise ValueError(
                f"{key!r}: `correct_a` has {a.size} examples and `correct_b` "
                f"{b.size}; a paired test needs the same examples."
            )
        chance = 1.0 / _checked_choices(_choices_of(num_choices, key))
        index = rng.integers(0, a.size, size=(num_resamples, a.size))
        for row, values in enumerate((a, b)):
            observed[row] += w * (values.mean() - chance) / chance
            resampled[row] += w * (values[index].mean(-1) - chance) / chance
    differences = resampled[0] - resampled[1]
    p_value = (np.sum(differences < 0) + 0.5 * np.sum(differences == 0)) / num_resamples
    return BootstrapResult(
        float(observed[0]),
        float(observed[1]),
        float(observed[0] - observed[1]),
        float(p_value),
        int(num_resamples),
        differences,
    )


def _checked_choices(n) -> int:
    relative_gain(0.0, n)  # validates n
    return int(n)


def _correctness(value, arg_name, key) -> np.ndarray:
    if isinstance(value, FewShotResult):
        value = value.correct
    value = np.asarray(value, np.float64).reshape(-1)
    if value.size == 0 or not np.isin(value, (0.0, 1.0)).all() or not math.isfinite(value.sum()):
        raise ValueError(
            f"`{arg_name}`[{key!r}] must be a non-empty 0/1 per-example correctness array."
        )
    return value
