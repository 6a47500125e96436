"""Up-front checks of task batches for the trainers that unroll a loop over the tasks of a
batch (`MAMLTrainer`, `PromptFOMAMLTrainer`, `PromptReptileTrainer`).

Those trainers need the number of tasks of a batch (per replica) when the step is traced,
so a last batch with fewer tasks cannot be trained as the others (it would be a new
program; with `tasks_per_batch` it fails inside the step). Rather than failing after an
epoch of training, `fit` / `evaluate` refuse such input before the first step, with what
to do:

* NumPy / tensor input `(support_x, support_y, query_x), query_y`: the number of tasks
  must be a multiple of `batch_size` (Keras cannot drop the remainder of arrays), and
  `batch_size` a multiple of the replica count;
* a `tf.data.Dataset`: its task dimension must be static (`batch(T,
  drop_remainder=True)`) or `tasks_per_batch` given, and a static T a multiple of the
  replica count. With `tasks_per_batch` and a dynamic T, a batch of another size stops
  the step with an error saying so (`assert_task_count`).
"""

from __future__ import annotations

import tensorflow as tf

KERAS_DEFAULT_BATCH_SIZE = 32


def _first_shape(x):
    """The shape of the first tensor (or spec) of `x` (support_x's first part), or None."""
    for t in tf.nest.flatten(x):
        shape = getattr(t, "shape", None)
        if shape is not None:
            return tf.TensorShape(shape)
    return None


def _replicas(trainer):
    return trainer.distribute_strategy.num_replicas_in_sync


def check_task_input(trainer, x, batch_size=None, where="fit"):
    """Refuse task-batch input that cannot be processed as the trainer needs (see the
    module doc). `x`: what `fit` / `evaluate` take as `x` (a Dataset, or the arrays
    `(support_x, support_y, query_x)`); anything else is left to Keras."""
    name = type(trainer).__name__
    replicas = _replicas(trainer)
    tasks_per_batch = getattr(trainer, "tasks_per_batch", None)
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if isinstance(spec, (tuple, list)) and spec:
            spec = spec[0]  # ((support_x, support_y, query_x), query_y[, weights])
        shape = _first_shape(spec)
        if shape is None or shape.rank is None or shape.rank == 0:
            return
        tasks = shape[0]
        if tasks is None:
            if tasks_per_batch is None:
                raise ValueError(
                    f"{name}.{where}: the dataset's batches have no static number of tasks "
                    f"(support_x {shape}), and {name} unrolls its loop over the tasks of a "
                    "batch: batch the tasks with `dataset.batch(T, drop_remainder=True)` "
                    "(a smaller last batch cannot be trained), or give "
                    "`tasks_per_batch=T` (then every batch must have exactly T tasks)."
                )
            tasks = tasks_per_batch
        elif tasks_per_batch is not None and tasks != tasks_per_batch:
            raise ValueError(
                f"{name}.{where}: the dataset's batches have {tasks} tasks, but "
                f"tasks_per_batch={tasks_per_batch}."
            )
        if tasks % replicas:
            raise ValueError(
                f"{name}.{where}: {tasks} tasks per batch do not split evenly among the "
                f"{replicas} replicas (each replica unrolls the same number of tasks): use "
                f"a number of tasks per batch that is a multiple of {replicas}."
            )
        return
    if not (isinstance(x, (tuple, list)) and len(x) == 3):
        return
    shape = _first_shape(x[0])
    if shape is None or shape.rank is None or shape.rank == 0 or shape[0] is None:
        return
    n = int(shape[0])
    size = KERAS_DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)
    if n % size:
        full = n - n % size
        raise ValueError(
            f"{name}.{where}: {n} tasks given as arrays with batch_size={size} leave a last "
            f"batch of {n % size} task(s), and {name} unrolls its loop over a static "
            f"number of tasks per batch (arrays are batched without drop_remainder): give "
            f"a number of tasks that is a multiple of batch_size (e.g. the first {full}), "
            "another batch_size, or a tf.data.Dataset batched with drop_remainder=True."
        )
    if tasks_per_batch is not None and size != tasks_per_batch:
        raise ValueError(
            f"{name}.{where}: batch_size={size} tasks per batch, but "
            f"tasks_per_batch={tasks_per_batch}."
        )
    if size % replicas:
        raise ValueError(
            f"{name}.{where}: batch_size={size} tasks per batch do not split evenly among "
            f"the {replicas} replicas (each replica unrolls the same number of tasks): use "
            f"a batch_size that is a multiple of {replicas}."
        )


def check_fit_input(trainer, args, kwargs, validation=True):
    """`check_task_input` on `fit`'s x and (with `validation`: a trainer whose evaluation
    takes task batches too) its validation_data, bound like `keras.Model.fit`."""
    import inspect

    import keras

    bound = inspect.signature(keras.Model.fit).bind(trainer, *args, **kwargs).arguments
    check_task_input(trainer, bound.get("x"), bound.get("batch_size"), "fit")
    if not validation:
        return
    validation = bound.get("validation_data")
    if isinstance(validation, tf.data.Dataset):
        check_task_input(trainer, validation, None, "fit (validation_data)")
    elif isinstance(validation, (tuple, list)) and validation:
        size = bound.get("validation_batch_size") or bound.get("batch_size")
        check_task_input(trainer, validation[0], size, "fit (validation_data)")


def check_evaluate_input(trainer, args, kwargs):
    """`check_task_input` on `evaluate`'s x."""
    import inspect

    import keras

    bound = inspect.signature(keras.Model.evaluate).bind(trainer, *args, **kwargs).arguments
    check_task_input(trainer, bound.get("x"), bound.get("batch_size"), "evaluate")


TASK_COUNT_OP = "task_count_of_tasks_per_batch"


def assert_task_count(trainer, t, tasks):
    """`t` with its leading (task) dimension set to `tasks` (a python int, per replica),
    for batches whose task dimension is not static (`tasks_per_batch`): a batch of
    another size fails in this op, which `explain_task_count_error` names."""
    return tf.ensure_shape(t, [tasks] + [None] * (t.shape.rank - 1), name=TASK_COUNT_OP)


class explain_task_count_error:
    """Around `fit` / `evaluate`: a batch that failed `assert_task_count` is reported as
    what it is (a ValueError saying what to do), not as a shape error of an op."""

    def __init__(self, trainer):
        self.name = type(trainer).__name__
        self.tasks_per_batch = getattr(trainer, "tasks_per_batch", None)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, tf.errors.InvalidArgumentError) and TASK_COUNT_OP in str(error):
            raise ValueError(
                f"{self.name}: a batch does not have the tasks_per_batch={self.tasks_per_batch} "
                "tasks every batch must have (typically the last, smaller batch of a dataset "
                "batched without drop_remainder=True; the steps before it were trained): "
                "batch the tasks with drop_remainder=True."
            ) from error
        return False
