"""T5/Pegasus/BERT-faithful optimizers; each rule a pure function used by Keras and by
differentiable code. See docs/optimizers.md."""
from tf_metaalign.optimizers.base import BaseOptimizer, UpdateRule
from tf_metaalign.optimizers.sgd import SGD, SGDRule
from tf_metaalign.optimizers.adam import Adam, AdamRule

__all__ = ["BaseOptimizer", "UpdateRule", "SGD", "SGDRule", "Adam", "AdamRule"]
