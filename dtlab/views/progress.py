"""Progress of long steps (engines registering, ranks joining) as text or as a widget.

A reporter is a callable ``(phase, done, total)``; control/ calls it, views decide the face.
"""

from __future__ import annotations

import sys
import time

QUIET_S = 1.0  # on plain text, print intermediate counts at most this often


class TextProgress:
    """One line per finished phase, plus a line at most every second while one drags on."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.last_print = self.start
        self.seen: dict[str, tuple[int, int]] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.seen.get(phase) == (done, total):
            return
        self.seen[phase] = (done, total)
        now = time.monotonic()
        if done == total or now - self.last_print >= QUIET_S:
            self.last_print = now
            print(
                f"{phase} {done}/{total} ({now - self.start:.1f} s)", file=self.stream, flush=True
            )


def in_notebook_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def auto_progress():
    """A widget in a notebook kernel, text anywhere else."""
    if in_notebook_kernel():
        from dtlab.views.widgets import WidgetProgress

        return WidgetProgress()
    return TextProgress()


class DelayedProgress:
    """Shows nothing for short work; after ``after_s`` hands over to ``auto_progress``."""

    def __init__(self, after_s: float = 1.0):
        self.start = time.monotonic()
        self.after_s = after_s
        self.reporter = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.reporter is None:
            if time.monotonic() - self.start < self.after_s:
                return
            self.reporter = auto_progress()
        self.reporter(phase, done, total)


def delayed_progress(after_s: float = 1.0) -> DelayedProgress:
    return DelayedProgress(after_s)
