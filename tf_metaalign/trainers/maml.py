"""`MAMLTrainer`: MAML, first-order MAML, Meta-SGD, MAML++ (LSLR, multi-step loss,
derivative-order annealing) and gradient sharing inside `model.fit`.

The maths lives in `tf_metaalign.algorithms.maml` and
`tf_metaalign.algorithms.gradient_sharing`; this trainer unpacks the task batch, owns the
learned variables (inner learning rates, gradient sharing's m, lambda, g_hat), hands the
outer gradient to the compiled (OUTER) optimizer and logs.
"""

from __future__ import annotations


import contextlib

import keras
from keras import ops

from tf_metaalign import _compat, backend
from tf_metaalign import functional as F
from tf_metaalign.algorithms import maml as M
from tf_metaalign.algorithms import reptile as R
from tf_metaalign.algorithms.gradient_sharing import as_gradient_sharing
from tf_metaalign.trainers.base import (
    MetaTrainer,
    _value_initializer,
    first_task_query_set,
    with_epoch_counter,
)


def _task_batches():
    """`tf_metaalign.trainers.task_batches` (TensorFlow: a task count must be static when
    the step is traced), or None on JAX, where every batch's shapes are concrete (a last
    batch with fewer tasks is traced again; nothing to refuse)."""
    if backend.is_jax():
        return None
    from tf_metaalign.trainers import task_batches

    return task_batches


def _explain_task_count_error(trainer):
    module = _task_batches()
    return contextlib.nullcontext() if module is None else module.explain_task_count_error(trainer)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; got {value!r}.")
    return value


def _rank(t):
    """The rank of a tensor or KerasTensor (None if unknown)."""
    shape = t.shape
    if hasattr(shape, "rank"):  # a tf.TensorShape
        return shape.rank
    return len(shape)


