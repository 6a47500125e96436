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
# Loss weighting (one backward pass of sum_t w_t L_t):
from tf_metaalign.algorithms.multitask.equal import EqualWeighting  # noqa: E402
from tf_metaalign.algorithms.multitask.rlw import RandomLossWeighting  # noqa: E402
from tf_metaalign.algorithms.multitask.uw import UncertaintyWeighting  # noqa: E402
from tf_metaalign.algorithms.multitask.dwa import DynamicWeightAverage  # noqa: E402
from tf_metaalign.algorithms.multitask.famo import FAMO  # noqa: E402

# Per-task gradients (T backward passes, combined on the Gram matrix):
from tf_metaalign.algorithms.multitask.gradnorm import GradNorm  # noqa: E402
from tf_metaalign.algorithms.multitask.pcgrad import PCGrad  # noqa: E402
from tf_metaalign.algorithms.multitask.gradvac import GradVac  # noqa: E402
from tf_metaalign.algorithms.multitask.mgda import MGDA  # noqa: E402
from tf_metaalign.algorithms.multitask.cagrad import CAGrad  # noqa: E402
from tf_metaalign.algorithms.multitask.imtl import IMTL  # noqa: E402
from tf_metaalign.algorithms.multitask.nash import NashMTL  # noqa: E402
from tf_metaalign.algorithms.multitask.aligned_mtl import AlignedMTL  # noqa: E402

__all__ = [
    "Combination",
    "MultiTaskMethod",
    "StateSpec",
    "TaskInputs",
    "get_method",
    "method_names",
    "random_normal",
    "random_uniform",
    "register",
    "serialize_method",
    "EqualWeighting",
    "RandomLossWeighting",
    "UncertaintyWeighting",
    "DynamicWeightAverage",
    "FAMO",
    "GradNorm",
    "PCGrad",
    "GradVac",
    "MGDA",
    "CAGrad",
    "IMTL",
    "NashMTL",
    "AlignedMTL",
]
