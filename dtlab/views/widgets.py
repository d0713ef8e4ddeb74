"""ipywidgets faces. The only module that builds widgets."""

from __future__ import annotations

import time

import ipywidgets as widgets
from IPython.display import display


class WidgetProgress:
    """One labelled progress bar per phase, shown when the first phase starts."""

    def __init__(self):
        self.start = time.monotonic()
        self.rows: dict[str, tuple[widgets.IntProgress, widgets.Label]] = {}
        self.box = widgets.VBox()
        self.shown = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.rows:
            bar = widgets.IntProgress(
                min=0, max=max(total, 1), description=phase, style={"description_width": "initial"}
            )
            label = widgets.Label()
            self.rows[phase] = (bar, label)
            self.box.children = (*self.box.children, widgets.HBox([bar, label]))
        if not self.shown:
            display(self.box)
            self.shown = True
        bar, label = self.rows[phase]
        bar.max = max(total, 1)
        bar.value = done
        bar.bar_style = "success" if done == total else ""
        label.value = f"{done}/{total}  ({time.monotonic() - self.start:.1f} s)"
