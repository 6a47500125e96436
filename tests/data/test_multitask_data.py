"""Multi-task batches: task frequencies, determinism, resume, batch contents, clear errors."""

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign import data
from tf_metaalign.data import multitask as mt

SIZES = {"small": 12, "medium": 60, "large": 600}


def make_tasks(sizes=SIZES, sample_weight=False):
    """Row i of task t has features (t, i, 10 t + i) and label i: any example of a batch
    tells which task's arrays and which row it came from."""
    tasks = {}
    for t, (name, n) in enumerate(sizes.items()):
        i = np.arange(n)
        x = np.stack([np.full(n, t), i, 10 * t + i], axis=1).astype(np.float32)
        y = i.astype(np.int32)
        tasks[name] = (x, y, (1.0 + t + 0 * i).astype(np.float32)) if sample_weight else (x, y)
    return tasks


def to_numpy(batches):
    return [tf.nest.map_structure(lambda a: a.numpy(), b) for b in batches]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        tf.nest.map_structure(np.testing.assert_array_equal, u, v)


def first_task_ids(stream, steps):
    """The task of each of the first `steps` single-task batches."""
    ds = stream.single_task_batches().take(steps).map(lambda x, y: x["task_id"][0])
    return np.fromiter(ds.batch(1000).unbatch().as_numpy_iterator(), np.int64, steps)


# ----------------------------------------------------------------------------- probabilities


def test_probabilities_closed_forms():
    sizes = {"a": 10, "b": 40, "c": 950}
    p0 = mt.task_probabilities(sizes, q=0)
    np.testing.assert_allclose(list(p0.values()), [1 / 3] * 3)
    p1 = mt.task_probabilities(sizes, q=1)
    np.testing.assert_allclose(list(p1.values()), [0.01, 0.04, 0.95])
    p5 = mt.task_probabilities(sizes)  # default q = 1/5
    n = np.array([10, 40, 950.0]) ** 0.2
    np.testing.assert_allclose(list(p5.values()), n / n.sum())
    assert list(p5) == ["a", "b", "c"]
    pw = mt.task_probabilities(sizes, weights={"c": 1, "a": 3, "b": 4.0})
    np.testing.assert_allclose(list(pw.values()), [3 / 8, 4 / 8, 1 / 8])
    np.testing.assert_allclose(
        list(mt.task_probabilities(sizes, weights=[1, 1, 2]).values()), [0.25, 0.25, 0.5]
    )
    # Huge sizes and exponents stay finite (log space).
    big = mt.task_probabilities({"a": 10**9, "b": 10**9}, q=300)
    np.testing.assert_allclose(list(big.values()), [0.5, 0.5])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sizes={}), "`sizes` is empty"),
        (dict(sizes={"a": 3, "b": 0}), r"`sizes`\['b'\].*0 examples"),
        (dict(sizes={"a": 3, "b": -2}), r"`sizes`\['b'\]"),
        (dict(sizes={"a": 3, "b": 2.5}), r"`sizes`\['b'\]"),
        (dict(sizes={"a": 3}, q=float("nan")), "`q` must be a finite number"),
        (dict(sizes={"a": 3}, q=float("inf")), "`q` must be a finite number"),
        (dict(sizes={"a": 3}, q="0.2"), "`q` must be a finite number"),
        (dict(sizes={"a": 3}, q=True), "`q` must be a finite number"),
        (dict(sizes={"a": 3, "b": 4}, weights={"a": 1, "b": 1, "zz": 1}), "unknown tasks.*zz"),
        (dict(sizes={"a": 3, "b": 4}, weights={"a": 1}), r"no weight for tasks \['b'\]"),
        (dict(sizes={"a": 3, "b": 4}, weights={"a": 1, "b": 0}), r"`weights`\['b'\].*> 0"),
        (dict(sizes={"a": 3, "b": 4}, weights={"a": -1, "b": 1}), r"`weights`\['a'\].*> 0"),
        (dict(sizes={"a": 3, "b": 4}, weights=[1]), "1 entries for 2 tasks"),
        (dict(sizes={"a": 3}, q=1, weights={"a": 1}), "not both"),
    ],
)
def test_probabilities_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.task_probabilities(**kwargs)


# ----------------------------------------------------------------------------- sampling


