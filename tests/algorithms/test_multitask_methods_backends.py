"""The multi-task method zoo and gradient surgery on BOTH backends (no TensorFlow import).

* Golden files: every registry method (and the options that change its code path) runs
  `combine` for 6 steps on fixed float64 inputs (3 tasks, Gram matrices of fixed
  gradients, losses, an absent task at step 3, epochs 0, 0, 1, 1, 2, 2), its state carried
  from step to step (trainable state by an SGD step on its `state_gradients`), and every
  output (coefficients, loss weights, new state, state gradients) is compared with
  `tests/golden/multitask_<case>.npz`, written on TensorFlow: the TF env checks the file is
  still TensorFlow's result, the JAX env that JAX == TensorFlow.
* The NumPy oracles of the TensorFlow tests (`mtl_oracles.py`: LibMTL's weighting
  methods, PCGrad, GradVac, GradNorm, Nash-MTL, Aligned-MTL, FAMO re-derived) run here
  on whichever backend runs the module.
* float32 with JAX's x64 off: the same steps in float32 with an int32 step counter stay
  float32 (no float64 / int64 is requested: JAX's "not available" warnings are errors),
  close to the float64 goldens; with x64 on, the traced float32 step holds no 64-bit
  type at all.

Time (TF env, 2 busy cores): ~60 s for the module, most of it the eager solvers' loops."""

import warnings

import numpy as np
import pytest
from keras import ops
from keras.backend import standardize_dtype

from backends import on_jax, requires_jax
from golden_io import GOLDEN, check_golden
from mtl_oracles import (
    LibMTLUW,
    ReferenceFAMO,
    libmtl_aligned_numpy,
    libmtl_dwa,
    libmtl_nash_numpy,
    np_cagrad_exact_w,
    np_gradnorm,
    np_gradvac,
    np_libmtl_cagrad,
    np_libmtl_imtl,
    np_libmtl_mgda,
    np_pcgrad,
)
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms.multitask import base, get_method, method_names

BACKENDS = ("tensorflow", "jax")

T = 3
STEPS = 6
EPOCHS = (0, 0, 1, 1, 2, 2)
ABSENT_AT = {3: 1}  # step -> the task absent from that step's batch
SEED = 5
#: a gradient's two "shared variables": a [2, 2] kernel and a [3] bias (GradNorm's W is
#: the kernel)
SHAPES = ((2, 2), (3,))

#: case id -> (registry name, options). Every registry name appears.
CASES = {
    "sum": ("sum", {}),
    "rlw": ("rlw", {}),
    "uw": ("uw", {}),
    "dwa": ("dwa", {"temperature": 0.5}),
    "famo": ("famo", {"w_lr": 0.3, "gamma": 0.01, "min_losses": 0.05}),
    "gradnorm": ("gradnorm", {"learning_rate": 0.2}),
    "pcgrad": ("pcgrad", {}),
    "gradvac": ("gradvac", {"beta": 0.3}),
    "mgda": ("mgda", {}),
    "mgda_l2": ("mgda", {"normalization": "loss+"}),
    "cagrad": ("cagrad", {}),
    "cagrad_pgd": ("cagrad", {"solver": "pgd", "iterations": 60}),
    "imtl": ("imtl", {}),
    "imtl_g": ("imtl", {"learn_scales": False}),
    "nash_mtl": ("nash_mtl", {}),
    "nash_mtl_every2": ("nash_mtl", {"update_weights_every": 2, "max_norm": 0.5}),
    "aligned_mtl": ("aligned_mtl", {}),
    "aligned_mtl_median": ("aligned_mtl", {"scale_mode": "median"}),
}


#: TF == JAX tolerance where 1e-9 is too tight: the pgd solver's 60 unconverged momentum
#: steps (its step size from the largest eigenvalue, LAPACK's on TF and XLA's on JAX, 1e-16
#: apart) amplify rounding to ~7e-9 (measured).
GOLDEN_RTOL = {"cagrad_pgd": 1e-7}


def test_the_cases_cover_the_registry():
    assert {name for name, _ in CASES.values()} == set(method_names())


# ---------------------------------------------------------------- the fixed problem


