"""What every group of magics needs: the live session, or a UsageError saying how to get one."""

from __future__ import annotations

from IPython.core.error import UsageError

from dtlab.control import lifecycle
from dtlab.control.errors import NoSessionError


def current_session():
    try:
        return lifecycle.current()
    except NoSessionError as e:
        raise UsageError(str(e)) from None
