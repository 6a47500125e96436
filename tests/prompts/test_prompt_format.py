"""The saved format of a PromptedCausalLM's prompt (`causal_lm.PROMPT_FORMAT_VERSION`):
prompts saved before Gemma's conventions changed still compute what they computed.

Oracle: files that tf_metaalign at commit 1ac9f45 wrote itself, with the logits its models
gave (`legacy_fixtures/`, written by `legacy_fixtures/make_legacy_fixtures.py`, which runs
that commit's package): a Gemma shallow prompt there was multiplied by sqrt(hidden_dim) in
the forward pass, and a Gemma deep prefix held keras-hub's interleaved rotary keys. Loaded
today from each of the three files a user has -- a `save_prompt` .npz, a `.keras` file, a
weights-only file (`save_weights` / `BackupAndRestore`; the `.keras` file's
`model.weights.h5` member, the same file) -- the model must give those logits; assigning the
files' values as they are gives other logits (checked: the fixture can fail). GPT-2 and
Llama files load unchanged; files of the current format round-trip bit-exactly; a newer
format is refused. A prompt trainer's checkpoint converts through the nested model.

Default suite: 25 tests, ~15 s on 2 cores.
"""

import io
import json
import os
import shutil
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
from keras import ops

from tf_metaalign import prompts
from tf_metaalign.prompts import causal_lm as C

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_fixtures")
with open(os.path.join(HERE, "cases.json")) as _f:
    CASES = json.load(_f)
EXPECTED = dict(np.load(os.path.join(HERE, "expected.npz")))
X = {"token_ids": EXPECTED["token_ids"], "padding_mask": EXPECTED["padding_mask"]}
FILES = ("npz", "keras", "weights")
CONVERTED = "prompt_format_version 1"  # in the conversion's warning


def numpy(x):
    return ops.convert_to_numpy(x)


def arguments(case):
    spec = CASES[case]
    keys = ("length", "mode", "init", "reparameterize", "seed")
    return {k: spec[k] for k in keys}


def load_keras(path, convert):
    """keras.models.load_model, the conversion's warning expected iff `convert`."""
    return _expect_warning(convert, keras.models.load_model, path)


def _expect_warning(convert, fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    ours = [w for w in caught if CONVERTED in str(w.message)]
    assert len(ours) == (1 if convert else 0), [str(w.message) for w in caught]
    return result


def old_weights_file(case, tmp_path):
    """The old code's weights-only file: the `.keras` file's `model.weights.h5` member."""
    path = tmp_path / f"{case}.weights.h5"
    with zipfile.ZipFile(os.path.join(HERE, f"{case}.keras")) as archive:
        path.write_bytes(archive.read("model.weights.h5"))
    return path


def load(case, kind, tmp_path):
    """A model of today holding the old file `case` of `kind`."""
    convert = CASES[case]["family"] == "gemma"
    keras_path = os.path.join(HERE, f"{case}.keras")
    if kind == "keras":
        return load_keras(keras_path, convert)
    backbone = load_keras(keras_path, convert).backbone
    model = prompts.PromptedCausalLM(backbone, **arguments(case))
    if kind == "npz":
        _expect_warning(convert, prompts.load_prompt, model, os.path.join(HERE, f"{case}.npz"))
    else:
        _expect_warning(convert, model.load_weights, old_weights_file(case, tmp_path))
    return model


def saved_values(case):
    with np.load(os.path.join(HERE, f"{case}.npz")) as data:
        return {k: data[k] for k in data if k != "__prompt_metadata__"}


# ------------------------------------------------------------------ old files


@pytest.mark.parametrize("kind", FILES)
@pytest.mark.parametrize("case", list(CASES))
def test_an_old_file_gives_the_old_models_logits(case, kind, tmp_path):
    model = load(case, kind, tmp_path)
    logits = numpy(model(X))
    expected = EXPECTED[case]
    # float32 throughout: shallow, the first layer's input is the old one bit for bit (the
    # same product); deep, a permutation. Reparameterised shallow: the MLP's output is
    # scaled before its bias is added, a float rounding apart.
    np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=2e-6)
    if CASES[case]["family"] != "gemma":  # unchanged conventions: the values as saved
        for variable in model.prompt_variables:
            np.testing.assert_array_equal(variable.numpy(), saved_values(case)[variable.name])
        return
    raw = prompts.PromptedCausalLM(model.backbone, **arguments(case))
    for variable in raw.prompt_variables:  # the file's values as they are: what the bug did
        variable.assign(saved_values(case)[variable.name])
    assert np.abs(numpy(raw(X)) - expected).max() > 0.05


@pytest.mark.parametrize("case", ["gemma_shallow", "gemma_deep"])
def test_the_conversion_is_the_old_forward_product_or_a_permutation(case, tmp_path):
    model = load(case, "npz", tmp_path)
    old = saved_values(case)[model.prompt_variables[0].name]
    new = model.prompt_variables[0].numpy()
    if CASES[case]["mode"] == "shallow":  # one float32 rounding: old * fl(sqrt(8))
        np.testing.assert_array_equal(new, old * np.float32(np.sqrt(8.0)))
        return
    # [L, layer, key/value, kv head, head_dim]: keys' halves de-interleaved, values as saved
    old, new = old.reshape(3, 2, 2, 1, 4), new.reshape(3, 2, 2, 1, 4)
    np.testing.assert_array_equal(new[:, :, 1], old[:, :, 1])
    np.testing.assert_array_equal(new[:, :, 0], old[:, :, 0][..., [0, 2, 1, 3]])


# ------------------------------------------------------------------ new files


