"""Algorithms as pure functions on (loss_fn, params, state, batches), for custom loops."""

from tf_metaalign.algorithms import dotprod, gradient_surgery, guided, reptile
from tf_metaalign.algorithms.dotprod import DotProdResult, auto_alpha, dotprod_gradient
from tf_metaalign.algorithms.guided import (
    HypergradientResult,
    greedy_hypergradients,
    hypergradients,
)
from tf_metaalign.algorithms.reptile import (
    InnerLoopResult,
    fomaml_gradient,
    inner_loop,
    mean_reptile_gradient,
    outer_update,
    reptile_gradient,
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
]

from tf_metaalign.algorithms import gradient_sharing, maml  # noqa: E402
from tf_metaalign.algorithms.gradient_sharing import GradientSharing  # noqa: E402
from tf_metaalign.algorithms.maml import (  # noqa: E402
    AdaptResult,
    MetaGradientResult,
    adapt,
    adapt_and_evaluate,
    meta_gradient,
    multi_step_loss_weights,
)

__all__ += [
    "gradient_sharing",
    "maml",
    "GradientSharing",
    "AdaptResult",
    "MetaGradientResult",
    "adapt",
    "adapt_and_evaluate",
    "meta_gradient",
    "multi_step_loss_weights",
]

from tf_metaalign.algorithms.maml import StepStatistics  # noqa: E402

__all__ += ["StepStatistics"]

from tf_metaalign.algorithms import prompt_meta  # noqa: E402
from tf_metaalign.algorithms.prompt_meta import (  # noqa: E402
    PromptMetaResult,
    prompt_fomaml,
    prompt_indices,
    prompt_inner_loop,
    prompt_reptile,
)

__all__ += [
    "prompt_meta",
    "PromptMetaResult",
    "prompt_fomaml",
    "prompt_indices",
    "prompt_inner_loop",
    "prompt_reptile",
]

# The multi-task method zoo (one class per method on one engine; MultiTaskTrainer's
# `method=`): PCGrad, GradVac, GradNorm, MGDA, CAGrad, IMTL, Nash-MTL, Aligned-MTL, UW,
# DWA, RLW, FAMO, equal weighting; `multitask.method_names()` lists them.
from tf_metaalign.algorithms import multitask  # noqa: E402

__all__ += ["multitask"]

# Sharpness-aware minimisation (SAM, ASAM, GSAM) and the sharpness measure lambda_max.
from tf_metaalign.algorithms import sam  # noqa: E402
from tf_metaalign.algorithms.sam import (  # noqa: E402
    SAMResult,
    gsam_direction,
    gsam_rho,
    largest_hessian_eigenvalue,
    sam_gradient,
    sam_perturbation,
)

__all__ += [
    "sam",
    "SAMResult",
    "gsam_direction",
    "gsam_rho",
    "largest_hessian_eigenvalue",
    "sam_gradient",
    "sam_perturbation",
]
