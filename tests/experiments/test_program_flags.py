"""`trainers.settings`: `setting` / `define_flags_from` / `config_from_flags`: each program
setting declared once, as a `Config` field, and its absl flag derived from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from trainers import settings
from trainers.settings import setting

ROOT = Path(__file__).resolve().parents[2]


def _parse_method_options(items):
    return {k: v for k, _, v in (item.partition("=") for item in items)}


@dataclasses.dataclass
class Toy:
    fast: bool = setting(True, "A bool.")
    steps: int = setting(10, "An int.")
    rate: float = setting(0.5, "A float.")
    name: str = setting("x", "A string.")
    mode: str = setting("a", "An enum.", choices=("a", "b"))
    seeds: tuple[int, ...] = setting((0, 1), "Integers.")
    scales: tuple[float, ...] = setting((1.0,), "Numbers.")
    modes: tuple[str, ...] = setting(("a",), "Enum items.", choices=("a", "b", "c"))
    words: tuple[str, ...] = setting((), "Any strings.")
    options: dict = setting(
        default_factory=dict, help=lambda: "Computed help.", parse=_parse_method_options
    )
    hidden: int = setting(7, flag=False)
    checked: bool = False

    def check(self):
        if self.steps < 1:
            raise ValueError(f"`steps` must be >= 1; got {self.steps}.")
        self.checked = True


def _flags(*argv):
    values = flags.FlagValues()
    names = settings.define_flags_from(Toy, values)
    values(["program", *argv])
    return values, names


def test_flags_have_the_fields_types_defaults_and_help():
    values, names = _flags()
    assert names == [f.name for f in dataclasses.fields(Toy) if f.name not in ("hidden", "checked")]
    assert values["fast"].flag_type() == "bool" and values["steps"].flag_type() == "int"
    assert values["rate"].flag_type() == "float" and values["mode"].flag_type() == "string enum"
    assert values["seeds"].value == [0, 1] and values["scales"].value == [1.0]
    assert values["options"].value == [] and values["words"].value == []
    assert values["options"].help == "Computed help."
    assert values["modes"].help == "Enum items. Items: a, b, c."
    assert "hidden" not in values
    # The defaults build the dataclass's own defaults, checked.
    config = settings.config_from_flags(Toy, values)
    assert config == dataclasses.replace(Toy(), checked=True)


def test_flag_values_become_the_config_with_tuples_and_parsed_settings():
    values, _ = _flags(
        "--nofast",
        "--steps=3",
        "--rate=2.5",
        "--name=y",
        "--mode=b",
        "--seeds=4,5,6",
        "--scales=0.5,10",
        "--modes=c,a",
        "--words=p,q",
        "--options=k=1,j=2",
    )
    config = settings.config_from_flags(Toy, values)
    assert config == Toy(
        fast=False,
        steps=3,
        rate=2.5,
        name="y",
        mode="b",
        seeds=(4, 5, 6),
        scales=(0.5, 10.0),
        modes=("c", "a"),
        words=("p", "q"),
        options={"k": "1", "j": "2"},
        hidden=7,
        checked=True,
    )
    assert isinstance(config.seeds, tuple) and isinstance(config.scales[1], float)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--seeds=1,a"], ["--seeds", "'a'", "int"]),
        (["--scales=1,x"], ["--scales", "'x'", "float"]),
        (["--modes=a,z"], ["--modes", "'z'", "a, b, c"]),
        (["--mode=z"], ["--mode", "a|b"]),
        (["--steps=many"], ["--steps"]),
        (["--rate=fast"], ["--rate"]),
    ],
)
def test_a_wrong_value_is_an_error_naming_the_flag(argv, words):
    with pytest.raises(flags.IllegalFlagValueError) as error:
        _flags(*argv)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_the_config_check_runs_and_the_full_preset_yields_to_explicit_flags():
    values, _ = _flags("--steps=0")
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        settings.config_from_flags(Toy, values)
    values, _ = _flags("--rate=0.25")
    config = settings.config_from_flags(Toy, values, {"rate": 9.0, "seeds": (7,)})
    assert config.rate == 0.25 and config.seeds == (7,)
    with pytest.raises(ValueError, match="'hidden'"):
        settings.config_from_flags(Toy, values, {"hidden": 1})


@dataclasses.dataclass
class WithOptional:
    weight: float | None = setting(None, "A float or None (a per-dataset default).")
    units: int | None = setting(None, "An int or None.")
    optimizer: str | None = setting(None, "An enum or None.", choices=("adam", "sgd"))
    label: str | None = setting("x", "A string or None.")


def test_optional_settings_default_to_none_and_take_values_of_their_type():
    values = flags.FlagValues()
    settings.define_flags_from(WithOptional, values)
    values(["program"])
    assert values["weight"].flag_type() == "float" and values["units"].flag_type() == "int"
    assert values["optimizer"].flag_type() == "string enum"
    assert settings.config_from_flags(WithOptional, values) == WithOptional()
    values.unparse_flags()
    values(["program", "--weight=0.5", "--units=3", "--optimizer=sgd", "--label=y"])
    assert settings.config_from_flags(WithOptional, values) == WithOptional(0.5, 3, "sgd", "y")
    for argv in (["--weight=heavy"], ["--units=1.5"], ["--optimizer=rmsprop"]):
        values.unparse_flags()
        with pytest.raises(flags.IllegalFlagValueError, match=argv[0].split("=")[0][2:]):
            values(["program", *argv])


def test_settings_the_helper_cannot_make_a_flag_of_are_refused():
    @dataclasses.dataclass
    class Bad:
        pair: tuple[int, int] = setting((1, 2), "Two ints, not a list.")

    @dataclasses.dataclass
    class Either:
        value: int | str = setting(1, "An int or a string: which flag type?")

    with pytest.raises(TypeError, match="`pair`"):
        settings.define_flags_from(Bad, flags.FlagValues())
    with pytest.raises(TypeError, match="`value`"):
        settings.define_flags_from(Either, flags.FlagValues())
    with pytest.raises(ValueError, match="`help` is empty"):
        setting(1)
    with pytest.raises(TypeError, match="dataclass"):
        settings.define_flags_from(object, flags.FlagValues())


def test_the_flags_belong_to_the_module_that_defines_them():
    values, names = _flags()
    assert sorted(f.name for f in values.flags_by_module_dict()[__name__]) == sorted(names)
    assert "trainers.settings" not in values.flags_by_module_dict()


PROGRAMS = (
    "fewshot",
    "finetune",
    "guided",
    "multitask",
    "multitask_synthetic",
    "promptability",
    "promptability_decoder",
)


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_setting_is_a_flag_with_help(program):
    """Each program's settings are its `Config`'s fields: one flag each, with help."""
    module = __import__(f"trainers.{program}", fromlist=["Config"])
    values = flags.FlagValues()
    names = settings.define_flags_from(module.Config, values)
    fields = [f.name for f in dataclasses.fields(module.Config) if f.metadata.get("flag")]
    assert names == fields and len(names) >= 6
    for name in names:
        assert values[name].help.strip(), name
    values(["program"])
    assert settings.config_from_flags(module.Config, values) == module.Config()


def test_program_help_lists_every_flag():
    """`python -m trainers.fewshot --help`: the settings and the program's own flags."""
    from trainers import fewshot

    proc = subprocess.run(
        [sys.executable, "-m", "trainers.fewshot", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    for field in dataclasses.fields(fewshot.Config):
        assert f"--{field.name}" in text or f"--[no]{field.name}" in text, field.name
    for name in ("--[no]full", "--output_dir"):
        assert name in text
    assert "Outer Adam's rate." in text


def test_program_flags_add_output_dir_and_full_and_bad_settings_are_usage_errors():
    from absl import app

    values = flags.FlagValues()
    settings.define_program_flags(Toy, "/tmp/out", "The long run.", values)
    values(["program", "--full", "--rate=0.25"])
    assert values.output_dir == "/tmp/out" and values["full"].help == "The long run."
    config = settings.program_config(Toy, {"rate": 9.0, "steps": 4}, values)
    assert (config.rate, config.steps) == (0.25, 4)  # --full: the preset, explicit flags win
    values = flags.FlagValues()
    settings.define_program_flags(Toy, "/tmp/out", flag_values=values)
    values(["program", "--steps=0"])
    assert "full" not in values
    with pytest.raises(app.UsageError, match="`steps` must be >= 1"):
        settings.program_config(Toy, {"steps": 4}, values)


def test_config_checks_name_the_setting_and_the_bound():
    config = Toy(steps=0, rate=-1.0)
    with pytest.raises(ValueError, match=r"`steps` must be an integer >= 1; got 0\."):
        settings.check_integers(config, ("steps",))
    with pytest.raises(ValueError, match=r"`fast` must be an integer >= 0 \(0: all\); got True"):
        settings.check_integers(config, ("fast",), 0, "(0: all)")
    settings.check_integers(Toy(), ("steps", "hidden"))
    with pytest.raises(ValueError, match=r"`rate` must be > 0; got -1\.0\."):
        settings.check_positive(config, ("rate",))
    settings.check_positive(Toy(), ("rate", "steps"))