def problem(step):
    """Step `step`'s task gradients G [T, 7] (conflicting), losses and presence."""
    rng = np.random.default_rng(1000 + step)
    shared = rng.normal(size=7)
    G = rng.normal(size=(T, 7)) * rng.uniform(0.3, 2.0, size=(T, 1))
    G = G + np.array([[1.0], [-0.7], [0.4]]) * shared
    losses = rng.uniform(0.3, 2.0, size=T) * 0.8**step
    present = np.ones(T)
    if step in ABSENT_AT:
        present[ABSENT_AT[step]] = 0.0
    return G * present[:, None], losses * present, present


class _Variable:
    """What a method reads of a shared variable: its shape and path."""

    def __init__(self, shape, path):
        self.shape, self.path = shape, path


SHARED_VARIABLES = [_Variable(s, f"shared/v{i}") for i, s in enumerate(SHAPES)]


def _split(g):
    parts, start = [], 0
    for shape in SHAPES:
        n = int(np.prod(shape))
        parts.append(np.reshape(g[start : start + n], shape))
        start += n
    return parts


def initial_state(method, dtype):
    """The state a trainer starts the method from (`state_spec`'s initializers)."""
    state = {}
    for key, spec in method.state_spec(T).items():
        init = spec.initializer
        value = {"zeros": 0.0, "ones": 1.0}.get(init, init)
        state[key] = np.full(spec.shape, float(value))
    return {k: ops.convert_to_tensor(v.astype(dtype)) for k, v in state.items()}


_COMPILED = {}


def combine_fn(method, jit=True):
    """`method.combine` as a function of (arrays, state) -> (shared, specific,
    loss_weights, state, state_gradients), the Combination's defaults filled in;
    `arrays` holds TaskInputs' tensors (losses, present, step, epoch, gram, task_grads).
    On JAX jitted (one compile per method and dtypes: run eagerly, the solvers' while
    loops would compile at every call), on TensorFlow eager."""

    def run(arrays, state):
        shared_variables = None if arrays.get("task_grads") is None else SHARED_VARIABLES
        inputs = base.TaskInputs(seed=SEED, shared_variables=shared_variables, **arrays)
        c = method.combine(inputs, state)
        specific = c.shared if c.specific is None else c.specific
        weights = specific if c.loss_weights is None else c.loss_weights
        return c.shared, specific, weights, dict(c.state), dict(c.state_gradients)

    if not (jit and on_jax()):
        return run
    import jax

    if id(method) not in _COMPILED:  # the method is kept alive with its function
        _COMPILED[id(method)] = (method, jax.jit(run))
    return _COMPILED[id(method)][1]


def step_arrays(G, losses, present, step, epoch=0, dtype="float64", step_dtype="int64"):
    """TaskInputs' tensors for gradient rows G (gram and task_grads, split into SHAPES)."""
    tensor = lambda x: ops.convert_to_tensor(np.asarray(x, dtype))  # noqa: E731
    return {
        "losses": tensor(losses),
        "present": tensor(present),
        "step": ops.convert_to_tensor(np.asarray(step, step_dtype)),
        "epoch": ops.convert_to_tensor(np.asarray(epoch, step_dtype)),
        "gram": tensor(G @ G.T),
        "task_grads": [[tensor(p) for p in _split(g)] for g in G],
    }


def combine_step(method, step, dtype, step_dtype, state, jit=True):
    """`method.combine` at `step` of the fixed problem, tensors in `dtype`."""
    arrays = step_arrays(*problem(step), step, EPOCHS[step], dtype, step_dtype)
    if not method.uses_gradients:  # as the trainer gives them
        arrays["gram"] = arrays["task_grads"] = None
    return base.Combination(*combine_fn(method, jit)(arrays, state))


