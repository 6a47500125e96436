"""Writes the prompt files of format 1 that tests/prompts/test_prompt_format.py loads: files
written by tf_metaalign as it was at commit 1ac9f45 (before Gemma's shallow prompt stopped
being scaled by sqrt(hidden_dim) and Gemma's prefix keys moved to Hugging Face's layout),
by that code itself, and what that code's models computed.

How: the script extracts the `tf_metaalign` package at COMMIT (`git archive`) into a
temporary directory and runs itself again in a subprocess with that directory first on
PYTHONPATH, so every `tf_metaalign` module it imports -- `prompts.causal_lm`, `prompts.base`,
`prompts.storage` -- is the old one (it checks where the package came from). For each case
(CASES: Gemma shallow / deep, plain / reparameterised; Llama shallow and GPT-2 deep, whose
conventions did not change) it builds a tiny PromptedCausalLM, perturbs its prompt variables
(a "trained" prompt), and writes

* `<case>.keras` (`model.save`; its members then re-zipped deflated, unchanged: Keras stores
  them uncompressed, 90 KB a file instead of 9), `<case>.npz` (`prompts.save_prompt`),
* `expected.npz`: a right-padded batch and, per case, the old model's logits on it,
* `cases.json` (the constructor arguments) and `versions.json`.

A `.keras` file's `model.weights.h5` member IS the file `model.save_weights` writes (the same
groups and arrays: the script checks it), so the tests take the old weights-only file
(`save_weights`, `BackupAndRestore`) from there.

Run from the repository root (~15 s; ~80 KB, deterministic up to HDF5's timestamps):

    python tests/prompts/legacy_fixtures/make_legacy_fixtures.py
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

COMMIT = "1ac9f45"
HERE = os.path.dirname(os.path.abspath(__file__))
VOCABULARY = 32
LENGTH = 3
CASES = {
    "gemma_shallow": {"family": "gemma", "mode": "shallow"},
    "gemma_shallow_mlp": {"family": "gemma", "mode": "shallow", "reparameterize": True},
    "gemma_deep": {"family": "gemma", "mode": "deep"},
    "gemma_deep_mlp": {"family": "gemma", "mode": "deep", "reparameterize": True},
    "llama_shallow": {"family": "llama", "mode": "shallow"},
    "gpt2_deep": {"family": "gpt2", "mode": "deep"},
}


def tiny_backbone(family):
    """The tests' tiny backbone of `family` (tests/tiny_backbones.py), seeded 0."""
    import keras

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/
    from tiny_backbones import tiny_backbone as build

    keras.utils.set_random_seed(0)
    return build(family, vocabulary_size=VOCABULARY)


def model_arguments(case):
    """The PromptedCausalLM arguments of `case` (besides the backbone)."""
    spec = CASES[case]
    return {
        "length": LENGTH,
        "mode": spec["mode"],
        "init": "random",
        "reparameterize": spec.get("reparameterize", False),
        "seed": 1,
    }


def batch():
    rng = np.random.default_rng(1)
    return {
        "token_ids": rng.integers(2, VOCABULARY, (2, 5)).astype("int32"),
        "padding_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], "int32"),
    }


def _deflate(path):
    """Re-zip the `.keras` file at `path` with its members deflated (Keras: stored)."""
    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for info, data in members:
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)


def _h5_arrays(data):
    """{path: array bytes} of every dataset in the HDF5 file `data` (bytes)."""
    import h5py

    found = {}
    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(
            lambda name, item: (
                found.__setitem__(name, np.asarray(item).tobytes())
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    return found


def _write():
    """In the subprocess: tf_metaalign is COMMIT's."""
    import keras
    import keras_hub
    import tensorflow as tf

    import tf_metaalign
    from tf_metaalign import prompts

    root = os.environ["LEGACY_TREE"]
    assert os.path.abspath(tf_metaalign.__file__).startswith(root), tf_metaalign.__file__
    backbones = {}
    x = batch()
    expected = dict(x)
    rng = np.random.default_rng(2)
    for case, spec in CASES.items():
        family = spec["family"]
        if family not in backbones:
            backbones[family] = tiny_backbone(family)
        model = prompts.PromptedCausalLM(backbones[family], name=case, **model_arguments(case))
        for variable in model.prompt_variables:  # a trained prompt: not the initial values
            noise = rng.standard_normal(tuple(variable.shape)).astype("float32")
            variable.assign(variable.numpy() + 0.3 * noise)
        path = os.path.join(HERE, f"{case}.keras")
        model.save(path)
        _deflate(path)
        prompts.save_prompt(model, os.path.join(HERE, f"{case}.npz"))
        with tempfile.TemporaryDirectory() as tmp:
            weights = os.path.join(tmp, "w.weights.h5")
            model.save_weights(weights)
            with zipfile.ZipFile(path) as archive, open(weights, "rb") as f:
                assert _h5_arrays(archive.read("model.weights.h5")) == _h5_arrays(f.read())
        expected[case] = keras.ops.convert_to_numpy(model(x))
    np.savez(os.path.join(HERE, "expected.npz"), **expected)
    with open(os.path.join(HERE, "cases.json"), "w") as f:
        json.dump({case: model_arguments(case) | CASES[case] for case in CASES}, f, indent=1)
    with open(os.path.join(HERE, "versions.json"), "w") as f:
        json.dump(
            {
                "tf_metaalign commit": COMMIT,
                "keras": keras.__version__,
                "keras_hub": keras_hub.__version__,
                "tensorflow": tf.__version__,
            },
            f,
            indent=1,
        )


def main():
    if os.environ.get("LEGACY_TREE"):
        _write()
        return
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(
            ["git", "archive", COMMIT, "tf_metaalign"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = dict(os.environ, LEGACY_TREE=tree, PYTHONPATH=tree)
        subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True)


if __name__ == "__main__":
    main()
