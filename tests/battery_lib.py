"""Machinery of the trainer battery, shared by test_trainer_battery.py and battery_worker.py.

Builds a trainer from a `TrainerEntry`, trains it on the entry's deterministic data, and
takes a *snapshot*: every number that defines the training state, as numpy arrays keyed
by kind (model weights, model state such as Dropout's seed, optimizer variables, the
trainer's algorithm state), so two runs can be compared key by key.
"""

from __future__ import annotations

import contextlib
import inspect
import re

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

#: rows of the training data: 5 global batches of 8 per epoch (an odd count, so
#: steps_per_execution=3 ends each epoch on a partial execution and DotProd's every=2
#: phase shifts between epochs).
N_ROWS = 40
EPOCHS = 2


def data(entry, dtype=None, n=N_ROWS):
    return entry.make_data(n, dtype=dtype or entry.dtype, seed=0)


def take_rows(x, rows):
    """`x[rows]` for an array or a nest of arrays (dict batches: multi-task data)."""
    return tf.nest.map_structure(lambda a: a[rows], x)


def num_rows(x):
    """The number of rows of an array or of a nest of arrays."""
    return len(tf.nest.flatten(x)[0])


def dataset(x, y, batch_size, drop_remainder=False):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder)


def build(entry, strategy=None, dtype="entry", dropout=0.0, **compile_overrides):
    """A compiled trainer; `dtype=None` builds the model in the global policy."""
    model_dtype = entry.dtype if dtype == "entry" else dtype
    data_dtype = model_dtype or keras.backend.floatx()
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = entry.make_model(dtype=model_dtype, dropout=dropout, seed=0)
        trainer = entry.make_trainer(model, data_dtype)
        trainer.compile(**entry.compile_kwargs(), **compile_overrides)
    return trainer