def test_task_frequencies_match_p_chi_square():
    from scipy import stats

    steps = 5000
    for q in (1.0, 0.2):
        stream = mt.MultiTaskStream(make_tasks(), batch_size=4, q=q, seed=3)
        p = np.array(list(stream.probabilities.values()))
        counts = np.bincount(first_task_ids(stream, steps), minlength=3)
        chi2, pval = stats.chisquare(counts, steps * p)
        assert pval > 1e-3, (q, counts, steps * p)
        if q == 1.0:
            # ... and not uniform: sizes 12 / 60 / 600 are far from equal.
            _, pval_uniform = stats.chisquare(counts, np.full(3, steps / 3))
            assert pval_uniform < 1e-12, counts
            np.testing.assert_allclose(p, np.array([12, 60, 600]) / 672)


def test_weights_override_q():
    stream = mt.MultiTaskStream(
        make_tasks(), batch_size=4, q=1.0, weights={"small": 1, "medium": 1, "large": 2}
    )
    assert stream.probabilities == {"small": 0.25, "medium": 0.25, "large": 0.5}


def test_single_task_batch_contents():
    stream = mt.MultiTaskStream(make_tasks(sample_weight=True), batch_size=12, q=0.0, seed=1)
    spec = stream.single_task_batches().element_spec
    assert spec[0]["inputs"].shape == (12, 3) and spec[0]["task_id"].shape == (12,)
    assert spec[0]["task_id"].dtype == tf.int32 and spec[1].shape == (12,)
    seen = set()
    for x, y, sw in to_numpy(stream.single_task_batches().take(60)):
        tid = x["task_id"]
        assert len(set(tid)) == 1  # ONE task per batch
        t = int(tid[0])
        seen.add(t)
        feats = x["inputs"]
        # Every example comes from task t's arrays, at the row its label names.
        np.testing.assert_array_equal(feats[:, 0], t)
        np.testing.assert_array_equal(feats[:, 1], y)
        np.testing.assert_array_equal(feats[:, 2], 10 * t + y)
        np.testing.assert_array_equal(sw, 1.0 + t)
        assert y.max() < list(SIZES.values())[t]
        assert len(set(y)) == 12  # no example twice in one batch
    assert seen == {0, 1, 2}
    # The small task (12 examples) with batch_size 12: the whole task, in some order.


def test_mixed_batch_contents_all_tasks_and_interleave():
    stream = mt.MultiTaskStream(make_tasks(), batch_size=8, seed=2)
    spec = stream.mixed_batches(per_task_batch_size=5).element_spec
    assert spec[0]["inputs"].shape == (15, 3) and spec[1].shape == (15,)
    for interleave in (False, True):
        for x, y in to_numpy(
            stream.mixed_batches(per_task_batch_size=5, interleave=interleave).take(10)
        ):
            tid = x["task_id"]
            assert np.bincount(tid, minlength=3).tolist() == [5, 5, 5]
            if interleave:
                np.testing.assert_array_equal(tid, np.tile([0, 1, 2], 5))
            else:
                np.testing.assert_array_equal(tid, np.repeat([0, 1, 2], 5))
            np.testing.assert_array_equal(x["inputs"][:, 0], tid)
            np.testing.assert_array_equal(x["inputs"][:, 1], y)
            for t in range(3):
                assert len(set(y[tid == t])) == 5
    # Default per_task_batch_size is batch_size.
    assert stream.mixed_batches().element_spec[1].shape == (24,)


def test_mixed_batches_some_tasks_drawn_with_p():
    from scipy import stats

    sizes = {"a": 6, "b": 6, "c": 6, "d": 600}
    stream = mt.MultiTaskStream(make_tasks(sizes), batch_size=2, q=1.0, seed=5)
    steps, pairs = 1500, []
    ds = stream.mixed_batches(tasks_per_batch=2, per_task_batch_size=3).take(steps)
    for x, y in to_numpy(ds):
        tid = x["task_id"]
        chosen = np.unique(tid)
        assert len(chosen) == 2  # without replacement
        assert np.bincount(tid, minlength=4)[chosen].tolist() == [3, 3]
        np.testing.assert_array_equal(x["inputs"][:, 0], tid)
        pairs.append(chosen)
    counts = np.bincount(np.concatenate(pairs), minlength=4)
    # Successive sampling without replacement (Gumbel top-2) in closed form: task d
    # (p = 600/618) is almost always in; each small task fills the other slot equally.
    p = np.array([6, 6, 6, 600]) / 618
    incl = np.array(
        [p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(4) if j != i) for i in range(4)]
    )
    np.testing.assert_allclose(incl.sum(), 2.0)
    _, pval = stats.chisquare(counts, steps * incl)
    assert pval > 1e-3, (counts, steps * incl)


