"""Each program setting declared once: a field of the program's `Config` dataclass, and
the absl flag of the same name derived from it.

    @dataclasses.dataclass
    class Config:
        steps: int = setting(120, "Training steps.")
        seeds: tuple[int, ...] = setting((0, 1, 2), "Seeds.")
        mode: str = setting("shallow", "Prompt mode.", choices=("shallow", "deep"))

    if __name__ == "__main__":
        define_flags_from(Config)          # --steps, --seeds, --mode, with help and defaults
        app.run(main)                      # main: config = config_from_flags(Config)

`define_flags_from` defines one flag per field (type from the annotation, default and help
from the field); `config_from_flags` builds the checked `Config` back from the parsed flags.
Tests build `Config` directly. Stdlib and absl only: a program imports this before
TensorFlow (`trainers.startup`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Mapping, Sequence

from absl import flags

#: The Keras backends of `--backend` (`trainers.startup.BACKENDS`).
BACKENDS = ("tensorflow", "jax")

#: Element types a list setting (`tuple[T, ...]`) may hold.
_LIST_ELEMENTS = (str, int, float)


def setting(
    default: Any = dataclasses.MISSING,
    help: str | Callable[[], str] = "",
    *,
    choices: Sequence[str] | None = None,
    parse: Callable[[list[str]], Any] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    flag: bool = True,
):
    """A `Config` field that is also the program's flag of the same name.

    Args:
      default: the setting's default (a tuple for a list setting).
      help: the flag's help text, or a function returning it (called when the flags are
        defined: for help that lists what a registry holds at run time).
      choices: the values a `str` setting, or the items a list setting, may take: an enum
        flag, or a list flag that rejects other items; the help lists them.
      parse: for a setting of another type (a dict, say), how to build its value from the
        flag's comma-separated items (the flag is a list of strings, default empty).
      default_factory: as `dataclasses.field`'s (mutable defaults).
      flag: False for a setting with no flag (tests and callers set it; `--help` omits it).
    """
    if flag and not help:
        raise ValueError("`help` is empty: every flag needs a help text.")
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "parse": parse}
    metadata["flag"] = flag
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def _optional(field_type) -> type | None:
    """`T` of `T | None` / `Optional[T]` with T in bool / int / float / str (else None):
    a setting whose default None means "chosen at run time" (a per-dataset default)."""
    import types

    if typing.get_origin(field_type) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(field_type) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(field_type)) == 2:
            if args[0] in (bool, int, float, str):
                return args[0]
    return None


def _list_element(field_type) -> type | None:
    """`T` of `tuple[T, ...]` / `list[T]` (None: not a list setting)."""
    origin, args = typing.get_origin(field_type), typing.get_args(field_type)
    if origin in (tuple, list) and args and args[0] in _LIST_ELEMENTS:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return None
        return args[0]
    return None


class _ListParser(flags.ListParser):
    """absl's comma-separated list, each item converted to `element` (and, with
    `choices`, one of them); a wrong item is an error naming the flag."""

    def __init__(self, name: str, element: type, choices: Sequence[str] | None):
        super().__init__()
        self.name, self.element, self.choices = name, element, choices

    def parse(self, argument):
        items = super().parse(list(argument) if isinstance(argument, tuple) else argument)
        out = []
        for item in items:
            try:
                value = item if isinstance(item, self.element) else self.element(item)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`--{self.name}` takes comma-separated {self.element.__name__} values; "
                    f"{item!r} is not one."
                ) from None
            if self.choices and value not in self.choices:
                raise ValueError(
                    f"`--{self.name}`: {item!r} is not one of {', '.join(self.choices or ())}."
                )
            out.append(value)
        return out

    def flag_type(self):
        return f"list of {self.element.__name__}"


def _settings(config_cls):
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"`config_cls` must be a dataclass type; got {config_cls!r}.")
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.metadata.get("flag", False):
            yield field, hints[field.name]


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"setting `{field.name}` has no default: a flag needs one.")


def define_flags_from(config_cls, flag_values=None) -> list[str]:
    """Define one absl flag per setting (`setting(...)` field) of the dataclass
    `config_cls`; returns their names.

    The annotation gives the flag's type: `bool`, `int`, `float`, `str` (an enum with
    `choices`), each also as `T | None` (a flag whose default None the program resolves,
    e.g. a per-dataset default), `tuple[T, ...]` with T in str / int / float (a
    comma-separated list whose items are converted, and checked against `choices`), or
    any type with a `parse` function (a list of strings). The field's default is the
    flag's, its help the flag's help. The flags count as defined by the calling module
    (the program: `--help` lists them), not by this one.
    """
    flag_values = flags.FLAGS if flag_values is None else flag_values
    names = []
    for field, field_type in _settings(config_cls):
        name, default = field.name, _default(field)
        help_text = field.metadata["help"]
        help_text = help_text() if callable(help_text) else help_text
        choices = field.metadata["choices"]
        element = _list_element(field_type)
        field_type = _optional(field_type) or field_type  # the flag's default stays None
        if field.metadata["parse"] is not None:
            flags.DEFINE_list(name, [], help_text, flag_values=flag_values)
        elif field_type is bool:
            flags.DEFINE_bool(name, default, help_text, flag_values=flag_values)
        elif field_type is int:
            flags.DEFINE_integer(name, default, help_text, flag_values=flag_values)
        elif field_type is float:
            flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
        elif field_type is str and choices:
            flags.DEFINE_enum(name, default, choices, help_text, flag_values=flag_values)
        elif field_type is str:
            flags.DEFINE_string(name, default, help_text, flag_values=flag_values)
        elif element is not None:
            if choices:
                help_text = f"{help_text} Items: {', '.join(map(str, choices))}."
            flags.DEFINE(
                _ListParser(name, element, choices),
                name,
                list(default),
                help_text,
                flag_values=flag_values,
                serializer=flags.CsvListSerializer(","),
            )
        else:
            raise TypeError(
                f"setting `{name}`: no flag for type {field_type!r} (bool, int, float, str, "
                "tuple[str | int | float, ...], or give `parse`)."
            )
        names.append(name)
    return names


# Flags defined by `define_flags_from` belong to the program that calls it.
flags.disclaim_key_flags()


def config_from_flags(config_cls, flag_values=None, full_run: Mapping[str, Any] | None = None):
    """The program's `config_cls` from its parsed flags, checked (`config.check()` if it
    has one): each setting takes its flag's value (lists as tuples; `parse` settings
    parsed); settings without a flag keep their defaults. With `full_run` (a `--full`
    preset), its values replace those of flags not given on the command line.
    """
    flag_values = flags.FLAGS if flag_values is None else flag_values
    values = {}
    for field, field_type in _settings(config_cls):
        value = flag_values[field.name].value
        if field.metadata["parse"] is not None:
            value = field.metadata["parse"](value)
        elif _list_element(field_type) is not None:
            value = tuple(value)
        values[field.name] = value
    for name, value in (full_run or {}).items():
        if name not in values:
            raise ValueError(f"`full_run` sets {name!r}, which is not a setting with a flag.")
        if not flag_values[name].present:
            values[name] = value
    config = config_cls(**values)
    if hasattr(config, "check"):
        config.check()
    return config


def define_program_flags(
    config_cls, output_dir: str, full_run_help: str | None = None, flag_values=None
) -> None:
    """A program's flags: one per setting of `config_cls` (`define_flags_from`),
    `--output_dir` (default `output_dir`), `--backend` (Keras's backend: `backend_flag`)
    and, with `full_run_help`, `--full` (the program's preset for the long run,
    `program_config(..., full_run)`)."""
    flag_values = flags.FLAGS if flag_values is None else flag_values
    define_flags_from(config_cls, flag_values)
    flags.DEFINE_enum(
        "backend",
        None,
        BACKENDS,
        "Keras's backend (default: KERAS_BACKEND, else tensorflow). On jax the program needs "
        "no TensorFlow: its data come as NumPy batches and it writes no TensorBoard logs.",
        flag_values=flag_values,
    )
    if full_run_help is not None:
        flags.DEFINE_bool("full", False, full_run_help, flag_values=flag_values)
    flags.DEFINE_string("output_dir", output_dir, "Where results go.", flag_values=flag_values)


def program_config(config_cls, full_run: Mapping[str, Any] | None = None, flag_values=None):
    """`config_from_flags` in a program's `main`: with `full_run` applied when `--full` is
    given, and a bad setting raised as absl's `UsageError` (the message names it)."""
    from absl import app

    flag_values = flags.FLAGS if flag_values is None else flag_values
    full = "full" in flag_values and flag_values.full
    try:
        return config_from_flags(config_cls, flag_values, full_run if full else None)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def check_integers(config, names: Sequence[str], minimum: int = 1, note: str = "") -> None:
    """A `Config.check` step: each named setting is an integer (not a bool) >= `minimum`;
    the error names the setting (`note`, e.g. "(0: all)", follows the bound)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            note_text = f" {note}" if note else ""
            raise ValueError(f"`{name}` must be an integer >= {minimum}{note_text}; got {value!r}.")


def check_positive(config, names: Sequence[str]) -> None:
    """A `Config.check` step: each named setting is a number > 0 (rates)."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"`{name}` must be > 0; got {getattr(config, name)!r}.")
