"""`trainers.finetune`'s run stage: one training run of a named method, and the
measurements taken at its final weights (G1.G2, the sharpness lambda_max)."""

from __future__ import annotations

import time

#: The methods `--runs` may name (the DotProd paper's baselines beside the SAM family).
RUNS = ("baseline", "dotprod", "sam", "asam", "gsam", "reptile", "fomaml")

#: What each run is (the report's legend).
DESCRIPTIONS = {
    "baseline": "DotProdTrainer(weight=0, regulariser pass off): plain training on G1+G2, "
    "G1.G2 logged on the same pairs",
    "dotprod": "DotProdTrainer(weight, alpha, every, method, alignment)",
    "sam": "SAMTrainer(rho)",
    "asam": "SAMTrainer(asam_rho, adaptive=True)",
    "gsam": "GSAMTrainer(rho, alpha=gsam_alpha): constant rho, as the learning rate is",
    "reptile": "ReptileTrainer(inner_steps=2 on (b1, b2), inner SGD(inner_learning_rate)); "
    "the outer optimizer on (phi - theta_2) / inner_learning_rate",
    "fomaml": "FOMAMLTrainer(inner_steps=1 on b1, query b2, inner SGD(inner_learning_rate))",
}
#: Said under the legend: the step scale of the runs.
SCALE_NOTE = (
    "baseline, dotprod and reptile step on G1 + G2 (twice the batch's mean gradient); with "
    "SGD, sam/asam/gsam/fomaml (one mean gradient) take twice the learning rate."
)

#: Runs whose trainer takes the pair stacked [2, B/2, ...] instead of the batch.
STACKED = ("reptile", "fomaml")


def interval_length(steps: int, log_every: int) -> int:
    """The largest divisor of `steps` that is <= `log_every` (equal logged intervals)."""
    for n in range(min(steps, log_every), 0, -1):
        if steps % n == 0:
            return n
    return 1


def make_optimizer(name: str, learning_rate):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(learning_rate)
    return keras.optimizers.SGD(learning_rate)


def make_trainer(run, model, options, optimizer_name, learning_rate):
    """`(trainer, optimizer)` for the run `run` (see `DESCRIPTIONS`).

    `options`: dict with weight, every, alpha, method, alignment (DotProd), rho, asam_rho,
    gsam_alpha (SAM family), inner_learning_rate (Reptile, FOMAML)."""

    from tf_metaalign.trainers import (
        DotProdTrainer,
        FOMAMLTrainer,
        GSAMTrainer,
        ReptileTrainer,
        SAMTrainer,
    )

    o = options
    if optimizer_name == "sgd" and run in ("sam", "asam", "gsam", "fomaml"):
        # DotProdTrainer (baseline, dotprod) and Reptile step on G1 + G2, twice the batch's
        # mean gradient; these step on one mean gradient: with SGD, twice the rate gives
        # every run the same step scale (Adam is invariant to it).
        learning_rate = 2 * learning_rate
    if run in ("baseline", "dotprod"):
        weight = 0.0 if run == "baseline" else o["weight"]
        trainer = DotProdTrainer(
            model,
            weight=weight,
            every=o["every"] if weight else 1,
            alpha=o["alpha"],
            method=o["method"],
            alignment=o["alignment"],
        )
        return trainer, make_optimizer(optimizer_name, learning_rate)
    if run == "sam":
        return SAMTrainer(model, rho=o["rho"]), make_optimizer(optimizer_name, learning_rate)
    if run == "asam":
        trainer = SAMTrainer(model, rho=o["asam_rho"], adaptive=True)
        return trainer, make_optimizer(optimizer_name, learning_rate)
    if run == "gsam":
        # Every run of the study keeps the constant learning rate (a decaying schedule for
        # GSAM alone would confound the comparison: measured on digits, a linear decay to a
        # tenth cost 2 points of accuracy in 200 steps), so GSAM's rho, which follows the
        # learning rate, is constant too: GSAM here is SAM plus the surrogate-gap term.
        trainer = GSAMTrainer(model, rho=o["rho"], alpha=o["gsam_alpha"])
        return trainer, make_optimizer(optimizer_name, learning_rate)
    if run in STACKED:
        inner = o["inner_learning_rate"]
        if run == "reptile":
            trainer = ReptileTrainer(model, inner_steps=2, inner_optimizer=inner)
            # phi - theta_2 = inner_lr * (G1 + G2(theta_1)): in gradient units for SGD.
            outer = learning_rate / inner if optimizer_name == "sgd" else learning_rate
        else:
            trainer = FOMAMLTrainer(model, inner_steps=1, inner_optimizer=inner)
            outer = learning_rate
        return trainer, make_optimizer(optimizer_name, outer)
    raise ValueError(f"`--runs`: unknown run {run!r}; expected names from {RUNS}.")