# ----------------------------------------------------------------------------- determinism


def test_deterministic_under_seed():
    tasks = make_tasks()
    a = to_numpy(mt.MultiTaskStream(tasks, 4, seed=7).single_task_batches().take(20))
    b = to_numpy(mt.MultiTaskStream(tasks, 4, seed=7).single_task_batches().take(20))
    c = to_numpy(mt.MultiTaskStream(tasks, 4, seed=8).single_task_batches().take(20))
    assert_batches_equal(a, b)
    assert not all(np.array_equal(u[1], v[1]) for u, v in zip(a, c))
    ma = to_numpy(mt.MultiTaskStream(tasks, 4, seed=7).mixed_batches(2).take(10))
    mb = to_numpy(mt.MultiTaskStream(tasks, 4, seed=7).mixed_batches(2).take(10))
    mc = to_numpy(mt.MultiTaskStream(tasks, 4, seed=8).mixed_batches(2).take(10))
    assert_batches_equal(ma, mb)
    assert not all(np.array_equal(u[1], v[1]) for u, v in zip(ma, mc))
    # Iterating the same dataset twice gives the same batches (no hidden state).
    ds = mt.MultiTaskStream(tasks, 4, seed=7).single_task_batches().take(20)
    assert_batches_equal(to_numpy(ds), to_numpy(ds))


def test_resume_with_start_equals_skipping():
    stream = mt.MultiTaskStream(make_tasks(), 4, seed=11)
    full = to_numpy(stream.single_task_batches().take(30))
    assert_batches_equal(to_numpy(stream.single_task_batches(start=17).take(13)), full[17:])
    # A fresh stream object (a restarted process) resumes identically.
    again = mt.MultiTaskStream(make_tasks(), 4, seed=11)
    assert_batches_equal(to_numpy(again.single_task_batches(start=17).take(13)), full[17:])
    mixed = to_numpy(stream.mixed_batches(2, per_task_batch_size=3).take(25))
    assert_batches_equal(
        to_numpy(again.mixed_batches(2, per_task_batch_size=3, start=9).take(16)), mixed[9:]
    )
    # batch k is a function of k alone, also called directly / in a tf.function.
    k_batch = to_numpy([tf.function(stream.single_task_batch)(tf.constant(21, tf.int64))])
    assert_batches_equal(k_batch, full[21:22])


def test_dataset_tasks_materialised_and_model_inputs():
    tasks = make_tasks({"a": 20, "b": 30})
    as_datasets = {k: tf.data.Dataset.from_tensor_slices(v) for k, v in tasks.items()}
    a = to_numpy(mt.MultiTaskStream(tasks, 5, seed=0).single_task_batches().take(8))
    b = to_numpy(mt.MultiTaskStream(as_datasets, 5, seed=0).single_task_batches().take(8))
    assert_batches_equal(a, b)
    x, _ = a[0]
    assert data.model_inputs(x) is x["inputs"]
    assert data.model_inputs(x, model_takes_task_id=True) is x
    assert data.task_ids(x) is x["task_id"]
    with pytest.raises(ValueError, match="'inputs'.*'task_id'"):
        data.model_inputs(x["inputs"])
    # Nested inputs (e.g. tokenized text) keep their structure.
    nested = {k: ({"ids": v[0].astype(np.int32), "mask": v[0] > 0}, v[1]) for k, v in tasks.items()}
    x, y = next(iter(mt.MultiTaskStream(nested, 5).mixed_batches(per_task_batch_size=2)))
    assert set(x["inputs"]) == {"ids", "mask"} and x["inputs"]["ids"].shape == (4, 3)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: mt.MultiTaskStream({}, 4), "`tasks` is empty"),
        (lambda: mt.MultiTaskStream(make_tasks({"a": 10, "b": 0}), 4), r"'b'.*0 examples"),
        (
            lambda: mt.MultiTaskStream(
                {
                    "a": make_tasks({"a": 5})["a"],
                    "b": tf.data.Dataset.from_tensor_slices(
                        (np.zeros((0, 3), np.float32), np.zeros(0, np.int32))
                    ),
                },
                2,
            ),
            r"'b'.*0 examples",
        ),
        (lambda: mt.MultiTaskStream(make_tasks(), 13), r"`batch_size`=13.*'small'.*12 examples"),
        (lambda: mt.MultiTaskStream(make_tasks(), 0), "`batch_size` must be an integer >= 1"),
        (
            lambda: mt.MultiTaskStream(make_tasks(), 4, weights={"small": 1, "huge": 1}),
            "unknown tasks.*huge",
        ),
        (
            lambda: mt.MultiTaskStream(
                make_tasks(), 4, weights={"small": 1, "medium": 1, "large": 0}
            ),
            r"`weights`\['large'\]",
        ),
        (lambda: mt.MultiTaskStream(make_tasks(), 4, q=float("nan")), "`q`"),
        (
            lambda: mt.MultiTaskStream(make_tasks(), 4).mixed_batches(per_task_batch_size=20),
            r"`per_task_batch_size`=20.*'small'",
        ),
        (
            lambda: mt.MultiTaskStream(make_tasks(), 4).mixed_batches(tasks_per_batch=4),
            "`tasks_per_batch`=4 is larger than the number of tasks",
        ),
        (lambda: mt.MultiTaskStream(make_tasks(), 4).single_task_batches(start=-1), "`start`"),
        (
            lambda: mt.MultiTaskStream(
                {
                    "a": make_tasks({"a": 5})["a"],
                    "b": (np.zeros((5, 4), np.float32), np.zeros(5, np.int32)),
                },
                2,
            ),
            r"`tasks`\['b'\].*per-example shape",
        ),
        (lambda: mt.MultiTaskStream({"a": (np.zeros((5, 3)), np.zeros(4))}, 2), "same leading"),
        (
            lambda: mt.MultiTaskStream(
                {"a": tf.data.Dataset.from_tensors((np.zeros(3), 1)).repeat()}, 2
            ),
            "infinite",
        ),
    ],
)
def test_stream_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- per-task heads


