"""``Word``: the base of dtlab's enums of words (launchers, rank states, reply kinds):
a str equal to its text, printed and written to JSON as it, on every Python dtlab runs on
(``enum.StrEnum`` is 3.11+)."""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A word compared in several places: a str equal to its text."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)