def run_one(name, model, initial_weights, splits, options, settings, output_dir, progress):
    """Train `name` from `initial_weights`; return the result row and the per-interval
    history.

    `settings`: dict with optimizer, learning_rate, steps, batch_size, seed, log_every,
    timing_warmup. `progress(message)` prints the run's progress lines.
    """
    import keras

    from trainers import common
    from trainers.finetune_data import stacked_pairs, static_tf_dataset

    s = settings
    model.set_weights(initial_weights)
    keras.utils.set_random_seed(s["seed"])
    run = name.split("@")[0]
    trainer, optimizer = make_trainer(run, model, options, s["optimizer"], s["learning_rate"])
    trainer.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    # The NumPy route on JAX (and with --portable): no tf.data; its shuffle order is drawn
    # by NumPy from the seed (tf.data's, on TensorFlow, cannot be reproduced without it).
    as_numpy = s.get("numpy_data", False)
    train_ds = splits.train_dataset(
        s["batch_size"], seed=s["seed"], repeat=True, drop_remainder=True, as_numpy=as_numpy
    )
    if run in STACKED:
        train_ds = stacked_pairs(train_ds, s["batch_size"])
    if as_numpy and keras.backend.backend() == "tensorflow":  # --portable on TensorFlow
        train_ds = static_tf_dataset(train_ds)
    timer = common.StepTimer(warmup=s["timing_warmup"])
    log_dir = output_dir / "tensorboard" / name
    steps = s["steps"]
    interval = interval_length(steps, s["log_every"])
    weight = options["weight"] if run == "dotprod" else 0.0
    progress(
        f"{name}: training {steps} steps of batch {s['batch_size']}"
        + (f" (weight={weight:g})" if run in ("baseline", "dotprod") else "")
        + "; the first step traces and compiles the model"
    )
    reporter = common.ProgressCallback(
        progress, name, steps, interval, metrics=("loss", "accuracy", "grad_dot")
    )
    start = time.perf_counter()
    # One "epoch" per logged interval over an endless dataset: Keras keeps the iterator
    # across epochs when steps_per_epoch is set, so every run sees the same batch order.
    # shuffle=False: the dataset is already shuffled (by --seed); Keras ignores `shuffle`
    # for a tf.data.Dataset and warns when it is left at its default True.
    h = trainer.fit(
        train_ds,
        steps_per_epoch=interval,
        epochs=steps // interval,
        shuffle=False,
        verbose=0,
        callbacks=[timer, reporter, *common.tensorboard_callbacks(log_dir)],
    )
    history = {k: [float(v) for v in h.history[k]] for k in h.history}
    history["steps"] = [interval * (i + 1) for i in range(len(history["loss"]))]
    train_seconds = time.perf_counter() - start
    progress(
        f"{name}: trained in {train_seconds:.1f} s; evaluating on {len(splits.y_test)} "
        "held-out examples"
    )
    ev = trainer.evaluate(
        splits.test_dataset(max(s["batch_size"], 64), as_numpy=as_numpy),
        verbose=0,
        return_dict=True,
    )
    common.write_summary(
        log_dir / "test",
        {"test_accuracy": ev["accuracy"], "test_loss": ev["loss"]},
        step=steps,
    )
    progress(f"{name}: test acc {ev['accuracy']:.4f}  test loss {ev['loss']:.4f}")
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731 (equal intervals)
    row = {
        "run": name,
        "weight": weight if run in ("baseline", "dotprod") else None,
        "every": options["every"] if run == "dotprod" and weight else None,
        "method": options["method"] if run == "dotprod" and weight else None,
        "test_accuracy": float(ev["accuracy"]),
        "test_loss": float(ev["loss"]),
        "train_loss": history["loss"][-1],
        "mean_grad_dot": mean(history.get("grad_dot", [])),
        "mean_grad_cosine": mean(history.get("grad_cosine", [])),
        "step_ms": 1000 * timer.median(),
        "step_time_s": timer.mean(),
        "step_time_median_s": timer.median(),
        "first_step_s": timer.first(),
        "train_seconds": train_seconds,
    }
    return row, history, trainer


def final_measurements(model, splits, batch_size, examples, iterations, pairs, seed):
    """At the model's current weights, in inference mode (dropout off), on the first
    `examples` training examples (the same for every run of a seed):

    * `sharpness`: lambda_max of the training-loss Hessian, by power iteration on exact
      Hessian-vector products (`tf_metaalign.algorithms.largest_hessian_eigenvalue`,
      `iterations` at most);
    * `final_grad_dot` / `final_grad_cosine`: G1.G2 and cos(G1, G2) averaged over the
      first `pairs` pairs of half batches (b1, b2) of `batch_size` examples.
    """
    import keras

    from tf_metaalign import functional as F
    from tf_metaalign.algorithms import largest_hessian_eigenvalue
    from trainers.finetune_data import fixed_batch

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss_fn = F.make_loss_fn(model, loss, training=False)
    params, state = F.current_params(model), F.current_state(model)
    x, y = fixed_batch(splits, examples)
    start = time.perf_counter()
    lam, _, done = largest_hessian_eigenvalue(
        loss_fn, params, state, (x, y), iterations=iterations, seed=seed
    )
    dots, cosines = [], []
    half = batch_size // 2
    grad = _compiled_gradient(loss_fn, params, state)
    for p in range(pairs):
        lo = p * batch_size
        if lo + batch_size > len(y):
            break
        g1 = grad(_rows(x, lo, lo + half), y[lo : lo + half])
        g2 = grad(_rows(x, lo + half, lo + batch_size), y[lo + half : lo + batch_size])
        dots.append(float(F.dot(g1, g2)))
        cosines.append(float(F.cosine(g1, g2)))
    return {
        "sharpness": float(lam),
        "sharpness_iterations": int(done),
        "final_grad_dot": sum(dots) / len(dots) if dots else None,
        "final_grad_cosine": sum(cosines) / len(cosines) if cosines else None,
        "measure_seconds": time.perf_counter() - start,
    }


def _rows(x, lo, hi):
    import keras

    return keras.tree.map_structure(lambda a: a[lo:hi], x)


def _compiled_gradient(loss_fn, params, state):
    """`(x, y) -> gradient` at `params`, compiled: `tf.function` on TensorFlow, `jax.jit`
    on JAX."""
    import keras

    from tf_metaalign import functional as F

    def grad(x, y):
        return F.value_and_grad(loss_fn, params, state, (x, y))[1]

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(grad)
    import tensorflow as tf

    return tf.function(grad, autograph=False, reduce_retracing=True)