def test_one_head_per_task_model(tmp_path):
    import keras

    sizes, classes = {"a": 20, "b": 30, "c": 25}, [2, 5, 3]
    rng = np.random.default_rng(0)
    tasks = {
        n: (rng.random((s, 3), dtype=np.float32), rng.integers(0, c, s).astype(np.int32))
        for (n, s), c in zip(sizes.items(), classes)
    }
    stream = mt.MultiTaskStream(tasks, 4, seed=0)
    backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu")])
    model = mt.one_head_per_task_model(backbone, dict(zip(sizes, classes)))
    x, y = next(iter(stream.mixed_batches(per_task_batch_size=3, interleave=True)))
    out = model(x).numpy()
    assert out.shape == (9, 5)
    features = backbone(x["inputs"]).numpy()
    head = model.get_layer("per_task_head")
    kernel = head.kernel.numpy().reshape(8, 3, 5)
    bias = head.bias.numpy().reshape(3, 5)
    for i, t in enumerate(x["task_id"].numpy()):
        c = classes[t]
        np.testing.assert_allclose(
            out[i, :c], features[i] @ kernel[:, t, :c] + bias[t, :c], rtol=1e-5, atol=1e-6
        )
        assert np.all(out[i, c:] <= -1e8)  # ignored by a softmax cross-entropy
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(stream.mixed_batches(per_task_batch_size=3), steps_per_epoch=3, verbose=0)
    assert np.isfinite(hist.history["loss"][-1])
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(again(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_static_shapes_under_mirrored_strategy_and_xla():
    from conftest import two_cpu_strategy

    stream = mt.MultiTaskStream(make_tasks(), 4, seed=0)
    for ds in (
        stream.single_task_batches(),
        stream.mixed_batches(per_task_batch_size=4, interleave=True),
    ):
        assert all(s.shape.is_fully_defined() for s in tf.nest.flatten(ds.element_spec))
    strategy = two_cpu_strategy()
    dist = strategy.experimental_distribute_dataset(
        stream.mixed_batches(per_task_batch_size=4, interleave=True)
    )
    x, y = next(iter(dist))
    shards = strategy.experimental_local_results(x["task_id"])
    assert len(shards) == 2
    for shard in shards:  # interleaved: every replica gets 2 examples of every task
        assert np.bincount(shard.numpy(), minlength=3).tolist() == [2, 2, 2]

    @tf.function(jit_compile=True)
    def per_task_sum(x):
        return tf.math.unsorted_segment_sum(
            tf.reduce_sum(mt.model_inputs(x), axis=1), mt.task_ids(x), 3
        )

    x, _ = next(iter(stream.single_task_batches()))
    assert per_task_sum(x).shape == (3,)
