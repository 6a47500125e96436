"""Keras trainers: `keras.Model` wrappers whose `train_step` runs an algorithm."""

from tf_metaalign.trainers.base import Diagnostic, EveryKSteps, MetaTrainer, commit_weights
from tf_metaalign.trainers.dotprod import DotProdTrainer
from tf_metaalign.trainers.multitask import MultiTaskTrainer
from tf_metaalign.trainers.guided import (
    GuidedHyperparameters,
    GuidedTrainer,
    guided_update,
    split_guidance_batch,
)
from tf_metaalign.trainers.reptile import (
    FOMAMLTrainer,
    MultiTaskReptileTrainer,
    ReptileTrainer,
    SequentialReptileTrainer,
)

__all__ = [
    "MetaTrainer",
    "Diagnostic",
    "EveryKSteps",
    "commit_weights",
    "DotProdTrainer",
    "GuidedTrainer",
    "MultiTaskTrainer",
    "GuidedHyperparameters",
    "guided_update",
    "split_guidance_batch",
    "SequentialReptileTrainer",
    "ReptileTrainer",
    "FOMAMLTrainer",
    "MultiTaskReptileTrainer",
]

from tf_metaalign.trainers.maml import MAMLTrainer  # noqa: E402

__all__ += ["MAMLTrainer"]

from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer, PromptReptileTrainer  # noqa: E402

__all__ += ["PromptFOMAMLTrainer", "PromptReptileTrainer"]

from tf_metaalign.trainers.sam import GSAMTrainer, SAMTrainer  # noqa: E402

__all__ += ["SAMTrainer", "GSAMTrainer"]
