"""Prompt-tuning FOMAML and Reptile trainers (Wu et al., EMNLP 2022; reference
allenai/better-promptability `better_promptability/models/meta_learner.py`,
`MetaLearner.forward`). The algorithm is `tf_metaalign.algorithms.prompt_meta`.

Data: `fit` takes elements `((support_x, support_y, query_x), query_y)` (optionally
`query_sample_weight` third), every tensor with a leading TASK dimension (one element = one
meta-batch of B tasks; under a strategy Keras splits the tasks among the replicas):
support_x / support_y `[B, S, N_support, ...]` with S = `inner_steps` (one support batch per
inner step, the reference Reptile config) or S = 1 (the same support batch at every inner
step, the reference FOMAML config); query_x / query_y `[B, N_query, ...]`. The number of
tasks per replica must be static: batch with `drop_remainder=True` or give
`tasks_per_batch` (global); NumPy input: a number of tasks that is a multiple of
`batch_size`, itself a multiple of the replica count. `fit` refuses input that breaks
these rules before the first step (`tf_metaalign.trainers.task_batches`) rather than
failing at the last batch. On JAX shapes are concrete: nothing is refused up front, a
smaller last meta-batch is traced as a step of its own (the mean over its own tasks), and
`tasks_per_batch` is not needed. `evaluate` / `predict` take ordinary model batches.

The compiled optimizer is the OUTER optimizer (the paper: Adafactor at 1e-3, clipping at
1.0: `default_adafactor(aggregated_clipnorm=1.0)`). Logs "loss" (the mean query loss at
the adapted prompts) and "support_loss" (the mean over tasks of the last inner step's loss).
"""

from __future__ import annotations

import keras
from keras import ops

from tf_metaalign import _compat, backend
from tf_metaalign import functional as F
from tf_metaalign import optimizers as O
from tf_metaalign.algorithms import prompt_meta as P
from tf_metaalign.algorithms import reptile as R
from tf_metaalign.trainers.base import MetaTrainer, apply_gradients, first_task_query_set

try:
    from tf_metaalign.trainers import task_batches
except ModuleNotFoundError as _error:  # its checks read tf.data / tf.TensorShape
    if (_error.name or "").split(".")[0] != "tensorflow":
        raise
    # Without TensorFlow (Keras on JAX) the up-front input checks are skipped: a smaller
    # last batch is then traced as a step of its own, with the mean over its own tasks.
    task_batches = None


def default_adafactor(learning_rate=1e-3, **kwargs):
    """The paper's optimizer: HF `transformers.Adafactor(lr=1e-3, scale_parameter=False,
    relative_step=False)` (decay -0.8, eps (1e-30, 1e-3), update clipping 1.0, no momentum,
    the last two dims of every rank >= 2 variable factored)."""
    config = dict(
        beta_1=None,
        decay_rate=0.8,
        clipping_threshold=1.0,
        factoring="last_two",
        min_dim_size_to_factor=0,
        multiply_by_parameter_scale=False,
    )
    config.update(kwargs)
    return O.Adafactor(learning_rate, **config)


def _rank(t):
    shape = getattr(t, "shape", None)
    if shape is None:
        return None
    return shape.rank if hasattr(shape, "rank") else len(shape)  # TensorShape or tuple