def run_case(case, dtype="float64", step_dtype="int64"):
    """The 6 steps of `case`: {"s<k>_<output>": array}, and the dtypes seen."""
    name, options = CASES[case]
    method = get_method(name, **options)
    state = initial_state(method, dtype)
    out, dtypes = {}, set()
    for step in range(STEPS):
        c = combine_step(method, step, dtype, step_dtype, state)
        arrays = {"shared": c.shared, "specific": c.specific, "loss_weights": c.loss_weights}
        arrays.update({f"state_{k}": v for k, v in c.state.items()})
        arrays.update({f"grad_{k}": v for k, v in c.state_gradients.items()})
        for key, value in arrays.items():
            dtypes.add(standardize_dtype(value.dtype))
            out[f"s{step}_{key}"] = np.asarray(ops.convert_to_numpy(value))
        state = {**state, **c.state}
        for key, grad in c.state_gradients.items():  # the optimizer's (SGD) step
            state[key] = state[key] - ops.cast(grad, dtype) * np.asarray(0.1, dtype)
    return out, dtypes


# ---------------------------------------------------------------- TF == JAX (goldens)


@pytest.mark.parametrize("case", list(CASES))
def test_combine_matches_the_tensorflow_golden(float64, case):
    arrays, dtypes = run_case(case)
    assert dtypes == {"float64"}
    check_golden(f"multitask_{case}", arrays, rtol=GOLDEN_RTOL.get(case, 1e-9), atol=1e-13)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_with_an_int32_step_stays_float32_and_near_float64(case):
    """No float64 / int64 requested (on JAX with x64 off such a request is a warning,
    here an error); float32 results within float32 rounding (amplified by the solvers'
    conditioning) of the float64 goldens."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*requested in .* is not available")
        arrays, dtypes = run_case(case, "float32", "int32")
    assert dtypes == {"float32"}
    with np.load(GOLDEN / f"multitask_{case}.npz") as golden:
        assert set(golden.files) == set(arrays)
        for key in golden.files:
            want = golden[key]
            scale = max(np.abs(want).max(), 1e-3)
            np.testing.assert_allclose(arrays[key], want, rtol=2e-3, atol=2e-4 * scale, err_msg=key)


@requires_jax
@pytest.mark.parametrize("case", list(CASES))
def test_jitted_float32_step_holds_no_64_bit_type(float64, case):
    """With x64 ON (float64 available), a float32 step with an int32 counter, traced by
    jax.jit, holds no float64 anywhere (nothing silently widens to it) and no uint64 (the
    hash is uint32). (int64 does appear with x64 on: Keras's own ops turn python int
    literals and loop counters into the default int, int32 without x64.) Tracing only:
    the other tests run the steps jitted."""
    import jax

    name, options = CASES[case]
    method = get_method(name, **options)
    state = initial_state(method, "float32")

    def step_fn(state):
        c = combine_step(method, 3, "float32", "int32", state, jit=False)
        return c.shared, c.specific, c.loss_weights, c.state, c.state_gradients

    jaxpr = str(jax.make_jaxpr(step_fn)(state))
    for wide in ("f64", "u64"):
        assert wide not in jaxpr, f"{case}: {wide} in the traced step"


def test_random_draws_are_the_same_for_int32_int64_and_python_steps(float64):
    """The uint32 hash: the same order / normal draws from a python, int32 and int64
    step (below 2^31), pinned to TensorFlow's numbers of earlier versions."""
    orders = []
    for step in (0, 1, 2, 3, 17, 2**31 - 1):
        draws = [
            (
                np.asarray(GS.random_order(5, 7, s)).tolist(),
                np.asarray(base.random_normal(7, s, 3, dtype="float64")),
            )
            for s in (
                step,
                ops.convert_to_tensor(np.int32(step)),
                ops.convert_to_tensor(np.int64(step)),
            )
        ]
        for order, normal in draws[1:]:
            assert order == draws[0][0]
            np.testing.assert_array_equal(normal, draws[0][1])
        assert sorted(draws[0][0]) == [0, 1, 2, 3, 4]
        orders.append(draws[0][0])
    # TensorFlow's int64 hash of earlier versions (tf.bitwise on int64 / uint32)
    assert orders == [
        [2, 3, 1, 4, 0],
        [3, 4, 0, 2, 1],
        [1, 0, 4, 2, 3],
        [1, 0, 3, 4, 2],
        [0, 3, 4, 1, 2],
        [4, 3, 0, 1, 2],
    ]


# ---------------------------------------------------------------- NumPy oracles


def _tensor(x):
    return ops.convert_to_tensor(np.asarray(x, np.float64))


