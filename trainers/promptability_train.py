"""The promptability program's continued pre-training (`python -m trainers.promptability`,
step 2): each configuration's training from the pre-trained T5, and the token loss that
measures it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trainers.promptability_config import TRAIN

if TYPE_CHECKING:
    from trainers.promptability_config import Config


def token_loss(lm, x, y, batch_size: int = 64) -> float:
    """`lm`'s mean target-token cross-entropy over ALL of `(x, y)` (`encode_examples`):
    summed over the real tokens and divided by their count once, where Keras's `evaluate`
    would average per-batch means."""
    import keras
    import numpy as np

    from tf_metaalign.prompts.evaluation import token_log_likelihoods

    nll = tokens = 0.0
    for start in range(0, len(y), batch_size):
        sl = slice(start, start + batch_size)
        logits = lm({k: v[sl] for k, v in x.items()})
        real = y[sl] != 0
        log_p = keras.ops.convert_to_numpy(token_log_likelihoods(logits, y[sl]))
        nll -= float(np.sum(np.where(real, log_p, 0)))
        tokens += float(real.sum())
    return nll / tokens


def adafactor_optimizer(learning_rate, clip=True):
    from tf_metaalign.trainers.prompt_meta import default_adafactor

    # The paper: Adafactor at 1e-3 (HF settings), the gradient clipped at global norm 1.0.
    return default_adafactor(learning_rate, **({"global_clipnorm": 1.0} if clip else {}))


def build_prompted(backbone, config: Config, mode: str, train: str, length=None):
    from tf_metaalign import prompts
    from tf_metaalign.prompts.t5_lm import PromptedT5LM

    prompted = prompts.prompt_t5(
        backbone,
        config.prompt_length if length is None else length,
        mode,
        train=train,
        seed=config.seed,
    )
    return prompted, PromptedT5LM(prompted)


def continued_pretraining(
    configuration: str, mode: str, backbone, data, config: Config, log=print
) -> dict:
    """Trains `backbone` in place (and a new prompt) as `configuration` says; returns the
    run's record with the prompt values (None for mtl_t), `mean_loss` (Keras's loss of the
    run: the mean over ALL its steps, not the last one) and, when `data` has "fit" (an
    `encode_examples` pair), `end_loss`: the trained model's `token_loss` on it."""
    import keras
    import numpy as np

    from tf_metaalign.prompts.t5_lm import masked_token_loss
    from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer, PromptReptileTrainer
    from trainers import common

    train = TRAIN[configuration]
    length = 0 if configuration == "mtl_t" else config.prompt_length
    prompted, lm = build_prompted(backbone, config, mode, train, length)
    start = time.perf_counter()
    name = f"{configuration}/{mode}" if configuration != "mtl_t" else configuration
    if configuration in ("fomaml", "reptile"):
        (sx, sy, qx), qy = data["meta"]
        lm({k: v[0, 0] for k, v in sx.items()})  # build (the trainer's state needs it)
        cls = PromptFOMAMLTrainer if configuration == "fomaml" else PromptReptileTrainer
        model = cls(
            lm,
            prompt_variables=list(prompted.prompt_variables),
            inner_steps=config.inner_steps,
            inner_optimizer=adafactor_optimizer(config.learning_rate, clip=False),
        )
        steps, examples = (
            config.meta_steps,
            qy.shape[0] * (config.inner_steps + 1) * config.task_batch_size,
        )
        fit_args = dict(x=meta_batches((sx, sy, qx), qy, config.meta_batch), shuffle=False)
    else:
        model = lm
        x, y = data["mtl"]
        steps, examples = config.steps, len(y)
        fit_args = dict(x=x, y=y, batch_size=config.batch_size, shuffle=False)
    model.compile(
        optimizer=adafactor_optimizer(config.learning_rate),
        loss=masked_token_loss(),
        jit_compile=common.fit_jit_compile(),
    )
    progress = common.ProgressCallback(
        log, name, steps, max(1, config.log_every * steps // config.steps)
    )
    history = model.fit(**fit_args, epochs=1, verbose=0, callbacks=[progress])
    seconds = time.perf_counter() - start
    prompt = (
        [np.array(keras.ops.convert_to_numpy(v)) for v in prompted.prompt_variables]
        if configuration != "mtl_t"
        else None
    )
    return {
        "configuration": configuration,
        "mode": mode if configuration != "mtl_t" else None,
        "steps": steps,
        "examples": int(examples),
        "mean_loss": float(history.history["loss"][-1]),
        "prompt": prompt,
        "end_loss": token_loss(lm, *data["fit"]) if "fit" in data else None,
        "seconds": seconds,
    }


def meta_batches(x, y, batch_size: int):
    """The meta-training elements `(x, y)` (task-major arrays) in batches of `batch_size`
    tasks, the last partial batch dropped: a `tf.data.Dataset` on TensorFlow; on other
    backends the same batches as a `keras.utils.PyDataset` of NumPy arrays."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    from tf_metaalign.data._numpy_route import NumpyBatches

    def batch(k):
        rows = slice(k * batch_size, (k + 1) * batch_size)
        return keras.tree.map_structure(lambda a: a[rows], x), y[rows]

    return NumpyBatches(batch, len(y) // batch_size)
