r"""The synthetic experiment of Sequential Reptile (Lee et al., Fig. 3) with every method.

    python -m trainers.multitask_synthetic                  # all methods, ~30 s on 2 cores
    python -m trainers.multitask_synthetic --methods=mtl,sequential_reptile --steps=600
    python -m trainers.multitask_synthetic --methods=zoo,sequential_reptile  # every method

Three tasks in 2-D (optima (0, 10), (0, 0), (10, 0)), phi starts at (20, 5), task loss
-200 exp(-0.2 ||phi - x_i||) (`trainers.experiments.synthetic`; the paper prints the exponent
with the wrong sign). Every method starts from the same phi and sees batches drawn by the
same `MultiTaskStream` (seed `--seed`), and takes `--steps` task gradients in all:

  mtl                 MultiTaskTrainer("sum"): every step the three tasks' gradients, summed
  pcgrad, gradvac,    MultiTaskTrainer with gradient surgery / GradNorm task weights
  gradnorm            (GradNorm's layer: phi, the only weight)
  <registry name>     MultiTaskTrainer(method=<name>): any method of
                      `tf_metaalign.algorithms.multitask` (`--methods=zoo`: all of them,
                      "sum" as "mtl"; options `--method_options=cagrad.calpha=0.4,...`,
                      see `trainers.multitask_methods`)
  recadam             "sum" with RecAdam(0.05) (pulled back to the start point, annealed
                      with k=0.05, t0 = the middle of the run, pretrain_cof=10: see run_method)
  reptile             MultiTaskReptileTrainer: per outer step one K-step trajectory per task
                      from the same phi, averaged (outer SGD, `--outer_learning_rate`)
  sequential_reptile  SequentialReptileTrainer: one K-step trajectory over single-task
                      batches (task drawn with p_t, equal sizes: uniform), then the outer step

Prints a table (final phi; the mean task loss and the mean pairwise cosine of the task
gradients averaged over the last 20% of the trajectory, since SGD ends in a cycle around a
loss cusp; per-task losses and the cosine at the final phi) and writes `results.json` and
`trajectories.png` (the
loss surface with every method's trajectory of phi, like the paper's Fig. 3) to
`--output_dir`.
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from trainers import multitask_methods as MM  # noqa: E402
from trainers import settings  # noqa: E402
from trainers.settings import setting  # noqa: E402

#: The default run (the paper's Fig. 3 comparison).
METHODS = ("mtl", "pcgrad", "gradvac", "gradnorm", "recadam", "reptile", "sequential_reptile")
#: The program's own methods; every registry method is accepted too, and "zoo".
PROGRAM_METHODS = ("recadam", "reptile", "sequential_reptile")
ALIASES = {"mtl": "sum"}
#: The program's defaults for registry methods (the user's --method_options override them).
#: The task losses here are NEGATIVE (minimum -SCALE = -200 at a task's optimum), which
#: the loss-scale methods assume they are not: FAMO gets the true lower bound (its
#: log(L_t - min_losses_t) needs it), IMTL runs IMTL-G alone (IMTL-L's e^s L_t - s has
#: no minimum in s when L_t < 0: s grows without bound).
METHOD_DEFAULTS = {
    "gradnorm": {"variable": 0},  # phi, the only (rank-1) weight
    "famo": {"min_losses": -200.0},
    "imtl": {"learn_scales": False},
}
#: Registry methods that cannot run on negative losses; "zoo" leaves them out, and
#: naming one is an error.
NEEDS_NONNEGATIVE_LOSSES = {
    "uw": "uncertainty weighting minimises L_t / (2 e^s_t) + s_t / 2, unbounded below in "
    "s_t when L_t < 0 (the weights diverge)"
}


@dataclasses.dataclass
class Config:
    """The program's settings: each field is also the flag of its name (`setting`)."""

    methods: tuple[str, ...] = MM.methods_setting(METHODS, PROGRAM_METHODS, ALIASES)
    #: {method: {constructor argument: value}} for the registry methods run.
    method_options: dict = MM.method_options_setting("cagrad.calpha=0.4,gradvac.beta=0.5")
    steps: int = setting(1800, "Task gradients per method (MTL: steps/3 steps of 3 tasks).")
    inner_steps: int = setting(3, "K of Reptile and Sequential Reptile.")
    learning_rate: float = setting(0.1, "SGD learning rate (MTL & co.; the inner rate of Reptile).")
    outer_learning_rate: float = setting(0.5, "eta of Reptile and Sequential Reptile.")
    seed: int = setting(0, "Seed of the task stream (and PCGrad's order).")


