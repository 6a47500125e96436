"""The data helpers' NumPy routes (`as_numpy=True`), on both backends and without
TensorFlow: the batches' contracts (a pure function of (seed, k), sampling without
replacement, task ids), `fit` on them == the same batches step by step, and the error of
a tf.data route without TensorFlow (naming the helper and its NumPy route). That the
NumPy route gives the tf.data route's batches is tests/data/test_numpy_routes_tf.py.
~10 s per backend."""

import importlib
import importlib.util
import io
import sys
import pathlib
import zipfile

import keras
import numpy as np
import pytest

from tf_metaalign import backend
from tf_metaalign.data import (
    EpisodeSampler,
    MultiTaskStream,
    Splits,
    load_omniglot,
    load_tfds,
    make_dataset,
    official_runs_dataset,
    stack_task,
    stacked_batches,
)
from tf_metaalign.data import omniglot as omniglot_module
from tf_metaalign.data.omniglot import OfficialRun
from tf_metaalign.data.sinusoid import SinusoidTasks

BACKENDS = ("tensorflow", "jax")


def _tasks(sizes=(12, 30, 7), weights=False):
    """Task t's example i is x = [t, i] (so a batch row tells where it came from)."""
    out = {}
    for t, n in enumerate(sizes):
        x = np.stack([np.full(n, t), np.arange(n)], 1).astype("float32")
        y = (10 * t + np.arange(n)).astype("int32")
        out[f"task{t}"] = (x, y, np.full(n, t + 1.0, "float32")) if weights else (x, y)
    return out


def _equal_nests(a, b):
    fa, fb = keras.tree.flatten(a), keras.tree.flatten(b)
    assert len(fa) == len(fb)
    for u, v in zip(fa, fb):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(u, v)


# ------------------------------------------------------------------- MultiTaskStream


def test_single_task_batches_are_one_task_without_replacement_and_resumable():
    stream = MultiTaskStream(_tasks(weights=True), batch_size=5, q=0.5, seed=4)
    gen = stream.single_task_batches(as_numpy=True)
    batches = [next(gen) for _ in range(400)]
    counts = np.zeros(3)
    for x, y, w in batches:
        (t,) = set(x["task_id"].tolist())
        assert x["task_id"].dtype == np.int32 and x["inputs"].shape == (5, 2)
        np.testing.assert_array_equal(x["inputs"][:, 0], t)  # every row from task t
        rows = x["inputs"][:, 1].astype(int)
        assert len(set(rows.tolist())) == 5  # without replacement
        np.testing.assert_array_equal(y, 10 * t + rows)
        np.testing.assert_array_equal(w, t + 1.0)
        counts[t] += 1
    p = np.sqrt([12, 30, 7]) / np.sqrt([12, 30, 7]).sum()
    np.testing.assert_allclose(counts / 400, p, atol=0.07)  # p_t ∝ N_t^q
    resumed = stream.single_task_batches(start=123, as_numpy=True)
    _equal_nests(next(resumed), batches[123])
    _equal_nests(stream.single_task_batch(7, as_numpy=True), batches[7])
    again = MultiTaskStream(_tasks(weights=True), batch_size=5, q=0.5, seed=4)
    _equal_nests(next(again.single_task_batches(start=7, as_numpy=True)), batches[7])


@pytest.mark.parametrize("tasks_per_batch", [None, 2])
@pytest.mark.parametrize("interleave", [False, True])
def test_mixed_batches_hold_each_drawn_task_equally(tasks_per_batch, interleave):
    stream = MultiTaskStream(_tasks(), batch_size=3, seed=1)
    gen = stream.mixed_batches(tasks_per_batch, 3, interleave=interleave, start=5, as_numpy=True)
    for k in range(5, 25):
        x, y = next(gen)
        ids = x["task_id"]
        m = tasks_per_batch or 3
        assert ids.shape == (3 * m,)
        layout = ids.reshape(3, m).T if interleave else ids.reshape(m, 3)
        assert (layout == layout[:, :1]).all() and (np.diff(layout[:, 0]) > 0).all()
        np.testing.assert_array_equal(x["inputs"][:, 0], ids)
        _equal_nests((x, y), stream.mixed_batch(k, tasks_per_batch, 3, interleave, as_numpy=True))


