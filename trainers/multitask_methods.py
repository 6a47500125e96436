"""Method names and method options of the multi-task programs, read from the registry.

`trainers.multitask` and `trainers.multitask_synthetic` accept, in `--methods=`, their
own methods (Reptile, Sequential Reptile, ...) and EVERY method of the multi-task
registry (`tf_metaalign.algorithms.multitask.method_names()`), each run by
`MultiTaskTrainer(method=...)`; "zoo" stands for all of the registry's methods, so a
method added to the registry (one file plus one registry line) is run by `--methods=zoo`
and takes options with no change here.

Method hyperparameters pass through `--method_options=<method>.<argument>=<value>,...`
(e.g. `cagrad.calpha=0.4,nash_mtl.optim_niter=10`): `<argument>` is a constructor
argument of the method's class (its docstring lists them), `<value>` a Python literal
(`0.4`, `10`, `True`, `'l2'`, `(0.1, 0.2)`) or a bare word taken as a string (`l2`).
Errors name the flag and say what was expected.
"""

from __future__ import annotations

import ast
from typing import Iterable, Mapping

from trainers.settings import setting

#: `--methods=zoo`: every method of the multi-task registry.
ZOO = "zoo"


def registry_names() -> tuple[str, ...]:
    """The registry's primary names, in its (the docs') order."""
    from tf_metaalign.algorithms.multitask import method_names

    return method_names()


def registry_name(method: str, aliases: Mapping[str, str]) -> str | None:
    """The registry name a program method runs (`aliases`: program name -> registry
    name, e.g. {"mtl": "sum"}), or None for a program's own method."""
    name = aliases.get(method, method)
    return name if name in registry_names() else None


def zoo(aliases: Mapping[str, str]) -> tuple[str, ...]:
    """Every registry method, under the program's name for it where it has one."""
    inverse = {registry: program for program, registry in aliases.items()}
    return tuple(inverse.get(name, name) for name in registry_names())


def known(program_methods: Iterable[str], aliases: Mapping[str, str]) -> tuple[str, ...]:
    """Every name `--methods=` accepts (besides "zoo")."""
    names = list(program_methods) + list(aliases)
    return tuple(names + [n for n in zoo(aliases) if n not in names])


def expand(methods: Iterable[str], aliases: Mapping[str, str]) -> tuple[str, ...]:
    """`methods` with "zoo" replaced by the registry's methods (duplicates dropped, first
    occurrence kept)."""
    out = []
    for method in methods:
        for name in zoo(aliases) if method == ZOO else (method,):
            if name not in out:
                out.append(name)
    return tuple(out)


def check_methods(methods, program_methods, aliases, flag: str = "methods") -> None:
    choices = known(program_methods, aliases)
    unknown = [m for m in methods if m not in choices]
    if unknown or not methods:
        raise ValueError(
            f"`{flag}`: unknown {unknown} (or none given); choose from {', '.join(choices)}, "
            f"or '{ZOO}' for every method of the multi-task registry."
        )


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string option such as normalization=l2


def parse_method_options(items, flag: str = "method_options") -> dict:
    """{method: {argument: value}} from `method.argument=value` items (a list, as absl's
    list flag splits them on commas: an item without "=" continues the previous value,
    so `famo.min_losses=(0.1,0.2)` survives the split), or a mapping returned as is."""
    if isinstance(items, Mapping):
        return {m: dict(o) for m, o in items.items()}
    if isinstance(items, str):
        items = items.split(",") if items else []
    merged = []
    for item in items:
        if "=" not in item and merged:
            merged[-1] += "," + item
        else:
            merged.append(item)
    options: dict = {}
    for item in merged:
        key, sep, text = item.partition("=")
        method, dot, argument = key.strip().partition(".")
        if not sep or not dot or not method or not argument or not text.strip():
            raise ValueError(
                f"`{flag}`: {item!r} is not <method>.<argument>=<value> (e.g. cagrad.calpha=0.4)."
            )
        if argument in options.get(method, {}):
            raise ValueError(f"`{flag}`: {method}.{argument} is given twice.")
        options.setdefault(method, {})[argument.strip()] = _value(text.strip())
    return options


def check_method_options(options: Mapping, methods, aliases, flag: str = "method_options") -> None:
    """Every method named in `options` is run (`methods`) and is a registry method, and
    its class accepts the arguments and values (it is built once to check)."""
    from tf_metaalign.algorithms.multitask import get_method

    if not isinstance(options, Mapping):
        raise ValueError(
            f"`{flag}` must be a dict {{method: {{argument: value}}}}; got {options!r}."
        )
    for method, arguments in options.items():
        if method not in methods:
            raise ValueError(
                f"`{flag}` sets options of {method!r}, which is not among the "
                f"methods run ({', '.join(methods)})."
            )
        name = registry_name(method, aliases)
        if name is None:
            raise ValueError(
                f"`{flag}`: {method!r} is not a method of the multi-task "
                "registry and takes no method options (it has flags of its own)."
            )
        if not isinstance(arguments, Mapping):
            raise ValueError(
                f"`{flag}`: the options of {method!r} must be a dict; got {arguments!r}."
            )
        try:
            get_method(name, **arguments)
        except (ValueError, TypeError) as e:
            raise ValueError(f"`{flag}`: {method} {dict(arguments)}: {e}") from None


def build(method: str, options: Mapping, aliases, defaults: Mapping | None = None):
    """The method object program method `method` runs: the registry method with the
    program's `defaults` for it, overridden by the user's `options[method]`."""
    from tf_metaalign.algorithms.multitask import get_method

    name = registry_name(method, aliases)
    if name is None:
        raise ValueError(f"{method!r} is not a method of the multi-task registry.")
    return get_method(name, **{**dict(defaults or {}), **dict(options.get(method, {}))})


def methods_setting(default: Iterable[str], program_methods, aliases: Mapping[str, str]):
    """A program's `methods` setting (`trainers.settings.setting`): `--methods=`, whose
    help lists every name it accepts (read from the registry when the flags are defined)."""
    return setting(
        tuple(default),
        lambda: (
            f"Which methods: {', '.join(known(program_methods, aliases))}; "
            f"'{ZOO}' = every method of the multi-task registry."
        ),
    )


def method_options_setting(example: str = "cagrad.calpha=0.4,nash_mtl.optim_niter=10"):
    """A program's `method_options` setting: {method: {argument: value}}, given as
    `--method_options=<method>.<argument>=<value>,...` (`parse_method_options`)."""
    return setting(
        default_factory=dict,
        help="Registry methods' hyperparameters, <method>.<argument>=<value>, e.g. "
        f"{example} (the arguments of the method's class, "
        "tf_metaalign.algorithms.multitask).",
        parse=parse_method_options,
    )
