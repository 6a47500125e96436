"""Multi-task batches: task sampling p_t ∝ N_t^q, deterministic and resumable streams.

Used by multi-task trainers: Sequential Reptile (one inner trajectory over batches drawn
from ALL tasks, each batch from ONE task t drawn with probability p_t ∝ N_t^q, q = 1/5 in
the paper) and the MTL baselines (PCGrad, GradVac, GradNorm) that take a mixed batch
holding examples of several tasks and need per-task losses.

The batch format
----------------
Every element of `MultiTaskStream.single_task_batches()` and `.mixed_batches()` is
`(x, y)` or `(x, y, sample_weight)` (the latter when the tasks were given with sample
weights), where::

    x = {"inputs": <the model inputs of the batch: a tensor or a nest>,
         "task_id": <int32 tensor [B]: the task index of each example, in the order of
                     `stream.task_names`>}

`model_inputs(x)` gives what a shared model (one head for all tasks) is called on, and
`task_ids(x)` the task index of each example (for per-task losses, e.g.
`tf.math.unsorted_segment_sum(per_example_loss, task_ids(x), num_tasks)`).

A model with one head per task takes the whole dict (`model_inputs(x,
model_takes_task_id=True)`): its call reads `x["inputs"]` for the shared backbone and
`x["task_id"]` to pick, for each example, the output of the head of its task.
`one_head_per_task_model(backbone, num_outputs_per_task)` builds such a Keras functional
model: all heads are one `Dense(num_tasks * max_outputs)` layer, and example i gets the
`max_outputs` columns of task `task_id[i]` (columns past a task's own number of outputs
are set to a large negative logit so that a softmax cross-entropy ignores them).

Determinism and resuming
------------------------
Batch k of a stream is a pure function of `(seed, k)` (and of the data): the task(s) of step
k come from `tf.random.stateless_categorical` (Gumbel top-k for several tasks without
replacement) seeded by `(seed, k)`, and the examples from stateless sampling without
replacement inside the task (within one batch; examples may repeat across batches). So
`single_task_batches(start=k)` (and `mixed_batches(..., start=k)`) yields exactly batches
k, k+1, ... of an uninterrupted run, whatever object or process builds the stream. To
resume a run, pass as `start` the number of batches it had consumed: a trainer's
checkpointed step count (`optimizer.iterations` when every batch is one optimizer step, or
a schedule's `count` for Sequential Reptile's inner steps) is the position to resume from.
Do not skip batches twice: if the resume mechanism itself skips the consumed batches of
the restarted epoch (Keras `BackupAndRestore` with the trainers' mid-epoch resume), give
`start` = the position of that epoch's first batch (`epoch * steps_per_epoch`) instead.

Batches have static shapes (every batch has exactly `batch_size` examples; a mixed batch
exactly `tasks_per_batch * per_task_batch_size`), so they work under `tf.function`, XLA
and `MirroredStrategy` (the global batch is split along axis 0 across replicas: see
`interleave` of `mixed_batches` to give every replica examples of every task).

On JAX (or anywhere without TensorFlow)
---------------------------------------
`single_task_batches(as_numpy=True)` and `mixed_batches(..., as_numpy=True)` are infinite
Python generators of the SAME batches as NumPy arrays (`single_task_batch(k,
as_numpy=True)` is batch k): the stateless draws are TensorFlow's, reproduced in NumPy
(Philox, `tf_metaalign.data._stateless_numpy`), so a run resumed on the other route, or
on the other backend, sees the batches of an uninterrupted one. Keras's `fit` takes the
generator on every backend (`steps_per_epoch=...`). One exception to "the same": mixed
batches that draw `tasks_per_batch` < all of 8 or more tasks rank Gumbel scores computed
with TensorFlow's vectorised float32 log, which differs from the correctly rounded one
in the last bit; the drawn tasks then differ when two scores tie to that bit (not seen
in 20,000 batches of 10 tasks; with fewer than 8 tasks the routes are bit-identical).
Without TensorFlow, the tf.data methods raise an ImportError that names this route.

The data is held in memory: `tasks` given as `tf.data.Dataset`s are materialised once
(iterated to the end) when the stream is built. All tasks must have the same structure,
dtypes and per-example shapes (pad text to one sequence length), since they share batches.
The examples are captured as constants of the input pipeline's graph, so their total size
must stay under protobuf's 2 GB (fine for text token ids and small images).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import keras
import numpy as np

from tf_metaalign import backend
from tf_metaalign.data import _stateless_numpy as rnd
from tf_metaalign.data._numpy_route import generate, tensorflow_for
from tf_metaalign.data.splits import check_positive_int

#: Sequential Reptile's (and the multilingual-BERT) default temperature: p_t ∝ N_t^(1/5).
DEFAULT_Q = 0.2

__all__ = [
    "DEFAULT_Q",
    "task_probabilities",
    "MultiTaskStream",
    "model_inputs",
    "task_ids",
    "PerTaskHead",
    "one_head_per_task_model",
]


# ----------------------------------------------------------------------------- sampling


def _check_q(q) -> float:
    if (
        isinstance(q, bool)
        or not isinstance(q, (int, float, np.integer, np.floating))
        or (not math.isfinite(float(q)))
    ):
        raise ValueError(f"`q` must be a finite number (e.g. 0.2, 0 or 1); got {q!r}.")
    return float(q)


def task_probabilities(
    sizes: Mapping[str, int],
    q: float | None = None,
    weights: Mapping[str, float] | Sequence[float] | None = None,
) -> dict[str, float]:
    """The probability of drawing each task: p_t ∝ N_t^q, or p_t ∝ weights[t].

    Args:
      sizes: task name -> number of examples N_t (an integer >= 1), in task order.
      q: the temperature exponent: 0 gives uniform, 1 proportional to size, 1/5 (the
        default when neither `q` nor `weights` is given) Sequential Reptile's choice.
      weights: task name -> positive weight (every task of `sizes`, no other), or a sequence
        in the order of `sizes`; replaces `q` (giving both is an error).

    Returns:
      task name -> probability, in the order of `sizes`, summing to 1.

    Example:
      >>> from tf_metaalign.data import task_probabilities
      >>> p = task_probabilities({"a": 100, "b": 10_000}, q=0.5)  # sqrt(100) : sqrt(10000)
      >>> {t: round(v, 4) for t, v in p.items()}
      {'a': 0.0909, 'b': 0.9091}
      >>> task_probabilities({"a": 100, "b": 10_000}, weights=[1, 3])
      {'a': 0.25, 'b': 0.75}

    References:
      Lee et al., "Sequential Reptile: Inter-Task Gradient Alignment for Multilingual
      Learning", ICLR 2022 (q = 1/5). https://arxiv.org/abs/2110.02600
    """
    if not isinstance(sizes, Mapping):
        raise ValueError(
            f"`sizes` must be a mapping task name -> number of examples; "
            f"got {type(sizes).__name__}."
        )
    if len(sizes) == 0:
        raise ValueError("`sizes` is empty: give at least one task.")
    names = list(sizes)
    n = []
    for name in names:
        size = sizes[name]
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(
                f"`sizes`[{name!r}] must be a non-negative integer number of "
                f"examples; got {size!r}."
            )
        if size == 0:
            raise ValueError(
                f"`sizes`[{name!r}]: task {name!r} has 0 examples; remove it or give it data."
            )
        n.append(float(size))
    n = np.asarray(n, np.float64)
    if weights is not None:
        if q is not None:
            raise ValueError("Give `q` or `weights`, not both: `weights` sets p_t directly.")
        if isinstance(weights, Mapping):
            unknown = [k for k in weights if k not in sizes]
            if unknown:
                raise ValueError(f"`weights` names unknown tasks {unknown}; the tasks are {names}.")
            missing = [k for k in names if k not in weights]
            if missing:
                raise ValueError(
                    f"`weights` has no weight for tasks {missing}; give one for "
                    f"every task of {names}."
                )
            w = [weights[k] for k in names]
        else:
            w = list(weights)
            if len(w) != len(names):
                raise ValueError(f"`weights` has {len(w)} entries for {len(names)} tasks {names}.")
        for name, value in zip(names, w):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.integer, np.floating))
                or not math.isfinite(float(value))
                or value <= 0
            ):
                raise ValueError(f"`weights`[{name!r}] must be a finite number > 0; got {value!r}.")
        p = np.asarray(w, np.float64)
    else:
        q = DEFAULT_Q if q is None else _check_q(q)
        # In log space: N^q of large N and q overflows no float64 before normalising.
        logp = q * np.log(n)
        p = np.exp(logp - logp.max())
    p = p / p.sum()
    return dict(zip(names, (float(v) for v in p)))


# ----------------------------------------------------------------------------- batch format


def model_inputs(x, model_takes_task_id: bool = False):
    """What the model is called on: `x["inputs"]` for a shared model, or the whole dict
    `{"inputs", "task_id"}` for a model with one head per task (`model_takes_task_id`).

    Args:
      x: a multi-task batch's `x`, `{"inputs": ..., "task_id": ...}`.
      model_takes_task_id: whether the model takes the whole dict.

    Example:
      >>> from tf_metaalign.data import model_inputs
      >>> x = {"inputs": tf.zeros([2, 3]), "task_id": tf.constant([0, 1])}
      >>> model_inputs(x).shape, sorted(model_inputs(x, model_takes_task_id=True))
      (TensorShape([2, 3]), ['inputs', 'task_id'])
    """
    _check_batch_x(x)
    return x if model_takes_task_id else x["inputs"]


def task_ids(x):
    """The int32 `[B]` task index of each example of a batch's `x`.

    Args:
      x: a multi-task batch's `x`, `{"inputs": ..., "task_id": ...}`.

    Example:
      >>> from tf_metaalign.data import task_ids
      >>> task_ids({"inputs": tf.zeros([2, 3]), "task_id": tf.constant([1, 0])}).numpy()
      array([1, 0], dtype=int32)
    """
    _check_batch_x(x)
    return x["task_id"]


def is_task_batch_x(x) -> bool:
    """Whether a batch's `x` is in the multi-task format `{"inputs", "task_id"}`."""
    return isinstance(x, Mapping) and "inputs" in x and "task_id" in x