def test_fit_on_the_stream_is_the_stream_step_by_step():
    stream = MultiTaskStream(_tasks(), batch_size=4, seed=2)

    def model():
        m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        m.set_weights([np.full((2, 1), 0.1, "float32"), np.zeros(1, "float32")])
        m.compile(keras.optimizers.SGD(0.001), "mse")
        return m

    def as_xy(batch):
        x, y = batch
        return x["inputs"], y.astype("float32")

    fitted = model()
    batches = (as_xy(b) for b in stream.single_task_batches(start=3, as_numpy=True))
    fitted.fit(
        batches, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0
    )  # the 2nd epoch goes on
    stepped = model()
    for k in range(3, 9):
        stepped.train_on_batch(*as_xy(stream.single_task_batch(k, as_numpy=True)))
    for a, b in zip(fitted.get_weights(), stepped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="the tf.data route needs TensorFlow"
)
def test_the_tf_data_route_feeds_fit_as_the_numpy_route_does():
    """Where TensorFlow is installed, on either backend (Keras's JAX fit takes a
    tf.data.Dataset: JAX beside tensorflow-cpu)."""
    stream = MultiTaskStream(_tasks(), batch_size=4, seed=2)

    def fitted(batches):
        m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        m.set_weights([np.full((2, 1), 0.1, "float32"), np.zeros(1, "float32")])
        m.compile(keras.optimizers.SGD(0.001), "mse")
        m.fit(batches, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0)
        return m.get_weights()

    tf_route = stream.single_task_batches(start=3).map(lambda x, y: (x["inputs"], y))
    numpy_route = ((x["inputs"], y) for x, y in stream.single_task_batches(3, as_numpy=True))
    for a, b in zip(fitted(tf_route), fitted(numpy_route)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------- episodes, stacks


@pytest.mark.parametrize("shuffle", [False, True])
def test_episodes_are_n_way_k_shot_and_a_function_of_k(shuffle):
    classes = {f"c{i}": np.stack([np.full(9, i), np.arange(9)], 1) for i in range(6)}
    sampler = EpisodeSampler(
        classes, ways=3, shots=2, queries=2, tasks_per_batch=4, seed=3, shuffle=shuffle
    )
    ds = sampler.dataset(start=2, num_batches=5, as_numpy=True)
    assert len(ds) == 5
    for j, ((sx, sy, qx), qy) in enumerate(ds):
        assert sx.shape == (4, 6, 2) and qy.shape == (4, 6) and sy.dtype == np.int32
        for t in range(4):
            cls = {lab: set() for lab in range(3)}
            for x, lab in [*zip(sx[t], sy[t]), *zip(qx[t], qy[t])]:
                cls[lab].add(int(x[0]))
            assert all(len(c) == 1 for c in cls.values())  # one class per label
            assert len({next(iter(c)) for c in cls.values()}) == 3  # distinct classes
            rows = {tuple(r) for r in sx[t]} | {tuple(r) for r in qx[t]}
            assert len(rows) == 12  # support and query never share an example
        _equal_nests(((sx, sy, qx), qy), sampler.batch(2 + j, as_numpy=True))
    _equal_nests(next(sampler.dataset(start=4, as_numpy=True)), ds[2])
    _equal_nests(next(sampler.numpy_batches(4)), ds[2])
    evaluation = sampler.evaluation_dataset(3, as_numpy=True)
    _equal_nests(evaluation[1], sampler.evaluation_dataset(3, as_numpy=True)[1])
    assert not np.array_equal(evaluation[0][0][0], sampler.batch(0, as_numpy=True)[0][0])


def test_stacked_batches_are_stack_task_of_each_task():
    def task(i):
        x = np.arange(7, dtype="float32")[:, None] + 100 * i
        return x, 2 * x

    ds = stacked_batches(
        task, num_batches=3, batch_size=4, num_elements=2, seed=5, start=1, as_numpy=True
    )
    assert len(ds) == 2
    for j, (xs, ys) in enumerate(ds):
        want = stack_task(*task(1 + j), 3, 4, np.random.default_rng([5, 1 + j]))
        _equal_nests((xs, ys), want)
    forever = stacked_batches(task, 3, 4, stack_axis=1, seed=5, start=2, as_numpy=True)
    _equal_nests(next(forever), stack_task(*task(2), 3, 4, np.random.default_rng([5, 2]), 1))

    sampler = EpisodeSampler(
        [np.arange(12.0).reshape(6, 2) + 20 * c for c in range(4)],
        ways=2,
        shots=3,
        queries=1,
        tasks_per_batch=2,
        seed=1,
    )
    (sx, sy, _), _ = sampler.batch(1, as_numpy=True)
    xs, ys = next(stacked_batches(sampler, 2, 3, start=3, as_numpy=True))  # batch 1, task 1
    np.testing.assert_array_equal(np.sort(xs.reshape(-1, 2), 0), np.sort(sx[1], 0))


def test_sinusoid_and_official_runs_as_numpy():
    tasks = SinusoidTasks(shots=3, queries=2, tasks_per_batch=4, seed=1)
    ds = tasks.dataset(3, as_numpy=True)
    assert len(ds) == 3
    _equal_nests(ds[2], tasks.batch(2))
    run = OfficialRun(
        np.zeros((5, 4, 4, 1), "float32"),
        np.arange(5, dtype="int32"),
        np.ones((5, 4, 4, 1), "float32"),
        np.arange(5, dtype="int32")[::-1],
        "r",
    )
    runs = official_runs_dataset([run] * 3, tasks_per_batch=2, as_numpy=True)
    assert [b[1].shape for b in runs] == [(2, 5), (1, 5)]


# ------------------------------------------------------------------- make_dataset


def test_make_dataset_as_numpy():
    x, y = {"a": np.arange(10.0)[:, None]}, np.arange(10)
    in_order = make_dataset(x, y, 4, shuffle=False, as_numpy=True)
    assert [b[1].tolist() for b in in_order] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    np.testing.assert_array_equal(in_order[1][0]["a"][:, 0], [4, 5, 6, 7])
    shuffled = make_dataset(x, y, 4, seed=3, drop_remainder=True, as_numpy=True)
    first = np.concatenate([b[1] for b in shuffled])
    assert len(shuffled) == 2 and len(set(first.tolist())) == 8
    np.testing.assert_array_equal(first, np.random.default_rng([3, 0]).permutation(10)[:8])
    shuffled.on_epoch_end()  # what fit calls: the next epoch, another order
    second = np.concatenate([b[1] for b in shuffled])
    np.testing.assert_array_equal(second, np.random.default_rng([3, 1]).permutation(10)[:8])
    forever = make_dataset(x, y, 4, shuffle=False, repeat=True, as_numpy=True)
    assert [next(forever)[1].tolist() for _ in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]
    splits = Splits(x["a"], y, x["a"][:3], y[:3], 10, [str(i) for i in range(10)])
    assert [b[1].tolist() for b in splits.test_dataset(2, as_numpy=True)] == [[0, 1], [2]]


# ------------------------------------------------------------------- without TensorFlow


@pytest.fixture
def no_tensorflow(monkeypatch):
    """TensorFlow not installed (as in the JAX env), on either env."""
    real = importlib.import_module

    def import_module(name, *args):
        if name.split(".")[0] == "tensorflow":
            raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
        return real(name, *args)

    monkeypatch.setattr(backend.importlib, "import_module", import_module)
    # require_tensorflow takes an already loaded TensorFlow from sys.modules (no import
    # machinery inside traced code): hide it there too.
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)


