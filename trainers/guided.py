r"""Guided learning (Lichtarge et al.) on a real, offline sequence-to-sequence task.

    pip install django            # the gettext catalogs are the data (nothing downloads)
    python -m trainers.guided                       # LAMB and Adafactor, ~5 min on 2 cores
    python -m trainers.guided --optimizers=lamb --steps=600 --lang=fr

Task: Django's English -> `--lang` UI strings (~790 pairs per language, strings up to
`--max_chars` characters), character-level, a tiny Transformer encoder-decoder
(keras_hub TransformerEncoder/Decoder, 1+1 layers, randomly initialised). Held out:
a guidance set (`--guidance_size` pairs, one fixed batch as in the paper's default) and a
dev set. Every run starts from the same weights and sees the same batches.

Runs per optimizer (`--optimizers`: lamb, adafactor):
  baseline    plain `model.fit` (static hyperparameters)
  lr          learned learning-rate scale
  beta_1      learned beta_1 (LAMB: from 0.9; Adafactor: from 0, i.e. 0.01, see docs)
  both        learned learning rate and beta_1
  beta_1@b    learned beta_1 started at b for b in `--beta_1_inits` (0.1, 0.5, 0.9)

Prints a table (dev loss, dev token accuracy with teacher forcing, final learned values,
time per step) and writes `results.json`, schedule plots (PNG) and TensorBoard logs to
`--output_dir`. The meta learning rate defaults to 5e-3, not the paper's 3e-5: with Adam
the raw values move about one meta learning rate per step, and these runs are a few
hundred steps, not 160k.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from trainers import settings  # noqa: E402
from trainers.settings import setting  # noqa: E402

OPTIMIZERS = ("lamb", "adafactor")


@dataclasses.dataclass
class Config:
    """Everything a run depends on: each field is also the flag of its name (`setting`)."""

    lang: str = setting("de", "Target language of the Django catalogs.")
    max_chars: int = setting(40, "Keep pairs whose sides have at most this many characters.")
    steps: int = setting(300, "Training steps per run.")
    batch_size: int = setting(32, "Training batch size.")
    guidance_size: int = setting(64, "Held-out guidance pairs (one fixed batch).")
    dev_fraction: float = setting(0.15, "Fraction of pairs held out for dev evaluation.")
    dim: int = setting(64, "Transformer width.")
    heads: int = setting(4, "Attention heads.")
    ff_dim: int = setting(128, "Feed-forward width.")
    dropout: float = setting(0.1, "Dropout (training only; the guidance loss uses none).")
    optimizers: tuple[str, ...] = setting(OPTIMIZERS, "Optimizers to compare.", choices=OPTIMIZERS)
    lamb_learning_rate: float = setting(1e-2, "LAMB learning rate (constant schedule).")
    adafactor_learning_rate: float = setting(1e-2, "Adafactor learning rate (constant).")
    meta_learning_rate: float = setting(5e-3, "Adam learning rate of the raw hyperparameters.")
    beta_1_inits: tuple[float, ...] = setting((0.1, 0.5, 0.9), "Initial beta_1 values to compare.")
    seed: int = setting(0, "Seed of the split, initial weights and batch order.")


def define_flags():
    """The program's flags: one per `Config` setting, `--output_dir` (only when it
    runs as a program: tests import its functions)."""
    settings.define_program_flags(Config, "/tmp/tf_metaalign_guided")


FLAGS = flags.FLAGS


def build_model(vocab_size, max_len, config: Config):
    import keras
    import keras_hub

    enc_in = keras.Input((max_len,), dtype="int32", name="encoder_tokens")
    dec_in = keras.Input((max_len + 1,), dtype="int32", name="decoder_tokens")
    enc_mask = keras.ops.not_equal(enc_in, 0)
    dec_mask = keras.ops.not_equal(dec_in, 0)
    x = keras_hub.layers.TokenAndPositionEmbedding(vocab_size, max_len, config.dim)(enc_in)
    x = keras_hub.layers.TransformerEncoder(config.ff_dim, config.heads, dropout=config.dropout)(
        x, padding_mask=enc_mask
    )
    y = keras_hub.layers.TokenAndPositionEmbedding(vocab_size, max_len + 1, config.dim)(dec_in)
    y = keras_hub.layers.TransformerDecoder(config.ff_dim, config.heads, dropout=config.dropout)(
        y, x, decoder_padding_mask=dec_mask, encoder_padding_mask=enc_mask
    )
    logits = keras.layers.Dense(vocab_size, name="logits")(y)
    return keras.Model([enc_in, dec_in], logits, name="char_transformer")


def make_optimizer(name, beta_1, config: Config):
    from tf_metaalign import optimizers as O

    if name == "lamb":
        return O.Lamb(config.lamb_learning_rate, beta_1=beta_1)
    if name == "adafactor":
        return O.Adafactor(config.adafactor_learning_rate, beta_1=beta_1)
    raise ValueError(f"`--optimizers`: unknown optimizer {name!r} (lamb, adafactor).")


def dev_metrics(model, dev):
    import numpy as np

    (enc, dec), lab, mask = dev
    logits = model.predict([enc, dec], batch_size=256, verbose=0).astype("float64")
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, lab[..., None], -1)[..., 0]
    acc = logits.argmax(-1) == lab
    return {
        "dev_loss": float((nll * mask).sum() / mask.sum()),
        "dev_token_accuracy": float((acc * mask).sum() / mask.sum()),
    }


#: What the program needs on the backend, besides each `--optimizers` optimizer.
NEEDS = (("tf_metaalign.trainers", "GuidedTrainer"), ("tf_metaalign.optimizers", "Adam"))
#: The optimizer class of each `--optimizers` name.
OPTIMIZER_CLASSES = {"lamb": "Lamb", "adafactor": "Adafactor"}


def main(argv):
    del argv
    from trainers import common, startup

    config = settings.program_config(Config)
    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)
    needs = NEEDS + tuple(
        ("tf_metaalign.optimizers", OPTIMIZER_CLASSES[name]) for name in config.optimizers
    )
    common.require_on_backend("trainers.guided", needs, backend)
    import keras
    import numpy as np

    from tf_metaalign import optimizers as O
    from tf_metaalign.data import make_dataset
    from trainers.experiments import translation
    from tf_metaalign.plotting import ScheduleRecorder, plot_schedules
    from tf_metaalign.trainers.guided import GuidedTrainer
    from trainers.common import StepTimer, format_table, prepare_output_dir, write_json

    out_dir = prepare_output_dir(FLAGS.output_dir)
    print(f"guided: backend {backend}, devices: {', '.join(devices)}", flush=True)
    pairs = translation.load_django_pairs(config.lang, max_chars=config.max_chars)
    train, guidance, dev = translation.split_pairs(
        pairs, config.dev_fraction, config.guidance_size, config.seed
    )
    vocab = translation.CharVocab([t for p in train for t in p])
    L = config.max_chars
    tr = translation.make_char_seq2seq(train, vocab, L)
    gd = translation.make_char_seq2seq(guidance, vocab, L)
    dv = translation.make_char_seq2seq(dev, vocab, L)
    print(
        f"{config.lang}: {len(train)} train / {len(guidance)} guidance / {len(dev)} dev pairs, "
        f"{len(vocab)} symbols",
        flush=True,
    )

    def dataset():
        (enc, dec), lab, mask = tr
        if backend == "tensorflow":
            import tensorflow as tf

            ds = tf.data.Dataset.from_tensor_slices(((enc, dec), lab, mask))
            return (
                ds.shuffle(len(lab), seed=config.seed)
                .repeat()
                .batch(config.batch_size, drop_remainder=True)
            )
        # The NumPy route (no tf.data): batches of shuffled example indices, drawn by NumPy
        # from the seed (another order than tf.data's shuffle, which needs TensorFlow).
        rows = make_dataset(
            np.arange(len(lab)),
            np.arange(len(lab)),
            config.batch_size,
            seed=config.seed,
            repeat=True,
            drop_remainder=True,
            as_numpy=True,
        )
        return (((enc[i], dec[i]), lab[i], mask[i]) for i, _ in rows)

    guidance_batch = (gd[0], gd[1], gd[2])
    keras.utils.set_random_seed(config.seed)
    model = build_model(len(vocab), L, config)
    initial = model.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    runs = []
    for opt in config.optimizers:
        default_b1 = 0.9 if opt == "lamb" else 0.0
        runs.append((opt, "baseline", None, default_b1))
        runs.append((opt, "lr", ("learning_rate",), default_b1))
        runs.append((opt, "beta_1", ("beta_1",), default_b1))
        runs.append((opt, "both", ("learning_rate", "beta_1"), default_b1))
        for b in config.beta_1_inits:
            if b != default_b1:
                runs.append((opt, f"beta_1@{b:g}", ("beta_1",), b))

    rows, schedules = [], {}
    for opt, name, hparams, b1 in runs:
        model.set_weights(initial)
        keras.utils.set_random_seed(config.seed)
        if hparams is None:
            runner = model
        else:
            runner = GuidedTrainer(
                model,
                guidance_batch,
                hyperparameters=hparams,
                meta_optimizer=O.Adam(config.meta_learning_rate),
            )
        runner.compile(make_optimizer(opt, b1, config), loss)
        recorder = ScheduleRecorder(
            (
                "learning_rate_scale",
                "effective_learning_rate",
                "beta_1",
                "guidance_loss",
                "nonfinite_hypergrads",
            )
        )
        timer = StepTimer(warmup=3)
        tb = common.tensorboard_callbacks(out_dir / "tensorboard" / f"{opt}_{name}", 10)
        t0 = time.time()
        hist = runner.fit(
            dataset(),
            steps_per_epoch=config.steps,
            epochs=1,
            verbose=0,
            callbacks=[recorder, timer, *tb],
        )
        wall = time.time() - t0
        metrics = dev_metrics(model, dv)
        row = {
            "optimizer": opt,
            "run": name,
            "beta_1_init": b1 if hparams and "beta_1" in hparams else None,
            **metrics,
            "train_loss": float(hist.history["loss"][-1]),
            "ms_per_step": 1000 * timer.median(),
            "wall_s": wall,
        }
        if hparams is not None:
            learned = runner.learned_values()
            row["final_lr_scale"] = learned.get("learning_rate")
            row["final_beta_1"] = learned.get("beta_1")
            row["nonfinite_hypergrads"] = recorder.values["nonfinite_hypergrads"][-1]
        schedules[(opt, name)] = recorder.values
        rows.append(row)
        print(
            f"{opt:9s} {name:12s} dev loss {metrics['dev_loss']:.4f} acc "
            f"{metrics['dev_token_accuracy']:.4f}  {row['ms_per_step']:.1f} ms/step  "
            f"lr_scale {row.get('final_lr_scale')} beta_1 {row.get('final_beta_1')}",
            flush=True,
        )

    for opt in config.optimizers:
        main_runs = {
            n: schedules[(o, n)]
            for (o, n) in schedules
            if o == opt and n in ("lr", "beta_1", "both")
        }
        plot_schedules(
            main_runs,
            out_dir / f"{opt}_schedules.png",
            keys=("learning_rate_scale", "beta_1", "guidance_loss"),
            title=f"{opt}: learned schedules",
        )
        init_runs = {
            n: schedules[(o, n)] for (o, n) in schedules if o == opt and n.startswith("beta_1")
        }
        plot_schedules(
            init_runs,
            out_dir / f"{opt}_beta_1_inits.png",
            keys=("beta_1",),
            title=f"{opt}: learned beta_1 from different initial values",
        )

    table = format_table(
        rows,
        [
            ("optimizer", "optimizer", "s"),
            ("run", "run", "s"),
            ("dev_loss", "dev loss", ".4f"),
            ("dev_token_accuracy", "dev tok acc", ".4f"),
            ("train_loss", "train loss", ".4f"),
            ("final_lr_scale", "lr scale", ".3f"),
            ("final_beta_1", "beta_1", ".3f"),
            ("ms_per_step", "ms/step", ".1f"),
        ],
    )
    print(table)
    path = write_json(
        out_dir / "results.json",
        {
            "task": f"django en->{config.lang}, char-level, <= {config.max_chars} chars",
            "sizes": {
                "train": len(train),
                "guidance": len(guidance),
                "dev": len(dev),
                "vocab": len(vocab),
            },
            "flags": {
                k: getattr(config, k)
                for k in (
                    "steps",
                    "batch_size",
                    "dim",
                    "heads",
                    "ff_dim",
                    "dropout",
                    "lamb_learning_rate",
                    "adafactor_learning_rate",
                    "meta_learning_rate",
                    "seed",
                )
            },
            "rows": rows,
            "table": table,
            "backend": backend,
        },
    )
    print(f"wrote {path} and plots to {out_dir}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
