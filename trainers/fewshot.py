r"""Few-shot Omniglot with MAML-family meta-learners, with and without gradient sharing
(Chang & Lipson), plus Reptile, FOMAML and DotProd, and a sinusoid sanity check.

    python -m trainers.fewshot                 # default: ~7 min on 2 shared CPU cores
    python -m trainers.fewshot --full          # the paper-like run (hours: see docs/fewshot.md)
    python -m trainers.fewshot --methods=maml,maml_gs,reptile --task_batch_sizes=5 --seeds=0,1

Data: the two small Omniglot background sets (242 characters after deduplication), split
by character into meta-train / validation / test classes (`--validation_classes`,
`--test_classes`); the meta-train characters get their 90/180/270 degree rotations as
extra classes (`--rotations`); the held-out characters are not rotated. Lake's official
20 runs (20-way 1-shot, evaluation alphabets, so no alphabet in common with training) are
scored too.

Model: Conv-4 = 4 x [Conv 3x3 (`--filters`), BatchNorm, ReLU, MaxPool 2] + Dense(ways) on
28x28x1 images. Transductive BatchNorm (batch statistics of the support / query set) in
training and evaluation, as the reference MAML.

Methods (`--methods`); every MAML-family method is a `MAMLTrainer` with K=`--inner_steps`
inner SGD steps at alpha = `--inner_learning_rate` x `--inner_learning_rate_scales`, outer
Adam(`--outer_learning_rate`):

  maml, maml_gs         second-order MAML; _gs: gradient_sharing=True
  metasgd, metasgd_gs   learn_inner_learning_rates="per_parameter" (Meta-SGD)
  mamlpp, mamlpp_gs     MAML++: "per_layer_per_step" (LSLR) + multi-step loss (annealed over
                        half the epochs); no per-step BatchNorm (not in MAMLTrainer)
  fomaml                MAMLTrainer(first_order=True) on the same task batches
  reptile               ReptileTrainer, one episode per step: each of its K inner batches is
                        the whole episode (support + query examples, N*(K_shot+Q) images),
                        outer Adam on the pseudo-gradient phi - theta_K
  dotprod               DotProdTrainer (weight `--dotprod_weight`), one episode per step as a
                        plain classification batch: b1 = the support set, b2 = the first
                        `shots` query examples of each class (so |b1| = |b2|)

The MAML-family methods (fomaml included) run at every `--task_batch_sizes`; reptile and
dotprod take one episode per step, so they run once per seed and rate (listed as task
batch 1).

Evaluation (the same for every method): each episode is adapted with the evaluation inner
loop of a MAMLTrainer (`--evaluation_inner_steps` SGD steps at alpha on the support set;
for MAML-family runs the trainer itself, i.e. its learned rates and gradient sharing with
the stored g_hat; for reptile / dotprod a plain MAMLTrainer wrapped around the trained
model), then scored on its query set. 20-way episodes (and the official runs) use a
20-way copy of the model: same body, the 5-way head's columns averaged and repeated 20
times (all classes start equal; the labels of an episode are a random permutation anyway),
learned inner rates / gradient-sharing state copied likewise.

Per run: validation accuracy after every epoch (`--steps_per_epoch` meta-batches) on a
fixed set of `--validation_episodes` 5-way episodes; the best one and the earliest epoch
reaching it; test accuracy on `--test_episodes` 5-way 1-shot and 20-way 1-shot episodes of
the test characters (mean +- 95% t-interval over episodes) and on the official runs (+- CI
over the 20 runs), at the FINAL weights; wall time. Per OG/GS pair: the paper's speed-up
(E_OG - E_GS) / E_GS with E the earliest epoch reaching the run's best validation
accuracy. Plots (PNG): validation accuracy per epoch, and sigmoid(m), sigmoid(lambda) per
epoch of the gradient-sharing runs. Sinusoid regression (Finn et al.): MAML vs MAML+GS,
query MSE of held-out waves before and after adaptation.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

METHODS = (
    "maml",
    "maml_gs",
    "metasgd",
    "metasgd_gs",
    "mamlpp",
    "mamlpp_gs",
    "fomaml",
    "reptile",
    "dotprod",
)
ONE_EPISODE_METHODS = ("reptile", "dotprod")  # one episode per step (task batch 1)
GS_PAIRS = (("maml", "maml_gs"), ("metasgd", "metasgd_gs"), ("mamlpp", "mamlpp_gs"))


@dataclasses.dataclass
class Config:
    """Everything a run depends on (the program's flags; tests build it directly)."""

    methods: tuple = ("maml", "maml_gs")
    task_batch_sizes: tuple = (5, 1)
    seeds: tuple = (0,)
    inner_learning_rate_scales: tuple = (1.0,)
    ways: int = 5
    shots: int = 1
    queries: int = 5
    inner_steps: int = 1
    inner_learning_rate: float = 0.1
    evaluation_inner_steps: int = 3
    outer_learning_rate: float = 1e-3
    filters: int = 16
    epochs: int = 10
    steps_per_epoch: int = 60
    validation_episodes: int = 40
    test_episodes: int = 100
    validation_classes: int = 24
    test_classes: int = 48
    rotations: bool = True
    official_runs: bool = True
    dotprod_weight: float = 0.1
    sinusoid: bool = True
    sinusoid_steps: int = 1500
    sinusoid_tasks_per_batch: int = 10
    sinusoid_test_tasks: int = 100
    log_every: int = 60

    def check(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(
                f"`methods`: unknown {unknown} (or none given); choose from {', '.join(METHODS)}."
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"`methods` lists a method twice: {list(self.methods)}.")
        if not self.seeds:
            raise ValueError("`seeds` is empty.")
        for name in ("task_batch_sizes", "seeds"):
            for v in getattr(self, name):
                if (
                    isinstance(v, bool)
                    or not isinstance(v, int)
                    or v < (1 if name == "task_batch_sizes" else 0)
                ):
                    raise ValueError(
                        f"`{name}` must hold integers >= "
                        f"{1 if name == 'task_batch_sizes' else 0}; got {v!r}."
                    )
        if not self.task_batch_sizes:
            raise ValueError("`task_batch_sizes` is empty.")
        if not self.inner_learning_rate_scales or any(
            not (isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0)
            for s in self.inner_learning_rate_scales
        ):
            raise ValueError(
                "`inner_learning_rate_scales` must be numbers > 0; got "
                f"{list(self.inner_learning_rate_scales)}."
            )
        for name in (
            "ways",
            "shots",
            "queries",
            "inner_steps",
            "evaluation_inner_steps",
            "filters",
            "epochs",
            "steps_per_epoch",
            "validation_episodes",
            "test_episodes",
            "sinusoid_steps",
            "sinusoid_tasks_per_batch",
            "sinusoid_test_tasks",
            "log_every",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        for name in ("inner_learning_rate", "outer_learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0; got {getattr(self, name)!r}.")
        if self.dotprod_weight < 0:
            raise ValueError(f"`dotprod_weight` must be >= 0; got {self.dotprod_weight!r}.")
        if self.validation_classes < self.ways:
            raise ValueError(
                f"`validation_classes`={self.validation_classes} is fewer than `ways`={self.ways}."
            )
        if self.test_classes < 20:
            raise ValueError(
                f"`test_classes`={self.test_classes}: 20-way test episodes need "
                "at least 20 test characters."
            )
        if self.validation_classes + self.test_classes > 242 - self.ways:
            raise ValueError(
                "`validation_classes` + `test_classes` leave fewer than `ways` "
                "of the 242 characters for meta-training."
            )
        if self.shots + self.queries > 20:
            raise ValueError(
                f"`shots` + `queries` = {self.shots + self.queries}: Omniglot "
                "has 20 drawings per character."
            )
        if "dotprod" in self.methods and self.queries < self.shots:
            raise ValueError(
                "dotprod needs `queries` >= `shots` (b2 = `shots` query examples per class)."
            )


FULL_RUN = {
    "methods": METHODS,
    "task_batch_sizes": (5, 1),
    "seeds": (0, 1, 2),
    "inner_learning_rate_scales": (1.0, 10.0),
    "inner_steps": 5,
    "inner_learning_rate": 0.1,
    "evaluation_inner_steps": 5,
    "filters": 64,
    "epochs": 40,
    "steps_per_epoch": 100,
    "validation_episodes": 200,
    "test_episodes": 600,
    "queries": 15,
    "sinusoid_steps": 5000,
    "sinusoid_tasks_per_batch": 25,
    "sinusoid_test_tasks": 600,
}


def define_flags():
    """The program's flags (only when it runs as a program: tests import its functions)."""
    c = Config()
    flags.DEFINE_list("methods", list(c.methods), f"Which methods ({', '.join(METHODS)}).")
    flags.DEFINE_list(
        "task_batch_sizes",
        [str(t) for t in c.task_batch_sizes],
        "Tasks per meta-batch (MAML family; reptile/dotprod take 1).",
    )
    flags.DEFINE_list("seeds", [str(s) for s in c.seeds], "Seeds (init, episodes).")
    flags.DEFINE_list(
        "inner_learning_rate_scales",
        [str(s) for s in c.inner_learning_rate_scales],
        "Multipliers of --inner_learning_rate (10: the paper's 10x run).",
    )
    flags.DEFINE_integer("ways", c.ways, "N of the training / validation episodes.")
    flags.DEFINE_integer("shots", c.shots, "K-shot of every episode.")
    flags.DEFINE_integer("queries", c.queries, "Query examples per class (5-way episodes).")
    flags.DEFINE_integer("inner_steps", c.inner_steps, "Inner SGD steps in meta-training.")
    flags.DEFINE_float("inner_learning_rate", c.inner_learning_rate, "Inner SGD rate alpha.")
    flags.DEFINE_integer(
        "evaluation_inner_steps",
        c.evaluation_inner_steps,
        "Inner SGD steps when evaluating (every method).",
    )
    flags.DEFINE_float("outer_learning_rate", c.outer_learning_rate, "Outer Adam's rate.")
    flags.DEFINE_integer("filters", c.filters, "Conv-4 filters per layer (64 in the paper).")
    flags.DEFINE_integer("epochs", c.epochs, "Epochs of meta-training.")
    flags.DEFINE_integer("steps_per_epoch", c.steps_per_epoch, "Meta-batches per epoch.")
    flags.DEFINE_integer(
        "validation_episodes",
        c.validation_episodes,
        "Fixed 5-way validation episodes, scored after every epoch.",
    )
    flags.DEFINE_integer(
        "test_episodes", c.test_episodes, "Test episodes (each of 5-way and 20-way)."
    )
    flags.DEFINE_integer("validation_classes", c.validation_classes, "Validation characters.")
    flags.DEFINE_integer("test_classes", c.test_classes, "Test characters.")
    flags.DEFINE_bool("rotations", c.rotations, "Rotations of meta-train characters as classes.")
    flags.DEFINE_bool("official_runs", c.official_runs, "Score Lake's 20 official runs.")
    flags.DEFINE_float("dotprod_weight", c.dotprod_weight, "DotProd's regulariser weight.")
    flags.DEFINE_bool("sinusoid", c.sinusoid, "Run the sinusoid sanity check.")
    flags.DEFINE_integer("sinusoid_steps", c.sinusoid_steps, "Sinusoid meta-batches.")
    flags.DEFINE_integer(
        "sinusoid_tasks_per_batch", c.sinusoid_tasks_per_batch, "Sinusoid tasks per meta-batch."
    )
    flags.DEFINE_integer("sinusoid_test_tasks", c.sinusoid_test_tasks, "Held-out sine waves.")
    flags.DEFINE_integer("log_every", c.log_every, "Steps between progress lines.")
    flags.DEFINE_bool(
        "full",
        False,
        "The full run (see docs/fewshot.md): every method, "
        "K=5 at 0.1 and the 10x run, 64 filters, 40 x 100 meta-batches, 3 "
        "seeds, 600 test episodes. Flags given explicitly still win.",
    )
    flags.DEFINE_string("output_dir", "/tmp/tf_metaalign_fewshot", "Where results go.")


FLAGS = flags.FLAGS


def config_from_flags() -> Config:
    def ints(name):
        try:
            return tuple(int(s) for s in getattr(FLAGS, name))
        except ValueError:
            raise ValueError(f"`{name}` must be integers; got {getattr(FLAGS, name)}.") from None

    try:
        scales = tuple(float(s) for s in FLAGS.inner_learning_rate_scales)
    except ValueError:
        raise ValueError(
            f"`inner_learning_rate_scales` must be numbers; got {FLAGS.inner_learning_rate_scales}."
        ) from None
    from trainers import common

    converted = dict(
        methods=tuple(FLAGS.methods),
        task_batch_sizes=ints("task_batch_sizes"),
        seeds=ints("seeds"),
        inner_learning_rate_scales=scales,
    )
    return common.config_from_flags(Config, FLAGS, converted, FULL_RUN if FLAGS.full else None)


# ------------------------------------------------------------------------------ helpers


def first_epoch_of_best(curve) -> int:
    """The earliest epoch (1-based) at which `curve` (validation accuracy per epoch)
    reaches its maximum."""
    values = [float(v) for v in curve]
    if not values:
        raise ValueError("`curve` is empty.")
    best = max(values)
    return values.index(best) + 1


def epochs_to_reach(curve, target) -> int | None:
    """The earliest epoch (1-based) at which `curve` reaches `target` (None: never)."""
    for i, v in enumerate(curve):
        if float(v) >= float(target):
            return i + 1
    return None


def speed_up(og_curve, gs_curve) -> float:
    """Chang & Lipson's speed-up (E_OG - E_GS) / E_GS, E = the earliest epoch reaching the
    run's best validation accuracy (`first_epoch_of_best`)."""
    e_og, e_gs = first_epoch_of_best(og_curve), first_epoch_of_best(gs_curve)
    return (e_og - e_gs) / e_gs


# ------------------------------------------------------------------------------ data


@dataclasses.dataclass
class Data:
    train: dict
    validation: dict
    test: dict
    runs: list | None


def prepare_data(config: Config, log=print) -> Data:
    from tf_metaalign.data import omniglot

    classes = omniglot.load_omniglot()
    split = omniglot.split_classes(
        classes, counts=(None, config.validation_classes, config.test_classes), seed=0
    )
    train = omniglot.augment_rotations(split.train) if config.rotations else split.train
    runs = omniglot.load_official_runs() if config.official_runs else None
    log(
        f"Omniglot: {len(classes)} characters -> meta-train {len(split.train)}"
        + (f" (x4 rotations = {len(train)} classes)" if config.rotations else "")
        + f", validation {len(split.validation)}, test {len(split.test)}"
        + (f"; official runs: {len(runs)}" if runs else "")
    )
    return Data(train, split.validation, split.test, runs)


# ------------------------------------------------------------------------------ models


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
    from tf_metaalign.trainers.maml import MAMLTrainer

    model = trainer.model
    wide = conv4(ways, filters)
    n_head = 2  # the Dense kernel and bias: the last two weights
    for i, (w, v) in enumerate(zip(wide.weights, model.weights)):
        head = i >= len(model.weights) - n_head
        w.assign(_widen(v.numpy(), ways) if head else v.numpy())
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
        dst.assign(_widen(src.numpy(), ways) if index >= n - n_head else src.numpy())

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
    the query logits (one traced function per episode shape)."""

    def __init__(self, trainer):
        import tensorflow as tf

        self.trainer = trainer
        model = trainer.model
        training = trainer.transductive_evaluation

        @tf.function(reduce_retracing=True)
        def logits(sx, sy, qx):
            weights = trainer.adapt(sx[tf.newaxis], sy[tf.newaxis])[0]
            state = [v.value for v in model.non_trainable_variables]
            return model.stateless_call(weights, state, qx, training=training)[0]

        self._logits = logits

    def __call__(self, sx, sy, qx):
        return self._logits(sx, sy, qx).numpy()

    def accuracies(self, dataset):
        """Per-episode query accuracy over a dataset of 1-task batches."""
        import numpy as np

        out = []
        for (sx, sy, qx), qy in dataset.as_numpy_iterator():
            for t in range(sx.shape[0]):
                pred = self(sx[t], sy[t], qx[t]).argmax(-1)
                out.append(float(np.mean(pred == qy[t])))
        return out


# ------------------------------------------------------------------------------ one run


def _episode_batch_for_reptile(k):
    import tensorflow as tf

    def fn(x, y):
        sx, sy, qx = x
        ex = tf.concat([sx[0], qx[0]], 0)
        ey = tf.concat([sy[0], y[0]], 0)
        return tf.stack([ex] * k), tf.stack([ey] * k)

    return fn


def _episode_batch_for_dotprod(ways, shots, queries):
    import tensorflow as tf

    def fn(x, y):
        sx, sy, qx = x
        q = tf.reshape(qx[0], [ways, queries, 28, 28, 1])[:, :shots]
        qy = tf.reshape(y[0], [ways, queries])[:, :shots]
        return (
            tf.concat([sx[0], tf.reshape(q, [ways * shots, 28, 28, 1])], 0),
            tf.concat([sy[0], tf.reshape(qy, [-1])], 0),
        )

    return fn


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
            train = sampler.dataset().map(_episode_batch_for_reptile(config.inner_steps))
        else:
            trainer = DotProdTrainer(model, weight=config.dotprod_weight)
            train = sampler.dataset().map(
                _episode_batch_for_dotprod(config.ways, config.shots, config.queries)
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
        train = sampler.dataset()
        evaluator = trainer
    scorer = EpisodeScorer(evaluator)
    val_sampler = EpisodeSampler(
        data.validation, config.ways, config.shots, config.queries, seed=1000
    )
    val_data = val_sampler.evaluation_dataset(config.validation_episodes, tasks_per_batch=1)
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
    acc5 = scorer.accuracies(test5.evaluation_dataset(config.test_episodes, tasks_per_batch=1))
    row["test_5way"], row["test_5way_ci"] = mean_confidence_interval(acc5)
    wide = EpisodeScorer(widened_trainer(evaluator, 20, config.filters))
    test20 = EpisodeSampler(data.test, 20, config.shots, 1, seed=3000)
    acc20 = wide.accuracies(test20.evaluation_dataset(config.test_episodes, tasks_per_batch=1))
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
    import tensorflow as tf

    from tf_metaalign.data.episodes import mean_confidence_interval
    from tf_metaalign.data.sinusoid import SinusoidTasks
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
    trainer.fit(tasks.dataset(steps), epochs=1, verbose=0)
    test = SinusoidTasks(
        shots=10, queries=50, tasks_per_batch=config.sinusoid_test_tasks, seed=10_000 + seed
    ).batch(0)
    (sx, sy, qx), qy = test
    out = {"method": "maml_gs" if gradient_sharing else "maml", "seed": seed, "steps": steps}
    pre = ((model(qx.reshape(-1, 1), training=False).numpy().reshape(qy.shape) - qy) ** 2).mean(
        axis=(1, 2)
    )
    out["mse_0"], out["mse_0_ci"] = mean_confidence_interval(pre)

    @tf.function(reduce_retracing=True)
    def predict(sx, sy, qx, n):
        weights = trainer.adapt(sx[tf.newaxis], sy[tf.newaxis], inner_steps=n)[0]
        return model.stateless_call(weights, [], qx)[0]

    for n in (1, 10):
        mse = [
            float(((predict(sx[t], sy[t], qx[t], n).numpy() - qy[t]) ** 2).mean())
            for t in range(len(sx))
        ]
        out[f"mse_{n}"], out[f"mse_{n}_ci"] = mean_confidence_interval(mse)
    out["seconds"] = time.perf_counter() - start
    log(
        f"sinusoid {out['method']} seed {seed}: query MSE unadapted {out['mse_0']:.3f}, "
        f"1 step {out['mse_1']:.3f}, 10 steps {out['mse_10']:.3f}  ({out['seconds']:.0f} s)"
    )
    return out


# ------------------------------------------------------------------------------ summary


def speed_ups(runs) -> list[dict]:
    """Per OG/GS pair run with the same task batch, rate scale and seed: the speed-up."""
    index = {(r["method"], r["task_batch"], r["inner_lr_scale"], r["seed"]): r for r in runs}
    out = []
    for og, gs in GS_PAIRS:
        for (m, tb, scale, seed), r in index.items():
            if m != og or (gs, tb, scale, seed) not in index:
                continue
            g = index[(gs, tb, scale, seed)]
            out.append(
                {
                    "pair": f"{og} vs {gs}",
                    "task_batch": tb,
                    "inner_lr_scale": scale,
                    "seed": seed,
                    "epoch_og": r["best_epoch"],
                    "epoch_gs": g["best_epoch"],
                    "speed_up": speed_up(r["val_curve"], g["val_curve"]),
                    "best_val_og": r["best_val"],
                    "best_val_gs": g["best_val"],
                }
            )
            # A variant for runs still improving at their last epoch (then E = the last
            # epoch for both): the epochs GS needs to reach OG's best validation accuracy.
            reach = epochs_to_reach(g["val_curve"], r["best_val"])
            out[-1]["epoch_gs_to_og_best"] = reach
            out[-1]["speed_up_to_og_best"] = (
                None if reach is None else (r["best_epoch"] - reach) / reach
            )
    return out


RUN_COLUMNS = (
    ("method", "method", "s"),
    ("task_batch", "tb", "d"),
    ("inner_learning_rate", "alpha", "g"),
    ("seed", "seed", "d"),
    ("best_val", "best val", ".3f"),
    ("best_epoch", "@ep", "d"),
    ("test_5way_str", "5-way 1-shot", "s"),
    ("test_20way_str", "20-way 1-shot", "s"),
    ("official_str", "official 20 runs", "s"),
    ("seconds", "time s", ".0f"),
)
SPEED_COLUMNS = (
    ("pair", "pair", "s"),
    ("task_batch", "tb", "d"),
    ("inner_lr_scale", "lr x", "g"),
    ("seed", "seed", "d"),
    ("epoch_og", "E_OG", "d"),
    ("epoch_gs", "E_GS", "d"),
    ("speed_up", "speed-up", "+.0%"),
    ("best_val_og", "best val OG", ".3f"),
    ("best_val_gs", "best val GS", ".3f"),
    ("epoch_gs_to_og_best", "E_GS(OG best)", "d"),
    ("speed_up_to_og_best", "speed-up(OG best)", "+.0%"),
)
SINE_COLUMNS = (
    ("method", "method", "s"),
    ("seed", "seed", "d"),
    ("steps", "meta-batches", "d"),
    ("mse_0_str", "MSE unadapted", "s"),
    ("mse_1_str", "MSE 1 step", "s"),
    ("mse_10_str", "MSE 10 steps", "s"),
    ("seconds", "time s", ".0f"),
)


def _pm(mean, ci, percent=True):
    if mean is None:
        return None
    if percent:
        return f"{100 * mean:.1f} ± {100 * ci:.1f}"
    return f"{mean:.3f} ± {ci:.3f}"


def table_rows(runs):
    rows = []
    for r in runs:
        row = dict(r)
        row["test_5way_str"] = _pm(r.get("test_5way"), r.get("test_5way_ci"))
        row["test_20way_str"] = _pm(r.get("test_20way"), r.get("test_20way_ci"))
        row["official_str"] = _pm(r.get("official"), r.get("official_ci"))
        rows.append(row)
    return rows


def sine_rows(sine):
    rows = []
    for r in sine:
        row = dict(r)
        for n in (0, 1, 10):
            row[f"mse_{n}_str"] = _pm(r[f"mse_{n}"], r[f"mse_{n}_ci"], percent=False)
        rows.append(row)
    return rows


def plot(runs, out) -> list:
    """val_accuracy.png and sharing.png (GS runs) in `out`; returns the paths written."""
    from trainers.common import figure

    paths = []
    groups = sorted({(r["task_batch"], r["inner_lr_scale"]) for r in runs})
    fig = figure(figsize=(5 * len(groups), 4))
    axes = fig.subplots(1, len(groups), squeeze=False)
    for ax, (tb, scale) in zip(axes[0], groups):
        for r in runs:
            if (r["task_batch"], r["inner_lr_scale"]) == (tb, scale):
                ax.plot(
                    range(1, len(r["val_curve"]) + 1),
                    r["val_curve"],
                    marker="o",
                    label=f"{r['method']} s{r['seed']}",
                )
        ax.set_title(f"task batch {tb}, inner lr x{scale:g}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("5-way 1-shot validation accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "val_accuracy.png")
    fig.savefig(paths[-1], dpi=100)
    gs_runs = [r for r in runs if r.get("sharing_m")]
    if gs_runs:
        fig = figure(figsize=(10, 4))
        axes = fig.subplots(1, 2)
        for ax, key, label in zip(
            axes, ("sharing_m", "sharing_lambda"), ("sigmoid(m)", "sigmoid(lambda)")
        ):
            for r in gs_runs:
                ax.plot(
                    range(1, len(r[key]) + 1),
                    r[key],
                    marker="o",
                    label=f"{r['method']} tb{r['task_batch']} x{r['inner_lr_scale']:g} "
                    f"s{r['seed']}",
                )
            ax.set_xlabel("epoch")
            ax.set_ylabel(f"mean {label}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "sharing.png")
        fig.savefig(paths[-1], dpi=100)
    return paths


def main(argv):
    del argv
    from trainers import common

    try:
        config = config_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e))
    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    start = time.perf_counter()
    sine = []
    if config.sinusoid:
        for seed in config.seeds:
            for gs in (False, True):
                sine.append(run_sinusoid(config, seed, gs, log))
    data = prepare_data(config, log)
    plan = []
    for seed in config.seeds:
        for scale in config.inner_learning_rate_scales:
            for tb in config.task_batch_sizes:
                for method in config.methods:
                    if method in ONE_EPISODE_METHODS and tb != config.task_batch_sizes[-1]:
                        continue
                    plan.append((method, 1 if method in ONE_EPISODE_METHODS else tb, scale, seed))
    runs = []
    for i, (method, tb, scale, seed) in enumerate(plan):
        log(f"run {i + 1}/{len(plan)}: {method}, task batch {tb}, inner lr x{scale:g}, seed {seed}")
        runs.append(run_method(method, tb, scale, seed, data, config, log))
        r = runs[-1]
        log(
            f"{method} tb{tb}: best val {r['best_val']:.3f} (epoch {r['best_epoch']}), "
            f"test 5-way {_pm(r['test_5way'], r['test_5way_ci'])}, 20-way "
            f"{_pm(r['test_20way'], r['test_20way_ci'])}"
            + (f", official {_pm(r['official'], r['official_ci'])}" if "official" in r else "")
            + f"  ({r['seconds']:.0f} s)"
        )
    speed = speed_ups(runs)
    paths = plot(runs, out)
    print()
    print(
        "Omniglot, accuracy in % ± 95% t-interval (test: over episodes; official: over "
        "Lake's 20 runs), at the final weights:"
    )
    print(common.format_table(table_rows(runs), RUN_COLUMNS))
    if speed:
        print(
            "\nSpeed-up (E_OG - E_GS) / E_GS, E = earliest epoch reaching the run's best "
            "validation accuracy:"
        )
        print(common.format_table(speed, SPEED_COLUMNS))
    if sine:
        print("\nSinusoid regression (K=10), query MSE of held-out waves ± 95% t-interval:")
        print(common.format_table(sine_rows(sine), SINE_COLUMNS))
    total = time.perf_counter() - start
    common.write_json(
        out / "results.json",
        {
            "config": dataclasses.asdict(config),
            "runs": runs,
            "speed_ups": speed,
            "sinusoid": sine,
            "plots": [p.name for p in paths],
            "seconds": total,
        },
    )
    log(f"results.json and {', '.join(p.name for p in paths)} in {out} ({total:.0f} s)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