def test_tf_data_routes_without_tensorflow_name_the_numpy_route(no_tensorflow):
    stream = MultiTaskStream(_tasks(), batch_size=2)
    sampler = EpisodeSampler([np.zeros((4, 1))] * 3, ways=2, shots=1, queries=1)
    run = OfficialRun(np.zeros((2, 1)), np.arange(2), np.zeros((2, 1)), np.arange(2), "r")
    calls = {
        "MultiTaskStream.single_task_batches": lambda: stream.single_task_batches(),
        "MultiTaskStream.mixed_batches": lambda: stream.mixed_batches(),
        "MultiTaskStream.single_task_batch": lambda: stream.single_task_batch(0),
        "EpisodeSampler.dataset": lambda: sampler.dataset(),
        "EpisodeSampler.batch": lambda: sampler.batch(0),
        "EpisodeSampler.evaluation_dataset": lambda: sampler.evaluation_dataset(2),
        "stacked_batches": lambda: stacked_batches(lambda i: (np.ones((3, 1)),) * 2, 1, 2),
        "SinusoidTasks.dataset": lambda: SinusoidTasks().dataset(2),
        "make_dataset": lambda: make_dataset(np.zeros(3), np.zeros(3), 2),
        "official_runs_dataset": lambda: official_runs_dataset([run]),
    }
    for name, call in calls.items():
        with pytest.raises(ImportError) as error:
            call()
        message = str(error.value)
        gives = "tensors" if name.endswith("batch") else "a tf.data.Dataset"
        assert message.startswith(f"{name} ({gives}) needs TensorFlow"), message
        assert f"Instead: {name}(..., as_numpy=True)" in message, message
    with pytest.raises(ImportError, match=r"element_spec.*needs TensorFlow.*as_numpy=True"):
        sampler.element_spec
    with pytest.raises(ImportError, match=r"load_tfds.*needs TensorFlow.*tensorflow-cpu"):
        load_tfds("mnist")


