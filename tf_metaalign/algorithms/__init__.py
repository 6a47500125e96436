"""Algorithms as pure functions on (loss_fn, params, state, batches), for custom loops."""

from tf_metaalign._exports import export, missing_attribute

_PACKAGE = "tf_metaalign.algorithms"
# Modules exported as modules (`algorithms.sam`), then names from modules.
_MODULES = [
    "dotprod",
    "gradient_surgery",
    "guided",
    "reptile",
    "gradient_sharing",
    "maml",
    "prompt_meta",
    "multitask",
    "sam",
]
_EXPORTS = {
    "tf_metaalign.algorithms.dotprod": ["DotProdResult", "auto_alpha", "dotprod_gradient"],
    "tf_metaalign.algorithms.guided": [
        "HypergradientResult",
        "greedy_hypergradients",
        "hypergradients",
    ],
    "tf_metaalign.algorithms.reptile": [
        "InnerLoopResult",
        "fomaml_gradient",
        "inner_loop",
        "mean_reptile_gradient",
        "outer_update",
        "reptile_gradient",
    ],
    "tf_metaalign.algorithms.gradient_sharing": ["GradientSharing"],
    "tf_metaalign.algorithms.maml": [
        "AdaptResult",
        "MetaGradientResult",
        "adapt",
        "adapt_and_evaluate",
        "meta_gradient",
        "multi_step_loss_weights",
        "StepStatistics",
    ],
    "tf_metaalign.algorithms.prompt_meta": [
        "PromptMetaResult",
        "prompt_fomaml",
        "prompt_indices",
        "prompt_inner_loop",
        "prompt_reptile",
    ],
    "tf_metaalign.algorithms.sam": [
        "SAMResult",
        "gsam_direction",
        "gsam_rho",
        "largest_hessian_eigenvalue",
        "sam_gradient",
        "sam_perturbation",
    ],
}
for _name in _MODULES:
    export(globals(), f"{_PACKAGE}.{_name}", as_module=_name)
for _module, _names in _EXPORTS.items():
    export(globals(), _module, _names)

__all__ = [
    "dotprod",
    "guided",
    "gradient_surgery",
    "DotProdResult",
    "auto_alpha",
    "dotprod_gradient",
    "HypergradientResult",
    "greedy_hypergradients",
    "hypergradients",
    "reptile",
    "InnerLoopResult",
    "inner_loop",
    "reptile_gradient",
    "mean_reptile_gradient",
    "fomaml_gradient",
    "outer_update",
    "gradient_sharing",
    "maml",
    "GradientSharing",
    "AdaptResult",
    "MetaGradientResult",
    "adapt",
    "adapt_and_evaluate",
    "meta_gradient",
    "multi_step_loss_weights",
    "prompt_meta",
    "PromptMetaResult",
    "prompt_fomaml",
    "prompt_indices",
    "prompt_inner_loop",
    "prompt_reptile",
    "sam",
    "SAMResult",
    "gsam_direction",
    "gsam_rho",
    "largest_hessian_eigenvalue",
    "sam_gradient",
    "sam_perturbation",
]
__getattr__ = missing_attribute(globals(), _PACKAGE)
