"""tf_metaalign: gradient-alignment and meta-learning algorithms for Keras 3 (TensorFlow, JAX).

What a user imports (each subpackage lists its API in `__all__`):

  trainers     -- keras.Model wrappers whose train_step runs an algorithm (compile + fit):
                  DotProdTrainer (Meta DotProd), SAMTrainer (SAM, ASAM), GSAMTrainer,
                  SequentialReptileTrainer,
                  MultiTaskTrainer (the multi-task method zoo), ReptileTrainer,
                  FOMAMLTrainer, MultiTaskReptileTrainer, MAMLTrainer (gradient sharing),
                  PromptFOMAMLTrainer, PromptReptileTrainer, GuidedTrainer.
  algorithms   -- the same algorithms as pure functions for a custom training loop:
                  dotprod_gradient, sam_gradient (SAM / ASAM / GSAM) and
                  largest_hessian_eigenvalue, reptile_gradient / fomaml_gradient / inner_loop,
                  maml.meta_gradient / adapt, GradientSharing, guided hypergradients,
                  prompt_meta, gradient_surgery (PCGrad, GradVac, GradNorm on a Gram
                  matrix) and multitask (PCGrad(), CAGrad(), NashMTL(), MGDA(), ...).
  optimizers   -- T5/Pegasus/BERT-faithful optimizers, each rule a pure function: Adafactor,
                  Adam, AdamW, AdamWeightDecay, Lamb, RecAdam, SGD and their schedules.
  prompts      -- soft prompts for keras-hub T5 / BERT, templates, rank classification, ARG.
  callbacks    -- DivergenceGuard, MultiTaskDiagnostics, MultiWorkerBackupAndRestore.
  data         -- MultiTaskStream, PerTaskHead, EpisodeSampler, stacked meta-batches, and
                  the standard loaders (Omniglot, sinusoid, digits, TFDS).
  functional   -- a Keras model evaluated at *given* weights, and gradient-list algebra.
  forward_mode -- forward-mode tangents of pure TF functions (the optimizer rules).
  plotting     -- learned-hyperparameter schedule plots (matplotlib, imported lazily).

The repository's `trainers/` (the programs, and `trainers/experiments/`: our paper
reproductions' data and models) is not part of the installed package.
"""

__version__ = "0.1.0"

from tf_metaalign._exports import missing_attribute, unavailable  # noqa: E402

# Every subpackage is imported, as before (so `import tf_metaalign` registers the classes
# `keras.saving.load_model` needs); without TensorFlow (Keras on JAX) a subpackage that
# needs it is a name that raises a clear ImportError.
from tf_metaalign import backend, functional  # noqa: E402

try:
    from tf_metaalign import algorithms
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.algorithms", ["algorithms"])
try:
    from tf_metaalign import callbacks
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.callbacks", ["callbacks"])
try:
    from tf_metaalign import data
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.data", ["data"])
try:
    from tf_metaalign import forward_mode
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.forward_mode", ["forward_mode"])
try:
    from tf_metaalign import optimizers
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.optimizers", ["optimizers"])
try:
    from tf_metaalign import prompts
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.prompts", ["prompts"])
try:
    from tf_metaalign import trainers
except ModuleNotFoundError as _error:
    unavailable(globals(), _error, "tf_metaalign.trainers", ["trainers"])

__all__ = [
    "algorithms",
    "backend",
    "callbacks",
    "data",
    "forward_mode",
    "functional",
    "optimizers",
    "prompts",
    "trainers",
    "__version__",
]
__getattr__ = missing_attribute(globals(), "tf_metaalign")
