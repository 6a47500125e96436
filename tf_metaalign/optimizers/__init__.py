"""T5/Pegasus/BERT-faithful optimizers; each rule is a pure function (`UpdateRule.update`) used
both by the Keras optimizer and by code that differentiates through an update.
See docs/optimizers.md."""

from tf_metaalign._exports import export, missing_attribute

_PACKAGE = "tf_metaalign.optimizers"
_MODULES = ["differentiable", "schedules"]
_EXPORTS = {
    "tf_metaalign.optimizers.adafactor": ["Adafactor", "AdafactorRule", "factored_dims"],
    "tf_metaalign.optimizers.adam": ["Adam", "AdamRule", "AdamW", "AdamWRule"],
    "tf_metaalign.optimizers.adam_weight_decay": ["AdamWeightDecay", "AdamWeightDecayRule"],
    "tf_metaalign.optimizers.base": ["BaseOptimizer", "OptimizerState", "UpdateRule", "apply_rule"],
    "tf_metaalign.optimizers.differentiable": [
        "as_rule_optimizer",
        "check_optimizer",
        "describe_conversion",
        "forward_mode_error",
        "optimizer_classes",
        "resolve_hyperparameters",
        "supported_optimizers",
        "supports_forward_mode",
    ],
    "tf_metaalign.optimizers.lamb": ["Lamb", "LambRule"],
    "tf_metaalign.optimizers.recadam": ["RecAdam", "RecAdamRule", "anneal_lambda"],
    "tf_metaalign.optimizers.schedules": [
        "AdafactorRelativeStep",
        "BertSchedule",
        "PegasusSchedule",
        "T5InverseSquareRootSchedule",
    ],
    "tf_metaalign.optimizers.sgd": ["SGD", "SGDRule"],
}
for _name in _MODULES:
    export(globals(), f"{_PACKAGE}.{_name}", as_module=_name)
for _module, _names in _EXPORTS.items():
    export(globals(), _module, _names)

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
__getattr__ = missing_attribute(globals(), _PACKAGE)