class BatchLogs(keras.callbacks.Callback):
    """Records the logs of every training batch (floats)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def fit(entry, trainer, x, y, epochs=EPOCHS, callbacks=(), **fit_kwargs):
    """Unshuffled fit on batches of `entry.batch_size`.

    Returns `(batch_logs, history)`: the logs of every `on_train_batch_end` call and
    `History.history` (per-epoch logs).
    """
    recorder = BatchLogs()
    history = trainer.fit(
        dataset(x, y, entry.batch_size),
        epochs=epochs,
        verbose=0,
        shuffle=False,  # ignored for a dataset (already unshuffled); silences a warning
        callbacks=[recorder, *callbacks],
        **fit_kwargs,
    )
    return recorder.logs, history.history


def trainer_state(trainer):
    """The trainer's own variables -- neither the model's nor the optimizer's -- keyed by
    name (`name#k` for the k-th repeat of a name, in the trainer's variable order).

    This is the algorithm's state (counters, learned values, meta-optimizer slots) plus
    whatever the MetaTrainer base class keeps, found without being named, so a variable
    the base class or a trainer adds is compared by every check automatically.
    """
    known = {id(v) for v in trainer.model.variables}
    known |= {id(v) for v in trainer.optimizer.variables}
    out = {}
    for v in trainer.variables:
        if id(v) in known:
            continue
        key, k = v.name, 1
        while key in out:
            key, k = f"{v.name}#{k}", k + 1
        out[key] = v
    return out


def base_class_state_names():
    """Names of the variables that MetaTrainer itself gives every trainer."""
    from tf_metaalign.trainers import MetaTrainer

    # With a Dropout layer: the base class checkpoints the model's seed states too.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), keras.layers.Dropout(0.1)])
    bare = MetaTrainer(model)
    bare.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return {key.split("#")[0] for key in trainer_state(bare)}


def check_entry_state(entry, trainer):
    """`entry.state_variables` all exist, and every own variable of the trainer is either
    listed there or one of the base class's: an entry names all its algorithm's state.

    Returns the problems found (empty when the entry is right)."""
    names = [key.split("#")[0] for key in trainer_state(trainer)]
    problems = [f"listed but missing: {n!r}" for n in entry.state_variables if n not in names]
    base = base_class_state_names()
    problems += [
        f"not listed in state_variables: {n!r}"
        for n in names
        if n not in entry.state_variables and n not in base
    ]
    return problems


def snapshot(entry, trainer):
    """Every number of the training state, keyed `kind/index` or `state/name`.

    Optimizer variables are keyed by index only: their names embed layer names, which
    differ between two models built in one process.
    """
    out = {}
    for i, v in enumerate(trainer.model.trainable_variables):
        out[f"weights/{i}"] = np.asarray(v.numpy())
    for i, v in enumerate(trainer.model.non_trainable_variables):
        out[f"model_state/{i}"] = np.asarray(v.numpy())  # Dropout seed, BatchNorm stats
    for i, v in enumerate(trainer.optimizer.variables):
        out[f"optimizer/{i}"] = np.asarray(v.numpy())
    out["optimizer/iterations"] = np.asarray(trainer.optimizer.iterations.numpy())
    for name, v in trainer_state(trainer).items():
        out[f"state/{name}"] = np.asarray(v.numpy())
    missing = [n for n in entry.state_variables if f"state/{n}" not in out]
    assert not missing, f"{entry.name}: no trainer variable named {missing}; has {sorted(out)}"
    return out


def tolerance(entry, check):
    return entry.tolerances.get(check, entry.tolerance)


def assert_same(a, b, rtol, atol, what="", keys=None):
    """Every key of two snapshots agrees (integers exactly); one message listing all
    the keys that differ, with their largest absolute difference."""
    if keys is None:
        assert sorted(a) == sorted(b), f"{what}: different keys {sorted(set(a) ^ set(b))}"
        keys = sorted(a)
    bad = []
    for k in keys:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape:
            bad.append(f"{k}: shape {x.shape} vs {y.shape}")
        elif x.dtype.kind in "iub":
            if not np.array_equal(x, y):
                bad.append(f"{k}: {x.ravel()[:4]} vs {y.ravel()[:4]}")
        elif not np.allclose(x, y, rtol=rtol, atol=atol):
            diff = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            bad.append(f"{k}: max |diff| {diff:.3g}")
    assert not bad, f"{what} differ (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(bad)


def max_relative_difference(a, b, keys=None):
    """Largest |a-b| / (|b| + 1e-12) over float keys (for reporting / tuning tolerances)."""
    worst = 0.0
    for k in keys or sorted(a):
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if x.size:
            worst = max(worst, float(np.max(np.abs(x - y) / (np.abs(y) + 1e-12))))
    return worst


def assert_trained(entry, before, after):
    """The weights, the optimizer and the algorithm state all moved: a comparison of
    two runs is not vacuous (e.g. a zero learning rate would make any two runs equal)."""
    for kind in ("weights/", "optimizer/", "state/"):
        keys = [k for k in before if k.startswith(kind)]
        if kind == "state/" and not keys:
            continue
        moved = [k for k in keys if not np.array_equal(before[k], after[k])]
        assert moved, f"{entry.name}: no {kind[:-1]} variable changed in training"


def logs_as_arrays(logs, names):
    """Per-batch logs -> {name: array over batches} for the given names."""
    return {n: np.asarray([step[n] for step in logs]) for n in names}


# ------------------------------------------------------ the step's graph (no host round trip)

#: Ops that call back into Python (`tf.py_function`, `tf.numpy_function`, `tf.compat.v1.py_func`).
PYTHON_CALLBACK_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def keras_step_functions(trainer):
    """`(multi_step, one_step)`: the `tf.function`s behind Keras's `trainer.train_function`.

    `multi_step(iterator)` is what `fit` calls (the host loop over `steps_per_execution`
    steps); `one_step(data)` is the step on one batch, the function Keras compiles with XLA
    under `jit_compile=True`. Keras exposes neither: they are read from the closures of the
    train function (and of MetaTrainer's wrapper of it), so a Keras upgrade that renames
    them fails here, by name.
    """
    trainer.make_train_function()
    function = trainer.train_function
    for _ in range(4):  # MetaTrainer's wrapper -> Keras's `function(iterator)`
        names = inspect.getclosurevars(function).nonlocals
        if "multi_step_on_iterator" in names:
            break
        function = names.get("train_function")
        assert function is not None, f"no Keras train function under {sorted(names)}"
    multi_step = names["multi_step_on_iterator"]
    inner = inspect.getclosurevars(inspect.unwrap(multi_step.python_function)).nonlocals
    one_step = inner["one_step_on_data"].__wrapped__  # under Keras's Optional converter
    assert hasattr(multi_step, "get_concrete_function"), "Keras's step is not a tf.function"
    assert hasattr(one_step, "experimental_get_compiler_ir"), "Keras's step is not a tf.function"
    return multi_step, one_step


def _node_dtypes(node, functions):
    """`(input dtypes, output dtypes)` of a NodeDef (enums of types_pb2) from its OpDef and
    attrs, or from the FunctionDef it calls; None for an op TensorFlow does not know."""
    if node.op in functions:
        signature = functions[node.op].signature
        return [a.type for a in signature.input_arg], [a.type for a in signature.output_arg]
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return None

    def types(args):
        out = []
        for arg in args:
            if arg.type_list_attr:
                out += list(node.attr[arg.type_list_attr].list.type)
            elif arg.type_attr:
                out.append(node.attr[arg.type_attr].type)
            else:
                out.append(arg.type)
        return out

    return types(op_def.input_arg), types(op_def.output_arg)


def _called_functions(node):
    """Names of the functions a node calls (a call op's `f`, While's body and cond, If's
    branches, Case's branch list, a direct call by name)."""
    names = [node.op]
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names += [f.name for f in value.list.func]
    return names


def host_round_trips(graph_def):
    """The ops of a step's graph that go through the host: a list of
    `"<function>/<node>: <op> (<why>)"`, empty when there is none.

    Walks the graph's nodes and the nodes of EVERY function of its library: nested
    `tf.function`s, `tf.while_loop` / `tf.cond` bodies and branches, the function XLA
    compiles (Keras's `one_step_on_data`), gradients of all of them. Found:

    * Python callbacks: `PyFunc`, `PyFuncStateless`, `EagerPyFunc` (`tf.py_function`,
      `tf.numpy_function`): the step stops, the tensors go to the Python interpreter
      and back. XLA cannot compile them, a TPU cannot run them.
    * string-typed ops: any op with a `tf.string` input or output (`StringFormat` and
      `PrintV2` of `tf.print`, `AsString`, `tf.strings.*`, string constants): strings
      live in host memory only, so the step copies to the host, and XLA has no string
      type (`StringFormat` / `PrintV2` / `AsString` have no XLA kernel).
    * ops TensorFlow does not know (a custom op library): not checkable, so reported.

    Allowed, the one exception: `Assert` (`tf.debugging.assert_*`,
    `tf.debugging.Assert`) whose string inputs are all string CONSTANTS (its message),
    and those constants where `Assert`s are their only consumers, or where nothing
    consumes them (`tf.debugging.assert_*` leaves its message's constants unused beside
    the `Assert` it builds in a `tf.cond` branch; dead constants are pruned before a
    function runs). XLA compiles `Assert` to nothing (tf2xla's AssertOp is a no-op; the
    constants are then dead): the compiled step is unchanged. In a plain graph step it
    checks a condition in TensorFlow's C++ runtime, no Python (on a GPU its CPU kernel
    reads the boolean condition and the data it prints).
    An `Assert` whose message is computed (`tf.strings.format`, `AsString`) is reported
    through the op that computes it. `CheckNumerics` (`MetaTrainer.check_finite_loss`)
    carries its message as an attribute, not a tensor: not string-typed.
    """
    functions = {f.signature.name: f for f in graph_def.library.function}
    bodies = [("", list(graph_def.node))]
    bodies += [(name, list(f.node_def)) for name, f in functions.items()]
    problems = []
    for function, nodes in bodies:
        by_name = {n.name: n for n in nodes}
        consumers = {}
        for n in nodes:
            for ref in n.input:
                if not ref.startswith("^"):
                    consumers.setdefault(ref.split(":")[0], []).append(n.op)

        def constant_message(ref):
            producer = by_name.get(ref.split(":")[0])
            return producer is not None and producer.op == "Const"

        where = f"{function or '<step>'}/"
        for n in nodes:
            missing = [f for f in _called_functions(n)[1:] if f not in functions]
            if missing:
                problems.append(f"{where}{n.name}: {n.op} calls {missing}, not in the library")
            if n.op in PYTHON_CALLBACK_OPS:
                problems.append(f"{where}{n.name}: {n.op} (a Python callback)")
                continue
            dtypes = _node_dtypes(n, functions)
            if dtypes is None:
                problems.append(f"{where}{n.name}: {n.op} (an op TensorFlow does not know)")
                continue
            inputs, outputs = dtypes
            if types_pb2.DT_STRING not in inputs + outputs:
                continue
            if n.op == "Assert":
                data = [r for r in n.input if not r.startswith("^")][1:]
                strings = [r for r, t in zip(data, inputs[1:]) if t == types_pb2.DT_STRING]
                if all(constant_message(r) for r in strings):
                    continue
            if n.op == "Const" and set(consumers.get(n.name, [])) <= {"Assert"}:
                continue
            problems.append(f"{where}{n.name}: {n.op} (a tf.string input or output)")
    return problems


#: A bounded dynamic dimension in HLO text: `f32[<=8,4]` (tf.where, tf.boolean_mask,
#: tf.unique, a data-dependent slice under XLA).
_DYNAMIC_DIMENSION = re.compile(r"\w+\[[^\]]*<=[^\]]*\]")


_OP_METADATA = re.compile(r'op_type="([^"]*)" op_name="([^"]*)"')


def dynamic_shapes(hlo_text):
    """The first 3 HLO instructions with a bounded dynamic dimension (`f32[<=8]`), as
    `"<shape> from <TF op type> <TF op name>"`."""
    found = []
    for line in hlo_text.splitlines():
        shape = _DYNAMIC_DIMENSION.search(line)
        if shape and len(found) < 3:
            op = _OP_METADATA.search(line)
            found.append(f"{shape.group(0)} from " + (" ".join(op.groups()) if op else line))
    return found


def step_problems(trainer, dataset, jit_compile):
    """What keeps `trainer`'s step (Keras's train function, traced on `dataset`'s element
    spec, not run) from being one device program: `host_round_trips` of the whole step;
    with `jit_compile`, also the step not marked for XLA, its XLA lowering failing
    (HLO of the CPU JIT backend: tf2xla rejects an op without an XLA kernel), or dynamic
    shapes in the HLO (`dynamic_shapes`) although the batches have static shapes."""
    multi_step, one_step = keras_step_functions(trainer)
    graph_def = multi_step.get_concrete_function(iter(dataset)).graph.as_graph_def()
    problems = host_round_trips(graph_def)
    if not jit_compile or problems:
        return problems
    marked = [f for f in graph_def.library.function if "_XlaMustCompile" in f.attr]
    if not any(f.attr["_XlaMustCompile"].b for f in marked):
        return ["the step is not marked for XLA compilation (_XlaMustCompile)"]
    try:
        hlo = one_step.experimental_get_compiler_ir(next(iter(dataset)))(stage="hlo")
    except Exception as error:  # tf2xla's error names the op it has no kernel for
        return [f"XLA cannot compile the step: {str(error).splitlines()[0][:600]}"]
    return [f"a dynamic shape under XLA: {line}" for line in dynamic_shapes(hlo)]