def _combine(method, G, losses, present, state=None, step=0, epoch=0):
    """One (jitted on JAX) combine on float64 arrays; numpy outputs."""
    arrays = step_arrays(G, losses, present, step, epoch)
    state = {k: _tensor(v) for k, v in (state or {}).items()}
    shared, specific, weights, new_state, grads = combine_fn(method)(arrays, state)
    return base.Combination(
        _np(shared),
        _np(specific),
        _np(weights),
        {k: _np(v) for k, v in new_state.items()},
        {k: _np(v) for k, v in grads.items()},
    )


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


def test_pcgrad_and_gradvac_equal_their_numpy_references(float64):
    """PCGrad (tianheyu927/PCGrad, Algorithm 1) and GradVac (LibMTL, 3 steps of EMA
    targets, an absent task at the last) on the gradients and on the Gram matrix."""
    targets, targets_np = _tensor(np.zeros((T, T))), np.zeros((T, T))
    moved = False
    for step in range(3):
        G, losses, present = problem(step if step < 2 else 3)
        vectors = list(G)
        grads = [[_tensor(p) for p in _split(g)] for g in G]
        order = np.asarray(GS.random_order(T, SEED, step))
        flat = np.concatenate([_np(g).ravel() for g in GS.pcgrad(grads, order)])
        np.testing.assert_allclose(flat, np_pcgrad(vectors, order), rtol=1e-12, atol=1e-12)
        method = _combine(get_method("pcgrad"), G, losses, present, step=step)
        np.testing.assert_allclose(
            method.shared @ G, np_pcgrad(vectors, order), rtol=1e-12, atol=1e-12
        )
        result = GS.gradvac_coefficients(GS.gram_matrix(grads), targets, order, beta=0.3)
        expected, targets_np = np_gradvac(vectors, targets_np, order, beta=0.3)
        targets = result.targets
        np.testing.assert_allclose(_np(result.coefficients) @ G, expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(targets), targets_np, rtol=1e-12, atol=1e-14)
        moved |= not np.allclose(expected, np.sum(vectors, axis=0))
    assert moved


def test_gradnorm_update_equals_the_numpy_reference(float64):
    rng = np.random.default_rng(2)
    w = np.ones(T)
    for _ in range(3):
        norms, losses, initial = (
            rng.uniform(0.5, 2, T),
            rng.uniform(0.5, 2, T),
            rng.uniform(1, 2, T),
        )
        present = np.array([1.0, 1.0, 0.0])
        new = _np(GS.gradnorm_update(_tensor(w), norms, losses, initial, present, 1.5, 0.1))
        np.testing.assert_allclose(new, np_gradnorm(w, norms, losses, initial, present, 1.5, 0.1))
        w = new
    assert not np.allclose(w, 1.0)


@pytest.mark.parametrize("normalization", ["none", "l2", "loss", "loss+"])
def test_mgda_equals_libmtl(float64, normalization):
    method = get_method("mgda", normalization=normalization)
    for step in range(STEPS):
        G, losses, present = problem(step)
        shared = _combine(method, G, losses, present).shared
        idx = np.flatnonzero(present)
        expected, _ = np_libmtl_mgda(G[idx], losses[idx], normalization)
        np.testing.assert_allclose(
            shared @ G, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max()
        )
        assert np.all(shared[present == 0] == 0.0)


@pytest.mark.parametrize("rescale", [0, 1, 2])
def test_cagrad_equals_libmtl_on_the_exact_dual(float64, rescale):
    method = get_method("cagrad", rescale=rescale)
    for step in range(STEPS):
        G, losses, present = problem(step)
        shared = _combine(method, G, losses, present).shared
        sub = G[np.flatnonzero(present)]
        expected, _ = np_libmtl_cagrad(sub, rescale=rescale, w=np_cagrad_exact_w(sub))
        np.testing.assert_allclose(shared @ G, expected, rtol=1e-9, atol=1e-11)