def model_inputs_of(x, model_takes_task_id: bool = False):
    """`model_inputs` for a multi-task `x`; any other `x` (e.g. plain inputs given to
    `evaluate` / `predict`) as it is. What the multi-task trainers call the model on."""
    return model_inputs(x, model_takes_task_id) if is_task_batch_x(x) else x


def _check_batch_x(x):
    if not is_task_batch_x(x):
        raise ValueError(
            "A multi-task batch's `x` must be a dict {'inputs': ..., 'task_id': int32 [B]} "
            f"(see tf_metaalign.data.multitask); got {type(x).__name__}"
            + (f" with keys {sorted(x)}" if isinstance(x, Mapping) else "")
            + "."
        )


# ----------------------------------------------------------------------------- the stream


def _is_tf_dataset(value) -> bool:
    tf = backend.tensorflow_if_loaded()
    return tf is not None and isinstance(value, tf.data.Dataset)


def _materialise(name, dataset):
    tf = backend.tensorflow_if_loaded()
    card = int(dataset.cardinality())
    if card == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"`tasks`[{name!r}] is an infinite tf.data.Dataset; give a finite "
            "dataset of unbatched examples (it is read once into memory)."
        )
    parts = [b for b in dataset.batch(4096).as_numpy_iterator()]
    if not parts:
        raise ValueError(f"`tasks`[{name!r}]: task {name!r} has 0 examples (its dataset is empty).")
    return keras.tree.map_structure(lambda *a: np.concatenate(a, axis=0), *parts)