def define_flags():
    """The program's flags: one per `Config` setting, `--output_dir` (only when it
    runs as a program: tests import its functions)."""
    settings.define_program_flags(Config, "/tmp/tf_metaalign_multitask_synthetic")


FLAGS = flags.FLAGS

TABLE_COLUMNS = (
    ("method", "method", "s"),
    ("phi", "final phi", "s"),
    ("tail_loss", "loss (last 20%)", ".2f"),
    ("tail_cosine", "task cos (last 20%)", ".3f"),
    ("task_losses", "final task losses", "s"),
    ("cosine", "final task cos", ".3f"),
    ("seconds", "s", ".1f"),
)

#: What a method uses beyond `MultiTaskTrainer` (a run whose piece is not on the backend
#: yet is skipped with the reason: `common.unavailable`).
NEEDS = {
    "recadam": [("tf_metaalign.optimizers", "RecAdam")],
    "reptile": [("tf_metaalign.trainers", "MultiTaskReptileTrainer")],
    "sequential_reptile": [("tf_metaalign.trainers", "SequentialReptileTrainer")],
}

#: the share of a trajectory the "last 20%" columns average over. SGD on these losses does
#: not settle: each task's loss has a cusp at its optimum (|grad| = 40 there), so a fixed
#: learning rate ends in a cycle around it and the final point is one phase of the cycle.
TAIL = 0.2


def _stream(seed):
    from trainers.experiments import synthetic as S
    from tf_metaalign.data.multitask import MultiTaskStream

    return MultiTaskStream(S.synthetic_tasks(8), batch_size=1, q=1.0, seed=seed)


