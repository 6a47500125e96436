"""The seam between the backends (`tf_metaalign.backend`, `functional`, `MetaTrainer`'s step),
checked on both: numerical oracles, a trainer step == Keras's own fit, state assigned inside
conditional branches, the non-finite-loss guard, TensorFlow == JAX (golden) and, on JAX,
1 device == 2 devices. Default run: ~20 s per backend on 2 cores."""

import re

import keras
import numpy as np
import pytest
from backends import data_parallel, on_jax
from golden_io import check_golden, set_numpy_weights
from keras import ops

from tf_metaalign import functional as F
from tf_metaalign.trainers import MetaTrainer

BACKENDS = ("tensorflow", "jax")


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


# ------------------------------------------------------------------- oracles


def test_scalar_is_exact_and_algebra_matches_numpy(float64):
    assert float(_np(F.scalar(0.4, "float64"))) == 0.4
    assert _np(F.scalar(3, "int32")).dtype == np.int32
    rng = np.random.default_rng(0)
    a = [rng.normal(size=(3, 2)), rng.normal(size=(4,))]
    b = [rng.normal(size=(3, 2)), rng.normal(size=(4,))]
    ta, tb = [ops.convert_to_tensor(x) for x in a], [ops.convert_to_tensor(x) for x in b]
    dot = sum(float(np.sum(x * y)) for x, y in zip(a, b))
    norm = np.sqrt(sum(float(np.sum(x * x)) for x in a))
    np.testing.assert_allclose(_np(F.dot(ta, tb)), dot, rtol=1e-14)
    np.testing.assert_allclose(_np(F.global_norm(ta)), norm, rtol=1e-14)
    assert F.accumulation_dtype(ta) == "float64"
    assert float(_np(F.cosine(ta, F.zeros_like(tb)))) == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        F.dot(ta, tb[:1])


def _quadratic_loss_fn(A, c):
    """L(w) = 0.5 w^T A w + c^T w on one parameter vector (a "model" for the autodiff seam)."""

    def loss_fn(params, state, batch):
        (w,) = params
        value = 0.5 * ops.sum(w * ops.matmul(A, w)) + ops.sum(c * w)
        return value, (state, None)

    return loss_fn


def test_value_grad_and_hvp_are_exact_on_a_quadratic(float64):
    rng = np.random.default_rng(1)
    M = rng.normal(size=(5, 5))
    A, c, w, v = M + M.T, rng.normal(size=5), rng.normal(size=5), rng.normal(size=5)
    loss_fn = _quadratic_loss_fn(ops.convert_to_tensor(A), ops.convert_to_tensor(c))
    params = [ops.convert_to_tensor(w)]
    value, grads, _ = F.value_and_grad(loss_fn, params, [], None)
    np.testing.assert_allclose(_np(value), 0.5 * w @ A @ w + c @ w, rtol=1e-13)
    np.testing.assert_allclose(_np(grads[0]), A @ w + c, rtol=1e-13)
    _, grads2, _, hv = F.value_grad_and_hvp(loss_fn, params, [], None, [ops.convert_to_tensor(v)])
    np.testing.assert_allclose(_np(grads2[0]), A @ w + c, rtol=1e-13)
    np.testing.assert_allclose(_np(hv[0]), A @ v, rtol=1e-12)


def test_jvp_matches_the_jacobian(float64):
    rng = np.random.default_rng(2)
    J, x, t = rng.normal(size=(3, 4)), rng.normal(size=4), rng.normal(size=4)
    Jt = ops.convert_to_tensor(J)
    out, tangent = F.jvp(
        lambda z: ops.tanh(ops.matmul(Jt, z)),
        [ops.convert_to_tensor(x)],
        [ops.convert_to_tensor(t)],
    )
    np.testing.assert_allclose(_np(out), np.tanh(J @ x), rtol=1e-13)
    np.testing.assert_allclose(_np(tangent), (1 - np.tanh(J @ x) ** 2) * (J @ t), rtol=1e-12)


# ------------------------------------------------------------------- a trainer


