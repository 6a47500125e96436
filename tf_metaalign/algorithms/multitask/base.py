"""The engine every multi-task method runs on: what a method sees at a step, what it
returns, its state, and the registry that the trainer, the programs, the tests and the
docs read.

A method is one small object (LibMTL's `weighting/<Method>.py`, optax's
`GradientTransformation`): its hyperparameters are constructor arguments, its state is
declared by `state_spec(num_tasks)` (the trainer creates the variables, checkpoints them
and hands their values back each step), and `combine(inputs, state)` turns the step's
global per-task losses and gradients into a `Combination`:

    shared gradient          = sum_t shared[t]   * g_t   (g_t on the SHARED variables)
    task-specific gradient   = sum_t specific[t] * g_t   (g_t on the TASK-SPECIFIC variables)
    reported loss            = sum_t loss_weights[t] * L_t

Every method in the zoo is such a linear combination of the task gradients (PCGrad's
projections, GradVac, MGDA's min-norm point, CAGrad, Nash-MTL, IMTL-G and Aligned-MTL
all are), which is what lets the trainer compute the Gram matrix once, run the method on
T x T numbers, and combine the gradients in one pass.

Shared vs task-specific variables (LibMTL's default `rep_grad=False`): gradient
surgery and loss weighting act on the SHARED variables; a task-specific variable (a
per-task head) receives its own task's gradient, times that task's loss weight for the
loss-weighting methods (`specific = loss weights`) and unweighted for the gradient
methods (`specific = 1`: LibMTL's task-specific parameters keep the raw gradients of the
per-task backward passes). Other tasks' gradients are zero on a task's own head, so
`sum_t specific[t] g_t` there is exactly "its own task's gradient".

Methods that need no per-task gradients (`uses_gradients = False`: equal, random and
uncertainty weighting, DWA, FAMO) get `inputs.gram = inputs.task_grads = None`, and the
trainer takes ONE backward pass of `sum_t shared[t] L_t` instead of T (they must then
return `specific == shared`).

Sparse gradients. The gradient of that one backward pass goes to the optimizer as the
tape returns it, as in Keras's own `fit`: an Embedding's gradient stays
`tf.IndexedSlices`, which Keras's optimizers apply slice by slice (a token repeated in a
batch adds the SUM of its slices' squares to Adam's / RMSprop's second moment or
Adagrad's accumulator), and a variable no loss reaches gets None. So "sum" is plain
multi-output `fit` to the bit on a model with embeddings. A gradient method
(`uses_gradients = True`) must densify: the trainer stacks the T task gradients, takes
their Gram matrix and combines them as dense tensors (`functional.dense_gradient`), and
the optimizer gets the dense combination (a repeated token adds the square of its
summed gradient; an unreached variable gets zeros). The same holds for a loss-weighting
method run with `MultiTaskTrainer(measure_task_cosine=True)`, whose update is then
combined from the dense task gradients.

Backends. Every method is pure algebra written once in `keras.ops`: it runs on
TensorFlow and on JAX, eager and compiled, and computes in the dtype of
`inputs.losses` (float64 only when the model computes in float64: with JAX's x64 off
nothing here creates a float64 or int64 tensor). Its non-trainable state is created in
the trainer's variable dtype (`StateSpec.dtype=None`): float32 unless the model computes
in float64, where it is float64.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Optional

import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from tf_metaalign import functional as F

_REGISTRY: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state variable of a method: created by the trainer in the strategy scope,
    checkpointed, named `<method name>_<key>` unless `name` is given (kept for the names
    of earlier versions' checkpoints). `trainable=True`: trained by the compiled
    optimizer with the gradient the method returns in `Combination.state_gradients`
    (UW's log-variances, as LibMTL trains them with the model's optimizer).

    A method computes its state in the dtype of `inputs.losses` and reads it cast to
    that dtype, so the state's dtype follows the computation: `dtype=None` (the default)
    is the trainer's variable dtype (`keras.backend.floatx()` when it was built: float64
    only where the model computes in float64; float32 under mixed precision), which
    holds every value a float32 computation produces exactly (earlier versions stored
    float64 state: the same numbers, and such a checkpoint loads into float32 state).

    Attributes:
      shape: the variable's shape.
      dtype: its dtype (None: the trainer's variable dtype, above).
      initializer: a Keras initializer (name or object).
      trainable: trained by the compiled optimizer (above).
      name: the variable's name (None: `<method name>_<key>`).

    Example:
      >>> from tf_metaalign.algorithms.multitask import UncertaintyWeighting
      >>> UncertaintyWeighting().state_spec(num_tasks=3)["log_variances"].shape
      (3,)
    """

    shape: tuple = ()
    dtype: Optional[str] = None
    initializer: Any = "zeros"
    trainable: bool = False
    name: Optional[str] = None


