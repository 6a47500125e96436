r"""Time and peak memory per meta-step of `MAMLTrainer`: second vs first order, with and
without gradient sharing, against the functional PyTorch peer `shared/peers/maml_torch.py`.

    python -m benchmarks.maml_step                         # ~15 min on 2 shared CPU cores
    python -m benchmarks.maml_step --torch_python=/tmp/torchenv/bin/python
    python -m benchmarks.maml_step --configs=maml,fomaml --jit_compile_variants

The episode of the peer: Conv-4 (4 x [Conv 3x3, 64 filters, BatchNorm with batch
statistics, ReLU, max-pool 2]) + Dense(5) on 28x28x1, 5-way 1-shot, 15 queries per class,
5 inner SGD steps at 0.4, a task batch of 8, outer Adam (1e-3); random normal images, the
same meta-batch every step. Configurations (one model each, same initial weights, each
its own compiled `MAMLTrainer`): maml (second order), fomaml (first_order=True), maml_gs
and fomaml_gs (gradient_sharing=True); with `--jit_compile_variants` also "<config>_xla"
(`jit_compile=True`).

Warm: each configuration first runs `--warmup` untimed meta-steps (tracing, compilation:
the first meta-step takes 1.5-5 minutes on 2 CPU cores, the inner loop being unrolled over
8 tasks x 5 steps), then, once all are built, one more untimed meta-step each (the first
step of a trainer after others were run costs tens of seconds once: TensorFlow optimises
its function graph again).
Timed: `--rounds` rounds; each round runs every configuration for `--steps_per_round`
meta-steps in a shuffled order (load from other processes on a shared machine falls on
all of them alike); the wall time of each meta-step is taken by a Keras batch callback.
Ratios are of medians (means recorded too).

Memory: TensorFlow's allocator peak on the device (GPU, else "CPU:0") during ONE warm
meta-step (after compilation), minus what was allocated before it (exact; tensors only:
activations, the tapes' saved tensors, the gradients; the weights and Adam slots exist
already).

The peer runs as a subprocess (`--torch_python`, default: this interpreter if it can
import torch) before and after our configurations (`--peer_runs`), since the machine may
be shared; it prints its own warm seconds per meta-step (the mean of 3 steps after 1 warm-up).
Our/torch ratio = our median / the peer's FASTEST run (per order).

The peer's time depends on the machine's load far more than ours: its 2 OpenMP threads
wait on each other when other processes hold the cores (1.3 s second order on a quiet
moment, 63 s under a load of ~8 on 2 cores, same session); each run records its load
average and CPU seconds, so read the ratios against a quiet peer run.

Targets (issue #10 item 6): *_gs <= 1.2x the same order without sharing; maml and
fomaml <= 0.8x the torch peer of the same order. Writes `benchmarks/results/maml_step.json`.

On JAX (`KERAS_BACKEND=jax`, issue 30), also the hand-written vmapped JAX MAML step
("jax_maml", "jax_fomaml": the same Conv-4, weights and episode; `jax.vmap` over the tasks
of `jax.grad` inner steps, `jax.value_and_grad` outside, Adam by hand, one `jax.jit`; no
moving statistics, no Keras), timed in the same interleaved rounds; target: the trainer
<= 1.1x it (`hand_ratio`). Each timed trainer step waits for its results (a callback reads
the logged loss), as the hand step does (`block_until_ready`). Memory on JAX: RSS growth.

    KERAS_BACKEND=jax python -m benchmarks.maml_step --tasks=8 --rounds=3 \
        --output=benchmarks/results/maml_step_jax.json
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "maml_torch.py"

flags.DEFINE_integer("ways", 5, "N classes per task.")
flags.DEFINE_integer("shots", 1, "Support examples per class.")
flags.DEFINE_integer("queries", 15, "Query examples per class.")
flags.DEFINE_integer("inner_steps", 5, "Inner SGD steps.")
flags.DEFINE_float("inner_learning_rate", 0.4, "Inner SGD learning rate.")
flags.DEFINE_integer("tasks", 8, "Tasks per meta-batch.")
flags.DEFINE_integer("filters", 64, "Conv-4 filters per layer.")
flags.DEFINE_integer("image_size", 28, "Square images, 1 channel.")
flags.DEFINE_integer("conv_blocks", 4, "Conv blocks (4: Conv-4).")
flags.DEFINE_float("learning_rate", 1e-3, "Outer Adam learning rate.")
flags.DEFINE_integer("rounds", 8, "Timed rounds; each runs every configuration, shuffled.")
flags.DEFINE_integer("steps_per_round", 1, "Timed meta-steps per configuration and round.")
flags.DEFINE_integer("warmup", 1, "Untimed meta-steps first (tracing, compilation).")
flags.DEFINE_list(
    "configs",
    ["maml", "fomaml", "maml_gs", "fomaml_gs"],
    "maml, fomaml, maml_gs, fomaml_gs; a suffix _xla compiles with XLA.",
)
flags.DEFINE_bool(
    "jit_compile_variants",
    False,
    "Also run every configuration with jit_compile=True (<config>_xla).",
)
flags.DEFINE_string(
    "torch_python",
    None,
    "Python with torch for the peer; default: this interpreter if it has "
    "torch, else the peer is skipped. 'none': skip.",
)
flags.DEFINE_string("peer", str(DEFAULT_PEER), "The PyTorch peer script.")
flags.DEFINE_enum(
    "peer_device",
    "cpu",
    ["cpu", "cuda", "auto"],
    "Where the PyTorch peer runs: its script has no device option, so for cuda it runs "
    "under `torch.set_default_device` (every tensor and module it builds lands there; its "
    "per-task `.item()` synchronises, so its wall times are honest). auto: cuda when JAX's "
    "default device is a GPU.",
)
flags.DEFINE_integer("peer_runs", 2, "Peer runs: 1 = before ours; 2 = before and after.")
flags.DEFINE_integer("peer_timeout", 900, "Seconds before a peer run is abandoned.")
flags.DEFINE_string(
    "output",
    str(Path(__file__).resolve().parent / "results" / "maml_step.json"),
    "Where the JSON goes.",
)
flags.DEFINE_bool("verbose_times", False, "Print every timed meta-step.")
flags.DEFINE_enum(
    "jax_task_map",
    "auto",
    ["auto", "vmap", "loop"],
    "On JAX: tf_metaalign.algorithms.maml.JAX_TASK_MAP (auto: vmap on GPU/TPU, loop on CPU).",
)
flags.DEFINE_bool(
    "hand_jax", True, "On JAX: also time the hand-written vmapped JAX MAML step (jax_*)."
)
FLAGS = flags.FLAGS

TARGET_SHARING = 1.2  # *_gs / same order without sharing
TARGET_VS_TORCH = 0.8  # ours / torch, same order
TARGET_VS_HAND_JAX = 1.1  # ours / the hand-written vmapped JAX step, same order (JAX)
HAND = {"maml": "jax_maml", "fomaml": "jax_fomaml", "maml_xla": "jax_maml"}
BASE = {
    "maml_gs": "maml",
    "fomaml_gs": "fomaml",
    "maml_gs_xla": "maml_xla",
    "fomaml_gs_xla": "fomaml_xla",
}
ORDER = {"maml": "second", "fomaml": "first"}


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((FLAGS.image_size, FLAGS.image_size, 1))]
    for _ in range(FLAGS.conv_blocks):
        layers += [
            keras.layers.Conv2D(FLAGS.filters, 3, padding="same"),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(FLAGS.ways)]
    return keras.Sequential(layers, name="conv4")


def make_dataset():
    """The same meta-batch forever (as the peer): ((support_x, support_y, query_x), query_y).
    A tf.data.Dataset on TensorFlow; a Python generator of NumPy arrays on JAX."""
    import numpy as np

    rng = np.random.default_rng(0)
    t, n, k, q, s = FLAGS.tasks, FLAGS.ways, FLAGS.shots, FLAGS.queries, FLAGS.image_size
    sx = rng.normal(size=(t, n * k, s, s, 1)).astype("float32")
    qx = rng.normal(size=(t, n * q, s, s, 1)).astype("float32")
    sy = np.tile(np.repeat(np.arange(n), k), (t, 1)).astype("int32")
    qy = np.tile(np.repeat(np.arange(n), q), (t, 1)).astype("int32")
    if on_jax():

        def forever():
            while True:
                yield (sx, sy, qx), qy

        return forever()
    import tensorflow as tf

    return tf.data.Dataset.from_tensors(((sx, sy, qx), qy)).repeat()


def on_jax() -> bool:
    import keras

    return keras.backend.backend() == "jax"


class WaitForResults:
    """A Keras callback (JAX) that reads the logged loss at each batch's end, so that a
    step's wall time includes its computation (JAX dispatches asynchronously)."""

    def __new__(cls):
        import keras

        class _Wait(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if logs and "loss" in logs:
                    float(logs["loss"])

        return _Wait()


def hand_jax_step(first_order, weights):
    """The hand-written vmapped JAX MAML meta-step on the Conv-4 of `build_model` (its
    initial `weights`: per block conv kernel, bias, BN gamma, beta (+ the moving statistics,
    unused), then the dense kernel and bias): BatchNorm with batch statistics (eps 1e-3,
    Keras's default), `--inner_steps` SGD steps per task under `jax.vmap`, the query
    cross-entropy mean over tasks, `jax.value_and_grad` (second order through the inner
    `jax.grad`, or with it stopped), Adam by hand. Returns (step, params, adam state):
    `step(params, adam, batch) -> (params, adam, loss)`, jitted."""
    import jax
    import jax.numpy as jnp

    blocks = FLAGS.conv_blocks
    params = []
    for b in range(blocks):
        params += [jnp.asarray(w) for w in weights[6 * b : 6 * b + 4]]
    params += [jnp.asarray(w) for w in weights[6 * blocks :]]
    alpha = FLAGS.inner_learning_rate

    def forward(p, x):
        h = x
        for b in range(blocks):
            kernel, bias, gamma, beta = p[4 * b : 4 * b + 4]
            h = jax.lax.conv_general_dilated(
                h, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            h = h + bias
            mean = jnp.mean(h, axis=(0, 1, 2))
            var = jnp.mean(jnp.square(h - mean), axis=(0, 1, 2))
            h = (h - mean) * jax.lax.rsqrt(var + 1e-3) * gamma + beta
            h = jax.nn.relu(h)
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = h.reshape(h.shape[0], -1)
        return h @ p[-2] + p[-1]

    def cross_entropy(p, x, y):
        logits = forward(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    def task_loss(p, sx, sy, qx, qy):
        theta = p
        for _ in range(FLAGS.inner_steps):
            grads = jax.grad(cross_entropy)(theta, sx, sy)
            if first_order:
                grads = jax.lax.stop_gradient(grads)
            theta = [t - alpha * g for t, g in zip(theta, grads)]
        return cross_entropy(theta, qx, qy)

    def meta_loss(p, batch):
        (sx, sy, qx), qy = batch
        return jnp.mean(jax.vmap(task_loss, in_axes=(None, 0, 0, 0, 0))(p, sx, sy, qx, qy))

    lr, b1, b2, eps = FLAGS.learning_rate, 0.9, 0.999, 1e-7

    @jax.jit
    def step(p, adam, batch):
        loss, grads = jax.value_and_grad(meta_loss)(p, batch)
        m, v, t = adam
        t = t + 1
        m = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grads)]
        v = [b2 * vi + (1 - b2) * g * g for vi, g in zip(v, grads)]
        scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        p = [pi - scale * mi / (jnp.sqrt(vi) + eps) for pi, mi, vi in zip(p, m, v)]
        return p, (m, v, t), loss

    adam = ([jnp.zeros_like(w) for w in params], [jnp.zeros_like(w) for w in params], 0.0)
    return step, params, adam


class HandRunner:
    """Runs `hand_jax_step` as `interleaved_rounds` runs a trainer (timer callbacks around
    each step, which waits for its results)."""

    def __init__(self, first_order, batch):
        import jax

        self.jax = jax
        self.step, self.params, self.adam = hand_jax_step(
            first_order, [w for w in build_model().get_weights()]
        )
        self.batch = jax.device_put(batch)

    def run(self, steps, timer=None):
        for i in range(steps):
            if timer is not None:
                timer.on_train_batch_begin(i)
            self.params, self.adam, loss = self.step(self.params, self.adam, self.batch)
            self.jax.block_until_ready(loss)
            if timer is not None:
                timer.on_train_batch_end(i)
        return float(loss)


def parse_config(config):
    base = config[:-4] if config.endswith("_xla") else config
    if base not in ("maml", "fomaml", "maml_gs", "fomaml_gs"):
        raise ValueError(f"`--configs`: unknown configuration {config!r}.")
    return {
        "first_order": base.startswith("fomaml"),
        "gradient_sharing": base.endswith("_gs"),
        "jit_compile": config.endswith("_xla"),
    }


def make_trainer(config):
    import keras

    from tf_metaalign.trainers import MAMLTrainer

    spec = parse_config(config)
    trainer = MAMLTrainer(
        build_model(),
        inner_steps=FLAGS.inner_steps,
        inner_learning_rate=FLAGS.inner_learning_rate,
        first_order=spec["first_order"],
        gradient_sharing=True if spec["gradient_sharing"] else None,
    )
    trainer.compile(
        keras.optimizers.Adam(FLAGS.learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # On JAX a step is always one jax.jit (jit_compile=False would run it op by op).
        jit_compile=True if on_jax() else spec["jit_compile"],
    )
    return trainer


# ------------------------------------------------------------------------- the peer


def resolve_torch_python():
    """(python executable or None, reason when None)."""
    import importlib.util
    import sys

    value = FLAGS.torch_python
    if value and value.lower() == "none":
        return None, "skipped (--torch_python=none)"
    if value:
        return value, None
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, None
    return None, (
        "torch not installed in this interpreter (give --torch_python=/path/to/python with torch)"
    )


#: Runs a script as `__main__` with torch's default device set first (argv: device, script).
PEER_ON_DEVICE = (
    "import runpy, sys, torch; torch.set_default_device(sys.argv[1]); "
    "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def peer_device():
    """`--peer_device`, with auto resolved: "cuda" when JAX's default device is a GPU."""
    if FLAGS.peer_device != "auto":
        return FLAGS.peer_device
    if on_jax():
        import jax

        return "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
    return "cpu"


def peer_command(python):
    device = peer_device()
    if device == "cpu":
        return [python, FLAGS.peer]
    return [python, "-c", PEER_ON_DEVICE, device, FLAGS.peer]


def run_peer(python, label):
    """Run the peer script; returns {"second_order_s", "first_order_s", ...} or {"error"}."""
    import re
    import subprocess
    import time

    import resource

    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run(
            peer_command(python),
            capture_output=True,
            text=True,
            timeout=FLAGS.peer_timeout,
            cwd=str(Path(FLAGS.peer).parent),
        )
    except subprocess.TimeoutExpired:
        return {"run": label, "error": f"timed out after {FLAGS.peer_timeout} s"}
    except OSError as e:
        return {"run": label, "error": f"could not start {python}: {e}"}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the whole run (import, 8 meta-steps per order): against wall_s, how
    # much of the 2 cores the peer got (OpenMP threads suffer on an oversubscribed machine).
    out = {
        "run": label,
        "device": peer_device(),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load_average": os.getloadavg(),
    }
    for order in ("second", "first"):
        m = re.search(rf"torch {order}-order meta-step: ([0-9.]+) s", proc.stdout)
        if m:
            out[f"{order}_order_s"] = float(m.group(1))
    if proc.returncode or "second_order_s" not in out:
        out["error"] = f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"
    return out


def torch_version(python):
    import subprocess

    try:
        proc = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


# ------------------------------------------------------------------------- main


def main(argv):
    del argv
    import time

    import numpy as np

    from benchmarks import common
    from trainers.common import format_table, write_json

    configs = list(FLAGS.configs)
    if FLAGS.jit_compile_variants:
        configs += [c + "_xla" for c in FLAGS.configs if not c.endswith("_xla")]
    for c in configs:
        parse_config(c)
    python, peer_skip = resolve_torch_python()
    if python and not Path(FLAGS.peer).exists():
        python, peer_skip = None, f"peer script not found: {FLAGS.peer}"
    peer = []
    if python:
        print(f"peer run 1 ({python}) ...", flush=True)
        peer.append(run_peer(python, "before"))
        print(f"peer: {peer[-1]}", flush=True)

    task_map = None
    if on_jax():
        from tf_metaalign.algorithms import maml as M

        M.JAX_TASK_MAP = FLAGS.jax_task_map
        task_map = "vmap" if M._parallel_tasks() else "loop"
    dataset = make_dataset()
    wait = [WaitForResults()] if on_jax() else []
    trainers, first_step, warm_errors, memory, memory_kind = {}, {}, {}, {}, None
    for config in configs:
        t0 = time.perf_counter()
        try:
            trainer = make_trainer(config)
            timer = common.StepTimer(warmup=0)
            trainer.fit(
                dataset,
                steps_per_epoch=FLAGS.warmup,
                epochs=1,
                verbose=0,
                callbacks=[*wait, timer],
            )
        except Exception as e:  # noqa: BLE001  (XLA may not compile: record why)
            warm_errors[config] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"{config}: FAILED: {warm_errors[config][:300]}", flush=True)
            continue
        trainers[config] = trainer
        first_step[config] = timer.first()
        print(
            f"{config}: warm-up {time.perf_counter() - t0:.1f} s (first step "
            f"{timer.first():.1f} s)",
            flush=True,
        )

    # The first step of a trainer after other trainers were built and run costs seconds
    # (once; TensorFlow re-optimises the step's function graph): one untimed step each.
    for config in trainers:
        trainers[config].fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)
    # Memory: one warm meta-step each.
    for config in trainers:
        with common.PeakMemory() as mem:
            trainers[config].fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)
        memory[config], memory_kind = mem.peak_bytes, mem.kind
        print(f"{config}: peak {mem.peak_bytes / 2**20:.1f} MB", flush=True)

    # JAX: the hand-written vmapped JAX step of each order timed (first_order or not).
    hand = {}
    if on_jax() and FLAGS.hand_jax:
        batch = next(make_dataset())
        for config in [c for c in ("maml", "fomaml") if any(k.startswith(c) for k in trainers)]:
            name = HAND[config]
            t0 = time.perf_counter()
            hand[name] = HandRunner(config == "fomaml", batch)
            hand[name].run(max(FLAGS.warmup, 1))
            first_step[name] = time.perf_counter() - t0
            memory[name] = None
            print(f"{name}: warm-up {first_step[name]:.1f} s", flush=True)

    def run(config, steps, timer):
        if config in hand:
            hand[config].run(steps, timer)
            return
        trainers[config].fit(
            dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[*wait, timer]
        )

    def show(config, step_times):
        if FLAGS.verbose_times:
            print(f"  {config}: " + " ".join(f"{1000 * x:.0f}" for x in step_times), flush=True)

    times, _ = common.interleaved_rounds(
        list(trainers) + list(hand), run, FLAGS.rounds, FLAGS.steps_per_round, on_step_times=show
    )

    if python and FLAGS.peer_runs > 1:
        print("peer run 2 ...", flush=True)
        peer.append(run_peer(python, "after"))
        print(f"peer: {peer[-1]}", flush=True)

    # The peer's reference: its FASTEST run (the least disturbed by other processes; the
    # peer slows down under load far more than ours, see the module doc). Conservative:
    # a slower peer run would only make our ratio smaller.
    torch_s = {}
    for order in ("second", "first"):
        values = [p[f"{order}_order_s"] for p in peer if f"{order}_order_s" in p]
        if values:
            torch_s[order] = float(np.min(values))

    med = {c: float(np.median(t)) for c, t in times.items()}
    mean = {c: float(np.mean(t)) for c, t in times.items()}

    def timing(config):
        """The row fields every timed config has."""
        return {
            "config": config,
            "median_step_ms": 1000 * med[config],
            "mean_step_ms": 1000 * mean[config],
            "min_step_ms": 1000 * float(np.min(times[config])),
            "timed_steps": len(times[config]),
            "first_step_s": first_step[config],
        }

    rows, results = [], {}
    for config in configs + list(hand):
        if config in hand:
            results[config] = r = timing(config)
            rows.append(r)
            continue
        if config not in times:
            results[config] = {"config": config, "error": warm_errors.get(config)}
            continue
        base = config[:-4] if config.endswith("_xla") else config
        r = {
            "config": config,
            **parse_config(config),
            **timing(config),
            "peak_mb": memory[config] / 2**20 if memory[config] is not None else None,
        }
        if config in BASE and BASE[config] in med:
            r["sharing_ratio"] = med[config] / med[BASE[config]]
            r["sharing_ratio_mean"] = mean[config] / mean[BASE[config]]
            r["sharing_target"] = TARGET_SHARING
            r["meets_sharing_target"] = bool(r["sharing_ratio"] <= TARGET_SHARING)
            if memory[config] is not None and memory.get(BASE[config]):
                r["sharing_memory_ratio"] = memory[config] / memory[BASE[config]]
        if config in HAND and HAND[config] in med:
            r["hand_jax_ratio"] = med[config] / med[HAND[config]]
            r["hand_jax_target"] = TARGET_VS_HAND_JAX
            r["meets_hand_jax_target"] = bool(r["hand_jax_ratio"] <= TARGET_VS_HAND_JAX)
        order = ORDER.get(base.replace("_gs", ""))
        if order in torch_s:
            r["torch_s"] = torch_s[order]
            r["torch_ratio"] = med[config] / torch_s[order]
            if base in ORDER:  # the target is for plain MAML / FOMAML
                r["torch_target"] = TARGET_VS_TORCH
                r["meets_torch_target"] = bool(r["torch_ratio"] <= TARGET_VS_TORCH)
        results[config] = r
        rows.append(r)
    for p in peer:
        for order in ("second", "first"):
            if f"{order}_order_s" in p:
                rows.append(
                    {
                        "config": f"torch_{order}_{p['run']}",
                        "median_step_ms": 1000 * p[f"{order}_order_s"],
                    }
                )
    table = format_table(
        rows,
        [
            ("config", "config", "s"),
            ("median_step_ms", "median ms", ".0f"),
            ("mean_step_ms", "mean ms", ".0f"),
            ("peak_mb", "peak MB", ".1f"),
            ("sharing_ratio", "gs/plain", ".3f"),
            ("torch_ratio", "ours/torch", ".3f"),
            ("hand_jax_ratio", "ours/jax hand", ".3f"),
            ("first_step_s", "first step s", ".1f"),
        ],
    )
    print(table)
    model = build_model()
    out = {
        "description": "MAMLTrainer seconds per meta-step (warm; compilation excluded) and "
        "allocator peak per warm meta-step, 5-way 1-shot Conv-4 episode of "
        "shared/peers/maml_torch.py; configurations interleaved; sharing ratio "
        "= *_gs median / same order's median; torch ratio = our median / the "
        "peer's warm mean of its fastest run.",
        "episode": {
            "ways": FLAGS.ways,
            "shots": FLAGS.shots,
            "queries": FLAGS.queries,
            "inner_steps": FLAGS.inner_steps,
            "inner_learning_rate": FLAGS.inner_learning_rate,
            "tasks": FLAGS.tasks,
            "image_size": FLAGS.image_size,
            "filters": FLAGS.filters,
            "conv_blocks": FLAGS.conv_blocks,
            "outer": f"Adam({FLAGS.learning_rate})",
        },
        "model": {"kind": "conv4", "params": int(model.count_params())},
        "rounds": FLAGS.rounds,
        "steps_per_round": FLAGS.steps_per_round,
        "warmup": FLAGS.warmup,
        "memory_kind": (
            f"{memory_kind}: TensorFlow allocator peak during one warm meta-step "
            "minus what was allocated before (tensors only)"
            if memory_kind and memory_kind.endswith("allocator_peak")
            else f"{memory_kind}: process RSS growth during one warm meta-step (approximate)"
        ),
        "targets": {
            "sharing_over_plain_max": TARGET_SHARING,
            "ours_over_torch_max": TARGET_VS_TORCH,
            "ours_over_hand_jax_max": TARGET_VS_HAND_JAX,
        },
        "environment": common.environment(),
        "jax_task_map": task_map,
        "results": results,
        "torch": {
            "python": python,
            "version": torch_version(python) if python else None,
            "script": FLAGS.peer,
            "runs": peer,
            "reference_s": torch_s,
            "reference": "fastest run per order",
            "skipped": peer_skip,
        },
        "table": table,
    }
    path = write_json(FLAGS.output, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
