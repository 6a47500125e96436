"""`MultiTaskTrainer`: multi-task learning on mixed batches with gradient surgery."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tf_metaalign.data import multitask as multitask_data
from tf_metaalign import _compat
from tf_metaalign import model_graph
from tf_metaalign import functional as F
from tf_metaalign.algorithms import gradient_surgery as GS
from tf_metaalign.algorithms import multitask as methods
from tf_metaalign.trainers.base import MetaTrainer, with_epoch_counter

#: How the per-task losses and gradients are computed (see `MultiTaskTrainer`).
TASK_PASSES = ("auto", "factored", "vectorized", "gathered", "masked")
#: What a task is (see `MultiTaskTrainer`): rows of the batch (`task_id`) or model outputs.
TASK_SETTINGS = ("rows", "outputs")


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

    The old keyword shortcuts `gradvac_beta`, `gradnorm_alpha`, `gradnorm_learning_rate`,
    `gradnorm_variable` still set those methods' options (an error with any other method).

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
            raise ValueError(
                f"`representation` must be None or a layer name; got {representation!r}."
            )
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
        if not isinstance(model_takes_task_id, bool):
            raise ValueError(f"`model_takes_task_id` must be a bool; got {model_takes_task_id!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an integer; got {seed!r}.")
        if task_passes not in TASK_PASSES:
            raise ValueError(f"`task_passes` must be one of {TASK_PASSES}; got {task_passes!r}.")
        if measure_task_cosine not in (None, True, False):
            raise ValueError(
                f"`measure_task_cosine` must be None, True or False; got {measure_task_cosine!r}."
            )
        if method_options is not None and not isinstance(method_options, dict):
            raise ValueError(
                f"`method_options` must be a dict of the method's arguments; got "
                f"{method_options!r}."
            )
        options = dict(method_options or {})
        shortcuts = {
            "gradvac_beta": ("gradvac", "beta", gradvac_beta),
            "gradnorm_alpha": ("gradnorm", "alpha", gradnorm_alpha),
            "gradnorm_learning_rate": ("gradnorm", "learning_rate", gradnorm_learning_rate),
            "gradnorm_variable": ("gradnorm", "variable", gradnorm_variable),
        }
        for arg, (owner, key, value) in shortcuts.items():
            if value is None:
                continue
            if method != owner:
                raise ValueError(
                    f"`{arg}` is an option of method={owner!r}; got method="
                    f"{method!r} (give a method's options to its object or in "
                    "`method_options`)."
                )
            options[key] = value
        self.method_object = methods.get_method(method, **options)
        self._task_specific_request = _check_task_specific_request(task_specific_variables)
        super().__init__(model, **kwargs)
        self.task_passes = task_passes
        self.num_tasks = num_tasks
        self.tasks = setting
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
                        lambda shape, dtype=None: tf.fill(shape, F.scalar(v, dtype or "float32"))
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
            self.epochs_done = self.add_state_variable("epochs_done", dtype="int64")

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
            with self.distribute_strategy.scope(), _compat.unlocked_state(self):
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
            if isinstance(layer, multitask_data.PerTaskHead) and (
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
        return multitask_data.model_inputs_of(x, self.model_takes_task_id)

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
        if not multitask_data.is_task_batch_x(x):
            raise ValueError(
                "MultiTaskTrainer: a training batch's x must be a dict {'inputs': <model "
                "inputs>, 'task_id': int [B]}; got "
                + (f"a dict with keys {sorted(x)}" if isinstance(x, dict) else type(x).__name__)
                + " (for a model with one output per task, "
                "compiled with a loss per output, use tasks='outputs' or num_tasks=None)."
            )
        task_id = x["task_id"]
        if not task_id.dtype.is_integer or task_id.shape.rank != 1:
            raise ValueError(
                "MultiTaskTrainer: x['task_id'] must be an integer vector [B] (the task of "
                f"each example); got dtype {task_id.dtype.name}, shape {task_id.shape}."
            )
        if not self.model.built:
            self.model(self.model_inputs(x), training=False)
            self._check_num_tasks_against_heads()  # a subclassed model's, built now
        return x, y, sample_weight

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
                if isinstance(layer, multitask_data.PerTaskHead):
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

    def _needs_task_gradients(self):
        if self.measure_task_cosine is not None:
            return self.method_object.uses_gradients or self.measure_task_cosine
        return self.method_object.uses_gradients

    # -------------------------------------------------------------------- step

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        T = self.num_tasks
        loss_scale = self.loss_scale()
        params, state = F.current_params(self.model), F.current_state(self.model)
        acc = F.accumulation_dtype(params)
        compiled = self._compiled_loss()

        if self.tasks == "outputs":
            # Every example carries every task: task t's loss is output t's compiled loss
            # (times its loss weight), in Keras's per-replica units; summed over the
            # replicas it is the global batch's loss, as fit's.
            model_x = x
            present = tf.ones([T], acc)

            def task_losses_of(y_pred):
                return self._output_task_losses(model_x, y, y_pred, sample_weight, compiled, acc)
        else:
            model_x = x if self.model_takes_task_id else x["inputs"]
            task_id = tf.cast(x["task_id"], tf.int32)
            # A task_id >= T would be no task's row (silently left out by the masks) or
            # out of range of a [T] gather: every use of task_id waits for the check.
            checks = [
                tf.debugging.assert_non_negative(
                    task_id, message="MultiTaskTrainer: a task_id is negative"
                ),
                tf.debugging.assert_less(
                    task_id, T, message=f"MultiTaskTrainer: a task_id is >= num_tasks={T}"
                ),
            ]
            with tf.control_dependencies([c for c in checks if c is not None]):
                task_id = tf.identity(task_id)
            masks = [tf.cast(tf.equal(task_id, t), acc) for t in range(T)]
            local_batch = tf.cast(F.batch_size(task_id), acc)
            counts = F.all_reduce_sum(tf.stack([tf.reduce_sum(m) for m in masks]))
            replicas = tf.cast(F.num_replicas(), acc)
            # loss_t (per replica, Keras units) * B_local * R / n_t, summed over replicas,
            # is the task's mean loss over the global batch.
            factors = tf.math.divide_no_nan(local_batch * replicas, counts)
            present = tf.cast(counts > 0, acc)

            def task_losses_of(y_pred):
                return [
                    self._masked_task_loss(
                        model_x, y, y_pred, sample_weight, masks[t], factors[t], compiled, acc
                    )
                    for t in range(T)
                ]

        shared_index, specific_index = self._variable_split()
        variables = self.model.trainable_variables
        step = tf.convert_to_tensor(self.steps.count.value)
        epoch = (
            tf.convert_to_tensor(self.epochs_done.value)
            if self.epochs_done is not None
            else tf.constant(0, tf.int64)
        )
        method_state = {k: tf.convert_to_tensor(v.value) for k, v in self.method_state.items()}

        def task_inputs(
            losses, task_grads=None, gram=None, shared_variables=None, variable_gram=None
        ):
            # task_grads: stacked by variable ([T, ...] per variable) when gram is None,
            # else task_grads[t][v] (rep_grad's representation gradients).
            shared_grads = None
            if task_grads is not None and gram is None:
                stacked = [task_grads[i] for i in shared_index]
                gram = GS.stacked_gram_matrix(stacked) if shared_index else tf.zeros([T, T], acc)
                # task t's list of gradients (graph pruning drops the slices unless a
                # method reads them: GradNorm's layer norms)
                per_variable = [tf.unstack(g, num=T) for g in stacked]
                shared_grads = [[g[t] for g in per_variable] for t in range(T)]
            elif task_grads is not None:
                shared_grads = task_grads
            if shared_variables is None:
                shared_variables = [variables[i] for i in shared_index]
            return methods.TaskInputs(
                losses=losses,
                present=present,
                step=step,
                epoch=epoch,
                seed=self.seed,
                gram=gram,
                task_grads=shared_grads,
                shared_variables=shared_variables,
                variable_gram=variable_gram,
            )

        regularizer = None
        if self.rep_grad:
            # Task gradients at the shared representation z (LibMTL rep_grad=True): T
            # backward passes through the heads, the method on the Gram matrix of
            # r_t = sum over the batch of dL_t/dz, ONE backward pass of
            # sum_t c_t dL_t/dz through the encoder.
            (losses, _, combination, cosine, gradient, new_state, y_pred, regularizer) = (
                self._rep_grad_step(
                    params,
                    state,
                    model_x,
                    y,
                    task_losses_of,
                    loss_scale,
                    acc,
                    task_inputs,
                    method_state,
                    task_id if self.tasks == "rows" else None,
                )
            )
            cosine_weight = tf.cast(tf.reduce_sum(present) >= 2, tf.float32)
            shared_c, _ = _coefficients(combination, acc)
        elif self._needs_task_gradients() and self._task_passes_used() == "factored":
            # Dense layers' per-task gradients never formed: their Gram matrix and the
            # combination from the layers' inputs and output gradients (one backward pass).
            (losses, combination, cosine, gradient, new_state, y_pred, regularizer) = (
                self._factored_step(
                    params,
                    state,
                    model_x,
                    y,
                    task_losses_of,
                    task_id,
                    loss_scale,
                    acc,
                    task_inputs,
                    method_state,
                )
            )
            cosine_weight = tf.cast(tf.reduce_sum(present) >= 2, tf.float32)
            shared_c, _ = _coefficients(combination, acc)
        elif self._needs_task_gradients():
            passes = self._task_passes_used()
            if passes in ("vectorized", "gathered"):
                task_passes_fn = (
                    self._vectorized_task_passes
                    if passes == "vectorized"
                    else self._gathered_task_passes
                )
                task_losses, stacked, new_state, y_pred = task_passes_fn(
                    params,
                    state,
                    model_x,
                    y,
                    sample_weight,
                    task_id,
                    counts,
                    replicas,
                    loss_scale,
                    compiled,
                    acc,
                )
                reg_grads = None
            else:
                task_losses, task_grads, new_state, y_pred, regularizer, reg_grads = (
                    self._masked_task_passes(
                        params, state, model_x, y, task_losses_of, loss_scale, acc
                    )
                )
                stacked = [tf.stack([g[v] for g in task_grads]) for v in range(len(params))]
            # Global per-task losses and gradients (stacked by variable: [T, ...]),
            # identical on every replica.
            losses, stacked = F.all_reduce_sum((tf.stack(task_losses), stacked))
            inputs = task_inputs(losses, stacked)
            combination, cosine = self._combine(inputs, method_state)
            cosine_weight = tf.cast(tf.reduce_sum(present) >= 2, tf.float32)
            shared_c, specific_c = _coefficients(combination, acc)
            specific_positions = set(specific_index)
            combined = []
            for v in range(len(variables)):
                c = specific_c if v in specific_positions else shared_c
                combined.append(GS.stacked_combine([stacked[v]], c)[0])
            gradient = [g * tf.cast(loss_scale, g.dtype) for g in F.replica_share(combined)]
            if reg_grads is not None:
                gradient = F.add(gradient, reg_grads)
        else:
            # A loss-weighting method: the weights come from the losses alone, so ONE
            # backward pass of sum_t w_t L_t (the cost of plain fit for "sum").
            (gradient, losses, combination, new_state, y_pred, regularizer) = (
                self._weighted_loss_pass(
                    params,
                    state,
                    model_x,
                    y,
                    task_losses_of,
                    loss_scale,
                    acc,
                    task_inputs,
                    method_state,
                )
            )
            cosine = None  # no task gradients: not measured, not logged
            shared_c, _ = _coefficients(combination, acc)

        # The reported loss weighs each task as the method weighs its loss: the loss
        # weights it names, else its task-specific coefficients (1 for the gradient
        # methods, the weights of a weighting method).
        loss_weights = next(
            tf.cast(w, acc)
            for w in (combination.loss_weights, combination.specific, shared_c)
            if w is not None
        )
        total = tf.reduce_sum(loss_weights * losses)
        if regularizer is not None:
            total = total + tf.cast(F.all_reduce_sum(regularizer), acc)
        loss = F.scale_loss_for_distribution(tf.cast(total, tf.float32))
        # The state is assigned only once the loss is known finite (finish_step checks
        # it again before the model's variables are touched).
        loss = self.check_finite_loss(loss)
        with tf.control_dependencies([loss]):
            for key, value in combination.state.items():
                variable = self.method_state[key]
                variable.assign(tf.cast(value, variable.dtype))
            # (None: a variable no loss reaches, left to the optimizer as fit leaves it)
            gradient = [None if g is None else tf.identity(g) for g in gradient]
        diagnostics = {} if cosine is None else {"task_cosine": (cosine, cosine_weight)}
        if not self._trainable_method_state:
            return self.finish_step(
                data,
                y_pred,
                loss,
                new_state=new_state,
                gradients=gradient,
                diagnostics=diagnostics,
                where="the multi-task loss",
            )
        # Trainable method state (UW's log-variances): trained by the compiled optimizer
        # beside the model, with its global gradient shared out like the model's.
        keys = list(self._trainable_method_state)
        extra_vars = [self._trainable_method_state[k] for k in keys]
        extra = F.replica_share(
            [
                tf.cast(combination.state_gradients[k], v.dtype) * tf.cast(loss_scale, v.dtype)
                for k, v in zip(keys, extra_vars)
            ]
        )
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
            y_pred,
            loss,
            new_state=new_state,
            update=update,
            diagnostics=diagnostics,
            where="the multi-task loss",
        )

    def _combine(self, inputs, method_state):
        """The method's combination and the task cosine, from the T x T quantities.

        A gradient method's combination is hundreds of tiny ops on T x T matrices (T^2
        projections, a min-norm or Newton solver, an eigen-decomposition), whose
        per-op dispatch costs 0.3-2.9 ms a step on a CPU at T = 8: with
        `compile_combination=True` (the default) they run as ONE XLA-compiled function
        (0.2-0.3 ms) for the methods whose `compiles_well` is True (not CAGrad, whose
        face enumeration is slower under XLA on CPU, nor GradNorm, which reads the task
        gradients themselves). No collective sits inside (the inputs are already all-reduced), so
        it runs the same in a replica context and under an XLA-compiled step."""
        method = self.method_object
        args = (
            inputs.losses,
            inputs.present,
            inputs.step,
            inputs.epoch,
            inputs.gram,
            dict(method_state),
        )
        parts = None
        if self.compile_combination and method.compiles_well:
            parts = _compiled_combination(method, inputs.seed, args)
        if parts is None:
            # Not compiled, or a method that reads the trainer's other inputs (task
            # gradients, variables) inside: a function of this trace (kept by XLA's cache).
            def run(losses, present, step, epoch, gram, state):
                fields = dataclasses.replace(
                    inputs, losses=losses, present=present, step=step, epoch=epoch, gram=gram
                )
                return _combination_parts(method, fields, state)

            if self.compile_combination and method.compiles_well:
                parts = tf.function(run, jit_compile=True)(*args)
            else:
                parts = run(*args)
        parts, cosine = parts
        shared, specific, loss_weights, state, state_gradients = parts
        return methods.Combination(
            shared=shared,
            specific=specific,
            loss_weights=loss_weights,
            state=state,
            state_gradients=state_gradients,
        ), cosine

    def _weighted_loss_pass(
        self, params, state, model_x, y, task_losses_of, loss_scale, acc, task_inputs, method_state
    ):
        """One forward and ONE backward pass of sum_t w_t L_t (w from the method).

        Its gradient goes to the optimizer as the tape returns it, as Keras's own TF
        trainer hands fit's: an Embedding's gradient stays IndexedSlices (Keras's
        optimizers apply it slice by slice: a token repeated in the batch adds the sum of
        its slices' squares to Adam's, RMSprop's or Adagrad's second moment, where the
        densified gradient would add the square of their sum) and a variable no loss
        reaches gets None (the optimizer skips it: no slot decay, no weight decay).
        "sum" is then plain multi-output fit to the bit (tested with repeated tokens).
        """
        with tf.GradientTape() as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, model_x, training=True
            )
            local = tf.stack(task_losses_of(y_pred))
            losses = F.all_reduce_sum(tf.stop_gradient(local))
            combination = self.method_object.combine(task_inputs(losses), method_state)
            weights = tf.stop_gradient(tf.cast(combination.shared, acc))
            total = tf.reduce_sum(weights * local) * tf.cast(loss_scale, acc)
            regularizer = self._regularizer(model_x, y, y_pred, model_losses)
            if regularizer is not None:
                total = total + tf.cast(regularizer, acc) * tf.cast(loss_scale, acc)
        gradient = tape.gradient(total, params)
        return gradient, losses, combination, new_state, y_pred, regularizer

    def _masked_task_loss(self, model_x, y, y_pred, sample_weight, mask, factor, compiled, acc):
        """Task loss from the whole batch's outputs: the compiled loss with the task's
        rows as sample weights, rescaled to the task's mean (see the class doc)."""
        weight = (
            mask
            if sample_weight is None
            else (mask * tf.cast(tf.reshape(sample_weight, [-1]), acc))
        )
        value = F.compute_loss(
            self.model,
            model_x,
            y,
            y_pred,
            tf.cast(weight, _loss_weight_dtype(y)),
            [],
            training=True,
            loss=compiled,
        )
        return tf.cast(value, acc) * factor

    def _output_task_losses(self, model_x, y, y_pred, sample_weight, compiled, acc):
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
                self.model, model_x, y, y_pred, sample_weight, [], training=True, loss=compiled
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
            value = keras.ops.cast(value, compile_loss.dtype)
            if weight is not None:
                value = keras.ops.multiply(value, weight)
            losses.append(tf.cast(value, acc))
        return losses

    @property
    def task_names(self):
        """The tasks' names: the output names with tasks='outputs' (known once the
        compiled loss is built: after the first step), else 'task_<t>'."""
        if self.tasks == "outputs" and self._cache.task_names:
            return list(self._cache.task_names)
        return [f"task_{t}" for t in range(self.num_tasks)]

    def _regularizer(self, model_x, y, y_pred, model_losses):
        """The model's own losses (regularisers, add_loss) as `fit` adds them (through
        the model's `compute_loss`), without the compiled loss; None if it has none."""
        if not model_losses:
            return None
        return F.compute_loss(
            self.model,
            model_x,
            y,
            y_pred,
            None,
            model_losses,
            training=True,
            loss=_no_compiled_loss,
        )

    def fit(self, *args, **kwargs):
        if self.epochs_done is not None:
            # first among the callbacks: BackupAndRestore saves the epoch's new count
            args, kwargs = with_epoch_counter(args, kwargs, self.epochs_done)
        return super().fit(*args, **kwargs)

    def _masked_task_passes(self, params, state, model_x, y, task_losses_of, loss_scale, acc):
        """One forward pass over the batch, T masked backward passes (static shapes)."""
        T = self.num_tasks
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, model_x, training=True
            )
            task_losses = task_losses_of(y_pred)
            scaled = [v * tf.cast(loss_scale, acc) for v in task_losses]
            regularizer = self._regularizer(model_x, y, y_pred, model_losses)
            if regularizer is not None:
                regularizer_scaled = regularizer * tf.cast(loss_scale, regularizer.dtype)
        inv_scale = 1.0 / tf.cast(loss_scale, acc)
        task_grads = []
        for t in range(T):
            g = F.dense_gradient(tape, scaled[t], params)
            task_grads.append([gi * tf.cast(inv_scale, gi.dtype) for gi in g])
        reg_grads = None
        if regularizer is not None:
            reg_grads = F.dense_gradient(tape, regularizer_scaled, params)
        del tape
        return task_losses, task_grads, new_state, y_pred, regularizer, reg_grads

    # ------------------------------------------------------ representation gradients

    def _rep_plan(self):
        """The representation-gradient plan (cached): a functional model of the same
        graph that also returns the representation z, the positions of the encoder
        variables (those z depends on) and of the head variables (the rest, which must
        be task-specific) in `model.trainable_variables`, and the state mapping."""
        plan = self._cache.plan
        if plan is not None:
            return plan
        model = self.model
        if not model_graph.has_graph(model):
            raise ValueError(
                f"`rep_grad=True` needs a functional model (its graph says where the shared "
                f"representation is); the model {model.name!r} is a "
                f"{type(model).__name__} without one."
            )
        if self.representation is not None:
            rep = model_graph.layer_output(model, self.representation)
        elif self.tasks == "rows":
            rep = model_graph.layer_input(model, multitask_data.PerTaskHead)
            if rep is None:
                raise ValueError(
                    "`rep_grad=True` with tasks='rows': the model has no (single) PerTaskHead "
                    "layer whose input would be the shared representation; give "
                    "`representation=<layer name>`."
                )
        else:
            rep = model_graph.shared_representation(model)
        variables = model.trainable_variables
        position = {id(v): i for i, v in enumerate(variables)}
        encoder = [position[id(v)] for v in model_graph.upstream_variables(model, rep)]
        shared, specific = self._variable_split()
        heads = [i for i in range(len(variables)) if i not in set(encoder)]
        not_specific = [variables[i].path for i in heads if i not in set(specific)]
        if not_specific:
            raise ValueError(
                f"`rep_grad=True`: the variables {not_specific} are shared by the tasks but "
                f"lie after the representation {rep.name!r} (the output of the last shared "
                "layer): name a later layer with `representation=`, or list the variables "
                "in `task_specific_variables` if each belongs to one task."
            )
        in_encoder = [variables[i].path for i in encoder if i in set(specific)]
        if in_encoder:
            raise ValueError(
                f"`rep_grad=True`: the task-specific variables {in_encoder} feed the "
                f"representation {rep.name!r}; the representation must come after every "
                "shared variable and before every task's own."
            )
        tap = keras.Model(model.input, list(model.outputs) + [rep], name=f"{model.name}_rep")
        tap_params = [position[id(v)] for v in tap.trainable_variables]
        state_position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        tap_state = [state_position[id(v)] for v in tap.non_trainable_variables]
        if len(tap_state) != len(model.non_trainable_variables):
            raise ValueError("`rep_grad=True`: the model has state outside its graph.")
        plan = _RepPlan(tap, tap_params, tap_state, encoder, heads, rep)
        # Tasks as rows: dL_t/dz is nonzero on task t's rows only, so ONE backward pass of
        # sum_t L_t through the heads gives every task's rows at once -- unless a layer
        # after z mixes the rows of the batch (BatchNorm: a layer with state, seeds aside).
        upstream = {
            id(v)
            for layer in _compat.flatten_layers(model)
            for v in layer.non_trainable_variables
            if set(map(id, layer.trainable_variables)) & {id(variables[i]) for i in encoder}
        }
        seeds = _seed_states(model)
        plan.heads_mix_rows = any(
            id(v) not in upstream and id(v) not in seeds for v in model.non_trainable_variables
        )
        self._cache.plan = plan
        return plan

    def _rep_grad_step(
        self,
        params,
        state,
        model_x,
        y,
        task_losses_of,
        loss_scale,
        acc,
        task_inputs,
        method_state,
        task_id=None,
    ):
        T = self.num_tasks
        plan = self._rep_plan()
        model = self.model
        scale = tf.cast(loss_scale, acc)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(params)
            outputs, tap_state, model_losses = F.stateless_forward(
                plan.tap,
                [params[i] for i in plan.tap_params],
                [state[i] for i in plan.tap_state],
                model_x,
                training=True,
            )
            z = outputs[-1]
            y_pred = tf.nest.pack_sequence_as(model.output, outputs[:-1])
            task_losses = task_losses_of(y_pred)
            scaled = [v * scale for v in task_losses]
            regularizer = self._regularizer(model_x, y, y_pred, model_losses)
            if regularizer is not None:
                regularizer_scaled = regularizer * tf.cast(loss_scale, regularizer.dtype)
        new_state = list(state)
        for j, i in enumerate(plan.tap_state):
            new_state[i] = tap_state[j]
        head_params = [params[i] for i in plan.heads]
        rows_disjoint = task_id is not None and not plan.heads_mix_rows
        if rows_disjoint:
            # ONE backward pass through the heads: row r of d(sum_t L_t)/dz is
            # dL_task(r)/dz_r (the other tasks' losses weigh row r by 0).
            # (A list of targets: the gradient of their sum, on the recorded losses.)
            rep_rows = (
                tf.cast(
                    tape.gradient(scaled, z, unconnected_gradients=tf.UnconnectedGradients.ZERO),
                    acc,
                )
                / scale
            )
            flat_rows = tf.reshape(rep_rows, [tf.shape(rep_rows)[0], -1])
            vectors = tf.math.unsorted_segment_sum(flat_rows, task_id, T)
        else:
            rep_grads, head_grads = [], []
            for t in range(T):
                # Through the heads only (the encoder's part of this graph is never used).
                g = F.dense_gradient(tape, scaled[t], [z] + head_params)
                rep_grads.append(tf.cast(g[0], acc) / scale)
                head_grads.append([gi / tf.cast(scale, gi.dtype) for gi in g[1:]])
            # LibMTL: the representation gradient of each task summed over the batch.
            vectors = tf.stack([tf.reshape(tf.reduce_sum(r, axis=0), [-1]) for r in rep_grads])
        losses, vectors = F.all_reduce_sum((tf.stack(task_losses), vectors))
        gram = tf.matmul(vectors, vectors, transpose_b=True)
        inputs = task_inputs(
            losses,
            [[vectors[t]] for t in range(T)],
            gram=gram,
            shared_variables=[_Representation(plan.rep)],
        )
        combination, cosine = self._combine(inputs, method_state)
        shared_c, specific_c = _coefficients(combination, acc)
        # ONE backward pass through the encoder of sum_t c_t dL_t/dz (c held fixed): the
        # encoder's gradient sum_t c_t J^T dL_t/dz. Per replica: the optimizer's
        # cross-replica sum of these local parts is the global gradient.
        if rows_disjoint:
            row_c = tf.reshape(
                tf.gather(shared_c, task_id),
                tf.concat([[-1], tf.ones([tf.rank(rep_rows) - 1], tf.int32)], 0),
            )
            combined_rep = rep_rows * row_c * scale
        else:
            combined_rep = tf.add_n([shared_c[t] * rep_grads[t] for t in range(T)]) * scale
        encoder_params = [params[i] for i in plan.encoder]
        encoder_grads = F.dense_gradient(
            tape, z, encoder_params, output_gradients=tf.cast(combined_rep, z.dtype)
        )
        gradient = [None] * len(params)
        for i, g in zip(plan.encoder, encoder_grads):
            gradient[i] = g
        if rows_disjoint and plan.heads:
            # The heads' sum_t s_t g_t: one more backward pass through the heads only.
            head_gradient = F.dense_gradient(
                tape,
                scaled,
                head_params,
                output_gradients=[tf.cast(specific_c[t], v.dtype) for t, v in enumerate(scaled)],
            )
            for i, g in zip(plan.heads, head_gradient):
                gradient[i] = g
        for k, i in enumerate(plan.heads if not rows_disjoint else []):
            gradient[i] = GS.combine([[h[k]] for h in head_grads], specific_c)[0] * tf.cast(
                scale, head_grads[0][k].dtype
            )
        if regularizer is not None:
            gradient = F.add(gradient, F.dense_gradient(tape, regularizer_scaled, params))
        del tape
        return (losses, vectors, combination, cosine, gradient, new_state, y_pred, regularizer)

    def _task_passes_used(self):
        """The per-task pass a gradient step takes: "vectorized", "gathered" or "masked"
        (what `task_passes` asks for, "auto" resolved; see the class doc)."""
        if self.tasks == "outputs":
            return "masked"
        if self.task_passes != "auto":
            return self.task_passes
        if self._factored_plan(explain=False) is not None:
            return "factored"
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

    def _factored_plan(self, explain=True):
        """The plain Dense layers whose kernels and biases are ALL the shared variables,
        in `model.trainable_variables` positions: [(layer, kernel index, bias index or
        None)], when the "factored" pass applies; else None (`explain=False`) or a
        ValueError saying why (`explain=True`, for task_passes="factored")."""
        if self._cache.factored_plan is None:
            self._cache.factored_plan = self._find_factored_plan()
        plan, reason = self._cache.factored_plan
        if plan is None and explain:
            raise ValueError(
                f"MultiTaskTrainer(task_passes='factored'): {reason} (use 'auto', which "
                "falls back to 'vectorized', 'gathered' or 'masked')."
            )
        return plan

    def _find_factored_plan(self):
        if self.tasks != "rows":
            return None, "it is for tasks='rows' (every row belongs to one task)"
        if self.method_object.reads_task_gradients:
            return None, (
                f"method {self.method_object.name!r} reads the task gradients themselves, "
                "which this pass never forms"
            )
        seeds = _seed_states(self.model)
        other = [v.path for v in self.model.non_trainable_variables if id(v) not in seeds]
        if other:
            return None, (
                f"the model has state other than dropout's seeds ({other[:3]}, e.g. "
                "BatchNorm statistics, which mix the rows of the batch)"
            )
        shared_index, _ = self._variable_split()
        variables = self.model.trainable_variables
        position = {id(v): i for i, v in enumerate(variables)}
        shared = {id(variables[i]) for i in shared_index}
        plan, covered = [], set()
        for layer in _compat.flatten_layers(self.model):
            if not _compat.is_plain_dense(layer) or id(layer.kernel) not in shared:
                continue
            bias = layer.bias
            if bias is not None and id(bias) not in shared:
                return None, f"Dense layer {layer.name!r}'s kernel is shared but its bias is not"
            if _compat.dense_input_rank(layer) != 2:
                return None, (
                    f"Dense layer {layer.name!r} is not called once on [batch, features] "
                    "inputs in the model's graph"
                )
            plan.append(
                (layer, position[id(layer.kernel)], None if bias is None else position[id(bias)])
            )
            covered |= {id(layer.kernel)} | (set() if bias is None else {id(bias)})
        left = [v.path for v in variables if id(v) in shared and id(v) not in covered]
        if left:
            return None, (
                "every shared variable must be the kernel or bias of a plain Dense layer on "
                f"[batch, features] inputs; these are not: {left[:4]}"
                f"{' ...' if len(left) > 4 else ''}"
            )
        return plan, None

    def _factored_step(
        self,
        params,
        state,
        model_x,
        y,
        task_losses_of,
        task_id,
        loss_scale,
        acc,
        task_inputs,
        method_state,
    ):
        """The gradient methods with no per-task gradient formed (task_passes="factored").

        Every shared variable is a Dense layer's kernel or bias (`_factored_plan`). One
        forward pass over the batch records each such layer's inputs X and pre-activation
        outputs z; ONE backward pass of sum_t L_t gives dZ = dL/dz, whose row r is its
        own task's dL_t/dz_r (the rows do not interact: no state but dropout seeds).
        Then per layer (`gradient_surgery.dense_task_gram` / `dense_combined_gradient`):
        the Gram matrix S^T ((X X^T + 1) * (dZ dZ^T)) S over the GLOBAL batch (X, dZ
        and the task one-hots all-gathered from the replicas: the inner products of
        summed per-replica gradients have cross-replica terms), and the combination
        sum_t c_t g_t = X^T (c_task(r) * dZ) from the replica's own rows (the optimizer
        sums the replicas' parts). Task-specific variables: the gradient of sum_t s_t L_t,
        a backward pass through the heads only. Losses, dropout masks and gradients are
        those of "masked" (tested equal).
        """
        plan = self._factored_plan()
        shared_index, specific_index = self._variable_split()
        T = self.num_tasks
        scale = tf.cast(loss_scale, acc)
        layers = [layer for layer, _, _ in plan]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(params)
            with _compat.recorded_dense_pre_activations(layers) as records:
                y_pred, new_state, model_losses = F.stateless_forward(
                    self.model, params, state, model_x, training=True
                )
            task_losses = task_losses_of(y_pred)
            stacked_losses = tf.stack(task_losses)
            total = tf.reduce_sum(stacked_losses) * scale
            regularizer = self._regularizer(model_x, y, y_pred, model_losses)
            if regularizer is not None:
                regularizer_scaled = regularizer * tf.cast(loss_scale, regularizer.dtype)
        calls = {layers[i].name: len(records.get(i, ())) for i in range(len(layers))}
        if any(n != 1 for n in calls.values()):
            raise ValueError(
                "MultiTaskTrainer(task_passes='factored'): each shared Dense layer must be "
                f"called once per forward pass; calls: {calls} (use task_passes='vectorized')."
            )
        xs = [records[i][0][0] for i in range(len(layers))]
        zs = [records[i][0][1] for i in range(len(layers))]
        dzs = tape.gradient(total, zs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        dzs = [tf.cast(dz, acc) / scale for dz in dzs]
        xs = [tf.cast(x, acc) for x in xs]
        onehot = tf.one_hot(task_id, T, dtype=acc)
        # (zero padding rows of a replica with fewer rows add nothing: their one-hot is 0)
        gathered = F.all_gather_rows((xs, dzs, onehot))
        gram = tf.add_n(
            [
                GS.dense_task_gram(x, dz, gathered[2], has_bias=bias is not None)
                for x, dz, (_, _, bias) in zip(gathered[0], gathered[1], plan)
            ]
        )
        losses = F.all_reduce_sum(stacked_losses)
        # One shared variable's Gram matrix (GradNorm's layer norms): the kernel's alone,
        # or the bias's (S^T (dZ dZ^T) S: zero-width inputs).
        owner = {}
        for k, (_, kernel_i, bias_i) in enumerate(plan):
            owner[kernel_i], owner[bias_i] = (k, "kernel"), (k, "bias")

        def variable_gram(v):
            k, part = owner[shared_index[v]]
            x = gathered[0][k]
            if part == "bias":
                x = tf.zeros([tf.shape(x)[0], 0], x.dtype)
            return GS.dense_task_gram(x, gathered[1][k], gathered[2], has_bias=part == "bias")

        inputs = task_inputs(losses, gram=gram, variable_gram=variable_gram)
        combination, cosine = self._combine(inputs, method_state)
        shared_c, specific_c = _coefficients(combination, acc)
        row_c = tf.gather(shared_c, task_id) * scale
        gradient = [None] * len(params)
        for x, dz, (_, kernel_i, bias_i) in zip(xs, dzs, plan):
            parts = GS.dense_combined_gradient(x, dz, row_c, has_bias=bias_i is not None)
            for i, g in zip((kernel_i, bias_i), parts):
                gradient[i] = tf.cast(g, params[i].dtype)
        if specific_index:
            specific = F.dense_gradient(
                tape,
                stacked_losses,
                [params[i] for i in specific_index],
                output_gradients=specific_c * scale,
            )
            for i, g in zip(specific_index, specific):
                gradient[i] = g
        if regularizer is not None:
            gradient = F.add(gradient, F.dense_gradient(tape, regularizer_scaled, params))
        del tape
        return losses, combination, cosine, gradient, new_state, y_pred, regularizer

    def _check_vectorizable(self):
        """The vectorized pass runs every task's forward pass from the step's state: it
        refuses state other than dropout's seeds (BatchNorm statistics would need the T
        updates threaded, as "gathered" does)."""
        if self._cache.vectorizable:
            return
        seeds = _seed_states(self.model)
        other = [v.path for v in self.model.non_trainable_variables if id(v) not in seeds]
        if other:
            raise ValueError(
                "MultiTaskTrainer(task_passes='vectorized') runs the T tasks' forward "
                "passes side by side from the step's state, so it takes no model state "
                f"other than dropout's seeds; the model has {other[:4]}"
                f"{' ...' if len(other) > 4 else ''} (e.g. BatchNorm statistics): use "
                "task_passes='gathered' (which threads the state through the tasks in "
                "order) or 'auto'."
            )
        self._cache.vectorizable = True

    def _vectorized_task_passes(
        self,
        params,
        state,
        model_x,
        y,
        sample_weight,
        task_id,
        counts,
        replicas,
        loss_scale,
        compiled,
        acc,
    ):
        """Task t's loss and gradient over its own rows, the T tasks in ONE
        `tf.vectorized_map` pass over a [T, m, ...] batch.

        The rows are laid out task-major and padded: row (t, j) is task t's j-th row of
        this replica's batch, m the largest task count here (at least 1), padding rows
        are a zero row with weight 0. Each task's forward and backward pass over its m
        rows is then one batched computation (a [T, m, D] x [D, W] matmul, [T, D, m] x
        [T, m, W] weight gradients): the FLOPs of one pass over T*m rows (= the batch
        when tasks are balanced), not T passes' worth of launches. The task loss is the
        gathered path's: (Keras's mean over the m rows) * m * R / n_t. Model state:
        every task's forward starts from the step's state and the step's new state is
        task 0's (only dropout seeds are allowed, `_check_vectorizable`: the seeds
        advance once per step, and the T tasks draw the SAME masks for their j-th rows
        -- the one difference from "gathered", whose tasks draw in turn).
        """
        self._check_vectorizable()
        T = self.num_tasks
        weight_dtype = _loss_weight_dtype(y)
        rows = tf.shape(task_id)[0]
        local_counts = tf.math.bincount(task_id, minlength=T, maxlength=T)
        m = tf.maximum(tf.reduce_max(local_counts), 1)
        order = tf.argsort(task_id, stable=True)
        sorted_ids = tf.gather(task_id, order)
        position = tf.range(rows) - tf.gather(tf.cumsum(local_counts, exclusive=True), sorted_ids)
        # index[t, j] = the batch row of task t's j-th row, or `rows` (the zero row).
        index = tf.tensor_scatter_nd_update(
            tf.fill([T, m], rows), tf.stack([sorted_ids, position], axis=1), order
        )
        valid = index < rows
        padded = tf.nest.map_structure(_with_zero_row, (model_x, y, sample_weight))
        gather = lambda a: None if a is None else tf.gather(a, index)  # noqa: E731
        x_t, y_t, w_t = tf.nest.map_structure(gather, padded)
        weight = tf.cast(valid, weight_dtype)
        if sample_weight is not None:
            weight = weight * tf.cast(tf.reshape(w_t, [T, m]), weight_dtype)
        factor = tf.math.divide_no_nan(tf.cast(m, acc) * replicas, counts)

        def one_task(args):
            return self._sub_batch_pass(
                params, state, *args, loss_scale, compiled, acc, "vectorized"
            )

        values, stacked, states, preds = tf.vectorized_map(one_task, (x_t, y_t, weight, factor))
        task_losses = tf.unstack(values, num=T)
        new_state = [s[0] for s in states]
        # Predictions back in batch order (for the compiled metrics); the padding rows
        # land on row `rows`, dropped.
        flat_index = tf.reshape(index, [-1, 1])

        def unpad(p):
            p = tf.reshape(p, tf.concat([[-1], tf.shape(p)[2:]], axis=0))
            shape = tf.concat([[rows + 1], tf.shape(p)[1:]], axis=0)
            return tf.scatter_nd(flat_index, p, shape)[:rows]

        y_pred = tf.nest.map_structure(unpad, preds)
        return task_losses, list(stacked), new_state, y_pred

    def _sub_batch_pass(
        self, params, state, x, y, weight, factor, loss_scale, compiled, acc, passes
    ):
        """One task's loss (Keras's mean over the sub-batch times `factor`, the task's
        share of the global batch) and its gradient (unscaled), from a forward and a
        backward pass over its rows: (loss, gradients, new state, predictions)."""
        with tf.GradientTape() as tape:
            tape.watch(params)
            y_pred, new_state, model_losses = F.stateless_forward(
                self.model, params, state, x, training=True
            )
            if model_losses:
                raise ValueError(
                    f"MultiTaskTrainer(task_passes={passes!r}): the model has its own "
                    "losses (regularisers, add_loss), which are not task losses; use "
                    "task_passes='masked' (or 'auto', which picks it for such models)."
                )
            value = F.compute_loss(
                self.model, x, y, y_pred, weight, [], training=True, loss=compiled
            )
            value = tf.cast(value, acc) * factor
            scaled = value * tf.cast(loss_scale, acc)
        g = F.dense_gradient(tape, scaled, params)
        inv_scale = 1.0 / tf.cast(loss_scale, acc)
        return value, [gi * tf.cast(inv_scale, gi.dtype) for gi in g], new_state, y_pred

    def _gathered_task_passes(
        self,
        params,
        state,
        model_x,
        y,
        sample_weight,
        task_id,
        counts,
        replicas,
        loss_scale,
        compiled,
        acc,
    ):
        """Task t's loss and gradient from a forward and backward pass over its own rows.

        The per-replica task loss is (Keras's mean over the m gathered rows) * m * R /
        n_t = sum_{i in t, this replica} w_i l_i * R / n_t, the masked path's value. A
        task with no row on this replica runs on one dummy row with weight 0 (a Keras
        mean over zero rows is 0/0), and its state update is discarded: the batch gets one
        zero row appended for that (a replica may hold no row at all: the last, partial
        batch of an epoch under a strategy).
        """
        T = self.num_tasks
        weight_dtype = _loss_weight_dtype(y)
        pad_row = tf.cast(tf.shape(task_id)[0], tf.int64)  # the appended zero row
        padded = tf.nest.map_structure(_with_zero_row, (model_x, y, sample_weight))
        task_losses, task_grads, rows_list, preds = [], [], [], []
        for t in range(T):
            rows = tf.reshape(tf.where(tf.equal(task_id, t)), [-1])
            n_local = tf.shape(rows)[0]
            present_here = n_local > 0
            safe_rows = tf.cond(present_here, lambda: rows, lambda: tf.reshape(pad_row, [1]))
            m = tf.shape(safe_rows)[0]
            gather = lambda a: None if a is None else tf.gather(a, safe_rows)  # noqa: E731
            x_t, y_t, w_t = tf.nest.map_structure(gather, padded)
            weight = tf.cast(tf.fill([m], tf.cast(present_here, tf.float32)), weight_dtype)
            if sample_weight is not None:
                weight = weight * tf.cast(tf.reshape(w_t, [-1]), weight_dtype)
            factor = tf.math.divide_no_nan(tf.cast(m, acc) * replicas, counts[t])
            value, g, state_t, y_pred_t = self._sub_batch_pass(
                params, state, x_t, y_t, weight, factor, loss_scale, compiled, acc, "gathered"
            )
            task_grads.append(g)
            task_losses.append(value)
            state = [tf.where(present_here, new, old) for new, old in zip(state_t, state)]
            rows_list.append(tf.cast(rows, tf.int32))
            preds.append(tf.nest.map_structure(lambda p: p[:n_local], y_pred_t))
        # Predictions back in batch order (for the compiled metrics).
        y_pred = tf.nest.map_structure(
            lambda *parts: tf.dynamic_stitch(rows_list, list(parts)), *preds
        )
        stacked = [tf.stack([g[v] for g in task_grads]) for v in range(len(params))]
        return task_losses, stacked, state, y_pred

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


def _coefficients(combination, acc):
    """(shared, task-specific) coefficients of a method's Combination, in `acc`."""
    shared = tf.cast(combination.shared, acc)
    specific = shared if combination.specific is None else tf.cast(combination.specific, acc)
    return shared, specific


def _combination_parts(method, inputs, state):
    """The method's combination as a tuple (what a tf.function returns) and the cosine."""
    c = method.combine(inputs, state)
    cosine = GS.mean_pairwise_cosine(inputs.gram, inputs.present)
    parts = (c.shared, c.specific, c.loss_weights, dict(c.state), dict(c.state_gradients))
    return parts, cosine


class _ReadsTrainerInputs(Exception):
    """A method read a TaskInputs field the shared compiled combination does not have."""


class _NotGiven:
    """`task_grads`, `shared_variables` and `variable_gram` in the shared compiled
    combination (tensors and variables of one trace and one trainer, which a function
    shared by trainers cannot close over): any use raises `_ReadsTrainerInputs`."""

    def __init__(self, field):
        self.field = field

    def _read(self, *args, **kwargs):
        raise _ReadsTrainerInputs(self.field)

    __getitem__ = __iter__ = __len__ = __bool__ = __call__ = __getattr__ = _read


#: The XLA-compiled combinations, one `tf.function(jit_compile=True)` per method
#: configuration (its class, its attributes, the seed), shared by every trainer. TF's XLA
#: cache keeps each compiled cluster for the life of the process, keyed by the function's
#: name: a new function per trainer (or per trace) kept 7.7-14.7 MB per run of the
#: battery MLP; one per configuration compiles once for each input signature.
#: Least recently used first; a handful in practice.
_COMPILED_COMBINATIONS = {}
_COMPILED_COMBINATIONS_MAX = 32


def _frozen(value):
    """A hashable form of a method's attribute (its type kept: 1, 1.0 and True differ);
    TypeError if it has none."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    hash(value)
    return (type(value), value)


def _compiled_combination(method, seed, args):
    """`_combination_parts` through the method configuration's shared compiled function:
    the method's tensors all enter as arguments, the method and the seed as constants.
    None where the method cannot share one (unhashable attributes, or it reads the task
    gradients, variables or `variable_gram` inside): the caller compiles its own."""
    try:
        key = (type(method), _frozen(vars(method)), seed)
        hash(key)
    except TypeError:
        return None
    function = _COMPILED_COMBINATIONS.pop(key, False)
    if function is None:
        _COMPILED_COMBINATIONS[key] = None
        return None
    if function is False:

        def combination(losses, present, step, epoch, gram, state):
            inputs = methods.TaskInputs(
                losses=losses,
                present=present,
                step=step,
                epoch=epoch,
                seed=seed,
                gram=gram,
                task_grads=_NotGiven("task_grads"),
                shared_variables=_NotGiven("shared_variables"),
                variable_gram=_NotGiven("variable_gram"),
            )
            return _combination_parts(method, inputs, state)

        function = tf.function(combination, jit_compile=True)
    try:
        parts = function(*args)
    except _ReadsTrainerInputs:
        function, parts = None, None
    _COMPILED_COMBINATIONS[key] = function
    while len(_COMPILED_COMBINATIONS) > _COMPILED_COMBINATIONS_MAX:
        del _COMPILED_COMBINATIONS[next(iter(_COMPILED_COMBINATIONS))]
    return parts


def _seed_states(model):
    """ids of the state variables of the model's random-seed generators (dropout)."""
    return {
        id(generator.state)
        for layer in [model, *_compat.flatten_layers(model)]
        for generator in getattr(layer, "_seed_generators", None) or []
    }


def _with_zero_row(a):
    """`a` with one zero (or empty-string) row appended along the batch axis."""
    if a is None:
        return None
    a = tf.convert_to_tensor(a)
    shape = tf.concat([[1], tf.shape(a)[1:]], axis=0)
    row = tf.fill(shape, "") if a.dtype == tf.string else tf.zeros(shape, a.dtype)
    return tf.concat([a, row], axis=0)


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


def _loss_weight_dtype(y):
    """The dtype sample weights are given in: the targets' float dtype (float32 for
    integer labels)."""
    first = tf.nest.flatten(y)[0]
    return first.dtype if first.dtype.is_floating else tf.float32


def _no_compiled_loss(y_true, y_pred, sample_weight=None):
    """A compiled loss that adds nothing (Keras's compute_loss skips a None): the
    model's own losses alone."""
    return None


class _Untracked:
    """A plain holder Keras does not track (the representation model shares the
    model's layers and must not be saved or counted twice)."""

    counted_tasks = False  # num_tasks=None, counted by compile
    plan = None
    task_names = None
    vectorizable = False
    factored_plan = None  # (plan, reason): MultiTaskTrainer._factored_plan


class _RepPlan:
    def __init__(self, tap, tap_params, tap_state, encoder, heads, rep):
        self.tap, self.tap_params, self.tap_state = tap, tap_params, tap_state
        self.encoder, self.heads, self.rep = encoder, heads, rep


class _Representation:
    """Stands for the shared representation where a method expects the shared variables
    (`TaskInputs.shared_variables`: GradNorm's layer, which it picks among those of rank
    >= 2): its path and the representation tensor's shape ([batch, ...])."""

    def __init__(self, tensor):
        self.path = f"representation/{tensor.name}"
        self.name = self.path
        self.shape = tuple(tensor.shape)
