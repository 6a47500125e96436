"""`MultiTaskTrainer`: multi-task learning on mixed batches with gradient surgery.

The trainer is small: it checks its arguments, knows the tasks (`tasks="rows"` or
"outputs") and the shared / task-specific variables, and its `train_step` hands the batch
to a task layout and one gradient path (`multitask_paths`: one object per way of
obtaining the task gradients), then logs and applies what the path returns.
"""

from __future__ import annotations

import inspect
import warnings

import keras
from keras import ops

from tf_metaalign import _compat
from tf_metaalign import model_graph
from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.trainers import multitask_paths as paths
from tf_metaalign.trainers.base import MetaTrainer, with_epoch_counter

#: How the per-task losses and gradients are computed (see `MultiTaskTrainer`).
TASK_PASSES = ("auto", "factored", "vectorized", "gathered", "masked")
#: The passes with dynamic shapes, TensorFlow only (`multitask_tf`).
TENSORFLOW_ONLY_PASSES = ("vectorized", "gathered")
#: What a task is (see `MultiTaskTrainer`): rows of the batch (`task_id`) or model outputs.
TASK_SETTINGS = ("rows", "outputs")
#: The old per-method keywords: keyword -> (method, option). They still work, with a
#: DeprecationWarning that names the new spelling (`method_options` or the method object).
DEPRECATED_METHOD_KEYWORDS = {
    "gradvac_beta": ("gradvac", "beta"),
    "gradnorm_alpha": ("gradnorm", "alpha"),
    "gradnorm_learning_rate": ("gradnorm", "learning_rate"),
    "gradnorm_variable": ("gradnorm", "variable"),
}