class PlainTrainer(MetaTrainer):
    """The base's contract at its simplest: Keras's own gradient step, plus a conditional
    branch that assigns state (a counter every 2nd step) and a diagnostic."""

    backends = ("tensorflow", "jax")

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.every = self.every_k_steps(2, "every_two")
        self.firsts = self.add_state_variable("firsts")
        self.add_diagnostic("grad_norm")

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        loss, grads, (new_state, y_pred) = F.value_and_grad(
            self.loss_fn(),
            F.current_params(self.model),
            F.current_state(self.model),
            (x, y, sample_weight),
        )

        def count():
            self.firsts.assign_add(ops.convert_to_tensor(1.0, self.firsts.dtype))
            return ops.convert_to_tensor(1.0, "float32")

        F.cond(self.every.is_first(), count, lambda: ops.convert_to_tensor(0.0, "float32"))
        return self.finish_step(
            data,
            y_pred,
            loss,
            new_state=new_state,
            gradients=grads,
            diagnostics={"grad_norm": F.global_norm(grads)},
        )


def _model(seed=3):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.0),
            keras.layers.Dense(1),
        ]
    )
    set_numpy_weights(model, seed)  # the same on both backends
    return model


def _data(n=48):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 4)).astype(keras.backend.floatx())
    return x, (x @ rng.normal(size=(4, 1))).astype(keras.backend.floatx())


@pytest.mark.parametrize("jit_compile", [True, False])
def test_trainer_step_equals_keras_fit(float64, jit_compile):
    x, y = _data()
    plain = _model()
    plain.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _model()
    trainer = PlainTrainer(model)
    trainer.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
    history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # 6 steps: the branch ran on steps 0, 2, 4; counters and the epoch count are state.
    assert float(_np(trainer.firsts.value)) == 3.0
    assert int(_np(trainer.every.count.value)) == 6
    assert set(history.history) == {"loss", "grad_norm"}
    np.testing.assert_allclose(trainer.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0))


class EveryThreeTrainer(PlainTrainer):
    """PlainTrainer whose conditional branch runs on the LAST step of every 3 (and counts
    the steps the step itself saw as first-of-period, the flag it does not branch on)."""

    def __init__(self, model, **kwargs):
        MetaTrainer.__init__(self, model, **kwargs)
        self.every = self.every_k_steps(3, "every_three")
        self.firsts = self.add_state_variable("firsts")
        self.lasts = self.add_state_variable("lasts")
        self.add_diagnostic("grad_norm")

    traces = 0  # train_step bodies run (once per JAX trace; every step when eager)

    def train_step(self, data):
        EveryThreeTrainer.traces += 1

        def count():
            self.lasts.assign_add(ops.convert_to_tensor(1.0, self.lasts.dtype))
            return ops.convert_to_tensor(1.0, "float32")

        F.cond(self.every.is_last(), count, lambda: ops.convert_to_tensor(0.0, "float32"))
        return super().train_step(data)


def test_every_k_schedules_pick_a_program_on_the_host(float64):
    """On JAX a jitted step is compiled once per combination of the flags (`is_first`,
    `is_last`) it asks of its "every k" schedules, the program picked on the host from the
    counters read at the start of fit (no lax.cond); it equals the eager run, and a second
    fit (resumed from the counters' state, mid-period) adds no program."""
    x, y = _data(56)  # 7 steps of 8: the second fit starts at phase 1 of 3
    runs = {}
    for jit_compile in (True, False):
        trainer = EveryThreeTrainer(_model())
        trainer.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
        EveryThreeTrainer.traces = 0
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        first_fit = EveryThreeTrainer.traces
        trainer.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)
        runs[jit_compile] = trainer
        if jit_compile and on_jax():
            # is_first and is_last asked: programs for (first), (last), (neither); the
            # second fit (steps 7, 8, 9: phases 1, 2, 0) needs none of its own.
            assert (first_fit, EveryThreeTrainer.traces) == (3, 3), EveryThreeTrainer.traces
    jit, eager = runs[True], runs[False]
    assert float(_np(jit.firsts.value)) == 4.0 and float(_np(jit.lasts.value)) == 3.0
    assert int(_np(jit.every.count.value)) == 10
    for trainer in (jit, eager):
        # A counter set outside fit (e.g. restored weights) is read again: phase 2 is last.
        trainer.every.count.assign(2)
        trainer.train_on_batch(x[:8], y[:8])
    assert float(_np(jit.lasts.value)) == 4.0 and float(_np(jit.firsts.value)) == 4.0
    for a, b in zip(jit.model.get_weights(), eager.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for name in ("firsts", "lasts"):
        assert float(_np(getattr(eager, name).value)) == float(_np(getattr(jit, name).value))


def test_steps_per_execution_equals_one_step_at_a_time(float64):
    x, y = _data()
    weights = []
    for steps in (1, 3):
        model = _model()
        trainer = PlainTrainer(model)
        trainer.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=steps)
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
        assert float(_np(trainer.firsts.value)) == 3.0
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_tensorflow_equals_jax_golden(float64):
    # SGD: Keras's own Adam differs between its backends at float64 (TF casts the python
    # betas through float32: 6.7e-6 relative on a first step; see docs/tpu.md).
    x, y = _data()
    model = _model()
    trainer = PlainTrainer(model)
    trainer.compile(keras.optimizers.SGD(0.05), "mse")
    history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays["loss"] = np.array(history.history["loss"])
    arrays["grad_norm"] = np.array(history.history["grad_norm"])
    check_golden("seam_plain_trainer", arrays)