class _PromptMetaTrainer(MetaTrainer):
    """Shared by `PromptFOMAMLTrainer` and `PromptReptileTrainer`."""

    backends = ("tensorflow", "jax")

    _algorithm = None  # P.prompt_fomaml / P.prompt_reptile
    _state_groups = ("prompt",)

    def __init__(
        self,
        model,
        prompt_variables=None,
        inner_steps=7,
        inner_optimizer=None,
        carry_inner_state=True,
        tasks_per_batch=None,
        **kwargs,
    ):
        inner_steps = R.validate_steps("inner_steps", inner_steps)
        if not isinstance(carry_inner_state, bool):
            raise ValueError(
                f"`carry_inner_state` must be True or False; got {carry_inner_state!r}."
            )
        if tasks_per_batch is not None:
            tasks_per_batch = R.validate_steps("tasks_per_batch", tasks_per_batch)
        if isinstance(inner_optimizer, dict):  # from get_config
            inner_optimizer = keras.optimizers.deserialize(inner_optimizer)
        if inner_optimizer is None:
            inner_optimizer = default_adafactor()
        if not isinstance(inner_optimizer, O.BaseOptimizer):
            raise ValueError(
                "`inner_optimizer` must be a tf_metaalign optimizer (it steps on tensors: "
                f"apply_on_tensors) or None (the paper's Adafactor); got {inner_optimizer!r}."
            )
        # What get_config saves: the selection itself when it is data, else the positions.
        self._prompt_config = prompt_variables
        if isinstance(prompt_variables, str):
            substring = prompt_variables
            prompt_variables = lambda path: substring in path  # noqa: E731
        elif (
            isinstance(prompt_variables, (list, tuple))
            and prompt_variables
            and all(isinstance(p, str) for p in prompt_variables)
        ):
            paths = set(prompt_variables)
            prompt_variables = lambda path: path in paths  # noqa: E731
        elif (
            isinstance(prompt_variables, (list, tuple))
            and prompt_variables
            and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt_variables)
        ):
            positions = list(prompt_variables)
            prompt_variables = lambda variables: [variables[i] for i in positions]  # noqa: E731
            prompt_variables.positions = positions
        super().__init__(model, **kwargs)
        self.inner_steps = inner_steps
        self.inner_optimizer = inner_optimizer
        self.carry_inner_state = carry_inner_state
        self.tasks_per_batch = tasks_per_batch
        self._prompt_selection = prompt_variables
        self._prompt_indices = None
        self._inner_state_variables = None  # per group: (slot dicts, iterations)
        self.schedule = self.every_k_steps(1, name="outer_steps")
        self.add_diagnostic("support_loss")
        if model.built:
            self._resolve_prompt()
            self._create_weight_copies()

    @property
    def outer_steps(self):
        """Meta-batches trained on (a checkpointed int64)."""
        return self.schedule.count

    @property
    def prompt_variables(self):
        """The model's prompt variables (the inner loop's only trainable ones)."""
        variables = self.model.trainable_variables
        return P.take(variables, self._resolve_prompt())

    def _resolve_prompt(self):
        if self._prompt_indices is None:
            variables = self.model.trainable_variables
            selection = self._prompt_selection
            if hasattr(selection, "positions"):
                bad = [i for i in selection.positions if not 0 <= i < len(variables)]
                if bad:
                    raise ValueError(
                        f"`prompt_variables`: positions {bad} are not positions among the "
                        f"model's {len(variables)} trainable variables."
                    )
                selection = selection(variables)
            self._prompt_indices = P.prompt_indices(variables, selection)
        return self._prompt_indices

    def _group_variables(self, group):
        variables = self.model.trainable_variables
        indices = self._resolve_prompt()
        if group == "prompt":
            return P.take(variables, indices)
        return P.take(variables, P.complement(indices, len(variables)))

    # ------------------------------------------------------------- carried inner state

    def _create_weight_copies(self):
        super()._create_weight_copies()
        # The base class calls this from its __init__, before this class's attributes.
        if (
            not getattr(self, "carry_inner_state", False)
            or not self.model.built
            or self._inner_state_variables is not None
        ):
            return
        self._resolve_prompt()
        groups = []
        with self._strategy_scope(), _compat.unlocked_state(self):
            for group in self._state_groups:
                initial = self.inner_optimizer.initial_state(self._group_variables(group))
                slots = []
                for j, slot in enumerate(initial.slots):
                    slots.append(
                        {
                            name: self.add_weight(
                                name=f"inner_{group}_{name}_{j}",
                                shape=value.shape,
                                dtype=value.dtype,
                                initializer="zeros",
                                trainable=False,
                                aggregation="only_first_replica",
                            )
                            for name, value in slot.items()
                        }
                    )
                iterations = self.add_weight(
                    name=f"inner_{group}_iterations",
                    shape=(),
                    dtype=F.counter_dtype(),
                    initializer="zeros",
                    trainable=False,
                    aggregation="only_first_replica",
                )
                groups.append((slots, iterations))
        # Zero slots and count are what `initial_state` gives for every rule of the package
        # (checked: a rule with non-zero initial slots would need its own initializer).
        self._inner_state_variables = groups

    def _carried_states(self):
        if not self.carry_inner_state:
            return None
        if self._inner_state_variables is None:
            raise ValueError(
                f"{type(self).__name__} carries the inner optimizer's state in variables, "
                "created when the model is built: give the model Input shapes or call the "
                "trainer once on a model batch before fit()."
            )
        return tuple(
            O.OptimizerState(
                tuple({k: F.read_value(v) for k, v in s.items()} for s in slots),
                F.read_value(iterations),
            )
            for slots, iterations in self._inner_state_variables
        )

    def _assign_carried(self, states, keep_unless=True):
        """Store `states` where `keep_unless` (a boolean tensor) holds, else keep the old."""

        def pick(variable, value):
            value = ops.cast(value, variable.dtype)
            return ops.where(keep_unless, value, F.read_value(variable))

        for (slots, iterations), state in zip(self._inner_state_variables, states):
            for variables, values in zip(slots, state.slots):
                for name, variable in variables.items():
                    variable.assign(pick(variable, values[name]))
            iterations.assign(pick(iterations, state.iterations))

    # -------------------------------------------------------------------- the batch

    def _parts(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not (isinstance(x, (tuple, list)) and len(x) == 3):
            raise ValueError(
                f"{type(self).__name__}: a batch must be ((support_x, support_y, query_x), "
                "query_y[, query_sample_weight]) with a leading task dimension; got x of type "
                f"{type(x).__name__}."
            )
        if y is None:
            raise ValueError(f"{type(self).__name__}: the batch has no query_y.")
        return x[0], x[1], x[2], y, sample_weight

    def example_batch(self, x, y=None, sample_weight=None):
        # Keras builds the model, loss and metrics from a training batch: the first task's
        # query set is a model batch.
        return first_task_query_set(x, y, sample_weight)

    def _tasks(self, support_x, support_y, query_x, query_y, sample_weight):
        first = keras.tree.flatten(support_x)[0]
        if _rank(first) is not None and _rank(first) < 3:
            raise ValueError(
                f"{type(self).__name__}: `support_x` must be [B, S, N_support, ...] (tasks, "
                f"S = inner_steps or 1 support batches, examples); got shape {first.shape}."
            )
        steps = first.shape[1]
        if steps not in (1, self.inner_steps):
            raise ValueError(
                f"{type(self).__name__}(inner_steps={self.inner_steps}): `support_x` must "
                f"stack {self.inner_steps} support batches (one per inner step) or 1 (reused "
                f"at every step) on axis 1; got shape {first.shape}."
            )
        tasks = self.static_tasks_per_replica(first.shape[0])
        if first.shape[0] is None:  # tasks_per_batch: check every batch has that many
            # (TensorFlow only: a JAX step's shapes are always static)
            support_x = keras.tree.map_structure(
                lambda a: task_batches.assert_task_count(self, a, tasks), support_x
            )

        def task(nest, t, s=None):
            if nest is None:
                return None
            return keras.tree.map_structure(lambda a: a[t] if s is None else a[t, s], nest)

        out = []
        for t in range(tasks):
            support = [
                (
                    task(support_x, t, 0 if steps == 1 else s),
                    task(support_y, t, 0 if steps == 1 else s),
                )
                for s in range(self.inner_steps)
            ]
            out.append((support, (task(query_x, t), task(query_y, t), task(sample_weight, t))))
        return out

    # --------------------------------------------------------------------- the step

    def train_step(self, data):
        x, y, sample_weight = self.unpack(data)
        support_x, support_y, query_x, query_y, sample_weight = self._parts((x, y, sample_weight))
        tasks = self._tasks(support_x, support_y, query_x, query_y, sample_weight)
        if not self.optimizer.built:  # before the control-dependent block (XLA)
            self.optimizer.build(self.model.trainable_variables)
        loss_scale = self.loss_scale()
        result = type(self)._algorithm(
            self.loss_fn(loss_scale=loss_scale),
            F.current_params(self.model),
            F.current_state(self.model),
            tasks,
            self._resolve_prompt(),
            self.inner_optimizer,
            self.model.trainable_variables,
            optimizer_states=self._carried_states(),
            carry_inner_state=self.carry_inner_state,
            loss_scale=loss_scale,
        )
        n = len(tasks)
        loss = backend.add_n(result.query_losses) / n
        support_loss = F.unscale_loss_for_distribution(backend.add_n(result.support_losses) / n)

        def update():
            apply_gradients(self.optimizer, result.gradients, self.model.trainable_variables)
            if self.carry_inner_state:
                # A non-finite step (float16 overflow under a LossScaleOptimizer, which then
                # skips the outer update) must not poison the carried state for good: keep
                # the old state, as the outer optimizer keeps its own.
                finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in result.gradients]))
                self._assign_carried(result.optimizer_states, keep_unless=finite)

        flat = self._flat((query_x, query_y, sample_weight))
        y_pred = keras.tree.map_structure(lambda *t: ops.concatenate(t, 0), *result.y_pred)
        return self.finish_step(
            flat,
            y_pred,
            loss,
            new_state=result.state,
            update=update,
            diagnostics={"support_loss": support_loss},
        )

    def fit(self, *args, **kwargs):
        # A last batch with fewer tasks, or tasks that do not split among the replicas:
        # refused before the first step (the loop over tasks is unrolled).
        # (Its evaluation takes ordinary model batches: validation_data is not checked.)
        if task_batches is None:
            return super().fit(*args, **kwargs)
        task_batches.check_fit_input(self, args, kwargs, validation=False)
        with task_batches.explain_task_count_error(self):
            return super().fit(*args, **kwargs)

    @staticmethod
    def _flat(nest):
        def one(a):
            if a is None:
                return None
            shape = ops.shape(a)
            return ops.reshape(a, (-1,) + tuple(shape[2:]))

        return keras.tree.map_structure(one, nest)

    def get_config(self):
        selection = self._prompt_config
        if not (
            selection is None
            or isinstance(selection, str)
            or (
                isinstance(selection, (list, tuple))
                and all(isinstance(p, (str, int)) for p in selection)
            )
        ):
            # variables or a predicate: saved as positions among the trainable variables
            # (paths change when a model is reloaded: "sequential_3/prompt/x" -> "prompt/x").
            selection = list(self._resolve_prompt())
        return {
            **super().get_config(),
            "prompt_variables": selection,
            "inner_steps": self.inner_steps,
            "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer),
            "carry_inner_state": self.carry_inner_state,
            "tasks_per_batch": self.tasks_per_batch,
        }


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptFOMAMLTrainer(_PromptMetaTrainer):
    """Prompt-tuning FOMAML (Wu et al. 2022; `MetaLearner.forward`, algorithm "fomaml").

    Per meta-batch of B tasks, from phi (the model's variables): per task, `inner_steps`
    steps of `inner_optimizer` on the PROMPT only (on tensors, first order: off the outer
    tape), on its support batches; then the query-loss gradient of ALL variables at the
    adapted prompt (the other weights at phi). The compiled (outer) optimizer applies the
    mean over all tasks (all replicas') of these gradients.

    Args:
      model: the Keras model (`trainer.model`).
      prompt_variables: the prompt: None (trainable variables whose path contains
        "prompt"), a substring of the path, a list of paths, a list of positions among
        `model.trainable_variables`, a list of the model's variables, or a predicate on
        `variable.path` (the last two are saved as positions).
      inner_steps: T >= 1 (the paper: 7).
      inner_optimizer: a tf_metaalign optimizer stepped with `apply_on_tensors` (never
        built); None = the paper's Adafactor at 1e-3 (`default_adafactor()`).
      carry_inner_state: True (the reference's `reuse_inner_opt_state=True` default): the
        inner optimizer's state runs on across the tasks of a meta-batch and across
        meta-batches, kept in the checkpointed variables `inner_prompt_<slot>_<j>` and
        `inner_prompt_iterations`. Under R replicas each replica runs its tasks' chain
        from the stored state, and the FIRST replica's end state is kept (the reference
        keeps one chain per DDP process: not replica-count independent either). On JAX
        (`keras.distribution.DataParallel`) the step sees the global meta-batch: one chain
        over all its tasks, as one replica's (1 device == 2, tested). False: every task
        starts from a fresh inner optimizer.
      tasks_per_batch: the global number of tasks per meta-batch when the batch's task
        dimension is not static.

    Example:
      >>> from tf_metaalign.optimizers import SGD
      >>> from tf_metaalign.trainers import PromptFOMAMLTrainer
      >>> model = keras.Sequential(
      ...     [keras.Input((3,)), keras.layers.Dense(3, name="prompt"), keras.layers.Dense(1)]
      ... )  # the variables whose path holds "prompt" adapt in the inner loop
      >>> trainer = PromptFOMAMLTrainer(model, inner_steps=2, inner_optimizer=SGD(0.1))
      >>> trainer.compile(optimizer="adam", loss="mse")
      >>> rng = np.random.default_rng(0)
      >>> support_x = rng.normal(size=(4, 2, 5, 3)).astype("float32")  # 4 tasks, 2 steps of 5
      >>> query_x = rng.normal(size=(4, 5, 3)).astype("float32")
      >>> x = (support_x, support_x.sum(-1, keepdims=True), query_x)
      >>> history = trainer.fit(x, query_x.sum(-1, keepdims=True), batch_size=2, verbose=0)
      >>> sorted(history.history)
      ['loss', 'support_loss']

    References:
      Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
      EMNLP 2022.
    """

    _algorithm = staticmethod(P.prompt_fomaml)


