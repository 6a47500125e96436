"""Reference train steps for `benchmarks/multitask_overhead.py` (NOT library code): what
per-task gradients cost when each is taken over its own task's rows -- T sub-batch passes
in a python loop, or ONE `tf.vectorized_map` pass over the task dimension -- measured
beside `MultiTaskTrainer`, and checked equal to it (tests/benchmarks/test_multitask_benchmark.py:
one SGD step of `PerTaskPasses(method="pcgrad")` == `MultiTaskTrainer(method="pcgrad")`).

No absl flags here, so tests can import it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_metaalign import _compat
from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.data.multitask import PerTaskHead

METHODS = ("sum", "pcgrad")


class PerTaskPasses(keras.Model):
    """REFERENCE train steps (not library code): what per-task gradients cost when
    each is taken over its own task's b examples.

    "loop" (ref_per_task_*): T forward+backward passes, one per task, in a python loop
    (what MultiTaskTrainer's "gathered" does, with static shapes here).
    "vmap" (ref_vmap_*): ONE vectorized pass: `tf.vectorized_map` over the task
    dimension of the batch reshaped to [T, b, ...], each task's loss and gradient at
    the same weights (stateless call): the T sub-batch forward and backward passes
    become batched ops (a [T, b, D] x [D, W] forward matmul, [T, D, b] x [T, b, W]
    weight gradients): the FLOPs of ONE pass over the T b rows, plus T copies of the
    gradients (written once, read by the Gram matrix and the combination).

    Relies on this benchmark's batch layout: `mixed_batches` with every task is
    task-major (task t = rows t*b .. (t+1)*b - 1). Per-task loss = the compiled loss's
    mean over the task's examples (the MultiTaskTrainer task loss); "sum" hands
    sum_t grad L_t to the optimizer, "pcgrad" the PCGrad combination of the shared
    variables' gradients (`gradient_surgery` on their Gram matrix, as the trainer
    does) and the heads their own task's gradient. Model state (dropout seeds) is not
    threaded (every task sees the step's first seed). No strategy, loss scaling or
    diagnostics.
    """

    def __init__(self, inner, num_tasks, method, vectorized):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"`num_tasks` must be an integer >= 1; got {num_tasks!r}.")
        if method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}; got {method!r}.")
        if not isinstance(vectorized, bool):
            raise ValueError(f"`vectorized` must be a bool; got {vectorized!r}.")
        super().__init__()
        self.inner, self.num_tasks, self.method = inner, num_tasks, method
        self.vectorized = vectorized

    def call(self, x, training=False):
        return self.inner(x, training=training)

    def _split(self):
        specific = set()
        for layer in _compat.flatten_layers(self.inner):
            if isinstance(layer, PerTaskHead):
                specific |= {id(v) for v in layer.trainable_variables}
        variables = self.inner.trainable_variables
        return [id(v) in specific for v in variables]

    def train_step(self, data):
        x, y = data
        T = self.num_tasks

        def by_task(a):
            return tf.reshape(a, [T, -1] + list(a.shape[1:]))

        xs, ys = tf.nest.map_structure(by_task, x), by_task(y)
        variables = self.inner.trainable_variables
        params, state = F.current_params(self.inner), F.current_state(self.inner)

        def task_loss_grad(xt, yt):
            with tf.GradientTape() as tape:
                tape.watch(params)
                pred, _, _ = F.stateless_forward(self.inner, params, state, xt, training=True)
                loss = self.loss(yt, pred)
            return loss, F.densify(tape.gradient(loss, params))

        if self.vectorized:
            losses, stacked = tf.vectorized_map(lambda a: task_loss_grad(*a), (xs, ys))
        else:
            pairs = [
                task_loss_grad(tf.nest.map_structure(lambda a: a[t], xs), ys[t]) for t in range(T)
            ]
            losses = tf.stack([p[0] for p in pairs])
            stacked = [tf.stack([p[1][v] for p in pairs]) for v in range(len(params))]
        specific = self._split()
        if self.method == "pcgrad":
            gram = tf.zeros([T, T], F.accumulation_dtype(stacked))
            for g, own in zip(stacked, specific):
                if not own:
                    rows = tf.reshape(g, [T, -1])
                    gram += tf.matmul(rows, rows, transpose_b=True)
            order = GS.random_order(T, 0, self.optimizer.iterations)
            coefficients = GS.pcgrad_coefficients(gram, order)
        else:
            coefficients = tf.ones([T])
        grads = [
            tf.reduce_sum(g, 0) if own else tf.tensordot(tf.cast(coefficients, g.dtype), g, 1)
            for g, own in zip(stacked, specific)
        ]
        self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": tf.reduce_sum(losses)}
