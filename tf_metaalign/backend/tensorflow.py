"""The TensorFlow side of the seam (`tf_metaalign.backend`): gradient tapes and the
`tf.distribute` replica context.

Loss scaling under a strategy follows Keras exactly: a compiled mean-reduced loss is
already divided by the number of replicas (Keras's loss reduction), and the optimizer
*sums* gradients across replicas, so per-replica gradients are in "replica-scaled" units
whose sum is the global mean gradient. `all_reduce_sum` turns such per-replica values into
the global value; `unscale_loss_for_distribution` turns a per-replica loss back into a
number that does not depend on the replica count.
"""

from __future__ import annotations

import tensorflow as tf

from tf_metaalign import _compat

name = "tensorflow"


def dense_gradient(tape, target, sources, output_gradients=None) -> list:
    """`tape.gradient(target, sources)` as the algorithms combine gradients: zeros for a
    source the target does not reach (a task that does not use a head) and dense tensors
    (an embedding's IndexedSlices densified), so gradients can be added, stacked and
    dotted."""
    grads = tape.gradient(
        target,
        sources,
        output_gradients=output_gradients,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    return [tf.convert_to_tensor(g) for g in grads]


def value_and_grad(f, params, *args):
    """`(value, grads, aux)` of `f(params, *args) -> (value, aux)` at `params`."""
    params = list(params)
    with tf.GradientTape() as tape:
        tape.watch(params)
        value, aux = f(params, *args)
    return value, dense_gradient(tape, value, params), aux


def value_grad_and_hvp(f, params, args, vector):
    """`(value, grads, aux, H v)`: reverse over reverse, `vector` held constant."""
    params = list(params)
    vector = [tf.stop_gradient(v) for v in vector]
    with tf.GradientTape() as outer:
        outer.watch(params)
        with tf.GradientTape() as inner:
            inner.watch(params)
            value, aux = f(params, *args)
        grads = dense_gradient(inner, value, params)
        acc = tf.float64 if any(g.dtype == tf.float64 for g in grads) else tf.float32
        grads_dot_v = tf.add_n(
            [tf.reduce_sum(tf.cast(g, acc) * tf.cast(v, acc)) for g, v in zip(grads, vector)]
        )
    hv = dense_gradient(outer, grads_dot_v, params)
    return value, grads, aux, [tf.cast(h, g.dtype) for h, g in zip(hv, grads)]


def jvp(f, primals, tangents):
    """`(f(*primals), J_f tangents)` (forward mode, `tf.autodiff.ForwardAccumulator`)."""
    primals, tangents = list(primals), list(tangents)
    with tf.autodiff.ForwardAccumulator(primals, tangents) as acc:
        outputs = f(*primals)
    out_tangents = tf.nest.map_structure(
        lambda o: acc.jvp(o, unconnected_gradients=tf.UnconnectedGradients.ZERO), outputs
    )
    return outputs, out_tangents


def executing_eagerly() -> bool:
    return tf.executing_eagerly()


def cond(pred, true_fn, false_fn):
    """`tf.cond` (branches may assign variables: TF records the assignments in the graph)."""
    if isinstance(pred, bool):
        return true_fn() if pred else false_fn()
    return tf.cond(pred, true_fn, false_fn)


def num_replicas() -> int:
    """Replicas in sync of the current strategy (1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def replica_id():
    """This replica's index in its sync group (0 outside any strategy)."""
    ctx = tf.distribute.get_replica_context()
    return 0 if ctx is None else ctx.replica_id_in_sync_group


def scale_loss_for_distribution(value):
    return _compat.scale_loss_for_distribution(value)


def unscale_loss_for_distribution(value):
    return _compat.unscale_loss_for_distribution(value)


def all_reduce_sum(tensors):
    """Sum a nest of per-replica tensors over replicas (identity with one replica).

    Must be called in a replica context (inside `strategy.run` / `train_step`).
    """
    if num_replicas() == 1:
        return tensors
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "all_reduce_sum must be called in a replica context (inside strategy.run)."
        )
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


