"""Keras trainers: `keras.Model` wrappers whose `train_step` runs an algorithm.

On Keras's JAX backend without TensorFlow installed, a trainer not yet moved to JAX is a
name that raises a clear ImportError (`tf_metaalign._exports`); `MetaTrainer.backends`
says which backends a trainer runs on.
"""

from tf_metaalign._exports import export, missing_attribute

_PACKAGE = "tf_metaalign.trainers"
_EXPORTS = {
    "tf_metaalign.trainers.base": ["Diagnostic", "EveryKSteps", "MetaTrainer", "commit_weights"],
    "tf_metaalign.trainers.dotprod": ["DotProdTrainer"],
    "tf_metaalign.trainers.multitask": ["MultiTaskTrainer"],
    "tf_metaalign.trainers.guided": [
        "GuidedHyperparameters",
        "GuidedTrainer",
        "guided_update",
        "split_guidance_batch",
    ],
    "tf_metaalign.trainers.reptile": [
        "FOMAMLTrainer",
        "MultiTaskReptileTrainer",
        "ReptileTrainer",
        "SequentialReptileTrainer",
    ],
    "tf_metaalign.trainers.maml": ["MAMLTrainer"],
    "tf_metaalign.trainers.prompt_meta": ["PromptFOMAMLTrainer", "PromptReptileTrainer"],
    "tf_metaalign.trainers.sam": ["GSAMTrainer", "SAMTrainer"],
}
for _module, _names in _EXPORTS.items():
    export(globals(), _module, _names)

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
    "MAMLTrainer",
    "PromptFOMAMLTrainer",
    "PromptReptileTrainer",
    "SAMTrainer",
    "GSAMTrainer",
]
__getattr__ = missing_attribute(globals(), _PACKAGE)