def _as_examples(name, value):
    """(x, y) or (x, y, sample_weight) as numpy nests with one leading example axis."""
    if _is_tf_dataset(value):
        value = _materialise(name, value)
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        raise ValueError(
            f"`tasks`[{name!r}] must be (x, y), (x, y, sample_weight) or a "
            f"tf.data.Dataset of such unbatched examples; got "
            f"{type(value).__name__}"
            + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else "")
            + "."
        )
    value = tuple(keras.tree.map_structure(np.asarray, tuple(value)))
    leaves = keras.tree.flatten(value)
    lengths = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if None in lengths or len(lengths) != 1:
        raise ValueError(
            f"`tasks`[{name!r}]: every array must have the same leading "
            f"(example) dimension; got lengths "
            f"{[leaf.shape[0] if leaf.ndim else 'scalar' for leaf in leaves]}."
        )
    (n,) = lengths
    if n == 0:
        raise ValueError(f"`tasks`[{name!r}]: task {name!r} has 0 examples.")
    return value, int(n)


class MultiTaskStream:
    """Infinite, deterministic, resumable streams of multi-task batches.

    Args:
      tasks: task name -> `(x, y)` or `(x, y, sample_weight)` (numpy arrays or nests of
        them, one row per example), or a finite `tf.data.Dataset` of such unbatched
        examples (materialised once, into memory, here). The task index of a task is its
        position in `tasks` (`self.task_names`).
      batch_size: examples per batch of `single_task_batches` (each task must have at
        least this many).
      q: p_t ∝ N_t^q (1/5 in Sequential Reptile; 0 uniform, 1 proportional). Ignored when
        `weights` is given.
      weights: task name -> positive weight: p_t ∝ weights[t] instead.
      seed: integer; batch k depends only on `(seed, k)`.

    Attributes:
      task_names: the task names, in task-index order.
      sizes: task name -> N_t.
      probabilities: task name -> p_t.
      num_tasks: the number of tasks.
      batch_size: as given.
      seed: as given.

    Example:
      >>> from tf_metaalign.data import MultiTaskStream
      >>> tasks = {
      ...     "small": (np.zeros((10, 3), "float32"), np.zeros(10, "int32")),
      ...     "large": (np.ones((1000, 3), "float32"), np.ones(1000, "int32")),
      ... }
      >>> stream = MultiTaskStream(tasks, batch_size=4, q=0.2)
      >>> {t: round(p, 3) for t, p in stream.probabilities.items()}  # 10^0.2 : 1000^0.2
      {'small': 0.285, 'large': 0.715}
      >>> x, y = next(iter(stream.mixed_batches(per_task_batch_size=2)))  # 2 from each task
      >>> x["inputs"].shape, x["task_id"].numpy().tolist(), y.numpy().tolist()
      (TensorShape([4, 3]), [0, 0, 1, 1], [0, 0, 1, 1])

    References:
      Lee et al., "Sequential Reptile: Inter-Task Gradient Alignment for Multilingual
      Learning", ICLR 2022 (the task sampling p_t ∝ N_t^(1/5)). https://arxiv.org/abs/2110.02600
    """

    def __init__(
        self,
        tasks: Mapping[str, Any],
        batch_size: int,
        q: float = DEFAULT_Q,
        weights: Mapping[str, float] | None = None,
        seed: int = 0,
    ):
        if not isinstance(tasks, Mapping):
            raise ValueError(
                "`tasks` must be a mapping task name -> (x, y) or dataset; got "
                f"{type(tasks).__name__}."
            )
        if len(tasks) == 0:
            raise ValueError("`tasks` is empty: give at least one task.")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        self.seed = int(seed)
        self.task_names = list(tasks)
        self.num_tasks = len(self.task_names)

        examples, sizes = [], {}
        for name in self.task_names:
            value, n = _as_examples(name, tasks[name])
            examples.append(value)
            sizes[name] = n
        self.sizes = sizes
        self.probabilities = task_probabilities(
            sizes, q=None if weights is not None else _check_q(q), weights=weights
        )
        self._check_fits(self.batch_size, "batch_size")

        first = self.task_names[0]
        for name, value in zip(self.task_names[1:], examples[1:]):
            try:
                keras.tree.assert_same_structure(examples[0], value)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"`tasks`[{name!r}] has another structure than `tasks`[{first!r}] (both "
                    "must be (x, y) or both (x, y, sample_weight), with the same nest of x): "
                    f"{e}"
                ) from None
            for a, b in zip(keras.tree.flatten(examples[0]), keras.tree.flatten(value)):
                if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                    raise ValueError(
                        f"`tasks`[{name!r}] has an array of per-example shape {b.shape[1:]} "
                        f"and dtype {b.dtype} where `tasks`[{first!r}] has {a.shape[1:]} "
                        f"and {a.dtype}; tasks share batches, so these must match (pad "
                        "sequences to one length)."
                    )
        # All tasks in one array per leaf; task t is rows offsets[t] : offsets[t] + N_t.
        self._data_np = keras.tree.map_structure(lambda *a: np.concatenate(a, axis=0), *examples)
        n = np.asarray([sizes[k] for k in self.task_names], np.int64)
        self._sizes_np = n
        self._offsets_np = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        self._max_size = int(n.max())
        p = np.asarray([self.probabilities[k] for k in self.task_names], np.float64)
        self._logits_np = np.log(p).astype(np.float32)
        self._tf_tables = None  # the tf.data route's constants, made on its first use

    def _tf(self, what, gives="a tf.data.Dataset"):
        """TensorFlow and the stream's data as its constants (made once), for `what`."""
        tf = tensorflow_for(what, gives)
        if self._tf_tables is None:
            self._tf_tables = (
                keras.tree.map_structure(tf.constant, self._data_np),
                tf.constant(self._sizes_np),
                tf.constant(self._offsets_np),
                tf.constant(self._logits_np)[tf.newaxis],
            )
        return tf

    @property
    def _data(self):
        return self._tf_tables[0]

    @property
    def _sizes(self):
        return self._tf_tables[1]

    @property
    def _offsets(self):
        return self._tf_tables[2]

    @property
    def _logits(self):
        return self._tf_tables[3]

    def __repr__(self):
        return (
            f"MultiTaskStream(tasks={self.sizes}, batch_size={self.batch_size}, seed={self.seed})"
        )

    def _check_fits(self, batch_size, arg_name, names=None):
        for name in names or self.task_names:
            if self.sizes[name] < batch_size:
                raise ValueError(
                    f"`{arg_name}`={batch_size} is larger than task {name!r}, which has "
                    f"{self.sizes[name]} examples (a batch samples without replacement)."
                )

    # ------------------------------------------------------------------ stateless sampling

    def _step_seeds(self, k, salt: int, num: int):
        """`num` independent stateless seeds for step `k` (an int64 scalar tensor)."""
        tf = self._tf("MultiTaskStream")
        base = tf.stack([tf.constant(self.seed, tf.int64) * 2 + salt, k])
        return tf.random.experimental.stateless_split(base, num=num)

    def _sample_examples(self, seed, tasks, per_task):
        """Row indices `[len(tasks), per_task]` of the concatenated data: for each task,
        `per_task` distinct examples uniformly at random (Gumbel top-k over its rows)."""
        tf = self._tf("MultiTaskStream")
        num = tasks.shape[0]
        sizes = tf.gather(self._sizes, tasks)  # [num]
        u = tf.random.stateless_uniform([num, self._max_size], seed=seed)
        valid = tf.range(self._max_size, dtype=tf.int64)[tf.newaxis] < sizes[:, tf.newaxis]
        u = tf.where(valid, u, -1.0)  # rows past a task's size are never chosen
        _, within = tf.math.top_k(u, k=per_task)
        return tf.cast(within, tf.int64) + tf.gather(self._offsets, tasks)[:, tf.newaxis]

    def _element(self, rows, tids):
        tf = self._tf("MultiTaskStream")
        rows = tf.reshape(rows, [-1])
        batch = tf.nest.map_structure(lambda a: tf.gather(a, rows), self._data)
        x, y, *rest = batch
        x = {"inputs": x, "task_id": tf.cast(tf.reshape(tids, [-1]), tf.int32)}
        return (x, y, *rest)

    def single_task_batch(self, k, as_numpy: bool = False):
        """Batch `k` of `single_task_batches()` (a pure function of `(seed, k)`); with
        `as_numpy`, the same batch as NumPy arrays (no TensorFlow)."""
        if as_numpy:
            return self._single_task_batch_numpy(int(k))
        tf = self._tf("MultiTaskStream.single_task_batch", "tensors")
        k = tf.cast(k, tf.int64)
        task_seed, example_seed = tf.unstack(self._step_seeds(k, salt=0, num=2))
        task = tf.random.stateless_categorical(self._logits, 1, seed=task_seed, dtype=tf.int32)[
            0
        ]  # [1]
        rows = self._sample_examples(example_seed, task, self.batch_size)
        tids = tf.fill([self.batch_size], task[0])
        return self._element(rows, tids)

    def single_task_batches(self, start: int = 0, as_numpy: bool = False):
        """Infinite dataset of batches of `batch_size` examples, each from ONE task drawn
        with probability p_t (Sequential Reptile's sampling); begins at batch `start` (to
        resume: the trainer's checkpointed step count).

        Returns a `tf.data.Dataset`; with `as_numpy`, an infinite generator of the same
        batches as NumPy arrays (no TensorFlow; see the module doc)."""
        start = _check_start(start)
        if as_numpy:
            return generate(self._single_task_batch_numpy, start)
        tf = self._tf("MultiTaskStream.single_task_batches")
        return (
            tf.data.Dataset.counter(start, dtype=tf.int64)
            .map(self.single_task_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .prefetch(tf.data.AUTOTUNE)
        )

    # ------------------------------------------------------------------ the NumPy route
    # The same draws as the TensorFlow methods above, op for op (see _stateless_numpy).

    def _sample_examples_numpy(self, seed, tasks, per_task):
        u = rnd.uniform([len(tasks), self._max_size], seed)
        valid = np.arange(self._max_size)[None] < self._sizes_np[tasks][:, None]
        u = np.where(valid, u, np.float32(-1.0))
        within = rnd.top_k_indices(u, per_task).astype(np.int64)
        return within + self._offsets_np[tasks][:, None]

    def _element_numpy(self, rows, tids):
        rows = rows.reshape(-1)
        x, y, *rest = keras.tree.map_structure(lambda a: a[rows], self._data_np)
        return ({"inputs": x, "task_id": tids.reshape(-1).astype(np.int32)}, y, *rest)

    def _single_task_batch_numpy(self, k):
        task_seed, example_seed = rnd.split(rnd.seed_pair(self.seed, 0, k), 2)
        task = rnd.categorical(self._logits_np, task_seed)
        rows = self._sample_examples_numpy(example_seed, np.asarray([task]), self.batch_size)
        return self._element_numpy(rows, np.full([self.batch_size], task, np.int32))

    def _mixed_batch_numpy(self, k, tasks_per_batch, per_task_batch_size, interleave):
        task_seed, example_seed = rnd.split(rnd.seed_pair(self.seed, 1, k), 2)
        if tasks_per_batch == self.num_tasks:
            tasks = np.arange(self.num_tasks, dtype=np.int32)
        else:
            u = rnd.uniform([self.num_tasks], task_seed)
            u = u * (np.float32(1.0) - np.float32(1e-20)) + np.float32(1e-20)
            tasks = np.sort(rnd.top_k_indices(self._logits_np + rnd.gumbel(u), tasks_per_batch))
        rows = self._sample_examples_numpy(example_seed, tasks, per_task_batch_size)
        tids = np.broadcast_to(tasks[:, None], (tasks_per_batch, per_task_batch_size))
        if interleave:
            rows, tids = rows.T, tids.T
        return self._element_numpy(rows, tids)

    def _check_mixed(self, tasks_per_batch, per_task_batch_size):
        per_task_batch_size = check_positive_int(per_task_batch_size, "per_task_batch_size")
        if tasks_per_batch is None:
            tasks_per_batch = self.num_tasks
        tasks_per_batch = check_positive_int(tasks_per_batch, "tasks_per_batch")
        if tasks_per_batch > self.num_tasks:
            raise ValueError(
                f"`tasks_per_batch`={tasks_per_batch} is larger than the number "
                f"of tasks ({self.num_tasks})."
            )
        # Any task may be drawn; with every task, every task is.
        self._check_fits(per_task_batch_size, "per_task_batch_size")
        return tasks_per_batch, per_task_batch_size

    def mixed_batch(
        self,
        k,
        tasks_per_batch: int | None = None,
        per_task_batch_size: int | None = None,
        interleave: bool = False,
        as_numpy: bool = False,
    ):
        """Batch `k` of `mixed_batches(...)` (a pure function of `(seed, k)`); with
        `as_numpy`, the same batch as NumPy arrays (no TensorFlow)."""
        if per_task_batch_size is None:
            per_task_batch_size = self.batch_size
        tasks_per_batch, per_task_batch_size = self._check_mixed(
            tasks_per_batch, per_task_batch_size
        )
        if as_numpy:
            return self._mixed_batch_numpy(int(k), tasks_per_batch, per_task_batch_size, interleave)
        tf = self._tf("MultiTaskStream.mixed_batch", "tensors")
        k = tf.cast(k, tf.int64)
        task_seed, example_seed = tf.unstack(self._step_seeds(k, salt=1, num=2))
        if tasks_per_batch == self.num_tasks:
            tasks = tf.range(self.num_tasks, dtype=tf.int32)
        else:
            # Gumbel top-k: tasks_per_batch tasks drawn with p_t without replacement.
            u = tf.random.stateless_uniform(
                [self.num_tasks], seed=task_seed, minval=1e-20, maxval=1.0
            )
            gumbel = -tf.math.log(-tf.math.log(u))
            _, tasks = tf.math.top_k(self._logits[0] + gumbel, k=tasks_per_batch)
            tasks = tf.sort(tasks)
        rows = self._sample_examples(example_seed, tasks, per_task_batch_size)
        tids = tf.broadcast_to(tasks[:, tf.newaxis], [tasks_per_batch, per_task_batch_size])
        if interleave:
            rows, tids = tf.transpose(rows), tf.transpose(tids)
        return self._element(rows, tids)

    def mixed_batches(
        self,
        tasks_per_batch: int | None = None,
        per_task_batch_size: int | None = None,
        interleave: bool = False,
        start: int = 0,
        as_numpy: bool = False,
    ):
        """Infinite dataset of mixed batches: `per_task_batch_size` (default `batch_size`)
        examples of each of `tasks_per_batch` tasks (default all; fewer are drawn with p_t
        without replacement), `tasks_per_batch * per_task_batch_size` examples in all.

        Layout: task-major (all examples of the lowest chosen task index first), or with
        `interleave=True` example-major (`[e0 of t_a, e0 of t_b, ..., e1 of t_a, ...]`), so
        that a split of the batch into R equal replica shards gives every replica
        `per_task_batch_size / R` examples of every task when R divides it. `task_id` is
        authoritative either way. Begins at batch `start` (the trainer's step count).

        Returns a `tf.data.Dataset`; with `as_numpy`, an infinite generator of the same
        batches as NumPy arrays (no TensorFlow; see the module doc).
        """
        if per_task_batch_size is None:
            per_task_batch_size = self.batch_size
        tasks_per_batch, per_task_batch_size = self._check_mixed(
            tasks_per_batch, per_task_batch_size
        )
        start = _check_start(start)
        if as_numpy:
            return generate(
                lambda k: self._mixed_batch_numpy(
                    k, tasks_per_batch, per_task_batch_size, interleave
                ),
                start,
            )
        tf = self._tf("MultiTaskStream.mixed_batches")

        def fn(k):
            return self.mixed_batch(k, tasks_per_batch, per_task_batch_size, interleave)

        return (
            tf.data.Dataset.counter(start, dtype=tf.int64)
            .map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .prefetch(tf.data.AUTOTUNE)
        )


def _check_start(start) -> int:
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(
            f"`start` must be an integer >= 0 (the number of batches already "
            f"consumed); got {start!r}."
        )
    return int(start)


# ----------------------------------------------------------------------------- per-task heads


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PerTaskHead(keras.layers.Layer):
    """One dense head per task; example i gets the output of the head of `task_id[i]`.

    Called on `(features [B, D], task_id int [B])`, returns `[B, max(num_outputs)]`: all
    heads are one `Dense(num_tasks * max_outputs)` (cheap for small heads), and the row of
    each example's task is gathered. Columns past a task's own number of outputs hold
    `masked_logit` (a large negative logit), so that a softmax cross-entropy over the
    columns ignores them (labels of task t must lie in `[0, num_outputs[t])`).

    Args:
      num_outputs_per_task: one number of outputs per task, in task order.
      masked_logit: the value of the columns past a task's outputs (None: the default
        large negative logit).
      **kwargs: other `keras.layers.Layer` arguments.

    Example:
      >>> from tf_metaalign.data import PerTaskHead
      >>> head = PerTaskHead([2, 3], masked_logit=-1e9)
      >>> logits = head((tf.ones([2, 4]), tf.constant([0, 1])))
      >>> logits.shape, logits.numpy()[0, 2]  # task 0 has 2 outputs: its third is masked
      (TensorShape([2, 3]), np.float32(-1e+09))
    """

    def __init__(
        self, num_outputs_per_task: Sequence[int], masked_logit: float | None = None, **kwargs
    ):
        super().__init__(**kwargs)
        self.num_outputs_per_task = [
            check_positive_int(n, "num_outputs_per_task") for n in num_outputs_per_task
        ]
        if not self.num_outputs_per_task:
            raise ValueError("`num_outputs_per_task` is empty: give one number per task.")
        self.masked_logit = masked_logit
        self.num_tasks = len(self.num_outputs_per_task)
        self.max_outputs = max(self.num_outputs_per_task)

    def build(self, input_shape):
        features_shape = input_shape[0]
        dim = features_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(dim, self.num_tasks * self.max_outputs),
            initializer="glorot_uniform",
        )
        self.bias = self.add_weight(
            name="bias", shape=(self.num_tasks * self.max_outputs,), initializer="zeros"
        )

    def call(self, inputs):
        features, task_id = inputs
        ops = keras.ops
        task_id = ops.cast(ops.reshape(task_id, (-1,)), "int32")
        out = ops.matmul(features, ops.cast(self.kernel, features.dtype)) + ops.cast(
            self.bias, features.dtype
        )
        out = ops.reshape(out, (-1, self.num_tasks, self.max_outputs))
        out = ops.take_along_axis(out, task_id[:, None, None], axis=1)[:, 0]  # [B, M]
        if min(self.num_outputs_per_task) < self.max_outputs:
            n = ops.take(ops.convert_to_tensor(self.num_outputs_per_task, "int32"), task_id)
            valid = ops.arange(self.max_outputs, dtype="int32")[None, :] < n[:, None]
            masked = self.masked_logit
            if masked is None:
                masked = (
                    -3.0e4 if keras.backend.standardize_dtype(out.dtype) == "float16" else -1.0e9
                )
            out = ops.where(valid, out, ops.cast(masked, out.dtype))
        return out

    def compute_output_shape(self, input_shape):
        return (input_shape[0][0], self.max_outputs)

    def get_config(self):
        return {
            **super().get_config(),
            "num_outputs_per_task": self.num_outputs_per_task,
            "masked_logit": self.masked_logit,
        }