def all_gather_rows(tensors):
    """Every replica's rows of a nest of [rows, ...] tensors, concatenated in replica
    order (identity with one replica); a replica with fewer rows than the largest is
    padded with zero rows (callers must be indifferent to zero rows).

    Built on an all-reduce (each replica writes its rows into its own block of a zero
    buffer), which works under every strategy: `ReplicaContext.all_gather` fails inside
    Keras's step under MultiWorkerMirroredStrategy ("destinations can not be empty").
    The block size is the static row count when the trace knows it (XLA-friendly), else
    the largest replica's. Must be called in a replica context.
    """
    replicas = num_replicas()
    if replicas == 1:
        return tensors
    context = tf.distribute.get_replica_context()
    flat = tf.nest.flatten(tensors)
    rows = tf.shape(flat[0])[0]
    static_rows = flat[0].shape[0]
    replica = tf.cast(context.replica_id_in_sync_group, tf.int32)
    if static_rows is not None:
        block = static_rows
    else:
        counts = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.one_hot(replica, replicas, dtype=tf.float32) * tf.cast(rows, tf.float32),
        )
        block = tf.cast(tf.reduce_max(counts), tf.int32)
    buffers = []
    for t in flat:
        padded = tf.pad(t, [[0, block - rows]] + [[0, 0]] * (t.shape.rank - 1))
        shape = tf.concat([[replicas, block], tf.shape(t)[1:]], axis=0)
        buffers.append(tf.scatter_nd([[replica]], padded[None], shape))
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, buffers)
    out = [tf.reshape(s, [-1, *t.shape[1:]]) for s, t in zip(summed, flat)]
    return tf.nest.pack_sequence_as(tensors, out)


def replica_share(tensors):
    """The per-replica part of a global value that is identical on every replica: the
    value divided by the replica count, so that the optimizer's cross-replica *sum* in
    `apply_gradients` gives the value back. Identity with one replica."""
    n = num_replicas()
    if n == 1:
        return tensors
    return tf.nest.map_structure(lambda t: t / tf.cast(n, t.dtype), tensors)


def traced_once(fn):
    """`fn` as ONE traced function, called for every task (and step) when the caller is
    already building a graph (`tf.function`, `fit`); else `fn` itself (eager stays eager).

    For inner loops unrolled over tasks x steps (MAML, prompt FOMAML/Reptile): traced
    inline, every call re-traces the model's forward pass, its gradient and (second
    order) the outer tape's gradient of that gradient. A nested `tf.function` is traced
    once per input signature, and its gradient functions are built once and reused for
    every call. Grappler inlines the calls before the graph runs: the run time does not
    change (keeping the calls with `_noinline` was 25% slower). Measured, MAML 8 tasks x 5
    steps, second order, 2 CPU cores: the first meta-step (tracing + graph optimisation)
    171 s -> 39 s. Python values are closed over; only tensors are arguments, and the
    function must not all-reduce (keep collectives outside it).

    Under XLA (`jit_compile=True`) `fn` itself: XLA compiles nested function calls and
    their gradient functions without inlining them first, and compiling got 6x slower
    (MAML battery model, second order: 135 s, 22 s inline).
    """
    if not tf.inside_function() or _compat.building_xla_function():
        return fn
    return tf.function(fn, autograph=False)


def counter_dtype() -> str:
    return "int64"


def densify(tensors) -> list:
    """IndexedSlices (an embedding's gradient) -> dense tensors; others unchanged."""
    return [tf.convert_to_tensor(t) for t in tensors]


def add_n(tensors):
    """The sum of same-shaped tensors (`tf.add_n`, TensorFlow's own summation order)."""
    return tf.add_n(list(tensors))


def read_value(variable):
    """The variable's current value as a tensor (a read, not the variable itself: Keras's
    `ops.convert_to_tensor` returns a `tf.Variable` unchanged)."""
    return tf.convert_to_tensor(getattr(variable, "value", variable))


def static_schedule_flag(schedule, which):
    """None: TensorFlow's step reads every schedule's phase from its counter (`tf.cond`)."""
    del schedule, which
    return None
