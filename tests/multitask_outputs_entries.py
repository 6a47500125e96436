"""Battery entries for MultiTaskTrainer(tasks='outputs') (a two-output model compiled with
a loss per output and loss weights) and its rep_grad option (MGDA-UB), for
`tests/trainer_entries.py`, which appends them at its end (their targets are a dict per
output: the battery slices targets with `B.take_rows`).
"""

from __future__ import annotations

import keras
import numpy as np

from trainer_entries import TrainerEntry, regression_data


def two_head_mlp(dtype="float64", dropout=0.0, seed=0):
    """Input(4) -> Dense(5, tanh) -> [Dropout] -> heads "a" Dense(3, tanh) -> Dense(1)
    and "b" Dense(1): a shared trunk, a two-layer head and a one-layer head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype=dtype or keras.backend.floatx())
    h = keras.layers.Dense(5, activation="tanh", dtype=dtype, name="trunk")(inputs)
    if dropout:
        h = keras.layers.Dropout(dropout, seed=7, dtype=dtype)(h)
    a = keras.layers.Dense(3, activation="tanh", dtype=dtype, name="a_hidden")(h)
    a = keras.layers.Dense(1, dtype=dtype, name="a")(a)
    b = keras.layers.Dense(1, dtype=dtype, name="b")(h)
    return keras.Model(inputs, [a, b], name="two_heads")


def two_output_data(n, dtype="float64", seed=0):
    """`regression_data`'s two target columns as two outputs; "b" is scaled by -3 on the
    even rows and shifted by x_0, so that the tasks' trunk gradients conflict."""
    x, y = regression_data(n, dtype=dtype, seed=seed)
    flip = np.where(np.arange(n) % 2 == 0, -3.0, 1.0).astype(dtype)
    return x, {"a": y[:, :1], "b": (y[:, 1:] * flip[:, None] + x[:, :1]).astype(dtype)}


def _compile():
    return dict(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"a": keras.losses.MeanSquaredError(), "b": keras.losses.MeanSquaredError()},
        loss_weights={"a": 1.0, "b": 0.5},
        metrics={"a": ["mae"]},
    )


def _trainer(method, **options):
    def make(model, data_dtype):
        from tf_metaalign.trainers import MultiTaskTrainer

        return MultiTaskTrainer(model, method=method, **options)

    return make


OUTPUT_ENTRIES = [
    TrainerEntry(
        name="multitask_outputs_pcgrad",
        make_trainer=_trainer("pcgrad", seed=3),
        compile_kwargs=_compile,
        state_variables=("count",),
        diagnostics=("task_cosine",),
        make_model=two_head_mlp,
        make_data=two_output_data,
        make_eval_data=two_output_data,
        slow=("multi_worker",),  # "multitask_pcgrad" runs MultiTaskTrainer's by default
    ),
    TrainerEntry(
        name="multitask_outputs_mgda_rep_grad",
        make_trainer=_trainer("mgda", rep_grad=True),
        compile_kwargs=_compile,
        state_variables=("count",),
        diagnostics=("task_cosine",),
        make_model=two_head_mlp,
        make_data=two_output_data,
        make_eval_data=two_output_data,
        # the default suite runs the checks where rep_grad's own path matters (XLA,
        # 2 replicas, save/reload); the rest under -m slow (the suite's budget)
        slow=(
            "multi_worker",
            "backup_machinery",
            "backup_and_restore",
            "mixed_float16",
            "mixed_bfloat16",
            "steps_per_execution",
            "eager",
            "ragged_last_batch",
            "model_after_fit",
        ),
    ),
]
