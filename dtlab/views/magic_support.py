"""What every group of magics needs: the live session (or a UsageError saying how to get
one), arguments made from an option set's fields, and the one place where a refused input
becomes IPython's UsageError.

A magic's options are declared once, as an option set (``control/options.py``; e.g.
``config.LaunchOptions``), whose fields ``option_arguments`` turns into the magic's
argparse arguments. Input is checked where it is used, in control/ or analysis/, which
raise OptionError (analysis: its base, InputError); ``dtlab_magics`` makes every magic of
a class show that as a UsageError: one line, no traceback. Any other error, a ValueError
from a bug included, passes through unchanged.
"""

from __future__ import annotations

import functools
from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import MISSING

from IPython.core.error import UsageError
from IPython.core.magic import magics_class
from IPython.core.magic_arguments import argument

from dtlab.control import config, lifecycle
from dtlab.control.errors import NoSessionError
from dtlab.control.options import flag_of, option_fields
from dtlab.records.errors import InputError


def current_session():
    try:
        return lifecycle.current()
    except NoSessionError as e:
        raise UsageError(str(e)) from None


def connected_job():
    """The job this notebook is connected to (``%dt_connect``, until ``%dt_disconnect``),
    else None: while there is one, %%dt, %dt_pull, %dt_push, %dt_step, %dt_run,
    %dt_continue, %dt_doctor, %dt_findings, %dt_plot and %dt_stacks act on it."""
    from dtlab.control import connect

    return connect.current_or_none()


def current_target():
    """The connected job if there is one, else the live session (or a UsageError)."""
    return connected_job() or current_session()


def text_type(convert: Callable[[str], object]) -> Callable[[str], object]:
    """``convert`` as an argparse ``type``: its refusal (InputError) becomes argparse's
    error, which the magic shows as a UsageError after the flag's name."""
    if convert in (int, float, str):
        return convert  # argparse says "invalid int value: 'x'" itself

    @functools.wraps(convert)
    def converted(text: str):
        try:
            return convert(text)
        except InputError as e:
            raise ArgumentTypeError(str(e)) from None

    return converted


seconds = text_type(config.seconds)  # the type of every --timeout: a positive number of seconds


def option_arguments(options: type) -> Callable:
    """Decorator, under ``@magic_arguments()``: one argparse argument per field of the
    option set ``options`` that has a flag (or is positional), in the fields' order, with
    the field's help and default; its value lands under the field's name, so
    ``options(**vars(args))`` (or the Python function taking them) gets them as they are."""

    def decorate(func):
        for f in reversed(option_fields(options)):  # IPython adds the last decorator first
            flag = flag_of(f)
            if flag is None:
                continue  # a Python keyword only
            meta = f.metadata
            kwargs = {"help": meta["help"]}
            for key in ("action", "nargs", "metavar"):
                if meta[key] is not None:
                    kwargs[key] = meta[key]
            if meta["type"] is not None:
                kwargs["type"] = text_type(meta["type"])
            if not meta["positional"]:
                kwargs["dest"] = f.name
                default = None if f.default is MISSING else f.default
                # argparse's append and extend add to a list
                if meta["action"] in ("append", "extend") and default is not None:
                    default = list(default)
                kwargs["default"] = default
            func = argument(flag, **kwargs)(func)
        return func

    return decorate


def _refusals_as_usage_errors(method):
    @functools.wraps(method)  # keeps the `parser` that parse_argstring reads
    def magic(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except InputError as e:  # OptionError included: input refused where it was checked
            raise UsageError(str(e)) from None

    return magic


def dtlab_magics(cls):
    """Class decorator for dtlab's Magics classes, in place of IPython's ``magics_class``:
    registers the magics, and makes each show a refused input (InputError, so OptionError
    too) as a UsageError. The one place that turns such errors into UsageError."""
    cls = magics_class(cls)
    methods = {m for table in cls.magics.values() for m in table.values() if isinstance(m, str)}
    for name in methods:  # a line-and-cell magic is one method, wrapped once
        setattr(cls, name, _refusals_as_usage_errors(getattr(cls, name)))
    return cls
