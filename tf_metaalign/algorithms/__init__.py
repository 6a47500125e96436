"""Algorithms as pure functions on (loss_fn, params, state, batches), for custom loops."""

from tf_metaalign._exports import missing_attribute, unavailable

try:
    from tf_metaalign.algorithms import dotprod
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.dotprod", ["dotprod"])
try:
    from tf_metaalign.algorithms import gradient_surgery
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.gradient_surgery", ["gradient_surgery"])
try:
    from tf_metaalign.algorithms import guided
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.guided", ["guided"])
try:
    from tf_metaalign.algorithms import reptile
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.reptile", ["reptile"])
try:
    from tf_metaalign.algorithms import gradient_sharing
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.gradient_sharing", ["gradient_sharing"])
try:
    from tf_metaalign.algorithms import maml
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.maml", ["maml"])
try:
    from tf_metaalign.algorithms import prompt_meta
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.prompt_meta", ["prompt_meta"])
try:
    from tf_metaalign.algorithms import multitask
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.multitask", ["multitask"])
try:
    from tf_metaalign.algorithms import sam
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.sam", ["sam"])
try:
    from tf_metaalign.algorithms.dotprod import (
        DotProdResult,
        auto_alpha,
        dotprod_gradient,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.dotprod",
        ["DotProdResult", "auto_alpha", "dotprod_gradient"],
    )
try:
    from tf_metaalign.algorithms.guided import (
        HypergradientResult,
        greedy_hypergradients,
        hypergradients,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.guided",
        ["HypergradientResult", "greedy_hypergradients", "hypergradients"],
    )
try:
    from tf_metaalign.algorithms.reptile import (
        InnerLoopResult,
        fomaml_gradient,
        inner_loop,
        mean_reptile_gradient,
        outer_update,
        reptile_gradient,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.reptile",
        [
            "InnerLoopResult",
            "fomaml_gradient",
            "inner_loop",
            "mean_reptile_gradient",
            "outer_update",
            "reptile_gradient",
        ],
    )
try:
    from tf_metaalign.algorithms.gradient_sharing import (
        GradientSharing,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms.gradient_sharing", ["GradientSharing"])
try:
    from tf_metaalign.algorithms.maml import (
        AdaptResult,
        MetaGradientResult,
        adapt,
        adapt_and_evaluate,
        meta_gradient,
        multi_step_loss_weights,
        StepStatistics,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.maml",
        [
            "AdaptResult",
            "MetaGradientResult",
            "adapt",
            "adapt_and_evaluate",
            "meta_gradient",
            "multi_step_loss_weights",
            "StepStatistics",
        ],
    )
try:
    from tf_metaalign.algorithms.prompt_meta import (
        PromptMetaResult,
        prompt_fomaml,
        prompt_indices,
        prompt_inner_loop,
        prompt_reptile,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.prompt_meta",
        [
            "PromptMetaResult",
            "prompt_fomaml",
            "prompt_indices",
            "prompt_inner_loop",
            "prompt_reptile",
        ],
    )
try:
    from tf_metaalign.algorithms.sam import (
        SAMResult,
        gsam_direction,
        gsam_rho,
        largest_hessian_eigenvalue,
        sam_gradient,
        sam_perturbation,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.algorithms.sam",
        [
            "SAMResult",
            "gsam_direction",
            "gsam_rho",
            "largest_hessian_eigenvalue",
            "sam_gradient",
            "sam_perturbation",
        ],
    )

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
    "multitask",
    "StepStatistics",
]
__getattr__ = missing_attribute(globals(), "tf_metaalign.algorithms")
