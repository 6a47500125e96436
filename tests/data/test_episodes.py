"""tf_metaalign.data.episodes: N-way K-shot episode batches and the CI helper."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.data import EpisodeSampler, mean_confidence_interval
from tf_metaalign.data.episodes import student_t_ppf

# Class c has SIZES[c] examples; example i of class c is the vector [c, i] (float32), so an
# episode's examples tell which class and example they are.
SIZES = [6, 7, 8, 9, 10, 6, 7, 8, 9, 10, 11, 12]


def make_classes(sizes=SIZES):
    return {
        f"class{c}": np.stack([np.full(n, c), np.arange(n)], axis=1).astype(np.float32)
        for c, n in enumerate(sizes)
    }


def flat(nest):
    return [np.asarray(t) for t in tf.nest.flatten(nest)]


def assert_same(a, b):
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        np.testing.assert_array_equal(x, y)


def check_episode(sx, sy, qx, qy, ways, shots, queries, class_major):
    """Every structural property one episode (one task) must have."""
    s_cls, s_idx = sx[:, 0].astype(int), sx[:, 1].astype(int)
    q_cls, q_idx = qx[:, 0].astype(int), qx[:, 1].astype(int)
    assert sx.shape[0] == ways * shots and qx.shape[0] == ways * queries
    assert sy.dtype == np.int32 and qy.dtype == np.int32
    # Exactly N distinct classes, the same N in support and query.
    assert len(set(s_cls)) == ways
    assert set(q_cls) == set(s_cls)
    # Labels 0..N-1, K support and Q query examples each.
    assert sorted(set(sy.tolist())) == list(range(ways))
    assert np.all(np.bincount(sy, minlength=ways) == shots)
    assert np.all(np.bincount(qy, minlength=ways) == queries)
    # One consistent label <-> class mapping (a bijection) across support and query.
    mapping = {}
    for label, c in list(zip(sy, s_cls)) + list(zip(qy, q_cls)):
        assert mapping.setdefault(int(label), int(c)) == c
    assert len(set(mapping.values())) == ways
    # K + Q distinct examples per class; support and query disjoint; indices in range.
    examples = list(zip(s_cls, s_idx)) + list(zip(q_cls, q_idx))
    assert len(set(examples)) == len(examples)
    assert not set(zip(s_cls, s_idx)) & set(zip(q_cls, q_idx))
    for c, i in examples:
        assert 0 <= i < SIZES[c]
    if class_major:
        np.testing.assert_array_equal(sy, np.repeat(np.arange(ways), shots))
        np.testing.assert_array_equal(qy, np.repeat(np.arange(ways), queries))
    return mapping


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_episode_is_a_valid_n_way_k_shot_task(shuffle):
    ways, shots, queries, tasks = 5, 2, 4, 3
    sampler = EpisodeSampler(
        make_classes(), ways, shots, queries, tasks_per_batch=tasks, seed=7, shuffle=shuffle
    )
    orders = set()
    for (sx, sy, qx), qy in sampler.numpy_batches(num_batches=40):
        assert sx.shape == (tasks, ways * shots, 2) and sx.dtype == np.float32
        assert sy.shape == (tasks, ways * shots)
        assert qx.shape == (tasks, ways * queries, 2) and qy.shape == (tasks, ways * queries)
        for t in range(tasks):
            mapping = check_episode(
                sx[t], sy[t], qx[t], qy[t], ways, shots, queries, class_major=not shuffle
            )
            orders.add(tuple(mapping[j] for j in range(ways)))
            if shuffle:
                # shuffled: not class-major (almost surely, over 40 x 3 episodes)
                orders.add(("sorted", bool(np.all(np.diff(sy[t]) >= 0))))
    # The label of a class is random: many different label orders.
    assert len(orders) > 100
    if shuffle:
        assert ("sorted", False) in orders


def test_element_spec_is_static_and_matches_the_dataset():
    sampler = EpisodeSampler(make_classes(), 4, 1, 3, tasks_per_batch=2, seed=0)
    ds = sampler.dataset()
    assert ds.element_spec == sampler.element_spec
    for spec in tf.nest.flatten(ds.element_spec):
        assert spec.shape.is_fully_defined()
    (sx_spec, sy_spec, qx_spec), qy_spec = ds.element_spec
    assert sx_spec.shape == (2, 4, 2) and sy_spec.dtype == tf.int32
    assert qx_spec.shape == (2, 12, 2) and qy_spec.shape == (2, 12)


def test_determinism_and_resume():
    classes = make_classes()
    a = EpisodeSampler(classes, 5, 1, 2, tasks_per_batch=4, seed=3)
    b = EpisodeSampler(classes, 5, 1, 2, tasks_per_batch=4, seed=3)
    c = EpisodeSampler(classes, 5, 1, 2, tasks_per_batch=4, seed=4)
    stream = list(a.numpy_batches(num_batches=8))
    for k in range(8):
        # batch(k) is the k-th element of the dataset, and the same for another object.
        assert_same(a.batch(k), stream[k])
        assert_same(b.batch(k), stream[k])
    # Resuming at step k gives exactly batches k, k+1, ... of the uninterrupted stream.
    resumed = list(b.numpy_batches(start=5, num_batches=3))
    for got, want in zip(resumed, stream[5:]):
        assert_same(got, want)
    assert_same(next(iter(a.dataset(start=6))), stream[6])
    # Another seed, another stream; consecutive batches differ.
    assert not np.array_equal(flat(c.batch(0))[0], flat(stream[0])[0])
    assert not np.array_equal(flat(stream[0])[0], flat(stream[1])[0])


def test_episode_indices_match_the_batch():
    classes = make_classes()
    sampler = EpisodeSampler(classes, 3, 2, 2, tasks_per_batch=2, seed=1, shuffle=True)
    cls, s_rows, q_rows, s_y, q_y = (t.numpy() for t in sampler.episode_indices(5))
    sx, sy, qx, qy = flat(sampler.batch(5))
    data = np.concatenate(list(classes.values()))
    np.testing.assert_array_equal(data[s_rows], sx)
    np.testing.assert_array_equal(data[q_rows], qx)
    np.testing.assert_array_equal(s_y, sy)
    np.testing.assert_array_equal(q_y, qy)
    # classes[t, j] is the class of episode label j.
    for t in range(2):
        np.testing.assert_array_equal(sx[t, :, 0], cls[t][sy[t]])


def test_class_example_and_label_frequencies_are_uniform():
    stats = pytest.importorskip("scipy.stats")
    sizes = [10] * 12
    sampler = EpisodeSampler(make_classes(sizes), 4, 2, 3, tasks_per_batch=8, seed=11)
    class_counts = np.zeros(12)
    label_of_class0 = np.zeros(4)
    example_counts = np.zeros(10)  # examples of class 0 drawn
    for (sx, sy, qx), qy in sampler.numpy_batches(num_batches=150):
        for t in range(sx.shape[0]):
            cls = sx[t, :, 0].astype(int)
            class_counts += np.bincount(np.unique(cls), minlength=12)
            if 0 in cls:
                label_of_class0[sy[t][cls == 0][0]] += 1
                both = np.concatenate([sx[t], qx[t]])
                example_counts += np.bincount(both[both[:, 0] == 0, 1].astype(int), minlength=10)
    n_tasks = 150 * 8
    # Each class is in an episode with probability ways / num_classes.
    assert class_counts.sum() == n_tasks * 4
    assert stats.chisquare(class_counts).pvalue > 1e-3
    assert abs(class_counts.mean() / n_tasks - 4 / 12) < 1e-9
    # The label of a class is uniform over 0..N-1 (random relabelling).
    assert stats.chisquare(label_of_class0).pvalue > 1e-3
    # The examples of a class are drawn uniformly (5 of its 10 per episode).
    assert stats.chisquare(example_counts).pvalue > 1e-3


def test_unequal_class_sizes_draw_from_every_example():
    sampler = EpisodeSampler(make_classes(), 12, 3, 3, tasks_per_batch=4, seed=2)
    seen = set()
    for (sx, _, qx), _ in sampler.numpy_batches(num_batches=30):
        both = np.concatenate([sx, qx], axis=1).reshape(-1, 2).astype(int)
        seen.update(map(tuple, both))
    assert seen == {(c, i) for c, n in enumerate(SIZES) for i in range(n)}


def test_evaluation_dataset_is_fixed_finite_and_not_the_training_stream():
    sampler = EpisodeSampler(make_classes(), 5, 1, 2, tasks_per_batch=4, seed=0)
    ev = sampler.evaluation_dataset(6)
    assert int(ev.cardinality()) == 6
    first, second = list(ev.as_numpy_iterator()), list(ev.as_numpy_iterator())
    for a, b in zip(first, second):
        assert_same(a, b)
    again = list(
        EpisodeSampler(make_classes(), 5, 1, 2, tasks_per_batch=4, seed=0)
        .evaluation_dataset(6)
        .as_numpy_iterator()
    )
    for a, b in zip(first, again):
        assert_same(a, b)
    assert not np.array_equal(first[0][0][0], flat(sampler.batch(0))[0])
    other_seed = next(sampler.evaluation_dataset(6, seed=1).as_numpy_iterator())
    assert not np.array_equal(first[0][0][0], other_seed[0][0])
    one = next(sampler.evaluation_dataset(3, tasks_per_batch=1).as_numpy_iterator())
    assert one[0][0].shape == (1, 5, 2)
    check_episode(one[0][0][0], one[0][1][0], one[0][2][0], one[1][0], 5, 1, 2, True)


def test_list_of_class_arrays_and_from_labelled():
    classes = make_classes()
    from_list = EpisodeSampler(list(classes.values()), 3, 1, 1, seed=5)
    assert from_list.class_names == [str(i) for i in range(len(SIZES))]
    x = np.concatenate(list(classes.values()))
    y = x[:, 0].astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    from_xy = EpisodeSampler.from_labelled(x[perm], y[perm], ways=3, shots=1, queries=1, seed=5)
    assert from_xy.class_names == [str(i) for i in range(len(SIZES))]
    np.testing.assert_array_equal(from_xy.class_sizes, SIZES)
    sx, sy, qx, qy = (a[0] for a in flat(from_xy.batch(0)))
    check_episode(sx, sy, qx, qy, 3, 1, 1, True)
    ds = tf.data.Dataset.from_tensor_slices((x[perm], y[perm]))
    from_ds = EpisodeSampler.from_labelled(ds, ways=3, shots=1, queries=1, seed=5)
    np.testing.assert_array_equal(from_ds.class_sizes, SIZES)
    # Same classes in another order inside each class: the same episodes' classes.
    np.testing.assert_array_equal(from_ds.episode_indices(0)[0], from_xy.episode_indices(0)[0])
    strings = EpisodeSampler.from_labelled(
        x, np.asarray([f"c{int(v)}" for v in y]), ways=2, shots=1, queries=1
    )
    assert strings.class_names[:3] == ["c0", "c1", "c10"]


def test_errors_name_the_argument():
    classes = make_classes()
    with pytest.raises(ValueError, match=r"`ways`=13 is larger than the number of classes \(12\)"):
        EpisodeSampler(classes, 13, 1, 1)
    with pytest.raises(ValueError, match=r"`shots` \+ `queries` = 4 \+ 3 = 7 .*'class0' \(6\)"):
        EpisodeSampler(classes, 2, 4, 3)
    for arg in ("ways", "shots", "queries", "tasks_per_batch"):
        for bad in (0, -1, 1.5, True):
            kwargs = dict(ways=2, shots=1, queries=1, tasks_per_batch=1)
            kwargs[arg] = bad
            with pytest.raises(ValueError, match=f"`{arg}` must be an integer >= 1"):
                EpisodeSampler(classes, **kwargs)
    sampler = EpisodeSampler(classes, 2, 1, 1)
    with pytest.raises(ValueError, match="`start` must be an integer >= 0"):
        sampler.dataset(start=-1)
    with pytest.raises(ValueError, match="`num_batches` must be an integer >= 1"):
        sampler.dataset(num_batches=0)
    with pytest.raises(ValueError, match="`num_batches`"):
        sampler.evaluation_dataset(0)
    with pytest.raises(ValueError, match="`seed` must be an integer"):
        EpisodeSampler(classes, 2, 1, 1, seed=1.0)
    with pytest.raises(ValueError, match="`classes` is empty"):
        EpisodeSampler({}, 1, 1, 1)
    with pytest.raises(ValueError, match="0 examples"):
        EpisodeSampler({"a": np.zeros((0, 2)), "b": np.zeros((3, 2))}, 1, 1, 1)
    with pytest.raises(ValueError, match=r"`classes`\['b'\] has examples of shape"):
        EpisodeSampler({"a": np.zeros((3, 2)), "b": np.zeros((3, 4))}, 1, 1, 1)
    with pytest.raises(ValueError, match="from_labelled"):
        EpisodeSampler(np.zeros((3, 2)), 1, 1, 1)
    with pytest.raises(ValueError, match="same number of examples"):
        EpisodeSampler.from_labelled(np.zeros((3, 2)), np.zeros(4), ways=1, shots=1, queries=1)
    with pytest.raises(ValueError, match="infinite"):
        EpisodeSampler.from_labelled(
            tf.data.Dataset.from_tensors((np.zeros(2), 0)).repeat(), ways=1, shots=1, queries=1
        )


# ----------------------------------------------------------------------------- the CI helper


def test_mean_confidence_interval_equals_the_t_interval():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 20, 600):
        v = rng.uniform(size=n)
        for conf in (0.95, 0.99, 0.5):
            mean, half = mean_confidence_interval(v, conf)
            lo, hi = stats.t.interval(conf, n - 1, loc=v.mean(), scale=stats.sem(v))
            assert mean == pytest.approx(v.mean(), abs=1e-15)
            assert half == pytest.approx((hi - lo) / 2, rel=1e-9)
    # Closed form for n = 2, 95%: t_{0.975, 1} = tan(pi * 0.475) = 12.706...
    mean, half = mean_confidence_interval([0.0, 1.0])
    assert mean == 0.5
    assert half == pytest.approx(
        math.tan(math.pi * 0.475) * (math.sqrt(0.5) / math.sqrt(2)), rel=1e-10
    )
    assert math.isnan(mean_confidence_interval([0.3])[1])
    assert mean_confidence_interval([0.3, 0.3, 0.3]) == (pytest.approx(0.3), 0.0)


def test_student_t_ppf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3.5, 19, 1000):
        for p in (0.001, 0.025, 0.3, 0.5, 0.975, 0.9995):
            assert student_t_ppf(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)


def test_mean_confidence_interval_errors():
    with pytest.raises(ValueError, match="`values` is empty"):
        mean_confidence_interval([])
    with pytest.raises(ValueError, match="`confidence`"):
        mean_confidence_interval([1, 2], confidence=1.0)
    with pytest.raises(ValueError, match="`values` must be 1-D"):
        mean_confidence_interval([[1, 2]])
    with pytest.raises(ValueError, match="non-finite"):
        mean_confidence_interval([1, float("nan")])


def test_batches_split_along_the_task_axis_under_mirrored_strategy():
    from conftest import two_cpu_strategy

    strategy = two_cpu_strategy()
    sampler = EpisodeSampler(make_classes(), 3, 1, 2, tasks_per_batch=4, seed=0)
    dist = strategy.experimental_distribute_dataset(sampler.dataset(num_batches=1))
    (sx, sy, qx), qy = next(iter(dist))
    parts = strategy.experimental_local_results(sx)
    assert [tuple(p.shape) for p in parts] == [(2, 3, 2), (2, 3, 2)]
    qparts = strategy.experimental_local_results(qy)
    np.testing.assert_array_equal(
        np.concatenate([p.numpy() for p in qparts]), flat(sampler.batch(0))[3]
    )
