"""Multi-task methods on one per-task-gradient engine (`base`): each method is one
small class in its own module, registered by name; `get_method("pcgrad")` or
`method=PCGrad()` in `MultiTaskTrainer`. A new method is one file plus one line below."""
from tf_metaalign.algorithms.multitask.base import (
    Combination,
    MultiTaskMethod,
    StateSpec,
    TaskInputs,
    get_method,
    method_names,
    random_normal,
    random_uniform,
    register,
    serialize_method,
)

# The registry: one line per method (registration order = the docs' order).
from tf_metaalign.algorithms.multitask.equal import EqualWeighting  # noqa: E402
from tf_metaalign.algorithms.multitask.pcgrad import PCGrad  # noqa: E402
from tf_metaalign.algorithms.multitask.gradvac import GradVac  # noqa: E402
from tf_metaalign.algorithms.multitask.gradnorm import GradNorm  # noqa: E402

__all__ = [
    "Combination", "MultiTaskMethod", "StateSpec", "TaskInputs", "get_method",
    "method_names", "random_normal", "random_uniform", "register", "serialize_method",
    "EqualWeighting", "PCGrad", "GradVac", "GradNorm",
]
