"""What every prompted backbone shares: the wrapped keras-hub backbone, the prompt's
length / mode / which weights train, its prompt variables, and the configuration that
`model.save` and `save_prompt` / `load_prompt` rely on."""

from __future__ import annotations

import keras

from tf_metaalign.prompts import storage


class PromptedBackbone(keras.Model):
    """Base of `PromptedT5` and `PromptedBert`. A subclass sets `ARCHITECTURE` (the name a
    prompt file is checked against), checks its backbone type and mode, creates
    `self.prompt_variables` and then calls `self._select_trainable()`."""

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
        return self.add_weight(
            shape=initial.shape,
            initializer=keras.initializers.Constant(initial),
            dtype=self.backbone.dtype_policy.variable_dtype,
            name=name,
        )

    def _select_trainable(self):
        storage.apply_train(self.train, self.backbone, self.prompt_variables)
        self.built = True

    def set_train(self, train):
        """Re-select which weights train ("prompt", "transformer" or "both")."""
        self.train = storage.check_train(train)
        storage.apply_train(self.train, self.backbone, self.prompt_variables)

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