def test_nonfinite_loss_stops_fit_and_keeps_the_weights():
    x, y = _data()
    y[20] = np.nan  # the second batch of 16
    model = _model()
    trainer = PlainTrainer(model)
    trainer.compile(keras.optimizers.SGD(0.01), "mse")
    before = model.get_weights()
    with pytest.raises(Exception, match="not finite"):
        trainer.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for w in model.get_weights():
        assert np.all(np.isfinite(w))
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_one_device_equals_two_devices_on_jax(float64):
    if not on_jax():
        pytest.skip("keras.distribution runs on JAX (TensorFlow: the battery's replicas check)")
    x, y = _data(64)
    results = []
    for n in (1, 2):
        with data_parallel(n):
            model = _model()
            trainer = PlainTrainer(model)
            trainer.compile(keras.optimizers.Adam(0.01), "mse")
            trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_import_and_unported_trainers_name_their_backend():
    import tf_metaalign

    assert tf_metaalign.backend.name == keras.backend.backend()
    if on_jax():
        # A trainer not moved to JAX yet (issue 30 moves them one by one; MAMLTrainer is):
        # its stand-in name raises on access, or its class on construction.
        unported = []
        for name in tf_metaalign.trainers.__all__:
            try:
                cls = getattr(tf_metaalign.trainers, name)
            except ImportError as error:
                unported.append(error)
                continue
            if isinstance(cls, type) and "jax" not in getattr(cls, "backends", ("jax",)):
                try:
                    cls(_model())
                except (ImportError, NotImplementedError) as error:
                    unported.append(error)
        if not unported:
            pytest.skip("every trainer runs on JAX")
        assert re.search("TensorFlow|tensorflow", str(unported[0])), unported[0]


#: the library's modules that are TensorFlow code by design, never imported on JAX:
#: the backend's TensorFlow half, forward-mode tangents of TF ops (`tf_metaalign.forward_mode`
#: is a stub naming TensorFlow there), MultiTaskTrainer's TF-only paths and the static
#: task-count checks of the loop-over-tasks trainers (on JAX shapes are concrete).
TENSORFLOW_ONLY_MODULES = {
    "tf_metaalign.backend.tensorflow",
    "tf_metaalign.forward_mode",
    "tf_metaalign.trainers.multitask_tf",
    "tf_metaalign.trainers.task_batches",
}


def test_import_on_jax_loads_no_tensorflow():
    """`import tf_metaalign` and every module of the library but TENSORFLOW_ONLY_MODULES,
    under KERAS_BACKEND=jax, import no TensorFlow (even where it is installed) and none of
    the programs (`trainers`) or tests (a fresh interpreter); without TensorFlow installed,
    each of TENSORFLOW_ONLY_MODULES does need it (the list only shrinks)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("jax") is None:
        pytest.skip("needs jax installed")
    code = (
        "import importlib, importlib.util, pkgutil, sys, tf_metaalign\n"
        "from tf_metaalign import trainers, algorithms, functional, backend\n"
        "assert backend.name == 'jax'\n"
        f"tf_only = {sorted(TENSORFLOW_ONLY_MODULES)!r}\n"
        "names = [m.name for m in pkgutil.walk_packages(tf_metaalign.__path__, 'tf_metaalign.')]\n"
        "assert set(tf_only) <= set(names), sorted(set(tf_only) - set(names))\n"
        "for name in names:\n"
        "    if name not in tf_only:\n"
        "        importlib.import_module(name)\n"
        "assert len(names) > 50, names\n"
        "leaked = [m for m in sys.modules if m.split('.')[0] in ('trainers', 'tests')]\n"
        "assert not leaked, leaked\n"
        "if importlib.util.find_spec('tensorflow') is None:\n"
        "    for name in tf_only:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except ModuleNotFoundError as error:\n"
        "            assert error.name == 'tensorflow', (name, error)\n"
        "        else:\n"
        "            raise AssertionError(name + ' imports without TensorFlow: unlist it')\n"
        "print('tensorflow' in sys.modules)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
