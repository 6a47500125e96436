"""Algorithms as pure functions on (loss_fn, params, state, batches), for custom loops."""
from tf_metaalign.algorithms.dotprod import DotProdResult, auto_alpha, dotprod_gradient

__all__ = ["DotProdResult", "auto_alpha", "dotprod_gradient"]
