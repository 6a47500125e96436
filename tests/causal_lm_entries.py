"""Battery entries for the prompt FOMAML / Reptile trainers on a prompted keras-hub decoder
(`prompts.prompt_causal_lm`: a tiny GPT-2 with a deep key/value prefix, `train="both"`:
the inner loop adapts the prefix, the outer step trains the prefix and the transformer),
for `tests/trainer_entries.py`, which appends them at its end. Model batches are the
backbone's dict `{"token_ids", "padding_mask"}` with next-token targets.
"""

from __future__ import annotations

import keras
import numpy as np

from trainer_entries import (
    CHECKS,
    STACKED_K,
    TASK_BATCH_FIELDS,
    TrainerEntry,
    prompt_fomaml_trainer,
)

VOCABULARY, TOKENS = 16, 4


def prompted_gpt2(dtype="float64", dropout=0.0, seed=0):
    """A one-layer GPT-2 (hidden 4, 2 heads) with a deep prefix of 2 positions."""
    from tf_metaalign import prompts
    from tiny_backbones import tiny_backbone

    keras.utils.set_random_seed(seed)
    backbone = tiny_backbone(
        "gpt2",
        vocabulary_size=VOCABULARY,
        num_layers=1,
        hidden_dim=4,
        intermediate_dim=8,
        max_sequence_length=8,
        dropout=dropout,
        dtype=dtype,
    )
    return prompts.prompt_causal_lm(backbone, length=2, mode="deep", train="both", seed=seed)


def token_batches(n, dtype="float64", seed=0):
    """n rows of TOKENS token ids (the last row's final token padded) and their next
    tokens: the rule next = (3 * token + 1) mod VOCABULARY, so that training moves."""
    del dtype  # token ids whatever the float dtype
    rng = np.random.default_rng(seed)
    first = rng.integers(1, VOCABULARY, (n, 1))
    ids = [first]
    for _ in range(TOKENS):
        ids.append((3 * ids[-1] + 1) % VOCABULARY)
    ids = np.concatenate(ids, 1).astype("int32")
    mask = np.ones((n, TOKENS), "int32")
    mask[-1, -1] = 0
    return {"token_ids": ids[:, :-1] * mask, "padding_mask": mask}, ids[:, 1:]


def decoder_task_data(n, dtype="float64", seed=0, steps=STACKED_K, n_support=2, n_query=2):
    """n tasks `((support_x, support_y, query_x), query_y)` of `token_batches` rows, as the
    prompt entries' `prompt_task_data` cuts its regression rows."""
    per_task = steps * n_support + n_query
    x, y = token_batches(n * per_task, seed=seed)
    cut = steps * n_support

    def split(a):
        a = a.reshape((n, per_task) + a.shape[1:])
        return a[:, :cut].reshape((n, steps, n_support) + a.shape[2:]), a[:, cut:]

    support_x, query_x = {}, {}
    for key, value in x.items():
        support_x[key], query_x[key] = split(value)
    support_y, query_y = split(y)
    return (support_x, support_y, query_x), query_y


def _compile():
    return dict(
        optimizer=keras.optimizers.Adam(0.02),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )


def _reptile(model, data_dtype):
    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers.prompt_meta import PromptReptileTrainer

    return PromptReptileTrainer(
        model,
        inner_steps=STACKED_K,
        inner_optimizer=O.SGD(0.1),
        carry_inner_state=False,
        tasks_per_batch=8,
    )


# The default suite runs the "entry" check only: every other check builds, traces and
# trains keras-hub models several times (35-90 s each on 2 shared cores; all pass under
# -m slow but the one below). tests/prompts/test_prompts_causal_lm.py trains one meta-step.
_SLOW = tuple(c for c in CHECKS if c != "entry")
_CAUSAL_LM_COMPILE = (
    "keras-hub's CausalLM.compile adds weighted_sparse_categorical_accuracy by default "
    "(weighted_metrics='auto'), so the copy compiled with loss and metrics only reports one "
    "metric more than the trained model"
)
_XFAIL = {"model_after_fit": (_CAUSAL_LM_COMPILE, AssertionError)}

_DECODER_FIELDS = dict(
    compile_kwargs=_compile,
    state_variables=("count",),
    diagnostics=("support_loss",),
    make_model=prompted_gpt2,
    make_data=decoder_task_data,
    make_eval_data=token_batches,
    slow=_SLOW,
    xfail=_XFAIL,
    **TASK_BATCH_FIELDS,
)

DECODER_ENTRIES = [
    # The "prompt_fomaml" entry's trainer (a fresh Adam per task) on the decoder.
    TrainerEntry(name="prompt_fomaml_gpt2", make_trainer=prompt_fomaml_trainer, **_DECODER_FIELDS),
    TrainerEntry(name="prompt_reptile_gpt2", make_trainer=_reptile, **_DECODER_FIELDS),
]
