r"""Multilingual multi-task fine-tuning of a pretrained encoder: Sequential Reptile, the
baselines it is measured against (Lee et al., ICLR 2022, Tables 2-4) and the multi-task
method zoo, on real data offline.

    python -m trainers.multitask                       # ~15 min on 2 quiet cores: 8 methods x 3
    seeds
    python -m trainers.multitask --methods=mtl,sequential_reptile --seeds=0
    python -m trainers.multitask --methods=zoo --seeds=0 --steps=40   # every registry method
    python -m trainers.multitask --methods=mtl,cagrad,nash_mtl \
        --method_options=cagrad.calpha=0.4,nash_mtl.optim_niter=10
    python -m trainers.multitask --full                # whole encoder, 5 seeds, 4x the steps

Data (`trainers.experiments.django_catalogs`): Django's gettext catalogs, one task per
language: a translated UI string -> the part of Django it belongs to (8 classes). The
training languages are imbalanced (de/fr/es/pl ~520 training strings, lb 117); the
zero-shot languages are never trained on (the paper's Table 3). The held-out strings are
the same English messages in every language (split by msgid), so no score comes from
having seen a message's translation in another language.

Model: the pretrained all-MiniLM-L6-v2 encoder (`trainers.experiments.text_encoder`), masked
mean pooling, dropout and a new linear head. By default only its top
`--trainable_layers=1` transformer layer is fine-tuned (with the head): the frozen layers'
outputs are computed once and cached, which is what makes 24 runs fit in minutes on 2
cores. `--trainable_layers=6` (`--full`) fine-tunes the whole encoder, embeddings
included.

Methods (every run of a seed starts from the same weights, the same head initialisation,
and sees the same number of examples, `--steps * num_tasks * --per_task_batch_size`):

  single_task         one model per language, each on `--steps` batches of
                      `--per_task_batch_size` of its own language (the examples of that
                      language MTL sees)
  mtl                 MultiTaskTrainer("sum"): every step a mixed batch with
                      `--per_task_batch_size` examples of every language
  <registry name>     MultiTaskTrainer(method=<name>) on the same mixed batches: every
                      method of `tf_metaalign.algorithms.multitask` (`method_names()`:
                      sum, rlw, uw, dwa, famo, gradnorm, pcgrad, gradvac, mgda, cagrad,
                      imtl, nash_mtl, aligned_mtl); the default run has pcgrad, gradvac
                      and gradnorm; `--methods=zoo` runs all of them ("sum" as "mtl").
                      Their hyperparameters: `--method_options=<method>.<argument>=<value>`
                      (the class's constructor arguments; `trainers.multitask_methods`)
  recadam             "sum" with RecAdam instead of Adam (pull toward the pretrained weights,
                      sigmoid annealing k = `--recadam_k`, t0 = steps / 4; the new head is
                      excluded from the pull, as the reference's new-weights group)
  reptile             MultiTaskReptileTrainer: per outer step one `--reptile_inner_steps`-step
                      Adam trajectory per language from the same phi, averaged; outer SGD
                      with rate `--outer_learning_rate`
  sequential_reptile  SequentialReptileTrainer: single-language batches of the mixed batch's
                      size, language t drawn with p_t ∝ N_t^q (`--q`, 0.2 as in the paper),
                      Adam inner steps, every `--inner_steps` steps
                      phi <- phi + `--outer_learning_rate` (theta - phi)

The model has ONE classification head shared by every language (the paper's setting: one
multilingual model, and the zero-shot languages need the head too), so every variable is
shared and the surgery / weighting acts on all of them (MultiTaskTrainer finds no
`PerTaskHead`; a model with per-task heads would have them treated as task-specific).

Measured per run: accuracy on each training language's held-out strings and their average;
zero-shot accuracy on each unseen language; the mean pairwise cosine of the training
languages' gradients at the final weights (`callbacks.MultiTaskDiagnostics.measure`, on a
fixed batch of `--probe_examples` training strings per language, no dropout); the L2
distance of the encoder's trainable weights from the pretrained ones (the head is new and
left out). The table gives each quantity's mean over seeds with a 95% t-interval, and
`results.json` every run's values; progress lines are printed while it runs.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from trainers import multitask_methods as MM  # noqa: E402

#: The default run: the paper's baselines (Lee et al. Tables 2-4).
METHODS = (
    "single_task",
    "mtl",
    "pcgrad",
    "gradvac",
    "gradnorm",
    "recadam",
    "reptile",
    "sequential_reptile",
)
#: The program's own methods (not in the multi-task registry). Every registry method is
#: accepted too (`MM.known(PROGRAM_METHODS, ALIASES)`), and "zoo" for all of them.
PROGRAM_METHODS = ("single_task", "recadam", "reptile", "sequential_reptile")
#: Program names of registry methods: "mtl" runs the registry's "sum" (equal weighting).
ALIASES = {"mtl": "sum"}
TRAIN_LANGUAGES = ("de", "fr", "es", "pl", "ro", "hr", "cy", "lb")
ZERO_SHOT_LANGUAGES = ("it", "nl", "sw")


@dataclasses.dataclass
class Config:
    """Everything a run depends on (the program's flags; tests build it directly)."""

    methods: tuple = METHODS
    #: {method: {constructor argument: value}} for the registry methods run.
    method_options: dict = dataclasses.field(default_factory=dict)
    train_languages: tuple = TRAIN_LANGUAGES
    zero_shot_languages: tuple = ZERO_SHOT_LANGUAGES
    seeds: tuple = (0, 1, 2)
    steps: int = 120
    per_task_batch_size: int = 4
    learning_rate: float = 1e-3
    trainable_layers: int = 1
    sequence_length: int = 16
    q: float = 0.2
    inner_steps: int = 10
    reptile_inner_steps: int = 5
    reptile_tasks: int = 4
    outer_learning_rate: float = 0.5
    recadam_k: float = 0.1
    recadam_pretrain_cof: float = 100.0
    probe_examples: int = 32
    test_fraction: float = 0.25
    split_seed: int = 0
    log_every: int = 20

    def __post_init__(self):
        if isinstance(self.methods, str):
            self.methods = tuple(self.methods.split(","))
        self.methods = MM.expand(self.methods, ALIASES)  # "zoo" -> every registry method
        self.method_options = MM.parse_method_options(self.method_options)

    def check(self):
        MM.check_methods(self.methods, PROGRAM_METHODS, ALIASES)
        MM.check_method_options(self.method_options, self.methods, ALIASES)
        if len(self.train_languages) < 2:
            raise ValueError(
                "`train_languages` needs at least two languages (tasks); got "
                f"{list(self.train_languages)}."
            )
        overlap = set(self.train_languages) & set(self.zero_shot_languages)
        if overlap:
            raise ValueError(
                f"`zero_shot_languages` must not be trained on; both lists have {sorted(overlap)}."
            )
        if not self.seeds:
            raise ValueError("`seeds` is empty.")
        for name in (
            "steps",
            "per_task_batch_size",
            "trainable_layers",
            "inner_steps",
            "reptile_inner_steps",
            "reptile_tasks",
            "probe_examples",
            "log_every",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        if self.reptile_tasks > len(self.train_languages):
            raise ValueError(
                f"`reptile_tasks`={self.reptile_tasks} is more than the "
                f"{len(self.train_languages)} training languages."
            )
        if (self.steps * len(self.train_languages)) % (
            self.reptile_tasks * self.reptile_inner_steps
        ):
            raise ValueError(
                f"`steps` x languages = {self.steps * len(self.train_languages)} must be a "
                f"multiple of `reptile_tasks` x `reptile_inner_steps` = "
                f"{self.reptile_tasks * self.reptile_inner_steps} (Reptile sees the same "
                "examples as MTL)."
            )
        for name in ("learning_rate", "outer_learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0; got {getattr(self, name)!r}.")


def define_flags():
    """The program's flags (only when it runs as a program: tests import its functions)."""
    c = Config()
    flags.DEFINE_list(
        "methods",
        list(c.methods),
        f"Which methods: {', '.join(MM.known(PROGRAM_METHODS, ALIASES))}; "
        f"'{MM.ZOO}' = every method of the multi-task registry.",
    )
    flags.DEFINE_list(
        "method_options",
        [],
        "Registry methods' hyperparameters, <method>.<argument>=<value>, e.g. "
        "cagrad.calpha=0.4,nash_mtl.optim_niter=10 (the arguments of the "
        "method's class, tf_metaalign.algorithms.multitask).",
    )
    flags.DEFINE_list("train_languages", list(c.train_languages), "Training languages (tasks).")
    flags.DEFINE_list(
        "zero_shot_languages", list(c.zero_shot_languages), "Unseen languages, evaluated zero-shot."
    )
    flags.DEFINE_list("seeds", [str(s) for s in c.seeds], "Seeds (initial head, data order).")
    flags.DEFINE_integer(
        "steps",
        c.steps,
        "MTL steps; every method sees steps x tasks x per_task_batch_size examples.",
    )
    flags.DEFINE_integer(
        "per_task_batch_size",
        c.per_task_batch_size,
        "Examples per task in a mixed batch (Sequential Reptile's single-task "
        "batches have tasks x this many).",
    )
    flags.DEFINE_float(
        "learning_rate", c.learning_rate, "Adam's rate (the inner rate of the Reptiles)."
    )
    flags.DEFINE_integer(
        "trainable_layers",
        c.trainable_layers,
        "Top transformer layers fine-tuned (6: the whole encoder).",
    )
    flags.DEFINE_integer("sequence_length", c.sequence_length, "Tokens per string.")
    flags.DEFINE_float("q", c.q, "Sequential Reptile's task sampling p_t ∝ N_t^q.")
    flags.DEFINE_integer("inner_steps", c.inner_steps, "Sequential Reptile's K.")
    flags.DEFINE_integer("reptile_inner_steps", c.reptile_inner_steps, "Reptile's k per task.")
    flags.DEFINE_integer(
        "reptile_tasks", c.reptile_tasks, "Reptile's tasks per outer step (drawn with p_t ∝ N_t^q)."
    )
    flags.DEFINE_float("outer_learning_rate", c.outer_learning_rate, "eta of both Reptiles.")
    flags.DEFINE_float("recadam_k", c.recadam_k, "RecAdam's annealing slope k.")
    flags.DEFINE_float("recadam_pretrain_cof", c.recadam_pretrain_cof, "RecAdam's gamma.")
    flags.DEFINE_integer(
        "probe_examples", c.probe_examples, "Training strings per language for the gradient cosine."
    )
    flags.DEFINE_integer("log_every", c.log_every, "Steps between progress lines.")
    flags.DEFINE_bool(
        "full",
        False,
        "The full run: the whole encoder (trainable_layers=6), "
        "sequence_length 32, 4x the steps, seeds 0-4, 12 training languages.",
    )
    flags.DEFINE_string("output_dir", "/tmp/tf_metaalign_multitask", "Where results go.")


FLAGS = flags.FLAGS

FULL_RUN = {
    "trainable_layers": 6,
    "sequence_length": 32,
    "steps": 480,
    "seeds": (0, 1, 2, 3, 4),
    "learning_rate": 1e-4,
    "train_languages": TRAIN_LANGUAGES + ("pt", "sv", "tr", "ast"),
}


def config_from_flags() -> Config:
    from trainers import common

    converted = dict(
        methods=tuple(FLAGS.methods),
        method_options=MM.parse_method_options(FLAGS.method_options),
        train_languages=tuple(FLAGS.train_languages),
        zero_shot_languages=tuple(FLAGS.zero_shot_languages),
        seeds=tuple(int(s) for s in FLAGS.seeds),
    )
    return common.config_from_flags(Config, FLAGS, converted, FULL_RUN if FLAGS.full else None)


# ------------------------------------------------------------------------------ data


@dataclasses.dataclass
class Data:
    """Model inputs per language and split: `train[lang] = (x, y)`, x a dict of arrays."""

    class_names: tuple
    train: dict
    test: dict
    zero_shot: dict
    encoder: object  # the pretrained backbone
    cached_layers: int  # frozen transformer layers whose outputs x holds (0: token ids)


def prepare_data(config: Config, log=print) -> Data:
    """Load the catalogs, tokenize, and (trainable_layers < 6) run the frozen layers once."""
    import keras
    import numpy as np

    from trainers.experiments import django_catalogs as D
    from trainers.experiments import text_encoder as TE

    languages = tuple(config.train_languages) + tuple(config.zero_shot_languages)
    log(f"loading Django catalogs for {len(languages)} languages")
    tasks = D.component_tasks(languages, test_fraction=config.test_fraction, seed=config.split_seed)
    log("loading the MiniLM encoder and tokenizer")
    tokenizer, backbone = TE.load_minilm_tokenizer(), TE.load_minilm_backbone()
    num_layers = len(backbone.transformer_layers)
    if config.trainable_layers > num_layers:
        raise ValueError(
            f"`trainable_layers`={config.trainable_layers}: the encoder has {num_layers} layers."
        )
    cached = num_layers - config.trainable_layers
    if cached:
        cut = backbone.get_layer(f"transformer_layer_{cached - 1}").output
        frozen = keras.Model(backbone.inputs, cut)

    def inputs(texts):
        tokens = TE.tokenize(texts, tokenizer, sequence_length=config.sequence_length)
        if not cached:
            return tokens
        hidden = frozen.predict(tokens, batch_size=128, verbose=0)
        return {"hidden": hidden.astype(np.float32), "padding_mask": tokens["padding_mask"]}

    start = time.perf_counter()
    train, test, zero_shot = {}, {}, {}
    for lang in config.train_languages:
        train[lang] = (inputs(tasks.train[lang][0]), tasks.train[lang][1])
        test[lang] = (inputs(tasks.test[lang][0]), tasks.test[lang][1])
    for lang in config.zero_shot_languages:
        zero_shot[lang] = (inputs(tasks.test[lang][0]), tasks.test[lang][1])
    sizes = ", ".join(f"{lang} {len(y)}" for lang, (_, y) in train.items())
    log(
        f"{'encoded' if cached else 'tokenized'} {sum(len(y) for _, y in train.values())} "
        f"training strings ({sizes}) in {time.perf_counter() - start:.0f} s"
        + (f" (the frozen {cached} layers run once)" if cached else "")
    )
    return Data(tasks.class_names, train, test, zero_shot, backbone, cached)


def build_model(data: Data, seed: int):
    """(model, encoder weights): the fine-tuned part of the encoder at its pretrained
    values, masked mean pooling, dropout 0.1 and a new head initialised with `seed`."""
    import keras
    import keras_hub

    from trainers.experiments import text_encoder as TE

    num_classes = len(data.class_names)
    if not data.cached_layers:
        backbone = type(data.encoder).from_config(data.encoder.get_config())
        backbone.set_weights(data.encoder.get_weights())
        length = data.train[next(iter(data.train))][0]["token_ids"].shape[1]
        model = TE.build_text_classifier(
            num_classes, backbone=backbone, sequence_length=length, seed=seed
        )
        return model, backbone.trainable_weights
    example = data.train[next(iter(data.train))][0]["hidden"]
    length, width = example.shape[1:]
    hidden = keras.Input((length, width), name="hidden")
    mask = keras.Input((length,), dtype="bool", name="padding_mask")
    x, encoder_weights = hidden, []
    for pretrained in data.encoder.transformer_layers[data.cached_layers :]:
        layer = keras_hub.layers.TransformerEncoder.from_config(pretrained.get_config())
        x = layer(x, padding_mask=mask)
        layer.set_weights(pretrained.get_weights())
        encoder_weights += layer.trainable_weights
    weights = keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1)
    pooled = keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(
        keras.ops.sum(weights, axis=1), 1.0
    )
    pooled = keras.layers.Dropout(0.1, seed=seed)(pooled)
    logits = keras.layers.Dense(
        num_classes,
        name="head",
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02, seed=seed),
    )(pooled)
    return keras.Model({"hidden": hidden, "padding_mask": mask}, logits), encoder_weights


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def accuracy(model, split) -> dict:
    """Accuracy of `model` on each language of `split` (lang -> (x, y))."""
    import numpy as np

    out = {}
    for lang, (x, y) in split.items():
        # Eager calls: `predict` would retrace for every language's number of strings.
        logits = np.concatenate(
            [
                np.asarray(model({k: v[i : i + 256] for k, v in x.items()}, training=False))
                for i in range(0, len(y), 256)
            ]
        )
        out[lang] = float(np.mean(np.argmax(logits, -1) == y))
    return out