def test_new_files_record_the_format_and_round_trip_bit_exactly(tmp_path):
    model = load("gemma_shallow", "keras", tmp_path)  # converted once
    assert model.prompt_metadata()["prompt_format_version"] == C.PROMPT_FORMAT_VERSION == 2
    assert model.get_config()["prompt_format_version"] == 2
    logits = numpy(model(X))
    path = prompts.save_prompt(model, tmp_path / "p.npz")
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    with h5py.File(tmp_path / "m.weights.h5") as f:
        assert int(f["vars/prompt_format_version"][()]) == 2

    again = [load_keras(tmp_path / "m.keras", convert=False)]
    for loader, source in ((prompts.load_prompt, path), (None, tmp_path / "m.weights.h5")):
        fresh = prompts.PromptedCausalLM(model.backbone, **arguments("gemma_shallow"))
        _expect_warning(
            False, loader or fresh.load_weights, *((fresh, source) if loader else (source,))
        )
        again.append(fresh)
    for other in again:
        for a, b in zip(other.prompt_variables, model.prompt_variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        np.testing.assert_array_equal(numpy(other(X)), logits)


def test_a_file_edited_to_the_old_form_converts(tmp_path):
    """The record removed from a new .npz's metadata: the values are read as format 1."""
    model = load("gemma_shallow", "npz", tmp_path)
    path = prompts.save_prompt(model, tmp_path / "p.npz")
    with np.load(path) as data:
        arrays = dict(data)
    metadata = json.loads(str(arrays["__prompt_metadata__"]))
    del metadata["prompt_format_version"]
    arrays["__prompt_metadata__"] = np.asarray(json.dumps(metadata))
    np.savez(tmp_path / "old.npz", **arrays)
    fresh = prompts.PromptedCausalLM(model.backbone, **arguments("gemma_shallow"))
    _expect_warning(True, prompts.load_prompt, fresh, tmp_path / "old.npz")
    np.testing.assert_array_equal(
        fresh.prompt_variables[0].numpy(),
        model.prompt_variables[0].numpy() * np.float32(np.sqrt(8.0)),
    )


def test_a_newer_format_is_refused_on_every_path(tmp_path):
    model = load("gemma_shallow", "npz", tmp_path)
    path = prompts.save_prompt(model, tmp_path / "p.npz")
    with np.load(path) as data:
        arrays = dict(data)
    arrays["__prompt_metadata__"] = np.asarray(
        str(arrays["__prompt_metadata__"]).replace(
            '"prompt_format_version": 2', '"prompt_format_version": 3'
        )
    )
    np.savez(tmp_path / "new.npz", **arrays)
    with pytest.raises(ValueError, match="prompt_format_version=3.*reads 1 to 2"):
        prompts.load_prompt(model, tmp_path / "new.npz")

    model.save_weights(tmp_path / "w.weights.h5")
    with h5py.File(tmp_path / "w.weights.h5", "a") as f:
        f["vars/prompt_format_version"][()] = 3
    with pytest.raises(ValueError, match="prompt_format_version=3"):
        model.load_weights(tmp_path / "w.weights.h5")

    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    config["config"]["prompt_format_version"] = 3
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(tmp_path / "n.keras", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(ValueError, match="model config has prompt_format_version=3"):
        keras.models.load_model(tmp_path / "n.keras")


# ------------------------------------------------------------------ a trainer's checkpoint


def _delete_format_records(path):
    """A checkpoint of the old form: every `prompt_format_version` entry removed."""
    with h5py.File(path, "a") as f:
        found = []
        f.visit(
            lambda name: found.append(name) if name.endswith("/prompt_format_version") else None
        )
        for name in found:
            del f[name]
    return found


def test_a_prompt_trainers_old_checkpoint_converts_the_nested_model(tmp_path):
    """`trainer.save_weights` (what BackupAndRestore writes) of a prompt FOMAML trainer around
    a Gemma shallow prompt; without the record (the old form) `load_weights` converts the
    model's prompt; with it, the prompt loads as saved."""
    from tf_metaalign import optimizers as O
    from tf_metaalign.trainers.prompt_meta import PromptFOMAMLTrainer

    source = load("gemma_shallow", "npz", tmp_path)

    def trainer():
        model = prompts.PromptedCausalLM(source.backbone, **arguments("gemma_shallow"))
        return model, PromptFOMAMLTrainer(model, inner_steps=1, inner_optimizer=O.SGD(0.5))

    model, saving = trainer()
    model.prompt_variables[0].assign(source.prompt_variables[0].numpy())
    saving.save_weights(tmp_path / "t.weights.h5")
    shutil.copy(tmp_path / "t.weights.h5", tmp_path / "old.weights.h5")
    assert _delete_format_records(tmp_path / "old.weights.h5")  # the model's, found nested

    restored, restoring = trainer()
    _expect_warning(False, restoring.load_weights, tmp_path / "t.weights.h5")
    np.testing.assert_array_equal(
        restored.prompt_variables[0].numpy(), model.prompt_variables[0].numpy()
    )
    restored, restoring = trainer()
    _expect_warning(True, restoring.load_weights, tmp_path / "old.weights.h5")
    np.testing.assert_array_equal(
        restored.prompt_variables[0].numpy(),
        model.prompt_variables[0].numpy() * np.float32(np.sqrt(8.0)),
    )


def test_the_fixture_is_what_save_weights_wrote():
    """The tests' old weights-only file is the `.keras` member: the generator checked it;
    here, that the member holds no format record (old) and the prompt as the .npz does."""
    with zipfile.ZipFile(os.path.join(HERE, "gemma_shallow.keras")) as archive:
        data = archive.read("model.weights.h5")
    with h5py.File(io.BytesIO(data)) as f:
        assert "prompt_format_version" not in f["vars"]
        np.testing.assert_array_equal(
            f["vars/0"][()], saved_values("gemma_shallow")["prompt_embeddings"]
        )
