"""Keras trainers: `keras.Model` wrappers whose `train_step` runs an algorithm.

On Keras's JAX backend without TensorFlow installed, a trainer not yet moved to JAX is a
name that raises a clear ImportError (`tf_metaalign._exports`); `MetaTrainer.backends`
says which backends a trainer runs on."""

from tf_metaalign._exports import missing_attribute, unavailable

try:
    from tf_metaalign.trainers.base import (
        Diagnostic,
        EveryKSteps,
        MetaTrainer,
        commit_weights,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.trainers.base",
        ["Diagnostic", "EveryKSteps", "MetaTrainer", "commit_weights"],
    )
try:
    from tf_metaalign.trainers.dotprod import (
        DotProdTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.trainers.dotprod", ["DotProdTrainer"])
try:
    from tf_metaalign.trainers.multitask import (
        MultiTaskTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.trainers.multitask", ["MultiTaskTrainer"])
try:
    from tf_metaalign.trainers.guided import (
        GuidedHyperparameters,
        GuidedTrainer,
        guided_update,
        split_guidance_batch,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.trainers.guided",
        ["GuidedHyperparameters", "GuidedTrainer", "guided_update", "split_guidance_batch"],
    )
try:
    from tf_metaalign.trainers.reptile import (
        FOMAMLTrainer,
        MultiTaskReptileTrainer,
        ReptileTrainer,
        SequentialReptileTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.trainers.reptile",
        ["FOMAMLTrainer", "MultiTaskReptileTrainer", "ReptileTrainer", "SequentialReptileTrainer"],
    )
try:
    from tf_metaalign.trainers.maml import (
        MAMLTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.trainers.maml", ["MAMLTrainer"])
try:
    from tf_metaalign.trainers.prompt_meta import (
        PromptFOMAMLTrainer,
        PromptReptileTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(
        globals(),
        _error,
        "tf_metaalign.trainers.prompt_meta",
        ["PromptFOMAMLTrainer", "PromptReptileTrainer"],
    )
try:
    from tf_metaalign.trainers.sam import (
        GSAMTrainer,
        SAMTrainer,
    )
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.trainers.sam", ["GSAMTrainer", "SAMTrainer"])

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
__getattr__ = missing_attribute(globals(), "tf_metaalign.trainers")
