"""Keras trainers: `keras.Model` wrappers whose `train_step` runs an algorithm."""
from tf_metaalign.trainers.base import MetaTrainer
from tf_metaalign.trainers.dotprod import DotProdTrainer
from tf_metaalign.trainers.guided import (
    GuidedHyperparameters,
    GuidedTrainer,
    split_guidance_batch,
    supported_optimizers,
)

__all__ = [
    "MetaTrainer",
    "DotProdTrainer",
    "GuidedTrainer",
    "GuidedHyperparameters",
    "split_guidance_batch",
    "supported_optimizers",
]
