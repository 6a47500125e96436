"""Battery entries for the prompt FOMAML / Reptile trainers on a prompted keras-hub decoder
(`prompts.prompt_causal_lm`: a tiny GPT-2 with a deep key/value prefix, `train="both"`:
the inner loop adapts the prefix, the outer step trains the prefix and the transformer),
for `tests/trainer_entries.py`, which appends them at its end. Model batches are the
backbone's dict `{"token_ids", "padding_mask"}` with next-token targets.
"""

from __future__ import annotations

import keras

from backend_battery import (
    decoder_task_data,
    prompted_gpt2,
    token_batches,
)
from trainer_entries import (
    CHECKS,
    STACKED_K,
    TASK_BATCH_FIELDS,
    TrainerEntry,
    prompt_fomaml_trainer,
)

# The tiny prompted GPT-2 and its tasks: backend_battery's (TensorFlow-free), one copy.


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