@keras.saving.register_keras_serializable(package="tf_metaalign")
class MultiTaskTrainer(MetaTrainer):
    """Train `model` on T tasks, combining the per-task gradients.

    Two settings, one engine (`tasks=`):

    tasks="outputs" (the default when `num_tasks` is None; LibMTL's multi_input=False:
      NYUv2, Cityscapes, CelebA; the Keras functional-API guide's ticket model): the
      model has one output per task and is compiled with one loss per output,
      `compile(loss={"priority": ..., "department": ...}, loss_weights={...})`; batches
      are the model's ordinary `(x, y)` / `(x, y, sample_weight)`, `y` a dict (or list)
      per output, and every example carries every task's label. Task t is the t-th
      output loss in Keras's order (the model's output order; `trainer.task_names` after
      the first step), and
          L_t = loss_weight_t * (output t's compiled loss),
      the very term Keras adds into fit's loss: the compiled loss is called ONCE per step
      and each output's term recorded (`_compat.recorded_loss_terms`), so targets,
      nested per-output sample weights and `loss_weights` are Keras's own, and the
      per-output "<name>_loss" logs are counted once. `loss_weights` therefore scale the
      tasks BEFORE the method (LibMTL has no loss weights; with none, L_t is LibMTL's
      task loss): "sum" is exactly plain multi-output `fit` (tested step for step), and a
      gradient method sees the weighted tasks' gradients. `num_tasks=None` counts one
      task per output WITH a loss when the trainer is compiled (an auxiliary output
      compiled with no loss, `loss={"aux": None}` or keras-io's `[loss1, loss2, None]`,
      is no task and gets no gradient, as in fit); a given `num_tasks` must equal that
      count (checked by `compile`, or at the first step where the count needs Keras's
      compiled loss) and not exceed the model's outputs. `evaluate` reports the
      total, each output's loss and each output's metrics as Keras does for a
      multi-output model (the trainer takes the model's `output_names`).
      Task-specific variables come from the model's functional graph
      (`tf_metaalign.model_graph`): a layer every call of which feeds ONE output only is
      that output's head, its variables that task's; the rest is shared. A Sequential or
      subclassed model has no graph to read: every variable is shared unless
      `task_specific_variables=` lists the heads' (and `num_tasks` must be given).

    tasks="rows" (the default when `num_tasks` is given; LibMTL's multi_input=True):
      batches mix examples of T tasks, `x = {"inputs": <model inputs>, "task_id": int
      [B]}`; the model is called on `x["inputs"]`, or on the whole dict with
      `model_takes_task_id=True` (per-task heads). `evaluate` / `predict` take the same
      dicts (or plain model inputs). `num_tasks` must equal the heads of every
      `PerTaskHead` layer of the model (checked once the model is built), and every
      task_id lie in [0, num_tasks) (checked each step in graph mode; XLA drops the
      check). The rest of this doc describes how rows are masked.

    Per-task losses (tasks="rows"). One forward pass over the whole batch; task t's loss
    is the trainer's compiled loss (`functional.compute_loss`, the loss `fit` uses) evaluated with
    the
    sample weights `sample_weight * [task_id == t]` and rescaled to the task's MEAN:
    with Keras's default "sum_over_batch_size" reduction, the masked loss is
    `sum_{i in t} w_i l_i / B`, so it is multiplied by `B / n_t`, where n_t is the number of
    task-t examples in the GLOBAL batch (all replicas): L_t = sum_{i in t} w_i l_i / n_t.
    (Sample-weight masks rather than evaluating on boolean-masked sub-batches: the shapes
    stay static, so it runs under XLA, and the forward pass is shared.) A task absent
    from the batch has L_t = 0 and a zero gradient and is left out of the surgery and the
    diagnostics. The model's own losses (regularisers, `add_loss`) are not task losses:
    their gradient is added once, after the combination, as `fit` adds it. Other loss
    reductions ("sum", a `compute_loss` override) are scaled the same way: the task loss
    is then B/n_t times that reduction of the task's examples.

    Per-task passes (`task_passes`):
      "factored": no per-task gradient is formed. When every shared variable is the
        kernel or bias of a plain `keras.layers.Dense` layer called once on [batch,
        features] inputs (an MLP encoder under per-task heads), task t's gradient of
        such a layer is X_t^T dZ_t (its inputs and the gradients at its pre-activation
        outputs, over task t's rows), so the Gram matrix is
        S^T ((X X^T + 1) * (dZ dZ^T)) S and the combination sum_t c_t g_t is ONE
        weight-gradient product X^T (c_task(row) * dZ) (`gradient_surgery.
        dense_task_gram`, `dense_combined_gradient`; Goodfellow 2015). One forward pass
        records X and z, ONE backward pass of sum_t L_t gives every row's dZ (its own
        task's: the rows do not interact), task-specific variables get the gradient of
        sum_t s_t L_t through the heads. Static shapes (XLA), dropout allowed (the same
        masks as "masked", which it equals: tested), model losses added as "masked"
        adds them; under a strategy X, dZ and the task one-hots are all-gathered for the
        global Gram matrix (the cost: B^2 (d_in + d_out) per layer, B the global batch).
        GradNorm's layer norms: the diagonal of that layer's own Gram matrix
        (`TaskInputs.variable_gram`). Not for BatchNorm (rows interact) or other shared
        layers (LayerNorm, embeddings, attention: "vectorized").
      "vectorized": each task's loss and gradient over its own rows, the T tasks in ONE
        `tf.vectorized_map` pass: the batch is laid out [T, m, ...] (task t's rows,
        padded with weight-0 rows to m, the largest task count on the replica), so the
        T sub-batch forward and backward passes are batched ops with the FLOPs of one
        pass over the batch (for balanced tasks) and the per-task gradients come out
        stacked [T, ...] per variable, read in place by the Gram matrix and the
        combination. Dynamic shapes (no XLA). Every task's forward starts from the
        step's state, so it takes no model state but dropout's seeds (an error names
        the others, e.g. BatchNorm statistics); with dropout, the T tasks draw the SAME
        masks for their j-th rows (the seeds advance once per step), where "gathered"
        draws each task's in turn: that is why "auto" leaves models with dropout to
        "gathered".
        over that task's own rows of the batch (gathered by `task_id`): T passes over
        sub-batches cost about one pass over the whole batch. The shapes are dynamic,
        so it does not run under XLA. The model's state (BatchNorm moving statistics,
        dropout seeds) is threaded through the T forward passes in task order, so
        BatchNorm normalises each task's examples with that task's batch statistics.
      "masked": one forward pass over the whole batch and T backward passes through it
        (a persistent tape), each masked to a task: T times the backward cost of plain
        `fit`, static shapes (XLA).
      "auto" (default): "factored" where it applies (above; XLA included); else
        "masked" under `jit_compile=True` or when the model has its own
        losses (regularisers, `add_loss`: the masked path adds their gradient exactly as
        `fit` does); else "vectorized" for a model without state (non-trainable
        variables), "gathered" for one with (BatchNorm, dropout). All three give the
        same task losses and gradients for a model without state (tested). Measured
        (benchmarks/multitask_overhead.py, MLP, T = 8, 2-core CPU): PCGrad factored
        1.3x plain `fit`, vectorized 1.5-1.6x, gathered 2.7x, masked 5x. With tasks="outputs"
        every row belongs to every task: the passes are "masked" (or `rep_grad`).
    `compile_combination` (default True): the method's combination (its algebra on the
    T x T Gram matrix: projections, solvers, an eigen-decomposition; hundreds of tiny
    ops) and the task cosine run as one XLA-compiled function inside the step, which
    saves 0.3-2.6 ms of op dispatch per step on a CPU at T = 8 (methods whose
    `compiles_well` is False, CAGrad and GradNorm, keep graph ops). Equal to the graph
    ops to rounding (tested); False turns it off (a platform without XLA). One compiled
    function per method configuration (class, hyperparameters, seed) is shared by every
    trainer in the process, so a sweep of fresh trainers compiles it once per input
    signature (TensorFlow's XLA cache keeps every compiled function for the process).
    Under a strategy the per-task losses and gradients are all-reduced BEFORE the
    combination (PCGrad, GradVac and GradNorm are non-linear in the gradients: combining
    per-replica gradients would not give the global batch's update), so the combination
    sees the global per-task gradients on every replica and 1 replica == N replicas; the
    combined gradient is handed to the optimizer divided by the replica count
    (`functional.replica_share`), whose cross-replica sum gives it back.

    Methods (`method=`): a name (`"pcgrad"`) or a method object (`PCGrad()`,
    `GradVac(beta=0.2)`, ... from `tf_metaalign.algorithms.multitask`, whose registry
    lists them all: `methods.method_names()`); a name takes its options from
    `method_options={...}`. Each turns the global per-task losses L_t and gradients g_t
    into coefficients (see `tf_metaalign.algorithms.multitask.base`):
      shared variables:        G = sum_t c_t g_t   (the surgery / weighting)
      task-specific variables: G = sum_t s_t g_t   (their own task's gradient: s = 1 for
                               the gradient methods, s = the loss weights for the
                               loss-weighting ones, as LibMTL does).
    "sum" (equal weighting, LibMTL's EW): G = sum_t grad L_t, from ONE backward pass of
    the summed loss; on batches where every task has B/T examples and the compiled loss
    is a mean, that is exactly T times plain `fit`'s gradient. Loss-weighting methods
    (`uses_gradients = False`: sum, UW, DWA, RLW, FAMO) take one backward pass of
    sum_t w_t L_t and hand the optimizer its gradient as the tape returns it, as
    Keras's TF trainer hands fit's: an Embedding's gradient stays `tf.IndexedSlices`,
    which Keras's optimizers apply slice by slice (a token repeated in the batch adds
    the sum of its slices' squares to Adam's, RMSprop's or Adagrad's second moment), and
    a variable no loss reaches gets None (skipped, as by fit). The gradient methods
    (PCGrad, GradVac, GradNorm, ...) take T passes and DENSIFY: per-task gradients are
    stacked, dotted and combined as dense tensors (`functional.dense_gradient`), so the
    optimizer gets a dense update (a repeated token's second moment then grows by the
    square of its summed gradient, and an unreached variable gets zeros, which a weight
    decay still shrinks); so do the loss-weighting methods with
    `measure_task_cosine=True` (their update is then combined from the dense task
    gradients). The per-task-gradient `task_cosine` diagnostic is measured
    (and logged) by the gradient methods, and by the others only with
    `measure_task_cosine=True` (it costs T backward passes); without it a
    loss-weighting method logs no `task_cosine`.

    Shared vs task-specific variables (`task_specific_variables`): by default the
    variables of every `PerTaskHead` layer in the model (the heads of
    `data.one_head_per_task_model`) are task-specific and the rest shared; give a list
    of further variables (or variable paths) to add them; "none" treats every variable
    as shared (this trainer's behaviour before: surgery over the heads too). The surgery,
    the Gram matrix, `task_cosine` and GradNorm's layer are over the shared variables.

    Representation gradients (`rep_grad=True`, LibMTL's `rep_grad`; MGDA with it is
    MGDA-UB): the task gradients are taken with respect to the shared REPRESENTATION z
    (the output of the last shared layer, found from the graph; with tasks="rows" the
    input of the `PerTaskHead` layer; or the output of the layer named by
    `representation=`): one forward pass, T backward passes through the heads only
    (dL_t/dz [B, ...] and the heads' own gradients; with tasks="rows" ONE backward pass
    of sum_t L_t gives every task's rows of dL_t/dz at once, and one more the heads'
    sum_t s_t g_t, unless a layer after z has state, e.g. BatchNorm, which mixes the
    rows), the method run on the Gram matrix of
    r_t = sum over the batch of dL_t/dz (LibMTL sums over the batch), then ONE backward
    pass of sum_t c_t dL_t/dz through the encoder: with c held fixed that is the encoder
    gradient of sum_t c_t L_t, J^T sum_t c_t dL_t/dz. Heads get sum_t s_t g_t as
    without it (their raw task gradients for gradient methods). It costs one encoder
    backward pass instead of T. Every shared variable must lie before z and every
    variable after z be task-specific (an error says which is not); the model must be
    functional; loss-weighting methods (no task gradients) refuse it. GradNorm's
    "layer" is then z itself; `task_cosine` is measured on the r_t.
    Where it equals the parameter-level method (tested): any fixed coefficients, for
    any encoder (the pull-back is linear); methods whose coefficients are invariant to
    scaling the Gram matrix (PCGrad, MGDA, IMTL-G; CAGrad up to its 1e-8 epsilons) when
    the two Gram matrices are proportional, e.g. a linear encoder z = W x + b on a batch
    of one repeated input, where <g_i, g_j> = (|x|^2 + 1) <r_i, r_j>. Elsewhere it is a
    different method: the Gram matrix of batch-summed representation gradients is not
    J's image of the parameters' (Nash-MTL is not even scale invariant). One more
    difference from LibMTL: with MGDA's `normalization` other than "none" this applies
    the method's coefficients w_t / n_t to dL_t/dz, as at the parameter level; LibMTL's
    rep_grad MGDA applies the unnormalised w_t.

    Per-method options: `method_options={"beta": 0.2}` (for the method named by
    `method`) or the method object (`method=GradVac(beta=0.2)`); an option the method
    does not take is a ValueError naming the method and its options. The old keywords
    `gradvac_beta`, `gradnorm_alpha`, `gradnorm_learning_rate`, `gradnorm_variable`
    still set those options, with a DeprecationWarning naming the new spelling (an
    error with any other method).

    On JAX (`KERAS_BACKEND=jax`): the same trainer and numbers (tested against
    TensorFlow's at float64); the step is compiled whole, so `compile_combination` has
    nothing left to do; the passes are "factored" and "masked" ("vectorized" and
    "gathered" have dynamic shapes, which jit does not take: asking for them is an
    error). Under `keras.distribution.DataParallel` the step sees the GLOBAL batch:
    every device's rows are one batch of the method, as TensorFlow's one replica sees
    them; TensorFlow under a strategy all-reduces the per-task losses and gradients
    before the combination, which gives the same update (1 device == 2 devices, tested
    on both).

    Mixed precision: the per-task gradients are unscaled (divided by the loss scale)
    before the combination and the combined gradient scaled back for the
    LossScaleOptimizer.

    State (checkpointed trainer variables): `count` (steps, drives the RNG), the method's
    own (`<method>_<key>`, e.g. `gradvac_targets` [T, T], `gradnorm_weights` [T]), and
    `epochs_done` for the methods that read the epoch (DWA); with tasks='outputs' and
    `num_tasks=None` they are created by `compile` (which counts the tasks). Logs:
    "loss" = sum_t w_t L_t with the method's loss weights, and, where it is measured
    (above), "task_cosine", the mean pairwise cosine of the task gradients (before
    surgery) over the tasks present.

    Example:
      >>> from tf_metaalign.trainers import MultiTaskTrainer
      >>> inputs = keras.Input((3,))
      >>> shared = keras.layers.Dense(8, activation="relu")(inputs)
      >>> outputs = {t: keras.layers.Dense(1, name=t)(shared) for t in ("a", "b")}
      >>> trainer = MultiTaskTrainer(keras.Model(inputs, outputs), method="pcgrad")
      >>> trainer.compile(optimizer="adam", loss={"a": "mse", "b": "mse"})  # a task per output
      >>> x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
      >>> history = trainer.fit(x, {"a": x[:, :1], "b": -x[:, :1]}, batch_size=8, verbose=0)
      >>> trainer.task_names
      ['a', 'b']

    References:
      Yu et al., "Gradient Surgery for Multi-Task Learning", NeurIPS 2020 (PCGrad); the
      other methods' papers are in `tf_metaalign.algorithms.multitask`. LibMTL:
      https://github.com/median-research-group/LibMTL
    """

    backends = ("tensorflow", "jax")

    def __init__(
        self,
        model: keras.Model,
        num_tasks=None,
        method="sum",
        model_takes_task_id: bool = False,
        seed: int = 0,
        method_options=None,
        task_specific_variables=None,
        measure_task_cosine=None,
        task_passes: str = "auto",
        gradvac_beta=None,
        gradnorm_alpha=None,
        gradnorm_learning_rate=None,
        gradnorm_variable=None,
        tasks=None,
        rep_grad: bool = False,
        representation=None,
        compile_combination: bool = True,
        **kwargs,
    ):
        setting = _check_arguments(
            model,
            num_tasks,
            tasks,
            rep_grad,
            compile_combination,
            representation,
            model_takes_task_id,
            seed,
            task_passes,
            measure_task_cosine,
        )
        self.method_object = _method_from_arguments(
            method,
            method_options,
            {
                "gradvac_beta": gradvac_beta,
                "gradnorm_alpha": gradnorm_alpha,
                "gradnorm_learning_rate": gradnorm_learning_rate,
                "gradnorm_variable": gradnorm_variable,
            },
        )
        self._task_specific_request = _check_task_specific_request(task_specific_variables)
        super().__init__(model, **kwargs)
        self.task_passes = task_passes
        self.num_tasks = num_tasks
        self.tasks = setting
        self.task_layout = paths.RowTasks() if setting == "rows" else paths.OutputTasks()
        self.rep_grad = rep_grad
        self.representation = representation
        self.compile_combination = compile_combination
        self._cache = _Untracked()
        if setting == "outputs" and model_graph.has_graph(model):
            # Keras's compile names per-output losses and metrics by the output names.
            self.output_names = list(model.output_names)
        self.method = self.method_object.name
        self.model_takes_task_id = model_takes_task_id
        self.seed = seed
        self.measure_task_cosine = measure_task_cosine
        self.steps = self.every_k_steps(1, name="multitask_steps")
        self.method_state = {}
        self._trainable_method_state = {}
        self.epochs_done = None
        if num_tasks is not None:
            self._create_method_state()
        self.add_diagnostic("task_cosine", "mean")
        # Logged only where measured: a loss-weighting method forms no task gradients.
        self.set_active_diagnostics(["task_cosine"] if self._needs_task_gradients() else [])
        if rep_grad and not self.method_object.uses_gradients:
            raise ValueError(
                f"`rep_grad=True` computes the task gradients at the shared representation; "
                f"method={self.method!r} weighs the losses without task gradients (its "
                "update is one backward pass already): use rep_grad=False."
            )
        self._check_num_tasks_against_heads()
        if model.built:
            self._variable_split()  # bad task_specific_variables / GradNorm layer fail now
            if rep_grad:
                self._rep_plan()

    def _create_method_state(self):
        """The method's state variables for `num_tasks` tasks (and `epochs_done` for a
        method that reads the epoch): in `__init__` when `num_tasks` is known, else in
        `compile`, which counts the output losses (in the same order either way, so a
        reloaded trainer's variables line up with the saved ones)."""
        num_tasks = self.num_tasks
        for key, spec in self.method_object.state_spec(num_tasks).items():
            name = spec.name or f"{self.method}_{key}"
            initializer = spec.initializer
            if isinstance(initializer, (int, float)):
                # Exact in the variable's dtype (Keras's Constant rounds through float32).
                value = float(initializer)
                initializer = (
                    lambda v: (
                        lambda shape, dtype=None: ops.full(
                            shape, F.scalar(v, dtype or "float32"), dtype=dtype or "float32"
                        )
                    )
                )(value)
            if spec.trainable:
                # Trained by the compiled optimizer beside the model: in the dtype of the
                # model's variables (float32 under mixed precision), like its slots.
                variable = self.add_weight(
                    name=name,
                    shape=spec.shape,
                    dtype=keras.backend.floatx(),
                    initializer=initializer,
                    trainable=True,
                )
                self._trainable_method_state[key] = variable
            else:
                variable = self.add_state_variable(name, spec.shape, spec.dtype, initializer)
            self.method_state[key] = variable
            setattr(self, name, variable)
        if getattr(self.method_object, "uses_epoch", False):
            self.epochs_done = self.add_state_variable("epochs_done", dtype=paths.counter_dtype())

    def compile(self, optimizer="rmsprop", loss=None, *args, **kwargs):
        """`MetaTrainer.compile`; with tasks='outputs' it counts the output losses: one
        task per output that has a loss (`num_tasks=None`), or checks `num_tasks`
        against them. Without a `loss` the wrapped model's own compiled loss counts."""
        super().compile(optimizer, loss, *args, **kwargs)
        if self.tasks != "outputs":
            return
        loss = loss if loss is not None else getattr(self.model, "loss", None)
        outputs = len(self.model.outputs) if model_graph.has_graph(self.model) else None
        count = _output_loss_count(loss, outputs)
        if count is None:
            if self.num_tasks is None:
                raise ValueError(
                    "MultiTaskTrainer(tasks='outputs', num_tasks=None) counts one task per "
                    "output with a compiled loss: compile the trainer with one loss per "
                    "output, e.g. loss={'<output name>': ..., ...}."
                )
            return  # checked against the compiled loss's terms at the first step
        if self.num_tasks is None:
            if count < 2:
                raise ValueError(
                    "MultiTaskTrainer(num_tasks=None) makes one task per output with a loss; "
                    f"the compiled `loss` gives {count} of the model's {outputs} outputs a "
                    "loss: give two or more outputs a loss (or `num_tasks` explicitly)."
                )
            self.num_tasks = count
            self._cache.counted_tasks = True
            with _state_creation_scope(self), _compat.unlocked_state(self):
                self._create_method_state()
        elif count != self.num_tasks:
            counted = " (counted by an earlier compile)" if self._cache.counted_tasks else ""
            raise ValueError(
                f"MultiTaskTrainer(tasks='outputs', num_tasks={self.num_tasks}){counted}: "
                f"the compiled `loss` gives {count} outputs a loss; one task is one output's "
                "loss: give num_tasks = the number of outputs with a loss (or None to count "
                "them), or a loss for each task's output."
            )

    def _check_num_tasks_against_heads(self):
        """tasks='rows': `num_tasks` must be the number of heads of every `PerTaskHead`
        layer of the model (one per task_id value)."""
        if self.tasks != "rows":
            return
        for layer in _compat.flatten_layers(self.model):
            if isinstance(layer, paths.per_task_head_class()) and (
                layer.num_tasks != self.num_tasks
            ):
                raise ValueError(
                    f"`num_tasks`={self.num_tasks}, but the `model` {self.model.name!r} has "
                    f"{layer.num_tasks} task heads (its PerTaskHead layer {layer.name!r}): "
                    "num_tasks is the number of task_id values, one per head."
                )

    # ----------------------------------------------------------------- batches

    def model_inputs(self, x):
        if self.tasks == "outputs":
            return x
        return paths.model_inputs_of(x, self.model_takes_task_id)

    def call(self, inputs, training=None):
        return super().call(self.model_inputs(inputs), training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(self.model_inputs(x), y, y_pred, sample_weight, training)

    def unpack(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self.tasks == "outputs":
            if not self.model.built:
                self.model(x, training=False)
            return x, y, sample_weight
        if not paths.is_task_batch_x(x):
            raise ValueError(
                "MultiTaskTrainer: a training batch's x must be a dict {'inputs': <model "
                "inputs>, 'task_id': int [B]}; got "
                + (f"a dict with keys {sorted(x)}" if isinstance(x, dict) else type(x).__name__)
                + " (for a model with one output per task, "
                "compiled with a loss per output, use tasks='outputs' or num_tasks=None)."
            )
        task_id = x["task_id"]
        dtype = keras.backend.standardize_dtype(task_id.dtype)
        if "int" not in dtype or len(task_id.shape) != 1:
            raise ValueError(
                "MultiTaskTrainer: x['task_id'] must be an integer vector [B] (the task of "
                f"each example); got dtype {dtype}, shape {tuple(task_id.shape)}."
            )
        if not self.model.built:
            self.model(self.model_inputs(x), training=False)
            self._check_num_tasks_against_heads()  # a subclassed model's, built now
        return x, y, sample_weight

    # ------------------------------------------------------------ the variables

    @property
    def shared_variables(self):
        """The model's trainable variables the method combines (surgery / weighting)."""
        shared, _ = self._variable_split()
        return [self.model.trainable_variables[i] for i in shared]

    @property
    def task_specific_variables(self):
        """The model's trainable variables that receive their own task's gradient
        (`PerTaskHead` layers, heads found from a multi-output graph, and those named in
        `task_specific_variables=`)."""
        _, specific = self._variable_split()
        return [self.model.trainable_variables[i] for i in specific]

    def _variable_split(self):
        """(shared, task-specific) positions in `model.trainable_variables`."""
        variables = self.model.trainable_variables
        request = self._task_specific_request
        specific = set()
        if request != "none":
            for layer in _compat.flatten_layers(self.model):
                if isinstance(layer, paths.per_task_head_class()):
                    specific |= {id(v) for v in layer.trainable_variables}
            if self.tasks == "outputs" and model_graph.has_graph(self.model):
                # The layers only one output depends on are that output's head.
                for own in model_graph.task_specific_variables(self.model):
                    specific |= {id(v) for v in own}
            by_id = {id(v) for v in variables}
            by_path = {v.path: v for v in variables}
            for item in request or ():
                if isinstance(item, str):
                    if item not in by_path:
                        raise ValueError(
                            f"`task_specific_variables`: {item!r} is not the path of a "
                            f"trainable variable of the model; paths: {sorted(by_path)}."
                        )
                    specific.add(id(by_path[item]))
                elif id(item) in by_id:
                    specific.add(id(item))
                else:
                    raise ValueError(
                        "`task_specific_variables`: "
                        f"{getattr(item, 'path', item)!r} is not a trainable variable of the "
                        "model (give the model's own variables or their paths)."
                    )
        shared = [i for i, v in enumerate(variables) if id(v) not in specific]
        task_specific = [i for i, v in enumerate(variables) if id(v) in specific]
        if not shared and self.method_object.uses_gradients:
            raise ValueError(
                f"MultiTaskTrainer(method={self.method!r}): every trainable variable is "
                "task-specific, so there is no shared gradient to combine; check "
                "`task_specific_variables`."
            )
        if isinstance(self.method_object, methods.GradNorm):
            self.method_object.variable_index([variables[i] for i in shared])
        return shared, task_specific

    # ----------------------------------------------------------- the gradient path

    def _needs_task_gradients(self):
        if self.measure_task_cosine is not None:
            return self.method_object.uses_gradients or self.measure_task_cosine
        return self.method_object.uses_gradients

    def _task_passes_used(self):
        """The per-task pass a gradient step takes: "factored", "vectorized", "gathered"
        or "masked" (what `task_passes` asks for, "auto" resolved; see the class doc)."""
        if self.tasks == "outputs":
            return "masked"
        if self.task_passes != "auto":
            return self.task_passes
        if self._factored_plan(explain=False) is not None:
            return "factored"
        if paths.backend_name() != "tensorflow":
            return "masked"  # the passes with dynamic shapes are TensorFlow's
        if (
            getattr(self, "jit_compile", False) is True
            or self.model.losses
            or any(
                getattr(layer, "activity_regularizer", None) is not None
                for layer in [self.model, *_compat.flatten_layers(self.model)]
            )
        ):
            return "masked"
        return "gathered" if self.model.non_trainable_variables else "vectorized"

    def gradient_path(self) -> paths.GradientPath:
        """The object that obtains this step's task gradients (see `multitask_paths`)."""
        if self.rep_grad:
            return paths.RepGrad()
        if not self._needs_task_gradients():
            return paths.LossWeighted()
        passes = self._task_passes_used()
        if passes == "factored":
            return paths.FactoredPasses()
        if passes == "masked":
            return paths.MaskedPasses()
        from tf_metaalign.trainers import multitask_tf

        return (
            multitask_tf.VectorizedPasses()
            if passes == "vectorized"
            else (multitask_tf.GatheredPasses())
        )

    def _factored_plan(self, explain=True):
        """The plain Dense layers whose kernels and biases are ALL the shared variables,
        in `model.trainable_variables` positions: [(layer, kernel index, bias index or
        None)], when the "factored" pass applies; else None (`explain=False`) or a
        ValueError saying why (`explain=True`, for task_passes="factored")."""
        if self._cache.factored_plan is None:
            self._cache.factored_plan = paths.find_factored_plan(self)
        plan, reason = self._cache.factored_plan
        if plan is None and explain:
            raise ValueError(
                f"MultiTaskTrainer(task_passes='factored'): {reason} (use 'auto', which "
                "falls back to 'vectorized', 'gathered' or 'masked')."
            )
        return plan

    def _rep_plan(self):
        """`rep_grad`'s plan (`multitask_paths.RepPlan`), built once."""
        if self._cache.plan is None:
            self._cache.plan = paths.rep_plan(self)
        return self._cache.plan

    # -------------------------------------------------------------------- step

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        params, state = F.current_params(self.model), F.current_state(self.model)
        acc = keras.backend.standardize_dtype(F.accumulation_dtype(params))
        batch = self.task_layout.batch(self, x, y, sample_weight, self._compiled_loss(), acc)
        inputs = self._step_inputs(batch, params, state)
        result = self.gradient_path().step(self, batch, inputs)
        return self._finish(data, batch, inputs, result)

    def _step_inputs(self, batch, params, state):
        """What every gradient path gets besides the batch (`multitask_paths.StepInputs`),
        with `task_inputs(...)`, the builder of the method's `TaskInputs`."""
        T, acc = self.num_tasks, batch.acc
        shared_index, specific_index = self._variable_split()
        variables = self.model.trainable_variables
        step = F.read_value(self.steps.count)
        epoch = (
            F.read_value(self.epochs_done)
            if self.epochs_done is not None
            else ops.convert_to_tensor(0, dtype=paths.counter_dtype())
        )
        method_state = {k: F.read_value(v) for k, v in self.method_state.items()}

        def task_inputs(
            losses, task_grads=None, gram=None, shared_variables=None, variable_gram=None
        ):
            # task_grads: stacked by variable ([T, ...] per variable) when gram is None,
            # else task_grads[t][v] (rep_grad's representation gradients).
            shared_grads = None
            if task_grads is not None and gram is None:
                stacked = [task_grads[i] for i in shared_index]
                gram = GS.stacked_gram_matrix(stacked) if shared_index else ops.zeros([T, T], acc)
                # task t's list of gradients (graph pruning drops the slices unless a
                # method reads them: GradNorm's layer norms)
                per_variable = [ops.unstack(g, num=T) for g in stacked]
                shared_grads = [[g[t] for g in per_variable] for t in range(T)]
            elif task_grads is not None:
                shared_grads = task_grads
            if shared_variables is None:
                shared_variables = [variables[i] for i in shared_index]
            return methods.TaskInputs(
                losses=losses,
                present=batch.present,
                step=step,
                epoch=epoch,
                seed=self.seed,
                gram=gram,
                task_grads=shared_grads,
                shared_variables=shared_variables,
                variable_gram=variable_gram,
            )

        return paths.StepInputs(
            params=params,
            state=state,
            loss_scale=self.loss_scale(),
            method_state=method_state,
            task_inputs=task_inputs,
            shared_index=shared_index,
            specific_index=specific_index,
        )

    def _finish(self, data, batch, inputs, result):
        """Log the loss and the cosine, assign the method's state, apply the gradient."""
        acc, combination = batch.acc, result.combination
        shared_c, _ = paths.coefficients(combination, acc)
        # The reported loss weighs each task as the method weighs its loss: the loss
        # weights it names, else its task-specific coefficients (1 for the gradient
        # methods, the weights of a weighting method).
        loss_weights = next(
            ops.cast(w, acc)
            for w in (combination.loss_weights, combination.specific, shared_c)
            if w is not None
        )
        total = ops.sum(loss_weights * result.losses)
        if result.regularizer is not None:
            total = total + ops.cast(F.all_reduce_sum(result.regularizer), acc)
        loss = F.scale_loss_for_distribution(ops.cast(total, "float32"))
        # The state is assigned only once the loss is known finite (finish_step checks
        # it again before the model's variables are touched).
        loss = self.check_finite_loss(loss)

        def assign_state():
            for key, value in combination.state.items():
                variable = self.method_state[key]
                variable.assign(ops.cast(value, variable.dtype))

        # (None: a variable no loss reaches, left to the optimizer as fit leaves it)
        gradient = _after(loss, assign_state, result.gradient)
        diagnostics = {}
        if result.cosine is not None:
            weight = ops.cast(ops.sum(batch.present) >= 2, "float32")
            diagnostics["task_cosine"] = (result.cosine, weight)
        if not self._trainable_method_state:
            return self.finish_step(
                data,
                result.y_pred,
                loss,
                new_state=result.new_state,
                gradients=gradient,
                diagnostics=diagnostics,
                where="the multi-task loss",
            )
        # Trainable method state (UW's log-variances): trained by the compiled optimizer
        # beside the model, with its global gradient shared out like the model's.
        keys = list(self._trainable_method_state)
        extra_vars = [self._trainable_method_state[k] for k in keys]
        loss_scale = inputs.loss_scale
        extra = F.replica_share(
            [
                ops.cast(combination.state_gradients[k], v.dtype) * ops.cast(loss_scale, v.dtype)
                for k, v in zip(keys, extra_vars)
            ]
        )
        variables = self.model.trainable_variables
        by_id = {id(v): g for v, g in zip(list(variables) + extra_vars, list(gradient) + extra)}
        # In the trainer's variable order, the order Keras builds its optimizer in (on
        # reload too), so the slots line up.
        all_vars = self.trainable_variables
        all_grads = [by_id[id(v)] for v in all_vars]
        if not self.optimizer.built:
            self.optimizer.build(all_vars)

        def update():
            self.optimizer.apply_gradients(zip(all_grads, all_vars))

        return self.finish_step(
            data,
            result.y_pred,
            loss,
            new_state=result.new_state,
            update=update,
            diagnostics=diagnostics,
            where="the multi-task loss",
        )

    def _output_task_losses(self, model_x, y, y_pred, sample_weight, compiled, acc, model_losses):
        """The T output losses of a multi-output model (tasks='outputs'): ONE call of the
        compiled loss, as fit makes it (its per-output loss trackers count once), with
        each output's term recorded: L_t = loss_weight_t * loss_t(y_t, y_pred_t), the
        term Keras adds into its total."""
        compile_loss = compiled if compiled is not None else _compat.compiled_loss(self.model)
        if compile_loss is None:
            raise ValueError(
                "MultiTaskTrainer(tasks='outputs'): no compiled loss; compile the trainer "
                "with one loss per output, e.g. loss={'<output name>': ..., ...}."
            )
        with _compat.recorded_loss_terms(compile_loss) as terms:
            F.compute_loss(
                self.model,
                model_x,
                y,
                y_pred,
                sample_weight,
                paths.held_model_losses(model_losses),
                training=True,
                loss=compiled,
            )
        if len(terms) != self.num_tasks:
            names = _compat.compile_loss_names(compile_loss)
            counted = " (counted from compile's `loss`)" if self._cache.counted_tasks else ""
            raise ValueError(
                f"MultiTaskTrainer(tasks='outputs', num_tasks={self.num_tasks}){counted}: the "
                f"compiled loss has {len(terms)} output losses ({names}); one task is one output's "
                "loss: give a loss for each output (or num_tasks = their number)"
                + (" (a compute_loss override must call the compiled loss)" if not terms else "")
                + "."
            )
        if self._cache.task_names is None:
            self._cache.task_names = tuple(_compat.compile_loss_names(compile_loss) or ())
        losses = []
        for value, weight in terms:
            # What CompileLoss.call does with each term before summing them.
            value = ops.cast(value, compile_loss.dtype)
            if weight is not None:
                value = ops.multiply(value, weight)
            losses.append(ops.cast(value, acc))
        return losses

    @property
    def task_names(self):
        """The tasks' names: the output names with tasks='outputs' (known once the
        compiled loss is built: after the first step), else 'task_<t>'."""
        if self.tasks == "outputs" and self._cache.task_names:
            return list(self._cache.task_names)
        return [f"task_{t}" for t in range(self.num_tasks)]

    def fit(self, *args, **kwargs):
        if self.epochs_done is not None:
            # first among the callbacks: BackupAndRestore saves the epoch's new count
            args, kwargs = with_epoch_counter(args, kwargs, self.epochs_done)
        return super().fit(*args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_tasks=self.num_tasks,
            method=methods.serialize_method(self.method_object),
            model_takes_task_id=self.model_takes_task_id,
            seed=self.seed,
            task_specific_variables=(
                self._task_specific_request
                if self._task_specific_request in (None, "none")
                else [getattr(v, "path", v) for v in self._task_specific_request]
            ),
            measure_task_cosine=self.measure_task_cosine,
            task_passes=self.task_passes,
            tasks=self.tasks,
            rep_grad=self.rep_grad,
            representation=self.representation,
            compile_combination=self.compile_combination,
        )
        return config


def _check_arguments(
    model,
    num_tasks,
    tasks,
    rep_grad,
    compile_combination,
    representation,
    model_takes_task_id,
    seed,
    task_passes,
    measure_task_cosine,
):
    """Validate `MultiTaskTrainer`'s arguments (errors name the argument); returns the
    task setting, "rows" or "outputs"."""
    if num_tasks is not None and (
        isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1
    ):
        raise ValueError(
            f"`num_tasks` must be an integer >= 1 (or None: one task per "
            f"output of a multi-output model); got {num_tasks!r}."
        )
    if tasks is not None and tasks not in TASK_SETTINGS:
        raise ValueError(f"`tasks` must be None, 'rows' or 'outputs'; got {tasks!r}.")
    if not isinstance(rep_grad, bool):
        raise ValueError(f"`rep_grad` must be a bool; got {rep_grad!r}.")
    if not isinstance(compile_combination, bool):
        raise ValueError(f"`compile_combination` must be a bool; got {compile_combination!r}.")
    if representation is not None and not isinstance(representation, str):
        raise ValueError(f"`representation` must be None or a layer name; got {representation!r}.")
    if representation is not None and not rep_grad:
        raise ValueError(
            "`representation` names the layer for `rep_grad=True`; got "
            f"representation={representation!r} with rep_grad=False."
        )
    setting = tasks or ("rows" if num_tasks is not None else "outputs")
    if setting == "rows" and num_tasks is None:
        raise ValueError(
            "`num_tasks` is required with tasks='rows' (the number of task_id values)."
        )
    if setting == "outputs":
        _check_output_tasks(model, num_tasks, model_takes_task_id, task_passes)
    if not isinstance(model_takes_task_id, bool):
        raise ValueError(f"`model_takes_task_id` must be a bool; got {model_takes_task_id!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"`seed` must be an integer; got {seed!r}.")
    if task_passes not in TASK_PASSES:
        raise ValueError(f"`task_passes` must be one of {TASK_PASSES}; got {task_passes!r}.")
    if task_passes in TENSORFLOW_ONLY_PASSES and paths.backend_name() != "tensorflow":
        raise ValueError(
            f"`task_passes`={task_passes!r} runs each task's rows with dynamic shapes, "
            f"which only the TensorFlow backend takes (this is {paths.backend_name()!r}): "
            "use 'auto', 'factored' or 'masked'."
        )
    if measure_task_cosine not in (None, True, False):
        raise ValueError(
            f"`measure_task_cosine` must be None, True or False; got {measure_task_cosine!r}."
        )
    return setting


def _check_output_tasks(model, num_tasks, model_takes_task_id, task_passes):
    if model_takes_task_id:
        raise ValueError(
            "`model_takes_task_id=True` is for tasks='rows' (batches "
            "with a task_id); got tasks='outputs'."
        )
    if task_passes in ("gathered", "vectorized", "factored"):
        raise ValueError(
            f"`task_passes`={task_passes!r} separates the rows of each task; "
            "with tasks='outputs' every row belongs to every task "
            "(use 'auto' or 'masked')."
        )
    outputs = len(model.outputs) if model_graph.has_graph(model) else None
    if num_tasks is None:
        if outputs is None:
            raise ValueError(
                f"`num_tasks` is None and the model {model.name!r} has no graph to "
                "count its outputs: give `num_tasks` (one task per compiled output "
                "loss) with tasks='outputs'."
            )
        if outputs < 2:
            raise ValueError(
                f"`num_tasks` is None, which means one task per model output, but "
                f"the model {model.name!r} has {outputs} output: give `num_tasks` "
                "and batches {'inputs': ..., 'task_id': ...} for tasks that are "
                "rows of the batch, or a model with one output per task."
            )
        # One task per output that has a loss: counted by `compile`, which
        # creates the method's state then (an output without a loss is no task).
    elif outputs is not None and num_tasks > outputs:
        raise ValueError(
            f"`num_tasks`={num_tasks} with tasks='outputs' is one task per output "
            f"loss, but the `model` {model.name!r} has {outputs} outputs: give "
            f"num_tasks <= {outputs} (or None: one task per output with a loss)."
        )


def _method_from_arguments(method, method_options, keywords):
    """The method object from `method`, `method_options` and the deprecated per-method
    keywords (each a DeprecationWarning naming the new spelling; an error with another
    method). An option the method does not take: a ValueError naming the method and the
    options it takes."""
    if method_options is not None and not isinstance(method_options, dict):
        raise ValueError(
            f"`method_options` must be a dict of the method's arguments; got {method_options!r}."
        )
    options = dict(method_options or {})
    for arg, value in keywords.items():
        if value is None:
            continue
        owner, key = DEPRECATED_METHOD_KEYWORDS[arg]
        if method != owner:
            raise ValueError(
                f"`{arg}` is an option of method={owner!r}; got method="
                f"{method!r} (give a method's options to its object or in "
                "`method_options`)."
            )
        if key in options:
            raise ValueError(
                f"`{arg}`={value!r} and method_options[{key!r}]={options[key]!r} set the "
                f"same option of method={owner!r}: give it once, in `method_options`."
            )
        warnings.warn(
            f"MultiTaskTrainer({arg}={value!r}) is deprecated: write "
            f"method_options={{{key!r}: {value!r}}} (or pass the method object, "
            f"method={type(methods.get_method(owner)).__name__}({key}={value!r})).",
            DeprecationWarning,
            stacklevel=3,
        )
        options[key] = value
    if isinstance(method, str) and options:
        cls = type(methods.get_method(method))  # a bad name fails here, naming `method`
        accepted = [
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(
                f"`method_options` {unknown} do not apply to method={method!r} "
                f"({cls.__name__}), whose options are {accepted or 'none'}."
            )
    return methods.get_method(method, **options)


def _check_task_specific_request(request):
    if request is None or request == "none":
        return request
    if isinstance(request, str) or not isinstance(request, (list, tuple)):
        raise ValueError(
            "`task_specific_variables` must be None (the PerTaskHead layers' variables), "
            '"none" (every variable shared) or a list of the model\'s variables or their '
            f"paths; got {request!r}."
        )
    return list(request)


def _after(loss, assign, gradient):
    """Run `assign` and hand on `gradient` once `loss` is computed (TensorFlow: control
    dependencies, so the state is assigned only once the loss is known finite; JAX's
    step is a pure function of its values, in which the check comes first)."""
    if paths.backend_name() == "tensorflow":
        from tf_metaalign.trainers import multitask_tf

        return multitask_tf.after(loss, assign, gradient)
    assign()
    return list(gradient)


def _state_creation_scope(trainer):
    """Where `compile` creates the method's state: the strategy's scope on TensorFlow."""
    import contextlib

    strategy = getattr(trainer, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _output_loss_count(loss, outputs):
    """The number of output losses `compile(loss=loss)` gives a model of `outputs`
    outputs, as Keras's compiled loss builds them: one per output for a single loss,
    else one per non-None entry of the dict / list (Keras skips an output whose loss is
    None: keras-io's `[loss1, loss2, None]`); None where it cannot be told (no loss, or
    a single loss on a model without a graph)."""
    if loss is None:
        return None
    if not keras.tree.is_nested(loss):
        return outputs
    return sum(item is not None for item in keras.tree.flatten(loss))


class _Untracked:
    """A plain holder Keras does not track (the representation model shares the
    model's layers and must not be saved or counted twice)."""

    counted_tasks = False  # num_tasks=None, counted by compile
    plan = None
    task_names = None
    vectorizable = False
    factored_plan = None  # (plan, reason): MultiTaskTrainer._factored_plan
