"""Every optimizer of `tf_metaalign.optimizers` on both backends (backend-neutral: no
TensorFlow import).

* TensorFlow == JAX at float64: each registry entry's trajectory (weights after every
  step, slots and `iterations` after the last) on a (128, 130) matrix (Adafactor factors
  it), a (6, 5, 5) tensor (the Mesh TF tie-break, `adafactor_tiebreak`), a "bias" and a
  "layer_norm" vector (BERT's decay exclusion by name), against golden files written on
  TensorFlow (`golden_io`); the schedules' values over steps likewise.
* `model.fit` on each backend in float32 (x64 off on JAX): the loss falls.
"""

import sys

import keras
import numpy as np
import pytest
from golden_io import check_golden
from optimizer_registry import REGISTRY

from tf_metaalign import optimizers as O

BACKENDS = ("tensorflow", "jax")

CASES = dict(REGISTRY)
CASES_EXTRA = {
    # Mesh TF's tie-break: a (6, 5, 5) variable factors axes 0 and 1.
    "adafactor_tiebreak": lambda: O.Adafactor(0.01, beta_1=0.9, min_dim_size_to_factor=2),
}
NAMES = sorted(CASES) + sorted(CASES_EXTRA)
SHAPES = {"kernel": (128, 130), "cube": (6, 5, 5), "bias": (7,), "layer_norm_gamma": (5,)}
STEPS = 4


def _factory(name):
    return CASES_EXTRA[name] if name in CASES_EXTRA else CASES[name].factory


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float64")


def _summary(key, value):
    """A big matrix as its first rows and column sums (keeps the golden small)."""
    if value.ndim == 2 and value.size > 1000:
        return {f"{key}/row0": value[0], f"{key}/colsum": value.sum(axis=0)}
    return {key: value}


@pytest.mark.parametrize("name", NAMES)
def test_trajectory_equals_tensorflow(name, float64):
    rng = np.random.default_rng(7)
    variables = [
        keras.Variable(rng.normal(size=shape), dtype="float64", name=key)
        for key, shape in SHAPES.items()
    ]
    optimizer = _factory(name)()
    out = {}
    for step in range(STEPS):
        grads = [keras.ops.convert_to_tensor(rng.normal(size=v.shape)) for v in variables]
        optimizer.apply_gradients(zip(grads, variables))
        for key, v in zip(SHAPES, variables):
            out.update(_summary(f"step{step}/{key}", _np(v)))
    for key, v in zip(SHAPES, variables):
        for slot, s in optimizer.slots_for(v).items():
            out.update(_summary(f"slot/{key}/{slot}", _np(s)))
    out["iterations"] = _np(optimizer.iterations)
    if name == "adafactor_tiebreak":
        assert optimizer.options_for(variables[1])["factored_dims"] == (1, 0)
        assert tuple(optimizer.slots_for(variables[1])["v_row"].shape) == (5, 5)
    check_golden(f"optimizers_{name}", out)


SCHEDULES = {
    "t5": lambda: O.T5InverseSquareRootSchedule(4, scale=0.5),
    "bert": lambda: O.BertSchedule(0.01, num_train_steps=10, num_warmup_steps=3, power=2.0),
    "pegasus": lambda: O.PegasusSchedule(0.01, warmup_steps=3, decay_start_step=5),
    "relative": lambda: O.AdafactorRelativeStep(False),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_values_equal_tensorflow(name, float64):
    schedule = SCHEDULES[name]()
    values = [_np(schedule(keras.ops.convert_to_tensor(step))) for step in range(12)]
    check_golden(f"optimizers_schedule_{name}", {"values": np.stack(values)})


def test_recadam_anneal_equals_tensorflow(float64):
    steps = keras.ops.convert_to_tensor(np.arange(1.0, 9.0))
    out = {
        fun: _np(O.anneal_lambda(fun, steps, k=0.8, t0=3.0, weight=0.9))
        for fun in ("sigmoid", "linear", "constant")
    }
    check_golden("optimizers_recadam_anneal", out)


@pytest.mark.parametrize("name", NAMES)
def test_fit_float32(name):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x @ rng.normal(size=(3, 2))).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(_factory(name)(), "mse")
    history = model.fit(x, y, epochs=3, batch_size=8, verbose=0).history["loss"]
    assert np.all(np.isfinite(history))
    assert history[-1] < history[0]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 12


def test_import_needs_no_tensorflow_on_jax():
    if keras.backend.backend() != "jax":
        pytest.skip("JAX env")
    import subprocess

    code = (
        "import sys, numpy as np, keras\n"
        "sys.path.insert(0, 'tests')\n"
        "from tf_metaalign import optimizers\n"
        "from optimizer_registry import REGISTRY\n"
        "for c in REGISTRY.values(): c.factory()\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: O.Adafactor(0.01, decay_rate=1.5), "decay_rate"),
        (lambda: O.Adafactor(0.01, factoring="rows"), "factoring"),
        (lambda: O.Lamb(0.01, beta_1=1.0), "beta_1"),
        (lambda: O.AdamWeightDecay(-1.0), "learning_rate"),
        (lambda: O.AdamWeightDecay(0.01, exclude_from_weight_decay=[1]), "exclude_from"),
        (lambda: O.RecAdam(0.01, anneal_fun="cosine"), "anneal_fun"),
        (lambda: O.BertSchedule(0.01, num_train_steps=0), "num_train_steps"),
    ],
)
def test_bad_input_errors_name_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def _one_case_per_class():
    seen, names = set(), []
    for name in NAMES:
        optimizer = _factory(name)()
        key = (type(optimizer).__name__, type(getattr(optimizer, "_learning_rate", None)).__name__)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


@pytest.mark.parametrize("name", _one_case_per_class())
def test_saved_and_reloaded_run_equals_the_uninterrupted_one(name, tmp_path):
    """model.save (weights and optimizer state: slots, iterations, RecAdam's pretrained copy)
    then keras.saving.load_model and two more steps == four steps without the round trip,
    on a kernel large enough for Adafactor to factor (128 x 130)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 128)).astype("float32")
    y = (x @ rng.normal(size=(128, 130)) / 10).astype("float32")

    def model():
        m = keras.Sequential([keras.Input((128,)), keras.layers.Dense(130)])
        m.set_weights([np.full((128, 130), 0.01, "float32"), np.zeros(130, "float32")])
        m.compile(_factory(name)(), "mse")
        return m

    uninterrupted = model()
    uninterrupted.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    first = model()
    first.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    first.save(tmp_path / "model.keras")
    resumed = keras.saving.load_model(tmp_path / "model.keras")
    assert type(resumed.optimizer) is type(first.optimizer)
    resumed.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    assert int(_np(resumed.optimizer.iterations)) == 4
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(resumed.optimizer.variables, uninterrupted.optimizer.variables):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-6, atol=1e-7, err_msg=a.path)
