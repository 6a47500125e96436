"""N-way K-shot episodes for few-shot meta-learning, deterministic and resumable.

The episode batch format
------------------------
Every element of `EpisodeSampler.dataset()` (and `batch(k)`) is::

    ((support_x, support_y, query_x), query_y)

with a leading TASK dimension T (`tasks_per_batch`) on every tensor:

    support_x  [T, N*K, ...]   the K "shots" of each of the N "ways" (classes)
    support_y  [T, N*K] int32  episode labels in 0..N-1
    query_x    [T, N*Q, ...]   Q further examples of each of the same N classes
    query_y    [T, N*Q] int32  their episode labels

so `model.fit(sampler.dataset(), steps_per_epoch=...)` gives a meta-learning trainer one
meta-batch of T tasks per step, with `x = (support_x, support_y, query_x)` and
`y = query_y`.

Within one task:

* the N classes are drawn uniformly at random WITHOUT replacement from all classes, and
  relabelled in a random order: episode label j is the j-th drawn class (a uniformly random
  permutation of the drawn set), so a class has no fixed label across episodes;
* for each drawn class, K + Q distinct examples are drawn uniformly at random without
  replacement: the first K go to the support set, the other Q to the query set (support
  and query never share an example);
* the layout is class-major: `support_y = [0]*K + [1]*K + ... + [N-1]*K` and
  `query_y = [0]*Q + ... + [N-1]*Q`, unless `shuffle=True`, which permutes the support
  set and the query set (each on its own, labels with their examples) at random.

The T tasks of a batch are drawn independently (two tasks of one batch may share
classes).

Determinism and resuming
------------------------
As in `tf_metaalign.data.multitask.MultiTaskStream`, batch k is a pure function of
`(seed, k)` and the data: the classes and examples of step k come from stateless random
ops (`tf.random.stateless_uniform` + top-k, i.e. Gumbel-style sampling without
replacement) seeded by `(seed, k)`. `dataset(start=k)` yields exactly batches k, k+1, ...
of an uninterrupted run, in any process; to resume a run, pass the number of batches it
had consumed (the trainer's checkpointed step count) as `start` (and not twice: see the
notes in `tf_metaalign.data.multitask` about `BackupAndRestore`).

`evaluation_dataset(num_batches)` is a FIXED, finite set of episodes (the same every time
it is built, for a seed), drawn from another stream than the training batches (another
salt), so it can be used for validation/test episodes of a held-out class split.

The data lives in memory and is captured by the input pipeline's graph (keep it under
protobuf's 2 GB: Omniglot at 28x28 float32 with all 4 rotations is ~400 MB).

On JAX (or anywhere without TensorFlow)
---------------------------------------
`batch(k, as_numpy=True)`, `dataset(..., as_numpy=True)` (an infinite generator, or a
`keras.utils.PyDataset` of `num_batches`), `numpy_batches(...)` and
`evaluation_dataset(..., as_numpy=True)` (a PyDataset) give the SAME batches as NumPy
arrays, bit for bit: TensorFlow's stateless draws are reproduced in NumPy
(`tf_metaalign.data._stateless_numpy`). Keras's `fit` takes them on every backend (give a
finite PyDataset `shuffle=False` to keep its order). Without TensorFlow the tf.data
methods raise an ImportError naming this route.

Confidence intervals
--------------------
`mean_confidence_interval(values, confidence=0.95)` is the Student-t interval of a mean
(e.g. of per-episode or per-run accuracies), the usual "mean ± 95% CI" of few-shot papers.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from tf_metaalign import backend
from tf_metaalign.data import _stateless_numpy as rnd
from tf_metaalign.data._numpy_route import NumpyBatches, generate, tensorflow_for
from tf_metaalign.data.multitask import _check_start, _is_tf_dataset
from tf_metaalign.data.splits import check_positive_int

__all__ = ["EpisodeSampler", "mean_confidence_interval", "student_t_ppf"]


# ----------------------------------------------------------------------------- the CI helper


def student_t_ppf(p: float, df: float) -> float:
    """The quantile function of Student's t distribution with `df` degrees of freedom.

    Computed from the regularised incomplete beta function (`betainc`, float64) by
    bisection to ~1e-13, so that neither scipy nor TensorFlow is needed; equals
    `scipy.stats.t.ppf`.
    """
    p, df = float(p), float(df)
    if not (0.0 < p < 1.0):
        raise ValueError(f"`p` must be strictly between 0 and 1; got {p!r}.")
    if not (df > 0 and math.isfinite(df)):
        raise ValueError(f"`df` must be a finite number > 0; got {df!r}.")
    if p == 0.5:
        return 0.0
    upper = max(p, 1.0 - p)  # solve for the upper tail, then mirror

    def cdf(t):  # for t >= 0
        x = df / (df + t * t)
        return 1.0 - 0.5 * _betainc(df / 2, 0.5, x)

    lo, hi = 0.0, 1.0
    while cdf(hi) < upper:
        hi *= 2.0
        if hi > 1e12:
            break
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < upper:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    t = 0.5 * (lo + hi)
    return t if p > 0.5 else -t


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (a, b > 0, 0 <= x <= 1), in
    float64: the continued fraction of Numerical Recipes (3rd ed., 6.4), evaluated by
    Lentz's method to machine precision. Agrees with `tf.math.betainc` to ~1e-15."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _betacf(a, b, x):
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h


def mean_confidence_interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """The mean of `values` and the half-width of its Student-t confidence interval.

    `half_width = t_{(1 + confidence)/2, n-1} * s / sqrt(n)` with `s` the sample standard
    deviation (ddof=1) of the n values: the interval is `mean ± half_width` (what few-shot
    papers report as "accuracy ± 95% CI" over test episodes or over Lake's 20 runs).

    Args:
      values: a 1-D sequence of numbers (e.g. per-episode accuracies), at least one.
      confidence: the coverage, strictly between 0 and 1 (0.95 by default).

    Returns:
      `(mean, half_width)` as Python floats; `half_width` is nan for a single value
      (no spread can be estimated) and 0 when all values are equal.

    Example:
      >>> from tf_metaalign.data import mean_confidence_interval
      >>> mean, half_width = mean_confidence_interval([0.9, 0.95, 1.0, 0.85])
      >>> round(mean, 4), round(half_width, 4)  # t_{0.975, 3} = 3.182, s / sqrt(4) = 0.0323
      (0.925, 0.1027)
    """
    if (
        isinstance(confidence, bool)
        or not isinstance(confidence, (int, float, np.floating))
        or not (0.0 < float(confidence) < 1.0)
    ):
        raise ValueError(
            f"`confidence` must be a number strictly between 0 and 1; got {confidence!r}."
        )
    v = np.asarray(values, np.float64)
    if v.ndim != 1:
        raise ValueError(f"`values` must be 1-D; got shape {v.shape}.")
    if v.size == 0:
        raise ValueError("`values` is empty: give at least one value.")
    if not np.all(np.isfinite(v)):
        raise ValueError("`values` has non-finite entries.")
    mean = float(v.mean())
    n = v.size
    if n == 1:
        return mean, float("nan")
    sem = float(v.std(ddof=1)) / math.sqrt(n)
    if sem == 0.0:
        return mean, 0.0
    return mean, student_t_ppf(0.5 + float(confidence) / 2.0, n - 1) * sem


# ----------------------------------------------------------------------------- the sampler


def _as_class_arrays(classes) -> tuple[list[str], list[np.ndarray]]:
    if isinstance(classes, Mapping):
        names = [str(k) for k in classes]
        arrays = list(classes.values())
    elif isinstance(classes, (list, tuple)):
        names = [str(i) for i in range(len(classes))]
        arrays = list(classes)
    else:
        raise ValueError(
            "`classes` must be a mapping class name -> array [n_examples, ...] or a list of "
            f"such arrays (one per class); got {type(classes).__name__}. For (x, y) arrays "
            "or a labelled tf.data.Dataset use EpisodeSampler.from_labelled(x, y, ...)."
        )
    if not arrays:
        raise ValueError("`classes` is empty: give at least one class.")
    out = []
    for name, a in zip(names, arrays):
        a = np.asarray(a)
        if a.ndim == 0:
            raise ValueError(
                f"`classes`[{name!r}] must be an array with a leading example axis; got a scalar."
            )
        if a.shape[0] == 0:
            raise ValueError(f"`classes`[{name!r}]: class {name!r} has 0 examples.")
        out.append(a)
    first = out[0]
    for name, a in zip(names[1:], out[1:]):
        if a.shape[1:] != first.shape[1:] or a.dtype != first.dtype:
            raise ValueError(
                f"`classes`[{name!r}] has examples of shape {a.shape[1:]} and dtype {a.dtype} "
                f"where `classes`[{names[0]!r}] has {first.shape[1:]} and {first.dtype}; all "
                "classes share episodes, so these must match."
            )
    return names, out


class EpisodeSampler:
    """Infinite, deterministic, resumable N-way K-shot episode batches (see module doc).

    Args:
      classes: class name -> array `[n_c, ...]` of that class's examples (e.g. what
        `tf_metaalign.data.omniglot.load_omniglot` / `split_classes` return), or a list of
        such arrays (class names "0", "1", ...). Classes may have different numbers of
        examples; all need the same per-example shape and dtype. For `(x, y)` arrays or a
        labelled `tf.data.Dataset` use `EpisodeSampler.from_labelled`.
      ways: N, classes per episode (<= the number of classes).
      shots: K, support examples per class.
      queries: Q, query examples per class (every class needs >= K + Q examples).
      tasks_per_batch: T, episodes per batch (the leading task dimension).
      seed: integer; batch k depends only on `(seed, k)`.
      shuffle: permute the support and the query examples within each episode (default:
        class-major order).

    Attributes:
      class_names: the class names, in class order.
      class_sizes: np.ndarray of the number of examples of each class.
      num_classes: the number of classes.
      element_spec: the `tf.TypeSpec`s of a batch.
      ways, shots, queries, tasks_per_batch, seed, shuffle: the arguments, as given.

    Example:
      >>> from tf_metaalign.data import EpisodeSampler
      >>> classes = {f"c{i}": np.full((6, 2), i, "float32") for i in range(5)}
      >>> sampler = EpisodeSampler(classes, ways=3, shots=1, queries=2, tasks_per_batch=4)
      >>> (support_x, support_y, query_x), query_y = sampler.batch(0)
      >>> support_x.shape, query_x.shape, support_y.numpy()[0].tolist()
      (TensorShape([4, 3, 2]), TensorShape([4, 6, 2]), [0, 1, 2])
      >>> bool(tf.reduce_all(sampler.batch(7)[1] == sampler.batch(7)[1]))  # a function of (seed, k)
      True

    References:
      Vinyals et al., "Matching Networks for One Shot Learning", NeurIPS 2016 (the N-way
      K-shot episodes). https://arxiv.org/abs/1606.04080
    """

    def __init__(
        self,
        classes,
        ways: int,
        shots: int,
        queries: int,
        tasks_per_batch: int = 1,
        seed: int = 0,
        shuffle: bool = False,
    ):
        self.ways = check_positive_int(ways, "ways")
        self.shots = check_positive_int(shots, "shots")
        self.queries = check_positive_int(queries, "queries")
        self.tasks_per_batch = check_positive_int(tasks_per_batch, "tasks_per_batch")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        names, arrays = _as_class_arrays(classes)
        self.class_names = names
        self.num_classes = len(names)
        self.class_sizes = np.asarray([a.shape[0] for a in arrays], np.int64)
        if self.ways > self.num_classes:
            raise ValueError(
                f"`ways`={self.ways} is larger than the number of classes "
                f"({self.num_classes}); an episode needs `ways` distinct classes."
            )
        need = self.shots + self.queries
        small = [(n, int(s)) for n, s in zip(names, self.class_sizes) if s < need]
        if small:
            listed = ", ".join(f"{n!r} ({s})" for n, s in small[:5])
            more = f" and {len(small) - 5} more" if len(small) > 5 else ""
            raise ValueError(
                f"`shots` + `queries` = {self.shots} + {self.queries} = {need} is larger than "
                f"the number of examples of {len(small)} class(es): {listed}{more}; every "
                "class of an episode needs shots + queries distinct examples (lower `shots` "
                "or `queries`, or drop those classes)."
            )
        self._example_shape = arrays[0].shape[1:]
        self._dtype = arrays[0].dtype
        self._data_np = np.concatenate(arrays, axis=0)
        self._offsets_np = np.concatenate([[0], np.cumsum(self.class_sizes)[:-1]]).astype(np.int64)
        self._max_size = int(self.class_sizes.max())
        self._tf_tables = None  # the tf.data route's constants, made on its first use

    def _tf(self, what, gives="a tf.data.Dataset"):
        """TensorFlow and the sampler's data as its constants (made once), for `what`."""
        tf = tensorflow_for(what, gives)
        if self._tf_tables is None:
            self._tf_tables = (
                tf.constant(self._data_np),
                tf.constant(self.class_sizes),
                tf.constant(self._offsets_np),
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

    @classmethod
    def from_labelled(
        cls,
        x,
        y=None,
        *,
        ways: int,
        shots: int,
        queries: int,
        tasks_per_batch: int = 1,
        seed: int = 0,
        shuffle: bool = False,
    ) -> "EpisodeSampler":
        """A sampler over the classes of labelled examples.

        The classes are the sorted distinct labels (`class_names` are their string forms).

        Args:
          x: an array `[n, ...]`, or a finite `tf.data.Dataset` of unbatched `(x, y)` pairs.
          y: an array `[n]` (integer or string labels), or None with a dataset `x`.
          ways: as for `EpisodeSampler`.
          shots: as for `EpisodeSampler`.
          queries: as for `EpisodeSampler`.
          tasks_per_batch: as for `EpisodeSampler`.
          seed: as for `EpisodeSampler`.
          shuffle: as for `EpisodeSampler`.
        """
        if _is_tf_dataset(x):
            tf = backend.tensorflow_if_loaded()
            if y is not None:
                raise ValueError(
                    "Give `y` only with array `x`: a tf.data.Dataset `x` holds (x, y) pairs."
                )
            card = int(x.cardinality())
            if card == tf.data.INFINITE_CARDINALITY:
                raise ValueError(
                    "`x` is an infinite tf.data.Dataset; give a finite dataset "
                    "of unbatched (x, y) examples (it is read into memory)."
                )
            parts = list(x.batch(4096).as_numpy_iterator())
            if not parts:
                raise ValueError("`x`: the dataset is empty.")
            if not all(isinstance(p, tuple) and len(p) == 2 for p in parts):
                raise ValueError("`x`: the dataset's elements must be (x, y) pairs.")
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
        if y is None:
            raise ValueError("`y` is missing: give labels for `x`.")
        x, y = np.asarray(x), np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"`y` must be 1-D (one label per example); got shape {y.shape}.")
        if x.ndim == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"`x` and `y` must have the same number of examples; got "
                f"{x.shape[0] if x.ndim else 'a scalar'} and {y.shape[0]}."
            )
        if y.size == 0:
            raise ValueError("`x`, `y` are empty.")
        labels, inverse = np.unique(y, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        counts = np.bincount(inverse, minlength=len(labels))
        groups = np.split(x[order], np.cumsum(counts)[:-1])
        classes = {
            str(lab.item() if hasattr(lab, "item") else lab): g for lab, g in zip(labels, groups)
        }
        if len(classes) != len(labels):
            raise ValueError("`y` has labels with equal string forms; use integer labels.")
        return cls(
            classes,
            ways=ways,
            shots=shots,
            queries=queries,
            tasks_per_batch=tasks_per_batch,
            seed=seed,
            shuffle=shuffle,
        )

    def __repr__(self):
        return (
            f"EpisodeSampler(num_classes={self.num_classes}, ways={self.ways}, "
            f"shots={self.shots}, queries={self.queries}, "
            f"tasks_per_batch={self.tasks_per_batch}, seed={self.seed})"
        )

    # ------------------------------------------------------------------ sampling

    @property
    def element_spec(self):
        """The `tf.TensorSpec`s of a batch (with `tasks_per_batch` tasks)."""
        return self._spec(self.tasks_per_batch)

    def _spec(self, t):
        tf = tensorflow_for("EpisodeSampler.element_spec", "tf.TensorSpecs")
        n, k, q = self.ways, self.shots, self.queries
        dt = tf.as_dtype(self._dtype)
        return (
            (
                tf.TensorSpec([t, n * k, *self._example_shape], dt),
                tf.TensorSpec([t, n * k], tf.int32),
                tf.TensorSpec([t, n * q, *self._example_shape], dt),
            ),
            tf.TensorSpec([t, n * q], tf.int32),
        )

    def _step_seeds(self, seed, k, salt: int, num: int):
        tf = self._tf("EpisodeSampler")
        base = tf.stack([tf.constant(seed, tf.int64) * 2 + salt, k])
        return tf.random.experimental.stateless_split(base, num=num)

    def episode_indices(
        self,
        k,
        salt: int = 0,
        seed: int | None = None,
        tasks_per_batch: int | None = None,
        as_numpy: bool = False,
    ):
        """Which examples batch `k` holds, as int64 tensors:
        `(classes [T, N], support_rows [T, N*K], query_rows [T, N*Q],
        support_y [T, N*K], query_y [T, N*Q])`, where `classes[t, j]` is the class (index
        into `class_names`) of episode label j of task t, and a row r is example
        `r - offset[c]` of class c (rows index all classes' examples concatenated in
        `class_names` order). For tests and analyses; `batch(k)` gathers these rows.
        With `as_numpy`, the same indices as NumPy arrays (no TensorFlow)."""
        t = self.tasks_per_batch if tasks_per_batch is None else tasks_per_batch
        n, kk, q = self.ways, self.shots, self.queries
        seed = self.seed if seed is None else seed
        if as_numpy:
            return self._episode_indices_numpy(int(k), salt, seed, t)
        tf = self._tf("EpisodeSampler.episode_indices", "tensors")
        k = tf.cast(k, tf.int64)
        s_cls, s_ex, s_sup, s_qry = tf.unstack(self._step_seeds(seed, k, salt, 4))
        # N distinct classes per task, in a uniformly random order (= the episode labels).
        u = tf.random.stateless_uniform([t, self.num_classes], seed=s_cls)
        _, classes = tf.math.top_k(u, k=n)  # [T, N] int32
        # K + Q distinct examples of each drawn class.
        sizes = tf.gather(self._sizes, classes)  # [T, N]
        u = tf.random.stateless_uniform([t, n, self._max_size], seed=s_ex)
        valid = tf.range(self._max_size, dtype=tf.int64) < sizes[..., tf.newaxis]
        u = tf.where(valid, u, -1.0)  # rows past a class's size are never chosen
        _, within = tf.math.top_k(u, k=kk + q)  # [T, N, K+Q]
        rows = tf.cast(within, tf.int64) + tf.gather(self._offsets, classes)[..., tf.newaxis]
        labels = tf.broadcast_to(tf.range(n, dtype=tf.int32)[:, tf.newaxis], [t, n, kk + q])
        support_rows = tf.reshape(rows[:, :, :kk], [t, n * kk])
        query_rows = tf.reshape(rows[:, :, kk:], [t, n * q])
        support_y = tf.reshape(labels[:, :, :kk], [t, n * kk])
        query_y = tf.reshape(labels[:, :, kk:], [t, n * q])
        if self.shuffle:
            perm = tf.argsort(tf.random.stateless_uniform([t, n * kk], seed=s_sup), axis=1)
            support_rows = tf.gather(support_rows, perm, batch_dims=1)
            support_y = tf.gather(support_y, perm, batch_dims=1)
            perm = tf.argsort(tf.random.stateless_uniform([t, n * q], seed=s_qry), axis=1)
            query_rows = tf.gather(query_rows, perm, batch_dims=1)
            query_y = tf.gather(query_y, perm, batch_dims=1)
        return classes, support_rows, query_rows, support_y, query_y

    def _episode_indices_numpy(self, k, salt, seed, t):
        """`episode_indices` in NumPy: the same draws, op for op (see _stateless_numpy)."""
        n, kk, q = self.ways, self.shots, self.queries
        s_cls, s_ex, s_sup, s_qry = rnd.split(rnd.seed_pair(seed, salt, k), 4)
        classes = rnd.top_k_indices(rnd.uniform([t, self.num_classes], s_cls), n)
        sizes = self.class_sizes[classes]
        u = rnd.uniform([t, n, self._max_size], s_ex)
        u = np.where(np.arange(self._max_size) < sizes[..., None], u, np.float32(-1.0))
        within = rnd.top_k_indices(u, kk + q).astype(np.int64)
        rows = within + self._offsets_np[classes][..., None]
        labels = np.broadcast_to(np.arange(n, dtype=np.int32)[:, None], (t, n, kk + q))
        support_rows = rows[:, :, :kk].reshape(t, n * kk)
        query_rows = rows[:, :, kk:].reshape(t, n * q)
        support_y = labels[:, :, :kk].reshape(t, n * kk)
        query_y = labels[:, :, kk:].reshape(t, n * q)
        if self.shuffle:
            perm = rnd.argsort(rnd.uniform([t, n * kk], s_sup))
            support_rows = np.take_along_axis(support_rows, perm, 1)
            support_y = np.take_along_axis(support_y, perm, 1)
            perm = rnd.argsort(rnd.uniform([t, n * q], s_qry))
            query_rows = np.take_along_axis(query_rows, perm, 1)
            query_y = np.take_along_axis(query_y, perm, 1)
        return classes, support_rows, query_rows, support_y, query_y

    def _make_batch(self, k, salt=0, seed=None, tasks_per_batch=None):
        _, s_rows, q_rows, s_y, q_y = self.episode_indices(k, salt, seed, tasks_per_batch)
        tf = self._tf("EpisodeSampler.batch")
        return ((tf.gather(self._data, s_rows), s_y, tf.gather(self._data, q_rows)), q_y)

    def _make_batch_numpy(self, k, salt=0, seed=None, tasks_per_batch=None):
        _, s_rows, q_rows, s_y, q_y = self.episode_indices(
            k, salt, seed, tasks_per_batch, as_numpy=True
        )
        return ((self._data_np[s_rows], s_y, self._data_np[q_rows]), q_y)

    def batch(self, k, as_numpy: bool = False):
        """Batch `k` of `dataset()` (a pure function of `(seed, k)`), as tensors
        `((support_x, support_y, query_x), query_y)`; with `as_numpy`, the same batch as
        NumPy arrays (no TensorFlow)."""
        if as_numpy:
            return self._make_batch_numpy(int(k))
        self._tf("EpisodeSampler.batch", "tensors")
        return self._make_batch(k)

    def dataset(self, start: int = 0, num_batches: int | None = None, as_numpy: bool = False):
        """Batches `start, start + 1, ...` (infinite, or `num_batches` of them) of
        `((support_x, support_y, query_x), query_y)`; `start` = batches already consumed.

        Returns a `tf.data.Dataset`; with `as_numpy`, the same batches as NumPy arrays: an
        infinite generator, or a `keras.utils.PyDataset` of `num_batches` (no TensorFlow;
        see the module doc)."""
        start = _check_start(start)
        if as_numpy:
            if num_batches is None:
                return generate(self._make_batch_numpy, start)
            return NumpyBatches(
                self._make_batch_numpy, check_positive_int(num_batches, "num_batches"), start
            )
        tf = self._tf("EpisodeSampler.dataset")
        ds = tf.data.Dataset.counter(start, dtype=tf.int64)
        if num_batches is not None:
            ds = ds.take(check_positive_int(num_batches, "num_batches"))
        return ds.map(
            self._make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        ).prefetch(tf.data.AUTOTUNE)

    def numpy_batches(self, start: int = 0, num_batches: int | None = None):
        """`dataset(start, num_batches)` as an iterator of numpy nests (no TensorFlow)."""
        return iter(self.dataset(start, num_batches, as_numpy=True))

    def evaluation_dataset(
        self,
        num_batches: int,
        seed: int | None = None,
        tasks_per_batch: int | None = None,
        as_numpy: bool = False,
    ):
        """A fixed, finite dataset of `num_batches` batches of episodes, the same each time
        for a `seed` (default: the sampler's), and not the training stream's batches.

        `tasks_per_batch` (default the sampler's) sets T of these batches, e.g. 1 for an
        evaluation that adapts to one task at a time. Built from the sampler's classes:
        make a sampler over the held-out (validation / test) classes for evaluation.

        Returns a `tf.data.Dataset`; with `as_numpy`, a `keras.utils.PyDataset` of the same
        batches as NumPy arrays (no TensorFlow).
        """
        num_batches = check_positive_int(num_batches, "num_batches")
        t = (
            self.tasks_per_batch
            if tasks_per_batch is None
            else check_positive_int(tasks_per_batch, "tasks_per_batch")
        )
        if seed is None:
            seed = self.seed
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        seed = int(seed)
        if as_numpy:
            return NumpyBatches(
                lambda k: self._make_batch_numpy(k, salt=1, seed=seed, tasks_per_batch=t),
                num_batches,
            )
        tf = self._tf("EpisodeSampler.evaluation_dataset")

        def fn(k):
            return self._make_batch(k, salt=1, seed=seed, tasks_per_batch=t)

        return (
            tf.data.Dataset.range(num_batches)
            .map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .prefetch(tf.data.AUTOTUNE)
        )
