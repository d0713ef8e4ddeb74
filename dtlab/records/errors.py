"""The one error that means "you asked for something invalid", shared by every layer
(records and analysis cannot import control, where the rest of dtlab's errors live)."""

from __future__ import annotations


class InputError(ValueError):
    """A value the user gave (a rank spec, a condition, a plan, an argument) is not valid;
    the message names it and says what would be.

    The base of control's ``OptionError``, of records' ``PlanError``, and what analysis
    raises for such input. The magics show it as IPython's UsageError, a one-line message
    (``views/magic_support.py: dtlab_magics``); a plain ValueError is a bug, not a refusal.
    """
