"""The few-shot program's runs (`python -m trainers.fewshot`): the Conv-4, one method's
training and evaluation (`run_method`), the widened 20-way evaluator, the sinusoid check."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers.fewshot_config import Config
    from trainers.fewshot_data import Data

#: Methods that take one episode per step (task batch 1).
ONE_EPISODE_METHODS = ("reptile", "dotprod")


def conv4(ways: int, filters: int):
    import keras

    inputs = keras.Input((28, 28, 1))
    x = inputs
    for _ in range(4):
        x = keras.layers.Conv2D(filters, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D(2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(ways)(x), name="conv4")


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def maml_options(method: str, config: Config, scale: float) -> dict:
    base = method[:-3] if method.endswith("_gs") else method
    options = dict(
        inner_steps=config.inner_steps,
        inner_learning_rate=config.inner_learning_rate * scale,
        evaluation_inner_steps=config.evaluation_inner_steps,
        gradient_sharing=True if method.endswith("_gs") else None,
    )
    if base == "fomaml":
        options["first_order"] = True
    elif base == "metasgd":
        options["learn_inner_learning_rates"] = "per_parameter"
    elif base == "mamlpp":
        options.update(
            learn_inner_learning_rates="per_layer_per_step",
            multi_step_loss=True,
            multi_step_loss_epochs=max(1, config.epochs // 2),
        )
    return options


def _widen(value, ways):
    """A head variable [..., n] -> [..., ways]: the mean over the n columns, repeated."""
    import numpy as np

    value = np.asarray(value)
    return np.repeat(value.mean(axis=-1, keepdims=True), ways, axis=-1)


def widened_trainer(trainer, ways: int, filters: int):
    """A MAMLTrainer on a `ways`-way copy of `trainer.model` (see the module doc)."""
    import keras

    from tf_metaalign.trainers.maml import MAMLTrainer

    model = trainer.model
    wide = conv4(ways, filters)
    n_head = 2  # the Dense kernel and bias: the last two weights
    for i, (w, v) in enumerate(zip(wide.weights, model.weights)):
        head = i >= len(model.weights) - n_head
        value = keras.ops.convert_to_numpy(v)
        w.assign(_widen(value, ways) if head else value)
    config = {
        k: v
        for k, v in trainer.get_config().items()
        if k
        in (
            "inner_steps",
            "inner_learning_rate",
            "first_order",
            "learn_inner_learning_rates",
            "gradient_sharing",
            "multi_step_loss",
            "multi_step_loss_epochs",
            "first_order_epochs",
            "evaluation_inner_steps",
            "transductive_evaluation",
        )
    }
    if config.get("gradient_sharing") is not None:
        from tf_metaalign.algorithms import GradientSharing

        config["gradient_sharing"] = GradientSharing.from_config(config["gradient_sharing"])
    out = MAMLTrainer(wide, **config)
    out.compile(optimizer="sgd", loss=_loss())
    n = len(model.trainable_variables)

    def copy(dst, src, index):
        value = keras.ops.convert_to_numpy(src)
        dst.assign(_widen(value, ways) if index >= n - n_head else value)

    if trainer.learn_inner_learning_rates == "per_parameter":
        for i, (d, s) in enumerate(
            zip(out.inner_learning_rate_variables, trainer.inner_learning_rate_variables)
        ):
            copy(d, s, i)
    elif trainer.learn_inner_learning_rates == "per_layer_per_step":
        out.inner_learning_rate_variables[0].assign(trainer.inner_learning_rate_variables[0])
    if trainer.gradient_sharing is not None:
        out.sharing_m.assign(trainer.sharing_m)
        out.sharing_lambda.assign(trainer.sharing_lambda)
        for k in range(trainer.inner_steps):
            for i, (d, s) in enumerate(
                zip(out.weights_copy(f"g_hat_{k}"), trainer.weights_copy(f"g_hat_{k}"))
            ):
                copy(d, s, i)
        out.g_hat_initialized.assign(trainer.g_hat_initialized)
    return out


class EpisodeScorer:
    """Adapts to one episode at a time with `trainer`'s evaluation inner loop and returns
    the query logits (one traced function per episode shape on TensorFlow)."""

    def __init__(self, trainer):
        import keras

        self.trainer = trainer
        model = trainer.model
        training = trainer.transductive_evaluation

        def logits(sx, sy, qx):
            weights = trainer.adapt(keras.ops.expand_dims(sx, 0), keras.ops.expand_dims(sy, 0))[0]
            state = [v.value for v in model.non_trainable_variables]
            return model.stateless_call(weights, state, qx, training=training)[0]

        from trainers.common import compiled

        self._logits = compiled(logits, reduce_retracing=True)

    def __call__(self, sx, sy, qx):
        import keras

        return keras.ops.convert_to_numpy(self._logits(sx, sy, qx))

    def accuracies(self, dataset):
        """Per-episode query accuracy over a dataset of 1-task batches (a tf.data.Dataset
        or the NumPy route's PyDataset)."""
        import numpy as np

        batches = dataset.as_numpy_iterator() if hasattr(dataset, "as_numpy_iterator") else dataset
        out = []
        for (sx, sy, qx), qy in batches:
            for t in range(sx.shape[0]):
                pred = self(sx[t], sy[t], qx[t]).argmax(-1)
                out.append(float(np.mean(pred == qy[t])))
        return out


def run_method(
    method: str, task_batch: int, scale: float, seed: int, data: Data, config: Config, log=print
) -> dict:
    """Train one configuration and evaluate it; returns its row of results."""
    import keras
    import numpy as np

    from tf_metaalign.data.episodes import EpisodeSampler, mean_confidence_interval
    from tf_metaalign.data.omniglot import evaluate_official_runs
    from tf_metaalign.trainers.dotprod import DotProdTrainer
    from tf_metaalign.trainers.maml import MAMLTrainer
    from tf_metaalign.trainers.reptile import ReptileTrainer
    from trainers import common
    from trainers.fewshot_data import (
        episode_batch_for_dotprod,
        episode_batch_for_reptile,
        map_batches,
        on_numpy_route,
    )
    from trainers.fewshot_report import first_epoch_of_best

    as_numpy = on_numpy_route()  # JAX: the samplers' NumPy batches (the same batches)

    name = f"{method} tb{task_batch} lr{scale:g}x s{seed}"
    keras.utils.set_random_seed(seed)
    model = conv4(config.ways, config.filters)
    alpha = config.inner_learning_rate * scale
    sampler = EpisodeSampler(
        data.train, config.ways, config.shots, config.queries, tasks_per_batch=task_batch, seed=seed
    )
    optimizer = keras.optimizers.Adam(config.outer_learning_rate)
    if method in ONE_EPISODE_METHODS:
        if method == "reptile":
            trainer = ReptileTrainer(model, inner_steps=config.inner_steps, inner_optimizer=alpha)
            train = map_batches(
                sampler.dataset(as_numpy=as_numpy),
                episode_batch_for_reptile(config.inner_steps, as_numpy),
            )
        else:
            trainer = DotProdTrainer(model, weight=config.dotprod_weight)
            train = map_batches(
                sampler.dataset(as_numpy=as_numpy),
                episode_batch_for_dotprod(config.ways, config.shots, config.queries, as_numpy),
            )
        trainer.compile(optimizer=optimizer, loss=_loss(), metrics=["accuracy"])
        evaluator = MAMLTrainer(
            model,
            inner_steps=config.inner_steps,
            inner_learning_rate=alpha,
            evaluation_inner_steps=config.evaluation_inner_steps,
        )
        evaluator.compile(optimizer="sgd", loss=_loss())
    else:
        trainer = MAMLTrainer(model, **maml_options(method, config, scale))
        trainer.compile(optimizer=optimizer, loss=_loss(), metrics=["accuracy"])
        train = sampler.dataset(as_numpy=as_numpy)
        evaluator = trainer
    scorer = EpisodeScorer(evaluator)
    val_sampler = EpisodeSampler(
        data.validation, config.ways, config.shots, config.queries, seed=1000
    )
    val_data = val_sampler.evaluation_dataset(
        config.validation_episodes, tasks_per_batch=1, as_numpy=as_numpy
    )
    curve, sharing = [], {"sharing_m": [], "sharing_lambda": []}

    class Validate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            acc = float(np.mean(scorer.accuracies(val_data)))
            curve.append(acc)
            for key in sharing:
                if key in logs:
                    sharing[key].append(float(logs[key]))
            extra = "".join(f"  {k} {sharing[k][-1]:.3f}" for k in sharing if sharing[k])
            log(
                f"{name}: epoch {epoch + 1}/{config.epochs}  loss {logs.get('loss', 0):.4f}"
                f"  val acc {acc:.3f}{extra}"
            )

    total = config.epochs * config.steps_per_epoch
    start = time.perf_counter()
    trainer.fit(
        train,
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        shuffle=False,  # an endless stream in order (Keras warns that a generator ignores it)
        verbose=0,
        callbacks=[
            common.ProgressCallback(log, name, total, config.log_every, ("loss",)),
            Validate(),
        ],
    )
    train_seconds = time.perf_counter() - start
    row = {
        "method": method,
        "task_batch": task_batch,
        "inner_lr_scale": scale,
        "inner_learning_rate": alpha,
        "seed": seed,
        "val_curve": curve,
        "best_val": max(curve),
        "best_epoch": first_epoch_of_best(curve),
        "train_seconds": train_seconds,
    }
    if sharing["sharing_m"]:
        row.update(sharing)
    test5 = EpisodeSampler(data.test, config.ways, config.shots, config.queries, seed=2000)
    acc5 = scorer.accuracies(
        test5.evaluation_dataset(config.test_episodes, tasks_per_batch=1, as_numpy=as_numpy)
    )
    row["test_5way"], row["test_5way_ci"] = mean_confidence_interval(acc5)
    wide = EpisodeScorer(widened_trainer(evaluator, 20, config.filters))
    test20 = EpisodeSampler(data.test, 20, config.shots, 1, seed=3000)
    acc20 = wide.accuracies(
        test20.evaluation_dataset(config.test_episodes, tasks_per_batch=1, as_numpy=as_numpy)
    )
    row["test_20way"], row["test_20way_ci"] = mean_confidence_interval(acc20)
    if data.runs:
        official = evaluate_official_runs(wide, data.runs)
        row["official"], row["official_ci"] = official.mean_accuracy, official.ci
    row["seconds"] = time.perf_counter() - start
    return row


# ------------------------------------------------------------------------------ sinusoid


def sinusoid_model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((1,))
    x = keras.layers.Dense(40, activation="relu")(inputs)
    x = keras.layers.Dense(40, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x), name="sinusoid_mlp")


