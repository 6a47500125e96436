r"""Time and memory per step of `GuidedTrainer` against plain `fit` with the same optimizer.

    python -m benchmarks.guided_overhead                      # ~2-3 min on 2 CPU cores
    python -m benchmarks.guided_overhead --optimizers=adam,lamb,adafactor --steps=30
    KERAS_BACKEND=jax python -m benchmarks.guided_overhead --model=transformer \
        --optimizers=adam,flax_lamb                           # on JAX (no TensorFlow needed)

Same conventions as `benchmarks/dotprod_overhead.py`: one process, one model (weights
reset before each configuration), warm per-step wall times (the first `--warmup` steps,
which trace and compile, are not timed), ratio of medians, configurations interleaved over
`--repeats`. The guidance batch has the training batch's size (the cost of the guidance
pass is that of one training forward+backward, so the floor is about 2x at
guidance_every=1). Learned: learning rate and beta_1 (where the optimizer has one).

Memory: TensorFlow's allocator peak on the device (GPU, else "CPU:0": exact, tensors
only). The default model (a 10M-parameter MLP, 38 MB per parameter copy, batch 64) makes
a parameter copy large against allocator noise, and a small batch is the worst case for
the time ratio (the optimizer update is a larger share of a step). The
target is peak(guided) <= peak(plain) + 2 parameter copies (theta_{t+1} and the guidance
gradient), and step time <= 2.1x plain. Writes `benchmarks/results/guided_overhead.json`
(`guided_overhead_jax.json` on JAX).

On JAX: the data is an endless NumPy generator (the same batches as the tf.data pipeline),
`jit_compile` defaults to True (Keras's default there; on TensorFlow False), and memory is
the process's RSS growth (`benchmarks.common.PeakMemory`'s fallback: coarse).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

flags.DEFINE_enum(
    "model",
    "mlp",
    ["mlp", "transformer"],
    "mlp: dense layers on vectors (the optimizer update is a large share of a "
    "step: the worst case); transformer: a keras-hub encoder-decoder on token "
    "sequences (the setting of the paper).",
)
flags.DEFINE_integer("vocab_size", 4000, "transformer: vocabulary (embeddings and logits).")
flags.DEFINE_integer("seq_len", 32, "transformer: tokens per source and target sequence.")
flags.DEFINE_integer("dim", 128, "transformer: width.")
flags.DEFINE_integer("layers", 2, "transformer: encoder layers and decoder layers (each).")
flags.DEFINE_integer("input_dim", 784, "Input features of the synthetic classification data.")
flags.DEFINE_integer("width", 2048, "Hidden units of each Dense layer.")
flags.DEFINE_integer("depth", 3, "Hidden Dense layers.")
flags.DEFINE_integer("num_classes", 10, "Output classes.")
flags.DEFINE_integer("batch_size", 64, "Training batch (and guidance batch) size.")
flags.DEFINE_integer(
    "guidance_batch_size",
    None,
    "Guidance batch size (default: --batch_size; the guidance pass then costs a training "
    "forward+backward, so the floor of the ratio is about 2x).",
)
flags.DEFINE_integer("steps", 20, "Timed steps per configuration and repeat.")
flags.DEFINE_integer("warmup", 3, "Untimed steps first (tracing, compilation).")
flags.DEFINE_integer("repeats", 2, "Interleaved repeats of all configurations.")
flags.DEFINE_list(
    "optimizers",
    ["adam", "lamb"],
    "adam, lamb, adafactor, sgd_momentum, flax_adam, flax_lamb (flax's LAMB, the reference's).",
)
flags.DEFINE_list("guidance_every", ["1"], "GuidedTrainer guidance_every values to time.")
flags.DEFINE_list(
    "hyperparameters",
    ["learning_rate", "beta_1"],
    "What GuidedTrainer learns (beta_1 is dropped for an optimizer without one).",
)
flags.DEFINE_bool(
    "recompute",
    True,
    "Also time GuidedTrainer(commit_forward_update=False) (config 'guided_recompute').",
)
flags.DEFINE_bool(
    "jit_compile",
    None,
    "XLA-compile the train step (all configurations); default: False on TensorFlow, True on "
    "JAX (Keras's defaults).",
)
flags.DEFINE_string(
    "output",
    None,
    "Where the JSON goes (default: benchmarks/results/guided_overhead[_jax].json).",
)
FLAGS = flags.FLAGS

TARGET_RATIO = 2.1
TARGET_EXTRA_PARAM_COPIES = 2.0


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    if FLAGS.model == "transformer":
        return build_transformer()
    layers = [keras.Input((FLAGS.input_dim,))]
    layers += [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
    layers += [keras.layers.Dense(FLAGS.num_classes)]
    return keras.Sequential(layers, name="mlp")


def build_transformer():
    import keras
    import keras_hub

    n, d = FLAGS.seq_len, FLAGS.dim
    enc_in = keras.Input((n,), dtype="int32")
    dec_in = keras.Input((n,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(FLAGS.vocab_size, n, d)(enc_in)
    for _ in range(FLAGS.layers):
        x = keras_hub.layers.TransformerEncoder(4 * d, 4, dropout=0.1)(x)
    y = keras_hub.layers.TokenAndPositionEmbedding(FLAGS.vocab_size, n, d)(dec_in)
    for _ in range(FLAGS.layers):
        y = keras_hub.layers.TransformerDecoder(4 * d, 4, dropout=0.1)(y, x)
    logits = keras.layers.Dense(FLAGS.vocab_size)(y)
    return keras.Model([enc_in, dec_in], logits, name="transformer")


def synthetic_data(rng, n):
    """(x, y) numpy arrays of n examples for the chosen model."""
    if FLAGS.model == "transformer":
        shape = (n, FLAGS.seq_len)
        x = (
            rng.integers(1, FLAGS.vocab_size, size=shape).astype("int32"),
            rng.integers(1, FLAGS.vocab_size, size=shape).astype("int32"),
        )
        return x, rng.integers(1, FLAGS.vocab_size, size=shape).astype("int32")
    x = rng.normal(size=(n, FLAGS.input_dim)).astype("float32")
    return x, rng.integers(0, FLAGS.num_classes, size=n).astype("int32")


def make_optimizer(name):
    from tf_metaalign import optimizers as O

    if name == "adam":
        return O.Adam(1e-3)
    if name == "lamb":
        return O.Lamb(1e-3)
    if name == "adafactor":
        return O.Adafactor(1e-3, beta_1=0.0)
    if name == "sgd_momentum":
        return O.SGD(1e-2, momentum=0.9)
    if name in ("flax_adam", "flax_lamb"):
        from tf_metaalign.optimizers import flax_reference

        return (flax_reference.FlaxAdam if name == "flax_adam" else flax_reference.FlaxLamb)(1e-3)
    raise ValueError(f"`--optimizers`: unknown optimizer {name!r}.")


def make_dataset(x, y):
    """Endless batches of (x, y): tf.data on TensorFlow, a NumPy generator elsewhere."""
    import keras

    n = len(y)
    if keras.backend.backend() != "tensorflow":
        import keras.tree

        def batches():
            while True:
                for start in range(0, n - FLAGS.batch_size + 1, FLAGS.batch_size):
                    cut = slice(start, start + FLAGS.batch_size)
                    yield keras.tree.map_structure(lambda a: a[cut], (x, y))

        return batches()
    import tensorflow as tf

    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .repeat()
        .batch(FLAGS.batch_size, drop_remainder=True)
        .prefetch(2)
    )


def main(argv):
    del argv
    import keras
    import numpy as np

    from benchmarks import common
    from tf_metaalign.trainers.guided import GuidedTrainer
    from trainers.common import format_table, write_json

    backend = keras.backend.backend()
    jit_compile = FLAGS.jit_compile if FLAGS.jit_compile is not None else backend == "jax"
    output = FLAGS.output or str(
        Path(__file__).resolve().parent
        / "results"
        / ("guided_overhead_jax.json" if backend == "jax" else "guided_overhead.json")
    )
    rng = np.random.default_rng(0)
    x, y = synthetic_data(rng, FLAGS.batch_size * 8)
    dataset = make_dataset(x, y)
    guidance = synthetic_data(rng, FLAGS.guidance_batch_size or FLAGS.batch_size)
    model = build_model()
    initial = model.get_weights()
    param_bytes = int(sum(np.prod(v.shape) * 4 for v in model.trainable_variables))

    configs = []
    for opt in FLAGS.optimizers:
        configs.append((opt, "plain"))
        configs += [(opt, f"guided_every={e}") for e in FLAGS.guidance_every]
        if FLAGS.recompute:
            configs.append((opt, "guided_recompute"))
    per = {c: {"times": [], "memory": [], "first": [], "repeat_medians": []} for c in configs}
    memory_kind = None
    for repeat in range(FLAGS.repeats):
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for opt, kind in order:
            model.set_weights(initial)
            if kind == "plain":
                runner = model
            elif kind == "guided_recompute":
                runner = GuidedTrainer(
                    model,
                    guidance,
                    hyperparameters=tuple(FLAGS.hyperparameters),
                    commit_forward_update=False,
                )
            else:
                runner = GuidedTrainer(
                    model,
                    guidance,
                    hyperparameters=tuple(FLAGS.hyperparameters),
                    guidance_every=int(kind.split("=")[1]),
                )
            runner.compile(
                make_optimizer(opt),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile,
            )
            with common.PeakMemory() as mem:
                timer = common.StepTimer(warmup=FLAGS.warmup)
                runner.fit(
                    dataset,
                    steps_per_epoch=FLAGS.warmup + FLAGS.steps,
                    epochs=1,
                    verbose=0,
                    callbacks=[timer],
                )
            memory_kind = mem.kind
            rec = per[(opt, kind)]
            rec["times"].extend(timer.warm_times)
            rec["memory"].append(mem.peak_bytes)
            rec["first"].append(timer.first())
            rec["repeat_medians"].append(timer.median())
            print(
                f"repeat {repeat} {opt:12s} {kind:16s} median {1000 * timer.median():7.1f} ms "
                f"peak {mem.peak_bytes / 2**20:8.1f} MB",
                flush=True,
            )

    rows, results = [], {}
    for opt, kind in configs:
        rec = per[(opt, kind)]
        plain = per[(opt, "plain")]
        med = float(np.median(rec["times"]))
        plain_med = float(np.median(plain["times"]))
        peak, plain_peak = max(rec["memory"]), max(plain["memory"])
        extra_copies = (peak - plain_peak) / param_bytes
        # Ratios of runs taken next to each other (configurations are interleaved): robust
        # to the load of a shared machine drifting between repeats.
        repeat_ratios = [
            common.ratio(a, b) for a, b in zip(rec["repeat_medians"], plain["repeat_medians"])
        ]
        r = {
            "optimizer": opt,
            "config": kind,
            "median_step_ms": 1000 * med,
            "mean_step_ms": 1000 * float(np.mean(rec["times"])),
            "ratio_median": common.ratio(med, plain_med),
            "ratio_per_repeat": repeat_ratios,
            "ratio_median_of_repeats": float(np.median(repeat_ratios)),
            "peak_memory_mb": peak / 2**20,
            "extra_memory_param_copies": extra_copies,
            "extra_memory_param_copies_median": (
                float(np.median(rec["memory"])) - float(np.median(plain["memory"]))
            )
            / param_bytes,
            "first_step_s": max(rec["first"]),
            "timed_steps": len(rec["times"]),
        }
        if kind != "plain":
            r["meets_time_target"] = r["ratio_median_of_repeats"] <= TARGET_RATIO
            r["meets_memory_target"] = extra_copies <= TARGET_EXTRA_PARAM_COPIES
        results[f"{opt}/{kind}"] = r
        rows.append(r)
    table = format_table(
        rows,
        [
            ("optimizer", "optimizer", "s"),
            ("config", "config", "s"),
            ("median_step_ms", "median ms/step", ".1f"),
            ("ratio_median_of_repeats", "ratio (median of repeats)", ".3f"),
            ("ratio_median", "ratio of medians", ".3f"),
            ("peak_memory_mb", f"peak MB ({memory_kind})", ".1f"),
            ("extra_memory_param_copies", "extra (param copies, max)", ".2f"),
            ("extra_memory_param_copies_median", "extra (median)", ".2f"),
        ],
    )
    print(table)
    out = {
        "description": "GuidedTrainer (learning rate + beta_1, guidance batch = training batch "
        "size) vs plain model.fit with the same tf_metaalign optimizer; warm "
        "per-step wall time, ratio = guided / plain (medians).",
        "targets": {
            "ratio_median": TARGET_RATIO,
            "extra_memory_param_copies": TARGET_EXTRA_PARAM_COPIES,
        },
        "model": dict(
            {"kind": FLAGS.model, "params": int(model.count_params()), "param_bytes": param_bytes},
            **(
                {
                    "vocab_size": FLAGS.vocab_size,
                    "seq_len": FLAGS.seq_len,
                    "dim": FLAGS.dim,
                    "layers": FLAGS.layers,
                }
                if FLAGS.model == "transformer"
                else {
                    "input_dim": FLAGS.input_dim,
                    "width": FLAGS.width,
                    "depth": FLAGS.depth,
                    "num_classes": FLAGS.num_classes,
                }
            ),
        ),
        "batch_size": FLAGS.batch_size,
        "guidance_batch_size": FLAGS.guidance_batch_size or FLAGS.batch_size,
        "steps": FLAGS.steps,
        "warmup": FLAGS.warmup,
        "repeats": FLAGS.repeats,
        "jit_compile": jit_compile,
        "backend": backend,
        "memory_kind": memory_kind,
        "environment": common.environment(),
        "results": results,
        "table": table,
    }
    path = write_json(output, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
