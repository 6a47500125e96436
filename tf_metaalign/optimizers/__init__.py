"""T5/Pegasus/BERT-faithful optimizers; each rule is a pure function (`UpdateRule.update`) used
both by the Keras optimizer and by code that differentiates through an update.
See docs/optimizers.md."""

from tf_metaalign.optimizers import differentiable, schedules
from tf_metaalign.optimizers.adafactor import Adafactor, AdafactorRule, factored_dims
from tf_metaalign.optimizers.adam import Adam, AdamRule, AdamW, AdamWRule
from tf_metaalign.optimizers.adam_weight_decay import AdamWeightDecay, AdamWeightDecayRule
from tf_metaalign.optimizers.base import BaseOptimizer, OptimizerState, UpdateRule, apply_rule
from tf_metaalign.optimizers.differentiable import (
    as_rule_optimizer,
    check_optimizer,
    describe_conversion,
    forward_mode_error,
    optimizer_classes,
    resolve_hyperparameters,
    supported_optimizers,
    supports_forward_mode,
)
from tf_metaalign.optimizers.lamb import Lamb, LambRule
from tf_metaalign.optimizers.recadam import RecAdam, RecAdamRule, anneal_lambda
from tf_metaalign.optimizers.schedules import (
    AdafactorRelativeStep,
    BertSchedule,
    PegasusSchedule,
    T5InverseSquareRootSchedule,
)
from tf_metaalign.optimizers.sgd import SGD, SGDRule

__all__ = [
    "Adafactor",
    "AdafactorRelativeStep",
    "AdafactorRule",
    "Adam",
    "AdamRule",
    "AdamW",
    "AdamWRule",
    "AdamWeightDecay",
    "AdamWeightDecayRule",
    "BaseOptimizer",
    "BertSchedule",
    "Lamb",
    "LambRule",
    "OptimizerState",
    "PegasusSchedule",
    "RecAdam",
    "RecAdamRule",
    "SGD",
    "SGDRule",
    "T5InverseSquareRootSchedule",
    "UpdateRule",
    "anneal_lambda",
    "apply_rule",
    "as_rule_optimizer",
    "check_optimizer",
    "describe_conversion",
    "differentiable",
    "factored_dims",
    "forward_mode_error",
    "optimizer_classes",
    "resolve_hyperparameters",
    "schedules",
    "supported_optimizers",
    "supports_forward_mode",
]
