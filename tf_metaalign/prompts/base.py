"""What every prompted backbone shares: the wrapped keras-hub backbone, the prompt's
length / mode / which weights train, its prompt variables, and the configuration that
`model.save` and `save_prompt` / `load_prompt` rely on."""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np

from tf_metaalign import _compat
from tf_metaalign.functional import TrainableSelection
from tf_metaalign.prompts import storage

MODES = ("shallow", "deep")


def check_mode(mode) -> str:
    """`mode` if it is one of `MODES`, else a ValueError naming it."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}; received mode={mode!r}.")
    return mode


def check_backbone(backbone, class_name: str):
    """`backbone` if it is a `keras_hub.models.<class_name>` (or a subclass), else a
    ValueError naming the expected class."""
    import keras_hub  # here, not at the top: importing tf_metaalign.prompts stays keras-hub free

    if not isinstance(backbone, getattr(keras_hub.models, class_name)):
        raise ValueError(
            f"`backbone` must be a keras_hub.models.{class_name} (or a subclass); "
            f"received {type(backbone).__name__}."
        )
    return backbone


class KeyValueCache:
    """keras-hub's attention cache `[B, 2, K, h, d]` with its keys and values held apart.
    keras-hub's attention layers (T5's, `CachedMultiHeadAttention` of GPT-2, Gemma's,
    Llama's) read `cache[:, 0, ...]` (keys) and `cache[:, 1, ...]` (values): they get the
    two tensors themselves (the update route then writes the new entries into them with
    `slice_update`); `ops.shape(cache)` stacks them (`__tf_tensor__`: only its static shape
    is used, so the stack is pruned from a traced step).

    Why not `ops.stack([keys, values], axis=1)`: the gradient of each of a layer's two
    reads of a stacked tensor is a StridedSliceGrad that writes a dense, mostly zero
    `[B, 2, K, h, d]` tensor element by element (Eigen's strided-slice assignment); on CPU
    these 24 reads were half of a deep prompt-only step of the small T5 (50 of ~105 ms), and
    ~7% of a deep step of a GPT-2-small-shaped decoder. Held apart, each read is the tensor,
    and its gradient is the incoming one. Any other index is a TypeError.
    """

    def __init__(self, keys, values):
        self.keys = keys
        self.values = values

    @property
    def shape(self):
        batch_size, length, heads, dim = tuple(keras.ops.shape(self.keys))
        return (batch_size, 2, length, heads, dim)

    def __tf_tensor__(self, dtype=None, name=None):
        import tensorflow as tf

        return tf.stack([self.keys, self.values], axis=1, name=name)

    def __getitem__(self, index):
        if (
            isinstance(index, tuple)
            and len(index) == 3
            and index[0] == slice(None)
            and isinstance(index[1], int)
            and index[1] in (0, 1)
            and index[2] is Ellipsis
        ):
            return self.values if index[1] else self.keys
        raise TypeError(
            f"KeyValueCache supports only the reads cache[:, 0, ...] (keys) and "
            f"cache[:, 1, ...] (values); received the index {index!r}."
        )


@functools.cache
def _functional_classes():
    return _compat.functional_model_classes()


class SubclassedModelType(type):
    """The metaclass of the prompted models: a class whose MRO never holds Keras's
    `Functional` (nor its base `Function`), whatever the classes it extends become.

    Why: `PromptedCausalLM` is a subclassed `keras_hub.models.CausalLM`, and keras-hub's
    tasks (`GPT2CausalLM`, ...) are functional subclasses of the same `CausalLM` / `Task` /
    `PipelineModel` class objects. Keras makes a functional subclass work by rewriting the
    `__bases__` of those shared classes to put `Functional` in (keras-team/keras#17270), and
    keras-hub's `PipelineModel.__init__` takes it out again on every construction, so that a
    subclassed task can be built -- which breaks every functional task already built
    (`lm(x)`: "does not have a `call()` method"; saving and loading fail). Python recomputes
    the MRO of every subclass of a class whose `__bases__` change, through the metaclass's
    `mro()`: this one drops the functional classes, so a prompted model computes the same
    whether or not a functional keras-hub task exists, and `PromptedBackbone.__init__` can
    leave the shared classes as it found them (`kept_class_hierarchy`).
    """

    def mro(cls):
        functional = _functional_classes()
        return [c for c in super().mro() if c not in functional]


@contextlib.contextmanager
def kept_class_hierarchy(cls):
    """Within the block, the `__bases__` of the classes `cls` extends may change (keras-hub's
    `PipelineModel.__init__` resets its own); on exit each is given back what it had, so
    building `cls` leaves every other model whose class shares them as it was."""
    saved = [(c, c.__bases__) for c in type.mro(cls) if c is not object]
    try:
        yield
    finally:
        for c, bases in saved:
            if c.__bases__ != bases:
                c.__bases__ = bases


class PromptedBackbone(TrainableSelection, keras.Model, metaclass=SubclassedModelType):
    """Base of `PromptedT5`, `PromptedBert` and `PromptedCausalLM`. A subclass sets
    `ARCHITECTURE` (the name a prompt file is checked against), checks its backbone type
    and mode (`check_backbone`, `check_mode`), creates `self.prompt_variables` (with
    `_add_prompt_variable`) and then calls `self._select_trainable()`.

    Building or training one leaves the user's models as they were: their classes'
    hierarchy (see `SubclassedModelType`), and the backbone's `trainable` flags: the backbone
    is shared, and `train` selects this model's trainable set itself (`TrainableSelection`):
    "prompt" leaves the backbone out of it, "transformer" the prompt (whose variables are this
    model's own: their `trainable` flag says whether `train` includes them, and you may set it
    False to freeze one). `model.trainable = False` freezes this model (nothing trains) and
    does not reach the backbone.
    """

    ARCHITECTURE = None

    def __init__(
        self,
        backbone,
        length=20,
        mode="shallow",
        train="prompt",
        init_vocabulary_rows=5000,
        seed=0,
        **kwargs,
    ):
        with kept_class_hierarchy(type(self)):  # keras-hub's PipelineModel resets it
            super().__init__(**kwargs)
        self.backbone = backbone
        self.length = storage.check_length(length)
        self.mode = mode
        self.train = storage.check_train(train)
        self.init_vocabulary_rows = init_vocabulary_rows
        self.seed = seed
        self.prompt_variables = []

    def _shallow_prompt(self, name="prompt_embeddings"):
        """L vectors initialised from random rows among the first `init_vocabulary_rows`
        rows of the backbone's token embedding (Wu et al.; Lester et al. 2021)."""
        initial = storage.vocabulary_rows_init(
            self.backbone.token_embedding.embeddings.numpy(),
            self.length,
            self.init_vocabulary_rows,
            self.seed,
        )
        return self._add_prompt_variable(name, initial)

    def _add_prompt_variable(self, name, initial):
        """A variable of this model holding `initial` (a NumPy array), in the backbone's
        variable dtype."""
        initial = np.asarray(initial)
        return self.add_weight(
            shape=initial.shape,
            initializer=keras.initializers.Constant(initial),
            dtype=self.backbone.dtype_policy.variable_dtype,
            name=name,
        )

    def _select_trainable(self):
        storage.apply_train(self.train, self.prompt_variables, self.trainable)
        self.built = True

    def set_train(self, train):
        """Re-select which weights train ("prompt", "transformer" or "both"); as after
        changing a layer's `trainable`, compile again before `fit`."""
        self.train = storage.check_train(train)
        storage.apply_train(self.train, self.prompt_variables, self.trainable)

    def __call__(self, *args, **kwargs):
        if self.train == "prompt":
            self._check_outer_model(kwargs.get("training"))
        return super().__call__(*args, **kwargs)

    def _check_outer_model(self, training):
        """A model around this one, called in training (its `fit`), whose trainable set
        holds the backbone that `train="prompt"` freezes: a ValueError naming the fix (Keras
        collects a model's trainable variables by their own flags, which stay the user's).
        Checked once per outer model."""
        outer, context_training = _compat.outermost_call()
        in_training = any(
            isinstance(t, (bool, np.bool_)) and bool(t) for t in (training, context_training)
        )
        if outer is None or outer is self or not in_training:
            return
        checked = self.__dict__.setdefault("_checked_outer_models", set())
        if id(outer) in checked:
            return
        backbone = {id(v) for v in self.backbone.variables}
        trained = [v for v in outer.trainable_variables if id(v) in backbone]
        if trained:
            raise ValueError(
                f"{type(outer).__name__} {outer.name!r} is being trained around the prompted "
                f"model {self.name!r} (train='prompt'), and its trainable_variables hold "
                f"{len(trained)} variables of the backbone, which train='prompt' keeps "
                "frozen: Keras collects a model's trainable variables by each variable's own "
                "`trainable` flag, and prompting leaves the backbone's flags as you set them. "
                f"Add `prompts.TrainableSelection` before keras.Model in the bases of "
                f"{type(outer).__name__} (its trainable set then honours the prompted "
                "model's `train`; for a functional model: `class Model(prompts."
                "TrainableSelection, keras.Model): pass`, then `Model(inputs, outputs)`), or "
                "use train='both' to fine-tune the backbone too."
            )
        checked.add(id(outer))

    def _selected_ids(self) -> set:
        ids = super()._selected_ids()  # the prompt by its flags, the backbone by its own
        if self.train == "prompt":
            ids -= {id(v) for v in self.backbone.variables}
        elif self.train == "transformer":
            ids -= {id(v) for v in self.prompt_variables}
        return ids

    @property
    def trainable(self):
        return self._trainable

    @trainable.setter
    def trainable(self, value):
        """Keras's setter (this model's flag, its variables', its sublayers'), except that
        the shared backbone keeps its own: freezing a prompted model never freezes your LM."""
        self._trainable = bool(value)
        train = getattr(self, "train", "both")
        storage.apply_train(train, getattr(self, "prompt_variables", []), self._trainable)
        backbone = getattr(self, "backbone", None)
        for sublayer in _compat.own_variables_and_sublayers(self)[1]:
            if sublayer is not backbone:
                sublayer.trainable = value

    def prompt_metadata(self):
        return {
            "architecture": self.ARCHITECTURE,
            "mode": self.mode,
            "length": self.length,
            "shapes": {v.name: list(v.shape) for v in self.prompt_variables},
        }

    def get_config(self):
        return {
            "name": self.name,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "length": self.length,
            "mode": self.mode,
            "train": self.train,
            "init_vocabulary_rows": self.init_vocabulary_rows,
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