def run_sinusoid(
    config: Config, seed: int, gradient_sharing: bool, log=print, steps: int | None = None
) -> dict:
    """MAML (+GS) with 1 inner step at 0.01 (Finn et al.) on 10-shot sinusoid tasks;
    returns the held-out waves' query MSE (50 points each) before adaptation and after
    1 and 10 inner steps, each the mean over waves +- its 95% t-interval."""
    import keras

    from tf_metaalign.data.episodes import mean_confidence_interval
    from tf_metaalign.data.sinusoid import SinusoidTasks
    from trainers.fewshot_data import on_numpy_route
    from tf_metaalign.trainers.maml import MAMLTrainer

    steps = steps or config.sinusoid_steps
    start = time.perf_counter()
    model = sinusoid_model(seed)
    trainer = MAMLTrainer(
        model,
        inner_steps=1,
        inner_learning_rate=0.01,
        gradient_sharing=True if gradient_sharing else None,
    )
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    tasks = SinusoidTasks(
        shots=10, queries=10, tasks_per_batch=config.sinusoid_tasks_per_batch, seed=seed
    )
    as_numpy = on_numpy_route()
    # The NumPy route's PyDataset: shuffle=False keeps its order (tf.data's never shuffles).
    trainer.fit(tasks.dataset(steps, as_numpy=as_numpy), epochs=1, verbose=0, shuffle=False)
    test = SinusoidTasks(
        shots=10, queries=50, tasks_per_batch=config.sinusoid_test_tasks, seed=10_000 + seed
    ).batch(0)
    (sx, sy, qx), qy = test
    out = {"method": "maml_gs" if gradient_sharing else "maml", "seed": seed, "steps": steps}
    pre_logits = keras.ops.convert_to_numpy(model(qx.reshape(-1, 1), training=False))
    pre = ((pre_logits.reshape(qy.shape) - qy) ** 2).mean(axis=(1, 2))
    out["mse_0"], out["mse_0_ci"] = mean_confidence_interval(pre)

    def predict(sx, sy, qx, n):
        weights = trainer.adapt(
            keras.ops.expand_dims(sx, 0), keras.ops.expand_dims(sy, 0), inner_steps=n
        )[0]
        return model.stateless_call(weights, [], qx)[0]

    from trainers.common import compiled

    predict = compiled(predict, reduce_retracing=True)
    for n in (1, 10):
        mse = [
            float(
                ((keras.ops.convert_to_numpy(predict(sx[t], sy[t], qx[t], n)) - qy[t]) ** 2).mean()
            )
            for t in range(len(sx))
        ]
        out[f"mse_{n}"], out[f"mse_{n}_ci"] = mean_confidence_interval(mse)
    out["seconds"] = time.perf_counter() - start
    log(
        f"sinusoid {out['method']} seed {seed}: query MSE unadapted {out['mse_0']:.3f}, "
        f"1 step {out['mse_1']:.3f}, 10 steps {out['mse_10']:.3f}  ({out['seconds']:.0f} s)"
    )
    return out
