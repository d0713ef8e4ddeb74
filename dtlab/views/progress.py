"""Progress of long steps (engines registering, ranks joining) as text or as a widget.

A reporter is a callable ``(phase, done, total)``; control/ calls it, views decide the face.
``total`` 0 means open-ended (a run until a condition): the reporter shows what was done
and its rate, never a bar with a made-up end.
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
                f"{phase} {describe(done, total, now - self.start)}", file=self.stream, flush=True
            )


def describe(done: int, total: int, seconds: float) -> str:
    """``5/10 (1.2 s)``, or for an open-ended phase ``15 so far, 12.3/s (1.2 s)``."""
    if total > 0:
        return f"{done}/{total} ({seconds:.1f} s)"
    rate = f", {done / seconds:.1f}/s" if seconds > 0 and done else ""
    return f"{done} so far{rate} ({seconds:.1f} s)"


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


_LIVE: list[WidgetProgress] = []  # shown in the cell that is running; text when it ends
DESCRIPTION_WIDTH = "16em"  # every bar starts at the same x, whatever its phase's name


class WidgetProgress:
    """One labelled progress bar per phase, shown when the first phase starts.

    When the cell that showed it ends (IPython's ``post_run_cell``), the widgets are closed
    and their output is replaced by plain text: what ran and how far it got, and "cut
    off" with the error when the cell failed or was interrupted. A saved notebook then
    holds text, never a widget whose model is gone after a kernel restart ("Error
    displaying widget: model not found").
    """

    def __init__(self):
        import ipywidgets as widgets  # only in a notebook kernel: launches elsewhere skip it

        self.widgets = widgets
        self.start = time.monotonic()
        self.rows: dict[str, tuple] = {}
        self.box = widgets.VBox()
        self.handle = None  # the output showing the box, once shown
        self.finished = False

    @property
    def shown(self) -> bool:
        return self.handle is not None

    def __call__(self, phase: str, done: int, total: int) -> None:
        from IPython.display import display

        widgets = self.widgets
        if self.finished:
            return
        if phase not in self.rows:
            bar = widgets.IntProgress(
                min=0,
                max=max(total, 1),
                description=phase,
                style={"description_width": DESCRIPTION_WIDTH},
            )
            label = widgets.Label()
            self.rows[phase] = (bar, label)
            self.box.children = (*self.box.children, widgets.HBox([bar, label]))
        if not self.shown:
            self.handle = display(self.box, display_id=True)
            _finish_when_the_cell_ends(self)
        bar, label = self.rows[phase]
        bar.layout.display = None if total > 0 else "none"  # no end known: no bar
        bar.max = max(total, 1)
        bar.value = done
        bar.bar_style = "success" if done == total else ""
        label.value = (phase + ": " if total <= 0 else "") + describe(
            done, total, time.monotonic() - self.start
        )

    def text(self, error: BaseException | None = None) -> str:
        """What the bars said, as lines (``launch: 8/8 (3.1 s)``), and how the cell ended."""
        lines = []
        for phase, (_bar, label) in self.rows.items():
            said = label.value.removeprefix(phase + ": ")
            lines.append(f"{phase}: {said}")
        if error is not None:
            why = f"{type(error).__name__}: {error}".splitlines()[0].rstrip(": ")
            lines.append(f"cut off ({why})")
        return "\n".join(lines)

    def finish(self, error: BaseException | None = None) -> None:
        """Replace the bars by their text and close the widgets (their models go)."""
        if self.finished:
            return
        self.finished = True
        if self.handle is not None:
            self.handle.update({"text/plain": self.text(error)}, raw=True)
        for bar, label in self.rows.values():
            bar.close()
            label.close()
        for row in self.box.children:
            row.close()
        self.box.close()


def _finish_when_the_cell_ends(progress: WidgetProgress) -> None:
    from IPython import get_ipython

    _LIVE.append(progress)
    shell = get_ipython()
    if shell is not None and _finish_live not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", _finish_live)


def _finish_live(result=None) -> None:
    """IPython's post_run_cell: every bar the cell showed becomes its text."""
    error = getattr(result, "error_in_exec", None) if result is not None else None
    while _LIVE:
        _LIVE.pop().finish(error)
