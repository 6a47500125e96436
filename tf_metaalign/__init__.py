"""tf_metaalign: gradient-alignment and meta-learning algorithms for Keras 3 on TensorFlow.

Layers (each a subpackage):
  functional   -- a Keras model evaluated at *given* weights, and gradient-list algebra.
  algorithms   -- the algorithms as pure functions usable from a custom training loop.
  optimizers   -- T5/Pegasus/BERT-faithful optimizers, each rule a pure function.
  trainers     -- keras.Model wrappers whose train_step runs an algorithm (compile + fit).
  data         -- offline dataset loaders and multi-task sampling.
"""
__version__ = "0.1.0"