def _probe_batches(data: Data, config: Config):
    """A fixed batch of `probe_examples` training strings per language (the first ones of
    a fixed permutation), for the gradient cosine."""
    import numpy as np

    batches = {}
    for lang, (x, y) in data.train.items():
        rows = np.random.default_rng(1234).permutation(len(y))[: config.probe_examples]
        batches[lang] = ({k: v[rows] for k, v in x.items()}, y[rows])
    return batches


# ------------------------------------------------------------------------------ runs


def run_method(method: str, data: Data, seed: int, config: Config, log=print) -> dict:
    """Train `method` from the pretrained weights (seed `seed`); its measured values."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_metaalign import optimizers as O
    from tf_metaalign.callbacks import MultiTaskDiagnostics
    from tf_metaalign.data.multitask import MultiTaskStream
    from tf_metaalign.trainers import (
        MultiTaskReptileTrainer,
        MultiTaskTrainer,
        SequentialReptileTrainer,
    )
    from trainers import common

    MM.check_methods((method,), PROGRAM_METHODS, ALIASES, flag="method")
    languages = list(data.train)
    num_tasks, b = len(languages), config.per_task_batch_size
    start = time.perf_counter()
    name = f"{method} seed {seed}"

    def fresh():
        keras.utils.set_random_seed(seed)
        model, encoder = build_model(data, seed)
        return model, encoder, [w.numpy() for w in encoder]

    def distance(encoder, pretrained):
        return float(
            np.sqrt(sum(np.sum((w.numpy() - p) ** 2) for w, p in zip(encoder, pretrained)))
        )

    if method == "single_task":
        scores, distances = {}, []
        for index, lang in enumerate(languages):
            model, encoder, pretrained = fresh()
            model.compile(optimizer=O.Adam(config.learning_rate), loss=_loss())
            stream = MultiTaskStream(
                {lang: data.train[lang]}, batch_size=b, seed=seed * 1000 + index
            )
            batches = (
                stream.single_task_batches().map(lambda x, y: (x["inputs"], y)).take(config.steps)
            )
            model.fit(batches, verbose=0, shuffle=False)
            scores[lang] = accuracy(model, {lang: data.test[lang]})[lang]
            distances.append(distance(encoder, pretrained))
            log(f"{name}: {lang} ({index + 1}/{num_tasks}) held-out accuracy {scores[lang]:.3f}")
        return {
            "method": method,
            "seed": seed,
            "task_accuracy": scores,
            "average_accuracy": float(np.mean(list(scores.values()))),
            "zero_shot_accuracy": {},
            "zero_shot_average": None,
            "task_cosine": None,
            "distance_from_pretrained": float(np.mean(distances)),
            "seconds": time.perf_counter() - start,
        }

    model, encoder, pretrained = fresh()
    stream = MultiTaskStream(data.train, batch_size=num_tasks * b, q=config.q, seed=seed)
    method_config = None
    if method == "recadam" or MM.registry_name(method, ALIASES):
        # Every registry method with its options; RecAdam is "sum" with another optimizer.
        mtl_method = (
            MM.build("mtl", {}, ALIASES)
            if method == "recadam"
            else MM.build(method, config.method_options, ALIASES)
        )
        method_config = {"name": mtl_method.name, "config": mtl_method.get_config()}
        # One shared head: no task-specific variables (see the module doc).
        trainer = MultiTaskTrainer(
            model, num_tasks=num_tasks, method=mtl_method, seed=seed, measure_task_cosine=True
        )
        optimizer = (
            O.RecAdam(
                config.learning_rate,
                anneal_k=config.recadam_k,
                anneal_t0=config.steps // 4,
                pretrain_cof=config.recadam_pretrain_cof,
                exclude_from_recall=["head"],
            )
            if method == "recadam"
            else O.Adam(config.learning_rate)
        )
        batches = stream.mixed_batches(per_task_batch_size=b).take(config.steps)
        steps = config.steps
    elif method == "reptile":
        k, tasks = config.reptile_inner_steps, config.reptile_tasks
        trainer = MultiTaskReptileTrainer(
            model, inner_steps=k, inner_optimizer=O.Adam(config.learning_rate)
        )
        optimizer = O.SGD(config.outer_learning_rate)

        def stack(x, y):  # task-major [tasks * k * b] -> [tasks, k, b, ...]
            def fold(t):
                return tf.reshape(t, [tasks, k, b] + t.shape[1:].as_list())

            return tf.nest.map_structure(fold, x), fold(y)

        # The inner loops are unrolled when traced (tasks x k steps): tracing time grows
        # with their product, hence a subset of tasks per outer step.
        steps = config.steps * num_tasks // (tasks * k)
        batches = (
            stream.mixed_batches(tasks_per_batch=tasks, per_task_batch_size=k * b)
            .map(stack)
            .take(steps)
        )
    else:  # sequential_reptile
        trainer = SequentialReptileTrainer(
            model, inner_steps=config.inner_steps, outer_learning_rate=config.outer_learning_rate
        )
        optimizer = O.Adam(config.learning_rate)
        batches = stream.single_task_batches().take(config.steps)
        steps = config.steps
    trainer.compile(optimizer=optimizer, loss=_loss())
    progress = common.ProgressCallback(
        log, name, steps, max(1, config.log_every * steps // config.steps)
    )
    trainer.fit(batches, verbose=0, shuffle=False, callbacks=[progress])
    diagnostics = MultiTaskDiagnostics(_probe_batches(data, config))
    diagnostics.set_model(trainer)
    cosine = diagnostics.measure()["task_gradient_cosine"]
    scores = accuracy(model, data.test)
    zero_shot = accuracy(model, data.zero_shot)
    return {
        "method": method,
        "seed": seed,
        "task_accuracy": scores,
        "average_accuracy": float(np.mean(list(scores.values()))),
        "zero_shot_accuracy": zero_shot,
        "zero_shot_average": float(np.mean(list(zero_shot.values()))) if zero_shot else None,
        "task_cosine": cosine,
        "distance_from_pretrained": distance(encoder, pretrained),
        "method_config": method_config,
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------- summary

SUMMARY_COLUMNS = (
    ("method", "method", "s"),
    ("average_accuracy", "avg held-out acc", "s"),
    ("zero_shot_average", "zero-shot acc", "s"),
    ("task_cosine", "task grad cos", "s"),
    ("distance_from_pretrained", "L2 from pretrained", "s"),
    ("seconds", "s/run", ".0f"),
)


def summarise(runs, methods) -> list[dict]:
    """One row per method: `mean ± half-width` (95% t-interval over seeds) per quantity."""
    import numpy as np

    from tf_metaalign.data.episodes import mean_confidence_interval

    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        row = {
            "method": method,
            "seeds": len(mine),
            "seconds": float(np.mean([r["seconds"] for r in mine])),
        }
        for key, fmt in (
            ("average_accuracy", ".3f"),
            ("zero_shot_average", ".3f"),
            ("task_cosine", ".3f"),
            ("distance_from_pretrained", ".2f"),
        ):
            values = [r[key] for r in mine if r[key] is not None]
            if not values:
                continue
            mean, half = mean_confidence_interval(values)
            row[key] = f"{mean:{fmt}} ± {half:{fmt}}" if len(values) > 1 else f"{mean:{fmt}}"
            row[key + "_mean"], row[key + "_ci95"] = mean, half
        languages = list(mine[0]["task_accuracy"]) + list(mine[0]["zero_shot_accuracy"])
        row["per_language"] = {
            lang: float(
                np.mean(
                    [r["task_accuracy"].get(lang, r["zero_shot_accuracy"].get(lang)) for r in mine]
                )
            )
            for lang in languages
        }
        rows.append(row)
    return rows


def per_language_table(rows, data: Data) -> str:
    from trainers import common

    languages = list(data.train) + list(data.zero_shot)
    columns = [("method", "method", "s")] + [
        (lang, lang + ("*" if lang in data.zero_shot else ""), ".3f") for lang in languages
    ]
    return common.format_table(
        [{"method": r["method"], **r["per_language"]} for r in rows], columns
    )


def majority_accuracy(data: Data) -> dict:
    """Accuracy of always answering the training set's most frequent class, per language."""
    import numpy as np

    counts = np.bincount(
        np.concatenate([y for _, y in data.train.values()]), minlength=len(data.class_names)
    )
    top = int(np.argmax(counts))
    return {
        lang: float(np.mean(y == top)) for lang, (_, y) in {**data.test, **data.zero_shot}.items()
    }


