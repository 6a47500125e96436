"""tf_metaalign: gradient-alignment and meta-learning algorithms for Keras 3 on TensorFlow.

Layers (each a subpackage or module):
  functional   -- a Keras model evaluated at *given* weights, and gradient-list algebra.
  forward_mode -- forward-mode tangents of pure TF functions (the optimizer rules).
  algorithms   -- the algorithms as pure functions usable from a custom training loop.
  optimizers   -- T5/Pegasus/BERT-faithful optimizers, each rule a pure function.
  trainers     -- keras.Model wrappers whose train_step runs an algorithm (compile + fit).
  callbacks    -- Keras callbacks (multi-task diagnostics).
  data         -- offline dataset loaders.
  prompts      -- soft prompts for keras-hub T5/BERT, templates, rank classification, ARG.
  plotting     -- learned-hyperparameter schedule plots (matplotlib, imported lazily).
"""
__version__ = "0.1.0"

from tf_metaalign import (  # noqa: E402
    algorithms,
    callbacks,
    data,
    forward_mode,
    functional,
    optimizers,
    prompts,
    trainers,
)

__all__ = [
    "algorithms", "callbacks", "data", "forward_mode", "functional", "optimizers", "prompts", "trainers", "__version__",
]
