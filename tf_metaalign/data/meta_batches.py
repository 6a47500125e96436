"""Stacked training elements for `ReptileTrainer` / `FOMAMLTrainer` from a task sampler.

These trainers run a whole inner loop inside one train step, so one training element
holds ONE task's `k` inner batches stacked:

    x  [k, B, *input_shape]   (stack_axis=0; [B, k, *input_shape] with stack_axis=1)
    y  [k, B, *target_shape]

with k = `trainer.num_stacked` (`inner_steps` for Reptile, `inner_steps + 1` for FOMAML,
whose last batch is the query batch) and B examples per inner batch. `stacked_batches`
builds a `tf.data.Dataset` of such elements (static shapes, every element full) from a
task sampler:

* a callable `task_sampler(i) -> (x, y)`: the examples of task number i (arrays
  `[n, *input_shape]`, `[n, ...]`), e.g. keras-io's `Dataset.get_mini_dataset` without
  its batching; make it a function of `i` (e.g. `np.random.default_rng([seed, i])`) for
  a deterministic, resumable stream;
* or a `tf_metaalign.data.EpisodeSampler`: task i is task `i % T` of its batch `i // T`
  (T = `tasks_per_batch`), and its pool is that episode's SUPPORT set (`support_x`,
  `support_y`; the query set is for evaluation).

The k batches of a task are cut from passes over its pool, each pass a fresh random
permutation (seeded by `(seed, i)`): the pool shuffled, repeated and batched, as keras-io's
`dataset.shuffle(...).batch(B).repeat(k)`; when B does not divide the pool, a batch may
straddle two passes. FOMAML's query batch is the (k+1)-th batch of the same pool, as in
openai/supervised-reptile's FOMAML (the last mini-batch).

`stack_task(x, y, num_batches, batch_size, rng)` is the one-task building block (NumPy).

On JAX (or anywhere without TensorFlow), `stacked_batches(..., as_numpy=True)` gives the
same elements as NumPy arrays: an infinite generator, or a `keras.utils.PyDataset` of
`num_elements` (give `fit` `shuffle=False` to keep its order). Without TensorFlow the
tf.data route raises an ImportError naming this one.
"""

from __future__ import annotations

import numpy as np

from tf_metaalign.data._numpy_route import NumpyBatches, tensorflow_for
from tf_metaalign.data._numpy_route import generate as generate_batches
from tf_metaalign.data.splits import check_positive_int

__all__ = ["stack_task", "stacked_batches"]


def stack_task(x, y, num_batches: int, batch_size: int, rng=None, stack_axis: int = 0):
    """One task's examples `x [n, ...]`, `y [n, ...]` -> `(xs, ys)` of `num_batches`
    batches of `batch_size` examples, stacked `[k, B, ...]` (stack_axis=0) or
    `[B, k, ...]` (stack_axis=1): passes over the examples in fresh random orders
    (`rng`, a `np.random.Generator`; None: in order), concatenated and cut.

    Args:
      x: the task's examples `[n, ...]`.
      y: their targets `[n, ...]`.
      num_batches: k.
      batch_size: B.
      rng: a `np.random.Generator`, or None (in order).
      stack_axis: 0 (`[k, B, ...]`) or 1 (`[B, k, ...]`).

    Returns:
      `(xs, ys)`, numpy arrays.

    Example:
      >>> from tf_metaalign.data import stack_task
      >>> xs, ys = stack_task(np.arange(5.0)[:, None], np.arange(5), num_batches=3, batch_size=2)
      >>> xs.shape, ys.tolist()  # in order, wrapping around: 0 1 | 2 3 | 4 0
      ((3, 2, 1), [[0, 1], [2, 3], [4, 0]])
    """
    num_batches = check_positive_int(num_batches, "num_batches")
    batch_size = check_positive_int(batch_size, "batch_size")
    if stack_axis not in (0, 1) or isinstance(stack_axis, bool):
        raise ValueError(f"`stack_axis` must be 0 or 1; got {stack_axis!r}.")
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            "`x` and `y` of a task must be arrays with the same number of examples on axis "
            f"0 ([n, ...]); got shapes {x.shape} and {y.shape}."
        )
    n = x.shape[0]
    if n == 0:
        raise ValueError("A task has no examples (`x` is empty).")
    need = num_batches * batch_size
    order = []
    while len(order) < need:
        order.extend(rng.permutation(n) if rng is not None else range(n))
    order = np.asarray(order[:need])
    xs = x[order].reshape((num_batches, batch_size) + x.shape[1:])
    ys = y[order].reshape((num_batches, batch_size) + y.shape[1:])
    if stack_axis == 1:
        xs, ys = np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1)
    return xs, ys


