"""Options a user gives, declared once.

A set of options (``config.LaunchOptions``: what ``%dt_launch`` and ``dtlab.launch`` take)
is a frozen dataclass whose fields carry, in their ``metadata``, the option's help, its flag
in the magic and how the flag's text is read. From the fields come the magic's argparse
arguments (``views/magic_support.py: option_arguments``) and the Python function's keywords:
its signature, the options list of its docstring, and a TypeError naming the options for
an unknown keyword (``given``). So a flag, its keyword, its default and its help cannot
drift apart. Values are checked where they are used (``LaunchConfig.__post_init__``),
which raises OptionError.
"""

from __future__ import annotations

import difflib
import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = "",
    type: Callable[[str], Any] | None = None,
    action: str | None = None,
    nargs: str | None = None,
    metavar: str | None = None,
    positional: bool = False,
) -> Any:
    """A field of an option set: ``default`` (none: required) and ``help`` as the user
    reads them. ``flag``: the magic's flag ("": made from the name, ``pg_timeout`` ->
    ``--pg-timeout``; None: a Python keyword only); ``positional``: the magic takes it
    without a flag; ``type`` reads the flag's text (refusing bad text with OptionError);
    ``action``, ``nargs``, ``metavar``: as argparse's ``add_argument``."""
    metadata = {
        "help": help,
        "flag": flag,
        "type": type,
        "action": action,
        "nargs": nargs,
        "metavar": metavar,
        "positional": positional,
    }
    return field(default=default, metadata=metadata)


def option_fields(options: type) -> tuple[Field, ...]:
    """The fields of an option set, in declaration order (checked to be declared with
    ``option``)."""
    found = fields(options)
    bare = [f.name for f in found if "help" not in f.metadata]
    if bare:
        raise TypeError(f"{options.__name__}: declare {', '.join(bare)} with option(help=...)")
    return found


def flag_of(f: Field) -> str | None:
    """The magic's name for option ``f``: its flag, its name for a positional, None for a
    Python keyword only."""
    if f.metadata["positional"]:
        return f.name
    if f.metadata["flag"] is None:
        return None
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def given(options: type[T], what: str, values: Mapping[str, Any]) -> T:
    """``options(**values)``, or a TypeError naming the options when a name is not one
    (``what`` is the function the values were given to)."""
    names = [f.name for f in option_fields(options)]
    unknown = [name for name in values if name not in names]
    if unknown:
        near = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise TypeError(
            f"{what} got an unknown option {unknown[0]!r}{hint}; its options are {', '.join(names)}"
        )
    return options(**values)


def signature(
    options: type, *, positional: tuple[str, ...] = (), extra: Mapping[str, Any] | None = None
) -> inspect.Signature:
    """The signature of a function taking ``options`` as keywords (the ``positional`` ones
    may be given by position too), then the keywords ``extra`` ({name: default}) of its
    own: what ``help()`` and a notebook's call tips show for a ``def f(..., **options)``."""
    kinds = inspect.Parameter
    params = []
    by_name = {f.name: f for f in option_fields(options)}
    for name in positional:
        params.append(kinds(name, kinds.POSITIONAL_OR_KEYWORD, annotation=by_name[name].type))
    for f in by_name.values():
        if f.name not in positional:
            default = kinds.empty if f.default is MISSING else f.default
            params.append(kinds(f.name, kinds.KEYWORD_ONLY, default=default, annotation=f.type))
    for name, default in (extra or {}).items():
        params.append(kinds(name, kinds.KEYWORD_ONLY, default=default))
    return inspect.Signature(params)


def describe(options: type, *, skip: tuple[str, ...] = (), indent: str = "    ") -> str:
    """The options list of a docstring: one entry per option, its keyword and default,
    its flag in the magic, and its help."""
    lines = []
    for f in option_fields(options):
        if f.name in skip:
            continue
        flag = flag_of(f)
        where = "Python only" if flag is None else flag
        head = f.name if f.default is MISSING else f"{f.name}={f.default!r}"
        lines.append(
            textwrap.fill(
                f"{head} ({where}): {f.metadata['help']}",
                width=88,
                initial_indent=indent,
                subsequent_indent=indent + "    ",
            )
        )
    return "\n".join(lines)