def one_head_per_task_model(backbone: keras.Model, num_outputs_per_task, name=None) -> keras.Model:
    """A functional model called on the batch's whole `x` dict `{"inputs", "task_id"}`.

    Args:
      backbone: a built Keras model `inputs -> features [B, D]` (its `inputs` define the
        model's `x["inputs"]`).
      num_outputs_per_task: one number of outputs per task, in task order (a sequence, or a
        mapping task name -> number, e.g. ordered like `stream.task_names`).

      name: the model's name.

    Returns:
      `keras.Model` mapping `{"inputs": ..., "task_id": int32 [B]}` to `[B, max outputs]`
      (see `PerTaskHead`). Train it on batches with `model_takes_task_id=True`, i.e. on the
      dict as the stream yields it.

    Example:
      >>> from tf_metaalign.data import one_head_per_task_model
      >>> backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8)])
      >>> model = one_head_per_task_model(backbone, {"sst2": 2, "mnli": 3})
      >>> model({"inputs": tf.zeros([4, 3]), "task_id": tf.constant([0, 1, 1, 0])}).shape
      TensorShape([4, 3])
    """
    if isinstance(num_outputs_per_task, Mapping):
        num_outputs_per_task = list(num_outputs_per_task.values())
    if len(backbone.inputs) == 1:  # a fresh Input named like its key in the dict
        spec = backbone.inputs[0]
        inputs = keras.Input(batch_shape=spec.shape, dtype=spec.dtype, name="inputs")
    else:
        inputs = backbone.input
    x = {"inputs": inputs, "task_id": keras.Input(shape=(), dtype="int32", name="task_id")}
    features = backbone(x["inputs"])
    out = PerTaskHead(num_outputs_per_task, name="per_task_head")([features, x["task_id"]])
    return keras.Model(x, out, name=name or "one_head_per_task")