@keras.saving.register_keras_serializable(package="tf_metaalign")
class PromptReptileTrainer(_PromptMetaTrainer):
    """Prompt-tuning Reptile, the paper's variant (`MetaLearner.forward`, "reptile").

    Per task: `inner_steps` prompt-only steps of `inner_optimizer` on the support batches,
    then one step of the same optimizer on ALL variables with the query gradient at the
    adapted prompt, giving phi_b; the compiled (outer) optimizer applies phi - mean_b phi_b
    (mean over all replicas' tasks; the reference code divides by nothing else: no 1/alpha).
    With `carry_inner_state` the prompt's inner state (`inner_prompt_*`, T + 1 updates per
    task) and the other variables' (`inner_other_*`, 1 update per task) are carried, each
    with its own count, as HF Adafactor counts steps per parameter. Arguments as
    `PromptFOMAMLTrainer`.

    Example:
      >>> from tf_metaalign.optimizers import SGD
      >>> from tf_metaalign.trainers import PromptReptileTrainer
      >>> model = keras.Sequential(
      ...     [keras.Input((3,)), keras.layers.Dense(3, name="prompt"), keras.layers.Dense(1)]
      ... )
      >>> trainer = PromptReptileTrainer(model, inner_steps=2, inner_optimizer=SGD(0.1))
      >>> trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
      >>> rng = np.random.default_rng(0)
      >>> support_x = rng.normal(size=(4, 2, 5, 3)).astype("float32")
      >>> query_x = rng.normal(size=(4, 5, 3)).astype("float32")
      >>> x = (support_x, support_x.sum(-1, keepdims=True), query_x)
      >>> history = trainer.fit(x, query_x.sum(-1, keepdims=True), batch_size=2, verbose=0)
      >>> sorted(history.history)
      ['loss', 'support_loss']

    References:
      Wu et al., "Continued Pretraining for Better Zero- and Few-Shot Promptability",
      EMNLP 2022.
    """

    _algorithm = staticmethod(P.prompt_reptile)
    _state_groups = ("prompt", "other")