@dataclasses.dataclass
class TaskInputs:
    """What a method sees at one step; global (all replicas), identical on every replica.

    Attributes:
      losses: [T] the task losses L_t (each the mean over its task's examples), in the
        accumulation dtype (float64 when the model computes in float64).
      present: [T] 1.0 where the task has examples in the global batch, else 0.0 (an
        absent task has L_t = 0 and g_t = 0; methods must leave it out).
      step: integer scalar (int64 on TensorFlow, `functional.counter_dtype()`), the
        trainer's step counter (checkpointed): random draws are a pure function of
        (seed, step) (`random_order`, `random_normal`).
      epoch: integer scalar, the number of epochs completed (DWA's loss history).
      seed: the trainer's integer seed.
      gram: [T, T] <g_i, g_j> over the shared variables (None if not `uses_gradients`).
      task_grads: `task_grads[t][v]`, task t's gradient of the v-th SHARED variable (None
        if not `uses_gradients`).
      shared_variables: the shared variables (for methods that pick one, e.g. GradNorm's
        last shared layer), in the order of `task_grads[t]`.
      variable_gram: `variable_gram(v)` is the [T, T] Gram matrix of the task gradients
        on the v-th shared variable alone (GradNorm's layer norms are the square roots
        of its diagonal); given by the trainer where it forms no per-task gradient
        (task_passes="factored", `task_grads` None there), else None.

    Example:
      >>> from tf_metaalign.algorithms.multitask import PCGrad, TaskInputs
      >>> gram = keras.ops.convert_to_tensor([[1.0, -0.5], [-0.5, 1.0]])  # conflicting tasks
      >>> inputs = TaskInputs(
      ...     losses=keras.ops.ones([2]), present=keras.ops.ones([2]), step=0, epoch=0,
      ...     seed=0, gram=gram,
      ... )
      >>> # each g_t projected off the other: g_1 + 0.5 g_2 and g_2 + 0.5 g_1
      >>> inputs.num_tasks, inputs.dtype, np.asarray(PCGrad().combine(inputs, {}).shared).tolist()
      (2, 'float32', [1.5, 1.5])
    """

    losses: Any
    present: Any
    step: Any
    epoch: Any
    seed: int
    gram: Optional[Any] = None
    task_grads: Optional[list] = None
    shared_variables: Optional[list] = None
    variable_gram: Optional[Callable[[int], Any]] = None

    @property
    def num_tasks(self) -> int:
        return int(self.losses.shape[0])

    @property
    def dtype(self) -> str:
        """The losses' dtype, as a name ("float32", "float64")."""
        return standardize_dtype(self.losses.dtype)


