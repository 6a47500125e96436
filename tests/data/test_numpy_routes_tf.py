"""The NumPy routes (`as_numpy=True`, what feeds the JAX trainers without TensorFlow) give
the tf.data routes' batches, array for array, and the NumPy copies of TensorFlow's
stateless random ops (`tf_metaalign.data._stateless_numpy`) draw TensorFlow's numbers.
TensorFlow env only (both routes side by side). ~25 s on 2 cores."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_metaalign.data import (
    EpisodeSampler,
    MultiTaskStream,
    make_dataset,
    official_runs_dataset,
    stacked_batches,
)
from tf_metaalign.data import _stateless_numpy as rnd
from tf_metaalign.data.episodes import _betainc, student_t_ppf
from tf_metaalign.data.omniglot import OfficialRun
from tf_metaalign.data.sinusoid import SinusoidTasks


def _same(tf_batches, numpy_batches, n=None):
    count = 0
    for a, b in zip(tf_batches, numpy_batches):
        fa, fb = keras.tree.flatten(a), keras.tree.flatten(b)
        assert len(fa) == len(fb)
        for u, v in zip(fa, fb):
            u = u.numpy() if hasattr(u, "numpy") else u
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)
        count += 1
        if n is not None and count == n:
            break
    assert count == (n if n is not None else count) and count > 0
    return count


def test_stateless_ops_draw_tensorflows_numbers():
    rng = np.random.default_rng(0)
    for _ in range(100):
        seed = [int(rng.integers(-(2**62), 2**62)), int(rng.integers(0, 2**40))]
        tf_seed = tf.constant(seed, tf.int64)
        np.testing.assert_array_equal(
            tf.random.experimental.stateless_split(tf_seed, num=3).numpy(), rnd.split(seed, 3)
        )
        shape = [int(rng.integers(1, 4)), int(rng.integers(1, 30))]
        u = tf.random.stateless_uniform(shape, seed=tf_seed)
        np.testing.assert_array_equal(u.numpy(), rnd.uniform(shape, seed))
        k = int(rng.integers(1, shape[1] + 1))
        np.testing.assert_array_equal(tf.math.top_k(u, k).indices.numpy(), rnd.top_k_indices(u, k))
        np.testing.assert_array_equal(tf.argsort(u).numpy(), rnd.argsort(u))
        logits = np.log(rng.dirichlet(np.ones(int(rng.integers(1, 12))))).astype("float32")
        drawn = tf.random.stateless_categorical(logits[None], 1, seed=tf_seed, dtype=tf.int32)
        assert int(drawn[0, 0]) == rnd.categorical(logits, seed)
    ties = np.asarray([[0.5, 0.25, 0.5, 0.5, -1.0]], np.float32)  # ties: the lower index first
    np.testing.assert_array_equal(
        tf.math.top_k(ties, 4).indices.numpy(), rnd.top_k_indices(ties, 4)
    )
    small = rnd.uniform([7], [3, 4]) + np.float32(1e-20)  # fewer than 8: the exact log
    np.testing.assert_array_equal((-tf.math.log(-tf.math.log(small))).numpy(), rnd.gumbel(small))


def _tasks(num_tasks, rng, dict_inputs=False):
    out = {}
    for t in range(num_tasks):
        n = int(rng.integers(6, 40))
        x = rng.normal(size=(n, 3)).astype("float32")
        x = {"ids": np.arange(n, dtype="int32") + 100 * t, "feats": x} if dict_inputs else x
        out[f"t{t}"] = (x, rng.integers(0, 4, n).astype("int32"), rng.random(n).astype("float32"))
    return out


@pytest.mark.parametrize(
    "num_tasks, tasks_per_batch, interleave, dict_inputs",
    [(3, None, False, True), (5, 2, True, False), (7, 4, False, False), (10, 3, True, True)],
)
def test_multitask_stream_routes_give_the_same_batches(
    num_tasks, tasks_per_batch, interleave, dict_inputs
):
    rng = np.random.default_rng(num_tasks)
    stream = MultiTaskStream(_tasks(num_tasks, rng, dict_inputs), batch_size=4, q=0.3, seed=9)
    _same(
        stream.single_task_batches(start=11).take(60),
        stream.single_task_batches(start=11, as_numpy=True),
        60,
    )
    _same(
        stream.mixed_batches(tasks_per_batch, 2, interleave, start=5).take(60),
        stream.mixed_batches(tasks_per_batch, 2, interleave, start=5, as_numpy=True),
        60,
    )
    _same(
        [stream.mixed_batch(3, tasks_per_batch, 2)],
        [stream.mixed_batch(3, tasks_per_batch, 2, as_numpy=True)],
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_episode_sampler_routes_give_the_same_batches(shuffle):
    rng = np.random.default_rng(1)
    classes = [
        rng.normal(size=(int(rng.integers(4, 25)), 2, 2)).astype("float32") for _ in range(9)
    ]
    sampler = EpisodeSampler(
        classes, ways=3, shots=2, queries=2, tasks_per_batch=3, seed=5, shuffle=shuffle
    )
    _same(sampler.dataset(start=3, num_batches=40), sampler.dataset(3, 40, as_numpy=True))
    _same(sampler.dataset(start=3), sampler.dataset(3, as_numpy=True), 20)
    _same(
        sampler.evaluation_dataset(10, seed=2, tasks_per_batch=1),
        sampler.evaluation_dataset(10, seed=2, tasks_per_batch=1, as_numpy=True),
    )
    for tensors, arrays in zip(
        sampler.episode_indices(4), sampler.episode_indices(4, as_numpy=True)
    ):
        np.testing.assert_array_equal(tensors.numpy(), arrays)


def test_stacked_batches_sinusoid_runs_and_unshuffled_datasets_routes_agree():
    def task(i):
        x = np.linspace(-1, 1, 9, dtype="float32")[:, None] + i
        return x, 3 * x

    _same(
        stacked_batches(task, 3, 4, num_elements=5, seed=2, start=1),
        stacked_batches(task, 3, 4, num_elements=5, seed=2, start=1, as_numpy=True),
    )
    sampler = EpisodeSampler(
        [np.arange(14.0).reshape(7, 2) + 20 * c for c in range(4)],
        ways=2,
        shots=3,
        queries=1,
        tasks_per_batch=2,
        seed=1,
    )
    _same(
        stacked_batches(sampler, 2, 3, stack_axis=1),
        stacked_batches(sampler, 2, 3, stack_axis=1, as_numpy=True),
        6,
    )
    tasks = SinusoidTasks(shots=3, queries=2, tasks_per_batch=4, seed=1)
    _same(tasks.dataset(3), tasks.dataset(3, as_numpy=True))
    run = OfficialRun(
        np.zeros((5, 4, 4, 1), "float32"),
        np.arange(5, dtype="int32"),
        np.ones((5, 4, 4, 1), "float32"),
        np.arange(5, dtype="int32")[::-1],
        "r",
    )
    _same(official_runs_dataset([run] * 3, 2), official_runs_dataset([run] * 3, 2, as_numpy=True))
    x, y = {"a": np.arange(10.0)[:, None], "b": np.arange(10)}, np.arange(10) % 3
    _same(make_dataset(x, y, 4, shuffle=False), make_dataset(x, y, 4, shuffle=False, as_numpy=True))
    _same(
        make_dataset(x, y, 4, shuffle=False, repeat=True),
        make_dataset(x, y, 4, shuffle=False, repeat=True, as_numpy=True),
        7,
    )


def test_student_t_without_tensorflow_equals_tensorflows_betainc():
    for a, b, x in [(0.5, 0.5, 0.3), (1.5, 0.5, 0.9), (10.0, 0.5, 0.01), (28.5, 0.5, 0.97)]:
        want = float(
            tf.math.betainc(
                tf.constant(a, tf.float64), tf.constant(b, tf.float64), tf.constant(x, tf.float64)
            )
        )
        np.testing.assert_allclose(_betainc(a, b, x), want, rtol=1e-13)
    np.testing.assert_allclose(student_t_ppf(0.975, 3), 3.182446305284263, rtol=1e-11)
