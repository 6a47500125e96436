"""tf_metaalign: gradient-alignment and meta-learning algorithms for Keras 3 on TensorFlow.

Layers (each a subpackage or module):
  functional   -- a Keras model evaluated at *given* weights, and gradient-list algebra.
  algorithms   -- the algorithms as pure functions usable from a custom training loop.
  optimizers   -- T5/Pegasus/BERT-faithful optimizers, each rule a pure function.
  trainers     -- keras.Model wrappers whose train_step runs an algorithm (compile + fit).
  data         -- offline dataset loaders.
  plotting     -- learned-hyperparameter schedule plots (matplotlib, imported lazily).
"""
__version__ = "0.1.0"

from tf_metaalign import algorithms, data, functional, optimizers, trainers  # noqa: E402

__all__ = ["algorithms", "data", "functional", "optimizers", "trainers", "__version__"]