class _Trajectory:
    """phi after every step (the slow weights for Sequential Reptile)."""

    def __init__(self, read):
        import keras

        self.points = []
        outer = self

        class Record(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                outer.points.append(read())

            def on_train_batch_end(self, batch, logs=None):
                # On JAX, fit holds the state outside the variables between steps: write
                # it back first (a no-op when already written).
                sync = getattr(self.model, "jax_state_sync", None)
                if sync is not None:
                    sync()
                outer.points.append(read())

        self.callback = Record()


def run_method(
    method,
    steps,
    inner_steps=3,
    learning_rate=0.1,
    outer_learning_rate=0.5,
    seed=0,
    method_options=None,
):
    """Train one method on the synthetic problem; returns (final phi, trajectory).
    `method_options`: {method: {argument: value}} for registry methods."""
    import itertools

    import keras
    import numpy as np

    from tf_metaalign import optimizers as O
    from trainers.experiments import synthetic as S
    from tf_metaalign.trainers import (
        MultiTaskReptileTrainer,
        MultiTaskTrainer,
        SequentialReptileTrainer,
    )

    MM.check_methods((method,), PROGRAM_METHODS, ALIASES, flag="method")
    if MM.registry_name(method, ALIASES) in NEEDS_NONNEGATIVE_LOSSES:
        raise ValueError(
            f"`method`={method!r} does not apply to the synthetic problem: its "
            f"task losses are negative and "
            f"{NEEDS_NONNEGATIVE_LOSSES[MM.registry_name(method, ALIASES)]}."
        )
    options = MM.parse_method_options(method_options or {})
    MM.check_method_options(options, (method,), ALIASES)
    model = S.point_model()
    stream = _stream(seed)
    tasks = len(S.OPTIMA)
    # On JAX, NumPy batches (the stream's NumPy route: the same batches as tf.data's).
    as_numpy = keras.backend.backend() != "tensorflow"

    def take(batches, n):
        if as_numpy:
            return (batch for batch in itertools.islice(batches, n))  # fit takes generators
        return batches.take(n)

    def phi_now():
        return np.array(keras.ops.convert_to_numpy(model.trainable_variables[0]))

    if method == "recadam" or MM.registry_name(method, ALIASES):
        mtl_method = MM.build(
            "mtl" if method == "recadam" else method, options, ALIASES, METHOD_DEFAULTS.get(method)
        )
        trainer = MultiTaskTrainer(model, num_tasks=tasks, seed=seed, method=mtl_method)
        # RecAdam's pull is lr * pretrain_cof * (1 - lambda) * (w - w0) per step: the
        # reference's pretrain_cof=5000 is sized for lr ~2e-5 and diverges at lr 0.05
        # (a factor 250 per step); 10 keeps the factor at 0.5.
        optimizer = (
            O.RecAdam(0.05, anneal_k=0.05, anneal_t0=steps // (2 * tasks), pretrain_cof=10.0)
            if method == "recadam"
            else O.SGD(learning_rate)
        )
        n = steps // tasks
        data = take(stream.mixed_batches(per_task_batch_size=1, as_numpy=as_numpy), n)
        read = phi_now
    elif method == "reptile":
        trainer = MultiTaskReptileTrainer(
            model, inner_steps=inner_steps, inner_optimizer=learning_rate
        )
        optimizer = O.SGD(outer_learning_rate)

        # [T, K, 1, ...]: every task's K single-example batches (the same every step)
        x = np.zeros((tasks, inner_steps, 1, 1), np.float32)
        y = np.tile(np.asarray(S.OPTIMA, np.float32)[:, None, None, :], (1, inner_steps, 1, 1))
        n = steps // (tasks * inner_steps)
        if as_numpy:
            data = (batch for batch in [(x, y)] * n)
        else:
            import tensorflow as tf

            data = tf.data.Dataset.from_tensors((x, y)).repeat(n)
        read = phi_now
    else:  # sequential_reptile
        trainer = SequentialReptileTrainer(
            model, inner_steps=inner_steps, outer_learning_rate=outer_learning_rate
        )
        optimizer = O.SGD(learning_rate)
        n = steps
        data = take(stream.single_task_batches(as_numpy=as_numpy), n)

        def read():
            return np.array(keras.ops.convert_to_numpy(trainer.weights_copy("slow")[0]))

    trainer.compile(optimizer=optimizer, loss=S.SyntheticTaskLoss())
    trajectory = _Trajectory(read)
    trainer.fit(data, verbose=0, shuffle=False, steps_per_epoch=n, callbacks=[trajectory.callback])
    final = phi_now()
    return final, np.asarray(trajectory.points)


def tail_averages(points, fraction=TAIL):
    """(mean task loss, mean pairwise task-gradient cosine) averaged over the last
    `fraction` of a trajectory."""
    import numpy as np

    from trainers.experiments import synthetic as S

    tail = points[-max(1, int(len(points) * fraction)) :]
    loss = float(np.mean([np.mean([S.task_loss(p, o) for o in S.OPTIMA]) for p in tail]))
    cosine = float(np.mean([S.mean_pairwise_cosine(p) for p in tail]))
    return loss, cosine


def summarise(method, phi, points, seconds):
    import numpy as np

    from trainers.experiments import synthetic as S

    losses = [float(S.task_loss(phi, o)) for o in S.OPTIMA]
    tail_loss, tail_cosine = tail_averages(points)
    return {
        "method": method,
        "phi": f"({phi[0]:.2f}, {phi[1]:.2f})",
        "final_phi": [float(v) for v in phi],
        "mean_loss": float(np.mean(losses)),
        "task_losses": " ".join(f"{v:.1f}" for v in losses),
        "task_loss_values": losses,
        "cosine": S.mean_pairwise_cosine(phi),
        "tail_loss": tail_loss,
        "tail_cosine": tail_cosine,
        "seconds": seconds,
    }


def plot(trajectories, path):
    import matplotlib
    import numpy as np

    from trainers.common import figure

    from trainers.experiments import synthetic as S

    grid = np.linspace(-5, 25, 200)
    xx, yy = np.meshgrid(grid, grid)
    points = np.stack([xx, yy], axis=-1)
    surface = np.mean([S.task_loss(points, o) for o in S.OPTIMA], axis=0)
    fig = figure(figsize=(7, 6))
    ax = fig.subplots()
    contour = ax.contourf(xx, yy, surface, levels=30, cmap="viridis")
    fig.colorbar(contour, ax=ax, label="mean task loss")
    for x, y in S.OPTIMA:
        ax.plot(x, y, "r*", markersize=14)
    colors = matplotlib.colormaps["tab10" if len(trajectories) <= 10 else "tab20"].colors
    for (method, points_), color in zip(trajectories.items(), colors):
        ax.plot(
            points_[:, 0], points_[:, 1], "-", linewidth=1.2, color=color, alpha=0.8, label=method
        )
        ax.plot(
            points_[-1, 0], points_[-1, 1], "o", markersize=7, color=color, markeredgecolor="white"
        )
    ax.set_xlim(grid[0], grid[-1])
    ax.set_ylim(grid[0], grid[-1])
    ax.plot(*S.START, "ws", markersize=8)
    ax.set_xlabel("phi_1")
    ax.set_ylabel("phi_2")
    ax.set_title("Synthetic 3-task problem: trajectories of phi (stars: task optima)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    from trainers import startup

    config = settings.program_config(Config)
    # --backend (or KERAS_BACKEND), set before anything imports Keras; TensorFlow quietly.
    backend, devices = startup.start(FLAGS.backend)

    from trainers import common

    zoo_skipped = [
        m for m in NEEDS_NONNEGATIVE_LOSSES if MM.ZOO in config.methods and m not in config.methods
    ]
    methods = tuple(m for m in MM.expand(config.methods, ALIASES) if m not in zoo_skipped)
    for m in zoo_skipped:
        print(
            f"'{MM.ZOO}' without {m}: this problem's task losses are negative and "
            f"{NEEDS_NONNEGATIVE_LOSSES[m]}."
        )
    options = config.method_options
    try:
        MM.check_methods(methods, PROGRAM_METHODS, ALIASES)
        MM.check_method_options(options, methods, ALIASES)
    except ValueError as e:
        raise app.UsageError(str(e))
    missing = common.unavailable({m: NEEDS.get(m, ()) for m in methods})
    for m, reason in missing.items():
        print(f"{m}: skipped on {backend}: {reason}")
    methods = tuple(m for m in methods if m not in missing)
    out = common.prepare_output_dir(FLAGS.output_dir)
    rows, trajectories = [], {}
    for method in methods:
        start = time.perf_counter()
        print(f"[{method}] training ({config.steps} task gradients)", flush=True)
        phi, points = run_method(
            method,
            config.steps,
            config.inner_steps,
            config.learning_rate,
            config.outer_learning_rate,
            config.seed,
            {m: o for m, o in options.items() if m == method},
        )
        rows.append(summarise(method, phi, points, time.perf_counter() - start))
        trajectories[method] = points
    print()
    print(common.format_table(rows, TABLE_COLUMNS))
    plot(trajectories, out / "trajectories.png")
    common.write_json(
        out / "results.json",
        {
            "flags": dataclasses.asdict(config),
            "backend": backend,
            "skipped": missing,
            "runs": [{k: v for k, v in r.items() if k not in ("phi", "task_losses")} for r in rows],
        },
    )
    print(f"\nresults.json and trajectories.png in {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