def test_imtl_equals_libmtl_over_steps(float64):
    method, s = get_method("imtl"), np.zeros(T)
    for step in range(STEPS):
        G, losses, present = problem(step)
        c = _combine(method, G, losses, present, {"loss_scale": s})
        idx = np.flatnonzero(present)
        new, alpha, scale, grad_s = np_libmtl_imtl(G[idx], losses[idx], s[idx])
        np.testing.assert_allclose(c.shared @ G, new, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(c.specific, np.exp(s), rtol=1e-15)
        grad = c.state_gradients["loss_scale"]
        np.testing.assert_allclose(grad[idx], grad_s, rtol=1e-14)
        s = s - 0.3 * grad
    assert np.any(s != 0.0)


def test_nash_and_aligned_equal_their_numpy_references(float64):
    nash_method, aligned_method = get_method("nash_mtl"), get_method("aligned_mtl")
    for step in range(STEPS):
        G, losses, present = problem(step)
        nash = _combine(nash_method, G, losses, present, {"prev_alpha": np.ones(T)})
        alpha, shared = libmtl_nash_numpy(G, present)
        np.testing.assert_allclose(nash.specific, alpha, rtol=1e-11)
        np.testing.assert_allclose(nash.shared @ G, shared, rtol=1e-10, atol=1e-13)
        aligned = _combine(aligned_method, G, losses, present)
        idx = np.flatnonzero(present)
        want = np.zeros(T)
        want[idx] = libmtl_aligned_numpy(G[idx])
        np.testing.assert_allclose(aligned.shared, want, rtol=1e-10, atol=1e-14)


def test_uw_dwa_and_famo_equal_their_references(float64):
    """UW (LibMTL, s trained by SGD), DWA (LibMTL's epoch buffer, 4 epochs of 2 steps),
    FAMO (the official code, full batch: step k+1's losses are the re-computed ones)."""
    uw, ref = get_method("uw"), LibMTLUW(T)
    s = np.full(T, -0.5)
    zeros = np.zeros((T, sum(int(np.prod(shape)) for shape in SHAPES)))
    for step in range(STEPS):
        _, losses, present = problem(step)
        c = _combine(uw, zeros, losses, present, {"log_variances": s}, step)
        weights, loss, grad = ref.backward(losses, present)
        np.testing.assert_allclose(c.shared, weights, rtol=1e-12)
        np.testing.assert_allclose(np.sum(c.loss_weights * losses), loss, rtol=1e-12)
        np.testing.assert_allclose(c.state_gradients["log_variances"], grad, rtol=1e-12)
        s = s - 0.3 * c.state_gradients["log_variances"]
        ref.loss_scale = ref.loss_scale - 0.3 * grad

    rng = np.random.default_rng(3)
    epoch_losses = [[0.8**e * rng.uniform(0.5, 2.0, T) for _ in range(2)] for e in range(4)]
    dwa = get_method("dwa", temperature=0.5)
    state, ours = {k: _np(v) for k, v in initial_state(dwa, "float64").items()}, []
    for e, batches in enumerate(epoch_losses):
        for losses in batches:
            c = _combine(dwa, zeros, losses, np.ones(T), state, epoch=e)
            state = c.state
            ours.append(c.shared)
    np.testing.assert_allclose(ours, libmtl_dwa(epoch_losses, T, 0.5), rtol=1e-12)
    assert not np.allclose(ours[-1], 1.0)

    options = {"w_lr": 0.3, "gamma": 0.01, "min_losses": 0.05}
    famo, ref = get_method("famo", **options), ReferenceFAMO(T, **options)
    steps = [np.maximum(rng.uniform(0.2, 2.0, T) * 0.7**k, 0.1) for k in range(5)]
    state = {k: _np(v) for k, v in initial_state(famo, "float64").items()}
    for k, losses in enumerate(steps):
        want = ref.backward(losses)
        c = _combine(famo, zeros, losses, np.ones(T), state, k)
        state = c.state
        np.testing.assert_allclose(c.shared, want, rtol=1e-12)
        np.testing.assert_allclose(state["logits"], ref.w, rtol=1e-12, atol=1e-15)
        if k + 1 < len(steps):
            ref.update_w(steps[k + 1])
    assert not np.allclose(state["logits"], 0.0)


def test_the_jax_env_imports_no_tensorflow():
    import sys

    if on_jax():
        assert "tensorflow" not in sys.modules
