"""What every group of magics needs: the live session, or a UsageError saying how to get one."""

from __future__ import annotations

from argparse import ArgumentTypeError

from IPython.core.error import UsageError

from dtlab.control import lifecycle
from dtlab.control.config import checked_timeout
from dtlab.control.errors import NoSessionError


def current_session():
    try:
        return lifecycle.current()
    except NoSessionError as e:
        raise UsageError(str(e)) from None


def seconds(text: str) -> float:
    """The argparse type of every ``--timeout``: a positive number of seconds (the rule is
    control's ``checked_timeout``; argparse turns the refusal into a UsageError)."""
    try:
        return checked_timeout(float(text), "--timeout")
    except ValueError as e:
        raise ArgumentTypeError(
            str(e) if "must be" in str(e) else f"{text!r} is not a number of seconds"
        ) from None