def _check_epochs(name, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}.")
    return int(value)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class MAMLTrainer(MetaTrainer):
    """MAML (Finn et al., 2017) and its variants as a Keras trainer.

    Data: `fit` / `evaluate` take elements `((support_x, support_y, query_x), query_y)`
    (optionally `query_sample_weight` third), every tensor with a leading TASK dimension:
    support_x `[T, N_support, ...]`, support_y `[T, N_support, ...]`, query_x
    `[T, N_query, ...]`, query_y `[T, N_query, ...]`. One element is one meta-batch of T
    tasks; under a distribution strategy Keras splits the T tasks among the replicas
    (T must be a multiple of the replica count). The inner loop is unrolled over the
    tasks, so T (per replica) must be known when the step is traced: batch the task
    dataset with `drop_remainder=True`, or give `tasks_per_batch` (the GLOBAL number of
    tasks of every meta-batch; every meta-batch must then have exactly that many). NumPy
    input: a number of tasks that is a multiple of `batch_size`. `fit` and `evaluate`
    refuse input that breaks these rules before the first step
    (`tf_metaalign.trainers.task_batches`), rather than failing at the last batch.

    Per meta-batch, from theta (the model's variables, the meta weights), for every task
    K = `inner_steps` SGD steps on tensors, all tasks taking step k before any takes step
    k + 1 (`algorithms.maml.adapt`):

        theta_{t,k} = theta_{t,k-1} - alpha_k * Delta_{t,k},
        Delta_{t,k} = grad L_t^support(theta_{t,k-1})  (or gradient sharing's mix).

    * the INNER loss is the trainer's compiled loss (and the model's own losses) on the
      task's support set, in the task's own units (Keras's per-replica division undone);
    * the OUTER loss (the meta-objective) is the compiled loss on each task's query set at
      theta_{t,K}, averaged over the tasks (MAML++'s multi-step loss: a weighted sum over
      k of the query losses at theta_{t,k}); its gradient is handed, with the gradients
      of the trainer's own learned variables, to the COMPILED optimizer (the outer
      optimizer) in Keras's per-replica units: exactly what `fit` hands
      `apply_gradients`, so the outer step is on the mean over ALL replicas' tasks;
    * second order (`first_order=False`): the outer gradient goes through the whole inner
      loop (nested gradient tapes over `functional`'s stateless model, no variable is
      assigned); first order (`first_order=True`, FOMAML): the inner loop runs off the
      outer tape, its gradients are constants, and the theta gradient is the query
      gradient at theta_{t,K}.

    Learned inner learning rates (`learn_inner_learning_rates`), variables of the TRAINER
    (the wrapped model saves as itself), initialised at `inner_learning_rate`, updated by
    the outer optimizer together with the model's weights:
    * "none": alpha = `inner_learning_rate` for every weight and step (MAML);
    * "per_parameter": Meta-SGD (Li et al., 2017): one rate per scalar weight
      (variables `inner_learning_rate_<i>`, the shape of the i-th trainable weight),
      shared by the steps;
    * "per_layer_per_step": MAML++'s LSLR: one rate per trainable weight tensor and step
      (variable `inner_learning_rates`, shape [K, number of trainable weights]).
    Both need a built model (give the model Input shapes).

    MAML++ (Antoniou et al., 2019) options:
    * `multi_step_loss=True`: the meta-objective is sum_k w_k L^query(theta_{t,k}), w
      annealed from uniform towards the last step over `multi_step_loss_epochs` epochs
      (`algorithms.maml.multi_step_loss_weights`), then the last step only;
    * `first_order_epochs=n`: derivative-order annealing: first-order outer gradients in
      the first n epochs, second order afterwards (needs `first_order=False`; the first n
      epochs still cost what second order costs: the inner loop stays on the tape and its
      Hessian terms are multiplied by 0);
    * the epochs are counted by the checkpointed variable `epochs_done` (all epochs the
      trainer has trained, across `fit` calls).
    * `per_step_batch_norm_statistics=True`: one copy per inner step of the model's
      statistics (every non-trainable variable that is not a random-seed state: the
      BatchNorm moving means and variances), variables `step_statistics_<k>_<j>`,
      initialised from the model's. The support pass of inner step k and the query pass
      at theta_{t,k} use and update copy k (`algorithms.maml.StepStatistics`); after each
      meta-iteration the model's own statistics are set to the last step's copy (what
      the user's model saves). With `training=True` passes (the default) BatchNorm
      normalises with batch statistics, so the copies only matter to
      `transductive_evaluation=False` evaluation, where step k normalises with copy k.
    * NOT implemented: MAML++'s per-step BatchNorm weights and biases.

    Gradient sharing (Chang & Lipson), `gradient_sharing=GradientSharing(...)` (or True):
    trainable `sharing_m`, `sharing_lambda` (shape [K]) and the non-trainable running
    directions g_hat_k (weights copies `g_hat_<k>_<i>`) with the flag `g_hat_initialized`
    (0 until the first meta-iteration); see `algorithms.gradient_sharing`. Under a
    strategy the sum over tasks of each inner step is over every replica's tasks (one
    all-reduce per inner step). At `evaluate` time the stored g_hat is used (Algorithm 2).
    Works with MAML, Meta-SGD and MAML++ alike.

    BatchNorm and Dropout (`inner_training`, default True, transductive): every forward
    pass of `fit` runs with `training=True`: the inner loop and the query loss use each
    pass's batch statistics (support set, then query set), as the reference MAML
    (cbfinn/maml's `tf.contrib.layers.batch_norm` keeps its default `is_training=True`,
    in training and at test time); the moving statistics and Dropout seeds are threaded
    through the passes (support passes step by step, then the query passes) and the
    final ones assigned. `inner_training=False` runs them with `training=False`, as a
    hand-written loop that calls `model(x)`: BatchNorm on its moving statistics (never
    updated by the step), Dropout off (docs/porting.md). `evaluate`, `adapt` and
    `predict` run their passes with `training=transductive_evaluation`, which defaults to
    `inner_training` (nothing is assigned; with True, Dropout is active too).

    `evaluate` (and the validation of `fit`) runs the inner loop with
    `evaluation_inner_steps` steps (default K; steps past K reuse step K's learning
    rates and gradient-sharing values) on each task's support set, then reports the
    query loss and the compiled metrics (e.g. query accuracy) at theta_{t,K}.
    `adapt(support_x, support_y)` returns the adapted weights of every task (support_x
    [T, N, *input_shape]: one task needs its task axis, `x[None]`; a missing task or
    feature axis is refused by name); `evaluate_tasks(data, inner_steps=n)` evaluates
    with another step count, n = 0 included (the unadapted score; `adapt(...,
    inner_steps=0)` returns theta);
    `predict` on batches `(support_x, support_y, query_x)` returns each task's adapted
    outputs on its query set ([T, N_query, ...]); on other batches, the model's outputs.

    On JAX (`KERAS_BACKEND=jax`, no TensorFlow needed) the same arguments and numbers
    (TensorFlow == JAX at float64, tests/trainers/test_maml_backends.py). The tasks of a
    meta-batch run in parallel: `jax.vmap` over the task axis on GPU and TPU; on CPU an
    unrolled loop inside the jitted step, 8.7x faster there
    (`algorithms.maml.JAX_TASK_MAP`). The whole meta-step is one `jax.jit`; the
    second-order gradient is `jax.value_and_grad` around the inner `jax.grad`. Every pass
    of an inner step (and of the query set) runs all tasks from the same model state;
    the state after them is what TensorFlow's one-after-another passes give: exact for
    state updated elementwise-affinely in itself (BatchNorm's moving statistics, MAML++'s
    per-step copies; `algorithms.maml._compose_tasks`), integer states (Dropout's seed)
    advance by every pass's increment. What differs: Dropout draws the same mask for the
    tasks of one pass on JAX (one seed per pass; Keras's random numbers differ between
    the backends anyway). Several devices: `keras.distribution.DataParallel` shards the
    tasks and the step sees the global meta-batch (one device == two, tested); a
    `tf.distribute` strategy is TensorFlow's. The task count needs no static rule on JAX
    (a last, smaller meta-batch is traced again), so `tasks_per_batch` is not needed.

    Logs: "loss" (the meta-objective, independent of the replica count), the compiled
    metrics on the query sets at theta_{t,K}, "support_loss" (the mean support loss at
    theta, before adaptation), with learned rates "inner_learning_rate" (their mean),
    with gradient sharing "sharing_m" and "sharing_lambda" (mean sigmoid(m), mean
    sigmoid(lambda)).

    Args:
      model: the Keras model (`trainer.model`).
      inner_steps: K >= 1.
      inner_learning_rate: alpha > 0 (the initial value of learned rates).
      first_order: FOMAML-style outer gradient.
      learn_inner_learning_rates: "none", "per_parameter" or "per_layer_per_step".
      gradient_sharing: None, True, or a `tf_metaalign.algorithms.GradientSharing`.
      multi_step_loss: MAML++'s multi-step loss (above).
      multi_step_loss_epochs: the epochs over which its weights anneal (above).
      first_order_epochs: MAML++'s first-order epochs (above).
      per_step_batch_norm_statistics: MAML++'s per-step statistics (above; needs a built
        model with statistics).
      evaluation_inner_steps: inner steps of `evaluate` (default K).
      transductive_evaluation: the `training` flag of the evaluation passes (see
        BatchNorm above); None (the default): `inner_training`.
      inner_training: the `training` flag of the passes of a train step (see BatchNorm).
      tasks_per_batch: the global number of tasks per meta-batch when the batch's task
        dimension is not static (see Data).

    Example:
      >>> from tf_metaalign.trainers import MAMLTrainer
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = MAMLTrainer(
      ...     model, inner_steps=1, inner_learning_rate=0.1,
      ...     learn_inner_learning_rates="per_parameter",
      ... )  # Meta-SGD
      >>> trainer.compile(optimizer="adam", loss="mse")
      >>> rng = np.random.default_rng(0)
      >>> support_x, query_x = rng.normal(size=(2, 8, 5, 3)).astype("float32")  # 8 tasks of 5
      >>> w = rng.normal(size=(8, 3, 1)).astype("float32")  # task t: y = x w_t
      >>> history = trainer.fit(
      ...     (support_x, support_x @ w, query_x), query_x @ w, batch_size=4, verbose=0
      ... )
      >>> sorted(history.history)
      ['inner_learning_rate', 'loss', 'support_loss']

    References:
      Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks",
      ICML 2017. https://arxiv.org/abs/1703.03400; Li et al., "Meta-SGD", 2017.
      https://arxiv.org/abs/1707.09835; Antoniou et al., "How to train your MAML", ICLR
      2019. https://arxiv.org/abs/1810.09502
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model,
        inner_steps=1,
        inner_learning_rate=0.01,
        first_order=False,
        learn_inner_learning_rates="none",
        gradient_sharing=None,
        multi_step_loss=False,
        multi_step_loss_epochs=10,
        first_order_epochs=0,
        per_step_batch_norm_statistics=False,
        evaluation_inner_steps=None,
        transductive_evaluation=None,
        tasks_per_batch=None,
        inner_training=True,
        **kwargs,
    ):
        inner_steps = R.validate_steps("inner_steps", inner_steps)
        inner_learning_rate = R.validate_rate("inner_learning_rate", inner_learning_rate)
        first_order = _check_bool("first_order", first_order)
        learn = M.validate_learn_inner_learning_rates(learn_inner_learning_rates)
        sharing = as_gradient_sharing(gradient_sharing)
        multi_step_loss = _check_bool("multi_step_loss", multi_step_loss)
        multi_step_loss_epochs = _check_epochs("multi_step_loss_epochs", multi_step_loss_epochs, 1)
        first_order_epochs = _check_epochs("first_order_epochs", first_order_epochs)
        if first_order and first_order_epochs:
            raise ValueError(
                "`first_order_epochs` (derivative-order annealing: first order, then second "
                "order) needs first_order=False; got first_order=True and "
                f"first_order_epochs={first_order_epochs}."
            )
        if evaluation_inner_steps is not None:
            evaluation_inner_steps = R.validate_steps(
                "evaluation_inner_steps", evaluation_inner_steps
            )
        inner_training = _check_bool("inner_training", inner_training)
        if transductive_evaluation is not None:
            transductive_evaluation = _check_bool(
                "transductive_evaluation", transductive_evaluation
            )
        if tasks_per_batch is not None:
            tasks_per_batch = R.validate_steps("tasks_per_batch", tasks_per_batch)
        per_step = _check_bool("per_step_batch_norm_statistics", per_step_batch_norm_statistics)
        if per_step and not model.built:
            raise ValueError(
                "per_step_batch_norm_statistics=True copies the model's statistics "
                "per inner step: the model must be built (give it Input shapes)."
            )
        if learn != "none" and not model.built:
            raise ValueError(
                f"learn_inner_learning_rates={learn!r} creates one learning rate per weight: "
                "the model must be built (give it Input shapes, or call it once)."
            )
        super().__init__(model, **kwargs)
        self.inner_steps = inner_steps
        self.inner_learning_rate = inner_learning_rate
        self.first_order = first_order
        self.learn_inner_learning_rates = learn
        self.gradient_sharing = sharing
        self.multi_step_loss = multi_step_loss
        self.multi_step_loss_epochs = multi_step_loss_epochs
        self.first_order_epochs = first_order_epochs
        self.evaluation_inner_steps = evaluation_inner_steps
        self.inner_training = inner_training
        # None: evaluate with the passes training uses.
        self._transductive_evaluation = transductive_evaluation
        self.tasks_per_batch = tasks_per_batch
        self.per_step_batch_norm_statistics = per_step
        self._evaluation_steps_override = None
        # Outer steps taken (checkpointed): `trainer.outer_steps`.
        self.schedule = self.every_k_steps(1, name="outer_steps")
        self.epochs_done = None
        if multi_step_loss or first_order_epochs:
            self.epochs_done = self.add_state_variable("epochs_done", dtype=F.counter_dtype())
        self._learned = {}  # algorithm name -> trainer-owned trainable variable
        dtype = (
            model.trainable_variables[0].dtype
            if model.built and model.trainable_variables
            else keras.backend.floatx()
        )
        with _compat.unlocked_state(self):
            if learn == "per_parameter":
                self.inner_learning_rate_variables = [
                    self._add_learned(
                        f"inner_learning_rate_{i}",
                        v.shape,
                        inner_learning_rate,
                        v.dtype,
                        key=f"lr_{i}",
                    )
                    for i, v in enumerate(model.trainable_variables)
                ]
            elif learn == "per_layer_per_step":
                self.inner_learning_rate_variables = [
                    self._add_learned(
                        "inner_learning_rates",
                        (inner_steps, len(model.trainable_variables)),
                        inner_learning_rate,
                        dtype,
                        key="lslr",
                    )
                ]
            if sharing is not None:
                self.sharing_m = self._add_learned(
                    "sharing_m", (inner_steps,), sharing.initial_m, dtype
                )
                self.sharing_lambda = self._add_learned(
                    "sharing_lambda", (inner_steps,), sharing.initial_lambda, dtype
                )
        if sharing is not None:
            # g_hat_k: a weights copy per step (its initial value is never read: the
            # flag says "not initialised" until the first meta-iteration writes it).
            for k in range(inner_steps):
                self.add_weights_copy(f"g_hat_{k}")
            self.g_hat_initialized = self.add_state_variable(
                "g_hat_initialized", dtype=F.counter_dtype()
            )
        self._statistics_indices = []
        self.step_statistics = []  # per step, the copies of the statistics
        if per_step:
            seeds = set(self._seed_indices())
            state = model.non_trainable_variables
            self._statistics_indices = [i for i, v in enumerate(state) if i not in seeds]
            if not self._statistics_indices:
                raise ValueError(
                    "per_step_batch_norm_statistics=True, but the model has no "
                    "statistics (no non-trainable variable but seed states)."
                )
            scope = (
                contextlib.nullcontext() if backend.is_jax() else self.distribute_strategy.scope()
            )
            with scope, _compat.unlocked_state(self):
                for k in range(inner_steps):
                    self.step_statistics.append(
                        [
                            self.add_weight(
                                name=f"step_statistics_{k}_{j}",
                                shape=state[i].shape,
                                dtype=state[i].dtype,
                                initializer=_value_initializer(state[i]),
                                trainable=False,
                                aggregation="mean",
                            )
                            for j, i in enumerate(self._statistics_indices)
                        ]
                    )
        self.add_diagnostic("support_loss", "mean")
        if learn != "none":
            self.add_diagnostic("inner_learning_rate", "last")
        if sharing is not None:
            self.add_diagnostic("sharing_m", "last")
            self.add_diagnostic("sharing_lambda", "last")

    def _add_learned(self, name, shape, value, dtype, key=None):
        def initializer(shape, dtype=None):
            # Not keras.initializers.Constant: it casts the python float through float32
            # (a float64 rate of 0.4 would start at 0.4000000059604645).
            return ops.full(shape, F.scalar(value, dtype), dtype=dtype)

        variable = self.add_weight(
            name=name, shape=shape, dtype=dtype, initializer=initializer, trainable=True
        )
        self._learned[key or name] = variable
        return variable

    @property
    def outer_steps(self):
        """Outer steps (meta-iterations) taken (a checkpointed int64)."""
        return self.schedule.count

    @property
    def transductive_evaluation(self):
        """The `training` flag of the evaluation passes (`evaluate`, `adapt`, `predict`):
        the argument, or when it was None, `inner_training`."""
        if self._transductive_evaluation is None:
            return self.inner_training
        return self._transductive_evaluation

    @transductive_evaluation.setter
    def transductive_evaluation(self, value):
        if value is not None:
            value = _check_bool("transductive_evaluation", value)
        self._transductive_evaluation = value
        self.test_function = self.predict_function = None  # traced with the old flag

    # -------------------------------------------------------------------- the batch

    def _parts(self, x, y, sample_weight, require_y=True):
        """The named parts of a task batch, checked (format, leading task dimension);
        returns (parts, static task count or None)."""
        if not (isinstance(x, (tuple, list)) and len(x) == 3):
            raise ValueError(
                "MAMLTrainer: a batch must be ((support_x, support_y, query_x), query_y"
                "[, query_sample_weight]), each with a leading task dimension; got x of type "
                f"{type(x).__name__}"
                + (f" with {len(x)} parts." if isinstance(x, (tuple, list)) else ".")
            )
        if y is None and require_y:
            raise ValueError(
                "MAMLTrainer: the batch has no query_y (the targets of the query sets)."
            )
        parts = {"support_x": x[0], "support_y": x[1], "query_x": x[2]}
        if y is not None:
            parts["query_y"] = y
        if sample_weight is not None:
            parts["query_sample_weight"] = sample_weight
        tasks = None
        for name, part in parts.items():
            for t in keras.tree.flatten(part):
                rank = _rank(t)
                need = 1 if name == "query_sample_weight" else 2
                if rank is not None and rank < need:
                    raise ValueError(
                        f"MAMLTrainer: `{name}` needs a leading task dimension ([T, N, ...]); "
                        f"got shape {t.shape}. Batch the tasks (one element = T tasks)."
                    )
                n = t.shape[0] if rank else None
                if n is not None:
                    if tasks is not None and n != tasks:
                        raise ValueError(
                            f"MAMLTrainer: the parts of a batch have different task counts "
                            f"({tasks} and {n} in `{name}`)."
                        )
                    tasks = n
        try:
            model_inputs = keras.tree.flatten(self.model.inputs)
        except (AttributeError, ValueError):  # a subclassed model: no symbolic inputs
            model_inputs = []
        if model_inputs:
            for name in ("support_x", "query_x"):
                self._check_task_axis("MAMLTrainer", name, parts[name])
        return parts, tasks

    def _split(self, data, require_y=True):
        """(support batches, query batches, flat query (x, y, sw)) per task."""
        parts, tasks = self._parts(*keras.utils.unpack_x_y_sample_weight(data), require_y=require_y)
        if tasks is None:
            tasks = self.static_tasks_per_replica(None)

            def fix(t):
                return _task_batches().assert_task_count(self, t, tasks)

            parts = {k: keras.tree.map_structure(fix, v) for k, v in parts.items()}
        support_x, support_y, query_x, y = (
            parts["support_x"],
            parts["support_y"],
            parts["query_x"],
            parts.get("query_y"),
        )
        sample_weight = parts.get("query_sample_weight")

        def task(nest, t):
            return None if nest is None else keras.tree.map_structure(lambda a: a[t], nest)

        supports = [(task(support_x, t), task(support_y, t)) for t in range(tasks)]
        queries = [(task(query_x, t), task(y, t), task(sample_weight, t)) for t in range(tasks)]

        def flat(nest):
            if nest is None:
                return None
            return keras.tree.map_structure(
                lambda a: ops.reshape(a, [-1] + list(ops.shape(a)[2:])), nest
            )

        return supports, queries, (flat(query_x), flat(y), flat(sample_weight))

    def example_batch(self, x, y=None, sample_weight=None):
        # Keras builds the model, loss and metrics from a training batch: the first task's
        # query set is a model batch.
        if self._building_from_training_batch:
            self._parts(
                x, y, sample_weight, require_y=False
            )  # a clear error for a batch of another format
        return first_task_query_set(x, y, sample_weight)

    # -------------------------------------------------------------- the learned values

    def _hyper(self):
        """name -> current value of every trainer-owned trainable variable ("lr_<i>",
        "lslr", "sharing_m", "sharing_lambda": the names `algorithms.maml` is given)."""
        return {n: F.read_value(v) for n, v in self._learned.items()}

    def _learning_rates_fn(self, steps):
        n = len(self.model.trainable_variables)
        learn = self.learn_inner_learning_rates

        def learning_rates(h):
            out = []
            for k in range(steps):
                kk = min(k, self.inner_steps - 1)  # past K: step K's rates
                if learn == "none":
                    out.append([self.inner_learning_rate] * n)
                elif learn == "per_parameter":
                    out.append([h[f"lr_{i}"] for i in range(n)])
                else:
                    out.append([h["lslr"][kk, i] for i in range(n)])
            return out

        return learning_rates

    def _g_hat(self, steps):
        index = [min(k, self.inner_steps - 1) for k in range(steps)]
        return [[F.read_value(v) for v in self.weights_copy(f"g_hat_{k}")] for k in index]

    def _step_statistics(self, steps):
        """A fresh `StepStatistics` from the copies (past K: step K's), or None."""
        if not self.per_step_batch_norm_statistics:
            return None
        return M.StepStatistics(
            self._statistics_indices,
            [
                [F.read_value(v) for v in self.step_statistics[min(k, self.inner_steps - 1)]]
                for k in range(steps)
            ],
        )

    def _g_hat_initialized(self):
        return F.read_value(self.g_hat_initialized) > 0

    def _loss_fns(self, loss_scale, training=True):
        """(inner, query): the inner loss in task units (times the loss scale), the query
        loss in Keras's per-replica units (times the loss scale)."""
        base = self.loss_fn(loss_scale=loss_scale, training=training)

        def inner(params, state, batch):
            loss, aux = base(params, state, batch)
            return F.unscale_loss_for_distribution(loss), aux

        return inner, base

    # ------------------------------------------------------------------- train step

    def train_step(self, data):
        self.unpack(data)
        supports, queries, flat_query = self._split(data)
        if not self.optimizer.built:  # before the control-dependent block (XLA)
            self.optimizer.build(self.trainable_variables)
        loss_scale = self.loss_scale()
        inner_fn, query_fn = self._loss_fns(loss_scale, training=self.inner_training)
        steps = self.inner_steps
        order_weight = step_weights = None
        if self.epochs_done is not None:
            epoch = F.read_value(self.epochs_done)
            if self.first_order_epochs:
                order_weight = ops.cast(epoch >= self.first_order_epochs, "float32")
            if self.multi_step_loss:
                # In the weights' dtype: 1/K and 0.03/K are not exact in float32.
                step_weights = M.multi_step_loss_weights(
                    steps,
                    epoch,
                    self.multi_step_loss_epochs,
                    dtype=self.model.trainable_variables[0].dtype,
                )
        sharing_kwargs = {}
        if self.gradient_sharing is not None:
            sharing_kwargs = dict(
                sharing=self.gradient_sharing,
                g_hat=self._g_hat(steps),
                g_hat_initialized=self._g_hat_initialized(),
            )
        statistics = self._step_statistics(steps)
        result = M.meta_gradient(
            inner_fn,
            query_fn,
            F.current_params(self.model),
            F.current_state(self.model),
            supports,
            queries,
            self._hyper(),
            self._learning_rates_fn(steps),
            first_order=self.first_order,
            order_weight=order_weight,
            step_weights=step_weights,
            loss_scale=loss_scale,
            step_statistics=statistics,
            **sharing_kwargs,
        )
        new_state = result.state
        if statistics is not None:  # the model keeps the last step's statistics
            new_state = statistics.enter(steps - 1, new_state)
        by_id = {id(v): g for v, g in zip(self.model.trainable_variables, result.grads)}
        by_id.update({id(v): result.hyper_grads[n] for n, v in self._learned.items()})
        variables = self.trainable_variables
        gradients = [by_id[id(v)] for v in variables]
        loss = result.loss / ops.cast(loss_scale, result.loss.dtype)

        def update():
            self.optimizer.apply_gradients(zip(gradients, variables))
            if self.gradient_sharing is not None:
                for k, values in enumerate(result.g_hat):
                    for v, value in zip(self.weights_copy(f"g_hat_{k}"), values):
                        v.assign(ops.cast(value, v.dtype))
                self.g_hat_initialized.assign(1)
            if statistics is not None:
                for copies, values in zip(self.step_statistics, statistics.values):
                    for v, value in zip(copies, values):
                        v.assign(value)

        # The mean over ALL replicas' tasks (identical on every replica).
        support_loss = F.all_reduce_sum(
            F.replica_share(ops.stop_gradient(result.support_losses[0]))
        )
        diagnostics = {"support_loss": support_loss}
        diagnostics.update(self._learned_diagnostics())
        return self.finish_step(
            flat_query,
            result.y_pred,
            loss,
            new_state=new_state,
            update=update,
            diagnostics=diagnostics,
        )

    def _learned_diagnostics(self):
        out = {}
        if self.learn_inner_learning_rates != "none":
            values = [
                ops.reshape(F.read_value(v), [-1]) for v in self.inner_learning_rate_variables
            ]
            out["inner_learning_rate"] = ops.mean(ops.concatenate(values, 0))
        if self.gradient_sharing is not None:
            out["sharing_m"] = ops.mean(ops.sigmoid(F.read_value(self.sharing_m)))
            out["sharing_lambda"] = ops.mean(ops.sigmoid(F.read_value(self.sharing_lambda)))
        return out

    # ------------------------------------------------------------------ evaluation

    @property
    def _evaluation_steps(self):
        for steps in (self._evaluation_steps_override, self.evaluation_inner_steps):
            if steps is not None:
                return steps
        return self.inner_steps

    def _step_statistics_for(self, steps):
        # Zero steps: the model's own statistics (no step's copy is entered).
        return self._step_statistics(steps) if steps else None

    def _adapt_arguments(self, steps, loss_scale=None):
        """(learning rates, keyword arguments) of `algorithms.maml.adapt` for `steps`
        evaluation inner steps (first order; the stored g_hat, Algorithm 2)."""
        hyper = self._hyper()
        kwargs = {"first_order": True, "loss_scale": loss_scale}
        if self.gradient_sharing is not None and steps:
            index = [min(k, self.inner_steps - 1) for k in range(steps)]
            kwargs.update(
                sharing=self.gradient_sharing,
                sharing_m=ops.take(hyper["sharing_m"], index, axis=0),
                sharing_lambda=ops.take(hyper["sharing_lambda"], index, axis=0),
                g_hat=self._g_hat(steps),
                sharing_training=False,
                g_hat_initialized=self._g_hat_initialized(),
            )
        return self._learning_rates_fn(steps)(hyper), kwargs

    def _adapt(self, supports, loss_scale=None, training=True, steps=None, statistics=None):
        steps = self._evaluation_steps if steps is None else steps
        inner_fn, _ = self._loss_fns(loss_scale, training=training)
        learning_rates, kwargs = self._adapt_arguments(steps, loss_scale)
        return M.adapt(
            inner_fn,
            F.current_params(self.model),
            F.current_state(self.model),
            supports,
            learning_rates,
            step_statistics=statistics,
            **kwargs,
        )

    def _adapt_and_evaluate(self, supports, queries, query_fn=None):
        """`algorithms.maml.adapt_and_evaluate` with the evaluation passes: (mean query
        loss, y_pred of every task's query set at theta_{t,K}, concatenated)."""
        training = self.transductive_evaluation
        steps = self._evaluation_steps
        statistics = self._step_statistics_for(steps)
        inner_fn, base_query_fn = self._loss_fns(None, training=training)
        learning_rates, kwargs = self._adapt_arguments(steps)
        kwargs.pop("first_order")
        loss, _, y_pred, _, _ = M.adapt_and_evaluate(
            inner_fn,
            query_fn or base_query_fn,
            F.current_params(self.model),
            F.current_state(self.model),
            supports,
            queries,
            learning_rates,
            step_statistics=statistics,
            **kwargs,
        )
        return loss, y_pred

    def test_step(self, *args):
        # TensorFlow calls test_step(data); JAX test_step(state, data) -> (logs, state).
        if backend.is_jax():
            from tf_metaalign.trainers.reptile import _stateless_test_step

            return _stateless_test_step(self, self._test_step, *args)
        return self._test_step(*args)

    def _test_step(self, data):
        self.unpack(data)
        supports, queries, flat_query = self._split(data)
        loss, y_pred = self._adapt_and_evaluate(supports, queries)
        x, y, sample_weight = flat_query
        _compat.loss_tracker(self).update_state(
            F.unscale_loss_for_distribution(loss), sample_weight=F.batch_size(x)
        )
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return {k: v for k, v in logs.items() if k not in self._diagnostics}

    def predict_step(self, *args):
        """Task batches `(support_x, support_y, query_x)` (each [T, N, ...]): the model's
        outputs on each task's query set after adaptation, [T, N_query, ...] (passes as in
        `evaluate`). Any other batch: the wrapped model's outputs, as `MetaTrainer`."""
        if backend.is_jax():  # predict_step(state, data) -> (outputs, non-trainable state)
            state, data = args
            if not self._is_task_batch(data):
                return super().predict_step(state, data)
            mapping = list(zip(self.trainable_variables, state[0]))
            mapping += list(zip(self.non_trainable_variables, state[1]))
            with keras.StatelessScope(state_mapping=mapping):
                outputs = self._predict_tasks(data)
            return outputs, state[1]
        (data,) = args
        if not self._is_task_batch(data):
            return super().predict_step(data)
        return self._predict_tasks(data)

    @staticmethod
    def _is_task_batch(data):
        if isinstance(data, (tuple, list)) and len(data) == 1:
            data = data[0]
        return isinstance(data, (tuple, list)) and len(data) == 3

    def _predict_tasks(self, data):
        if isinstance(data, (tuple, list)) and len(data) == 1:
            data = data[0]
        self.unpack((tuple(data), None))
        supports, queries, _ = self._split((tuple(data), None), require_y=False)
        model, training = self.model, self.transductive_evaluation

        def outputs_only(params, state, batch):  # the query passes, without a loss
            y_pred, new_state, _ = F.stateless_forward(model, params, state, batch[0], training)
            first = keras.tree.flatten(y_pred)[0]
            return ops.zeros((), first.dtype), (new_state, y_pred)

        _, y_pred = self._adapt_and_evaluate(supports, queries, outputs_only)
        tasks = len(queries)
        return keras.tree.map_structure(
            lambda a: ops.reshape(a, [tasks, -1] + list(ops.shape(a)[1:])), y_pred
        )

    def evaluate(self, *args, **kwargs):
        if _task_batches() is not None:
            _task_batches().check_evaluate_input(self, args, kwargs)
        # Keras may build the compiled metrics from an evaluation batch (a task batch).
        self._building_from_training_batch = True
        try:
            with _explain_task_count_error(self):
                return super().evaluate(*args, **kwargs)
        finally:
            self._building_from_training_batch = False

    def make_test_function(self, force=False):
        test_function = super().make_test_function(force) or self.test_function
        if getattr(test_function, "_maml_wrapped", False):
            return test_function

        def function(*args):  # TensorFlow: (iterator); JAX: (state, iterator)
            self._building_from_training_batch = False  # real steps from here on
            return test_function(*args)

        function._maml_wrapped = True
        self.test_function = function
        return function

    def evaluate_tasks(self, *args, inner_steps=None, **kwargs):
        """`evaluate` with `inner_steps` inner steps (default: `evaluation_inner_steps`);
        `inner_steps=0` scores the unadapted weights theta on every query set (the
        "0 steps" row of few-shot protocols), with the passes of `evaluate`."""
        if inner_steps is not None:
            inner_steps = _check_epochs("inner_steps", inner_steps)
        self._evaluation_steps_override = inner_steps
        self.test_function = None
        try:
            return self.evaluate(*args, **kwargs)
        finally:
            self._evaluation_steps_override = None
            self.test_function = None

    def adapt(self, support_x, support_y, inner_steps=None):
        """The adapted weights of each task: a list over tasks of lists of tensors (one per
        `model.trainable_variables`), after `inner_steps` (default: `evaluation_inner_steps`)
        inner steps on the task's support set (`support_x`, `support_y`: [T, N, ...], a
        leading TASK axis even for one task: `x[None]`). `inner_steps=0` returns theta
        (the model's weights) for every task: the unadapted score. Run eagerly; forward
        passes as in `evaluate` (`transductive_evaluation`). Use them with
        `model.stateless_call(weights, model.non_trainable_variables, x)`."""
        if inner_steps is not None:
            inner_steps = _check_epochs("inner_steps", inner_steps)
        support_x = keras.tree.map_structure(ops.convert_to_tensor, support_x)
        support_y = keras.tree.map_structure(ops.convert_to_tensor, support_y)
        first = keras.tree.flatten(support_x)[0]
        if _rank(first) is None or _rank(first) < 2:
            raise ValueError(
                f"adapt: `support_x` needs a leading task dimension ([T, N, ...]); "
                f"got shape {first.shape}."
            )
        self._check_task_axis("adapt", "support_x", support_x)
        tasks = first.shape[0]
        for t in keras.tree.flatten(support_y):
            if _rank(t) is None or _rank(t) < 2 or tuple(t.shape[:2]) != tuple(first.shape[:2]):
                raise ValueError(
                    f"adapt: `support_y` must be [T, N, ...] with the T={tasks} tasks and "
                    f"N={first.shape[1]} examples of `support_x` (shape {first.shape}); got "
                    f"shape {t.shape}."
                )
        steps = self._evaluation_steps if inner_steps is None else inner_steps
        if steps == 0:
            return [list(F.current_params(self.model)) for _ in range(tasks)]
        supports = [
            (
                keras.tree.map_structure(lambda a: a[t], support_x),
                keras.tree.map_structure(lambda a: a[t], support_y),
            )
            for t in range(tasks)
        ]
        result = self._adapt(
            supports,
            training=self.transductive_evaluation,
            steps=steps,
            statistics=self._step_statistics_for(steps),
        )
        return [traj[-1] for traj in result.trajectories]

    def _check_task_axis(self, where, name, x):
        """x must be [T, N, *input_shape] for the model's inputs: one task without its
        task axis, or a missing feature axis, is named as such (not as N tasks of one
        example each, adapted silently)."""
        try:
            inputs = keras.tree.flatten(self.model.inputs)
        except (AttributeError, ValueError):  # a subclassed model: no symbolic inputs
            return
        given = keras.tree.flatten(x)
        if len(given) != len(inputs):
            return
        for t, i in zip(given, inputs):
            if _rank(t) is None or _rank(i) is None:
                continue
            if len(inputs) > 1:  # several inputs: the rank only (their order may differ)
                if _rank(t) != _rank(i) + 1:
                    raise ValueError(
                        f"{where}: `{name}` needs a leading task dimension: shape [T, N, ...] "
                        f"of rank {_rank(i) + 1} for the model's input of shape {i.shape}; "
                        f"got shape {t.shape}."
                    )
                continue
            feature = tuple(i.shape[1:])
            shape = tuple(t.shape)
            want = len(feature) + 2
            expected = "[T, N" + "".join(f", {d}" for d in feature) + "]"

            def fits(dims):
                return len(dims) == len(feature) and all(
                    a is None or b is None or a == b for a, b in zip(dims, feature)
                )

            if len(shape) == want and fits(shape[2:]):
                continue
            if len(shape) == want - 1 and fits(shape[1:]):
                raise ValueError(
                    f"{where}: `{name}` of shape {shape} is ONE task without its task axis "
                    "(the leading task dimension) "
                    f"(the model's input is {tuple(i.shape)}); {name} must be {expected} "
                    f"(tasks, examples, features): add the task axis, e.g. `{name}[None]` "
                    "(a [1, N, ...] batch of one task)."
                )
            if len(shape) == want - 1 and fits(shape[2:] + (1,)):
                raise ValueError(
                    f"{where}: `{name}` of shape {shape} lacks the model's feature axis: the "
                    f"model's input is {tuple(i.shape)}, so {name} must be {expected} "
                    f"(tasks, examples, features); add it, e.g. `{name}[..., None]`."
                )
            raise ValueError(
                f"{where}: `{name}` must be {expected} (a leading task dimension, examples, "
                "features) for the "
                f"model's input of shape {tuple(i.shape)}; got shape {shape}."
            )

    # ------------------------------------------------------------------------- fit

    def fit(self, *args, **kwargs):
        # A last batch with fewer tasks, or tasks that do not split among the replicas:
        # refused before the first step (the loop over tasks is unrolled).
        if _task_batches() is not None:
            _task_batches().check_fit_input(self, args, kwargs)
        with _explain_task_count_error(self):
            if self.epochs_done is None:
                return super().fit(*args, **kwargs)
            args, kwargs = with_epoch_counter(args, kwargs, self.epochs_done)
            return super().fit(*args, **kwargs)

    def get_config(self):
        sharing = self.gradient_sharing
        return {
            **super().get_config(),
            "inner_steps": self.inner_steps,
            "inner_learning_rate": self.inner_learning_rate,
            "first_order": self.first_order,
            "learn_inner_learning_rates": self.learn_inner_learning_rates,
            "gradient_sharing": None if sharing is None else sharing.get_config(),
            "multi_step_loss": self.multi_step_loss,
            "multi_step_loss_epochs": self.multi_step_loss_epochs,
            "first_order_epochs": self.first_order_epochs,
            "per_step_batch_norm_statistics": self.per_step_batch_norm_statistics,
            "evaluation_inner_steps": self.evaluation_inner_steps,
            "transductive_evaluation": self._transductive_evaluation,
            "tasks_per_batch": self.tasks_per_batch,
            "inner_training": self.inner_training,
        }