def _task_fn(task_sampler):
    """`i -> (x, y)` for a callable or an `EpisodeSampler`."""
    from tf_metaalign.data.episodes import EpisodeSampler

    if isinstance(task_sampler, EpisodeSampler):
        tasks = task_sampler.tasks_per_batch
        cache = {}

        def episode_task(i):
            k, t = divmod(int(i), tasks)
            if k not in cache:
                cache.clear()
                (sx, sy, _), _ = task_sampler.batch(k, as_numpy=True)
                cache[k] = (sx, sy)
            sx, sy = cache[k]
            return sx[t], sy[t]

        return episode_task
    if not callable(task_sampler):
        raise ValueError(
            "`task_sampler` must be a callable `i -> (x, y)` (the examples of task i) or a "
            f"tf_metaalign.data.EpisodeSampler; got {type(task_sampler).__name__}."
        )
    return task_sampler


def stacked_batches(
    task_sampler,
    num_batches: int,
    batch_size: int,
    num_elements: int | None = None,
    stack_axis: int = 0,
    seed: int = 0,
    start: int = 0,
    as_numpy: bool = False,
):
    """A `tf.data.Dataset` of stacked elements `(x [k, B, ...], y [k, B, ...])`, one task
    per element (see the module doc).

    Args:
      task_sampler: a callable `i -> (x, y)` or an `EpisodeSampler`.
      num_batches: k, the batches stacked per element: `trainer.num_stacked`
        (`inner_steps` for ReptileTrainer, `inner_steps + 1` for FOMAMLTrainer).
      batch_size: B, examples per inner batch.
      num_elements: elements (tasks) to yield; None: infinite (use `steps_per_epoch`).
      stack_axis: 0 (`[k, B, ...]`) or 1 (`[B, k, ...]`, for several replicas); the
        trainer's `stack_axis`.
      seed: the shuffling of task i's pool depends only on `(seed, i)`.
      start: the first task index (tasks already consumed, to resume).
      as_numpy: the same elements as NumPy arrays, without TensorFlow: an infinite
        generator, or a `keras.utils.PyDataset` of `num_elements` (see the module doc).

    Every element has the static shape `[k, B, *example_shape]` (or `[B, k, ...]`),
    which the trainers check against the model's input.

    Returns:
      The `tf.data.Dataset` (with `as_numpy`, the generator or PyDataset).

    Example:
      >>> from tf_metaalign.data import stacked_batches
      >>> def task(i):  # task i: y = i * x on 10 examples
      ...     x = np.linspace(-1, 1, 10, dtype="float32")[:, None]
      ...     return x, i * x
      >>> ds = stacked_batches(task, num_batches=3, batch_size=4, num_elements=2)
      >>> [tuple(x.shape) for x, y in ds]  # for ReptileTrainer(inner_steps=3)
      [(3, 4, 1), (3, 4, 1)]
    """
    num_batches = check_positive_int(num_batches, "num_batches")
    batch_size = check_positive_int(batch_size, "batch_size")
    if num_elements is not None:
        num_elements = check_positive_int(num_elements, "num_elements")
    if stack_axis not in (0, 1) or isinstance(stack_axis, bool):
        raise ValueError(f"`stack_axis` must be 0 or 1; got {stack_axis!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"`seed` must be an integer; got {seed!r}.")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"`start` must be an integer >= 0; got {start!r}.")
    task = _task_fn(task_sampler)

    def element(i):
        x, y = task(i)
        return stack_task(
            x, y, num_batches, batch_size, np.random.default_rng([int(seed), int(i)]), stack_axis
        )

    first_x, first_y = element(start)

    def checked_element(i):
        x, y = element(i)
        if x.shape != first_x.shape or y.shape != first_y.shape:
            raise ValueError(
                f"stacked_batches: task {i} gives elements of shapes {x.shape} and "
                f"{y.shape}, task {start} gave {first_x.shape} and {first_y.shape}: "
                "every task's examples need the same shape."
            )
        return x, y

    if as_numpy:
        if num_elements is None:
            return generate_batches(checked_element, int(start))
        return NumpyBatches(checked_element, num_elements, int(start))
    tf = tensorflow_for("stacked_batches")
    spec = (
        tf.TensorSpec(first_x.shape, tf.as_dtype(first_x.dtype)),
        tf.TensorSpec(first_y.shape, tf.as_dtype(first_y.dtype)),
    )

    def generate():
        i = int(start)
        end = None if num_elements is None else start + num_elements
        while end is None or i < end:
            yield checked_element(i)
            i += 1

    ds = tf.data.Dataset.from_generator(generate, output_signature=spec)
    if num_elements is not None:
        ds = ds.apply(tf.data.experimental.assert_cardinality(num_elements))
    return ds
