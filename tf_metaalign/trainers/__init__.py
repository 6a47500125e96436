"""Keras trainers: `keras.Model` wrappers whose `train_step` runs an algorithm."""
from tf_metaalign.trainers.base import MetaTrainer
from tf_metaalign.trainers.dotprod import DotProdTrainer

__all__ = ["MetaTrainer", "DotProdTrainer"]