@dataclasses.dataclass
class Combination:
    """What a method returns (see the module doc). `specific` defaults to `shared` for a
    loss-weighting method; `loss_weights` to `specific`; `state` holds the new value of
    every state variable the method changes; `state_gradients` the gradient of every
    trainable state variable (in the units of the loss: the trainer hands it to the
    compiled optimizer beside the model's gradient).

    Attributes:
      shared: [T] the coefficients of the task gradients on the shared variables.
      specific: [T] the coefficients on the task-specific variables (None: `shared`).
      loss_weights: [T] the weights of the reported loss (None: `specific`).
      state: state key -> new value.
      state_gradients: state key -> gradient (trainable state).

    Example:
      >>> from tf_metaalign.algorithms.multitask import Combination
      >>> c = Combination(shared=keras.ops.convert_to_tensor([0.5, 0.5]))
      >>> c.specific is None, dict(c.state)
      (True, {})
    """

    shared: Any
    specific: Optional[Any] = None
    loss_weights: Optional[Any] = None
    state: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    state_gradients: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class MultiTaskMethod:
    """Base class of a multi-task method (see the module doc).

    A subclass sets `name` (its registry key), `uses_gradients`, takes its
    hyperparameters in `__init__` (validated there, with errors naming the argument),
    stores them as attributes listed by `get_config`, and implements `combine`.

    Example:
      >>> from tf_metaalign.algorithms.multitask import Combination, MultiTaskMethod, TaskInputs
      >>> class LargestLossOnly(MultiTaskMethod):  # add @register to use it by name
      ...     name = "largest_loss_only"
      ...     uses_gradients = False
      ...     def combine(self, inputs, state):
      ...         ops = keras.ops
      ...         pick = ops.one_hot(ops.argmax(inputs.losses), 3, dtype=inputs.dtype)
      ...         return Combination(shared=pick)
      >>> inputs = TaskInputs(
      ...     losses=keras.ops.convert_to_tensor([0.5, 2.0, 1.0]), present=keras.ops.ones([3]),
      ...     step=0, epoch=0, seed=0,
      ... )
      >>> np.asarray(LargestLossOnly().combine(inputs, {}).shared)
      array([0., 1., 0.], dtype=float32)
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple] = ()
    uses_gradients: ClassVar[bool] = True
    #: "gradient" (surgery / multi-objective: task-specific variables get raw task
    #: gradients) or "loss" (loss weighting: they get the task's loss weight).
    kind: ClassVar[str] = "gradient"
    #: what the method was checked against (the docs' table reads it).
    reference: ClassVar[str] = ""
    #: the method reads `inputs.epoch` (the trainer then counts epochs in a checkpointed
    #: variable, `epochs_done`; else `inputs.epoch` is 0).
    uses_epoch: ClassVar[bool] = False
    #: the trainer may run `combine` as one XLA-compiled function (its T x T algebra
    #: is many tiny ops; see MultiTaskTrainer(compile_combination=)). False for a method
    #: that reads the task gradients themselves (GradNorm: XLA would take the large
    #: tensors in and out) or runs slower under XLA (CAGrad's face enumeration on CPU).
    compiles_well: ClassVar[bool] = True
    #: the method reads `inputs.task_grads` beyond what `inputs.variable_gram` gives, so
    #: the trainer must form the per-task gradients (not its task_passes="factored").
    #: No method of the zoo does (GradNorm's layer norms come from `variable_gram`).
    reads_task_gradients: ClassVar[bool] = False

    def state_spec(self, num_tasks: int) -> dict[str, StateSpec]:
        return {}

    def combine(self, inputs: TaskInputs, state: Mapping[str, Any]) -> Combination:
        raise NotImplementedError

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self), tuple(sorted(self.get_config().items()))))


def register(cls):
    """Class decorator: makes `cls` reachable as `method=cls.name` (and its aliases).

    Args:
      cls: a `MultiTaskMethod` subclass with a `name` no other method has.

    Returns:
      `cls`.

    Example:
      >>> from tf_metaalign.algorithms.multitask import MultiTaskMethod, PCGrad, register
      >>> register(PCGrad) is PCGrad  # registering a class again is harmless
      True
      >>> class MyPCGrad(MultiTaskMethod):
      ...     name = "pcgrad"
      >>> try:
      ...     register(MyPCGrad)
      ... except ValueError as e:
      ...     print(e)
      Two multi-task methods are named 'pcgrad'.
    """
    for key in (cls.name, *cls.aliases):
        if not key:
            raise ValueError(f"{cls.__name__} has no `name`.")
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"Two multi-task methods are named {key!r}.")
        _REGISTRY[key] = cls
    return cls


def method_names() -> tuple[str, ...]:
    """The registry's primary names, in registration order.

    Example:
      >>> from tf_metaalign.algorithms.multitask import method_names
      >>> method_names()[:4], "nash_mtl" in method_names()
      (('sum', 'rlw', 'uw', 'dwa'), True)
    """
    seen = []
    for key, cls in _REGISTRY.items():
        if key == cls.name and key not in seen:
            seen.append(key)
    return tuple(seen)


def get_method(method, **options) -> MultiTaskMethod:
    """A method object from a name (`"pcgrad"`, with `options` as its constructor's
    arguments), a method object (returned as is; `options` must be empty), or a
    serialized `{"name": ..., "config": {...}}`.

    Args:
      method: a registered name, a `MultiTaskMethod` or a serialized method.
      **options: the constructor's arguments (with a name).

    Example:
      >>> from tf_metaalign.algorithms.multitask import get_method, serialize_method
      >>> method = get_method("cagrad", calpha=0.2)
      >>> get_method(serialize_method(method)) == method
      True
    """
    if isinstance(method, MultiTaskMethod):
        if options:
            raise ValueError(
                f"Options {sorted(options)} were given beside the method object {method!r}: "
                "pass them to its constructor instead."
            )
        return method
    if isinstance(method, Mapping) and set(method) == {"name", "config"}:
        return get_method(method["name"], **dict(method["config"]), **options)
    if not isinstance(method, str) or method not in _REGISTRY:
        raise ValueError(
            f"`method` must be one of {method_names()} or a MultiTaskMethod object (e.g. "
            f"tf_metaalign.algorithms.multitask.PCGrad()); got {method!r}."
        )
    cls = _REGISTRY[method]
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(
            f"Options {sorted(options)} do not apply to method {method!r} ({cls.__name__}): {e}"
        ) from None


def serialize_method(method: MultiTaskMethod) -> dict:
    """`{"name": ..., "config": {...}}`: what `get_method` rebuilds the method from.

    Args:
      method: a `MultiTaskMethod`.

    Example:
      >>> from tf_metaalign.algorithms.multitask import PCGrad, serialize_method
      >>> serialize_method(PCGrad())
      {'name': 'pcgrad', 'config': {}}
    """
    return {"name": method.name, "config": method.get_config()}


# ------------------------------------------------------------------ shared helpers


def scalar(value, dtype):
    """A python number as an exact `dtype` constant (a cast of a python float rounds
    it through float32 first), a list of numbers an exact vector; tensors are cast.
    (`functional.scalar`.)"""
    if isinstance(value, (list, tuple)):
        return ops.convert_to_tensor(np.asarray([float(v) for v in value], dtype=dtype))
    return F.scalar(value, dtype)


def check_number(name, value, low=None, high=None, low_open=False, integer=False):
    """Validate a hyperparameter; the error names the argument and the range."""
    kinds = (int,) if integer else (int, float)
    bad = isinstance(value, bool) or not isinstance(value, kinds)
    if not bad:
        if low is not None and (value <= low if low_open else value < low):
            bad = True
        if high is not None and value > high:
            bad = True
    if bad:
        what = "an integer" if integer else "a number"
        lo = "" if low is None else (f" > {low}" if low_open else f" >= {low}")
        hi = "" if high is None else f" <= {high}"
        raise ValueError(f"`{name}` must be {what}{lo}{hi}; got {value!r}.")
    return int(value) if integer else float(value)


def masked_softmax(logits, present):
    """softmax over the present tasks (absent ones get 0)."""
    logits = ops.where(ops.greater(present, 0), logits, ops.full_like(logits, -1e30))
    return ops.softmax(logits, axis=-1) * present


def random_uniform(seed, step, n, stream=0, dtype="float64"):
    """n numbers in (0, 1), a pure function of (seed, step, stream): integer hashing
    (uint32 arithmetic), so eager, graph, XLA, JAX's jit and a resumed run draw the same
    on both backends (see `gradient_surgery.random_order` for why not TensorFlow's
    stateless RNG). In float32 a key within 128 of 2^32 rounds to 1.0 (a draw of 1 in
    2^25).

    Args:
      seed: the trainer's integer seed.
      step: the step (an int or an integer tensor: int32 or int64).
      n: how many numbers.
      stream: an independent stream per value.
      dtype: the numbers' dtype (float64 needs JAX's x64 on JAX: pass the computation's
        dtype).

    Example:
      >>> from tf_metaalign.algorithms.multitask import random_uniform
      >>> u = np.asarray(random_uniform(seed=0, step=5, n=3, dtype="float32"))
      >>> u.shape, bool(np.all((u > 0) & (u < 1)))
      ((3,), True)
      >>> same = random_uniform(0, keras.ops.convert_to_tensor(5, "int32"), 3, dtype="float32")
      >>> bool(np.all(u == np.asarray(same)))
      True
    """
    from tf_metaalign.algorithms.gradient_surgery import _hash32, _hash_keys, _step_key, _uint32

    seed_key = _hash32(ops.bitwise_xor(_uint32(seed), _uint32(0x9E3779B9 * (stream + 1))))
    keys = _hash_keys(_step_key(seed_key, step), n)
    return (ops.cast(keys, dtype) + scalar(0.5, dtype)) / scalar(2.0**32, dtype)


def random_normal(seed, step, n, stream=0, dtype="float64"):
    """n standard normal numbers, a pure function of (seed, step, stream) (Box-Muller on
    two `random_uniform` streams).

    Args:
      seed: the trainer's integer seed.
      step: the step.
      n: how many numbers.
      stream: an independent stream per value.
      dtype: the numbers' dtype.

    Example:
      >>> from tf_metaalign.algorithms.multitask import random_normal
      >>> z = np.asarray(random_normal(seed=0, step=0, n=10_000, dtype="float32"))
      >>> round(float(z.mean()), 1), round(float(z.std()), 1)
      (0.0, 1.0)
    """
    u1 = random_uniform(seed, step, n, 2 * stream + 1, dtype)
    u2 = random_uniform(seed, step, n, 2 * stream + 2, dtype)
    two_pi = scalar(6.283185307179586, dtype)
    return ops.sqrt(scalar(-2.0, dtype) * ops.log(u1)) * ops.cos(two_pi * u2)
