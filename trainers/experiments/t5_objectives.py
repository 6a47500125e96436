"""T5's two unsupervised objectives on token ids, NumPy ports of
`t5.data.preprocessors` (github.com/google-research/text-to-text-transfer-transformer,
t5/data/preprocessors.py):

  random_spans_noise_mask / noise_span_to_unique_sentinel / span_corruption / random_spans_helper
                          T5's span corruption (Raffel et al. 2020)
  random_prefix_noise_mask / lm_adaptation
                          T5's `prefix_lm` objective, used for the "LM adapted" T5 v1.1
                          checkpoints (Lester et al. 2021) that Wu et al. start from
  restore_from_span_corruption
                          the inverse of span corruption (a test oracle)

Randomness: every function takes a `numpy.random.Generator` (or a seed). The mask
*distribution* is T5's; the draws are NumPy's, so masks are not bit-identical to T5's
`stateless_shuffle` ones for the same seed. The special ids and sentinels are
`trainers.experiments.t5_vocabulary`'s.
"""

from __future__ import annotations

import numpy as np

from trainers.experiments.t5_vocabulary import EOS_ID, PAD_ID, T5_NUM_EXTRA_IDS, check_int


def num_noise_tokens_and_spans(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's deterministic counts in `random_spans_noise_mask`:
        num_noise_tokens = clip(round(max(length, 2) * noise_density), 1, length - 1)
        num_noise_spans  = max(round(num_noise_tokens / mean_noise_span_length), 1)
    computed in float32 with round-half-to-even, as T5's `tf.round(tf.cast(.., tf.float32))`
    (float32 matters: 190 * 0.15 is 28.5 in float64 (-> 28) but 28.500002 in float32 (-> 29);
    166 lengths below 20,000 differ)."""
    length = max(int(length), 2)
    noise = int(np.round(np.float32(length) * np.float32(noise_density)))
    noise = min(max(noise, 1), length - 1)
    spans = int(np.round(np.float32(noise) / np.float32(mean_noise_span_length)))
    return noise, max(spans, 1)


def _random_segmentation(num_items: int, num_segments: int, rng) -> np.ndarray:
    # T5's `_random_segmentation`: shuffle (num_segments - 1) segment starts among the
    # num_items - 1 gaps; every partition into non-empty segments is equally likely.
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_id = np.cumsum(np.concatenate([[0], first_in_segment]))
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0, rng=None
) -> np.ndarray:
    """T5's `random_spans_noise_mask` (t5/data/preprocessors.py): a bool mask of `length`.

    Spans alternate non-noise, noise, non-noise, ..., starting with non-noise and ending
    with noise; `num_noise_tokens_and_spans` gives the counts; the span lengths are two
    independent uniform random segmentations. `rng`: a `numpy.random.Generator` or seed.
    """
    length = check_int("length", length, 1)
    if not 0.0 < float(noise_density) < 1.0:
        raise ValueError(f"`noise_density` must be in (0, 1); got {noise_density!r}.")
    if float(mean_noise_span_length) < 1.0:
        raise ValueError(f"`mean_noise_span_length` must be >= 1; got {mean_noise_span_length!r}.")
    rng = np.random.default_rng(rng)
    orig_length, length = length, max(length, 2)  # T5: "increase length to avoid degeneracy"
    num_noise, num_spans = num_noise_tokens_and_spans(length, noise_density, mean_noise_span_length)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_index = np.repeat(np.arange(2 * num_spans), interleaved)
    return (span_index % 2 == 1)[:orig_length]


def noise_span_to_unique_sentinel(
    tokens: np.ndarray, noise_mask: np.ndarray, vocabulary_size: int
) -> np.ndarray:
    """T5's `noise_span_to_unique_sentinel`: each noise span -> one sentinel, the k-th span
    (0-based) getting `sentinel_id(vocabulary_size, k)` = vocabulary_size - 1 - k."""
    tokens = np.asarray(tokens)
    noise_mask = np.asarray(noise_mask, bool)
    if tokens.shape != noise_mask.shape or tokens.ndim != 1:
        raise ValueError(
            f"`tokens` and `noise_mask` must be 1-D of one shape; got "
            f"{tokens.shape} and {noise_mask.shape}."
        )
    prev_is_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise = noise_mask & ~prev_is_noise
    subsequent_noise = noise_mask & prev_is_noise
    sentinels = vocabulary_size - np.cumsum(first_noise)  # = V - 1 - k at the k-th span
    out = np.where(first_noise, sentinels, tokens).astype(tokens.dtype)
    return out[~subsequent_noise]


def nonnoise_span_to_unique_sentinel(tokens, noise_mask, vocabulary_size) -> np.ndarray:
    """T5's `nonnoise_span_to_unique_sentinel`: the same on the complement mask."""
    return noise_span_to_unique_sentinel(tokens, ~np.asarray(noise_mask, bool), vocabulary_size)


def span_corruption(
    tokens,
    vocabulary_size: int,
    rng=None,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    eos_id: int = EOS_ID,
) -> tuple[np.ndarray, np.ndarray]:
    """T5's span corruption of one token sequence: `(inputs, targets)`, each ending in EOS.

    `t5.data.preprocessors.span_corruption` = `denoise(noise_mask_fn=random_spans_noise_mask,
    inputs_fn=noise_span_to_unique_sentinel, targets_fn=nonnoise_span_to_unique_sentinel)`,
    with seqio appending EOS to both features. Since the mask starts with non-noise and ends
    with noise: inputs = n_0 <X_0> n_1 <X_1> ... n_{k-1} <X_{k-1}> </s> and
    targets = <X_0> s_0 <X_1> s_1 ... <X_{k-1}> s_{k-1} </s>, with <X_j> = id V - 1 - j.
    Raises if the spans need more than `num_extra_ids` sentinels.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"`tokens` must be a non-empty 1-D id array; got shape {tokens.shape}.")
    _, num_spans = num_noise_tokens_and_spans(tokens.size, noise_density, mean_noise_span_length)
    if num_spans > num_extra_ids:
        raise ValueError(
            f"A sequence of {tokens.size} tokens has {num_spans} noise spans but "
            f"only `num_extra_ids`={num_extra_ids} sentinels exist; use shorter "
            "sequences."
        )
    mask = random_spans_noise_mask(tokens.size, noise_density, mean_noise_span_length, rng)
    eos = np.array([eos_id], np.int32)
    inputs = np.concatenate([noise_span_to_unique_sentinel(tokens, mask, vocabulary_size), eos])
    targets = np.concatenate([nonnoise_span_to_unique_sentinel(tokens, mask, vocabulary_size), eos])
    return inputs, targets


def random_spans_helper(
    inputs_length: int = 512, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's `random_spans_helper`: the raw chunk length whose span-corrupted inputs (with
    one sentinel per span and EOS) fill `inputs_length`, and the targets' length.
    T5: inputs_length 512 -> (568, 114). Uses Python's `round`, as T5 does here."""
    inputs_length = check_int("inputs_length", inputs_length, 2)

    def lengths(tokens_length):
        num_noise = int(round(tokens_length * noise_density))
        num_nonnoise = tokens_length - num_noise
        num_spans = int(round(num_noise / mean_noise_span_length))
        return num_nonnoise + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:  # T5's "minor hack"
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def random_prefix_noise_mask(length: int, rng=None, noise_density: float = 0.5) -> np.ndarray:
    """T5's `random_prefix_noise_mask` (the `prefix_lm` objective): noise = a suffix.

    The prefix has n ~ Uniform{min_n, ..., length - 1} tokens, min_n =
    clip(round((1 - 2 * noise_density) * (length - 1)), 1, length - 1); at T5's
    noise_density 0.5 the split point is uniform over 1..length-1, so both parts are
    non-empty.
    """
    length = check_int("length", length, 2)
    if not 0.0 < float(noise_density) <= 0.5:
        raise ValueError(
            f"`noise_density` must be in (0, 0.5] (T5 raises above 0.5); got {noise_density!r}."
        )
    rng = np.random.default_rng(rng)
    max_inputs = length - 1
    min_inputs = min(
        max_inputs,
        max(1, int(np.round(np.float32(1 - 2 * noise_density) * np.float32(max_inputs)))),
    )
    num_inputs = int(rng.integers(min_inputs, max_inputs + 1))
    return np.arange(length) >= num_inputs


def lm_adaptation(
    tokens, rng=None, noise_density: float = 0.5, eos_id: int = EOS_ID
) -> tuple[np.ndarray, np.ndarray]:
    """LM adaptation (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt
    Tuning", sec. 3.2; T5's `prefix_lm` preprocessor): inputs = a random prefix + EOS,
    targets = the rest + EOS, so `inputs[:-1] ++ targets[:-1] == tokens`."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(
            f"`tokens` must be a 1-D id array of at least 2 ids; got shape {tokens.shape}."
        )
    mask = random_prefix_noise_mask(tokens.size, rng, noise_density)
    eos = np.array([eos_id], np.int32)
    return np.concatenate([tokens[~mask], eos]), np.concatenate([tokens[mask], eos])


def restore_from_span_corruption(
    inputs,
    targets,
    vocabulary_size: int,
    num_extra_ids: int = T5_NUM_EXTRA_IDS,
    eos_id: int = EOS_ID,
) -> np.ndarray:
    """Inverts `span_corruption`: each sentinel of `inputs` replaced by what follows the same
    sentinel in `targets` (up to the next sentinel or EOS). Trailing EOS/pad are dropped."""

    def strip(ids):
        ids = list(np.asarray(ids).tolist())
        while ids and ids[-1] in (eos_id, PAD_ID):
            ids.pop()
        return ids

    first_sentinel = vocabulary_size - num_extra_ids
    spans, current = {}, None
    for t in strip(targets):
        if t >= first_sentinel:
            current = t
            spans[current] = []
        elif current is None:
            raise ValueError("`targets` must start with a sentinel.")
        else:
            spans[current].append(t)
    out = []
    for t in strip(inputs):
        out.extend(spans[t] if t >= first_sentinel else [t])
    return np.asarray(out, np.int32)
