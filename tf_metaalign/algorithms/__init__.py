"""Algorithms as pure functions on (loss_fn, params, state, batches), for custom loops."""
from tf_metaalign.algorithms import dotprod, gradient_surgery, guided
from tf_metaalign.algorithms.dotprod import DotProdResult, auto_alpha, dotprod_gradient
from tf_metaalign.algorithms.guided import (
    HypergradientResult,
    greedy_hypergradients,
    hypergradients,
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
]