def main(argv):
    del argv
    from trainers import common

    try:
        config = config_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e))
    out = common.prepare_output_dir(FLAGS.output_dir)
    log = common.Progress()
    data = prepare_data(config, log)
    runs = []
    total = len(config.seeds) * len(config.methods)
    for seed in config.seeds:
        for method in config.methods:
            log(f"run {len(runs) + 1}/{total}: {method}, seed {seed}")
            runs.append(run_method(method, data, seed, config, log))
            r = runs[-1]
            log(
                f"{method} seed {seed}: held-out {r['average_accuracy']:.3f}"
                + (
                    f"  zero-shot {r['zero_shot_average']:.3f}"
                    if r["zero_shot_average"] is not None
                    else ""
                )
                + (f"  task cos {r['task_cosine']:.3f}" if r["task_cosine"] is not None else "")
                + f"  L2 {r['distance_from_pretrained']:.2f}  ({r['seconds']:.0f} s)"
            )
    rows = summarise(runs, config.methods)
    majority = majority_accuracy(data)
    print()
    print(
        f"Mean over seeds {list(config.seeds)} ± 95% t-interval; held-out = the training "
        f"languages' held-out strings; zero-shot = unseen languages "
        f"({', '.join(config.zero_shot_languages)})."
    )
    print(common.format_table(rows, SUMMARY_COLUMNS))
    print()
    print("Accuracy per language (mean over seeds; * = zero-shot):")
    print(per_language_table(rows, data))
    print(
        f"\nmajority class: held-out "
        f"{sum(majority[l] for l in data.test) / len(data.test):.3f}, zero-shot "
        f"{sum(majority[l] for l in data.zero_shot) / max(1, len(data.zero_shot)):.3f}"
    )
    common.write_json(
        out / "results.json",
        {
            "config": dataclasses.asdict(config),
            "classes": list(data.class_names),
            "train_sizes": {lang: len(y) for lang, (_, y) in data.train.items()},
            "majority_accuracy": majority,
            "summary": rows,
            "runs": runs,
        },
    )
    log(f"results.json in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
