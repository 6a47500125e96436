"""T5/Pegasus/BERT-faithful optimizers; each rule is a pure function (`UpdateRule.update`) used
both by the Keras optimizer and by code that differentiates through an update.
See docs/optimizers.md."""

from tf_metaalign._exports import missing_attribute, unavailable

try:
    from tf_metaalign.optimizers import differentiable
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.optimizers.differentiable", ["differentiable"])
try:
    from tf_metaalign.optimizers import schedules
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.optimizers.schedules", ["schedules"])
try:
    from tf_metaalign.optimizers.adafactor import (
        Adafactor,
        AdafactorRule,
        factored_dims,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.adafactor",
        ["Adafactor", "AdafactorRule", "factored_dims"],
    )
try:
    from tf_metaalign.optimizers.adam import (
        Adam,
        AdamRule,
        AdamW,
        AdamWRule,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.adam",
        ["Adam", "AdamRule", "AdamW", "AdamWRule"],
    )
try:
    from tf_metaalign.optimizers.adam_weight_decay import (
        AdamWeightDecay,
        AdamWeightDecayRule,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.adam_weight_decay",
        ["AdamWeightDecay", "AdamWeightDecayRule"],
    )
try:
    from tf_metaalign.optimizers.base import (
        BaseOptimizer,
        OptimizerState,
        UpdateRule,
        apply_rule,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.base",
        ["BaseOptimizer", "OptimizerState", "UpdateRule", "apply_rule"],
    )
try:
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
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.differentiable",
        [
            "as_rule_optimizer",
            "check_optimizer",
            "describe_conversion",
            "forward_mode_error",
            "optimizer_classes",
            "resolve_hyperparameters",
            "supported_optimizers",
            "supports_forward_mode",
        ],
    )
try:
    from tf_metaalign.optimizers.lamb import (
        Lamb,
        LambRule,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.optimizers.lamb", ["Lamb", "LambRule"])
try:
    from tf_metaalign.optimizers.recadam import (
        RecAdam,
        RecAdamRule,
        anneal_lambda,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.recadam",
        ["RecAdam", "RecAdamRule", "anneal_lambda"],
    )
try:
    from tf_metaalign.optimizers.schedules import (
        AdafactorRelativeStep,
        BertSchedule,
        PegasusSchedule,
        T5InverseSquareRootSchedule,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.optimizers.schedules",
        ["AdafactorRelativeStep", "BertSchedule", "PegasusSchedule", "T5InverseSquareRootSchedule"],
    )
try:
    from tf_metaalign.optimizers.sgd import (
        SGD,
        SGDRule,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.optimizers.sgd", ["SGD", "SGDRule"])

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
__getattr__ = missing_attribute(globals(), "tf_metaalign.optimizers")