def test_omniglot_reads_its_cache_without_tensorflow(tmp_path, no_tensorflow, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # no Pillow either: nothing decodes
    root = tmp_path / "omniglot"
    root.mkdir()
    with zipfile.ZipFile(root / "tiny.zip", "w") as zf:  # never decoded: read from the cache
        for c in (1, 2):
            zf.writestr(f"tiny/Latin/character{c:02d}/01{c:02d}_01.png", b"not decoded")
    with pytest.raises(ImportError, match="Decoding and resizing.*needs TensorFlow.*cache"):
        load_omniglot(root, sets=["tiny"], cache_dir=False)
    sources = [omniglot_module._Source(root, "tiny")]
    path = omniglot_module._cache_path(sources, 28, "lanczos3", tmp_path / "cache")
    images = np.random.default_rng(0).random((2, 28, 28, 1)).astype("float32")
    omniglot_module._write_cache(path, ["Latin/character01", "Latin/character02"], [1, 1], images)
    classes = load_omniglot(root, sets=["tiny"], cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(classes["Latin/character02"], images[1:])
    assert isinstance(pathlib.Path(path), pathlib.Path)


def test_omniglot_decodes_on_either_backend_as_tensorflow_does():
    """`tf.io.decode_png` + `tf.image.resize` (lanczos3, antialiased) on TensorFlow; Pillow
    + `keras.ops.image.resize` elsewhere: the same arrays (a golden written on TensorFlow),
    so the few-shot program's data do not depend on the backend."""
    from PIL import Image

    from golden_io import check_golden

    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(3):  # binary drawings, 105x105 as Omniglot's: random strokes
        img = np.full((105, 105), 255, np.uint8)
        for _ in range(6):
            r, c = rng.integers(5, 100, 2)
            img[r - 2 : r + 3, max(0, c - 20) : c + 20] = 0
            img[max(0, r - 20) : r + 20, c - 1 : c + 2] = 0
        buffer = io.BytesIO()
        Image.fromarray(img).convert("1").save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    full = omniglot_module._decode_images(pngs, None, "lanczos3")
    assert set(np.unique(full)) == {0.0, 1.0}  # strokes 1, exactly
    small = omniglot_module._decode_images(pngs, 28, "lanczos3")
    assert small.shape == (3, 28, 28, 1) and small.dtype == np.float32
    check_golden("omniglot_decode_lanczos3", {"full": full, "small": small}, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="could not decode PNG #1 of images"):
        omniglot_module._decode_images([pngs[0], b"not a png"], 28, "lanczos3")


def test_every_data_helper_and_callback_imports_without_tensorflow():
    """No name of tf_metaalign.data is left to a stand-in (a module that imports
    TensorFlow at top level would be, in the JAX env), nor is a callback."""
    import tf_metaalign.callbacks
    import tf_metaalign.data as data

    assert getattr(data, "_UNAVAILABLE", {}) == {}
    assert all(not isinstance(getattr(data, name), type(None)) for name in data.__all__)
    assert tf_metaalign.callbacks.__all__ == [
        "DivergenceGuard",
        "MultiTaskDiagnostics",
        "MultiWorkerBackupAndRestore",
    ]
